"""The quantized cache (kvlib.serving.quantized, notebook 22) against plain references:
round trips within half a quantization step; packed codes read back exactly; with exact
values the cache equals a contiguous one bit for bit; over random models, interleavings of
prefills, decode steps and truncations give the logits of a reference written from scratch
(float64, 1e-10); nbytes equals the formula on live caches; truncate restores the state the
cache had; a failing call changes nothing."""

import copy
import json
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import (
    assert_answers_in_words,
    assert_correct,
    assert_not_yet,
    case_id,
    odd_answers,
    student_answers,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from matplotlib.backends.backend_agg import FigureCanvasAgg
from notebook_runs import notebook_path, run_notebook
from strategies import models, token_lists

import kvlib
from kvlib.exercises import quantized_cache as ex22
from kvlib.serving import quantized as q
from kvlib.serving.quantized import PerChannel, PerToken, QuantizedKVCache
from kvlib.widgets import quantized_cache as w22

TOLERANCE = 1e-10

bits = st.sampled_from(q.SUPPORTED_BITS)


@st.composite
def groupings(draw, max_group=6):
    """PerToken or PerChannel of any width, most without a residual of their own, some with
    one (KIVI's R: per token the newest R rows, per channel R a multiple of G)."""
    if draw(st.booleans()):
        return PerToken(draw(bits), draw(st.sampled_from([0, 0, 1, 3, 5])))
    size = draw(st.integers(1, max_group))
    return PerChannel(draw(bits), size, size * draw(st.sampled_from([1, 1, 2, 3])))


@st.composite
def arrays(draw, max_rows=12, max_width=9):
    """Rows of numbers of very different sizes, some rows or columns all zero."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(1, max_rows)), draw(st.integers(1, max_width)))
    x = rng.standard_normal(shape) * 10.0 ** draw(st.integers(-6, 2))
    if draw(st.booleans()):
        x[rng.integers(shape[0])] = 0.0
    if draw(st.booleans()):
        x[:, rng.integers(shape[1])] = 0.0
    if draw(st.booleans()):                     # an outlier channel
        x[:, rng.integers(shape[1])] *= 50
    return x


# ------------------------------------------------------------------------------------------
# Numbers: scales, codes, round trips, packing
# ------------------------------------------------------------------------------------------

@given(arrays(), bits, st.sampled_from([0, 1]))
@settings(max_examples=300, deadline=None)
def test_round_trip_error_is_at_most_half_a_step_per_number(x, b, axis):
    scales = q.symmetric_scales(x, b, axis)
    assert scales.dtype == np.float16
    assert scales.shape == ((1, x.shape[1]) if axis == 0 else (x.shape[0], 1))
    exact = np.max(np.abs(x), axis=axis, keepdims=True) / q.max_code(b)
    assert (scales.astype(np.float64) >= exact).all()            # rounded up, never down
    assert (scales.astype(np.float64) <= exact * (1 + 2**-10) + 2**-24).all()   # by one step
    codes = q.quantize(x, scales, b)
    assert codes.dtype == np.int8 and np.abs(codes).max() <= q.max_code(b)
    error = np.abs(q.round_trip(x, b, axis) - x)
    step = q.quantization_step(x, b, axis)
    assert (error <= step / 2 * (1 + 1e-9)).all()
    assert np.array_equal(q.round_trip(x, b, axis), q.dequantize(codes, scales))


@given(arrays(), bits, st.sampled_from([0, 1]))
@settings(max_examples=100, deadline=None)
def test_the_largest_number_of_every_group_is_stored_at_the_largest_code(x, b, axis):
    """... as long as the scale is a normal float16 (above 6.1e-5): below, float16 keeps
    fewer digits and rounding the scale up may cost the largest number a code."""
    codes = q.quantize(x, q.symmetric_scales(x, b, axis), b)
    largest = np.abs(x).max(axis=axis)
    reached = np.abs(codes).max(axis=axis)
    normal = largest / q.max_code(b) >= np.finfo(np.float16).tiny
    assert (reached[normal] == q.max_code(b)).all()
    assert (reached[largest == 0] == 0).all()


@given(st.data(), bits, st.integers(1, 13))
@settings(max_examples=200, deadline=None)
def test_packed_codes_read_back_exactly_in_the_bytes_they_should_take(data, b, width):
    rows = data.draw(st.integers(0, 5))
    seed = data.draw(st.integers(0, 2**32 - 1))
    codes = np.random.default_rng(seed).integers(-q.max_code(b), q.max_code(b) + 1,
                                                 (rows, width))
    packed = q.pack_codes(codes, b)
    assert packed.dtype == np.uint8
    assert packed.shape == (rows, -(-width * b // 8)) == (rows, q.packed_width(width, b))
    assert np.array_equal(q.unpack_codes(packed, b, width), codes)


def test_packing_puts_the_first_code_in_the_lowest_bits():
    assert q.pack_codes(np.array([[1, -7]]), 4).tolist() == [[(1 + 8) | (-7 + 8) << 4]]
    assert q.pack_codes(np.array([[-1, 0, 1, 1]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4 | 3 << 6]]
    assert q.pack_codes(np.array([[-127, 127]]), 8).tolist() == [[1, 255]]
    assert q.packed_width(5, 4) == 3 and q.packed_width(5, 2) == 2 and q.packed_width(5, 8) == 5


def test_max_codes_and_zero_groups():
    assert [q.max_code(b) for b in (2, 4, 8)] == [1, 7, 127]
    x = np.zeros((3, 4))
    assert np.array_equal(q.round_trip(x, 4, 1), x)
    assert np.array_equal(q.symmetric_scales(x, 4, 0), np.zeros((1, 4), dtype=np.float16))


@pytest.mark.parametrize("call, error, phrase", [
    (lambda: q.max_code(3), ValueError, "one of (2, 4, 8)"),
    (lambda: q.max_code(8.0), TypeError, "whole number"),
    (lambda: q.max_code(True), TypeError, "whole number"),
    (lambda: q.symmetric_scales([[1.0, np.nan]], 8, 1), ValueError, "NaN and infinity"),
    (lambda: q.symmetric_scales([[1e9]], 8, 1), ValueError, "float16"),
    (lambda: q.symmetric_scales("text", 8, 1), TypeError, "array of numbers"),
    (lambda: q.symmetric_scales(np.zeros((0, 3)), 8, 1), ValueError, "non-empty"),
    (lambda: q.pack_codes(np.array([[8]]), 4), ValueError, "between -7 and 7"),
    (lambda: q.pack_codes(np.array([[0.5]]), 4), TypeError, "whole numbers"),
    (lambda: q.unpack_codes(np.zeros((1, 2), dtype=np.uint8), 4, 5), ValueError,
     "uint8 bytes (..., 3)"),
    (lambda: q.unpack_codes(np.zeros((1, 3), dtype=np.int8), 4, 5), ValueError, "uint8"),
    (lambda: PerToken(3), ValueError, "one of (2, 4, 8)"),
    (lambda: PerChannel(8, 0), ValueError, "group_size must be at least 1"),
    (lambda: PerChannel(8, 2.0), TypeError, "group_size must be a whole number"),
])
def test_bad_numbers_are_refused_in_words(call, error, phrase):
    with pytest.raises(error, match=re_escape(phrase)):
        call()


def re_escape(text):
    return re.escape(text)


# ------------------------------------------------------------------------------------------
# A reference written from scratch: what the cache must hold
# ------------------------------------------------------------------------------------------

def reference_scale(largest: float, b: int) -> float:
    """max|x| / q_max stored in float16, rounded up."""
    exact = largest / (2 ** (b - 1) - 1)
    stored = np.float16(exact)
    if float(stored) < exact:
        stored = np.nextafter(stored, np.float16(np.inf))
    return float(stored)


def reference_group(numbers: np.ndarray, b: int) -> np.ndarray:
    limit = 2 ** (b - 1) - 1
    scale = reference_scale(float(np.max(np.abs(numbers))), b)
    if scale == 0:
        return np.zeros_like(numbers)
    return np.clip(np.rint(numbers / scale), -limit, limit) * scale


def exact_from(grouping, n: int) -> int:
    """The first of n positions held in full precision: per token, the newest `residual`
    rows; per channel, the rows after the last whole residual of R rows."""
    if isinstance(grouping, PerToken):
        return max(0, n - grouping.residual)
    return n // grouping.residual * grouping.residual


def reference_held(rows: np.ndarray, grouping) -> np.ndarray:
    """Per token, every row before the residual by itself; per channel, every column of
    every group of G rows before the residual by itself; the residual rows as they are."""
    held = np.array(rows, dtype=np.float64)
    quantized = exact_from(grouping, len(rows))
    if isinstance(grouping, PerToken):
        for i in range(quantized):
            held[i] = reference_group(rows[i], grouping.bits)
        return held
    size = grouping.group_size
    for start in range(0, quantized, size):
        for column in range(rows.shape[1]):
            held[start:start + size, column] = reference_group(
                rows[start:start + size, column], grouping.bits)
    return held


class ReferenceCache(kvlib.KVCache):
    """A contiguous cache of the exact rows that hands attention the reference's rows."""

    def __init__(self, config, keys, values):
        super().__init__(config)
        self.key_grouping, self.value_grouping = keys, values

    def keys(self, layer):
        return reference_held(super().keys(layer), self.key_grouping)

    def values(self, layer):
        return reference_held(super().values(layer), self.value_grouping)


def assert_same_rows(cache, reference):
    assert cache.lengths == reference.lengths
    for layer in range(cache.config.n_layers):
        np.testing.assert_allclose(cache.keys(layer), reference.keys(layer), rtol=0,
                                   atol=TOLERANCE)
        np.testing.assert_allclose(cache.values(layer), reference.values(layer), rtol=0,
                                   atol=TOLERANCE)


def valid_truncations(cache):
    """Lengths the cache can go back to: those whose full-precision rows it still holds (a
    row once quantized has lost its exact numbers). Without residuals (per token), any."""
    n = len(cache)
    allowed = set(range(n + 1))
    for grouping in (cache.key_grouping, cache.value_grouping):
        held = set(range(exact_from(grouping, n), n))
        allowed &= {m for m in range(n + 1) if set(range(exact_from(grouping, m), m)) <= held}
    return sorted(allowed)


# ------------------------------------------------------------------------------------------
# The cache against the references
# ------------------------------------------------------------------------------------------

@given(models(latent=False, window=False), groupings(), groupings(), st.data())
@settings(max_examples=80, deadline=None)
def test_prefills_decodes_and_truncations_equal_the_reference(model, keys, values, data):
    params, config = model
    cache = QuantizedKVCache(config, keys, values)
    reference = ReferenceCache(config, keys, values)
    ids = token_lists(data.draw, config, max_size=8)
    a, _ = kvlib.prefill(params, ids, cache)
    b, _ = kvlib.prefill(params, ids, reference)
    np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    for _ in range(data.draw(st.integers(1, 14))):
        action = data.draw(st.sampled_from(["decode", "decode", "chunk", "truncate"]))
        room = config.context_length - len(cache)
        if action == "truncate" and len(cache) > 1:
            n = data.draw(st.sampled_from(valid_truncations(cache)[1:]))
            cache.truncate(n), reference.truncate(n)
        elif action == "chunk" and room > 1:
            chunk = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1,
                                       max_size=min(room, 7)))
            a, _ = kvlib.prefill(params, chunk, cache)
            b, _ = kvlib.prefill(params, chunk, reference)
            np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
        elif room > 0:
            token = data.draw(st.integers(0, config.vocab_size - 1))
            np.testing.assert_allclose(kvlib.decode_step(params, token, cache),
                                       kvlib.decode_step(params, token, reference),
                                       rtol=0, atol=TOLERANCE)
        assert_same_rows(cache, reference)
        assert cache.nbytes == q.quantized_cache_bytes(config, len(cache), keys, values)


