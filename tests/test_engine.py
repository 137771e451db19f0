"""kvlib.serving.Engine and block attention (notebook 24), by property tests over random
workloads (aborts, n > 1 completions, caller ids and both caching timings among them): every
request's tokens equal decoding it alone, the pool stays consistent after every step, no block
leaks, a step never exceeds its token budget, prefix blocks are reused while their first
request still runs, preemption changes no output, a failed step changes nothing, and an
interrupted generate leaves nothing running."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies import configs

import kvlib
from kvlib.serving import Engine, SamplingParams
from kvlib.serving import engine as engine_module
from kvlib.serving.block_attention import (
    attention_bytes,
    batched_block_attention,
    batched_gather_attention,
    block_attention,
    gather_attention,
)
from kvlib.serving.block_pool import BlockPool

PROPERTY = settings(max_examples=40, deadline=None)
STORIES = Path(kvlib.__file__).parent / "models" / "stories"


# --------------------------------------------------------------------------- block attention

@PROPERTY
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(1, 6),
       st.integers(0, 30), st.integers(1, 6), st.integers(0, 10_000))
def test_block_attention_equals_gathering_then_attending(kv_heads, group, head_dim, block_size,
                                                         n_cached, T, seed):
    rng = np.random.default_rng(seed)
    width = kv_heads * head_dim
    n_blocks = -(-n_cached // block_size) + 3
    keys = rng.standard_normal((n_blocks, block_size, width))
    values = rng.standard_normal((n_blocks, block_size, width))
    table = list(rng.permutation(n_blocks)[:-(-n_cached // block_size)]) if n_cached else []
    Q = rng.standard_normal((kv_heads * group, T, head_dim)) * 3   # sharp softmaxes too
    positions = n_cached + np.arange(T)
    new_keys, new_values = rng.standard_normal((2, T, width))
    got = block_attention(Q, positions, keys, values, table, n_cached, new_keys, new_values)
    want = gather_attention(Q, positions, keys, values, table, n_cached, new_keys, new_values)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@PROPERTY
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(1, 6),
       st.lists(st.integers(0, 30), min_size=1, max_size=4), st.integers(1, 5),
       st.integers(0, 10_000))
def test_batched_block_attention_equals_gathering_each_sequence(kv_heads, group, head_dim,
                                                               block_size, lengths, T, seed):
    """All sequences at once, the pool holding each query's own row too (the engine writes
    before it attends): both batched forms equal gather_attention sequence by sequence."""
    rng = np.random.default_rng(seed)
    width = kv_heads * head_dim
    n = max(-(-(length + T) // block_size) for length in lengths)
    n_blocks = n * len(lengths) + 2
    keys, values = rng.standard_normal((2, n_blocks, block_size, width))
    order = rng.permutation(n_blocks)
    tables = np.array([order[row * n:(row + 1) * n] for row in range(len(lengths))])
    Q = rng.standard_normal((len(lengths), kv_heads * group, T, head_dim)) * 3
    positions = np.array([length + np.arange(T) for length in lengths])
    want = []
    for row, length in enumerate(lengths):
        new = positions[row]
        rows = tables[row][new // block_size], new % block_size
        want.append(gather_attention(Q[row], new, keys, values, list(tables[row]), length,
                                     keys[rows], values[rows]))
    for batched in (batched_block_attention, batched_gather_attention):
        np.testing.assert_allclose(batched(Q, positions, keys, values, tables), np.stack(want),
                                   rtol=0, atol=1e-12)


def plain_causal_attention(Q, K, V, positions):
    """The reference, written out in float64 with nothing of kvlib: Q (h, T, dh) at
    `positions`, K and V (P, kv, dh) contiguous, position p of the sequence in row p; query
    head j reads K/V head j // (h / kv) at positions 0 .. its own, softmax over them."""
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    h, T, dh = Q.shape
    group = h // K.shape[1]
    out = np.zeros((h, T, dh))
    for head in range(h):
        for t in range(T):
            seen = positions[t] + 1
            scores = K[:seen, head // group] @ Q[head, t] / np.sqrt(dh)
            weights = np.exp(scores - scores.max())
            out[head, t] = weights @ V[:seen, head // group] / weights.sum()
    return out


@PROPERTY
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.integers(1, 5),
       st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(1, 4),
       st.sampled_from(["float64", "float32"]), st.booleans(), st.integers(0, 10_000))
def test_batched_attention_equals_plain_causal_attention_over_contiguous_rows(
        kv_heads, group, head_dim, block_size, lengths, T, dtype, contiguous_queries, seed):
    """Both batched forms against a float64 softmax over each sequence's own contiguous K and
    V: grouped-query heads (group queries a K/V head), sequences of different lengths in one
    call, their block tables padded to the longest with any block (another sequence's, a
    repeated one, block 0), blocks scattered over the pool, and queries either the last T
    positions or any T positions of the sequence (a prefill chunk, or decodes)."""
    rng = np.random.default_rng(seed)
    width, h = kv_heads * head_dim, kv_heads * group
    lengths = [max(length, T) for length in lengths]
    used = [-(-length // block_size) for length in lengths]
    n = max(used) + rng.integers(0, 2)                       # sometimes one block to spare
    n_blocks = sum(used) + 2
    order = rng.permutation(n_blocks)
    owned = np.split(order[:sum(used)], np.cumsum(used)[:-1])
    tables = np.array([np.concatenate([own, rng.integers(0, n_blocks, n - len(own))])
                       for own in owned])                    # padding: any block id
    contiguous = [rng.standard_normal((length, kv_heads, head_dim)) * 2 for length in lengths]
    values = [rng.standard_normal((length, kv_heads, head_dim)) for length in lengths]
    pool_k = rng.standard_normal((n_blocks, block_size, width))    # noise wherever unwritten
    pool_v = rng.standard_normal((n_blocks, block_size, width))
    for own, K, V in zip(owned, contiguous, values):
        for p in range(len(K)):
            pool_k[own[p // block_size], p % block_size] = K[p].reshape(-1)
            pool_v[own[p // block_size], p % block_size] = V[p].reshape(-1)
    positions = np.array([length - T + np.arange(T) if contiguous_queries
                          else np.sort(rng.choice(length, T, replace=False))
                          for length in lengths])
    Q = rng.standard_normal((len(lengths), h, T, head_dim)) * 3      # sharp softmaxes too
    want = np.stack([plain_causal_attention(Q[r], contiguous[r], values[r], positions[r])
                     for r in range(len(lengths))])
    tolerance = 1e-12 if dtype == "float64" else 2e-5
    inputs = [x.astype(dtype) for x in (Q, pool_k, pool_v)]
    for batched in (batched_block_attention, batched_gather_attention):
        got = batched(inputs[0], positions, inputs[1], inputs[2], tables)
        assert got.dtype == np.dtype(dtype) and got.shape == Q.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * max(1, np.abs(want).max()),
                                   err_msg=batched.__name__)


def test_block_attention_reads_each_block_once_where_the_gather_moves_it_three_times():
    assert attention_bytes(100, 192, 4, gather=False) == 2 * 100 * 192 * 4
    assert attention_bytes(100, 192, 4, gather=True) == 3 * 2 * 100 * 192 * 4


# --------------------------------------------------------------------------- workloads

def alone(params, prompt, sampling):
    """The reference: one request decoded by itself with kvlib.generate (for n > 1, each of
    its completions, with its own seed)."""
    if sampling.n > 1:
        return [alone(params, prompt, sampling.child(i)) for i in range(sampling.n)]
    new = kvlib.generate(params, prompt, sampling.max_tokens, temperature=sampling.temperature,
                         seed=sampling.seed)
    for index, token in enumerate(new):
        if token in sampling.stop_token_ids:
            return new[:index + 1]
    return new


@st.composite
def workloads(draw, vocab_size: int, max_prompt: int = 14):
    """Prompts sharing a random prefix, their arrival steps, and their sampling."""
    prefix = draw(st.lists(st.integers(0, vocab_size - 1), min_size=0, max_size=12))
    n = draw(st.integers(1, 6))
    requests = []
    for _ in range(n):
        own = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_prompt))
        shared = prefix[:draw(st.integers(0, len(prefix)))]
        sampled = draw(st.booleans())
        sampling = SamplingParams(max_tokens=draw(st.integers(1, 8)),
                                  temperature=0.8 if sampled else 0.0,
                                  seed=draw(st.integers(0, 99)) if sampled else None,
                                  stop_token_ids=draw(st.lists(st.integers(0, vocab_size - 1),
                                                               max_size=2)),
                                  n=draw(st.sampled_from([1, 1, 1, 2, 3])))
        requests.append((draw(st.integers(0, 6)), shared + own, sampling))
    return requests


def prefix_of_alone(params, prompt, sampling, output) -> bool:
    """An aborted request's tokens: the first ones decoding alone gives (each completion's)."""
    want = alone(params, prompt, sampling)
    if sampling.n == 1:
        return output == want[:len(output)]
    return all(o == w[:len(o)] for o, w in zip(output, want))


def run(engine, requests, aborts=(), names=None):
    """Add each request at its arrival step (under names[i] if given), abort request i at
    step s for each (i, s) of aborts, step to the end, checking the pool and the budget after
    every step and every abort -> each request's output (n lists for n > 1), in the order
    given."""
    ids, step = {}, 0
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][0] <= step:
            index = pending.pop(0)
            ids[index] = engine.add_request(requests[index][1], requests[index][2],
                                            request_id=None if names is None else names[index])
        for index, when in aborts:
            if when == step and index in ids:
                engine.abort_request(ids[index])
                engine.check()
        engine.step()
        engine.check()
        assert sum(engine.last_step.scheduled_tokens.values()) <= engine.max_num_batched_tokens
        step += 1
        assert step < 2000, "the engine made no progress"
    assert engine.pool.n_used == 0, "blocks leaked"
    return [engine.output_of(ids[i]) for i in range(len(requests))], ids


def check_outputs(engine, params, requests, outputs, ids):
    """Every request equals decoding it alone; an aborted one, the start of it."""
    for index, ((_, prompt, sampling), output) in enumerate(zip(requests, outputs)):
        completions = engine.parents.get(ids[index], [ids[index]])
        reasons = {engine.requests[i].finish_reason for i in completions}
        assert reasons <= {"stop", "length", "abort"} and None not in reasons
        if "abort" in reasons:
            assert prefix_of_alone(params, prompt, sampling, output)
        else:
            assert output == alone(params, prompt, sampling)


@settings(max_examples=80, deadline=None)
@given(configs(latent=False, window=False, context_length=48), st.integers(0, 10_000),
       st.data())
def test_every_request_equals_decoding_it_alone(config, seed, data):
    params = kvlib.init_params(config, seed=seed)
    requests = data.draw(workloads(config.vocab_size))
    block_size = data.draw(st.integers(1, 6))
    longest = max(len(p) + s.max_tokens for _, p, s in requests)
    n_blocks = data.draw(st.integers(-(-longest // block_size), 3 * -(-longest // block_size)))
    engine = Engine(params, block_size=block_size, n_blocks=n_blocks,
                    max_num_batched_tokens=data.draw(st.integers(1, 24)),
                    max_num_seqs=data.draw(st.integers(1, 6)),
                    enable_prefix_caching=data.draw(st.booleans()),
                    cache_when_scheduled=data.draw(st.booleans()))
    aborts = data.draw(st.lists(st.tuples(st.integers(0, len(requests) - 1),
                                          st.integers(0, 12)), max_size=2))
    names = data.draw(st.one_of(st.none(), st.lists(
        st.one_of(st.integers(-5, 50), st.text("abc-", min_size=1, max_size=3)),
        min_size=len(requests), max_size=len(requests), unique=True)))
    event(f"{sum(s.n > 1 for _, _, s in requests)} requests with n > 1, {len(aborts)} aborts")
    outputs, ids = run(engine, requests, aborts, names)
    check_outputs(engine, params, requests, outputs, ids)


@pytest.fixture(scope="module")
def story():
    from kvlib import gpt2

    return gpt2.load(STORIES, dtype="float32")


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_the_trained_story_model_in_float32_equals_decoding_alone(story, data):
    from kvlib.stories import corpus

    sequences = corpus.story_sequences(4, corpus.HELD_OUT_SEED)
    requests = []
    for row in range(data.draw(st.integers(2, 4))):
        length = data.draw(st.integers(8, 60))
        requests.append((data.draw(st.integers(0, 4)), sequences[row][:length].tolist(),
                         SamplingParams(max_tokens=data.draw(st.integers(2, 10)))))
    engine = Engine(story, block_size=8, n_blocks=data.draw(st.integers(9, 30)),
                    max_num_batched_tokens=data.draw(st.integers(8, 64)))
    for (_, prompt, sampling), output in zip(requests, run(engine, requests)[0]):
        assert output == alone(story, prompt, sampling)


# --------------------------------------------------------------------------- named behaviours

def toy():
    config = kvlib.ModelConfig(vocab_size=30, d_model=8, n_heads=4, n_kv_heads=2, n_layers=2,
                               d_ff=16, context_length=64, positions="rotary", norm="rms",
                               mlp="swiglu")
    return kvlib.init_params(config, seed=5)


SYSTEM = list(range(1, 18))                          # 17 tokens: 4 full blocks of 4


def test_a_second_request_reuses_every_full_block_while_the_first_still_runs():
    engine = Engine(toy(), block_size=4, n_blocks=32, max_num_batched_tokens=64)
    first = engine.add_request(SYSTEM + [20, 21], SamplingParams(max_tokens=10))
    engine.step()                                           # the first prefills, then decodes
    assert engine.requests[first].status == "running"
    second = engine.add_request(SYSTEM + [22], SamplingParams(max_tokens=3))
    engine.step()
    assert engine.last_step.hit_blocks[second] == engine.requests[first].block_table[:4]
    assert engine.last_step.scheduled_tokens[second] == 18 - 16       # only its own tokens
    assert engine.stats["prefix_hit_tokens"] == 16


def test_the_last_prompt_token_always_runs_even_when_its_block_is_cached():
    engine = Engine(toy(), block_size=4, n_blocks=32)
    engine.generate([SYSTEM[:16]], SamplingParams(max_tokens=2))     # 16 tokens: 4 blocks
    engine.add_request(SYSTEM[:16], SamplingParams(max_tokens=2))
    engine.step()
    assert len(next(iter(engine.last_step.hit_blocks.values()))) == 3
    assert list(engine.last_step.scheduled_tokens.values()) == [4]


def test_a_pool_too_small_preempts_the_newest_and_its_output_is_unchanged():
    params = toy()
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10][:n] for n in (8, 7, 6)]
    sampling = SamplingParams(max_tokens=12)
    engine = Engine(params, block_size=4, n_blocks=9, max_num_batched_tokens=32)
    ids = [engine.add_request(p, sampling) for p in prompts]
    preempted = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
        preempted += engine.last_step.preempted
    assert preempted and preempted[0] == ids[-1], "the newest goes first"
    assert engine.stats["preemptions"] == len(preempted)
    for i, prompt in zip(ids, prompts):
        assert engine.requests[i].output_token_ids == kvlib.generate(params, prompt, 12)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    engine = Engine(toy(), block_size=4, n_blocks=32, max_num_batched_tokens=5)
    request = engine.add_request(list(range(1, 24)), SamplingParams(max_tokens=2))
    chunks = []
    while engine.has_unfinished_requests():
        engine.step()
        chunks.append(engine.last_step.prefill_chunks.get(request))
    assert chunks[:5] == [(0, 5), (5, 5), (10, 5), (15, 5), (20, 3)]


def test_a_request_that_does_not_fit_waits_and_is_never_skipped():
    engine = Engine(toy(), block_size=4, n_blocks=6, max_num_batched_tokens=64,
                    enable_prefix_caching=False)
    running = engine.add_request(list(range(1, 14)), SamplingParams(max_tokens=3))  # 4 blocks
    engine.step()
    big = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=2))      # needs 3
    small = engine.add_request([1, 2], SamplingParams(max_tokens=2))                # needs 1
    engine.step()
    assert set(engine.last_step.scheduled_tokens) == {running}    # 2 free: big waits, so
    assert engine.requests[small].status == "waiting"            # small waits behind it
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[big].first_scheduled_step <= \
        engine.requests[small].first_scheduled_step


def test_finished_requests_free_their_blocks_and_cached_ones_stay():
    engine = Engine(toy(), block_size=4, n_blocks=16)
    engine.generate([SYSTEM], SamplingParams(max_tokens=3))
    assert engine.pool.n_used == 0
    assert len(engine.pool.cached) == 4 and len(engine.pool.idle) == 4
    without = Engine(toy(), block_size=4, n_blocks=16, enable_prefix_caching=False)
    without.generate([SYSTEM], SamplingParams(max_tokens=3))
    assert not without.pool.cached and without.pool.n_free == 16


def test_never_cached_blocks_are_taken_before_cached_ones_then_least_recent_first():
    pool = BlockPool(toy().config, n_blocks=3, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"key a")
    pool.cache(b, b"key b")
    pool.release(b)                 # b idle first, then a: b is the least recently released
    pool.release(a)
    assert not pool.evicting() and pool.allocate() == 2    # the free block before any cached
    assert pool.evicting() and pool.allocate() == b        # then the least recently released
    assert b"key b" not in pool.cached and b"key a" in pool.cached
    pool.check_invariants({a: 0, b: 1, 2: 1})


def state(engine):
    """Everything a step may change, as plain values."""
    pool = engine.pool
    return (pool.ref_counts.tolist(), pool.generations.tolist(), list(pool.free),
            list(pool.idle), list(pool.key_of), dict(pool.cached),
            [r.request_id for r in engine.waiting], [r.request_id for r in engine.running],
            {i: {name: value for name, value in r.snapshot().items()}
             for i, r in engine.requests.items()},
            dict(engine.stats), engine.step_count, engine.last_step)


def test_a_step_that_fails_changes_nothing(monkeypatch):
    params = toy()
    engine = Engine(params, block_size=4, n_blocks=8, max_num_batched_tokens=6)
    ids = [engine.add_request(p, SamplingParams(max_tokens=5)) for p in
           ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15])]
    for _ in range(3):
        engine.step()
    before = state(engine)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "forward_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert state(engine) == before
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    for i, prompt in zip(ids, ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15])):
        assert engine.requests[i].output_token_ids == kvlib.generate(params, prompt, 5)


