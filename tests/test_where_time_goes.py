"""Notebook 10 (where the time goes): the roofline helpers it uses (bytes, intensity, the
slower of two limits, the measurements, which only have to run: no test asserts on a measured
time), the machine's rates, its batching explorer driven headless, and its exercise checkers,
with tables of typical wrong answers (each with its diagnosis) and of valid answers in other
forms; the published solutions run after the notebook's set-up cell (its measurements take
tens of seconds)."""

import math
import re

import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, code_cells, notebook_path, run_notebook

import kvlib
from kvlib import hardware, roofline
from kvlib.exercises import where_time_goes as exercises
from kvlib.widgets import where_time_goes as widgets

GPT2 = kvlib.GPT2_SMALL
SMALL = kvlib.ModelConfig(vocab_size=50, d_model=12, n_heads=3, n_layers=2, d_ff=20,
                          context_length=40, dtype="float32")


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [kvlib.ModelConfig(), SMALL, widgets.LAB_MODEL])
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


def test_the_time_ratio_curve_equals_the_ratio_at_each_point():
    ridges = [0.3, 3.0, 30.0, 300.0]
    curve = widgets.time_ratio_curve(GPT2, 32, 64, ridges)
    for ridge, value in zip(ridges, curve):
        times = [roofline.generation_step_times(GPT2, 32, 64, use, ridge, 1.0).sum()
                 for use in (False, True)]
        assert value == pytest.approx(times[0] / times[1], rel=1e-12)
    with pytest.raises(ValueError, match="positive"):
        widgets.time_ratio_curve(GPT2, 32, 64, [0.0])

# ---------------------------------------------------------------------------------------------
# The machine's rates, batching and its explorer
# ---------------------------------------------------------------------------------------------

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
    low = widgets.predicted_time_ratio(GPT2, 32, 512, 1e-3)
    flop_ratio = (kvlib.generation_multiply_adds(GPT2, 32, 512, use_cache=False).flops
                  / kvlib.generation_multiply_adds(GPT2, 32, 512).flops)
    assert low == pytest.approx(flop_ratio, rel=0.01)
    assert widgets.predicted_time_ratio(GPT2, 32, 512, 5.0) == pytest.approx(20.4, abs=0.05)
    assert widgets.predicted_time_ratio(GPT2, 32, 512, 1e4) == 1.0
    ratios = [widgets.predicted_time_ratio(GPT2, 32, 512, r) for r in (1, 3, 10, 30, 100)]
    assert ratios == sorted(ratios, reverse=True)
    # the same ratio whatever the two rates, as long as their ratio is the same
    times = [roofline.generation_step_times(GPT2, 32, 64, use, 5e11, 1e11).sum()
             for use in (False, True)]
    assert times[0] / times[1] == pytest.approx(widgets.predicted_time_ratio(GPT2, 32, 64, 5))


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


@pytest.mark.usefixtures("no_figure_leaks")
def test_batching_explorer():
    rates = hardware.rates_from_readings([100e9], [30e9])
    explorer = widgets.batching_explorer(rates)
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
    assert "this CPU" not in widgets.batching_explorer().hardware.options
    with pytest.raises(ValueError, match="model must be one of"):
        widgets.batching_explorer(model="the article's toy (3 layers, d 4)")

# ---------------------------------------------------------------------------------------------
# Exercises 1: a decode step's time; 2: a batched step's bytes; 3: the first token's time
# ---------------------------------------------------------------------------------------------

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
def test_roofline_time_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_roofline_time(answer), diagnosis)


@pytest.mark.parametrize("answer", [TPOT, 0.0107, 0.01068, 0.0106847, np.float32(TPOT)])
def test_roofline_time_valid_forms(answer):
    correct(exercises.check_roofline_time(answer), "time per output token")


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
def test_batched_bytes_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_batched_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [BATCHED, float(BATCHED), np.int64(BATCHED)])
def test_batched_bytes_valid_forms(answer):
    correct(exercises.check_batched_bytes(answer), "Batching shares the weights")


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
def test_time_to_first_token_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_time_to_first_token(answer), diagnosis)


@pytest.mark.parametrize("answer", [TTFT, 0.484, 0.4836, np.float64(TTFT)])
def test_time_to_first_token_valid_forms(answer):
    correct(exercises.check_time_to_first_token(answer), "compute-bound")

# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_after_the_notebooks_set_up_cell():
    assert_solutions_pass(run_notebook("where_time_goes", code_cells("where_time_goes")[:1]),
                          exercises, {1: exercises.check_roofline_time,
                                      2: exercises.check_batched_bytes,
                                      3: exercises.check_time_to_first_token})


def test_the_notebook_keeps_no_figure_of_the_invented_machine():
    """It used to claim "about 190 times the FLOPs, about 20 times the time" from an invented
    machine, and "the sum grows like N" with the cache."""
    text = notebook_path("where_time_goes").read_text(encoding="utf-8")
    assert "190 times" not in text and "20 times the time" not in text
    assert not re.search(r"sum grows like N\b", text)
