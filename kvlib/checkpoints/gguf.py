"""GGUF files (model_of_today): llama.cpp's format, read with llama.cpp's own `gguf` package.

A GGUF file is one self-contained model: a header of metadata (the architecture and its
sizes, the tokenizer's vocabulary and merges, the chat template) followed by every tensor,
most of them quantized. SmolLM2-135M-Instruct's file (kvlib.checkpoints.smollm2) holds:

- Q4_1 for the 210 matrices of the blocks: rows cut into groups of 32 numbers, each group
  stored as 32 codes of 4 bits (0..15) with a float16 scale d and a float16 minimum m, and
  read back as x = d * code + m (5 bits a number, 0.625 bytes, against 4 for float32);
- Q8_0 for the token table: groups of 32 codes of 8 bits (-128..127) with a float16 scale,
  x = d * code (8.5 bits a number);
- float32 for the RMSNorm gains.

kvlib computes in float32 or float64, so `dequantize_tensors` turns every tensor into float32
once (the numbers the quantization left, nothing lost twice), and `convert` keeps them in a
folder beside the file, as a safetensors file that later loads memory-mapped in about a
second. The quantized_cache lesson rebuilds Q4_1 and Q8_0 in a few lines of numpy and checks them
against the `gguf` package's dequantization.

Names: llama.cpp calls the tensors `token_embd.weight`, `blk.{i}.attn_q.weight`, ...
(GGUF_NAMES maps them to kvlib's), and stores every matrix as (out, in) like PyTorch, so
kvlib's W (in, out) is a transposed view. llama.cpp's converter also reorders the rows of
attn_q and attn_k of every head (`permute` in convert_hf_to_gguf.py) so that llama.cpp can
turn neighbouring columns (x[2i], x[2i+1]): a GGUF model needs rope_pairing="interleaved",
while the same model's safetensors on the hub need "half" (kvlib.checkpoints.llama).

Only `convert` and `read_gguf` need the gguf package; loading a converted folder needs numpy.

A damaged file is named, in kvlib's words: a GGUF header that does not hold together
(check_layout walks it first, every count bounded by the bytes the file has left), a count no
model has (PLAUSIBLE), a converted file that differs from the manifest written with it
(kvlib.checkpoints.integrity).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import shutil
import struct
from numbers import Integral, Real
from pathlib import Path

import numpy as np

from ..checks import as_finite, as_instance, as_one_of, as_path
from ..config import ModelConfig
from ..params import LayerParams, Params
from .integrity import MANIFEST_NAME, DamagedFileError, sha256_of, verify_folder, write_manifest
from .safetensors import read_safetensors, write_safetensors

GGUF_NAMES = {
    "embedding": "token_embd.weight",
    "ln_f_gain": "output_norm.weight",
}
"""kvlib name -> GGUF name, outside the blocks."""

GGUF_BLOCK_NAMES = {
    "ln_1_gain": "attn_norm.weight",
    "Wq": "attn_q.weight",
    "Wk": "attn_k.weight",
    "Wv": "attn_v.weight",
    "Wo": "attn_output.weight",
    "ln_2_gain": "ffn_norm.weight",
    "W_gate": "ffn_gate.weight",
    "W_up": "ffn_up.weight",
    "W_down": "ffn_down.weight",
}
"""kvlib name -> GGUF name inside block i (blk.{i}.<name>); matrices stored (out, in)."""

TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
CONTROL_TOKEN = 3
"""llama.cpp's token type of a control token (<|im_start|>): matched whole, never split."""


# ------------------------------------------------------------------------------ reading

