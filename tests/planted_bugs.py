"""Cache bugs the zoo (kvlib.cache_bugs) does not show, planted on small models for
tests/test_debug.py: each must be found at its place and read from the evidence (a review planted
bugs like these; before, NaNs passed as agreement and several readings named a cause the
evidence did not show).

Decode steps (params, token_id, cache) -> logits, prefills (params, ids, cache) -> (logits,
cache), and caches that store something else than they are given.
"""

from dataclasses import replace

import numpy as np

import kvlib
from kvlib import cache_bugs as bugs
from kvlib import model
from kvlib.cache import KVCache
from kvlib.positions import rotary_positions


def toy(**options):
    """A Llama-shaped model of 3 layers, 4 query heads and 2 K/V heads, random weights, float64."""
    config = dict(vocab_size=30, d_model=16, n_heads=4, n_kv_heads=2, n_layers=3, d_ff=16,
                  context_length=40, positions="rotary", norm="rms", mlp="swiglu")
    return kvlib.init_params(kvlib.ModelConfig(**(config | options)), seed=7)


def loud(params, factor: float = 200.0):
    """params with Wq and Wk scaled up: scores beyond float16's range (float64 holds them)."""
    layers = tuple(replace(layer, Wq=layer.Wq * factor, Wk=layer.Wk * factor)
                   for layer in params.layers)
    return replace(params, layers=layers)


# ------------------------------------------------------------------------------ not numbers

def nan_logits(params, token_id, cache):
    """The right step, whose logits come back as NaN."""
    return bugs.decode_step(params, token_id, cache) * np.nan


class NaNValues(KVCache):
    """Values from position `start` on written from an uninitialised buffer (NaN here)."""

    def __init__(self, config, start: int):
        super().__init__(config)
        self.start = start

    def _store(self, layer, K, V):
        V = V.copy()
        V[max(self.start - self._lengths[layer], 0):] = np.nan
        return super()._store(layer, K, V)


