"""The grouped_query_attention lesson: which query heads share which K/V head, and what that does to
the cache.

``grouping_explorer()`` takes a published model (kvlib.memory.PRESETS) or a custom one and
lets a student choose the number of K/V heads among the divisors of the query heads. It
draws the grouping (each query head joined to the K/V head it reads, one colour a group)
and the cache KiB per token for every possible choice (each bar labelled with its own
value), and says how many tokens the chosen one fits in a memory budget for the cache.
"""

from __future__ import annotations

import html
import math
from numbers import Integral, Real

import ipywidgets as widgets
import numpy as np
from matplotlib.ticker import FuncFormatter, NullFormatter

from kvlib.grouped import group_size, query_groups
from kvlib.memory import PRESETS, GiB, kv_cache_bytes, tokens_that_fit
from kvlib.plots import MAX_HEADS, draw_query_groups, plural

from .base import CUSTOM, DTYPES, LiveFigure, carry, check_choice, loading, preset_dropdown, safely

MAX_BUDGET_GIB = 10**9  # a billion GiB: past any real machine, and still exact as bytes
CHOSEN_COLOR = "#21918c"  # viridis teal
OTHER_COLOR = "#c8c8c8"
GROUPABLE_PRESETS = tuple(name for name, preset in PRESETS.items() if preset.latent_dim is None)
"""The presets with K/V heads
(latent attention, the latent_attention lesson, caches a latent instead)."""


def divisors(n: int) -> list[int]:
    """The numbers of K/V heads a model with n query heads can have: the divisors of n."""
    return [k for k in range(1, n + 1) if n % k == 0]


