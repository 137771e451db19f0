"""The pool of cache blocks every serving lesson shares (paged_cache to the_engine; vLLM's
BlockPool, nano-vllm's block_manager.py).

A pool cuts the cache's memory into n_blocks blocks of block_size positions of K and V, in
every layer (one block id serves all layers, as in vLLM): keys and values are
(n_layers, n_blocks, block_size, kv_width). Every block is in exactly one of three states:

- held: ref_counts[block] block tables (and caches) hold it;
- cached and idle: nobody holds it, but it is full and keeps the K and V of a known prefix
  under its key, so that a later request with that prefix can take it back (a prefix hit);
- free: nobody holds it and it keeps nothing.

allocate() takes a free block first, and when none is left evicts the least recently released
idle block (its key forgotten). share() holds a block once more (a fork, a prefix hit),
release() once less: a block nobody holds stays cached if it has a key, and is free otherwise.
Keys are chained through the parent (block_key), over full blocks only, so that a key stands
for every token before the block's end and for the block's position.

The paged_cache lesson's pool holds no keys; the prefix_caching lesson's PrefixCache holds one
reference to each block it keeps (SGLang's way, so its blocks are never idle here); the engine
releases its blocks and lets cached ones wait idle (vLLM's way).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque

import numpy as np

from ..checks import as_count, as_flag, as_whole_number, as_whole_numbers
from ..config import ModelConfig

MAX_POOL_BYTES = 2**40
"""The largest pool kvlib allocates (1 TiB of K and V): a larger one is a typing slip."""

ROOT_KEY = b""
"""The key of the empty prefix: the parent of every sequence's first block."""


def block_key(parent_key: bytes, tokens) -> bytes:
    """The key of one full block (prefix_caching; vLLM's block hash): the SHA-256 digest of its
    parent's key and its token ids, 32 bytes.

    The parent's key stands for every token before the block, so two blocks get the same key
    only when the whole prefix up to their end is the same: the same tokens at the same
    positions. The root's key is ROOT_KEY (b"").
    """
    return hashlib.sha256(parent_key + np.asarray(tokens, dtype="<i8").tobytes()).digest()


