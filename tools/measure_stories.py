"""Measure the two stories models on held-out stories and write measured.json beside each.

Run by hand after tools/train_stories.py, with the tools environment (torch, transformers):

    .venv-reference/bin/python tools/measure_stories.py     # any Python with torch and transformers

Everything is measured on stories the models never saw (kvlib.stories.corpus.HELD_OUT_SEED),
in float32 from the saved float16 weights, the files kvlib loads:
- held-out loss in nats per token (every position of every sequence but the first), against
  a bigram model counted on the training corpus with add-one smoothing;
- greedy continuations of a few story openings, and whether they are sentences of the
  grammar (kvlib.stories.is_grammatical);
- for every head, the mean weight on the previous token, and, where the grammar forces a
  name (the other character, a thing's owner), the weight the query before it puts on the
  earlier occurrences of that name, on those of the other character (the distractor), and
  on the most recent name of either (Repeat.latest): the trained target has no head that
  looks up the right name, but one that looks at the latest name, nearly always the other
  character's, so the answer is found by elimination; and where a song is sung again, the
  weight on the earlier occurrence of the sound that comes next (a copy head);
- how often the argmax is the forced word, for each kind (name, thing, song);
- the loss at positions beyond a window: full attention, a sliding window of W positions,
  and the window plus the first 4 positions (attention sinks), for the window lessons.
The values are deterministic (no timings); tests/test_stories_model.py checks them with
kvlib's numpy code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2LMHeadModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib.stories import StoryTokenizer, first_error, forced_repeats  # noqa: E402
from kvlib.stories.corpus import (  # noqa: E402
    CONTEXT_LENGTH,
    HELD_OUT_SEED,
    TRAINING_SEED,
    story_sequences,
)

MODELS = ROOT / "kvlib" / "models"
NAMES = ("stories", "stories-draft")
HELD_OUT_SEQUENCES = 64
TRAINING_SEQUENCES = 24_000   # as in tools/train_stories.py
BIGRAM_SMOOTHING = 1.0        # add-one
OPENINGS = (
    "Once upon a time, there was a shy girl named Mia. Mia had a red ball.",
    "There once was a brave boy named Leo. Leo got a wooden boat from his grandpa. "
    "Leo had a friend named Nora.",
    "Long ago, in a small village, there lived a curious girl named Zoe. Zoe had a striped "
    "kite. One day, Zoe met a funny boy named Max. Max had a golden drum.",
    "Once upon a time, there was a kind boy named Tom. Tom had a blue hat. Tom lived next to "
    "a girl named Lily. Lily had a silver key. Tom and Lily went to the beach.",
)
GREEDY_TOKENS = 120
WINDOWS = (32, 64)
SINKS = 4


def load(directory: Path) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32,
                                            attn_implementation="eager")
    return model.eval()


def token_losses(model, sequences: np.ndarray) -> np.ndarray:
    """-> (n, T - 1): nats of each next token, for positions 1..T-1."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(sequences)).logits[:, :-1]
        targets = torch.from_numpy(sequences[:, 1:])
        return -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].numpy()


