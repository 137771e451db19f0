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
- the BLAS library and the number of threads it really uses (one by default);
- the decode step against its bare matrix-vector products on the same weights, part by
  part, as kvlib holds the weights and in the fastest layout (the tied unembedding as
  X @ table.T on the (V, d) table against a contiguous (d, V) copy; Q, K, V as three
  products or one (d, 3d) product), the model code's overhead over the fastest, and the
  decode step with the table stored column-major (one array serves both uses).

--architecture toy (the default) is the toy's architecture at these shapes (no positions,
norms or biases); --architecture gpt2 is GPT-2's own (kvlib.gpt2.GPT2_124M: learned
positions, pre-LN layer norms, biases), random weights; --checkpoint DIR loads a GPT-2
checkpoint folder instead (kvlib.gpt2.load; the real GPT-2 124M after `make gpt2`).

    python benchmarks/decode.py            # full run: several minutes (the no-cache baseline)
    python benchmarks/decode.py --quick    # under a minute: the no-cache baseline estimated
    python benchmarks/decode.py --architecture gpt2          # GPT-2's architecture, 124M shapes
    python benchmarks/decode.py --help     # sizes, lengths, threads, --profile

The 64- and 256-token figures are the first 64 and 256 tokens of the 512-token run: greedy
generation is deterministic, so a shorter run does exactly the same first passes.
"""

from __future__ import annotations

import argparse
import sys
import time

import report  # benchmarks/report.py: threads, machine lines, tables

GPT2_CONTEXT = 1024  # GPT-2's learned position table has 1024 rows


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokens per second with and without the KV cache, on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="estimate the no-cache baseline from forwards timed at a few "
                             "lengths instead of running it in full (under a minute)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512],
                        help="numbers of new tokens to report (default: 64 256 512)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--architecture", choices=("toy", "gpt2"), default="toy",
                        help="toy: the series' architecture at these shapes (default); gpt2: "
                             "GPT-2's (learned positions, layer norms, biases)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="load the weights of a GPT-2 checkpoint folder (config.json + "
                             "model.safetensors) instead of random ones; sizes from its config")
    report.add_model_shape_options(parser)
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
    if args.checkpoint is not None:
        args.architecture = "gpt2"
    if args.architecture == "gpt2" and args.checkpoint is None and \
            args.prompt + max(args.lengths) > GPT2_CONTEXT:
        parser.error(f"GPT-2 has {GPT2_CONTEXT} positions: --prompt + the longest of --lengths "
                     f"must fit, got {args.prompt} + {max(args.lengths)}")
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.lengths = sorted(set(args.lengths))
    args.append_lengths = sorted(set(args.append_lengths))
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy is imported

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import gpt2, roofline  # noqa: E402

PARTS = ("Q, K, V projections", "attention over the cache", "output projection",
         "MLP up and down", "unembedding")


def _fastest(candidates: dict, repeats: int) -> tuple[str, float]:
    """(name, seconds) of the fastest of several ways to do the same products, each the best
    of `repeats` runs after a warm-up run."""
    best = {}
    for name, run in candidates.items():
        run()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        best[name] = min(seconds)
    name = min(best, key=best.get)
    return name, best[name]


def bare_products(params, cache_length: int, layouts: dict | None = None,
                  repeats: int = 10) -> dict[str, tuple[str, float]]:
    """Seconds of each part of one decode step's matrix products alone, on the same weights
    with no model code around them (no biases, norms, softmax or GeLU): {part: (layout,
    seconds)}, summed over the layers. The attention products run against a cache of
    cache_length positions, on views split into heads as kvlib's are.

    layouts None: the weights as kvlib holds them (Wq, Wk, Wv as they are, views of c_attn
    for a loaded checkpoint; the unembedding as x @ table.T on the (V, d) table). Otherwise
    the dict of contiguous copies made by fast_layouts(), and each part keeps the faster of
    its layouts: what BLAS itself reaches on these shapes, the real floor of the step.
    """
    config = params.config
    dtype, d, heads = config.numpy_dtype, config.d_model, config.n_heads
    x = np.ones((1, d), dtype=dtype)
    rng = np.random.default_rng(0)
    K = [kvlib.split_heads(rng.standard_normal((cache_length, config.kv_width)).astype(dtype),
                           config.kv_heads) for _ in params.layers]
    V = [k.copy() for k in K]
    q = kvlib.split_heads(x, heads)
    w = np.full((heads, 1, cache_length), 1.0 / cache_length, dtype=dtype)
    hidden = np.ones((1, config.d_ff), dtype=dtype)
    layers = params.layers

    def as_held_qkv():
        for layer in layers:
            x @ layer.Wq, x @ layer.Wk, x @ layer.Wv

    candidates = {
        "Q, K, V projections": {"as held": as_held_qkv},
        "attention over the cache": {"split heads": lambda: [
            (q @ k.swapaxes(-1, -2), w @ v) for k, v in zip(K, V)]},
        "output projection": {"(d, d)": lambda: [x @ layer.Wo for layer in layers]},
        "MLP up and down": {"(d, f), (f, d)": lambda: [
            (x @ layer.W_up, hidden @ layer.W_down) for layer in layers]},
        "unembedding": {"x @ table.T, (V, d)": lambda: x @ params.embedding.T},
    }
    if layouts is not None:
        candidates["Q, K, V projections"] = {
            "three contiguous (d, d)": lambda: [(x @ a, x @ b, x @ c)
                                               for a, b, c in layouts["separate"]],
            "one contiguous (d, 3d)": lambda: [x @ fused for fused in layouts["fused"]],
        }
        candidates["unembedding"]["x @ (d, V) copy"] = lambda: x @ layouts["table_columns"]
    return {part: _fastest(candidates[part], repeats) for part in PARTS}


def fast_layouts(params) -> dict:
    """Contiguous copies of the weights in the layouts bare_products(..., layouts) tries."""
    return {
        "separate": [tuple(np.ascontiguousarray(w) for w in (layer.Wq, layer.Wk, layer.Wv))
                     for layer in params.layers],
        "fused": [np.ascontiguousarray(np.hstack([layer.Wq, layer.Wk, layer.Wv]))
                  for layer in params.layers],
        "table_columns": np.ascontiguousarray(params.embedding.T),
    }


def bare_step(params, cache_length: int, layouts: dict, fastest: dict):
    """One decode step's matrix products alone, each part in the layout `fastest` chose for
    it (bare_products): a function to time against kvlib.decode_step."""
    config = params.config
    dtype, d = config.numpy_dtype, config.d_model
    x = np.ones((1, d), dtype=dtype)
    rng = np.random.default_rng(0)
    K = [kvlib.split_heads(rng.standard_normal((cache_length, config.kv_width)).astype(dtype),
                           config.kv_heads) for _ in params.layers]
    q = kvlib.split_heads(x, config.n_heads)
    w = np.full((config.n_heads, 1, cache_length), 1.0 / cache_length, dtype=dtype)
    hidden = np.ones((1, config.d_ff), dtype=dtype)
    fused = fastest["Q, K, V projections"][0] == "one contiguous (d, 3d)"
    table = layouts["table_columns"] if fastest["unembedding"][0] == "x @ (d, V) copy" \
        else params.embedding.T

    def run():
        for index, layer in enumerate(params.layers):
            if fused:
                x @ layouts["fused"][index]
            else:
                for weight in layouts["separate"][index]:
                    x @ weight
            q @ K[index].swapaxes(-1, -2), w @ K[index]
            x @ layer.Wo, x @ layer.W_up, hidden @ layer.W_down
        x @ table

    return run


def interleaved_step_times(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn, one call of each per round, so that
    what else the machine does at a moment weighs on all of them alike."""
    seconds = {name: [] for name in runs}
    for run in runs.values():
        run()   # warm-up
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in seconds.items()}


