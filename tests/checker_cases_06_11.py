"""Shared by the checker tests of lessons 06-11: what a Feedback must say, and the fuzz that
every checker must answer with a Feedback (never an exception, never a pass).

Not a test module (pytest collects test_*.py only); the tests import it by name.
"""

from __future__ import annotations

import numpy as np
from checker_cases import (  # noqa: F401  (correct, not_yet: the lesson tests import them here)
    UNPRINTABLE,
    correct,
    in_words,
    not_yet,
)

from kvlib.exercises.base import Feedback

FUZZ = [
    None, ..., "5", "abc", b"12", "", True, False, 10**400, -10**400, UNPRINTABLE,
    -UNPRINTABLE, [UNPRINTABLE, 2], np.int64(5), np.float64("nan"), float("nan"),
    float("inf"), -1, 0, 2**64, 1e308, complex(1, 2), [], (), {}, set(), [[1, 2], [3]],
    [1.5, "x"], [[1, 2], [3, 4]], np.array(5), np.zeros(0), np.full(12, np.nan),
    np.full((5, 4), np.inf), np.full(12, None, dtype=object), np.full((5, 4), "x", dtype=object),
    np.full((4, 4), "x", dtype=object), np.full((2, 1, 7), None, dtype=object),
    np.array([1, 2, 3, 4, 5, 6, 7], dtype=object), np.ones((2, 1, 7), dtype=bool), object(),
    {"projections": "a"}, {"a": 1}, print,
]
"""Odd things a student can type: strings, huge ints, nan, None, ragged lists, object arrays
of the right shape, booleans, complex numbers, a built-in function."""


def survives_the_fuzz(checker, *extra):
    """checker(value, *extra) for every FUZZ value: always a Feedback in plain words
    (checker_cases.in_words), never a pass."""
    for value in FUZZ:
        feedback = checker(value, *extra)
        assert isinstance(feedback, Feedback), feedback
        in_words(feedback)
        assert not feedback.passed, feedback


def functions_returning_the_fuzz():
    """For checkers that take a function: one function per FUZZ value, returning it (and one
    that raises), so that whatever a student's function returns is answered in words."""
    def raising(*_args):
        raise ArithmeticError("a student's bug")
    return [lambda *_args, value=value: value for value in FUZZ] + [raising]
