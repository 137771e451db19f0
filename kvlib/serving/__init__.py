"""Serving many sequences from one memory (paged_cache to the_engine): above kvlib's caches and
inference, never imported by them. One object per concept, shared by the lessons:

- request.Request and SamplingParams: one request, as every lesson tracks it (vLLM's names);
- block_pool.BlockPool: the one pool of blocks (reference counts, a free queue, chained prefix
  keys, LRU eviction of cached blocks nobody holds, the K and V), BlockAllocator in paged_cache;
- paged.PagedKVCache: one sequence's cache in the pool, copy-on-write (paged_cache);
- memory_plan (contiguous reservations against paged blocks, for a mix of requests) and
  pool_timeline.PoolTimeline (requests served step by step from one pool) (paged_cache);
- prefix.PrefixCache and prefix.PrefixServer: prefix caching across requests over the pool,
  LRU eviction of leaves (prefix_caching);
- batch: several sequences decoded in one step, ragged or padded (batched_decoding);
- scheduler.Scheduler: who runs in each step, under a token budget; static and continuous
  batching as its options, serve() and timeline.Timeline for a stream of requests
  (batched_decoding, the_engine);
- quantized: K and V stored in 8, 4 or 2 bits with scales per token or per channel
  (quantized_cache);
- speculative: a draft proposes, the target verifies in one pass (speculative_decoding);
- engine.Engine: the serving loop built from the parts above, one step at a time, on the
  scheduler and the pool, with block_attention reading the blocks in place (the_engine);
- kv_cache_manager and gemma3_engine.Gemma3Engine: the engine serving Gemma 3, its blocks
  counted per KV cache group (sliding layers free the blocks that left the window; a prefix
  hit needs only their last window), as vLLM V1's hybrid KV cache manager does; pool_peak,
  the pool a workload needs with and without it (local_and_global_layers);
- workloads: the lessons' and benchmarks' streams of requests.
"""

from .batch import attend_padded, attend_per_sequence, batched_decode_step, padding_mask
from .block_pool import ROOT_KEY, BlockAllocator, BlockPool, block_key, block_keys
from .engine import Engine, StaticBatchingEngine, StepRecord, summarize
from .gemma3_engine import Gemma3Engine, GroupedScheduler, blocks_in_memory, pool_peak
from .kv_cache_manager import (
    NULL_BLOCK,
    KVCacheGroup,
    block_bytes,
    blocks_for_hit,
    blocks_held,
    freeable_blocks,
    kv_cache_groups,
    skipped_tokens,
)
from .memory_plan import ContiguousArena, blocks_for, memory_table, request_mix
from .paged import PagedKVCache
from .pool_timeline import PoolTimeline
from .prefix import Admission, CachedBlock, PrefixCache, PrefixServer
from .quantized import PerChannel, PerToken, QuantizedKVCache
from .request import Request, RequestOutput, SamplingParams
from .scheduler import ContinuousBatching, ModelRunner, Scheduler, StaticBatching, serve
from .speculative import (
    GreedyAcceptance,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingAcceptance,
    SpeculativeDecoder,
    speculative_generate,
)
