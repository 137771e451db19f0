"""Requests arriving, decoding and finishing in one pool of blocks, step by step
(paged_cache's widget and its measurements over time).

A PoolTimeline runs the real model: every request is prefilled into a PagedKVCache of one
shared BlockAllocator when it arrives and blocks are free, decodes one token per step, and
gives its blocks back when it is done. A running sequence can be forked (parallel
sampling): the fork shares every block until one of them writes into a shared block, which
is then copied (copy-on-write). When a sequence needs a block and none is free, the latest
admitted sequence is preempted: its blocks are freed and it waits to be recomputed (vLLM's
recompute preemption), with the same tokens.

The snapshots in ``history`` set the bytes in use beside what contiguous caches would have
reserved for the same sequences: the context length each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

from ..checks import count, real_number, whole_number
from ..inference import choose_next_token, decode_step, prefill
from ..params import Params
from .blocks import BlockAllocator
from .memory_plan import Request, blocks_for
from .paged import PagedKVCache

TOLERANCE = 1e-10
NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def request_name(index: int) -> str:
    """A, B, ..., Z, then A1, B1, ...: short enough to write inside a drawn block."""
    index = whole_number("index", index, 0)
    letter, lap = NAMES[index % len(NAMES)], index // len(NAMES)
    return letter if lap == 0 else f"{letter}{lap}"


@dataclass(eq=False)      # two sequences are the same only if they are the same object
class Sequence:
    """One sequence being served: its tokens so far (all of them in its cache while it
    runs), the token chosen next but not yet fed, and its own seeded random generator, so
    that its samples do not depend on when it ran or how often it was recomputed."""

    name: str
    request: int
    tokens: list[int]
    target_length: int                 # positions its cache holds when it is done
    rng: np.random.Generator
    pending: int | None = None         # chosen from the last logits, not yet fed
    last_logits: np.ndarray | None = None
    cache: PagedKVCache | None = None
    forks: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.target_length


@dataclass(frozen=True)
class Snapshot:
    """The pool after one step: positions written (shared ones once), blocks taken, what
    contiguous caches of the context length would reserve for the same running sequences
    (one each: without blocks to share, a fork is a whole copy), and the pool's size."""

    step: int
    running: tuple[str, ...]
    waiting: int
    used_positions: int
    blocks_in_use: int
    block_size: int
    reserved_positions: int
    pool_positions: int

    @property
    def paged_positions(self) -> int:
        return self.blocks_in_use * self.block_size


