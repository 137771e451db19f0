"""Every bad input raises ValueError or TypeError with a message that says what was expected."""

import numpy as np
import pytest

import kvlib


@pytest.fixture(scope="module")
def params():
    return kvlib.init_params()


@pytest.mark.parametrize("ids, error, message", [
    ([0, 3, 12], ValueError, r"\[12\] are outside the vocabulary: ids must be between 0 and 11"),
    ([-1], ValueError, "outside the vocabulary"),
    ([0.5, 1.0], TypeError, "token ids must be whole numbers"),
    (["How"], TypeError, "token ids must be whole numbers"),
    ([], ValueError, "empty"),
    ([[0, 1], [2, 3]], TypeError, r"whole numbers \(a flat sequence of them.*, got \[0, 1\]"),
    (list(range(12)) * 3, ValueError, "context length is 32"),
])
def test_bad_prompts(params, ids, error, message):
    with pytest.raises(error, match=message):
        kvlib.forward(params, ids)
    if "context" not in message:
        with pytest.raises(error, match=message):
            kvlib.prefill(params, ids)


def test_config_checks():
    with pytest.raises(ValueError, match=r"d_model \(6\) must be divisible by n_heads \(4\)"):
        kvlib.ModelConfig(d_model=6, n_heads=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kvlib.ModelConfig(dtype="float16")
    with pytest.raises(TypeError, match="whole number"):
        kvlib.ModelConfig(d_model=4.0)
    with pytest.raises(ValueError, match="at least 1"):
        kvlib.ModelConfig(n_layers=0)


def test_decoding_on_an_empty_cache(params):
    with pytest.raises(ValueError, match="run prefill first"):
        kvlib.decode_step(params, 5, kvlib.KVCache(params.config))


def test_a_cache_made_for_another_config(params):
    other = kvlib.KVCache(kvlib.ModelConfig(n_layers=2))
    with pytest.raises(ValueError, match="another model"):
        kvlib.prefill(params, [0, 3], other)
    with pytest.raises(TypeError, match="KVCache"):
        kvlib.decode_step(params, 5, cache={"K": []})


def test_decode_step_takes_one_token(params):
    _, cache = kvlib.prefill(params, [0, 3])
    with pytest.raises(ValueError, match="exactly one token"):
        kvlib.decode_step(params, [5, 2], cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kvlib.decode_step(params, 99, cache)


def test_weights_of_the_wrong_shape_or_dtype(params):
    layer = params.layers[0]
    bad_layer = kvlib.LayerParams(**{**layer.__dict__, "Wq": np.zeros((4, 5))})
    expected = r"layer 0 Wq has shape \(4, 5\); the config expects \(4, 4\)"
    with pytest.raises(ValueError, match=expected):
        kvlib.Params(params.config, params.embedding, (bad_layer, *params.layers[1:]))
    with pytest.raises(ValueError, match=r"embedding has shape \(11, 4\)"):
        kvlib.Params(params.config, params.embedding[:11], params.layers)
    with pytest.raises(TypeError, match="dtype float32; the config expects float64"):
        kvlib.Params(params.config, params.embedding.astype(np.float32), params.layers)
    with pytest.raises(ValueError, match="expected 3 layers"):
        kvlib.Params(params.config, params.embedding, params.layers[:2])


def test_generate_checks(params):
    with pytest.raises(ValueError, match="needs 36 positions; the context length is 32"):
        kvlib.generate(params, [0, 3, 7, 1, 9], 32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvlib.generate(params, [0], 0)
    with pytest.raises(ValueError, match="temperature"):
        kvlib.generate(params, [0], 3, temperature=-1)
    with pytest.raises(ValueError, match="top_k must be at most 12"):
        kvlib.generate(params, [0], 3, temperature=1.0, top_k=20)


def test_shape_errors_in_the_steps():
    with pytest.raises(ValueError, match="n_heads must be a whole number that divides the 4"):
        kvlib.split_heads(np.zeros((5, 4)), 3)
    with pytest.raises(ValueError, match="n_keys must be at least 5"):
        kvlib.causal_mask(5, 3)
    with pytest.raises(ValueError, match="must have 4 columns"):
        kvlib.project_qkv(np.zeros((5, 3)), kvlib.init_params().layers[0])
    with pytest.raises(ValueError, match=r"K must be a 2-D array \(n_new, 4\)"):
        kvlib.KVCache(kvlib.ModelConfig()).append(0, np.zeros((1, 3)), np.zeros((1, 3)))


def test_tokenizer_errors():
    tokenizer = kvlib.ToyTokenizer()
    expected = r"unknown word\(s\) \['hello'\]: this toy vocabulary only has"
    with pytest.raises(ValueError, match=expected):
        tokenizer.encode("hello you")
    with pytest.raises(ValueError, match="ids must be between 0 and 11"):
        tokenizer.decode([3, 15])
    with pytest.raises(TypeError, match="must be a str"):
        tokenizer.encode(42)
