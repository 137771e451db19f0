"""Widgets of the embedding_lookup lesson (tokens and the embedding lookup).

lookup_figure / draw_lookup: the lookup table (V, d) next to X = table[ids] (T, d), on one
colour scale, with a line from each row of the table to the row of X it is copied into; the
prompt's rows and one chosen token are outlined. embedding_explorer: the same picture for a
sentence the student types, plus a token picker.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

import kvlib
from kvlib import plots

from .base import LiveFigure, carry, read_prompt, safely

PROMPT_ROW_COLOR = "#ff8c00"    # orange: rows of the table that the sentence uses
SELECTED_ROW_COLOR = "#d6004c"  # crimson, dashed: the token picked in the dropdown
MAX_TOKENS = 12
"""The explorer draws at most this many tokens (BOS included), so the rows stay readable."""


def _outline_row(ax, row: int, columns: int, color: str, linestyle: str = "-",
                 lw: float = 2.5) -> None:
    ax.add_patch(Rectangle((-0.5, row - 0.5), columns, 1, fill=False, edgecolor=color,
                           linestyle=linestyle, lw=lw, zorder=4))


def draw_lookup(table_ax, x_ax, table, ids, vocabulary, selected: int | None = None):
    """Draw the embedding lookup (embedding_lookup) into two axes; returns X = table[ids] (T, d).

    Left: the table (V, d), rows labelled "id word", the rows the ids use outlined in
    orange, the `selected` token's row outlined dashed in crimson. Right: X (T, d), rows
    labelled "position: word", each joined by a line to the table row it is copied from.
    """
    table = np.asarray(table)
    if table.ndim != 2 or len(vocabulary) != table.shape[0]:
        raise ValueError(f"need a 2-D table with one row per vocabulary token, got shape "
                         f"{table.shape} for {len(vocabulary)} tokens")
    vocab_size, d = table.shape
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"ids must be a non-empty sequence of whole numbers, got {ids.tolist()!r}")
    if ids.min() < 0 or ids.max() >= vocab_size or not (
            selected is None or 0 <= selected < vocab_size):
        raise ValueError(f"token ids (and selected) must be between 0 and {vocab_size - 1}, "
                         f"got ids {ids.tolist()} and selected {selected}")
    ids = [int(i) for i in ids]
    X = kvlib.embed(np.asarray(ids, dtype=np.intp), table)
    vmin, vmax = float(table.min()), float(table.max())
    _place_axes(table_ax, x_ax, vocab_size, len(ids), d)
    columns = [str(j) for j in range(d)]
    plots.matrix_heatmap(table, [f"{i} {word}" for i, word in enumerate(vocabulary)], columns,
                         ax=table_ax, title=f"lookup table {table.shape}", vmin=vmin, vmax=vmax)
    for row in sorted(set(ids)):
        _outline_row(table_ax, row, d, PROMPT_ROW_COLOR)
        table_ax.get_yticklabels()[row].set_fontweight("bold")
    if selected is not None:
        _outline_row(table_ax, selected, d, SELECTED_ROW_COLOR, linestyle="--", lw=3.5)
    plots.matrix_heatmap(X, [f"{t}: {vocabulary[i]}" for t, i in enumerate(ids)], columns,
                         ax=x_ax, title=f"X = table[ids] {X.shape}", vmin=vmin, vmax=vmax)
    x_ax.yaxis.tick_right()
    for ax in (table_ax, x_ax):
        ax.set_xlabel("embedding dimension", fontsize=9)
    for position, row in enumerate(ids):
        x_ax.add_artist(ConnectionPatch(
            xyA=(d - 0.5, row), coordsA=table_ax.transData, xyB=(-0.5, position),
            coordsB=x_ax.transData, color=PROMPT_ROW_COLOR, lw=1.3, zorder=5))
    handles = [Patch(fill=False, edgecolor=PROMPT_ROW_COLOR, lw=2.5, label="rows the ids pick")]
    if selected is not None:
        handles.append(Patch(fill=False, edgecolor=SELECTED_ROW_COLOR, linestyle="--", lw=2.5,
                             label=f"picked token: {selected} {vocabulary[selected]}"))
    table_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.02),
                    frameon=False, fontsize=9)
    return X


CELL = 0.42          # inches per matrix cell, the same in both matrices
LOOKUP_FIGSIZE = (7.6, 6.8)


def _place_axes(table_ax, x_ax, table_rows: int, x_rows: int, columns: int) -> None:
    """Give both matrices the same cell size, tops aligned: table on the left, X on the right."""
    width, height = table_ax.figure.get_size_inches()
    top = height - 0.95
    left_table, left_x = 1.15, width - 1.05 - columns * CELL
    table_ax.set_position([left_table / width, (top - table_rows * CELL) / height,
                           columns * CELL / width, table_rows * CELL / height])
    x_ax.set_position([left_x / width, (top - x_rows * CELL) / height,
                       columns * CELL / width, x_rows * CELL / height])


def lookup_figure(table, ids, vocabulary, selected: int | None = None):
    """The lookup picture as a plain, new figure (embedding_lookup, shown before the widget)."""
    figure, (table_ax, x_ax) = plt.subplots(1, 2, figsize=LOOKUP_FIGSIZE)
    draw_lookup(table_ax, x_ax, table, ids, vocabulary, selected)
    return figure


def _ids_html(ids, tokenizer) -> str:
    cells = "".join(
        f"<td style='padding:0 8px;text-align:center'>{html.escape(word)}<br><b>{i}</b></td>"
        for i, word in zip(ids, tokenizer.tokens(ids)))
    return f"<table><tr><td style='padding-right:8px'>token<br>id</td>{cells}</tr></table>"


def embedding_explorer(params: kvlib.Params | None = None, text: str = kvlib.ARTICLE_PROMPT,
                       selected: int = 1):
    """Type a sentence, see its ids and X = table[ids]; pick a token, see its row
    (embedding_lookup).

    Returns a VBox with: ``sentence`` (Text; applied on Enter or when it loses focus),
    ``token`` (Dropdown of the vocabulary), ``controls`` (both, by name), ``ids_view`` and
    ``row_view`` (HTML), ``status`` (HTML: an unknown word or a too long sentence shows the
    message here, and the last good picture stays), ``figure`` and ``axes`` (table, X),
    and ``shown`` (a dict: the "ids", "X" and "selected" token on show).
    """
    params = kvlib.init_params() if params is None else params
    tokenizer = kvlib.ToyTokenizer()
    table = params.embedding
    if table.shape[0] != len(tokenizer):
        raise ValueError(f"the table has {table.shape[0]} rows but the toy vocabulary has "
                         f"{len(tokenizer)} tokens")
    first_ids = read_prompt(text, tokenizer, MAX_TOKENS)
    if not 0 <= selected < len(tokenizer):
        raise ValueError(f"selected must be a token id between 0 and {len(tokenizer) - 1}")

    words = ", ".join(f"<code>{html.escape(word)}</code>" for word in tokenizer.words())
    allowed = widgets.HTML(f"Words you can use (any case): {words}. "
                           "The tokenizer puts <code>&lt;bos&gt;</code> in front.")
    sentence = widgets.Text(value=text, description="sentence", continuous_update=False,
                            placeholder="type a sentence and press Enter",
                            layout=widgets.Layout(width="360px"))
    token = widgets.Dropdown(options=[(f"{i}: {word}", i)
                                      for i, word in enumerate(tokenizer.vocabulary)],
                             value=selected, description="token")
    ids_view, row_view, status = widgets.HTML(), widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=LOOKUP_FIGSIZE, n_axes=2)
    shown = {"ids": first_ids, "X": None, "selected": selected}

    def draw():
        for ax in live.axes:
            ax.clear()
        shown["X"] = draw_lookup(live.axes[0], live.axes[1], table, shown["ids"],
                                 tokenizer.vocabulary, shown["selected"])
        ids_view.value = _ids_html(shown["ids"], tokenizer)
        chosen = shown["selected"]
        positions = [t for t, i in enumerate(shown["ids"]) if i == chosen]
        where = (f"X repeats it at position(s) {positions}" if positions
                 else "your sentence does not use it")
        values = np.array2string(table[chosen], precision=3, suppress_small=True)
        row_view.value = (f"Row {chosen} of the table, token "
                          f"<code>{html.escape(tokenizer.vocabulary[chosen])}</code>: "
                          f"<code>{values}</code>; {where}.")
        live.show()

    def on_sentence(change):
        shown["ids"] = read_prompt(change["new"], tokenizer, MAX_TOKENS)
        draw()

    def on_token(change):
        shown["selected"] = int(change["new"])
        draw()

    sentence.observe(safely(on_sentence, status), names="value")
    token.observe(safely(on_token, status), names="value")
    draw()

    box = widgets.VBox([allowed, widgets.HBox([sentence, token]), ids_view, status,
                        live.output, row_view])
    return carry(box, {"sentence": sentence, "token": token}, live, ids_view=ids_view,
                 row_view=row_view, status=status, shown=shown)
