"""Notebook 02 (one attention head): its attention explorer driven headless (the query, the
head, scaling and temperature change the weights shown; a bad sentence gives a message and no
exception; nothing leaks), and its exercise checkers, with tables of typical wrong answers
(each with its diagnosis) and of valid answers in other forms, and the published solutions
run in the notebook's own variables."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import no_new_figures

import kvlib
from kvlib.exercises import one_attention_head as exercises
from kvlib.widgets import one_attention_head as widgets

TOKENIZER = kvlib.ToyTokenizer()
ARTICLE_IDS = [0, 3, 7, 1, 9]
TABLE = kvlib.init_params().embedding


def head_of_layer0(params, ids, head):
    X = kvlib.embed(np.array(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    return kvlib.split_heads(Q, 2)[head], kvlib.split_heads(K, 2)[head]


# ---------------------------------------------------------------------------------------------
# The attention explorer
# ---------------------------------------------------------------------------------------------

def query_row_bars(ax):
    """The heights of every bar drawn on the query row's Axes (all of them: none may pile up)."""
    return np.array([p.get_height() for p in ax.patches
                     if isinstance(p, matplotlib.patches.Rectangle) and p.get_width() == 0.8])


def test_attention_explorer_starts_on_head_0_without_mask(params):
    explorer = widgets.attention_explorer(params)
    Qh, Kh = head_of_layer0(params, ARTICLE_IDS, 0)
    expected = kvlib.attention_weights(Qh, Kh)          # no mask
    np.testing.assert_allclose(explorer.shown["weights"], expected)
    heat_ax, bar_ax = explorer.axes
    np.testing.assert_allclose(heat_ax.images[0].get_array(), expected)
    np.testing.assert_allclose(query_row_bars(bar_ax), expected[0])
    assert explorer.query.value == 0
    assert "&lt;bos&gt;" in explorer.summary.value
    assert f"{1 - expected[0, 0]:.3f} of its weight" in explorer.summary.value


def test_picking_a_query_shows_its_row(params):
    explorer = widgets.attention_explorer(params)
    explorer.query.value = 3
    weights = explorer.shown["weights"]
    bar_ax = explorer.axes[1]
    np.testing.assert_allclose(query_row_bars(bar_ax), weights[3])
    hatched = [bool(p.get_hatch()) for p in bar_ax.patches if p.get_width() == 0.8]
    assert hatched == [False, False, False, False, True]   # only "?" comes after "you"
    assert "attends most to <b>?</b> (position 4)" in explorer.summary.value
    explorer.query.value = 4
    assert "every key is at or before it" in explorer.summary.value


def test_head_scaling_and_temperature_change_the_weights(params):
    explorer = widgets.attention_explorer(params)
    explorer.head.value = 1
    Qh, Kh = head_of_layer0(params, ARTICLE_IDS, 1)
    np.testing.assert_allclose(explorer.shown["weights"], kvlib.attention_weights(Qh, Kh))
    explorer.scaled.value = False
    np.testing.assert_allclose(explorer.shown["weights"], kvlib.softmax(Qh @ Kh.T))
    assert "NOT divided" in explorer.axes[1].get_title()
    explorer.scaled.value = True
    plain = explorer.shown["weights"]
    explorer.temperature.value = 0.05
    scores = kvlib.attention_scores(Qh, Kh)
    sharp = explorer.shown["weights"]
    np.testing.assert_allclose(sharp, kvlib.softmax(scores / 0.05))
    assert (sharp.max(axis=1) > plain.max(axis=1)).all()     # every row sharpens
    assert (sharp.max(axis=1) > 0.99).sum() >= 3             # most rows are nearly one-hot
    explorer.temperature.value = 10.0
    assert explorer.shown["weights"].max() < 0.25                # rows near uniform


