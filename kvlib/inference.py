"""Running the model (big_picture, logits_next_token to kv_cached_decode): full recomputation,
prefill, cached decode, generate.

One loop serves every architecture kvlib has: the toy, GPT-2 (real_model), rotary
positions, fewer K/V heads, latent attention and sliding windows
(positions_and_rope to sliding_windows_and_sinks), and Llama's (SmolLM2, the model_of_today lesson).
What differs is chosen from the config: the position scheme, the block
(decoder_block or latent_decoder_block), the mask (causal, or banded with sinks), and the cache kind
(kvlib.make_cache); the norm and the MLP follow from the weights each layer has
(kvlib.model.normalize and mlp).
"""

from __future__ import annotations

import numpy as np

from .cache import BaseKVCache, all_or_nothing, make_cache
from .checks import (
    as_cache,
    as_count,
    as_flag,
    as_instance,
    as_list_or_none,
    as_logits_row,
    as_matrix,
    as_params,
    as_sampling,
    as_token_ids,
    as_whole_number,
    trusted,
)
from .config import ModelConfig
from .latent import latent_decoder_block
from .model import attention_mask, decoder_block, embed, normalize, softmax, unembed
from .params import Params
from .positions import add_positions, rotary_positions


def check_ids(ids, params: Params, what: str = "prompt") -> np.ndarray:
    """Token ids of the params' vocabulary, checked: a non-empty flat sequence of ids in
    [0, vocab_size) (or one id) -> int array (T,) (kvlib.checks.as_token_ids for a model)."""
    return as_token_ids(ids, as_params(params).config.vocab_size, what)


def embed_tokens(params: Params, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The rows the first block reads (embedding_lookup, real_model): ids (T,) at positions
    (T,) -> X (T, d), the table's rows plus, with learned positions (GPT-2), each position's row."""
    X = embed(ids, params.embedding)
    if params.config.positions == "learned":
        X = add_positions(X, params.position_table, positions)
    return X


def _mask(config: ModelConfig, query_positions, key_positions) -> np.ndarray | None:
    """The mask from positions; None when it lets everything through (a decode step)."""
    mask = attention_mask(query_positions, key_positions, config.window, config.sink_tokens)
    return None if mask.all() else mask


def run_blocks(params: Params, X: np.ndarray, positions: np.ndarray, mask=None, cache=None,
               record_attention: list | None = None) -> np.ndarray:
    """Every block in turn (mlp_residual_stream): X (T, d) at positions (T,) -> (T, d), each
    layer's K and V appended to the cache when one is given. The block is the config's
    (decoder_block, or latent_decoder_block for latent attention), the rotation its position
    scheme's (rotary_positions); mask (T, S) or None lets every query see every key."""
    config = params.config
    block = latent_decoder_block if config.latent_dim is not None else decoder_block
    rotary = rotary_positions(config, positions)
    for index, layer in enumerate(params.layers):
        X = block(X, layer, config.n_heads, mask=mask, cache=cache, layer_index=index,
                  record_attention=record_attention, rotary=rotary,
                  norm_epsilon=config.norm_epsilon)
    return X


def final_logits(params: Params, X: np.ndarray, last_only: bool = False) -> np.ndarray:
    """The final norm and the unembedding (logits_next_token): X (T, d) -> logits (T, V), or
    (1, V) for the last row alone."""
    X = X[-1:] if last_only else X
    X = normalize(X, params.ln_f_gain, params.ln_f_bias, params.config.norm_epsilon)
    return unembed(X, params.embedding)


def _run_chunk(params: Params, ids, cache, last_only, record_attention):
    """A chunk of T checked tokens after len(cache) cached positions: positions P .. P+T-1,
    the mask from the positions the cache holds, every layer's K and V appended. The blocks
    trust the door that checked the chunk (kvlib.checks.trusted)."""
    past = len(cache)
    positions = np.arange(past, past + len(ids))
    mask = _mask(params.config, positions, cache.key_positions(len(ids)))
    with trusted(), all_or_nothing(cache):
        X = run_blocks(params, embed_tokens(params, ids, positions), positions, mask, cache,
                       record_attention)
        return final_logits(params, X, last_only)


def forward(params: Params, ids, *, last_only: bool = False, record_attention: list | None = None):
    """Full recomputation, no cache (big_picture): ids (T,) -> logits (T, V).

    With last_only=True only the last row is unembedded: (1, V), all that choosing the next
    token needs. A list given as record_attention receives each layer's weights (h, T, T).
    """
    context = as_params(params).config.context_length
    ids = as_token_ids(ids, params.config.vocab_size, limit=context)
    last_only, record_attention = as_flag("last_only", last_only), as_list_or_none(record_attention)
    positions = np.arange(len(ids))
    with trusted():
        X = run_blocks(params, embed_tokens(params, ids, positions), positions,
                       _mask(params.config, positions, positions), None, record_attention)
        return final_logits(params, X, last_only)


def prefill(params: Params, ids, cache: BaseKVCache | None = None, *, last_only: bool = False,
            record_attention: list | None = None):
    """The prompt in one parallel pass, filling the cache (prefill): ids (T,) ->
    (logits (T, V), cache holding T more positions).

    Given a cache that already holds P positions, it continues it (kv_cached_decode: a second
    chunk of a long prompt, or the next turn of a chat): the T new queries see all P cached
    positions and, among the new ones, only the earlier ones: the causal mask is (T, P + T),
    aligned to the end. Prefilling in chunks gives the same logits as prefilling at once.
    With positions (real_model and positions_and_rope) the chunk's tokens sit at P .. P+T-1. Without
    a cache, one of the kind the model needs is made (kvlib.make_cache). If the call fails, the
    cache is left as it was.
    """
    ids = as_token_ids(ids, as_params(params).config.vocab_size)
    last_only, record_attention = as_flag("last_only", last_only), as_list_or_none(record_attention)
    cache = make_cache(params.config) if cache is None else \
        as_cache(cache, params.config, adding=len(ids))
    return _run_chunk(params, ids, cache, last_only, record_attention), cache


def decode_step(params: Params, token_id, cache: BaseKVCache, *,
                record_attention: list | None = None):
    """One new token against the cache (kv_cached_decode): token id -> logits (1, V).

    Only the new token's q, k, v (1, d) are computed; its k and v are appended, so every
    layer's cache grows by one row. No mask: every cached position is in the past (a
    sliding window, the sliding_windows_and_sinks lesson, is the exception). The token sits at
    position len(cache). If the call fails, the cache is left as it was.
    """
    ids = as_token_ids(token_id, as_params(params).config.vocab_size, what="token")
    if len(ids) != 1:
        raise ValueError(f"decode_step takes exactly one token id, got {len(ids)}; use prefill "
                         "for several")
    if len(as_cache(cache, params.config, adding=1)) == 0:
        raise ValueError("decode_step needs a cache that already holds the prompt: run prefill "
                         "first")
    return _run_chunk(params, ids, cache, True, as_list_or_none(record_attention))


def _probabilities(row: np.ndarray, temperature: float, top_k: int | None, dtype):
    """next_token_probabilities on a checked row (V,) of float64 logits."""
    if temperature == 0:
        return (np.arange(len(row)) == np.argmax(row)).astype(dtype)
    with np.errstate(over="ignore"):
        scaled = row / temperature
    # a tiny temperature overflows the largest logits to inf; the limit is greedy
    if not np.isfinite(scaled.max()):
        return (np.arange(len(row)) == np.argmax(row)).astype(dtype)
    if top_k is not None:
        kth_largest = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= kth_largest, scaled, -np.inf)
    # near the largest float, scaled - max can overflow to -inf: its exp, 0, is the limit
    with np.errstate(over="ignore"):
        return softmax(scaled).astype(dtype)


