"""Feedback for a student's answer, in words."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from numbers import Real

import numpy as np

import kvlib


@dataclass(frozen=True)
class Feedback:
    """The verdict on one answer: shown in the notebook as a single line of text."""

    passed: bool
    message: str

    def __repr__(self) -> str:
        return f"{'Correct' if self.passed else 'Not yet'}: {self.message}"

    def __bool__(self) -> bool:
        return self.passed


def is_missing(answer) -> bool:
    """True while the student's cell still says `answer = ...` (or None)."""
    return answer is None or answer is ...


def not_an_array_answer(answer, name: str = "answer") -> Feedback | None:
    """Feedback when an array answer is still `...` or holds no numbers; None otherwise."""
    if is_missing(answer):
        return Feedback(False, f"{name} is not filled in yet: replace the ... with your code.")
    if isinstance(answer, np.ndarray) and not np.issubdtype(answer.dtype, np.number):
        return Feedback(False, f"{name} should hold numbers, got an array of {answer.dtype}.")
    return None


def as_number(answer) -> float | None:
    """A plain number as a float; None for anything else (bools, arrays, strings)."""
    if isinstance(answer, bool) or not isinstance(answer, Real):
        return None
    return float(answer)


@lru_cache(maxsize=1)
def article_example() -> tuple[kvlib.Params, list[int]]:
    """The worked example the checkers compare against: the default params and the ids of
    "How are you?". Made once; callers must not modify the arrays."""
    return kvlib.init_params(), kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)


def check_array(answer, expected: np.ndarray, name: str, hint: str = "",
                atol: float = 1e-8) -> Feedback:
    """Compare an array answer with the expected one: missing, type, shape, then values."""
    if is_missing(answer):
        return Feedback(False, f"{name} is not filled in yet: replace the ... with your code.")
    if not isinstance(answer, np.ndarray):
        return Feedback(False, f"{name} should be a numpy array, got {type(answer).__name__}.")
    if answer.shape != expected.shape:
        return Feedback(False, f"{name} should have shape {expected.shape}, got {answer.shape}."
                        + (f" {hint}" if hint else ""))
    if not np.allclose(answer, expected, atol=atol, equal_nan=True):
        error = np.nan_to_num(np.abs(answer - expected), nan=np.inf)
        worst = np.unravel_index(np.argmax(error), expected.shape)
        return Feedback(False, f"{name} has the right shape but not the right values (first "
                        f"look at position {tuple(int(i) for i in worst)})."
                        + (f" {hint}" if hint else ""))
    return Feedback(True, f"{name} has shape {expected.shape} and the right values.")


def show_solution(solutions: dict[int, str], number: int):
    """Display exercise `number`'s solution (for the instructor; students try first)."""
    from IPython.display import Markdown

    if number not in solutions:
        raise ValueError(f"there is no exercise {number}; exercises: {sorted(solutions)}")
    code = solutions[number].strip()
    return Markdown(f"**Solution to exercise {number}**\n\n```python\n{code}\n```")
