"""The engine (the_engine): one serving loop built from the parts of the paged_cache to
speculative_decoding lessons, with vLLM's words
(`LLM`'s engine, `SamplingParams`, `add_request`, `step`).

Every step does four things, the loop that vLLM's V1 scheduler, SGLang's and nano-vllm's run:

1. schedule (Engine.schedule): running requests first, each a token of decode (or the next
   chunk of its prompt) against the step's token budget, max_num_batched_tokens; a request
   that needs a block when none is left makes the newest running request give its blocks back
   and wait at the front of the queue (preemption by recomputation: it keeps the tokens it
   produced and prefills them again later); then, if nobody was preempted, waiting requests
   first come first served while the budget and the blocks last, each starting after its
   longest cached prefix, a long prompt cut into chunks (chunked prefill). A waiting request
   that does not fit stops the admissions: the queue never skips it.
2. run one batched model step (forward_step) for every scheduled token at once, prefill chunks
   and decodes together, each sequence with its own positions; attention reads each sequence's
   blocks in place (kvlib.serving.block_attention) and the new K and V enter the pool only
   after the whole step has succeeded.
3. sample the next token of every request whose scheduled tokens reached its end, and let the
   blocks that are now full enter the prefix cache;
4. finish requests that reached max_tokens or a stop token: their blocks go back (the cached
   ones stay in the prefix cache, idle, until they are reused or evicted).

`engine.last_step` says what a step did (who was scheduled, how many tokens each, who was
preempted, which blocks were hit, taken, freed and evicted) and `engine.stats` counts since
the engine was made: what the_engine lesson's widget draws.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

from ..checks import whole_number
from ..inference import check_ids, choose_next_token, embed_tokens, final_logits
from ..model import block_with_attention, merge_heads, split_heads
from ..params import Params
from ..positions import rotary_positions
from .block_attention import block_attention
from .block_manager import BlockManager


@dataclass(frozen=True)
class SamplingParams:
    """How a request is decoded (vLLM's SamplingParams, the fields the_engine lesson needs):
    max_tokens new tokens at most; temperature 0 for greedy, otherwise sampled with a
    generator seeded by seed; generation also stops after any of stop_token_ids."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        whole_number("max_tokens", self.max_tokens, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, Real) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be 0 (greedy) or a positive number, got "
                             f"{self.temperature!r}")
        if self.seed is not None:
            whole_number("seed", self.seed, 0)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, Integral) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")


