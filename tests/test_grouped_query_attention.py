"""Notebook 15 (grouped-query attention): kvlib.grouped against plain references (hypothesis,
float64, 1e-10), the grouping explorer driven headless as a student would drive it, the
exercise checkers with tables of typical wrong answers (each with its diagnosis) and of valid
answers in other forms, and SmolLM2's grouping."""

import json
import math
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import case_id, correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.collections import LineCollection, PatchCollection
from notebook_runs import assert_solutions_pass, run_notebook
from strategies import models, token_lists
from widget_checks import text_of

import kvlib
from kvlib import (
    grouped,
    plots,
    roofline,
)
from kvlib.exercises import grouped_query_attention as exercises
from kvlib.memory import PRESETS, GiB
from kvlib.model import attention as attention_by_another_name
from kvlib.widgets import grouped_query_attention as widgets

TOLERANCE = 1e-10
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / \
    "15_grouped_query_attention.ipynb"


# ---------------------------------------------------------------------------------------------
# kvlib.grouped against plain references
# ---------------------------------------------------------------------------------------------

@st.composite
def grouped_shapes(draw):
    """(n_heads, n_kv_heads, T, S, head_dim) with n_kv_heads a divisor of n_heads."""
    n_heads = draw(st.integers(1, 12))
    n_kv_heads = draw(st.sampled_from(widgets.divisors(n_heads)))
    T = draw(st.integers(1, 6))
    return n_heads, n_kv_heads, T, T + draw(st.integers(0, 6)), draw(st.integers(1, 5))


