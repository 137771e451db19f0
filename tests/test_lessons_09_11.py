"""Notebooks 09 (the cost of generation) and 10 (KV cache memory): the figures they show, the
roofline helpers, the widgets (headless) and the exercise checkers.

No test asserts on a measured time: measurements only have to run and have the right shape.
"""

import matplotlib

matplotlib.use("Agg")

import math  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvlib  # noqa: E402
from kvlib import memory, roofline  # noqa: E402
from kvlib.exercises import lesson09 as exercises09  # noqa: E402
from kvlib.exercises import lesson10 as exercises10  # noqa: E402
from kvlib.memory import GiB, MiB  # noqa: E402
from kvlib.widgets import lesson09 as widgets09  # noqa: E402
from kvlib.widgets import lesson10 as widgets10  # noqa: E402

GPT2 = kvlib.GPT2_SMALL
SMALL = kvlib.ModelConfig(vocab_size=50, d_model=12, n_heads=3, n_layers=2, d_ff=20,
                          context_length=40, dtype="float32")
PARTS = ["projections", "attention_scores", "attention_sums", "mlp", "unembedding"]


# ------------------------------------------------------------------ FLOPs pass by pass (09)

@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("prompt_length,new_tokens", [(1, 1), (4, 6), (32, 64)])
def test_step_list_sums_to_the_generation_total(use_cache, prompt_length, new_tokens):
    steps = kvlib.flops.generation_step_multiply_adds(GPT2, prompt_length, new_tokens,
                                                      use_cache)
    assert len(steps) == new_tokens
    total = kvlib.MultiplyAdds()
    for step in steps:
        total = total + step
    assert total == kvlib.generation_multiply_adds(GPT2, prompt_length, new_tokens, use_cache)


def test_each_cached_pass_equals_a_count_of_the_products_that_run():
    params = kvlib.init_params(SMALL, seed=0)
    prompt = [1, 2, 3, 4]
    steps = kvlib.flops.generation_step_multiply_adds(SMALL, len(prompt), 4, use_cache=True)
    (_, cache), counted = kvlib.count_multiply_adds(kvlib.prefill, params, prompt,
                                                    last_only=True)
    assert counted == steps[0]
    for step, token in zip(steps[1:], [5, 6, 7]):
        _, counted = kvlib.count_multiply_adds(kvlib.decode_step, params, token, cache)
        assert counted == step


def test_step_list_refuses_bad_lengths():
    with pytest.raises(ValueError, match="at least 1"):
        kvlib.flops.generation_step_multiply_adds(GPT2, 0, 5)
    with pytest.raises(TypeError, match="whole number"):
        kvlib.flops.generation_step_multiply_adds(GPT2, 3, 2.5)


def test_notebook_09_flop_figures():
    step = kvlib.decode_step_multiply_adds(GPT2, position=100)
    assert step.as_dict() == {"projections": 28_311_552, "attention_scores": 930_816,
                              "attention_sums": 930_816, "mlp": 56_623_104,
                              "unembedding": 38_597_376}
    assert round(step.flops / 1e6, 1) == 250.8
    ratios = [kvlib.generation_multiply_adds(GPT2, 32, n, use_cache=False).total
              / kvlib.generation_multiply_adds(GPT2, 32, n).total for n in (64, 256, 512)]
    assert [round(r, 1) for r in ratios] == [33.2, 103.5, 196.9]
    last_without = kvlib.forward_multiply_adds(GPT2, 543, last_only=True).flops
    last_with = kvlib.decode_step_multiply_adds(GPT2, 542).flops
    assert round(last_without / 1e9, 1) == 103.2 and round(last_with / 1e9, 3) == 0.267
    # shares of the parts over 512 tokens with the cache
    with_cache = kvlib.generation_multiply_adds(GPT2, 32, 512).as_dict()
    shares = {part: value / sum(with_cache.values()) for part, value in with_cache.items()}
    assert [round(100 * shares[p], 1) for p in PARTS] == [22.4, 2.0, 2.0, 44.8, 28.8]
    # the 1/N argument, exact for every part
    forward_64 = kvlib.forward_multiply_adds(GPT2, 64)
    decode_64 = kvlib.decode_step_multiply_adds(GPT2, 63)
    assert all(getattr(forward_64, p) == 64 * getattr(decode_64, p) for p in PARTS)
    # the lab model of the measurements
    lab = widgets09.LAB_MODEL
    assert roofline.weights_bytes(lab) == 54_525_952
    lab_ratio = (kvlib.generation_multiply_adds(lab, 16, 256, use_cache=False).total
                 / kvlib.generation_multiply_adds(lab, 16, 256).total)
    assert round(lab_ratio, 1) == 127.9


