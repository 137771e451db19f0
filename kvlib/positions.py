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

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from .checks import contains_bool, count, numbers
from .config import ModelConfig

LARGEST_ROTARY_DIM = 2**16
"""More rotated columns a head than any model has (real heads have 64 to 256)."""


def check_positions(positions, limit: int | None = None) -> np.ndarray:
    """Position ids as an int array (T,), each >= 0 and, given a limit, < limit."""
    if isinstance(positions, (str, bytes)) or contains_bool(positions):
        raise ValueError(f"positions must be a flat sequence of whole numbers, got {positions!r}")
    try:
        array = np.asarray(positions)
    except (ValueError, TypeError):
        raise ValueError(f"positions must be a flat sequence of whole numbers, got "
                         f"{positions!r}") from None
    if limit is not None:
        limit = count("limit", limit)
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
    """Learned positions (real_model, GPT-2's wpe): X (T, d) + table[positions] -> (T, d).

    table is (context_length, d); a position at or past context_length raises, because the
    model never learned a row for it.
    """
    table, X = numbers("table", table, 2), numbers("X", X, 2)
    positions = check_positions(positions, limit=table.shape[0])
    if X.shape != (len(positions), table.shape[1]):
        raise ValueError(f"X {X.shape} needs one position per row and {table.shape[1]} "
                         f"columns; got {len(positions)} positions")
    return X + table[positions]


def _check_rotary_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, Integral):
        raise TypeError(f"dim must be a whole number (the rotated columns of a head), got "
                        f"{dim!r}")
    if dim < 2 or dim % 2 or dim > LARGEST_ROTARY_DIM:
        raise ValueError(f"rotary positions turn pairs of columns: dim must be an even whole "
                         f"number between 2 and {LARGEST_ROTARY_DIM:,}, got {dim}")
    return int(dim)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:            # an int too large for a float
        return False


def _check_base(base) -> float:
    if isinstance(base, bool) or not isinstance(base, Real) or not _finite(base) \
            or base <= 0:
        raise ValueError(f"the rotary base must be a positive finite number (10000 in RoPE's "
                         f"paper, 100000 in SmolLM2), got {base!r}")
    return float(base)


def rotary_angles(positions, dim: int, base: float = 10000.0) -> np.ndarray:
    """The angle of every pair of columns at every position (positions_and_rope): (T, dim / 2).

    Pair i turns at the frequency base^(-2i / dim): pair 0 once per position (radian), the
    last pair slowest, so that near and far distances both leave a mark on the scores.
    """
    dim, base = _check_rotary_dim(dim), _check_base(base)
    positions = check_positions(positions)
    frequencies = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return positions[:, None] * frequencies[None, :]


def _check_rotated(X, angles) -> tuple[int, int]:
    """(T, heads) for X (T, heads x 2 x angles.shape[1]); a clear error otherwise."""
    if not isinstance(X, np.ndarray) or X.ndim != 2 or not np.issubdtype(X.dtype, np.floating):
        raise TypeError(f"X must be a 2-D float array (tokens, heads x dim), got "
                        f"{getattr(X, 'dtype', type(X).__name__)} "
                        f"{getattr(X, 'shape', '')}: a rotation of whole numbers is not whole")
    T, width = X.shape
    angles = numbers("angles", angles)
    if angles.ndim != 2 or angles.shape[0] != T or angles.shape[1] == 0 \
            or width % (2 * angles.shape[1]):
        raise ValueError(f"angles {angles.shape} do not fit X {X.shape}: need one row per "
                         "token and a whole number of heads of 2 x angles.shape[1] columns")
    return T, width // (2 * angles.shape[1])


def rotate_pairs(X: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Turn each pair of neighbouring columns (2i, 2i+1) of each head by its angle (notebook
    14): the "interleaved" pairing of RoPE's paper, GPT-J and llama.cpp (model_of_today).

    X (T, n x dim) for n heads of dim columns, angles (T, dim / 2) -> (T, n x dim), the same
    dtype. Every head turns by the same angles: the position, not the head, sets them.
    transformers' Llama pairs column i with column i + dim/2 instead (rotate_halves), a fixed
    permutation of the same rotation.
    """
    _check_rotated(X, angles)
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
    _check_rotated(X, angles)
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
        if not isinstance(self.pairing, str) or self.pairing not in ROTATIONS:
            raise ValueError(f"pairing must be one of {tuple(ROTATIONS)}, got {self.pairing!r}")
        object.__setattr__(self, "angles", rotary_angles(self.positions, self.dim, self.base))
        # every layer turns q and k by the same angles: their cos and sin once per pass
        object.__setattr__(self, "_cos_sin", {})

    def rotate(self, X: np.ndarray) -> np.ndarray:
        """(T, n x dim) -> (T, n x dim): each head's pairs turned by its token's angles."""
        angles = self.angles
        if not isinstance(X, np.ndarray) or X.ndim != 2 or X.dtype.kind != "f" or \
                X.shape[0] != angles.shape[0] or X.shape[1] % (2 * angles.shape[1]):
            _check_rotated(X, angles)           # says what is wrong; the angles were checked
        if X.dtype not in self._cos_sin:
            self._cos_sin[X.dtype] = (np.cos(self.angles).astype(X.dtype),
                                      np.sin(self.angles).astype(X.dtype))
        return _TURNS[self.pairing](X, *self._cos_sin[X.dtype])


def rotary_positions(config, positions) -> RotaryPositions | None:
    """The rotation a model applies at these positions (positions_and_rope and model_of_today), or
    None when it has no rotary positions: the head size (the decoupled rotary part's with latent
    attention), the config's base and its pairing."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a kvlib ModelConfig, got {type(config).__name__}")
    if config.positions != "rotary":
        return None
    dim = config.rope_head_dim if config.latent_dim is not None else config.head_dim
    return RotaryPositions(positions, dim, config.rope_base, config.rope_pairing)