def bigram_losses(training: np.ndarray, sequences: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-k bigram counted on training: -> (n, T - 1) nats of each next token."""
    counts = np.zeros((vocab_size, vocab_size))
    np.add.at(counts, (training[:, :-1].ravel(), training[:, 1:].ravel()), 1)
    counts += BIGRAM_SMOOTHING
    log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
    return -log_p[sequences[:, :-1], sequences[:, 1:]]


def greedy(model, ids: list[int], n_tokens: int) -> list[int]:
    """Greedy decoding by full recomputation, stopped at BOS (a new story) or n_tokens."""
    ids = list(ids)
    new = []
    with torch.no_grad():
        for _ in range(n_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if token == 0:
                break
            ids.append(token)
            new.append(token)
    return new


def forced_accuracy(predicted: np.ndarray, sequences: np.ndarray,
                    tokenizer: StoryTokenizer) -> dict:
    """How often the argmax (predicted: (n, T) ids, each the model's next token after that
    position, with the true story before it) is the word the grammar forces, by kind (name,
    thing, song): {kind: {"count", "accuracy"}}. tools/train_hybrid.py counts the hybrid
    model's with it."""
    accuracy = {}
    for kind in ("name", "thing", "song"):
        right = [predicted[row, repeat.position - 1] == sequence[repeat.position]
                 for row, sequence in enumerate(sequences)
                 for repeat in forced_repeats(tokenizer.tokens(sequence), kind)]
        accuracy[kind] = {"count": len(right), "accuracy": round(float(np.mean(right)), 4)}
    return accuracy


def head_fractions(model, sequences: np.ndarray, tokenizer: StoryTokenizer) -> dict:
    """Per layer and head: mean weight on t-1, and at forced names on the right earlier
    occurrences and on the distractor's; plus how often the model predicts the name."""
    with torch.no_grad():
        output = model(input_ids=torch.from_numpy(sequences), output_attentions=True)
    weights = np.stack([a.numpy() for a in output.attentions], axis=1)  # (n, L, h, T, T)
    predicted = output.logits.argmax(-1).numpy()
    T = sequences.shape[1]
    previous = weights[..., np.arange(1, T), np.arange(T - 1)].mean(axis=(0, 3))  # (L, h)
    on_name, on_distractor, on_latest, latest_is_other, correct = [], [], [], [], []
    for row, sequence in enumerate(sequences):
        for repeat in forced_repeats(tokenizer.tokens(sequence), "name"):
            query = repeat.position - 1
            attention = weights[row, :, :, query]  # (L, h, T)
            on_name.append(attention[..., list(repeat.earlier)].sum(-1))
            on_distractor.append(attention[..., list(repeat.distractor)].sum(-1))
            on_latest.append(attention[..., repeat.latest])
            latest_is_other.append(repeat.latest in repeat.distractor)
            correct.append(predicted[row, query] == sequence[repeat.position])
    on_song = [weights[row, :, :, repeat.position - 1][..., list(repeat.earlier)].sum(-1)
               for row, sequence in enumerate(sequences)
               for repeat in forced_repeats(tokenizer.tokens(sequence), "song")]
    return {
        "forced_accuracy": forced_accuracy(predicted, sequences, tokenizer),
        "song_earlier": np.mean(on_song, axis=0),
        "previous_token": previous,
        "name_earlier": np.mean(on_name, axis=0),
        "name_distractor": np.mean(on_distractor, axis=0),
        "name_latest": np.mean(on_latest, axis=0),
        "latest_name_is_the_other": float(np.mean(latest_is_other)),
        "forced_names": len(correct),
        "forced_name_accuracy": float(np.mean(correct)),
    }


def manual_losses(model, sequences: np.ndarray, window: int | None, sinks: int) -> np.ndarray:
    """(n, T - 1) nats with attention limited to the last `window` positions (all if None)
    plus the first `sinks`: GPT-2's forward written out, so that the mask can be banded."""
    T = sequences.shape[1]
    position = np.arange(T)
    visible = position[None, :] <= position[:, None]
    if window is not None:
        visible &= (position[:, None] - position[None, :] < window) | (position[None, :] < sinks)
    mask = torch.from_numpy(np.where(visible, 0.0, -np.inf).astype(np.float32))
    transformer = model.transformer
    config = model.config
    with torch.no_grad():
        ids = torch.from_numpy(sequences)
        X = transformer.wte(ids) + transformer.wpe(torch.arange(T))
        for block in transformer.h:
            h = block.ln_1(X)
            q, k, v = block.attn.c_attn(h).split(config.n_embd, dim=-1)
            q, k, v = (t.view(len(ids), T, config.n_head, -1).transpose(1, 2) for t in (q, k, v))
            scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + mask
            attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(len(ids), T, -1)
            X = X + block.attn.c_proj(attended)
            X = X + block.mlp(block.ln_2(X))
        logits = model.lm_head(transformer.ln_f(X))[:, :-1]
        targets = ids[:, 1:]
        return -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].numpy()


def table(values: np.ndarray) -> list[list[float]]:
    return [[round(float(v), 4) for v in layer] for layer in values]


def best_head(values: np.ndarray) -> dict:
    layer, head = np.unravel_index(np.argmax(values), values.shape)
    return {"layer": int(layer), "head": int(head), "fraction": round(float(values[layer, head]),
                                                                          4)}


