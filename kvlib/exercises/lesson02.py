"""Exercises of notebook 02 (one attention head, no mask yet): layer 0 of the article's model
on "How are you?"."""

from __future__ import annotations

import math

import numpy as np

import kvlib

from .base import Feedback, check_array, show_solution

QUERY_OF_EXERCISE_3 = 3
"""Position of the query "you" in "How are you?" (BOS 3 7 1 9)."""


def _layer0():
    """Q, K, V (5, 4) of layer 0 for the article's prompt, and the head size."""
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    return Q, K, V, params.config


def _head(M: np.ndarray, head: int, config) -> np.ndarray:
    return kvlib.split_heads(M, config.n_heads)[head]


def _same(answer: np.ndarray, other: np.ndarray) -> bool:
    return answer.shape == other.shape and np.allclose(answer, other)


def _scores_misconception(answer, Q, K, config, expect_scaled: bool) -> str | None:
    """Name the mistake when `answer` equals a known wrong version of head 1's scores."""
    dh = config.head_dim
    raw = _head(Q, 1, config) @ _head(K, 1, config).T
    raw_head0 = _head(Q, 0, config) @ _head(K, 0, config).T
    scale = 1.0 / math.sqrt(dh) if expect_scaled else 1.0
    if _same(answer, raw_head0 * scale) or _same(answer, raw_head0 / math.sqrt(dh)) \
            or _same(answer, raw_head0):
        return "these are head 0's scores (columns 0 and 1); head 1 owns columns 2 and 3."
    if _same(answer, (Q @ K.T) * scale) or _same(answer, Q @ K.T):
        return (f"you used all {config.d_model} columns of Q and K; one head uses only its "
                f"own {dh}: Q[:, 2:4] and K[:, 2:4] for head 1.")
    if _same(answer, raw.T * scale) or _same(answer, raw.T / math.sqrt(dh)):
        return ("rows and columns are swapped (that is K_h @ Q_h.T): row i must belong to "
                "query i, so compute Q_h @ K_h.T.")
    if answer.shape == (dh, dh):
        return (f"a ({dh}, {dh}) matrix comes from Q_h.T @ K_h; the scores pair every query "
                "with every key: Q_h @ K_h.T is (5, 5).")
    if not expect_scaled and _same(answer, raw / math.sqrt(dh)):
        return ("these are already divided by sqrt(dh): exercise 1 asks for the raw "
                "Q_h @ K_h.T (the scaling is exercise 2).")
    if expect_scaled:
        if _same(answer, raw):
            return f"not scaled yet: divide by sqrt(dh) = sqrt({dh})."
        wrong = [name for name, value in ((f"dh = {dh}", dh),
                                          (f"sqrt(d_model) = sqrt({config.d_model})",
                                           math.sqrt(config.d_model)))
                 if _same(answer, raw / value)]
        if wrong:
            return (f"you divided by {' (which equals '.join(wrong)}{')' * (len(wrong) - 1)}; "
                    f"the scale is the square root of ONE head's size: sqrt(dh) = "
                    f"sqrt({dh}) = {math.sqrt(dh):.3f}.")
        if _same(answer, raw * math.sqrt(dh)):
            return "you multiplied by sqrt(dh); divide instead."
    return None


def check_head1_scores(answer) -> Feedback:
    """Exercise 1: head 1's raw scores Q_h K_h^T (5, 5), not yet scaled."""
    Q, K, _, config = _layer0()
    expected = _head(Q, 1, config) @ _head(K, 1, config).T
    if isinstance(answer, np.ndarray) and answer.ndim == 2:
        mistake = _scores_misconception(answer, Q, K, config, expect_scaled=False)
        if mistake:
            return Feedback(False, mistake)
    feedback = check_array(answer, expected, "answer",
                           hint="Head 1 is columns 2:4 of Q and K; scores = Q_h @ K_h.T.")
    if feedback.passed:
        return Feedback(True, "head 1's scores, (5, 5): entry [i, j] is query i's dot product "
                              "with key j.")
    return feedback


def check_head1_scaled_scores(answer) -> Feedback:
    """Exercise 2: head 1's scores divided by sqrt(dh), equal to kvlib.attention_scores."""
    Q, K, _, config = _layer0()
    expected = kvlib.attention_scores(_head(Q, 1, config), _head(K, 1, config))
    if isinstance(answer, np.ndarray) and answer.ndim == 2:
        mistake = _scores_misconception(answer, Q, K, config, expect_scaled=True)
        if mistake:
            return Feedback(False, mistake)
    feedback = check_array(answer, expected, "answer",
                           hint="Divide head 1's Q_h @ K_h.T by np.sqrt(dh).")
    if feedback.passed:
        return Feedback(True, f"head 1's scores divided by sqrt({config.head_dim}); the same "
                              "as kvlib.attention_scores.")
    return feedback


def check_strongest_key(answer) -> Feedback:
    """Exercise 3: the key position that query "you" (position 3) weighs most in head 0."""
    Q, K, _, config = _layer0()
    weights = kvlib.attention_weights(_head(Q, 0, config), _head(K, 0, config))
    query = QUERY_OF_EXERCISE_3
    row = weights[query]
    expected = int(np.argmax(row))
    labels = kvlib.ToyTokenizer().tokens(kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT))
    if answer is None or answer is ...:
        return Feedback(False, "answer is not filled in yet: replace the ... with a position.")
    if isinstance(answer, str):
        return Feedback(False, "give the key's position (a whole number), not its word: "
                               "positions are the columns of the weights.")
    if isinstance(answer, np.ndarray) and answer.ndim > 0:
        return Feedback(False, f"give one position, got an array of shape {answer.shape}: "
                               f"take the argmax of row {query} only.")
    if isinstance(answer, np.ndarray):
        answer = answer.item()
    if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, (int, np.integer)):
        return Feedback(False, f"give the position as a whole number, got {answer!r}.")
    answer = int(answer)
    if not 0 <= answer < len(row):
        return Feedback(False, f"keys are at positions 0 to {len(row) - 1}, got {answer}.")
    if answer == expected:
        return Feedback(True, f"key {expected} ({labels[expected]!r}) with weight "
                              f"{row[expected]:.3f}: a token that comes AFTER 'you'. While "
                              "generating, it would not exist yet: notebook 03's mask "
                              "forbids it.")
    head1 = kvlib.attention_weights(_head(Q, 1, config), _head(K, 1, config))[query]
    if answer == int(np.argmax(head1)):
        return Feedback(False, f"that is head 1's strongest key for 'you'; this exercise is "
                               f"about head 0 (columns 0:2), where key {answer} gets only "
                               f"{row[answer]:.3f}.")
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
# weights: head 0's unmasked weights (5, 5) from above; "you" is query 3
answer = int(np.argmax(weights[3]))
print(answer, labels[answer])
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (notebook 02; for the instructor)."""
    return show_solution(SOLUTIONS, number)