def _whole(name: str, value, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and at most {maximum}"
        raise ValueError(f"{name} must be at least {minimum}{upper}, got {value}")
    return int(value)


def grouping_summary(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                     dtype_bytes: int = 2, budget_bytes: int = 16 * GiB) -> dict:
    """The numbers the explorer shows (grouped_query_attention).

    group: query heads a K/V head serves; kind: MHA, GQA or MQA; kv_head_of: the K/V head of
    each query head (h,); shared_by: for each K/V head, its query heads; bytes_per_token: K
    and V of one position in every layer; mha_bytes_per_token: the same with a K/V head for
    every query head; tokens_that_fit: cached positions in budget_bytes (over all sequences),
    mha_tokens_that_fit: the same for multi-head attention.
    """
    n_layers = _whole("layers", n_layers, 1)
    n_heads = _whole("query heads", n_heads, 1)
    head_dim = _whole("head size", head_dim, 1)
    group = group_size(n_heads, n_kv_heads)
    kv_head_of = query_groups(n_heads, n_kv_heads)
    per_token = kv_cache_bytes(n_layers, None, 1, 1, dtype_bytes, n_kv_heads=n_kv_heads,
                               head_dim=head_dim)
    mha = kv_cache_bytes(n_layers, None, 1, 1, dtype_bytes, n_kv_heads=n_heads,
                         head_dim=head_dim)
    kind = "MHA" if n_kv_heads == n_heads else "MQA" if n_kv_heads == 1 else "GQA"
    return {"group": group, "kind": kind, "kv_head_of": kv_head_of,
            "shared_by": [np.flatnonzero(kv_head_of == g).tolist() for g in range(n_kv_heads)],
            "bytes_per_token": per_token, "mha_bytes_per_token": mha,
            "tokens_that_fit": tokens_that_fit(budget_bytes, 0, per_token),
            "mha_tokens_that_fit": tokens_that_fit(budget_bytes, 0, mha)}


def kib_text(n_bytes: int) -> str:
    """Bytes as KiB for a bar's label (grouped_query_attention): '128' for 131,072, '0.0352' for
    36."""
    return f"{n_bytes // 1024:,}" if n_bytes % 1024 == 0 else f"{n_bytes / 1024:,.3g}"


def _heads_text(heads: list[int]) -> str:
    if len(heads) == 1:
        return f"query head {heads[0]} alone"
    return f"query heads {heads[0]}-{heads[-1]}"


def draw_bytes_per_choice(ax, n_layers: int, n_heads: int, head_dim: int, chosen: int,
                          dtype_bytes: int = 2, budget_bytes: int = 16 * GiB) -> list[int]:
    """Cache KiB per token for every possible number of K/V heads (grouped_query_attention), the
    chosen one highlighted, each bar labelled with its own KiB. (budget_bytes is only passed on to
    grouping_summary.) Returns the bytes per token of each choice, in the order drawn
    (1 K/V head first)."""
    choices = divisors(_whole("query heads", n_heads, 1, MAX_HEADS))
    if chosen not in choices:
        raise ValueError(f"{chosen} K/V heads cannot serve {n_heads} query heads equally: "
                         f"choose one of {choices}")
    per_token = [grouping_summary(n_layers, n_heads, k, head_dim, dtype_bytes,
                                  budget_bytes)["bytes_per_token"] for k in choices]
    ax.clear()
    positions = np.arange(len(choices))
    bars = ax.bar(positions, [b / 1024 for b in per_token],
                  color=[CHOSEN_COLOR if k == chosen else OTHER_COLOR for k in choices],
                  edgecolor="black", linewidth=0.5)
    for bar, n_bytes in zip(bars, per_token):
        ax.annotate(kib_text(n_bytes), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=7, rotation=90 if len(choices) > 6 else 0)
    ax.set_xticks(positions, labels=[str(k) for k in choices])
    ax.set_yscale("log")
    # plain tick labels: matplotlib's default 10^n labels go through mathtext, slow to draw
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(min(per_token) / 1024 / 2, max(per_token) / 1024 * 12)
    ax.set_xlabel("K/V heads (the divisors of the query heads)")
    ax.set_ylabel("cache KiB per token (log scale)")
    ax.set_title("Cache KiB per token for each choice\n(the number above each bar)",
                 fontsize=10)
    return per_token


def grouping_explorer(preset: str = "Llama-3-8B", budget_gib: float = 16.0,
                      dtype_bytes: int = 2):
    """Choose how many K/V heads serve a model's query heads, and see the grouping, the
    cache bytes per token and the tokens that fit in a memory budget.

    Returns a VBox with the attributes the tests use: ``preset`` (Dropdown of the presets
    with K/V heads, and "custom"), ``n_heads``, ``head_dim``, ``layers`` (IntText; changing
    one switches the preset to "custom"), ``kv_heads`` (Dropdown of the divisors of the query
    heads), ``dtype``, ``budget_gib`` (all also in ``controls``), ``status``, ``message``,
    ``source`` (HTML), ``figure``, ``axes`` and ``summary()`` (the numbers on show, from
    grouping_summary).
    """
    check_choice("preset", preset, GROUPABLE_PRESETS)
    if dtype_bytes not in DTYPES.values():
        raise ValueError(f"dtype_bytes must be one of {sorted(DTYPES.values())}")
    start = PRESETS[preset]
    style = {"description_width": "130px"}
    wide = widgets.Layout(width="300px")
    choose = preset_dropdown(GROUPABLE_PRESETS, preset, style)
    n_heads = widgets.IntText(value=start.n_heads, description="query heads", style=style,
                              layout=wide)
    head_dim = widgets.IntText(value=start.head_dim, description="head size", style=style,
                               layout=wide)
    layers = widgets.IntText(value=start.n_layers, description="layers", style=style,
                             layout=wide)
    kv_heads = widgets.Dropdown(options=divisors(start.n_heads), value=start.n_kv_heads,
                                description="K/V heads", style=style, layout=wide)
    dtype = widgets.Dropdown(options=list(DTYPES.items()), value=dtype_bytes,
                             description="number format", style=style, layout=wide)
    budget = widgets.FloatText(value=budget_gib, description="cache budget (GiB)",
                               style=style, layout=wide)
    status, message, source = widgets.HTML(), widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(11, 3.6), n_axes=2, gridspec_kw={"width_ratios": [1.6, 1]})
    # a fixed layout: tight_layout on every change would take most of the update's time
    live.figure.subplots_adjust(left=0.12, right=0.98, bottom=0.2, top=0.84, wspace=0.25)
    state = {"loading": False}

    def budget_bytes() -> int:
        value = budget.value
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
                or not 0 < value <= MAX_BUDGET_GIB:
            raise ValueError(f"the cache budget must be a number of GiB above 0 and at most "
                             f"{MAX_BUDGET_GIB:,}, got {value}")
        return int(value * GiB)

    def check_heads() -> int:
        return _whole("query heads", n_heads.value, 1, MAX_HEADS)

    def redraw(*_):
        if state["loading"]:
            return
        h = check_heads()
        if kv_heads.value not in divisors(h):      # the options follow the query heads
            raise ValueError(f"{kv_heads.value} K/V heads cannot serve {h} query heads")
        kv = int(kv_heads.value)
        summary = grouping_summary(layers.value, h, kv, head_dim.value, int(dtype.value),
                                   budget_bytes())
        state["summary"] = summary
        group, kind = summary["group"], summary["kind"]
        shared = summary["shared_by"]
        example = min(h - 1, group + 1)
        sharing = ("each with a K/V head of its own" if group == 1 else
                   f"share {plural(kv, 'K/V head')}, {group} to a group")
        saving = ("as much as multi-head attention, which it is" if group == 1 else
                  f"{group} times less than the {summary['mha_bytes_per_token']:,} of "
                  "multi-head attention")
        lines = [
            f"<b>{kind}</b>: {plural(h, 'query head')} {sharing}. Query head i reads K/V "
            f"head i // {group}: query head {example} reads K/V head {example // group}, "
            f"shared by {_heads_text(shared[example // group])}.",
            f"A token costs 2 (K and V) x {plural(layers.value, 'layer')} x "
            f"{plural(kv, 'K/V head')} x {head_dim.value} x {plural(dtype.value, 'byte')} = "
            f"<b>{summary['bytes_per_token']:,} bytes</b>, {saving}.",
            f"In {budget.value:g} GiB of cache: "
            f"<b>{plural(summary['tokens_that_fit'], 'cached token')}</b>, against "
            f"{summary['mha_tokens_that_fit']:,} with multi-head attention.",
        ]
        status.value = "<br>".join(lines)
        chosen = PRESETS.get(choose.value)
        if chosen is None:
            source.value = ""
        else:
            published = ("" if chosen.n_kv_heads == kv else
                         f" <b>You chose {plural(kv, 'K/V head')}; the published model has "
                         f"{chosen.n_kv_heads}.</b>")
            window = ("" if chosen.window is None else
                      f" Its sliding window keeps at most {chosen.window:,} positions of each "
                      "sequence (notebook 17).")
            source.value = (f"<small>{html.escape(chosen.name)}: "
                            f"{plural(chosen.n_heads, 'query head')}, "
                            f"{plural(chosen.n_kv_heads, 'K/V head')} of {chosen.head_dim}."
                            f"{window} Source: {html.escape(chosen.source)}</small>{published}")
        draw_query_groups(live.axes[0], h, kv)
        draw_bytes_per_choice(live.axes[1], layers.value, h, head_dim.value, kv,
                              int(dtype.value), budget_bytes())
        live.show()

    def set_heads_options(h: int, wanted: int) -> None:
        options = divisors(h)
        with loading(state):
            kv_heads.options = options
            kv_heads.value = wanted if wanted in options else max(k for k in options
                                                                  if k <= max(wanted, 1))

    def on_preset(change):
        chosen = PRESETS.get(change["new"])
        if chosen is None:          # "custom": the shapes stay, the published model's line goes
            redraw()
            return
        with loading(state):
            n_heads.value, head_dim.value = chosen.n_heads, chosen.head_dim
            layers.value = chosen.n_layers
        set_heads_options(chosen.n_heads, chosen.n_kv_heads)
        redraw()

    def on_shape(change):
        if state["loading"]:
            return
        if change["owner"] is n_heads:
            h = check_heads()
            set_heads_options(h, int(kv_heads.value))
        chosen = PRESETS.get(choose.value)
        if chosen is not None and (n_heads.value, head_dim.value, layers.value) != (
                chosen.n_heads, chosen.head_dim, chosen.n_layers):
            with loading(state):
                choose.value = CUSTOM
        redraw()

    choose.observe(safely(on_preset, message), names="value")
    for field in (n_heads, head_dim, layers):
        field.observe(safely(on_shape, message), names="value")
    for field in (kv_heads, dtype, budget):
        field.observe(safely(redraw, message), names="value")
    safely(redraw, message)()

    box = widgets.VBox([
        choose, source,
        widgets.HBox([widgets.VBox([n_heads, kv_heads, head_dim]),
                      widgets.VBox([layers, dtype, budget])]),
        message, status, live.output])
    controls = {"preset": choose, "n_heads": n_heads, "kv_heads": kv_heads,
                "head_dim": head_dim, "layers": layers, "dtype": dtype, "budget_gib": budget}
    return carry(box, controls, live, status=status, message=message, source=source,
                 summary=lambda: state.get("summary"))
