"""Write what transformers computes on Llama-architecture models, for kvlib's tests to compare
against (tests/test_llama_reference.py, tests/test_smollm2.py, tests/test_smollm2_tokenizer.py).

Needs torch, transformers and tokenizers (never part of requirements.txt, `make test` or CI;
`make test-reference` builds .venv-reference with them). Run by hand, from the repository root,
after `make smollm2`:

    .venv-reference/bin/python tools/make_llama_reference.py

Two references, each a small committed folder:

1. tests/data/llama-reference/: a tiny random LlamaForCausalLM (3 layers, d 32, 4 query heads,
   2 K/V heads, SwiGLU 80, RMSNorm gains away from 1, rope_theta 10000, tied embeddings) saved by
   transformers' save_pretrained (the hub's layout: config.json + model.safetensors, the half
   rotary pairing), and reference.npz: its logits on prompts in float32 and float64, what its
   cache holds after a prompt, and greedy tokens through its cache. transformers' float64 mode
   runs LlamaRMSNorm in float32 and computes the rotary angles in float32; for the float64
   reference this tool swaps in the same formulas computed in the input's dtype (marked below),
   so that float64 agreement can be checked to 1e-9 rather than 1e-5.

2. tests/data/smollm2-reference/: SmolLM2-135M-Instruct's GGUF file loaded by transformers
   (`from_pretrained(folder, gguf_file=...)`, which dequantizes with the gguf package, as kvlib
   does, and puts q and k rows back in the hub's order): float32 logits on prompts (the top 32
   of every row, the row's log-sum-exp and 256 fixed columns, so that the file stays small),
   layer 0's and layer 29's cached K and V after a prompt, 30 greedy tokens, and token ids of
   varied texts from two tokenizers: transformers' tokenizer built from the GGUF (in
   transformers 5.24 a plain GPT-2 byte-level BPE: it does not cut numbers into digits, because
   its table of GGUF pre-tokenizers has no "smollm" entry), and the pipeline of SmolLM2's
   tokenizer.json on the hub (a Digits step with individual_digits, then GPT-2's ByteLevel),
   built with the tokenizers library from the GGUF's vocabulary and merges.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers_runs import (  # noqa: E402  tools/transformers_runs.py
    cached_keys_values,
    greedy_through_the_cache,
    logits_of,
    rotary_in_dtype,
    save_model,
    tiny_model,
    tiny_reference,
    versions,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib.checkpoints import smollm2  # noqa: E402

LLAMA_OUT = ROOT / "tests" / "data" / "llama-reference"
SMOLLM2_OUT = ROOT / "tests" / "data" / "smollm2-reference"
SEED = 2023
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            hidden_act="silu", attention_bias=False, mlp_bias=False,
            bos_token_id=0, eos_token_id=1, pad_token_id=None)
PROMPT_LENGTHS = (1, 5, 17, 64)
CACHE_PROMPT_LENGTH = 9
NEW_TOKENS = 20

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
TOKENIZER_TEXTS = [
    "The capital of France is", "Hello, world! How are you?", "In 2024, 3.14159 x 12 = 37.7",
    "phone: +1 (555) 010-9999", "½ cup, Ⅻ o'clock, x² + y³, ١٢٣ and ٤٥", "naïve café résumé",
    "Привет, мир! 日本語のテキスト 😀👍🏽", "  leading spaces\tand\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<repo_name>c",
    "def f(x):\n    return x ** 2  # square\n", "I'll say it's done, they've gone",
    "https://example.com/a/b?c=1&d=2", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "control byte \x04 in text", "ümlaut ÄÖÜ ß ﬁ", "",
]
SAMPLED_COLUMNS = 256
TOP = 32


# ------------------------------------------------------------------------------ float64 as written

def rms_norm_in_input_dtype(self, hidden_states):
    # transformers' LlamaRMSNorm casts to float32; the same formula in the input's dtype
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotary_in_input_dtype(self, x, position_ids):
    # transformers computes the rotary angles in float32; the same formula in x's dtype
    return rotary_in_dtype(x, position_ids, self.inv_freq.shape[0] * 2,
                           self.config.rope_parameters["rope_theta"])


FLOAT64_FORWARDS = {modeling_llama.LlamaRMSNorm: rms_norm_in_input_dtype,
                    modeling_llama.LlamaRotaryEmbedding: rotary_in_input_dtype}
"""The forwards that make LlamaRMSNorm and LlamaRotaryEmbedding compute in the input's dtype
(forwards_replaced)."""


# ------------------------------------------------------------------------------ 1. a tiny Llama

def build_tiny() -> LlamaForCausalLM:
    return tiny_model(lambda: LlamaForCausalLM(LlamaConfig(**TINY)), SEED,
                      norm_centre=1.0, norm_spread=0.2, scale=8.0)


def write_tiny() -> None:
    model = build_tiny()
    save_model(model, LLAMA_OUT)
    wide = build_tiny().double()
    wide.config._attn_implementation = "sdpa"   # eager's softmax is float32 even for float64
    record = tiny_reference(model, wide, vocab_size=TINY["vocab_size"], seed=SEED,
                            prompt_lengths=PROMPT_LENGTHS,
                            cache_prompt_length=CACHE_PROMPT_LENGTH, new_tokens=NEW_TOKENS,
                            float64_forwards=FLOAT64_FORWARDS)
    np.savez_compressed(LLAMA_OUT / "reference.npz", **record)
    (LLAMA_OUT / "versions.json").write_text(json.dumps(versions(SEED), indent=2) + "\n")


# ------------------------------------------------------------------------------ 2. SmolLM2

def hub_style_tokenizer(path: Path):
    """SmolLM2's tokenizer.json pipeline (Digits, then GPT-2's ByteLevel), from the GGUF's
    vocabulary and merges, with its 17 control tokens as special tokens."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == 3])
    return tokenizer