# ------------------------------------------------------------------ the roofline (09)

@pytest.mark.parametrize("config", [kvlib.ModelConfig(), SMALL, widgets09.LAB_MODEL])
def test_weights_bytes_equal_the_parameters(config):
    params = kvlib.init_params(config, seed=0)
    assert roofline.weights_bytes(config) == params.n_parameters * config.numpy_dtype.itemsize


def test_cache_bytes_equal_a_live_cache():
    params = kvlib.init_params(SMALL, seed=0)
    _, cache = kvlib.prefill(params, list(range(7)))
    assert roofline.cache_bytes(SMALL, 7) == cache.nbytes
    assert roofline.decode_step_bytes(SMALL, 7) == roofline.weights_bytes(SMALL) + \
        roofline.cache_bytes(SMALL, 8)
    assert roofline.forward_bytes(SMALL, 7) == roofline.weights_bytes(SMALL) + cache.nbytes


def test_gpt2_bytes_and_intensity():
    assert roofline.weights_bytes(GPT2) == 494_128_128
    assert roofline.decode_step_bytes(GPT2, 100) == 494_128_128 + 2 * 12 * 101 * 768 * 4
    decode = roofline.arithmetic_intensity(kvlib.decode_step_multiply_adds(GPT2, 100).flops,
                                           roofline.decode_step_bytes(GPT2, 100))
    forward = roofline.arithmetic_intensity(
        kvlib.forward_multiply_adds(GPT2, 512, last_only=True).flops,
        roofline.forward_bytes(GPT2, 512))
    assert round(decode, 3) == 0.5 and round(forward) == 182
    assert round(roofline.matmul_intensity(1, 2048, 8192), 3) == 0.5
    assert roofline.matmul_intensity(256, 2048, 8192) > 100


def test_roofline_time_takes_the_slower_limit():
    assert roofline.roofline_time(100.0, 10.0, compute_rate=10.0, bandwidth=10.0) == 10.0
    assert roofline.roofline_time(10.0, 100.0, compute_rate=10.0, bandwidth=10.0) == 10.0
    assert roofline.roofline_time(10.0, 10.0, compute_rate=10.0, bandwidth=1.0) == 10.0
    times = roofline.roofline_time(np.array([1.0, 100.0]), np.array([50.0, 50.0]), 1.0, 10.0)
    np.testing.assert_array_equal(times, [5.0, 100.0])
    with pytest.raises(ValueError, match="bandwidth must be a positive number"):
        roofline.roofline_time(1.0, 1.0, 1.0, 0)
    with pytest.raises(ValueError, match="one shape"):
        roofline.roofline_time(np.ones(2), np.ones(3), 1.0, 1.0)
    with pytest.raises(ValueError, match="negative"):
        roofline.roofline_time(-1.0, 1.0, 1.0, 1.0)


def test_the_roofline_predicts_about_20x_for_gpt2_at_example_rates():
    times = {use: roofline.generation_step_times(GPT2, 32, 512, use, 100e9, 20e9)
             for use in (False, True)}
    assert times[True].shape == times[False].shape == (512,)
    assert round(times[False].sum() / times[True].sum(), 1) == 20.4
    # every decode step is memory-bound, every long recomputation compute-bound
    decode_bytes = roofline.generation_step_bytes(GPT2, 32, 512)[1:]
    np.testing.assert_allclose(times[True][1:], decode_bytes / 20e9)
    flops = [s.flops for s in kvlib.flops.generation_step_multiply_adds(GPT2, 32, 512, False)]
    np.testing.assert_allclose(times[False][-100:], np.array(flops[-100:]) / 100e9)


def test_bytes_do_not_depend_on_the_cache():
    with_cache = roofline.generation_step_bytes(SMALL, 5, 10, use_cache=True)
    without = roofline.generation_step_bytes(SMALL, 5, 10, use_cache=False)
    np.testing.assert_array_equal(with_cache, without)
    assert with_cache[0] == roofline.forward_bytes(SMALL, 5)
    assert with_cache[3] == roofline.decode_step_bytes(SMALL, 7)


def test_measurements_run_and_return_rates():
    # no assertion on the values: only that they are finite positive rates
    for rate in (roofline.measure_read_bandwidth(2**20, repeats=2),
                 roofline.measure_matmul_rate(64, repeats=2),
                 roofline.measure_matmul_rows(np.ones((32, 64), np.float32), 4, repeats=2)):
        assert isinstance(rate, float) and math.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="n_bytes"):
        roofline.measure_read_bandwidth(10)
    with pytest.raises(ValueError, match="2-D"):
        roofline.measure_matmul_rows(np.ones(5), 1)


