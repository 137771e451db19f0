"""Bad and odd input on kvlib's public functions: every outcome is a valid result or a
ValueError/TypeError raised by kvlib's own checks (the last frame is in kvlib, not deep in
numpy), and no failing call changes a cache."""

import traceback
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import gpt2

KVLIB = str(Path(kvlib.__file__).parent)

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 40), st.sampled_from([10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.binary(max_size=3),
    st.sampled_from([np.int32(3), np.int64(-2), np.float32(0.5), np.float64(np.nan)]),
    st.lists(st.integers(-3, 20), max_size=4),
    st.sampled_from([[1, [2, 3]], [[1, 2], [3, 4]], {}, (1.5,), object(), [], [[]],
                     np.array(["a", "b"]), np.array([1, None], dtype=object),
                     np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((1, 4), dtype=np.float32),
                     np.array([[1, 2]]), np.array(3)]),
)

PARAMS = kvlib.init_params()
WINDOWED = kvlib.init_params(kvlib.ModelConfig(positions="rotary", window=3, sink_tokens=1))
CONFIG = PARAMS.config
TOY = kvlib.ToyTokenizer()


def fresh_cache(params=PARAMS):
    return kvlib.prefill(params, [0, 3, 7])[1]


def state(cache):
    return (cache.lengths, [(cache.keys(i).copy(), cache.values(i).copy())
                            for i in range(cache.config.n_layers)])


def same_state(a, b):
    return a[0] == b[0] and all(np.array_equal(x, y) and np.array_equal(v, w)
                                for (x, v), (y, w) in zip(a[1], b[1]))


CALLS = {
    "forward ids": lambda v, c: kvlib.forward(PARAMS, v),
    "forward last_only": lambda v, c: kvlib.forward(PARAMS, [0, 1], last_only=v),
    "forward record_attention": lambda v, c: kvlib.forward(PARAMS, [0, 1], record_attention=v),
    "prefill ids": lambda v, c: kvlib.prefill(PARAMS, v, c),
    "prefill cache": lambda v, c: kvlib.prefill(PARAMS, [0, 1], v),
    "prefill last_only": lambda v, c: kvlib.prefill(PARAMS, [1], c, last_only=v),
    "decode_step token": lambda v, c: kvlib.decode_step(PARAMS, v, c),
    "decode_step record": lambda v, c: kvlib.decode_step(PARAMS, 1, c, record_attention=v),
    "decode_step window token": lambda v, c: kvlib.decode_step(
        WINDOWED, v, fresh_cache(WINDOWED)),
    "generate n": lambda v, c: kvlib.generate(PARAMS, [0], v),
    "generate use_cache": lambda v, c: kvlib.generate(PARAMS, [0], 2, use_cache=v),
    "generate temperature": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=v),
    "generate top_k": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=1.0, top_k=v),
    "generate seed": lambda v, c: kvlib.generate(PARAMS, [0], 2, temperature=1.0, seed=v),
    "next_token_probabilities row": lambda v, c: kvlib.next_token_probabilities(v),
    "next_token_probabilities temperature": lambda v, c: kvlib.next_token_probabilities(
        [1.0, 2.0], v),
    "next_token_probabilities top_k": lambda v, c: kvlib.next_token_probabilities(
        [1.0, 2.0], 1.0, v),
    "choose_next_token row": lambda v, c: kvlib.choose_next_token(v),
    "choose_next_token rng": lambda v, c: kvlib.choose_next_token([1.0, 2.0], 1.0, None, v),
    "init_params config": lambda v, c: kvlib.init_params(v),
    "init_params seed": lambda v, c: kvlib.init_params(None, v),
    "KVCache config": lambda v, c: kvlib.KVCache(v),
    "KVCache capacity": lambda v, c: kvlib.KVCache(CONFIG, v),
    "ConcatenatingKVCache capacity": lambda v, c: kvlib.ConcatenatingKVCache(CONFIG, v),
    "make_cache": lambda v, c: kvlib.make_cache(v),
    "cache.keys": lambda v, c: c.keys(v),
    "cache.values": lambda v, c: c.values(v),
    "cache.append K": lambda v, c: c.append(0, v, np.zeros((1, 4))),
    "cache.append V": lambda v, c: c.append(0, np.zeros((1, 4)), v),
    "cache.append layer": lambda v, c: c.append(v, np.zeros((1, 4)), np.zeros((1, 4))),
    "cache.truncate": lambda v, c: c.truncate(v),
    "cache.key_positions": lambda v, c: c.key_positions(v),
    "kv_cache_bytes n_layers": lambda v, c: kvlib.kv_cache_bytes(v, 8, 10),
    "kv_cache_bytes seq_len": lambda v, c: kvlib.kv_cache_bytes(2, 8, v),
    "kv_cache_bytes n_kv_heads": lambda v, c: kvlib.kv_cache_bytes(2, None, 10, n_kv_heads=v,
                                                                   head_dim=4),
    "latent_cache_bytes": lambda v, c: kvlib.latent_cache_bytes(2, v, 0, 10),
    "config_cache_bytes": lambda v, c: kvlib.config_cache_bytes(CONFIG, v),
    "forward_multiply_adds": lambda v, c: kvlib.forward_multiply_adds(CONFIG, v),
    "decode_step_multiply_adds": lambda v, c: kvlib.decode_step_multiply_adds(CONFIG, v),
    "generation_multiply_adds": lambda v, c: kvlib.generation_multiply_adds(CONFIG, v, 3),
    "generation_multiply_adds config": lambda v, c: kvlib.generation_multiply_adds(v, 2, 3),
    "count_multiply_adds": lambda v, c: kvlib.count_multiply_adds(kvlib.forward, v, [0]),
    "ToyTokenizer.encode": lambda v, c: TOY.encode(v),
    "ToyTokenizer.encode add_bos": lambda v, c: TOY.encode("How", add_bos=v),
    "ToyTokenizer.decode": lambda v, c: TOY.decode(v),
    "ToyTokenizer vocabulary": lambda v, c: kvlib.ToyTokenizer(v),
    "gpt2 Tokenizer.encode": lambda v, c: gpt2.Tokenizer.gpt2().encode(v),
    "gpt2 Tokenizer.decode": lambda v, c: gpt2.Tokenizer.gpt2().decode(v),
    "params.with_config window": lambda v, c: PARAMS.with_config(window=v),
    "add_positions": lambda v, c: kvlib.add_positions(np.zeros((1, 4)), np.zeros((8, 4)), v),
    "RotaryPositions": lambda v, c: kvlib.RotaryPositions(v, 4),
    "attention_mask": lambda v, c: kvlib.attention_mask(v, [0, 1]),
    "causal_mask": lambda v, c: kvlib.causal_mask(v),
    "split_heads": lambda v, c: kvlib.split_heads(np.zeros((2, 4)), v),
    "project_qkv": lambda v, c: kvlib.project_qkv(v, PARAMS.layers[0]),
}
CONFIG_FIELDS = ["vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "context_length",
                 "dtype", "positions", "norm", "bias", "norm_epsilon", "n_kv_heads",
                 "rope_base", "latent_dim", "rope_head_dim", "window", "sink_tokens"]


