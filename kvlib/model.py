"""The model's steps as small pure functions, in the order a token meets them.

Shapes use T for the number of tokens in the chunk being processed, S for the number of
positions attended over (S = T without a cache), d for d_model, h for n_heads,
dh = d / h for the head size, f for d_ff and V for the vocabulary size. Models with fewer K/V
heads (grouped_query_attention) have kv of them: K and V are (T, kv x dh), split into (kv, T, dh).

Every function keeps its input's dtype: constants are Python floats, because under numpy 2
a numpy float64 scalar would silently turn float32 activations into float64.
"""

from __future__ import annotations

import math

import numpy as np

from .checks import (
    as_array,
    as_divisor,
    as_floats,
    as_instance,
    as_list_or_none,
    as_mask,
    as_matrix,
    as_real_number,
    as_rotary,
    as_token_ids,
    as_whole_number,
    as_whole_numbers,
    is_trusted,
)
from .params import LatentLayerParams, LayerParams

LAYER = "one of params.layers"
"""Where a block's weights come from, for the error that refuses anything else."""
LAYERS = (LayerParams, LatentLayerParams)
LONGEST_MASK = 2**15
"""More queries or keys than any mask here has (a (2**15, 2**15) mask is a GB of bools)."""


def _plus_bias(Y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """Y + bias when the model has biases (GPT-2, the real_model lesson); Y itself for the toy."""
    return Y if bias is None else Y + bias


def embed(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Embedding lookup (embedding_lookup): ids (T,) pick rows of the table (V, d) -> X (T, d)."""
    table = as_matrix("table", table)
    return table[as_token_ids(ids, len(table), what="token ids", empty=True)]


def project_qkv(X: np.ndarray, layer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q, K, V projections (one_attention_head): X (T, d) @ Wq, Wk, Wv (d, d) -> three (T, d).

    GPT-2 adds a bias to each (real_model) and stores the three matrices side by side as
    one (d, 3d) matrix, c_attn: X @ c_attn is the three products next to each other. With
    fewer K/V heads (grouped_query_attention) Wk and Wv are (d, kv x dh), and so are K and V.
    """
    X = as_matrix("X", X, as_instance("layer", layer, LayerParams, LAYER).Wq.shape[0])
    return (_plus_bias(X @ layer.Wq, layer.bq), _plus_bias(X @ layer.Wk, layer.bk),
            _plus_bias(X @ layer.Wv, layer.bv))


def split_heads(X: np.ndarray, n_heads: int) -> np.ndarray:
    """Split columns into heads (multi_head_attention): (T, d) -> (h, T, d / h).

    Head i gets columns i*dh to (i+1)*dh - 1: a reshape, then a swap of the first two axes.
    """
    X = as_matrix("X", X)
    T, d = X.shape
    n_heads = as_divisor("n_heads", n_heads, d, "columns of X")
    return X.reshape(T, n_heads, d // n_heads).transpose(1, 0, 2)


def merge_heads(heads: np.ndarray) -> np.ndarray:
    """Concatenate the heads back (multi_head_attention): (h, T, dh) -> (T, h * dh)."""
    heads = as_array("heads", heads, 3)
    h, T, dh = heads.shape
    return heads.transpose(1, 0, 2).reshape(T, h * dh)


def causal_mask(n_queries: int, n_keys: int | None = None) -> np.ndarray:
    """Which key each query may see (causal_masking): bool (Tq, S), True = allowed.

    The mask is aligned to the end: the queries are the last n_queries of n_keys positions,
    so query i (at position n_keys - n_queries + i) sees keys 0 .. that position. Without a
    cache n_keys = n_queries and this is the usual lower triangle; when new tokens continue a
    cache (kv_cached_decode), every cached position is visible to every new query.
    """
    n_queries = as_whole_number("n_queries", n_queries, 1, LONGEST_MASK)
    n_keys = as_whole_number("n_keys", n_queries if n_keys is None else n_keys, n_queries,
                             LONGEST_MASK)
    offset = n_keys - n_queries
    return np.tri(n_queries, n_keys, k=offset, dtype=bool)


def attention_mask(query_positions, key_positions, window: int | None = None,
                   sink_tokens: int = 0) -> np.ndarray:
    """Which key each query may see, by their positions
    (causal_masking and sliding_windows_and_sinks): bool (T, S).

    Causal: a query sees the keys at its own position and before. With a sliding window of
    W (Mistral), only the last W of those, itself included, unless the key is one of the
    first sink_tokens positions (StreamingLLM's attention sinks), which stay visible.
    causal_mask(T, S) is the case of consecutive positions without a window.
    """
    queries = as_whole_numbers("query_positions", query_positions)[:, None]
    keys = as_whole_numbers("key_positions", key_positions)[None, :]
    sink_tokens = as_whole_number("sink_tokens", sink_tokens)
    allowed = keys <= queries
    if window is not None:
        window = as_whole_number("window", window, 1)
        allowed &= (keys > queries - window) | (keys < sink_tokens)
    return allowed


def is_grouped(queries: np.ndarray, keys: np.ndarray) -> bool:
    """True when several query heads share each K/V head (grouped_query_attention)."""
    if queries.ndim != 3 or keys.ndim != 3 or queries.shape[0] == keys.shape[0]:
        return False
    if queries.shape[0] % keys.shape[0]:
        raise ValueError(f"{queries.shape[0]} query heads cannot share {keys.shape[0]} K/V "
                         "heads equally: the query heads must be a multiple of the K/V heads")
    return True


def attention_scores(Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Scaled dot products (one_attention_head): Q (h, T, dh) @ K^T (h, dh, S) / sqrt(dh) ->
    (h, T, S).

    Dividing by sqrt(dh) keeps the scores' spread near 1 whatever the head size, so the
    softmax does not saturate into a one-hot row. With fewer K/V heads (grouped_query_attention), K
    is (kv, S, dh) and query head i is scored against K/V head i // (h / kv): the queries are
    viewed as kv groups of h / kv heads, and each group meets its one K/V head by
    broadcasting, without copying K.
    """
    Q = as_array("Q", Q, (2, 3, 4))
    K = as_array("K", K, (2, 3, 4), columns=Q.shape[-1])
    scale = 1.0 / math.sqrt(Q.shape[-1])
    if is_grouped(Q, K):
        h, T, dh = Q.shape
        groups = Q.reshape(K.shape[0], h // K.shape[0], T, dh)       # (kv, h/kv, T, dh)
        return ((groups @ K[:, None].swapaxes(-1, -2)) * scale).reshape(h, T, K.shape[1])
    return (Q @ K.swapaxes(-1, -2)) * scale


def apply_mask(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Set forbidden scores to -inf (causal_masking): scores (..., T, S), mask (T, S) ->
    (..., T, S).

    -inf becomes exactly 0 after the softmax, so a forbidden position gets no weight.
    """
    scores = as_array("scores", scores, (2, 3, 4))
    mask = as_mask(mask, scores.shape[-2:])
    return np.where(mask, scores, -np.inf)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along an axis (one_attention_head): any shape -> same shape, each row sums to 1.

    Subtracting the row maximum first changes nothing mathematically and avoids overflow.
    """
    x = as_array("x", x)
    if not is_trusted() and x.size == 0:
        raise ValueError(f"softmax needs at least one number, got shape {x.shape}")
    axis = as_whole_number("axis", axis, -x.ndim, x.ndim - 1)
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def attention_weights(Q: np.ndarray, K: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Scores, mask, softmax (one_attention_head and causal_masking): (h, T, dh), (h, S, dh) ->
    weights (h, T, S)."""
    scores = attention_scores(Q, K)
    if mask is not None:
        scores = apply_mask(scores, mask)
    return softmax(scores)


def weighted_sum(weights: np.ndarray, V: np.ndarray) -> np.ndarray:
    """Mix the values (one_attention_head): weights (h, T, S) @ V (h, S, dh) -> (h, T, dh).

    With fewer K/V heads (grouped_query_attention), V is (kv, S, dh), shared by groups of h / kv
    heads.
    """
    weights, V = as_array("weights", weights, (2, 3, 4)), as_array("V", V, (2, 3, 4))
    if not is_trusted() and weights.shape[-1] != V.shape[-2]:
        raise ValueError(f"weights {weights.shape} need one value per position: V must be "
                         f"(heads, {weights.shape[-1]}, head size), got {V.shape}")
    if is_grouped(weights, V):
        h, T, S = weights.shape
        groups = weights.reshape(V.shape[0], h // V.shape[0], T, S)   # (kv, h/kv, T, S)
        return (groups @ V[:, None]).reshape(h, T, V.shape[-1])
    return weights @ V


def attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray | None = None):
    """Scaled dot-product attention (one_attention_head): (h, T, dh), (h, S, dh) x2 ->
    (h, T, dh)."""
    return weighted_sum(attention_weights(Q, K, mask), V)


def output_projection(X: np.ndarray, Wo: np.ndarray, bo: np.ndarray | None = None):
    """Mix the concatenated heads (multi_head_attention): (T, d) @ Wo (d, d) (+ bo) -> (T, d)."""
    Wo = as_matrix("Wo", Wo)
    X = as_matrix("X", X, Wo.shape[0])
    bo = bo if bo is None else as_array("bo", bo, 1, Wo.shape[1])
    return _plus_bias(X @ Wo, bo)


def gelu(x: np.ndarray) -> np.ndarray:
    """GeLU, the tanh form used by GPT-2 (mlp_residual_stream): any shape -> same shape.

    The cube is written x * x * x: numpy's x**3 on a float32 array goes through a general
    power function, about 100 times slower, which made this the slowest step of a decode.
    """
    x = as_floats("x", x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


def gelu_mlp(X: np.ndarray, layer) -> np.ndarray:
    """GPT-2's MLP (mlp_residual_stream): X (T, d) @ W_up (d, f) -> GeLU -> @ W_down (f, d) ->
    (T, d).

    GPT-2 adds a bias after each product (real_model).
    """
    X = as_matrix("X", X, as_instance("layer", layer, LAYERS, LAYER).W_up.shape[0])
    hidden = gelu(_plus_bias(X @ layer.W_up, getattr(layer, "b_up", None)))
    return _plus_bias(hidden @ layer.W_down, getattr(layer, "b_down", None))


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU, x * sigmoid(x) (model_of_today): any shape -> same shape.

    sigmoid(x) = 1 / (1 + exp(-x)) overflows exp for x below about -88 in float32, so it is
    computed from z = exp(-|x|), which never does: 1 / (1 + z) for x >= 0, z / (1 + z) below.
    """
    z = np.exp(-np.abs(x))
    return x * np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def swiglu_mlp(X: np.ndarray, layer) -> np.ndarray:
    """Llama's MLP (model_of_today): silu(X @ W_gate) * (X @ W_up) -> @ W_down: (T, d) -> (T, d).

    Two projections up to f columns instead of one: the gate's silu decides, column by
    column, how much of the up projection passes. Three (d, f) matrices instead of two, so
    Llama-style models choose f about 8/3 d instead of 4 d (SmolLM2: 1536 for d = 576).
    """
    if as_instance("layer", layer, LAYERS, LAYER).W_gate is None:
        raise ValueError("swiglu_mlp needs a layer with a gate, W_gate (a SwiGLU model, the "
                         "model_of_today lesson); for GPT-2's MLP use gelu_mlp")
    X = as_matrix("X", X, layer.W_gate.shape[0])
    return (silu(X @ layer.W_gate) * (X @ layer.W_up)) @ layer.W_down


def mlp(X: np.ndarray, layer) -> np.ndarray:
    """The block's MLP (mlp_residual_stream): X (T, d) -> (T, d). GPT-2's (gelu_mlp), or Llama's
    SwiGLU (swiglu_mlp, the model_of_today lesson) when the layer has a gate, W_gate."""
    if as_instance("layer", layer, LAYERS, LAYER).W_gate is not None:
        return swiglu_mlp(X, layer)
    return gelu_mlp(X, layer)


def layer_norm(X: np.ndarray, gain: np.ndarray, bias: np.ndarray, epsilon: float = 1e-5):
    """LayerNorm (real_model): each row (T, d) to mean 0 and variance 1, then * gain + bias.

    GPT-2 applies one before attention, one before the MLP (pre-LN) and one before the
    unembedding, so that the size of the residual stream, which grows block by block, does
    not reach the products. epsilon keeps the division finite for a constant row.
    """
    X = as_array("X", X, (1, 2, 3))
    gain, bias = as_array("gain", gain, 1, X.shape[-1]), as_array("bias", bias, 1, X.shape[-1])
    epsilon = as_real_number("epsilon", epsilon, positive=True)
    mean = X.mean(axis=-1, keepdims=True)
    variance = ((X - mean) ** 2).mean(axis=-1, keepdims=True)
    return (X - mean) / np.sqrt(variance + epsilon) * gain + bias


def rms_norm(X: np.ndarray, gain: np.ndarray, epsilon: float = 1e-5) -> np.ndarray:
    """RMSNorm (model_of_today; Llama): each row (T, d) divided by its root mean square, then *
    gain. No mean is subtracted and no bias added: LayerNorm without its centring, one
    reduction per row instead of two."""
    X = as_array("X", X, (1, 2, 3))
    gain = as_array("gain", gain, 1, X.shape[-1])
    epsilon = as_real_number("epsilon", epsilon, positive=True)
    # sum / d rather than .mean(): the same number, without numpy's slower mean wrapper,
    # which a decode step of SmolLM2 calls 61 times
    mean_square = (X * X).sum(axis=-1, keepdims=True) * (1.0 / X.shape[-1])
    return X / np.sqrt(mean_square + epsilon) * gain


def normalize(X: np.ndarray, gain: np.ndarray | None, bias: np.ndarray | None,
              epsilon: float = 1e-5) -> np.ndarray:
    """The model's norm: X itself for the toy (no gain), layer_norm for GPT-2 (a gain and a
    bias, the real_model lesson), rms_norm for Llama (a gain alone, the model_of_today lesson)."""
    if gain is None:
        return X
    if bias is None:
        return rms_norm(X, gain, epsilon)
    return layer_norm(X, gain, bias, epsilon)


def decoder_block(
    X: np.ndarray,
    layer,
    n_heads: int,
    mask: np.ndarray | None = None,
    cache=None,
    layer_index: int = 0,
    record_attention: list | None = None,
    *,
    rotary=None,
    norm_epsilon: float = 1e-5,
) -> np.ndarray:
    """One decoder block (mlp_residual_stream): X (T, d) -> X1 (T, d), with X1 = X + block(X).

    Attention, then the MLP, each adding its result to the residual stream. With a cache
    (prefill and kv_cached_decode) this chunk's K and V are appended first and the T queries attend
    over all S cached positions. When a list is given as record_attention, the attention weights
    (h, T, S) are appended to it.

    What real models add changes a line each: GPT-2 normalizes the block's input before
    attention and before the MLP (real_model; the toy has no norms and skips it; Llama's
    norm is RMSNorm, the model_of_today lesson); with rotary positions (positions_and_rope, a
    kvlib.positions.RotaryPositions) q and k are turned before K is cached; with fewer K/V
    heads (grouped_query_attention) K and V are narrower and split into fewer heads than Q; Llama's
    MLP is SwiGLU (model_of_today). The block itself is block_with_attention, the skeleton
    every path shares; what is this one's own is its attention, with the cache and the mask.
    """
    width = as_instance("layer", layer, LayerParams, LAYER).Wq.shape[1]
    n_heads = as_divisor("n_heads", n_heads, width, "query columns")
    rotary, record_attention = as_rotary(rotary), as_list_or_none(record_attention)
    attend = _cached_attention(n_heads, mask, cache, layer_index, record_attention)
    if cache is None or is_trusted():      # the inference loop puts a failed pass back itself
        return block_with_attention(X, layer, attend, rotary=rotary, norm_epsilon=norm_epsilon)
    saved = cache.checkpoint()             # a learner's call that fails (a mask of the wrong
    try:                                   # shape, after the append) leaves the cache as it was
        return block_with_attention(X, layer, attend, rotary=rotary, norm_epsilon=norm_epsilon)
    except BaseException:
        cache.restore(saved)
        raise


def block_with_attention(X: np.ndarray, layer: LayerParams, attend, *, rotary=None,
                         norm_epsilon: float = 1e-5) -> np.ndarray:
    """The decoder block around a given attention (mlp_residual_stream): X (T, d) -> (T, d).

    The one skeleton of every path that runs blocks of K and V: norm -> q, k, v -> rotation
    -> attend -> output projection -> residual -> norm -> MLP -> residual. The paths differ
    only in attend(Q, K, V) -> (T, h x dh), which gets the rows' queries (T, d) and keys and
    values (T, kv x dh), turned already, and returns the merged heads: kvlib.decoder_block
    appends K and V to a cache and attends with a mask (kv_cached_decode); a batch attends each
    row to its own sequence's cache (kvlib.serving.batch, batched_decoding); the engine
    attends over paged blocks in place (kvlib.serving.engine, the_engine). Latent attention
    has no K and V and a block of its own (kvlib.latent_decoder_block).

    It trusts its caller: the doors (decoder_block, the inference loop) checked the inputs.
    """
    Q, K, V = project_qkv(normalize(X, layer.ln_1_gain, layer.ln_1_bias, norm_epsilon), layer)
    if rotary is not None:
        Q, K = rotary.rotate(Q), rotary.rotate(K)
    H = X + output_projection(attend(Q, K, V), layer.Wo, layer.bo)
    return H + mlp(normalize(H, layer.ln_2_gain, layer.ln_2_bias, norm_epsilon), layer)


def _cached_attention(n_heads: int, mask, cache, layer_index: int, record_attention):
    """decoder_block's attend: the chunk's K and V appended to the cache first (when there is
    one), then attention over every position it holds, with the mask -> (T, h x dh)."""
    def attend(Q, K, V):
        layer_mask = mask
        if cache is not None:
            K, V = cache.append(layer_index, K, V)
            layer_mask = cache.mask_for(layer_index, mask)   # an evicting cache's layers differ
        n_kv_heads = K.shape[1] // (Q.shape[1] // n_heads)   # fewer with grouped K/V heads
        weights = attention_weights(split_heads(Q, n_heads), split_heads(K, n_kv_heads),
                                    layer_mask)
        if cache is not None:
            cache.observe(layer_index, weights)   # an evicting cache chooses what to keep here
        if record_attention is not None:
            record_attention.append(weights)
        return merge_heads(weighted_sum(weights, split_heads(V, n_kv_heads)))
    return attend


def unembed(X: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Logits with the tied unembedding (logits_next_token): X (T, d) @ table^T (d, V) -> (T, V)."""
    table = as_matrix("table", table)
    return as_matrix("X", X, table.shape[1]) @ table.T
