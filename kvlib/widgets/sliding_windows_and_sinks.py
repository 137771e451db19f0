"""The sliding_windows_and_sinks lesson: sliding windows and attention sinks, drawn.

The pictures (each draws into a given Axes, cleared first):

- draw_window_mask: which key each query sees with a window of W and s sinks: in the
  window, a sink, fallen out of the window, or in the future;
- draw_ring: the ring buffer of a SlidingWindowCache, one box per slot with the position it
  holds;
- draw_cache_bytes: bytes held against tokens seen, a full cache against the ring;
- draw_reach: which earlier tokens can change the last token's output, by number of layers;
- draw_window_losses: held-out loss beyond the window against W, for each choice of cache;
- draw_loss_by_position: the loss of each prediction along the sequence;
- draw_sink_heads: the weight each head of a real model (SmolLM2) puts on position 0;
- draw_sinks_won_back: the share of a window's cost that keeping sinks wins back, by model.

The widget, ``window_explorer()``: sliders for W, sink_tokens and the tokens seen; it
prefills a real SlidingWindowCache and shows its mask, its slots and its bytes.
"""

from __future__ import annotations

from numbers import Integral

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch, Rectangle

import kvlib
from kvlib import plots

from .base import OneRenderFigure, explorer, plural

FUTURE, DROPPED, SINK, IN_WINDOW = 0, 1, 2, 3
VISIBILITY_NAMES = {FUTURE: "after the query (causal)", DROPPED: "fell out of the window",
                    SINK: "sink (kept for good)", IN_WINDOW: "in the window"}
_VIRIDIS = plt.get_cmap(plots.COLORMAP)
VISIBILITY_COLORS = {FUTURE: "#ffffff", DROPPED: plots.MASKED_COLOR, SINK: _VIRIDIS(0.25),
                     IN_WINDOW: _VIRIDIS(0.75)}
EMPTY_SLOT = -1
FULL_COLOR = _VIRIDIS(0.25)
RING_COLOR = _VIRIDIS(0.75)
SEQUENCE_SEED = 16
MAX_TOKENS = 64


# ------------------------------------------------------------------------------- the mask

def visibility(n_positions: int, window: int | None, sink_tokens: int = 0) -> np.ndarray:
    """What each query sees (sliding_windows_and_sinks): (n, n) ints, one of FUTURE, DROPPED, SINK,
    IN_WINDOW per (query, key). The keys a query attends to, SINK and IN_WINDOW, are
    exactly kvlib.attention_mask(positions, positions, window, sink_tokens)."""
    positions = np.arange(n_positions)
    causal = kvlib.attention_mask(positions, positions)
    seen = kvlib.attention_mask(positions, positions, window, sink_tokens)
    kinds = np.where(seen, IN_WINDOW, np.where(causal, DROPPED, FUTURE))
    return np.where(seen & (positions < sink_tokens)[None, :], SINK, kinds)


def _tick_step(n: int) -> int:
    return 1 if n <= 16 else 4 if n <= 40 else 8


def draw_window_mask(ax, n_positions: int, window: int | None, sink_tokens: int = 0,
                     title: str | None = None, labels=None):
    """The mask of a window of W with sink_tokens sinks over n positions
    (sliding_windows_and_sinks), as an image: rows are queries, columns keys, one colour per kind of
    cell (visibility). labels: optional token labels (n of them); without, positions are written.
    The last query row, the newest token, is outlined."""
    kinds = visibility(n_positions, window, sink_tokens)
    ax.clear()
    colors = ListedColormap([VISIBILITY_COLORS[k] for k in sorted(VISIBILITY_COLORS)])
    norm = BoundaryNorm(np.arange(-0.5, 4.5), colors.N)
    ax.imshow(kinds, cmap=colors, norm=norm, interpolation="nearest")
    step = _tick_step(n_positions)
    ticks = np.arange(0, n_positions, step)
    names = ticks if labels is None else [labels[i] for i in ticks]
    ax.set_xticks(ticks, names, rotation=90 if labels is not None else 0)
    ax.set_yticks(ticks, names)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("key position (attended to)")
    ax.set_ylabel("query position (attending)")
    ax.add_patch(Rectangle((-0.5, n_positions - 1.5), n_positions, 1, fill=False,
                           edgecolor="black", lw=1.5))
    shown = [k for k in (IN_WINDOW, SINK, DROPPED, FUTURE) if (kinds == k).any()]
    ax.legend(handles=[Patch(facecolor=VISIBILITY_COLORS[k], edgecolor="#888888",
                             label=VISIBILITY_NAMES[k]) for k in shown],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, frameon=False,
              fontsize=8)
    where = ("full attention" if window is None
             else f"window W = {window}, {plural(sink_tokens, 'sink')}")
    ax.set_title(title or f"Which keys each query sees ({where})", pad=24)
    return ax


