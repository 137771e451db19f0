"""Block accounting per layer type (local_and_global_layers; vLLM V1's hybrid KV cache manager): the
layers of a model that mixes sliding-window and global attention are cut into KV cache
groups, each group keeps its own block table for every request, and all groups take their
blocks from one pool.

What this follows, read in vLLM's repository (main, the files at the commits named):
- docs/design/hybrid_kv_cache_manager.md (commit 1153c0c, written against 458e74e): one pool
  of blocks of one page size; the layers cut into groups of one attention type each and of
  the same number of layers, "the smallest layer count among all attention types" (Gemma 3
  270M: 15 sliding, 3 global -> 3 layers a group: 1 full-attention group, 5 sliding ones; a
  type's last group may be padded); a block of the pool holds block_size positions of K and V
  for one layer of each group's slot, and the prefix cache is keyed by (block hash, group).
- vllm/v1/core/single_type_kv_cache_manager.py (commit 129ab7c): FullAttentionManager keeps
  every block of a request; SlidingWindowManager.get_num_skipped_tokens(n) = max(0, n -
  sliding_window + 1): the positions no future query reads once n tokens are computed, and
  remove_skipped_blocks frees the blocks made only of them, putting the null block in their
  place in the table. find_longest_cache_hit: for full attention the cached blocks from the
  first on, up to the first miss; for a sliding window, scanning from the right, the first
  run of cdiv(sliding_window - 1, block_size) cached blocks (the blocks before it are null).
- vllm/v1/core/kv_cache_coordinator.py (commit 52b9a57): UnitaryKVCacheCoordinator for one
  group; HybridKVCacheCoordinator takes the full-attention hit first (a left-to-right scan),
  then each other attention type's longest hit within it, groups of one spec together, and
  repeats until no type shortens the hit: the longest prefix every group can serve.
  disable_hybrid_kv_cache_manager (vLLM's engine argument) counts sliding layers as global:
  one group of every layer.

kvlib keeps its one BlockPool (block ids, reference counts, prefix keys, LRU eviction) and
stores the K and V of each block for `layers_per_group` layers (KVCacheTensors); a null
block is NULL_BLOCK (-1) in a table (vLLM reserves a real block, number 0, so that its GPU
kernels can index it: vllm/v1/core/block_pool.py, null_block; numpy never reads it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..checkpoints.gemma3 import Gemma3Config
from ..checks import as_count, as_flag, as_whole_number
from .block_pool import BlockPool

FULL, SLIDING = "full_attention", "sliding_attention"
NULL_BLOCK = -1
"""The null block in a block table: a sliding layer's block that left the window, freed."""


# ---------------------------------------------------------------------- pure helpers

def skipped_tokens(num_computed_tokens: int, sliding_window: int | None) -> int:
    """Positions no future query of a layer reads once num_computed_tokens have K and V
    (vLLM's get_num_skipped_tokens): the next query, at position num_computed_tokens, sees
    the sliding_window positions ending at itself; a global layer (sliding_window None)
    skips none."""
    num_computed_tokens = as_whole_number("num_computed_tokens", num_computed_tokens)
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - as_count("sliding_window", sliding_window, 1) + 1)


