"""Notebook 06 (logits and the next token): its next-token explorer driven headless as a
student drives it (temperature, top-k, the sample button's running count; nothing leaks), and
its exercise checkers, with tables of typical wrong answers (each with its diagnosis) and of
valid answers in other forms; the published solutions run in the notebook's own variables,
and every cell can be run twice."""

import re

import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import bar_heights, no_new_figures, text_of

import kvlib
from kvlib.exercises import logits_next_token as exercises
from kvlib.widgets import logits_next_token as widgets

TOKENIZER = kvlib.ToyTokenizer()
PARAMS = kvlib.init_params()
ARTICLE_IDS = TOKENIZER.encode(kvlib.ARTICLE_PROMPT)
ARTICLE_LAST = kvlib.forward(PARAMS, ARTICLE_IDS)[-1]


@pytest.fixture(scope="module")
def article_logits(params, article_ids):
    """The last row of the logits of "How are you?": what the widget starts from."""
    return kvlib.forward(params, article_ids)[-1]


# ---------------------------------------------------------------------------------------------
# The next-token explorer: temperature, top-k, samples
# ---------------------------------------------------------------------------------------------

def test_starts_at_temperature_1_without_a_cut(article_logits):
    widget = widgets.next_token_explorer()
    assert widget.temperature.description == "temperature"
    assert widget.temperature.value == 1.0 and widget.top_k.value == 12
    assert widget.sample.description == "sample"
    np.testing.assert_allclose(bar_heights(widget.ax), kvlib.softmax(article_logits))
    assert '1. "I" 0.359, 2. "?" 0.178, 3. "fine" 0.148' in widget.readout.value
    assert widget.message.value == ""


def test_temperature_moves_the_bars_and_the_readout(article_logits):
    widget = widgets.next_token_explorer()
    before_heights, before_readout = bar_heights(widget.ax), widget.readout.value
    widget.temperature.value = 0.5
    heights = bar_heights(widget.ax)
    np.testing.assert_allclose(heights, kvlib.next_token_probabilities(article_logits, 0.5))
    assert heights[5] > before_heights[5]
    assert widget.readout.value != before_readout
    assert '1. "I" 0.623' in widget.readout.value
    widget.temperature.value = 5.0
    assert bar_heights(widget.ax).max() < 0.15                 # nearly flat
    assert '1. "I" 0.130' in widget.readout.value
    widget.temperature.value = 0.0                             # greedy
    np.testing.assert_array_equal(bar_heights(widget.ax), np.eye(12)[5])
    assert '1. "I" 1.000' in widget.readout.value
    assert "greedy" in widget.ax.get_title()


def test_top_k_leaves_exactly_k_bars(article_logits):
    widget = widgets.next_token_explorer()
    widget.top_k.value = 3
    heights = bar_heights(widget.ax)
    assert np.count_nonzero(heights) == 3
    assert set(np.flatnonzero(heights)) == set(np.argsort(article_logits)[-3:])
    assert heights.sum() == pytest.approx(1.0)
    assert "top-k 3" in widget.ax.get_title()


def test_sample_button_keeps_a_running_count():
    widget, twin = widgets.next_token_explorer(seed=3), widgets.next_token_explorer(seed=3)
    widget.sample.click()
    twin.sample.click()
    assert widget.samples.value == twin.samples.value          # seeded: the same draws
    assert "20 samples so far</b> (1 draw of 20, seed 3)" in widget.samples.value
    counts = [int(n) for n in re.findall(r"x(\d+)", widget.samples.value)]
    assert sum(counts) == 20
    dots = widget.ax.lines[0].get_ydata()
    assert dots.sum() == pytest.approx(1.0) and len(dots) == 12
    first = widget.counts()
    for _ in range(9):
        widget.sample.click()
    assert "200 samples so far</b> (10 draws of 20" in widget.samples.value
    counts = widget.counts()
    assert counts.sum() == 200 and (counts >= first).all()      # added to, not replaced
    np.testing.assert_allclose(widget.ax.lines[0].get_ydata(), counts / 200)
    assert "share of 200 samples so far" in widget.ax.get_legend().texts[0].get_text()
    # 200 draws: the shares approach the probabilities
    assert np.abs(counts / 200 - widget.probabilities()).max() < 0.1
    widget.temperature.value = 0.0                 # greedy: every sample is "I"
    assert widget.samples.value == "" and not widget.ax.lines   # old samples cleared
    assert widget.counts().sum() == 0
    widget.sample.click()
    assert '"I" x20' in widget.samples.value


def test_readout_lists_only_tokens_that_can_be_drawn():
    widget = widgets.next_token_explorer()
    widget.temperature.value = 0.0
    assert " ".join(text_of(widget.readout.value).split()).startswith('Top 3: 1. "I" 1.000')
    assert "2." not in widget.readout.value and "never drawn" in widget.readout.value
    widget.temperature.value = 1.0
    widget.top_k.value = 1
    assert "2." not in widget.readout.value and "never drawn" in widget.readout.value
    widget.top_k.value = 2
    assert '2. "?"' in widget.readout.value and "3." not in widget.readout.value
    widget.top_k.value = 12
    assert "3." in widget.readout.value and "never drawn" not in widget.readout.value


