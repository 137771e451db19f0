"""Argument checks shared by kvlib's caches and serving code: bad input gets an error that
says what was expected, before anything changes."""

from numbers import Integral


def whole_number(name: str, value, minimum: int) -> int:
    """value as a Python int if it is a whole number >= minimum (bool is not one).

    Raises TypeError for anything but a whole number, ValueError below minimum; Python's int
    keeps products of sizes exact where numpy's int32 would overflow.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)
