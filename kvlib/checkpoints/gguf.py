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
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..checks import as_finite, as_instance, as_one_of, as_path
from ..config import ModelConfig
from ..params import LayerParams, Params
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
    """
    from gguf import GGUFValueType

    reader = _reader(path)
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = _float32_as_written(value)
        metadata[name] = value
    tensors = {tensor.name: (tensor.data, tensor.tensor_type.name) for tensor in reader.tensors}
    return metadata, tensors


def _reader(path):
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a GGUF file needs llama.cpp's gguf package: "
                          "pip install gguf") from None
    path = as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as error:
        raise ValueError(f"{path} is not a GGUF file the gguf package can read: {error}") from None


def _float32_as_written(value: float) -> float:
    """A float32 field (1e-5 stored as 9.99999974e-06) as the shortest decimal it came from."""
    return float(str(np.float32(value)))


def dequantize_tensors(tensors: dict[str, tuple[np.ndarray, str]]) -> dict[str, np.ndarray]:
    """Every tensor as float32 numbers (model_of_today): name -> array in numpy order ((out, in)
    for a matrix), with the gguf package's dequantization (Q4_1: d * code + m per group of
    32; Q8_0: d * code)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return {name: dequantize(data, GGMLQuantizationType[kind]).astype(np.float32, copy=False)
            for name, (data, kind) in tensors.items()}


# ------------------------------------------------------------------------------ the config

def config_from_gguf(metadata: dict, dtype: str = "float32") -> ModelConfig:
    """kvlib's ModelConfig of a Llama-architecture GGUF file, from its metadata (model_of_today).

    RMSNorm, SwiGLU, rotary positions with the interleaved pairing (what llama.cpp's
    reordered rows expect) and grouped-query attention when head_count_kv < head_count.
    Anything kvlib does not compute (another architecture, RoPE scaling, untied output) is
    refused, naming the setting.
    """
    metadata = as_instance("metadata", metadata, dict, "read_gguf's first result")
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"this GGUF file holds a {architecture!r} model; kvlib reads the "
                         "'llama' architecture (SmolLM2, Llama, Mistral without a window)")

    def field(key, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF metadata has no llama.{key}: is the file complete?")
        return value

    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"the file asks for RoPE scaling {scaling!r}; kvlib's rotary "
                         "positions have none")
    n_heads, d_model = field("attention.head_count"), field("embedding_length")
    n_kv_heads = field("attention.head_count_kv", n_heads)
    rope_dim = field("rope.dimension_count", d_model // n_heads)
    if rope_dim != d_model // n_heads:
        raise ValueError(f"the file rotates {rope_dim} of {d_model // n_heads} columns a head; "
                         "kvlib rotates whole heads")
    vocab_size = field("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())) or None)
    return ModelConfig(
        vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_layers=field("block_count"), d_ff=field("feed_forward_length"),
        context_length=field("context_length"), dtype=dtype, positions="rotary",
        norm="rms", mlp="swiglu", bias=False,
        norm_epsilon=field("attention.layer_norm_rms_epsilon"),
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        rope_base=field("rope.freq_base", 10000.0), rope_pairing="interleaved")


# ------------------------------------------------------------------------------ params

def params_from_gguf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray],
                             where: str = "the file") -> Params:
    """kvlib Params from float tensors under their GGUF names (model_of_today): each (out, in)
    matrix becomes kvlib's (in, out) as a transposed view, no copy; other dtypes than the
    config's are converted. Missing, misshapen, unknown or non-finite tensors are named."""
    if "output.weight" in tensors:
        raise ValueError(f"{where} has an output.weight: an untied unembedding, which kvlib's "
                         "models (the unembedding is the token table) do not have")
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
                   "source.json")
"""What convert writes: the float32 tensors (GGUF names), the metadata without the
tokenizer's long lists, the tokenizer in the model hub's layout, and the GGUF file's size."""


def _source_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}


def converted_directory(path) -> Path:
    """Where convert keeps a GGUF file's float32 weights: <name>.float32/ beside the file."""
    path = as_path(path)
    return path.with_name(path.stem + ".float32")


def is_converted(path) -> bool:
    """True when the GGUF file beside it has a complete, up-to-date converted folder."""
    path, folder = Path(path), converted_directory(path)
    if not all((folder / name).is_file() for name in CONVERTED_FILES):
        return False
    try:
        stamp = json.loads((folder / "source.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return path.is_file() and stamp == _source_stamp(path)


def convert(path) -> Path:
    """Dequantize a GGUF file once into a folder beside it (model_of_today) -> the folder.

    The folder holds model.safetensors (every tensor in float32 under its GGUF name),
    metadata.json, vocab.json and merges.txt (the tokenizer, in the model hub's layout) and
    source.json (the GGUF file's size and time, so that a changed file is converted again).
    It is written under a temporary name and renamed at the end: an interrupted conversion
    leaves nothing half-written behind.
    """
    path = Path(path)
    metadata, raw = read_gguf(path)
    config = config_from_gguf(metadata)               # refuse what kvlib cannot run, first
    tensors = dequantize_tensors(raw)
    params_from_gguf_tensors(config, tensors, where=str(path))     # checks every tensor
    folder = converted_directory(path)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    write_safetensors(partial / "model.safetensors",
                      {name: np.ascontiguousarray(array) for name, array in tensors.items()},
                      {"source": path.name})
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise ValueError(f"{path} has no byte-level BPE tokenizer in its metadata")
    (partial / "vocab.json").write_text(
        json.dumps({token: i for i, token in enumerate(tokens)}, ensure_ascii=False),
        encoding="utf-8")
    (partial / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                        encoding="utf-8")
    types = metadata.get("tokenizer.ggml.token_type", [])
    small = {key: value for key, value in metadata.items() if key not in TOKENIZER_KEYS}
    small["kvlib.control_tokens"] = [token for token, kind in zip(tokens, types)
                                     if kind == CONTROL_TOKEN]
    (partial / "metadata.json").write_text(json.dumps(small, indent=1, ensure_ascii=False),
                                           encoding="utf-8")
    (partial / "source.json").write_text(json.dumps(_source_stamp(path)), encoding="utf-8")
    if folder.exists():
        for old in folder.iterdir():
            old.unlink()
        folder.rmdir()
    os.replace(partial, folder)
    return folder


def read_converted_metadata(folder) -> dict:
    """metadata.json of a converted folder (without the tokenizer's lists)."""
    return json.loads((Path(folder) / "metadata.json").read_text(encoding="utf-8"))


def load_converted(folder, dtype: str = "float32") -> Params:
    """Params from a converted folder (model_of_today): memory-mapped float32, about a second."""
    folder = Path(folder)
    config = config_from_gguf(read_converted_metadata(folder), dtype)
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


__all__ = ["CONVERTED_FILES", "GGUF_BLOCK_NAMES", "GGUF_NAMES", "bits_per_number",
           "config_from_gguf", "convert", "converted_directory",
           "dequantize_tensors", "is_converted", "load_converted", "load_gguf",
           "params_from_gguf_tensors", "read_converted_metadata", "read_gguf"]
