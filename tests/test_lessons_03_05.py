"""Notebooks 03-05: their widgets, driven headless, and their exercise checkers.

Widgets are built, their controls set (observers fire synchronously), and the drawn artists
compared with what kvlib computes. Every checker must say "Not yet" with the specific reason
for each typical wrong answer in its table, pass the valid answers in other forms, answer odd
input (text, nan, 10**400, ragged lists) in words, and every published solution, executed in
the namespace of its notebook, must pass its checker.
"""

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
from functools import lru_cache  # noqa: E402
from pathlib import Path  # noqa: E402

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
from kvlib.exercises import causal_masking as exercises03  # noqa: E402
from kvlib.exercises import mlp_residual_stream as exercises05  # noqa: E402
from kvlib.exercises import multi_head_attention as exercises04  # noqa: E402
from kvlib.widgets import causal_masking as widgets03  # noqa: E402
from kvlib.widgets import mlp_residual_stream as widgets05  # noqa: E402
from kvlib.widgets import multi_head_attention as widgets04  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
IDS = [0, 3, 7, 1, 9]


@pytest.fixture(scope="module")
def params():
    return kvlib.init_params()


@pytest.fixture(autouse=True)
def no_figure_leaks():
    """Every test must leave the set of open pyplot figures as it found it."""
    before = set(plt.get_fignums())
    yield
    assert set(plt.get_fignums()) == before


def image_of(ax):
    """The array shown by the first image of an Axes (a masked array for attention maps)."""
    return ax.images[0].get_array()


def bar_heights(ax, container=0):
    return np.array([bar.get_height() for bar in ax.containers[container]])


# ---------------------------------------------------------------- notebook 03 widgets


def test_attention_by_layer_masked_is_the_model_and_unmasked_differs(params):
    record = []
    kvlib.forward(params, IDS, record_attention=record)
    masked = widgets03.attention_by_layer(params, IDS, masked=True)
    unmasked = widgets03.attention_by_layer(params, IDS, masked=False)
    for layer in range(3):
        np.testing.assert_array_equal(masked[layer], record[layer])
        assert unmasked[layer].shape == (2, 5, 5)
        assert np.all(unmasked[layer][:, 0, 1:] > 0)        # the first token reads the future
    # Layer 0's last row sees everything either way; later layers' inputs differ without a mask.
    np.testing.assert_allclose(unmasked[0][:, -1], masked[0][:, -1])
    assert not np.allclose(unmasked[1][:, -1], masked[1][:, -1])


def test_mask_explorer_draws_the_chosen_head_with_and_without_the_mask(params):
    box = widgets03.mask_explorer(params)
    ax = box.figure.axes[0]
    masked = widgets03.attention_by_layer(params, IDS, masked=True)
    shown = image_of(ax)
    np.testing.assert_allclose(shown.data, masked[0][0])
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~kvlib.causal_mask(5))
    assert "mask on" in ax.get_title() and "sums to 1" in box.status.value

    box.controls["mask"].value = False
    unmasked = widgets03.attention_by_layer(params, IDS, masked=False)
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
    box = widgets03.mask_explorer(params)
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
    box = widgets03.mask_explorer(params)
    box.controls["prompt"].value = ""               # only <bos>
    for masked in (False, True):
        box.controls["mask"].value = masked
        assert "single token" in box.status.value and "reads the future" not in box.status.value
        assert image_of(box.figure.axes[0]).shape == (1, 1)


def test_mask_explorer_keeps_one_figure_and_one_colorbar(params):
    box = widgets03.mask_explorer(params)
    n_axes = len(box.figure.axes)
    for step in range(24):
        box.controls["mask"].value = bool(step % 2)
        box.controls["layer"].value = step % 3
        box.controls["head"].value = step % 2
    assert len(box.figure.axes) == n_axes == 2   # the heatmap and its colorbar, never more


