"""Argument checks shared by kvlib's functions: bad input gets an error that says what was
expected, before anything changes, instead of a numpy traceback from deep inside.

Each check returns the value in the form the code needs (a Python int, a float, an array),
so a function checks and converts in one line.
"""

import math
from collections.abc import Mapping, Set
from numbers import Integral, Real

import numpy as np

LARGEST_COUNT = 2**31 - 1
"""More positions, blocks, heads or requests than anything here holds: a count above it is
refused before numpy is asked for an array of that size."""


def whole_number(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """value as a Python int if it is a whole number >= minimum (and <= maximum, when given;
    bool is not a whole number).

    Raises TypeError for anything but a whole number, ValueError outside the bounds; Python's
    int keeps products of sizes exact where numpy's int32 would overflow.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}, got {value:,}")
    return int(value)


def count(name: str, value, minimum: int = 0) -> int:
    """A size that numpy will allocate for: a whole number between minimum and LARGEST_COUNT."""
    return whole_number(name, value, minimum, LARGEST_COUNT)


def real_number(name: str, value, *, minimum: float | None = None,
                positive: bool = False) -> float:
    """value as a finite float (>= minimum, or > 0 when positive); bool is not a number.

    Raises TypeError for anything but a real number (a string, None, a complex number),
    ValueError for NaN, infinity, an int too large for a float, or a value out of range.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {value}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return number


def flag(name: str, value) -> bool:
    """True or False (numpy's bool too); anything else, 1 and "no" included, is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def numbers(name: str, value, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    """value as an array of real numbers (float or int, not bool, complex, text or objects),
    with ndim dimensions (one of them, given a tuple). A numpy array is returned as it is,
    not copied; a list of numbers is converted.
    """
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (str, bytes, Mapping, Set)) or value is None:
        raise TypeError(f"{name} must be an array of numbers, got {_short(value)}")
    else:
        if contains_bool(value):
            raise TypeError(f"{name} must be numbers, not True or False: got {_short(value)}")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError):
            raise ValueError(f"{name} must be an array of numbers with rows of one length, "
                             f"got {_short(value)}") from None
    if array.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers (float or int), got dtype "
                        f"{array.dtype}: {_short(value)}")
    wanted = (ndim,) if isinstance(ndim, int) else ndim
    if wanted is not None and array.ndim not in wanted:
        dims = " or ".join(f"{n}-D" for n in wanted)
        raise ValueError(f"{name} must be a {dims} array, got shape {array.shape}")
    return array


def whole_numbers(name: str, values, minimum: int = 0) -> np.ndarray:
    """A flat sequence of whole numbers >= minimum (positions, lengths, token ids) as an int
    array (n,); bools, floats, text and nested lists are refused."""
    if isinstance(values, (str, bytes, Mapping, Set)) or values is None:
        raise TypeError(f"{name} must be a flat sequence of whole numbers, got "
                        f"{_short(values)}")
    if isinstance(values, np.ndarray):
        array = values
    else:
        try:
            items = list(values) if not isinstance(values, Integral) else [values]
        except TypeError:
            raise TypeError(f"{name} must be a flat sequence of whole numbers, got "
                            f"{_short(values)}") from None
        for item in items:
            if isinstance(item, (bool, np.bool_)) or not isinstance(item, Integral):
                raise TypeError(f"{name} must be whole numbers, got {item!r} in "
                                f"{_short(values)}")
        if any(abs(item) >= 2**63 for item in items):
            raise ValueError(f"{name} holds a number too large for a 64-bit integer: "
                             f"{_short(values)}")
        array = np.array(items, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of whole numbers, got shape "
                         f"{array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be whole numbers, got dtype {array.dtype}: "
                        f"{_short(values)}")
    if array.size and array.min() < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {array.min()}")
    return array


def contains_bool(value) -> bool:
    """True when a list or tuple (nested or not) holds True or False somewhere: numpy reads
    [True, 2] as the numbers [1, 2] without a word."""
    if isinstance(value, (bool, np.bool_)):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype == bool
    if isinstance(value, (list, tuple)):
        return any(contains_bool(item) for item in value)
    return False


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
