"""The engine (the_engine): one serving loop built from the parts of the paged_cache to
speculative_decoding lessons, with vLLM's words
(`LLM`'s engine, `SamplingParams`, `add_request`, `step`).

Every step does four things, the loop that vLLM's V1 scheduler, SGLang's and nano-vllm's run:

1. schedule (kvlib.serving.scheduler): running requests first, each a token of decode (or the
   next chunk of its prompt) against the step's token budget, max_num_batched_tokens; a
   request that needs a block when none is left makes the newest running request give its
   blocks back and wait at the front of the queue (preemption by recomputation); then, if
   nobody was preempted, waiting requests first come first served while the budget and the
   blocks last, each starting after its longest cached prefix, a long prompt cut into chunks
   (chunked prefill). A waiting request that does not fit stops the admissions.
2. run one batched model step (forward_step) for every scheduled token at once, prefill chunks
   and decodes together, each sequence with its own positions. In every layer the step's new
   K and V are written into their blocks first, then each sequence attends over its blocks
   (vLLM's order: reshape_and_cache, then attention); the decoding sequences attend together,
   their blocks gathered in one copy (kvlib.serving.block_attention.batched_gather_attention);
3. sample the next token of every request whose scheduled tokens reached its end, and let the
   blocks that are now full enter the prefix cache;
4. finish requests that reached max_tokens or a stop token (finish_reason "length" or
   "stop"): their blocks go back (the cached ones stay in the pool, idle, until they are
   reused or evicted).

A step is all or nothing: if it fails (an error, an interrupt), the engine is as it was
before it. It saves only what a step can change: the pool's bookkeeping, the running
requests and the few waiting ones it may admit, never the requests it served before, and the
K and V of the few blocks the step took from someone (a preempted request, an evicted
prefix) before writing into them.

Requests are named by the caller (add_request(..., request_id="chat-7"), a str or an int) or
numbered by the engine; abort_request(id) stops one between steps (finish_reason "abort").
SamplingParams(n=4) makes four requests "0_id" .. "3_id" (vLLM V1's ParentRequest) that
share the prompt's full blocks: the first one's are cached as soon as it is scheduled.

`engine.last_step` says what a step did (who was scheduled, how many tokens each, who was
preempted, which blocks were hit, taken, freed and evicted) and `engine.stats` counts since
the engine was made: what the_engine lesson's widget draws.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import islice
from numbers import Integral
from typing import TYPE_CHECKING

import numpy as np

from ..checks import as_count, as_flag, trusted
from ..inference import check_ids, choose_next_token, embed_tokens, final_logits
from ..model import block_with_attention
from ..params import Params
from ..positions import rotary_positions
from .block_attention import batched_gather_attention
from .block_pool import BlockPool
from .request import ABORT, FINISHED, Request, RequestOutput, SamplingParams
from .scheduler import Scheduler, SchedulerConfig, StepRecord

if TYPE_CHECKING:                     # forward_step's annotation, kept as it was written
    from .block_pool import BlockPool as BlockManager


@dataclass
class Checkpoint:
    """What a step may change, saved before it (Engine.step): the pool's bookkeeping, the
    requests the step may touch (the running ones and the first waiting ones it may admit:
    at most max_num_seqs), the running list, and the front of the waiting queue."""

    pool: tuple
    requests: list[tuple[Request, dict]]
    running: list[Request]
    front: list[Request]
    n_waiting: int
    rows: tuple | None = None          # (blocks, their K, their V) before the step wrote them


class Engine:
    """A small serving engine over one model (the_engine).

    Engine(params, block_size=16, n_blocks=..., max_num_batched_tokens=..., max_num_seqs=...,
    enable_prefix_caching=True, enable_chunked_prefill=True, cache_when_scheduled=False).
    add_request(prompt_ids, SamplingParams(...), request_id=None) -> request id;
    abort_request(request_id); step() -> [RequestOutput]; generate(prompts, sampling_params)
    -> each prompt's new token ids, in order (a list of n lists for SamplingParams(n=n > 1));
    has_unfinished_requests(). pool is its BlockPool, scheduler its Scheduler, requests
    {id: Request} every request it was given (the n completions of an n > 1 request under
    their own ids, "0_id" .. "n-1_id"), parents {id: [completion ids]}.
    cache_when_scheduled: full blocks become reusable when the step that fills them is
    scheduled (vLLM V1), not after it has run (nano-vllm, SGLang; kvlib's default).
    """

    static = False

    def __init__(self, params: Params, block_size: int = 16, n_blocks: int = 256,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 cache_when_scheduled: bool = False):
        self.params = self._checked_params(params)
        self.pool = self._make_pool(n_blocks, block_size, enable_prefix_caching)
        self.scheduler = self._make_scheduler(SchedulerConfig(
            max_num_seqs, as_count("max_num_batched_tokens", max_num_batched_tokens, 1),
            as_flag("enable_chunked_prefill", enable_chunked_prefill) and not self.static,
            self.static, as_flag("cache_when_scheduled", cache_when_scheduled)))
        self.requests: dict[int | str, Request] = {}
        self.parents: dict[int | str, list[int | str]] = {}
        self._next_id = 0
        self.step_count = 0
        self.stats = {"steps": 0, "scheduled_tokens": 0, "preemptions": 0,
                      "prefix_hit_tokens": 0, "prompt_tokens": 0, "evicted_blocks": 0}
        self.last_step = StepRecord(step=0)
        self.seconds_at_step = [0.0]        # this machine's clock at the end of each step

    @staticmethod
    def _checked_params(params):
        if not isinstance(params, Params):
            raise TypeError(f"params must be kvlib Params, got {type(params).__name__}")
        return params

    def _make_pool(self, n_blocks, block_size, enable_prefix_caching) -> BlockPool:
        return BlockPool(self.params.config, n_blocks, block_size, enable_prefix_caching)

    def _make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return Scheduler(self.pool, config)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.running)} running, {len(self.waiting)} "
                f"waiting, {self.pool.n_used} of {self.pool.n_blocks} blocks held)")

    block_size = property(lambda self: self.pool.block_size)
    max_num_batched_tokens = property(lambda self: self.scheduler.config.max_num_batched_tokens)
    max_num_seqs = property(lambda self: self.scheduler.config.max_num_seqs)
    enable_chunked_prefill = property(lambda self: self.scheduler.config.enable_chunked_prefill)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids, sampling_params: SamplingParams | None = None,
                    request_id: int | str | None = None) -> int | str:
        """Queue a request -> its id (request_id if given: a str or an int no other request
        of this engine has; otherwise the next free number). Refused in words, with nothing
        queued, if it could never run: ids outside the vocabulary, more positions than the
        context, more blocks than the whole pool; or if its id is taken. With
        SamplingParams(n=n > 1) it becomes n requests "0_id" .. "n-1_id" (engine.parents[id])."""
        prompt, sampling = self._checked_request(prompt_ids, sampling_params)
        return self._queue(prompt, sampling, self._checked_id(request_id, sampling.n))

    def _checked_id(self, request_id, n: int) -> int | str:
        if request_id is None:
            while self._taken(self._next_id, n):
                self._next_id += 1
            return self._next_id
        if isinstance(request_id, bool) or not isinstance(request_id, (str, Integral)):
            raise TypeError(f"request_id must be a str or an int, got "
                            f"{type(request_id).__name__}")
        request_id = request_id if isinstance(request_id, str) else int(request_id)
        if self._taken(request_id, n):
            raise ValueError(f"request id {request_id!r:.60} is taken: another request of this "
                             "engine has it (or one of its n completions' ids)")
        return request_id

    def _taken(self, request_id, n: int) -> bool:
        names = [request_id] + ([f"{i}_{request_id}" for i in range(n)] if n > 1 else [])
        return any(name in self.requests or name in self.parents for name in names)

    def _checked_request(self, prompt_ids, sampling_params) -> tuple[list[int], SamplingParams]:
        prompt = self._checked_prompt(prompt_ids)
        sampling = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got "
                            f"{type(sampling).__name__}")
        positions = len(prompt) + sampling.max_tokens - 1
        if positions > self._context_length():
            raise ValueError(f"{len(prompt)} prompt tokens and max_tokens "
                             f"{sampling.max_tokens} need {positions} positions; the context "
                             f"length is {self._context_length()}")
        if not self.enable_chunked_prefill and len(prompt) > self.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a prompt must fit one step: "
                             f"{len(prompt)} tokens exceed max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
        if self._most_blocks(positions) > self.pool.n_blocks:
            raise ValueError(f"this request needs {self._most_blocks(positions)} blocks of "
                             f"{self.block_size} positions, and the pool has "
                             f"{self.pool.n_blocks} in all: it could never finish")
        return prompt, sampling

    def _checked_prompt(self, prompt_ids) -> list[int]:
        return check_ids(prompt_ids, self.params).tolist()

    def _context_length(self) -> int:
        return self.params.config.context_length

    def _most_blocks(self, positions: int) -> int:
        """The most blocks a request of `positions` positions holds at once: all of them."""
        return -(-positions // self.block_size)

    def _queue(self, prompt: list[int], sampling: SamplingParams, request_id) -> int | str:
        if sampling.n == 1:
            requests = [Request(request_id, prompt, sampling, self.step_count)]
        else:
            requests = [Request(f"{i}_{request_id}", prompt, sampling.child(i),
                                self.step_count, parent_id=request_id, index=i)
                        for i in range(sampling.n)]
            self.parents[request_id] = [r.request_id for r in requests]
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add_request(request)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def abort_request(self, request_id: int | str) -> None:
        """Stop a request between steps (vLLM's abort_request): waiting or running, it
        finishes now with finish_reason "abort" and gives its blocks back; the id of an n > 1
        request aborts all its completions. A finished request stays as it is; an id this
        engine never had is refused in words."""
        for name in self._ids_of(request_id):
            self.scheduler.abort(self.requests[name], self.step_count)

    def output_of(self, request_id) -> list[int] | list[list[int]]:
        """The new tokens of a request so far, copied (for an n > 1 request, a list of its n
        completions' tokens). An id this engine never had is refused in words."""
        outputs = [list(self.requests[i].output_token_ids) for i in self._ids_of(request_id)]
        return outputs if request_id in self.parents else outputs[0]

    def _ids_of(self, request_id) -> list[int | str]:
        """The ids of the requests a caller's id names (its n completions for an n > 1
        request), refused in words unless it is a str or an int this engine has: True and
        1.0 are not the request 1."""
        if isinstance(request_id, bool) or not isinstance(request_id, (str, Integral)):
            raise TypeError(f"request_id must be a str or an int, got "
                            f"{type(request_id).__name__}")
        request_id = request_id if isinstance(request_id, str) else int(request_id)
        ids = self.parents.get(request_id, [request_id])
        if ids[0] not in self.requests:
            shown = repr(request_id) if isinstance(request_id, str) or \
                abs(request_id) < 10**60 else "a number of more than 60 digits"
            raise ValueError(f"no request of this engine has the id {shown:.60}")
        return ids

    def generate(self, prompts, sampling_params=None) -> list[list[int]]:
        """Add every prompt, step until all are done -> each prompt's new token ids, in order
        (for SamplingParams(n=n > 1), a list of its n completions' tokens). sampling_params:
        one SamplingParams for all, a list of one each, or None. If the call is interrupted
        (an error, a KeyboardInterrupt), the requests it added that are not finished are
        aborted, so that they hold no blocks and never run in a later call."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of prompts, each a list of token ids")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or \
                len(sampling_params) != len(prompts):
            given = len(sampling_params) if isinstance(sampling_params, (list, tuple)) else "no"
            raise ValueError(f"{len(prompts)} prompts but {given} SamplingParams: give one for "
                             "all, a list of one a prompt, or None")
        checked = [self._checked_request(prompt, sampling)     # all, before queueing any
                   for prompt, sampling in zip(prompts, sampling_params)]
        ids = [self._queue(prompt, sampling, self._checked_id(None, sampling.n))
               for prompt, sampling in checked]
        try:
            while self.has_unfinished_requests():
                self.step()
        except BaseException:
            for request_id in ids:
                self.abort_request(request_id)
            raise
        return [self.output_of(i) for i in ids]

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One step of the loop -> what each scheduled request produced. If the step fails
        (an error, an interrupt), the engine is left as it was before it."""
        started = time.perf_counter()
        saved = self._checkpoint()
        try:
            record = self.scheduler.schedule(self.step_count + 1)
            saved.rows = self._rows_to_save(record)
            with trusted():          # the requests were checked when they were added
                logits = self._forward(record.batch) if record.batch else {}
            sampled = {request.request_id: choose_next_token(
                           logits[request.request_id], request.sampling_params.temperature,
                           rng=request.rng)
                       for request in Scheduler.reaching_end(record)}
            outputs = self.scheduler.update(record, sampled)
        except BaseException:
            self._restore(saved)
            raise
        self.step_count += 1
        self._count(record)
        record.seconds = time.perf_counter() - started
        self.seconds_at_step.append(self.seconds_at_step[-1] + record.seconds)
        self.last_step = record
        return outputs

    def _forward(self, batch) -> dict:
        """The model step over the scheduled batch -> {request id: logits (V,)}."""
        return forward_step(self.params, self.pool, batch)

    def _count(self, record: StepRecord) -> None:
        stats = self.stats
        stats["steps"] += 1
        stats["scheduled_tokens"] += sum(record.scheduled_tokens.values())
        stats["evicted_blocks"] += len(record.evicted_blocks)
        stats["preemptions"] += len(record.preempted)
        for i in record.admitted:
            if self.requests[i].first_scheduled_step == record.step:     # not a resumed one
                stats["prompt_tokens"] += self.requests[i].num_prompt_tokens
                stats["prefix_hit_tokens"] += record.hit_tokens.get(i, 0)

    def _checkpoint(self) -> Checkpoint:
        """What this step may change (Checkpoint): bounded by the pool and max_num_seqs."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        front = list(islice(waiting, max(0, self.max_num_seqs - len(running))))
        return Checkpoint(self.pool.checkpoint(),
                          [(request, request.snapshot()) for request in running + front],
                          list(running), front, len(waiting))

    def _rows_to_save(self, record: StepRecord):
        """The blocks this step took from someone (a preempted request's, an evicted prefix)
        with their K and V, copied before the model step writes into them: a failed step
        gives them back as they were. Blocks that were free hold nothing to keep."""
        taken = set(record.taken_blocks) & (set(record.freed_blocks) |
                                            set(record.evicted_blocks))
        keys, values = self._kv_arrays()
        if not taken or keys is None:
            return None
        blocks = sorted(taken)
        return blocks, keys[:, blocks].copy(), values[:, blocks].copy()

    def _kv_arrays(self):
        """The arrays holding K and V, blocks along their axis 1 (None, None without)."""
        return self.pool.keys, self.pool.values

    def _restore(self, saved: Checkpoint) -> None:
        if saved.rows is not None:
            blocks, keys, values = saved.rows
            all_keys, all_values = self._kv_arrays()
            all_keys[:, blocks], all_values[:, blocks] = keys, values
        self.pool.restore(saved.pool)
        for request, state in saved.requests:
            request.restore(state)
        self.scheduler.running = saved.running
        waiting = self.scheduler.waiting          # a step only pops from or pushes to its front
        while len(waiting) > saved.n_waiting - len(saved.front):
            waiting.popleft()
        waiting.extendleft(reversed(saved.front))

    def check(self) -> None:
        """Raise AssertionError unless the pool is consistent: every block free, cached-idle
        or held, each held block's count equal to the block tables holding it."""
        holders: dict[int, int] = {}
        for request in self.running:
            for block in request.block_table:
                holders[block] = holders.get(block, 0) + 1
        if any(r.block_table for r in self.waiting) or any(
                r.block_table for r in self.requests.values() if r.status == FINISHED):
            raise AssertionError("a request that is not running holds blocks")
        self.pool.check_invariants(holders)


class StaticBatchingEngine(Engine):
    """The engine with static batching instead of continuous batching
    (batched_decoding and the_engine): waiting requests are admitted only when no request runs,
    whole prompts at once, and the batch runs until its last request finishes. Everything else is
    the Engine's."""

    static = True


def summarize(engine: Engine, request_ids) -> dict[str, float]:
    """The service a workload got (the_engine), as medians over its requests: time to first
    token (TTFT) and time per output token after it (TPOT), in steps and in this machine's
    seconds, and throughput: output tokens per step and per second, over the whole run."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a kvlib Engine, got {type(engine).__name__}")
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, (list, tuple)):
        raise TypeError("request_ids must be a list of request ids")
    ids = [i for request_id in request_ids
           for i in engine.parents.get(request_id, [request_id])]
    requests = [engine.requests.get(i) if isinstance(i, (str, Integral)) else None
                for i in ids]
    if not requests or any(r is None or r.status != FINISHED for r in requests):
        raise ValueError("summarize needs the ids of this engine's finished requests: run it "
                         "to the end first")
    if any(r.finish_reason == ABORT for r in requests):
        raise ValueError("summarize measures served requests: leave the aborted ones out")
    clock = engine.seconds_at_step

    def ttft(r, seconds):
        times = clock if seconds else range(len(clock))
        return times[r.first_token_step] - times[r.arrival]

    def tpot(r, seconds):
        if len(r.output_token_ids) < 2:
            return 0.0
        times = clock if seconds else range(len(clock))
        return (times[r.finished_step] - times[r.first_token_step]) / \
            (len(r.output_token_ids) - 1)

    start = min(r.arrival for r in requests)
    end = max(r.finished_step for r in requests)
    tokens = sum(len(r.output_token_ids) for r in requests)
    return {"ttft_steps": float(np.median([ttft(r, False) for r in requests])),
            "tpot_steps": float(np.median([tpot(r, False) for r in requests])),
            "ttft_seconds": float(np.median([ttft(r, True) for r in requests])),
            "tpot_seconds": float(np.median([tpot(r, True) for r in requests])),
            "steps": end - start, "tokens_per_step": tokens / (end - start),
            "tokens_per_second": tokens / (clock[end] - clock[start])}


# ---------------------------------------------------------------------------------- the model

def forward_step(params: Params, allocator: BlockManager, batch) -> dict:
    """One batched pass over every scheduled token (the_engine): batch [(request, n_new)]
    -> {request id: logits (V,)} for each request whose tokens reach their end.

    Each layer is kvlib.model.block_with_attention, the skeleton of kvlib.decoder_block: the
    rows of all requests go through each projection and the MLP as one matrix. Attention
    first writes the layer's new K and V rows into their blocks and slots (write_rows, vLLM's
    reshape_and_cache), then reads them from the pool with the cached ones: the decoding
    requests (one token each) all together, each prefill chunk on its own
    (batched_gather_attention), each at its own positions.
    """
    config, size = params.config, allocator.block_size
    ids, positions, spans = batch_rows(batch)
    X = embed_tokens(params, ids, positions)                               # (N, d)
    rotary = rotary_positions(config, positions)
    blocks = np.array([request.block_table[p // size]
                       for (request, first, end) in spans for p in positions[first:end]])
    slots = positions % size
    groups = _attention_groups(spans, positions, size)

    def over_blocks(index):
        """Layer index's attend: write the new rows, then every group's queries over its
        sequences' blocks."""
        def attend(Q, K, V):
            write_rows(allocator, index, blocks, slots, K, V)
            heads = np.empty_like(Q)
            for rows, tables, at in groups:
                R, T = at.shape
                attended = batched_gather_attention(
                    Q[rows].reshape(R, T, config.n_heads, -1).swapaxes(1, 2), at,
                    allocator.keys[index], allocator.values[index], tables)
                heads[rows] = attended.swapaxes(1, 2).reshape(R * T, -1)
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
    return logits


def batch_rows(batch) -> tuple[np.ndarray, np.ndarray, list]:
    """A step's batch [(request, n_new)] as rows: the token ids (N,) and positions (N,) of
    every scheduled token, request after request, and spans [(request, first row, end
    row)]."""
    ids, positions, spans = [], [], []
    for request, n_new in batch:
        start = request.num_computed_tokens
        ids += request.tokens[start:start + n_new]
        positions += range(start, start + n_new)
        spans.append((request, len(ids) - n_new, len(ids)))
    return np.asarray(ids), np.asarray(positions), spans


def _attention_groups(spans, positions: np.ndarray, block_size: int) -> list[tuple]:
    """The step's rows grouped for batched_gather_attention: all decodes (one row each)
    together, each prefill chunk alone -> [(rows, block tables (R, n), positions (R, T))],
    each table padded with its own first block up to the group's longest."""
    decodes = [(request, first) for request, first, end in spans if end - first == 1]
    groups = []
    if decodes:
        rows = np.array([first for _, first in decodes])
        groups.append((rows, _padded_tables([r for r, _ in decodes], positions[rows] + 1,
                                            block_size), positions[rows][:, None]))
    for request, first, end in spans:
        if end - first > 1:
            rows = np.arange(first, end)
            groups.append((rows, _padded_tables([request], [positions[end - 1] + 1],
                                                block_size), positions[rows][None]))
    return groups


def _padded_tables(requests, lengths, block_size: int) -> np.ndarray:
    """The blocks covering each request's first `lengths` positions, as one (R, n) array."""
    n = max(-(-int(length) // block_size) for length in lengths)
    tables = np.empty((len(requests), n), dtype=np.intp)
    for row, (request, length) in enumerate(zip(requests, lengths)):
        used = -(-int(length) // block_size)
        tables[row, :used] = request.block_table[:used]
        tables[row, used:] = request.block_table[0]
    return tables


def write_rows(allocator: BlockManager, layer: int, blocks, slots, K, V) -> None:
    """Write one layer's new K and V rows into their blocks and slots."""
    allocator.keys[layer, blocks, slots] = K
    allocator.values[layer, blocks, slots] = V


__all__ = ["Engine", "RequestOutput", "SamplingParams", "StaticBatchingEngine", "StepRecord",
           "batch_rows", "forward_step", "summarize", "write_rows"]
