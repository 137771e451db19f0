"""Requests arriving, decoding and finishing in one pool of blocks, step by step
(paged_cache's widget and its measurements over time).

A PoolTimeline runs the real model: every request is prefilled into a PagedKVCache of one
shared BlockPool when it arrives and blocks are free, decodes one token per step, and gives
its blocks back when it is done. A running sequence can be forked (parallel sampling, the
PagedAttention paper's way): the fork is a request of its own that shares every block until
one of them writes into a shared block, which is then copied (copy-on-write). When a sequence
needs a block and none is free, the latest admitted sequence is preempted: its blocks are
freed and it waits to be recomputed (vLLM's recompute preemption), with the same tokens.

Each sequence is a kvlib.serving.Request named A, B, ... (its request_id; a fork of A is
A.1): all_token_ids holds the tokens its cache holds, output_token_ids the generated ones
among them, block_table its cache's. The snapshots in ``history`` set the bytes in use beside
what contiguous caches would have reserved for the same sequences: the context length each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..checks import as_count, as_real_number, as_whole_number
from ..inference import choose_next_token, decode_step, prefill
from ..params import Params
from .block_pool import BlockPool
from .memory_plan import blocks_for
from .paged import PagedKVCache
from .request import FINISHED, RUNNING, WAITING, Request, SamplingParams

NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def request_name(index: int) -> str:
    """A, B, ..., Z, then A1, B1, ...: short enough to write inside a drawn block."""
    index = as_whole_number("index", index, 0)
    letter, lap = NAMES[index % len(NAMES)], index // len(NAMES)
    return letter if lap == 0 else f"{letter}{lap}"


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
    """Serve `requests` (kvlib.serving.Request) in one pool of n_blocks blocks, step by step.

    One call of step() is one engine step: every running sequence decodes one token
    (preempting the latest admitted one when a block is needed and none is free), the
    sequences that reached their length (prompt + max_tokens) are retired and their blocks
    freed, then waiting requests are admitted first come, first served, while their prompt's
    blocks fit. Tokens are sampled at `temperature` (0: greedy), each sequence with its own
    generator seeded by (seed, request, fork), so that its samples do not depend on when it
    ran or how often it was recomputed.
    """

    def __init__(self, params: Params, requests, n_blocks: int, block_size: int = 4,
                 seed: int = 0, temperature: float = 1.0):
        if not isinstance(params, Params) or not isinstance(requests, (list, tuple)) or \
                not all(isinstance(r, Request) for r in requests):
            raise TypeError("PoolTimeline needs kvlib Params and a list of kvlib.serving.Request")
        self.params, self.config = params, params.config
        self.pool = BlockPool(self.config, n_blocks, block_size)
        self.temperature = as_real_number("temperature", temperature, minimum=0)
        self.seed = as_whole_number("seed", seed, 0)
        too_long = [r.request_id for r in requests if r.max_num_tokens > self.config.context_length
                    or blocks_for(r.max_num_tokens, block_size) > self.pool.n_blocks]
        if too_long or not requests:
            raise ValueError(f"requests {too_long} need more positions than the context length "
                             f"{self.config.context_length}, or more blocks than the pool's "
                             f"{self.pool.n_blocks} (and at least one request is needed)")
        self.requests = list(requests)
        self._arrivals = deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
        self._sequences = {i: self._sequence(request_name(i), r.prompt_token_ids, r, i, 0)
                           for i, r in enumerate(self.requests)}
        self.caches: dict[str, PagedKVCache] = {}
        self.pending: dict[str, int | None] = {}      # chosen from the last logits, not yet fed
        self.last_logits: dict[str, np.ndarray] = {}
        self.parent: dict[str, int] = {}              # sequence -> index of its request
        self.forks: dict[str, int] = {}               # sequence -> forks made of it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.step_number = 0
        self.preemptions = 0
        self.n_forks = 0
        self.events: list[str] = []
        self.copied_blocks: set[int] = set()     # blocks made by copy-on-write in the last step
        self.history: list[Snapshot] = [self.snapshot()]

    def _sequence(self, name: str, tokens, request: Request, index: int, fork: int) -> Request:
        sequence = Request(name, tokens, SamplingParams(request.max_tokens), request.arrival)
        sequence.rng = np.random.default_rng([self.seed, index, fork])
        return sequence

    def __repr__(self) -> str:
        return (f"PoolTimeline(step {self.step_number}: {len(self.running)} running, "
                f"{len(self.waiting)} waiting, {len(self.finished)} finished; {self.pool})")

    # ------------------------------------------------------------------ what is going on

    @property
    def all_done(self) -> bool:
        return not (self._arrivals or self.waiting or self.running)

    @property
    def requests_done(self) -> int:
        """Requests none of whose sequences (its own, its forks) still runs or waits."""
        busy = {self.parent[s.request_id] for s in self.running + list(self.waiting)
                if s.request_id in self.parent}
        return len({self.parent[s.request_id] for s in self.finished} - busy)

    def sequence(self, name: str) -> Request:
        """The running sequence called name ('A', 'A.1', ...)."""
        running = {seq.request_id: seq for seq in self.running}
        if not isinstance(name, str) or name not in running:
            raise ValueError(f"no running sequence is called {name!r}; running: "
                             f"{list(running)}")
        return running[name]

    def block_tables(self) -> dict[str, list[int]]:
        """Each running sequence's block table, by name."""
        return {seq.request_id: list(seq.block_table) for seq in self.running}

    def positions_written(self) -> int:
        """Positions of the pool that hold a token's K and V: a block shared by several
        sequences counts once, as full as the fullest of them."""
        size, filled = self.pool.block_size, {}
        for seq in self.running:
            for index, block in enumerate(seq.block_table):
                used = min(size, seq.num_tokens - index * size)
                filled[block] = max(filled.get(block, 0), used)
        return sum(filled.values())

    def snapshot(self) -> Snapshot:
        return Snapshot(
            step=self.step_number, running=tuple(seq.request_id for seq in self.running),
            waiting=len(self.waiting), used_positions=self.positions_written(),
            blocks_in_use=self.pool.n_used, block_size=self.pool.block_size,
            reserved_positions=len(self.running) * self.config.context_length,
            pool_positions=self.pool.n_blocks * self.pool.block_size)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[str]:
        """One engine step; returns (and keeps in .events) what happened, in words."""
        self.events, self.copied_blocks = [], set()
        for seq in list(self.running):
            if seq in self.running:
                self._decode(seq)
        for seq in [s for s in self.running if s.num_tokens >= s.max_num_tokens]:
            self._retire(seq)
        while self._arrivals and self.requests[self._arrivals[0]].arrival <= self.step_number:
            index = self._arrivals.popleft()
            self.parent[self._sequences[index].request_id] = index
            self.waiting.append(self._sequences[index])
        while self.waiting and self._admit(self.waiting[0]):
            self.waiting.popleft()
        self.step_number += 1
        self.history.append(self.snapshot())
        return self.events

    def run(self, max_steps: int = 10_000) -> list[Snapshot]:
        """step() until every request is done (at most max_steps steps); the history."""
        for _ in range(as_count("max_steps", max_steps)):
            if self.all_done:
                break
            self.step()
        return self.history

    def _needs_block(self, seq: Request) -> bool:
        """Whether writing the next position takes a block: a new one, or a copy of a
        shared one."""
        index = seq.num_tokens // self.pool.block_size
        return index == len(seq.block_table) or self.pool.ref_counts[seq.block_table[index]] > 1

    def _decode(self, seq: Request) -> None:
        name = seq.request_id
        while self._needs_block(seq) and self.pool.n_free == 0:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return
        before = list(seq.block_table)
        logits = decode_step(self.params, self.pending[name], self.caches[name])
        seq.append_output_token(self.pending[name])
        seq.num_computed_tokens = seq.num_tokens
        after = seq.block_table
        if len(after) > len(before):
            self.events.append(f"{name} took block {after[-1]}")
        for old, new in zip(before, after):
            if old != new:
                self.copied_blocks.add(new)
                self.events.append(f"{name} wrote into shared block {old}: copied to "
                                   f"block {new} (copy-on-write)")
        self._choose(seq, logits[-1])

    def _choose(self, seq: Request, logits_row: np.ndarray) -> None:
        name = seq.request_id
        self.last_logits[name] = logits_row
        self.pending[name] = None if seq.num_tokens >= seq.max_num_tokens else \
            choose_next_token(logits_row, self.temperature, rng=seq.rng)

    def _release(self, seq: Request) -> int:
        n_blocks = len(seq.block_table)
        self.caches.pop(seq.request_id).free()
        seq.block_table, seq.num_computed_tokens = [], 0
        self.running.remove(seq)
        return n_blocks

    def _retire(self, seq: Request) -> None:
        n_blocks = self._release(seq)
        seq.status = FINISHED
        self.finished.append(seq)
        self.events.append(f"{seq.request_id} finished with {seq.num_tokens} positions: "
                           f"released its {n_blocks} block references")

    def _preempt(self, seq: Request) -> None:
        n_blocks = self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.events.append(f"no free block: {seq.request_id} preempted, its {n_blocks} block "
                           "references released; it waits to be recomputed")

    def _admit(self, seq: Request) -> bool:
        if blocks_for(seq.num_tokens, self.pool.block_size) > self.pool.n_free:
            return False
        cache = self.caches[seq.request_id] = PagedKVCache(self.pool)
        logits, _ = prefill(self.params, seq.all_token_ids, cache, last_only=True)
        seq.block_table, seq.num_computed_tokens, seq.status = cache.block_table, len(cache), \
            RUNNING
        self.running.append(seq)
        if self.pending.get(seq.request_id) is None:       # a new request: its first token
            self._choose(seq, logits[-1])
            self.events.append(f"{seq.request_id} arrived: {seq.num_tokens} prompt tokens "
                               f"prefilled into blocks {seq.block_table}")
        else:                                # preempted before: its K and V recomputed
            self.events.append(f"{seq.request_id} recomputed: {seq.num_tokens} positions "
                               f"prefilled again into blocks {seq.block_table}")
        return True

    # ------------------------------------------------------------------ parallel sampling

    def fork(self, name: str) -> str:
        """A second sample of running sequence `name`: it shares every block (nothing is
        copied yet) and draws its own next token from the same logits. Returns its name."""
        parent = self.sequence(name)
        index = self.parent[name]
        self.n_forks += 1
        self.forks[name] = self.forks.get(name, 0) + 1
        child_name = f"{name}.{self.forks[name]}"
        child = self._sequence(child_name, parent.prompt_token_ids, self.requests[index], index,
                               self.n_forks)
        for token in parent.output_token_ids:
            child.append_output_token(token)
        cache = self.caches[child_name] = self.caches[name].fork()
        child.block_table, child.num_computed_tokens, child.status = cache.block_table, \
            len(cache), RUNNING
        self.parent[child_name] = index
        self._choose(child, self.last_logits[name])
        self.running.append(child)
        self.events = [f"{child_name} forked from {name}: shares its blocks "
                       f"{child.block_table}, nothing copied"]
        self.history[-1] = self.snapshot()
        return child_name

    # ------------------------------------------------------------------ the checks

    def check(self) -> float:
        """Largest difference between any running sequence's K and V, read through its
        block table, and a contiguous cache prefilled with its tokens; also checks that no
        block leaked (every block free or held by a block table)."""
        self.pool.check_invariants()
        held = {block for seq in self.running for block in seq.block_table}
        if len(held) != self.pool.n_used:
            raise AssertionError(f"{self.pool.n_used} blocks in use but the block tables "
                                 f"hold {len(held)}: a block leaked")
        worst = 0.0
        for seq in self.running:
            _, reference = prefill(self.params, seq.all_token_ids)
            cache = self.caches[seq.request_id]
            for layer in range(self.config.n_layers):
                for got, expected in ((cache.keys(layer), reference.keys(layer)),
                                      (cache.values(layer), reference.values(layer))):
                    worst = max(worst, float(np.max(np.abs(got - expected))))
        return worst
