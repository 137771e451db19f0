"""The cache of a hybrid model (Qwen3-Next, Qwen3.5): K and V rows for the attention layers,
a fixed-size state for the DeltaNet layers.

The two halves behave differently, and this is the point of the lesson:

- the attention layers' rows grow by one a token (a kvlib KVCache holds them), so their
  bytes grow with the sequence, and forgetting the last tokens is free: keep the first n
  rows (truncate);
- a DeltaNet layer's state (the convolution's last K - 1 inputs and the delta rule's
  matrix per head, kvlib.deltanet.DeltaNetState) has the same size at 10 tokens as at
  100,000, but it has mixed every token into one matrix: the state after n tokens cannot be
  recovered from the state after n + 5. Rolling back (a rejected speculative draft) or
  reusing a prefix needs the state as it was at n, kept beforehand: a snapshot.

HybridCache(config, snapshot_every=N) keeps a snapshot of every DeltaNet state each time the
sequence reaches a multiple of N (kvlib.hybrid's prefill splits a prompt there), and
snapshot() keeps one now. truncate(n) works at n = 0, at the current length, and at a
snapshot; anywhere else it refuses, and says why. Snapshots' bytes are counted apart from
what the cache needs to continue (nbytes): snapshot_nbytes.

The interface is kvlib's caches' (kvlib/cache.py): len(cache), nbytes, truncate(n), reset(),
checkpoint() / restore(state), so that a pass that fails half-way leaves the cache as it was.
Nothing here changes an array in place except the KV rows past the sequence's end: the
states are replaced, never modified, so a checkpoint holds references, not copies.
"""

from __future__ import annotations

from .cache import KVCache
from .checks import as_count, as_instance, as_rows, as_whole_number, as_whole_numbers
from .config import ModelConfig
from .deltanet import DeltaNetState, HybridConfig


def _kv_storage(config: HybridConfig) -> ModelConfig:
    """A kvlib ModelConfig that sizes a KVCache for the attention layers only: one row of
    n_kv_heads x head_dim for K and for V, a position each."""
    return ModelConfig(vocab_size=config.vocab_size, d_model=config.n_heads * config.head_dim,
                       n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                       n_layers=len(config.attention_layers), d_ff=1,
                       context_length=config.context_length, dtype=config.dtype)


