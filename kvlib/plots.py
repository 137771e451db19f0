"""Pictures of the computation: shape diagrams, attention heatmaps, distributions.

Every function draws into a given Axes (or a new figure when ax is None) and returns the Axes,
so that widgets can redraw into the same figure instead of creating new ones. Colours come
from viridis, which is perceptually uniform and readable with colour-blindness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection, PatchCollection, PolyCollection
from matplotlib.patches import PathPatch, Rectangle
from matplotlib.path import Path

from .checks import as_whole_number
from .grouped import group_size, query_groups

COLORMAP = "viridis"
OLD_ROWS_COLOR = "#bcd4e6"   # cached rows in a cache diagram
NEW_ROWS_COLOR = "#fde725"   # the rows appended by this step (viridis' yellow)
BOX_COLOR = "#d9e8f2"
MASKED_COLOR = "#d0d0d0"
WITH_CACHE_COLOR = "#21918c"     # viridis teal: a run with the KV cache
WITHOUT_CACHE_COLOR = "#440154"  # viridis purple: the same run recomputing everything
MAX_HEADS = 256                  # more query heads than this cannot be told apart in a drawing
MAX_LABELLED_HEADS = 16          # beyond this many heads of a row, only some are numbered


@dataclass(frozen=True)
class Box:
    """One matrix in a shape diagram: its name, its shape, and optionally its values
    (drawn as coloured cells) and how many of its last rows are new (drawn highlighted).

    text writes a string in each cell instead of colouring it (token ids are labels, not
    sizes: the big_picture lesson); row_labels are written left of the rows; caption replaces the
    shape written under the box.
    """

    name: str
    shape: tuple[int, int]
    values: np.ndarray | None = None
    new_rows: int = 0
    text: tuple[tuple[str, ...], ...] | None = None
    row_labels: tuple[str, ...] | None = None
    caption: str | None = None

    def __post_init__(self):
        rows, columns = self.shape
        if self.text is not None:
            text = tuple(tuple(str(cell) for cell in row) for row in self.text)
            if len(text) != rows or any(len(row) != columns for row in text):
                raise ValueError(f"{self.name}: text must have {rows} rows of {columns} "
                                 f"strings, the box's shape")
            object.__setattr__(self, "text", text)
        if self.row_labels is not None:
            labels = tuple(str(label) for label in self.row_labels)
            if len(labels) != rows:
                raise ValueError(f"{self.name}: need {rows} row labels, got {len(labels)}")
            object.__setattr__(self, "row_labels", labels)

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

    @property
    def left_margin(self) -> float:
        """Room its row labels need on the left, in cells of the diagram."""
        if self.row_labels is None:
            return 0.0
        return 0.3 + 0.17 * max(len(label) for label in self.row_labels)


@dataclass(frozen=True)
class Arrow:
    """A step between two matrices in a shape diagram (big_picture): an arrow with a label
    above it ("lookup", "block 1", ...)."""

    label: str = ""

    def width(self, character: float) -> float:
        """The arrow's slot, wide enough for its label when a character is `character`
        diagram units wide."""
        longest = max((len(line) for line in self.label.split("\n")), default=0)
        return max(1.6, character * longest + 0.8)


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
    boxes = [term if isinstance(term, (str, Arrow)) else Box.of(term) for term in terms]
    matrices = [b for b in boxes if isinstance(b, Box)]
    if not matrices:
        raise ValueError("shape_diagram needs at least one (name, shape) term")
    largest = max(max(b.shape) for b in matrices)
    cell = cell if cell is not None else min(1.0, 12.0 / largest)

    character = 0.15   # a label's character width in diagram units, found by iterating:

    def slot(term) -> float:
        if isinstance(term, str):
            return 1.2
        if isinstance(term, Arrow):
            return term.width(character)
        return term.shape[1] * cell + 1.2 + term.left_margin

    for _ in range(4):  # the figure is at most 14 in wide, so wider slots shrink every unit
        width = sum(slot(term) for term in boxes)
        character = 0.08 / min(0.55, 12.0 / width)   # a 9-point character is about 0.08 in
    width = sum(slot(term) for term in boxes)
    height = max(b.shape[0] for b in matrices) * cell
    shrink = min(1.0, 12.0 / (0.55 * width))   # a wide diagram is scaled down to 14 in
    ax = _new_axes(ax, (min(2 + 0.55 * width, 14), round(1.6 + 0.5 * height * shrink, 1)))
    x = 0.0
    for term in boxes:
        if isinstance(term, str):
            ax.text(x + 0.6, -height / 2, term, ha="center", va="center", fontsize=16)
        elif isinstance(term, Arrow):
            arrow = term.width(character)
            ax.annotate("", xy=(x + arrow - 0.25, -height / 2), xytext=(x + 0.25, -height / 2),
                        arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 1.5})
            ax.text(x + arrow / 2, -height / 2 + 0.25, term.label, ha="center", va="bottom",
                    fontsize=9)
        else:
            _draw_box(ax, term, x + term.left_margin, cell, height)
        x += slot(term)
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
    elif box.text is not None:
        ax.add_patch(Rectangle((x, top - rows * cell), columns * cell, rows * cell,
                               facecolor="white", edgecolor="none", zorder=1))
        for (r, c), text in np.ndenumerate(np.array(box.text, dtype=object)):
            ax.text(x + (c + 0.5) * cell, top - (r + 0.5) * cell, text, ha="center",
                    va="center", fontsize=10, zorder=4)
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
        grid = "#bbbbbb" if box.text is not None else "white"
        for r in range(1, rows):
            ax.plot([x, x + columns * cell], [top - r * cell] * 2, color=grid, lw=0.8, zorder=2)
        for c in range(1, columns):
            ax.plot([x + c * cell] * 2, [top, top - rows * cell], color=grid, lw=0.8, zorder=2)
    if box.row_labels is not None:
        for r, label in enumerate(box.row_labels):
            ax.text(x - 0.15, top - (r + 0.5) * cell, label, ha="right", va="center",
                    fontsize=9)
    ax.add_patch(Rectangle((x, top - rows * cell), columns * cell, rows * cell, fill=False,
                           edgecolor="black", lw=1.2, zorder=3))
    ax.text(x + columns * cell / 2, top + 0.25, box.name, ha="center", va="bottom",
            fontsize=12, fontweight="bold")
    ax.text(x + columns * cell / 2, top - rows * cell - 0.25,
            str(box.shape) if box.caption is None else box.caption, ha="center", va="top",
            fontsize=10)


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


HATCH_COLOR = "#888888"
ROW_MAX_COLOR = "white"


def masked_cells_hatch(mask) -> PathPatch:
    """The grey "///" hatching of the cells where mask is False
    (causal_masking and multi_head_attention), as ONE patch whose path is one rectangle per run of
    masked cells in a row. One artist for any number of masked cells: a hatched patch per cell made
    8 heads x 32 tokens take seconds to draw."""
    hidden = ~np.asarray(mask, dtype=bool)
    vertices, codes = [], []
    for row, line in enumerate(hidden):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], line.astype(int), [0]])))
        for start, stop in zip(edges[::2], edges[1::2]):
            left, right, top, bottom = start - 0.5, stop - 0.5, row - 0.5, row + 0.5
            vertices += [(left, top), (right, top), (right, bottom), (left, bottom), (left, top)]
            codes += [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]
    return PathPatch(Path(vertices, codes), fill=False, hatch="///", edgecolor=HATCH_COLOR,
                     lw=0, zorder=2, label="masked")


def _row_max_frames(ax, weights: np.ndarray, mask) -> None:
    """Frame each row's largest visible weight: one collection (black outside, white in)."""
    shown = weights if mask is None else np.where(np.asarray(mask, bool), weights, -np.inf)
    columns = np.argmax(shown, axis=1)
    squares = [[(c - 0.5, r - 0.5), (c + 0.5, r - 0.5), (c + 0.5, r + 0.5), (c - 0.5, r + 0.5)]
               for r, c in enumerate(columns)]
    for color, width in (("black", 3.0), (ROW_MAX_COLOR, 1.2)):
        ax.add_collection(PolyCollection(squares, facecolors="none", edgecolors=color,
                                         linewidths=width, zorder=5, label="row maximum"))


