"""Exercises of the sliding_windows_and_sinks lesson (sliding windows and attention sinks): checkers
and solutions.

1. Transfer: which positions does one query of Mistral-7B see, with a window of 4096 and
   4 attention sinks added? The usual slips are off by one at the window's edge and
   forgetting the sinks (or counting them inside the window).
2. Find the bug: a ring buffer that writes position p to slot p % W overwrites the sinks.
   The fixed ring_slot(position, window, sink_tokens) is run on a table of cases.
3. Prediction: the bytes of that Mistral-7B cache after 10,000 tokens, in BF16.
"""

from __future__ import annotations

import math

import numpy as np

import kvlib

from .base import (
    Feedback,
    as_number,
    checker,
    is_missing,
    not_filled_in,
    read_function,
    read_whole_number,
    show_solution,
)

# Exercise 1 and 3: Mistral-7B (kvlib.memory.PRESETS) with StreamingLLM's 4 sinks added
WINDOW, SINK_TOKENS, QUERY = 4096, 4, 5000
MISTRAL = kvlib.memory.PRESETS["Mistral-7B"]
N_TOKENS, DTYPE_BYTES = 10_000, 2

# Exercise 2: (position, window, sink_tokens); sinks, the first wrap, and later laps
SLOT_CASES = (
    (0, 4, 0), (3, 4, 0), (4, 4, 0), (9, 4, 0),
    (0, 4, 2), (1, 4, 2), (2, 4, 2), (5, 4, 2), (6, 4, 2), (13, 4, 2),
    (2, 3, 4), (4, 3, 4), (7, 3, 4), (30, 3, 4), (100, 7, 1), (4099, 4096, 4),
)


def _expected_slot(position: int, window: int, sink_tokens: int) -> int:
    return position if position < sink_tokens else \
        sink_tokens + (position - sink_tokens) % window


# Exercise 1 ------------------------------------------------------------------------------

def visible_positions(query: int = QUERY, window: int = WINDOW,
                      sink_tokens: int = SINK_TOKENS) -> list[int]:
    """The positions query sees: kvlib.attention_mask's row for it, as a list."""
    keys = np.arange(query + 1)
    return np.flatnonzero(kvlib.attention_mask([query], keys, window, sink_tokens)[0]).tolist()


def _is_mask(answer) -> bool:
    """True for a row (or rows) of True/False: an attention mask, not positions."""
    if isinstance(answer, np.ndarray):
        return answer.dtype == bool and answer.size > 1
    return isinstance(answer, (list, tuple)) and len(answer) > 1 and \
        all(isinstance(item, (bool, np.bool_)) for item in answer)


def _as_positions(answer) -> list[int] | Feedback:
    """A collection of whole numbers (a list, tuple, array, set, range) -> its sorted list,
    or a Feedback that says what is wrong. Each element follows base.read_whole_number."""
    if isinstance(answer, (str, bytes)):
        return Feedback(False, "positions are numbers, not text: give a list such as "
                        "[0, 1, 2, 3].")
    if _is_mask(answer):
        return Feedback(False, "give positions, not a mask: that is a row of True/False, one "
                        "per key. The positions are the indices where it is True: "
                        "np.flatnonzero(row) lists them.")
    if not isinstance(answer, (list, tuple, np.ndarray)) and hasattr(answer, "__iter__"):
        try:            # a set, a range, a generator: its elements, in any order
            answer = list(answer)
        except Exception as error:  # an iterable of a student's own may fail in any way
            return Feedback(False, f"could not read the positions: {type(error).__name__}: "
                            f"{error}")
    if isinstance(answer, np.ndarray) and answer.ndim >= 1:
        answer = answer.tolist()
    if not isinstance(answer, (list, tuple)):
        return Feedback(False, "give every position the query sees, as a list (one number is "
                        "not enough; list(range(a, b)) builds a run).")
    positions = []
    for item in answer:
        if isinstance(item, (list, tuple, np.ndarray)):
            return Feedback(False, "give one flat list of positions, not a list of lists: join "
                            "the runs with + (list(range(a, b)) + list(range(c, d))).")
        if is_missing(item):
            return Feedback(False, f"{item!r} is not a position: every position is a whole "
                            "number.")
        value = read_whole_number(item, name="every position")
        if isinstance(value, Feedback):
            return value
        positions.append(value)
    if len(set(positions)) != len(positions):
        return Feedback(False, "some positions appear twice: list each position once.")
    return sorted(positions)


