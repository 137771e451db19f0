"""Notebook 10: where the time goes. This machine's rates, the roofline, and batching.

``measure_machine()`` measures this machine's matrix-product rate and read bandwidth several
times and says whether the readings agree (another program on the machine makes them spread).
``batching_explorer()`` shows what a batched decode step reads and computes, for a model, a
batch size and a cache length, on this machine or on an accelerator: the weights are read once
for the whole batch, but every sequence's cache is read for that sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np

import kvlib
from kvlib import roofline

from .base import LiveFigure, safely
from .lesson09 import MODELS, format_flops

LAB_MODEL = kvlib.ModelConfig(vocab_size=2048, d_model=512, n_heads=8, n_layers=4, d_ff=2048,
                              context_length=512, dtype="float32")
"""The model notebook 10 times: big enough that its weights do not fit in a CPU's caches."""

ACCELERATORS = {
    "NVIDIA A100 80GB SXM, BF16": (312e12, 2.039e12),
    "NVIDIA H100 SXM, BF16": (989e12, 3.35e12),
}
"""(dense BF16 FLOP/s, memory bandwidth in bytes/s) from NVIDIA's data sheets: ridge points
of about 150 and 300 FLOPs per byte. Real kernels reach a fraction of either."""

BUSY_SPREAD = 1.5
"""Readings of one rate that differ by more than this factor (fastest / slowest) mean that
something else was using the machine while it was measured."""

MEMORY_BOUND_COLOR = "#3b528b"    # viridis blue
COMPUTE_BOUND_COLOR = "#5ec962"   # viridis green
WEIGHTS_COLOR = "#3b528b"
CACHE_COLOR = "#5ec962"


@dataclass(frozen=True)
class MachineRates:
    """This machine's two roofline rates (notebook 10): the medians of several readings,
    and how far the readings spread (fastest / slowest, 1.0 = all equal)."""

    compute_rate: float
    bandwidth: float
    compute_spread: float
    bandwidth_spread: float

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte at which arithmetic and reading take equal time."""
        return self.compute_rate / self.bandwidth

    @property
    def busy(self) -> bool:
        """True when the readings disagree by more than BUSY_SPREAD: do not trust them."""
        return max(self.compute_spread, self.bandwidth_spread) > BUSY_SPREAD

    def describe(self) -> str:
        """One line: the rates, the ridge point, and whether the machine was quiet."""
        line = (f"this machine: {self.compute_rate / 1e9:,.0f} GFLOP/s (matrix products), "
                f"{self.bandwidth / 1e9:,.1f} GB/s (reading memory), ridge point "
                f"{self.ridge_point:.1f} FLOPs per byte; readings spread by "
                f"x{self.compute_spread:.2f} and x{self.bandwidth_spread:.2f}")
        if self.busy:
            line += (". The readings disagree: another program was using the machine. Treat "
                     "every time below as unreliable, and run the cells again when it is "
                     "quiet.")
        return line


def measure_machine(rounds: int = 5, matmul_size: int = 1024,
                    read_bytes: int = 128 * roofline.MiB) -> MachineRates:
    """Measure the matrix-product rate and the read bandwidth (notebook 10), interleaved over
    `rounds` rounds of 3 readings each; each rate is the median of all its readings."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1, got {rounds!r}")
    rates, bandwidths = [], []
    for _ in range(rounds):
        roofline.measure_matmul_rate(matmul_size, repeats=3, record=rates)
        roofline.measure_read_bandwidth(read_bytes, repeats=3, record=bandwidths)
    return rates_from_readings(rates, bandwidths)


def rates_from_readings(rates, bandwidths) -> MachineRates:
    """MachineRates from lists of readings (FLOP/s, bytes/s): medians and spreads."""
    rates, bandwidths = np.asarray(rates, float), np.asarray(bandwidths, float)
    if rates.size == 0 or bandwidths.size == 0 or (rates <= 0).any() or (bandwidths <= 0).any():
        raise ValueError("need at least one positive reading of each rate")
    return MachineRates(float(np.median(rates)), float(np.median(bandwidths)),
                        float(rates.max() / rates.min()),
                        float(bandwidths.max() / bandwidths.min()))


