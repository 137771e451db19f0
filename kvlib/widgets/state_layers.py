"""The state_layers lesson: how far apart a hybrid cache keeps its DeltaNet states, and what
that costs in prefix hits and in bytes.

``snapshot_explorer(workloads, state_bytes)`` takes chat workloads (lists of prompts, token
ids) and the bytes of one set of DeltaNet states; a slider picks the spacing of the kept
states (vLLM's block size). Each prompt is drawn as a bar: its length, and the part of it a
cache with states every N positions lets it skip (kvlib.hybrid_cache.prefix_hits). The status
line gives the hit rate over the workload and the bytes of the states kept for its longest
prompt.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from kvlib.hybrid_cache import prefix_hits

from .base import LiveFigure, carry, check_choice, safely

SPACINGS = (1, 16, 32, 64, 128, 256, 528)
"""The spacings the slider offers: 1 (a state after every token), kvlib's and vLLM's usual
block sizes, and the 528 tokens vLLM uses for Qwen3.5 (vllm issue #40696)."""


def hit_rate(prompts, every: int) -> float:
    """Tokens skipped over tokens asked for, over the whole workload (state_layers)."""
    return sum(prefix_hits(prompts, every)) / sum(len(prompt) for prompt in prompts)


def kept_states_bytes(longest: int, every: int, state_bytes: int) -> int:
    """Bytes of the states kept for a prompt of `longest` tokens: one set per multiple of
    `every` (state_layers)."""
    return longest // every * state_bytes


def draw_hits(ax, prompts, every: int, title: str) -> list[int]:
    """Each prompt's length (grey) and the tokens it skips (blue): -> the hits."""
    hits = prefix_hits(prompts, every)
    ax.clear()
    index = np.arange(len(prompts))
    ax.bar(index, [len(p) for p in prompts], color="#bbbbbb", label="prompt tokens")
    ax.bar(index, hits, color="#0072b2", label="skipped: resumed from a kept state")
    ax.set_xticks(index, [str(i) for i in index])
    ax.set_xlabel("request (in arrival order)")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    return hits


def snapshot_explorer(workloads: dict, state_bytes: int, every: int = 64,
                      workload: str | None = None):
    """Pick a spacing of kept states and a workload; see which prompt tokens are skipped.

    workloads: {name: list of prompts (lists of token ids)}; state_bytes: bytes of one set of
    DeltaNet states (kept at each multiple of the spacing). Returns a VBox with ``every``
    (SelectionSlider), ``workload`` (Dropdown), ``status`` and ``message`` (HTML), ``figure``,
    ``axes``, ``controls`` and ``hits()`` (the counts on show).
    """
    check_choice("every", every, SPACINGS)
    names = list(workloads)
    workload = names[0] if workload is None else workload
    check_choice("workload", workload, names)
    spacing = widgets.SelectionSlider(options=list(SPACINGS), value=every,
                                      description="state every", continuous_update=False)
    choice = widgets.Dropdown(options=names, value=workload, description="workload")
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(8, 3.6))
    state: dict = {}

    def redraw(*_):
        prompts = workloads[choice.value]
        n = int(spacing.value)
        state["hits"] = draw_hits(live.ax, prompts, n,
                                  f"{choice.value}: states kept every {n} tokens")
        longest = max(len(p) for p in prompts)
        status.value = (
            f"hit rate {hit_rate(prompts, n):.1%} of {sum(len(p) for p in prompts):,} prompt "
            f"tokens; states kept for the longest prompt ({longest} tokens): "
            f"{longest // n} x {state_bytes:,} = "
            f"{kept_states_bytes(longest, n, state_bytes):,} bytes")
        live.figure.tight_layout()
        live.show()

    run = safely(redraw, message)
    spacing.observe(run, names="value")
    choice.observe(run, names="value")
    run()
    box = widgets.VBox([widgets.HBox([spacing, choice]), status, message, live.output])
    return carry(box, {"every": spacing, "workload": choice}, live, status=status,
                 message=message, hits=lambda: state.get("hits"))
