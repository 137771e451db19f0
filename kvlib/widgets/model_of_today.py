"""The model_of_today lesson: a model of today (SmolLM2), piece by piece, and a chat that keeps its
cache.

- draw_q4_1_group: one group of 32 weights and the 16 levels Q4_1 can give them;
- draw_pairings: the columns each rotary pairing turns together, for one head;
- draw_cache_growth: bytes of SmolLM2's cache against the tokens it holds, with 3 K/V heads
  and as multi-head attention would cache them;
- draw_tape / chat_widget: a conversation as the cache holds it, turn after turn, and a chat
  box that answers with the cache, streams its reply and shows the cache growing.
"""

from __future__ import annotations

import warnings

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np

import kvlib
from kvlib.chat import Conversation

from .base import LiveFigure, as_html, plural, safely

MAX_MESSAGE_CHARACTERS = 2_000
"""Longer messages are refused: their prefill would take minutes on a laptop."""
COLOURS = {"turn": "#0072B2", "reply": "#E69F00"}    # Okabe-Ito: blue and orange
PAIR_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
                "#999999")                         # Okabe-Ito, one a pair
LABELS = {"turn": "the turn's text (template, user message)", "reply": "the model's reply"}


# ------------------------------------------------------------------------------ the file

def draw_q4_1_group(ax, values: np.ndarray, scale: float, minimum: float) -> None:
    """A group of 32 float weights (dots) and what Q4_1 stores for them (crosses): each one
    rounded to one of the 16 levels minimum + code x scale (the grey lines)."""
    codes = np.clip(np.round((values - minimum) / scale), 0, 15)
    levels = minimum + scale * np.arange(16)
    for level in levels:
        ax.axhline(level, color="0.85", linewidth=0.8, zorder=0)
    index = np.arange(len(values))
    ax.plot(index, values, "o", color="#0072B2", label="the weight (float)")
    ax.plot(index, minimum + scale * codes, "x", color="#D55E00", markersize=8,
            label="stored: minimum + code x scale")
    ax.set_xlabel("position in the group of 32")
    ax.set_ylabel("weight")
    ax.set_title("Q4_1: 32 weights, a float16 scale and minimum, a 4-bit code each")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8)


def draw_pairings(axes, head_dim: int = 8) -> None:
    """Which columns of one head the rotation turns together, in each pairing: interleaved
    (2i, 2i+1) and half (i, i + dh/2). A colour a pair (up to 8 pairs)."""
    half = head_dim // 2
    for ax, (name, partner) in zip(axes, (
            ("interleaved: (x[2i], x[2i+1])  GGUF, llama.cpp", lambda c: c // 2),
            ("half: (x[i], x[i + dh/2])  transformers, the hub", lambda c: c % half))):
        for column in range(head_dim):
            ax.add_patch(plt.Rectangle((column, 0), 0.9, 0.9,
                                       color=PAIR_COLOURS[partner(column) % len(PAIR_COLOURS)]))
            ax.text(column + 0.45, 0.45, str(column), ha="center", va="center", fontsize=10)
        ax.set_xlim(-0.2, head_dim + 0.1)
        ax.set_ylim(-0.1, 1.0)
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_title(f"{name}: one colour = one pair (angle i)", fontsize=10)
        ax.set_xlabel("column of a head")


def draw_cache_growth(ax, config, max_tokens: int | None = None,
                      bytes_per_number: int = 2) -> None:
    """MiB of the cache against the tokens it holds: the model's K/V heads, and as many K/V
    heads as query heads (multi-head attention), at bytes_per_number (2: float16)."""
    max_tokens = max_tokens or config.context_length
    tokens = np.linspace(0, max_tokens, 65)
    for n_kv_heads, name, colour in ((config.kv_heads, f"{config.kv_heads} K/V heads (GQA)",
                                      "#0072B2"),
                                     (config.n_heads, f"{config.n_heads} K/V heads (MHA)",
                                      "#D55E00")):
        per_token = kvlib.kv_cache_bytes(config.n_layers, None, 1, dtype_bytes=bytes_per_number,
                                         n_kv_heads=n_kv_heads, head_dim=config.head_dim)
        ax.plot(tokens, tokens * per_token / kvlib.MiB, color=colour,
                label=f"{name}: {per_token:,} bytes a token")
    ax.set_xlabel("tokens in the cache")
    ax.set_ylabel("MiB (float16)")
    ax.set_title("SmolLM2's cache for one sequence")
    ax.legend(fontsize=8)


# ------------------------------------------------------------------------------ the chat

def draw_tape(ax, conversation: Conversation, title: str | None = None) -> None:
    """The cache as one row of positions, coloured by what wrote them: the turns' text
    (template and user message) and the replies. Nothing is ever written twice."""
    ax.clear()
    for kind, start, end in conversation.spans:
        ax.barh(0, end - start, left=start, height=0.6, color=COLOURS[kind],
                edgecolor="white", linewidth=0.5)
    held = len(conversation.ids)
    ax.set_xlim(0, max(64, held * 1.05))
    ax.set_ylim(-0.6, 0.8)
    ax.set_yticks([])
    ax.set_xlabel("position in the cache")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in COLOURS]
    ax.legend(handles, [LABELS[k] for k in COLOURS], loc="upper right", fontsize=8, ncol=2)
    kib = conversation.cache.nbytes / 1024
    ax.set_title(title or f"The cache after {plural(len(conversation.messages) // 2, 'turn')}: "
                 f"{plural(held, 'position')}, {kib:,.0f} KiB in float32")


