"""Machines: the published accelerators the lessons compare against, and this machine's own
two roofline rates, measured (where_time_goes, batched_decoding, the_engine).

A rate measured here is whatever the machine does at that moment: use it for plots and
printed reports, never for assertions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import as_count
from .roofline import MiB, measure_matmul_rate, measure_read_bandwidth

ACCELERATORS = {
    "NVIDIA A100 80GB SXM, BF16": (312e12, 2.039e12),
    "NVIDIA H100 SXM, BF16": (989e12, 3.35e12),
}
"""(dense BF16 FLOP/s, memory bandwidth in bytes/s) from NVIDIA's data sheets: ridge points
of about 150 and 300 FLOPs per byte. Real kernels reach a fraction of either."""

BUSY_SPREAD = 1.5
"""Readings of one rate that differ by more than this factor (fastest / slowest) mean that
something else was using the machine while it was measured."""


@dataclass(frozen=True)
class MachineRates:
    """This machine's two roofline rates (where_time_goes): the medians of several readings,
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
                    read_bytes: int = 128 * MiB) -> MachineRates:
    """Measure the matrix-product rate and the read bandwidth (where_time_goes), interleaved over
    `rounds` rounds of 3 readings each; each rate is the median of all its readings."""
    rounds = as_count("rounds", rounds, 1)
    rates, bandwidths = [], []
    for _ in range(rounds):
        measure_matmul_rate(matmul_size, repeats=3, record=rates)
        measure_read_bandwidth(read_bytes, repeats=3, record=bandwidths)
    return rates_from_readings(rates, bandwidths)


def rates_from_readings(rates, bandwidths) -> MachineRates:
    """MachineRates from lists of readings (FLOP/s, bytes/s): medians and spreads."""
    rates, bandwidths = np.asarray(rates, float), np.asarray(bandwidths, float)
    if rates.size == 0 or bandwidths.size == 0 or (rates <= 0).any() or (bandwidths <= 0).any():
        raise ValueError("need at least one positive reading of each rate")
    return MachineRates(float(np.median(rates)), float(np.median(bandwidths)),
                        float(rates.max() / rates.min()),
                        float(bandwidths.max() / bandwidths.min()))