class HybridCache:
    """K and V rows of the attention layers, the state of the DeltaNet layers.

    config: the model's HybridConfig. capacity: positions the attention layers hold (the
    context length by default). snapshot_every: None, or N: keep the DeltaNet states at
    every multiple of N positions, so that truncate can return there.
    """

    def __init__(self, config: HybridConfig, capacity: int | None = None,
                 snapshot_every: int | None = None):
        if not isinstance(config, HybridConfig):
            raise TypeError(f"HybridCache needs a HybridConfig, got {type(config).__name__}")
        self.config = config
        self.snapshot_every = None if snapshot_every is None else \
            as_count("snapshot_every", snapshot_every, 1)
        self.slots = {layer: slot for slot, layer in enumerate(config.attention_layers)}
        self.kv = KVCache(_kv_storage(config), capacity) if self.slots else None
        self.capacity = config.context_length if self.kv is None else self.kv.capacity
        self._length = 0
        self._states = {layer: DeltaNetState.zeros(config) for layer in config.deltanet_layers}
        self._snapshots: dict[int, dict[int, DeltaNetState]] = {}

    # ------------------------------------------------------------------ what is held

    def __len__(self) -> int:
        """Positions in the sequence so far: the next token's position."""
        return self._length

    def __repr__(self) -> str:
        return (f"HybridCache({self._length} of {self.capacity} positions; "
                f"{len(self.slots)} attention layers, {self.kv_nbytes:,} bytes of K and V; "
                f"{len(self._states)} DeltaNet layers, {self.state_nbytes:,} bytes of state; "
                f"{len(self._snapshots)} snapshots, {self.snapshot_nbytes:,} bytes)")

    def state(self, layer: int) -> DeltaNetState:
        """The state of DeltaNet layer `layer` (its index among all layers) after the
        sequence so far."""
        if as_whole_number("layer", layer) not in self._states:
            raise ValueError(f"layer {layer!r} is not a DeltaNet layer: they are "
                             f"{self.config.deltanet_layers}")
        return self._states[layer]

    def keys(self, layer: int):
        """The K rows (T, n_kv_heads x head_dim) of attention layer `layer`."""
        return self.kv.keys(self._slot(layer))

    def values(self, layer: int):
        """The V rows (T, n_kv_heads x head_dim) of attention layer `layer`."""
        return self.kv.values(self._slot(layer))

    def _slot(self, layer) -> int:
        if as_whole_number("layer", layer) not in self.slots:
            raise ValueError(f"layer {layer!r} is not an attention layer: they are "
                             f"{self.config.attention_layers}")
        return self.slots[layer]

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the attention layers' K and V rows: they grow with the sequence."""
        return 0 if self.kv is None else self.kv.nbytes

    @property
    def state_nbytes(self) -> int:
        """Bytes of the DeltaNet layers' states: the same at every length."""
        return sum(state.nbytes for state in self._states.values())

    @property
    def nbytes(self) -> int:
        """Bytes needed to continue the sequence: K and V rows plus the states (snapshots
        are counted apart, snapshot_nbytes)."""
        return self.kv_nbytes + self.state_nbytes

    @property
    def snapshot_nbytes(self) -> int:
        """Bytes of the kept snapshots: a full set of DeltaNet states each."""
        return sum(state.nbytes for states in self._snapshots.values()
                   for state in states.values())

    @property
    def snapshot_positions(self) -> tuple[int, ...]:
        """Where truncate can return to besides 0 and the current length."""
        return tuple(sorted(self._snapshots))

    # ------------------------------------------------------------------ used by a pass

    def append(self, layer: int, K, V):
        """Write an attention layer's new K and V rows (n_new, n_kv_heads x head_dim) after
        its last one; -> all its rows (kvlib.KVCache.append)."""
        width = self.config.n_kv_heads * self.config.head_dim
        K = as_rows("K", K, width)
        V = as_rows("V", V, width, len(K))
        return self.kv.append(self._slot(layer), K, V)

    def set_state(self, layer: int, state: DeltaNetState) -> None:
        """Replace a DeltaNet layer's state by the one after this pass's tokens."""
        self.state(layer)
        if not isinstance(state, DeltaNetState):
            raise TypeError(f"state must be a DeltaNetState, got {type(state).__name__}")
        self._states[layer] = state

    def advance(self, n_new: int) -> None:
        """End of a pass of n_new tokens through every layer: the sequence is longer, and a
        snapshot is kept if it reached a multiple of snapshot_every."""
        self._length += as_count("n_new", n_new, 1)
        if self.kv is not None and set(self.kv.lengths) != {self._length}:
            raise ValueError(f"the attention layers hold {list(self.kv.lengths)} positions, "
                             f"not {self._length}: a pass skipped a layer")
        if self.snapshot_every and self._length % self.snapshot_every == 0:
            self.snapshot()

    # ------------------------------------------------------------------ going back

    def snapshot(self) -> None:
        """Keep the DeltaNet states at the current length, so that truncate can return here
        (before a speculative draft is checked, for example)."""
        if self._length:
            self._snapshots[self._length] = dict(self._states)

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n-1 and forget the rest.

        The attention rows can always be cut; a DeltaNet state can only be returned to a
        length where it was kept: n = 0 (zeros), the current length (nothing to do), or a
        snapshot (snapshot_positions). Anywhere else this raises a ValueError and changes
        nothing. Snapshots past n are dropped.
        """
        n = as_whole_number("truncate's n", n, 0)
        if n > self._length:
            raise ValueError(f"cannot truncate to {n} positions: the cache holds "
                             f"{self._length}")
        if n == self._length:
            return
        if n and n not in self._snapshots:
            kept = ", ".join(map(str, self.snapshot_positions)) or "none"
            raise ValueError(
                f"cannot truncate to {n} positions: a DeltaNet layer keeps one state that "
                f"has mixed all {self._length} tokens together, and the last "
                f"{self._length - n} cannot be taken out of it. Only the state at a "
                f"snapshot can be returned to (kept at: {kept}); make the cache with "
                "snapshot_every=N, or call cache.snapshot() before the tokens you may "
                "want to undo")
        self._states = dict(self._snapshots[n]) if n else \
            {layer: DeltaNetState.zeros(self.config) for layer in self._states}
        self._snapshots = {at: states for at, states in self._snapshots.items() if at <= n}
        if self.kv is not None:
            self.kv.truncate(n)
        self._length = n

    def reset(self) -> None:
        """Forget everything, snapshots included."""
        self._snapshots = {}
        self.truncate(0)

    def checkpoint(self):
        """What restore needs to undo a pass that failed half-way: the length, the KV
        lengths and references to the states and snapshots (which are never changed in
        place)."""
        kv = None if self.kv is None else self.kv.checkpoint()
        return self._length, kv, dict(self._states), dict(self._snapshots)

    def restore(self, saved) -> None:
        """Put back what this cache's checkpoint() returned."""
        if not (isinstance(saved, tuple) and len(saved) == 4 and isinstance(saved[2], dict)
                and isinstance(saved[3], dict) and (saved[1] is None) == (self.kv is None)):
            raise ValueError(f"saved must be what this cache's checkpoint() returned, got "
                             f"{type(saved).__name__}")
        self._length, kv, states, snapshots = saved
        if self.kv is not None:
            self.kv.restore(kv)
        self._states, self._snapshots = dict(states), dict(snapshots)


