"""The model's sizes and architecture (big_picture): one frozen object that every other part
reads.

The defaults are the article's toy. The other options add, one at a time, what real models
have: what GPT-2 adds (real_model: learned positions, layer norms, biases), rotary positions
(positions_and_rope), fewer K/V heads (grouped_query_attention), a latent K/V (latent_attention), a
sliding window with attention sinks (sliding_windows_and_sinks) and what Llama changes from GPT-2
(model_of_today: RMSNorm, the SwiGLU MLP, and which columns the rotation pairs). Impossible
combinations are refused with the rule they break.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .checks import as_flag, as_one_of, as_real_number, as_whole_number

SUPPORTED_DTYPES = ("float32", "float64")
POSITION_SCHEMES = ("none", "learned", "rotary")
NORMS = ("none", "layer", "rms")
MLPS = ("gelu", "swiglu")
ROPE_PAIRINGS = ("interleaved", "half")


WHOLE_NUMBERS = {"vocab_size": 1, "d_model": 1, "n_heads": 1, "n_layers": 1, "d_ff": 1,
                 "context_length": 1, "n_kv_heads": 1, "latent_dim": 1, "rope_head_dim": 0,
                 "window": 1, "sink_tokens": 0}
"""The fields that are whole numbers, with their least value; None is allowed for those whose
default is None (n_kv_heads, latent_dim, window)."""
CHOICES = {"dtype": SUPPORTED_DTYPES, "positions": POSITION_SCHEMES, "norm": NORMS,
           "mlp": MLPS, "rope_pairing": ROPE_PAIRINGS}


def attention_kind(n_heads: int, n_kv_heads: int, latent_dim: int | None = None) -> str:
    """'MHA' (a K/V head for every query head), 'GQA' (groups of query heads share one),
    'MQA' (one K/V head for all) or 'MLA' (latent attention: a latent instead of K and V)."""
    if latent_dim is not None:
        return "MLA"
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else "GQA"


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder-only model, and which parts of a real architecture it has.

    The defaults are the worked example of the source article: a vocabulary of 12 tokens,
    d_model = c = 4, 2 heads of size 2, an MLP 4 -> 8 -> 4, 3 decoder blocks, an unembedding
    tied to the lookup table, and nothing else: no positions, no layer norms, no biases.
    Realistic sizes work too, for example GPT-2 small's shapes: ``ModelConfig(
    vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072, context_length=1024,
    dtype="float32")``, and its whole architecture with ``positions="learned", norm="layer",
    bias=True`` (kvlib.gpt2.GPT2_124M).

    positions: "none" (the toy), "learned" (GPT-2: a table of context_length rows added to
        the embeddings) or "rotary" (RoPE: q and k rotated by an angle set by the position).
    norm: "none", "layer" (LayerNorm before attention, before the MLP and before the
        unembedding: GPT-2's pre-LN) or "rms" (RMSNorm in the same places, a gain and no
        bias: Llama). norm_epsilon is added to the variance (the mean square for RMSNorm).
    bias: whether every projection adds a bias (GPT-2 does).
    mlp: "gelu" (GPT-2: up, tanh GeLU, down) or "swiglu" (Llama: a gate and an up projection,
        silu(gate) * up, then down; one more (d, d_ff) matrix).
    n_kv_heads: None (as many K/V heads as query heads: multi-head attention) or a divisor of
        n_heads: grouped-query attention, or multi-query with 1. Only K/V heads are cached.
    rope_base: the base of the rotary angles (10000 in RoPE's paper and Llama 2).
    rope_pairing: which columns of a head the rotation turns together: "interleaved"
        (x[2i], x[2i+1]: RoPE's paper, GPT-J, llama.cpp and GGUF files) or "half" (x[i],
        x[i + dh/2]: transformers' rotate_half and the hub's safetensors). The same rotation
        with the columns in another order; weights written for one give another model under
        the other (model_of_today).
    latent_dim: None, or the width of the latent that multi-head latent attention caches
        instead of K and V (DeepSeek-V2's d_c). rope_head_dim is then the width of its
        decoupled rotary key (needs positions="rotary"; 0 for none).
    window: None (every query sees every earlier position) or W: each query sees the last W
        positions, itself included (Mistral's sliding window). sink_tokens: with a window, the
        first few positions stay visible to every query (StreamingLLM's attention sinks).
    """

    vocab_size: int = 12
    d_model: int = 4
    n_heads: int = 2
    n_layers: int = 3
    d_ff: int = 8
    context_length: int = 32
    dtype: str = "float64"
    positions: str = "none"
    norm: str = "none"
    bias: bool = False
    norm_epsilon: float = 1e-5
    mlp: str = "gelu"
    n_kv_heads: int | None = None
    rope_base: float = 10000.0
    rope_pairing: str = "interleaved"
    latent_dim: int | None = None
    rope_head_dim: int = 0
    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self):
        for name, minimum in WHOLE_NUMBERS.items():   # Python ints: numpy's overflow products
            value = getattr(self, name)
            if value is not None or self.__dataclass_fields__[name].default is not None:
                object.__setattr__(self, name, as_whole_number(f"ModelConfig.{name}", value,
                                                               minimum))
        for name, allowed in CHOICES.items():
            as_one_of(name, getattr(self, name), allowed)
        as_flag("ModelConfig.bias", self.bias)
        for name in ("norm_epsilon", "rope_base"):
            as_real_number(f"ModelConfig.{name}", getattr(self, name), positive=True)
        self._check_heads()
        self._check_latent()
        self._check_window()

    def _check_heads(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads}), so that every head gets the same number of "
                             "columns")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads}): each K/V head serves an equal group of query "
                             "heads")
        if self.positions == "rotary" and self.latent_dim is None and self.head_dim % 2:
            raise ValueError(f"rotary positions turn pairs of columns: the head size "
                             f"({self.head_dim}) must be even")

    def _check_latent(self) -> None:
        if self.latent_dim is None:
            if self.rope_head_dim:
                raise ValueError("rope_head_dim is the decoupled rotary part of latent "
                                 "attention: give latent_dim too, or leave it 0")
            return
        if self.n_kv_heads is not None:
            raise ValueError("latent attention caches one latent for all heads: leave "
                             "n_kv_heads as None")
        if self.bias:
            raise ValueError("kvlib's latent attention has no biases: use bias=False")
        if self.positions == "rotary" and self.rope_head_dim == 0:
            raise ValueError("with rotary positions, latent attention needs rope_head_dim > 0: "
                             "the rotation cannot be applied to keys rebuilt from the latent "
                             "(notebook 16), so the keys get a small decoupled rotary part")
        if self.positions != "rotary" and self.rope_head_dim:
            raise ValueError("rope_head_dim > 0 needs positions='rotary'")
        if self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim must be even (rotary positions turn pairs of "
                             f"columns), got {self.rope_head_dim}")

    def _check_window(self) -> None:
        if self.window is None:
            if self.sink_tokens:
                raise ValueError("sink_tokens keep the first positions visible beside a "
                                 "sliding window: give a window too, or leave it 0")
            return
        if self.sink_tokens + self.window > self.context_length:
            raise ValueError(f"the window and the sinks ({self.window} + {self.sink_tokens}) "
                             f"cannot exceed the context length ({self.context_length})")
        if self.latent_dim is not None:
            raise ValueError("kvlib does not combine a sliding window with latent attention")

    @property
    def head_dim(self) -> int:
        """Columns per query head: d_model // n_heads (2 in the article's example)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of K/V heads: n_kv_heads, or n_heads for multi-head attention."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kv_width(self) -> int:
        """Width of one cached row of K (and of V): kv_heads x head_dim (d_model for MHA)."""
        return self.kv_heads * self.head_dim

    @property
    def attention_kind(self) -> str:
        """'MHA', 'GQA', 'MQA' or 'MLA' (latent)."""
        return attention_kind(self.n_heads, self.kv_heads, self.latent_dim)

    def held_positions(self, n_positions: int) -> int:
        """How many of n_positions the cache of this model holds (sliding_windows_and_sinks): all of
        them, or with a sliding window the first sink_tokens and the last W."""
        if self.window is None:
            return n_positions
        sinks = min(n_positions, self.sink_tokens)
        return sinks + max(0, n_positions - max(self.sink_tokens, n_positions - self.window))

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (and checked again)."""
        return dataclasses.replace(self, **changes)


