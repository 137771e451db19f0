"""The quantized cache (quantized_cache): QuantizedKVCache stores K and V with a grouping each,
and kvlib.prefill and kvlib.decode_step run on it unchanged.
"""

from __future__ import annotations

import numpy as np

from ...cache import BaseKVCache
from ...config import ModelConfig
from .groupings import PerChannel, PerToken, _check_grouping, _check_quantizable

DEFAULT_KEYS, DEFAULT_VALUES = PerChannel(8), PerToken(8)
"""KIVI's axes at 8 bits: keys per channel in groups of 32, values per token."""


class QuantizedKVCache(BaseKVCache):
    """A contiguous cache whose K and V are stored in a few bits (quantized_cache).

    keys and values are groupings, chosen separately: PerToken(bits, residual) or
    PerChannel(bits, group_size, residual). The default is KIVI's axes at 8 bits, keys per
    channel in groups of 32, values per token, with no residual beyond the keys' incomplete
    group (KIVI also keeps the newest R rows of each in full precision: pass residual=R to
    both). append quantizes the new rows and returns what attention reads: every held row,
    dequantized (the new ones too). ``nbytes`` is the bytes really held: packed codes,
    float16 scales, and the full-precision residual rows.
    ``key_store`` and ``value_store`` hold them (a PerTokenStore or a PerChannelStore:
    ``codes``, ``scales`` and ``residual``).
    """

    def __init__(self, config: ModelConfig, keys: PerToken | PerChannel = DEFAULT_KEYS,
                 values: PerToken | PerChannel = DEFAULT_VALUES, capacity: int | None = None):
        super().__init__(config)
        if config.latent_dim is not None or config.window is not None:
            raise ValueError("kvlib's quantized cache holds K and V of full attention: use a "
                             "config without a latent or a window")
        self.key_grouping = _check_grouping("keys", keys)
        self.value_grouping = _check_grouping("values", values)
        self.capacity = capacity = self._check_capacity(capacity)
        self.width = config.kv_width
        shape = (config.n_layers, capacity, self.width, config.numpy_dtype)
        self.key_store = keys.store(*shape)
        self.value_store = values.store(*shape)

    def _describe(self) -> str:
        n = self._lengths[0]
        return (f"QuantizedKVCache({n} of {self.capacity} positions, {self.config.n_layers} "
                f"layers; K {self.key_grouping.name}, V {self.value_grouping.name}; "
                f"{self.nbytes:,} bytes)")

    def keys(self, layer: int) -> np.ndarray:
        """The layer's keys, dequantized: (T, kv_width) in the model's dtype, a new array."""
        layer = self._check_layer(layer)
        return self.key_store.read(layer, self._lengths[layer])

    def values(self, layer: int) -> np.ndarray:
        """The layer's values, dequantized: (T, kv_width), a new array."""
        layer = self._check_layer(layer)
        return self.value_store.read(layer, self._lengths[layer])

    def append(self, layer: int, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Quantize new rows K, V (n_new, kv_width) after the layer's last position; return
        every held row, dequantized: (T + n_new, kv_width) each. Rows that cannot be
        quantized (NaN, too large) are refused before anything is stored."""
        layer = self._check_layer(layer)
        self._check_rows("K", K, self.width)
        self._check_rows("V", V, self.width, K.shape[0])
        self._check_room(layer, K.shape[0])
        _check_quantizable(K, "K", self.key_grouping.bits)
        _check_quantizable(V, "V", self.value_grouping.bits)
        start = self._lengths[layer]
        self.key_store.write(layer, start, K)
        self.value_store.write(layer, start, V)
        self._lengths[layer] = start + K.shape[0]
        return self.keys(layer), self.values(layer)

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1 (speculative_decoding), to exactly the state the cache had then;
        refused when rows that n positions held in full precision are quantized since (per
        channel: cut to a multiple of the residual or within it; per token with a residual:
        only while at most R positions are held)."""
        n = self._check_truncate(n)
        for store in (self.key_store, self.value_store):
            store.check_truncate(len(self), n)
        self._lengths = [n] * self.config.n_layers

    def checkpoint(self):
        return (tuple(self._lengths), self.key_store.checkpoint(),
                self.value_store.checkpoint())

    def restore(self, state) -> None:
        lengths, key_state, value_state = state
        self.key_store.restore(key_state)
        self.value_store.restore(value_state)
        self._lengths = list(lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, float16 scales and full-precision residual rows of K
        and V, over every layer's filled positions (equal to quantized_cache_bytes)."""
        return sum(store.nbytes(layer, length)
                   for store in (self.key_store, self.value_store)
                   for layer, length in enumerate(self._lengths))