# ---------------------------------------------------------------------------- the ring

def ring_slot(position: int, window: int, sink_tokens: int = 0) -> int:
    """The row of a SlidingWindowCache where position p is written (sliding_windows_and_sinks): p
    itself for a sink, sink_tokens + (p - sink_tokens) % W for the others. The same rule as
    kvlib.SlidingWindowCache (its test reads the cache's buffer to check)."""
    if position < sink_tokens:
        return int(position)
    return int(sink_tokens + (position - sink_tokens) % window)


def ring_contents(cache: kvlib.SlidingWindowCache) -> np.ndarray:
    """The position each slot of a ring holds now (sliding_windows_and_sinks): (sink_tokens + W,)
    ints, EMPTY_SLOT (-1) for a slot nothing was written to yet."""
    if not isinstance(cache, kvlib.SlidingWindowCache):
        raise TypeError(f"ring_contents reads a kvlib.SlidingWindowCache, "
                        f"got {type(cache).__name__}")
    contents = np.full(cache.sink_tokens + cache.window, EMPTY_SLOT)
    for position in cache.key_positions():
        contents[ring_slot(int(position), cache.window, cache.sink_tokens)] = position
    return contents


def draw_ring(ax, contents, sink_tokens: int, newest: int | None = None,
              next_slot: int | None = None, title=None):
    """A ring buffer as a row of boxes (sliding_windows_and_sinks): contents (slots,) the position
    in each slot (EMPTY_SLOT for none), the first sink_tokens slots drawn as sinks, the slot holding
    `newest` highlighted, and the slot the next position will be written to outlined with
    a dashed line. Returns the Axes."""
    contents = np.asarray(contents)
    ax.clear()
    for slot, position in enumerate(contents):
        if position == EMPTY_SLOT:
            color = "#ffffff"
        elif position == newest:
            color = plots.NEW_ROWS_COLOR
        elif slot < sink_tokens:
            color = VISIBILITY_COLORS[SINK]
        else:
            color = VISIBILITY_COLORS[IN_WINDOW]
        ax.add_patch(Rectangle((slot, 0), 1, 1, facecolor=color, edgecolor="black", lw=1))
        text = "-" if position == EMPTY_SLOT else str(int(position))
        text_color = "white" if slot < sink_tokens and position not in (EMPTY_SLOT, newest) \
            else "black"
        ax.text(slot + 0.5, 0.5, text, ha="center", va="center", color=text_color,
                fontsize=9 if len(contents) <= 12 else 7)
    if sink_tokens:
        ax.axvline(sink_tokens, color="black", lw=3)
    if next_slot is not None:
        ax.add_patch(Rectangle((next_slot + 0.06, 0.06), 0.88, 0.88, fill=False, ls="--",
                               edgecolor="#d62728", lw=1.5, label="next write"))
    ax.set_xlim(0, max(len(contents), 1))
    ax.set_ylim(-0.1, 1.1)
    ax.set_aspect("equal")
    ax.set_yticks([])
    ax.set_xticks(np.arange(len(contents)) + 0.5, np.arange(len(contents)),
                  fontsize=9 if len(contents) <= 12 else 7)
    ax.set_xlabel("slot (row of the buffer); the number in a box is the position it holds")
    legend = [Patch(facecolor=plots.NEW_ROWS_COLOR, edgecolor="black", label="newest"),
              Patch(facecolor=VISIBILITY_COLORS[IN_WINDOW], edgecolor="black",
                    label="window")]
    if sink_tokens:
        legend.append(Patch(facecolor=VISIBILITY_COLORS[SINK], edgecolor="black",
                            label="sink"))
    if next_slot is not None:
        legend.append(Patch(fill=False, ls="--", edgecolor="#d62728", label="next write"))
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4,
              frameon=False, fontsize=8)
    ax.set_title(title or "The ring buffer", pad=24)
    return ax


