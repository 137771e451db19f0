"""The kv_cached_decode lesson: decode one token at a time against the KV cache, and watch the cache
grow.

``decode_explorer()`` prefills a prompt, then every click on "Decode next token" feeds the
greedy choice to ``kvlib.decode_step``: the drawing of the cache gains one (highlighted) row,
the new token's attention row is shown per head over every cached position, and the result
is checked against a full recomputation with ``kvlib.forward``.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Rectangle

import kvlib
from kvlib import plots
from kvlib.debug import CACHED_TOLERANCES, relative_difference

from .base import LiveFigure, layer_dropdown, plural, read_prompt, safely, wire_reset

TOLERANCE = CACHED_TOLERANCES["float64"]
"""How close cached decoding must come to full recomputation, relative to the logits' size
(the largest |logit|), in float64: the kv_cached_decode lesson, this widget and the README use this
number. Rounding leaves differences of a few 1e-16 (the two ways add the same products in another
order); a real bug moves logits by 1e-3 or more. 1e-10 sits far from both."""


MAX_KEYS_WITH_VALUES = 12  # beyond this many positions, numbers in the cells are unreadable


def draw_decode_state(figure, n_cached: int, n_new: int, weights, query_label: str,
                      key_labels, layer: int = 0, d_model: int = 4):
    """Draw the cache and the newest query's attention (kv_cached_decode) into `figure`, cleared
    first.

    Left: the K and V cache of one layer (every layer has the same shape), its n_cached old
    rows and n_new rows just appended told apart. Right: one strip per head, the attention
    weights (h, S) of the newest query over all S = n_cached + n_new positions.
    Returns (cache Axes, list of head Axes).
    """
    weights = np.asarray(weights, dtype=float)
    n_heads, S = weights.shape
    if S != n_cached + n_new or len(key_labels) != S:
        raise ValueError(f"weights over {S} positions need n_cached + n_new = {S} and {S} key "
                         f"labels, got {n_cached} + {n_new} and {len(key_labels)} labels")
    figure.clear()
    grid = figure.add_gridspec(n_heads, 2, width_ratios=[1.0, 2.4], wspace=0.25, hspace=0.9)
    cache_ax = figure.add_subplot(grid[:, 0])
    # plots.cache_diagram's drawing, with short names so that a tall, narrow cache keeps
    # its labels apart, and the legend below the boxes, out of the way of the strips
    S_shape = (n_cached + n_new, d_model)
    plots.shape_diagram(plots.Box("K", S_shape, new_rows=n_new),
                        plots.Box("V", S_shape, new_rows=n_new), ax=cache_ax,
                        title=f"Layer {layer}'s cache\n(every layer's has this shape)")
    cache_ax.legend(handles=[Rectangle((0, 0), 1, 1, color=plots.OLD_ROWS_COLOR),
                             Rectangle((0, 0), 1, 1, color=plots.NEW_ROWS_COLOR)],
                    labels=[f"cached before ({n_cached})", f"new ({n_new})"],
                    loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    head_axes = []
    # One colour scale for the heads, from 0 to the largest weight on show: over 32 positions
    # the weights are near 1/32, and a fixed 0-1 scale would paint them all the same dark.
    top = float(weights.max())
    for head in range(n_heads):
        ax = figure.add_subplot(grid[head, 1])
        plots.matrix_heatmap(weights[head][None, :], [query_label], list(key_labels), ax=ax,
                             title=f"layer {layer}, head {head}: the newest query over "
                                   f"all {plural(S, 'cached position')}",
                             show_values=S <= MAX_KEYS_WITH_VALUES, vmin=0.0, vmax=top)
        ax.set_ylabel("query")
        ax.set_xlabel("")
        if S > MAX_KEYS_WITH_VALUES:
            ax.tick_params(axis="x", labelrotation=90, labelsize=8)
        head_axes.append(ax)
    figure.colorbar(head_axes[0].images[0], ax=head_axes, fraction=0.03, pad=0.02,
                    label=f"attention weight\n(0 to {top:.2f}, the largest)")
    return cache_ax, head_axes


def decode_explorer(params=None, prompt: str = kvlib.ARTICLE_PROMPT):
    """Greedy decoding one click at a time, the cache drawn as it grows (kv_cached_decode).

    Returns a VBox with the attributes the tests use: ``decode`` (Button "Decode next
    token"), ``reset`` (Button "Reset": prefill the prompt again), ``prompt`` (Text),
    ``layer`` (Dropdown: whose attention is shown), ``status`` (HTML: "Cache holds N
    positions ...", and when the context is full, says so), ``check`` (HTML: the comparison
    with full recomputation, made at every step), ``message`` (HTML: bad text in words),
    ``figure``, ``controls`` (dict), ``cache()`` and ``sequence()`` (the ids in the cache).
    """
    params = kvlib.init_params() if params is None else params
    config = params.config
    tokenizer = kvlib.ToyTokenizer()

    decode = widgets.Button(description="Decode next token", button_style="primary")
    reset = widgets.Button(description="Reset")
    text = widgets.Text(value=prompt, description="prompt", continuous_update=False)
    layer = layer_dropdown(config, description="attention of")
    status = widgets.HTML()
    check = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(11, 4.2))
    # cache, sequence (ids in the cache), pending (the chosen id not yet fed), n_new,
    # weights (per layer, the newest query's (h, S) row), generated (ids chosen so far)
    state = {}

    def compare(logits, sequence, what):
        full = kvlib.forward(params, sequence, last_only=True)
        difference = relative_difference(logits[-1:], full)
        if difference < TOLERANCE:
            check.value = (f"{what} equals full recomputation: the logits differ by "
                           f"{difference:.0e} of their size, below {TOLERANCE:.0e}")
        else:
            check.value = (f"<b>{what} differs from full recomputation</b> "
                           f"(by {difference:.1e} of the logits' size)")

    def choose(logits):
        state["pending"] = int(np.argmax(logits[-1]))
        state["generated"].append(state["pending"])

    def draw():
        sequence = state["sequence"]
        n_new = state["n_new"]
        labels = tokenizer.tokens(sequence)
        draw_decode_state(live.figure, len(sequence) - n_new, n_new,
                          state["weights"][int(layer.value)][:, -1, :], labels[-1], labels,
                          layer=int(layer.value), d_model=config.d_model)
        n = len(sequence)
        generated = tokenizer.decode(state["generated"])
        pending = tokenizer.vocabulary[state["pending"]]
        status.value = (
            f"Cache holds {plural(n, 'position')} (K and V of shape ({n}, {config.d_model}) per "
            "layer). "
            f"Generated: {html.escape(generated)} "
            f'(chosen next, not yet in the cache: "{html.escape(pending, quote=False)}")')
        full = n >= state["cache"].capacity
        decode.disabled = full or state.get("invalid", False)
        if full:  # in the status, since a successful callback clears the message line
            status.value += (f"<br><b>The context is full:</b> the cache holds {n} of "
                             f"{state['cache'].capacity} positions and no further token fits. "
                             "Press Reset to start again.")
        live.show()

    def on_reset(*_):
        try:
            ids = read_prompt(text.value, tokenizer, params.config.context_length)
        except ValueError as error:
            # The box shows text that cannot be decoded: decoding the old sequence under it
            # would mislead, so the button waits for a prompt that works.
            decode.disabled = True
            state["invalid"] = True
            shown = " ".join(tokenizer.tokens(state["sequence"])) if "sequence" in state else ""
            raise ValueError(f"{str(error).rstrip('.')}. Decoding is paused until the prompt "
                             f"works; the figure still shows {shown}") from error
        state["invalid"] = False
        recorded = []
        logits, cache = kvlib.prefill(params, ids, record_attention=recorded)
        state.update(cache=cache, sequence=list(ids), n_new=len(ids), weights=recorded,
                     generated=[])
        choose(logits)
        compare(logits, state["sequence"], "prefill")
        draw()

    def on_decode(_button):
        cache = state.get("cache")
        if cache is None or len(cache) >= cache.capacity or state.get("invalid"):
            decode.disabled = True  # the status already says why; a click here changes nothing
            return
        recorded = []
        token = state["pending"]
        logits = kvlib.decode_step(params, token, cache, record_attention=recorded)
        state["sequence"].append(token)
        state.update(n_new=1, weights=recorded)
        choose(logits)
        compare(logits, state["sequence"], "decode_step")
        draw()

    def on_layer(_change):
        if state:
            draw()

    decode.on_click(safely(on_decode, message))
    layer.observe(safely(on_layer, message), names="value")
    wire_reset(on_reset, message, reset, [text])

    box = widgets.VBox([widgets.HBox([decode, reset, text, layer]), status, check, message,
                        live.output])
    box.decode, box.reset, box.prompt, box.layer = decode, reset, text, layer
    box.status, box.check, box.message = status, check, message
    box.figure, box.live = live.figure, live
    box.controls = {"decode": decode, "reset": reset, "prompt": text, "layer": layer}
    box.cache = lambda: state.get("cache")
    box.sequence = lambda: list(state.get("sequence", []))
    return box
