"""Exercises of notebook 09 (the cost of generation): checkers and solutions.

1. The multiply-adds of one full recomputation, part by part, from the formulas.
2. The FLOP ratio of generating without and with the cache, for another prompt.
3. A roofline prediction: how long a GPT-2-small decode step takes on a given machine.
"""

from __future__ import annotations

import math
from numbers import Real

import kvlib
from kvlib import roofline

from .base import Feedback, as_number, is_missing, show_solution

PARTS = ("projections", "attention_scores", "attention_sums", "mlp", "unembedding")

# Exercise 1: a full forward of GPT-2 small over this many tokens, last row unembedded
EXERCISE1_TOKENS = 100
# Exercise 2: GPT-2 small, this prompt and this many new tokens
EXERCISE2_PROMPT, EXERCISE2_NEW = 128, 256
# Exercise 3: a decode step of GPT-2 small at this position, on this (imagined) machine
EXERCISE3_POSITION = 543
EXERCISE3_COMPUTE_RATE = 200e9   # FLOP/s
EXERCISE3_BANDWIDTH = 50e9       # bytes/s


def check_forward_macs(answer) -> Feedback:
    """Exercise 1: a dict {part: multiply-adds} of GPT-2 small's full forward over 100 tokens,
    no cache, unembedding only the last row."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a dict.")
    if isinstance(answer, kvlib.MultiplyAdds):
        answer = answer.as_dict()
    if not isinstance(answer, dict):
        return Feedback(False, f"expected a dict from part name to multiply-adds, got "
                        f"{type(answer).__name__}.")
    missing = [part for part in PARTS if part not in answer]
    if missing:
        return Feedback(False, f"the dict has no entry for {', '.join(missing)}; it needs the "
                        f"five parts {', '.join(PARTS)}.")
    extra = sorted(set(answer) - set(PARTS))
    if extra:
        return Feedback(False, f"unexpected entries {extra}: keep only {', '.join(PARTS)}.")
    config, T = kvlib.GPT2_SMALL, EXERCISE1_TOKENS
    L, d, f, V = config.n_layers, config.d_model, config.d_ff, config.vocab_size
    expected = kvlib.forward_multiply_adds(config, T, last_only=True).as_dict()
    one_row = kvlib.decode_step_multiply_adds(config, T - 1).as_dict()
    for part in PARTS:
        value = answer[part]
        if isinstance(value, bool) or not isinstance(value, Real):
            return Feedback(False, f"{part} should be a number, got {type(value).__name__}.")
        if value == expected[part]:
            continue
        if part != "unembedding" and value * L == expected[part]:
            return Feedback(False, f"{part}: that is one layer's work; every one of the {L} "
                            "layers does it.")
        if part == "unembedding" and value == T * d * V:
            return Feedback(False, "unembedding: that turns all 100 rows into logits; the "
                            "baseline unembeds only the last row, all the next token needs.")
        if value == one_row[part]:
            return Feedback(False, f"{part}: that is for one row. Without the cache, all "
                            f"{T} rows go through every layer again.")
        if part in ("attention_scores", "attention_sums") and value * 2 == expected[part]:
            return Feedback(False, f"{part}: kvlib computes the whole T x T score matrix, the "
                            "masked half too (it is set to -inf afterwards), so count T x T.")
        if part == "projections" and value == L * 3 * T * d * d:
            return Feedback(False, "projections: Q, K and V, and also the output projection "
                            "Wo: four (d, d) matrices.")
        if part == "mlp" and value == L * T * d * f:
            return Feedback(False, "mlp: count both matrices, up (d, f) and down (f, d).")
        return Feedback(False, f"{part} should be {expected[part]:,}, got {value!r}. T = S = "
                        f"{T}: every row is a query and a key; see the formulas in kvlib.flops.")
    total = sum(expected.values())
    return Feedback(True, f"{total:,} multiply-adds: about {total / sum(one_row.values()):.0f} "
                    "times a decode step at the same position.")


def check_flop_ratio(answer) -> Feedback:
    """Exercise 2: FLOPs without the cache / with it, GPT-2 small, prompt 128, 256 new tokens."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a number.")
    value = as_number(answer)
    if value is None:
        return Feedback(False, f"expected a number (a ratio), got {type(answer).__name__}.")
    config, P, N = kvlib.GPT2_SMALL, EXERCISE2_PROMPT, EXERCISE2_NEW
    without = kvlib.generation_multiply_adds(config, P, N, use_cache=False).total
    with_cache = kvlib.generation_multiply_adds(config, P, N, use_cache=True).total
    expected = without / with_cache
    if math.isclose(value, expected, rel_tol=1e-6):
        short = (kvlib.generation_multiply_adds(config, 32, N, use_cache=False).total
                 / kvlib.generation_multiply_adds(config, 32, N, use_cache=True).total)
        return Feedback(True, f"about {expected:.1f} times fewer FLOPs with the cache, against "
                        f"{short:.1f} after a 32-token prompt: without the cache, every pass "
                        "recomputes the whole prompt too.")
    if value > 0 and math.isclose(1 / value, expected, rel_tol=1e-6):
        return Feedback(False, "that is with / without; the question asks how many times more "
                        "work recomputation does: without / with.")
    return Feedback(False, f"not {value:.4g}. Divide kvlib.generation_multiply_adds(config, "
                    f"{P}, {N}, use_cache=False).total by the same with use_cache=True.")


