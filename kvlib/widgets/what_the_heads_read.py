"""The what_the_heads_read lesson: what the heads of a trained model read, measured, and GPT-2 124M.

- ``draw_head`` draws one head's weights with token labels and ``draw_head_table`` a score
  for every layer and head (kvlib.heads measures them from recorded attention weights);
  ``draw_distances`` compares how far back heads read on one histogram.
- ``draw_reading(ax, labels, weights)`` lays a text out token by token on a grid, each cell
  coloured by the attention weight the newest token puts on it: which earlier position the
  new token reads from.
- ``reading_explorer(params, tokenizer, prompt)`` decodes one token a click with
  ``kvlib.decode_step`` and draws, for the chosen layer and head, what the new token read;
  every step is checked against a full recomputation with ``kvlib.forward``.
- GPT-2 124M: the published prompt and continuation, and what to print when the weights are
  not on this machine (``gpt2_status``).
"""

from __future__ import annotations

import html
import textwrap

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import kvlib
from kvlib import plots
from kvlib.debug import cached_tolerance as tolerance
from kvlib.debug import relative_difference
from kvlib.gpt2 import default_directory

from .base import LiveFigure, head_dropdown, layer_dropdown, plural, safely, wire_reset

PUBLISHED_PROMPT = "Alan Turing theorized that computers would one day become"
PUBLISHED_CONTINUATION = (
    " the most powerful machines on the planet.\n\nThe computer is a machine that can perform "
    "complex calculations, and it can perform these calculations in a way that is very "
    "similar to the human brain.")
"""Greedy GPT-2 124M after PUBLISHED_PROMPT, 40 new tokens: the reference output that
independent numpy, JAX and MLX ports of GPT-2 agree on (issue 9)."""
PUBLISHED_NEW_TOKENS = 40

COLUMNS = 16             # tokens per row of the reading grid
MIN_ROWS = 4             # a short text still gets cells of a readable height
LABEL_CHARACTERS = 9     # longer tokens are cut, with an ellipsis


# ---------------------------------------------------------------------------------- GPT-2

def gpt2_status(directory) -> str:
    """What the what_the_heads_read lesson prints about GPT-2 124M's weights: where they are, or how
    to get them."""
    if directory is not None:
        return f"GPT-2 124M's weights are in {directory}: the GPT-2 cells below run."
    return textwrap.dedent(f"""\
        GPT-2 124M's weights are not on this machine, so the GPT-2 cells below skip.
        To get them (548 MB, once, with a network), either
          - run  kvlib.gpt2.download()  in a cell of this notebook, or
          - run  make gpt2  in a terminal, in the repository's folder;
        they go to {default_directory()} (or to $KVLIB_GPT2_DIR if you set it).
        Then run this notebook again from the top.""")


SKIPPED = "skipped: GPT-2 124M's weights are not on this machine (see above)"

REAL_SENTENCE = "Alan Turing was born in London in 1912, and he studied mathematics at Cambridge."
"""The real sentence the what_the_heads_read lesson feeds GPT-2 124M twice, for its heads."""
CLEAR_HEAD = 0.5
"""A head whose score passes this does its job plainly: more than half of its weight (a
uniform head over 20-odd positions would put a few percent on any one)."""
COPIED_AT_LEAST = 0.8
"""In the second copy of a sentence GPT-2 124M predicts most next tokens by copying them."""


# ---------------------------------------------------------------------------------- heads

def draw_head_table(ax, scores, title: str, vmax: float = 1.0):
    """An (L, h) table of head scores as a heatmap, layers down and heads across, each cell
    labelled with its value (what_the_heads_read); the colours run from 0 to vmax for every table,
    so that tables side by side compare."""
    scores = np.asarray(scores, dtype=float)
    image = ax.imshow(scores, cmap=plots.COLORMAP, vmin=0.0, vmax=vmax)
    n_layers, n_heads = scores.shape
    if n_heads <= 6:            # a few heads: every tick says what it is
        ax.set_xticks(range(n_heads), [f"head {h}" for h in range(n_heads)], fontsize=8)
        ax.set_yticks(range(n_layers), [f"layer {i}" for i in range(n_layers)], fontsize=8)
    else:                       # many: numbers on the ticks, the names on the axes
        ax.set_xticks(range(n_heads), range(n_heads), fontsize=8)
        ax.set_yticks(range(n_layers), range(n_layers), fontsize=8)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    for (layer, head), value in np.ndenumerate(scores):
        light = image.norm(value) > 0.55
        ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8,
                color="black" if light else "white")
    ax.set_title(title, fontsize=9)
    return image


