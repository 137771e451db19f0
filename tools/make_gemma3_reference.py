"""Write what transformers computes on Gemma 3, for kvlib's tests to compare against
(tests/test_gemma3.py, tests/test_sentencepiece.py), into tests/data/gemma3-reference/.

Needs torch, transformers, tokenizers and gguf (never part of requirements.txt, `make test` or
CI). Run by hand from the repository root, after `make gemma3`, with an environment that has
them (one thread):

    OPENBLAS_NUM_THREADS=1 /path/to/reference-venv/bin/python tools/make_gemma3_reference.py

It writes (about 1.4 MB in all):

1. tiny/: a tiny random Gemma3ForCausalLM (4 layers, two of them sliding over 6 positions and
   two global, rotary bases 10,000 and 100, 4 query heads over 2 K/V heads of 16 columns from
   a width of 32, query_pre_attn_scalar 24, norm weights away from 0) saved by transformers'
   save_pretrained (config.json + model.safetensors, float32 numbers), and tiny.npz: its
   logits on a 20-token prompt in float32 and float64, the K and V its cache holds afterwards
   for layer 0 (sliding: transformers keeps the last sliding_window - 1 positions) and layer 2
   (global: every position), and 12 greedy tokens through its cache.

   Where transformers computes in float32 whatever the model's dtype: Gemma3RMSNorm (x.float(),
   weight.float()), the rotary angles and their cos and sin (inv_freq and positions in
   float32), the embedding's scale sqrt(hidden_size) (a float32 buffer), and the eager
   attention's softmax. For the float64 reference this tool swaps in the same formulas
   computed in the input's dtype (marked below) and uses the "sdpa" attention, so that float64
   agreement can be checked to 1e-12 rather than 1e-6.

2. real.npz: Gemma 3 270M's GGUF file loaded by transformers (`from_pretrained(folder,
   gguf_file=...)`, which dequantizes with the gguf package as kvlib does and subtracts the 1
   llama.cpp added to the norm weights, which Gemma3RMSNorm adds back) in float32: for each
   prompt the top 32 logits of every row, the row's log-sum-exp and 512 fixed columns (not the
   262,144-wide rows); one full row (the last of the France prompt); a prompt of 560 tokens,
   of which the last 48 rows (positions 512-559, where the sliding window matters) are kept;
   16 greedy tokens through transformers' cache; each token's loss on an English paragraph.

3. tokenizer.json: the ids transformers' tokenizer built from the same file gives for varied
   texts (English, code, digits, runs of spaces, newlines and tabs, HTML tags, non-Latin
   scripts, emoji, characters that need byte fallback, control tokens typed as text, the
   empty text): its default encode (control tokens in the text become their ids, BOS added)
   and with split_special_tokens=True (typed control tokens read as text). Runs of more than
   31 spaces are tokenized differently by transformers 5.25 (which reads the file's space
   runs as ordinary pieces and merges them pairwise: 33 spaces -> 16 + 17) and by llama.cpp
   and SentencePiece (which cut them out longest first: 31 + 2); kvlib follows llama.cpp, and
   the file records both.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers_runs import (  # noqa: E402  tools/transformers_runs.py
    cache_of,
    forwards_replaced,
    greedy_through_the_cache,
    logits_of,
    rotary_in_dtype,
    save_model,
    tiny_model,
    versions,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib.checkpoints import gemma3  # noqa: E402

OUT = ROOT / "tests" / "data" / "gemma3-reference"
SEED = 2025
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            sliding_window=6, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
            max_position_embeddings=64, tie_word_embeddings=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 100.0}},
            hidden_activation="gelu_pytorch_tanh", pad_token_id=0, bos_token_id=2,
            eos_token_id=1)
TINY_PROMPT_LENGTH = 20
TINY_NEW_TOKENS = 12

FRANCE = "Question: What is the capital of France?\nAnswer:"
PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when Johannes "
             "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted "
             "from those used to make wine. Within fifty years, presses had spread to more "
             "than two hundred cities across Europe, and millions of books had been printed.")
CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
LONG_TOKENS = 560
LONG_ROWS_KEPT = 48
TOP = 32
SAMPLED_COLUMNS = 512
GREEDY_TOKENS = 16

TOKENIZER_TEXTS = [
    FRANCE, PARAGRAPH, CODE, "Hello world", "Hello, world! How are you?",
    "I'll say it's done, they've gone", "In 2024, 3.14159 x 12 = 37.7; 1,000,000 and 007",
    "phone: +1 (555) 010-9999", "https://example.com/a/b?c=1&d=2",
    "a  b   c    d", "   leading spaces", "trailing spaces   ", "x" + " " * 31 + "y",
    "x" + " " * 32 + "y", " " * 33 + "x", "x" + " " * 40 + "y", " " * 70, "\n", "\n\n",
    "line one\nline two\n\n\nline five", "\n" * 35 + "end", "\t\tindented\twith\ttabs",
    "  \n  \t \n", "<b>bold</b> <i>it</i> <code>x = 1</code>",
    "<table><tr><td>1</td></tr></table> <h1>Title</h1> <div><span>s</span></div>",
    "<blockquote>q</blockquote><s>struck</s><sub>2</sub><sup>3</sup>",
    "Привет, мир! Как дела?", "日本語のテキストです。", "中文文本，包含标点。", "مرحبا بالعالم",
    "नमस्ते दुनिया", "안녕하세요 세계", "Ελληνικά γράμματα", "naïve café résumé ümlaut ß ﬁ",
    "😀👍🏽 🧑\u200d💻 🇫🇷 🫠", "rare characters: 𠀀 ꙮ 𓀀 ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "control byte \x04 and \x7f",
    "private use \ue000", "typed ▁ lower one eighth block", "<0x41> is not a byte token",
    "<bos>hi<eos>", "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<pad><mask>[multimodal]<start_of_image>", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "QmFzZTY0IGVuY29kZWQgdGV4dCB3aXRob3V0IGFueSBzcGFjZXMgYXQgYWxs", "",
]


# ------------------------------------------------------------------------------ float64 as written

def rms_norm_in_input_dtype(self, x):
    # Gemma3RMSNorm computes in float32; the same formula in the input's dtype
    output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return output * (1.0 + self.weight.to(x.dtype))


def rotary_in_input_dtype(self, x, position_ids, layer_type):
    # Gemma3RotaryEmbedding computes the angles in float32; the same formula in x's dtype
    return rotary_in_dtype(x, position_ids, getattr(self, f"{layer_type}_inv_freq").shape[0] * 2,
                           self.config.rope_parameters[layer_type]["rope_theta"])


FLOAT64_FORWARDS = {modeling_gemma3.Gemma3RMSNorm: rms_norm_in_input_dtype,
                    modeling_gemma3.Gemma3RotaryEmbedding: rotary_in_input_dtype}
"""The forwards that make Gemma3RMSNorm and Gemma3RotaryEmbedding compute in the input's dtype
(forwards_replaced)."""


# ------------------------------------------------------------------------------ 1. a tiny Gemma 3

def build_tiny() -> Gemma3ForCausalLM:
    # norm weights w away from 0 (Gemma's norms scale by 1 + w): 1 + w away from 1
    return tiny_model(lambda: Gemma3ForCausalLM(Gemma3TextConfig(**TINY)), SEED,
                      norm_centre=0.0, norm_spread=0.3, scale=10.0)


def write_tiny() -> None:
    model = build_tiny()
    save_model(model, OUT / "tiny")
    prompt = np.random.default_rng(SEED).integers(3, TINY["vocab_size"],
                                                  TINY_PROMPT_LENGTH).tolist()
    record = {"prompt": np.array(prompt), "logits_float32": logits_of(model, prompt)}
    wide = build_tiny().double()
    wide.config._attn_implementation = "sdpa"   # eager's softmax is float32 even for float64
    with torch.no_grad():                        # the scale as a float64, not a float32's
        wide.model.embed_tokens.embed_scale.copy_(
            torch.tensor(math.sqrt(TINY["hidden_size"]), dtype=torch.float64))
    with forwards_replaced(FLOAT64_FORWARDS):
        with torch.no_grad():
            output = wide(torch.tensor([prompt]), use_cache=True)
        record["logits_float64"] = output.logits[0].numpy()
        cache = cache_of(output)
        for layer in (0, 2):
            record[f"keys_{layer}"] = cache.layers[layer].keys[0].numpy()      # (kv, S, dh)
            record[f"values_{layer}"] = cache.layers[layer].values[0].numpy()
        record["greedy_float64"] = np.array(greedy_through_the_cache(wide, prompt,
                                                                     TINY_NEW_TOKENS))
    np.savez_compressed(OUT / "tiny.npz", **record)


# ------------------------------------------------------------------------------ 2. the real file

def compact(logits: np.ndarray, columns: np.ndarray) -> dict:
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return {"top_ids": top, "top_logits": np.take_along_axis(logits, top, axis=1),
            "logsumexp": logits.max(axis=1) + np.log(np.exp(shifted).sum(axis=1)),
            "sampled": logits[:, columns]}


def long_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return topics["assignment"] + topics["for"]


def write_real(tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    path = gemma3.find_gguf()
    if path is None:
        raise SystemExit("Gemma 3's GGUF file is missing: run `make gemma3` first")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    columns = np.random.default_rng(SEED).choice(model.config.vocab_size, SAMPLED_COLUMNS,
                                                 replace=False)
    record = {"sampled_columns": columns}
    for name, text in (("france", FRANCE), ("paragraph", PARAGRAPH), ("code", CODE)):
        ids = tokenizer.encode(text)
        logits = logits_of(model, ids)
        record[f"{name}_ids"] = np.array(ids)
        record |= {f"{name}_{key}": value for key, value in compact(logits, columns).items()}
        if name == "france":
            record["france_last_row"] = logits[-1]
        if name == "paragraph":
            log_probabilities = torch.log_softmax(torch.tensor(logits[:-1], dtype=torch.float64),
                                                  dim=-1).numpy()
            record["paragraph_losses"] = -log_probabilities[np.arange(len(ids) - 1), ids[1:]]
    ids = tokenizer.encode(long_text())[:LONG_TOKENS]
    assert len(ids) == LONG_TOKENS
    record["long_ids"] = np.array(ids)
    logits = logits_of(model, ids, logits_to_keep=LONG_ROWS_KEPT)
    record |= {f"long_{key}": value for key, value in compact(logits, columns).items()}
    france = record["france_ids"].tolist()
    record["france_greedy"] = np.array(greedy_through_the_cache(model, france, GREEDY_TOKENS))
    np.savez_compressed(OUT / "real.npz", **record)
    print("greedy after the France prompt:", repr(tokenizer.decode(record["france_greedy"])))
    print("paragraph:", len(record["paragraph_ids"]), "tokens, mean loss",
          record["paragraph_losses"].mean())


# ------------------------------------------------------------------------------ 3. the tokenizer

def write_tokenizer(tokenizer) -> None:
    entries = [{"text": text, "ids": tokenizer.encode(text),
                "ids_typed_control_as_text": tokenizer.encode(text, split_special_tokens=True)}
               for text in TOKENIZER_TEXTS]
    (OUT / "tokenizer.json").write_text(json.dumps(entries, ensure_ascii=False, indent=1) + "\n",
                                        encoding="utf-8")


def main() -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    path = gemma3.find_gguf()
    if path is None:
        raise SystemExit("Gemma 3's GGUF file is missing: run `make gemma3` first")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    write_tiny()
    write_tokenizer(tokenizer)
    write_real(tokenizer)
    (OUT / "versions.json").write_text(json.dumps(
        versions(SEED) | {"gguf_sha256": gemma3.GGUF_SHA256}, indent=2) + "\n")
    sizes = {str(p.relative_to(OUT)): p.stat().st_size for p in sorted(OUT.rglob("*"))
             if p.is_file()}
    print(f"wrote {OUT}: {sizes}, {sum(sizes.values()):,} bytes")


if __name__ == "__main__":
    main()
