"""Measure what lower precision does to "cached equals recomputed" (notebook 25), once, and
keep the numbers small (kvlib/models/precision.json; the lesson loads it with
kvlib.precision.measured()).

    python tools/measure_precision.py                  # both models (about 15 minutes)
    python tools/measure_precision.py stories          # one; the other is kept
    python tools/measure_precision.py gpt2             # GPT-2 124M, when it is downloaded
    python tools/measure_precision.py zoo              # notebook 25's widget (about 30 s)
    python tools/measure_precision.py flips            # SmolLM2's flips on two texts (5 min)

For each model, windows of real text: the story model's stories (kvlib.stories.corpus,
seed 2026), SmolLM2's 1024 tokens of Python's documentation (the ids kept in
kvlib/models/smollm2/measured.json). In every window the first PROMPT tokens are the prompt
and every later token is predicted twice, teacher-forced: by decode steps against the cache
and by one forward pass (kvlib.precision.teacher_forced). Rows:

- everything in float64, float32, float16, bfloat16 (kvlib.precision.computed_in, weights
  rounded with in_format): cached against recomputed; and the recomputed logits against the
  float64 ones (what the format itself costs);
- the cache alone in float16 and bfloat16 (kvlib.precision.RoundingCache), the model in
  float32: cached against the float32 recomputation;
- left padding: each window with PADDING pad tokens in front, hidden by the mask, against the
  window alone (kvlib.precision.left_padded), everything in each format.

Each comparison: positions, largest and mean absolute logit difference, greedy flips and
the widest top-two gap at which one happened (kvlib.precision.Comparison).

flips: SmolLM2's greedy flips window by window on two texts (Python's documentation, as above,
and the story grammar's English), in float16 and bfloat16, cached against recomputed and
against float64: does the format move the greedy token more than the cache, beyond chance?

zoo: the widget of notebook 25, every bug it offers in every format on the story model
(kvlib.cache_bugs.run_bug): the logit differences step by step, the locator's report (with
the tolerance tools/measure_tolerances.py measured, kvlib.cache_bugs.zoo_tolerance) and the
rows each decode step computes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import cache_bugs, precision, stories  # noqa: E402

PROMPT = 16
PADDING = 5
SIZES = {"stories": (48, 96), "smollm2": (16, 64), "gpt2": (16, 64)}   # windows, tokens each


def story_windows(n: int, length: int) -> list[list[int]]:
    from kvlib.stories.corpus import story_sequences

    return [list(map(int, row)) for row in story_sequences(n, seed=2026, length=length)]


def smollm2_windows(n: int, length: int) -> list[list[int]]:
    from kvlib.checkpoints import smollm2

    ids = smollm2.measured()["ids"]
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def gpt2_windows(n: int, length: int) -> list[list[int]]:
    from kvlib import gpt2

    tokenizer = gpt2.Tokenizer.gpt2()
    return [tokenizer.encode(text)[:length] for text in _python_texts(n)]


def _python_texts(n: int) -> list[str]:
    from pydoc_data import topics

    return [topics.topics[key] for key in sorted(topics.topics)[:n]]


def load(name: str):
    from kvlib import gpt2

    if name == "stories":
        return gpt2.load(Path(kvlib.__file__).parent / "models" / "stories", dtype="float32")
    if name == "smollm2":
        return kvlib.load_smollm2()
    weights = gpt2.find_weights()
    if weights is None:
        raise SystemExit("GPT-2 124M is not downloaded: run kvlib.gpt2.download() first "
                         "(it needs a network)")
    return gpt2.load(weights, dtype="float32")


WINDOWS = {"stories": story_windows, "smollm2": smollm2_windows, "gpt2": gpt2_windows}


def pooled(pairs) -> dict:
    """One Comparison over every window's rows."""
    a = np.concatenate([first for first, _ in pairs])
    b = np.concatenate([second for _, second in pairs])
    return precision.compare(a, b).as_dict()


