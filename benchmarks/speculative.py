"""Speculative decoding on this machine: the trained story models, draft and target.

Greedy speculative decoding (kvlib.serving.speculative) with the draft in
kvlib/models/stories-draft (1 layer, d_model 64) and the target in kvlib/models/stories
(4 layers, d_model 128), on prompts cut from held-out stories, for several k. Prints:

- the acceptance rate alpha: how often the draft's greedy choice is the target's, along the
  target's own greedy continuation (kvlib.serving.speculative.greedy_agreements; it does not
  depend on k);
- for every k: the accepted proposals, tokens per target pass measured, replayed from where
  the draft agrees (exact) and predicted from alpha alone, (1 - alpha^(k+1)) / (1 - alpha);
- the measured speed-up over plain decoding (kvlib.generate) beside two predictions: the
  brief one, (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)) with c = a draft pass's time over a
  target decode step's, and one from the measured time of every pass (the target's pass over
  k + 1 tokens is dearer than a decode step here);
- whether every speculative run gave exactly the target's greedy tokens.

    python benchmarks/speculative.py            # full run: about a minute
    python benchmarks/speculative.py --quick    # a few seconds: fewer prompts, tokens, k
    python benchmarks/speculative.py --help

Timings are interleaved (every repeat runs every method, in a rotating order) and the fastest
run of each is reported, so that load from other processes on a shared machine falls on all
of them and its spikes drop out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "kvlib" / "models"


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Greedy speculative decoding with the story models, on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts, 48 tokens, k = 1 and 4, 2 repeats (a few seconds)")
    parser.add_argument("--target", type=Path, default=MODELS / "stories",
                        help="target model directory (default kvlib/models/stories)")
    parser.add_argument("--draft", type=Path, default=MODELS / "stories-draft",
                        help="draft model directory (default kvlib/models/stories-draft)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts, each the first sentence of a held-out story (default 6)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="new tokens a prompt (default 200)")
    parser.add_argument("--k", type=int, nargs="+", default=None,
                        help="numbers of proposals a round (default 1 2 3 4 6 8)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of every method, interleaved (default 5)")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS threads, set before numpy is imported (default 1)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"prompts": 2 if quick else 6, "tokens": 48 if quick else 200,
                "k": [1, 4] if quick else [1, 2, 3, 4, 6, 8], "repeats": 2 if quick else 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("prompts", "tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.k) < 1:
        parser.error(f"every --k must be at least 1, got {args.k}")
    args.k = sorted(set(args.k))
    for name in ("target", "draft"):
        if not (getattr(args, name) / "config.json").is_file():
            parser.error(f"--{name} {getattr(args, name)} holds no model (config.json)")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy is imported

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import gpt2  # noqa: E402
from kvlib.serving import speculative  # noqa: E402
from kvlib.stories import StoryTokenizer, generate_stories  # noqa: E402
from kvlib.stories.corpus import HELD_OUT_SEED  # noqa: E402


def story_prompts(tokenizer: StoryTokenizer, n: int) -> list[list[int]]:
    """The first sentence of each of n held-out stories, as ids (BOS first)."""
    return [tokenizer.encode(story.split(". ")[0] + ".")
            for story in generate_stories(n, HELD_OUT_SEED)]


def describe(params) -> str:
    c = params.config
    layers = "1 layer" if c.n_layers == 1 else f"{c.n_layers} layers"
    return f"{layers}, d_model {c.d_model}, {c.n_heads} heads, {params.n_parameters:,} weights"


def time_passes(target, draft, sequence, ks, repeats: int = 60) -> dict:
    """Seconds of one pass of each kind at the sequence's length (the fastest of repeats,
    interleaved): the target's decode step, the draft's, and the target's pass over k + 1
    tokens for every k."""
    caches = {}
    for name, params in (("target", target), ("draft", draft)):
        _, caches[name] = kvlib.prefill(params, sequence)
    held = len(sequence)
    kinds = [("target step", target, 1), ("draft step", draft, 1)] + \
        [(f"verify {k}", target, k + 1) for k in ks]
    seconds = {name: [] for name, _, _ in kinds}
    for _ in range(repeats):
        for name, params, n_tokens in kinds:
            cache = caches["target" if params is target else "draft"]
            tokens = sequence[-n_tokens:]
            start = time.perf_counter()
            if n_tokens == 1:
                kvlib.decode_step(params, tokens[0], cache)
            else:
                kvlib.prefill(params, tokens, cache)
            seconds[name].append(time.perf_counter() - start)
            cache.truncate(held)
    return {name: min(times) for name, times in seconds.items()}


def main(args) -> None:
    started = time.perf_counter()
    target = gpt2.load(args.target, args.dtype)
    draft = gpt2.load(args.draft, args.dtype)
    speculative.check_pair(target, draft)
    tokenizer = StoryTokenizer.from_directory(args.target)
    prompts = story_prompts(tokenizer, args.prompts)
    limit = min(target.config.context_length, draft.config.context_length)
    tokens = min(args.tokens, limit + 1 - max(len(p) for p in prompts))

    print("# Speculative decoding on this machine")
    print()
    print(f"target: {args.target.name}, {describe(target)}; draft: {args.draft.name}, "
          f"{describe(draft)}; {args.dtype}; greedy")
    print(f"workload: {len(prompts)} prompts (the first sentence of held-out stories, "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), {tokens} new tokens "
          f"each; k = {', '.join(map(str, args.k))}")
    print(report.machine_lines())
    print(f"mode: {'quick' if args.quick else 'full'}; {args.repeats} interleaved repeats, "
          "the fastest of each")
    print()

    # -- counts: what the draft agrees on, what every k accepts (no timing) -------------
    references = [kvlib.generate(target, prompt, tokens) for prompt in prompts]
    agreements = [speculative.greedy_agreements(target, draft, prompt, reference)
                  for prompt, reference in zip(prompts, references)]
    alpha = float(np.mean(np.concatenate(agreements)))
    counts, identical = {}, {}
    for k in args.k:
        steps, same = [], 0
        for prompt, reference in zip(prompts, references):
            decoder = speculative.SpeculativeDecoder(target, draft, prompt, k)
            same += decoder.generate(tokens) == reference
            steps += decoder.steps
        replayed = sum(len(speculative.replay_greedy(a, k)) for a in agreements)
        counts[k] = (speculative.summarize(steps), replayed)
        identical[k] = same

    # -- timings: every method in every repeat, in a rotating order -----------------------
    def plain():
        for prompt in prompts:
            kvlib.generate(target, prompt, tokens)

    def speculative_run(k):
        def run():
            for prompt in prompts:
                speculative.SpeculativeDecoder(target, draft, prompt, k).generate(tokens)
        return run

    methods = [("plain", plain)] + [(f"k={k}", speculative_run(k)) for k in args.k]
    seconds = {name: [] for name, _ in methods}
    for repeat in range(args.repeats + 1):          # the first round warms up, not reported
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
        for name, run in order:
            start = time.perf_counter()
            run()
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    fastest = {name: min(times) for name, times in seconds.items()}
    middle = prompts[0] + references[0][: tokens // 2]
    passes = time_passes(target, draft, middle, args.k)
    c = passes["draft step"] / passes["target step"]

    total_tokens = tokens * len(prompts)
    rows = [["plain", "-", "-", "1.00", "1.00", "1.00", "1.00x", "-", "-",
             f"{total_tokens / fastest['plain']:.0f}"]]
    for k in args.k:
        stats, replayed = counts[k]
        measured = fastest["plain"] / fastest[f"k={k}"]
        verify = passes[f"verify {k}"]
        from_passes = stats.tokens_per_pass * passes["target step"] / \
            (k * passes["draft step"] + verify)
        rows.append([
            k, f"{stats.accepted}/{stats.judged}", f"{stats.acceptance_rate:.3f}",
            f"{stats.tokens_per_pass:.2f}", f"{total_tokens / replayed:.2f}",
            f"{speculative.expected_tokens_per_pass(alpha, k):.2f}", f"{measured:.2f}x",
            f"{speculative.predicted_speedup(alpha, k, c):.2f}x", f"{from_passes:.2f}x",
            f"{total_tokens / fastest[f'k={k}']:.0f}"])
    print(f"alpha = {alpha:.3f}: the draft's greedy choice is the target's at "
          f"{int(np.concatenate(agreements).sum())} of {total_tokens} positions of the "
          "target's greedy continuations")
    print(f"one pass at position {len(middle)}: target decode step "
          f"{passes['target step'] * 1e3:.3f} ms, draft decode step "
          f"{passes['draft step'] * 1e3:.3f} ms, so c = {c:.2f}; the target's pass over "
          "k + 1 tokens: " + ", ".join(f"k={k} {passes[f'verify {k}'] * 1e3:.3f} ms "
                                       f"({passes[f'verify {k}'] / passes['target step']:.2f}"
                                       " steps)" for k in args.k))
    print()
    print("## Greedy speculative decoding against plain decoding")
    print()
    print(report.table(["k", "accepted/judged", "acceptance", "tokens/pass", "replayed",
                 "from alpha", "speed-up", "predicted (alpha, c)", "predicted (passes)",
                 "tok/s"], rows))
    print()
    print("- tokens/pass: new tokens / target passes (one pass a round; plain decoding makes "
          "one token a pass); replayed: the same, from where the draft agrees "
          "(speculative.replay_greedy), exact; from alpha: (1 - alpha^(k+1)) / (1 - alpha), "
          "as if every proposal were accepted independently with probability alpha")
    print("- speed-up: plain time / speculative time (the fastest of the interleaved runs); "
          "predicted (alpha, c): (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); predicted "
          "(passes): measured tokens/pass x target step / (k draft steps + the target's pass "
          "over k + 1 tokens), each pass timed alone")
    for k in args.k:
        if identical[k] != len(prompts):
            print(f"- k={k}: {len(prompts) - identical[k]} of {len(prompts)} runs differ from "
                  f"the target's greedy tokens ({args.dtype} rounding on a near tie)")
    all_same = all(identical[k] == len(prompts) for k in args.k)
    print(f"- every speculative run gave exactly the target's greedy tokens: "
          f"{'yes' if all_same else 'no'} ({sum(identical.values())} of "
          f"{len(prompts) * len(args.k)} runs)")
    print("- the machine may be shared: ratios come from one interleaved run; absolute "
          "tokens per second move with the load")
    print()
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
