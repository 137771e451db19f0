"""Notebook 20 (prefix caching across requests): kvlib.serving.prefix proven against plain
prefills over random request streams (the longest cached prefix's exact K and V, logits with
reuse equal to logits without, no leaked block, no block a running request holds ever
evicted), its eviction rules, its errors and a fuzz of its API; the widget driven headless; the
exercise checkers with tables of wrong answers and valid answers in other forms (what every
checker does with odd input is tested once for all lessons, in test_checkers.py)."""

import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import (
    assert_correct,
    assert_not_yet,
    case_id,
    student_answers,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from strategies import models
from widget_checks import assert_check_line_is_computed

import kvlib
from kvlib.exercises import prefix_caching as ex20
from kvlib.serving import (
    ROOT_KEY,
    CachedBlock,
    PrefixServer,
    Request,
    block_key,
    block_keys,
)
from kvlib.widgets import prefix_caching as w20

TOLERANCE = 1e-10
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def toy():
    return w20.example_model()


def tokens(text):
    return kvlib.ToyTokenizer().encode(text)


def prompts(data, config, n_stems=3, max_stem=10, max_own=6):
    """A drawer of requests that often share a beginning: one of a few stems, then tokens
    of their own (possibly none)."""
    vocabulary = st.integers(0, config.vocab_size - 1)
    stems = data.draw(st.lists(st.lists(vocabulary, min_size=0, max_size=max_stem),
                               min_size=1, max_size=n_stems))

    def draw():
        stem = data.draw(st.sampled_from(stems))
        own = data.draw(st.lists(vocabulary, min_size=1 if not stem else 0, max_size=max_own))
        return (stem + own)[: config.context_length]

    return draw


def cached_rows(pool, entries, layer):
    """K and V of a chain of cached blocks, gathered from the pool: (n x B, width) each."""
    if not entries:
        width = pool.width
        return np.zeros((0, width)), np.zeros((0, width))
    return (np.concatenate([pool.keys[layer, e.block] for e in entries]),
            np.concatenate([pool.values[layer, e.block] for e in entries]))


def check_accounting(server: PrefixServer):
    """Every reference is accounted for: a block's count is the running requests that list
    it plus one if the prefix cache keeps it; the pool and the prefix cache are consistent."""
    server.pool.check_invariants()
    server.prefix_cache.check_invariants()
    expected = np.zeros(server.pool.n_blocks, dtype=np.int64)
    for running in server.running.values():
        for block in running.block_table:
            expected[block] += 1
    for entry in server.prefix_cache.entries:
        expected[entry.block] += 1
    np.testing.assert_array_equal(server.pool.ref_counts, expected)


# ---------------------------------------------------------------------------------------------
# Properties: the prefix cache against plain prefills
# ---------------------------------------------------------------------------------------------

@given(models(latent=False, window=False), st.integers(1, 5), st.data())
@PROPERTY
def test_match_returns_exactly_the_kv_of_the_longest_stored_prefix(model, block_size, data):
    params, config = model
    server = PrefixServer(params, n_blocks=200, block_size=block_size)
    draw = prompts(data, config)
    stored = set()                      # every full-block prefix of a finished request
    for _ in range(data.draw(st.integers(1, 6))):
        ids = draw()
        admission = server.admit(ids)
        server.finish(admission.request)
        stored |= {tuple(ids[:end]) for end in range(block_size, len(ids) + 1, block_size)}
    check_accounting(server)
    query = draw()
    found = server.prefix_cache.match(query)
    longest = max((end for end in range(block_size, len(query) + 1, block_size)
                   if tuple(query[:end]) in stored), default=0)
    assert len(found) * block_size == longest
    assert [e.depth for e in found] == list(range(len(found)))
    if longest:
        _, alone = kvlib.prefill(params, query[:longest])
        for layer in range(config.n_layers):
            keys, values = cached_rows(server.pool, found, layer)
            np.testing.assert_allclose(keys, alone.keys(layer), rtol=0, atol=TOLERANCE)
            np.testing.assert_allclose(values, alone.values(layer), rtol=0, atol=TOLERANCE)
    reusable = server.prefix_cache.reusable(query)
    assert len(reusable) * block_size == max(
        (end for end in range(block_size, len(query), block_size)
         if tuple(query[:end]) in stored), default=0)


@given(models(latent=False, window=False), st.integers(1, 4), st.data())
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_random_request_streams_with_evictions(model, block_size, data):
    """Admissions, decode steps and finishes in any order, on a pool small enough to evict:
    logits equal full recomputation, a running request's K and V never change under it (no
    block it holds is evicted or overwritten), and no block leaks."""
    params, config = model
    longest = -(-18 // block_size)                    # blocks of the longest request drawn
    n_blocks = data.draw(st.integers(longest + 1, 3 * longest + 4))
    server = PrefixServer(params, n_blocks=n_blocks, block_size=block_size)
    draw = prompts(data, config, max_stem=12)
    texts = {}
    evictions = 0
    for _ in range(data.draw(st.integers(5, 30))):
        action = data.draw(st.sampled_from(["admit", "admit", "decode", "finish"]))
        held = server.held_blocks()
        if action == "admit" or not server.running:
            ids = draw()
            before = server.pool.ref_counts.copy(), len(server.prefix_cache)
            try:
                admission = server.admit(ids)
            except MemoryError:
                # nothing is held and nothing evicted when a request does not fit
                np.testing.assert_array_equal(server.pool.ref_counts, before[0])
                assert len(server.prefix_cache) == before[1]
                continue
            assert not set(admission.evicted_blocks) & held
            evictions += len(admission.evicted_blocks)
            np.testing.assert_allclose(admission.logits, kvlib.forward(params, ids)[-1:],
                                       rtol=0, atol=TOLERANCE)
            assert admission.reused_tokens <= len(ids) - 1
            assert admission.reused_tokens + admission.prefilled_tokens == len(ids)
            texts[admission.request] = list(ids)
        elif action == "decode":
            request = data.draw(st.sampled_from(sorted(server.running)))
            if len(texts[request]) >= config.context_length:
                continue
            token = data.draw(st.integers(0, config.vocab_size - 1))
            try:
                logits = server.decode(request, token)
            except MemoryError:
                assert len(server.caches[request]) == len(texts[request])
                continue
            texts[request].append(token)
            np.testing.assert_allclose(logits, kvlib.forward(params, texts[request])[-1:],
                                       rtol=0, atol=TOLERANCE)
        else:
            request = data.draw(st.sampled_from(sorted(server.running)))
            server.finish(request)
            del texts[request]
        check_accounting(server)
        for request, running in server.running.items():
            assert running.all_token_ids == texts[request]
            _, reference = kvlib.prefill(params, texts[request])
            cache = server.caches[request]
            for layer in range(config.n_layers):
                np.testing.assert_allclose(cache.keys(layer), reference.keys(layer),
                                           rtol=0, atol=TOLERANCE)
                np.testing.assert_allclose(cache.values(layer), reference.values(layer),
                                           rtol=0, atol=TOLERANCE)
    event(f"blocks evicted: {'none' if not server.prefix_cache.n_evicted else 'some'}")
    for request in list(server.running):
        server.finish(request)
    check_accounting(server)
    assert server.pool.n_used == len(server.prefix_cache)     # only the cache holds any
    assert server.prefix_cache.n_evicted >= evictions              # decode steps evict too
    server.prefix_cache.make_room(n_blocks)                        # everything can go now
    assert len(server.prefix_cache) == 0 and server.pool.n_free == n_blocks
    check_accounting(server)


@given(models(latent=False, window=False), st.integers(1, 4), st.data())
@PROPERTY
def test_a_running_requests_full_blocks_are_reused_at_once(model, block_size, data):
    """With nothing finished and nothing evicted, every full block of every running request
    (prompt or generated) is cached: a new request reuses the longest full-block prefix it
    shares with any of them, all but its last token."""
    params, config = model
    server = PrefixServer(params, n_blocks=300, block_size=block_size)
    draw = prompts(data, config)
    texts = {}

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for _ in range(data.draw(st.integers(1, 10))):
        if texts and data.draw(st.booleans()):
            request = data.draw(st.sampled_from(sorted(texts)))
            if len(texts[request]) < config.context_length:
                token = data.draw(st.integers(0, config.vocab_size - 1))
                server.decode(request, token)
                texts[request].append(token)
            continue
        ids = draw()
        shared = max((common(ids[:-1], text) for text in texts.values()), default=0)
        admission = server.admit(ids)
        assert admission.reused_tokens == shared // block_size * block_size
        texts[admission.request] = list(ids)
    full = {key for text in texts.values() for key in block_keys(text, block_size)}
    assert {e.key for e in server.prefix_cache.entries} == full
    check_accounting(server)


@given(models(latent=False, window=False), st.integers(1, 4), st.data())
@PROPERTY
def test_eviction_never_takes_a_held_block_and_goes_leaves_first(model, block_size, data):
    params, config = model
    server = PrefixServer(params, n_blocks=120, block_size=block_size)
    draw = prompts(data, config)
    for _ in range(data.draw(st.integers(1, 8))):
        admission = server.admit(draw())
        if data.draw(st.booleans()):
            server.finish(admission.request)
    held = server.held_blocks()
    cache = server.prefix_cache
    order = cache.eviction_order()
    assert not {e.block for e in order} & held
    gone = set()
    for entry in order:                 # a block goes only after all its cached children
        assert all(child.key in gone for child in cache.entries if child.parent == entry.key)
        gone.add(entry.key)
    # everything that is neither held nor above a held block can go, nothing else
    pinned = {e.key for e in cache.entries if cache.is_held(e)}
    changed = True
    while changed:
        parents = {e.parent for e in cache.entries if e.key in pinned} - {ROOT_KEY} - pinned
        changed = bool(parents)
        pinned |= parents
    assert {e.key for e in order} == {e.key for e in cache.entries} - pinned
    evicted = [cache.evict().block for _ in order]
    assert evicted == [e.block for e in order]
    with pytest.raises(MemoryError, match="no cached block can be evicted"):
        cache.evict()
    check_accounting(server)
    for running in server.running.values():
        _, reference = kvlib.prefill(params, running.all_token_ids)
        np.testing.assert_allclose(server.caches[running.request_id].keys(0), reference.keys(0),
                                   rtol=0, atol=TOLERANCE)


@given(models(latent=False, window=False), st.integers(1, 4), st.data())
@PROPERTY
def test_prefix_cache_bytes_equal_their_formula(model, block_size, data):
    params, config = model
    server = PrefixServer(params, n_blocks=100, block_size=block_size)
    draw = prompts(data, config)
    for _ in range(data.draw(st.integers(1, 5))):
        server.finish(server.admit(draw()).request)
    itemsize = np.dtype(config.dtype).itemsize
    per_block = 2 * config.n_layers * block_size * config.kv_width * itemsize
    assert server.prefix_cache.nbytes == len(server.prefix_cache) * per_block
    assert server.pool.nbytes_in_use == server.prefix_cache.nbytes


# ---------------------------------------------------------------------------------------------
# Keys, positions, full blocks, the last token
# ---------------------------------------------------------------------------------------------

def test_block_keys_chain_through_the_parent():
    a = block_keys([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_keys([1, 2, 3, 4, 9, 9], 2)
    assert len(a) == 3 and len(b) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert a[0] == block_key(ROOT_KEY, [1, 2]) and a[1] == block_key(a[0], [3, 4])
    # the same tokens after another beginning, or at another place: another key
    assert block_keys([5, 5, 3, 4], 2)[1] != a[1]
    assert block_keys([3, 4], 2)[0] != a[1]
    assert block_keys(np.array([1, 2, 3]), 2) == a[:1]          # arrays work; no partial key
    assert block_keys([1], 2) == []
    assert all(len(key) == 32 for key in a)


def test_rotary_keys_depend_on_the_position_and_the_earlier_tokens(toy):
    block = tokens("How are you ?")[1:]

    def rows(beginning, layer):
        _, cache = kvlib.prefill(toy, beginning + block)
        return cache.keys(layer)[len(beginning):]

    here, other_start, elsewhere = tokens("I am good"), tokens("you are good"), tokens("I am")
    assert np.allclose(rows(here, 0), rows(other_start, 0))      # same place, same tokens
    assert not np.allclose(rows(here, 1), rows(other_start, 1))  # but other earlier tokens
    assert not np.allclose(rows(here, 0), rows(elsewhere, 0))    # another place


def test_only_full_blocks_are_shared_and_the_last_token_always_runs(toy):
    server = PrefixServer(toy, n_blocks=16, block_size=4)
    ids = tokens("I am good . How are you ?")                      # 9 tokens: 2 full blocks
    first = server.admit(ids)
    assert [e.depth for e in server.finish(first.request)] == [0, 1]
    assert len(server.prefix_cache) == 2                           # the 9th token's block: no
    same = server.admit(ids)
    assert same.reused_tokens == 8 and same.prefilled_tokens == 1
    server.finish(same.request)
    eight = server.admit(ids[:8])                                  # exactly 2 cached blocks
    assert eight.reused_tokens == 4                                # the last block runs again
    np.testing.assert_allclose(eight.logits, kvlib.forward(toy, ids[:8])[-1:], atol=TOLERANCE)
    server.finish(eight.request)
    partial = server.admit(ids[:6] + [3, 3, 3])                    # shares 6 tokens
    assert partial.reused_tokens == 4


def test_a_reused_block_is_never_written_into(toy):
    """Appending after a reused prefix starts a new block; truncating into a cached block and
    writing there copies it first (copy-on-write), so the cached rows never change."""
    server = PrefixServer(toy, n_blocks=16, block_size=4)
    ids = tokens("I am good . How are you ?")
    server.finish(server.admit(ids).request)
    cached = [e.block for e in server.prefix_cache.entries]
    before = server.pool.keys[:, cached].copy()
    admission = server.admit(ids[:8] + [2, 2])
    cache = server.caches[admission.request]
    cache.truncate(6)                                      # back into cached block 1
    kvlib.decode_step(toy, 10, cache)
    np.testing.assert_array_equal(server.pool.keys[:, cached], before)
    assert cache.block_table[0] == cached[0] and cache.block_table[1] != cached[1]
    check_accounting(server)


def test_blocks_are_cached_as_they_fill_while_the_request_runs(toy):
    """The prompt's full blocks are cached right after its prefill and a generated block when
    it fills, so a second request admitted while the first still runs reuses every full block
    of their common beginning (vLLM, SGLang and nano-vllm do the same); the last token of a
    prompt always runs."""
    server = PrefixServer(toy, n_blocks=16, block_size=4)
    ids = tokens("I am good . How are you ? I am fine")           # 12 tokens: 3 full blocks
    first = server.admit(ids[:10])                                 # 2 full blocks, 2 rows more
    assert len(first.cached_blocks) == 2 and len(server.prefix_cache) == 2
    second = server.admit(ids[:10])                                # the first still runs
    assert second.reused_blocks == first.cached_blocks and second.reused_tokens == 8
    assert second.cached_blocks == ()                              # nothing new to cache
    for token in ids[10:]:                                         # the first fills block 2
        server.decode(first.request, token)
    assert len(server.prefix_cache) == 3
    longer = ids + tokens("thanks")[1:]                            # 13 tokens
    third = server.admit(longer)                                   # the first still runs
    assert third.reused_tokens == 12
    np.testing.assert_allclose(third.logits, kvlib.forward(toy, longer)[-1:], atol=TOLERANCE)
    held = [e for e in server.prefix_cache.entries if server.prefix_cache.is_held(e)]
    assert len(held) == 3                                          # all held by running ones
    same = server.admit(ids)                                       # exactly 3 full blocks:
    assert same.reused_tokens == 8                                 # the last token runs, so
    check_accounting(server)                                       # its block runs again


def test_chat_requests_to_smollm2_share_their_system_message():
    """The real model of the notebook's last section: two chat requests with one system
    message, through SmolLM2's template. The system message is a prefix of both; the second
    reuses every full block of their common beginning, and its logits and greedy token equal
    a plain prefill's (float32; GQA, rotary positions, RMSNorm and SwiGLU on a paged cache).
    A date at the top of the system message leaves nothing to reuse."""
    from kvlib.chat import reusable_prefix

    params, tokenizer = kvlib.load_smollm2(), kvlib.smollm2_tokenizer()
    system = "You answer in one short sentence. You never make up facts."

    def chat(question, system=system):
        return tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": question}])

    first, second = chat("Name a planet."), chat("What colour is the sky?")
    system_part = tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                                add_generation_prompt=False)
    assert first[:len(system_part)] == second[:len(system_part)] == system_part
    shared = reusable_prefix(first, second)
    server = PrefixServer(params, n_blocks=16, block_size=8)
    server.admit(first)
    admitted = server.admit(second)                          # the first still runs
    assert admitted.reused_tokens == shared // 8 * 8 > 0
    plain, _ = kvlib.prefill(params, second, last_only=True)
    assert np.abs(admitted.logits - plain).max() <= 1e-4 * np.abs(plain).max()
    assert int(admitted.logits[-1].argmax()) == int(plain[-1].argmax())
    check_accounting(server)
    dated = [chat(question, f"Today is {day}. {system}") for question, day in
             (("Name a planet.", "Monday"), ("What colour is the sky?", "Tuesday"))]
    assert reusable_prefix(*dated) < 8
    assert server.prefix_cache.reusable(dated[1]) == []        # another beginning: a miss


def test_the_reuse_bars():
    fig, ax = plt.subplots()
    w20.draw_reuse_bars(ax, ["a", "b"], [40, 36], [0, 32], 16)
    reused, computed = ax.containers
    assert [bar.get_width() for bar in reused] == [0, 32]
    assert [bar.get_width() for bar in computed] == [40, 4]
    assert [bar.get_x() for bar in computed] == [0, 32]
    placed = {tick: label.get_text() for tick, label in zip(ax.get_yticks(),
                                                           ax.get_yticklabels())}
    assert placed == {1: "a", 0: "b"}                              # the first on top
    assert len(ax.lines) == 1                                      # one boundary inside 32
    assert ax.get_title() == "32 of 76 prompt tokens reused"
    with pytest.raises(ValueError, match="more tokens than it has"):
        w20.draw_reuse_bars(ax, ["a"], [4], [5], 4)
    with pytest.raises(ValueError, match="one name"):
        w20.draw_reuse_bars(ax, ["a"], [4, 5], [1, 1], 4)


def test_a_block_computed_twice_is_cached_once(toy):
    """A request admitted before another one filled a block computes that block too; the
    copy cached first stays the cached one, the other is freed with its request."""
    server = PrefixServer(toy, n_blocks=16, block_size=4)
    ids = tokens("I am good . How are you ?")
    a = server.admit(ids[:6])                       # block 0 cached, block 1 partly filled
    b = server.admit(ids[:9])                       # reuses block 0, computes and caches 1
    assert b.reused_tokens == 4 and len(b.cached_blocks) == 1
    for token in ids[6:8]:                          # a fills its own block 1: already cached
        server.decode(a.request, token)
    a_table = list(server.caches[a.request].block_table)
    b_table = server.caches[b.request].block_table
    assert a_table[0] == b_table[0] and a_table[1] != b_table[1]
    assert len(server.prefix_cache) == 2
    assert [e.block for e in server.finish(a.request)] == b_table[:2]
    assert server.pool.ref_counts[a_table[1]] == 0          # a's copy went back
    server.finish(b.request)
    assert len(server.prefix_cache) == 2 and server.pool.n_used == 2
    check_accounting(server)


def test_hits_and_the_clock():
    params = w20.example_model()
    server = PrefixServer(params, n_blocks=16, block_size=4)
    ids = tokens("I am good . How are you ?")
    server.finish(server.admit(ids).request)                 # tick 1 (admit), 2 (insert)
    assert [e.hits for e in server.prefix_cache.entries] == [0, 0]
    assert [e.last_used for e in server.prefix_cache.entries] == [2, 2]
    admission = server.admit(ids)                            # tick 3: a hit on both
    assert [e.hits for e in server.prefix_cache.entries] == [1, 1]
    assert [e.last_used for e in server.prefix_cache.entries] == [3, 3]
    assert "CachedBlock(block 0, positions 0-3" in repr(server.prefix_cache.entries[0])
    assert "1 hits, last used at 3" in repr(server.prefix_cache.entries[0])
    assert "2 of them held by running requests" in repr(server.prefix_cache)
    assert "1 running" in repr(server)
    server.finish(admission.request)


def test_eviction_order_rules_by_hand():
    """LRU among leaves nobody holds; the deeper first at the same tick; a parent joins when
    its last child goes; make_room evicts exactly what is missing, or nothing."""
    server = ex20.lru_scenario()
    cache = server.prefix_cache
    order = [e.block for e in cache.eviction_order()]
    assert order[:4] == ex20.lru_expected() == [2, 6, 9, 1]
    before = cache.eviction_order(4)
    evicted = cache.make_room(ex20.LRU_NEEDED)
    assert evicted == before and [e.block for e in evicted] == [2, 6, 9, 1]
    assert server.pool.n_free == ex20.LRU_NEEDED
    assert cache.make_room(ex20.LRU_NEEDED) == []
    ref_counts, cached = server.pool.ref_counts.copy(), len(cache)
    with pytest.raises(MemoryError, match="held by running requests"):
        cache.make_room(server.pool.n_blocks)
    np.testing.assert_array_equal(server.pool.ref_counts, ref_counts)
    assert len(cache) == cached
    check_accounting(server)


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing changed
# ---------------------------------------------------------------------------------------------

def test_bad_input_gets_clear_errors(toy):
    with pytest.raises(TypeError, match="needs kvlib Params"):
        PrefixServer(toy.config, 8)
    with pytest.raises(TypeError, match="whole numbers"):
        block_keys("How are you", 2)
    with pytest.raises(TypeError, match="whole numbers"):
        block_keys([1.5, 2], 2)
    with pytest.raises(ValueError, match="block_size must be"):
        block_keys([1, 2], 0)
    server = PrefixServer(toy, n_blocks=4, block_size=4)
    with pytest.raises(MemoryError, match="the pool has 4 in all"):
        server.admit([0] * 20)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        server.admit([0, 99])
    with pytest.raises(ValueError, match="running request"):
        server.finish(3)
    with pytest.raises(ValueError, match="running request"):
        server.decode(True, 1)
    with pytest.raises(TypeError, match="whole numbers"):
        server.prefix_cache.match("How")
    assert server.pool.n_free == 4 and not server.running


def test_a_request_that_does_not_fit_holds_nothing(toy):
    server = PrefixServer(toy, n_blocks=6, block_size=4)
    ids = tokens("I am good . How are you ? I am fine . thanks")     # 14 tokens: 4 blocks
    running = server.admit(ids)                      # its 3 full blocks cached, all held
    before = server.pool.ref_counts.copy()
    with pytest.raises(MemoryError, match="held by running requests"):
        server.admit(tokens("you are good . thanks . I am"))         # 9 tokens: 3 blocks
    np.testing.assert_array_equal(server.pool.ref_counts, before)
    assert list(server.running) == [running.request]
    check_accounting(server)


def test_check_invariants_notices_a_broken_tree(toy):
    server = PrefixServer(toy, n_blocks=12, block_size=4)
    server.finish(server.admit(tokens("I am good . How are you ?")).request)
    entry = server.prefix_cache.entries[0]
    entry.children += 1
    with pytest.raises(AssertionError, match="counts its cached children wrong"):
        server.prefix_cache.check_invariants()
    entry.children -= 1
    server.pool.release(entry.block)           # a bug: the cache's reference dropped
    with pytest.raises(AssertionError, match="not held by the cache"):
        server.prefix_cache.check_invariants()


def test_cached_block_fields():
    entry = CachedBlock(b"k", ROOT_KEY, (1, 2, 3, 4), block=7, depth=2)
    assert entry.positions == range(8, 12)


# ---------------------------------------------------------------------------------------------
# The widget and its drawings
# ---------------------------------------------------------------------------------------------

def status_text(widget):
    return re.sub(r"<[^>]+>", "", widget.status.value)


def test_widget_starts_empty_and_serves_a_request_per_click(toy):
    widget = w20.prefix_stream_explorer(toy)
    assert widget.arrive.description == "Next request" and widget.reset.description == "Reset"
    assert "No request yet" in widget.status.value
    assert widget.message.value == ""
    tree_ax = widget.figure.axes[0]
    assert "the prefix cache is empty" in [t.get_text() for t in tree_ax.texts]
    stream = widget.run().stream
    for click in range(6):
        widget.arrive.click()
        run = widget.run()
        admission = run.admissions[-1]
        assert admission.ids == stream[click].ids and admission.request == click
        status = status_text(widget)
        assert f"Request {click}" in status
        assert f"reused {admission.reused_tokens} tokens" in status
        assert f"prefilled {admission.prefilled_tokens}" in status
        assert (f"So far: {run.reused_tokens} of {run.prompt_tokens} prompt tokens reused"
                in status)
        assert "equal a full recomputation" in widget.check.value
        # one box per cached block; the reused ones drawn yellow
        tree_ax = widget.figure.axes[0]
        boxes = [t for t in tree_ax.texts if t.get_bbox_patch() is not None]
        assert len(boxes) == len(run.server.prefix_cache)
        yellow = {int(re.match(r"b(\d+)", t.get_text()).group(1)) for t in boxes
                  if np.allclose(t.get_bbox_patch().get_facecolor(), w20.REUSED_COLOR)}
        assert yellow == set(admission.reused_blocks)
        # the request strip: reused cells first
        strip = np.asarray(widget.figure.axes[1].images[0].get_array())[0]
        assert strip.sum() == admission.reused_tokens and (np.diff(strip) <= 0).all()
        # the pool: one block each, labelled by its state as the server says
        labels = {int(t.get_gid().split()[1]): t.get_text() for t in widget.figure.axes[2].texts
                  if (t.get_gid() or "").startswith("block")}
        states = w20.pool_states(run.server)
        assert [labels[b] == "" for b in range(len(states))] == list(states == 0)
        assert [labels[b] == "cached" for b in range(len(states))] == list(states == 1)
    assert widget.run().reused_tokens > 0


def test_widget_evicts_in_a_small_pool_and_says_so(toy):
    widget = w20.prefix_stream_explorer(toy)
    widget.pool.value = 12
    assert widget.message.value == ""
    for _ in range(25):
        widget.arrive.click()
    run = widget.run()
    assert run.evicted > 0 and run.server.prefix_cache.n_evicted == run.evicted
    assert f"{run.evicted} blocks evicted" in status_text(widget)
    assert all(len(a.logits) for a in run.admissions)
    check_accounting(run.server)


def test_widget_status_counts_in_words(toy):
    """One block, one running request: no "1 blocks", no "1 running requests"."""
    widget = w20.prefix_stream_explorer(toy)
    widget.pool.value = widget.pool.min                     # 10 blocks: evictions soon
    seen = set()
    for _ in range(12):
        widget.arrive.click()
        run, status = widget.run(), status_text(widget)
        running = len(run.server.running)
        assert f"held by {running} running request{'s' if running > 1 else ''}." in status
        assert f"{run.evicted} block{'' if run.evicted == 1 else 's'} evicted" in status
        seen |= {("running", running), ("evicted", run.evicted)}
    assert {("running", 1), ("running", 2), ("evicted", 1), ("evicted", 2)} <= seen


def test_widget_redraws_in_place(toy):
    """A click redraws the same three Axes (rebuilding them and their ticks is what made a
    click slow) and shows one PNG render."""
    widget = w20.prefix_stream_explorer(toy)
    axes = list(widget.figure.axes)
    for _ in range(5):
        widget.arrive.click()
    assert widget.figure.axes == axes
    tree_ax = axes[0]
    assert len(tree_ax.texts) == len(widget.run().server.prefix_cache)
    assert len(axes[1].images) == 1 and len(axes[2].collections) in (2, 3)   # the pool
    assert tree_ax.get_legend() is not None and axes[2].get_legend() is not None


def as_values(stream):
    return [(item.ids, item.system, item.lifetime) for item in stream]


def test_widget_controls_start_a_new_stream(toy):
    widget = w20.prefix_stream_explorer(toy)
    widget.arrive.click()
    first = widget.run()
    widget.block.value = 8
    assert widget.run() is not first and widget.run().server.block_size == 8
    assert "No request yet" in widget.status.value
    widget.seed.value = 5
    assert as_values(widget.run().stream) == as_values(w20.request_stream(40, 5))
    widget.arrive.click()
    widget.reset.click()
    assert widget.run().position == 0


def test_widget_offers_only_pools_the_stream_fits_in(toy):
    """The slider starts at the smallest pool that holds two of the stream's longest requests,
    for the block size and seed chosen; below it nothing can be set, so nothing is refused
    and the pool drawn is always the slider's."""
    widget = w20.prefix_stream_explorer(toy)

    def smallest():
        size = widget.block.value
        return 2 * max(-(-len(item.ids) // size) for item in widget.run().stream)

    for size in (2, 8, 4):
        widget.block.value = size
        assert widget.pool.min == smallest()
        assert widget.run().server.pool.n_blocks == widget.pool.value >= smallest()
        assert widget.message.value == ""
    widget.pool.value = widget.pool.min - 2               # clamped to the minimum
    assert widget.pool.value == widget.pool.min == widget.run().server.pool.n_blocks
    widget.block.value = 2                                # a larger minimum moves it up
    assert widget.pool.value == widget.pool.min == widget.run().server.pool.n_blocks
    widget.pool.value = 40
    assert widget.run().server.pool.n_blocks == 40 and widget.message.value == ""
    for seed in range(6):
        widget.seed.value = seed
        assert widget.pool.min == smallest() and widget.message.value == ""


def test_widget_check_line_is_computed(toy, monkeypatch):
    widget = w20.prefix_stream_explorer(toy)
    assert_check_line_is_computed(monkeypatch, widget, widget.arrive,
                                  "differ from a full recomputation", "equal a full recomputation")


def test_widget_stream_end_disables_the_button_and_nothing_leaks(toy):
    before = plt.get_fignums()
    widget = w20.prefix_stream_explorer(toy, n_requests=5)
    for _ in range(8):
        widget.arrive.click()
    assert widget.arrive.disabled and widget.run().position == 5
    assert widget.message.value == ""
    widget.reset.click()
    assert not widget.arrive.disabled
    assert plt.get_fignums() == before


def test_a_request_that_does_not_fit_waits(toy):
    first = w20.Arrival(Request(0, tokens("I am good . How are you ? and you")), "", 2)
    other = w20.Arrival(Request(0, tokens("you are good . thanks . I am fine")), "", 2)
    stream = [first, other, first]                   # 11 and 10 tokens: 3 blocks each
    run = w20.StreamRun(PrefixServer(toy, n_blocks=5, block_size=4), stream)
    assert run.arrive() is not None
    assert run.arrive() is None and run.waited and run.position == 1
    assert run.arrive() is not None and not run.waited       # the first one finished


def test_drawings_check_their_input_and_stay_small(toy):
    figure = plt.figure()
    ax = figure.add_subplot()
    with pytest.raises(ValueError, match="reused_tokens must be between"):
        w20.draw_request(ax, ["a", "b"], 3, 2)
    run = w20.StreamRun(PrefixServer(toy, 48, 2), w20.request_stream(30, 0))
    for _ in range(30):
        run.arrive()
    tree_ax, _, _ = w20.draw_prefix_state(figure, run.server, run.admissions[-1],
                                          kvlib.ToyTokenizer().tokens)
    # a redraw is a handful of artists per block, not per token or per cell
    assert len(tree_ax.texts) == len(run.server.prefix_cache)
    assert len(tree_ax.collections) == 1 and len(tree_ax.patches) == 0
    assert "\n" not in tree_ax.texts[0].get_text()            # many rows: one-line boxes


def test_tree_layout_puts_children_right_of_their_parent(toy):
    server = PrefixServer(toy, n_blocks=30, block_size=4)
    for text in ("I am good . How are you ?", "I am good . thanks . and", "you are good ."):
        server.finish(server.admit(tokens(text)).request)
    place = w20.tree_layout(server.prefix_cache.entries)
    for entry in server.prefix_cache.entries:
        x, y = place[entry.key]
        assert x == entry.depth
        if entry.parent != ROOT_KEY:
            assert place[entry.parent][0] == x - 1
    ys = [y for _, y in place.values()]
    assert len(set(place.values())) == len(place) and min(ys) == 0


def test_cache_table_lists_every_block():
    server = ex20.lru_scenario()
    table = w20.cache_table(server.prefix_cache, kvlib.ToyTokenizer().tokens)
    lines = table.splitlines()
    assert len(lines) == 1 + len(server.prefix_cache)
    assert "last used" in lines[0] and "held" in lines[0]
    assert re.search(r"^\s+5\s+4-7\s+\. How are you\s+1\s+5\s+yes\s+2$", table, re.M)
    assert re.search(r"^\s+8\s+8-11\s+\? and you \?\s+0\s+5\s+yes\s+0$", table, re.M)


def test_request_stream_is_seeded_and_shares_system_prompts():
    stream = w20.request_stream(40, seed=0)
    assert as_values(stream) == as_values(w20.request_stream(40, seed=0)) != \
        as_values(w20.request_stream(40, seed=1))
    systems = [item.system for item in stream]
    assert {"A", "B", ""} == set(systems) and systems.count("") < 15
    for item in stream:
        if item.system:
            prompt = tokens(w20.SYSTEM_PROMPTS[item.system])
            assert list(item.ids[:len(prompt)]) == prompt
        assert item.lifetime in (1, 2) and item.ids[0] == 0


# ---------------------------------------------------------------------------------------------
# Exercise 1: how many tokens can a request reuse?
# ---------------------------------------------------------------------------------------------

def test_exercise1_expected_matches_a_real_prefix_cache():
    config = kvlib.ModelConfig(vocab_size=50, context_length=80)
    params = kvlib.init_params(config, seed=1)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 50, ex20.SYSTEM_TOKENS).tolist()
    first = system + rng.integers(1, 50, ex20.FIRST_QUESTION).tolist()
    second = system + rng.integers(1, 50, ex20.SECOND_QUESTION).tolist()
    assert second[ex20.SYSTEM_TOKENS] != first[ex20.SYSTEM_TOKENS]
    got = []
    for size in ex20.BLOCK_SIZES:
        server = PrefixServer(params, n_blocks=40, block_size=size)
        server.finish(server.admit(first).request)
        got.append(len(server.prefix_cache.reusable(second)) * size)
    server = PrefixServer(params, n_blocks=40, block_size=16)
    server.finish(server.admit(first).request)
    got.append(server.admit(first).reused_tokens)
    assert tuple(got) == ex20.exercise1_expected() == (32, 40, 0, 48)


@pytest.mark.parametrize("answer, words", [
    ((45, 45, 45, 48), "only full blocks are"),
    ((48, 40, 0, 48), "that rounds up"),
    ((32, 48, 0, 48), "that rounds up"),
    ((32, 40, 64, 48), "that rounds up"),
    ((32, 40, 45, 48), "only full blocks are"),
    ((32, 40, 0, 64), "never reuses its last token"),
    ((32, 40, 0, 63), "reuse comes in full blocks"),
    ((32, 40, 0, 32), "request 1 again"),
    ((40, 32, 0, 48), "another order"),
    ((75, 40, 0, 48), "shares only its first 45 tokens"),
    ((30, 40, 0, 48), "not a multiple"),
    ((16, 40, 0, 48), "Count the full blocks"),
    ((32, 40, 0), "should have 4 numbers"),
    (32, "tuple of 4 whole numbers"),
    ((32.5, 40, 0, 48), "fractional part"),
    ((32, 40, 0, "48"), "not text"),
    ("32, 40, 0, 48", "tuple of 4 whole numbers"),
    ((32, 40, 0, 10**5000), "about 5,001 digits"),
    (..., "not filled in"),
], ids=case_id)
def test_exercise1_wrong_answers_get_their_diagnosis(answer, words):
    assert_not_yet(ex20.check_reusable_tokens(answer), words)


@pytest.mark.parametrize("answer", [
    (32, 40, 0, 48), [32, 40, 0, 48], np.array([32, 40, 0, 48]), (32.0, 40.0, 0.0, 48.0),
    (np.int64(32), 40, 0, 48), (45 // 16 * 16, 45 // 8 * 8, 45 // 64 * 64, 63 // 16 * 16),
])
def test_exercise1_valid_answers_in_other_forms(answer):
    assert_correct(ex20.check_reusable_tokens(answer))


# ---------------------------------------------------------------------------------------------
# Exercise 2: the key without its parent
# ---------------------------------------------------------------------------------------------

def test_exercise2_the_broken_key_shows_wrong_logits(toy):
    stream = ex20.stream_ids(ex20.SHUFFLED_EXAMPLES)
    results = ex20.serve_with_block_key(lambda parent, t: tuple(t), stream, toy)
    errors = [np.abs(logits - kvlib.forward(toy, ids)[-1]).max()
              for (_, logits), ids in zip(results, stream)]
    assert [reused for reused, _ in results] == [0, 12, 12]
    assert errors[0] < TOLERANCE and errors[1] > 0.1 and errors[2] < TOLERANCE
    right = ex20.serve_with_block_key(ex20.right_block_key, stream, toy)
    assert [reused for reused, _ in right] == [0, 4, 12]
    for (_, logits), ids in zip(right, stream):
        np.testing.assert_allclose(logits, kvlib.forward(toy, ids)[-1], atol=TOLERANCE)


def raises(parent, tokens):
    raise KeyError("parent")


class Unhashable(tuple):
    __hash__ = None


class BadEquality:
    def __hash__(self):
        return 1

    def __eq__(self, other):
        raise RuntimeError("no comparing")


def make_counter():
    count = iter(range(10**6))
    return lambda parent, tokens: next(count)


@pytest.mark.parametrize("block_key_function, words", [
    (lambda parent, tokens: tuple(tokens), "without its parent"),
    (lambda parent, tokens: tokens, "without its parent"),
    (lambda parent, tokens: (len(parent), tuple(tokens)), "without its parent"),
    (lambda parent, tokens: ((parent[0] + 1) if parent else 0, tuple(tokens)),
     "tells positions apart but not what came before"),
    (lambda parent, tokens: parent, "does your key use the block's tokens"),
    (lambda parent, tokens: 7, "does your key use the block's tokens"),
    (lambda parent, tokens: None, "is a `return` missing"),
    (lambda parent, tokens: list(tokens), "must be hashable"),
    (lambda parent, tokens: np.array(tokens), "must be hashable"),
    (lambda parent, tokens: Unhashable(tokens), "must be hashable"),
    (lambda parent, tokens: (parent, [1]), "must be hashable"),
    (raises, "raised KeyError"),
    (lambda tokens: tokens, "raised TypeError"),
    (lambda parent, tokens: BadEquality(), "raised RuntimeError"),
    (lambda parent, tokens: object(), "Equal prefixes must get equal keys"),
    (lambda parent, tokens: np.random.default_rng().random(), "random"),
    (lambda parent, tokens: (parent, tuple(sorted(tokens))), "same tokens in another order"),
    (lambda parent, tokens: (parent, frozenset(tokens)), "not sorted or a set"),
    (lambda parent, tokens: (parent, tuple(sorted(set(tokens)))), "tuple(tokens)"),
    (lambda parent, tokens: (parent, sum(tokens)), "same key"),
])
def test_exercise2_wrong_keys_get_their_diagnosis(block_key_function, words):
    assert_not_yet(ex20.check_block_key(block_key_function), words)


def test_exercise2_a_counter_key_is_caught():
    assert_not_yet(ex20.check_block_key(make_counter()), "a counter")


def test_exercise2_the_reordered_stream_catches_keys_that_lose_the_order(toy):
    """Block 2 of the third stream's second request holds block 2 of the first in another
    order: a key of the sorted tokens (or their set) reuses it, and the logits are wrong."""
    stream = ex20.stream_ids(ex20.REORDERED_EXAMPLES)
    assert sorted(stream[0][4:8]) == sorted(stream[1][4:8]) and stream[0][4:8] != stream[1][4:8]
    assert set(stream[2][4:8]) == set(stream[3][4:8])
    assert sorted(stream[2][4:8]) != sorted(stream[3][4:8])
    results = ex20.serve_with_block_key(lambda parent, t: (parent, tuple(sorted(t))), stream,
                                        toy)
    error = np.abs(results[1][1] - kvlib.forward(toy, stream[1])[-1]).max()
    assert results[1][0] == 8 and error > 0.1
    for (_, logits), ids in zip(ex20.serve_with_block_key(ex20.right_block_key, stream, toy),
                                stream):
        np.testing.assert_allclose(logits, kvlib.forward(toy, ids)[-1], atol=TOLERANCE)


def test_exercise2_wrong_logits_are_shown_in_the_message():
    feedback = ex20.check_block_key(lambda parent, tokens: tuple(tokens))
    assert re.search(r"Request 2 .* reused 12 tokens, and its logits differ from a full "
                     r"recomputation by up to 0\.\d+", feedback.message), feedback.message


@pytest.mark.parametrize("answer, words", [
    (..., "not filled in"), (None, "not filled in"), ("block_key_fixed", "should be a function"),
    ((1, 2), "should be a function"),
])
def test_exercise2_not_a_function(answer, words):
    assert_not_yet(ex20.check_block_key(answer), words)


@pytest.mark.parametrize("block_key_function", [
    lambda parent, tokens: (parent, tuple(tokens)),
    lambda parent, tokens: (parent, tokens),
    lambda parent, tokens: parent + tuple(tokens),
    lambda parent, tokens: hash((parent, tuple(tokens))),
    lambda parent, tokens: str((parent, list(tokens))),
    lambda parent, tokens: kvlib.serving.block_key(parent or ROOT_KEY, tokens),
    lambda parent, tokens: (tuple(tokens), parent),
])
def test_exercise2_valid_keys_in_other_forms(block_key_function):
    assert_correct(ex20.check_block_key(block_key_function))


# ---------------------------------------------------------------------------------------------
# Exercise 3: which blocks go?
# ---------------------------------------------------------------------------------------------

def test_exercise3_scenario_is_what_the_notebook_says():
    server = ex20.lru_scenario()
    assert server.pool.n_free == 3 and ex20.lru_to_evict(server) == 4
    assert list(server.running) == [2]
    held = {e.block for e in server.prefix_cache.entries if server.prefix_cache.is_held(e)}
    assert held == {4, 5, 8}            # the two it reused and its own, cached when it filled
    # what admitting a request of 7 new blocks really evicts
    evicted = server.prefix_cache.make_room(ex20.LRU_NEEDED)
    assert [e.block for e in evicted] == ex20.lru_expected()


@pytest.mark.parametrize("answer, words", [
    # the leaves of the start, least recently used first: block 1 joins when block 9 goes.
    # Every leaf has 0 hits, so this is no "fewest hits first" (LFU) order, though block 10
    # has fewer hits than block 1: the message says both, and names no rule it did not follow
    ([2, 6, 9, 10], "block 1 (it became a candidate when its last cached child went) was last "
                    "used at tick 7, before block 10 (tick 9)"),
    ([2, 6, 9, 10], "Block 10 has fewer hits, 0 against 1, but the rule counts when"),
    ([2, 6, 0, 1], "block 0 still has a cached child"),
    ([2, 6, 1, 9], "block 1 still has a cached child (block 9)"),
    ([2, 6, 5, 4], "block 5 is held by request 2"),
    ([4, 2, 6, 9], "block 4 is held"),
    ([10, 9, 6, 2], "block 2 was last used at tick 2, before block 10"),
    ([6, 2, 9, 1], "the right blocks, in another order"),
    ([2, 9, 6, 1], "block 6 was last used at tick 4, before block 9"),
    ([2, 6, 9, 3], "block 3 holds no cached prefix"),
    ([2, 2, 6, 9], "evicted once"),
    ([2, 6, 9], "should have 4 numbers"),
    ({2, 6, 9, 1}, "a set has no order"),
    ("2 6 9 1", "tuple of 4 whole numbers"),
    ([2, 6, 9, 1.25], "close (0.25 from the answer)"),
    ([2, 6, 9, 10**40], "41 digits: far too large"),
    ([2, 6, 9, 10**5000], "about 5,001 digits: far too large"),
    ([2, 6, 9, np.float64(1.5)], "1.5"),
    (..., "not filled in"),
    (None, "4 whole numbers, such as (2, 3, 4, 5)"),
], ids=case_id)
def test_exercise3_wrong_answers_get_their_diagnosis(answer, words):
    assert_not_yet(ex20.check_eviction_order(answer), words)


@pytest.mark.parametrize("answer", [[2, 6, 9, 10], [10, 9, 6, 2], [2, 6, 9, 1.25], [6, 2, 9, 1]],
                         ids=case_id)
def test_exercise3_names_no_rule_the_answer_did_not_follow(answer):
    # every leaf of the table has 0 hits: no answer is told it evicts by the fewest hits
    message = ex20.check_eviction_order(answer).message
    assert "LFU" not in message and "fewest hits first" not in message


@pytest.mark.parametrize("answer", [
    [2, 6, 9, 1], (2, 6, 9, 1), np.array([2, 6, 9, 1]), [2.0, 6.0, 9.0, 1.0],
    [np.int64(2), 6, 9, 1],
])
def test_exercise3_valid_answers_in_other_forms(answer):
    assert_correct(ex20.check_eviction_order(answer))


# ---------------------------------------------------------------------------------------------
# Solutions and the fuzz
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("number, checker", [(1, ex20.check_reusable_tokens),
                                             (2, ex20.check_block_key),
                                             (3, ex20.check_eviction_order)])
def test_solutions_pass(number, checker):
    scope = {"exercises": ex20, "kvlib": kvlib, "np": np}
    exec(ex20.SOLUTIONS[number], scope)
    assert_correct(checker(scope["answer"]))


def test_solution_display():
    shown = ex20.solution(2)
    assert "Solution to exercise 2" in shown.data and "block_key_fixed" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        ex20.solution(9)


# ---------------------------------------------------------------------------------------------
# A fuzz of the prefix-caching API: odd input gets a clear error and changes nothing
# ---------------------------------------------------------------------------------------------

FUZZ_MODEL = w20.example_model()


def server_state(server):
    return (server.pool.ref_counts.tolist(), len(server.prefix_cache),
            sorted(server.running), server.prefix_cache.clock,
            {r: list(run.all_token_ids) for r, run in server.running.items()})


@given(value=st.one_of(student_answers, st.integers(-3, 70)))
@settings(max_examples=120, deadline=None)
def test_the_prefix_api_answers_odd_input_with_clear_errors(value):
    server = PrefixServer(FUZZ_MODEL, n_blocks=12, block_size=4)
    server.finish(server.admit(tokens("I am good . How are you ?")).request)
    running = server.admit(tokens("I am good . thanks"))
    calls = {
        "admit": lambda: server.admit(value),
        "decode request": lambda: server.decode(value, 1),
        "decode token": lambda: server.decode(running.request, value),
        "finish": lambda: server.finish(value),
        "match": lambda: server.prefix_cache.match(value),
        "reusable": lambda: server.prefix_cache.reusable(value),
        "block_keys": lambda: block_keys(value, 4),
        "block size": lambda: block_keys([1, 2, 3], value),
    }
    for name, call in calls.items():
        before = server_state(server)
        try:
            call()
        except (ValueError, TypeError, MemoryError) as error:
            assert str(error), name
            assert server_state(server) == before, name
        check_accounting(server)
