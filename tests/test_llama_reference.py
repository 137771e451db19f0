"""kvlib's Llama architecture against transformers, without torch: a tiny random
LlamaForCausalLM saved by transformers' save_pretrained (the hub's layout, the half rotary
pairing) and what transformers computed on it (tools/make_llama_reference.py wrote both into
tests/data/llama-reference/). Then the two rotary pairings, the hub layout's loader and writer,
and the pieces (RMSNorm, SwiGLU) against plain formulas, over random models."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import models, token_lists
from transformers_references import (
    assert_cache_holds_the_recorded,
    assert_float32_logits_close,
    memory_mapped,
    prompts,
    reference_fixtures,
)

import kvlib
from kvlib.checkpoints import llama
from kvlib.checkpoints.safetensors import read_header, read_safetensors, write_safetensors

REFERENCE = Path(__file__).parent / "data" / "llama-reference"
PROPERTY = settings(max_examples=40, deadline=None)


recorded, wide, narrow = reference_fixtures(REFERENCE, llama.load)


def test_the_checkpoint_is_what_transformers_wrote(wide):
    config = json.loads((REFERENCE / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert "model.layers.0.self_attn.q_proj.weight" in read_header(
        REFERENCE / "model.safetensors")[0]
    assert wide.config == kvlib.ModelConfig(
        vocab_size=300, d_model=32, n_heads=4, n_layers=3, d_ff=80, context_length=64,
        dtype="float64", positions="rotary", norm="rms", mlp="swiglu", norm_epsilon=1e-5,
        n_kv_heads=2, rope_base=10000.0, rope_pairing="half")


def test_float64_logits_match_transformers_within_1e_12(wide, recorded):
    for i, prompt in enumerate(prompts(recorded)):
        np.testing.assert_allclose(kvlib.forward(wide, prompt),
                                   recorded[f"logits_float64_{i}"], rtol=0, atol=1e-12)


def test_float32_logits_match_transformers_relative_to_their_size(narrow, recorded):
    assert_float32_logits_close(narrow, recorded, 1e-5)


def test_the_cache_holds_the_rotated_keys_transformers_caches(wide, recorded):
    assert_cache_holds_the_recorded(wide, recorded, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_decoding_through_the_cache_gives_transformers_tokens(recorded, dtype, wide,
                                                                     narrow):
    params = wide if dtype == "float64" else narrow
    expected = recorded[f"greedy_{dtype}"].tolist()
    assert kvlib.generate(params, recorded["cache_prompt"], len(expected)) == expected
    assert kvlib.generate(params, recorded["cache_prompt"], len(expected),
                          use_cache=False) == expected


def test_the_wrong_pairing_is_another_model(wide, recorded):
    prompt = prompts(recorded)[2]
    wrong = wide.with_config(rope_pairing="interleaved")
    assert np.abs(kvlib.forward(wrong, prompt) - recorded["logits_float64_2"]).max() > 0.1


# --------------------------------------------------------------------------- the two pairings

@PROPERTY
@given(models(positions="rotary", latent=False), st.data())
def test_reordering_q_and_k_columns_turns_one_pairing_into_the_other(model, data):
    """llama.cpp's permutation: the same model, the same logits, and a cache whose keys are
    the same numbers with each head's columns reordered."""
    params, config = model
    ids = token_lists(data.draw, config, min_size=1, max_size=10)
    other = "half" if config.rope_pairing == "interleaved" else "interleaved"
    turned = llama.with_rope_pairing(params, other)
    assert turned.config.rope_pairing == other
    np.testing.assert_allclose(kvlib.forward(turned, ids), kvlib.forward(params, ids),
                               rtol=0, atol=1e-10)
    np.testing.assert_array_equal(llama.with_rope_pairing(turned, config.rope_pairing)
                                  .layers[0].Wk, params.layers[0].Wk)


@PROPERTY
@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 5), st.integers(0, 99))
def test_rotate_halves_is_rotate_pairs_on_reordered_columns(heads, half, tokens, seed):
    rng = np.random.default_rng(seed)
    dim = 2 * half
    X = rng.standard_normal((tokens, heads * dim))
    angles = kvlib.rotary_angles(rng.integers(0, 1000, tokens), dim)
    order = llama.to_interleaved_columns(np.arange(heads * dim)[None, :], heads)[0]
    np.testing.assert_allclose(kvlib.rotate_pairs(X[:, order], angles),
                               kvlib.rotate_halves(X, angles)[:, order], atol=1e-12)


def test_reordering_columns_is_llama_cpps_row_permutation():
    # convert_hf_to_gguf.py's permute on (out, in) rows: reshape(heads, 2, dh/2, in),
    # swap the two middle axes, reshape back
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4 * 6, 5))                               # (heads x dh, in)
    llama_cpp = rows.reshape(4, 2, 3, 5).swapaxes(1, 2).reshape(rows.shape)
    np.testing.assert_array_equal(llama.to_interleaved_columns(rows.T, 4), llama_cpp.T)
    np.testing.assert_array_equal(llama.to_half_columns(llama_cpp.T, 4), rows.T)


# --------------------------------------------------------------------------- the pieces

@PROPERTY
@given(st.integers(1, 6), st.integers(1, 12), st.floats(1e-8, 1e-2), st.integers(0, 99))
def test_rms_norm_is_the_plain_formula(tokens, width, epsilon, seed):
    rng = np.random.default_rng(seed)
    X, gain = rng.standard_normal((tokens, width)), rng.standard_normal(width)
    expected = np.array([row / np.sqrt(np.mean(row ** 2) + epsilon) * gain for row in X])
    np.testing.assert_allclose(kvlib.rms_norm(X, gain, epsilon), expected, atol=1e-12)
    assert kvlib.rms_norm(X.astype(np.float32), gain.astype(np.float32)).dtype == np.float32


