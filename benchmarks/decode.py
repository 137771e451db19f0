"""Decode speed on this machine: tokens per second with and without the KV cache.

Runs kvlib's own generation loop on a GPT-2-small-sized model (12 layers, d_model 768,
12 heads, vocabulary 50257, float32, random weights) after a 32-token prompt, and prints:

- tokens per second with the cache (one prefill, then decode steps) and without it (an honest
  baseline: a full forward over the whole sequence for every token, unembedding only the last
  row, kvlib.forward(..., last_only=True)), at 64, 256 and 512 new tokens;
- the FLOP ratio of the two next to the measured time ratio, and the ratio a roofline model
  predicts from this machine's measured rates;
- the memory read bandwidth measured in the same run, and the fraction of the bandwidth
  floor (bytes of weights and cache read per token / bandwidth) the cached decode reaches;
- appending one token to a preallocated cache against np.concatenate, for the appends alone,
  at up to 4096 cached tokens; and the same generation with the concatenating cache;
- the BLAS library and the number of threads it really uses (one by default).

    python benchmarks/decode.py            # full run: several minutes (the no-cache baseline)
    python benchmarks/decode.py --quick    # under a minute: the no-cache baseline estimated
    python benchmarks/decode.py --help     # sizes, lengths, threads, --profile

The 64- and 256-token figures are the first 64 and 256 tokens of the 512-token run: greedy
generation is deterministic, so a shorter run does exactly the same first passes.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokens per second with and without the KV cache, on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="estimate the no-cache baseline from forwards timed at a few "
                             "lengths instead of running it in full (under a minute)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512],
                        help="numbers of new tokens to report (default: 64 256 512)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--d-ff", type=int, default=None, help="MLP width (default 4 d_model)")
    parser.add_argument("--append-lengths", type=int, nargs="+", default=[64, 512, 4096],
                        help="cache lengths at which one append is timed (default 64 512 4096)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="size of the array read to measure bandwidth (default 256 MiB)")
    parser.add_argument("--samples", type=int, default=8,
                        help="--quick: lengths at which the no-cache forward is timed")
    parser.add_argument("--repeats", type=int, default=None,
                        help="cached generations run; each pass keeps its fastest time "
                             "(default 3, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS threads, set before numpy is imported (default 1)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile up to 64 cached decode steps by kvlib function")
    args = parser.parse_args(argv)
    positive = {"--prompt": args.prompt, "--layers": args.layers, "--d-model": args.d_model,
                "--heads": args.heads, "--vocab": args.vocab, "--threads": args.threads,
                "--bandwidth-mib": args.bandwidth_mib, "--samples": args.samples}
    positive.update({"--lengths": min(args.lengths),
                     "--append-lengths": min(args.append_lengths)})
    for name, value in positive.items():
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.samples < 2:
        parser.error("--samples must be at least 2 (the first and the last length)")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.lengths = sorted(set(args.lengths))
    args.append_lengths = sorted(set(args.append_lengths))
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    # Must happen before numpy is imported: OpenBLAS reads these once, when it loads.
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(ARGS.threads)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import roofline  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_bare_matrix_products(params, repeats: int = 10) -> float:
    """Seconds per token of the decode step's matrix-vector products alone, on the same
    weights, with no model code around them: what BLAS itself reaches (the fastest)."""
    x = np.ones((1, params.config.d_model), dtype=params.config.numpy_dtype)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for layer in params.layers:
            x @ layer.Wq, x @ layer.Wk, x @ layer.Wv, x @ layer.Wo
            (x @ layer.W_up) @ layer.W_down
        x @ params.embedding.T
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


def profile_decode(params, prompt, steps: int = 64) -> str:
    import cProfile
    import io
    import pstats

    steps = min(steps, params.config.context_length - len(prompt))
    cache = kvlib.KVCache(params.config, capacity=len(prompt) + steps)
    _, cache = kvlib.prefill(params, prompt, cache, last_only=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        kvlib.decode_step(params, 0, cache)
    profiler.disable()
    out = io.StringIO()
    out.write(f"{steps} decode steps; every kvlib function, slowest first (own time):\n")
    # filtered to kvlib's own functions, not cut to the slowest few: which of them come
    # first depends on timing, and the list must always show decode_step
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(r"kvlib[/\\]")
    return out.getvalue()


def table(headers, rows) -> str:
    """A plain-text table whose columns fit their contents (also valid Markdown)."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def main(args) -> None:
    started = time.perf_counter()
    d_ff = 4 * args.d_model if args.d_ff is None else args.d_ff
    N, P = max(args.lengths), args.prompt
    config = kvlib.ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                               n_layers=args.layers, d_ff=d_ff, context_length=P + N,
                               dtype="float32")
    threads = roofline.blas_threads()
    print("# Decode speed on this machine")
    print()
    print(f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
          f"d_ff {config.d_ff}, vocabulary {config.vocab_size}, float32, random weights; "
          f"prompt {P} tokens")
    print(f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} "
          f"{platform.machine()}; Python {platform.python_version()}, numpy {np.__version__}")
    thread_settings = ", ".join(f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARIABLES)
    print(f"BLAS: {roofline.blas_name()}; threads in effect: "
          f"{threads if threads is not None else 'unknown (not OpenBLAS)'} ({thread_settings})")
    print(f"mode: {'quick (the no-cache baseline is estimated)' if args.quick else 'full'}")
    print()

    def read_bandwidth():
        return roofline.measure_read_bandwidth(args.bandwidth_mib * roofline.MiB, repeats=7)

    bandwidth_before = read_bandwidth()
    compute_rate = roofline.measure_matmul_rate(min(1024, 4 * args.d_model), repeats=3)
    params = kvlib.init_params(config, seed=0)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=P).tolist()

    # -- with the cache: preallocated, then concatenating -------------------------------
    roofline.time_cached_generation(params, prompt, min(N, 8))  # warm-up, not reported
    bare_before = time_bare_matrix_products(params)
    new_ids, cached = roofline.time_cached_generation(params, prompt, N, repeats=args.repeats)
    concat_ids, concatenating = roofline.time_cached_generation(
        params, prompt, N, cache=kvlib.ConcatenatingKVCache(config),
        repeats=1 if args.quick else args.repeats)
    # read again after the decode runs; the floor uses the faster reading (the stricter floor)
    bandwidth_after = read_bandwidth()
    bandwidth = max(bandwidth_before, bandwidth_after)
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s (a {args.bandwidth_mib} MiB "
          f"float32 array dotted with itself, best of 7, before and after the decode runs: "
          f"{bandwidth_before / 1e9:.1f} and {bandwidth_after / 1e9:.1f} GB/s)")
    print(f"measured matmul rate: {compute_rate / 1e9:.1f} GFLOP/s (square float32 matrices)")
    print(f"cached runs: {args.repeats} (concatenating: {1 if args.quick else args.repeats}), "
          "each pass keeping its fastest time")
    sys.stdout.flush()
    if concat_ids != new_ids:
        raise RuntimeError("the concatenating cache generated other tokens: a bug in kvlib")

    # -- without the cache: a forward over the sequence so far for every new token. The
    # sequence is the cached run's, so both do the same work on the same tokens.
    sequence = prompt + new_ids
    if args.quick:
        lengths = np.unique(np.linspace(P, P + N - 1, args.samples).round().astype(int))
    else:
        lengths = np.arange(P, P + N)
    timed, chosen = roofline.time_recomputation(params, sequence, lengths.tolist(),
                                                return_tokens=True)
    recomputed = np.interp(np.arange(P, P + N), lengths, timed) if args.quick else timed
    agree = sum(token == sequence[n] for token, n in zip(chosen, lengths))
    checked = len(lengths)

    # -- predictions ---------------------------------------------------------------------
    rows = []
    for n in args.lengths:
        flops_with = kvlib.generation_multiply_adds(config, P, n, use_cache=True).flops
        flops_without = kvlib.generation_multiply_adds(config, P, n, use_cache=False).flops
        predicted_with = roofline.generation_step_times(config, P, n, True, compute_rate,
                                                        bandwidth).sum()
        predicted_without = roofline.generation_step_times(config, P, n, False, compute_rate,
                                                           bandwidth).sum()
        time_with, time_without = cached[:n].sum(), recomputed[:n].sum()
        decode_bytes = roofline.generation_step_bytes(config, P, n)[1:].sum()
        decode_time = cached[1:n].sum()
        floor_fraction = (decode_bytes / bandwidth) / decode_time if n > 1 else float("nan")
        rows.append([
            n, f"{n / time_with:.1f}", f"{n / time_without:.2f}" + ("*" if args.quick else ""),
            f"{time_without / time_with:.1f}x", f"{flops_without / flops_with:.1f}x",
            f"{predicted_without / predicted_with:.1f}x", f"{floor_fraction:.2f}",
            f"{n / concatenating[:n].sum():.1f}",
        ])
    print()
    print("## Generation, tokens per second")
    print()
    print(table(["new tokens", "cached tok/s", "no-cache tok/s", "time ratio", "FLOP ratio",
                 "roofline ratio", "floor fraction", "concatenating tok/s"], rows))
    print()
    print("- time ratio: no-cache time / cached time, both including the prompt's pass; "
          "FLOP ratio: the same for kvlib.generation_multiply_adds; roofline ratio: the same "
          "for roofline time = max(FLOPs / matmul rate, bytes / bandwidth)")
    print("- floor fraction: (bytes of weights and cache read by the decode steps / measured "
          "bandwidth) / measured time of those steps; 1.00 would be reading memory flat out")
    print(f"- shorter runs are the first tokens of the {N}-token run; a full forward chose the "
          f"same greedy token as the cached run in {agree} of {checked} passes checked")
    if args.quick:
        print(f"- * estimated: a no-cache forward was timed at {len(lengths)} lengths "
              f"from {P} to {P + N - 1} tokens and the time of every other length interpolated "
              "between them (run without --quick to time every pass)")
    decode_step_time = float(np.median(cached[1:])) if N > 1 else float("nan")
    bare = min(bare_before, time_bare_matrix_products(params))  # before and after the runs
    weights = roofline.weights_bytes(config)
    print(f"- one cached decode step: {decode_step_time * 1e3:.2f} ms (median) for "
          f"{weights / 1e6:.1f} MB of weights plus the cache; the matrix-vector products "
          f"alone, on the same weights without the model code around them: "
          f"{bare * 1e3:.2f} ms, {weights / bandwidth / bare:.2f} of their floor")
    sys.stdout.flush()

    # -- appends alone -------------------------------------------------------------------
    append_config = dataclasses.replace(config, context_length=max(args.append_lengths) + 8)
    rows = []
    for cached_tokens in args.append_lengths:
        in_place = roofline.time_appends(append_config, kvlib.KVCache, cached_tokens)
        copied = roofline.time_appends(append_config, kvlib.ConcatenatingKVCache, cached_tokens)
        rows.append([cached_tokens, f"{in_place * 1e6:.1f}", f"{copied * 1e6:.1f}",
                     f"{copied / in_place:.0f}x"])
    print()
    print(f"## Appending one token's K and V to all {config.n_layers} layers (appends alone)")
    print()
    print(table(["cached tokens", "preallocated us", "concatenating us", "ratio"], rows))
    print()
    print("- preallocated: kvlib.KVCache writes one row in place; concatenating: "
          "kvlib.ConcatenatingKVCache copies the whole layer cache with np.concatenate")

    if args.profile:
        print()
        print("## Profile of cached decode steps (cProfile, by internal time)")
        print()
        print(profile_decode(params, prompt))
    print()
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
