"""The safetensors file format, read and written with numpy alone (real_model).

Published checkpoints, GPT-2's among them, come as `model.safetensors`. The format is short
enough to read in full:

    8 bytes     N, the header's length, an unsigned little-endian integer
    N bytes     a JSON object in UTF-8: for every tensor its name -> {"dtype": "F32",
                "shape": [768, 2304], "data_offsets": [begin, end]}, and optionally
                "__metadata__": {str: str}; padded with spaces to a multiple of 8 bytes
    the rest    the tensors' raw bytes, little-endian, C order, one after the other; each
                tensor's offsets count from the start of this part

Reading maps the file into memory (`np.memmap`) and returns views into it: nothing is copied,
so the 500 MB of GPT-2's weights cost 500 MB of address space and only the pages a
computation touches are read from disk.

bfloat16 (BF16, the top 16 bits of a float32) has no numpy dtype. `read_safetensors` returns
BF16 tensors as uint16 views of their bits, still without a copy, and `bfloat16_to_float32`
turns them into numbers (that one makes a float32 copy). The header says which tensors are
BF16: `read_header(path)[0][name]["dtype"]`. To write BF16, pass uint16 bits and name those
tensors in `write_safetensors(..., bfloat16=names)`; `float32_to_bfloat16` rounds float32
values to those bits.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ..checks import as_flag, as_path

DTYPES = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: its bits, see bfloat16_to_float32
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}
"""safetensors dtype name -> the numpy dtype of its bytes, in the reference implementation's
order (its Rust `Dtype` enum); the writer lays tensors out in this order, last first."""

METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000
"""The reference implementation refuses longer headers; so does read_header."""
MAX_DIMENSIONS = 64
"""numpy's limit on an array's dimensions."""

_NAMES_OF_DTYPES = {dtype: name for name, dtype in DTYPES.items() if name != "BF16"}


def _invalid(path, message: str) -> ValueError:
    return ValueError(f"{path} is not a valid safetensors file: {message}")


def read_header(path) -> tuple[dict, int]:
    """The header of a safetensors file, checked, and where its tensor bytes start (real_model).

    Returns (header, data_offset): the header as the file has it, {name: {"dtype", "shape",
    "data_offsets"}} plus "__metadata__" if present; data_offset = 8 + N, the file position of
    the first tensor byte. Raises ValueError, naming the file and the tensor, for a file that
    is too short, a header that is not a JSON object of valid entries, an unknown dtype, a
    tensor whose byte count is not dtype size x shape, and offsets that overlap, leave gaps or
    run past the end of the file.
    """
    path = as_path(path)
    file_size = path.stat().st_size
    with open(path, "rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        if file_size < 8 or header_length > min(file_size - 8, MAX_HEADER_BYTES):
            raise _invalid(path, f"it has {file_size:,} bytes: 8 for the header's length, which "
                                f"they give as {header_length:,}, then the header (at most "
                                f"{MAX_HEADER_BYTES:,} bytes, the reference implementation's "
                                "limit) and the data")
        header = _parse_header(path, file.read(header_length))
    _check_layout(path, header, file_size - 8 - header_length)
    return header, 8 + header_length


def _parse_header(path, raw: bytes) -> dict:
    """The header's bytes -> its JSON object, each entry checked on its own."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys(path))
    except (ValueError, RecursionError) as error:   # not UTF-8, not JSON, nested too deeply
        raise _invalid(path, f"its header is not valid JSON in UTF-8 ({error!r:.200})") from None
    if not isinstance(header, dict):
        raise _invalid(path, f"its header is a JSON {type(header).__name__}, not an object")
    for name, entry in header.items():
        _check_entry(path, name, entry)
    return header


def _unique_keys(path):
    def to_dict(pairs):
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise _invalid(path, f"its header names {repeated} more than once")
        return dict(pairs)
    return to_dict


