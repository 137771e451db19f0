"""Widgets of the one_attention_head lesson (one attention head, before the causal mask).

head_weights: one head's attention weights without a mask, with or without the 1/sqrt(dh)
scaling and at a chosen temperature. draw_query_row / query_row_figure: that head's heatmap
with one query's row outlined, next to the same row as bars, where the keys AFTER the query
are hatched (the positions the causal_masking lesson's mask removes). attention_explorer: the
widget.
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

import kvlib
from kvlib import plots

from .base import LiveFigure, carry, read_prompt, safely

QUERY_COLOR = "#d6004c"   # crimson: the chosen query's row
SEEN_COLOR = plt.get_cmap(plots.COLORMAP)(0.35)
FUTURE_COLOR = "#d0d0d0"  # light grey, hatched: keys after the query
MAX_TOKENS = 10
"""The explorer draws at most this many tokens (BOS included), so the heatmap stays readable."""


def head_scores(params: kvlib.Params, ids, layer: int = 0, head: int = 0,
                scaled: bool = True) -> np.ndarray:
    """One head's attention scores, no mask (one_attention_head): ids (T,) -> (T, T).

    The embeddings X (T, d) go through the layer's Wq and Wk; the head keeps its dh columns;
    scores = Q_h K_h^T, divided by sqrt(dh) when scaled (as kvlib.attention_scores does).
    """
    ids = kvlib.check_ids(ids, params)
    config = params.config
    if not 0 <= layer < config.n_layers:
        raise ValueError(f"layer must be between 0 and {config.n_layers - 1}, got {layer}")
    if not 0 <= head < config.n_heads:
        raise ValueError(f"head must be between 0 and {config.n_heads - 1}, got {head}")
    X = kvlib.embed(ids, params.embedding)
    Q, K, _ = kvlib.project_qkv(X, params.layers[layer])
    Qh = kvlib.split_heads(Q, config.n_heads)[head]
    Kh = kvlib.split_heads(K, config.n_heads)[head]
    scores = kvlib.attention_scores(Qh, Kh)
    return scores if scaled else scores * math.sqrt(config.head_dim)


def head_weights(params: kvlib.Params, ids, layer: int = 0, head: int = 0, scaled: bool = True,
                 temperature: float = 1.0) -> np.ndarray:
    """One head's attention weights, no mask (one_attention_head): ids (T,) -> (T, T), rows sum to
    1.

    softmax(scores / temperature): a temperature below 1 stretches the scores, as a bigger
    head would without the 1/sqrt(dh) scaling, and pushes each row towards one-hot.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    scores = head_scores(params, ids, layer, head, scaled)
    return kvlib.softmax(scores / float(temperature))