def measure(directory: Path, held_out: np.ndarray, bigram: np.ndarray,
            tokenizer: StoryTokenizer) -> dict:
    model = load(directory)
    losses = token_losses(model, held_out)
    full = manual_losses(model, held_out, None, 0)
    assert np.allclose(full, losses, atol=1e-4), "the written-out forward must equal the model's"
    beyond = {}
    for window in WINDOWS:
        after = slice(window, None)  # targets at positions > window: some context falls out
        beyond[str(window)] = {
            "full": round(float(full[:, after].mean()), 4),
            "window": round(float(manual_losses(model, held_out, window, 0)[:, after].mean()), 4),
            f"window_plus_{SINKS}_sinks": round(float(
                manual_losses(model, held_out, window, SINKS)[:, after].mean()), 4),
        }
    heads = head_fractions(model, held_out, tokenizer)
    continuations = []
    for opening in OPENINGS:
        prompt = tokenizer.encode(opening)
        new = greedy(model, prompt, GREEDY_TOKENS)
        text = tokenizer.decode(prompt + new)
        continuations.append({
            "opening": opening,
            "continuation": tokenizer.decode(new),
            "new_tokens": len(new),
            "grammatical": first_error(text, allow_unfinished=True) is None,
            "error": first_error(text, allow_unfinished=True),
        })
    config = model.config
    return {
        "model": directory.name,
        "config": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                   "n_positions": config.n_positions, "vocab_size": config.vocab_size},
        "parameters": sum(p.numel() for p in model.parameters()),
        "file_bytes": (directory / "model.safetensors").stat().st_size,
        "held_out": {"seed": HELD_OUT_SEED, "sequences": len(held_out),
                     "tokens_scored": int(losses.size)},
        "held_out_loss": round(float(losses.mean()), 4),
        # what tests/test_stories_model.py recomputes with kvlib (16 sequences keep it fast)
        "held_out_loss_first_16": round(float(losses[:16].mean()), 4),
        "bigram_loss": round(float(bigram.mean()), 4),
        "bigram": f"add-{BIGRAM_SMOOTHING:g} smoothing, counted on the {TRAINING_SEQUENCES} "
                  f"training sequences (seed {TRAINING_SEED})",
        "loss_beyond_window": beyond,
        "previous_token_head": best_head(heads["previous_token"]),
        "name_copy_head": {**best_head(heads["name_earlier"]),
                           "on_distractor": None},
        # where a song is sung again: the weight on the earlier occurrence of the sound that
        # comes next, a copy head
        "song_copy_head": best_head(heads["song_earlier"]),
        "latest_name_head": best_head(heads["name_latest"]),
        "latest_name_is_the_other": round(heads["latest_name_is_the_other"], 4),
        "forced_names": heads["forced_names"],
        "forced_name_accuracy": round(heads["forced_name_accuracy"], 4),
        # greedy argmax at each forced word, teacher-forced on held-out stories
        "forced_accuracy": heads["forced_accuracy"],
        "previous_token_by_head": table(heads["previous_token"]),
        "name_earlier_by_head": table(heads["name_earlier"]),
        "name_distractor_by_head": table(heads["name_distractor"]),
        "name_latest_by_head": table(heads["name_latest"]),
        "song_earlier_by_head": table(heads["song_earlier"]),
        "greedy": continuations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=MODELS,
                        help="the directory holding stories/ and stories-draft/")
    parser.add_argument("--only", choices=NAMES, help="measure one model only")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = StoryTokenizer()
    held_out = story_sequences(HELD_OUT_SEQUENCES, HELD_OUT_SEED, CONTEXT_LENGTH)
    training = story_sequences(TRAINING_SEQUENCES, TRAINING_SEED, CONTEXT_LENGTH)
    bigram = bigram_losses(training, held_out, len(tokenizer))
    for name in NAMES:
        if args.only and name != args.only:
            continue
        result = measure(args.models / name, held_out, bigram, tokenizer)
        copy = result["name_copy_head"]
        layer, head = copy["layer"], copy["head"]
        copy["on_distractor"] = result["name_distractor_by_head"][layer][head]
        path = args.models / name / "measured.json"
        path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("_by_head")},
                         indent=1))
        print(f"written {path}")


if __name__ == "__main__":
    main()
