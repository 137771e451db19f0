"""Widgets of the causal_masking lesson (causal masking): the mask on and off, and what a changed
token reaches.

mask_explorer: one head's attention weights, with the causal mask on or off, for any layer
and head. change_explorer: replace the token at one position and see, row by row, how much the
model's output (the logits) changes: exactly 0 for every row before that position.
The plot row_change_bars is also used by the causal_masking lesson itself.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.patches import Rectangle

import kvlib
from kvlib import plots

from .base import (
    LiveFigure,
    as_html,
    explorer,
    head_dropdown,
    layer_dropdown,
    prompt_box,
    read_prompt,
)

UNCHANGED_COLOR = plt.get_cmap(plots.COLORMAP)(0.35)
CHANGED_COLOR = plots.NEW_ROWS_COLOR


def attention_by_layer(params: kvlib.Params, ids, masked: bool = True) -> list[np.ndarray]:
    """Every layer's attention weights (causal_masking): ids (T,) -> list of n_layers (h, T, T).

    masked=True is the real model (kvlib.forward); masked=False runs the same blocks without
    the causal mask, so that later layers also see what an unmasked model would compute.
    """
    ids = kvlib.check_ids(ids, params)
    record: list[np.ndarray] = []
    if masked:
        kvlib.forward(params, ids, record_attention=record)
        return record
    X = kvlib.embed(ids, params.embedding)
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, params.config.n_heads, mask=None,
                                layer_index=index, record_attention=record)
    return record


def row_changes(params: kvlib.Params, ids, position: int, replacement: int) -> np.ndarray:
    """How much each output row moves when one token is replaced (causal_masking).

    ids (T,), the position to change and the new token id -> (T,): for each row, the largest
    absolute change in its logits. Rows before `position` are exactly 0 under the causal mask.
    """
    ids = kvlib.check_ids(ids, params)
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise TypeError(f"position must be a whole number, got {position!r}")
    if not 0 <= position < len(ids):
        raise ValueError(f"position must be between 0 and {len(ids) - 1}, got {position}")
    changed = ids.copy()
    changed[position] = replacement
    changed = kvlib.check_ids(changed, params, what="changed prompt")
    before = kvlib.forward(params, ids)
    after = kvlib.forward(params, changed)
    return np.abs(after - before).max(axis=1)


def row_change_bars(changes, labels, position: int, ax=None, replacement_label: str | None = None):
    """Bar chart of row_changes (causal_masking): one bar per position; the rows that cannot see
    the changed position are labelled "0 exactly", the changed position is marked."""
    changes = np.asarray(changes, dtype=float)
    if changes.ndim != 1 or len(labels) != len(changes):
        raise ValueError(f"need one label per row, got {len(labels)} labels for {changes.shape}")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.5 + 0.9 * len(changes), 3.6), layout="constrained")
    rows = np.arange(len(changes))
    colors = [UNCHANGED_COLOR if r < position else CHANGED_COLOR for r in rows]
    ax.bar(rows, changes, color=colors, edgecolor="black", lw=0.6)
    top = max(float(changes.max()), 1e-3)
    ax.set_ylim(0, top * 1.25)
    for r in rows:
        text = "0 exactly" if changes[r] == 0 else f"{changes[r]:.2f}"
        ax.text(r, changes[r] + top * 0.03, text, ha="center", va="bottom", fontsize=9)
    ax.axvline(position - 0.5, color="black", ls="--", lw=1)
    ax.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=UNCHANGED_COLOR, edgecolor="black"),
                       Rectangle((0, 0), 1, 1, facecolor=CHANGED_COLOR, edgecolor="black")],
              labels=[f"before position {position}: cannot see it",
                      f"position {position} and after: can see it"],
              loc="upper left", fontsize=8, frameon=False)
    tick_labels = [f"{r}\n{label}" for r, label in zip(rows, labels)]
    if replacement_label is not None:
        tick_labels[position] = f"{position}\n{labels[position]} -> {replacement_label}"
    ax.set_xticks(rows, tick_labels)
    ax.set_xlabel("output row (position and token)")
    ax.set_ylabel("largest |change| in logits")
    ax.set_title(f"Replacing the token at position {position}: which rows change?")
    return ax


def _rows(first: int, last: int) -> str:
    return f"row {first}" if first == last else f"rows {first}-{last}"


def mask_explorer(params: kvlib.Params | None = None, prompt: str = kvlib.ARTICLE_PROMPT,
                  tokenizer: kvlib.ToyTokenizer | None = None):
    """The causal_masking lesson: one head's (T, T) attention weights with the causal mask on or
    off.

    Controls (box.controls): "prompt" (Text), "mask" (True = on), "layer", "head". The
    heatmap's image holds the weights, masked cells as masked entries (drawn grey, hatched);
    box.status says how much weight the first token gives to later ones; box.message shows
    what is wrong with a bad prompt.
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    config = params.config
    controls = {
        "prompt": prompt_box(prompt),
        "mask": widgets.ToggleButtons(options=[("mask on", True), ("mask off", False)],
                                      value=True, description="causal mask"),
        "layer": layer_dropdown(config),
        "head": head_dropdown(config),
    }
    for control in controls.values():
        control.style.description_width = "initial"
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(6.2, 4.8), layout="constrained")
    live.figure.colorbar(ScalarMappable(Normalize(0.0, 1.0), cmap=plots.COLORMAP), ax=live.ax,
                         fraction=0.046, pad=0.04, label="attention weight")
    state = {}

    def redraw(_=None):
        status.value = ""
        ids = read_prompt(controls["prompt"].value, tokenizer, params.config.context_length)
        masked = controls["mask"].value
        layer, head = controls["layer"].value, controls["head"].value
        weights = attention_by_layer(params, ids, masked)[layer][head]
        labels = tokenizer.tokens(ids)
        mask = kvlib.causal_mask(len(ids)) if masked else None
        live.ax.clear()
        plots.attention_heatmap(weights, labels, labels, mask=mask, ax=live.ax, colorbar=False,
                                show_values=len(ids) <= 12, title=f"Layer {layer}, head {head}, "
                                f"mask {'on' if masked else 'off'}")
        future = float(np.triu(weights, k=1).sum(axis=1)[0])
        if len(ids) == 1:
            text = (f"With a single token ({labels[0]}) there is nothing after it to read: "
                    "mask or no mask, it attends only to itself (weight 1.00). Add words to "
                    "the prompt to see the mask at work.")
        elif masked:
            text = ("Every cell above the diagonal is masked: row t weighs only tokens 0..t, "
                    f"and each row still sums to 1. The first token ({labels[0]}) can only "
                    f"attend to itself (weight {weights[0, 0]:.2f}).")
        else:
            text = (f"Without the mask the first token ({labels[0]}) gives {future:.2f} of "
                    "its weight to later tokens: it reads the future.")
        status.value = as_html(text)
        state.update(ids=ids, weights=weights, mask=mask)
        live.show()

    return explorer(live, controls, status, message, redraw, state)