def test_row_changes_are_exactly_zero_before_the_changed_position(params):
    changes = widgets03.row_changes(params, IDS, 3, 5)
    assert changes.shape == (5,)
    assert np.all(changes[:3] == 0) and np.all(changes[3:] > 0)
    assert np.all(widgets03.row_changes(params, IDS, 0, 4) > 0)
    assert np.all(widgets03.row_changes(params, IDS, 2, IDS[2]) == 0)
    with pytest.raises(ValueError, match="position must be between 0 and 4"):
        widgets03.row_changes(params, IDS, 5, 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        widgets03.row_changes(params, IDS, 1, 12)
    with pytest.raises(TypeError, match="whole number"):
        widgets03.row_changes(params, IDS, 1.5, 1)


def test_change_explorer_bars_follow_the_chosen_change(params):
    box = widgets03.change_explorer(params, position=3, replacement=5)
    ax = box.figure.axes[0]
    heights = bar_heights(ax)
    np.testing.assert_array_equal(heights, widgets03.row_changes(params, IDS, 3, 5))
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
    box = widgets03.change_explorer(params, position=4, replacement=5)
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
    box = widgets03.change_explorer(params)
    figures = plt.get_fignums()
    for step in range(24):
        box.controls["position"].value = step % 5
        box.controls["replacement"].value = step % 12
    assert plt.get_fignums() == figures
    assert len(box.figure.axes) == 1


# ---------------------------------------------------------------- notebook 04 widgets


def frames(ax, color):
    return [p for p in ax.patches if not p.get_fill()
            and matplotlib.colors.same_color(p.get_edgecolor(), color)]


def test_head_columns_frames_each_head_and_rejects_bad_splits():
    Q = np.arange(20.0).reshape(5, 4)
    fig, ax = plt.subplots()
    try:
        widgets04.head_columns(Q, 2, list("abcde"), ax=ax, highlight=1)
        red = frames(ax, widgets04.FRAME_COLOR)
        assert len(red) == 1 and red[0].get_x() == 1.5 and red[0].get_width() == 2
        assert sorted(t.get_text() for t in ax.texts if t.get_text().startswith("head")) == [
            "head 0", "head 1"]
        with pytest.raises(ValueError, match="cannot split 4 columns into 3"):
            widgets04.head_columns(Q, 3, ax=ax)
        with pytest.raises(ValueError, match="highlight must be a head between 0 and 1"):
            widgets04.head_columns(Q, 2, ax=ax, highlight=2)
    finally:
        plt.close(fig)


def test_layer_inputs_are_the_stream_entering_each_block(params):
    inputs = widgets04.layer_inputs(params, IDS)
    assert len(inputs) == 3
    X = kvlib.embed(np.array(IDS), params.embedding)
    for layer, X_in in zip(params.layers, inputs):
        np.testing.assert_array_equal(X_in, X)
        X = kvlib.decoder_block(X, layer, 2, mask=kvlib.causal_mask(5))


def test_head_explorer_shows_the_chosen_head(params):
    box = widgets04.head_explorer(params)
    left, right = box.figure.axes
    X = kvlib.embed(np.array(IDS), params.embedding)
    Q, _, _ = kvlib.project_qkv(X, params.layers[0])
    np.testing.assert_array_equal(box.state["head_slice"], Q[:, 0:2])
    np.testing.assert_allclose(image_of(left), Q)
    assert frames(left, widgets04.FRAME_COLOR)[0].get_x() == -0.5

    box.controls["head"].value = 1
    np.testing.assert_array_equal(box.state["head_slice"], Q[:, 2:4])
    assert frames(left, widgets04.FRAME_COLOR)[0].get_x() == 1.5
    assert "columns 2:4" in box.status.value

    box.controls["layer"].value = 2
    record = []
    kvlib.forward(params, IDS, record_attention=record)
    np.testing.assert_allclose(image_of(right).data, record[2][1])
    Q2 = widgets04.layer_inputs(params, IDS)[2] @ params.layers[2].Wq
    np.testing.assert_allclose(box.state["Q"], Q2)
    assert right.get_title() == "Layer 2, head 1: weights (5, 5)"


def test_head_explorer_reports_a_bad_prompt_and_does_not_leak(params):
    box = widgets04.head_explorer(params)
    box.controls["prompt"].value = "How are zebras?"
    assert "unknown word" in box.message.value and box.status.value == ""
    box.controls["prompt"].value = "How are you? I am fine."
    assert box.message.value == "" and box.state["Q"].shape == (9, 4)
    figures = plt.get_fignums()
    for step in range(24):
        box.controls["layer"].value = step % 3
        box.controls["head"].value = (step // 3) % 2
    assert plt.get_fignums() == figures and len(box.figure.axes) == 2


def test_split_for_heads_cuts_the_same_q(params):
    Q1, _ = widgets04.split_for_heads(IDS, 1)
    for count in (1, 2, 4, 8):
        Q, weights = widgets04.split_for_heads(IDS, count)
        np.testing.assert_array_equal(Q, Q1)
        assert weights.shape == (count, 5, 5)
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0)
        assert np.all(weights[:, kvlib.causal_mask(5) == 0] == 0)
    with pytest.raises(ValueError, match=r"divisible by n_heads \(3\)"):
        widgets04.split_for_heads(IDS, 3)


def test_head_count_explorer_redraws_one_heatmap_per_head():
    box = widgets04.head_count_explorer(n_heads=2)
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
    box = widgets04.head_count_explorer(n_heads=8)
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
    box = widgets04.head_count_explorer()
    figures = plt.get_fignums()
    for step in range(24):
        box.controls["heads"].value = 1 + step % 8
    assert plt.get_fignums() == figures


# ---------------------------------------------------------------- notebook 05 widgets


def test_residual_stream_is_the_stack_of_decoder_blocks(params):
    stream = widgets05.residual_stream(params, IDS)
    assert len(stream["streams"]) == 4
    mask = kvlib.causal_mask(5)
    for i, layer in enumerate(params.layers):
        X, X_next = stream["streams"][i], stream["streams"][i + 1]
        assert X_next.shape == (5, 4)
        np.testing.assert_allclose(X_next, kvlib.decoder_block(X, layer, 2, mask=mask))
        np.testing.assert_allclose(X_next, X + stream["attention"][i] + stream["mlp"][i])
        np.testing.assert_allclose(stream["mlp"][i], kvlib.mlp(X + stream["attention"][i], layer))
    np.testing.assert_allclose(kvlib.unembed(stream["streams"][-1], params.embedding),
                               kvlib.forward(params, IDS))


def test_stream_explorer_draws_the_stream_the_vector_and_the_edits(params):
    box = widgets05.stream_explorer(params, blocks=3, token=4)
    heat, vector, sizes = box.figure.axes[:3]
    stream = widgets05.residual_stream(params, IDS)
    np.testing.assert_allclose(image_of(heat), stream["streams"][3])
    assert len(vector.patches) == 4 * 4                      # 4 components x X0..X3
    np.testing.assert_allclose(bar_heights(vector, 3), stream["streams"][3][4])
    np.testing.assert_allclose(bar_heights(sizes, 0),
                               [np.linalg.norm(a[4]) for a in stream["attention"]])
    assert "X3[4]" in box.status.value and "6 update(s)" in box.status.value

    box.controls["blocks"].value = 0
    np.testing.assert_allclose(image_of(heat), stream["streams"][0])
    assert len(vector.patches) == 4
    box.controls["blocks"].value = 1
    box.controls["token"].value = 1
    np.testing.assert_allclose(bar_heights(vector, 1), stream["streams"][1][1])
    outline = [p for p in heat.patches if not p.get_fill()]
    assert outline[0].get_y() == 0.5                          # the frame around row 1
    np.testing.assert_allclose(bar_heights(sizes, 0), [np.linalg.norm(stream["attention"][0][1])])


def test_stream_explorer_follows_a_new_prompt_and_reports_bad_ones(params):
    box = widgets05.stream_explorer(params, token=4)
    box.controls["prompt"].value = "I am"
    assert box.controls["token"].value == 2
    assert [label for label, _ in box.controls["token"].options] == ["0 <bos>", "1 I", "2 am"]
    assert image_of(box.figure.axes[0]).shape == (3, 4)
    box.controls["prompt"].value = "I am a robot"
    assert "unknown word" in box.message.value and box.status.value == ""
    box.controls["prompt"].value = "How are you?"
    assert box.message.value == "" and len(box.controls["token"].options) == 5


def test_stream_explorer_does_not_leak(params):
    box = widgets05.stream_explorer(params)
    figures = plt.get_fignums()
    for step in range(24):
        box.controls["blocks"].value = step % 4
        box.controls["token"].value = step % 5
    assert plt.get_fignums() == figures and len(box.figure.axes) == 3


def test_gelu_explorer_plots_gelu_and_relu_and_rejects_bad_values():
    box = widgets05.gelu_explorer()
    ax = box.figure.axes[0]
    gelu_line, relu_line = ax.lines[:2]
    np.testing.assert_allclose(gelu_line.get_ydata(), kvlib.gelu(gelu_line.get_xdata()))
    np.testing.assert_allclose(relu_line.get_ydata(), np.maximum(relu_line.get_xdata(), 0))
    assert "gelu(-0.75) = -0.170" in box.status.value

    box.controls["x"].value = 1.0
    assert "gelu(1) = 0.841, relu(1) = 1.000" in box.status.value
    box.controls["range"].value = (-2.0, 0.5)
    assert ax.get_xlim() == (-2.0, 0.5)
    box.controls["relu"].value = False
    assert [line.get_label() for line in ax.lines if not line.get_label().startswith("_")][0] \
        == "GeLU"
    assert "ReLU" not in [line.get_label() for line in ax.lines]
    assert "outside the plotted range" in box.status.value

    box.controls["x"].value = float("nan")
    assert "x must be a finite number" in box.message.value
    box.controls["x"].value = 0.0
    assert box.message.value == ""
    box.controls["range"].value = (1.0, 1.0)
    assert "range wider than zero" in box.message.value
    figures = plt.get_fignums()
    for step in range(24):
        box.controls["range"].value = (-4.0 + step % 3, 4.0)
        box.controls["x"].value = step / 4
    assert plt.get_fignums() == figures


def test_stream_legend_tells_the_updates_apart_at_every_block_count(params):
    for blocks in (0, 1, 3):
        box = widgets05.stream_explorer(params, blocks=blocks)
        legend = box.figure.axes[2].get_legend()
        entries = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
        attention = entries["attention update"].get_facecolor()
        mlp = entries["MLP update"].get_facecolor()
        assert matplotlib.colors.same_color(attention, widgets05.ATTENTION_COLOR)
        assert matplotlib.colors.same_color(mlp, widgets05.MLP_COLOR)
        assert ("block not applied yet" in entries) == (blocks < 3)


@pytest.mark.parametrize("x, shown", [(1e308, "gelu(1e+308) = 1e+308"),
                                      (-1e308, "gelu(-1e+308) = 0.000"),
                                      (12345678.0, "gelu(1.23457e+07) = 1.235e+07"),
                                      (-3.0, "gelu(-3) = -0.004")])
def test_gelu_explorer_prints_large_values_readably(x, shown):
    box = widgets05.gelu_explorer()
    box.controls["x"].value = x                       # no overflow warning (warnings are errors)
    assert shown in box.status.value and len(box.status.value) < 120
    assert box.message.value == ""


def test_gelu_plot_marks_the_dip():
    fig, ax = plt.subplots()
    try:
        widgets05.gelu_plot(-4, 4, ax=ax)
        assert any(t.get_text().startswith("the dip: -0.170") for t in ax.texts)
        grid = np.linspace(-2, 0, 200001)
        assert abs(grid[np.argmin(kvlib.gelu(grid))] - widgets05.GELU_MINIMUM_X) < 1e-4
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- exercise checkers
# A table of a beginner's typical wrong answers, each with the diagnosis it must get; valid
# answers in other forms that must pass; then a fuzz of odd answers, all answered in words.

CHECKERS = {
    # checker: the shape of a well-formed answer, for the fuzz
    exercises03.check_mask: (7, 7),
    exercises03.check_masked_weights: (7, 7),
    exercises03.check_changed_rows: (3,),
    exercises04.check_head_slice: (5, 4),
    exercises04.check_three_heads: (3, 5, 2),
    exercises04.check_attention_output: (7, 4),
    exercises05.check_hidden_shape: (2,),
    exercises05.check_second_block: (7, 4),
    exercises05.check_gelu_values: (3,),
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


# Notebook 03, exercise 1: the (7, 7) mask of "I am fine and you?"

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
    assert_not_yet(exercises03.check_mask(answer), words)


@pytest.mark.parametrize("answer", [
    MASK7, MASK7.tolist(), np.tril(np.ones((7, 7))) == 1, np.arange(7)[:, None] >= np.arange(7),
    ~np.triu(np.ones((7, 7), bool), k=1),
])
def test_mask_right_answers(answer):
    assert_correct(exercises03.check_mask(answer))


SCORES7 = exercises03.practice_scores()
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
    (kvlib.softmax(kvlib.apply_mask(exercises03.layer0_scores()[1], kvlib.causal_mask(5))),
     "size of the notebook's prompt"),
    (np.tril(np.ones((7, 7))), "should sum to 1"),
    (np.full((7, 7), 1 / 7), "above the diagonal"),
    (np.eye(7), "right shape but not the right values"),
    (SCORES7[1], "should sum to 1"),
])
def test_masked_weights_wrong_answers(answer, words):
    assert_not_yet(exercises03.check_masked_weights(answer), words)


