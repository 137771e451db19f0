"""Prefix caching across requests (prefix_caching; vLLM's automatic prefix caching, SGLang's
RadixAttention).

Many requests start alike: the same system prompt, the same document, the earlier turns of a
chat. The causal mask makes position p's K and V depend on tokens 0 .. p only, so requests
that share their first n tokens have the same K and V there, and a server can keep them in
its block pool (paged_cache) after a request ends and hand them to the next one:

- only full blocks are kept: a partly filled block still belongs to the sequence writing it;
- each block is keyed by its parent's key and its own tokens, as vLLM's block hashes are.
  The parent's key stands for every token before the block, so two blocks share a key only
  when everything up to their end is the same. That also fixes their positions: a cached
  block is reused at the place where it was computed, and a prefix only at the start of a
  sequence (with absolute or rotary positions alike, and even without positions, since
  later layers' K and V depend on every earlier token);
- a lookup follows the keys of a new request's blocks from the first one and stops at the
  first miss: the longest cached prefix, in whole blocks. It stops one token short of the
  end, because the last token must run through the model to give the logits;
- a block is cached as soon as it is full, while its request still runs: the prompt's full
  blocks right after its prefill, a generated block when its last row is written (vLLM's
  cache_blocks in allocate_slots, SGLang's cache_unfinished_req after a prefill), so that a
  second request with the same beginning, admitted while the first one runs, reuses them.
  If two requests computed the same block, the one cached first is the cached copy; the
  other stays private to its request and is freed with it;
- the prefix cache holds one reference to each block it keeps and every running request one
  more for each block in its table (the BlockPool's reference counts), so a block is free
  only when nobody holds it;
- when the pool runs out, the least recently used block that no running request holds is
  evicted. Only a leaf can go (a block none of whose children is cached), so that every
  cached block stays reachable from the start; when the last child of a block goes, the
  block becomes a candidate itself.

SGLang keeps the same information in a radix tree: its edges are runs of tokens, a lookup
walks down from the root comparing tokens, and it also evicts leaves in LRU order. The
parent keys here make the same tree; the hash table finds each block in one step.

The keys and the reference counts live in the one BlockPool (kvlib.serving.block_pool): a
PrefixCache adds what this lesson shows about each cached block (its tokens, depth, hits, last
use, cached children) and the eviction rule above, written out. It holds a reference to each
block it keeps, as SGLang's tree does; the engine (the_engine) counts the other way, as vLLM
does: a cached block nobody holds waits idle in the pool, the least recently released evicted
first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np

from ..checks import as_count, as_whole_number, as_whole_numbers
from ..inference import check_ids, decode_step, prefill
from ..params import Params
from .block_pool import ROOT_KEY, BlockPool, block_key, block_keys
from .paged import PagedKVCache
from .request import FINISHED, RUNNING, Request

__all__ = ["ROOT_KEY", "Admission", "CachedBlock", "PrefixCache", "PrefixServer", "block_key",
           "block_keys"]


@dataclass(eq=False)
class CachedBlock:
    """One block the prefix cache keeps (prefix_caching): the pool block that holds the K and V
    of `tokens`, the block at place `depth` of every sequence that starts with this prefix
    (positions depth x block_size onwards), its parent's key, how many requests reused it
    (hits) and when it was last used (the cache's clock: one tick per admission or insertion).
    """

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    block: int
    depth: int
    hits: int = 0
    last_used: int = 0
    children: int = field(default=0, repr=False)

    @property
    def positions(self) -> range:
        size = len(self.tokens)
        return range(self.depth * size, (self.depth + 1) * size)

    def __repr__(self) -> str:
        first, last = self.positions[0], self.positions[-1]
        return (f"CachedBlock(block {self.block}, positions {first}-{last}, tokens "
                f"{list(self.tokens)}, {self.hits} hits, last used at {self.last_used})")


class PrefixCache:
    """Which blocks of a BlockPool hold the K and V of which prefixes (prefix_caching).

    match(ids) finds the longest cached prefix of a request in whole blocks, reusable(ids)
    the part of it a request may reuse (all but its last token), attach(entries) starts a
    PagedKVCache on those blocks, cache_full_blocks(ids, cache) keeps a running sequence's
    full blocks as they fill, insert(ids, cache) does the same when a sequence ends and marks
    its blocks as used, and make_room(n) evicts least recently used blocks that no running
    request holds until n blocks are free. The cache itself holds one reference to every
    block it keeps; the keys are the pool's.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.clock = 0
        self.n_evicted = 0
        self._entries: dict[bytes, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        held = sum(self.is_held(entry) for entry in self._entries.values())
        return (f"PrefixCache({len(self)} blocks of {self.block_size} tokens cached, {held} of "
                f"them held by running requests; {self.n_evicted} evicted so far)")

    # -------------------------------------------------------------- reading

    @property
    def entries(self) -> list[CachedBlock]:
        """The cached blocks, by depth, then in the order they were cached."""
        return sorted(self._entries.values(), key=lambda entry: entry.depth)

    def entry(self, block: int) -> CachedBlock | None:
        """The cached block held in pool block `block`, or None if it holds no cached one."""
        return self._entries.get(self.pool.key_of[as_whole_number("block", block, 0,
                                                              self.pool.n_blocks - 1)])

    def is_held(self, entry: CachedBlock) -> bool:
        """True when a running request holds the block (a reference beside the cache's)."""
        return bool(self.pool.ref_counts[entry.block] > 1)

    def match(self, ids) -> list[CachedBlock]:
        """The longest cached prefix of ids, in whole blocks: the cached blocks of ids[0:B],
        ids[B:2B], ..., up to the first block that is not cached. Changes nothing."""
        ids = as_whole_numbers("ids", ids).tolist()
        found = []
        for block in self.pool.lookup(ids):
            entry = self._entries[self.pool.key_of[block]]
            if list(entry.tokens) != ids[entry.positions[0]:entry.positions[-1] + 1]:
                break                  # the tokens guard against a hash collision, as in vLLM
            found.append(entry)
        return found

    def reusable(self, ids) -> list[CachedBlock]:
        """The cached blocks a request for ids may reuse: the longest cached prefix of all
        but its last token, which must run through the model to give the next token's
        logits (vLLM and SGLang leave it out in the same way). Changes nothing."""
        return self.match(as_whole_numbers("ids", ids)[:-1])

    # -------------------------------------------------------------- using

    def attach(self, entries: list[CachedBlock]) -> PagedKVCache:
        """A new sequence that starts with these cached blocks (a prefix, as match() returns
        it): its block table lists them, with one more reference each, and it holds their
        len(entries) x block_size positions; kvlib.prefill continues it."""
        cache = PagedKVCache.on_blocks(self.pool, [entry.block for entry in entries],
                                       len(entries) * self.block_size)
        cache.token_ids = [token for entry in entries for token in entry.tokens]
        return cache

    def record_hits(self, entries: list[CachedBlock]) -> None:
        """A request reused these blocks: one more hit each, and used now (one clock tick)."""
        self.clock += 1
        for entry in entries:
            entry.hits += 1
            entry.last_used = self.clock

    def cache_full_blocks(self, ids: list[int], cache: PagedKVCache) -> list[CachedBlock]:
        """Cache the full blocks of a running sequence that are not cached yet (prefix_caching),
        at the current tick, and return them: called after a prefill and whenever a decode
        step fills a block, as vLLM and SGLang do, so that a request admitted while this one
        still runs can reuse them.

        ids are the tokens whose K and V the cache holds, len(ids) == len(cache). A block
        already cached (reused by this request, or the same prefix computed by another) is
        only marked as used; any other full block gets one more reference, the prefix
        cache's, so that it stays in the pool when the request frees its blocks.
        """
        parent, new = ROOT_KEY, []
        for depth, key in enumerate(self.pool.keys_of(ids)):
            block = cache.block_table[depth]
            if key not in self._entries:
                self.pool.cache(self.pool.share(block), key)
                tokens = tuple(ids[depth * self.block_size:(depth + 1) * self.block_size])
                self._entries[key] = CachedBlock(key, parent, tokens, block, depth,
                                                 last_used=self.clock)
                if parent != ROOT_KEY:
                    self._entries[parent].children += 1
                new.append(self._entries[key])
            parent = key
        return new

    def insert(self, ids: list[int], cache: PagedKVCache) -> list[CachedBlock]:
        """Keep the full blocks of a sequence that ends (a finished request), mark all of them
        as used now (one clock tick), and return the newly cached ones: cache_full_blocks plus
        the touch, which sets a finished request's place in the LRU order."""
        self.clock += 1
        new = self.cache_full_blocks(ids, cache)
        for key in self.pool.keys_of(ids):
            self._entries[key].last_used = self.clock
        return new

    # -------------------------------------------------------------- eviction

    def eviction_order(self, n: int | None = None) -> list[CachedBlock]:
        """The blocks evict() would take next, in order, up to n (None: all that can go).
        Changes nothing.

        Each time: among the cached blocks that no running request holds and none of whose
        children is cached, the least recently used; between blocks last used at the same
        tick, the deeper one first (the end of a prefix is less likely to be shared than
        its start). A block whose last cached child goes becomes a candidate itself.
        """
        n = None if n is None else as_count("n", n)
        children = {key: entry.children for key, entry in self._entries.items()}
        heap = [(e.last_used, -e.depth, e.block, e) for e in self._entries.values()
                if children[e.key] == 0 and not self.is_held(e)]
        heapq.heapify(heap)
        order = []
        while heap and (n is None or len(order) < n):
            *_, entry = heapq.heappop(heap)
            order.append(entry)
            if entry.parent != ROOT_KEY:
                children[entry.parent] -= 1
                parent = self._entries[entry.parent]
                if children[parent.key] == 0 and not self.is_held(parent):
                    heapq.heappush(heap, (parent.last_used, -parent.depth, parent.block, parent))
        return order

    def evict(self) -> CachedBlock:
        """Forget the next block of eviction_order(), and release the cache's reference: the
        block goes back to the free list (nobody else holds it). Returns it."""
        order = self.eviction_order(1)
        if not order:
            raise MemoryError("no cached block can be evicted: every one is held by a running "
                              "request (or the cache is empty)")
        entry = order[0]
        del self._entries[entry.key]
        if entry.parent != ROOT_KEY:
            self._entries[entry.parent].children -= 1
        self.pool.uncache(entry.block)
        self.pool.release(entry.block)
        self.n_evicted += 1
        return entry

    def make_room(self, n_blocks: int) -> list[CachedBlock]:
        """Evict until n_blocks blocks are free, least recently used first; returns what was
        evicted. If even evicting every block nobody holds would not do, a MemoryError says
        so and nothing is evicted."""
        missing = n_blocks - self.pool.n_free
        if missing <= 0:
            return []
        order = self.eviction_order(missing)
        if len(order) < missing:
            raise MemoryError(
                f"{n_blocks} blocks are needed but only {self.pool.n_free} are free and "
                f"{len(order)} more can be evicted: the other blocks are held by running "
                "requests (a server would make this request wait)")
        return [self.evict() for _ in range(missing)]

    # -------------------------------------------------------------- accounting

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the prefix cache keeps: cached blocks x block bytes (a block
        that running requests also hold is counted here once)."""
        return len(self._entries) * self.pool.block_bytes

    def check_invariants(self) -> None:
        """The pool's keys are this cache's, each cached block held (by the cache at least);
        every parent is cached (the root excepted), one level up; the children counts are
        right."""
        self.pool.check_invariants()
        if {key: entry.block for key, entry in self._entries.items()} != self.pool.cached:
            raise AssertionError("the prefix cache's blocks and the pool's keys disagree")
        children = dict.fromkeys(self._entries, 0)
        for entry in self._entries.values():
            if self.pool.ref_counts[entry.block] < 1:
                raise AssertionError(f"cached block {entry.block} is not held by the cache")
            parent = self._entries.get(entry.parent)
            if (parent.depth if parent else -1) != entry.depth - 1:
                raise AssertionError(f"cached block {entry.block} lost its parent")
            if parent:
                children[entry.parent] += 1
        if any(self._entries[key].children != n for key, n in children.items()):
            raise AssertionError("a cached block counts its cached children wrong")


@dataclass(frozen=True, eq=False)
class Admission:
    """What admitting one request did (prefix_caching): the cached blocks it reused (block ids,
    in its block table's order), the blocks evicted to make room for the rest, the logits
    of its last token, (1, V), which choose its first new token, and the blocks it cached:
    its prompt's full blocks that were not cached yet, reusable from now on."""

    request: int
    ids: tuple[int, ...]
    reused_blocks: tuple[int, ...]
    evicted_blocks: tuple[int, ...]
    block_size: int
    logits: np.ndarray
    cached_blocks: tuple[int, ...] = ()

    @property
    def reused_tokens(self) -> int:
        return len(self.reused_blocks) * self.block_size

    @property
    def prefilled_tokens(self) -> int:
        return len(self.ids) - self.reused_tokens


class PrefixServer:
    """Requests served from one block pool with a prefix cache (prefix_caching).

    admit(ids) looks the request up, starts its PagedKVCache on the reused blocks, evicts
    what the rest needs, prefills only the rest and caches the prompt's full blocks at once;
    decode(request, token) feeds one more token and caches the block it fills;
    finish(request) marks the request's cached blocks as used and frees its references, so
    that only its partly filled block (and any block another request had cached first) goes
    back to the pool. Every running request holds its blocks, so eviction never takes them.

    running {id: Request} lists the requests being served (each Request's block_table is its
    cache's), caches {id: PagedKVCache} their caches.
    """

    def __init__(self, params: Params, n_blocks: int, block_size: int = 16):
        if not isinstance(params, Params):
            raise TypeError(f"PrefixServer needs kvlib Params, got {type(params).__name__}")
        self.params = params
        self.pool = BlockPool(params.config, n_blocks, block_size)
        self.prefix_cache = PrefixCache(self.pool)
        self.running: dict[int, Request] = {}
        self.caches: dict[int, PagedKVCache] = {}
        self.n_admitted = 0

    def __repr__(self) -> str:
        return (f"PrefixServer({len(self.running)} running, {self.pool.n_used} of "
                f"{self.pool.n_blocks} blocks in use, {len(self.prefix_cache)} cached)")

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that n_tokens positions take: ceil(n_tokens / block_size)."""
        return -(-as_count("n_tokens", n_tokens) // self.block_size)

    def admit(self, ids) -> Admission:
        """Start a request: reuse the longest cached prefix (all but the last token at most),
        make room for the rest, prefill only the rest, and cache the prompt's full blocks,
        so that the next request with the same beginning reuses them even while this one
        runs. If it fails (too long, no room), nothing is held and a clear error says why."""
        ids = check_ids(ids, self.params).tolist()
        if self.blocks_needed(len(ids)) > self.pool.n_blocks:
            raise MemoryError(f"a request of {len(ids)} tokens needs "
                              f"{self.blocks_needed(len(ids))} blocks; the pool has "
                              f"{self.pool.n_blocks} in all")
        reused = self.prefix_cache.reusable(ids)
        cache = self.prefix_cache.attach(reused)       # held now: eviction cannot take them
        try:
            evicted = self.prefix_cache.make_room(self.blocks_needed(len(ids)) - len(reused))
            logits, _ = prefill(self.params, ids[len(cache):], cache, last_only=True)
        except BaseException:
            cache.free()
            raise
        self.prefix_cache.record_hits(reused)
        cached = self.prefix_cache.cache_full_blocks(ids, cache)
        request = Request(self.n_admitted, ids, arrival=self.n_admitted,
                          num_computed_tokens=len(ids), block_table=cache.block_table,
                          status=RUNNING)
        cache.token_ids = request.all_token_ids
        self.n_admitted += 1
        self.running[request.request_id], self.caches[request.request_id] = request, cache
        return Admission(request.request_id, tuple(ids), tuple(e.block for e in reused),
                         tuple(e.block for e in evicted), self.block_size, logits,
                         tuple(e.block for e in cached))

    def decode(self, request: int, token: int) -> np.ndarray:
        """Feed one more token to a running request (kvlib.decode_step), evicting a block
        first if it starts a new one, and caching the block it fills: logits (1, V)."""
        running, cache = self._running(request), self.caches.get(request)
        token = int(check_ids(token, self.params, what="token")[0])
        if len(cache) % self.block_size == 0:
            self.prefix_cache.make_room(1)
        logits = decode_step(self.params, token, cache)
        running.append_output_token(token)
        running.num_computed_tokens = len(cache)
        cache.token_ids = running.all_token_ids
        if len(cache) % self.block_size == 0:
            self.prefix_cache.cache_full_blocks(running.all_token_ids, cache)
        return logits

    def finish(self, request: int) -> list[CachedBlock]:
        """End a request: its full blocks stay in the prefix cache (cached as they filled),
        marked as used now; its references go, so its partly filled block returns to the
        pool. Returns the cached blocks that hold its prefix, first block first."""
        running, cache = self._running(request), self.caches.pop(request, None)
        self.prefix_cache.insert(running.all_token_ids, cache)
        cache.free()
        del self.running[request]
        running.status = FINISHED
        return self.prefix_cache.match(running.all_token_ids)

    def held_blocks(self) -> set[int]:
        """The pool blocks that running requests hold."""
        return {block for running in self.running.values() for block in running.block_table}

    def _running(self, request) -> Request:
        if isinstance(request, bool) or not isinstance(request, Integral) or \
                request not in self.running:
            raise ValueError(f"request must be the number of a running request "
                             f"{sorted(self.running)}, got {request!r}")
        return self.running[request]
