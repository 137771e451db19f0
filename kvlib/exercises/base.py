"""Feedback for a student's answer, in words, and the rules every checker shares.

A checker answers anything a student can type with a Feedback, never a traceback. The shared
readers below turn an answer into what a checker compares (a number, a whole number, a tuple
of whole numbers, an array, a letter) or into a Feedback that says what was expected, so that
every lesson treats the same kind of answer in the same way:

- numbers: Python and numpy ints and floats, also one number in a 0-d or one-element array,
  list or tuple; text, bools, several numbers, nan, infinities and ints too large for a float
  are refused in words (a number typed as text is echoed back without its quotes);
- whole numbers (an id, a count, a shape): 7, np.int64(7) and 7.0 pass; 10.9 does not, and the
  message says how far it is from a whole number;
- arrays: a numpy array or a (nested) list of numbers; ragged lists, text and objects are
  refused in words.

Messages show the student's values plainly (7, not np.int64(7); [1, 2], not array([1, 2])),
and no message starts with "Not yet" or "Correct": Feedback's repr adds that.
"""

from __future__ import annotations

import functools
import math
import re
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


def _stub(*args):
    ...


def is_stub(function) -> bool:
    """True for a function whose body is still only `...` (or `pass`): its code is that of a
    stub, whatever its arguments. A body that computes and forgets to return is not one."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_code == _stub.__code__.co_code


def not_filled_in(name: str = "answer", example: str = "your code") -> Feedback:
    """The Feedback for an answer that is still `...`."""
    return Feedback(False, f"{name} is not filled in yet: replace the ... with {example}.")


def read_function(answer, write: str, like: str | None = None) -> Feedback | None:
    """None when the answer is a function; otherwise what to do: write `write` and set answer
    to it (the function itself, not its result), a function like `like`."""
    if is_missing(answer):
        return Feedback(False, f"answer is not filled in yet: write {write}, then set answer = "
                        f"{write} (without calling it).")
    if not callable(answer):
        return Feedback(False, f"answer should be a function{f' like {like}' if like else ''}, "
                        f"not {described(answer)}: write answer = {write}, without ().")
    return None


# Showing what the student typed ---------------------------------------------------------------

def _digits(value: int) -> str:
    """'401 digits': how long an int is, without str() of it (Python refuses to print an int
    of more than 4,300 digits)."""
    value = abs(int(value))
    if value.bit_length() < 10_000:
        return f"{len(str(value)):,} digits"
    return f"about {int(math.log10(value)) + 1:,} digits"


def _plain(answer, depth: int = 0) -> str:
    """What the student typed, as plain text: numbers as numbers (np.int64(7) -> 7), arrays
    as lists, huge ints by their length; no numpy reprs, no memory addresses."""
    if isinstance(answer, (bool, np.bool_)):
        return str(bool(answer))
    if isinstance(answer, Integral):
        value = int(answer)
        return str(value) if value.bit_length() <= 200 else f"a number of {_digits(value)}"
    if isinstance(answer, (str, np.str_)):
        return repr(str(answer))
    if isinstance(answer, (bytes, np.bytes_)):
        return repr(bytes(answer))
    if isinstance(answer, (complex, np.complexfloating)):
        return str(complex(answer))
    if isinstance(answer, Real):
        try:
            value = float(answer)
        except (OverflowError, ValueError):
            return f"a {type(answer).__name__}"
        return str(answer) if isinstance(answer, np.generic) else repr(value)
    if isinstance(answer, np.ndarray):
        if answer.ndim == 0:
            return _plain(answer[()], depth)
        if answer.size <= 12 and answer.ndim <= 2 and depth < 3:
            return _plain(answer.tolist(), depth)
        return f"an array of shape {answer.shape}"
    if isinstance(answer, (list, tuple)):
        if depth >= 3:                  # deep enough to say what it is
            return "[...]" if isinstance(answer, list) else "(...)"
        items = ", ".join(_plain(item, depth + 1) for item in answer[:12])
        items += ", ..." if len(answer) > 12 else ""
        if isinstance(answer, list):
            return f"[{items}]"
        return f"({items},)" if len(answer) == 1 else f"({items})"
    if callable(answer) and not isinstance(answer, type):
        return getattr(answer, "__name__", type(answer).__name__)
    try:
        text = repr(answer)
    except Exception:  # noqa: BLE001 - a repr may fail in any way (an int too long to print)
        return f"a {type(answer).__name__}"
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        return f"an instance of {type(answer).__name__}"
    return text


def shown(answer, limit: int = 60) -> str:
    """What the student typed, short and plain, for a message: shown(np.int64(7)) is '7',
    shown(np.array([1, 2])) '[1, 2]', shown(10**5000) 'a number of about 5,001 digits'."""
    text = _plain(answer)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _array_kind(array: np.ndarray) -> str:
    return {"b": "True/False values", "i": "whole numbers", "u": "whole numbers",
            "f": "numbers", "c": "complex numbers", "U": "text", "S": "bytes",
            "O": "objects"}.get(array.dtype.kind, "values that are not numbers")


def described(answer) -> str:
    """The kind of a student's answer and its value, in words: 'text, 'hello'', 'a list,
    [1, 2]', 'True (a bool)', 'an array of shape (2, 3) (numbers)'."""
    if answer is None or answer is ...:
        return "nothing (None)" if answer is None else "... (not filled in)"
    if isinstance(answer, (bool, np.bool_)):
        return f"{bool(answer)} (a bool)"
    if isinstance(answer, (str, np.str_, bytes, np.bytes_)):
        return f"text, {shown(answer)}"
    if isinstance(answer, (complex, np.complexfloating)):
        return f"a complex number, {shown(answer)}"
    if isinstance(answer, Real):
        return shown(answer)
    if isinstance(answer, np.ndarray):
        if answer.ndim == 0:
            return described(answer[()])
        return f"an array of shape {answer.shape} ({_array_kind(answer)})"
    for kind, name in ((list, "list"), (tuple, "tuple"), (dict, "dict"), (set, "set"),
                       (frozenset, "frozenset"), (range, "range")):
        if isinstance(answer, kind):
            return f"an empty {name}" if not len(answer) else f"a {name}, {shown(answer)}"
    if callable(answer) and not isinstance(answer, type):
        return f"a function, {shown(answer)}"
    text = shown(answer)
    return text if text.startswith("an instance of") else f"a {type(answer).__name__}, {text}"


