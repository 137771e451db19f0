"""The when_the_cache_is_wrong lesson's tables and figures: the precision measurements of
tools/measure_precision.py (kvlib.precision.measured()) and the locator's tolerances of
tools/measure_tolerances.py (kvlib.debug.measured_tolerances()), read as the lesson shows
them."""

from __future__ import annotations

import math

import numpy as np

from .. import debug, precision
from ..cache_bugs import ZOO_FORMATS, zoo_tolerance

TOLERANCES = {number_format: zoo_tolerance(number_format) for number_format in ZOO_FORMATS}
"""The locator's tolerance in each format of the zoo widget (None: its default, in float32)."""

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
                         f"{sorted(key for key, value in measured.items() if 'rows' in value)}")
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


def beyond_chance(a: int, b: int) -> bool:
    """Whether two counts of rare events (greedy flips) differ by more than chance gives: each
    count is off by about its square root from run to run, so their difference by about
    sqrt(a + b); beyond chance is more than twice that."""
    return abs(a - b) > 2 * math.sqrt(a + b)


def flips() -> list[dict]:
    """Greedy flips in 16 bits: the cache's (cached against recomputed, in the format) and the
    format's (recomputed in the format against float64), over the same positions. The story
    model on its table's 48 windows of stories; SmolLM2 on two texts of 16 windows each
    (tools/measure_precision.py flips: Python's documentation, the table's text, measured
    again; and the story grammar's English), with each text's first and second 8 windows
    apart. Each: model, text, format, positions, cache, format_flips, halves ((cache,
    format) of each half, None without windows) and beyond_chance."""
    measured = precision.measured()
    found = []
    for row in rows("stories"):
        if row["where"] == "everything" and row["format"] in ("float16", "bfloat16"):
            cache = row["cached_against_recomputed"]["flips"]
            made = row["against_float64"]["flips"]
            found.append({"model": "stories", "text": "stories", "format": row["format"],
                          "positions": row["cached_against_recomputed"]["positions"],
                          "cache": cache, "format_flips": made, "halves": None,
                          "beyond_chance": beyond_chance(cache, made)})
    for text, formats in measured["flips"]["texts"].items():
        for number_format, counts in formats.items():
            cache, made = counts["cached_against_recomputed"], counts["against_float64"]
            half = len(cache) // 2
            found.append({"model": "smollm2", "text": text, "format": number_format,
                          "positions": sum(counts["positions"]), "cache": sum(cache),
                          "format_flips": sum(made),
                          "halves": [(sum(cache[:half]), sum(made[:half])),
                                     (sum(cache[half:]), sum(made[half:]))],
                          "beyond_chance": beyond_chance(sum(cache), sum(made))})
    return found


def flips_table() -> str:
    """flips() one line each: the flips of the cache and of the format, each half's, and
    whether they differ beyond chance."""
    lines = [f"{'':31} {'':9} {'flips of':>14}   {'each half':12}",
             f"{'model':8} {'text':12} {'format':9} {'positions':>9} {'cache':>6} "
             f"{'format':>7}   {'(cache / format)':24} beyond chance"]
    for row in flips():
        halves = ("" if row["halves"] is None else
                  ", ".join(f"{cache} / {made}" for cache, made in row["halves"]))
        lines.append(f"{row['model']:8} {row['text']:12} {row['format']:9} "
                     f"{row['positions']:9d} {row['cache']:6d} {row['format_flips']:7d}   "
                     f"{halves:24} {'yes' if row['beyond_chance'] else 'no'}")
    return "\n".join(line.rstrip() for line in lines)


