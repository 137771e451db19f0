"""Notebook 26 (local and global layers): the cache formula against live Gemma 3 caches of
random configurations, the widgets driven headless, vLLM's sliding-window rules as the notebook
writes them against kvlib's exercise functions, the exercise checkers with tables of typical
wrong answers (each with its diagnosis) and of valid answers in other forms, and the notebook's
solutions in its own variables (every cell is run twice by tests/test_cells_run_twice.py)."""

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import NOTEBOOKS, assert_solutions_pass, run_notebook

import kvlib
from kvlib import gemma3
from kvlib.checkpoints.gemma3 import GEMMA3_270M, Gemma3Config
from kvlib.exercises import local_and_global_layers as exercises
from kvlib.memory import MiB
from kvlib.serving.kv_cache_manager import freeable_blocks
from kvlib.widgets import local_and_global_layers as widgets

# ---------------------------------------------------------------------------------------------
# The formula against live caches
# ---------------------------------------------------------------------------------------------


@st.composite
def hybrid_configs(draw):
    n_layers = draw(st.integers(1, 5))
    kinds = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                          min_size=n_layers, max_size=n_layers))
    n_kv = draw(st.sampled_from([1, 2]))
    return Gemma3Config(vocab_size=32, hidden_size=8, intermediate_size=12,
                        num_hidden_layers=n_layers, num_attention_heads=2 * n_kv,
                        num_key_value_heads=n_kv, head_dim=4, layer_types=tuple(kinds),
                        sliding_window=draw(st.integers(1, 9)), max_position_embeddings=64,
                        dtype="float64")


@settings(max_examples=30, deadline=None)
@given(config=hybrid_configs(), lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3))
def test_the_formula_is_what_a_live_cache_holds(config, lengths):
    """Prefill and decode in chunks of random lengths: after each, nbytes is the formula's
    (a sliding layer min(T, W) rows, a global one T)."""
    params = gemma3.init_gemma3_params(config, seed=len(lengths))
    ids = np.random.default_rng(sum(lengths)).integers(0, config.vocab_size, sum(lengths))
    cache, seen = gemma3.Gemma3Cache(config), 0
    for n in lengths:
        gemma3.prefill(params, ids[seen:seen + n], cache, last_only=True)
        seen += n
        assert cache.nbytes == kvlib.local_global_cache_bytes(
            config.layer_windows, seen, config.num_key_value_heads, config.head_dim,
            dtype_bytes=8)


def test_gemma3_270m_numbers():
    assert kvlib.local_global_cache_bytes(GEMMA3_270M.layer_windows, 32_768, 1, 256) == \
        103.5 * MiB
    assert widgets.cache_bytes(widgets.MODELS[2], 32_768) == 576 * MiB
    assert widgets.cache_bytes(widgets.MODELS[0], 8_193) is None
    assert widgets.split_by_layer_type(GEMMA3_270M, 32_768) == {"sliding": 7.5 * MiB,
                                                               "global": 96 * MiB}


@pytest.mark.parametrize("windows", [[], None, [0, None], [True], [2.5], "512", [None, -1]])
def test_layer_windows_refused_in_words(windows):
    with pytest.raises(ValueError, match="layer_windows must be a non-empty list"):
        kvlib.local_global_cache_bytes(windows, 10, 1, 4)


# ---------------------------------------------------------------------------------------------
# The widgets
# ---------------------------------------------------------------------------------------------

def test_layer_pattern_draws_every_layer():
    fig, ax = plt.subplots()
    widgets.layer_pattern(ax, GEMMA3_270M)
    assert len(ax.patches) == 18 and "15 slide" in ax.get_title()
    plt.close(fig)


def test_the_explorer_answers_and_leaks_no_figure(no_figure_leaks):
    explorer = widgets.cache_growth_explorer(n_tokens=8_192)
    assert "31.5 MiB" in explorer.status.value and "180.0 MiB" in explorer.status.value
    explorer.length.value = 32_768
    assert "103.5 MiB" in explorer.status.value and "past its context" in explorer.status.value
    assert "93%" in explorer.axes[1].get_title()
    explorer.dtype.value = 4
    assert "207.0 MiB" in explorer.status.value and explorer.message.value == ""
    lines = explorer.axes[0].get_lines()
    assert len(lines) == 4 and lines[-1].get_xdata()[0] == 32_768        # 3 models + marker


@pytest.mark.parametrize("options, match", [
    ({"n_tokens": 0}, "n_tokens"), ({"n_tokens": 40_000}, "n_tokens"),
    ({"n_tokens": "8k"}, "n_tokens"), ({"dtype_bytes": 3}, "dtype_bytes"),
])
def test_the_explorer_refuses_bad_starting_values(options, match):
    with pytest.raises(ValueError, match=match):
        widgets.cache_growth_explorer(**options)


