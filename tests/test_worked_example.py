"""The article's worked example, step by step: every shape, and the predicted token 5 (the
toy model `params` and the prompt's `article_ids` are conftest's fixtures)."""

import numpy as np

import kvlib
from kvlib import (
    attention_weights,
    causal_mask,
    embed,
    merge_heads,
    mlp,
    output_projection,
    project_qkv,
    split_heads,
    unembed,
    weighted_sum,
)


def test_default_config_is_the_article_example():
    config = kvlib.ModelConfig()
    assert (config.vocab_size, config.d_model, config.n_heads, config.head_dim,
            config.n_layers, config.d_ff, config.dtype) == (12, 4, 2, 2, 3, 8, "float64")


def test_prompt_ids(article_ids):
    assert article_ids == [0, 3, 7, 1, 9]


def test_every_prefill_shape(params, article_ids):
    layer = params.layers[0]
    assert params.embedding.shape == (12, 4)
    X = embed(np.array(article_ids), params.embedding)
    assert X.shape == (5, 4)
    assert layer.Wq.shape == layer.Wk.shape == layer.Wv.shape == (4, 4)
    Q, K, V = project_qkv(X, layer)
    assert Q.shape == K.shape == V.shape == (5, 4)
    Qh, Kh, Vh = (split_heads(M, 2) for M in (Q, K, V))
    assert Qh.shape == (2, 5, 2)  # two (5, 2) slices
    np.testing.assert_array_equal(Qh[1], Q[:, 2:4])
    weights = attention_weights(Qh, Kh, causal_mask(5))
    assert weights.shape == (2, 5, 5)
    heads = weighted_sum(weights, Vh)
    assert heads.shape == (2, 5, 2)
    concatenated = merge_heads(heads)
    assert concatenated.shape == (5, 4)
    assert layer.Wo.shape == (4, 4)
    X_attended = X + output_projection(concatenated, layer.Wo)
    assert X_attended.shape == (5, 4)
    assert layer.W_up.shape == (4, 8) and layer.W_down.shape == (8, 4)
    assert (X_attended @ layer.W_up).shape == (5, 8)
    X1 = X_attended + mlp(X_attended, layer)
    assert X1.shape == (5, 4)
    np.testing.assert_allclose(X1, kvlib.decoder_block(X, layer, 2, causal_mask(5)), atol=1e-15)
    X3 = X
    for block in params.layers:
        X3 = kvlib.decoder_block(X3, block, 2, causal_mask(5))
    logits = unembed(X3, params.embedding)
    assert logits.shape == (5, 12)
    np.testing.assert_allclose(logits, kvlib.forward(params, article_ids), atol=1e-15)


def test_greedy_prediction_is_token_5(params, article_ids):
    logits = kvlib.forward(params, article_ids)
    assert int(np.argmax(logits[-1])) == 5


def test_default_seed_continuation_as_documented(params, article_ids):
    new = kvlib.generate(params, article_ids, 8)
    assert new[:2] == [5, 2]
    assert len(set(new)) >= 3 and 0 not in new


def test_cache_shapes_after_prefill_and_one_decode(params, article_ids):
    logits, cache = kvlib.prefill(params, article_ids)
    assert logits.shape == (5, 12)
    assert len(cache) == 5
    for layer in range(3):
        assert cache.keys(layer).shape == cache.values(layer).shape == (5, 4)
    logits = kvlib.decode_step(params, 5, cache)
    assert logits.shape == (1, 12)
    assert len(cache) == 6
    for layer in range(3):
        assert cache.keys(layer).shape == cache.values(layer).shape == (6, 4)


def test_decode_step_shapes(params, article_ids):
    _, cache = kvlib.prefill(params, article_ids)
    x = embed(np.array([5]), params.embedding)
    assert x.shape == (1, 4)
    q, k, v = project_qkv(x, params.layers[0])
    assert q.shape == k.shape == v.shape == (1, 4)
    K = np.vstack([cache.keys(0), k])
    assert K.shape == (6, 4)
    scores_one_head = split_heads(q, 2)[0] @ split_heads(K, 2)[0].T
    assert scores_one_head.shape == (1, 6)


def test_cache_holds_only_keys_and_values(params, article_ids):
    _, cache = kvlib.prefill(params, article_ids)
    X = embed(np.array(article_ids), params.embedding)
    _, K, V = project_qkv(X, params.layers[0])
    np.testing.assert_allclose(cache.keys(0), K, atol=1e-15)
    np.testing.assert_allclose(cache.values(0), V, atol=1e-15)
    assert not hasattr(cache, "queries")
