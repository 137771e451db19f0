"""Exercises of notebook 06 (logits and the next token): checkers and solutions.

Every checker compares with the article's example: the default parameters and the prompt
"How are you?" (ids 0 3 7 1 9), whose logits are (5, 12).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import (
    Feedback,
    check_array,
    is_missing,
    not_an_array_answer,
    show_solution,
)

TARGET_TOKEN = 5            # "I", the greedy choice after "How are you?"
TARGET_PROBABILITY = 0.5
TARGET_TOLERANCE = 0.005
EXERCISE_TOP_K = 3


@lru_cache(maxsize=1)
def _article_logits() -> np.ndarray:
    params = kvlib.init_params()
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    return kvlib.forward(params, ids)


def check_predictions_per_position(answer) -> Feedback:
    """Exercise 1: the greedy guess of every row of the logits, ids (5,)."""
    name = "answer"
    if is_missing(answer):
        return Feedback(False, f"{name} is not filled in yet: replace the ... with your code.")
    logits = _article_logits()
    expected = np.argmax(logits, axis=-1)
    answer = np.asarray(answer)
    if answer.ndim == 0:
        return Feedback(False, "that is one token id; the exercise asks for one guess per "
                        f"position, {len(expected)} ids in all (one per row of the logits).")
    if answer.shape == (logits.shape[1],):
        return Feedback(False, "you got 12 numbers, one per vocabulary entry: that is the argmax "
                        "down each column. Take it along each row instead (axis=-1): every row "
                        "is one position.")
    if answer.shape != expected.shape:
        return Feedback(False, f"expected {len(expected)} ids (one per position), got shape "
                        f"{answer.shape}.")
    if not np.issubdtype(answer.dtype, np.integer):
        return Feedback(False, "expected token ids (whole numbers), for example from np.argmax.")
    if not np.array_equal(answer, expected):
        wrong = int(np.flatnonzero(answer != expected)[0])
        return Feedback(False, f"position {wrong} is off: row {wrong} of the logits scores the "
                        f"token that follows position {wrong}; its largest entry is not at "
                        f"{int(answer[wrong])}.")
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    hits = int(np.sum(expected[:-1] == np.asarray(ids[1:])))
    return Feedback(True, f"the guesses are {expected.tolist()}. Only the last one, "
                    f"{int(expected[-1])}, is about a new position. The first four guess tokens "
                    f"the prompt already shows ({ids[1:]}); this untrained model gets {hits} "
                    "of them right. Training compares every row with the real next token.")


def check_temperature_for_half(answer) -> Feedback:
    """Exercise 2: a temperature at which "I" (token 5) gets probability 0.5 (within 0.005)."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a temperature.")
    if isinstance(answer, bool) or not isinstance(answer, (int, float, np.integer, np.floating)):
        return Feedback(False, f"expected one number, a temperature, got {type(answer).__name__}.")
    temperature = float(answer)
    if not np.isfinite(temperature) or temperature <= 0:
        return Feedback(False, f"a temperature must be a positive number, got {answer}.")
    last = _article_logits()[-1]
    p_top = kvlib.next_token_probabilities(last, temperature)[TARGET_TOKEN]
    at_one = kvlib.softmax(last)[TARGET_TOKEN]
    if abs(p_top - TARGET_PROBABILITY) <= TARGET_TOLERANCE:
        return Feedback(True, f'at temperature {temperature:.3f}, "I" has probability '
                        f"{p_top:.3f}. Below 1 the distribution sharpens: the top token gains.")
    if temperature > 1:
        return Feedback(False, f'at temperature {temperature:.3f}, "I" has probability '
                        f"{p_top:.3f}, even less than {at_one:.3f} at temperature 1: a "
                        "temperature above 1 flattens the distribution. Go below 1.")
    direction = "lower" if p_top < TARGET_PROBABILITY else "higher"
    return Feedback(False, f'at temperature {temperature:.3f}, "I" has probability {p_top:.3f}, '
                    f"not 0.5: try a {direction} temperature (the top token's probability "
                    "falls as the temperature rises).")


def check_top_k(answer) -> Feedback:
    """Exercise 3: top-3 probabilities by hand (12,), zeros outside the 3 largest logits."""
    name = "answer"
    if (feedback := not_an_array_answer(answer, name)) is not None:
        return feedback
    last = _article_logits()[-1]
    k = EXERCISE_TOP_K
    top = np.argsort(last)[-k:]
    expected = np.zeros_like(last)
    expected[top] = kvlib.softmax(last[top])
    if not isinstance(answer, np.ndarray) or answer.shape != expected.shape:
        return check_array(answer, expected, name, hint="One probability per vocabulary token.")
    kept = np.flatnonzero(answer > 0)
    if len(kept) != k:
        return Feedback(False, f"{len(kept)} tokens have a probability above 0; with top-k = {k} "
                        f"exactly {k} should, all the others exactly 0.")
    if set(kept) != set(top):
        return Feedback(False, f"you kept tokens {sorted(kept.tolist())}, but the {k} largest "
                        f"logits of the last row are those of tokens {sorted(top.tolist())}.")
    if np.isclose(answer.sum(), kvlib.softmax(last)[top].sum()) and not np.isclose(answer.sum(), 1):
        return Feedback(False, f"the right {k} tokens, but they add up to {answer.sum():.3f}: "
                        "you zeroed the others after the softmax. Renormalise: take the softmax "
                        f"over the {k} kept logits only (or divide by their sum).")
    return check_array(answer, expected, name,
                       hint=f"Softmax over the {k} largest logits of the last row, 0 elsewhere.")


SOLUTIONS = {
    1: """
answer = np.argmax(logits, axis=-1)   # one guess per row: [10, 1, 5, 1, 5]
""",
    2: """
candidates = np.linspace(0.05, 3.0, 2951)        # temperatures 0.001 apart
p_I = np.array([kvlib.next_token_probabilities(logits[-1], T)[5] for T in candidates])
answer = float(candidates[np.argmin(np.abs(p_I - 0.5))])   # about 0.665
""",
    3: """
last = logits[-1]
top = np.argsort(last)[-3:]               # ids of the 3 largest logits
answer = np.zeros_like(last)
answer[top] = kvlib.softmax(last[top])    # renormalised over the 3 kept tokens
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
