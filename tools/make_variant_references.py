"""Write what transformers' own code computes for the attention variants of notebooks 14-17
(rotary positions, grouped-query attention, latent attention, sliding windows), for
tests/test_variants_reference.py to check kvlib against without torch.

Needs torch and transformers (never part of requirements.txt, `make test` or CI; see
tools/README.md). Run by hand, from the repository root, in the reference environment:

    .venv-reference/bin/python tools/make_variant_references.py

kvlib is not imported: nothing recorded here is computed by the code under test. Inputs
and weights are float64 from a seeded generator (no download); where transformers itself
computes in float32 whatever the model's dtype (its rotary inverse frequencies and cos/sin,
the softmax of its eager attention), the record says so. It writes
tests/data/variants-reference/reference.npz (about 290 KB; a rerun writes the same bytes)
and versions.json (torch, transformers, Python, numpy, seed). Keys are
`section.case.name`; weights keep transformers' names and layout, nn.Linear's (out, in), so
that the test does the mapping to kvlib's (in, out) itself.

- `rotary.{c}`: q and k (T, heads x dim) at `positions`, for a `base` and a head size `dim`.
  `inv_freq` is LlamaRotaryEmbedding's own (transformers computes it in float32, whatever
  the model's dtype) and `angles` = positions x inv_freq in float64. Then:
  `half_q`, `half_k`: Llama's apply_rotary_pos_emb (rotate_half, column i with i + dim/2)
      on float64 cos/sin of those angles;
  `llama_q`: the same, with the cos/sin LlamaRotaryEmbedding.forward returns (computed in
      float32 even for a float64 model: what a Llama in transformers actually uses);
  `interleave_q`, `interleave_k`: DeepSeek-V3's apply_rotary_pos_emb_interleave (pairs
      x[2i], x[2i+1]), float64 cos/sin; its output lists the turned first members of the
      pairs, then the turned second members (the order of rotate_half), which changes no
      score because q and k are reordered alike.
- `gptj.{c}`: GPT-J's create_sinusoidal_positions (base 10000 fixed) + apply_rotary_pos_emb
  (rotate_every_two: the interleaved pairs, kept in place), all in float64 (torch's default
  dtype set to float64 while its table is made): `q`, `positions`, `dim`, `sin`, `cos`,
  `rotated`. The one rotary reference whose frequencies are float64 end to end.
- `gqa.{c}`: LlamaAttention with `kv_heads` = num_key_value_heads < num_attention_heads,
  on `x` (T, d) with the causal mask of create_causal_mask (`mask`, booleans); weights
  `q_proj.weight` ... `o_proj.weight`, rotary `angles` (as above), `output` (T, d) from
  the sdpa path (float64 throughout), `weights` (h, T, T) from the eager path (softmax in
  float32); `repeat_kv_in` (kv, S, dh) and `repeat_kv_out` (h, S, dh): its repeat_kv.
- `mla.{c}`: DeepseekV3Attention (q_lora_rank=None, both paths as for gqa) with
  rope_interleave True and False (`interleave`); its kv_a_layernorm (an RMSNorm on the
  latent, which kvlib leaves out) is replaced by nn.Identity. Weights `q_proj.weight`,
  `kv_a_proj_with_mqa.weight`, `kv_b_proj.weight`, `o_proj.weight`; `scaling` (the
  module's softmax scale), `output`, `weights`.
- `mask.{c}`: create_sliding_window_causal_mask (Mistral's config, eager) as booleans
  `allowed` (T, S) with `query_positions`, `key_positions`, `window`, `sinks`. With a prefix
  (`prefix` > 0), P tokens first go through a DynamicCache, whose sliding layer keeps only
  the last window - 1 keys; the key positions are read back from the keys it returns.
  transformers has no attention-sink mask: with `sinks` > 0, the keys below `sinks` are
  added with its own or_mask_function hook, and_masks(causal_mask_function, kv_idx < sinks).
- `window.{c}`: MistralAttention (sdpa, float64; `kv_heads` K/V heads) with such a mask:
  `output` of the whole sequence and, with a `prefix`, `chunk_output` of the tokens after
  it, once the first `prefix` went through a DynamicCache (sliding layer) with that cache's
  mask.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config, DynamicCache, LlamaConfig, MistralConfig
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.gptj import modeling_gptj
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralRotaryEmbedding

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "variants-reference"
SEED = 1415
# (base, head size, heads, positions): the bases of RoPE's paper (10000), SmolLM2 (100000),
# Llama 3 (500000), and a small one whose slowest pair still turns
ROTARY_CASES = (
    (10000.0, 8, 2, (0, 1, 2, 3, 7, 100)),
    (100000.0, 64, 1, (0, 1, 5, 63, 511, 2047)),
    (500000.0, 16, 3, (3, 4, 9, 1000, 8191)),
    (7.5, 4, 2, (0, 2, 11)),
)
GPTJ_CASES = ((8, (0, 1, 2, 3, 7, 100)), (64, (0, 1, 17, 300, 2047)))
GQA_CASES = ((2, 7), (1, 6))                  # (K/V heads of 4 query heads, tokens)
SIZES = dict(hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=1,
             attn_implementation="eager", attention_dropout=0.0)
MLA_SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, num_hidden_layers=1, attn_implementation="eager",
                 attention_bias=False)
MLA_TOKENS = 7
MASK_CASES = (    # (tokens, window, sinks, prefix through the cache)
    (9, 1, 0, 0), (9, 3, 0, 0), (9, 4, 2, 0), (9, 2, 3, 0), (9, 9, 0, 0), (9, 20, 0, 0),
    (4, 4, 0, 7), (3, 5, 0, 2), (6, 3, 0, 5),
)
WINDOW_CASES = ((12, 4, 0, 7), (10, 3, 2, 0))   # (tokens, window, sinks, prefix)


def rope(base: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": base}}


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, dim/2) angles -> cos, sin (1, T, dim) in float64, laid out as the rotary
    embeddings' forward lays them out: cat(freqs, freqs)."""
    both = torch.cat([angles, angles], dim=-1)[None]
    return both.cos(), both.sin()


