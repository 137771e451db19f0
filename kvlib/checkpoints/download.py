"""Getting GPT-2 124M's published weights (what_the_heads_read), where a network exists.

`download()` fetches openai-community/gpt2 from the Hugging Face model hub with
huggingface_hub (imported only here): config.json, model.safetensors (548 MB) and the
tokenizer's vocab.json and merges.txt, into a folder kvlib finds again later. Tests and CI
never call it: they run without a network, on checkpoints written by kvlib.gpt2.save and
tools/make_reference.py.

The folder is, in this order: the directory given; $KVLIB_GPT2_DIR; ~/.cache/kvlib/gpt2.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checks import as_path

REPOSITORY = "openai-community/gpt2"
FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
ENVIRONMENT_VARIABLE = "KVLIB_GPT2_DIR"


def _directory(directory) -> Path:
    """The folder given, or the default one for None."""
    return default_directory() if directory is None else as_path(directory, "directory")


def default_directory() -> Path:
    """Where GPT-2's weights are kept: $KVLIB_GPT2_DIR, or ~/.cache/kvlib/gpt2."""
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    return Path(configured).expanduser() if configured else \
        Path.home() / ".cache" / "kvlib" / "gpt2"


def find_weights(directory=None) -> Path | None:
    """The folder holding GPT-2 124M's config.json and model.safetensors, or None when they
    have not been downloaded (what_the_heads_read then says how to get them)."""
    directory = _directory(directory)
    complete = all((directory / name).is_file() for name in ("config.json", "model.safetensors"))
    return directory if complete else None


def download(directory=None) -> Path:
    """Fetch GPT-2 124M (about 550 MB, with a progress bar) into directory, or the default
    folder; files already there are not fetched again. Returns the folder.

    Needs a network and the huggingface_hub package (`pip install huggingface_hub`).
    """
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError("downloading GPT-2 needs the huggingface_hub package: "
                          "pip install huggingface_hub") from None
    directory = _directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        hf_hub_download(REPOSITORY, name, local_dir=directory)
    return directory
