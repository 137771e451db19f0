"""Multi-head latent attention (latent_attention; DeepSeek-V2, 2024, and V3).

Instead of K and V (2 x d numbers a token and layer), each token's input is compressed into
one latent of dc numbers, and that latent is what is cached. Every head's keys and values
can be rebuilt from it with an up-projection, latent @ W_up_k and latent @ W_up_v, but a
decode step never needs to: because

    q . (latent @ W_up_k_h) = (q @ W_up_k_h^T) . latent,

the query can be moved into the latent's space once ("absorbed") and scored against the
cached latents directly, and the values' up-projection can be applied after the weighted sum,
to one row per head instead of to every cached position.

Rotary positions do not survive the absorption (a rotation between q and W_up_k depends on
the key's position, so it cannot be folded into one matrix). DeepSeek's answer, kept here:
a small decoupled rotary part, dr columns of q per head and one shared rotary key of dr
columns per token, cached beside the latent. A token then costs dc + dr numbers a layer.

Shapes: h heads of dh = d / h columns, dc = latent_dim, dr = rope_head_dim, T new tokens,
S attended positions. kvlib leaves out two details of DeepSeek's: the query's own
compression (DeepSeek-V2 compresses q too, to save activations in training, not cache) and
the RMSNorm on the latent.
"""

from __future__ import annotations

import math

import numpy as np

from .checks import (
    as_array,
    as_divisor,
    as_instance,
    as_list_or_none,
    as_matrix,
    as_real_number,
    as_rotary,
)
from .model import (
    LAYER,
    apply_mask,
    attention_weights,
    merge_heads,
    mlp,
    normalize,
    output_projection,
    softmax,
    split_heads,
    weighted_sum,
)
from .params import LatentLayerParams


def compress_kv(X: np.ndarray, layer) -> np.ndarray:
    """The latent that is cached (latent_attention): X (T, d) @ W_down_kv (d, dc) -> (T, dc)."""
    layer = as_instance("layer", layer, LatentLayerParams, LAYER)
    return as_matrix("X", X, layer.Wq.shape[0]) @ layer.W_down_kv


def rebuild_kv(latent: np.ndarray, layer) -> tuple[np.ndarray, np.ndarray]:
    """Every head's keys and values from the latents (latent_attention): (S, dc) -> K, V (S, d).

    What the absorbed form never does: it costs 2 x S x dc x d multiply-adds a step."""
    layer = as_instance("layer", layer, LatentLayerParams, LAYER)
    latent = as_matrix("latent", latent, layer.W_up_k.shape[0])
    return latent @ layer.W_up_k, latent @ layer.W_up_v


def latent_queries(X: np.ndarray, layer, rotary=None):
    """Queries (latent_attention): X (T, d) -> the content part (T, d) and, with rotary
    positions, the rotated rotary part (T, h x dr); None without."""
    layer = as_instance("layer", layer, LatentLayerParams, LAYER)
    X = as_matrix("X", X, layer.Wq.shape[0])
    if as_rotary(rotary) is not None and layer.Wk_rope is None:
        raise ValueError("this layer has no rotary part (no Wk_rope): give rotary=None")
    content = X @ layer.Wq
    if rotary is None:
        return content, None
    return content, rotary.rotate(X @ layer.Wq_rope)


def rope_keys(X: np.ndarray, layer, rotary=None):
    """The decoupled rotary key (latent_attention): X (T, d) @ Wk_rope (d, dr), rotated ->
    (T, dr), one for all heads; None without rotary positions."""
    layer = as_instance("layer", layer, LatentLayerParams, LAYER)
    X = as_matrix("X", X, layer.Wq.shape[0])
    if as_rotary(rotary) is not None and layer.Wk_rope is None:
        raise ValueError("this layer has no rotary part (no Wk_rope): give rotary=None")
    if rotary is None:
        return None
    return rotary.rotate(X @ layer.Wk_rope)