class Failure(Exception):
    pass


@settings(max_examples=60, deadline=None)
@given(configs(latent=False, window=False, context_length=48), st.data())
def test_a_step_that_fails_anywhere_changes_nothing_and_the_run_goes_on(config, data):
    """Over random workloads and pools: at a random step, the model step, the sampling or the
    bookkeeping after it fails; the engine is as before the step, and the rest of the run
    gives every request the tokens it would have had."""
    params = kvlib.init_params(config, seed=data.draw(st.integers(0, 99)))
    requests = data.draw(workloads(config.vocab_size))
    block_size = data.draw(st.integers(1, 6))
    longest = max(len(p) + s.max_tokens for _, p, s in requests)
    engine = Engine(params, block_size=block_size,
                    n_blocks=data.draw(st.integers(-(-longest // block_size),
                                                   2 * -(-longest // block_size))),
                    max_num_batched_tokens=data.draw(st.integers(1, 16)),
                    max_num_seqs=data.draw(st.integers(1, 4)))
    fail_at = data.draw(st.integers(1, 12))
    where = data.draw(st.sampled_from(["forward_step", "choose_next_token", "write_rows",
                                       "update"]))
    ids, step, failed = {}, 0, False
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][0] <= step:
            index = pending.pop(0)
            ids[index] = engine.add_request(requests[index][1], requests[index][2])
        if step >= fail_at and not failed and engine.has_unfinished_requests():
            before = state(engine)

            def failing(*args, **kwargs):
                if where == "update":         # half-way through the bookkeeping
                    engine.scheduler.running.clear()
                raise Failure

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(engine.scheduler if where == "update" else engine_module, where,
                              failing)
                try:
                    engine.step()             # a step that never reaches `where` just runs
                except Failure:
                    failed = True
            if failed:
                assert state(engine) == before
                continue
            engine.check()
            step += 1
            continue
        engine.step()
        engine.check()
        step += 1
    event(f"failed in {where}" if failed else "no step reached the failure")
    for index, (_, prompt, sampling) in enumerate(requests):
        assert engine.output_of(ids[index]) == alone(params, prompt, sampling)


def test_a_checkpoint_copies_only_what_a_step_may_touch():
    """However many requests the engine has served, a step saves the running requests and
    at most max_num_seqs waiting ones: never the finished ones."""
    engine = Engine(toy(), block_size=4, n_blocks=32, max_num_batched_tokens=32,
                    max_num_seqs=4)
    for n in range(60):
        engine.add_request([1 + n % 20, 2, 3], SamplingParams(max_tokens=2))
        engine.step()
        saved = engine._checkpoint()
        assert len(saved.requests) <= engine.max_num_seqs
        assert {r.request_id for r, _ in saved.requests} >= \
            {r.request_id for r in engine.running}
    assert sum(r.status == "finished" for r in engine.requests.values()) > 50


@pytest.mark.parametrize("call, error, words", [
    (lambda e: e.add_request("hello"), TypeError, "token ids"),
    (lambda e: e.add_request([99]), ValueError, "outside the vocabulary"),
    (lambda e: e.add_request([1], SamplingParams(max_tokens=65)), ValueError, "context length"),
    (lambda e: e.add_request(list(range(1, 30)), SamplingParams(max_tokens=10)), ValueError,
     "could never finish"),
    (lambda e: e.add_request([1], {"max_tokens": 3}), TypeError, "SamplingParams"),
    (lambda e: e.generate([[1]], [SamplingParams(), SamplingParams()]), ValueError, "2 Sampl"),
    (lambda e: e.generate("1 2 3"), TypeError, "list of prompts"),
])
def test_bad_requests_are_refused_in_words_and_change_nothing(call, error, words):
    engine = Engine(toy(), block_size=4, n_blocks=8)
    with pytest.raises(error, match=words):
        call(engine)
    assert not engine.has_unfinished_requests() and engine.pool.n_free == 8


@pytest.mark.parametrize("options, error, words", [
    (dict(max_tokens=0), ValueError, "at least 1"),
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(seed=-2), ValueError, "at least 0"),
    (dict(stop_token_ids="2"), TypeError, "stop_token_ids"),
])
def test_bad_sampling_params_are_refused_in_words(options, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**options)


@pytest.mark.parametrize("options, error, words", [
    (dict(n_blocks=0), ValueError, "n_blocks"), (dict(block_size=1.5), TypeError, "block_size"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(n_blocks=2**40), ValueError, "n_blocks must be at most"),
    (dict(n_blocks=2**30, block_size=2**20), ValueError, "far more cache"),
    (dict(enable_prefix_caching="yes"), TypeError, "True or False"),
])
def test_bad_engine_settings_are_refused_in_words(options, error, words):
    with pytest.raises(error, match=words):
        Engine(toy(), **options)
    with pytest.raises(ValueError, match="latent"):
        Engine(kvlib.init_params(kvlib.ModelConfig(latent_dim=2)))


def test_without_chunked_prefill_a_request_longer_than_the_budget_is_refused():
    engine = Engine(toy(), block_size=4, n_blocks=16, max_num_batched_tokens=8,
                    enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="must fit one step"):
        engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=2))


