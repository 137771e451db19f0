"""The quantized_cache lesson: the quantized KV cache, drawn: each channel's size in a layer's keys
and values (the outlier channels), the error a quantized cache adds to every cached number, the
bytes a token costs, and the quality table of a model.

``quantized_cache_explorer(params, tokenizer, story)`` lets a student choose the bits (8, 4
or 2) and the grouping (per token or per channel) of K and of V. It prefills the story into
a QuantizedKVCache and shows the rounding error of one layer's keys as a heatmap, the bytes
per token beside float16 and kvlib's own dtype, and how often greedy decoding still picks
the same token, along the story and in a free continuation of it.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib
import numpy as np
from matplotlib.colors import LogNorm

import kvlib
from kvlib.plots import COLORMAP
from kvlib.serving.quantized import (
    PerChannel,
    PerToken,
    QuantizedKVCache,
    bytes_per_token,
    greedy_agreement,
    greedy_tokens,
    next_token_loss,
)

from .base import OneRenderFigure, explorer

BITS = (8, 4, 2)
GROUPINGS = ("per channel", "per token")
EXACT_COLOR = "white"
"""Cells whose number is held exactly (the full-precision residual) have no error to draw."""


def make_grouping(kind: str, bits: int, group_size: int = 32) -> PerToken | PerChannel:
    """'per token' or 'per channel' (quantized_cache) -> PerToken(bits) or PerChannel(bits,
    group_size)."""
    if kind == "per token":
        return PerToken(bits)
    if kind == "per channel":
        return PerChannel(bits, group_size)
    raise ValueError(f"the grouping must be one of {GROUPINGS}, got {kind!r}")


def channel_sizes(rows: np.ndarray) -> np.ndarray:
    """The size of every channel (column) of rows (T, w): max over positions of |x|, (w,)."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or not len(rows):
        raise ValueError(f"expected rows (T, w) with T >= 1, got shape {rows.shape}")
    return np.abs(rows).max(axis=0)


LEGEND_ROOM = 0.45
"""On the channel plot's log axis, the room above the largest number for the legend and the
labels, as a power of the data's own range: the top 30% of the axis stays empty."""


def draw_channel_sizes(ax, keys: np.ndarray, values: np.ndarray, title: str = "",
                       head_dim: int | None = None, n_marked: int = 2) -> None:
    """Each channel's largest |number| in a layer's keys and values (quantized_cache), channels
    on the x axis, on a log scale; the n_marked largest key channels are labelled. Lines
    between heads when head_dim is given. The axis leaves room above the data, so that the
    legend covers no point and no label."""
    key_sizes, value_sizes = channel_sizes(keys), channel_sizes(values)
    ax.clear()
    channels = np.arange(len(key_sizes))
    cmap = matplotlib.colormaps[COLORMAP]
    ax.plot(channels, key_sizes, "o-", color=cmap(0.15), markersize=3, linewidth=1,
            label="keys: max |K| of the channel")
    ax.plot(channels, value_sizes, "s-", color=cmap(0.75), markersize=3, linewidth=1,
            label="values: max |V| of the channel")
    for channel in np.argsort(key_sizes)[::-1][:n_marked]:
        ax.annotate(f"{channel}", (channel, key_sizes[channel]), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=8)
    if head_dim:
        for start in range(head_dim, len(key_sizes), head_dim):
            ax.axvline(start - 0.5, color="grey", linewidth=0.5, linestyle=":")
    ax.set_yscale("log")
    low = float(min(key_sizes.min(), value_sizes.min())) / 1.5
    high = float(max(key_sizes.max(), value_sizes.max()))
    if low > 0:
        ax.set_ylim(low, high * (high / low) ** LEGEND_ROOM)
    ax.set_xlabel("channel (column of the cached row)" + (f"; heads of {head_dim}, dotted"
                                                          if head_dim else ""))
    ax.set_ylabel("largest |number| over the positions")
    ax.set_xlim(-1, len(key_sizes))
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)


