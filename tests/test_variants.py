"""Every architecture kvlib has (GPT-2's pieces, rotary positions, fewer K/V heads, latent
attention, sliding windows with sinks) against plain references: cached decoding equals full
recomputation, chunked prefill equals prefill at once, a cache's bytes equal the formula, and
the variants equal the simpler models they generalise."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import models, token_lists

import kvlib
from kvlib import latent, roofline

TOLERANCE = 1e-10


@given(models(), st.data())
@settings(max_examples=120, deadline=None)
def test_cached_decoding_equals_full_recomputation_for_every_architecture(model, data):
    params, config = model
    prompt = token_lists(data.draw, config, 1, 8)
    # several windows long: the ring buffer wraps around more than once
    continuation = token_lists(data.draw, config, 1, config.context_length - len(prompt))
    logits, cache = kvlib.prefill(params, prompt)
    np.testing.assert_allclose(logits, kvlib.forward(params, prompt), rtol=0, atol=TOLERANCE)
    sequence = list(prompt)
    for token in continuation:
        sequence.append(token)
        cached = kvlib.decode_step(params, token, cache)
        full = kvlib.forward(params, sequence, last_only=True)
        np.testing.assert_allclose(cached, full, rtol=0, atol=TOLERANCE)
        assert len(cache) == len(sequence)
        assert cache.nbytes == kvlib.config_cache_bytes(config, len(sequence))


@given(models(), st.data())
@settings(max_examples=80, deadline=None)
def test_chunked_prefill_equals_prefill_at_once(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 2, 30)
    whole_logits, whole_cache = kvlib.prefill(params, ids)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=4)))
    cache = kvlib.make_cache(config)
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):
        logits, cache = kvlib.prefill(params, ids[start:end], cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.vstack(pieces), whole_logits, rtol=0, atol=TOLERANCE)
    for layer in range(config.n_layers):
        np.testing.assert_allclose(cache.keys(layer), whole_cache.keys(layer), atol=TOLERANCE)
        np.testing.assert_allclose(cache.values(layer), whole_cache.values(layer),
                                   atol=TOLERANCE)


@given(models(), st.data())
@settings(max_examples=60, deadline=None)
def test_truncate_restores_exactly_the_state_before_the_appended_positions(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 2, 20)
    cut = data.draw(st.integers(1, len(ids) - 1))
    _, cache = kvlib.prefill(params, ids[:cut])
    before = [(cache.keys(i).copy(), cache.values(i).copy()) for i in range(config.n_layers)]
    kvlib.prefill(params, ids[cut:], cache)
    if isinstance(cache, kvlib.SlidingWindowCache) and len(ids) > \
            config.sink_tokens + config.window:
        with pytest.raises(ValueError, match="overwritten"):
            cache.truncate(cut)
        return
    cache.truncate(cut)
    assert len(cache) == cut and cache.nbytes == kvlib.config_cache_bytes(config, cut)
    for layer, (keys, values) in enumerate(before):
        np.testing.assert_array_equal(cache.keys(layer), keys)
        np.testing.assert_array_equal(cache.values(layer), values)
    # and it goes on as if the truncated positions had never been there
    logits, _ = kvlib.prefill(params, ids[cut:], cache)
    np.testing.assert_allclose(logits, kvlib.forward(params, ids)[cut:], atol=TOLERANCE)


@given(models(), st.data())
@settings(max_examples=40, deadline=None)
def test_greedy_generation_is_the_same_with_and_without_the_cache(model, data):
    params, config = model
    prompt = token_lists(data.draw, config, 1, 6)
    n = data.draw(st.integers(1, config.context_length - len(prompt)))
    assert kvlib.generate(params, prompt, n) == kvlib.generate(params, prompt, n,
                                                               use_cache=False)


# --------------------------------------------------------------------------- positions

def test_a_decode_step_uses_position_len_cache():
    """Guards the equality tests above: a decode step at the wrong position is wrong."""
    config = kvlib.ModelConfig(positions="learned", norm="layer", bias=True)
    params = kvlib.init_params(config)
    ids = [0, 3, 7, 1, 9]
    _, cache = kvlib.prefill(params, ids)
    right = kvlib.decode_step(params, 5, cache)
    np.testing.assert_allclose(right, kvlib.forward(params, ids + [5], last_only=True),
                               atol=TOLERANCE)
    shifted = params.position_table[np.r_[1:config.context_length, 0]]
    wrong = dataclasses.replace(params, position_table=np.ascontiguousarray(shifted))
    _, cache = kvlib.prefill(params, ids)
    assert not np.allclose(kvlib.decode_step(wrong, 5, cache), right)


def test_learned_positions_stop_at_the_context_length_and_change_nothing():
    config = kvlib.ModelConfig(positions="learned", context_length=8)
    params = kvlib.init_params(config)
    cache = kvlib.KVCache(config)
    kvlib.prefill(params, [0, 1, 2, 3, 4, 5, 6, 7], cache)
    with pytest.raises(ValueError, match="full"):
        kvlib.decode_step(params, 1, cache)
    with pytest.raises(ValueError, match="past the context length 8"):
        kvlib.add_positions(np.zeros((1, 4)), params.position_table, [8])
    assert len(cache) == 8


def test_rotary_scores_depend_on_the_distance_only():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 8)), rng.standard_normal((1, 8))

    def score(m, n):
        qm = kvlib.RotaryPositions(np.array([m]), 8).rotate(q)
        kn = kvlib.RotaryPositions(np.array([n]), 8).rotate(k)
        return float((qm @ kn.T)[0, 0])

    assert score(5, 2) == pytest.approx(score(103, 100), abs=1e-12)
    assert score(7, 7) == pytest.approx(float((q @ k.T)[0, 0]), abs=1e-12)   # distance 0: no turn
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-6)


def test_rotation_keeps_lengths_and_is_undone_by_the_opposite_angle():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((6, 12))               # 3 heads of 4
    angles = kvlib.rotary_angles(np.arange(6), 4)
    turned = kvlib.rotate_pairs(X, angles)
    np.testing.assert_allclose(np.linalg.norm(turned.reshape(6, 6, 2), axis=-1),
                               np.linalg.norm(X.reshape(6, 6, 2), axis=-1))
    np.testing.assert_allclose(kvlib.rotate_pairs(turned, -angles), X, atol=1e-12)
    assert kvlib.rotate_pairs(X.astype(np.float32), angles).dtype == np.float32


def test_rotary_keys_are_cached_after_the_rotation():
    config = kvlib.ModelConfig(positions="rotary")
    params = kvlib.init_params(config)
    ids = [0, 3, 7, 1, 9]
    _, cache = kvlib.prefill(params, ids)
    X = kvlib.embed(np.array(ids), params.embedding)
    K = X @ params.layers[0].Wk
    rotated = kvlib.RotaryPositions(np.arange(5), config.head_dim).rotate(K)
    np.testing.assert_allclose(cache.keys(0), rotated, atol=1e-12)
    assert not np.allclose(cache.keys(0), K)


# --------------------------------------------------------------------------- K/V heads

@given(models(latent=False, window=False), st.data())
@settings(max_examples=40, deadline=None)
def test_gqa_with_as_many_kv_heads_as_query_heads_is_exactly_mha(model, data):
    _, config = model
    params = kvlib.init_params(config.replace(n_kv_heads=None))
    explicit = params.with_config(n_kv_heads=config.n_heads)
    mha = params.with_config(n_kv_heads=None)
    ids = token_lists(data.draw, config, 1, 12)
    np.testing.assert_array_equal(kvlib.forward(explicit, ids), kvlib.forward(mha, ids))


def _duplicated_kv_heads(params):
    """The MHA model in which every query head has its own copy of its group's K/V head."""
    config = params.config
    group = config.n_heads // config.kv_heads
    dh = config.head_dim

    def widen(W):
        heads = W.reshape(W.shape[0], config.kv_heads, dh) if W.ndim == 2 else \
            W.reshape(config.kv_heads, dh)
        return np.repeat(heads, group, axis=-2).reshape(*W.shape[:-1], config.d_model)

    layers = []
    for layer in params.layers:
        changes = {"Wk": widen(layer.Wk), "Wv": widen(layer.Wv)}
        if layer.bk is not None:
            changes |= {"bk": widen(layer.bk), "bv": widen(layer.bv)}
        layers.append(dataclasses.replace(layer, **changes))
    return kvlib.Params(config.replace(n_kv_heads=None), params.embedding, layers,
                        params.position_table, params.ln_f_gain, params.ln_f_bias)


