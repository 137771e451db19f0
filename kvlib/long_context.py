"""What a cache that forgets costs, measured two ways (keeping_what_attention_reads): the loss a
token of a long text fed through the cache one token at a time, and how much of a passage the
model copies when it sees the passage's start again.

Both run through any kvlib cache (KVCache for the ceiling, an EvictingCache with a budget), or
Gemma 3's (kvlib.gemma3.Gemma3Cache, kvlib.gemma3.evicting_cache), so the same code measures
every policy; tools/measure_eviction.py runs them over budgets.
"""

from __future__ import annotations

import numpy as np

from . import gemma3
from .checkpoints.gemma3 import Gemma3Params
from .checks import as_cache, as_params, as_token_ids, as_whole_number
from .inference import decode_step, prefill


def _model(params, cache, adding: int):
    """(prefill, decode_step, vocab_size) of the params' model, its empty cache checked."""
    if isinstance(params, Gemma3Params):
        if not isinstance(cache, gemma3.Gemma3Cache):
            raise TypeError(f"Gemma 3 needs a kvlib.gemma3.Gemma3Cache (or evicting_cache), "
                            f"got {type(cache).__name__}")
        model = gemma3.prefill, gemma3.decode_step, params.config.vocab_size
    else:
        config = as_params(params).config
        as_cache(cache, config, adding=adding)
        model = prefill, decode_step, config.vocab_size
    if len(cache):
        raise ValueError(f"this needs an empty cache, got one holding {len(cache)} positions "
                         "(a fresh one, or cache.reset())")
    return model


def log_loss(logits_row: np.ndarray, token: int) -> float:
    """-log p(token) under one row of logits (V,), in float64 (nats)."""
    row = logits_row.astype(np.float64) - logits_row.max()
    return float(np.log(np.exp(row).sum()) - row[token])


def streaming_losses(params, ids, cache, prompt_length: int = 1) -> np.ndarray:
    """The text fed through an empty cache, each token predicting the next
    (keeping_what_attention_reads): ids (T,) -> losses (T - 1,), loss t for ids[t + 1] given
    what the cache kept of ids[: t + 1]. The first prompt_length ids go in one pass (a prompt:
    what SnapKV compresses, once), the rest one token at a time (an evicting cache chooses
    after every step)."""
    run_prefill, run_decode_step, vocab_size = _model(params, cache, np.size(ids))
    ids = as_token_ids(ids, vocab_size, "ids")
    prompt_length = as_whole_number("prompt_length", prompt_length, 1, len(ids))
    logits, cache = run_prefill(params, ids[:prompt_length], cache)
    losses = [log_loss(row, token) for row, token in zip(logits[:-1], ids[1:prompt_length])]
    for position in range(prompt_length, len(ids)):
        losses.append(log_loss(logits[-1], ids[position]))
        if position < len(ids) - 1:
            logits = run_decode_step(params, ids[position], cache)
    return np.array(losses)


def copied_tokens(params, prompt_chunks, answer, cache) -> np.ndarray:
    """The prompt fed chunk by chunk (each chunk one pass: what an evicting cache sees when it
    compresses), then the answer teacher-forced one token at a time; per answer token, whether
    the greedy choice was it (keeping_what_attention_reads): -> bool (len(answer),)."""
    if not isinstance(prompt_chunks, (list, tuple)) or not prompt_chunks:
        raise TypeError("prompt_chunks must be a non-empty list of chunks of token ids, such "
                        f"as [[1, 2, 3], [4]], got {type(prompt_chunks).__name__} "
                        f"{prompt_chunks!r:.40}")
    total = sum(map(np.size, prompt_chunks)) + np.size(answer)
    run_prefill, run_decode_step, vocab_size = _model(params, cache, total)
    chunks = [as_token_ids(chunk, vocab_size, "each prompt chunk") for chunk in prompt_chunks]
    answer = as_token_ids(answer, vocab_size, "answer")
    for chunk in chunks:
        logits, cache = run_prefill(params, chunk, cache, last_only=True)
    hits = []
    for index, token in enumerate(answer):
        hits.append(int(np.argmax(logits[-1])) == token)
        if index < len(answer) - 1:
            logits = run_decode_step(params, token, cache)
    return np.array(hits)
