"""Checks at the door, the one home of kvlib's argument checks: bad input from a learner gets an
error that names the argument, says what was expected and echoes what came, before anything
changes, instead of a numpy traceback from deep inside.

Each check converts as it checks: ``as_count("n_new", n_new)`` returns a Python int,
``as_matrix("X", X, 4)`` the array, so that a public function checks its arguments in one
line. Only public functions check, and only what a learner passes them; the functions they
call trust them.

The inference loop goes further (kvlib.inference): its door checks the prompt, the cache and
the options once, then runs every block inside ``trusted()``, where the building blocks it
calls (kvlib.embed, kvlib.project_qkv, cache.append, ...) skip their own checks, so that a
decode step does not pay for them again in every layer. Called by a learner, outside the
loop, they check.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Set
from contextlib import contextmanager
from contextvars import ContextVar
from numbers import Integral, Real
from pathlib import Path

import numpy as np

LARGEST_COUNT = 2**31 - 1
"""More positions, blocks, heads or requests than anything here holds: a count above it is
refused before numpy is asked for an array of that size."""

_TRUSTED = ContextVar("kvlib_trusted", default=False)


@contextmanager
def trusted():
    """While the block runs, the building blocks' checks let their values through unchanged:
    the caller (the inference loop, after its own door) vouches for them."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_trusted() -> bool:
    """True inside trusted(): a building block may skip a check that is not one line."""
    return _TRUSTED.get()


# ------------------------------------------------------------------------------ numbers

