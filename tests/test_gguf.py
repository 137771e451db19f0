"""kvlib.checkpoints.gguf on GGUF files written here with llama.cpp's own gguf package: the
tiny Llama that transformers saved (tests/data/llama-reference), its q and k rows reordered as
llama.cpp's converter does, must compute what transformers computed on the hub's layout; and
a file kvlib cannot run is refused in words."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

import kvlib
from kvlib.bpe import bytes_to_unicode
from kvlib.checkpoints import gguf as kvgguf
from kvlib.checkpoints import llama
from kvlib.checkpoints.integrity import RECORD_NAME
from kvlib.checkpoints.safetensors import read_safetensors

REFERENCE = Path(__file__).parent / "data" / "llama-reference"
CONFIG = json.loads((REFERENCE / "config.json").read_text())
HUB_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, on (out, in) rows."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def tiny_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """300 tokens: the 256 bytes, 41 merges of letters, three control tokens."""
    tokens = list(bytes_to_unicode().values())
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for left, right in zip(letters, letters[1:] + "a"):
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    for left in "ABCDEFGHIJKLMNO":
        merges.append(f"Ġ {left}")
        tokens.append("Ġ" + left)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, merges, types


def write_tiny_gguf(path: Path, change=None) -> Path:
    tensors = {name: np.array(a, np.float32)
               for name, a in read_safetensors(REFERENCE / "model.safetensors").items()}
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    named = {"token_embd.weight": tensors["model.embed_tokens.weight"],
             "output_norm.weight": tensors["model.norm.weight"]}
    for i in range(CONFIG["num_hidden_layers"]):
        for hub, ours in HUB_TO_GGUF.items():
            array = tensors[f"model.layers.{i}.{hub}"]
            if ours == "attn_q.weight":
                array = llama_cpp_permute(array, heads)
            elif ours == "attn_k.weight":
                array = llama_cpp_permute(array, kv_heads)
            named[f"blk.{i}.{ours}"] = array
    metadata = {"general.architecture": "llama"}
    if change is not None:
        change(named, metadata)
    writer = gguf.GGUFWriter(path, metadata["general.architecture"])
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    writer.add_rope_dimension_count(CONFIG["hidden_size"] // heads)
    writer.add_vocab_size(CONFIG["vocab_size"])
    tokens, merges, types = tiny_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for name, array in named.items():
        writer.add_tensor(name, array)
    write_out(writer)
    return path


def write_out(writer) -> None:
    """A GGUFWriter's file written: its header, its key-value pairs, its tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def recorded():
    with np.load(REFERENCE / "reference.npz") as data:
        return dict(data)


def test_a_gguf_file_computes_what_transformers_computed_on_the_hubs_layout(tiny_gguf,
                                                                            recorded):
    params = kvgguf.load_gguf(tiny_gguf, dtype="float64")
    assert params.config == llama.load(REFERENCE, "float64").config.replace(
        rope_pairing="interleaved")
    for i in range(4):
        np.testing.assert_allclose(kvlib.forward(params, recorded[f"prompt_{i}"]),
                                   recorded[f"logits_float64_{i}"], rtol=0, atol=1e-12)
    assert kvlib.generate(params, recorded["cache_prompt"], 20) == \
        recorded["greedy_float64"].tolist()


def test_the_wrong_pairing_on_gguf_weights_is_another_model(tiny_gguf, recorded):
    params = kvgguf.load_gguf(tiny_gguf, dtype="float64").with_config(rope_pairing="half")
    assert np.abs(kvlib.forward(params, recorded["prompt_2"])
                  - recorded["logits_float64_2"]).max() > 0.1


def test_conversion_happens_once_and_again_when_the_file_changes(tiny_gguf):
    kvgguf.load_gguf(tiny_gguf)
    folder = kvgguf.converted_directory(tiny_gguf)
    assert kvgguf.is_converted(tiny_gguf)
    assert sorted(p.name for p in folder.iterdir() if p.name != RECORD_NAME) == \
        sorted(kvgguf.CONVERTED_FILES)       # verified.json too, once its files have settled
    stamp = json.loads((folder / "source.json").read_text())
    (folder / "source.json").write_text(json.dumps(stamp | {"bytes": 1}))
    assert not kvgguf.is_converted(tiny_gguf)
    kvgguf.load_gguf(tiny_gguf)
    assert kvgguf.is_converted(tiny_gguf)


def test_weights_load_memory_mapped_from_the_converted_folder(tiny_gguf):
    params = kvgguf.load_gguf(tiny_gguf)
    base = params.layers[0].Wq
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap) and params.layers[0].Wq.flags.f_contiguous


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tiny_gguf):
    kvgguf.load_gguf(tiny_gguf)
    folder = kvgguf.converted_directory(tiny_gguf)
    metadata = kvgguf.read_converted_metadata(folder)
    assert metadata["kvlib.control_tokens"] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert "tokenizer.ggml.tokens" not in metadata        # the long lists live in vocab.json
    tokenizer = kvlib.Tokenizer.from_directory(folder,
                                               special_tokens=metadata["kvlib.control_tokens"])
    assert tokenizer.tokens(tokenizer.encode("<|im_start|>ab Ab")) == \
        ["<|im_start|>", "ab", " A", "b"]


@pytest.mark.parametrize("change, words", [
    (lambda t, m: m.update({"general.architecture": "gpt2"}), "'gpt2' model"),
    (lambda t, m: t.pop("blk.1.ffn_gate.weight"), "no tensor 'blk.1.ffn_gate.weight'"),
    (lambda t, m: t.update({"output.weight": t["token_embd.weight"]}), "untied unembedding"),
    (lambda t, m: t.update({"blk.0.attn_q.bias": np.zeros(32, np.float32)}),
     "does not know: \\['blk.0.attn_q.bias'\\]"),
    (lambda t, m: t["blk.2.ffn_down.weight"].__setitem__((0, 0), np.inf), "infinite"),
])
def test_a_gguf_file_kvlib_cannot_run_is_refused_in_words(tmp_path, change, words):
    path = write_tiny_gguf(tmp_path / "bad.gguf", change)
    with pytest.raises(ValueError, match=words):
        kvgguf.load_gguf(path)
    assert not kvgguf.converted_directory(path).exists(), "nothing half-written is left"


def test_not_a_gguf_file_is_named(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="not a GGUF file"):
        kvgguf.load_gguf(tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        kvgguf.load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(TypeError, match="must be a path"):
        kvgguf.read_gguf(3)


@pytest.mark.parametrize("kind, bits", [("Q4_1", 5.0), ("Q8_0", 8.5), ("Q4_0", 4.5),
                                        ("F16", 16.0), ("F32", 32.0)])
def test_bits_per_number_match_the_gguf_packages_block_sizes(kind, bits):
    numbers, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    assert kvgguf.bits_per_number(kind) == bits == 8 * block_bytes / numbers