# ---------------------------------------------------------------------- prefix reuse on a grid

def resumable_length(shared: int, n_prompt: int, every: int) -> int:
    """How many of a new prompt's n_prompt tokens need not be computed again (state_layers),
    when a cached sequence shares its first `shared` tokens and its DeltaNet states were kept
    at every multiple of `every` positions (HybridCache's snapshot_every; vLLM's block size).

    The state can only be resumed where it was kept: the largest multiple of `every` that is
    at most the shared prefix and at most n_prompt - 1 (the prompt's last token is always
    computed: its logits give the first new token). A KV cache of blocks of `every` positions
    reuses the same number. -> 0 .. n_prompt - 1.
    """
    n_prompt = as_count("n_prompt", n_prompt, 1)
    shared = as_whole_number("shared", shared, 0)
    every = as_count("every", every, 1)
    return min(shared, n_prompt - 1) // every * every


def common_prefix(first, second) -> int:
    """How many ids two sequences share from the start (state_layers)."""
    length = 0
    first, second = as_whole_numbers("first", first), as_whole_numbers("second", second)
    for a, b in zip(first.tolist(), second.tolist()):
        if a != b:
            break
        length += 1
    return length


def prefix_hits(prompts, every: int) -> list[int]:
    """For a workload of prompts served one after another, the tokens of each that a cache
    with states kept every `every` positions lets it skip: resumable_length against the
    earlier prompt that shares the most with it (only prompts are cached here, not the
    replies). prompts: a list of lists of token ids -> a list of counts (state_layers)."""
    every = as_count("every", every, 1)
    prompts = [as_whole_numbers("a prompt", prompt, empty=False).tolist()
               for prompt in as_instance("prompts", prompts, (list, tuple), "a list of prompts")]
    hits = []
    for index, prompt in enumerate(prompts):
        shared = max((common_prefix(earlier, prompt) for earlier in prompts[:index]), default=0)
        hits.append(resumable_length(shared, len(prompt), every))
    return hits
