"""Gated DeltaNet beside attention (kvlib.deltanet, kvlib.hybrid, kvlib.hybrid_cache).

Against transformers 5.25 (tests/data/deltanet-reference, written by
tools/make_deltanet_reference.py; no torch here): its two kernels, one DeltaNet layer and one
gated attention layer with random weights, and the trained stories-hybrid model. "f64"
references come from transformers' module with its float32 casts made float64 and are
compared tightly; "f32" ones from the module as it is, with tolerances measured (each is
given beside it, with the error measured when it was set).

Then the cache: prefill + decode equals recomputation, the DeltaNet state does not grow,
truncate works at snapshots only, a failing call changes nothing, bad input is refused.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvlib.hybrid as hybrid
from kvlib import deltanet
from kvlib.checkpoints.hybrid import config_from_hub, load_hybrid
from kvlib.deltanet import (
    DeltaNetLayerParams,
    DeltaNetState,
    GatedAttentionLayerParams,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from kvlib.hybrid import hybrid_decode_step, hybrid_forward, hybrid_generate, hybrid_prefill
from kvlib.hybrid_cache import HybridCache
from kvlib.positions import RotaryPositions
from kvlib.stories.corpus import HELD_OUT_SEED, story_sequences

REFERENCE = Path(__file__).parent / "data" / "deltanet-reference" / "reference.npz"
MEASURED = Path(deltanet.__file__).parent / "models" / "stories-hybrid" / "measured.json"
KERNEL_CASES = ("one_token", "grouped", "three_chunks", "one_chunk")


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE) as data:
        return dict(data)


@pytest.fixture(scope="module")
def model():
    return load_hybrid("stories-hybrid")


@pytest.fixture(scope="module")
def model64():
    return load_hybrid("stories-hybrid", dtype="float64")


def random_inputs(rng, T, hk, hv, dk, dv, dtype=np.float64):
    """query, key, value, g, beta of one sequence."""
    arrays = (rng.normal(size=(T, hk, dk)), rng.normal(size=(T, hk, dk)),
              rng.normal(size=(T, hv, dv)), -rng.uniform(0.0, 2.0, size=(T, hv)),
              rng.uniform(0.0, 1.0, size=(T, hv)))
    return tuple(a.astype(dtype) for a in arrays)


# ----------------------------------------------------------------------------- the two kernels

@settings(max_examples=60, deadline=None)
@example(T=1, hk=1, served=1, dk=4, dv=4, chunk=64, with_state=False, seed=0)
@example(T=1, hk=2, served=2, dk=3, dv=5, chunk=1, with_state=True, seed=1)
@example(T=130, hk=2, served=2, dk=8, dv=8, chunk=64, with_state=True, seed=2)
@example(T=64, hk=1, served=1, dk=8, dv=8, chunk=64, with_state=False, seed=3)
@given(T=st.integers(1, 150), hk=st.integers(1, 2), served=st.integers(1, 2),
       dk=st.integers(1, 9), dv=st.integers(1, 9), chunk=st.integers(1, 70),
       with_state=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_recurrent_and_chunked_forms_agree(T, hk, served, dk, dv, chunk, with_state, seed):
    rng = np.random.default_rng(seed)
    inputs = random_inputs(rng, T, hk, hk * served, dk, dv)
    state = rng.normal(size=(hk * served, dk, dv)) if with_state else None
    out_r, state_r = recurrent_gated_delta_rule(*inputs, initial_state=state)
    out_c, state_c = chunked_gated_delta_rule(*inputs, initial_state=state, chunk_size=chunk)
    # measured: at most 5e-15 over 300 such draws
    np.testing.assert_allclose(out_c, out_r, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state_c, state_r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", [recurrent_gated_delta_rule, chunked_gated_delta_rule])
def test_the_final_state_continues_the_sequence(kernel):
    rng = np.random.default_rng(1)
    inputs = random_inputs(rng, 50, 2, 4, 8, 8)
    whole, whole_state = kernel(*inputs)
    first, state = kernel(*(x[:30] for x in inputs))
    rest, final = kernel(*(x[30:] for x in inputs), initial_state=state)
    np.testing.assert_allclose(np.concatenate([first, rest]), whole, atol=1e-12)
    np.testing.assert_allclose(final, whole_state, atol=1e-12)


@pytest.mark.parametrize("kernel", [recurrent_gated_delta_rule, chunked_gated_delta_rule])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_keep_the_dtype_and_leave_inputs_alone(kernel, dtype):
    rng = np.random.default_rng(2)
    inputs = random_inputs(rng, 70, 1, 2, 4, 4, dtype)
    state = rng.normal(size=(2, 4, 4)).astype(dtype)
    copies = [x.copy() for x in (*inputs, state)]
    output, final = kernel(*inputs, initial_state=state)
    assert output.dtype == dtype and final.dtype == dtype
    for before, after in zip(copies, (*inputs, state)):
        np.testing.assert_array_equal(before, after)


def test_a_state_is_a_fixed_size_memory():
    """With beta = 1 and no decay, a key written once reads back its value exactly (the
    delta rule overwrites rather than adds); writing the same key again replaces it."""
    key = np.array([[[1.0, 0.0, 0.0]]])
    inputs = (np.repeat(key, 3, 0), np.repeat(key, 3, 0),
              np.array([[[2.0, 5.0]], [[7.0, -1.0]], [[7.0, -1.0]]]),
              np.zeros((3, 1)), np.ones((3, 1)))
    output, state = recurrent_gated_delta_rule(*inputs)
    scale = 1 / np.sqrt(3)   # q is scaled by d_k^-0.5
    # rtol: the L2 norm's epsilon makes |k|^2 = 1 / (1 + 1e-6)
    np.testing.assert_allclose(output[:, 0] / scale, [[2.0, 5.0], [7.0, -1.0], [7.0, -1.0]],
                               rtol=1e-5)
    np.testing.assert_allclose(state[0, 0], [7.0, -1.0], rtol=1e-5)


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("name, kernel", [("recurrent", recurrent_gated_delta_rule),
                                          ("chunked", chunked_gated_delta_rule)])
def test_kernels_equal_transformers(reference, case, name, kernel):
    ref = {key.split(".", 2)[2]: value for key, value in reference.items()
           if key.startswith(f"kernel.{case}.")}
    inputs = [ref[n] for n in ("query", "key", "value", "g", "beta")]
    options = {"initial_state": ref.get("initial_state")}
    if name == "chunked":
        options["chunk_size"] = int(ref["chunk_size"])
    output, state = kernel(*inputs, **options)
    # f64: transformers' code in float64; measured 4.4e-16
    np.testing.assert_allclose(output, ref[f"f64_{name}_output"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(state, ref[f"f64_{name}_state"], rtol=0, atol=1e-12)
    as32 = {k: None if v is None else v.astype(np.float32) for k, v in options.items()
            if k != "chunk_size"}
    output, state = kernel(*(x.astype(np.float32) for x in inputs),
                           **as32, **{k: v for k, v in options.items() if k == "chunk_size"})
    # f32: transformers as it is; measured 1.9e-6 (outputs up to 0.95, states up to 1.7)
    np.testing.assert_allclose(output, ref[f"f32_{name}_output"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(state, ref[f"f32_{name}_state"], rtol=0, atol=1e-5)


def test_the_float64_reference_is_transformers_float32_code(reference):
    """The float64 edit of transformers' module changed dtypes only: its results are the
    untouched module's, up to float32 rounding."""
    for case in KERNEL_CASES:
        for kernel in ("recurrent", "chunked"):
            key = f"kernel.{case}.f{{}}_{kernel}_output"
            np.testing.assert_allclose(reference[key.format(32)], reference[key.format(64)],
                                       rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(reference["model.f32_logits"][list(reference["model.f64_rows"])],
                               reference["model.f64_logits_rows"], atol=1e-3)


# ----------------------------------------------------------------------------- single layers

def layer_config(reference, dtype="float64"):
    sizes = json.loads(str(reference["layers.config"]))
    return config_from_hub({**sizes, "model_type": "qwen3_next", "tie_word_embeddings": True},
                           dtype)


def deltanet_layer(reference, config):
    """The random layer's weights in kvlib's layout: (in, out) matrices, conv (C, K); the
    block's norms and MLP, which the mixer does not use, as zeros."""
    w = {k.split(".", 1)[1]: v.astype(config.dtype) for k, v in reference.items()
         if k.startswith("deltanet.") and k.endswith(("weight", "A_log", "dt_bias"))}
    shapes = DeltaNetLayerParams.expected_shapes(config)
    unused = {name: np.zeros(shapes[name], config.dtype)
              for name in ("input_norm", "post_norm", "W_gate", "W_up", "W_down")}
    return DeltaNetLayerParams(
        in_proj_qkvz=w["in_proj_qkvz.weight"].T, in_proj_ba=w["in_proj_ba.weight"].T,
        conv_weight=w["conv1d.weight"][:, 0], A_log=w["A_log"], dt_bias=w["dt_bias"],
        out_norm=w["norm.weight"], out_proj=w["out_proj.weight"].T, **unused)


def attention_layer(reference, config):
    w = {k.split(".", 1)[1]: v.astype(config.dtype) for k, v in reference.items()
         if k.startswith("attention.") and k.endswith("weight")}
    shapes = GatedAttentionLayerParams.expected_shapes(config)
    unused = {name: np.zeros(shapes[name], config.dtype)
              for name in ("input_norm", "post_norm", "W_gate", "W_up", "W_down")}
    return GatedAttentionLayerParams(
        Wq=w["q_proj.weight"].T, Wk=w["k_proj.weight"].T, Wv=w["v_proj.weight"].T,
        Wo=w["o_proj.weight"].T, q_norm=w["q_norm.weight"], k_norm=w["k_norm.weight"],
        **unused)


# (dtype, tolerance): f64 measured 9e-16, f32 9.5e-7, on outputs and states up to 3.4
LAYER_TOLERANCES = [("float64", 1e-12), ("float32", 5e-6)]


@pytest.mark.parametrize("dtype, tolerance", LAYER_TOLERANCES)
def test_deltanet_layer_equals_transformers(reference, dtype, tolerance):
    config = layer_config(reference, dtype)
    layer = deltanet_layer(reference, config)
    v = "f64" if dtype == "float64" else "f32"
    state = DeltaNetState.zeros(config)
    for part in ("", "step_", "more_"):       # prompt, one decode token, a chunk after it
        x = reference[f"deltanet.x{'_' + part[:-1] if part else ''}"].astype(dtype)
        output, state = deltanet.deltanet_mixer(x, layer, config, state)
        assert output.dtype == dtype
        np.testing.assert_allclose(output, reference[f"deltanet.{v}_{part}output"],
                                   rtol=0, atol=tolerance)
        # transformers keeps K inputs for the convolution; the last K - 1 are the state
        np.testing.assert_allclose(state.conv, reference[f"deltanet.{v}_{part}conv_state"][:, 1:].T,
                                   rtol=0, atol=tolerance)
        np.testing.assert_allclose(state.recurrent,
                                   reference[f"deltanet.{v}_{part}recurrent_state"],
                                   rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", LAYER_TOLERANCES)
def test_gated_attention_layer_equals_transformers(reference, dtype, tolerance):
    config = layer_config(reference, dtype)
    layer = attention_layer(reference, config)
    v = "f64" if dtype == "float64" else "f32"
    x, x_step = (reference[f"attention.{n}"].astype(dtype) for n in ("x", "x_step"))
    cache = HybridCache(config)
    T = len(x)
    rotary = RotaryPositions(np.arange(T), config.rotary_dim, config.rope_base, "half")
    output = deltanet.gated_attention_mixer(x, layer, config, rotary, cache.kv, 0)
    np.testing.assert_allclose(output, reference[f"attention.{v}_output"], rtol=0,
                               atol=tolerance)
    rotary = RotaryPositions(np.array([T]), config.rotary_dim, config.rope_base, "half")
    output = deltanet.gated_attention_mixer(x_step, layer, config, rotary, cache.kv, 0)
    assert output.dtype == dtype
    np.testing.assert_allclose(output, reference[f"attention.{v}_step_output"],
                               rtol=0, atol=tolerance)


def test_qwen3_next_norms_add_one_to_their_weight_except_the_gated_one():
    X = np.array([[3.0, -4.0]])                     # root mean square sqrt(12.5)
    normalised = X / np.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(deltanet.offset_rms_norm(X, np.zeros(2), 1e-6), normalised)
    silu_of_2 = 2.0 / (1.0 + np.exp(-2.0))
    np.testing.assert_allclose(deltanet.gated_rms_norm(X, np.full((1, 2), 2.0), np.ones(2),
                                                       1e-6), normalised * silu_of_2)


# ----------------------------------------------------------------------------- the trained model

def test_model_logits_equal_transformers(reference, model, model64):
    prompt = reference["model.prompt"]
    logits = hybrid_forward(model, prompt)
    assert logits.dtype == np.float32
    # f32: measured 9.5e-6 on logits up to 23
    np.testing.assert_allclose(logits, reference["model.f32_logits"], rtol=0, atol=1e-4)
    rows = list(reference["model.f64_rows"])
    # f64: measured 1.1e-14
    np.testing.assert_allclose(hybrid_forward(model64, prompt)[rows],
                               reference["model.f64_logits_rows"], rtol=0, atol=1e-11)


def test_model_states_after_the_prompt_equal_transformers(reference, model, model64):
    prompt = reference["model.prompt"]
    _, cache = hybrid_prefill(model, prompt)
    _, cache64 = hybrid_prefill(model64, prompt)
    for i in model.config.deltanet_layers:
        # measured: conv 1.9e-6 (inputs up to 8.3), recurrent 6e-8 in f32 (up to 0.15),
        # 1.7e-16 in f64
        np.testing.assert_allclose(cache.state(i).conv,
                                   reference[f"model.f32_conv_state_{i}"][:, 1:].T, atol=1e-5)
        np.testing.assert_allclose(cache.state(i).recurrent,
                                   reference[f"model.f32_recurrent_state_{i}"], atol=1e-6)
        if f"model.f64_recurrent_state_{i}" in reference:
            np.testing.assert_allclose(cache64.state(i).recurrent,
                                       reference[f"model.f64_recurrent_state_{i}"], atol=1e-11)
    for i in model.config.attention_layers:
        for ours, theirs in ((cache.keys(i), "keys"), (cache.values(i), "values")):
            rows = reference[f"model.f32_{theirs}_{i}"].transpose(1, 0, 2).reshape(len(prompt),
                                                                                   -1)
            np.testing.assert_allclose(ours, rows, atol=2e-5)     # measured 2.4e-6


def test_greedy_decoding_equals_transformers(reference, model):
    prompt = reference["model.prompt"]
    greedy = reference["model.greedy"].tolist()
    assert hybrid_generate(model, prompt, len(greedy)) == greedy
    logits, cache = hybrid_prefill(model, prompt)
    rows = [logits[-1]]
    for token in greedy[:-1]:
        rows.append(hybrid_decode_step(model, token, cache)[0])
    np.testing.assert_allclose(np.stack(rows), reference["model.f32_decode_logits"],
                               atol=1e-4)                               # measured 6.4e-6


def test_measured_held_out_loss_is_the_numpy_models(model):
    """measured.json's loss on the first 16 held-out stories, recomputed here in numpy."""
    measured = json.loads(MEASURED.read_text(encoding="utf-8"))
    sequences = story_sequences(16, HELD_OUT_SEED)
    losses = []
    for ids in sequences:
        logits = hybrid_forward(model, ids)[:-1].astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        losses.append(-log_p[np.arange(len(ids) - 1), ids[1:]])
    assert abs(np.mean(losses) - measured["held_out_loss_first_16"]) < 2e-4
    assert measured["parameters"] == sum(
        a.size for a in (model.embedding, model.final_norm)) + sum(
        getattr(layer, f).size for layer in model.layers for f in layer.expected_shapes(
            model.config))


# ----------------------------------------------------------------------------- the hybrid cache

PROMPTS = [story_sequences(1, seed)[0, :length] for seed, length in ((3, 5), (4, 63), (5, 90))]
"""Prompts the reference did not use; 63 and 90 tokens end inside and past the first chunk."""


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}-tokens")
def test_prefill_and_decode_equal_recomputation(model64, prompt):
    continuation = story_sequences(1, 6)[0, :12]
    logits, cache = hybrid_prefill(model64, prompt)
    rows = [logits]
    for token in continuation:
        rows.append(hybrid_decode_step(model64, token, cache))
    full = hybrid_forward(model64, np.concatenate([prompt, continuation]))
    # measured 1.4e-14: the chunked and the recurrent forms differ by rounding only
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=1e-10)
    assert len(cache) == len(prompt) + len(continuation)