def draw_groupings(axes, n_positions: int = 12, width: int = 8, group_size: int = 4,
                   residual: int | None = None) -> None:
    """Which numbers share a scale (quantized_cache), on a grid of n_positions cached rows of
    width numbers: per token (axes[0]) every row is a group, per channel (axes[1]) every
    column of every group_size rows. Groups alternate in two shades; each carries one scale.
    Rows held in full precision are white: per channel, those after the last whole residual
    of `residual` rows (by default group_size: the newest, incomplete group); per token, with
    a residual, the newest `residual` rows (KIVI's values; without one, none)."""
    if len(axes) != 2:
        raise ValueError("draw_groupings needs two axes")
    token = PerToken(8, residual or 0)
    channel = PerChannel(8, group_size, residual)
    cmap = matplotlib.colormaps[COLORMAP]
    shades = np.array([cmap(0.35), cmap(0.75)])
    rows, columns = np.arange(n_positions)[:, None], np.arange(width)[None, :]
    per_token = shades[(rows + 0 * columns) % 2]
    per_channel = shades[(rows // group_size + columns) % 2]
    panels = ((axes[0], per_token, token, "per token: one scale per row"),
              (axes[1], per_channel, channel,
               f"per channel: one scale per column of {group_size} rows"))
    for ax, colours, grouping, title in panels:
        exact_from = grouping.quantized_positions(n_positions)
        colours[exact_from:] = (1, 1, 1, 1)
        ax.clear()
        ax.imshow(colours, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(width))
        ax.set_yticks(range(n_positions))
        ax.set_xticks(np.arange(width + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(n_positions + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="black", linewidth=0.3)
        ax.tick_params(which="both", length=0, labelsize=7)
        ax.set_xlabel("channel")
        ax.set_ylabel("position")
        ax.set_title(title, fontsize=10)
        if exact_from < n_positions:
            if grouping is token:
                note = f"full precision\n(the newest {token.residual} rows)"
            elif channel.residual == group_size:
                note = "full precision\n(the newest group, not yet full)"
            else:
                note = f"full precision\n(the residual, until {channel.residual} rows)"
            ax.text(width / 2 - 0.5, (exact_from + n_positions - 1) / 2, note, ha="center",
                    va="center", fontsize=8)


def error_norm(scale: float) -> LogNorm:
    """One log colour scale for error heatmaps, from 1e-4 x scale to scale (quantized_cache), so
    that 8, 4 and 2 bits can be told apart at a glance; 0 (held exactly) is drawn white."""
    return LogNorm(vmin=scale * 1e-4, vmax=scale)


def draw_error_heatmap(ax, error: np.ndarray, norm: LogNorm, title: str = "",
                       colorbar: bool = True):
    """|quantized - exact| of every cached number (quantized_cache): positions down, channels
    across, on the log scale norm; exact numbers (0) white. Returns the image."""
    error = np.asarray(error, dtype=np.float64)
    shown = np.ma.masked_less_equal(error, 0)
    cmap = matplotlib.colormaps[COLORMAP]
    cmap = cmap.with_extremes(bad=EXACT_COLOR, under=cmap(0.0))
    image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xlabel("channel")
    ax.set_ylabel("position")
    ax.set_title(title)
    if colorbar:
        bar = ax.figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        bar.set_label("|quantized - exact| (white: held exactly)")
    return image


def pairing_name(quality) -> str:
    """'K per channel, V per token' and so on: the groupings of a Quality (quantized_cache)."""
    def kind(grouping):
        return "per channel" if isinstance(grouping, PerChannel) else "per token"
    return f"K {kind(quality.keys)}, V {kind(quality.values)}"


LINEAR_LOSS = 1e-3
"""The quality plot's loss axis is linear within +-LINEAR_LOSS nats, logarithmic beyond."""


def draw_quality(axes, qualities) -> None:
    """The quality table as grouped bars (quantized_cache): for each pairing of groupings, a bar
    per bit width; the share of greedy picks left unchanged (%) on axes[0], the held-out
    loss added (nats per token) on axes[1]. That axis is symmetric-logarithmic: linear
    within +-LINEAR_LOSS (shaded), where int8's changes sit, up or down (quantization noise
    can also lower the loss a little), and logarithmic beyond, where int4's hundredths and
    int2's whole nats sit. qualities: kvlib.serving.quantized.Quality, any order."""
    if len(axes) != 2 or not qualities:
        raise ValueError("draw_quality needs two axes and at least one setting")
    pairings = list(dict.fromkeys(pairing_name(q) for q in qualities))
    widths = sorted({q.keys.bits for q in qualities}, reverse=True)
    cmap = matplotlib.colormaps[COLORMAP]
    colors = {bits: cmap(0.15 + 0.7 * i / max(1, len(widths) - 1))
              for i, bits in enumerate(widths)}
    bar = 0.8 / len(widths)
    for ax, value, label in ((axes[0], lambda q: 100 * q.agreement, "greedy picks unchanged (%)"),
                             (axes[1], lambda q: q.added_loss,
                              f"held-out loss added (nats per token)\nlinear within "
                              f"±{LINEAR_LOSS:g} (shaded), logarithmic beyond")):
        ax.clear()
        for i, bits in enumerate(widths):
            chosen = {pairing_name(q): q for q in qualities if q.keys.bits == bits}
            x = [j + (i - (len(widths) - 1) / 2) * bar for j, p in enumerate(pairings)
                 if p in chosen]
            heights = [value(chosen[p]) for p in pairings if p in chosen]
            ax.bar(x, heights, width=bar, color=colors[bits], edgecolor="black",
                   linewidth=0.5, label=f"int{bits}")
        ax.set_xticks(range(len(pairings)), [p.replace(", ", ",\n") for p in pairings],
                      fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, 112)
    axes[0].set_yticks(range(0, 101, 20))
    axes[0].legend(loc="upper center", ncol=len(widths), fontsize=8)
    axes[0].set_title("how often the greedy token stays the same")
    axes[1].set_yscale("symlog", linthresh=LINEAR_LOSS)
    axes[1].axhspan(-LINEAR_LOSS, LINEAR_LOSS, color="0.9", zorder=0)
    lowest = min(q.added_loss for q in qualities)
    axes[1].set_ylim(bottom=min(-LINEAR_LOSS, 2 * lowest))
    axes[1].axhline(0, color="black", linewidth=0.5)
    axes[1].set_title("what the cache costs in held-out loss")


def _relative_rms(error: np.ndarray, exact: np.ndarray) -> float:
    """RMS of the error over the RMS of the numbers themselves (quantized_cache)."""
    return float(np.sqrt(np.mean(error ** 2)) / np.sqrt(np.mean(exact ** 2)))


def _full_precision_rows(keys, values, n_positions: int, dtype: str) -> str:
    """Which of n_positions rows a cache holds in full precision, in words: "K's newest 8
    rows in float32", "no row in full precision"."""
    held = []
    for name, grouping in (("K", keys), ("V", values)):
        exact = n_positions - grouping.quantized_positions(n_positions)
        if exact:
            held.append(f"{name}'s newest {exact} row{'s' if exact > 1 else ''}")
    return " and ".join(held) + f" in {dtype}" if held else "no row in full precision"


def _tokens_html(tokens, reference) -> str:
    """The continuation's tokens, those that differ from the plain cache's in bold and
    underlined (no colour needed to see them)."""
    shown = []
    for token, plain in zip(tokens, reference):
        text = html.escape(token)
        shown.append(text if token == plain else f"<b><u>{text}</u></b>")
    return " ".join(shown)


MODELS = ("as trained", "outlier keys")


def quantized_cache_explorer(params: kvlib.Params, tokenizer, story, prompt_length: int = 32,
                             n_new: int = 24, layer: int = 0, group_size: int = 32,
                             outlier_params: kvlib.Params | None = None):
    """Choose bits and grouping for K and V; see what a QuantizedKVCache does (quantized_cache).

    story: ids (T,), BOS first, prefilled whole (T <= context length). The heatmap is the
    rounding error of layer `layer`'s keys; the status lines give the bytes per token (the live
    cache's nbytes / T, and the formula), the error of K and V, the loss along the story
    and the share of unchanged greedy picks, and a greedy continuation of the story's first
    prompt_length tokens by n_new tokens, with the tokens that differ from the plain cache's
    in bold. Results are kept per setting, so going back to one is instant. With
    outlier_params (the same model with outlier key channels,
    kvlib.serving.quantized.with_outlier_key_channels), a "keys" control switches between
    the two models.

    Returns a VBox with what the tests use: ``controls`` ({"key_bits", "key_grouping",
    "value_bits", "value_grouping", "layer"}, and "model" with outlier_params), ``status``,
    ``message``, ``figure`` and ``state`` ({"result": the setting on show, a dict;
    "results": every setting seen}).
    """
    config = params.config
    if outlier_params is not None and outlier_params.config != config:
        raise ValueError("outlier_params must be the same model's (its config differs)")
    story = kvlib.check_ids(story, params, "story")
    if len(story) > config.context_length:
        raise ValueError(f"the story has {len(story)} tokens; the context holds "
                         f"{config.context_length}")
    if not 1 <= prompt_length < len(story):
        raise ValueError(f"prompt_length must be between 1 and {len(story) - 1}, "
                         f"got {prompt_length}")
    if prompt_length + n_new > config.context_length:
        raise ValueError(f"prompt_length + n_new ({prompt_length} + {n_new}) exceeds the "
                         f"context length {config.context_length}")
    models = {MODELS[0]: params} | ({} if outlier_params is None else
                                     {MODELS[1]: outlier_params})
    plain = {}
    for name, model in models.items():
        logits, cache = kvlib.prefill(model, story)
        plain[name] = {"logits": logits, "loss": next_token_loss(logits, story),
                       "keys": [cache.keys(i) for i in range(config.n_layers)],
                       "values": [cache.values(i) for i in range(config.n_layers)]}
    plain_tokens = greedy_tokens(params, story[:prompt_length], n_new,
                                 kvlib.KVCache(config))
    norm = error_norm(float(max(np.abs(k).max() for reference in plain.values()
                                for k in reference["keys"])) / 2)
    float16_bytes = 2 * 2 * config.n_layers * config.kv_width
    own_bytes = float16_bytes * config.numpy_dtype.itemsize // 2

    toggle = dict(style={"button_width": "52px"})
    controls = {
        "key_bits": widgets.ToggleButtons(options=BITS, value=8, description="K bits",
                                          **toggle),
        "key_grouping": widgets.ToggleButtons(options=GROUPINGS, value="per channel",
                                              description="K scales",
                                              style={"button_width": "90px"}),
        "value_bits": widgets.ToggleButtons(options=BITS, value=8, description="V bits",
                                            **toggle),
        "value_grouping": widgets.ToggleButtons(options=GROUPINGS, value="per token",
                                                description="V scales",
                                                style={"button_width": "90px"}),
        "layer": widgets.IntSlider(value=layer, min=0, max=config.n_layers - 1,
                                   description="layer", continuous_update=False),
    }
    if outlier_params is not None:
        controls["model"] = widgets.ToggleButtons(options=MODELS, value=MODELS[0],
                                                  description="keys",
                                                  style={"button_width": "100px"})
    status, message = widgets.HTML(), widgets.HTML()
    # one render of the whole figure, laid out with room for every label (base.OneRenderFigure:
    # the inline backend's crop to a tight box draws a figure twice, and a click took 1.55 s
    # on a busy machine)
    live = OneRenderFigure(figsize=(10, 3.8), n_axes=2, width_ratios=[3, 1])
    live.figure.subplots_adjust(left=0.07, right=0.97, bottom=0.14, top=0.85, wspace=0.45)
    heatmap_ax, bytes_ax = live.axes
    image = draw_error_heatmap(heatmap_ax, np.zeros_like(plain[MODELS[0]]['keys'][0]), norm)
    labels = ["float16", f"kvlib {config.dtype}", "this cache"]
    bars = bytes_ax.barh(range(3), [float16_bytes, own_bytes, float16_bytes],
                         color=[matplotlib.colormaps[COLORMAP](x) for x in (0.35, 0.1, 0.8)],
                         edgecolor="black", linewidth=0.5)
    bytes_ax.set_yticks(range(3), labels)
    bytes_ax.invert_yaxis()
    bytes_ax.set_xlim(0, own_bytes * 1.6)
    bar_labels = [bytes_ax.text(bar.get_width(), y, f" {bar.get_width():,.0f}", va="center",
                                fontsize=8) for y, bar in enumerate(bars)]
    bytes_ax.set_xlabel("bytes per token")
    bytes_ax.set_title("cache per token")
    state = {"results": {}}

    def measure(setting):
        if setting in state["results"]:
            return state["results"][setting]
        model_name, key_bits, key_kind, value_bits, value_kind = setting
        model, reference = models[model_name], plain[model_name]
        keys = make_grouping(key_kind, key_bits, group_size)
        values = make_grouping(value_kind, value_bits, group_size)
        logits, cache = kvlib.prefill(model, story, QuantizedKVCache(config, keys, values))
        tokens = greedy_tokens(model, story[:prompt_length], n_new,
                               QuantizedKVCache(config, keys, values))
        # the rounding alone: each layer's plain keys and values, quantized and read back
        # (the cache's own rows in later layers also carry what earlier layers changed)
        key_error = [np.abs(keys.round_trip(rows) - rows) for rows in reference["keys"]]
        value_error = [np.abs(values.round_trip(rows) - rows) for rows in reference["values"]]
        exact_keys = np.concatenate(reference["keys"])
        exact_values = np.concatenate(reference["values"])
        result = {
            "keys": keys, "values": values, "nbytes": cache.nbytes, "model": model_name,
            "bytes_per_token": bytes_per_token(config.n_layers, config.kv_width, keys, values),
            "key_error": key_error,
            "key_rms": _relative_rms(np.concatenate(key_error), exact_keys),
            "value_rms": _relative_rms(np.concatenate(value_error), exact_values),
            "logit_error": float(np.abs(logits - reference["logits"]).mean()),
            "loss": next_token_loss(logits, story), "plain_loss": reference["loss"],
            "agreement": greedy_agreement(logits, reference["logits"]),
            "tokens": tokens,
            "same_tokens": sum(a == b for a, b in zip(tokens, plain_tokens)),
            "first_difference": next((i for i, (a, b) in enumerate(zip(tokens, plain_tokens))
                                      if a != b), None),
        }
        state["results"][setting] = result
        return result

    def redraw(*_):
        model_name = controls["model"].value if "model" in controls else MODELS[0]
        setting = (model_name, controls["key_bits"].value, controls["key_grouping"].value,
                   controls["value_bits"].value, controls["value_grouping"].value)
        result = measure(setting)
        state["result"] = result
        chosen = controls["layer"].value
        image.set_data(np.ma.masked_less_equal(result["key_error"][chosen], 0))
        heatmap_ax.set_title(f"layer {chosen}'s keys ({model_name}), {result['keys'].name}:\n"
                             f"rounding error of every cached key, {len(story)} positions",
                             fontsize=9)
        bars[2].set_width(result["bytes_per_token"])
        bar_labels[2].set_position((result["bytes_per_token"], 2))
        bar_labels[2].set_text(f" {result['bytes_per_token']:,.0f}")
        live.show()
        T = len(story)
        per_token = result["nbytes"] / T
        first = result["first_difference"]
        continuation = (f"all {n_new} the same as with the plain cache" if first is None else
                        f"{result['same_tokens']} of {n_new} the same, the first difference "
                        f"at new token {first + 1}")
        words = tokenizer.tokens(result["tokens"])
        plain_words = tokenizer.tokens(plain_tokens)
        status.value = "<br>".join([
            f"<b>K {html.escape(result['keys'].name)}, V "
            f"{html.escape(result['values'].name)}</b>: "
            f"{result['bytes_per_token']:,.1f} bytes a token once the groups are full "
            f"({float16_bytes / result['bytes_per_token']:.2f}x less than float16's "
            f"{float16_bytes:,}, {own_bytes / result['bytes_per_token']:.1f}x less than "
            f"kvlib's {config.dtype}); the live cache holds {result['nbytes']:,} bytes for "
            f"{T} positions ({per_token:,.1f} a position, "
            f"{_full_precision_rows(result['keys'], result['values'], T, config.dtype)}).",
            f"Error of the cached numbers, RMS relative to their own: keys "
            f"{100 * result['key_rms']:.2f}%, values {100 * result['value_rms']:.2f}%.",
            f"Along the story: logits off by {result['logit_error']:.4f} on average; loss "
            f"{result['loss']:.4f} nats against {result['plain_loss']:.4f}; the greedy pick is "
            f"the same at {100 * result['agreement']:.1f}% of the {T} positions.",
            f"Greedy continuation of the first {prompt_length} tokens: {continuation}:",
            f"<small>{_tokens_html(words, plain_words)}</small>",
        ])

    box = explorer(live, controls, status, message, redraw, state)
    box.plain_tokens = plain_tokens
    return box
