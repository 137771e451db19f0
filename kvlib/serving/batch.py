"""Several sequences decoded in one step (batched_decoding): a batch.

Decoding B sequences one after the other multiplies every weight matrix by one row, B times:
B matrix-vector products, each reading the whole matrix from memory. Decoding them together
stacks their B new rows into X (B, d) and multiplies once: one matrix-matrix product per
weight, which reads each weight once for the whole batch. The projections, the output
projection, the MLP and the unembedding do not care which sequence a row came from, so they
run on the batch as it is.

Attention does care. Each sequence's new query must meet its own cache, and the caches have
different lengths (a ragged batch). Two ways, both here:

- attend_per_sequence: a loop over the batch for the attention alone, each query against its
  own cache of S_b positions, as kvlib.decode_step does for one sequence;
- attend_padded: every cache copied into one array of the longest length S_max, padded on the
  left, with a mask that hides the padded positions (padding_mask), so that the attention of
  the whole batch is one product. This is what a padded, "static" cache does (transformers'
  batched generate); the padded positions cost work and memory for nothing.

batched_decode_step runs the whole step with either and equals decoding each sequence alone.
It reuses kvlib.model's step functions; only the loop over the batch is new. Below it, the
roofline of a batched step: the weights are read once per step, each sequence's cache is read
for itself (batched_step_bytes), so batching raises the FLOPs per byte of the weights' part,
and not of the cache's.

Shapes: B sequences, d = d_model, h heads of dh columns, kv K/V heads (kv_width = kv x dh),
S_b positions in sequence b's cache after the new token, S_max the longest.
"""

from __future__ import annotations

import math

import numpy as np

from ..cache import BaseKVCache
from ..checks import as_array, as_count, as_instance, as_whole_number, as_whole_numbers
from ..config import ModelConfig
from ..inference import check_ids
from ..model import (
    LAYER,
    attention_mask,
    attention_scores,
    attention_weights,
    block_with_attention,
    embed,
    merge_heads,
    normalize,
    softmax,
    split_heads,
    unembed,
    weighted_sum,
)
from ..params import LayerParams, Params
from ..positions import add_positions, rotary_positions

# ------------------------------------------------------------------------------ checks

LARGEST_ID = 2**62
"""Larger than any vocabulary: token ids above it do not fit numpy's int64 arithmetic."""


def _config_differences(a: ModelConfig, b: ModelConfig) -> str:
    """The fields in which two configs differ, as 'd_model 8 (not 4), n_layers 2 (not 3)'."""
    names = [name for name in a.__dataclass_fields__ if getattr(a, name) != getattr(b, name)]
    return ", ".join(f"{name} {getattr(a, name)!r} (not {getattr(b, name)!r})"
                     for name in names)


def check_batch(params: Params, token_ids, caches) -> np.ndarray:
    """Validate a batch for one decode step (batched_decoding): B token ids, B caches of the model
    of params, each holding its prompt, none full, no cache twice. Returns the ids (B,).

    A cache knows the config of the model that filled it, not the weights: a batch whose
    caches come from models of different shapes or architectures is refused here; two models
    of one config with different weights cannot be told apart by their caches.
    """
    if not isinstance(params, Params) or not isinstance(caches, (list, tuple)) or not caches \
            or not all(isinstance(cache, BaseKVCache) for cache in caches):
        raise TypeError("params must be kvlib Params and caches a list of kvlib caches, one per "
                        "sequence: not one cache (use kvlib.decode_step, or put it in a list), "
                        "and not none (the batch is empty)")
    if params.config.latent_dim is not None:
        raise ValueError("batched decoding here runs models that cache K and V; latent "
                         "attention (notebook 16): decode its sequences with kvlib.decode_step")
    for index, cache in enumerate(caches):
        if cache.config != params.config:
            raise ValueError(f"sequence {index}'s cache comes from another model: its config "
                             f"differs from the params' in "
                             f"{_config_differences(cache.config, params.config)}. A batch "
                             "runs one model's weights over every sequence, so every cache in "
                             "it must have been filled by that model")
        cache.check_consistent()
        if not 0 < len(cache) < (cache.capacity or math.inf) or \
                any(other is cache for other in caches[:index]):
            raise ValueError(f"sequence {index}'s cache is empty or full, or another sequence's "
                             "cache object: each sequence needs its own, holding its prompt "
                             "(kvlib.prefill) and room for one more position")
    ids = check_ids(token_ids, params, what="batch's token ids")
    if len(ids) != len(caches):
        raise ValueError(f"{len(ids)} token ids for {len(caches)} caches: give one new token "
                         "per sequence")
    return ids


