"""The real_model lesson: the decode loop on a real model, and the position of a decode step.

- ``relative_difference`` (kvlib.debug's): how close cached decoding comes to a full
  recomputation (kv_cached_decode's check, in float64 or float32).
- ``step_at_position(params, ids, token, position)``: the decode step after a prompt whose
  new token gets the row of the position table you choose; ``draw_next_words`` compares its
  next-word probabilities with a full recomputation's.
- ``position_explorer(params, tokenizer, prompt)``: the same, with a slider for the position.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

import kvlib
from kvlib import plots
from kvlib.debug import CACHED_TOLERANCES as TOLERANCES  # noqa: F401 (the lesson reads them here)
from kvlib.debug import cached_tolerance as tolerance
from kvlib.debug import relative_difference

from .base import LiveFigure, as_html, safely

# ---------------------------------------------------------------------------- the position

TOP_WORDS = 8            # the words shown: the most likely under full recomputation


def step_at_position(params, ids, token: int, position) -> np.ndarray:
    """The decode step after the prompt `ids` (a fresh prefill) whose new token gets row
    `position` of the position table (real_model): -> logits (V,). At position len(ids)
    it is kvlib.decode_step; at any other row it is the classic bug of exercise 1."""
    from kvlib.exercises.real_model import decode_at_position

    _, cache = kvlib.prefill(params, ids)
    return decode_at_position(params, token, cache, position)[-1]


def top_words(right, step, count: int = TOP_WORDS) -> list[int]:
    """Ids of the `count` most likely words under `right` (V,), and the step's own choice
    when it is not among them."""
    chosen = [int(i) for i in np.argsort(-np.asarray(right), kind="stable")[:count]]
    best = int(np.argmax(step))
    return chosen if best in chosen else chosen + [best]


def draw_next_words(ax, vocabulary, right, step, position: int, title: str | None = None):
    """Next-word probabilities (V,) of a full recomputation and of a decode step whose token
    sat at `position`, as pairs of bars over the likeliest words (real_model)."""
    right, step = np.asarray(right, dtype=float), np.asarray(step, dtype=float)
    if right.shape != step.shape or right.ndim != 1:
        raise ValueError(f"need two probability rows (V,), got {right.shape} and {step.shape}")
    shown = top_words(right, step)
    x = np.arange(len(shown))
    ax.clear()
    colours = plt.get_cmap(plots.COLORMAP)([0.2, 0.75])
    ax.bar(x - 0.2, right[shown], width=0.4, color=colours[0], edgecolor="black", lw=0.5,
           label="full recomputation (kvlib.forward)")
    ax.bar(x + 0.2, step[shown], width=0.4, color=colours[1], edgecolor="black", lw=0.5,
           label=f"decode step, new token at position {position}")
    ax.set_xticks(x, [vocabulary[i] for i in shown])
    ax.set_ylim(0, 1.3)                         # room for the legend above p = 1
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_xlabel("next word (the likeliest under full recomputation)")
    ax.set_ylabel("probability")
    ax.set_title(title or "The next word, with the new token at a chosen position")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    return ax


def position_explorer(params, tokenizer, prompt: str):
    """A decode step at the position you choose (real_model).

    The prompt is prefilled; the model's next word is fed to a decode step whose new token
    gets the row of the position table under the slider (len(cache) to start with). The
    figure compares the next-word probabilities with a full recomputation's, and the status
    line says how far apart the logits are.

    Returns a VBox with ``prompt`` (Text), ``position`` (IntSlider), ``status``, ``message``
    (HTML), ``figure``, ``controls`` and ``state`` (the last comparison: position, difference,
    the two next words).
    """
    config = params.config
    text = widgets.Text(value=prompt, description="prompt", continuous_update=False,
                        layout=widgets.Layout(width="48em"))
    position = widgets.IntSlider(min=0, max=config.context_length - 1, description="position",
                                 continuous_update=False, layout=widgets.Layout(width="40em"))
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(9, 3.6), layout="constrained")
    state = {}

    def read_prompt():
        ids = tokenizer.encode(text.value)
        if not 1 <= len(ids) < config.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; it needs 1 to "
                             f"{config.context_length - 1} to leave room for a new one")
        token = int(np.argmax(kvlib.forward(params, ids, last_only=True)[-1]))
        right = kvlib.forward(params, ids + [token], last_only=True)[-1]
        state.clear()                       # a prompt that works: no error left over
        state.update(ids=ids, token=token, right=right)

    def redraw():
        ids, token, right = state["ids"], state["token"], state["right"]
        p = int(position.value)
        step = step_at_position(params, ids, token, p)
        difference = relative_difference(step, right)
        p_right, p_step = kvlib.softmax(right), kvlib.softmax(step)
        words = tokenizer.vocabulary
        said = {"right": words[int(np.argmax(right))], "step": words[int(np.argmax(step))]}
        state.update(position=p, difference=difference, words=said)
        draw_next_words(live.ax, words, p_right, p_step, p,
                        title=f"After {words[token]!r}, fed at position {p} "
                              f"(len(cache) = {len(ids)})")
        where = (f"The cache holds {len(ids)} positions, so the new token "
                 f"{as_html(repr(words[token]))} belongs at position {len(ids)}. ")
        if difference < tolerance(params):
            verdict = (f"At position {p} the step equals full recomputation (its logits within "
                       f"{tolerance(params):.0e} of their size).")
        elif said["step"] == said["right"]:
            verdict = (f"At position {p} nothing crashes and the word is even the same, "
                       f"{as_html(repr(said['step']))}, but with p = {p_step.max():.2f} instead "
                       f"of {p_right.max():.2f}: the logits differ from full recomputation by "
                       f"{difference:.2f} of their size.")
        else:
            verdict = (f"At position {p} nothing crashes, but the logits differ from full "
                       f"recomputation by {difference:.2f} of their size: the model writes "
                       f"{as_html(repr(said['step']))} with p = {p_step.max():.2f}, where it "
                       f"should write {as_html(repr(said['right']))} with p = "
                       f"{p_right.max():.2f}.")
        status.value = where + verdict
        live.show()

    def on_prompt(*_):
        try:
            read_prompt()
        except ValueError as error:
            state.clear()
            state["error"] = error
            status.value = "Waiting for a prompt that works."
            raise
        right_row = len(state["ids"])
        if position.value != right_row:
            position.value = right_row          # its observer redraws
        else:
            redraw()

    def on_position(*_):
        if "error" in state:
            raise state["error"]            # the prompt still cannot be read: say so again
        redraw()

    text.observe(safely(on_prompt, message), names="value")
    position.observe(safely(on_position, message), names="value")
    safely(on_prompt, message)()
    box = widgets.VBox([widgets.HBox([position]), text, message, status, live.output])
    box.prompt, box.position, box.status, box.message = text, position, status, message
    box.figure, box.live, box.state = live.figure, live, state
    box.controls = {"prompt": text, "position": position}
    return box
