"""SmolLM2-135M-Instruct's decode throughput against the batch size on this machine, one BLAS
thread (notebook 21): one batched_decode_step for B sequences against B decode steps one at a
time, the step's matrix products alone, and the roofline's prediction; and one weight matrix
of the model multiplied by 1 to 16 rows on its own, which shows what the CPU's BLAS does with
a few rows.

    python benchmarks/smollm2_batching.py            # about a minute; writes the JSON below
    python benchmarks/smollm2_batching.py --quick    # B = 1, 2; a few seconds; writes nothing
    python benchmarks/smollm2_batching.py --output results.json   # somewhere else

The model: kvlib.load_smollm2() (`make smollm2` first), float32 weights memory-mapped. Every
sequence of a batch holds the same cache: one chat request of notebook 24's workload (its
system message and first question, through the chat template) prefilled once and copied, so
that each batch size decodes at the same position. Each repeat times every batch size in turn
(batched, one at a time, products alone), every cache put back after each step, so that load
from other programs falls on all of them; the JSON keeps every repeat's seconds and the
notebook takes their medians.

1. The batch: batch_sizes (default 1 2 4 8 16). "batched" is one
   kvlib.serving.batch.batched_decode_step for the B sequences, "one at a time" is
   batch.decode_each_alone (kvlib.decode_step per sequence), "products" the step's matrix
   products alone (the 210 block matrices and the unembedding, X (B, 576) @ each, as kvlib
   holds them; no norms, rotation, attention or cache). "predicted" is the roofline's time,
   roofline.batched_step_seconds, from the read bandwidth and matrix-product rate measured before
   and after the timings (the faster reading of each: the roofline is a bound).
2. The skinny products: X (rows, 576) @ W (576, 1536), the shape of SmolLM2's gate and up
   projections, for rows 1 to 16, with W as kvlib holds it (the file's (1536, 576) matrix,
   transposed: a column-major view) and as a contiguous (row-major) copy; the median of many
   calls each. numpy hands one row to BLAS's matrix-vector routine (gemv) and two or more to
   its matrix-matrix routine (gemm).

The machine, the BLAS, its threads and the load average before and after go into the JSON
(benchmarks/data/smollm2_batching.json by default), with the command that remakes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "benchmarks" / "data" / "smollm2_batching.json"
COMMAND = "python benchmarks/smollm2_batching.py"
SKINNY_SHAPE = (576, 1536)
"""X (rows, 576) @ W (576, 1536): SmolLM2's gate and up projections."""


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="B = 1, 2, one repeat, rows 1 and 2; writes no JSON unless "
                             "--output is given")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batch sizes (default 1 2 4 8 16; quick 1 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repeats of the batch timings (default 5, quick 1)")
    parser.add_argument("--rows", type=int, default=None,
                        help="the skinny products from 1 to this many rows (default 16, "
                             "quick 2)")
    parser.add_argument("--calls", type=int, default=None,
                        help="calls of each skinny product, the median kept (default 200, "
                             "quick 10)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="array read to measure bandwidth (default 256 MiB)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"where the JSON goes (default {OUTPUT.relative_to(ROOT)}; "
                             "quick: none)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args(argv)
    args.batch_sizes = sorted(set(args.batch_sizes or ([1, 2] if args.quick else
                                                       [1, 2, 4, 8, 16])))
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.rows is None:
        args.rows = 2 if args.quick else 16
    if args.calls is None:
        args.calls = 10 if args.quick else 200
    if args.output is None and not args.quick:
        args.output = OUTPUT
    for name in ("repeats", "rows", "calls", "bandwidth_mib", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be at least 1")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy loads
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import roofline  # noqa: E402
from kvlib.serving import batch, workloads  # noqa: E402


def copies(config, cache, n: int) -> list:
    """n caches holding what `cache` holds (the timings do not depend on the contents)."""
    made = []
    for _ in range(n):
        copy = kvlib.KVCache(config, capacity=len(cache) + 4)
        for layer in range(config.n_layers):
            copy.append(layer, cache.keys(layer), cache.values(layer))
        made.append(copy)
    return made


def products_alone(params, rows: int):
    """The matrix products of a decode step for `rows` rows, nothing around them."""
    X = np.ones((rows, params.config.d_model), dtype=params.config.numpy_dtype)
    H = np.ones((rows, params.config.d_ff), dtype=params.config.numpy_dtype)

    def step(*_):
        for layer in params.layers:
            X @ layer.Wq, X @ layer.Wk, X @ layer.Wv, X @ layer.Wo
            X @ layer.W_gate, X @ layer.W_up, H @ layer.W_down
        X @ params.embedding.T

    return step


def time_batches(params, prompt, args) -> dict:
    """Every repeat's seconds of each way at each batch size, measured in turns."""
    config = params.config
    _, cache = kvlib.prefill(params, prompt, last_only=True)
    caches = copies(config, cache, max(args.batch_sizes))
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size,
                                                                 len(caches))]
    ways = {"batched": lambda B: batch.batched_decode_step,
            "one_at_a_time": lambda B: batch.decode_each_alone,
            "products": lambda B: products_alone(params, B)}
    for way in ways.values():                                # warm-up, not kept
        report.run_once(way(1), params, tokens[:1], caches[:1])
    seconds = {name: {B: [] for B in args.batch_sizes} for name in ways}
    for _ in range(args.repeats):
        for B in args.batch_sizes:
            for name, way in ways.items():
                seconds[name][B].append(
                    report.run_once(way(B), params, tokens[:B], caches[:B]))
    assert all(len(c) == len(prompt) for c in caches), "a step was not undone"
    return seconds


def time_skinny(args) -> dict:
    """Median seconds of X (rows, 576) @ W (576, 1536) for rows 1..args.rows, W as kvlib
    holds SmolLM2's (a transposed view of the file's row-major (1536, 576)) and as a
    contiguous copy; the rows take turns, round after round."""
    rng = np.random.default_rng(0)
    inner, outer = SKINNY_SHAPE
    held = rng.standard_normal((outer, inner)).astype(np.float32).T      # column-major view
    layouts = {"as_held": held, "contiguous": np.ascontiguousarray(held)}
    rows = list(range(1, args.rows + 1))
    inputs = {n: rng.standard_normal((n, inner)).astype(np.float32) for n in rows}
    seconds = {name: {n: [] for n in rows} for name in layouts}
    rounds = 10 if args.calls >= 10 else 1
    for _ in range(rounds):
        for n in rows:
            for name, W in layouts.items():
                X = inputs[n]
                X @ W                                                    # warm
                for _ in range(max(1, args.calls // rounds)):
                    started = time.perf_counter()
                    X @ W
                    seconds[name][n].append(time.perf_counter() - started)
    return {"shape": list(SKINNY_SHAPE), "rows": rows, "calls": args.calls,
            **{f"seconds_{name}": [float(np.median(seconds[name][n])) for n in rows]
               for name in layouts}}


def main(args) -> None:
    started = time.perf_counter()
    load_before = report.load_average()
    params = kvlib.load_smollm2()
    tokenizer = kvlib.smollm2_tokenizer()
    prompt = workloads.chat_prompts(tokenizer)[0]
    config = params.config
    print("# SmolLM2-135M-Instruct: decode throughput against the batch size")
    print()
    print(report.machine_lines())
    print(f"mode: {'quick' if args.quick else 'full'}; {args.repeats} interleaved repeat(s); "
          f"every sequence with {len(prompt)} tokens cached (a chat request of notebook 24)")
    sys.stdout.flush()

    bandwidths, rates = [], []

    def read_the_machine():
        bandwidths.append(roofline.measure_read_bandwidth(args.bandwidth_mib * roofline.MiB,
                                                          repeats=5))
        rates.append(roofline.measure_matmul_rate(1024, repeats=3))

    read_the_machine()
    seconds = time_batches(params, prompt, args)
    skinny = time_skinny(args)
    read_the_machine()
    bandwidth, rate = max(bandwidths), max(rates)
    load_after = report.load_average()
    positions = len(prompt)
    rows = []
    for B in args.batch_sizes:
        predicted = roofline.batched_step_seconds(config, [positions] * B, rate, bandwidth)
        rows.append({"batch_size": B, "predicted_seconds": predicted,
                     **{f"{name}_seconds": seconds[name][B] for name in seconds}})
    crossover = roofline.compute_bound_batch_size(config, positions, rate, bandwidth)

    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, matrix products {rate / 1e9:.1f} "
          f"GFLOP/s (the faster of two readings each), ridge {rate / bandwidth:.1f} FLOPs "
          f"per byte; the roofline calls a step compute-bound from B = {crossover}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    print()
    print("## One decode step for B sequences: tokens per second (medians)")
    print()
    table = []
    one = float(np.median(seconds["batched"][min(args.batch_sizes)])) / min(args.batch_sizes)
    for row in rows:
        B = row["batch_size"]
        medians = {name: float(np.median(row[f"{name}_seconds"])) for name in seconds}
        table.append([B, f"{B / medians['one_at_a_time']:.1f}",
                      f"{B / medians['batched']:.1f}", f"{B / medians['products']:.1f}",
                      f"{B / row['predicted_seconds']:.1f}",
                      f"{medians['batched'] * 1e3:.1f}",
                      f"{medians['batched'] / one:.2f}x"])
    print(report.table(["batch", "one at a time tok/s", "batched tok/s",
                        "products alone tok/s", "roofline tok/s", "batched step ms",
                        "step / B = 1 step"], table))
    print()
    print(f"## X (rows, {SKINNY_SHAPE[0]}) @ W {SKINNY_SHAPE}: medians of {args.calls} calls")
    print()
    first = skinny["seconds_as_held"][0]
    table = [[n, f"{held * 1e6:.0f}", f"{contiguous * 1e6:.0f}", f"{held / first:.2f}x",
              f"{held / (n * first):.2f}"]
             for n, held, contiguous in zip(skinny["rows"], skinny["seconds_as_held"],
                                            skinny["seconds_contiguous"])]
    print(report.table(["rows", "as held us", "contiguous us", "time / 1 row",
                        "time / (rows x 1 row)"], table))
    result = {
        "command": COMMAND + (" --quick" if args.quick else ""),
        "model": "SmolLM2-135M-Instruct, float32 (kvlib.load_smollm2)",
        "cached_tokens": positions,
        "repeats": args.repeats,
        "machine": report.machine(),
        "load_average": {"before": load_before, "after": load_after},
        "bandwidth": bandwidth,
        "matmul_rate": rate,
        "compute_bound_from": crossover,
        "batches": rows,
        "skinny_products": skinny,
    }
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print()
        print(f"written: {args.output}")
    print()
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