def block_keys(ids, block_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of the full blocks of a sequence, in order (prefix_caching): len(ids) // block_size
    of them; a partly filled last block has no key, it is never shared."""
    ids, block_size = as_whole_numbers("ids", ids).tolist(), as_count("block_size", block_size, 1)
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_key(parent, ids[start:start + block_size])
        keys.append(parent)
    return keys


class BlockPool:
    """n_blocks blocks of block_size positions of K and V in every layer, their reference
    counts, a free queue, and the prefix cache's keys (paged_cache, prefix_caching, the_engine).

    BlockPool(config, n_blocks, block_size=16, enable_prefix_caching=True). config None makes
    a pool of block ids without K and V (a scheduler that only counts blocks: batched_decoding).
    generations[block] counts how often the block was allocated, so that a cache can tell its
    block from the same block allocated again to someone else.
    """

    def __init__(self, config: ModelConfig | None, n_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):
        self.config = config
        self.n_blocks, self.block_size = as_count("n_blocks", n_blocks, 1), as_count("block_size",
                                                                                block_size, 1)
        self.enable_prefix_caching = as_flag("enable_prefix_caching", enable_prefix_caching)
        self.keys = self.values = None
        if not isinstance(config, (ModelConfig, type(None))):
            raise TypeError(f"config must be a kvlib ModelConfig (or None), got {config!r:.60}")
        if config is not None and (config.latent_dim is not None or config.window is not None):
            raise ValueError("a pool of blocks holds K and V: use a model without a latent or "
                             "a sliding window")
        if config is not None:
            self.width = config.kv_width
            shape = (config.n_layers, self.n_blocks, self.block_size, self.width)
            if 2 * math.prod(shape) * config.numpy_dtype.itemsize > MAX_POOL_BYTES:
                raise ValueError(f"{self.n_blocks:,} blocks of {self.block_size:,} positions "
                                 f"is far more cache than the {MAX_POOL_BYTES:,} bytes kvlib "
                                 "allows: give fewer or smaller blocks")
            self.keys = np.zeros(shape, dtype=config.numpy_dtype)
            self.values = np.zeros(shape, dtype=config.numpy_dtype)
        self.ref_counts = np.zeros(self.n_blocks, dtype=np.int64)
        self.generations = np.zeros(self.n_blocks, dtype=np.int64)
        self.free: deque[int] = deque(range(self.n_blocks))
        self.idle: OrderedDict[int, None] = OrderedDict()      # cached, unheld; oldest first
        self.key_of: list[bytes | None] = [None] * self.n_blocks
        self.cached: dict[bytes, int] = {}                     # key -> block

    def __repr__(self) -> str:
        return (f"BlockPool({self.n_used} of {self.n_blocks} blocks in use, {self.block_size} "
                f"positions a block, {len(self.cached)} cached)")

    # ------------------------------------------------------------------ counts

    @property
    def n_free(self) -> int:
        """Blocks an allocation can take now: free ones and idle cached ones (evicted if
        taken)."""
        return len(self.free) + len(self.idle)

    @property
    def n_used(self) -> int:
        """Blocks somebody holds."""
        return self.n_blocks - self.n_free

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of block_size positions in every layer."""
        return 2 * self.config.n_layers * self.block_size * self.width * self.keys.itemsize

    @property
    def nbytes_in_use(self) -> int:
        """Bytes of the blocks somebody holds (shared blocks counted once)."""
        return self.n_used * self.block_bytes

    # ------------------------------------------------------------------ holding blocks

    def allocate(self) -> int:
        """A block for new rows, with one reference: a free one, else the least recently
        released idle one, evicted (evicting() says beforehand whether it will be)."""
        if self.free:
            block = self.free.popleft()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            self.uncache(block)
        else:
            raise MemoryError(f"out of cache blocks: all {self.n_blocks} are in use. A server "
                              "would now wait, or preempt a sequence and recompute it later")
        self.ref_counts[block] = 1
        self.generations[block] += 1
        return block

    def evicting(self) -> bool:
        """True when the next allocate() evicts a cached block (no block is free)."""
        return not self.free

    def share(self, block: int) -> int:
        """One more holder of a block that is held or cached (a fork, a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.idle[block]
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> bool:
        """One holder less. A block nobody holds waits idle if it is cached, and is free
        otherwise: True when it became free."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return False
        if self.key_of[block] is not None:
            self.idle[block] = None                       # most recently released, last
            return False
        self.free.append(block)
        return True

    def copy(self, block: int) -> int:
        """A new block with the same contents in every layer (copy-on-write)."""
        new = self.allocate()
        self.keys[:, new] = self.keys[:, block]
        self.values[:, new] = self.values[:, block]
        return new

    def check_in_use(self, block) -> None:
        """Refuse a block id that is not a held block of this pool (a block table pointing at
        a block that was released: a sequence used after it was freed?)."""
        as_whole_number("block", block, 0, self.n_blocks - 1)
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not held: a block table points at a block "
                             "that was released (a sequence used after it was freed?)")

    # ------------------------------------------------------------------ the prefix cache

    def keys_of(self, tokens, parent: bytes = ROOT_KEY) -> list[bytes]:
        """Chained keys of the full blocks of tokens (a partial last block has none)."""
        keys = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = block_key(parent, tokens[start:start + self.block_size])
            keys.append(parent)
        return keys

    def lookup(self, tokens) -> list[int]:
        """The cached blocks of the longest cached prefix of tokens, in whole blocks: their
        keys followed from the first block, up to the first miss."""
        found = []
        for key in self.keys_of(tokens) if self.enable_prefix_caching else ():
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def lookup_keys(self, keys) -> list[int]:
        """The cached blocks of a sequence whose full blocks have these keys, in order, up to
        the first one not cached (lookup, with the keys computed by the caller)."""
        found = []
        for key in keys if self.enable_prefix_caching else ():
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def cache(self, block: int, key: bytes) -> bool:
        """Keep a full, held block under its key, unless another block keeps that key already
        (or caching is off): True when it was cached."""
        if not self.enable_prefix_caching or key in self.cached or self.key_of[block]:
            return False
        self.cached[key] = block
        self.key_of[block] = key
        return True

    def uncache(self, block: int) -> None:
        """Forget a block's key (an eviction); an idle block becomes free."""
        del self.cached[self.key_of[block]]
        self.key_of[block] = None
        if self.idle.pop(block, False) is None:
            self.free.append(block)

    # ------------------------------------------------------------------ all or nothing

    def checkpoint(self):
        """The bookkeeping (not K and V): restore(checkpoint) puts it back. Its size is the
        pool's, whatever has been served before."""
        return (self.ref_counts.copy(), self.generations.copy(), deque(self.free),
                OrderedDict(self.idle), list(self.key_of), dict(self.cached))

    def restore(self, state) -> None:
        (self.ref_counts, self.generations, self.free, self.idle, self.key_of,
         self.cached) = state

    def check_invariants(self, holders: dict[int, int] | None = None) -> None:
        """Raise AssertionError unless every block is in exactly one state (free, idle or
        held), free blocks keep no key, idle ones do, the keys agree both ways, and (given
        holders {block: block tables holding it}) each reference count is its holders."""
        free, idle = set(self.free), set(self.idle)
        held = set(np.flatnonzero(self.ref_counts > 0).tolist())
        if len(free) != len(self.free) or free & idle or free & held or idle & held:
            raise AssertionError("a block is in two states at once, or on the free list twice")
        if free | idle | held != set(range(self.n_blocks)) or (self.ref_counts < 0).any():
            raise AssertionError("a block is neither free, idle nor held: it leaked")
        if any(self.key_of[b] is not None for b in free) or \
                any(self.key_of[b] is None for b in idle):
            raise AssertionError("a free block kept a key, or an idle block lost its")
        if {b: k for b, k in enumerate(self.key_of) if k is not None} != \
                {b: k for k, b in self.cached.items()}:
            raise AssertionError("the cache's keys and the blocks' keys disagree")
        if holders is not None and any(self.ref_counts[b] != holders.get(b, 0)
                                       for b in range(self.n_blocks)):
            raise AssertionError("a reference count differs from the block tables holding it")


BlockAllocator = BlockPool
"""The paged_cache lesson's name for the pool (it allocates the blocks of PagedKVCache)."""
