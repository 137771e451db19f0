"""Gated DeltaNet, the layer that Qwen3-Next and Qwen3.5 put beside attention, in numpy.

An attention layer keeps every past token's key and value: its cache grows by a row a token.
A gated DeltaNet layer (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025)
keeps one matrix per head instead, a state S of d_k x d_v numbers, and updates it a token at
a time:

    S_t = a_t S_{t-1} + k_t (b_t (v_t - S_{t-1}^T a_t k_t))^T      o_t = S_t^T q_t

(transformers' orientation: S is (d_k, d_v), read with k^T S). The state is decayed by the
gate a_t = exp(g_t) in (0, 1], then read at the key, S^T k, which is what it would return
for k now; the difference between the value and that reading, scaled by the write strength
b_t in (0, 1), is written back at k: the delta rule, which corrects what is stored under k
rather than piling another value on top of it. In the paper's notation this is
S_t = S_{t-1} a_t (I - b_t k_t k_t^T) + b_t v_t k_t^T with S transposed. The state does not
grow with the sequence: a 256-token story and a 100,000-token book cost the same bytes.

Qwen3-Next (transformers' Qwen3NextGatedDeltaNet) wraps the rule in a layer:

    X (T, d) -> in_proj_qkvz, in_proj_ba   q, k (per key head), v, z (per value head), b, a
             -> short causal convolution    over q, k, v (kernel 4, one filter per channel),
                                            then SiLU; its state is the last 3 inputs
             -> gates                       g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
             -> the gated delta rule        q, k L2-normalised, q scaled by d_k^-0.5
             -> gated RMSNorm               rms_norm(o) * weight * silu(z), per value head
             -> out_proj                    (T, d)

and its attention layers are gated too (Qwen3NextAttention): the q projection also yields a
gate, sigmoid(gate) multiplies the attention output before o_proj; q and k get an RMSNorm
per head; rotary positions turn only the first quarter of each head (partial rotary).
Qwen3-Next's RMSNorm multiplies by 1 + weight (its weights are stored centred on 0) except
the gated one inside DeltaNet, which multiplies by weight: offset_rms_norm and
gated_rms_norm here.

Two ways to run the rule, equal up to rounding: recurrent_gated_delta_rule, one token at a
time (what a decode step does), and chunked_gated_delta_rule, transformers' chunked form for
a prompt: within a chunk of C tokens the T sequential updates are rewritten as matrix
products (the "UT transform" of DeltaNet: a unit lower-triangular system solved once per
chunk), and only the chunks are sequential.

Shapes: T tokens, d = d_model; DeltaNet layers have hk query/key heads of d_k and hv value
heads of d_v (hv a multiple of hk: each query/key head serves hv / hk consecutive value
heads, as in Qwen3-Next's 16 and 32), key_dim = hk d_k, value_dim = hv d_v, conv_dim =
2 key_dim + value_dim, K the convolution's kernel; attention layers have h query heads and
kv K/V heads of hd columns. Weights are (in, out), so X @ W, as everywhere in kvlib.

Every function keeps its input's dtype (float32 in, float32 out): constants are Python
floats, see kvlib/model.py. transformers runs both kernels in float32 whatever the model's
dtype; kvlib runs them in the dtype it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .checks import as_array, as_count, as_real_number
from .model import (
    attention_weights,
    causal_mask,
    merge_heads,
    rms_norm,
    silu,
    split_heads,
    weighted_sum,
)
from .positions import RotaryPositions

L2_EPSILON = 1e-6
"""Added to the squared length of q and k before the square root, as transformers' l2norm
(and the flash-linear-attention library it follows) does."""
LAYER_TYPES = ("linear_attention", "full_attention")
"""transformers' names of the two kinds of layer in Qwen3NextConfig.layer_types."""


# ----------------------------------------------------------------------------- input checks

def _float_array(name: str, value, ndim: int, dtype: np.dtype | None = None,
                 like: str = "query") -> np.ndarray:
    """A float32 or float64 array of ndim dimensions (of dtype, that of `like`, if given)."""
    array = as_array(name, value, ndim)
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got dtype {array.dtype}")
    if dtype is not None and array.dtype != dtype:
        raise TypeError(f"{name} is {array.dtype} but {like} is {dtype}: give every input in "
                        "one dtype")
    return array