def measure(name: str) -> dict:
    params = load(name)
    windows = WINDOWS[name](*SIZES[name])
    reference = [kvlib.forward(precision.in_format(params, "float64"), ids[:-1])[PROMPT - 1:]
                 for ids in windows]
    rows = []
    for number_format in precision.FORMATS:
        started = time.monotonic()
        weights = precision.in_format(params, number_format)
        with precision.computed_in(number_format):
            runs = [precision.teacher_forced(weights, ids, PROMPT) for ids in windows]
            padded = [precision.left_padded(weights, ids, PADDING) for ids in windows]
        rows.append({"format": number_format, "where": "everything",
                     "cached_against_recomputed": pooled(runs),
                     "against_float64": pooled([(recomputed, exact) for (_, recomputed), exact
                                                in zip(runs, reference)]),
                     "padded_against_alone": pooled(padded)})
        print(f"{name} {number_format}: {time.monotonic() - started:.0f} s", flush=True)
    for number_format in ("float16", "bfloat16"):
        runs = [precision.teacher_forced(params, ids, PROMPT,
                                         precision.RoundingCache(params.config, number_format))
                for ids in windows]
        rows.append({"format": number_format, "where": "the cache",
                     "cached_against_recomputed": pooled(runs),
                     "against_float64": pooled([(cached, exact) for (cached, _), exact
                                                in zip(runs, reference)])})
    return {"windows": len(windows), "tokens": len(windows[0]), "prompt": PROMPT,
            "padding": PADDING, "rows": rows}


def measure_zoo() -> dict:
    story, tokenizer = stories.load_model(dtype="float32"), stories.load_tokenizer()
    prompt = tokenizer.encode(cache_bugs.ZOO_PROMPT)
    runs = {}
    for label in cache_bugs.zoo(tokenizer, prompt):
        runs[label] = {}
        for number_format in cache_bugs.ZOO_FORMATS:
            differences, found, rows = cache_bugs.run_bug(story, tokenizer, prompt, label,
                                                          number_format)
            runs[label][number_format] = {
                "differences": [None if np.isnan(d) else float(d) for d in differences],
                "report": None if found is None else str(found), "rows": rows}
    return {"prompt": cache_bugs.ZOO_PROMPT, "runs": runs}


FLIP_TEXTS = ("python docs", "stories")
FLIP_WINDOWS = 16


def smollm2_story_windows(n: int, length: int) -> list[list[int]]:
    """SmolLM2's token ids of the story grammar's stories (seed 2026), cut into windows."""
    from kvlib.stories.grammar import generate_stories

    encode, ids, seed = kvlib.smollm2_tokenizer().encode, [], 2026
    while len(ids) < n * length:
        ids += encode(" ".join(generate_stories(8, seed)))
        seed += 1
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def measure_flips() -> dict:
    """SmolLM2's greedy flips window by window, on two texts (the table's 16 windows of
    Python's documentation, and 16 of the story grammar's English), in float16 and bfloat16:
    cached against recomputed, and recomputed against float64 (what the format itself does).
    Counts this small need their spread: the lesson reads it from the windows."""
    params = load("smollm2")
    length = SIZES["smollm2"][1]
    texts = {"python docs": smollm2_windows(FLIP_WINDOWS, length),
             "stories": smollm2_story_windows(FLIP_WINDOWS, length)}
    exact = precision.in_format(params, "float64")
    result = {"model": "smollm2", "windows": FLIP_WINDOWS, "tokens": length, "prompt": PROMPT,
              "texts": {}}
    for text, windows in texts.items():
        reference = [kvlib.forward(exact, ids[:-1])[PROMPT - 1:] for ids in windows]
        counts = {}
        for number_format in ("float16", "bfloat16"):
            started = time.monotonic()
            weights = precision.in_format(params, number_format)
            with precision.computed_in(number_format):
                runs = [precision.teacher_forced(weights, ids, PROMPT) for ids in windows]
            counts[number_format] = {
                "cached_against_recomputed": [precision.compare(c, r).flips for c, r in runs],
                "against_float64": [precision.compare(r, e).flips
                                    for (_, r), e in zip(runs, reference)],
                "positions": [len(r) for _, r in runs]}
            del weights
            print(f"flips, {text}, {number_format}: {time.monotonic() - started:.0f} s",
                  flush=True)
        result["texts"][text] = counts
    return result


MEASURES = {"stories": lambda: measure("stories"), "smollm2": lambda: measure("smollm2"),
            "gpt2": lambda: measure("gpt2"), "zoo": measure_zoo, "flips": measure_flips}


def main(argv: list[str]) -> None:
    names = argv or ["stories", "smollm2", "zoo", "flips"]
    unknown = set(names) - set(MEASURES)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {sorted(MEASURES)}")
    for name in names:
        started = time.monotonic()
        result = MEASURES[name]()
        path = precision.MEASURED
        measured = json.loads(path.read_text()) if path.is_file() else {}
        measured |= {"command": "python tools/measure_precision.py [parts]", name: result}
        path.write_text(json.dumps(measured, indent=1) + "\n")
        print(f"{name}: {time.monotonic() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
