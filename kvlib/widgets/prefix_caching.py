"""The prefix_caching lesson: prefix caching across requests, drawn and played with.

``draw_prefix_state`` draws a PrefixServer after an admission: the cached blocks as the
tree their parent keys make (hit counts on each block; the blocks the new request reused
highlighted), the request's tokens (reused or prefilled), and the pool (free, cached and
idle, held by running requests). ``prefix_stream_explorer()`` serves a seeded stream of
requests, many starting with one of two system prompts, one click at a time.
``draw_reuse_bars`` draws, for a few requests, the prompt tokens reused and computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

import kvlib
from kvlib.plots import draw_pool
from kvlib.serving import ROOT_KEY, Admission, PrefixServer, Request

from .base import OneRenderFigure, plural, safely, wire_reset

TOLERANCE = 1e-10
_VIRIDIS = plt.get_cmap("viridis")
REUSED_COLOR = _VIRIDIS(0.95)       # yellow: reused by the request just admitted
NEW_COLOR = _VIRIDIS(0.6)           # green: cached by the request just admitted
HELD_COLOR = _VIRIDIS(0.3)          # blue: held by a running request
IDLE_COLOR = "#d9d9d9"              # grey: cached, held by nobody (evictable)
FREE_COLOR = "#ffffff"
PRIVATE_COLOR = _VIRIDIS(0.05)      # dark purple: a running request's own, not cached
POOL_STATES = ("free", "cached, idle", "cached, held by a running request",
               "a running request's own")
MAX_TOKEN_LABELS = 40
MAX_TWO_LINE_ROWS = 8

SYSTEM_PROMPTS = {
    "A": "you are good and I am fine . thanks .",
    "B": "I am good . How are you ?",
}
"""Two "system prompts" in the toy's words; the tokenizer puts BOS in front."""


def example_model() -> kvlib.Params:
    """The toy with rotary positions (positions_and_rope) and room for 64 positions: the
    prefix_caching lesson's model."""
    return kvlib.init_params(kvlib.ModelConfig(positions="rotary", context_length=64))


@dataclass(frozen=True)
class Arrival:
    """One arrival of a generated stream: the request (kvlib.serving.Request, its prompt BOS
    first), which system prompt it starts with ("" for none), and how many further arrivals
    it runs for."""

    request: Request
    system: str
    lifetime: int

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self.request.prompt_token_ids)


def request_stream(n_requests: int, seed: int = 0, tokenizer=None,
                   system_share: float = 0.8, n_questions: int = 6) -> list[Arrival]:
    """A seeded stream of requests (prefix_caching): most start with system prompt A or B, then
    one question from a small pool (so whole requests repeat too); the rest are a question
    alone.
    Each finishes when the next request arrives (lifetime 1) or the one after (lifetime 2),
    so at most one request still runs when another is admitted."""
    tokenizer = kvlib.ToyTokenizer() if tokenizer is None else tokenizer
    rng = np.random.default_rng(seed)
    words = [w for w in tokenizer.words() if w not in ("?", ".")]
    questions = []
    for _ in range(n_questions):
        length = int(rng.integers(2, 6))
        questions.append(" ".join(rng.choice(words, size=length)) + " ?")
    stream = []
    for index in range(n_requests):
        system = str(rng.choice(["A", "B"])) if rng.random() < system_share else ""
        question = questions[int(rng.integers(len(questions)))]
        text = f"{SYSTEM_PROMPTS[system]} {question}" if system else question
        stream.append(Arrival(Request(index, tokenizer.encode(text), arrival=index), system,
                              int(rng.integers(1, 3))))
    return stream


# --------------------------------------------------------------------------------- drawing

def tree_layout(entries) -> dict[bytes, tuple[float, float]]:
    """Where the prefix_caching lesson draws every cached block: (x, y), x its depth, y from its
    leaves (a leaf a row of its own, a parent at the middle of its children), first blocks in the
    order cached."""
    children: dict[bytes, list] = {}
    for entry in entries:
        children.setdefault(entry.parent, []).append(entry)
    place: dict[bytes, tuple[float, float]] = {}
    next_row = [0.0]

    def visit(entry) -> float:
        kids = children.get(entry.key, [])
        if not kids:
            y = next_row[0]
            next_row[0] += 1
        else:
            ys = [visit(kid) for kid in kids]
            y = (min(ys) + max(ys)) / 2
        place[entry.key] = (float(entry.depth), y)
        return y

    for root in children.get(ROOT_KEY, []):
        visit(root)
    return place


