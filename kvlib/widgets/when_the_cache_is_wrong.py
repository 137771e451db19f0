"""The when_the_cache_is_wrong lesson's tables and figure: the precision measurements of
tools/measure_precision.py (kvlib.precision.measured()), read as the lesson shows them."""

from __future__ import annotations

import numpy as np

from .. import precision
from ..cache_bugs import ZOO_TOLERANCES as TOLERANCES

COLUMNS = {
    "cached_against_recomputed": "cached vs recomputed",
    "against_float64": "vs float64",
    "padded_against_alone": "padded vs alone",
}


def rows(model: str) -> list[dict]:
    """The committed rows of one model ("stories" or "smollm2")."""
    measured = precision.measured()
    if model not in measured:
        raise ValueError(f"no precision measurements for {model!r}; there are "
                         f"{sorted(key for key in measured if key != 'command')}")
    return measured[model]["rows"]


def _cell(comparison: dict | None) -> str:
    if comparison is None:
        return f"{'':>24}"
    return (f"{comparison['largest_difference']:9.2g} {comparison['flips']:5d}/"
            f"{comparison['positions']:<6d}   ")


def table(model: str) -> str:
    """One line a row: the format, where it applies, and for each comparison the largest
    logit difference and the greedy flips over the positions."""
    header = f"{'format':9} {'where':11}" + "".join(f"{name:>24}" for name in COLUMNS.values())
    lines = [header, f"{'':21}" + "   largest |Δ|  flips/positions" * len(COLUMNS)]
    for row in rows(model):
        lines.append(f"{row['format']:9} {row['where']:11}" +
                     "".join(f"{_cell(row.get(column)):>24}" for column in COLUMNS))
    return "\n".join(lines)


def draw_precision(ax, model: str, title: str) -> None:
    """Bars of the largest logit difference, cached against recomputed, and of what the
    format itself moves the logits (against float64), for each row; log scale; the greedy
    flips of both written above each pair (cached vs recomputed / vs float64)."""
    measured = rows(model)
    labels = [f"{row['format']}\n{row['where']}" for row in measured]
    x = np.arange(len(measured))
    floor = 1e-16                                   # a log axis cannot show 0
    for offset, column, colour in ((-0.2, "cached_against_recomputed", "#0072B2"),
                                   (0.2, "against_float64", "#E69F00")):
        heights = [max(row[column]["largest_difference"], floor) for row in measured]
        ax.bar(x + offset, heights, width=0.4, color=colour, label=COLUMNS[column])
    for index, row in enumerate(measured):
        top = max(row["cached_against_recomputed"]["largest_difference"],
                  row["against_float64"]["largest_difference"], floor)
        ax.annotate(f"{row['cached_against_recomputed']['flips']} / "
                    f"{row['against_float64']['flips']} flips", (index, top),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.axhline(floor, color="0.6", linewidth=0.8, linestyle=":",
               label=f"{floor:g}: no difference (a 0 is drawn here)")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 10)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("largest |logit difference|")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)


# ------------------------------------------------------------------------------ the zoo widget

def draw_differences(ax, differences, rounding: float, title: str) -> None:
    """The largest logit difference at each step (log scale; 0 drawn at the floor), and the
    largest a right loop showed in this format (rounding), as a dashed line."""
    floor = 1e-8
    steps = np.arange(len(differences))
    shown = np.where(np.isnan(differences), np.nan, np.maximum(differences, floor))
    ax.clear()
    ax.plot(steps, shown, "o-", color="#0072B2", label="this loop")
    ax.axhline(max(rounding, floor), color="#E69F00", linestyle="--",
               label="a right loop's largest (measured, 48 windows)")
    failed = np.isnan(differences)
    if failed.any():
        first = int(np.argmax(failed))
        ax.axvline(first, color="#D55E00", linestyle=":", label=f"fails at step {first}")
    ax.axhline(floor, color="0.6", linewidth=0.8, linestyle=":",
               label=f"{floor:g}: no difference at all (a 0 is drawn here)")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 100)
    ax.set_xlabel("token (0: the prefill's last row, then each decode step)")
    ax.set_ylabel("largest |logit difference|")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)


def zoo_runs() -> dict:
    """Every bug of the widget in every format, as tools/measure_precision.py zoo computed
    them with run_bug: label -> format -> {"differences", "report", "rows"} (a difference of
    None is a step that failed)."""
    return precision.measured()["zoo"]["runs"]


def zoo_widget():
    """Plant a bug of the zoo, pick a number format, and see the logits part from
    recomputation step by step, with the locator's report and the rows each step computes
    (when_the_cache_is_wrong). The runs were made by tools/measure_precision.py zoo
    (run_bug, 33 of them, about 20 s) and are read from the file, so that the widget answers at
    once; the notebook runs the same bugs live above it, and a test recomputes some of the runs."""
    import ipywidgets as widgets

    from .base import LiveFigure, as_html, explorer

    runs = zoo_runs()
    labels = list(runs)
    controls = {"bug": widgets.Dropdown(options=labels, value=labels[1], description="bug"),
                "format": widgets.Dropdown(options=list(TOLERANCES), value="float32",
                                           description="format")}
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(8, 3.2))
    ceilings = {row["format"]: row["cached_against_recomputed"]["largest_difference"]
                for row in rows("stories") if row["where"] == "everything"}

    def redraw(_=None) -> None:
        label, number_format = controls["bug"].value, controls["format"].value
        run = runs[label][number_format]
        differences = np.array([np.nan if d is None else d for d in run["differences"]])
        draw_differences(live.ax, differences, ceilings[number_format],
                         f"{label}, {number_format}")
        live.figure.tight_layout()
        live.show()
        tolerance = TOLERANCES[number_format]
        report = "nothing parts" if run["report"] is None else as_html(run["report"])
        status.value = (f"<b>locator</b> (tolerance {tolerance or 'default'}): {report}<br>"
                        f"<b>rows each of the first {len(run['rows'])} decode steps "
                        f"computes:</b> {run['rows']}")

    return explorer(live, controls, status, message, redraw, {"runs": runs})
