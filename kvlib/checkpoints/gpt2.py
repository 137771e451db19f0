"""GPT-2's published weights as kvlib params (real_model), with numpy alone.

A GPT-2 checkpoint in the model hub's layout is a folder with `config.json` (the sizes) and
`model.safetensors` (the tensors). Its tensors map onto kvlib's names one to one, except
c_attn: GPT-2 keeps Wq, Wk and Wv side by side in one (d, 3d) matrix, which `load` cuts into
three column blocks (views, no copy). GPT-2 stores every matrix as (in, out) (its "Conv1D"
layout), so `X @ W + b` needs no transpose, as in kvlib.

    hub name (h.{i}. = block i)    kvlib name
    wte.weight        (V, d)       embedding (and the tied unembedding)
    wpe.weight        (n_ctx, d)   position_table
    h.{i}.ln_1.weight / .bias      layers[i].ln_1_gain / ln_1_bias
    h.{i}.attn.c_attn.weight       layers[i].Wq | Wk | Wv, (d, 3d) cut in three
    h.{i}.attn.c_attn.bias         layers[i].bq | bk | bv
    h.{i}.attn.c_proj.weight/.bias layers[i].Wo / bo
    h.{i}.ln_2.weight / .bias      layers[i].ln_2_gain / ln_2_bias
    h.{i}.mlp.c_fc.weight/.bias    layers[i].W_up / b_up
    h.{i}.mlp.c_proj.weight/.bias  layers[i].W_down / b_down
    ln_f.weight / .bias            ln_f_gain / ln_f_bias

The hub's file for openai-community/gpt2 names tensors as above; files written by
transformers' `save_pretrained` put `transformer.` in front (and may add `lm_head.weight`, the
tied table again). Old files also hold `h.{i}.attn.bias` and `h.{i}.attn.masked_bias`: the
causal mask as a buffer, not weights; they are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..checks import as_finite, as_known_tensors, as_path
from ..config import ModelConfig
from ..params import LayerParams, Params
from .safetensors import (
    float32_to_bfloat16,
    in_dtype,
    read_header,
    read_safetensors,
    write_safetensors,
)

GPT2_124M = ModelConfig(
    vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, context_length=1024,
    dtype="float32", positions="learned", norm="layer", bias=True,
)
"""GPT-2 small (124M parameters), its whole architecture: config.json of openai-community/gpt2
(n_layer 12, n_embd 768, n_head 12, n_positions 1024, vocab_size 50257)."""

_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_SKIPPED = (".attn.bias", ".attn.masked_bias")


def config_from_hub(hub_config: dict, dtype: str = "float32") -> ModelConfig:
    """A kvlib ModelConfig from the dict of a GPT-2 config.json (real_model).

    Refuses, naming the setting, what kvlib's GPT-2 does not compute: another activation
    than the tanh GeLU, unscaled or per-layer-scaled attention, untied embeddings.
    """
    if hub_config.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"config.json describes a {hub_config['model_type']!r} model "
                         "(model_type); kvlib.gpt2 reads GPT-2 checkpoints only")
    activation = hub_config.get("activation_function", "gelu_new")
    if activation not in _TANH_GELU:
        raise ValueError(f"activation_function is {activation!r}: kvlib computes GPT-2's "
                         f"tanh GeLU ({' or '.join(_TANH_GELU)}) only")
    for setting, expected in (("scale_attn_weights", True),
                              ("scale_attn_by_inverse_layer_idx", False),
                              ("tie_word_embeddings", True)):
        if hub_config.get(setting, expected) != expected:
            raise ValueError(f"config.json sets {setting} = {hub_config[setting]}; kvlib's "
                             f"GPT-2 computes {setting} = {expected} only")
    try:
        d_model = hub_config["n_embd"]
        return ModelConfig(
            vocab_size=hub_config["vocab_size"], d_model=d_model,
            n_heads=hub_config["n_head"], n_layers=hub_config["n_layer"],
            d_ff=hub_config.get("n_inner") or 4 * d_model,
            context_length=hub_config.get("n_positions", hub_config.get("n_ctx")),
            dtype=dtype, positions="learned", norm="layer", bias=True,
            norm_epsilon=hub_config.get("layer_norm_epsilon", 1e-5),
        )
    except KeyError as missing:
        raise ValueError(f"config.json has no {missing} entry: is it a GPT-2 config?") from None


def _tensor_names(prefix: str, n_layers: int) -> dict[str, str]:
    """kvlib name (with `layer {i} ` for blocks) -> the checkpoint's tensor name."""
    mapping = {"embedding": "wte.weight", "position_table": "wpe.weight",
               "ln_f_gain": "ln_f.weight", "ln_f_bias": "ln_f.bias"}
    block = {"ln_1_gain": "ln_1.weight", "ln_1_bias": "ln_1.bias",
             "c_attn": "attn.c_attn.weight", "c_attn_bias": "attn.c_attn.bias",
             "Wo": "attn.c_proj.weight", "bo": "attn.c_proj.bias",
             "ln_2_gain": "ln_2.weight", "ln_2_bias": "ln_2.bias",
             "W_up": "mlp.c_fc.weight", "b_up": "mlp.c_fc.bias",
             "W_down": "mlp.c_proj.weight", "b_down": "mlp.c_proj.bias"}
    for i in range(n_layers):
        mapping |= {f"layer {i} {ours}": f"h.{i}.{theirs}" for ours, theirs in block.items()}
    return {ours: prefix + theirs for ours, theirs in mapping.items()}