GPT2_SMALL = ModelConfig(
    vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
    context_length=1024, dtype="float32",
)
"""GPT-2 small's shapes (Radford et al. 2019) on the toy's architecture (no positions, norms
or biases), used by the counting_the_work and where_time_goes lessons and the benchmark. GPT-2
itself is kvlib.gpt2.GPT2_124M."""


def _gpt2_shapes(n_layers: int, d_model: int, n_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=50257, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                       d_ff=4 * d_model, context_length=1024, dtype="float32")


GPT2_LONG = dataclasses.replace(GPT2_SMALL, context_length=32768)
"""GPT-2 small's shapes with a context stretched to 32,768 positions: a hypothetical model
(GPT-2 has 1024) that shows where attention's cost overtakes the rest (counting_the_work)."""

MODEL_SIZES = {
    "the article's toy (3 layers, d 4)": ModelConfig(dtype="float32"),
    "GPT-2 small (12 layers, d 768)": GPT2_SMALL,
    "GPT-2 medium (24 layers, d 1024)": _gpt2_shapes(24, 1024, 16),
    "GPT-2 large (36 layers, d 1280)": _gpt2_shapes(36, 1280, 20),
    "GPT-2 XL (48 layers, d 1600)": _gpt2_shapes(48, 1600, 25),
    "GPT-2 small's shapes, 32k context (hypothetical)": GPT2_LONG,
}
"""Model sizes whose cost the lessons count and time (counting_the_work, where_time_goes).
GPT-2's layers and widths are those of Radford et al. 2019 (table 2) and its published
config.json files; the FLOPs do not depend on the head count."""

