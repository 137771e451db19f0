"""Serving many sequences from one memory (notebooks 17-21): above kvlib's caches and
inference, never imported by them.

- blocks.BlockAllocator and paged.PagedKVCache: the paged cache, block tables, reference
  counts and copy-on-write (notebook 17).
- batch: several sequences decoded in one step, ragged or padded (notebook 19);
  scheduler: static and continuous batching of a stream of requests (notebook 19).
"""

from .batch import attend_padded, attend_per_sequence, batched_decode_step, padding_mask
from .blocks import BlockAllocator
from .paged import PagedKVCache
from .scheduler import ContinuousBatching, ModelRunner, Request, StaticBatching, serve
