"""Codes and scales (quantized_cache): symmetric quantization of a group of numbers x with one
scale s = max|x| / q_max, q_max = 2**(bits - 1) - 1 (127 for int8, 7 for int4, 1 for int2),
each number stored as code = round(x / s) and read back as code x s (an error of at most s / 2);
scales in float16, rounded up. Codes of 4 and 2 bits packed two and four to a byte.
"""

from __future__ import annotations

import numpy as np

from ...checks import as_array, as_count, as_whole_number

SUPPORTED_BITS = (2, 4, 8)


SCALE_DTYPE = np.dtype(np.float16)


SCALE_BYTES = SCALE_DTYPE.itemsize


LARGEST_SCALE = float(np.finfo(np.float16).max)


def _check_bits(bits) -> int:
    if as_whole_number("bits", bits, 2, 8) not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} (codes that pack whole into "
                         f"a byte), got {bits}")
    return int(bits)


def _as_float_array(x, name: str = "x") -> np.ndarray:
    array = as_array(name, x)
    if array.ndim == 0 or array.size == 0 or not np.isfinite(array).all():
        raise ValueError(f"{name} must be a non-empty array of finite numbers (NaN and "
                         f"infinity cannot be quantized), got shape {array.shape}")
    return array


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
    axis = as_whole_number("axis (for rows (n, w): 1 a scale per row, 0 per column)", axis,
                        -x.ndim, x.ndim - 1)
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
    """Scales as a float array (finite, >= 0) that broadcasts against numbers of shape."""
    scales = as_array("scales", scales).astype(np.float64)
    if not np.isfinite(scales).all() or (scales < 0).any() or any(
            a != b and 1 not in (a, b) for a, b in zip(shape[::-1], scales.shape[::-1])):
        raise ValueError(f"scales must be finite numbers >= 0 that match numbers of shape "
                         f"{shape}: one per row is (n, 1), one per column (1, w); got shape "
                         f"{scales.shape}")
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
    if getattr(dtype, "__name__", str(dtype)) not in ("float16", "float32", "float64"):
        raise TypeError(f"dtype must be a float dtype such as 'float32', got {dtype!r}")
    dtype, scales = np.dtype(dtype), _as_scales(scales, codes.shape)
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


def quantization_step(x, bits: int, axis: int) -> np.ndarray:
    """The quantization step of every number of x (quantized_cache): its group's stored scale,
    broadcast to x's shape. The round trip error of each number is at most half of it."""
    x = np.asarray(x)
    return np.broadcast_to(symmetric_scales(x, bits, axis).astype(np.float64), x.shape)


def packed_width(width: int, bits: int) -> int:
    """Bytes that width codes of `bits` bits take, 8 // bits to a byte: ceil(width x bits / 8)."""
    return -(-as_count("width", width, 1) * _check_bits(bits) // 8)


def pack_codes(codes, bits: int) -> np.ndarray:
    """Codes (..., w) -> bytes (..., packed_width(w, bits)), uint8 (quantized_cache).

    Each code is offset by 2**(bits - 1) to a whole number 1 .. 2**bits - 1 and written into
    its own `bits` bits of a byte, the first code in the lowest bits; a row whose width is
    not a multiple of 8 // bits is padded with zero bits.
    """
    codes, limit = _codes(codes), max_code(bits)
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
    """codes as an array of whole numbers, at least 1-D."""
    codes = as_array("codes", codes)
    if codes.ndim == 0 or codes.dtype.kind not in "iu":
        raise TypeError(f"codes must be an array of whole numbers, got {codes.dtype} of shape "
                        f"{codes.shape}")
    return codes


def _byte_table(bits: int) -> np.ndarray:
    """The codes every byte value holds: (256, 8 // bits) int8, lowest bits first."""
    per_byte = 8 // bits
    fields = (np.arange(256)[:, None] >> (np.arange(per_byte) * bits)) & (2 ** bits - 1)
    return (fields - 2 ** (bits - 1)).astype(np.int8)


BYTE_TABLES = {bits: _byte_table(bits) for bits in SUPPORTED_BITS}
"""For each bit width, the codes each of the 256 byte values holds: unpacking is one lookup."""


def unpack_codes(packed, bits: int, width: int) -> np.ndarray:
    """Bytes from pack_codes (..., packed_width(width, bits)) -> codes (..., width), int8."""
    bits, width, packed = _check_bits(bits), as_count("width", width, 1), as_array("packed", packed)
    if packed.dtype != np.uint8 or packed.ndim == 0 or \
            packed.shape[-1] != packed_width(width, bits):
        raise ValueError(f"expected uint8 bytes (..., {packed_width(width, bits)}) for {width} "
                         f"codes of {bits} bits, got {packed.dtype} of shape {packed.shape}")
    codes = BYTE_TABLES[bits][packed]                      # (..., bytes, 8 // bits)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))[..., :width]
