"""Blocks of cache memory shared by many sequences (paged_cache; vLLM's PagedAttention).

A serving engine does not reserve a sequence's whole context up front. It cuts the cache's
memory into blocks of block_size positions and hands them out as tokens arrive: a sequence's
K and V live in whichever blocks it was given, and its block table lists them in order.
Blocks are reference-counted, so several sequences (parallel samples of one prompt, requests
with a common prefix) can point at the same block; a block returns to the free list when the
last of them lets it go.
"""

from __future__ import annotations

import math
from collections import deque
from numbers import Integral

import numpy as np

from ..checks import count
from ..config import ModelConfig

MAX_POOL_BYTES = 2**40
"""The largest pool kvlib allocates (1 TiB of K and V): a larger one is a typing slip."""


class BlockAllocator:
    """A pool of n_blocks blocks, each block_size positions of K and V in every layer.

    keys and values are (n_layers, n_blocks, block_size, kv_width): block b holds, in every
    layer, the rows of block_size consecutive positions of one sequence (one block id serves
    all layers, as in vLLM). allocate() takes a block from the free list, share() adds a
    reference, release() drops one; a block with no reference is free again.
    """

    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int = 16):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"BlockAllocator needs a ModelConfig, got {type(config).__name__}")
        if config.latent_dim is not None or config.window is not None:
            raise ValueError("kvlib's paged cache holds K and V: use a config without a "
                             "latent or a window")
        self.config = config
        self.n_blocks = count("n_blocks", n_blocks, 1)
        self.block_size = count("block_size", block_size, 1)
        self.width = config.kv_width
        shape = (config.n_layers, self.n_blocks, self.block_size, self.width)
        pool_bytes = 2 * math.prod(shape) * config.numpy_dtype.itemsize
        if pool_bytes > MAX_POOL_BYTES:
            raise ValueError(f"a pool of {self.n_blocks:,} blocks of {self.block_size:,} "
                             f"positions takes {pool_bytes:,} bytes of K and V, more than the "
                             f"{MAX_POOL_BYTES:,} kvlib allows: give fewer or smaller blocks")
        self.keys = np.zeros(shape, dtype=config.numpy_dtype)
        self.values = np.zeros(shape, dtype=config.numpy_dtype)
        self.ref_counts = np.zeros(self.n_blocks, dtype=np.int64)
        # how many times each block was taken from the free list: a cache notes it when it
        # takes a block, so that it can tell its block from the same block taken again later
        self.generations = np.zeros(self.n_blocks, dtype=np.int64)
        self._free = deque(range(self.n_blocks))

    def __repr__(self) -> str:
        return (f"BlockAllocator({self.n_used} of {self.n_blocks} blocks in use, "
                f"{self.block_size} positions a block)")

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of block_size positions in every layer."""
        return 2 * self.config.n_layers * self.block_size * self.width * self.keys.itemsize

    @property
    def nbytes_in_use(self) -> int:
        """Bytes of the blocks some sequence holds (shared blocks counted once)."""
        return self.n_used * self.block_bytes

    def allocate(self) -> int:
        """A free block, with one reference; a clear error when none is left."""
        if not self._free:
            raise MemoryError(f"out of cache blocks: all {self.n_blocks} are in use. A server "
                              "would now wait, or preempt a sequence and recompute it later")
        block = self._free.popleft()
        self.ref_counts[block] = 1
        self.generations[block] += 1
        return block

    def share(self, block: int) -> int:
        """One more reference to a block that is in use (a fork, a cached prefix)."""
        self.check_in_use(block)
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        self.check_in_use(block)
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def copy(self, block: int) -> int:
        """A new block with the same contents in every layer (copy-on-write)."""
        self.check_in_use(block)
        new = self.allocate()
        self.keys[:, new] = self.keys[:, block]
        self.values[:, new] = self.values[:, block]
        return new

    def check_in_use(self, block) -> None:
        if isinstance(block, bool) or not isinstance(block, Integral) or \
                not 0 <= block < self.n_blocks:
            raise ValueError(f"block must be a block id between 0 and {self.n_blocks - 1}, "
                             f"got {block!r}")
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free: a block table points at a block that was "
                             "released (a sequence used after it was freed?)")

    def check_invariants(self) -> None:
        """Every block is either free or referenced, never both, and none is lost."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if any(self.ref_counts[b] != 0 for b in free):
            raise AssertionError("a block on the free list is still referenced")
        if (self.ref_counts > 0).sum() + len(free) != self.n_blocks:
            raise AssertionError("a block is neither free nor referenced: it leaked")