def heads_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(T, heads x dim) -> (1, heads, T, dim), the layout of the apply_rotary_* functions."""
    return x.view(x.shape[0], -1, dim).transpose(0, 1)[None]


def tokens_first(x: torch.Tensor) -> np.ndarray:
    """(1, heads, T, dim) -> (T, heads x dim)."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1).numpy()


def rotary_record(generator) -> dict:
    record = {}
    for c, (base, dim, heads, positions) in enumerate(ROTARY_CASES):
        config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim,
                             **rope(base))
        embedding = LlamaRotaryEmbedding(config)
        position_ids = torch.tensor([positions])
        inv_freq = embedding.inv_freq.double()
        angles = position_ids[0, :, None].double() * inv_freq
        q = torch.randn(len(positions), heads * dim, generator=generator, dtype=torch.float64)
        k = torch.randn(len(positions), heads * dim, generator=generator, dtype=torch.float64)
        cos, sin = cos_sin(angles)
        half_q, half_k = apply_rotary_pos_emb(heads_first(q, dim), heads_first(k, dim), cos, sin)
        llama_cos, llama_sin = embedding(q, position_ids)
        llama_q, _ = apply_rotary_pos_emb(heads_first(q, dim), heads_first(k, dim),
                                          llama_cos, llama_sin)
        inter_q, inter_k = apply_rotary_pos_emb_interleave(heads_first(q, dim),
                                                           heads_first(k, dim), cos, sin)
        record |= {f"rotary.{c}.{name}": value for name, value in {
            "base": np.float64(base), "dim": np.int64(dim), "positions": np.array(positions),
            "inv_freq": inv_freq.numpy(), "angles": angles.numpy(),
            "q": q.numpy(), "k": k.numpy(),
            "half_q": tokens_first(half_q), "half_k": tokens_first(half_k),
            "llama_q": tokens_first(llama_q),
            "interleave_q": tokens_first(inter_q), "interleave_k": tokens_first(inter_k),
        }.items()}
    return record


def gptj_record(generator) -> dict:
    record = {}
    for c, (dim, positions) in enumerate(GPTJ_CASES):
        torch.set_default_dtype(torch.float64)    # its inv_freq follows the default dtype
        try:
            table = modeling_gptj.create_sinusoidal_positions(max(positions) + 1, dim)
        finally:
            torch.set_default_dtype(torch.float32)
        assert table.dtype == torch.float64
        sin, cos = torch.split(table[list(positions)], dim // 2, dim=-1)    # (T, dim/2) each
        q = torch.randn(len(positions), 2 * dim, generator=generator, dtype=torch.float64)
        per_head = q.view(1, len(positions), 2, dim)             # GPT-J's (b, T, heads, dim)
        rotated = modeling_gptj.apply_rotary_pos_emb(per_head, sin[None], cos[None])
        record |= {f"gptj.{c}.{name}": value for name, value in {
            "dim": np.int64(dim), "positions": np.array(positions), "q": q.numpy(),
            "sin": sin.numpy(), "cos": cos.numpy(),
            "rotated": rotated.reshape(len(positions), 2 * dim).numpy(),
        }.items()}
    return record


def seeded(module: torch.nn.Module, generator) -> torch.nn.Module:
    """Float64 weights, randn / sqrt(fan-in): the attention rows then range from spread to
    peaked (a row's largest weight from about 0.25 to 1), so that a wrong scale or a wrong
    mask changes the output."""
    module = module.double().eval()
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
                         / tensor.shape[-1] ** 0.5)
    return module


