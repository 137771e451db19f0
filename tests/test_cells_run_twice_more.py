"""The other half of tests/test_cells_run_twice.py's notebooks, in a module of its own so that
pytest-xdist (--dist loadscope: a module on one worker) runs the two halves side by side."""

import pytest
from test_cells_run_twice import HALVES, check_every_cell_runs_twice


@pytest.mark.parametrize("path", HALVES[1], ids=[p.stem for p in HALVES[1]])
def test_every_cell_gives_the_same_output_when_run_again_after_the_notebook(path):
    check_every_cell_runs_twice(path)


def test_the_halves_cover_every_notebook_once():
    from test_cells_run_twice import NOTEBOOKS
    assert sorted(HALVES[0] + HALVES[1]) == NOTEBOOKS