def _check_kernel_inputs(query, key, value, g, beta, initial_state):
    """The inputs of one sequence, checked and returned as arrays: query, key (T, hk, d_k),
    value (T, hv, d_v), g, beta (T, hv), initial_state None or (hv, d_k, d_v), all of one
    float dtype."""
    query = _float_array("query", query, 3)
    key, value = (_float_array(n, x, 3, query.dtype) for n, x in (("key", key),
                                                                  ("value", value)))
    g, beta = (_float_array(n, x, 2, query.dtype) for n, x in (("g", g), ("beta", beta)))
    T, hk, dk = query.shape
    hv, dv = value.shape[1:]
    if key.shape != query.shape or value.shape[0] != T or T < 1 or hv % hk:
        raise ValueError(f"query {query.shape} and key {key.shape} must be (T, hk, d_k) alike "
                         f"and value {value.shape} (T, hv, d_v) with hv a multiple of hk, T >= 1")
    if g.shape != (T, hv) or beta.shape != (T, hv):
        raise ValueError(f"g {g.shape} and beta {beta.shape} must be (T, hv) = {(T, hv)}")
    if not (g <= 0).all():
        raise ValueError("g must be <= 0 everywhere (it is the log of the decay, a number in "
                         f"(0, 1]), got a largest value of {g.max()!r}")
    if initial_state is not None:
        initial_state = _float_array("initial_state", initial_state, 3, query.dtype)
        if initial_state.shape != (hv, dk, dv):
            raise ValueError(f"initial_state must be (hv, d_k, d_v) = {(hv, dk, dv)}, got "
                             f"{initial_state.shape}")
    return query, key, value, g, beta, initial_state


# ----------------------------------------------------------------------------- the delta rule

def l2_normalize(x: np.ndarray, epsilon: float = L2_EPSILON) -> np.ndarray:
    """Each row to length 1: x / sqrt(|x|^2 + epsilon). (..., n) -> (..., n)."""
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + epsilon)


def prepare_queries_and_keys(query: np.ndarray, key: np.ndarray, n_value_heads: int):
    """q and k as the rule uses them: L2-normalised, q scaled by d_k^-0.5, and each of the hk
    heads repeated for the hv / hk value heads it serves. (T, hk, d_k) -> (T, hv, d_k) each.

    Normalised keys keep the state bounded: with |k| = 1 and 0 < beta < 1, the write
    (I - beta k k^T) never stretches what is stored.
    """
    repeats = n_value_heads // query.shape[1]
    scale = 1.0 / math.sqrt(query.shape[-1])
    return (np.repeat(l2_normalize(query) * scale, repeats, axis=1),
            np.repeat(l2_normalize(key), repeats, axis=1))


