"""Running a lesson's notebook headless in the test process, for the tests that read what its
code cells leave behind. Not a test module (pytest collects test_*.py only).

    from notebook_runs import assert_solutions_pass, code_cells, run_notebook

    namespace = run_notebook("prefill")           # a lesson by its slug
    assert_solutions_pass(namespace, exercises, {1: exercises.check_layer_keys, ...})

The cells run in order in one namespace, as in a kernel: pyplot's show() does nothing and the
figures a cell makes are closed after it (as Jupyter's inline backend closes them).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import matplotlib.pyplot as plt
from checker_cases import correct

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_path(slug: str) -> Path:
    """notebooks/NN_<slug>.ipynb, whatever the lesson's number."""
    (path,) = NOTEBOOKS.glob(f"[0-9][0-9]_{slug}.ipynb")
    return path


def notebook_cells(slug: str) -> list[dict]:
    """Every cell of the lesson's notebook, markdown and code."""
    return json.loads(notebook_path(slug).read_text(encoding="utf-8"))["cells"]


def code_cells(slug: str) -> list[dict]:
    return [cell for cell in notebook_cells(slug) if cell["cell_type"] == "code"]


def run_notebook(slug: str, cells: list[dict] | None = None, *, each_twice: bool = False,
                 printed: list[str] | None = None) -> dict:
    """The variables the notebook's code cells leave, run in order (all of them, or `cells`).

    each_twice: every cell runs twice in a row, as by a student who clicks twice.
    printed: a list that receives what each cell prints (its standard output).
    """
    name = notebook_path(slug).name
    namespace = {"__name__": "__notebook__"}
    figures = set(plt.get_fignums())
    show, plt.show = plt.show, lambda *args, **kwargs: None
    try:
        for index, cell in enumerate(code_cells(slug) if cells is None else cells):
            code = compile("".join(cell["source"]), f"{name} cell {index}", "exec")
            out = io.StringIO()
            with contextlib.redirect_stdout(out) if printed is not None else \
                    contextlib.nullcontext():
                for _ in range(2 if each_twice else 1):
                    exec(code, namespace)
            if printed is not None:
                printed.append(out.getvalue())
            for number in set(plt.get_fignums()) - figures:
                plt.close(number)
    finally:
        plt.show = show
    return namespace


def assert_solutions_pass(namespace: dict, exercises, checks: dict, arguments=None) -> None:
    """The notebook leaves every exercise open (answer = ..., where its cells have run that
    far), and each published solution of the lesson, run in a copy of the notebook's
    variables, passes its checker.

    checks: {exercise number: checker}, one per solution; arguments: {number: names of the
    notebook's variables the checker is also given} (check_serve(answer, server_cache))."""
    assert namespace.get("answer", ...) is ..., "the notebook should leave the exercises open"
    assert sorted(exercises.SOLUTIONS) == sorted(checks)
    for number, check in checks.items():
        scope = dict(namespace)
        exec(exercises.SOLUTIONS[number], scope)
        more = [scope[name] for name in (arguments or {}).get(number, ())]
        correct(check(scope["answer"], *more))
