"""Exercises of the multi_head_attention lesson (multi-head attention), in sizes and on a prompt the
notebook does not use: one head's columns of a wider Q, a three-way split, and from the heads of
another prompt back to the attention output."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import Feedback, check_array, checker, read_array, same_array, show_solution

WIDE_D_MODEL = 12
WIDE_HEADS = 3
WIDE_HEAD = 2
"""Exercise 1: head 2 of a model with d_model = 12 and 3 heads (head_dim 4)."""
EXERCISE_3_PROMPT = "I am fine and you?"
"""Exercise 3 starts from the first block's head outputs for this prompt, (2, 7, 2)."""

SOLUTIONS = {
    1: """
Q12 = exercises.practice_queries()          # (5, 12): 3 heads of 12 / 3 = 4 columns
head_dim = Q12.shape[1] // 3
answer = Q12[:, 2 * head_dim:3 * head_dim]  # head 2 owns columns 8 to 11
""",
    2: """
split = M.reshape(5, 3, 2)             # (tokens, heads, head_dim)
answer = split.transpose(1, 0, 2)      # (heads, tokens, head_dim)
""",
    3: """
heads7 = exercises.practice_heads()                         # (2, 7, 2)
concatenated = heads7.transpose(1, 0, 2).reshape(7, 4)     # or np.hstack(list(heads7))
answer = concatenated @ params.layers[0].Wo                # (7, 4) @ (4, 4)
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor)."""
    return show_solution(SOLUTIONS, number)


@lru_cache(maxsize=1)
def _wide_queries() -> np.ndarray:
    config = kvlib.ModelConfig(d_model=WIDE_D_MODEL, n_heads=WIDE_HEADS, d_ff=2 * WIDE_D_MODEL)
    params = kvlib.init_params(config)
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    X = kvlib.embed(np.array(ids), params.embedding)
    return X @ params.layers[0].Wq


def practice_queries() -> np.ndarray:
    """Exercise 1's Q: the first block's queries for "How are you?" in a seeded model with
    d_model = 12 and 3 heads, (5, 12). A fresh copy each call."""
    return _wide_queries().copy()


@lru_cache(maxsize=None)
def _layer0_heads(prompt: str):
    """The first block's masked head outputs (2, T, 2) for a prompt, and the params."""
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(prompt)
    X = kvlib.embed(np.array(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    n_heads = params.config.n_heads
    heads = kvlib.attention(*(kvlib.split_heads(M, n_heads) for M in (Q, K, V)),
                            mask=kvlib.causal_mask(len(ids)))
    return params, heads


def practice_heads() -> np.ndarray:
    """Exercise 3's head outputs: the first block's, for EXERCISE_3_PROMPT, (2, 7, 2)."""
    return _layer0_heads(EXERCISE_3_PROMPT)[1].copy()


@checker
def check_head_slice(answer) -> Feedback:
    """Exercise 1: head 2's columns of practice_queries(), (5, 4), taken by slicing."""
    Q = _wide_queries()
    dh = WIDE_D_MODEL // WIDE_HEADS
    h = WIDE_HEAD
    expected = Q[:, h * dh:(h + 1) * dh]
    name = f"Head {h}'s slice"
    array = read_array(answer, name, expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    if array.shape[1:] == (WIDE_D_MODEL,) and array.shape[0] < Q.shape[0]:
        return Feedback(False, f"you took rows, which are tokens (Q has only {Q.shape[0]}). "
                        "Heads split the columns (the features): Q12[:, columns], all rows.")
    for other in range(WIDE_HEADS):
        if other != h and same_array(array, Q[:, other * dh:(other + 1) * dh]):
            return Feedback(False, f"this is head {other}'s slice. Head h starts at column "
                            f"h * head_dim = {h} * {dh} = {h * dh}.")
    if same_array(array, Q[:, h:h + dh]):
        return Feedback(False, f"head h starts at column h * head_dim, not at column h: head "
                        f"{h} owns columns {h * dh} to {(h + 1) * dh - 1}.")
    if same_array(array, Q.reshape(WIDE_HEADS, Q.shape[0], dh)[h]):
        return Feedback(False, f"this is Q12.reshape({WIDE_HEADS}, {Q.shape[0]}, {dh})[{h}]: "
                        "reshaping straight to (heads, tokens, head_dim) mixes tokens. Slice "
                        "the columns instead.")
    if same_array(array, Q[:, h::WIDE_HEADS]):
        return Feedback(False, "a head's columns are next to each other, not every "
                        f"{WIDE_HEADS}rd column.")
    if array.shape == (Q.shape[0], WIDE_D_MODEL // 2):
        return Feedback(False, f"{WIDE_D_MODEL // 2} columns would be 2 heads; with "
                        f"{WIDE_HEADS} heads, head_dim = {WIDE_D_MODEL} / {WIDE_HEADS} = {dh}.")
    if array.shape == (Q.shape[0], 2):
        return Feedback(False, f"head_dim is 2 in the notebook's model; here d_model = "
                        f"{WIDE_D_MODEL} and {WIDE_HEADS} heads, so head_dim = {dh}.")
    return check_array(answer, expected, name,
                       f"Head {h} is columns {h * dh}:{(h + 1) * dh} of Q12, all rows.")


@checker
def check_three_heads(answer) -> Feedback:
    """Exercise 2: M = np.arange(30).reshape(5, 6) split into 3 heads: (3, 5, 2)."""
    M = np.arange(30).reshape(5, 6)
    expected = kvlib.split_heads(M, 3)
    name = "The split into three heads"
    array = read_array(answer, name, expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    if same_array(array, M.reshape(3, 5, 2)):
        return Feedback(False, "the shape is right but this is M.reshape(3, 5, 2): it fills "
                        "head 0 with the first 10 numbers, which belong to tokens 0-1 and part "
                        "of 2. Reshape to (5, 3, 2) first, then transpose(1, 0, 2).")
    if same_array(array, M.reshape(5, 3, 2)):
        return Feedback(False, "the split is right but the head axis is second: (tokens, "
                        "heads, head_dim). Move it to the front with transpose(1, 0, 2).")
    if same_array(array, M.reshape(5, 3, 2).transpose(1, 2, 0)) or \
            same_array(array, M.reshape(5, 3, 2).transpose(2, 1, 0)):
        return Feedback(False, "the heads are split right but the other two axes are in the "
                        "wrong order: each head is (tokens, head_dim) = (5, 2), so "
                        "transpose(1, 0, 2).")
    if array.shape == (2, 5, 3):
        return Feedback(False, "this is 2 heads of 3 columns; the exercise asks for 3 heads, "
                        "so head_dim = 6 / 3 = 2.")
    return check_array(answer, expected, name,
                       "Head h should be M[:, 2h:2h+2]: reshape (5, 3, 2), then transpose.")


@checker
def check_attention_output(answer) -> Feedback:
    """Exercise 3: the first block's attention output (7, 4) for EXERCISE_3_PROMPT, from its
    heads practice_heads() (2, 7, 2) and Wo."""
    params, heads = _layer0_heads(EXERCISE_3_PROMPT)
    Wo = params.layers[0].Wo
    n_heads, T, dh = heads.shape
    concatenated = kvlib.merge_heads(heads)
    expected = concatenated @ Wo
    name = "The attention output"
    array = read_array(answer, name, expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    article = len(kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT))
    if array.shape == (article, n_heads * dh):
        return Feedback(False, f"({article}, {n_heads * dh}) is the notebook's prompt; the "
                        f"exercise starts from practice_heads(), {heads.shape}, whose output "
                        f"is ({T}, {n_heads * dh}).")
    wrong = (
        (concatenated, "this is the concatenation of the heads: the output projection is "
         "still missing (multiply by Wo)."),
        (heads.reshape(T, n_heads * dh) @ Wo, f"heads.reshape({T}, {n_heads * dh}) puts the "
         "wrong numbers in each row: transpose back to (tokens, heads, head_dim) first, then "
         "reshape."),
        (heads.reshape(T, n_heads * dh), f"heads.reshape({T}, {n_heads * dh}) puts the wrong "
         "numbers in each row, and Wo is still missing."),
        (concatenated @ Wo.T, "Wo is transposed: the concatenation (tokens, d_model) is "
         "multiplied by Wo as it is, concatenated @ Wo."),
    )
    for candidate, message in wrong:
        if same_array(array, candidate):
            return Feedback(False, message)
    if array.shape == (n_heads * dh, T):
        return Feedback(False, f"the rows must stay tokens: ({T}, {n_heads * dh}) @ Wo "
                        f"({n_heads * dh}, {n_heads * dh}) gives ({T}, {n_heads * dh}).")
    if array.shape == (T, dh):
        return Feedback(False, f"the heads are placed side by side (concatenated) into "
                        f"({T}, {n_heads * dh}), not added into ({T}, {dh}).")
    return check_array(answer, expected, name,
                       f"Concatenate the heads into ({T}, {n_heads * dh}), then multiply by "
                       f"Wo ({n_heads * dh}, {n_heads * dh}).")
