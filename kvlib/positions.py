"""Where a token sits (notebooks 12-14): learned absolute positions (GPT-2) and rotary
positions (RoPE: Su et al. 2021, used by Llama, Mistral, Qwen, DeepSeek).

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


def check_positions(positions, limit: int | None = None) -> np.ndarray:
    """Position ids as an int array (T,), each >= 0 and, given a limit, < limit."""
    array = np.asarray(positions)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"positions must be a flat sequence of whole numbers, got "
                         f"{array.tolist()!r}")
    if array.size and array.min() < 0:
        raise ValueError(f"positions must be >= 0, got {array.min()}")
    if limit is not None and array.size and array.max() >= limit:
        raise ValueError(f"position {array.max()} is past the context length {limit}: a "
                         f"learned position table has rows 0 .. {limit - 1} only")
    return array.astype(np.intp, copy=False)


def add_positions(X: np.ndarray, table: np.ndarray, positions) -> np.ndarray:
    """Learned positions (notebook 12, GPT-2's wpe): X (T, d) + table[positions] -> (T, d).

    table is (context_length, d); a position at or past context_length raises, because the
    model never learned a row for it.
    """
    positions = check_positions(positions, limit=table.shape[0])
    if X.shape != (len(positions), table.shape[1]):
        raise ValueError(f"X {X.shape} needs one position per row and {table.shape[1]} "
                         f"columns; got {len(positions)} positions")
    return X + table[positions]


def rotary_angles(positions, dim: int, base: float = 10000.0) -> np.ndarray:
    """The angle of every pair of columns at every position (notebook 14): (T, dim / 2).

    Pair i turns at the frequency base^(-2i / dim): pair 0 once per position (radian), the
    last pair slowest, so that near and far distances both leave a mark on the scores.
    """
    if dim % 2:
        raise ValueError(f"rotary positions turn pairs of columns: dim must be even, got {dim}")
    positions = check_positions(positions)
    frequencies = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return positions[:, None] * frequencies[None, :]


def rotate_pairs(X: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Turn each pair of columns (2i, 2i+1) of each head by its angle (notebook 14).

    X (T, n x dim) for n heads of dim columns, angles (T, dim / 2) -> (T, n x dim), the same
    dtype. Every head turns by the same angles: the position, not the head, sets them.
    The pairs are neighbouring columns, as in the RoPE paper; transformers' Llama pairs
    column i with column i + dim/2 instead, a fixed permutation of the same rotation.
    """
    T, width = X.shape
    half = angles.shape[1]
    if angles.shape[0] != T or width % (2 * half):
        raise ValueError(f"angles {angles.shape} do not fit X {X.shape}: need one row per "
                         "token and a whole number of heads of 2 x angles.shape[1] columns")
    pairs = X.reshape(T, width // (2 * half), half, 2)
    cos = np.cos(angles).astype(X.dtype)[:, None, :]
    sin = np.sin(angles).astype(X.dtype)[:, None, :]
    first, second = pairs[..., 0], pairs[..., 1]
    turned = np.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return turned.reshape(T, width)


@dataclass(frozen=True)
class RotaryPositions:
    """The rotation of one chunk of tokens (notebook 14): made once per pass, used by every
    layer on q and k. positions (T,), dim = the rotated columns per head."""

    positions: np.ndarray
    dim: int
    base: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "angles", rotary_angles(self.positions, self.dim, self.base))

    def rotate(self, X: np.ndarray) -> np.ndarray:
        """(T, n x dim) -> (T, n x dim): each head's pairs turned by its token's angles."""
        return rotate_pairs(X, self.angles)
