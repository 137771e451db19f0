"""Notebooks 00-02: their widgets, driven headless, and their exercise checkers.

Widgets: set a control's value (observers fire at once) and check what the figure and the HTML
show; bad input gives a message and no exception; nothing leaks. Checkers: typical wrong answers
get their specific "Not yet" message, and each published solution, executed after the
notebook's own code, passes.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvlib  # noqa: E402
from kvlib import plots  # noqa: E402
from kvlib.exercises import lesson00, lesson01, lesson02  # noqa: E402
from kvlib.widgets import lesson01 as widgets01  # noqa: E402
from kvlib.widgets import lesson02 as widgets02  # noqa: E402

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
# Exercise checkers: specific messages for typical wrong answers


def not_yet(feedback, words):
    assert not feedback.passed
    assert repr(feedback).startswith("Not yet: ")
    assert words in feedback.message, feedback.message


@pytest.mark.parametrize("check", [
    lesson00.check_logits_shape, lesson00.check_next_token,
    lesson01.check_sentence_embedding, lesson01.check_one_hot, lesson01.check_gpt2_table_size,
    lesson02.check_head1_scores, lesson02.check_head1_scaled_scores,
    lesson02.check_strongest_key,
])
def test_an_untouched_answer_is_not_filled_in(check):
    not_yet(check(...), "not filled in yet")


@pytest.mark.parametrize("answer, words", [
    ((12, 7), "swapped"),
    ((1, 12), "only the last row is USED"),
    ((7, 4), "hidden state X3"),
    ((6, 12), "count the BOS token"),
    ((5, 12), "number of tokens"),
    ((7, 13), "vocabulary size"),
    ((7, 12, 1), "two numbers"),
    ("(7, 12)", "tuple of whole numbers"),
    (np.zeros((7, 12)), "not the logits"),
])
def test_logits_shape_mistakes(answer, words):
    not_yet(lesson00.check_logits_shape(answer), words)


def test_logits_shape_accepts_tuple_or_list():
    assert lesson00.check_logits_shape((7, 12)).passed
    assert lesson00.check_logits_shape([np.int64(7), 12]).passed


def test_practice_logits_tell_the_mistakes_apart():
    logits = lesson00.practice_logits()
    answers = {int(np.argmax(logits[-1])), int(np.argmax(logits[0])), int(np.argmin(logits[-1]))}
    assert len(answers) == 3 and int(np.argmax(logits)) >= logits.shape[1]
    sorted_last = np.sort(logits[-1])
    assert sorted_last[-1] - sorted_last[-2] > 0.5    # a clear winner


@pytest.mark.parametrize("make_answer, words", [
    (lambda m: int(np.argmax(m)), "not a token id"),
    (lambda m: int(np.argmax(m[0])), "FIRST row"),
    (lambda m: int(np.argmin(m[-1])), "smallest logit"),
    (lambda m: np.argmax(m, axis=1), "every row"),
    (lambda m: np.argmax(m, axis=0), "one index per column"),
    (lambda m: "and", "id"),
    (lambda m: 12, "from 0 to 11"),
    (lambda m: 1.5, "whole number"),
    (lambda m: 1, "does not have the largest logit"),
])
def test_next_token_mistakes(make_answer, words):
    not_yet(lesson00.check_next_token(make_answer(lesson00.practice_logits())), words)


def test_next_token_accepts_numpy_integers():
    assert lesson00.check_next_token(np.argmax(lesson00.practice_logits()[-1])).passed


def test_sentence_embedding_mistakes(params):
    table = params.embedding
    not_yet(lesson01.check_sentence_embedding(table[[5, 2, 4, 8]]), "BOS row is missing")
    not_yet(lesson01.check_sentence_embedding(table[:, [0, 1, 2, 3, 0]]), "COLUMNS")
    not_yet(lesson01.check_sentence_embedding(table[[0, 2, 5, 4, 8]]),
            "row 1 of X is the row of token 2 ('am'), but position 1 of 'I am fine.' holds "
            "token 5 ('I')")
    not_yet(lesson01.check_sentence_embedding(table[[0, 5, 2, 4, 8]] + 1),
            "not a row of the table")
    not_yet(lesson01.check_sentence_embedding(table[[0, 5, 2, 4, 8]].tolist()), "numpy array")
    not_yet(lesson01.check_sentence_embedding(np.zeros((5, 3))), "shape (5, 4)")
    assert lesson01.check_sentence_embedding(table[[0, 5, 2, 4, 8]]).passed


def one_hot(rows, columns=12):
    matrix = np.zeros((len(rows), columns))
    matrix[np.arange(len(rows)), rows] = 1
    return matrix


def test_one_hot_mistakes():
    right = one_hot([0, 11, 1, 9])
    not_yet(lesson01.check_one_hot(right.T), "transposed")
    not_yet(lesson01.check_one_hot(one_hot([11, 1, 9])), "BOS token")
    not_yet(lesson01.check_one_hot(2 * right), "only 0s and 1s")
    two_ones = right.copy()
    two_ones[2, 5] = 1
    not_yet(lesson01.check_one_hot(two_ones), "row 2 has 2 ones")
    not_yet(lesson01.check_one_hot(one_hot([0, 1, 1, 9])),
            "row 1 has its 1 in column 1 ('you'), but position 1 of 'and you?' holds token 11")
    not_yet(lesson01.check_one_hot(np.zeros((4, 5))), "shape (4, 12)")
    not_yet(lesson01.check_one_hot(right.tolist()), "numpy array")
    assert lesson01.check_one_hot(right.astype(bool)).passed


@pytest.mark.parametrize("answer, words", [
    (50257 + 768, "rows PLUS columns"), (50257, "one side"), (768, "one side"),
    (50257 * 768 * 4, "bytes"), (50257 * 768 * 2, "bytes"), (1000, "not vocab_size x d_model"),
    ("38597376", "whole number"), (3.5, "whole number"), (True, "whole number"),
])
def test_gpt2_table_size_mistakes(answer, words):
    not_yet(lesson01.check_gpt2_table_size(answer), words)


def test_gpt2_table_size_accepts_equal_numbers():
    for answer in (38_597_376, 38597376.0, np.int64(38_597_376)):
        assert lesson01.check_gpt2_table_size(answer).passed


@pytest.fixture(scope="module")
def layer0(params):
    X = kvlib.embed(np.array(ARTICLE_IDS), params.embedding)
    return kvlib.project_qkv(X, params.layers[0])


def test_head1_scores_mistakes(layer0):
    Q, K, _ = layer0
    raw = Q[:, 2:] @ K[:, 2:].T
    check = lesson02.check_head1_scores
    not_yet(check(Q[:, :2] @ K[:, :2].T), "head 0's scores")
    not_yet(check(Q @ K.T), "all 4 columns")
    not_yet(check(raw.T), "swapped")
    not_yet(check(Q[:, 2:].T @ K[:, 2:]), "Q_h.T @ K_h")
    not_yet(check(raw / np.sqrt(2)), "already divided")
    not_yet(check(raw + 1), "right shape but not the right values")
    assert check(raw).passed


def test_head1_scaled_scores_mistakes(layer0):
    Q, K, _ = layer0
    raw = Q[:, 2:] @ K[:, 2:].T
    check = lesson02.check_head1_scaled_scores
    not_yet(check(raw), "not scaled yet")
    not_yet(check(raw / 2), "square root of ONE head's size")
    not_yet(check(raw * np.sqrt(2)), "multiplied")
    not_yet(check(Q[:, :2] @ K[:, :2].T / np.sqrt(2)), "head 0's scores")
    not_yet(check(Q @ K.T / np.sqrt(2)), "all 4 columns")
    assert check(raw / np.sqrt(2)).passed
    assert check(kvlib.attention_scores(Q[:, 2:], K[:, 2:])).passed


def test_strongest_key_mistakes():
    check = lesson02.check_strongest_key
    not_yet(check(3), "head 1's strongest key")
    not_yet(check(0), "another key gets more")
    not_yet(check("?"), "not its word")
    not_yet(check(np.array([4, 4])), "one position")
    not_yet(check(5), "positions 0 to 4")
    not_yet(check(4.0), "whole number")
    feedback = check(np.int64(4))
    assert feedback.passed and "AFTER 'you'" in feedback.message


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
