"""Shared cases for the exercise checkers' tests (every lesson's test module may use them).

A checker must answer anything a student can type with a Feedback, never a traceback:
`odd_answers(shape)` lists the usual suspects (text, None, 10**400 and 10**5000, nan, ragged
lists, object and text arrays of the right shape, lists of the wrong length, ...) and
`student_answers` is a hypothesis strategy that builds more of them.
`assert_answers_in_words(check, answer)` is the one assertion: a Feedback with a message,
whatever the answer. Every helper here also checks the message's words (`in_words`): its
prefix not doubled ("Not yet: not yet: ..."), numbers shown plainly (7, not np.int64(7)).

    from checker_cases import assert_answers_in_words, odd_answers, student_answers
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
        size = int(np.prod(shape))
        answers += [
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


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-HUGE, max_value=HUGE),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
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


def assert_answers_in_words(check, answer) -> Feedback:
    """The checker returns a Feedback whose message is plain words (in_words), and shows it."""
    feedback = check(answer)
    assert isinstance(feedback, Feedback), f"{check.__name__} returned {type(feedback)}"
    return in_words(feedback)


def assert_not_yet(feedback: Feedback, words: str) -> None:
    """A wrong answer gets its specific diagnosis: `words` appear in the message."""
    in_words(feedback)
    assert not feedback.passed, f"passed: {feedback.message}"
    assert repr(feedback).startswith("Not yet: ")
    assert words in feedback.message, feedback.message


def assert_correct(feedback: Feedback) -> None:
    in_words(feedback)
    assert feedback.passed, feedback.message
    assert repr(feedback).startswith("Correct: ")


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