# ------------------------------------------------------------------------------ the step


def batch_positions(caches) -> np.ndarray:
    """The position of each sequence's new token (batched_decoding): len(cache) each, (B,)."""
    return np.array([len(cache) for cache in caches], dtype=np.intp)


def _check_caches(caches) -> list:
    """A non-empty list of kvlib caches, one per sequence."""
    if not isinstance(caches, (list, tuple)) or not caches or \
            not all(isinstance(cache, BaseKVCache) for cache in caches):
        raise TypeError(f"caches must be a non-empty list of kvlib caches, one per sequence, "
                        f"got {caches!r:.80}")
    return list(caches)


def _check_config(config) -> ModelConfig:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a kvlib ModelConfig, got {type(config).__name__}")
    return config


def embed_batch(params: Params, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The new tokens' rows (batched_decoding): ids (B,) at positions (B,) -> X (B, d).

    A lookup per row, as for a prompt; with learned positions (GPT-2) each row gets its own
    sequence's position, not its row number in the batch.
    """
    X = embed(token_ids, params.embedding)
    if params.config.positions == "learned":
        X = add_positions(X, params.position_table, positions)
    return X


def sequence_masks(config: ModelConfig, caches, positions: np.ndarray) -> list:
    """Which cached positions each new query may see (batched_decoding): for sequence b a bool
    (1, S_b), or None when it sees them all (no window). Read before any layer appends."""
    masks = []
    for cache, position in zip(caches, positions):
        mask = attention_mask([position], cache.key_positions(1), config.window,
                              config.sink_tokens)
        masks.append(None if mask.all() else mask)
    return masks


def attend_per_sequence(queries: np.ndarray, keys: list, values: list, masks: list,
                        config: ModelConfig) -> np.ndarray:
    """Each sequence's query over its own cache, one sequence at a time (batched_decoding).

    queries (B, d); keys[b] and values[b] (S_b, kv_width); masks[b] (1, S_b) or None
    -> the merged heads (B, d). Row b is kvlib.decode_step's attention for sequence b alone.
    """
    _check_attend_arguments(queries, keys, values, masks, config)
    rows = []
    for b, (K, V, mask) in enumerate(zip(keys, values, masks)):
        q = split_heads(queries[b:b + 1], config.n_heads)              # (h, 1, dh)
        weights = attention_weights(q, split_heads(K, config.kv_heads), mask)
        rows.append(merge_heads(weighted_sum(weights, split_heads(V, config.kv_heads))))
    return np.vstack(rows)


def _check_attend_arguments(queries, keys, values, masks, config) -> None:
    """queries (B, d); B keys and B values (S_b, kv_width) each; B masks, each None or bool
    (1, S_b): what both ways of attending need (the lesson calls them itself)."""
    queries, config = as_array("queries", queries, 2), _check_config(config)
    if queries.shape[1] != config.d_model or not all(
            isinstance(rows, (list, tuple)) and len(rows) == len(queries)
            for rows in (keys, values, masks)):
        raise ValueError(f"queries must be (B, {config.d_model}), and keys, values and masks "
                         f"lists of B entries, one per query row")
    for b, (K, V, mask) in enumerate(zip(keys, values, masks)):
        K, V = as_array(f"keys[{b}]", K, 2), as_array(f"values[{b}]", V, 2)
        if K.shape != V.shape or K.shape[1] != config.kv_width or len(K) == 0 or not (
                mask is None or isinstance(mask, np.ndarray) and mask.dtype == bool
                and mask.shape == (1, len(K))):
            raise ValueError(f"keys[{b}] and values[{b}] must both be (S, {config.kv_width}) "
                             f"with S >= 1 (got {K.shape} and {V.shape}), and masks[{b}] None "
                             f"or a bool array (1, S)")


def padding_mask(lengths) -> np.ndarray:
    """The mask of a left-padded batch of caches (batched_decoding): lengths (B,) -> bool
    (B, S_max), True where row b holds one of its S_b real positions.

    Padded on the left, sequence b's positions fill the last S_b columns, so every
    sequence's newest position sits in the same, last column; the first S_max - S_b columns
    of row b are padding, and no query may attend to them.
    """
    lengths = as_whole_numbers("lengths", lengths, minimum=1)
    longest = as_count("lengths must be non-empty: the longest", int(lengths.max(initial=0)), 1)
    return np.arange(longest)[None, :] >= (longest - lengths)[:, None]


def pad_left(rows: list, width: int) -> np.ndarray:
    """Sequences of rows (S_b, n) each, copied into one zero-filled array (B, width, n),
    every sequence in its last S_b rows (batched_decoding)."""
    padded = np.zeros((len(rows), width, rows[0].shape[1]), dtype=rows[0].dtype)
    for b, block in enumerate(rows):
        padded[b, width - len(block):] = block
    return padded


def attend_padded(queries: np.ndarray, keys: list, values: list, masks: list,
                  config: ModelConfig) -> np.ndarray:
    """The whole batch's attention as one product over caches padded on the left (notebook
    19): queries (B, d), keys[b] and values[b] (S_b, kv_width), masks[b] (1, S_b) or None
    -> the merged heads (B, d), equal to attend_per_sequence.

    Every cache is copied into (B, S_max, kv_width); the padding gets score -inf (as
    kvlib.apply_mask does), so its weight is exactly 0. The batch is folded into the head
    axis, (B x h, 1, dh) queries against (B x kv, S_max, dh) keys, which keeps
    kvlib.attention_scores' grouping of query heads for GQA: query head i of sequence b
    meets K/V head b x kv + i // (h / kv), its own sequence's.
    """
    _check_attend_arguments(queries, keys, values, masks, config)
    B, h, kv, dh = len(keys), config.n_heads, config.kv_heads, config.head_dim
    lengths = [len(K) for K in keys]
    longest = max(lengths)
    visible = padding_mask(lengths)                                     # (B, S_max)
    for b, mask in enumerate(masks):
        if mask is not None:                  # a sliding window hides some real positions too
            visible[b, longest - lengths[b]:] &= mask[0]
    K = pad_left(keys, longest).reshape(B, longest, kv, dh).transpose(0, 2, 1, 3)
    V = pad_left(values, longest).reshape(B, longest, kv, dh).transpose(0, 2, 1, 3)
    Q = queries.reshape(B * h, 1, dh)                           # split_heads of every row
    scores = attention_scores(Q, K.reshape(B * kv, longest, dh)).reshape(B, h, longest)
    scores = np.where(visible[:, None, :], scores, -np.inf)
    weights = softmax(scores).reshape(B * h, 1, longest)
    heads = weighted_sum(weights, V.reshape(B * kv, longest, dh))        # (B x h, 1, dh)
    return heads.reshape(B, h * dh)                             # merge_heads of every row


def batched_decoder_block(X: np.ndarray, layer, config: ModelConfig, caches, layer_index: int,
                          masks: list, rotary=None, attend=attend_per_sequence) -> np.ndarray:
    """One decoder block for a batch of decode steps (batched_decoding): X (B, d) -> (B, d).

    kvlib.model.block_with_attention, the skeleton of kvlib.decoder_block, with the batch as
    its rows: the projections, the output projection and the MLP are one product each for the
    whole batch; row b's k and v are appended to sequence b's cache, and attend
    (attend_per_sequence or attend_padded) lets each query see its own sequence only. With
    rotary positions each row is turned to its own sequence's position. If the block fails,
    every cache is left as it was.
    """
    _check_config(config)
    as_instance("layer", layer, LayerParams, LAYER)
    caches = _check_caches(caches)
    if as_array("X", X, 2).shape[0] != len(caches) or not isinstance(masks, (list, tuple)) \
            or len(masks) != len(caches):
        raise ValueError(f"X, caches and masks must have one entry per sequence: got "
                         f"{np.shape(X)[0]} rows, {len(caches)} caches and masks {masks!r:.60}")
    for b, mask in enumerate(masks):                     # before any cache changes
        if mask is not None and (not isinstance(mask, np.ndarray) or mask.dtype != bool
                                 or mask.ndim != 2 or len(mask) != 1):
            raise ValueError(f"masks[{b}] must be None or a bool array (1, S), got "
                             f"{mask!r:.80}")
    if not callable(attend):
        raise TypeError("attend must be attend_per_sequence, attend_padded or a function "
                        "like them")

    def each_to_its_own(Q, K, V):
        """Row b's k and v appended to cache b; then attend over each cache."""
        attended = [cache.append(layer_index, K[b:b + 1], V[b:b + 1])
                    for b, cache in enumerate(caches)]
        return attend(Q, [keys for keys, _ in attended], [vals for _, vals in attended],
                      masks, config)

    saved = [cache.checkpoint() for cache in caches]
    try:
        return block_with_attention(X, layer, each_to_its_own, rotary=rotary,
                                    norm_epsilon=config.norm_epsilon)
    except BaseException:         # a mask of the wrong width, say: every cache as it was
        for cache, state in zip(caches, saved):
            cache.restore(state)
        raise


