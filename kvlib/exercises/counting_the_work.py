"""Exercises of the counting_the_work lesson (counting the work): checkers and solutions.

1. The multiply-adds of one full recomputation of GPT-2 medium, part by part (a transfer
   task: another size than the notebook's GPT-2 small, with 24 layers and 16 heads).
2. The FLOP ratio of generating without and with the cache, after a longer prompt
   (predicted before it is computed).
3. The cache length at which a decode step's attention costs as much as the rest of the
   layer, for GPT-2 XL (another size again).
"""

from __future__ import annotations

from numbers import Real

import numpy as np

import kvlib

from .base import (
    Feedback,
    agrees_at_its_precision,
    checker,
    is_missing,
    near_miss,
    read_number,
    read_whole_number,
    show_solution,
)

PARTS = ("projections", "attention_scores", "attention_sums", "mlp", "unembedding")

GPT2_MEDIUM = kvlib.ModelConfig(vocab_size=50257, d_model=1024, n_heads=16, n_layers=24,
                                d_ff=4096, context_length=1024, dtype="float32")
GPT2_XL = kvlib.ModelConfig(vocab_size=50257, d_model=1600, n_heads=25, n_layers=48,
                            d_ff=6400, context_length=1024, dtype="float32")
"""GPT-2 medium's and XL's shapes (Radford et al. 2019, table 2; their config.json)."""

# Exercise 1: a full forward of GPT-2 medium over this many tokens, last row unembedded
EXERCISE1_CONFIG, EXERCISE1_TOKENS = GPT2_MEDIUM, 100
# Exercise 2: GPT-2 small, this prompt and this many new tokens
EXERCISE2_PROMPT, EXERCISE2_NEW = 128, 256
# Exercise 3: GPT-2 XL's decode step
EXERCISE3_CONFIG = GPT2_XL


@checker
def check_forward_macs(answer) -> Feedback:
    """Exercise 1: a dict {part: multiply-adds} of GPT-2 medium's full forward over 100
    tokens, no cache, unembedding only the last row."""
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
    extra = sorted(str(key) for key in set(answer) - set(PARTS))
    if extra:
        return Feedback(False, f"unexpected entries {extra}: keep only {', '.join(PARTS)}.")
    config, T = EXERCISE1_CONFIG, EXERCISE1_TOKENS
    L, d, f, V, h = (config.n_layers, config.d_model, config.d_ff, config.vocab_size,
                     config.n_heads)
    expected = kvlib.forward_multiply_adds(config, T, last_only=True).as_dict()
    one_row = kvlib.decode_step_multiply_adds(config, T - 1).as_dict()
    small = kvlib.forward_multiply_adds(kvlib.GPT2_SMALL, T, last_only=True).as_dict()
    if all(_is(answer[part], small[part]) for part in PARTS):
        return Feedback(False, "those are GPT-2 small's counts (12 layers, d 768), the "
                        "notebook's model. The exercise is about GPT-2 medium: 24 layers, "
                        "d_model 1024, d_ff 4096.")
    for part in PARTS:
        value = answer[part]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
            return Feedback(False, f"{part} should be a number, got {type(value).__name__}.")
        if _is(value, expected[part]):
            continue
        if part != "unembedding" and _is(value * L, expected[part]):
            return Feedback(False, f"{part}: that is one layer's work; every one of the {L} "
                            "layers does it.")
        if part in ("attention_scores", "attention_sums") and _is(value * h, expected[part]):
            return Feedback(False, f"{part}: that is one head's work (head size "
                            f"{config.head_dim}); the {h} heads together span all d = {d} "
                            "columns, so count T x S x d per layer.")
        if part == "unembedding" and _is(value, T * d * V):
            return Feedback(False, f"unembedding: that turns all {T} rows into logits; the "
                            "baseline unembeds only the last row, all the next token needs.")
        if _is(value, one_row[part]):
            return Feedback(False, f"{part}: that is for one row. Without the cache, all "
                            f"{T} rows go through every layer again.")
        if part in ("attention_scores", "attention_sums") and _is(value * 2, expected[part]):
            return Feedback(False, f"{part}: kvlib computes the whole T x T score matrix, the "
                            "masked half too (it is set to -inf afterwards), so count T x T.")
        if _is(value, 2 * expected[part]):
            return Feedback(False, f"{part}: twice the count: those are FLOPs (2 per "
                            "multiply-add); the exercise counts multiply-adds.")
        if part == "projections" and _is(value, L * 3 * T * d * d):
            return Feedback(False, "projections: Q, K and V, and also the output projection "
                            "Wo: four (d, d) matrices.")
        if part == "mlp" and _is(value, L * T * d * f):
            return Feedback(False, "mlp: count both matrices, up (d, f) and down (f, d).")
        return Feedback(False, f"{part} is not right. T = S = {T}: every row is a query and "
                        "a key; see the formulas at the top of the notebook (kvlib.flops).")
    total = sum(expected.values())
    return Feedback(True, f"{total:,} multiply-adds: about {total / sum(one_row.values()):.0f} "
                    "times a decode step at the same position.")


