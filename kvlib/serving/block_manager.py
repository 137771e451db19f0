"""The engine's pool of cache blocks, with prefix caching (the_engine; what vLLM's
BlockPool and KVCacheManager do, in about a hundred lines, as nano-vllm's block_manager.py).

Every block is in exactly one of three states:

- held: some running request has it in its block table (ref_counts[block] of them);
- cached and idle: nobody holds it, but it is full and keeps the K and V of a known prefix,
  under its key, so a later request with that prefix can take it back (a prefix-cache hit);
- free: nobody holds it and it keeps nothing.

A new block is taken from the free ones first; when there are none, the least recently
released cached block is evicted (its key forgotten) and taken. Keys are chained through the
parent (kvlib.serving.prefix.block_key), over full blocks only, so a key stands for every
token before the block's end. Blocks enter the cache as soon as they fill, while their
request still runs (vLLM's cache_blocks, SGLang's cache_unfinished_req, nano-vllm's
hash_blocks): a second request with the same system prompt reuses them at once.

keys and values are the pool itself, (n_layers, n_blocks, block_size, kv_width).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from ..checks import whole_number
from ..config import ModelConfig
from .prefix import ROOT_KEY, block_key


class BlockManager:
    """Blocks, their reference counts, and the prefix cache's keys (the_engine)."""

    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"BlockManager needs a ModelConfig, got {type(config).__name__}")
        if config.latent_dim is not None or config.window is not None:
            raise ValueError("the engine's blocks hold K and V: use a model without a latent "
                             "or a sliding window")
        self.n_blocks = whole_number("n_blocks", n_blocks, 1)
        self.block_size = whole_number("block_size", block_size, 1)
        if self.n_blocks * self.block_size * config.kv_width * config.n_layers > 2**32:
            raise ValueError(f"{n_blocks} blocks of {block_size} positions is far more cache "
                             "than this machine holds for this model")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got "
                            f"{enable_prefix_caching!r}")
        self.enable_prefix_caching = enable_prefix_caching
        shape = (config.n_layers, self.n_blocks, self.block_size, config.kv_width)
        self.keys = np.zeros(shape, dtype=config.numpy_dtype)
        self.values = np.zeros(shape, dtype=config.numpy_dtype)
        self.ref_counts = [0] * self.n_blocks
        self.key_of: list[bytes | None] = [None] * self.n_blocks
        self.cached: dict[bytes, int] = {}              # key -> block
        self.free: deque[int] = deque(range(self.n_blocks))
        self.idle: OrderedDict[int, None] = OrderedDict()   # cached, unheld; oldest first

    # ------------------------------------------------------------------ counts

    @property
    def n_free(self) -> int:
        """Blocks a request can take now: free ones and idle cached ones (evicted if taken)."""
        return len(self.free) + len(self.idle)

    @property
    def n_held(self) -> int:
        """Blocks some unfinished request holds."""
        return self.n_blocks - self.n_free

    # ------------------------------------------------------------------ taking and giving back

    def take(self) -> tuple[int, int | None]:
        """A block for new rows -> (block, the cached block evicted to get it, or None)."""
        if self.free:
            block = self.free.popleft()
            evicted = None
        elif self.idle:
            block, _ = self.idle.popitem(last=False)        # least recently released
            del self.cached[self.key_of[block]]
            self.key_of[block] = None
            evicted = block
        else:
            raise MemoryError("no block is free or idle: the scheduler must check n_free first")
        self.ref_counts[block] = 1
        return block, evicted

    def hold(self, block: int) -> None:
        """One more holder of a cached block (a prefix-cache hit, or a block it still holds)."""
        if self.ref_counts[block] == 0:
            del self.idle[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> bool:
        """One holder less. A block nobody holds stays cached (idle) if it has a key, and is
        free otherwise. Returns True when the block was freed, False when it was kept."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return False
        if self.key_of[block] is not None:
            self.idle[block] = None                       # most recently released, last
            return False
        self.free.append(block)
        return True

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
        if not self.enable_prefix_caching:
            return []
        found = []
        for key in self.keys_of(tokens):
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def cache(self, block: int, key: bytes) -> None:
        """Keep a full block under its key (if no other block keeps that key already)."""
        if self.enable_prefix_caching and key not in self.cached and self.key_of[block] is None:
            self.cached[key] = block
            self.key_of[block] = key

    # ------------------------------------------------------------------ checks

    def check(self, holders: dict[int, int]) -> None:
        """Raise AssertionError unless every block is in exactly one state and each held
        block's reference count is the number of block tables that hold it (holders)."""
        free, idle = set(self.free), set(self.idle)
        held = {b for b in range(self.n_blocks) if self.ref_counts[b] > 0}
        if len(free) != len(self.free) or free & idle or free & held or idle & held:
            raise AssertionError("a block is in two states at once")
        if free | idle | held != set(range(self.n_blocks)):
            raise AssertionError("a block is in no state: it leaked")
        if any(self.ref_counts[b] != holders.get(b, 0) for b in range(self.n_blocks)):
            raise AssertionError("a reference count differs from the block tables holding it")
        if any(self.key_of[b] is None for b in idle) or any(self.key_of[b] for b in free):
            raise AssertionError("an idle block lost its key, or a free block kept one")
        if {b: k for b, k in enumerate(self.key_of) if k is not None} != \
                {b: k for k, b in self.cached.items()}:
            raise AssertionError("the cache's keys and the blocks' keys disagree")
