"""Shared cases for the exercise checkers' tests (test_checkers.py and every lesson's tests).

A checker must answer anything a student can type with a Feedback, never a traceback.
tests/test_checkers.py holds what is true of every checker and feeds each of them the answers
made here: `odd_answers(shape)`, the usual suspects (text, None, 10**400 and 10**5000, nan,
ragged lists, object and text arrays of the right shape, lists of the wrong length, ...);
`MORE_ODD_ANSWERS`, what the lessons' own tests found worth trying (bytes, a built-in
function, functions that raise or touch the cache they are given, arrays of odd shapes); and
`student_answers`, a hypothesis strategy that builds more. A lesson's tests keep its
checkers' tables of wrong answers (each with its diagnosis) and of valid answers in other
forms, with these assertions:

    not_yet(feedback, *phrases)   refused, and the message holds every phrase
    correct(feedback, *phrases)   passed, and the message holds every phrase
    in_words(feedback)            a Feedback in plain words, whatever the verdict

Every helper here checks the message's words (`in_words`): its prefix not doubled ("Not yet:
not yet: ..."), numbers shown plainly (7, not np.int64(7)).
"""

from __future__ import annotations

import math
import re

import numpy as np
from hypothesis import strategies as st

from kvlib.exercises.base import Feedback, shown

HUGE = 10**400
"""An int that no float can hold: float(HUGE) raises OverflowError."""
UNPRINTABLE = 10**5000
"""An int too long for str(): Python refuses to print more than 4,300 digits (ValueError)."""
NUMPY_REPR = re.compile(r"np\.(?:u?int|float|bool|str_|bytes_|complex)\w*\(|(?<!np\.)\barray\(|"
                        r"dtype='")
"""What a numpy repr looks like in a message: np.int64(1), np.float64(nan), array([1, 2]),
array(['a'], dtype='<U1'); not a hint such as np.array([...]) or dtype=bool."""


def case_id(value) -> str:
    """A pytest id for a table's answer, plain and short: pytest's own would call
    str(10**5000), which raises. Use it as ids=case_id wherever odd_answers goes."""
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return shown(value, 40)


def odd_answers(shape: tuple[int, ...] | None = None) -> list[tuple[str, object]]:
    """(label, answer) pairs a student might type; with `shape`, also answers of that shape
    that hold no usable numbers and lists one element too long or too short."""
    answers = [
        ("empty string", ""), ("text", "hello"), ("number as text", "7"), ("None", None),
        ("Ellipsis", ...), ("True", True), ("False", False), ("zero", 0), ("minus one", -1),
        ("a half", 0.5), ("huge int", HUGE), ("minus huge int", -HUGE), ("huge float", 1e308),
        ("unprintable int", UNPRINTABLE), ("minus unprintable int", -UNPRINTABLE),
        ("list with an unprintable int", [UNPRINTABLE, 1]),
        ("numpy float", np.float64(2.5)), ("numpy text", np.str_("7")),
        ("nan", math.nan), ("inf", math.inf), ("minus inf", -math.inf),
        ("numpy nan", np.float64("nan")), ("numpy int", np.int64(-3)), ("complex", 1 + 2j),
        ("empty list", []), ("list of empty list", [[]]), ("ragged list", [[1, 2], [3]]),
        ("nested ragged", [1, [2, [3, 4]]]), ("list of text", ["a", "b"]),
        ("list with None", [1, None]), ("list with huge", [1, HUGE]),
        ("tuple of nan", (math.nan, math.nan)), ("dict", {"a": 1}), ("set", {1, 2}),
        ("range", range(3)), ("function", len), ("object", object()), ("0-d array", np.array(2)),
        ("0-d float array", np.array(2.5)), ("empty array", np.array([])),
        ("text array", np.array(["x"])), ("object array", np.array([1, "a"], dtype=object)),
        ("bool array", np.array([True, False])), ("3-d array", np.zeros((2, 2, 2))),
        ("np.where tuple", np.where(np.array([0, 1, 1]) > 0)),
    ]
    if shape is not None:
        answers += answers_of_shape(shape)
    return answers