# --------------------------------------------------------------------------- vLLM's API

def test_finish_reasons_say_why_each_request_stopped():
    params = toy()
    free = kvlib.generate(params, [10, 3], 6)
    stopped = free[:free.index(free[1]) + 1]
    assert len(stopped) < 6
    engine = Engine(params, block_size=4, n_blocks=16)
    by_length = engine.add_request([10, 3], SamplingParams(max_tokens=6))
    by_stop = engine.add_request([10, 3], SamplingParams(max_tokens=6,
                                                         stop_token_ids=[free[1]]))
    waiting = engine.add_request([4, 5], SamplingParams(max_tokens=6))
    engine.abort_request(waiting)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {by_length: "length", by_stop: "stop"}
    assert all(o.finish_reason is None for o in outputs if not o.finished)
    assert [engine.requests[i].finish_reason for i in (by_length, by_stop, waiting)] == \
        ["length", "stop", "abort"]
    assert engine.output_of(by_stop) == stopped and engine.output_of(waiting) == []
    assert engine.requests[waiting].first_scheduled_step is None, "an aborted request never ran"


def test_abort_frees_a_running_requests_blocks_and_the_others_go_on():
    params = toy()
    engine = Engine(params, block_size=4, n_blocks=16)
    keep = engine.add_request(SYSTEM[:9], SamplingParams(max_tokens=5), request_id="keep")
    drop = engine.add_request([20, 21, 22, 23, 24, 25], SamplingParams(max_tokens=9),
                              request_id=7)
    engine.step()
    held = engine.pool.n_used
    assert engine.requests[drop].status == "running" and len(engine.requests[drop].block_table)
    engine.abort_request(7)
    engine.check()
    assert engine.pool.n_used == held - 2 and engine.requests[drop].block_table == []
    assert [r.request_id for r in engine.running] == ["keep"]
    engine.abort_request(7)                                  # finished: nothing more happens
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    assert engine.output_of(keep) == kvlib.generate(params, SYSTEM[:9], 5)
    assert len(engine.output_of(drop)) == 1 and engine.pool.n_used == 0
    with pytest.raises(ValueError, match="no request of this engine has the id 'nobody'"):
        engine.abort_request("nobody")


