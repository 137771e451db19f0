"""A Qwen3-Next-architecture checkpoint (kvlib's stories-hybrid) as numpy weights.

The folder is the model hub's layout that transformers' save_pretrained writes for
Qwen3NextForCausalLM: config.json + model.safetensors, read here with kvlib's own
safetensors reader. transformers' nn.Linear stores (out, in); kvlib computes X @ W with
(in, out), so every projection is transposed once, here.

    tensor (model.layers.{i}. = block i)         kvlib (kvlib.deltanet)
    model.embed_tokens.weight    (V, d)           embedding (tied: no lm_head.weight)
    model.norm.weight            (d,)             final_norm
    input_layernorm / post_attention_layernorm   input_norm / post_norm
    mlp.gate_proj / up_proj / down_proj          W_gate / W_up / W_down
    linear_attn.in_proj_qkvz / in_proj_ba        in_proj_qkvz / in_proj_ba
    linear_attn.conv1d.weight  (conv_dim, 1, K)  conv_weight (conv_dim, K)
    linear_attn.A_log / dt_bias                  A_log / dt_bias
    linear_attn.norm.weight / out_proj           out_norm / out_proj
    self_attn.q_proj / k_proj / v_proj / o_proj  Wq / Wk / Wv / Wo
    self_attn.q_norm / k_norm                    q_norm / k_norm

The norm weights are kept as stored: the model adds the 1 of Qwen3-Next's (1 + w) gain when
it runs (kvlib.deltanet.offset_rms_norm), except for linear_attn.norm, whose gain is w.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checks import as_finite, as_path
from ..deltanet import LAYER_PARAMS, HybridConfig, HybridParams
from .gpt2 import read_config
from .safetensors import in_dtype, read_header, read_safetensors

MODELS = Path(__file__).resolve().parent.parent / "models"
"""The folder of the models that ship with kvlib."""

_NAMES = {
    "linear_attention": {
        "in_proj_qkvz": "linear_attn.in_proj_qkvz.weight",
        "in_proj_ba": "linear_attn.in_proj_ba.weight",
        "conv_weight": "linear_attn.conv1d.weight", "A_log": "linear_attn.A_log",
        "dt_bias": "linear_attn.dt_bias", "out_norm": "linear_attn.norm.weight",
        "out_proj": "linear_attn.out_proj.weight"},
    "full_attention": {
        "Wq": "self_attn.q_proj.weight", "Wk": "self_attn.k_proj.weight",
        "Wv": "self_attn.v_proj.weight", "Wo": "self_attn.o_proj.weight",
        "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"},
}
_SHARED = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
           "W_gate": "mlp.gate_proj.weight", "W_up": "mlp.up_proj.weight",
           "W_down": "mlp.down_proj.weight"}
_LINEAR = ("in_proj_qkvz", "in_proj_ba", "out_proj", "Wq", "Wk", "Wv", "Wo", "W_gate",
           "W_up", "W_down")
"""nn.Linear weights, stored (out, in)."""


def config_from_hub(hub: dict, dtype: str = "float32") -> HybridConfig:
    """A HybridConfig from the dict of a Qwen3-Next config.json; refuses, naming the setting,
    what kvlib.deltanet does not compute (experts, biases, another activation or rotary
    scaling, untied embeddings)."""
    if hub.get("model_type") != "qwen3_next":
        raise ValueError(f"config.json describes a {hub.get('model_type')!r} model; "
                         "kvlib.deltanet reads Qwen3-Next (qwen3_next) checkpoints")
    for setting, expected, default in (("attention_bias", False, False),
                                       ("hidden_act", "silu", "silu"),
                                       ("tie_word_embeddings", True, False)):
        if hub.get(setting, default) != expected:
            raise ValueError(f"config.json sets {setting} = {hub.get(setting, default)!r}; "
                             "kvlib.deltanet "
                             f"computes {setting} = {expected!r} only")
    if hub.get("num_experts", 0) and any(
            i not in (hub.get("mlp_only_layers") or [])
            and (i + 1) % hub.get("decoder_sparse_step", 1) == 0
            for i in range(hub["num_hidden_layers"])):
        raise ValueError("config.json gives some layers mixture-of-experts MLPs "
                         "(num_experts > 0); kvlib.deltanet computes dense MLPs only")
    rope = hub.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r}: kvlib.deltanet computes the "
                         "default rotary positions only")
    try:
        head_dim = hub["head_dim"]
        return HybridConfig(
            vocab_size=hub["vocab_size"], d_model=hub["hidden_size"],
            layer_types=tuple(hub["layer_types"]), d_ff=hub["intermediate_size"],
            n_heads=hub["num_attention_heads"], n_kv_heads=hub["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
            rope_base=rope.get("rope_theta", 10000.0),
            linear_key_heads=hub["linear_num_key_heads"],
            linear_value_heads=hub["linear_num_value_heads"],
            linear_key_dim=hub["linear_key_head_dim"],
            linear_value_dim=hub["linear_value_head_dim"],
            conv_kernel=hub["linear_conv_kernel_dim"], norm_epsilon=hub["rms_norm_eps"],
            context_length=hub["max_position_embeddings"], dtype=dtype)
    except KeyError as missing:
        raise ValueError(f"config.json has no {missing} entry: is it a Qwen3-Next "
                         "config?") from None


def _tensor_names(config: HybridConfig) -> dict[str, str]:
    """kvlib name ("layer {i} {field}" for blocks) -> the checkpoint's tensor name."""
    names = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    for i, kind in enumerate(config.layer_types):
        for ours, theirs in (_NAMES[kind] | _SHARED).items():
            names[f"layer {i} {ours}"] = f"model.layers.{i}.{theirs}"
    return names


