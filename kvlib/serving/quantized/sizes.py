"""The bytes a quantized cache holds (quantized_cache): packed codes, float16 scales and
full-precision residual rows, for a whole cache (quantized_cache_bytes) or one position once
its groups are full (bytes_per_token).
"""

from __future__ import annotations

from ...checks import as_count, as_whole_number
from ...config import ModelConfig
from .groupings import _check_grouping


def quantized_cache_bytes(config: ModelConfig, n_positions: int, keys, values,
                          residual_bytes: int | None = None) -> int:
    """Bytes of a QuantizedKVCache after n_positions (quantized_cache): per layer, K's codes,
    scales and residual rows plus V's. residual_bytes (a number of the full-precision
    residual) defaults to the config's dtype; a real engine keeps it in float16 (2)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"quantized_cache_bytes needs a ModelConfig, got {type(config).__name__}")
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    n_positions = as_whole_number("n_positions", n_positions, 0)
    residual_bytes = config.numpy_dtype.itemsize if residual_bytes is None else residual_bytes
    per_layer = (keys.nbytes(n_positions, config.kv_width, residual_bytes)
                 + values.nbytes(n_positions, config.kv_width, residual_bytes))
    return config.n_layers * per_layer


def bytes_per_token(n_layers: int, width: int, keys, values) -> float:
    """Bytes one position adds to a quantized cache once its groups are full (quantized_cache):
    layers x (K's codes and scale share + V's), for rows of width = kv_heads x head_dim."""
    keys, values = _check_grouping("keys", keys), _check_grouping("values", values)
    return as_count("n_layers", n_layers, 1) * (keys.bytes_per_token(width)
                                              + values.bytes_per_token(width))
