"""Every exercise checker of the series, found by name (kvlib/exercises/<slug>.py, check_*),
meets the series' odd answers: a Feedback in plain words (checker_cases.in_words: no doubled
"Not yet: not yet:", no np.int64(1) or array([...]) in the message), never a pass, never an
exception, 10**5000 (which Python refuses to print) included. The lesson test modules hold
each checker's tables of wrong and valid answers; this one holds what is true of all of them.
"""

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import numpy as np
import pytest
from checker_cases import UNPRINTABLE, assert_answers_in_words, case_id, in_words, odd_answers

import kvlib.exercises
from kvlib.exercises import base
from kvlib.exercises.base import Feedback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import lessons  # noqa: E402

SLUGS = {lesson.slug for lesson in lessons.load()}


def all_checkers():
    """(lesson, name, function) of every check_* function defined in a lesson module."""
    found = []
    for module_info in pkgutil.iter_modules(kvlib.exercises.__path__):
        if module_info.name not in SLUGS:
            continue
        module = importlib.import_module(f"kvlib.exercises.{module_info.name}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("check_") and function.__module__ == module.__name__:
                found.append((module_info.name, name, function))
    return found


CHECKERS = all_checkers()
ODD = odd_answers((4,)) + [
    ("numpy ints in a tuple", (np.int64(1), np.int64(99))), ("numpy str", np.str_("x")),
    ("a tuple with an unprintable int", (UNPRINTABLE, 3)), ("numpy float", np.float64(1.5)),
]


def test_every_lesson_with_exercises_has_checkers():
    lessons = {lesson for lesson, _, _ in CHECKERS}
    assert len(CHECKERS) >= 50 and {"big_picture", "real_model", "speculative_decoding"} <= lessons


@pytest.mark.parametrize("check", [c for _, _, c in CHECKERS],
                         ids=[f"{lesson}.{name}" for lesson, name, _ in CHECKERS])
def test_every_checker_answers_every_odd_answer_in_plain_words(check):
    for label, answer in ODD:
        feedback = assert_answers_in_words(check, answer)
        assert not feedback.passed, (label, feedback)


@pytest.mark.parametrize("message", [
    "not yet: look at token 0.", "Not yet: x", "Correct: x", "  correct: x",
    "the code is np.int64(3)", "got array([1, 2])", "got np.float64(nan)", "dtype='<U1'",
    "got array([None], dtype=object)", "(np.str_('x'))", "np.bool_(True) is not",
])
def test_the_words_check_catches_doubled_prefixes_and_numpy_reprs(message):
    with pytest.raises(AssertionError):
        in_words(Feedback(False, message))


def test_plain_words_pass_the_words_check():
    in_words(Feedback(False, "look at token 0: the chance is min(1, p / q); use np.argmax."))
    in_words(Feedback(False, "use dtype=bool, or np.array([1, 0, 1], dtype=float)."))
    in_words(Feedback(True, "correctly done: 2.176 tokens a pass."))


@pytest.mark.parametrize("answer, text", [
    (np.int64(7), "7"), (np.float64(2.5), "2.5"), (np.float64("nan"), "nan"),
    (np.array([1, 2]), "[1, 2]"), (np.array(3), "3"), (np.str_("x"), "'x'"),
    ((np.int64(1), np.int64(2)), "(1, 2)"), ([np.float32(0.5)], "[0.5]"),
    (True, "True"), (10**400, "a number of 401 digits"),
    (UNPRINTABLE, "a number of about 5,001 digits"), ([UNPRINTABLE], "[a number of about"),
    ((None, (None, (None, (None, np.int64(7))))), "(None, (None, (None, (...))))"),
    (np.zeros((20, 3)), "an array of shape (20, 3)"), (len, "len"),
    (object(), "an instance of object"),
], ids=case_id)
def test_answers_are_shown_plainly(answer, text):
    assert base.shown(answer).startswith(text)


def test_shown_answers_are_short():
    assert len(base.shown(list(range(1000)))) <= 60
    assert len(base.shown("x" * 1000)) <= 60
