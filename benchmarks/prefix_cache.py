"""Time to first token with and without prefix caching, on this machine (notebook 20).

Requests share a long prefix (a system prompt, a document) and end with a question of their
own. Without prefix caching every request prefills all its tokens into a paged cache;
with it (kvlib.serving.PrefixServer), a first request leaves the prefix's full blocks in the
prefix cache and every later request reuses them and prefills only its question. For each
prefix length the script prints the time to first token (the prefill, up to the logits of
the last token) both ways, their ratio, and the ratio of prefill FLOPs from kvlib.flops.

The model has GPT-2 small's architecture and shapes (kvlib.gpt2.GPT2_124M: 12 layers,
d_model 768, 12 heads, vocabulary 50257, learned positions, layer norms, biases), float32,
random weights, on one BLAS thread (set before numpy is imported). Measurements with and
without reuse are interleaved (ABBA) so that load from other processes falls on both, and
each way keeps its fastest time, the one least disturbed by that load.

    python benchmarks/prefix_cache.py            # full run: about a minute
    python benchmarks/prefix_cache.py --quick    # a few seconds: fewer layers, repeats
    python benchmarks/prefix_cache.py --help     # sizes, lengths, threads
"""

from __future__ import annotations

import argparse
import sys
import time

import report  # benchmarks/report.py: threads, machine lines, tables


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time to first token with and without prefix caching, on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, 2 measurements each, shorter prefixes (a few seconds)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=None,
                        help="shared prefix lengths (default 128 512 960; --quick: 64 256)")
    parser.add_argument("--question", type=int, default=32,
                        help="tokens of each request's own question (default 32)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measurements each way per prefix, interleaved (default 6; "
                             "--quick: 2)")
    parser.add_argument("--block-size", type=int, default=16, help="block size (default 16)")
    parser.add_argument("--layers", type=int, default=None, help="default 12 (--quick: 2)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS threads, set before numpy is imported (default 1)")
    args = parser.parse_args(argv)
    if args.prefixes is None:
        args.prefixes = [64, 256] if args.quick else [128, 512, 960]
    if args.repeats is None:
        args.repeats = 2 if args.quick else 6
    if args.layers is None:
        args.layers = 2 if args.quick else 12
    positive = {"--question": args.question, "--repeats": args.repeats,
                "--block-size": args.block_size, "--layers": args.layers,
                "--d-model": args.d_model, "--heads": args.heads, "--vocab": args.vocab,
                "--threads": args.threads, "--prefixes": min(args.prefixes)}
    for name, value in positive.items():
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if max(args.prefixes) + args.question > 1024:
        parser.error("a prefix plus a question must fit GPT-2's 1024 positions")
    args.prefixes = sorted(set(args.prefixes))
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy is imported

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib.gpt2 import GPT2_124M  # noqa: E402
from kvlib.serving import BlockAllocator, PagedKVCache, PrefixServer  # noqa: E402


def without_reuse(params, pool: BlockAllocator, ids):
    """A server without prefix caching: prefill every token into a fresh paged cache.
    Returns (seconds, last logits)."""
    start = time.perf_counter()
    logits, cache = kvlib.prefill(params, ids, PagedKVCache(pool), last_only=True)
    seconds = time.perf_counter() - start
    cache.free()
    return seconds, logits


def with_reuse(server: PrefixServer, ids):
    """The same request on a server whose prefix cache holds the shared prefix. Returns
    (seconds, last logits, tokens reused)."""
    start = time.perf_counter()
    admission = server.admit(ids)
    seconds = time.perf_counter() - start
    server.finish(admission.request)
    return seconds, admission.logits, admission.reused_tokens


def measure(params, prefix_length: int, args, rng) -> list:
    config = params.config
    prefix = rng.integers(0, config.vocab_size, prefix_length).tolist()
    blocks = -(-(prefix_length + args.question) // args.block_size)
    questions_blocks = (args.repeats + 1) * (-(-args.question // args.block_size) + 1)
    server = PrefixServer(params, blocks + questions_blocks, args.block_size)
    pool = BlockAllocator(config, blocks, args.block_size)

    def request():
        return prefix + rng.integers(0, config.vocab_size, args.question).tolist()

    first = server.admit(request())          # a first request leaves the prefix cached
    server.finish(first.request)
    without_reuse(params, pool, request())   # warm-up, not reported
    times_without, times_with, differences, reused = [], [], [], set()
    for repeat in range(args.repeats):
        ids = request()
        order = ("without", "with") if repeat % 2 == 0 else ("with", "without")
        for way in order:
            if way == "without":
                seconds, plain_logits = without_reuse(params, pool, ids)
                times_without.append(seconds)
            else:
                seconds, reused_logits, n = with_reuse(server, ids)
                times_with.append(seconds)
                reused.add(n)
        scale = float(np.max(np.abs(plain_logits)))
        differences.append(float(np.max(np.abs(reused_logits - plain_logits))) / scale)
    n_reused = reused.pop() if len(reused) == 1 else None
    if n_reused is None:
        raise RuntimeError("requests with the same prefix reused different numbers of tokens")
    total = prefix_length + args.question
    flops_without = kvlib.prefill_multiply_adds(config, total, last_only=True).flops
    flops_with = kvlib.prefill_multiply_adds(config, total - n_reused, cached=n_reused,
                                             last_only=True).flops
    fastest_without, fastest_with = min(times_without), min(times_with)
    return [prefix_length, args.question, n_reused, f"{fastest_without * 1e3:.1f}",
            f"{fastest_with * 1e3:.1f}", f"{fastest_without / fastest_with:.1f}x",
            f"{flops_without / flops_with:.1f}x", f"{max(differences):.1e}"]


def main(args) -> None:
    started = time.perf_counter()
    config = GPT2_124M.replace(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                               d_ff=4 * args.d_model, vocab_size=args.vocab)
    print("# Time to first token with and without prefix caching")
    print()
    print(f"model: GPT-2's architecture, {config.n_layers} layers, d_model {config.d_model}, "
          f"{config.n_heads} heads, vocabulary {config.vocab_size}, float32, random weights; "
          f"block size {args.block_size}; each request: a shared prefix, then "
          f"{args.question} tokens of its own")
    print(report.machine_lines())
    print(f"mode: {'quick' if args.quick else 'full'}; {args.repeats} measurements each way "
          "per prefix, interleaved, the fastest reported")
    print()
    sys.stdout.flush()
    params = kvlib.init_params(config, seed=0)
    rng = np.random.default_rng(0)
    rows = [measure(params, length, args, rng) for length in args.prefixes]
    print(report.table(["shared prefix", "own tokens", "reused", "TTFT without reuse ms",
                 "TTFT with reuse ms", "time ratio", "FLOP ratio", "logits difference"], rows))
    print()
    print("- TTFT: the prefill of one request up to its last token's logits (kvlib.prefill "
          "into a PagedKVCache without reuse; PrefixServer.admit with it: lookup, attach the "
          "cached blocks, prefill the rest); no tokenizer, no sampling, no queueing")
    print("- reused: tokens taken from the prefix cache (full blocks of the shared prefix)")
    print("- FLOP ratio: kvlib.prefill_multiply_adds of the whole request / of its own tokens "
          "after the reused ones (their attention over the reused positions included)")
    print("- logits difference: the largest |reused - recomputed| over the requests, relative "
          "to the largest logit; float32, from rows computed in products of other shapes")
    print()
    print(f"total benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(ARGS)
