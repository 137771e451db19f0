"""What the state_layers lesson (a cache that does not grow) loads instead of measuring in a cell:
how far back each trained story model can copy, and the token ids of a chat-like workload.

    PYTHONPATH=$PWD .venv/bin/python tools/measure_state_layers.py

writes notebooks/data/state_layers.json.

1. The copy task, on the two trained story models (float32, as shipped): `stories` (4 attention
   layers) and `stories-hybrid` (3 gated DeltaNet layers, 1 attention layer). Where a story's
   song is sung again, the grammar forces each sound to be the one sung before: a model that can
   copy from its context predicts it (argmax of the logits one position before). Counted at
   every such sound, against the distance back to the sound's latest earlier occurrence:
   - "natural": the 64 held-out sequences of kvlib/models/README.md (story_sequences(64, 7));
     the grammar puts the copies 10 to 59 positions back;
   - "stretched": single stories (seeds 0 .. TRIALS - 1) with whole filler sentences inserted
     before the first sentence that sings the song again (sentences of the grammar with no
     name and no song in them), to push the copy further back, up to the context of 256;
     and the same with the sung song replaced by another random song (nothing to copy: the
     chance level a model reaches by guessing a sound).
2. The chat workload of the engine lesson (kvlib.serving.workloads: SmolLM2's chat template,
   one system message, eight questions) as token ids, both as eight separate requests and as
   one conversation of eight turns (each turn's prompt holds the turns before it, with the
   short replies in CONVERSATION_REPLIES): the lesson counts prefix hits on them for several
   snapshot spacings without loading SmolLM2's tokenizer.

3. The copy task on Gemma 3 270M (15 layers that see 512 positions, 3 global layers), which has
   no song to copy but, as a real language model, copies a passage it has seen: <bos>, a
   passage of GEMMA_PASSAGE tokens drawn at random from the tokens of story text, filler (story
   text, Gemma's tokenizer), the passage again. Counted at each token of the repeat after its
   first; chance: the same with a second random passage in the repeat. Filler lengths go past
   the 512-position window, where only the 3 global layers can still see the passage. Needs
   Gemma 3's file (make gemma3); about 2 s a 700-token prompt here.

Runs in about five minutes with one BLAS thread (here, on a busy machine).
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache
from pathlib import Path

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvlib  # noqa: E402
from kvlib import stories  # noqa: E402
from kvlib.checkpoints.hybrid import load_hybrid  # noqa: E402
from kvlib.hybrid import hybrid_forward  # noqa: E402
from kvlib.serving import workloads  # noqa: E402
from kvlib.stories import grammar  # noqa: E402
from kvlib.stories.corpus import story_sequences  # noqa: E402

OUTPUT = ROOT / "notebooks" / "data" / "state_layers.json"
FILLERS = (0, 16, 32, 64, 96, 128, 160)
"""Words of filler sentences inserted (at most: whole sentences only)."""
TRIALS = 24
NATURAL_BINS = ((10, 20), (20, 40), (40, 60))
CONVERSATION_REPLIES = ["56.", "Mars.", "Tokyo.", "Eight.", "Blue.", "Bonjour.",
                        "Johannes Gutenberg, in Mainz.", "William Shakespeare."]
"""The assistant's replies between the conversation's turns (fixed text: the workload's shape,
not a model's output)."""
NOT_IN_FILLER = set(grammar.GIRL_NAMES + grammar.BOY_NAMES + grammar.SONG_WORDS) | {"song", "sang"}


def sentences(words: list[str]) -> list[list[str]]:
    """A story's words cut after each full stop."""
    cut, current = [], []
    for word in words:
        current.append(word)
        if word == ".":
            cut.append(current)
            current = []
    return cut


@lru_cache(maxsize=1)
def neutral_sentences() -> list[list[str]]:
    """Sentences of the grammar with no name and no song ("it was a cold day ."), sorted."""
    rng = np.random.default_rng(99)
    found = {tuple(sentence) for _ in range(200)
             for sentence in sentences(grammar.generate_story_words(rng))
             if not set(sentence) & NOT_IN_FILLER}
    return [list(sentence) for sentence in sorted(found)]


def stretched_story(seed: int, filler: int, copy: bool = True):
    """(ids, positions of the sung sounds): story `seed` up to the first sentence that sings
    its song again, whole neutral sentences of at most `filler` words inserted before that
    sentence, then the sentence (with another random song if copy is False)."""
    rng = np.random.default_rng(seed)
    story = sentences(grammar.generate_story_words(rng))
    made = next(i for i, s in enumerate(story) if "made" in s and "song" in s)
    sung = next(i for i, s in enumerate(story) if i > made and "sang" in s)
    inserted: list[str] = []
    neutral = neutral_sentences()
    while True:
        sentence = neutral[rng.integers(len(neutral))]
        if len(inserted) + len(sentence) > filler:
            break
        inserted += sentence
    words = [grammar.BOS] + [w for s in story[:sung] for w in s] + inserted
    sentence = list(story[sung])
    if not copy:
        other = iter(rng.choice(grammar.SONG_WORDS, grammar.SONG_LENGTH, replace=False))
        sentence = [next(other) if w in grammar.SONG_WORDS else w for w in sentence]
    start = len(words)
    words += sentence
    if len(words) > 256:
        raise ValueError(f"story {seed} with {filler} filler words is {len(words)} long")
    tokenizer = stories.load_tokenizer()
    ids = [tokenizer.vocabulary.index(w) for w in words]
    return ids, [start + j for j, w in enumerate(sentence) if w in grammar.SONG_WORDS]


def latest_distance(ids: list[int], position: int) -> int:
    """Positions back from `position` to the latest earlier occurrence of its word."""
    return position - max(j for j in range(position) if ids[j] == ids[position])


def predicted(params, forward, ids) -> np.ndarray:
    """The argmax at every position: what the model writes next. (T,)"""
    return np.argmax(forward(params, np.asarray(ids)), axis=-1)


def models() -> dict:
    return {"stories": (stories.load_model("stories", "float32"), kvlib.forward),
            "stories-hybrid": (load_hybrid("stories-hybrid", "float32"), hybrid_forward)}


def measure_natural(name, params, forward) -> list[dict]:
    tokenizer = stories.load_tokenizer()
    found = []                                   # (distance back, copied)
    for sequence in story_sequences(64, 7):
        ids = sequence.tolist()
        guesses = predicted(params, forward, ids)
        for repeat in grammar.forced_repeats(tokenizer.tokens(ids), "song"):
            if repeat.earlier:
                found.append((repeat.position - max(repeat.earlier),
                              bool(guesses[repeat.position - 1] == ids[repeat.position])))
    rows = []
    for low, high in NATURAL_BINS:
        inside = [hit for distance, hit in found if low <= distance < high]
        rows.append({"from": low, "to": high, "count": len(inside),
                     "copied": sum(inside) / len(inside)})
    print(name, "natural", rows, flush=True)
    return rows


def measure_stretched(name, params, forward) -> list[dict]:
    rows = []
    for filler in FILLERS:
        hits, count, distances, chance = 0, 0, [], 0
        for seed in range(TRIALS):
            for copy in (True, False):
                ids, positions = stretched_story(seed, filler, copy)
                guesses = predicted(params, forward, ids)
                right = sum(int(guesses[p - 1] == ids[p]) for p in positions)
                if copy:
                    hits, count = hits + right, count + len(positions)
                    distances += [latest_distance(ids, p) for p in positions]
                else:
                    chance += right
        rows.append({"filler": filler, "count": count, "mean_distance": float(np.mean(distances)),
                     "longest_distance": int(max(distances)), "copied": hits / count,
                     "chance": chance / count})
        print(name, rows[-1], flush=True)
    return rows


def measure_copying() -> dict:
    return {name: {"natural": measure_natural(name, *model),
                   "stretched": measure_stretched(name, *model)}
            for name, model in models().items()}


def example_row() -> dict:
    """One stretched trial the notebook recomputes: its ids, the sung positions, and how many
    of them each model copies."""
    ids, positions = stretched_story(0, 64)
    return {"seed": 0, "filler": 64, "ids": ids, "positions": positions,
            "copied": {name: sum(int(predicted(params, forward, ids)[p - 1] == ids[p])
                                 for p in positions)
                       for name, (params, forward) in models().items()}}


GEMMA_PASSAGE = 16
GEMMA_FILLERS = (0, 64, 256, 448, 600, 1000, 2000)
GEMMA_TRIALS = 6


@lru_cache(maxsize=1)
def gemma():
    from kvlib.checkpoints.gemma3 import gemma3_tokenizer, load_gemma3

    return load_gemma3(), gemma3_tokenizer()


def gemma_filler(seed: int, n: int) -> list[int]:
    """n tokens of seeded story text in Gemma's tokenizer, no BOS."""
    _, tokenizer = gemma()
    rng, ids = np.random.default_rng(20_000 + seed), []
    while len(ids) < n:
        ids += tokenizer.encode(" " + stories.generate_story(rng), add_bos=False)
    return ids[:n]


def gemma_sequence(seed: int, filler: int, copy: bool = True) -> tuple[list[int], int]:
    """(ids, start of the repeat): <bos> passage filler passage (or another passage)."""
    rng = np.random.default_rng(seed)
    common = sorted(set(gemma_filler(999, 3000)))
    passage, other = (rng.choice(common, GEMMA_PASSAGE).tolist() for _ in range(2))
    ids = [GEMMA3_BOS] + passage + gemma_filler(seed, filler)
    return ids + (passage if copy else other), len(ids)


GEMMA3_BOS = 2


def gemma_copied(ids: list[int], start: int) -> int:
    """How many repeat tokens after the first are the argmax before them."""
    from kvlib import gemma3

    params, _ = gemma()
    hidden = gemma3.run_layers(params, np.asarray(ids), np.arange(len(ids)))
    logits = gemma3.unembed_logits(params, hidden[start:-1])
    return int((np.argmax(logits, axis=-1) == np.asarray(ids[start + 1:])).sum())


def measure_gemma() -> list[dict]:
    rows = []
    for filler in GEMMA_FILLERS:
        counts = {True: 0, False: 0}
        for seed in range(GEMMA_TRIALS):
            for copy in (True, False):
                counts[copy] += gemma_copied(*gemma_sequence(seed, filler, copy))
        total = GEMMA_TRIALS * (GEMMA_PASSAGE - 1)
        rows.append({"filler": filler, "distance": GEMMA_PASSAGE + filler,
                     "count": total, "copied": counts[True] / total,
                     "chance": counts[False] / total})
        print("gemma", rows[-1], flush=True)
    return rows


def chat_workload() -> dict:
    tokenizer = kvlib.smollm2_tokenizer()
    messages = [{"role": "system", "content": workloads.SYSTEM_PROMPT}]
    turns = []
    for question, reply in zip(workloads.QUESTIONS, CONVERSATION_REPLIES):
        messages.append({"role": "user", "content": question})
        turns.append(tokenizer.apply_chat_template(messages))
        messages.append({"role": "assistant", "content": reply})
    return {"requests": workloads.chat_prompts(tokenizer), "conversation": turns}


def main() -> None:
    data = {"command": "PYTHONPATH=$PWD .venv/bin/python tools/measure_state_layers.py",
            "trials": TRIALS,
            "copying": measure_copying(), "example": example_row(),
            "copying_gemma": measure_gemma(),
            "chat": chat_workload()}
    OUTPUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print("wrote", OUTPUT.relative_to(ROOT))


if __name__ == "__main__":
    main()