def gated_delta_step(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     g: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token through the rule, every head at once: decay the state, read it at k, write
    the delta, read it at q.

    state (hv, d_k, d_v); q, k (hv, d_k) prepared (prepare_queries_and_keys); v (hv, d_v);
    g, beta (hv,) -> (output (hv, d_v), new state (hv, d_k, d_v)). The state given is not
    changed.
    """
    state = state * np.exp(g)[:, None, None]
    stored = (k[:, None, :] @ state)[:, 0]                  # S^T k: what k retrieves now
    delta = (v - stored) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]       # + k delta^T
    return (q[:, None, :] @ state)[:, 0], state


def _zero_state(value: np.ndarray, d_k: int) -> np.ndarray:
    return np.zeros((value.shape[1], d_k, value.shape[2]), dtype=value.dtype)


def _recurrent(query, key, value, g, beta, initial_state):
    q, k = prepare_queries_and_keys(query, key, value.shape[1])
    state = _zero_state(value, q.shape[-1]) if initial_state is None else initial_state
    output = np.empty_like(value)
    for t in range(len(value)):
        output[t], state = gated_delta_step(state, q[t], k[t], value[t], g[t], beta[t])
    return output, state


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None):
    """The gated delta rule one token at a time (transformers' torch_recurrent_gated_delta_rule
    with use_qk_l2norm_in_kernel=True, for one sequence).

    query, key (T, hk, d_k); value (T, hv, d_v); g (T, hv), the log of each step's decay
    (<= 0); beta (T, hv), the write strength; initial_state None (zeros) or (hv, d_k, d_v),
    the state after the tokens before these. -> (output (T, hv, d_v), final state (hv, d_k,
    d_v)), which continues the sequence when given back as initial_state.
    """
    return _recurrent(*_check_kernel_inputs(query, key, value, g, beta, initial_state))


def unit_lower_inverse(lower: np.ndarray) -> np.ndarray:
    """(I + L)^-1 for strictly lower-triangular L: (..., C, C) -> (..., C, C).

    Forward substitution, a row at a time: (I + L) X = I gives X[i] = e_i - L[i, :i] X[:i],
    and X is unit lower-triangular too. transformers asks torch.linalg.solve_triangular for
    the same (its export path builds this inverse the same way); numpy has no triangular
    solver.
    """
    C = lower.shape[-1]
    inverse = np.zeros_like(lower)
    inverse[..., np.arange(C), np.arange(C)] = 1.0
    for i in range(1, C):
        inverse[..., i, :i] = -(lower[..., i:i + 1, :i] @ inverse[..., :i, :i])[..., 0, :]
    return inverse


def _in_chunks(x: np.ndarray, chunk_size: int) -> np.ndarray:
    """(T, hv, ...) -> (hv, n, C, ...): heads first, the sequence padded with zeros to n
    chunks of C (a padded token has k = v = 0, beta = 0 and g = 0: it changes nothing)."""
    x = np.moveaxis(x, 0, 1)
    padding = -x.shape[1] % chunk_size
    x = np.pad(x, [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])


def _chunked(query, key, value, g, beta, initial_state, chunk_size):
    T, hv, dv = value.shape
    q, k = prepare_queries_and_keys(query, key, hv)
    q, k, v = (_in_chunks(x, chunk_size) for x in (q, k, value))     # (hv, n, C, d)
    g, beta = _in_chunks(g, chunk_size), _in_chunks(beta, chunk_size)[..., None]
    k_beta, v_beta = k * beta, v * beta
    decay = np.cumsum(g, axis=-1)                # log of the decay from the chunk's start
    # decay from token j to token i of a chunk, for j <= i; the rest masked before exp,
    # where it would overflow
    causal = np.tri(chunk_size, dtype=bool)
    between = np.exp(np.where(causal, decay[..., :, None] - decay[..., None, :], -np.inf))
    # the UT transform: the chunk's sequential writes as one unit lower-triangular system
    inverse = unit_lower_inverse(np.tril((k_beta @ k.swapaxes(-1, -2)) * between, -1))
    new_values = inverse @ v_beta                                # what to write, before the
    reads_of_state = inverse @ (k_beta * np.exp(decay)[..., None])  # state's part is removed
    within = (q @ k.swapaxes(-1, -2)) * between                  # attention inside the chunk
    q_from_start = q * np.exp(decay)[..., None]
    k_to_end = k * np.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = np.exp(decay[..., -1])[..., None, None]        # (hv, n, 1, 1)
    state = _zero_state(value, q.shape[-1]) if initial_state is None else initial_state
    output = np.empty_like(v)
    for c in range(q.shape[1]):
        correction = new_values[:, c] - reads_of_state[:, c] @ state   # the delta
        output[:, c] = q_from_start[:, c] @ state + within[:, c] @ correction
        state = state * chunk_decay[:, c] + k_to_end[:, c].swapaxes(-1, -2) @ correction
    return np.moveaxis(output.reshape(hv, -1, dv)[:, :T], 0, 1), state


def chunked_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                             chunk_size: int = 64):
    """The gated delta rule for a whole prompt, chunk_size tokens at a time (transformers'
    torch_chunk_gated_delta_rule with use_qk_l2norm_in_kernel=True, for one sequence).

    Same arguments and result as recurrent_gated_delta_rule, and the same numbers up to
    rounding. Within a chunk every token's output and the state's update are matrix
    products; only the chunks follow one another, so a prompt of T tokens takes T /
    chunk_size sequential steps instead of T. T need not be a multiple of chunk_size.
    """
    return _chunked(*_check_kernel_inputs(query, key, value, g, beta, initial_state),
                    as_count("chunk_size", chunk_size, 1))


# ----------------------------------------------------------------------------- small pieces

def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), from exp(-|x|) so that it never overflows. Any shape."""
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), and x itself above 20 as torch's softplus (its threshold). Any shape."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def offset_rms_norm(X: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """Qwen3-Next's RMSNorm (Qwen3NextRMSNorm): rms_norm with the gain 1 + weight.
    (..., n), weight (n,) -> (..., n).

    Its weights are stored centred on 0 (initialised to zeros), as Gemma's are: a weight of
    0 leaves the normalised row as it is. Multiplying by weight alone would silence it.
    """
    return rms_norm(X, 1.0 + weight, epsilon)


def gated_rms_norm(X: np.ndarray, gate: np.ndarray, weight: np.ndarray,
                   epsilon: float) -> np.ndarray:
    """DeltaNet's output norm (Qwen3NextRMSNormGated): rms_norm(X) * weight * silu(gate).
    X, gate (..., d_v), weight (d_v,) -> (..., d_v). Here the gain is weight itself
    (initialised to ones), not 1 + weight."""
    return rms_norm(X, weight, epsilon) * silu(gate)


def swiglu(X: np.ndarray, W_gate: np.ndarray, W_up: np.ndarray,
           W_down: np.ndarray) -> np.ndarray:
    """The dense MLP (Qwen3NextMLP): silu(X @ W_gate) * (X @ W_up) @ W_down. (T, d) -> (T, d)."""
    return (silu(X @ W_gate) * (X @ W_up)) @ W_down


# ----------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class HybridConfig:
    """The sizes of a Qwen3-Next-style hybrid model with dense MLPs (kvlib's stories-hybrid:
    4 layers, three DeltaNet then one attention).

    layer_types: one of LAYER_TYPES per layer. Attention layers: n_heads query heads and
    n_kv_heads K/V heads of head_dim; rotary_dim of each head's columns are turned (the
    first ones: transformers' partial rotary), rope_base. DeltaNet layers: linear_key_heads
    (hk) heads of linear_key_dim (d_k) for q and k, linear_value_heads (hv) of
    linear_value_dim (d_v) for v, conv_kernel. norm_epsilon: every RMSNorm's.
    """

    vocab_size: int
    d_model: int
    layer_types: tuple[str, ...]
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_base: float
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    norm_epsilon: float
    context_length: int
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.layer_types, tuple) or not self.layer_types or \
                any(kind not in LAYER_TYPES for kind in self.layer_types):
            raise ValueError(f"layer_types must be a non-empty tuple of {LAYER_TYPES}, got "
                             f"{self.layer_types!r}")
        for f in fields(self):
            if f.type == "int":
                as_count(f.name, getattr(self, f.name), 1)
        as_real_number("norm_epsilon", self.norm_epsilon, positive=True)
        as_real_number("rope_base", self.rope_base, positive=True)
        if self.n_heads % self.n_kv_heads or self.linear_value_heads % self.linear_key_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads and linear_value_heads "
                             "a multiple of linear_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and at most head_dim {self.head_dim}, "
                             f"got {self.rotary_dim}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the ones with a KV cache)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        """Indices of the DeltaNet layers (the ones with a fixed-size state)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_key_heads * self.linear_key_dim

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_value_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)