def test_prefill_in_pieces_equals_prefill_at_once(model64):
    ids = PROMPTS[2]
    at_once, cache_at_once = hybrid_prefill(model64, ids)
    first, cache = hybrid_prefill(model64, ids[:40])
    second, cache = hybrid_prefill(model64, ids[40:], cache)
    np.testing.assert_allclose(np.concatenate([first, second]), at_once, atol=1e-10)
    for i in model64.config.deltanet_layers:
        np.testing.assert_allclose(cache.state(i).recurrent, cache_at_once.state(i).recurrent,
                                   atol=1e-12)


def test_state_bytes_stay_flat_and_attention_bytes_grow(model):
    config = model.config
    cache = HybridCache(config)
    _, cache = hybrid_prefill(model, PROMPTS[0], cache)
    kv_row = 2 * config.n_kv_heads * config.head_dim * 4          # K and V, float32
    state = (config.conv_kernel - 1) * config.conv_dim + config.linear_value_heads * \
        config.linear_key_dim * config.linear_value_dim
    for _ in range(3):
        assert cache.state_nbytes == 4 * state * len(config.deltanet_layers)
        assert cache.kv_nbytes == kv_row * len(config.attention_layers) * len(cache)
        assert cache.nbytes == cache.state_nbytes + cache.kv_nbytes
        hybrid_prefill(model, PROMPTS[1], cache)