def test_each_rows_strongest_key_is_framed(params):
    explorer = widgets.attention_explorer(params)
    frames = explorer.axes[0].collections[0]
    centres = [tuple(np.round(path.vertices[:4].mean(axis=0)).astype(int)) for path in
               frames.get_paths()]
    weights = explorer.shown["weights"]
    assert centres == [(int(np.argmax(row)), r) for r, row in enumerate(weights)]


def test_typing_a_sentence_updates_the_queries(params):
    explorer = widgets.attention_explorer(params, query=4)
    explorer.sentence.value = "I am fine"
    ids = [0, 5, 2, 4]
    assert [value for _, value in explorer.query.options] == [0, 1, 2, 3]
    assert explorer.query.value == 3                # clamped to the new last position
    Qh, Kh = head_of_layer0(params, ids, 0)
    np.testing.assert_allclose(explorer.shown["weights"], kvlib.attention_weights(Qh, Kh))
    assert [t.get_text() for t in explorer.axes[0].get_yticklabels()] == ["<bos>", "I", "am",
                                                                          "fine"]


@pytest.mark.parametrize("text, message", [
    ("How are you today?", "unknown word(s) ['today']"),
    ("you " * 10, "at most 10 fit"),
])
def test_attention_explorer_bad_sentence_shows_a_message(params, text, message):
    explorer = widgets.attention_explorer(params)
    before = explorer.shown["weights"].copy()
    explorer.sentence.value = text
    assert message in explorer.status.value
    np.testing.assert_array_equal(explorer.shown["weights"], before)
    assert len(explorer.query.options) == 5
    explorer.query.value = 2                        # still works after the error
    assert explorer.status.value == ""


def test_attention_explorer_leaks_no_figures(params):
    explorer = widgets.attention_explorer(params)
    with no_new_figures():
        for step in range(20):
            explorer.query.value = step % 5
            explorer.head.value = step % 2
            explorer.scaled.value = step % 3 == 0
            explorer.temperature.value = [0.05, 1.0, 5.0][step % 3]
            if step % 7 == 0:
                explorer.sentence.value = ["How are you?", "bad input", "I am fine"][step % 3]
                explorer.sentence.value = "How are you?"
    assert len(explorer.figure.axes) == 2


@pytest.mark.parametrize("kwargs, error", [
    ({"temperature": 0.0}, ValueError), ({"temperature": -1.0}, ValueError),
    ({"temperature": float("nan")}, ValueError), ({"temperature": "hot"}, ValueError),
    ({"head": 2}, ValueError), ({"layer": 3}, ValueError),
])
def test_head_weights_rejects_bad_values(params, kwargs, error):
    with pytest.raises(error):
        widgets.head_weights(params, ARTICLE_IDS, **kwargs)


@pytest.mark.parametrize("kwargs", [{"head": 2}, {"layer": -1}, {"query": 5}, {"text": "Hi"}])
def test_attention_explorer_rejects_bad_arguments(params, kwargs):
    with pytest.raises(ValueError):
        widgets.attention_explorer(params, **kwargs)


def test_draw_query_row_rejects_a_query_outside_the_sentence():
    weights = np.full((3, 3), 1 / 3)
    figure, axes = plt.subplots(1, 2)
    with pytest.raises(ValueError, match="between 0 and 2"):
        widgets.draw_query_row(*axes, weights, ["a", "b", "c"], query=3)

# ---------------------------------------------------------------------------------------------
# Exercises 1 and 2: head 1's raw and scaled scores; 3: the strongest key on another prompt
# ---------------------------------------------------------------------------------------------

X_ARTICLE = kvlib.embed(np.array(ARTICLE_IDS), TABLE)
Q0, K0, _ = kvlib.project_qkv(X_ARTICLE, kvlib.init_params().layers[0])
RAW1 = Q0[:, 2:] @ K0[:, 2:].T
RAW0 = Q0[:, :2] @ K0[:, :2].T