# ----------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class DeltaNetLayerParams:
    """A block whose token mixer is gated DeltaNet (transformers' names in brackets).

    input_norm, post_norm (d,) [input_layernorm, post_attention_layernorm: gain 1 + w];
    in_proj_qkvz (d, 2 key_dim + 2 value_dim), in_proj_ba (d, 2 hv): their columns grouped
    by key head (split_qkvz); conv_weight (conv_dim, K) [conv1d.weight (conv_dim, 1, K)];
    A_log, dt_bias (hv,); out_norm (d_v,) [norm: gain w]; out_proj (value_dim, d);
    W_gate, W_up (d, f), W_down (f, d) [mlp.gate_proj, up_proj, down_proj].
    """

    input_norm: np.ndarray
    in_proj_qkvz: np.ndarray
    in_proj_ba: np.ndarray
    conv_weight: np.ndarray
    A_log: np.ndarray
    dt_bias: np.ndarray
    out_norm: np.ndarray
    out_proj: np.ndarray
    post_norm: np.ndarray
    W_gate: np.ndarray
    W_up: np.ndarray
    W_down: np.ndarray

    @staticmethod
    def expected_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
        d, f, hv = config.d_model, config.d_ff, config.linear_value_heads
        return {"input_norm": (d,), "in_proj_qkvz": (d, 2 * config.key_dim + 2 * config.value_dim),
                "in_proj_ba": (d, 2 * hv), "conv_weight": (config.conv_dim, config.conv_kernel),
                "A_log": (hv,), "dt_bias": (hv,), "out_norm": (config.linear_value_dim,),
                "out_proj": (config.value_dim, d), "post_norm": (d,), "W_gate": (d, f),
                "W_up": (d, f), "W_down": (f, d)}


