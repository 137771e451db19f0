"""What kvlib.plots draws: boxes sized by shape and labelled, masked cells told apart, labels."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import kvlib  # noqa: E402
from kvlib import plots  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def outlined_boxes(ax):
    """The black outline of each matrix, left to right: (width, height) in data units."""
    boxes = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()
             and p.get_edgecolor()[:3] == (0.0, 0.0, 0.0)]
    return [(round(b.get_width(), 6), round(b.get_height(), 6))
            for b in sorted(boxes, key=lambda b: b.get_x())]


def texts(ax):
    return [t.get_text() for t in ax.texts]


def test_shape_diagram_boxes_follow_the_shapes_and_are_labelled():
    ax = plots.shape_diagram(("X", (5, 4)), "@", ("Wq", (4, 4)), "=", ("Q", (5, 4)))
    assert outlined_boxes(ax) == [(4, 5), (4, 4), (4, 5)]   # columns wide, rows tall
    for label in ("X", "Wq", "Q", "(5, 4)", "(4, 4)", "@", "="):
        assert label in texts(ax)


def test_shape_diagram_with_values_draws_them():
    X = np.arange(20.0).reshape(5, 4)
    ax = plots.shape_diagram(("X", X))
    np.testing.assert_array_equal(ax.images[0].get_array(), X)
    with pytest.raises(ValueError, match="2-D"):
        plots.shape_diagram(("heads", np.zeros((2, 5, 2))))
    with pytest.raises(ValueError, match="at least one"):
        plots.shape_diagram("@")


def test_large_matrices_are_scaled_to_fit_but_keep_their_proportions():
    ax = plots.shape_diagram(("W_up", (768, 3072)))
    (width, height), = outlined_boxes(ax)
    assert width / height == pytest.approx(4.0) and width <= 12


def test_cache_diagram_tells_old_rows_from_new_ones():
    ax = plots.cache_diagram(5, 1, 4)
    assert outlined_boxes(ax) == [(4, 6), (4, 6)]
    assert {"K cache", "V cache", "(6, 4)"} <= set(texts(ax))
    new = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb(
        plots.NEW_ROWS_COLOR)]
    assert [(p.get_width(), p.get_height()) for p in new] == [(4, 1), (4, 1)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["cached (5)", "new (1)"]


def test_attention_heatmap_labels_and_masked_cells():
    weights = kvlib.softmax(kvlib.apply_mask(np.zeros((3, 3)), kvlib.causal_mask(3)))
    labels = ["<bos>", "How", "are"]
    ax = plots.attention_heatmap(weights, labels, labels, mask=kvlib.causal_mask(3))
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
    assert [t.get_text() for t in ax.get_yticklabels()] == labels
    shown = ax.images[0].get_array()
    np.testing.assert_array_equal(shown.mask, ~kvlib.causal_mask(3))   # drawn as masked
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in hatched) == [(1, 0), (2, 0), (2, 1)]
    assert "0.50" in texts(ax) and len(texts(ax)) == 6      # values only in visible cells
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    assert ax.images[0].get_cmap().name.startswith(plots.COLORMAP)


def test_attention_heatmaps_one_panel_per_head_and_bad_input():
    weights = np.full((2, 4, 4), 0.25)
    fig = plots.attention_heatmaps(weights, list("abcd"), list("abcd"))
    heads = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heads] == ["head 0", "head 1"]
    with pytest.raises(ValueError, match="query labels"):
        plots.attention_heatmap(weights[0], ["a"], list("abcd"))
    with pytest.raises(ValueError, match=r"\(heads, T, S\)"):
        plots.attention_heatmaps(weights[0], list("abcd"), list("abcd"))


def test_probability_bars_and_matrix_heatmap():
    ax = plots.probability_bars([0.1, 0.6, 0.3], ["a", "b", "c"], highlight=1)
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([0.1, 0.6, 0.3])
    assert ax.patches[1].get_facecolor()[:3] == matplotlib.colors.to_rgb(plots.NEW_ROWS_COLOR)
    assert ax.get_ylabel() == "probability" and ax.get_title()
    ax = plots.matrix_heatmap(np.eye(2), ["r0", "r1"], ["c0", "c1"], title="I")
    assert texts(ax) == ["1.00", "0.00", "0.00", "1.00"] and ax.get_title() == "I"
    with pytest.raises(ValueError, match="one label per probability"):
        plots.probability_bars([0.5, 0.5], ["a"])