def exact_rows(rng, grouping, n_rows, width):
    """Rows that quantize without any error: whole-number codes times a power of two, and
    in every group a number at the largest code, so that the scale is that power exactly."""
    limit = 2 ** (grouping.bits - 1) - 1
    codes = rng.integers(-limit, limit + 1, (n_rows, width)).astype(np.float64)
    if isinstance(grouping, PerToken):
        codes[np.arange(n_rows), rng.integers(0, width, n_rows)] = limit
        return codes * 2.0 ** rng.integers(-8, 4, (n_rows, 1))
    size = grouping.group_size
    for start in range(0, n_rows, size):
        group = slice(start, min(start + size, n_rows))
        codes[start + rng.integers(0, group.stop - start, width), np.arange(width)] = -limit
        codes[group] *= 2.0 ** rng.integers(-8, 4, (1, width))
    return codes


@given(st.data(), groupings(), groupings(), st.integers(1, 3), st.integers(1, 9))
@settings(max_examples=150, deadline=None)
def test_with_exact_values_the_cache_equals_a_contiguous_one_bit_for_bit(
        data, keys, values, n_layers, width):
    config = kvlib.ModelConfig(d_model=width, n_heads=1, n_layers=n_layers, context_length=30)
    cache, plain = QuantizedKVCache(config, keys, values), kvlib.KVCache(config)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    K, V = exact_rows(rng, keys, 30, width), exact_rows(rng, values, 30, width)
    position = 0
    while position < 30:
        n = min(data.draw(st.integers(1, 8)), 30 - position)
        for layer in range(n_layers):
            got = cache.append(layer, K[position:position + n], V[position:position + n])
            want = plain.append(layer, K[position:position + n], V[position:position + n])
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        position += n
        for layer in range(n_layers):
            assert np.array_equal(cache.keys(layer), plain.keys(layer))
            assert np.array_equal(cache.values(layer), plain.values(layer))


@given(models(latent=False, window=False), bits, bits, st.data())
@settings(max_examples=60, deadline=None)
def test_per_token_prefill_at_once_in_chunks_and_decoding_agree(model, key_bits, value_bits,
                                                               data):
    """Each row is quantized by itself, so how the positions arrive changes nothing."""
    params, config = model
    ids = token_lists(data.draw, config, min_size=2, max_size=12)
    make = lambda: QuantizedKVCache(config, PerToken(key_bits), PerToken(value_bits))  # noqa: E731
    at_once, _ = kvlib.prefill(params, ids, make())
    decoded = q.decoded_logits(params, ids, make())
    np.testing.assert_allclose(decoded, at_once, rtol=0, atol=TOLERANCE)
    split = data.draw(st.integers(1, len(ids) - 1))
    cache = make()
    first, _ = kvlib.prefill(params, ids[:split], cache)
    second, _ = kvlib.prefill(params, ids[split:], cache)
    np.testing.assert_allclose(np.vstack([first, second]), at_once, rtol=0, atol=TOLERANCE)


@given(st.integers(1, 3), st.integers(1, 9), groupings(), groupings(), st.integers(0, 40),
       st.sampled_from(["float32", "float64"]))
@settings(max_examples=200, deadline=None)
def test_nbytes_of_a_live_cache_equals_the_formula(n_layers, width, keys, values, n, dtype):
    config = kvlib.ModelConfig(d_model=width, n_heads=1, n_layers=n_layers, context_length=40,
                               dtype=dtype)
    cache = QuantizedKVCache(config, keys, values)
    rows = np.random.default_rng(n).standard_normal((n, width)).astype(dtype)
    if n:
        for layer in range(n_layers):
            cache.append(layer, rows, rows)
    itemsize = np.dtype(dtype).itemsize
    assert cache.nbytes == q.quantized_cache_bytes(config, n, keys, values)
    by_hand = 0
    for grouping in (keys, values):
        row_bytes = -(-width * grouping.bits // 8)
        quantized = exact_from(grouping, n)
        if isinstance(grouping, PerToken):
            by_hand += quantized * (row_bytes + 2)
        else:
            by_hand += quantized // grouping.group_size * (grouping.group_size * row_bytes
                                                           + 2 * width)
        by_hand += (n - quantized) * width * itemsize
    assert cache.nbytes == n_layers * by_hand
    # past the residuals, L more positions (whole residuals of R) cost L x bytes_per_token
    period = int(np.lcm(*(g.residual if isinstance(g, PerChannel) else 1 for g in (keys, values))))
    more = 2 * period
    past = max([n] + [g.residual for g in (keys, values) if isinstance(g, PerToken)])
    assert q.quantized_cache_bytes(config, past + more, keys, values) - \
        q.quantized_cache_bytes(config, past, keys, values) == pytest.approx(
            more * q.bytes_per_token(n_layers, width, keys, values))