@dataclass(frozen=True)
class GatedAttentionLayerParams:
    """A block whose token mixer is Qwen3-Next's gated attention.

    input_norm, post_norm (d,); Wq (d, h 2 hd): per head hd query columns then hd gate
    columns [q_proj]; Wk, Wv (d, kv hd); Wo (h hd, d) [o_proj]; q_norm, k_norm (hd,) (gain
    1 + w); W_gate, W_up (d, f), W_down (f, d).
    """

    input_norm: np.ndarray
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_norm: np.ndarray
    W_gate: np.ndarray
    W_up: np.ndarray
    W_down: np.ndarray

    @staticmethod
    def expected_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
        d, f, hd = config.d_model, config.d_ff, config.head_dim
        kv_width = config.n_kv_heads * hd
        return {"input_norm": (d,), "Wq": (d, 2 * config.n_heads * hd), "Wk": (d, kv_width),
                "Wv": (d, kv_width), "Wo": (config.n_heads * hd, d), "q_norm": (hd,),
                "k_norm": (hd,), "post_norm": (d,), "W_gate": (d, f), "W_up": (d, f),
                "W_down": (f, d)}


LAYER_PARAMS = {"linear_attention": DeltaNetLayerParams,
                "full_attention": GatedAttentionLayerParams}


@dataclass(frozen=True)
class HybridParams:
    """A whole hybrid model: embedding (V, d), tied to the unembedding; layers, one
    DeltaNetLayerParams or GatedAttentionLayerParams each, as config.layer_types says;
    final_norm (d,) (gain 1 + w)."""

    config: HybridConfig
    embedding: np.ndarray
    layers: tuple
    final_norm: np.ndarray

    def __post_init__(self):
        config = self.config
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        if len(self.layers) != config.n_layers:
            raise ValueError(f"config.layer_types names {config.n_layers} layers, got "
                             f"{len(self.layers)}")
        wanted = {"embedding": (config.vocab_size, config.d_model),
                  "final_norm": (config.d_model,)}
        for name, shape in wanted.items():
            _check_weight(name, getattr(self, name), shape, config)
        for i, (kind, layer) in enumerate(zip(config.layer_types, self.layers)):
            if not isinstance(layer, LAYER_PARAMS[kind]):
                raise TypeError(f"layer {i} is a {kind} layer: it needs "
                                f"{LAYER_PARAMS[kind].__name__}, got {type(layer).__name__}")
            for name, shape in layer.expected_shapes(config).items():
                _check_weight(f"layer {i} {name}", getattr(layer, name), shape, config)


def _check_weight(name: str, array, shape: tuple[int, ...], config: HybridConfig) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != config.numpy_dtype \
            or array.shape != shape:
        raise ValueError(f"{name} must be a {config.dtype} array of shape {shape}, got "
                         f"{getattr(array, 'dtype', type(array).__name__)} "
                         f"{getattr(array, 'shape', '')}")


# ----------------------------------------------------------------------------- a DeltaNet layer

def _check_mixer_inputs(X, layer, kind: type, config: HybridConfig) -> None:
    """X (T, d) in the config's dtype, T >= 1, and a layer of the kind the mixer runs."""
    if not isinstance(config, HybridConfig) or not isinstance(layer, kind):
        raise TypeError(f"need a HybridConfig and a {kind.__name__}, got "
                        f"{type(config).__name__} and {type(layer).__name__}")
    X = _float_array("X", X, 2, config.numpy_dtype, "the model (config.dtype)")
    if X.shape[0] < 1 or X.shape[1] != config.d_model:
        raise ValueError(f"X must be (T, d_model) = (T, {config.d_model}) with T >= 1, got "
                         f"{X.shape}")


