"""The KV cache (prefill and kv_cached_decode): per layer, what later tokens need of every past
position.

Every kind of cache has the same interface, so that kvlib.prefill and kvlib.decode_step run
on any of them:

- ``len(cache)``: how many positions the sequence has so far (the next token's position);
- ``append(layer, K, V)``: store a chunk's rows and return the rows attention reads, in
  position order; ``keys(layer)`` and ``values(layer)``: the rows held now;
- ``key_positions(n_new)``: the positions of the rows attention will read once n_new more
  are appended (the mask is built from them);
- ``truncate(n)``: forget every position from n on (speculative decoding needs it);
  ``reset()``: forget everything;
- ``nbytes``: the bytes of what is really held;
- ``checkpoint()`` / ``restore(state)``: what kvlib.prefill and kvlib.decode_step use so that
  a call that fails half-way (an error, a KeyboardInterrupt) leaves the cache as it was.

The kinds: KVCache (contiguous, preallocated; K and V of every K/V head), ConcatenatingKVCache
(the naive one that copies on every append, the where_time_goes lesson), SlidingWindowCache
(a ring buffer of the last W positions plus attention sinks, the sliding_windows_and_sinks lesson)
and LatentKVCache (one latent per token instead of K and V, the latent_attention lesson). The
serving layer adds paged and quantized caches.
"""

from __future__ import annotations

import math
import mmap
from contextlib import contextmanager

import numpy as np

from .checks import LARGEST_COUNT, as_config, as_instance, as_rows, as_whole_number, is_trusted
from .config import ModelConfig