@pytest.mark.parametrize("n", [5, 127, 128, 129, 200, 256])
def test_kivis_residual_length_is_apart_from_its_group_size(n):
    """KIVI's keys: whole residuals of R = 128 rows quantized in groups of G = 32, the rest
    exact; its values: all but the newest 128 rows quantized, each by itself."""
    config = kvlib.ModelConfig(d_model=8, n_heads=2, n_layers=1, context_length=256)
    keys, values = PerChannel(4, 32, residual=128), PerToken(4, residual=128)
    rows = np.random.default_rng(n).standard_normal((n, 8))
    cache = QuantizedKVCache(config, keys, values)
    for start in range(0, n, 7):                         # in chunks, as decode steps would
        cache.append(0, rows[start:start + 7], rows[start:start + 7])
    quantized_keys = n // 128 * 128
    assert np.all(cache.keys(0) == rows, axis=1).tolist() == [
        i >= quantized_keys for i in range(n)]
    assert np.all(cache.values(0) == rows, axis=1).tolist() == [i >= n - 128 for i in range(n)]
    for group in range(quantized_keys // 32):            # one scale per column of 32 rows
        block = rows[32 * group:32 * group + 32]
        np.testing.assert_array_equal(cache.key_store.scales[0, group],
                                      q.symmetric_scales(block, 4, axis=0)[0])
    assert keys.name == "int4 per channel (groups of 32, residual 128)"
    assert values.name == "int4 per token, the newest 128 in full precision"
    assert PerChannel(4, 32) == PerChannel(4, 32, residual=32)


@pytest.mark.parametrize("make, phrase", [
    (lambda: PerChannel(4, 32, residual=48), "multiple of group_size (32)"),
    (lambda: PerChannel(4, 32, residual=0), "residual"),
    (lambda: PerToken(4, residual=-1), "residual"),
    (lambda: PerToken(4, residual=2.5), "residual"),
])
def test_bad_residuals_are_refused_in_words(make, phrase):
    with pytest.raises((ValueError, TypeError), match=re_escape(phrase)):
        make()


def test_bytes_per_token_against_float16_for_a_published_model():
    llama = kvlib.memory.PRESETS["Llama-3-8B"]
    width = llama.n_kv_heads * llama.head_dim                          # 1024
    int8 = q.bytes_per_token(llama.n_layers, width, PerToken(8), PerToken(8))
    assert int8 == 32 * 2 * (1024 + 2) == 65_664
    assert llama.kv_bytes_per_token() / int8 == pytest.approx(1.996, abs=1e-3)
    kivi4 = q.bytes_per_token(llama.n_layers, width, PerChannel(4, 32), PerToken(4))
    assert kivi4 == 32 * ((512 + 2 * 1024 / 32) + (512 + 2)) == 34_880


# ------------------------------------------------------------------------------------------
# truncate, checkpoints, failing calls
# ------------------------------------------------------------------------------------------

def filled(config, keys, values, rows_k, rows_v, n):
    cache = QuantizedKVCache(config, keys, values)
    if n:
        for layer in range(config.n_layers):
            cache.append(layer, rows_k[:n], rows_v[:n])
    return cache


def same_state(a, b):
    assert a.lengths == b.lengths and a.nbytes == b.nbytes
    for layer in range(a.config.n_layers):
        assert np.array_equal(a.keys(layer), b.keys(layer))
        assert np.array_equal(a.values(layer), b.values(layer))


@given(groupings(), groupings(), st.integers(1, 30), st.data())
@settings(max_examples=200, deadline=None)
def test_truncate_gives_exactly_the_state_the_cache_had_or_refuses(keys, values, length,
                                                                   data):
    config = kvlib.ModelConfig(d_model=4, n_heads=2, n_layers=2, context_length=40)
    rng = np.random.default_rng(length)
    K, V = rng.standard_normal((40, 4)), rng.standard_normal((40, 4))
    cache = filled(config, keys, values, K, V, length)
    n = data.draw(st.integers(0, length))
    if n in valid_truncations(cache):
        cache.truncate(n)
        same_state(cache, filled(config, keys, values, K, V, n))
        more = data.draw(st.integers(1, 10))          # and it goes on as if never cut
        for layer in range(2):
            cache.append(layer, K[n:n + more], V[n:n + more])
        same_state(cache, filled(config, keys, values, K, V, n + more))
    else:
        before = filled(config, keys, values, K, V, length)
        with pytest.raises(ValueError, match="already quantized since"):
            cache.truncate(n)
        same_state(cache, before)


def test_truncate_refusal_names_the_group_and_the_way_out():
    config = kvlib.ModelConfig()
    cache = QuantizedKVCache(config, PerChannel(8, 4), PerToken(8))
    _, cache = kvlib.prefill(kvlib.init_params(), [0, 3, 7, 1, 9, 5, 2, 4, 1, 3], cache)
    with pytest.raises(ValueError) as error:
        cache.truncate(6)
    message = str(error.value)
    assert "rows 4-5 in full precision" in message and "rows 4-7 are already quantized" \
        in message
    assert "multiple of 4" in message and "checkpoint()" in message
    cache.truncate(9)                    # within the residual (positions 8, 9)
    cache.truncate(4)                    # a group boundary
    assert len(cache) == 4
    cache.reset()
    assert len(cache) == 0 and cache.nbytes == 0


def test_truncate_refusals_with_kivis_residuals_say_what_is_allowed():
    config = kvlib.ModelConfig()
    cache = QuantizedKVCache(config, PerChannel(8, 2, residual=4), PerToken(8, residual=3))
    _, cache = kvlib.prefill(kvlib.init_params(), [0, 3, 7, 1, 9, 5, 2, 4, 1], cache)
    with pytest.raises(ValueError) as error:
        cache.truncate(6)                # keys: rows 4-5 were quantized with rows 6-7
    message = str(error.value)
    assert "rows 4-7 are already quantized" in message and "multiple of 4" in message
    assert "residual 4" in message
    with pytest.raises(ValueError) as error:
        cache.truncate(4)                # values: rows 1-3 of 4 positions, quantized since
    message = str(error.value)
    assert "rows 1-3 in full precision" in message and "at most 3 positions" in message
    assert len(cache) == 9 and cache.nbytes == q.quantized_cache_bytes(
        config, 9, cache.key_grouping, cache.value_grouping)
    with pytest.raises(ValueError, match="row 5 is already quantized since"):
        cache.truncate(8)                # values: row 5 left the residual when row 8 came
    cache.truncate(9)                    # the length it has: nothing to rebuild
    assert len(cache) == 9


@given(models(latent=False, window=False), groupings(), groupings(), st.data())
@settings(max_examples=60, deadline=None)
def test_a_pass_that_fails_half_way_leaves_the_cache_as_it_was(model, keys, values, data):
    params, config = model
    assume(config.n_layers >= 2)
    ids = token_lists(data.draw, config, max_size=9)
    _, cache = kvlib.prefill(params, ids, QuantizedKVCache(config, keys, values))
    before = copy.deepcopy(cache)
    broken = copy.deepcopy(params)
    broken.layers[-1].Wv[...] = np.nan                 # the last layer's V cannot be stored
    chunk = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1,
                               max_size=min(9, config.context_length - len(ids))))
    with pytest.raises(ValueError, match="NaN or infinite"):
        kvlib.prefill(broken, chunk, cache)
    same_state(cache, before)
    a, _ = kvlib.prefill(params, chunk, cache)            # and it goes on as if nothing failed
    b, _ = kvlib.prefill(params, chunk, before)
    np.testing.assert_allclose(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("K, V, phrase", [
    (np.full((2, 4), np.nan), np.zeros((2, 4)), "K holds NaN"),
    (np.zeros((2, 4)), np.full((2, 4), np.inf), "V holds NaN"),
    (np.zeros((2, 4)), np.full((2, 4), 1e9), "too large for float16 scales"),
    (np.zeros((2, 3)), np.zeros((2, 3)), "(n_new, 4)"),
    (np.zeros((2, 4)), np.zeros((3, 4)), "must have 2 rows"),
    (np.zeros((0, 4)), np.zeros((0, 4)), "no rows"),
    (np.zeros((40, 4)), np.zeros((40, 4)), "cache is full"),
    ([[0.0] * 4], [[0.0] * 4], "2-D array"),
])
def test_appends_that_fail_change_nothing(K, V, phrase):
    config = kvlib.ModelConfig()
    cache = QuantizedKVCache(config, PerChannel(4, 4), PerToken(4))
    _, cache = kvlib.prefill(kvlib.init_params(), [0, 3, 7, 1, 9, 5], cache)
    before = copy.deepcopy(cache)
    with pytest.raises((ValueError, TypeError), match=re_escape(phrase)):
        cache.append(0, K, V)
    same_state(cache, before)


@pytest.mark.parametrize("make, error, phrase", [
    (lambda: QuantizedKVCache(kvlib.ModelConfig(latent_dim=2)), ValueError, "latent"),
    (lambda: QuantizedKVCache(kvlib.ModelConfig(window=4)), ValueError, "window"),
    (lambda: QuantizedKVCache(kvlib.ModelConfig(), keys=8), TypeError, "keys must be a grouping"),
    (lambda: QuantizedKVCache(kvlib.ModelConfig(), values="per token"), TypeError,
     "values must be a grouping"),
    (lambda: QuantizedKVCache(kvlib.ModelConfig(), capacity=33), ValueError, "capacity"),
    (lambda: QuantizedKVCache("config"), TypeError, "needs a ModelConfig"),
    (lambda: q.quantized_cache_bytes(kvlib.ModelConfig(), 3, PerToken(), "x"), TypeError,
     "values must be a grouping"),
    (lambda: q.quantized_cache_bytes(kvlib.ModelConfig(), -1, PerToken(), PerToken()),
     ValueError, "n_positions"),
])
def test_bad_caches_are_refused_in_words(make, error, phrase):
    with pytest.raises(error, match=re_escape(phrase)):
        make()


def test_the_cache_describes_itself_and_holds_bytes_and_halves():
    params = kvlib.init_params()
    cache = QuantizedKVCache(params.config, PerChannel(8, 4), PerToken(4))
    kvlib.prefill(params, [0, 3, 7, 1, 9], cache)
    assert repr(cache) == ("QuantizedKVCache(5 of 32 positions, 3 layers; K int8 per channel "
                           "(groups of 4), V int4 per token; 228 bytes)")
    store = cache.key_store
    assert store.codes.dtype == np.uint8 and store.scales.dtype == np.float16
    assert cache.value_store.codes.shape == (3, 32, 2)      # 4 int4 codes in 2 bytes
    assert cache.keys(0).dtype == np.float64
    # K: one group of 4 rows (4 x 4 bytes + 4 float16 scales) and 1 float64 row of 4;
    # V: 5 rows of 2 bytes + a float16 scale; all times 3 layers
    assert cache.nbytes == 3 * ((16 + 8 + 32) + 5 * (2 + 2)) == 228
    assert cache.nbytes == q.quantized_cache_bytes(params.config, 5, PerChannel(8, 4),
                                                   PerToken(4))


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------

def test_decoded_logits_equal_prefill_with_a_plain_cache_and_check_their_input():
    params = kvlib.init_params()
    ids = [0, 3, 7, 1, 9, 5, 2]
    plain, _ = kvlib.prefill(params, ids)
    for prompt in (1, 3, 7):
        np.testing.assert_allclose(q.decoded_logits(params, ids, kvlib.KVCache(params.config),
                                                    prompt), plain, atol=TOLERANCE)
    with pytest.raises(ValueError, match="empty cache"):
        _, used = kvlib.prefill(params, [0])
        q.decoded_logits(params, ids, used)
    with pytest.raises(ValueError, match="longer than the 7 ids"):
        q.decoded_logits(params, ids, kvlib.KVCache(params.config), 8)


def test_loss_and_agreement():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    assert q.next_token_loss(logits, [0, 0, 1]) == pytest.approx(-(np.log(0.5) + np.log(0.8))
                                                                 / 2)
    other = logits.copy()
    other[1] = [0, 0, 1]
    assert q.greedy_agreement(logits, other) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="T >= 2"):
        q.next_token_loss(logits[:1], [0])
    with pytest.raises(ValueError, match="one shape"):
        q.greedy_agreement(logits, logits[:2])