def test_the_measured_text_is_the_tools():
    kept = json.loads((NOTEBOOKS / "data" / "local_and_global_layers.json").read_text())
    assert len(kept["ids"]) == 641 and kept["ids"][0] == 2 and kept["past"] == 512
    measured = kept["measured"]
    assert measured["loss_no_window"] > measured["loss_window"] + 0.3


# ---------------------------------------------------------------------------------------------
# vLLM's sliding-window rules
# ---------------------------------------------------------------------------------------------

@given(window=st.integers(1, 40), block=st.integers(1, 16), computed=st.integers(0, 200))
def test_the_freed_blocks_are_exactly_those_no_later_query_reads(window, block, computed):
    """A block may go when every position in it is older than the next query's window
    (which starts at computed - window + 1); vLLM 0.33.0's docstring example too."""
    freed = freeable_blocks(computed, window, block)
    first_read = computed - window + 1
    for index in range(computed // block + 1):
        assert (index in freed) == ((index + 1) * block <= first_read)


def test_vllm_docstring_example():
    # get_num_skipped_tokens(7) == 4 for sliding_window=4: with blocks of 2, blocks 0 and 1
    assert list(freeable_blocks(7, 4, 2)) == [0, 1]


# ---------------------------------------------------------------------------------------------
# Exercises 1: bytes at 8,192 tokens; 2: blocks a sliding layer frees; 3: global layers
# ---------------------------------------------------------------------------------------------

EXPECTED_BYTES = (3 * 8192 + 15 * 512) * 1024


@pytest.mark.parametrize("answer, diagnosis", [
    (18 * 8192 * 1024, "every layer keeping"), (3 * 8192 * 1024, "3 global layers only"),
    (15 * 512 * 1024, "15 sliding layers only"), ((3 * 8192 + 15 * 511) * 1024, "511 rows"),
    (EXPECTED_BYTES // 2, "K and V"), (EXPECTED_BYTES * 2, "2 bytes"),
    (EXPECTED_BYTES * 4, "1 K/V head"), (EXPECTED_BYTES * 8, "bits"),
    (31.5, "not KiB or MiB"), (EXPECTED_BYTES // 1024, "not KiB or MiB"),
    (EXPECTED_BYTES + 1024, "close"), (12, "not that"), ("33030144", "a number of bytes"),
])
def test_cache_bytes_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_cache_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [EXPECTED_BYTES, float(EXPECTED_BYTES),
                                    np.int64(EXPECTED_BYTES), 31.5 * MiB, [EXPECTED_BYTES]])
def test_cache_bytes_valid_forms(answer):
    correct(exercises.check_cache_bytes(answer), "33,030,144 bytes")


@pytest.mark.parametrize("answer, diagnosis", [
    ([0, 1, 2, 3], "block 4 may go"), ([0, 1, 2, 3, 4, 5], "still reads"),
    ([1, 2, 3, 4, 5], "from 0"), ([1, 2, 3, 4], "no attention sinks"), ([], "some blocks"),
    ([0, 5], "must stay"), ([0, 1], "not those"), (4, "not one number"),
    ([0, 0, 1, 2, 3], "twice"), ([-1, 0], "start at 0"), ([0.5, 1], "block index"),
    ("0, 1, 2, 3, 4", "a list of block indices"), ({"0": 1}, "a list of block indices"),
])
def test_blocks_to_free_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_blocks_to_free(answer), diagnosis)


@pytest.mark.parametrize("answer", [[0, 1, 2, 3, 4], (4, 3, 2, 1, 0), {0, 1, 2, 3, 4}, range(5),
                                    np.arange(5), [0.0, 1.0, 2.0, 3.0, 4.0]])
def test_blocks_to_free_valid_forms(answer):
    correct(exercises.check_blocks_to_free(answer), "blocks 0 to 4")


@pytest.mark.parametrize("answer, diagnosis", [
    ([6, 12, 18, 24], "counted from 1"), ([0, 6, 12, 18, 24], "layer 0 global"),
    ([5, 11, 17, 23, 25], "not global by itself"), ([5, 11, 17], "270M"),
    ([5, 11, 17, 26], "layers 0 to 25"), ([5, 10, 15, 20, 25], "not those"),
    (5, "not one number"), ("5, 11, 17, 23", "list of layer indices"),
])
def test_global_layers_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_global_layers(answer), diagnosis)


@pytest.mark.parametrize("answer", [[5, 11, 17, 23], (23, 17, 11, 5), range(5, 26, 6),
                                    np.array([5, 11, 17, 23])])
def test_global_layers_valid_forms(answer):
    correct(exercises.check_global_layers(answer), "layers 5, 11, 17 and 23")


# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables(monkeypatch):
    monkeypatch.chdir(NOTEBOOKS)           # the notebook reads data/ beside it, as in Jupyter
    namespace = run_notebook("local_and_global_layers")
    assert namespace["blocks_to_free"](27, 8, 4) == list(freeable_blocks(27, 8, 4))
    assert_solutions_pass(namespace, exercises, {1: exercises.check_cache_bytes,
                                                 2: exercises.check_blocks_to_free,
                                                 3: exercises.check_global_layers})