@pytest.mark.parametrize("request_id, error, words", [
    ("keep", ValueError, "'keep' is taken"), (3, ValueError, "3 is taken"),
    ("0_pair", ValueError, "is taken"), (2.0, TypeError, "a str or an int"),
    (True, TypeError, "a str or an int"), (None, None, None),
])
def test_caller_ids_are_strings_or_ints_and_never_reused(request_id, error, words):
    engine = Engine(toy(), block_size=4, n_blocks=16)
    engine.add_request([1, 2], request_id="keep")
    engine.add_request([1, 2], request_id=3)
    engine.add_request([1, 2], SamplingParams(n=2), request_id="pair")
    before = (list(engine.requests), len(engine.waiting))
    if error is None:
        assert engine.add_request([1, 2], request_id=request_id) == 0   # the first free number
        assert engine.add_request([1, 2]) == 1 and engine.add_request([1]) == 2
        assert engine.add_request([1]) == 4                               # 3 is taken
        return
    with pytest.raises(error, match=words):
        engine.add_request([1, 2], request_id=request_id)
    assert (list(engine.requests), len(engine.waiting)) == before


def test_n_completions_share_the_prompts_full_blocks_and_each_equals_decoding_alone():
    params = toy()
    prompt = SYSTEM[:10]                                  # 2 full blocks of 4, then 2 tokens
    sampling = SamplingParams(max_tokens=6, temperature=0.9, seed=11, n=3)
    engine = Engine(params, block_size=4, n_blocks=24)
    parent = engine.add_request(prompt, sampling, request_id="q")
    assert parent == "q" and engine.parents["q"] == ["0_q", "1_q", "2_q"]
    engine.step()
    tables = [engine.requests[i].block_table for i in engine.parents["q"]]
    assert tables[1][:2] == tables[2][:2] == tables[0][:2], "the prompt's full blocks, shared"
    assert len({t[2] for t in tables}) == 3, "each its own last, partial block"
    assert engine.last_step.scheduled_tokens == {"0_q": 10, "1_q": 2, "2_q": 2}
    assert engine.pool.ref_counts[tables[0][0]] == 3
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    outputs = engine.output_of("q")
    assert outputs == [kvlib.generate(params, prompt, 6, temperature=0.9, seed=11 + i)
                       for i in range(3)]
    assert len({tuple(o) for o in outputs}) > 1, "different seeds, different samples"
    assert Engine(params, block_size=4, n_blocks=24).generate([prompt], sampling) == [outputs]
    engine.add_request(prompt, SamplingParams(n=2, max_tokens=2), request_id="r")
    engine.abort_request("r")
    assert {engine.requests[i].finish_reason for i in engine.parents["r"]} == {"abort"}


