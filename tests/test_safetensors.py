"""kvlib.gpt2.safetensors: the format with numpy alone, checked against the reference library.

The reference is the `safetensors` package (a test-only dependency), through its numpy API
(`safetensors.numpy.save` / `save_file` / `load_file`) and, for BF16, which numpy cannot hold,
its raw `serialize` / `deserialize`; no torch anywhere.
"""

import json
import math
import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvlib.gpt2 import (
    DTYPES,
    bfloat16_to_float32,
    float32_to_bfloat16,
    read_header,
    read_safetensors,
    write_safetensors,
)

NUMPY_DTYPES = sorted({dtype for name, dtype in DTYPES.items() if name != "BF16"}, key=str)
NAMES = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
    lambda name: name != "__metadata__")


def arrays(dtype=None):
    """Any array of a safetensors dtype: 0-d, zero-size and up to 4 dimensions."""
    dtypes = st.sampled_from(NUMPY_DTYPES) if dtype is None else st.just(np.dtype(dtype))
    shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
    return dtypes.flatmap(lambda dtype: hnp.arrays(dtype, shapes))


def tensor_dicts():
    return st.dictionaries(NAMES, arrays(), max_size=6)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def file_bytes(header, data: bytes = b"", length=None) -> bytes:
    """A file made by hand: header (a JSON-able object, or raw bytes), then data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def f32(name, shape, begin):
    size = 4 * math.prod(shape)
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + size]}}


# ------------------------------------------------------------------ round trips

@given(tensor_dicts(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_round_trip_of_every_dtype_and_shape(tmp_path_factory, tensors, memory_map):
    path = tmp_path_factory.mktemp("round") / "t.safetensors"
    write_safetensors(path, tensors)
    back = read_safetensors(path, memory_map=memory_map)
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert same(back[name], tensor.astype(tensor.dtype.newbyteorder("<"))), name


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3), (2, 1, 3, 1)])
def test_round_trip_table_of_dtypes_and_shapes(tmp_path, dtype, shape):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        bits = bits % 2
    tensor = bits.view(dtype).reshape(shape)
    write_safetensors(tmp_path / "t.safetensors", {"x": tensor, "other": np.ones(3, "<f2")})
    (back,) = [read_safetensors(tmp_path / "t.safetensors")["x"]]
    assert same(back, tensor)
    header, _ = read_header(tmp_path / "t.safetensors")
    assert header["x"]["shape"] == list(shape)


def test_bf16_round_trip_and_conversion(tmp_path):
    values = np.array([[1.0, -2.5, 0.0], [np.inf, -np.inf, 3.140625]], np.float32)
    bits = float32_to_bfloat16(values)
    assert bits.dtype == np.uint16 and bits[0, 0] == 0x3F80 and bits[0, 1] == 0xC020
    write_safetensors(tmp_path / "b.safetensors", {"w": bits, "u": bits.copy()},
                      bfloat16=["w"])
    header, _ = read_header(tmp_path / "b.safetensors")
    assert header["w"]["dtype"] == "BF16" and header["u"]["dtype"] == "U16"
    back = read_safetensors(tmp_path / "b.safetensors")
    assert same(back["w"], bits)
    assert np.array_equal(bfloat16_to_float32(back["w"]), values)  # all exact in bfloat16


def test_metadata_round_trip_and_header(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"b": np.zeros(3, np.float32), "a": np.ones((), np.float64)},
                      metadata={"format": "np", "note": "é ✓"})
    header, data_offset = read_header(path)
    assert header["__metadata__"] == {"format": "np", "note": "é ✓"}
    assert list(header) == ["__metadata__", "a", "b"]  # widest dtype first, then names
    assert data_offset % 8 == 0 and data_offset == 8 + int.from_bytes(path.read_bytes()[:8],
                                                                       "little")
    assert os.path.getsize(path) == data_offset + 8 + 12


def test_writer_takes_non_contiguous_big_endian_and_list_input(tmp_path):
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    tensors = {"transposed": base.T, "strided": base[::2, 1::3],
               "big_endian": base.astype(">f4"), "list": [[1, 2], [3, 4]]}
    write_safetensors(tmp_path / "x.safetensors", tensors)
    back = read_safetensors(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        assert np.array_equal(back[name], np.asarray(tensor)), name
    assert back["big_endian"].dtype == np.dtype("<f4")
    assert back["list"].dtype == np.int64


# ------------------------------------------------------------------ memory mapping

def test_memory_map_views_the_file_without_a_copy(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                             "b": np.arange(4, dtype=np.float64)})
    tensors = read_safetensors(path)
    for tensor in tensors.values():
        assert isinstance(tensor, np.memmap)
        assert not tensor.flags.writeable and not tensor.flags.owndata
        with pytest.raises(ValueError, match="read-only"):
            tensor[...] = 0
    # the arrays ARE the file: bytes written to it afterwards show up in them at once
    header, data_offset = read_header(path)
    with open(path, "r+b") as file:
        file.seek(data_offset + header["a"]["data_offsets"][0])
        file.write(np.array([42.0], np.float32).tobytes())
    assert tensors["a"][0, 0] == 42.0


def test_without_memory_map_the_arrays_are_writable_copies(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32)})
    tensors = read_safetensors(path, memory_map=False)
    assert not isinstance(tensors["a"], np.memmap) and tensors["a"].flags.writeable
    tensors["a"][0] = 7.0  # changes the copy, not the file
    assert read_safetensors(path)["a"][0] == 0.0


def test_files_of_empty_tensors_or_none(tmp_path):
    write_safetensors(tmp_path / "none.safetensors", {})
    assert (tmp_path / "none.safetensors").read_bytes() == b"\x08" + b"\0" * 7 + b"{}      "
    assert read_safetensors(tmp_path / "none.safetensors") == {}
    write_safetensors(tmp_path / "metadata.safetensors", {}, {"format": "np"})
    raw = (tmp_path / "metadata.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header == {"__metadata__": {"format": "np"}}   # valid JSON, unlike the reference's
    assert read_safetensors(tmp_path / "metadata.safetensors") == {}
    write_safetensors(tmp_path / "empty.safetensors", {"e": np.zeros((0, 5), np.float32)})
    assert read_safetensors(tmp_path / "empty.safetensors")["e"].shape == (0, 5)


# ------------------------------------------------------------------ the reference library

@given(tensor_dicts(), st.one_of(st.none(), st.dictionaries(NAMES, NAMES, max_size=1)))
@settings(max_examples=150, deadline=None)
def test_writes_the_same_bytes_as_the_reference(tmp_path_factory, tensors, metadata):
    # with at most one metadata key: the reference keeps metadata in a hash map, whose order
    # with several keys is not defined
    # without tensors the reference writes invalid JSON, '{},"__metadata__":{...}}' (0.4.0
    # with any metadata, 0.8.0 with an empty one); ours is read back by its own test
    assume(tensors)
    path = tmp_path_factory.mktemp("ours") / "t.safetensors"
    write_safetensors(path, tensors, metadata)
    assert path.read_bytes() == safetensors.numpy.save(tensors, metadata=metadata)


@given(tensor_dicts(), st.dictionaries(NAMES, NAMES, max_size=4))
@settings(max_examples=100, deadline=None)
def test_reference_reads_what_we_write(tmp_path_factory, tensors, metadata):
    path = tmp_path_factory.mktemp("ours") / "t.safetensors"
    write_safetensors(path, tensors, metadata)
    theirs = safetensors.numpy.load_file(path)
    assert set(theirs) == set(tensors)
    for name, tensor in tensors.items():
        assert same(theirs[name], tensor), name
    with safetensors.safe_open(path, framework="np") as file:
        assert (file.metadata() or {}) == metadata


@given(tensor_dicts(), st.dictionaries(NAMES, NAMES, max_size=4))
@settings(max_examples=100, deadline=None)
def test_we_read_what_the_reference_writes(tmp_path_factory, tensors, metadata):
    # safetensors 0.4 writes invalid JSON for metadata without tensors, which we refuse
    assume(tensors or not metadata)
    path = tmp_path_factory.mktemp("theirs") / "t.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata=metadata or None)
    ours = read_safetensors(path)
    assert set(ours) == set(tensors)
    for name, tensor in tensors.items():
        assert same(ours[name], tensor), name
    assert read_header(path)[0].get("__metadata__", {}) == metadata


def reference_spec(dtype: str, array: np.ndarray):
    """What the reference's raw serialize takes: a TensorSpec in newer releases, a dict before."""
    if hasattr(safetensors, "TensorSpec"):
        return safetensors.TensorSpec(dtype=dtype, shape=array.shape,
                                      data_ptr=array.ctypes.data, data_len=array.nbytes)
    return {"dtype": dtype, "shape": array.shape, "data": array.tobytes()}