def decode_at(params, sequence, cache_length: int):
    """A function that runs one kvlib.decode_step on a cache holding sequence[:cache_length],
    then truncates the cache back, so that every call does the same work."""
    cache = kvlib.KVCache(params.config, capacity=cache_length + 1)
    kvlib.prefill(params, sequence[:cache_length], cache, last_only=True)
    token = sequence[cache_length]

    def run():
        kvlib.decode_step(params, token, cache)
        cache.truncate(cache_length)

    return run


def with_column_major_table(params):
    """The same weights with the lookup table stored column-major (np.asfortranarray): still
    a (V, d) array, so the lookup picks its rows, but table.T is then a contiguous (d, V)
    array and the unembedding x @ table.T runs in BLAS's fast order. One array of the same
    154 MB at GPT-2's size, not a second copy."""
    return dataclasses.replace(params, embedding=np.asfortranarray(params.embedding))


def decode_bytes(config, prompt_length: int, new_tokens: int) -> np.ndarray:
    """Bytes each pass reads (kvlib.roofline.generation_step_bytes), less the rows of a learned
    position table that a decode step does not read: it reads one row, not all of them."""
    passes = roofline.generation_step_bytes(config, prompt_length, new_tokens)
    if config.positions == "learned":
        unread = (config.context_length - 1) * config.d_model * config.numpy_dtype.itemsize
        passes = passes - unread
    return passes


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