def test_silu_is_x_times_the_logistic_and_never_overflows():
    x = np.linspace(-50, 50, 101)
    np.testing.assert_allclose(kvlib.silu(x), x / (1 + np.exp(-x)), rtol=1e-12, atol=1e-300)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        assert kvlib.silu(np.array([-1e4, 1e4], np.float32)).tolist() == [-0.0, 1e4]


@PROPERTY
@given(models(latent=False), st.integers(1, 5), st.integers(0, 99))
def test_swiglu_mlp_is_gate_times_up_then_down(model, tokens, seed):
    params, config = model
    X = np.random.default_rng(seed).standard_normal((tokens, config.d_model))
    layer = params.layers[0]
    if config.mlp == "swiglu":
        gate = X @ layer.W_gate
        expected = (gate / (1 + np.exp(-gate)) * (X @ layer.W_up)) @ layer.W_down
        assert layer.W_gate.shape == (config.d_model, config.d_ff)
    else:
        assert layer.W_gate is None
        expected = kvlib.gelu_mlp(X, layer)
    np.testing.assert_allclose(kvlib.mlp(X, layer), expected, atol=1e-10)


def test_swiglu_counts_three_matrices_of_work_and_of_weights():
    gelu = kvlib.ModelConfig(d_model=8, n_heads=2, d_ff=16)
    swiglu = gelu.replace(mlp="swiglu")
    assert kvlib.forward_multiply_adds(swiglu, 5).mlp == 3 * 3 * 5 * 8 * 16
    assert kvlib.forward_multiply_adds(gelu, 5).mlp == 3 * 2 * 5 * 8 * 16
    assert kvlib.init_params(swiglu).n_parameters - kvlib.init_params(gelu).n_parameters \
        == 3 * 8 * 16


def test_rms_norm_has_a_gain_and_no_bias():
    params = kvlib.init_params(kvlib.ModelConfig(norm="rms"))
    assert params.layers[0].ln_1_gain.shape == (4,) and params.layers[0].ln_1_bias is None
    assert params.ln_f_gain.shape == (4,) and params.ln_f_bias is None
    with pytest.raises(ValueError, match="ln_1_bias is given, but this config has no use"):
        import dataclasses
        layer = dataclasses.replace(params.layers[0], ln_1_bias=np.zeros(4))
        kvlib.Params(params.config, params.embedding, (layer,) + params.layers[1:],
                     ln_f_gain=params.ln_f_gain)


# --------------------------------------------------------------------------- the hub's layout

@pytest.mark.parametrize("stored, tolerance", [("F32", 0.0), ("F16", 2e-2), ("BF16", 1e-1)])
def test_save_and_load_round_trip(tmp_path, narrow, recorded, stored, tolerance):
    llama.save(narrow, tmp_path, stored_dtype=stored)
    again = llama.load(tmp_path, dtype="float32")
    assert again.config == narrow.config
    a, b = kvlib.forward(again, prompts(recorded)[1]), kvlib.forward(narrow, prompts(recorded)[1])
    assert np.abs(a - b).max() <= tolerance * np.abs(b).max() + 1e-5


def test_float32_weights_stay_memory_mapped_transposed_views(narrow):
    assert memory_mapped(narrow.embedding) and memory_mapped(narrow.layers[0].Wq)
    assert narrow.layers[0].Wq.flags.f_contiguous       # (out, in) in the file, read as .T


def test_an_interleaved_model_must_be_turned_before_saving(tmp_path, narrow):
    with pytest.raises(ValueError, match="with_rope_pairing"):
        llama.save(llama.with_rope_pairing(narrow, "interleaved"), tmp_path)


def _rewrite(tmp_path, change):
    tensors = {name: np.array(a)
               for name, a in read_safetensors(REFERENCE / "model.safetensors").items()}
    config = json.loads((REFERENCE / "config.json").read_text())
    change(tensors, config)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("change, words", [
    (lambda t, c: t.pop("model.layers.1.mlp.gate_proj.weight"),
     r"no tensor 'model.layers.1.mlp.gate_proj.weight' \(kvlib's layer 1 W_gate\)"),
    (lambda t, c: t.update({"model.norm.weight": np.zeros(31, np.float32)}),
     r"'model.norm.weight' has shape \(31,\)"),
    (lambda t, c: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
     "does not read: 'model.layers.0.self_attn.q_proj.bias'"),
    (lambda t, c: t.update({"lm_head.weight": np.ones((300, 32), np.float32)}),
     "'lm_head.weight' \\(an lm_head.weight must equal the token table"),
    (lambda t, c: t["model.layers.2.mlp.up_proj.weight"].__setitem__((0, 0), np.nan),
     "holds 1 NaN or infinite"),
    (lambda t, c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda t, c: c.update(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda t, c: c.update(rope_parameters={"rope_theta": 1e4, "rope_type": "llama3"}),
     "RoPE scaling 'llama3'"),
    (lambda t, c: c.update(model_type="mistral"), "'mistral' model"),
    (lambda t, c: c.pop("num_hidden_layers"), "no 'num_hidden_layers' entry"),
])
def test_a_checkpoint_kvlib_cannot_run_is_refused_in_words(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        llama.load(_rewrite(tmp_path, change))


def test_a_folder_without_its_files_or_with_bad_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        llama.load(tmp_path)
    shutil.copy(REFERENCE / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not a config.json, a JSON object"):
        llama.load(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="it holds a JSON list"):
        llama.load(tmp_path)
    with pytest.raises(TypeError, match="must be a path"):
        llama.load(None)
