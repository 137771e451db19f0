"""Notebook 03 (causal masking): its widgets driven headless (the mask explorer with and
without the mask, the change explorer's bars of exactly 0 before the changed position; bad
prompts give a message, and nothing leaks: every test leaves the figures as it found them),
and its exercise checkers, with tables of typical wrong answers (each with its diagnosis) and
of valid answers in other forms, and the published solutions run in the notebook's own
variables."""

import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import bar_heights, image_of, no_new_figures

import kvlib
from kvlib.exercises import causal_masking as exercises
from kvlib.widgets import causal_masking as widgets

pytestmark = pytest.mark.usefixtures("no_figure_leaks")

IDS = [0, 3, 7, 1, 9]


# ---------------------------------------------------------------------------------------------
# The widgets
# ---------------------------------------------------------------------------------------------

def test_attention_by_layer_masked_is_the_model_and_unmasked_differs(params):
    record = []
    kvlib.forward(params, IDS, record_attention=record)
    masked = widgets.attention_by_layer(params, IDS, masked=True)
    unmasked = widgets.attention_by_layer(params, IDS, masked=False)
    for layer in range(3):
        np.testing.assert_array_equal(masked[layer], record[layer])
        assert unmasked[layer].shape == (2, 5, 5)
        assert np.all(unmasked[layer][:, 0, 1:] > 0)        # the first token reads the future
    # Layer 0's last row sees everything either way; later layers' inputs differ without a mask.
    np.testing.assert_allclose(unmasked[0][:, -1], masked[0][:, -1])
    assert not np.allclose(unmasked[1][:, -1], masked[1][:, -1])


def test_mask_explorer_draws_the_chosen_head_with_and_without_the_mask(params):
    box = widgets.mask_explorer(params)
    ax = box.figure.axes[0]
    masked = widgets.attention_by_layer(params, IDS, masked=True)
    shown = image_of(ax)
    np.testing.assert_allclose(shown.data, masked[0][0])
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~kvlib.causal_mask(5))
    assert "mask on" in ax.get_title() and "sums to 1" in box.status.value

    box.controls["mask"].value = False
    unmasked = widgets.attention_by_layer(params, IDS, masked=False)
    shown = image_of(ax)
    assert not np.ma.getmaskarray(shown).any()
    np.testing.assert_allclose(shown.data, unmasked[0][0])
    future = unmasked[0][0][0, 1:].sum()
    assert f"gives {future:.2f} of its weight to later tokens" in box.status.value
    assert "first token (&lt;bos&gt;)" in box.status.value   # escaped, so the label shows in HTML

    box.controls["layer"].value = 2
    box.controls["head"].value = 1
    np.testing.assert_allclose(image_of(ax).data, unmasked[2][1])
    box.controls["mask"].value = True
    np.testing.assert_allclose(image_of(ax).data, masked[2][1])
    assert ax.get_title() == "Layer 2, head 1, mask on"


def test_mask_explorer_reports_a_bad_prompt_and_recovers(params):
    box = widgets.mask_explorer(params)
    before = image_of(box.figure.axes[0]).copy()
    box.controls["prompt"].value = "How are bananas?"
    assert "Cannot show this" in box.message.value and "bananas" in box.message.value
    np.testing.assert_array_equal(image_of(box.figure.axes[0]).data, before.data)
    box.controls["prompt"].value = "you " * 40
    assert "at most 32 fit" in box.message.value
    box.controls["prompt"].value = "I am fine"
    assert box.message.value == ""
    assert image_of(box.figure.axes[0]).shape == (4, 4)
    assert [t.get_text() for t in box.figure.axes[0].get_xticklabels()] == ["<bos>", "I", "am",
                                                                           "fine"]


def test_mask_explorer_with_a_single_token_says_there_is_no_future(params):
    box = widgets.mask_explorer(params)
    box.controls["prompt"].value = ""               # only <bos>
    for masked in (False, True):
        box.controls["mask"].value = masked
        assert "single token" in box.status.value and "reads the future" not in box.status.value
        assert image_of(box.figure.axes[0]).shape == (1, 1)


def test_mask_explorer_keeps_one_figure_and_one_colorbar(params):
    box = widgets.mask_explorer(params)
    n_axes = len(box.figure.axes)
    for step in range(24):
        box.controls["mask"].value = bool(step % 2)
        box.controls["layer"].value = step % 3
        box.controls["head"].value = step % 2
    assert len(box.figure.axes) == n_axes == 2   # the heatmap and its colorbar, never more


