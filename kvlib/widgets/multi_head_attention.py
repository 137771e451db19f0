"""Widgets of the multi_head_attention lesson (multi-head attention): which columns each head uses,
and what it sees.

head_explorer: pick a layer and a head, see the columns of Q that head works on and its
attention weights. head_count_explorer: a wider model (d_model 8) split into 1, 2, 4 or 8
heads; the same Q, cut into narrower or wider slices. The plot head_columns (a matrix with
each head's columns framed) is also used by the multi_head_attention lesson itself.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.transforms import blended_transform_factory

import kvlib
from kvlib import plots

from .base import LiveFigure, explorer, head_dropdown, layer_dropdown, prompt_box, read_prompt

FRAME_COLOR = "#d62728"   # the chosen head's frame: red stands out on viridis
DIM_ALPHA = 0.65          # how strongly the other heads' columns are washed out


def layer_inputs(params: kvlib.Params, ids) -> list[np.ndarray]:
    """The residual stream entering each block (multi_head_attention): ids (T,) -> n_layers x
    (T, d).

    Element 0 is the embeddings; element i is the output of block i - 1 (causal mask on).
    """
    ids = kvlib.check_ids(ids, params)
    X = kvlib.embed(ids, params.embedding)
    inputs = []
    for index, layer in enumerate(params.layers):
        inputs.append(X)
        X = kvlib.decoder_block(X, layer, params.config.n_heads, mask=kvlib.causal_mask(len(ids)),
                                layer_index=index)
    return inputs


def head_columns(matrix, n_heads: int, row_labels=None, ax=None, highlight: int | None = None,
                 title: str | None = None, name: str = "Q", show_values: bool = True):
    """A (T, d) matrix with each head's columns framed and named (multi_head_attention).

    Head h owns columns h*dh .. (h+1)*dh - 1, dh = d // n_heads. With highlight, that head's
    frame is drawn thick and red and the other heads' columns are washed out.
    """
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"head_columns draws a (tokens, d_model) matrix, got {matrix.shape}")
    rows, columns = matrix.shape
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive whole number, got {n_heads!r}")
    if columns % n_heads:
        raise ValueError(f"cannot split {columns} columns into {n_heads} equal heads")
    if highlight is not None and not 0 <= highlight < n_heads:
        raise ValueError(f"highlight must be a head between 0 and {n_heads - 1}, got {highlight}")
    head_dim = columns // n_heads
    ax = plots.matrix_heatmap(matrix, row_labels, [f"{c}" for c in range(columns)], ax=ax,
                              show_values=show_values)
    if rows > 2 * columns:
        # A long prompt would make the matrix a thin strip whose head labels overlap.
        ax.set_aspect("auto")
    ax.set_xlabel(f"columns of {name}, grouped by head", labelpad=16)
    label_y = blended_transform_factory(ax.transData, ax.transAxes)
    for head in range(n_heads):
        left = head * head_dim - 0.5
        chosen = head == highlight
        if highlight is not None and not chosen:
            ax.add_patch(Rectangle((left, -0.5), head_dim, rows, facecolor="white",
                                   alpha=DIM_ALPHA, edgecolor="none", zorder=3))
        ax.add_patch(Rectangle((left, -0.5), head_dim, rows, fill=False, zorder=4,
                               edgecolor=FRAME_COLOR if chosen else "black",
                               lw=3.5 if chosen else 1.5))
        ax.text(left + head_dim / 2, -0.03, f"head {head}" if head_dim > 1 else f"h{head}",
                transform=label_y, ha="center", va="top", fontsize=9 if n_heads <= 4 else 7,
                fontweight="bold" if chosen else "normal",
                color=FRAME_COLOR if chosen else "black")
    if title:
        ax.set_title(title)
    return ax


def head_explorer(params: kvlib.Params | None = None, prompt: str = kvlib.ARTICLE_PROMPT,
                  tokenizer: kvlib.ToyTokenizer | None = None):
    """The multi_head_attention lesson: choose a layer and a head; see the columns of Q it uses and
    its weights.

    Controls (box.controls): "prompt" (Text), "layer", "head" (Dropdowns). Left axes: that
    layer's Q (T, d) with the head's columns framed; right axes: the head's masked (T, T)
    attention weights. box.state holds Q, the head's slice and its weights.
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    config = params.config
    controls = {
        "prompt": prompt_box(prompt),
        "layer": layer_dropdown(config),
        "head": head_dropdown(config),
    }
    for control in controls.values():
        control.style.description_width = "initial"
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(11, 4.6), n_axes=2, layout="constrained")
    state = {}

    def redraw(_=None):
        status.value = ""
        ids = read_prompt(controls["prompt"].value, tokenizer, params.config.context_length)
        layer, head = controls["layer"].value, controls["head"].value
        labels = tokenizer.tokens(ids)
        X = layer_inputs(params, ids)[layer]
        Q, K, _ = kvlib.project_qkv(X, params.layers[layer])
        mask = kvlib.causal_mask(len(ids))
        weights = kvlib.attention_weights(kvlib.split_heads(Q, config.n_heads),
                                          kvlib.split_heads(K, config.n_heads), mask)[head]
        dh = config.head_dim
        for ax in live.axes:
            ax.clear()
        head_columns(Q, config.n_heads, labels, ax=live.axes[0], highlight=head,
                     title=f"Q of layer {layer} {Q.shape}", show_values=len(ids) <= 8)
        plots.attention_heatmap(weights, labels, labels, mask=mask, ax=live.axes[1],
                                colorbar=False, show_values=len(ids) <= 12,
                                title=f"Layer {layer}, head {head}: weights {weights.shape}")
        status.value = (f"Head {head} uses columns {head * dh}:{(head + 1) * dh} of Q, K and V "
                        f"(head_dim = {config.d_model} / {config.n_heads} = {dh}); its scores "
                        f"are Q[:, {head * dh}:{(head + 1) * dh}] @ K[:, {head * dh}:"
                        f"{(head + 1) * dh}].T / sqrt({dh}), then masked and softmaxed.")
        state.update(ids=ids, Q=Q, head_slice=Q[:, head * dh:(head + 1) * dh], weights=weights)
        live.show()

    return explorer(live, controls, status, message, redraw, state)


