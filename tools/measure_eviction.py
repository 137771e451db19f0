"""Write notebooks/data/keeping_what_attention_reads.json: what each eviction policy costs
SmolLM2-135M at equal cache budgets, and keeping_what_attention_reads_gemma3.json: the same
for Gemma 3 270M's three global layers, its sliding layers keeping their ring (after `make
smollm2 gemma3`; numpy and kvlib only, one BLAS thread):

    .venv/bin/python tools/measure_eviction.py                  # about 25 minutes on one core
    .venv/bin/python tools/measure_eviction.py --model gemma3   # about 25 minutes
    .venv/bin/python tools/measure_eviction.py --quick          # a smaller run, printed only
    .venv/bin/python tools/measure_eviction.py --sections cost  # one section again, the rest kept

Four measurements, every policy through kvlib.eviction.EvictingCache, the ceiling through a
plain kvlib.KVCache:

- loss: Python's documentation of the assignment statement (pydoc_data.topics, PSF licence),
  its first N_LOSS SmolLM2 tokens (ids kept, since another Python may hold another text), fed
  one token at a time (kvlib.long_context.streaming_losses); per policy and budget the mean
  loss of the tokens at positions SCORED_FROM .. N_LOSS - 1, and the mean of every block of
  BLOCK predictions (block b: the predictions of ids[b x BLOCK + 1 ..]).
- continued: the same text's first N_LOSS - CONTINUED tokens as a prompt in one pass (where
  every policy chooses once, SnapKV's only choice), then the last CONTINUED tokens one at a
  time; their mean loss, for every policy, SnapKV and PyramidKV included (SnapKV keeps every
  token after the prompt, so it ends holding its budget + CONTINUED).
- copying: a passage of PASSAGE_WORDS random words from the documentation, then FILLER tokens
  of other documentation, then the passage's first CUE tokens; how many of the rest the model
  copies greedily, teacher-forced (kvlib.long_context.copied_tokens). "question_last": the
  prompt in one pass, the cue last (a scoring policy sees the cue when it chooses);
  "question_later": the passage and filler in one pass, the cue in a second (it does not).
- Gemma 3: fewer rows (a step takes about five times SmolLM2's): N_LOSS_GEMMA3 tokens, budgets
  BUDGETS_GEMMA3 for the global layers, TRIALS_GEMMA3 copying trials, no PyramidKV (three
  global layers), no continued or cost rows. Its filler is longer than its 512-position
  window, so only the global layers can reach the passage.
- cost (SmolLM2): one decode step at position N_LOSS - 1 with budget COST_BUDGET, per policy
  and for plain caches of the whole sequence and of COST_BUDGET positions: the median time of
  COST_STEPS steps (one thread; a timing, so the notebook shows it and checks nothing on it),
  the bytes of K and V held and the bytes of positions and scores kept beside them.
"""

from __future__ import annotations

import os

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvlib  # noqa: E402
from kvlib import gemma3  # noqa: E402
from kvlib.eviction import EvictingCache, SnapKV, pyramid_budgets  # noqa: E402
from kvlib.long_context import copied_tokens, streaming_losses  # noqa: E402

OUTPUT = ROOT / "notebooks" / "data" / "keeping_what_attention_reads.json"
N_LOSS, SCORED_FROM, BLOCK = 1536, 512, 64
BUDGETS = [32, 64, 128, 256, 512]
STREAMING = ["window", "sinks", "h2o", "tova"]           # SnapKV compresses a prompt, once
PROMPTED = STREAMING + ["snapkv", "pyramidkv"]
PASSAGE_WORDS, FILLER, CUE, TRIALS = 24, 640, 4, 3
COST_BUDGET, COST_STEPS = 128, 15
OUTPUT_GEMMA3 = ROOT / "notebooks" / "data" / "keeping_what_attention_reads_gemma3.json"
N_LOSS_GEMMA3, BUDGETS_GEMMA3, TRIALS_GEMMA3 = 768, [32, 128], 2
CONTINUED = 512


def loss_ids(tokenizer, n_tokens: int = N_LOSS) -> list[int]:
    from pydoc_data import topics
    return tokenizer.encode(topics.topics["assignment"])[:n_tokens]


def make_cache(config, policy: str, budget: int):
    """The cache a row is measured with: KVCache for "full", PyramidKV as SnapKV selecting
    within pyramid_budgets, the others by name; for Gemma 3 its own cache, the global layers
    evicting."""
    if isinstance(config, gemma3.Gemma3Config):
        return gemma3.Gemma3Cache(config) if policy == "full" else \
            gemma3.evicting_cache(config, budget, policy)
    if policy == "full":
        return kvlib.KVCache(config)
    if policy == "pyramidkv":
        return EvictingCache(config, pyramid_budgets(config.n_layers, budget), SnapKV())
    return EvictingCache(config, budget, policy)


