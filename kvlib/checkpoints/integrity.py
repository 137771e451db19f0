"""Checking that a model's files are the ones kvlib fetched or wrote (the fuzz: a flipped byte,
a weight of 1e30, a changed metadata.json or a truncated merges.txt loaded silently).

- A fetched GGUF file is checked against the sha256 kvlib knows (kvlib.checkpoints.smollm2,
  .gemma3) before it is converted, not only when it is downloaded.
- A converted folder (<name>.float32/, kvlib.checkpoints.gguf) gets a manifest.json when it is
  written: the bytes and the sha256 of every file in it, and the GGUF file's sha256. A folder
  is verified against it before it loads; a file that differs is named, with what to do.

What verifying costs, and why a file is not hashed at every load. sha256 read 0.75-1.4 GB/s
on the 2-core machine this was measured on (its CPU has SHA instructions; a CPU without them
does about a third of that): SmolLM2's 538 MB of weights took 0.36-0.76 s, Gemma 3's 1.07 GB
0.71-1.4 s, against 0.06-0.1 s and 0.15-0.4 s for the memory-mapped load itself. Hashing at
every load would make each load 5-10 times slower (2-3 s for Gemma 3 on a CPU without SHA
instructions), and every lesson's kernel, `make test` and `make lab` load them.

So a file is hashed when kvlib first meets it, and then only when it may have changed, as
git's index decides which files to hash again: kvlib records the file's size, modification
and change times, inode and device once it has found its sha256 right (in verified.json
beside the manifest, which every later process reads, and in memory for the process). A
file whose stat is unchanged is the file that was hashed: any write to it, through any
program, sets both times, and the change time (ctime) cannot be set back by a program (only
by moving the system clock). With git's guard for "racily clean" files: a file modified
less than RACY_SECONDS before it was hashed is not recorded (a file system's clock ticks in
steps of milliseconds, and a write in the same tick would leave the times as they were);
the next load hashes it again. What this cannot see is a file changed on the disk without a
write (bit rot) after it was recorded; delete verified.json to have every file hashed
again. A folder kvlib cannot write to is hashed once a process. verified.json is not in the
manifest: a damaged one only means the files are hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
RECORD_NAME = "verified.json"
"""Beside the manifest: the stat of each file found right, so that later loads need not hash
it (see the module's docstring)."""
RACY_SECONDS = 2.0
"""A file modified less than this before it was hashed is not recorded; the next check hashes
it again (git's racily clean entries)."""


class DamagedFileError(ValueError):
    """A model file that is not the one kvlib fetched or wrote: its sha256 or its size
    differs from what kvlib recorded, or it cannot be read as what it should be."""


def sha256_of(path) -> str:
    """The sha256 of a file, read 1 MiB at a time, as 64 hexadecimal digits."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _settled(identity: list[int]) -> bool:
    """True when the file's last change is more than RACY_SECONDS old."""
    return time.time_ns() - max(identity[1], identity[2]) > RACY_SECONDS * 1e9


_hashed: dict[str, tuple[list[int], str]] = {}
"""resolved path -> (its stat when it was hashed, its sha256): this process's record."""


def forget_hashes() -> None:
    """Forget what this process has hashed (verified.json files are not touched)."""
    _hashed.clear()


def write_manifest(folder, names, source: dict) -> Path:
    """Write <folder>/manifest.json: the bytes and sha256 of each of names (files in folder),
    and source (what the folder was made from: the GGUF file's name, bytes and sha256)."""
    folder = Path(folder)
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)}
             for name in sorted(names)}
    manifest = {"kvlib_manifest": MANIFEST_FORMAT, "algorithm": "sha256", "source": source,
                "files": files}
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return path


def _parse_manifest(path: Path, raw: bytes, remedy: str) -> dict:
    try:
        manifest = json.loads(raw.decode("utf-8"))
        files = manifest["files"]
        if manifest.get("kvlib_manifest") != MANIFEST_FORMAT or not isinstance(files, dict) \
                or not files or not all(
                    isinstance(name, str) and name and "/" not in name and "\\" not in name
                    and name not in (".", "..", MANIFEST_NAME, RECORD_NAME)
                    and isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                    and isinstance(entry.get("sha256"), str) for name, entry in files.items()):
            raise ValueError("not the layout kvlib writes")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DamagedFileError(f"{path} is damaged ({error}). {remedy}".strip()) from None
    return manifest


