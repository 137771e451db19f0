"""tools/execute_notebooks.py --compare: what nbval does not see (figures, widget state)."""

import copy
from pathlib import Path

import execute_notebooks as tool
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = nbformat.read(ROOT / "notebooks" / "08_kv_cached_decode.ipynb", as_version=4)


def first_figure_cell(notebook):
    return next(c for c in notebook.cells if c.cell_type == "code"
                and any("image/png" in o.get("data", {}) for o in c.outputs))


def test_a_notebook_matches_itself():
    assert tool.structure_differences(NOTEBOOK, copy.deepcopy(NOTEBOOK)) == []


def test_a_figure_that_disappears_is_caught():
    fresh = copy.deepcopy(NOTEBOOK)
    cell = first_figure_cell(fresh)
    cell.outputs = [o for o in cell.outputs if "image/png" not in o.get("data", {})]
    [difference] = tool.structure_differences(NOTEBOOK, fresh)
    assert "image/png" in difference and "code cell" in difference


def test_a_figure_whose_pixels_differ_is_not_a_difference():
    fresh = copy.deepcopy(NOTEBOOK)
    for output in first_figure_cell(fresh).outputs:
        if "image/png" in output.get("data", {}):
            output["data"]["image/png"] = "iVBORw0KGgo="
    assert tool.structure_differences(NOTEBOOK, fresh) == []


def test_widget_state_with_other_models_is_caught():
    fresh = copy.deepcopy(NOTEBOOK)
    state = fresh.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    state.pop(next(iter(state)))
    assert any("widget state" in d for d in tool.structure_differences(NOTEBOOK, fresh))
