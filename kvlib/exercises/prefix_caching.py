"""Exercises of the prefix_caching lesson (prefix caching across requests): checkers and solutions.

1. How many tokens a request can reuse, in full blocks, at several block sizes (a transfer
   to block sizes other than the notebook's), and when it repeats a cached prompt exactly.
2. Find the bug: a prefix cache that keys each block by its tokens alone, without its
   parent, and so reuses a block computed after a different beginning (wrong logits).
3. LRU: which cached blocks go, in which order, when a request needs room (one of them only
   becomes a candidate when its last cached child has gone).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

import kvlib
from kvlib.serving import PrefixServer

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    not_filled_in,
    read_whole_numbers,
    show_solution,
    shown,
)

TOLERANCE = 1e-10

# Exercise 1 ------------------------------------------------------------------------------

SYSTEM_TOKENS = 45          # the system prompt both requests start with
FIRST_QUESTION = 19         # request 1: system prompt + this question = 64 tokens
SECOND_QUESTION = 30        # request 2: system prompt + another question = 75 tokens
BLOCK_SIZES = (16, 8, 64)


def reusable_tokens(shared: int, cached_length: int, request_length: int,
                    block_size: int) -> int:
    """Tokens a request reuses from a cached sequence (prefix_caching): the full blocks of the
    part it shares with the cached one (at most the cached sequence's full blocks), and
    never its own last token, which must run to give the logits."""
    usable = min(shared, cached_length, request_length - 1)
    return usable // block_size * block_size


def exercise1_expected() -> tuple[int, int, int, int]:
    """Request 2 at block sizes 16, 8 and 64, then request 1 again at block size 16."""
    first = SYSTEM_TOKENS + FIRST_QUESTION
    second = SYSTEM_TOKENS + SECOND_QUESTION
    return (*(reusable_tokens(SYSTEM_TOKENS, first, second, size) for size in BLOCK_SIZES),
            reusable_tokens(first, first, first, 16))


def _diagnose_reuse(index: int, value: int, expected: int) -> str:
    """Why one of the four numbers is wrong, in words."""
    first = SYSTEM_TOKENS + FIRST_QUESTION
    if index == 3:
        if value == first:
            return ("request 1's 64 tokens are all cached, but a request never reuses its last "
                    "token: it must run through the model to give the logits of the next one. "
                    "At most 63 tokens, and only in full blocks of 16.")
        if value == first - 1:
            return ("63 is right for the last token, but reuse comes in full blocks: "
                    "63 tokens hold 3 full blocks of 16.")
        return (f"request 1 again: its 64 tokens are cached in 4 blocks of 16. How many of them "
                f"can it reuse, leaving its last token to compute? (you wrote {value})")
    size = BLOCK_SIZES[index]
    where = f"with blocks of {size}"
    if value == SYSTEM_TOKENS:
        return (f"{where}: 45 tokens are shared, but only full blocks are: the block that "
                f"holds tokens {SYSTEM_TOKENS // size * size}-"
                f"{SYSTEM_TOKENS // size * size + size - 1} also holds the first question's "
                "tokens, so request 2's copy of it differs.")
    if value == -(-SYSTEM_TOKENS // size) * size:
        return (f"{where}: that rounds up. The block that holds token 45 also holds tokens of "
                "request 1's question, so it is not shared: round down to full blocks.")
    if value > SYSTEM_TOKENS:
        return (f"{where}: request 2 shares only its first 45 tokens with request 1; the rest "
                "is another question.")
    if value % size:
        return f"{where}: reuse comes in whole blocks of {size}; {value} is not a multiple."
    return f"{where}: not {value}. Count the full blocks inside the 45 shared tokens."


@checker
def check_reusable_tokens(answer) -> Feedback:
    """Exercise 1: (request 2 at block size 16, 8, 64; request 1 again at 16)."""
    expected = exercise1_expected()
    numbers = read_whole_numbers(answer, 4, expected=expected)
    if isinstance(numbers, Feedback):
        return numbers
    if numbers == expected:
        return Feedback(True, f"{numbers}: only full blocks are shared, so a long block wastes "
                        "more of a shared prefix (64 tokens: nothing of 45), and a repeated "
                        "prompt still computes its last block.")
    if sorted(numbers) == sorted(expected):
        return Feedback(False, "the right numbers in another order: block size 16, 8, 64 for "
                        "request 2, then request 1 again.")
    for index, (value, right) in enumerate(zip(numbers, expected)):
        if value != right:
            return Feedback(False, _diagnose_reuse(index, value, right))
    raise AssertionError("unreachable")     # pragma: no cover


# Exercise 2 ------------------------------------------------------------------------------

ROOT = ()
"""The parent key of a sequence's first block in the notebook's dict-based prefix cache."""
BLOCK_SIZE = 4
SHUFFLED_EXAMPLES = (      # the notebook's stream: the same examples, in another order
    "I am good How are you ? I am fine . and you ?",
    "I am good I am fine . How are you ? and you ?",
    "I am good How are you ? I am fine . and you ?",
)
MIXED_EXAMPLES = (         # the checker's second stream: block 3 follows another block 2
    "I am good How are you ? I am fine . and you ?",
    "I am good you are good . thanks . How are you ?",
    "I am good you are good . I am fine . thanks ?",
)
REORDERED_EXAMPLES = (     # the third: block 2 holds the same tokens in another order (and
    "I am good How are you ? I am fine .",       # with other counts), after the same block 1
    "I am good are How you ? I am fine .",
    "I am good I am am . How are you ?",
    "I am good I I am . How are you ?",
)


def example_model() -> kvlib.Params:
    """The toy with rotary positions (positions_and_rope) and 64 positions, as in the notebook."""
    return kvlib.init_params(kvlib.ModelConfig(positions="rotary", context_length=64))


def stream_ids(texts) -> list[list[int]]:
    tokenizer = kvlib.ToyTokenizer()
    return [tokenizer.encode(text) for text in texts]


class KeyFunctionError(Exception):
    """The student's block_key raised or returned something that cannot be a key."""


def _key(block_key, parent, tokens):
    try:
        key = block_key(parent, tokens)
    except Exception as error:  # a student's code may fail in any way; report it in words
        raise KeyFunctionError(f"your function raised {type(error).__name__}: {error} "
                               f"(called with parent_key={shown(parent)}, tokens={tokens})") \
            from None
    if key is None:
        raise KeyFunctionError("your function returned None: is a `return` missing?")
    if not isinstance(key, Hashable):
        raise KeyFunctionError(f"a dict key must be hashable, and your function returned a "
                               f"{type(key).__name__}: return a tuple, a number, a string or "
                               "bytes instead")
    try:
        hash(key)
    except TypeError as error:
        raise KeyFunctionError(f"a dict key must be hashable, and yours is not ({error}): "
                               "return a tuple of numbers, a string or bytes") from None
    return key


def serve_with_block_key(block_key, requests, params=None, block_size: int = BLOCK_SIZE):
    """Serve requests one after the other through a dict-based prefix cache whose keys come
    from block_key(parent_key, tokens) (prefix_caching). The first block's parent is ROOT; the
    last token is never reused. Returns, per request, (tokens reused, its last token's
    logits (V,)). Raises KeyFunctionError if block_key fails or returns no usable key."""
    params = example_model() if params is None else params
    store = {}                    # key -> ([K rows of every layer], [V rows of every layer])
    results = []
    for ids in requests:
        ids = [int(i) for i in ids]
        parent, reused = ROOT, []
        for start in range(0, len(ids) - 1 - block_size + 1, block_size):
            key = _key(block_key, parent, tuple(ids[start:start + block_size]))
            if key not in store:
                break
            reused.append(store[key])
            parent = key
        cache = kvlib.KVCache(params.config)
        for keys, values in reused:
            for layer in range(params.config.n_layers):
                cache.append(layer, keys[layer], values[layer])
        logits, _ = kvlib.prefill(params, ids[len(cache):], cache, last_only=True)
        results.append((len(reused) * block_size, logits[-1]))
        parent = ROOT
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = _key(block_key, parent, tuple(ids[start:start + block_size]))
            if key not in store:
                rows = slice(start, start + block_size)
                store[key] = ([cache.keys(layer)[rows].copy() for layer in
                               range(params.config.n_layers)],
                              [cache.values(layer)[rows].copy() for layer in
                               range(params.config.n_layers)])
            parent = key
    return results


def right_block_key(parent_key, tokens):
    """The reference key: the parent's key and the block's tokens (vLLM's block hash, as a
    tuple)."""
    return (parent_key, tuple(tokens))


def _collisions(block_key, requests, block_size: int = BLOCK_SIZE):
    """Two different prefixes whose last blocks got the same key: (prefix, prefix) or None;
    and whether two equal prefixes got different keys."""
    seen, unstable = {}, False
    for ids in requests:
        parent = ROOT
        for start in range(0, len(ids) - block_size + 1, block_size):
            prefix = tuple(ids[:start + block_size])
            key = _key(block_key, parent, tuple(ids[start:start + block_size]))
            again = _key(block_key, parent, tuple(ids[start:start + block_size]))
            unstable = unstable or key != again
            if key in seen and seen[key] != prefix:
                return (seen[key], prefix), unstable
            seen.setdefault(key, prefix)
            parent = key
    return None, unstable


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _words(ids) -> str:
    return " ".join(kvlib.ToyTokenizer().tokens(ids))


def _collision_message(first, second, block_size: int = BLOCK_SIZE) -> str:
    block_a, block_b = first[-block_size:], second[-block_size:]
    depth_a, depth_b = len(first) // block_size - 1, len(second) // block_size - 1
    if block_a == block_b and depth_a != depth_b:
        return (f"the block '{_words(block_a)}' gets the same key at positions "
                f"{depth_a * block_size}-{depth_a * block_size + block_size - 1} and at "
                f"{depth_b * block_size}-{depth_b * block_size + block_size - 1}: the key is "
                "the block's tokens alone, without its parent. Its K and V depend on its "
                "position and on every token before it, so the key must include the "
                "parent's key.")
    if block_a == block_b:
        return (f"the block '{_words(block_a)}' gets the same key after "
                f"'{_words(first[:-block_size])}' and after '{_words(second[:-block_size])}': "
                "your key tells positions apart but not what came before. Its K and V depend "
                "on every earlier token: build the key from the parent's key.")
    if sorted(block_a) == sorted(block_b) or set(block_a) == set(block_b):
        return (f"the blocks '{_words(block_a)}' and '{_words(block_b)}' hold the same tokens "
                "in another order (or other counts of them) and get the same key. Each token's "
                "K and V depend on its position and on the tokens before it, so the key must "
                "keep the block's tokens as they are, in order: tuple(tokens), not sorted or a "
                "set.")
    return (f"the different blocks '{_words(block_a)}' and '{_words(block_b)}' get the same key: "
            "does your key use the block's tokens?")


@checker
def check_block_key(block_key) -> Feedback:
    """Exercise 2: a fixed block_key(parent_key, tokens) for the dict-based prefix cache.

    Runs three streams of requests through serve_with_block_key (the notebook's, one whose
    third block follows another second block, one whose second blocks hold the same tokens
    in other orders) and compares every request's logits with kvlib.forward on the whole
    request, and what it reused with what it could.
    """
    if is_missing(block_key):
        return not_filled_in("answer", "your function (answer = block_key_fixed)")
    if not callable(block_key):
        return Feedback(False, f"answer should be a function like block_key_broken, not "
                        f"{described(block_key)}: write answer = block_key_fixed.")
    params = example_model()
    streams = (stream_ids(SHUFFLED_EXAMPLES), stream_ids(MIXED_EXAMPLES),
               stream_ids(REORDERED_EXAMPLES))
    for requests in streams:
        try:
            collision, unstable = _collisions(block_key, requests)
            results = serve_with_block_key(block_key, requests, params)
        except KeyFunctionError as error:
            return Feedback(False, _sentence(str(error)))
        except Exception as error:  # keys that cannot be compared or stored, in any way
            return Feedback(False, f"your keys cannot serve as dict keys: comparing or storing "
                            f"them raised {type(error).__name__}: {error}. Return a tuple of "
                            "numbers, a string or bytes.")
        expected = serve_with_block_key(right_block_key, requests, params)
        errors = [float(np.max(np.abs(logits - kvlib.forward(params, ids, last_only=True)[-1])))
                  for (_, logits), ids in zip(results, requests)]
        worst = int(np.argmax(errors))
        if collision is not None:
            shown = (f" Request {worst + 1} ('{_words(requests[worst])}') reused "
                     f"{results[worst][0]} tokens, and its logits differ from a full "
                     f"recomputation by up to {errors[worst]:.2g}." if errors[worst] > TOLERANCE
                     else "")
            return Feedback(False, _sentence(_collision_message(*collision)) + shown)
        if errors[worst] > TOLERANCE:       # pragma: no cover - no collision, no wrong reuse
            return Feedback(False, f"request {worst + 1}'s logits differ from a full "
                            f"recomputation by {errors[worst]:.2g}.")
        for number, ((got, _), (could, _)) in enumerate(zip(results, expected), start=1):
            if got < could:
                why = (" The same prefix gets different keys from one call to the next: is "
                       "your key random, or made from id() or a counter?") if unstable else ""
                return Feedback(False, f"the logits are right, but request {number} reused "
                                f"{got} tokens where {could} were cached.{why} Equal prefixes "
                                "must get equal keys.")
    return Feedback(True, "every request's logits equal a full recomputation, and every "
                    "request reused all the full blocks of its cached prefix: with the "
                    "parent in the key, equal keys mean equal prefixes, at equal positions.")


# Exercise 3 ------------------------------------------------------------------------------

LRU_SYSTEM_A = "you are good and I am fine"      # with BOS: 8 tokens, 2 blocks of 4
LRU_SYSTEM_B = "I am good . How are you"
LRU_STEPS = (              # (what happens, the request's text or its number)
    ("admit and finish", f"{LRU_SYSTEM_A} . How are you ?"),
    ("admit and finish", f"{LRU_SYSTEM_B} ? I am fine ."),
    ("admit, keep running", f"{LRU_SYSTEM_B} ? and you ?"),
    ("admit and finish", f"{LRU_SYSTEM_A} and you ? thanks"),
    ("admit and finish", "thanks . I am good"),
)
LRU_POOL = 12
LRU_NEEDED = 7             # blocks the next request needs; the pool has fewer free


def lru_scenario() -> PrefixServer:
    """The server of exercise 3, in a fresh copy: the toy with rotary positions, a pool of 12
    blocks of 4, after LRU_STEPS (request 2 is still running)."""
    tokenizer = kvlib.ToyTokenizer()
    server = PrefixServer(example_model(), LRU_POOL, BLOCK_SIZE)
    for action, text in LRU_STEPS:
        admission = server.admit(tokenizer.encode(text))
        if action == "admit and finish":
            server.finish(admission.request)
    return server


def lru_to_evict(server: PrefixServer) -> int:
    """How many blocks must go so that LRU_NEEDED are free."""
    return LRU_NEEDED - server.pool.n_free


def lru_expected() -> list[int]:
    server = lru_scenario()
    return [entry.block for entry in server.prefix_cache.eviction_order(lru_to_evict(server))]


def _eviction_key(entry):
    return (entry.last_used, -entry.depth, entry.block)


def _first_wrong_step(prefix_cache, numbers) -> str | None:
    """Replay the student's evictions and say what is wrong with the first wrong one."""
    entries = prefix_cache.entries
    evicted: list = []
    for step, block in enumerate(numbers, start=1):
        entry = prefix_cache.entry(block)
        if prefix_cache.is_held(entry):
            return (f"block {block} is held by request 2, which is still running: evicting it "
                    "would pull its K and V from under it. Only blocks nobody but the cache "
                    "holds can go.")
        left = [e for e in entries if e.parent == entry.key and e not in evicted]
        if left:
            return (f"at eviction {step}, block {block} still has a cached child (block "
                    f"{left[0].block}), which would become unreachable: only a leaf can go, "
                    "and a parent becomes one when its last child has gone. (Between blocks "
                    "last used at the same tick, the deeper one goes first.)")
        candidates = [e for e in entries if e not in evicted and not prefix_cache.is_held(e)
                      and not any(c.parent == e.key and c not in evicted for c in entries)]
        best = min(candidates, key=_eviction_key)
        if best is not entry:
            if best.last_used == entry.last_used:
                return (f"at eviction {step}, blocks {best.block} and {block} were last used "
                        "at the same tick: the deeper one goes first (the end of a prefix is "
                        "less likely to be shared than its start).")
            joined = (" (it became a candidate when its last cached child went)"
                      if best.children else "")
            hits = (f" (Block {block} has fewer hits, {entry.hits} against {best.hits}, but "
                    "the rule counts when a block was last used, not how often.)"
                    if entry.hits < best.hits else "")
            return (f"at eviction {step}, block {best.block}{joined} was last used at tick "
                    f"{best.last_used}, before block {block} (tick {entry.last_used}): the "
                    "least recently used goes first." + hits)
        evicted.append(entry)
    return None


@checker
def check_eviction_order(answer) -> Feedback:
    """Exercise 3: the blocks evicted, in order, when the next request needs LRU_NEEDED
    blocks (after LRU_STEPS)."""
    server = lru_scenario()
    prefix_cache = server.prefix_cache
    n = lru_to_evict(server)
    expected = [entry.block for entry in prefix_cache.eviction_order(n)]
    if isinstance(answer, set):
        return Feedback(False, f"a set has no order: give the {n} block numbers as a list, "
                        "the first evicted first.")
    numbers = read_whole_numbers(answer, n, expected=tuple(expected))
    if isinstance(numbers, Feedback):
        return numbers
    numbers = list(numbers)
    if numbers == expected:
        return Feedback(True, f"{numbers}: never a block a running request holds, a leaf "
                        "before its parent, the least recently used first; and block "
                        f"{expected[-1]} joined the candidates when its last cached child "
                        "went." if prefix_cache.entry(expected[-1]).children else
                        f"{numbers}: never a block a running request holds, a leaf before its "
                        "parent, the least recently used first.")
    cached = {entry.block for entry in prefix_cache.entries}
    unknown = [block for block in numbers if block not in cached]
    if unknown:
        return Feedback(False, f"block {unknown[0]} holds no cached prefix: pick from the "
                        "blocks listed in the table.")
    if len(set(numbers)) < len(numbers):
        return Feedback(False, "a block is evicted once: the numbers must be different.")
    prefix = ""
    if sorted(numbers) == sorted(expected):
        prefix = "the right blocks, in another order. "
    why = _first_wrong_step(prefix_cache, numbers) or f"not {numbers}."
    if prefix:
        why = why[0].upper() + why[1:]
    return Feedback(False, prefix + why)


SOLUTIONS = {
    1: """
def reusable(shared, request_length, block_size):
    usable = min(shared, request_length - 1)     # the last token always runs
    return usable // block_size * block_size      # full blocks only

answer = (reusable(45, 75, 16), reusable(45, 75, 8), reusable(45, 75, 64),
          reusable(64, 64, 16))                    # (32, 40, 0, 48)
""",
    2: """
def block_key_fixed(parent_key, tokens):
    # the parent's key stands for every token before the block: equal keys, equal prefixes
    return (parent_key, tuple(tokens))

answer = block_key_fixed
""",
    3: """
# candidates: held by no running request and no cached child; least recently used first,
# the deeper block first between equal ticks; a parent joins when its last child goes
server = exercises.lru_scenario()
to_evict = exercises.LRU_NEEDED - server.pool.n_free          # 7 needed, 3 free: 4
answer = [entry.block for entry in server.prefix_cache.eviction_order(to_evict)]
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
