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
                   exact=contextlib.nullcontext) -> dict[str, np.ndarray]:
    """What tests/data/gpt2-reference/ and llama-reference/ record of a tiny random model:
    `model` in float32 and `wide`, the same weights in float64 (run inside `exact()`, a
    context that makes transformers compute float64 as written).

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
        with exact():
            record[f"logits_float64_{i}"] = logits_of(wide, prompt)
    with exact():
        keys, values = cached_keys_values(wide, cache_prompt)
        greedy_float64 = greedy_through_the_cache(wide, cache_prompt, new_tokens)
    for layer, (k, v) in enumerate(zip(keys, values)):
        record[f"keys_{layer}"], record[f"values_{layer}"] = k, v
    record["greedy_float64"] = np.array(greedy_float64)
    record["greedy_float32"] = np.array(greedy_through_the_cache(model, cache_prompt,
                                                                 new_tokens))
    return record