@pytest.mark.parametrize("answer", [
    RIGHT_WEIGHTS7, RIGHT_WEIGHTS7.tolist(),
    kvlib.attention_weights(*(kvlib.split_heads(M, 2)[1] for M in kvlib.project_qkv(
        kvlib.embed(np.array([0, 5, 2, 4, 11, 1, 9]), kvlib.init_params().embedding),
        kvlib.init_params().layers[0])[:2]), MASK7),
    (lambda e: e / e.sum(axis=1, keepdims=True))(np.exp(SCORES7[1]) * MASK7),
])
def test_masked_weights_right_answers(answer):
    assert_correct(exercises03.check_masked_weights(answer))


# Notebook 03, exercise 3: which rows change when "are" (position 2) becomes "fine"

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
    assert_not_yet(exercises03.check_changed_rows(answer), words)


@pytest.mark.parametrize("answer", [
    [2, 3, 4], (4, 3, 2), np.array([2, 3, 4]), {2, 3, 4}, range(2, 5), [2.0, 3.0, 4.0],
    [np.int64(2), 3, 4], [2, 2, 3, 4], np.where(np.arange(5) >= 2),
    np.flatnonzero(np.arange(5) >= 2), np.arange(5) >= 2, list(range(2, 5)),
])
def test_changed_rows_right_answers(answer):
    assert_correct(exercises03.check_changed_rows(answer))


