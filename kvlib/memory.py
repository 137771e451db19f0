"""How much memory the KV cache takes (notebook 10)."""

from __future__ import annotations

from numbers import Integral

GiB = 2**30
MiB = 2**20


def kv_cache_bytes(n_layers: int, d_model: int | None, seq_len: int, batch_size: int = 1,
                   dtype_bytes: int = 2, *, n_kv_heads: int | None = None,
                   head_dim: int | None = None) -> int:
    """Bytes of a KV cache: 2 (K and V) x batch x seq_len x width x dtype_bytes x n_layers.

    The width of the cached rows is d_model for multi-head attention. Models with fewer K/V
    heads than query heads (multi-query, grouped-query attention) cache n_kv_heads x head_dim
    instead: give both, and d_model may be None.

    >>> kv_cache_bytes(n_layers=80, d_model=8192, seq_len=4096) / GiB   # BF16, batch 1
    10.0
    """
    if (n_kv_heads is None) != (head_dim is None):
        raise ValueError("give both n_kv_heads and head_dim, or neither")
    width = d_model if n_kv_heads is None else n_kv_heads * head_dim
    if width is None:
        raise ValueError("give d_model, or n_kv_heads and head_dim")
    named = {"n_layers": n_layers, "width of a cached row": width, "seq_len": seq_len,
             "batch_size": batch_size, "dtype_bytes": dtype_bytes}
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return 2 * batch_size * seq_len * width * dtype_bytes * n_layers
