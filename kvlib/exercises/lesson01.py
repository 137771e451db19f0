"""Exercises of notebook 01 (tokens and the embedding lookup)."""

from __future__ import annotations

import numpy as np

import kvlib

from .base import Feedback, check_array, show_solution

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


def check_sentence_embedding(answer) -> Feedback:
    """Exercise 1: X for EXERCISE_1_SENTENCE, (5, 4), the table's rows picked by its ids."""
    table = _table()
    ids = _ids(EXERCISE_1_SENTENCE)
    expected = table[ids]
    name = "answer"
    if isinstance(answer, np.ndarray) and answer.ndim == 2 and answer.shape[1] == table.shape[1] \
            and answer.shape[0] == len(ids) - 1 \
            and np.allclose(answer, table[ids[1:]]):
        return Feedback(False, "the BOS row is missing: tokenizer.encode puts BOS (id 0) in "
                               "front, and X has a row for it too.")
    if isinstance(answer, np.ndarray) and answer.shape == (table.shape[0], len(ids)):
        return Feedback(False, "you picked COLUMNS of the table; the ids pick ROWS: table[ids].")
    feedback = check_array(answer, expected, name)
    if feedback.passed or answer is None or answer is ... \
            or not isinstance(answer, np.ndarray) or answer.shape != expected.shape:
        return feedback
    for position, (row, token_id) in enumerate(zip(answer, ids)):
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


def check_one_hot(answer) -> Feedback:
    """Exercise 2: the one-hot matrix (T, V) of EXERCISE_2_SENTENCE's ids, BOS included."""
    ids = _ids(EXERCISE_2_SENTENCE)
    V = len(kvlib.TOY_VOCABULARY)
    expected = np.zeros((len(ids), V))
    expected[np.arange(len(ids)), ids] = 1.0
    if answer is None or answer is ...:
        return Feedback(False, "answer is not filled in yet: replace the ... with your code.")
    if not isinstance(answer, np.ndarray):
        return Feedback(False, f"answer should be a numpy array, got {type(answer).__name__}.")
    if answer.shape == (V, len(ids)):
        return Feedback(False, f"one_hot should be (tokens, vocabulary) = {expected.shape}: "
                               "one ROW per token, so that one_hot @ table gives X. Yours is "
                               "transposed.")
    if answer.shape == (len(ids) - 1, V):
        return Feedback(False, "one row is missing: the BOS token at position 0 needs its "
                               "row too.")
    if answer.shape != expected.shape:
        return Feedback(False, f"one_hot should have shape {expected.shape} (tokens, "
                               f"vocabulary), got {answer.shape}.")
    values = answer.astype(float)
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


def check_gpt2_table_size(answer) -> Feedback:
    """Exercise 3: how many numbers GPT-2 small's lookup table holds (vocab_size x d_model)."""
    config = kvlib.GPT2_SMALL
    V, d = config.vocab_size, config.d_model
    expected = V * d
    if answer is None or answer is ...:
        return Feedback(False, "answer is not filled in yet: replace the ... with a number.")
    if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, (int, float, np.number)) \
            or not float(answer).is_integer():
        return Feedback(False, f"give a whole number, got {answer!r}.")
    answer = int(answer)
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
    """Show exercise `number`'s solution (notebook 01; for the instructor)."""
    return show_solution(SOLUTIONS, number)