def _config_with(field):
    return lambda v, c: kvlib.ModelConfig(**{field: v})


CALLS |= {f"ModelConfig {field}": _config_with(field) for field in CONFIG_FIELDS}


def raised_by_kvlib(error: BaseException) -> bool:
    return traceback.extract_tb(error.__traceback__)[-1].filename.startswith(KVLIB)


@pytest.mark.parametrize("name", sorted(CALLS))
@given(value=ODD)
@settings(max_examples=60, deadline=None)
def test_odd_input_gets_a_result_or_a_clear_error_and_changes_no_cache(name, value):
    cache = fresh_cache()
    before = state(cache)
    try:
        CALLS[name](value, cache)
    except (ValueError, TypeError) as error:
        assert raised_by_kvlib(error), f"{name}({value!r}) raised deep inside: {error!r}"
        assert len(str(error)) > 15, f"{name}({value!r}) raised a terse error: {error!r}"
        assert same_state(state(cache), before), f"{name}({value!r}) failed but changed the cache"
    except Exception as error:   # anything else is a bug
        pytest.fail(f"{name}({value!r}) raised {type(error).__name__}: {error}")


def test_a_huge_workload_does_not_overflow():
    # numpy int32 inputs: 80 layers, d 8192, 2**20 tokens, batch 64 is far past 2**31
    n = kvlib.kv_cache_bytes(np.int32(80), np.int32(8192), np.int32(2**20), np.int32(64))
    assert n == 2 * 80 * 8192 * 2**20 * 64 * 2
    with pytest.raises(ValueError, match="n_kv_heads must be a whole number >= 1"):
        kvlib.kv_cache_bytes(2, None, 10, n_kv_heads=-2, head_dim=-4)


def test_choosing_from_bad_logits_is_refused():
    with pytest.raises(ValueError, match="last row"):
        kvlib.choose_next_token(np.zeros((5, 12)))
    for bad in ([np.nan, 1.0], [-np.inf, -np.inf]):
        with pytest.raises(ValueError, match="finite"):
            kvlib.choose_next_token(bad, temperature=1.0)
    # a tiny temperature is greedy in the limit, not NaN
    p = kvlib.next_token_probabilities([1.0, 3.0, 2.0], temperature=1e-308)
    np.testing.assert_array_equal(p, [0, 1, 0])
    with pytest.raises(ValueError, match="top_k must be between"):
        kvlib.choose_next_token([1.0, 2.0], temperature=0, top_k=5)


def test_flags_that_are_not_booleans_are_refused():
    for call in (lambda: kvlib.generate(PARAMS, [0], 2, use_cache="no"),
                 lambda: TOY.encode("How", add_bos="no")):
        with pytest.raises(TypeError, match="True or False"):
            call()
    with pytest.raises(ValueError, match="more than once"):
        kvlib.ToyTokenizer(("<bos>", "A", "a"))