def _runs(positions: list[int]) -> str:
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][1] + 1:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    shown = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:4])
    return shown + (", ..." if len(runs) > 4 else "")


def _typical_slips() -> list[tuple[list[int], str]]:
    """Wrong answers a student is likely to give, each with what went wrong."""
    p, W, s = QUERY, WINDOW, SINK_TOKENS
    sinks = list(range(s))
    return [
        (list(range(p - W + 1, p + 1)), "the first 4 positions are missing: the sinks stay "
         "visible to every query, beside the window."),
        (sinks + list(range(p - W, p + 1)), f"one position too many: the window is W = {W} "
         f"positions counting the query itself, so it starts at {p} - {W} + 1."),
        (sinks + list(range(p - W, p)), f"the window ends at the query itself: it is the "
         f"{W} positions {p - W + 1} to {p}, not {p - W} to {p - 1}."),
        (sinks + list(range(p - W + 1, p)), f"the query itself is missing: {p} is the last "
         "position of its own window."),
        (sinks + list(range(p - W + s + 1, p + 1)), "the sinks come on top of the window, "
         f"not out of it: {s} sinks plus the last {W} positions."),
        (list(range(s + 1)) + list(range(p - W + 1, p + 1)), f"one sink too many: "
         f"sink_tokens = {s} keeps positions 0 to {s - 1}."),
        (list(range(p + 1)), "that is every earlier position: full attention. The window "
         f"keeps only the last {W}, plus the sinks."),
        ([q + 1 for q in sinks] + list(range(p - W + 2, p + 2)), "positions count from 0: "
         "the first token is position 0, and the query is at 5000."),
    ]


@checker
def check_visible_positions(answer) -> Feedback:
    """Exercise 1: every position query 5000 sees in Mistral-7B (W = 4096) with 4 sinks."""
    if is_missing(answer):
        return not_filled_in("answer", "a list of positions")
    positions = _as_positions(answer)
    if isinstance(positions, Feedback):
        return positions
    expected = visible_positions()
    if positions == expected:
        return Feedback(True, f"query {QUERY} sees {len(expected)} positions: the {SINK_TOKENS} "
                        f"sinks 0..{SINK_TOKENS - 1} and the window {QUERY - WINDOW + 1}.."
                        f"{QUERY}. Its cache holds exactly these rows.")
    for slip, diagnosis in _typical_slips():
        if positions == slip:
            return Feedback(False, diagnosis)
    if positions and positions[-1] > QUERY:
        return Feedback(False, f"position {positions[-1]} comes after the query: causal "
                        f"attention never looks ahead of {QUERY}.")
    missing = sorted(set(expected) - set(positions))
    extra = sorted(set(positions) - set(expected))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} (such as {_runs(missing)})")
    if extra:
        parts.append(f"{len(extra)} too many (such as {_runs(extra)})")
    return Feedback(False, f"not these positions: {' and '.join(parts)}. The query sees the "
                    "sinks and the last W positions, itself included.")


# Exercise 2 ------------------------------------------------------------------------------

