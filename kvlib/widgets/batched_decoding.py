"""The batched_decoding lesson: batched decoding and continuous batching, drawn.

``draw_padded_caches(ax, lengths)`` draws a batch of caches padded on the left: each row a
sequence, its real positions in the last columns, the padding hidden. ``draw_batch_roofline
(ax, ...)`` draws tokens per second against the batch size, the roofline's prediction beside
what was measured. ``draw_timelines(figure, static, continuous, now)`` draws two Gantt charts of
one workload, under static and under continuous batching, and the batch occupancy of both;
``timeline_explorer()`` is that figure with a slider through time and the workload's controls.
``smollm2_batching()`` loads what benchmarks/smollm2_batching.py measured on SmolLM2, and
``draw_skinny_products(ax, ...)`` draws the time of one weight matrix times 1 to 16 rows.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

import ipywidgets as widgets
import numpy as np
from IPython.display import Image, display
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator, NullLocator

from kvlib.serving import scheduler, workloads
from kvlib.serving.timeline import Timeline

from .base import LiveFigure, explorer

WAITING_COLOR = "#c7c7c7"      # light grey: arrived, not yet in the batch
PREFILL_COLOR = "#3b528b"      # viridis blue: the step that prefilled it (its first token)
DECODE_COLOR = "#5ec962"       # viridis green: one token a step
STATIC_COLOR = "#e69f00"       # Okabe-Ito orange, told apart from the green with any vision
CONTINUOUS_COLOR = "#21918c"   # viridis teal
PAD_COLOR = "#f0f0f0"
REAL_COLOR = "#21918c"
NEW_COLOR = "#fde725"
PRODUCTS_COLOR = "#cc79a7"     # Okabe-Ito reddish purple: the step's products alone

SMOLLM2_BATCHING = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / \
    "smollm2_batching.json"
"""What benchmarks/smollm2_batching.py measured on this project's machine (batched_decoding)."""


# ------------------------------------------------------------------------------ plain figures


