"""Train the two small GPT-2-architecture models that ship with kvlib (notebook 12).

Run by hand, once, with the tools environment (torch and transformers; never by the tests
or CI, which only read the saved files):

    python tools/train_stories.py            # both models, about 15 minutes on 2 cores
    python tools/train_stories.py --quick    # a few steps, to try it

The corpus is generated, not downloaded: kvlib.stories.corpus.story_sequences(n,
TRAINING_SEED), children's stories from the grammar in kvlib/stories/grammar.py packed into
sequences of 256 tokens, each story starting with BOS. Both models are transformers'
GPT2LMHeadModel (tanh GeLU "gelu_new", pre-LN, learned positions, tied embeddings, dropout 0),
trained with AdamW from a fixed seed on 2 threads, and saved with save_pretrained in the model
hub layout (config.json + model.safetensors, tensors named transformer.*, stored as float16
to keep each file under 2 MB) plus vocab.json:

    kvlib/models/stories/         the target: 4 layers, d_model 96, 4 heads, context 256
    kvlib/models/stories-draft/   the draft: 1 layer, d_model 64, 4 heads, same context and
                                  vocabulary (for speculative decoding)

tools/measure_stories.py then measures both on held-out stories and writes measured.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib.stories import StoryTokenizer, slot_of_each_word  # noqa: E402
from kvlib.stories.corpus import (  # noqa: E402
    CONTEXT_LENGTH,
    HELD_OUT_SEED,
    TRAINING_SEED,
    story_sequences,
)

MODELS = ROOT / "kvlib" / "models"

# name -> (sizes, training steps, peak learning rate)
RECIPES = {
    "stories": (dict(n_layer=4, n_embd=96, n_head=4), 2500, 3e-3),
    "stories-draft": (dict(n_layer=1, n_embd=64, n_head=4), 1500, 5e-3),
}
BATCH_SIZE = 16
TRAINING_SEQUENCES = 24_000   # 6.1 M tokens; each model sees BATCH_SIZE * steps of them
WARMUP_STEPS = 100
TORCH_SEED = 0


def gpt2_config(sizes: dict, tokenizer: StoryTokenizer) -> GPT2Config:
    """GPT-2's architecture at the given sizes, for the story vocabulary."""
    return GPT2Config(
        vocab_size=len(tokenizer), n_positions=CONTEXT_LENGTH, **sizes,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.bos_id,
    )


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Monitor:
    """Held-out loss, and the accuracy at the words the story forces, printed while training:
    shows when the model learns to copy (a sudden rise, as induction heads form)."""

    GROUPS = {"names": ("other", "owner"), "things": ("own_thing", "any_thing"),
              "song": tuple(f"sung_{i}" for i in range(1, 7))}

    def __init__(self, n_sequences: int = 16):
        tokenizer = StoryTokenizer()
        self.sequences = torch.from_numpy(story_sequences(n_sequences, HELD_OUT_SEED))
        self.positions = {group: [] for group in self.GROUPS}
        for row, sequence in enumerate(self.sequences.numpy()):
            words = tokenizer.tokens(sequence)
            for position, slot in enumerate(slot_of_each_word(words)):
                for group, slots in self.GROUPS.items():
                    if slot in slots:
                        self.positions[group].append((row, position))

    def __call__(self, model: GPT2LMHeadModel) -> str:
        model.eval()
        with torch.no_grad():
            output = model(input_ids=self.sequences, labels=self.sequences)
        model.train()
        report = f"held-out {output.loss.item():.4f}; copied"
        for group, positions in self.positions.items():
            rows, columns = (torch.tensor(x) for x in zip(*positions))
            right = output.logits[rows, columns - 1].argmax(-1) == self.sequences[rows, columns]
            report += f" {group} {right.float().mean().item():.3f}"
        return report


def train(model: GPT2LMHeadModel, sequences: np.ndarray, steps: int, peak: float,
          name: str, monitor: Monitor | None = None) -> list[float]:
    """AdamW on batches drawn from sequences with a seeded generator; -> the loss per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    order = np.random.default_rng(TORCH_SEED).permutation(len(sequences))
    data = torch.from_numpy(sequences)
    losses = []
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        rows = order[(np.arange(BATCH_SIZE) + step * BATCH_SIZE) % len(order)]
        batch = data[rows]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step:5d} loss {np.mean(losses[-100:]):.4f} "
                  f"({time.perf_counter() - start:.0f} s)"
                  + (f"; {monitor(model)}" if monitor else ""), flush=True)
    model.eval()
    return losses


def save(model: GPT2LMHeadModel, tokenizer: StoryTokenizer, directory: Path) -> None:
    """config.json + model.safetensors (float16; a GPT-2's tensors named transformer.*) +
    vocab.json. tools/train_hybrid.py saves the hybrid model with it."""
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(directory)
    model.to(torch.float32)
    (directory / "vocab.json").write_text(tokenizer.to_json() + "\n", encoding="utf-8")
    # save_pretrained may add a generation config; the hub layout kvlib reads needs only these
    for extra in directory.glob("generation_config.json"):
        extra.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="20 steps per model on a small corpus, saved under /tmp")
    parser.add_argument("--only", choices=sorted(RECIPES), help="train one model only")
    parser.add_argument("--steps", type=int, help="override the recipe's number of steps")
    parser.add_argument("--sizes", help="override the sizes: layers,d_model,heads")
    parser.add_argument("--lr", type=float, help="override the peak learning rate")
    parser.add_argument("--monitor", action="store_true",
                        help="print held-out loss and forced-name accuracy every 100 steps")
    parser.add_argument("--out", type=Path, default=MODELS,
                        help="where to save (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = StoryTokenizer()
    begin = time.perf_counter()
    n_sequences = 200 if args.quick else TRAINING_SEQUENCES
    sequences = story_sequences(n_sequences, TRAINING_SEED)
    print(f"corpus: {sequences.shape[0]} sequences of {sequences.shape[1]} tokens "
          f"({time.perf_counter() - begin:.0f} s)", flush=True)
    for name, (sizes, steps, peak) in RECIPES.items():
        if args.only and name != args.only:
            continue
        if args.sizes:
            sizes = dict(zip(("n_layer", "n_embd", "n_head"), map(int, args.sizes.split(","))))
        peak = args.lr or peak
        torch.manual_seed(TORCH_SEED)
        model = GPT2LMHeadModel(gpt2_config(sizes, tokenizer))
        n_parameters = sum(p.numel() for p in model.parameters())
        print(f"{name}: {sizes}, {n_parameters:,} parameters", flush=True)
        started = time.perf_counter()
        steps = 20 if args.quick else args.steps or steps
        train(model, sequences, steps, peak, name, Monitor() if args.monitor else None)
        print(f"{name}: trained in {time.perf_counter() - started:.0f} s", flush=True)
        directory = (Path("/tmp/kvlib-stories-quick") if args.quick else args.out) / name
        save(model, tokenizer, directory)
        print(f"{name}: saved to {directory}", flush=True)
    print(f"total {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