def test_temperature_zero_is_greedy_and_bad_input_is_refused(article_logits):
    greedy = kvlib.next_token_probabilities(article_logits, 0.0)
    assert greedy[5] == 1.0 and greedy.sum() == 1.0
    with pytest.raises(ValueError, match="temperature must be at least 0"):
        kvlib.next_token_probabilities(article_logits, -1.0)
    with pytest.raises(ValueError, match="one row of logits"):
        kvlib.next_token_probabilities(np.zeros((2, 12)), 1.0)


def test_no_figure_leaks_over_many_interactions():
    widget = widgets.next_token_explorer()
    with no_new_figures():
        for step in range(30):
            widget.temperature.value = (step % 10) * 0.5
            widget.top_k.value = 1 + step % 12
            widget.sample.click()
    assert widget.message.value == ""

# ---------------------------------------------------------------------------------------------
# Exercises 1: every row's guess; 2: the temperature for one half; 3: top-k by hand
# ---------------------------------------------------------------------------------------------

# ------------------------------------------------------------------ 06 ex. 1: every row's guess

EX06_1_IDS = TOKENIZER.encode(exercises.EXERCISE1_PROMPT)
EX06_1_LOGITS = kvlib.forward(PARAMS, EX06_1_IDS)
EX06_1_RIGHT = np.argmax(EX06_1_LOGITS, axis=-1)


def _one_position_off():
    guesses = EX06_1_RIGHT.copy()
    guesses[3] = (guesses[3] + 1) % 12
    return guesses


EX06_1_WRONG = [
    (np.argmax(EX06_1_LOGITS, axis=0), "12 numbers"),
    (5, "one token id"),
    (np.argmax(kvlib.forward(PARAMS, ARTICLE_IDS), axis=-1), "How are you?"),
    (np.argmax(kvlib.forward(PARAMS, TOKENIZER.encode(exercises.EXERCISE1_PROMPT, add_bos=False)),
               axis=-1), "BOS"),
    (EX06_1_LOGITS, "whole (7, 12) matrix"),
    (_one_position_off(), "position 3 is off"),
    (EX06_1_RIGHT + 0.5, "whole numbers"),
    (EX06_1_RIGHT[:6], "expected 7 ids"),
    (np.array(["a"] * 7), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX06_1_WRONG)
def test_predictions_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_predictions_per_position(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX06_1_RIGHT, EX06_1_RIGHT.tolist(), tuple(EX06_1_RIGHT),
                                    EX06_1_RIGHT.astype(float), EX06_1_RIGHT.astype(np.int32)])
def test_predictions_valid_forms(answer):
    correct(exercises.check_predictions_per_position(answer), "Training compares")


# ------------------------------------------------------------------ 06 ex. 2: temperature

@pytest.mark.parametrize("answer, diagnosis", [
    (1.0, "try a lower temperature"), (2.0, "above 1 flattens"), (0.3, "try a higher"),
    (-0.5, "positive"), (0, "greedy"), ("hot", "a temperature"), ([0.665, 0.7], "several"),
])
def test_temperature_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_temperature_for_half(answer), diagnosis)


@pytest.mark.parametrize("answer", [0.665, 0.66, 0.67, np.float32(0.665), np.array(0.665),
                                    [0.665], np.array([0.665])])
def test_temperature_valid_forms(answer):
    correct(exercises.check_temperature_for_half(answer))


# ------------------------------------------------------------------ 06 ex. 3: top-k by hand

TOP = np.argsort(ARTICLE_LAST)[-3:]
TOP3 = kvlib.next_token_probabilities(ARTICLE_LAST, top_k=3)


def _only(indices, values):
    answer = np.zeros(12)
    answer[indices] = values
    return answer


EX06_3_WRONG = [
    (_only(TOP, kvlib.softmax(ARTICLE_LAST)[TOP]), "Renormalise"),
    (_only(np.argsort(ARTICLE_LAST)[:3], 1 / 3), "you kept tokens"),
    (kvlib.next_token_probabilities(ARTICLE_LAST, top_k=4), "4 tokens"),
    (kvlib.softmax(ARTICLE_LAST), "12 tokens"),
    (TOP3[TOP], "3 numbers"),
    (_only(TOP, ARTICLE_LAST[TOP]), "logits"),
    (np.where(np.isin(np.arange(12), TOP), ARTICLE_LAST, -np.inf), "-inf"),
    (np.full(12, np.nan), "nan"),
    (_only(TOP, 1 / 3), "not their probabilities"),
    (kvlib.next_token_probabilities(ARTICLE_LAST, 0.7, top_k=3), "not their probabilities"),
    (TOP3[:11], "shape (12,)"),
    (np.array(list("abcdefghijkl")), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX06_3_WRONG)
def test_top_k_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_top_k(answer), diagnosis)


@pytest.mark.parametrize("answer", [TOP3, TOP3.tolist(), tuple(TOP3), np.round(TOP3, 3),
                                    TOP3.astype(np.float32), np.round(TOP3, 3).tolist()])
def test_top_k_valid_forms(answer):
    correct(exercises.check_top_k(answer))

# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("logits_next_token"), exercises,
                          {1: exercises.check_predictions_per_position,
                           2: exercises.check_temperature_for_half, 3: exercises.check_top_k})


def test_every_cell_can_be_run_twice_in_a_row():
    """Students re-run cells: each code cell, run a second time at once, must neither fail
    nor leave a different state for the cells after it."""
    assert run_notebook("logits_next_token", each_twice=True)["answer"] is ...