# Notebook 04, exercise 1: head 2's columns of a (5, 12) Q with 3 heads

Q12 = exercises04.practice_queries()


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
    assert_not_yet(exercises04.check_head_slice(answer), words)


@pytest.mark.parametrize("answer", [Q12[:, 8:12], Q12[:, -4:], Q12[:, 8:12].tolist(),
                                    kvlib.split_heads(Q12, 3)[2], Q12.reshape(5, 3, 4)[:, 2]])
def test_head_slice_right_answers(answer):
    assert_correct(exercises04.check_head_slice(answer))


# Notebook 04, exercise 2: np.arange(30).reshape(5, 6) split into 3 heads

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
    assert_not_yet(exercises04.check_three_heads(answer), words)


@pytest.mark.parametrize("answer", [
    M30.reshape(5, 3, 2).transpose(1, 0, 2), np.stack([M30[:, 2 * h:2 * h + 2] for h in range(3)]),
    [M30[:, 2 * h:2 * h + 2].tolist() for h in range(3)], kvlib.split_heads(M30, 3),
    np.array(np.split(M30, 3, axis=1)), M30.reshape(5, 3, 2).swapaxes(0, 1).astype(float),
])
def test_three_heads_right_answers(answer):
    assert_correct(exercises04.check_three_heads(answer))