def test_truncate_needs_a_snapshot(model):
    _, cache = hybrid_prefill(model, PROMPTS[1])
    length, nbytes, state = len(cache), cache.nbytes, cache.state(0)
    with pytest.raises(ValueError, match="cannot be taken out of it.*snapshot"):
        cache.truncate(40)
    assert (len(cache), cache.nbytes) == (length, nbytes) and cache.state(0) is state
    cache.truncate(len(cache))                     # nothing to forget
    assert len(cache) == len(PROMPTS[1])
    with pytest.raises(ValueError, match="holds 63"):
        cache.truncate(64)
    cache.truncate(0)
    assert len(cache) == 0 and cache.kv_nbytes == 0
    np.testing.assert_array_equal(cache.state(0).recurrent, 0)


def test_rollback_to_a_snapshot_equals_never_going_past_it(model):
    ids = PROMPTS[2]
    cache = HybridCache(model.config, snapshot_every=16)
    logits, _ = hybrid_prefill(model, ids[:50], cache)
    np.testing.assert_allclose(logits, hybrid_forward(model, ids[:50]), atol=1e-4)
    assert cache.snapshot_positions == (16, 32, 48)
    assert cache.snapshot_nbytes == 3 * cache.state_nbytes
    for token in ids[50:70]:                       # 20 tokens we will take back
        hybrid_decode_step(model, token, cache)
    assert cache.snapshot_positions == (16, 32, 48, 64)
    cache.truncate(32)
    assert len(cache) == 32 and cache.snapshot_positions == (16, 32)
    _, fresh = hybrid_prefill(model, ids[:32])
    assert hybrid_generate(model, ids[32:40], 10, cache) == \
        hybrid_generate(model, ids[32:40], 10, fresh)


