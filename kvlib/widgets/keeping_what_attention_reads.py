"""The keeping_what_attention_reads lesson: the measured cost of each eviction policy.

The data is tools/measure_eviction.py's (notebooks/data/keeping_what_attention_reads.json):
SmolLM2's loss a token fed one token at a time, and the share of a passage it copies with the
cue in the prompt ("question_last") or in a later pass ("question_later"), per policy and
budget, with the full cache as the ceiling. ``draw_curves(ax, data, measurement)`` draws one
measurement; ``curves_explorer(data)`` lets a student choose the measurement and policies.
"""

from __future__ import annotations

import ipywidgets as widgets

from .base import LiveFigure, check_choice, safely

MEASUREMENTS = {
    "loss": "loss a token (nats), fed one token at a time",
    "question_last": "share of the passage copied, cue in the prompt",
    "question_later": "share of the passage copied, cue in a later pass",
}
"""Each measurement's name in the data and what its axis shows."""
POLICY_LABELS = {"window": "window", "sinks": "4 sinks + window", "h2o": "H2O",
                 "tova": "TOVA", "snapkv": "SnapKV", "pyramidkv": "PyramidKV (SnapKV)"}
POLICY_COLORS = {"window": "#E69F00", "sinks": "#56B4E9", "h2o": "#009E73",
                 "tova": "#0072B2", "snapkv": "#D55E00", "pyramidkv": "#CC79A7"}
"""Okabe and Ito's colour-blind-safe palette; the full cache is drawn black and dashed."""
POLICY_MARKERS = {"window": "o", "sinks": "s", "h2o": "^", "tova": "D", "snapkv": "v",
                  "pyramidkv": "P"}


def measured_policies(data: dict, measurement: str) -> list[str]:
    """The policies the data measured for one measurement, in the data's order."""
    check_choice("measurement", measurement, MEASUREMENTS)
    if measurement == "loss":
        return list(data["loss"]["policies"])
    return list(data["copying"][measurement]["policies"])


def curve(data: dict, measurement: str, policy: str) -> tuple[list[int], list[float]]:
    """One policy's values against the budget -> (budgets, values)."""
    check_choice("policy", policy, measured_policies(data, measurement))
    if measurement == "loss":
        budgets = data["loss"]["budgets"]
        rows = data["loss"]["policies"][policy]
        return budgets, [rows[str(budget)]["mean"] for budget in budgets]
    return data["copying"]["budgets"], data["copying"][measurement]["policies"][policy]


def ceiling(data: dict, measurement: str) -> float:
    """The full cache's value: the best a budget can do."""
    check_choice("measurement", measurement, MEASUREMENTS)
    if measurement == "loss":
        return data["loss"]["full"]["mean"]
    return data["copying"][measurement]["full"]


def draw_curves(ax, data: dict, measurement: str, policies=None) -> None:
    """Each chosen policy's curve against the budget, and the full cache as a dashed line."""
    available = measured_policies(data, measurement)
    chosen = available if policies is None else [p for p in policies if p in available]
    ax.clear()
    for policy in chosen:
        budgets, values = curve(data, measurement, policy)
        ax.plot(budgets, values, marker=POLICY_MARKERS[policy], color=POLICY_COLORS[policy],
                label=POLICY_LABELS[policy])
    ax.axhline(ceiling(data, measurement), color="black", linestyle="--",
               label="full cache (ceiling)")
    ax.set_xscale("log", base=2)
    budgets = data["loss"]["budgets"] if measurement == "loss" else data["copying"]["budgets"]
    ax.set_xticks(budgets, [str(budget) for budget in budgets])
    ax.set_xlabel("budget (positions a layer)")
    ax.set_ylabel(MEASUREMENTS[measurement].split(",")[0])
    if measurement != "loss":
        ax.set_ylim(-0.03, 1.03)
    ax.set_title(f"SmolLM2: {MEASUREMENTS[measurement]}")
    ax.legend(fontsize=8)


def summary(data: dict, measurement: str, policies, budget: int = 128) -> str:
    """One line per chosen policy at one budget, against the full cache (HTML)."""
    full = ceiling(data, measurement)
    unit = " nats" if measurement == "loss" else ""
    parts = [f"full cache {full:.3f}{unit}"]
    for policy in policies:
        if policy not in measured_policies(data, measurement):
            parts.append(f"{POLICY_LABELS[policy]}: not measured here (it compresses a "
                         "prompt once; the loss is measured one token at a time)")
            continue
        budgets, values = curve(data, measurement, policy)
        if budget in budgets:
            parts.append(f"{POLICY_LABELS[policy]} {values[budgets.index(budget)]:.3f}{unit}")
    return f"At a budget of {budget}: " + "; ".join(parts)


def curves_explorer(data: dict, measurement: str = "loss", policies=None):
    """Choose a measurement and the policies to draw.

    Returns a VBox with the attributes the tests use: ``measurement`` (ToggleButtons),
    ``policies`` (SelectMultiple), ``status`` and ``message`` (HTML), ``figure``, ``axes``.
    """
    check_choice("measurement", measurement, MEASUREMENTS)
    policies = list(POLICY_LABELS) if policies is None else list(policies)
    for policy in policies:
        check_choice("policy", policy, POLICY_LABELS)
    choice = widgets.ToggleButtons(options=[(name.replace("_", " "), name)
                                            for name in MEASUREMENTS], value=measurement,
                                   description="measure")
    chosen = widgets.SelectMultiple(options=[(label, name) for name, label in
                                             POLICY_LABELS.items()], value=policies,
                                    description="policies", rows=len(POLICY_LABELS))
    status, message = widgets.HTML(), widgets.HTML()
    live = LiveFigure(figsize=(7, 3.8))

    def redraw(*_):
        draw_curves(live.ax, data, choice.value, chosen.value)
        live.figure.tight_layout()
        status.value = summary(data, choice.value, chosen.value)
        live.show()

    run = safely(redraw, message)
    for control in (choice, chosen):
        control.observe(run, names="value")
    run()
    box = widgets.VBox([widgets.HBox([choice, chosen]), message, status, live.output])
    box.measurement, box.policies, box.status, box.message = choice, chosen, status, message
    box.figure, box.axes = live.figure, live.axes
    return box


__all__ = ["MEASUREMENTS", "POLICY_COLORS", "POLICY_LABELS", "ceiling", "curve",
           "curves_explorer", "draw_curves", "measured_policies", "summary"]
