"""Exercises of notebook 04 (multi-head attention): a head's columns, a three-way split, and
putting the heads back together through the output projection."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import Feedback, check_array, show_solution

SOLUTIONS = {
    1: """
head_dim = Q.shape[1] // 2
answer = Q[:, 1 * head_dim:2 * head_dim]   # head 1 owns columns 2 and 3
""",
    2: """
split = M.reshape(5, 3, 2)             # (tokens, heads, head_dim)
answer = split.transpose(1, 0, 2)      # (heads, tokens, head_dim)
""",
    3: """
concatenated = heads.transpose(1, 0, 2).reshape(5, 4)   # or np.hstack(list(heads))
answer = concatenated @ params.layers[0].Wo
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor)."""
    return show_solution(SOLUTIONS, number)


@lru_cache(maxsize=1)
def _layer0():
    """The article's first block: Q (5, 4) and the masked head outputs (2, 5, 2)."""
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    X = kvlib.embed(np.array(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    n_heads = params.config.n_heads
    heads = kvlib.attention(*(kvlib.split_heads(M, n_heads) for M in (Q, K, V)),
                            mask=kvlib.causal_mask(len(ids)))
    return params, Q, heads


def _same(answer, candidate) -> bool:
    return (isinstance(answer, np.ndarray) and answer.shape == candidate.shape
            and np.allclose(answer, candidate))


def check_head_slice(answer) -> Feedback:
    """Exercise 1: head 1's slice of the first block's Q, (5, 2), taken by hand."""
    _, Q, _ = _layer0()
    expected = Q[:, 2:4]
    if isinstance(answer, np.ndarray):
        if answer.shape == (2, 4) and np.allclose(answer, Q[2:4]):
            return Feedback(False, "you took rows 2 and 3, which are tokens. Heads split the "
                            "columns (the features): Q[:, columns].")
        if _same(answer, Q[:, 0:2]):
            return Feedback(False, "this is head 0's slice. Head h starts at column "
                            "h * head_dim = 1 * 2 = 2.")
        if _same(answer, Q[:, 1:3]):
            return Feedback(False, "head h starts at column h * head_dim, not at column h: "
                            "head 1 owns columns 2 and 3.")
        if _same(answer, Q.reshape(2, 5, 2)[1]):
            return Feedback(False, "this is Q.reshape(2, 5, 2)[1]: reshaping straight to "
                            "(heads, tokens, head_dim) mixes tokens. Slice the columns instead.")
        if _same(answer, Q[:, 1::2]):
            return Feedback(False, "a head's columns are next to each other (2 and 3), not every "
                            "other column.")
    return check_array(answer, expected, "Head 1's slice",
                       "Head 1 is columns 2:4 of Q, all rows.")


def check_three_heads(answer) -> Feedback:
    """Exercise 2: M = np.arange(30).reshape(5, 6) split into 3 heads: (3, 5, 2)."""
    M = np.arange(30).reshape(5, 6)
    expected = kvlib.split_heads(M, 3)
    if isinstance(answer, np.ndarray):
        if _same(answer, M.reshape(3, 5, 2)):
            return Feedback(False, "the shape is right but this is M.reshape(3, 5, 2): it "
                            "fills head 0 with the first 10 numbers, which belong to tokens 0-1 "
                            "and part of 2. Reshape to (5, 3, 2) first, then transpose(1, 0, 2).")
        if _same(answer, M.reshape(5, 3, 2)):
            return Feedback(False, "the split is right but the head axis is second: (tokens, "
                            "heads, head_dim). Move it to the front with transpose(1, 0, 2).")
        if answer.shape == (2, 5, 3):
            return Feedback(False, "this is 2 heads of 3 columns; the exercise asks for 3 heads, "
                            "so head_dim = 6 / 3 = 2.")
    return check_array(answer, expected, "The split into three heads",
                       "Head h should be M[:, 2h:2h+2]: reshape (5, 3, 2), then transpose.")


def check_attention_output(answer) -> Feedback:
    """Exercise 3: the first block's attention output (5, 4) from heads (2, 5, 2) and Wo."""
    params, _, heads = _layer0()
    Wo = params.layers[0].Wo
    concatenated = kvlib.merge_heads(heads)
    expected = concatenated @ Wo
    if isinstance(answer, np.ndarray):
        if _same(answer, concatenated):
            return Feedback(False, "this is the concatenation of the heads: the output "
                            "projection is still missing (multiply by Wo).")
        if _same(answer, heads.reshape(5, 4) @ Wo) or _same(answer, heads.reshape(5, 4)):
            return Feedback(False, "heads.reshape(5, 4) puts the wrong numbers in each row: "
                            "transpose back to (tokens, heads, head_dim) first, then reshape.")
        if answer.shape == (5, 2):
            return Feedback(False, "the heads are placed side by side (concatenated) into "
                            "(5, 4), not added into (5, 2).")
        if _same(answer, Wo @ concatenated.T) or _same(answer, (concatenated @ Wo).T):
            return Feedback(False, "the rows must stay tokens: (5, 4) @ Wo (4, 4).")
    return check_array(answer, expected, "The attention output",
                       "Concatenate the heads into (5, 4), then multiply by Wo (4, 4).")