def compact_logits(logits: np.ndarray, columns: np.ndarray) -> dict:
    top = np.argsort(-logits, axis=1)[:, :TOP]
    shifted = logits - logits.max(axis=1, keepdims=True)
    return {"top_ids": top, "top_logits": np.take_along_axis(logits, top, axis=1),
            "logsumexp": logits.max(axis=1) + np.log(np.exp(shifted).sum(axis=1)),
            "sampled": logits[:, columns]}


def write_smollm2() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2.find_gguf()
    if path is None:
        raise SystemExit("SmolLM2's GGUF file is missing: run `make smollm2` first")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    from_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hub_style = hub_style_tokenizer(path)
    SMOLLM2_OUT.mkdir(parents=True, exist_ok=True)
    columns = np.random.default_rng(SEED).choice(model.config.vocab_size, SAMPLED_COLUMNS,
                                                 replace=False)
    record = {"sampled_columns": columns}
    for i, text in enumerate(SMOLLM2_PROMPTS):
        ids = hub_style.encode(text).ids
        record[f"prompt_{i}"] = np.array(ids)
        for name, array in compact_logits(logits_of(model, ids), columns).items():
            record[f"{name}_{i}"] = array
    cache_prompt = record["prompt_1"].tolist()
    keys, values = cached_keys_values(model, cache_prompt)
    for layer in (0, model.config.num_hidden_layers - 1):
        record[f"keys_{layer}"], record[f"values_{layer}"] = keys[layer], values[layer]
    record["greedy_prompt"] = record["prompt_0"]
    record["greedy"] = np.array(greedy_through_the_cache(model, record["prompt_0"].tolist(), 30))
    record["chat_greedy"] = np.array(greedy_through_the_cache(model, cache_prompt, 30))
    np.savez_compressed(SMOLLM2_OUT / "reference.npz", **record)
    texts = [{"text": text, "hub_pipeline": hub_style.encode(text).ids,
              "transformers_from_gguf": from_gguf.encode(text, add_special_tokens=False)}
             for text in TOKENIZER_TEXTS]
    (SMOLLM2_OUT / "tokenizer.json").write_text(
        json.dumps(texts, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    chat = [{"role": "user", "content": "What is 2+2?"}]
    rendered = {"messages": chat,
                "with_generation_prompt": from_gguf.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=True),
                "without": from_gguf.apply_chat_template(chat, tokenize=False,
                                                         add_generation_prompt=False),
                "with_system": from_gguf.apply_chat_template(
                    [{"role": "system", "content": "Be brief."}] + chat, tokenize=False,
                    add_generation_prompt=True)}
    (SMOLLM2_OUT / "chat_template.json").write_text(
        json.dumps(rendered, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (SMOLLM2_OUT / "versions.json").write_text(json.dumps(
        versions(SEED) | {"gguf_sha256": smollm2.GGUF_SHA256}, indent=2) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    write_tiny()
    write_smollm2()
    for folder in (LLAMA_OUT, SMOLLM2_OUT):
        sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
        print(f"wrote {folder}: {sizes}")


if __name__ == "__main__":
    main()