def predicted_time_ratio(config: kvlib.ModelConfig, prompt_length: int, new_tokens: int,
                         ridge_point: float) -> float:
    """Roofline time without the cache / with it (notebook 10), on a machine whose compute
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
        flops = np.array([step.flops for step in kvlib.flops.generation_step_multiply_adds(
            config, prompt_length, new_tokens, use)], dtype=np.float64)
        # seconds with bandwidth 1 and compute rate = ridge point, for every ridge point
        totals[use] = np.maximum(flops[None, :] / ridge_points[:, None], n_bytes[None, :]).sum(1)
    return totals[False] / totals[True]


def batched_decode_step(config: kvlib.ModelConfig, batch: int, position: int,
                        bytes_per_number: int | None = None) -> dict:
    """What one decode step of `batch` sequences reads and computes (notebook 10), every
    sequence at 0-based `position`, so that each attends over position + 1 cached positions.

    The weights are read once for the whole batch; each sequence's keys and values are read
    for it alone. Returns FLOPs, bytes of the weights, of the caches, in all, and the
    arithmetic intensity (FLOPs per byte). bytes_per_number: 4 for float32 (the config's
    own, by default), 2 for BF16 on an accelerator.
    """
    for name, value in (("batch", batch), ("position", position)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if batch < 1:
        raise ValueError("batch must be at least 1")
    size = config.numpy_dtype.itemsize if bytes_per_number is None else bytes_per_number
    scale = size / config.numpy_dtype.itemsize
    flops = batch * kvlib.decode_step_multiply_adds(config, position).flops
    weights = roofline.weights_bytes(config) * scale
    caches = batch * roofline.cache_bytes(config, position + 1) * scale
    return {"flops": float(flops), "weights": float(weights), "caches": float(caches),
            "bytes": float(weights + caches), "intensity": float(flops / (weights + caches))}


def draw_batching(axes, config, position: int, batch: int, bytes_per_number: int,
                  ridge_point: float, max_batch: int = 1024) -> dict:
    """Two panels (notebook 10), cleared first. Left: the bytes one batched decode step reads,
    the weights (once) beside the caches (one per sequence). Right: arithmetic intensity
    against the batch size, with the machine's ridge point: below it the step waits for
    memory. Returns batched_decode_step(...) at `batch`."""
    left, right = axes
    for ax in axes:
        ax.clear()
    step = batched_decode_step(config, batch, position, bytes_per_number)
    left.bar([0], [step["weights"] / 1e9], color=WEIGHTS_COLOR, label="weights (read once)")
    left.bar([0], [step["caches"] / 1e9], bottom=[step["weights"] / 1e9], color=CACHE_COLOR,
             label=f"{batch} caches (one each)")
    left.set_xticks([0], [f"batch {batch}"])
    left.set_xlim(-1, 1)
    left.set_ylabel("GB read per decode step")
    left.set_title(f"Bytes read ({step['bytes'] / 1e9:,.2f} GB)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False, fontsize=8)
    batches = np.unique(np.geomspace(1, max_batch, 60).astype(int))
    one = batched_decode_step(config, 1, position, bytes_per_number)
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
    choices = {name: config for name, config in MODELS.items() if config.d_model > 4}
    if model not in choices:
        raise ValueError(f"model must be one of {list(choices)}, got {model!r}")
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
    box.model, box.hardware, box.batch, box.position = (model_choice, hardware, batch_slider,
                                                        position_slider)
    box.status, box.message = status, message
    box.figure, box.axes, box.live = live.figure, live.axes, live
    box.controls = {"model": model_choice, "hardware": hardware, "batch": batch_slider,
                    "position": position_slider}
    box.step = lambda: state.get("step")
    return box
