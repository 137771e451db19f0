"""Every notebook, run in JupyterLab in a real (headless) Chromium, as a student on Binder runs it.

For each notebook: open it, clear its outputs, run all cells, wait until the kernel is idle
with every code cell executed, then check what the student sees: no error output, no
"Error displaying widget", every widget the notebook displays rendered, and the controls the
lesson uses present. Notebooks 06 and 08 are also played with: the temperature slider must
change the plotted distribution, and three clicks on "Decode next token" must grow the cache by
three positions, Reset taking it back to the prompt's five. A full-page screenshot of every
notebook goes to artifacts/screenshots/NN_name.png.

Run with `make browser-test` (see conftest.py for the set-up).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    os.environ.get("KVLIB_BROWSER_TEST") != "1",
    reason="the browser test runs with `make browser-test` (it sets KVLIB_BROWSER_TEST=1 "
           "and needs Chromium and Playwright)")

ALL_NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DECODE = "08_kv_cached_decode"
SAMPLING = "06_logits_next_token"
INTERACTIVE = {DECODE, SAMPLING}
REAL_MODEL = "18_model_of_today"  # SmolLM2 loaded and chatted with in the browser's kernel
PROMPT_POSITIONS = 5  # "How are you?" -> <bos> How are you ?
RUN_SECONDS = 240
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
MAX_SCREENSHOT_HEIGHT = 32000  # Chromium captures 30000 px here; the longest notebook, 10, is less

# Saved widget model -> what its rendered view looks like in the page.
CONTROL_SELECTORS = {
    "FloatSliderModel": ".widget-slider", "IntSliderModel": ".widget-slider",
    "FloatLogSliderModel": ".widget-slider", "SelectionSliderModel": ".widget-slider",
    "IntRangeSliderModel": ".widget-slider", "FloatRangeSliderModel": ".widget-slider",
    "ButtonModel": ".widget-button", "DropdownModel": ".widget-dropdown",
    "ToggleButtonsModel": ".widget-toggle-buttons", "ToggleButtonModel": ".widget-toggle-button",
    "RadioButtonsModel": ".widget-radio", "CheckboxModel": ".widget-checkbox",
    "TextModel": ".widget-text",
}

# JavaScript run in the page. `panel` is the notebook JupyterLab has open.
PANEL = "const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
KERNEL_IDLE = PANEL + """
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
        && panel.sessionContext.session.kernel;
    const idle = !!kernel && kernel.status === 'idle';"""
CODE_CELLS = """
    const code = panel.content.widgets.filter(
        c => c.model.type === 'code' && c.model.sharedModel.getSource().trim() !== '');"""
NOTEBOOK_READY = "(path) => {" + KERNEL_IDLE + """
    return !!panel && !!panel.context && panel.context.path === path && panel.context.isReady
        && idle && panel.content.widgets.length > 0;
}"""
CLEAR_OUTPUTS = "async () => {" + PANEL + CODE_CELLS + """
    await window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');
    return code.filter(c => c.model.executionCount !== null).length;
}"""
RUN_ALL = "() => {" + PANEL + """
    window.jupyterapp.commands.execute('notebook:run-all-cells');  // not awaited
    return true;
}"""
RUN_FINISHED = "() => {" + KERNEL_IDLE + CODE_CELLS + """
    const running = code.some(c => c.model.executionState === 'running'
        || (c.promptNode && c.promptNode.textContent.includes('*')));
    const errored = code.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
    const allRun = code.every(c => c.model.executionCount !== null);
    return idle && !running && (allRun || errored);
}"""
CELL_REPORT = "() => {" + PANEL + CODE_CELLS + """
    return code.map((c, i) => ({
        index: i,
        source: c.model.sharedModel.getSource().slice(0, 80),
        count: c.model.executionCount,
        outputs: c.model.outputs.toJSON(),
    }));
}"""
# A widget's output is JupyterLab's widget renderer: the one output kind without a
# data-mime-type (text, images and HTML carry theirs); once the view is made, it holds
# .jupyter-widgets elements, and on failure only the words "Error displaying widget".
# Outputs inside an Output widget (a LiveFigure's figure) belong to that widget.
WIDGET_OUTPUTS = """() => Array.from(document.querySelectorAll(
    '.jp-Notebook .jp-OutputArea-output:not([data-mime-type])'
)).filter(node => !node.parentElement.closest('.widget-output')).map(node => ({
    rendered: !!node.querySelector('.jupyter-widgets') && node.getBoundingClientRect().height > 0
        && !node.innerText.includes('Error displaying widget'),
    text: node.innerText.slice(0, 200),
}))"""
# How much taller the window must be for the notebook's scroller to show every cell.
MISSING_HEIGHT = "() => {" + PANEL + """
    const scroller = panel.content.node.querySelector('.jp-WindowedPanel-outer')
        || panel.content.node;
    scroller.scrollTop = 0;
    return scroller.scrollHeight - scroller.clientHeight;
}"""
SHUT_DOWN = "async () => {" + PANEL + """
    if (panel && panel.sessionContext) { await panel.sessionContext.shutdown(); }
}"""


class OpenNotebook:
    """One notebook open in its own page, run from a fresh kernel."""

    def __init__(self, page, server, name: str):
        self.name = name
        self.path = f"notebooks/{name}.ipynb"
        self.page = page
        self.server = server

    def open(self) -> None:
        self.page.set_default_timeout(60_000)
        # ?reset: a fresh workspace, so no other notebook (and kernel) is reopened
        self.page.goto(f"{self.server.url}/lab/tree/{self.path}?reset")
        self.page.wait_for_function(NOTEBOOK_READY, arg=self.path, timeout=120_000)

    def run_all(self) -> list[dict]:
        left = self.page.evaluate(CLEAR_OUTPUTS)
        assert left == 0, "clearing the outputs left execution counts behind"
        self.page.evaluate(RUN_ALL)
        self.page.wait_for_function(RUN_FINISHED, timeout=RUN_SECONDS * 1000, polling=250)
        self.settle()
        return self.page.evaluate(CELL_REPORT)

    def settle(self, quiet_seconds: float = 1.0, limit_seconds: float = 30.0) -> None:
        """Wait until the notebook's DOM stops changing (widgets and images arrive late)."""
        last, quiet_since = None, time.monotonic()
        deadline = time.monotonic() + limit_seconds
        while time.monotonic() < deadline:
            size = self.page.evaluate(
                "() => document.querySelector('.jp-Notebook').innerHTML.length")
            if size != last:
                last, quiet_since = size, time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_seconds:
                return
            time.sleep(0.2)

    def text(self) -> str:
        return self.page.evaluate("() => document.body.innerText")

    def screenshot(self, path: Path) -> None:
        """The whole notebook in one picture: grow the window to the notebook's height."""
        self.page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        self.settle(quiet_seconds=0.3, limit_seconds=5)
        width, height = self.page.viewport_size["width"], self.page.viewport_size["height"]
        height = min(height + self.page.evaluate(MISSING_HEIGHT) + 20, MAX_SCREENSHOT_HEIGHT)
        self.page.set_viewport_size({"width": width, "height": height})
        self.settle(quiet_seconds=0.5, limit_seconds=10)
        self.page.evaluate(MISSING_HEIGHT)  # back to the top, if anything still scrolls
        self.page.screenshot(path=str(path), full_page=True)

    def close(self) -> None:
        try:
            self.page.evaluate(SHUT_DOWN)
        finally:
            self.page.close()