def read_gguf(path) -> tuple[dict, dict[str, tuple[np.ndarray, str]]]:
    """(metadata, tensors) of a GGUF file, with the gguf package (model_of_today).

    metadata: every key -> its value (lists for arrays: the tokenizer's tokens and merges);
    tensors: name -> (raw data as the file stores it, a view of the memory-mapped file; the
    quantization type's name, "Q4_1", "Q8_0", "F32", ...).

    The file's layout is checked first (check_layout): a damaged or cut-short file gets a
    ValueError naming it, never the gguf package's IndexError or minutes of reading a count
    that no file could hold.
    """
    from gguf import GGUFValueType

    path = as_path(path)
    reader = _reader(path)
    metadata = {}
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            value = field.contents()
            if field.types == [GGUFValueType.FLOAT32]:
                value = _float32_as_written(value)
            metadata[name] = value
        tensors = {tensor.name: (tensor.data, tensor.tensor_type.name)
                   for tensor in reader.tensors}
    except (ValueError, IndexError, TypeError, KeyError, OverflowError) as error:
        raise _damaged(path, f"{type(error).__name__}: {error}") from None
    return metadata, tensors


def _damaged(path, what: str) -> DamagedFileError:
    return DamagedFileError(f"{path} is not a GGUF file kvlib can read (damaged, cut short, or "
                            f"another format): {what}. Fetch or write the file again.")


def _reader(path):
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a GGUF file needs llama.cpp's gguf package: "
                          "pip install gguf") from None
    path = as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    check_layout(path)
    try:
        return gguf.GGUFReader(path)
    except MemoryError:
        raise
    except Exception as error:     # noqa: BLE001 - whatever a damaged header makes it raise
        raise _damaged(path, f"the gguf package says {type(error).__name__}: {error}") \
            from None


