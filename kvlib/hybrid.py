"""A hybrid model in numpy: gated DeltaNet layers beside gated attention (Qwen3-Next,
Qwen3.5; kvlib's stories-hybrid), run as transformers' Qwen3NextForCausalLM runs it.

    ids (T,) -> embedding (T, d)
             -> per block: X + mixer(offset_rms_norm(X)), then X + swiglu(offset_rms_norm(X)),
                the mixer a DeltaNet layer or a gated attention layer (config.layer_types)
             -> offset_rms_norm -> @ embedding^T (tied) -> logits (T, V)

hybrid_forward recomputes a sequence from nothing; hybrid_prefill and hybrid_decode_step go
through a kvlib.hybrid_cache.HybridCache, the attention layers appending K and V rows, the
DeltaNet layers replacing their state. Only the attention layers need positions (rotary, on
a quarter of each head); a DeltaNet layer knows the order of its tokens from the
recurrence itself.
"""

from __future__ import annotations

import numpy as np

from .cache import all_or_nothing
from .checkpoints.hybrid import load_hybrid  # noqa: F401  (re-exported: kvlib.hybrid.load_hybrid)
from .checks import as_count, as_whole_numbers
from .deltanet import (
    DeltaNetLayerParams,
    DeltaNetState,
    HybridParams,
    deltanet_mixer,
    gated_attention_mixer,
    offset_rms_norm,
    swiglu,
)
from .hybrid_cache import HybridCache
from .positions import RotaryPositions


def _check_params(params) -> None:
    if not isinstance(params, HybridParams):
        raise TypeError(f"params must be kvlib.deltanet.HybridParams (kvlib.hybrid.load_hybrid),"
                        f" got {type(params).__name__}")


def _check_ids(ids, params: HybridParams, what: str = "prompt") -> np.ndarray:
    """Token ids of this model's vocabulary: a non-empty flat sequence (or one id)."""
    _check_params(params)
    if isinstance(ids, np.ndarray) and ids.ndim == 0:       # one id, as argmax returns it
        ids = ids.reshape(1)
    ids = as_whole_numbers(f"the {what}'s token ids", ids)
    vocab_size = params.config.vocab_size
    if len(ids) == 0 or ids.max() >= vocab_size:
        raise ValueError(f"the {what} must be at least one token id between 0 and "
                         f"{vocab_size - 1}, got {ids.tolist()[:10]}")
    return ids


def hybrid_block(X: np.ndarray, index: int, params: HybridParams, rotary: RotaryPositions,
                 cache: HybridCache | None) -> np.ndarray:
    """Block `index`: X (T, d) -> (T, d). Its mixer reads and updates the cache (the
    layer's K and V rows, or its DeltaNet state), when there is one."""
    config, layer = params.config, params.layers[index]
    eps = config.norm_epsilon
    normed = offset_rms_norm(X, layer.input_norm, eps)
    if isinstance(layer, DeltaNetLayerParams):
        state = DeltaNetState.zeros(config) if cache is None else cache.state(index)
        mixed, state = deltanet_mixer(normed, layer, config, state)
        if cache is not None:
            cache.set_state(index, state)
    else:
        kv, slot = (None, 0) if cache is None else (cache.kv, cache.slots[index])
        mixed = gated_attention_mixer(normed, layer, config, rotary, kv, slot)
    X = X + mixed
    return X + swiglu(offset_rms_norm(X, layer.post_norm, eps), layer.W_gate, layer.W_up,
                      layer.W_down)


def _run(params: HybridParams, ids: np.ndarray, cache: HybridCache | None,
         start: int) -> np.ndarray:
    """Every block on the tokens at positions start .. start + T - 1 -> logits (T, V)."""
    config = params.config
    rotary = RotaryPositions(np.arange(start, start + len(ids)), config.rotary_dim,
                             config.rope_base, "half")
    X = params.embedding[ids]
    for index in range(config.n_layers):
        X = hybrid_block(X, index, params, rotary, cache)
    return offset_rms_norm(X, params.final_norm, config.norm_epsilon) @ params.embedding.T