def draw_padded_caches(ax, lengths, labels=None):
    """A batch of caches padded on the left (batched_decoding): row b holds sequence b's lengths[b]
    positions in its last columns, the newest (this step's token) in the last column; the
    padded cells are the ones the mask hides. Returns the mask drawn, (B, S_max)."""
    from kvlib.serving.batch import padding_mask

    visible = padding_mask(lengths)
    B, S = visible.shape
    cells = np.where(visible, 1, 0)
    cells[:, -1] = 2                                          # every newest token, one column
    ax.imshow(cells, cmap=ListedColormap([PAD_COLOR, REAL_COLOR, NEW_COLOR]), vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    for b in range(B):
        for j in range(S):
            if not visible[b, j]:
                ax.text(j, b, "pad", ha="center", va="center", fontsize=7, color="#7f7f7f")
    labels = [f"sequence {b} ({n} positions)" for b, n in enumerate(lengths)] \
        if labels is None else list(labels)
    ax.set_yticks(range(B), labels)
    ax.set_xticks(range(S))
    ax.set_xticks(np.arange(-0.5, S), minor=True)
    ax.set_yticks(np.arange(-0.5, B), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("column of the padded cache")
    ax.set_title("Caches padded on the left: the newest tokens share the last column")
    handles = [Rectangle((0, 0), 1, 1, color=color) for color in
               (REAL_COLOR, NEW_COLOR, PAD_COLOR)]
    ax.legend(handles, ["cached position", "this step's token", "padding (masked)"],
              loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8)
    return visible


def draw_batch_roofline(ax, batch_sizes, predicted, measured=None, one_at_a_time=None,
                        crossover=None, title=None, products=None):
    """Tokens per second against the batch size (batched_decoding): the roofline's prediction
    (a line), what was measured (dots) and decoding the sequences one at a time (a dashed
    line), both axes logarithmic; `crossover` marks where the roofline turns compute-bound
    (a dotted line, named in the legend); `products`, the step's matrix products alone
    (triangles, dotted)."""
    batch_sizes = np.asarray(batch_sizes)
    ax.plot(batch_sizes, predicted, "-", color="black", lw=1.5,
            label="roofline: B / max(FLOPs / rate, bytes / bandwidth)")
    if measured is not None:
        ax.plot(batch_sizes, measured, "o-", color=CONTINUOUS_COLOR, lw=1.5,
                label="measured: one batched step")
    if one_at_a_time is not None:
        ax.plot(batch_sizes, one_at_a_time, "s--", color=STATIC_COLOR, lw=1.2, ms=4,
                label="measured: decode_step per sequence")
    if products is not None:
        ax.plot(batch_sizes, products, "^:", color=PRODUCTS_COLOR, lw=1.2, ms=5,
                label="measured: the step's matrix products alone")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batch_sizes, [str(int(b)) for b in batch_sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    if crossover is not None:
        # named in the legend: a label written on the plot ran over the curve
        ax.axvline(crossover, color="#7f7f7f", lw=1, linestyle=":",
                   label=f"roofline: compute-bound from B = {crossover}")
    ax.set_xlabel("batch size B (sequences decoded in one step)")
    ax.set_ylabel("tokens per second (log scale)")
    ax.set_title(title or "Decode throughput against the batch size")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              frameon=False)
    ax.grid(alpha=0.3, which="both")


def smollm2_batching(path=None) -> dict:
    """What benchmarks/smollm2_batching.py measured (batched_decoding): the machine and its load,
    the bandwidth and matrix rate it read, every repeat's seconds of a batched step, of B
    steps one at a time and of the step's products alone at each batch size, the roofline's
    seconds, and the skinny products (one weight matrix times 1 to 16 rows). The file lives
    in the repository (benchmarks/data/), beside the script that remakes it."""
    path = SMOLLM2_BATCHING if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not there: it is committed with the repository "
                                "(run the notebooks from a checkout), or remake it with "
                                "python benchmarks/smollm2_batching.py")
    return json.loads(path.read_text(encoding="utf-8"))


def draw_skinny_products(ax, rows, seconds, contiguous=None, title=None):
    """One weight matrix multiplied by 1, 2, ... rows at once (batched_decoding): each time over
    the time of one row, against two references, 1 (one read of the matrix, whatever the
    rows: what the roofline expects while memory-bound) and rows (one product per row, as
    decoding the rows one at a time does)."""
    rows = np.asarray(rows)
    seconds = np.asarray(seconds, dtype=float)
    ax.plot(rows, rows, "--", color="#7f7f7f", lw=1,
            label="one product per row (rows x one row)")
    ax.plot(rows, np.ones_like(rows, dtype=float), ":", color="black", lw=1.2,
            label="one read of the matrix (the memory-bound roofline)")
    ax.plot(rows, seconds / seconds[0], "o-", color=CONTINUOUS_COLOR, lw=1.5, ms=4,
            label="measured: W as kvlib holds it (column-major)")
    if contiguous is not None:
        contiguous = np.asarray(contiguous, dtype=float)
        ax.plot(rows, contiguous / seconds[0], "s--", color=STATIC_COLOR, lw=1.2, ms=4,
                label="measured: a contiguous (row-major) copy of W")
    ax.set_xticks(rows)
    ax.set_xlabel("rows multiplied at once (the batch size)")
    ax.set_ylabel("time / time of one row")
    ax.set_title(title or "X (rows, d) @ W (d, f)")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.grid(alpha=0.3)


# ------------------------------------------------------------------------------ the timelines


def _rectangles(spans, height: float = 0.7) -> list:
    """Polygons of bars: spans are (row, start, end)."""
    return [[(start, row - height / 2), (end, row - height / 2), (end, row + height / 2),
             (start, row + height / 2)] for row, start, end in spans if end > start]


def timeline_bars(timeline) -> dict[str, list]:
    """The bars of a Gantt chart of a Timeline (batched_decoding): for each request (row = id),
    'waiting' from its arrival to its admission, 'prefill' its first step, 'decode' from its
    first token to its last. Each a list of (row, start, end)."""
    bars = {"waiting": [], "prefill": [], "decode": []}
    for i, request in timeline.requests.items():
        admitted = timeline.admitted_at(i)
        bars["waiting"].append((i, request.arrival, admitted))
        bars["prefill"].append((i, admitted, timeline.first_token[i]))
        bars["decode"].append((i, timeline.first_token[i], timeline.finish[i]))
    return bars


def occupancy_curve(timeline, end: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests in the batch over time, as the edges and values of a step curve (notebook
    19): a step with k requests from its start to its end; 0 between steps."""
    edges, values, clock = [0.0], [], 0.0
    for step in timeline.steps:
        if step.start > clock:
            edges.append(step.start)
            values.append(0)
        edges.append(step.end)
        values.append(len(step.batch))
        clock = step.end
    if end > clock:
        edges.append(end)
        values.append(0)
    return np.array(edges), np.array(values)


class _TimelineArtists:
    """The artists of draw_timelines, made once per figure and then changed in place: a
    new workload replaces the bars' vertices, a move through time moves two lines and the
    grey covers over the future, so that a slider move costs almost nothing."""

    def __init__(self, figure):
        figure.clear()
        grid = figure.add_gridspec(3, 1, height_ratios=[1.0, 1.0, 0.55], hspace=0.55)
        self.gantts = [figure.add_subplot(grid[0]), figure.add_subplot(grid[1])]
        self.occupancy = figure.add_subplot(grid[2], sharex=self.gantts[0])
        self.collections, self.arrivals, self.nows, self.covers = [], [], [], []
        for ax in self.gantts:
            parts = {name: PolyCollection([], facecolors=color, edgecolors="white",
                                          linewidths=0.5)
                     for name, color in (("waiting", WAITING_COLOR), ("prefill", PREFILL_COLOR),
                                         ("decode", DECODE_COLOR))}
            for collection in parts.values():
                ax.add_collection(collection)
            self.collections.append(parts)
            self.arrivals.append(ax.plot([], [], "|", color="black", ms=9, mew=1.5)[0])
            ax.set_ylabel("request")
            ax.invert_yaxis()
        for ax in self.gantts + [self.occupancy]:
            # over the spines (2.5) and under the covers (3), in a whole draw as in a blit
            self.nows.append(ax.axvline(0, color="black", lw=1.2, zorder=2.6))
            cover = Rectangle((0, 0), 1, 1, transform=ax.get_xaxis_transform(),
                              facecolor="white", alpha=0.7, edgecolor="none", zorder=3)
            ax.add_patch(cover)
            self.covers.append(cover)
        handles = [Rectangle((0, 0), 1, 1, color=c) for c in
                   (WAITING_COLOR, PREFILL_COLOR, DECODE_COLOR)]
        self.gantts[0].legend(handles + [self.arrivals[0]],
                              ["waiting", "prefill step (first token)", "decoding",
                               "arrival"], loc="upper center", bbox_to_anchor=(0.5, 1.42),
                              ncol=4, frameon=False, fontsize=8)
        self.static_line, = self.occupancy.plot([], [], drawstyle="steps-post",
                                                color=STATIC_COLOR, lw=1.8, label="static")
        self.continuous_line, = self.occupancy.plot([], [], drawstyle="steps-post",
                                                    color=CONTINUOUS_COLOR, lw=1.8,
                                                    label="continuous")
        self.limit_line = self.occupancy.axhline(0, color="#7f7f7f", lw=1, linestyle=":")
        self.occupancy_legend = self.occupancy.legend(loc="upper right", fontsize=8, ncol=2)
        self.occupancy.set_ylabel("in the batch")
        self.occupancy.yaxis.set_major_locator(MaxNLocator(integer=True))
        self.occupancy.set_xlabel("time (model steps)")
        self.workload = None

    @property
    def moving(self) -> list:
        """What a move through time changes (the 'now' lines and the grey covers), and the
        legend drawn over a cover: the parts _TimelineFigure draws over its kept picture."""
        return self.nows + self.covers + [self.occupancy_legend]

    def set_timelines(self, timelines) -> None:
        end = max(t.steps[-1].end for t in timelines)
        for ax, parts, arrivals, timeline in zip(self.gantts, self.collections, self.arrivals,
                                                 timelines):
            for name, spans in timeline_bars(timeline).items():
                parts[name].set_verts(_rectangles(spans))
            ids = sorted(timeline.requests)
            arrivals.set_data([timeline.requests[i].arrival for i in ids], ids)
            ax.set_xlim(0, end)
            ax.set_ylim(max(ids) + 0.6, min(ids) - 0.6)
            ax.set_yticks(ids)
            ax.tick_params(axis="y", labelsize=7 if len(ids) > 12 else 9)
        for line, timeline in ((self.static_line, timelines[0]),
                               (self.continuous_line, timelines[1])):
            edges, values = occupancy_curve(timeline, end)
            line.set_data(edges, np.append(values, values[-1] if len(values) else 0))
        max_batch = timelines[0].policy.max_batch
        self.limit_line.set_ydata([max_batch, max_batch])
        self.occupancy.set_ylim(0, max_batch + 0.8)
        self.occupancy.set_xlim(0, end)
        self.end = end

    def set_now(self, now: float) -> None:
        for line, cover in zip(self.nows, self.covers):
            line.set_xdata([now, now])
            cover.set_x(now)
            cover.set_width(max(self.end - now, 0) + 1)


def draw_timelines(figure, static, continuous, now: float | None = None) -> dict:
    """Two Gantt charts of one workload (batched_decoding), static batching above, continuous
    below, and the requests in the batch over time under both; a black line at `now`, the
    future greyed (None: the whole run). The first call on a figure makes the artists; later
    calls change them. Returns the three Axes and the end of the longer run."""
    if not (isinstance(static, Timeline) and isinstance(continuous, Timeline)):
        raise TypeError("draw_timelines needs two Timelines (kvlib.serving.serve)")
    artists = getattr(figure, "_timeline_artists", None)
    if artists is None or artists.occupancy not in figure.axes:
        artists = figure._timeline_artists = _TimelineArtists(figure)
    workload = (tuple(static.requests.values()), static.policy.max_batch)
    if artists.workload != workload or getattr(artists, "timelines", None) != (static,
                                                                                continuous):
        artists.set_timelines((static, continuous))
        artists.workload, artists.timelines = workload, (static, continuous)
    now = artists.end if now is None else float(now)
    artists.set_now(now)
    titles = _titles(static, continuous)
    for ax, title in zip(artists.gantts, titles):
        ax.set_title(title, fontsize=10)
    return {"static": artists.gantts[0], "continuous": artists.gantts[1],
            "occupancy": artists.occupancy, "end": artists.end, "now": now}


def _clocks(summary: dict) -> str:
    """A policy's throughput on each of its two clocks, each number named by its clock: the
    steps run (passes of the model) and the makespan (first arrival to last token, idle
    steps included)."""
    return (f"{summary['steps']} steps run ({summary['tokens_per_step_run']:.2f} tokens a step "
            f"run), makespan {summary['makespan']:.0f} steps ({summary['throughput']:.2f} "
            "tokens a makespan step)")


def _titles(static, continuous) -> tuple[str, str]:
    s, c = static.summary(), continuous.summary()
    return (f"Static batching (max {static.policy.max_batch}): {_clocks(s)}; mean TTFT "
            f"{s['mean_ttft']:.1f} steps",
            f"Continuous batching (max {continuous.policy.max_batch}): {_clocks(c)}; mean TTFT "
            f"{c['mean_ttft']:.1f} steps")


def _at(timeline, now: float) -> str:
    states = timeline.state_at(now)
    count = {name: sum(s == name for s in states.values())
             for name in ("waiting", "running", "finished")}
    step = timeline.step_at(now)
    in_batch = 0 if step is None else len(step.batch)
    return (f"{in_batch} of {timeline.policy.max_batch} slots busy, {count['waiting']} "
            f"waiting, {count['finished']} finished")


class _TimelineFigure(LiveFigure):
    """timeline_explorer's figure, shown as one PNG that it renders itself, laid out with room
    for every label (no crop to a tight box, which draws a figure twice).

    A new workload draws the whole figure once without its moving parts (the 'now' lines,
    the grey covers over the future, the legend drawn over a cover) and keeps that picture;
    a move through time, the play button's every tick, puts the picture back and draws only
    the moving parts over it (matplotlib's blitting): hundredths of a second where a whole
    render takes tenths. The result is the whole figure's render, pixel for pixel (the
    tests compare them)."""

    def __init__(self, figsize):
        super().__init__(figsize=figsize)
        FigureCanvasAgg(self.figure)        # its own Agg canvas, whatever pyplot's backend
        self.background = None
        self.moving: list = []

    def forget(self) -> None:
        """The figure changed beyond its moving parts: the next render draws it whole."""
        self.background = None

    def render(self) -> np.ndarray:
        """The figure's pixels (height, width, 4), from the kept picture when there is one."""
        canvas = self.figure.canvas
        if self.background is None:
            for artist in self.moving:
                artist.set_visible(False)
            canvas.draw()
            self.background = canvas.copy_from_bbox(self.figure.bbox)
            for artist in self.moving:
                artist.set_visible(True)
        else:
            canvas.restore_region(self.background)
        for artist in sorted(self.moving, key=lambda artist: artist.get_zorder()):
            self.figure.draw_artist(artist)
        return np.asarray(canvas.buffer_rgba()).copy()

    def png(self) -> bytes:
        from PIL import Image as PILImage
        buffer = io.BytesIO()
        PILImage.fromarray(self.render()).save(buffer, format="png", compress_level=1)
        return buffer.getvalue()

    def show(self) -> None:
        picture = self.png()
        with self.output:
            self.output.clear_output(wait=True)
            display(Image(picture))


MAX_SEED = 2**31 - 1


def timeline_explorer(n_requests: int = 12, seed: int = 0, max_batch: int = 4,
                      mean_gap: float = 2.0):
    """The batched_decoding lesson: one seeded workload served by static and by continuous
    batching, drawn as two Gantt charts and the batch occupancy, with a slider through time.

    Controls (box.controls): "time" (IntSlider, model steps; a Play button moves it),
    "seed" (BoundedIntText, 0 to MAX_SEED), "requests" (IntSlider 2 .. 24), "max_batch"
    (IntSlider 1 .. 8), "mean_gap" (FloatSlider: mean steps between arrivals). box.state
    holds the two Timelines and what draw_timelines returned; box.status says, at the chosen
    time, how many slots each policy fills and how many requests wait, then both summaries,
    each number named by its clock (steps run, makespan). A value the workload refuses is
    explained in box.message and put back to the last good one, so that the other controls
    keep working; the figure keeps the last good workload. A move through time redraws only
    the 'now' lines and the covers (_TimelineFigure).
    """
    controls = {
        "time": widgets.IntSlider(value=0, min=0, max=1, description="time"),
        "seed": widgets.BoundedIntText(value=seed, min=0, max=MAX_SEED, description="seed",
                                       layout=widgets.Layout(width="11em")),
        "requests": widgets.IntSlider(value=n_requests, min=2, max=24, description="requests",
                                      continuous_update=False),
        "max_batch": widgets.IntSlider(value=max_batch, min=1, max=8, description="max batch",
                                       continuous_update=False),
        "mean_gap": widgets.FloatSlider(value=mean_gap, min=0.0, max=6.0, step=0.5,
                                        description="mean gap", continuous_update=False),
    }
    workload_names = ("seed", "requests", "max_batch", "mean_gap")
    play = widgets.Play(value=0, min=0, max=1, interval=400, description="play")
    widgets.link((play, "value"), (controls["time"], "value"))
    status, message = widgets.HTML(), widgets.HTML()
    live = _TimelineFigure(figsize=(11, 6.4))
    state = {}

    def redraw(_=None):
        if state.get("putting_back"):
            return                      # a refused value going back: the caller redraws
        workload_key = tuple(controls[name].value for name in workload_names)
        refused = None
        if state.get("key") != workload_key:
            try:
                _rebuild(workload_key)
            except ValueError as error:
                if "key" not in state:
                    raise               # nothing good to fall back on: the caller's mistake
                refused = str(error)
                _put_back(workload_key)
        now = controls["time"].value
        drawn = draw_timelines(live.figure, state["static"], state["continuous"], now)
        if state.get("drawn_key") != state["key"]:
            live.moving = live.figure._timeline_artists.moving
            live.figure.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.08)
            live.forget()
            state["drawn_key"] = state["key"]
        state["drawn"] = drawn
        s, c = state["static"].summary(), state["continuous"].summary()
        status.value = (
            f"At time {now}: static batching has {html.escape(_at(state['static'], now))}; "
            f"continuous batching has {html.escape(_at(state['continuous'], now))}.<br>"
            f"Whole workload: static {_clocks(s)}, slots {s['mean_occupancy']:.0%} busy, mean "
            f"TTFT {s['mean_ttft']:.1f} steps (worst {s['max_ttft']:.0f}); continuous "
            f"{_clocks(c)}, slots {c['mean_occupancy']:.0%} busy, mean TTFT "
            f"{c['mean_ttft']:.1f} steps (worst {c['max_ttft']:.0f}). Time per output token: "
            "1 step for both.")
        live.show()
        if refused is not None:         # said after the redraw, which clears the message
            raise ValueError(refused)

    def _put_back(workload_key) -> None:
        # the refused values go back to the last good ones, without a redraw for each
        state["putting_back"] = True
        try:
            for name, value, good in zip(workload_names, workload_key, state["key"]):
                if value != good:
                    controls[name].value = good
        finally:
            state["putting_back"] = False

    def _rebuild(workload_key) -> None:
        seed_value, count, size, gap = workload_key
        requests = workloads.make_workload(count, seed_value, gap)
        static = scheduler.serve(requests, scheduler.StaticBatching(size))
        continuous = scheduler.serve(requests, scheduler.ContinuousBatching(size))
        state.update(static=static, continuous=continuous, key=workload_key,
                     requests=requests)
        end = int(max(t.steps[-1].end for t in (static, continuous)))
        play.max = end
        controls["time"].max = end    # may lower the value: its observer redraws, harmlessly

    box = explorer(live, controls, status, message, redraw, state)
    box.children = (widgets.HBox([play, controls["time"]]),
                    widgets.HBox([controls[n] for n in workload_names]),
                    message, status, live.output)
    box.play = play
    return box