def _check_entry(path, name: str, entry) -> None:
    """One tensor's entry: {"dtype": a name of DTYPES, "shape": [sizes], "data_offsets":
    [begin, end]}, with end - begin the bytes of that dtype and shape; or the metadata."""
    if name == METADATA_KEY:
        if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
            raise _invalid(path, f"{METADATA_KEY} must map strings to strings, got {entry!r}")
        return
    dtype, shape, offsets = (entry.get(key) if isinstance(entry, dict) else None
                             for key in ("dtype", "shape", "data_offsets"))
    valid = isinstance(dtype, str) and dtype in DTYPES and isinstance(shape, list) \
        and len(shape) <= MAX_DIMENSIONS and all(_is_count(size) for size in shape) \
        and math.prod(size for size in shape if size) * DTYPES[dtype].itemsize < 2**63 \
        and isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets)) \
        and offsets[1] - offsets[0] == math.prod(shape) * DTYPES[dtype].itemsize
    if not valid:
        raise _invalid(path, f"tensor {name!r} must be {{'dtype': one of {', '.join(DTYPES)}, "
                            f"'shape': a list of at most {MAX_DIMENSIONS} sizes >= 0, "
                            "'data_offsets': [begin, end], end - begin the bytes of that dtype "
                            f"and shape}}, got {entry!r:.200}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path, header: dict, buffer_size: int) -> None:
    """The tensors must tile the data part exactly: no overlap, no gap, nothing past the end."""
    entries = sorted((entry["data_offsets"], name) for name, entry in header.items()
                     if name != METADATA_KEY)
    covered = 0
    for (begin, end), name in entries + [((buffer_size, buffer_size), None)]:
        if begin != covered or end > buffer_size:
            where = f"tensor {name!r} takes bytes {begin:,} to {end:,}, and the tensors before " \
                f"it end at byte {covered:,}" if name else f"the tensors end at byte {covered:,}"
            raise _invalid(path, f"{where}: the tensors must tile the {buffer_size:,} bytes of "
                                "data one after the other, without a gap or an overlap")
        covered = end


def read_safetensors(path, *, memory_map: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, by name, in the header's order (real_model).

    memory_map=True (the default): read-only np.memmap views into the file, no copy.
    memory_map=False: the file is read into memory once; the arrays are writable views of that.
    BF16 tensors come back as uint16 bits (see bfloat16_to_float32); the file's
    "__metadata__" is in read_header(path)[0]. Raises ValueError as read_header does.
    """
    memory_map = as_flag("memory_map", memory_map)
    header, data_offset = read_header(path)
    buffer_size = os.path.getsize(path) - data_offset
    if buffer_size == 0:  # mmap refuses a region of 0 bytes; every tensor here is empty
        buffer = np.zeros(0, np.uint8)
    elif memory_map:
        buffer = np.memmap(path, dtype=np.uint8, mode="r", offset=data_offset,
                           shape=(buffer_size,))
    else:
        buffer = np.frombuffer(_read_bytes(path, data_offset, buffer_size), np.uint8)
    tensors = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        begin, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        tensors[name] = buffer[begin:end].view(dtype).reshape(entry["shape"])
    return tensors


def _read_bytes(path, offset: int, size: int) -> bytearray:
    data = bytearray(size)  # a bytearray, so that the arrays viewing it are writable
    with open(path, "rb") as file:
        file.seek(offset)
        if file.readinto(data) != size:
            raise _invalid(path, "it became shorter while it was read")
    return data


def bfloat16_to_float32(bits) -> np.ndarray:
    """bfloat16 bits (uint16, as read_safetensors returns BF16) -> float32 values (real_model).

    A bfloat16 is the top half of a float32: the same sign, the same 8 exponent bits, 7 of the
    23 mantissa bits. Shifting its 16 bits up and filling the rest with zeros gives that
    float32 exactly. Same shape in and out; the result is a new array.
    """
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:          # other bits would be read as numbers without a word
        raise TypeError(f"bfloat16 bits must be a uint16 array, got dtype {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values) -> np.ndarray:
    """float32 values -> the nearest bfloat16, as uint16 bits (real_model).

    Rounds to nearest, ties to even (as PyTorch's `.to(torch.bfloat16)` does); NaN stays a
    (quiet) NaN of the same sign. Same shape in and out. write_safetensors stores the result
    as BF16 when its name is in bfloat16=.
    """
    values = np.asarray(values)
    if values.dtype != np.float32:    # a float64's bits would be halved without a word
        raise TypeError(f"expected a float32 array, got dtype {values.dtype}: convert it "
                        "first (.astype(np.float32)) to say that this rounding is intended")
    bits = values.view(np.uint32).astype(np.uint64)  # 64 bits: the rounding may carry
    lowest_kept_bit = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lowest_kept_bit) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) & 0x8000 | 0x7FC0).astype(np.uint16)
    return np.where(np.isnan(values), quiet_nan, rounded)


def in_dtype(array: np.ndarray, stored: str, dtype) -> np.ndarray:
    """A tensor read by read_safetensors, as numbers of dtype (real_model and model_of_today): BF16
    bits become float32 first; a view of the mapped file when nothing needs converting, a copy
    otherwise. stored is the header's dtype name ("F32", "F16", "BF16", ...)."""
    if stored == "BF16":
        array = bfloat16_to_float32(array)
    if array.dtype == np.dtype(dtype):
        return array.view(np.ndarray)
    return array.astype(dtype)


def write_safetensors(path, tensors: Mapping[str, np.ndarray], metadata=None, *,
                      bfloat16: Iterable[str] = ()) -> None:
    """Write tensors to a safetensors file the reference implementation reads (real_model).

    tensors: name -> array of a dtype in DTYPES (bool, (u)int8-64, float16/32/64).
    metadata: optional {str: str}, stored as "__metadata__".
    bfloat16: names of uint16 tensors that hold bfloat16 bits (see float32_to_bfloat16),
    stored as BF16.

    The layout is the reference implementation's (safetensors' `save_file`): tensors ordered
    by dtype, widest first, then by name, so that each starts at a multiple of its item
    size; a compact JSON header padded with spaces to a multiple of 8 bytes. Everything is
    checked before the file is touched, and the file appears complete or not at all (it is
    written under a temporary name, then renamed).
    """
    path = Path(path)
    entries = _prepare_tensors(tensors, set(bfloat16))
    header = {}
    if metadata is not None:
        header[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for name, dtype_name, array in entries:
        header[name] = {"dtype": dtype_name, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw_header = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw_header += b" " * (-len(raw_header) % 8)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as file:
            file.write(len(raw_header).to_bytes(8, "little"))
            file.write(raw_header)
            for _, _, array in entries:
                file.write(array.reshape(-1).view(np.uint8))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _prepare_tensors(tensors, bfloat16: set[str]) -> list[tuple[str, str, np.ndarray]]:
    """(name, dtype name, contiguous little-endian array) in the order the file stores them."""
    entries = []
    for name, tensor in tensors.items():
        array = np.asarray(tensor)
        little_endian = array.dtype.newbyteorder("<")
        if little_endian not in _NAMES_OF_DTYPES or (name in bfloat16 and array.dtype != np.uint16):
            raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which safetensors does "
                            "not store (bool, (u)int8-64, float16/32/64; bfloat16 as uint16 "
                            "bits with bfloat16=[name])")
        dtype_name = "BF16" if name in bfloat16 else _NAMES_OF_DTYPES[little_endian]
        entries.append((name, dtype_name, np.asarray(array, little_endian, order="C")))
    order = list(DTYPES)
    entries.sort(key=lambda entry: (-order.index(entry[1]), entry[0]))
    return entries
