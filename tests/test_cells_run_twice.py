"""Every cell of every notebook gives the same output when it is run again, after the whole
notebook has run.

In class, a cell is often run again: to show it once more, after a typo in the next one, by a
student who clicked twice, or who scrolls back to an earlier cell after reading on. A cell
that changes state (appends to a cache, takes blocks from a pool, advances a generator) must
rebuild that state itself, and a later cell must not rebind a name an earlier one reads, or the
second run prints something else, fails its own asserts, or breaks the cells after it. nbval
runs each cell once; this runs the whole notebook, then every cell again in order, in one
kernel, and compares each cell's two runs' text outputs (sanitized as nbval's are; for cells
that measure this machine or show a widget, the number and kinds of outputs). The second run
of a cell comes after every later cell of the first pass, and after its own first run: it
catches both a cell that is not safe to run twice and a later cell that changed what it reads.

After the first pass the kernel's peak memory is read: it must stay under the figure the lesson
states in its header (notebooks/lessons.json's memory_mib, measured by tools/measure_memory.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import lessons  # tools/lessons.py: the table of lessons, with each one's memory figure
import nbformat
import pytest
from measure_memory import peak_mib  # tools/measure_memory.py
from stepped_client import SteppedClient  # tools/stepped_client.py: why

ROOT = Path(__file__).resolve().parent.parent

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HALVES = (NOTEBOOKS[::2], NOTEBOOKS[1::2])
"""Every other notebook here, the rest in tests/test_cells_run_twice_more.py: pytest-xdist's
--dist loadscope keeps a module on one worker, and the two modules run on two."""
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def sanitizers() -> list[tuple[re.Pattern, str]]:
    """The regex / replace pairs of tests/nbval_sanitize.cfg."""
    lines = (ROOT / "tests" / "nbval_sanitize.cfg").read_text(encoding="utf-8").splitlines()
    pairs, pattern = [], None
    for line in lines:
        if line.startswith("regex:"):
            pattern = re.compile(line.split(":", 1)[1].strip())
        elif line.startswith("replace:") and pattern is not None:
            pairs.append((pattern, line.split(":", 1)[1].strip()))
            pattern = None
    return pairs


SANITIZERS = sanitizers()
MEMORY_MIB = {lesson.slug: lesson.memory_mib for lesson in lessons.load()}


def summary(outputs, exact: bool) -> list:
    """What must agree between two runs: the kinds of outputs, and with exact=True their text."""
    kept = []
    for output in outputs:
        kind = output["output_type"]
        if kind == "error":
            kept.append(("error", output["ename"], output["evalue"]))
            continue
        if kind == "stream":     # one print may arrive in several pieces: join them
            text = output["text"] if exact else None
            if kept and kept[-1][:2] == (kind, output["name"]):
                earlier = kept.pop()[2]          # popped in both modes: one entry per print
                if exact:
                    text = earlier + text
            kept.append((kind, output["name"], text))
            continue
        data = output.get("data", {})
        text = data.get("text/plain", "") if exact and WIDGET_VIEW not in data else None
        kept.append((kind, tuple(sorted(data)), text))
    if exact:
        sanitized = []
        for entry in kept:
            text = entry[-1]
            for pattern, replacement in SANITIZERS:
                text = pattern.sub(replacement, text) if isinstance(text, str) else text
            sanitized.append(entry[:-1] + (text,))
        kept = sanitized
    return kept


@pytest.mark.parametrize("path", HALVES[0], ids=[p.stem for p in HALVES[0]])
def test_every_cell_gives_the_same_output_when_run_again_after_the_notebook(path):
    check_every_cell_runs_twice(path)


def check_every_cell_runs_twice(path: Path) -> None:
    """Run the notebook, read the kernel's peak memory, then run every cell again and compare
    its outputs with its first run's."""
    notebook = nbformat.read(path, as_version=4)
    client = SteppedClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                           resources={"metadata": {"path": str(path.parent)}})
    cells = [(index, cell) for index, cell in enumerate(notebook.cells)
             if cell.cell_type == "code" and cell.source.strip()]
    first, differences = {}, []
    with client.setup_kernel():
        for index, cell in cells:
            client.execute_cell(cell, index, store_history=True)
            first[index] = cell.outputs
            cell.outputs = []
        peak, stated = peak_mib(client), MEMORY_MIB[path.stem[3:]]
        assert stated is not None, f"{path.name} states no memory: python tools/measure_memory.py"
        assert peak <= stated, (f"the kernel peaked at {peak:,} MiB, over the {stated:,} MiB "
                                "the lesson states: python tools/measure_memory.py " + str(path))
        for index, cell in cells:
            tags = set(cell.metadata.get("tags", []))
            exact = not tags & {"timings", "nbval-ignore-output"}
            client.execute_cell(cell, index, store_history=True)
            runs = [summary(first[index], exact), summary(cell.outputs, exact)]
            cell.outputs = []
            if runs[0] != runs[1]:
                first_line = cell.source.split("\n")[0][:70]
                differences.append(f"cell {index} ({first_line!r}): first run {runs[0]!r:.300}"
                                   f"\n    run again {runs[1]!r:.300}")
            if any(entry[0] == "error" for entry in runs[1]):
                break       # the cells after it would fail for this one's sake
    assert not differences, "cells that print something else when run again:\n" + \
        "\n".join(differences)


def test_summary_joins_a_print_that_arrives_in_pieces():
    pieces = [{"output_type": "stream", "name": "stdout", "text": "3.1 ms"},
              {"output_type": "stream", "name": "stdout", "text": " a step\n"}]
    whole = [{"output_type": "stream", "name": "stdout", "text": "3.1 ms a step\n"}]
    assert summary(pieces, exact=False) == summary(whole, exact=False) \
        == [("stream", "stdout", None)]
    assert summary(pieces, exact=True) == summary(whole, exact=True)
    both = pieces + [{"output_type": "stream", "name": "stderr", "text": "warning\n"}]
    assert [entry[1] for entry in summary(both, exact=False)] == ["stdout", "stderr"]