def test_timed_generation_generates_what_generate_does():
    params = kvlib.init_params(SMALL, seed=0)
    prompt = [3, 1, 4, 1, 5]
    new_ids, seconds = roofline.time_cached_generation(params, prompt, 8, repeats=2)
    assert new_ids == kvlib.generate(params, prompt, 8)
    assert seconds.shape == (8,)
    concat_ids, _ = roofline.time_cached_generation(params, prompt, 8,
                                                    cache=kvlib.ConcatenatingKVCache(SMALL))
    assert concat_ids == new_ids
    recomputed = roofline.time_recomputation(params, prompt + new_ids, [5, 9, 12])
    assert recomputed.shape == (3,)
    _, chosen = roofline.time_recomputation(params, prompt + new_ids, [5, 9, 12],
                                            return_tokens=True)
    assert chosen == [new_ids[0], new_ids[4], new_ids[7]]   # the same greedy choices
    with pytest.raises(ValueError, match="longer than the sequence"):
        roofline.time_recomputation(params, prompt, [6])
    _, cache = kvlib.prefill(params, prompt)
    with pytest.raises(ValueError, match="empty cache"):
        roofline.time_cached_generation(params, prompt, 2, cache=cache)


def test_timed_appends_checks_the_context():
    assert roofline.time_appends(SMALL, kvlib.KVCache, 30, repeats=3) >= 0
    assert roofline.time_appends(SMALL, kvlib.ConcatenatingKVCache, 30, repeats=3) >= 0
    with pytest.raises(ValueError, match="context length of 45"):
        roofline.time_appends(SMALL, kvlib.KVCache, 40)


def test_blas_threads_can_be_read_and_set():
    before = roofline.blas_threads()
    assert before is None or before >= 1
    if before is not None:
        assert roofline.set_blas_threads(1) == 1
        assert roofline.set_blas_threads(before) == before
    assert isinstance(roofline.blas_name(), str)
    with pytest.raises(ValueError, match="n_threads"):
        roofline.set_blas_threads(0)


def test_bad_configs_are_refused():
    with pytest.raises(TypeError, match="ModelConfig"):
        roofline.weights_bytes("gpt2")
    with pytest.raises(ValueError, match="position"):
        roofline.decode_step_bytes(GPT2, -1)
    with pytest.raises(ValueError, match="rows"):
        roofline.matmul_intensity(0, 4, 4)


# ------------------------------------------------------------------ memory figures (10)

def test_notebook_10_memory_figures():
    config = kvlib.ModelConfig()
    params = kvlib.init_params(config)
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    logits, cache = kvlib.prefill(params, ids)
    assert cache.nbytes == 960 == kvlib.kv_cache_bytes(3, 4, 5, dtype_bytes=8)
    kvlib.decode_step(params, int(np.argmax(logits[-1])), cache)
    assert cache.nbytes == 960 + 192
    assert kvlib.kv_cache_bytes(3, 4, 5, batch_size=3, dtype_bytes=8) == 2880
    assert kvlib.kv_cache_bytes(12, 768, 1024, dtype_bytes=4) == 72 * MiB
    assert kvlib.kv_cache_bytes(1, 8192, 4096) == 128 * MiB
    assert kvlib.kv_cache_bytes(80, 8192, 4096) == 10 * GiB
    assert kvlib.kv_cache_bytes(80, 8192, 4096, batch_size=64) == 640 * GiB
    assert round(640 * GiB / (12 * 80 * 8192**2 * 2), 2) == 5.33
    fit = {name: memory.tokens_that_fit(24 * GiB, memory.PRESETS[name].weights_bytes(),
                                        memory.PRESETS[name].kv_bytes_per_token())
           for name in ("Llama-2-7B", "Llama-3-8B", "Falcon-7B")}
    assert fit == {"Llama-2-7B": 23_446, "Llama-3-8B": 74_075, "Falcon-7B": 1_455_854}


def test_a_gpt2_sized_live_cache_matches_the_formula():
    cache = kvlib.KVCache(GPT2, capacity=256)
    rows = np.zeros((256, 768), dtype=np.float32)
    for layer in range(12):
        cache.append(layer, rows, rows)
    assert cache.nbytes == kvlib.kv_cache_bytes(12, 768, 256, dtype_bytes=4)
    assert cache.nbytes // 2 == memory.PRESETS["GPT-2 small"].kv_cache_bytes(256)


