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


# ================================================================================================
# Reading answers, for the checkers of lessons 06-11.
#
# Added by the review of lessons 06-11 as one separate block, so that it merges cleanly with the
# shared rule for whole-number answers above it. Each reader turns anything a student can type
# into the value a checker compares, or into a Feedback that says what was expected: a checker
# never lets a traceback escape.
# ================================================================================================

MIN_SIGNIFICANT_DIGITS = 3
"""A rounded answer is accepted from this many significant digits on: the notebooks print
ratios, times and rates at 3 or 4 (134.3, 0.0107 s)."""


def read_number(answer, what: str = "a number") -> float | Feedback:
    """A number the student typed -> float; a Feedback for anything else.

    Accepts Python and numpy ints and floats and 0-d arrays. Refuses bools, strings, arrays
    of several numbers, nan and infinities, and ints too large for a float (10**400), each
    with the reason.
    """
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with "
                        f"{what}.")
    if isinstance(answer, np.ndarray) and answer.ndim == 0:
        answer = answer[()]
    if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, Real):
        if isinstance(answer, (list, tuple, np.ndarray)):
            return Feedback(False, f"expected one number ({what}), got several "
                            f"({type(answer).__name__}).")
        return Feedback(False, f"expected {what}, got {type(answer).__name__} "
                        f"{_shown(answer)}.")
    try:
        value = float(answer)
    except OverflowError:
        return Feedback(False, f"that number has {len(str(abs(int(answer))))} digits: far too "
                        f"large for {what}.")
    if not np.isfinite(value):
        return Feedback(False, f"expected {what}, got {value}.")
    return value


def read_whole_number(answer, what: str = "a whole number") -> int | Feedback:
    """A count (bytes, tokens, a batch) -> int; a Feedback for anything else.

    Python ints of any size and numpy ints are taken as they are; a float is accepted when it
    holds a whole number (1920.0, or 1.92e3), since `/` gives floats. A float with a fraction
    gets a Feedback that says so (a count is whole).
    """
    if isinstance(answer, (int, np.integer)) and not isinstance(answer, (bool, np.bool_)):
        if abs(int(answer)) >= 2**63:
            return Feedback(False, f"that number has {len(str(abs(int(answer))))} digits: far "
                            f"too large for {what}.")
        return int(answer)
    value = read_number(answer, what)
    if isinstance(value, Feedback):
        return value
    if not value.is_integer():
        return Feedback(False, f"{value:g} is not a whole number: {what} is a count. Use // "
                        "to divide without a fraction, or round where the question says so.")
    if abs(value) >= 2**63:
        return Feedback(False, f"{value:g} is far too large for {what}.")
    return int(value)


def read_array(answer, name: str = "answer") -> np.ndarray | Feedback:
    """An array answer -> numpy array of numbers; lists, tuples and arrays are all accepted.

    A Feedback for what holds no numbers: `...`, None, a string, a ragged nested list (rows of
    different lengths), an object array of non-numbers, booleans, complex numbers.
    """
    if is_missing(answer):
        return Feedback(False, f"{name} is not filled in yet: replace the ... with your code.")
    if isinstance(answer, (str, bytes, dict, set)) or callable(answer):
        return Feedback(False, f"{name} should be an array of numbers, got "
                        f"{type(answer).__name__} {_shown(answer)}.")
    try:
        array = np.asarray(answer)
    except (ValueError, TypeError):
        return Feedback(False, f"{name} is a ragged list: its rows have different lengths. "
                        "Every row needs the same number of entries.")
    if array.dtype == object:
        try:
            array = array.astype(np.float64)
        except (TypeError, ValueError, OverflowError):
            return Feedback(False, f"{name} should hold numbers, but some entries are not "
                            "numbers (an array of Python objects).")
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number) \
            or np.issubdtype(array.dtype, np.complexfloating):
        return Feedback(False, f"{name} should hold real numbers, got an array of "
                        f"{array.dtype}.")
    return array


def significant_digits(value: float) -> int:
    """How many significant digits a typed number has: 134.3 -> 4, 0.0107 -> 3, 130 -> 2.

    Read from the shortest repr, which gives back exactly what was typed for a literal; a
    computed value has 15-17."""
    mantissa = repr(float(abs(value))).partition("e")[0]   # '134.3', '0.0107', '130.0'
    whole, _, fraction = mantissa.partition(".")
    fraction = "" if fraction == "0" else fraction
    digits = (whole + fraction).lstrip("0")
    if not fraction:
        digits = digits.rstrip("0")   # 130: the trailing zero carries no digit
    return max(len(digits), 1)


def agrees_at_its_precision(value: float, expected: float,
                            min_digits: int = MIN_SIGNIFICANT_DIGITS) -> bool:
    """True when `value` is `expected` given to the digits the student typed (rounded or
    truncated: within one unit of the last digit), with at least min_digits of them. A value
    computed to full precision must agree to 1e-6 (float32 keeps about 7 digits)."""
    if expected == 0:
        return value == 0
    digits = significant_digits(value)
    if digits >= 12:
        return abs(value - expected) <= 1e-6 * abs(expected)
    if digits < min_digits or value == 0:
        return False
    unit = 10.0 ** (int(np.floor(np.log10(abs(value)))) - digits + 1)
    return abs(value - expected) <= unit * (1 + 1e-9)


def how_close(value: float, expected: float) -> str | None:
    """'within 0.3%' style words when value is within 10% of expected, else None."""
    if expected == 0 or not np.isfinite(value):
        return None
    off = abs(value - expected) / abs(expected)
    if off >= 0.1:
        return None
    side = "above" if value > expected else "below"
    return f"{_percent(off)} {side} the exact value"


def _percent(fraction: float) -> str:
    percent = 100 * fraction
    return f"{percent:.2g}%" if percent < 10 else f"{percent:.0f}%"


def _shown(answer) -> str:
    text = repr(answer)
    return text if len(text) <= 40 else text[:37] + "..."
