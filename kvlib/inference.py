"""Running the model (notebooks 00, 06-08): full recomputation, prefill, cached decode, generate."""

from __future__ import annotations

import numpy as np

from .cache import KVCache
from .model import causal_mask, decoder_block, embed, softmax, unembed
from .params import Params


def check_ids(ids, params: Params, what: str = "prompt") -> np.ndarray:
    """Validate token ids: a non-empty sequence of integers in [0, vocab_size) -> int array (T,)."""
    if not isinstance(params, Params):
        raise TypeError("params must be kvlib Params (from init_params), "
                        f"got {type(params).__name__}")
    array = np.asarray(ids)
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1:
        raise ValueError(f"the {what} must be a flat sequence of token ids, "
                         f"got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"the {what} is empty: give at least one token id "
                         "(for example the BOS id 0)")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {array.tolist()!r} ({array.dtype})")
    vocab_size = params.config.vocab_size
    outside = sorted(set(array[(array < 0) | (array >= vocab_size)].tolist()))
    if outside:
        raise ValueError(f"token id(s) {outside} are outside the vocabulary: "
                         f"ids must be between 0 and {vocab_size - 1}")
    return array.astype(np.intp, copy=False)


def _check_cache(cache, params: Params) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a kvlib KVCache, got {type(cache).__name__}")
    if cache.config != params.config:
        raise ValueError(f"this cache was made for another model: {cache.config} "
                         f"is not the params' config {params.config}")


def _run_blocks(params: Params, X, mask, cache, record_attention):
    for index, layer in enumerate(params.layers):
        X = decoder_block(X, layer, params.config.n_heads, mask=mask, cache=cache,
                          layer_index=index, record_attention=record_attention)
    return X


def _logits(params: Params, X, last_only: bool):
    return unembed(X[-1:] if last_only else X, params.embedding)


def forward(params: Params, ids, *, last_only: bool = False, record_attention: list | None = None):
    """Full recomputation, no cache (notebook 00): ids (T,) -> logits (T, V).

    With last_only=True only the last row is unembedded: (1, V), all that choosing the next
    token needs. A list given as record_attention receives each layer's weights (h, T, T).
    """
    ids = check_ids(ids, params)
    if len(ids) > params.config.context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context length is "
                         f"{params.config.context_length}")
    X = _run_blocks(params, embed(ids, params.embedding), causal_mask(len(ids)), None,
                    record_attention)
    return _logits(params, X, last_only)


def prefill(params: Params, ids, cache: KVCache | None = None, *, last_only: bool = False,
            record_attention: list | None = None):
    """The prompt in one parallel pass, filling the cache (notebook 07): ids (T,) ->
    (logits (T, V), cache holding T more positions).

    Given a cache that already holds P positions, it continues it (notebook 08: a second
    chunk of a long prompt, or the next turn of a chat): the T new queries see all P cached
    positions and, among the new ones, only the earlier ones: the causal mask is (T, P + T),
    aligned to the end. Prefilling in chunks gives the same logits as prefilling at once.
    """
    ids = check_ids(ids, params)
    if cache is None:
        cache = KVCache(params.config)
    _check_cache(cache, params)
    past = len(cache)
    if past + len(ids) > cache.capacity:
        raise ValueError(f"the cache holds {past} positions and the prompt adds {len(ids)}, "
                         f"more than the {cache.capacity} the context allows")
    mask = causal_mask(len(ids), past + len(ids))
    X = _run_blocks(params, embed(ids, params.embedding), mask, cache, record_attention)
    return _logits(params, X, last_only), cache


def decode_step(params: Params, token_id, cache: KVCache, *, record_attention: list | None = None):
    """One new token against the cache (notebook 08): token id -> logits (1, V).

    Only the new token's q, k, v (1, d) are computed; its k and v are appended, so every
    layer's cache grows by one row. No mask: every cached position is in the past.
    """
    ids = check_ids(token_id, params, what="token")
    if len(ids) != 1:
        raise ValueError(f"decode_step takes exactly one token id, got {len(ids)}; "
                         "use prefill for several")
    _check_cache(cache, params)
    if len(cache) == 0:
        raise ValueError("decode_step needs a cache that already holds the prompt: "
                         "run prefill first")
    if len(cache) >= cache.capacity:
        raise ValueError(f"the cache is full ({len(cache)} of {cache.capacity} positions): "
                         "the context length is reached")
    X = _run_blocks(params, embed(ids, params.embedding), None, cache, record_attention)
    return _logits(params, X, last_only=True)


def next_token_probabilities(logits_row, temperature: float = 1.0, top_k: int | None = None):
    """Sampling distribution over the vocabulary (notebook 06): logits (V,) -> probabilities (V,).

    Logits are divided by the temperature (below 1 sharpens, above 1 flattens); with top_k,
    all but the k largest logits get probability 0. Temperature 0 is greedy decoding: all
    the probability on the largest logit, the token choose_next_token picks.
    """
    logits_row = np.asarray(logits_row)
    if logits_row.ndim != 1:
        raise ValueError(f"expected one row of logits (V,), got shape {logits_row.shape}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or a positive number, got {temperature}")
    if temperature == 0:
        return (np.arange(len(logits_row)) == np.argmax(logits_row)).astype(logits_row.dtype)
    scaled = logits_row / float(temperature)
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
            raise TypeError(f"top_k must be a whole number or None, got {top_k!r}")
        if not 1 <= top_k <= len(logits_row):
            raise ValueError(f"top_k must be between 1 and {len(logits_row)}, got {top_k}")
        kth_largest = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= kth_largest, scaled, -np.inf)
    return softmax(scaled)


def choose_next_token(logits_row, temperature: float = 0.0, top_k: int | None = None,
                      rng: np.random.Generator | None = None) -> int:
    """Greedy (temperature 0: the argmax) or seeded sampling: logits (V,) -> one token id."""
    if temperature == 0:
        return int(np.argmax(logits_row))
    probabilities = next_token_probabilities(logits_row, temperature, top_k)
    rng = np.random.default_rng() if rng is None else rng
    return int(rng.choice(len(probabilities), p=probabilities.astype(np.float64)))


def generate(params: Params, ids, max_new_tokens: int, use_cache: bool = True,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None):
    """Generate new tokens (notebook 08): prompt ids (P,) -> list of max_new_tokens new ids.

    With the cache: one prefill, then one decode_step per new token. Without: a full
    forward over the whole, growing sequence for every token (unembedding only its last row).
    Both give the same ids. Greedy at temperature 0, otherwise sampled with a generator
    seeded by seed.
    """
    ids = check_ids(ids, params)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive whole number, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or positive, got {temperature}")
    needed = len(ids) + max_new_tokens - 1
    if needed > params.config.context_length:
        raise ValueError(f"a {len(ids)}-token prompt plus {max_new_tokens} new tokens needs "
                         f"{needed} positions; the context length is "
                         f"{params.config.context_length}")
    rng = np.random.default_rng(seed)
    sequence = [int(i) for i in ids]
    if use_cache:
        logits, cache = prefill(params, ids, last_only=True)
    else:
        logits = forward(params, sequence, last_only=True)
    new_ids = []
    while True:
        token = choose_next_token(logits[-1], temperature, top_k, rng)
        new_ids.append(token)
        sequence.append(token)
        if len(new_ids) == max_new_tokens:
            return new_ids
        if use_cache:
            logits = decode_step(params, token, cache)
        else:
            logits = forward(params, sequence, last_only=True)
