"""How much memory each lesson's kernel needs: run every notebook once, top to bottom, in a
fresh kernel (one BLAS thread, as make and Binder start them), and read the kernel's peak
resident memory (VmHWM in /proc/self/status: the high-water mark of this process since it
started; ru_maxrss would count the memory of the process that forked it) after the last cell.

    python tools/measure_memory.py                        # every lesson; writes the table
    python tools/measure_memory.py notebooks/18_*.ipynb   # some; the others are kept

The figures go into notebooks/lessons.json ("memory_mib", rounded up to 50 MiB with 20% to
spare, so that a lesson stays under it on another machine) and into the last paragraph of each
notebook's first cell ("Memory: ..."; tools/lessons.py checks that they agree);
tests/test_cells_run_twice.py checks that the kernel stays under it. Linux only.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import nbformat
from stepped_client import SteppedClient  # tools/stepped_client.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import lessons  # noqa: E402

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

PEAK_MEMORY = ("print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) "
               "// 1024)")
"""A cell that prints the kernel's peak resident memory so far, in MiB."""


def peak_mib(client: SteppedClient) -> int:
    """Run PEAK_MEMORY in the client's kernel and return what it prints."""
    cell = nbformat.v4.new_code_cell(PEAK_MEMORY)
    client.execute_cell(cell, 0, store_history=False)
    return int("".join(output.get("text", "") for output in cell.outputs).strip())


def stated_figure(peak: int) -> int:
    """The figure a lesson states: the peak with 20% to spare (another machine's BLAS and
    allocator differ), rounded up to 50 MiB."""
    return int(math.ceil(peak * 1.2 / 50) * 50)


def measure(path: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    client = SteppedClient(notebook, timeout=300, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "code" and cell.source.strip():
                client.execute_cell(cell, index, store_history=True)
        return peak_mib(client)


MEMORY_LINE = ("Memory: this lesson's kernel needs about {mib:,} MiB (measured by "
               "tools/measure_memory.py). On Binder, which gives about 2 GB in all, shut down "
               "the kernels of earlier notebooks first (Kernel > Shut Down Kernel).")


def with_memory_line(header: str, mib: int) -> str:
    """The notebook's first cell with its memory paragraph (re)written at the end."""
    kept = [part for part in header.rstrip("\n").split("\n\n")
            if not part.startswith("Memory: ")]
    return "\n\n".join(kept + [MEMORY_LINE.format(mib=mib)])


def state_in_header(path: Path, mib: int) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    first = notebook["cells"][0]
    first["source"] = with_memory_line("".join(first["source"]), mib).splitlines(keepends=True)
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str]) -> None:
    table = json.loads((ROOT / lessons.TABLE).read_text(encoding="utf-8"))
    rows = {row["slug"]: row for row in table["lessons"]}
    paths = [Path(arg) for arg in argv] or [ROOT / lesson.notebook for lesson in lessons.load()]
    for path in paths:
        peak = measure(path)
        slug = path.stem[3:]
        rows[slug]["memory_mib"] = stated_figure(peak)
        state_in_header(path, rows[slug]["memory_mib"])
        print(f"{path.name:40} peak {peak:5,} MiB -> states {rows[slug]['memory_mib']:,} MiB",
              flush=True)
        (ROOT / lessons.TABLE).write_text(json.dumps(table, indent=1, ensure_ascii=False)
                                          + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