def both_ways(attention, x, angles):
    """Run an attention module on x (1, T, d) with the causal mask twice: with "sdpa"
    (torch's scaled_dot_product_attention, float64 throughout) for its output (T, d), and
    with "eager" for its weights (h, T, T) (eager_attention_forward takes its softmax in
    float32 whatever the model's dtype) and the mask as booleans (T, T), True = seen."""
    positions = torch.arange(x.shape[1])
    results = {}
    for implementation in ("eager", "sdpa"):
        attention.config._attn_implementation = implementation
        mask = create_causal_mask(attention.config, x, None, None, position_ids=positions[None])
        with torch.no_grad():
            results[implementation] = attention(x, cos_sin(angles), mask), mask
    (output, _), _ = results["sdpa"]
    (_, weights), mask = results["eager"]
    return output[0].numpy(), weights[0].numpy(), (mask[0, 0] == 0).numpy()


def model_angles(embedding_class, config, positions: torch.Tensor) -> torch.Tensor:
    """positions x the inverse frequencies of the model's own rotary embedding, in float64:
    (T, dim / 2)."""
    return positions[:, None].double() * embedding_class(config).inv_freq.double()


def gqa_record(generator) -> dict:
    record = {}
    for c, (kv_heads, tokens) in enumerate(GQA_CASES):
        config = LlamaConfig(num_key_value_heads=kv_heads, **SIZES, **rope(10000.0))
        attention = seeded(LlamaAttention(config, layer_idx=0), generator)
        x = torch.randn(1, tokens, config.hidden_size, generator=generator, dtype=torch.float64)
        positions = torch.arange(tokens)
        angles = model_angles(LlamaRotaryEmbedding, config, positions)
        output, weights, mask = both_ways(attention, x, angles)
        group = config.num_attention_heads // kv_heads
        keys = torch.randn(1, kv_heads, tokens, config.head_dim, generator=generator,
                           dtype=torch.float64)
        record |= {f"gqa.{c}.{name}": value for name, value in {
            "kv_heads": np.int64(kv_heads), "x": x[0].numpy(), "angles": angles.numpy(),
            "output": output, "weights": weights, "mask": mask,
            "repeat_kv_in": keys[0].numpy(), "repeat_kv_out": repeat_kv(keys, group)[0].numpy(),
        }.items()}
        record |= {f"gqa.{c}.{name}": tensor.detach().numpy()
                   for name, tensor in attention.state_dict().items()}
    return record


def mla_record(generator) -> dict:
    record = {}
    for c, interleave in enumerate((True, False)):
        config = DeepseekV3Config(rope_interleave=interleave, **MLA_SIZES, **rope(10000.0))
        attention = DeepseekV3Attention(config, layer_idx=0)
        attention.kv_a_layernorm = torch.nn.Identity()      # kvlib has no norm on the latent
        attention = seeded(attention, generator)
        x = torch.randn(1, MLA_TOKENS, config.hidden_size, generator=generator,
                        dtype=torch.float64)
        positions = torch.arange(MLA_TOKENS)
        angles = model_angles(DeepseekV3RotaryEmbedding, config, positions)   # on dr columns
        output, weights, _ = both_ways(attention, x, angles)
        record |= {f"mla.{c}.{name}": value for name, value in {
            "interleave": np.bool_(interleave), "scaling": np.float64(attention.scaling),
            "x": x[0].numpy(), "angles": angles.numpy(), "output": output,
            "weights": weights,
        }.items()}
        record |= {f"mla.{c}.{name}": tensor.detach().numpy()
                   for name, tensor in attention.state_dict().items()}
    return record


def sink_mask(sinks: int):
    """Keys below `sinks`, for queries at or after them: StreamingLLM's sinks, as a mask
    function of transformers' (batch_idx, head_idx, q_idx, kv_idx) kind."""
    return and_masks(causal_mask_function, lambda b, h, q_idx, kv_idx: kv_idx < sinks)


