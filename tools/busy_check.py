"""Run notebooks on a busy machine and check that no cell takes more than 10 s (`make
busy-check`).

A class laptop with a browser and a video call, a Binder pod shared with other users: the
series runs on busy machines. With OpenBLAS's default of one thread per core, four busy
processes beside notebook 22 on a 2-core machine kept it from finishing in 400 s; with one
BLAS thread it took 13 s. This starts BUSY processes that spin, runs each notebook given (by
default the heaviest ones) top to bottom in a kernel that gets the environment `make lab` and
Binder give (one BLAS thread unless the environment says otherwise), times every cell, prints
the slowest, and exits non-zero if a cell took longer than LIMIT seconds.

    python tools/busy_check.py [--busy 4] [--limit 10] [notebooks/NN_name.ipynb ...]

Nothing is written: the notebooks are executed in memory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVIEST = ["notebooks/18_model_of_today.ipynb", "notebooks/22_quantized_cache.ipynb"]
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


def spin() -> None:
    while True:
        pass


def cell_seconds(cell) -> float | None:
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not start or not end:
        return None
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))
            ).total_seconds()


def run(path: Path) -> list[tuple[float, int, str]]:
    import nbformat
    from stepped_client import SteppedClient  # tools/stepped_client.py

    notebook = nbformat.read(path, as_version=4)
    client = SteppedClient(notebook, timeout=600, kernel_name="python3", record_timing=True,
                           resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    timings = []
    for index, cell in enumerate(notebook.cells):
        seconds = cell_seconds(cell) if cell.cell_type == "code" else None
        if seconds is not None:
            timings.append((seconds, index, "".join(cell.source).split("\n")[0][:70]))
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", default=HEAVIEST)
    parser.add_argument("--busy", type=int, default=4, help="spinning processes (default 4)")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds a cell (default 10)")
    args = parser.parse_args()
    workers = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for worker in workers:
        worker.start()
    failed = False
    try:
        print(f"{args.busy} busy processes on {os.cpu_count()} CPUs; OPENBLAS_NUM_THREADS="
              f"{os.environ['OPENBLAS_NUM_THREADS']}; limit {args.limit:g} s a cell")
        for name in args.notebooks:
            path = (ROOT / name).resolve()
            started = time.monotonic()
            timings = sorted(run(path), reverse=True)
            slow = [t for t in timings if t[0] > args.limit]
            failed |= bool(slow)
            print(f"\n{path.name}: {time.monotonic() - started:.1f} s in all, "
                  f"{len(timings)} cells; slowest:")
            for seconds, index, first_line in timings[:5]:
                mark = "  TOO SLOW" if seconds > args.limit else ""
                print(f"  cell {index:3d}  {seconds:6.2f} s  {first_line}{mark}")
    finally:
        for worker in workers:
            worker.terminate()
    print("\nbusy check " + ("FAILED: cells over the limit above" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
