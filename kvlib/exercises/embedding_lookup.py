"""Exercises of the embedding_lookup lesson (tokens and the embedding lookup)."""

from __future__ import annotations

import numpy as np

import kvlib

from .base import (
    Feedback,
    check_array,
    checker,
    is_missing,
    read_array,
    read_whole_number,
    same_array,
    show_solution,
)

EXERCISE_1_SENTENCE = "I am fine."
EXERCISE_2_SENTENCE = "and you?"


def _table() -> np.ndarray:
    return kvlib.init_params().embedding


def _ids(sentence: str) -> list[int]:
    return kvlib.ToyTokenizer().encode(sentence)


def _word(token_id: int) -> str:
    return repr(kvlib.TOY_VOCABULARY[token_id])


def _matching_token(row: np.ndarray, table: np.ndarray) -> int | None:
    """The id whose table row equals `row`, or None."""
    matches = np.flatnonzero(np.all(np.isclose(table, row), axis=1))
    return int(matches[0]) if matches.size else None


@checker
def check_sentence_embedding(answer) -> Feedback:
    """Exercise 1: X for EXERCISE_1_SENTENCE, (5, 4), the table's rows picked by its ids."""
    table = _table()
    ids = _ids(EXERCISE_1_SENTENCE)
    expected = table[ids]
    name = "answer"
    array = read_array(answer, name, expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    if same_array(array, table[ids[1:]]):
        return Feedback(False, "the BOS row is missing: tokenizer.encode puts BOS (id 0) in "
                               "front, and X has a row for it too.")
    if array.shape == (table.shape[0], len(ids)):
        return Feedback(False, "you picked COLUMNS of the table; the ids pick ROWS: table[ids].")
    if same_array(array, expected.T):
        return Feedback(False, "this is X transposed: X has one ROW per token, (5, 4).")
    article = table[_ids(kvlib.ARTICLE_PROMPT)]
    if same_array(array, article):
        return Feedback(False, f"this is X for {kvlib.ARTICLE_PROMPT!r}, the notebook's X; "
                               f"build it for {EXERCISE_1_SENTENCE!r} (encode it first).")
    feedback = check_array(answer, expected, name)
    if feedback.passed or array.shape != expected.shape:
        return feedback
    for position, (row, token_id) in enumerate(zip(array, ids)):
        if np.allclose(row, table[token_id]):
            continue
        found = _matching_token(row, table)
        if found is None:
            return Feedback(False, f"row {position} of X is not a row of the table at all: X "
                                   "is made only of copies of the table's rows.")
        return Feedback(False, f"row {position} of X is the row of token {found} "
                               f"({_word(found)}), but position {position} of "
                               f"{EXERCISE_1_SENTENCE!r} holds token {token_id} "
                               f"({_word(token_id)}).")
    return feedback


def _one_hot(ids: list[int]) -> np.ndarray:
    matrix = np.zeros((len(ids), len(kvlib.TOY_VOCABULARY)))
    matrix[np.arange(len(ids)), ids] = 1.0
    return matrix


@checker
def check_one_hot(answer) -> Feedback:
    """Exercise 2: the one-hot matrix (T, V) of EXERCISE_2_SENTENCE's ids, BOS included."""
    ids = _ids(EXERCISE_2_SENTENCE)
    V = len(kvlib.TOY_VOCABULARY)
    expected = _one_hot(ids)
    array = read_array(answer, "answer", expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    article_ids = _ids(kvlib.ARTICLE_PROMPT)
    if same_array(array, _one_hot(article_ids)):
        return Feedback(False, f"this is the one-hot matrix of {kvlib.ARTICLE_PROMPT!r}, the "
                               f"notebook's; build it for {EXERCISE_2_SENTENCE!r}.")
    if same_array(array, _table()[ids]):
        return Feedback(False, "this is X, the rows of the table; the exercise asks for the "
                               "one-hot matrix itself, the one that gives X when multiplied "
                               "by the table.")
    if array.shape == (V, len(ids)):
        return Feedback(False, f"one_hot should be (tokens, vocabulary) = {expected.shape}: "
                               "one ROW per token, so that one_hot @ table gives X. Yours is "
                               "transposed.")
    if array.shape == (len(ids) - 1, V):
        return Feedback(False, "one row is missing: the BOS token at position 0 needs its "
                               "row too.")
    if array.shape != expected.shape:
        return Feedback(False, f"one_hot should have shape {expected.shape} (tokens, "
                               f"vocabulary), got {array.shape}.")
    values = array.astype(float)
    if not np.all((values == 0) | (values == 1)):
        return Feedback(False, "a one-hot matrix holds only 0s and 1s.")
    for position, (row, token_id) in enumerate(zip(values, ids)):
        ones = int(row.sum())
        if ones != 1:
            return Feedback(False, f"row {position} has {ones} ones; each row has exactly "
                                   "one 1, in the column of its token's id.")
        column = int(np.argmax(row))
        if column != token_id:
            return Feedback(False, f"row {position} has its 1 in column {column} "
                                   f"({_word(column)}), but position {position} of "
                                   f"{EXERCISE_2_SENTENCE!r} holds token {token_id} "
                                   f"({_word(token_id)}).")
    return Feedback(True, f"shape {expected.shape}, one 1 per row in its token's column; "
                          "one_hot @ table now gives the same X as table[ids].")


GPT2_POSITIONS = 1024
GPT2_PARAMETERS = 124_439_808
"""GPT-2 small's position table has 1024 rows; all its weights together are 124,439,808."""


@checker
def check_gpt2_table_size(answer) -> Feedback:
    """Exercise 3: how many numbers GPT-2 small's lookup table holds (vocab_size x d_model)."""
    config = kvlib.GPT2_SMALL
    V, d = config.vocab_size, config.d_model
    expected = V * d
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a number.")
    answer = read_whole_number(answer, expected=expected)
    if isinstance(answer, Feedback):
        return answer
    if answer == expected:
        return Feedback(True, f"{V:,} rows of {d} numbers: {expected:,} numbers, about "
                              f"{expected * 4 / kvlib.MiB:.0f} MiB in float32, just to look "
                              "words up.")
    if answer == V + d:
        return Feedback(False, "that is rows PLUS columns; a table of V rows with d numbers "
                               "each holds V x d numbers.")
    if answer in (V, d):
        return Feedback(False, "that is only one side of the table: it has vocab_size rows "
                               "AND d_model columns.")
    if answer in (expected * 4, expected * 2):
        return Feedback(False, "that counts bytes; the question asks for the number of "
                               "numbers (multiply vocab_size by d_model only).")
    if answer == expected + GPT2_POSITIONS * d:
        return Feedback(False, f"that adds GPT-2's position table ({GPT2_POSITIONS} x {d}); "
                               "the question asks for the token table only.")
    if answer == GPT2_PARAMETERS:
        return Feedback(False, "that is every weight of GPT-2 small (124 million); the "
                               "lookup table is one part of it: vocab_size x d_model.")
    if abs(answer - expected) <= 0.01 * expected:
        return Feedback(False, f"{answer:,} is close ({abs(answer - expected):,} off) but not "
                               "exact: multiply vocab_size by d_model without rounding.")
    return Feedback(False, f"{answer:,} is not vocab_size x d_model: read both from "
                           "kvlib.GPT2_SMALL.")


SOLUTIONS = {
    1: """\
sentence_ids = tokenizer.encode("I am fine.")   # [0, 5, 2, 4, 8]
answer = table[sentence_ids]                    # one row of the table per id: (5, 4)
""",
    2: """\
sentence_ids = tokenizer.encode("and you?")     # [0, 11, 1, 9]
one_hot = np.zeros((len(sentence_ids), len(tokenizer)))
one_hot[np.arange(len(sentence_ids)), sentence_ids] = 1
assert np.allclose(one_hot @ table, table[sentence_ids])
answer = one_hot
""",
    3: """\
answer = kvlib.GPT2_SMALL.vocab_size * kvlib.GPT2_SMALL.d_model   # 50257 x 768
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (embedding_lookup; for the instructor)."""
    return show_solution(SOLUTIONS, number)
