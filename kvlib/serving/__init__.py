"""Serving many sequences from one memory (notebooks 17-21): above kvlib's caches and
inference, never imported by them.

- blocks.BlockAllocator and paged.PagedKVCache: the paged cache, block tables, reference
  counts and copy-on-write (notebook 17).
"""

from .blocks import BlockAllocator
from .paged import PagedKVCache
