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
        return np.concatenate([sinks, recent], axis=1)   # sinks: the first slots, never evicted


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


MOST_LAYERS = 10_000
"""pyramid_budgets' limit: more layers than any model has (a list of them must fit in memory)."""


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
    n_layers = as_whole_number("n_layers", n_layers, 1, MOST_LAYERS)
    observation_window = as_whole_number("observation_window", observation_window, 1)
    budget = as_whole_number("budget", budget, observation_window + 1)
    beta = as_whole_number("beta", beta, 1)
    chosen = budget - observation_window
    smallest = chosen // beta
    largest = 2 * chosen - smallest
    step = (largest - smallest) / max(n_layers - 1, 1)
    return [observation_window + round(largest - layer * step) for layer in range(n_layers)]


# ---------------------------------------------------------------------------------- the cache

class EvictingLayer:
    """One layer's held rows (keeping_what_attention_reads): per K/V head the positions held
    (kv, held), their keys and values (kv, held, dh) and the attention each has received
    (kv, held), all in position order. ``append`` adds a pass's rows, ``observe`` lets the
    policy keep `budget` of them. Every change replaces these arrays, never writes into them,
    so a copy of the list of them is a snapshot. EvictingCache has one per layer; Gemma 3's
    evicting cache one per global layer (kvlib.gemma3.evicting_cache)."""

    def __init__(self, budget: int, policy, kv_heads: int, head_dim: int, dtype):
        self.budget, self.policy, self.kv_heads, self.head_dim = budget, policy, kv_heads, head_dim
        self.positions = np.zeros((kv_heads, 0), dtype=np.int64)
        self.scores = np.zeros((kv_heads, 0))
        self.keys = self.values = np.zeros((kv_heads, 0, head_dim), dtype=dtype)
        self.length, self.first_pass = 0, True

    @property
    def n_held(self) -> int:
        return self.positions.shape[1]

    def append(self, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A pass's rows K, V (T, kv x dh) at the next positions -> every row attention reads,
        held and new: (held + T, kv x dh) each, K/V head by K/V head in its columns."""
        n_new = len(K)
        new_positions = np.arange(self.length, self.length + n_new)
        self.first_pass = self.length == 0
        self.positions = np.concatenate(
            [self.positions, np.broadcast_to(new_positions, (self.kv_heads, n_new))], axis=1)
        self.keys = np.concatenate([self.keys, self._split(K)], axis=1)
        self.values = np.concatenate([self.values, self._split(V)], axis=1)
        self.scores = np.concatenate([self.scores, np.zeros((self.kv_heads, n_new))], axis=1)
        self.length += n_new
        return merged(self.keys), merged(self.values)

    def _split(self, rows: np.ndarray) -> np.ndarray:
        """(T, kv x dh) -> (kv, T, dh)."""
        return rows.reshape(len(rows), self.kv_heads, self.head_dim).transpose(1, 0, 2)

    def observe(self, weights: np.ndarray) -> None:
        """After the pass's attention, weights (h, T, held + T): add them to the scores, then,
        over budget, keep what the policy chooses."""
        grouped = weights.reshape(self.kv_heads, -1, *weights.shape[1:])   # (kv, h/kv, T, S)
        self.scores = self.scores + grouped.sum(axis=(1, 2))
        if self.n_held <= self.budget:
            return
        kept = self.policy.keep(self.positions, self.scores, grouped, self.budget,
                                self.first_pass)
        self.positions = np.take_along_axis(self.positions, kept, axis=1)
        self.scores = np.take_along_axis(self.scores, kept, axis=1)
        self.keys = np.take_along_axis(self.keys, kept[:, :, None], axis=1)
        self.values = np.take_along_axis(self.values, kept[:, :, None], axis=1)

    def forget_from(self, n: int) -> None:
        """Drop the positions from n on, when nothing was evicted (every head holds 0 .. length)."""
        kept = self.positions[0] < n
        self.positions, self.scores = self.positions[:, kept], self.scores[:, kept]
        self.keys, self.values = self.keys[:, kept], self.values[:, kept]
        self.length = n

    @property
    def evicted(self) -> bool:
        return self.n_held < self.length

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def index_bytes(self) -> int:
        return self.positions.nbytes + self.scores.nbytes

    def state(self) -> tuple:
        return (self.positions, self.scores, self.keys, self.values, self.length, self.first_pass)

    def put_back(self, state: tuple) -> None:
        (self.positions, self.scores, self.keys, self.values, self.length,
         self.first_pass) = state


def merged(rows: np.ndarray) -> np.ndarray:
    """(kv, S, dh) -> (S, kv x dh): row j of head k sits in head k's columns; a head's row j
    and another head's row j may be different positions."""
    kv, n_rows, head_dim = rows.shape
    return rows.transpose(1, 0, 2).reshape(n_rows, kv * head_dim)


class EvictingCache(BaseKVCache):
    """A cache that holds at most `budget` positions a layer and lets a policy choose them
    (keeping_what_attention_reads).

    One EvictingLayer per layer. A pass appends its rows and attention reads every held row
    and the new ones; then ``observe`` hands the weights to the policy, which keeps `budget`
    of them. So between two passes a layer holds at most its budget (SnapKV: its prompt at
    most the budget, plus every later token), and a pass of T tokens reads at most budget + T
    rows.

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
        self.policy = as_policy(policy)
        self.budgets = _as_budgets(budget, config.n_layers)
        for layer_budget in set(self.budgets):
            self.policy.check(layer_budget)
        self.width = config.kv_width
        self.reset()

    # ---------------------------------------------------------------- what is held

    def held_positions(self, layer: int) -> np.ndarray:
        """The positions a layer holds, per K/V head, in position order: (kv, held)."""
        return self._layers[self._check_layer(layer)].positions.copy()

    def keys(self, layer: int) -> np.ndarray:
        """The held keys, K/V head by K/V head in its columns: (held, kv_width)."""
        return merged(self._layers[self._check_layer(layer)].keys)

    def values(self, layer: int) -> np.ndarray:
        return merged(self._layers[self._check_layer(layer)].values)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: 2 (K and V) x the rows of every layer and head x dh x bytes."""
        return sum(layer.nbytes for layer in self._layers)

    @property
    def index_bytes(self) -> int:
        """Bytes kept beside the rows: each held row's position and score, per K/V head."""
        return sum(layer.index_bytes for layer in self._layers)

    def _describe(self) -> str:
        held = sorted({layer.n_held for layer in self._layers})
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
        most = max(layer.n_held for layer in self._layers)
        return np.arange(n - most, n + n_new)

    def mask_for(self, layer: int, mask):
        """The pass's mask cut to this layer's rows: the last columns (layers may hold fewer)."""
        if mask is None:
            return None
        return mask[:, mask.shape[1] - self._layers[layer].n_held:]

    def _store(self, layer: int, K: np.ndarray, V: np.ndarray):
        self._lengths[layer] += len(K)
        return self._layers[layer].append(K, V)

    def observe(self, layer: int, weights: np.ndarray) -> None:
        """After a layer's attention: weights (h, T, S) over the rows it read. Add them to the
        scores, then, over budget, keep what the policy chooses."""
        self._layers[layer].observe(weights)

    # ---------------------------------------------------------------- going back

    def truncate(self, n: int) -> None:
        """Go back to n positions: to 0 always; to n < len only while nothing was evicted (what
        was dropped to make room is gone, so the cache could not be what it was at n)."""
        n = self._check_truncate(n)
        if n == 0:
            self.reset()
            return
        if n < len(self) and any(layer.evicted for layer in self._layers):
            raise ValueError(f"cannot truncate an evicting cache from {len(self)} to {n} "
                             "positions: it dropped positions since, and the ones dropped to "
                             "make room are gone. Keep a checkpoint() and restore() it instead")
        for layer in self._layers:
            layer.forget_from(n)
        self._lengths = [n] * self.config.n_layers

    def reset(self) -> None:
        config = self.config
        self._layers = [EvictingLayer(budget, self.policy, config.kv_heads, config.head_dim,
                                      config.numpy_dtype) for budget in self.budgets]
        self._lengths = [0] * config.n_layers

    def _state(self):
        return tuple(self._lengths), [layer.state() for layer in self._layers]

    def _put_back(self, state) -> None:
        lengths, layers = state
        self._lengths = list(lengths)
        for layer, layer_state in zip(self._layers, layers):
            layer.put_back(layer_state)


def as_policy(policy):
    """A policy object from a name of POLICIES or an object (the door of EvictingCache and
    kvlib.gemma3.evicting_cache)."""
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
