"""Gemma 3 in numpy: a decoder whose layers mix sliding-window and global attention, and a
cache that keeps only what each kind of layer can still read.

What a Gemma 3 block adds to Llama's (kvlib.model), each a small function named after the
piece of transformers' Gemma3 modelling code it mirrors:

- the embedding is multiplied by sqrt(hidden_size) (`embed`, Gemma3TextScaledWordEmbedding);
- every RMSNorm multiplies by the file's weight, 1 + w (`rms_norm`, Gemma3RMSNorm), and
  there are four a block: before and after attention, before and after the MLP, each "after"
  applied to the branch before it joins the residual stream (`decoder_layer`);
- q and k get an RMSNorm of their own on each head, before the rotation (`qk_norm`, the
  attention's q_norm and k_norm);
- the rotation pairs column i with column i + head_dim / 2 (`apply_rotary_pos_emb`, with
  kvlib.positions.rotate_halves), at base rope_local_base_freq (10,000) in sliding layers and
  rope_theta (1,000,000) in global ones;
- scores are scaled by query_pre_attn_scalar^-1/2 (`attention`);
- a sliding layer's query sees only the sliding_window positions ending at itself
  (`attention_mask_for`, kvlib.model.attention_mask with a window);
- the MLP is GeGLU: gelu_tanh(X W_gate) * (X W_up), then W_down (`mlp`, Gemma3MLP);
- the unembedding is the token table, after a final RMSNorm (`unembed_logits`).

Shapes: T tokens in the chunk, S positions attended over, d = hidden_size, h query heads,
kv K/V heads, dh = head_dim, f = intermediate_size, V = vocab_size.

The cache (`Gemma3Cache`): a sliding layer can never read a position more than
sliding_window - 1 behind the newest query, so it keeps a ring of sliding_window rows
(position p in slot p % sliding_window); a global layer keeps every position. Gemma 3 270M
(15 sliding layers, 3 global, one K/V head of 256) holds (3 T + 15 min(T, 512)) positions'
K and V after T tokens: 1,024 bytes a position and a layer in float16, 2,048 in float32,
which is what this cache stores for the float32 model. prefill and decode_step through it
give the logits of `forward`, which recomputes everything with the windowed mask.

Every function keeps its input's dtype: constants are Python floats or cast to the
activations' dtype (numpy 2 would otherwise turn float32 into float64, notebook 00).
"""

from __future__ import annotations

import math
from numbers import Integral

import numpy as np

