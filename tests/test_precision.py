"""kvlib.precision (notebook 25): rounding to each format against numpy's and PyTorch's rules,
the 16-bit emulation put back after use, cached against recomputed and padded against alone
equal in float64 on random architectures, the comparison's counts on hand-made logits, and
the committed table against what the tool computes."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import configs, token_lists

import kvlib
from kvlib import precision
from kvlib.checkpoints.safetensors import bfloat16_to_float32, float32_to_bfloat16

ROOT = Path(__file__).resolve().parent.parent


def test_rounding_to_float16_is_numpys_and_keeps_the_dtype():
    x = np.random.default_rng(0).normal(size=(50, 7)).astype(np.float32) * 100
    rounded = precision.round_to(x, "float16")
    assert rounded.dtype == np.float32 and rounded.shape == x.shape
    assert np.array_equal(rounded, x.astype(np.float16).astype(np.float32))
    assert np.isinf(precision.round_to(np.array([70000.0]), "float16")).all()


def test_rounding_to_bfloat16_keeps_eight_bits_of_mantissa_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -7, 3e38, -2.5e-3], np.float32)
    rounded = precision.round_to(x, "bfloat16")
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even one, 1
    assert rounded[:4].tolist() == [1.0, 1.0, 1 + 2 ** -6, 1 + 2 ** -7]
    bits = rounded.view(np.uint32)
    assert (bits & 0xFFFF == 0).all(), "a bfloat16 is a float32 with 16 low bits of zero"
    assert np.array_equal(bfloat16_to_float32((bits >> 16).astype(np.uint16)), rounded)
    assert precision.round_to(x.astype(np.float64), "bfloat16").dtype == np.float64


def test_the_fast_bfloat16_rounding_is_the_safetensors_rule_on_every_kind_of_number():
    """Every 4099th bit pattern of 32 bits: normal, subnormal, zero, infinite, NaN, both signs,
    and the largest floats, which round up to infinity."""
    x = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, np.array([3.4e38, -3.4e38, np.inf, -np.inf, 0.0, -0.0],
                                    np.float32)])
    ours = precision.round_to(x, "bfloat16")
    theirs = bfloat16_to_float32(float32_to_bfloat16(x))
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(ours)
    assert np.array_equal(ours.view(np.uint32)[finite], theirs.view(np.uint32)[finite])


def test_float64_and_float32_change_nothing_they_cannot_hold():
    x = np.linspace(-1, 1, 11)
    assert precision.round_to(x, "float64") is x
    assert np.array_equal(precision.round_to(x, "float32"), x.astype(np.float32))


@pytest.mark.parametrize("call, error, words", [
    (lambda: precision.in_format(kvlib.init_params(), "int8"), ValueError, "float16', 'bf"),
    (lambda: precision.computed_in("float8").__enter__(), ValueError, "number_format"),
    (lambda: precision.in_format("params", "float16"), TypeError, "Params"),
    (lambda: precision.compare(np.ones((2, 3)), np.ones((3, 2))), ValueError, "one shape"),
])
def test_bad_input_is_refused_in_words(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_weights_in_a_format_are_rounded_copies():
    params = kvlib.init_params(kvlib.ModelConfig(positions="rotary", norm="rms",
                                                 mlp="swiglu"), seed=1)
    half = precision.in_format(params, "bfloat16")
    assert half.config.dtype == "float32" and half.layers[0].W_gate.dtype == np.float32
    assert np.array_equal(half.layers[0].Wq, precision.round_to(params.layers[0].Wq,
                                                                  "bfloat16"))
    assert not np.shares_memory(half.embedding, params.embedding)
    wide = precision.in_format(half, "float64")
    assert wide.config.dtype == "float64" and wide.embedding.dtype == np.float64
    narrow = precision.in_format(params, "float64")        # init_params makes float64
    assert precision.in_format(narrow, "float64") is narrow
    single = precision.in_format(params, "float32")
    assert single.config.dtype == "float32" and precision.in_format(single, "float32") is single


def test_computed_in_rounds_every_building_block_and_puts_them_back():
    params = precision.in_format(kvlib.init_params(seed=2), "float32")
    originals = {name: getattr(kvlib.model, name) for name in precision.ROUNDED}
    with precision.computed_in("float16"):
        logits = kvlib.forward(params, [1, 2, 3])
        assert np.array_equal(logits, logits.astype(np.float16).astype(np.float32))
    with pytest.raises(RuntimeError):
        with precision.computed_in("bfloat16"):
            raise RuntimeError
    assert {name: getattr(kvlib.model, name) for name in precision.ROUNDED} == originals
    assert kvlib.decoder_block is originals["decoder_block"]
    assert not np.array_equal(kvlib.forward(params, [1, 2, 3]), logits)


def test_the_rounding_cache_stores_what_a_16_bit_buffer_would():
    config = kvlib.ModelConfig()
    cache = precision.RoundingCache(config, "bfloat16")
    K = np.random.default_rng(3).normal(size=(2, config.kv_width)).astype(np.float32)
    keys, values = cache.append(0, K, K * 3)
    assert np.array_equal(keys, precision.round_to(K, "bfloat16"))
    assert np.array_equal(cache.values(0), precision.round_to(K * 3, "bfloat16"))
    for layer in range(1, config.n_layers):
        cache.append(layer, K, K)
    assert "RoundingCache(bfloat16, 2 of " in repr(cache)


@settings(max_examples=25, deadline=None)
@given(configs(latent=False, context_length=30), st.integers(0, 999), st.data())
def test_in_float64_cached_equals_recomputed_and_padded_equals_alone(config, seed, data):
    params = precision.in_format(kvlib.init_params(config, seed=seed), "float64")
    ids = token_lists(data.draw, config, min_size=2, max_size=20)
    prompt_length = data.draw(st.integers(1, len(ids) - 1))
    cached, recomputed = precision.teacher_forced(params, ids, prompt_length)
    assert cached.shape == (len(ids) - prompt_length, config.vocab_size)
    np.testing.assert_allclose(cached, recomputed, rtol=0, atol=1e-9)
    padding = data.draw(st.integers(1, 30 - len(ids)))
    padded, alone = precision.left_padded(params, ids, padding)
    np.testing.assert_allclose(padded, alone, rtol=0, atol=1e-9)


def test_teacher_forcing_checks_its_prompt_length():
    params = kvlib.init_params(seed=0)
    for bad in (0, 3, 2.0, True):
        with pytest.raises((TypeError, ValueError), match="prompt_length must be"):
            precision.teacher_forced(params, [1, 2, 3], bad)
    with pytest.raises(ValueError, match="padding must be at least 1"):
        precision.left_padded(params, [1, 2], 0)


def test_comparison_counts_flips_and_the_gap_they_needed():
    recomputed = np.array([[1.0, 3.0, 2.9], [5.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    cached = np.array([[1.0, 2.95, 2.96], [5.0, 0.1, 0.0], [0.0, 1.0, 1.0]])
    result = precision.compare(cached, recomputed)
    assert result.positions == 3 and result.flips == 1
    assert result.flip_gap == pytest.approx(0.1) and result.flip_rate == pytest.approx(1 / 3)
    assert result.largest_difference == pytest.approx(0.1)
    assert result.as_dict()["flips"] == 1


def test_the_committed_table_has_every_row_and_the_orders_of_size_the_lesson_states():
    measured = precision.measured()
    assert measured["command"].startswith("python tools/measure_precision.py")
    for name in ("stories", "smollm2"):
        rows = {(row["format"], row["where"]): row for row in measured[name]["rows"]}
        assert set(rows) == {(f, "everything") for f in precision.FORMATS} | {
            ("float16", "the cache"), ("bfloat16", "the cache")}
        differences = [rows[(f, "everything")]["cached_against_recomputed"]
                       ["largest_difference"] for f in precision.FORMATS]
        assert differences[0] < 1e-9 < differences[1] < 1e-3 < differences[2] < differences[3]
        assert rows[("float32", "everything")]["cached_against_recomputed"]["flips"] == 0


def test_the_tool_gives_the_committed_story_numbers_on_its_first_windows(monkeypatch):
    """The tool again, on 2 of the 48 story windows: float64 and float32 as committed (no
    flips, differences within the pooled largest), and the 16-bit rows nonzero."""
    import measure_precision as tool
    monkeypatch.setitem(tool.SIZES, "stories", (2, 40))
    again = {(row["format"], row["where"]): row for row in tool.measure("stories")["rows"]}
    committed = {(row["format"], row["where"]): row
                 for row in precision.measured()["stories"]["rows"]}
    for key in (("float64", "everything"), ("float32", "everything")):
        for column in ("cached_against_recomputed", "padded_against_alone"):
            ours, theirs = again[key][column], committed[key][column]
            assert ours["flips"] == 0
            assert ours["largest_difference"] <= max(theirs["largest_difference"], 1e-12) * 4
    assert again[("bfloat16", "everything")]["cached_against_recomputed"][
        "largest_difference"] > 1e-3
    json.dumps(again[("bfloat16", "the cache")])       # plain numbers, ready for the file


def test_the_emulation_is_close_to_real_bfloat16_in_transformers():
    """tools/make_precision_reference.py ran the same 16 SmolLM2 windows through transformers
    in real bfloat16 (PyTorch's CPU kernels): the emulation's differences and flip rates are
    of the same size (within a factor of 3), and float32 agrees to 1e-4 without flips in
    both."""
    reference = json.loads((ROOT / "tests" / "data" / "precision-reference" /
                            "smollm2.json").read_text())
    theirs = {row["format"]: row for row in reference["rows"]}
    ours = {row["format"]: row for row in precision.measured()["smollm2"]["rows"]
            if row["where"] == "everything"}
    for column in ("cached_against_recomputed", "padded_against_alone"):
        assert theirs["float32"][column]["flips"] == ours["float32"][column]["flips"] == 0
        assert theirs["float32"][column]["largest_difference"] < 1e-4
        mine, real = ours["bfloat16"][column], theirs["bfloat16"][column]
        assert 1 / 3 < mine["largest_difference"] / real["largest_difference"] < 3
        assert 1 / 3 < mine["flips"] / mine["positions"] / (real["flips"] / real["positions"]) < 3
    assert 1 / 3 < ours["bfloat16"]["against_float64"]["flips"] / \
        theirs["bfloat16"]["against_float32"]["flips"] < 3


def test_notebook_25_quotes_the_transformers_reference():
    reference = json.loads((ROOT / "tests" / "data" / "precision-reference" /
                            "smollm2.json").read_text())
    theirs = {row["format"]: row for row in reference["rows"]}["bfloat16"]
    notebook = json.loads((ROOT / "notebooks" / "25_when_the_cache_is_wrong.ipynb").read_text())
    text = " ".join("".join(cell["source"]) for cell in notebook["cells"]
                    if cell["cell_type"] == "markdown")
    text = " ".join(text.split())
    cached, padded = theirs["cached_against_recomputed"], theirs["padded_against_alone"]
    assert f"{cached['flips']} flips in {cached['positions']}" in text
    assert f"{padded['flips']} in {padded['positions']}" in text
    assert f"{cached['largest_difference']:.2f}" in text
    ours = {row["format"]: row for row in precision.measured()["smollm2"]["rows"]
            if row["where"] == "everything"}["bfloat16"]
    mine = ours["cached_against_recomputed"]
    assert f"the emulation gives {mine['flips']} flips and {mine['largest_difference']:.2f}" in text
    assert f"the emulation gives {ours['padded_against_alone']['flips']}." in text