class Lab:
    """Opens and runs notebooks, one page each; 06 and 08 stay open for the widget tests."""

    def __init__(self, browser, server, screenshots: Path):
        self.browser, self.server, self.screenshots = browser, server, screenshots
        self.opened: dict[str, tuple[OpenNotebook, list[dict]]] = {}

    def run(self, name: str) -> tuple[OpenNotebook, list[dict]]:
        if name in self.opened:
            return self.opened[name]
        page = self.browser.new_page(viewport={"width": 1280, "height": 900})
        notebook = OpenNotebook(page, self.server, name)
        try:
            notebook.open()
            cells = notebook.run_all()
        except Exception:
            # keep what the page showed when it went wrong, then let the failure through
            try:
                page.screenshot(path=str(self.screenshots / f"{name}_FAILED.png"))
            finally:
                notebook.close()
            raise
        notebook.screenshot(self.screenshots / f"{name}.png")
        self.opened[name] = (notebook, cells)
        return self.opened[name]

    def close(self, name: str) -> None:
        notebook, _ = self.opened.pop(name)
        notebook.close()

    def close_all(self) -> None:
        for name in list(self.opened):
            try:
                self.close(name)
            except Exception:  # noqa: BLE001 - a page that died must not stop the rest closing
                pass


@pytest.fixture(scope="module")
def lab(browser, lab_server, screenshots):
    opened = Lab(browser, lab_server, screenshots)
    try:
        yield opened
    finally:
        opened.close_all()


