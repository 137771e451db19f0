"""Notebooks 09 (counting the work), 10 (where the time goes) and 11 (KV cache memory): the
figures they show, the roofline helpers, the widgets (headless) and the exercise checkers,
with tables of wrong answers and valid answers in other forms, and the fuzz.

No test asserts on a measured time: measurements only have to run and have the right shape.
"""

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from checker_cases import case_id, in_words  # noqa: E402
from checker_cases_06_11 import FUZZ, correct, not_yet, survives_the_fuzz  # noqa: E402

import kvlib  # noqa: E402
from kvlib import (  # noqa: E402
    hardware,  # noqa: E402
    memory,
    roofline,
)
from kvlib.exercises import counting_the_work as exercises09  # noqa: E402
from kvlib.exercises import kv_cache_memory as exercises11  # noqa: E402
from kvlib.exercises import where_time_goes as exercises10  # noqa: E402
from kvlib.memory import GiB, MiB  # noqa: E402
from kvlib.widgets import counting_the_work as widgets09  # noqa: E402
from kvlib.widgets import kv_cache_memory as widgets11  # noqa: E402
from kvlib.widgets import where_time_goes as widgets10  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

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
    lab = widgets10.LAB_MODEL
    assert roofline.weights_bytes(lab) == 54_525_952
    lab_ratio = (kvlib.generation_multiply_adds(lab, 16, 256, use_cache=False).total
                 / kvlib.generation_multiply_adds(lab, 16, 256).total)
    assert round(lab_ratio, 1) == 127.9


# ------------------------------------------------------------------ the roofline (10)

@pytest.mark.parametrize("config", [kvlib.ModelConfig(), SMALL, widgets10.LAB_MODEL])
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
    # the functions that take a learner's rates check them (roofline_time trusts its callers)
    with pytest.raises(ValueError, match="bandwidth must be a positive number"):
        roofline.batched_step_seconds(kvlib.ModelConfig(), [3], 1.0, 0)


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
    # every reading can be recorded, and the rate is their median
    readings = []
    rate = roofline.measure_matmul_rate(64, repeats=5, record=readings)
    assert len(readings) == 5 and rate == pytest.approx(np.median(readings), rel=1e-9)
    readings = []
    roofline.measure_read_bandwidth(2**20, repeats=3, record=readings)
    roofline.measure_matmul_rows(np.ones((32, 64), np.float32), 4, repeats=3, record=readings)
    assert len(readings) == 6 and all(r > 0 for r in readings)
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


# ------------------------------------------------------------------ memory figures (11)

def test_notebook_11_memory_figures():
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
    budget = widgets11.memory_budget(32, 32, 128, context=4096, batch_size=8, dtype_bytes=2,
                                     n_parameters=6_738_415_616, memory_bytes=80 * GiB)
    assert budget["bytes_per_token"] == 524_288 and budget["cache"] == 16 * GiB
    assert budget["tokens_that_fit"] == 138_134 and budget["sequences_that_fit"] == 33
    assert budget["fits"]
    small = widgets11.memory_budget(32, 32, 128, 4096, 8, 2, 6_738_415_616, 10 * GiB)
    assert small["tokens_that_fit"] == 0 and not small["fits"]


# ------------------------------------------------------------------ widgets


def test_a_budget_keeps_the_weights_format_apart_from_the_caches():
    fp8_cache = widgets11.memory_budget(32, 32, 128, 4096, 8, 1, 6_738_415_616, 80 * GiB,
                                        weights_dtype_bytes=2)
    assert fp8_cache["bytes_per_token"] == 262_144 and fp8_cache["cache"] == 8 * GiB
    assert fp8_cache["weights"] == 6_738_415_616 * 2
    same = widgets11.memory_budget(32, 32, 128, 4096, 8, 1, 6_738_415_616, 80 * GiB)
    assert same["weights"] == 6_738_415_616          # by default, one format for both


