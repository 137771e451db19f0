"""kvlib's cached decode against transformers' on the same GPT-2 weights, one thread each.

Needs torch and transformers, which kvlib never needs: run it with an environment that has
them (the tests never run it):

    .venv-reference/bin/python benchmarks/versus_transformers.py            # about a minute
    .venv-reference/bin/python benchmarks/versus_transformers.py --quick    # under a minute
    .venv-reference/bin/python benchmarks/versus_transformers.py --checkpoint ~/.cache/kvlib/gpt2

The weights: random GPT-2 124M weights from kvlib.init_params(kvlib.gpt2.GPT2_124M), written
as a checkpoint folder with kvlib.gpt2.save into a temporary folder (or --checkpoint DIR, for
example the real GPT-2 after `make gpt2`). Both load that folder: kvlib.gpt2.load
(memory-mapped float32) and transformers' GPT2LMHeadModel.from_pretrained (float32).

The loop, the same in both: a prefill of a P-token prompt, then one decode step per new
token against the cache, choosing greedily. kvlib: kvlib.prefill, then kvlib.decode_step.
transformers: the model's forward with its own cache (a DynamicCache), one token a step,
under torch.inference_mode(): the loop model.generate runs, written out so that nothing but
the model is timed. Rounds alternate the two, so that whatever else the machine does weighs
on both alike; each reports the median of its rounds.

Prints tokens per second of each, the ratio kvlib / transformers (above 1.0: kvlib ahead),
and whether both chose the same tokens (random weights leave near ties that float32 rounding
can tip either way; the real GPT-2 rarely has them).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="kvlib's cached decode against transformers'.")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens generated per round (default 128, 32 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of each (default 5, 2 with --quick)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a GPT-2 checkpoint folder (default: random 124M weights)")
    parser.add_argument("--threads", type=int, default=1, help="threads for both (default 1)")
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    args.rounds = args.rounds or (2 if args.quick else 5)
    for name in ("prompt", "new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy and torch load: read once
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import gpt2, roofline  # noqa: E402


def kvlib_generation(params, prompt: list[int], new_tokens: int) -> list[int]:
    logits, cache = kvlib.prefill(params, prompt, last_only=True)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < new_tokens:
        new.append(int(np.argmax(kvlib.decode_step(params, new[-1], cache)[-1])))
    return new


def transformers_generation(torch, model, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        output = model(input_ids=torch.tensor([prompt]), use_cache=True)
        token = output.logits[0, -1].argmax()
        new = [int(token)]
        while len(new) < new_tokens:
            # transformers 5 names the cache `cache` (older releases: past_key_values)
            cache = {"cache": output.cache} if "cache" in output else \
                {"past_key_values": output.past_key_values}
            output = model(input_ids=token.view(1, 1), use_cache=True, **cache)
            token = output.logits[0, -1].argmax()
            new.append(int(token))
    return new


def timed(function, *args) -> tuple[float, list[int]]:
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def main(args) -> None:
    import torch
    import transformers
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()       # deprecation notices, not results
    warnings.filterwarnings("ignore", category=FutureWarning)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.checkpoint
        if directory is None:
            directory = Path(scratch) / "gpt2-random"
            gpt2.save(kvlib.init_params(gpt2.GPT2_124M, seed=0), directory)
        params = gpt2.load(directory)
        model = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()
        config = params.config
        if args.prompt + args.new_tokens > config.context_length:
            sys.exit(f"--prompt + --new-tokens must fit in {config.context_length} positions")
        prompt = np.random.default_rng(0).integers(0, config.vocab_size, args.prompt).tolist()

        print("# kvlib against transformers: cached greedy decoding, the same weights")
        print()
        print(f"model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} "
              f"heads, vocabulary {config.vocab_size}, float32, "
              f"{'random weights' if args.checkpoint is None else args.checkpoint}; prompt "
              f"{args.prompt} tokens, {args.new_tokens} new tokens a round, {args.rounds} "
              "rounds each, alternating")
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical "
              f"CPUs; Python {platform.python_version()}, numpy {np.__version__} "
              f"({roofline.blas_name()}, threads {roofline.blas_threads()}), torch "
              f"{torch.__version__} (threads {torch.get_num_threads()}), transformers "
              f"{transformers.__version__} (attention: "
              f"{model.config._attn_implementation})")
        sys.stdout.flush()

        kvlib_generation(params, prompt, 4)                 # warm-up, not reported
        transformers_generation(torch, model, prompt, 4)
        seconds = {"kvlib": [], "transformers": []}
        for _ in range(args.rounds):
            spent, ours = timed(kvlib_generation, params, prompt, args.new_tokens)
            seconds["kvlib"].append(spent)
            spent, theirs = timed(transformers_generation, torch, model, prompt,
                                  args.new_tokens)
            seconds["transformers"].append(spent)

    rates = {name: args.new_tokens / float(np.median(values)) for name, values in seconds.items()}
    same = sum(a == b for a, b in zip(ours, theirs))
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print()
    print("| loop | tok/s (median of rounds) | every round, tok/s |")
    print("|---|---:|---|")
    for name, values in seconds.items():
        each = ", ".join(f"{args.new_tokens / s:.1f}" for s in values)
        print(f"| {name} | {rates[name]:.1f} | {each} |")
    print()
    print(f"ratio kvlib / transformers: {rates['kvlib'] / rates['transformers']:.2f} "
          "(above 1.00: kvlib ahead)")
    print(f"same greedy tokens: {same} of {args.new_tokens}"
          + ("" if first_difference is None else
             f" (the first difference at new token {first_difference}; after it the two "
             "continue different sequences)"))
    print(f"total time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