def next_token_probabilities(logits_row, temperature: float = 1.0, top_k: int | None = None):
    """Sampling distribution over the vocabulary (logits_next_token): logits (V,) -> probabilities
    (V,).

    Logits are divided by the temperature (below 1 sharpens, above 1 flattens); with top_k,
    all but the k largest logits get probability 0. Temperature 0 is greedy decoding: all
    the probability on the largest logit, the token choose_next_token picks.
    """
    row, temperature, top_k = as_sampling(logits_row, temperature, top_k)
    dtype = np.asarray(logits_row).dtype
    return _probabilities(row, temperature, top_k, dtype if dtype.kind == "f" else np.float64)


def next_token_losses(logits, ids) -> np.ndarray:
    """The loss of each next-token prediction, in nats (what_the_heads_read): logits (T, V) of a
    sequence of ids (T,) -> (T - 1,), -log p(ids[t + 1]) under row t (the last row predicts
    nothing). Its mean is the loss a model is trained and measured on."""
    logits = as_matrix("logits", logits).astype(np.float64, copy=False)
    ids = as_token_ids(ids, logits.shape[1], what="token ids")
    if len(logits) != len(ids) or len(ids) < 2:
        raise ValueError(f"need logits (T, V) for T >= 2 ids, got {logits.shape} for "
                         f"{len(ids)} ids")
    shifted = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probabilities[np.arange(len(ids) - 1), ids[1:]]


def choose_next_token(logits_row, temperature: float = 0.0, top_k: int | None = None,
                      rng: np.random.Generator | None = None) -> int:
    """Greedy (temperature 0: the argmax) or seeded sampling: logits (V,) -> one token id."""
    row, temperature, top_k = as_sampling(logits_row, temperature, top_k)
    rng = rng if rng is None else as_instance("rng", rng, np.random.Generator,
                                              "np.random.default_rng(seed)")
    if temperature == 0:
        return int(np.argmax(row))
    probabilities = _probabilities(row, temperature, top_k, np.float64)
    rng = np.random.default_rng() if rng is None else rng
    return int(rng.choice(len(probabilities), p=probabilities))


def generate(params: Params, ids, max_new_tokens: int, use_cache: bool = True,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None):
    """Generate new tokens (kv_cached_decode): prompt ids (P,) -> list of max_new_tokens new ids.

    With the cache: one prefill, then one decode_step per new token. Without: a full
    forward over the whole, growing sequence for every token (unembedding only its last row).
    Both give the same ids. Greedy at temperature 0, otherwise sampled with a generator
    seeded by seed (temperature and top_k are checked where they are used, by
    choose_next_token: a failing call leaves nothing behind, its cache is its own).
    """
    max_new_tokens = as_count("max_new_tokens", max_new_tokens, 1)
    use_cache = as_flag("use_cache", use_cache)
    rng = np.random.default_rng(seed if seed is None else as_whole_number("seed", seed))
    ids = as_token_ids(ids, as_params(params).config.vocab_size)
    if len(ids) + max_new_tokens - 1 > params.config.context_length:
        raise ValueError(f"a {len(ids)}-token prompt plus {max_new_tokens} new tokens needs "
                         f"{len(ids) + max_new_tokens - 1} positions; the context length is "
                         f"{params.config.context_length}")
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


# kvlib.serving.speculative still imports the old private name; its own worker moves it to
# kvlib.checks.as_logits_row
_check_logits_row = as_logits_row
