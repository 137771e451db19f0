"""Exercises of the causal_masking lesson (causal masking), on a prompt the notebook does not use:
build the mask for "I am fine and you?", mask its scores, and predict which rows a change
reaches."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import (
    Feedback,
    check_array,
    checker,
    is_missing,
    not_filled_in,
    read_array,
    read_whole_number,
    same_array,
    show_solution,
)

EXERCISE_PROMPT = "I am fine and you?"
"""Exercises 1 and 2 work on this prompt: <bos> I am fine and you ? (7 tokens)."""
EXERCISE_HEAD = 1
"""Exercise 2 masks this head's scores."""
CHANGED_POSITION = 2
"""Exercise 3 replaces the token at this position of "How are you?" ("are") by "fine"."""

SOLUTIONS = {
    1: """
answer = np.tril(np.ones((7, 7), dtype=bool))   # 7 tokens: True on and below the diagonal
""",
    2: """
exercise_scores = exercises.practice_scores()         # (2, 7, 7): both heads
mask7 = np.tril(np.ones((7, 7), dtype=bool))
masked = np.where(mask7, exercise_scores[1], -np.inf)   # -inf BEFORE the softmax
answer = kvlib.softmax(masked)                       # each row still sums to 1
""",
    3: """
answer = [2, 3, 4]   # position 2 itself and every later row; rows 0 and 1 cannot see it

# Check the prediction by running the model twice:
changed = list(ids)
changed[2] = tokenizer.encode("fine", add_bos=False)[0]
before, after = kvlib.forward(params, ids), kvlib.forward(params, changed)
assert answer == [row for row in range(len(ids)) if not np.array_equal(before[row], after[row])]
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor)."""
    return show_solution(SOLUTIONS, number)


@lru_cache(maxsize=1)
def _article():
    tokenizer = kvlib.ToyTokenizer()
    return kvlib.init_params(), tokenizer.encode(kvlib.ARTICLE_PROMPT), tokenizer


def _layer0_scores(prompt: str) -> np.ndarray:
    params, _, tokenizer = _article()
    X = kvlib.embed(np.array(tokenizer.encode(prompt)), params.embedding)
    Q, K, _ = kvlib.project_qkv(X, params.layers[0])
    n_heads = params.config.n_heads
    return kvlib.attention_scores(kvlib.split_heads(Q, n_heads), kvlib.split_heads(K, n_heads))


def layer0_scores() -> np.ndarray:
    """The article's scaled scores in the first block, both heads: (2, 5, 5), unmasked."""
    return _layer0_scores(kvlib.ARTICLE_PROMPT)


def practice_scores() -> np.ndarray:
    """Exercise 2's scores: the first block's scaled scores, both heads, for EXERCISE_PROMPT,
    (2, 7, 7), unmasked. A fresh copy each call, so an exercise cell can be run again."""
    return _layer0_scores(EXERCISE_PROMPT).copy()


def _size() -> int:
    return len(_article()[2].encode(EXERCISE_PROMPT))


def _article_size() -> int:
    """Tokens of the notebook's own prompt, "How are you?" with BOS: 5."""
    return len(_article()[1])


def _read_square(answer, name: str, shape: tuple[int, int],
                 notebook_sized: str) -> np.ndarray | Feedback:
    """The answer as an array (exercise 1's mask or exercise 2's weights, `shape` (7, 7)), or
    the Feedback for one not filled in, not an array, or of the notebook's prompt's size
    (5, 5), which says `notebook_sized`."""
    if is_missing(answer):
        return not_filled_in(name)
    array = read_array(answer, name, shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    article = _article_size()
    if array.shape == (article, article):
        return Feedback(False, notebook_sized)
    return array


@checker
def check_mask(answer) -> Feedback:
    """Exercise 1: the (7, 7) causal mask of EXERCISE_PROMPT, True where a query may see a key."""
    T = _size()
    expected = kvlib.causal_mask(T)
    article = _article_size()
    array = _read_square(answer, "The mask", expected.shape,
                         f"this mask is ({article}, {article}), the size of the notebook's "
                         f"prompt; {EXERCISE_PROMPT!r} has {T} tokens with BOS, so the mask is "
                         f"({T}, {T}).")
    if isinstance(array, Feedback):
        return array
    if array.shape != expected.shape:
        return Feedback(False, f"the mask should have shape ({T}, {T}), one row per query and "
                        f"one column per key; got {array.shape}.")
    if array.dtype != bool:
        if np.array_equal(array, expected.astype(array.dtype)):
            return Feedback(False, "the pattern is right but it holds numbers, not booleans: "
                            "use dtype=bool. With integers, ~mask gives -1 and -2, which are "
                            "both 'true', so inverting the mask would silently fail.")
        return Feedback(False, f"the mask should hold True/False (dtype bool), got "
                        f"{array.dtype}.")
    if np.array_equal(array, ~expected):
        return Feedback(False, "this is True exactly where the key is in the future: the "
                        "opposite. In kvlib's convention True means 'may attend'.")
    if np.array_equal(array, np.triu(np.ones((T, T), bool))):
        return Feedback(False, "this is the upper triangle: it lets each token see the tokens "
                        "after it. The causal mask is the lower triangle (np.tril).")
    if np.array_equal(array, np.tril(np.ones((T, T), bool), k=-1)):
        return Feedback(False, "the diagonal is missing: a token may see itself (row 0 would "
                        "otherwise have nothing to attend to). Use np.tril with k=0.")
    if array.all():
        return Feedback(False, "this allows every query to see every key: no masking at all.")
    if np.array_equal(array, expected):
        return Feedback(True, f"True on and below the diagonal, ({T}, {T}): each token sees "
                        "itself and the tokens before it, never the ones after.")
    wrong = np.argwhere(array != expected)[0]
    return Feedback(False, f"not the causal mask yet: look at row {wrong[0]}, column {wrong[1]} "
                    f"(query {wrong[0]} may see key {wrong[1]}: "
                    f"{bool(expected[tuple(wrong)])}).")


@checker
def check_masked_weights(answer) -> Feedback:
    """Exercise 2: head 1's masked attention weights from practice_scores()[1], (7, 7)."""
    both = practice_scores()
    scores = both[EXERCISE_HEAD]
    T = scores.shape[0]
    mask = kvlib.causal_mask(T)
    expected = kvlib.softmax(kvlib.apply_mask(scores, mask))
    name = "The weight matrix"
    article = _article_size()
    array = _read_square(answer, name, expected.shape,
                         f"({article}, {article}) is the size of the notebook's prompt; the "
                         f"exercise's prompt has {T} tokens: mask practice_scores()"
                         f"[{EXERCISE_HEAD}], which is ({T}, {T}).")
    if isinstance(array, Feedback):
        return array
    if same_array(array, kvlib.softmax(kvlib.apply_mask(both, mask))):
        return Feedback(False, f"these are both heads' weights, {array.shape}; the exercise "
                        "asks for head 1 only: practice_scores()[1].")
    if array.shape == expected.shape:
        with np.errstate(all="ignore"):
            unmasked = kvlib.softmax(scores)
            candidates = (
                (unmasked, "row 0 still gives weight to later tokens: these are the unmasked "
                 "weights. Apply the mask to the scores first."),
                (unmasked * mask, "the rows no longer sum to 1: you set weights to 0 after the "
                 "softmax. Set the masked scores to -np.inf before it."),
                (kvlib.softmax(np.where(mask, scores, 0.0)), "the masked positions still get "
                 "weight: a score of 0 is not forbidden, exp(0) = 1. Use -np.inf, whose exp "
                 "is exactly 0."),
                (kvlib.softmax(kvlib.apply_mask(both[1 - EXERCISE_HEAD], mask)),
                 f"these are head {1 - EXERCISE_HEAD}'s weights; the exercise asks for head "
                 f"{EXERCISE_HEAD} (practice_scores()[{EXERCISE_HEAD}])."),
                (kvlib.softmax(kvlib.apply_mask(scores, mask), axis=0), "the COLUMNS sum to 1: "
                 "the softmax ran down each column. Take it along each row (the last axis), "
                 "one distribution per query."),
            )
        for candidate, message in candidates:
            if same_array(array, candidate):
                return Feedback(False, message)
        if np.isnan(array.astype(complex)).any():
            return Feedback(False, "some rows are nan: every score in them was -inf, so the "
                            "softmax divided 0 by 0. Keep the allowed scores and put -inf only "
                            "where the mask is False: np.where(mask, scores, -np.inf).")
        if not np.allclose(array.sum(axis=1), 1.0):
            return Feedback(False, "every row of attention weights should sum to 1 (softmax "
                            "over the allowed keys).")
        if np.abs(array[~mask]).max() > 0:
            return Feedback(False, "some weight sits above the diagonal, on future tokens: "
                            "those cells should be exactly 0.")
    return check_array(answer, expected, name, f"Mask practice_scores()[{EXERCISE_HEAD}] with "
                       "-np.inf above the diagonal, then take the softmax of each row.")


def _changed_rows() -> list[int]:
    params, ids, tokenizer = _article()
    changed = list(ids)
    changed[CHANGED_POSITION] = tokenizer.encode("fine", add_bos=False)[0]
    before, after = kvlib.forward(params, ids), kvlib.forward(params, changed)
    return [row for row in range(len(ids)) if not np.array_equal(before[row], after[row])]


def _row_numbers(answer, n_rows: int) -> list[int] | Feedback:
    """Row numbers from a list, tuple, set, range, array (an index array, np.where's tuple,
    or a boolean array with one entry per row) or a single number."""
    if isinstance(answer, tuple) and len(answer) == 1 and isinstance(answer[0], np.ndarray):
        answer = answer[0]                      # np.where(...) returns a tuple of arrays
    if isinstance(answer, np.ndarray):
        if answer.dtype == bool:
            if answer.shape != (n_rows,):
                return Feedback(False, f"a True/False answer needs one entry per row ({n_rows}), "
                                f"got shape {answer.shape}.")
            return [int(row) for row in np.flatnonzero(answer)]
        answer = answer.ravel().tolist() if answer.ndim else [answer.item()]
    elif isinstance(answer, (list, tuple, set, frozenset, range)):
        answer = list(answer)
    else:
        answer = [answer]                       # a single row number
    rows = []
    for value in answer:
        row = read_whole_number(value, name="each row number")
        if isinstance(row, Feedback):
            return Feedback(False, "give a list of row numbers (whole numbers), for example "
                            f"[0, 1]. {row.message[0].upper()}{row.message[1:]}")
        rows.append(row)
    return rows


@checker
def check_changed_rows(answer) -> Feedback:
    """Exercise 3: which rows of the logits change when "are" (position 2) becomes "fine"."""
    if is_missing(answer):
        return Feedback(False, "The list of rows is not filled in yet: replace the ... with your "
                        "code.")
    n_rows = _article_size()
    rows = _row_numbers(answer, n_rows)
    if isinstance(rows, Feedback):
        return rows
    rows = sorted(set(rows))
    expected = _changed_rows()
    if any(not 0 <= row < n_rows for row in rows):
        return Feedback(False, f"the logits have {n_rows} rows, numbered 0 to {n_rows - 1}.")
    if not rows:
        return Feedback(False, f"no row at all? Row {CHANGED_POSITION} holds the replaced token "
                        "itself, so at least it changes.")
    early = [row for row in rows if row < CHANGED_POSITION]
    if early:
        return Feedback(False, f"row(s) {early} come before position {CHANGED_POSITION}: under "
                        "the causal mask they never see it, so their outputs stay exactly the "
                        "same.")
    if CHANGED_POSITION not in rows:
        return Feedback(False, f"row {CHANGED_POSITION} changes too: it holds the replaced token "
                        "itself, and every token sees itself.")
    later = [row for row in expected if row not in rows]
    if later:
        return Feedback(False, f"row(s) {later} also change: they come after position "
                        f"{CHANGED_POSITION}, so they attend to it.")
    return Feedback(True, f"rows {rows} change: position {CHANGED_POSITION} and every later row; "
                    "the rows before it are bit-for-bit identical.")