# ------------------------------------------------------------------ long contexts (09)

def test_attention_overtakes_the_rest_of_a_decode_step_at_6d():
    long = kvlib.GPT2_LONG
    d = long.d_model
    for position, more in ((6 * d - 2, False), (6 * d - 1, None), (6 * d, True)):
        step = kvlib.decode_step_multiply_adds(long, position)
        attention = step.attention_scores + step.attention_sums
        rest = step.projections + step.mlp
        assert (attention == rest) if more is None else ((attention > rest) == more)
    # the same crossover for bytes: the cache of 6d positions weighs as much as the weights
    # outside the embeddings
    assert roofline.cache_bytes(GPT2, 6 * 768) == \
        roofline.weights_bytes(GPT2) - GPT2.vocab_size * 768 * 4


def test_the_cached_total_is_quadratic_in_the_long_run():
    steps = kvlib.flops.generation_step_multiply_adds(kvlib.GPT2_LONG, 32, 32737)
    totals = np.cumsum([s.flops for s in steps])
    second_differences = np.diff(totals[1:], 2)     # the decode steps: a constant > 0
    assert (second_differences > 0).all() and np.ptp(second_differences) == 0


# ------------------------------------------------------------------ widgets

def test_flop_units_follow_the_size():
    assert kvlib.flops.format_flops(49_920) == "49.9 kFLOPs"
    assert kvlib.flops.format_flops(2.7e13) == "27 TFLOPs"
    assert kvlib.flops.format_flops(137.2e9) == "137 GFLOPs"
    assert kvlib.flops.format_flops(12) == "12 FLOPs"
    assert kvlib.flops.flop_unit(0.5) == (1.0, "FLOPs")


def test_cost_explorer_draws_the_counted_curves():
    before = len(plt.get_fignums())
    explorer = widgets09.cost_explorer()
    assert "<b>196.9x</b> fewer FLOPs" in explorer.status.value
    assert "Roofline" not in explorer.status.value
    left, right = explorer.axes
    without, with_cache = left.get_lines()
    steps = kvlib.flops.generation_step_multiply_adds(GPT2, 32, 512, use_cache=True)
    scale, unit = kvlib.flops.flop_unit(without.get_ydata().max() * 1e9)
    assert unit == "GFLOPs" and "GFLOPs" in left.get_ylabel()
    np.testing.assert_allclose(with_cache.get_ydata(), [s.flops / 1e9 for s in steps])
    np.testing.assert_array_equal(with_cache.get_xdata(), np.arange(32, 544))
    totals = right.get_lines()
    assert "TFLOPs" in right.get_ylabel()
    assert totals[0].get_ydata()[-1] == pytest.approx(
        kvlib.generation_multiply_adds(GPT2, 32, 512, use_cache=False).flops / 1e12)

    explorer.new_tokens.value = 256
    assert "<b>103.5x</b>" in explorer.status.value
    assert len(explorer.axes[0].get_lines()[1].get_ydata()) == 256
    for model in kvlib.config.MODEL_SIZES:
        explorer.model.value = model
        assert explorer.message.value == ""
        assert explorer.prompt.value + explorer.new_tokens.value - 1 <= \
            kvlib.config.MODEL_SIZES[model].context_length
    assert len(plt.get_fignums()) == before


def test_cost_explorer_gives_each_model_its_own_lengths():
    explorer = widgets09.cost_explorer()
    explorer.model.value = "the article's toy (3 layers, d 4)"
    assert (explorer.prompt.value, explorer.new_tokens.value) == (5, 28)
    assert "kFLOPs" in explorer.status.value and "0.0 GFLOPs" not in explorer.status.value
    explorer.model.value = "GPT-2 small (12 layers, d 768)"       # back: not the toy's 5 and 28
    assert (explorer.prompt.value, explorer.new_tokens.value) == (32, 512)
    assert "<b>196.9x</b>" in explorer.status.value
    explorer.model.value = "GPT-2 small's shapes, 32k context (hypothetical)"
    assert explorer.new_tokens.value == 16384 and explorer.prompt.max == 32768