SLOT_SLIPS = (
    (lambda p, W, s: p % W, "this is p % W: it ignores the sinks, so the window's positions "
     "land in the sinks' slots and overwrite them. Count the window's slots after the sinks: "
     "s + (p - s) % W."),
    (lambda p, W, s: p % (W + s), "p % (W + s) cycles through the sinks' slots too: the "
     "sinks are written once and never again. Only positions from s on go round the ring."),
    (lambda p, W, s: (p - s) % W if p >= s else p, "the window's slots start after the "
     "sinks: add s to (p - s) % W."),
    (lambda p, W, s: s + p % W if p >= s else p, "subtract the sinks first: position s is "
     "the first of the window and goes to slot s, so the window slot is s + (p - s) % W."),
    (lambda p, W, s: s + (p - s) % W, "a sink position (p < s) keeps its own slot p; only "
     "the positions after the sinks go round the ring."),
    (lambda p, W, s: s + (p - s + 1) % W if p >= s else p, "off by one: position s goes "
     "to slot s, the first window slot, so use (p - s) % W without adding 1."),
    (lambda p, W, s: s + (p - s - 1) % W if p >= s else p, "off by one: position s goes "
     "to slot s, the first window slot, so use (p - s) % W without subtracting 1."),
)


def _run_slot_function(ring_slot) -> list[int] | Feedback:
    """The slot for every case, or a Feedback on the first case that fails."""
    slots = []
    for position, window, sinks in SLOT_CASES:
        where = f"ring_slot({position}, window={window}, sink_tokens={sinks})"
        try:
            value = ring_slot(position, window, sinks)
        except Exception as error:  # a student's code may fail in any way; report it in words
            return Feedback(False, f"{where} raised {type(error).__name__}: {error}")
        slot = read_whole_number(value, "one whole number",
                                 f"the slot {where} returned (a slot is one whole number)")
        if isinstance(slot, Feedback):
            return slot
        slots.append(slot)
    return slots


@checker
def check_ring_slot(ring_slot) -> Feedback:
    """Exercise 2: a fixed `ring_slot(position, window, sink_tokens) -> slot`, run on
    SLOT_CASES and compared with the layout of kvlib.SlidingWindowCache."""
    refused = read_function(ring_slot, "ring_slot_fixed", "ring_slot_broken")
    if refused is not None:
        return refused
    slots = _run_slot_function(ring_slot)
    if isinstance(slots, Feedback):
        return slots
    expected = [_expected_slot(*case) for case in SLOT_CASES]
    if slots == expected:
        return Feedback(True, f"all {len(SLOT_CASES)} cases land in the slots "
                        "kvlib.SlidingWindowCache uses: sinks in their own slots, the "
                        "window going round the W slots after them.")
    for slip, diagnosis in SLOT_SLIPS:
        if slots == [slip(*case) for case in SLOT_CASES]:
            return Feedback(False, diagnosis)
    for (position, window, sinks), got, want in zip(SLOT_CASES, slots, expected):
        if not 0 <= got < window + sinks:
            return Feedback(False, f"ring_slot({position}, {window}, {sinks}) = {got}: the "
                            f"buffer has only {sinks + window} slots, 0 to "
                            f"{sinks + window - 1}.")
        if got != want:
            return Feedback(False, f"ring_slot({position}, window={window}, sink_tokens="
                            f"{sinks}) should be {want}, got {got}.")
    return Feedback(False, "some slots differ from kvlib.SlidingWindowCache's.")


# Exercise 3 ------------------------------------------------------------------------------

def mistral_cache_bytes(n_tokens: int = N_TOKENS, sink_tokens: int = SINK_TOKENS,
                        window: int | None = WINDOW, n_kv_heads: int = MISTRAL.n_kv_heads,
                        n_layers: int = MISTRAL.n_layers, dtype_bytes: int = DTYPE_BYTES,
                        ) -> int:
    """Bytes of Mistral-7B's window cache with sinks after n_tokens (kvlib.kv_cache_bytes
    over the positions held)."""
    held = n_tokens if window is None else min(n_tokens, sink_tokens + window)
    return kvlib.kv_cache_bytes(n_layers, None, held, dtype_bytes=dtype_bytes,
                                n_kv_heads=n_kv_heads, head_dim=MISTRAL.head_dim)


