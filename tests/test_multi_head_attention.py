"""Notebook 04 (multi-head attention): its widgets driven headless (the head explorer's
column frames and weights, the head-count explorer's heatmaps, bounded in what they draw;
nothing leaks: every test leaves the figures as it found them), and its exercise checkers,
with tables of typical wrong answers (each with its diagnosis) and of valid answers in other
forms, and the published solutions run in the notebook's own variables."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import image_of, no_new_figures

import kvlib
from kvlib.exercises import multi_head_attention as exercises
from kvlib.widgets import multi_head_attention as widgets

pytestmark = pytest.mark.usefixtures("no_figure_leaks")

IDS = [0, 3, 7, 1, 9]


# ---------------------------------------------------------------------------------------------
# The widgets
# ---------------------------------------------------------------------------------------------

def frames(ax, color):
    return [p for p in ax.patches if not p.get_fill()
            and matplotlib.colors.same_color(p.get_edgecolor(), color)]


def test_head_columns_frames_each_head_and_rejects_bad_splits():
    Q = np.arange(20.0).reshape(5, 4)
    fig, ax = plt.subplots()
    try:
        widgets.head_columns(Q, 2, list("abcde"), ax=ax, highlight=1)
        red = frames(ax, widgets.FRAME_COLOR)
        assert len(red) == 1 and red[0].get_x() == 1.5 and red[0].get_width() == 2
        assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("head")) == [
            "head 0", "head 1"]
        with pytest.raises(ValueError, match="cannot split 4 columns into 3"):
            widgets.head_columns(Q, 3, ax=ax)
        with pytest.raises(ValueError, match="highlight must be a head between 0 and 1"):
            widgets.head_columns(Q, 2, ax=ax, highlight=2)
    finally:
        plt.close(fig)


def test_layer_inputs_are_the_stream_entering_each_block(params):
    inputs = widgets.layer_inputs(params, IDS)
    assert len(inputs) == 3
    X = kvlib.embed(np.array(IDS), params.embedding)
    for layer, X_in in zip(params.layers, inputs):
        np.testing.assert_array_equal(X_in, X)
        X = kvlib.decoder_block(X, layer, 2, mask=kvlib.causal_mask(5))


def test_head_explorer_shows_the_chosen_head(params):
    box = widgets.head_explorer(params)
    left, right = box.figure.axes
    X = kvlib.embed(np.array(IDS), params.embedding)
    Q, _, _ = kvlib.project_qkv(X, params.layers[0])
    np.testing.assert_array_equal(box.state["head_slice"], Q[:, 0:2])
    np.testing.assert_allclose(image_of(left), Q)
    assert frames(left, widgets.FRAME_COLOR)[0].get_x() == -0.5

    box.controls["head"].value = 1
    np.testing.assert_array_equal(box.state["head_slice"], Q[:, 2:4])
    assert frames(left, widgets.FRAME_COLOR)[0].get_x() == 1.5
    assert "columns 2:4" in box.status.value

    box.controls["layer"].value = 2
    record = []
    kvlib.forward(params, IDS, record_attention=record)
    np.testing.assert_allclose(image_of(right).data, record[2][1])
    Q2 = widgets.layer_inputs(params, IDS)[2] @ params.layers[2].Wq
    np.testing.assert_allclose(box.state["Q"], Q2)
    assert right.get_title() == "Layer 2, head 1: weights (5, 5)"


def test_head_explorer_reports_a_bad_prompt_and_does_not_leak(params):
    box = widgets.head_explorer(params)
    box.controls["prompt"].value = "How are zebras?"
    assert "unknown word" in box.message.value and box.status.value == ""
    box.controls["prompt"].value = "How are you? I am fine."
    assert box.message.value == "" and box.state["Q"].shape == (9, 4)
    with no_new_figures():
        for step in range(24):
            box.controls["layer"].value = step % 3
            box.controls["head"].value = (step // 3) % 2
    assert len(box.figure.axes) == 2


def test_split_for_heads_cuts_the_same_q(params):
    Q1, _ = widgets.split_for_heads(IDS, 1)
    for count in (1, 2, 4, 8):
        Q, weights = widgets.split_for_heads(IDS, count)
        np.testing.assert_array_equal(Q, Q1)
        assert weights.shape == (count, 5, 5)
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0)
        assert np.all(weights[:, kvlib.causal_mask(5) == 0] == 0)
    with pytest.raises(ValueError, match=r"divisible by n_heads \(3\)"):
        widgets.split_for_heads(IDS, 3)


def test_head_count_explorer_redraws_one_heatmap_per_head():
    box = widgets.head_count_explorer(n_heads=2)
    Q = box.state["Q"]
    for count in (1, 2, 4, 8):
        box.controls["heads"].value = count
        assert box.state["head_dim"] == 8 // count
        assert len(box.figure.axes) == 1 + count          # Q and one heatmap per head
        np.testing.assert_array_equal(box.state["Q"], Q)
        heads = [t.get_text() for t in box.figure.axes[0].texts if t.get_text().startswith("h")]
        short = count == 8                                  # one column per head: "h0".."h7"
        assert heads == [f"h{h}" if short else f"head {h}" for h in range(count)]
        assert f"head_dim {8 // count}" in box.status.value
    box.controls["heads"].value = 3
    assert "must be divisible by n_heads (3)" in box.message.value
    assert box.status.value == "" and box.state["head_dim"] == 1   # the last good drawing stays
    box.controls["heads"].value = 4
    assert box.message.value == "" and len(box.figure.axes) == 5


def figure_artists(figure):
    """Everything an update draws: each axes' children and tick labels, the figure's texts."""
    return sum(len(ax.get_children()) + len(ax.get_xticklabels()) + len(ax.get_yticklabels())
               for ax in figure.axes) + len(figure.texts)


def test_head_count_explorer_draws_a_bounded_number_of_artists():
    """8 heads on a 32-token prompt took 5.9 s per update when every masked cell was its own
    hatched patch (3,968 of them). What it draws must not grow with the masked cells: one
    hatch patch per heatmap and a few token labels, so an update is as fast as at 5 tokens.
    Counted, not timed: a timing would fail on a busy machine."""
    box = widgets.head_count_explorer(n_heads=8)
    short = figure_artists(box.figure)
    box.controls["prompt"].value = "How are you? I am fine and you? " * 3 + "I"
    assert len(box.state["ids"]) == 32 and box.message.value == ""
    heatmaps = box.figure.axes[1:]
    assert len(heatmaps) == 8
    for ax in heatmaps:
        assert len(ax.patches) == 1 and len(ax.images) == 1          # weights, one hatch
        assert len(ax.get_xticklabels()) <= 8 and len(ax.get_yticklabels()) <= 8
    assert figure_artists(box.figure) <= short + 40 and figure_artists(box.figure) < 300
    labels = [t for t in box.figure.axes[0].texts if t.get_text().startswith("h")]
    assert [t.get_text() for t in labels] == [f"h{h}" for h in range(8)]
    assert box.figure.axes[0].get_aspect() == "auto"       # Q is not a thin strip of 32 rows


def test_head_count_explorer_does_not_leak():
    box = widgets.head_count_explorer()
    with no_new_figures():
        for step in range(24):
            box.controls["heads"].value = 1 + step % 8


# ---------------------------------------------------------------------------------------------
# The exercise checkers: typical wrong answers, each with its diagnosis; valid answers
# ---------------------------------------------------------------------------------------------

# Exercise 1: head 2's columns of a (5, 12) Q with 3 heads

Q12 = exercises.practice_queries()


@pytest.mark.parametrize("answer, words", [
    (Q12[8:12], "you took rows"),
    (Q12[2:3], "you took rows"),
    (Q12[:, 4:8], "head 1's slice"),
    (Q12[:, 0:4], "head 0's slice"),
    (Q12[:, 2:6], "not at column h"),
    (Q12.reshape(3, 5, 4)[2], "mixes tokens"),
    (Q12[:, 2::3], "next to each other"),
    (Q12[:, 6:12], "6 columns would be 2 heads"),
    (Q12[:, 4:6], "head_dim is 2 in the notebook's model"),
    (Q12, "shape (5, 4)"),
    (Q12[:, 8:12] * 2, "not the right values"),
])
def test_head_slice_wrong_answers(answer, words):
    not_yet(exercises.check_head_slice(answer), words)


@pytest.mark.parametrize("answer", [Q12[:, 8:12], Q12[:, -4:], Q12[:, 8:12].tolist(),
                                    kvlib.split_heads(Q12, 3)[2], Q12.reshape(5, 3, 4)[:, 2]])
def test_head_slice_right_answers(answer):
    correct(exercises.check_head_slice(answer))


# Exercise 2: np.arange(30).reshape(5, 6) split into 3 heads

M30 = np.arange(30).reshape(5, 6)


@pytest.mark.parametrize("answer, words", [
    (M30.reshape(3, 5, 2), "M.reshape(3, 5, 2)"),
    (M30.reshape(5, 3, 2), "transpose(1, 0, 2)"),
    (M30.reshape(5, 3, 2).transpose(1, 2, 0), "other two axes are in the wrong order"),
    (M30.reshape(5, 2, 3).transpose(1, 0, 2), "2 heads of 3 columns"),
    (M30.reshape(3, 10), "shape (3, 5, 2)"),
    (M30.reshape(5, 3, 2).transpose(1, 0, 2) + 1, "not the right values"),
])
def test_three_heads_wrong_answers(answer, words):
    not_yet(exercises.check_three_heads(answer), words)


@pytest.mark.parametrize("answer", [
    M30.reshape(5, 3, 2).transpose(1, 0, 2), np.stack([M30[:, 2 * h:2 * h + 2] for h in range(3)]),
    [M30[:, 2 * h:2 * h + 2].tolist() for h in range(3)], kvlib.split_heads(M30, 3),
    np.array(np.split(M30, 3, axis=1)), M30.reshape(5, 3, 2).swapaxes(0, 1).astype(float),
])
def test_three_heads_right_answers(answer):
    correct(exercises.check_three_heads(answer))


# Exercise 3: from the heads of "I am fine and you?" to the attention output

HEADS7 = exercises.practice_heads()
WO = kvlib.init_params().layers[0].Wo
CONCATENATED7 = kvlib.merge_heads(HEADS7)


@pytest.mark.parametrize("answer, words", [
    (CONCATENATED7, "output projection is still missing"),
    (HEADS7.reshape(7, 4) @ WO, "heads.reshape(7, 4)"),
    (HEADS7.reshape(7, 4), "Wo is still missing"),
    (HEADS7.sum(axis=0), "not added"),
    (WO @ CONCATENATED7.T, "rows must stay tokens"),
    (CONCATENATED7 @ WO.T, "Wo is transposed"),
    (np.zeros((5, 4)), "the notebook's prompt"),
    (CONCATENATED7 @ WO + 1, "not the right values"),
])
def test_attention_output_wrong_answers(answer, words):
    not_yet(exercises.check_attention_output(answer), words)


@pytest.mark.parametrize("answer", [
    CONCATENATED7 @ WO, np.hstack(list(HEADS7)) @ WO, np.concatenate(HEADS7, axis=1) @ WO,
    sum(HEADS7[h] @ WO[2 * h:2 * h + 2] for h in range(2)), (CONCATENATED7 @ WO).tolist(),
])
def test_attention_output_right_answers(answer):
    correct(exercises.check_attention_output(answer))


def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("multi_head_attention"), exercises,
                          {1: exercises.check_head_slice, 2: exercises.check_three_heads,
                           3: exercises.check_attention_output})
