"""Train the small hybrid model that ships with kvlib: gated DeltaNet layers beside attention.

Run by hand, once, with the tools environment (torch and transformers; never by the tests
or CI, which only read the saved files):

    python tools/train_hybrid.py             # train, save, measure: about 25 minutes
    python tools/train_hybrid.py --quick     # 20 steps on a small corpus, saved under /tmp
    python tools/train_hybrid.py --measure   # measure the saved model again, no training

The model is transformers' Qwen3NextForCausalLM (the architecture of Qwen3-Next and Qwen3.5)
at the size of kvlib's `stories` model: 4 layers, three gated DeltaNet layers then one gated
full-attention layer (Qwen3-Next's pattern, full_attention_interval 4), d_model 96, dense SwiGLU
MLPs and no experts (num_experts = 0 makes every layer's MLP a dense Qwen3NextMLP), tied
embeddings, the 276-word story vocabulary, context 256. The MLP width (232) is chosen so that
the parameter count (496,792) is within 0.4% of the story model's 498,624.

The recipe is the story model's, taken from tools/train_stories.py itself (its train loop,
learning-rate schedule, batch size and seeds): the same 24,000 training sequences
(kvlib.stories.corpus, seed 2024), AdamW (betas 0.9, 0.95, weight decay 0.01), batch 16,
100 warm-up steps then cosine decay to a tenth, 2,500 steps at peak learning rate 3e-3,
gradients clipped at 1, torch seed 0. One torch thread by default (--threads): on this shared
2-core machine, with other jobs running, 2 threads took 1.3 to 17 s a step (threads waiting
for each other) against 0.6 to 0.8 s with one.

Saved with save_pretrained in the model hub layout, float16 like the story model:

    kvlib/models/stories-hybrid/   config.json, model.safetensors, vocab.json, measured.json

then measured from the saved float16 file (in float32, as tools/measure_stories.py measures
the story model): the loss on the same 64 held-out sequences (seed 7), every position but the
first, beside the story model's; how often the argmax is the word the story forces (names,
things, song sounds); greedy continuations of the same four openings. kvlib.deltanet loads the
folder with numpy alone (tests/test_deltanet.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from measure_stories import (  # noqa: E402
    GREEDY_TOKENS,
    OPENINGS,
    forced_accuracy,
    greedy,
    token_losses,
)
from train_stories import (  # noqa: E402
    BATCH_SIZE,
    TORCH_SEED,
    TRAINING_SEQUENCES,
    WARMUP_STEPS,
    Monitor,
    save,
    train,
)

from kvlib.stories import StoryTokenizer, first_error  # noqa: E402
from kvlib.stories.corpus import (  # noqa: E402
    CONTEXT_LENGTH,
    HELD_OUT_SEED,
    TRAINING_SEED,
    story_sequences,
)

MODELS = ROOT / "kvlib" / "models"
NAME = "stories-hybrid"
STEPS = 2500
PEAK_LR = 3e-3
HELD_OUT_SEQUENCES = 64
SIZES = dict(
    hidden_size=96, intermediate_size=232, num_hidden_layers=4,
    # gated attention: 4 query heads sharing 2 K/V heads of 32; rotary on a quarter of each head
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    # gated DeltaNet: 2 query/key heads, each serving 2 of the 4 value heads, all of size 32
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
)


def hybrid_config(tokenizer: StoryTokenizer) -> Qwen3NextConfig:
    """Qwen3-Next's architecture at the story model's size, without experts."""
    return Qwen3NextConfig(
        vocab_size=len(tokenizer), max_position_embeddings=CONTEXT_LENGTH, **SIZES,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=0, mlp_only_layers=[], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, hidden_act="silu", attention_dropout=0.0,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.bos_id, pad_token_id=None,
    )


def parameter_count(model) -> int:
    """Each tensor once: the tied unembedding is the embedding table."""
    return sum(p.numel() for p in model.parameters())


def load(directory: Path):
    return Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def predicted_ids(model, sequences: np.ndarray) -> np.ndarray:
    """(n, T): the model's argmax after each position of each sequence, the true story before
    it."""
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(sequences)).logits.argmax(-1).numpy()


def measure(directory: Path, tokenizer: StoryTokenizer, steps: int = STEPS) -> dict:
    """The saved model, in float32 from its float16 file, on the held-out stories."""
    model = load(directory)
    held_out = story_sequences(HELD_OUT_SEQUENCES, HELD_OUT_SEED, CONTEXT_LENGTH)
    losses = token_losses(model, held_out)
    story = json.loads((MODELS / "stories" / "measured.json").read_text(encoding="utf-8"))
    continuations = []
    for opening in OPENINGS:
        prompt = tokenizer.encode(opening)
        new = greedy(model, prompt, GREEDY_TOKENS)
        text = tokenizer.decode(prompt + new)
        error = first_error(text, allow_unfinished=True)
        continuations.append({"opening": opening, "continuation": tokenizer.decode(new),
                              "new_tokens": len(new), "grammatical": error is None,
                              "error": error})
    config = model.config
    return {
        "model": directory.name,
        "architecture": "Qwen3NextForCausalLM",
        "config": {key: getattr(config, key) for key in (
            "num_hidden_layers", "layer_types", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "num_experts", "max_position_embeddings",
            "vocab_size", "tie_word_embeddings")},
        "parameters": parameter_count(model),
        "file_bytes": (directory / "model.safetensors").stat().st_size,
        "recipe": {"steps": steps, "peak_lr": PEAK_LR, "batch_size": BATCH_SIZE,
                   "warmup_steps": WARMUP_STEPS, "training_sequences": TRAINING_SEQUENCES,
                   "training_seed": TRAINING_SEED, "torch_seed": TORCH_SEED},
        "held_out": {"seed": HELD_OUT_SEED, "sequences": len(held_out),
                     "tokens_scored": int(losses.size)},
        "held_out_loss": round(float(losses.mean()), 4),
        "held_out_loss_first_16": round(float(losses[:16].mean()), 4),
        "stories_model": {"parameters": story["parameters"],
                          "held_out_loss": story["held_out_loss"]},
        "forced_accuracy": forced_accuracy(predicted_ids(model, held_out), held_out, tokenizer),
        "greedy": continuations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="20 steps on a small corpus, saved under /tmp")
    parser.add_argument("--measure", action="store_true",
                        help="only measure the saved model and rewrite its measured.json")
    parser.add_argument("--monitor", action="store_true",
                        help="print held-out loss and forced-word accuracy every 100 steps")
    parser.add_argument("--threads", type=int, choices=(1, 2), default=1,
                        help="torch threads (default %(default)s)")
    parser.add_argument("--out", type=Path, default=MODELS,
                        help="where to save (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()   # the notice that no CUDA kernels are used
    tokenizer = StoryTokenizer()
    directory = (Path("/tmp/kvlib-stories-quick") if args.quick else args.out) / NAME
    begin = time.perf_counter()
    steps = 20 if args.quick else STEPS
    if not args.measure:
        sequences = story_sequences(200 if args.quick else TRAINING_SEQUENCES, TRAINING_SEED)
        print(f"corpus: {sequences.shape[0]} sequences of {sequences.shape[1]} tokens "
              f"({time.perf_counter() - begin:.0f} s)", flush=True)
        torch.manual_seed(TORCH_SEED)
        model = Qwen3NextForCausalLM(hybrid_config(tokenizer))
        print(f"{NAME}: {model.config.layer_types}, {parameter_count(model):,} parameters",
              flush=True)
        started = time.perf_counter()
        train(model, sequences, steps, PEAK_LR, NAME,
              Monitor() if args.monitor else None)
        print(f"{NAME}: trained in {time.perf_counter() - started:.0f} s", flush=True)
        save(model, tokenizer, directory)
        print(f"{NAME}: saved to {directory}", flush=True)
    result = measure(directory, tokenizer, steps)
    path = directory / "measured.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({key: value for key, value in result.items() if key != "greedy"},
                     indent=1))
    print(f"held-out loss {result['held_out_loss']:.4f} nats a token "
          f"({result['parameters']:,} parameters); the story model "
          f"{result['stories_model']['held_out_loss']:.4f} "
          f"({result['stories_model']['parameters']:,})")
    print(f"written {path}; total {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