def tolerances_table() -> str:
    """The locator's measured tolerances (kvlib.debug.measured_tolerances()), one line a model
    and format: the largest relative difference right loops showed, the tolerance, the
    smallest a planted bug showed where the locator found it (and which bug), and the gaps:
    smallest bug over largest right loop, and the same over the bugs of positions and masks."""
    measured = debug.measured_tolerances()

    def times(x: float) -> str:
        return f"{x:.1f}" if x < 100 else f"{x:,.0f}"

    lines = [f"{'':18} {'right loops:':>12} {'':9} {'smallest bug':>21}   "
             f"{'gap (bug / right loops)':>25}",
             f"{'model':8} {'format':9} {'largest':>12} {'tolerance':>9} "
             f"{'(where found)':>21}   {'smallest':>10} {'positions, masks':>16}"]
    for name, model in measured["models"].items():
        for number_format, entry in model["formats"].items():
            bug = f"{entry['smallest_bug']:.3g} ({entry['smallest_bug_name']})"
            lines.append(f"{name:8} {number_format:9} {entry['largest']:12.2g} "
                         f"{entry['tolerance']:9.2g} {bug:>21}   {times(entry['gap']):>10} "
                         f"{times(entry['loud_gap']):>16}")
    return "\n".join(line.rstrip() for line in lines)


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

FLOOR = 1e-8
"""Where the zoo's figure draws a difference of exactly 0 (a log axis cannot show 0)."""


def draw_differences(ax, differences, rounding: float, title: str) -> None:
    """The largest logit difference at each step (log scale), and the largest a right loop
    showed in this format (rounding), as a dashed line. A difference of exactly 0 (the two runs
    gave the same logits, as 16-bit rounding often does) is drawn at FLOOR with its own marker
    and named in the legend."""
    steps = np.arange(len(differences))
    shown = np.where(np.isnan(differences), np.nan, np.maximum(differences, FLOOR))
    zero = differences == 0
    ax.clear()
    ax.plot(steps, shown, "-", color="#0072B2", zorder=1)
    ax.plot(steps[~zero], shown[~zero], "o", color="#0072B2", label="this loop")
    if zero.any():
        ax.plot(steps[zero], shown[zero], "v", color="#0072B2", markerfacecolor="white",
                label=f"this loop: exactly 0 (drawn at {FLOOR:g})")
    ax.axhline(max(rounding, FLOOR), color="#E69F00", linestyle="--",
               label="a right loop's largest (measured, 48 windows)")
    failed = np.isnan(differences)
    if failed.any():
        first = int(np.argmax(failed))
        ax.axvline(first, color="#D55E00", linestyle=":", label=f"fails at step {first}")
    ax.axhline(FLOOR, color="0.6", linewidth=0.8, linestyle=":",
               label=f"{FLOOR:g}: the floor, where 0 is drawn (no difference at all)")
    ax.set_yscale("log")
    ax.set_ylim(FLOOR / 2, 100)
    ax.set_xlabel("token (0: the prefill's last row, then each decode step)")
    ax.set_ylabel("largest |logit difference|")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)   # beside: bugs fill the top


def zoo_runs() -> dict:
    """Every bug of the widget in every format, as tools/measure_precision.py zoo computed
    them with run_bug: label -> format -> {"differences", "report", "rows"} (a difference of
    None is a step that failed; rows: each decode step's, 15 of them)."""
    return precision.measured()["zoo"]["runs"]


def zoo_widget():
    """Plant a bug of the zoo, pick a number format, and see the logits part from
    recomputation step by step, with the locator's report and the rows each step computes
    (when_the_cache_is_wrong). The runs were made by tools/measure_precision.py zoo
    (run_bug, 33 of them, about 30 s) and are read from the file, so that the widget answers at
    once; the notebook runs the same bugs live above it, and a test recomputes some of the runs."""
    import ipywidgets as widgets

    from .base import LiveFigure, as_html, explorer

    runs = zoo_runs()
    labels = list(runs)
    controls = {"bug": widgets.Dropdown(options=labels, value=labels[1], description="bug"),
                "format": widgets.Dropdown(options=list(TOLERANCES), value="float32",
                                           description="format")}
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(10, 3.2))
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
        said = ("its default" if tolerance is None
                else f"{tolerance:g}, measured for the story model in {number_format}")
        report = "nothing parts" if run["report"] is None else as_html(run["report"])
        status.value = (f"<b>locator</b> (tolerance {said}): {report}<br>"
                        f"<b>rows each of the {len(run['rows'])} decode steps computes:</b> "
                        f"{run['rows']}")

    return explorer(live, controls, status, message, redraw, {"runs": runs})
