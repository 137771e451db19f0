"""Exercises of the logits_next_token lesson (logits and the next token): checkers and solutions.

1. The greedy guess of every row, for another prompt (a transfer task).
2. A temperature that gives "I" probability 0.5, after the article's prompt.
3. Top-3 probabilities by hand, after the article's prompt.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import (
    Feedback,
    article_example,
    as_number,
    checker,
    read_array,
    read_number,
    show_solution,
)

EXERCISE1_PROMPT = "you are good and I am"
TARGET_TOKEN = 5            # "I", the greedy choice after "How are you?"
TARGET_PROBABILITY = 0.5
TARGET_TOLERANCE = 0.005
EXERCISE_TOP_K = 3
PRINTED_PRECISION = 1e-3    # the notebook prints probabilities at 3 decimals


@lru_cache(maxsize=None)
def _logits(text: str) -> np.ndarray:
    params, _ = article_example()
    return kvlib.forward(params, kvlib.ToyTokenizer().encode(text))


def _article_last_row() -> np.ndarray:
    return _logits(kvlib.ARTICLE_PROMPT)[-1]


@checker
def check_predictions_per_position(answer) -> Feedback:
    """Exercise 1: the greedy guess of every row of the logits of "you are good and I am",
    ids (7,)."""
    if as_number(answer) is not None:
        answer = np.asarray(answer)             # one id: diagnosed below, with the 0-d array
    answer = read_array(answer)
    if isinstance(answer, Feedback):
        return answer
    tokenizer = kvlib.ToyTokenizer()
    ids = tokenizer.encode(EXERCISE1_PROMPT)
    logits = _logits(EXERCISE1_PROMPT)
    expected = np.argmax(logits, axis=-1)
    article = np.argmax(_logits(kvlib.ARTICLE_PROMPT), axis=-1)
    if answer.ndim == 0:
        return Feedback(False, "that is one token id; the exercise asks for one guess per "
                        f"position, {len(expected)} ids in all (one per row of the logits).")
    if answer.shape == (logits.shape[1],):
        return Feedback(False, f"you got {logits.shape[1]} numbers, one per vocabulary entry: "
                        "that is the argmax down each column. Take it along each row instead "
                        "(axis=-1): every row is one position.")
    if answer.shape == article.shape and np.array_equal(answer, article):
        return Feedback(False, "those are the guesses for \"How are you?\", the notebook's "
                        f"logits. Compute the logits of {EXERCISE1_PROMPT!r} first "
                        "(tokenizer.encode, then kvlib.forward).")
    no_bos = np.argmax(_logits_without_bos(), axis=-1)
    if answer.shape == no_bos.shape and np.array_equal(answer, no_bos):
        return Feedback(False, f"{len(no_bos)} guesses: the prompt lost its BOS token. "
                        "tokenizer.encode puts BOS (id 0) in front; keep it, as the model was "
                        "run in the notebook.")
    if answer.shape == logits.shape:
        return Feedback(False, f"that is the whole {logits.shape} matrix of logits; the guess "
                        "of a row is the position of its largest entry (np.argmax, axis=-1).")
    if answer.shape != expected.shape:
        return Feedback(False, f"expected {len(expected)} ids (one per position of the "
                        f"{len(ids)}-token prompt, BOS included), got shape {answer.shape}.")
    if not np.all(np.mod(answer, 1) == 0):
        return Feedback(False, "expected token ids, whole numbers (the position of the largest "
                        "logit, from np.argmax), not scores or probabilities.")
    if not np.array_equal(answer, expected):
        wrong = int(np.flatnonzero(answer != expected)[0])
        return Feedback(False, f"position {wrong} is off: row {wrong} of the logits scores the "
                        f"token that follows position {wrong}; its largest entry is not at "
                        f"{answer[wrong]:g}.")
    hits = int(np.sum(expected[:-1] == np.asarray(ids[1:])))
    return Feedback(True, f"the guesses are {expected.tolist()}. Only the last one, "
                    f"{int(expected[-1])}, is about a new position. The first "
                    f"{len(ids) - 1} guess tokens the prompt already shows ({ids[1:]}); this "
                    f"untrained model gets {hits} of them right. Training compares every row "
                    "with the real next token.")


def _logits_without_bos() -> np.ndarray:
    params, _ = article_example()
    ids = kvlib.ToyTokenizer().encode(EXERCISE1_PROMPT, add_bos=False)
    return kvlib.forward(params, ids)


@checker
def check_temperature_for_half(answer) -> Feedback:
    """Exercise 2: a temperature at which "I" (token 5) gets probability 0.5 (within 0.005)."""
    temperature = read_number(answer, "a temperature")
    if isinstance(temperature, Feedback):
        return temperature
    if temperature <= 0:
        return Feedback(False, f"a temperature must be a positive number, got {temperature:g} "
                        "(0 is greedy decoding: all the probability on one token).")
    last = _article_last_row()
    p_top = kvlib.next_token_probabilities(last, temperature)[TARGET_TOKEN]
    at_one = kvlib.softmax(last)[TARGET_TOKEN]
    if abs(p_top - TARGET_PROBABILITY) <= TARGET_TOLERANCE:
        return Feedback(True, f'at temperature {temperature:.3f}, "I" has probability '
                        f"{p_top:.3f}. Below 1 the distribution sharpens: the top token gains.")
    if temperature > 1:
        return Feedback(False, f'at temperature {temperature:.3g}, "I" has probability '
                        f"{p_top:.3f}, even less than {at_one:.3f} at temperature 1: a "
                        "temperature above 1 flattens the distribution. Go below 1.")
    direction = "lower" if p_top < TARGET_PROBABILITY else "higher"
    return Feedback(False, f'at temperature {temperature:.3g}, "I" has probability '
                    f"{p_top:.3f}, not 0.5: try a {direction} temperature (the top token's "
                    "probability falls as the temperature rises).")


@checker
def check_top_k(answer) -> Feedback:
    """Exercise 3: top-3 probabilities by hand (12,), zeros outside the 3 largest logits.

    Values rounded to the 3 decimals the notebook prints are accepted."""
    answer = read_array(answer)
    if isinstance(answer, Feedback):
        return answer
    last = _article_last_row()
    k = EXERCISE_TOP_K
    top = np.argsort(last)[-k:]
    expected = np.zeros_like(last)
    expected[top] = kvlib.softmax(last[top])
    if answer.shape == (k,):
        return Feedback(False, f"{k} numbers: the kept tokens' probabilities alone. The answer "
                        f"has one probability per vocabulary token, {len(last)}, with 0 for "
                        "every token outside the top 3.")
    if answer.shape != expected.shape:
        return Feedback(False, f"answer should have shape {expected.shape}, one probability per "
                        f"vocabulary token, got {answer.shape}.")
    answer = answer.astype(np.float64)
    if np.isnan(answer).any():
        return Feedback(False, "answer holds nan: a softmax over a row that is all -inf (or "
                        "0/0) gives nan. Take the softmax over the 3 kept logits only.")
    if np.isinf(answer).any():
        return Feedback(False, "answer holds -inf: those are the cut logits, before the "
                        "softmax. The softmax turns -inf into exactly 0.")
    if (answer < 0).any():
        return Feedback(False, "some entries are negative: probabilities are never below 0. "
                        "Are those logits? Take the softmax of the kept logits.")
    kept = np.flatnonzero(answer > 0)
    if len(kept) != k:
        return Feedback(False, f"{len(kept)} tokens have a probability above 0; with top-k = {k} "
                        f"exactly {k} should, all the others exactly 0.")
    if set(kept) != set(top):
        return Feedback(False, f"you kept tokens {sorted(kept.tolist())}, but the {k} largest "
                        f"logits of the last row are those of tokens {sorted(top.tolist())}.")
    if np.allclose(answer[top], last[top]):
        return Feedback(False, "the right 3 tokens, but those are their logits: take the "
                        "softmax over the 3 kept logits.")
    if np.allclose(answer[top], kvlib.softmax(last)[top], atol=PRINTED_PRECISION):
        return Feedback(False, f"the right {k} tokens, but they add up to {answer.sum():.3f}: "
                        "you zeroed the others after the softmax. Renormalise: take the softmax "
                        f"over the {k} kept logits only (or divide by their sum).")
    if not np.allclose(answer, expected, atol=PRINTED_PRECISION):
        return Feedback(False, "the right 3 tokens, but not their probabilities: the softmax "
                        "over the 3 kept logits, at temperature 1.")
    return Feedback(True, "the 3 largest logits keep all the probability, "
                    f"{np.round(expected[top[::-1]], 3).tolist()}, and every other token gets "
                    "exactly 0.")


SOLUTIONS = {
    1: """
new_ids = tokenizer.encode("you are good and I am")   # BOS first: 7 ids
answer = np.argmax(kvlib.forward(params, new_ids), axis=-1)   # one guess per row
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
