"""What transformers recorded for the checkpoint tests (tools/make_reference.py,
make_llama_reference.py and make_gemma3_reference.py wrote tests/data/*-reference/), read
the same way by each. Not a test module (pytest collects test_*.py only).

    recorded, wide, narrow = reference_fixtures(REFERENCE, gpt2.load)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of a .npz file, read into memory."""
    with np.load(path) as data:
        return dict(data)


def memory_mapped(array: np.ndarray) -> bool:
    """True for an array that reads the checkpoint's file in place: a np.memmap, or a view
    (a slice, a transpose) of one."""
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = array.base
    return False


def prompts(recorded: dict) -> list[np.ndarray]:
    """The recorded prompts, prompt_0, prompt_1, ... in order."""
    return [recorded[f"prompt_{index}"] for index in range(len(
        [name for name in recorded if name.startswith("prompt_")]))]


def reference_fixtures(directory: Path, load):
    """Module fixtures of a reference folder: `recorded`, its reference.npz; `wide` and
    `narrow`, its checkpoint loaded in float64 and in float32."""

    @pytest.fixture(scope="module")
    def recorded():
        return arrays(directory / "reference.npz")

    @pytest.fixture(scope="module")
    def wide():
        return load(directory, dtype="float64")

    @pytest.fixture(scope="module")
    def narrow():
        return load(directory, dtype="float32")

    return recorded, wide, narrow
