"""Write what transformers' own code computes for gated DeltaNet and Qwen3-Next's gated
attention, for tests/test_deltanet.py to check kvlib.deltanet against without torch.

Needs torch and transformers (never part of requirements.txt, `make test` or CI; see
tools/README.md). Run by hand, from the repository root, in the reference environment,
after tools/train_hybrid.py:

    /work/venv-ref/bin/python tools/make_deltanet_reference.py

kvlib's numpy code is not imported: nothing recorded here is computed by the code under
test (kvlib.stories makes the prompts). Inputs and weights are float64 from a seeded
generator. It writes tests/data/deltanet-reference/reference.npz (about 600 KB; a rerun
writes the same numbers) and versions.json (torch, transformers, Python, numpy, seed).

Two versions of transformers' code are run:
- `f32`: transformers 5.25's modeling_qwen3_next as it is. Its kernels
  (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule) cast every input to
  float32 whatever its dtype, its RMSNorms compute in float32 (x.float()), its rotary
  frequencies and angles are float32: it cannot be run in float64. Inputs and weights are
  cast to float32 first; the test casts them the same way and compares with a measured
  tolerance.
- `f64`: the same module's source with those casts turned to float64 (torch.float32 ->
  torch.float64, .float() -> .double(), dtype=torch.float -> torch.float64; nothing else
  changed), executed as a module of the same package. Everything then runs in float64,
  and the test compares with a tight tolerance. The counts of the replacements are in
  versions.json.

Keys are `section.case.name`:
- `kernel.{c}`: `query`, `key` (T, hk, d_k), `value` (T, hv, d_v), `g`, `beta` (T, hv),
  `initial_state` (hv, d_k, d_v) when the case has one, `chunk_size`; for each version v and
  each kernel (`recurrent`, `chunked`): `{v}_{kernel}_output` (T, hv, d_v) and
  `{v}_{kernel}_state` (hv, d_k, d_v) (batch of one removed).
- `deltanet`: one Qwen3NextGatedDeltaNet with random weights (norm weights, A_log and
  dt_bias random too, so that a wrong 1 + w shows): weights under transformers' names and
  (out, in) layout; `x` (T, d) through a DynamicCache (`{v}_output`, then the cache's
  `{v}_conv_state` (conv_dim, K) and `{v}_recurrent_state`); then `x_step` (1, d), one
  decode token (the recurrent kernel and causal_conv1d_update): `{v}_step_output`, states
  `{v}_step_*`; then `x_more` (3, d), a chunk continuing the cache (the chunked kernel with
  an initial state): `{v}_more_output`, `{v}_more_*`.
- `attention`: one Qwen3NextAttention (sdpa, causal) with random weights; `x` (T, d) at
  positions 0 .. T-1 -> `{v}_output`; then `x_step` at position T through the DynamicCache
  -> `{v}_step_output`. `layers.config` holds the sizes of both layers (json).
- `model`: kvlib/models/stories-hybrid loaded by from_pretrained (float16 -> float32; for
  f64 those weights are copied into the edited module's model in float64); `prompt` (a
  story's first 72 tokens: the chunked kernel's second chunk starts at 64); `f32_logits`
  (T, V); `f64_logits_rows` at `f64_rows`; per DeltaNet layer i `f32_conv_state_{i}`
  (conv_dim, K) and `f32_recurrent_state_{i}`, and for the last one `f64_recurrent_state_2`;
  `f32_keys_{i}`, `f32_values_{i}` (kv, T, hd) of the attention layer; `greedy` (the 24
  tokens chosen greedily after the prompt, one decode step at a time through transformers'
  cache) and `f32_decode_logits` (24, V), the logits each step chose from.
"""

from __future__ import annotations

import inspect
import json
import platform
import sys
import types
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as original
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib.stories.corpus import story_sequences  # noqa: E402

OUT = ROOT / "tests" / "data" / "deltanet-reference"
MODEL = ROOT / "kvlib" / "models" / "stories-hybrid"
SEED = 2025
PROMPT_SEED = 11           # neither the training (2024) nor the held-out (7) stories
PROMPT_TOKENS = 72
GREEDY_TOKENS = 24
F64_ROWS = (0, 1, 31, 63, 64, 65, 70, 71)
LAST_DELTANET = 2
FLOAT64_EDITS = (("torch.float32", "torch.float64"), (".float()", ".double()"),
                 ("dtype=torch.float)", "dtype=torch.float64)"),
                 ("dtype=torch.float,", "dtype=torch.float64,"))