def check_roofline_time(answer) -> Feedback:
    """Exercise 3: roofline seconds of GPT-2 small's decode step at position 543, with
    200 GFLOP/s and 50 GB/s."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a number "
                        "of seconds.")
    value = as_number(answer)
    if value is None:
        return Feedback(False, f"expected a number of seconds, got {type(answer).__name__}.")
    config = kvlib.GPT2_SMALL
    flops = kvlib.decode_step_multiply_adds(config, EXERCISE3_POSITION).flops
    n_bytes = roofline.decode_step_bytes(config, EXERCISE3_POSITION)
    rate, bandwidth = EXERCISE3_COMPUTE_RATE, EXERCISE3_BANDWIDTH
    expected = max(flops / rate, n_bytes / bandwidth)
    if math.isclose(value, expected, rel_tol=1e-6):
        return Feedback(True, f"{expected * 1e3:.2f} ms, set by reading {n_bytes / 1e6:.0f} MB; "
                        f"the arithmetic alone would take {flops / rate * 1e3:.2f} ms.")
    if math.isclose(value, flops / rate + n_bytes / bandwidth, rel_tol=1e-6):
        return Feedback(False, "you added the two times. In the roofline model reading and "
                        "computing overlap: the slower of the two sets the time (max).")
    if math.isclose(value, min(flops / rate, n_bytes / bandwidth), rel_tol=1e-6):
        return Feedback(False, "that is the faster of the two; the slower one sets the time.")
    if math.isclose(value, flops / 2 / rate, rel_tol=1e-6) or \
            math.isclose(value, flops / rate, rel_tol=1e-6):
        return Feedback(False, "that is the arithmetic time only: a decode step does about "
                        "2 FLOPs per 4-byte weight, so reading the weights takes longer.")
    if math.isclose(value, roofline.weights_bytes(config) / bandwidth, rel_tol=1e-6):
        return Feedback(False, "close: the weights are there, but the step also reads the "
                        f"keys and values of its {EXERCISE3_POSITION + 1} positions "
                        "(roofline.decode_step_bytes counts both).")
    if math.isclose(value * 1e3, expected, rel_tol=1e-3) or \
            math.isclose(value, expected * 1e3, rel_tol=1e-3):
        return Feedback(False, "the right number in the wrong unit: give seconds.")
    return Feedback(False, f"not {value:.4g} s. Compute max(FLOPs / {rate:.0e} FLOP/s, bytes / "
                    f"{bandwidth:.0e} bytes/s) with the step's FLOPs and bytes.")


SOLUTIONS = {
    1: """
config = kvlib.GPT2_SMALL
L, d, f, V = config.n_layers, config.d_model, config.d_ff, config.vocab_size
T = 100  # every row is a query, and every row is a key: T = S
answer = {
    "projections": L * 4 * T * d * d,   # Wq, Wk, Wv, Wo on all T rows
    "attention_scores": L * T * T * d,  # all heads: T x dh times dh x T
    "attention_sums": L * T * T * d,    # all heads: T x T times T x dh
    "mlp": L * 2 * T * d * f,           # up and down, every row
    "unembedding": d * V,               # only the last row becomes logits
}
""",
    2: """
config = kvlib.GPT2_SMALL
without = kvlib.generation_multiply_adds(config, 128, 256, use_cache=False)
with_cache = kvlib.generation_multiply_adds(config, 128, 256, use_cache=True)
answer = without.total / with_cache.total
""",
    3: """
config = kvlib.GPT2_SMALL
flops = kvlib.decode_step_multiply_adds(config, 543).flops
n_bytes = roofline.decode_step_bytes(config, 543)
answer = max(flops / 200e9, n_bytes / 50e9)
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
