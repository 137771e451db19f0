"""The kv_cache_memory lesson: a KV cache memory calculator.

``kv_cache_calculator()`` takes a model's shapes (layers, K/V heads, head size) or one of the
published presets in kvlib.memory.PRESETS (those with a plain K/V cache), a context length, a
batch size, a number format for the cache and another for the weights (a quantized cache
beside BF16 weights, say), and shows how many GiB the cache takes, beside the weights, in an
accelerator's memory, and how many tokens fit there.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from kvlib.memory import PRESETS as ALL_PRESETS
from kvlib.memory import GiB, kv_cache_bytes, tokens_that_fit, weights_bytes

from .base import CUSTOM, DTYPES, LiveFigure, carry, check_choice, loading, preset_dropdown, safely

PRESETS = {name: preset for name, preset in ALL_PRESETS.items()
           if preset.latent_dim is None and preset.window is None}
"""The presets whose cache is K and V of every position, (n_kv_heads x head_dim) wide: the
calculator's formula. Latent and sliding-window caches (DeepSeek, Mistral) have their own
formulas, in the latent_attention and latent_attention lessons."""
WEIGHTS_COLOR = "#3b528b"   # viridis blue
CACHE_COLOR = "#5ec962"     # viridis green
FREE_COLOR = "#e8e8e8"
OVER_COLOR = "#d62728"


def memory_budget(n_layers: int, n_kv_heads: int, head_dim: int, context: int,
                  batch_size: int, dtype_bytes: int, n_parameters: int,
                  memory_bytes: int, weights_dtype_bytes: int | None = None) -> dict:
    """The calculator's numbers (kv_cache_memory), all in bytes or tokens.

    bytes_per_token: K and V of one position in every layer, at dtype_bytes a number; cache:
    for batch_size sequences of `context` tokens; weights: n_parameters at weights_dtype_bytes
    each (dtype_bytes when not given); tokens_that_fit: cached positions that fit beside the
    weights in memory_bytes, over all sequences; sequences_that_fit: how many full-context
    sequences that is. Only the weights are set aside: a real server also needs memory for
    activations and its allocator (kv_cache_memory).
    """
    weights_dtype_bytes = dtype_bytes if weights_dtype_bytes is None else weights_dtype_bytes
    per_token = kv_cache_bytes(n_layers, None, 1, 1, dtype_bytes, n_kv_heads=n_kv_heads,
                               head_dim=head_dim)
    cache = kv_cache_bytes(n_layers, None, context, batch_size, dtype_bytes,
                           n_kv_heads=n_kv_heads, head_dim=head_dim)
    weights = weights_bytes(n_parameters, weights_dtype_bytes)
    fit = tokens_that_fit(memory_bytes, weights, per_token)
    return {"bytes_per_token": per_token, "cache": cache, "weights": weights,
            "memory": memory_bytes, "tokens_that_fit": fit,
            "sequences_that_fit": fit // context if context else 0,
            "fits": weights + cache <= memory_bytes}


def draw_memory_budget(ax, budget: dict, title: str = "") -> None:
    """One horizontal bar (kv_cache_memory): the weights, then the cache, against the memory.

    The accelerator's memory is the grey bar; what does not fit is drawn in red past its end.
    """
    ax.clear()
    memory = budget["memory"] / GiB
    weights, cache = budget["weights"] / GiB, budget["cache"] / GiB
    ax.barh([0], [memory], color=FREE_COLOR, edgecolor="black", label="accelerator memory")
    ax.barh([0], [weights], color=WEIGHTS_COLOR, label=f"weights {weights:,.1f} GiB")
    ax.barh([0], [cache], left=[weights], color=CACHE_COLOR,
            label=f"KV cache {cache:,.1f} GiB")
    if weights + cache > memory:
        ax.barh([0], [weights + cache - memory], left=[memory], color="none",
                edgecolor=OVER_COLOR, hatch="//", label="does not fit")
    ax.axvline(memory, color="black", linewidth=1)
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_xlim(0, max(memory, weights + cache) * 1.05)
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, frameon=False)


def draw_cache_growth(ax, budget_at, context: int, memory_bytes: int, weights: int) -> None:
    """Cache GiB against context length up to `context` (kv_cache_memory), with the memory left
    beside the weights as a horizontal line. budget_at(n) gives the cache bytes at n tokens."""
    ax.clear()
    lengths = np.linspace(0, context, 50)
    ax.plot(lengths, [budget_at(int(n)) / GiB for n in lengths], color=CACHE_COLOR,
            label="KV cache")
    ax.axhline(max(memory_bytes - weights, 0) / GiB, color=WEIGHTS_COLOR, linestyle="--",
               label="memory left beside the weights")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("GiB")
    ax.set_title("The cache grows with every token")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")


def kv_cache_calculator(preset: str = "Llama-2-7B", context: int | None = None,
                        batch_size: int = 1, dtype_bytes: int = 2,
                        memory_gib: float = 80.0, weights_dtype_bytes: int = 2):
    """How much memory does a model's KV cache take, and how many tokens fit?

    Returns a VBox with the attributes the tests use: ``preset`` (Dropdown; choosing one fills
    the shape fields, and changing a field switches it to "custom"), ``layers``, ``kv_heads``,
    ``head_dim``, ``parameters_b`` (billions of weights), ``context`` (set to the preset's own
    context length), ``batch``, ``dtype`` (the cache's number format), ``weights_dtype`` (the
    weights'), ``memory_gib`` (all also in ``controls``), ``status``, ``message`` and
    ``source`` (HTML), ``figure`` and ``axes``, and ``budget()`` (the numbers on show, from
    memory_budget).
    """
    check_choice("preset", preset, PRESETS)
    for name, value in (("dtype_bytes", dtype_bytes), ("weights_dtype_bytes",
                                                        weights_dtype_bytes)):
        if value not in DTYPES.values():
            raise ValueError(f"{name} must be one of {sorted(DTYPES.values())}, got {value!r}")
    start = PRESETS[preset]
    style = {"description_width": "110px"}
    wide = widgets.Layout(width="260px")
    choose = preset_dropdown(PRESETS, preset, style)
    layers = widgets.BoundedIntText(value=start.n_layers, min=1, max=1000,
                                    description="layers", style=style, layout=wide)
    kv_heads = widgets.BoundedIntText(value=start.n_kv_heads, min=1, max=1024,
                                      description="K/V heads", style=style, layout=wide)
    head_dim = widgets.BoundedIntText(value=start.head_dim, min=1, max=4096,
                                      description="head size", style=style, layout=wide)
    parameters_b = widgets.BoundedFloatText(value=round(start.n_parameters / 1e9, 3), min=0.0,
                                            max=10_000.0, step=0.1, style=style, layout=wide,
                                            description="weights (billions)")
    context_box = widgets.BoundedIntText(value=start.context_length if context is None
                                         else context, min=1, max=10_000_000, style=style,
                                         description="context (tokens)", layout=wide)
    batch = widgets.BoundedIntText(value=batch_size, min=1, max=100_000, description="batch",
                                   style=style, layout=wide)
    dtype = widgets.Dropdown(options=list(DTYPES.items()), value=dtype_bytes,
                             description="cache numbers", style=style, layout=wide)
    weights_dtype = widgets.Dropdown(options=list(DTYPES.items()), value=weights_dtype_bytes,
                                     description="weight numbers", style=style, layout=wide)
    memory = widgets.BoundedFloatText(value=memory_gib, min=0.0, max=1_000_000.0, step=8.0,
                                      description="memory (GiB)", style=style, layout=wide)
    status = widgets.HTML()
    message = widgets.HTML()
    source = widgets.HTML()
    live = LiveFigure(figsize=(10, 3.4), n_axes=2, gridspec_kw={"width_ratios": [1.3, 1]})
    state = {"loading": False}
    shape_fields = (layers, kv_heads, head_dim, parameters_b)

    def exact_parameters() -> int:
        chosen = PRESETS.get(choose.value)
        if chosen is not None and round(chosen.n_parameters / 1e9, 3) == parameters_b.value:
            return chosen.n_parameters  # the published count, not its rounded display
        return int(round(parameters_b.value * 1e9))

    def redraw(*_):
        if state["loading"]:
            return
        n_tokens = int(context_box.value)
        budget = memory_budget(int(layers.value), int(kv_heads.value), int(head_dim.value),
                               n_tokens, int(batch.value), int(dtype.value),
                               exact_parameters(), int(round(memory.value * GiB)),
                               weights_dtype_bytes=int(weights_dtype.value))
        state["budget"] = budget
        width = int(kv_heads.value) * int(head_dim.value)
        lines = [
            f"Each token adds 2 (K and V) x {layers.value} layers x {kv_heads.value} K/V heads "
            f"x {head_dim.value} x {dtype.value} bytes = <b>{budget['bytes_per_token']:,} "
            f"bytes</b> ({budget['bytes_per_token'] / 2**10:,.0f} KiB); a cached row is "
            f"{width} numbers wide.",
            f"{batch.value} x {n_tokens:,} tokens: KV cache <b>{budget['cache'] / GiB:,.2f} "
            f"GiB</b> ({dtype.label}), beside {budget['weights'] / GiB:,.2f} GiB of weights "
            f"({weights_dtype.label}), in {memory.value:g} GiB of memory.",
        ]
        if budget["weights"] > budget["memory"]:
            lines.append("The weights alone do not fit in this memory: no room for a cache.")
        else:
            lines.append(f"Room beside the weights for <b>{budget['tokens_that_fit']:,} "
                         f"cached tokens</b>, that is {budget['sequences_that_fit']:,} "
                         f"sequences of {n_tokens:,} tokens: an upper bound, since a real "
                         "server also keeps activations and allocator overhead (vLLM takes "
                         "90% of the memory by default, gpu_memory_utilization=0.9).")
        status.value = "<br>".join(lines)
        chosen = PRESETS.get(choose.value)
        source.value = ("<small>Custom shapes: no published source.</small>" if chosen is None
                        else f"<small>{chosen.attention}, {chosen.n_heads} query heads, context "
                             f"{chosen.context_length:,} tokens. Source: "
                             f"{html.escape(chosen.source)}</small>")
        draw_memory_budget(live.axes[0], budget, title="Accelerator memory")

        def cache_at(n):
            return kv_cache_bytes(int(layers.value), None, n, int(batch.value),
                                  int(dtype.value), n_kv_heads=int(kv_heads.value),
                                  head_dim=int(head_dim.value))

        draw_cache_growth(live.axes[1], cache_at, n_tokens, budget["memory"],
                          budget["weights"])
        live.figure.tight_layout()
        live.show()

    def on_preset(change):
        chosen = PRESETS.get(change["new"])
        if chosen is None:
            return
        with loading(state):
            layers.value, kv_heads.value = chosen.n_layers, chosen.n_kv_heads
            head_dim.value = chosen.head_dim
            parameters_b.value = round(chosen.n_parameters / 1e9, 3)
            context_box.value = chosen.context_length
        redraw()

    def on_shape(_change):
        if state["loading"] or choose.value == CUSTOM:
            return
        chosen = PRESETS[choose.value]
        if (layers.value, kv_heads.value, head_dim.value) != (
                chosen.n_layers, chosen.n_kv_heads, chosen.head_dim) or \
                parameters_b.value != round(chosen.n_parameters / 1e9, 3):
            with loading(state):
                choose.value = CUSTOM

    update = safely(redraw, message)
    choose.observe(safely(on_preset, message), names="value")
    for field in shape_fields:
        field.observe(safely(on_shape, message), names="value")
    for field in shape_fields + (context_box, batch, dtype, weights_dtype, memory):
        field.observe(update, names="value")
    update()

    box = widgets.VBox([
        choose, source,
        widgets.HBox([widgets.VBox([layers, kv_heads, head_dim, parameters_b]),
                      widgets.VBox([context_box, batch, dtype, weights_dtype, memory])]),
        status, message, live.output])
    controls = {"preset": choose, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                "parameters_b": parameters_b, "context": context_box, "batch": batch,
                "dtype": dtype, "weights_dtype": weights_dtype, "memory_gib": memory}
    return carry(box, controls, live, status=status, message=message, source=source,
                 budget=lambda: state.get("budget"))
