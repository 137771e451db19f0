"""Batched decoding on this machine: tokens per second against the batch size, beside the
roofline's prediction, and static against continuous batching in seconds (notebook 21).

Runs kvlib.serving on a model of GPT-2 small's shapes and architecture (kvlib.gpt2.GPT2_124M:
12 layers, d_model 768, 12 heads, vocabulary 50257, learned positions, layer norms, biases;
random weights, float32) on one BLAS thread, and prints:

- for each batch size B, the tokens per second of one decode step for B sequences of
  different cache lengths (a ragged batch): kvlib.decode_step once per sequence, one
  batched_decode_step with per-sequence attention, one with padded attention, and the
  matrix products of the step alone (no model code around them); beside them the roofline's
  prediction from this machine's measured bandwidth and matrix-product rate (the weights
  read once per step, each sequence's cache for itself) and whether it calls the step
  memory- or compute-bound;
- the batch size from which the roofline calls a step compute-bound, on this machine and on
  an H100 SXM's datasheet figures (989 TFLOP/s dense BF16, 3.35 TB/s);
- a seeded workload of requests served by static and by continuous batching on a clock of
  seconds (arrivals a number of steps apart, times the measured time of one decode step):
  steps, makespan, throughput, time to first token, time per output token, occupancy;
  and a check that both policies generate the same tokens for every request.

    python benchmarks/batched_decode.py            # full run: a few minutes
    python benchmarks/batched_decode.py --quick    # under a minute: fewer sizes and requests
    python benchmarks/batched_decode.py --help

Every measurement is interleaved: each repeat times every batch size and every variant once,
and each keeps its fastest repeat, so that another process slowing the machine for a while
slows all of them alike.
"""

from __future__ import annotations

import argparse
import sys
import time

import report  # benchmarks/report.py: threads, machine lines, tables