def draw_distances(ax, distances: dict, title: str, bin_width: int = 5):
    """One histogram per head of how far back it reads (what_the_heads_read): distances = {label:
    array of distances}; the same bins for every head, so that they compare."""
    arrays = {label: np.asarray(values, dtype=int) for label, values in distances.items()}
    if not arrays or any(values.size == 0 for values in arrays.values()):
        raise ValueError("need at least one distance for every head")
    top = max(int(values.max()) for values in arrays.values())
    bins = np.arange(0, top + 2 * bin_width, bin_width)
    colours = plt.get_cmap(plots.COLORMAP)(np.linspace(0.15, 0.75, len(arrays)))
    for (label, values), colour in zip(arrays.items(), colours):
        ax.hist(values, bins=bins, color=colour, edgecolor="black", linewidth=0.5, alpha=0.85,
                label=f"{label}: median {np.median(values):.0f}, at most {values.max()}")
    ax.set_xlabel("positions back from the query to the position read most")
    ax.set_ylabel("queries")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    return ax


def short_labels(labels) -> list[str]:
    """Token labels for plots: newlines shown as ⏎, long tokens cut."""
    shown = []
    for label in labels:
        label = str(label).replace("\n", "⏎")
        shown.append(label if len(label) <= LABEL_CHARACTERS
                     else label[:LABEL_CHARACTERS - 1] + "…")
    return shown


def draw_head(ax, weights, labels, title: str, max_labels: int = 40):
    """One head's attention weights (T, T) with token labels on both axes, masked future cells
    hatched; the colours span the weights on show (what_the_heads_read)."""
    weights = np.asarray(weights, dtype=float)
    labels = short_labels(labels)
    T = weights.shape[0]
    plots.attention_heatmap(weights, labels, labels, mask=kvlib.causal_mask(T), ax=ax,
                            title=title, show_values=False, colorbar=True, vmin=0.0,
                            vmax=float(weights.max()), max_labels=max_labels)
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.tick_params(axis="y", labelsize=7)
    return ax


# ---------------------------------------------------------------------------------- reading

