"""kvlib's attention variants (notebooks 14-17) against what transformers' own code computes,
without torch: tools/make_variant_references.py ran transformers' rotary functions,
LlamaAttention with grouped K/V heads, DeepseekV3Attention, MistralAttention and the
sliding-window masks on seeded inputs, and wrote the results into
tests/data/variants-reference/ (versions.json names the versions).

tests/test_variants.py checks that each variant's cache gives what recomputing gives; a
variant that is consistently wrong (a rotary exponent i/dim instead of 2i/dim, a latent
attention scaled by 1/sqrt(dh) instead of 1/sqrt(dh + dr)) passes that and fails this.

Layouts: transformers' nn.Linear weights are (out, in) and kvlib's W are (in, out), so
kvlib's W = weight.T. Where transformers ran in float64 the tolerance is 1e-10. It computes
its rotary inverse frequencies in float32 whatever the model's dtype; the references
record them (`inv_freq`, `angles` = positions x inv_freq) so that the rotation itself is
compared in float64, and kvlib's own float64 frequencies are compared with them at float32's
precision.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvlib
from kvlib import grouped, latent
from kvlib.params import LatentLayerParams, LayerParams

REFERENCE = Path(__file__).parent / "data" / "variants-reference"
with np.load(REFERENCE / "reference.npz") as _data:
    RECORDED = dict(_data)

EXACT = 1e-10
FLOAT32_FREQUENCIES = 2.5e-7
"""transformers' inv_freq is rounded to float32 (a relative 6e-8) after a float32 power of a
few ulps; measured worst 8.3e-8 here. An exponent i/dim instead of 2i/dim puts pair i off by
a factor base^(i/dim): 1.2 for pair 1 at base 100000 and dim 64, far more for later pairs."""
FLOAT32_SOFTMAX = 3e-7
"""transformers' eager attention (the one that returns its weights) takes the softmax in
float32 whatever the model's dtype: weights within a few float32 ulps (measured worst
7e-8). The outputs come from its sdpa path, float64 throughout, and are held to EXACT."""


def cases(section: str) -> list[dict]:
    """Each recorded case of a section, as {name: array}."""
    numbers = sorted({int(key.split(".")[1]) for key in RECORDED if key.startswith(section + ".")})
    prefix = [f"{section}.{n}." for n in numbers]
    return [{key.removeprefix(p): value for key, value in RECORDED.items() if key.startswith(p)}
            for p in prefix]


def ids(section: str) -> list[str]:
    return [f"{section}{n}" for n in range(len(cases(section)))]


def close(actual, expected, atol=EXACT):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


@dataclass(frozen=True)
class RecordedRotation:
    """kvlib's rotation (rotate_pairs or rotate_halves) by transformers' recorded angles,
    standing in for a kvlib.RotaryPositions: the attention is then compared in float64,
    and kvlib's own angles are compared with the recorded ones apart."""

    angles: np.ndarray
    pairing: str

    def rotate(self, X):
        return kvlib.positions.ROTATIONS[self.pairing](X, self.angles)

    def rows(self, start, stop):
        return RecordedRotation(self.angles[start:stop], self.pairing)


def no_mlp(config):
    """Zero MLP weights: the block's output is then X + attention (no norms either)."""
    return dict(W_up=np.zeros((config.d_model, config.d_ff)),
                W_down=np.zeros((config.d_ff, config.d_model)))


def through_cache(block, layer, config, X, rotation, split):
    """X through one kvlib block as kvlib.prefill runs it (notebook 08): the first `split`
    tokens, then the rest, each chunk appended to the cache kind the config asks for and
    masked by the cache's key positions. Returns the second chunk's attention output."""
    cache = kvlib.make_cache(config)
    outputs = []
    for start, stop in ((0, split), (split, len(X))):
        positions = np.arange(start, stop)
        mask = kvlib.attention_mask(positions, cache.key_positions(stop - start),
                                    config.window, config.sink_tokens)
        block_output = block(X[start:stop], layer, config.n_heads, mask=mask, cache=cache,
                             rotary=rotation.rows(start, stop))
        outputs.append(block_output - X[start:stop])
    return outputs[1]


