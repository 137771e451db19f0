"""The KV cache (notebooks 07-08): per layer, the keys and values of every past position."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig


class KVCache:
    """Keys and values of every layer, for the positions seen so far. Never queries.

    The buffers are allocated once, at full capacity (by default the config's context
    length), so appending a token writes one row in place and never copies what is cached.
    ``keys(layer)`` and ``values(layer)`` are views of the filled rows, shape (T, d_model).
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"KVCache needs a ModelConfig, got {type(config).__name__}")
        capacity = config.context_length if capacity is None else capacity
        if not 1 <= capacity <= config.context_length:
            raise ValueError(f"capacity must be between 1 and the context length "
                             f"{config.context_length}, got {capacity}")
        self.config = config
        self.capacity = capacity
        shape = (config.n_layers, capacity, config.d_model)
        self._keys = np.zeros(shape, dtype=config.numpy_dtype)
        self._values = np.zeros(shape, dtype=config.numpy_dtype)
        self._lengths = [0] * config.n_layers

    def __len__(self) -> int:
        """Number of positions held in every layer."""
        return min(self._lengths)

    def __repr__(self) -> str:
        return (f"KVCache({len(self)} of {self.capacity} positions, {self.config.n_layers} "
                f"layers, K and V of shape ({len(self)}, {self.config.d_model}) each)")

    def keys(self, layer: int) -> np.ndarray:
        """View of the cached keys of a layer: (T, d_model)."""
        self._check_layer(layer)
        return self._keys[layer, : self._lengths[layer]]

    def values(self, layer: int) -> np.ndarray:
        """View of the cached values of a layer: (T, d_model)."""
        self._check_layer(layer)
        return self._values[layer, : self._lengths[layer]]

    def append(self, layer: int, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write new rows K, V (n_new, d_model) after a layer's last position, in place.

        Returns views of all the layer's filled rows, old and new: (T + n_new, d_model) each.
        """
        self._check_layer(layer)
        expected = (K.shape[0], self.config.d_model)
        if K.ndim != 2 or K.shape != expected or V.shape != expected:
            raise ValueError(f"append expects K and V of shape (n_new, {self.config.d_model}), "
                             f"got {K.shape} and {V.shape}")
        start = self._lengths[layer]
        end = start + K.shape[0]
        if end > self.capacity:
            raise ValueError(f"the cache is full: it holds {start} of {self.capacity} positions "
                             f"and cannot take {K.shape[0]} more (capacity is the context length)")
        self._keys[layer, start:end] = K
        self._values[layer, start:end] = V
        self._lengths[layer] = end
        return self.keys(layer), self.values(layer)

    def reset(self) -> None:
        """Forget every position (start a new, unrelated prompt); the buffers are kept."""
        self._lengths = [0] * self.config.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by the filled positions: 2 (K and V) x layers x T x d_model x dtype bytes."""
        return sum(2 * length * self.config.d_model * self._keys.itemsize
                   for length in self._lengths)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.config.n_layers:
            raise ValueError(f"layer must be between 0 and {self.config.n_layers - 1}, got {layer}")


class ConcatenatingKVCache(KVCache):
    """The naive cache that grows with np.concatenate, copying everything on every append.

    Same interface and same results as KVCache; notebook 09 and benchmarks/decode.py measure
    what the copy costs.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        super().__init__(config, capacity=1)
        self.capacity = config.context_length if capacity is None else capacity
        empty = np.zeros((0, config.d_model), dtype=config.numpy_dtype)
        self._key_list = [empty] * config.n_layers
        self._value_list = [empty] * config.n_layers

    def keys(self, layer: int) -> np.ndarray:
        self._check_layer(layer)
        return self._key_list[layer]

    def values(self, layer: int) -> np.ndarray:
        self._check_layer(layer)
        return self._value_list[layer]

    def append(self, layer, K, V):
        self._check_layer(layer)
        if self._lengths[layer] + K.shape[0] > self.capacity:
            raise ValueError(f"the cache is full: capacity is {self.capacity} positions")
        self._key_list[layer] = np.concatenate([self._key_list[layer], K])
        self._value_list[layer] = np.concatenate([self._value_list[layer], V])
        self._lengths[layer] += K.shape[0]
        return self._key_list[layer], self._value_list[layer]

    def reset(self) -> None:
        super().reset()
        self._key_list = [k[:0] for k in self._key_list]
        self._value_list = [v[:0] for v in self._value_list]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self._key_list, self._value_list))
