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
  more for each block in its table (BlockAllocator's reference counts), so a block is free
  only when nobody holds it;
- when the pool runs out, the least recently used block that no running request holds is
  evicted. Only a leaf can go (a block none of whose children is cached), so that every
  cached block stays reachable from the start; when the last child of a block goes, the
  block becomes a candidate itself.

SGLang keeps the same information in a radix tree: its edges are runs of tokens, a lookup
walks down from the root comparing tokens, and it also evicts leaves in LRU order. The
parent keys here make the same tree; the hash table finds each block in one step.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np

from ..inference import check_ids, decode_step, prefill
from ..params import Params
from .blocks import BlockAllocator
from .paged import PagedKVCache

ROOT_KEY = b""
"""The key of the empty prefix: the parent of every sequence's first block."""

_LARGEST_ID = 2**63       # token ids are hashed as 64-bit integers


def _token_ids(tokens, what: str = "tokens") -> list[int]:
    """A flat sequence of whole numbers (token ids) -> list of ints; clear errors otherwise."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{what} must be token ids (whole numbers), got the text {tokens!r}")
    if isinstance(tokens, (dict, set, frozenset)):
        raise TypeError(f"{what} must be a sequence of token ids in order, got "
                        f"{type(tokens).__name__}")
    try:
        items = list(tokens)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of token ids, got "
                        f"{type(tokens).__name__}") from None
    for item in items:
        if type(item) is int and 0 <= item < _LARGEST_ID:    # the usual case, checked fast
            continue
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, Integral) or item < 0:
            raise TypeError(f"{what} must be token ids (whole numbers >= 0), got {item!r}")
        if item >= _LARGEST_ID:
            raise ValueError(f"{what} holds a token id with {len(str(int(item)))} digits: no "
                             "vocabulary is that large")
    return [int(item) for item in items]


def _check_token_ids(ids: list[int], cache: PagedKVCache) -> None:
    """Refuse ids that are not the tokens the cache's K and V were computed from: cached
    under them, its blocks would hand another request K and V of other tokens."""
    if cache.token_ids is None or len(cache.token_ids) != len(cache):
        raise ValueError("this cache does not record which tokens it holds (it was filled by "
                         "hand, not by a PrefixServer): set cache.token_ids to the ids it was "
                         "prefilled with before inserting it")
    if ids != list(cache.token_ids):
        first = next(i for i, (a, b) in enumerate(zip(ids, cache.token_ids)) if a != b)
        raise ValueError(f"ids are not the tokens this cache holds: position {first} holds "
                         f"token {cache.token_ids[first]}, ids say {ids[first]}. Cached under "
                         "the wrong ids, its blocks would give later requests K and V of other "
                         "tokens")


def block_key(parent_key: bytes, tokens) -> bytes:
    """The key of one full block (prefix_caching; vLLM's block hash): the SHA-256 digest of its
    parent's key and its token ids, 32 bytes.

    The parent's key stands for every token before the block, so two blocks get the same key
    only when the whole prefix up to their end is the same: the same tokens at the same
    positions. The root's key is ROOT_KEY (b"").
    """
    if not isinstance(parent_key, bytes):
        raise TypeError(f"parent_key must be the parent's key (bytes; ROOT_KEY for a first "
                        f"block), got {type(parent_key).__name__}")
    ids = _token_ids(tokens)
    if not ids:
        raise ValueError("a block has at least one token")
    return hashlib.sha256(parent_key + np.asarray(ids, dtype="<i8").tobytes()).digest()


def block_keys(ids, block_size: int) -> list[bytes]:
    """Keys of the full blocks of a sequence, in order (prefix_caching): len(ids) // block_size
    of them; a partly filled last block has no key, it is never shared."""
    ids = _token_ids(ids, "ids")
    if isinstance(block_size, bool) or not isinstance(block_size, Integral) or block_size < 1:
        raise ValueError(f"block_size must be a whole number >= 1, got {block_size!r}")
    block_size = int(block_size)                # numpy's small ints overflow the range
    keys, parent = [], ROOT_KEY
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_key(parent, ids[start:start + block_size])
        keys.append(parent)
    return keys


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
    """Which blocks of a BlockAllocator hold the K and V of which prefixes (prefix_caching).

    match(ids) finds the longest cached prefix of a request in whole blocks, reusable(ids)
    the part of it a request may reuse (all but its last token), attach(blocks) starts a
    PagedKVCache on those blocks, cache_full_blocks(ids, cache) keeps a running sequence's
    full blocks as they fill, insert(ids, cache) does the same when a sequence ends and marks
    its blocks as used, and make_room(n) evicts least recently used blocks that no running
    request holds until n blocks are free. The cache itself holds one reference to every
    block it keeps.
    """

    def __init__(self, allocator: BlockAllocator):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"PrefixCache needs a BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.clock = 0
        self.n_evicted = 0
        self._entries: dict[bytes, CachedBlock] = {}
        self._key_of_block: dict[int, bytes] = {}
        # block -> its allocator.generations when cached: a block released behind the
        # cache's back and taken by another sequence holds other tokens' K and V
        self._generation_of_block: dict[int, int] = {}

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
        if isinstance(block, (bool, np.bool_)) or not isinstance(block, Integral):
            raise TypeError(f"block must be a block id (a whole number), got {block!r}")
        key = self._key_of_block.get(int(block))
        return None if key is None else self._entries[key]

    def is_held(self, entry: CachedBlock) -> bool:
        """True when a running request holds the block (a reference beside the cache's)."""
        return bool(self.allocator.ref_counts[entry.block] > 1)

    def match(self, ids) -> list[CachedBlock]:
        """The longest cached prefix of ids, in whole blocks: the cached blocks of ids[0:B],
        ids[B:2B], ..., up to the first block that is not cached. Changes nothing."""
        ids = _token_ids(ids, "ids")
        size, parent, found = self.block_size, ROOT_KEY, []
        for start in range(0, len(ids) - size + 1, size):
            tokens = tuple(ids[start:start + size])
            entry = self._entries.get(block_key(parent, tokens))
            if entry is None or entry.tokens != tokens:     # the tokens guard against a
                break                                       # hash collision, as in vLLM
            found.append(entry)
            parent = entry.key
        return found

    def reusable(self, ids) -> list[CachedBlock]:
        """The cached blocks a request for ids may reuse: the longest cached prefix of all
        but its last token, which must run through the model to give the next token's
        logits (vLLM and SGLang leave it out in the same way). Changes nothing."""
        ids = _token_ids(ids, "ids")
        return self.match(ids[:-1])

    # -------------------------------------------------------------- using

    def attach(self, entries) -> PagedKVCache:
        """A new sequence that starts with these cached blocks: its block table lists them,
        with one more reference each, and it holds their len(entries) x block_size positions;
        kvlib.prefill continues it with the rest of the request."""
        entries = self._entry_list(entries)
        parent = ROOT_KEY
        for depth, entry in enumerate(entries):
            if not isinstance(entry, CachedBlock) or self._entries.get(entry.key) is not entry:
                raise ValueError(f"entry {depth} is not a block of this prefix cache (evicted "
                                 "since it was looked up?): look the request up again")
            if not self._still_ours(entry.block):
                raise ValueError(f"cached block {entry.block} was released and taken again "
                                 "behind the prefix cache's back (by hand?): it may hold other "
                                 "tokens' K and V now. Make a new PrefixCache")
            if entry.depth != depth or entry.parent != parent:
                raise ValueError("the blocks must be a cached prefix, from the first block on, "
                                 "as match() returns them")
            parent = entry.key
        cache = PagedKVCache.on_blocks(self.allocator, [entry.block for entry in entries],
                                       len(entries) * self.block_size)
        cache.token_ids = [token for entry in entries for token in entry.tokens]
        return cache

    def _entry_list(self, entries) -> list[CachedBlock]:
        if not isinstance(entries, (list, tuple)):
            raise TypeError(f"entries must be a list of cached blocks (match() returns one), "
                            f"got {type(entries).__name__}")
        return list(entries)

    def _still_ours(self, block: int) -> bool:
        """The pool block still holds what was cached: in use, not released and taken again."""
        return bool(self.allocator.ref_counts[block] > 0) and \
            self.allocator.generations[block] == self._generation_of_block.get(block)

    def record_hits(self, entries) -> None:
        """A request reused these blocks: one more hit each, and used now (one clock tick)."""
        entries = self._entry_list(entries)
        for entry in entries:
            if not isinstance(entry, CachedBlock) or self._entries.get(entry.key) is not entry:
                raise ValueError(f"{entry!r:.60} is not a block of this prefix cache (evicted "
                                 "since it was looked up?)")
        self.clock += 1
        for entry in entries:
            entry.hits += 1
            entry.last_used = self.clock

    def cache_full_blocks(self, ids, cache: PagedKVCache) -> list[CachedBlock]:
        """Cache the full blocks of a running sequence that are not cached yet (prefix_caching),
        at the current tick, and return them: call it after a prefill and whenever a decode
        step fills a block, as vLLM and SGLang do, so that a request admitted while this one
        still runs can reuse them.

        ids are the tokens whose K and V the cache holds, len(ids) == len(cache), as the
        cache records them (cache.token_ids, kept by PrefixServer and attach): other ids are
        refused, since blocks cached under them would give later requests wrong K and V. A
        block already cached (reused by this request, or the same prefix computed by
        another) is only marked as used; any other full block gets one more reference, the
        prefix cache's, so that it stays in the pool when the request frees its blocks.
        """
        ids, keys = self._checked_keys(ids, cache)
        return self._store(ids, keys, cache)

    def insert(self, ids, cache: PagedKVCache) -> list[CachedBlock]:
        """Keep the full blocks of a sequence that ends (a finished request), mark all of them
        as used now (one clock tick), and return the newly cached ones: cache_full_blocks plus
        the touch, which sets a finished request's place in the LRU order."""
        ids, keys = self._checked_keys(ids, cache)
        self.clock += 1
        new = self._store(ids, keys, cache)
        for key in keys:
            self._entries[key].last_used = self.clock
        return new

    def _checked_keys(self, ids, cache) -> tuple[list[int], list[bytes]]:
        """ids as a list and the keys of its full blocks, after checking that they are what
        the cache holds; clear errors otherwise."""
        if not isinstance(cache, PagedKVCache) or cache.allocator is not self.allocator:
            raise TypeError("the prefix cache needs a PagedKVCache on this prefix cache's "
                            "allocator")
        cache._checked_table()                 # its blocks are still its own
        ids = _token_ids(ids, "ids")
        if len(ids) != len(cache):
            raise ValueError(f"ids has {len(ids)} tokens but the cache holds {len(cache)} "
                             "positions: give the tokens whose K and V the cache holds")
        keys = block_keys(ids, self.block_size)
        for depth, key in enumerate(keys):
            block = cache.block_table[depth]
            cached_as = self._key_of_block.get(block)
            if cached_as is not None and cached_as != key:
                raise ValueError(f"block {block} of this sequence is cached for other tokens: "
                                 "ids do not match what the cache holds")
        _check_token_ids(ids, cache)
        return ids, keys

    def _store(self, ids, keys, cache) -> list[CachedBlock]:
        """Cache the blocks whose keys are not cached yet, at the current tick."""
        parent, new = ROOT_KEY, []
        for depth, key in enumerate(keys):
            if key not in self._entries:
                block = self.allocator.share(cache.block_table[depth])
                tokens = tuple(ids[depth * self.block_size:(depth + 1) * self.block_size])
                entry = CachedBlock(key, parent, tokens, block, depth, last_used=self.clock)
                self._entries[key] = entry
                self._key_of_block[block] = key
                self._generation_of_block[block] = int(self.allocator.generations[block])
                if parent != ROOT_KEY:
                    self._entries[parent].children += 1
                new.append(entry)
            parent = key
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
        if n is not None and (isinstance(n, (bool, np.bool_)) or not isinstance(n, Integral)
                              or n < 0):
            raise ValueError(f"n must be a whole number >= 0 or None (all), got {n!r}")
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
        """Forget the next block of eviction_order() and release the cache's reference: the
        block goes back to the free list (nobody else holds it). Returns it."""
        order = self.eviction_order(1)
        if not order:
            raise MemoryError("no cached block can be evicted: every one is held by a running "
                              "request (or the cache is empty)")
        entry = order[0]
        del self._entries[entry.key]
        del self._key_of_block[entry.block]
        if entry.parent != ROOT_KEY:
            self._entries[entry.parent].children -= 1
        if self._still_ours(entry.block):      # else another sequence's reference, not ours
            self.allocator.release(entry.block)
        del self._generation_of_block[entry.block]
        self.n_evicted += 1
        return entry

    def make_room(self, n_blocks: int) -> list[CachedBlock]:
        """Evict until n_blocks blocks are free, least recently used first; returns what was
        evicted. If even evicting every block nobody holds would not do, a MemoryError says
        so and nothing is evicted."""
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, Integral) or n_blocks < 0:
            raise ValueError(f"n_blocks must be a whole number >= 0, got {n_blocks!r}")
        missing = n_blocks - self.allocator.n_free
        if missing <= 0:
            return []
        order = self.eviction_order(missing)
        if len(order) < missing:
            raise MemoryError(
                f"{n_blocks} blocks are needed but only {self.allocator.n_free} are free and "
                f"{len(order)} more can be evicted: the other blocks are held by running "
                "requests (a server would make this request wait)")
        return [self.evict() for _ in range(missing)]

    # -------------------------------------------------------------- accounting

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the prefix cache keeps: cached blocks x block bytes (a block
        that running requests also hold is counted here once)."""
        return len(self._entries) * self.allocator.block_bytes

    def check_invariants(self) -> None:
        """Every cached block is in use and cached once, under its own key; every parent is
        cached (the root excepted), one level up; the children counts are right."""
        if len(self._key_of_block) != len(self._entries):
            raise AssertionError("a pool block is cached under two keys, or a key lost its block")
        children = dict.fromkeys(self._entries, 0)
        for key, entry in self._entries.items():
            if entry.key != key or self._key_of_block.get(entry.block) != key:
                raise AssertionError(f"cached block {entry.block} is filed under another key")
            if self.allocator.ref_counts[entry.block] < 1:
                raise AssertionError(f"cached block {entry.block} is free in the pool")
            if entry.parent == ROOT_KEY:
                if entry.depth != 0:
                    raise AssertionError(f"block {entry.block} at depth {entry.depth} has "
                                         "no parent")
                continue
            parent = self._entries.get(entry.parent)
            if parent is None or parent.depth != entry.depth - 1:
                raise AssertionError(f"cached block {entry.block} lost its parent")
            children[entry.parent] += 1
        for key, count in children.items():
            if self._entries[key].children != count:
                raise AssertionError(f"block {self._entries[key].block} counts "
                                     f"{self._entries[key].children} children, has {count}")


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


@dataclass
class RunningRequest:
    """A request being served: the tokens its cache holds, and the cache."""

    ids: list[int]
    cache: PagedKVCache


class PrefixServer:
    """Requests served from one block pool with a prefix cache (prefix_caching).

    admit(ids) looks the request up, starts its PagedKVCache on the reused blocks, evicts
    what the rest needs, prefills only the rest and caches the prompt's full blocks at once;
    decode(request, token) feeds one more token and caches the block it fills;
    finish(request) marks the request's cached blocks as used and frees its references, so
    that only its partly filled block (and any block another request had cached first) goes
    back to the pool. Every running request holds its blocks, so eviction never takes them.
    """

    def __init__(self, params: Params, n_blocks: int, block_size: int = 16):
        if not isinstance(params, Params):
            raise TypeError(f"PrefixServer needs kvlib Params, got {type(params).__name__}")
        self.params = params
        self.allocator = BlockAllocator(params.config, n_blocks, block_size)
        self.prefix_cache = PrefixCache(self.allocator)
        self.running: dict[int, RunningRequest] = {}
        self.n_admitted = 0

    def __repr__(self) -> str:
        return (f"PrefixServer({len(self.running)} running, {self.allocator.n_used} of "
                f"{self.allocator.n_blocks} blocks in use, {len(self.prefix_cache)} cached)")

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that n_tokens positions take: ceil(n_tokens / block_size)."""
        if isinstance(n_tokens, (bool, np.bool_)) or not isinstance(n_tokens, Integral) \
                or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number >= 0, got {n_tokens!r}")
        return -(-int(n_tokens) // self.block_size)

    def admit(self, ids) -> Admission:
        """Start a request: reuse the longest cached prefix (all but the last token at most),
        make room for the rest, prefill only the rest, and cache the prompt's full blocks,
        so that the next request with the same beginning reuses them even while this one
        runs. If it fails (too long, no room), nothing is held and a clear error says why."""
        ids = [int(i) for i in check_ids(ids, self.params)]
        context = self.params.config.context_length
        if len(ids) > context:
            raise ValueError(f"the request has {len(ids)} tokens but the context length is "
                             f"{context}")
        if self.blocks_needed(len(ids)) > self.allocator.n_blocks:
            raise MemoryError(f"a request of {len(ids)} tokens needs "
                              f"{self.blocks_needed(len(ids))} blocks; the pool has "
                              f"{self.allocator.n_blocks} in all")
        reused = self.prefix_cache.reusable(ids)
        cache = self.prefix_cache.attach(reused)       # held now: eviction cannot take them
        try:
            evicted = self.prefix_cache.make_room(self.blocks_needed(len(ids)) - len(reused))
            logits, _ = prefill(self.params, ids[len(cache):], cache, last_only=True)
        except BaseException:
            cache.free()
            raise
        cache.token_ids = list(ids)
        self.prefix_cache.record_hits(reused)
        cached = self.prefix_cache.cache_full_blocks(ids, cache)
        request = self.n_admitted
        self.n_admitted += 1
        self.running[request] = RunningRequest(ids, cache)
        return Admission(request, tuple(ids), tuple(e.block for e in reused),
                         tuple(e.block for e in evicted), self.block_size, logits,
                         tuple(e.block for e in cached))

    def decode(self, request: int, token: int) -> np.ndarray:
        """Feed one more token to a running request (kvlib.decode_step), evicting a block
        first if it starts a new one, and caching the block it fills: logits (1, V)."""
        running = self._running(request)
        token = int(check_ids(token, self.params, what="token")[0])
        if len(running.cache) % self.block_size == 0:
            self.prefix_cache.make_room(1)
        logits = decode_step(self.params, token, running.cache)
        running.ids.append(token)
        running.cache.token_ids = list(running.ids)
        if len(running.cache) % self.block_size == 0:
            self.prefix_cache.cache_full_blocks(running.ids, running.cache)
        return logits

    def finish(self, request: int) -> list[CachedBlock]:
        """End a request: its full blocks stay in the prefix cache (cached as they filled),
        marked as used now; its references go, so its partly filled block returns to the
        pool. Returns the cached blocks that hold its prefix, first block first."""
        running = self._running(request)
        self.prefix_cache.insert(running.ids, running.cache)
        running.cache.free()
        del self.running[request]
        return self.prefix_cache.match(running.ids)

    def held_blocks(self) -> set[int]:
        """The pool blocks that running requests hold."""
        return {block for running in self.running.values() for block in running.cache.block_table}

    def _running(self, request) -> RunningRequest:
        if isinstance(request, bool) or not isinstance(request, Integral) \
                or request not in self.running:
            raise ValueError(f"request must be the number of a running request "
                             f"{sorted(self.running)}, got {request!r}")
        return self.running[int(request)]