def test_a_snapshot_lets_another_prompt_reuse_the_prefix(model):
    shared = PROMPTS[2][:32]
    first = np.concatenate([shared, PROMPTS[1][:20]])
    second = np.concatenate([shared, PROMPTS[0]])
    cache = HybridCache(model.config, snapshot_every=16)
    hybrid_prefill(model, first, cache)
    cache.truncate(32)                             # the shared prefix, computed once
    tail, cache = hybrid_prefill(model, second[32:], cache)
    np.testing.assert_allclose(tail, hybrid_prefill(model, second)[0][32:], atol=1e-4)


def test_snapshot_now_allows_a_speculative_rollback(model):
    _, cache = hybrid_prefill(model, PROMPTS[1])
    cache.snapshot()
    expected = hybrid_decode_step(model, 5, cache)
    for token in (7, 9, 11):                       # a draft that is rejected
        hybrid_decode_step(model, token, cache)
    cache.truncate(len(PROMPTS[1]))
    np.testing.assert_array_equal(hybrid_decode_step(model, 5, cache), expected)


class Boom(Exception):
    pass


def failing_on_call(n: int, failure: type):
    """A stand-in for the attention mixer (the last layer, after the DeltaNet layers have
    replaced their states) that works n - 1 times, then raises."""
    calls = []
    real = hybrid.gated_attention_mixer

    def mixer(*args, **kwargs):
        calls.append(1)
        if len(calls) >= n:
            raise failure()
        return real(*args, **kwargs)
    return mixer