def cache_status(conversation: Conversation) -> str:
    held = len(conversation.ids)
    per_token = conversation.cache.nbytes // max(held, 1)
    return (f"The cache holds {plural(held, 'position')}: {conversation.cache.nbytes:,} bytes "
            f"({per_token:,} a token in float32; {per_token // 2:,} in float16). Every turn "
            "prefilled only its new text.")


def chat_widget(conversation: Conversation, max_new_tokens: int = 40):
    """A chat box (model_of_today): type a message, press Send; the reply streams in token by
    token from the cache, and the tape below shows what the cache holds. Reset empties it."""
    box = widgets.Text(placeholder="ask something, e.g. What is the capital of Italy?",
                       layout=widgets.Layout(width="30em"))
    send, reset = widgets.Button(description="Send"), widgets.Button(description="Reset")
    length = widgets.IntSlider(value=max_new_tokens, min=1, max=96,
                               description="new tokens", continuous_update=False)
    transcript, status, message = widgets.HTML(), widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(9, 1.9))

    def show_transcript() -> None:
        transcript.value = "<br>".join(f"<b>{m['role']}:</b> {as_html(m['content'])}"
                                       for m in conversation.messages)

    def redraw() -> None:
        show_transcript()
        draw_tape(live.ax, conversation)
        live.figure.tight_layout()
        live.show()
        status.value = cache_status(conversation)

    def on_send(_=None) -> None:
        text = box.value.strip()
        if not text:
            raise ValueError("type a message first")
        if len(text) > MAX_MESSAGE_CHARACTERS:
            raise ValueError(f"a message of {len(text):,} characters is more than this chat "
                             f"reads ({MAX_MESSAGE_CHARACTERS:,}): its prefill would take "
                             "minutes here")
        pending = conversation.messages + [{"role": "user", "content": text}]
        try:
            conversation.say(text, length.value,
                             on_token=lambda words: show_transcript_streaming(pending, words))
        finally:                # refused or interrupted: the transcript shows what was said
            redraw()
        box.value = ""

    def show_transcript_streaming(pending, words: str) -> None:
        lines = [f"<b>{m['role']}:</b> {as_html(m['content'])}" for m in pending]
        transcript.value = "<br>".join(lines + [f"<b>assistant:</b> {as_html(words)}…"])

    def on_reset(_=None) -> None:
        conversation.reset()
        redraw()

    send.on_click(safely(on_send, message, prefix="Not sent:"))
    with warnings.catch_warnings():     # ipywidgets 8 deprecates on_submit, and has no other
        warnings.simplefilter("ignore", DeprecationWarning)         # way to send on Enter
        box.on_submit(safely(on_send, message, prefix="Not sent:"))
    reset.on_click(safely(on_reset, message))
    redraw()
    layout = widgets.VBox([widgets.HBox([box, send, reset, length]), message, transcript,
                           status, live.output])
    layout.conversation, layout.figure, layout.controls = conversation, live.figure, {
        "text": box, "send": send, "reset": reset, "new tokens": length}
    layout.transcript, layout.status, layout.message = transcript, status, message
    return layout