def mistral_config(window: int) -> MistralConfig:
    return MistralConfig(num_key_value_heads=2, sliding_window=window, **SIZES,
                         **rope(10000.0))


def position_coded_cache(config, prefix: int) -> DynamicCache:
    """A DynamicCache (sliding layer) after `prefix` tokens whose keys hold their position."""
    cache = DynamicCache(config=config)
    coded = torch.arange(prefix, dtype=torch.float64)[None, None, :, None].expand(
        1, config.num_key_value_heads, prefix, config.head_dim)
    cache.update(coded, coded, 0)
    return cache


def sliding_mask(config, x, positions, cache, sinks):
    return create_sliding_window_causal_mask(
        config, x, None, cache, position_ids=positions[None],
        or_mask_function=sink_mask(sinks) if sinks else None)


def mask_record() -> dict:
    record = {}
    for c, (tokens, window, sinks, prefix) in enumerate(MASK_CASES):
        config = mistral_config(window)
        positions = torch.arange(prefix, prefix + tokens)
        x = torch.zeros(1, tokens, config.hidden_size, dtype=torch.float64)
        if prefix:
            cache = position_coded_cache(config, prefix)
            mask = sliding_mask(config, x, positions, cache, sinks)
            new = positions.double()[None, None, :, None].expand(
                1, config.num_key_value_heads, tokens, config.head_dim)
            keys, _ = cache.update(new, new, 0)
            key_positions = keys[0, 0, :, 0].long()
        else:
            mask = sliding_mask(config, x, positions, None, sinks)
            key_positions = positions
        record |= {f"mask.{c}.{name}": value for name, value in {
            "window": np.int64(window), "sinks": np.int64(sinks), "prefix": np.int64(prefix),
            "query_positions": positions.numpy(), "key_positions": key_positions.numpy(),
            "allowed": (mask[0, 0] == 0).numpy(),
        }.items()}
    return record


def run_rows(attention, x, angles, sinks: int, rows: slice, cache=None) -> np.ndarray:
    """A sliding-window attention module on the tokens `rows` of x (1, T, d), after what
    the cache holds: (rows, d)."""
    positions = torch.arange(x.shape[1])[rows]
    mask = sliding_mask(attention.config, x[:, rows], positions, cache, sinks)
    with torch.no_grad():
        output, _ = attention(x[:, rows], cos_sin(angles[rows]), mask, cache=cache)
    return output[0].numpy()


def window_record(generator) -> dict:
    record = {}
    for c, (tokens, window, sinks, prefix) in enumerate(WINDOW_CASES):
        assert not (sinks and prefix), "transformers' sliding cache keeps no sinks"
        config = mistral_config(window)
        attention = seeded(MistralAttention(config, layer_idx=0), generator)
        config._attn_implementation = "sdpa"          # float64 throughout (see both_ways)
        x = torch.randn(1, tokens, config.hidden_size, generator=generator, dtype=torch.float64)
        angles = model_angles(MistralRotaryEmbedding, config, torch.arange(tokens))
        record |= {f"window.{c}.{name}": value for name, value in {
            "window": np.int64(window), "sinks": np.int64(sinks), "prefix": np.int64(prefix),
            "kv_heads": np.int64(config.num_key_value_heads), "x": x[0].numpy(),
            "angles": angles.numpy(),
            "output": run_rows(attention, x, angles, sinks, slice(None)),
        }.items()}
        if prefix:            # the sliding cache drops what the window no longer reaches
            cache = DynamicCache(config=config)
            run_rows(attention, x, angles, sinks, slice(0, prefix), cache)
            record[f"window.{c}.chunk_output"] = run_rows(attention, x, angles, sinks,
                                                          slice(prefix, None), cache)
        record |= {f"window.{c}.{name}": tensor.detach().numpy()
                   for name, tensor in attention.state_dict().items()}
    return record


def main() -> None:
    generator = torch.Generator().manual_seed(SEED)
    record = (rotary_record(generator) | gptj_record(generator) | gqa_record(generator)
              | mla_record(generator) | mask_record() | window_record(generator))
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **record)
    (OUT / "versions.json").write_text(json.dumps({
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "numpy": np.__version__, "seed": SEED}, indent=2)
        + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(OUT.iterdir())}
    print(f"wrote {len(record)} arrays to {OUT}: {sizes}")


if __name__ == "__main__":
    main()
