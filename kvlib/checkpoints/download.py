"""Getting GPT-2 124M's published weights (what_the_heads_read), where a network exists.

`download()` fetches openai-community/gpt2 from the Hugging Face model hub with
huggingface_hub (imported only here): config.json, model.safetensors (548 MB) and the
tokenizer's vocab.json and merges.txt, into a folder kvlib finds again later. Tests and CI
never call it: they run without a network, on checkpoints written by kvlib.gpt2.save and
tools/make_reference.py.

The folder is, in this order: the directory given; $KVLIB_GPT2_DIR; ~/.cache/kvlib/gpt2.

Without a network, download() says so at once, in one ConnectionError that starts with "no
network": it looks the hub up first (a connection with a 5 s timeout), where
huggingface_hub alone retries for about 24 s and ends in its LocalEntryNotFoundError.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..checks import as_path

REPOSITORY = "openai-community/gpt2"
FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
ENVIRONMENT_VARIABLE = "KVLIB_GPT2_DIR"
TIMEOUT = 5.0
"""Seconds check_network waits for the model hub to answer before it says "no network"."""
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


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


def _huggingface_hub():
    """huggingface_hub's constants, errors and hf_hub_download, imported only here."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:
        raise ImportError("downloading from the model hub needs the huggingface_hub package: "
                          "pip install huggingface_hub") from None
    return huggingface_hub


def no_network(what: str, why: str) -> ConnectionError:
    """The error that says "no network": why, and that what cannot be downloaded now."""
    return ConnectionError(f"no network: {why}. {what[0].upper() + what[1:]} cannot be "
                           "downloaded now: try again where a network exists.")


def check_network(what: str = "the model hub's files", timeout: float = TIMEOUT) -> None:
    """Raise ConnectionError("no network: ...") at once when the model hub cannot be reached:
    HF_HUB_OFFLINE set, or no connection to its host within timeout seconds. Behind a proxy
    ($HTTPS_PROXY, $ALL_PROXY) the host is not dialled directly; the download's own error
    then says it."""
    hub = _huggingface_hub()
    if hub.constants.HF_HUB_OFFLINE:
        raise no_network(what, "HF_HUB_OFFLINE is set (huggingface_hub may not use the network)")
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    address = urlparse(hub.constants.ENDPOINT)
    host = address.hostname
    port = address.port or (80 if address.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        raise no_network(what, f"the model hub ({host}) cannot be reached ({error})") from None


def hub_download(repository: str, names, folder: Path, what: str) -> Path:
    """Fetch names from a model hub repository into folder -> the folder: check_network
    first, and huggingface_hub's LocalEntryNotFoundError (the hub lost on the way) said as
    "no network" too, naming the file."""
    hub = _huggingface_hub()
    check_network(what)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            hub.hf_hub_download(repository, name, local_dir=folder)
        except hub.errors.LocalEntryNotFoundError:
            raise no_network(what, f"the model hub stopped answering while {name} of "
                                   f"{repository} was being fetched") from None
    return folder


def download(directory=None) -> Path:
    """Fetch GPT-2 124M (about 550 MB, with a progress bar) into directory, or the default
    folder; files already there are not fetched again. Returns the folder.

    Needs a network and the huggingface_hub package (`pip install huggingface_hub`). Without
    a network it stops at once with a ConnectionError that says "no network" (check_network).
    """
    directory = _directory(directory)
    return hub_download(REPOSITORY, FILES, directory, "GPT-2 124M's weights")
