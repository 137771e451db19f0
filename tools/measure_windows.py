"""Measure the story model under sliding windows and attention sinks, for notebook 17, and
write notebooks/data/window_losses.json, which the notebook loads.

numpy and kvlib only (no torch). On held-out stories (kvlib.stories.corpus.HELD_OUT_SEED),
for the predictions made at positions FIRST_POSITION and later, where every window below has
already forgotten something, the loss in nats of:
- the model with its full cache, and with a window of W = 16, 32, 64 alone or with 1 or 4
  sinks (`stories.with_config(window=W, sink_tokens=s)`: the same weights; kvlib.forward
  gives exactly the logits of the ring cache, which notebook 17 checks);
- re-reading the last W tokens afresh for every prediction (`<bos>` + the last W - 1 tokens,
  positions from 0), StreamingLLM's re-computation yardstick, for W = 16 and 32;
- the bigram of notebook 13 (add-one smoothing, counted on the first 400 training
  sequences) and a uniform guess over the vocabulary, log V.
For each row and sequence: the mean loss, how many predictions give the true token less
probability than the uniform guess (a loss above log V), and the mean loss over the
predictions of a word the story forces to repeat from earlier (a name, a thing or a song's
sound: kvlib.stories.forced_repeats) with their count. For three rows, the mean loss at every
position (the notebook's plot). Everything is float64 and deterministic (no
timings); notebook 17 recomputes one row and the bigram, and its tests more
(tests/test_sliding_windows_and_sinks.py).

    python tools/measure_windows.py            # about two minutes on one core
    python tools/measure_windows.py --check    # recompute and compare with the file
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvlib  # noqa: E402
from kvlib import gpt2  # noqa: E402
from kvlib.stories import StoryTokenizer, forced_repeats  # noqa: E402
from kvlib.stories.corpus import HELD_OUT_SEED, TRAINING_SEED, story_sequences  # noqa: E402

MODEL = ROOT / "kvlib" / "models" / "stories"
OUTPUT = ROOT / "notebooks" / "data" / "window_losses.json"
HELD_OUT_SEQUENCES = 64          # as the model card's measurements (measured.json)
FIRST_POSITION = 68              # past the largest window and its sinks, 64 + 4
WINDOWS = (16, 32, 64)
SINKS = (0, 1, 4)
AFRESH_WINDOWS = (16, 32)
BIGRAM_TRAINING_SEQUENCES = 400   # notebook 13's bigram
BY_POSITION = ("full cache", "window 32", "window 32 + 4 sinks")
DECIMALS = 6


def row_name(window: int | None, sinks: int = 0) -> str:
    """'full cache', 'window 32', 'window 32 + 1 sink', 'window 32 + 4 sinks'."""
    if window is None:
        return "full cache"
    return f"window {window}" + ("" if sinks == 0 else f" + {sinks} sink{'s' * (sinks > 1)}")


def model_losses(model: kvlib.Params, sequences: np.ndarray) -> np.ndarray:
    """(n, T) ids -> (n, T - 1): the loss of each next-token prediction, in nats."""
    return np.array([kvlib.next_token_losses(kvlib.forward(model, ids), ids)
                     for ids in sequences])


def afresh_losses(model: kvlib.Params, sequences: np.ndarray, window: int,
                  first: int = FIRST_POSITION) -> np.ndarray:
    """(n, T) ids -> (n, T - 1 - first): each prediction from position `first` on made by
    re-reading `<bos>` and the last window - 1 tokens as a sequence of their own."""
    losses = []
    for ids in sequences:
        row = []
        for query in range(first, len(ids) - 1):
            context = np.concatenate([[0], ids[query - window + 2: query + 1]])
            logits = kvlib.forward(model, context, last_only=True)[0]      # (V,)
            shifted = logits - logits.max()
            row.append(np.log(np.exp(shifted).sum()) - shifted[ids[query + 1]])
        losses.append(row)
    return np.array(losses)


def bigram_losses(training: np.ndarray, sequences: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-one bigram counted on training (m, T), scored on sequences (n, T) -> (n, T - 1)."""
    counts = np.ones((vocab_size, vocab_size))
    np.add.at(counts, (training[:, :-1].ravel(), training[:, 1:].ravel()), 1)
    log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
    return -log_p[sequences[:, :-1], sequences[:, 1:]]


def forced_predictions(sequences: np.ndarray) -> np.ndarray:
    """(n, T) ids -> (n, T - 1) booleans: prediction t (of token t + 1) is of a word the story
    forces to repeat an earlier one (a name, a thing, a song's sound)."""
    tokenizer = StoryTokenizer()
    forced = np.zeros((len(sequences), sequences.shape[1] - 1), dtype=bool)
    for row, ids in enumerate(sequences):
        words = tokenizer.tokens(ids.tolist())
        for kind in ("name", "thing", "song"):
            for repeat in forced_repeats(words, kind):
                forced[row, repeat.position - 1] = bool(repeat.earlier)
    return forced


