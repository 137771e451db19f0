"""Every notebook is committed executed, in order, with its widget state, and is built the way
the series promises (goals at the top, recap and exercises at the end). nbval, run by the same
`pytest`, checks that the committed outputs match a fresh run."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SERIES = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def load(name):
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))


def source(cell):
    return "".join(cell["source"])


def test_the_series_is_numbered_without_gaps_and_listed_in_the_readme():
    assert [int(name[:2]) for name in SERIES] == list(range(len(SERIES)))
    for name in SERIES:
        assert f"notebooks/{name}.ipynb" in README, f"{name} is not in README's lesson table"


# what a measurement of this machine prints: seconds, rates, bandwidth
TIMING = re.compile(r"\d ?(ms|µs|us|ns|s)\b(?! *=)|tokens/s\b|FLOP/s\b|B/s\b|\d ?x faster")
TIMINGS_NOTE = ("[measured on the machine that runs this cell, so not saved with the notebook: "
                "run the cell to see the numbers]\n")


def printed_text(cell) -> str:
    texts = [output.get("text", "") for output in cell.get("outputs", [])
             if output["output_type"] == "stream"]
    texts += [output["data"].get("text/plain", "") for output in cell.get("outputs", [])
              if "data" in output and "image/png" not in output["data"]]
    return "".join("".join(text) for text in texts)


@pytest.mark.parametrize("name", SERIES)
def test_no_timings_or_timestamps_are_committed(name):
    # tools/execute_notebooks.py --inplace replaces what a cell tagged "timings" prints
    for cell in load(name)["cells"]:
        assert "execution" not in cell["metadata"], "execution timestamps committed"
        if cell["cell_type"] != "code":
            continue
        if "timings" in cell["metadata"].get("tags", []):
            assert "nbval-ignore-output" in cell["metadata"]["tags"]
            streams = [o for o in cell["outputs"] if o["output_type"] == "stream"]
            assert all("".join(o["text"]) == TIMINGS_NOTE for o in streams), source(cell)[:80]
        else:
            found = TIMING.search(printed_text(cell))
            assert found is None, (f"a timing ({found.group(0)!r}) printed by a cell not "
                                   f"tagged timings: {source(cell)[:80]}")


@pytest.mark.parametrize("name", SERIES)
def test_executed_in_order_without_errors(name):
    code = [c for c in load(name)["cells"] if c["cell_type"] == "code" and source(c).strip()]
    assert code, "a notebook with no code"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    for cell in code:
        for output in cell["outputs"]:
            assert output["output_type"] != "error", f"committed error in: {source(cell)[:80]}"


@pytest.mark.parametrize("name", SERIES)
def test_widget_state_is_saved_for_every_widget_shown(name):
    notebook = load(name)
    shown = [o["data"][WIDGET_VIEW]["model_id"]
             for c in notebook["cells"] if c["cell_type"] == "code"
             for o in c["outputs"] if WIDGET_VIEW in o.get("data", {})]
    if name != "00_big_picture":
        assert shown, "every notebook from 01 on has at least one widget"
    if not shown:
        return
    state = notebook["metadata"]["widgets"][WIDGET_STATE]
    assert "state" in state and state["version_major"] == 2
    missing = set(shown) - set(state["state"])
    assert not missing, f"widget views without saved state: {missing}"
    for cell in notebook["cells"]:
        if any(WIDGET_VIEW in o.get("data", {}) for o in cell.get("outputs", [])):
            assert "nbval-ignore-output" in cell["metadata"].get("tags", []), source(cell)[:80]


@pytest.mark.parametrize("name", SERIES)
def test_lesson_structure(name):
    notebook = load(name)
    cells = notebook["cells"]
    assert cells[0]["cell_type"] == "markdown"
    assert re.search(r"learning goals", source(cells[0]), re.IGNORECASE)
    markdown = "\n".join(source(c) for c in cells if c["cell_type"] == "markdown")
    assert re.search(r"^#+ .*recap", markdown, re.IGNORECASE | re.MULTILINE)
    assert re.search(r"^#+ .*exercises", markdown, re.IGNORECASE | re.MULTILINE)
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    code = "\n".join(source(c) for c in cells if c["cell_type"] == "code")
    assert "import kvlib" in code
    assert "shared" not in code, "notebooks must not read ../shared"
    assert "assert " in code, "every claim is checked by code that runs"
