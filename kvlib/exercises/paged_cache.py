"""Exercises of the paged_cache lesson (the paged KV cache): checkers and solutions.

1. Blocks and empty positions of a 1,234-token request at vLLM's block size 16 (transfer:
   the lesson counts the toy's blocks of 4).
2. Find the bug: a gather that looks the block up with p % B instead of p // B.
3. Predict: blocks in use after three samples of one prompt decode five tokens each.
"""

from __future__ import annotations

import math
import warnings
from numbers import Integral, Real

import numpy as np

import kvlib
from kvlib.serving import BlockAllocator, PagedKVCache
from kvlib.serving.memory_plan import (
    blocks_for,
    parallel_sampling_blocks,
    separate_sampling_blocks,
    slack,
)

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    read_whole_number,
    show_solution,
    shown,
)

EXERCISE1 = {"n_tokens": 1234, "block_size": 16}
EXERCISE3 = {"prompt_length": 10, "new_tokens": 5, "n_samples": 3, "block_size": 4}
# Exercise 2: (block size, prompts of the sequences sharing one pool, which one is read,
# which one finishes once written and gives its blocks back, blocks in the pool). Blocks
# given back return at the end of the free queue, so that the last case's table is not in
# ascending order: [1, 4, 5, 0, 3].
GATHER_CASES = ((2, (7, 5, 6), 0, None, 24), (4, (9, 6, 13), 2, None, 24),
                (3, (3, 8), 1, None, 24), (4, (4, 8), 1, None, 24), (1, (3, 5), 0, None, 24),
                (5, (12, 2, 11), 2, None, 24), (2, (4, 10, 2), 1, 0, 6))


def _whole(value) -> int | None:
    """A whole number as an int (also 14.0 or a numpy integer); None for anything else.
    Huge ints stay ints: float(10**400) would overflow."""
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return None
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        value = float(value)
        if math.isfinite(value) and value == int(value):
            return int(value)
    return None


def _pair(answer):
    """(a, b) from a tuple, list or array of two numbers; None if it is not one. The
    numbers may be any Real (rounded ones are judged by the caller)."""
    if isinstance(answer, np.ndarray):
        if answer.shape != (2,):
            return None
        answer = list(answer)
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return None
    if not all(isinstance(x, Real) and not isinstance(x, (bool, np.bool_)) for x in answer):
        return None
    return answer


# Exercise 1 ------------------------------------------------------------------------------

