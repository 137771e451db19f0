"""Keys and values stored in a few bits (quantized_cache; KIVI, vLLM's --kv-cache-dtype).

Symmetric quantization: a group of numbers x shares one scale s = max|x| / q_max, with
q_max = 2**(bits - 1) - 1 (127 for int8, 7 for int4, 1 for int2). Each number is stored as
the whole number code = round(x / s), between -q_max and q_max, and read back as code x s:
the error of every number is at most s / 2, half a quantization step. Scales are stored in
float16, rounded up so that no number falls outside the codes. Codes of 4 and 2 bits are
packed two and four to a byte, so that nbytes counts what a real cache would hold.

Which numbers share a scale is the grouping, chosen for K and V separately:

- PerToken(bits, residual=0): one scale per cached row, a token's K (or V) in one layer,
  all K/V heads; with residual=R the newest R rows stay in full precision (KIVI's values);
- PerChannel(bits, group_size, residual=None): one scale per column over a group of G =
  group_size positions. The newest rows are kept in full precision until R = residual of
  them (a multiple of G, by default G) have arrived, then quantized G at a time (KIVI's
  keys).

KIVI itself (Liu et al., ICML 2024; github.com/jy-yuan/KIVI, models/llama_kivi.py) is
PerChannel(bits, G, R) for the keys with PerToken(bits, R) for the values, at 2 or 4 bits
with asymmetric codes (a zero point), and per-token groups of G channels within a row.

QuantizedKVCache(config, keys=..., values=...) stores K and V this way, and kvlib.prefill and
kvlib.decode_step run on it unchanged. Everything attention reads comes back through the
store: keys(layer) and values(layer) dequantize on read and return float arrays, in a
prefill as in a decode step (a real kernel fuses the dequantization into attention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ..cache import BaseKVCache
from ..checks import contains_bool, count, numbers, real_number, whole_number, whole_numbers
from ..config import ModelConfig
from ..inference import check_ids, decode_step, next_token_losses, prefill
from ..params import Params

SUPPORTED_BITS = (2, 4, 8)
SCALE_DTYPE = np.dtype(np.float16)
SCALE_BYTES = SCALE_DTYPE.itemsize
LARGEST_SCALE = float(np.finfo(np.float16).max)


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, Integral):
        raise TypeError(f"bits must be a whole number, one of {SUPPORTED_BITS}, got {bits!r}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} (codes that pack whole into "
                         f"a byte), got {bits}")
    return int(bits)


def _as_float_array(x, name: str = "x") -> np.ndarray:
    array = numbers(name, x)
    if array.ndim == 0 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty array, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds NaN or infinite values: they cannot be quantized")
    return array


# ---------------------------------------------------------------------------------- numbers

def max_code(bits: int) -> int:
    """The largest code of symmetric quantization (quantized_cache): 2**(bits - 1) - 1, so
    127 for int8, 7 for int4, 1 for int2. Codes run from -max_code to max_code."""
    return 2 ** (_check_bits(bits) - 1) - 1


def symmetric_scales(x, bits: int, axis: int) -> np.ndarray:
    """One scale per group of numbers (quantized_cache): max|x| along axis / max_code(bits).

    x (n, w) with axis=1 gives a scale per row (n, 1); axis=0 a scale per column (1, w).
    Stored in float16 and rounded up, never down, so that |x| / s never exceeds max_code.
    A group of zeros gets the scale 0 (its codes are 0).
    """
    x = _as_float_array(x)
    if isinstance(axis, bool) or not isinstance(axis, Integral) or \
            not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be a whole number between {-x.ndim} and {x.ndim - 1} "
                         f"(for rows (n, w): 1 gives a scale per row, 0 one per column), "
                         f"got {axis!r}")
    largest = np.max(np.abs(x), axis=axis, keepdims=True).astype(np.float64)
    scales = largest / max_code(bits)
    if scales.max() > LARGEST_SCALE:
        raise ValueError(f"numbers up to {largest.max():.3g} need a scale above float16's "
                         f"largest, {LARGEST_SCALE:.0f}: at {bits} bits |x| must stay below "
                         f"{LARGEST_SCALE * max_code(bits):.4g}")
    stored = scales.astype(SCALE_DTYPE)
    rounded_down = stored.astype(np.float64) < scales
    return np.where(rounded_down, np.nextafter(stored, SCALE_DTYPE.type(np.inf)), stored)


def _as_scales(scales, shape: tuple[int, ...]) -> np.ndarray:
    """Scales as a float array that broadcasts against numbers of the given shape."""
    if isinstance(scales, (bool, np.bool_, str, bytes)) or scales is None:
        raise TypeError(f"scales must be numbers, got {scales!r}")
    scales = numbers("scales", scales).astype(np.float64)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise ValueError("scales must be finite numbers >= 0")
    try:
        np.broadcast_shapes(shape, scales.shape)
    except ValueError:
        raise ValueError(f"scales of shape {scales.shape} do not match numbers of shape "
                         f"{shape}: one per row is (n, 1), one per column (1, w)") from None
    return scales


def quantize(x, scales, bits: int) -> np.ndarray:
    """Codes of x (quantized_cache): round(x / scales) clipped to +-max_code(bits), int8 of x's
    shape. scales broadcast against x (a scale per row (n, 1) or per column (1, w))."""
    limit = max_code(bits)
    x = _as_float_array(x)
    scales = _as_scales(scales, x.shape)
    with np.errstate(over="ignore"):        # a scale near 0: inf, which the clip takes in
        ratio = np.divide(x, scales, out=np.zeros(np.broadcast_shapes(x.shape, scales.shape)),
                          where=scales != 0)
    return np.clip(np.rint(ratio), -limit, limit).astype(np.int8)


def dequantize(codes, scales, dtype="float64") -> np.ndarray:
    """What quantized numbers are read back as (quantized_cache): codes x scales, in dtype."""
    codes = _codes(codes)
    if isinstance(dtype, str) and dtype not in ("float16", "float32", "float64"):
        raise TypeError(f"dtype must be a float dtype such as 'float32', got {dtype!r}")
    if not isinstance(dtype, (str, type, np.dtype)) or isinstance(dtype, bool):
        raise TypeError(f"dtype must be a float dtype such as 'float32', got {dtype!r}")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a float dtype such as 'float32', got {dtype!r}") from None
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a float dtype such as 'float32', got {dtype}")
    if codes.ndim == 0 or not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"codes must be an array of whole numbers, got {codes.dtype} of shape "
                        f"{codes.shape}")
    scales = _as_scales(scales, codes.shape)
    values = codes.astype(np.float64) * scales
    # int8 codes and float16 scales always fit; only larger ones can overflow the dtype
    largest = np.finfo(dtype).max
    if np.iinfo(codes.dtype).max * np.abs(scales).max(initial=0) > largest and \
            np.abs(values).max(initial=0) > largest:
        raise ValueError(f"codes x scales reach {np.abs(values).max():.3g}, more than "
                         f"{dtype}'s largest number, {largest:.3g}")
    return values.astype(dtype, copy=False)


def round_trip(x, bits: int, axis: int) -> np.ndarray:
    """x quantized with one scale per group along axis and read back (quantized_cache)."""
    scales = symmetric_scales(x, bits, axis)
    return dequantize(quantize(x, scales, bits), scales)


# ---------------------------------------------------------------------------------- packing

def packed_width(width: int, bits: int) -> int:
    """Bytes that width codes of `bits` bits take, 8 // bits to a byte: ceil(width x bits / 8)."""
    return -(-count("width", width, 1) * _check_bits(bits) // 8)


def pack_codes(codes, bits: int) -> np.ndarray:
    """Codes (..., w) -> bytes (..., packed_width(w, bits)), uint8 (quantized_cache).

    Each code is offset by 2**(bits - 1) to a whole number 1 .. 2**bits - 1 and written into
    its own `bits` bits of a byte, the first code in the lowest bits; a row whose width is
    not a multiple of 8 // bits is padded with zero bits.
    """
    bits = _check_bits(bits)
    codes = _codes(codes)
    limit = max_code(bits)
    if codes.ndim == 0 or not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"codes must be an array of whole numbers, got {codes.dtype} "
                        f"of shape {codes.shape}")
    if codes.size and (codes.min() < -limit or codes.max() > limit):
        raise ValueError(f"{bits}-bit codes must lie between -{limit} and {limit}, got "
                         f"{codes.min()} .. {codes.max()}")
    per_byte = 8 // bits
    width = codes.shape[-1]
    unsigned = (codes.astype(np.int16) + 2 ** (bits - 1)).astype(np.uint16)
    padding = [(0, 0)] * (codes.ndim - 1) + [(0, -width % per_byte)]
    grouped = np.pad(unsigned, padding).reshape(*codes.shape[:-1], -(-width // per_byte),
                                                 per_byte)
    shifts = np.arange(per_byte, dtype=np.uint16) * bits
    return (grouped << shifts).sum(axis=-1).astype(np.uint8)


def _codes(codes) -> np.ndarray:
    """codes as an array (not nested lists of different lengths, not text)."""
    if isinstance(codes, (str, bytes)) or codes is None or contains_bool(codes):
        raise TypeError(f"codes must be an array of whole numbers, got {codes!r}")
    try:
        return np.asarray(codes)
    except ValueError:
        raise ValueError("codes must be an array of whole numbers with rows of one length") \
            from None


def _byte_table(bits: int) -> np.ndarray:
    """The codes every byte value holds: (256, 8 // bits) int8, lowest bits first."""
    per_byte = 8 // bits
    fields = (np.arange(256)[:, None] >> (np.arange(per_byte) * bits)) & (2 ** bits - 1)
    return (fields - 2 ** (bits - 1)).astype(np.int8)


BYTE_TABLES = {bits: _byte_table(bits) for bits in SUPPORTED_BITS}
"""For each bit width, the codes each of the 256 byte values holds: unpacking is one lookup."""


def unpack_codes(packed, bits: int, width: int) -> np.ndarray:
    """Bytes from pack_codes (..., packed_width(width, bits)) -> codes (..., width), int8."""
    bits, width = _check_bits(bits), count("width", width, 1)
    try:
        packed = np.asarray(packed)
    except ValueError:
        raise ValueError("packed must be an array of bytes with rows of one length") from None
    if packed.dtype != np.uint8 or packed.ndim == 0 or \
            packed.shape[-1] != packed_width(width, bits):
        raise ValueError(f"expected uint8 bytes (..., {packed_width(width, bits)}) for {width} "
                         f"codes of {bits} bits, got {packed.dtype} of shape {packed.shape}")
    codes = BYTE_TABLES[bits][packed]                      # (..., bytes, 8 // bits)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :width]


# ---------------------------------------------------------------------------------- groupings

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
        whole_number("residual", self.residual, 0)

    @property
    def name(self) -> str:
        text = f"int{self.bits} per token"
        return text + (f", the newest {self.residual} in full precision" if self.residual else "")

    def quantized_positions(self, n_positions: int) -> int:
        """How many of n_positions are read back quantized: all but the newest `residual`."""
        return max(0, whole_number("n_positions", n_positions, 0) - self.residual)

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
        old = self.quantized_positions(n_positions)
        residual_bytes = whole_number("residual_bytes", residual_bytes, 1)
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
        whole_number("group_size", self.group_size, 1)
        if self.residual is None:
            object.__setattr__(self, "residual", self.group_size)
        whole_number("residual", self.residual, 1)
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
        return whole_number("n_positions", n_positions, 0) // self.residual * self.residual

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
        n_positions = whole_number("n_positions", n_positions, 0)
        width = count("width", width, 1)
        full = self.quantized_positions(n_positions)
        group_bytes = self.group_size * packed_width(width, self.bits) + width * SCALE_BYTES
        residual_bytes = whole_number("residual_bytes", residual_bytes, 1)
        return full // self.group_size * group_bytes + (n_positions - full) * width * \
            residual_bytes

    def store(self, n_layers: int, capacity: int, width: int, dtype) -> PerChannelStore:
        return PerChannelStore(self, n_layers, capacity, width, dtype)


# ---------------------------------------------------------------------------------- stores

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


# ---------------------------------------------------------------------------------- the cache

def _check_grouping(name: str, grouping):
    if not isinstance(grouping, (PerToken, PerChannel)):
        raise TypeError(f"{name} must be a grouping, PerToken(bits, residual) or "
                        f"PerChannel(bits, group_size, residual), got {grouping!r}")
    return grouping


class QuantizedKVCache(BaseKVCache):
    """A contiguous cache whose K and V are stored in a few bits (quantized_cache).

    keys and values are groupings, chosen separately: PerToken(bits, residual) or
    PerChannel(bits, group_size, residual). The default is KIVI's axes at 8 bits, keys per
    channel in groups of 32, values per token, with no residual beyond the keys' incomplete
    group (KIVI also keeps the newest R rows of each in full precision: pass residual=R to
    both). append quantizes the new rows and returns what attention reads: every held row,
    dequantized (the new ones too). ``nbytes`` is the bytes really held: packed codes,
    float16 scales, and the full-precision residual rows.
    ``key_store`` and ``value_store`` hold them (a PerTokenStore or a PerChannelStore:
    ``codes``, ``scales`` and ``residual``).
    """

    def __init__(self, config: ModelConfig, keys: PerToken | PerChannel = PerChannel(8),
                 values: PerToken | PerChannel = PerToken(8), capacity: int | None = None):
        super().__init__(config)
        if config.latent_dim is not None or config.window is not None:
            raise ValueError("kvlib's quantized cache holds K and V of full attention: use a "
                             "config without a latent or a window")
        self.key_grouping = _check_grouping("keys", keys)
        self.value_grouping = _check_grouping("values", values)
        self.capacity = capacity = self._check_capacity(capacity)
        self.width = config.kv_width
        shape = (config.n_layers, capacity, self.width, config.numpy_dtype)
        self.key_store = keys.store(*shape)
        self.value_store = values.store(*shape)

    def _describe(self) -> str:
        n = self._lengths[0]
        return (f"QuantizedKVCache({n} of {self.capacity} positions, {self.config.n_layers} "
                f"layers; K {self.key_grouping.name}, V {self.value_grouping.name}; "
                f"{self.nbytes:,} bytes)")

    def keys(self, layer: int) -> np.ndarray:
        """The layer's keys, dequantized: (T, kv_width) in the model's dtype, a new array."""
        layer = self._check_layer(layer)
        return self.key_store.read(layer, self._lengths[layer])

    def values(self, layer: int) -> np.ndarray:
        """The layer's values, dequantized: (T, kv_width), a new array."""
        layer = self._check_layer(layer)
        return self.value_store.read(layer, self._lengths[layer])

    def append(self, layer: int, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Quantize new rows K, V (n_new, kv_width) after the layer's last position; return
        every held row, dequantized: (T + n_new, kv_width) each. Rows that cannot be
        quantized (NaN, too large) are refused before anything is stored."""
        layer = self._check_layer(layer)
        self._check_rows("K", K, self.width)
        self._check_rows("V", V, self.width, K.shape[0])
        self._check_room(layer, K.shape[0])
        _check_quantizable(K, "K", self.key_grouping.bits)
        _check_quantizable(V, "V", self.value_grouping.bits)
        start = self._lengths[layer]
        self.key_store.write(layer, start, K)
        self.value_store.write(layer, start, V)
        self._lengths[layer] = start + K.shape[0]
        return self.keys(layer), self.values(layer)

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1 (speculative_decoding), to exactly the state the cache had then;
        refused when rows that n positions held in full precision are quantized since (per
        channel: cut to a multiple of the residual or within it; per token with a residual:
        only while at most R positions are held)."""
        n = self._check_truncate(n)
        for store in (self.key_store, self.value_store):
            store.check_truncate(len(self), n)
        self._lengths = [n] * self.config.n_layers

    def checkpoint(self):
        return (tuple(self._lengths), self.key_store.checkpoint(),
                self.value_store.checkpoint())

    def restore(self, state) -> None:
        lengths, key_state, value_state = state
        self.key_store.restore(key_state)
        self.value_store.restore(value_state)
        self._lengths = list(lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, float16 scales and full-precision residual rows of K
        and V, over every layer's filled positions (equal to quantized_cache_bytes)."""
        return sum(store.nbytes(layer, length)
                   for store in (self.key_store, self.value_store)
                   for layer, length in enumerate(self._lengths))


def quantized_cache_bytes(config: ModelConfig, n_positions: int, keys, values,
                          residual_bytes: int | None = None) -> int:
    """Bytes of a QuantizedKVCache after n_positions (quantized_cache): per layer, K's codes,
    scales and residual rows plus V's. residual_bytes (a number of the full-precision
    residual) defaults to the config's dtype; a real engine keeps it in float16 (2)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"quantized_cache_bytes needs a ModelConfig, got {type(config).__name__}")
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    residual_bytes = config.numpy_dtype.itemsize if residual_bytes is None else residual_bytes
    per_layer = (keys.nbytes(n_positions, config.kv_width, residual_bytes)
                 + values.nbytes(n_positions, config.kv_width, residual_bytes))
    return config.n_layers * per_layer


def bytes_per_token(n_layers: int, width: int, keys, values) -> float:
    """Bytes one position adds to a quantized cache once its groups are full (quantized_cache):
    layers x (K's codes and scale share + V's), for rows of width = kv_heads x head_dim."""
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    return count("n_layers", n_layers, 1) * (keys.bytes_per_token(width)
                                              + values.bytes_per_token(width))


# ---------------------------------------------------------------------------------- outliers

def with_outlier_key_channels(params: Params, channels, factor: float, layers=None) -> Params:
    """The same model with outlier key channels (quantized_cache): in each of the given layers
    (all by default), key channels `channels` (columns of K, 0 .. kv_width - 1) multiplied
    by factor, and the query columns that meet them divided by it.

    Every score q . k = sum over c of q_c k_c is unchanged, so the model computes the same
    logits; only the cached keys look different: a few of their channels are factor times
    larger, as in the keys of large trained models (KIVI). With fewer K/V heads, a key
    channel meets one query column in each head of its group. Needs learned or no positions
    (rotary positions turn pairs of channels together) and K and V (not a latent).
    """
    if not isinstance(params, Params):
        raise TypeError(f"params must be kvlib Params, got {type(params).__name__}")
    config = params.config
    if config.latent_dim is not None or config.positions == "rotary":
        raise ValueError("with_outlier_key_channels needs a model with K and V and learned "
                         "or no positions: rotary positions turn pairs of channels together, "
                         "and a latent has no key channels")
    try:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError
        factor = real_number("factor", factor, positive=True)
    except (TypeError, ValueError):
        raise ValueError(f"factor must be a positive number (finite), got {factor!r}") from None
    if isinstance(channels, (Integral, np.ndarray)) and not isinstance(channels, bool):
        channels = np.atleast_1d(channels)          # one channel, or an array of them
    channels = np.unique(whole_numbers("channels", channels))
    if channels.size == 0 or channels.max() >= config.kv_width:
        raise ValueError(f"channels must be whole numbers between 0 and {config.kv_width - 1}, "
                         f"got {channels.tolist()}")
    layers = range(config.n_layers) if layers is None else layers
    if not isinstance(layers, (list, tuple, range, set)):
        raise TypeError(f"layers must be a list of layer indices or None (all), got {layers!r}")
    layers = {whole_number("layer", layer, 0) for layer in layers}
    if max(layers, default=0) >= config.n_layers:
        raise ValueError(f"layers must be between 0 and {config.n_layers - 1}, got "
                         f"{sorted(layers)}")
    dh, group = config.head_dim, config.n_heads // config.kv_heads
    # key channel g*dh + i meets query column h*dh + i of every head h in K/V head g's group
    queries = np.array([(c // dh * group + member) * dh + c % dh
                        for c in channels for member in range(group)])
    new_layers = []
    for index, layer in enumerate(params.layers):
        if index not in layers:
            new_layers.append(layer)
            continue
        changed = {}
        for name, columns, by in (("Wk", channels, factor), ("bk", channels, factor),
                                  ("Wq", queries, 1 / factor), ("bq", queries, 1 / factor)):
            array = getattr(layer, name)
            if array is None:
                continue
            array = array.copy()
            array[..., columns] = array[..., columns] * array.dtype.type(by)
            changed[name] = array
        new_layers.append(dataclasses.replace(layer, **changed))
    return Params(config, params.embedding, tuple(new_layers), params.position_table,
                  params.ln_f_gain, params.ln_f_bias)


# ---------------------------------------------------------------------------------- measuring

def decoded_logits(params: Params, ids, cache: BaseKVCache, prompt_length: int = 1
                   ) -> np.ndarray:
    """Logits of every position as generation sees them (quantized_cache): the first
    prompt_length ids prefilled, then each later id fed by kvlib.decode_step (teacher
    forcing), into the given empty cache: ids (T,) -> logits (T, V). Row t predicts id t+1."""
    ids = check_ids(ids, params)
    prompt_length = whole_number("prompt_length", prompt_length, 1)
    _check_empty_cache("decoded_logits", cache)
    if prompt_length > len(ids):
        raise ValueError(f"prompt_length {prompt_length} is longer than the {len(ids)} ids")
    logits, _ = prefill(params, ids[:prompt_length], cache)
    rows = [logits] + [decode_step(params, token, cache) for token in ids[prompt_length:]]
    return np.concatenate(rows)


def greedy_tokens(params: Params, prompt, n_new: int, cache: BaseKVCache) -> list[int]:
    """Greedy decoding of n_new tokens after prompt, on the given empty cache (quantized_cache):
    kvlib.generate with a cache of one's choosing. Returns the new ids."""
    prompt = check_ids(prompt, params)
    n_new = whole_number("n_new", n_new, 1)
    _check_empty_cache("greedy_tokens", cache)
    room = params.config.context_length if cache.capacity is None else cache.capacity
    if len(prompt) + n_new - 1 > room:
        raise ValueError(f"a {len(prompt)}-token prompt and {n_new} new tokens need "
                         f"{len(prompt) + n_new - 1} positions; the cache holds {room}")
    logits, _ = prefill(params, prompt, cache, last_only=True)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n_new:
        new.append(int(np.argmax(decode_step(params, new[-1], cache)[-1])))
    return new


def _check_empty_cache(what: str, cache) -> None:
    if not isinstance(cache, BaseKVCache):
        raise TypeError(f"{what} needs a kvlib cache, got {type(cache).__name__}")
    if len(cache) != 0:
        raise ValueError(f"{what} needs an empty cache, this one holds {len(cache)} "
                         "positions: give a fresh one")


def next_token_loss(logits: np.ndarray, ids) -> float:
    """Mean cross-entropy, in nats, of logits (T, V) predicting ids[1:] (row t predicts id
    t+1; the last row predicts nothing): the mean of kvlib.next_token_losses."""
    return float(next_token_losses(logits, ids).mean())


def greedy_agreement(logits, reference_logits) -> float:
    """Fraction of positions where both logits (T, V) pick the same greedy token."""
    logits = numbers("logits", logits)
    reference_logits = numbers("reference_logits", reference_logits)
    if logits.shape != reference_logits.shape or logits.ndim != 2:
        raise ValueError(f"need two logits arrays of one shape (T, V), got {logits.shape} "
                         f"and {reference_logits.shape}")
    return float(np.mean(logits.argmax(axis=1) == reference_logits.argmax(axis=1)))


@dataclass(frozen=True)
class Quality:
    """What a quantized cache does to a model's predictions over some sequences (notebook
    22): the error it adds to the logits (mean and largest |difference|), the mean next-token
    loss (nats) with it and with the plain cache, and the fraction of positions where the
    greedy pick stays the same. bytes_per_token is the cache's, once its groups are full."""

    keys: PerToken | PerChannel
    values: PerToken | PerChannel
    bytes_per_token: float
    logit_error: float
    max_logit_error: float
    loss: float
    plain_loss: float
    agreement: float

    @property
    def name(self) -> str:
        return f"K {self.keys.name}, V {self.values.name}"

    @property
    def added_loss(self) -> float:
        return self.loss - self.plain_loss


def plain_logits(params: Params, sequences) -> list[np.ndarray]:
    """Each sequence's logits with a plain cache: one prefill each (T, V)."""
    return [prefill(params, ids)[0] for ids in _sequences(sequences)]


def _sequences(sequences) -> list:
    """A list of sequences, or a 2-D array of them (one row each)."""
    if isinstance(sequences, np.ndarray) and sequences.ndim == 2:
        return list(sequences)
    if not isinstance(sequences, (list, tuple)):
        raise TypeError(f"sequences must be a list of token id sequences, got "
                        f"{type(sequences).__name__}")
    return list(sequences)


def measure_quality(params: Params, sequences, keys, values, reference=None) -> Quality:
    """Prefill each sequence (T,) into a QuantizedKVCache and compare its logits with the
    plain cache's (reference: plain_logits(params, sequences), given to save the work when
    several settings are measured). Every position of every sequence counts once."""
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    sequences = [check_ids(ids, params, "sequence") for ids in _sequences(sequences)]
    if not sequences:
        raise ValueError("measure_quality needs at least one sequence")
    reference = plain_logits(params, sequences) if reference is None else reference
    if len(reference) != len(sequences):
        raise ValueError(f"reference has {len(reference)} logits arrays for "
                         f"{len(sequences)} sequences")
    config = params.config
    errors, largest, losses, plain_losses, agreements, weights = [], [], [], [], [], []
    for ids, plain in zip(sequences, reference):
        logits, _ = prefill(params, ids, QuantizedKVCache(config, keys, values))
        difference = np.abs(logits.astype(np.float64) - plain)
        errors.append(difference.mean()), largest.append(difference.max())
        losses.append(next_token_loss(logits, ids))
        plain_losses.append(next_token_loss(plain, ids))
        agreements.append(greedy_agreement(logits, plain))
        weights.append(len(ids))
    weights = np.asarray(weights, dtype=np.float64)
    predicted = weights - 1          # the losses are over T - 1 predictions a sequence
    return Quality(keys, values, bytes_per_token(config.n_layers, config.kv_width, keys, values),
                   float(np.average(errors, weights=weights)), float(max(largest)),
                   float(np.average(losses, weights=predicted)),
                   float(np.average(plain_losses, weights=predicted)),
                   float(np.average(agreements, weights=weights)))


def quantization_step(x, bits: int, axis: int) -> np.ndarray:
    """The quantization step of every number of x (quantized_cache): its group's stored scale,
    broadcast to x's shape. The round trip error of each number is at most half of it."""
    x = _as_float_array(x)
    return np.broadcast_to(symmetric_scales(x, bits, axis).astype(np.float64), x.shape)


__all__ = [
    "SUPPORTED_BITS", "SCALE_DTYPE", "max_code", "symmetric_scales", "quantize", "dequantize",
    "round_trip", "packed_width", "pack_codes", "unpack_codes", "PerToken", "PerChannel",
    "PerTokenStore", "PerChannelStore", "QuantizedKVCache", "quantized_cache_bytes",
    "bytes_per_token", "decoded_logits", "greedy_tokens", "next_token_loss", "greedy_agreement",
    "Quality", "plain_logits", "measure_quality", "quantization_step",
    "with_outlier_key_channels",
]
