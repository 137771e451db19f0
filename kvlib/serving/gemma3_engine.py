"""The engine serving Gemma 3 (local_and_global_layers): the_engine's loop over a model
whose layers mix sliding-window and global attention, with its blocks counted per KV cache group
(kvlib.serving.kv_cache_manager, vLLM V1's hybrid KV cache manager).

Gemma3Engine is kvlib's Engine (scheduling, chunked prefill, prefix caching, preemption by
recomputation, the all-or-nothing step) with three things of its own:
- GroupedScheduler: every request has one block table per KV cache group; before each step
  the sliding groups' blocks that no future query reads are freed (null in the table); a
  waiting request starts after the longest prefix every group can serve, a sliding group
  needing only the blocks of the last window before it;
- gemma3_forward_step: kvlib.gemma3's decoder layer (decoder_layer_around, project_qkv,
  attend_rows: per-layer rotary base, q/k norms, the window mask in sliding layers) over the
  batch's rows at once, its attention reading each request's rows from its group's blocks,
  from the first position the layer's window still shows;
- disable_hybrid_kv_cache_manager=True (vLLM's engine argument of that name): one
  full-attention group of every layer, the blocks of sliding layers kept to the end (their
  window still applies in attention): the same tokens, more memory.

pool_peak(config, requests, ...) runs only the accounting (no model) and gives the blocks a
workload holds at the peak, with and without hybrid accounting; blocks_in_memory(config,
nbytes, ...) how many blocks a pool of nbytes holds either way (a fixed memory for both).

    from kvlib.checkpoints.gemma3 import gemma3_tokenizer, load_gemma3
    from kvlib.serving import Gemma3Engine, SamplingParams, pool_peak
    from kvlib.serving.workloads import long_reply_workload

    params, tokenizer = load_gemma3(), gemma3_tokenizer()
    engine = Gemma3Engine(params, block_size=16, n_blocks=300)      # hybrid accounting
    prompts = [tokenizer.encode("Question: What is the capital of France?\\nAnswer:")]
    replies = engine.generate(prompts, SamplingParams(max_tokens=4))
    requests = long_reply_workload(tokenizer)                       # replies past the window
    hybrid = pool_peak(params.config, requests, block_size=16)
    every_layer_global = pool_peak(params.config, requests, 16,
                                   disable_hybrid_kv_cache_manager=True)
"""

from __future__ import annotations

import numpy as np

from ..checkpoints.gemma3 import Gemma3Config, Gemma3Params
from ..checks import as_count, as_flag, as_whole_number
from ..gemma3 import (
    attend_rows,
    attention_mask_for,
    check_ids,
    decoder_layer_around,
    embed,
    project_qkv,
    rotary_for,
    unembed_logits,
)
from .block_pool import BlockPool
from .engine import Engine, batch_rows
from .kv_cache_manager import (
    NULL_BLOCK,
    SLIDING,
    KVCacheTensors,
    block_bytes,
    coordinator_for,
    kv_cache_groups,
)
from .request import FINISHED, Request, SamplingParams
from .scheduler import Scheduler, SchedulerConfig


class GroupedScheduler(Scheduler):
    """The engine's Scheduler with one block table per KV cache group (request.block_tables),
    its blocks taken, freed, hit and cached by a KVCacheCoordinator (vLLM's
    KVCacheManager over its coordinator)."""

    def __init__(self, pool: BlockPool, config: SchedulerConfig, coordinator):
        super().__init__(pool, config)
        self.coordinator = coordinator

    def _free_skipped_blocks(self, record) -> None:
        for request in self.running:
            self.coordinator.remove_skipped_blocks(request, record)

    def _cached_prefix_of(self, request: Request):
        n_blocks = (request.num_tokens - 1) // self.pool.block_size    # the last token runs
        if not self.pool.enable_prefix_caching or n_blocks == 0:
            return [[] for _ in self.coordinator.groups], 0
        return self.coordinator.find_longest_cache_hit(self._block_hashes(request, n_blocks),
                                                       n_blocks * self.pool.block_size)

    def _blocks_to_admit(self, hits, end: int) -> int:
        return self.coordinator.blocks_to_allocate(hits, end, hits)

    def _hold_hits(self, request: Request, hits, computed: int) -> None:
        request.block_tables = [[block if block == NULL_BLOCK else self.pool.share(block)
                                 for block in table] for table in hits]
        request.num_cached_blocks = computed // self.pool.block_size
        request.num_computed_tokens = computed

    @staticmethod
    def _held_hit_blocks(hits) -> list[int]:
        return [block for table in hits for block in table if block != NULL_BLOCK]

    def _allocate(self, request: Request, n_new: int, record) -> None:
        self.coordinator.allocate(request, request.num_computed_tokens + n_new, record)

    def _blocks_needed(self, request: Request, n_new: int) -> int:
        return self.coordinator.blocks_to_allocate(request.block_tables,
                                                   request.num_computed_tokens + n_new)

    def _give_back(self, request: Request, record) -> None:
        self.coordinator.free(request, record)
        request.num_cached_blocks = 0

    def _cache_full_blocks(self, request: Request, n_tokens: int) -> None:
        full = min(n_tokens, request.num_tokens) // self.pool.block_size
        if full <= request.num_cached_blocks or not self.pool.enable_prefix_caching:
            return
        self.coordinator.cache_blocks(request, self._block_hashes(request, full),
                                      request.num_cached_blocks, full)
        request.num_cached_blocks = full


