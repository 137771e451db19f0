"""Exercises of the big_picture lesson (the big picture): the logits' shape, and the next token."""

from __future__ import annotations

import numpy as np

import kvlib

from .base import (
    Feedback,
    as_number,
    checker,
    is_missing,
    read_whole_number,
    read_whole_numbers,
    show_solution,
)

EXERCISE_1_PROMPT = "I am fine and you?"
"""Exercise 1's prompt: 6 words and punctuation, 7 tokens with BOS."""


@checker
def check_logits_shape(answer) -> Feedback:
    """Exercise 1: the shape of kvlib.forward's logits for EXERCISE_1_PROMPT, as a tuple."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a shape, "
                               "for example (2, 3).")
    if isinstance(answer, np.ndarray) and answer.ndim >= 2:
        return Feedback(False, "give the shape, a tuple like (2, 3), not the logits "
                               "themselves: an array's shape is array.shape.")
    if isinstance(answer, (tuple, list)) and len(answer) != 2:
        return Feedback(False, f"logits are a matrix: two numbers (rows, columns), got "
                               f"{len(answer)}.")
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(EXERCISE_1_PROMPT)
    expected = kvlib.forward(params, ids).shape
    shape = read_whole_numbers(answer, 2, "the shape", expected)
    if isinstance(shape, Feedback):
        return shape
    T, V = expected
    d = params.config.d_model
    article_rows = len(kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT))
    if shape == expected:
        return Feedback(True, f"{T} tokens (BOS included) give {T} rows of logits, one score "
                              f"for each of the {V} vocabulary tokens in each row.")
    if shape == (V, T):
        return Feedback(False, "rows and columns are swapped: there is one ROW per position "
                               "and one COLUMN per vocabulary token.")
    if shape[0] == 1:
        return Feedback(False, "forward computes logits for every position, one row each; "
                               "only the last row is USED to pick the next token.")
    if shape[1] == d:
        return Feedback(False, f"{d} columns is the hidden state X3 (T, d_model); the "
                               "unembedding turns each row into one score per vocabulary "
                               "token.")
    if shape == (article_rows, V):
        return Feedback(False, f"({article_rows}, {V}) is the shape for {kvlib.ARTICLE_PROMPT!r}; "
                               f"count the tokens of {EXERCISE_1_PROMPT!r} instead, BOS "
                               "included.")
    if shape[0] == T - 1:
        return Feedback(False, "count the BOS token too: tokenizer.encode puts it in front "
                               "(len(tokenizer.encode(...)) tells you).")
    if shape[0] != T:
        return Feedback(False, f"the number of rows is the number of tokens; count the "
                               f"tokens of {EXERCISE_1_PROMPT!r}, BOS included (the '?' is "
                               "a token of its own).")
    if shape[1] == V - 1:
        return Feedback(False, f"the vocabulary has {V} tokens, <bos> included, and every one "
                               "gets a score.")
    return Feedback(False, "the number of columns is the vocabulary size: one score per "
                           "token the model knows (len(tokenizer)).")


def practice_logits() -> np.ndarray:
    """Exercise 2's logits: a made-up (4, 12) matrix for a 4-token prompt, one decimal each.

    Made-up numbers (seeded), not the model's: the exercise is about reading logits.
    """
    return np.round(np.random.default_rng(0).normal(0.0, 2.0, size=(4, 12)), 1)


@checker
def check_next_token(answer) -> Feedback:
    """Exercise 2: the greedy next token (an id) for the logits of practice_logits()."""
    logits = practice_logits()
    expected = int(np.argmax(logits[-1]))
    word = kvlib.TOY_VOCABULARY[expected]
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a token id.")
    if isinstance(answer, str):
        return Feedback(False, "give the token's id (a whole number); tokenizer.tokens([id]) "
                               "turns it into its word.")
    if isinstance(answer, np.ndarray) and answer.ndim > 0:
        if answer.shape == (logits.shape[0],):
            return Feedback(False, "you have the favourite token of every row (argmax along "
                                   "axis=1); the next token comes from the LAST row only.")
        if answer.shape == (logits.shape[1],):
            return Feedback(False, "that is one index per column (argmax along axis=0): take "
                                   "the last row first, logits[-1], then its argmax.")
        return Feedback(False, f"give one token id, got an array of shape {answer.shape}.")
    value = as_number(answer.item() if isinstance(answer, np.ndarray) else answer)
    if value is not None and np.isclose(value, logits[-1].max()) and value != expected:
        return Feedback(False, f"{value:g} is the largest logit itself; the token is the "
                               "column it sits in: np.argmax gives that index.")
    answer = read_whole_number(answer, name="the token id", expected=expected)
    if isinstance(answer, Feedback):
        return answer
    if answer == expected:
        return Feedback(True, f"the last row's largest logit is in column {expected}: the next "
                              f"token is {expected} ({word!r}).")
    if answer == int(np.argmax(logits)) and answer >= logits.shape[1]:
        row, column = divmod(answer, logits.shape[1])
        return Feedback(False, f"{answer} is not a token id: np.argmax without an axis counts "
                               f"through the whole flattened matrix ({answer} = row {row} x "
                               f"{logits.shape[1]} + column {column}). Take logits[-1] first.")
    if not 0 <= answer < logits.shape[1]:
        return Feedback(False, f"token ids go from 0 to {logits.shape[1] - 1}, got {answer}.")
    if answer == int(np.argmax(logits[0])):
        return Feedback(False, "that is the FIRST row's favourite: the next token after the "
                               "prompt comes from the last row, logits[-1].")
    if answer == int(np.argmin(logits[-1])):
        return Feedback(False, "that is the smallest logit of the last row; greedy decoding "
                               "takes the largest (np.argmax).")
    return Feedback(False, f"token {answer} does not have the largest logit in the last row: "
                           "use np.argmax(logits[-1]).")


SOLUTIONS = {
    1: """\
prompt_ids = tokenizer.encode("I am fine and you?")   # BOS + 6 tokens
answer = (len(prompt_ids), params.config.vocab_size)
# check by running the model: kvlib.forward(params, prompt_ids).shape
""",
    2: """\
answer = int(np.argmax(practice[-1]))   # the last row decides the next token
print(answer, tokenizer.tokens([answer]))
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (big_picture; for the instructor)."""
    return show_solution(SOLUTIONS, number)
