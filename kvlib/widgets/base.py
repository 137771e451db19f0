"""The pattern every widget follows: one figure, made once, redrawn in place."""

from __future__ import annotations

import html
import io
from contextlib import contextmanager

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import Image, display

from kvlib.plots import plural as plural  # the widgets take it from here


class LiveFigure:
    """A matplotlib figure shown inside an ipywidgets Output and redrawn on every change.

    The figure is created once and closed at once (so the inline backend does not show it a
    second time); callbacks change its artists or clear and redraw its axes, then call
    show(). No callback creates a new figure, so nothing leaks however long a student plays.
    """

    def __init__(self, figsize=(6, 4), n_axes: int = 1, **subplot_options):
        self.figure, axes = plt.subplots(1, n_axes, figsize=figsize, squeeze=False,
                                         **subplot_options)
        self.axes = list(axes[0])
        plt.close(self.figure)
        self.output = widgets.Output()

    @property
    def ax(self):
        return self.axes[0]

    def show(self) -> None:
        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)


class OneRenderFigure(LiveFigure):
    """A LiveFigure shown as one PNG render of the whole figure (paged_cache and prefix_caching).
    The inline backend crops a figure to its tight bounding box, which draws it twice; a figure
    laid out with room for every label needs one draw, and a click answers in about half
    the time."""

    def show(self) -> None:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
        with self.output:
            self.output.clear_output(wait=True)
            display(Image(buffer.getvalue()))


def read_prompt(text, tokenizer, max_tokens: int) -> list[int]:
    """A prompt typed into a widget -> its ids, BOS first (embedding_lookup to kv_cached_decode).

    Raises the tokenizer's ValueError for unknown words (safely() shows it escaped, since a
    student may type < or >), and a ValueError in words when the prompt has more than
    max_tokens tokens.
    """
    ids = tokenizer.encode(text)
    if len(ids) > max_tokens:
        raise ValueError(f"this prompt has {len(ids)} tokens (BOS included); at most "
                         f"{max_tokens} fit here: try a shorter one")
    return ids


def as_html(text: str) -> str:
    """Plain text for an HTML line: token labels such as <bos> must show as written."""
    return html.escape(text, quote=False)


def prompt_box(prompt: str) -> widgets.Text:
    """The text box in which a student types a prompt (applied on Enter)."""
    return widgets.Text(value=prompt, description="prompt", continuous_update=False,
                        layout=widgets.Layout(width="20em"))


CUSTOM = "custom"
"""The model choice of the memory calculators once a shape field no longer matches a preset."""
DTYPES = {"FP32 (4 bytes)": 4, "BF16 / FP16 (2 bytes)": 2, "INT8 / FP8 (1 byte)": 1}
"""The number formats the memory calculators offer, by their bytes a number."""


def check_choice(name: str, value, choices) -> None:
    """Refuse a starting value the widget does not offer: "preset must be one of [...]"."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def preset_dropdown(names, preset: str, style: dict) -> widgets.Dropdown:
    """The model choice of a memory calculator: the presets `names`, then CUSTOM."""
    return widgets.Dropdown(options=list(names) + [CUSTOM], value=preset, description="model",
                            style=style, layout=widgets.Layout(width="420px"))


def layer_dropdown(config, value: int = 0, description: str = "layer") -> widgets.Dropdown:
    """A choice of one of the model's layers, "layer 0" to "layer L-1" (its value: the index)."""
    return widgets.Dropdown(options=[(f"layer {i}", i) for i in range(config.n_layers)],
                            value=value, description=description)


def head_dropdown(config, value: int = 0) -> widgets.Dropdown:
    """A choice of one of the model's query heads, "head 0" to "head H-1" (its value: the
    index)."""
    return widgets.Dropdown(options=[(f"head {i}", i) for i in range(config.n_heads)],
                            value=value, description="head")


def carry(box: widgets.VBox, controls: dict, live: LiveFigure, **more) -> widgets.VBox:
    """The widget's box, carrying what later cells and the tests read: each control under its
    name and all of them as box.controls; the figure, its axes and the LiveFigure (figure,
    axes, live); and each of `more` (status, message, a callable of the state) by its name."""
    for name, control in controls.items():
        setattr(box, name, control)
    box.controls = controls
    box.figure, box.axes, box.live = live.figure, live.axes, live
    for name, value in more.items():
        setattr(box, name, value)
    return box


def explorer(live: LiveFigure, controls: dict, status: widgets.HTML, message: widgets.HTML,
             redraw, state: dict) -> widgets.VBox:
    """Wire every control to redraw (through safely, so bad input lands in message), draw
    once, and lay the widget out: the controls in a row, the message and status lines, then
    the figure. The VBox carries what tests use: figure, controls, status, message, state.
    """
    run = safely(redraw, message)
    for control in controls.values():
        control.observe(run, names="value")
    run()
    box = widgets.VBox([widgets.HBox(list(controls.values())), message, status, live.output])
    box.figure, box.controls, box.status, box.message, box.state = (
        live.figure, controls, status, message, state)
    return box


def wire_reset(on_reset, message: widgets.HTML, reset_button: widgets.Button,
               controls) -> None:
    """Run on_reset (through safely, so bad input lands in message) when reset_button is
    clicked or the value of any of `controls` changes, and once now, to draw the start."""
    reset_safely = safely(on_reset, message)
    reset_button.on_click(reset_safely)
    for control in controls:
        control.observe(reset_safely, names="value")
    reset_safely()


@contextmanager
def loading(state: dict):
    """Set several controls at once with one redraw after, not one per control: inside, the
    widget's redraw finds state["loading"] True and returns at once."""
    state["loading"] = True
    try:
        yield
    finally:
        state["loading"] = False


def safely(callback, message_widget: widgets.HTML | None = None,
           prefix: str = "Cannot show this:"):
    """Wrap a widget callback so that a bad value is reported in words, never a traceback:
    `prefix` and the error's message in message_widget."""

    def run(*args, **kwargs):
        try:
            callback(*args, **kwargs)
            if message_widget is not None:
                message_widget.value = ""
        except (ValueError, TypeError) as error:
            if message_widget is None:
                raise
            message_widget.value = f"<b>{as_html(prefix)}</b> {as_html(str(error))}"

    return run