@dataclass
class Request:
    """One request as the engine tracks it (vLLM's Request): its tokens (prompt, then what it
    produced), how many of them have K and V in the cache, and its block table."""

    request_id: int
    prompt: list[int]
    sampling: SamplingParams
    arrival_step: int
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0            # of its full blocks, how many entered the cache
    status: str = "waiting"               # waiting, running, finished
    first_admitted_step: int | None = None
    first_token_step: int | None = None
    finished_step: int | None = None
    rng: np.random.Generator | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.rng = np.random.default_rng(self.sampling.seed)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step: its new tokens (none while its prompt is still
    being prefilled in chunks) and whether it finished."""

    request_id: int
    new_token_ids: list[int]
    finished: bool


@dataclass
class StepRecord:
    """What one step did (engine.last_step, for the_engine lesson): scheduled_tokens
    {id: tokens}, prefill_chunks {id: (first position, tokens)} and decodes [ids] among them,
    preempted, finished, and the blocks hit (prefix cache), taken, freed and evicted; seconds, how
    long the step took on this machine."""

    step: int
    seconds: float = 0.0
    scheduled_tokens: dict[int, int] = field(default_factory=dict)
    prefill_chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    decodes: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    hit_blocks: dict[int, list[int]] = field(default_factory=dict)
    taken_blocks: list[int] = field(default_factory=list)
    freed_blocks: list[int] = field(default_factory=list)
    evicted_blocks: list[int] = field(default_factory=list)


class Engine:
    """A small serving engine over one model (the_engine).

    Engine(params, block_size=16, n_blocks=..., max_num_batched_tokens=..., max_num_seqs=...,
    enable_prefix_caching=True, enable_chunked_prefill=True). add_request(prompt_ids,
    SamplingParams(...)) -> request id; step() -> [RequestOutput]; generate(prompts,
    sampling_params) -> each prompt's new token ids, in order; has_unfinished_requests().
    """

    def __init__(self, params: Params, block_size: int = 16, n_blocks: int = 256,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True):
        if not isinstance(params, Params):
            raise TypeError(f"params must be kvlib Params, got {type(params).__name__}")
        self.params = params
        self.allocator = BlockManager(params.config, n_blocks, block_size, enable_prefix_caching)
        self.block_size = self.allocator.block_size
        self.max_num_batched_tokens = whole_number("max_num_batched_tokens",
                                                   max_num_batched_tokens, 1)
        self.max_num_seqs = whole_number("max_num_seqs", max_num_seqs, 1)
        if not isinstance(enable_chunked_prefill, bool):
            raise TypeError(f"enable_chunked_prefill must be True or False, got "
                            f"{enable_chunked_prefill!r}")
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.step_count = 0
        self.stats = {"steps": 0, "scheduled_tokens": 0, "preemptions": 0,
                      "prefix_hit_tokens": 0, "prompt_tokens": 0, "evicted_blocks": 0}
        self.last_step = StepRecord(step=0)
        self.seconds_at_step = [0.0]        # this machine's clock at the end of each step
        self._next_id = 0

    def __repr__(self) -> str:
        return (f"Engine({len(self.running)} running, {len(self.waiting)} waiting, "
                f"{self.allocator.n_held} of {self.allocator.n_blocks} blocks held)")

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids, sampling_params: SamplingParams | None = None) -> int:
        """Queue a request -> its id. Refused in words if it could never run: ids outside the
        vocabulary, more positions than the context, more blocks than the whole pool."""
        return self._queue(*self._checked_request(prompt_ids, sampling_params))

    def _checked_request(self, prompt_ids, sampling_params) -> tuple[list[int], SamplingParams]:
        prompt = [int(i) for i in check_ids(prompt_ids, self.params)]
        sampling = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got "
                            f"{type(sampling).__name__}")
        positions = len(prompt) + sampling.max_tokens - 1
        if positions > self.params.config.context_length:
            raise ValueError(f"{len(prompt)} prompt tokens and max_tokens "
                             f"{sampling.max_tokens} need {positions} positions; the context "
                             f"length is {self.params.config.context_length}")
        if not self.enable_chunked_prefill and positions + 1 > self.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a request must fit one step: "
                             f"{positions + 1} tokens (prompt and max_tokens, which a "
                             f"preempted request recomputes) exceed max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        needed = -(-positions // self.block_size)
        if needed > self.allocator.n_blocks:
            raise ValueError(f"this request needs {needed} blocks of {self.block_size} "
                             f"positions, and the pool has {self.allocator.n_blocks} in all: "
                             "it could never finish")
        return prompt, sampling

    def _queue(self, prompt: list[int], sampling: SamplingParams) -> int:
        request = Request(self._next_id, prompt, sampling, self.step_count)
        self._next_id += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return request.request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts, sampling_params=None) -> list[list[int]]:
        """Add every prompt, step until all are done -> each prompt's new token ids, in order.
        sampling_params: one SamplingParams for all, a list of one each, or None."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts, each a list of token ids")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams, a list of one a "
                            f"prompt, or None; got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} "
                             "SamplingParams")
        checked = [self._checked_request(prompt, sampling)     # all, before queueing any
                   for prompt, sampling in zip(prompts, sampling_params)]
        ids = [self._queue(prompt, sampling) for prompt, sampling in checked]
        while self.has_unfinished_requests():
            self.step()
        return [self.requests[i].output for i in ids]

    # ------------------------------------------------------------------ 1. schedule

    def _blocks_needed(self, request: Request, n_new: int) -> int:
        """Blocks to take so that request's table covers n_new more positions."""
        end = request.num_computed_tokens + n_new
        return max(0, -(-end // self.block_size) - len(request.block_table))

    def _take_blocks(self, request: Request, n: int, record: StepRecord) -> None:
        for _ in range(n):
            block, evicted = self.allocator.take()
            request.block_table.append(block)
            record.taken_blocks.append(block)
            if evicted is not None:
                record.evicted_blocks.append(evicted)

    def _give_back(self, request: Request, record: StepRecord) -> None:
        for block in reversed(request.block_table):    # the tail first, as vLLM frees them
            if self.allocator.release(block):
                record.freed_blocks.append(block)
        request.block_table = []
        request.num_cached_blocks = 0

    def _preempt(self, request: Request, record: StepRecord) -> None:
        """Give the blocks back, forget what was computed, wait at the front of the queue."""
        self._give_back(request, record)
        request.num_computed_tokens = 0
        request.status = "waiting"
        self.waiting.appendleft(request)
        record.preempted.append(request.request_id)
        self.stats["preemptions"] += 1

    def _schedule_running(self, record: StepRecord, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            n_new = min(len(request.tokens) - request.num_computed_tokens, budget)
            while self._blocks_needed(request, n_new) > self.allocator.n_free:
                victim = self.running.pop()                # the newest request
                self._preempt(victim, record)
                if victim is request:
                    break
            if request.status != "running":
                break
            self._take_blocks(request, self._blocks_needed(request, n_new), record)
            record.scheduled_tokens[request.request_id] = n_new
            budget -= n_new
            index += 1
        return budget

    def _schedule_waiting(self, record: StepRecord, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self.allocator.lookup(request.tokens[:-1])      # the last token always runs
            computed = len(hits) * self.block_size
            n_new = len(request.tokens) - computed
            if n_new > budget:
                if not self.enable_chunked_prefill:
                    break
                n_new = budget
            idle_hits = sum(1 for b in hits if self.allocator.ref_counts[b] == 0)
            needed = -(-(computed + n_new) // self.block_size) - len(hits)
            if needed > self.allocator.n_free - idle_hits:
                break                                      # first come, first served: wait
            self.waiting.popleft()
            for block in hits:
                self.allocator.hold(block)
            request.block_table = list(hits)
            request.num_cached_blocks = len(hits)
            request.num_computed_tokens = computed
            self._take_blocks(request, needed, record)
            request.status = "running"
            self.running.append(request)
            if hits:
                record.hit_blocks[request.request_id] = list(hits)
            if request.first_admitted_step is None:        # not a resumed request
                request.first_admitted_step = self.step_count
                self.stats["prompt_tokens"] += len(request.prompt)
                self.stats["prefix_hit_tokens"] += computed
            record.scheduled_tokens[request.request_id] = n_new
            budget -= n_new

    def schedule(self, record: StepRecord) -> None:
        """Fill record.scheduled_tokens for this step, taking and freeing blocks as it goes."""
        budget = self._schedule_running(record, self.max_num_batched_tokens)
        if not record.preempted:
            self._schedule_waiting(record, budget)

    # ------------------------------------------------------------------ 2-4. the step

    def step(self) -> list[RequestOutput]:
        """One step of the loop -> what each scheduled request produced. If the step fails
        (an error, an interrupt), the engine is left as it was before it."""
        started = time.perf_counter()
        saved = self._checkpoint()
        self.step_count += 1
        record = StepRecord(step=self.step_count)
        try:
            self.schedule(record)
            batch = [(self.requests[i], n) for i, n in record.scheduled_tokens.items()]
            logits, new_rows = forward_step(self.params, self.allocator, batch) if batch \
                else ({}, [])
            outputs = self._finish_step(batch, logits, new_rows, record)
        except BaseException:
            self._restore(saved)
            raise
        self.stats["steps"] += 1
        self.stats["scheduled_tokens"] += sum(record.scheduled_tokens.values())
        self.stats["evicted_blocks"] += len(record.evicted_blocks)
        record.seconds = time.perf_counter() - started
        self.seconds_at_step.append(self.seconds_at_step[-1] + record.seconds)
        self.last_step = record
        return outputs

    def _finish_step(self, batch, logits, new_rows, record: StepRecord):
        # first what can fail (sampling), then the changes: a failed step changes nothing
        chosen = {request.request_id: choose_next_token(
                      logits[request.request_id], request.sampling.temperature,
                      rng=request.rng)
                  for request, _ in batch if request.request_id in logits}
        write_rows(self.allocator, new_rows)
        outputs = []
        for request, n_new in batch:
            start = request.num_computed_tokens
            if n_new == 1 and start == len(request.tokens) - 1 and request.output:
                record.decodes.append(request.request_id)
            else:
                record.prefill_chunks[request.request_id] = (start, n_new)
            request.num_computed_tokens += n_new
            self._cache_full_blocks(request)
            if request.request_id not in chosen:
                outputs.append(RequestOutput(request.request_id, [], False))
                continue
            token = chosen[request.request_id]
            request.tokens.append(token)
            if request.first_token_step is None:
                request.first_token_step = self.step_count
            done = len(request.output) >= request.sampling.max_tokens or \
                token in request.sampling.stop_token_ids
            if done:
                self._finish(request, record)
            outputs.append(RequestOutput(request.request_id, [token], done))
        return outputs

    def _cache_full_blocks(self, request: Request) -> None:
        """Blocks whose every position now has K and V enter the prefix cache, as they fill."""
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        keys = self.allocator.keys_of(request.tokens[:full * self.block_size])
        for index in range(request.num_cached_blocks, full):
            self.allocator.cache(request.block_table[index], keys[index])
        request.num_cached_blocks = full

    def _finish(self, request: Request, record: StepRecord) -> None:
        self.running.remove(request)
        self._give_back(request, record)
        request.status = "finished"
        request.finished_step = self.step_count
        record.finished.append(request.request_id)

    # ------------------------------------------------------------------ all or nothing

    def _checkpoint(self):
        allocator = self.allocator
        state = {name: copy.copy(getattr(allocator, name))
                 for name in ("ref_counts", "key_of", "cached", "free", "idle")}
        requests = {i: (copy.copy(r.tokens), r.num_computed_tokens, copy.copy(r.block_table),
                        r.num_cached_blocks, r.status, r.first_admitted_step,
                        r.first_token_step, r.finished_step, copy.deepcopy(r.rng))
                    for i, r in self.requests.items()}
        return (state, requests, deque(self.waiting), list(self.running), self.step_count,
                dict(self.stats), self.last_step)

    def _restore(self, saved) -> None:
        state, requests, waiting, running, step_count, stats, last_step = saved
        for name, value in state.items():
            setattr(self.allocator, name, value)
        for i, values in requests.items():
            r = self.requests[i]
            (r.tokens, r.num_computed_tokens, r.block_table, r.num_cached_blocks, r.status,
             r.first_admitted_step, r.first_token_step, r.finished_step, r.rng) = values
        self.waiting, self.running, self.step_count = waiting, running, step_count
        self.stats, self.last_step = stats, last_step

    def check(self) -> None:
        """Raise AssertionError unless the pool is consistent: every block free, cached-idle
        or held, each held block's count equal to the block tables holding it."""
        holders: dict[int, int] = {}
        for request in self.running:
            for block in request.block_table:
                holders[block] = holders.get(block, 0) + 1
        if any(r.block_table for r in self.waiting) or any(
                r.block_table for r in self.requests.values() if r.status == "finished"):
            raise AssertionError("a request that is not running holds blocks")
        self.allocator.check(holders)


class StaticBatchingEngine(Engine):
    """The engine with static batching instead of continuous batching
    (batched_decoding and the_engine): waiting requests are admitted only when no request runs,
    whole prompts at once, and the batch runs until its last request finishes. Everything else is
    the Engine's."""

    def __init__(self, params: Params, **options):
        super().__init__(params, **(options | {"enable_chunked_prefill": False}))

    def schedule(self, record: StepRecord) -> None:
        budget = self._schedule_running(record, self.max_num_batched_tokens)
        if not self.running and not record.preempted:
            self._schedule_waiting(record, budget)


def summarize(engine: Engine, request_ids) -> dict[str, float]:
    """The service a workload got (the_engine), as medians over its requests: time to first
    token (TTFT) and time per output token after it (TPOT), in steps and in this machine's
    seconds, and throughput: output tokens per step and per second, over the whole run."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a kvlib Engine, got {type(engine).__name__}")
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, (list, tuple)) \
            or not request_ids or any(isinstance(i, bool) or i not in engine.requests
                                      for i in request_ids):
        raise ValueError(f"request_ids must be a non-empty list of this engine's request ids "
                         f"(0 to {len(engine.requests) - 1}), got {request_ids!r:.60}")
    requests = [engine.requests[i] for i in request_ids]
    if any(r.status != "finished" for r in requests):
        raise ValueError("summarize needs finished requests: run the engine to the end first")
    clock = engine.seconds_at_step

    def ttft(r, seconds):
        times = clock if seconds else range(len(clock))
        return times[r.first_token_step] - times[r.arrival_step]

    def tpot(r, seconds):
        if len(r.output) < 2:
            return 0.0
        times = clock if seconds else range(len(clock))
        return (times[r.finished_step] - times[r.first_token_step]) / (len(r.output) - 1)

    start = min(r.arrival_step for r in requests)
    end = max(r.finished_step for r in requests)
    tokens = sum(len(r.output) for r in requests)
    return {"ttft_steps": float(np.median([ttft(r, False) for r in requests])),
            "tpot_steps": float(np.median([tpot(r, False) for r in requests])),
            "ttft_seconds": float(np.median([ttft(r, True) for r in requests])),
            "tpot_seconds": float(np.median([tpot(r, True) for r in requests])),
            "steps": end - start, "tokens_per_step": tokens / (end - start),
            "tokens_per_second": tokens / (clock[end] - clock[start])}


# ---------------------------------------------------------------------------------- the model

def forward_step(params: Params, allocator: BlockManager, batch):
    """One batched pass over every scheduled token (the_engine): batch [(request, n_new)]
    -> ({request id: logits (V,)} for each request whose tokens reach their end, the new
    K and V rows [(layer, blocks, slots, K, V)] to write into the pool afterwards).

    Each layer is kvlib.model.block_with_attention, the skeleton of kvlib.decoder_block: the
    rows of all requests go through each projection and the MLP as one matrix; attention is
    per request, over its own blocks and its new rows (block_attention), at its own
    positions. Nothing is written into the pool here.
    """
    config = params.config
    ids, positions, spans = [], [], []
    for request, n_new in batch:
        start = request.num_computed_tokens
        ids += request.tokens[start:start + n_new]
        positions += range(start, start + n_new)
        spans.append((request, len(ids) - n_new, len(ids)))
    ids, positions = np.asarray(ids), np.asarray(positions)
    X = embed_tokens(params, ids, positions)                               # (N, d)
    rotary = rotary_positions(config, positions)
    blocks = np.array([request.block_table[p // allocator.block_size]
                       for (request, first, end) in spans for p in positions[first:end]])
    slots = positions % allocator.block_size
    new_rows = []

    def over_blocks(index):
        """Layer index's attend: each request's queries over its blocks in place and its new
        rows (block_attention); the new rows are kept to be written after the step."""
        def attend(Q, K, V):
            heads = np.empty_like(Q)
            for request, first, end in spans:
                attended = block_attention(
                    split_heads(Q[first:end], config.n_heads), positions[first:end],
                    allocator.keys[index], allocator.values[index], request.block_table,
                    request.num_computed_tokens, K[first:end], V[first:end])
                heads[first:end] = merge_heads(attended)
            new_rows.append((index, blocks, slots, K, V))
            return heads
        return attend

    for index, layer in enumerate(params.layers):
        X = block_with_attention(X, layer, over_blocks(index), rotary=rotary,
                                 norm_epsilon=config.norm_epsilon)
    last_rows = [(request, end - 1) for request, first, end in spans
                 if request.num_computed_tokens + end - first == len(request.tokens)]
    logits = {}
    if last_rows:
        rows = final_logits(params, X[[row for _, row in last_rows]])
        for (request, _), row in zip(last_rows, rows):
            logits[request.request_id] = row
    return logits, new_rows


def write_rows(allocator: BlockManager, new_rows) -> None:
    """Write a step's new K and V rows into their blocks and slots, every layer."""
    for layer, blocks, slots, K, V in new_rows:
        allocator.keys[layer, blocks, slots] = K
        allocator.values[layer, blocks, slots] = V


__all__ = ["Engine", "RequestOutput", "SamplingParams", "StaticBatchingEngine", "StepRecord",
           "forward_step", "summarize", "write_rows"]
