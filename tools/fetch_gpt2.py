"""Download GPT-2 124M's published weights for notebook 13 (`make gpt2`; binder/postBuild).

    python tools/fetch_gpt2.py            # into $KVLIB_GPT2_DIR, else ~/.cache/kvlib/gpt2
    python tools/fetch_gpt2.py DIR        # into DIR (then set KVLIB_GPT2_DIR=DIR)

kvlib.gpt2.download() does the work (openai-community/gpt2 from the Hugging Face model hub:
config.json, model.safetensors (548 MB), vocab.json, merges.txt; files already there are not
fetched again). This script adds what a build needs: without a network it stops at once
with one line, never a traceback or minutes of retries (the hub is looked up with a 5 s
timeout first, and huggingface_hub's own timeouts are shortened), and it exits non-zero
then, so that binder/postBuild can go on without the weights.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# before huggingface_hub is imported, which reads them once
os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "30")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import kvlib.gpt2  # noqa: E402


def hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname


LATER = "notebook 13 says how to download it later"


def fetch(directory=None) -> Path:
    """Download into directory (or kvlib's default folder) and check that kvlib loads it.
    Raises SystemExit with one line when the hub cannot be reached or the download fails."""
    try:
        host = hub_host()
    except ImportError:
        raise SystemExit("GPT-2 124M not downloaded: the huggingface_hub package is missing "
                         f"(pip install huggingface_hub); {LATER}") from None
    try:   # one quick look first: no network gives a one-line answer, at once
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        raise SystemExit(f"GPT-2 124M not downloaded: the model hub ({host}) cannot be "
                         f"reached ({error}); {LATER}") from None
    try:
        directory = kvlib.gpt2.download(directory)
        kvlib.gpt2.load(directory)   # memory-mapped: checks every tensor, reads almost nothing
    except Exception as error:  # a network error of any kind, a full disk, a broken file
        raise SystemExit(f"GPT-2 124M not downloaded: {type(error).__name__}: "
                         f"{error}; {LATER}") from None
    return directory


def main(argv: list[str]) -> None:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        raise SystemExit(__doc__)
    started = time.monotonic()
    directory = fetch(argv[0] if argv else None)
    print(f"GPT-2 124M is in {directory} ({time.monotonic() - started:.0f} s); "
          "kvlib.gpt2.find_weights() finds it there"
          + ("" if directory == kvlib.gpt2.default_directory() else
             f" when KVLIB_GPT2_DIR={directory} is set"))


if __name__ == "__main__":
    main(sys.argv[1:])
