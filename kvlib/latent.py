"""Multi-head latent attention (notebook 16; DeepSeek-V2, 2024, and V3).

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

from .model import (
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


def compress_kv(X: np.ndarray, layer) -> np.ndarray:
    """The latent that is cached (notebook 16): X (T, d) @ W_down_kv (d, dc) -> (T, dc)."""
    return X @ layer.W_down_kv


def rebuild_kv(latent: np.ndarray, layer) -> tuple[np.ndarray, np.ndarray]:
    """Every head's keys and values from the latents (notebook 16): (S, dc) -> K, V (S, d).

    What the absorbed form never does: it costs 2 x S x dc x d multiply-adds a step."""
    return latent @ layer.W_up_k, latent @ layer.W_up_v


def latent_queries(X: np.ndarray, layer, rotary=None):
    """Queries (notebook 16): X (T, d) -> the content part (T, d) and, with rotary
    positions, the rotated rotary part (T, h x dr); None without."""
    content = X @ layer.Wq
    if rotary is None:
        return content, None
    return content, rotary.rotate(X @ layer.Wq_rope)


def rope_keys(X: np.ndarray, layer, rotary=None):
    """The decoupled rotary key (notebook 16): X (T, d) @ Wk_rope (d, dr), rotated ->
    (T, dr), one for all heads; None without rotary positions."""
    if rotary is None:
        return None
    return rotary.rotate(X @ layer.Wk_rope)


def per_head(matrix: np.ndarray, n_heads: int) -> np.ndarray:
    """An up-projection (dc, h x dh) seen as one (dc, dh) matrix per head (notebook 16):
    (h, dc, dh)."""
    dc, width = matrix.shape
    return matrix.reshape(dc, n_heads, width // n_heads).transpose(1, 0, 2)


def absorb_queries(queries: np.ndarray, layer, n_heads: int) -> np.ndarray:
    """Move each head's content query into the latent's space (notebook 16):
    (h, T, dh) @ W_up_k_h^T (h, dh, dc) -> (h, T, dc). Then q . k_h = q_absorbed . latent."""
    return queries @ per_head(layer.W_up_k, n_heads).swapaxes(-1, -2)


def latent_attention_scores(absorbed, latent, query_rope=None, key_rope=None, scale=1.0):
    """Scores against the cached latents (notebook 16): absorbed (h, T, dc) @ latent^T
    (dc, S), plus the rotary parts (h, T, dr) @ (dr, S), times scale -> (h, T, S)."""
    scores = absorbed @ latent.T
    if query_rope is not None:
        scores = scores + query_rope @ key_rope.T
    return scores * scale


def latent_weighted_sum(weights: np.ndarray, latent: np.ndarray) -> np.ndarray:
    """Mix the cached latents (notebook 16): weights (h, T, S) @ latent (S, dc) -> (h, T, dc)."""
    return weights @ latent


def expand_values(mixed: np.ndarray, layer, n_heads: int) -> np.ndarray:
    """The values' up-projection after the sum (notebook 16): (h, T, dc) @ W_up_v_h
    (h, dc, dh) -> (h, T, dh), equal to the weighted sum of the rebuilt values."""
    return mixed @ per_head(layer.W_up_v, n_heads)


def _scale(layer, n_heads: int) -> float:
    head_dim = layer.Wq.shape[1] // n_heads
    rope_dim = 0 if layer.Wk_rope is None else layer.Wk_rope.shape[1]
    return 1.0 / math.sqrt(head_dim + rope_dim)


def _rope_heads(query_rope, n_heads: int):
    return None if query_rope is None else split_heads(query_rope, n_heads)


def latent_attention(X, layer, n_heads: int, mask=None, cache=None, layer_index: int = 0,
                     record_attention: list | None = None, *, rotary=None) -> np.ndarray:
    """The absorbed form, as a decode step runs it (notebook 16): X (T, d) -> (T, d),
    before the output projection. Only the latents and rotary keys are cached."""
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
    """The same attention with K and V rebuilt for every position (notebook 16, and the
    tests' reference): X (T, d) -> (T, d), before the output projection. past_latent
    (P, dc) and past_key_rope (P, dr) continue earlier positions.

    This is plain multi-head attention (kvlib.attention_weights, kvlib.weighted_sum) on the
    rebuilt keys and values; with a rotary part, each head's query and key get the dr
    rotary columns appended, the key's shared by every head.
    """
    content, query_rope = latent_queries(X, layer, rotary)
    latent, key_rope = compress_kv(X, layer), rope_keys(X, layer, rotary)
    if past_latent is not None:
        if (past_key_rope is None) != (key_rope is None):
            raise ValueError("give past_key_rope with past_latent exactly when the model has "
                             "a rotary part (rope_head_dim > 0)")
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
    """A decoder block with latent attention (notebook 16): X (T, d) -> (T, d).

    The same residual stream and MLP as kvlib.decoder_block; only the attention differs.
    """
    attended = latent_attention(normalize(X, layer.ln_1_gain, layer.ln_1_bias, norm_epsilon),
                                layer, n_heads, mask, cache, layer_index, record_attention,
                                rotary=rotary)
    H = X + output_projection(attended, layer.Wo)
    return H + mlp(normalize(H, layer.ln_2_gain, layer.ln_2_bias, norm_epsilon), layer)
