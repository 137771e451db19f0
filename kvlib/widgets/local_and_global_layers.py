"""The local_and_global_layers lesson: what a cache holds when most layers slide.

``layer_pattern(ax, config)`` draws which layers slide and which are global;
``cache_growth_explorer()`` draws the cache's bytes against the context length for three
models (SmolLM2, whose 30 layers are all global; Gemma 3 270M as it is, 15 sliding layers
over 512 positions and 3 global; and Gemma 3 270M with every layer global) and, at the
chosen length, where Gemma 3's bytes sit: in the sliding layers or in the global ones.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Rectangle

from kvlib.checkpoints.gemma3 import GEMMA3_270M, Gemma3Config
from kvlib.checkpoints.smollm2 import SMOLLM2_135M
from kvlib.memory import MiB, config_cache_bytes, local_global_cache_bytes

from .base import DTYPES, LiveFigure, check_choice, safely

SLIDING_COLOR = "#5ec962"   # viridis green
GLOBAL_COLOR = "#3b528b"    # viridis blue
ALL_GLOBAL_COLOR = "#fde725"
SMOLLM2_COLOR = "#21918c"
LONGEST = 32_768
"""Gemma 3 270M's context length, the explorer's longest."""
MODELS = ("SmolLM2-135M (30 global layers)", "Gemma 3 270M (15 sliding + 3 global)",
          "Gemma 3 270M, every layer global")


def without_window(config: Gemma3Config) -> Gemma3Config:
    """The same model with its window opened to the whole context: every layer reads and
    keeps every position, and each keeps its own rotary base, so that only the mask
    changes (and what an engine that ignores the windows would keep)."""
    return config.replace(sliding_window=config.max_position_embeddings)


def gemma3_cache_bytes(config: Gemma3Config, n_tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of a Gemma 3 model's cache after n_tokens (local_and_global_layers)."""
    return local_global_cache_bytes(config.layer_windows, n_tokens, config.num_key_value_heads,
                                    config.head_dim, dtype_bytes=dtype_bytes)


def cache_bytes(model: str, n_tokens: int, dtype_bytes: int = 2) -> int | None:
    """One of MODELS' cache bytes after n_tokens, or None past the model's context length
    (SmolLM2 reads at most 8,192 positions)."""
    check_choice("model", model, MODELS)
    if model == MODELS[0]:
        if n_tokens > SMOLLM2_135M.context_length:
            return None
        return config_cache_bytes(SMOLLM2_135M, n_tokens, dtype_bytes=dtype_bytes)
    config = GEMMA3_270M if model == MODELS[1] else without_window(GEMMA3_270M)
    return gemma3_cache_bytes(config, n_tokens, dtype_bytes)


def split_by_layer_type(config: Gemma3Config, n_tokens: int,
                        dtype_bytes: int = 2) -> dict[str, int]:
    """A Gemma 3 cache's bytes after n_tokens, split: {"sliding": ..., "global": ...}."""
    per_position = 2 * config.kv_width * dtype_bytes
    n_global = sum(window is None for window in config.layer_windows)
    n_sliding = config.num_hidden_layers - n_global
    return {"sliding": n_sliding * min(n_tokens, config.sliding_window) * per_position,
            "global": n_global * n_tokens * per_position}