def test_row_changes_are_exactly_zero_before_the_changed_position(params):
    changes = widgets.row_changes(params, IDS, 3, 5)
    assert changes.shape == (5,)
    assert np.all(changes[:3] == 0) and np.all(changes[3:] > 0)
    assert np.all(widgets.row_changes(params, IDS, 0, 4) > 0)
    assert np.all(widgets.row_changes(params, IDS, 2, IDS[2]) == 0)
    with pytest.raises(ValueError, match="position must be between 0 and 4"):
        widgets.row_changes(params, IDS, 5, 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        widgets.row_changes(params, IDS, 1, 12)
    with pytest.raises(TypeError, match="whole number"):
        widgets.row_changes(params, IDS, 1.5, 1)


def test_change_explorer_bars_follow_the_chosen_change(params):
    box = widgets.change_explorer(params, position=3, replacement=5)
    ax = box.figure.axes[0]
    heights = bar_heights(ax)
    np.testing.assert_array_equal(heights, widgets.row_changes(params, IDS, 3, 5))
    assert np.all(heights[:3] == 0) and np.all(heights[3:] > 0)
    texts = [t.get_text() for t in ax.texts]
    assert texts[:3] == ["0 exactly"] * 3
    assert "rows 0-2: change exactly 0" in box.status.value

    box.controls["position"].value = 1
    box.controls["replacement"].value = 4          # "fine"
    heights = bar_heights(ax)
    assert heights[0] == 0 and np.all(heights[1:] > 0)
    assert "row 0: change exactly 0" in box.status.value
    assert ax.get_xticklabels()[1].get_text() == "1\nHow -> fine"

    box.controls["replacement"].value = IDS[1]     # the token already there
    assert np.all(bar_heights(ax) == 0) and "already holds 'How'" in box.status.value

    box.controls["position"].value = 0
    box.controls["replacement"].value = 5
    assert np.all(bar_heights(ax) > 0)


def test_change_explorer_follows_a_new_prompt_and_reports_bad_ones(params):
    box = widgets.change_explorer(params, position=4, replacement=5)
    box.controls["prompt"].value = "I am"          # 3 tokens: position 4 no longer exists
    assert box.controls["position"].max == 2 and box.controls["position"].value == 2
    assert len(bar_heights(box.figure.axes[0])) == 3
    assert box.message.value == ""
    box.controls["prompt"].value = "I am hungry"
    assert "unknown word" in box.message.value and "hungry" in box.message.value
    assert box.status.value == ""
    box.controls["prompt"].value = "How are you?"
    assert box.message.value == "" and box.controls["position"].max == 4


def test_change_explorer_does_not_leak_figures(params):
    box = widgets.change_explorer(params)
    with no_new_figures():
        for step in range(24):
            box.controls["position"].value = step % 5
            box.controls["replacement"].value = step % 12
    assert len(box.figure.axes) == 1


# ---------------------------------------------------------------------------------------------
# The exercise checkers: typical wrong answers, each with its diagnosis; valid answers
# ---------------------------------------------------------------------------------------------

# Exercise 1: the (7, 7) mask of "I am fine and you?"

MASK7 = kvlib.causal_mask(7)


@pytest.mark.parametrize("answer, words", [
    (kvlib.causal_mask(5), "size of the notebook's prompt"),
    (np.tril(np.ones((4, 4), bool)), "shape (7, 7)"),
    (MASK7.astype(int), "holds numbers, not booleans"),
    (MASK7.astype(float), "holds numbers, not booleans"),
    (~MASK7, "the opposite"),
    (np.triu(np.ones((7, 7), bool)), "upper triangle"),
    (np.tril(np.ones((7, 7), bool), k=-1), "diagonal is missing"),
    (np.ones((7, 7), bool), "no masking at all"),
    (np.tril(np.ones((7, 7), bool), k=1), "look at row 0, column 1"),
    ("np.tril", "got text"),
    ([[True, False], [True]], "different lengths"),
])
def test_mask_wrong_answers(answer, words):
    not_yet(exercises.check_mask(answer), words)


@pytest.mark.parametrize("answer", [
    MASK7, MASK7.tolist(), np.tril(np.ones((7, 7))) == 1, np.arange(7)[:, None] >= np.arange(7),
    ~np.triu(np.ones((7, 7), bool), k=1),
])
def test_mask_right_answers(answer):
    correct(exercises.check_mask(answer))


SCORES7 = exercises.practice_scores()
with np.errstate(all="ignore"):
    RIGHT_WEIGHTS7 = kvlib.softmax(np.where(MASK7, SCORES7[1], -np.inf))
    INVERTED_WEIGHTS7 = kvlib.softmax(np.where(~MASK7, SCORES7[1], -np.inf))


@pytest.mark.parametrize("answer, words", [
    (kvlib.softmax(SCORES7[1]), "unmasked weights"),
    (kvlib.softmax(SCORES7[1]) * MASK7, "rows no longer sum to 1"),
    (kvlib.softmax(np.where(MASK7, SCORES7[1], 0.0)), "a score of 0 is not forbidden"),
    (kvlib.softmax(kvlib.apply_mask(SCORES7[0], MASK7)), "head 0's weights"),
    (kvlib.softmax(kvlib.apply_mask(SCORES7, MASK7)), "both heads' weights"),
    (kvlib.softmax(kvlib.apply_mask(SCORES7[1], MASK7), axis=0), "COLUMNS sum to 1"),
    (INVERTED_WEIGHTS7, "rows are nan"),
    (kvlib.softmax(kvlib.apply_mask(exercises.layer0_scores()[1], kvlib.causal_mask(5))),
     "size of the notebook's prompt"),
    (np.tril(np.ones((7, 7))), "should sum to 1"),
    (np.full((7, 7), 1 / 7), "above the diagonal"),
    (np.eye(7), "right shape but not the right values"),
    (SCORES7[1], "should sum to 1"),
])
def test_masked_weights_wrong_answers(answer, words):
    not_yet(exercises.check_masked_weights(answer), words)


@pytest.mark.parametrize("answer", [
    RIGHT_WEIGHTS7, RIGHT_WEIGHTS7.tolist(),
    kvlib.attention_weights(*(kvlib.split_heads(M, 2)[1] for M in kvlib.project_qkv(
        kvlib.embed(np.array([0, 5, 2, 4, 11, 1, 9]), kvlib.init_params().embedding),
        kvlib.init_params().layers[0])[:2]), MASK7),
    (lambda e: e / e.sum(axis=1, keepdims=True))(np.exp(SCORES7[1]) * MASK7),
])
def test_masked_weights_right_answers(answer):
    correct(exercises.check_masked_weights(answer))


# Exercise 3: which rows change when "are" (position 2) becomes "fine"

@pytest.mark.parametrize("answer, words", [
    ("2, 3, 4", "not text"),
    ([2.5, 3], "2.5 is not a whole number: it is 0.5 from the nearest one"),
    ([2, 3, 4, 5], "numbered 0 to 4"),
    ([-1], "numbered 0 to 4"),
    ([1, 2, 3, 4], "row(s) [1] come before position 2"),
    ([0, 1, 2, 3, 4], "row(s) [0, 1] come before position 2"),
    (range(5), "row(s) [0, 1] come before position 2"),
    ([3, 4], "row 2 changes too"),
    ([2, 3], "row(s) [4] also change"),
    (np.array(2), "row(s) [3, 4] also change"),
    (2, "row(s) [3, 4] also change"),
    ([], "no row at all"),
    (np.array([True, False]), "one entry per row"),
    ([True, 2], "a bool"),
])
def test_changed_rows_wrong_answers(answer, words):
    not_yet(exercises.check_changed_rows(answer), words)


@pytest.mark.parametrize("answer", [
    [2, 3, 4], (4, 3, 2), np.array([2, 3, 4]), {2, 3, 4}, range(2, 5), [2.0, 3.0, 4.0],
    [np.int64(2), 3, 4], [2, 2, 3, 4], np.where(np.arange(5) >= 2),
    np.flatnonzero(np.arange(5) >= 2), np.arange(5) >= 2, list(range(2, 5)),
])
def test_changed_rows_right_answers(answer):
    correct(exercises.check_changed_rows(answer))


def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("causal_masking"), exercises,
                          {1: exercises.check_mask, 2: exercises.check_masked_weights,
                           3: exercises.check_changed_rows})