def answers_of_shape(shape: tuple[int, ...]) -> list[tuple[str, object]]:
    """Odd answers of the given shape (no usable numbers) and of nearly that shape."""
    size = int(np.prod(shape))
    answers = [
        ("objects of the right shape", np.full(shape, None, dtype=object)),
        ("text of the right shape", np.full(shape, "w")),
        ("huge ints of the right shape", np.full(shape, HUGE, dtype=object)),
        ("nan of the right shape", np.full(shape, np.nan)),
        ("inf of the right shape", np.full(shape, np.inf)),
        ("huge floats of the right shape", np.full(shape, 1e308)),
        ("bools of the right shape", np.ones(shape, dtype=bool)),
        ("complex of the right shape", np.full(shape, 1j)),
        ("list of the right shape with None", np.full(shape, None, dtype=object).tolist()),
        ("flat list of the right size", list(range(size))),
        ("one too long", np.zeros((shape[0] + 1,) + tuple(shape[1:])).tolist()),
        ("one too short", np.zeros((max(shape[0] - 1, 0),) + tuple(shape[1:])).tolist()),
        ("transposed shape", np.zeros(tuple(reversed(shape)))),
    ]
    if len(shape) >= 2:
        ragged = np.zeros(shape).tolist()
        ragged[-1] = ragged[-1][:-1]
        answers.append(("ragged list of the right length", ragged))
    return answers


def _raises(error):
    def raising(*args, **kwargs):
        raise error
    raising.__name__ = f"raises_{type(error).__name__}"
    return raising


def _resets_its_cache(params, token, cache):
    return cache.reset()


def _appends_to_its_cache(params, token, cache):
    return cache.append(0, np.zeros((1, 4)), np.zeros((1, 4)))


MORE_ODD_ANSWERS = [
    ("bytes", b"12"), ("empty bytes", b""), ("bytes that are no text", b"\x00\xff"),
    ("text with a number", "5"), ("a word", "abc"), ("2 ** 64", 2**64),
    ("numpy int32", np.int32(-3)), ("numpy str", np.str_("x")),
    ("numpy float 1.5", np.float64(1.5)),
    ("numpy ints in a tuple", (np.int64(1), np.int64(99))), ("numpy int 7", np.int64(7)),
    ("a tuple with an unprintable int", (UNPRINTABLE, 3)), ("huge ints in a tuple", (HUGE, HUGE)),
    ("nan and a number", (math.nan, 1)), ("two bools", (True, False)), ("empty tuple", ()),
    ("a tuple of a float", (1.5,)), ("a number and text", [1.5, "x"]), ("one element", [1]),
    ("a 2x2 list", [[1, 2], [3, 4]]), ("a ragged list of bools", [[True], [False, True]]),
    ("a list in a list", [1, [2, 3]]), ("five nan", [math.nan] * 5), ("five None", [None] * 5),
    ("five lists", [[1]] * 5), ("empty dict", {}), ("a dict of text", {"projections": "a"}),
    ("empty set", set()), ("an array with None", np.array([1, None], dtype=object)),
    ("0-d nan array", np.array(np.nan)), ("two empty rows", np.zeros((0, 16))),
    ("a (2, 3) array", np.zeros((2, 3))), ("six zeros", np.zeros(6)),
    ("a 4-d array", np.ones((8, 1, 2, 1))), ("huge ints in an array", np.array([HUGE] * 16,
                                                                               dtype=object)),
    ("an array of objects", np.array([object(), object()])), ("a 0-d int array", np.array(78)),
    ("twelve nan", np.full(12, np.nan)), ("(5, 4) of inf", np.full((5, 4), np.inf)),
    ("twelve None", np.full(12, None, dtype=object)),
    ("(5, 4) of text", np.full((5, 4), "x", dtype=object)),
    ("(4, 4) of text", np.full((4, 4), "x", dtype=object)),
    ("(2, 1, 7) of None", np.full((2, 1, 7), None, dtype=object)),
    ("(2, 1, 7) of bools", np.ones((2, 1, 7), dtype=bool)),
    ("seven ints as objects", np.array([1, 2, 3, 4, 5, 6, 7], dtype=object)),
    ("a built-in function", print), ("a class", type),
    ("a function of no argument", lambda: 0), ("a function returning None", lambda *args: None),
    ("a function raising KeyError", _raises(KeyError("x"))),
    ("a function raising StopIteration", _raises(StopIteration())),
    ("a function raising ArithmeticError", _raises(ArithmeticError("a student's bug"))),
    ("a step that resets its cache", _resets_its_cache),
    ("a step that appends to its cache", _appends_to_its_cache),
]
"""Odd answers the lessons' tests tried besides odd_answers(): none is anyone's right answer
(a small whole number can be: 3 and 5 are answers of some exercises)."""


