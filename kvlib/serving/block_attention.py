"""Attention that reads a paged cache where it lies (the_engine): block by block, merged
with an online softmax, instead of gathering every row into one array first.

The paged_cache lesson's paged cache gathers a sequence's rows out of its blocks into a contiguous
copy (`PagedKVCache.keys`) and attends to the copy: every layer of every step copies the whole
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

from ..checks import as_array, as_flag, as_matrix, as_whole_number, as_whole_numbers, is_trusted
from ..model import split_heads


def _check_attention_inputs(Q, positions, keys, values, block_table, n_cached, new_keys,
                            new_values) -> None:
    """The door of block_attention and gather_attention: the shapes of their docstring."""
    h, T, dh = as_array("Q", Q, 3).shape
    n_blocks, block_size, width = as_array("keys", keys, 3).shape
    if as_array("values", values, 3).shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {keys.shape}, got {values.shape}")
    if dh == 0 or width % dh or h % max(width // dh, 1) or width == 0:
        raise ValueError(f"keys' rows ({width} numbers) must be K/V heads of Q's {dh} columns, "
                         f"as many as divide Q's {h} heads")
    block_table = as_whole_numbers("block_table", block_table)
    if block_table.size and block_table.max() >= n_blocks:
        raise ValueError(f"block_table names blocks of a pool of {n_blocks}: {block_table}")
    as_whole_number("n_cached", n_cached, 0, block_size * block_table.size)
    if as_whole_numbers("positions", positions).shape != (T,):
        raise ValueError(f"positions must give the {T} queries' positions, got {positions}")
    for name, rows in (("new_keys", new_keys), ("new_values", new_values)):
        if as_matrix(name, rows, width).shape[0] != T:
            raise ValueError(f"{name} must have one row for each of the {T} queries")


class OnlineSoftmax:
    """The running state of attention over blocks of keys, per query and head: m the largest
    score so far, l the sum of exp(score - m), acc the values weighted the same way (shapes
    (kv, group, T, 1) and (kv, group, T, dh): the query heads in their K/V groups, the
    grouped_query_attention lesson). add(scores, V) takes one block; result() is acc / l.

    m starts at -inf, and exp(-inf - m') = 0 makes the first block's rescaling vanish. A
    hidden key (score -inf) weighs exp(-inf) = 0. Every query sees at least its own key, so
    after the last block every row's m is finite and l > 0.
    """

    def __init__(self, shape: tuple[int, ...], head_dim: int, dtype):
        self.m = np.full(shape + (1,), -np.inf, dtype=dtype)
        self.l = np.zeros(shape + (1,), dtype=dtype)
        self.acc = np.zeros(shape + (head_dim,), dtype=dtype)

    def add(self, scores: np.ndarray, V: np.ndarray) -> None:
        """scores (kv, group, T, S) of one block, -inf where a key is hidden; V (kv, 1, S, dh)."""
        new_m = np.maximum(self.m, scores.max(axis=-1, keepdims=True))
        rescale = np.exp(self.m - new_m)          # how much smaller the old terms become
        weights = np.exp(scores - new_m)
        self.l = self.l * rescale + weights.sum(axis=-1, keepdims=True)
        self.acc = self.acc * rescale + weights @ V
        self.m = new_m

    def result(self) -> np.ndarray:
        return self.acc / self.l


def _heads_of(rows: np.ndarray, kv: int, dh: int, keys: bool) -> np.ndarray:
    """Rows (S, kv x dh) as a view per K/V head, ready to meet a group of queries: keys as
    (kv, 1, dh, S), values as (kv, 1, S, dh). No copy."""
    heads = rows.reshape(rows.shape[0], kv, dh)
    return (heads.transpose(1, 2, 0) if keys else heads.transpose(1, 0, 2))[:, None]


def block_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                    block_table, n_cached: int, new_keys: np.ndarray,
                    new_values: np.ndarray) -> np.ndarray:
    """Causal attention of T queries over a sequence's cached blocks and its T new rows,
    reading each block in place (the_engine) -> (h, T, dh).

    Q (h, T, dh); positions (T,) the queries' positions (n_cached .. n_cached + T - 1);
    keys, values (n_blocks, block_size, kv x dh): one layer of the pool; block_table: the
    sequence's blocks, in order, covering at least its n_cached positions; new_keys,
    new_values (T, kv x dh). Equal to gathering the rows and attending with a causal mask
    (gather_attention), whatever the block size, the last block's filling or the grouping.
    """
    if not is_trusted():                     # the engine's forward_step has checked its batch
        _check_attention_inputs(Q, positions, keys, values, block_table, n_cached, new_keys,
                                new_values)
    h, T, dh = Q.shape
    block_size = keys.shape[1]
    kv = keys.shape[2] // dh
    groups = Q.reshape(kv, h // kv, T, dh) * (1.0 / math.sqrt(dh))   # query heads by K/V head
    state = OnlineSoftmax((kv, h // kv, T), dh, Q.dtype)
    for index in range(-(-n_cached // block_size)):
        block = block_table[index]
        used = min(block_size, n_cached - index * block_size)      # the last may be partial
        # every cached key is before every query: nothing to mask
        state.add(groups @ _heads_of(keys[block, :used], kv, dh, True),
                  _heads_of(values[block, :used], kv, dh, False))
    causal = (n_cached + np.arange(T))[None, :] <= np.asarray(positions)[:, None]   # (T, T)
    scores = groups @ _heads_of(new_keys, kv, dh, True)
    state.add(np.where(causal, scores, -np.inf), _heads_of(new_values, kv, dh, False))
    return state.result().reshape(h, T, dh)


def _check_batched_inputs(Q, positions, keys, values, block_tables) -> None:
    """The door of batched_block_attention: the shapes of its docstring."""
    R, h, T, dh = as_array("Q", Q, 4).shape
    n_blocks, block_size, width = as_array("keys", keys, 3).shape
    if as_array("values", values, 3).shape != keys.shape:
        raise ValueError(f"values must have the shape of keys {keys.shape}, got {values.shape}")
    if dh == 0 or width == 0 or width % dh or h % max(width // dh, 1):
        raise ValueError(f"keys' rows ({width} numbers) must be K/V heads of Q's {dh} columns, "
                         f"as many as divide Q's {h} heads")
    tables = as_array("block_tables", block_tables, 2)
    if tables.shape[0] != R or tables.shape[1] == 0 or tables.dtype.kind not in "iu" or \
            tables.min() < 0 or tables.max() >= n_blocks:
        raise ValueError(f"block_tables must be {R} rows of block ids of a pool of {n_blocks}, "
                         f"got shape {tables.shape} ({tables.dtype})")
    positions = as_array("positions", positions, 2)
    if positions.shape != (R, T) or positions.dtype.kind not in "iu" or \
            (positions.size and (positions.min() < 0 or
                                 positions.max() >= tables.shape[1] * block_size)):
        raise ValueError(f"positions must be ({R}, {T}) whole numbers inside the block tables' "
                         f"{tables.shape[1] * block_size} positions, got {positions.shape}")


def _gathered(keys: np.ndarray, values: np.ndarray, tables: np.ndarray, kv: int, dh: int):
    """Every sequence's blocks, copied out of the pool in one fancy index each for K and V:
    (R, kv, n, S, dh) both, n blocks of S positions (no Python loop over blocks)."""
    R, n = tables.shape
    block_size = keys.shape[1]
    K = keys[tables].reshape(R, n, block_size, kv, dh).transpose(0, 3, 1, 2, 4)
    V = values[tables].reshape(R, n, block_size, kv, dh).transpose(0, 3, 1, 2, 4)
    return K, V


def _visible(positions, n_positions: int, group: int) -> np.ndarray:
    """(R, 1, group x T, n_positions): a query at position p sees positions 0 .. p; the rows
    in the order of the queries grouped by K/V head (group, T)."""
    positions = np.asarray(positions)
    R, T = positions.shape
    visible = np.arange(n_positions) <= positions[:, :, None]                   # (R, T, P)
    return np.broadcast_to(visible[:, None, None], (R, 1, group, T, n_positions)).reshape(
        R, 1, group * T, n_positions)


def batched_block_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                            block_tables) -> np.ndarray:
    """Causal attention of R sequences at once, each over its own blocks, block by block,
    merged at the end (the_engine) -> (R, h, T, dh).

    Q (R, h, T, dh): T queries of each sequence; positions (R, T) their positions; keys,
    values (n_blocks, block_size, kv x dh): one layer of the pool, holding every position up
    to each query's own (the engine writes a step's new rows before attending, as vLLM does);
    block_tables (R, n): each sequence's blocks in order, padded with any block id. A query
    at position p sees the positions 0 .. p of its sequence.

    block_attention's computation arranged as a GPU kernel splits it (flash-decoding): every
    block's scores, maximum m_b, sum l_b and weighted values acc_b independently, for all
    sequences and blocks in one batched product, then one merge: M = max_b m_b, out =
    sum_b e^(m_b - M) acc_b / sum_b e^(m_b - M) l_b. numpy cannot read scattered blocks
    without copying them: the blocks are gathered once per call (keys[block_tables]).
    """
    if not is_trusted():
        _check_batched_inputs(Q, positions, keys, values, block_tables)
    R, h, T, dh = Q.shape
    block_size, kv = keys.shape[1], keys.shape[2] // dh
    tables = np.asarray(block_tables, dtype=np.intp)
    n = tables.shape[1]
    K, V = _gathered(keys, values, tables, kv, dh)                    # (R, kv, n, S, dh)
    queries = Q.reshape(R, kv, 1, h // kv * T, dh) * (1.0 / math.sqrt(dh))
    scores = queries @ K.swapaxes(-1, -2)                              # (R, kv, n, gT, S)
    visible = _visible(positions, n * block_size, h // kv)             # (R, 1, gT, n S)
    visible = visible.reshape(R, 1, h // kv * T, n, block_size).swapaxes(2, 3)
    scores = np.where(visible, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)                 # each block's maximum, -inf if hidden
    weights = np.exp(scores - np.where(np.isfinite(m), m, 0))
    l = weights.sum(axis=-1, keepdims=True)
    acc = weights @ V                                                  # (R, kv, n, gT, dh)
    merge = np.exp(m - m.max(axis=2, keepdims=True))       # 0 for a hidden block
    out = (merge * acc).sum(axis=2) / (merge * l).sum(axis=2)          # (R, kv, gT, dh)
    return out.reshape(R, h, T, dh).astype(Q.dtype, copy=False)


def batched_gather_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                             block_tables) -> np.ndarray:
    """batched_block_attention's inputs and result, computed as numpy does it fastest
    (the_engine; what Engine.step runs): every sequence's blocks gathered in one copy, then
    one softmax over all their positions, no per-block maxima to merge -> (R, h, T, dh)."""
    if not is_trusted():
        _check_batched_inputs(Q, positions, keys, values, block_tables)
    R, h, T, dh = Q.shape
    block_size, kv = keys.shape[1], keys.shape[2] // dh
    tables = np.asarray(block_tables, dtype=np.intp)
    n = tables.shape[1]
    K, V = _gathered(keys, values, tables, kv, dh)
    K = K.reshape(R, kv, n * block_size, dh)
    V = V.reshape(R, kv, n * block_size, dh)
    queries = Q.reshape(R, kv, h // kv * T, dh) * (1.0 / math.sqrt(dh))
    scores = np.where(_visible(positions, n * block_size, h // kv),
                      queries @ K.swapaxes(-1, -2), -np.inf)          # (R, kv, gT, P)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (weights @ V) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(R, h, T, dh).astype(Q.dtype, copy=False)


def gather_attention(Q: np.ndarray, positions, keys: np.ndarray, values: np.ndarray,
                     block_table, n_cached: int, new_keys: np.ndarray,
                     new_values: np.ndarray) -> np.ndarray:
    """The reference (paged_cache's way): copy the cached rows out of their blocks into one
    array, append the new rows, and attend with a causal mask -> (h, T, dh)."""
    from ..model import attention

    if not is_trusted():
        _check_attention_inputs(Q, positions, keys, values, block_table, n_cached, new_keys,
                                new_values)
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
    (the_engine): reading its K and V rows once (in place), or, with a gather, reading them,
    writing the contiguous copy and reading the copy again: three times as many."""
    n_cached, width = as_whole_number("n_cached", n_cached), as_whole_number("width", width)
    itemsize, gather = as_whole_number("itemsize", itemsize, 1), as_flag("gather", gather)
    once = 2 * n_cached * width * itemsize
    return 3 * once if gather else once
