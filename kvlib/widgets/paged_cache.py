"""The paged_cache lesson: the paged KV cache, drawn: a pool of blocks coloured by the sequence that
holds them, each sequence's block table, the gather that attention reads, and memory over
time against what contiguous caches would reserve.

``pool_explorer()`` runs a kvlib.serving.PoolTimeline one step per click: requests arrive,
take blocks as their tokens arrive and give them back when they finish; "Fork" makes a
second sample of a running sequence that shares its blocks until a write copies one.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
from matplotlib.collections import PatchCollection
from matplotlib.patches import ConnectionPatch, Rectangle
from matplotlib.ticker import MaxNLocator

import kvlib
from kvlib.plots import block_holders, block_place, draw_pool
from kvlib.serving import BlockPool, PoolTimeline, Request, request_mix

from .base import OneRenderFigure, plural, safely, wire_reset

# Okabe and Ito's colour-blind-safe palette (without black, which hides the labels); a
# request and its forks share a colour, and every block also carries the sequence's name
OWNER_COLORS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
FREE_COLOR = "#eeeeee"
def owner_color(name: str) -> str:
    """The colour of a sequence: PoolTimeline's request names (A, B, ..., Z, A1, ...) take
    the palette in order, and forks (A.1, A.2) share their request's colour; any other name
    gets a colour fixed by its characters."""
    family = str(name).split(".")[0]
    letter, lap = family[:1], family[1:]
    if letter.isascii() and letter.isupper() and (lap == "" or lap.isdigit()):
        index = ord(letter) - ord("A") + 26 * int(lap or 0)
    else:
        index = sum(map(ord, family))
    return OWNER_COLORS[index % len(OWNER_COLORS)]


def _wipe(ax) -> None:
    """Remove what an earlier draw put on ax, keeping its axis settings: much faster than
    ax.clear(), which rebuilds the ticks, so that a widget redraws at once."""
    for artist in [*ax.patches, *ax.texts, *ax.collections, *ax.lines]:
        artist.remove()


def _rectangles(ax, rectangles, **options):
    """Many rectangles as one PatchCollection (one artist to draw, not hundreds)."""
    if rectangles:
        ax.add_collection(PatchCollection(rectangles, **options), autolim=False)


def draw_block_tables(ax, block_tables: dict, lengths: dict, block_size: int,
                      common_blocks=(), title: str = "Block tables"):
    """One row per sequence: its name and length, then its block table as cells holding
    block ids, in the sequence's colour (common_blocks, held by several tables, hatched).
    The ids are texts with gid "table <name>", so that tests can read the tables back.
    Returns ax."""
    _wipe(ax)
    names = list(block_tables)
    width = max([len(t) for t in block_tables.values()] + [1])
    plain, plain_colors, hatched, hatched_colors = [], [], [], []
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        ax.text(-0.2, y + 0.35, f"{name} ({lengths[name]})", ha="right", va="center",
                fontsize=8)
        for index, block in enumerate(block_tables[name]):
            rectangle = Rectangle((index, y), 0.9, 0.7)
            if block in common_blocks:
                hatched.append(rectangle)
                hatched_colors.append(owner_color(name))
            else:
                plain.append(rectangle)
                plain_colors.append(owner_color(name))
            ax.text(index + 0.45, y + 0.35, str(block), ha="center", va="center",
                    fontsize=8, gid=f"table {name}")
    _rectangles(ax, plain, facecolors=plain_colors, edgecolors="#555555", linewidths=0.6)
    _rectangles(ax, hatched, facecolors=hatched_colors, edgecolors="#555555",
                linewidths=0.6, hatch="///")
    if not names:
        ax.text(0.5, 0.5, "no sequence holds blocks", ha="center", va="center", fontsize=9)
    ax.set_xlim(-3.2, max(width, 1))
    ax.set_ylim(-0.3, max(len(names), 1))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{title} (entry i: positions {block_size}i to {block_size}i + "
                 f"{block_size - 1})", fontsize=10)
    return ax


def draw_gather(figure, n_blocks: int, block_size: int, block_tables: dict, lengths: dict,
                reader: str):
    """The gather attention does (paged_cache), drawn into `figure` (cleared first): left
    the pool, middle the block tables, right `reader`'s keys as attention sees them, one
    row per position, with an arrow from each block it reads. Returns (pool ax, tables ax,
    gathered ax)."""
    if reader not in block_tables:
        raise ValueError(f"no sequence {reader!r}; the tables are for {list(block_tables)}")
    pool = BlockPool(None, n_blocks, block_size)      # block ids only: the lesson's own pool
    figure.clear()
    grid = figure.add_gridspec(1, 3, width_ratios=[2.6, 1.6, 0.7], wspace=0.3)
    pool_ax, table_ax, rows_ax = (figure.add_subplot(grid[0, i]) for i in range(3))
    shared = {b for b, (names, _) in block_holders(block_tables, lengths, block_size).items()
              if len(names) > 1}
    draw_pool(pool_ax, pool, block_tables, lengths, colors=owner_color)
    draw_block_tables(table_ax, block_tables, lengths, block_size, shared)
    table, n = block_tables[reader], lengths[reader]
    for position in range(n):
        block, row = table[position // block_size], position % block_size
        y = n - 1 - position
        rows_ax.add_patch(Rectangle((0, y), 1, 0.9, facecolor=owner_color(reader),
                                    edgecolor="#555555", lw=0.5))
        rows_ax.text(1.1, y + 0.45, f"p{position}: block {block}, row {row}", va="center",
                     fontsize=6, gid="gathered")
    rows_ax.set_xlim(0, 4.2)
    rows_ax.set_ylim(-0.2, n)
    rows_ax.axis("off")
    rows_ax.set_title(f"{reader}'s K rows,\ngathered in order", fontsize=10)
    for index, block in enumerate(table):
        top = n - index * block_size
        x, y = block_place(block, n_blocks)
        figure.add_artist(ConnectionPatch(
            xyA=(x + 0.9, y + 0.31),
            coordsA=pool_ax.transData, xyB=(0, top - 0.5), coordsB=rows_ax.transData,
            arrowstyle="->", color=owner_color(reader), lw=1.0, alpha=0.8, gid="gather"))
    return pool_ax, table_ax, rows_ax


def plot_memory_table(axes, rows, unit: int = 2**20, unit_name: str = "MiB"):
    """Two panels from memory_plan.memory_table rows (paged_cache): left, memory against
    block size, paged (used and waste) beside the contiguous reservation; right, block
    table entries (separate blocks gathered per layer per decode step). Returns axes."""
    left, right = axes
    sizes = [row.block_size for row in rows]
    x = np.arange(len(rows))
    used = np.array([row.used_bytes for row in rows]) / unit
    paged = np.array([row.paged_bytes for row in rows]) / unit
    left.clear()
    left.bar(x, used, color="#21918c", label="tokens written")
    left.bar(x, paged - used, bottom=used, color="#fde725", label="paged: empty slots")
    left.axhline(rows[0].reserved_bytes / unit, color="#440154", ls="--",
                 label="contiguous: reserved for max length")
    left.set_xticks(x, [str(s) for s in sizes])
    left.set_xlabel("block size (positions)")
    left.set_ylabel(unit_name)
    left.set_title("Memory held for the same requests")
    left.legend(fontsize=8, loc="center right")
    right.clear()
    right.bar(x, [row.block_table_entries for row in rows], color="#3b528b")
    right.set_yscale("log")
    right.set_xticks(x, [str(s) for s in sizes])
    right.set_xlabel("block size (positions)")
    right.set_ylabel("block table entries (log scale)")
    right.set_title("Blocks gathered per layer and decode step")
    return axes


def plot_timeline(ax, history, bytes_per_position: int, unit: int = 1024,
                  unit_name: str = "KiB"):
    """Memory over the steps of a PoolTimeline (paged_cache): tokens written, blocks taken,
    what contiguous caches would reserve for the same running sequences, and the pool's
    size. Returns ax."""
    _wipe(ax)
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    steps = [s.step for s in history]

    def line(values):
        return np.array(values) * bytes_per_position / unit

    ax.step(steps, line([s.used_positions for s in history]), where="post", color="#21918c",
            label="tokens written")
    ax.step(steps, line([s.paged_positions for s in history]), where="post", color="#3b528b",
            label="paged: blocks taken")
    ax.step(steps, line([s.reserved_positions for s in history]), where="post",
            color="#440154", ls="--", label="contiguous reserve")
    ax.axhline(history[0].pool_positions * bytes_per_position / unit, color="#b5a300",
               ls=":", label="pool size")
    ax.relim()
    ax.autoscale_view()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # steps are whole
    ax.set_xlabel("step")
    ax.set_ylabel(f"cache memory ({unit_name})")
    ax.set_title("Memory over time")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def demo_requests() -> list[Request]:
    """The widget's requests: a seeded mix for the toy model's 32-token context."""
    return request_mix(10, 32, seed=0, mean_gap=1.5, shortest=3)


def pool_explorer(params=None, n_blocks: int = 24, block_size: int = 4, requests=None,
                  seed: int = 0):
    """Requests served step by step from one pool of blocks (paged_cache).

    Returns a VBox with what the tests use: ``next_step`` (Button "Next step"), ``fork``
    (Button "Fork") with ``fork_of`` (Dropdown of the running sequences), ``reset``
    (Button "Reset"), ``block_size`` (Dropdown: the pool is rebuilt with the same memory),
    ``status`` (HTML: step, sequences, bytes in use against a contiguous reservation),
    ``events`` (HTML: what the last step did), ``check`` (HTML: every sequence's K and V,
    read through its block table, against a contiguous cache of its tokens), ``message``
    (HTML: a refused action in words), ``figure``, ``controls`` and ``timeline()``.
    """
    params = kvlib.init_params() if params is None else params
    requests = demo_requests() if requests is None else list(requests)
    pool_positions = n_blocks * block_size
    next_step = widgets.Button(description="Next step", button_style="primary")
    fork = widgets.Button(description="Fork")
    fork_of = widgets.Dropdown(options=[], description="sequence",
                               layout=widgets.Layout(width="12em"))
    reset = widgets.Button(description="Reset")
    sizes = sorted({block_size, *(s for s in (1, 2, 4, 8, 16) if pool_positions % s == 0)})
    size = widgets.Dropdown(options=sizes, value=block_size, description="block size",
                            layout=widgets.Layout(width="12em"))
    status, events, check, message = (widgets.HTML() for _ in range(4))
    live = OneRenderFigure(figsize=(11, 6.4))
    figure = live.figure
    grid = figure.add_gridspec(2, 2, height_ratios=[1.25, 1], width_ratios=[1.5, 1],
                               hspace=0.35, wspace=0.25, left=0.06, right=0.84)
    figure.clear()
    axes = {"pool": figure.add_subplot(grid[0, 0]), "tables": figure.add_subplot(grid[0, 1]),
            "memory": figure.add_subplot(grid[1, :])}
    state = {}
    per_position = kvlib.config_cache_bytes(params.config, 1)

    def draw():
        timeline = state["timeline"]
        tables = timeline.block_tables()
        lengths = {seq.request_id: seq.num_tokens for seq in timeline.running}
        pool = timeline.pool
        shared = {b for b in range(pool.n_blocks) if pool.ref_counts[b] > 1}
        draw_pool(axes["pool"], pool, tables, lengths, colors=owner_color,
                  copied=timeline.copied_blocks,
                  title=f"The pool at step {timeline.step_number}: {pool.n_used} of "
                        f"{pool.n_blocks} blocks in use")
        draw_block_tables(axes["tables"], tables, lengths, pool.block_size, shared)
        plot_timeline(axes["memory"], timeline.history, per_position)
        snapshot = timeline.history[-1]
        fits = pool_positions // params.config.context_length
        forks = (f", {plural(timeline.n_forks, 'fork')} among them"
                 if timeline.n_forks else "")
        status.value = (
            f"Step {timeline.step_number}: {plural(len(timeline.running), 'sequence')} "
            f"running, {len(timeline.waiting)} waiting, {len(timeline.finished)} finished"
            f"{forks}; {timeline.requests_done} of {len(requests)} requests done; "
            f"{plural(timeline.preemptions, 'preemption')}. "
            f"Paged: {snapshot.paged_positions * per_position:,} bytes in "
            f"{pool.n_used} blocks for {snapshot.used_positions} positions. Contiguous "
            f"caches of {params.config.context_length} positions would reserve "
            f"{snapshot.reserved_positions * per_position:,} bytes for the same sequences; "
            f"the pool's {pool_positions * per_position:,} bytes hold {fits} of them.")
        if timeline.all_done:
            status.value += " <b>Every request is done:</b> press Reset to start again."
        events.value = ("Last step: " + html.escape("; ".join(timeline.events))
                        if timeline.events else "Last step: nothing changed hands.")
        difference = timeline.check()
        check.value = ("Every running sequence's K and V, gathered through its block table, "
                       f"equal a contiguous cache of its tokens (max difference "
                       f"{'below 1e-10' if difference < 1e-10 else f'{difference:.1e}'})"
                       if difference < 1e-10 else
                       f"<b>A sequence's K and V differ from a contiguous cache</b> "
                       f"(max difference {difference:.1e})")
        chosen, names = fork_of.value, [seq.request_id for seq in timeline.running]
        fork_of.options = names            # new options clear the choice: keep it, or the first
        fork_of.value = chosen if chosen in names else (names[0] if names else None)
        next_step.disabled = timeline.all_done
        fork.disabled = not timeline.running
        live.show()

    def on_reset(*_):
        state["timeline"] = PoolTimeline(params, requests, pool_positions // int(size.value),
                                         int(size.value), seed=seed)
        draw()

    def on_step(_button):
        if state["timeline"].all_done:
            return
        state["timeline"].step()
        draw()

    def on_fork(_button):
        if fork_of.value is None:
            raise ValueError("no sequence is running: press Next step until one has arrived")
        state["timeline"].fork(fork_of.value)
        draw()

    next_step.on_click(safely(on_step, message))
    fork.on_click(safely(on_fork, message))
    wire_reset(on_reset, message, reset, [size])

    box = widgets.VBox([widgets.HBox([next_step, fork, fork_of, reset, size]), status, events,
                        check, message, live.output])
    box.next_step, box.fork, box.fork_of, box.reset, box.block_size = (
        next_step, fork, fork_of, reset, size)
    box.status, box.events, box.check, box.message = status, events, check, message
    box.figure, box.live, box.axes = figure, live, axes
    box.controls = {"next_step": next_step, "fork": fork, "fork_of": fork_of, "reset": reset,
                    "block_size": size}
    box.timeline = lambda: state["timeline"]
    return box
