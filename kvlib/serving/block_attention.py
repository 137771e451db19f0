"""Attention that reads a paged cache where it lies (notebook 24): block by block, merged
with an online softmax, instead of gathering every row into one array first.

Notebook 19's paged cache gathers a sequence's rows out of its blocks into a contiguous copy
(`PagedKVCache.keys`) and attends to the copy: every layer of every step copies the whole
cache once more. A paged attention kernel (vLLM's PagedAttention, FlashAttention's and
flash-decoding's idea of splitting the keys) never makes that copy. It walks the block table,
scores the queries against one block's keys in place, and keeps three running numbers per
query and head: the largest score so far (m), the sum of exp(score - m) (l), and the weighted
sum of values so far, scaled to the same m (acc). A new block with a larger maximum m' shrinks
what came before by exp(m - m'), then adds its own terms. At the end acc / l is exactly the
softmax-weighted sum over all the keys.

    block_attention(Q, positions, keys, values, block_table, n_cached, new_keys, new_values)

Shapes: h query heads and kv K/V heads of dh (h a multiple of kv), T queries at `positions`
(T,), a pool of K or V for one layer (n_blocks, block_size, kv x dh), a block table (list of
block ids) whose first n_cached positions hold the sequence's cached rows, and the T new
rows (T, kv x dh) at positions n_cached .. n_cached + T - 1, which are attended as one more
block (the engine writes them into the pool after the whole step has succeeded).
"""

from __future__ import annotations

import math

import numpy as np

from ..model import split_heads, weighted_sum


def _grouped_scores(Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Q (h, T, dh) against K (kv, S, dh), each query head reading its group's K/V head
    (notebook 15) -> scores (h, T, S), scaled by 1 / sqrt(dh)."""
    h, T, dh = Q.shape
    kv = K.shape[0]
    groups = Q.reshape(kv, h // kv, T, dh)
    return ((groups @ K[:, None].swapaxes(-1, -2)) * (1.0 / math.sqrt(dh))).reshape(h, T, -1)


class OnlineSoftmax:
    """The running state of attention over blocks of keys: m (h, T, 1) the largest score so
    far, l (h, T, 1) the sum of exp(score - m), acc (h, T, dh) the values weighted the same
    way. add(scores, V) takes one block; result() is acc / l."""

    def __init__(self, h: int, T: int, dh: int, dtype):
        self.m = np.full((h, T, 1), -np.inf, dtype=dtype)
        self.l = np.zeros((h, T, 1), dtype=dtype)
        self.acc = np.zeros((h, T, dh), dtype=dtype)

    def add(self, scores: np.ndarray, V: np.ndarray) -> None:
        """scores (h, T, S) with -inf where a key is hidden; V (kv, S, dh)."""
        new_m = np.maximum(self.m, scores.max(axis=-1, keepdims=True))
        # a row that has seen only hidden keys keeps m = -inf and adds nothing
        finite = np.isfinite(new_m)
        safe_m = np.where(finite, new_m, 0.0)
        rescale = np.where(finite, np.exp(self.m - safe_m), 1.0)   # exp(-inf) = 0 at first
        weights = np.exp(scores - safe_m)                          # a hidden key weighs 0
        self.l = self.l * rescale + weights.sum(axis=-1, keepdims=True)
        self.acc = self.acc * rescale + weighted_sum(weights, V)
        self.m = new_m

    def result(self) -> np.ndarray:
        return self.acc / self.l


def block_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                    block_table, n_cached: int, new_keys: np.ndarray,
                    new_values: np.ndarray) -> np.ndarray:
    """Causal attention of T queries over a sequence's cached blocks and its T new rows,
    reading each block in place (notebook 24) -> (h, T, dh).

    Q (h, T, dh); positions (T,) the queries' positions (n_cached .. n_cached + T - 1);
    keys, values (n_blocks, block_size, kv x dh): one layer of the pool; block_table: the
    sequence's blocks, in order, covering at least its n_cached positions; new_keys,
    new_values (T, kv x dh). Equal to gathering the rows and attending with a causal mask
    (gather_attention), whatever the block size, the last block's filling or the grouping.
    """
    h, T, dh = Q.shape
    block_size = keys.shape[1]
    kv = keys.shape[2] // dh
    positions = np.asarray(positions)
    state = OnlineSoftmax(h, T, dh, Q.dtype)
    for index, block in enumerate(block_table):
        start = index * block_size
        if start >= n_cached:
            break
        used = min(block_size, n_cached - start)                  # the last may be partial
        K = split_heads(keys[block, :used], kv)                    # views: nothing copied
        V = split_heads(values[block, :used], kv)
        state.add(_grouped_scores(Q, K), V)   # cached keys are all before every query
    new_positions = n_cached + np.arange(T)
    scores = _grouped_scores(Q, split_heads(new_keys, kv))
    causal = new_positions[None, :] <= positions[:, None]           # (T, T)
    state.add(np.where(causal, scores, -np.inf), split_heads(new_values, kv))
    return state.result()


def gather_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                     block_table, n_cached: int, new_keys: np.ndarray,
                     new_values: np.ndarray) -> np.ndarray:
    """The reference (notebook 19's way): copy the cached rows out of their blocks into one
    array, append the new rows, and attend with a causal mask -> (h, T, dh)."""
    from ..model import attention

    h, T, dh = Q.shape
    block_size = keys.shape[1]
    kv = keys.shape[2] // dh
    slots = np.arange(n_cached)
    blocks = np.asarray(block_table, dtype=np.intp)[slots // block_size]
    K = np.concatenate([keys[blocks, slots % block_size], new_keys])      # (S, kv x dh)
    V = np.concatenate([values[blocks, slots % block_size], new_values])
    mask = np.arange(n_cached + T)[None, :] <= np.asarray(positions)[:, None]
    return attention(Q, split_heads(K, kv), split_heads(V, kv), mask)


def attention_bytes(n_cached: int, width: int, itemsize: int, gather: bool) -> int:
    """Bytes one layer's attention moves for a sequence of n_cached cached positions
    (notebook 24): reading its K and V rows once (in place), or, with a gather, reading them,
    writing the contiguous copy and reading the copy again: three times as many."""
    once = 2 * n_cached * width * itemsize
    return 3 * once if gather else once