def freeable_blocks(num_computed_tokens: int, sliding_window: int | None,
                    block_size: int) -> range:
    """The indices (in a request's block table) of the blocks a layer may free once
    num_computed_tokens have K and V: those made only of skipped positions (vLLM's
    remove_skipped_blocks). None for a global layer (sliding_window None)."""
    block_size = as_count("block_size", block_size, 1)
    return range(skipped_tokens(num_computed_tokens, sliding_window) // block_size)


def blocks_for_hit(hit_tokens: int, sliding_window: int | None, block_size: int) -> range:
    """The indices of the blocks a prefix hit of hit_tokens (whole blocks) needs cached in a
    layer: every block for a global layer; for a sliding one only those holding the
    sliding_window - 1 positions before the hit point, which the next query reads."""
    hit_tokens = as_whole_number("hit_tokens", hit_tokens)
    block_size = as_count("block_size", block_size, 1)
    if hit_tokens % block_size:
        raise ValueError(f"a prefix hit is whole blocks: {hit_tokens} tokens are not a "
                         f"multiple of the block size {block_size}")
    first = skipped_tokens(hit_tokens, sliding_window) // block_size
    return range(first, hit_tokens // block_size)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table (vLLM's KVCacheGroupSpec): their attention
    ("full_attention" or "sliding_attention"), the layers, and the window of a sliding
    group. All groups of a model have the same number of layer slots (padded)."""

    attention: str
    layers: tuple[int, ...]
    sliding_window: int | None = None

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return skipped_tokens(num_computed_tokens, self.sliding_window)


def kv_cache_groups(config: Gemma3Config, hybrid: bool = True) -> tuple[KVCacheGroup, ...]:
    """A model's layers cut into KV cache groups as vLLM cuts them: each attention type's
    layers, in order, in groups of the smallest layer count among the types (the last group
    of a type may hold fewer: padding); full attention first. hybrid False: one
    full-attention group of every layer (vLLM's disable_hybrid_kv_cache_manager: a sliding
    layer is counted as global, its window still applies in attention)."""
    if not isinstance(config, Gemma3Config):
        raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
    if not as_flag("hybrid", hybrid):
        return (KVCacheGroup(FULL, tuple(range(config.num_hidden_layers))),)
    by_type = {kind: [i for i, t in enumerate(config.layer_types) if t == kind]
               for kind in (FULL, SLIDING)}
    by_type = {kind: layers for kind, layers in by_type.items() if layers}
    size = min(len(layers) for layers in by_type.values())
    return tuple(KVCacheGroup(kind, tuple(layers[start:start + size]),
                              config.sliding_window if kind == SLIDING else None)
                 for kind, layers in by_type.items()
                 for start in range(0, len(layers), size))


def checked_groups(groups) -> tuple[KVCacheGroup, ...]:
    """groups as kv_cache_groups gives them: a non-empty sequence of KVCacheGroup."""
    if isinstance(groups, KVCacheGroup) or not isinstance(groups, (list, tuple)) or \
            not groups or not all(isinstance(group, KVCacheGroup) for group in groups):
        raise TypeError(f"groups must be a non-empty list of KVCacheGroup "
                        f"(kv_cache_groups(config)), got {groups!r:.80}")
    return tuple(groups)


def layers_per_group(groups) -> int:
    """The layer slots of every group (the largest group; the others padded to it)."""
    return max(len(group.layers) for group in checked_groups(groups))


def block_bytes(config: Gemma3Config, block_size: int, groups) -> int:
    """Bytes of one block of the pool (vLLM's page size): K and V of block_size positions
    for layers_per_group layers, in the config's dtype. Every group's blocks are this size."""
    if not isinstance(config, Gemma3Config):
        raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
    block_size = as_count("block_size", block_size, 1)
    return (2 * layers_per_group(groups) * block_size * config.kv_width *
            config.numpy_dtype.itemsize)


def blocks_held(groups, n_tokens: int, block_size: int) -> int:
    """Blocks a request holds between steps once n_tokens have K and V, over all groups: a
    full group every block, a sliding group those not yet freed."""
    n_tokens, block_size = as_whole_number("n_tokens", n_tokens), as_count("block_size",
                                                                           block_size, 1)
    table = -(-n_tokens // block_size)
    return sum(table - group.skipped_tokens(n_tokens) // block_size
               for group in checked_groups(groups))


# ---------------------------------------------------------------------- the K and V

class KVCacheTensors:
    """The K and V of the pool's blocks (vLLM's KVCacheTensors): keys and values of shape
    (layers_per_group, n_blocks, block_size, kv_width); slot i of a block holds layer
    group.layers[i] of whichever group owns the block. layer_slot[l] = (group, slot)."""

    def __init__(self, config: Gemma3Config, groups, n_blocks: int, block_size: int):
        shape = (layers_per_group(groups), n_blocks, block_size, config.kv_width)
        if 2 * math.prod(shape) * config.numpy_dtype.itemsize > 2**40:
            raise ValueError(f"{n_blocks:,} blocks of {block_size:,} positions is far more "
                             "cache than the 2**40 bytes kvlib allows: give fewer or smaller "
                             "blocks")
        self.keys = np.zeros(shape, dtype=config.numpy_dtype)
        self.values = np.zeros(shape, dtype=config.numpy_dtype)
        self.layer_slot = {layer: (g, slot) for g, group in enumerate(groups)
                           for slot, layer in enumerate(group.layers)}


# ---------------------------------------------------------------------- one group's rules

def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix cache's key of a group's block: (block hash, group id), as vLLM's
    BlockHashWithGroupId: the same tokens are cached and evicted in each group apart."""
    return block_hash + group.to_bytes(2, "little")


class FullAttentionManager:
    """A full-attention group (vLLM's FullAttentionManager): never frees a block before the
    request ends; a prefix hit is its cached blocks from the first, up to the first miss."""

    def __init__(self, pool: BlockPool, window: int | None):
        self.pool, self.window = pool, window

    def cached(self, block_hash: bytes, group_ids) -> list[int] | None:
        """The block of every group under this hash, or None unless all are cached."""
        blocks = [self.pool.cached.get(group_key(block_hash, g)) for g in group_ids]
        return None if None in blocks else blocks

    def find_longest_cache_hit(self, block_hashes, max_length: int,
                               group_ids) -> list[list[int]]:
        """Each group's hit blocks (the same count for all), at most max_length tokens."""
        hits: list[list[int]] = [[] for _ in group_ids]
        for block_hash in block_hashes[:max_length // self.pool.block_size]:
            blocks = self.cached(block_hash, group_ids)
            if blocks is None:
                break
            for hit, block in zip(hits, blocks):
                hit.append(block)
        return hits


class SlidingWindowManager(FullAttentionManager):
    """A sliding-window group (vLLM's SlidingWindowManager): its blocks that hold only
    skipped positions are freed as the request goes on (skipped_tokens); a prefix hit needs
    only the cdiv(window - 1, block_size) blocks before the hit point, found from the right."""

    def find_longest_cache_hit(self, block_hashes, max_length: int,
                               group_ids) -> list[list[int]]:
        needed = -(-(self.window - 1) // self.pool.block_size)
        n = max_length // self.pool.block_size
        hits = [[NULL_BLOCK] * n for _ in group_ids]
        run = 0
        for index in range(n - 1, -1, -1):           # from the right: the longest hit first
            blocks = self.cached(block_hashes[index], group_ids)
            if blocks is None:
                run = 0
                continue
            for hit, block in zip(hits, blocks):
                hit[index] = block
            run += 1
            if run >= needed:
                return [hit[:index + run] for hit in hits]
        return [hit[:run] for hit in hits]          # a run that reaches the first block


# ---------------------------------------------------------------------- the coordinator

class KVCacheCoordinator:
    """Every group's tables of every request, over one pool (vLLM's KVCacheCoordinator):
    request.block_tables[g] is group g's table, all of the same length (a sliding group's
    freed blocks are NULL_BLOCK). find_longest_cache_hit is the subclasses'."""

    def __init__(self, groups, pool: BlockPool):
        self.groups, self.pool = tuple(groups), pool
        self.specs: dict[tuple, list[int]] = {}            # one manager for a spec's groups
        for g, group in enumerate(self.groups):
            self.specs.setdefault((group.attention, group.sliding_window), []).append(g)
        self.managers = {spec: (SlidingWindowManager if spec[0] == SLIDING else
                                FullAttentionManager)(pool, spec[1]) for spec in self.specs}

    def find_longest_cache_hit(self, block_hashes, max_length: int):
        """-> (each group's hit table, with null blocks, and the hit's tokens)."""
        raise NotImplementedError

    def blocks_to_allocate(self, tables, end: int, hit_tables=()) -> int:
        """New blocks so that every group's table covers positions 0 .. end - 1, plus the
        hit blocks nobody holds (taking them removes them from the free ones)."""
        idle = sum(1 for table in hit_tables for block in table
                   if block != NULL_BLOCK and self.pool.ref_counts[block] == 0)
        needed = -(-end // self.pool.block_size)
        return sum(max(0, needed - len(table)) for table in tables) + idle

    def allocate(self, request, end: int, record) -> None:
        """Extend every group's table to cover positions 0 .. end - 1."""
        needed = -(-end // self.pool.block_size)
        for table in request.block_tables:
            while len(table) < needed:
                evicting = self.pool.evicting()
                block = self.pool.allocate()
                table.append(block)
                record.taken_blocks.append(block)
                if evicting:
                    record.evicted_blocks.append(block)

    def remove_skipped_blocks(self, request, record) -> None:
        """Free every group's blocks that no future query reads (sliding groups only), from
        the last such block back, stopping at a null block (the ones before it are null)."""
        for group, table in zip(self.groups, request.block_tables):
            for index in reversed(range(min(len(table), group.skipped_tokens(
                    request.num_computed_tokens) // self.pool.block_size))):
                if table[index] == NULL_BLOCK:
                    break
                self._release(table[index], record)
                table[index] = NULL_BLOCK

    def free(self, request, record) -> None:
        """Give every block back, each table's tail first, as vLLM frees them."""
        for table in request.block_tables:
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self._release(block, record)
        request.block_tables = []

    def _release(self, block: int, record) -> None:
        if self.pool.release(block) and record is not None:
            record.freed_blocks.append(block)

    def cache_blocks(self, request, block_hashes, first: int, end: int) -> None:
        """Blocks first .. end - 1 of every group (full now) enter the prefix cache under
        (hash, group); null blocks are not cached."""
        for g, table in enumerate(request.block_tables):
            for index in range(first, end):
                if table[index] != NULL_BLOCK:
                    self.pool.cache(table[index], group_key(block_hashes[index], g))


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group (every layer of one type, or hybrid accounting off): its manager's hit."""

    def find_longest_cache_hit(self, block_hashes, max_length: int):
        (spec, group_ids), = self.specs.items()
        tables = self.managers[spec].find_longest_cache_hit(block_hashes, max_length,
                                                            group_ids)
        return tables, len(tables[0]) * self.pool.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several attention types (vLLM's HybridKVCacheCoordinator): the full-attention hit
    first, then each other type's within it, again until no type shortens it."""

    def find_longest_cache_hit(self, block_hashes, max_length: int):
        order = sorted(self.specs, key=lambda spec: spec[0] != FULL)
        hit_length, hits = max_length, {}
        while True:
            length = hit_length
            for spec in order:
                found = self.managers[spec].find_longest_cache_hit(block_hashes, length,
                                                                   self.specs[spec])
                hits.update(zip(self.specs[spec], found))
                length = len(found[0]) * self.pool.block_size
            if length >= hit_length:
                break
            hit_length = length
        n = hit_length // self.pool.block_size
        return [hits[g][:n] for g in range(len(self.groups))], hit_length


def coordinator_for(groups, pool: BlockPool) -> KVCacheCoordinator:
    """vLLM's get_kv_cache_coordinator: Unitary for one attention type, Hybrid otherwise
    (with prefix caching off, BlockPool finds no hits, so either serves)."""
    kinds = {(group.attention, group.sliding_window) for group in groups}
    return (UnitaryKVCacheCoordinator if len(kinds) == 1 else
            HybridKVCacheCoordinator)(groups, pool)


__all__ = ["FULL", "FullAttentionManager", "HybridKVCacheCoordinator", "KVCacheCoordinator",
           "KVCacheGroup", "KVCacheTensors", "NULL_BLOCK", "SLIDING", "SlidingWindowManager",
           "UnitaryKVCacheCoordinator", "block_bytes", "blocks_for_hit", "blocks_held",
           "checked_groups", "coordinator_for", "freeable_blocks", "group_key", "kv_cache_groups",
           "layers_per_group", "skipped_tokens"]
