"""The model's sizes (notebook 00): one frozen object that every other part reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUPPORTED_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder-only model.

    The defaults are the worked example of the source article: a vocabulary of 12 tokens,
    d_model = c = 4, 2 heads of size 2, an MLP 4 -> 8 -> 4, 3 decoder blocks, and an
    unembedding tied to the lookup table. Realistic sizes work too, for example GPT-2 small:
    ``ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
    context_length=1024, dtype="float32")``.
    """

    vocab_size: int = 12
    d_model: int = 4
    n_heads: int = 2
    n_layers: int = 3
    d_ff: int = 8
    context_length: int = 32
    dtype: str = "float64"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"ModelConfig.{name} must be a whole number, got {value!r}")
            if value < 1:
                raise ValueError(f"ModelConfig.{name} must be at least 1, got {value}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), "
                "so that every head gets the same number of columns"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        """Columns per head: d_model // n_heads (2 in the article's example)."""
        return self.d_model // self.n_heads

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)


GPT2_SMALL = ModelConfig(
    vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
    context_length=1024, dtype="float32",
)
"""GPT-2 small's shapes (Radford et al. 2019), used by notebook 09 and the benchmark."""
