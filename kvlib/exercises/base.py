"""Feedback for a student's answer, in words, and the rules every checker shares.

A checker answers anything a student can type with a Feedback, never a traceback. The shared
readers below turn an answer into what a checker compares (a whole number, a tuple of whole
numbers, a numeric array) or into a Feedback that says what was expected, so that every
lesson treats the same kind of answer in the same way:

- whole numbers (an id, a count, a shape): 7, np.int64(7) and 7.0 pass; 10.9 does not, and the
  message says how far it is from a whole number; True, "7", nan and 1e400 are refused in words;
- arrays: a numpy array or a (nested) list of numbers; ragged lists, text and objects are
  refused in words.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral, Real

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


def checker(function):
    """Decorate an exercise checker: numpy's warnings about the student's numbers (an overflow
    in 1e308 * 10, nan in a comparison) stay out of the notebook; the Feedback says it all.
    Exceptions are not caught: a checker must answer every input with a Feedback by itself,
    and tests/checker_cases.py fuzzes that."""

    @functools.wraps(function)
    def check(*args, **kwargs) -> Feedback:
        with np.errstate(all="ignore"):
            return function(*args, **kwargs)

    return check


def is_missing(answer) -> bool:
    """True while the student's cell still says `answer = ...` (or None)."""
    return answer is None or answer is ...


def not_filled_in(name: str = "answer", example: str = "your code") -> Feedback:
    """The Feedback for an answer that is still `...`."""
    return Feedback(False, f"{name} is not filled in yet: replace the ... with {example}.")


def not_an_array_answer(answer, name: str = "answer") -> Feedback | None:
    """Feedback when an array answer is still `...` or holds no numbers; None otherwise."""
    if is_missing(answer):
        return not_filled_in(name)
    if isinstance(answer, np.ndarray) and not _holds_numbers(answer):
        return Feedback(False, f"{name} should hold numbers, got an array of {answer.dtype}.")
    return None


def as_number(answer) -> float | None:
    """A plain, finite number as a float; None for anything else (bools, arrays, strings,
    nan, infinities, and integers too large for a float such as 10**400)."""
    if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, Real):
        return None
    try:
        value = float(answer)
    except (OverflowError, ValueError):
        return None
    return value if math.isfinite(value) else None


LARGEST_WHOLE_NUMBER = 10**30
"""No answer in the series is larger; beyond it a number is refused before any formatting
(Python will not even print an int of more than 4,300 digits)."""


def _shown(answer) -> str:
    """A short repr of what the student typed, for a message (10**400 has 401 digits)."""
    try:
        text = repr(answer)
    except ValueError:          # an int too long to print
        return "a number with thousands of digits"
    return text if len(text) <= 60 else text[:57] + "..."


def whole_number(answer, name: str = "answer", expected: int | None = None) -> int | Feedback:
    """The one rule for a whole-number answer (an id, a count, one number of a shape).

    Returns the number as an int, or a Feedback that says what is wrong. Passes: int, numpy
    integers, and floats (or 0-d arrays) whose value is whole, 7.0 as well as 7. Refused in
    words: bools, text, nan and infinities, other types, and numbers with a fractional part;
    for those, the message says how far the value is from the nearest whole number, and
    when `expected` is given and that nearest number is it, that the answer is close.
    """
    if is_missing(answer):
        return not_filled_in(name, "a whole number")
    if isinstance(answer, np.ndarray):
        if answer.ndim == 0:
            return whole_number(answer.item(), name, expected)
        return Feedback(False, f"{name} should be one whole number, got an array of shape "
                        f"{answer.shape}.")
    if isinstance(answer, (bool, np.bool_)):
        return Feedback(False, f"{name} should be a whole number, got {answer!r} (a bool).")
    if isinstance(answer, str):
        return Feedback(False, f"{name} should be the number itself, not text: write 7, not "
                        f"'7' (got {_shown(answer)}).")
    if isinstance(answer, Integral):
        if abs(int(answer)) > LARGEST_WHOLE_NUMBER:
            return Feedback(False, f"{name} is a number with more than 30 digits, far larger "
                            "than anything counted here.")
        return int(answer)
    if not isinstance(answer, Real):
        return Feedback(False, f"{name} should be a whole number, got {type(answer).__name__} "
                        f"{_shown(answer)}.")
    try:
        value = float(answer)
    except (OverflowError, ValueError):
        return Feedback(False, f"{name} should be a whole number, got {_shown(answer)}.")
    if not math.isfinite(value):
        return Feedback(False, f"{name} should be a whole number, got {value}.")
    if value.is_integer():
        return whole_number(int(value), name, expected)
    nearest = round(value)
    distance = abs(value - nearest)
    if expected is not None and nearest == expected:
        return Feedback(False, f"{name} is {value:,.10g}: close ({distance:.3g} from the answer), "
                        "but the answer is a whole number, with no fractional part.")
    return Feedback(False, f"{name} should be a whole number, but {value:,.10g} is {distance:.3g} "
                    f"from the nearest one, {nearest}.")


