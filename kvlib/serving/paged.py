"""One sequence's cache in a shared pool of blocks (notebook 19; vLLM's block tables).

A PagedKVCache has the interface of every kvlib cache, so kvlib.prefill and
kvlib.decode_step run on it unchanged. Position p of the sequence lives in block
block_table[p // block_size], row p % block_size. Attention reads the keys and values
through the block table: a gather of the sequence's blocks, in order.
"""

from __future__ import annotations

import numpy as np

from ..cache import BaseKVCache
from .blocks import BlockAllocator


class PagedKVCache(BaseKVCache):
    """A sequence's K and V in blocks of a BlockAllocator, listed by its block_table.

    Blocks are taken as positions arrive (at most one partly filled block per sequence:
    the waste is under one block), never reserved for the whole context. fork() makes a
    second sequence that shares every block (parallel sampling); when a sequence writes into
    a block that another one also holds, the block is copied first (copy-on-write), so no
    sequence ever sees another's writes.
    """

    def __init__(self, allocator: BlockAllocator):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"PagedKVCache needs a BlockAllocator, got {type(allocator).__name__}")
        super().__init__(allocator.config)
        self.allocator = allocator
        self.capacity = allocator.config.context_length
        self.block_table: list[int] = []

    def _describe(self) -> str:
        return (f"PagedKVCache({len(self)} positions in {len(self.block_table)} blocks of "
                f"{self.allocator.block_size}: block table {self.block_table})")

    # -------------------------------------------------------------- reading

    def _rows(self, store: np.ndarray, layer: int) -> np.ndarray:
        """The layer's rows gathered through the block table: (T, kv_width), a copy."""
        for block in self.block_table:
            self.allocator.check_in_use(block)
        table = np.asarray(self.block_table, dtype=np.intp)
        return store[layer, table].reshape(-1, self.allocator.width)[: self._lengths[layer]]

    def keys(self, layer: int) -> np.ndarray:
        return self._rows(self.allocator.keys, self._check_layer(layer))

    def values(self, layer: int) -> np.ndarray:
        return self._rows(self.allocator.values, self._check_layer(layer))

    # -------------------------------------------------------------- writing

    def _writable_block(self, index: int) -> int:
        """The block for table slot index, taken or copied so that this sequence owns it."""
        allocator = self.allocator
        if index == len(self.block_table):
            self.block_table.append(allocator.allocate())
        block = self.block_table[index]
        if allocator.ref_counts[block] > 1:          # shared: copy on write
            self.block_table[index] = allocator.copy(block)
            allocator.release(block)
        return self.block_table[index]

    def append(self, layer: int, K: np.ndarray, V: np.ndarray):
        """Write new rows into the sequence's blocks (taking new ones as needed); return the
        layer's keys and values gathered through the block table."""
        layer = self._check_layer(layer)
        width, size = self.allocator.width, self.allocator.block_size
        self._check_rows("K", K, width)
        self._check_rows("V", V, width, K.shape[0])
        self._check_room(layer, K.shape[0])
        start = self._lengths[layer]
        for offset in range(K.shape[0]):
            position = start + offset
            block = self._writable_block(position // size)
            self.allocator.keys[layer, block, position % size] = K[offset]
            self.allocator.values[layer, block, position % size] = V[offset]
        self._lengths[layer] = start + K.shape[0]
        return self.keys(layer), self.values(layer)

    # -------------------------------------------------------------- sharing and freeing

    @classmethod
    def on_blocks(cls, allocator: BlockAllocator, blocks, length: int) -> PagedKVCache:
        """A sequence whose first `length` positions are already in these blocks, taking one
        more reference to each (notebook 19: a fork; notebook 20: a cached prefix)."""
        blocks = list(blocks)
        if not (len(blocks) - 1) * allocator.block_size < length <= \
                len(blocks) * allocator.block_size and (blocks or length):
            raise ValueError(f"{length} positions do not fill {len(blocks)} blocks of "
                             f"{allocator.block_size}: every block but the last must be full")
        cache = cls(allocator)
        cache._check_room(0, length)
        cache.block_table = [allocator.share(block) for block in blocks]
        cache._lengths = [length] * allocator.config.n_layers
        return cache

    def fork(self) -> PagedKVCache:
        """A second sequence with the same positions, sharing every block (notebook 19)."""
        return PagedKVCache.on_blocks(self.allocator, self.block_table, len(self))

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1; blocks no longer needed go back to the pool."""
        n = self._check_truncate(n)
        keep = -(-n // self.allocator.block_size)
        for block in self.block_table[keep:]:
            self.allocator.release(block)
        del self.block_table[keep:]
        self._lengths = [n] * self.config.n_layers

    def free(self) -> None:
        """Give every block back (the request is finished); the cache is empty after."""
        self.reset()

    def checkpoint(self):
        return tuple(self._lengths), list(self.block_table)

    def restore(self, state) -> None:
        """Back to a checkpoint: blocks taken since are released, blocks copied away from
        (copy-on-write) are held again."""
        lengths, table = state
        for block in set(self.block_table) - set(table):
            self.allocator.release(block)
        for block in set(table) - set(self.block_table):
            self.allocator.share(block)
        self.block_table = list(table)
        self._lengths = list(lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds, partly filled ones whole (shared blocks
        count for each sequence that holds them; BlockAllocator.nbytes_in_use counts once)."""
        return len(self.block_table) * self.allocator.block_bytes