def _byte_slips() -> list[tuple[float, float, str]]:
    """(wrong value, relative tolerance, what went wrong): byte counts must match to the
    byte; answers in GiB or MiB may be rounded."""
    right = mistral_cache_bytes()
    exact = 1e-12
    return [
        (mistral_cache_bytes(window=None), exact, "that is a full cache of all 10,000 "
         "tokens: the ring holds only the sinks and the last W positions."),
        (mistral_cache_bytes(sink_tokens=0), exact, "that is the window alone: the 4 sinks "
         "are held too, 4 more rows in every layer."),
        (mistral_cache_bytes(sink_tokens=SINK_TOKENS - 1), exact, "one row short a layer: "
         "after 10,000 tokens the ring holds the 4 sinks and the last 4096 positions, the "
         "newest included: 4100 rows."),
        (mistral_cache_bytes(n_kv_heads=MISTRAL.n_heads), exact, "Mistral-7B caches 8 K/V "
         "heads, not 32 (grouped-query attention, notebook 15)."),
        (right / 2, exact, "the cache holds K and V: multiply by 2."),
        (right / MISTRAL.n_layers, exact, "that is one layer: every one of the 32 layers has "
         "its own cache."),
        (mistral_cache_bytes(dtype_bytes=4), exact, "BF16 numbers take 2 bytes, not 4."),
        (right * 8, exact, "bytes, not bits: a BF16 number is 2 bytes."),
        (right / kvlib.GiB, 2e-3, "that is in GiB: the exercise asks for bytes."),
        (right / kvlib.MiB, 2e-3, "that is in MiB: the exercise asks for bytes."),
    ]


@checker
def check_cache_bytes(answer) -> Feedback:
    """Exercise 3: bytes of Mistral-7B's cache with 4 sinks after 10,000 tokens, BF16."""
    if is_missing(answer):
        return not_filled_in("answer", "a number of bytes")
    right = mistral_cache_bytes()
    value = as_number(answer)
    if value is not None:       # a slip, in bytes or in another unit, is named first
        if value < 0:
            return Feedback(False, "a number of bytes cannot be negative.")
        for slip, tolerance, diagnosis in _byte_slips():
            if value != right and math.isclose(value, slip, rel_tol=tolerance):
                return Feedback(False, diagnosis)
    count = read_whole_number(answer, "a number of bytes", expected=right)
    if isinstance(count, Feedback):
        return count
    if count == right:
        return Feedback(True, f"{right:,} bytes ({right / kvlib.MiB:,.1f} MiB) at any length "
                        f"past 4100 tokens; a full cache of 10,000 tokens would take "
                        f"{mistral_cache_bytes(window=None) / kvlib.MiB:,.0f} MiB.")
    if count < 0:
        return Feedback(False, "a number of bytes cannot be negative.")
    return Feedback(False, f"{count:,} is not it. Count the rows held (sinks + W), then 2 (K "
                    "and V) x layers x K/V heads x head size x 2 bytes each.")


SOLUTIONS = {
    1: """
p, W, s = 5000, 4096, 4
answer = list(range(s)) + list(range(p - W + 1, p + 1))   # the sinks, then the window
# or, from the mask itself:
# answer = np.flatnonzero(kvlib.attention_mask([p], np.arange(p + 1), W, s)[0])
""",
    2: """
def ring_slot_fixed(position, window, sink_tokens):
    if position < sink_tokens:            # a sink keeps its own slot for good
        return position
    return sink_tokens + (position - sink_tokens) % window   # the window goes round after them

answer = ring_slot_fixed
""",
    3: """
held = 4 + 4096                           # sinks + window, however long the text
answer = 2 * 32 * held * 8 * 128 * 2      # K and V x layers x rows x K/V heads x head size x BF16
# = kvlib.kv_cache_bytes(32, None, held, dtype_bytes=2, n_kv_heads=8, head_dim=128)
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