def loss_row(params, ids, policy: str, budget: int, prompt_length: int = 1,
             scored_from: int = SCORED_FROM) -> dict:
    """The mean loss of the tokens at scored_from .. and the mean of every block of BLOCK
    predictions, fed one token at a time after a prompt of prompt_length in one pass."""
    losses = streaming_losses(params, ids, make_cache(params.config, policy, budget),
                              prompt_length)
    blocks = [float(losses[start:start + BLOCK].mean()) for start in range(0, len(losses), BLOCK)]
    return {"mean": round(float(losses[scored_from - 1:].mean()), 4),
            "blocks": [round(value, 4) for value in blocks]}


def copy_trial(tokenizer, seed: int) -> dict:
    """Ids of one copying trial: the passage, the filler around it, the cue length."""
    from pydoc_data import topics
    names = sorted(topics.topics)
    rng = np.random.default_rng(seed)
    words = topics.topics["assignment"].split()
    passage_text = " " + " ".join(rng.choice(words, PASSAGE_WORDS))
    # Gemma 3's tokenizer puts BOS first unless told not to: once, at the prompt's start
    passage = tokenizer.encode(passage_text, add_bos=False) if hasattr(tokenizer, "bos_id") \
        else tokenizer.encode(passage_text)
    filler_text = " ".join(topics.topics[name] for name in rng.choice(names, 12, replace=False))
    filler = tokenizer.encode(filler_text)[:FILLER + 64]
    return {"before": filler[:64], "passage": passage, "filler": filler[64:]}


def copy_chunks(trial: dict, variant: str) -> tuple[list[list[int]], list[int]]:
    """The prompt's chunks and the answer of a trial: the cue in the prompt's one pass
    (question_last) or in a pass of its own (question_later)."""
    head = trial["before"] + trial["passage"] + trial["filler"]
    cue, answer = trial["passage"][:CUE], trial["passage"][CUE:]
    chunks = [head + cue] if variant == "question_last" else [head, cue]
    return chunks, answer


def copy_fractions(params, trials, variant: str, policy: str, budget: int) -> list[float]:
    """Per trial, the share of the answer's tokens copied."""
    return [round(float(copied_tokens(params, *copy_chunks(trial, variant),
                                      make_cache(params.config, policy, budget)).mean()), 4)
            for trial in trials]


def pooled(fractions: list[float], trials) -> float:
    """The trials' shares as one: the tokens copied in all of them over all their tokens."""
    lengths = [len(trial["passage"]) - CUE for trial in trials]
    copied = sum(round(fraction * length) for fraction, length in zip(fractions, lengths))
    return round(copied / sum(lengths), 4)


def copy_fraction(params, trials, variant: str, policy: str, budget: int) -> float:
    """The share of every trial's answer tokens copied, all trials together."""
    hits = [copied_tokens(params, *copy_chunks(trial, variant),
                          make_cache(params.config, policy, budget)) for trial in trials]
    return round(float(np.concatenate(hits).mean()), 4)


def step_cost(params, ids, policy: str, budget: int) -> dict:
    """The median time of a decode step after ids[:-1] (prefilled in one pass, so compressed
    once to the budget), and the bytes held."""
    config = params.config
    cache = make_cache(config, "full" if policy == "short" else policy, budget)
    prompt = ids[-budget - 1:-1] if policy == "short" else ids[:-1]
    kvlib.prefill(params, prompt, cache, last_only=True)
    saved, times = cache.checkpoint(), []
    for _ in range(COST_STEPS):
        start = time.perf_counter()
        kvlib.decode_step(params, ids[-1], cache)
        times.append(time.perf_counter() - start)
        cache.restore(saved)
    index_bytes = cache.index_bytes if isinstance(cache, EvictingCache) else 0
    return {"step_ms": round(1000 * float(np.median(times)), 2), "nbytes": cache.nbytes,
            "index_bytes": index_bytes}


