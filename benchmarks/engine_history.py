"""Does an engine step cost more after the engine has served many requests? (the_engine)

A tiny model (no positions, d_model 8, 2 layers) keeps kvlib.serving.Engine busy with a
stream of short requests, one arriving every step (prompts of 3 to 8 tokens, 4 new tokens
each), until 2,000 have been served. The median time of steps 10 to 29 is compared with the
median of the 20 steps right after the 2,000th request finished, while the stream still
runs: the same work, a long history apart. A step's all-or-nothing checkpoint saves the
pool's bookkeeping and the requests it may touch (the running ones, at most max_num_seqs
waiting ones), never the finished ones, so the ratio should stay near 1.

    python benchmarks/engine_history.py              # 2,000 requests, about 10 s
    python benchmarks/engine_history.py --quick      # 200 requests
    python benchmarks/engine_history.py --requests 5000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 20
EARLY = 10


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 requests")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests to serve before the late window (default 2000)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args(argv)
    args.requests = (200 if args.quick else 2000) if args.requests is None else args.requests
    if args.requests < EARLY + WINDOW or args.threads < 1:
        parser.error(f"--requests must be at least {EARLY + WINDOW}, --threads at least 1")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib.serving import Engine, SamplingParams  # noqa: E402


def timed_steps(n_requests: int, seed: int = 0):
    """Step an engine fed one request a step -> (seconds of steps EARLY .. EARLY + WINDOW - 1,
    seconds of the WINDOW steps after the n_requests-th request finished, requests served
    then, the largest checkpoint seen in each window: requests it saved)."""
    config = kvlib.ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_layers=2, d_ff=16,
                               context_length=32)
    params = kvlib.init_params(config, seed=seed)
    engine = Engine(params, block_size=4, n_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=8)
    rng = np.random.default_rng(seed)
    finished, seconds, saved, late_start = 0, [], [], None
    while late_start is None or len(seconds) < late_start + WINDOW:
        engine.add_request(rng.integers(0, 16, int(rng.integers(3, 9))).tolist(),
                           SamplingParams(max_tokens=4))
        checkpoint = getattr(engine, "_checkpoint", None)
        saved.append(len(checkpoint().requests) if checkpoint else None)
        started = time.perf_counter()
        outputs = engine.step()
        seconds.append(time.perf_counter() - started)
        finished += sum(output.finished for output in outputs)
        if late_start is None and finished >= n_requests:
            late_start = len(seconds)
    early = seconds[EARLY:EARLY + WINDOW]
    late = seconds[late_start:late_start + WINDOW]
    return early, late, finished, max(saved[EARLY:EARLY + WINDOW]), \
        max(saved[late_start:late_start + WINDOW])


def main() -> None:
    early, late, served, saved_early, saved_late = timed_steps(ARGS.requests)
    print(report.machine_lines())
    print(f"a tiny model, one short request arriving a step, served until {ARGS.requests:,} "
          f"had finished ({served:,} by the late window)\n")
    rows = [(f"steps {EARLY}-{EARLY + WINDOW - 1}", f"{np.median(early) * 1e3:.2f} ms",
             str(saved_early)),
            (f"{WINDOW} steps after {ARGS.requests:,} requests",
             f"{np.median(late) * 1e3:.2f} ms", str(saved_late))]
    print(report.table(("steps", "median step", "requests a checkpoint saves"), rows))
    print(f"\nlate / early: {np.median(late) / np.median(early):.2f}x")


if __name__ == "__main__":
    main()
