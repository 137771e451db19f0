"""Running transformers for the reference tools, in one place: make_reference.py (GPT-2),
make_llama_reference.py (a tiny Llama, SmolLM2), make_gemma3_reference.py (a tiny Gemma 3, the
real file) and make_precision_reference.py import it (tools/ is on their path, as the scripts'
own folder).

Needs torch and transformers (never part of requirements.txt, `make test` or CI; see
tools/README.md). Every function takes a transformers causal LM in eval mode and token ids
as a list of ints, and gives numpy arrays back:

    logits_of(model, ids)                 (T, V) logits of a full forward pass
    cached_keys_values(model, ids)        per layer, the cached K and V, (kv_heads, T, dh)
    greedy_through_the_cache(model, ids, n)   n greedy tokens, one decode step at a time
    tiny_reference(model, wide, ...)      all of it for a tiny random model, in float32
                                          and float64, as tests/data/*-reference/ holds it
    tiny_model(build, seed, ...)          a tiny random model, its weights spread out
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import transformers


def logits_of(model, ids, **options) -> np.ndarray:
    """(T, V) logits of one forward pass over ids, in the model's dtype; options go to the
    model (logits_to_keep=48: only the last 48 rows)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), **options).logits[0].numpy()


def cache_of(output):
    """transformers 5 names the cache `cache`; 4.x named it `past_key_values`."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def continue_with(model, ids, cache):
    """One forward pass over ids after what the cache holds (a decode step for one id)."""
    try:
        return model(torch.tensor([ids]), cache=cache, use_cache=True)
    except TypeError:
        return model(torch.tensor([ids]), past_key_values=cache, use_cache=True)


def cached_keys_values(model, ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(keys, values): what transformers' own cache holds after ids, one (kv_heads, T, dh)
    array a layer."""
    with torch.no_grad():
        cache = cache_of(model(torch.tensor([ids]), use_cache=True))
    return ([layer.keys[0].numpy() for layer in cache.layers],
            [layer.values[0].numpy() for layer in cache.layers])


def greedy_through_the_cache(model, ids, n_new: int) -> list[int]:
    """n_new greedy tokens after ids, decoded one at a time through transformers' cache by a
    hand-written loop (its `generate` casts logits to float32 even for a float64 model)."""
    with torch.no_grad():
        output = model(torch.tensor([ids]), use_cache=True)
        new = []
        for _ in range(n_new):
            token = int(output.logits[0, -1].argmax())
            new.append(token)
            output = continue_with(model, [token], cache_of(output))
    return new


def versions(seed: int) -> dict:
    """What wrote a reference: torch's, transformers' and Python's versions, and the seed."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "seed": seed}


def save_model(model, folder: Path) -> None:
    """config.json + model.safetensors in the hub's layout (save_pretrained), without the
    generation config it may add."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)


def tiny_reference(model, wide, *, vocab_size: int, seed: int, prompt_lengths,
                   cache_prompt_length: int, new_tokens: int,
                   float64_forwards: dict | None = None) -> dict[str, np.ndarray]:
    """What tests/data/gpt2-reference/ and llama-reference/ record of a tiny random model:
    `model` in float32 and `wide`, the same weights in float64, run with float64_forwards
    in place ({module class: forward}, forwards_replaced: what makes transformers compute
    float64 as written).

    prompt_{i}: random ids (seeded), one prompt of each length; logits_float32_{i} and
    logits_float64_{i}: (T, V) on prompt i; keys_{layer} and values_{layer}: the float64
    cache after cache_prompt, (kv_heads, T, dh); greedy_float64 and greedy_float32:
    new_tokens greedy tokens after cache_prompt.
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in prompt_lengths]
    cache_prompt = rng.integers(0, vocab_size, cache_prompt_length).tolist()
    record = {"cache_prompt": np.array(cache_prompt)}
    for i, prompt in enumerate(prompts):
        record[f"prompt_{i}"] = np.array(prompt)
        record[f"logits_float32_{i}"] = logits_of(model, prompt)
        with forwards_replaced(float64_forwards or {}):
            record[f"logits_float64_{i}"] = logits_of(wide, prompt)
    with forwards_replaced(float64_forwards or {}):
        keys, values = cached_keys_values(wide, cache_prompt)
        greedy_float64 = greedy_through_the_cache(wide, cache_prompt, new_tokens)
    for layer, (k, v) in enumerate(zip(keys, values)):
        record[f"keys_{layer}"], record[f"values_{layer}"] = k, v
    record["greedy_float64"] = np.array(greedy_float64)
    record["greedy_float32"] = np.array(greedy_through_the_cache(model, cache_prompt,
                                                                 new_tokens))
    return record


# ------------------------------------------------------------------------------ tiny models

def seeded_model(build, seed: int):
    """(build() in eval mode with torch seeded by `seed`, a torch generator seeded by seed + 1
    for the weights drawn afterwards): the same model, weight for weight, every time."""
    torch.manual_seed(seed)
    return build().eval(), torch.Generator().manual_seed(seed + 1)


def tiny_model(build, seed: int, *, norm_centre: float, norm_spread: float, scale: float):
    """seeded_model(build, seed), then every norm weight drawn around norm_centre (away from
    its initial value: a norm in the wrong place, or none, shows in the logits) and every
    matrix multiplied by scale (larger weights than the initial ones: the logits spread
    out)."""
    model, generator = seeded_model(build, seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.copy_(norm_centre + norm_spread * torch.randn(tensor.shape,
                                                                     generator=generator))
            elif tensor.ndim == 2:
                tensor.mul_(scale)
    return model


# ------------------------------------------------------------------------------ float64 as written

def rotary_in_dtype(x, position_ids, dim: int, base: float):
    """(cos, sin) of the rotary angles for position_ids, computed in x's dtype (transformers
    computes them in float32 whatever the model's dtype): dim columns turned in pairs at
    rates base ** (-2i / dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim))
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@contextlib.contextmanager
def forwards_replaced(replacements: dict):
    """Inside it, each module class's forward is the one given ({class: forward}); the
    originals are back afterwards, also after an error."""
    saved = {module: module.forward for module in replacements}
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in saved.items():
            module.forward = forward
