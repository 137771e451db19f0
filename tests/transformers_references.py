"""What transformers recorded for the checkpoint tests (tools/make_reference.py,
make_llama_reference.py and make_gemma3_reference.py wrote tests/data/*-reference/), read
the same way by each. Not a test module (pytest collects test_*.py only).

    recorded, wide, narrow = reference_fixtures(REFERENCE, gpt2.load)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvlib


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


def assert_float32_logits_close(narrow, recorded: dict, tolerance: float) -> None:
    """The float32 model's logits of every recorded prompt are float32 and within tolerance of
    transformers' (logits_float32_<i>), relative to their largest."""
    for i, prompt in enumerate(prompts(recorded)):
        logits, expected = kvlib.forward(narrow, prompt), recorded[f"logits_float32_{i}"]
        assert logits.dtype == np.float32
        assert np.abs(logits - expected).max() / np.abs(expected).max() < tolerance


def assert_cache_holds_the_recorded(wide, recorded: dict, atol: float) -> None:
    """A prefill of the recorded cache_prompt caches, in every layer, the keys and values
    transformers cached (keys_<layer> and values_<layer>, (K/V heads, T, dh)), within atol."""
    _, cache = kvlib.prefill(wide, recorded["cache_prompt"])
    for layer in range(wide.config.n_layers):
        n_heads = recorded[f"keys_{layer}"].shape[0]
        for name, rows in (("keys", cache.keys(layer)), ("values", cache.values(layer))):
            np.testing.assert_allclose(kvlib.split_heads(rows, n_heads),
                                       recorded[f"{name}_{layer}"], rtol=0, atol=atol)


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