KERNEL_CASES = {
    # name: (T, hk, hv, d_k, d_v, chunk_size, with an initial state)
    "one_token": (1, 1, 1, 4, 4, 64, False),
    "grouped": (37, 2, 4, 8, 6, 16, True),
    "three_chunks": (130, 1, 2, 6, 6, 64, True),
    "one_chunk": (64, 1, 3, 5, 7, 64, False),
}
LAYER_SIZES = dict(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    num_experts=0, rms_norm_eps=1e-6, max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25},
)
LAYER_TOKENS = 20


def float64_module() -> tuple[types.ModuleType, dict]:
    """transformers' modeling_qwen3_next with its float32 casts made float64."""
    source = inspect.getsource(original)
    counts = {}
    for old, new in FLOAT64_EDITS:
        counts[old] = source.count(old)
        source = source.replace(old, new)
    module = types.ModuleType(original.__name__ + "_float64")
    module.__package__, module.__file__ = original.__package__, original.__file__
    sys.modules[module.__name__] = module      # transformers reads its classes' annotations
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module, counts


def as_torch(x: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def kernels(record: dict, rng: np.random.Generator, versions: dict) -> None:
    for case, (T, hk, hv, dk, dv, chunk, with_state) in KERNEL_CASES.items():
        inputs = {"query": rng.normal(size=(T, hk, dk)), "key": rng.normal(size=(T, hk, dk)),
                  "value": rng.normal(size=(T, hv, dv)),
                  "g": -rng.uniform(0.0, 2.0, size=(T, hv)),
                  "beta": rng.uniform(0.0, 1.0, size=(T, hv))}
        state = rng.normal(size=(hv, dk, dv)) if with_state else None
        prefix = f"kernel.{case}."
        record |= {prefix + name: value for name, value in inputs.items()}
        record[prefix + "chunk_size"] = np.array(chunk)
        if with_state:
            record[prefix + "initial_state"] = state
        for version, (module, dtype) in versions.items():
            args = [as_torch(inputs[name], dtype)[None] for name in inputs]
            initial = None if state is None else as_torch(state, dtype)[None]
            options = dict(initial_state=initial, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
            for kernel, result in (
                    ("recurrent", module.torch_recurrent_gated_delta_rule(*args, **options)),
                    ("chunked", module.torch_chunk_gated_delta_rule(*args, chunk_size=chunk,
                                                                     **options))):
                record[f"{prefix}{version}_{kernel}_output"] = result[0][0].numpy()
                record[f"{prefix}{version}_{kernel}_state"] = result[1][0].numpy()


def random_weights(module: torch.nn.Module, rng: np.random.Generator) -> dict:
    """Every parameter random (norm weights around 0 or 1 as the norm expects, A_log and
    dt_bias in their usual range), as float64 arrays under transformers' names."""
    weights = {}
    for name, parameter in module.named_parameters():
        shape = tuple(parameter.shape)
        if name.endswith("norm.weight"):
            centre = 1.0 if name == "norm.weight" else 0.0      # gated norm: w; others: 1 + w
            weights[name] = centre + 0.3 * rng.normal(size=shape)
        elif name == "A_log":
            weights[name] = np.log(rng.uniform(0.5, 8.0, size=shape))
        elif name == "dt_bias":
            weights[name] = rng.normal(size=shape)
        else:
            weights[name] = rng.normal(size=shape) / np.sqrt(shape[-1] if len(shape) > 1
                                                             else 1.0)
    return weights


def load_weights(module: torch.nn.Module, weights: dict, dtype) -> torch.nn.Module:
    """The weights in dtype (the module first: loading into its float32 parameters would
    round float64 weights)."""
    module = module.to(dtype)
    module.load_state_dict({name: as_torch(value, dtype) for name, value in weights.items()})
    return module.eval()


def linear_states(cache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies: the cache updates its tensors in place (copy_) at the next step."""
    entry = cache.layers[layer]
    return (entry.conv_states[0][0].numpy().copy(),
            entry.recurrent_states[0][0].numpy().copy())


def layers(record: dict, rng: np.random.Generator, versions: dict) -> None:
    config = Qwen3NextConfig(**LAYER_SIZES)
    torch.manual_seed(SEED)
    deltanet_weights = random_weights(original.Qwen3NextGatedDeltaNet(config, 0), rng)
    attention_weights = random_weights(original.Qwen3NextAttention(config, 1), rng)
    d = config.hidden_size
    x, x_step, x_more = (rng.normal(size=(n, d)) for n in (LAYER_TOKENS, 1, 3))
    record |= {f"deltanet.{name}": value for name, value in deltanet_weights.items()}
    record |= {f"attention.{name}": value for name, value in attention_weights.items()}
    record |= {"deltanet.x": x, "deltanet.x_step": x_step, "deltanet.x_more": x_more,
               "attention.x": x, "attention.x_step": x_step}
    for version, (module, dtype) in versions.items():
        config = module.Qwen3NextConfig(**LAYER_SIZES)
        config._attn_implementation = "sdpa"
        layer = load_weights(module.Qwen3NextGatedDeltaNet(config, 0), deltanet_weights, dtype)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            for part, inputs in (("", x), ("step_", x_step), ("more_", x_more)):
                output = layer(as_torch(inputs, dtype)[None], cache=cache)
                conv, recurrent = linear_states(cache, 0)
                record[f"deltanet.{version}_{part}output"] = output[0].numpy()
                record[f"deltanet.{version}_{part}conv_state"] = conv
                record[f"deltanet.{version}_{part}recurrent_state"] = recurrent
        attention = load_weights(module.Qwen3NextAttention(config, 1), attention_weights, dtype)
        rotary = module.Qwen3NextRotaryEmbedding(config)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            for part, inputs, start in (("", x, 0), ("step_", x_step, LAYER_TOKENS)):
                hidden = as_torch(inputs, dtype)[None]
                positions = torch.arange(start, start + len(inputs))[None]
                output, _ = attention(hidden, rotary(hidden, positions), None, cache=cache)
                record[f"attention.{version}_{part}output"] = output[0].numpy()
    record["layers.config"] = np.array(json.dumps(LAYER_SIZES))


def model(record: dict, versions: dict) -> None:
    prompt = story_sequences(1, PROMPT_SEED)[0, :PROMPT_TOKENS]
    record["model.prompt"] = prompt
    record["model.f64_rows"] = np.array(F64_ROWS)
    ids = torch.from_numpy(prompt)[None]
    saved = original.Qwen3NextForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    for version, (module, dtype) in versions.items():
        hybrid = saved
        if version == "f64":    # the float16 numbers, exact in float32, into the edited module
            hybrid = module.Qwen3NextForCausalLM(saved.config).to(dtype).eval()
            hybrid.load_state_dict(saved.state_dict())
        config = hybrid.config
        cache = DynamicCache(config=config)
        with torch.no_grad():
            logits = hybrid(input_ids=ids, cache=cache, use_cache=True).logits[0]
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                conv, recurrent = linear_states(cache, i)
                if version == "f32":
                    record[f"model.f32_conv_state_{i}"] = conv
                    record[f"model.f32_recurrent_state_{i}"] = recurrent
                elif i == LAST_DELTANET:       # the others in float32 only, to keep it small
                    record[f"model.f64_recurrent_state_{i}"] = recurrent
            elif version == "f32":
                record[f"model.f32_keys_{i}"] = cache.layers[i].keys[0].numpy().copy()
                record[f"model.f32_values_{i}"] = cache.layers[i].values[0].numpy().copy()
        if version == "f64":
            record["model.f64_logits_rows"] = logits[list(F64_ROWS)].numpy()
            continue
        record["model.f32_logits"] = logits.numpy()
        greedy, decode_logits = [], []
        row = logits[-1]
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                greedy.append(int(row.argmax()))
                decode_logits.append(row.numpy())
                row = hybrid(input_ids=torch.tensor([[greedy[-1]]]), cache=cache,
                             use_cache=True).logits[0, -1]
        record["model.greedy"] = np.array(greedy)
        record["model.f32_decode_logits"] = np.stack(decode_logits)


def main() -> None:
    torch.set_num_threads(2)
    transformers_logging.set_verbosity_error()
    module64, counts = float64_module()
    versions = {"f32": (original, torch.float32), "f64": (module64, torch.float64)}
    rng = np.random.default_rng(SEED)
    record: dict[str, np.ndarray] = {}
    kernels(record, rng, versions)
    layers(record, rng, versions)
    model(record, versions)
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **record)
    (OUT / "versions.json").write_text(json.dumps({
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "numpy": np.__version__, "seed": SEED,
        "float64_edits": {f"{old} -> {new}": counts[old] for old, new in FLOAT64_EDITS},
    }, indent=1) + "\n", encoding="utf-8")
    size = (OUT / "reference.npz").stat().st_size
    print(f"{len(record)} arrays, {size:,} bytes in {OUT / 'reference.npz'}")


if __name__ == "__main__":
    main()