def _short(labels, width: int = 18) -> str:
    text = " ".join(labels)
    return text if len(text) <= width else text[: width - 1] + "…"


def _wipe(ax) -> None:
    """Remove what an earlier draw put on ax, keeping its ticks and legend: much faster than
    ax.clear(), which rebuilds them, so that a widget answers at once."""
    for artist in [*ax.images, *ax.texts, *ax.collections, *ax.patches, *ax.lines]:
        artist.remove()


def _show_cells(ax, cells, cmap, vmin, vmax) -> None:
    """One row of coloured cells (1, n) on ax, replacing what an earlier draw left there."""
    _wipe(ax)
    ax.imshow(cells, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    n = cells.shape[1]
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(0.5, -0.5)


def draw_prefix_tree(ax, prefix_cache, labels_of, reused=(), new=(), title=None):
    """The cached blocks as a tree (prefix_caching): one box per block, at its depth, linked to
    its parent; each box says its pool block, its hits and its tokens. Blocks in `reused`
    (pool block ids) are highlighted, those in `new` marked as just cached; blocks held by a
    running request are blue, idle ones grey. labels_of(ids) gives the token strings."""
    _wipe(ax)
    entries = prefix_cache.entries
    reused, new = set(reused), set(new)
    ax.set_title(title or f"Prefix cache: {len(entries)} blocks of {prefix_cache.block_size} "
                 "tokens (box: pool block, hits, tokens)")
    ax.set_axis_off()
    if ax.get_legend() is None:
        ax.legend(handles=[Patch(facecolor=color, edgecolor="#444444") for color in
                           (REUSED_COLOR, NEW_COLOR, HELD_COLOR, IDLE_COLOR)],
                  labels=["reused by this request", "cached by this request (held by it)",
                          "held by a running request", "idle (can be evicted)"],
                  loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, frameon=False,
                  fontsize=8)
    if not entries:
        ax.text(0.5, 0.5, "the prefix cache is empty", ha="center", va="center",
                transform=ax.transAxes)
        return ax
    place = tree_layout(entries)
    depth = max(x for x, _ in place.values())
    rows = max(y for _, y in place.values())
    two_lines = rows <= MAX_TWO_LINE_ROWS        # beyond, two-line boxes would overlap
    segments = [(place[e.parent], place[e.key]) for e in entries if e.parent in place]
    ax.add_collection(LineCollection(segments, colors="#777777", linewidths=1.0, zorder=1))
    for entry in entries:
        x, y = place[entry.key]
        if entry.block in reused:
            color = REUSED_COLOR
        elif entry.block in new:
            color = NEW_COLOR
        elif prefix_cache.is_held(entry):
            color = HELD_COLOR
        else:
            color = IDLE_COLOR
        separator = "\n" if two_lines else "  "
        ax.text(x, y, f"b{entry.block} {entry.hits}x{separator}{_short(labels_of(entry.tokens))}",
                ha="center", va="center", fontsize=8 if two_lines else 6.5, zorder=2,
                color="white" if color == HELD_COLOR else "black",
                bbox=dict(boxstyle="round,pad=0.25", facecolor=color, edgecolor="#444444"))
    ax.set_xlim(-0.6, depth + 0.6)
    ax.set_ylim(rows + 0.7, -0.7)
    return ax


def draw_request(ax, labels, reused_tokens: int, block_size: int, title=None):
    """One request's tokens, reused from the cache or prefilled (prefix_caching), with its
    block boundaries."""
    n = len(labels)
    if not 0 <= reused_tokens <= n:
        raise ValueError(f"reused_tokens must be between 0 and {n}, got {reused_tokens}")
    strip = (np.arange(n) < reused_tokens).astype(float)[None, :]
    _show_cells(ax, strip, ListedColormap([PRIVATE_COLOR, REUSED_COLOR]), 0, 1)
    bounds = np.arange(block_size, n, block_size) - 0.5
    ax.add_collection(LineCollection([((b, -0.5), (b, 0.5)) for b in bounds], colors="white",
                                     linewidths=2.5))
    ax.set_yticks([])
    if n <= MAX_TOKEN_LABELS:
        ax.set_xticks(range(n), labels, rotation=90, fontsize=8)
    else:
        ax.set_xticks([])
    ax.set_xlabel("the request's tokens (white lines: block boundaries)", fontsize=9)
    ax.set_title(title or f"{reused_tokens} tokens reused (yellow), {n - reused_tokens} "
                 "prefilled (purple)", fontsize=10)
    return ax


def draw_reuse_bars(ax, names, lengths, reused, block_size: int, title=None):
    """Prompt tokens of each request, reused from the prefix cache or computed (prefix_caching):
    one horizontal bar a request, the reused part first (yellow, as in draw_request), the
    computed part after it (purple), with the block boundaries of the reused part."""
    lengths, reused = np.asarray(lengths), np.asarray(reused)
    if lengths.shape != reused.shape or len(names) != len(lengths):
        raise ValueError("give one name, one length and one reused count per request")
    if ((reused < 0) | (reused > lengths)).any():
        raise ValueError("a request cannot reuse more tokens than it has")
    rows = np.arange(len(lengths))[::-1]                       # the first request on top
    ax.barh(rows, reused, color=REUSED_COLOR, edgecolor="black", lw=0.5,
            label="reused from the prefix cache")
    ax.barh(rows, lengths - reused, left=reused, color=PRIVATE_COLOR, edgecolor="black",
            lw=0.5, label="computed (prefilled)")
    for row, n in zip(rows, reused):
        for bound in range(block_size, int(n), block_size):
            ax.plot([bound, bound], [row - 0.4, row + 0.4], color="white", lw=1)
    ax.set_yticks(rows, names, fontsize=8)
    ax.set_xlabel(f"prompt tokens (white lines: blocks of {block_size})")
    ax.set_title(title or f"{int(reused.sum())} of {int(lengths.sum())} prompt tokens reused",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=2,
              frameon=False)
    return ax


def pool_states(server: PrefixServer) -> np.ndarray:
    """Each pool block's state (prefix_caching), an index into POOL_STATES: free, cached and
    idle, cached and held by a running request, or a running request's own block."""
    states = np.zeros(server.pool.n_blocks, dtype=int)
    held = server.held_blocks()
    for block in range(server.pool.n_blocks):
        if server.pool.ref_counts[block] == 0:
            continue
        cached = server.pool.key_of[block] is not None
        states[block] = (2 if block in held else 1) if cached else 3
    return states


def draw_server_pool(ax, server: PrefixServer):
    """The server's pool (plots.draw_pool), each running request's blocks labelled with its
    number, cached blocks nobody runs with in grey (prefix_caching)."""
    counts = np.bincount(pool_states(server), minlength=len(POOL_STATES))
    return draw_pool(ax, server.pool, {str(i): r.block_table for i, r in server.running.items()},
                     columns=24, title=f"Pool of {server.pool.n_blocks} blocks: " + ", ".join(
                         f"{c} {name}" for c, name in zip(counts, POOL_STATES)))


def _state_layout(figure) -> list[tuple[float, float, float, float]]:
    """Where the tree, the request strip and the pool go, as figure fractions (left, bottom,
    width, height), from fixed room in inches for the titles, tick labels and legends: the
    figure then needs no tight bounding box, which would draw it twice."""
    height = figure.get_size_inches()[1]
    pool_bottom, pool_height = 0.55, 0.7          # inches; the pool's legend below
    request_bottom = pool_bottom + pool_height + 1.15    # its title, the strip's labels
    request_height = 0.4
    tree_bottom = request_bottom + request_height + 0.75  # the strip's title, tree legend
    tree_top = height - 0.35                              # the tree's title
    return [(0.02, tree_bottom / height, 0.96, (tree_top - tree_bottom) / height),
            (0.02, request_bottom / height, 0.96, request_height / height),
            (0.02, pool_bottom / height, 0.96, pool_height / height)]


def draw_prefix_state(figure, server: PrefixServer, admission: Admission | None, labels_of,
                      new=()):
    """The whole picture (prefix_caching) into `figure`: the prefix tree, the request just
    admitted (if any) and the pool. Returns (tree, request, pool) Axes.

    The three Axes are made on the first call and redrawn in place after (a widget redraws
    at every click: rebuilding Axes and their ticks would cost more than the drawing)."""
    axes = getattr(figure, "_prefix_state_axes", None)
    if axes is None or list(axes) != figure.axes:
        figure.clear()
        axes = tuple(figure.add_axes(rect) for rect in _state_layout(figure))
        figure._prefix_state_axes = axes
    tree_ax, request_ax, pool_ax = axes
    reused = admission.reused_blocks if admission is not None else ()
    draw_prefix_tree(tree_ax, server.prefix_cache, labels_of, reused=reused, new=new)
    if admission is None:
        _wipe(request_ax)
        request_ax.set_axis_off()
        request_ax.set_title("no request admitted yet", fontsize=10)
    else:
        request_ax.set_axis_on()
        draw_request(request_ax, labels_of(admission.ids), admission.reused_tokens,
                     admission.block_size,
                     title=f"Request {admission.request}: {admission.reused_tokens} tokens "
                           f"reused (yellow), {admission.prefilled_tokens} prefilled (purple)")
    draw_server_pool(pool_ax, server)
    return tree_ax, request_ax, pool_ax


def cache_table(prefix_cache, labels_of) -> str:
    """The cached blocks as a text table: pool block, positions, tokens, hits, last used,
    held by a running request, cached children (prefix_caching's eviction exercise)."""
    lines = [f"{'block':>5}  {'positions':>9}  {'tokens':<26} {'hits':>4}  {'last used':>9}  "
             f"{'held':>4}  {'children':>8}"]
    for entry in prefix_cache.entries:
        span = f"{entry.positions[0]}-{entry.positions[-1]}"
        lines.append(f"{entry.block:>5}  {span:>9}  {' '.join(labels_of(entry.tokens)):<26} "
                     f"{entry.hits:>4}  {entry.last_used:>9}  "
                     f"{'yes' if prefix_cache.is_held(entry) else 'no':>4}  {entry.children:>8}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- the stream

@dataclass
class StreamRun:
    """A stream of requests served one arrival at a time (the widget's state): each arrival
    (a tick) first finishes the requests whose time is up, then admits the next request; a
    request that does not fit waits, and is tried again at the next tick. newly_cached: the
    blocks the last admission cached (its prompt's full blocks that were not cached yet)."""

    server: PrefixServer
    stream: list
    position: int = 0                               # the next request of the stream
    tick: int = 0                                   # arrivals so far, waits included
    finish_at: dict = field(default_factory=dict)   # request number -> tick that ends it
    admissions: list = field(default_factory=list)
    newly_cached: tuple = ()
    waited: bool = False
    evicted: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0

    def arrive(self) -> Admission | None:
        """Serve the next arrival; None (and waited = True) if its request must wait."""
        if self.position >= len(self.stream):
            raise ValueError(f"the stream has only {len(self.stream)} requests: press Reset")
        tick = self.tick
        self.tick += 1
        for request, ends in sorted(self.finish_at.items()):
            if ends <= tick:
                self.server.finish(request)
                del self.finish_at[request]
        item = self.stream[self.position]
        try:
            admission = self.server.admit(item.ids)
        except MemoryError:
            self.waited, self.newly_cached = True, ()
            return None
        self.waited, self.newly_cached = False, admission.cached_blocks
        self.finish_at[admission.request] = tick + item.lifetime
        self.position += 1
        self.admissions.append(admission)
        self.evicted += len(admission.evicted_blocks)
        self.prompt_tokens += len(admission.ids)
        self.reused_tokens += admission.reused_tokens
        return admission


def prefix_stream_explorer(params=None, seed: int = 0, n_blocks: int = 20, block_size: int = 4,
                           n_requests: int = 40):
    """Serve a seeded stream of requests with a prefix cache, one click at a time
    (prefix_caching).

    Returns a VBox with what the tests use: ``arrive`` (Button "Next request"), ``reset``
    (Button "Reset"), ``pool`` (IntSlider: blocks in the pool, from the smallest pool the
    stream fits in: two of its longest requests), ``block`` (Dropdown: block
    size), ``seed`` (BoundedIntText), ``status`` (HTML: the request, what it reused and
    prefilled, evictions, the pool, totals so far), ``check`` (HTML: its logits against a
    full recomputation), ``message`` (HTML: bad input in words), ``figure``, ``controls``,
    and ``run()`` (the StreamRun).
    """
    params = example_model() if params is None else params
    tokenizer = kvlib.ToyTokenizer()
    labels_of = tokenizer.tokens

    arrive = widgets.Button(description="Next request", button_style="primary")
    reset = widgets.Button(description="Reset")
    pool = widgets.IntSlider(value=n_blocks, min=2, max=48, description="pool blocks",
                             continuous_update=False)
    block = widgets.Dropdown(options=[2, 4, 8], value=block_size, description="block size")
    seed_box = widgets.BoundedIntText(value=seed, min=0, max=10_000, description="seed",
                                      layout=widgets.Layout(width="12em"))
    status, check, message = widgets.HTML(), widgets.HTML(), widgets.HTML()
    live = OneRenderFigure(figsize=(11, 6.6))
    state = {}

    def describe(admission: Admission | None) -> None:
        run = state["run"]
        states = pool_states(run.server)
        counts = np.bincount(states, minlength=len(POOL_STATES))
        pool_line = (f"Pool: {counts[0]} free, {counts[1]} cached and idle, "
                     f"{counts[2] + counts[3]} held by "
                     f"{plural(len(run.server.running), 'running request')}.")
        share = 100 * run.reused_tokens / run.prompt_tokens if run.prompt_tokens else 0.0
        totals = (f"So far: {run.reused_tokens} of {run.prompt_tokens} prompt tokens reused "
                  f"({share:.0f}%), {plural(run.evicted, 'block')} evicted.")
        if admission is None and run.waited:
            item = run.stream[run.position]
            text = (f"<b>Request {run.position} waits:</b> its {len(item.ids)} tokens need "
                    "more blocks than are free or evictable; the running requests hold the "
                    "rest. It is admitted after the next one finishes.")
        elif admission is None:
            text = "No request yet: press <b>Next request</b>."
        else:
            item = run.stream[admission.request]
            source = f"system prompt {item.system} + a question" if item.system else \
                "a question alone"
            reused = ", ".join(map(str, admission.reused_blocks)) or "none"
            evicted = ", ".join(map(str, admission.evicted_blocks)) or "none"
            text = (f"<b>Request {admission.request}</b> ({source}, "
                    f"{len(admission.ids)} tokens): reused {admission.reused_tokens} tokens "
                    f"(blocks {reused}), prefilled {admission.prefilled_tokens}. "
                    f"Evicted: {evicted}.")
        status.value = f"{text}<br>{pool_line} {totals}"

    def compare(admission: Admission) -> None:
        full = kvlib.forward(params, list(admission.ids), last_only=True)
        difference = float(np.max(np.abs(admission.logits - full)))
        if difference < TOLERANCE:
            check.value = ("its last token's logits equal a full recomputation "
                           f"(max difference below {TOLERANCE:.0e})")
        else:
            check.value = ("<b>its logits differ from a full recomputation</b> "
                           f"(max difference {difference:.1e})")

    def draw(admission: Admission | None) -> None:
        run = state["run"]
        draw_prefix_state(live.figure, run.server, admission, labels_of, new=run.newly_cached)
        describe(admission)
        arrive.disabled = run.position >= len(run.stream)
        live.show()

    def smallest_pool(stream, size: int) -> int:
        # two requests may hold blocks at once: room for two of the stream's longest
        return 2 * max(-(-len(item.ids) // size) for item in stream)

    def on_reset(*_):
        if state.get("adjusting"):         # the slider's own change below: handled here
            return
        size = int(block.value)
        stream = request_stream(n_requests, int(seed_box.value), tokenizer)
        smallest = smallest_pool(stream, size)
        state["adjusting"] = True
        try:                               # offer only pools this stream fits in; a raised
            pool.max = max(pool.max, smallest)     # minimum moves the value up with it
            pool.min = smallest
        finally:
            state["adjusting"] = False
        server = PrefixServer(params, int(pool.value), size)
        longest = max(server.blocks_needed(len(item.ids)) for item in stream)
        if 2 * longest > server.pool.n_blocks:   # two requests may hold blocks at once
            raise ValueError(f"a pool of {server.pool.n_blocks} blocks of {size} is too "
                             f"small for this stream: its longest request needs {longest} "
                             f"blocks, and two may run at once; take at least {2 * longest}")
        state["run"] = StreamRun(server, stream)
        check.value = ""
        draw(None)

    def on_arrive(_button):
        run = state.get("run")
        if run is None or run.position >= len(run.stream):
            arrive.disabled = True
            return
        admission = run.arrive()
        if admission is not None:
            compare(admission)
        draw(admission)

    arrive.on_click(safely(on_arrive, message))
    wire_reset(on_reset, message, reset, [pool, block, seed_box])

    box = widgets.VBox([widgets.HBox([arrive, reset, pool, block, seed_box]), status, check,
                        message, live.output])
    box.arrive, box.reset, box.pool, box.block, box.seed = arrive, reset, pool, block, seed_box
    box.status, box.check, box.message = status, check, message
    box.figure, box.live = live.figure, live
    box.controls = {"arrive": arrive, "reset": reset, "pool": pool, "block": block,
                    "seed": seed_box}
    box.run = lambda: state.get("run")
    return box