def saved_controls(name: str) -> dict[str, str]:
    """The control kinds (model name -> selector) in the notebook's saved widget state."""
    notebook = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
    state = notebook.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {})
    models = {m.get("model_name") for m in state.get("state", {}).values()}
    return {m: CONTROL_SELECTORS[m] for m in sorted(models) if m in CONTROL_SELECTORS}


def problems_in(cells: list[dict]) -> list[str]:
    found = []
    for cell in cells:
        first_line = cell["source"].splitlines()[0] if cell["source"] else ""
        where = f"code cell {cell['index'] + 1} ({first_line!r})"
        if cell["count"] is None:
            found.append(f"{where} did not run")
        for output in cell["outputs"]:
            if output.get("output_type") == "error":
                found.append(f"{where} raised {output.get('ename')}: {output.get('evalue')}")
            text = output.get("text", "")
            text = "".join(text) if isinstance(text, list) else text
            if output.get("name") == "stderr" and re.search(r"Traceback|Error|Exception", text):
                found.append(f"{where} wrote an error to stderr: {text[:300]}")
    return found


def widget_models(name: str) -> set[str]:
    """Every widget model kind in the notebook's saved widget state."""
    notebook = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
    state = notebook.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {})
    return {m.get("model_name") for m in state.get("state", {}).values()}


def covering_notebooks(names: list[str]) -> list[str]:
    """A few notebooks that together show every widget kind the series uses: the first
    notebook, the two played with, the real model's, then greedily the notebook that adds the
    most kinds not yet shown (the lower number on a tie). CI runs these
    (KVLIB_BROWSER_NOTEBOOKS=cover); `make browser-test` runs them all."""
    chosen = [n for n in names if n[:2] == "00" or n in INTERACTIVE or n == REAL_MODEL]
    shown = set().union(*(widget_models(n) for n in chosen))
    wanted = set().union(*(widget_models(n) for n in names))
    while wanted - shown:
        best = max((n for n in names if n not in chosen),
                   key=lambda n: (len(widget_models(n) - shown), -names.index(n)))
        chosen.append(best)
        shown |= widget_models(best)
    return sorted(chosen)


def selected_notebooks() -> list[str]:
    which = os.environ.get("KVLIB_BROWSER_NOTEBOOKS", "all")
    if which not in ("all", "cover"):
        raise ValueError(f"KVLIB_BROWSER_NOTEBOOKS must be 'all' or 'cover', got {which!r}")
    return ALL_NOTEBOOKS if which == "all" else covering_notebooks(ALL_NOTEBOOKS)


NOTEBOOKS = selected_notebooks()