# ------------------------------------------------------------------------------ memory

def draw_cache_bytes(ax, tokens, full_bytes, ring_bytes, window: int, sink_tokens: int = 0):
    """Bytes held against tokens seen (sliding_windows_and_sinks): the full cache's line keeps
    rising, the ring's stops at sink_tokens + W positions. tokens, full_bytes, ring_bytes:
    equal-length sequences."""
    ax.clear()
    ax.plot(tokens, full_bytes, color=FULL_COLOR, marker=".", label="full cache (KVCache)")
    ax.plot(tokens, ring_bytes, color=RING_COLOR, marker=".", lw=2.5,
            label=f"ring buffer (SlidingWindowCache, W = {window}, "
                  f"{plural(sink_tokens, 'sink')})")
    ax.annotate(f"stops at sinks + W = {plural(window + sink_tokens, 'row')} a layer",
                (tokens[-1], ring_bytes[-1]), xytext=(0, 8), textcoords="offset points",
                ha="right", va="bottom", fontsize=8, color="#333333")
    ax.set_xlabel("tokens seen (prompt + generated)")
    ax.set_ylabel("bytes held by the cache (cache.nbytes)")
    ax.set_title("Memory: the full cache grows, the ring stays flat")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return ax


# ----------------------------------------------------------------------- receptive field

def draw_reach(ax, changes, layer_counts, window: int):
    """Which earlier tokens reach the last output (sliding_windows_and_sinks): changes
    (len(layer_counts), D) the largest change of the last row of logits when the token d positions
    back is replaced, for models of 1, 2, ... layers. Cells with no change at all are drawn grey;
    the others coloured by log10 of the change. The line after each row's reach marks
    L x (W - 1)."""
    changes = np.asarray(changes, dtype=float)
    ax.clear()
    shown = np.ma.masked_less_equal(changes, 0.0)
    cmap = _VIRIDIS.with_extremes(bad=plots.MASKED_COLOR)
    with np.errstate(divide="ignore"):
        image = ax.imshow(np.ma.log10(shown), cmap=cmap, aspect="auto",
                          interpolation="nearest")
    for row, layers in enumerate(layer_counts):
        reach = layers * (window - 1)
        ax.plot([reach + 0.5] * 2, [row - 0.5, row + 0.5], color="black", lw=2)
    ax.set_yticks(range(len(layer_counts)), [plural(n, "layer") for n in layer_counts])
    ax.set_xlabel("how far before the last token the replaced token is (positions)")
    ax.set_title(f"Window W = {window}: what a replaced token changes in the last output\n"
                 "(grey: exactly nothing; black line: L x (W - 1) back)")
    ax.figure.colorbar(image, ax=ax, label="log10 of the largest logit change")
    return ax


# ---------------------------------------------------------------------------- the loss

BASELINE_STYLES = (":", "-.", (0, (1, 4)))
"""Line styles of the baselines (a bigram, a uniform guess, ...), told apart without colour."""


def _draw_baselines(ax, baselines: dict | None) -> None:
    """Each baseline {label: loss} as a grey horizontal line of its own style."""
    for index, (label, value) in enumerate((baselines or {}).items()):
        ax.axhline(value, color="#555555", lw=1.2, label=label,
                   ls=BASELINE_STYLES[index % len(BASELINE_STYLES)])


