"""One sequence's cache in a shared pool of blocks (paged_cache; vLLM's block tables).

A PagedKVCache has the interface of every kvlib cache, so kvlib.prefill and
kvlib.decode_step run on it unchanged. Position p of the sequence lives in block
block_table[p // block_size], row p % block_size. Attention reads the keys and values
through the block table: a gather of the sequence's blocks, in order.
"""

from __future__ import annotations

import numpy as np

from ..cache import BaseKVCache, _plural
from .block_pool import BlockPool


class PagedKVCache(BaseKVCache):
    """A sequence's K and V in blocks of a BlockPool, listed by its block_table.

    Blocks are taken as positions arrive (at most one partly filled block per sequence:
    the waste is under one block), never reserved for the whole context. fork() makes a
    second sequence that shares every block (parallel sampling); when a sequence writes into
    a block that another one also holds, the block is copied first (copy-on-write), so no
    sequence ever sees another's writes.
    """

    def __init__(self, pool: BlockPool):
        if not isinstance(pool, BlockPool) or pool.keys is None:
            raise TypeError(f"PagedKVCache needs a BlockPool of K and V, got {pool!r:.60}")
        super().__init__(pool.config)
        self.pool = pool
        self.capacity = pool.config.context_length
        self.block_table: list[int] = []
        # block -> its pool.generations when this sequence took it: a block released
        # behind the cache's back and allocated again to another sequence no longer matches
        self._taken: dict[int, int] = {}
        self.token_ids: list[int] | None = []
        """The token ids whose K and V the cache holds, when the code that filled it said
        so (PrefixServer and PrefixCache.attach do; the prefix cache keys blocks by them);
        None when not known."""

    def _describe(self) -> str:
        return (f"PagedKVCache({len(self)} positions in {len(self.block_table)} blocks of "
                f"{self.pool.block_size}: block table {self.block_table})")

    # -------------------------------------------------------------- reading

    def _checked_table(self) -> np.ndarray:
        """The block table as indices (n_blocks,), after checking that every block in it is
        still this sequence's: in use, and not released and taken again since."""
        pool, table = self.pool, self.block_table
        taken = [self._taken.get(block, -1) for block in table]
        if all(type(block) is int and 0 <= block < pool.n_blocks for block in table):
            indices = np.asarray(table, dtype=np.intp)
            if (pool.ref_counts[indices] > 0).all() and \
                    np.array_equal(pool.generations[indices], taken):
                return indices                   # the usual case, checked in one step
        for block, generation in zip(table, taken):       # find the culprit, and say what
            pool.check_in_use(block)
            if pool.generations[block] != generation:
                raise ValueError(
                    f"block {block} of this sequence was released and taken again (by another "
                    "sequence?) after this cache took it: its rows are not this sequence's any "
                    "more. A block released by hand, outside the cache? Free the cache "
                    "(cache.free()) and prefill its tokens again")
        return np.asarray(table, dtype=np.intp)

    def _rows(self, store: np.ndarray, layer: int) -> np.ndarray:
        """The layer's rows gathered through the block table: (T, kv_width), a copy."""
        table = self._checked_table()
        return store[layer, table].reshape(-1, self.pool.width)[: self._lengths[layer]]

    def keys(self, layer: int) -> np.ndarray:
        return self._rows(self.pool.keys, self._check_layer(layer))

    def values(self, layer: int) -> np.ndarray:
        return self._rows(self.pool.values, self._check_layer(layer))

    # -------------------------------------------------------------- writing

    def _take(self, block: int) -> int:
        self._taken[block] = int(self.pool.generations[block])
        return block

    def _let_go(self, block: int) -> None:
        """Drop this sequence's reference to a block, unless the block stopped being its own
        (released behind the cache's back): another sequence's reference is not ours to drop."""
        taken = self._taken.pop(block, None)
        pool = self.pool
        if pool.ref_counts[block] > 0 and pool.generations[block] == taken:
            pool.release(block)

    def _writable_block(self, index: int) -> int:
        """The block for table slot index, taken or copied so that this sequence owns it."""
        pool = self.pool
        if index == len(self.block_table):
            self.block_table.append(self._take(pool.allocate()))
        block = self.block_table[index]
        if pool.ref_counts[block] > 1:          # shared: copy on write
            self.block_table[index] = self._take(pool.copy(block))
            self._let_go(block)
        return self.block_table[index]

    def _blocks_needed(self, start: int, n_new: int) -> int:
        """Blocks that writing positions start .. start + n_new - 1 takes from the pool: new
        ones past the table, and a copy of each shared block they write into."""
        size = self.pool.block_size
        first, last = start // size, (start + n_new - 1) // size
        shared = sum(int(self.pool.ref_counts[block] > 1)
                     for block in self.block_table[first:last + 1])
        return max(0, last + 1 - len(self.block_table)) + shared

    def _out_of_blocks(self, n_new: int, needed: int) -> str:
        """What a chunk that does not fit says (BlockPool.allocate's words when the pool is
        full)."""
        free, total = self.pool.n_free, self.pool.n_blocks
        if free == 0:
            held = f"all {total} are in use"
        else:
            held = (f"{_plural(n_new, 'position')} need {_plural(needed, 'more block')} and "
                    f"only {free} of the {total} {'is' if free == 1 else 'are'} free")
        return (f"out of cache blocks: {held}. A server would now wait, or preempt a "
                "sequence and recompute it later")

    def append(self, layer: int, K: np.ndarray, V: np.ndarray):
        """Write new rows into the sequence's blocks (taking new ones as needed); return the
        layer's keys and values gathered through the block table. All or nothing: when the
        pool has too few free blocks for the whole chunk, a MemoryError says so and nothing
        is taken or written."""
        layer, size = self._check_layer(layer), self.pool.block_size
        self._check_rows("K", K, self.pool.width)
        self._check_rows("V", V, self.pool.width, K.shape[0])
        self._check_room(layer, K.shape[0])
        self._checked_table()
        start = self._lengths[layer]
        needed = self._blocks_needed(start, K.shape[0])
        if needed > self.pool.n_free:
            raise MemoryError(self._out_of_blocks(K.shape[0], needed))
        saved = self.checkpoint()
        try:
            for offset in range(K.shape[0]):
                position = start + offset
                block = self._writable_block(position // size)
                self.pool.keys[layer, block, position % size] = K[offset]
                self.pool.values[layer, block, position % size] = V[offset]
        except BaseException:          # a KeyboardInterrupt half-way: give back what was taken
            self.restore(saved)
            raise
        self._lengths[layer] = start + K.shape[0]
        return self.keys(layer), self.values(layer)

    # -------------------------------------------------------------- sharing and freeing

    @classmethod
    def on_blocks(cls, pool: BlockPool, blocks: list[int], length: int) -> PagedKVCache:
        """A sequence whose first `length` positions are already in these blocks (every one
        but the last full), taking one more reference to each (paged_cache: a fork;
        prefix_caching: a cached prefix)."""
        cache = cls(pool)
        cache.block_table = [cache._take(pool.share(block)) for block in blocks]
        cache._lengths = [length] * pool.config.n_layers
        cache.token_ids = None
        return cache

    def fork(self) -> PagedKVCache:
        """A second sequence with the same positions, sharing every block (paged_cache)."""
        self._checked_table()
        child = PagedKVCache.on_blocks(self.pool, self.block_table, len(self))
        child.token_ids = None if self.token_ids is None else list(self.token_ids)
        return child

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1; blocks no longer needed go back to the pool."""
        n = self._check_truncate(n)
        keep = -(-n // self.pool.block_size)
        for block in self.block_table[keep:]:
            self._let_go(block)
        del self.block_table[keep:]
        self._lengths = [n] * self.config.n_layers
        if n == 0 or self.token_ids is not None:
            self.token_ids = [] if n == 0 else self.token_ids[:n]

    def free(self) -> None:
        """Give every block back (the request is finished); the cache is empty after."""
        self.reset()

    def checkpoint(self):
        token_ids = None if self.token_ids is None else list(self.token_ids)
        return tuple(self._lengths), list(self.block_table), dict(self._taken), token_ids

    def restore(self, state) -> None:
        """Back to a checkpoint: blocks taken since are released, blocks copied away from
        (copy-on-write) are held again. The block table is changed in place: a Request that
        lists the same table (PrefixServer, PoolTimeline) sees it."""
        lengths, table, taken, token_ids = state
        for block in set(self.block_table) - set(table):
            self._let_go(block)
        for block in set(table) - set(self.block_table):
            self.pool.share(block)
        self.block_table[:] = table
        self._taken = dict(taken)
        self._lengths = list(lengths)
        self.token_ids = None if token_ids is None else list(token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds, partly filled ones whole (shared blocks
        count for each sequence that holds them; BlockPool.nbytes_in_use counts once)."""
        return len(self.block_table) * self.pool.block_bytes
