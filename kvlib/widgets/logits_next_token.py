"""The logits_next_token lesson: the next-token distribution under a temperature and a top-k cut,
and sampling.

``next_token_explorer()`` shows the probabilities that the model gives each of the 12 tokens
after the prompt, redrawn as the student moves the temperature and top-k controls, with a
readout of the three likeliest tokens and a "sample" button that draws seeded samples.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import plots

from .base import LiveFigure, plural, safely

TEMPERATURE_MAX = 5.0


def top_tokens_html(probabilities, labels, n: int = 3) -> str:
    """The n likeliest tokens with their probabilities at 3 decimals, as one line of HTML.

    Only tokens that can be drawn are listed: at temperature 0 or top-k 1 that is one token,
    and the line says that every other token has probability 0 (rather than listing the
    lowest ids as runners-up at 0.000).
    """
    probabilities = np.asarray(probabilities)
    order = [i for i in np.argsort(-probabilities, kind="stable")[:n] if probabilities[i] > 0]
    items = ", ".join(f'{rank}. "{html.escape(labels[i], quote=False)}" {probabilities[i]:.3f}'
                      for rank, i in enumerate(order, start=1))
    line = f"<b>Top {n}:</b> {items}"
    if len(order) < n:
        line += " (every other token has probability 0 and is never drawn)"
    return line


def next_token_explorer(params=None, prompt: str = kvlib.ARTICLE_PROMPT, seed: int = 0,
                        n_samples: int = 20):
    """The next-token distribution after `prompt` (logits_next_token), with temperature and top-k.

    Each click on "sample" draws n_samples more tokens with a seeded generator; the black dots
    are the shares of all the samples drawn so far at this setting, so that a few clicks show
    the shares approaching the probabilities. Moving a control starts the count again (the old
    samples came from another distribution).

    Returns a VBox with the attributes the tests use: ``temperature`` (FloatSlider, 0 to 5,
    0 = greedy), ``top_k`` (IntSlider, 1 to V, V = no cut), ``sample`` (Button),
    ``readout`` (HTML: the top 3 tokens), ``samples`` (HTML: the running count), ``message``
    (HTML: errors in words), ``figure`` and ``ax`` (the bars), ``controls`` (a dict of all
    the controls), ``probabilities()`` (the distribution on show) and ``counts()`` (samples
    so far, per token).
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer()
    ids = tokenizer.encode(prompt)
    logits_row = kvlib.forward(params, ids, last_only=True)[0]
    labels = list(tokenizer.vocabulary)
    vocab_size = len(labels)
    rng = np.random.default_rng(seed)

    temperature = widgets.FloatSlider(
        value=1.0, min=0.0, max=TEMPERATURE_MAX, step=0.05, description="temperature",
        readout_format=".2f", continuous_update=False, style={"description_width": "initial"})
    top_k = widgets.IntSlider(value=vocab_size, min=1, max=vocab_size, description="top-k",
                              continuous_update=False)
    sample = widgets.Button(description="sample", tooltip=f"draw {n_samples} more seeded samples")
    readout = widgets.HTML()
    samples = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(8, 3.6))
    state = {"counts": np.zeros(vocab_size, dtype=np.int64), "clicks": 0}

    def current():
        return kvlib.next_token_probabilities(logits_row, float(temperature.value),
                                              int(top_k.value))

    def draw():
        probabilities = current()
        ax = live.ax
        ax.clear()
        k = "all" if top_k.value == vocab_size else top_k.value
        mode = "greedy" if temperature.value == 0 else f"temperature {temperature.value:.2f}"
        plots.probability_bars(probabilities, labels, ax=ax,
                               highlight=int(np.argmax(probabilities)),
                               title=f'After "{prompt}": {mode}, top-k {k}')
        drawn = int(state["counts"].sum())
        if drawn:
            ax.plot(range(vocab_size), state["counts"] / drawn, "o", color="black",
                    markersize=6, label=f"share of {drawn} samples so far")
            ax.legend(loc="upper right", frameon=False)
        live.figure.tight_layout()
        readout.value = top_tokens_html(probabilities, labels)
        live.show()

    def on_change(_change):
        state["counts"][:] = 0   # samples drawn from the old distribution no longer apply
        state["clicks"] = 0
        samples.value = ""
        draw()

    def on_sample(_button):
        drawn = [kvlib.choose_next_token(logits_row, float(temperature.value), int(top_k.value),
                                         rng) for _ in range(n_samples)]
        state["counts"] += np.bincount(drawn, minlength=vocab_size)
        state["clicks"] += 1
        counts = state["counts"]
        total = int(counts.sum())
        order = [i for i in np.argsort(-counts, kind="stable") if counts[i]]
        text = ", ".join(f'"{html.escape(labels[i], quote=False)}" x{counts[i]}' for i in order)
        samples.value = (f"<b>{total} samples so far</b> ({plural(state['clicks'], 'draw')} of "
                         f"{n_samples}, seed {seed}): {text}")
        draw()

    temperature.observe(safely(on_change, message), names="value")
    top_k.observe(safely(on_change, message), names="value")
    sample.on_click(safely(on_sample, message))
    draw()

    box = widgets.VBox([widgets.HBox([temperature, top_k, sample]), readout, samples, message,
                        live.output])
    box.temperature, box.top_k, box.sample = temperature, top_k, sample
    box.readout, box.samples, box.message = readout, samples, message
    box.figure, box.ax, box.live = live.figure, live.ax, live
    box.controls = {"temperature": temperature, "top_k": top_k, "sample": sample}
    box.probabilities = current
    box.counts = lambda: state["counts"].copy()
    return box