def _visible_range(weights, mask) -> tuple[float, float]:
    visible = np.asarray(weights, dtype=float)
    if mask is not None:
        visible = visible[np.broadcast_to(np.asarray(mask, bool), visible.shape)]
    if visible.size == 0:
        return 0.0, 1.0
    low, high = float(visible.min()), float(visible.max())
    return (low, high) if high > low else (low - 0.05, high + 0.05)


def attention_heatmap(weights, query_labels, key_labels, mask=None, ax=None, title=None,
                      show_values: bool = True, colorbar: bool = True,
                      vmin: float | None = 0.0, vmax: float | None = 1.0,
                      mark_row_max: bool = False, max_labels: int | None = None):
    """Attention weights (T, S) with query tokens down the side and key tokens along the top.

    Cells where mask is False are drawn grey and hatched, with no value: masked, not zero.
    The colours span 0 to 1 by default; vmin=None and vmax=None make them span the visible
    weights instead (one_attention_head: untrained weights all lie between 0.12 and 0.34, which a
    0-1 scale shows as one colour). mark_row_max frames each row's largest weight;
    max_labels labels only every k-th token when there are more (small panels of many heads).
    """
    weights = np.asarray(weights, dtype=float)
    if weights.ndim != 2:
        raise ValueError(f"attention_heatmap draws one head's (T, S) weights, got {weights.shape}")
    rows, columns = weights.shape
    if len(query_labels) != rows or len(key_labels) != columns:
        raise ValueError(f"need {rows} query labels and {columns} key labels, got "
                         f"{len(query_labels)} and {len(key_labels)}")
    if mask is not None and np.shape(mask) != weights.shape:
        raise ValueError(f"the mask {np.shape(mask)} must have the weights' shape {weights.shape}")
    ax = _new_axes(ax, (1.6 + 0.7 * columns, 1.2 + 0.55 * rows))
    low, high = _visible_range(weights, mask)
    vmin = low if vmin is None else vmin
    vmax = high if vmax is None else vmax
    shown = np.ma.masked_array(weights, mask=None if mask is None else ~np.asarray(mask, bool))
    cmap = plt.get_cmap(COLORMAP).with_extremes(bad=MASKED_COLOR)
    image = ax.imshow(shown, cmap=cmap, vmin=vmin, vmax=vmax)
    if mask is not None and not np.all(mask):
        ax.add_patch(masked_cells_hatch(mask))
    if mark_row_max:
        _row_max_frames(ax, weights, mask)
    if max_labels is not None and max(rows, columns) > max_labels:
        _label_every_kth(ax, query_labels, key_labels, max_labels)
    else:
        _label_axes(ax, rows, columns, query_labels, key_labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if show_values:
        _write_values(ax, shown, image, digits=2)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    ax.set_title(title or "Attention weights")
    return ax


def attention_heatmaps(weights, query_labels, key_labels, mask=None, fig=None, title=None,
                       vmin: float | None = 0.0, vmax: float | None = 1.0,
                       mark_row_max: bool = False):
    """One heatmap per head, side by side: weights (h, T, S). Returns the figure.

    vmin/vmax None: one colour scale for all heads, spanning their visible weights."""
    weights = np.asarray(weights)
    if weights.ndim != 3:
        raise ValueError(f"attention_heatmaps draws (heads, T, S) weights, got {weights.shape}")
    n_heads, rows, columns = weights.shape
    low, high = _visible_range(weights, mask)
    vmin = low if vmin is None else vmin
    vmax = high if vmax is None else vmax
    if fig is None:
        fig = plt.figure(figsize=(n_heads * (1.4 + 0.7 * columns), 1.6 + 0.55 * rows),
                         layout="constrained")
    fig.clear()
    axes = fig.subplots(1, n_heads, squeeze=False)[0]
    for head, ax in enumerate(axes):
        attention_heatmap(weights[head], query_labels, key_labels, mask=mask, ax=ax,
                          title=f"head {head}", colorbar=False, vmin=vmin, vmax=vmax,
                          mark_row_max=mark_row_max)
    fig.colorbar(axes[0].images[0], ax=list(axes), fraction=0.046 / n_heads ** 0.5, pad=0.04,
                 label="attention weight")
    if title:
        fig.suptitle(title)
    return fig


def whole_path(tokens, ids, d_model: int, vocab_size: int, n_blocks: int, next_id: int,
               next_token: str, values=None, ax=None, title=None):
    """The whole path of a prediction as one shape diagram (big_picture).

    tokens (T,) and their ids as text (an id is a label, not a size), then "lookup" -> X
    (T, d_model), one labelled arrow per decoder block -> X1 .. Xn, "unembed" -> logits
    (T, vocab_size), and "argmax of the last row" -> the next id. With values, a sequence of
    the n_blocks + 2 matrices (X, X1, .., Xn, logits), the boxes show them as colours.
    """
    T = len(ids)
    if len(tokens) != T:
        raise ValueError(f"need one token per id, got {len(tokens)} tokens and {T} ids")
    names = ["X"] + [f"X{n}" for n in range(1, n_blocks + 1)] + ["logits"]
    shapes = [(T, d_model)] * (n_blocks + 1) + [(T, vocab_size)]
    if values is not None:
        values = [np.asarray(v) for v in values]
        if [v.shape for v in values] != shapes:
            raise ValueError(f"values must be {len(shapes)} matrices of shapes {shapes}, got "
                             f"{[v.shape for v in values]}")
    boxes = [Box(name, shape, values=None if values is None else values[i])
             for i, (name, shape) in enumerate(zip(names, shapes))]
    terms = [Box("ids", (T, 1), text=[[str(i)] for i in ids], row_labels=tokens,
                 caption=f"({T},)"), Arrow("lookup"), boxes[0]]
    for n in range(1, n_blocks + 1):
        terms += [Arrow(f"block {n}"), boxes[n]]
    terms += [Arrow("unembed"), boxes[-1], Arrow("argmax of\nthe last row"),
              Box("next", (1, 1), text=[[str(next_id)]], caption=repr(next_token))]
    return shape_diagram(*terms, ax=ax, title=title)


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


def _label_every_kth(ax, row_labels, column_labels, max_labels: int) -> None:
    for labels, set_ticks in ((column_labels, ax.set_xticks), (row_labels, ax.set_yticks)):
        step = -(-len(labels) // max_labels)
        positions = range(0, len(labels), step)
        set_ticks(positions, [labels[p] for p in positions])
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("bottom")


def _write_values(ax, matrix, image, digits: int = 2):
    normalised = image.norm(np.ma.filled(matrix.astype(float), np.nan))
    for (r, c), value in np.ndenumerate(np.ma.filled(matrix.astype(float), np.nan)):
        if np.isnan(value):
            continue
        color = "black" if normalised[r, c] > 0.55 else "white"
        ax.text(c, r, f"{value:.{digits}f}", ha="center", va="center", fontsize=8, color=color)


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """A count with its noun in the right number: '1 position', '5 positions', '131,072
    cached tokens' (thousands separated, as the readouts write every large number)."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {plural_noun or noun + 's'}"


# ------------------------------------------------------------- grouped-query attention

def group_colors(n_kv_heads: int) -> np.ndarray:
    """One colour per K/V head from viridis (colour-blind safe): (kv, 4) RGBA."""
    return mpl.colormaps["viridis"](np.linspace(0.0, 0.9, n_kv_heads))


def _labelled(n: int) -> set[int]:
    """Which of n heads get a number: all of a few, otherwise about 8, always the last."""
    if n <= MAX_LABELLED_HEADS:
        return set(range(n))
    step = math.ceil(n / 8)
    return set(range(0, n, step)) | {n - 1}


def draw_query_groups(ax, n_heads: int, n_kv_heads: int, title: str | None = None) -> None:
    """The grouping (grouped_query_attention): query heads on top, K/V heads below, each query head
    joined to the K/V head it reads, one colour per K/V head and its group.

    Each K/V head is drawn as wide as its group, under it: query head i sits above K/V
    head i // group. Draws into ax (cleared first).
    """
    n_heads = as_whole_number("query heads", n_heads, 1, MAX_HEADS)
    group = group_size(n_heads, n_kv_heads)
    colors = group_colors(n_kv_heads)
    kv_head_of = query_groups(n_heads, n_kv_heads)
    heads = np.arange(n_heads)
    ax.clear()
    # one collection a row, not one artist a head: 256 heads redraw at once
    ax.add_collection(PatchCollection(
        [Rectangle((head + 0.1, 2.0), 0.8, 0.8) for head in heads],
        facecolors=colors[kv_head_of], edgecolors="black",
        linewidths=0.5 if n_heads <= 64 else 0.0))      # past 64, edges would hide the colours
    ax.add_collection(LineCollection(
        [[(head + 0.5, 2.0), ((kv + 0.5) * group, 0.8)] for head, kv in zip(heads, kv_head_of)],
        colors=colors[kv_head_of], linewidths=1.0))
    ax.add_collection(PatchCollection(
        [Rectangle((kv * group + 0.1, 0.0), group - 0.2, 0.8) for kv in range(n_kv_heads)],
        facecolors=colors, edgecolors="black", linewidths=0.8))
    for head in sorted(_labelled(n_heads)):
        ax.text(head + 0.5, 2.95, str(head), ha="center", va="bottom", fontsize=7)
    for kv_head in sorted(_labelled(n_kv_heads)):
        ax.text((kv_head + 0.5) * group, -0.15, str(kv_head), ha="center", va="top",
                fontsize=7)
    ax.set_xlim(0, n_heads)
    ax.set_ylim(-0.9, 3.6)
    ax.set_yticks([0.4, 2.4], labels=[f"{plural(n_kv_heads, 'K/V head')}\n(cached)",
                                      f"{plural(n_heads, 'query head')}\n(not cached)"])
    ax.set_xticks([])
    ax.set_xlabel("head number (query heads on top, K/V heads below)")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"{plural(n_heads, 'query head')}, {plural(n_kv_heads, 'K/V head')}: "
                          f"groups of {group}")


# ------------------------------------------------------------- the block pool (serving)

POOL_COLUMNS = 8
ROW_PITCH = 1.3
"""Rows of a drawn pool this far apart: room for the labels above a block and the numbers
below the row over it, so that the two never share a line."""
POOL_STATE_COLORS = {"free": "#eeeeee", "cached": "#bdbdbd", "held": "#21918c",
                     "cached, held": "#3b528b", "shared": "#fde725"}
POOL_STATE_LABELS = {"free": "free", "cached": "cached, idle (reusable)",
                     "held": "held by one request", "cached, held": "cached, held by a request",
                     "shared": "held by several (hatched)"}


def pool_columns(n_blocks: int) -> int:
    """Blocks in a row of the drawn pool: 8, or 16 for a large pool (96 blocks of 1), which
    would otherwise need too many rows to read."""
    return POOL_COLUMNS if n_blocks <= 4 * POOL_COLUMNS else 2 * POOL_COLUMNS


def block_place(block: int, n_blocks: int, columns: int | None = None) -> tuple[float, float]:
    """Where draw_pool puts a block: the lower-left corner (x, y) of its slots, row by row
    from the top."""
    columns = columns or pool_columns(n_blocks)
    rows = -(-n_blocks // columns)
    return float(block % columns), (rows - 1 - block // columns) * ROW_PITCH


def block_holders(block_tables: dict, lengths: dict | None, block_size: int) -> dict:
    """For each block some table holds: (holder names, positions filled). A shared block
    lists every table that holds it, as full as the fullest of them (full without lengths)."""
    holders = {}
    for name, table in block_tables.items():
        for index, block in enumerate(table):
            names, filled = holders.get(block, ((), 0))
            used = block_size if lengths is None else \
                min(block_size, lengths[name] - index * block_size)
            holders[block] = (names + (name,), max(filled, used))
    return holders


def draw_pool(ax, pool, block_tables: dict, lengths: dict | None = None, *, colors=None,
              copied=(), title: str | None = None, columns: int | None = None,
              legend: bool | None = None):
    """The one block pool (kvlib.serving.BlockPool) as a grid of blocks, each cut into
    block_size slots (paged_cache, prefix_caching, the_engine).

    block_tables {name: [block ids]} are the holders' tables, lengths {name: positions held}
    how far each filled its blocks (None: full). A block no table holds is free (light grey)
    or cached and idle (grey, it keeps a prefix's key in the pool); a held block is filled up
    to its positions in its first holder's colour (colors(name), or the state's colour: held,
    cached and held), hatched and labelled "shared xN" when N tables hold it, outlined in
    black when just made by copy-on-write (copied). Each block's label (its holders, "free"
    or "cached") is a text with gid "block b", its number one with gid "number b", so that
    tests can read the pool back. legend (by default when colours are the states') names the
    states below. Returns ax.
    """
    for artist in [*ax.patches, *ax.texts, *ax.collections, *ax.lines]:
        artist.remove()
    n_blocks, size = pool.n_blocks, pool.block_size
    columns = columns or pool_columns(n_blocks)
    small = columns > POOL_COLUMNS                     # narrower blocks: smaller labels
    holders = block_holders(block_tables, lengths, size)
    slot = 0.9 / size
    plain, plain_colors, hatched, hatched_colors, outlines, widths = [], [], [], [], [], []
    for block in range(n_blocks):
        x, y = block_place(block, n_blocks, columns)
        names, filled = holders.get(block, ((), 0))
        cached = pool.key_of[block] is not None
        state = ("shared" if len(names) > 1 else "cached, held" if cached else "held") \
            if names else ("cached" if cached else "free")
        color = colors(names[0]) if colors and names else POOL_STATE_COLORS[state]
        for position in range(size):
            rectangle = Rectangle((x + position * slot, y), slot, 0.62)
            if len(names) > 1 and position < filled:
                hatched.append(rectangle)
                hatched_colors.append(color)
            else:
                plain.append(rectangle)
                plain_colors.append(color if position < filled or not names else "white")
        outlines.append(Rectangle((x, y), 0.9, 0.62))
        widths.append(2.4 if block in copied else 0.8)
        label = f"shared x{len(names)}" if len(names) > 1 else ",".join(map(str, names)) or \
            ("cached" if cached else "" if small else "free")
        ax.text(x + 0.45, y + 0.68, label, ha="center", va="bottom", fontsize=5 if small else 7,
                color="black" if names else "#888888", gid=f"block {block}")
        ax.text(x + 0.02, y - 0.05, str(block), ha="left", va="top", fontsize=5 if small else 6,
                color="#333333", gid=f"number {block}")
    for patches, options in ((plain, dict(facecolors=plain_colors, edgecolors="#aaaaaa")),
                             (hatched, dict(facecolors=hatched_colors, edgecolors="#555555",
                                            hatch="///"))):
        if patches:
            ax.add_collection(PatchCollection(patches, linewidths=0.4, **options),
                              autolim=False)
    ax.add_collection(PatchCollection(outlines, facecolors="none", linewidths=widths,
                                      edgecolors=["black" if w > 1 else "#555555"
                                                  for w in widths]), autolim=False)
    rows = -(-n_blocks // columns)
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.3, (rows - 1) * ROW_PITCH + 0.95)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"The pool: {n_blocks} blocks of {size} positions (block id below "
                          "each)", fontsize=10)
    if legend or (legend is None and colors is None):
        if ax.get_legend() is None:
            ax.legend([Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#555555")
                       for c in POOL_STATE_COLORS.values()], POOL_STATE_LABELS.values(),
                      loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=7,
                      frameon=False)
    return ax