def test_cost_explorer_fits_long_requests_into_the_context():
    explorer = widgets09.cost_explorer(compute_rate=100e9, bandwidth=20e9)
    assert "Roofline prediction at 100 GFLOP/s and 20.0 GB/s" in explorer.status.value
    assert "<b>20.4x</b> faster" in explorer.status.value
    explorer.prompt.value = 1000
    assert explorer.new_tokens.value == 25
    assert "reduced to fit" in explorer.status.value
    with pytest.raises(ValueError, match="model must be one of"):
        widgets09.cost_explorer(model="GPT-5")


def test_machine_rates_say_when_the_machine_was_busy():
    quiet = hardware.rates_from_readings([100e9, 105e9, 98e9], [30e9, 31e9, 29e9])
    assert quiet.compute_rate == 100e9 and quiet.bandwidth == 30e9 and not quiet.busy
    assert quiet.ridge_point == pytest.approx(100 / 30)
    assert "disagree" not in quiet.describe() and "ridge point 3.3" in quiet.describe()
    busy = hardware.rates_from_readings([100e9, 30e9, 98e9], [30e9, 31e9, 29e9])
    assert busy.busy and busy.compute_spread == pytest.approx(100 / 30)
    assert "another program was using the machine" in busy.describe()
    with pytest.raises(ValueError, match="positive reading"):
        hardware.rates_from_readings([], [1.0])
    measured = hardware.measure_machine(rounds=1, matmul_size=64, read_bytes=2**20)
    assert measured.compute_rate > 0 and measured.bandwidth > 0
    assert measured.compute_spread >= 1 and measured.bandwidth_spread >= 1
    with pytest.raises(ValueError, match="rounds"):
        hardware.measure_machine(rounds=0)


def test_the_time_ratio_depends_on_the_ridge_point_only():
    low = widgets10.predicted_time_ratio(GPT2, 32, 512, 1e-3)
    flop_ratio = (kvlib.generation_multiply_adds(GPT2, 32, 512, use_cache=False).flops
                  / kvlib.generation_multiply_adds(GPT2, 32, 512).flops)
    assert low == pytest.approx(flop_ratio, rel=0.01)
    assert widgets10.predicted_time_ratio(GPT2, 32, 512, 5.0) == pytest.approx(20.4, abs=0.05)
    assert widgets10.predicted_time_ratio(GPT2, 32, 512, 1e4) == 1.0
    ratios = [widgets10.predicted_time_ratio(GPT2, 32, 512, r) for r in (1, 3, 10, 30, 100)]
    assert ratios == sorted(ratios, reverse=True)
    # the same ratio whatever the two rates, as long as their ratio is the same
    times = [roofline.generation_step_times(GPT2, 32, 64, use, 5e11, 1e11).sum()
             for use in (False, True)]
    assert times[0] / times[1] == pytest.approx(widgets10.predicted_time_ratio(GPT2, 32, 64, 5))


def test_a_batched_decode_step_shares_the_weights_not_the_caches():
    one = roofline.batched_step_cost(GPT2, 1, 543)
    eight = roofline.batched_step_cost(GPT2, 8, 543)
    assert eight["bytes"] == roofline.weights_bytes(GPT2) + 8 * roofline.cache_bytes(GPT2, 544)
    assert eight["flops"] == 8 * kvlib.decode_step_multiply_adds(GPT2, 543).flops
    assert one["intensity"] < eight["intensity"] < one["flops"] / one["caches"]
    bf16 = roofline.batched_step_cost(GPT2, 8, 543, bytes_per_number=2)
    assert bf16["bytes"] == eight["bytes"] / 2 and bf16["flops"] == eight["flops"]
    with pytest.raises(ValueError, match="batch"):
        roofline.batched_step_cost(GPT2, 0, 5)
    with pytest.raises(ValueError, match="position"):
        roofline.batched_step_cost(GPT2, 1, -1)


