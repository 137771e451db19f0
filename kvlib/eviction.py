"""Caches that keep what attention reads and drop the rest (keeping_what_attention_reads).

A budget of positions per layer, and a policy that chooses which of a layer's positions stay
once it holds more. Each policy is a small class with one method, ``keep``: it gets what the
layer holds and the weights this pass's attention paid to it, and returns, per K/V head, the
slots to keep. The cache itself (EvictingCache) stores rows, hands them to attention, and
calls the policy after attention (kvlib.decoder_block reports the weights through
``cache.observe``):

- Window: the last `budget` positions (what SlidingWindowCache keeps, as a policy);
- Sinks: the first few positions and the most recent (StreamingLLM, Xiao et al. 2023);
- H2O: a recent part plus the "heavy hitters", the positions with the most attention summed
  over every query so far, per K/V head (Zhang et al., NeurIPS 2023, arXiv 2306.14048);
- TOVA: one set for all heads of a layer; drop the positions the current query, averaged over
  the layer's query heads, weighs least (Oren et al., EMNLP 2024, arXiv 2401.06104; a chunk is
  scored by its last query, as TOVA's own TOVACache.reduce does);
- SnapKV: once, on the prompt: the prompt's last `observation_window` queries vote for the
  positions before them, the votes pooled over `kernel_size` neighbours, per K/V head; the top
  positions and the window itself stay; generated tokens are all kept (Li et al., NeurIPS 2024,
  arXiv 2404.14469). Pooling kernel 5 as in SnapKV's and PyramidKV's code; their observation
  window of 32 or 64 is for budgets of a thousand and more, so the default here is 8.

PyramidKV (Cai et al., arXiv 2406.02069) is a budget, not a policy: pyramid_budgets gives the
lower layers more positions and the higher ones fewer, for the same total, and SnapKV selects.

Kept keys keep the rotation of the position they were written at: nothing is re-rotated.
Shapes: kv K/V heads, dh head size, h query heads, T new positions, S rows a layer reads.
"""

from __future__ import annotations

import numpy as np

from .cache import BaseKVCache, _plural
from .checks import as_config, as_one_of, as_whole_number
from .config import ModelConfig


# ---------------------------------------------------------------------------------- policies