class PoolTimeline:
    """Serve `requests` (memory_plan.Request) in one pool of n_blocks blocks, step by step.

    One call of step() is one engine step: every running sequence decodes one token
    (preempting the latest admitted one when a block is needed and none is free), the
    sequences that reached their length are retired and their blocks freed, then waiting
    requests are admitted first come, first served, while their prompt's blocks fit.
    Prompts are seeded random token ids; tokens are sampled at `temperature` (0: greedy).
    """

    def __init__(self, params: Params, requests, n_blocks: int, block_size: int = 4,
                 seed: int = 0, temperature: float = 1.0):
        if not isinstance(params, Params):
            raise TypeError(f"PoolTimeline needs kvlib Params, got {type(params).__name__}")
        if not isinstance(requests, (list, tuple)):
            raise TypeError("requests must be a list of kvlib.serving.Request")
        requests = list(requests)
        if not requests or not all(isinstance(r, Request) for r in requests):
            raise TypeError("requests must be a non-empty list of kvlib.serving.Request")
        if isinstance(seed, bool) or not isinstance(seed, Integral) or seed < 0:
            raise TypeError(f"seed must be a whole number >= 0, got {seed!r}")
        self.params, self.config = params, params.config
        self.allocator = BlockAllocator(self.config, n_blocks, block_size)
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, Real):
            raise TypeError(f"temperature must be a number (0 for greedy), got {temperature!r}")
        self.temperature = real_number("temperature", temperature, minimum=0)
        choose_next_token(np.zeros(2), self.temperature)      # refuses a bad temperature now
        context = self.config.context_length
        for index, request in enumerate(requests):
            if request.length > context:
                raise ValueError(f"request {request_name(index)} needs {request.length} "
                                 f"positions; the context length is {context}")
            if blocks_for(request.length, block_size) > self.allocator.n_blocks:
                raise ValueError(f"request {request_name(index)} needs "
                                 f"{blocks_for(request.length, block_size)} blocks of "
                                 f"{block_size}; the pool has only {self.allocator.n_blocks}")
        self.requests = requests
        rng = np.random.default_rng(seed)
        self._arrivals = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        self._sequences = {}
        for index, request in enumerate(requests):
            prompt = [int(t) for t in rng.integers(0, self.config.vocab_size,
                                                   request.prompt_length)]
            self._sequences[index] = Sequence(
                request_name(index), index, prompt, request.length,
                np.random.default_rng([seed, index, 0]))
        self.seed = seed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.step_number = 0
        self.preemptions = 0
        self._fork_count = 0
        self.events: list[str] = []
        self.copied_blocks: set[int] = set()     # blocks made by copy-on-write in the last step
        self.history: list[Snapshot] = [self.snapshot()]

    def __repr__(self) -> str:
        return (f"PoolTimeline(step {self.step_number}: {len(self.running)} running, "
                f"{len(self.waiting)} waiting, {len(self.finished)} finished; {self.allocator})")

    # ------------------------------------------------------------------ what is going on

    @property
    def all_done(self) -> bool:
        return not (self._arrivals or self.waiting or self.running)

    @property
    def n_forks(self) -> int:
        """Sequences made by fork() so far: running and finished count them beside the
        requests' own sequences."""
        return self._fork_count

    @property
    def requests_done(self) -> int:
        """Requests none of whose sequences (its own, its forks) still runs or waits."""
        busy = {seq.request for seq in self.running} | {seq.request for seq in self.waiting}
        return len({seq.request for seq in self.finished} - busy)

    def sequence(self, name: str) -> Sequence:
        if not isinstance(name, str):
            raise TypeError(f"name must be a running sequence's name (a string such as 'A'), "
                            f"got {name!r}")
        for seq in self.running:
            if seq.name == name:
                return seq
        raise ValueError(f"no running sequence is called {name!r}; running: "
                         f"{[s.name for s in self.running]}")

    def block_tables(self) -> dict[str, list[int]]:
        """Each running sequence's block table, by name."""
        return {seq.name: list(seq.cache.block_table) for seq in self.running}

    def positions_written(self) -> int:
        """Positions of the pool that hold a token's K and V: a block shared by several
        sequences counts once, as full as the fullest of them."""
        size, filled = self.allocator.block_size, {}
        for seq in self.running:
            for index, block in enumerate(seq.cache.block_table):
                used = min(size, len(seq.tokens) - index * size)
                filled[block] = max(filled.get(block, 0), used)
        return sum(filled.values())

    def snapshot(self) -> Snapshot:
        return Snapshot(
            step=self.step_number, running=tuple(seq.name for seq in self.running),
            waiting=len(self.waiting),
            used_positions=self.positions_written(),
            blocks_in_use=self.allocator.n_used, block_size=self.allocator.block_size,
            reserved_positions=len(self.running) * self.config.context_length,
            pool_positions=self.allocator.n_blocks * self.allocator.block_size)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[str]:
        """One engine step; returns (and keeps in .events) what happened, in words."""
        self.events, self.copied_blocks = [], set()
        for seq in list(self.running):
            if seq in self.running:
                self._decode(seq)
        for seq in [s for s in self.running if s.done]:
            self._retire(seq)
        while self._arrivals and self.requests[self._arrivals[0]].arrival <= self.step_number:
            self.waiting.append(self._sequences[self._arrivals.popleft()])
        while self.waiting and self._admit(self.waiting[0]):
            self.waiting.popleft()
        self.step_number += 1
        self.history.append(self.snapshot())
        return self.events

    def run(self, max_steps: int = 10_000) -> list[Snapshot]:
        """step() until every request is done (at most max_steps steps); the history."""
        for _ in range(count("max_steps", max_steps)):
            if self.all_done:
                break
            self.step()
        return self.history

    def _needs_block(self, seq: Sequence) -> bool:
        """Whether writing the next position takes a block: a new one, or a copy of a
        shared one."""
        cache, size = seq.cache, self.allocator.block_size
        index = len(cache) // size
        if index == len(cache.block_table):
            return True
        return self.allocator.ref_counts[cache.block_table[index]] > 1

    def _decode(self, seq: Sequence) -> None:
        while self._needs_block(seq) and self.allocator.n_free == 0:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return
        before = list(seq.cache.block_table)
        logits = decode_step(self.params, seq.pending, seq.cache)
        seq.tokens.append(seq.pending)
        seq.output.append(seq.pending)
        after = seq.cache.block_table
        if len(after) > len(before):
            self.events.append(f"{seq.name} took block {after[-1]}")
        for old, new in zip(before, after):
            if old != new:
                self.copied_blocks.add(new)
                self.events.append(f"{seq.name} wrote into shared block {old}: copied to "
                                   f"block {new} (copy-on-write)")
        self._choose(seq, logits[-1])

    def _choose(self, seq: Sequence, logits_row: np.ndarray) -> None:
        seq.last_logits = logits_row
        seq.pending = None if seq.done else choose_next_token(logits_row, self.temperature,
                                                               rng=seq.rng)

    def _retire(self, seq: Sequence) -> None:
        n_blocks = len(seq.cache.block_table)
        seq.cache.free()
        seq.cache = None
        self.running.remove(seq)
        self.finished.append(seq)
        self.events.append(f"{seq.name} finished with {len(seq.tokens)} positions: released "
                           f"its {n_blocks} block references")

    def _preempt(self, seq: Sequence) -> None:
        n_blocks = len(seq.cache.block_table)
        seq.cache.free()
        seq.cache = None
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.events.append(f"no free block: {seq.name} preempted, its {n_blocks} block "
                           "references released; it waits to be recomputed")

    def _admit(self, seq: Sequence) -> bool:
        needed = blocks_for(len(seq.tokens), self.allocator.block_size)
        if needed > self.allocator.n_free:
            return False
        seq.cache = PagedKVCache(self.allocator)
        logits, _ = prefill(self.params, seq.tokens, seq.cache, last_only=True)
        self.running.append(seq)
        if seq.pending is None:              # a new request: choose its first token
            self._choose(seq, logits[-1])
            self.events.append(f"{seq.name} arrived: {len(seq.tokens)} prompt tokens "
                               f"prefilled into blocks {seq.cache.block_table}")
        else:                                # preempted before: its K and V recomputed
            self.events.append(f"{seq.name} recomputed: {len(seq.tokens)} positions "
                               f"prefilled again into blocks {seq.cache.block_table}")
        return True

    # ------------------------------------------------------------------ parallel sampling

    def fork(self, name: str) -> str:
        """A second sample of running sequence `name`: it shares every block (nothing is
        copied yet) and draws its own next token from the same logits. Returns its name."""
        parent = self.sequence(name)
        parent.forks += 1
        self._fork_count += 1
        child = Sequence(
            f"{parent.name}.{parent.forks}", parent.request, list(parent.tokens),
            parent.target_length,
            np.random.default_rng([self.seed, parent.request, self._fork_count]),
            output=list(parent.output))
        child.cache = parent.cache.fork()
        self._choose(child, parent.last_logits)
        self.running.append(child)
        self.events = [f"{child.name} forked from {parent.name}: shares its blocks "
                       f"{child.cache.block_table}, nothing copied"]
        self.history[-1] = self.snapshot()
        return child.name

    # ------------------------------------------------------------------ the checks

    def check(self) -> float:
        """Largest difference between any running sequence's K and V, read through its
        block table, and a contiguous cache prefilled with its tokens; also checks that no
        block leaked (every block free or held by a block table)."""
        self.allocator.check_invariants()
        held = {block for seq in self.running for block in seq.cache.block_table}
        if len(held) != self.allocator.n_used:
            raise AssertionError(f"{self.allocator.n_used} blocks in use but the block tables "
                                 f"hold {len(held)}: a block leaked")
        worst = 0.0
        for seq in self.running:
            _, reference = prefill(self.params, seq.tokens)
            for layer in range(self.config.n_layers):
                for got, expected in ((seq.cache.keys(layer), reference.keys(layer)),
                                      (seq.cache.values(layer), reference.values(layer))):
                    worst = max(worst, float(np.max(np.abs(got - expected))))
        return worst
