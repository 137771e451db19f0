"""The model's steps as small pure functions, in the order a token meets them.

Shapes use T for the number of tokens in the chunk being processed, S for the number of
positions attended over (S = T without a cache), d for d_model, h for n_heads,
dh = d / h for the head size, f for d_ff and V for the vocabulary size.

Every function keeps its input's dtype: constants are Python floats, because under numpy 2
a numpy float64 scalar would silently turn float32 activations into float64.
"""

from __future__ import annotations

import math

import numpy as np


def _require_matrix(name: str, array: np.ndarray, columns: int | None = None) -> None:
    if not isinstance(array, np.ndarray) or array.ndim != 2:
        shape = getattr(array, "shape", type(array).__name__)
        raise ValueError(f"{name} must be a 2-D array (tokens, features), got {shape}")
    if columns is not None and array.shape[1] != columns:
        raise ValueError(f"{name} must have {columns} columns, got shape {array.shape}")


def embed(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Embedding lookup (notebook 01): ids (T,) pick rows of the table (V, d) -> X (T, d)."""
    return table[ids]


def project_qkv(X: np.ndarray, layer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q, K, V projections (notebook 02): X (T, d) @ Wq, Wk, Wv (d, d) -> three (T, d)."""
    _require_matrix("X", X, layer.Wq.shape[0])
    return X @ layer.Wq, X @ layer.Wk, X @ layer.Wv


def split_heads(X: np.ndarray, n_heads: int) -> np.ndarray:
    """Split columns into heads (notebook 04): (T, d) -> (h, T, d / h).

    Head i gets columns i*dh to (i+1)*dh - 1: a reshape, then a swap of the first two axes.
    """
    _require_matrix("X", X)
    T, d = X.shape
    if d % n_heads != 0:
        raise ValueError(f"cannot split {d} columns into {n_heads} equal heads")
    return X.reshape(T, n_heads, d // n_heads).transpose(1, 0, 2)


def merge_heads(heads: np.ndarray) -> np.ndarray:
    """Concatenate the heads back (notebook 04): (h, T, dh) -> (T, h * dh)."""
    if heads.ndim != 3:
        raise ValueError(f"heads must be a 3-D array (heads, tokens, head_dim), got {heads.shape}")
    h, T, dh = heads.shape
    return heads.transpose(1, 0, 2).reshape(T, h * dh)


def causal_mask(n_queries: int, n_keys: int | None = None) -> np.ndarray:
    """Which key each query may see (notebook 03): bool (Tq, S), True = allowed.

    The mask is aligned to the end: the queries are the last n_queries of n_keys positions,
    so query i (at position n_keys - n_queries + i) sees keys 0 .. that position. Without a
    cache n_keys = n_queries and this is the usual lower triangle; when new tokens continue a
    cache (notebook 08), every cached position is visible to every new query.
    """
    n_keys = n_queries if n_keys is None else n_keys
    if n_queries < 1 or n_keys < n_queries:
        raise ValueError(
            f"need 1 <= n_queries <= n_keys, got n_queries={n_queries}, n_keys={n_keys}"
        )
    offset = n_keys - n_queries
    return np.tri(n_queries, n_keys, k=offset, dtype=bool)


def attention_scores(Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Scaled dot products (notebook 02): Q (h, T, dh) @ K^T (h, dh, S) / sqrt(dh) -> (h, T, S).

    Dividing by sqrt(dh) keeps the scores' spread near 1 whatever the head size, so the
    softmax does not saturate into a one-hot row.
    """
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"queries {Q.shape} and keys {K.shape} must have the same head size")
    return (Q @ K.swapaxes(-1, -2)) * (1.0 / math.sqrt(Q.shape[-1]))


def apply_mask(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Set forbidden scores to -inf (notebook 03): scores (..., T, S), mask (T, S) -> (..., T, S).

    -inf becomes exactly 0 after the softmax, so a forbidden position gets no weight.
    """
    if mask.shape != scores.shape[-2:]:
        raise ValueError(f"mask {mask.shape} does not match scores {scores.shape[-2:]}")
    return np.where(mask, scores, -np.inf)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along an axis (notebook 02): any shape -> same shape, each row sums to 1.

    Subtracting the row maximum first changes nothing mathematically and avoids overflow.
    """
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def attention_weights(Q: np.ndarray, K: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Scores, mask, softmax (notebooks 02-03): (h, T, dh), (h, S, dh) -> weights (h, T, S)."""
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    return softmax(scores)


def weighted_sum(weights: np.ndarray, V: np.ndarray) -> np.ndarray:
    """Mix the values (notebook 02): weights (h, T, S) @ V (h, S, dh) -> (h, T, dh)."""
    return weights @ V


def attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray | None = None):
    """Scaled dot-product attention (notebook 02): (h, T, dh), (h, S, dh) x2 -> (h, T, dh)."""
    return weighted_sum(attention_weights(Q, K, mask), V)


def output_projection(X: np.ndarray, Wo: np.ndarray) -> np.ndarray:
    """Mix the concatenated heads (notebook 04): (T, d) @ Wo (d, d) -> (T, d)."""
    return X @ Wo


def gelu(x: np.ndarray) -> np.ndarray:
    """GeLU, the tanh form used by GPT-2 (notebook 05): any shape -> same shape.

    The cube is written x * x * x: numpy's x**3 on a float32 array goes through a general
    power function, about 100 times slower, which made this the slowest step of a decode.
    """
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


def mlp(X: np.ndarray, layer) -> np.ndarray:
    """Position-wise MLP (notebook 05): X (T, d) @ W_up (d, f) -> GeLU -> @ W_down (f, d)."""
    return gelu(X @ layer.W_up) @ layer.W_down


def decoder_block(
    X: np.ndarray,
    layer,
    n_heads: int,
    mask: np.ndarray | None = None,
    cache=None,
    layer_index: int = 0,
    record_attention: list | None = None,
) -> np.ndarray:
    """One decoder block (notebook 05): X (T, d) -> X1 (T, d), with X1 = X + block(X).

    Attention, then the MLP, each adding its result to the residual stream (as in GPT-2,
    without layer normalisation). With a cache (notebooks 07-08) this chunk's K and V are
    appended first and the T queries attend over all S cached positions. When a list is
    given as record_attention, the attention weights (h, T, S) are appended to it.
    """
    Q, K, V = project_qkv(X, layer)
    if cache is not None:
        K, V = cache.append(layer_index, K, V)
    weights = attention_weights(split_heads(Q, n_heads), split_heads(K, n_heads), mask)
    if record_attention is not None:
        record_attention.append(weights)
    heads = weighted_sum(weights, split_heads(V, n_heads))
    H = X + output_projection(merge_heads(heads), layer.Wo)
    return H + mlp(H, layer)


def unembed(X: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Logits with the tied unembedding (notebook 06): X (T, d) @ table^T (d, V) -> (T, V)."""
    return X @ table.T