@given(models(latent=False, window=False), groupings(), groupings(), st.data())
@settings(max_examples=30, deadline=None)
def test_quality_is_measured_against_the_plain_cache(model, keys, values, data):
    params, config = model
    sequences = [data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=2,
                                    max_size=10)) for _ in range(data.draw(st.integers(1, 3)))]
    quality = q.measure_quality(params, sequences, keys, values)
    reference = q.plain_logits(params, sequences)
    assert quality == q.measure_quality(params, sequences, keys, values, reference)
    logits = [kvlib.prefill(params, ids, QuantizedKVCache(config, keys, values))[0]
              for ids in sequences]
    predictions = sum(len(ids) - 1 for ids in sequences)
    loss = sum(q.next_token_loss(lg, ids) * (len(ids) - 1)
               for lg, ids in zip(logits, sequences)) / predictions
    assert quality.loss == pytest.approx(loss, rel=1e-12)
    same = sum(int((lg.argmax(1) == ref.argmax(1)).sum()) for lg, ref in zip(logits, reference))
    assert quality.agreement == pytest.approx(same / sum(map(len, sequences)), rel=1e-12)
    assert quality.max_logit_error == pytest.approx(
        max(np.abs(lg - ref).max() for lg, ref in zip(logits, reference)), rel=1e-12)
    assert quality.added_loss == pytest.approx(quality.loss - quality.plain_loss)
    assert quality.name == f"K {keys.name}, V {values.name}"


def test_greedy_tokens_equal_kvlib_generate_with_a_plain_cache():
    params = kvlib.init_params()
    prompt = [0, 3, 7, 1, 9]
    assert q.greedy_tokens(params, prompt, 8, kvlib.KVCache(params.config)) == \
        kvlib.generate(params, prompt, 8)
    with pytest.raises(ValueError, match="empty cache"):
        q.greedy_tokens(params, prompt, 2, kvlib.prefill(params, prompt)[1])
    with pytest.raises(ValueError, match="n_new must be at least 1"):
        q.greedy_tokens(params, prompt, 0, kvlib.KVCache(params.config))


# ------------------------------------------------------------------------------------------
# Exercise checkers: tables of wrong answers, valid answers in other forms, a fuzz
# ------------------------------------------------------------------------------------------

ROW, NEXT_ROW, SCALE = ex22.ROW, ex22.NEXT_ROW, ex22.row_scale()
RATIO, NEXT_RATIO = ROW / SCALE, NEXT_ROW / SCALE
CODES = np.array([25, -127, 51, 17, -39, 100, -3, 6])
NEXT_CODES = np.array([15, 127, -23, -127, 1, 62, -25, 38])


def test_the_exercise_rows_and_kvlibs_float16_scale_give_the_same_codes():
    assert SCALE == pytest.approx(0.02)
    assert np.array_equal(ex22.row_codes(ROW, SCALE), CODES)
    assert np.array_equal(ex22.row_codes(NEXT_ROW, SCALE), NEXT_CODES)
    stored = q.symmetric_scales(ROW[None], 8, axis=1)
    assert np.array_equal(q.quantize(ROW[None], stored, 8)[0], CODES)