@dataclass(frozen=True, eq=False)      # eq=False: two states are the same object or not
class DeltaNetState:
    """What a DeltaNet layer carries from one token to the next, whatever the length.

    conv: (K - 1, conv_dim), the last K - 1 inputs of the short convolution (zeros before
    the first token); recurrent: (hv, d_k, d_v), the delta rule's state. transformers keeps
    K inputs for the convolution (its conv_states are (batch, conv_dim, K)); the oldest of
    them is never used.
    """

    conv: np.ndarray
    recurrent: np.ndarray

    @staticmethod
    def zeros(config: HybridConfig) -> DeltaNetState:
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        shape = (config.linear_value_heads, config.linear_key_dim, config.linear_value_dim)
        return DeltaNetState(np.zeros((config.conv_kernel - 1, config.conv_dim),
                                      dtype=config.numpy_dtype),
                             np.zeros(shape, dtype=config.numpy_dtype))

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


def split_qkvz(mixed_qkvz: np.ndarray, mixed_ba: np.ndarray, config: HybridConfig):
    """Cut the two input projections into q, k, v, z, b, a (transformers'
    fix_query_key_value_ordering).

    mixed_qkvz (T, 2 key_dim + 2 value_dim) = X @ in_proj_qkvz, mixed_ba (T, 2 hv). The
    columns are grouped by key head, not by kind: for each of the hk key heads, d_k of q,
    d_k of k, then (hv / hk) d_v of v and as many of z; and for b and a, hv / hk each.
    -> q, k (T, hk, d_k); v, z (T, hv, d_v); b, a (T, hv).
    """
    T = len(mixed_qkvz)
    hk, dk, dv = config.linear_key_heads, config.linear_key_dim, config.linear_value_dim
    served = config.linear_value_heads // hk           # value heads per key head
    groups = mixed_qkvz.reshape(T, hk, 2 * dk + 2 * served * dv)
    q, k, v, z = np.split(groups, np.cumsum([dk, dk, served * dv]), axis=-1)
    b, a = np.split(mixed_ba.reshape(T, hk, 2 * served), 2, axis=-1)
    return (q, k, v.reshape(T, -1, dv), z.reshape(T, -1, dv), b.reshape(T, -1),
            a.reshape(T, -1))


def causal_conv(inputs: np.ndarray, weight: np.ndarray,
                past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The short causal convolution, one filter per channel (transformers' depthwise conv1d
    with padding K - 1, no bias; the activation comes after).

    inputs (T, C), weight (C, K), past (K - 1, C): the inputs just before these (zeros at
    the start). Output t = sum_j weight[:, j] * x[t - K + 1 + j]: the current input meets
    the last tap. -> (outputs (T, C), the new past: the last K - 1 inputs).
    """
    K = weight.shape[1]
    window = np.concatenate([past, inputs])           # (K - 1 + T, C)
    T = len(inputs)
    outputs = sum(window[j:j + T] * weight[:, j] for j in range(K))
    return outputs, window[len(window) - (K - 1):]


def gates(a: np.ndarray, b: np.ndarray, A_log: np.ndarray,
          dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decay and the write strength of each token and value head (Mamba-2's gate).

    a, b (T, hv); A_log, dt_bias (hv,) -> g = -exp(A_log) softplus(a + dt_bias) (T, hv),
    the log of the decay (<= 0; a head with a large A forgets fast), and beta = sigmoid(b)
    (T, hv), in (0, 1).
    """
    return -np.exp(A_log) * softplus(a + dt_bias), sigmoid(b)


def deltanet_mixer(X: np.ndarray, layer: DeltaNetLayerParams, config: HybridConfig,
                   state: DeltaNetState) -> tuple[np.ndarray, DeltaNetState]:
    """A DeltaNet layer's token mixer (Qwen3NextGatedDeltaNet.forward, one sequence):
    X (T, d), already normalised, and the state after the tokens before -> (Y (T, d), the
    state after these). The state given is not changed.

    One token goes through the recurrent form (a decode step, as in transformers), more
    through the chunked form (transformers also uses it for one token without a cache: the
    same numbers up to rounding).
    """
    _check_mixer_inputs(X, layer, DeltaNetLayerParams, config)
    if not isinstance(state, DeltaNetState):
        raise TypeError(f"state must be a DeltaNetState, got {type(state).__name__}")
    T = len(X)
    dk, dv = config.linear_key_dim, config.linear_value_dim
    q, k, v, z, b, a = split_qkvz(X @ layer.in_proj_qkvz, X @ layer.in_proj_ba, config)
    mixed = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1)
    mixed, conv_state = causal_conv(mixed, layer.conv_weight, state.conv)
    q, k, v = np.split(silu(mixed), [config.key_dim, 2 * config.key_dim], axis=1)
    q, k, v = q.reshape(T, -1, dk), k.reshape(T, -1, dk), v.reshape(T, -1, dv)
    g, beta = gates(a, b, layer.A_log, layer.dt_bias)
    if T == 1:
        out, recurrent = _recurrent(q, k, v, g, beta, state.recurrent)
    else:
        out, recurrent = _chunked(q, k, v, g, beta, state.recurrent, 64)
    out = gated_rms_norm(out, z, layer.out_norm, config.norm_epsilon).reshape(T, -1)
    return out @ layer.out_proj, DeltaNetState(conv_state, recurrent)


