"""The published model configurations in kvlib.memory.PRESETS, checked against numbers
computed by hand from each model's published configuration (config.json / paper)."""

import pytest

import kvlib
from kvlib.memory import PRESETS, GiB, MiB, tokens_that_fit, weights_bytes

# bytes a token in BF16 = 2 (K and V) x layers x K/V heads x head size x 2 bytes
BY_HAND_BYTES_PER_TOKEN = {
    "GPT-2 small": 2 * 12 * 12 * 64 * 2,       # n_layer 12, n_head 12, n_embd 768
    "Llama-2-7B": 2 * 32 * 32 * 128 * 2,       # 32 layers, 32 K/V heads, hidden 4096
    "Llama-3-8B": 2 * 32 * 8 * 128 * 2,        # 32 layers, 8 K/V heads (GQA)
    "Llama-2-70B": 2 * 80 * 8 * 128 * 2,       # 80 layers, 8 K/V heads (GQA)
    "Falcon-7B": 2 * 32 * 1 * 64 * 2,          # multi_query: one K/V head of 4544 / 71 = 64
    "source example (d 8192, 80 layers, MHA)": 2 * 80 * 8192 * 2,
    "Mistral-7B": 2 * 32 * 8 * 128 * 2,        # 32 layers, 8 K/V heads of 128 (GQA)
    # latent attention: kv_lora_rank 512 + qk_rope_head_dim 64 a layer, no factor 2
    "DeepSeek-V2": 60 * (512 + 64) * 2,
    "DeepSeek-V3": 61 * (512 + 64) * 2,
}


def test_every_preset_is_checked_and_names_its_source():
    assert set(PRESETS) == set(BY_HAND_BYTES_PER_TOKEN)
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert len(preset.source) > 20


@pytest.mark.parametrize("name", sorted(BY_HAND_BYTES_PER_TOKEN))
def test_bytes_per_token_against_the_published_configuration(name):
    assert PRESETS[name].kv_bytes_per_token() == BY_HAND_BYTES_PER_TOKEN[name]


def test_the_figures_of_the_field_notes_table():
    per_token = {name: p.kv_bytes_per_token() for name, p in PRESETS.items()}
    assert list(per_token.values())[:6] == [36_864, 524_288, 131_072, 327_680, 8_192,
                                            2_621_440]
    at_4k = {name: p.kv_cache_bytes(4096) for name, p in PRESETS.items()}
    assert at_4k["GPT-2 small"] == 144 * MiB
    assert at_4k["Llama-2-7B"] == 2 * GiB
    assert at_4k["Llama-3-8B"] == 512 * MiB
    assert at_4k["Llama-2-70B"] == 1.25 * GiB
    assert at_4k["Falcon-7B"] == 32 * MiB
    assert at_4k["source example (d 8192, 80 layers, MHA)"] == 10 * GiB


def test_latent_attention_and_the_sliding_window():
    v3, v2, mistral = PRESETS["DeepSeek-V3"], PRESETS["DeepSeek-V2"], PRESETS["Mistral-7B"]
    assert v3.attention == v2.attention == "MLA" and v3.kv_bytes_per_token() == 70_272
    # DeepSeek-V2's paper: MHA with 128 heads of 128 caches 2 x 128 x 128 x layers elements
    assert v2.mha_bytes_per_token() == 2 * 128 * 128 * 60 * 2
    assert v2.mha_bytes_per_token() / v2.kv_bytes_per_token() == pytest.approx(56.9, abs=0.1)
    # a sliding window caps the cache at 4096 positions, however long the sequence
    assert mistral.kv_cache_bytes(32_768) == mistral.kv_cache_bytes(4096) == 512 * MiB
    assert mistral.kv_cache_bytes(100) == 100 * 131_072


def test_the_source_example_and_its_weights():
    source = PRESETS["source example (d 8192, 80 layers, MHA)"]
    assert source.kv_cache_bytes(4096) == kvlib.kv_cache_bytes(80, 8192, 4096) == 10 * GiB
    assert source.kv_cache_bytes(4096, batch_size=64) == 640 * GiB
    assert source.kv_cache_bytes(1, dtype_bytes=4) == 2 * 2_621_440
    assert source.weights_bytes() == 12 * 80 * 8192**2 * 2 == 120 * GiB
    assert source.n_heads * source.head_dim == source.d_model


