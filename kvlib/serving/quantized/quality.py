"""What a quantized cache does to a model's predictions (quantized_cache): the logits as
generation sees them (decoded_logits), greedy tokens on any cache, the next-token loss, greedy
agreement, and measure_quality over some sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...cache import BaseKVCache
from ...checks import as_array, as_whole_number
from ...inference import check_ids, decode_step, next_token_losses, prefill
from ...params import Params
from .cache import QuantizedKVCache
from .groupings import PerChannel, PerToken, _check_grouping
from .sizes import bytes_per_token


def decoded_logits(params: Params, ids, cache: BaseKVCache, prompt_length: int = 1
                   ) -> np.ndarray:
    """Logits of every position as generation sees them (quantized_cache): the first
    prompt_length ids prefilled, then each later id fed by kvlib.decode_step (teacher
    forcing), into the given empty cache: ids (T,) -> logits (T, V). Row t predicts id t+1."""
    ids = check_ids(ids, params)
    prompt_length = as_whole_number("prompt_length", prompt_length, 1)
    _check_empty_cache("decoded_logits", cache)
    if prompt_length > len(ids):
        raise ValueError(f"prompt_length {prompt_length} is longer than the {len(ids)} ids")
    logits, _ = prefill(params, ids[:prompt_length], cache)
    rows = [logits] + [decode_step(params, token, cache) for token in ids[prompt_length:]]
    return np.concatenate(rows)


def greedy_tokens(params: Params, prompt, n_new: int, cache: BaseKVCache) -> list[int]:
    """Greedy decoding of n_new tokens after prompt, on the given empty cache (quantized_cache):
    kvlib.generate with a cache of one's choosing. Returns the new ids."""
    prompt = check_ids(prompt, params)
    n_new = as_whole_number("n_new", n_new, 1)
    _check_empty_cache("greedy_tokens", cache)
    room = params.config.context_length if cache.capacity is None else cache.capacity
    if len(prompt) + n_new - 1 > room:
        raise ValueError(f"a {len(prompt)}-token prompt and {n_new} new tokens need "
                         f"{len(prompt) + n_new - 1} positions; the cache holds {room}")
    logits, _ = prefill(params, prompt, cache, last_only=True)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n_new:
        new.append(int(np.argmax(decode_step(params, new[-1], cache)[-1])))
    return new


def _check_empty_cache(what: str, cache) -> None:
    if not isinstance(cache, BaseKVCache):
        raise TypeError(f"{what} needs a kvlib cache, got {type(cache).__name__}")
    if len(cache) != 0:
        raise ValueError(f"{what} needs an empty cache, this one holds {len(cache)} "
                         "positions: give a fresh one")


def next_token_loss(logits: np.ndarray, ids) -> float:
    """Mean cross-entropy, in nats, of logits (T, V) predicting ids[1:] (row t predicts id
    t+1; the last row predicts nothing): the mean of kvlib.next_token_losses."""
    return float(next_token_losses(logits, ids).mean())


def greedy_agreement(logits, reference_logits) -> float:
    """Fraction of positions where both logits (T, V) pick the same greedy token."""
    logits = as_array("logits", logits)
    reference_logits = as_array("reference_logits", reference_logits)
    if logits.shape != reference_logits.shape or logits.ndim != 2:
        raise ValueError(f"need two logits arrays of one shape (T, V), got {logits.shape} "
                         f"and {reference_logits.shape}")
    return float(np.mean(logits.argmax(axis=1) == reference_logits.argmax(axis=1)))


@dataclass(frozen=True)
class Quality:
    """What a quantized cache does to a model's predictions over some sequences (notebook
    22): the error it adds to the logits (mean and largest |difference|), the mean next-token
    loss (nats) with it and with the plain cache, and the fraction of positions where the
    greedy pick stays the same. bytes_per_token is the cache's, once its groups are full."""

    keys: PerToken | PerChannel
    values: PerToken | PerChannel
    bytes_per_token: float
    logit_error: float
    max_logit_error: float
    loss: float
    plain_loss: float
    agreement: float

    @property
    def name(self) -> str:
        return f"K {self.keys.name}, V {self.values.name}"

    @property
    def added_loss(self) -> float:
        return self.loss - self.plain_loss


def plain_logits(params: Params, sequences) -> list[np.ndarray]:
    """Each sequence's logits with a plain cache: one prefill each (T, V)."""
    return [prefill(params, ids)[0] for ids in _sequences(sequences)]


def _sequences(sequences) -> list:
    """A list of sequences, or a 2-D array of them (one row each)."""
    if isinstance(sequences, np.ndarray) and sequences.ndim == 2:
        return list(sequences)
    if not isinstance(sequences, (list, tuple)):
        raise TypeError(f"sequences must be a list of token id sequences, got "
                        f"{type(sequences).__name__}")
    return list(sequences)


def measure_quality(params: Params, sequences, keys, values, reference=None) -> Quality:
    """Prefill each sequence (T,) into a QuantizedKVCache and compare its logits with the
    plain cache's (reference: plain_logits(params, sequences), given to save the work when
    several settings are measured). Every position of every sequence counts once."""
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    sequences = [check_ids(ids, params, "sequence") for ids in _sequences(sequences)]
    if not sequences:
        raise ValueError("measure_quality needs at least one sequence")
    reference = plain_logits(params, sequences) if reference is None else reference
    if len(reference) != len(sequences):
        raise ValueError(f"reference has {len(reference)} logits arrays for "
                         f"{len(sequences)} sequences")
    config = params.config
    errors, largest, losses, plain_losses, agreements, weights = [], [], [], [], [], []
    for ids, plain in zip(sequences, reference):
        logits, _ = prefill(params, ids, QuantizedKVCache(config, keys, values))
        difference = np.abs(logits.astype(np.float64) - plain)
        errors.append(difference.mean()), largest.append(difference.max())
        losses.append(next_token_loss(logits, ids))
        plain_losses.append(next_token_loss(plain, ids))
        agreements.append(greedy_agreement(logits, plain))
        weights.append(len(ids))
    weights = np.asarray(weights, dtype=np.float64)
    predicted = weights - 1          # the losses are over T - 1 predictions a sequence
    return Quality(keys, values, bytes_per_token(config.n_layers, config.kv_width, keys, values),
                   float(np.average(errors, weights=weights)), float(max(largest)),
                   float(np.average(losses, weights=predicted)),
                   float(np.average(plain_losses, weights=predicted)),
                   float(np.average(agreements, weights=weights)))