def zeros_by_page(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero array whose memory the operating system hands out page by page (4 KiB) as rows are
    written: an anonymous memory map. np.zeros asks Linux for 2 MiB huge pages when an array is
    large, so the first row of each layer of an 8,192-position SmolLM2 cache took 4 MiB of
    memory, 116 MiB for a 5-token prompt; here that prompt takes a few hundred KiB."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class BaseKVCache:
    """What every cache kind shares: its config, the per-layer lengths and their checks.

    Each layer's length is tracked on its own, because a forward pass appends to layer 0
    first, then 1, and so on. Between two passes every layer must hold the same number of
    positions; kvlib.prefill and kvlib.decode_step refuse a cache whose layers disagree.
    """

    capacity: int | None = None

    def __init__(self, config: ModelConfig):
        self.config = as_instance("config", config, ModelConfig, called="a kvlib ModelConfig",
                                  hint=f"a {type(self).__name__} needs a ModelConfig")
        self._lengths = [0] * config.n_layers

    # ------------------------------------------------------------------ lengths

    @property
    def lengths(self) -> tuple[int, ...]:
        """Positions held by each layer; all equal between two passes."""
        return tuple(self._lengths)

    def check_consistent(self) -> None:
        """Raise a ValueError that says what happened when the layers disagree."""
        if len(set(self._lengths)) > 1:
            raise ValueError(
                f"the layers of this cache hold different numbers of positions "
                f"{list(self._lengths)}: something appended to some layers only (a cell "
                "that calls cache.append by hand, run again?). Its contents no longer "
                "describe one sequence: prefill again into a fresh cache, or call "
                "cache.reset()")

    def __len__(self) -> int:
        """Number of positions in the sequence so far: the next token's position."""
        self.check_consistent()
        return self._lengths[0]

    def __repr__(self) -> str:
        if len(set(self._lengths)) > 1:
            return (f"{type(self).__name__}(layers disagree: {list(self._lengths)} "
                    "positions; prefill again or reset)")
        return self._describe()

    def _describe(self) -> str:
        n = self._lengths[0]
        of = "" if self.capacity is None else f" of {self.capacity}"
        return (f"{type(self).__name__}({_plural(n, 'position')}{of}, "
                f"{_plural(self.config.n_layers, 'layer')})")

    # the doors of every kind of cache (kvlib.serving's paged and quantized caches use them too)

    def _check_layer(self, layer) -> int:
        return as_whole_number("layer", layer, 0, self.config.n_layers - 1)

    def _check_rows(self, what: str, array, width: int, n_rows: int | None = None):
        return as_rows(what, array, width, n_rows)

    def _check_room(self, layer: int, n_new: int) -> None:
        start = self._lengths[layer]
        if not is_trusted() and self.capacity is not None and start + n_new > self.capacity:
            raise ValueError(f"the cache is full: it holds {start} of {self.capacity} positions "
                             f"and cannot take {n_new} more (capacity is the context length)")

    def _check_capacity(self, capacity) -> int:
        """The positions a preallocated cache holds: the context length when None."""
        context = self.config.context_length
        return as_whole_number("capacity", context if capacity is None else capacity, 1, context)

    def _check_truncate(self, n) -> int:
        n = as_whole_number("truncate's n", n)
        if n > len(self):
            raise ValueError(f"cannot truncate to {n} positions: the cache holds {len(self)}")
        return n

    # ------------------------------------------------------------------ the interface

    def key_positions(self, n_new: int = 0) -> np.ndarray:
        """Positions of the rows attention reads after n_new more are appended: (S,)."""
        return np.arange(len(self) + self._check_new(n_new))

    def _check_new(self, n_new) -> int:
        return as_whole_number("n_new", n_new, 0, (self.capacity or LARGEST_COUNT) - len(self))

    def append(self, layer: int, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store a chunk's new rows K, V (n_new, kv_width) after a layer's last position and
        return the rows attention reads, old and new, in position order: (S, kv_width) each.
        The door of every kind: the layer, the rows and the room are checked here, and the
        kind stores them (_store)."""
        layer = self._check_layer(layer)
        K = self._check_rows("K", K, self.width)
        V = self._check_rows("V", V, self.width, len(K))
        self._check_room(layer, len(K))
        return self._store(layer, K, V)

    def mask_for(self, layer: int, mask):
        """The mask of a pass for one layer's rows: the same for every layer here; an evicting
        cache's layers may hold fewer rows (kvlib.eviction)."""
        return mask

    def observe(self, layer: int, weights: np.ndarray) -> None:
        """What a layer's attention paid to the rows it read, weights (h, T, S), reported after
        each pass: a cache that keeps every row ignores it; an evicting cache chooses here what
        to keep (kvlib.eviction, keeping_what_attention_reads)."""

    def reset(self) -> None:
        """Forget every position (start a new, unrelated prompt); buffers are kept. Also
        the way out when the layers disagree."""
        self._lengths = [0] * self.config.n_layers
        self.truncate(0)

    def checkpoint(self):
        """What restore(state) puts back (kvlib.prefill and kvlib.decode_step use it, so that
        a pass that fails half-way changes nothing): the kind's state, marked as this
        cache's."""
        return self, self._state()

    def restore(self, state) -> None:
        """Put back a state that this cache's checkpoint() returned."""
        if not (isinstance(state, tuple) and len(state) == 2 and state[0] is self):
            raise ValueError(f"state must be what this cache's checkpoint() returned, got "
                             f"{type(state).__name__}")
        self._put_back(state[1])

    def _state(self):
        return tuple(self._lengths)

    def _put_back(self, state) -> None:
        self._lengths = list(state)


@contextmanager
def all_or_nothing(cache):
    """Leave the cache as it was if the pass run inside fails half-way, between two layers'
    appends (an error, or a KeyboardInterrupt when a student stops the kernel). Any cache
    with checkpoint() and restore(state): a BaseKVCache, a HybridCache."""
    saved = cache.checkpoint()
    try:
        yield
    except BaseException:
        cache.restore(saved)
        raise


class KVCache(BaseKVCache):
    """Keys and values of every layer, for the positions seen so far. Never queries.

    The buffers are allocated once, at full capacity (by default the config's context
    length), so appending a token writes one row in place and never copies what is cached.
    ``keys(layer)`` and ``values(layer)`` are views of the filled rows, shape (T, kv_width),
    where kv_width = n_kv_heads x head_dim: d_model for multi-head attention (notebooks
    07-08), less with grouped-query attention (grouped_query_attention).
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        super().__init__(config)
        self.capacity = capacity = self._check_capacity(capacity)
        self.width = config.kv_width
        shape = (config.n_layers, capacity, self.width)
        self._keys = zeros_by_page(shape, config.numpy_dtype)
        self._values = zeros_by_page(shape, config.numpy_dtype)

    def _describe(self) -> str:
        n = self._lengths[0]
        return (f"KVCache({n} of {self.capacity} positions, {self.config.n_layers} layers, "
                f"K and V of shape ({n}, {self.width}) each)")

    def keys(self, layer: int) -> np.ndarray:
        """View of the cached keys of a layer: (T, kv_width)."""
        layer = self._check_layer(layer)
        return self._keys[layer, : self._lengths[layer]]

    def values(self, layer: int) -> np.ndarray:
        """View of the cached values of a layer: (T, kv_width)."""
        layer = self._check_layer(layer)
        return self._values[layer, : self._lengths[layer]]

    def _store(self, layer: int, K: np.ndarray, V: np.ndarray):
        """Write the new rows in place, after the layer's last position; return views of all
        the layer's filled rows, old and new: (T + n_new, kv_width) each."""
        start = self._lengths[layer]
        end = start + K.shape[0]
        self._keys[layer, start:end] = K
        self._values[layer, start:end] = V
        self._lengths[layer] = end
        return self.keys(layer), self.values(layer)

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1 and forget the rest (speculative_decoding): the rows stay in the
        buffer and are overwritten by the next appends."""
        n = self._check_truncate(n)
        self._lengths = [n] * self.config.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by the filled positions: 2 (K and V) x layers x T x kv_width x bytes."""
        return sum(2 * length * self.width * self._keys.itemsize for length in self._lengths)


class ConcatenatingKVCache(BaseKVCache):
    """The naive cache that grows with np.concatenate, copying everything on every append.

    Same interface and same results as KVCache; the where_time_goes lesson and benchmarks/decode.py
    measure what the copy costs.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        super().__init__(config)
        self.capacity = capacity = self._check_capacity(capacity)
        self.width = config.kv_width
        empty = np.zeros((0, self.width), dtype=config.numpy_dtype)
        self._key_list = [empty] * config.n_layers
        self._value_list = [empty] * config.n_layers

    def keys(self, layer: int) -> np.ndarray:
        return self._key_list[self._check_layer(layer)]

    def values(self, layer: int) -> np.ndarray:
        return self._value_list[self._check_layer(layer)]

    def _store(self, layer, K, V):
        self._key_list[layer] = np.concatenate([self._key_list[layer], K])
        self._value_list[layer] = np.concatenate([self._value_list[layer], V])
        self._lengths[layer] += K.shape[0]
        return self._key_list[layer], self._value_list[layer]

    def truncate(self, n: int) -> None:
        n = self._check_truncate(n)
        self._key_list = [k[:n] for k in self._key_list]
        self._value_list = [v[:n] for v in self._value_list]
        self._lengths = [n] * self.config.n_layers

    def _state(self):
        return tuple(self._lengths), list(self._key_list), list(self._value_list)

    def _put_back(self, state) -> None:
        lengths, self._key_list, self._value_list = state
        self._lengths = list(lengths)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self._key_list, self._value_list))


class SlidingWindowCache(BaseKVCache):
    """The cache of a sliding-window model (sliding_windows_and_sinks): a ring buffer of the last W
    positions, plus the first sink_tokens positions kept for good (StreamingLLM).

    Its memory never grows past (sink_tokens + W) rows a layer, however long the generation:
    position p >= sink_tokens is written to ring slot (p - sink_tokens) % W, over the
    position W before it, which no later query can see. W and sink_tokens come from the
    config (config.window, config.sink_tokens). There is no capacity: a model with rotary or
    no positions can stream on for ever; a learned position table still stops at its
    context length.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if config.window is None:
            raise ValueError("a SlidingWindowCache needs a config with a window "
                             "(ModelConfig(window=W, ...)); for full attention use KVCache")
        self.window, self.sink_tokens = config.window, config.sink_tokens
        self.width = config.kv_width
        shape = (config.n_layers, self.sink_tokens + self.window, self.width)
        self._keys = np.zeros(shape, dtype=config.numpy_dtype)
        self._values = np.zeros(shape, dtype=config.numpy_dtype)

    def _describe(self) -> str:
        n = self._lengths[0]
        return (f"SlidingWindowCache({_plural(n, 'position')} seen, "
                f"{_plural(len(self._held(n)), 'row')} held: window {self.window}, "
                f"{_plural(self.sink_tokens, 'sink')}, {_plural(self.config.n_layers, 'layer')})")

    def _held(self, n: int) -> np.ndarray:
        """Positions held after n positions: the sinks and the last W."""
        sinks = np.arange(min(n, self.sink_tokens))
        recent = np.arange(max(self.sink_tokens, n - self.window), n)
        return np.concatenate([sinks, recent])

    def slot(self, position: int) -> int:
        """The buffer row that holds a position (sliding_windows_and_sinks): the position itself for
        a sink, sinks + (position - sinks) % W after them."""
        return int(self._slots(np.array([position]))[0])

    def _slots(self, positions: np.ndarray) -> np.ndarray:
        sink = self.sink_tokens
        return np.where(positions < sink, positions, sink + (positions - sink) % self.window)

    def key_positions(self, n_new: int = 0) -> np.ndarray:
        n, n_new = len(self), self._check_new(n_new)
        return np.concatenate([self._held(n), np.arange(n, n + n_new)])

    def keys(self, layer: int) -> np.ndarray:
        """The held keys of a layer in position order: (held, kv_width), a copy."""
        return self._in_order(self._keys, self._check_layer(layer))

    def values(self, layer: int) -> np.ndarray:
        return self._in_order(self._values, self._check_layer(layer))

    def _in_order(self, buffer: np.ndarray, layer: int) -> np.ndarray:
        return buffer[layer, self._slots(self._held(self._lengths[layer]))]

    def _store(self, layer: int, K: np.ndarray, V: np.ndarray):
        """Return the held rows and the new ones, in position order (a chunk longer than the
        window still sees, through the mask, the W positions before each of its queries),
        then keep only the sinks and the last W."""
        attended_keys = np.concatenate([self._in_order(self._keys, layer), K])
        attended_values = np.concatenate([self._in_order(self._values, layer), V])
        start = self._lengths[layer]
        end = start + K.shape[0]
        positions = np.arange(start, end)
        kept = np.isin(positions, self._held(end))   # new rows still held after this chunk
        self._keys[layer, self._slots(positions[kept])] = K[kept]
        self._values[layer, self._slots(positions[kept])] = V[kept]
        self._lengths[layer] = end
        return attended_keys, attended_values

    def truncate(self, n: int) -> None:
        """Go back to n positions; possible only while nothing was overwritten yet (or when
        n is the current length): a ring buffer does not keep what it wrote over."""
        n = self._check_truncate(n)
        if n < len(self) and len(self) > self.sink_tokens + self.window:
            raise ValueError(
                f"cannot truncate a sliding-window cache from {len(self)} to {n} positions: "
                f"positions before {len(self) - self.window} were overwritten in its ring "
                "buffer. Keep a checkpoint() from before and restore() it instead")
        self._lengths = [n] * self.config.n_layers

    def _state(self):
        return tuple(self._lengths), self._keys.copy(), self._values.copy()

    def _put_back(self, state) -> None:
        lengths, keys, values = state
        self._lengths = list(lengths)
        self._keys[...] = keys
        self._values[...] = values

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: 2 x layers x min(T, sinks + W) x kv_width x bytes."""
        return sum(2 * self.config.held_positions(n) * self.width * self._keys.itemsize
                   for n in self._lengths)


class LatentKVCache(BaseKVCache):
    """The cache of multi-head latent attention (latent_attention): per token and layer one
    latent of latent_dim numbers and one shared rotary key of rope_head_dim, instead of K
    and V for every head.

    Both sit side by side in one row of dc + dr numbers. ``keys(layer)`` is that whole row
    (T, dc + dr): the absorbed queries are scored against it. ``values(layer)`` is a view of
    its first dc columns (T, dc): the latents, which the weighted sum mixes. Nothing is
    stored twice.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        super().__init__(config)
        if config.latent_dim is None:
            raise ValueError("a LatentKVCache needs a config with latent_dim "
                             "(latent attention); for K and V use KVCache")
        self.capacity = capacity = self._check_capacity(capacity)
        self.latent_dim, self.rope_dim = config.latent_dim, config.rope_head_dim
        self.width = self.latent_dim + self.rope_dim
        self._rows = zeros_by_page((config.n_layers, capacity, self.width), config.numpy_dtype)

    def _describe(self) -> str:
        n = self._lengths[0]
        return (f"LatentKVCache({n} of {self.capacity} positions, {self.config.n_layers} "
                f"layers, rows of {self.latent_dim} latent + {self.rope_dim} rotary)")

    def keys(self, layer: int) -> np.ndarray:
        """Latent and rotary key side by side: (T, dc + dr), a view."""
        layer = self._check_layer(layer)
        return self._rows[layer, : self._lengths[layer]]

    def values(self, layer: int) -> np.ndarray:
        """The latents alone: (T, dc), a view of the same rows."""
        return self.keys(layer)[:, : self.latent_dim]

    def append(self, layer: int, latent: np.ndarray, rope_keys: np.ndarray | None = None):
        """Store new latents (n_new, dc) and rotary keys (n_new, dr); return all the layer's
        latents (T, dc) and rotary keys (T, dr) (None without a rotary part), as views."""
        layer = self._check_layer(layer)
        latent = self._check_rows("latent", latent, self.latent_dim)
        if self.rope_dim:     # without a rotary part there are no rotary keys to store
            rope_keys = self._check_rows("rope_keys", rope_keys, self.rope_dim, len(latent))
        self._check_room(layer, len(latent))
        start = self._lengths[layer]
        end = start + latent.shape[0]
        self._rows[layer, start:end, : self.latent_dim] = latent
        if self.rope_dim:
            self._rows[layer, start:end, self.latent_dim:] = rope_keys
        self._lengths[layer] = end
        rows = self._rows[layer, :end]
        return rows[:, : self.latent_dim], (rows[:, self.latent_dim:] if self.rope_dim else None)

    def truncate(self, n: int) -> None:
        n = self._check_truncate(n)
        self._lengths = [n] * self.config.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes held: layers x T x (dc + dr) x bytes; no factor 2, the latent serves K and V."""
        return sum(length * self.width * self._rows.itemsize for length in self._lengths)


def make_cache(config: ModelConfig, capacity: int | None = None) -> BaseKVCache:
    """The cache kind a model needs: LatentKVCache for latent attention, SlidingWindowCache
    for a sliding window, KVCache otherwise (what kvlib.prefill makes when given none)."""
    if as_config(config).latent_dim is not None:
        return LatentKVCache(config, capacity)
    if config.window is not None:
        if capacity is not None:
            raise ValueError("a sliding-window cache has no capacity: it keeps the last W")
        return SlidingWindowCache(config)
    return KVCache(config, capacity)
