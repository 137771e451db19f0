"""Widgets of the mlp_residual_stream lesson (MLP, residual stream, block stack).

stream_explorer: apply 0 to n_layers blocks and follow one token's vector in the residual
stream, with the size of every edit the blocks make to it. gelu_explorer: GeLU next to ReLU
over a range of your choice, evaluated at any x. residual_stream and the plots draw_stream and
gelu_plot are also used by the mlp_residual_stream lesson itself.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

import kvlib
from kvlib import plots

from .base import LiveFigure, as_html, explorer, prompt_box, read_prompt

ATTENTION_COLOR = plt.get_cmap(plots.COLORMAP)(0.25)
MLP_COLOR = plt.get_cmap(plots.COLORMAP)(0.75)
GELU_COLOR = plt.get_cmap(plots.COLORMAP)(0.3)
RELU_COLOR = "#888888"
GELU_MINIMUM_X = -0.7525
"""Where the tanh form of GeLU is smallest (value about -0.170); found numerically."""


def residual_stream(params: kvlib.Params, ids) -> dict[str, list[np.ndarray]]:
    """The residual stream block by block (mlp_residual_stream): ids (T,) -> a dict of lists.

    "streams": X0 (the embeddings) .. Xn, each (T, d); "attention" and "mlp": the n_layers
    updates each block adds, each (T, d), so that X(i+1) = Xi + attention[i] + mlp[i].
    Built from the same steps as kvlib.decoder_block, which the tests check it equals.
    """
    ids = kvlib.check_ids(ids, params)
    n_heads = params.config.n_heads
    mask = kvlib.causal_mask(len(ids))
    X = kvlib.embed(ids, params.embedding)
    streams, attention_updates, mlp_updates = [X], [], []
    for layer in params.layers:
        Q, K, V = (kvlib.split_heads(M, n_heads) for M in kvlib.project_qkv(X, layer))
        attention_update = kvlib.output_projection(
            kvlib.merge_heads(kvlib.attention(Q, K, V, mask)), layer.Wo)
        H = X + attention_update
        mlp_update = kvlib.mlp(H, layer)
        X = H + mlp_update
        streams.append(X)
        attention_updates.append(attention_update)
        mlp_updates.append(mlp_update)
    return {"streams": streams, "attention": attention_updates, "mlp": mlp_updates}


def draw_stream(axes, stream: dict, token: int, blocks: int, labels) -> None:
    """Three panels (mlp_residual_stream) for `token` after `blocks` blocks: the stream X_blocks as
    a heatmap with the token's row framed; the token's vector after 0..blocks blocks as bars;
    and the size (norm) of each block's attention and MLP update to it."""
    streams = stream["streams"]
    n_layers = len(streams) - 1
    if not 0 <= blocks <= n_layers:
        raise ValueError(f"blocks must be between 0 and {n_layers}, got {blocks}")
    if not 0 <= token < len(labels):
        raise ValueError(f"token must be a position between 0 and {len(labels) - 1}, got {token}")
    heat, vector, sizes = axes
    X = streams[blocks]
    T, d = X.shape
    plots.matrix_heatmap(X, labels, [f"{c}" for c in range(d)], ax=heat, show_values=T <= 6,
                         title=f"X{blocks} {X.shape}: the stream after {blocks} block(s)")
    heat.add_patch(Rectangle((-0.5, token - 0.5), d, 1, fill=False, edgecolor="#d62728", lw=3))

    history = np.array([s[token] for s in streams])            # (n_layers + 1, d)
    width = 0.8 / (n_layers + 1)
    colors = plt.get_cmap(plots.COLORMAP)(np.linspace(0.0, 0.9, n_layers + 1))
    for stage in range(blocks + 1):
        vector.bar(np.arange(d) + (stage - n_layers / 2) * width, history[stage], width,
                   color=colors[stage], edgecolor="black", lw=0.4, label=f"X{stage}")
    limit = 1.15 * np.abs(history).max()
    vector.set_ylim(-limit, limit)
    vector.axhline(0, color="black", lw=0.6)
    vector.set_xticks(range(d), [f"{c}" for c in range(d)])
    vector.set_xlabel("component of the vector")
    vector.set_title(f"Token {token} '{labels[token]}': its vector, block by block")
    vector.legend(loc="upper right", fontsize=8, ncol=2, frameon=False)

    steps = np.arange(1, n_layers + 1)
    for offset, name, color in ((-0.2, "attention", ATTENTION_COLOR), (0.2, "mlp", MLP_COLOR)):
        norms = np.array([np.linalg.norm(u[token]) for u in stream[name]])
        applied = steps <= blocks
        sizes.bar(steps[applied] + offset, norms[applied], 0.4, color=color, edgecolor="black",
                  lw=0.5)
        sizes.bar(steps[~applied] + offset, norms[~applied], 0.4, fill=False, hatch="//",
                  edgecolor="#aaaaaa", lw=0.5)
    embedding = np.linalg.norm(streams[0][token])
    sizes.axhline(embedding, color="black", ls="--", lw=1)
    # The legend is built by hand: at 0 blocks no coloured bar exists to take a swatch from.
    handles = [Patch(facecolor=ATTENTION_COLOR, edgecolor="black", label="attention update"),
               Patch(facecolor=MLP_COLOR, edgecolor="black", label="MLP update"),
               Line2D([], [], color="black", ls="--", lw=1, label="size of the embedding X0")]
    if blocks < n_layers:
        handles.append(Patch(fill=False, hatch="//", edgecolor="#aaaaaa",
                             label="block not applied yet"))
    sizes.set_xticks(steps, [f"block {s}" + ("" if s <= blocks else "\n(not applied)")
                             for s in steps])
    sizes.set_ylabel("size of the update (norm)")
    sizes.set_title("How much each block edits this token")
    sizes.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)
    top = max(np.linalg.norm(streams[0][token]),
              *(np.linalg.norm(u[token]) for name in ("attention", "mlp") for u in stream[name]))
    sizes.set_ylim(0, 1.45 * top)


