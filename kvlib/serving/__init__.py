"""Serving many sequences from one memory (notebooks 17-21): above kvlib's caches and
inference, never imported by them.

- blocks.BlockAllocator and paged.PagedKVCache: the paged cache, block tables, reference
  counts and copy-on-write (notebook 17).
- memory_plan (contiguous reservations against paged blocks, for a mix of requests) and
  pool_timeline.PoolTimeline (requests served step by step from one pool) (notebook 17).
- quantized.QuantizedKVCache: K and V stored in 8, 4 or 2 bits with scales per token or per
  channel (notebook 20).
"""

from .blocks import BlockAllocator
from .memory_plan import ContiguousArena, Request, blocks_for, memory_table, request_mix
from .paged import PagedKVCache
from .pool_timeline import PoolTimeline
from .quantized import PerChannel, PerToken, QuantizedKVCache
