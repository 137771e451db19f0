"""The model's weights (big_picture): seeded, shape-checked, and carrying their config.

The toy has six matrices a block (Wq, Wk, Wv, Wo, W_up, W_down) and the lookup table. What a
config adds brings its own arrays (real_model for GPT-2's): biases (bq ... b_down), layer
norms (ln_1 before attention, ln_2 before the MLP, ln_f before the unembedding; a gain and a
bias each) and a learned position table. Grouped-query attention narrows Wk and Wv (notebook
14); latent attention has blocks of another kind, LatentLayerParams (latent_attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from .checks import as_config, as_instance, as_weights, as_whole_number
from .config import ModelConfig

DEFAULT_SEED = 1302
"""Seed of the article's example model; see init_params for how it was chosen."""


def _present_arrays(obj) -> dict[str, np.ndarray]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if f.name != "config" and isinstance(getattr(obj, f.name), np.ndarray)}


@dataclass(frozen=True)
class LayerParams:
    """One decoder block's weights (MHA or GQA).

    Wq (d, d), Wk and Wv (d, kv_width), Wo (d, d), W_up (d, f), W_down (f, d), where
    kv_width = n_kv_heads x head_dim (= d for multi-head attention). With config.bias: bq (d,),
    bk and bv (kv_width,), bo (d,), b_up (f,), b_down (d,). With config.norm == "layer":
    ln_1_gain, ln_1_bias, ln_2_gain, ln_2_bias, (d,) each; with "rms" the two gains only.
    With config.mlp == "swiglu": W_gate (d, f). Absent parts are None.
    """

    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wo: np.ndarray
    W_up: np.ndarray
    W_down: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None
    ln_1_gain: np.ndarray | None = None
    ln_1_bias: np.ndarray | None = None
    ln_2_gain: np.ndarray | None = None
    ln_2_bias: np.ndarray | None = None
    W_gate: np.ndarray | None = None

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every array this config needs in a block, with its shape."""
        d, f, kv = config.d_model, config.d_ff, config.kv_width
        shapes = {"Wq": (d, d), "Wk": (d, kv), "Wv": (d, kv), "Wo": (d, d)}
        shapes |= _mlp_shapes(config)
        if config.bias:
            shapes |= {"bq": (d,), "bk": (kv,), "bv": (kv,), "bo": (d,), "b_up": (f,),
                       "b_down": (d,)}
        return shapes | _norm_shapes(config, "ln_1", "ln_2")

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays this block holds, by name (absent parts left out)."""
        return _present_arrays(self)


@dataclass(frozen=True)
class LatentLayerParams:
    """One block of multi-head latent attention (latent_attention; DeepSeek-V2's MLA).

    Queries: Wq (d, d), and with rotary positions Wq_rope (d, h x dr). Keys and values are
    compressed into one latent per token, W_down_kv (d, dc), and rebuilt per head from it,
    W_up_k and W_up_v (dc, d); with rotary positions a small shared rotary key is computed
    apart, Wk_rope (d, dr). Then Wo (d, d) and the MLP, W_up (d, f) and W_down (f, d), and
    with config.norm == "layer" the norms ln_1/ln_2 as in LayerParams. dc = latent_dim,
    dr = rope_head_dim.
    """

    Wq: np.ndarray
    W_down_kv: np.ndarray
    W_up_k: np.ndarray
    W_up_v: np.ndarray
    Wo: np.ndarray
    W_up: np.ndarray
    W_down: np.ndarray
    Wq_rope: np.ndarray | None = None
    Wk_rope: np.ndarray | None = None
    ln_1_gain: np.ndarray | None = None
    ln_1_bias: np.ndarray | None = None
    ln_2_gain: np.ndarray | None = None
    ln_2_bias: np.ndarray | None = None
    W_gate: np.ndarray | None = None

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        d, dc, dr = config.d_model, config.latent_dim, config.rope_head_dim
        shapes = {"Wq": (d, d), "W_down_kv": (d, dc), "W_up_k": (dc, d), "W_up_v": (dc, d),
                  "Wo": (d, d)} | _mlp_shapes(config)
        if dr:
            shapes |= {"Wq_rope": (d, config.n_heads * dr), "Wk_rope": (d, dr)}
        return shapes | _norm_shapes(config, "ln_1", "ln_2")

    def arrays(self) -> dict[str, np.ndarray]:
        return _present_arrays(self)


def _mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """GPT-2's MLP: W_up and W_down; SwiGLU adds the gate W_gate
    (Llama, the model_of_today lesson)."""
    d, f = config.d_model, config.d_ff
    shapes = {"W_up": (d, f), "W_down": (f, d)}
    return shapes | {"W_gate": (d, f)} if config.mlp == "swiglu" else shapes


def _norm_shapes(config: ModelConfig, *names: str) -> dict[str, tuple[int]]:
    """LayerNorm has a gain and a bias, RMSNorm a gain only (model_of_today)."""
    parts = {"none": (), "layer": ("gain", "bias"), "rms": ("gain",)}[config.norm]
    return {f"{name}_{part}": (config.d_model,) for name in names for part in parts}


def layer_class(config: ModelConfig) -> type:
    """LatentLayerParams for latent attention, LayerParams otherwise."""
    return LatentLayerParams if config.latent_dim is not None else LayerParams


