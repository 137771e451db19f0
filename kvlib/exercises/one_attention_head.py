"""Exercises of the one_attention_head lesson (one attention head, no mask yet): layer 0 of the
article's model on "How are you?"."""

from __future__ import annotations

import math

import numpy as np

import kvlib

from .base import (
    Feedback,
    check_array,
    checker,
    is_missing,
    read_array,
    read_whole_number,
    show_solution,
)

EXERCISE_3_PROMPT = "I am fine and you?"
"""Exercise 3's prompt, not the notebook's: <bos> I am fine and you ? (7 tokens)."""
EXERCISE_3_HEAD = 1
EXERCISE_3_QUERY = 4
"""Exercise 3 asks whom the query "and" (position 4) attends to most in head 1 of layer 0.
Chosen so that every usual misreading gives another position: the column weights[:, 4]
(what attends TO "and") peaks at 0, head 0's row at 6, and "and" itself is 4."""
PRINTED_SQRT2 = 1.41
"""The notebook says the scaling "divides by 1.41": any divisor within 0.005 of sqrt(2)
(1.41, 1.414, np.sqrt(2), 2 ** 0.5) is the right scaling at the precision it prints."""
SCALE_TOLERANCE = 0.005
PRINTED_PRECISION = 6e-4
"""Scores typed or rounded at the 3 decimals the notebook prints are within this of the truth."""


def _layer0(prompt: str = kvlib.ARTICLE_PROMPT):
    """Q, K, V (T, 4) of layer 0 for a prompt (the article's by default), and the config."""
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(prompt)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    return Q, K, V, params.config


def _head(M: np.ndarray, head: int, config) -> np.ndarray:
    return kvlib.split_heads(M, config.n_heads)[head]


def implied_divisor(answer: np.ndarray, base: np.ndarray) -> float | None:
    """c such that answer == base / c (to 1e-6), or None when answer is not a multiple of
    base. Names what a student divided by: 1 (not scaled), 1.41, 2, 0.71 (multiplied)."""
    if answer.shape != base.shape:
        return None
    answer = answer.astype(float)
    dot = float(np.sum(base * answer))
    if not np.isfinite(dot) or dot == 0.0:
        return None
    divisor = float(np.sum(base * base)) / dot
    if not np.allclose(answer, base / divisor, rtol=1e-6, atol=1e-9):
        return None
    return divisor


def _is_sqrt2(divisor: float) -> bool:
    return abs(divisor - math.sqrt(2)) <= SCALE_TOLERANCE


def _scores_feedback(answer: np.ndarray, expect_scaled: bool) -> Feedback | None:
    """Name the mistake (or the success) when `answer` is a multiple of a known version of
    head 1's scores: head 1's own, head 0's, all columns', or the transpose."""
    Q, K, _, config = _layer0()
    dh = config.head_dim
    raw = _head(Q, 1, config) @ _head(K, 1, config).T
    others = (
        (_head(Q, 0, config) @ _head(K, 0, config).T,
         "these are head 0's scores (columns 0 and 1); head 1 owns columns 2 and 3."),
        (Q @ K.T, f"you used all {config.d_model} columns of Q and K; one head uses only its "
                  f"own {dh}: Q[:, 2:4] and K[:, 2:4] for head 1."),
        (raw.T, "rows and columns are swapped (that is K_h @ Q_h.T): row i must belong to "
                "query i, so compute Q_h @ K_h.T."),
    )
    for base, message in others:
        if implied_divisor(answer, base) is not None:
            return Feedback(False, message)
    divisor = implied_divisor(answer, raw)
    if divisor is None:
        return None
    if not expect_scaled:
        if divisor == 1.0 or abs(divisor - 1.0) < 1e-9:
            return Feedback(True, "head 1's scores, (5, 5): entry [i, j] is query i's dot "
                                  "product with key j.")
        return Feedback(False, f"these are divided by {divisor:.3g} already: exercise 1 asks "
                               "for the raw Q_h @ K_h.T (the scaling is exercise 2).")
    if _is_sqrt2(divisor):
        return Feedback(True, f"head 1's scores divided by sqrt({dh}) = {math.sqrt(dh):.4f}"
                              + ("" if abs(divisor - math.sqrt(dh)) < 1e-9 else
                                 f" (you divided by {divisor:.4g}, the same at the 2 decimals "
                                 "the notebook prints)")
                              + "; the same as kvlib.attention_scores.")
    if abs(divisor - 1.0) < 1e-9:
        return Feedback(False, f"not scaled yet: divide by sqrt(dh) = sqrt({dh}).")
    if abs(divisor - dh) < 1e-9:
        return Feedback(False, f"you divided by dh = {dh} (which equals sqrt(d_model) = "
                               f"sqrt({config.d_model})); the scale is the square root of ONE "
                               f"head's size: sqrt(dh) = sqrt({dh}) = {math.sqrt(dh):.3f}.")
    if abs(divisor - 1 / math.sqrt(dh)) < SCALE_TOLERANCE:
        return Feedback(False, "you multiplied by sqrt(dh); divide instead.")
    return Feedback(False, f"you divided head 1's scores by {divisor:.4g}; the scale is "
                           f"sqrt(dh) = sqrt({dh}) = {math.sqrt(dh):.4f} (np.sqrt(dh), or at "
                           "least 1.41).")


def _scores_shape_feedback(answer: np.ndarray, config) -> Feedback | None:
    dh = config.head_dim
    if answer.shape == (dh, dh):
        return Feedback(False, f"a ({dh}, {dh}) matrix comes from Q_h.T @ K_h; the scores pair "
                               "every query with every key: Q_h @ K_h.T is (5, 5).")
    return None


