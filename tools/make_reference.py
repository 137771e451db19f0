"""Write what transformers computes on a small GPT-2, for kvlib's tests to compare against.

Needs torch and transformers (never part of requirements.txt, `make test` or CI; see
tools/README.md). Run by hand, from the repository root:

    /path/to/venv-with-torch/bin/python tools/make_reference.py

It builds `GPT2LMHeadModel` from a small `GPT2Config` with seeded random weights (no
download), gives its layer norms and biases non-trivial values (a fresh GPT-2 has unit gains
and zero biases, which would hide a norm or a bias applied in the wrong place), saves it with
`save_pretrained` into tests/data/gpt2-reference/ (config.json + model.safetensors, names
prefixed `transformer.`), and records in reference.npz:

- `logits_float64_{i}` and `logits_float32_{i}`: full-forward logits (T, V) on prompt i
  (`prompt_{i}`), the model in float64 and in float32;
- `keys_{layer}` and `values_{layer}`: what transformers' own cache holds after
  `cache_prompt`, (heads, T, head_dim), float64;
- `greedy_float64` and `greedy_float32`: 20 greedy tokens after `cache_prompt`, decoded one
  at a time through transformers' cache by a hand-written loop (its `generate` casts logits
  to float32 even for a float64 model).

The files are small (about 200 KB) and committed; tests/test_gpt2_reference.py loads the
checkpoint with kvlib.gpt2.load and must match these numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers_runs import save_model, seeded_model, tiny_reference, versions

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gpt2-reference"
SEED = 2019
SIZES = dict(vocab_size=300, n_positions=48, n_embd=32, n_layer=3, n_head=4,
             layer_norm_epsilon=1e-5, activation_function="gelu_new",
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
             bos_token_id=0, eos_token_id=0)
PROMPT_LENGTHS = (1, 5, 17, 48)
CACHE_PROMPT_LENGTH = 7
NEW_TOKENS = 20


def build_model() -> GPT2LMHeadModel:
    model, generator = seeded_model(lambda: GPT2LMHeadModel(GPT2Config(**SIZES)), SEED)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif ".ln_" in name and name.endswith("weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
        # larger weights than GPT-2's 0.02, so that the logits are far from uniform
        for name, tensor in model.named_parameters():
            if name.endswith("weight") and tensor.ndim == 2:
                tensor.mul_(10.0)
    return model


def main() -> None:
    model = build_model()
    save_model(model, OUT)
    wide = build_model().double()    # the same weights (same seeds), computed in float64
    record = tiny_reference(model, wide, vocab_size=SIZES["vocab_size"], seed=SEED,
                            prompt_lengths=PROMPT_LENGTHS,
                            cache_prompt_length=CACHE_PROMPT_LENGTH, new_tokens=NEW_TOKENS)
    np.savez_compressed(OUT / "reference.npz", **record)
    (OUT / "versions.json").write_text(json.dumps(versions(SEED), indent=2) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(OUT.iterdir())}
    print(f"wrote {OUT}: {sizes}")


if __name__ == "__main__":
    main()
