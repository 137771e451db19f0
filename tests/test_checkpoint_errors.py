"""Findings of the fuzz of the checkpoint readers, each kept as a test: a damaged or hostile
safetensors header, a config.json that is not a JSON object, weights with NaN or infinity,
and odd arguments get kvlib's own ValueError or TypeError, naming the file or the tensor."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib import gpt2
from kvlib.gpt2 import read_header, read_safetensors, write_safetensors

GPT = kvlib.init_params(kvlib.ModelConfig(positions="learned", norm="layer", bias=True))


def write_file(path, header, data: bytes = b""):
    """A safetensors file made by hand: header (bytes, or a JSON-able object), then data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE_HEADERS = {
    # name: (header bytes, data, words the error must contain)
    "a dtype that is a list": (json.dumps({"w": entry(["F32"])}).encode(), b"\0" * 4,
                               "got {'dtype': ['F32']"),
    "a dtype that is an object": (json.dumps({"w": entry({"F": 32})}).encode(), b"\0" * 4,
                                  "got {'dtype': {'F': 32}"),
    "100,000 nested brackets": (b"[" * 100_000 + b"]" * 100_000, b"", "RecursionError"),
    "a 5,001-digit integer": (b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5001 + b'], '
                              b'"data_offsets": [0, 4]}}', b"\0" * 4, "not valid JSON"),
    "shape [0, 2**62]": (json.dumps({"w": entry(shape=(0, 2**62), offsets=(0, 0))}).encode(),
                         b"", "'shape': [0, 4611686018427387904]"),
    "65 dimensions": (json.dumps({"w": entry(shape=(1,) * 65)}).encode(), b"\0" * 4,
                      "a list of at most 64 sizes"),
    "offsets of 400 digits": (json.dumps({"w": entry(offsets=(0, 10**400))}).encode(),
                              b"\0" * 4, "'data_offsets': [0, 1000"),
    "a name that is not text": (b'{"w": 1, "\\ud800": 2}', b"", "valid"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_hostile_headers_get_a_clear_error_naming_the_file(tmp_path, name):
    header, data, words = HOSTILE_HEADERS[name]
    path = write_file(tmp_path / "hostile.safetensors", header, data)
    for read in (read_header, read_safetensors):
        with pytest.raises(ValueError) as caught:
            read(path)
        assert str(caught.value).startswith(f"{path} is not a valid safetensors file"), caught
        assert words in str(caught.value), str(caught.value)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["dtype", "shape", "data_offsets", "w", "__metadata__"]), children,
        max_size=4),
    max_leaves=12)


@given(header=st.dictionaries(st.sampled_from(["w", "v", "__metadata__"]), JSON_VALUES,
                              max_size=3),
       data=st.binary(max_size=16))
@settings(max_examples=200, deadline=None)
def test_any_json_header_is_read_or_refused_in_words(tmp_path_factory, header, data):
    path = write_file(tmp_path_factory.mktemp("h") / "any.safetensors",
                      json.dumps(header).encode(), data)
    try:
        tensors = read_safetensors(path)
    except ValueError as error:
        assert str(error).startswith(f"{path} is not a valid safetensors file"), error
    else:
        assert set(tensors) == set(header) - {"__metadata__"}


def test_odd_paths_and_flags_are_refused():
    for bad in (None, 3, ["a"], b"\0", "", "a\0b"):
        for read in (read_header, read_safetensors, gpt2.load):
            with pytest.raises(TypeError, match="a non-empty str or a pathlib.Path"):
                read(bad)
    with pytest.raises(TypeError, match="True or False"):
        read_safetensors("x.safetensors", memory_map="no")


# ------------------------------------------------------------------ GPT-2's folder


@pytest.fixture
def checkpoint(tmp_path):
    return gpt2.save(GPT, tmp_path / "gpt2")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_load_refuses_weights_that_are_not_finite(checkpoint, bad):
    path = checkpoint / "model.safetensors"
    tensors = {name: np.array(array) for name, array in read_safetensors(path).items()}
    tensors["h.1.mlp.c_fc.weight"][2, 3] = bad
    write_safetensors(path, tensors)
    with pytest.raises(ValueError, match=r"tensor 'h.1.mlp.c_fc.weight' holds 1 NaN or "
                                         r"infinite numbers"):
        gpt2.load(checkpoint)


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not a config.json, a JSON object in UTF-8 .*JSONDecodeError"),
    ("[1, 2, 3]", "is not a config.json, a JSON object in UTF-8: it holds a JSON list"),
    ('"gpt2"', "is not a config.json, a JSON object in UTF-8: it holds a JSON str"),
    ("", "is not a config.json, a JSON object in UTF-8"),
    (b"\xff\xfe", "is not a config.json, a JSON object in UTF-8 .*UnicodeDecodeError"),
])
def test_a_config_that_is_not_a_json_object_is_named(checkpoint, content, words):
    path = checkpoint / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=words) as caught:
        gpt2.load(checkpoint)
    assert str(path) in str(caught.value)


def test_config_values_of_the_wrong_kind_get_kvlibs_errors(checkpoint):
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    # named by the file's key, or by the ModelConfig field it becomes (n_embd: d_model)
    for key, value, name in (("n_embd", "4", "d_model"), ("n_layer", None, "n_layers"),
                             ("vocab_size", 2.5, "vocab_size"),
                             ("activation_function", ["gelu_new"], "activation_function"),
                             ("model_type", {"a": 1}, "model_type")):
        path.write_text(json.dumps(config | {key: value}))
        with pytest.raises((ValueError, TypeError), match=name):
            gpt2.load(checkpoint)


def test_load_refuses_a_dtype_it_cannot_compute_in(tmp_path):
    # (gpt2.save, a tool for tests, trusts its caller)
    with pytest.raises(ValueError, match="dtype must be one of"):
        gpt2.load(gpt2.save(GPT, tmp_path / "ok"), dtype=np.array(["a", "b"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]
