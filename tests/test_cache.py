"""The KV cache: in-place appends, capacity, bytes."""

import numpy as np
import pytest

import kvlib


@pytest.fixture
def params():
    return kvlib.init_params()


def test_append_writes_in_place(params):
    _, cache = kvlib.prefill(params, [0, 3, 7, 1, 9])
    keys_before = cache.keys(0)
    buffer_before = keys_before.base
    kvlib.decode_step(params, 5, cache)
    keys_after = cache.keys(0)
    assert keys_after.base is buffer_before
    assert np.shares_memory(keys_before, keys_after)
    np.testing.assert_array_equal(keys_after[:5], keys_before)


def test_cache_full_raises_a_clear_error(params):
    cache = kvlib.KVCache(params.config, capacity=6)
    kvlib.prefill(params, [0, 3, 7, 1, 9], cache)
    kvlib.decode_step(params, 5, cache)
    with pytest.raises(ValueError, match="full"):
        kvlib.decode_step(params, 5, cache)


def test_reset_empties_the_cache(params):
    _, cache = kvlib.prefill(params, [0, 3, 7])
    cache.reset()
    assert len(cache) == 0 and cache.nbytes == 0
    logits, _ = kvlib.prefill(params, [0, 3, 7, 1, 9], cache)
    np.testing.assert_allclose(logits, kvlib.forward(params, [0, 3, 7, 1, 9]), atol=1e-12)


def test_nbytes_equals_the_formula_for_a_live_cache(params):
    config = params.config
    _, cache = kvlib.prefill(params, [0, 3, 7, 1, 9])
    for expected_length in (5, 6, 7):
        assert cache.nbytes == kvlib.kv_cache_bytes(config.n_layers, config.d_model,
                                                    expected_length, dtype_bytes=8)
        kvlib.decode_step(params, 5, cache)


def test_concatenating_cache_gives_the_same_logits(params):
    ids = [0, 3, 7, 1, 9]
    cache = kvlib.ConcatenatingKVCache(params.config)
    logits, _ = kvlib.prefill(params, ids, cache)
    fast_logits, fast_cache = kvlib.prefill(params, ids)
    np.testing.assert_array_equal(logits, fast_logits)
    for token in (5, 2, 4):
        np.testing.assert_array_equal(kvlib.decode_step(params, token, cache),
                                      kvlib.decode_step(params, token, fast_cache))
    assert cache.nbytes == fast_cache.nbytes
    assert cache.keys(2).shape == (8, 4)