def _check_head1(answer, expected: np.ndarray, config, scaled: bool, hint: str) -> Feedback:
    """Head 1's scores, expected (5, 5), raw (exercise 1) or scaled by 1 / sqrt(dh) (exercise
    2): the shape and scaling slips in words first, then the numbers at the printed
    precision."""
    array = read_array(answer, "answer", expected.shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    for feedback in (_scores_shape_feedback(array, config), _scores_feedback(array, scaled)):
        if feedback is not None:      # a Feedback that did not pass is falsy: test for None
            return feedback
    return check_array(answer, expected, "answer", atol=PRINTED_PRECISION, hint=hint)


@checker
def check_head1_scores(answer) -> Feedback:
    """Exercise 1: head 1's raw scores Q_h K_h^T (5, 5), not yet scaled."""
    Q, K, _, config = _layer0()
    expected = _head(Q, 1, config) @ _head(K, 1, config).T
    return _check_head1(answer, expected, config, scaled=False,
                        hint="Head 1 is columns 2:4 of Q and K; scores = Q_h @ K_h.T.")


@checker
def check_head1_scaled_scores(answer) -> Feedback:
    """Exercise 2: head 1's scores divided by sqrt(dh), equal to kvlib.attention_scores.

    Dividing by 1.41 or 1.414, the value the notebook prints, passes too."""
    Q, K, _, config = _layer0()
    expected = kvlib.attention_scores(_head(Q, 1, config), _head(K, 1, config))
    return _check_head1(answer, expected, config, scaled=True,
                        hint="Divide head 1's Q_h @ K_h.T by np.sqrt(dh).")


@checker
def check_strongest_key(answer) -> Feedback:
    """Exercise 3: the key that query "and" (position 4 of EXERCISE_3_PROMPT) weighs most in
    head 1 of layer 0, without a mask."""
    Q, K, _, config = _layer0(EXERCISE_3_PROMPT)
    head, query = EXERCISE_3_HEAD, EXERCISE_3_QUERY
    weights = kvlib.attention_weights(_head(Q, head, config), _head(K, head, config))
    row = weights[query]
    expected = int(np.argmax(row))
    tokenizer = kvlib.ToyTokenizer()
    labels = tokenizer.tokens(tokenizer.encode(EXERCISE_3_PROMPT))
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a position.")
    if isinstance(answer, str):
        return Feedback(False, "give the key's position (a whole number), not its word: "
                               "positions are the columns of the weights.")
    if isinstance(answer, np.ndarray) and answer.ndim > 0:
        return Feedback(False, f"give one position, got an array of shape {answer.shape}: "
                               f"take the argmax of row {query} only.")
    answer = read_whole_number(answer, name="the position", expected=expected)
    if isinstance(answer, Feedback):
        return answer
    if not 0 <= answer < len(row):
        return Feedback(False, f"{EXERCISE_3_PROMPT!r} has {len(row)} tokens with BOS: keys "
                               f"are at positions 0 to {len(row) - 1}, got {answer}.")
    if answer == expected:
        return Feedback(True, f"key {expected} ({labels[expected]!r}) with weight "
                              f"{row[expected]:.3f}: a token that comes AFTER 'and'. While "
                              "generating, it would not exist yet: notebook 03's mask "
                              "forbids it.")
    if answer == int(np.argmax(weights[:, query])):
        return Feedback(False, f"that is the largest entry of COLUMN {query}, weights[:, "
                               f"{query}]: how much each query attends TO 'and'. Whom 'and' "
                               f"attends to is its ROW, weights[{query}].")
    other = kvlib.attention_weights(_head(Q, 1 - head, config), _head(K, 1 - head, config))
    if answer == int(np.argmax(other[query])):
        return Feedback(False, f"that is head {1 - head}'s strongest key for 'and'; this "
                               f"exercise is about head {head} (columns "
                               f"{2 * head}:{2 * head + 2}), where key {answer} gets only "
                               f"{row[answer]:.3f}.")
    if answer == query:
        return Feedback(False, f"position {query} is 'and' itself (weight {row[query]:.3f}). "
                               "If you encoded without BOS, every position shifts by one: "
                               "tokenizer.encode puts <bos> at position 0.")
    return Feedback(False, f"key {answer} ({labels[answer]!r}) gets {row[answer]:.3f}, but "
                           f"another key gets more: np.argmax(weights[{query}]).")


SOLUTIONS = {
    1: """\
Qh1, Kh1 = Q[:, 2:4], K[:, 2:4]   # head 1 owns columns 2 and 3
answer = Qh1 @ Kh1.T              # (5, 5): every query with every key
""",
    2: """\
Qh1, Kh1 = Q[:, 2:4], K[:, 2:4]
answer = (Qh1 @ Kh1.T) / np.sqrt(Qh1.shape[1])   # divide by sqrt(dh) = sqrt(2)
assert np.allclose(answer, kvlib.attention_scores(Qh1, Kh1))
""",
    3: """\
other_ids = tokenizer.encode("I am fine and you?")   # <bos> I am fine and you ?
X_other = kvlib.embed(np.array(other_ids), params.embedding)
Q_other, K_other = X_other @ layer.Wq, X_other @ layer.Wk
scores_other = Q_other[:, 2:4] @ K_other[:, 2:4].T / np.sqrt(2)   # head 1
weights_other = kvlib.softmax(scores_other)
answer = int(np.argmax(weights_other[4]))            # the ROW of "and", position 4
print(answer, tokenizer.tokens(other_ids)[answer])
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (one_attention_head; for the instructor)."""
    return show_solution(SOLUTIONS, number)
