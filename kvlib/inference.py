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

from contextlib import contextmanager
from numbers import Integral, Real

import numpy as np

from .cache import BaseKVCache, make_cache
from .checks import contains_bool, numbers, whole_numbers
from .config import ModelConfig
from .latent import latent_decoder_block
from .model import attention_mask, decoder_block, embed, normalize, softmax, unembed
from .params import Params
from .positions import add_positions, rotary_positions


def check_ids(ids, params: Params, what: str = "prompt") -> np.ndarray:
    """Validate token ids: a non-empty sequence of integers in [0, vocab_size) -> int array (T,)."""
    if not isinstance(params, Params):
        raise TypeError("params must be kvlib Params (from init_params), "
                        f"got {type(params).__name__}")
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"the {what} must be token ids (integers), got the text {ids!r}: "
                        "encode it with a tokenizer first")
    if contains_bool(ids):
        raise TypeError(f"token ids must be integers, not True or False: got {ids!r}")
    try:
        array = np.asarray(ids)
    except ValueError:
        raise ValueError(f"the {what} must be a flat sequence of token ids, got the nested "
                         f"sequence {ids!r}") from None
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1:
        raise ValueError(f"the {what} must be a flat sequence of token ids, "
                         f"got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"the {what} is empty: give at least one token id "
                         "(for example the BOS id 0)")
    if not np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        raise TypeError(f"token ids must be integers, got {array.tolist()!r} ({array.dtype})")
    vocab_size = params.config.vocab_size
    outside = sorted(set(array[(array < 0) | (array >= vocab_size)].tolist()))
    if outside:
        raise ValueError(f"token id(s) {outside} are outside the vocabulary: "
                         f"ids must be between 0 and {vocab_size - 1}")
    return array.astype(np.intp, copy=False)


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_record(record_attention) -> None:
    if record_attention is not None and not isinstance(record_attention, list):
        raise TypeError("record_attention must be a list (the weights of each layer are "
                        f"appended to it) or None, got {type(record_attention).__name__}")


def _check_cache(cache, params: Params) -> None:
    if not isinstance(cache, BaseKVCache):
        raise TypeError(f"cache must be a kvlib cache (kvlib.KVCache or another kind), "
                        f"got {type(cache).__name__}")
    if cache.config != params.config:
        raise ValueError(f"this cache was made for another model: {cache.config} "
                         f"is not the params' config {params.config}")
    cache.check_consistent()


@contextmanager
def _all_or_nothing(cache: BaseKVCache):
    """Leave the cache as it was if the pass fails half-way, between two layers' appends
    (an error, or a KeyboardInterrupt when a student stops the kernel)."""
    saved = cache.checkpoint()
    try:
        yield
    except BaseException:
        cache.restore(saved)
        raise


def _embed(params: Params, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    X = embed(ids, params.embedding)
    if params.config.positions == "learned":
        X = add_positions(X, params.position_table, positions)
    return X


def _mask(config: ModelConfig, query_positions, key_positions) -> np.ndarray | None:
    """The mask from positions; None when it lets everything through (a decode step)."""
    mask = attention_mask(query_positions, key_positions, config.window, config.sink_tokens)
    return None if mask.all() else mask


def _run_blocks(params: Params, X, positions, mask, cache, record_attention):
    config = params.config
    block = latent_decoder_block if config.latent_dim is not None else decoder_block
    rotary = rotary_positions(config, positions)
    for index, layer in enumerate(params.layers):
        X = block(X, layer, config.n_heads, mask=mask, cache=cache, layer_index=index,
                  record_attention=record_attention, rotary=rotary,
                  norm_epsilon=config.norm_epsilon)
    return X


def _logits(params: Params, X, last_only: bool):
    X = X[-1:] if last_only else X
    X = normalize(X, params.ln_f_gain, params.ln_f_bias, params.config.norm_epsilon)
    return unembed(X, params.embedding)


def _run_chunk(params: Params, ids, cache, last_only, record_attention):
    """A chunk of T tokens after len(cache) cached positions: positions P .. P+T-1, the mask
    from the positions the cache holds, every layer's K and V appended."""
    past = len(cache)
    positions = np.arange(past, past + len(ids))
    X = _embed(params, ids, positions)        # before any append: a bad position changes nothing
    mask = _mask(params.config, positions, cache.key_positions(len(ids)))
    with _all_or_nothing(cache):
        X = _run_blocks(params, X, positions, mask, cache, record_attention)
    return _logits(params, X, last_only)


def forward(params: Params, ids, *, last_only: bool = False, record_attention: list | None = None):
    """Full recomputation, no cache (big_picture): ids (T,) -> logits (T, V).

    With last_only=True only the last row is unembedded: (1, V), all that choosing the next
    token needs. A list given as record_attention receives each layer's weights (h, T, T).
    """
    ids = check_ids(ids, params)
    last_only = _check_flag("last_only", last_only)
    _check_record(record_attention)
    if len(ids) > params.config.context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context length is "
                         f"{params.config.context_length}")
    positions = np.arange(len(ids))
    X = _embed(params, ids, positions)
    X = _run_blocks(params, X, positions, _mask(params.config, positions, positions), None,
                    record_attention)
    return _logits(params, X, last_only)


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
    ids = check_ids(ids, params)
    last_only = _check_flag("last_only", last_only)
    _check_record(record_attention)
    cache = make_cache(params.config) if cache is None else cache
    _check_cache(cache, params)
    past = len(cache)
    if cache.capacity is not None and past + len(ids) > cache.capacity:
        raise ValueError(f"the cache is too full for this prompt: it holds {past} positions "
                         f"and the prompt adds {len(ids)}, more than its capacity of "
                         f"{cache.capacity} (the context length, unless given)")
    return _run_chunk(params, ids, cache, last_only, record_attention), cache