def test_the_covering_notebooks_show_every_widget_kind():
    chosen = covering_notebooks(ALL_NOTEBOOKS)
    assert set().union(*map(widget_models, chosen)) == \
        set().union(*map(widget_models, ALL_NOTEBOOKS))
    assert INTERACTIVE | {REAL_MODEL} <= set(chosen) and len(chosen) < len(ALL_NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_widgets_render(lab, name):
    notebook, cells = lab.run(name)
    try:
        check_notebook(notebook, cells, name)
    finally:
        if name not in INTERACTIVE:  # 06 and 08 stay open for the tests below
            lab.close(name)


def check_notebook(notebook, cells, name):
    page = notebook.page
    problems = problems_in(cells)
    text = notebook.text()
    if "Error displaying widget" in text:
        problems.append("the page shows 'Error displaying widget'")
    if "Traceback (most recent call last)" in text:
        problems.append("the page shows a Python traceback")

    shown = [o for c in cells for o in c["outputs"] if WIDGET_VIEW in o.get("data", {})]
    rendered = page.evaluate(WIDGET_OUTPUTS)
    if name[:2] != "00":
        if not shown:
            problems.append("no widget displayed (every notebook from 01 on has one)")
    if len(rendered) != len(shown):
        problems.append(f"{len(shown)} widgets displayed, {len(rendered)} widget outputs in page")
    for i, view in enumerate(rendered):
        if not view["rendered"]:
            problems.append(f"widget output {i + 1} did not render: {view['text']!r}")
    for model, selector in saved_controls(name).items():
        count = page.locator(f".jp-OutputArea-output {selector}").count()
        if count == 0:
            problems.append(f"the notebook's {model} shows nowhere ({selector} not in the page)")
    assert not problems, f"{name} in the browser:\n  " + "\n  ".join(problems)


def cache_positions(status_text: str) -> int:
    found = re.search(r"Cache holds (\d+) positions", status_text)
    assert found, f"no 'Cache holds N positions' in the status: {status_text!r}"
    return int(found.group(1))


def wait_for(condition, what: str, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")


def figure_source(box) -> str:
    images = box.locator(".widget-output img")
    return images.first.get_attribute("src") if images.count() else ""


@pytest.mark.skipif(DECODE not in NOTEBOOKS, reason=f"notebooks/{DECODE}.ipynb does not exist")
def test_decode_button_grows_the_cache_and_reset_returns_to_the_prompt(lab, screenshots):
    notebook, _ = lab.run(DECODE)
    page = notebook.page
    explorer = page.get_by_role("button", name="Decode next token", exact=True)
    box = page.locator(".widget-vbox").filter(has=explorer).last
    decode = box.get_by_role("button", name="Decode next token", exact=True)
    reset = box.get_by_role("button", name="Reset", exact=True)
    status = box.locator(".widget-html", has_text="Cache holds").first
    check = box.locator(".widget-html", has_text="full recomputation").first

    def positions() -> int:
        return cache_positions(status.inner_text())

    assert positions() == PROMPT_POSITIONS
    assert f"({PROMPT_POSITIONS}, 4)" in status.inner_text()
    pictures = [wait_for(lambda: figure_source(box), "the cache drawing")]
    for step in range(1, 4):
        decode.click()
        wait_for(lambda step=step: positions() == PROMPT_POSITIONS + step,
                 f"the cache to hold {PROMPT_POSITIONS + step} positions")
        previous = pictures[-1]
        pictures.append(wait_for(lambda previous=previous: (src := figure_source(box)) != previous
                                 and src, f"the drawing to change after click {step}"))
        assert "equals full recomputation" in check.inner_text(), check.inner_text()
    grown = PROMPT_POSITIONS + 3
    assert positions() == grown
    assert f"K and V of shape ({grown}, 4)" in status.inner_text()
    assert len(set(pictures)) == 4, "every decoded token must redraw the cache"
    box.screenshot(path=str(screenshots / f"{DECODE}_after_3_decodes.png"))

    reset.click()
    wait_for(lambda: positions() == PROMPT_POSITIONS, "Reset to return to the prompt")
    wait_for(lambda: figure_source(box) == pictures[0],
             "the drawing after Reset to be the prompt's drawing again")
    assert "Traceback" not in box.inner_text()


@pytest.mark.skipif(SAMPLING not in NOTEBOOKS, reason=f"notebooks/{SAMPLING}.ipynb does not exist")
def test_temperature_slider_changes_the_distribution(lab, screenshots):
    notebook, _ = lab.run(SAMPLING)
    page = notebook.page
    box = page.locator(".widget-vbox").filter(
        has=page.locator(".widget-slider", has_text="temperature")).last
    slider = box.locator(".widget-slider", has_text="temperature")
    readout = box.locator(".widget-html", has_text="Top 3").first
    value = slider.locator(".widget-readout")
    before_text, before_value = readout.inner_text(), value.inner_text()
    before_picture = wait_for(lambda: figure_source(box), "the distribution's plot")
    assert re.search(r"1\. .+ \d\.\d{3}, 2\. .+ \d\.\d{3}, 3\. .+ \d\.\d{3}", before_text), \
        before_text

    handle = slider.locator(".noUi-handle").first
    handle.focus()
    for _ in range(10):  # ten steps of 0.05 to the right, as a student with arrow keys
        page.keyboard.press("ArrowRight")
    wait_for(lambda: value.inner_text() != before_value, "the slider's value to move")
    after_text = wait_for(lambda: (t := readout.inner_text()) != before_text and t,
                          "the top-3 readout to change")
    after_picture = wait_for(lambda: (src := figure_source(box)) != before_picture and src,
                             "the plotted distribution to change")
    assert float(value.inner_text()) > float(before_value)
    assert after_picture != before_picture and after_text != before_text
    box.screenshot(path=str(screenshots / f"{SAMPLING}_temperature_moved.png"))
    assert "Traceback" not in box.inner_text()
