"""Notebook 00 (the big picture): its exercise checkers, with a table of a beginner's typical
wrong answers (each with its "Not yet" diagnosis) and of valid answers in other forms, and
the published solutions run in the notebook's own variables. What every checker does with odd
input is tested once for all lessons, in test_checkers.py."""

import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook

import kvlib
from kvlib.exercises import big_picture as exercises

TOKENIZER = kvlib.ToyTokenizer()
PRACTICE = exercises.practice_logits()


# Exercise 1: the logits' shape for "I am fine and you?" (7 tokens with BOS)

@pytest.mark.parametrize("answer, words", [
    ((12, 7), "swapped"),
    ((1, 12), "only the last row is USED"),
    ((7, 4), "hidden state X3"),
    ((5, 12), "shape for 'How are you?'"),
    ((6, 12), "count the BOS token"),
    ((8, 12), "number of rows is the number of tokens"),
    ((7, 11), "<bos> included"),
    ((7, 13), "vocabulary size"),
    ((7, 12, 1), "two numbers"),
    ((7,), "two numbers"),
    ("(7, 12)", "tuple of 2 whole numbers"),
    (7, "tuple of 2 whole numbers"),
    ((6.9, 12), "close (0.1 from the answer)"),
    ((10.9, 12.0), "10.9 is not a whole number: it is 0.1 from the nearest one, 11"),
    ((True, 12), "a bool"),
    ((float("nan"), 12), "got nan"),
    (np.zeros((7, 12)), "not the logits"),
])
def test_logits_shape_wrong_answers(answer, words):
    not_yet(exercises.check_logits_shape(answer), words)


@pytest.mark.parametrize("answer", [
    (7, 12), [7, 12], (7.0, 12.0), (np.int64(7), 12), np.array([7, 12]), (np.float64(7), 12.0),
    kvlib.forward(kvlib.init_params(), TOKENIZER.encode("I am fine and you?")).shape,
])
def test_logits_shape_right_answers(answer):
    correct(exercises.check_logits_shape(answer))


# Exercise 2: the next token from practice logits

def test_practice_logits_tell_the_mistakes_apart():
    logits = exercises.practice_logits()
    answers = {int(np.argmax(logits[-1])), int(np.argmax(logits[0])), int(np.argmin(logits[-1]))}
    assert len(answers) == 3 and int(np.argmax(logits)) >= logits.shape[1]
    sorted_last = np.sort(logits[-1])
    assert sorted_last[-1] - sorted_last[-2] > 0.5    # a clear winner


@pytest.mark.parametrize("answer, words", [
    (int(np.argmax(PRACTICE)), "not a token id"),
    (int(np.argmax(PRACTICE[0])), "FIRST row"),
    (int(np.argmin(PRACTICE[-1])), "smallest logit"),
    (np.argmax(PRACTICE, axis=1), "every row"),
    (np.argmax(PRACTICE, axis=0), "one index per column"),
    (np.array([11, 11]), "got an array of shape (2,)"),
    (float(PRACTICE[-1].max()), "largest logit itself"),
    ("and", "id"),
    (12, "from 0 to 11"),
    (-1, "from 0 to 11"),
    (10.9, "close (0.1 from the answer)"),
    (1.5, "whole number"),
    (True, "a bool"),
    (float("inf"), "got inf"),
    (1, "does not have the largest logit"),
])
def test_next_token_wrong_answers(answer, words):
    not_yet(exercises.check_next_token(answer), words)


@pytest.mark.parametrize("answer", [
    11, 11.0, np.int64(11), np.float32(11), np.array(11), np.argmax(PRACTICE[-1]),
    int(np.argmax(kvlib.softmax(PRACTICE[-1]))),
])
def test_next_token_right_answers(answer):
    correct(exercises.check_next_token(answer))


# The published solutions, run after the notebook's own code

def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("big_picture"), exercises,
                          {1: exercises.check_logits_shape, 2: exercises.check_next_token})
