"""What kvlib.plots draws: boxes sized by shape and labelled, ids written as text, masked cells
told apart (as one artist however many there are), colour scales, row maxima, labels."""

import matplotlib
import numpy as np
import pytest
from matplotlib.patches import Rectangle

import kvlib
from kvlib import plots


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
    assert covered_cells(ax, 3, 3) == [(0, 1), (0, 2), (1, 2)]     # hatched: the masked cells
    assert "0.50" in texts(ax) and len(texts(ax)) == 6      # values only in visible cells
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    assert ax.images[0].get_cmap().name.startswith(plots.COLORMAP)


def covered_cells(ax, rows, columns):
    """(row, column) of the cells the heatmap's hatched patches cover."""
    hatched = [p for p in ax.patches if p.get_hatch()]
    return sorted((r, c) for r in range(rows) for c in range(columns)
                  if any(p.get_path().contains_point((c, r)) for p in hatched))


@pytest.mark.parametrize("tokens", [3, 12, 32])
def test_masked_cells_are_one_artist_at_any_size(tokens):
    """A hatched patch per masked cell made 8 heads x 32 tokens take seconds to draw: the
    artists a heatmap holds must not grow with the number of masked cells."""
    mask = kvlib.causal_mask(tokens)
    weights = kvlib.softmax(kvlib.apply_mask(np.zeros((tokens, tokens)), mask))
    labels = [f"t{i}" for i in range(tokens)]
    ax = plots.attention_heatmap(weights, labels, labels, mask=mask, show_values=False,
                                 colorbar=False, max_labels=8)
    assert len(ax.patches) == 1 and len(ax.images) == 1 and not ax.collections
    assert covered_cells(ax, tokens, tokens) == [tuple(cell) for cell in np.argwhere(~mask)]
    assert len(ax.get_xticklabels()) <= 8 and len(ax.get_yticklabels()) <= 8
    assert ax.get_xticklabels()[0].get_text() == "t0"
    if tokens > 8:
        step = -(-tokens // 8)
        assert [t.get_text() for t in ax.get_yticklabels()][1] == f"t{step}"


def test_an_unmasked_heatmap_has_no_hatching():
    ax = plots.attention_heatmap(np.full((2, 2), 0.5), ["a", "b"], ["a", "b"],
                                 mask=np.ones((2, 2), bool))
    assert not [p for p in ax.patches if p.get_hatch()]
    with pytest.raises(ValueError, match="the weights' shape"):
        plots.attention_heatmap(np.full((2, 2), 0.5), ["a", "b"], ["a", "b"],
                                mask=np.ones((3, 3), bool))


def test_the_colour_scale_can_span_the_visible_weights():
    weights = np.array([[1.0, 0.0], [0.3, 0.2]])
    mask = np.array([[True, False], [True, True]])
    ax = plots.attention_heatmap(weights, ["a", "b"], ["a", "b"], mask=mask)
    assert ax.images[0].get_clim() == (0.0, 1.0)              # the default: 0 to 1
    ax = plots.attention_heatmap(weights, ["a", "b"], ["a", "b"], mask=mask, vmin=None,
                                 vmax=None)
    assert ax.images[0].get_clim() == (0.2, 1.0)              # masked 0.0 does not count
    flat = plots.attention_heatmap(np.full((2, 2), 0.5), ["a", "b"], ["a", "b"], vmin=None,
                                   vmax=None)
    low, high = flat.images[0].get_clim()
    assert low < 0.5 < high                                   # a constant still gets a scale
    fig = plots.attention_heatmaps(np.array([[[0.1, 0.9]], [[0.4, 0.6]]]), ["q"], ["a", "b"],
                                   vmin=None, vmax=None)
    heads = [ax for ax in fig.axes if ax.images]
    assert {ax.images[0].get_clim() for ax in heads} == {(0.1, 0.9)}   # one scale for all heads


def test_each_rows_maximum_can_be_framed():
    weights = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.1, 0.1, 0.8]])
    mask = np.array([[True, False, False], [True, True, False], [True, True, True]])
    ax = plots.attention_heatmap(weights, list("abc"), list("abc"), mask=mask,
                                 mark_row_max=True)
    frames = ax.collections
    assert len(frames) == 2                                   # a black and a white outline
    centres = [tuple(np.round(path.vertices[:4].mean(axis=0), 6)) for path in
               frames[0].get_paths()]
    assert centres == [(0, 0), (0, 1), (2, 2)]                # (column, row); row 0's 0.5 is masked
    ax = plots.attention_heatmap(weights, list("abc"), list("abc"))
    assert not ax.collections                                 # off by default


def test_box_text_row_labels_and_caption():
    box = plots.Box("ids", (3, 1), text=[["0"], ["3"], ["7"]], row_labels=["<bos>", "How", "are"],
                    caption="(3,)")
    ax = plots.shape_diagram(box, plots.Arrow("lookup"), ("X", (3, 4)))
    shown = texts(ax)
    for label in ("0", "3", "7", "<bos>", "How", "are", "(3,)", "lookup", "X", "(3, 4)"):
        assert label in shown
    assert "(3, 1)" not in shown                              # the caption replaces the shape
    assert not ax.images                                      # ids are text, not colours
    first_box = min(p.get_x() for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill())
    label_x = [a for a in ax.texts if a.get_text() == "<bos>"][0].get_position()[0]
    assert 0 < label_x < first_box                            # left of its box, inside the axes
    with pytest.raises(ValueError, match="3 rows of 1 strings"):
        plots.Box("ids", (3, 1), text=[["0"], ["3"]])
    with pytest.raises(ValueError, match="3 row labels"):
        plots.Box("ids", (3, 1), row_labels=["a"])


def test_whole_path_labels_every_step_and_writes_ids_as_text():
    tokenizer = kvlib.ToyTokenizer()
    ids = tokenizer.encode(kvlib.ARTICLE_PROMPT)
    ax = plots.whole_path(tokenizer.tokens(ids), ids, 4, 12, 3, 5, "I")
    shown = texts(ax)
    for label in ("lookup", "block 1", "block 2", "block 3", "unembed", "argmax of\nthe last row",
                  "ids", "X", "X1", "X2", "X3", "logits", "(5, 4)", "(5, 12)", "'I'", "5",
                  "<bos>", "?"):
        assert label in shown, label
    assert [t for t in shown if t in {"0", "3", "7", "1", "9"}] == ["0", "3", "7", "1", "9"]
    assert not ax.images                                      # shapes only, no values
    assert outlined_boxes(ax)[0] == (1, 5) and outlined_boxes(ax)[-2] == (12, 5)
    params = kvlib.init_params()
    stream = [kvlib.embed(np.array(ids), params.embedding)]
    for layer in params.layers:
        stream.append(kvlib.decoder_block(stream[-1], layer, 2, mask=kvlib.causal_mask(5)))
    logits = kvlib.unembed(stream[-1], params.embedding)
    ax = plots.whole_path(tokenizer.tokens(ids), ids, 4, 12, 3, 5, "I", values=stream + [logits])
    assert len(ax.images) == 5                                # X .. X3 and logits, coloured
    np.testing.assert_array_equal(ax.images[-1].get_array(), logits)
    with pytest.raises(ValueError, match="5 matrices"):
        plots.whole_path(tokenizer.tokens(ids), ids, 4, 12, 3, 5, "I", values=stream)
    with pytest.raises(ValueError, match="one token per id"):
        plots.whole_path(["a"], ids, 4, 12, 3, 5, "I")


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