def batched_decode_step(params: Params, token_ids, caches, *, attend=attend_per_sequence):
    """One decode step for B sequences at once (batched_decoding): token ids (B,), B caches ->
    logits (B, V); each cache grows by one position.

    Row b equals kvlib.decode_step(params, token_ids[b], caches[b]) run alone, whatever the
    caches' lengths (each token sits at its own position len(caches[b])) and kinds (KVCache,
    a paged cache, a sliding window). attend chooses how the ragged attention is done:
    attend_per_sequence (a loop) or attend_padded (one padded product). If the step fails
    half-way, every cache is left as it was.
    """
    ids = check_batch(params, token_ids, caches)
    if not callable(attend):
        raise TypeError("attend must be attend_per_sequence, attend_padded or a function "
                        "like them")
    config = params.config
    positions = batch_positions(caches)
    X = embed_batch(params, ids, positions)   # before any append: a bad position changes nothing
    masks = sequence_masks(config, caches, positions)
    rotary = rotary_positions(config, positions)
    saved = [cache.checkpoint() for cache in caches]
    try:
        for index, layer in enumerate(params.layers):
            X = batched_decoder_block(X, layer, config, caches, index, masks, rotary, attend)
    except BaseException:
        for cache, state in zip(caches, saved):
            cache.restore(state)
        raise
    X = normalize(X, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return unembed(X, params.embedding)


def decode_each_alone(params: Params, token_ids, caches) -> np.ndarray:
    """The reference (batched_decoding): kvlib.decode_step for each sequence, one after the
    other -> logits (B, V). B matrix-vector products per weight instead of one product."""
    from ..inference import decode_step

    ids = check_batch(params, token_ids, caches)
    return np.vstack([decode_step(params, int(token), cache)
                      for token, cache in zip(ids, caches)])


# ------------------------------------------------------------------------------ left-padded prompts


def left_pad(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of different lengths as one batch, padded on the left (batched_decoding; what
    transformers' tokenizers do with padding_side="left"): B lists of ids ->
    (ids (B, T), real (B, T) bool, True where a column holds a prompt's token).

    Each prompt's last token sits in the last column, so the next token of every prompt is
    read from logits[:, -1], and the first new token of every sequence goes in column T.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts, each a list of ids")
    pad_id = as_whole_number("pad_id", pad_id, 0, LARGEST_ID)
    rows = [as_whole_numbers(f"prompt {index} (token ids: encode a text first)", prompt)
            for index, prompt in enumerate(prompts)]
    if any(row.size == 0 or row.max() > LARGEST_ID for row in rows):
        raise ValueError("every prompt must be a non-empty list of token ids")
    longest = max(len(row) for row in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.intp)
    for b, row in enumerate(rows):
        ids[b, longest - len(row):] = row
    return ids, padding_mask([len(row) for row in rows])


def padded_prompt_mask(real: np.ndarray) -> np.ndarray:
    """The attention mask of a left-padded prompt batch (batched_decoding): real (B, T) ->
    bool (B, T, T), [b, i, j] True when query i of prompt b may see key j.

    Causal, and no query sees a padded key (a column of padding is hidden in every row).
    A padded query (a row of padding) would then see nothing, and a softmax over nothing
    is 0 / 0; it is let see itself instead, and its output is never read (transformers
    un-masks such rows for the same reason).
    """
    real = _check_real(real)
    T = real.shape[1]
    allowed = np.tri(T, dtype=bool)[None] & real[:, None, :]
    return allowed | (np.eye(T, dtype=bool)[None] & ~real[:, :, None])


def padded_prompt_positions(real: np.ndarray) -> np.ndarray:
    """The position of every column of a left-padded prompt batch (batched_decoding): real
    (B, T) -> (B, T) ints, each prompt counting from 0 at its first real token (padding
    gets 0). transformers computes position_ids the same way, from the attention mask."""
    real = _check_real(real)
    return np.maximum(np.cumsum(real, axis=1) - 1, 0)


def _check_real(real) -> np.ndarray:
    """A (B, T) array of True/False (left_pad's second result)."""
    try:
        array = np.asarray(real)
    except ValueError:                       # rows of different lengths
        array = np.asarray(real, dtype=object)
    if array.dtype != bool or array.ndim != 2 or array.size == 0:
        raise ValueError(f"real must be a (B, T) array of True/False (left_pad gives it), got "
                         f"{array.dtype} of shape {array.shape}")
    return array