@given(hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0)),
       arrays(np.float32))
@settings(max_examples=100, deadline=None)
def test_bf16_agrees_with_the_reference_both_ways(tmp_path_factory, bits, other):
    folder = tmp_path_factory.mktemp("bf16")
    bits = np.ascontiguousarray(bits)
    other = np.ascontiguousarray(other)
    # the reference writes BF16 (its raw API: numpy has no bfloat16) and we read it
    specs = {"w": reference_spec("bfloat16", bits), "f": reference_spec("float32", other)}
    safetensors.serialize_file(specs, str(folder / "theirs.safetensors"))
    ours = read_safetensors(folder / "theirs.safetensors")
    assert read_header(folder / "theirs.safetensors")[0]["w"]["dtype"] == "BF16"
    assert same(ours["w"], bits) and same(ours["f"], other)
    # we write BF16, the reference reads its bytes back, and both files are the same bytes
    write_safetensors(folder / "ours.safetensors", {"w": bits, "f": other}, bfloat16=["w"])
    theirs = dict(safetensors.deserialize((folder / "ours.safetensors").read_bytes()))
    assert theirs["w"]["dtype"] == "BF16" and list(theirs["w"]["shape"]) == list(bits.shape)
    assert bytes(theirs["w"]["data"]) == bits.tobytes()
    assert (folder / "ours.safetensors").read_bytes() == \
        (folder / "theirs.safetensors").read_bytes()