def test_accelerators_have_ridge_points_of_hundreds():
    ridges = {name: rate / bandwidth for name, (rate, bandwidth) in
              hardware.ACCELERATORS.items()}
    assert all(100 < ridge < 1000 for ridge in ridges.values())


def test_batching_explorer():
    before = len(plt.get_fignums())
    rates = hardware.rates_from_readings([100e9], [30e9])
    explorer = widgets10.batching_explorer(rates)
    assert explorer.hardware.value == "this CPU (measured), float32"
    step = explorer.step()
    assert step == {**roofline.batched_step_cost(GPT2, 8, 511), "seconds": step["seconds"]}
    assert step["seconds"] == pytest.approx(step["bytes"] / 30e9)   # memory-bound
    assert "memory-bound" in explorer.status.value and "8 x" in explorer.status.value
    explorer.hardware.value = "NVIDIA H100 SXM, BF16"
    assert explorer.step()["bytes"] == roofline.batched_step_cost(GPT2, 8, 511, 2)["bytes"]
    assert "ridge point of 295" in explorer.status.value
    explorer.batch.value = 1024
    explorer.position.value = 0
    assert explorer.message.value == ""
    explorer.model.value = "GPT-2 small's shapes, 32k context (hypothetical)"
    explorer.position.value = 32000
    assert explorer.step()["caches"] > 10 * explorer.step()["weights"]
    explorer.model.value = "GPT-2 medium (24 layers, d 1024)"     # shorter context: clamped
    assert explorer.position.value == 1023 and explorer.message.value == ""
    _, right = explorer.axes
    assert "ridge point 295" in right.get_legend().texts[1].get_text()
    assert len(plt.get_fignums()) == before
    assert "this CPU" not in widgets10.batching_explorer().hardware.options
    with pytest.raises(ValueError, match="model must be one of"):
        widgets10.batching_explorer(model="the article's toy (3 layers, d 4)")


def test_kv_cache_calculator_presets_and_custom_shapes():
    before = len(plt.get_fignums())
    calculator = widgets11.kv_cache_calculator("Llama-2-7B", batch_size=8)
    assert "524,288 bytes" in calculator.status.value
    assert "138,134 cached tokens" in calculator.status.value
    assert "gpu_memory_utilization=0.9" in calculator.status.value     # weights are not all
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
    assert "no published source" in calculator.source.value and "Meta" not in \
        calculator.source.value
    assert calculator.budget()["bytes_per_token"] == 524_288
    weights = calculator.budget()["weights"]
    calculator.dtype.value = 1                       # an 8-bit cache beside BF16 weights
    assert calculator.budget()["bytes_per_token"] == 262_144
    assert calculator.budget()["weights"] == weights
    calculator.weights_dtype.value = 4
    assert calculator.budget()["weights"] == 2 * weights
    calculator.memory_gib.value = 4
    assert "do not fit" in calculator.status.value
    assert any(p.get_hatch() == "//" for p in calculator.axes[0].patches)
    calculator.preset.value = "source example (d 8192, 80 layers, MHA)"
    calculator.weights_dtype.value = 2
    calculator.batch.value = 64
    calculator.dtype.value = 2
    assert calculator.budget()["cache"] == 640 * GiB
    assert calculator.budget()["weights"] == 120 * GiB
    assert set(widgets11.PRESETS) == {name for name, preset in memory.PRESETS.items()
                                      if preset.latent_dim is None and preset.window is None}
    assert "DeepSeek-V2" not in calculator.preset.options      # a latent cache: notebook 16
    for name, preset in widgets11.PRESETS.items():
        calculator.preset.value = name
        assert calculator.context.value == preset.context_length    # its own context
        assert calculator.budget()["bytes_per_token"] == \
            preset.kv_bytes_per_token(calculator.dtype.value)
        assert calculator.message.value == ""
    assert len(plt.get_fignums()) == before
    with pytest.raises(ValueError, match="preset must be one of"):
        widgets11.kv_cache_calculator("GPT-5")
    with pytest.raises(ValueError, match="weights_dtype_bytes"):
        widgets11.kv_cache_calculator(weights_dtype_bytes=3)


