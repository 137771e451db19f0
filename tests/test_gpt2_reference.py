"""kvlib's GPT-2 against transformers, without torch: a small GPT2LMHeadModel with random
weights, non-trivial norms and biases, saved by transformers' save_pretrained, and what
transformers computed on it (tools/make_reference.py wrote both into tests/data/)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers_references import (
    assert_cache_holds_the_recorded,
    assert_float32_logits_close,
    memory_mapped,
    prompts,
    reference_fixtures,
)

import kvlib
from kvlib import gpt2, roofline

REFERENCE = Path(__file__).parent / "data" / "gpt2-reference"


recorded, wide, narrow = reference_fixtures(REFERENCE, gpt2.load)


def test_the_checkpoint_is_what_transformers_wrote():
    config = json.loads((REFERENCE / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 3
    names = gpt2.read_header(REFERENCE / "model.safetensors")[0]
    assert "transformer.h.0.attn.c_attn.weight" in names     # save_pretrained's naming


def test_float64_logits_match_transformers_within_1e_9(wide, recorded):
    for i, prompt in enumerate(prompts(recorded)):
        logits = kvlib.forward(wide, prompt)
        np.testing.assert_allclose(logits, recorded[f"logits_float64_{i}"], rtol=0, atol=1e-9)


def test_float32_logits_match_transformers_relative_to_their_size(narrow, recorded):
    assert_float32_logits_close(narrow, recorded, 1e-4)


def test_the_cache_holds_what_transformers_caches(wide, recorded):
    assert_cache_holds_the_recorded(wide, recorded, atol=1e-9)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_decoding_through_the_cache_gives_transformers_tokens(recorded, dtype, wide,
                                                                     narrow):
    params = wide if dtype == "float64" else narrow
    prompt = recorded["cache_prompt"]
    expected = recorded[f"greedy_{dtype}"].tolist()
    assert kvlib.generate(params, prompt, len(expected)) == expected
    assert kvlib.generate(params, prompt, len(expected), use_cache=False) == expected


def test_float32_weights_stay_memory_mapped(narrow):
    assert memory_mapped(narrow.embedding) and memory_mapped(narrow.layers[0].Wq)
    # Wq, Wk and Wv are column blocks of one c_attn matrix: within its bounds, not copies
    assert np.may_share_memory(narrow.layers[0].Wq, narrow.layers[0].Wv)
    assert not narrow.layers[0].Wq.flags.c_contiguous


def test_the_hub_naming_with_mask_buffers_loads_the_same(tmp_path, wide, recorded):
    tensors = gpt2.read_safetensors(REFERENCE / "model.safetensors")
    renamed = {name.removeprefix("transformer."): np.array(array)
               for name, array in tensors.items()}
    size = wide.config.context_length
    for i in range(wide.config.n_layers):     # old files hold the causal mask as a buffer
        renamed[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, size, size), np.float32))
    gpt2.write_safetensors(tmp_path / "model.safetensors", renamed)
    shutil.copy(REFERENCE / "config.json", tmp_path)
    hub = gpt2.load(tmp_path, dtype="float64")
    prompt = prompts(recorded)[2]
    np.testing.assert_array_equal(kvlib.forward(hub, prompt), kvlib.forward(wide, prompt))


@pytest.mark.parametrize("stored, tolerance", [("F32", 0.0), ("F16", 2e-2), ("BF16", 1e-1)])
@pytest.mark.parametrize("prefix", ["", "transformer."])
def test_save_and_load_round_trip(tmp_path, narrow, recorded, stored, tolerance, prefix):
    gpt2.save(narrow, tmp_path, prefix=prefix, stored_dtype=stored)
    again = gpt2.load(tmp_path, dtype="float32")
    assert again.config == narrow.config
    prompt = prompts(recorded)[1]
    a, b = kvlib.forward(again, prompt), kvlib.forward(narrow, prompt)
    assert np.abs(a - b).max() <= tolerance * np.abs(b).max()


def _rewrite(tmp_path, change):
    tensors = {name: np.array(a) for name, a in
               gpt2.read_safetensors(REFERENCE / "model.safetensors").items()}
    config = json.loads((REFERENCE / "config.json").read_text())
    change(tensors, config)
    gpt2.write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("change, words", [
    (lambda t, c: t.pop("transformer.h.1.mlp.c_fc.bias"),
     r"no tensor 'transformer.h.1.mlp.c_fc.bias' \(kvlib's layer 1 b_up\), of shape \(128,\)"),
    (lambda t, c: t.update({"transformer.wpe.weight": np.zeros((40, 32), np.float32)}),
     r"'transformer.wpe.weight' has shape \(40, 32\), but config.json's sizes need \(48, 32\)"),
    (lambda t, c: t.update({"transformer.h.0.attn.extra": np.zeros(2, np.float32)}),
     "does not read: 'transformer.h.0.attn.extra'"),
    (lambda t, c: t.update({"lm_head.weight": np.ones((300, 32), np.float32)}),
     "'lm_head.weight' \\(an lm_head.weight must equal the token table"),
    (lambda t, c: c.update(activation_function="gelu"), "tanh GeLU"),
    (lambda t, c: c.update(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse"),
    (lambda t, c: c.pop("n_embd"), "no 'n_embd' entry"),
    (lambda t, c: c.update(model_type="llama"), "GPT-2 checkpoints only"),
    (lambda t, c: [t.pop(n) for n in list(t) if "wte" in n], "neither 'wte.weight'"),
])
def test_a_checkpoint_that_does_not_fit_gets_an_error_naming_the_tensor(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        gpt2.load(_rewrite(tmp_path, change))


def test_a_folder_without_the_files_says_what_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json and model.safetensors"):
        gpt2.load(tmp_path)


def test_positions_past_the_context_are_refused(wide):
    cache = kvlib.KVCache(wide.config)
    kvlib.prefill(wide, list(range(wide.config.context_length)), cache)
    with pytest.raises(ValueError, match="full"):
        kvlib.decode_step(wide, 1, cache)
    with pytest.raises(ValueError, match="context length is 48"):
        kvlib.forward(wide, list(range(49)))


def test_the_124m_config_is_gpt2_small(tmp_path):
    assert gpt2.GPT2_124M.d_model == 768 and gpt2.GPT2_124M.context_length == 1024
    n = roofline.weights_bytes(gpt2.GPT2_124M) // 4
    assert n == 124_439_808        # the published parameter count, the tied table once
    assert gpt2.find_weights(tmp_path) is None