def reading_grid(weights, columns: int = COLUMNS, min_rows: int = MIN_ROWS) -> np.ndarray:
    """Weights over S positions laid out row by row, `columns` a row: (max(min_rows,
    ceil(S / columns)), columns), the cells after the last position masked."""
    weights = np.asarray(weights, dtype=float)
    rows = max(min_rows, -(-len(weights) // columns))
    cells = np.zeros(rows * columns)
    cells[: len(weights)] = weights
    hidden = np.arange(rows * columns) >= len(weights)
    return np.ma.masked_array(cells, mask=hidden).reshape(rows, columns)


class ReadingPicture:
    """What the newest token reads (what_the_heads_read), drawn into one Axes and updated in place:
    the text token by token on a grid, each cell coloured by the newest query's attention
    weight on that position, the newest token (the query itself, last) framed with a dashed
    line and the position read most with a white frame.

    update() reuses the image, the labels and the frames; only a new row of the grid (every
    COLUMNS tokens) rebuilds the Axes. A click in the widget then costs a few set_text calls,
    not a few hundred new artists.
    """

    def __init__(self, ax, columns: int = COLUMNS, min_rows: int = MIN_ROWS):
        self.ax, self.columns, self.min_rows = ax, columns, min_rows
        self.image, self.texts, self.frames = None, [], []

    def _build(self, shape) -> None:
        ax = self.ax
        ax.clear()
        cmap = plt.get_cmap(plots.COLORMAP).with_extremes(bad="white")
        self.image = ax.imshow(np.ma.masked_array(np.zeros(shape), mask=True), cmap=cmap,
                               vmin=0.0, vmax=1.0, aspect="auto")
        self.texts = []
        self.frames = [ax.add_patch(Rectangle((-0.5, -0.5), 1, 1, fill=False, edgecolor=color,
                                              linestyle=style, linewidth=width))
                       for color, style, width in (("black", "-", 4.5), ("white", "-", 2.0),
                                                   ("black", "--", 1.8))]
        ax.set_xticks(range(self.columns), [str(c) for c in range(self.columns)], fontsize=7)
        ax.set_yticks(range(shape[0]), [str(r * self.columns) for r in range(shape[0])],
                      fontsize=7)
        ax.set_xlabel("position = the row's first position (left) + the column; white frame: "
                      "read most; dashed: the newest token")
        ax.set_ylabel("first position of the row")

    def update(self, labels, weights, title: str | None = None) -> int:
        """Show the weights (S,) of the newest query over the S tokens labelled `labels`;
        returns the position of the largest weight."""
        weights = np.asarray(weights, dtype=float)
        if weights.ndim != 1 or len(weights) != len(labels) or len(weights) == 0:
            raise ValueError(f"need one weight per token: got weights of shape "
                             f"{weights.shape} and {len(labels)} labels")
        grid = reading_grid(weights, self.columns, self.min_rows)
        if self.image is None or self.image.get_array().shape != grid.shape:
            self._build(grid.shape)
        top = float(weights.max())
        self.image.set_data(grid)
        self.image.set_clim(0.0, top if top > 0 else 1.0)
        bright = self.image.norm(weights) > 0.55
        labels = short_labels(labels)
        for text in self.texts[len(labels):]:
            text.remove()
        del self.texts[len(labels):]
        for position in range(len(self.texts), len(labels)):
            row, column = divmod(position, self.columns)
            self.texts.append(self.ax.text(column, row, "", ha="center", va="center",
                                           fontsize=7))
        for text, label, light in zip(self.texts, labels, bright):
            text.set_text(label)
            text.set_color("black" if light else "white")
        most = int(np.argmax(weights))
        for frame, position in zip(self.frames, (most, most, len(weights) - 1)):
            row, column = divmod(position, self.columns)
            frame.set_xy((column - 0.5, row - 0.5))
        self.ax.set_title(title or "What the newest token reads")
        return most


def draw_reading(ax, labels, weights, title: str | None = None, columns: int = COLUMNS,
                 min_rows: int = 1):
    """A ReadingPicture of the weights (S,) over S labelled tokens (what_the_heads_read): the plain
    figure before the widget, as many rows as the text needs. Returns (image, position of
    the largest weight)."""
    picture = ReadingPicture(ax, columns, min_rows)
    most = picture.update(labels, weights, title)
    return picture.image, most


def reading_explorer(params, tokenizer, prompt: str, layer: int = 0, head: int = 0):
    """Greedy decoding one click at a time on a real model, and what the new token reads
    (what_the_heads_read).

    Each click on "Decode next token" feeds the greedy choice to kvlib.decode_step; the
    figure shows the new token's attention, in the chosen layer and head, over every cached
    position, and the status line names the position it reads most. Every step is compared
    with kvlib.forward on the whole sequence (within TOLERANCES of the logits' size).

    Returns a VBox with ``decode``, ``reset`` (Buttons), ``prompt`` (Text), ``layer``,
    ``head`` (Dropdowns), ``status``, ``check``, ``message`` (HTML), ``figure``, ``controls``,
    ``cache()``, ``sequence()`` and ``reading()`` (the last drawing: its weights and the
    position read most).
    """
    config = params.config
    decode = widgets.Button(description="Decode next token", button_style="primary")
    reset = widgets.Button(description="Reset")
    text = widgets.Text(value=prompt, description="prompt", continuous_update=False,
                        layout=widgets.Layout(width="40em"))
    layer_box = layer_dropdown(config, layer)
    head_box = head_dropdown(config, head)
    status, check, message = widgets.HTML(), widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(11, 5.2))
    picture = ReadingPicture(live.ax)
    state = {}

    def compare(logits, what):
        full = kvlib.forward(params, state["sequence"], last_only=True)
        difference = relative_difference(logits[-1:], full)
        limit = tolerance(params)
        verdict = "equals" if difference < limit else "<b>differs from</b>"
        check.value = (f"{what} {verdict} full recomputation (kvlib.forward): the logits "
                       f"differ by {difference:.0e} of their size (tolerance {limit:.0e}, "
                       f"{config.dtype})")
        state["difference"] = difference

    def draw():
        sequence = state["sequence"]
        labels = tokenizer.tokens(sequence)
        weights = state["weights"][int(layer_box.value)][int(head_box.value), -1]
        newest = len(sequence) - 1
        image = picture.image
        most = picture.update(labels, weights,
                              title=f"layer {layer_box.value}, head {head_box.value}: what "
                                    f"{labels[-1]!r} (position {newest}) reads")
        state["reading"] = {"weights": weights, "most": most}
        if "colorbar" not in state:
            state["colorbar"] = live.figure.colorbar(picture.image, ax=live.ax, fraction=0.03,
                                                     pad=0.02, label="attention weight")
        elif picture.image is not image:
            state["colorbar"].update_normal(picture.image)
        generated = tokenizer.decode(state["generated"]) if state["generated"] else ""
        status.value = (
            f"Cache holds {plural(len(sequence), 'position')}. The newest token "
            f"{html.escape(repr(labels[-1]))} (position {newest}) puts {weights[most]:.2f} of "
            f"this head's weight on {html.escape(repr(labels[most]))} at position {most}"
            + (" (itself)" if most == newest else "") + ". Generated so far: "
            + html.escape(generated))
        full = len(sequence) >= state["cache"].capacity
        decode.disabled = full or state.get("invalid", False)
        if full:
            status.value += (f"<br><b>The context is full</b> ({state['cache'].capacity} "
                             "positions): press Reset to start again.")
        live.show()

    def on_reset(*_):
        try:
            ids = tokenizer.encode(text.value)
            if not 1 <= len(ids) < config.context_length:
                raise ValueError(f"the prompt has {len(ids)} tokens; it needs 1 to "
                                 f"{config.context_length - 1} to leave room for a new one")
        except ValueError as error:
            decode.disabled, state["invalid"] = True, True
            raise ValueError(f"{str(error).rstrip('.')}. Decoding waits for a prompt that "
                             "works.") from error
        state["invalid"] = False
        recorded = []
        logits, cache = kvlib.prefill(params, ids, record_attention=recorded)
        state.update(cache=cache, sequence=list(ids), weights=recorded, generated=[])
        state["pending"] = int(np.argmax(logits[-1]))
        compare(logits, "prefill")
        draw()

    def on_decode(_button):
        cache = state.get("cache")
        if cache is None or state.get("invalid") or len(cache) >= cache.capacity:
            decode.disabled = True
            return
        token = state["pending"]
        recorded = []
        logits = kvlib.decode_step(params, token, cache, record_attention=recorded)
        state["sequence"].append(token)
        state["generated"].append(token)
        state.update(weights=recorded, pending=int(np.argmax(logits[-1])))
        compare(logits, "decode_step")
        draw()

    def on_choice(_change):
        if "sequence" in state:
            draw()

    decode.on_click(safely(on_decode, message))
    layer_box.observe(safely(on_choice, message), names="value")
    head_box.observe(safely(on_choice, message), names="value")
    wire_reset(on_reset, message, reset, [text])

    box = widgets.VBox([widgets.HBox([decode, reset, layer_box, head_box]), text, status,
                        check, message, live.output])
    box.decode, box.reset, box.prompt, box.layer, box.head = (decode, reset, text, layer_box,
                                                              head_box)
    box.status, box.check, box.message = status, check, message
    box.figure, box.live = live.figure, live
    box.controls = {"decode": decode, "reset": reset, "prompt": text, "layer": layer_box,
                    "head": head_box}
    box.cache = lambda: state.get("cache")
    box.sequence = lambda: list(state.get("sequence", []))
    box.reading = lambda: state.get("reading")
    box.state = state
    return box