@pytest.mark.parametrize("answer, phrase", [
    (np.trunc(RATIO), "cut the fraction off"),
    (RATIO.astype(int), "cut the fraction off"),
    (np.floor(RATIO), "np.floor rounds down"),
    (np.rint(ROW / (2.54 / 128)), "divides max|x| by 128"),
    (np.clip(np.rint(ROW / (2.54 / 128)), -127, 127), "by 128 (and clips)"),
    (np.rint(ROW / (2.54 / 255)), "divides by 255"),
    (np.clip(np.rint(ROW / (2.54 / 255)), -127, 127), "divides by 255 and clips"),
    (np.rint(ROW / (2.54 / 255)).astype(np.int8), "wrapped the codes beyond 127"),
    (np.rint((ROW - ROW.min()) / (ROW.max() - ROW.min()) * 255), "asymmetric"),
    (np.rint(ROW / (2.0 / 127)), "max(x) is 2.0"),
    (np.clip(np.rint(ROW / (2.0 / 127)), -127, 127), "max(x) = 2.0"),
    (np.rint(ROW / 2.54), "divides by max|x| itself"),
    (CODES * SCALE, "numbers read back"),
    (RATIO, "not yet rounded"),
    (SCALE, "got one number"),
    (CODES[:7], "8 codes"),
    (np.append(CODES, 0), "8 codes"),
    (CODES + 0.4, "whole numbers"),
    (np.where(np.arange(8) == 3, 18, CODES), "the code of number 3 (0.333) is 18"),
    (np.array([10**5000] * 8, dtype=object), "too large for a float"),
    (10**5000, "got one number"),
    (np.full(8, np.nan), "NaN or infinite"),
    (CODES > 0, "True/False"),
    ("25, -127", "numeric"),
    (..., "not filled in"),
], ids=case_id)
def test_codes_checker_names_each_mistake(answer, phrase):
    if phrase == "numeric":
        feedback = ex22.check_codes(answer)
        assert not feedback.passed
        return
    assert_not_yet(ex22.check_codes(answer), phrase)


@pytest.mark.parametrize("answer", [CODES, CODES.tolist(), tuple(CODES.tolist()),
                                    CODES.astype(np.int8), CODES.astype(float),
                                    np.rint(RATIO), np.round(RATIO), CODES[None, :],
                                    [float(c) for c in CODES], CODES.astype(np.int16),
                                    q.quantize(ROW[None], q.symmetric_scales(ROW[None], 8, 1), 8)])
def test_codes_checker_passes_valid_forms(answer):
    assert_correct(ex22.check_codes(answer))


@pytest.mark.parametrize("answer, phrase", [
    (np.rint(NEXT_RATIO), "lie outside -127 .. 127"),
    (np.rint(NEXT_RATIO).astype(np.int8), "wrapped 145 and -155 around to -111 and 101"),
    (np.clip(np.rint(NEXT_RATIO), -128, 127), "whole range, -128 .. 127"),
    (np.clip(np.rint(NEXT_ROW / (3.1 / 127)), -127, 127), "its own scale"),
    (CODES, "codes of the first row"),
    (np.trunc(NEXT_RATIO), "not clipped either"),
    (np.clip(np.trunc(NEXT_RATIO), -127, 127), "-22.80 becomes -22, not -23"),
    (np.clip(np.floor(NEXT_RATIO), -127, 127), "61.70 becomes 61, not 62"),
    (NEXT_CODES * SCALE, "numbers read back"),
    (NEXT_RATIO, "not yet rounded"),
    (np.where(np.arange(8) == 0, 16, NEXT_CODES), "clipped to -127 .. 127."),
], ids=case_id)
def test_fixed_scale_checker_names_each_mistake(answer, phrase):
    assert_not_yet(ex22.check_codes_with_fixed_scale(answer), phrase)


def test_a_code_off_elsewhere_is_named_with_the_prefix_once():
    feedback = ex22.check_codes_with_fixed_scale(np.where(np.arange(8) == 0, 16, NEXT_CODES))
    assert repr(feedback).startswith("Not yet: the code of number 0 (0.3) is 16")


@pytest.mark.parametrize("answer", [NEXT_CODES, NEXT_CODES.tolist(), NEXT_CODES.astype(np.int8),
                                    np.clip(np.rint(NEXT_RATIO), -127, 127),
                                    np.clip(np.round(NEXT_RATIO), -127, 127).astype(int)])
def test_fixed_scale_checker_passes_valid_forms(answer):
    assert_correct(ex22.check_codes_with_fixed_scale(answer))


@pytest.mark.parametrize("answer, phrase", [
    (81_920, "leaves the scales out"),
    (82_240, "one scale per row"),
    (245_920, "1024 key scales for every token"),
    (327_680, "without quantization"),
    (169_120, "one byte per int4 code"),
    (1_090, "one layer"),
    (46_080, "keys only"),
    (41_120, "values only"),
    (697_600, "counts bits"),
    (92_480, "float32"),
    (696_480, "all 64 query heads"),
    (85.15625, "KiB"),
    (88_320, "one scale per head"),
    (34_880, "the figure for 32 layers, Llama-3-8B's count"),
    (87_201, "Per layer"),
    (87_200.4, "close (0.4 from the answer)"),
    ("87200", "not text: write 87200 without quotes"),
    (np.array(["87200"]), "not text: write 87200 without quotes"),
    (True, "True (a bool)"),
    ([87_200, 2], "several numbers"),
    (float("nan"), "finite"),
    (10**400, "finite"),
    (10**5000, "about 5,001 digits"),
    (None, "not filled in"),
], ids=case_id)
def test_bytes_per_token_checker_names_each_mistake(answer, phrase):
    assert_not_yet(ex22.check_bytes_per_token(answer), phrase)


