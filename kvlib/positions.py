"""Where a token sits (real_model and positions_and_rope): learned absolute positions (GPT-2) and
rotary positions (RoPE: Su et al. 2021, used by Llama, Mistral, Qwen, DeepSeek).

Attention by itself does not know the order of its keys: permute the cached rows and every
weight follows them. A position scheme gives each token its place:

- learned positions add a row of a trained table to the token's embedding, once, before the
  first block. The table has context_length rows; there is no row for a position past it.
- rotary positions turn each pair of columns of q and k by an angle proportional to the
  position, in every layer, after the projections. The score of q (at m) and k (at n) then
  depends on m - n only. K is cached after its rotation: a cached key never needs its
  position again.

A decode step's token sits at position len(cache); a chunk after P cached tokens at P .. P+T-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import (
    as_config,
    as_matrix,
    as_one_of,
    as_real_number,
    as_rotatable,
    as_whole_number,
    as_whole_numbers,
    is_trusted,
)

LARGEST_ROTARY_DIM = 2**16
"""More rotated columns a head than any model has (real heads have 64 to 256)."""


def add_positions(X: np.ndarray, table: np.ndarray, positions) -> np.ndarray:
    """Learned positions (real_model, GPT-2's wpe): X (T, d) + table[positions] -> (T, d).

    table is (context_length, d); a position at or past context_length raises, because the
    model never learned a row for it.
    """
    table = as_matrix("table", table)
    X, positions = as_matrix("X", X, table.shape[1]), as_whole_numbers("positions", positions)
    if not is_trusted() and len(positions) != len(X):
        raise ValueError(f"X has {len(X)} rows and {len(positions)} positions: give one "
                         "position per row")
    if not is_trusted() and positions.max(initial=0) >= len(table):
        raise ValueError(f"position {positions.max()} is past the context length {len(table)}: "
                         f"a learned position table has rows 0 .. {len(table) - 1} only")
    return X + table[positions]


def rotary_angles(positions, dim: int, base: float = 10000.0) -> np.ndarray:
    """The angle of every pair of columns at every position (positions_and_rope): (T, dim / 2).

    Pair i turns at the frequency base^(-2i / dim): pair 0 once per position (radian), the
    last pair slowest, so that near and far distances both leave a mark on the scores.
    """
    dim = as_whole_number("dim", dim, 2, LARGEST_ROTARY_DIM)
    if dim % 2:
        raise ValueError(f"rotary positions turn pairs of columns: dim must be even, got {dim}")
    base = as_real_number("base", base, positive=True)
    positions = as_whole_numbers("positions", positions)
    frequencies = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return positions[:, None] * frequencies[None, :]


def rotate_pairs(X: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Turn each pair of neighbouring columns (2i, 2i+1) of each head by its angle (notebook
    14): the "interleaved" pairing of RoPE's paper, GPT-J and llama.cpp (model_of_today).

    X (T, n x dim) for n heads of dim columns, angles (T, dim / 2) -> (T, n x dim), the same
    dtype. Every head turns by the same angles: the position, not the head, sets them.
    transformers' Llama pairs column i with column i + dim/2 instead (rotate_halves), a fixed
    permutation of the same rotation.
    """
    X = as_rotatable(X, angles)
    return _turn_pairs(X, np.cos(angles).astype(X.dtype), np.sin(angles).astype(X.dtype))


def _turn_pairs(X: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_pairs with cos and sin of the angles given, (T, dim / 2) each in X's dtype."""
    T, half = cos.shape
    pairs = X.reshape(T, -1, half, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    turned = np.empty_like(pairs)
    np.subtract(first * cos, second * sin, out=turned[..., 0])
    np.add(first * sin, second * cos, out=turned[..., 1])
    return turned.reshape(X.shape)


def rotate_halves(X: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Turn column i of each head with column i + dim/2 by angle i (model_of_today): the "half"
    pairing of transformers' rotate_half and of the hub's Llama checkpoints.

    Shapes as rotate_pairs. It equals rotate_pairs on the columns reordered as 0, dim/2, 1,
    dim/2 + 1, ...: llama.cpp's converter reorders the rows of Wq and Wk that way, so that a
    GGUF file is right with rotate_pairs while the same model's safetensors are right with
    this.
    """
    X = as_rotatable(X, angles)
    return _turn_halves(X, np.cos(angles).astype(X.dtype), np.sin(angles).astype(X.dtype))


def _turn_halves(X: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_halves with cos and sin of the angles given, (T, dim / 2) each in X's dtype."""
    T, half = cos.shape
    parts = X.reshape(T, -1, 2, half)
    first, second = parts[:, :, 0], parts[:, :, 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    turned = np.empty_like(parts)
    np.subtract(first * cos, second * sin, out=turned[:, :, 0])
    np.add(first * sin, second * cos, out=turned[:, :, 1])
    return turned.reshape(X.shape)


ROTATIONS = {"interleaved": rotate_pairs, "half": rotate_halves}
"""The rotation of each pairing (kvlib.ModelConfig.rope_pairing)."""
_TURNS = {"interleaved": _turn_pairs, "half": _turn_halves}


@dataclass(frozen=True)
class RotaryPositions:
    """The rotation of one chunk of tokens (positions_and_rope): made once per pass, used by every
    layer on q and k. positions (T,), dim = the rotated columns per head, pairing =
    "interleaved" (rotate_pairs) or "half" (rotate_halves, the model_of_today lesson)."""

    positions: np.ndarray
    dim: int
    base: float = 10000.0
    pairing: str = "interleaved"

    def __post_init__(self):
        as_one_of("pairing", self.pairing, ROTATIONS)
        object.__setattr__(self, "angles", rotary_angles(self.positions, self.dim, self.base))
        # every layer turns q and k by the same angles: their cos and sin once per pass
        object.__setattr__(self, "_cos_sin", {})

    def rotate(self, X: np.ndarray) -> np.ndarray:
        """(T, n x dim) -> (T, n x dim): each head's pairs turned by its token's angles."""
        X = as_rotatable(X, self.angles)
        if X.dtype not in self._cos_sin:
            self._cos_sin[X.dtype] = (np.cos(self.angles).astype(X.dtype),
                                      np.sin(self.angles).astype(X.dtype))
        return _TURNS[self.pairing](X, *self._cos_sin[X.dtype])


def rotary_positions(config, positions) -> RotaryPositions | None:
    """The rotation a model applies at these positions (positions_and_rope and model_of_today), or
    None when it has no rotary positions: the head size (the decoupled rotary part's with latent
    attention), the config's base and its pairing."""
    if as_config(config).positions != "rotary":
        return None
    dim = config.rope_head_dim if config.latent_dim is not None else config.head_dim
    return RotaryPositions(positions, dim, config.rope_base, config.rope_pairing)