from .checkpoints.gemma3 import Gemma3Config, Gemma3LayerParams, Gemma3Params
from .checks import as_count, as_flag, as_rows, as_whole_number, contains_bool
from .eviction import EvictingLayer, as_policy, merged
from .inference import choose_next_token
from .model import attention_mask, gelu, rms_norm, softmax, weighted_sum
from .model import embed as lookup
from .positions import RotaryPositions


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form (transformers' "gelu_pytorch_tanh"): kvlib.model.gelu."""
    return gelu(x)


def embed(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Gemma3TextScaledWordEmbedding: rows of the table (V, d) times sqrt(d), the scale in
    the table's dtype (transformers rounds it so: sqrt(640) as a float32) -> X (T, d)."""
    X = lookup(ids, table)
    return X * X.dtype.type(math.sqrt(table.shape[1]))


def qk_norm(X: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """q_norm / k_norm: RMSNorm of each head on its own: X (T, n x dh), weight (dh,) ->
    (T, n x dh)."""
    T, width = X.shape
    heads = X.reshape(T, width // weight.shape[0], weight.shape[0])
    return rms_norm(heads, weight, epsilon).reshape(T, width)


def apply_rotary_pos_emb(X: np.ndarray, rotary: RotaryPositions) -> np.ndarray:
    """Rotate-half rotary positions on q or k: (T, n x dh) -> (T, n x dh); rotary holds the
    chunk's positions and the layer type's base (kvlib.positions.RotaryPositions, pairing
    "half": column i turns with column i + dh / 2, as transformers' rotate_half)."""
    return rotary.rotate(X)


def rotary_for(config: Gemma3Config, positions: np.ndarray) -> dict[str, RotaryPositions]:
    """The rotation of a chunk for each layer type: base rope_local_base_freq for
    "sliding_attention", rope_theta for "full_attention" (Gemma3RotaryEmbedding)."""
    return {"sliding_attention": RotaryPositions(positions, config.head_dim,
                                                 config.rope_local_base_freq, "half"),
            "full_attention": RotaryPositions(positions, config.head_dim, config.rope_theta,
                                              "half")}


def attention_mask_for(config: Gemma3Config, layer_index: int, query_positions,
                       key_positions) -> np.ndarray:
    """bool (T, S), True where a query may read a key: causal, and in a sliding layer only
    the sliding_window positions ending at the query (transformers'
    create_sliding_window_causal_mask: kv_idx > q_idx - sliding_window)."""
    window = config.sliding_window if config.is_sliding(layer_index) else None
    return attention_mask(query_positions, key_positions, window)


def attention_weights(Q: np.ndarray, K: np.ndarray, mask: np.ndarray,
                      scaling: float) -> np.ndarray:
    """Scaled, masked, softmaxed scores over grouped K/V heads: Q (h, T, dh), K (kv, S, dh),
    mask (T, S) -> weights (h, T, S). Query head i reads K/V head i // (h / kv)."""
    h, T, dh = Q.shape
    groups = Q.reshape(K.shape[0], h // K.shape[0], T, dh)          # (kv, h/kv, T, dh)
    scores = ((groups @ K[:, None].swapaxes(-1, -2)) * scaling).reshape(h, T, K.shape[1])
    return softmax(np.where(mask, scores, -np.inf))


def attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray,
              scaling: float) -> np.ndarray:
    """Scaled dot-product attention over grouped K/V heads: Q (h, T, dh), K and V (kv, S,
    dh), mask (T, S) -> (h, T, dh)."""
    return weighted_sum(attention_weights(Q, K, mask, scaling), V)


def project_qkv(X: np.ndarray, layer: Gemma3LayerParams, config: Gemma3Config,
                rotary: RotaryPositions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gemma3Attention's projections: X (T, d), normalized -> Q (T, h x dh), K and V (T, kv x
    dh); q and k normalized per head, then rotated (V is neither)."""
    eps = config.rms_norm_eps
    Q = apply_rotary_pos_emb(qk_norm(X @ layer.Wq, layer.q_norm, eps), rotary)
    K = apply_rotary_pos_emb(qk_norm(X @ layer.Wk, layer.k_norm, eps), rotary)
    return Q, K, X @ layer.Wv


def heads_of(rows: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Rows of heads side by side (S, n x dh) -> (n, S, dh)."""
    return rows.reshape(len(rows), n_heads, head_dim).transpose(1, 0, 2)


def attend_rows(Q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray,
                config: Gemma3Config) -> np.ndarray:
    """attention on rows: Q (T, h x dh), keys and values (S, kv x dh), mask (T, S) -> the
    heads side by side (T, h x dh), before W_o."""
    return attend_rows_weighing(Q, keys, values, mask, config)[0]


def attend_rows_weighing(Q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray,
                         config: Gemma3Config) -> tuple[np.ndarray, np.ndarray]:
    """attend_rows, and the weights it paid: -> (T, h x dh), weights (h, T, S)."""
    h, kv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    weights = attention_weights(heads_of(Q, h, dh), heads_of(keys, kv, dh), mask,
                                config.query_pre_attn_scalar ** -0.5)
    heads = weighted_sum(weights, heads_of(values, kv, dh))
    return heads.transpose(1, 0, 2).reshape(len(Q), h * dh), weights


def self_attn(X: np.ndarray, layer: Gemma3LayerParams, config: Gemma3Config, layer_index: int,
              positions: np.ndarray, rotary: RotaryPositions, cache=None) -> np.ndarray:
    """Gemma3Attention: X (T, d), normalized, at positions (T,) -> (T, d), before the
    post-attention norm. q and k are normalized per head, then rotated; K and V go to the
    cache (if any), which returns every row this layer may read and their positions, and
    hears the weights (an evicting layer chooses what to keep from them)."""
    Q, K, V = project_qkv(X, layer, config, rotary)
    if cache is None:
        mask = attention_mask_for(config, layer_index, positions, positions)
        return attend_rows(Q, K, V, mask, config) @ layer.Wo
    keys, values, key_positions = cache.update(layer_index, K, V)
    mask = attention_mask_for(config, layer_index, positions, key_positions)
    attended, weights = attend_rows_weighing(Q, keys, values, mask, config)
    cache.observe(layer_index, weights)
    return attended @ layer.Wo


def mlp(X: np.ndarray, layer: Gemma3LayerParams) -> np.ndarray:
    """Gemma3MLP, GeGLU: gelu_tanh(X @ W_gate) * (X @ W_up) @ W_down: (T, d) -> (T, d)."""
    return (gelu_tanh(X @ layer.W_gate) * (X @ layer.W_up)) @ layer.W_down


def decoder_layer(X: np.ndarray, layer: Gemma3LayerParams, config: Gemma3Config,
                  layer_index: int, positions: np.ndarray, rotary: RotaryPositions,
                  cache=None) -> np.ndarray:
    """Gemma3DecoderLayer: X (T, d) -> (T, d). Each branch is normalized before and after,
    then added to the residual stream."""
    return decoder_layer_around(X, layer, config, lambda normalized: self_attn(
        normalized, layer, config, layer_index, positions, rotary, cache))


def decoder_layer_around(X: np.ndarray, layer: Gemma3LayerParams, config: Gemma3Config,
                         self_attention) -> np.ndarray:
    """decoder_layer with its attention given: self_attention(normalized X (T, d)) -> (T, d)
    before the post-attention norm (self_attn over a cache; the engine's over its blocks)."""
    eps = config.rms_norm_eps
    attended = self_attention(rms_norm(X, layer.input_layernorm, eps))
    H = X + rms_norm(attended, layer.post_attention_layernorm, eps)
    mixed = mlp(rms_norm(H, layer.pre_feedforward_layernorm, eps), layer)
    return H + rms_norm(mixed, layer.post_feedforward_layernorm, eps)


def unembed_logits(params: Gemma3Params, X: np.ndarray) -> np.ndarray:
    """The final norm, then the tied unembedding: X (T, d) @ table^T -> logits (T, V)."""
    return rms_norm(X, params.norm, params.config.rms_norm_eps) @ params.embedding.T


def run_layers(params: Gemma3Params, ids: np.ndarray, positions: np.ndarray,
               cache=None) -> np.ndarray:
    """Every block on the chunk ids (T,) at positions (T,) -> the last hidden states (T, d)."""
    config = params.config
    rotary = rotary_for(config, positions)
    X = embed(ids, params.embedding)
    for index, layer in enumerate(params.layers):
        X = decoder_layer(X, layer, config, index, positions, rotary[config.layer_types[index]],
                          cache)
    return X


# ---------------------------------------------------------------------- the cache

def _checked_rows(K, V, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's K and V at the door of a layer's cache: (T, width) each, T >= 1."""
    K = as_rows("K", K, width)
    return K, as_rows("V", V, width, len(K))


class RingCacheLayer:
    """A sliding layer's cache: a ring of `window` rows of K and of V (kv_width each); the
    row of position p sits in slot p % window, over position p - window, which no query from
    p on can read (it sees p - window + 1 .. p). Never grows."""

    def __init__(self, window: int, width: int, dtype):
        self.window = window
        self.ring_keys = np.zeros((window, width), dtype=dtype)
        self.ring_values = np.zeros((window, width), dtype=dtype)
        self.ring_positions = np.full(window, -1)                  # -1: an empty slot
        self.length = 0

    def update(self, K: np.ndarray, V: np.ndarray):
        """Append a chunk's K and V (T, kv_width) -> (keys, values, key_positions): the rows
        held before the chunk and the chunk's, which its queries read through the sliding
        mask; then keep only the last `window` positions."""
        K, V = _checked_rows(K, V, self.ring_keys.shape[1])
        T, held = K.shape[0], self.ring_positions >= 0
        new_positions = np.arange(self.length, self.length + T)
        keys = np.concatenate([self.ring_keys[held], K])
        values = np.concatenate([self.ring_values[held], V])
        key_positions = np.concatenate([self.ring_positions[held], new_positions])
        kept = slice(max(0, T - self.window), T)                   # the chunk's last window
        slots = new_positions[kept] % self.window
        self.ring_keys[slots], self.ring_values[slots] = K[kept], V[kept]
        self.ring_positions[slots] = new_positions[kept]
        self.length += T
        return keys, values, key_positions

    def observe(self, weights: np.ndarray) -> None:
        """A ring keeps its window whatever attention paid."""

    def held(self):
        """(keys, values, positions) of the rows held, in position order."""
        order = np.argsort(self.ring_positions)[np.sort(self.ring_positions) >= 0]
        return self.ring_keys[order], self.ring_values[order], self.ring_positions[order]

    @property
    def n_held(self) -> int:
        return min(self.length, self.window)


class FullCacheLayer:
    """A global layer's cache: K and V of every position, in a buffer of `capacity` rows
    made once (np.zeros: the operating system gives memory to the rows as they are written)."""

    def __init__(self, capacity: int, width: int, dtype):
        self.all_keys = np.zeros((capacity, width), dtype=dtype)
        self.all_values = np.zeros((capacity, width), dtype=dtype)
        self.length = 0

    def update(self, K: np.ndarray, V: np.ndarray):
        """Append a chunk's K and V (T, kv_width) -> views of every row held (S, kv_width),
        and their positions 0 .. S - 1."""
        K, V = _checked_rows(K, V, self.all_keys.shape[1])
        start, end = self.length, self.length + K.shape[0]
        if end > len(self.all_keys):
            raise ValueError(f"this layer holds {start} of {len(self.all_keys)} positions and "
                             f"cannot take {K.shape[0]} more")
        self.all_keys[start:end], self.all_values[start:end] = K, V
        self.length = end
        return self.all_keys[:end], self.all_values[:end], np.arange(end)

    def observe(self, weights: np.ndarray) -> None:
        """A full layer keeps every position whatever attention paid."""

    def held(self):
        return self.all_keys[:self.length], self.all_values[:self.length], np.arange(self.length)

    @property
    def n_held(self) -> int:
        return self.length


class Gemma3Cache:
    """The KV cache of a Gemma 3 model: a RingCacheLayer for each sliding layer, a
    FullCacheLayer for each global one, in the config's dtype.

    capacity: how many positions the global layers can hold (default: the context length,
    max_position_embeddings); the sliding layers hold sliding_window whatever the length.
    ``len(cache)`` is the number of positions seen (the next token's position); ``nbytes`` the
    bytes of the K and V rows held: 2 x kv_width x itemsize x (global layers x T + sliding
    layers x min(T, sliding_window)).
    """

    def __init__(self, config: Gemma3Config, capacity: int | None = None):
        if not isinstance(config, Gemma3Config):
            raise TypeError(f"Gemma3Cache needs a Gemma3Config, got {type(config).__name__}")
        capacity = config.max_position_embeddings if capacity is None else capacity
        self.capacity = as_count("capacity", capacity, 1)
        self.config = config
        self.layers = [RingCacheLayer(config.sliding_window, config.kv_width, config.dtype)
                       if config.is_sliding(i) else
                       FullCacheLayer(self.capacity, config.kv_width, config.dtype)
                       for i in range(config.num_hidden_layers)]

    def __len__(self) -> int:
        lengths = {layer.length for layer in self.layers}
        if len(lengths) > 1:
            raise ValueError(f"the layers of this cache hold different numbers of positions "
                             f"{sorted(lengths)}: a pass stopped half-way; prefill again into "
                             "a fresh cache")
        return lengths.pop()

    def __repr__(self) -> str:
        sliding = sum(self.config.is_sliding(i) for i in range(len(self.layers)))
        return (f"Gemma3Cache({len(self)} positions seen; {sliding} sliding layers holding "
                f"{self.layers[0].n_held if sliding else 0} of "
                f"{self.config.sliding_window}, {len(self.layers) - sliding} global)")

    def _layer(self, layer):
        return self.layers[as_whole_number("layer", layer, 0, len(self.layers) - 1)]

    def update(self, layer: int, K: np.ndarray, V: np.ndarray):
        """Append a chunk's K and V (T, kv_width) to a layer -> (keys, values,
        key_positions) that the chunk's queries read (transformers' Cache.update)."""
        return self._layer(layer).update(K, V)

    def observe(self, layer: int, weights: np.ndarray) -> None:
        """What a layer's attention paid to the rows update returned, weights (h, T, S)."""
        self._layer(layer).observe(weights)

    def keys(self, layer: int) -> np.ndarray:
        """The keys a layer holds, in position order: (held, kv_width)."""
        return self._layer(layer).held()[0]

    def values(self, layer: int) -> np.ndarray:
        return self._layer(layer).held()[1]

    def key_positions(self, layer: int) -> np.ndarray:
        """The positions of the rows a layer holds, in order: (held,)."""
        return self._layer(layer).held()[2]

    @property
    def nbytes(self) -> int:
        itemsize = self.config.numpy_dtype.itemsize
        return sum(2 * layer.n_held * self.config.kv_width * itemsize for layer in self.layers)


class EvictingCacheLayer:
    """A global layer that keeps at most `budget` positions, chosen by a kvlib.eviction
    policy after each pass (keeping_what_attention_reads): kvlib.eviction.EvictingLayer behind
    this module's layer interface. Its positions are one row: one K/V head (Gemma 3 270M), or
    a policy that keeps one set for every head."""

    def __init__(self, budget: int, policy, config: Gemma3Config):
        self.rows = EvictingLayer(budget, policy, config.num_key_value_heads, config.head_dim,
                                  config.numpy_dtype)
        self.width = config.kv_width

    @property
    def length(self) -> int:
        return self.rows.length

    @property
    def n_held(self) -> int:
        return self.rows.n_held

    def update(self, K: np.ndarray, V: np.ndarray):
        """Append a chunk's K and V (T, kv_width) -> (keys, values, key_positions) of the rows
        held and the chunk's; the policy chooses after the pass (observe)."""
        K, V = _checked_rows(K, V, self.width)
        keys, values = self.rows.append(K, V)
        return keys, values, self.rows.positions[0]

    def observe(self, weights: np.ndarray) -> None:
        self.rows.observe(weights)

    def held(self):
        return merged(self.rows.keys), merged(self.rows.values), self.rows.positions[0]


def evicting_cache(config: Gemma3Config, budget, policy="tova") -> Gemma3Cache:
    """A Gemma3Cache whose sliding layers keep their ring and whose global layers keep at most
    `budget` positions each, chosen by the policy (keeping_what_attention_reads): the only
    layers of Gemma 3 whose cache grows are the ones that evict."""
    cache = Gemma3Cache(config)
    policy = as_policy(policy)
    budget = as_whole_number("budget", budget, 1)
    policy.check(budget)
    if config.num_key_value_heads > 1 and policy.name in ("h2o", "snapkv"):
        raise ValueError(f"{policy.name} keeps positions per K/V head, and this model has "
                         f"{config.num_key_value_heads}: a Gemma 3 layer reads one row of "
                         "positions; use window, sinks or tova")
    cache.layers = [layer if config.is_sliding(index) else
                    EvictingCacheLayer(budget, policy, config)
                    for index, layer in enumerate(cache.layers)]
    return cache


# ---------------------------------------------------------------------- running the model

def check_ids(ids, config: Gemma3Config, what: str = "prompt") -> np.ndarray:
    """Token ids: a non-empty flat sequence of integers in [0, vocab_size) -> int array (T,)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"the {what} must be token ids, got the text {ids!r}: encode it first")
    if contains_bool(ids):
        raise TypeError(f"token ids must be integers, not True or False: got {ids!r}")
    try:
        array = np.asarray(ids)
    except ValueError:
        raise ValueError(f"the {what} must be a flat sequence of token ids") from None
    array = array.reshape(1) if array.ndim == 0 else array
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise ValueError(f"the {what} must be a non-empty flat sequence of integer token ids, "
                         f"got {array.dtype} of shape {array.shape}")
    if array.min() < 0 or array.max() >= config.vocab_size:
        raise ValueError(f"token ids must be between 0 and {config.vocab_size - 1}, got "
                         f"{array.min()} .. {array.max()}")
    return array.astype(np.intp, copy=False)


def _check_params(params) -> Gemma3Config:
    if not isinstance(params, Gemma3Params):
        raise TypeError(f"params must be Gemma3Params (kvlib.checkpoints.gemma3.load_gemma3), "
                        f"got {type(params).__name__}")
    return params.config


def _check_cache(cache, config: Gemma3Config) -> int:
    if not isinstance(cache, Gemma3Cache):
        raise TypeError(f"cache must be a Gemma3Cache, got {type(cache).__name__}")
    if cache.config != config:
        raise ValueError("this cache was made for another model's config")
    return len(cache)


def forward(params: Gemma3Params, ids, *, last_only: bool = False) -> np.ndarray:
    """Full recomputation, no cache: ids (T,) -> logits (T, V), or (1, V) with last_only.
    Every sliding layer reads through the windowed mask, every global layer through the
    causal one."""
    config = _check_params(params)
    ids, last_only = check_ids(ids, config), as_flag("last_only", last_only)
    if len(ids) > config.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens are more than the context length "
                         f"{config.max_position_embeddings}")
    X = run_layers(params, ids, np.arange(len(ids)))
    return unembed_logits(params, X[-1:] if last_only else X)


def prefill(params: Gemma3Params, ids, cache: Gemma3Cache | None = None, *,
            last_only: bool = False) -> tuple[np.ndarray, Gemma3Cache]:
    """A chunk of the prompt in one pass, into the cache: ids (T,) -> (logits (T, V), or
    (1, V) with last_only, and the cache holding T more positions). A cache that holds P
    positions already is continued: the chunk sits at P .. P + T - 1. Without a cache, a
    fresh Gemma3Cache is made."""
    config = _check_params(params)
    ids, last_only = check_ids(ids, config), as_flag("last_only", last_only)
    cache = Gemma3Cache(config) if cache is None else cache
    past = _check_cache(cache, config)
    if past + len(ids) > cache.capacity:
        raise ValueError(f"the cache holds {past} positions and cannot take {len(ids)} more "
                         f"(capacity {cache.capacity})")
    X = run_layers(params, ids, np.arange(past, past + len(ids)), cache)
    return unembed_logits(params, X[-1:] if last_only else X), cache


def decode_step(params: Gemma3Params, token, cache: Gemma3Cache) -> np.ndarray:
    """One new token at position len(cache) against the cache -> logits (1, V)."""
    config = _check_params(params)
    ids = check_ids(token, config, what="token")
    if len(ids) != 1:
        raise ValueError(f"decode_step takes one token id, got {len(ids)}; use prefill")
    past = _check_cache(cache, config)
    if past == 0:
        raise ValueError("decode_step needs a cache that holds the prompt: run prefill first")
    if past >= cache.capacity:
        raise ValueError(f"the cache is full ({past} of {cache.capacity} positions)")
    X = run_layers(params, ids, np.arange(past, past + 1), cache)
    return unembed_logits(params, X)


def generate(params: Gemma3Params, ids, max_new_tokens: int) -> list[int]:
    """Greedy generation through the cache: prompt ids (P,) -> max_new_tokens new ids."""
    config = _check_params(params)
    ids = check_ids(ids, config)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens - 1 > config.max_position_embeddings:
        raise ValueError(f"{len(ids)} prompt tokens and {max_new_tokens} new ones need more "
                         f"positions than the context length {config.max_position_embeddings}")
    logits, cache = prefill(params, ids, Gemma3Cache(config, len(ids) + max_new_tokens),
                            last_only=True)
    new = []
    while True:
        new.append(choose_next_token(logits[-1]))
        if len(new) == max_new_tokens:
            return new
        logits = decode_step(params, new[-1], cache)


# ---------------------------------------------------------------------- random weights

def init_gemma3_params(config: Gemma3Config, seed: int = 0) -> Gemma3Params:
    """Random weights of a Gemma 3 architecture (for tests and small experiments): matrices
    normal with standard deviation 1 / sqrt(inputs), the table's rows of size about 1, norm
    weights 1 + 0.2 x normal (away from 1, so that a norm left out shows)."""
    if not isinstance(config, Gemma3Config):
        raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
    rng = np.random.default_rng(as_count("seed", seed))
    dtype = config.numpy_dtype

    def draw(shape):
        if len(shape) == 1:
            return (1.0 + 0.2 * rng.standard_normal(shape)).astype(dtype)
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(dtype)

    shapes = Gemma3LayerParams.expected_shapes(config)
    layers = tuple(Gemma3LayerParams(**{name: draw(shape) for name, shape in shapes.items()})
                   for _ in range(config.num_hidden_layers))
    table = rng.standard_normal((config.vocab_size, config.hidden_size)) / math.sqrt(
        config.hidden_size)
    return Gemma3Params(config, table.astype(dtype), layers, draw((config.hidden_size,)))


__all__ = ["FullCacheLayer", "Gemma3Cache", "RingCacheLayer", "apply_rotary_pos_emb",
           "attend_rows", "attention", "attention_mask_for", "check_ids", "decode_step",
           "decoder_layer", "decoder_layer_around", "embed", "forward", "gelu_tanh",
           "generate", "init_gemma3_params", "mlp", "prefill", "project_qkv", "qk_norm",
           "rotary_for", "run_layers", "self_attn", "unembed_logits"]