@pytest.mark.parametrize("answer", [87_200, 87_200.0, np.int64(87_200), np.float32(87_200),
                                    np.array(87_200), [87_200], np.array([87_200.0]),
                                    80 * ((1024 // 2 + 2 * 1024 / 32) + (1024 // 2 + 2))])
def test_bytes_per_token_checker_passes_valid_forms(answer):
    assert_correct(ex22.check_bytes_per_token(answer))


def test_the_bytes_exercise_is_kvlibs_formula_on_a_live_cache():
    layers, width = ex22.exercise2_shapes()
    config = kvlib.ModelConfig(d_model=width, n_heads=8, n_layers=layers, context_length=64,
                               dtype="float32")
    cache = QuantizedKVCache(config, ex22.EXERCISE2_KEYS, ex22.EXERCISE2_VALUES)
    rows = np.random.default_rng(0).standard_normal((64, width)).astype(np.float32)
    for layer in range(layers):
        cache.append(layer, rows, rows)
    assert cache.nbytes == 64 * ex22.expected_bytes_per_token() == 64 * 87_200


@pytest.mark.parametrize("answer, phrase", [
    ("a", "30 times too coarse"), ("C", "not their spacing"), ("d", "the grouping decides"),
    ("e", "no choice 'e'"), ("ab", "one letter"), ("", "one letter"), (2, "one letter"),
    (["a", "b"], "one letter"), (..., "not filled in"),
])
def test_prediction_checker_wrong_answers(answer, phrase):
    assert_not_yet(ex22.check_huge_channel_prediction(answer), phrase)


@pytest.mark.parametrize("answer", ["b", "B", " b ", "(b)", "b)", ["b"], ("B",)])
def test_prediction_checker_valid_forms(answer):
    feedback = ex22.check_huge_channel_prediction(answer)
    assert_correct(feedback)
    assert "9 times less" in feedback.message


def test_the_prediction_is_measured():
    errors = ex22.outlier_errors()
    assert errors["per token"] > 8 * errors["per channel"]
    assert ex22.outlier_keys()[:, ex22.OUTLIER_CHANNEL].mean() > 25


def buggy(axis=1, largest=None, keepdims=True, rounding=np.rint, clip=True, times=True):
    def round_trip_per_token(rows, bits):
        n = 2 ** (bits - 1) - 1 if largest is None else largest(bits)
        scales = np.abs(rows).max(axis=axis, keepdims=keepdims) / n
        codes = rounding(rows / scales)
        if clip:
            codes = np.clip(codes, -n, n)
        return codes * scales if times else codes
    return round_trip_per_token


@pytest.mark.parametrize("function, phrase", [
    (ex22.round_trip_per_token_buggy, "still one scale per column"),
    (buggy(axis=0), "still one scale per column"),
    (buggy(largest=lambda b: 2 ** b - 1), "not 2**bits - 1"),
    (buggy(largest=lambda b: 2 ** (b - 1)), "not 2**(bits - 1)."),
    (buggy(rounding=np.trunc), "np.trunc"),
    (buggy(times=False), "returns the codes"),
    (lambda rows, bits: rows, "unchanged"),
    (buggy(keepdims=False), "keepdims=True"),
    (lambda rows, bits: 1 / 0, "raised ZeroDivisionError"),
    (lambda rows: rows, "raised TypeError"),
    (lambda rows, bits: None, "returned None"),
    (lambda rows, bits: "rows", "array of numbers"),
    (lambda rows, bits: rows[:2], "shape (6, 4)"),
    (lambda rows, bits: np.zeros_like(rows), "not right"),
    ("round_trip_per_token", "should be a function"),
    (np.zeros((6, 4)), "should be a function"),
    (..., "not filled in"),
])
def test_round_trip_checker_names_each_bug(function, phrase):
    assert_not_yet(ex22.check_round_trip_per_token(function), phrase)


def test_a_square_block_catches_scales_that_line_up_with_the_columns():
    def square_only(rows, bits):
        n = 2 ** (bits - 1) - 1
        if rows.shape[0] != rows.shape[1]:
            return ex22.round_trip_per_token(rows, bits)
        scales = np.abs(rows).max(axis=1) / n
        return np.clip(np.rint(rows / scales), -n, n) * scales

    assert_not_yet(ex22.check_round_trip_per_token(square_only), "line up with the columns")


@pytest.mark.parametrize("function", [
    ex22.round_trip_per_token,
    lambda rows, bits: PerToken(bits).round_trip(rows),
    lambda rows, bits: q.round_trip(rows, bits, axis=1),
    lambda rows, bits: ex22.round_trip_per_token(rows, bits).tolist(),
    buggy(clip=False),                   # with a scale from max|row| nothing needs the clip
])
def test_round_trip_checker_passes_valid_forms(function):
    assert_correct(ex22.check_round_trip_per_token(function))


CHECKERS = [ex22.check_codes, ex22.check_codes_with_fixed_scale, ex22.check_bytes_per_token,
            ex22.check_huge_channel_prediction, ex22.check_round_trip_per_token]


@pytest.mark.parametrize("checker", CHECKERS)
@pytest.mark.parametrize("answer", [a for _, a in odd_answers((8,))],
                         ids=[label for label, _ in odd_answers((8,))])
def test_every_checker_answers_odd_input_in_words(checker, answer):
    feedback = assert_answers_in_words(checker, answer)
    assert not feedback.passed or checker is ex22.check_huge_channel_prediction
    assert len(feedback.message) < 600


@pytest.mark.parametrize("checker", CHECKERS)
@given(answer=student_answers)
@settings(max_examples=150, deadline=None)
def test_every_checker_answers_generated_answers_in_words(checker, answer):
    assert_answers_in_words(checker, answer)


def test_a_round_trip_that_returns_odd_things_is_answered_in_words():
    for _, odd in odd_answers((6, 4)):
        feedback = assert_answers_in_words(ex22.check_round_trip_per_token,
                                           lambda rows, bits, odd=odd: odd)
        assert not feedback.passed


# ------------------------------------------------------------------------------------------
# The widget and the plots, headless
# ------------------------------------------------------------------------------------------

WIDGET_CONFIG = kvlib.ModelConfig(vocab_size=12, d_model=16, n_heads=2, n_layers=2, d_ff=32,
                                  context_length=96, positions="learned", norm="layer",
                                  bias=True, dtype="float32")


@pytest.fixture(scope="module")
def widget_model():
    params = kvlib.init_params(WIDGET_CONFIG, seed=3)
    story = [0] + np.random.default_rng(5).integers(1, 12, 70).tolist()
    return params, kvlib.ToyTokenizer(), story


@pytest.fixture
def explorer(widget_model):
    params, tokenizer, story = widget_model
    return w22.quantized_cache_explorer(params, tokenizer, story, prompt_length=20, n_new=12,
                                        group_size=16)


def test_the_explorer_shows_the_default_setting_measured_live(explorer, widget_model):
    params, _, story = widget_model
    result = explorer.state["result"]
    assert result["keys"] == PerChannel(8, 16) and result["values"] == PerToken(8)
    cache = QuantizedKVCache(params.config, PerChannel(8, 16), PerToken(8))
    logits, _ = kvlib.prefill(params, story, cache)
    plain, reference = kvlib.prefill(params, story)
    assert result["nbytes"] == cache.nbytes == q.quantized_cache_bytes(
        params.config, len(story), PerChannel(8, 16), PerToken(8))
    assert result["agreement"] == q.greedy_agreement(logits, plain)
    np.testing.assert_array_equal(result["key_error"][0],
                                  np.abs(cache.keys(0) - reference.keys(0)))
    shown = explorer.figure.axes[0].images[0].get_array()
    np.testing.assert_array_equal(shown.filled(0), result["key_error"][0])
    assert shown.mask[len(story) // 16 * 16:].all()          # the residual: held exactly
    assert not shown.mask[:len(story) // 16 * 16].all()
    status = explorer.status.value
    assert "K int8 per channel (groups of 16), V int8 per token" in status
    assert f"{result['nbytes']:,} bytes for {len(story)} positions" in status
    assert "K's newest 7 rows in float32)" in status and "V's" not in status   # 71 = 64 + 7
    assert explorer.message.value == ""
    assert result["tokens"] == q.greedy_tokens(params, story[:20], 12, QuantizedKVCache(
        params.config, PerChannel(8, 16), PerToken(8)))
    assert explorer.plain_tokens == kvlib.generate(params, story[:20], 12)


def test_fewer_bits_cost_fewer_bytes_and_more_error(explorer):
    seen = []
    for key_bits in (8, 4, 2):
        explorer.controls["key_bits"].value = key_bits
        explorer.controls["value_bits"].value = key_bits
        result = explorer.state["result"]
        seen.append((result["bytes_per_token"], result["key_rms"], result["logit_error"]))
        bar = explorer.figure.axes[1].patches[2]
        assert bar.get_width() == result["bytes_per_token"]
        assert explorer.figure.axes[1].texts[2].get_text() == \
            f" {result['bytes_per_token']:,.0f}"
    assert seen[0][0] > seen[1][0] > seen[2][0]
    assert seen[0][1] < seen[1][1] < seen[2][1]
    assert seen[0][2] < seen[2][2]


def test_groupings_change_what_is_shown_and_results_are_kept(explorer):
    explorer.controls["key_grouping"].value = "per token"
    per_token = explorer.state["result"]
    assert per_token["keys"] == PerToken(8)
    assert "K int8 per token" in explorer.status.value
    assert "no row in full precision" in explorer.status.value
    assert not explorer.figure.axes[0].images[0].get_array().mask.any()   # nothing exact
    explorer.controls["key_grouping"].value = "per channel"
    explorer.controls["key_grouping"].value = "per token"
    assert explorer.state["result"] is per_token                  # measured once
    assert len(explorer.state["results"]) == 2
    explorer.controls["layer"].value = 1
    np.testing.assert_array_equal(
        explorer.figure.axes[0].images[0].get_array().filled(0), per_token["key_error"][1])
    assert "layer 1's keys" in explorer.figure.axes[0].get_title()


def test_every_update_is_one_render_with_room_for_every_label(explorer, monkeypatch):
    """The widget shows one PNG render of the whole figure (OneRenderFigure), not the inline
    backend's crop to a tight box, which draws a figure twice (a click took 1.55 s on a busy
    machine): so every title, label and tick label must lie inside the figure."""
    saved = []
    real = explorer.figure.savefig
    monkeypatch.setattr(explorer.figure, "savefig",
                        lambda *args, **kwargs: saved.append(kwargs) or real(*args, **kwargs))
    for bits in (4, 2, 8):
        explorer.controls["key_bits"].value = bits
    assert len(saved) == 3 and all("bbox_inches" not in kwargs for kwargs in saved)
    explorer.controls["key_grouping"].value = "per token"      # the longest title
    canvas = FigureCanvasAgg(explorer.figure)
    canvas.draw()
    drawn = explorer.figure.get_tightbbox(canvas.get_renderer())   # what a crop would keep
    width, height = explorer.figure.get_size_inches()
    assert drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= width and drawn.y1 <= height


def test_changed_tokens_are_marked_without_colour():
    assert w22._tokens_html(["a", "<b>", "c"], ["a", "x", "c"]) == "a <b><u>&lt;b&gt;</u></b> c"


def test_updates_redraw_in_place_without_leaking_figures(explorer):
    figures = plt.get_fignums()
    artists = [len(ax.get_children()) for ax in explorer.figure.axes]
    for bits in (4, 2, 8, 4):
        for grouping in ("per token", "per channel"):
            explorer.controls["value_bits"].value = bits
            explorer.controls["value_grouping"].value = grouping
    assert [len(ax.get_children()) for ax in explorer.figure.axes] == artists
    assert plt.get_fignums() == figures


@pytest.mark.parametrize("make, phrase", [
    (lambda p, t, s: w22.quantized_cache_explorer(p, t, s * 3), "context holds 96"),
    (lambda p, t, s: w22.quantized_cache_explorer(p, t, s, prompt_length=0), "prompt_length"),
    (lambda p, t, s: w22.quantized_cache_explorer(p, t, s, prompt_length=60, n_new=40),
     "exceeds the context length"),
    (lambda p, t, s: w22.quantized_cache_explorer(p, t, [99]), "outside the vocabulary"),
])
def test_bad_explorers_are_refused_in_words(widget_model, make, phrase):
    with pytest.raises(ValueError, match=re_escape(phrase)):
        make(*widget_model)


def test_a_setting_that_cannot_be_shown_lands_in_the_message_line(widget_model):
    params, tokenizer, story = widget_model
    huge = copy.deepcopy(params)
    huge.layers[0].bk[...] = 1e8              # keys far beyond what float16 scales hold
    box = w22.quantized_cache_explorer(huge, tokenizer, story, prompt_length=20, n_new=4)
    assert "Cannot show this" in box.message.value and "float16 scales" in box.message.value
    assert box.controls and "result" not in box.state


def test_make_grouping_and_channel_sizes():
    assert w22.make_grouping("per token", 4) == PerToken(4)
    assert w22.make_grouping("per channel", 2, 8) == PerChannel(2, 8)
    with pytest.raises(ValueError, match="grouping must be one of"):
        w22.make_grouping("per head", 4)
    rows = np.array([[1.0, -5.0], [-3.0, 2.0]])
    assert w22.channel_sizes(rows).tolist() == [3.0, 5.0]
    with pytest.raises(ValueError, match="rows"):
        w22.channel_sizes(np.zeros(3))


def test_the_plots_label_what_they_draw():
    fig, ax = plt.subplots()
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((20, 8)), rng.standard_normal((20, 8))
    keys[:, 6] *= 40
    w22.draw_channel_sizes(ax, keys, values, title="t", head_dim=4, n_marked=1)
    assert [t.get_text() for t in ax.texts] == ["6"]
    assert ax.get_yscale() == "log" and ax.get_title() == "t" and ax.get_ylabel()
    assert len(ax.lines) == 3                   # keys, values, one line between the 2 heads
    fig.canvas.draw()                           # the legend sits above every point
    legend = ax.get_legend().get_window_extent()
    points = ax.transData.transform(np.column_stack([np.arange(8), np.abs(keys).max(0)]))
    assert (points[:, 1] < legend.y0).all()
    w22.draw_channel_sizes(ax, keys, values)
    largest_two = {str(channel) for channel in np.argsort(np.abs(keys).max(0))[-2:]}
    assert {t.get_text() for t in ax.texts} == largest_two and len(ax.texts) == 2
    fig, ax = plt.subplots()
    error = np.abs(rng.standard_normal((6, 4))) * 0.01
    error[4:] = 0
    image = w22.draw_error_heatmap(ax, error, w22.error_norm(1.0), title="e")
    assert image.get_array().mask[4:].all() and ax.get_xlabel() == "channel"
    assert isinstance(image.norm, matplotlib.colors.LogNorm)
    assert len(fig.axes) == 2                   # and its colour bar


@pytest.mark.parametrize("residual, exact_token_rows, exact_channel_rows", [
    (None, 0, 2),            # 14 rows, groups of 4: the newest, incomplete group
    (8, 8, 6),               # KIVI: the newest 8 per token; per channel 14 - 8
])
def test_the_groupings_figure_whitens_the_rows_held_exactly(residual, exact_token_rows,
                                                            exact_channel_rows):
    fig, axes = plt.subplots(1, 2)
    w22.draw_groupings(axes, n_positions=14, width=8, group_size=4, residual=residual)
    for ax, exact in zip(axes, (exact_token_rows, exact_channel_rows)):
        colours = ax.images[0].get_array()
        white = np.all(colours == 1, axis=(1, 2))
        assert white.tolist() == [i >= 14 - exact for i in range(14)]
        assert bool(ax.texts) == bool(exact)
    with pytest.raises(ValueError, match="multiple of group_size"):
        w22.draw_groupings(axes, group_size=4, residual=6)


def test_the_quality_plot_draws_a_bar_per_setting():
    params = kvlib.init_params()
    settings_ = [(PerToken(8), PerToken(8)), (PerChannel(4, 4), PerToken(4)),
                 (PerToken(4), PerToken(4))]
    sequences = [[0, 3, 7, 1, 9, 5, 2, 4]]
    qualities = [q.measure_quality(params, sequences, k, v) for k, v in settings_]
    fig, axes = plt.subplots(1, 2)
    w22.draw_quality(axes, qualities)
    for ax in axes:
        assert sum(len(bars) for bars in ax.containers) == 3
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "K per token,\nV per token", "K per channel,\nV per token"]
    heights = sorted(patch.get_height() for patch in axes[0].patches)
    assert heights == sorted(100 * quality.agreement for quality in qualities)
    assert axes[1].get_yscale() == "symlog" and "linear within ±0.001" in axes[1].get_ylabel()
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["int8", "int4"]
    assert w22.pairing_name(qualities[1]) == "K per channel, V per token"
    with pytest.raises(ValueError, match="two axes"):
        w22.draw_quality(axes[:1], qualities)


# ------------------------------------------------------------------------------------------
# The notebook: its exercises stay open, the solutions pass in its own variables
# ------------------------------------------------------------------------------------------

NOTEBOOK = notebook_path("quantized_cache")
STORIES = Path(kvlib.__file__).resolve().parent / "models" / "stories"


@pytest.fixture(scope="module")
def notebook():
    """The notebook's variables, its code cells run once in order (tests/test_cells_run_twice.py
    runs every cell again after the whole notebook)."""
    pytest.importorskip("kvlib.stories", reason="the notebook needs kvlib.stories (the "
                        "stories branch)")
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"the notebook needs the trained story model in {STORIES} (the stories "
                    "branch)")
    return run_notebook("quantized_cache")


def test_no_cell_before_the_exercises_prints_exercise_2s_answer():
    """Exercise 2 asks for Llama-2-70B's bytes a token (int4, KIVI's axes): 87,200. Llama-3-8B
    has rows as wide and 32 layers, so its figure, 34,880, is the answer times 32 / 80: no
    output above the exercises may show either (the table shows Llama-3-8B's ratios only)."""
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    end = next(i for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
               and "## Exercises" in "".join(cell["source"]))
    printed = " ".join("".join(output.get("text", "")) + "".join(
        output.get("data", {}).get("text/plain", "")) for cell in cells[:end]
        if cell["cell_type"] == "code" for output in cell["outputs"])
    assert ex22.expected_bytes_per_token() == 87_200
    for figure in ("87,200", "87200", "34,880", "34880"):
        assert figure not in printed, figure


def test_the_exercises_are_left_open(notebook):
    assert notebook["codes"] is ... and notebook["codes_next"] is ... and \
        notebook["answer"] is ...
    assert np.array_equal(notebook["row"], ex22.ROW)


def test_solutions_pass_in_the_notebooks_namespace(notebook):
    assert sorted(ex22.SOLUTIONS) == [1, 2, 3, 4]
    scope = dict(notebook)
    exec(ex22.SOLUTIONS[1], scope)
    assert_correct(ex22.check_codes(scope["codes"]))
    assert_correct(ex22.check_codes_with_fixed_scale(scope["codes_next"]))
    for number, checker in ((2, ex22.check_bytes_per_token),
                            (3, ex22.check_huge_channel_prediction),
                            (4, ex22.check_round_trip_per_token)):
        scope = dict(notebook)
        exec(ex22.SOLUTIONS[number], scope)
        assert_correct(checker(scope["answer"]))


def test_the_notebooks_buggy_function_fails_its_checker(notebook):
    assert_not_yet(ex22.check_round_trip_per_token(notebook["round_trip_per_token_buggy"]),
                   "still one scale per column")


def test_solution_display():
    shown = ex22.solution(4)
    assert "Solution to exercise 4" in shown.data and "axis=1" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        ex22.solution(9)


# ------------------------------------------------------------------------------------------
# Outlier key channels: the same model, wilder keys
# ------------------------------------------------------------------------------------------

@given(models(latent=False, window=False, positions="learned"), st.data())
@settings(max_examples=60, deadline=None)
def test_outlier_key_channels_change_the_keys_but_not_the_logits(model, data):
    params, config = model
    channels = data.draw(st.lists(st.integers(0, config.kv_width - 1), min_size=1, max_size=3))
    layers = data.draw(st.sets(st.integers(0, config.n_layers - 1), min_size=1))
    factor = data.draw(st.sampled_from([0.25, 3.0, 16.0, 100.0]))
    changed = q.with_outlier_key_channels(params, channels, factor, layers)
    ids = token_lists(data.draw, config, max_size=10)
    a, cache_a = kvlib.prefill(params, ids)
    b, cache_b = kvlib.prefill(changed, ids)
    np.testing.assert_allclose(b, a, rtol=1e-9, atol=TOLERANCE)
    for layer in range(config.n_layers):
        expected = cache_a.keys(layer).copy()
        if layer in layers:
            expected[:, sorted(set(channels))] *= factor
        np.testing.assert_allclose(cache_b.keys(layer), expected, rtol=1e-9, atol=TOLERANCE)
        np.testing.assert_allclose(cache_b.values(layer), cache_a.values(layer), rtol=1e-9,
                                   atol=TOLERANCE)
    for layer in set(range(config.n_layers)) - layers:     # untouched layers share weights
        assert changed.layers[layer] is params.layers[layer]


def test_per_channel_scales_absorb_outlier_channels_exactly():
    """Scaling a channel by a power of two scales its per-channel scale exactly: the codes
    and the error relative to the channel stay the same, while per-token scales suffer."""
    config = kvlib.ModelConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8, context_length=64,
                               positions="learned", norm="layer", bias=True)
    params = kvlib.init_params(config, seed=1)
    ids = np.random.default_rng(0).integers(0, 12, 64)
    wild = q.with_outlier_key_channels(params, [1, 6], 16.0)
    _, tame_cache = kvlib.prefill(params, ids)
    _, wild_cache = kvlib.prefill(wild, ids)
    tame, wild_keys = tame_cache.keys(0), wild_cache.keys(0)
    per_channel = PerChannel(4, 32)
    held_tame, held_wild = per_channel.round_trip(tame), per_channel.round_trip(wild_keys)
    np.testing.assert_allclose(held_wild[:, [1, 6]], 16 * held_tame[:, [1, 6]], rtol=1e-12)
    np.testing.assert_allclose(np.delete(held_wild, [1, 6], 1), np.delete(held_tame, [1, 6], 1),
                               rtol=1e-12)
    others = np.delete(np.arange(8), [1, 6])
    per_token_tame = np.abs(PerToken(4).round_trip(tame) - tame)[:, others].mean()
    per_token_wild = np.abs(PerToken(4).round_trip(wild_keys) - wild_keys)[:, others].mean()
    assert per_token_wild > 4 * per_token_tame


@pytest.mark.parametrize("change, phrase", [
    (dict(params=kvlib.init_params(kvlib.ModelConfig(positions="rotary"))), "rotary"),
    (dict(params=kvlib.init_params(kvlib.ModelConfig(latent_dim=2))), "latent"),
    (dict(channels=[4]), "between 0 and 3"),
    (dict(channels=[]), "between 0 and 3"),
    (dict(channels=[0.5]), "whole numbers"),
    (dict(factor=0), "positive number"),
    (dict(factor=float("nan")), "factor must be a finite number"),
    (dict(factor="16"), "factor must be a number"),
    (dict(layers=[3]), "between 0 and 2"),
    (dict(layers=[-1]), "layers must be >= 0"),
])
def test_outlier_key_channels_refuse_what_they_cannot_do(change, phrase):
    arguments = dict(params=kvlib.init_params(), channels=[1], factor=16.0, layers=None) | change
    with pytest.raises((ValueError, TypeError), match=re_escape(phrase)):
        q.with_outlier_key_channels(**arguments)


def test_the_explorer_compares_the_model_with_its_outlier_version(widget_model):
    params, tokenizer, story = widget_model
    wild = q.with_outlier_key_channels(params, [3, 12], 16.0)
    box = w22.quantized_cache_explorer(params, tokenizer, story, prompt_length=20, n_new=8,
                                       group_size=16, outlier_params=wild)
    for name in ("key_bits", "value_bits"):
        box.controls[name].value = 4
    box.controls["key_grouping"].value = "per token"
    tame_per_token = box.state["result"]
    box.controls["model"].value = "outlier keys"
    wild_per_token = box.state["result"]
    assert wild_per_token["model"] == "outlier keys" and "(outlier keys)" in \
        box.figure.axes[0].get_title()
    assert wild_per_token["logit_error"] > 2 * tame_per_token["logit_error"]
    assert np.abs(wild_per_token["key_error"][0]).max() > \
        4 * np.abs(tame_per_token["key_error"][0]).max()
    box.controls["key_grouping"].value = "per channel"
    wild_per_channel = box.state["result"]
    box.controls["model"].value = "as trained"
    tame_per_channel = box.state["result"]
    # per channel, the outliers only scale their own columns' scales: nothing else changes
    assert wild_per_channel["logit_error"] == pytest.approx(tame_per_channel["logit_error"],
                                                            rel=1e-6)
    assert wild_per_channel["agreement"] == tame_per_channel["agreement"]
    np.testing.assert_allclose(wild_per_channel["key_error"][1][:, [3, 12]],
                               16 * tame_per_channel["key_error"][1][:, [3, 12]], rtol=1e-6)
    other = kvlib.init_params(WIDGET_CONFIG.replace(n_layers=1))
    with pytest.raises(ValueError, match="same model"):
        w22.quantized_cache_explorer(params, tokenizer, story, outlier_params=other)


@pytest.mark.parametrize("call, error, phrase", [
    (lambda: q.quantize(np.ones((2, 3)), "s", 8), TypeError, "scales must be an array"),
    (lambda: q.quantize(np.ones((2, 3)), np.ones((3, 1)), 8), ValueError, "that match"),
    (lambda: q.quantize(np.ones((2, 3)), -np.ones((2, 1)), 8), ValueError, ">= 0"),
    (lambda: q.quantize(np.ones((2, 3)), np.ones((2, 1)), 5), ValueError, "one of (2, 4, 8)"),
    (lambda: q.dequantize("codes", 1.0), TypeError, "codes must be an array"),
    (lambda: q.dequantize(np.ones((2, 3)), 1.0), TypeError, "whole numbers"),
    (lambda: q.dequantize(np.ones((2, 3), dtype=int), [[1.0, np.nan]]), ValueError, "finite"),
    (lambda: q.round_trip([[1.0, 2.0]], 8, 2), ValueError, "axis"),
])
def test_quantize_and_dequantize_refuse_bad_input_in_words(call, error, phrase):
    with pytest.raises(error, match=re_escape(phrase)):
        call()
