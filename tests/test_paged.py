"""The paged cache (kvlib.serving): the same logits as a contiguous cache over random
interleavings of many sequences' appends, forks and frees; no block ever leaks; copy-on-write
never lets one sequence see another's writes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import models

import kvlib
from kvlib.serving import BlockAllocator, PagedKVCache

TOLERANCE = 1e-10


@given(models(latent=False, window=False), st.integers(1, 5), st.data())
@settings(max_examples=60, deadline=None)
def test_interleaved_sequences_in_one_pool_equal_contiguous_caches(model, block_size, data):
    params, config = model
    pool = BlockAllocator(config, n_blocks=64, block_size=block_size)
    paged, plain, texts = [], [], []
    for _ in range(data.draw(st.integers(40, 120))):
        action = data.draw(st.sampled_from(["start", "step", "step", "fork", "free",
                                            "truncate"]))
        if action == "start" or not paged:
            ids = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1,
                                     max_size=6))
            cache = PagedKVCache(pool)
            try:
                a, _ = kvlib.prefill(params, ids, cache)
            except MemoryError:           # the pool ran out: the failed call took nothing
                assert len(cache) == 0 and cache.block_table == []
                pool.check_invariants()
                continue
            b, reference = kvlib.prefill(params, ids)
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
            paged.append(cache), plain.append(reference), texts.append(list(ids))
            continue
        i = data.draw(st.integers(0, len(paged) - 1))
        if action == "step" and len(texts[i]) < config.context_length:
            token = data.draw(st.integers(0, config.vocab_size - 1))
            before = len(paged[i]), list(paged[i].block_table)
            try:
                logits = kvlib.decode_step(params, token, paged[i])
            except MemoryError:           # no block for a new position or a copy: unchanged
                assert (len(paged[i]), paged[i].block_table) == before
            else:
                np.testing.assert_allclose(logits, kvlib.decode_step(params, token, plain[i]),
                                           rtol=0, atol=TOLERANCE)
                texts[i].append(token)
        elif action == "fork":
            paged.append(paged[i].fork())
            _, copy = kvlib.prefill(params, texts[i])
            plain.append(copy), texts.append(list(texts[i]))
        elif action == "free":
            paged.pop(i).free(), plain.pop(i), texts.pop(i)
        elif action == "truncate":
            n = data.draw(st.integers(1, len(texts[i])))
            paged[i].truncate(n), plain[i].truncate(n)
            del texts[i][n:]
        pool.check_invariants()
        held = {b for cache in paged for b in cache.block_table}
        assert pool.n_used == len(held)                         # nothing leaks
        for cache, reference in zip(paged, plain):
            for layer in range(config.n_layers):
                np.testing.assert_allclose(cache.keys(layer), reference.keys(layer),
                                           rtol=0, atol=TOLERANCE)
    for cache in paged:
        cache.free()
    pool.check_invariants()
    assert pool.n_free == pool.n_blocks


def test_copy_on_write_keeps_forks_apart():
    params = kvlib.init_params()
    pool = BlockAllocator(params.config, n_blocks=8, block_size=4)
    _, parent = kvlib.prefill(params, [0, 3, 7, 1, 9, 5], PagedKVCache(pool))   # 2 blocks
    child = parent.fork()
    assert child.block_table == parent.block_table and pool.n_used == 2
    assert list(pool.ref_counts[parent.block_table]) == [2, 2]
    before = parent.keys(0).copy()
    kvlib.decode_step(params, 2, child)          # writes into the shared, partly filled block
    assert child.block_table[0] == parent.block_table[0]   # the full block is still shared
    assert child.block_table[1] != parent.block_table[1]   # the written one was copied
    np.testing.assert_array_equal(parent.keys(0), before)
    assert len(parent) == 6 and len(child) == 7 and pool.n_used == 3


def test_memory_is_taken_as_tokens_arrive():
    params = kvlib.init_params()
    pool = BlockAllocator(params.config, n_blocks=8, block_size=4)
    _, cache = kvlib.prefill(params, [0, 3, 7], PagedKVCache(pool))
    assert cache.block_table == [0] and cache.nbytes == pool.block_bytes
    for token, blocks in ((5, 1), (2, 2), (4, 2)):
        kvlib.decode_step(params, token, cache)
        assert len(cache.block_table) == blocks
    assert pool.block_bytes == 2 * 3 * 4 * 4 * 8


def test_running_out_of_blocks_says_so_and_changes_nothing():
    params = kvlib.init_params()
    pool = BlockAllocator(params.config, n_blocks=2, block_size=2)
    _, cache = kvlib.prefill(params, [0, 3, 7, 1], PagedKVCache(pool))
    with pytest.raises(MemoryError, match="out of cache blocks"):
        kvlib.decode_step(params, 5, cache)
    assert len(cache) == 4 and cache.block_table == [0, 1]
    pool.check_invariants()


def test_a_block_table_that_points_at_a_freed_block_is_refused():
    params = kvlib.init_params()
    pool = BlockAllocator(params.config, n_blocks=4, block_size=4)
    _, cache = kvlib.prefill(params, [0, 3, 7], PagedKVCache(pool))
    stale = list(cache.block_table)
    cache.free()
    cache.block_table, cache._lengths = stale, [3, 3, 3]   # a bug: using a freed table
    with pytest.raises(ValueError, match="block 0 is not held"):
        cache.keys(0)


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="n_blocks must be at least 1"):
        BlockAllocator(kvlib.ModelConfig(), 0)
    with pytest.raises(TypeError, match="block_size must be a whole number"):
        BlockAllocator(kvlib.ModelConfig(), 4, 2.5)
    with pytest.raises(ValueError, match="without a latent or a sliding window"):
        BlockAllocator(kvlib.ModelConfig(window=4), 4)
    with pytest.raises(TypeError, match="needs a BlockPool"):
        PagedKVCache(kvlib.ModelConfig())