# Notebook 04, exercise 3: from the heads of "I am fine and you?" to the attention output

HEADS7 = exercises04.practice_heads()
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
    assert_not_yet(exercises04.check_attention_output(answer), words)


@pytest.mark.parametrize("answer", [
    CONCATENATED7 @ WO, np.hstack(list(HEADS7)) @ WO, np.concatenate(HEADS7, axis=1) @ WO,
    sum(HEADS7[h] @ WO[2 * h:2 * h + 2] for h in range(2)), (CONCATENATED7 @ WO).tolist(),
])
def test_attention_output_right_answers(answer):
    assert_correct(exercises04.check_attention_output(answer))


# Notebook 05, exercise 1: GPT-2 small's hidden shape for a 10-token prompt

@pytest.mark.parametrize("answer, words", [
    (3072, "tuple of 2 whole numbers"),
    ((10, 768), "input and output shape"),
    ((768, 3072), "W_up's shape"),
    ((3072, 10), "rows are tokens"),
    ((1, 3072), "all 10 prompt tokens"),
    ((10, 1536), "toy model's ratio"),
    ((5, 8), "toy model"),
    ((10, 3073), "not (10, 3073)"),
    ((10.9, 3072.7), "10.9 is not a whole number: it is 0.1 from the nearest one, 11"),
    ((10, 3072.4), "close (0.4 from the answer)"),
    ((10,), "2 numbers, got 1"),
    ("(10, 3072)", "tuple of 2 whole numbers"),
])
def test_hidden_shape_wrong_answers(answer, words):
    assert_not_yet(exercises05.check_hidden_shape(answer), words)


