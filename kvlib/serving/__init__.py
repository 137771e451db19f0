"""Serving many sequences from one memory (notebooks 17-21): above kvlib's caches and
inference, never imported by them.

- blocks.BlockAllocator and paged.PagedKVCache: the paged cache, block tables, reference
  counts and copy-on-write (notebook 17).
- prefix.PrefixCache and prefix.PrefixServer: prefix caching across requests, block keys
  chained through their parents, LRU eviction (notebook 18).
"""

from .blocks import BlockAllocator
from .paged import PagedKVCache
from .prefix import (
    ROOT_KEY,
    Admission,
    CachedBlock,
    PrefixCache,
    PrefixServer,
    block_key,
    block_keys,
)
