"""Exercises of the state_layers lesson (a cache that does not grow): checkers and solutions.

1. The bytes of one sequence's DeltaNet state in Qwen3-Next-80B-A3B (bfloat16).
2. Which lengths a HybridCache with snapshot_every=6 can be truncated to, after a 20-token
   prompt and 3 decode steps.
3. How many tokens of a 1,000-token prompt whose first 900 match a cached conversation need not
   be computed again: states kept every 528 tokens (a hybrid model), and KV blocks of 16 (a
   model of attention only).
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from kvlib.deltanet import HybridConfig
from kvlib.hybrid_cache import resumable_length

from .base import (
    Feedback,
    agrees_at_its_precision,
    checker,
    described,
    is_missing,
    near_miss,
    not_filled_in,
    read_number,
    read_whole_numbers,
    show_solution,
    shown,
)

QWEN3_NEXT_80B = HybridConfig(
    vocab_size=151_936, d_model=2048,
    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                      for i in range(48)),
    d_ff=5632, n_heads=16, n_kv_heads=2, head_dim=256, rotary_dim=64, rope_base=10_000.0,
    linear_key_heads=16, linear_value_heads=32, linear_key_dim=128, linear_value_dim=128,
    conv_kernel=4, norm_epsilon=1e-6, context_length=32_768)
"""The sizes of Qwen3-Next-80B-A3B that the lesson uses: transformers 5.25's Qwen3NextConfig
defaults, which its docstring gives as Qwen/Qwen3-Next-80B-A3B-Instruct's (48 layers, every
fourth full attention; 16 q/k heads and 32 v heads of 128 in the DeltaNet layers; 2 K/V heads of
256 in the attention layers; a quarter of each head rotated). The experts, the MLP width and
the rotary base (a stand-in here) play no part in the cache."""
BYTES_BF16 = 2


def state_numbers(config: HybridConfig) -> int:
    """Numbers of one DeltaNet layer's state: the convolution's last K - 1 inputs and the rule's
    hv x d_k x d_v matrix (kvlib.deltanet.DeltaNetState)."""
    return ((config.conv_kernel - 1) * config.conv_dim
            + config.linear_value_heads * config.linear_key_dim * config.linear_value_dim)


def qwen3_next_state_bytes() -> int:
    """Exercise 1's answer, from the config."""
    return len(QWEN3_NEXT_80B.deltanet_layers) * state_numbers(QWEN3_NEXT_80B) * BYTES_BF16


# Exercise 1 ------------------------------------------------------------------------------

def _state_bytes_mistakes() -> dict[int, str]:
    config = QWEN3_NEXT_80B
    layers, matrix = len(config.deltanet_layers), (config.linear_value_heads
                                                   * config.linear_key_dim
                                                   * config.linear_value_dim)
    conv = (config.conv_kernel - 1) * config.conv_dim
    key_heads_matrix = config.linear_key_heads * config.linear_key_dim * config.linear_value_dim
    return {
        layers * matrix * BYTES_BF16: "that is the delta rule's matrices alone: each layer also "
        "keeps the convolution's last K - 1 = 3 inputs of conv_dim = 8,192 channels.",
        layers * (matrix + config.conv_kernel * config.conv_dim) * BYTES_BF16: "that keeps K = 4 "
        "inputs of the convolution (transformers' conv_states do); the oldest is never read, "
        "and kvlib's DeltaNetState keeps K - 1 = 3.",
        config.n_layers * (matrix + conv) * BYTES_BF16: "that counts all 48 layers: every fourth "
        "is full attention, with a KV cache instead of a state. 36 layers keep a state.",
        layers * (matrix + conv) * 4: "that is float32 (4 bytes a number); the exercise asks for "
        "bfloat16, 2 bytes.",
        layers * (matrix + conv): "that counts numbers; each takes 2 bytes in bfloat16.",
        (matrix + conv) * BYTES_BF16: "that is one layer's state; 36 layers keep one.",
        layers * (key_heads_matrix + conv) * BYTES_BF16: "the matrix is kept per value head "
        "(32), not per query/key head (16): each q/k head serves two value heads.",
        layers * key_heads_matrix * BYTES_BF16: "the matrix is kept per value head (32, not 16), "
        "and the convolution's last 3 inputs are part of the state too.",
    }


