"""Notebook 09: what generation costs, with and without the KV cache.

``cost_explorer()`` lets a student pick a model size, a prompt length and a number of tokens
to generate, and redraws at once the predicted cost of every pass (left) and the running
total (right), with and without the cache. The FLOPs come from kvlib.flops; given this
machine's measured rates, the status line also gives the roofline's predicted times.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import roofline

from .base import LiveFigure, safely

LAB_MODEL = kvlib.ModelConfig(vocab_size=2048, d_model=512, n_heads=8, n_layers=4, d_ff=2048,
                              context_length=512, dtype="float32")
"""The model notebook 09 times: big enough that its weights do not fit in a CPU's caches."""


def _gpt2(n_layers: int, d_model: int, n_heads: int) -> kvlib.ModelConfig:
    return kvlib.ModelConfig(vocab_size=50257, d_model=d_model, n_heads=n_heads,
                             n_layers=n_layers, d_ff=4 * d_model, context_length=1024,
                             dtype="float32")


MODELS = {
    "the article's toy (3 layers, d 4)": kvlib.ModelConfig(dtype="float32"),
    "notebook 09's lab model (4 layers, d 512)": LAB_MODEL,
    "GPT-2 small (12 layers, d 768)": kvlib.GPT2_SMALL,
    "GPT-2 medium (24 layers, d 1024)": _gpt2(24, 1024, 16),
    "GPT-2 large (36 layers, d 1280)": _gpt2(36, 1280, 20),
    "GPT-2 XL (48 layers, d 1600)": _gpt2(48, 1600, 25),
}
"""Model sizes to choose from. GPT-2's layers and widths are those of Radford et al. 2019
(table 2) and its published config.json files; the FLOPs do not depend on the head count."""

WITH_CACHE_COLOR = "#21918c"   # viridis teal
WITHOUT_CACHE_COLOR = "#440154"  # viridis purple


def cost_curves(config: kvlib.ModelConfig, prompt_length: int, new_tokens: int) -> dict:
    """FLOPs of each pass with and without the cache (notebook 09): arrays (new_tokens,),
    under "with" and "without", and the sequence length each pass sees, under "length"."""
    steps = {"with": kvlib.flops.generation_step_multiply_adds(config, prompt_length,
                                                                new_tokens, use_cache=True),
             "without": kvlib.flops.generation_step_multiply_adds(config, prompt_length,
                                                                   new_tokens, use_cache=False)}
    curves = {name: np.array([s.flops for s in passes], dtype=np.float64)
              for name, passes in steps.items()}
    curves["length"] = np.arange(prompt_length, prompt_length + new_tokens)
    return curves


def draw_cost_curves(axes, config: kvlib.ModelConfig, prompt_length: int,
                     new_tokens: int) -> dict:
    """Draw the predicted cost of generation (notebook 09) into two Axes, cleared first.

    Left: GFLOPs of each pass against the number of tokens it sees, log scale (with the
    cache, the first pass is the prompt's prefill). Right: the running total against the
    number of new tokens, linear scale: a parabola without the cache, a line with it.
    Returns cost_curves(...) with the totals and their ratio added.
    """
    curves = cost_curves(config, prompt_length, new_tokens)
    left, right = axes
    for ax in axes:
        ax.clear()
    x = curves["length"]
    count = np.arange(1, new_tokens + 1)
    for name, color, label in (("without", WITHOUT_CACHE_COLOR, "without cache"),
                               ("with", WITH_CACHE_COLOR, "with cache")):
        left.plot(x, curves[name] / 1e9, color=color, label=label, marker="." if
                  new_tokens <= 40 else None)
        right.plot(count, np.cumsum(curves[name]) / 1e9, color=color, label=label)
    left.set_yscale("log")
    left.set_xlabel("tokens the pass sees (prompt + generated so far)")
    left.set_ylabel("GFLOPs of the pass")
    left.set_title("Cost of each new token")
    right.set_xlabel("new tokens generated")
    right.set_ylabel("GFLOPs in total")
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
    """Choose a model, a prompt length and a number of new tokens; see the predicted cost.

    With compute_rate (FLOP/s) and bandwidth (bytes/s) measured on this machine, the status
    also gives the roofline's predicted seconds and their ratio. Returns a VBox with the
    attributes the tests use: ``model``, ``prompt``, ``new_tokens`` (the controls, also in
    ``controls``), ``status`` and ``message`` (HTML), ``figure`` and ``axes``, and
    ``curves()`` (what is drawn now).
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    model_choice = widgets.Dropdown(options=list(MODELS), value=model, description="model",
                                    layout=widgets.Layout(width="420px"))
    context = MODELS[model].context_length
    prompt = widgets.IntSlider(value=min(prompt_length, context), min=1, max=context,
                               description="prompt", continuous_update=False)
    new = widgets.IntSlider(value=min(new_tokens, context), min=1, max=context,
                            description="new tokens", continuous_update=False)
    status = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(10, 3.8), n_axes=2)
    state = {"loading": False}

    def fit_to_context(config, new_model: bool) -> str:
        """Keep prompt + new tokens within the model's context; say what was changed.

        A new, shorter model shortens a long prompt to an eighth of its context; otherwise
        only the number of new tokens is reduced."""
        context = config.context_length
        before = (prompt.value, new.value)
        state["loading"] = True
        try:
            prompt.max, new.max = context, context
            if new_model and before[0] + before[1] - 1 > context and prompt.value > context // 2:
                prompt.value = max(1, context // 8)
            new.value = min(new.value, context - prompt.value + 1)
        finally:
            state["loading"] = False
        if (prompt.value, new.value) == before:
            return ""
        return (f"this model sees at most {context} positions: prompt + new tokens were "
                "reduced to fit")

    def redraw(change=None):
        if state["loading"]:
            return
        config = MODELS[model_choice.value]
        new_model = isinstance(change, dict) and change.get("owner") is model_choice
        note = fit_to_context(config, new_model)
        P, N = int(prompt.value), int(new.value)
        curves = draw_cost_curves(live.axes, config, P, N)
        state["curves"] = curves
        lines = [f"{N} new tokens after a {P}-token prompt: "
                 f"{curves['total_without'] / 1e9:,.1f} GFLOPs without the cache, "
                 f"{curves['total_with'] / 1e9:,.1f} with it: "
                 f"<b>{curves['ratio']:.1f}x</b> fewer FLOPs."]
        if compute_rate is not None and bandwidth is not None:
            times = {use: roofline.generation_step_times(config, P, N, use, compute_rate,
                                                         bandwidth).sum()
                     for use in (True, False)}
            lines.append(f"Roofline prediction on this machine: {times[False]:.3g} s without, "
                         f"{times[True]:.3g} s with the cache: <b>{times[False] / times[True]:.1f}x"
                         "</b> faster.")
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
    box.model, box.prompt, box.new_tokens = model_choice, prompt, new
    box.status, box.message = status, message
    box.figure, box.axes, box.live = live.figure, live.axes, live
    box.controls = {"model": model_choice, "prompt": prompt, "new_tokens": new}
    box.curves = lambda: state.get("curves")
    return box
