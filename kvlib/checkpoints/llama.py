"""Llama-architecture checkpoints in the model hub's layout (model_of_today): config.json +
model.safetensors, as transformers' LlamaForCausalLM.save_pretrained writes them and as
HuggingFaceTB/SmolLM2-135M-Instruct is published.

    hub name (model.layers.{i}. = block i)        kvlib name
    model.embed_tokens.weight   (V, d)            embedding (and the tied unembedding)
    {i}.input_layernorm.weight                    layers[i].ln_1_gain   (RMSNorm: no bias)
    {i}.self_attn.q_proj / k_proj / v_proj / o_proj.weight   layers[i].Wq / Wk / Wv / Wo
    {i}.post_attention_layernorm.weight           layers[i].ln_2_gain
    {i}.mlp.gate_proj / up_proj / down_proj.weight           layers[i].W_gate / W_up / W_down
    model.norm.weight                             ln_f_gain
    lm_head.weight              (optional)        must equal the table: kvlib ties them

The hub stores each matrix as (out, in), like PyTorch's Linear; kvlib's W is (in, out), a
transposed view. Its q and k rows are in the order transformers' rotate_half expects, so a
model loaded from here has rope_pairing="half". llama.cpp's converter reorders those rows per
head for neighbouring pairs (`to_interleaved_rows`), which is why the same model read from
a GGUF file has rope_pairing="interleaved"; `with_rope_pairing` turns one into the other and
computes the same logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ..checks import (
    as_array,
    as_divisor,
    as_finite,
    as_known_tensors,
    as_one_of,
    as_params,
    as_path,
)
from ..config import ModelConfig
from ..params import LayerParams, Params
from .gpt2 import read_config
from .safetensors import (
    float32_to_bfloat16,
    in_dtype,
    read_header,
    read_safetensors,
    write_safetensors,
)

HUB_NAMES = {"embedding": "model.embed_tokens.weight", "ln_f_gain": "model.norm.weight"}
HUB_BLOCK_NAMES = {
    "ln_1_gain": "input_layernorm.weight",
    "Wq": "self_attn.q_proj.weight",
    "Wk": "self_attn.k_proj.weight",
    "Wv": "self_attn.v_proj.weight",
    "Wo": "self_attn.o_proj.weight",
    "ln_2_gain": "post_attention_layernorm.weight",
    "W_gate": "mlp.gate_proj.weight",
    "W_up": "mlp.up_proj.weight",
    "W_down": "mlp.down_proj.weight",
}
"""kvlib name -> hub name inside block i (model.layers.{i}.<name>); matrices (out, in)."""


def _rope_base(hub_config: dict) -> float:
    """rope_theta (transformers 4) or rope_parameters["rope_theta"] (transformers 5); only the
    plain rotation ("default"), no scaling."""
    parameters = hub_config.get("rope_parameters") or {}
    scaling = hub_config.get("rope_scaling") or parameters
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"config.json asks for RoPE scaling {kind!r}; kvlib's rotary positions "
                         "have none")
    return float(parameters.get("rope_theta", hub_config.get("rope_theta", 10000.0)))


def config_from_hub(hub_config: dict, dtype: str = "float32") -> ModelConfig:
    """kvlib's ModelConfig from a Llama config.json (model_of_today), with the half pairing.

    Refuses, naming the setting, what kvlib's Llama does not compute: another model type or
    activation, biases, untied embeddings, RoPE scaling, a head size other than d / heads.
    """
    if hub_config.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json describes a {hub_config['model_type']!r} model; "
                         "kvlib.checkpoints.llama reads Llama-architecture checkpoints")
    for setting, expected in (("hidden_act", "silu"), ("attention_bias", False),
                              ("mlp_bias", False), ("tie_word_embeddings", True)):
        if hub_config.get(setting, expected) != expected:
            raise ValueError(f"config.json sets {setting} = {hub_config[setting]!r}; kvlib's "
                             f"Llama computes {setting} = {expected!r} only")
    try:
        d_model, n_heads = hub_config["hidden_size"], hub_config["num_attention_heads"]
        head_dim = hub_config.get("head_dim") or d_model // n_heads
        if head_dim * n_heads != d_model:
            raise ValueError(f"config.json's head_dim {head_dim} x {n_heads} heads is not "
                             f"hidden_size {d_model}; kvlib's heads split d_model")
        n_kv_heads = hub_config.get("num_key_value_heads", n_heads)
        return ModelConfig(
            vocab_size=hub_config["vocab_size"], d_model=d_model, n_heads=n_heads,
            n_layers=hub_config["num_hidden_layers"], d_ff=hub_config["intermediate_size"],
            context_length=hub_config["max_position_embeddings"], dtype=dtype,
            positions="rotary", norm="rms", mlp="swiglu", bias=False,
            norm_epsilon=hub_config.get("rms_norm_eps", 1e-6),
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            rope_base=_rope_base(hub_config), rope_pairing="half")
    except KeyError as missing:
        raise ValueError(f"config.json has no {missing} entry: is it a Llama config?") from None


def _names(n_layers: int) -> dict[str, str]:
    names = dict(HUB_NAMES)
    for i in range(n_layers):
        names |= {f"layer {i} {ours}": f"model.layers.{i}.{theirs}"
                  for ours, theirs in HUB_BLOCK_NAMES.items()}
    return names


def load(directory, dtype: str = "float32") -> Params:
    """kvlib Params from a Llama checkpoint folder in the hub's layout (model_of_today).

    F32 tensors loaded as float32 stay memory-mapped (transposed views); F16 and BF16 (the
    hub's SmolLM2 is BF16) are converted. Missing, misshapen, unknown or non-finite tensors are
    named in the error.
    """
    directory = as_path(directory, "directory")
    for needed in ("config.json", "model.safetensors"):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory} has no {needed}: a Llama checkpoint folder "
                                    "holds config.json and model.safetensors")
    config = config_from_hub(read_config(directory / "config.json"), dtype)
    path = directory / "model.safetensors"
    header, _ = read_header(path)
    tensors = read_safetensors(path)
    names = _names(config.n_layers)
    expected = dict(Params.expected_shapes(config))
    for i in range(config.n_layers):
        expected |= {f"layer {i} {name}": shape
                     for name, shape in LayerParams.expected_shapes(config).items()}
    arrays = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ValueError(f"{path} has no tensor {theirs!r} (kvlib's {ours}), of shape "
                             f"{expected[ours]}: is it a Llama checkpoint of this config?")
        array = in_dtype(tensors[theirs], header[theirs]["dtype"], config.numpy_dtype)
        array = array.T if array.ndim == 2 and ours != "embedding" else array
        if array.shape != expected[ours]:
            raise ValueError(f"{path}: tensor {theirs!r} has shape {array.shape} as kvlib reads "
                             f"it, but config.json's sizes need {expected[ours]}")
        as_finite(array, theirs, str(path))
        arrays[ours] = array
    as_known_tensors(path, tensors, set(names.values()), arrays["embedding"],
                     ("rotary_emb.inv_freq",))   # a buffer, not a weight
    return _params(config, arrays)


def _params(config: ModelConfig, arrays: dict[str, np.ndarray]) -> Params:
    layers = [LayerParams(**{name: arrays[f"layer {i} {name}"]
                             for name in LayerParams.expected_shapes(config)})
              for i in range(config.n_layers)]
    return Params(config=config, layers=layers,
                  **{name: arrays[name] for name in Params.expected_shapes(config)})


def save(params: Params, directory, *, stored_dtype: str = "F32") -> Path:
    """Write Params of a Llama architecture (rope_pairing "half") as a hub-layout folder that
    `load` and transformers' LlamaForCausalLM.from_pretrained read (model_of_today; tests).
    stored_dtype "F32", "F16" or "BF16". A GGUF model (interleaved) is turned first with
    with_rope_pairing(params, "half")."""
    config = params.config
    if config.rope_pairing != "half":
        raise ValueError("the hub's layout expects q and k rows for the half pairing: save "
                         "with_rope_pairing(params, 'half') instead")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = dict(params.arrays())
    for i, layer in enumerate(params.layers):
        arrays |= {f"layer {i} {name}": array for name, array in layer.arrays().items()}
    tensors, bfloat16 = {}, set()
    for ours, theirs in _names(config.n_layers).items():
        value = arrays[ours]
        value = np.ascontiguousarray(value.T if value.ndim == 2 and ours != "embedding"
                                     else value).astype(np.float32)
        if stored_dtype == "F16":
            value = value.astype(np.float16)
        elif stored_dtype == "BF16":
            value = float32_to_bfloat16(value)
            bfloat16.add(theirs)
        tensors[theirs] = value
    write_safetensors(directory / "model.safetensors", tensors, {"format": "pt"},
                      bfloat16=bfloat16)
    hub_config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rope_base,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": True,
    }
    (directory / "config.json").write_text(json.dumps(hub_config, indent=2) + "\n")
    return directory


# ------------------------------------------------------------------------------ the two pairings

def to_interleaved_columns(W: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's reordering of q or k (model_of_today), on kvlib's W (d, heads x dh) or a bias
    (heads x dh,): within each head, output column 2i takes column i and 2i + 1 takes column
    i + dh/2. After it, turning neighbouring pairs (rotate_pairs) does what turning halves
    (rotate_halves) did before. (llama.cpp's `permute` in convert_hf_to_gguf.py does this to the
    rows of (out, in).)"""
    W = as_array("W", W, (1, 2))
    n_heads = as_divisor("n_heads", n_heads, W.shape[-1], "columns of W")
    if (W.shape[-1] // n_heads) % 2:
        raise ValueError(f"each head's {W.shape[-1] // n_heads} columns must pair up: an even "
                         "head size")
    *rest, width = W.shape
    head_dim = width // n_heads
    return W.reshape(*rest, n_heads, 2, head_dim // 2).swapaxes(-1, -2).reshape(W.shape)


def to_half_columns(W: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of to_interleaved_columns: from a GGUF's order back to the hub's."""
    W = as_array("W", W, (1, 2))
    interleaved = to_interleaved_columns(np.arange(W.shape[-1]), n_heads)   # which column went
    return W[..., np.argsort(interleaved)]                                  # where, undone


def with_rope_pairing(params: Params, pairing: str) -> Params:
    """The same model for the other rotary pairing (model_of_today): Wq's and Wk's columns (and
    their biases, if any) reordered within each head, the config's rope_pairing changed. Its
    logits equal the original's (up to rounding); only the order of the columns q and k hold
    differs, in the cache too."""
    config = as_params(params).config
    pairing = as_one_of("pairing", pairing, ("interleaved", "half"))
    if config.positions != "rotary" or config.latent_dim is not None:
        raise ValueError("only a model with rotary positions on whole heads has a pairing")
    if pairing == config.rope_pairing:
        return params
    reorder = to_interleaved_columns if pairing == "interleaved" else to_half_columns
    layers = []
    for layer in params.layers:
        changes = {"Wq": reorder(layer.Wq, config.n_heads),
                   "Wk": reorder(layer.Wk, config.kv_heads)}
        if layer.bq is not None:
            changes |= {"bq": reorder(layer.bq, config.n_heads),
                        "bk": reorder(layer.bk, config.kv_heads)}
        layers.append(dataclasses.replace(layer, **changes))
    return Params(config.replace(rope_pairing=pairing), params.embedding, layers,
                  params.position_table, params.ln_f_gain, params.ln_f_bias)


__all__ = ["HUB_BLOCK_NAMES", "HUB_NAMES", "config_from_hub", "load", "save",
           "to_half_columns", "to_interleaved_columns", "with_rope_pairing"]
