"""Exercises of the keeping_what_attention_reads lesson (keeping what attention reads):
checkers and solutions.

1. Which position TOVA drops next, from a small table of the current query's weights.
2. The bytes of SmolLM2's evicting cache at a budget of 256 positions, after 2,000 tokens.
3. The positions SnapKV keeps of a 10-token prompt, from the observation window's votes.
"""

from __future__ import annotations

import numpy as np

from kvlib.checkpoints.smollm2 import SMOLLM2_135M
from kvlib.eviction import TOVA, SnapKV
from kvlib.memory import MiB

from .base import (
    Feedback,
    as_number,
    checker,
    described,
    is_missing,
    near_miss,
    not_filled_in,
    read_whole_number,
    read_whole_numbers,
    show_solution,
    shown,
)

EXERCISE1_POSITIONS = np.array([0, 2, 5, 6, 8, 9])
"""The positions a layer holds, budget 5: the current token (9) has just been added."""
EXERCISE1_WEIGHTS = np.array([[0.50, 0.02, 0.10, 0.08, 0.10, 0.20],
                              [0.40, 0.20, 0.01, 0.09, 0.10, 0.20],
                              [0.30, 0.20, 0.15, 0.07, 0.06, 0.22]])
"""The current query's weights over the held positions, one row per query head (3 heads)."""
EXERCISE1_BUDGET = 5
EXERCISE2_BUDGET, EXERCISE2_TOKENS = 256, 2_000
EXERCISE3_VOTES = np.array([0.9, 0.1, 0.05, 0.6, 0.0, 0.05, 0.7, 0.02])
"""The votes for prompt positions 0-7: the weights the last 2 queries (positions 8 and 9, the
observation window) paid them, summed over the window and the group's query heads."""
EXERCISE3 = {"prompt_length": 10, "observation_window": 2, "kernel_size": 3, "budget": 5}


def tova_dropped() -> int:
    """The position kvlib's TOVA drops from exercise 1's table."""
    weights = EXERCISE1_WEIGHTS[None, :, None, :]                  # (kv 1, h 3, T 1, S 6)
    positions = EXERCISE1_POSITIONS[None, :]
    kept = TOVA().keep(positions, None, weights, EXERCISE1_BUDGET, first_pass=False)
    return int(np.setdiff1d(EXERCISE1_POSITIONS, positions[0, kept[0]])[0])


@checker
def check_tova_drop(answer) -> Feedback:
    """Exercise 1: the position TOVA drops from the table (positions 0, 2, 5, 6, 8, 9;
    budget 5)."""
    value = read_whole_number(answer, "a position")
    if isinstance(value, Feedback):
        return value
    expected = tova_dropped()
    slot = int(np.flatnonzero(EXERCISE1_POSITIONS == expected)[0])
    lowest_per_head = EXERCISE1_POSITIONS[EXERCISE1_WEIGHTS.argmin(axis=1)]
    if value == expected:
        return Feedback(True, f"position {expected}: the heads' mean weight on it is "
                        f"{EXERCISE1_WEIGHTS[:, slot].mean():.3f}, the lowest (position 5 and "
                        "8 have 0.087). No single head weighs it least.")
    if value == slot and value not in EXERCISE1_POSITIONS:
        return Feedback(False, f"{value} is the column (slot) of the position in the table; "
                        "give the position the cache holds there.")
    for head, position in enumerate(lowest_per_head):
        if value == position:
            return Feedback(False, f"position {value} has the lowest weight in head {head} "
                            "alone. TOVA keeps one set for the whole layer: it averages the "
                            "weights over the query heads first.")
    if value == EXERCISE1_POSITIONS[0]:
        return Feedback(False, "position 0 is the oldest: a window would drop it. TOVA drops "
                        "by weight, and the heads weigh position 0 most.")
    if value == EXERCISE1_POSITIONS[-1]:
        return Feedback(False, "position 9 is the current token: its weights are the ones "
                        "read; drop the held position the heads weigh least on average.")
    if value in EXERCISE1_POSITIONS:
        return Feedback(False, f"position {value} is held, but the heads' mean weight on it "
                        "is not the lowest: average each column over the 3 heads.")
    return Feedback(False, f"the layer holds positions {shown(EXERCISE1_POSITIONS.tolist())}: "
                    "TOVA drops one of them.")


def evicting_bytes(budget: int = EXERCISE2_BUDGET, dtype_bytes: int = 4) -> int:
    """K and V of SmolLM2 at `budget` positions a layer: layers x 2 x K/V heads x dh x bytes."""
    config = SMOLLM2_135M
    return config.n_layers * 2 * config.kv_heads * config.head_dim * dtype_bytes * budget