@pytest.mark.parametrize("answer, words", [
    (RAW0, "head 0's scores"),
    (Q0 @ K0.T, "all 4 columns"),
    (RAW1.T, "swapped"),
    (Q0[:, 2:].T @ K0[:, 2:], "Q_h.T @ K_h"),
    (RAW1 / np.sqrt(2), "divided by 1.41 already"),
    (RAW1 + 1, "right shape but not the right values"),
    (RAW1[:4], "shape (5, 5)"),
])
def test_head1_scores_wrong_answers(answer, words):
    not_yet(exercises.check_head1_scores(answer), words)


@pytest.mark.parametrize("answer", [RAW1, RAW1.tolist(), np.round(RAW1, 3),
                                    Q0[:, 2:4] @ K0[:, 2:4].T, np.einsum("ic,jc->ij", Q0[:, 2:],
                                                                         K0[:, 2:])])
def test_head1_scores_right_answers(answer):
    correct(exercises.check_head1_scores(answer))


@pytest.mark.parametrize("answer, words", [
    (RAW1, "not scaled yet"),
    (RAW1 / 2, "square root of ONE head's size"),
    (RAW1 * np.sqrt(2), "multiplied"),
    (RAW1 / 1.4, "divided head 1's scores by 1.4;"),
    (RAW1 / 1.42, "by 1.42;"),
    (RAW0 / np.sqrt(2), "head 0's scores"),
    (RAW0 / 1.41, "head 0's scores"),
    (Q0 @ K0.T / np.sqrt(2), "all 4 columns"),
    (RAW1.T / 1.414, "swapped"),
    (RAW1 / np.sqrt(2) + 0.1, "right shape but not the right values"),
])
def test_head1_scaled_scores_wrong_answers(answer, words):
    not_yet(exercises.check_head1_scaled_scores(answer), words)


@pytest.mark.parametrize("answer", [
    RAW1 / np.sqrt(2), RAW1 / 1.414, RAW1 / 1.41, RAW1 / 2 ** 0.5, RAW1 * (1 / np.sqrt(2)),
    (RAW1 / 1.41).tolist(), np.round(RAW1 / np.sqrt(2), 3),
    kvlib.attention_scores(Q0[:, 2:], K0[:, 2:]),
])
def test_head1_scaled_scores_right_answers(answer):
    correct(exercises.check_head1_scaled_scores(answer))


def test_strongest_key_case_tells_row_from_column():
    Q, K, _ = kvlib.project_qkv(kvlib.embed(np.array(TOKENIZER.encode("I am fine and you?")),
                                            TABLE), kvlib.init_params().layers[0])
    weights = kvlib.attention_weights(Q[:, 2:], K[:, 2:])
    head0 = kvlib.attention_weights(Q[:, :2], K[:, :2])
    row, column, other = (int(np.argmax(weights[4])), int(np.argmax(weights[:, 4])),
                          int(np.argmax(head0[4])))
    assert len({row, column, other, 4}) == 4      # every misreading gives another position
    assert row > 4                                # the strongest key is in the future
    assert np.sort(weights[4])[-1] - np.sort(weights[4])[-2] > 0.15   # a clear winner


@pytest.mark.parametrize("answer, words", [
    (0, "COLUMN 4"),
    (6, "head 0's strongest key"),
    (4, "'and' itself"),
    (3, "another key gets more"),
    (7, "positions 0 to 6"),
    ("you", "not its word"),
    (np.array([5, 5]), "one position"),
    (4.9, "close (0.1 from the answer)"),
    (5.5, "whole number"),
])
def test_strongest_key_wrong_answers(answer, words):
    not_yet(exercises.check_strongest_key(answer), words)


@pytest.mark.parametrize("answer", [5, 5.0, np.int64(5), np.array(5)])
def test_strongest_key_right_answers(answer):
    correct(exercises.check_strongest_key(answer), "AFTER 'and'")


def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("one_attention_head"), exercises,
                          {1: exercises.check_head1_scores, 2: exercises.check_head1_scaled_scores,
                           3: exercises.check_strongest_key})