def draw_query_row(heat_ax, bar_ax, weights, labels, query: int, title: str | None = None):
    """Draw a head's weights (T, T) and one query's row (one_attention_head) into two axes.

    Left: the heatmap (kvlib.plots.attention_heatmap) on a colour scale spanning the weights'
    own range (untrained weights are all close to 1 / T), each row's largest weight framed,
    the query's row outlined in crimson. The bars keep a fixed 0-1 scale, so that a sharper
    or flatter softmax shows there.
    Right: that row as bars with their values; keys after the query are hatched grey.
    Returns the bars' title, so that a caller can add a line to it.
    """
    weights = np.asarray(weights, dtype=float)
    T = weights.shape[0]
    if not 0 <= query < T:
        raise ValueError(f"query must be a position between 0 and {T - 1}, got {query}")
    span = f"colours span {weights.min():.2f}-{weights.max():.2f}"
    plots.attention_heatmap(weights, labels, labels, ax=heat_ax, colorbar=False,
                            title=f"{title}\n({span})" if title else span, show_values=T <= 7,
                            vmin=None, vmax=None, mark_row_max=True)
    if T > 6:
        for tick in heat_ax.get_xticklabels():
            tick.set(rotation=60, ha="left", rotation_mode="anchor")
    heat_ax.add_patch(Rectangle((-0.5, query - 0.5), weights.shape[1], 1, fill=False,
                                edgecolor=QUERY_COLOR, lw=3, zorder=4))
    row = weights[query]
    future = np.arange(len(row)) > query
    bars = bar_ax.bar(range(len(row)), row, color=[FUTURE_COLOR if f else SEEN_COLOR
                                                  for f in future],
                      edgecolor="black", lw=0.6)
    for bar, is_future in zip(bars, future):
        if is_future:
            bar.set_hatch("///")
    for position, value in enumerate(row):
        bar_ax.text(position, value + 0.02, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    bar_ax.set_xticks(range(len(row)), [f"{j}\n{label}" for j, label in enumerate(labels)])
    bar_ax.set_ylim(0, 1.12)
    bar_ax.set_xlabel("key (attended to)")
    bar_ax.set_ylabel("attention weight")
    bars_title = f"row {query}: whom '{labels[query]}' attends to"
    bar_ax.set_title(bars_title)
    bar_ax.legend(handles=[Patch(facecolor=SEEN_COLOR, edgecolor="black", label="up to the query"),
                           Patch(facecolor=FUTURE_COLOR, edgecolor="black", hatch="///",
                                 label="after the query (masked in 03)")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False,
                  fontsize=8)
    return bars_title


FIGSIZE = (11, 5.0)


def query_row_figure(weights, labels, query: int, title: str | None = None):
    """The heatmap and one query's bars as a plain, new figure
    (one_attention_head, before the widget)."""
    figure, (heat_ax, bar_ax) = plt.subplots(1, 2, figsize=FIGSIZE,
                                             gridspec_kw={"width_ratios": [1.1, 1]})
    draw_query_row(heat_ax, bar_ax, weights, labels, query, title)
    figure.tight_layout()
    return figure


def attention_summary(weights, labels, query: int) -> str:
    """One query's row in words (HTML): the key it attends to most, and its weight on the future."""
    row = np.asarray(weights)[query]
    top = int(np.argmax(row))
    future = float(row[query + 1:].sum())
    text = (f"Query <b>{html.escape(labels[query])}</b> (position {query}) attends most to "
            f"<b>{html.escape(labels[top])}</b> (position {top}), weight {row[top]:.3f}. ")
    if query == len(row) - 1:
        return text + "It is the last token: every key is at or before it."
    return text + (f"It puts {future:.3f} of its weight on tokens that come after it, which a "
                   "model generating text cannot see yet: notebook 03's mask sets that to 0.")


def attention_explorer(params: kvlib.Params | None = None, text: str = kvlib.ARTICLE_PROMPT,
                       layer: int = 0, head: int = 0, query: int = 0):
    """Pick a query and see whom it attends to in one unmasked head (one_attention_head).

    Controls: ``sentence`` (Text, applied on Enter), ``query`` (Dropdown of the sentence's
    positions), ``head`` (ToggleButtons), ``scaled`` (Checkbox: divide the scores by
    sqrt(dh)), ``temperature`` (log slider 0.03-10: softmax(scores / temperature)). Also
    ``controls`` (all by name), ``summary`` (HTML: the query's strongest key), ``status``
    (HTML: errors in words, the last good picture stays), ``figure``, ``axes`` (heatmap,
    bars) and ``shown`` (a dict with the "ids", "labels" and "weights" (T, T) on show).
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer()
    config = params.config

    def read(text):
        return read_prompt(text, tokenizer, MAX_TOKENS)

    ids = read(text)
    if not 0 <= layer < config.n_layers or not 0 <= head < config.n_heads:
        raise ValueError(f"layer must be between 0 and {config.n_layers - 1} and head between "
                         f"0 and {config.n_heads - 1}, got layer {layer} and head {head}")
    if not 0 <= query < len(ids):
        raise ValueError(f"query must be a position between 0 and {len(ids) - 1}, got {query}")

    def positions(labels):
        return [(f"{t}: {label}", t) for t, label in enumerate(labels)]

    labels = tokenizer.tokens(ids)
    sentence = widgets.Text(value=text, description="sentence", continuous_update=False,
                            layout=widgets.Layout(width="330px"))
    query_control = widgets.Dropdown(options=positions(labels), value=query,
                                     description="query")
    head_control = widgets.ToggleButtons(
        options=[(f"head {h}", h) for h in range(config.n_heads)], value=head,
        description="head", style={"button_width": "70px"})
    scaled = widgets.Checkbox(value=True, description="divide the scores by √dh")
    temperature = widgets.FloatLogSlider(value=1.0, base=10, min=-1.5, max=1.0, step=0.05,
                                         description="temperature", readout_format=".2f",
                                         continuous_update=False)
    summary, status = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=FIGSIZE, n_axes=2, gridspec_kw={"width_ratios": [1.1, 1]})
    shown = {"ids": ids, "labels": labels, "weights": None}
    replacing_options = [False]

    def draw():
        weights = head_weights(params, shown["ids"], layer, head_control.value, scaled.value,
                               temperature.value)
        shown["weights"] = weights
        for ax in live.axes:
            ax.clear()
        scale = "scores / √dh" if scaled.value else "scores NOT divided by √dh"
        bars_title = draw_query_row(*live.axes, weights, shown["labels"], query_control.value,
                                    title=f"layer {layer}, head {head_control.value}, no mask")
        live.axes[1].set_title(f"{bars_title}\n({scale}, temperature {temperature.value:.2f})")
        live.figure.tight_layout()
        summary.value = attention_summary(weights, shown["labels"], query_control.value)
        live.show()

    def on_sentence(change):
        new_ids = read(change["new"])
        shown["ids"], shown["labels"] = new_ids, tokenizer.tokens(new_ids)
        keep = min(query_control.value, len(new_ids) - 1)
        replacing_options[0] = True   # changing the options would redraw with the old ids
        try:
            query_control.options = positions(shown["labels"])
            query_control.value = keep
        finally:
            replacing_options[0] = False
        draw()

    def on_control(_change):
        if not replacing_options[0]:
            draw()

    sentence.observe(safely(on_sentence, status), names="value")
    for control in (query_control, head_control, scaled, temperature):
        control.observe(safely(on_control, status), names="value")
    draw()

    box = widgets.VBox([widgets.HBox([sentence, query_control]),
                        widgets.HBox([head_control, scaled]), temperature, summary, status,
                        live.output])
    controls = {"sentence": sentence, "query": query_control, "head": head_control,
                "scaled": scaled, "temperature": temperature}
    return carry(box, controls, live, summary=summary, status=status, shown=shown)
