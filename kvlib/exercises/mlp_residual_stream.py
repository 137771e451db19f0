"""Exercises of the mlp_residual_stream lesson (MLP, residual stream): the hidden layer's shape in
GPT-2 small, the second block by hand on a prompt the notebook does not use, and GeLU at points it
does not print."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import (
    Feedback,
    check_array,
    checker,
    is_missing,
    read_array,
    read_whole_numbers,
    same_array,
    show_solution,
)

GPT2_PROMPT_TOKENS = 10
"""Exercise 1 asks for GPT-2 small's MLP hidden shape on a prompt of this many tokens."""
EXERCISE_2_PROMPT = "I am fine and you?"
"""Exercise 2 starts from X1 for this prompt, (7, 4)."""
GELU_POINTS = (6.0, -6.0, -0.3)
"""Exercise 3 asks for GeLU at these inputs, none of which the notebook prints."""
PHI_OF_MINUS_0_3 = 0.382
"""The hint exercise 3 gives: Phi(-0.3), the standard normal's probability below -0.3."""
GELU_TOLERANCE = 0.01

SOLUTIONS = {
    1: """
config = kvlib.GPT2_SMALL
answer = (10, config.d_ff)   # one row per token, d_ff = 4 x 768 = 3072 hidden units
""",
    2: """
X1_other = exercises.practice_stream()            # (7, 4): X1 for "I am fine and you?"
layer = params.layers[1]                         # block 2 has its own weights
Q, K, V = (kvlib.split_heads(M, 2) for M in kvlib.project_qkv(X1_other, layer))
heads = kvlib.attention(Q, K, V, kvlib.causal_mask(7))
H = X1_other + kvlib.output_projection(kvlib.merge_heads(heads), layer.Wo)   # attention adds
answer = H + kvlib.mlp(H, layer)                                             # then the MLP adds
""",
    3: """
# gelu(x) = x * Phi(x), and Phi rises from 0 to 1:
# Phi(6) is about 1, so gelu(6) is about 6; Phi(-6) is about 0, so gelu(-6) is about 0;
# gelu(-0.3) = -0.3 * Phi(-0.3) = -0.3 * 0.382, about -0.115: a small negative output.
answer = (6.0, 0.0, -0.3 * 0.382)
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor)."""
    return show_solution(SOLUTIONS, number)


@checker
def check_hidden_shape(answer) -> Feedback:
    """Exercise 1: the shape of gelu(X @ W_up) in GPT-2 small for a 10-token prompt."""
    config = kvlib.GPT2_SMALL
    T, d, f = GPT2_PROMPT_TOKENS, config.d_model, config.d_ff
    expected = (T, f)
    if is_missing(answer):
        return Feedback(False, "The shape is not filled in yet: replace the ... with a tuple "
                        "like (rows, columns).")
    shape = read_whole_numbers(answer, 2, "the shape", expected)
    if isinstance(shape, Feedback):
        return shape
    messages = {
        (T, d): f"({T}, {d}) is the MLP's input and output shape. The hidden layer in between "
                f"is wider: d_ff = {f} columns (4 x {d}).",
        (d, f): f"({d}, {f}) is W_up's shape, the same for any prompt. The activations have "
                "one row per token.",
        (f, T): "rows are tokens and columns are hidden units: (tokens, d_ff).",
        (1, f): f"the MLP runs on all {T} prompt tokens at once, one row each.",
        (T, 2 * d): f"2 x d_model is the toy model's ratio (4 -> 8); GPT-2 small widens 4 "
                    f"times: d_ff = {f}.",
        (5, 8): "(5, 8) is the toy model's hidden shape; use GPT-2 small's sizes "
                "(kvlib.GPT2_SMALL).",
    }
    if shape in messages:
        return Feedback(False, messages[shape])
    if shape != expected:
        return Feedback(False, f"not {shape}: think (tokens, d_ff) with d_ff from "
                        "kvlib.GPT2_SMALL.")
    return Feedback(True, f"({T}, {f}): each of the {T} tokens gets {f} hidden units; W_down "
                    f"then maps them back to {d}.")


@lru_cache(maxsize=1)
def _exercise_stream():
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(EXERCISE_2_PROMPT)
    X0 = kvlib.embed(np.array(ids), params.embedding)
    mask = kvlib.causal_mask(len(ids))
    X1 = kvlib.decoder_block(X0, params.layers[0], params.config.n_heads, mask=mask)
    return params, X1, mask


def practice_stream() -> np.ndarray:
    """Exercise 2's start: X1, the stream after the first block, for EXERCISE_2_PROMPT (7, 4).
    A fresh copy each call."""
    return _exercise_stream()[1].copy()


def _attention_update(X, layer, n_heads, mask):
    Q, K, V = (kvlib.split_heads(M, n_heads) for M in kvlib.project_qkv(X, layer))
    return kvlib.output_projection(kvlib.merge_heads(kvlib.attention(Q, K, V, mask)), layer.Wo)


@checker
def check_second_block(answer) -> Feedback:
    """Exercise 2: X2 for EXERCISE_2_PROMPT from practice_stream() (7, 4), step by step."""
    params, X1, mask = _exercise_stream()
    layer, n_heads = params.layers[1], params.config.n_heads
    expected = kvlib.decoder_block(X1, layer, n_heads, mask=mask)
    array = read_array(answer, "X2", expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    article = len(kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT))
    if array.shape == (article, expected.shape[1]):
        return Feedback(False, f"({article}, {expected.shape[1]}) is the notebook's prompt; "
                        "start from X1_other = exercises.practice_stream(), "
                        f"{expected.shape}.")
    if array.shape == expected.shape:
        attention = _attention_update(X1, layer, n_heads, mask)
        H = X1 + attention
        wrong = [
            (attention + kvlib.mlp(attention, layer),
             "the block's result replaced the stream: add it to X1 instead (X1 + ...)."),
            (kvlib.mlp(attention, layer),
             "both additions are missing: the block's two results are added to the stream, "
             "H = X1 + attention, then X2 = H + MLP(H)."),
            (H, "this stops after attention: the MLP's output must be added too."),
            (X1 + attention + kvlib.mlp(X1, layer),
             "the MLP reads the stream after attention has been added (H = X1 + attention), "
             "not X1."),
            (kvlib.decoder_block(X1, params.layers[0], n_heads, mask=mask),
             "these are the first block's weights; the second block is params.layers[1]."),
            (kvlib.decoder_block(X1, layer, n_heads, mask=None),
             f"the attention ran without the causal mask: pass kvlib.causal_mask("
             f"{expected.shape[0]})."),
            (X1, "this is X1 itself, the start: the block's two additions are still missing."),
        ]
        for candidate, message in wrong:
            if same_array(array, candidate):
                return Feedback(False, message)
    return check_array(answer, expected, "X2", "Attention adds to X1 giving H; then the MLP "
                       "of H adds to H.")


def _gelu(x: float) -> float:
    return float(kvlib.gelu(np.array(x)))


@checker
def check_gelu_values(answer) -> Feedback:
    """Exercise 3: gelu(6), gelu(-6), gelu(-0.3), predicted to within 0.01."""
    if is_missing(answer):
        return Feedback(False, "The three values are not filled in yet: replace the ... with "
                        "(gelu(6), gelu(-6), gelu(-0.3)).")
    values = read_array(answer, "answer", (3,), booleans=True)
    if isinstance(values, Feedback):
        return Feedback(False, f"give three numbers, (gelu(6), gelu(-6), gelu(-0.3)); "
                        f"{values.message}")
    if values.shape != (len(GELU_POINTS),):
        return Feedback(False, f"give three numbers, one per input {GELU_POINTS}; got an "
                        f"answer of shape {values.shape}.")
    values = [float(v) for v in values]
    (big, big_value), (negative, negative_value), (small, small_value) = zip(GELU_POINTS,
                                                                            values)
    near = {x: abs(value - _gelu(x)) <= GELU_TOLERANCE for x, value in zip(GELU_POINTS, values)}
    if not near[big]:
        if abs(big_value - big / 2) <= GELU_TOLERANCE:
            return Feedback(False, f"gelu({big:g}) = {big:g} x Phi({big:g}), and Phi({big:g}) "
                            "is about 1, not 0.5 (Phi(0) = 0.5): gelu(6) is about 6.")
        return Feedback(False, f"far to the right Phi(x) is about 1, so GeLU lets almost "
                        f"everything through: gelu({big:g}) is about {big:g}.")
    if not near[negative]:
        if abs(negative_value - negative) <= GELU_TOLERANCE:
            return Feedback(False, f"not {negative:g}: far to the left Phi(x) is about 0, so "
                            f"gelu({negative:g}) is about 0, like ReLU.")
        return Feedback(False, f"far to the left Phi(x) is about 0: gelu({negative:g}) is "
                        "about 0.")
    if near[small]:
        return Feedback(True, f"about {big:g}, about 0, and {_gelu(small):.3f}: far from zero "
                        "GeLU behaves like ReLU; near zero it is x times a factor between 0 "
                        "and 1, so a small negative input gives a small negative output.")
    product = small * PHI_OF_MINUS_0_3
    hints = (
        (0.0, "ReLU would give 0 here, but GeLU multiplies x by Phi(x): "
              f"-0.3 x {PHI_OF_MINUS_0_3} is a small NEGATIVE number."),
        (small, f"that is x itself; GeLU multiplies it by Phi({small:g}) = {PHI_OF_MINUS_0_3}."),
        (-product, "the sign is wrong: x is negative and Phi(x) is positive, so x Phi(x) is "
                   "negative."),
        (small * (1 - PHI_OF_MINUS_0_3), f"Phi({small:g}) = {PHI_OF_MINUS_0_3} is already the "
                                         "factor: multiply x by it, not by 1 - Phi."),
        (-0.17, "-0.17 is the depth of the dip, at x = -0.75; at x = -0.3 GeLU is closer to 0."),
    )
    for wrong, message in hints:
        if abs(small_value - wrong) <= GELU_TOLERANCE / 2:
            return Feedback(False, message)
    return Feedback(False, f"gelu({small:g}) = {small:g} x Phi({small:g}), with "
                    f"Phi({small:g}) = {PHI_OF_MINUS_0_3}; got {small_value:.3g}.")
