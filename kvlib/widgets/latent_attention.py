"""The latent_attention lesson: what multi-head latent attention caches a token, beside MHA, GQA and
MQA.

``latent_cache_calculator()`` takes the shapes of a published model (kvlib.memory.PRESETS:
its layers, query heads and head size), a latent size dc and a rotary key size dr, and
draws the bytes one token adds to the cache with latent attention beside the same model
with a K and a V for every query head (MHA), for groups of them (GQA) and for all of them
at once (MQA). ``draw_bytes_per_token`` is the bar chart, also used for the notebook's
plain figure.
"""

from __future__ import annotations

import html
import math
from numbers import Integral

import ipywidgets as widgets

from kvlib.memory import PRESETS, GiB, kv_cache_bytes, latent_cache_bytes

from .base import LiveFigure, check_choice, explorer, loading, plural

KIND_COLORS = {"MHA": "#3b528b", "GQA": "#21918c", "MQA": "#5ec962", "MLA": "#fde725"}
"""One viridis colour per kind of attention, dark (caches most) to light (the latent)."""
BF16_BYTES = 2
GQA_KV_HEADS = 8   # what Llama 3 and Mistral use


def grouped_kv_heads(n_heads: int) -> int | None:
    """The K/V heads of the GQA bar (latent_attention): 8, as in Llama 3, when n_heads is a larger
    multiple of 8; otherwise the largest divisor of n_heads between 1 and n_heads; None when
    there is none (Falcon-7B's 71 heads can only be MHA or MQA)."""
    if n_heads > GQA_KV_HEADS and n_heads % GQA_KV_HEADS == 0:
        return GQA_KV_HEADS
    divisors = [k for k in range(2, n_heads) if n_heads % k == 0]
    return max(divisors) if divisors else None


def compared_with(ratio: float, other: str) -> str:
    """How one size compares with another's (latent_attention), ratio = other's / this one's:
    '56.9 times less than MHA', '2.0 times more than MHA', 'as much as MHA'."""
    if round(ratio, 1) == 1.0:
        return f"as much as {other}"
    if ratio > 1:
        return f"{ratio:,.1f} times less than {other}"
    return f"{1 / ratio:,.1f} times more than {other}"


def _short_comparison(ratio: float) -> str:
    """The bar label's note: '(56.9x less)', '(2.0x more)', '(the same)'."""
    if round(ratio, 1) == 1.0:
        return "(the same)"
    return f"({ratio:,.1f}x less)" if ratio > 1 else f"({1 / ratio:,.1f}x more)"


