"""Pictures of the computation: shape diagrams, attention heatmaps, distributions.

Every function draws into a given Axes (or a new figure when ax is None) and returns the Axes,
so that widgets can redraw into the same figure instead of creating new ones. Colours come
from viridis, which is perceptually uniform and readable with colour-blindness.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

COLORMAP = "viridis"
OLD_ROWS_COLOR = "#bcd4e6"   # cached rows in a cache diagram
NEW_ROWS_COLOR = "#fde725"   # the rows appended by this step (viridis' yellow)
BOX_COLOR = "#d9e8f2"
MASKED_COLOR = "#d0d0d0"


@dataclass(frozen=True)
class Box:
    """One matrix in a shape diagram: its name, its shape, and optionally its values
    (drawn as coloured cells) and how many of its last rows are new (drawn highlighted)."""

    name: str
    shape: tuple[int, int]
    values: np.ndarray | None = None
    new_rows: int = 0

    @classmethod
    def of(cls, term) -> Box:
        """A Box from a Box, a (name, shape) pair, or a (name, 2-D array) pair."""
        if isinstance(term, Box):
            return term
        name, content = term
        if isinstance(content, np.ndarray):
            if content.ndim != 2:
                raise ValueError(f"{name}: a shape diagram draws 2-D matrices, got {content.shape}")
            return cls(name, content.shape, values=content)
        return cls(name, tuple(int(n) for n in content))

    @property
    def label(self) -> str:
        return f"{self.name} {self.shape}"


def _new_axes(ax, figsize):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def shape_diagram(*terms, ax=None, title: str | None = None, cell: float | None = None):
    """Draw a matrix expression as boxes whose sizes follow their shapes.

    ``shape_diagram(("X", (5, 4)), "@", ("Wq", (4, 4)), "=", ("Q", (5, 4)))`` draws
    X (5, 4) @ Wq (4, 4) = Q (5, 4): each matrix a box of rows x columns cells, labelled with
    its name and shape; strings are drawn as operators between the boxes.
    """
    boxes = [term if isinstance(term, str) else Box.of(term) for term in terms]
    matrices = [b for b in boxes if isinstance(b, Box)]
    if not matrices:
        raise ValueError("shape_diagram needs at least one (name, shape) term")
    largest = max(max(b.shape) for b in matrices)
    cell = cell if cell is not None else min(1.0, 12.0 / largest)
    width = sum(b.shape[1] * cell + 1.2 if isinstance(b, Box) else 1.2 for b in boxes)
    height = max(b.shape[0] for b in matrices) * cell
    ax = _new_axes(ax, (min(2 + 0.55 * width, 14), 1.6 + 0.5 * height))
    x = 0.0
    for term in boxes:
        if isinstance(term, str):
            ax.text(x + 0.6, -height / 2, term, ha="center", va="center", fontsize=16)
            x += 1.2
            continue
        _draw_box(ax, term, x, cell, height)
        x += term.shape[1] * cell + 1.2
    ax.set_xlim(-0.6, x - 0.6)
    ax.set_ylim(-height - 1.2, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title)
    return ax


def _draw_box(ax, box: Box, x: float, cell: float, height: float) -> None:
    rows, columns = box.shape
    top = -(height - rows * cell) / 2  # centre the box vertically
    if box.values is not None:
        ax.imshow(box.values, cmap=COLORMAP, extent=(x, x + columns * cell, top - rows * cell, top),
                  aspect="auto", zorder=1)
    else:
        old = rows - box.new_rows
        ax.add_patch(Rectangle((x, top - old * cell), columns * cell, old * cell,
                               facecolor=OLD_ROWS_COLOR if box.new_rows else BOX_COLOR,
                               edgecolor="none", zorder=1))
        if box.new_rows:
            ax.add_patch(Rectangle((x, top - rows * cell), columns * cell, box.new_rows * cell,
                                   facecolor=NEW_ROWS_COLOR, edgecolor="none", zorder=1,
                                   label="new"))
    if max(rows, columns) <= 40:  # the grid of cells, where it is readable
        for r in range(1, rows):
            ax.plot([x, x + columns * cell], [top - r * cell] * 2, color="white", lw=0.8, zorder=2)
        for c in range(1, columns):
            ax.plot([x + c * cell] * 2, [top, top - rows * cell], color="white", lw=0.8, zorder=2)
    ax.add_patch(Rectangle((x, top - rows * cell), columns * cell, rows * cell, fill=False,
                           edgecolor="black", lw=1.2, zorder=3))
    ax.text(x + columns * cell / 2, top + 0.25, box.name, ha="center", va="bottom",
            fontsize=12, fontweight="bold")
    ax.text(x + columns * cell / 2, top - rows * cell - 0.25, str(box.shape), ha="center",
            va="top", fontsize=10)


def cache_diagram(cached: int, new: int = 1, d_model: int = 4, ax=None, names=("K", "V"),
                  title: str | None = None):
    """The cache of one layer: K and V with their `cached` old rows and `new` appended rows
    told apart (new rows highlighted)."""
    if cached < 0 or new < 0 or cached + new < 1:
        raise ValueError(f"need cached >= 0, new >= 0 and at least one row, got {cached}, {new}")
    terms = []
    for name in names:
        terms.append(Box(f"{name} cache", (cached + new, d_model), new_rows=new))
    ax = shape_diagram(*terms, ax=ax, title=title)
    if new:
        ax.legend(handles=[Rectangle((0, 0), 1, 1, color=OLD_ROWS_COLOR),
                           Rectangle((0, 0), 1, 1, color=NEW_ROWS_COLOR)],
                  labels=[f"cached ({cached})", f"new ({new})"], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def matrix_heatmap(matrix, row_labels=None, column_labels=None, ax=None, title=None,
                   show_values: bool = True, colorbar: bool = False, cmap: str = COLORMAP,
                   vmin: float | None = None, vmax: float | None = None):
    """A matrix as coloured cells with its values written in, labelled rows and columns.

    Colours span the matrix's own range unless vmin and vmax fix the scale (so that, say, a
    row copied from the lookup table keeps its colours in X).
    """
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"matrix_heatmap draws a 2-D matrix, got shape {matrix.shape}")
    rows, columns = matrix.shape
    ax = _new_axes(ax, (1.2 + 0.6 * columns, 1.0 + 0.45 * rows))
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax)
    _label_axes(ax, rows, columns, row_labels, column_labels)
    if show_values:
        _write_values(ax, matrix, image)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if title:
        ax.set_title(title)
    return ax


def attention_heatmap(weights, query_labels, key_labels, mask=None, ax=None, title=None,
                      show_values: bool = True, colorbar: bool = True):
    """Attention weights (T, S) with query tokens down the side and key tokens along the top.

    Cells where mask is False are drawn grey and hatched, with no value: masked, not zero.
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2:
        raise ValueError(f"attention_heatmap draws one head's (T, S) weights, got {weights.shape}")
    rows, columns = weights.shape
    if len(query_labels) != rows or len(key_labels) != columns:
        raise ValueError(f"need {rows} query labels and {columns} key labels, got "
                         f"{len(query_labels)} and {len(key_labels)}")
    ax = _new_axes(ax, (1.6 + 0.7 * columns, 1.2 + 0.55 * rows))
    shown = np.ma.masked_array(weights, mask=None if mask is None else ~np.asarray(mask, bool))
    cmap = plt.get_cmap(COLORMAP).with_extremes(bad=MASKED_COLOR)
    image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0)
    if mask is not None:
        for r, c in zip(*np.nonzero(~np.asarray(mask, bool))):
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///",
                                   edgecolor="#888888", lw=0, label="masked"))
    _label_axes(ax, rows, columns, query_labels, key_labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if show_values:
        _write_values(ax, shown, image, digits=2)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    ax.set_title(title or "Attention weights")
    return ax


def attention_heatmaps(weights, query_labels, key_labels, mask=None, fig=None, title=None):
    """One heatmap per head, side by side: weights (h, T, S). Returns the figure."""
    weights = np.asarray(weights)
    if weights.ndim != 3:
        raise ValueError(f"attention_heatmaps draws (heads, T, S) weights, got {weights.shape}")
    n_heads, rows, columns = weights.shape
    if fig is None:
        fig = plt.figure(figsize=(n_heads * (1.4 + 0.7 * columns), 1.6 + 0.55 * rows),
                         layout="constrained")
    fig.clear()
    axes = fig.subplots(1, n_heads, squeeze=False)[0]
    for head, ax in enumerate(axes):
        attention_heatmap(weights[head], query_labels, key_labels, mask=mask, ax=ax,
                          title=f"head {head}", colorbar=False)
    fig.colorbar(axes[0].images[0], ax=list(axes), fraction=0.046 / n_heads ** 0.5, pad=0.04,
                 label="attention weight")
    if title:
        fig.suptitle(title)
    return fig


def probability_bars(probabilities, labels, ax=None, title=None, highlight: int | None = None):
    """A distribution over the vocabulary as labelled bars; `highlight` marks one token."""
    probabilities = np.asarray(probabilities, dtype=float)
    if probabilities.ndim != 1 or len(labels) != len(probabilities):
        raise ValueError(f"need one label per probability, got {len(labels)} labels for "
                         f"shape {probabilities.shape}")
    ax = _new_axes(ax, (1.5 + 0.55 * len(labels), 3.0))
    colors = [plt.get_cmap(COLORMAP)(0.35)] * len(labels)
    if highlight is not None:
        colors[highlight] = NEW_ROWS_COLOR
    ax.bar(range(len(labels)), probabilities, color=colors, edgecolor="black", lw=0.5)
    ax.set_xticks(range(len(labels)), [f"{i}\n{label}" for i, label in enumerate(labels)])
    ax.set_ylim(0, 1)
    ax.set_xlabel("token (id and word)")
    ax.set_ylabel("probability")
    ax.set_title(title or "Next-token distribution")
    return ax


def _label_axes(ax, rows, columns, row_labels, column_labels):
    ax.set_xticks(range(columns), column_labels if column_labels is not None else range(columns))
    ax.set_yticks(range(rows), row_labels if row_labels is not None else range(rows))
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("bottom")


def _write_values(ax, matrix, image, digits: int = 2):
    normalised = image.norm(np.ma.filled(matrix.astype(float), np.nan))
    for (r, c), value in np.ndenumerate(np.ma.filled(matrix.astype(float), np.nan)):
        if np.isnan(value):
            continue
        color = "black" if normalised[r, c] > 0.55 else "white"
        ax.text(c, r, f"{value:.{digits}f}", ha="center", va="center", fontsize=8, color=color)