@given(models(latent=False), st.data())
@settings(max_examples=40, deadline=None)
def test_gqa_equals_mha_with_each_kv_head_copied_to_its_group(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 1, 20)
    np.testing.assert_allclose(kvlib.forward(params, ids),
                               kvlib.forward(_duplicated_kv_heads(params), ids),
                               rtol=0, atol=TOLERANCE)


def test_gqa_cache_is_narrower_by_the_group_size():
    base = dict(vocab_size=50, d_model=32, n_heads=8, n_layers=2, d_ff=16, context_length=16)
    for n_kv_heads, factor in ((8, 1), (4, 2), (2, 4), (1, 8)):
        config = kvlib.ModelConfig(**base, n_kv_heads=n_kv_heads)
        _, cache = kvlib.prefill(kvlib.init_params(config), list(range(10)))
        assert cache.keys(0).shape == (10, 32 // factor)
        assert cache.nbytes == kvlib.kv_cache_bytes(2, None, 10, dtype_bytes=8,
                                                    n_kv_heads=n_kv_heads, head_dim=4)
        assert cache.nbytes * factor == kvlib.kv_cache_bytes(2, 32, 10, dtype_bytes=8)


# --------------------------------------------------------------------------- latent

@given(models(latent=True), st.data())
@settings(max_examples=40, deadline=None)
def test_absorbed_latent_attention_equals_rebuilding_k_and_v(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 2, 16)
    cut = data.draw(st.integers(1, len(ids) - 1))
    layer = params.layers[0]
    X = data.draw(st.integers(0, 100).map(
        lambda s: np.random.default_rng(s).standard_normal((len(ids), config.d_model))))
    rotary = kvlib.RotaryPositions(np.arange(len(ids)), config.rope_head_dim) \
        if config.rope_head_dim else None
    mask = kvlib.causal_mask(len(ids))
    absorbed = latent.latent_attention(X, layer, config.n_heads, mask, rotary=rotary)
    rebuilt = latent.latent_attention_rebuilt(X, layer, config.n_heads, mask, rotary=rotary)
    np.testing.assert_allclose(absorbed, rebuilt, rtol=0, atol=TOLERANCE)
    # continuing cached latents: the last chunk's rows only
    past = X[:cut]
    past_rotary = kvlib.RotaryPositions(np.arange(cut), config.rope_head_dim) \
        if config.rope_head_dim else None
    now_rotary = kvlib.RotaryPositions(np.arange(cut, len(ids)), config.rope_head_dim) \
        if config.rope_head_dim else None
    continued = latent.latent_attention_rebuilt(
        X[cut:], layer, config.n_heads, kvlib.causal_mask(len(ids) - cut, len(ids)),
        rotary=now_rotary, past_latent=latent.compress_kv(past, layer),
        past_key_rope=latent.rope_keys(past, layer, past_rotary))
    np.testing.assert_allclose(continued, rebuilt[cut:], rtol=0, atol=TOLERANCE)


def test_latent_cache_holds_one_row_of_latent_and_rotary_key():
    config = kvlib.ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=16,
                               context_length=16, positions="rotary", latent_dim=6,
                               rope_head_dim=2)
    _, cache = kvlib.prefill(kvlib.init_params(config), list(range(10)))
    assert isinstance(cache, kvlib.LatentKVCache)
    assert cache.keys(0).shape == (10, 8) and cache.values(0).shape == (10, 6)
    assert np.shares_memory(cache.keys(1), cache.values(1))
    assert cache.nbytes == kvlib.latent_cache_bytes(2, 6, 2, 10, dtype_bytes=8)
    assert cache.nbytes * 8 == kvlib.kv_cache_bytes(2, 32, 10, dtype_bytes=8)