def _whole(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number of at least {minimum}, got {value!r}")
    return int(value)


def bytes_per_token(n_layers: int, n_heads: int, head_dim: int, latent_dim: int,
                    rope_head_dim: int, dtype_bytes: int = BF16_BYTES) -> dict[str, int]:
    """Bytes one token adds to the cache of each kind, for one model's shapes (latent_attention):
    {"MHA": ..., "GQA": ..., "MQA": ..., "MLA": ...} (no "GQA" when n_heads has no divisor
    between 1 and itself). MHA, GQA and MQA cache a K and a V of head_dim for n_heads,
    grouped_kv_heads(n_heads) and 1 K/V heads; MLA caches latent_dim + rope_head_dim numbers.
    """
    n_layers, n_heads = _whole("layers", n_layers, 1), _whole("heads", n_heads, 1)
    head_dim = _whole("head size", head_dim, 1)
    latent_dim = _whole("the latent size dc", latent_dim, 1)
    rope_head_dim = _whole("the rotary key size dr", rope_head_dim, 0)
    if rope_head_dim % 2:
        raise ValueError(f"the rotary key size dr must be even (rotary positions turn pairs of "
                         f"columns), got {rope_head_dim}")
    rows = {"MHA": n_heads}
    if (grouped := grouped_kv_heads(n_heads)) is not None:
        rows["GQA"] = grouped
    rows["MQA"] = 1
    sizes = {kind: kv_cache_bytes(n_layers, None, 1, dtype_bytes=dtype_bytes, n_kv_heads=kv,
                                  head_dim=head_dim) for kind, kv in rows.items()}
    sizes["MLA"] = latent_cache_bytes(n_layers, latent_dim, rope_head_dim, 1,
                                      dtype_bytes=dtype_bytes)
    return sizes


def draw_bytes_per_token(ax, labels, values, kinds, title: str = "",
                         compare_to_first: bool = True) -> None:
    """Horizontal bars of bytes per token on a log scale (latent_attention), one colour per kind
    ('MHA', 'GQA', 'MQA', 'MLA'), each bar labelled with its bytes and, with
    compare_to_first, with how many times less (or more) than the first bar it caches."""
    if not (len(labels) == len(values) == len(kinds)) or not labels:
        raise ValueError(f"need as many labels, values and kinds, at least one each; got "
                         f"{len(labels)}, {len(values)}, {len(kinds)}")
    if any(value <= 0 for value in values):
        raise ValueError(f"bytes per token must be positive for a log scale, got {values}")
    unknown = set(kinds) - set(KIND_COLORS)
    if unknown:
        raise ValueError(f"kinds must be among {list(KIND_COLORS)}, got {sorted(unknown)}")
    ax.clear()
    positions = range(len(labels))
    ax.barh(positions, values, color=[KIND_COLORS[k] for k in kinds], edgecolor="black",
            linewidth=0.5)
    for y, value in zip(positions, values):
        note = f"  {_short_comparison(values[0] / value)}" if compare_to_first and y > 0 else ""
        ax.text(value, y, f" {value:,}{note}", va="center", fontsize=9)
    ax.set_yticks(list(positions), labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2, max(values) * (40 if compare_to_first else 8))
    ax.set_xlabel("bytes one token adds to the cache, all layers (log scale)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)


def _kind_label(kind: str, kv_heads: int | None, latent_dim: int, rope_head_dim: int) -> str:
    if kind == "MLA":
        return f"MLA, latent {latent_dim:,} + rotary {rope_head_dim:,}"
    return f"{kind}, {plural(kv_heads, 'K/V head')}"


def fit_labels(ax, pad_pixels: float = 8.0) -> None:
    """Make room for the labels of the latent_attention lesson's bars, whose lengths follow what is
    typed: on the left of the figure for the longest y tick label, and on the right of the (log) x
    axis for the text after each bar. Measures the texts as drawn, which costs far less
    than a full tight_layout."""
    figure = ax.figure
    widest = max((label.get_window_extent().width for label in ax.get_yticklabels()),
                 default=0.0)
    figure_width = figure.get_figwidth() * figure.dpi
    left = min(0.6, (widest + pad_pixels + ax.yaxis.get_tick_padding() * figure.dpi / 72)
               / figure_width)
    figure.subplots_adjust(left=max(left, 0.05))
    # a text anchored at value v ends inside the axes when the axes span, in decades, is at
    # least (log v - log bottom) / (1 - its width / the axes width)
    axes_width = ax.get_window_extent().width
    bottom = ax.get_xlim()[0]
    decades = [math.log10(text.get_position()[0] / bottom)
               / max(1 - (text.get_window_extent().width + pad_pixels) / axes_width, 0.05)
               for text in ax.texts]
    top = bottom * 10 ** max(decades, default=0.0)
    if top > ax.get_xlim()[1]:
        ax.set_xlim(bottom, top)


def latent_cache_calculator(preset: str = "DeepSeek-V2", latent_dim: int | None = None,
                            rope_head_dim: int | None = None):
    """Bytes per token of a latent against MHA, GQA and MQA, for a published model's shapes.

    The preset gives the layers, query heads and head size (for DeepSeek-V2 and V3, the
    heads that latent attention rebuilds); latent_dim and rope_head_dim default to the
    preset's own (512 and 64 for DeepSeek), or to DeepSeek's proportions, 4 x and 1/2 x the
    head size, for models without latent attention. Choosing a preset brings its sizes
    (those typed for the previous one are dropped: they were sized for other heads).
    Numbers in BF16.

    Returns a VBox with what the tests use: ``controls`` ({"preset", "latent_dim",
    "rope_head_dim"}), ``status`` and ``message`` (HTML; bad input is explained in the
    message line), ``figure``, and ``state["sizes"]`` (the bytes on show, from
    bytes_per_token).
    """
    check_choice("preset", preset, PRESETS)

    def defaults(model):
        if model.latent_dim is not None:
            return model.latent_dim, model.rope_head_dim
        return 4 * model.head_dim, model.head_dim // 4 * 2   # 512 and 64 for heads of 128

    start_dc, start_dr = defaults(PRESETS[preset])
    style = {"description_width": "150px"}
    controls = {
        "preset": widgets.Dropdown(options=list(PRESETS), value=preset, description="shapes of",
                                   style=style, layout=widgets.Layout(width="440px")),
        "latent_dim": widgets.IntText(value=start_dc if latent_dim is None else latent_dim,
                                      description="latent size dc", style=style,
                                      layout=widgets.Layout(width="260px")),
        "rope_head_dim": widgets.IntText(
            value=start_dr if rope_head_dim is None else rope_head_dim,
            description="rotary key size dr", style=style,
            layout=widgets.Layout(width="260px")),
    }
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(9, 2.8))
    # fixed margins: tight_layout would measure every log-scale tick label on each change
    live.figure.subplots_adjust(left=0.25, right=0.98, bottom=0.2, top=0.88)
    state = {"loading": False}

    def on_preset(change):
        # every preset brings its own dc and dr; redraw once, after both are set
        model = PRESETS.get(change["new"])
        if model is None:
            return
        with loading(state):
            controls["latent_dim"].value, controls["rope_head_dim"].value = defaults(model)

    def redraw(*_):
        if state["loading"]:
            return
        model = PRESETS[controls["preset"].value]
        dc, dr = controls["latent_dim"].value, controls["rope_head_dim"].value
        sizes = bytes_per_token(model.n_layers, model.n_heads, model.head_dim, dc, dr)
        state["sizes"] = sizes
        kv_heads = {"MHA": model.n_heads, "GQA": grouped_kv_heads(model.n_heads), "MQA": 1}
        labels = [_kind_label(kind, kv_heads.get(kind), dc, dr) for kind in sizes]
        draw_bytes_per_token(live.ax, labels, list(sizes.values()), list(sizes),
                             title=f"{model.name}'s shapes: {plural(model.n_layers, 'layer')}, "
                                   f"{plural(model.n_heads, 'head')} of {model.head_dim}, BF16")
        fit_labels(live.ax)
        live.show()
        mla, mha = sizes["MLA"], sizes["MHA"]
        equivalent = (dc + dr) / (2 * model.head_dim)       # K/V heads caching as much
        # past MHA's K and V together no grouping caches as much: say so instead of '39,062.75'
        like_gqa = (f"as much as GQA with {equivalent:,.2f} K/V heads of {model.head_dim}"
                    if equivalent <= model.n_heads else
                    f"more than any grouping of its {model.n_heads} heads could (a latent this "
                    "wide saves nothing)")
        context = model.context_length
        status.value = "<br>".join([
            f"MLA caches {plural(model.n_layers, 'layer')} x ({dc:,} + {dr:,}) numbers x 2 "
            f"bytes = <b>{mla:,} bytes a token</b>: {compared_with(mha / mla, 'MHA')} "
            f"({mha:,}), {like_gqa}.",
            f"At {context:,} tokens (the context length): {mla * context / GiB:,.2f} GiB "
            f"against {mha * context / GiB:,.2f} GiB with MHA.",
            f"<small>{html.escape(model.name)} itself uses {html.escape(model.attention)}. "
            f"Source: {html.escape(model.source)}</small>",
        ])

    controls["preset"].observe(on_preset, names="value")   # before explorer's redraw
    return explorer(live, controls, status, message, redraw, state)
