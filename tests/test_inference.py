"""Cached decoding equals full recomputation, for many models and prompts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib


@st.composite
def models_and_prompts(draw):
    n_heads = draw(st.integers(1, 4))
    config = kvlib.ModelConfig(
        vocab_size=draw(st.integers(2, 40)),
        d_model=n_heads * draw(st.integers(1, 6)),
        n_heads=n_heads,
        n_layers=draw(st.integers(1, 4)),
        d_ff=draw(st.integers(1, 24)),
        context_length=24,
    )
    params = kvlib.init_params(config, seed=draw(st.integers(0, 10_000)))
    length = draw(st.integers(1, 12))
    prompt = draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=length,
                           max_size=length))
    continuation = draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1,
                                 max_size=10))
    return params, prompt, continuation


@given(models_and_prompts())
@settings(max_examples=60, deadline=None)
def test_cached_decoding_equals_full_recomputation_at_every_step(case):
    params, prompt, continuation = case
    logits, cache = kvlib.prefill(params, prompt)
    np.testing.assert_allclose(logits, kvlib.forward(params, prompt), rtol=0, atol=1e-10)
    sequence = list(prompt)
    for token in continuation:
        sequence.append(token)
        cached = kvlib.decode_step(params, token, cache)
        full = kvlib.forward(params, sequence)[-1:]
        np.testing.assert_allclose(cached, full, rtol=0, atol=1e-10)
        assert len(cache) == len(sequence)


@given(models_and_prompts(), st.data())
@settings(max_examples=40, deadline=None)
def test_chunked_prefill_equals_prefill_at_once(case, data):
    params, prompt, continuation = case
    ids = prompt + continuation
    whole_logits, whole_cache = kvlib.prefill(params, ids)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=3))
                  if len(ids) > 1 else set())
    cache = kvlib.KVCache(params.config)
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):
        logits, cache = kvlib.prefill(params, ids[start:end], cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.vstack(pieces), whole_logits, rtol=0, atol=1e-10)
    for layer in range(params.config.n_layers):
        np.testing.assert_allclose(cache.keys(layer), whole_cache.keys(layer), atol=1e-10)
        np.testing.assert_allclose(cache.values(layer), whole_cache.values(layer), atol=1e-10)


def test_a_mask_aligned_to_the_start_would_be_wrong():
    """Guards the test above: continuing a cache with an unaligned mask changes the result."""
    params = kvlib.init_params()
    ids = [0, 3, 7, 1, 9]
    _, cache = kvlib.prefill(params, ids[:3])
    X = kvlib.embed(np.array(ids[3:]), params.embedding)
    wrong_mask = np.tri(2, 5, dtype=bool)  # aligned to the start: hides cached positions
    wrong = kvlib.decoder_block(X, params.layers[0], 2, wrong_mask, cache, 0)
    _, cache_right = kvlib.prefill(params, ids[:3])
    right = kvlib.decoder_block(X, params.layers[0], 2, kvlib.causal_mask(2, 5), cache_right, 0)
    assert not np.allclose(wrong, right)


@given(models_and_prompts(), st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_greedy_generate_gives_the_same_ids_with_and_without_cache(case, new_tokens):
    params, prompt, _ = case
    with_cache = kvlib.generate(params, prompt, new_tokens, use_cache=True)
    without = kvlib.generate(params, prompt, new_tokens, use_cache=False)
    assert with_cache == without
    assert len(with_cache) == new_tokens


def test_sampled_generate_is_seeded_and_matches_without_cache():
    params = kvlib.init_params()
    prompt = [0, 3, 7, 1, 9]
    a = kvlib.generate(params, prompt, 10, temperature=1.5, top_k=6, seed=7)
    b = kvlib.generate(params, prompt, 10, temperature=1.5, top_k=6, seed=7)
    c = kvlib.generate(params, prompt, 10, use_cache=False, temperature=1.5, top_k=6, seed=7)
    assert a == b == c
    outputs = {tuple(kvlib.generate(params, prompt, 10, temperature=1.5, seed=s))
               for s in range(5)}
    assert len(outputs) > 1


def test_float32_cached_decoding_matches_to_float32_tolerance():
    config = kvlib.ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=3, d_ff=256,
                               context_length=64, dtype="float32")
    params = kvlib.init_params(config, seed=1)
    ids = list(np.random.default_rng(0).integers(0, 300, 20))
    _, cache = kvlib.prefill(params, ids[:10])
    for i in range(10, 20):
        cached = kvlib.decode_step(params, ids[i], cache)
        full = kvlib.forward(params, ids[: i + 1], last_only=True)
        assert cached.dtype == np.float32
        np.testing.assert_allclose(cached, full, rtol=1e-4, atol=1e-4)


def test_next_token_probabilities_temperature_and_top_k():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    p = kvlib.next_token_probabilities(logits, temperature=1.0)
    np.testing.assert_allclose(p, kvlib.softmax(logits))
    cold = kvlib.next_token_probabilities(logits, temperature=0.1)
    hot = kvlib.next_token_probabilities(logits, temperature=10.0)
    assert cold[0] > p[0] > hot[0]
    top2 = kvlib.next_token_probabilities(logits, top_k=2)
    assert (top2[2:] == 0).all()
    np.testing.assert_allclose(top2[:2], kvlib.softmax(logits[:2]))
    assert kvlib.choose_next_token(logits) == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_realistic_sizes_run(dtype):
    """GPT-2 small's widths and heads (fewer layers and a smaller vocabulary, to stay fast)."""
    config = kvlib.ModelConfig(vocab_size=2000, d_model=768, n_heads=12, n_layers=2,
                               d_ff=3072, context_length=1024, dtype=dtype)
    params = kvlib.init_params(config, seed=0)
    logits, cache = kvlib.prefill(params, list(range(40)))
    step = kvlib.decode_step(params, 3, cache)
    assert logits.shape == (40, 2000) and step.shape == (1, 2000)
    assert step.dtype == np.dtype(dtype) and cache.keys(1).shape == (41, 768)


@pytest.mark.parametrize("temperature", [2.2250738585072014e-308, 1e-300, 5e-324])
def test_a_temperature_near_zero_is_greedy_without_overflow_warnings(temperature):
    # found by the fuzz on numpy 2.0: row / t near the largest float, then scaled - max
    # overflowed inside the softmax
    row = np.array([1.0, -1.0, 0.5, -0.75])
    probabilities = kvlib.next_token_probabilities(row, temperature)
    assert np.array_equal(probabilities, [1.0, 0.0, 0.0, 0.0])


def test_next_token_losses_are_minus_the_log_probability_of_each_next_id():
    rng = np.random.default_rng(0)
    logits, ids = rng.normal(size=(6, 9)) * 5, rng.integers(0, 9, size=6)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected = [-np.log(probabilities[t, ids[t + 1]]) for t in range(5)]
    assert np.allclose(kvlib.next_token_losses(logits, ids), expected, atol=1e-12)
    for bad_logits, bad_ids in ((logits[0], ids), (logits, ids[:3]), (logits[:1], ids[:1])):
        with pytest.raises(ValueError, match="need logits|2-D array"):
            kvlib.next_token_losses(bad_logits, bad_ids)
