"""The multiply-add formulas equal a count of the matrix products actually performed."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import configs

import kvlib
from kvlib import count_multiply_adds, flops

CONFIGS = [
    kvlib.ModelConfig(),
    kvlib.ModelConfig(vocab_size=50, d_model=12, n_heads=3, n_layers=2, d_ff=20),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("length", [1, 5, 9])
@pytest.mark.parametrize("last_only", [False, True])
def test_forward_formula_equals_count(config, length, last_only):
    params = kvlib.init_params(config, seed=0)
    _, counted = count_multiply_adds(kvlib.forward, params, list(range(length)),
                                     last_only=last_only)
    assert counted == kvlib.forward_multiply_adds(config, length, last_only=last_only)
    assert counted.attention_scores > 0 and counted.unembedding > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_prefill_continuing_a_cache_and_decode_formulas_equal_count(config):
    params = kvlib.init_params(config, seed=0)
    _, cache = kvlib.prefill(params, [1, 2, 3])
    _, counted = count_multiply_adds(kvlib.prefill, params, [4, 5], cache)
    assert counted == kvlib.prefill_multiply_adds(config, 2, cached=3)
    _, counted = count_multiply_adds(kvlib.decode_step, params, 6, cache)
    assert counted == kvlib.decode_step_multiply_adds(config, position=5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_formula_equals_count(use_cache):
    config = CONFIGS[1]
    params = kvlib.init_params(config, seed=0)
    _, counted = count_multiply_adds(kvlib.generate, params, [1, 2, 3, 4], 6,
                                     use_cache=use_cache)
    assert counted == kvlib.generation_multiply_adds(config, 4, 6, use_cache=use_cache)


def test_the_quadratic_term_and_the_gpt2_ratio():
    config = kvlib.GPT2_SMALL
    decode = kvlib.decode_step_multiply_adds(config, position=100)
    assert decode.projections == 12 * 4 * 768**2 and decode.mlp == 12 * 2 * 768 * 3072
    assert decode.attention_scores == 12 * 101 * 768
    full = kvlib.forward_multiply_adds(config, 101)
    assert full.attention_scores == 12 * 101 * 101 * 768
    ratios = [kvlib.generation_multiply_adds(config, 32, n, use_cache=False).total
              / kvlib.generation_multiply_adds(config, 32, n).total for n in (64, 256, 512)]
    assert ratios[0] < ratios[1] < ratios[2]
    assert 170 < ratios[2] < 220  # "about 190 times" for 512 new tokens
    assert kvlib.MultiplyAdds(mlp=3).flops == 6


@given(configs(context_length=120), st.integers(1, 40), st.integers(1, 60), st.booleans())
@settings(max_examples=60, deadline=None)
def test_every_pass_counted_at_once_equals_counting_pass_by_pass(config, prompt, new, use):
    exact = [step.flops for step in flops.generation_step_multiply_adds(config, prompt, new, use)]
    assert flops.generation_step_flops(config, prompt, new, use).tolist() == exact


@given(configs(context_length=120), st.integers(1, 40), st.integers(1, 60))
@settings(max_examples=40, deadline=None)
def test_every_pass_read_at_once_equals_reading_pass_by_pass(config, prompt, new):
    from kvlib import roofline

    exact = [roofline.forward_bytes(config, n) for n in range(prompt, prompt + new)]
    assert roofline.generation_step_bytes(config, prompt, new).tolist() == exact