GGUF_VERSIONS = (2, 3)
"""The versions llama.cpp's gguf package reads (version 1 counted in 32 bits)."""
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF's value types of fixed size -> their bytes (UINT8 ... FLOAT64; 8 is a string, 9 an
array)."""
STRING, ARRAY = 8, 9
MAX_DIMS = 4
"""GGML_MAX_DIMS: a tensor has at most 4 dimensions."""
MAX_NESTING = 4
"""Arrays inside arrays this deep at most (llama.cpp itself reads none)."""


class _Layout:
    """Walks a GGUF file's header by the format's rules, each count checked against the bytes
    that remain before anything is read for it (check_layout)."""

    def __init__(self, data, order: str):
        self.data, self.size, self.order, self.offset = data, len(data), order, 0

    def take(self, n: int, what: str) -> int:
        """Claim n bytes for what -> where they start."""
        left = self.size - self.offset
        if n > left:
            raise ValueError(f"{what} at byte {self.offset:,} claims {n:,} bytes, but the file "
                             f"has {left:,} left")
        start = self.offset
        self.offset += n
        return start

    def number(self, code: str, what: str) -> int:
        return struct.unpack_from(self.order + code, self.data,
                                  self.take(struct.calcsize(code), what))[0]

    def text(self, what: str) -> str:
        n = self.number("Q", f"the length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.data[start:start + n]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{what} at byte {start:,} is not UTF-8 text ({error.reason})") \
                from None

    def skip_string(self, what: str) -> None:
        self.take(self.number("Q", f"the length of {what}"), what)

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in SCALAR_BYTES:
            self.take(SCALAR_BYTES[kind], what)
        elif kind == STRING:
            self.skip_string(what)
        elif kind == ARRAY:
            if depth >= MAX_NESTING:
                raise ValueError(f"{what} nests arrays more than {MAX_NESTING} deep")
            item = self.number("I", f"the item type of {what}")
            count = self.number("Q", f"the length of {what}")
            smallest = SCALAR_BYTES.get(item, 8 if item == STRING else 12)
            if item not in SCALAR_BYTES and item not in (STRING, ARRAY):
                raise ValueError(f"{what} holds items of type {item}, which GGUF does not have")
            if count * smallest > self.size - self.offset:
                raise ValueError(f"{what} at byte {self.offset:,} claims {count:,} items, more "
                                 f"than the {self.size - self.offset:,} bytes left can hold")
            if item in SCALAR_BYTES:
                self.take(count * smallest, what)
            elif item == STRING:
                for _ in range(count):
                    self.skip_string(f"a string of {what}")
            else:
                for _ in range(count):
                    self.value(ARRAY, f"an array in {what}", depth + 1)
        else:
            raise ValueError(f"{what} has value type {kind}, which GGUF does not have")


def check_layout(path) -> None:
    """Walk a GGUF file's header and check that it holds together, as llama.cpp's reader
    would, before the gguf package reads it: the magic bytes and version; every count (keys,
    tensors, array items, string bytes, a tensor's dimensions) no larger than what the bytes
    left could hold; every key and tensor name UTF-8; every tensor's type known and its data
    inside the file. A file that does not hold together gets a ValueError naming it and the
    byte where it stops making sense. This costs a pass over the header (the vocabulary: 0.2 s
    for Gemma 3's 262,144 pieces), none over the tensors' data."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = as_path(path)
    size = path.stat().st_size
    if size < 24:
        raise _damaged(path, f"it has {size} bytes, fewer than a GGUF header's 24")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            if data[:4] != b"GGUF":
                raise ValueError(f"it starts with {bytes(data[:4])!r}, not GGUF's magic b'GGUF'")
            order = "<"
            version = struct.unpack_from("<I", data, 4)[0]
            if version & 0xFFFF == 0:                     # written on a big-endian machine
                order, version = ">", struct.unpack_from(">I", data, 4)[0]
            if version not in GGUF_VERSIONS:
                raise ValueError(f"it says GGUF version {version}; kvlib reads versions "
                                 f"{GGUF_VERSIONS}")
            layout = _Layout(data, order)
            layout.offset = 8
            n_tensors = layout.number("Q", "the tensor count")
            n_keys = layout.number("Q", "the key count")
            if n_keys * 13 + n_tensors * 24 > size - layout.offset:   # their smallest sizes
                raise ValueError(f"its header claims {n_keys:,} keys and {n_tensors:,} "
                                 f"tensors, more than its {size:,} bytes can hold")
            alignment = 32
            for i in range(n_keys):
                key = layout.text(f"key {i}")
                kind = layout.number("I", f"the type of {key}")
                start = layout.offset
                layout.value(kind, key)
                if key == "general.alignment" and kind == 4:
                    alignment = struct.unpack_from(order + "I", data, start)[0]
                    if alignment == 0 or alignment & (alignment - 1):
                        raise ValueError(f"general.alignment is {alignment}, not a power of 2")
            tensors = []
            for i in range(n_tensors):
                name = layout.text(f"the name of tensor {i}")
                n_dims = layout.number("I", f"the dimension count of {name}")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows "
                                     f"1 to {MAX_DIMS}")
                dims = [layout.number("Q", f"a dimension of {name}") for _ in range(n_dims)]
                kind = layout.number("I", f"the type of {name}")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise ValueError(f"tensor {name!r} has type {kind}, which the gguf "
                                     "package does not know") from None
                offset = layout.number("Q", f"the data offset of {name}")
                numbers = math.prod(dims)
                if dims[0] % block:
                    raise ValueError(f"tensor {name!r}'s rows of {dims[0]} numbers are not "
                                     f"whole blocks of {block}")
                tensors.append((name, offset, numbers // block * block_bytes))
            start = layout.offset + -layout.offset % alignment
            for name, offset, n_bytes in tensors:
                if start + offset + n_bytes > size:
                    raise ValueError(f"tensor {name!r}'s {n_bytes:,} bytes at byte "
                                     f"{start + offset:,} run past the file's end at "
                                     f"{size:,}")
        except (ValueError, struct.error) as error:
            raise _damaged(path, str(error)) from None


def _float32_as_written(value: float) -> float:
    """A float32 field (1e-5 stored as 9.99999974e-06) as the shortest decimal it came from."""
    return float(str(np.float32(value)))


def dequantize_tensors(tensors: dict[str, tuple[np.ndarray, str]],
                       where: str = "the file") -> dict[str, np.ndarray]:
    """Every tensor as float32 numbers (model_of_today): name -> array in numpy order ((out, in)
    for a matrix), with the gguf package's dequantization (Q4_1: d * code + m per group of
    32; Q8_0: d * code). A type it cannot dequantize is named, with where."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arrays = {}
    for name, (data, kind) in tensors.items():
        try:
            arrays[name] = dequantize(data, GGMLQuantizationType[kind]).astype(np.float32,
                                                                              copy=False)
        except (NotImplementedError, ValueError, KeyError) as error:
            raise ValueError(f"{where}: tensor {name!r} of type {kind} cannot be dequantized "
                             f"({type(error).__name__}: {error})") from None
    return arrays


# ------------------------------------------------------------------------------ the config

PLAUSIBLE = {"block_count": 4096, "context_length": 2**24, "embedding_length": 2**16,
             "feed_forward_length": 2**20, "attention.head_count": 2**12,
             "attention.head_count_kv": 2**12, "attention.key_length": 2**12,
             "attention.value_length": 2**12, "attention.sliding_window": 2**24,
             "rope.dimension_count": 2**12, "vocab_size": 2**22}
"""The largest value kvlib believes of each count in a GGUF header: far above any model it
could run (Llama 3.1 405B has 126 blocks of width 16,384 with 128 heads; Gemma 3 a
vocabulary of 262,144), far below what a damaged header claims (2**31 blocks, whose names
alone would not fit in memory). Every count is at least 1."""


def _shown(value, limit: int = 60) -> str:
    """A header's value for a message: its repr, cut at limit characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def header_count(metadata: dict, key: str, where: str, default=None) -> int:
    """A count from a GGUF header (<architecture>.<key>, or default when absent) as an int from
    1 to PLAUSIBLE[key]; a ValueError naming the file and the key otherwise."""
    architecture = metadata.get("general.architecture")
    value = metadata.get(f"{architecture}.{key}", default)
    if value is None:
        raise ValueError(f"{where} has no {architecture}.{key} in its header: is the file "
                         "complete?")
    if isinstance(value, bool) or not isinstance(value, Integral) \
            or not 1 <= value <= PLAUSIBLE[key]:
        raise ValueError(f"{where}: its header's {architecture}.{key} is {_shown(value)}, not "
                         f"a count from 1 to {PLAUSIBLE[key]:,} (the file is damaged, or not a "
                         "model kvlib runs)")
    return int(value)


def header_number(metadata: dict, key: str, where: str, default=None,
                  below: float = math.inf) -> float:
    """A real number from a GGUF header (<architecture>.<key>, or default), positive, finite
    and below `below`; a ValueError naming the file and the key otherwise."""
    architecture = metadata.get("general.architecture")
    value = metadata.get(f"{architecture}.{key}", default)
    if value is None:
        raise ValueError(f"{where} has no {architecture}.{key} in its header: is the file "
                         "complete?")
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < below:
        raise ValueError(f"{where}: its header's {architecture}.{key} is {_shown(value)}, not "
                         f"a number above 0{'' if below == math.inf else f' and below {below}'} "
                         "(the file is damaged, or not a model kvlib runs)")
    return float(value)


def config_from_gguf(metadata: dict, dtype: str = "float32", *,
                     where: str = "the GGUF file") -> ModelConfig:
    """kvlib's ModelConfig of a Llama-architecture GGUF file, from its metadata (model_of_today).

    RMSNorm, SwiGLU, rotary positions with the interleaved pairing (what llama.cpp's
    reordered rows expect) and grouped-query attention when head_count_kv < head_count.
    Anything kvlib does not compute (another architecture, RoPE scaling, untied output) is
    refused, naming the setting; so is a count that no model has (header_count's PLAUSIBLE
    bounds). where names the file in the messages.
    """
    metadata = as_instance("metadata", metadata, dict, "read_gguf's first result")
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{where} holds a {_shown(architecture)} model; kvlib reads the "
                         "'llama' architecture (SmolLM2, Llama, Mistral without a window)")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{where} asks for RoPE scaling {_shown(scaling)}; kvlib's rotary "
                         "positions have none")

    def count(key, default=None):
        return header_count(metadata, key, where, default)

    n_heads, d_model = count("attention.head_count"), count("embedding_length")
    n_kv_heads = count("attention.head_count_kv", n_heads)
    rope_dim = count("rope.dimension_count", max(d_model // n_heads, 1))
    if d_model % n_heads:
        raise ValueError(f"{where}: its width {d_model} does not split into {n_heads} heads")
    if rope_dim != d_model // n_heads:
        raise ValueError(f"{where} rotates {rope_dim} columns of each head's "
                         f"{d_model // n_heads}; kvlib rotates whole heads")
    vocab_size = count("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())) or None)
    settings = dict(
        vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_layers=count("block_count"),
        d_ff=count("feed_forward_length"), context_length=count("context_length"),
        norm_epsilon=header_number(metadata, "attention.layer_norm_rms_epsilon", where,
                                   below=1.0),
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        rope_base=header_number(metadata, "rope.freq_base", where, 10000.0))
    try:
        return ModelConfig(dtype=dtype, positions="rotary", norm="rms", mlp="swiglu", bias=False,
                           rope_pairing="interleaved", **settings)
    except ValueError as error:
        if "dtype" in str(error):
            raise
        raise ValueError(f"{where}: {error}") from None


# ------------------------------------------------------------------------------ params

def blocks_in(names, prefix: str = "blk.") -> int:
    """How many blocks a file's tensor names hold: the distinct i of prefix + "{i}." ..."""
    return len({name[len(prefix):].split(".", 1)[0] for name in names
                if name.startswith(prefix)})


def params_from_gguf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray],
                             where: str = "the file") -> Params:
    """kvlib Params from float tensors under their GGUF names (model_of_today): each (out, in)
    matrix becomes kvlib's (in, out) as a transposed view, no copy; other dtypes than the
    config's are converted. Missing, misshapen, unknown or non-finite tensors are named, and
    a config with another number of blocks than the file holds is refused first."""
    if "output.weight" in tensors:
        raise ValueError(f"{where} has an output.weight: an untied unembedding, which kvlib's "
                         "models (the unembedding is the token table) do not have")
    held = blocks_in(tensors)
    if held != config.n_layers:
        raise ValueError(f"{where} holds {held} blocks of tensors (blk.0 ...), but its config "
                         f"says {config.n_layers} (the header's block_count): the file is "
                         "damaged, or the config is another model's")
    expected = dict(Params.expected_shapes(config))
    block = LayerParams.expected_shapes(config)
    names = {ours: theirs for ours, theirs in GGUF_NAMES.items() if ours in expected}
    for i in range(config.n_layers):
        names |= {f"layer {i} {ours}": f"blk.{i}.{theirs}" for ours, theirs in
                  GGUF_BLOCK_NAMES.items() if ours in block}
        expected |= {f"layer {i} {ours}": shape for ours, shape in block.items()}
    unknown = sorted(set(tensors) - set(names.values()))
    if unknown:
        raise ValueError(f"{where} has tensors kvlib's Llama does not know: {unknown[:5]}")
    arrays = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ValueError(f"{where} has no tensor {theirs!r} (kvlib's {ours}), of shape "
                             f"{expected[ours]}")
        array = tensors[theirs]
        if array.ndim == 2 and ours != "embedding":
            array = array.T                                        # (out, in) -> (in, out)
        if array.shape != expected[ours]:
            raise ValueError(f"{where}: tensor {theirs!r} has shape {array.shape} as kvlib "
                             f"reads it, but the config needs {expected[ours]}")
        if array.dtype != config.numpy_dtype:
            array = array.astype(config.numpy_dtype)
        as_finite(array, theirs, where)
        arrays[ours] = array.view(np.ndarray)
    layers = [LayerParams(**{name: arrays[f"layer {i} {name}"] for name in block})
              for i in range(config.n_layers)]
    return Params(config=config, layers=layers,
                  **{name: arrays[name] for name in Params.expected_shapes(config)})


# ------------------------------------------------------------------------------ converted folder

CONVERTED_FILES = ("model.safetensors", "metadata.json", "vocab.json", "merges.txt",
                   "source.json", MANIFEST_NAME)
"""What convert writes: the float32 tensors (GGUF names), the metadata without the
tokenizer's long lists, the tokenizer in the model hub's layout, the GGUF file's size and
time, and last the manifest: every other file's bytes and sha256, and the GGUF file's."""


def _source_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}


def converted_directory(path) -> Path:
    """Where convert keeps a GGUF file's float32 weights: <name>.float32/ beside the file."""
    path = as_path(path)
    return path.with_name(path.stem + ".float32")


def is_converted(path, files=CONVERTED_FILES) -> bool:
    """True when the GGUF file has a complete, up-to-date converted folder beside it: every
    one of files there (the manifest among them) and source.json's stamp the file's size and
    time. Whether the files hold what the manifest says is verify_folder's check."""
    path, folder = Path(path), converted_directory(path)
    if not all((folder / name).is_file() for name in files):
        return False
    try:
        stamp = json.loads((folder / "source.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return path.is_file() and stamp == _source_stamp(path)


def checked_sha256(path: Path, expected: str | None, remedy: str = "") -> str:
    """The GGUF file's sha256 -> it; DamagedFileError when expected is given and differs."""
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    found = sha256_of(path)
    if expected is not None and found != expected:
        raise DamagedFileError(f"{path} is damaged: its sha256 is {found}, not the {expected} "
                               f"of the file kvlib fetched. {remedy}".strip())
    return found


def finish_folder(path: Path, partial: Path, files, sha256: str) -> Path:
    """Write the manifest of the files in partial, then put partial where the converted folder
    of path goes (replacing an older one) -> the folder."""
    write_manifest(partial, [name for name in files if name != MANIFEST_NAME],
                   {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256})
    folder = converted_directory(path)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(partial, folder)
    return folder


def convert(path, *, sha256: str | None = None, remedy: str = "") -> Path:
    """Dequantize a GGUF file once into a folder beside it (model_of_today) -> the folder.

    The folder holds model.safetensors (every tensor in float32 under its GGUF name),
    metadata.json, vocab.json and merges.txt (the tokenizer, in the model hub's layout),
    source.json (the GGUF file's size and time, so that a changed file is converted again)
    and manifest.json (the sha256 of each, and of the GGUF file, checked at every load).
    With sha256 given, the GGUF file is checked against it first (DamagedFileError, ending
    with remedy). The header is checked before any tensor is read (check_layout, the
    plausible counts of config_from_gguf), every tensor after. The folder is written under a
    temporary name and renamed at the end: an interrupted conversion leaves nothing
    half-written behind.
    """
    path = as_path(path)
    found = checked_sha256(path, sha256, remedy)
    metadata, raw = read_gguf(path)
    config = config_from_gguf(metadata, where=str(path))   # refuse what kvlib cannot run, first
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise ValueError(f"{path} has no byte-level BPE tokenizer in its metadata")
    types = metadata.get("tokenizer.ggml.token_type", [])
    if len(tokens) != config.vocab_size or len(types) not in (0, len(tokens)):
        raise ValueError(f"{path} lists {len(tokens):,} tokens and {len(types):,} token types "
                         f"for a vocabulary of {config.vocab_size:,}: the file is damaged")
    tensors = dequantize_tensors(raw, str(path))
    params_from_gguf_tensors(config, tensors, where=str(path))     # checks every tensor
    folder = converted_directory(path)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    write_safetensors(partial / "model.safetensors",
                      {name: np.ascontiguousarray(array) for name, array in tensors.items()},
                      {"source": path.name})
    (partial / "vocab.json").write_text(
        json.dumps({token: i for i, token in enumerate(tokens)}, ensure_ascii=False),
        encoding="utf-8")
    (partial / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                        encoding="utf-8")
    small = {key: value for key, value in metadata.items() if key not in TOKENIZER_KEYS}
    small["kvlib.control_tokens"] = [token for token, kind in zip(tokens, types)
                                     if kind == CONTROL_TOKEN]
    (partial / "metadata.json").write_text(json.dumps(small, indent=1, ensure_ascii=False),
                                           encoding="utf-8")
    (partial / "source.json").write_text(json.dumps(_source_stamp(path)), encoding="utf-8")
    return finish_folder(path, partial, CONVERTED_FILES, found)


def folder_remedy(folder) -> str:
    """What to do about a damaged converted folder of a GGUF file kvlib did not fetch."""
    return (f"Delete {folder}: the next kvlib.checkpoints.gguf.load_gguf of the GGUF file "
            "converts it again.")


def read_converted_metadata(folder, remedy: str = "") -> dict:
    """metadata.json of a converted folder (without the tokenizer's lists)."""
    path = Path(folder) / "metadata.json"
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DamagedFileError(f"{path} cannot be read as JSON ({error}). "
                               f"{remedy or folder_remedy(folder)}") from None
    if not isinstance(metadata, dict):
        raise DamagedFileError(f"{path} holds no JSON object. {remedy or folder_remedy(folder)}")
    return metadata


def check_converted_folder(folder, remedy: str, config_of, expected, name: str,
                           possessive: str) -> None:
    """A converted folder as its manifest says, and its header `expected`'s config
    (model_of_today, local_and_global_layers): DamagedFileError naming the file otherwise,
    ending with remedy. config_of(metadata, where=...) reads the header (config_from_gguf of
    the model's module); name and possessive word the message ("SmolLM2-135M-Instruct",
    "SmolLM2's")."""
    verify_folder(folder, remedy)
    path = Path(folder) / "metadata.json"
    try:
        config = config_of(read_converted_metadata(folder, remedy), where=str(path))
    except DamagedFileError:
        raise
    except ValueError as error:
        raise DamagedFileError(f"{error}. {remedy}") from None
    if config != expected:
        wrong = [f"{field.name} {getattr(config, field.name)!r} ({possessive}: "
                 f"{getattr(expected, field.name)!r})" for field in dataclasses.fields(config)
                 if getattr(config, field.name) != getattr(expected, field.name)]
        raise DamagedFileError(f"{path} does not describe {name}: {', '.join(wrong)}. {remedy}")


def load_converted(folder, dtype: str = "float32", *, remedy: str = "") -> Params:
    """Params from a converted folder (model_of_today): memory-mapped float32, about a second.
    The folder is verified against its manifest first (kvlib.checkpoints.integrity: a file
    is hashed only when kvlib has no record of it as it is), and its header's counts
    checked; a damaged file is named, with remedy (what to do) or folder_remedy's."""
    folder = as_path(folder, "folder")
    remedy = remedy or folder_remedy(folder)
    verify_folder(folder, remedy)
    config = config_from_gguf(read_converted_metadata(folder, remedy), dtype,
                              where=str(folder / "metadata.json"))
    tensors = read_safetensors(folder / "model.safetensors")
    return params_from_gguf_tensors(config, tensors, where=str(folder / "model.safetensors"))


def load_gguf(path, dtype: str = "float32") -> Params:
    """kvlib Params of a Llama-architecture GGUF file (model_of_today): converted once into
    <name>.float32/ beside it (about 5 s for SmolLM2), then memory-mapped from there."""
    if not is_converted(path):
        convert(path)
    return load_converted(converted_directory(path), dtype)


def bits_per_number(kind: str) -> float:
    """Bits a stored number takes in a GGUF quantization type (model_of_today): Q4_1 5 (4 of code
    and 2 x 16 of scale and minimum shared by 32), Q8_0 8.5, F16 16, F32 32."""
    per_block = {"Q4_0": (32, 2 + 16), "Q4_1": (32, 2 + 2 + 16), "Q5_0": (32, 2 + 4 + 16),
                 "Q5_1": (32, 2 + 2 + 4 + 16), "Q8_0": (32, 2 + 32), "F16": (1, 2),
                 "F32": (1, 4)}
    numbers, n_bytes = per_block[as_one_of("kind", kind, per_block)]
    return 8 * n_bytes / numbers


__all__ = ["CONVERTED_FILES", "GGUF_BLOCK_NAMES", "GGUF_NAMES", "PLAUSIBLE", "bits_per_number",
           "blocks_in", "check_converted_folder", "check_layout", "config_from_gguf", "convert",
           "converted_directory",
           "dequantize_tensors", "header_count", "header_number", "is_converted",
           "load_converted", "load_gguf", "params_from_gguf_tensors",
           "read_converted_metadata", "read_gguf"]