@pytest.mark.parametrize("answer", [(10, 3072), [10, 3072], (10.0, 3072.0), np.array([10, 3072]),
                                    (np.int64(10), kvlib.GPT2_SMALL.d_ff)])
def test_hidden_shape_right_answers(answer):
    assert_correct(exercises05.check_hidden_shape(answer))


# Notebook 05, exercise 2: X2 of "I am fine and you?" from its X1, by hand

PARAMS = kvlib.init_params()
X1_OTHER = exercises05.practice_stream()
BLOCK2 = PARAMS.layers[1]
ATTENTION7 = kvlib.merge_heads(kvlib.attention(
    *(kvlib.split_heads(M, 2) for M in kvlib.project_qkv(X1_OTHER, BLOCK2)), MASK7)) @ BLOCK2.Wo
H7 = X1_OTHER + ATTENTION7
X2_OTHER = H7 + kvlib.mlp(H7, BLOCK2)


@pytest.mark.parametrize("answer, words", [
    (ATTENTION7 + kvlib.mlp(ATTENTION7, BLOCK2), "replaced the stream"),
    (kvlib.mlp(ATTENTION7, BLOCK2), "both additions are missing"),
    (H7, "stops after attention"),
    (X1_OTHER + ATTENTION7 + kvlib.mlp(X1_OTHER, BLOCK2), "the MLP reads the stream after"),
    (kvlib.decoder_block(X1_OTHER, PARAMS.layers[0], 2, mask=MASK7), "first block's weights"),
    (kvlib.decoder_block(X1_OTHER, BLOCK2, 2), "without the causal mask"),
    (X1_OTHER, "X1 itself"),
    (np.zeros((5, 4)), "the notebook's prompt"),
    (X1_OTHER[:4], "shape (7, 4)"),
    (X2_OTHER + 0.5, "not the right values"),
])
def test_second_block_wrong_answers(answer, words):
    assert_not_yet(exercises05.check_second_block(answer), words)


@pytest.mark.parametrize("answer", [X2_OTHER, X2_OTHER.tolist(),
                                    kvlib.decoder_block(X1_OTHER, BLOCK2, 2, mask=MASK7),
                                    X1_OTHER + ATTENTION7 + kvlib.mlp(H7, BLOCK2)])