# ------------------------------------------------------------------ exercise checkers

MEDIUM = exercises09.GPT2_MEDIUM
RIGHT_09_1 = kvlib.forward_multiply_adds(MEDIUM, 100, last_only=True).as_dict()


def changed(**parts):
    return dict(RIGHT_09_1, **parts)


@pytest.mark.parametrize("answer, diagnosis", [
    (changed(projections=RIGHT_09_1["projections"] // 24), "one layer's work"),
    (changed(attention_scores=RIGHT_09_1["attention_scores"] // 16), "one head's work"),
    (changed(attention_sums=RIGHT_09_1["attention_sums"] // 24), "one layer's work"),
    (changed(unembedding=100 * RIGHT_09_1["unembedding"]), "only the last row"),
    (changed(mlp=kvlib.decode_step_multiply_adds(MEDIUM, 99).mlp), "for one row"),
    (changed(attention_scores=RIGHT_09_1["attention_scores"] // 2), "masked half"),
    (changed(projections=24 * 3 * 100 * 1024 * 1024), "output projection"),
    (changed(mlp=24 * 100 * 1024 * 4096), "both matrices"),
    (changed(mlp=2 * RIGHT_09_1["mlp"]), "FLOPs (2 per"),
    (changed(mlp=RIGHT_09_1["mlp"] + 1), "mlp is not right"),
    (kvlib.forward_multiply_adds(GPT2, 100, last_only=True).as_dict(), "GPT-2 small's counts"),
    ({k: v for k, v in RIGHT_09_1.items() if k != "mlp"}, "no entry for mlp"),
    (changed(layernorm=0), "unexpected entries"),
    (changed(mlp="a lot"), "should be a number"),
    (changed(mlp=True), "should be a number"),
    ([1, 2], "dict"),
])
def test_09_forward_macs_wrong_answers(answer, diagnosis):
    not_yet(exercises09.check_forward_macs(answer), diagnosis)


@pytest.mark.parametrize("answer", [
    RIGHT_09_1, kvlib.forward_multiply_adds(MEDIUM, 100, last_only=True),
    {k: float(v) for k, v in RIGHT_09_1.items()},
    {k: np.int64(v) for k, v in RIGHT_09_1.items()},
])
def test_09_forward_macs_valid_forms(answer):
    correct(exercises09.check_forward_macs(answer), "multiply-adds")


RATIO_09_2 = (kvlib.generation_multiply_adds(GPT2, 128, 256, use_cache=False).total
              / kvlib.generation_multiply_adds(GPT2, 128, 256).total)


@pytest.mark.parametrize("answer, diagnosis", [
    (1 / RATIO_09_2, "with / without"), (0.00744, "with / without"),
    (103.5, "32-token prompt"), (130, "close: 3.2% below"), (140, "close: 4.2% above"),
    (13.4, "not that"), (1342.6, "not that"), ("134", "a number (a ratio)"),
    ([134.3, 103.5], "several"), (10**400, "far too large"), (float("nan"), "got nan"),
])
def test_09_flop_ratio_wrong_answers(answer, diagnosis):
    not_yet(exercises09.check_flop_ratio(answer), diagnosis)


@pytest.mark.parametrize("answer", [RATIO_09_2, 134.3, 134.33, 134, np.float64(134.3),
                                    np.array(134.3), np.float32(RATIO_09_2), [134.3],
                                    np.array([134.3])])
def test_09_flop_ratio_valid_forms(answer):
    correct(exercises09.check_flop_ratio(answer), "134.3")


@pytest.mark.parametrize("answer, diagnosis", [
    (19200, "scores only"), (3200, "leaves out the MLP"), (6400, "leaves out the projections"),
    (240000, "divides d among the heads"), (4608, "GPT-2 small's"), (4800, "half of it"),
    (10124, "unembedding"), (9700, "close"), (123, "not that"), (9600.5, "not a whole number"),
    ("9600", "a number of positions"),
])
def test_09_attention_crossover_wrong_answers(answer, diagnosis):
    not_yet(exercises09.check_attention_crossover(answer), diagnosis)


@pytest.mark.parametrize("answer", [9600, 9600.0, np.int64(9600), 9.6e3, np.array(9600)])
def test_09_attention_crossover_valid_forms(answer):
    correct(exercises09.check_attention_crossover(answer), "6 x d_model")


STEP_FLOPS = kvlib.decode_step_multiply_adds(GPT2, 543).flops
STEP_BYTES = roofline.decode_step_bytes(GPT2, 543)
TPOT = STEP_BYTES / 50e9


@pytest.mark.parametrize("answer, diagnosis", [
    (STEP_FLOPS / 200e9 + TPOT, "added the two times"),
    (STEP_FLOPS / 200e9, "arithmetic time only"),
    (STEP_FLOPS / 400e9, "arithmetic time only"),
    (roofline.weights_bytes(GPT2) / 50e9, "keys and values"),
    (TPOT * 1e3, "milliseconds"), (10.7, "milliseconds"), (TPOT * 1e6, "microseconds"),
    (0.0105, "close: 1.7% below"), (0.01, "close"), (1.0, "not that"), ("fast", "seconds"),
])
def test_10_roofline_time_wrong_answers(answer, diagnosis):
    not_yet(exercises10.check_roofline_time(answer), diagnosis)


@pytest.mark.parametrize("answer", [TPOT, 0.0107, 0.01068, 0.0106847, np.float32(TPOT)])
def test_10_roofline_time_valid_forms(answer):
    correct(exercises10.check_roofline_time(answer), "time per output token")


WEIGHTS = roofline.weights_bytes(GPT2)
ONE_CACHE = roofline.cache_bytes(GPT2, 544)
BATCHED = WEIGHTS + 8 * ONE_CACHE


@pytest.mark.parametrize("answer, diagnosis", [
    (8 * (WEIGHTS + ONE_CACHE), "reads the weights 8 times"),
    (WEIGHTS + ONE_CACHE, "one sequence's step"),
    (WEIGHTS, "leaves out the caches"), (8 * ONE_CACHE, "leaves out the weights"),
    (WEIGHTS + 8 * roofline.cache_bytes(GPT2, 543), "one position short"),
    (BATCHED // 2, "2 bytes a number"),
    (BATCHED / 1e9, "in GB"), (BATCHED / 1e6, "in MB"), (BATCHED / 2**30, "in GiB"),
    (BATCHED + 10**6, "close"), (12345, "not that"), (BATCHED + 0.5, "not a whole number"),
])
def test_10_batched_bytes_wrong_answers(answer, diagnosis):
    not_yet(exercises10.check_batched_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [BATCHED, float(BATCHED), np.int64(BATCHED)])
def test_10_batched_bytes_valid_forms(answer):
    correct(exercises10.check_batched_bytes(answer), "Batching shares the weights")


PREFILL_FLOPS = kvlib.prefill_multiply_adds(GPT2, 512, last_only=True).flops
TTFT = PREFILL_FLOPS / 200e9


@pytest.mark.parametrize("answer, diagnosis", [
    (roofline.forward_bytes(GPT2, 512) / 50e9, "reading time"),
    (TTFT + roofline.forward_bytes(GPT2, 512) / 50e9, "added the two times"),
    (TTFT / 2, "multiply-adds"),
    (kvlib.prefill_multiply_adds(GPT2, 512).flops / 200e9, "unembeds all 512 rows"),
    (roofline.decode_step_bytes(GPT2, 512) / 50e9, "one decode step"),
    (512 * roofline.decode_step_bytes(GPT2, 512) / 50e9, "512 decode steps"),
    (TTFT * 1e3, "milliseconds"), (0.47, "close"), (3.0, "not that"), (None, "not filled in"),
])
def test_10_time_to_first_token_wrong_answers(answer, diagnosis):
    not_yet(exercises10.check_time_to_first_token(answer), diagnosis)


@pytest.mark.parametrize("answer", [TTFT, 0.484, 0.4836, np.float64(TTFT)])
def test_10_time_to_first_token_valid_forms(answer):
    correct(exercises10.check_time_to_first_token(answer), "compute-bound")


@pytest.mark.parametrize("answer, diagnosis", [
    (81_920, "K or V alone"), (819_200, "8 K/V heads are cached"), (4_096, "one layer"),
    (327_680, "float32"), (655_360, "float64"), (1_310_720, "counts bits"),
    (100, "not that"), (163_840.5, "not a whole"), (10**400, "far too large"),
    ("163840", "a number of bytes"),
])
def test_11_bytes_per_token_wrong_answers(answer, diagnosis):
    not_yet(exercises11.check_bytes_per_token(answer), diagnosis)


def test_11_bits_and_float64_get_their_own_diagnoses():
    """The bits branch used to fire at 4x (a float64 answer) and the real bits answer, 8x,
    got nothing."""
    assert "float64" in exercises11.check_bytes_per_token(4 * 163_840).message
    assert "bits" in exercises11.check_bytes_per_token(8 * 163_840).message
    assert "bits" not in exercises11.check_bytes_per_token(4 * 163_840).message


@pytest.mark.parametrize("answer", [163_840, 163_840.0, np.int32(163_840), 1.6384e5])
def test_11_bytes_per_token_valid_forms(answer):
    correct(exercises11.check_bytes_per_token(answer), "163,840 bytes")


@pytest.mark.parametrize("answer, diagnosis", [
    (1 / 12, "upside down"), (6, "factor 2"), (24, "factor 2"), (12.5, "close"),
    (100, "not that"), ([12, 64], "several"),
])
def test_11_batch_wrong_answers(answer, diagnosis):
    not_yet(exercises11.check_batch_where_cache_equals_weights(answer), diagnosis)


@pytest.mark.parametrize("answer", [12, 12.0, np.float64(12), np.int64(12), [12], (12.0,)])
def test_11_batch_valid_forms(answer):
    correct(exercises11.check_batch_where_cache_equals_weights(answer))


LLAMA3 = memory.PRESETS["Llama-3-8B"]


@pytest.mark.parametrize("answer, diagnosis", [
    ((24 * GiB - LLAMA3.weights_bytes()) / 131_072, "round down"),
    (24 * GiB // 131_072, "subtract"),
    ((24 * 10**9 - LLAMA3.weights_bytes()) // 131_072, "2^30"),
    ((24 * GiB - LLAMA3.weights_bytes()) // 524_288, "8 K/V heads"),
    ((24 * GiB - LLAMA3.weights_bytes() // 2) // 131_072, "1 byte each"),
    (5, "not that"), ("74075", "a number of tokens"),
])
def test_11_tokens_that_fit_wrong_answers(answer, diagnosis):
    not_yet(exercises11.check_tokens_that_fit(answer), diagnosis)


@pytest.mark.parametrize("answer", [74_075, 74_075.0, np.int64(74_075)])
def test_11_tokens_that_fit_valid_forms(answer):
    correct(exercises11.check_tokens_that_fit(answer), "74,075 tokens")


CHECKERS = [
    exercises09.check_forward_macs, exercises09.check_flop_ratio,
    exercises09.check_attention_crossover, exercises10.check_roofline_time,
    exercises10.check_batched_bytes, exercises10.check_time_to_first_token,
    exercises11.check_bytes_per_token, exercises11.check_batch_where_cache_equals_weights,
    exercises11.check_tokens_that_fit,
]


@pytest.mark.parametrize("checker", CHECKERS)
def test_every_checker_answers_the_fuzz_with_feedback(checker):
    survives_the_fuzz(checker)
    not_yet(checker(...), "not filled in yet")


@pytest.mark.parametrize("value", FUZZ, ids=case_id)
def test_the_forward_macs_checker_answers_fuzz_in_every_entry(value):
    feedback = exercises09.check_forward_macs(changed(mlp=value))
    assert not feedback.passed
    in_words(feedback)


# ------------------------------------------------------------------ solutions and notebooks

def notebook_namespace(name, cells=None):
    """Run a notebook's code cells (all, or the first `cells`) headless: its variables."""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__notebook__"}
    for cell in code[:cells]:
        exec(compile("".join(cell["source"]), name, "exec"), namespace)
    plt.close("all")
    return namespace


LESSONS = {
    # 10's measurements take tens of seconds: its solutions run after its set-up cell only
    "09_counting_the_work": (exercises09, None, {1: "check_forward_macs",
                                                 2: "check_flop_ratio",
                                                 3: "check_attention_crossover"}),
    "10_where_time_goes": (exercises10, 1, {1: "check_roofline_time", 2: "check_batched_bytes",
                                            3: "check_time_to_first_token"}),
    "11_kv_cache_memory": (exercises11, None, {1: "check_bytes_per_token",
                                               2: "check_batch_where_cache_equals_weights",
                                               3: "check_tokens_that_fit"}),
}


@pytest.mark.parametrize("name", sorted(LESSONS))
def test_solutions_pass_in_the_notebooks_namespace(name):
    module, cells, checkers = LESSONS[name]
    assert sorted(module.SOLUTIONS) == sorted(checkers)
    namespace = notebook_namespace(name, cells)
    for number, checker in checkers.items():
        scope = dict(namespace)
        exec(module.SOLUTIONS[number], scope)
        feedback = getattr(module, checker)(scope["answer"])
        assert feedback.passed, f"solution {number} of {name}: {feedback}"


@pytest.mark.parametrize("name", ["09_counting_the_work", "11_kv_cache_memory"])
def test_every_cell_can_be_run_twice(name):
    """(10 only measures: no cell changes what a later one reads; running it twice would
    only double its measurements.)"""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    namespace = {"__name__": "__notebook__"}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            code = compile("".join(cell["source"]), name, "exec")
            exec(code, namespace)
            exec(code, namespace)
    plt.close("all")
    assert namespace["answer"] is ...


@pytest.mark.parametrize("module", [exercises09, exercises10, exercises11])
def test_solution_display(module):
    shown = module.solution(1)
    assert "Solution to exercise 1" in shown.data and "answer" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        module.solution(9)


def test_no_notebook_text_keeps_the_invented_machines_figures():
    """09/10 used to claim "about 190 times the FLOPs, about 20 times the time" from an
    invented machine, and "the sum grows like N" with the cache."""
    for name in ("09_counting_the_work", "10_where_time_goes"):
        text = (NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")
        assert "190 times" not in text and "20 times the time" not in text
        assert not re.search(r"sum grows like N\b", text)


def test_the_time_ratio_curve_equals_the_ratio_at_each_point():
    ridges = [0.3, 3.0, 30.0, 300.0]
    curve = widgets10.time_ratio_curve(GPT2, 32, 64, ridges)
    for ridge, value in zip(ridges, curve):
        times = [roofline.generation_step_times(GPT2, 32, 64, use, ridge, 1.0).sum()
                 for use in (False, True)]
        assert value == pytest.approx(times[0] / times[1], rel=1e-12)
    with pytest.raises(ValueError, match="positive"):
        widgets10.time_ratio_curve(GPT2, 32, 64, [0.0])
