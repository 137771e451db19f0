"""Notebook 09 (counting the work): the FLOP counts it shows, pass by pass and over long
contexts, its cost explorer driven headless, and its exercise checkers, with tables of typical
wrong answers (each with its diagnosis) and of valid answers in other forms; the published
solutions run in the notebook's own variables, and every cell can be run twice."""

import re

import numpy as np
import pytest
from checker_cases import MORE_ODD_ANSWERS, correct, not_yet, odd_answers
from notebook_runs import assert_solutions_pass, notebook_path, run_notebook

import kvlib
from kvlib import roofline
from kvlib.exercises import counting_the_work as exercises
from kvlib.widgets import counting_the_work as widgets
from kvlib.widgets import where_time_goes

GPT2 = kvlib.GPT2_SMALL
SMALL = kvlib.ModelConfig(vocab_size=50, d_model=12, n_heads=3, n_layers=2, d_ff=20,
                          context_length=40, dtype="float32")
PARTS = ["projections", "attention_scores", "attention_sums", "mlp", "unembedding"]


# ---------------------------------------------------------------------------------------------
# FLOPs pass by pass
# ---------------------------------------------------------------------------------------------

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
    lab = where_time_goes.LAB_MODEL
    assert roofline.weights_bytes(lab) == 54_525_952
    lab_ratio = (kvlib.generation_multiply_adds(lab, 16, 256, use_cache=False).total
                 / kvlib.generation_multiply_adds(lab, 16, 256).total)
    assert round(lab_ratio, 1) == 127.9

# ---------------------------------------------------------------------------------------------
# Long contexts
# ---------------------------------------------------------------------------------------------

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

# ---------------------------------------------------------------------------------------------
# The cost explorer
# ---------------------------------------------------------------------------------------------

def test_flop_units_follow_the_size():
    assert kvlib.flops.format_flops(49_920) == "49.9 kFLOPs"
    assert kvlib.flops.format_flops(2.7e13) == "27 TFLOPs"
    assert kvlib.flops.format_flops(137.2e9) == "137 GFLOPs"
    assert kvlib.flops.format_flops(12) == "12 FLOPs"
    assert kvlib.flops.flop_unit(0.5) == (1.0, "FLOPs")


@pytest.mark.usefixtures("no_figure_leaks")
def test_cost_explorer_draws_the_counted_curves():
    explorer = widgets.cost_explorer()
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


def test_cost_explorer_gives_each_model_its_own_lengths():
    explorer = widgets.cost_explorer()
    explorer.model.value = "the article's toy (3 layers, d 4)"
    assert (explorer.prompt.value, explorer.new_tokens.value) == (5, 28)
    assert "kFLOPs" in explorer.status.value and "0.0 GFLOPs" not in explorer.status.value
    explorer.model.value = "GPT-2 small (12 layers, d 768)"       # back: not the toy's 5 and 28
    assert (explorer.prompt.value, explorer.new_tokens.value) == (32, 512)
    assert "<b>196.9x</b>" in explorer.status.value
    explorer.model.value = "GPT-2 small's shapes, 32k context (hypothetical)"
    assert explorer.new_tokens.value == 16384 and explorer.prompt.max == 32768


def test_cost_explorer_fits_long_requests_into_the_context():
    explorer = widgets.cost_explorer(compute_rate=100e9, bandwidth=20e9)
    assert "Roofline prediction at 100 GFLOP/s and 20.0 GB/s" in explorer.status.value
    assert "<b>20.4x</b> faster" in explorer.status.value
    explorer.prompt.value = 1000
    assert explorer.new_tokens.value == 25
    assert "reduced to fit" in explorer.status.value
    with pytest.raises(ValueError, match="model must be one of"):
        widgets.cost_explorer(model="GPT-5")

# ---------------------------------------------------------------------------------------------
# Exercises 1: a forward pass's multiply-adds; 2: the FLOP ratio; 3: the crossover
# ---------------------------------------------------------------------------------------------

MEDIUM = exercises.GPT2_MEDIUM
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
def test_forward_macs_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_forward_macs(answer), diagnosis)


@pytest.mark.parametrize("answer", [
    RIGHT_09_1, kvlib.forward_multiply_adds(MEDIUM, 100, last_only=True),
    {k: float(v) for k, v in RIGHT_09_1.items()},
    {k: np.int64(v) for k, v in RIGHT_09_1.items()},
])
def test_forward_macs_valid_forms(answer):
    correct(exercises.check_forward_macs(answer), "multiply-adds")


RATIO_09_2 = (kvlib.generation_multiply_adds(GPT2, 128, 256, use_cache=False).total
              / kvlib.generation_multiply_adds(GPT2, 128, 256).total)


@pytest.mark.parametrize("answer, diagnosis", [
    (1 / RATIO_09_2, "with / without"), (0.00744, "with / without"),
    (103.5, "32-token prompt"), (130, "close: 3.2% below"), (140, "close: 4.2% above"),
    (13.4, "not that"), (1342.6, "not that"), ("134", "a number (a ratio)"),
    ([134.3, 103.5], "several"), (10**400, "far too large"), (float("nan"), "got nan"),
])
def test_flop_ratio_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_flop_ratio(answer), diagnosis)


@pytest.mark.parametrize("answer", [RATIO_09_2, 134.3, 134.33, 134, np.float64(134.3),
                                    np.array(134.3), np.float32(RATIO_09_2), [134.3],
                                    np.array([134.3])])
def test_flop_ratio_valid_forms(answer):
    correct(exercises.check_flop_ratio(answer), "134.3")


@pytest.mark.parametrize("answer, diagnosis", [
    (19200, "scores only"), (3200, "leaves out the MLP"), (6400, "leaves out the projections"),
    (240000, "divides d among the heads"), (4608, "GPT-2 small's"), (4800, "half of it"),
    (10124, "unembedding"), (9700, "close"), (123, "not that"), (9600.5, "not a whole number"),
    ("9600", "a number of positions"),
])
def test_attention_crossover_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_attention_crossover(answer), diagnosis)


@pytest.mark.parametrize("answer", [9600, 9600.0, np.int64(9600), 9.6e3, np.array(9600)])
def test_attention_crossover_valid_forms(answer):
    correct(exercises.check_attention_crossover(answer), "6 x d_model")


@pytest.mark.parametrize("label, value", odd_answers() + MORE_ODD_ANSWERS,
                         ids=[label for label, _ in odd_answers() + MORE_ODD_ANSWERS])
def test_the_forward_macs_checker_refuses_an_odd_value_in_any_entry(label, value):
    not_yet(exercises.check_forward_macs(changed(mlp=value)))


# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("counting_the_work"), exercises,
                          {1: exercises.check_forward_macs, 2: exercises.check_flop_ratio,
                           3: exercises.check_attention_crossover})


def test_every_cell_can_be_run_twice_in_a_row():
    """Students re-run cells: each code cell, run a second time at once, must neither fail
    nor leave a different state for the cells after it."""
    assert run_notebook("counting_the_work", each_twice=True)["answer"] is ...


def test_the_notebook_keeps_no_figure_of_the_invented_machine():
    """It used to claim "about 190 times the FLOPs, about 20 times the time" from an invented
    machine, and "the sum grows like N" with the cache."""
    text = notebook_path("counting_the_work").read_text(encoding="utf-8")
    assert "190 times" not in text and "20 times the time" not in text
    assert not re.search(r"sum grows like N\b", text)
