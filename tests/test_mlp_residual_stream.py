"""Notebook 05 (the MLP, the residual stream and the stack of blocks): its widgets driven
headless (the stream explorer's stream, vector and update sizes; the GeLU explorer; nothing
leaks: every test leaves the figures as it found them), and its exercise checkers, with
tables of typical wrong answers (each with its diagnosis) and of valid answers in other
forms, and the published solutions run in the notebook's own variables."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import bar_heights, image_of, no_new_figures

import kvlib
from kvlib.exercises import mlp_residual_stream as exercises
from kvlib.widgets import mlp_residual_stream as widgets

pytestmark = pytest.mark.usefixtures("no_figure_leaks")

IDS = [0, 3, 7, 1, 9]


# ---------------------------------------------------------------------------------------------
# The widgets
# ---------------------------------------------------------------------------------------------

def test_residual_stream_is_the_stack_of_decoder_blocks(params):
    stream = widgets.residual_stream(params, IDS)
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
    box = widgets.stream_explorer(params, blocks=3, token=4)
    heat, vector, sizes = box.figure.axes[:3]
    stream = widgets.residual_stream(params, IDS)
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
    box = widgets.stream_explorer(params, token=4)
    box.controls["prompt"].value = "I am"
    assert box.controls["token"].value == 2
    assert [label for label, _ in box.controls["token"].options] == ["0 <bos>", "1 I", "2 am"]
    assert image_of(box.figure.axes[0]).shape == (3, 4)
    box.controls["prompt"].value = "I am a robot"
    assert "unknown word" in box.message.value and box.status.value == ""
    box.controls["prompt"].value = "How are you?"
    assert box.message.value == "" and len(box.controls["token"].options) == 5


def test_stream_explorer_does_not_leak(params):
    box = widgets.stream_explorer(params)
    with no_new_figures():
        for step in range(24):
            box.controls["blocks"].value = step % 4
            box.controls["token"].value = step % 5
    assert len(box.figure.axes) == 3


def test_gelu_explorer_plots_gelu_and_relu_and_rejects_bad_values():
    box = widgets.gelu_explorer()
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
    with no_new_figures():
        for step in range(24):
            box.controls["range"].value = (-4.0 + step % 3, 4.0)
            box.controls["x"].value = step / 4


def test_stream_legend_tells_the_updates_apart_at_every_block_count(params):
    for blocks in (0, 1, 3):
        box = widgets.stream_explorer(params, blocks=blocks)
        legend = box.figure.axes[2].get_legend()
        entries = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
        attention = entries["attention update"].get_facecolor()
        mlp = entries["MLP update"].get_facecolor()
        assert matplotlib.colors.same_color(attention, widgets.ATTENTION_COLOR)
        assert matplotlib.colors.same_color(mlp, widgets.MLP_COLOR)
        assert ("block not applied yet" in entries) == (blocks < 3)


@pytest.mark.parametrize("x, shown", [(1e308, "gelu(1e+308) = 1e+308"),
                                      (-1e308, "gelu(-1e+308) = 0.000"),
                                      (12345678.0, "gelu(1.23457e+07) = 1.235e+07"),
                                      (-3.0, "gelu(-3) = -0.004")])
def test_gelu_explorer_prints_large_values_readably(x, shown):
    box = widgets.gelu_explorer()
    box.controls["x"].value = x                       # no overflow warning (warnings are errors)
    assert shown in box.status.value and len(box.status.value) < 120
    assert box.message.value == ""


def test_gelu_plot_marks_the_dip():
    fig, ax = plt.subplots()
    try:
        widgets.gelu_plot(-4, 4, ax=ax)
        assert any(t.get_text().startswith("the dip: -0.170") for t in ax.texts)
        grid = np.linspace(-2, 0, 200001)
        assert abs(grid[np.argmin(kvlib.gelu(grid))] - widgets.GELU_MINIMUM_X) < 1e-4
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The exercise checkers: typical wrong answers, each with its diagnosis; valid answers
# ---------------------------------------------------------------------------------------------

# Exercise 1: GPT-2 small's hidden shape for a 10-token prompt

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
    not_yet(exercises.check_hidden_shape(answer), words)


@pytest.mark.parametrize("answer", [(10, 3072), [10, 3072], (10.0, 3072.0), np.array([10, 3072]),
                                    (np.int64(10), kvlib.GPT2_SMALL.d_ff)])
def test_hidden_shape_right_answers(answer):
    correct(exercises.check_hidden_shape(answer))


# Exercise 2: X2 of "I am fine and you?" from its X1, by hand

MASK7 = kvlib.causal_mask(7)
PARAMS = kvlib.init_params()
X1_OTHER = exercises.practice_stream()
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
    not_yet(exercises.check_second_block(answer), words)


@pytest.mark.parametrize("answer", [X2_OTHER, X2_OTHER.tolist(),
                                    kvlib.decoder_block(X1_OTHER, BLOCK2, 2, mask=MASK7),
                                    X1_OTHER + ATTENTION7 + kvlib.mlp(H7, BLOCK2)])
def test_second_block_right_answers(answer):
    correct(exercises.check_second_block(answer))


# Exercise 3: gelu(6), gelu(-6), gelu(-0.3), predicted

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
    not_yet(exercises.check_gelu_values(answer), words)


@pytest.mark.parametrize("answer", [
    (6, 0, -0.115), (6.0, 0.0, -0.3 * 0.382), [5.999, -0.001, -0.11], np.array([6, 0, -0.12]),
    (6, -0.0, -0.1146), tuple(float(kvlib.gelu(np.array(x))) for x in (6.0, -6.0, -0.3)),
])
def test_gelu_values_right_answers(answer):
    correct(exercises.check_gelu_values(answer))


def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("mlp_residual_stream"), exercises,
                          {1: exercises.check_hidden_shape, 2: exercises.check_second_block,
                           3: exercises.check_gelu_values})
