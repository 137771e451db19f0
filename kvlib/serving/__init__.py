"""Serving many sequences from one memory (paged_cache to speculative_decoding): above kvlib's
caches and inference, never imported by them.

- blocks.BlockAllocator and paged.PagedKVCache: the paged cache, block tables, reference
  counts and copy-on-write (paged_cache).
- memory_plan (contiguous reservations against paged blocks, for a mix of requests) and
  pool_timeline.PoolTimeline (requests served step by step from one pool) (paged_cache).
- prefix.PrefixCache and prefix.PrefixServer: prefix caching across requests, block keys
  chained through their parents, LRU eviction (prefix_caching).
- batch: several sequences decoded in one step, ragged or padded (batched_decoding);
  scheduler: static and continuous batching of a stream of requests (batched_decoding; its own
  scheduler.Request carries an id and an arrival in steps or seconds).
- quantized.QuantizedKVCache: K and V stored in 8, 4 or 2 bits with scales per token or per
  channel (quantized_cache).
- speculative: a draft proposes, the target verifies in one pass; the draft a small model,
  the target's own first layers or prompt lookup (no model) (speculative_decoding).
- engine.Engine: the serving loop built from the parts above, one step at a time (scheduling
  with a token budget, chunked prefill, preemption, prefix caching as blocks fill, one batched
  model step), on block_manager.BlockManager's pool, with block_attention reading the blocks
  in place (the_engine).
"""

from .batch import attend_padded, attend_per_sequence, batched_decode_step, padding_mask
from .block_manager import BlockManager
from .blocks import BlockAllocator
from .engine import (
    Engine,
    RequestOutput,
    SamplingParams,
    StaticBatchingEngine,
    StepRecord,
    summarize,
)
from .memory_plan import ContiguousArena, Request, blocks_for, memory_table, request_mix
from .paged import PagedKVCache
from .pool_timeline import PoolTimeline
from .prefix import (
    ROOT_KEY,
    Admission,
    CachedBlock,
    PrefixCache,
    PrefixServer,
    block_key,
    block_keys,
)
from .quantized import PerChannel, PerToken, QuantizedKVCache
from .scheduler import ContinuousBatching, ModelRunner, StaticBatching, serve
from .speculative import (
    GreedyAcceptance,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingAcceptance,
    SpeculativeDecoder,
    speculative_generate,
)
