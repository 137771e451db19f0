"""Findings of the fuzz of kvlib.serving, each kept as a test: a failing call changes nothing,
a cache never reads rows that are not its own, and odd input gets kvlib's own clear error."""

import math

import numpy as np
import pytest

import kvlib
from kvlib import grouped, latent
from kvlib.serving import (
    BlockAllocator,
    PagedKVCache,
    PrefixServer,
    QuantizedKVCache,
    padding_mask,
    scheduler,
    speculative,
    workloads,
)

TOY = kvlib.init_params()
LATENT = kvlib.init_params(kvlib.ModelConfig(latent_dim=2))


def paged_state(cache):
    """What a failing call must leave as it was: lengths, table, pool and every row read."""
    return (cache.lengths, list(cache.block_table), cache.pool.ref_counts.tolist(),
            cache.pool.n_free, [cache.keys(i).tolist() for i in range(3)],
            [cache.values(i).tolist() for i in range(3)])


# ------------------------------------------------------------------ all or nothing


def test_an_append_that_runs_out_of_blocks_mid_chunk_changes_nothing():
    pool = BlockAllocator(TOY.config, n_blocks=3, block_size=2)
    cache = PagedKVCache(pool)
    kvlib.prefill(TOY, [0, 3, 7], cache)                  # 2 blocks, the second half full
    before = paged_state(cache)
    rows = np.ones((4, 4))                                # needs 2 more blocks, 1 is free
    with pytest.raises(MemoryError, match="out of cache blocks"):
        cache.append(0, rows, rows)
    assert paged_state(cache) == before
    assert cache.block_table == [0, 1] and pool.n_free == 1 and cache.lengths == (3, 3, 3)
    pool.check_invariants()
    cache.append(0, rows[:3], rows[:3])                   # what fits still goes in
    assert cache.lengths[0] == 6 and pool.n_free == 0


def test_an_append_that_needs_a_copy_and_finds_no_block_changes_nothing():
    pool = BlockAllocator(TOY.config, n_blocks=2, block_size=4)
    parent = PagedKVCache(pool)
    kvlib.prefill(TOY, [0, 3, 7], parent)
    child = parent.fork()                                 # shares block 0
    pool.allocate()                                       # the last free block is gone
    table, counts = list(child.block_table), pool.ref_counts.tolist()
    with pytest.raises(MemoryError):
        child.append(0, np.ones((1, 4)), np.ones((1, 4)))  # copy-on-write needs a block
    assert child.block_table == table and pool.ref_counts.tolist() == counts
    assert child.lengths == (3, 3, 3)


# ------------------------------------------------------------------ a released block


def test_a_cache_whose_block_was_released_and_reused_refuses_to_be_read():
    pool = BlockAllocator(TOY.config, n_blocks=1, block_size=4)
    old = PagedKVCache(pool)
    kvlib.prefill(TOY, [0, 3, 7], old)
    pool.release(old.block_table[0])                      # freed by hand, the table kept
    new = PagedKVCache(pool)
    kvlib.prefill(TOY, [0, 9, 9, 9], new)                 # takes the same block
    assert new.block_table == old.block_table
    for read in (lambda: old.keys(0), lambda: old.values(2),
                 lambda: old.append(0, np.ones((1, 4)), np.ones((1, 4))),
                 lambda: kvlib.decode_step(TOY, 1, old)):
        with pytest.raises(ValueError, match="released"):
            read()
    np.testing.assert_array_equal(new.keys(0), kvlib.prefill(TOY, [0, 9, 9, 9])[1].keys(0))
    old.free()                             # the way out: the new owner's block is not touched
    assert len(old) == 0 and old.block_table == [] and pool.ref_counts.tolist() == [1]
    np.testing.assert_array_equal(new.keys(0), kvlib.prefill(TOY, [0, 9, 9, 9])[1].keys(0))


def test_a_cache_whose_block_was_released_refuses_to_be_read_before_any_reuse():
    pool = BlockAllocator(TOY.config, n_blocks=2, block_size=4)
    cache = PagedKVCache(pool)
    kvlib.prefill(TOY, [0, 3, 7], cache)
    pool.release(cache.block_table[0])
    with pytest.raises(ValueError, match="free|released"):
        cache.keys(0)


