"""Notebook 21 (batched and continuous decoding): a batched decode step equals decoding each
sequence alone over random models, ragged lengths and cache kinds (float64, 1e-10); padding,
left-padded prompts and the roofline of a batch; the scheduler's rules as properties over
random workloads, and served by a model; bad input refused in words; the widget driven
headless; the exercise checkers with tables of wrong answers and valid answers in other forms
(what every checker does with odd input is tested once for all lessons, in test_checkers.py)."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import (
    assert_correct,
    assert_not_yet,
    case_id,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from notebook_runs import code_cells, notebook_path, run_notebook
from strategies import models, token_lists
from widget_checks import no_new_figures, text_of

import kvlib
from kvlib import roofline
from kvlib.exercises import batched_decoding as ex21
from kvlib.gpt2 import GPT2_124M
from kvlib.serving import (
    BlockAllocator,
    Engine,
    PagedKVCache,
    Request,
    SamplingParams,
    StaticBatchingEngine,
    batch,
    scheduler,
)
from kvlib.serving.workloads import arrivals_in_seconds, make_workload
from kvlib.widgets import batched_decoding as w21

NOTEBOOK = notebook_path("batched_decoding")
TOLERANCE = 1e-10
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
ATTENDS = [batch.attend_per_sequence, batch.attend_padded]
H100 = {"compute_rate": 989e12, "bandwidth": 3.35e12}


def untimed_cells(left_out_tag: str) -> list[dict]:
    """The notebook's code cells but those that time this machine: the lab model's (their
    names start with lab_) and those tagged left_out_tag."""
    return [cell for cell in code_cells("batched_decoding")
            if "lab_" not in "".join(cell["source"])
            and left_out_tag not in cell["metadata"].get("tags", [])]


@pytest.fixture(scope="module")
def namespace():
    """The notebook's variables after running its code cells headless; the cells that time
    this machine (the lab model's, and the cell tagged timings) and the widget cell are left
    out."""
    return run_notebook("batched_decoding", untimed_cells("nbval-ignore-output"))


def ragged_prompts(draw, config, max_sequences=5):
    n = draw(st.integers(1, max_sequences))
    return [token_lists(draw, config, min_size=1, max_size=10) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# A batched decode step equals decoding each sequence alone
# ---------------------------------------------------------------------------------------------

@PROPERTY
@given(models(latent=False), st.data(), st.sampled_from(ATTENDS))
def test_a_batched_step_equals_each_sequence_decoded_alone(model, data, attend):
    """Random models of every architecture with a K/V cache (MHA, GQA, MQA; no, learned or
    rotary positions; norms, biases; sliding windows with sinks), ragged prompts, several
    steps: every row of every batched step equals kvlib.decode_step on that sequence."""
    params, config = model
    prompts = ragged_prompts(data.draw, config)
    batched = [kvlib.prefill(params, p)[1] for p in prompts]
    alone = [kvlib.prefill(params, p)[1] for p in prompts]
    tokens = [data.draw(st.integers(0, config.vocab_size - 1)) for _ in prompts]
    for _ in range(data.draw(st.integers(1, 4))):
        together = batch.batched_decode_step(params, tokens, batched, attend=attend)
        apart = np.vstack([kvlib.decode_step(params, t, c) for t, c in zip(tokens, alone)])
        np.testing.assert_allclose(together, apart, rtol=0, atol=TOLERANCE)
        assert together.shape == (len(prompts), config.vocab_size)
        assert [len(c) for c in batched] == [len(c) for c in alone]
        for mine, reference in zip(batched, alone):
            for layer in range(config.n_layers):
                np.testing.assert_allclose(mine.keys(layer), reference.keys(layer), rtol=0,
                                           atol=TOLERANCE)
        tokens = [int(t) for t in apart.argmax(axis=1)]


@PROPERTY
@given(models(latent=False, window=False), st.data())
def test_a_batch_mixes_cache_kinds_and_paged_forks(model, data):
    """Paged caches (with a fork sharing its parent's blocks), contiguous and concatenating
    caches in one batch: the same logits as decoding each alone; no block leaks."""
    params, config = model
    pool = BlockAllocator(config, n_blocks=64, block_size=data.draw(st.integers(1, 4)))
    prompts = ragged_prompts(data.draw, config, max_sequences=3)
    kinds = [lambda: PagedKVCache(pool), lambda: kvlib.KVCache(config),
             lambda: kvlib.ConcatenatingKVCache(config)]
    batched = [kvlib.prefill(params, p, kinds[i % 3]())[1] for i, p in enumerate(prompts)]
    alone = [kvlib.prefill(params, p)[1] for p in prompts]
    batched.append(batched[0].fork())                # shares every block of sequence 0
    alone.append(kvlib.prefill(params, prompts[0])[1])
    tokens = [data.draw(st.integers(0, config.vocab_size - 1)) for _ in batched]
    for _ in range(3):
        together = batch.batched_decode_step(params, tokens, batched,
                                             attend=data.draw(st.sampled_from(ATTENDS)))
        apart = np.vstack([kvlib.decode_step(params, t, c) for t, c in zip(tokens, alone)])
        np.testing.assert_allclose(together, apart, rtol=0, atol=TOLERANCE)
        tokens = [data.draw(st.integers(0, config.vocab_size - 1)) for _ in batched]
        pool.check_invariants()
    for cache in batched:
        if isinstance(cache, PagedKVCache):
            cache.free()
    assert pool.n_free == pool.n_blocks


@PROPERTY
@given(models(latent=False), st.data())
def test_attend_padded_equals_attend_per_sequence(model, data):
    params, config = model
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    B = len(lengths)
    queries = rng.standard_normal((B, config.d_model))
    keys = [rng.standard_normal((n, config.kv_width)) for n in lengths]
    values = [rng.standard_normal((n, config.kv_width)) for n in lengths]
    masks = [None if data.draw(st.booleans()) else   # a window's mask: the newest always seen
             np.array(data.draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
                      + [True], dtype=bool)[None, :] for n in lengths]
    np.testing.assert_allclose(batch.attend_padded(queries, keys, values, masks, config),
                               batch.attend_per_sequence(queries, keys, values, masks, config),
                               rtol=0, atol=TOLERANCE)


def test_the_batched_step_reuses_kvlibs_steps_and_one_product_per_weight():
    """Counted by kvlib.count_multiply_adds: the same multiply-adds as B decode steps, and
    the projections done as one (B, d) product per weight."""
    params = kvlib.init_params()
    prompts = [[0, 3, 7, 1, 9], [0, 5], [0, 3, 7, 1, 9, 5, 2, 4, 8]]
    caches = [kvlib.prefill(params, p)[1] for p in prompts]
    _, batched = kvlib.count_multiply_adds(batch.batched_decode_step, params, [5, 2, 4],
                                           caches)
    caches = [kvlib.prefill(params, p)[1] for p in prompts]
    alone = sum((kvlib.count_multiply_adds(kvlib.decode_step, params, t, c)[1]
                 for t, c in zip([5, 2, 4], caches)), kvlib.MultiplyAdds())
    assert batched == alone


# ---------------------------------------------------------------------------------------------
# Padding and left-padded prompts
# ---------------------------------------------------------------------------------------------

@given(st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_padding_mask_puts_each_sequence_in_its_last_columns(lengths):
    mask = batch.padding_mask(lengths)
    assert mask.shape == (len(lengths), max(lengths))
    assert mask[:, -1].all()                                # every newest token, one column
    for row, n in zip(mask, lengths):
        assert row.sum() == n and row[len(row) - n:].all()


@PROPERTY
@given(st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=9), min_size=1,
                max_size=5))
def test_the_notebooks_padded_forward_equals_each_prompt_alone(namespace, prompts):
    """The notebook's left-padded batch through the toy: the real rows of the logits equal
    each prompt's own forward, and the last column is every prompt's next token."""
    params = namespace["params"]
    ids, real = batch.left_pad(prompts)
    logits = namespace["padded_forward"](params, ids, batch.padded_prompt_mask(real))
    assert np.isfinite(logits).all()
    for b, prompt in enumerate(prompts):
        np.testing.assert_allclose(logits[b, real[b]], kvlib.forward(params, prompt),
                                   rtol=0, atol=TOLERANCE)


@given(st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=9), min_size=1, max_size=5))
def test_left_padding_mask_and_positions(prompts):
    ids, real = batch.left_pad(prompts, pad_id=11)
    T = max(len(p) for p in prompts)
    mask = batch.padded_prompt_mask(real)
    positions = batch.padded_prompt_positions(real)
    for b, prompt in enumerate(prompts):
        pads = T - len(prompt)
        assert ids[b, pads:].tolist() == prompt and (ids[b, :pads] == 11).all()
        assert positions[b, pads:].tolist() == list(range(len(prompt)))
        np.testing.assert_array_equal(mask[b, pads:, pads:], np.tri(len(prompt), dtype=bool))
        assert not mask[b, pads:, :pads].any()               # no real query sees a pad
        assert mask[b].any(axis=1).all()                     # no row sees nothing
    assert mask.shape == (len(prompts), T, T)


def test_left_pad_refuses_bad_prompts():
    for bad, words in [([], "non-empty list"), ("How", "non-empty list"),
                       ([[0, 1], "How"], "encode a text first"),
                       ([[0, 1], []], "non-empty list of token ids"),
                       ([[0.5]], "prompt 0")]:
        with pytest.raises((ValueError, TypeError), match=words):
            batch.left_pad(bad)
    with pytest.raises(ValueError, match="pad_id"):
        batch.left_pad([[1]], pad_id=-1)
    for bad in ([], [0, 2], [[1, 2]], [1.5]):
        with pytest.raises((ValueError, TypeError), match="lengths must be"):
            batch.padding_mask(bad)
    with pytest.raises(ValueError, match="real must be"):
        batch.padded_prompt_mask(np.ones(3, dtype=bool))


# ---------------------------------------------------------------------------------------------
# The roofline of a batch
# ---------------------------------------------------------------------------------------------

small_configs = st.sampled_from([kvlib.ModelConfig(), kvlib.GPT2_SMALL, GPT2_124M,
                                 GPT2_124M.replace(n_kv_heads=2),
                                 kvlib.ModelConfig(d_model=8, n_heads=4, window=4,
                                                   context_length=64)])


@given(small_configs, st.lists(st.integers(0, 30), min_size=1, max_size=6))
def test_batched_step_counts_are_sums_over_the_sequences(config, positions):
    assert roofline.batched_step_flops(config, positions) == sum(
        kvlib.decode_step_multiply_adds(config, p).flops for p in positions)
    assert roofline.batched_step_bytes(config, positions) == kvlib.roofline.weights_bytes(
        config) + sum(kvlib.roofline.cache_bytes(config, p + 1) for p in positions)
    assert roofline.batched_step_bytes(config, positions, bytes_per_number=2) * \
        config.numpy_dtype.itemsize == 2 * roofline.batched_step_bytes(config, positions)


@settings(deadline=None)
@given(small_configs, st.integers(0, 60), st.floats(1e9, 1e15), st.floats(1e9, 1e13),
       st.sampled_from([None, 1, 2]))
def test_compute_bound_batch_size_is_the_smallest_such_batch(config, position, rate,
                                                             bandwidth, number_bytes):
    """B sequences do B f FLOPs and read W + B c bytes (the previous test): the answer is the
    smallest B with B f / rate >= (W + B c) / bandwidth, or None when f / rate <= c /
    bandwidth (then no B is)."""
    size = roofline.compute_bound_batch_size(config, position, rate, bandwidth, number_bytes)
    f = roofline.batched_step_flops(config, [position])
    W = roofline.batched_step_bytes(config, [position], number_bytes) - \
        roofline.batched_step_bytes(config, [position, position], number_bytes) + \
        roofline.batched_step_bytes(config, [position], number_bytes)
    c = roofline.batched_step_bytes(config, [position], number_bytes) - W

    def bound(b):
        return b * f * bandwidth >= (W + b * c) * rate

    if size is None:
        assert f * bandwidth <= c * rate
    else:
        assert bound(size) and (size == 1 or not bound(size - 1))
    if size is not None and size <= 64:     # the sums themselves, where they are small
        positions = [position] * size
        assert roofline.batched_step_flops(config, positions) * bandwidth >= \
            roofline.batched_step_bytes(config, positions, number_bytes) * rate


def test_the_lessons_h100_figures():
    assert round(roofline.ridge_point(**H100)) == 295
    assert roofline.compute_bound_batch_size(GPT2_124M, 0, **H100, bytes_per_number=2) == 312
    assert roofline.compute_bound_batch_size(GPT2_124M, 21, **H100, bytes_per_number=2) is not None
    assert roofline.compute_bound_batch_size(GPT2_124M, 22, **H100, bytes_per_number=2) is None
    seconds = [roofline.batched_step_seconds(GPT2_124M, [32] * b, **H100, bytes_per_number=2)
               for b in (1, 2, 4)]
    assert seconds[0] < seconds[1] < seconds[2] < 4 * seconds[0]   # memory-bound: sublinear
    assert ex21.weights_bound_batch_size(312e12, 2.039e12) == pytest.approx(153.016, abs=1e-3)


def test_roofline_functions_refuse_bad_input():
    with pytest.raises(ValueError, match="positions"):
        roofline.batched_step_flops(GPT2_124M, [])
    with pytest.raises(ValueError, match="positions"):
        roofline.batched_step_bytes(GPT2_124M, [-1])
    with pytest.raises(ValueError, match="bytes_per_number"):
        roofline.batched_step_bytes(GPT2_124M, [3], bytes_per_number=0)
    for rate in (0, -1.0, float("nan"), float("inf"), "fast", True):
        with pytest.raises((TypeError, ValueError), match="compute_rate"):
            roofline.ridge_point(rate, 1e9)
        with pytest.raises((TypeError, ValueError), match="bandwidth"):
            roofline.compute_bound_batch_size(GPT2_124M, 0, 1e12, rate)


# ---------------------------------------------------------------------------------------------
# Bad batches are refused in words, and a failed step changes nothing
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def toy_batch():
    params = kvlib.init_params()
    caches = [kvlib.prefill(params, p)[1] for p in ([0, 3, 7], [0, 5])]
    return params, caches


def test_a_batch_from_two_models_is_refused(toy_batch):
    params, caches = toy_batch
    other = kvlib.init_params(kvlib.ModelConfig(d_model=8, n_heads=4))
    caches.append(kvlib.prefill(other, [0, 1])[1])
    with pytest.raises(ValueError, match=r"sequence 2's cache comes from another model.*"
                                         r"d_model 8 \(not 4\)"):
        batch.batched_decode_step(params, [1, 2, 3], caches)
    with pytest.raises(ValueError, match="another model"):
        batch.batched_decode_step(other, [1, 2, 3], caches)
    assert [len(c) for c in caches] == [3, 2, 2]


@pytest.mark.parametrize("make, words", [
    (lambda p, c: (p, [1, 2], c[0]), "list of kvlib caches"),
    (lambda p, c: (p, [1, 2], {"a": c[0]}), "list of kvlib caches"),
    (lambda p, c: (p, [], []), "batch is empty"),
    (lambda p, c: (p, [1, 2], [c[0], "cache"]), "list of kvlib caches"),
    (lambda p, c: (p, [1, 2], [c[0], c[0]]), "another sequence's cache object"),
    (lambda p, c: (p, [1, 2], [c[0], kvlib.KVCache(p.config)]), "sequence 1's cache is empty"),
    (lambda p, c: (p, [1], c), "1 token ids for 2 caches"),
    (lambda p, c: (p, [1, 12], c), "outside the vocabulary"),
    (lambda p, c: (p, "I am", c), "text"),
    (lambda p, c: (p, [[1], [2]], c), "flat sequence"),
    (lambda p, c: ("params", [1, 2], c), "params must be kvlib Params"),
])
def test_bad_batches_are_refused_in_words(toy_batch, make, words):
    params, caches = toy_batch
    args = make(params, caches)
    with pytest.raises((ValueError, TypeError), match=words):
        batch.batched_decode_step(*args)
    assert [len(c) for c in caches] == [3, 2]


def test_full_caches_inconsistent_caches_and_latent_models_are_refused(toy_batch):
    params, caches = toy_batch
    full = kvlib.KVCache(params.config, capacity=3)
    kvlib.prefill(params, [0, 3, 7], full)
    with pytest.raises(ValueError, match="sequence 1's cache is empty or full"):
        batch.batched_decode_step(params, [1, 2], [caches[0], full])
    caches[1].append(0, np.zeros((1, 4)), np.zeros((1, 4)))
    with pytest.raises(ValueError, match="layers of this cache hold different numbers"):
        batch.batched_decode_step(params, [1, 2], caches)
    latent = kvlib.init_params(kvlib.ModelConfig(latent_dim=2))
    with pytest.raises(ValueError, match="latent attention"):
        batch.batched_decode_step(latent, [1], [kvlib.prefill(latent, [0, 1])[1]])
    with pytest.raises(TypeError, match="attend must be"):
        batch.batched_decode_step(params, [1], [caches[0]], attend="padded")


def test_a_past_the_table_position_is_refused_before_anything_is_appended():
    params = kvlib.init_params(kvlib.ModelConfig(positions="learned", window=4,
                                                 context_length=8))
    _, long = kvlib.prefill(params, [0, 1, 2, 3, 4, 5, 6, 7])
    _, short = kvlib.prefill(params, [0, 1])
    with pytest.raises(ValueError, match="past the context length"):
        batch.batched_decode_step(params, [1, 1], [short, long])
    assert (len(short), len(long)) == (2, 8)


@pytest.mark.parametrize("attend", ATTENDS)
def test_a_step_that_fails_half_way_leaves_every_cache_as_it_was(toy_batch, attend):
    params, caches = toy_batch
    before = [[(c.keys(i).copy(), c.values(i).copy()) for i in range(3)] for c in caches]
    calls = []

    def fails_in_layer_1(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("the student stopped the kernel")
        return attend(*args)

    with pytest.raises(KeyboardInterrupt):
        batch.batched_decode_step(params, [1, 2], caches, attend=fails_in_layer_1)
    for cache, saved in zip(caches, before):
        assert len(cache) == len(saved[0][0]) and cache.lengths == (len(saved[0][0]),) * 3
        for layer, (keys, values) in enumerate(saved):
            np.testing.assert_array_equal(cache.keys(layer), keys)
            np.testing.assert_array_equal(cache.values(layer), values)
    batch.batched_decode_step(params, [1, 2], caches)         # and it still works
    assert [len(c) for c in caches] == [4, 3]


# ---------------------------------------------------------------------------------------------
# The scheduler
# ---------------------------------------------------------------------------------------------

@st.composite
def workloads(draw, max_requests=14):
    return make_workload(
        draw(st.integers(1, max_requests)), draw(st.integers(0, 10**6)),
        draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0])),
        prompt_lengths=(1, draw(st.integers(1, 12))),
        output_lengths=(1, draw(st.integers(1, 12))))


@st.composite
def policies(draw):
    kind = draw(st.sampled_from([scheduler.StaticBatching, scheduler.ContinuousBatching]))
    size = draw(st.integers(1, 5))
    budget = draw(st.one_of(st.none(), st.integers(12 + size, 40)))
    return kind(size, budget)


def with_prompts(requests, vocab_size, seed):
    """The same requests with seeded prompts below vocab_size."""
    rng = np.random.default_rng(seed)
    return [Request(r.request_id, rng.integers(0, vocab_size, r.num_prompt_tokens).tolist(),
                    r.sampling_params, r.arrival) for r in requests]


@PROPERTY
@given(workloads(), policies())
def test_the_scheduler_keeps_its_rules(requests, policy):
    timeline = scheduler.serve(requests, policy)
    produced = {r.request_id: 0 for r in requests}
    clock, order = 0.0, []
    for step in timeline.steps:
        assert step.start >= clock and step.duration == 1.0
        clock = step.end
        assert len(step.batch) <= policy.max_batch
        assert set(step.admitted).isdisjoint(step.decoded)
        for i in step.admitted:
            assert produced[i] == 0 and timeline.requests[i].arrival <= step.start
        for i in step.decoded:
            assert produced[i] >= 1
        for i in step.batch:
            produced[i] += 1
        for i in step.finished:
            assert produced[i] == timeline.requests[i].max_tokens
        if policy.max_num_batched_tokens is not None:
            assert sum(timeline.requests[i].num_prompt_tokens for i in step.admitted) + \
                len(step.decoded) <= policy.max_num_batched_tokens
        if policy.static and step.admitted:
            assert not step.decoded                       # a new batch only when empty
        order += list(step.admitted)
        _check_no_slot_left_idle(timeline, policy, step)
    assert produced == {r.request_id: r.max_tokens for r in requests}
    arrival = {r.request_id: (r.arrival, r.request_id) for r in requests}
    assert order == sorted(order, key=arrival.get)        # first come, first served
    for r in requests:
        assert timeline.time_to_first_token(r.request_id) >= 1
        assert timeline.latency(r.request_id) == timeline.time_to_first_token(r.request_id) + \
            r.max_tokens - 1
        assert timeline.time_per_output_token(r.request_id) in (None, 1.0)
        assert not r.output_token_ids and r.status == "waiting"   # served copies, not these
    summary = timeline.summary()
    assert summary["steps"] == len(timeline.steps)
    assert 0 < summary["mean_occupancy"] <= 1
    assert summary["throughput"] == pytest.approx(timeline.output_tokens / timeline.makespan)
    assert summary["tokens_per_step_run"] == pytest.approx(
        timeline.output_tokens / len(timeline.steps))
    assert summary["makespan"] >= summary["steps"]          # idle steps are in the makespan


def _check_no_slot_left_idle(timeline, policy, step):
    """Continuous batching: when a step leaves a slot free while a request waits, the head
    of the queue did not fit the token budget."""
    if policy.static:
        return
    waiting = [r for r in timeline.requests.values()
               if r.arrival <= step.start and timeline.admitted_at(r.request_id) > step.start]
    if waiting and len(step.batch) < policy.max_batch:
        head = min(waiting, key=lambda r: (r.arrival, r.request_id))
        left = policy.max_num_batched_tokens - len(step.decoded) - sum(
            timeline.requests[i].num_prompt_tokens for i in step.admitted)
        assert head.num_prompt_tokens > left


def test_the_lessons_workload_and_its_numbers():
    requests = make_workload(12, seed=0)
    assert [(repr(r), r.prompt_token_ids) for r in requests] == \
        [(repr(r), r.prompt_token_ids) for r in make_workload(12, seed=0)]      # seeded
    static = scheduler.serve(requests, scheduler.StaticBatching(4)).summary()
    continuous = scheduler.serve(requests, scheduler.ContinuousBatching(4)).summary()
    assert (static["steps"], continuous["steps"]) == (46, 36)          # steps run
    assert (static["makespan"], continuous["makespan"]) == (55, 47)    # to the last token
    assert (static["mean_ttft"], continuous["max_ttft"]) == (4.25, 5)
    assert continuous["throughput"] > static["throughput"]


@PROPERTY
@given(workloads(), policies())
def test_the_batching_lesson_is_the_engines_scheduler(requests, policy):
    """serve() with a policy and the Engine (or the StaticBatchingEngine) with the same
    options admit every request at the same step and give it the same tokens."""
    params = kvlib.init_params(kvlib.ModelConfig(context_length=48), seed=1)
    timeline = scheduler.serve(requests, policy, scheduler.ModelRunner(params))
    engine = (StaticBatchingEngine if policy.static else Engine)(
        params, block_size=4, n_blocks=200, max_num_seqs=policy.max_batch,
        max_num_batched_tokens=policy.max_num_batched_tokens or 10**6,
        enable_chunked_prefill=False, enable_prefix_caching=False)
    pending, ids = sorted(requests, key=lambda r: (r.arrival, r.request_id)), {}
    steps_run = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending[0].arrival > \
                timeline.steps[steps_run].start:
            raise AssertionError("the engine idles where serve() does not")
        while pending and pending[0].arrival <= timeline.steps[min(steps_run, len(
                timeline.steps) - 1)].start:
            request = pending.pop(0)
            ids[request.request_id] = engine.add_request(request.prompt_token_ids,
                                                         request.sampling_params)
        engine.step()
        assert sorted(engine.last_step.scheduled_tokens) == sorted(
            ids[i] for i in timeline.steps[steps_run].batch)
        steps_run += 1
    assert steps_run == len(timeline.steps)
    for r in requests:
        assert engine.requests[ids[r.request_id]].output_token_ids == \
            timeline.requests[r.request_id].output_token_ids


@PROPERTY
@given(models(latent=False, window=False), workloads(max_requests=6), policies(),
       st.booleans())
def test_served_by_a_model_every_request_gets_its_own_tokens(model, requests, policy, paged):
    params, config = model
    requests = with_prompts(requests, config.vocab_size, seed=3)
    pool = BlockAllocator(config, n_blocks=200, block_size=3)
    runner = scheduler.ModelRunner(
        params, attend=batch.attend_padded if paged else batch.attend_per_sequence,
        make_cache=(lambda r: PagedKVCache(pool)) if paged else None)
    counted = scheduler.serve(requests, policy)
    timeline = scheduler.serve(requests, policy, runner)
    assert [s.batch for s in timeline.steps] == [s.batch for s in counted.steps]
    for r in requests:
        assert timeline.requests[r.request_id].output_token_ids == \
            kvlib.generate(params, r.prompt_token_ids, r.max_tokens)
    assert not runner.caches and pool.n_free == pool.n_blocks      # every cache given back


def test_on_a_clock_of_seconds_the_steps_last_what_the_model_took():
    params = kvlib.init_params(kvlib.ModelConfig(context_length=48))
    requests = arrivals_in_seconds(make_workload(6, seed=2), 1e-4)
    runner = scheduler.ModelRunner(params)
    timeline = scheduler.serve(requests, scheduler.ContinuousBatching(3), runner,
                               clock="seconds")
    assert [s.duration for s in timeline.steps] == pytest.approx(runner.step_seconds)
    assert all(s > 0 for s in runner.step_seconds)
    for r in requests:
        assert timeline.requests[r.request_id].output_token_ids == \
            kvlib.generate(params, r.prompt_token_ids, r.max_tokens)


def request(request_id, arrival, prompt_length, output_length):
    return Request(request_id, [1] * prompt_length, SamplingParams(max_tokens=output_length),
                   arrival)


@pytest.mark.parametrize("call, words", [
    (lambda: request(0, 0, 3, 0), "max_tokens"),
    (lambda: make_workload(0), "n_requests"),
    (lambda: make_workload(3, seed=-1), "seed"),
    (lambda: make_workload(3, mean_gap=-1), "mean_gap"),
    (lambda: make_workload(3, mean_gap=float("inf")), "mean_gap"),
    (lambda: make_workload(3, output_lengths=7.5), "output_lengths"),
    (lambda: scheduler.StaticBatching(0), "max_num_seqs"),
    (lambda: scheduler.ContinuousBatching(4, max_batched_tokens=3), "at least max_batch"),
    (lambda: scheduler.serve([], scheduler.StaticBatching(2)), "non-empty list"),
    (lambda: scheduler.serve(["request"], scheduler.StaticBatching(2)), "list of kvlib"),
    (lambda: scheduler.serve(make_workload(2), "static"), "policy must be"),
    (lambda: scheduler.serve(make_workload(2), scheduler.StaticBatching(2), clock="hours"),
     "clock"),
    (lambda: scheduler.serve([request(0, 0, 3, 3), request(0, 1, 3, 3)],
                             scheduler.StaticBatching(2)), "unique"),
    (lambda: scheduler.serve([request(0, 0, 30, 3)], scheduler.ContinuousBatching(2, 20)),
     "could never be prefilled"),
    (lambda: arrivals_in_seconds(make_workload(2), 0), "seconds_per_step"),
])
def test_the_scheduler_refuses_bad_input_in_words(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()


# ---------------------------------------------------------------------------------------------
# The widget and the plain figures
# ---------------------------------------------------------------------------------------------

def artist_count(figure):
    return sum(len(ax.lines) + len(ax.texts) + len(ax.patches) + len(ax.collections)
               for ax in figure.axes), len(figure.axes)


def bar_spans(collection):
    """(row, start, end) of every bar of a PolyCollection of rectangles."""
    spans = []
    for path in collection.get_paths():
        corners = path.vertices
        spans.append((round(float(corners[:4, 1].mean())), float(corners[0, 0]),
                      float(corners[1, 0])))
    return sorted(spans)


def test_the_gantt_bars_are_the_timelines():
    widget = w21.timeline_explorer()
    static, continuous = widget.state["static"], widget.state["continuous"]
    for ax, timeline in ((widget.state["drawn"]["static"], static),
                         (widget.state["drawn"]["continuous"], continuous)):
        expected = w21.timeline_bars(timeline)
        for collection, name in zip(ax.collections, ("waiting", "prefill", "decode")):
            drawn = bar_spans(collection)
            assert drawn == sorted((i, float(a), float(b)) for i, a, b in expected[name]
                                   if b > a)
    edges, values = w21.occupancy_curve(continuous, widget.state["drawn"]["end"])
    [line] = [line for line in widget.state["drawn"]["occupancy"].lines
              if line.get_label() == "continuous"]
    np.testing.assert_array_equal(line.get_xdata(), edges)
    assert values.max() == continuous.occupancy.max() <= 4


def test_moving_through_time_moves_the_line_and_the_status():
    widget = w21.timeline_explorer()
    widget.controls["time"].value = 12
    assert "static batching has 2 of 4 slots busy, 3 waiting" in widget.status.value
    assert "continuous batching has 3 of 4 slots busy, 0 waiting" in widget.status.value
    for ax in widget.figure.axes:
        now_lines = [line for line in ax.lines if list(line.get_xdata()) == [12, 12]]
        assert len(now_lines) == 1
    widget.play.value = 30                                  # the play button drives time
    assert widget.controls["time"].value == 30
    assert "At time 30" in widget.status.value
    summary = widget.state["continuous"].summary()
    assert f"continuous {summary['steps']} steps" in widget.status.value


def test_the_status_is_computed_not_written():
    widget = w21.timeline_explorer(max_batch=2)
    assert "1 of 2 slots busy" in widget.status.value
    widget.controls["max_batch"].value = 8
    assert widget.state["static"].policy.max_batch == 8
    assert "of 8 slots busy" in widget.status.value
    widget.controls["mean_gap"].value = 0.0                # every request at step 0
    requests = widget.state["requests"]
    assert all(r.arrival == 0 for r in requests)


def test_a_new_workload_redraws_in_place_without_leaks():
    widget = w21.timeline_explorer()
    before = plt.get_fignums()
    count = artist_count(widget.figure)
    for step in range(12):
        widget.controls["seed"].value = step
        widget.controls["requests"].value = 2 + (5 * step) % 23
        widget.controls["max_batch"].value = 1 + step % 8
        widget.controls["time"].value = (7 * step) % (widget.controls["time"].max + 1)
        assert artist_count(widget.figure) == count
    assert plt.get_fignums() == before
    end = widget.state["drawn"]["end"]
    assert widget.controls["time"].max == int(end) and widget.play.max == int(end)


@pytest.mark.parametrize("bad", [-1, -10**30])
def test_a_negative_seed_cannot_be_typed_and_freezes_nothing(bad):
    # the box holds 0 to MAX_SEED (its front end clamps as its Python side does); a seed of
    # -1 once froze every other control
    widget = w21.timeline_explorer(seed=3)
    widget.controls["seed"].value = bad
    assert widget.controls["seed"].value == 0 and widget.message.value == ""
    widget.controls["max_batch"].value = 2
    assert "of 2 slots busy" in widget.status.value
    widget.controls["seed"].value = 10**12
    assert widget.controls["seed"].value == w21.MAX_SEED
    widget.controls["requests"].value = 5
    assert len(widget.state["requests"]) == 5


def test_a_refused_workload_is_said_in_words_and_put_back(monkeypatch):
    """Whatever the workload refuses (here: a stand-in that refuses seed 7) is explained in
    the message line, the refused value goes back to the last good one, and every other
    control keeps working."""
    widget = w21.timeline_explorer(seed=3)
    real = w21.workloads.make_workload

    def refusing(count, seed, gap):
        if seed == 7:
            raise ValueError("seed 7 is refused here")
        return real(count, seed, gap)

    monkeypatch.setattr(w21.workloads, "make_workload", refusing)
    status = widget.status.value
    widget.controls["seed"].value = 7
    assert "seed 7 is refused here" in widget.message.value
    assert widget.controls["seed"].value == 3 and widget.status.value == status
    widget.controls["max_batch"].value = 2                 # not frozen
    assert "of 2 slots busy" in widget.status.value and widget.message.value == ""
    assert widget.state["static"].policy.max_batch == 2


def test_the_status_names_each_number_by_its_clock():
    widget = w21.timeline_explorer()
    text = text_of(widget.status.value)
    assert ("static 46 steps run (1.93 tokens a step run), makespan 55 steps (1.62 tokens a "
            "makespan step)") in text
    assert ("continuous 36 steps run (2.47 tokens a step run), makespan 47 steps (1.89 "
            "tokens a makespan step)") in text
    assert "46 steps, 1.62 tokens a step" not in text         # two clocks in one phrase
    titles = [widget.state["drawn"][name].get_title() for name in ("static", "continuous")]
    assert "46 steps run (1.93 tokens a step run), makespan 55 steps" in titles[0]
    assert "36 steps run (2.47 tokens a step run), makespan 47 steps" in titles[1]


def test_a_move_through_time_draws_only_the_moving_parts(monkeypatch):
    """A move through time (the play button's every tick) puts back the kept picture and
    draws the 'now' lines and covers over it: the whole figure is drawn only for a new
    workload, and the picture equals a whole draw, pixel for pixel."""
    widget = w21.timeline_explorer()
    canvas = widget.figure.canvas
    whole_draws = []
    real_draw = canvas.draw
    monkeypatch.setattr(canvas, "draw", lambda: whole_draws.append(1) or real_draw())
    with no_new_figures():
        for now in (12, 30, 0, 55, 7):
            widget.controls["time"].value = now
            shown = np.asarray(canvas.buffer_rgba()).copy()
            assert whole_draws == []
            real_draw()                                        # the whole figure, drawn anew
            np.testing.assert_array_equal(shown, np.asarray(canvas.buffer_rgba()))
        widget.controls["seed"].value = 5                      # a new workload: one whole draw
        assert whole_draws == [1]
        widget.controls["time"].value = 3
        assert whole_draws == [1]
    # shown as rendered, not cropped to a tight box: every label lies inside the figure
    drawn = widget.figure.get_tightbbox(canvas.get_renderer())
    width, height = widget.figure.get_size_inches()
    assert drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= width and drawn.y1 <= height


def test_draw_timelines_needs_timelines():
    with pytest.raises(TypeError, match="two Timelines"):
        w21.draw_timelines(plt.figure(), "static", None)


def test_the_plain_figures_show_kvlibs_numbers():
    fig, ax = plt.subplots()
    visible = w21.draw_padded_caches(ax, [6, 4, 10])
    np.testing.assert_array_equal(visible, batch.padding_mask([6, 4, 10]))
    assert sum(text.get_text() == "pad" for text in ax.texts) == 10
    assert ax.get_xlabel() == "column of the padded cache"
    fig, ax = plt.subplots()
    w21.draw_batch_roofline(ax, [1, 2, 4], [10, 20, 30], measured=[5, 9, 20],
                            one_at_a_time=[5, 5, 5], crossover=3)
    assert [list(line.get_ydata()) for line in ax.lines[:3]] == [[10, 20, 30], [5, 9, 20],
                                                               [5, 5, 5]]
    assert ax.get_xscale() == "log" and "tokens per second" in ax.get_ylabel()
    # the crossover is named in the legend, not written over the curves
    assert not ax.texts
    assert "roofline: compute-bound from B = 3" in [t.get_text() for t in
                                                    ax.get_legend().get_texts()]


def test_the_roofline_figure_draws_the_products_alone_when_given():
    fig, ax = plt.subplots()
    w21.draw_batch_roofline(ax, [1, 2, 4], [10, 20, 30], measured=[5, 9, 20],
                            products=[6, 10, 22])
    assert [list(line.get_ydata()) for line in ax.lines] == [[10, 20, 30], [5, 9, 20],
                                                           [6, 10, 22]]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("roofline") and all(label.startswith("measured")
                                                    for label in labels[1:])


def test_the_skinny_products_figure():
    fig, ax = plt.subplots()
    w21.draw_skinny_products(ax, [1, 2, 3], [1e-4, 4e-4, 4.5e-4], contiguous=[1e-4, 3e-4, 4e-4])
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert lines["one product per row (rows x one row)"] == [1, 2, 3]
    assert lines["one read of the matrix (the memory-bound roofline)"] == [1, 1, 1]
    assert np.allclose(lines["measured: W as kvlib holds it (column-major)"], [1, 4, 4.5])
    assert np.allclose(lines["measured: a contiguous (row-major) copy of W"], [1, 3, 4])
    assert "time of one row" in ax.get_ylabel() and list(ax.get_xticks()) == [1, 2, 3]


def test_the_smollm2_measurement_is_explained_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="benchmarks/smollm2_batching.py"):
        w21.smollm2_batching(tmp_path / "nothing.json")


def test_the_notebook_reads_the_committed_smollm2_run(namespace):
    """The SmolLM2 section's figures come from benchmarks/data/smollm2_batching.json, and
    the roofline it draws is kvlib's for the rates that run measured."""
    measured = w21.smollm2_batching()
    assert namespace["measured_smol"] == measured
    assert namespace["smol_sizes"].tolist() == [1, 2, 4, 8, 16]
    assert np.allclose(namespace["smol_predicted"],
                       [row["predicted_seconds"] for row in measured["batches"]])
    assert namespace["skinny_relative"][0] == 1.0


def test_the_notebook_leaves_the_exercises_open(namespace):
    assert namespace["answer"] is ...
    assert namespace["worst"] < 1e-12
    assert namespace["last_column_right"] == [False, False, True]
    assert namespace["never_from"] == 22 and namespace["gqa_never_from"] == 125


# ---------------------------------------------------------------------------------------------
# Exercise 1: the mask of a left-padded batch
# ---------------------------------------------------------------------------------------------

MASKS = ex21._masks()


@pytest.mark.parametrize("name, words", [
    ("right padding", "padded on the RIGHT"),
    ("rows, right padding", "hides padded rows"),
    ("rows", "hid the padded ROWS"),
    ("causal only", "the padding is not hidden"),
    ("padding only", "not causal"),
    ("transposed", "rows and columns are swapped"),
    ("inverted", "True and False are swapped"),
])
def test_mask_checker_diagnoses_each_mistake(name, words):
    assert_not_yet(ex21.check_padded_mask(MASKS[name]), words)
    assert_not_yet(ex21.check_padded_mask(MASKS[name].astype(int).tolist()), words)


@pytest.mark.parametrize("answer, words", [
    (batch.padding_mask([3, 5, 2]), "the padding mask"),
    (np.ones((3, 4, 4), dtype=bool), "should have shape (3, 5, 5)"),
    (np.full((3, 5, 5), 0.5), "True/False (or 1/0)"),
    (np.where(MASKS["right"], 2, 0), "True/False"),
    (np.tri(5, dtype=bool), "should have shape (3, 5, 5)"),
])
def test_mask_checker_explains_answers_of_the_wrong_form(answer, words):
    assert_not_yet(ex21.check_padded_mask(answer), words)


def test_mask_checker_points_at_a_wrong_cell():
    answer = MASKS["right"].copy()
    answer[1, 4, 0] = False
    feedback = ex21.check_padded_mask(answer)
    assert_not_yet(feedback, "look at prompt 1, query 4, key 0")
    assert repr(feedback).startswith("Not yet: look at")          # the prefix once


@pytest.mark.parametrize("answer", [
    MASKS["right"], ex21.expected_mask(), MASKS["right"].astype(int),
    MASKS["right"].astype(float), MASKS["right"].tolist(), MASKS["right"].astype(int).tolist(),
    MASKS["right"] | ~batch.left_pad(list(ex21.PROMPTS))[1][:, :, None],   # pad rows see all
    batch.padded_prompt_mask(batch.left_pad(list(ex21.PROMPTS))[1]),
])
def test_mask_checker_accepts_every_right_form(answer):
    assert_correct(ex21.check_padded_mask(answer))


def test_mask_checker_explains_the_nan_of_empty_rows():
    feedback = ex21.check_padded_mask(MASKS["right"])
    assert "0 / 0" in feedback.message
    assert "0 / 0" not in ex21.check_padded_mask(ex21.expected_mask()).message


# ---------------------------------------------------------------------------------------------
# Exercise 2: the A100's batch size
# ---------------------------------------------------------------------------------------------

EXACT = 312 / 2.039


@pytest.mark.parametrize("answer, words", [
    (2 * EXACT, "twice the answer"), (306, "twice the answer"), (307, "twice the answer"),
    (EXACT / 2, "half the answer"), (77, "half the answer"),
    (296, "H100"), (295.2, "H100"),
    (2.039 / 312, "upside down"), (0.0065, "upside down"),
    (EXACT * 1000, "1000 times too large"), (0.153, "1000 times too small"),
    (4 * EXACT, "float32 weights counted as multiply-adds"),
    (0.5, "below one sequence"),
    (100, "How many FLOPs per byte"), (200, "How many FLOPs per byte"),
    (154.4, "a batch size is a whole number"), (153.5, "a batch size is a whole number"),
    (152.6, "whole number"), (153.2, "whole number"), (152.99, "whole number"),
    ("153", "not text: write 153 without quotes"), ([153, 154], "one number"),
    (True, "True (a bool)"), (float("nan"), "a finite number"), (10**400, "401 digits"),
    (10**5000, "about 5,001 digits"),
], ids=case_id)
def test_batch_checker_diagnoses_each_mistake(answer, words):
    assert_not_yet(ex21.check_compute_bound_batch(answer), words)


@pytest.mark.parametrize("answer", [
    153, 154, 153.0, round(EXACT, 1), round(EXACT, 2), round(EXACT, 3), 153.01, EXACT,
    np.float32(EXACT), np.int64(154), np.array(153.0), np.array([153]), [154], (153.0,),
    ex21.weights_bound_batch_size(312e12, 2.039e12),
])
def test_batch_checker_accepts_the_answer_in_every_form(answer):
    assert_correct(ex21.check_compute_bound_batch(answer))


def test_batch_checker_says_what_it_means():
    feedback = ex21.check_compute_bound_batch(154)
    assert "153.0 FLOP per byte" in feedback.message and "cache" in feedback.message


# ---------------------------------------------------------------------------------------------
# Exercise 3: which requests enter
# ---------------------------------------------------------------------------------------------

def test_the_situation_is_kvlibs_scheduler():
    assert ex21.admitted() == [4, 5] and ex21.admitted(24) == [4]
    text = ex21.situation()
    assert "start of step 7" in text and "request 7: arrives at step 8" in text


@pytest.mark.parametrize("answer, words", [
    ([], "static batching's answer"),
    ([4], "its slot is free"),
    ([4, 5, 6], "two are free"),
    ([4, 6], "shortest prompts"),
    ([5, 6], "arrived last"),
    ([4, 5, 7], "request 7 arrives at step 8"),
    ([7], "request 7 arrives at step 8"),
    ([0, 1, 4, 5], "already in the batch"),
    ([1], "is already in the batch"),
    ([3, 4], "request 3 has finished"),
    ([9], "there is no request 9"),
    ([6], "Count the free slots"),
    ([4, 4], "appears twice"),
    ("4, 5", "list of request ids"),
    (True, "not a bool"),
    ([4.5], "whole numbers"),
    ([True, 5], "not True/False"),
    (np.zeros((2, 2)), "flat list"),
    ([[4], [5]], "flat list"),
    ([10**5000], "about 5,001 digits"),
    ([4, "5"], "not text"),
    (np.where(np.array([0, 1, 1]) > 0), "flat list"),
], ids=case_id)
def test_admission_checker_diagnoses_each_mistake(answer, words):
    assert_not_yet(ex21.check_admitted(answer), words)


@pytest.mark.parametrize("answer, words", [
    # the answer of 3a, and what chunked prefill would admit: the message says both
    ([4, 5], "assumes no chunked prefill"),
    ([4, 5], "request 5's 20 do not fit in the 10 left"),
    ([4, 5], "With chunked prefill, vLLM's default, request 5 would start with a chunk of 10"),
    ([4, 6], "never lets a later request overtake"),
    ([], "static batching's answer"),
    ([5, 6], "Count the free slots"),
    ([6], "Count the free slots"),
    ([4, 7], "request 7 arrives at step 8"),
])
def test_budget_checker_diagnoses_each_mistake(answer, words):
    assert_not_yet(ex21.check_admitted_with_budget(answer), words)


@pytest.mark.parametrize("answer", [[4, 5], [5, 4], (4, 5), {4, 5}, np.array([4, 5]),
                                    [4.0, 5.0], [np.int64(5), 4], np.array([5.0, 4.0])])
def test_admission_checker_accepts_every_form(answer):
    assert_correct(ex21.check_admitted(answer))


@pytest.mark.parametrize("answer", [[4], 4, (4,), {4}, np.array([4]), np.int64(4), [4.0]])
def test_budget_checker_accepts_every_form(answer):
    assert_correct(ex21.check_admitted_with_budget(answer))


# ---------------------------------------------------------------------------------------------
# Solutions, and every checker answers anything in words
# ---------------------------------------------------------------------------------------------

def test_solutions_pass_in_the_notebooks_namespace(namespace):
    scope = dict(namespace)
    exec(ex21.SOLUTIONS[1], scope)
    assert_correct(ex21.check_padded_mask(scope["answer"]))
    exec(ex21.SOLUTIONS[2], scope)
    assert_correct(ex21.check_compute_bound_batch(scope["answer"]))
    first, second = ex21.SOLUTIONS[3].split("\n# 3b")
    exec(first, scope)
    assert_correct(ex21.check_admitted(scope["answer"]))
    exec("# 3b" + second, scope)
    assert_correct(ex21.check_admitted_with_budget(scope["answer"]))


def test_solution_display():
    shown = ex21.solution(2)
    assert "Solution to exercise 2" in shown.data and "312e12" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        ex21.solution(9)


CHECKERS = [ex21.check_padded_mask, ex21.check_compute_bound_batch, ex21.check_admitted,
            ex21.check_admitted_with_budget]


def test_unfilled_answers_say_so():
    for checker in CHECKERS:
        assert_not_yet(checker(...), "not filled in yet")
        assert_not_yet(checker(None), "not filled in yet")
    assert math.isclose(ex21.A100["bf16_flops"] / ex21.A100["bandwidth"], EXACT, rel_tol=1e-12)