def change_explorer(params: kvlib.Params | None = None, prompt: str = kvlib.ARTICLE_PROMPT,
                    tokenizer: kvlib.ToyTokenizer | None = None, position: int = 3,
                    replacement: int = 5):
    """The causal_masking lesson: replace the token at one position and see which output rows
    change.

    Controls (box.controls): "prompt" (Text), "position" (IntSlider, kept within the prompt),
    "replacement" (Dropdown of token ids). The bars are row_changes: exactly 0 before the
    position. box.state["changes"] holds the bar heights; box.status says which rows moved.
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    first_ids = read_prompt(prompt, tokenizer, params.config.context_length)
    controls = {
        "prompt": prompt_box(prompt),
        "position": widgets.IntSlider(value=min(position, len(first_ids) - 1), min=0,
                                      max=len(first_ids) - 1, description="position to change",
                                      continuous_update=False),
        "replacement": widgets.Dropdown(
            options=[(f"{i} {word}", i) for i, word in enumerate(tokenizer.vocabulary)],
            value=replacement, description="new token"),
    }
    for control in controls.values():
        control.style.description_width = "initial"
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(7.5, 3.8), layout="constrained")
    state = {}

    def redraw(_=None):
        status.value = ""
        ids = read_prompt(controls["prompt"].value, tokenizer, params.config.context_length)
        slider = controls["position"]
        if slider.max != len(ids) - 1:
            # Keep the slider within the new prompt; setting it fires this callback again.
            slider.max = len(ids) - 1
        position = min(slider.value, len(ids) - 1)
        new_token = controls["replacement"].value
        labels = tokenizer.tokens(ids)
        changes = row_changes(params, ids, position, new_token)
        new_label = tokenizer.vocabulary[new_token]
        live.ax.clear()
        row_change_bars(changes, labels, position, ax=live.ax, replacement_label=new_label)
        if ids[position] == new_token:
            text = (f"Position {position} already holds '{labels[position]}': nothing "
                    "changed, so every bar is 0.")
        else:
            last = len(ids) - 1
            before = ("" if position == 0 else f"{_rows(0, position - 1)}: change exactly 0 "
                      f"(cannot see position {position}); ")
            text = (f"Replaced '{labels[position]}' at position {position} by '{new_label}'. "
                    f"{before}{_rows(position, last)}: changed (largest change "
                    f"{changes.max():.3f}).")
        status.value = as_html(text)
        state.update(ids=ids, position=position, changes=changes)
        live.show()

    return explorer(live, controls, status, message, redraw, state)
