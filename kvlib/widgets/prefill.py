"""The prefill lesson: prefill a prompt and look inside the cache it leaves behind.

``prefill_explorer()`` takes a prompt typed in words of the toy vocabulary, runs
``kvlib.prefill`` on it, and shows one layer's cached K and V as heatmaps (a row per token),
with the first predicted token. Text outside the vocabulary shows the tokenizer's message.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import plots

from .base import LiveFigure, carry, layer_dropdown, plural, read_prompt, safely

MAX_ROWS_WITH_VALUES = 12  # beyond this many tokens, numbers in the cells are unreadable


def draw_cache_contents(axes, cache, layer: int, token_labels) -> None:
    """Heatmaps of one layer's cached K and V (T, d), one row per token (prefill).

    `axes` is a pair of matplotlib Axes (cleared first); the rows are labelled with the tokens.
    The titles are short ("K (21, 4)"), so that two narrow heatmaps of a long prompt keep them
    apart; the layer goes in the figure's title (see draw_cache_figure) or the caller's.
    """
    if len(token_labels) != len(cache):
        raise ValueError(f"need one label per cached position: {len(cache)} positions, "
                         f"{len(token_labels)} labels")
    for ax, name, matrix in zip(axes, ("K", "V"), (cache.keys(layer), cache.values(layer))):
        ax.clear()
        plots.matrix_heatmap(matrix, row_labels=token_labels,
                             column_labels=[str(c) for c in range(matrix.shape[1])], ax=ax,
                             show_values=len(matrix) <= MAX_ROWS_WITH_VALUES,
                             title=f"{name} {matrix.shape}")
        ax.set_xlabel("column")
        if len(matrix) > MAX_ROWS_WITH_VALUES:
            ax.tick_params(axis="y", labelsize=7)


def prefill_explorer(params=None, prompt: str = kvlib.ARTICLE_PROMPT):
    """Type a prompt, prefill it, see each layer's cached K and V (T, d) (prefill).

    Returns a VBox with the attributes the tests use: ``prompt`` (Text; Enter or the button
    prefills), ``prefill`` (Button), ``layer`` (Dropdown), ``status`` (HTML: tokens, cache
    shapes and bytes, the first predicted token), ``message`` (HTML: the tokenizer's or the
    model's complaint about bad text), ``figure`` and ``axes`` (the K and V heatmaps),
    ``controls`` (dict) and ``cache()`` (the cache on show).
    """
    params = kvlib.init_params() if params is None else params
    config = params.config
    tokenizer = kvlib.ToyTokenizer()

    text = widgets.Text(value=prompt, description="prompt", continuous_update=False,
                        placeholder="words of the vocabulary, e.g. How are you?")
    button = widgets.Button(description="Prefill")
    layer = layer_dropdown(config)
    words = widgets.HTML("<b>Vocabulary:</b> " + html.escape(" ".join(tokenizer.words()))
                         + " (a BOS token is put in front)")
    status = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(9, 4.2), n_axes=2)
    state = {}

    def draw():
        draw_cache_contents(live.axes, state["cache"], int(layer.value), state["labels"])
        live.figure.suptitle(f"Layer {int(layer.value)}'s cache after the prefill: one row per "
                             "token")
        live.figure.tight_layout()
        live.show()

    def on_prefill(*_):
        try:
            ids = read_prompt(text.value, tokenizer, config.context_length)
        except ValueError as error:
            shown = " ".join(state["labels"]) if state else "nothing yet"
            raise ValueError(f"{str(error).rstrip('.')}. The cache below is still that of the "
                             f"last prompt that worked: {shown}") from error
        logits, cache = kvlib.prefill(params, ids)
        probabilities = kvlib.softmax(logits[-1])
        first = int(np.argmax(logits[-1]))
        word = tokenizer.vocabulary[first]
        state.update(cache=cache, labels=tokenizer.tokens(ids))
        T, d = len(ids), config.d_model
        status.value = (
            f"Prefilled {plural(T, 'token')} in one pass: "
            f"{html.escape(' '.join(state['labels']))}<br>"
            f"The cache holds K and V of shape ({T}, {d}) in each of the {config.n_layers} "
            f"layers: {cache.nbytes} bytes.<br>"
            f'First predicted token: {first} ("{html.escape(word, quote=False)}"), '
            f"probability {probabilities[first]:.3f}.")
        draw()

    def on_layer(_change):
        if state:
            draw()

    prefill_safely = safely(on_prefill, message)
    text.observe(prefill_safely, names="value")
    button.on_click(prefill_safely)
    layer.observe(safely(on_layer, message), names="value")
    prefill_safely()

    box = widgets.VBox([words, widgets.HBox([text, button, layer]), status, message,
                        live.output])
    controls = {"prompt": text, "prefill": button, "layer": layer}
    return carry(box, controls, live, status=status, message=message,
                 cache=lambda: state.get("cache"))
