"""What a contiguous cache reserves against what a paged cache uses (paged_cache).

A server that gives every request one contiguous buffer must size it before the request
runs, and it cannot know how many tokens the model will generate: it reserves the longest
sequence the model allows (vLLM's ``--max-model-len``). A paged cache takes a block of
block_size positions whenever the last one is full, so a sequence of n tokens holds
ceil(n / B) blocks and wastes fewer than B positions. This module counts both for a mix of
requests; benchmarks/paged_memory.py prints the table for GPT-2 small's shapes.

- request_mix: a seeded mix of requests (kvlib.serving.Request) of different prompt and
  output lengths;
- blocks_for, slack: blocks a sequence needs, and the empty positions of its last block;
- PagedMemory, paged_memory, memory_table: used, paged and reserved positions and bytes at
  one or several block sizes;
- parallel_sampling_blocks, separate_sampling_blocks: n samples of one prompt with shared
  blocks (copy-on-write) against n caches of their own;
- ContiguousArena: contiguous reservations in one memory (first fit), to show external
  fragmentation: enough free memory in total, but no hole large enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import as_count, as_real_number, as_whole_number, as_whole_numbers
from .request import Request, requests_of_lengths

# ------------------------------------------------------------------ requests


def request_mix(n_requests: int, max_length: int, seed: int = 0, mean_gap: float = 0.0,
                shortest: int | None = None) -> list[Request]:
    """A seeded mix of n_requests requests (paged_cache; benchmarks/paged_memory.py).

    Prompt and output (max_tokens) lengths are each drawn log-uniformly between shortest (by
    default max_length // 64, at least 1) and max_length // 2, so that short requests are
    common and long ones occur, as in chat traffic; every request fits in max_length
    positions (its max_num_tokens). Arrival steps grow by geometric gaps of mean mean_gap (0,
    the default: all arrive at step 0). Prompts are seeded random ids of the toy's
    vocabulary.
    """
    n_requests = as_count("n_requests", n_requests, 1)
    max_length = as_count("max_length", max_length, 2)
    half = max_length // 2
    shortest = as_whole_number("shortest", max(1, max_length // 64) if shortest is None else
                            shortest, 1, half)
    rng = np.random.default_rng(as_whole_number("seed", seed, 0))
    mean_gap = as_real_number("mean_gap", mean_gap, minimum=0)

    def lengths():
        drawn = np.exp(rng.uniform(np.log(shortest), np.log(half + 1), n_requests))
        return np.floor(drawn).astype(int).clip(shortest, half)

    prompts, outputs = lengths(), lengths()
    if mean_gap == 0:
        gaps = np.zeros(n_requests, dtype=int)
    else:
        gaps = rng.geometric(1 / (1 + mean_gap), n_requests) - 1
        gaps[0] = 0
    return requests_of_lengths(prompts, outputs, np.cumsum(gaps).tolist(), seed)


# ------------------------------------------------------------------ blocks of one sequence

def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks a sequence of n_tokens positions holds: ceil(n_tokens / block_size)."""
    n_tokens = as_whole_number("n_tokens", n_tokens, 0)
    block_size = as_count("block_size", block_size, 1)
    return -(-n_tokens // block_size)


def slack(n_tokens: int, block_size: int) -> int:
    """Empty positions in the sequence's last block: always fewer than block_size."""
    return blocks_for(n_tokens, block_size) * int(block_size) - int(n_tokens)


# ------------------------------------------------------------------ a batch of sequences

@dataclass(frozen=True)
class PagedMemory:
    """Memory of a set of sequences held at once, at one block size (paged_cache).

    used: positions really written; paged: positions in the blocks a paged cache takes;
    reserved: positions a contiguous cache reserves (max_length for every sequence).
    block_table_entries: the blocks of all block tables together, which is also how many
    separate blocks attention gathers, per layer, in one decode step of all the sequences.
    """

    block_size: int
    n_sequences: int
    max_length: int
    used_positions: int
    paged_positions: int
    reserved_positions: int
    block_table_entries: int
    largest_slack: int
    bytes_per_position: int

    @property
    def used_bytes(self) -> int:
        return self.used_positions * self.bytes_per_position

    @property
    def paged_bytes(self) -> int:
        return self.paged_positions * self.bytes_per_position

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_positions * self.bytes_per_position

    @property
    def paged_waste(self) -> float:
        """Share of the paged memory that holds no token: under one block a sequence."""
        return 1 - self.used_positions / self.paged_positions

    @property
    def reserved_waste(self) -> float:
        """Share of the contiguous reservation that holds no token."""
        return 1 - self.used_positions / self.reserved_positions

    @property
    def reserved_over_paged(self) -> float:
        """How many times more memory the contiguous reservation takes."""
        return self.reserved_positions / self.paged_positions


def _lengths(lengths) -> list[int]:
    """Sequence lengths, or Requests at their max_num_tokens, as a list of ints >= 1."""
    if isinstance(lengths, (list, tuple)):
        lengths = [r.max_num_tokens if isinstance(r, Request) else r for r in lengths]
    lengths = as_whole_numbers("lengths", lengths, 1).tolist()
    if not lengths:
        raise ValueError("lengths is empty: give at least one sequence")
    return lengths


def paged_memory(lengths, block_size: int, max_length: int,
                 bytes_per_position: int = 1) -> PagedMemory:
    """Used, paged and reserved memory of sequences of the given lengths (or Requests, at
    their full length), held at once (paged_cache). bytes_per_position is K and V of every
    layer for one position (kvlib.config_cache_bytes(config, 1), or
    ModelPreset.kv_bytes_per_token())."""
    lengths = _lengths(lengths)
    if max(lengths, default=0) > max_length:
        raise ValueError(f"a sequence of {max(lengths)} positions is longer than max_length "
                         f"{max_length}, the most a contiguous cache would reserve")
    blocks = [blocks_for(n, block_size) for n in lengths]
    return PagedMemory(
        block_size=block_size, n_sequences=len(lengths), max_length=max_length,
        used_positions=sum(lengths), paged_positions=sum(blocks) * block_size,
        reserved_positions=len(lengths) * max_length, block_table_entries=sum(blocks),
        largest_slack=max(slack(n, block_size) for n in lengths),
        bytes_per_position=bytes_per_position)


def memory_table(lengths, block_sizes, max_length: int,
                 bytes_per_position: int = 1) -> list[PagedMemory]:
    """paged_memory at each block size, in the order given (paged_cache)."""
    block_sizes = as_whole_numbers("block_sizes", block_sizes, 1).tolist()
    lengths = _lengths(lengths)
    max_length = as_whole_number("max_length", max_length, max(lengths, default=1))
    bytes_per_position = as_whole_number("bytes_per_position", bytes_per_position, 1)
    return [paged_memory(lengths, size, max_length, bytes_per_position)
            for size in block_sizes]


# ------------------------------------------------------------------ parallel sampling

def parallel_sampling_blocks(prompt_length: int, new_tokens: int, n_samples: int,
                             block_size: int) -> int:
    """Blocks in use after n_samples continuations of one prompt, new_tokens cached each,
    when they share the prompt's blocks (paged_cache, PagedKVCache.fork).

    The prompt's full blocks stay shared. Its partly filled last block is copied by every
    sample that writes into it but the last one still holding it (copy-on-write), so from
    there on each sample has blocks of its own: ceil((P + k) / B) - P // B of them.
    """
    prompt_length, new_tokens = as_whole_numbers("lengths", [prompt_length, new_tokens]).tolist()
    n_samples, block_size = as_whole_numbers("n_samples and block_size", [n_samples, block_size],
                                          1).tolist()
    if new_tokens == 0:
        return blocks_for(prompt_length, block_size)
    shared = prompt_length // block_size
    own = blocks_for(prompt_length + new_tokens, block_size) - shared
    return shared + n_samples * own


def separate_sampling_blocks(prompt_length: int, new_tokens: int, n_samples: int,
                             block_size: int) -> int:
    """Blocks of n_samples caches of their own, each holding the prompt and new_tokens."""
    n_samples = as_whole_number("n_samples", n_samples, 1)
    prompt_length = as_whole_number("prompt_length", prompt_length, 0)
    new_tokens = as_whole_number("new_tokens", new_tokens, 0)
    return n_samples * blocks_for(prompt_length + new_tokens, block_size)


# ------------------------------------------------------------------ contiguous reservations

class ContiguousArena:
    """A memory of n_positions cache positions in which every request reserves one
    contiguous run, placed first fit (paged_cache): what a server without paging does.

    owners[i] is the request holding position i, or -1. When requests of different sizes
    come and go, the free positions end up scattered between the reservations (external
    fragmentation): reserve() can fail although n_free is larger than the request.
    """

    FREE = -1

    def __init__(self, n_positions: int):
        n_positions = as_count("n_positions", n_positions, 1)
        self.owners = np.full(n_positions, self.FREE, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"ContiguousArena({self.n_free} of {len(self.owners)} positions free, largest "
                f"hole {self.largest_hole})")

    @property
    def n_free(self) -> int:
        return int((self.owners == self.FREE).sum())

    def holes(self) -> list[tuple[int, int]]:
        """The runs of free positions, as (start, length), in order."""
        free = np.concatenate([[False], self.owners == self.FREE, [False]])
        edges = np.flatnonzero(np.diff(free.astype(np.int8)))
        return [(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2])]

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes()), default=0)

    def reserve(self, owner: int, n_positions: int) -> int:
        """Reserve n_positions contiguous positions for owner at the first hole that fits;
        return where they start. MemoryError when no hole is large enough."""
        owner = as_count("owner", owner)
        n_positions = as_whole_number("n_positions", n_positions, 1)
        if (self.owners == owner).any():
            raise ValueError(f"request {owner} already holds a reservation")
        for start, length in self.holes():
            if length >= n_positions:
                self.owners[start:start + n_positions] = owner
                return start
        raise MemoryError(f"no hole of {n_positions} contiguous positions: {self.n_free} are "
                          f"free, but the largest hole has {self.largest_hole} "
                          "(external fragmentation)")

    def release(self, owner: int) -> None:
        """Free the positions of owner's reservation."""
        owner = as_count("owner", owner)
        held = self.owners == owner
        if not held.any():
            raise ValueError(f"request {owner} holds no reservation")
        self.owners[held] = self.FREE