def test_changing_the_callers_stop_list_later_changes_no_request():
    stop = [5]
    sampling = SamplingParams(stop_token_ids=stop)
    stop.append(7)
    assert sampling.stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)


@pytest.mark.parametrize("temperature", [10**400, -10**400, 10**5000],
                         ids=["1e400", "-1e400", "1e5000"])
def test_a_temperature_too_large_for_a_float_is_refused_in_words(temperature):
    with pytest.raises(ValueError, match="temperature") as error:
        SamplingParams(temperature=temperature)
    assert len(str(error.value)) < 120 and "digits" in str(error.value)


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, Interrupt])
def test_an_interrupted_generate_leaves_none_of_its_requests_running(monkeypatch, interrupt):
    params = toy()
    engine = Engine(params, block_size=4, n_blocks=16, max_num_batched_tokens=8)
    earlier = engine.add_request([9, 8, 7], SamplingParams(max_tokens=8))  # not this call's
    calls = {"n": 0}
    real_step = engine_module.forward_step

    def third_step_fails(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise interrupt
        return real_step(*args)

    monkeypatch.setattr(engine_module, "forward_step", third_step_fails)
    with pytest.raises(interrupt):
        engine.generate([SYSTEM[:6], [3, 4]], SamplingParams(max_tokens=5))
    monkeypatch.undo()
    engine.check()
    mine = [r for i, r in engine.requests.items() if i != earlier]
    assert all(r.status == "finished" and r.finish_reason == "abort" and not r.block_table
               for r in mine)
    assert [r.request_id for r in engine.running + list(engine.waiting)] == [earlier]
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2)) == \
        [kvlib.generate(params, [1, 2], 2)]
    assert engine.output_of(earlier) == kvlib.generate(params, [9, 8, 7], 8)
    assert all(len(r.output_token_ids) <= 2 for r in mine), "never ran after the interrupt"
    assert engine.pool.n_used == 0