def make_model(args, prompt_length: int, new_tokens: int):
    """(params, what they are) for the options: random weights of the toy's or GPT-2's
    architecture at the given sizes, or a GPT-2 checkpoint folder."""
    if args.checkpoint is not None:
        params = gpt2.load(args.checkpoint)
        context = params.config.context_length
        if prompt_length + new_tokens > context:
            sys.exit(f"the checkpoint's model has {context} positions: --prompt + the longest "
                     f"of --lengths ({prompt_length} + {new_tokens}) must fit")
        return params, f"GPT-2 architecture, weights of {args.checkpoint}"
    d_ff = 4 * args.d_model if args.d_ff is None else args.d_ff
    sizes = dict(vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                 n_layers=args.layers, d_ff=d_ff)
    if args.architecture == "gpt2":
        config = gpt2.GPT2_124M.replace(**sizes, context_length=GPT2_CONTEXT)
        what = "GPT-2 architecture (learned positions, layer norms, biases), random weights"
    else:
        config = kvlib.ModelConfig(**sizes, context_length=prompt_length + new_tokens,
                                   dtype="float32")
        what = "the toy's architecture (no positions, norms or biases), random weights"
    return kvlib.init_params(config, seed=0), what


def main(args) -> None:
    started = time.perf_counter()
    N, P = max(args.lengths), args.prompt
    params, what = make_model(args, P, N)
    config = params.config
    print("# Decode speed on this machine")
    print()
    print(f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
          f"d_ff {config.d_ff}, vocabulary {config.vocab_size}, {config.dtype}; {what}; "
          f"prompt {P} tokens")
    print(report.machine_lines())
    print(f"mode: {'quick (the no-cache baseline is estimated)' if args.quick else 'full'}")
    print()

    def read_bandwidth():
        return roofline.measure_read_bandwidth(args.bandwidth_mib * roofline.MiB, repeats=7)

    bandwidth_before = read_bandwidth()
    compute_rate = roofline.measure_matmul_rate(min(1024, 4 * args.d_model), repeats=3)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=P).tolist()

    # -- with the cache: preallocated, then concatenating -------------------------------
    roofline.time_cached_generation(params, prompt, min(N, 8))  # warm-up, not reported
    step_cache = P + N // 2   # the cache length of the median decode step
    layouts = fast_layouts(params)
    bare_before = bare_products(params, step_cache), bare_products(params, step_cache, layouts)
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
        step_bytes = decode_bytes(config, P, n)[1:].sum()
        decode_time = cached[1:n].sum()
        floor_fraction = (step_bytes / bandwidth) / decode_time if n > 1 else float("nan")
        rows.append([
            n, f"{n / time_with:.1f}", f"{n / time_without:.2f}" + ("*" if args.quick else ""),
            f"{time_without / time_with:.1f}x", f"{flops_without / flops_with:.1f}x",
            f"{predicted_without / predicted_with:.1f}x", f"{floor_fraction:.2f}",
            f"{n / concatenating[:n].sum():.1f}",
        ])
    print()
    print("## Generation, tokens per second")
    print()
    print(report.table(["new tokens", "cached tok/s", "no-cache tok/s", "time ratio", "FLOP ratio",
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
    as_held, fastest = (
        {part: min(before[part], again[part], key=lambda pair: pair[1]) for part in PARTS}
        for before, again in zip(bare_before, (bare_products(params, step_cache),
                                               bare_products(params, step_cache, layouts))))
    held_total = sum(seconds for _, seconds in as_held.values())
    fastest_total = sum(seconds for _, seconds in fastest.values())
    weights = roofline.weights_bytes(config)
    step_bytes = decode_bytes(config, P, N)[N // 2]   # the bytes of the median step
    print(f"- one cached decode step: {decode_step_time * 1e3:.2f} ms (median) for "
          f"{weights / 1e6:.1f} MB of weights plus the cache; the matrix-vector products "
          f"alone, on the same weights without the model code around them: "
          f"{held_total * 1e3:.2f} ms as kvlib holds the weights, {fastest_total * 1e3:.2f} "
          f"ms in the fastest layout, {step_bytes / bandwidth / fastest_total:.2f} of their "
          "floor")
    sys.stdout.flush()

    # -- the decode step against its bare products, and the table's layout -----------------
    column_major = with_column_major_table(params)
    column_ids, column_times = roofline.time_cached_generation(
        column_major, prompt, N, repeats=1 if args.quick else args.repeats)
    if column_ids != new_ids:
        raise RuntimeError("the column-major table generated other tokens: a bug")
    steps = interleaved_step_times({
        "kvlib": decode_at(params, sequence, step_cache),
        "column-major": decode_at(column_major, sequence, step_cache),
        "bare": bare_step(params, step_cache, layouts, fastest),
    }, repeats=10 if args.quick else 30)
    rows = [[part, f"{as_held[part][1] * 1e3:.3f}", f"{fastest[part][1] * 1e3:.3f}",
             fastest[part][0]] for part in PARTS]
    rows.append(["all products", f"{held_total * 1e3:.3f}", f"{fastest_total * 1e3:.3f}", ""])
    for name, label in (("bare", "all products, in turn with the steps"),
                        ("kvlib", "decode step, kvlib"),
                        ("column-major", "decode step, column-major table")):
        overhead = "" if name == "bare" else \
            f"model code: {steps[name] / steps['bare'] - 1:+.0%} over the products"
        rows.append([label, f"{steps[name] * 1e3:.3f}" if name != "bare" else "",
                     f"{steps[name] * 1e3:.3f}" if name == "bare" else "", overhead])
    print()
    print(f"## One decode step against its bare matrix-vector products ({step_cache} cached "
          "positions)")
    print()
    print(report.table(["part", "as kvlib holds it, ms", "fastest layout, ms", "fastest layout"],
                rows))
    table_bytes = params.embedding.nbytes
    print()
    print("- bare products: each part's matrix products alone, best of 10, no biases, norms, "
          "softmax or GeLU; the fastest layout tries contiguous copies (Q, K, V as three "
          "(d, d) products or one (d, 3d); the unembedding on a contiguous (d, V) copy of the "
          "table) and keeps the faster")
    print(f"- model code: a decode step at {step_cache} cached positions and the fastest bare "
          f"products, timed in turn ({10 if args.quick else 30} rounds, medians), the step's "
          "time over the products' less 1 (target: at most +10%)")
    print(f"- the whole generation with the column-major table: {N / column_times.sum():.1f} "
          f"tok/s against {N / cached.sum():.1f}, the same {N} tokens")
    print(f"- the layout trade-off: a contiguous (d, V) copy beside the (V, d) table costs "
          f"{table_bytes / 1e6:.1f} MB more ({table_bytes / weights:.0%} of the weights); "
          "storing the one table column-major costs no more memory, but a checkpoint stores "
          "it row-major, so it is no longer memory-mapped: it is read and transposed at load")
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
    print(report.table(["cached tokens", "preallocated us", "concatenating us", "ratio"], rows))
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