def _naming_prefix(names) -> str:
    if "transformer.wte.weight" in names:
        return "transformer."
    if "wte.weight" in names:
        return ""
    raise ValueError("this is not a GPT-2 checkpoint: it has neither 'wte.weight' (the hub's "
                     "naming) nor 'transformer.wte.weight' (transformers' save_pretrained)")


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = config.d_model
    shapes = dict(Params.expected_shapes(config))
    block = LayerParams.expected_shapes(config)
    for i in range(config.n_layers):
        shapes |= {f"layer {i} {name}": shape for name, shape in block.items()
                   if name not in ("Wq", "Wk", "Wv", "bq", "bk", "bv")}
        shapes |= {f"layer {i} c_attn": (d, 3 * d), f"layer {i} c_attn_bias": (3 * d,)}
    return shapes


def load(directory, dtype: str = "float32") -> Params:
    """kvlib params from a GPT-2 checkpoint folder (config.json + model.safetensors) (real_model).

    Tensors stored as F32 and loaded as float32 stay memory-mapped: nothing is copied, and
    the file's pages stay file-backed (GPT-2 124M is 500 MB; the kernel can drop them and
    read them again). Each tensor is read once here, to check that it holds no NaN or
    infinity: a damaged file would otherwise show much later, as NaN logits. F16 and BF16,
    or a dtype other than the file's, are converted (a copy). Missing or misshapen tensors
    are named in the error, with the shape expected and the shape found; so is a
    config.json that is not a JSON object.
    """
    directory = as_path(directory, "directory")
    for needed in ("config.json", "model.safetensors"):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory} has no {needed}: a GPT-2 checkpoint folder "
                                    "holds config.json and model.safetensors (kvlib.gpt2."
                                    "download() fetches GPT-2 124M)")
    config = config_from_hub(read_config(directory / "config.json"), dtype)
    path = directory / "model.safetensors"
    header, _ = read_header(path)
    tensors = read_safetensors(path)
    prefix = _naming_prefix(tensors)
    names = _tensor_names(prefix, config.n_layers)
    shapes = _expected_shapes(config)
    arrays = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ValueError(f"{path} has no tensor {theirs!r} (kvlib's {ours}), of shape "
                             f"{shapes[ours]}: is it a GPT-2 checkpoint of this config?")
        tensor = tensors[theirs]
        if tensor.shape != shapes[ours]:
            raise ValueError(f"{path}: tensor {theirs!r} has shape {tensor.shape}, but "
                             f"config.json's sizes need {shapes[ours]}")
        arrays[ours] = in_dtype(tensor, header[theirs]["dtype"], config.numpy_dtype)
        as_finite(arrays[ours], theirs, str(path))
    as_known_tensors(path, tensors, set(names.values()), arrays["embedding"], _SKIPPED)
    return _params(config, arrays)


def read_config(path: Path) -> dict:
    """A config.json as a dict; a ValueError naming the file when it is not a JSON object."""
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as error:    # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"{path} is not a config.json, a JSON object in UTF-8 "
                         f"({error!r:.200})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a config.json, a JSON object in UTF-8: it holds a JSON "
                         f"{type(config).__name__}")
    return config


def _params(config: ModelConfig, arrays: dict[str, np.ndarray]) -> Params:
    d = config.d_model
    layers = []
    for i in range(config.n_layers):
        block = {name[len(f"layer {i} "):]: array for name, array in arrays.items()
                 if name.startswith(f"layer {i} ")}
        c_attn, c_attn_bias = block.pop("c_attn"), block.pop("c_attn_bias")
        layers.append(LayerParams(
            Wq=c_attn[:, :d], Wk=c_attn[:, d:2 * d], Wv=c_attn[:, 2 * d:],
            bq=c_attn_bias[:d], bk=c_attn_bias[d:2 * d], bv=c_attn_bias[2 * d:], **block))
    return Params(config=config, layers=layers,
                  **{name: arrays[name] for name in Params.expected_shapes(config)})


def save(params: Params, directory, *, prefix: str = "", stored_dtype: str = "F32") -> Path:
    """Write kvlib params of a GPT-2 model as a checkpoint folder that `load` and transformers
    read (config.json + model.safetensors), for tests and tools (real_model).

    prefix "" names tensors as the hub's GPT-2 file does, "transformer." as save_pretrained
    does. stored_dtype "F32", "F16" or "BF16".
    """
    config = params.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = dict(params.arrays())
    for i, layer in enumerate(params.layers):
        block = layer.arrays()
        arrays[f"layer {i} c_attn"] = np.hstack([block.pop("Wq"), block.pop("Wk"),
                                                 block.pop("Wv")])
        arrays[f"layer {i} c_attn_bias"] = np.concatenate([block.pop("bq"), block.pop("bk"),
                                                           block.pop("bv")])
        arrays |= {f"layer {i} {name}": array for name, array in block.items()}
    names = _tensor_names(prefix, config.n_layers)
    tensors, bfloat16 = {}, set()
    for ours, theirs in names.items():
        value = np.ascontiguousarray(arrays[ours])
        if stored_dtype == "F16":
            value = value.astype(np.float16)
        elif stored_dtype == "BF16":
            value = float32_to_bfloat16(value.astype(np.float32))
            bfloat16.add(theirs)
        else:
            value = value.astype(np.float32)
        tensors[theirs] = value
    write_safetensors(directory / "model.safetensors", tensors, {"format": "pt"},
                      bfloat16=bfloat16)
    hub_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size, "n_embd": config.d_model, "n_head": config.n_heads,
        "n_layer": config.n_layers, "n_inner": config.d_ff, "n_positions": config.context_length,
        "n_ctx": config.context_length, "layer_norm_epsilon": config.norm_epsilon,
        "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "tie_word_embeddings": True,
    }
    (directory / "config.json").write_text(json.dumps(hub_config, indent=2) + "\n")
    return directory