@checker
def check_evicting_bytes(answer) -> Feedback:
    """Exercise 2: nbytes of kvlib.EvictingCache(SmolLM2's config, 256) after 2,000 tokens
    (float32, K and V only)."""
    expected = evicting_bytes()
    if as_number(answer) in (expected / 1024, expected / MiB):
        return Feedback(False, "give the number of bytes, not KiB or MiB.")
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    per_position = expected // EXERCISE2_BUDGET
    config = SMOLLM2_135M
    index = config.n_layers * config.kv_heads * EXERCISE2_BUDGET * 16
    if value == expected:
        return Feedback(True, f"{expected:,} bytes ({expected / MiB:g} MiB): 30 layers x 2 x "
                        "3 K/V heads x 64 x 4 bytes x 256 positions, whatever the length. "
                        f"A plain cache would hold {per_position * EXERCISE2_TOKENS:,}.")
    if value == per_position * EXERCISE2_TOKENS:
        return Feedback(False, "that is every one of the 2,000 positions: the evicting cache "
                        "holds at most its budget, 256 a layer, between passes.")
    if value == per_position * (EXERCISE2_BUDGET + 1):
        return Feedback(False, "that is 257 positions, what a layer holds during a step (the "
                        "budget plus the new token); between steps it holds 256.")
    if value == expected + index:
        return Feedback(False, "that adds the positions and scores kept beside the rows "
                        "(cache.index_bytes); nbytes counts K and V only.")
    if value == expected * 3:
        return Feedback(False, "three times too much: SmolLM2 has 9 query heads but only 3 "
                        "K/V heads, and only K/V heads are cached.")
    if value * 2 == expected:
        return Feedback(False, "half of it: count K and V, both, at 4 bytes a number "
                        "(float32).")
    if value == expected * 8:
        return Feedback(False, "that counts bits: divide by 8 for bytes.")
    if value * 30 == expected:
        return Feedback(False, "that is one layer: the budget is per layer, and SmolLM2 has 30.")
    return near_miss(value, expected, "Count again: 2 x 3 x 64 x 4 bytes a position and a "
                     "layer.", "A held position in one layer costs 2 (K and V) x 3 K/V "
                     "heads x 64 x 4 bytes; a layer holds 256 of them.")


def snapkv_kept() -> tuple[int, ...]:
    """The positions kvlib's SnapKV keeps in exercise 3."""
    e = EXERCISE3
    length, window = e["prompt_length"], e["observation_window"]
    weights = np.zeros((1, 1, window, length))
    weights[0, 0, 0, : length - window] = EXERCISE3_VOTES       # the votes, all in one query
    policy = SnapKV(observation_window=window, kernel_size=e["kernel_size"])
    kept = policy.keep(np.arange(length)[None, :], None, weights, e["budget"], first_pass=True)
    return tuple(int(slot) for slot in kept[0])


def _as_positions(answer):
    """A set, range or 1-D array of positions -> a sorted list; anything else as it is."""
    if isinstance(answer, np.ndarray) and answer.ndim == 1 and answer.dtype.kind in "iuf":
        return sorted(answer.tolist())
    if isinstance(answer, (set, frozenset, range, list, tuple)):
        try:
            return sorted(answer)
        except (TypeError, ValueError, OverflowError):     # mixed types, huge numbers
            return list(answer)
    return answer


@checker
def check_snapkv_kept(answer) -> Feedback:
    """Exercise 3: the positions SnapKV keeps of a 10-token prompt (window 2, kernel 3,
    budget 5)."""
    if is_missing(answer):
        return not_filled_in("answer", "a list of positions, such as [0, 4, 5, 8, 9]")
    positions = _as_positions(answer)
    if not isinstance(positions, list):
        return Feedback(False, "answer should be a list of the positions kept, such as "
                        f"[0, 4, 5, 8, 9]; got {described(answer)}.")
    if positions == [0, 1, 6]:
        return Feedback(False, "those are the 3 best positions by pooled vote; SnapKV keeps "
                        "the observation window (positions 8 and 9) as well.")
    if positions == [0, 1, 2, 5, 6]:
        return Feedback(False, "that spends the whole budget on votes. The observation window "
                        "(8 and 9) is always kept and counts in the budget of 5.")
    if positions == [0, 1, 2, 5, 6, 8, 9]:
        return Feedback(False, "that is 7 positions: the window counts in the budget of 5, so "
                        "only 3 are chosen by vote.")
    if len(positions) != EXERCISE3["budget"]:
        return Feedback(False, f"SnapKV keeps exactly the budget, 5 positions; got "
                        f"{len(positions)}.")
    read = read_whole_numbers(positions, EXERCISE3["budget"])
    if isinstance(read, Feedback):
        return read
    if len(set(read)) != len(read):
        return Feedback(False, f"answer names a position twice: {shown(list(read))}.")
    expected = snapkv_kept()
    if tuple(read) == expected:
        return Feedback(True, "positions 0, 1, 6 by pooled vote, and the window 8, 9. Pooling "
                        "gave position 1 (vote 0.1) the vote of its neighbour 0 and dropped "
                        "position 3 (vote 0.6), which sits beside a 0.")
    if tuple(read) == (0, 3, 6, 8, 9):
        return Feedback(False, "those are the 3 largest raw votes. SnapKV first averages each "
                        "vote with its neighbours (kernel 3) and picks by the pooled votes.")
    if tuple(read) == (0, 1, 7, 8, 9):
        return Feedback(False, "that pools without the zeros past the ends (position 7 "
                        "averaged over 2). SnapKV pools like torch's avg_pool1d with padding: "
                        "the missing neighbour counts as 0, and the sum is divided by 3.")
    if any(position >= EXERCISE3["prompt_length"] or position < 0 for position in read):
        return Feedback(False, "the prompt has positions 0 to 9.")
    if not {8, 9} <= set(read):
        return Feedback(False, "the observation window (positions 8 and 9) is always kept.")
    return Feedback(False, "not those. Pool each vote with its two neighbours (zeros past the "
                    "ends, divide by 3), keep the 3 best, and add the window 8, 9.")


SOLUTIONS = {
    1: """
mean_weight = weights.mean(axis=0)                  # one score a position: the heads' mean
answer = int(held[np.argmin(mean_weight)])
""",
    2: """
config = params.config
answer = config.n_layers * 2 * config.kv_heads * config.head_dim * 4 * 256
# or: kvlib.EvictingCache(config, 256).nbytes after 2,000 tokens
""",
    3: """
padded = np.pad(votes, 1)                                   # kernel 3: one zero each side
pooled = (padded[:-2] + padded[1:-1] + padded[2:]) / 3
chosen = np.sort(np.argsort(-pooled, kind="stable")[:3])    # budget 5 minus the window of 2
answer = sorted(chosen.tolist() + [8, 9])
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
