"""Which numbers share a scale (quantized_cache), chosen for K and V apart, and how each grouping
stores a layer's rows:

- PerToken(bits, residual=0): one scale per cached row; with residual=R the newest R rows stay
  in full precision (KIVI's values); stored by a PerTokenStore;
- PerChannel(bits, group_size, residual=None): one scale per column over a group of G
  positions; the newest rows stay in full precision until R of them have arrived, then are
  quantized G at a time (KIVI's keys); stored by a PerChannelStore.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...checks import as_count, as_whole_number
from .codes import (
    LARGEST_SCALE,
    SCALE_BYTES,
    SCALE_DTYPE,
    _as_float_array,
    _check_bits,
    dequantize,
    max_code,
    pack_codes,
    packed_width,
    quantize,
    round_trip,
    symmetric_scales,
    unpack_codes,
)


def _check_quantizable(rows: np.ndarray, what: str, bits: int) -> None:
    """Refuse, before anything is stored, what quantize would fail on."""
    if not np.isfinite(rows).all():
        raise ValueError(f"{what} holds NaN or infinite values: they cannot be quantized")
    limit = LARGEST_SCALE * max_code(bits)
    if np.abs(rows).max() > limit:
        raise ValueError(f"{what} holds numbers up to {np.abs(rows).max():.3g}, too large for "
                         f"float16 scales at {bits} bits (at most {limit:.4g})")


def _check_truncate(grouping, length: int, n: int) -> None:
    """Refuse to cut a store of `length` positions back to n when the full-precision rows that
    n positions held are gone (quantized since): the state of n positions cannot be rebuilt.
    Allowed: n positions needing no full-precision row, or needing only rows still held."""
    needed_from, held_from = grouping.quantized_positions(n), grouping.quantized_positions(length)
    if needed_from < n and needed_from < held_from:
        def rows(first, last):
            return f"row {first}" if first == last else f"rows {first}-{last}"
        lost = rows(needed_from, held_from - 1)
        raise ValueError(
            f"cannot truncate this cache from {length} to {n} positions: {n} positions held "
            f"{rows(needed_from, n - 1)} in full precision ({grouping.name}), and {lost} "
            f"{'is' if needed_from == held_from - 1 else 'are'} already quantized since. "
            f"{grouping.truncation_hint()}, or keep a checkpoint() from before and restore() it")


@dataclass(frozen=True)
class PerToken:
    """One scale per cached row (quantized_cache): a token's K (or V) in one layer, over all
    its K/V heads. A row can be quantized the moment it arrives (residual=0, the default).

    With residual=R, the newest R rows are held in full precision, and each row is quantized
    when it falls out of them: what KIVI does with the values.
    """

    bits: int = 8
    residual: int = 0

    def __post_init__(self):
        _check_bits(self.bits)
        as_whole_number("residual", self.residual, 0)

    @property
    def name(self) -> str:
        text = f"int{self.bits} per token"
        return text + (f", the newest {self.residual} in full precision" if self.residual else "")

    def quantized_positions(self, n_positions: int) -> int:
        """How many of n_positions are read back quantized: all but the newest `residual`."""
        return max(0, n_positions - self.residual)

    def truncation_hint(self) -> str:
        return f"Truncate only while the cache holds at most {self.residual} positions"

    def round_trip(self, rows) -> np.ndarray:
        """What the cache holds for rows (n, w) stored from position 0: each row but the
        newest `residual` read back with its own scale, those as they were."""
        rows = _as_float_array(rows, "rows")
        held = rows.astype(np.float64, copy=True)
        old = self.quantized_positions(len(rows))
        if old:
            held[:old] = round_trip(rows[:old], self.bits, axis=1)
        return held

    def bytes_per_token(self, width: int) -> float:
        """Bytes one quantized position costs in one layer: its packed codes and its float16
        scale."""
        return packed_width(width, self.bits) + SCALE_BYTES

    def nbytes(self, n_positions: int, width: int, residual_bytes: int) -> int:
        """Bytes held for n_positions rows of width numbers: codes and scales of the quantized
        rows, and the residual rows at residual_bytes a number."""
        old = self.quantized_positions(as_whole_number("n_positions", n_positions, 0))
        residual_bytes = as_whole_number("residual_bytes", residual_bytes, 1)
        return old * int(self.bytes_per_token(width)) + (n_positions - old) * width * \
            residual_bytes

    def store(self, n_layers: int, capacity: int, width: int, dtype) -> PerTokenStore:
        return PerTokenStore(self, n_layers, capacity, width, dtype)


@dataclass(frozen=True)
class PerChannel:
    """One scale per column over each group of group_size positions (quantized_cache).

    The newest rows are held in full precision until `residual` of them have arrived (R, a
    multiple of group_size G; by default R = G); then all R are quantized, G rows at a time,
    and the residual starts again empty. So at most R - 1 rows are in full precision. What
    KIVI does with the keys (its code takes G and R apart: G = 32 with R = 128, for example),
    whose outlier channels would otherwise set every token's scale.
    """

    bits: int = 8
    group_size: int = 32
    residual: int | None = None

    def __post_init__(self):
        _check_bits(self.bits)
        as_whole_number("group_size", self.group_size, 1)
        if self.residual is None:
            object.__setattr__(self, "residual", self.group_size)
        as_whole_number("residual", self.residual, 1)
        if self.residual % self.group_size:
            raise ValueError(f"residual must be a multiple of group_size ({self.group_size}): "
                             f"a full residual is quantized as whole groups, got "
                             f"{self.residual}")

    @property
    def name(self) -> str:
        text = f"int{self.bits} per channel (groups of {self.group_size}"
        if self.residual != self.group_size:
            text += f", residual {self.residual}"
        return text + ")"

    def quantized_positions(self, n_positions: int) -> int:
        """How many of n_positions are quantized: the whole residuals (the rest is held)."""
        return n_positions // self.residual * self.residual

    def truncation_hint(self) -> str:
        return f"Truncate to a multiple of {self.residual}"

    def round_trip(self, rows) -> np.ndarray:
        """What the cache holds for rows (n, w) stored from position 0: every group of the
        quantized positions read back with its column scales, the residual as it was."""
        rows = _as_float_array(rows, "rows")
        held = rows.astype(np.float64, copy=True)
        for start in range(0, self.quantized_positions(len(rows)), self.group_size):
            group = rows[start:start + self.group_size]
            held[start:start + self.group_size] = round_trip(group, self.bits, axis=0)
        return held

    def bytes_per_token(self, width: int) -> float:
        """Bytes one quantized position costs in one layer: its packed codes and its share of
        the group's width float16 scales, 2 x width / group_size (a fraction)."""
        return packed_width(width, self.bits) + SCALE_BYTES * int(width) / self.group_size

    def nbytes(self, n_positions: int, width: int, residual_bytes: int) -> int:
        """Bytes held for n_positions rows: codes and scales of the quantized groups, and the
        residual rows at residual_bytes a number."""
        n_positions = as_whole_number("n_positions", n_positions, 0)
        width = as_count("width", width, 1)
        full = self.quantized_positions(n_positions)
        group_bytes = self.group_size * packed_width(width, self.bits) + width * SCALE_BYTES
        residual_bytes = as_whole_number("residual_bytes", residual_bytes, 1)
        return full // self.group_size * group_bytes + (n_positions - full) * width * \
            residual_bytes

    def store(self, n_layers: int, capacity: int, width: int, dtype) -> PerChannelStore:
        return PerChannelStore(self, n_layers, capacity, width, dtype)


