"""Exercises of the kv_cache_memory lesson (KV cache memory): checkers and solutions.

1. Bytes per token of a grouped-query model described in words.
2. The batch size at which the source example's cache weighs as much as its weights.
3. How many tokens of Llama-3-8B's cache fit beside its weights on a 24 GiB accelerator.
"""

from __future__ import annotations

import math

from kvlib.memory import PRESETS, GiB, kv_cache_bytes, tokens_that_fit

from .base import Feedback, checker, near_miss, read_number, read_whole_number, show_solution

# Exercise 1: an imagined model with grouped-query attention, in BF16
EXERCISE1 = {"n_layers": 40, "n_heads": 40, "n_kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
# Exercise 2: the source example, 4096 tokens, BF16
EXERCISE2 = {"n_layers": 80, "d_model": 8192, "seq_len": 4096, "dtype_bytes": 2}
# Exercise 3: Llama-3-8B in BF16 on an accelerator with this much memory
EXERCISE3_MEMORY = 24 * GiB


@checker
def check_bytes_per_token(answer) -> Feedback:
    """Exercise 1: bytes one token adds to the cache of a 40-layer model with 40 query heads,
    8 K/V heads of 128, in BF16."""
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    e = EXERCISE1
    expected = kv_cache_bytes(e["n_layers"], None, 1, dtype_bytes=e["dtype_bytes"],
                              n_kv_heads=e["n_kv_heads"], head_dim=e["head_dim"])
    if value == expected:
        return Feedback(True, f"{expected:,} bytes ({expected // 1024} KiB) a token: 5 times "
                        "less than with a K/V head for every query head.")
    if value * 2 == expected:
        return Feedback(False, "half of it: that is K or V alone (or 1 byte a number). The "
                        "cache keeps both K and V, at 2 bytes a number in BF16.")
    if value == expected * e["n_heads"] // e["n_kv_heads"]:
        return Feedback(False, "that counts 40 K/V heads. Only the 8 K/V heads are cached; the "
                        "40 query heads share them, 5 to a K/V head.")
    if value * e["n_layers"] == expected:
        return Feedback(False, "that is one layer; every one of the 40 layers has its cache.")
    if value == expected * 2:
        return Feedback(False, "that is 4 bytes a number (float32); BF16 takes 2.")
    if value == expected * 4:
        return Feedback(False, "that is 8 bytes a number (float64); BF16 takes 2.")
    if value == expected * 8:
        return Feedback(False, "that counts bits, not bytes: BF16 is 16 bits, 2 bytes a "
                        "number.")
    if value * e["dtype_bytes"] == expected:
        return Feedback(False, "that is the number of cached numbers; multiply by 2 bytes "
                        "each (BF16).")
    return Feedback(False, "not that. Multiply 2 (K and V) x layers x K/V heads x head size "
                    "x bytes a number.")


@checker
def check_batch_where_cache_equals_weights(answer) -> Feedback:
    """Exercise 2: the batch at which the source example's cache (4096 tokens, BF16) weighs
    as much as its weights, estimated as 12 L d^2 in BF16."""
    value = read_number(answer, "a number (a batch size)")
    if isinstance(value, Feedback):
        return value
    e = EXERCISE2
    weights = 12 * e["n_layers"] * e["d_model"] ** 2 * e["dtype_bytes"]
    per_sequence = kv_cache_bytes(e["n_layers"], e["d_model"], e["seq_len"],
                                  dtype_bytes=e["dtype_bytes"])
    expected = weights / per_sequence
    if math.isclose(value, expected):
        return Feedback(True, f"{expected:g} sequences of 4096 tokens: 120 GiB of cache, as much "
                        "as the weights. At batch 64 the cache is over 5 times the weights.")
    if value > 0 and math.isclose(1 / value, expected):
        return Feedback(False, "that is cache / weights upside down: divide the weights' bytes by "
                        "one sequence's cache bytes.")
    if math.isclose(value, expected * 2) or math.isclose(value, expected / 2):
        return Feedback(False, "off by a factor 2: both the weights and the cache are in BF16 "
                        "(2 bytes), and the cache holds K and V.")
    return near_miss(value, expected,
                     "Divide the weights' bytes by one sequence's cache bytes, exactly.",
                     "Weights: 12 x 80 x 8192^2 weights x 2 bytes; one sequence's cache: "
                     "kv_cache_bytes(80, 8192, 4096).")


@checker
def check_tokens_that_fit(answer) -> Feedback:
    """Exercise 3: cached tokens of Llama-3-8B (BF16) that fit beside its BF16 weights in
    24 GiB."""
    value = read_number(answer, "a number of tokens")
    if isinstance(value, Feedback):
        return value
    model = PRESETS["Llama-3-8B"]
    per_token = model.kv_bytes_per_token()
    weights = model.weights_bytes()
    expected = tokens_that_fit(EXERCISE3_MEMORY, weights, per_token)
    if value == expected:
        return Feedback(True, f"{expected:,} tokens: about {expected // model.context_length} "
                        "full 8192-token sequences at once.")
    if math.isclose(value, (EXERCISE3_MEMORY - weights) / per_token, abs_tol=1):
        return Feedback(False, "almost: a token is cached whole or not at all; round down "
                        "(use //).")
    if value == EXERCISE3_MEMORY // per_token:
        return Feedback(False, "the weights take their share of the memory first: subtract "
                        "them before dividing.")
    if value == (24 * 10**9 - weights) // per_token:
        return Feedback(False, "24 GiB is 24 x 2^30 bytes, not 24 x 10^9.")
    mha = PRESETS["Llama-2-7B"].kv_bytes_per_token()
    if value == (EXERCISE3_MEMORY - weights) // mha:
        return Feedback(False, "that uses 32 K/V heads. Llama-3-8B has 32 query heads but "
                        "caches only 8 K/V heads.")
    if value == (EXERCISE3_MEMORY - weights // 2) // per_token:
        return Feedback(False, "that counts the weights at 1 byte each; in BF16 a weight "
                        "takes 2 (PRESETS['Llama-3-8B'].weights_bytes()).")
    return Feedback(False, "not that. (memory - weights) // bytes per token, with "
                    "PRESETS['Llama-3-8B'].weights_bytes() and .kv_bytes_per_token().")


SOLUTIONS = {
    1: """
answer = 2 * 40 * 8 * 128 * 2  # K and V x layers x K/V heads x head size x BF16 bytes
""",
    2: """
weights = 12 * 80 * 8192**2 * 2                      # bytes, BF16
one_sequence = kvlib.kv_cache_bytes(80, 8192, 4096)  # 10 GiB
answer = weights / one_sequence
""",
    3: """
model = memory.PRESETS["Llama-3-8B"]
answer = (24 * kvlib.GiB - model.weights_bytes()) // model.kv_bytes_per_token()
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
