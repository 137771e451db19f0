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


class _FailingRecord(list):
    """A record_attention list that fails when layer `at` appends: a pass stopped half-way."""

    def __init__(self, at, error):
        super().__init__()
        self.at, self.error = at, error

    def append(self, weights):
        if len(self) == self.at:
            raise self.error
        super().append(weights)


@pytest.mark.parametrize("kind", ["contiguous", "window", "latent", "concatenating"])
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_pass_that_fails_half_way_leaves_the_cache_as_it_was(kind, error):
    options = {"contiguous": {}, "concatenating": {},
               "window": dict(positions="rotary", window=3, sink_tokens=1),
               "latent": dict(positions="rotary", latent_dim=3, rope_head_dim=2)}[kind]
    config = kvlib.ModelConfig(**options)
    params = kvlib.init_params(config)
    cache = kvlib.ConcatenatingKVCache(config) if kind == "concatenating" else \
        kvlib.make_cache(config)
    kvlib.prefill(params, [0, 3, 7, 1, 9], cache)
    kvlib.decode_step(params, 5, cache)
    before = [(cache.keys(i).copy(), cache.values(i).copy()) for i in range(3)]
    nbytes = cache.nbytes
    for call in (lambda r: kvlib.decode_step(params, 2, cache, record_attention=r),
                 lambda r: kvlib.prefill(params, [2, 4, 8, 1], cache, record_attention=r)):
        with pytest.raises(type(error)):
            call(_FailingRecord(2, error))
        assert cache.lengths == (6, 6, 6) and cache.nbytes == nbytes
        for layer, (keys, values) in enumerate(before):
            np.testing.assert_array_equal(cache.keys(layer), keys)
            np.testing.assert_array_equal(cache.values(layer), values)
    # and the cache still gives the right answer
    np.testing.assert_allclose(kvlib.decode_step(params, 2, cache),
                               kvlib.forward(params, [0, 3, 7, 1, 9, 5, 2], last_only=True),
                               atol=1e-12)


def test_a_cache_whose_layers_disagree_is_refused_in_words(params):
    _, cache = kvlib.prefill(params, [0, 3, 7, 1, 9])
    k = np.zeros((1, 4))
    cache.append(0, k, k)                    # a notebook cell appending to layer 0 by hand
    for call in (lambda: len(cache), lambda: kvlib.decode_step(params, 5, cache),
                 lambda: kvlib.prefill(params, [5], cache), lambda: cache.truncate(2)):
        with pytest.raises(ValueError, match=r"different numbers of positions \[6, 5, 5\]"):
            call()
    assert cache.lengths == (6, 5, 5) and "layers disagree" in repr(cache)
    cache.reset()
    assert len(cache) == 0


@pytest.mark.parametrize("bad, error, words", [
    ("5", TypeError, "whole number"), (1.5, TypeError, "whole number"),
    (True, TypeError, "whole number"), (0, ValueError, "at least 1"),
    (-1, ValueError, "at least 1"), (float("nan"), TypeError, "whole number"),
    (33, ValueError, "capacity must be at most 32"),
])
@pytest.mark.parametrize("kind", [kvlib.KVCache, kvlib.ConcatenatingKVCache])
def test_bad_capacities_are_refused(kind, bad, error, words):
    with pytest.raises(error, match=words):
        kind(kvlib.ModelConfig(), capacity=bad)


@pytest.mark.parametrize("layer, error", [(True, TypeError), (0.5, TypeError), ("0", TypeError),
                                          (-1, ValueError), (3, ValueError)])
def test_bad_layers_are_refused(params, layer, error):
    _, cache = kvlib.prefill(params, [0, 3, 7])
    with pytest.raises(error, match="layer must be"):
        cache.keys(layer)


def test_appends_of_the_wrong_shape_change_nothing(params):
    _, cache = kvlib.prefill(params, [0, 3, 7])
    for K, V in ((np.zeros((2, 4)), np.zeros((3, 4))), (np.zeros((2, 3)), np.zeros((2, 3))),
                 (np.zeros(4), np.zeros(4)), (np.zeros((0, 4)), np.zeros((0, 4)))):
        with pytest.raises(ValueError, match="K must|V must|no rows"):
            cache.append(0, K, V)
    assert cache.lengths == (3, 3, 3)