def summary(losses: np.ndarray, forced: np.ndarray, vocab_size: int) -> dict:
    """Losses (n, k) of the scored predictions, forced (n, k) -> per sequence: the mean loss,
    the predictions worse than a uniform guess over the vocabulary, and the mean loss and
    count of the forced predictions."""
    def rounded(values):
        return [round(float(x), DECIMALS) for x in values]
    return {"per_sequence": rounded(losses.mean(axis=1)),
            "worse_than_uniform": [int(x) for x in (losses > math.log(vocab_size)).sum(axis=1)],
            "forced_per_sequence": rounded([row[mask].mean() for row, mask in zip(losses, forced)]),
            "forced_count": [int(x) for x in forced.sum(axis=1)]}


def measure(n_sequences: int = HELD_OUT_SEQUENCES, afresh: bool = True) -> dict:
    stories = gpt2.load(MODEL, dtype="float64")
    vocab_size = stories.config.vocab_size
    held_out = story_sequences(n_sequences, HELD_OUT_SEED)
    first = FIRST_POSITION
    forced = forced_predictions(held_out)[:, first:]
    rows, by_position = {}, {}
    for window, sinks in [(None, 0)] + [(w, s) for w in WINDOWS for s in SINKS]:
        model = stories if window is None else stories.with_config(window=window,
                                                                    sink_tokens=sinks)
        losses = model_losses(model, held_out)
        name = row_name(window, sinks)
        rows[name] = summary(losses[:, first:], forced, vocab_size)
        if name in BY_POSITION:
            by_position[name] = [round(float(x), DECIMALS) for x in losses.mean(axis=0)]
    for window in AFRESH_WINDOWS if afresh else ():
        rows[f"re-reading the last {window} afresh"] = summary(
            afresh_losses(stories, held_out, window, first), forced, vocab_size)
    training = story_sequences(BIGRAM_TRAINING_SEQUENCES, TRAINING_SEED)
    rows["bigram"] = summary(bigram_losses(training, held_out, vocab_size)[:, first:], forced,
                             vocab_size)
    return {
        "about": "tools/measure_windows.py: the story model's next-token loss (nats) on "
                 "held-out stories, for the predictions made at positions first_position "
                 "and later; notebook 17",
        "model": "kvlib/models/stories",
        "held_out_seed": HELD_OUT_SEED,
        "sequences": n_sequences,
        "first_position": first,
        "predictions_per_sequence": held_out.shape[1] - 1 - first,
        "vocab_size": vocab_size,
        "uniform": round(math.log(vocab_size), DECIMALS),
        "bigram": f"add-one smoothing, counted on the first {BIGRAM_TRAINING_SEQUENCES} "
                  f"training sequences (seed {TRAINING_SEED}), as in notebook 13",
        "afresh": "<bos> and the last W - 1 tokens, read as a sequence of their own with "
                  "positions from 0, for every prediction",
        "forced": "predictions of a word the story forces to repeat an earlier one (a name, "
                  "a thing, a song's sound), kvlib.stories.forced_repeats",
        "rows": rows,
        "by_position": by_position,
    }


def write(data: dict, path: Path = OUTPUT) -> None:
    """One row a line: the file stays small and its diffs readable."""
    lines = json.dumps(data, indent=1).splitlines()
    text, inside_list = [], False
    for line in lines:               # join the lines of each list of numbers into one
        stripped = line.strip()
        if inside_list:
            text[-1] = (text[-1].rstrip() + stripped if stripped.startswith("]")
                        else text[-1] + stripped + " ")
            inside_list = not stripped.startswith("]")
        else:
            text.append(line)
            inside_list = stripped.endswith("[")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="recompute everything and compare with the committed file")
    args = parser.parse_args()
    data = measure()
    if args.check:
        saved = json.loads(OUTPUT.read_text(encoding="utf-8"))
        if saved != json.loads(json.dumps(data)):
            sys.exit(f"{OUTPUT.relative_to(ROOT)} differs from a fresh measurement")
        print(f"{OUTPUT.relative_to(ROOT)}: the same as a fresh measurement")
        return
    write(data)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    for name, row in data["rows"].items():
        counts = np.array(row["forced_count"])
        others = data["predictions_per_sequence"] - counts
        forced_sum = np.dot(row["forced_per_sequence"], counts)
        other = (np.sum(row["per_sequence"]) * data["predictions_per_sequence"] - forced_sum)
        print(f"  {name:36} {np.mean(row['per_sequence']):.3f} nats, "
              f"{sum(row['worse_than_uniform'])} predictions worse than uniform; forced "
              f"{forced_sum / counts.sum():.3f}, other {other / others.sum():.3f}")


if __name__ == "__main__":
    main()
