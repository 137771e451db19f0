"""Notebooks 00-02: their widgets, driven headless, and their exercise checkers.

Widgets: set a control's value (observers fire at once) and check what the figure and the HTML
show; bad input gives a message and no exception; nothing leaks. Checkers: a table of typical
wrong answers, each with its specific "Not yet" diagnosis, a table of valid answers in other
forms that must pass, odd input (text, nan, 10**400, ragged lists) answered in words, and each
published solution, executed after the notebook's own code, passes.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from checker_cases import (  # noqa: E402
    assert_answers_in_words,
    assert_correct,
    assert_not_yet,
    case_id,
    odd_answers,
    student_answers,
)
from hypothesis import given, settings  # noqa: E402

import kvlib  # noqa: E402
from kvlib import plots  # noqa: E402
from kvlib.exercises import big_picture as lesson00  # noqa: E402
from kvlib.exercises import embedding_lookup as lesson01
from kvlib.exercises import one_attention_head as lesson02
from kvlib.widgets import embedding_lookup as widgets01  # noqa: E402
from kvlib.widgets import one_attention_head as widgets02  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TOKENIZER = kvlib.ToyTokenizer()
ARTICLE_IDS = [0, 3, 7, 1, 9]


@pytest.fixture(scope="module")
def params():
    return kvlib.init_params()


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def head_of_layer0(params, ids, head):
    X = kvlib.embed(np.array(ids), params.embedding)
    Q, K, V = kvlib.project_qkv(X, params.layers[0])
    return kvlib.split_heads(Q, 2)[head], kvlib.split_heads(K, 2)[head]


def outlined_rows(ax, color):
    """Rows of a heatmap outlined by a Rectangle of the given edge colour."""
    return sorted(int(round(p.get_y() + 0.5)) for p in ax.patches
                  if matplotlib.colors.same_color(p.get_edgecolor(), color))


# ----------------------------------------------------------------------------------------
# Notebook 01's widget


def test_lookup_explorer_starts_on_the_article_prompt(params):
    explorer = widgets01.embedding_explorer(params)
    table_ax, x_ax = explorer.axes
    assert explorer.shown["ids"] == ARTICLE_IDS
    np.testing.assert_array_equal(table_ax.images[0].get_array(), params.embedding)
    np.testing.assert_array_equal(x_ax.images[0].get_array(), params.embedding[ARTICLE_IDS])
    assert [t.get_text() for t in x_ax.get_yticklabels()] == [
        "0: <bos>", "1: How", "2: are", "3: you", "4: ?"]
    assert outlined_rows(table_ax, widgets01.PROMPT_ROW_COLOR) == sorted(ARTICLE_IDS)
    # the two matrices share one colour scale, so a copied row keeps its colours
    assert table_ax.images[0].get_clim() == x_ax.images[0].get_clim()
    assert "&lt;bos&gt;<br><b>0</b>" in explorer.ids_view.value
    assert explorer.status.value == ""


def test_typing_a_sentence_shows_its_ids_and_rows(params):
    explorer = widgets01.embedding_explorer(params)
    explorer.sentence.value = "I am fine."
    ids = [0, 5, 2, 4, 8]
    assert explorer.shown["ids"] == ids
    table_ax, x_ax = explorer.axes
    np.testing.assert_array_equal(x_ax.images[0].get_array(), params.embedding[ids])
    assert outlined_rows(table_ax, widgets01.PROMPT_ROW_COLOR) == sorted(ids)
    assert x_ax.get_title() == "X = table[ids] (5, 4)"
    for token_id in ids:
        assert f"<b>{token_id}</b>" in explorer.ids_view.value
    # one line from each table row to its row of X
    lines = [p for p in x_ax.patches if isinstance(p, matplotlib.patches.ConnectionPatch)]
    assert len(lines) == 5


def test_the_dropdown_outlines_the_picked_token(params):
    explorer = widgets01.embedding_explorer(params)
    explorer.token.value = 10
    table_ax = explorer.axes[0]
    assert outlined_rows(table_ax, widgets01.SELECTED_ROW_COLOR) == [10]
    assert "<code>good</code>" in explorer.row_view.value
    assert "does not use it" in explorer.row_view.value
    explorer.sentence.value = "you and you?"
    explorer.token.value = 1
    assert outlined_rows(explorer.axes[0], widgets01.SELECTED_ROW_COLOR) == [1]
    assert "position(s) [1, 3]" in explorer.row_view.value


@pytest.mark.parametrize("text, message", [
    ("Hello there", "unknown word(s) ['Hello', 'there']"),
    ("<script>", "unknown word(s) ['&lt;', 'script', '&gt;']"),
    ("you " * 12, "at most 12 fit"),
])
def test_a_bad_sentence_shows_a_message_and_keeps_the_picture(params, text, message):
    explorer = widgets01.embedding_explorer(params)
    explorer.sentence.value = text          # must not raise
    assert message in explorer.status.value
    assert explorer.status.value.startswith("<b>Cannot show this:</b>")
    assert explorer.shown["ids"] == ARTICLE_IDS
    np.testing.assert_array_equal(explorer.axes[1].images[0].get_array(),
                                  params.embedding[ARTICLE_IDS])
    explorer.sentence.value = "good"
    assert explorer.status.value == "" and explorer.shown["ids"] == [0, 10]


def test_lookup_explorer_leaks_no_figures(params):
    explorer = widgets01.embedding_explorer(params)
    figures = len(plt.get_fignums())
    sentences = ["I am fine.", "nonsense", "you and you?", "How are you?", "good thanks"]
    for step in range(20):
        explorer.sentence.value = sentences[step % len(sentences)]
        explorer.token.value = step % 12
    assert len(plt.get_fignums()) == figures
    assert len(explorer.figure.axes) == 2
    assert len(explorer.axes[0].patches) <= len(kvlib.TOY_VOCABULARY) + 1


def test_lookup_explorer_rejects_bad_arguments(params):
    with pytest.raises(ValueError, match="unknown word"):
        widgets01.embedding_explorer(params, text="Hello")
    with pytest.raises(ValueError, match="selected"):
        widgets01.embedding_explorer(params, selected=12)
    with pytest.raises(ValueError, match="2-D"):
        plots.matrix_heatmap(np.zeros(3), ax=plt.figure().gca(), vmin=0, vmax=1)
    with pytest.raises(ValueError, match="between 0 and 11"):
        widgets01.lookup_figure(params.embedding, [0, 12], kvlib.TOY_VOCABULARY)
    with pytest.raises(ValueError, match="between 0 and 11"):
        widgets01.lookup_figure(params.embedding, [0, 1], kvlib.TOY_VOCABULARY, selected=-1)
    with pytest.raises(TypeError, match="whole numbers"):
        widgets01.lookup_figure(params.embedding, [0.5], kvlib.TOY_VOCABULARY)
    with pytest.raises(ValueError, match="one row per vocabulary token"):
        widgets01.lookup_figure(params.embedding, [0], kvlib.TOY_VOCABULARY[:5])


def test_lookup_figure_draws_both_matrices(params):
    figure = widgets01.lookup_figure(params.embedding, ARTICLE_IDS, kvlib.TOY_VOCABULARY, 5)
    table_ax, x_ax = figure.axes[:2]
    assert outlined_rows(table_ax, widgets01.SELECTED_ROW_COLOR) == [5]
    assert x_ax.images[0].get_array().shape == (5, 4)


# ----------------------------------------------------------------------------------------
# Notebook 02's widget


def bar_heights(ax):
    return np.array([p.get_height() for p in ax.patches
                     if isinstance(p, matplotlib.patches.Rectangle) and p.get_width() == 0.8])


def test_attention_explorer_starts_on_head_0_without_mask(params):
    explorer = widgets02.attention_explorer(params)
    Qh, Kh = head_of_layer0(params, ARTICLE_IDS, 0)
    expected = kvlib.attention_weights(Qh, Kh)          # no mask
    np.testing.assert_allclose(explorer.shown["weights"], expected)
    heat_ax, bar_ax = explorer.axes
    np.testing.assert_allclose(heat_ax.images[0].get_array(), expected)
    np.testing.assert_allclose(bar_heights(bar_ax), expected[0])
    assert explorer.query.value == 0
    assert "&lt;bos&gt;" in explorer.summary.value
    assert f"{1 - expected[0, 0]:.3f} of its weight" in explorer.summary.value


def test_picking_a_query_shows_its_row(params):
    explorer = widgets02.attention_explorer(params)
    explorer.query.value = 3
    weights = explorer.shown["weights"]
    bar_ax = explorer.axes[1]
    np.testing.assert_allclose(bar_heights(bar_ax), weights[3])
    hatched = [bool(p.get_hatch()) for p in bar_ax.patches if p.get_width() == 0.8]
    assert hatched == [False, False, False, False, True]   # only "?" comes after "you"
    assert "attends most to <b>?</b> (position 4)" in explorer.summary.value
    explorer.query.value = 4
    assert "every key is at or before it" in explorer.summary.value


def test_head_scaling_and_temperature_change_the_weights(params):
    explorer = widgets02.attention_explorer(params)
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
    explorer = widgets02.attention_explorer(params)
    frames = explorer.axes[0].collections[0]
    centres = [tuple(np.round(path.vertices[:4].mean(axis=0)).astype(int)) for path in
               frames.get_paths()]
    weights = explorer.shown["weights"]
    assert centres == [(int(np.argmax(row)), r) for r, row in enumerate(weights)]


def test_typing_a_sentence_updates_the_queries(params):
    explorer = widgets02.attention_explorer(params, query=4)
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
    explorer = widgets02.attention_explorer(params)
    before = explorer.shown["weights"].copy()
    explorer.sentence.value = text
    assert message in explorer.status.value
    np.testing.assert_array_equal(explorer.shown["weights"], before)
    assert len(explorer.query.options) == 5
    explorer.query.value = 2                        # still works after the error
    assert explorer.status.value == ""


def test_attention_explorer_leaks_no_figures(params):
    explorer = widgets02.attention_explorer(params)
    figures = len(plt.get_fignums())
    for step in range(20):
        explorer.query.value = step % 5
        explorer.head.value = step % 2
        explorer.scaled.value = step % 3 == 0
        explorer.temperature.value = [0.05, 1.0, 5.0][step % 3]
        if step % 7 == 0:
            explorer.sentence.value = ["How are you?", "bad input", "I am fine"][step % 3]
            explorer.sentence.value = "How are you?"
    assert len(plt.get_fignums()) == figures
    assert len(explorer.figure.axes) == 2


@pytest.mark.parametrize("kwargs, error", [
    ({"temperature": 0.0}, ValueError), ({"temperature": -1.0}, ValueError),
    ({"temperature": float("nan")}, ValueError), ({"temperature": "hot"}, ValueError),
    ({"head": 2}, ValueError), ({"layer": 3}, ValueError),
])
def test_head_weights_rejects_bad_values(params, kwargs, error):
    with pytest.raises(error):
        widgets02.head_weights(params, ARTICLE_IDS, **kwargs)


@pytest.mark.parametrize("kwargs", [{"head": 2}, {"layer": -1}, {"query": 5}, {"text": "Hi"}])
def test_attention_explorer_rejects_bad_arguments(params, kwargs):
    with pytest.raises(ValueError):
        widgets02.attention_explorer(params, **kwargs)


def test_draw_query_row_rejects_a_query_outside_the_sentence():
    weights = np.full((3, 3), 1 / 3)
    figure, axes = plt.subplots(1, 2)
    with pytest.raises(ValueError, match="between 0 and 2"):
        widgets02.draw_query_row(*axes, weights, ["a", "b", "c"], query=3)


# ----------------------------------------------------------------------------------------
# Exercise checkers: a table of a beginner's typical wrong answers, each with the diagnosis
# it must get, and valid answers in other forms that must pass; then a fuzz of odd answers.

CHECKERS = {
    # checker: the shape of a well-formed answer (None: one number), for the fuzz
    lesson00.check_logits_shape: (2,),
    lesson00.check_next_token: None,
    lesson01.check_sentence_embedding: (5, 4),
    lesson01.check_one_hot: (4, 12),
    lesson01.check_gpt2_table_size: None,
    lesson02.check_head1_scores: (5, 5),
    lesson02.check_head1_scaled_scores: (5, 5),
    lesson02.check_strongest_key: None,
}


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
def test_an_untouched_answer_is_not_filled_in(check):
    assert_not_yet(check(...), "not filled in yet")
    assert_not_yet(check(None), "not filled in yet")


@pytest.mark.parametrize("check, label, answer",
                         [(check, label, answer) for check, shape in CHECKERS.items()
                          for label, answer in odd_answers(shape)],
                         ids=case_id)
def test_every_checker_answers_odd_input_in_words(check, label, answer):
    feedback = assert_answers_in_words(check, answer)
    assert not feedback.passed, label


@pytest.mark.parametrize("check", CHECKERS, ids=lambda check: check.__name__)
@settings(max_examples=60, deadline=None)
@given(answer=student_answers)
def test_every_checker_answers_anything_in_words(check, answer):
    assert_answers_in_words(check, answer)


# Notebook 00, exercise 1: the logits' shape for "I am fine and you?" (7 tokens with BOS)

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
    assert_not_yet(lesson00.check_logits_shape(answer), words)


@pytest.mark.parametrize("answer", [
    (7, 12), [7, 12], (7.0, 12.0), (np.int64(7), 12), np.array([7, 12]), (np.float64(7), 12.0),
    kvlib.forward(kvlib.init_params(), TOKENIZER.encode("I am fine and you?")).shape,
])
def test_logits_shape_right_answers(answer):
    assert_correct(lesson00.check_logits_shape(answer))


def test_practice_logits_tell_the_mistakes_apart():
    logits = lesson00.practice_logits()
    answers = {int(np.argmax(logits[-1])), int(np.argmax(logits[0])), int(np.argmin(logits[-1]))}
    assert len(answers) == 3 and int(np.argmax(logits)) >= logits.shape[1]
    sorted_last = np.sort(logits[-1])
    assert sorted_last[-1] - sorted_last[-2] > 0.5    # a clear winner


PRACTICE = lesson00.practice_logits()


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
    assert_not_yet(lesson00.check_next_token(answer), words)


@pytest.mark.parametrize("answer", [
    11, 11.0, np.int64(11), np.float32(11), np.array(11), np.argmax(PRACTICE[-1]),
    int(np.argmax(kvlib.softmax(PRACTICE[-1]))),
])
def test_next_token_right_answers(answer):
    assert_correct(lesson00.check_next_token(answer))


# Notebook 01: X for "I am fine.", the one-hot matrix of "and you?", GPT-2's table size

TABLE = kvlib.init_params().embedding
SENTENCE_IDS = [0, 5, 2, 4, 8]


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
    assert_not_yet(lesson01.check_sentence_embedding(answer), words)


@pytest.mark.parametrize("answer", [
    TABLE[SENTENCE_IDS], TABLE[SENTENCE_IDS].tolist(), tuple(map(tuple, TABLE[SENTENCE_IDS])),
    kvlib.embed(np.array(SENTENCE_IDS), TABLE), np.eye(12)[SENTENCE_IDS] @ TABLE,
    TABLE[SENTENCE_IDS].astype(object), np.asarray(TABLE[SENTENCE_IDS], dtype=np.float32),
])
def test_sentence_embedding_right_answers(answer):
    assert_correct(lesson01.check_sentence_embedding(answer))


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
    assert_not_yet(lesson01.check_one_hot(answer), words)


@pytest.mark.parametrize("answer", [
    RIGHT_ONE_HOT, RIGHT_ONE_HOT.tolist(), RIGHT_ONE_HOT.astype(bool), RIGHT_ONE_HOT.astype(int),
    np.eye(12)[[0, 11, 1, 9]], (np.arange(12) == np.array([[0], [11], [1], [9]])),
])
def test_one_hot_right_answers(answer):
    assert_correct(lesson01.check_one_hot(answer))


@pytest.mark.parametrize("answer, words", [
    (50257 + 768, "rows PLUS columns"), (50257, "one side"), (768, "one side"),
    (50257 * 768 * 4, "bytes"), (50257 * 768 * 2, "bytes"),
    (50257 * 768 + 1024 * 768, "position table"), (124_439_808, "every weight of GPT-2"),
    (38_600_000, "close (2,624 off)"), (3.86e7, "close"), (38_597_376.5, "close (0.5 from"),
    (1000, "not vocab_size x d_model"), ("38597376", "not text"), (3.5, "whole number"),
    (True, "a bool"), (10**400, "401 digits: far too large"), (float("nan"), "got nan"),
])
def test_gpt2_table_size_wrong_answers(answer, words):
    assert_not_yet(lesson01.check_gpt2_table_size(answer), words)


@pytest.mark.parametrize("answer", [38_597_376, 38597376.0, np.int64(38_597_376),
                                    np.array(38_597_376), 50257 * 768])
def test_gpt2_table_size_right_answers(answer):
    assert_correct(lesson01.check_gpt2_table_size(answer))


# Notebook 02: head 1's raw and scaled scores, and the strongest key on another prompt

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
    assert_not_yet(lesson02.check_head1_scores(answer), words)


@pytest.mark.parametrize("answer", [RAW1, RAW1.tolist(), np.round(RAW1, 3),
                                    Q0[:, 2:4] @ K0[:, 2:4].T, np.einsum("ic,jc->ij", Q0[:, 2:],
                                                                         K0[:, 2:])])
def test_head1_scores_right_answers(answer):
    assert_correct(lesson02.check_head1_scores(answer))


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
    assert_not_yet(lesson02.check_head1_scaled_scores(answer), words)


@pytest.mark.parametrize("answer", [
    RAW1 / np.sqrt(2), RAW1 / 1.414, RAW1 / 1.41, RAW1 / 2 ** 0.5, RAW1 * (1 / np.sqrt(2)),
    (RAW1 / 1.41).tolist(), np.round(RAW1 / np.sqrt(2), 3),
    kvlib.attention_scores(Q0[:, 2:], K0[:, 2:]),
])
def test_head1_scaled_scores_right_answers(answer):
    feedback = lesson02.check_head1_scaled_scores(answer)
    assert_correct(feedback)


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
    assert_not_yet(lesson02.check_strongest_key(answer), words)


@pytest.mark.parametrize("answer", [5, 5.0, np.int64(5), np.array(5)])
def test_strongest_key_right_answers(answer):
    feedback = lesson02.check_strongest_key(answer)
    assert_correct(feedback)
    assert "AFTER 'and'" in feedback.message


# ----------------------------------------------------------------------------------------
# Every published solution, run after the notebook's own code, passes its checker


def notebook_namespace(name):
    """Run a notebook's code cells (headless) and return the variables they leave behind."""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    namespace = {"__name__": "__notebook__"}
    show, plt.show = plt.show, lambda *args, **kwargs: None
    try:
        for cell in notebook["cells"]:
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), name, "exec"), namespace)
    finally:
        plt.show = show
        plt.close("all")
    return namespace