def test_second_block_right_answers(answer):
    assert_correct(exercises05.check_second_block(answer))


# Notebook 05, exercise 3: gelu(6), gelu(-6), gelu(-0.3), predicted

@pytest.mark.parametrize("answer, words", [
    ("6, 0, -0.1", "give three numbers"),
    ((6, 0), "got an answer of shape (2,)"),
    ((3, 0, -0.115), "not 0.5"),
    ((0, 0, 0), "lets almost everything through"),
    ((6, -6, -0.115), "not -6"),
    ((6, 1, -0.115), "about 0"),
    ((6, 0, 0), "ReLU would give 0 here"),
    ((6, 0, -0.3), "that is x itself"),
    ((6, 0, 0.115), "the sign is wrong"),
    ((6, 0, -0.185), "not by 1 - Phi"),
    ((6, 0, -0.17), "depth of the dip"),
    ((6, 0, -0.05), "with Phi(-0.3) = 0.382"),
    ((6, 0, float("nan")), "got nan"),
    ((float("nan"), 0, -0.115), "about 6"),
])
def test_gelu_values_wrong_answers(answer, words):
    assert_not_yet(exercises05.check_gelu_values(answer), words)


@pytest.mark.parametrize("answer", [
    (6, 0, -0.115), (6.0, 0.0, -0.3 * 0.382), [5.999, -0.001, -0.11], np.array([6, 0, -0.12]),
    (6, -0.0, -0.1146), tuple(float(kvlib.gelu(np.array(x))) for x in (6.0, -6.0, -0.3)),
])
def test_gelu_values_right_answers(answer):
    assert_correct(exercises05.check_gelu_values(answer))


# ---------------------------------------------------------------- solutions, run in their notebooks


@lru_cache(maxsize=None)
def notebook_namespace(name):
    """Run every code cell of a committed notebook, in order, in one namespace."""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    namespace = {}
    figures = set(plt.get_fignums())
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{name} cell {index}", "exec"), namespace)
    for number in set(plt.get_fignums()) - figures:
        plt.close(number)
    return namespace


EXERCISES = [
    ("03_causal_masking", exercises03, {1: "check_mask", 2: "check_masked_weights",
                                        3: "check_changed_rows"}),
    ("04_multi_head_attention", exercises04, {1: "check_head_slice", 2: "check_three_heads",
                                              3: "check_attention_output"}),
    ("05_mlp_residual_stream", exercises05, {1: "check_hidden_shape", 2: "check_second_block",
                                             3: "check_gelu_values"}),
]


@pytest.mark.parametrize("name, module, checkers", EXERCISES, ids=[e[0] for e in EXERCISES])
def test_every_solution_passes_its_checker_in_its_notebook(name, module, checkers):
    assert sorted(module.SOLUTIONS) == sorted(checkers)
    base = notebook_namespace(name)
    assert base["answer"] is ...   # the notebook leaves every exercise for the student
    for number, checker in checkers.items():
        namespace = dict(base)
        exec(module.SOLUTIONS[number], namespace)
        feedback = getattr(module, checker)(namespace["answer"])
        assert feedback, (name, number, feedback)
        assert repr(feedback).startswith("Correct:")
        assert f"exercise {number}" in module.solution(number).data
    with pytest.raises(ValueError, match="there is no exercise 9"):
        module.solution(9)


@pytest.mark.parametrize("name, module, checkers", EXERCISES, ids=[e[0] for e in EXERCISES])
def test_each_notebook_calls_its_checkers_on_unfilled_answers(name, module, checkers):
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    sources = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    lesson = "exercises"           # each notebook imports its checkers as exercises
    for checker in checkers.values():
        cell = next(s for s in sources if f"{lesson}.{checker}(answer)" in s)
        outputs = next(c["outputs"] for c in notebook["cells"] if "".join(c["source"]) == cell)
        text = "".join(outputs[0]["data"]["text/plain"])
        assert text.startswith("Not yet:") and "not filled in yet" in text