def split_for_heads(ids, n_heads: int, d_model: int = 8):
    """The multi_head_attention lesson: the first block's Q and per-head weights of a model with
    d_model columns split into n_heads heads -> (Q (T, d_model), weights (n_heads, T, T)).

    The weights are drawn from the default seed and depend on d_model only, so every split
    cuts the very same Q; ModelConfig raises ValueError when d_model % n_heads != 0.
    """
    config = kvlib.ModelConfig(d_model=d_model, n_heads=n_heads, d_ff=4 * d_model)
    params = kvlib.init_params(config)
    ids = kvlib.check_ids(ids, params)
    X = kvlib.embed(ids, params.embedding)
    Q, K, _ = kvlib.project_qkv(X, params.layers[0])
    weights = kvlib.attention_weights(kvlib.split_heads(Q, n_heads), kvlib.split_heads(K, n_heads),
                                      kvlib.causal_mask(len(ids)))
    return Q, weights


MAX_TICK_LABELS = 8
"""A small heatmap of many heads labels at most this many tokens per axis (every k-th)."""


def draw_head_count(figure, Q, weights, labels, d_model: int) -> None:
    """The multi_head_attention lesson: clear `figure` and draw Q (T, d_model) with its head columns
    framed, next to one masked (T, T) heatmap per head (weights (h, T, T)).

    The artists drawn do not grow with the number of masked cells (one hatch collection per
    heatmap) and, beyond two heads, only a few token labels are written per heatmap, so an
    update stays fast at 8 heads and 32 tokens."""
    heads = weights.shape[0]
    head_dim = d_model // heads
    T = len(labels)
    figure.clear()
    # Fixed margins instead of constrained layout, whose solve over nine axes and their
    # labels was half the time of an update.
    figure.set_layout_engine("none")
    outer = figure.add_gridspec(1, 2, width_ratios=[1.0, 1.4], left=0.07, right=0.99,
                                bottom=0.1, top=0.8, wspace=0.12)
    left = figure.add_subplot(outer[0])
    head_columns(Q, heads, labels, ax=left, show_values=T <= 8,
                 title=f"Q {Q.shape}: {heads} head(s) of {head_dim} column(s)")
    grid_rows = 1 if heads <= 4 else 2
    grid = outer[1].subgridspec(grid_rows, -(-heads // grid_rows), wspace=0.25, hspace=0.55)
    mask = kvlib.causal_mask(T)
    for head in range(heads):
        row, column = divmod(head, grid.ncols)
        ax = figure.add_subplot(grid[row, column])
        crowded = heads > 2 or T > 12
        plots.attention_heatmap(weights[head], labels, labels, mask=mask, ax=ax,
                                colorbar=False, title=f"head {head}", show_values=not crowded,
                                max_labels=MAX_TICK_LABELS if crowded else None)
        if crowded:
            # Token labels on the outer heatmaps only, small and turned: none overlap.
            ax.set_xlabel("")
            ax.set_ylabel("")
            ax.tick_params(labelsize=7, labeltop=row == 0, labelleft=column == 0)
            ax.tick_params(axis="x", rotation=90)
    figure.suptitle(f"A model with d_model = {d_model}: layer 0's Q and its heads", y=0.98)


def head_count_explorer(prompt: str = kvlib.ARTICLE_PROMPT, d_model: int = 8, n_heads: int = 2,
                        tokenizer: kvlib.ToyTokenizer | None = None):
    """The multi_head_attention lesson: one d_model-wide Q cut into 1 .. d_model heads; head_dim =
    d_model / heads.

    Controls (box.controls): "prompt" (Text), "heads" (IntSlider 1..d_model). A count that
    does not divide d_model is explained in box.message. Left: Q with each head's columns
    framed; right: one masked heatmap per head. box.state holds Q, weights and head_dim.
    """
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    vocabulary_model = kvlib.init_params(
        kvlib.ModelConfig(d_model=d_model, n_heads=1, d_ff=4 * d_model))
    controls = {
        "prompt": prompt_box(prompt),
        "heads": widgets.IntSlider(value=n_heads, min=1, max=d_model, description="heads",
                                   continuous_update=False),
    }
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(12, 5.2), layout="constrained")
    state = {}

    def redraw(_=None):
        status.value = ""
        ids = read_prompt(controls["prompt"].value, tokenizer,
                          vocabulary_model.config.context_length)
        heads = controls["heads"].value
        Q, weights = split_for_heads(ids, heads, d_model)
        labels = tokenizer.tokens(ids)
        head_dim = d_model // heads
        draw_head_count(live.figure, Q, weights, labels, d_model)
        live.axes = live.figure.axes
        status.value = (f"{d_model} columns / {heads} head(s) = head_dim {head_dim}: each head "
                        f"compares tokens using {head_dim} number(s) per token, and its scores "
                        f"are divided by sqrt({head_dim}) = {np.sqrt(head_dim):.3f}. Same Q, "
                        f"cut into {heads} slice(s); {heads} attention pattern(s) of "
                        f"{weights.shape[1:]}.")
        state.update(ids=ids, Q=Q, weights=weights, head_dim=head_dim)
        live.show()

    return explorer(live, controls, status, message, redraw, state)