def _llama_parameters(vocab, d, layers, heads, kv_heads, ffn):
    head_dim = d // heads
    per_layer = (2 * d * d                      # q_proj, o_proj
                 + 2 * d * kv_heads * head_dim  # k_proj, v_proj
                 + 3 * d * ffn                  # gate, up, down (SwiGLU)
                 + 2 * d)                       # two RMSNorm weights
    return 2 * vocab * d + layers * per_layer + d   # untied embedding and lm_head; final norm


def test_parameter_counts_against_the_published_architectures():
    # GPT-2 small: token and position embeddings (tied unembedding); per block two LayerNorms,
    # c_attn (d, 3d) + bias, c_proj (d, d) + bias, c_fc (d, 4d) + bias, c_proj (4d, d) + bias
    d = 768
    block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    gpt2 = 50257 * d + 1024 * d + 12 * block + 2 * d
    assert PRESETS["GPT-2 small"].n_parameters == gpt2 == 124_439_808
    assert PRESETS["Llama-2-7B"].n_parameters == _llama_parameters(32000, 4096, 32, 32, 32,
                                                                   11008)
    assert PRESETS["Llama-3-8B"].n_parameters == _llama_parameters(128256, 4096, 32, 32, 8,
                                                                   14336)
    assert PRESETS["Llama-2-70B"].n_parameters == _llama_parameters(32000, 8192, 80, 64, 8,
                                                                    28672)
    # Falcon-7B: tied embedding 65024 x 4544; per layer one LayerNorm (weight and bias),
    # query_key_value (4544, 71 x 64 + 2 x 64), dense (4544, 4544), MLP 4544 -> 18176 -> 4544;
    # no biases in the linear layers; a final LayerNorm
    d = 4544
    falcon_layer = 2 * d + d * (71 * 64 + 2 * 64) + d * d + 2 * d * 4 * d
    assert PRESETS["Falcon-7B"].n_parameters == 65024 * d + 32 * falcon_layer + 2 * d
    assert PRESETS["Llama-2-7B"].n_parameters == 6_738_415_616


def test_attention_kinds():
    kinds = {name: p.attention for name, p in PRESETS.items()}
    assert kinds == {"GPT-2 small": "MHA", "Llama-2-7B": "MHA", "Llama-3-8B": "GQA",
                     "Llama-2-70B": "GQA", "Falcon-7B": "MQA",
                     "source example (d 8192, 80 layers, MHA)": "MHA", "Mistral-7B": "GQA",
                     "DeepSeek-V2": "MLA", "DeepSeek-V3": "MLA"}


def test_weights_and_tokens_that_fit():
    llama3 = PRESETS["Llama-3-8B"]
    assert llama3.weights_bytes() == weights_bytes(8_030_261_248) == 16_060_522_496
    assert llama3.weights_bytes(dtype_bytes=1) == 8_030_261_248
    fit = tokens_that_fit(24 * GiB, llama3.weights_bytes(), llama3.kv_bytes_per_token())
    assert fit == (24 * GiB - 16_060_522_496) // 131_072 == 74_075
    assert tokens_that_fit(10 * GiB, 20 * GiB, 100) == 0        # the weights do not fit
    assert tokens_that_fit(1000, 0, 10) == 100


def test_bad_values_are_refused_in_words():
    # the presets' own values are kvlib's (ModelPreset trusts them); what a learner passes
    # to their methods and to the functions is checked
    with pytest.raises(ValueError, match="n_parameters must be at least 0"):
        weights_bytes(-1)
    with pytest.raises(TypeError, match="dtype_bytes must be a whole number"):
        weights_bytes(10, dtype_bytes=1.5)
    with pytest.raises(ValueError, match="bytes_per_token must be at least 1"):
        tokens_that_fit(100, 10, 0)
    with pytest.raises(ValueError, match="memory_bytes"):
        tokens_that_fit(-1, 10, 1)
    with pytest.raises(ValueError, match="seq_len must be at least 0"):
        PRESETS["Llama-3-8B"].kv_cache_bytes(-1)
