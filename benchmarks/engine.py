"""The engine of notebook 24 on this machine, one thread: the lesson's chat workload to SmolLM2
served by the engine, by one request at a time, and by static batching (throughput, time to
first token, time per output token, medians in seconds); and the engine's bookkeeping against
the model step it schedules.

    python benchmarks/engine.py              # under a minute
    python benchmarks/engine.py --quick      # one round, about 20 s

1. The workload (kvlib.widgets.the_engine.workload: eight chat requests arriving over six steps,
   a shared system message, one long passage) on three engines: kvlib.serving.Engine (blocks
   of 16, a budget of 64 tokens a step), the same with max_num_seqs=1 (one request at a time),
   and StaticBatchingEngine (four at a time). Rounds alternate the engines; each reports the
   median of its rounds.
2. The bookkeeping: 8 requests decoding together (prompts of the workload, 32 new tokens
   each); each step's time split into the model step (kvlib.serving.engine.forward_step:
   the batched products and each sequence's attention over its blocks) and everything else
   (scheduling, block accounting, the prefix cache, sampling, the step's checkpoint). The
   issue's bar: the Python around the model at most 10% of a step at batch 8.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, 1 quick)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args(argv)
    args.rounds = (1 if args.quick else 3) if args.rounds is None else args.rounds
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib.serving import (  # noqa: E402
    Engine,
    SamplingParams,
    StaticBatchingEngine,
    workloads,  # noqa: E402
)
from kvlib.serving import engine as engine_module  # noqa: E402


def engines(params) -> dict:
    common = {"block_size": 16, "n_blocks": 48}
    return {
        "the engine (continuous batching)": lambda: Engine(params, max_num_batched_tokens=64,
                                                           **common),
        "one request at a time": lambda: Engine(params, max_num_batched_tokens=64,
                                                max_num_seqs=1, **common),
        "static batching, 4 at a time": lambda: StaticBatchingEngine(
            params, max_num_batched_tokens=256, max_num_seqs=4, **common),
    }


def bookkeeping(params, prompts, steps: int) -> tuple[float, float]:
    """(median seconds of a whole step, median seconds of its model step) with 8 requests
    decoding together."""
    model_seconds = []
    timed_forward = engine_module.forward_step

    def forward(*args):
        started = time.perf_counter()
        result = timed_forward(*args)
        model_seconds.append(time.perf_counter() - started)
        return result

    engine = Engine(params, block_size=16, n_blocks=64, max_num_batched_tokens=512)
    for prompt in prompts[:8]:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2))
    engine.step()                                     # every prefill in one step
    engine_module.forward_step = forward
    try:
        step_seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - started)
    finally:
        engine_module.forward_step = timed_forward
    return float(np.median(step_seconds)), float(np.median(model_seconds))


def main() -> None:
    params = kvlib.load_smollm2()
    requests = workloads.workload(kvlib.smollm2_tokenizer())
    makers = engines(params)
    results = {name: [] for name in makers}
    for _ in range(ARGS.rounds):
        for name, make in makers.items():
            results[name].append(workloads.run_variant(make(), requests))
    print(report.machine_lines())
    print(f"notebook 24's workload: 8 chat requests to SmolLM2-135M-Instruct (float32), "
          f"{ARGS.rounds} round(s), medians\n")
    rows = []
    for name, runs in results.items():
        def median(key, runs=runs):
            return float(np.median([run[key] for run in runs]))
        rows.append((name, f"{median('tokens_per_second'):.1f}",
                     f"{median('ttft_seconds') * 1000:.0f} ms",
                     f"{median('tpot_seconds') * 1000:.0f} ms", f"{median('steps'):.0f}"))
    print(report.table(("engine", "output tokens/s", "TTFT", "TPOT", "steps"), rows))
    step, model = bookkeeping(params, [prompt for _, prompt, _ in requests],
                              8 if ARGS.quick else 24)
    print(f"\nbatch 8, decoding: a step {step * 1000:.1f} ms, its model step "
          f"{model * 1000:.1f} ms; the bookkeeping around it {(step - model) * 1000:.1f} ms, "
          f"{(step - model) / step:.1%} of the step")


if __name__ == "__main__":
    main()