def stream_explorer(params: kvlib.Params | None = None, prompt: str = kvlib.ARTICLE_PROMPT,
                    tokenizer: kvlib.ToyTokenizer | None = None, blocks: int = 3, token: int = 4):
    """The mlp_residual_stream lesson: apply 0 .. n_layers blocks and follow one token through the
    stream.

    Controls (box.controls): "prompt" (Text), "blocks" (IntSlider 0..n_layers), "token"
    (Dropdown of the prompt's positions). box.state holds the residual_stream dict and the
    chosen token and block count; box.status gives the token's numbers.
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    first_ids = read_prompt(prompt, tokenizer, params.config.context_length)

    def token_options(ids):
        return [(f"{i} {word}", i) for i, word in enumerate(tokenizer.tokens(ids))]

    controls = {
        "prompt": prompt_box(prompt),
        "blocks": widgets.IntSlider(value=blocks, min=0, max=params.config.n_layers,
                                    description="blocks applied", continuous_update=False),
        "token": widgets.Dropdown(options=token_options(first_ids),
                                  value=min(token, len(first_ids) - 1), description="token"),
    }
    for control in controls.values():
        control.style.description_width = "initial"
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(14, 4.2), n_axes=3, layout="constrained",
                      gridspec_kw={"width_ratios": [1, 1.2, 1.2]})
    state = {"updating": False}

    def redraw(_=None):
        if state["updating"]:
            return
        status.value = ""
        ids = read_prompt(controls["prompt"].value, tokenizer, params.config.context_length)
        dropdown = controls["token"]
        options = token_options(ids)
        if list(dropdown.options) != options:
            # A new prompt: offer its positions, keeping the chosen one when it still exists.
            state["updating"] = True
            try:
                keep = min(dropdown.value if dropdown.value is not None else 0, len(ids) - 1)
                dropdown.options = options
                dropdown.value = keep
            finally:
                state["updating"] = False
        token, blocks = dropdown.value, controls["blocks"].value
        labels = tokenizer.tokens(ids)
        stream = residual_stream(params, ids)
        for ax in live.axes:
            ax.clear()
        draw_stream(live.axes, stream, token, blocks, labels)
        vector = stream["streams"][blocks][token]
        edits = 2 * blocks
        status.value = as_html(
            f"Token {token} '{labels[token]}' after {blocks} block(s): X{blocks}[{token}] = "
            f"{np.array2string(vector, precision=3)}, the embedding plus {edits} update(s) "
            "added to it, none replacing it.")
        state.update(ids=ids, stream=stream, token=token, blocks=blocks)
        live.show()

    return explorer(live, controls, status, message, redraw, state)


def gelu_at(x: float) -> float:
    """kvlib.gelu at one number (mlp_residual_stream's widget). Far from 0 the cube inside overflows
    to inf, which the tanh turns into exactly x or 0: the right values, so numpy's overflow
    warning is silenced rather than shown to the student."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(kvlib.gelu(np.array(float(x)))) + 0.0   # + 0.0 turns -0.0 into 0.0


def readable(value: float) -> str:
    """A number for the mlp_residual_stream lesson's status line: 3 decimals, or 4 significant
    digits with an exponent when it is large (gelu(1e308) is 1e308, not a 309-digit number)."""
    return f"{value:.3f}" if abs(value) < 1e6 else f"{value:.4g}"


def gelu_plot(low: float = -4.0, high: float = 4.0, ax=None, x: float | None = None,
              show_relu: bool = True):
    """GeLU (kvlib.gelu) next to ReLU on [low, high] (mlp_residual_stream), the dip below zero
    marked; with x, both evaluated there. Returns the Axes."""
    for name, value in (("low", low), ("high", high)) + ((("x", x),) if x is not None else ()):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        if not np.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    if not high > low:
        raise ValueError(f"choose a range wider than zero: got low {low} and high {high}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    grid = np.linspace(low, high, 801)
    curve = kvlib.gelu(grid)
    ax.plot(grid, curve, color=GELU_COLOR, lw=2.5, label="GeLU")
    if show_relu:
        ax.plot(grid, np.maximum(grid, 0.0), color=RELU_COLOR, lw=1.5, ls="--", label="ReLU")
    ax.axhline(0, color="black", lw=0.6)
    ax.axvline(0, color="black", lw=0.6)
    bottom, top = min(float(curve.min()), 0.0), max(float(curve.max()), high, 0.0)
    span = max(top - bottom, 0.2)
    ax.set_ylim(bottom - 0.15 * span, top + 0.1 * span)
    if low <= GELU_MINIMUM_X <= high:
        lowest = float(kvlib.gelu(np.array(GELU_MINIMUM_X)))
        ax.plot([GELU_MINIMUM_X], [lowest], "v", color="black")
        ax.annotate(f"the dip: {lowest:.3f} at x = {GELU_MINIMUM_X:.2f}",
                    (GELU_MINIMUM_X, lowest), xytext=(0.05, 0.45), textcoords="axes fraction",
                    fontsize=9, arrowprops={"arrowstyle": "->", "color": "black"})
    if x is not None:
        ax.plot([x], [gelu_at(x)], "o", color=plots.NEW_ROWS_COLOR,
                markeredgecolor="black", markersize=9, zorder=5, label=f"x = {x:g}")
    ax.set_xlim(low, high)
    ax.set_xlabel("x (one hidden unit's input)")
    ax.set_ylabel("activation")
    ax.set_title("GeLU is a smooth ReLU that lets small negatives through")
    ax.legend(loc="upper left", frameon=False)
    return ax


def gelu_explorer(low: float = -4.0, high: float = 4.0, x: float = -0.75):
    """The mlp_residual_stream lesson: GeLU vs ReLU over a chosen range, and both evaluated at a
    chosen x.

    Controls (box.controls): "range" (FloatRangeSlider), "x" (FloatText), "relu"
    (Checkbox). box.status gives gelu(x) and relu(x); a non-finite x or an empty range is
    explained in box.message.
    """
    controls = {
        "range": widgets.FloatRangeSlider(value=(low, high), min=-10.0, max=10.0, step=0.5,
                                          description="x range", continuous_update=False),
        "x": widgets.FloatText(value=x, description="x", layout=widgets.Layout(width="12em")),
        "relu": widgets.Checkbox(value=True, description="show ReLU"),
    }
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(7, 4.2), layout="constrained")
    state = {}

    def redraw(_=None):
        status.value = ""
        low, high = (float(v) for v in controls["range"].value)
        point = float(controls["x"].value)
        live.ax.clear()
        gelu_plot(low, high, ax=live.ax, x=point, show_relu=controls["relu"].value)
        gelu_value = gelu_at(point)
        status.value = (f"gelu({point:g}) = {readable(gelu_value)}, relu({point:g}) = "
                        f"{readable(max(point, 0.0))}"
                        + ("" if low <= point <= high else " (x is outside the plotted range)"))
        state.update(x=point, gelu=gelu_value)
        live.show()

    return explorer(live, controls, status, message, redraw, state)