def test_latent_attention_needs_a_rotary_part_with_rotary_positions():
    with pytest.raises(ValueError, match="rope_head_dim > 0"):
        kvlib.ModelConfig(positions="rotary", latent_dim=4)
    with pytest.raises(ValueError, match="needs positions='rotary'"):
        kvlib.ModelConfig(latent_dim=4, rope_head_dim=2)


# --------------------------------------------------------------------------- windows

@given(models(window=True, positions="rotary"), st.data())
@settings(max_examples=40, deadline=None)
def test_the_ring_buffer_equals_a_full_cache_with_a_banded_mask(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 2, config.context_length)
    ring_logits, ring = kvlib.prefill(params, ids[:1])
    full_logits, full = kvlib.prefill(params, ids[:1], kvlib.KVCache(config))
    for token in ids[1:]:
        np.testing.assert_allclose(kvlib.decode_step(params, token, ring),
                                   kvlib.decode_step(params, token, full), atol=TOLERANCE)
    assert isinstance(ring, kvlib.SlidingWindowCache)
    assert ring.nbytes <= kvlib.config_cache_bytes(config, config.window + config.sink_tokens)
    assert full.nbytes == kvlib.kv_cache_bytes(config.n_layers, None, len(ids), dtype_bytes=8,
                                               n_kv_heads=config.kv_heads,
                                               head_dim=config.head_dim)