@pytest.mark.parametrize("failure", [Boom, KeyboardInterrupt])
def test_a_failing_call_changes_nothing(model, monkeypatch, failure):
    _, untouched = hybrid_prefill(model, PROMPTS[1])
    expected = hybrid_decode_step(model, 5, untouched)
    _, cache = hybrid_prefill(model, PROMPTS[1])
    states = {i: cache.state(i) for i in model.config.deltanet_layers}
    keys, nbytes = cache.keys(3).copy(), cache.nbytes
    monkeypatch.setattr(hybrid, "gated_attention_mixer", failing_on_call(1, failure))
    for call in (lambda: hybrid_decode_step(model, 5, cache),
                 lambda: hybrid_prefill(model, PROMPTS[0], cache)):
        with pytest.raises(failure):
            call()
        assert len(cache) == len(PROMPTS[1]) and cache.nbytes == nbytes
        assert all(cache.state(i) is states[i] for i in states)
        np.testing.assert_array_equal(cache.keys(3), keys)
    monkeypatch.undo()
    np.testing.assert_array_equal(hybrid_decode_step(model, np.int64(5), cache), expected)


def test_a_prefill_failing_after_a_snapshot_leaves_none(model, monkeypatch):
    cache = HybridCache(model.config, snapshot_every=16)
    states = {i: cache.state(i) for i in model.config.deltanet_layers}
    monkeypatch.setattr(hybrid, "gated_attention_mixer", failing_on_call(3, Boom))
    with pytest.raises(Boom):                      # in the third piece of 16 tokens
        hybrid_prefill(model, PROMPTS[2], cache)
    assert len(cache) == 0 and cache.snapshot_positions == () and cache.kv_nbytes == 0
    assert all(cache.state(i) is states[i] for i in states)