def test_the_references_name_their_versions():
    versions = json.loads((REFERENCE / "versions.json").read_text())
    assert versions["transformers"].startswith("5.") and "torch" in versions
    assert (REFERENCE / "reference.npz").stat().st_size < 400_000


# ----------------------------------------------------------------------------- rotary

@pytest.mark.parametrize("case", cases("rotary"), ids=ids("rotary"))
def test_rotary_angles_are_transformers_frequencies(case):
    angles = kvlib.rotary_angles(case["positions"], int(case["dim"]), float(case["base"]))
    np.testing.assert_allclose(angles, case["angles"], rtol=FLOAT32_FREQUENCIES, atol=0)
    frequencies = kvlib.rotary_angles([1], int(case["dim"]), float(case["base"]))[0]
    np.testing.assert_allclose(frequencies, case["inv_freq"], rtol=FLOAT32_FREQUENCIES)


@pytest.mark.parametrize("case", cases("rotary"), ids=ids("rotary"))
def test_rotate_halves_is_llamas_rotate_half(case):
    for x in "qk":
        close(kvlib.rotate_halves(case[x], case["angles"]), case[f"half_{x}"])


@pytest.mark.parametrize("case", cases("rotary"), ids=ids("rotary"))
def test_rotate_pairs_is_deepseeks_interleaved_rotation(case):
    """DeepSeek-V3's apply_rotary_pos_emb_interleave turns the pairs (2i, 2i+1) and writes
    the turned first members, then the turned second members: kvlib's result reordered."""
    dim = int(case["dim"])
    for x in "qk":
        turned = kvlib.rotate_pairs(case[x], case["angles"])
        T, width = turned.shape
        reordered = turned.reshape(T, width // dim, dim // 2, 2).transpose(0, 1, 3, 2)
        close(reordered.reshape(T, width), case[f"interleave_{x}"])


@pytest.mark.parametrize("case", cases("rotary"), ids=ids("rotary"))
def test_reordered_columns_make_rotate_pairs_llamas_rotation(case):
    """rotate_halves' docstring: llama.cpp's converter reorders each head's rows of q_proj
    and k_proj (`permute` in convert_hf_to_gguf.py: reshape(2, dim/2), swap the axes) to
    0, dim/2, 1, dim/2 + 1, ..., and then the interleaved pairing turns what Llama's
    rotate_half turns (in that order)."""
    dim, width = int(case["dim"]), case["q"].shape[1]
    order = np.arange(width).reshape(-1, 2, dim // 2).swapaxes(1, 2).ravel()
    close(kvlib.rotate_pairs(case["q"][:, order], case["angles"]), case["half_q"][:, order])


def float32_angle_tolerance(case):
    """|x| times the largest angle error of transformers' float32 frequencies (angle x
    FLOAT32_FREQUENCIES) and of its float32 cos/sin (a few 1e-8), twice for the two
    columns a pair mixes."""
    largest_angle = case["angles"].max()
    return 2 * np.abs(case["q"]).max() * (FLOAT32_FREQUENCIES * largest_angle + 1.2e-7)


@pytest.mark.parametrize("case", cases("rotary"), ids=ids("rotary"))
def test_rotary_positions_half_is_llamas_rotary_embedding(case):
    """End to end, kvlib's own angles: against the float64 rotation, and against what a
    Llama in transformers computes (its cos/sin in float32)."""
    rotary = kvlib.RotaryPositions(case["positions"], int(case["dim"]), float(case["base"]),
                                   "half")
    rotated = rotary.rotate(case["q"])
    close(rotated, case["half_q"], atol=float32_angle_tolerance(case))
    close(rotated, case["llama_q"], atol=float32_angle_tolerance(case))


@pytest.mark.parametrize("case", cases("gptj"), ids=ids("gptj"))
def test_rotary_positions_interleaved_is_gptj_in_float64(case):
    """GPT-J's sinusoid table and rotate_every_two: float64 from the frequencies on."""
    positions, dim = case["positions"], int(case["dim"])
    angles = kvlib.rotary_angles(positions, dim)
    close(np.sin(angles), case["sin"])
    close(np.cos(angles), case["cos"])
    close(kvlib.RotaryPositions(positions, dim).rotate(case["q"]), case["rotated"])


# ------------------------------------------------------------------------ grouped K/V

def llama_layer(case, config):
    """transformers' q/k/v/o_proj.weight (out, in) as kvlib's LayerParams (in, out)."""
    return LayerParams(Wq=case["q_proj.weight"].T, Wk=case["k_proj.weight"].T,
                       Wv=case["v_proj.weight"].T, Wo=case["o_proj.weight"].T,
                       **no_mlp(config))


def grouped_config(case, **options):
    return kvlib.ModelConfig(d_model=32, n_heads=4, n_kv_heads=int(case["kv_heads"]), n_layers=1,
                             d_ff=8, context_length=16, positions="rotary",
                             rope_pairing="half", **options)


@pytest.mark.parametrize("case", cases("gqa"), ids=ids("gqa"))
def test_repeat_kv_heads_is_transformers_repeat_kv(case):
    np.testing.assert_array_equal(grouped.repeat_kv_heads(case["repeat_kv_in"], 4),
                                  case["repeat_kv_out"])


@pytest.mark.parametrize("case", cases("gqa"), ids=ids("gqa"))
def test_grouped_attention_is_llama_attention(case):
    config = grouped_config(case)
    layer, x, T = llama_layer(case, config), case["x"], len(case["x"])
    Q, K, V = kvlib.project_qkv(x, layer)
    Q, K = kvlib.rotate_halves(Q, case["angles"]), kvlib.rotate_halves(K, case["angles"])
    queries = kvlib.split_heads(Q, 4)
    keys, values = kvlib.split_heads(K, config.kv_heads), kvlib.split_heads(V, config.kv_heads)
    mask = kvlib.causal_mask(T)
    np.testing.assert_array_equal(mask, case["mask"])
    close(kvlib.attention_weights(queries, keys, mask), case["weights"], FLOAT32_SOFTMAX)
    heads = kvlib.attention(queries, keys, values, mask)
    close(kvlib.merge_heads(heads) @ layer.Wo, case["output"])
    close(kvlib.merge_heads(grouped.repeated_attention(queries, keys, values, mask))
          @ layer.Wo, case["output"])


@pytest.mark.parametrize("case", cases("gqa"), ids=ids("gqa"))
def test_the_grouped_decoder_block_and_its_cache_are_llama_attention(case):
    config = grouped_config(case)
    layer, x = llama_layer(case, config), case["x"]
    rotation = RecordedRotation(case["angles"], config.rope_pairing)
    positions = np.arange(len(x))
    recorded = []
    whole = kvlib.decoder_block(x, layer, 4, kvlib.attention_mask(positions, positions),
                                rotary=rotation, record_attention=recorded)
    close(whole - x, case["output"])
    close(recorded[0], case["weights"], FLOAT32_SOFTMAX)
    split = len(x) // 2
    close(through_cache(kvlib.decoder_block, layer, config, x, rotation, split),
          case["output"][split:])
    ours = kvlib.rotary_positions(config, positions).angles
    np.testing.assert_allclose(ours, case["angles"], rtol=FLOAT32_FREQUENCIES)


# ---------------------------------------------------------------------------- latent

def latent_layer(case, config):
    """DeepseekV3Attention's weights as kvlib's LatentLayerParams. Per head, q_proj's rows
    are [content dn | rotary dr], kv_b_proj's [key dn | value dv]; kv_a_proj_with_mqa's
    rows are [latent dc | shared rotary key dr]."""
    d, h, dc, dr = config.d_model, config.n_heads, config.latent_dim, config.rope_head_dim
    dh = d // h
    queries = case["q_proj.weight"].T.reshape(d, h, dh + dr)
    up = case["kv_b_proj.weight"].T.reshape(dc, h, 2 * dh)
    down = case["kv_a_proj_with_mqa.weight"].T
    return LatentLayerParams(
        Wq=queries[:, :, :dh].reshape(d, h * dh), Wq_rope=queries[:, :, dh:].reshape(d, h * dr),
        W_down_kv=down[:, :dc], Wk_rope=down[:, dc:],
        W_up_k=up[:, :, :dh].reshape(dc, h * dh), W_up_v=up[:, :, dh:].reshape(dc, h * dh),
        Wo=case["o_proj.weight"].T, **no_mlp(config))


def latent_config(case):
    pairing = "interleaved" if case["interleave"] else "half"
    return kvlib.ModelConfig(d_model=32, n_heads=4, n_layers=1, d_ff=8, context_length=16,
                             positions="rotary", rope_pairing=pairing, latent_dim=12,
                             rope_head_dim=8)


@pytest.mark.parametrize("case", cases("mla"), ids=ids("mla"))
def test_the_softmax_scale_counts_the_rotary_columns(case, monkeypatch):
    assert case["scaling"] == pytest.approx(1 / np.sqrt(8 + 8), rel=1e-15)  # dh + dr
    config = latent_config(case)
    layer, x = latent_layer(case, config), case["x"]
    assert latent._scale(layer, 4) == pytest.approx(float(case["scaling"]), rel=1e-15)
    # the reference tells the scales apart: 1 / sqrt(dh) alone moves the output
    monkeypatch.setattr(latent, "_scale", lambda layer, n_heads: 1 / np.sqrt(8))
    wrong = latent.latent_attention(x, layer, 4, kvlib.causal_mask(len(x)),
                                    rotary=RecordedRotation(case["angles"], config.rope_pairing))
    assert np.abs(wrong @ layer.Wo - case["output"]).max() > 1e-2


@pytest.mark.parametrize("form", [latent.latent_attention, latent.latent_attention_rebuilt])
@pytest.mark.parametrize("case", cases("mla"), ids=ids("mla"))
def test_latent_attention_is_deepseek_v3_attention(case, form):
    config = latent_config(case)
    layer, x = latent_layer(case, config), case["x"]
    rotation = RecordedRotation(case["angles"], config.rope_pairing)
    mask = kvlib.causal_mask(len(x))
    close(form(x, layer, 4, mask, rotary=rotation) @ layer.Wo, case["output"])


@pytest.mark.parametrize("case", cases("mla"), ids=ids("mla"))
def test_the_latent_block_and_its_cache_are_deepseek_v3_attention(case):
    config = latent_config(case)
    layer, x = latent_layer(case, config), case["x"]
    rotation = RecordedRotation(case["angles"], config.rope_pairing)
    recorded = []
    whole = kvlib.latent_decoder_block(x, layer, 4, kvlib.causal_mask(len(x)),
                                       rotary=rotation, record_attention=recorded)
    close(whole - x, case["output"])
    close(recorded[0], case["weights"], FLOAT32_SOFTMAX)
    close(through_cache(kvlib.latent_decoder_block, layer, config, x, rotation, 3),
          case["output"][3:])
    ours = kvlib.rotary_positions(config, np.arange(len(x)))
    assert ours.dim == 8 and ours.pairing == config.rope_pairing
    np.testing.assert_allclose(ours.angles, case["angles"], rtol=FLOAT32_FREQUENCIES)


# -------------------------------------------------------------------- sliding windows

@pytest.mark.parametrize("case", cases("mask"), ids=ids("mask"))
def test_attention_mask_is_transformers_sliding_window_mask(case):
    allowed = kvlib.attention_mask(case["query_positions"], case["key_positions"],
                                   int(case["window"]), int(case["sinks"]))
    np.testing.assert_array_equal(allowed, case["allowed"])


def test_the_masks_cover_windows_sinks_and_a_cache_that_dropped_keys():
    recorded = cases("mask")
    assert any(case["sinks"] and not case["allowed"].all() for case in recorded)
    assert any(case["key_positions"][0] > 0 for case in recorded)   # dropped by the cache
    assert any(case["window"] > len(case["key_positions"]) for case in recorded)


@pytest.mark.parametrize("case", [c for c in cases("mask") if c["prefix"]],
                         ids=[n for c, n in zip(cases("mask"), ids("mask")) if c["prefix"]])
def test_mistrals_sliding_cache_keeps_window_minus_one_past_keys(case):
    """Notebook 17's claim: DynamicSlidingWindowLayer keeps the last W - 1 past tokens (the
    token being decoded is the W-th); kvlib's ring keeps W."""
    prefix, window, T = int(case["prefix"]), int(case["window"]), len(case["query_positions"])
    kept = np.arange(max(0, prefix - (window - 1)), prefix)
    np.testing.assert_array_equal(case["key_positions"],
                                  np.concatenate([kept, np.arange(prefix, prefix + T)]))


@pytest.mark.parametrize("case", cases("window"), ids=ids("window"))
def test_windowed_attention_is_mistral_attention(case):
    config = grouped_config(case, window=int(case["window"]), sink_tokens=int(case["sinks"]))
    layer, x = llama_layer(case, config), case["x"]
    positions = np.arange(len(x))
    mask = kvlib.attention_mask(positions, positions, config.window, config.sink_tokens)
    assert not mask.all() and not np.tril(mask).all()
    Q, K, V = kvlib.project_qkv(x, layer)
    Q, K = kvlib.rotate_halves(Q, case["angles"]), kvlib.rotate_halves(K, case["angles"])
    heads = kvlib.attention(kvlib.split_heads(Q, 4), kvlib.split_heads(K, 2),
                            kvlib.split_heads(V, 2), mask)
    close(kvlib.merge_heads(heads) @ layer.Wo, case["output"])
    # the reference tells the masks apart: no window, a window one longer, no sinks
    others = [kvlib.attention_mask(positions, positions),
              kvlib.attention_mask(positions, positions, config.window + 1, config.sink_tokens)]
    if config.sink_tokens:
        others.append(kvlib.attention_mask(positions, positions, config.window))
    for other in others:
        heads = kvlib.attention(kvlib.split_heads(Q, 4), kvlib.split_heads(K, 2),
                                kvlib.split_heads(V, 2), other)
        assert np.abs(kvlib.merge_heads(heads) @ layer.Wo - case["output"]).max() > 1e-2


@pytest.mark.parametrize("case", cases("window"), ids=ids("window"))
def test_the_sliding_window_cache_gives_what_mistrals_cache_gives(case):
    """kvlib's SlidingWindowCache (the sinks and the last W) after a first chunk gives the
    second chunk what Mistral's one pass gives, and, where the reference ran one, what
    Mistral's own sliding cache (the last W - 1) gives."""
    config = grouped_config(case, window=int(case["window"]), sink_tokens=int(case["sinks"]))
    layer, x = llama_layer(case, config), case["x"]
    split = int(case["prefix"]) or len(x) // 2
    rotation = RecordedRotation(case["angles"], config.rope_pairing)
    ours = through_cache(kvlib.decoder_block, layer, config, x, rotation, split)
    close(ours, case["output"][split:])
    if "chunk_output" in case:
        close(ours, case["chunk_output"])