def test_the_window_cache_stops_growing_and_keeps_the_sinks():
    config = kvlib.ModelConfig(positions="rotary", window=4, sink_tokens=2, context_length=32)
    params = kvlib.init_params(config)
    _, cache = kvlib.prefill(params, [0, 3, 7])
    sizes = []
    for step in range(20):
        kvlib.decode_step(params, step % 12, cache)
        sizes.append(cache.nbytes)
    assert sizes[-1] == sizes[-10] == kvlib.config_cache_bytes(config, 6)
    np.testing.assert_array_equal(cache.key_positions(), [0, 1, 19, 20, 21, 22])


def test_a_window_mask_with_sinks():
    mask = kvlib.attention_mask(np.arange(6), np.arange(6), window=2, sink_tokens=1)
    expected = np.array([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 0, 1, 1, 0, 0],
                         [1, 0, 0, 1, 1, 0],
                         [1, 0, 0, 0, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(kvlib.attention_mask(np.arange(3, 5), np.arange(5)),
                                  kvlib.causal_mask(2, 5))


# --------------------------------------------------------------------------- configs

@pytest.mark.parametrize("options, rule", [
    (dict(n_heads=2, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(n_kv_heads=0), "at least 1"),
    (dict(window=33), "cannot exceed the context length"),
    (dict(window=30, sink_tokens=4), "cannot exceed the context"),
    (dict(sink_tokens=2), "give a window"),
    (dict(positions="absolute"), "positions must be one of"),
    (dict(norm="batch"), "norm must be one of"),
    (dict(mlp="relu"), "mlp must be one of"),
    (dict(rope_pairing="adjacent"), "rope_pairing must be one of"),
    (dict(bias="yes"), "True or False"),
    (dict(d_model=6, n_heads=2, positions="rotary"), "must be even"),
    (dict(latent_dim=4, n_kv_heads=1), "leave n_kv_heads"),
    (dict(latent_dim=4, window=4), "does not combine"),
    (dict(latent_dim=4, bias=True), "no biases"),
    (dict(rope_head_dim=2), "give latent_dim"),
])
def test_impossible_configs_name_the_rule(options, rule):
    with pytest.raises((ValueError, TypeError), match=rule):
        kvlib.ModelConfig(**options)


def test_with_config_refuses_changes_that_need_other_weights():
    params = kvlib.init_params()
    assert params.with_config(window=4).config.window == 4
    with pytest.raises(ValueError, match="Wk has shape"):
        params.with_config(n_kv_heads=1)
    with pytest.raises(ValueError, match="position_table is missing"):
        params.with_config(positions="learned")


def test_the_flop_formulas_count_the_products_of_every_architecture():
    for config in (
        kvlib.ModelConfig(positions="learned", norm="layer", bias=True),
        kvlib.ModelConfig(d_model=8, n_heads=4, n_kv_heads=2, positions="rotary"),
        kvlib.ModelConfig(d_model=8, n_heads=4, latent_dim=3, positions="rotary",
                          rope_head_dim=2),
        kvlib.ModelConfig(d_model=8, n_heads=4, latent_dim=3),
        kvlib.ModelConfig(positions="rotary", window=3, sink_tokens=1),
    ):
        params = kvlib.init_params(config)
        ids = [0, 3, 7, 1, 9, 2, 4]
        _, counted = kvlib.count_multiply_adds(kvlib.forward, params, ids)
        assert counted == kvlib.forward_multiply_adds(config, 7), config
        _, cache = kvlib.prefill(params, ids)
        _, counted = kvlib.count_multiply_adds(kvlib.decode_step, params, 5, cache)
        assert counted == kvlib.decode_step_multiply_adds(config, 7), config
        _, counted = kvlib.count_multiply_adds(kvlib.prefill, params, [1, 2], cache)
        assert counted == kvlib.prefill_multiply_adds(config, 2, cached=8), config
        weights = roofline.weights_bytes(config)
        assert weights == params.n_parameters * 8