def per_head(matrix: np.ndarray, n_heads: int) -> np.ndarray:
    """An up-projection (dc, h x dh) seen as one (dc, dh) matrix per head (latent_attention):
    (h, dc, dh)."""
    matrix = as_matrix("matrix", matrix)
    dc, width = matrix.shape
    n_heads = as_divisor("n_heads", n_heads, width, "columns of the matrix")
    return matrix.reshape(dc, n_heads, width // n_heads).transpose(1, 0, 2)


def absorb_queries(queries: np.ndarray, layer, n_heads: int) -> np.ndarray:
    """Move each head's content query into the latent's space (latent_attention):
    (h, T, dh) @ W_up_k_h^T (h, dh, dc) -> (h, T, dc). Then q . k_h = q_absorbed . latent."""
    width = as_instance("layer", layer, LatentLayerParams, LAYER).W_up_k.shape[1]
    n_heads = as_divisor("n_heads", n_heads, width, "columns of the up-projections")
    queries = as_array("queries", queries, (2, 3), width // n_heads)
    return queries @ per_head(layer.W_up_k, n_heads).swapaxes(-1, -2)


def latent_attention_scores(absorbed, latent, query_rope=None, key_rope=None, scale=1.0):
    """Scores against the cached latents (latent_attention): absorbed (h, T, dc) @ latent^T
    (dc, S), plus the rotary parts (h, T, dr) @ (dr, S), times scale -> (h, T, S)."""
    absorbed = as_array("absorbed", absorbed, (2, 3))
    latent = as_matrix("latent", latent, absorbed.shape[-1])
    if (query_rope is None) != (key_rope is None):
        raise ValueError("give query_rope and key_rope together (a rotary part), or neither")
    if query_rope is not None:
        key_rope = as_matrix("key_rope", key_rope)
        query_rope = as_array("query_rope", query_rope, (2, 3), key_rope.shape[1])
        if key_rope.shape[0] != latent.shape[0] or query_rope.shape[:-1] != absorbed.shape[:-1]:
            raise ValueError(f"query_rope {query_rope.shape} and key_rope {key_rope.shape} "
                             f"must match absorbed {absorbed.shape} and latent {latent.shape}")
    scale = as_real_number("scale", scale, positive=True)
    scores = absorbed @ latent.T
    if query_rope is not None:
        scores = scores + query_rope @ key_rope.T
    return scores * scale


def latent_weighted_sum(weights: np.ndarray, latent: np.ndarray) -> np.ndarray:
    """Mix the cached latents (latent_attention): weights (h, T, S) @ latent (S, dc) ->
    (h, T, dc)."""
    return weights @ latent


def expand_values(mixed: np.ndarray, layer, n_heads: int) -> np.ndarray:
    """The values' up-projection after the sum (latent_attention): (h, T, dc) @ W_up_v_h
    (h, dc, dh) -> (h, T, dh), equal to the weighted sum of the rebuilt values."""
    layer = as_instance("layer", layer, LatentLayerParams, LAYER)
    n_heads = as_divisor("n_heads", n_heads, layer.W_up_v.shape[1], "columns of W_up_v")
    mixed = as_array("mixed", mixed, (2, 3), layer.W_up_v.shape[0])
    if mixed.ndim == 3 and len(mixed) != n_heads:
        raise ValueError(f"mixed must have one row block per head, ({n_heads}, T, dc), got "
                         f"{mixed.shape}")
    return mixed @ per_head(layer.W_up_v, n_heads)


def _scale(layer, n_heads: int) -> float:
    head_dim = layer.Wq.shape[1] // n_heads
    rope_dim = 0 if layer.Wk_rope is None else layer.Wk_rope.shape[1]
    return 1.0 / math.sqrt(head_dim + rope_dim)


def _rope_heads(query_rope, n_heads: int):
    return None if query_rope is None else split_heads(query_rope, n_heads)


def latent_attention(X, layer, n_heads: int, mask=None, cache=None, layer_index: int = 0,
                     record_attention: list | None = None, *, rotary=None) -> np.ndarray:
    """The absorbed form, as a decode step runs it (latent_attention): X (T, d) -> (T, d),
    before the output projection. Only the latents and rotary keys are cached."""
    width = as_instance("layer", layer, LatentLayerParams, LAYER).W_up_k.shape[1]
    n_heads = as_divisor("n_heads", n_heads, width, "columns of the up-projections")
    record_attention = as_list_or_none(record_attention)
    content, query_rope = latent_queries(X, layer, rotary)
    latent, key_rope = compress_kv(X, layer), rope_keys(X, layer, rotary)
    if cache is not None:
        latent, key_rope = cache.append(layer_index, latent, key_rope)
    absorbed = absorb_queries(split_heads(content, n_heads), layer, n_heads)
    scores = latent_attention_scores(absorbed, latent, _rope_heads(query_rope, n_heads),
                                     key_rope, _scale(layer, n_heads))
    weights = softmax(scores if mask is None else apply_mask(scores, mask))
    if record_attention is not None:
        record_attention.append(weights)
    return merge_heads(expand_values(latent_weighted_sum(weights, latent), layer, n_heads))


def latent_attention_rebuilt(X, layer, n_heads: int, mask=None, *, rotary=None,
                             past_latent=None, past_key_rope=None) -> np.ndarray:
    """The same attention with K and V rebuilt for every position (latent_attention, and the
    tests' reference): X (T, d) -> (T, d), before the output projection. past_latent
    (P, dc) and past_key_rope (P, dr) continue earlier positions.

    This is plain multi-head attention (kvlib.attention_weights, kvlib.weighted_sum) on the
    rebuilt keys and values; with a rotary part, each head's query and key get the dr
    rotary columns appended, the key's shared by every head.
    """
    width = as_instance("layer", layer, LatentLayerParams, LAYER).W_up_k.shape[1]
    n_heads = as_divisor("n_heads", n_heads, width, "columns of the up-projections")
    content, query_rope = latent_queries(X, layer, rotary)
    latent, key_rope = compress_kv(X, layer), rope_keys(X, layer, rotary)
    if past_latent is not None:
        past_latent = as_matrix("past_latent", past_latent, latent.shape[1])
        if key_rope is not None:
            past_key_rope = as_matrix("past_key_rope", past_key_rope, key_rope.shape[1])
        if (past_key_rope is None) != (key_rope is None) or \
                (key_rope is not None and len(past_key_rope) != len(past_latent)):
            raise ValueError("give past_key_rope, one row per row of past_latent, exactly when "
                             "the model has a rotary part (rope_head_dim > 0)")
        latent = np.vstack([past_latent, latent])
        key_rope = None if key_rope is None else np.vstack([past_key_rope, key_rope])
    K, V = rebuild_kv(latent, layer)
    queries, keys = split_heads(content, n_heads), split_heads(K, n_heads)
    if query_rope is not None:
        queries = np.concatenate([queries, split_heads(query_rope, n_heads)], axis=-1)
        shared = np.broadcast_to(key_rope, (n_heads, *key_rope.shape))
        keys = np.concatenate([keys, shared], axis=-1)
    weights = attention_weights(queries, keys, mask)   # scaled by 1 / sqrt(dh + dr)
    return merge_heads(weighted_sum(weights, split_heads(V, n_heads)))


def latent_decoder_block(X, layer, n_heads: int, mask=None, cache=None, layer_index: int = 0,
                         record_attention: list | None = None, *, rotary=None,
                         norm_epsilon: float = 1e-5) -> np.ndarray:
    """A decoder block with latent attention (latent_attention): X (T, d) -> (T, d).

    The same residual stream and MLP as kvlib.decoder_block; only the attention differs.
    """
    attended = latent_attention(normalize(X, layer.ln_1_gain, layer.ln_1_bias, norm_epsilon),
                                layer, n_heads, mask, cache, layer_index, record_attention,
                                rotary=rotary)
    H = X + output_projection(attended, layer.Wo)
    return H + mlp(normalize(H, layer.ln_2_gain, layer.ln_2_bias, norm_epsilon), layer)