# Reading answers --------------------------------------------------------------------------------
#
# One family of readers for the whole series. Each turns anything a student can type into the
# value a checker compares (a float, an int, a tuple of ints, an array, a letter) or into a
# Feedback that says what was expected, so that every lesson treats the same kind of answer in
# the same way. `what` names the quantity in the messages ("a number of bytes"), `name` the
# variable the student fills in ("answer", "codes").

LARGEST_WHOLE_NUMBER = 10**30
"""No whole-number answer in the series is larger; beyond it a number is refused before any
arithmetic or formatting (Python will not even print an int of more than 4,300 digits)."""


def _one(answer):
    """The single item of a 0-d or one-element array, list or tuple: [2.176] and
    np.array([2.176]) read as 2.176 (a result computed as an array). One level only: [[2.176]]
    is a container in a container, which the readers refuse. Anything else is returned as it
    is."""
    if isinstance(answer, np.ndarray) and answer.size == 1 and answer.ndim <= 1:
        return answer.reshape(-1)[0]
    if isinstance(answer, (list, tuple)) and len(answer) == 1 and \
            not isinstance(answer[0], (list, tuple, np.ndarray)):
        return answer[0]
    return answer


def as_number(answer) -> float | None:
    """A plain, finite number as a float (also one number in a one-element array, list or
    tuple); None for anything else (bools, several numbers, strings, nan, infinities, and
    integers too large for a float such as 10**400). For recognising a slip quietly;
    read_number says what is wrong."""
    answer = _one(answer)
    if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, Real):
        return None
    try:
        value = float(answer)
    except (OverflowError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _text_feedback(text, what: str, name: str) -> Feedback:
    """Text is refused; a number typed as text is echoed back without its quotes (the
    student's own number: the message must not read as a hint)."""
    try:
        plain = text.decode() if isinstance(text, bytes) else str(text)
        float(plain.replace(",", "").replace("_", ""))
    except (ValueError, UnicodeDecodeError):
        return Feedback(False, f"{name} should be {what}, not text (got {shown(text)}).")
    number = plain.strip()
    number = number if len(number) <= 40 else number[:37] + "..."
    return Feedback(False, f"{name} should be {what}, not text: write {number} without quotes "
                    f"(got {shown(text, 40)}).")


def read_number(answer, what: str = "a number", name: str = "answer") -> float | Feedback:
    """A number the student typed -> float; a Feedback for anything else.

    Accepts Python and numpy ints and floats, and one number in a 0-d or one-element array,
    list or tuple. Refuses in words: text (a number typed as text is echoed back without its
    quotes), bools, several numbers, other types, nan and infinities, and ints too large for
    a float (10**400).
    """
    if is_missing(answer):
        return not_filled_in(name, what)
    answer = _one(answer)
    if isinstance(answer, (str, bytes, np.str_, np.bytes_)):
        return _text_feedback(answer, what, name)
    if isinstance(answer, (bool, np.bool_)):
        return Feedback(False, f"{name} should be {what}, got {described(answer)}.")
    if isinstance(answer, (list, tuple, np.ndarray, set, frozenset, range, dict)):
        if isinstance(answer, (list, tuple, np.ndarray)) and len(answer) == 1:
            return Feedback(False, f"{name} should be one number ({what}), not a number inside "
                            f"two levels of brackets: got {described(answer)}.")
        several = "" if not len(answer) else "several numbers: "
        return Feedback(False, f"{name} should be one number ({what}), got {several}"
                        f"{described(answer)}.")
    if not isinstance(answer, Real):
        return Feedback(False, f"{name} should be {what}, got {described(answer)}.")
    try:
        value = float(answer)
    except OverflowError:
        return Feedback(False, f"{name} is a number of {_digits(answer)}: far too large for "
                        f"{what}, and for a float. Give one finite number.")
    except (TypeError, ValueError):
        return Feedback(False, f"{name} should be {what}, got {described(answer)}.")
    if not math.isfinite(value):
        return Feedback(False, f"{name} should be a finite number ({what}), got "
                        f"{shown(value)}.")
    return value


def _as_whole(what: str) -> str:
    return what if "whole" in what else f"{what}, a whole number"


def read_whole_number(answer, what: str = "a whole number", name: str = "answer",
                      expected: int | None = None) -> int | Feedback:
    """The one rule for a whole-number answer (an id, a count, a number of bytes) -> int; a
    Feedback for anything else.

    Python and numpy ints are taken as they are, up to LARGEST_WHOLE_NUMBER; a float (or a
    0-d array) is accepted when its value is whole, 1920.0 or 1.92e3, since `/` gives floats.
    Everything read_number refuses is refused the same way; a number with a fraction gets
    how far it is from the nearest whole number, and when `expected` is given and that
    nearest number is it, that the answer is close.
    """
    if is_missing(answer):
        return not_filled_in(name, what)
    answer = _one(answer)
    if isinstance(answer, Integral) and not isinstance(answer, (bool, np.bool_)):
        value = int(answer)
        if abs(value) > LARGEST_WHOLE_NUMBER:
            return Feedback(False, f"{name} is a number of {_digits(value)}: far too large "
                            f"for {what}.")
        return value
    value = read_number(answer, _as_whole(what), name)
    if isinstance(value, Feedback):
        return value
    if value.is_integer():
        return read_whole_number(int(value), what, name, expected)
    nearest = round(value)
    distance = abs(value - nearest)
    if expected is not None and nearest == expected:
        return Feedback(False, f"{name} is {value:,.15g}: close ({distance:.3g} from the "
                        "answer), but the answer is a whole number, with no fractional part.")
    return Feedback(False, f"{name} should be {_as_whole(what)}, and {value:,.15g} is not "
                    f"a whole number: it is {distance:.3g} from the nearest one, {nearest:,}.")


def read_whole_numbers(answer, count: int, name: str = "answer",
                       expected: tuple[int, ...] | None = None) -> tuple[int, ...] | Feedback:
    """A shape-like answer: `count` whole numbers in a tuple, a list or a 1-D array.

    Each number follows read_whole_number's rule (so (7.0, 12.0) reads as (7, 12), and
    (10.9, 12) is refused with how close it is). Returns the tuple of ints, or a Feedback.
    """
    example = tuple(range(2, 2 + count))
    if is_missing(answer):
        return not_filled_in(name, f"{count} whole numbers, such as {example}")
    if isinstance(answer, np.ndarray) and answer.ndim == 1 and answer.dtype.kind in "biuf":
        answer = answer.tolist()
    if not isinstance(answer, (tuple, list)):
        return Feedback(False, f"{name} should be a tuple of {count} whole numbers like "
                        f"{example}; got {described(answer)}.")
    if len(answer) != count:
        return Feedback(False, f"{name} should have {count} numbers, got {len(answer)}: "
                        f"{shown(answer)}.")
    numbers = []
    for position, item in enumerate(answer):
        if isinstance(item, (list, tuple)) or (isinstance(item, np.ndarray) and item.ndim > 0):
            return Feedback(False, f"number {position + 1} of {name} should be a number, not "
                            f"{described(item)}: write {name} as {count} plain numbers, like "
                            f"{example}.")
        target = None if expected is None else expected[position]
        value = read_whole_number(item, "a whole number", f"number {position + 1} of {name}",
                                  target)
        if isinstance(value, Feedback):
            return value
        numbers.append(value)
    return tuple(numbers)


def read_array(answer, name: str = "answer", shape: tuple[int, ...] | None = None,
               booleans: bool = False) -> np.ndarray | Feedback:
    """An array answer: a numpy array, or a (nested) list or tuple of numbers, as an array.

    Refused with a Feedback: `...`, a single number, text and other types, ragged lists
    (rows of different lengths), and arrays of objects, text or complex numbers; arrays of
    True/False too, unless `booleans` (a mask). An object array of plain numbers (ints too
    large for int64) reads as floats. `shape`, when given, only words the messages.
    """
    if is_missing(answer):
        return not_filled_in(name)
    if isinstance(answer, np.ndarray):
        array = answer
    elif isinstance(answer, (list, tuple)):
        try:
            array = np.asarray(answer)
        except (ValueError, TypeError, OverflowError):
            return Feedback(False, f"{name} is a ragged list: its rows have different lengths "
                            "(or hold other lists). An array needs rows of equal length.")
    else:
        wanted = f" of shape {shape}" if shape is not None else " of numbers"
        forms = "a numpy array, a list or a tuple" if shape is not None and len(shape) == 1 \
            else "a numpy array or a list of rows"
        kind = f"a single number, {shown(answer)}" if isinstance(answer, Real) and \
            not isinstance(answer, (bool, np.bool_)) else described(answer)
        return Feedback(False, f"{name} should be an array{wanted} ({forms}), got {kind}.")
    kind = array.dtype.kind
    if kind in "iuf" or (kind == "b" and booleans):
        return array
    if kind == "O" and array.size and all(isinstance(item, Real) and
                                          not isinstance(item, (bool, np.bool_))
                                          for item in array.flat):
        try:
            return np.asarray(array.tolist(), dtype=float).reshape(array.shape)
        except (ValueError, TypeError, OverflowError):
            return Feedback(False, f"{name} holds numbers too large for a float: the answer's "
                            "numbers are far smaller.")
    if kind == "b":
        return Feedback(False, f"{name} should hold numbers, got an array of True/False "
                        "values.")
    words = {"O": "objects (None, words or lists) instead of numbers"}.get(
        kind, _array_kind(array))
    return Feedback(False, f"{name} should hold numbers, got an array of {words}.")


def read_choice(answer, choices, name: str = "answer") -> str | Feedback:
    """One letter among `choices` ("b", "B", "b)", ["b"] all read as "b"); a Feedback for
    anything else."""
    listed = ", ".join(choices)
    if is_missing(answer):
        return not_filled_in(name, 'a letter, for example "a"')
    answer = _one(answer)
    letters = None
    if isinstance(answer, (str, np.str_)):
        letters = "".join(ch for ch in str(answer).strip().lower() if ch.isalpha())
    if letters is None or len(letters) != 1:
        return Feedback(False, f"{name} should be one letter among {listed}, as text "
                        f"(\"b\"), got {described(answer)}.")
    if letters not in choices:
        return Feedback(False, f"there is no choice {letters!r}: pick one of {listed}.")
    return letters


# Comparing arrays ------------------------------------------------------------------------------

def check_array(answer, expected: np.ndarray, name: str, hint: str = "",
                atol: float = 1e-8) -> Feedback:
    """Compare an array answer with the expected one: missing, type, shape, then values.

    A list of numbers counts as an array (np.asarray of it is compared), so a correct answer
    written as a list passes.
    """
    if is_missing(answer):
        return not_filled_in(name)
    if not isinstance(answer, (np.ndarray, list, tuple)):
        return Feedback(False, f"{name} should be a numpy array, got {described(answer)}.")
    array = read_array(answer, name, expected.shape, booleans=True)
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
            and answer.dtype.kind in "biuf" and bool(np.allclose(answer, candidate, atol=atol)))


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


# Rounded answers -------------------------------------------------------------------------------

MIN_SIGNIFICANT_DIGITS = 3
"""A rounded answer is accepted from this many significant digits on: the notebooks print
ratios, times and rates at 3 or 4 (134.3, 0.0107 s)."""


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
    value = as_number(value)
    if expected == 0 or value is None:
        return None
    off = abs(value - expected) / abs(expected)
    if off >= 0.1:
        return None
    side = "above" if value > expected else "below"
    return f"{_percent(off)} {side} the exact value"


def near_miss(value: float, expected: float, when_close: str, otherwise: str) -> Feedback:
    """The last word on a wrong number that no known mistake explains: "close: within 0.3%
    below the exact value. <when_close>" when value is within 10% of expected, else
    "not that. <otherwise>"."""
    close = how_close(value, expected)
    if close is not None:
        return Feedback(False, f"close: {close}. {when_close}")
    return Feedback(False, f"not that. {otherwise}")


def _percent(fraction: float) -> str:
    percent = 100 * fraction
    return f"{percent:.2g}%" if percent < 10 else f"{percent:.0f}%"