def test_memory_budget():
    budget = widgets10.memory_budget(32, 32, 128, context=4096, batch_size=8, dtype_bytes=2,
                                     n_parameters=6_738_415_616, memory_bytes=80 * GiB)
    assert budget["bytes_per_token"] == 524_288 and budget["cache"] == 16 * GiB
    assert budget["tokens_that_fit"] == 138_134 and budget["sequences_that_fit"] == 33
    assert budget["fits"]
    small = widgets10.memory_budget(32, 32, 128, 4096, 8, 2, 6_738_415_616, 10 * GiB)
    assert small["tokens_that_fit"] == 0 and not small["fits"]


# ------------------------------------------------------------------ widgets

def test_cost_explorer_draws_the_counted_curves():
    before = len(plt.get_fignums())
    explorer = widgets09.cost_explorer()
    assert "<b>196.9x</b> fewer FLOPs" in explorer.status.value
    assert "Roofline" not in explorer.status.value
    left, right = explorer.axes
    without, with_cache = left.get_lines()
    steps = kvlib.flops.generation_step_multiply_adds(GPT2, 32, 512, use_cache=True)
    np.testing.assert_allclose(with_cache.get_ydata(), [s.flops / 1e9 for s in steps])
    np.testing.assert_array_equal(with_cache.get_xdata(), np.arange(32, 544))
    totals = right.get_lines()
    assert totals[0].get_ydata()[-1] == pytest.approx(
        kvlib.generation_multiply_adds(GPT2, 32, 512, use_cache=False).flops / 1e9)

    explorer.new_tokens.value = 256
    assert "<b>103.5x</b>" in explorer.status.value
    assert len(explorer.axes[0].get_lines()[1].get_ydata()) == 256
    explorer.model.value = "notebook 09's lab model (4 layers, d 512)"
    explorer.prompt.value = 16
    assert "<b>127.9x</b>" in explorer.status.value
    for model in widgets09.MODELS:
        explorer.model.value = model
        assert explorer.message.value == ""
        assert explorer.prompt.value + explorer.new_tokens.value - 1 <= \
            widgets09.MODELS[model].context_length
    assert len(plt.get_fignums()) == before


def test_cost_explorer_fits_long_requests_into_the_context():
    explorer = widgets09.cost_explorer(compute_rate=100e9, bandwidth=20e9)
    assert "Roofline prediction on this machine" in explorer.status.value
    assert "<b>20.4x</b> faster" in explorer.status.value
    explorer.prompt.value = 1000
    assert explorer.new_tokens.value == 25
    assert "reduced to fit" in explorer.status.value
    explorer.model.value = "the article's toy (3 layers, d 4)"
    assert explorer.prompt.value == 4 and explorer.prompt.max == 32
    assert explorer.prompt.value + explorer.new_tokens.value - 1 <= 32
    with pytest.raises(ValueError, match="model must be one of"):
        widgets09.cost_explorer(model="GPT-5")


def test_kv_cache_calculator_presets_and_custom_shapes():
    before = len(plt.get_fignums())
    calculator = widgets10.kv_cache_calculator("Llama-2-7B", batch_size=8)
    assert "524,288 bytes" in calculator.status.value
    assert "138,134 cached tokens" in calculator.status.value
    assert "Touvron" in calculator.source.value
    assert calculator.budget()["cache"] == 16 * GiB
    bars = [p.get_width() for p in calculator.axes[0].patches]
    assert bars[:3] == pytest.approx([80, 6_738_415_616 * 2 / GiB, 16])

    calculator.preset.value = "Llama-3-8B"
    assert (calculator.layers.value, calculator.kv_heads.value, calculator.head_dim.value,
            calculator.context.value) == (32, 8, 128, 8192)
    assert calculator.budget()["bytes_per_token"] == 131_072
    calculator.kv_heads.value = 32
    assert calculator.preset.value == "custom"
    assert calculator.budget()["bytes_per_token"] == 524_288
    calculator.dtype.value = 1
    assert calculator.budget()["bytes_per_token"] == 262_144
    calculator.memory_gib.value = 4
    assert "do not fit" in calculator.status.value
    assert any(p.get_hatch() == "//" for p in calculator.axes[0].patches)
    calculator.preset.value = "source example (d 8192, 80 layers, MHA)"
    calculator.batch.value = 64
    calculator.dtype.value = 2
    assert calculator.budget()["cache"] == 640 * GiB
    assert calculator.budget()["weights"] == 120 * GiB
    for name in memory.PRESETS:
        calculator.preset.value = name
        assert calculator.budget()["bytes_per_token"] == \
            memory.PRESETS[name].kv_bytes_per_token(calculator.dtype.value)
        assert calculator.message.value == ""
    assert len(plt.get_fignums()) == before
    with pytest.raises(ValueError, match="preset must be one of"):
        widgets10.kv_cache_calculator("GPT-5")