def whole_numbers(answer, count: int, name: str = "answer",
                  expected: tuple[int, ...] | None = None) -> tuple[int, ...] | Feedback:
    """A shape-like answer: `count` whole numbers in a tuple, a list or a 1-D array.

    Each number follows whole_number's rule (so (7.0, 12.0) reads as (7, 12), and (10.9, 12)
    is refused with how close it is). Returns the tuple of ints, or a Feedback.
    """
    if is_missing(answer):
        return not_filled_in(name, "a tuple such as (2, 3)")
    if isinstance(answer, np.ndarray) and answer.ndim == 1 and _holds_numbers(answer):
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not isinstance(answer, (tuple, list)):
        return Feedback(False, f"{name} should be a tuple of {count} whole numbers like "
                        f"{tuple(range(2, 2 + count))}; got {_shown(answer)}.")
    if len(answer) != count:
        return Feedback(False, f"{name} should have {count} numbers, got {len(answer)}: "
                        f"{_shown(answer)}.")
    numbers = []
    for position, item in enumerate(answer):
        target = None if expected is None else expected[position]
        value = whole_number(item, f"number {position + 1} of {name}", target)
        if isinstance(value, Feedback):
            return value
        numbers.append(value)
    return tuple(numbers)


def _holds_numbers(array: np.ndarray) -> bool:
    """True for arrays of bools, integers or real floats (no exercise has a complex answer)."""
    return array.dtype.kind in "biuf"


def numeric_array(answer, name: str = "answer", shape: tuple[int, ...] | None = None
                  ) -> np.ndarray | Feedback:
    """An array answer: a numpy array, or a (nested) list or tuple of numbers, as an array.

    Refused with a Feedback: `...`, a single number, text, ragged lists (rows of different
    lengths), and arrays of objects, strings or complex numbers (numbers too large for a
    float, None, words).
    """
    if is_missing(answer):
        return not_filled_in(name)
    if isinstance(answer, np.ndarray):
        array = answer
    elif isinstance(answer, (list, tuple)):
        try:
            array = np.asarray(answer)
        except (ValueError, TypeError, OverflowError):
            return Feedback(False, f"{name} is a list whose rows have different lengths (or "
                            "hold other lists): an array needs rows of equal length.")
    else:
        wanted = f" of shape {shape}" if shape is not None else ""
        forms = "a numpy array, a list or a tuple" if shape is not None and len(shape) == 1 \
            else "a numpy array or a list of rows"
        kind = "a single number" if isinstance(answer, (Real, np.number)) else \
            type(answer).__name__
        return Feedback(False, f"{name} should be an array{wanted} ({forms}), got {kind}.")
    if not _holds_numbers(array):
        if array.dtype == object and all(isinstance(item, Real) for item in array.flat):
            try:
                return np.asarray(array.tolist(), dtype=float).reshape(array.shape)
            except (ValueError, TypeError, OverflowError):
                pass
        kind = {"O": "objects (None, words, or numbers too large for a float)",
                "U": "text", "S": "bytes", "c": "complex numbers"}.get(array.dtype.kind,
                                                                   str(array.dtype))
        return Feedback(False, f"{name} should hold numbers, got an array of {kind}.")
    return array


def check_array(answer, expected: np.ndarray, name: str, hint: str = "",
                atol: float = 1e-8) -> Feedback:
    """Compare an array answer with the expected one: missing, type, shape, then values.

    A list of numbers counts as an array (np.asarray of it is compared), so a correct answer
    written as a list passes.
    """
    if is_missing(answer):
        return not_filled_in(name)
    if not isinstance(answer, (np.ndarray, list, tuple)):
        return Feedback(False, f"{name} should be a numpy array, got {type(answer).__name__}.")
    array = numeric_array(answer, name, expected.shape)
    if isinstance(array, Feedback):
        return array
    suffix = f" {hint}" if hint else ""
    if array.shape != expected.shape:
        read = "" if isinstance(answer, np.ndarray) else " (your list read as a numpy array)"
        return Feedback(False, f"{name} should have shape {expected.shape}, got "
                        f"{array.shape}{read}.{suffix}")
    with np.errstate(all="ignore"):
        array = array.astype(np.result_type(array, expected, 1.0), copy=False)
        if not np.allclose(array, expected, atol=atol, equal_nan=True):
            error = np.nan_to_num(np.abs(array - expected), nan=np.inf)
            worst = np.unravel_index(np.argmax(error), expected.shape)
            return Feedback(False, f"{name} has the right shape but not the right values "
                            f"(first look at position {tuple(int(i) for i in worst)}).{suffix}")
    return Feedback(True, f"{name} has shape {expected.shape} and the right values.")


def same_array(answer, candidate: np.ndarray, atol: float = 1e-8) -> bool:
    """True when `answer` is an array of candidate's shape and values (for naming mistakes)."""
    return (isinstance(answer, np.ndarray) and answer.shape == candidate.shape
            and _holds_numbers(answer) and bool(np.allclose(answer, candidate, atol=atol)))


@lru_cache(maxsize=1)
def article_example() -> tuple[kvlib.Params, list[int]]:
    """The worked example the checkers compare against: the default params and the ids of
    "How are you?". Made once; callers must not modify the arrays."""
    return kvlib.init_params(), kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)


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