def draw_window_losses(ax, windows, losses: dict, full_loss: float, title: str | None = None,
                       baselines: dict | None = None):
    """Held-out loss beyond the window against W (sliding_windows_and_sinks): losses maps a label
    ("window only", "window + 4 sinks", ...) to one loss per window; the full cache's loss
    is a dashed line, and each of `baselines` ({"bigram": 2.6, ...}) a grey line."""
    ax.clear()
    markers = "osD^v"
    for index, (label, values) in enumerate(losses.items()):
        ax.plot(windows, values, marker=markers[index % len(markers)],
                color=_VIRIDIS(0.15 + 0.7 * index / max(len(losses) - 1, 1)), label=label)
    ax.axhline(full_loss, color="black", ls="--", lw=1, label="full cache")
    _draw_baselines(ax, baselines)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(windows), [str(w) for w in windows])
    ax.set_xlabel("window W (positions)")
    ax.set_ylabel("held-out loss (nats per token)")
    ax.set_title(title or "Loss beyond the window, same weights")
    ax.grid(alpha=0.3)
    _legend_above_the_data(ax)
    return ax


def draw_loss_by_position(ax, curves: dict, window: int, smoothing: int = 8,
                          baselines: dict | None = None):
    """Next-token loss against the position of the predicted token (sliding_windows_and_sinks):
    curves maps a label to the mean loss of each prediction (T - 1,), the prediction at index i
    being of token i + 1; each curve is averaged over `smoothing` neighbours. A dashed line
    marks the window: before it nothing has been forgotten. Each of `baselines`
    ({"uniform guess": 5.6, ...}) is a grey horizontal line."""
    ax.clear()
    kernel = np.ones(smoothing) / smoothing
    for index, (label, curve) in enumerate(curves.items()):
        smooth = np.convolve(np.asarray(curve, dtype=float), kernel, mode="valid")
        first = 1 + smoothing // 2            # the predicted token of the window's middle
        ax.plot(np.arange(first, first + len(smooth)), smooth, label=label,
                color=_VIRIDIS(0.8 * index / max(len(curves) - 1, 1)))
    ax.axvline(window, color="#888888", ls="--", lw=1)
    _draw_baselines(ax, baselines)
    ax.set_xlabel("position of the predicted token")
    ax.set_ylabel(f"loss (nats), mean over {plural(smoothing, 'position')}")
    ax.set_title(f"Where the loss comes from: W = {window}")
    ax.grid(alpha=0.3)
    _legend_above_the_data(ax)
    return ax


# ------------------------------------------------------------------- a real model's sinks

SINK_THRESHOLD = 0.5
"""draw_sink_heads outlines the heads that put more than this on position 0."""