class PerTokenStore:
    """K or V of every layer, per-token quantized: packed codes (layers, capacity, bytes a
    row), one float16 scale per row (layers, capacity), and the newest `residual` rows in
    full precision, a ring (layers, R, width): position p sits in residual row p % R."""

    def __init__(self, grouping: PerToken, n_layers: int, capacity: int, width: int, dtype):
        self.grouping, self.width, self.dtype = grouping, width, np.dtype(dtype)
        self.codes = np.zeros((n_layers, capacity, packed_width(width, grouping.bits)),
                              dtype=np.uint8)
        self.scales = np.zeros((n_layers, capacity), dtype=SCALE_DTYPE)
        self.residual = np.zeros((n_layers, grouping.residual, width), dtype=self.dtype)

    def write(self, layer: int, start: int, rows: np.ndarray) -> None:
        bits, size, end = self.grouping.bits, self.grouping.residual, start + len(rows)
        # a row's codes depend on that row alone: made now, read once it leaves the residual
        scales = symmetric_scales(rows, bits, axis=1)
        self.codes[layer, start:end] = pack_codes(quantize(rows, scales, bits), bits)
        self.scales[layer, start:end] = scales[:, 0]
        if size:
            newest = np.arange(max(start, end - size), end)
            self.residual[layer, newest % size] = rows[newest - start]

    def read(self, layer: int, n: int) -> np.ndarray:
        old, size = self.grouping.quantized_positions(n), self.grouping.residual
        codes = unpack_codes(self.codes[layer, :old], self.grouping.bits, self.width)
        quantized = dequantize(codes, self.scales[layer, :old, None], self.dtype)
        if not size:
            return quantized
        return np.concatenate([quantized, self.residual[layer, np.arange(old, n) % size]])

    def check_truncate(self, length: int, n: int) -> None:
        """Any length can be cut back to without a residual; with one, only lengths whose
        full-precision rows are still held."""
        _check_truncate(self.grouping, length, n)

    def checkpoint(self):
        return self.residual.copy()

    def restore(self, state) -> None:
        """Rows past a layer's length are never read: the lengths and the residual restore
        the store."""
        self.residual[...] = state

    def nbytes(self, layer: int, n: int) -> int:
        old = self.grouping.quantized_positions(n)
        return (self.codes[layer, :old].nbytes + self.scales[layer, :old].nbytes
                + (n - old) * self.width * self.dtype.itemsize)


