"""Notebook 27 (keeping what attention reads): the notebook's policies written in a few lines
against kvlib.eviction's over random shapes (hypothesis), the measured data's shape and what
the notebook says of it, the curves explorer driven headless, the exercise checkers with
tables of typical wrong answers (each with its diagnosis) and of valid answers in other forms,
and the notebook's solutions in its own variables (every cell is run twice by
tests/test_cells_run_twice*.py)."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import NOTEBOOKS, assert_solutions_pass, run_notebook

import kvlib
from kvlib import eviction
from kvlib.exercises import keeping_what_attention_reads as exercises
from kvlib.memory import MiB
from kvlib.widgets import keeping_what_attention_reads as widgets

DATA = json.loads((NOTEBOOKS / "data" / "keeping_what_attention_reads.json").read_text())


@pytest.fixture(scope="module")
def namespace():
    """The notebook's variables after one run, in the notebook's folder (it reads data/)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(NOTEBOOKS)
        return run_notebook("keeping_what_attention_reads")


# ---------------------------------------------------------------------------------------------
# The notebook's policies, a few lines each, against kvlib's
# ---------------------------------------------------------------------------------------------

@st.composite
def pass_inputs(draw):
    """What a policy is given: weights (kv, group, T, S) of a pass, accumulated scores, and
    a budget below the held rows."""
    n_kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n_held = draw(st.integers(13, 40))
    n_queries = draw(st.integers(9, n_held))            # SnapKV's window of 8 needs 8 queries
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_kv, group, n_queries, n_held)) * draw(st.sampled_from([0.5, 3]))
    weights = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    scores = rng.random((n_kv, n_held)) * 5
    budget = draw(st.integers(9, n_held - 1))
    return weights, scores, budget


@settings(max_examples=40, deadline=None)
@given(inputs=pass_inputs())
def test_the_notebooks_policies_are_kvlibs(namespace, inputs):
    weights, scores, budget = inputs
    n_kv, group, n_queries, n_held = weights.shape
    positions = np.broadcast_to(np.arange(n_held), (n_kv, n_held))
    by_hand = {
        "window": [namespace["window_keep"](n_held, budget)] * n_kv,
        "sinks": [namespace["sinks_keep"](n_held, budget)] * n_kv,
        "h2o": [namespace["h2o_keep"](scores[k], budget) for k in range(n_kv)],
        "tova": [namespace["tova_keep"](weights.reshape(-1, n_queries, n_held), budget)] * n_kv,
        "snapkv": [namespace["snapkv_keep"](weights[k], budget) for k in range(n_kv)],
    }
    for name, kept in by_hand.items():
        policy = eviction.POLICIES[name]()
        assert np.array_equal(np.array(kept), policy.keep(positions, scores, weights, budget,
                                                          first_pass=True)), name


@pytest.mark.parametrize("n_layers, budget", [(30, 128), (30, 32), (2, 16), (18, 512)])
def test_the_notebooks_pyramid_is_kvlibs(namespace, n_layers, budget):
    assert namespace["pyramid"](n_layers, budget) == kvlib.pyramid_budgets(n_layers, budget)
    published = namespace["pyramid_as_published"](n_layers, budget)
    assert published[0] == kvlib.pyramid_budgets(n_layers, budget)[0]
    assert sum(published) >= n_layers * budget == sum(kvlib.pyramid_budgets(n_layers, budget))


def test_the_notebooks_variables(namespace):
    assert namespace["query_weights"].shape == (30, 9, 600)
    assert namespace["measured"] == DATA
    assert namespace["share_top10"].min() > 0.5
    assert set(namespace["small_caches"]) == set(eviction.POLICIES)


# ---------------------------------------------------------------------------------------------
# The measured data
# ---------------------------------------------------------------------------------------------

def test_the_data_has_the_tools_shape():
    loss, copying, cost = DATA["loss"], DATA["copying"], DATA["cost"]
    assert len(loss["ids"]) == 1536 and loss["scored_from"] == 512 and loss["block"] == 64
    assert loss["budgets"] == copying["budgets"] == [32, 64, 128, 256, 512]
    assert set(loss["policies"]) == {"window", "sinks", "h2o", "tova"}
    assert len(loss["full"]["blocks"]) == 24
    for variant in ("question_last", "question_later"):
        assert set(copying[variant]["policies"]) == {"window", "sinks", "h2o", "tova",
                                                     "snapkv", "pyramidkv"}
    assert cost["budget"] == 128 and cost["position"] == 1535


def test_no_budget_beats_the_full_cache_by_more_than_rounding():
    full = DATA["loss"]["full"]["mean"]
    for rows in DATA["loss"]["policies"].values():
        for row in rows.values():
            assert row["mean"] > full - 0.01


# ---------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------

def test_the_curves_explorer_answers_and_leaks_no_figure(no_figure_leaks):
    explorer = widgets.curves_explorer(DATA)
    assert "full cache" in explorer.status.value and "not measured here" in explorer.status.value
    assert len(explorer.axes[0].get_lines()) == 5              # 4 policies + the ceiling
    explorer.measurement.value = "question_later"
    assert len(explorer.axes[0].get_lines()) == 7 and "not measured" not in explorer.status.value
    explorer.policies.value = ("tova",)
    assert len(explorer.axes[0].get_lines()) == 2 and "TOVA" in explorer.status.value
    assert explorer.message.value == ""
    ceiling = explorer.axes[0].get_lines()[-1].get_ydata()[0]
    assert ceiling == DATA["copying"]["question_later"]["full"]