# ------------------------------------------------------------------ bfloat16 conversion

def nearest_bfloat16(value: np.float32) -> int:
    """The nearest bfloat16 by brute force: the two candidates around the value, in float64."""
    bits = int(np.array(value, np.float32).view(np.uint32))
    below = bits >> 16
    candidates = [below, below + 1]
    as_float = [float(np.array(c << 16, np.uint32).view(np.float32)) if c < 0x10000
                else math.inf for c in candidates]
    distances = [abs(f - float(value)) if math.isfinite(f) else math.inf for f in as_float]
    if below & 0x7FFF == 0x7F7F and below + 1 in (0x7F80, 0xFF80):
        # past the largest bfloat16, rounding goes to infinity at the halfway point
        largest = float(np.array(below << 16, np.uint32).view(np.float32))
        halfway = abs(largest) + 2.0 ** (127 - 8)
        return below + 1 if abs(float(value)) >= halfway else below
    if distances[0] != distances[1]:
        return candidates[int(distances[1] < distances[0])]
    return candidates[0] if candidates[0] % 2 == 0 else candidates[1]


TIES = st.integers(0, 2**16 - 1).map(lambda top: top << 16 | 0x8000)  # exactly halfway


@given(st.one_of(st.integers(0, 2**32 - 1), TIES))
@settings(max_examples=2000, deadline=None)
def test_float32_to_bfloat16_rounds_to_nearest_even(bits):
    value = np.array(bits, np.uint32).view(np.float32)
    rounded = int(float32_to_bfloat16(value))
    if np.isnan(value):
        assert np.isnan(bfloat16_to_float32(np.uint16(rounded)))
        assert rounded & 0x8000 == bits >> 31 << 15, "the sign is kept"
    elif np.isinf(value):
        assert rounded == bits >> 16
    else:
        assert rounded == nearest_bfloat16(value)