class PerChannelStore:
    """K or V of every layer, per-channel quantized in groups of G positions: packed codes
    (layers, capacity, bytes a row), float16 scales per group and column (layers, groups,
    width), and the residual's rows in full precision (layers, R, width): position p sits in
    residual row p % R until R rows have arrived and are quantized."""

    def __init__(self, grouping: PerChannel, n_layers: int, capacity: int, width: int, dtype):
        self.grouping, self.width, self.dtype = grouping, width, np.dtype(dtype)
        self.codes = np.zeros((n_layers, capacity, packed_width(width, grouping.bits)),
                              dtype=np.uint8)
        self.scales = np.zeros((n_layers, -(-capacity // grouping.group_size), width),
                               dtype=SCALE_DTYPE)
        self.residual = np.zeros((n_layers, grouping.residual, width), dtype=self.dtype)

    def write(self, layer: int, start: int, rows: np.ndarray) -> None:
        size, group, bits = self.grouping.residual, self.grouping.group_size, self.grouping.bits
        position = start
        while position < start + len(rows):
            # the rows up to the end of position's residual (or of the chunk)
            end = min(start + len(rows), (position // size + 1) * size)
            self.residual[layer, position % size:(end - 1) % size + 1] = \
                rows[position - start:end - start]
            if end % size == 0:                   # the residual is full: quantize its groups
                groups = self.residual[layer].reshape(size // group, group, self.width)
                scales = symmetric_scales(groups, bits, axis=1)       # (R / G, 1, width)
                codes = quantize(groups, scales, bits).reshape(size, self.width)
                self.codes[layer, end - size:end] = pack_codes(codes, bits)
                self.scales[layer, (end - size) // group:end // group] = scales[:, 0]
            position = end

    def read(self, layer: int, n: int) -> np.ndarray:
        group, bits = self.grouping.group_size, self.grouping.bits
        full = self.grouping.quantized_positions(n)
        codes = unpack_codes(self.codes[layer, :full], bits, self.width)
        scales = np.repeat(self.scales[layer, :full // group], group, axis=0)
        quantized = dequantize(codes, scales, self.dtype)
        return np.concatenate([quantized, self.residual[layer, :n - full]])

    def check_truncate(self, length: int, n: int) -> None:
        """Cutting back into a residual that was quantized since would need its
        full-precision rows, which are gone: refused. A multiple of R, or a length within the
        current residual, is exactly the state the cache had then."""
        _check_truncate(self.grouping, length, n)

    def checkpoint(self):
        return self.residual.copy()

    def restore(self, state) -> None:
        self.residual[...] = state

    def nbytes(self, layer: int, n: int) -> int:
        group, full = self.grouping.group_size, self.grouping.quantized_positions(n)
        return (self.codes[layer, :full].nbytes + self.scales[layer, :full // group].nbytes
                + self.residual[layer, :n - full].nbytes)


def _check_grouping(name: str, grouping):
    if not isinstance(grouping, (PerToken, PerChannel)):
        raise TypeError(f"{name} must be a grouping, PerToken(bits, residual) or "
                        f"PerChannel(bits, group_size, residual), got {grouping!r}")
    return grouping