MODELS = {
    "smollm2": dict(load=kvlib.load_smollm2, tokenizer=kvlib.smollm2_tokenizer, output=OUTPUT,
                    name="SmolLM2-135M-Instruct", n_loss=N_LOSS, budgets=BUDGETS, trials=TRIALS,
                    prompted=PROMPTED, sections=("loss", "continued", "copying", "cost")),
    "gemma3": dict(load=kvlib.load_gemma3, tokenizer=kvlib.gemma3_tokenizer,
                   output=OUTPUT_GEMMA3, name="Gemma 3 270M, its 3 global layers evicting",
                   n_loss=N_LOSS_GEMMA3, budgets=BUDGETS_GEMMA3, trials=TRIALS_GEMMA3,
                   prompted=STREAMING + ["snapkv"], sections=("loss", "copying")),
}


def measure_loss(params, ids, budgets, settings) -> dict:
    """The text one token at a time from the start: the streaming policies."""
    section = {"ids": ids, "scored_from": SCORED_FROM, "block": BLOCK, "budgets": budgets,
               "full": loss_row(params, ids, "full", 0), "policies": {}}
    for policy in STREAMING:
        section["policies"][policy] = {str(b): loss_row(params, ids, policy, b) for b in budgets}
        print("loss", policy, [row["mean"] for row in section["policies"][policy].values()],
              "full", section["full"]["mean"], flush=True)
    return section


def measure_continued(params, ids, budgets, settings) -> dict:
    """The text's first len - CONTINUED tokens as a prompt in one pass (every policy chooses,
    SnapKV once), then the rest one token at a time, whose mean loss is kept: every policy,
    SnapKV and PyramidKV too."""
    prompt_length = len(ids) - CONTINUED     # scored: the tokens after the prompt
    section = {"prompt_length": prompt_length, "budgets": budgets, "full": loss_row(
        params, ids, "full", 0, prompt_length, prompt_length)["mean"], "policies": {}}
    for policy in settings["prompted"]:
        section["policies"][policy] = [
            loss_row(params, ids, policy, b, prompt_length, prompt_length)["mean"]
            for b in budgets]
        print("continued", policy, section["policies"][policy], "full", section["full"],
              flush=True)
    return section


def measure_copying(params, tokenizer, budgets, settings) -> dict:
    trials = [copy_trial(tokenizer, seed) for seed in range(settings["trials"])]
    section = {"cue": CUE, "trials": trials, "budgets": budgets}
    for variant in ("question_last", "question_later"):
        # per trial (a cell remakes one in seconds), and of every trial's tokens together
        per_trial = {"full": copy_fractions(params, trials, variant, "full", 0), "policies": {}}
        for policy in settings["prompted"]:
            per_trial["policies"][policy] = [copy_fractions(params, trials, variant, policy, b)
                                             for b in budgets]
        section[variant] = {
            "full": pooled(per_trial["full"], trials),
            "policies": {policy: [pooled(row, trials) for row in rows]
                         for policy, rows in per_trial["policies"].items()},
            "per_trial": per_trial}
        print(variant, section[variant]["full"], section[variant]["policies"], flush=True)
    return section


def measure_cost(params, ids, settings) -> dict:
    section = {"position": len(ids) - 1, "budget": COST_BUDGET, "policies": {
        policy: step_cost(params, ids, policy, COST_BUDGET)
        for policy in ["full", "short"] + settings["prompted"]}}
    print(section, flush=True)
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--sections", help="comma-separated sections to measure again, the "
                        "others kept from the file (default: all)")
    parser.add_argument("--quick", action="store_true", help="small run, printed, not written")
    arguments = parser.parse_args()
    settings = MODELS[arguments.model]
    sections = arguments.sections.split(",") if arguments.sections else settings["sections"]
    unknown = set(sections) - set(settings["sections"])
    if unknown:
        parser.error(f"no section {sorted(unknown)} for {arguments.model}")
    params, tokenizer = settings["load"](), settings["tokenizer"]()
    quick = arguments.quick
    ids = loss_ids(tokenizer, 600 if quick else settings["n_loss"])
    budgets = settings["budgets"][:1] if quick else settings["budgets"]
    output = settings["output"]
    data = json.loads(output.read_text()) if arguments.sections else {}
    data.update({"command": f"python tools/measure_eviction.py --model {arguments.model}",
                 "model": settings["name"]})
    measures = {"loss": lambda: measure_loss(params, ids, budgets, settings),
                "continued": lambda: measure_continued(params, ids, budgets, settings),
                "copying": lambda: measure_copying(params, tokenizer, budgets, settings),
                "cost": lambda: measure_cost(params, ids, settings)}
    for section in sections:
        data[section] = measures[section]()
    if not quick:
        output.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
        print("wrote", output.relative_to(ROOT))


if __name__ == "__main__":
    main()
