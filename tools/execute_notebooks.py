"""Execute notebooks top to bottom, as `jupyter nbconvert --execute` does, and optionally save
them in place with their outputs and widget state (`make notebooks`; tools/binder_check.sh).

One change from nbconvert: the kernel's replies are polled in steps of a second
(tools/stepped_client.py says why).

    python tools/execute_notebooks.py [--inplace | --compare] [--jobs N] notebooks/00_*.ipynb ...

Exits non-zero, naming the notebook, on the first cell that raises or prints a traceback.
--jobs N runs N notebooks at once (tools/binder_check.sh uses 2); they are reported in order.

--compare checks what nbval cannot: nbval compares text outputs only, so a committed figure
(image/png) or a saved widget state could drift from the code unnoticed. With --compare,
every code cell of the fresh run must give the same number and kinds of outputs as the
committed notebook (output type, stream name, MIME types: a figure that disappears, or a
new one, is caught; the PNG bytes are not compared, they differ between matplotlib builds),
and the saved widget state must hold the same models (by module and name; their ids are
random). tools/binder_check.sh runs it on every notebook.

--inplace saves no timings: a cell tagged "timings" (it measures this machine: seconds,
tokens/s, GB/s) keeps the kinds of its outputs, but each printed text becomes TIMINGS_NOTE,
so the committed notebook is the same on every machine (tests/test_notebooks.py checks it);
and the cells' execution timestamps are dropped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import nbformat
from stepped_client import SteppedClient  # tools/stepped_client.py

TIMINGS_TAG = "timings"
TIMINGS_NOTE = ("[measured on the machine that runs this cell, so not saved with the notebook: "
                "run the cell to see the numbers]\n")
CELL_TIMEOUT_SECONDS = 300
# the kernels inherit the environment: one BLAS thread, as `make lab` and Binder give them
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


def error_outputs(notebook) -> list[str]:
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" or (
                    output.get("name") == "stderr" and "Traceback" in output.get("text", "")):
                found.append(output.get("ename", "a traceback on stderr"))
    return found


def output_kinds(cell) -> list[tuple]:
    """What a code cell shows, without the contents: one tuple per output."""
    kinds = []
    for output in cell.get("outputs", []):
        kind = output["output_type"]
        if kind == "stream":
            # one print may arrive in several pieces, depending on when the kernel flushes
            if not kinds or kinds[-1] != (kind, output.get("name")):
                kinds.append((kind, output.get("name")))
        elif kind in ("display_data", "execute_result"):
            kinds.append((kind, tuple(sorted(output.get("data", {})))))
        else:
            kinds.append((kind,))
    return kinds


def widget_models(notebook) -> list[tuple[str, str]]:
    state = notebook.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return sorted((model.get("model_module", ""), model.get("model_name", ""))
                  for model in state.values())


def structure_differences(committed, executed) -> list[str]:
    """Where a fresh run's outputs differ in number or kind from the committed notebook's."""
    found = []
    old = [c for c in committed.cells if c.cell_type == "code"]
    new = [c for c in executed.cells if c.cell_type == "code"]
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    for index, (a, b) in enumerate(zip(old, new)):
        if output_kinds(a) != output_kinds(b):
            first_line = "".join(a.source).strip().splitlines()[:1]
            found.append(f"code cell {index + 1} ({first_line[0][:50] if first_line else ''}"
                         f"): committed {output_kinds(a)}, fresh run {output_kinds(b)}")
    if widget_models(committed) != widget_models(executed):
        found.append("the saved widget state holds other models than a fresh run makes: "
                     "re-execute the notebook (make notebooks) and commit it")
    return found


def without_timings(notebook) -> None:
    """In place: drop execution timestamps, and the printed numbers of cells tagged timings
    (one TIMINGS_NOTE for each run of printed text, so output_kinds stays the same)."""
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code" or TIMINGS_TAG not in cell.metadata.get("tags", []):
            continue
        outputs = []
        for output in cell.outputs:
            if output["output_type"] == "stream":
                if outputs and outputs[-1]["output_type"] == "stream" and \
                        outputs[-1].get("name") == output.get("name"):
                    continue
                output["text"] = TIMINGS_NOTE
            outputs.append(output)
        cell.outputs = outputs


def run_one(path: Path, inplace: bool, compare: bool) -> str | None:
    """Execute one notebook (saved in place, or compared) -> what went wrong, or None."""
    notebook = nbformat.read(path, as_version=4)
    committed = nbformat.read(path, as_version=4)
    try:
        SteppedClient(notebook, timeout=CELL_TIMEOUT_SECONDS, kernel_name="python3",
                      resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as error:  # CellExecutionError, CellTimeoutError, DeadKernelError
        return f"{path.name} failed:\n{error}"
    errors = error_outputs(notebook)
    if errors:
        return f"{path.name}: error outputs: {'; '.join(errors)}"
    if compare:
        differences = structure_differences(committed, notebook)
        if differences:
            return (f"{path.name}: a fresh run differs from the committed notebook:\n  "
                    + "\n  ".join(differences))
    if inplace:
        without_timings(notebook)
        nbformat.write(notebook, path)
    return None


def timed(path: Path, inplace: bool, compare: bool) -> tuple[str | None, float]:
    started = time.monotonic()
    return run_one(path, inplace, compare), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--inplace", action="store_true",
                      help="save each executed notebook over the original")
    mode.add_argument("--compare", action="store_true",
                      help="check that a fresh run gives the committed number and kinds of "
                           "outputs per cell and the same widget models")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks run at once, each in its own process and kernel "
                             "(default 1; each kernel has one BLAS thread)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(timed, path, args.inplace, args.compare) for path in args.notebooks]
        for path, run in zip(args.notebooks, runs):     # reported in order, first failure ends
            problem, seconds = run.result()
            if problem is not None:
                for later in runs:
                    later.cancel()
                sys.exit(problem)
            print(f"   {path.name:34} {seconds:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