def test_bfloat16_examples():
    values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.0, np.nan,
                       3.4e38], np.float32)
    bits = float32_to_bfloat16(values)
    assert bits.tolist()[:5] == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x8000]  # ties to even
    assert np.isnan(bfloat16_to_float32(bits[5:6]))[0]
    assert bits[6] == 0x7F80  # past the largest bfloat16: infinity
    assert bfloat16_to_float32(np.array([[0x3F80]], np.uint16)).shape == (1, 1)
    with pytest.raises(TypeError, match="must be a uint16 array, got dtype int64"):
        bfloat16_to_float32(np.array([1]))
    with pytest.raises(TypeError, match="expected a float32 array, got dtype float64"):
        float32_to_bfloat16(np.array([1.0]))


# ------------------------------------------------------------------ files that are not valid

def entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


F4 = b"\0" * 4
BROKEN_FILES = {
    # name: (file bytes, words the error must contain, the tensor it must name or None)
    "empty file": (b"", "it has 0 bytes: 8 for the header's length", None),
    "shorter than 8 bytes": (b"\x05\0\0", "it has 3 bytes", None),
    "header length past the end": (file_bytes({}, length=1000),
                                   "it has 10 bytes: 8 for the header's length, which they give "
                                   "as 1,000", None),
    "header not UTF-8": (file_bytes(b'{"\xff": 1}'), "its header is not valid JSON in UTF-8",
                         None),
    "header not JSON": (file_bytes(b'{"a": '), "its header is not valid JSON", None),
    "header a JSON list": (file_bytes(b"[1, 2]"), "its header is a JSON list, not an object",
                           None),
    "entry not an object": (file_bytes({"w": 5}), "shape}, got 5", "w"),
    "entry without offsets": (file_bytes({"w": {"dtype": "F32", "shape": [1]}}, F4),
                              "must be {'dtype': one of BOOL", "w"),
    "a dtype numpy lacks": (file_bytes({"w": entry("F8_E4M3", (4,))}, F4),
                            "must be {'dtype': one of BOOL, U8, I8, I16", "w"),
    "no dtype at all": (file_bytes({"w": entry("F33")}, F4), "'dtype': 'F33'", "w"),
    "negative size": (file_bytes({"w": entry(shape=[-1])}, F4), "'shape': [-1]", "w"),
    "fractional size": (file_bytes({"w": entry(shape=[1.5])}, F4), "'shape': [1.5]", "w"),
    "shape a number": (file_bytes({"w": entry() | {"shape": 1}}, F4), "'shape': 1", "w"),
    "offsets reversed": (file_bytes({"w": entry(offsets=(4, 0))}, F4),
                         "'data_offsets': [4, 0]", "w"),
    "one offset": (file_bytes({"w": entry(offsets=(4,))}, F4), "'data_offsets': [4]", "w"),
    "byte count not dtype x shape": (file_bytes({"w": entry(shape=(2, 2), offsets=(0, 12))},
                                                F4 * 3),
                                     "end - begin the bytes of that dtype and shape}, got "
                                     "{'dtype': 'F32', 'shape': [2, 2], 'data_offsets': [0, 12]}",
                                     "w"),
    "overlap": (file_bytes(f32("a", [2], 0) | f32("b", [2], 4), F4 * 3),
                "tensor 'b' takes bytes 4 to 12, and the tensors before it end at byte 8", "b"),
    "gap": (file_bytes(f32("a", [1], 0) | f32("b", [1], 8), F4 * 3),
            "tensor 'b' takes bytes 8 to 12, and the tensors before it end at byte 4", "b"),
    "runs past the file": (file_bytes(f32("a", [1], 0) | f32("b", [4], 4), F4 * 2),
                           "tensor 'b' takes bytes 4 to 20, and the tensors before it end at "
                           "byte 4: the tensors must tile the 8 bytes of data", "b"),
    "bytes after the last tensor": (file_bytes(f32("a", [1], 0), F4 * 2),
                                    "the tensors end at byte 4: the tensors must tile the 8 "
                                    "bytes of data one after the other", None),
    "metadata not strings": (file_bytes({"__metadata__": {"n": 1}}),
                             "__metadata__ must map strings to strings", None),
    "a name twice": (file_bytes(b'{"w":' + json.dumps(entry()).encode() + b',"w":'
                                + json.dumps(entry()).encode() + b"}", F4),
                     "its header names ['w'] more than once", None),
}
# The reference implementation reads this one (the last entry of a name wins); kvlib refuses
# it on purpose: a repeated name silently hides a tensor.
REFERENCE_ACCEPTS = {"a name twice"}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_invalid_files_get_a_clear_error_naming_file_and_tensor(tmp_path, case):
    content, words, tensor = BROKEN_FILES[case]
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    for read in (read_header, read_safetensors,
                 lambda p: read_safetensors(p, memory_map=False)):
        with pytest.raises(ValueError) as caught:
            read(path)
        message = str(caught.value)
        assert message.startswith(f"{path} is not a valid safetensors file: ")
        assert words in message, message
        if tensor is not None:
            assert repr(tensor) in message
    if case not in REFERENCE_ACCEPTS:  # the reference implementation refuses it too
        with pytest.raises((safetensors.SafetensorError, AttributeError)):  # numpy: no float8
            safetensors.numpy.load_file(path)