def _blocks_with_attention(params, token_id, cache, attention):
    """A decode step through kvlib.model.block_with_attention with a learner's attention:
    attention(layer_index, Q, K, V) -> (T, h x dh), the cache appended inside it."""
    config = params.config
    positions = np.array([len(cache)])
    rotary = rotary_positions(config, positions)
    X = model.embed(np.asarray([token_id]), params.embedding)
    for index, layer in enumerate(params.layers):
        X = model.block_with_attention(
            X, layer, lambda Q, K, V, index=index: attention(index, Q, K, V), rotary=rotary,
            norm_epsilon=config.norm_epsilon)
    X = model.normalize(X[-1:], params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return model.unembed(X, params.embedding)


def scores_in_float16(params, token_id, cache):
    """q and k cast to float16 before the scores: past 65504 they overflow to inf."""
    config = params.config

    def attention(index, Q, K, V):
        K, V = cache.append(index, K, V)
        Qh = model.split_heads(Q, config.n_heads).astype(np.float16)
        Kh = model.split_heads(K, config.kv_heads).astype(np.float16)
        weights = model.attention_weights(Qh, Kh).astype(Q.dtype)
        return model.merge_heads(model.weighted_sum(weights,
                                                    model.split_heads(V, config.kv_heads)))
    return _blocks_with_attention(params, token_id, cache, attention)


# ------------------------------------------------------------------------------ attention read

def heads_tiled(params, token_id, cache):
    """Grouped K/V heads repeated with np.tile (query head i reads K/V head i % kv) where
    np.repeat is right (i // group)."""
    config = params.config
    group = config.n_heads // config.kv_heads

    def attention(index, Q, K, V):
        K, V = cache.append(index, K, V)
        Kh = np.tile(model.split_heads(K, config.kv_heads), (group, 1, 1))
        Vh = np.tile(model.split_heads(V, config.kv_heads), (group, 1, 1))
        weights = model.attention_weights(model.split_heads(Q, config.n_heads), Kh)
        return model.merge_heads(model.weighted_sum(weights, Vh))
    return _blocks_with_attention(params, token_id, cache, attention)


def rotated_again(params, token_id, cache):
    """The cache holds rotated keys, and the step rotates every key again when it reads them."""
    config = params.config

    def attention(index, Q, K, V):
        K, V = cache.append(index, K, V)
        K = rotary_positions(config, np.arange(len(K))).rotate(K)
        weights = model.attention_weights(model.split_heads(Q, config.n_heads),
                                          model.split_heads(K, config.kv_heads))
        return model.merge_heads(model.weighted_sum(weights,
                                                    model.split_heads(V, config.kv_heads)))
    return _blocks_with_attention(params, token_id, cache, attention)


def _mask(params, positions, cache, allowed):
    keys = cache.key_positions(len(positions))
    return allowed(keys[None, :], positions[:, None])


def prefill_strict_mask(params, ids, cache):
    """A causal mask with key < query, where key <= query is right: the first query sees
    nothing, the others not themselves."""
    positions = np.arange(len(cache), len(cache) + len(ids))
    return bugs.run_blocks(params, ids, positions, cache,
                           _mask(params, positions, cache, np.less),
                           rotary_positions(params.config, positions)), cache


def decode_strict_mask(params, token_id, cache):
    """The strict mask in a decode step: the new token does not see itself."""
    positions = np.array([len(cache)])
    return bugs.run_blocks(params, [token_id], positions, cache,
                           _mask(params, positions, cache, np.less),
                           rotary_positions(params.config, positions))


def decode_window_one_wide(params, token_id, cache):
    """A sliding window that lets the query see W + 1 positions (mlx-lm PR #390's own bug)."""
    positions = np.array([len(cache)])
    mask = model.attention_mask(positions, cache.key_positions(1), params.config.window + 1,
                                params.config.sink_tokens)
    return bugs.run_blocks(params, [token_id], positions, cache, mask,
                           rotary_positions(params.config, positions))


# ------------------------------------------------------------------------------ what is cached

class ValuesHoldKeys(KVCache):
    """The value cache is written with the keys."""

    def _store(self, layer, K, V):
        return super()._store(layer, K, K)


class Int8ValuesOtherScales(KVCache):
    """Values quantized to int8 with one scale per row (token), dequantized with one scale per
    column (channel)."""

    def _store(self, layer, K, V):
        per_row = np.abs(V).max(axis=1, keepdims=True) / 127
        per_column = np.abs(V).max(axis=0, keepdims=True) / 127
        return super()._store(layer, K, np.round(V / per_row) * per_column)


class LastLayerNeverWritten(KVCache):
    """The last layer's rows are counted but never written (they stay zeros)."""

    def _store(self, layer, K, V):
        if layer < self.config.n_layers - 1:
            return super()._store(layer, K, V)
        self._lengths[layer] += len(K)
        return self.keys(layer), self.values(layer)


# ------------------------------------------------------------------------------ passes

def prefill_in_chunks(params, ids, cache, chunk: int = 8):
    """The prompt in chunks of `chunk` tokens with kvlib.prefill (right)."""
    ids = list(ids)
    for start in range(0, len(ids), chunk):
        logits, cache = kvlib.prefill(params, ids[start:start + chunk], cache)
    return logits, cache


def chunks_masked_from_the_top(params, ids, cache, chunk: int = 8):
    """A prompt in chunks whose causal mask is built from the top-left corner (np.tri(T, S)),
    right for the first chunk only: later chunks' queries see the first keys alone."""
    ids = list(ids)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        positions = np.arange(len(cache), len(cache) + len(part))
        mask = np.tri(len(part), len(cache) + len(part), dtype=bool)
        logits = bugs.run_blocks(params, part, positions, cache, mask,
                                 rotary_positions(params.config, positions))
    return logits, cache


def layer_without_cache(params, token_id, cache, skipped: int = 2):
    """A decode step whose layer `skipped` runs its block without the cache: it attends to the
    new token alone and appends nothing there."""
    config = params.config
    positions = np.array([len(cache)])
    rotary = rotary_positions(config, positions)
    X = model.embed(np.asarray([token_id]), params.embedding)
    for index, layer in enumerate(params.layers):
        X = model.decoder_block(X, layer, config.n_heads,
                                cache=None if index == skipped else cache, layer_index=index,
                                rotary=rotary, norm_epsilon=config.norm_epsilon)
    X = model.normalize(X[-1:], params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return model.unembed(X, params.embedding)