@checker
def check_blocks_and_slack(answer) -> Feedback:
    """Exercise 1: (blocks, empty positions in the last block) for 1,234 tokens in blocks of
    16."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with two numbers, "
                        "(blocks, empty positions).")
    n, size = EXERCISE1["n_tokens"], EXERCISE1["block_size"]
    blocks, empty = blocks_for(n, size), slack(n, size)
    if _whole(answer) is not None:
        return Feedback(False, "give two numbers, (blocks, empty positions): "
                        f"answer = ({shown(answer)}, ...).")
    pair = _pair(answer)
    if pair is None:
        return Feedback(False, "expected two numbers, (blocks, empty positions), for example "
                        f"answer = (10, 3); got {described(answer)}.")
    got_blocks, got_empty = (_whole(x) for x in pair)
    if got_blocks is None:
        return Feedback(False, f"{shown(pair[0])} blocks: a sequence holds whole blocks. "
                        "Divide and round up (-(-n // B) in Python, or math.ceil).")
    if got_empty is None:
        return Feedback(False, f"{shown(pair[1])} empty positions: positions are whole too.")
    if (got_blocks, got_empty) == (blocks, empty):
        return Feedback(True, f"{blocks} blocks of {size} hold {blocks * size} positions: "
                        f"{empty} of them empty in the last block, {empty / n:.1%} of the "
                        "request. Fewer than one block is ever wasted.")
    if got_blocks == n // size:
        return Feedback(False, f"{got_blocks} blocks hold only {got_blocks * size} positions: "
                        f"round up, not down. The last {n % size} tokens need a block too.")
    if got_blocks == n:
        return Feedback(False, "that counts positions, not blocks: a block holds 16.")
    if got_blocks > blocks:
        extra = "one block" if got_blocks == blocks + 1 else f"{shown(got_blocks - blocks)} blocks"
        return Feedback(False, f"{extra} too many: {blocks} blocks already hold "
                        f"{blocks * size} >= {n} positions.")
    if got_blocks != blocks:
        return Feedback(False, f"not {shown(got_blocks)} blocks: divide {n} by {size} and "
                        "round up.")
    if got_empty == n % size:
        return Feedback(False, f"{n % size} is how many positions of the last block are "
                        f"filled ({n} % {size}). Empty ones: {blocks} x {size} - {n}.")
    if got_empty < 0:
        return Feedback(False, "a negative number of empty positions: blocks x block size is "
                        "at least the number of tokens.")
    if got_empty == 0:
        return Feedback(False, f"{n} is not a multiple of {size}, so the last block is only "
                        "partly filled.")
    if got_empty >= size:
        return Feedback(False, "a paged cache never wastes a whole block: the empty positions "
                        "are fewer than the block size.")
    return Feedback(False, f"{blocks} blocks is right, but not {shown(got_empty)} empty "
                    f"positions: {blocks} x {size} - {n}.")


# Exercise 2 ------------------------------------------------------------------------------

def gather_reference(pool, block_table, n_positions, block_size):
    """The right gather: position p is row p % B of block block_table[p // B]."""
    return np.stack([pool[block_table[p // block_size], p % block_size]
                     for p in range(n_positions)])


def _gather_block_by_remainder(pool, block_table, n_positions, block_size):
    return np.stack([pool[block_table[p % block_size], p % block_size]
                     for p in range(n_positions)])


def _gather_swapped(pool, block_table, n_positions, block_size):
    return np.stack([pool[block_table[p % block_size], p // block_size]
                     for p in range(n_positions)])


def _gather_without_table(pool, block_table, n_positions, block_size):
    return np.stack([pool[p // block_size, p % block_size] for p in range(n_positions)])


def _gather_untrimmed(pool, block_table, n_positions, block_size):
    return pool[np.asarray(block_table)].reshape(-1, pool.shape[-1])


def _gather_sorted(pool, block_table, n_positions, block_size):
    return pool[sorted(block_table)].reshape(-1, pool.shape[-1])[:n_positions]


def _gather_cases():
    """(pool keys of layer 0, block table, length, block size) of sequences that share one
    pool, written in turns so that their blocks interleave."""
    params = kvlib.init_params()
    rng = np.random.default_rng(17)
    for block_size, lengths, reader, finishing, n_blocks in GATHER_CASES:
        pool = BlockAllocator(params.config, n_blocks=n_blocks, block_size=block_size)
        caches = [PagedKVCache(pool) for _ in lengths]
        ids = [list(rng.integers(0, params.config.vocab_size, n)) for n in lengths]
        for position in range(max(lengths)):       # a token of each sequence in turn
            for index, (cache, sequence) in enumerate(zip(caches, ids)):
                if position < len(sequence):
                    kvlib.prefill(params, [int(sequence[position])], cache)
                    if index == finishing and position == len(sequence) - 1:
                        cache.free()               # its blocks go back to the pool
        cache = caches[reader]
        yield pool.keys[0].copy(), list(cache.block_table), len(cache), block_size, \
            cache.keys(0).copy()


WRONG_GATHERS = (
    (_gather_block_by_remainder, "the block of position p is block_table[p // B]: p % B is "
     "its row inside the block, and is the same for positions B apart"),
    (_gather_swapped, "block and row are swapped: the block is block_table[p // B], the row "
     "inside it p % B"),
    (_gather_without_table, "the block table is not used: block p // B of the pool belongs to "
     "whichever sequence took it. Look it up: block_table[p // B]"),
    (_gather_untrimmed, "you return every row of every block: the last block is only partly "
     "filled. Keep the first n_positions rows"),
    (_gather_sorted, "the blocks are read in the order of their numbers, not in the table's "
     "order: a block given back by a finished request is reused later, so a table need not "
     "be ascending. Take block_table[p // B] as it is"),
)


@checker
def check_gather(gather) -> Feedback:
    """Exercise 2: a fixed `gather(pool, block_table, n_positions, block_size) -> (n, width)`.

    Runs it on sequences that share a pool with blocks of 1 to 5 positions and compares with
    the keys PagedKVCache reads (its block table, then a contiguous KVCache's equal rows).
    """
    if is_missing(gather):
        return Feedback(False, "your fixed function is not filled in yet: write "
                        "gather_fixed, then set answer = gather_fixed (without calling it).")
    if not callable(gather):
        return Feedback(False, f"answer should be a function like gather_broken, not "
                        f"{described(gather)}: write answer = gather_fixed.")
    for pool, table, n, size, expected in _gather_cases():
        where = (f"for a sequence of {n} positions in blocks of {size}, block table "
                 f"{table}")
        try:
            got = gather(pool.copy(), list(table), n, size)
        except IndexError as error:
            return Feedback(False, f"{where}, your function raised IndexError ({error}): an "
                            "index ran past the end of the block table or of a block. Position "
                            f"p is row p % {size} of block block_table[p // {size}].")
        except Exception as error:  # a student's code may fail in any way; report it in words
            return Feedback(False, f"{where}, your function raised {type(error).__name__}: "
                            f"{error}")
        try:
            with warnings.catch_warnings():      # complex numbers: refused, not truncated
                warnings.simplefilter("error")
                got = np.asarray(got, dtype=float)
        except (TypeError, ValueError, OverflowError, Warning):
            return Feedback(False, f"{where}: expected an array of numbers of shape "
                            f"{expected.shape}, got {described(got)}.")
        for wrong, diagnosis in WRONG_GATHERS:
            try:
                mistaken = wrong(pool, table, n, size)
            except IndexError:
                continue
            if got.shape == mistaken.shape and np.allclose(got, mistaken) and \
                    not (got.shape == expected.shape and np.allclose(got, expected)):
                return Feedback(False, f"{where}: {diagnosis}.")
        if got.shape != expected.shape:
            return Feedback(False, f"{where}: expected the sequence's rows, shape "
                            f"{expected.shape} (one per position), got {got.shape}.")
        if not np.allclose(got, expected, atol=1e-12):
            wrong_rows = np.flatnonzero(~np.isclose(got, expected).all(axis=1))
            return Feedback(False, f"{where}: rows {wrong_rows[:6].tolist()} are not the keys of "
                            "those positions. Position p is row p % B of block "
                            "block_table[p // B].")
    return Feedback(True, f"all {len(GATHER_CASES)} sequences read back exactly as "
                    "PagedKVCache reads them, block sizes 1 to 5, a block table out of order "
                    "among them.")


# Exercise 3 ------------------------------------------------------------------------------

@checker
def check_forked_blocks(answer) -> Feedback:
    """Exercise 3: blocks in use after 3 samples of a 10-token prompt (blocks of 4) decode
    5 tokens each."""
    value = read_whole_number(answer, "a number of blocks")
    if isinstance(value, Feedback):
        return value
    e = EXERCISE3
    expected = parallel_sampling_blocks(e["prompt_length"], e["new_tokens"], e["n_samples"],
                                        e["block_size"])
    separate = separate_sampling_blocks(e["prompt_length"], e["new_tokens"], e["n_samples"],
                                        e["block_size"])
    full, partial = divmod(e["prompt_length"], e["block_size"])
    final = blocks_for(e["prompt_length"] + e["new_tokens"], e["block_size"])
    if value == expected:
        return Feedback(True, f"{expected} blocks: the {full} full prompt blocks shared, "
                        f"then {final - full} blocks of each sample's own (the prompt's "
                        "partly filled block, which the first samples to write copy and the "
                        "last holder keeps and writes in place, and one new block), against "
                        f"{separate} for three caches of their own.")
    if value == separate:
        return Feedback(False, f"{separate} is three caches of their own. The samples share "
                        "the prompt's blocks: what is copied, and when?")
    if value == full + 1 + e["n_samples"] * (final - full - 1):
        return Feedback(False, f"the prompt's last block holds only {partial} of its "
                        f"{e['block_size']} positions: each sample writes its own tokens "
                        "into it, so it cannot stay shared (copy-on-write).")
    if value == full + 1 + e["n_samples"] * (final - full):
        return Feedback(False, "one block too many: the last sample still holding the "
                        "shared block is its only owner by then, and writes into it in place.")
    if value == final:
        return Feedback(False, f"{final} is one sample's table; there are "
                        f"{e['n_samples']}.")
    return Feedback(False, f"not {shown(value)}. Count the prompt's full blocks (shared), "
                    "then the blocks each sample owns once it has written its 5 tokens.")


SOLUTIONS = {
    1: """
n, B = 1234, 16
blocks = -(-n // B)              # round up: 78
answer = (blocks, blocks * B - n)   # (78, 14): 14 empty positions in the last block
""",
    2: """
def gather_fixed(pool, block_table, n_positions, block_size):
    rows = []
    for p in range(n_positions):
        block = block_table[p // block_size]    # which block: the table's entry p // B
        row = p % block_size                    # where inside it
        rows.append(pool[block, row])
    return np.array(rows)

answer = gather_fixed
""",
    3: """
# the prompt's 2 full blocks stay shared; its third block (2 of 4 positions) is copied by
# the first two samples that write into it, the third writes in place; 15 positions need a
# fourth block each
answer = 2 + 3 * 2
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
