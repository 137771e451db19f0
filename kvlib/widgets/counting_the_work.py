"""The counting_the_work lesson: counting the work of generation, with and without the KV cache.

``cost_explorer()`` lets a student pick a model size, a prompt length and a number of tokens
to generate, and redraws at once the FLOPs of every pass (left) and the running total
(right), with and without the cache. The FLOPs come from kvlib.flops. Given a compute rate
and a bandwidth, the status line also gives the roofline's predicted times (where_time_goes).
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import roofline
from kvlib.config import MODEL_SIZES
from kvlib.flops import format_flops
from kvlib.plots import WITH_CACHE_COLOR, WITHOUT_CACHE_COLOR

from .base import LiveFigure, carry, check_choice, loading, safely

DEFAULT_LENGTHS = {
    "the article's toy (3 layers, d 4)": (5, 28),
    "GPT-2 small's shapes, 32k context (hypothetical)": (32, 16384),
}
"""(prompt, new tokens) a model starts with when chosen; every other model: (32, 512)."""


def cost_curves(config: kvlib.ModelConfig, prompt_length: int, new_tokens: int) -> dict:
    """FLOPs of each pass with and without the cache (counting_the_work): arrays (new_tokens,),
    under "with" and "without", and the sequence length each pass sees, under "length"."""
    curves = {name: kvlib.flops.generation_step_flops(config, prompt_length, new_tokens,
                                                      use_cache=use)
              for name, use in (("with", True), ("without", False))}
    curves["length"] = np.arange(prompt_length, prompt_length + new_tokens)
    return curves


def draw_cost_curves(axes, config: kvlib.ModelConfig, prompt_length: int,
                     new_tokens: int) -> dict:
    """Draw the counted cost of generation (counting_the_work) into two Axes, cleared first.

    Left: FLOPs of each pass against the number of tokens it sees, log scale (with the cache,
    the first pass is the prompt's prefill). Right: the running total against the number of
    new tokens, linear scale. Without the cache the total grows like N^2 (and its attention
    part like N^3); with it, like N at first, bending upwards once attention over the cache
    becomes a large share of a step (past about 6 d_model positions). Units follow the size.
    Returns cost_curves(...) with the totals and their ratio added.
    """
    curves = cost_curves(config, prompt_length, new_tokens)
    left, right = axes
    for ax in axes:
        ax.clear()
    x = curves["length"]
    count = np.arange(1, new_tokens + 1)
    step_scale, step_unit = kvlib.flops.flop_unit(curves["without"].max())
    totals = {name: np.cumsum(curves[name]) for name in ("with", "without")}
    total_scale, total_unit = kvlib.flops.flop_unit(totals["without"][-1])
    for name, color, label in (("without", WITHOUT_CACHE_COLOR, "without cache"),
                               ("with", WITH_CACHE_COLOR, "with cache")):
        left.plot(x, curves[name] / step_scale, color=color, label=label, marker="." if
                  new_tokens <= 40 else None)
        right.plot(count, totals[name] / total_scale, color=color, label=label)
    left.set_yscale("log")
    left.set_xlabel("tokens the pass sees (prompt + generated so far)")
    left.set_ylabel(f"{step_unit} of the pass (log scale)")
    left.set_title("Cost of each new token")
    right.set_xlabel("new tokens generated")
    right.set_ylabel(f"{total_unit} in total")
    right.set_title("Total cost")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    curves["total_with"] = float(curves["with"].sum())
    curves["total_without"] = float(curves["without"].sum())
    curves["ratio"] = curves["total_without"] / curves["total_with"]
    return curves


def cost_explorer(compute_rate: float | None = None, bandwidth: float | None = None,
                  model: str = "GPT-2 small (12 layers, d 768)", prompt_length: int = 32,
                  new_tokens: int = 512):
    """Choose a model, a prompt length and a number of new tokens; see the counted cost.

    Choosing a model sets its own starting lengths (DEFAULT_LENGTHS), so that the toy's short
    prompt does not carry over to GPT-2. With compute_rate (FLOP/s) and bandwidth (bytes/s),
    the status also gives the roofline's predicted seconds and their ratio. Returns a VBox
    with the attributes the tests use: ``model``, ``prompt``, ``new_tokens`` (the controls,
    also in ``controls``), ``status`` and ``message`` (HTML), ``figure`` and ``axes``, and
    ``curves()`` (what is drawn now).
    """
    check_choice("model", model, MODEL_SIZES)
    model_choice = widgets.Dropdown(options=list(MODEL_SIZES), value=model, description="model",
                                    layout=widgets.Layout(width="460px"))
    context = MODEL_SIZES[model].context_length
    prompt = widgets.IntSlider(value=min(prompt_length, context), min=1, max=context,
                               description="prompt", continuous_update=False)
    new = widgets.IntSlider(value=min(new_tokens, context - min(prompt_length, context) + 1),
                            min=1, max=context, description="new tokens",
                            continuous_update=False)
    status = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(10, 3.8), n_axes=2)
    state = {"loading": False}

    def set_lengths(config, prompt_value: int, new_value: int) -> None:
        with loading(state):
            prompt.max, new.max = config.context_length, config.context_length
            prompt.value = min(prompt_value, config.context_length)
            new.value = min(new_value, config.context_length - prompt.value + 1)

    def redraw(change=None):
        if state["loading"]:
            return
        config = MODEL_SIZES[model_choice.value]
        note = ""
        if isinstance(change, dict) and change.get("owner") is model_choice:
            set_lengths(config, *DEFAULT_LENGTHS.get(model_choice.value, (32, 512)))
        elif prompt.value + new.value - 1 > config.context_length:
            set_lengths(config, prompt.value, new.value)
            note = (f"this model sees at most {config.context_length:,} positions: the new "
                    "tokens were reduced to fit")
        P, N = int(prompt.value), int(new.value)
        curves = draw_cost_curves(live.axes, config, P, N)
        state["curves"] = curves
        lines = [f"{N:,} new tokens after a {P:,}-token prompt: "
                 f"{format_flops(curves['total_without'])} without the cache, "
                 f"{format_flops(curves['total_with'])} with it: "
                 f"<b>{curves['ratio']:.1f}x</b> fewer FLOPs."]
        if compute_rate is not None and bandwidth is not None:
            times = {use: roofline.generation_step_times(config, P, N, use, compute_rate,
                                                         bandwidth).sum()
                     for use in (True, False)}
            lines.append(f"Roofline prediction at {compute_rate / 1e9:,.0f} GFLOP/s and "
                         f"{bandwidth / 1e9:,.1f} GB/s: {times[False]:.3g} s without, "
                         f"{times[True]:.3g} s with the cache: "
                         f"<b>{times[False] / times[True]:.1f}x</b> faster.")
        if note:
            lines.append(f"Note: {note}.")
        status.value = "<br>".join(lines)
        live.figure.tight_layout()
        live.show()

    update = safely(redraw, message)
    for control in (model_choice, prompt, new):
        control.observe(update, names="value")
    update()

    box = widgets.VBox([widgets.HBox([model_choice]), widgets.HBox([prompt, new]), status,
                        message, live.output])
    controls = {"model": model_choice, "prompt": prompt, "new_tokens": new}
    return carry(box, controls, live, status=status, message=message,
                 curves=lambda: state.get("curves"))
