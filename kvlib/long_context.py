"""What a cache that forgets costs, measured two ways (keeping_what_attention_reads): the loss a
token of a long text fed through the cache one token at a time, and how much of a passage the
model copies when it sees the passage's start again.

Both run through any kvlib cache (KVCache for the ceiling, an EvictingCache with a budget), so
the same code measures every policy; tools/measure_eviction.py runs them over budgets.
"""

from __future__ import annotations

import numpy as np

from .checks import as_cache, as_params, as_token_ids
from .inference import decode_step, prefill


def log_loss(logits_row: np.ndarray, token: int) -> float:
    """-log p(token) under one row of logits (V,), in float64 (nats)."""
    row = logits_row.astype(np.float64) - logits_row.max()
    return float(np.log(np.exp(row).sum()) - row[token])


def streaming_losses(params, ids, cache) -> np.ndarray:
    """The text fed one token at a time through an empty cache, each token predicting the next
    (keeping_what_attention_reads): ids (T,) -> losses (T - 1,), loss t for ids[t + 1] given
    what the cache kept of ids[: t + 1]. One token a pass is what an evicting cache is made
    for: it chooses after every step."""
    config = as_params(params).config
    ids = as_token_ids(ids, config.vocab_size, "ids")
    if len(as_cache(cache, config, adding=len(ids))):
        raise ValueError(f"streaming_losses needs an empty cache, got one holding {len(cache)} "
                         "positions (cache.reset() empties it)")
    logits, cache = prefill(params, ids[:1], cache)
    losses = []
    for position in range(1, len(ids)):
        losses.append(log_loss(logits[-1], ids[position]))
        if position < len(ids) - 1:
            logits = decode_step(params, ids[position], cache)
    return np.array(losses)


def copied_tokens(params, prompt_chunks, answer, cache) -> np.ndarray:
    """The prompt fed chunk by chunk (each chunk one pass: what an evicting cache sees when it
    compresses), then the answer teacher-forced one token at a time; per answer token, whether
    the greedy choice was it (keeping_what_attention_reads): -> bool (len(answer),)."""
    config = as_params(params).config
    chunks = [as_token_ids(chunk, config.vocab_size, "each prompt chunk") for chunk in prompt_chunks]
    answer = as_token_ids(answer, config.vocab_size, "answer")
    total = sum(map(len, chunks)) + len(answer)
    if len(as_cache(cache, config, adding=total)):
        raise ValueError("copied_tokens needs an empty cache (cache.reset() empties it)")
    for chunk in chunks:
        logits, cache = prefill(params, chunk, cache, last_only=True)
    hits = []
    for index, token in enumerate(answer):
        hits.append(int(np.argmax(logits[-1])) == token)
        if index < len(answer) - 1:
            logits = decode_step(params, token, cache)
    return np.array(hits)