# ----------------------------------------------------------------------------- bad input

def test_kernels_refuse_bad_input():
    rng = np.random.default_rng(3)
    q, k, v, g, beta = random_inputs(rng, 6, 1, 2, 4, 4)
    with pytest.raises(ValueError, match="query .* and key .* must be"):
        recurrent_gated_delta_rule(q, k[:, :, :3], v, g, beta)
    with pytest.raises(ValueError, match="query must be a 3-D array"):
        chunked_gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(ValueError, match=r"g \(6, 1\) and beta"):
        chunked_gated_delta_rule(q, k, v, g[:, :1], beta)
    with pytest.raises(TypeError, match="query must be float32 or float64, got dtype int64"):
        recurrent_gated_delta_rule(q.astype(np.int64), k, v, g, beta)
    with pytest.raises(TypeError, match="value is float32 but query is float64"):
        recurrent_gated_delta_rule(q, k, v.astype(np.float32), g, beta)
    with pytest.raises(ValueError, match="g must be <= 0"):
        chunked_gated_delta_rule(q, k, v, -g, beta)
    with pytest.raises(ValueError, match="initial_state must be"):
        chunked_gated_delta_rule(q, k, v, g, beta, initial_state=np.zeros((2, 4, 5)))
    with pytest.raises(ValueError, match="chunk_size must be at least 1"):
        chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


