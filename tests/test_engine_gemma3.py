"""The engine serving Gemma 3 (kvlib.serving.gemma3_engine) with block accounting per KV cache
group (kvlib.serving.kv_cache_manager): every request's tokens equal to decoding it alone with
kvlib.gemma3.generate, on random tiny Gemma 3 configs in float64 (windows shorter than the
prompts, several requests, chunked prefill, prefix hits, preemption, hybrid accounting on and
off) and on the real Gemma 3 270M; the accounting's rules as vLLM V1 states them; errors in
words; a failing step changes nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import gemma3
from kvlib.checkpoints import gemma3 as checkpoint
from kvlib.checkpoints.gemma3 import GEMMA3_270M, Gemma3Config
from kvlib.serving import SamplingParams, gemma3_engine, workloads
from kvlib.serving.gemma3_engine import Gemma3Engine, pool_peak
from kvlib.serving.kv_cache_manager import (
    FULL,
    NULL_BLOCK,
    SLIDING,
    block_bytes,
    blocks_for_hit,
    blocks_held,
    freeable_blocks,
    group_key,
    kv_cache_groups,
    skipped_tokens,
)

S, F = SLIDING, FULL


def tiny_config(layer_types=(S, F, S, S), window=3, dtype="float64") -> Gemma3Config:
    return Gemma3Config(vocab_size=20, hidden_size=8, intermediate_size=6,
                        num_hidden_layers=len(layer_types), num_attention_heads=2,
                        num_key_value_heads=1, head_dim=4, layer_types=tuple(layer_types),
                        sliding_window=window, query_pre_attn_scalar=9.0,
                        max_position_embeddings=200, dtype=dtype)


@pytest.fixture(scope="module")
def tiny():
    return gemma3.init_gemma3_params(tiny_config(), 3)


def alone(params, prompts, max_tokens):
    return [gemma3.generate(params, prompt, max_tokens) for prompt in prompts]


def run_checked(engine, prompts, sampling):
    """generate, step by step, checking the pool after every step."""
    ids = [engine.add_request(prompt, sampling) for prompt in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    return [engine.output_of(i) for i in ids]


# --------------------------------------------------------------------------- the rules

def test_skipped_tokens_are_vllms_example_and_a_global_layer_skips_none():
    # vLLM's get_num_skipped_tokens docstring: sliding_window=4, num_computed_tokens=7 -> 4
    assert skipped_tokens(7, 4) == 4
    assert [skipped_tokens(n, 4) for n in range(6)] == [0, 0, 0, 0, 1, 2]
    assert skipped_tokens(10_000, None) == 0


def test_freeable_blocks_are_the_blocks_made_only_of_skipped_positions():
    assert list(freeable_blocks(7, 4, 2)) == [0, 1]          # positions 0-3 skipped
    assert list(freeable_blocks(6, 4, 2)) == [0]     # 0-2 skipped: block 1 holds 3, still read
    assert list(freeable_blocks(600, 512, 16)) == [0, 1, 2, 3, 4]
    assert list(freeable_blocks(600, None, 16)) == []


def test_a_prefix_hit_needs_the_last_window_for_a_sliding_layer_and_everything_for_a_global():
    # vLLM's example: block size 4, window 8 -> [NULL, NULL, block, block] at 16 tokens
    assert list(blocks_for_hit(16, 8, 4)) == [2, 3]
    assert list(blocks_for_hit(16, None, 4)) == [0, 1, 2, 3]
    assert len(blocks_for_hit(1024, 512, 16)) == -(-(512 - 1) // 16)
    with pytest.raises(ValueError, match="whole blocks"):
        blocks_for_hit(10, 8, 4)


def test_gemma3_270m_is_cut_into_six_groups_of_three_layers_as_vllm_cuts_it():
    groups = kv_cache_groups(GEMMA3_270M)
    assert [group.attention for group in groups] == [F] + [S] * 5
    assert groups[0].layers == (5, 11, 17)
    assert sorted(layer for group in groups for layer in group.layers) == list(range(18))
    assert all(len(group.layers) == 3 for group in groups)
    # a block: 16 positions of K and V for 3 layers, one K/V head of 256, float32
    assert block_bytes(GEMMA3_270M, 16, groups) == 2 * 3 * 16 * 256 * 4
    everything = kv_cache_groups(GEMMA3_270M, hybrid=False)
    assert len(everything) == 1 and everything[0].layers == tuple(range(18))
    assert block_bytes(GEMMA3_270M, 16, everything) == 6 * block_bytes(GEMMA3_270M, 16, groups)
    # at 32,768 tokens the full group holds 2,048 blocks, each sliding group the 32 blocks
    # that hold the 511 positions the next query still reads (positions 32,257 ..)
    assert blocks_held(groups, 32_768, 16) == 2048 + 5 * 32
    assert blocks_held(everything, 32_768, 16) * 18 == 18 * 2048


def test_a_type_with_layers_left_over_gets_a_padded_group():
    groups = kv_cache_groups(tiny_config((S, S, F, F, S)))
    assert [(g.attention, g.layers) for g in groups] == [(F, (2, 3)), (S, (0, 1)), (S, (4,))]


# --------------------------------------------------------------------------- the engine

def test_sliding_blocks_leave_the_table_as_the_window_passes(tiny):
    engine = Gemma3Engine(tiny, block_size=2, n_blocks=60, max_num_batched_tokens=4)
    rid = engine.add_request(list(range(1, 15)), SamplingParams(max_tokens=6))
    nulls = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
        request = engine.requests[rid]
        if request.block_tables:          # running: freed before the step, at its start
            n = request.num_computed_tokens - engine.last_step.scheduled_tokens[rid]
            held = sum(block != NULL_BLOCK for t in request.block_tables for block in t)
            assert engine.pool.n_used == held
            for group, table in zip(engine.groups, request.block_tables):
                assert table.count(NULL_BLOCK) == len(freeable_blocks(
                    n, group.sliding_window, 2))
            nulls += sum(t.count(NULL_BLOCK) for t in request.block_tables)
    assert nulls > 0
    assert engine.output_of(rid) == gemma3.generate(tiny, list(range(1, 15)), 6)
    # a global engine keeps every block to the end: more of the pool for the same tokens
    everything = Gemma3Engine(tiny, block_size=2, n_blocks=60, max_num_batched_tokens=4,
                              disable_hybrid_kv_cache_manager=True)
    assert everything.generate([list(range(1, 15))], SamplingParams(max_tokens=6)) == \
        [engine.output_of(rid)]
    layer_blocks = lambda e: e.peak_blocks * max(len(g.layers) for g in e.groups)  # noqa: E731
    assert layer_blocks(engine) < layer_blocks(everything)


def test_a_sliding_group_hits_with_only_the_last_windows_blocks_cached():
    params = gemma3.init_gemma3_params(tiny_config(window=5), 4)
    prompt = list(range(1, 17))
    hits = {}
    for hybrid in (True, False):
        engine = Gemma3Engine(params, block_size=2, n_blocks=80,
                              disable_hybrid_kv_cache_manager=not hybrid)
        engine.generate([prompt], SamplingParams(max_tokens=2))
        # forget (evict) the first block of every group but the full-attention one
        for g, group in enumerate(engine.groups):
            if group.attention == S or not hybrid:
                key = group_key(engine.scheduler._block_hashes(
                    engine.requests[0], 1)[0], g)
                engine.pool.uncache(engine.pool.cached[key])
        rid = engine.add_request(prompt + [3, 4], SamplingParams(max_tokens=3))
        engine.step()
        hits[hybrid] = engine.stats["prefix_hit_tokens"]
        if hybrid:          # the sliding tables: null blocks, then the last window's blocks
            needed = list(blocks_for_hit(16, 5, 2))
            assert needed == [6, 7]
            for group, table in zip(engine.groups, engine.requests[rid].block_tables):
                nulls = needed[0] if group.attention == S else 0
                assert table[:8].count(NULL_BLOCK) == nulls == table[:nulls].count(NULL_BLOCK)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.output_of(rid) == gemma3.generate(params, prompt + [3, 4], 3)
    assert hits == {True: 16, False: 0}


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_every_request_gets_the_tokens_of_decoding_it_alone(data):
    """Random tiny Gemma 3 configs in float64, windows shorter than the prompts, several
    requests sharing prefixes, small budgets (chunked prefill), small pools (preemption,
    eviction), hybrid accounting on and off, caching when scheduled or after the step."""
    n_layers = data.draw(st.integers(1, 4))
    config = Gemma3Config(
        vocab_size=data.draw(st.integers(5, 30)), hidden_size=data.draw(st.sampled_from([4, 8])),
        intermediate_size=data.draw(st.integers(2, 8)), num_hidden_layers=n_layers,
        num_attention_heads=2, num_key_value_heads=data.draw(st.sampled_from([1, 2])),
        head_dim=data.draw(st.sampled_from([2, 4])),
        layer_types=tuple(data.draw(st.lists(st.sampled_from([S, F]), min_size=n_layers - 1,
                                             max_size=n_layers - 1)) + [S]),  # one slides
        sliding_window=data.draw(st.integers(1, 5)),
        query_pre_attn_scalar=data.draw(st.sampled_from([4.0, 9.0])),
        max_position_embeddings=64, dtype="float64")
    params = gemma3.init_gemma3_params(config, data.draw(st.integers(0, 2**16)))
    token = st.integers(0, config.vocab_size - 1)
    base = data.draw(st.lists(token, min_size=4, max_size=16))
    prompts = [base[:data.draw(st.integers(1, len(base)))] +
               data.draw(st.lists(token, max_size=6)) for _ in range(data.draw(
                   st.integers(1, 4)))]
    max_tokens = data.draw(st.integers(1, 6))
    block_size = data.draw(st.integers(1, 4))
    options = dict(block_size=block_size,
                   max_num_batched_tokens=data.draw(st.integers(1, 12)),
                   max_num_seqs=data.draw(st.integers(1, 4)),
                   cache_when_scheduled=data.draw(st.booleans()),
                   enable_prefix_caching=data.draw(st.sampled_from([True, True, False])),
                   disable_hybrid_kv_cache_manager=data.draw(st.booleans()))
    # a pool from just enough for the longest request alone (preemption) to plenty
    need = Gemma3Engine(params, n_blocks=10**4, **options)._most_blocks(
        max(len(prompt) for prompt in prompts) + max_tokens - 1)
    engine = Gemma3Engine(params, n_blocks=need + data.draw(st.integers(0, need // 2)),
                          **options)
    assert run_checked(engine, prompts, SamplingParams(max_tokens=max_tokens)) == \
        alone(params, prompts, max_tokens)
    assert engine.peak_blocks <= engine.pool.n_blocks


def test_preemption_and_prefix_hits_happen_and_tokens_stay_equal(tiny):
    prompts = [list(range(1, 13)), list(range(1, 11)) + [5, 5, 5], [7] * 9, list(range(1, 9))]
    engine = Gemma3Engine(tiny, block_size=2, n_blocks=36, max_num_batched_tokens=6)
    assert run_checked(engine, prompts, SamplingParams(max_tokens=8)) == \
        alone(tiny, prompts, 8)
    assert engine.stats["preemptions"] > 0 and engine.stats["prefix_hit_tokens"] > 0


def test_pool_peak_counts_what_the_engine_holds_and_hybrid_needs_fewer_bytes(tiny):
    requests = [(0, list(range(1, 15)), SamplingParams(max_tokens=5)),
                (1, list(range(2, 12)), SamplingParams(max_tokens=7)),
                (2, [4] * 20, SamplingParams(max_tokens=3))]
    peaks = {}
    for hybrid in (True, False):
        engine = Gemma3Engine(tiny, block_size=2, n_blocks=200, max_num_batched_tokens=8,
                              disable_hybrid_kv_cache_manager=not hybrid)
        ids = []
        while len(ids) < len(requests) or engine.has_unfinished_requests():
            while len(ids) < len(requests) and requests[len(ids)][0] <= engine.step_count:
                ids.append(engine.add_request(*requests[len(ids)][1:]))
            engine.step()
        peaks[hybrid] = pool_peak(tiny.config, requests, 2, not hybrid, 8)
        assert peaks[hybrid]["peak_blocks"] == engine.peak_blocks
        assert peaks[hybrid]["block_bytes"] == engine.block_bytes
    assert peaks[True]["peak_bytes"] < peaks[False]["peak_bytes"]


def test_one_long_reply_alone_peaks_at_its_last_step_as_the_rules_say():
    """Gemma 3 270M's accounting (no weights needed): a 37-token prompt and 1,200 new
    tokens, blocks of 16. At its last step the table covers 1,236 positions (78 blocks) in
    every group; a sliding group has freed the blocks of the 724 positions the last query
    no longer reads (45 blocks)."""
    requests = [(0, [5] * 37, SamplingParams(max_tokens=1200))]
    hybrid = pool_peak(GEMMA3_270M, requests, 16)
    everything = pool_peak(GEMMA3_270M, requests, 16, disable_hybrid_kv_cache_manager=True)
    assert hybrid["peak_blocks"] == 78 + 5 * (78 - (1235 - 511) // 16)
    assert everything["peak_blocks"] == 78
    assert hybrid["peak_bytes"] / everything["peak_bytes"] == (78 + 5 * 33) / (6 * 78)


def test_in_the_same_memory_hybrid_accounting_serves_without_preempting():
    """One fixed memory for K and V: with hybrid accounting the long replies fit (no
    preemption); counted as global they do not (preemptions), and both give the tokens of
    decoding each request alone."""
    params = gemma3.init_gemma3_params(tiny_config(window=4), 7)
    prompts = [list(range(1, 9)), list(range(3, 12)), [5, 6, 7, 8] * 2]
    sampling = SamplingParams(max_tokens=30)
    memory = 3 * 40 * 2 * 2 * 4 * 8    # 40 positions of 3 requests, K and V, 2 layers of 4
    preemptions = {}
    for disable in (False, True):
        n_blocks = gemma3_engine.blocks_in_memory(params.config, memory, 2, disable)
        assert n_blocks == memory // (2 * (4 if disable else 1) * 2 * 4 * 8)
        engine = Gemma3Engine(params, block_size=2, n_blocks=n_blocks,
                              max_num_batched_tokens=16,
                              disable_hybrid_kv_cache_manager=disable)
        assert run_checked(engine, prompts, sampling) == alone(params, prompts, 30)
        assert engine.peak_blocks * engine.block_bytes <= memory
        preemptions[disable] = engine.stats["preemptions"]
    assert preemptions[False] == 0 < preemptions[True]


# --------------------------------------------------------------------------- errors

def test_bad_input_is_refused_in_words(tiny):
    with pytest.raises(TypeError, match="Gemma3Params"):
        Gemma3Engine("not a model")
    with pytest.raises(TypeError, match="disable_hybrid_kv_cache_manager"):
        Gemma3Engine(tiny, disable_hybrid_kv_cache_manager="yes")
    engine = Gemma3Engine(tiny, block_size=2, n_blocks=6)
    with pytest.raises(ValueError, match="between 0 and 19"):
        engine.add_request([1, 25])
    with pytest.raises(ValueError, match="could never finish"):
        engine.add_request(list(range(1, 19)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 190, SamplingParams(max_tokens=20))
    with pytest.raises(TypeError, match="Gemma3Config"):
        pool_peak("config", [])
    with pytest.raises(TypeError, match="arrival step, prompt ids, SamplingParams"):
        pool_peak(tiny.config, [[1, 2, 3]])
    with pytest.raises(ValueError, match="between 0 and 19"):
        pool_peak(tiny.config, [(0, [99], SamplingParams())])
    with pytest.raises(TypeError, match="KVCacheGroup"):
        blocks_held("groups", 10, 2)
    with pytest.raises(TypeError, match="Gemma3Config"):
        block_bytes(None, 16, kv_cache_groups(tiny.config))
    with pytest.raises(ValueError, match="sliding_window"):
        freeable_blocks(10, 0, 2)
    assert not engine.requests and not engine.waiting


def kept_rows(engine) -> np.ndarray:
    """The K and V the engine keeps: every computed position of every running request in
    each group's block (null blocks left out), and every cached idle block."""
    rows, size = [], engine.block_size
    for request in engine.running:
        for table in request.block_tables:
            for p in range(request.num_computed_tokens):
                if table[p // size] != NULL_BLOCK:
                    rows.append(engine.kv.keys[:, table[p // size], p % size])
                    rows.append(engine.kv.values[:, table[p // size], p % size])
    for block in engine.pool.idle:
        rows += [engine.kv.keys[:, block].reshape(-1, engine.kv.keys.shape[-1]),
                 engine.kv.values[:, block].reshape(-1, engine.kv.keys.shape[-1])]
    width = engine.kv.keys.shape[-1]
    return np.concatenate([np.empty((0, width))] + [np.reshape(row, (-1, width))
                                                    for row in rows])


def test_a_failing_step_changes_nothing(tiny, monkeypatch):
    prompts = [list(range(1, 13)), list(range(1, 11)) + [5, 5], [7] * 9]
    engine = Gemma3Engine(tiny, block_size=2, n_blocks=30, max_num_batched_tokens=6)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
    real_step = gemma3_engine.gemma3_forward_step
    for _ in range(12):
        before = ([r.snapshot() for r in engine.requests.values()], engine.pool.checkpoint(),
                  kept_rows(engine), list(engine.running), list(engine.waiting),
                  engine.peak_blocks, dict(engine.stats), engine.step_count)

        def failing(params, kv, block_size, batch):
            real_step(params, kv, block_size, batch)          # writes K and V, then fails
            raise RuntimeError("the model step failed")
        monkeypatch.setattr(gemma3_engine, "gemma3_forward_step", failing)
        with pytest.raises(RuntimeError):
            engine.step()
        after = ([r.snapshot() for r in engine.requests.values()], engine.pool.checkpoint(),
                 kept_rows(engine), list(engine.running), list(engine.waiting),
                 engine.peak_blocks, dict(engine.stats), engine.step_count)
        for old, new in zip(before[0], after[0]):
            assert {k: v for k, v in old.items() if k != "rng"} == \
                {k: v for k, v in new.items() if k != "rng"}
        assert all(np.array_equal(a, b) for a, b in zip(before[1][:2], after[1][:2]))
        assert list(before[1][2]) == list(after[1][2]) and before[1][3:] == after[1][3:]
        assert np.array_equal(before[2], after[2])
        assert before[3:] == after[3:]
        monkeypatch.setattr(gemma3_engine, "gemma3_forward_step", real_step)
        engine.step()
        engine.check()
    while engine.has_unfinished_requests():
        engine.step()
    assert [engine.output_of(i) for i in ids] == alone(tiny, prompts, 6)


# --------------------------------------------------------------------------- the real model

needs_file = pytest.mark.skipif(checkpoint.find_gguf() is None,
                                reason="Gemma 3 270M's GGUF file is not fetched (`make gemma3`)")


@pytest.fixture(scope="module")
def real():
    return checkpoint.load_gemma3(), checkpoint.gemma3_tokenizer()


@needs_file
def test_the_real_gemma3_serves_short_requests_as_generate_alone(real):
    params, tokenizer = real
    texts = ["Question: What is the capital of France?\nAnswer:",
             "Question: What is the capital of Japan?\nAnswer:",
             "The three primary colours are"]
    prompts = [tokenizer.encode(text) for text in texts]
    engine = Gemma3Engine(params, block_size=4, n_blocks=120, max_num_batched_tokens=32,
                          cache_when_scheduled=True)
    out = run_checked(engine, prompts, SamplingParams(max_tokens=4))
    assert out == alone(params, prompts, 4)
    assert engine.stats["prefix_hit_tokens"] > 0        # the two questions share "Question: ..."


@needs_file
def test_the_real_gemma3_past_its_window_frees_sliding_blocks_and_keeps_its_tokens(real):
    """556 prompt tokens (past the 512 window), prefilled in chunks of 256: by the last
    step each of the 5 sliding groups has freed the 2 blocks of 16 that hold only positions
    no query reads again."""
    params, tokenizer = real
    prompt = tokenizer.encode(" ".join([workloads.PASSAGE] * 5))
    assert len(prompt) > GEMMA3_270M.sliding_window
    engine = Gemma3Engine(params, block_size=16, n_blocks=300, max_num_batched_tokens=256)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
    nulls = []
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.requests[rid].block_tables
        nulls.append(sum(table.count(NULL_BLOCK) for table in tables))
    assert engine.output_of(rid) == gemma3.generate(params, prompt, 3)
    last_step_computed = len(prompt) + 1
    assert max(nulls) == 5 * len(freeable_blocks(last_step_computed, 512, 16)) == 10