def test_header_longer_than_the_references_limit(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as file:  # a sparse file: nothing is written past the 8 bytes
        file.write((100_000_001).to_bytes(8, "little"))
        file.truncate(8 + 100_000_001)
    with pytest.raises(ValueError, match="at most 100,000,000 bytes, the reference"):
        read_header(path)


def test_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_safetensors(tmp_path / "nowhere.safetensors")


# ------------------------------------------------------------------ what the writer refuses

BAD_WRITES = [
    # (tensors, metadata, bfloat16, error, words)
    ({"s": np.array(["text"])}, None, (), TypeError, "tensor 's' has dtype <U4, which"),
    ({"o": np.array([None])}, None, (), TypeError, "tensor 'o' has dtype object"),
    ({"c": np.zeros(2, np.complex64)}, None, (), TypeError, "has dtype complex64"),
    ({"q": np.zeros(2, np.longdouble)}, None, (), TypeError, "has dtype float128"),
    ({"w": np.zeros(2, np.float32)}, None, ["w"], TypeError,
     "tensor 'w' has dtype float32, .* bfloat16 as uint16 bits"),
]


@pytest.mark.parametrize("tensors, metadata, bfloat16, error, words", BAD_WRITES)
def test_writer_refuses_clearly_and_changes_nothing(tmp_path, tensors, metadata, bfloat16,
                                                     error, words):
    if "float128" in words and np.dtype(np.longdouble).itemsize != 16:
        pytest.skip("this platform's long double is not float128")
    path = tmp_path / "keep.safetensors"
    write_safetensors(path, {"kept": np.arange(3, dtype=np.float32)})
    before = path.read_bytes()
    with pytest.raises(error, match=words):
        write_safetensors(path, tensors, metadata, bfloat16=bfloat16)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_writer_leaves_no_partial_file_when_writing_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_safetensors(tmp_path / "no-such-folder" / "w.safetensors", {"w": np.zeros(1)})
    (tmp_path / "a-folder.safetensors").mkdir()
    with pytest.raises(OSError):
        write_safetensors(tmp_path / "a-folder.safetensors", {"w": np.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder.safetensors"]
