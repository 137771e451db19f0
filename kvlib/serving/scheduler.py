"""Which requests run in each step, and how many of their tokens (batched_decoding, the_engine;
vLLM's scheduler, nano-vllm's scheduler.py).

One Scheduler serves both lessons. Every step it spends a token budget,
max_num_batched_tokens (None: no limit), on at most max_num_seqs requests:

1. running requests first, in the order they started: each its next token (a decode) or the
   next chunk of its prompt. A request that needs a block when none is left makes the newest
   running request give its blocks back and wait at the front of the queue (preemption by
   recomputation: it keeps the tokens it produced and prefills them again later);
2. then, if nobody was preempted, waiting requests first come, first served, while the budget
   and the blocks last, each starting after its longest cached prefix. A prompt longer than
   what is left of the budget is cut to it (chunked prefill), or, with chunked prefill off,
   waits; a waiting request that does not fit stops the admissions: the queue never skips it.

Full blocks enter the prefix cache after the step that filled them has run (nano-vllm's
hash_blocks in postprocess, SGLang's cache_unfinished_req after the forward), or, with
cache_when_scheduled, as soon as the step that will fill them is scheduled (vLLM V1: allocate_slots
calls cache_blocks), so that a request admitted later in the same step already reuses them. The
engine writes a step's K and V into the pool before any attention reads it, as vLLM does, so
both are correct. The n completions of one request (n > 1) always cache when scheduled: they
are queued together, and the first one's prompt blocks are the others' prefix.

Static batching (static=True) admits waiting requests only when no request runs, and the
batch then runs until its last request finishes; continuous batching re-forms the batch every
step (iteration-level scheduling, Orca: Yu et al., OSDI 2022). StaticBatching and
ContinuousBatching are the batched_decoding lesson's two policies: whole prompts, no chunks.

serve() runs a scheduler over a stream of requests and returns the Timeline of its steps, on
a clock of model steps (the same on every machine) or of measured seconds; without a model
(the batched_decoding lesson's scheduling alone) or with a ModelRunner, which prefills each
admitted request into its own cache and decodes the others in one batched_decode_step. The
engine (the_engine) runs the same scheduler with block attention over its pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..cache import KVCache
from ..checks import as_count, as_flag
from ..inference import prefill
from ..params import Params
from .batch import attend_per_sequence, batched_decode_step
from .block_pool import ROOT_KEY, BlockPool, block_key
from .request import ABORT, FINISHED, LENGTH, RUNNING, STOP, WAITING, Request, RequestOutput
from .timeline import Step, Timeline

NO_LIMIT = 2**62
"""The token budget of a step when max_num_batched_tokens is None."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler fills a step (vLLM's SchedulerConfig): at most max_num_seqs requests
    running, at most max_num_batched_tokens tokens a step (None: no limit), long prompts cut
    into chunks of the budget (enable_chunked_prefill), static batching or continuous, and
    when a full block becomes reusable: after the step that fills it (False, kvlib's default:
    nano-vllm, SGLang) or when that step is scheduled (cache_when_scheduled=True: vLLM V1)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 256
    enable_chunked_prefill: bool = True
    static: bool = False
    cache_when_scheduled: bool = False

    def __post_init__(self):
        as_count("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            as_count("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        as_flag("enable_chunked_prefill", self.enable_chunked_prefill)
        as_flag("static", self.static)
        as_flag("cache_when_scheduled", self.cache_when_scheduled)

    @property
    def name(self) -> str:
        return "static" if self.static else "continuous"

    @property
    def max_batch(self) -> int:
        """batched_decoding's word for max_num_seqs."""
        return self.max_num_seqs

    @property
    def budget(self) -> int:
        return NO_LIMIT if self.max_num_batched_tokens is None else self.max_num_batched_tokens


def StaticBatching(max_batch: int = 4, max_batched_tokens: int | None = None) -> SchedulerConfig:
    """Form a batch only when the previous one has finished entirely (batched_decoding): up to
    max_batch waiting requests, first come first served, whole prompts, then none until all
    are done. transformers' generate on a list of prompts is this: one batch, run to its end."""
    return _lesson_policy(max_batch, max_batched_tokens, static=True)


def ContinuousBatching(max_batch: int = 4,
                       max_batched_tokens: int | None = None) -> SchedulerConfig:
    """Re-form the batch every step (batched_decoding; Orca's iteration-level scheduling):
    finished requests leave after their last token, waiting requests fill the free slots in
    the next step, first come first served, whole prompts. Each running request's decode
    takes one token of the step's budget."""
    return _lesson_policy(max_batch, max_batched_tokens, static=False)


def _lesson_policy(max_batch, max_batched_tokens, static: bool) -> SchedulerConfig:
    config = SchedulerConfig(max_batch, max_batched_tokens, enable_chunked_prefill=False,
                             static=static)
    if config.budget < config.max_num_seqs:
        raise ValueError(f"max_batched_tokens ({max_batched_tokens}) must be at least "
                         f"max_batch ({max_batch}): a full batch of decodes needs one token "
                         "each (vLLM refuses this too)")
    return config


@dataclass
class StepRecord:
    """What one step did (engine.last_step, for the_engine lesson): scheduled_tokens
    {id: tokens}, admitted [ids] (from the queue this step), prefill_chunks {id: (first
    position, tokens)} and decodes [ids], preempted, finished, the blocks hit (prefix
    cache) and the tokens they hold {id: tokens}, taken, freed and evicted; seconds, how
    long the step took on this machine. batch [(request, tokens)] is what the model step
    runs."""

    step: int
    seconds: float = 0.0
    scheduled_tokens: dict[int, int] = field(default_factory=dict)
    admitted: list[int] = field(default_factory=list)
    prefill_chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    decodes: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    hit_blocks: dict[int, list[int]] = field(default_factory=dict)
    hit_tokens: dict[int, int] = field(default_factory=dict)
    taken_blocks: list[int] = field(default_factory=list)
    freed_blocks: list[int] = field(default_factory=list)
    evicted_blocks: list[int] = field(default_factory=list)
    batch: list[tuple[Request, int]] = field(default_factory=list, repr=False)


class Scheduler:
    """The waiting queue, the running requests and the pool their blocks come from
    (batched_decoding, the_engine). add_request(request); schedule(step) -> StepRecord;
    update(record, sampled {id: token}) after the model step -> [RequestOutput];
    abort(request, step) between steps."""

    def __init__(self, pool: BlockPool, config: SchedulerConfig):
        self.pool, self.config = pool, config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        request.status = WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the policy

    def schedule(self, step: int) -> StepRecord:
        """Fill a StepRecord for this step, taking and freeing blocks as it goes."""
        record = StepRecord(step)
        self._free_skipped_blocks(record)
        budget = self._schedule_running(record, self.config.budget)
        if not record.preempted and not (self.config.static and self.running):
            self._schedule_waiting(record, budget)
        return record

    def _free_skipped_blocks(self, record: StepRecord) -> None:
        """Before scheduling: free the blocks no running request will read again (none here:
        every layer is global; kvlib.serving.gemma3_engine's scheduler frees sliding ones)."""

    def _schedule_running(self, record: StepRecord, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            n_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self._blocks_needed(request, n_new) > self.pool.n_free:
                victim = self.running.pop()                # the newest request
                self._preempt(victim, record)
                if victim is request:
                    break
            if request.status != RUNNING:
                break
            self._allocate(request, n_new, record)
            self._run(request, n_new, record)
            budget -= n_new
            index += 1
        return budget

    def _schedule_waiting(self, record: StepRecord, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, computed = self._cached_prefix_of(request)
            n_new = request.num_tokens - computed
            if n_new > budget:
                if not self.config.enable_chunked_prefill and n_new <= self.config.budget:
                    break                   # whole prompts only: wait for a step with room
                n_new = budget              # a chunk (or a resumed request that outgrew it)
            if self._blocks_to_admit(hits, computed + n_new) > self.pool.n_free:
                break                                      # first come, first served: wait
            self.waiting.popleft()
            self._hold_hits(request, hits, computed)
            self._allocate(request, n_new, record)
            request.status = RUNNING
            self.running.append(request)
            if computed:
                record.hit_blocks[request.request_id] = self._held_hit_blocks(hits)
                record.hit_tokens[request.request_id] = computed
            if request.first_scheduled_step is None:
                request.first_scheduled_step = record.step
            record.admitted.append(request.request_id)
            self._run(request, n_new, record)
            budget -= n_new

    # ------------------------------------------------------------------ blocks

    def _block_hashes(self, request: Request, n_blocks: int) -> list[bytes]:
        """The keys of the request's first n_blocks full blocks (vLLM's request.block_hashes),
        computed once each and kept on the request: each chained from the one before."""
        hashes, size = request.block_hashes, self.pool.block_size
        while len(hashes) < n_blocks:
            start = len(hashes) * size
            hashes.append(block_key(hashes[-1] if hashes else ROOT_KEY,
                                    request.all_token_ids[start:start + size]))
        return hashes[:n_blocks]

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of the request's longest cached prefix, in whole blocks, never
        its last token's block: the last token always runs (its logits choose the next)."""
        if not self.pool.enable_prefix_caching:
            return []
        n_blocks = (request.num_tokens - 1) // self.pool.block_size
        return self.pool.lookup_keys(self._block_hashes(request, n_blocks))

    def _cached_prefix_of(self, request: Request) -> tuple[list[int], int]:
        """(the blocks of the longest cached prefix, the tokens they hold)."""
        hits = self._cached_prefix(request)
        return hits, len(hits) * self.pool.block_size

    def _blocks_to_admit(self, hits: list[int], end: int) -> int:
        """Blocks an admission takes from the free ones: new blocks up to position end, and
        the hit blocks nobody holds (idle: taking them back removes them from the free ones,
        as vLLM counts its evictable computed blocks)."""
        idle_hits = sum(1 for block in hits if self.pool.ref_counts[block] == 0)
        return -(-end // self.pool.block_size) - len(hits) + idle_hits

    def _hold_hits(self, request: Request, hits: list[int], computed: int) -> None:
        """An admitted request holds its prefix hit's blocks and starts after them."""
        request.block_table = [self.pool.share(block) for block in hits]
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = computed

    @staticmethod
    def _held_hit_blocks(hits: list[int]) -> list[int]:
        """The blocks of a hit, for the StepRecord."""
        return list(hits)

    def _allocate(self, request: Request, n_new: int, record: StepRecord) -> None:
        """Take the blocks that let the request's table cover n_new more positions."""
        self._take_blocks(request, self._blocks_needed(request, n_new), record)

    def _blocks_needed(self, request: Request, n_new: int) -> int:
        """Blocks to take so that request's table covers n_new more positions."""
        end = request.num_computed_tokens + n_new
        return max(0, -(-end // self.pool.block_size) - len(request.block_table))

    def _take_blocks(self, request: Request, n: int, record: StepRecord) -> None:
        for _ in range(n):
            evicting = self.pool.evicting()
            block = self.pool.allocate()
            request.block_table.append(block)
            record.taken_blocks.append(block)
            if evicting:
                record.evicted_blocks.append(block)

    def _give_back(self, request: Request, record: StepRecord | None) -> None:
        for block in reversed(request.block_table):    # the tail first, as vLLM frees them
            if self.pool.release(block) and record is not None:
                record.freed_blocks.append(block)
        request.block_table = []
        request.num_cached_blocks = 0

    def _preempt(self, request: Request, record: StepRecord) -> None:
        """Give the blocks back, forget what was computed, wait at the front of the queue."""
        self._give_back(request, record)
        request.num_computed_tokens = 0
        request.status = WAITING
        self.waiting.appendleft(request)
        record.preempted.append(request.request_id)

    def _run(self, request: Request, n_new: int, record: StepRecord) -> None:
        record.scheduled_tokens[request.request_id] = n_new
        record.batch.append((request, n_new))
        if self.config.cache_when_scheduled or request.parent_id is not None:
            self._cache_full_blocks(request, request.num_computed_tokens + n_new)

    # ------------------------------------------------------------------ after the model step

    @staticmethod
    def reaching_end(record: StepRecord) -> list[Request]:
        """The scheduled requests whose tokens this step reach their end: each gets a next
        token (the others are in the middle of a chunked prefill)."""
        return [request for request, n_new in record.batch
                if request.num_computed_tokens + n_new == request.num_tokens]

    def update(self, record: StepRecord, sampled: dict) -> list[RequestOutput]:
        """After the model step: every scheduled request's tokens are computed, the blocks they
        filled enter the prefix cache, each request in `sampled` {id: token} gets its token,
        and those that reached max_tokens or a stop token finish."""
        outputs = []
        for request, n_new in record.batch:
            start = request.num_computed_tokens
            if n_new == 1 and start == request.num_tokens - 1 and request.output_token_ids:
                record.decodes.append(request.request_id)
            else:
                record.prefill_chunks[request.request_id] = (start, n_new)
            request.num_computed_tokens += n_new
            self._cache_full_blocks(request, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                outputs.append(RequestOutput(request.request_id, [], False))
                continue
            request.append_output_token(token)
            if request.first_token_step is None:
                request.first_token_step = record.step
            reason = STOP if token in request.sampling_params.stop_token_ids else \
                LENGTH if len(request.output_token_ids) >= request.max_tokens else None
            if reason is not None:
                self._finish(request, record, reason)
            outputs.append(RequestOutput(request.request_id, [token], reason is not None,
                                         reason))
        return outputs

    def _cache_full_blocks(self, request: Request, n_tokens: int) -> None:
        """The request's blocks that are full once its first n_tokens have K and V enter the
        prefix cache (after the step that computed them, or when it is scheduled)."""
        full = min(n_tokens, request.num_tokens) // self.pool.block_size
        if full <= request.num_cached_blocks or not self.pool.enable_prefix_caching:
            return
        keys = self._block_hashes(request, full)
        for index in range(request.num_cached_blocks, full):
            self.pool.cache(request.block_table[index], keys[index])
        request.num_cached_blocks = full

    def _finish(self, request: Request, record: StepRecord | None, reason: str,
                step: int | None = None) -> None:
        if request in self.running:
            self.running.remove(request)
        self._give_back(request, record)
        request.status = FINISHED
        request.finish_reason = reason
        request.finished_step = record.step if record is not None else step
        if record is not None:
            record.finished.append(request.request_id)

    def abort(self, request: Request, step: int) -> None:
        """Between steps: stop a waiting or running request where it is (finish_reason
        "abort"); its blocks go back to the pool (full cached ones stay cached, idle)."""
        if request.status == FINISHED:
            return
        if request.status == WAITING:
            self.waiting.remove(request)
        self._finish(request, None, ABORT, step)


# ---------------------------------------------------------------------------------- serve


def serve(requests, policy: SchedulerConfig, runner=None, clock: str = "steps") -> Timeline:
    """Run a scheduler over requests, step by step (batched_decoding) -> Timeline.

    Each step: the requests that have arrived join the waiting queue; the scheduler picks the
    batch (the admitted are prefilled, the others decode one token); those whose last token is
    out leave. With nothing to run, the clock jumps to the next arrival. runner (a
    ModelRunner) runs each step with a model; without one nothing is computed and every new
    token is 0 (no policy here looks at the tokens). clock "steps": every step lasts one
    model step; "seconds": what the runner measured. The requests given are not changed: the
    Timeline holds the served copies.
    """
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request)
                                                          for r in requests) or not requests:
        raise TypeError("requests must be a non-empty list of kvlib.serving.Request")
    if not isinstance(policy, SchedulerConfig) or clock not in ("steps", "seconds") or \
            not (runner is None or callable(runner)):
        raise TypeError("policy must be StaticBatching(...) or ContinuousBatching(...), runner "
                        "a ModelRunner or None, and clock 'steps' or 'seconds'")
    too_long = [r.request_id for r in requests if r.num_prompt_tokens > policy.budget]
    if too_long or len({r.request_id for r in requests}) < len(requests):
        raise ValueError(f"request ids must be unique, and no prompt longer than "
                         f"max_batched_tokens ({policy.max_num_batched_tokens}): {too_long} "
                         "could never be prefilled in one step")
    served = [r.fresh() for r in sorted(requests, key=lambda r: (r.arrival, r.request_id))]
    pool = BlockPool(None, sum(-(-r.max_num_tokens // 16) for r in served), 16,
                     enable_prefix_caching=False)   # room for all at once: memory never limits
    scheduler, pending, steps, now = Scheduler(pool, policy), deque(served), [], 0.0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival <= now:
            scheduler.add_request(pending.popleft())
        if not scheduler.has_unfinished_requests():
            now = float(pending[0].arrival)
            continue
        record = scheduler.schedule(len(steps))
        admitted = [r for r, _ in record.batch if r.request_id in record.admitted]
        decoded = [r for r, _ in record.batch if r.request_id not in record.admitted]
        sampled = runner(admitted, decoded) if runner is not None else \
            dict.fromkeys((r.request_id for r in Scheduler.reaching_end(record)), 0)
        scheduler.update(record, sampled)
        duration = runner.step_seconds[-1] if clock == "seconds" else 1.0
        steps.append(Step(len(steps), now, now + duration, tuple(record.admitted),
                          tuple(r.request_id for r in decoded), tuple(record.finished)))
        now += duration
    return Timeline(served, steps, policy)


class ModelRunner:
    """Runs serve()'s steps with a model (batched_decoding): each admitted request is prefilled
    into its own cache (kvlib.prefill; its first token), the requests already running decode
    one token each in one batched_decode_step. Greedy tokens. Calling it runs a step and
    returns {request id: its new token}; step_seconds lists how long each step took
    (time.perf_counter). make_cache(request) gives an empty cache for a request; by default a
    KVCache just large enough for its prompt and output. A request's cache is dropped when
    its last token is out.
    """

    def __init__(self, params: Params, *, attend=attend_per_sequence, make_cache=None):
        if not isinstance(params, Params):
            raise TypeError(f"params must be kvlib Params, got {type(params).__name__}")
        self.params, self.attend = params, attend
        self.make_cache = make_cache or (lambda request: KVCache(
            params.config, capacity=request.max_num_tokens))
        self.caches, self.step_seconds = {}, []

    def __call__(self, admitted: list[Request], decoded: list[Request]) -> dict:
        start = time.perf_counter()
        tokens = {}
        for request in admitted:
            logits, cache = prefill(self.params, request.prompt_token_ids,
                                    self.make_cache(request), last_only=True)
            self.caches[request.request_id] = cache
            tokens[request.request_id] = int(np.argmax(logits[-1]))
        if decoded:
            logits = batched_decode_step(self.params, [r.output_token_ids[-1] for r in decoded],
                                         [self.caches[r.request_id] for r in decoded],
                                         attend=self.attend)
            tokens.update((r.request_id, int(np.argmax(row))) for r, row in zip(decoded, logits))
        self.step_seconds.append(time.perf_counter() - start)
        for request in admitted + decoded:
            if len(request.output_token_ids) + 1 == request.max_tokens:    # its last token
                cache = self.caches.pop(request.request_id)
                if hasattr(cache, "free"):          # a paged cache gives its blocks back
                    cache.free()
        return tokens


__all__ = ["ContinuousBatching", "ModelRunner", "NO_LIMIT", "Scheduler", "SchedulerConfig",
           "StaticBatching", "StepRecord", "serve"]
