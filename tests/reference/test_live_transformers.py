"""kvlib's GPT-2 against transformers, live (`make test-reference`; needs torch and
transformers, so plain `make test` and CI skip it and rely on tests/test_gpt2_reference.py,
which compares against numbers this comparison wrote once).

Random GPT2LMHeadModels (no download): a few small ones, and one of GPT-2 124M's full
shapes, each saved with save_pretrained and loaded with kvlib.gpt2.load."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the live comparison needs torch and transformers "
                                            "(make test-reference installs them)")
transformers = pytest.importorskip("transformers")

import kvlib  # noqa: E402
from kvlib import gpt2  # noqa: E402

SMALL = [dict(vocab_size=97, n_positions=24, n_embd=16, n_layer=1, n_head=1),
         dict(vocab_size=300, n_positions=64, n_embd=48, n_layer=4, n_head=6),
         dict(vocab_size=1000, n_positions=40, n_embd=64, n_layer=2, n_head=8, n_inner=100)]


def random_model(sizes, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**sizes, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.1)
            elif ".ln_" in name:
                tensor.normal_(1.0, 0.1)
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


@pytest.mark.parametrize("sizes", SMALL)
def test_small_models_match(tmp_path, sizes):
    model = random_model(sizes)
    model.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, sizes["vocab_size"], sizes["n_positions"])
    wide = gpt2.load(tmp_path, dtype="float64")
    np.testing.assert_allclose(kvlib.forward(wide, ids), logits_of(model.double(), ids),
                               rtol=0, atol=1e-9)
    narrow = gpt2.load(tmp_path, dtype="float32")
    expected = logits_of(model.float(), ids)
    assert np.abs(kvlib.forward(narrow, ids) - expected).max() / np.abs(expected).max() < 1e-4
    _, cache = kvlib.prefill(wide, ids[:5])
    for token in ids[5:]:
        kvlib.decode_step(wide, int(token), cache)
    with torch.no_grad():
        theirs = model.double()(torch.tensor([list(ids)]), use_cache=True)
    kept = theirs["cache"] if "cache" in theirs else theirs["past_key_values"]
    for layer, held in enumerate(kept.layers):
        np.testing.assert_allclose(kvlib.split_heads(cache.keys(layer), sizes["n_head"]),
                                   held.keys[0].numpy(), rtol=0, atol=1e-9)


def test_gpt2_124m_shapes_match(tmp_path):
    model = random_model({}, seed=1)          # GPT2Config()'s defaults are GPT-2 124M
    model.save_pretrained(tmp_path)
    params = gpt2.load(tmp_path, dtype="float32")
    assert params.config == gpt2.GPT2_124M
    ids = np.random.default_rng(1).integers(0, 50257, 24)
    expected = logits_of(model, ids)
    ours = kvlib.forward(params, ids)
    assert np.abs(ours - expected).max() / np.abs(expected).max() < 1e-4
    assert (ours.argmax(axis=-1) == expected.argmax(axis=-1)).mean() > 0.95