@checker
def check_state_bytes(answer) -> Feedback:
    """Exercise 1: bytes of one sequence's DeltaNet states in Qwen3-Next-80B-A3B, bfloat16."""
    if is_missing(answer):
        return not_filled_in("answer", "a number of bytes")
    value = read_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    expected = qwen3_next_state_bytes()
    if value == expected or agrees_at_its_precision(value, expected):
        return Feedback(True, f"{expected:,} bytes (about {expected / 2**20:.1f} MiB): 36 layers "
                        "x (32 x 128 x 128 + 3 x 8,192) numbers x 2 bytes, at 10 tokens as at "
                        "32,768.")
    for wrong, why in _state_bytes_mistakes().items():
        if value == wrong:
            return Feedback(False, why)
    if value < 0:
        return Feedback(False, "a number of bytes cannot be negative.")
    return near_miss(value, expected, "count 36 layers x (hv x d_k x d_v + (K - 1) x conv_dim) "
                     "numbers x 2 bytes, exactly.",
                     "per DeltaNet layer: hv x d_k x d_v numbers for the rule's matrix and "
                     "(K - 1) x conv_dim for the convolution; 36 such layers; 2 bytes each.")


# Exercise 2 ------------------------------------------------------------------------------

SNAPSHOT_EVERY = 6
PROMPT_LENGTH = 20
DECODE_STEPS = 3


def allowed_lengths() -> list[int]:
    """Exercise 2's answer: 0, each multiple of 6 the sequence has passed, and its length."""
    length = PROMPT_LENGTH + DECODE_STEPS
    return sorted({0, length, *range(SNAPSHOT_EVERY, length + 1, SNAPSHOT_EVERY)})


def _read_lengths(answer) -> list[int] | Feedback:
    """The student's lengths, as a sorted list of whole numbers, or what is wrong with them."""
    if isinstance(answer, (set, frozenset, range)):
        answer = sorted(answer, key=lambda x: (not isinstance(x, (Integral, float)), str(x)))
    if isinstance(answer, np.ndarray) and answer.ndim == 1:
        answer = answer.tolist()
    if not isinstance(answer, (list, tuple)) or not answer:
        return Feedback(False, "answer should be a list of lengths, such as [0, 5, 23], got "
                        f"{described(answer)}.")
    read = read_whole_numbers(answer, len(answer), "answer")
    if isinstance(read, Feedback):
        return read
    return sorted(set(read))


@checker
def check_truncate_lengths(answer) -> Feedback:
    """Exercise 2: every n for which truncate(n) works on the exercise's cache."""
    if is_missing(answer):
        return not_filled_in("answer", "a list of lengths, such as [0, 5, 23]")
    read = _read_lengths(answer)
    if isinstance(read, Feedback):
        return read
    expected = allowed_lengths()
    length = PROMPT_LENGTH + DECODE_STEPS
    if read == expected:
        return Feedback(True, f"{expected}: zeros at 0, the snapshots kept at 6, 12 and 18 "
                        f"(the prefill stops at each multiple of 6), and {length} itself, where "
                        "there is nothing to undo.")
    given, wanted = set(read), set(expected)
    if any(n > length or n < 0 for n in given):
        return Feedback(False, f"the cache holds {length} positions: a length above {length} "
                        "(or below 0) is never allowed.")
    if given == set(range(length + 1)):
        return Feedback(False, "the attention layers could be cut anywhere, but a DeltaNet "
                        "state has mixed every token together: only lengths where the state was "
                        "kept can be returned to.")
    if {5, 11, 17} <= given and not given & {6, 12, 18}:
        return Feedback(False, "a snapshot is kept when the length reaches a multiple of 6 (after "
                        "6 tokens the length is 6): the lengths are 6, 12, 18, not 5, 11, 17.")
    if PROMPT_LENGTH in given:
        return Feedback(False, f"{PROMPT_LENGTH} is where the prompt ended, but no state was kept "
                        "there: the prefill keeps them at multiples of 6 only. cache.snapshot() "
                        "after the prefill would have kept one.")
    if given & {length - 1, length - 2}:
        return Feedback(False, "the decode steps keep no snapshot (their lengths, 21 and 22, are "
                        "not multiples of 6): the state after them cannot be returned to.")
    missing = sorted(wanted - given)
    extra = sorted(given - wanted)
    if 0 in missing:
        return Feedback(False, "0 is always allowed: the state of no tokens is zeros.")
    if length in missing:
        return Feedback(False, f"{length}, the current length, is always allowed: truncate then "
                        "has nothing to undo.")
    if missing:
        return Feedback(False, f"the cache also kept a snapshot at {shown(missing)}: read "
                        "cache.snapshot_positions.")
    return Feedback(False, f"{shown(extra)}: no state was kept there, so truncate refuses.")


