"""Exercises of notebook 03 (causal masking): build the mask, apply it, predict what changes."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import Feedback, check_array, is_missing, show_solution

CHANGED_POSITION = 2
"""Exercise 3 replaces the token at this position of "How are you?" ("are") by "fine"."""

SOLUTIONS = {
    1: """
answer = np.tril(np.ones((5, 5), dtype=bool))   # True on and below the diagonal
""",
    2: """
mask = np.tril(np.ones((5, 5), dtype=bool))
masked_scores = np.where(mask, scores[1], -np.inf)   # -inf BEFORE the softmax
answer = kvlib.softmax(masked_scores)                # each row still sums to 1
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


def layer0_scores() -> np.ndarray:
    """The article's scaled scores in the first block, both heads: (2, 5, 5), unmasked."""
    params, ids, _ = _article()
    X = kvlib.embed(np.array(ids), params.embedding)
    Q, K, _ = kvlib.project_qkv(X, params.layers[0])
    n_heads = params.config.n_heads
    return kvlib.attention_scores(kvlib.split_heads(Q, n_heads), kvlib.split_heads(K, n_heads))


def _missing(answer, name: str) -> Feedback | None:
    if is_missing(answer):
        return Feedback(False, f"{name} is not filled in yet: replace the ... with your code.")
    return None


def check_mask(answer) -> Feedback:
    """Exercise 1: the (5, 5) causal mask as booleans, True where a query may see a key."""
    expected = kvlib.causal_mask(5)
    if (feedback := _missing(answer, "The mask")) is not None:
        return feedback
    if not isinstance(answer, np.ndarray):
        return Feedback(False, f"the mask should be a numpy array, got {type(answer).__name__}.")
    if answer.shape != expected.shape:
        return Feedback(False, f"the mask should have shape (5, 5), one row per query and one "
                        f"column per key; got {answer.shape}.")
    if answer.dtype != bool:
        if np.array_equal(answer, expected.astype(answer.dtype)):
            return Feedback(False, "the pattern is right but it holds numbers, not booleans: "
                            "use dtype=bool. With integers, ~mask gives -1 and -2, which are "
                            "both 'true', so inverting the mask would silently fail.")
        return Feedback(False, f"the mask should hold True/False (dtype bool), got {answer.dtype}.")
    if np.array_equal(answer, ~expected):
        return Feedback(False, "this is True exactly where the key is in the future: the "
                        "opposite. In kvlib's convention True means 'may attend'.")
    if np.array_equal(answer, np.triu(np.ones((5, 5), bool))):
        return Feedback(False, "this is the upper triangle: it lets each token see the tokens "
                        "after it. The causal mask is the lower triangle (np.tril).")
    if np.array_equal(answer, np.tril(np.ones((5, 5), bool), k=-1)):
        return Feedback(False, "the diagonal is missing: a token may see itself (row 0 would "
                        "otherwise have nothing to attend to). Use np.tril with k=0.")
    if answer.all():
        return Feedback(False, "this allows every query to see every key: no masking at all.")
    if np.array_equal(answer, expected):
        return Feedback(True, "True on and below the diagonal: each token sees itself and the "
                        "tokens before it, never the ones after.")
    wrong = np.argwhere(answer != expected)[0]
    return Feedback(False, f"not the causal mask yet: look at row {wrong[0]}, column {wrong[1]} "
                    f"(query {wrong[0]} may see key {wrong[1]}: "
                    f"{bool(expected[tuple(wrong)])}).")


def check_masked_weights(answer) -> Feedback:
    """Exercise 2: head 1's masked attention weights from scores[1], shape (5, 5)."""
    scores = layer0_scores()[1]
    mask = kvlib.causal_mask(5)
    expected = kvlib.softmax(kvlib.apply_mask(scores, mask))
    if (feedback := _missing(answer, "The weight matrix")) is not None:
        return feedback
    if isinstance(answer, np.ndarray) and answer.shape == expected.shape:
        if np.allclose(answer, kvlib.softmax(scores)):
            return Feedback(False, "row 0 still gives weight to later tokens: these are the "
                            "unmasked weights. Apply the mask to the scores first.")
        if np.allclose(answer, kvlib.softmax(scores) * mask):
            return Feedback(False, "the rows no longer sum to 1: you set weights to 0 after "
                            "the softmax. Set the masked scores to -np.inf before it.")
        if np.allclose(answer, kvlib.softmax(np.where(mask, scores, 0.0))):
            return Feedback(False, "the masked positions still get weight: a score of 0 is not "
                            "forbidden, exp(0) = 1. Use -np.inf, whose exp is exactly 0.")
        if np.allclose(answer, kvlib.softmax(kvlib.apply_mask(layer0_scores()[0], mask))):
            return Feedback(False, "these are head 0's weights; the exercise asks for head 1 "
                            "(scores[1]).")
        if not np.allclose(answer.sum(axis=1), 1.0):
            return Feedback(False, "every row of attention weights should sum to 1 (softmax "
                            "over the allowed keys).")
        if np.abs(answer[~mask]).max() > 0:
            return Feedback(False, "some weight sits above the diagonal, on future tokens: "
                            "those cells should be exactly 0.")
    return check_array(answer, expected, "The weight matrix", "Mask scores[1] with -np.inf "
                       "above the diagonal, then take the softmax of each row.")


def _changed_rows() -> list[int]:
    params, ids, tokenizer = _article()
    changed = list(ids)
    changed[CHANGED_POSITION] = tokenizer.encode("fine", add_bos=False)[0]
    before, after = kvlib.forward(params, ids), kvlib.forward(params, changed)
    return [row for row in range(len(ids)) if not np.array_equal(before[row], after[row])]


def check_changed_rows(answer) -> Feedback:
    """Exercise 3: which rows of the logits change when "are" (position 2) becomes "fine"."""
    if (feedback := _missing(answer, "The list of rows")) is not None:
        return feedback
    values = list(answer) if isinstance(answer, (list, tuple, set, np.ndarray)) else None
    if values is None or not all(isinstance(value, (int, np.integer))
                                 and not isinstance(value, bool) for value in values):
        return Feedback(False, "give a list of row numbers (whole numbers), for example [0, 1].")
    rows = sorted({int(value) for value in values})
    expected = _changed_rows()
    n_rows = len(_article()[1])
    if any(not 0 <= row < n_rows for row in rows):
        return Feedback(False, f"the logits have {n_rows} rows, numbered 0 to {n_rows - 1}.")
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