def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_whole_number(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """value as a Python int if it is a whole number >= minimum (and <= maximum, when given;
    bool is not a whole number). Python's int keeps products of sizes exact where numpy's
    int32 would overflow."""
    if _TRUSTED.get():
        return value
    if _is_bool(value) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a whole number, got {_short(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}, got {value:,}")
    return int(value)


def as_sizes(minimum: int = 0, **sizes) -> tuple[int, ...]:
    """Several whole numbers >= minimum, named by their keywords, as Python ints in the order
    given: ``n_layers, seq_len = as_sizes(n_layers=n_layers, seq_len=seq_len)``."""
    return tuple(as_whole_number(name, value, minimum) for name, value in sizes.items())


def as_count(name: str, value, minimum: int = 0) -> int:
    """A size that numpy will allocate for: a whole number between minimum and LARGEST_COUNT."""
    return as_whole_number(name, value, minimum, LARGEST_COUNT)


def as_real_number(name: str, value, *, minimum: float | None = None,
                   positive: bool = False) -> float:
    """value as a finite float (>= minimum, or > 0 when positive); bool is not a number.
    TypeError for anything but a real number, ValueError for NaN, infinity, an int too large
    for a float, or a value out of range."""
    if _TRUSTED.get():
        return value
    if _is_bool(value) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {_short(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {_short(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return number


def as_flag(name: str, value) -> bool:
    """True or False (numpy's bool too); anything else, 1 and "no" included, is refused."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, got {_short(value)}")
    return bool(value)


def as_one_of(name: str, value, choices):
    """value if it is one of choices (strings: "float32", "rotary", ...)."""
    if _TRUSTED.get():
        return value
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {_short(value)}")
    return value


def as_divisor(name: str, value, total: int, of: str) -> int:
    """A whole number >= 1 that divides total (heads that split `of` evenly)."""
    if _TRUSTED.get():
        return value
    if _is_bool(value) or not isinstance(value, Integral) or not 1 <= value <= total \
            or total % value:
        raise ValueError(f"{name} must be a whole number that divides the {total} {of}, "
                         f"got {_short(value)}")
    return int(value)


# ------------------------------------------------------------------------------ arrays

def as_array(name: str, value, ndim: int | tuple[int, ...] | None = None,
             columns: int | None = None) -> np.ndarray:
    """value as an array of real numbers (float or int, not bool, complex, text or objects),
    with ndim dimensions (one of them, given a tuple) and `columns` numbers along its last
    axis, when given. A numpy array is returned as it is, not copied; a list is converted."""
    if _TRUSTED.get():
        return value
    if not isinstance(value, np.ndarray):
        if isinstance(value, (str, bytes, Mapping, Set)) or value is None:
            raise TypeError(f"{name} must be an array of numbers, got {_short(value)}")
        if contains_bool(value):
            raise TypeError(f"{name} must be numbers, not True or False: got {_short(value)}")
        try:
            value = np.asarray(value)
        except (ValueError, TypeError):
            raise ValueError(f"{name} must be an array of numbers with rows of one length, "
                             f"got {_short(value)}") from None
    if value.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers (float or int), got dtype "
                        f"{value.dtype}: {_short(value)}")
    wanted = (ndim,) if isinstance(ndim, int) else ndim
    if wanted is not None and value.ndim not in wanted:
        raise ValueError(f"{name} must be a {' or '.join(f'{n}-D' for n in wanted)} array, got "
                         f"shape {value.shape}")
    if columns is not None and (value.ndim == 0 or value.shape[-1] != columns):
        raise ValueError(f"{name} must have {columns} columns, got shape {value.shape}")
    return value


def as_matrix(name: str, value, columns: int | None = None) -> np.ndarray:
    """A 2-D array of real numbers (rows, columns): tokens by features, keys, weights."""
    return as_array(name, value, 2, columns)


def as_floats(name: str, value):
    """Real numbers as floats: one number as a Python float, an array as it is when it holds
    floats, whole numbers as float64 (whose cube does not overflow as an int8's does)."""
    if _TRUSTED.get():
        return value
    if isinstance(value, Real) and not _is_bool(value):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{name} is too large for a float: {value}") from None
    value = as_array(name, value)
    return value if value.dtype.kind == "f" else value.astype(np.float64)


def as_mask(mask, shape: tuple[int, ...]) -> np.ndarray:
    """A bool array of this shape (queries, positions), True where a query may look."""
    if _TRUSTED.get():
        return mask
    if not isinstance(mask, np.ndarray) or mask.dtype != bool or mask.shape != tuple(shape):
        raise ValueError(f"mask must be a bool array of shape {tuple(shape)} (True where a "
                         f"query may look), got {getattr(mask, 'dtype', type(mask).__name__)} "
                         f"{getattr(mask, 'shape', '')}")
    return mask


def as_rows(name: str, rows, width: int, n_rows: int | None = None) -> np.ndarray:
    """A chunk of new rows for a cache: (n, width) with n >= 1 (n_rows of them, when given)."""
    if _TRUSTED.get():
        return rows
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != width:
        raise ValueError(f"{name} must be a 2-D array (n_new, {width}), got "
                         f"{getattr(rows, 'shape', type(rows).__name__)}")
    if len(rows) != (n_rows or len(rows)) or len(rows) == 0:
        raise ValueError(f"{name} has no rows: append at least one position" if not len(rows)
                         else f"{name} must have {n_rows} rows, like the keys, got {len(rows)}")
    return as_array(name, rows)


def as_whole_numbers(name: str, values, minimum: int = 0, *, empty: bool = True) -> np.ndarray:
    """A flat sequence of whole numbers >= minimum (positions, lengths, token ids) as an int
    array (n,), none only when empty is True; one whole number is a sequence of one. Bools,
    floats, text and nested lists are refused."""
    if _TRUSTED.get():
        return values
    if isinstance(values, Integral) and not _is_bool(values):
        values = [values]
    if not isinstance(values, np.ndarray):
        if isinstance(values, (str, bytes, Mapping, Set)) or not hasattr(values, "__iter__"):
            raise TypeError(f"{name} must be a flat sequence of whole numbers, got "
                            f"{_short(values)}")
        items = list(values)
        for item in items:
            if _is_bool(item) or not isinstance(item, Integral) or abs(item) >= 2**63:
                raise TypeError(f"{name} must be whole numbers (a flat sequence of them, of 64 "
                                f"bits at most), got {_short(item)} in {_short(values)}")
        values = np.array(items, dtype=np.int64)
    if values.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of whole numbers, got shape "
                         f"{values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise TypeError(f"{name} must be whole numbers, got dtype {values.dtype}: "
                        f"{_short(values)}")
    if values.size and values.min() < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {values.min()}")
    if not (values.size or empty):
        raise ValueError(f"{name} must hold at least one whole number, got none")
    return values


def as_token_ids(ids, vocab_size: int, what: str = "prompt", limit: int | None = None, *,
                 empty: bool = False) -> np.ndarray:
    """Token ids as an int array (T,): one id or a flat sequence of ids in [0, vocab_size),
    at most limit of them (the context length) when given, none only when empty is True."""
    if _TRUSTED.get():
        return ids
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"the {what} must be token ids (integers), got the text {ids!r}: "
                        "encode it with a tokenizer first")
    name = f"the {what}" if what.endswith("token ids") else f"the {what}'s token ids"
    array = as_whole_numbers(name, ids, minimum=-2**63)
    if array.size == 0 and not empty:
        raise ValueError(f"the {what} is empty: give at least one token id (for example the "
                         "BOS id 0)")
    outside = (array < 0) | (array >= vocab_size)
    if array.size and outside.any():
        raise ValueError(f"token id(s) {sorted(set(array[outside].tolist()))} are outside the "
                         f"vocabulary: ids must be between 0 and {vocab_size - 1}")
    if limit is not None and len(array) > limit:
        raise ValueError(f"the {what} has {len(array)} tokens but the context length is {limit}")
    return array.astype(np.intp, copy=False)


def as_logits_row(logits_row) -> np.ndarray:
    """One row of logits (V,) as float64, finite (-inf allowed, not all of it)."""
    row = as_array("the logits", logits_row).astype(np.float64, copy=False)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected one row of logits (V,), got shape {row.shape}: for a "
                         "(T, V) array take its last row, logits[-1]")
    if np.isnan(row).any() or np.isposinf(row).any() or not np.isfinite(row.max()):
        raise ValueError("the logits must be finite numbers (NaN, +inf or all -inf give no "
                         "distribution to choose from)")
    return row


def as_sampling(logits_row, temperature, top_k) -> tuple[np.ndarray, float, int | None]:
    """What choosing a token takes: one row of logits (V,) as float64, a temperature >= 0
    (0 is greedy) and top_k, None or a whole number from 1 to V."""
    row = as_logits_row(logits_row)
    temperature = as_real_number("temperature", temperature, minimum=0)
    return row, temperature, top_k if top_k is None else as_whole_number("top_k", top_k, 1,
                                                                          len(row))


def as_path(path, what: str = "path") -> Path:
    """A file's or a folder's path: a non-empty str or a pathlib.Path."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str) or not name or "\0" in name:
        raise TypeError(f"{what} must be a path (a non-empty str or a pathlib.Path), got "
                        f"{_short(path)}")
    return Path(name)


# ------------------------------------------------------------------------------ kvlib's objects

def as_instance(name: str, value, kind, hint: str = "", called: str | None = None):
    """value if it is an instance of kind (a class, or a tuple of them, type(None) among them
    when None is allowed); called names the kind for a learner, hint where one comes from."""
    if _TRUSTED.get() or isinstance(value, kind):
        return value
    if called is None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        called = "a " + " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
    raise TypeError(f"{name} must be {called}{f' ({hint})' if hint else ''}, got "
                    f"{type(value).__name__}")


def as_list_or_none(record):
    """None, or a list to append to (record_attention: each layer's weights go there)."""
    if _TRUSTED.get() or record is None or isinstance(record, list):
        return record
    raise TypeError(f"record_attention must be a list (the weights of each layer are appended "
                    f"to it) or None, got {type(record).__name__}")


def as_rotary(rotary):
    """None, or a rotation: a kvlib.RotaryPositions, or anything with its rotate(X) method."""
    if _TRUSTED.get() or rotary is None or callable(getattr(rotary, "rotate", None)):
        return rotary
    raise TypeError(f"rotary must be a RotaryPositions (kvlib.rotary_positions), anything with "
                    f"its rotate(X) method, or None; got {type(rotary).__name__}")


def as_config(config, name: str = "config"):
    """A kvlib ModelConfig."""
    if _TRUSTED.get():
        return config
    from .config import ModelConfig  # config.py imports this module: imported when called
    return as_instance(name, config, ModelConfig, called="a kvlib ModelConfig")


def as_params(params):
    """kvlib Params (from kvlib.init_params or a loader)."""
    from .params import Params
    return as_instance("params", params, Params, "from kvlib.init_params or a loader",
                       called="kvlib Params")


def as_cache(cache, config, adding: int = 0):
    """A kvlib cache made for this config, its layers agreeing, with room for `adding` more
    positions: within its capacity, and within the table of learned positions."""
    from .cache import BaseKVCache
    as_instance("cache", cache, BaseKVCache, "kvlib.KVCache or another kind",
                called="a kvlib cache")
    if cache.config != config:
        raise ValueError(f"this cache was made for another model: {cache.config} is not the "
                         f"params' config {config}")
    cache.check_consistent()
    # a capacity is never past the context; a sliding window's cache has none, but learned
    # positions still end with their table
    limit = cache.capacity or (config.context_length if config.positions == "learned" else None)
    if limit is not None and len(cache) + adding > limit:
        raise ValueError(f"the cache is too full: it holds {len(cache)} positions and this "
                         f"adds {adding}, more than its {limit} (its capacity, or the context "
                         "length of a learned position table)")
    return cache


def as_rotatable(X, angles) -> np.ndarray:
    """X (T, n x 2 x a), floats, for angles (T, a): n heads of pairs a rotation turns."""
    if _TRUSTED.get():
        return X
    if not isinstance(X, np.ndarray) or X.ndim != 2 or X.dtype.kind != "f":
        raise TypeError(f"X must be a 2-D float array (tokens, heads x dim), got "
                        f"{getattr(X, 'dtype', type(X).__name__)} {getattr(X, 'shape', '')}: a "
                        "rotation of whole numbers is not whole")
    angles = as_array("angles", angles)
    if angles.ndim != 2 or angles.shape[0] != len(X) or angles.shape[1] == 0 \
            or X.shape[1] % (2 * angles.shape[1]):
        raise ValueError(f"angles {angles.shape} do not fit X {X.shape}: need one row per "
                         "token and a whole number of heads of 2 x angles.shape[1] columns")
    return X


def as_weights(where: str, arrays: dict, shapes: dict, config) -> dict:
    """Exactly the arrays a config needs (shapes: name -> shape), of its dtype; every other
    name None. where names the block ("layer 2 ")."""
    for name, array in arrays.items():
        expected = shapes.get(name)
        if expected is None and array is not None:
            raise ValueError(f"{where}{name} is given, but this config has no use for it "
                             f"(positions={config.positions!r}, norm={config.norm!r}, "
                             f"bias={config.bias}, mlp={config.mlp!r}, "
                             f"rope_head_dim={config.rope_head_dim})")
        if expected is not None and getattr(array, "shape", None) != expected:
            found = "is missing" if array is None else \
                f"has shape {getattr(array, 'shape', type(array).__name__)}"
            raise ValueError(f"{where}{name} {found}; the config expects {expected}")
        if expected is not None and array.dtype != config.numpy_dtype:
            raise TypeError(f"{where}{name} has dtype {array.dtype}; the config expects "
                            f"{config.dtype}")
    return arrays


# ------------------------------------------------------------------------------ checkpoints

def as_finite(array: np.ndarray, name: str, where: str) -> np.ndarray:
    """A weight read from a file, without NaN or infinity: the damage would otherwise show far
    later, as NaN logits, with nothing pointing back to the file."""
    if not np.isfinite(array).all():
        bad = np.size(array) - np.isfinite(array).sum()
        raise ValueError(f"{where}: tensor {name!r} holds {bad} NaN or infinite numbers; a "
                         "model's weights are finite (a damaged or wrongly converted file?)")
    return array


def as_known_tensors(where: str, tensors: dict, used: set, embedding: np.ndarray,
                     buffers: tuple[str, ...] = ()) -> dict:
    """A hub checkpoint's tensors: none that kvlib does not read but buffers (names ending so,
    not weights), and lm_head.weight, if there, equal to the token table: kvlib ties them."""
    for name in set(tensors) - used:
        tied = name == "lm_head.weight" and np.array_equal(
            np.asarray(tensors[name], dtype=embedding.dtype), embedding)
        if not (tied or name.endswith(buffers)):
            raise ValueError(f"{where} has a tensor kvlib does not read: {name!r} (an "
                             "lm_head.weight must equal the token table: kvlib ties them)")
    return tensors


# ------------------------------------------------------------------------------ helpers

def contains_bool(value) -> bool:
    """True when a list or tuple (nested or not) holds True or False somewhere: numpy reads
    [True, 2] as the numbers [1, 2] without a word."""
    if _is_bool(value):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype == bool
    if isinstance(value, (list, tuple)):
        return any(contains_bool(item) for item in value)
    return False


def _short(value, limit: int = 80) -> str:
    if isinstance(value, Integral) and not _is_bool(value) and abs(int(value)) >= 10**limit:
        return f"a whole number of about {int(math.log10(abs(int(value)))) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
