"""Notebook 01 (tokens and the embedding lookup): its lookup explorer driven headless (the
sentence box and the token dropdown change the ids, the rows of X and the outlined table rows;
bad input gives a message and no exception; nothing leaks), and its exercise checkers, with
tables of typical wrong answers (each with its diagnosis) and of valid answers in other forms,
and the published solutions run in the notebook's own variables."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import no_new_figures

import kvlib
from kvlib import plots
from kvlib.exercises import embedding_lookup as exercises
from kvlib.widgets import embedding_lookup as widgets

ARTICLE_IDS = [0, 3, 7, 1, 9]
TABLE = kvlib.init_params().embedding
SENTENCE_IDS = [0, 5, 2, 4, 8]


def outlined_rows(ax, color):
    """Rows of a heatmap outlined by a Rectangle of the given edge colour."""
    return sorted(int(round(p.get_y() + 0.5)) for p in ax.patches
                  if matplotlib.colors.same_color(p.get_edgecolor(), color))


# ---------------------------------------------------------------------------------------------
# The lookup explorer
# ---------------------------------------------------------------------------------------------

def test_lookup_explorer_starts_on_the_article_prompt(params):
    explorer = widgets.embedding_explorer(params)
    table_ax, x_ax = explorer.axes
    assert explorer.shown["ids"] == ARTICLE_IDS
    np.testing.assert_array_equal(table_ax.images[0].get_array(), params.embedding)
    np.testing.assert_array_equal(x_ax.images[0].get_array(), params.embedding[ARTICLE_IDS])
    assert [t.get_text() for t in x_ax.get_yticklabels()] == [
        "0: <bos>", "1: How", "2: are", "3: you", "4: ?"]
    assert outlined_rows(table_ax, widgets.PROMPT_ROW_COLOR) == sorted(ARTICLE_IDS)
    # the two matrices share one colour scale, so a copied row keeps its colours
    assert table_ax.images[0].get_clim() == x_ax.images[0].get_clim()
    assert "&lt;bos&gt;<br><b>0</b>" in explorer.ids_view.value
    assert explorer.status.value == ""


def test_typing_a_sentence_shows_its_ids_and_rows(params):
    explorer = widgets.embedding_explorer(params)
    explorer.sentence.value = "I am fine."
    ids = [0, 5, 2, 4, 8]
    assert explorer.shown["ids"] == ids
    table_ax, x_ax = explorer.axes
    np.testing.assert_array_equal(x_ax.images[0].get_array(), params.embedding[ids])
    assert outlined_rows(table_ax, widgets.PROMPT_ROW_COLOR) == sorted(ids)
    assert x_ax.get_title() == "X = table[ids] (5, 4)"
    for token_id in ids:
        assert f"<b>{token_id}</b>" in explorer.ids_view.value
    # one line from each table row to its row of X
    lines = [p for p in x_ax.patches if isinstance(p, matplotlib.patches.ConnectionPatch)]
    assert len(lines) == 5


def test_the_dropdown_outlines_the_picked_token(params):
    explorer = widgets.embedding_explorer(params)
    explorer.token.value = 10
    table_ax = explorer.axes[0]
    assert outlined_rows(table_ax, widgets.SELECTED_ROW_COLOR) == [10]
    assert "<code>good</code>" in explorer.row_view.value
    assert "does not use it" in explorer.row_view.value
    explorer.sentence.value = "you and you?"
    explorer.token.value = 1
    assert outlined_rows(explorer.axes[0], widgets.SELECTED_ROW_COLOR) == [1]
    assert "position(s) [1, 3]" in explorer.row_view.value


@pytest.mark.parametrize("text, message", [
    ("Hello there", "unknown word(s) ['Hello', 'there']"),
    ("<script>", "unknown word(s) ['&lt;', 'script', '&gt;']"),
    ("you " * 12, "at most 12 fit"),
])
def test_a_bad_sentence_shows_a_message_and_keeps_the_picture(params, text, message):
    explorer = widgets.embedding_explorer(params)
    explorer.sentence.value = text          # must not raise
    assert message in explorer.status.value
    assert explorer.status.value.startswith("<b>Cannot show this:</b>")
    assert explorer.shown["ids"] == ARTICLE_IDS
    np.testing.assert_array_equal(explorer.axes[1].images[0].get_array(),
                                  params.embedding[ARTICLE_IDS])
    explorer.sentence.value = "good"
    assert explorer.status.value == "" and explorer.shown["ids"] == [0, 10]


def test_lookup_explorer_leaks_no_figures(params):
    explorer = widgets.embedding_explorer(params)
    sentences = ["I am fine.", "nonsense", "you and you?", "How are you?", "good thanks"]
    with no_new_figures():
        for step in range(20):
            explorer.sentence.value = sentences[step % len(sentences)]
            explorer.token.value = step % 12
    assert len(explorer.figure.axes) == 2
    assert len(explorer.axes[0].patches) <= len(kvlib.TOY_VOCABULARY) + 1


def test_lookup_explorer_rejects_bad_arguments(params):
    with pytest.raises(ValueError, match="unknown word"):
        widgets.embedding_explorer(params, text="Hello")
    with pytest.raises(ValueError, match="selected"):
        widgets.embedding_explorer(params, selected=12)
    with pytest.raises(ValueError, match="2-D"):
        plots.matrix_heatmap(np.zeros(3), ax=plt.figure().gca(), vmin=0, vmax=1)
    with pytest.raises(ValueError, match="between 0 and 11"):
        widgets.lookup_figure(params.embedding, [0, 12], kvlib.TOY_VOCABULARY)
    with pytest.raises(ValueError, match="between 0 and 11"):
        widgets.lookup_figure(params.embedding, [0, 1], kvlib.TOY_VOCABULARY, selected=-1)
    with pytest.raises(TypeError, match="whole numbers"):
        widgets.lookup_figure(params.embedding, [0.5], kvlib.TOY_VOCABULARY)
    with pytest.raises(ValueError, match="one row per vocabulary token"):
        widgets.lookup_figure(params.embedding, [0], kvlib.TOY_VOCABULARY[:5])


def test_lookup_figure_draws_both_matrices(params):
    figure = widgets.lookup_figure(params.embedding, ARTICLE_IDS, kvlib.TOY_VOCABULARY, 5)
    table_ax, x_ax = figure.axes[:2]
    assert outlined_rows(table_ax, widgets.SELECTED_ROW_COLOR) == [5]
    assert x_ax.images[0].get_array().shape == (5, 4)


# ---------------------------------------------------------------------------------------------
# Exercise 1: X for "I am fine."; 2: the one-hot matrix of "and you?"; 3: GPT-2's table size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, words", [
    (TABLE[SENTENCE_IDS[1:]], "BOS row is missing"),
    (TABLE[SENTENCE_IDS].T, "transposed"),
    (TABLE[ARTICLE_IDS], "X for 'How are you?'"),
    (TABLE[[0, 2, 5, 4, 8]], "row 1 of X is the row of token 2 ('am'), but position 1 of "
                             "'I am fine.' holds token 5 ('I')"),
    (TABLE[SENTENCE_IDS] + 1, "not a row of the table"),
    (np.zeros((5, 3)), "shape (5, 4)"),
    (TABLE[SENTENCE_IDS].tolist()[:4], "your list read as a numpy array"),
    ([[1.0, 2.0], [3.0]], "different lengths"),
    ("table[ids]", "got text"),
    (np.full((5, 4), "x"), "should hold numbers"),
])
def test_sentence_embedding_wrong_answers(answer, words):
    not_yet(exercises.check_sentence_embedding(answer), words)


@pytest.mark.parametrize("answer", [
    TABLE[SENTENCE_IDS], TABLE[SENTENCE_IDS].tolist(), tuple(map(tuple, TABLE[SENTENCE_IDS])),
    kvlib.embed(np.array(SENTENCE_IDS), TABLE), np.eye(12)[SENTENCE_IDS] @ TABLE,
    TABLE[SENTENCE_IDS].astype(object), np.asarray(TABLE[SENTENCE_IDS], dtype=np.float32),
])
def test_sentence_embedding_right_answers(answer):
    correct(exercises.check_sentence_embedding(answer))


def one_hot(rows, columns=12):
    matrix = np.zeros((len(rows), columns))
    matrix[np.arange(len(rows)), rows] = 1
    return matrix


RIGHT_ONE_HOT = one_hot([0, 11, 1, 9])
TWO_ONES = RIGHT_ONE_HOT.copy()
TWO_ONES[2, 5] = 1


@pytest.mark.parametrize("answer, words", [
    (RIGHT_ONE_HOT.T, "transposed"),
    (one_hot([11, 1, 9]), "BOS token"),
    (one_hot(ARTICLE_IDS), "one-hot matrix of 'How are you?'"),
    (TABLE[[0, 11, 1, 9]], "this is X"),
    (2 * RIGHT_ONE_HOT, "only 0s and 1s"),
    (TWO_ONES, "row 2 has 2 ones"),
    (one_hot([0, 1, 1, 9]), "row 1 has its 1 in column 1 ('you'), but position 1 of 'and you?' "
                            "holds token 11"),
    (np.zeros((4, 5)), "shape (4, 12)"),
    ([0, 11, 1, 9], "shape (4, 12)"),
    (np.full((4, 12), None), "should hold numbers"),
])
def test_one_hot_wrong_answers(answer, words):
    not_yet(exercises.check_one_hot(answer), words)


@pytest.mark.parametrize("answer", [
    RIGHT_ONE_HOT, RIGHT_ONE_HOT.tolist(), RIGHT_ONE_HOT.astype(bool), RIGHT_ONE_HOT.astype(int),
    np.eye(12)[[0, 11, 1, 9]], (np.arange(12) == np.array([[0], [11], [1], [9]])),
])
def test_one_hot_right_answers(answer):
    correct(exercises.check_one_hot(answer))


@pytest.mark.parametrize("answer, words", [
    (50257 + 768, "rows PLUS columns"), (50257, "one side"), (768, "one side"),
    (50257 * 768 * 4, "bytes"), (50257 * 768 * 2, "bytes"),
    (50257 * 768 + 1024 * 768, "position table"), (124_439_808, "every weight of GPT-2"),
    (38_600_000, "close (2,624 off)"), (3.86e7, "close"), (38_597_376.5, "close (0.5 from"),
    (1000, "not vocab_size x d_model"), ("38597376", "not text"), (3.5, "whole number"),
    (True, "a bool"), (10**400, "401 digits: far too large"), (float("nan"), "got nan"),
])
def test_gpt2_table_size_wrong_answers(answer, words):
    not_yet(exercises.check_gpt2_table_size(answer), words)


@pytest.mark.parametrize("answer", [38_597_376, 38597376.0, np.int64(38_597_376),
                                    np.array(38_597_376), 50257 * 768])
def test_gpt2_table_size_right_answers(answer):
    correct(exercises.check_gpt2_table_size(answer))


def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("embedding_lookup"), exercises,
                          {1: exercises.check_sentence_embedding, 2: exercises.check_one_hot,
                           3: exercises.check_gpt2_table_size})