H100 = {"compute_rate": 989e12, "bandwidth": 3.35e12}
"""NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), GPU
memory bandwidth 3.35 TB/s."""


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Batched decode throughput against the batch size, and static against "
                    "continuous batching, on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer batch sizes, one repeat, a smaller workload (under a minute)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batch sizes to time (default 1 2 4 8 16 32 64; quick: 1 4 16)")
    parser.add_argument("--cached", type=int, default=32,
                        help="mean tokens in each sequence's cache; the lengths are spread "
                             "from half to one and a half times it (default 32)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats, each measurement keeping its fastest "
                             "(default 3, quick 1)")
    report.add_model_shape_options(parser)
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in the served workload (default 24, quick 8)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="max sequences in a step when serving (default 8, quick 4)")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=None,
                        help="shortest and longest prompt (default 16 64, quick 8 32)")
    parser.add_argument("--output-lengths", type=int, nargs=2, default=None,
                        help="shortest and longest output (default 8 64, quick 4 24)")
    parser.add_argument("--mean-gap", type=float, default=2.0,
                        help="mean steps between two arrivals (default 2)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="size of the array read to measure bandwidth (default 256 MiB)")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS threads, set before numpy is imported (default 1)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_sizes = sorted(set(args.batch_sizes or ([1, 4, 16] if quick else
                                                       [1, 2, 4, 8, 16, 32, 64])))
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    args.requests = args.requests if args.requests is not None else (8 if quick else 24)
    args.max_batch = args.max_batch if args.max_batch is not None else (4 if quick else 8)
    args.prompt_lengths = args.prompt_lengths or ([8, 32] if quick else [16, 64])
    args.output_lengths = args.output_lengths or ([4, 24] if quick else [8, 64])
    positive = {"--cached": args.cached, "--repeats": args.repeats, "--layers": args.layers,
                "--d-model": args.d_model, "--heads": args.heads, "--vocab": args.vocab,
                "--requests": args.requests, "--max-batch": args.max_batch,
                "--bandwidth-mib": args.bandwidth_mib, "--threads": args.threads,
                "--batch-sizes": min(args.batch_sizes),
                "--prompt-lengths": min(args.prompt_lengths),
                "--output-lengths": min(args.output_lengths)}
    for name, value in positive.items():
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.mean_gap < 0:
        parser.error(f"--mean-gap must be >= 0, got {args.mean_gap}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    for name in ("prompt_lengths", "output_lengths"):
        low, high = getattr(args, name)
        if low > high:
            parser.error(f"--{name.replace('_', '-')} must be shortest then longest")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy is imported

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import roofline  # noqa: E402
from kvlib.gpt2 import GPT2_124M  # noqa: E402
from kvlib.serving import batch, scheduler, workloads  # noqa: E402

# ----------------------------------------------------------------------------- the batch table


def prefix_caches(params, sequence, lengths):
    """One cache per length, each holding the first n positions of one prefilled sequence.

    Because of the causal mask the first n rows of a prefill's K and V are exactly what
    prefilling the first n tokens gives: these are true caches of those prefixes, made
    without running B prefills."""
    config = params.config
    _, full = kvlib.prefill(params, sequence, kvlib.KVCache(config, capacity=len(sequence) + 2))
    caches = []
    for n in lengths:
        cache = kvlib.KVCache(config, capacity=len(sequence) + 2)
        for layer in range(config.n_layers):
            cache.append(layer, full.keys(layer)[:n], full.values(layer)[:n])
        caches.append(cache)
    return caches


def bare_products(params, rows: int):
    """The matrix products of a batched decode step, with nothing around them: what BLAS
    itself reaches for `rows` rows (the model code and the attention left out)."""
    X = np.ones((rows, params.config.d_model), dtype=params.config.numpy_dtype)

    def step(*_):
        for layer in params.layers:
            X @ layer.Wq, X @ layer.Wk, X @ layer.Wv, X @ layer.Wo
            (X @ layer.W_up) @ layer.W_down
        X @ params.embedding.T

    return step


def padded(params, tokens, caches):
    return batch.batched_decode_step(params, tokens, caches, attend=batch.attend_padded)


VARIANTS = {"one at a time": batch.decode_each_alone,
            "batched": batch.batched_decode_step,
            "batched, padded": padded}


def time_batches(params, args, rng):
    """Fastest seconds of every variant at every batch size, measured interleaved."""
    config = params.config
    largest = max(args.batch_sizes)
    low, high = max(1, args.cached // 2), max(1, args.cached + args.cached // 2)
    lengths = rng.integers(low, high + 1, largest).tolist()
    sequence = rng.integers(0, config.vocab_size, high).tolist()
    caches = prefix_caches(params, sequence, lengths)
    tokens = rng.integers(0, config.vocab_size, largest).tolist()
    for step in VARIANTS.values():                         # warm-up, not reported
        report.run_once(step, params, tokens[:2], caches[:2])
    best = {}
    for _ in range(args.repeats):
        for B in args.batch_sizes:
            for name, step in list(VARIANTS.items()) + [("products alone",
                                                         bare_products(params, B))]:
                seconds = report.run_once(step, params, tokens[:B], caches[:B])
                best[name, B] = min(best.get((name, B), np.inf), seconds)
    return best, lengths


def batch_table(config, best, lengths, args, compute_rate, bandwidth):
    rows = []
    for B in args.batch_sizes:
        positions = lengths[:B]
        predicted = roofline.batched_step_seconds(config, positions, compute_rate, bandwidth)
        flops_time = roofline.batched_step_flops(config, positions) / compute_rate
        bound = "compute" if flops_time >= predicted else "memory"
        one = B / best["one at a time", B]
        rows.append([B, f"{np.mean(positions):.1f}", f"{one:.1f}",
                     f"{B / best['batched', B]:.1f}", f"{B / best['batched, padded', B]:.1f}",
                     f"{B / best['products alone', B]:.1f}", f"{B / predicted:.1f}", bound,
                     f"{B / best['batched', B] / one:.2f}x"])
    return report.table(["batch", "mean cached", "one at a time tok/s", "batched tok/s",
                  "padded tok/s", "products alone tok/s", "roofline tok/s", "roofline bound",
                  "batched / one at a time"], rows)


# ----------------------------------------------------------------------------- serving


def serve_table(params, args, seconds_per_step, rng):
    workload = workloads.make_workload(args.requests, seed=0, mean_gap=args.mean_gap,
                                       prompt_lengths=tuple(args.prompt_lengths),
                                       output_lengths=tuple(args.output_lengths))
    requests = workloads.arrivals_in_seconds(workload, seconds_per_step)
    policies = [scheduler.StaticBatching(args.max_batch),
                scheduler.ContinuousBatching(args.max_batch)]
    runs = 1 if args.quick else 2
    summaries, outputs = {p.name: [] for p in policies}, {}
    for _ in range(runs):                                  # interleaved: S, C, S, C
        for policy in policies:
            timeline = scheduler.serve(requests, policy, scheduler.ModelRunner(params),
                                       clock="seconds")
            summaries[policy.name].append(timeline.summary())
            outputs.setdefault(policy.name, {i: r.output_token_ids
                                             for i, r in timeline.requests.items()})
    rows = []
    for name, runs_of_policy in summaries.items():
        mean = {key: float(np.mean([s[key] for s in runs_of_policy]))
                for key in runs_of_policy[0]}
        rows.append([name, f"{mean['steps']:.0f}", f"{mean['makespan']:.2f}",
                     f"{mean['throughput']:.1f}", f"{mean['mean_ttft'] * 1e3:.0f}",
                     f"{mean['max_ttft'] * 1e3:.0f}", f"{mean['mean_tpot'] * 1e3:.1f}",
                     f"{mean['mean_occupancy']:.2f}"])
    same = outputs["static"] == outputs["continuous"]
    steps_only = {p.name: scheduler.serve(workload, p).summary() for p in policies}
    return report.table(["policy", "steps", "makespan s", "tok/s", "mean TTFT ms", "worst TTFT ms",
                  "mean TPOT ms", "slots busy"], rows), same, runs, workload, steps_only


def main(args) -> None:
    started = time.perf_counter()
    d_ff = 4 * args.d_model if args.d_ff is None else args.d_ff
    longest = max(args.prompt_lengths) + max(args.output_lengths)
    context = max(GPT2_124M.context_length, longest, 2 * args.cached + 4)
    config = GPT2_124M.replace(vocab_size=args.vocab, d_model=args.d_model,
                               n_heads=args.heads, n_layers=args.layers, d_ff=d_ff,
                               context_length=context)
    print("# Batched decoding on this machine")
    print()
    print(f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
          f"d_ff {config.d_ff}, vocabulary {config.vocab_size}, GPT-2's architecture, float32, "
          f"random weights ({roofline.weights_bytes(config) / 1e6:.1f} MB)")
    print(report.machine_lines())
    print(f"mode: {'quick' if args.quick else 'full'}; {args.repeats} interleaved repeat(s)")
    print()
    sys.stdout.flush()

    def read_bandwidth():
        return roofline.measure_read_bandwidth(args.bandwidth_mib * roofline.MiB, repeats=7)

    bandwidth_before = read_bandwidth()
    rate_before = roofline.measure_matmul_rate(min(1024, 4 * args.d_model), repeats=3)
    params = kvlib.init_params(config, seed=0)
    rng = np.random.default_rng(0)
    best, lengths = time_batches(params, args, rng)
    bandwidth = max(bandwidth_before, read_bandwidth())
    compute_rate = max(rate_before, roofline.measure_matmul_rate(min(1024, 4 * args.d_model),
                                                                 repeats=3))
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s (a {args.bandwidth_mib} MiB "
          "float32 array dotted with itself, best of 7, before and after the batch runs)")
    print(f"measured matmul rate: {compute_rate / 1e9:.1f} GFLOP/s (square float32 matrices, "
          "before and after)")
    print(f"ridge point: {compute_rate / bandwidth:.1f} FLOPs per byte")
    print()
    print(f"## One decode step for B sequences, about {args.cached} tokens cached each "
          "(ragged), tokens per second")
    print()
    print(batch_table(config, best, lengths, args, compute_rate, bandwidth))
    print()
    print("- one at a time: kvlib.decode_step per sequence; batched: one "
          "batched_decode_step (per-sequence attention); padded: the same with attention over "
          "caches padded on the left; products alone: the step's matrix products with "
          "nothing around them")
    print("- roofline: B / max(FLOPs / matmul rate, (weights + every sequence's cache) / "
          "bandwidth), from the rates above")
    here = roofline.compute_bound_batch_size(config, args.cached, compute_rate, bandwidth)
    print(f"- the roofline calls a step compute-bound from B = {here} on this machine "
          f"(float32, {args.cached} tokens cached each)")
    for cached in (0, args.cached):
        h100 = roofline.compute_bound_batch_size(config, cached, **H100, bytes_per_number=2)
        print(f"- on an H100 SXM (989 TFLOP/s dense BF16, 3.35 TB/s; BF16 weights and cache), "
              f"{cached} tokens cached each: "
              + (f"from B = {h100}" if h100 is not None else "never: each sequence's cache "
                 "takes longer to read than its FLOPs take to compute"))
    sys.stdout.flush()

    one_step = best["batched", 1] if ("batched", 1) in best else \
        best["batched", min(args.batch_sizes)] / min(args.batch_sizes)
    rows, same, runs, workload, steps_only = serve_table(params, args, one_step, rng)
    print()
    print(f"## Serving {args.requests} requests, at most {args.max_batch} in a step, "
          "seconds")
    print()
    print(rows)
    print()
    print(f"- workload: kvlib.serving.workloads.make_workload({args.requests}, seed=0, "
          f"mean_gap={args.mean_gap}), prompts {args.prompt_lengths[0]}-"
          f"{args.prompt_lengths[1]} tokens, outputs {args.output_lengths[0]}-"
          f"{args.output_lengths[1]}; arrivals at their step times {one_step * 1e3:.1f} ms "
          "(one batched step at B = 1)")
    print(f"- {runs} interleaved run(s) of each policy, the figures their mean; TTFT: arrival "
          "to first token; TPOT: between two tokens of a request once the first is out")
    print(f"- in model steps, the same workload: static {steps_only['static']['steps']} steps, "
          f"mean TTFT {steps_only['static']['mean_ttft']:.2f}; continuous "
          f"{steps_only['continuous']['steps']} steps, mean TTFT "
          f"{steps_only['continuous']['mean_ttft']:.2f}")
    print(f"- every request's tokens are the same under both policies: {same}")
    if not same:
        raise RuntimeError("the two policies generated different tokens: a bug in kvlib")
    print()
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