# ------------------------------------------------------------------ exercises

def _run_solution(module, number, **names):
    namespace = {"kvlib": kvlib, "np": np, "roofline": roofline, "memory": memory, **names}
    exec(module.SOLUTIONS[number], namespace)
    return namespace["answer"]


@pytest.mark.parametrize("number,checker", [(1, "check_forward_macs"),
                                            (2, "check_flop_ratio"),
                                            (3, "check_roofline_time")])
def test_lesson09_solutions_pass(number, checker):
    feedback = getattr(exercises09, checker)(_run_solution(exercises09, number))
    assert feedback.passed, feedback.message


@pytest.mark.parametrize("number,checker", [(1, "check_bytes_per_token"),
                                            (2, "check_batch_where_cache_equals_weights"),
                                            (3, "check_tokens_that_fit")])
def test_lesson10_solutions_pass(number, checker):
    feedback = getattr(exercises10, checker)(_run_solution(exercises10, number))
    assert feedback.passed, feedback.message


def test_lesson09_checkers_name_the_mistake():
    check = exercises09.check_forward_macs
    assert "not filled in yet" in repr(check(...))
    right = kvlib.forward_multiply_adds(GPT2, 100, last_only=True).as_dict()
    assert check(kvlib.forward_multiply_adds(GPT2, 100, last_only=True))
    assert "no entry for mlp" in check({k: v for k, v in right.items() if k != "mlp"}).message
    one_layer = dict(right, projections=right["projections"] // 12)
    assert "one layer" in check(one_layer).message
    all_rows = dict(right, unembedding=100 * right["unembedding"])
    assert "only the last row" in check(all_rows).message
    decode = dict(right, mlp=kvlib.decode_step_multiply_adds(GPT2, 99).mlp)
    assert "for one row" in check(decode).message
    half = dict(right, attention_scores=right["attention_scores"] // 2)
    assert "masked half" in check(half).message
    three = dict(right, projections=12 * 3 * 100 * 768 * 768)
    assert "output projection" in check(three).message
    assert "unexpected entries" in check(dict(right, layernorm=0)).message
    assert "dict" in check([1, 2]).message

    ratio = exercises09.check_flop_ratio
    expected = (kvlib.generation_multiply_adds(GPT2, 128, 256, use_cache=False).total
                / kvlib.generation_multiply_adds(GPT2, 128, 256).total)
    assert ratio(expected) and not ratio(expected + 1)
    assert "upside" in ratio(1 / expected).message or "with / without" in \
        ratio(1 / expected).message
    assert "a number" in ratio("196").message

    roof = exercises09.check_roofline_time
    flops = kvlib.decode_step_multiply_adds(GPT2, 543).flops
    n_bytes = roofline.decode_step_bytes(GPT2, 543)
    assert roof(n_bytes / 50e9)
    assert "added" in roof(flops / 200e9 + n_bytes / 50e9).message
    assert "faster of the two" in roof(flops / 200e9).message
    assert "keys and values" in roof(roofline.weights_bytes(GPT2) / 50e9).message
    assert "unit" in roof(n_bytes / 50e9 * 1e3).message
    assert "not filled in yet" in roof(None).message


def test_lesson10_checkers_name_the_mistake():
    check = exercises10.check_bytes_per_token
    assert check(163_840)
    assert "K or V alone" in check(81_920).message
    assert "8 K/V heads are cached" in check(819_200).message
    assert "one layer" in check(4_096).message
    assert "4 bytes" in check(327_680).message
    assert "not filled in yet" in check(...).message

    batch = exercises10.check_batch_where_cache_equals_weights
    assert batch(12) and batch(12.0)
    assert "upside down" in batch(1 / 12).message
    assert "factor 2" in batch(6).message
    assert "a number" in batch([12]).message

    fit = exercises10.check_tokens_that_fit
    weights = memory.PRESETS["Llama-3-8B"].weights_bytes()
    assert fit(74_075)
    assert "round down" in fit((24 * GiB - weights) / 131_072).message
    assert "subtract" in fit(24 * GiB // 131_072).message
    assert "2^30" in fit((24 * 10**9 - weights) // 131_072).message
    assert "8 K/V heads" in fit((24 * GiB - weights) // 524_288).message