# Exercise 3 ------------------------------------------------------------------------------

PROMPT_TOKENS = 1000
MATCHING_TOKENS = 900
STATE_EVERY = 528
BLOCK_SIZE = 16


def resumable_answer() -> tuple[int, int]:
    """Exercise 3's answer: (hybrid, states every 528; attention only, blocks of 16)."""
    return (resumable_length(MATCHING_TOKENS, PROMPT_TOKENS, STATE_EVERY),
            resumable_length(MATCHING_TOKENS, PROMPT_TOKENS, BLOCK_SIZE))


@checker
def check_resumable_tokens(answer) -> Feedback:
    """Exercise 3: (tokens skipped with states every 528, tokens skipped with blocks of 16)."""
    if is_missing(answer):
        return not_filled_in("answer", "two numbers, (with states every 528, with blocks of 16)")
    read = read_whole_numbers(answer, 2, "answer")
    if isinstance(read, Feedback):
        return read
    hybrid, attention = read
    expected = resumable_answer()
    if read == expected:
        return Feedback(True, f"{expected[0]} and {expected[1]}: the last multiple of 528 (of 16) "
                        f"within the {MATCHING_TOKENS} matching tokens. The hybrid model computes "
                        f"{PROMPT_TOKENS - expected[0]} tokens again, the other "
                        f"{PROMPT_TOKENS - expected[1]}.")
    if read == expected[::-1]:
        return Feedback(False, "the two numbers are swapped: (states every 528, blocks of 16).")
    if hybrid == MATCHING_TOKENS or attention == MATCHING_TOKENS:
        return Feedback(False, f"{MATCHING_TOKENS} tokens match, but the cache can only resume "
                        "where it kept something: at a multiple of 528 (of 16).")
    if hybrid > MATCHING_TOKENS or attention > MATCHING_TOKENS:
        return Feedback(False, f"more than the {MATCHING_TOKENS} matching tokens: round down to "
                        "a multiple, never up (a state past the match holds other tokens).")
    if hybrid == 0:
        return Feedback(False, f"{MATCHING_TOKENS} is past 528, so one state, kept at 528, "
                        "matches.")
    if hybrid != expected[0]:
        return Feedback(False, f"the first number: the largest multiple of 528 at most "
                        f"{MATCHING_TOKENS}.")
    if attention == expected[1] - BLOCK_SIZE:
        return Feedback(False, f"{attention} is one block short: 896 = 56 x 16 is within the "
                        f"{MATCHING_TOKENS} matching tokens.")
    return Feedback(False, f"the second number: the largest multiple of 16 at most "
                    f"{MATCHING_TOKENS}.")


SOLUTIONS = {
    1: '''
config = exercises.QWEN3_NEXT_80B
layers = len(config.deltanet_layers)                                          # 36
matrix = config.linear_value_heads * config.linear_key_dim * config.linear_value_dim
convolution = (config.conv_kernel - 1) * config.conv_dim                      # 3 x 8,192
answer = layers * (matrix + convolution) * 2
''',
    2: '''
answer = [0, 6, 12, 18, 23]      # zeros, the three snapshots, the current length
''',
    3: '''
answer = (900 // 528 * 528, 900 // 16 * 16)     # (528, 896)
''',
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor: try first)."""
    return show_solution(SOLUTIONS, number)