def decode_step(params: Params, token_id, cache: BaseKVCache, *,
                record_attention: list | None = None):
    """One new token against the cache (kv_cached_decode): token id -> logits (1, V).

    Only the new token's q, k, v (1, d) are computed; its k and v are appended, so every
    layer's cache grows by one row. No mask: every cached position is in the past (a
    sliding window, the sliding_windows_and_sinks lesson, is the exception). The token sits at
    position len(cache). If the call fails, the cache is left as it was.
    """
    ids = check_ids(token_id, params, what="token")
    if len(ids) != 1:
        raise ValueError(f"decode_step takes exactly one token id, got {len(ids)}; "
                         "use prefill for several")
    _check_record(record_attention)
    _check_cache(cache, params)
    if len(cache) == 0:
        raise ValueError("decode_step needs a cache that already holds the prompt: "
                         "run prefill first")
    if cache.capacity is not None and len(cache) >= cache.capacity:
        raise ValueError(f"the cache is full ({len(cache)} of {cache.capacity} positions): "
                         "the context length is reached")
    return _run_chunk(params, ids, cache, True, record_attention)


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise TypeError(f"temperature must be a number (0 for greedy), got {temperature!r}")
    try:
        temperature = float(temperature)
    except OverflowError:
        raise ValueError(f"temperature {temperature} is too large for a float") from None
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or a positive number, got {temperature}")
    return temperature


def _check_top_k(top_k, vocab_size: int) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, Integral):
        raise TypeError(f"top_k must be a whole number or None, got {top_k!r}")
    if not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be between 1 and {vocab_size}, got {top_k}")
    return int(top_k)


def _check_logits_row(logits_row) -> np.ndarray:
    try:
        row = numbers("the logits", logits_row).astype(np.float64, copy=False)
    except (TypeError, ValueError) as error:
        raise type(error)(f"expected one row of logits: {error}") from None
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected one row of logits (V,), got shape {row.shape}: for a "
                         "(T, V) array take its last row, logits[-1]")
    if np.isnan(row).any() or not np.isfinite(row.max()) or np.isposinf(row).any():
        raise ValueError("the logits must be finite numbers (NaN, +inf or all -inf give no "
                         "distribution to choose from)")
    return row


def next_token_probabilities(logits_row, temperature: float = 1.0, top_k: int | None = None):
    """Sampling distribution over the vocabulary (logits_next_token): logits (V,) -> probabilities
    (V,).

    Logits are divided by the temperature (below 1 sharpens, above 1 flattens); with top_k,
    all but the k largest logits get probability 0. Temperature 0 is greedy decoding: all
    the probability on the largest logit, the token choose_next_token picks.
    """
    row = _check_logits_row(logits_row)
    dtype = np.asarray(logits_row).dtype
    dtype = dtype if np.issubdtype(dtype, np.floating) else np.dtype(np.float64)
    temperature = _check_temperature(temperature)
    top_k = _check_top_k(top_k, len(row))
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


def next_token_losses(logits, ids) -> np.ndarray:
    """The loss of each next-token prediction, in nats (what_the_heads_read): logits (T, V) of a
    sequence of ids (T,) -> (T - 1,), -log p(ids[t + 1]) under row t (the last row predicts
    nothing). Its mean is the loss a model is trained and measured on."""
    logits = numbers("logits", logits).astype(np.float64, copy=False)
    ids = whole_numbers("ids", ids)
    if logits.ndim != 2 or len(logits) != len(ids) or len(ids) < 2:
        raise ValueError(f"need logits (T, V) for T >= 2 ids, got {logits.shape} for ids of "
                         f"shape {ids.shape}")
    if ids.max() >= logits.shape[1]:
        raise ValueError(f"ids must be between 0 and {logits.shape[1] - 1} (the logits' "
                         f"columns), got {ids.max()}")
    shifted = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probabilities[np.arange(len(ids) - 1), ids[1:]]


def choose_next_token(logits_row, temperature: float = 0.0, top_k: int | None = None,
                      rng: np.random.Generator | None = None) -> int:
    """Greedy (temperature 0: the argmax) or seeded sampling: logits (V,) -> one token id."""
    row = _check_logits_row(logits_row)
    temperature = _check_temperature(temperature)
    _check_top_k(top_k, len(row))
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    if temperature == 0:
        return int(np.argmax(row))
    probabilities = next_token_probabilities(row, temperature, top_k)
    rng = np.random.default_rng() if rng is None else rng
    return int(rng.choice(len(probabilities), p=probabilities))


def generate(params: Params, ids, max_new_tokens: int, use_cache: bool = True,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None):
    """Generate new tokens (kv_cached_decode): prompt ids (P,) -> list of max_new_tokens new ids.

    With the cache: one prefill, then one decode_step per new token. Without: a full
    forward over the whole, growing sequence for every token (unembedding only its last row).
    Both give the same ids. Greedy at temperature 0, otherwise sampled with a generator
    seeded by seed.
    """
    ids = check_ids(ids, params)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive whole number, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)          # numpy's small ints would overflow the sum
    use_cache = _check_flag("use_cache", use_cache)
    temperature = _check_temperature(temperature)
    _check_top_k(top_k, params.config.vocab_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)
                             or seed < 0):
        raise TypeError(f"seed must be a whole number >= 0 or None, got {seed!r}")
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