class Gemma3Engine(Engine):
    """kvlib's Engine serving Gemma3Params with block accounting per layer type
    (local_and_global_layers).

    Gemma3Engine(params, block_size=16, n_blocks=256, max_num_batched_tokens=256,
    max_num_seqs=64, enable_prefix_caching=True, enable_chunked_prefill=True,
    cache_when_scheduled=False, disable_hybrid_kv_cache_manager=False): Engine's API
    (add_request, step, generate, abort_request, output_of, last_step, stats). groups are its
    KV cache groups, coordinator their accounting, kv the blocks' K and V (layers_per_group
    layers a block); block_bytes the bytes of a block; peak_blocks the most blocks held at
    once (after a step's scheduling, before its model step), since the engine was made.
    """

    def __init__(self, params: Gemma3Params, block_size: int = 16, n_blocks: int = 256,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 cache_when_scheduled: bool = False,
                 disable_hybrid_kv_cache_manager: bool = False):
        hybrid = not as_flag("disable_hybrid_kv_cache_manager", disable_hybrid_kv_cache_manager)
        self.groups = kv_cache_groups(self._checked_params(params).config, hybrid)
        super().__init__(params, block_size, n_blocks, max_num_batched_tokens, max_num_seqs,
                         enable_prefix_caching, enable_chunked_prefill, cache_when_scheduled)
        self.peak_blocks = 0

    @staticmethod
    def _checked_params(params):
        if not isinstance(params, Gemma3Params):
            raise TypeError(f"params must be Gemma3Params (kvlib.checkpoints.gemma3.load_gemma3 or "
                            f"init_gemma3_params), got {type(params).__name__}")
        return params

    def _make_pool(self, n_blocks, block_size, enable_prefix_caching) -> BlockPool:
        n_blocks, block_size = as_count("n_blocks", n_blocks, 1), as_count("block_size",
                                                                          block_size, 1)
        self.kv = KVCacheTensors(self.params.config, self.groups, n_blocks, block_size)
        pool = BlockPool(None, n_blocks, block_size, enable_prefix_caching)
        self.coordinator = coordinator_for(self.groups, pool)
        return pool

    def _make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return GroupedScheduler(self.pool, config, self.coordinator)

    @property
    def hybrid(self) -> bool:
        """True when the sliding layers' blocks are counted apart (hybrid accounting)."""
        return any(group.attention == SLIDING for group in self.groups)

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.params.config, self.block_size, self.groups)

    def _kv_arrays(self):
        return self.kv.keys, self.kv.values

    def _forward(self, batch) -> dict:
        self._blocks_scheduled = self.pool.n_used
        return gemma3_forward_step(self.params, self.kv, self.block_size, batch)

    def step(self):
        """Engine.step; peak_blocks counts the step once it has succeeded."""
        self._blocks_scheduled = 0
        outputs = super().step()
        self.peak_blocks = max(self.peak_blocks, self._blocks_scheduled)
        return outputs

    def _checked_prompt(self, prompt_ids) -> list[int]:
        return check_ids(prompt_ids, self.params.config).tolist()

    def _context_length(self) -> int:
        return self.params.config.max_position_embeddings

    def _most_blocks(self, positions: int) -> int:
        """The most blocks a request of `positions` positions holds at once: a full group
        all of them; a sliding group at most those of a window and one step's tokens (a
        request whose most fits the pool can always run, alone if need be)."""
        size, chunk = self.block_size, min(positions, self.max_num_batched_tokens)
        table = -(-positions // size)
        return sum(table if group.sliding_window is None else
                   min(table, -(-(group.sliding_window - 1 + chunk) // size) + 1)
                   for group in self.groups)

    def check(self) -> None:
        """Raise AssertionError unless the pool is consistent: every block free, cached-idle
        or held, each held block's count equal to the block tables holding it, every table of
        a request as long as the others, null blocks only at the start of sliding tables."""
        holders: dict[int, int] = {}
        for request in self.running:
            if len({len(table) for table in request.block_tables}) != 1:
                raise AssertionError("a request's group tables have different lengths")
            for group, table in zip(self.groups, request.block_tables):
                nulls = table.count(NULL_BLOCK)
                if table[:nulls] != [NULL_BLOCK] * nulls or (nulls and group.attention !=
                                                             SLIDING):
                    raise AssertionError("a null block outside a sliding table's start")
                for block in table[nulls:]:
                    holders[block] = holders.get(block, 0) + 1
        if any(r.block_tables for r in self.waiting) or any(
                r.block_tables for r in self.requests.values() if r.status == FINISHED):
            raise AssertionError("a request that is not running holds blocks")
        self.pool.check_invariants(holders)


# ---------------------------------------------------------------------------------- the model

def gemma3_forward_step(params: Gemma3Params, kv: KVCacheTensors, block_size: int,
                        batch) -> dict:
    """One batched pass of Gemma 3 over every scheduled token (local_and_global_layers): batch
    [(request, n_new)] -> {request id: logits (V,)} for each request whose tokens reach their
    end. The rows of all requests go through each projection and the MLP as one matrix
    (kvlib.gemma3.decoder_layer_around); in each layer the new K and V rows are written into
    the blocks of the layer's group first, then each request's queries read its rows from
    there, from the first position the layer still shows them (a sliding layer's window)."""
    config = params.config
    ids, positions, spans = batch_rows(batch)
    rotary = rotary_for(config, positions)
    X = embed(ids, params.embedding)
    for index, layer in enumerate(params.layers):
        X = decoder_layer_around(X, layer, config, _attention_over_blocks(
            config, layer, index, kv, block_size, spans, positions,
            rotary[config.layer_types[index]]))
    last = [(request, end - 1) for request, first, end in spans
            if request.num_computed_tokens + end - first == len(request.tokens)]
    if not last:
        return {}
    rows = unembed_logits(params, X[[row for _, row in last]])
    return {request.request_id: row for (request, _), row in zip(last, rows)}


def _attention_over_blocks(config: Gemma3Config, layer, index: int, kv: KVCacheTensors,
                           block_size: int, spans, positions: np.ndarray, rotary):
    """Layer index's self_attention for decoder_layer_around: normalized rows (N, d) ->
    (N, d), through the blocks of the layer's group."""
    group, slot = kv.layer_slot[index]
    keys, values = kv.keys[slot], kv.values[slot]          # (n_blocks, block_size, width)
    window = config.sliding_window if config.is_sliding(index) else None

    def attend(normalized):
        Q, K, V = project_qkv(normalized, layer, config, rotary)
        blocks = [request.block_tables[group][p // block_size]
                  for request, first, end in spans for p in positions[first:end]]
        keys[blocks, positions % block_size] = K               # vLLM's reshape_and_cache
        values[blocks, positions % block_size] = V
        heads = np.empty_like(Q)
        for request, first, end in spans:
            start, stop = int(positions[first]), int(positions[end - 1]) + 1
            lowest = 0 if window is None else max(0, start - window + 1)
            table = request.block_tables[group][lowest // block_size:-(-stop // block_size)]
            offset = lowest // block_size * block_size
            rows_k = keys[table].reshape(-1, keys.shape[-1])[:stop - offset]
            rows_v = values[table].reshape(-1, keys.shape[-1])[:stop - offset]
            mask = attention_mask_for(config, index, positions[first:end],
                                      np.arange(offset, stop))
            heads[first:end] = attend_rows(Q[first:end], rows_k, rows_v, mask, config)
        return heads @ layer.Wo
    return attend


# ---------------------------------------------------------------------------------- the pool

def pool_peak(config: Gemma3Config, requests, block_size: int = 16,
              disable_hybrid_kv_cache_manager: bool = False,
              max_num_batched_tokens: int = 256, enable_prefix_caching: bool = True) -> dict:
    """The pool a workload needs (local_and_global_layers): the requests [(arrival step, prompt ids,
    SamplingParams)] scheduled by the engine's GroupedScheduler on a pool that never runs out,
    without a model (every new token 0: the accounting needs the lengths, not the tokens;
    requests with stop tokens run to max_tokens) -> {"peak_blocks", "block_bytes",
    "peak_bytes", "steps"}: the most blocks held at once (after a step's scheduling), a
    block's bytes, their product, and the steps it took."""
    if not isinstance(config, Gemma3Config):
        raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
    block_size, max_num_batched_tokens = as_count("block_size", block_size, 1), as_count(
        "max_num_batched_tokens", max_num_batched_tokens, 1)
    enable_prefix_caching = as_flag("enable_prefix_caching", enable_prefix_caching)
    groups = kv_cache_groups(config, not as_flag("disable_hybrid_kv_cache_manager",
                                                 disable_hybrid_kv_cache_manager))
    requests = _checked_workload(requests, config)
    n_blocks = sum(len(groups) * -(-(len(prompt) + sampling.max_tokens) // block_size)
                   for _, prompt, sampling in requests) + 1          # never runs out
    pool = BlockPool(None, n_blocks, block_size, enable_prefix_caching)
    scheduler = GroupedScheduler(pool, SchedulerConfig(max_num_batched_tokens=
                                                       max_num_batched_tokens),
                                 coordinator_for(groups, pool))
    pending = sorted(enumerate(requests), key=lambda item: item[1][0])
    peak = steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, prompt, sampling) = pending.pop(0)
            scheduler.add_request(Request(i, prompt, SamplingParams(
                max_tokens=sampling.max_tokens)))
        steps += 1
        record = scheduler.schedule(steps)
        peak = max(peak, pool.n_used)
        scheduler.update(record, dict.fromkeys(
            (r.request_id for r in Scheduler.reaching_end(record)), 0))
    size = block_bytes(config, block_size, groups)
    return {"peak_blocks": peak, "block_bytes": size, "peak_bytes": peak * size,
            "steps": steps}


def blocks_in_memory(config: Gemma3Config, nbytes: int, block_size: int = 16,
                     disable_hybrid_kv_cache_manager: bool = False) -> int:
    """How many blocks a pool of nbytes of K and V holds (local_and_global_layers): nbytes //
    the bytes of a block, as vLLM sizes its pool from the memory left for the KV cache. The same
    memory is fewer, larger blocks without hybrid accounting (a block holds every layer)."""
    if not isinstance(config, Gemma3Config):
        raise TypeError(f"config must be a Gemma3Config, got {type(config).__name__}")
    groups = kv_cache_groups(config, not as_flag("disable_hybrid_kv_cache_manager",
                                                 disable_hybrid_kv_cache_manager))
    return as_whole_number("nbytes", nbytes) // block_bytes(config, block_size, groups)


MAX_ARRIVAL = 10**6
"""The latest arrival step pool_peak takes (a larger one is a slip: it would step that long)."""


def _checked_workload(requests, config: Gemma3Config) -> list:
    """[(arrival step, prompt ids as a list, SamplingParams)], refused in words unless each
    arrival is a step up to MAX_ARRIVAL and each request fits the context."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, (list, tuple)) or \
            not all(isinstance(item, tuple) and len(item) == 3 and
                    isinstance(item[2], SamplingParams) for item in requests):
        raise TypeError("requests must be a list of (arrival step, prompt ids, "
                        "SamplingParams), as workloads.long_reply_workload gives them")
    checked = []
    for arrival, prompt, sampling in requests:
        prompt = check_ids(prompt, config).tolist()
        if len(prompt) + sampling.max_tokens - 1 > config.max_position_embeddings:
            raise ValueError(f"{len(prompt)} prompt tokens and max_tokens "
                             f"{sampling.max_tokens} are more positions than the context "
                             f"length {config.max_position_embeddings}")
        checked.append((as_whole_number("arrival", arrival, 0, MAX_ARRIVAL), prompt,
                        sampling))
    return checked


__all__ = ["Gemma3Engine", "GroupedScheduler", "blocks_in_memory", "gemma3_forward_step",
           "pool_peak"]