def test_mixers_refuse_bad_input(reference):
    config = layer_config(reference, "float32")
    layer, state = deltanet_layer(reference, config), DeltaNetState.zeros(config)
    x = reference["deltanet.x"]
    with pytest.raises(TypeError, match="X is float64 but the model"):
        deltanet.deltanet_mixer(x, layer, config, state)
    with pytest.raises(ValueError, match=r"X must be \(T, d_model\) = \(T, 32\)"):
        deltanet.deltanet_mixer(x[:, :5].astype(np.float32), layer, config, state)
    with pytest.raises(TypeError, match="GatedAttentionLayerParams"):
        deltanet.gated_attention_mixer(x.astype(np.float32), layer, config, None)
    with pytest.raises(TypeError, match="state must be a DeltaNetState"):
        deltanet.deltanet_mixer(x.astype(np.float32), layer, config, None)


def test_model_functions_refuse_bad_input(model, model64):
    with pytest.raises(TypeError, match="whole numbers"):
        hybrid_forward(model, "Once upon a time")
    with pytest.raises(ValueError, match="between 0 and 275"):
        hybrid_prefill(model, [0, 276])
    with pytest.raises(ValueError, match="at least one token"):
        hybrid_prefill(model, [])
    with pytest.raises(TypeError, match="HybridParams"):
        hybrid_forward(object(), [0])
    with pytest.raises(ValueError, match="run hybrid_prefill first"):
        hybrid_decode_step(model, 3, HybridCache(model.config))
    with pytest.raises(ValueError, match="another model"):
        hybrid_prefill(model, [0], HybridCache(model64.config))
    with pytest.raises(TypeError, match="HybridCache"):
        hybrid_prefill(model, [0], cache={})
    with pytest.raises(ValueError, match="exactly one token"):
        hybrid_decode_step(model, [1, 2], hybrid_prefill(model, [0])[1])
    with pytest.raises(ValueError, match="does not fit"):
        hybrid_prefill(model, np.zeros(257, dtype=int))
    with pytest.raises(ValueError, match="snapshot_every must be at least 1"):
        HybridCache(model.config, snapshot_every=0)


def test_loader_names_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hybrid(tmp_path)
    hub = json.loads((Path(deltanet.__file__).parent / "models" / "stories-hybrid" /
                      "config.json").read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        config_from_hub({**hub, "num_experts": 8})
    with pytest.raises(ValueError, match="'gpt2' model"):
        config_from_hub({**hub, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        config_from_hub({**hub, "tie_word_embeddings": False})
