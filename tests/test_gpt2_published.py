"""GPT-2 124M's published greedy continuation, with the real weights (issue 9).

Runs only where the weights are downloaded (kvlib.gpt2.find_weights(): $KVLIB_GPT2_DIR, else
~/.cache/kvlib/gpt2; `make gpt2` or kvlib.gpt2.download() fetches them). CI has no network and
skips it, saying why. The expected text is the issue's, written out here again, so that
notebook 13's copy (kvlib.widgets.what_the_heads_read) is checked against it too.
"""

import json

import numpy as np
import pytest

import kvlib
from kvlib import gpt2
from kvlib.widgets import what_the_heads_read

PROMPT = "Alan Turing theorized that computers would one day become"
CONTINUATION = (" the most powerful machines on the planet.\n\nThe computer is a machine that "
                "can perform complex calculations, and it can perform these calculations in a "
                "way that is very similar to the human brain.")
NEW_TOKENS = 40

WEIGHTS = gpt2.find_weights()
needs_weights = pytest.mark.skipif(
    WEIGHTS is None,
    reason=f"GPT-2 124M's weights are not downloaded (none in {gpt2.default_directory()}; "
           "`make gpt2` or kvlib.gpt2.download() fetches them, or set KVLIB_GPT2_DIR): the "
           "published continuation is checked only with the real weights")


def test_what_the_heads_read_checks_the_same_text():
    assert (what_the_heads_read.PUBLISHED_PROMPT, what_the_heads_read.PUBLISHED_CONTINUATION,
            what_the_heads_read.PUBLISHED_NEW_TOKENS) == (PROMPT, CONTINUATION, NEW_TOKENS)


@pytest.fixture(scope="module")
def model():
    return gpt2.load(WEIGHTS), gpt2.Tokenizer.gpt2()


@needs_weights
def test_the_weights_are_gpt2_124m(model):
    params, _ = model
    assert params.config == gpt2.GPT2_124M
    assert params.n_parameters == kvlib.memory.PRESETS["GPT-2 small"].n_parameters
    hub_config = json.loads((WEIGHTS / "config.json").read_text())
    assert (hub_config["n_layer"], hub_config["n_embd"], hub_config["vocab_size"]) == \
        (12, 768, 50257)


@needs_weights
def test_greedy_decoding_with_the_cache_gives_the_published_continuation(model):
    params, tokenizer = model
    ids = tokenizer.encode(PROMPT)
    new_ids = kvlib.generate(params, ids, NEW_TOKENS)
    assert tokenizer.decode(new_ids) == CONTINUATION
    assert len(new_ids) == NEW_TOKENS


@needs_weights
def test_the_cached_steps_equal_recomputation_on_the_real_model(model):
    params, tokenizer = model
    ids = tokenizer.encode(PROMPT + CONTINUATION)[:24]
    logits, cache = kvlib.prefill(params, ids[:12])
    for position in range(12, len(ids)):
        step = kvlib.decode_step(params, ids[position], cache)
        full = kvlib.forward(params, ids[:position + 1], last_only=True)
        assert np.abs(step - full).max() / np.abs(full).max() < 1e-5     # float32