@dataclass(frozen=True)
class Params:
    """All weights: the lookup table (V, d), shared with the unembedding, one block's params
    per layer, and what the config adds: a learned position table (context_length, d) and
    the final norm ln_f (d,) x 2. Creating one checks every shape and dtype against the
    config, and that nothing the config does not use is given."""

    config: ModelConfig
    embedding: np.ndarray
    layers: tuple
    position_table: np.ndarray | None = None
    ln_f_gain: np.ndarray | None = None
    ln_f_bias: np.ndarray | None = None

    def __post_init__(self):
        config = as_config(self.config)
        layers = tuple(as_instance("layers", self.layers, (list, tuple), "the blocks' weights"))
        object.__setattr__(self, "layers", layers)
        if len(layers) != config.n_layers:
            raise ValueError(f"expected {config.n_layers} layers (config.n_layers), got "
                             f"{len(layers)}")
        as_weights("", _fields(self), self.expected_shapes(config), config)
        kind = layer_class(config)
        for index, layer in enumerate(layers):
            as_weights(f"layer {index} ", _fields(as_instance(f"layer {index}", layer, kind)),
                       kind.expected_shapes(config), config)

    @staticmethod
    def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The arrays outside the blocks that this config needs, with their shapes."""
        shapes = {"embedding": (config.vocab_size, config.d_model)}
        if config.positions == "learned":
            shapes["position_table"] = (config.context_length, config.d_model)
        return shapes | _norm_shapes(config, "ln_f")

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays outside the blocks, by name (absent parts left out)."""
        return _present_arrays(self)

    @property
    def n_parameters(self) -> int:
        """Number of weights, counting the tied table once."""
        return sum(a.size for a in self.arrays().values()) + sum(
            a.size for layer in self.layers for a in layer.arrays().values())

    def with_config(self, **changes) -> Params:
        """The same weights under a config with some fields changed, for example a sliding
        window on a model trained without one (sliding_windows_and_sinks). Changes that would need
        other weights (sizes, heads, positions) are refused by the shape checks."""
        return Params(self.config.replace(**changes), self.embedding, self.layers,
                      self.position_table, self.ln_f_gain, self.ln_f_bias)

    def first_layers(self, n_layers: int) -> Params:
        """The model cut after its first n_layers blocks (quantized_cache and speculative_decoding):
        the same embedding, blocks 0 .. n_layers - 1, the final norm and the (tied) unembedding. An
        early exit: its cache holds exactly the first n_layers layers of the whole model's,
        and its logits are what the unembedding reads from the stream at that depth (a
        self-speculative draft). The arrays are shared, not copied."""
        n_layers = as_whole_number("n_layers", n_layers, 1, self.config.n_layers)
        return Params(self.config.replace(n_layers=n_layers), self.embedding,
                      self.layers[:n_layers], self.position_table, self.ln_f_gain,
                      self.ln_f_bias)


def _fields(obj) -> dict:
    """Every weight field of a block or of Params, by name: arrays, or None where absent."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if f.name not in ("config", "layers")}


def init_params(config: ModelConfig | None = None, seed: int = DEFAULT_SEED) -> Params:
    """Random weights from a seeded generator: the same seed gives the same model.

    The lookup table is drawn from N(0, 1); every other matrix from N(0, 1 / fan_in), so that
    a product keeps roughly the size of its input, and the two that write into the residual
    stream (Wo, W_down) are further scaled by 1 / sqrt(n_layers), so that the stream does
    not grow with depth.

    The default seed, 1302, was chosen by trying seeds 0, 1, 2, ... on the article's example
    (the default config and the prompt "How are you?", ids BOS 3 7 1 9) and keeping the first
    whose greedy continuation starts with token 5 ("I"), as in the article, then 2 ("am"),
    and whose first 8 new tokens use at least three different words and never BOS
    (untrained weights with a tied unembedding tend to repeat one word);
    ``tests/test_worked_example.py`` checks this.
    The weights are untrained: the model computes exactly like a real one, but its words
    carry no meaning.

    What other configs add (biases, norms, positions) is drawn from a second generator
    seeded by (seed, 1), so that the toy's numbers never change: biases and norm biases from
    N(0, 0.1^2), norm gains from 1 + N(0, 0.1^2), a learned position table from N(0, 0.5^2).
    Trained models start from zero biases and unit gains; random ones here make the tests
    notice a bias or a norm applied in the wrong place.
    """
    config = ModelConfig() if config is None else as_config(config)
    seed = as_whole_number("seed", seed)
    rng = np.random.default_rng(seed)
    extra = np.random.default_rng([int(seed), 1])
    dtype = config.numpy_dtype
    residual_scale = 1.0 / math.sqrt(config.n_layers)

    def normal(shape, std, generator=rng):
        return (generator.standard_normal(shape, dtype=dtype) * std).astype(dtype, copy=False)

    kind = layer_class(config)
    layers = []
    for _ in range(config.n_layers):
        matrices = {}
        for name, shape in kind.expected_shapes(config).items():
            if len(shape) == 2:
                scale = residual_scale if name in ("Wo", "W_down") else 1.0
                matrices[name] = normal(shape, scale / math.sqrt(shape[0]))
        layers.append(matrices)
    embedding = normal((config.vocab_size, config.d_model), 1.0)

    for matrices in layers:
        for name, shape in kind.expected_shapes(config).items():
            if len(shape) == 1:
                offset = 1.0 if name.endswith("_gain") else 0.0
                matrices[name] = (offset + normal(shape, 0.1, extra)).astype(dtype)
    outside = {}
    for name, shape in Params.expected_shapes(config).items():
        if name == "position_table":
            outside[name] = normal(shape, 0.5, extra)
        elif name != "embedding":
            outside[name] = (float(name.endswith("_gain")) + normal(shape, 0.1, extra)
                             ).astype(dtype)
    return Params(config=config, embedding=embedding,
                  layers=tuple(kind(**matrices) for matrices in layers), **outside)
