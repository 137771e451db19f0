"""Cached against recomputed, in lower precision (when_the_cache_is_wrong).

In exact arithmetic a cached run and a full recomputation give the same logits; in floating
point they do not quite, because they add the same numbers in another order: a decode step
multiplies one query row by the cached keys where the recomputation multiplies a block of
rows, and BLAS sums a row of one differently from a row of many. In float64 the difference
is about 1e-13, in float32 about 1e-5; in 16 bits it is as large as the format's own
rounding, and the greedy token sometimes flips. This module measures how often.

numpy has no bfloat16 and no fast float16 product, so 16-bit inference is emulated the way
GPU kernels do it: the numbers are stored in float32, the products and sums run in float32,
and every building block's result (kvlib.model's functions: the norm, q, k, v, the attention
weights and output, the projections, the MLP, each block's output, the logits) is rounded to
the format, as are the inputs of attention (q, k after the rotation, v) and the weights.
The sums inside a block (the residual additions) stay in float32 until the block's output
is rounded: a little kinder than real 16-bit kernels.

    round_to(x, number_format)             x with its values rounded to the format, same dtype
    in_format(params, number_format)       weights rounded (float64: widened)
    computed_in(number_format)             with: every building block rounded
    RoundingCache(config, number_format)   a cache that stores K and V rounded (the cache alone)
    teacher_forced(params, ids, prompt_length, cache) -> (cached, recomputed) logits (n, V)
    left_padded(params, ids, padding)      -> (padded, alone) logits (T, V)
    compare(a, b) -> Comparison            largest difference, flips of the greedy token
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from .cache import KVCache
from .checks import as_count, as_matrix, as_one_of, as_params, as_token_ids, as_whole_number
from .inference import decode_step, embed_tokens, final_logits, forward, prefill, run_blocks
from .model import attention_mask
from .params import Params
from .wrapping import wrapped

FORMATS = ("float64", "float32", "float16", "bfloat16")
"""The number formats compared: (sign, exponent, mantissa) bits 1-11-52, 1-8-23, 1-5-10,
1-8-7. float16 keeps more digits and overflows at 65504; bfloat16 keeps float32's range and
fewer digits (about 2.4 significant decimal digits against float16's 3.3)."""

ROUNDED = ("normalize", "project_qkv", "attention_weights", "weighted_sum",
           "output_projection", "mlp", "decoder_block", "unembed")
"""kvlib.model's functions whose results computed_in rounds."""

MEASURED = Path(__file__).parent / "models" / "precision.json"


def round_to(x, number_format: str) -> np.ndarray:
    """x (any shape, float32 or float64) with each value rounded to the nearest number of the
    format, to nearest even; same shape and dtype. float16 overflows to inf past 65504, as a
    real float16 would."""
    x = np.asarray(x)
    if number_format == "float64":
        return x
    if number_format == "bfloat16":
        return _round_to_bfloat16(x.astype(np.float32, copy=False)).astype(x.dtype, copy=False)
    with np.errstate(over="ignore"):
        return x.astype(number_format).astype(x.dtype)


def _round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest bfloat16 (the top 16 bits), ties to even: the
    rule of kvlib.checkpoints.safetensors.float32_to_bfloat16, done in place on 32 bits, which
    is several times faster on SmolLM2's 135 million weights. The carry of the rounding
    cannot overflow 32 bits except in NaNs, which are put back as they were."""
    bits = x.view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += bits
    rounded += 0x7FFF
    rounded &= 0xFFFF0000
    result = rounded.view(np.float32)
    nan = np.isnan(x)
    if nan.any():
        result[nan] = x[nan]
    return result


def _converted(obj, convert) -> dict:
    return {f.name: convert(getattr(obj, f.name)) for f in fields(obj)
            if isinstance(getattr(obj, f.name), np.ndarray)}


def _with_arrays(params: Params, convert, dtype: str) -> Params:
    """params with every array converted, under a config of that dtype."""
    layers = tuple(replace(layer, **_converted(layer, convert)) for layer in params.layers)
    return replace(params, config=params.config.replace(dtype=dtype), layers=layers,
                   **_converted(params, convert))


def in_format(params: Params, number_format: str) -> Params:
    """The weights in a format: float64 widens them (a config of dtype float64); float32 keeps
    them; float16 and bfloat16 round them, still stored as float32 (a copy)."""
    params, number_format = as_params(params), as_one_of("number_format", number_format, FORMATS)
    if number_format == "float64":
        return params if params.config.dtype == "float64" else \
            _with_arrays(params, lambda array: array.astype(np.float64), "float64")
    if params.config.dtype != "float32":
        params = _with_arrays(params, lambda array: array.astype(np.float32), "float32")
    if number_format == "float32":
        return params
    return _with_arrays(params, lambda array: round_to(array, number_format), "float32")


# ------------------------------------------------------------------------------ 16-bit runs

def _rounding(number_format: str):
    def wrap(name, original):
        def rounded(*args, **kwargs):
            if name == "attention_weights":          # q and k as attention reads them
                args = (round_to(args[0], number_format), round_to(args[1], number_format),
                        *args[2:])
            elif name == "weighted_sum":
                args = (args[0], round_to(args[1], number_format), *args[2:])
            result = original(*args, **kwargs)
            if isinstance(result, tuple):
                return tuple(round_to(part, number_format) for part in result)
            return round_to(result, number_format)
        return rounded
    return wrap


@contextlib.contextmanager
def computed_in(number_format: str):
    """While the block runs, every building block's result is rounded to the format (see the
    module's docstring); float32 and float64 change nothing (the params' dtype decides). Put
    back afterwards, even if the block raises."""
    if as_one_of("number_format", number_format, FORMATS) in ("float64", "float32"):
        yield
        return
    with wrapped(ROUNDED, _rounding(number_format)):
        yield


class RoundingCache(KVCache):
    """A KVCache that stores keys and values rounded to a format (the cache alone in 16 bits,
    the model in float32), as a float16 or bfloat16 cache buffer would. Reads return the
    rounded rows, the new one included, as a real 16-bit cache would."""

    def __init__(self, config, number_format: str, capacity: int | None = None):
        super().__init__(config, capacity)
        self.number_format = number_format

    def _describe(self) -> str:
        return super()._describe().replace("KVCache(", f"RoundingCache({self.number_format}, ", 1)

    def _store(self, layer: int, K: np.ndarray, V: np.ndarray):
        """K, V (n_new, kv_width), checked by append, rounded to the format, then stored."""
        return super()._store(layer, round_to(K, self.number_format),
                              round_to(V, self.number_format))


# ------------------------------------------------------------------------------ measuring

def teacher_forced(params: Params, ids, prompt_length: int, cache=None):
    """The logits that predict ids[prompt_length:], two ways -> (cached, recomputed), each
    (n, V) with n = len(ids) - prompt_length: cached prefills ids[:prompt_length] and feeds the
    rest one decode step at a time (into cache, a fresh KVCache when None); recomputed is one
    forward pass over ids[:-1]. Both see the same tokens (teacher forcing), so one flip cannot
    change the next step's input."""
    ids = as_token_ids(ids, as_params(params).config.vocab_size).tolist()
    prompt_length = as_whole_number("prompt_length", prompt_length, 1, len(ids) - 1)
    logits, cache = prefill(params, ids[:prompt_length], cache, last_only=True)
    rows = [logits[0]]
    for token in ids[prompt_length:-1]:
        rows.append(decode_step(params, token, cache)[0])
    return np.stack(rows), forward(params, ids[:-1])[prompt_length - 1:]