def _is(value, expected) -> bool:
    """Equal as counts: exactly, or as a float that holds the same whole number (counts
    below 2**53 are exact in a float)."""
    try:
        return bool(value == expected) or float(value) == float(expected)
    except (OverflowError, TypeError, ValueError):
        return False


@checker
def check_flop_ratio(answer) -> Feedback:
    """Exercise 2: FLOPs without the cache / with it, GPT-2 small, prompt 128, 256 new tokens.

    Accepted at the precision the student gives, from 3 significant digits (134 or 134.3)."""
    value = read_number(answer, "a number (a ratio)")
    if isinstance(value, Feedback):
        return value
    config, P, N = kvlib.GPT2_SMALL, EXERCISE2_PROMPT, EXERCISE2_NEW
    without = kvlib.generation_multiply_adds(config, P, N, use_cache=False).total
    with_cache = kvlib.generation_multiply_adds(config, P, N, use_cache=True).total
    expected = without / with_cache
    if agrees_at_its_precision(value, expected):
        short = (kvlib.generation_multiply_adds(config, 32, N, use_cache=False).total
                 / kvlib.generation_multiply_adds(config, 32, N, use_cache=True).total)
        return Feedback(True, f"about {expected:.1f} times fewer FLOPs with the cache, against "
                        f"{short:.1f} after a 32-token prompt: without the cache, every pass "
                        "recomputes the whole prompt too.")
    if value > 0 and agrees_at_its_precision(value, 1 / expected):
        return Feedback(False, "that is with / without; the question asks how many times more "
                        "work recomputation does: without / with.")
    short = (kvlib.generation_multiply_adds(config, 32, N, use_cache=False).total
             / kvlib.generation_multiply_adds(config, 32, N, use_cache=True).total)
    if agrees_at_its_precision(value, short):
        return Feedback(False, "that is the ratio after a 32-token prompt, the notebook's. "
                        f"Here the prompt has {P} tokens.")
    return near_miss(value, expected,
                     "Give it to at least 3 significant digits, from "
                     "kvlib.generation_multiply_adds with use_cache=False and True.",
                     f"Divide kvlib.generation_multiply_adds(config, {P}, {N}, "
                     "use_cache=False).total by the same with use_cache=True.")


@checker
def check_attention_crossover(answer) -> Feedback:
    """Exercise 3: the number of positions S a GPT-2 XL decode step attends over at which
    its attention (scores and sums) costs as many multiply-adds as its projections and MLP."""
    value = read_whole_number(answer, "a number of positions")
    if isinstance(value, Feedback):
        return value
    config = EXERCISE3_CONFIG
    d, f = config.d_model, config.d_ff
    expected = 2 * d + f                                  # 2 S d = 4 d^2 + 2 d f
    mistakes = {
        4 * d + 2 * f: "that counts the scores only (S d per layer); the weighted sum of the "
                       "values costs as much again, so attention is 2 S d.",
        2 * d: "that leaves out the MLP: the rest of the layer is the projections (4 d^2) "
               "and the MLP (2 d f).",
        f: "that leaves out the projections (4 d^2): the rest of the layer is projections "
           "and MLP.",
        expected * config.n_heads: "that divides d among the heads: all heads together "
                                   "attend with d columns, 2 S d per layer.",
        2 * 768 + 3072: "that is GPT-2 small's (d 768); the exercise is about GPT-2 XL, "
                        "d_model 1600, d_ff 6400.",
        (2 * d + f) // 2: "half of it: attention is 2 S d (scores and sums), the rest 4 d^2 "
                          "+ 2 d f; solve 2 S d = 4 d^2 + 2 d f.",
    }
    if value == expected:
        return Feedback(True, f"S = 2 d + f = {expected:,}: 6 x d_model, since f = 4 d. "
                        f"Beyond about {expected:,} cached positions, attention is most of a "
                        "decode step's arithmetic (and the cache most of what it reads).")
    if value in mistakes:
        return Feedback(False, mistakes[value])
    with_unembedding = (4 * d * d + 2 * d * f) * config.n_layers + d * config.vocab_size
    if abs(value - with_unembedding / (2 * d * config.n_layers)) <= 1:
        return Feedback(False, "that also counts the unembedding; the question compares "
                        "attention with the projections and MLP of the layers only.")
    return near_miss(value, expected, "Per layer, solve 2 S d = 4 d^2 + 2 d f exactly.",
                     "Per layer, a decode step's attention costs 2 S d multiply-adds, its "
                     "projections 4 d^2 and its MLP 2 d f: solve for S.")


SOLUTIONS = {
    1: """
config = exercises.GPT2_MEDIUM
L, d, f, V = config.n_layers, config.d_model, config.d_ff, config.vocab_size
T = 100  # every row is a query, and every row is a key: T = S
answer = {
    "projections": L * 4 * T * d * d,   # Wq, Wk, Wv, Wo on all T rows
    "attention_scores": L * T * T * d,  # all heads: T x dh times dh x T, h dh = d
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
d, f = 1600, 6400                  # GPT-2 XL
# per layer: attention 2 S d (scores and sums) = projections 4 d^2 + MLP 2 d f
answer = (4 * d * d + 2 * d * f) // (2 * d)   # 2 d + f = 9600
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