# ----------------------------------------------------------------------------- gated attention

def split_query_and_gate(QG: np.ndarray, n_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's q projection holds, per head, hd query columns then hd gate columns.
    QG (T, h 2 hd) -> (Q (T, h, hd), gate (T, h hd))."""
    T = len(QG)
    Q, gate = np.split(QG.reshape(T, n_heads, -1), 2, axis=-1)
    return Q, gate.reshape(T, -1)


def rotate_partial(X: np.ndarray, rotary: RotaryPositions) -> np.ndarray:
    """Rotary positions on the first rotary.dim columns of every head, the rest passed
    through (transformers' partial_rotary_factor; Qwen3-Next turns a quarter).
    X (T, n, hd) -> (T, n, hd). rotary pairs column i with i + dim / 2 ("half")."""
    T, n, _ = X.shape
    dim = rotary.dim
    turned = rotary.rotate(np.ascontiguousarray(X[..., :dim]).reshape(T, n * dim))
    return np.concatenate([turned.reshape(T, n, dim), X[..., dim:]], axis=-1)


def gated_attention_mixer(X: np.ndarray, layer: GatedAttentionLayerParams,
                          config: HybridConfig, rotary: RotaryPositions,
                          kv_cache=None, slot: int = 0) -> np.ndarray:
    """A gated attention layer's token mixer (Qwen3NextAttention.forward, one sequence):
    X (T, d), already normalised -> (T, d).

    q and k are normalised per head (RMSNorm, gain 1 + w), then turned (partial rotary);
    with a kv_cache (a kvlib KVCache) K and V are appended to its layer `slot` and the T
    queries attend to every cached position; the attention output is multiplied by
    sigmoid(gate), column by column, before o_proj: each head can shut its output.
    """
    _check_mixer_inputs(X, layer, GatedAttentionLayerParams, config)
    T, eps, hd = len(X), config.norm_epsilon, config.head_dim
    Q, gate = split_query_and_gate(X @ layer.Wq, config.n_heads)
    Q = rotate_partial(offset_rms_norm(Q, layer.q_norm, eps), rotary)
    K = offset_rms_norm((X @ layer.Wk).reshape(T, -1, hd), layer.k_norm, eps)
    K, V = rotate_partial(K, rotary).reshape(T, -1), X @ layer.Wv
    if kv_cache is not None:
        K, V = kv_cache.append(slot, K, V)
    mask = None if T == 1 else causal_mask(T, len(K))
    weights = attention_weights(Q.transpose(1, 0, 2), split_heads(K, config.n_kv_heads), mask)
    heads = weighted_sum(weights, split_heads(V, config.n_kv_heads))
    return (merge_heads(heads) * sigmoid(gate)) @ layer.Wo