def left_padded(params: Params, ids, padding: int, pad_id: int = 0):
    """The logits of ids (T,) with `padding` pad tokens in front, hidden by the mask, the real
    tokens at positions 0 .. T-1
    (as a left-padded batch row is run, the batched_decoding lesson; a window counts positions, not
    columns), against the ids alone -> (padded, alone), each (T, V). Equal in exact arithmetic: the
    pads' weights are exactly 0; only the order of the sums changes."""
    ids = as_token_ids(ids, as_params(params).config.vocab_size)
    padding = as_count("padding", padding, 1)
    padded_ids = as_token_ids([pad_id] * padding + ids.tolist(), params.config.vocab_size,
                              "padded prompt", limit=params.config.context_length)
    real = np.arange(len(padded_ids)) >= padding                        # (P + T,)
    positions = np.maximum(np.cumsum(real) - 1, 0)          # pads at 0, the tokens from 0
    X = embed_tokens(params, padded_ids, positions)
    config = params.config
    # no query sees a pad; a pad's own row sees itself (its output is never read), as
    # kvlib.serving.batch.padded_prompt_mask does for a whole batch
    hidden_pads = np.tri(len(real), dtype=bool) & real[None, :] | np.diag(~real)
    mask = hidden_pads & attention_mask(positions, positions, config.window, config.sink_tokens)
    X = run_blocks(params, X, positions, mask)
    return final_logits(params, X)[padding:], forward(params, ids)


@dataclass(frozen=True)
class Comparison:
    """Logits a (n, V) against b (n, V): n positions; the largest and the mean absolute
    difference; flips: positions where the greedy tokens differ; flip_gap: at those, the
    largest gap in b between b's top token and a's (a flip happens only where b's top two
    were this close)."""

    positions: int
    largest_difference: float
    mean_difference: float
    flips: int
    flip_gap: float

    @property
    def flip_rate(self) -> float:
        return self.flips / self.positions

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def compare(a, b) -> Comparison:
    """Compare two sets of logits of one shape (n, V) (see Comparison)."""
    a = as_matrix("a", a).astype(np.float64)
    b = as_matrix("b", b).astype(np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"expected two (n, V) arrays of logits of one shape, got {a.shape} "
                         f"and {b.shape}")
    difference = np.abs(a - b)
    rows = np.arange(len(b))
    chosen_a, chosen_b = a.argmax(axis=1), b.argmax(axis=1)
    flipped = chosen_a != chosen_b
    gaps = b[rows, chosen_b] - b[rows, chosen_a]
    return Comparison(len(b), float(difference.max()), float(difference.mean()),
                      int(flipped.sum()), float(gaps[flipped].max(initial=0.0)))


def measured() -> dict:
    """What tools/measure_precision.py measured (when_the_cache_is_wrong), by model."""
    return json.loads(MEASURED.read_text())
