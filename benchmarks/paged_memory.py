"""Paged against contiguous KV cache memory, for a generated mix of requests (notebook 19).

A contiguous cache reserves the model's whole context (vLLM's --max-model-len) for every
request, because nobody knows how long the answer will be. A paged cache takes a block of
block_size positions whenever a sequence's last block is full. For a seeded mix of requests
at GPT-2 small's shapes (12 layers, 768 wide, 16-bit K and V: 36,864 bytes a position,
context 1024), this prints, at several block sizes:

- the memory the paged cache holds (tokens written and the empty slots of last blocks),
  the memory contiguous caches reserve, and their ratio;
- the largest waste of one sequence (always under one block) and the block-table entries
  (how many separate blocks attention gathers per layer in one decode step of all of them);
- how many of the requests fit at once in a memory budget (2 GiB by default);
- parallel sampling: n samples of one prompt sharing its blocks against n caches of their own.

Every block count is also counted on a live kvlib BlockAllocator (one layer, one number a
position: the blocks it takes do not depend on the width) and must equal the formula. No
timings: every figure is exact, the same on every machine.

    python benchmarks/paged_memory.py            # 256 requests
    python benchmarks/paged_memory.py --quick    # 32 requests
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import report  # benchmarks/report.py: tables

import kvlib
from kvlib.memory import PRESETS, GiB, MiB
from kvlib.serving import BlockAllocator, PagedKVCache
from kvlib.serving.memory_plan import (
    blocks_for,
    memory_table,
    parallel_sampling_blocks,
    request_mix,
    separate_sampling_blocks,
)

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SAMPLES = (1, 2, 4, 8)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 requests instead of 256")
    parser.add_argument("--requests", type=int, default=None,
                        help="number of requests (default 256, 32 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--budget-gib", type=float, default=2.0,
                        help="cache memory for the 'fit at once' column (default 2 GiB)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 32 if args.quick else 256
    if args.requests < 1 or args.seed < 0 or min(args.block_sizes) < 1 or \
            not 0 < args.budget_gib < 1e6:
        parser.error("--requests and --block-sizes must be at least 1, --seed at least 0, "
                     "--budget-gib positive")
    return args


def counting_config(context_length: int) -> kvlib.ModelConfig:
    """The smallest model a BlockAllocator accepts: its pool counts blocks like any other."""
    return kvlib.ModelConfig(vocab_size=2, d_model=1, n_heads=1, n_layers=1, d_ff=1,
                             context_length=context_length)


def live_blocks(lengths, block_size: int, context_length: int) -> int:
    """Blocks in use once sequences of these lengths are all held in one live pool,
    written a chunk at a time (prompt at once, then the rest) as a server would."""
    config = counting_config(context_length)
    pool = BlockAllocator(config, n_blocks=sum(blocks_for(n, block_size) for n in lengths),
                          block_size=block_size)
    for n in lengths:
        cache = PagedKVCache(pool)
        rows = np.zeros((n, 1))
        cache.append(0, rows, rows)
    pool.check_invariants()
    return pool.n_used


def live_sampling_blocks(prompt: int, new: int, n: int, block_size: int,
                         context_length: int) -> int:
    """Blocks in use after n forks of one prompt each append new rows (copy-on-write)."""
    pool = BlockAllocator(counting_config(context_length), n_blocks=4096,
                          block_size=block_size)
    parent = PagedKVCache(pool)
    parent.append(0, np.zeros((prompt, 1)), np.zeros((prompt, 1)))
    samples = [parent] + [parent.fork() for _ in range(n - 1)]
    for position in range(new):                # the samples take turns, token by token
        for sample in samples:
            row = np.full((1, 1), float(position))
            sample.append(0, row, row)
    pool.check_invariants()
    return pool.n_used


def fits_at_once(lengths, block_size: int, bytes_per_position: int, budget: int) -> int:
    """How many of the requests, taken in order, a paged cache of `budget` bytes holds at
    their full length."""
    used = np.cumsum([blocks_for(n, block_size) * block_size * bytes_per_position
                      for n in lengths])
    return int(np.searchsorted(used, budget, side="right"))


def main(argv=None) -> int:
    args = parse_arguments(argv)
    preset = PRESETS["GPT-2 small"]
    per_position = preset.kv_bytes_per_token()
    context = preset.context_length
    requests = request_mix(args.requests, context, seed=args.seed)
    lengths = [r.max_num_tokens for r in requests]
    budget = int(args.budget_gib * GiB)
    print(f"mode: {'quick' if args.quick else 'full'}")
    print(f"workload: {len(requests)} requests (seed {args.seed}), prompt and output lengths "
          f"log-uniform in {max(1, context // 64)}..{context // 2}; max length {context} "
          "positions")
    print(f"model: {preset.name}, {preset.n_layers} layers, K and V of {preset.n_kv_heads} x "
          f"{preset.head_dim}, 16-bit: {per_position:,} bytes a position")
    print(f"positions written: {sum(lengths):,} (mean {np.mean(lengths):.1f}, shortest "
          f"{min(lengths)}, longest {max(lengths)})")
    print()
    rows = memory_table(lengths, args.block_sizes, context, per_position)
    table = []
    for row in rows:
        live = live_blocks(lengths, row.block_size, context)
        if live != row.block_table_entries:
            print(f"error: a live pool took {live} blocks of {row.block_size}, the formula "
                  f"says {row.block_table_entries}", file=sys.stderr)
            return 1
        table.append([row.block_size, f"{row.used_bytes / MiB:.1f}",
                      f"{row.paged_bytes / MiB:.1f}", f"{100 * row.paged_waste:.2f}%",
                      row.largest_slack, f"{row.reserved_bytes / MiB:.1f}",
                      f"{row.reserved_over_paged:.2f}x", f"{row.block_table_entries:,}",
                      fits_at_once(lengths, row.block_size, per_position, budget)])
    print(f"Memory of the {len(requests)} requests at their full length "
          "(blocks counted on a live BlockAllocator, equal to the formula):")
    print()
    print(report.table(["block size", "written MiB", "paged MiB", "paged waste",
                          "largest slack", "contiguous MiB", "contiguous / paged",
                          "block-table entries", f"fit in {args.budget_gib:g} GiB"], table))
    contiguous_fit = budget // (context * per_position)
    print()
    print(f"contiguous caches of {context} positions: {contiguous_fit} requests fit in "
          f"{args.budget_gib:g} GiB, at any block size")
    print()
    prompt, new, size = 200, 100, 16
    sampling = []
    for n in SAMPLES:
        shared = parallel_sampling_blocks(prompt, new, n, size)
        live = live_sampling_blocks(prompt, new, n, size, context)
        if live != shared:
            print(f"error: {n} live samples took {live} blocks, the formula says {shared}",
                  file=sys.stderr)
            return 1
        separate = separate_sampling_blocks(prompt, new, n, size)
        sampling.append([n, shared, separate, f"{shared * size * per_position / MiB:.2f}",
                         f"{separate * size * per_position / MiB:.2f}",
                         f"{separate / shared:.2f}x"])
    print(f"Parallel sampling: n samples of one {prompt}-token prompt, {new} new tokens each, "
          f"blocks of {size} (counted on a live pool with fork and copy-on-write):")
    print()
    print(report.table(["n", "shared blocks", "separate blocks", "shared MiB",
                          "separate MiB", "separate / shared"], sampling))
    return 0


if __name__ == "__main__":
    sys.exit(main())