def _top(scores: np.ndarray, n_keep: int) -> np.ndarray:
    """Per row, the slots of the n_keep largest scores, in slot (= position) order: (kv, n_keep).
    A stable sort on the negated scores: of two equal scores the earlier slot stays."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :n_keep]
    return np.sort(order, axis=-1)


def _last(n_heads: int, n_slots: int, n_keep: int) -> np.ndarray:
    """The last n_keep slots, for every head: (kv, n_keep)."""
    return np.broadcast_to(np.arange(n_slots - n_keep, n_slots), (n_heads, n_keep))


class Window:
    """Keep the most recent `budget` positions: a sliding window, chosen by position alone."""

    name = "window"
    needs_weights = False

    def check(self, budget: int) -> None:
        pass

    def keep(self, positions, scores, weights, budget, first_pass):
        return _last(len(positions), positions.shape[1], budget)


class Sinks:
    """Keep the first sink_tokens positions and the most recent ones (StreamingLLM)."""

    name = "sinks"
    needs_weights = False

    def __init__(self, sink_tokens: int = 4):
        self.sink_tokens = as_whole_number("sink_tokens", sink_tokens, 1)

    def check(self, budget: int) -> None:
        if budget <= self.sink_tokens:
            raise ValueError(f"a budget of {budget} leaves no room for recent positions beside "
                             f"{self.sink_tokens} sinks: give a budget above {self.sink_tokens}")

    def keep(self, positions, scores, weights, budget, first_pass):
        n_heads, n_slots = positions.shape
        recent = _last(n_heads, n_slots, budget - self.sink_tokens)
        sinks = np.broadcast_to(np.arange(self.sink_tokens), (n_heads, self.sink_tokens))
        return np.concatenate([sinks, recent], axis=1)   # the sinks are the first slots, never evicted


class H2O:
    """Keep `recent` most recent positions and, among the others, the heavy hitters: the most
    attention received, summed over every query and every query head of the K/V head's group
    since the position arrived. recent: None for half the budget (H2O's own split)."""

    name = "h2o"
    needs_weights = True

    def __init__(self, recent: int | None = None):
        self.recent = None if recent is None else as_whole_number("recent", recent, 1)

    def check(self, budget: int) -> None:
        if self.recent is not None and self.recent >= budget:
            raise ValueError(f"recent={self.recent} leaves no room for heavy hitters in a "
                             f"budget of {budget}: give recent below the budget")

    def recent_part(self, budget: int) -> int:
        return budget // 2 if self.recent is None else self.recent

    def keep(self, positions, scores, weights, budget, first_pass):
        n_heads, n_slots = positions.shape
        recent = self.recent_part(budget)
        heavy = _top(scores[:, : n_slots - recent], budget - recent)
        return np.concatenate([heavy, _last(n_heads, n_slots, recent)], axis=1)


class TOVA:
    """One set of positions for all heads of a layer: keep the `budget` positions the current
    query (the pass's last) weighs most, averaged over the layer's query heads."""

    name = "tova"
    needs_weights = True

    def check(self, budget: int) -> None:
        pass

    def keep(self, positions, scores, weights, budget, first_pass):
        current = weights[:, :, -1, :].mean(axis=(0, 1))          # (S,): every query head
        kept = _top(current[None, :], budget)
        return np.broadcast_to(kept, (len(positions), budget))


class SnapKV:
    """Compress the prompt once, per K/V head: the last observation_window queries vote
    (their weights summed over the window and the group's query heads), the votes are
    averaged over kernel_size neighbours, and the top budget - observation_window positions
    before the window stay, with the window. Later passes keep everything they add."""

    name = "snapkv"
    needs_weights = True

    def __init__(self, observation_window: int = 8, kernel_size: int = 5):
        self.observation_window = as_whole_number("observation_window", observation_window, 1)
        self.kernel_size = as_whole_number("kernel_size", kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, so that the pooling is centred, got "
                             f"{kernel_size}")

    def check(self, budget: int) -> None:
        if budget <= self.observation_window:
            raise ValueError(f"a budget of {budget} must be above the observation window "
                             f"({self.observation_window}), which is always kept")

    def keep(self, positions, scores, weights, budget, first_pass):
        n_heads, n_slots = positions.shape
        if not first_pass:                       # only the prompt is compressed
            return np.broadcast_to(np.arange(n_slots), (n_heads, n_slots))
        window = self.observation_window
        if weights.shape[2] < window:            # a prompt shorter than the window: its last rows
            return _last(n_heads, n_slots, budget)
        votes = weights[:, :, -window:, : n_slots - window].sum(axis=(1, 2))   # (kv, S - w)
        pooled = average_pool(votes, self.kernel_size)
        return np.concatenate([_top(pooled, budget - window),
                               _last(n_heads, n_slots, window)], axis=1)


def average_pool(votes: np.ndarray, kernel_size: int) -> np.ndarray:
    """Each vote averaged with its neighbours, kernel_size wide, zeros past the ends counted
    (torch's avg_pool1d with padding kernel_size // 2, as SnapKV pools): (kv, n) -> (kv, n)."""
    half = kernel_size // 2
    padded = np.pad(votes, ((0, 0), (half, half)))
    sums = np.cumsum(np.pad(padded, ((0, 0), (1, 0))), axis=1)
    return (sums[:, kernel_size:] - sums[:, :-kernel_size]) / kernel_size


POLICIES = {"window": Window, "sinks": Sinks, "h2o": H2O, "tova": TOVA, "snapkv": SnapKV}
"""Each policy's name and class; EvictingCache(policy="tova") makes TOVA() with its defaults."""


def pyramid_budgets(n_layers: int, budget: int, observation_window: int = 8,
                    beta: int = 20) -> list[int]:
    """PyramidKV's budgets (keeping_what_attention_reads): as many positions in total as
    `budget` in every layer, but more in the lower layers and fewer in the higher, down a line
    -> one budget per layer. As in PyramidKV's pyramidkv_utils.py, the part chosen besides the
    observation window runs from 2 x (budget - window) - smallest in layer 0 down to smallest =
    (budget - window) // beta in the last, and every layer also keeps the window. PyramidKV
    steps by the whole number (largest - smallest) // (layers - 1), which keeps more in total
    (10% more for SmolLM2 at 128); here each layer's share is rounded instead, so that the
    total is the uniform budget's and a comparison at equal memory is fair."""
    n_layers = as_whole_number("n_layers", n_layers, 1)
    observation_window = as_whole_number("observation_window", observation_window, 1)
    budget = as_whole_number("budget", budget, observation_window + 1)
    beta = as_whole_number("beta", beta, 1)
    chosen = budget - observation_window
    smallest = chosen // beta
    largest = 2 * chosen - smallest
    step = (largest - smallest) / max(n_layers - 1, 1)
    return [observation_window + round(largest - layer * step) for layer in range(n_layers)]


# ---------------------------------------------------------------------------------- the cache

class EvictingCache(BaseKVCache):
    """A cache that holds at most `budget` positions a layer and lets a policy choose them
    (keeping_what_attention_reads).

    Per layer and K/V head it keeps the positions held (kv, held), their keys and values
    (kv, held, dh) and an accumulated score (kv, held) (H2O's). A pass appends its rows and
    attention reads every held row and the new ones; then ``observe`` hands the weights to the
    policy, which keeps `budget` of them. So between two passes a layer holds at most its
    budget (SnapKV: its prompt at most the budget, plus every later token), and a pass of T
    tokens reads at most budget + T rows.

    ``len(cache)`` is the sequence's length (the next position); ``nbytes`` counts what is
    held. budget: one number for every layer, or one per layer (pyramid_budgets). policy: a
    name of POLICIES or a policy object (Sinks(sink_tokens=2), H2O(recent=8), ...).
    """

    def __init__(self, config: ModelConfig, budget, policy="tova"):
        config = as_config(config)
        if config.latent_dim is not None or config.window is not None:
            raise ValueError("an EvictingCache needs a model with K and V and no window of its "
                             "own (the window is one of its policies)")
        super().__init__(config)
        self.policy = _as_policy(policy)
        self.budgets = _as_budgets(budget, config.n_layers)
        for layer_budget in set(self.budgets):
            self.policy.check(layer_budget)
        self.width, self.head_dim, self.kv_heads = config.kv_width, config.head_dim, config.kv_heads
        self.reset()

    # ---------------------------------------------------------------- what is held

    def held_positions(self, layer: int) -> np.ndarray:
        """The positions a layer holds, per K/V head, in position order: (kv, held)."""
        return self._positions[self._check_layer(layer)].copy()

    def keys(self, layer: int) -> np.ndarray:
        """The held keys, K/V head by K/V head in its columns: (held, kv_width)."""
        return self._merged(self._keys[self._check_layer(layer)])

    def values(self, layer: int) -> np.ndarray:
        return self._merged(self._values[self._check_layer(layer)])

    @staticmethod
    def _merged(rows: np.ndarray) -> np.ndarray:
        """(kv, S, dh) -> (S, kv x dh): row j of head k sits in head k's columns; a head's
        row j and another head's row j may be different positions."""
        return rows.transpose(1, 0, 2).reshape(rows.shape[1], -1)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: 2 (K and V) x the rows of every layer and head x dh x bytes."""
        return sum(keys.nbytes + values.nbytes for keys, values in zip(self._keys, self._values))

    @property
    def index_bytes(self) -> int:
        """Bytes kept beside the rows: each held row's position and score, per K/V head."""
        return sum(positions.nbytes + scores.nbytes
                   for positions, scores in zip(self._positions, self._scores))

    def _describe(self) -> str:
        held = sorted({positions.shape[1] for positions in self._positions})
        held_text = str(held[0]) if len(held) == 1 else f"{held[0]}-{held[-1]}"
        return (f"EvictingCache({self.policy.name}, {_plural(self._lengths[0], 'position')} "
                f"seen, {held_text} held a layer, budget {_budget_text(self.budgets)}, "
                f"{_plural(self.config.n_layers, 'layer')})")

    # ---------------------------------------------------------------- a pass

    def key_positions(self, n_new: int = 0) -> np.ndarray:
        """For the mask only: every held position is before the new ones, so the new queries
        see all held rows and each other causally, whatever positions are held. The rows of
        the layer holding most, numbered up to the next position: (held + n_new,)."""
        n, n_new = len(self), self._check_new(n_new)
        most = max(positions.shape[1] for positions in self._positions)
        return np.arange(n - most, n + n_new)

    def mask_for(self, layer: int, mask):
        """The pass's mask cut to this layer's rows: the last columns (layers may hold fewer)."""
        if mask is None:
            return None
        return mask[:, mask.shape[1] - self._positions[layer].shape[1]:]

    def _store(self, layer: int, K: np.ndarray, V: np.ndarray):
        start, n_new = self._lengths[layer], len(K)
        self._first_pass[layer] = start == 0
        new_positions = np.broadcast_to(np.arange(start, start + n_new), (self.kv_heads, n_new))
        self._positions[layer] = np.concatenate([self._positions[layer], new_positions], axis=1)
        self._keys[layer] = np.concatenate([self._keys[layer], self._split(K)], axis=1)
        self._values[layer] = np.concatenate([self._values[layer], self._split(V)], axis=1)
        self._scores[layer] = np.concatenate([self._scores[layer],
                                              np.zeros((self.kv_heads, n_new))], axis=1)
        self._lengths[layer] = start + n_new
        return self._merged(self._keys[layer]), self._merged(self._values[layer])

    def _split(self, rows: np.ndarray) -> np.ndarray:
        """(T, kv x dh) -> (kv, T, dh)."""
        return rows.reshape(len(rows), self.kv_heads, self.head_dim).transpose(1, 0, 2)

    def observe(self, layer: int, weights: np.ndarray) -> None:
        """After a layer's attention: weights (h, T, S) over the rows it read. Add them to the
        scores, then, over budget, keep what the policy chooses."""
        grouped = weights.reshape(self.kv_heads, -1, *weights.shape[1:])   # (kv, h/kv, T, S)
        self._scores[layer] = self._scores[layer] + grouped.sum(axis=(1, 2))
        budget = self.budgets[layer]
        if self._positions[layer].shape[1] <= budget:
            return
        kept = self.policy.keep(self._positions[layer], self._scores[layer], grouped, budget,
                                self._first_pass[layer])
        self._evicted = True
        rows = kept[:, :, None]
        self._positions[layer] = np.take_along_axis(self._positions[layer], kept, axis=1)
        self._scores[layer] = np.take_along_axis(self._scores[layer], kept, axis=1)
        self._keys[layer] = np.take_along_axis(self._keys[layer], rows, axis=1)
        self._values[layer] = np.take_along_axis(self._values[layer], rows, axis=1)

    # ---------------------------------------------------------------- going back

    def truncate(self, n: int) -> None:
        """Go back to n positions: to 0 always; to n < len only while nothing was evicted (what
        was dropped to make room is gone, so the cache could not be what it was at n)."""
        n = self._check_truncate(n)
        if n == 0:
            self._empty()
            return
        if n < len(self) and self._evicted:
            raise ValueError(f"cannot truncate an evicting cache from {len(self)} to {n} "
                             "positions: it dropped positions since, and the ones dropped to "
                             "make room are gone. Keep a checkpoint() and restore() it instead")
        for layer in range(self.config.n_layers):
            kept = self._positions[layer][0] < n          # nothing evicted: every head the same
            self._positions[layer] = self._positions[layer][:, kept]
            self._scores[layer] = self._scores[layer][:, kept]
            self._keys[layer] = self._keys[layer][:, kept]
            self._values[layer] = self._values[layer][:, kept]
        self._lengths = [n] * self.config.n_layers

    def _empty(self) -> None:
        layers, dtype = self.config.n_layers, self.config.numpy_dtype
        self._positions = [np.zeros((self.kv_heads, 0), dtype=np.int64)] * layers
        self._scores = [np.zeros((self.kv_heads, 0))] * layers
        self._keys = [np.zeros((self.kv_heads, 0, self.head_dim), dtype=dtype)] * layers
        self._values = list(self._keys)
        self._first_pass = [True] * layers
        self._evicted = False
        self._lengths = [0] * layers

    def reset(self) -> None:
        self._empty()

    def _state(self):
        # every change replaces a layer's arrays, so copies of the lists are a snapshot
        return (tuple(self._lengths), list(self._positions), list(self._scores),
                list(self._keys), list(self._values), list(self._first_pass), self._evicted)

    def _put_back(self, state) -> None:
        lengths, positions, scores, keys, values, first_pass, evicted = state
        self._lengths, self._positions, self._scores = list(lengths), list(positions), list(scores)
        self._keys, self._values = list(keys), list(values)
        self._first_pass, self._evicted = list(first_pass), evicted


def _as_policy(policy):
    if isinstance(policy, str):
        return POLICIES[as_one_of("policy", policy, tuple(POLICIES))]()
    if isinstance(policy, tuple(POLICIES.values())):
        return policy
    raise TypeError(f"policy must be one of {', '.join(map(repr, POLICIES))} or a policy "
                    f"object such as kvlib.eviction.Sinks(sink_tokens=2), got "
                    f"{type(policy).__name__}")


def _as_budgets(budget, n_layers: int) -> list[int]:
    if isinstance(budget, (list, tuple, np.ndarray)):
        if len(budget) != n_layers:
            raise ValueError(f"budget per layer needs {n_layers} numbers, one per layer, got "
                             f"{len(budget)}")
        return [as_whole_number(f"budget of layer {layer}", value, 1)
                for layer, value in enumerate(budget)]
    return [as_whole_number("budget", budget, 1)] * n_layers


def _budget_text(budgets: list[int]) -> str:
    return str(budgets[0]) if len(set(budgets)) == 1 else f"{max(budgets)}-{min(budgets)}"
