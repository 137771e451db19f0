"""The positions_and_rope lesson: rotary positions, one pair of columns at a time.

``draw_rotation(figure, ...)`` draws one pair of a head's query and key as two arrows in the
pair's plane, the query turned to its position m and the key to its position n, next to the
score of q against k as the distance m - n grows: this pair's share, and the whole head's.
``rotation_explorer()`` is the same figure with sliders for the pair (its frequency), the
distance m - n and the key's position n, and a box for rope_base. Moving n turns both arrows
by the same angle: the angle between them, and the score, stay.
"""

from __future__ import annotations

import html
import math
from numbers import Real

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Circle

import kvlib

from .base import LiveFigure, explorer

HEAD_DIM = 16             # 8 pairs: enough to see fast and slow ones, few enough to read
MAX_DISTANCE = 48
MAX_POSITION = 64
EXAMPLE_SEED = 13
QUERY_COLOR = "#3b528b"   # viridis blue
KEY_COLOR = "#e69f00"     # Okabe-Ito orange: told apart from the blue with any colour vision
HEAD_COLOR = "#7f7f7f"
TOLERANCE = 1e-12


def example_query_and_key(head_dim: int = HEAD_DIM, seed: int = EXAMPLE_SEED):
    """One head's query and key before any rotation, seeded (positions_and_rope): two
    (head_dim,)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(head_dim), rng.standard_normal(head_dim)


def check_base(base) -> float:
    """rope_base as a float: a finite number above 1 (below it the pairs would speed up)."""
    if isinstance(base, bool) or not isinstance(base, Real) or not math.isfinite(base) \
            or base <= 1:
        raise ValueError(f"rope_base must be a number above 1 (10000 in the RoPE paper and "
                         f"Llama 2, 500000 in Llama 3), got {base!r}")
    return float(base)


def rotated(vector: np.ndarray, position: int, base: float = 10000.0) -> np.ndarray:
    """A query or key (dim,) turned to `position` by kvlib.RotaryPositions -> (dim,)."""
    rotary = kvlib.RotaryPositions(np.array([position]), len(vector), check_base(base))
    return rotary.rotate(np.asarray(vector)[None, :])[0]


def pair_scores(q: np.ndarray, k: np.ndarray, query_position: int, key_position: int,
                base: float = 10000.0) -> np.ndarray:
    """Each pair's share of the score of q (at m) against k (at n) (positions_and_rope): (dim / 2,).

    Their sum is the head's score, q_m . k_n / sqrt(dim), as kvlib.attention_scores gives it.
    """
    turned_q = rotated(q, query_position, base).reshape(-1, 2)
    turned_k = rotated(k, key_position, base).reshape(-1, 2)
    return (turned_q * turned_k).sum(axis=1) / math.sqrt(len(q))


def scores_by_distance(q: np.ndarray, k: np.ndarray, max_distance: int = MAX_DISTANCE,
                       base: float = 10000.0) -> np.ndarray:
    """Each pair's share of the score for distances 0 .. max_distance, the key at position 0
    and the query at the distance: (max_distance + 1, dim / 2). Any other key position gives
    the same rows (the score depends on m - n only)."""
    return np.array([pair_scores(q, k, distance, 0, base)
                     for distance in range(max_distance + 1)])


def _check_choice(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, got {value!r}")
    return int(value)


class _RotationArtists:
    """The artists of draw_rotation's figure, made once and then updated in place, so that a
    slider move changes a few numbers instead of rebuilding two Axes (about 0.1 s each)."""

    def __init__(self, figure, n_distances: int):
        figure.clear()
        self.plane, self.curves = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.0, 1.6]})
        plane, curves = self.plane, self.curves
        self.starts = [plane.annotate("", xy=(1, 0), xytext=(0, 0), arrowprops=dict(
            arrowstyle="-|>", color=color, alpha=0.3, lw=1.2, linestyle="--"))
            for color in (QUERY_COLOR, KEY_COLOR)]
        self.arrows = [plane.annotate("", xy=(1, 0), xytext=(0, 0), arrowprops=dict(
            arrowstyle="-|>", color=color, lw=2.5, linestyle=style))
            for color, style in ((QUERY_COLOR, "-"), (KEY_COLOR, "--"))]
        # a turn keeps the length: each arrow's tip stays on its own circle
        self.circles = [plane.add_patch(Circle((0, 0), 1.0, fill=False, color=color,
                                               alpha=0.35, lw=0.8, linestyle=":", zorder=0))
                        for color in (QUERY_COLOR, KEY_COLOR)]
        handles = [plane.plot([], [], color=QUERY_COLOR, lw=2.5)[0],
                   plane.plot([], [], color=KEY_COLOR, lw=2.5, linestyle="--")[0],
                   plane.plot([], [], color="black", alpha=0.3, lw=1.2, linestyle="--")[0]]
        self.plane_legend = plane.legend(handles, ["q", "k", "before turning (position 0)"],
                                         loc="lower left", fontsize=8, framealpha=0.9)
        plane.axhline(0, color="#d0d0d0", lw=0.8, zorder=0)
        plane.axvline(0, color="#d0d0d0", lw=0.8, zorder=0)
        plane.set_aspect("equal")
        distances = np.arange(n_distances)
        self.pair_line, = curves.plot(distances, np.zeros(n_distances), color=QUERY_COLOR,
                                      lw=2)
        self.head_line, = curves.plot(distances, np.zeros(n_distances), color=HEAD_COLOR,
                                      lw=1.5, linestyle="--")
        self.marker_line = curves.axvline(0, color="black", lw=0.8, alpha=0.5)
        self.markers, = curves.plot([0, 0], [0, 0], "o", color="black", ms=5)
        curves.axhline(0, color="#d0d0d0", lw=0.8, zorder=0)
        self.curve_legend = curves.legend(
            [self.pair_line, self.head_line, self.markers],
            ["pair", "the head's score (all pairs)", "distance"], loc="upper right",
            fontsize=8, framealpha=0.9)
        curves.set_xlabel("distance m - n (positions)")
        curves.set_ylabel("score  q_m . k_n / sqrt(head_dim)")
        curves.set_title("The score depends on the distance only")
        self.n_distances = n_distances

    def update_plane(self, q_pair, k_pair, q_start, k_start, pair, m, n) -> None:
        for arrow, tip in zip(self.starts + self.arrows, (q_start, k_start, q_pair, k_pair)):
            arrow.xy = tuple(float(x) for x in tip)
        for circle, tip in zip(self.circles, (q_pair, k_pair)):
            circle.set_radius(float(np.linalg.norm(tip)))
        for text, label in zip(self.plane_legend.texts, (f"q at m = {m}", f"k at n = {n}")):
            text.set_text(label)
        radius = 1.15 * max(np.linalg.norm(q_pair), np.linalg.norm(k_pair), 1e-9)
        self.plane.set_xlim(-radius, radius)
        self.plane.set_ylim(-radius, radius)
        self.plane.set_xlabel(f"column {2 * pair} of the head")
        self.plane.set_ylabel(f"column {2 * pair + 1} of the head")
        self.plane.set_title(f"Pair {pair} of q and k, turned to their positions")

    def update_curves(self, curve, pair, distance, pair_score, head_score) -> None:
        self.pair_line.set_ydata(curve[:, pair])
        self.head_line.set_ydata(curve.sum(axis=1))
        self.marker_line.set_xdata([distance, distance])
        self.markers.set_data([distance, distance], [pair_score, head_score])
        for text, label in zip(self.curve_legend.texts,
                               (f"pair {pair}'s share of the score",
                                "the head's score (all pairs)",
                                f"distance m - n = {distance}")):
            text.set_text(label)
        low = min(curve[:, pair].min(), curve.sum(axis=1).min(), 0.0)
        high = max(curve[:, pair].max(), curve.sum(axis=1).max(), 0.0)
        margin = 0.08 * (high - low or 1.0)
        self.curves.set_ylim(low - margin, high + margin)
        self.curves.set_xlim(-0.02 * self.n_distances, 1.02 * (self.n_distances - 1))


def draw_rotation(figure, q: np.ndarray, k: np.ndarray, pair: int, distance: int,
                  key_position: int, base: float = 10000.0,
                  max_distance: int = MAX_DISTANCE) -> dict:
    """Draw one pair of q and k turned to m = n + distance and n, and the score against the
    distance (positions_and_rope), into `figure`. q, k: (dim,) before any rotation.

    The first call on a figure clears it and makes the artists; later calls with the same
    max_distance move them. Returns what is drawn: the pair's angle per position (its
    frequency), the turned arrows of the pair, this pair's share of the score and the head's
    score at (m, n), the curve (max_distance + 1, dim / 2) of scores_by_distance, and the
    two Axes ("plane", "curves").
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    if q.ndim != 1 or q.shape != k.shape or len(q) % 2:
        raise ValueError(f"q and k must be two vectors of the same even length, got shapes "
                         f"{q.shape} and {k.shape}")
    base = check_base(base)
    pair = _check_choice("pair", pair, 0, len(q) // 2 - 1)
    distance = _check_choice("distance", distance, 0, max_distance)
    key_position = _check_choice("key_position", key_position, 0, 10**6)
    query_position = key_position + distance
    shares = pair_scores(q, k, query_position, key_position, base)
    curve = scores_by_distance(q, k, max_distance, base)
    turned_q = rotated(q, query_position, base).reshape(-1, 2)[pair]
    turned_k = rotated(k, key_position, base).reshape(-1, 2)[pair]
    artists = getattr(figure, "_rotation_artists", None)
    if artists is None or artists.n_distances != max_distance + 1 \
            or artists.plane not in figure.axes:
        artists = figure._rotation_artists = _RotationArtists(figure, max_distance + 1)
    artists.update_plane(turned_q, turned_k, q.reshape(-1, 2)[pair], k.reshape(-1, 2)[pair],
                         pair, query_position, key_position)
    artists.update_curves(curve, pair, distance, shares[pair], shares.sum())
    angle_per_position = float(kvlib.rotary_angles(np.array([1]), len(q), base)[0, pair])
    return {"angle_per_position": angle_per_position,
            "turn_every": 2 * math.pi / angle_per_position,
            "query_position": query_position, "key_position": key_position,
            "q_pair": turned_q, "k_pair": turned_k,
            "pair_score": float(shares[pair]), "head_score": float(shares.sum()),
            "curve": curve, "plane": artists.plane, "curves": artists.curves}


def rotation_explorer(q: np.ndarray | None = None, k: np.ndarray | None = None,
                      pair: int = 0, distance: int = 3, key_position: int = 0,
                      base: float = 10000.0):
    """The positions_and_rope lesson: one pair of a head's q and k, turned by RoPE, and the score by
    distance.

    Controls (box.controls): "pair" (IntSlider 0 .. dim/2 - 1: low pairs turn fast, high
    pairs slowly), "distance" (IntSlider m - n, 0 .. 48), "key_position" (IntSlider n,
    0 .. 64: shifts both positions) and "base" (FloatText rope_base). box.state holds what
    draw_rotation returned, and the head's score at (distance, 0) computed on its own.
    A bad rope_base is explained in box.message; the figure keeps the last good state.
    """
    default_q, default_k = example_query_and_key()
    q = default_q if q is None else np.asarray(q, dtype=np.float64)
    k = default_k if k is None else np.asarray(k, dtype=np.float64)
    controls = {
        "pair": widgets.IntSlider(value=pair, min=0, max=len(q) // 2 - 1, description="pair"),
        "distance": widgets.IntSlider(value=distance, min=0, max=MAX_DISTANCE,
                                      description="m - n"),
        "key_position": widgets.IntSlider(value=key_position, min=0, max=MAX_POSITION,
                                          description="key at n"),
        "base": widgets.FloatText(value=base, description="rope_base",
                                  layout=widgets.Layout(width="14em")),
    }
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(11, 4.4), layout="constrained")
    state = {}

    def redraw(_=None):
        values = {name: control.value for name, control in controls.items()}
        check_base(values["base"])
        drawn = draw_rotation(live.figure, q, k, values["pair"], values["distance"],
                              values["key_position"], values["base"])
        at_zero = pair_scores(q, k, values["distance"], 0, values["base"]).sum()
        difference = abs(drawn["head_score"] - at_zero)
        live.axes = live.figure.axes
        state.clear()
        state.update(drawn, score_at_key_zero=float(at_zero), difference=float(difference))
        same = ("the same as with the key at n = 0" if difference < TOLERANCE else
                f"<b>not</b> the same as with the key at n = 0 (difference {difference:.1e})")
        turn = (f"a full turn every {_positions_text(drawn['turn_every'])} positions"
                if drawn["turn_every"] < 1e7 else "hardly turning at all")
        status.value = (
            f"Pair {values['pair']} turns {drawn['angle_per_position']:.4g} rad per position "
            f"({html.escape(turn)}). Query at m = {drawn['query_position']}, key at n = "
            f"{drawn['key_position']}: this pair adds {drawn['pair_score']:.3f} to the score; "
            f"the head's score is {drawn['head_score']:.3f}, {same}.")
        live.show()

    return explorer(live, controls, status, message, redraw, state)


def _positions_text(positions: float) -> str:
    """A turn's length in positions: '6.28' (pair 0 never turns in a whole number), '19,869'."""
    return f"{positions:,.2f}" if positions < 100 else f"{positions:,.0f}"


def draw_angle_table(ax, n_positions: int = 32, dim: int = HEAD_DIM, base: float = 10000.0):
    """cos(angle) of every pair at positions 0 .. n_positions - 1 (positions_and_rope), as a
    heatmap: the low pairs flicker from row to row, the high ones barely change. Returns the
    image."""
    angles = kvlib.rotary_angles(np.arange(n_positions), dim, check_base(base))
    image = ax.imshow(np.cos(angles), cmap="viridis", vmin=-1, vmax=1, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(dim // 2))
    ax.set_xlabel(f"pair i (columns 2i, 2i + 1 of a head of {dim})")
    ax.set_ylabel("position")
    ax.set_title(f"cos(position x {base:g}^(-2i / {dim})): each pair's turn by position")
    ax.figure.colorbar(image, ax=ax, label="cos(angle)")
    return image


def draw_score_tables(figure, rotary_scores: np.ndarray, learned_scores: np.ndarray):
    """Two (positions, positions) tables of one head's scores side by side (positions_and_rope): the
    query at row m, the key at column n; with RoPE every diagonal holds one value; the
    learned table of the notebook is random rows, a stand-in for a trained one. Only m >= n
    is drawn (a query never sees later keys). Returns the two axes."""
    figure.clear()
    axes = figure.subplots(1, 2)
    tables = (("RoPE: the same q and k at every position", rotary_scores),
              ("Learned positions (a random table): the same token at every position",
               learned_scores))
    for ax, (title, table) in zip(axes, tables):
        table = np.asarray(table, dtype=float)
        shown = np.where(np.tri(*table.shape, dtype=bool), table, np.nan)
        image = ax.imshow(shown, cmap="viridis", interpolation="nearest")
        ax.set_xlabel("key position n")
        ax.set_ylabel("query position m")
        ax.set_title(title, fontsize=10)
        figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="score")
    return axes