@given(grouped_shapes(), st.integers(0, 2**32 - 1), st.booleans())
@settings(max_examples=80, deadline=None)
def test_broadcast_attention_equals_attention_on_repeated_kv_heads(shapes, seed, masked):
    n_heads, n_kv_heads, T, S, head_dim = shapes
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((n_heads, T, head_dim))
    K = rng.standard_normal((n_kv_heads, S, head_dim))
    V = rng.standard_normal((n_kv_heads, S, head_dim))
    mask = kvlib.causal_mask(T, S) if masked else None
    K_all, V_all = grouped.repeat_kv_heads(K, n_heads), grouped.repeat_kv_heads(V, n_heads)
    np.testing.assert_allclose(kvlib.attention_scores(Q, K),
                               Q @ K_all.swapaxes(-1, -2) / math.sqrt(head_dim),
                               rtol=0, atol=TOLERANCE)
    reference = kvlib.attention(Q, K_all, V_all, mask)     # ordinary multi-head attention
    np.testing.assert_allclose(kvlib.attention(Q, K, V, mask), reference, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(grouped.repeated_attention(Q, K, V, mask), reference, rtol=0,
                               atol=TOLERANCE)


@given(grouped_shapes(), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_query_head_i_reads_kv_head_i_div_group(shapes, seed):
    n_heads, n_kv_heads, _, S, head_dim = shapes
    K = np.random.default_rng(seed).standard_normal((n_kv_heads, S, head_dim))
    repeated = grouped.repeat_kv_heads(K, n_heads)
    groups = grouped.query_groups(n_heads, n_kv_heads)
    assert repeated.shape == (n_heads, S, head_dim)
    group = grouped.group_size(n_heads, n_kv_heads)
    for head in range(n_heads):
        assert groups[head] == head // group
        np.testing.assert_array_equal(repeated[head], K[head // group])
    # consecutive heads share: every K/V head serves one block of `group` query heads
    assert [list(groups).count(kv) for kv in range(n_kv_heads)] == [group] * n_kv_heads
    assert list(groups) == sorted(groups)


def test_the_tile_order_is_a_different_pairing():
    K = np.arange(2)[:, None, None] * np.ones((2, 3, 2))      # K/V head j holds j everywhere
    assert grouped.repeat_kv_heads(K, 8)[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert np.tile(K, (4, 1, 1))[:, 0, 0].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]


@st.composite
def grouped_models(draw, **options):
    """(params, config) of a random non-latent model with n_kv_heads a divisor of n_heads,
    below n_heads whenever n_heads > 1."""
    _, config = draw(models(latent=False, **options))
    fewer = [k for k in widgets.divisors(config.n_heads) if k < config.n_heads] or [1]
    config = config.replace(n_kv_heads=draw(st.sampled_from(fewer)))
    return kvlib.init_params(config, seed=draw(st.integers(0, 10_000))), config


@given(models(latent=False), st.data())
@settings(max_examples=30, deadline=None)
def test_as_many_kv_heads_as_query_heads_is_multi_head_attention_exactly(model, data):
    _, config = model
    mha = kvlib.init_params(config.replace(n_kv_heads=None), seed=data.draw(st.integers(0, 99)))
    named = mha.with_config(n_kv_heads=config.n_heads)
    ids = token_lists(data.draw, config, 1, 12)
    np.testing.assert_array_equal(kvlib.forward(named, ids), kvlib.forward(mha, ids))
    # the conversions leave a multi-head model as it is
    for same in (grouped.duplicate_kv_heads(mha), grouped.mean_pool_kv_heads(mha, config.n_heads)):
        assert same.config == mha.config
        for layer, original in zip(same.layers, mha.layers):
            np.testing.assert_array_equal(layer.Wk, original.Wk)
            np.testing.assert_array_equal(layer.Wv, original.Wv)


@given(grouped_models(), st.data())
@settings(max_examples=40, deadline=None)
def test_grouped_model_equals_its_multi_head_twin_with_copied_kv_heads(model, data):
    params, config = model
    twin = grouped.duplicate_kv_heads(params)
    assert twin.config == config.replace(n_kv_heads=None)
    ids = token_lists(data.draw, config, 1, 16)
    np.testing.assert_allclose(kvlib.forward(params, ids), kvlib.forward(twin, ids), rtol=0,
                               atol=TOLERANCE)
    _, cache = kvlib.prefill(params, ids)
    _, twin_cache = kvlib.prefill(twin, ids)
    assert twin_cache.nbytes == config.n_heads // config.kv_heads * cache.nbytes
    # pooling heads that are equal in each group gives the grouped model back
    back = grouped.mean_pool_kv_heads(twin, config.kv_heads)
    assert back.config == config or config.kv_heads == config.n_heads
    np.testing.assert_allclose(kvlib.forward(back, ids), kvlib.forward(params, ids), rtol=0,
                               atol=TOLERANCE)


@given(grouped_models(window=False), st.data())
@settings(max_examples=40, deadline=None)
def test_cached_decoding_of_grouped_models_equals_recomputation(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 1, 8)
    n_new = data.draw(st.integers(1, 10))
    logits, cache = kvlib.prefill(params, ids)
    sequence = list(ids)
    for _ in range(n_new):
        token = data.draw(st.integers(0, config.vocab_size - 1))
        sequence.append(token)
        logits = kvlib.decode_step(params, token, cache)
        np.testing.assert_allclose(logits[-1], kvlib.forward(params, sequence)[-1], rtol=0,
                                   atol=TOLERANCE)
        # the live cache's bytes are the formula's, for the K/V heads only
        assert cache.keys(0).shape == (len(sequence), config.kv_heads * config.head_dim)
        assert cache.nbytes == kvlib.kv_cache_bytes(
            config.n_layers, None, len(sequence), dtype_bytes=8, n_kv_heads=config.kv_heads,
            head_dim=config.head_dim) == kvlib.config_cache_bytes(config, len(sequence))


@given(grouped_models())
@settings(max_examples=30, deadline=None)
def test_mean_pooling_averages_the_kv_projections_of_each_group(model):
    _, config = model
    mha = kvlib.init_params(config.replace(n_kv_heads=None))
    n_kv_heads = config.kv_heads
    pooled = grouped.mean_pool_kv_heads(mha, n_kv_heads)
    dh, group = config.head_dim, config.n_heads // n_kv_heads
    assert pooled.config.kv_heads == n_kv_heads
    for layer, original in zip(pooled.layers, mha.layers):
        assert layer.Wk.shape == layer.Wv.shape == (config.d_model, n_kv_heads * dh)
        for kv in range(n_kv_heads):
            members = [original.Wk[:, h * dh:(h + 1) * dh]
                       for h in range(kv * group, (kv + 1) * group)]
            np.testing.assert_allclose(layer.Wk[:, kv * dh:(kv + 1) * dh],
                                       np.mean(members, axis=0), rtol=0, atol=1e-14)
        np.testing.assert_array_equal(layer.Wq, original.Wq)
        if original.bk is not None:
            assert layer.bk.shape == layer.bv.shape == (n_kv_heads * dh,)


def test_pooling_a_random_multi_head_model_changes_its_output():
    config = exercises.LESSON_CONFIG.replace(n_kv_heads=None)
    mha = kvlib.init_params(config)
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    for n_kv_heads in (4, 2, 1):
        pooled = grouped.mean_pool_kv_heads(mha, n_kv_heads)
        assert np.abs(kvlib.forward(pooled, ids) - kvlib.forward(mha, ids)).max() > 1.0


def test_float32_models_stay_float32():
    config = exercises.LESSON_CONFIG.replace(dtype="float32")
    params = kvlib.init_params(config)
    for converted in (grouped.duplicate_kv_heads(params),
                      grouped.mean_pool_kv_heads(grouped.duplicate_kv_heads(params), 1)):
        assert all(layer.Wk.dtype == np.float32 for layer in converted.layers)


@given(grouped_models(window=False), st.integers(0, 30))
@settings(max_examples=30, deadline=None)
def test_fewer_kv_heads_shrink_the_projections_and_the_cache_reads_not_the_attention(model,
                                                                                      position):
    params, config = model
    mha = config.replace(n_kv_heads=None)
    group = config.n_heads // config.kv_heads
    gqa_work = kvlib.decode_step_multiply_adds(config, position)
    mha_work = kvlib.decode_step_multiply_adds(mha, position)
    assert gqa_work.attention_scores == mha_work.attention_scores
    assert gqa_work.attention_sums == mha_work.attention_sums
    assert mha_work.projections - gqa_work.projections == \
        config.n_layers * 2 * config.d_model * (config.d_model - config.kv_width)
    assert roofline.cache_bytes(mha, position + 1) == group * roofline.cache_bytes(
        config, position + 1)


def test_the_flop_count_of_a_grouped_decode_step_is_the_formula():
    params = kvlib.init_params(exercises.LESSON_CONFIG)
    _, cache = kvlib.prefill(params, [0, 3, 7, 1, 9])
    _, counted = kvlib.count_multiply_adds(kvlib.decode_step, params, 5, cache)
    assert counted == kvlib.decode_step_multiply_adds(exercises.LESSON_CONFIG, 5)


@pytest.mark.parametrize("call, error, words", [
    (lambda: grouped.query_groups(8, 3), ValueError, "multiple of n_kv_heads"),
    (lambda: grouped.query_groups(8, 0), ValueError, "at least 1"),
    (lambda: grouped.query_groups(8, True), TypeError, "whole number"),
    (lambda: grouped.query_groups(8.0, 2), TypeError, "whole number"),
    (lambda: grouped.repeat_kv_heads(np.zeros((3, 4)), 6), ValueError, "3-D array"),
    (lambda: grouped.repeat_kv_heads(np.zeros((3, 4, 2)), 8), ValueError, "multiple"),
    (lambda: grouped.repeated_attention(np.zeros((4, 2)), np.zeros((2, 3, 2)),
                                        np.zeros((2, 3, 2))), ValueError, "Q must be"),
    (lambda: grouped.repeated_attention(np.zeros((4, 1, 2)), np.zeros((2, 3, 3)),
                                        np.zeros((2, 3, 3))), ValueError, "one head size"),
    (lambda: grouped.repeat_kv_heads(np.zeros((1, 2, 2)), 10**400), ValueError, "at most"),
    (lambda: grouped.repeated_attention(np.zeros((4, 1, 2)), np.zeros((2, 3, 2)),
                                        np.zeros((2, 3, 2)), np.ones((2, 3), dtype=bool)),
     ValueError, "mask must be"),
    (lambda: grouped.mean_pool_kv_heads(kvlib.init_params(exercises.LESSON_CONFIG), 4), ValueError,
     "must divide 2"),
    (lambda: grouped.mean_pool_kv_heads("params", 1), TypeError, "must be kvlib Params"),
    (lambda: grouped.duplicate_kv_heads(kvlib.init_params(kvlib.ModelConfig(latent_dim=2))),
     ValueError, "latent"),
])
def test_bad_input_is_refused_in_words(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ---------------------------------------------------------------------------------------------
# The grouping explorer
# ---------------------------------------------------------------------------------------------

def collections_of(ax):
    patches = [c for c in ax.collections if isinstance(c, PatchCollection)]
    lines = [c for c in ax.collections if isinstance(c, LineCollection)]
    return patches, lines


def assert_grouping_drawn(ax, n_heads, n_kv_heads):
    (query_boxes, kv_boxes), (links,) = collections_of(ax)
    assert len(query_boxes.get_paths()) == n_heads and len(kv_boxes.get_paths()) == n_kv_heads
    group = n_heads // n_kv_heads
    query_colors, kv_colors = query_boxes.get_facecolors(), kv_boxes.get_facecolors()
    for head, segment in enumerate(links.get_segments()):
        kv = head // group
        np.testing.assert_allclose(segment[-1], [(kv + 0.5) * group, 0.8])   # ends under it
        np.testing.assert_allclose(query_colors[head], kv_colors[kv])         # its colour
    assert len({tuple(c) for c in kv_colors}) == n_kv_heads                   # told apart


def test_explorer_starts_on_llama_3_8b():
    widget = widgets.grouping_explorer()
    assert widget.preset.value == "Llama-3-8B" and widget.kv_heads.value == 8
    assert widget.kv_heads.options == (1, 2, 4, 8, 16, 32)
    status = text_of(widget.status.value)
    assert "GQA: 32 query heads share 8 K/V heads, 4 to a group" in status
    assert "query head 5 reads K/V head 1, shared by query heads 4-7" in status
    assert "= 131,072 bytes, 4 times less than the 524,288 of multi-head attention" in status
    assert "In 16 GiB of cache: 131,072 cached tokens, against 32,768" in status
    assert "Meta Llama 3 model card" in widget.source.value
    assert "You chose" not in widget.source.value
    assert widget.message.value == ""
    assert_grouping_drawn(widget.axes[0], 32, 8)
    bars = widget.axes[1].patches
    assert [b.get_height() for b in bars] == [PRESETS["Llama-3-8B"].kv_cache_bytes(1) * k / 8 / 1024
                                             for k in (1, 2, 4, 8, 16, 32)]
    chosen = [i for i, b in enumerate(bars) if matplotlib.colors.to_hex(b.get_facecolor())
              == widgets.CHOSEN_COLOR]
    assert chosen == [3]
    assert widget.summary()["tokens_that_fit"] == 131_072


def test_choosing_kv_heads_redraws_the_grouping_and_the_numbers():
    widget = widgets.grouping_explorer()
    widget.kv_heads.value = 1
    assert "MQA: 32 query heads share 1 K/V head, 32 to a group" in text_of(widget.status.value)
    assert "= 16,384 bytes, 32 times less" in text_of(widget.status.value)
    assert_grouping_drawn(widget.axes[0], 32, 1)
    widget.kv_heads.value = 32
    assert "MHA" in widget.status.value and "shared by query head 2 alone" in widget.status.value
    assert_grouping_drawn(widget.axes[0], 32, 32)
    assert "You chose 32 K/V heads; the published model has 8" in widget.source.value
    assert widget.preset.value == "Llama-3-8B"           # still the model, other K/V heads


def test_the_bars_and_their_numbers_say_one_thing_kib_per_token():
    widget = widgets.grouping_explorer()
    ax = widget.axes[1]
    heights = [bar.get_height() for bar in ax.patches]
    assert [text.get_text() for text in ax.texts] == [f"{h:,.0f}" for h in heights] == \
        ["16", "32", "64", "128", "256", "512"]
    assert "KiB per token" in ax.get_ylabel() and "KiB per token" in ax.get_title()
    widget.budget_gib.value = 1.0                  # the budget changes the status, not the bars
    assert [text.get_text() for text in ax.texts][3] == "128"
    assert "In 1 GiB of cache: 8,192 cached tokens" in text_of(widget.status.value)
    assert widgets.kib_text(131_072) == "128" and widgets.kib_text(36) == "0.0352"


def test_readouts_count_in_words_with_one_of_each():
    widget = widgets.grouping_explorer("Falcon-7B")
    assert "71 query heads, 1 K/V head of 64" in widget.source.value
    widget.kv_heads.value = 71                     # multi-head attention: nothing saved
    status = text_of(widget.status.value)
    assert "MHA: 71 query heads each with a K/V head of its own" in status
    assert "as much as multi-head attention" in status and "1 times" not in status
    assert "You chose 71 K/V heads; the published model has 1" in widget.source.value
    widget.n_heads.value, widget.layers.value = 1, 1
    status = text_of(widget.status.value)
    assert "MHA: 1 query head each with a K/V head of its own" in status
    assert "2 (K and V) x 1 layer x 1 K/V head x 64 x 2 bytes = 256 bytes" in status
    ylabels = [label.get_text() for label in widget.axes[0].get_yticklabels()]
    assert ylabels == ["1 K/V head\n(cached)", "1 query head\n(not cached)"]
    assert not re.search(r"\b1 (query heads|K/V heads|layers|cached tokens)", status)
    widget.budget_gib.value = 256 / GiB            # room for exactly one token
    assert "1 cached token," in text_of(widget.status.value)


def test_presets_load_their_shapes():
    widget = widgets.grouping_explorer("Llama-2-7B")
    widget.preset.value = "Falcon-7B"
    assert widget.kv_heads.options == (1, 71) and widget.kv_heads.value == 1
    assert "71 query heads share 1 K/V head, 71 to a group" in text_of(widget.status.value)
    assert "581,632" in widget.status.value               # 71 x 8,192 for MHA
    assert_grouping_drawn(widget.axes[0], 71, 1)
    widget.preset.value = "Mistral-7B"
    assert "sliding window keeps at most 4,096 positions" in widget.source.value
    widget.preset.value = "Llama-2-70B"
    assert (widget.n_heads.value, widget.kv_heads.value, widget.layers.value) == (64, 8, 80)
    assert_grouping_drawn(widget.axes[0], 64, 8)
    assert not any("DeepSeek" in name for name in widget.preset.options)   # latent: notebook 16


def test_a_custom_model_gets_the_divisors_of_its_query_heads():
    widget = widgets.grouping_explorer()
    widget.n_heads.value = 12
    assert widget.preset.value == widgets.CUSTOM
    assert widget.kv_heads.options == (1, 2, 3, 4, 6, 12)
    assert widget.kv_heads.value == 6                      # 8 no longer divides: the next below
    assert widget.source.value == "" and widget.message.value == ""
    widget.kv_heads.value = 3
    widget.head_dim.value, widget.layers.value = 64, 10
    assert widget.summary()["bytes_per_token"] == kvlib.kv_cache_bytes(10, None, 1, n_kv_heads=3,
                                                                       head_dim=64)
    assert_grouping_drawn(widget.axes[0], 12, 3)
    widget.dtype.value = 4
    widget.budget_gib.value = 1.0
    assert widget.summary()["tokens_that_fit"] == GiB // (2 * 10 * 3 * 64 * 4)
    widget.preset.value = "Llama-3-8B"                     # back to a published model
    assert widget.kv_heads.options == (1, 2, 4, 8, 16, 32) and widget.kv_heads.value == 8


@pytest.mark.parametrize("field, value, words", [
    ("n_heads", 0, "query heads must be at least 1 and at most 256"),
    ("n_heads", -3, "query heads must be at least 1"),
    ("n_heads", 1000, "at most 256"),
    ("head_dim", 0, "head size must be at least 1"),
    ("layers", -1, "layers must be at least 1"),
    ("budget_gib", -1.0, "cache budget must be a number of GiB above 0"),
    ("budget_gib", 0.0, "above 0"),
    ("budget_gib", float("nan"), "above 0"),
    ("budget_gib", float("inf"), "above 0"),
    ("budget_gib", 1e300, "at most 1,000,000,000"),
])
def test_bad_values_land_in_the_message_line(field, value, words):
    widget = widgets.grouping_explorer()
    before = widget.status.value
    getattr(widget, field).value = value
    assert words in text_of(widget.message.value)
    assert widget.status.value == before                   # nothing half-drawn
    getattr(widget, field).value = {"n_heads": 32, "head_dim": 128, "layers": 32,
                                    "budget_gib": 16.0}[field]
    assert widget.message.value == ""


def test_the_drawing_stays_small_and_leaks_no_figure():
    widget = widgets.grouping_explorer()
    widget.n_heads.value = 256
    for kv in (1, 2, 16, 256, 4):
        widget.kv_heads.value = kv
        ax = widget.axes[0]
        assert len(ax.collections) == 3                    # one collection a row, any size
        assert len(ax.texts) <= 2 * (plots.MAX_LABELLED_HEADS + 1)   # some numbers, not 256
        assert len(widget.axes[1].patches) == len(widgets.divisors(256))
    for name in widgets.GROUPABLE_PRESETS:
        widget.preset.value = name
    assert plt.get_fignums() == []
    assert widget.figure is widget.live.figure


def test_explorer_and_drawings_check_their_arguments():
    with pytest.raises(ValueError, match="preset must be one of"):
        widgets.grouping_explorer("DeepSeek-V3")
    with pytest.raises(ValueError, match="dtype_bytes"):
        widgets.grouping_explorer(dtype_bytes=3)
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        plots.draw_query_groups(ax, 8, 3)
    with pytest.raises(ValueError, match="choose one of"):
        widgets.draw_bytes_per_choice(ax, 32, 32, 128, 5)
    with pytest.raises(ValueError, match="at most 256"):
        plots.draw_query_groups(ax, 512, 1)


def test_grouping_summary():
    summary = widgets.grouping_summary(32, 32, 8, 128, 2, 16 * GiB)
    assert summary["group"] == 4 and summary["kind"] == "GQA"
    assert summary["shared_by"][1] == [4, 5, 6, 7]
    assert summary["kv_head_of"].tolist() == (np.arange(32) // 4).tolist()
    assert summary["bytes_per_token"] == PRESETS["Llama-3-8B"].kv_bytes_per_token()
    assert summary["mha_bytes_per_token"] == PRESETS["Llama-2-7B"].kv_bytes_per_token()
    assert summary["mha_tokens_that_fit"] * 4 == summary["tokens_that_fit"]
    assert widgets.divisors(71) == [1, 71] and widgets.divisors(12) == [1, 2, 3, 4, 6, 12]


# ---------------------------------------------------------------------------------------------
# Exercise checkers
# ---------------------------------------------------------------------------------------------


QWEN = exercises.qwen2_cache_bytes()


def test_qwen2_answer_is_the_formula():
    assert QWEN == 2 * 28 * 4 * 128 * 2 * 32768 == 1_879_048_192 == 1.75 * GiB


@pytest.mark.parametrize("answer, phrase", [
    (QWEN * 7, "7 times too much"),
    (2 * 28 * 3584 * 2 * 32768, "7 times too much"),              # d_model wide, as for MHA
    (QWEN // 2, "K or V alone"),
    (QWEN // 28, "one layer"),
    (QWEN * 2, "4 bytes a number"),
    (QWEN * 8, "bits"),
    (57_344, "one token"),
    (57_344 * 32_000, "not 32,000"),
    (QWEN / 1e9, "GB or MB"),
    (QWEN / 1e6, "GB or MB"),
    (QWEN + 1, "Multiply 2 (K and V)"),
    (QWEN + 0.4, "close (0.4 from the answer)"),                  # bytes are whole
    (QWEN - 0.3, "close (0.3 from the answer)"),
    (QWEN * 7 + 0.4, "not a whole number"),
    (1792.4, "not a whole number"),                               # MiB, not quite
    (1.754, "Multiply 2 (K and V)"),                              # GiB, not quite
    (12.25, "Multiply 2 (K and V)"),                              # MHA's GiB
    (-QWEN, "Multiply"),
    ("1879048192", "not text: write 1879048192 without quotes"),
    ([QWEN, QWEN], "several numbers"),
    (np.array([QWEN, QWEN]), "an array of shape (2,)"),
    (10**400, "401 digits: far too large"),
    (10**5000, "about 5,001 digits: far too large"),
    (float("nan"), "a finite number"),
    (1e308 * 10, "a finite number"),
    (True, "True (a bool)"),
    (None, "not filled in yet"),
    (..., "not filled in yet"),
], ids=case_id)
def test_config_bytes_checker_wrong_answers(answer, phrase):
    not_yet(exercises.check_cache_bytes_from_config(answer), phrase)


@pytest.mark.parametrize("answer", [
    QWEN, float(QWEN), np.int64(QWEN), np.float64(QWEN), np.array(QWEN), 1.75, np.float32(1.75),
    1792, 1792.0, kvlib.kv_cache_bytes(28, None, 32768, n_kv_heads=4, head_dim=128),
    QWEN / GiB, [QWEN], np.array([1.75]),
])
def test_config_bytes_checker_accepts_every_form(answer):
    correct(exercises.check_cache_bytes_from_config(answer))


@pytest.fixture(scope="module")
def decode_case():
    return exercises.decode_inputs()


def output_with(options, case):
    return exercises._decode_output(*case, **options)


def test_every_wrong_decode_is_far_from_the_right_one(decode_case):
    """The tolerance that lets rounded answers pass cannot let a wrong one pass."""
    right = output_with({}, decode_case)
    for name, options, _ in exercises.WRONG_DECODES:
        assert np.abs(output_with(options, decode_case) - right).max() > \
            20 * exercises.ROUNDING, name


@pytest.mark.parametrize("name, options, phrase", [
    (name, options, diagnosis[:40]) for name, options, diagnosis in exercises.WRONG_DECODES])
def test_grouped_decode_checker_names_each_wrong_array(decode_case, name, options, phrase):
    not_yet(exercises.check_grouped_decode(output_with(options, decode_case)), phrase)


def function_with(k_order="repeat", v_order="repeat", scaled=True, softmax_axis=-1):
    def decode(q, K_rows, V_rows):
        return exercises._decode_output(q, K_rows, V_rows, k_order, v_order, scaled, softmax_axis)
    return decode


@pytest.mark.parametrize("function, phrases", [
    (function_with("tile", "tile"), ("with 8 query heads and 2 K/V heads", "np.tile",
                                     "i // group")),
    (function_with("columns", "columns"), ("single columns",)),
    (function_with(scaled=False), ("not scaled",)),
    (function_with(v_order="tile"), ("values are tiled",)),
    (function_with(softmax_axis=0), ("heads axis",)),
    (lambda q, K, V: kvlib.softmax(q @ grouped.repeat_kv_heads(
        kvlib.split_heads(K, K.shape[1] // q.shape[-1]), q.shape[0]).swapaxes(-1, -2)),
     ("attention weights",)),
    (lambda q, K, V: 1 / 0, ("raised ZeroDivisionError",)),
    (lambda q, K, V: "output", ("should be an array", "got text, 'output'")),
    (lambda q, K, V: None, ("got None instead of the output",)),
    (lambda q, K, V: 3.0, ("got a single number",)),
    (lambda q, K, V: [[1, 2], [3]], ("rows have different lengths",)),
    (lambda: None, ("raised TypeError",)),
])
def test_grouped_decode_checker_runs_a_function_and_names_its_bug(function, phrases):
    not_yet(exercises.check_grouped_decode(function), *phrases)


def test_a_bug_that_only_shows_on_other_sizes_is_caught():
    """Repeating single columns is right on no case here; a function that only handles
    the notebook's 8/2 heads right must fail on the other sizes."""
    lesson = exercises.decode_inputs()

    def only_the_notebooks_case(q, K_rows, V_rows):
        if q.shape[0] == 8:
            return exercises._decode_output(q, K_rows, V_rows)
        return exercises._decode_output(q, K_rows, V_rows, "columns", "columns")

    not_yet(exercises.check_grouped_decode(only_the_notebooks_case(*lesson)), "the right numbers")
    not_yet(exercises.check_grouped_decode(only_the_notebooks_case), "with 6 query heads and 3 K/V")


@pytest.mark.parametrize("transform", [
    lambda out: out,
    lambda out: out.round(3),                      # copied from a printout at 3 decimals
    lambda out: out.tolist(),
    lambda out: out.astype(np.float32),
    lambda out: out[:, 0, :],                      # (8, 2)
    lambda out: kvlib.merge_heads(out),            # (1, 16)
    lambda out: kvlib.merge_heads(out)[0],         # (16,)
    lambda out: kvlib.merge_heads(out).round(3).tolist(),
])
def test_grouped_decode_checker_reads_the_output_in_every_form_and_asks_for_the_function(
        decode_case, transform):
    """An array cannot show how it was made (np.repeat or kvlib.attention): the right numbers
    in any form are recognised, and the checker asks for the function that made them."""
    not_yet(exercises.check_grouped_decode(transform(output_with({}, decode_case))),
            "the right numbers", "set answer to the fixed function itself")


def kvlib_attention_one_liner(q, K_rows, V_rows):
    kv = K_rows.shape[1] // q.shape[-1]
    return kvlib.attention(q, kvlib.split_heads(K_rows, kv), kvlib.split_heads(V_rows, kv))


@pytest.mark.parametrize("function, shortcut", [
    (kvlib_attention_one_liner, "kvlib.attention did the grouping"),
    (lambda q, K, V: attention_by_another_name(
        q, kvlib.split_heads(K, K.shape[1] // q.shape[-1]),
        kvlib.split_heads(V, V.shape[1] // q.shape[-1])), "kvlib.attention did the grouping"),
    (lambda q, K, V: kvlib.merge_heads(kvlib.attention(
        q, kvlib.split_heads(K, K.shape[1] // q.shape[-1]),
        kvlib.split_heads(V, V.shape[1] // q.shape[-1]))), "kvlib.attention"),
    (lambda q, K, V: grouped.repeated_attention(
        q, kvlib.split_heads(K, K.shape[1] // q.shape[-1]),
        kvlib.split_heads(V, V.shape[1] // q.shape[-1])), "kvlib.grouped.repeated_attention"),
    (lambda q, K, V: kvlib.weighted_sum(kvlib.attention_weights(
        q, kvlib.split_heads(K, K.shape[1] // q.shape[-1])),
        kvlib.split_heads(V, V.shape[1] // q.shape[-1])), "kvlib's grouped attention"),
], ids=["one-liner", "imported by name", "merged", "repeated_attention", "weights and sum"])
def test_grouped_decode_checker_refuses_kvlibs_grouping(function, shortcut):
    """The task forbids kvlib.attention: a function that lets kvlib do the grouping gets the
    right numbers and is still refused, whatever name it calls kvlib's functions by."""
    not_yet(exercises.check_grouped_decode(function), "the numbers are right", shortcut,
            "np.repeat")


def test_grouped_decode_checker_leaves_no_profile_hook_behind():
    import sys

    exercises.check_grouped_decode(kvlib_attention_one_liner)
    exercises.check_grouped_decode(lambda q, K, V: 1 / 0)
    assert sys.getprofile() is None


def test_grouped_decode_checker_accepts_functions_written_any_way():
    def with_repeat_and_kvlib_scores(q, K_rows, V_rows):
        n_heads, _, dh = q.shape
        kv = K_rows.shape[1] // dh
        K = grouped.repeat_kv_heads(kvlib.split_heads(K_rows, kv), n_heads)
        V = np.repeat(kvlib.split_heads(V_rows, kv), n_heads // kv, axis=0)
        return kvlib.weighted_sum(kvlib.attention_weights(q, K), V)   # heads already repeated

    def with_a_loop(q, K_rows, V_rows):
        n_heads, _, dh = q.shape
        kv = K_rows.shape[1] // dh
        out = []
        for head in range(n_heads):
            j = head // (n_heads // kv)
            k, v = K_rows[:, j * dh:(j + 1) * dh], V_rows[:, j * dh:(j + 1) * dh]
            out.append(kvlib.softmax(q[head] @ k.T / np.sqrt(dh)) @ v)
        return np.array(out).tolist()

    correct(exercises.check_grouped_decode(with_repeat_and_kvlib_scores), "i // group")
    correct(exercises.check_grouped_decode(with_a_loop))
    scope = {"np": np, "kvlib": kvlib}
    exec(exercises.SOLUTIONS[2], scope)
    correct(exercises.check_grouped_decode(scope["answer"]))


def test_the_checker_does_not_let_a_function_change_its_inputs(decode_case):
    def scribbles(q, K_rows, V_rows):
        K_rows[:] = 0
        return exercises._decode_output(q, K_rows, V_rows)

    not_yet(exercises.check_grouped_decode(scribbles))
    assert np.array_equal(exercises.decode_inputs()[1], decode_case[1])


@pytest.mark.parametrize("answer, phrase", [
    (2, "42 % 8, the np.tile order"),
    (5.25, "round down"),
    (6, "one too many"),
    (42, "no K/V head of its own"),
    (10, "only 8 K/V heads"),
    (21, "only 8 K/V heads"),
    (0, "serves query heads 0-7"),
    (3, "serves query heads 24-31"),
    (-1, "numbered from 0"),
    (4.5, "whole number"),
    (5.1, "close (0.1 from the answer)"),
    ("5", "not text: write 5 without quotes"),
    ("five", "not text (got 'five')"),
    ([5, 5], "several numbers"),
    (np.array([5, 6]), "an array of shape (2,)"),
    (True, "a bool"),
    (10**400, "401 digits"),
    (float("-inf"), "got -inf"),
    (None, "not filled in yet"),
])
def test_query_group_checker_wrong_answers(answer, phrase):
    not_yet(exercises.check_query_group(answer), phrase)


@pytest.mark.parametrize("answer", [5, 5.0, np.int64(5), np.int8(5), np.array(5), [5],
                                    np.array([5]), int(grouped.query_groups(64, 8)[42])])
def test_query_group_checker_accepts_every_form(answer):
    correct(exercises.check_query_group(answer))


# ---------------------------------------------------------------------------------------------
# The notebook: solutions pass in its own variables, its broken function fails
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def notebook_namespace():
    return run_notebook("grouped_query_attention")


def test_every_solution_passes_in_the_notebooks_variables(notebook_namespace):
    assert_solutions_pass(notebook_namespace, exercises,
                          {1: exercises.check_cache_bytes_from_config,
                           2: exercises.check_grouped_decode, 3: exercises.check_query_group})


def test_the_notebooks_broken_function_fails_with_the_tile_diagnosis(notebook_namespace):
    broken = notebook_namespace["grouped_decode_attention_broken"]
    not_yet(exercises.check_grouped_decode(broken), "np.tile")
    q, K_rows, V_rows = (notebook_namespace[name] for name in ("q", "K_rows", "V_rows"))
    not_yet(exercises.check_grouped_decode(broken(q, K_rows, V_rows)), "np.tile")


def test_the_second_solution_copies_the_kv_heads_with_np_repeat():
    assert "np.repeat" in exercises.SOLUTIONS[2]


# ---------------------------------------------------------------------------------------------
# On a real model: SmolLM2's grouping, its cache bytes, its grouped attention
# ---------------------------------------------------------------------------------------------

def test_smollm2s_grouping_and_cache_bytes_a_token(smollm2):
    config = smollm2.config
    assert (config.n_heads, config.kv_heads, config.head_dim, config.n_layers) == (9, 3, 64, 30)
    assert grouped.query_groups(config.n_heads, config.kv_heads).tolist() == \
        [0, 0, 0, 1, 1, 1, 2, 2, 2]
    float16 = kvlib.kv_cache_bytes(30, None, 1, dtype_bytes=2, n_kv_heads=3, head_dim=64)
    assert float16 == 23_040 and kvlib.kv_cache_bytes(30, 576, 1, dtype_bytes=2) == 69_120
    for n in (1, 7):
        _, cache = kvlib.prefill(smollm2, list(range(100, 100 + n)))
        assert cache.keys(29).dtype == np.float32
        assert cache.nbytes == 2 * n * float16 == kvlib.config_cache_bytes(config, n)


@pytest.mark.parametrize("layer", [0, 12, 29])
def test_grouped_attention_equals_copied_kv_heads_on_smollm2s_layers(smollm2, layer):
    """The notebook's check (layer 12) on other layers: kvlib's broadcast grouping and
    np.repeat's copies give the same outputs on the real queries, keys and values."""
    config = smollm2.config
    ids = kvlib.smollm2_tokenizer().encode("Grouped-query attention shares K/V heads.")
    positions, mask = np.arange(len(ids)), kvlib.causal_mask(len(ids))
    rotary = kvlib.rotary_positions(config, positions)
    X = kvlib.embed(np.array(ids), smollm2.embedding)
    for block in smollm2.layers[:layer]:
        X = kvlib.decoder_block(X, block, 9, mask=mask, rotary=rotary,
                                norm_epsilon=config.norm_epsilon)
    block = smollm2.layers[layer]
    Q, K, V = kvlib.project_qkv(kvlib.rms_norm(X, block.ln_1_gain, config.norm_epsilon), block)
    Qh = kvlib.split_heads(rotary.rotate(Q), 9)
    Kh, Vh = kvlib.split_heads(rotary.rotate(K), 3), kvlib.split_heads(V, 3)
    broadcast = kvlib.attention(Qh, Kh, Vh, mask)
    copied = grouped.repeated_attention(Qh, Kh, Vh, mask)
    assert broadcast.dtype == np.float32 and broadcast.shape == (9, len(ids), 64)
    np.testing.assert_allclose(broadcast, copied, rtol=0, atol=1e-6)
    tiled = kvlib.attention(Qh, np.tile(Kh, (3, 1, 1)), np.tile(Vh, (3, 1, 1)), mask)
    assert np.abs(tiled - broadcast).max() > 1e-3            # the wrong order is noticed


def test_the_notebook_quotes_the_reference_test_as_it_is():
    """The notebook's words about tests/test_variants_reference.py: the versions it names
    and the tolerance the test holds the outputs to."""
    text = NOTEBOOK.read_text(encoding="utf-8")
    versions = json.loads((Path(__file__).parent / "data" / "variants-reference" /
                           "versions.json").read_text())
    assert f"transformers {versions['transformers']}" in text
    assert f"torch {versions['torch'].split('+')[0]}" in text
    import test_variants_reference as reference
    assert reference.EXACT == 1e-10 and "allows 1e-10" in text
    assert "within 1e-14" in text
    for case in reference.cases("gqa"):                  # what "within 1e-14" measured
        config = reference.grouped_config(case)
        layer = reference.llama_layer(case, config)
        Q, K, V = kvlib.project_qkv(case["x"], layer)
        Q, K = (kvlib.rotate_halves(M, case["angles"]) for M in (Q, K))
        heads = kvlib.attention(kvlib.split_heads(Q, 4), kvlib.split_heads(K, config.kv_heads),
                                kvlib.split_heads(V, config.kv_heads),
                                kvlib.causal_mask(len(case["x"])))
        # 1e-14: a few float64 roundings of outputs near 1 (1.3e-15 under OpenBLAS's
        # Sandybridge kernels, under 1e-15 under Haswell's)
        assert np.abs(kvlib.merge_heads(heads) @ layer.Wo - case["output"]).max() < 1e-14


def test_choosing_custom_drops_the_published_models_line():
    explorer = widgets.grouping_explorer()
    assert "Llama-3-8B" in explorer.source.value
    chooser = next(control for control in explorer.controls.values()
                   if "custom" in getattr(control, "options", ()))
    chooser.value = "custom"
    assert explorer.source.value == ""