@pytest.mark.parametrize("options, match", [
    ({"measurement": "speed"}, "measurement"), ({"policies": ["lru"]}, "policy"),
])
def test_the_explorer_refuses_bad_starting_values(options, match):
    with pytest.raises(ValueError, match=match):
        widgets.curves_explorer(DATA, **options)


def test_a_curve_is_the_datas():
    budgets, values = widgets.curve(DATA, "loss", "tova")
    assert values[budgets.index(32)] == DATA["loss"]["policies"]["tova"]["32"]["mean"]
    with pytest.raises(ValueError, match="policy"):
        widgets.curve(DATA, "loss", "snapkv")
    fig, ax = plt.subplots()
    widgets.draw_curves(ax, DATA, "question_last", ["window", "snapkv", "lru"])
    assert [line.get_label() for line in ax.get_lines()] == ["window", "SnapKV",
                                                             "full cache (ceiling)"]
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Exercises 1: TOVA's next drop; 2: bytes at a budget; 3: SnapKV's kept positions
# ---------------------------------------------------------------------------------------------

def test_exercise_answers_follow_the_rules():
    mean = exercises.EXERCISE1_WEIGHTS.mean(axis=0)
    assert exercises.tova_dropped() == exercises.EXERCISE1_POSITIONS[np.argmin(mean)] == 6
    assert np.sort(mean)[1] - mean.min() > 0.005                 # no near tie
    votes = np.pad(exercises.EXERCISE3_VOTES, 1)
    pooled = (votes[:-2] + votes[1:-1] + votes[2:]) / 3
    assert exercises.snapkv_kept() == tuple(sorted(np.argsort(-pooled)[:3].tolist() + [8, 9]))


def test_the_bytes_are_a_live_caches():
    config = kvlib.load_smollm2().config
    cache = kvlib.EvictingCache(config, 256, "window")
    ids = np.arange(300) % 1000 + 100
    kvlib.prefill(kvlib.load_smollm2(), ids, cache, last_only=True)
    assert len(cache) == 300 and cache.nbytes == exercises.evicting_bytes() == 11_796_480


@pytest.mark.parametrize("answer, diagnosis", [
    (3, "column (slot)"), (2, "head 0 alone"), (5, "head 1 alone"), (8, "head 2 alone"),
    (0, "oldest"), (9, "current token"), (4, "TOVA drops one of them"),
    (7, "TOVA drops one of them"), ("6", "without quotes"), (6.5, "whole number"),
])
def test_tova_drop_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_tova_drop(answer), diagnosis)


@pytest.mark.parametrize("answer", [6, 6.0, np.int64(6), [6], np.array(6)])
def test_tova_drop_valid_forms(answer):
    correct(exercises.check_tova_drop(answer), "position 6")


EXPECTED_BYTES = 30 * 2 * 3 * 64 * 4 * 256


@pytest.mark.parametrize("answer, diagnosis", [
    (EXPECTED_BYTES // 256 * 2000, "2,000 positions"), (EXPECTED_BYTES // 256 * 257, "257"),
    (EXPECTED_BYTES + 30 * 3 * 256 * 16, "index_bytes"), (EXPECTED_BYTES * 3, "3 K/V heads"),
    (EXPECTED_BYTES // 2, "K and V, both"), (EXPECTED_BYTES * 8, "bits"),
    (EXPECTED_BYTES // 30, "one layer"), (11.25, "not KiB or MiB"),
    (EXPECTED_BYTES // 1024, "not KiB or MiB"), (EXPECTED_BYTES + 4096, "close"),
    (12, "a layer holds 256"), ("11796480", "a number of bytes"),
])
def test_evicting_bytes_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_evicting_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [EXPECTED_BYTES, float(EXPECTED_BYTES),
                                    np.int64(EXPECTED_BYTES), 11.25 * MiB, [EXPECTED_BYTES]])
def test_evicting_bytes_valid_forms(answer):
    correct(exercises.check_evicting_bytes(answer), "11,796,480 bytes")


@pytest.mark.parametrize("answer, diagnosis", [
    ([0, 1, 6], "window (positions 8 and 9) as well"), ([0, 1, 2, 5, 6], "whole budget"),
    ([0, 1, 2, 5, 6, 8, 9], "7 positions"), ([0, 3, 6, 8, 9], "raw votes"),
    ([0, 1, 7, 8, 9], "avg_pool1d"), ([0, 1, 2, 3, 4], "always kept"),
    ([0, 1, 6, 8, 10], "0 to 9"), ([0, 1, 5, 8, 9], "not those"), ([0, 1, 8, 9], "exactly"),
    ([0, 0, 1, 8, 9], "twice"), (6, "a list of the positions"), ("0, 1, 6, 8, 9", "a list"),
    ([0, 1.5, 6, 8, 9], "whole number"),
])
def test_snapkv_kept_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_snapkv_kept(answer), diagnosis)


@pytest.mark.parametrize("answer", [[0, 1, 6, 8, 9], (9, 8, 6, 1, 0), {0, 1, 6, 8, 9},
                                    np.array([0, 1, 6, 8, 9]), [0.0, 1.0, 6.0, 8.0, 9.0]])
def test_snapkv_kept_valid_forms(answer):
    correct(exercises.check_snapkv_kept(answer), "positions 0, 1, 6")


# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables(namespace):
    assert_solutions_pass(namespace, exercises, {1: exercises.check_tova_drop,
                                                 2: exercises.check_evicting_bytes,
                                                 3: exercises.check_snapkv_kept})