# --------------------------------------------------------------------------- when blocks hit

@pytest.mark.parametrize("when_scheduled, hits", [(True, [1, 1, 1]), (False, [0, 0, 0])])
def test_vllms_timing_lets_requests_admitted_in_the_same_step_share_full_blocks(
        when_scheduled, hits):
    """Four identical 20-token prompts submitted together, blocks of 16: with vLLM's timing
    the last three take the first one's full block in the very step it is computed."""
    config = kvlib.ModelConfig(vocab_size=30, d_model=8, n_heads=2, n_layers=2, d_ff=16,
                               context_length=64, positions="rotary")
    params = kvlib.init_params(config, seed=3)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 30, 20)]
    engine = Engine(params, block_size=16, n_blocks=16, max_num_batched_tokens=256,
                    cache_when_scheduled=when_scheduled)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=4)) for _ in range(4)]
    engine.step()
    record = engine.last_step
    assert [len(record.hit_blocks.get(i, [])) for i in ids[1:]] == hits
    assert sum(record.scheduled_tokens.values()) == (20 + 3 * 4 if when_scheduled else 80)
    first_block = engine.requests[ids[0]].block_table[0]
    assert engine.pool.ref_counts[first_block] == (4 if when_scheduled else 1)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check()
    want = kvlib.generate(params, prompt, 4)
    assert [engine.output_of(i) for i in ids] == [want] * 4