def _expected_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """The file's shapes: (out, in) for the projections, conv1d's (conv_dim, 1, K)."""
    shapes = {"embedding": (config.vocab_size, config.d_model),
              "final_norm": (config.d_model,)}
    for i, kind in enumerate(config.layer_types):
        for name, shape in LAYER_PARAMS[kind].expected_shapes(config).items():
            if name in _LINEAR:
                shape = shape[::-1]
            elif name == "conv_weight":
                shape = (shape[0], 1, shape[1])
            shapes[f"layer {i} {name}"] = shape
    return shapes


def _as_kvlib(name: str, array: np.ndarray) -> np.ndarray:
    field = name.split()[-1]
    if field in _LINEAR:
        return np.ascontiguousarray(array.T)
    if field == "conv_weight":
        return np.ascontiguousarray(array[:, 0])
    return array


def model_directory(name) -> Path:
    """A model that ships with kvlib, by name ("stories-hybrid"), or any folder by its path."""
    if isinstance(name, str) and "/" not in name and "\\" not in name and name:
        return MODELS / name
    return as_path(name, "name")


def load_hybrid(name="stories-hybrid", dtype: str = "float32") -> HybridParams:
    """The weights of a Qwen3-Next-architecture model as kvlib.deltanet.HybridParams.

    name: a model that ships with kvlib (a folder of kvlib/models, "stories-hybrid"), or
    the path of a folder holding config.json and model.safetensors. dtype: float32 or
    float64 (the file's float16 numbers are converted). Missing, misshapen, unexpected or
    non-finite tensors are named in the error.
    """
    directory = model_directory(name)
    for needed in ("config.json", "model.safetensors"):
        if not (directory / needed).is_file():
            raise FileNotFoundError(f"{directory} has no {needed}: a checkpoint folder holds "
                                    "config.json and model.safetensors")
    config = config_from_hub(read_config(directory / "config.json"), dtype)
    path = directory / "model.safetensors"
    header, _ = read_header(path)
    tensors = read_safetensors(path)
    names, shapes = _tensor_names(config), _expected_shapes(config)
    arrays = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ValueError(f"{path} has no tensor {theirs!r} (kvlib's {ours}), of shape "
                             f"{shapes[ours]}: is it a checkpoint of this config?")
        if tensors[theirs].shape != shapes[ours]:
            raise ValueError(f"{path}: tensor {theirs!r} has shape {tensors[theirs].shape}, "
                             f"but config.json's sizes need {shapes[ours]}")
        array = in_dtype(tensors[theirs], header[theirs]["dtype"], dtype)
        as_finite(array, theirs, str(path))
        arrays[ours] = _as_kvlib(ours, array)
    unexpected = sorted(set(tensors) - set(names.values()))
    if unexpected:
        raise ValueError(f"{path} holds tensors kvlib.deltanet does not use: {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    layers = []
    for i, kind in enumerate(config.layer_types):
        fields = LAYER_PARAMS[kind].expected_shapes(config)
        layers.append(LAYER_PARAMS[kind](**{name: arrays[f"layer {i} {name}"]
                                            for name in fields}))
    return HybridParams(config=config, embedding=arrays["embedding"], layers=tuple(layers),
                        final_norm=arrays["final_norm"])