SOLVED = [
    ("00_big_picture", lesson00, {1: lesson00.check_logits_shape, 2: lesson00.check_next_token}),
    ("01_embedding_lookup", lesson01, {1: lesson01.check_sentence_embedding,
                                       2: lesson01.check_one_hot,
                                       3: lesson01.check_gpt2_table_size}),
    ("02_one_attention_head", lesson02, {1: lesson02.check_head1_scores,
                                         2: lesson02.check_head1_scaled_scores,
                                         3: lesson02.check_strongest_key}),
]


@pytest.mark.parametrize("name, module, checks", SOLVED, ids=[s[0] for s in SOLVED])
def test_every_solution_passes_in_the_notebooks_namespace(name, module, checks, capsys):
    namespace = notebook_namespace(name)
    assert sorted(module.SOLUTIONS) == sorted(checks)
    for number, check in checks.items():
        assert namespace["answer"] is ...           # the notebook leaves the exercises open
        scope = dict(namespace)
        exec(module.SOLUTIONS[number], scope)
        feedback = check(scope["answer"])
        assert feedback.passed, f"solution {number}: {feedback}"
        notebook_text = (NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")
        assert f"exercises.{check.__name__}(answer)" in notebook_text


@pytest.mark.parametrize("module", [lesson00, lesson01, lesson02])
def test_solution_shows_the_code(module):
    shown = module.solution(1)
    assert module.SOLUTIONS[1].strip() in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        module.solution(9)
