"""The where_time_goes lesson: where the time goes. This machine's rates, the roofline, and
batching.

``kvlib.hardware.measure_machine()`` measures this machine's matrix-product rate and read
bandwidth several times and says whether the readings agree (another program on the machine
makes them spread).
``batching_explorer()`` shows what a batched decode step reads and computes, for a model, a
batch size and a cache length, on this machine or on an accelerator: the weights are read once
for the whole batch, but every sequence's cache is read for that sequence alone.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import roofline
from kvlib.config import MODEL_SIZES
from kvlib.flops import format_flops
from kvlib.hardware import ACCELERATORS, MachineRates

from .base import LiveFigure, carry, check_choice, safely

LAB_MODEL = kvlib.ModelConfig(vocab_size=2048, d_model=512, n_heads=8, n_layers=4, d_ff=2048,
                              context_length=512, dtype="float32")
"""The model the where_time_goes lesson times: big enough that its weights do not fit in a CPU's
caches."""

MEMORY_BOUND_COLOR = "#3b528b"    # viridis blue
COMPUTE_BOUND_COLOR = "#5ec962"   # viridis green
WEIGHTS_COLOR = "#3b528b"
CACHE_COLOR = "#5ec962"


def predicted_time_ratio(config: kvlib.ModelConfig, prompt_length: int, new_tokens: int,
                         ridge_point: float) -> float:
    """Roofline time without the cache / with it (where_time_goes), on a machine whose compute
    rate is ridge_point times its bandwidth. Only that ratio matters: scaling both rates
    together scales both times alike."""
    return float(time_ratio_curve(config, prompt_length, new_tokens, [ridge_point])[0])


def time_ratio_curve(config: kvlib.ModelConfig, prompt_length: int, new_tokens: int,
                     ridge_points) -> np.ndarray:
    """predicted_time_ratio at every ridge point of a list: an array of the same length. The
    passes are counted once, so a long curve is quick."""
    ridge_points = np.asarray(ridge_points, dtype=np.float64)
    if ridge_points.ndim != 1 or not (ridge_points > 0).all():
        raise ValueError("ridge_points must be a list of positive numbers")
    n_bytes = roofline.generation_step_bytes(config, prompt_length, new_tokens).astype(float)
    totals = {}
    for use in (False, True):
        flops = kvlib.flops.generation_step_flops(config, prompt_length, new_tokens, use)
        # seconds with bandwidth 1 and compute rate = ridge point, for every ridge point
        totals[use] = np.maximum(flops[None, :] / ridge_points[:, None], n_bytes[None, :]).sum(1)
    return totals[False] / totals[True]


def draw_batching(axes, config, position: int, batch: int, bytes_per_number: int,
                  ridge_point: float, max_batch: int = 1024) -> dict:
    """Two panels (where_time_goes), cleared first. Left: the bytes one batched decode step reads,
    the weights (once) beside the caches (one per sequence). Right: arithmetic intensity
    against the batch size, with the machine's ridge point: below it the step waits for
    memory. Returns roofline.batched_step_cost(...) at `batch`."""
    left, right = axes
    for ax in axes:
        ax.clear()
    step = roofline.batched_step_cost(config, batch, position, bytes_per_number)
    left.bar([0], [step["weights"] / 1e9], color=WEIGHTS_COLOR, label="weights (read once)")
    left.bar([0], [step["caches"] / 1e9], bottom=[step["weights"] / 1e9], color=CACHE_COLOR,
             label=f"{batch} caches (one each)")
    left.set_xticks([0], [f"batch {batch}"])
    left.set_xlim(-1, 1)
    left.set_ylabel("GB read per decode step")
    left.set_title(f"Bytes read ({step['bytes'] / 1e9:,.2f} GB)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False, fontsize=8)
    batches = np.unique(np.geomspace(1, max_batch, 60).astype(int))
    one = roofline.batched_step_cost(config, 1, position, bytes_per_number)
    # every batch from the single step: B x its FLOPs over the weights + B x its cache
    intensity = batches * one["flops"] / (one["weights"] + batches * one["caches"])
    right.plot(batches, intensity, color=MEMORY_BOUND_COLOR, label="decode step")
    right.axhline(ridge_point, color="black", linestyle="--",
                  label=f"ridge point {ridge_point:,.0f} FLOP/byte")
    right.plot([batch], [step["intensity"]], "o", color="#fde725", markeredgecolor="black",
               markersize=9, label=f"batch {batch}")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("sequences decoded together (batch)")
    right.set_ylabel("FLOPs per byte read (log scale)")
    right.set_title(f"Intensity, {position + 1:,} cached positions each")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, loc="lower right")
    return step


def batching_explorer(machine: MachineRates | None = None,
                      model: str = "GPT-2 small (12 layers, d 768)", batch: int = 8,
                      position: int = 511):
    """Batch several sequences' decode steps and see what one step reads, computes and costs.

    Machines: the accelerators of ACCELERATORS (BF16, 2 bytes a number) and, when `machine`
    is given, this CPU with its measured rates (float32, 4 bytes). Returns a VBox with the
    attributes the tests use: ``model``, ``hardware``, ``batch``, ``position`` (controls, also
    in ``controls``), ``status`` and ``message`` (HTML), ``figure`` and ``axes``, and
    ``step()`` (the numbers on show, from batched_decode_step, with "seconds" added).
    """
    choices = {name: config for name, config in MODEL_SIZES.items() if config.d_model > 4}
    check_choice("model", model, choices)
    machines = {name: (rate, bandwidth, 2) for name, (rate, bandwidth) in ACCELERATORS.items()}
    if machine is not None:
        machines = {"this CPU (measured), float32": (machine.compute_rate, machine.bandwidth, 4),
                    **machines}
    model_choice = widgets.Dropdown(options=list(choices), value=model, description="model",
                                    layout=widgets.Layout(width="460px"))
    hardware = widgets.Dropdown(options=list(machines), value=list(machines)[0],
                                description="machine", layout=widgets.Layout(width="460px"))
    context = choices[model].context_length
    batch_slider = widgets.IntSlider(value=batch, min=1, max=1024, description="batch",
                                     continuous_update=False)
    position_slider = widgets.IntSlider(value=min(position, context - 1), min=0,
                                        max=context - 1, description="position",
                                        continuous_update=False)
    status = widgets.HTML()
    message = widgets.HTML()
    live = LiveFigure(figsize=(10, 3.6), n_axes=2, gridspec_kw={"width_ratios": [1, 2.2]})
    state = {}

    def redraw(*_):
        config = choices[model_choice.value]
        if position_slider.max != config.context_length - 1:
            position_slider.max = config.context_length - 1   # clamps the value, redraws
        rate, bandwidth, size = machines[hardware.value]
        B, S = int(batch_slider.value), int(position_slider.value)
        step = draw_batching(live.axes, config, S, B, size, rate / bandwidth)
        seconds = roofline.roofline_time(step["flops"], step["bytes"], rate, bandwidth)
        step["seconds"] = seconds
        state["step"] = step
        bound = ("memory-bound: the step waits for memory"
                 if step["intensity"] < rate / bandwidth else
                 "compute-bound: arithmetic sets the time")
        status.value = "<br>".join([
            f"{B} sequences at position {S:,}: {format_flops(step['flops'])} and "
            f"{step['weights'] / 1e9:,.2f} GB of weights (read once) + "
            f"{step['caches'] / 1e9:,.2f} GB of caches ({B} x "
            f"{step['caches'] / B / 1e6:,.1f} MB) per step.",
            f"{step['intensity']:,.1f} FLOPs per byte against a ridge point of "
            f"{rate / bandwidth:,.0f}: <b>{bound}</b>.",
            f"Roofline: {seconds * 1e3:,.3g} ms a step (the time per output token), "
            f"{1 / seconds:,.0f} tokens/s for each sequence, {B / seconds:,.0f} in all.",
        ])
        live.figure.tight_layout()
        live.show()

    update = safely(redraw, message)
    for control in (model_choice, hardware, batch_slider, position_slider):
        control.observe(update, names="value")
    update()

    box = widgets.VBox([widgets.HBox([model_choice, hardware]),
                        widgets.HBox([batch_slider, position_slider]), status, message,
                        live.output])
    controls = {"model": model_choice, "hardware": hardware, "batch": batch_slider,
                "position": position_slider}
    return carry(box, controls, live, status=status, message=message,
                 step=lambda: state.get("step"))