def draw_sink_heads(ax, on_first, even_share: float, first_query: int | None = None,
                    threshold: float = SINK_THRESHOLD, title: str | None = None):
    """Where a real model's heads put their attention (sliding_windows_and_sinks, SmolLM2): on_first
    (layers, heads), the mean weight each head gives position 0 over the measured queries,
    drawn with layers across and heads down, viridis from 0 to 1 (the whole possible range,
    so that 0.1 and 1.0 look as different as they are), each cell's value written in
    hundredths and the heads above `threshold` outlined. even_share is the weight an even
    spread would give position 0 (in the title, with first_query, the first query measured).
    Returns the image; the colour bar is marked at the threshold."""
    on_first = np.asarray(on_first, dtype=float)
    if on_first.ndim != 2 or not np.isfinite(on_first).all() or on_first.min() < 0 \
            or on_first.max() > 1:
        raise ValueError(f"on_first must be a (layers, heads) array of weights in 0..1, got "
                         f"shape {on_first.shape}")
    ax.clear()
    n_layers, n_heads = on_first.shape
    image = ax.imshow(on_first.T, cmap=plots.COLORMAP, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    for (layer, head), value in np.ndenumerate(on_first):
        text = "1" if round(value, 2) >= 1 else f"{value:.2f}"[1:]          # ".94", "1"
        ax.text(layer, head, text, ha="center", va="center", fontsize=6,
                color="black" if value > 0.55 else "white")
        if value > threshold:
            ax.add_patch(Rectangle((layer - 0.5, head - 0.5), 1, 1, fill=False,
                                   edgecolor="white", lw=1.2))
    ax.set_xticks(range(n_layers), [str(i) if i % 2 == 0 else "" for i in range(n_layers)])
    ax.set_yticks(range(n_heads), [str(h) for h in range(n_heads)])
    ax.set_xlabel("layer")
    ax.set_ylabel("query head")
    queries = "" if first_query is None else f" from position {first_query} on"
    above = int((on_first > threshold).sum())
    ax.set_title(title or f"Mean attention on position 0, queries{queries} (an even spread: "
                          f"{even_share:.3f}); {above} of {on_first.size} heads above "
                          f"{threshold:g}, outlined", fontsize=10)
    bar = ax.figure.colorbar(image, ax=ax, fraction=0.03, pad=0.015)
    bar.set_label("weight on position 0")
    bar.ax.axhline(threshold, color="white", lw=1.2)
    return image


def draw_sinks_won_back(ax, shares: dict, title: str | None = None):
    """How much of a window's cost keeping sinks wins back (sliding_windows_and_sinks): shares maps
    a model's name to {window: share}, the share being (window loss - window + sinks loss) /
    (window loss - full loss); one group of bars a model, one bar a window, each labelled
    with its window and its percentage."""
    ax.clear()
    x, ticks, names = 0.0, [], []
    for index, (model, by_window) in enumerate(shares.items()):
        color = _VIRIDIS(0.2 + 0.6 * index / max(len(shares) - 1, 1))
        start = x
        for window, share in by_window.items():
            ax.bar(x, 100 * share, width=0.8, color=color, edgecolor="black", lw=0.6)
            ax.text(x, 100 * share + 2, f"{share:.0%}", ha="center", va="bottom", fontsize=8)
            ax.text(x, -3, f"W = {window}", ha="center", va="top", fontsize=8)
            x += 1
        ticks.append((start + x - 1) / 2)
        names.append(model)
        x += 0.8
    ax.set_xticks(ticks, names)
    ax.tick_params(axis="x", pad=16, length=0)
    ax.set_ylim(0, 105)
    ax.set_ylabel("share of the window's cost won back (%)")
    ax.set_title(title or "What 4 sinks win back")
    ax.grid(axis="y", alpha=0.3)
    return ax


def _legend_above_the_data(ax) -> None:
    """A two-column legend in a band added above the highest line, where it hides none."""
    top = max(max(np.max(line.get_ydata()) for line in ax.get_lines()), 0.0)
    ax.set_ylim(0, 1.45 * top if top > 0 else 1.0)
    ax.legend(fontsize=8, ncol=2, loc="upper right")


# ------------------------------------------------------------------------------ widget

def _whole(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return int(value)


def example_model(context_length: int = MAX_TOKENS) -> kvlib.Params:
    """The model of the sliding_windows_and_sinks lesson: the toy with rotary positions
    (positions_and_rope), so that a window can slide as far as the context length allows."""
    return kvlib.init_params(kvlib.ModelConfig(positions="rotary",
                                               context_length=context_length))


def example_sequence(n_tokens: int = MAX_TOKENS, vocab_size: int = 12) -> list[int]:
    """A seeded sequence of token ids, BOS first: the long input of the sliding_windows_and_sinks
    lesson's widget."""
    rng = np.random.default_rng(SEQUENCE_SEED)
    return [0] + rng.integers(1, vocab_size, n_tokens - 1).tolist()


def window_cache(params: kvlib.Params, ids, window: int, sink_tokens: int):
    """Prefill ids into a SlidingWindowCache of a window W with sink_tokens sinks, on the
    same weights (sliding_windows_and_sinks): -> (logits (T, V), cache)."""
    return kvlib.prefill(params.with_config(window=window, sink_tokens=sink_tokens), ids)


def window_explorer(params: kvlib.Params | None = None, window: int = 4,
                    sink_tokens: int = 0, n_tokens: int = 20):
    """Sliders for W, sink_tokens and the tokens seen (sliding_windows_and_sinks): the mask over
    every position so far, the ring buffer's slots with the positions they hold, and its bytes
    beside a full cache's. Each change prefills a real SlidingWindowCache.

    Returns a VBox with the attributes the tests use: ``window``, ``sinks``, ``tokens``
    (IntSliders, also in ``controls``), ``status`` (HTML: what the ring holds and its bytes),
    ``message`` (HTML: a combination that cannot be, in words), ``figure``, ``axes`` (mask,
    ring) and ``state`` (the cache, its slots' contents and the bytes on show).
    """
    params = example_model() if params is None else params
    if not isinstance(params, kvlib.Params) or params.config.window is not None:
        raise TypeError("window_explorer needs kvlib Params of a model without a window; "
                        "it adds the window itself")
    context = params.config.context_length
    window = _whole("window", window, 1, min(16, context))
    sink_tokens = _whole("sink_tokens", sink_tokens, 0, 4)
    n_tokens = _whole("n_tokens", n_tokens, 1, min(MAX_TOKENS, context))
    ids = example_sequence(min(MAX_TOKENS, context), params.config.vocab_size)
    sliders = {
        "window": widgets.IntSlider(value=window, min=1, max=min(16, context),
                                    description="window W", continuous_update=False),
        "sinks": widgets.IntSlider(value=sink_tokens, min=0, max=4, description="sinks",
                                   continuous_update=False),
        "tokens": widgets.IntSlider(value=n_tokens, min=1, max=len(ids),
                                    description="tokens seen", continuous_update=False),
    }
    status, message = widgets.HTML(), widgets.HTML()
    live = OneRenderFigure(figsize=(11, 5.2), n_axes=2, gridspec_kw={"width_ratios": [1, 1.25]})
    state = {}

    def redraw(*_):
        W, s, n = (int(sliders[name].value) for name in ("window", "sinks", "tokens"))
        _, cache = window_cache(params, ids[:n], W, s)    # a bad W + s raises, in words
        contents = ring_contents(cache)
        full_bytes = kvlib.config_cache_bytes(params.config, n)
        state.update(cache=cache, contents=contents, nbytes=cache.nbytes,
                     full_bytes=full_bytes)
        draw_window_mask(live.axes[0], n, W, s)
        draw_ring(live.axes[1], contents, s, newest=n - 1, next_slot=ring_slot(n, W, s),
                  title=f"The ring after {plural(n, 'token')}: {plural(s, 'sink slot')} "
                        f"+ {plural(W, 'window slot')}")
        held = cache.key_positions()
        config = cache.config
        status.value = (
            f"After {plural(n, 'token')} the ring holds {plural(len(held), 'position')}: "
            f"{_ranges(held)}. Position {n} will go to slot "
            f"{ring_slot(n, W, s)}.<br>"
            f"cache.nbytes = 2 (K, V) x {plural(config.n_layers, 'layer')} x "
            f"{plural(len(held), 'row')} x {plural(config.kv_width, 'number')} x "
            f"{plural(config.numpy_dtype.itemsize, 'byte')} = "
            f"<b>{cache.nbytes:,} bytes</b>; a full cache of {plural(n, 'position')}: "
            f"{full_bytes:,} bytes.")
        if not state.get("laid_out"):        # once: the labels keep their places, and a
            live.figure.tight_layout()       # layout pass is most of the time of a redraw
            state["laid_out"] = True
        live.show()

    box = explorer(live, sliders, status, message, redraw, state)
    box.window, box.sinks, box.tokens = sliders["window"], sliders["sinks"], sliders["tokens"]
    box.axes, box.live = live.axes, live
    return box


def _ranges(positions) -> str:
    """Positions as runs: [0, 1, 5, 6, 7] -> '0-1, 5-7'."""
    runs: list[list[int]] = []
    for position in (int(p) for p in positions):
        if runs and position == runs[-1][1] + 1:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