def hybrid_forward(params: HybridParams, ids) -> np.ndarray:
    """Recompute a whole sequence with no cache: ids (T,) -> logits (T, V)."""
    ids = _check_ids(ids, params)
    if len(ids) > params.config.context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context length is "
                         f"{params.config.context_length}")
    return _run(params, ids, None, 0)


def _check_cache(cache, params: HybridParams) -> None:
    if not isinstance(cache, HybridCache):
        raise TypeError(f"cache must be a kvlib.hybrid_cache.HybridCache, got "
                        f"{type(cache).__name__}")
    if cache.config != params.config:
        raise ValueError("this cache was made for another model: its config is not the "
                         "params' config")


def _pieces(cache: HybridCache, n_tokens: int) -> list[int]:
    """Lengths to run n_tokens in, so that each multiple of cache.snapshot_every ends one."""
    start, end, every = len(cache), len(cache) + n_tokens, cache.snapshot_every
    bounds = [start, *(range((start // every + 1) * every, end, every) if every else ()), end]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def hybrid_prefill(params: HybridParams, ids, cache: HybridCache | None = None):
    """The prompt through every layer, filling the cache: ids (T,) -> (logits (T, V), cache).

    Given a cache that already holds P positions, the tokens continue it (positions P ..
    P + T - 1). A cache with snapshot_every = N gets the prompt in pieces that end at each
    multiple of N, where the DeltaNet states are kept. If the call fails, the cache is left
    as it was.
    """
    ids = _check_ids(ids, params)
    cache = HybridCache(params.config) if cache is None else cache
    _check_cache(cache, params)
    if len(cache) + len(ids) > cache.capacity:
        raise ValueError(f"the prompt does not fit: the cache holds {len(cache)} of "
                         f"{cache.capacity} positions (the context length, unless given) and "
                         f"the prompt adds {len(ids)}")
    logits, start = [], 0
    with all_or_nothing(cache):
        for piece in _pieces(cache, len(ids)):
            logits.append(_run(params, ids[start:start + piece], cache, len(cache)))
            cache.advance(piece)
            start += piece
    return np.concatenate(logits), cache


def hybrid_decode_step(params: HybridParams, token_id, cache: HybridCache) -> np.ndarray:
    """One new token after the cached sequence: token id -> logits (1, V). The attention
    layers append a row, the DeltaNet layers replace their state (the recurrent form, one
    step). If the call fails, the cache is left as it was."""
    ids = _check_ids(token_id, params, what="token")
    if len(ids) != 1:
        raise ValueError(f"hybrid_decode_step takes exactly one token id, got {len(ids)}; "
                         "use hybrid_prefill for several")
    _check_cache(cache, params)
    if len(cache) == 0:
        raise ValueError("hybrid_decode_step needs a cache that holds the prompt: run "
                         "hybrid_prefill first")
    if len(cache) >= cache.capacity:
        raise ValueError(f"the cache is full ({len(cache)} of {cache.capacity} positions)")
    with all_or_nothing(cache):
        logits = _run(params, ids, cache, len(cache))
        cache.advance(1)
    return logits


def hybrid_generate(params: HybridParams, ids, max_new_tokens: int,
                    cache: HybridCache | None = None) -> list[int]:
    """Greedy continuation through the cache: prefill, then one decode step a token.
    -> the max_new_tokens new ids (fewer if the context fills up)."""
    max_new_tokens = as_count("max_new_tokens", max_new_tokens)
    logits, cache = hybrid_prefill(params, ids, cache)
    new = []
    while len(new) < max_new_tokens:
        new.append(int(np.argmax(logits[-1])))
        if len(new) == max_new_tokens or len(cache) >= cache.capacity:
            break
        logits = hybrid_decode_step(params, new[-1], cache)
    return new