def test_a_cached_block_released_behind_the_prefix_caches_back_is_not_reused():
    """Released by hand, a cached block waits idle in the pool under its key; when another
    sequence takes it, the pool forgets the key, so no lookup finds rows that are not its
    prefix's any more."""
    server = PrefixServer(TOY, n_blocks=3, block_size=2)
    server.finish(server.admit([0, 3, 7, 1, 9]).request)          # blocks 0 and 1 cached
    first = server.prefix_cache.match([0, 3, 7, 1, 9])[0]
    assert server.pool.lookup([0, 3, 7, 1]) == [0, 1]
    server.pool.release(first.block)                              # by hand: now idle
    other = PagedKVCache(server.pool)
    kvlib.prefill(TOY, [0, 9, 9, 9], other)                       # takes blocks 2 and 0
    assert first.block in other.block_table
    assert server.pool.lookup([0, 3, 7, 1]) == [] and server.prefix_cache.match([0, 3]) == []
    server.pool.check_invariants()


# ------------------------------------------------------------------ the prefix cache


def test_served_requests_reuse_only_their_own_prefix():
    server = PrefixServer(TOY, n_blocks=16, block_size=2)
    first = server.admit([0, 3, 7, 1, 9])
    server.decode(first.request, 5)
    server.finish(first.request)
    second = server.admit([0, 3, 7, 1, 9, 5, 2])
    assert second.reused_tokens == 6
    np.testing.assert_allclose(second.logits, kvlib.prefill(TOY, [0, 3, 7, 1, 9, 5, 2])[0][-1:],
                               rtol=0, atol=1e-12)


# ------------------------------------------------------------------ silent results


@pytest.mark.parametrize("call, words", [
    (lambda: padding_mask([True, 2]), "whole numbers"),
    (lambda: padding_mask([2.0, 1.0]), "whole numbers"),
    (lambda: speculative.replay_greedy([True, "x"], 2), "True or False"),
    (lambda: speculative.replay_greedy([1, 0, 2], 2), "True or False"),
])
def test_odd_lists_are_refused_not_read_as_something_else(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()


def test_a_timeline_refuses_times_and_requests_it_does_not_have():
    requests = workloads.make_workload(3, seed=0)
    timeline = scheduler.serve(requests, scheduler.ContinuousBatching(2))
    for time in (math.nan, math.inf, "3", None, [1.0]):
        for call in (timeline.state_at, timeline.step_at):
            with pytest.raises((ValueError, TypeError), match="time"):
                call(time)
    for request in (99, -1, None, "0", 1.0, True):
        for call in (timeline.latency, timeline.admitted_at, timeline.time_to_first_token,
                     timeline.time_per_output_token):
            with pytest.raises((ValueError, TypeError), match="request"):
                call(request)


# ------------------------------------------------------------------ deep errors


@pytest.mark.parametrize("call, error, words", [
    (lambda: kvlib.KVCache(TOY.config).append(0, np.full((1, 4), "a"), np.zeros((1, 4))),
     TypeError, "real numbers"),
    (lambda: kvlib.KVCache(TOY.config).append(0, np.zeros((1, 4)),
                                              np.array([[1, None, 2, 3]], dtype=object)),
     TypeError, "real numbers"),
    (lambda: QuantizedKVCache(TOY.config).append(0, np.full((1, 4), "a"), np.zeros((1, 4))),
     TypeError, "real numbers"),
    (lambda: BlockAllocator(TOY.config, n_blocks=2**70), ValueError, "n_blocks"),
    (lambda: BlockAllocator(TOY.config, n_blocks=2**20, block_size=2**20), ValueError,
     "bytes"),
    (lambda: latent.compress_kv(np.zeros((2, 4)), TOY.layers[0]), TypeError,
     "LatentLayerParams"),
    (lambda: latent.latent_attention(np.zeros((2, 4)), TOY.layers[0], 2), TypeError,
     "LatentLayerParams"),
    (lambda: kvlib.decoder_block(np.zeros((2, 4)), LATENT.layers[0], 2), TypeError,
     "LayerParams"),
    (lambda: grouped.query_groups("8", 2), TypeError, "n_heads must be a whole number"),
    (lambda: grouped.query_groups(2**70, 2), ValueError, "n_heads"),
])
def test_odd_input_gets_kvlibs_own_error(call, error, words):
    with pytest.raises(error, match=words):
        call()