def layer_pattern(ax, config: Gemma3Config = GEMMA3_270M) -> None:
    """One cell a layer, in order: green for a sliding layer (with its window), blue for a
    global one, with each layer's rotary base below."""
    ax.clear()
    for layer, window in enumerate(config.layer_windows):
        sliding = window is not None
        ax.add_patch(_cell(layer, SLIDING_COLOR if sliding else GLOBAL_COLOR))
        ax.text(layer + 0.5, 0.5, f"{window}" if sliding else "all", ha="center",
                va="center", fontsize=8, color="black" if sliding else "white")
        base = config.rope_base(layer)
        ax.text(layer + 0.5, -0.35, f"{base:.0e}".replace("+0", ""), ha="center", va="center",
                fontsize=7)
    ax.set_xlim(0, config.num_hidden_layers)
    ax.set_ylim(-0.7, 1.05)
    ax.set_xticks(np.arange(config.num_hidden_layers) + 0.5,
                  [str(layer) for layer in range(config.num_hidden_layers)], fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("layer (cell: positions its cache keeps; below: its rotary base)")
    ax.set_title(f"Gemma 3's layers: {sum(w is not None for w in config.layer_windows)} "
                 f"slide over {config.sliding_window} positions (green), "
                 f"{sum(w is None for w in config.layer_windows)} are global (blue)")


def _cell(layer: int, color: str) -> Rectangle:
    return Rectangle((layer + 0.05, 0.05), 0.9, 0.9, color=color)


def draw_cache_growth(ax, n_tokens: int, dtype_bytes: int = 2) -> None:
    """The three models' cache MiB against the context length, up to LONGEST, with a line
    at n_tokens."""
    ax.clear()
    lengths = np.unique(np.linspace(1, LONGEST, 257).astype(int))
    colors = (SMOLLM2_COLOR, SLIDING_COLOR, ALL_GLOBAL_COLOR)
    styles = ("-", "-", "--")
    for model, color, style in zip(MODELS, colors, styles):
        points = [(n, cache_bytes(model, int(n), dtype_bytes)) for n in lengths]
        points = [(n, b / MiB) for n, b in points if b is not None]
        ax.plot(*zip(*points), color=color, linestyle=style, linewidth=2, label=model)
    ax.axvline(n_tokens, color="black", linewidth=1)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache (MiB, one sequence)")
    ax.set_title("The cache against the context length")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def draw_layer_shares(ax, n_tokens: int, dtype_bytes: int = 2) -> None:
    """Gemma 3 270M's cache at n_tokens, split into its sliding and its global layers,
    beside the same model with every layer global."""
    ax.clear()
    split = split_by_layer_type(GEMMA3_270M, n_tokens, dtype_bytes)
    everything = gemma3_cache_bytes(without_window(GEMMA3_270M), n_tokens, dtype_bytes)
    ax.bar([0], [split["sliding"] / MiB], color=SLIDING_COLOR, label="15 sliding layers")
    ax.bar([0], [split["global"] / MiB], bottom=[split["sliding"] / MiB], color=GLOBAL_COLOR,
           label="3 global layers")
    ax.bar([1], [everything / MiB], color=ALL_GLOBAL_COLOR, label="18 global layers")
    ax.set_xticks([0, 1], ["as it is", "every layer\nglobal"])
    ax.set_ylabel("cache (MiB)")
    share = split["global"] / (split["global"] + split["sliding"])
    ax.set_title(f"Gemma 3 270M at {n_tokens:,} tokens:\n{share:.0%} of it in the 3 global "
                 "layers", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def growth_summary(n_tokens: int, dtype_bytes: int = 2) -> str:
    """The numbers the explorer shows, in one line of text."""
    parts = []
    for model in MODELS:
        value = cache_bytes(model, n_tokens, dtype_bytes)
        shown = "past its context" if value is None else f"{value / MiB:,.1f} MiB"
        parts.append(f"{model}: {shown}")
    return f"At {n_tokens:,} tokens, " + "; ".join(parts) + "."


def cache_growth_explorer(n_tokens: int = 8_192, dtype_bytes: int = 2):
    """Slide the context length (1 to 32,768) and choose the cache's number format; see
    the three models' caches and where Gemma 3's bytes sit.

    Returns a VBox with the attributes the tests use: ``length`` (IntSlider), ``dtype``
    (Dropdown of bytes a number), ``status`` and ``message`` (HTML), ``figure``, ``axes``.
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) \
            or not 1 <= n_tokens <= LONGEST:
        raise ValueError(f"n_tokens must be a whole number from 1 to {LONGEST:,}, "
                         f"got {n_tokens!r}")
    if dtype_bytes not in DTYPES.values():
        raise ValueError(f"dtype_bytes must be one of {sorted(DTYPES.values())}, "
                         f"got {dtype_bytes!r}")
    length = widgets.IntSlider(value=int(n_tokens), min=1, max=LONGEST, step=1,
                               description="tokens", continuous_update=False,
                               layout=widgets.Layout(width="420px"))
    dtype = widgets.Dropdown(options=list(DTYPES.items()), value=dtype_bytes,
                             description="numbers")
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(10, 3.6), n_axes=2, gridspec_kw={"width_ratios": [2, 1]})

    def redraw(*_):
        draw_cache_growth(live.axes[0], length.value, dtype.value)
        draw_layer_shares(live.axes[1], length.value, dtype.value)
        live.figure.tight_layout()
        status.value = growth_summary(length.value, dtype.value)
        live.show()

    run = safely(redraw, message)
    for control in (length, dtype):
        control.observe(run, names="value")
    run()
    box = widgets.VBox([widgets.HBox([length, dtype]), message, status, live.output])
    box.length, box.dtype, box.status, box.message = length, dtype, status, message
    box.figure, box.axes = live.figure, live.axes
    return box


__all__ = ["MODELS", "cache_bytes", "cache_growth_explorer",
           "draw_cache_growth", "draw_layer_shares", "gemma3_cache_bytes", "growth_summary",
           "layer_pattern", "split_by_layer_type"]