def functions_returning(answers: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """For checkers that take a function: a function per answer, returning it whatever it is
    given, so that whatever a student's function returns is answered in words."""
    return [(f"a function returning {label}", lambda *args, value=value, **kwargs: value)
            for label, value in answers]


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-HUGE, max_value=HUGE),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.binary(max_size=3),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.just(...), st.sampled_from([np.int64(7), np.float64("nan"), np.float64(2.5)]),
    st.builds(lambda: UNPRINTABLE), st.builds(lambda: -UNPRINTABLE),   # no repr of the int
)


def _nested(children):
    return st.one_of(st.lists(children, max_size=5), st.tuples(children, children))


student_answers = st.one_of(
    st.recursive(_scalars, _nested, max_leaves=12),
    st.recursive(st.floats(allow_nan=True, allow_infinity=True), _nested,
                 max_leaves=30).map(lambda value: _as_array(value)),
)
"""Hypothesis strategy: scalars of every kind, nested lists and tuples of them (ragged or
not), and numpy arrays made from nested floats where numpy can make one."""


def _as_array(value):
    try:
        return np.asarray(value)
    except (ValueError, TypeError):
        return value


def in_words(feedback: Feedback) -> Feedback:
    """A Feedback whose message is plain words: non-empty, no traceback, no doubled prefix
    (Feedback's repr adds "Not yet: " or "Correct: "; a message that starts with one again
    shows it twice), and no numpy reprs (np.int64(1) is shown as 1)."""
    assert isinstance(feedback, Feedback), f"not a Feedback: {type(feedback)}"
    message = feedback.message
    assert isinstance(message, str) and message.strip(), f"empty message: {feedback!r}"
    assert repr(feedback).startswith(("Correct: ", "Not yet: "))
    assert "Traceback" not in message
    assert not re.match(r"\s*(not yet|correct)\b", message, re.IGNORECASE), \
        f"the prefix is doubled: {feedback!r}"
    assert not NUMPY_REPR.search(message), f"a numpy repr in the message: {message}"
    return feedback


def assert_answers_in_words(check, answer, *extra) -> Feedback:
    """The checker returns a Feedback whose message is plain words (in_words), and shows it."""
    feedback = check(answer, *extra)
    assert isinstance(feedback, Feedback), f"{check.__name__} returned {type(feedback)}"
    return in_words(feedback)


def not_yet(feedback, *phrases) -> None:
    """The answer is refused, and the message contains every phrase."""
    in_words(feedback)
    assert not feedback.passed, feedback
    assert repr(feedback).startswith("Not yet: ")
    for phrase in phrases:
        assert phrase in feedback.message, feedback.message


def correct(feedback, *phrases) -> None:
    """The answer passes, and the message contains every phrase."""
    in_words(feedback)
    assert feedback.passed, feedback
    assert repr(feedback).startswith("Correct: ")
    for phrase in phrases:
        assert phrase in feedback.message, feedback.message


assert_not_yet = not_yet
"""The name the tests of lessons 19-24 use (assert_not_yet(feedback, words))."""
assert_correct = correct
"""The name the tests of lessons 19-24 use."""