def read_manifest(folder, remedy: str = "") -> dict:
    """The manifest of a converted folder; DamagedFileError when it is missing or unreadable."""
    return _read_manifest(Path(folder), remedy)[0]


def _read_manifest(folder: Path, remedy: str) -> tuple[dict, str]:
    """(the manifest, the sha256 of its bytes)."""
    path = folder / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except OSError:
        raise DamagedFileError(
            f"{folder} has no {MANIFEST_NAME}, the checksums kvlib writes when it converts a "
            f"GGUF file: it was converted by an earlier kvlib, or the folder was changed. "
            f"{remedy}".strip()) from None
    return _parse_manifest(path, raw, remedy), hashlib.sha256(raw).hexdigest()


def _read_record(folder: Path, manifest_sha256: str) -> dict:
    """verified.json's files if it belongs to this manifest, else nothing."""
    try:
        record = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
        if record.get("manifest_sha256") == manifest_sha256 and isinstance(record["files"],
                                                                           dict):
            return record["files"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _write_record(folder: Path, manifest_sha256: str, files: dict) -> None:
    """Write verified.json, replacing the old one at once; a folder kvlib cannot write to
    keeps none (its files are then hashed once a process)."""
    partial = folder / f".{RECORD_NAME}.{os.getpid()}"
    try:
        partial.write_text(json.dumps({"manifest_sha256": manifest_sha256, "files": files}),
                           encoding="utf-8")
        os.replace(partial, folder / RECORD_NAME)
    except OSError:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass


def verify_folder(folder, remedy: str = "", *, hashes: bool = True) -> dict:
    """Check every file that folder's manifest lists: there, of its recorded size (all of them
    first, which costs nothing), then (unless hashes is False) of its recorded sha256,
    smallest first -> the manifest. A file is hashed only when neither verified.json nor
    this process has a record of it as it is (see the module's docstring). DamagedFileError
    names the first file that differs and ends with remedy (what to do)."""
    folder = Path(folder)
    manifest, manifest_sha256 = _read_manifest(folder, remedy)
    entries = manifest["files"]
    for name, entry in entries.items():
        if not (folder / name).is_file():
            raise DamagedFileError(f"{folder / name} is missing: {MANIFEST_NAME} lists it. "
                                   f"{remedy}".strip())
        size = (folder / name).stat().st_size
        if size != entry["bytes"]:
            raise DamagedFileError(
                f"{folder / name} is damaged: it has {size:,} bytes, not the "
                f"{entry['bytes']:,} recorded in {MANIFEST_NAME} when it was written (cut "
                f"short or changed). {remedy}".strip())
    if not hashes:
        return manifest
    recorded = _read_record(folder, manifest_sha256)
    settled = {}
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["bytes"]):
        file = folder / name
        key = str(file.resolve())
        before = _identity(file)
        if recorded.get(name) == before or _hashed.get(key) == (before, entry["sha256"]):
            settled[name] = before
            continue
        found = sha256_of(file)
        after = _identity(file)
        if after == before and _settled(after):
            _hashed[key] = (after, found)
            if found == entry["sha256"]:
                settled[name] = after
        if found != entry["sha256"]:
            raise DamagedFileError(
                f"{file} is damaged: its sha256 is {found[:16]}..., not the "
                f"{entry['sha256'][:16]}... recorded in {MANIFEST_NAME} when it was written "
                f"(changed since). {remedy}".strip())
    if settled != recorded:
        _write_record(folder, manifest_sha256, settled)
    return manifest


def passes(check, folder) -> bool:
    """True when check(folder), a folder check that raises DamagedFileError, finds nothing
    wrong."""
    try:
        check(folder)
    except DamagedFileError:
        return False
    return True


def is_complete(folder) -> bool:
    """True when folder has a manifest and every file it lists, of the recorded size (no file
    is read; verify_folder hashes them)."""
    return passes(lambda checked: verify_folder(checked, hashes=False), folder)


__all__ = ["DamagedFileError", "MANIFEST_NAME", "RACY_SECONDS", "RECORD_NAME", "forget_hashes",
           "is_complete", "passes", "read_manifest", "sha256_of", "verify_folder", "write_manifest"]
