"""Exercises of notebook 05 (MLP, residual stream): the hidden layer's shape, one block by
hand, and GeLU's values far from zero."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

import kvlib

from .base import Feedback, check_array, show_solution

GPT2_PROMPT_TOKENS = 10
"""Exercise 1 asks for GPT-2 small's MLP hidden shape on a prompt of this many tokens."""
GELU_POINTS = (0.0, 10.0, -10.0)
"""Exercise 3 asks for GeLU at these inputs."""
GELU_TOLERANCE = 0.01

SOLUTIONS = {
    1: """
config = kvlib.GPT2_SMALL
answer = (10, config.d_ff)   # one row per token, d_ff = 4 x 768 = 3072 hidden units
""",
    2: """
layer = params.layers[1]                        # block 2 has its own weights
Q, K, V = (kvlib.split_heads(M, 2) for M in kvlib.project_qkv(X1, layer))
heads = kvlib.attention(Q, K, V, kvlib.causal_mask(5))
H = X1 + kvlib.output_projection(kvlib.merge_heads(heads), layer.Wo)   # attention adds
answer = H + kvlib.mlp(H, layer)                                       # then the MLP adds
""",
    3: """
# gelu(x) = x * (a number between 0 and 1 that grows with x):
# at 0 it is 0; at 10 the factor is about 1; at -10 it is about 0.
answer = (0.0, 10.0, 0.0)
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor)."""
    return show_solution(SOLUTIONS, number)


def check_hidden_shape(answer) -> Feedback:
    """Exercise 1: the shape of gelu(X @ W_up) in GPT-2 small for a 10-token prompt."""
    config = kvlib.GPT2_SMALL
    T, d, f = GPT2_PROMPT_TOKENS, config.d_model, config.d_ff
    expected = (T, f)
    if answer is None or answer is ...:
        return Feedback(False, "The shape is not filled in yet: replace the ... with a tuple "
                        "like (rows, columns).")
    try:
        shape = tuple(int(n) for n in answer)
    except (TypeError, ValueError):
        return Feedback(False, f"give the shape as a tuple of two whole numbers, got {answer!r}.")
    messages = {
        (T, d): f"({T}, {d}) is the MLP's input and output shape. The hidden layer in between "
                f"is wider: d_ff = {f} columns (4 x {d}).",
        (d, f): f"({d}, {f}) is W_up's shape, the same for any prompt. The activations have "
                "one row per token.",
        (f, T): "rows are tokens and columns are hidden units: (tokens, d_ff).",
        (1, f): f"the MLP runs on all {T} prompt tokens at once, one row each.",
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
def _article_streams():
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    X0 = kvlib.embed(np.array(ids), params.embedding)
    mask = kvlib.causal_mask(len(ids))
    X1 = kvlib.decoder_block(X0, params.layers[0], params.config.n_heads, mask=mask)
    return params, X1, mask


def _attention_update(X, layer, n_heads, mask):
    Q, K, V = (kvlib.split_heads(M, n_heads) for M in kvlib.project_qkv(X, layer))
    return kvlib.output_projection(kvlib.merge_heads(kvlib.attention(Q, K, V, mask)), layer.Wo)


def check_second_block(answer) -> Feedback:
    """Exercise 2: X2, the stream after the second block, from X1 (5, 4), built step by step."""
    params, X1, mask = _article_streams()
    layer, n_heads = params.layers[1], params.config.n_heads
    expected = kvlib.decoder_block(X1, layer, n_heads, mask=mask)
    if isinstance(answer, np.ndarray) and answer.shape == expected.shape:
        attention = _attention_update(X1, layer, n_heads, mask)
        H = X1 + attention
        wrong = [
            (attention + kvlib.mlp(attention, layer),
             "the block's result replaced the stream: add it to X1 instead (X1 + ...)."),
            (H, "this stops after attention: the MLP's output must be added too."),
            (X1 + attention + kvlib.mlp(X1, layer),
             "the MLP reads the stream after attention has been added (H = X1 + attention), "
             "not X1."),
            (kvlib.decoder_block(X1, params.layers[0], n_heads, mask=mask),
             "these are the first block's weights; the second block is params.layers[1]."),
            (kvlib.decoder_block(X1, layer, n_heads, mask=None),
             "the attention ran without the causal mask: pass kvlib.causal_mask(5)."),
        ]
        for candidate, message in wrong:
            if np.allclose(answer, candidate):
                return Feedback(False, message)
    return check_array(answer, expected, "X2", "Attention adds to X1 giving H; then the MLP "
                       "of H adds to H.")


def check_gelu_values(answer) -> Feedback:
    """Exercise 3: gelu(0), gelu(10), gelu(-10), predicted to within 0.01."""
    if answer is None or answer is ...:
        return Feedback(False, "The three values are not filled in yet: replace the ... with "
                        "(gelu(0), gelu(10), gelu(-10)).")
    try:
        values = [float(v) for v in answer]
    except (TypeError, ValueError):
        return Feedback(False, f"give three numbers, (gelu(0), gelu(10), gelu(-10)); got "
                        f"{answer!r}.")
    if len(values) != len(GELU_POINTS):
        return Feedback(False, f"give three numbers, one per input {GELU_POINTS}; got "
                        f"{len(values)}.")
    hints = {
        0.0: "gelu(0) = 0 * (something) = 0: GeLU passes through the origin like ReLU.",
        10.0: "for a large positive x GeLU lets almost everything through: gelu(10) is about 10.",
        -10.0: "for a large negative x GeLU lets almost nothing through (like ReLU): "
               "gelu(-10) is about 0, not -10 and not -0.17 (the dip is near x = -0.75).",
    }
    for x, value in zip(GELU_POINTS, values):
        if not math.isfinite(value) or abs(value - float(kvlib.gelu(np.array(x)))) > GELU_TOLERANCE:
            return Feedback(False, hints[x])
    return Feedback(True, "0, about 10 and about 0: far from zero GeLU behaves like ReLU; only "
                    "near zero is it smooth, with a small dip below zero.")
