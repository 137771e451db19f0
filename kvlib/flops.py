"""Counting the work (counting_the_work): multiply-adds of each part of the model, by formula and
by counting the matrix products that really run.

One multiply-add (MAC) is one multiplication and one addition, 2 FLOPs. For a chunk of T
new tokens attending over S positions, each layer does:

    projections       4 T d^2   (Q, K, V and the output projection)
    attention scores  T S d     (every head: T x dh times dh x S)
    attention sums    T S d     (every head: T x S times S x dh)
    MLP               2 T d f   (up and down)

and the unembedding does R d V for the R rows it turns into logits. Without a cache, S = T
grows with every new token and the attention terms grow with its square; with a cache T = 1.

The variants of part 2 change the terms: fewer K/V heads (grouped_query_attention) shrink the K and
V projections to 2 T d kv_width but leave the attention terms (the queries are unchanged);
latent attention (latent_attention) has its own projections and scores against the latents; a
sliding window (sliding_windows_and_sinks) caps S at the positions the cache holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields

import numpy as np

from .checks import as_config, as_count, as_flag, as_params, as_whole_number
from .config import ModelConfig
from .params import Params

MAX_PASSES = 2**20
"""The most passes generation_step_multiply_adds lists one by one (a generation of a million
tokens); more is a slip, and would take minutes to list."""


@dataclass(frozen=True)
class MultiplyAdds:
    """Multiply-adds split by part of the model."""

    projections: int = 0
    attention_scores: int = 0
    attention_sums: int = 0
    mlp: int = 0
    unembedding: int = 0

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    @property
    def flops(self) -> int:
        """2 FLOPs per multiply-add."""
        return 2 * self.total

    def as_dict(self) -> dict[str, int]:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def __add__(self, other: MultiplyAdds) -> MultiplyAdds:
        return MultiplyAdds(**{name: value + getattr(other, name)
                               for name, value in self.as_dict().items()})


def chunk_multiply_adds(config: ModelConfig, new_tokens: int, attended_positions: int,
                        unembedded_rows: int) -> MultiplyAdds:
    """Work of one pass over new_tokens queries attending over attended_positions keys,
    unembedding unembedded_rows rows (the passes below check their arguments)."""
    T, S, rows = new_tokens, attended_positions, unembedded_rows
    d, L, h = config.d_model, config.n_layers, config.n_heads
    if config.latent_dim is not None:
        dc, dr = config.latent_dim, config.rope_head_dim
        # q, q's rotary part, the latent, the rotary key, absorbing q into the latent's
        # space, expanding the mixed latents back to values, the output projection
        projections = 2 * d * d + d * h * dr + d * dr + 3 * d * dc
        scores, sums = S * h * (dc + dr), S * h * dc
    else:
        projections = 2 * d * d + 2 * d * config.kv_width
        scores = sums = S * d
    return MultiplyAdds(
        projections=L * T * projections,
        attention_scores=L * T * scores,
        attention_sums=L * T * sums,
        # GPT-2's MLP has two (d, f) matrices, SwiGLU three (model_of_today)
        mlp=L * (3 if config.mlp == "swiglu" else 2) * T * d * config.d_ff,
        unembedding=rows * d * config.vocab_size,
    )


def forward_multiply_adds(config: ModelConfig, n_tokens: int, last_only: bool = False):
    """A full forward over n_tokens, no cache (kvlib.forward): S = T = n_tokens."""
    n_tokens, last_only = as_whole_number("n_tokens", n_tokens, 1), as_flag("last_only", last_only)
    return chunk_multiply_adds(as_config(config), n_tokens, n_tokens, 1 if last_only else n_tokens)


def prefill_multiply_adds(config: ModelConfig, n_tokens: int, cached: int = 0,
                          last_only: bool = False):
    """kvlib.prefill of n_tokens after `cached` positions already in the cache (with a
    sliding window, after the positions the cache still holds of them)."""
    n_tokens, last_only = as_whole_number("n_tokens", n_tokens, 1), as_flag("last_only", last_only)
    held = as_config(config).held_positions(as_whole_number("cached", cached))
    return chunk_multiply_adds(config, n_tokens, held + n_tokens, 1 if last_only else n_tokens)


def decode_step_multiply_adds(config: ModelConfig, position: int) -> MultiplyAdds:
    """One cached decode step for the token at 0-based `position`: it attends over
    position + 1 keys (the cached ones and its own; with a sliding window, the ones held)."""
    held = as_config(config).held_positions(as_whole_number("position", position))
    return chunk_multiply_adds(config, 1, held + 1, 1)


def generation_multiply_adds(config: ModelConfig, prompt_length: int, new_tokens: int,
                             use_cache: bool = True) -> MultiplyAdds:
    """Generating new_tokens after a prompt_length prompt, as kvlib.generate does it.

    With the cache: a prefill of the prompt (the first new token comes from its last row),
    then new_tokens - 1 decode steps. Without: new_tokens full forwards over P, P + 1, ...
    tokens. Both unembed only the last row of each pass.
    """
    total = MultiplyAdds()
    for step in generation_step_multiply_adds(config, prompt_length, new_tokens, use_cache):
        total = total + step
    return total


def generation_step_multiply_adds(config: ModelConfig, prompt_length: int, new_tokens: int,
                                  use_cache: bool = True) -> list[MultiplyAdds]:
    """The work of each pass that produces a new token (counting_the_work): a list of new_tokens
    MultiplyAdds, whose sum is generation_multiply_adds.

    Pass i produces new token i. With the cache, pass 0 is the prefill of the prompt and pass
    i >= 1 the decode step of the token at position prompt_length + i - 1. Without the cache,
    pass i is a full forward over prompt_length + i tokens.
    """
    config, use_cache = as_config(config), as_flag("use_cache", use_cache)
    P = as_count("prompt_length", prompt_length, 1)     # Python ints: numpy's would overflow
    new_tokens = as_whole_number("new_tokens", new_tokens, 1, MAX_PASSES)   # one count a pass
    if not use_cache:               # full forwards over P, P + 1, ... tokens
        return [chunk_multiply_adds(config, n, n, 1) for n in range(P, P + new_tokens)]
    # a prefill of the prompt, then decode steps, each over the positions the cache holds
    return [chunk_multiply_adds(config, P, P, 1)] + [
        chunk_multiply_adds(config, 1, config.held_positions(position) + 1, 1)
        for position in range(P, P + new_tokens - 1)]


def generation_step_flops(config: ModelConfig, prompt_length: int, new_tokens: int,
                          use_cache: bool = True) -> np.ndarray:
    """FLOPs of each pass of generation_step_multiply_adds, as a float array (new_tokens,),
    computed at once (counting_the_work's and where_time_goes' explorers, up to 32,768 passes).

    A pass's count is a polynomial in the positions it attends over: a decode step's is
    A + B S (S attended positions), a full forward's over L tokens a + b L + c L^2. So the
    exact counts at the first positions give the coefficients (in integers, so the result is
    exact), and the polynomial gives every pass. With a sliding window the attended positions
    stop growing: those configs are counted pass by pass.
    """
    config, use_cache = as_config(config), as_flag("use_cache", use_cache)
    prompt_length = as_count("prompt_length", prompt_length, 1)
    new_tokens = as_whole_number("new_tokens", new_tokens, 1, MAX_PASSES)   # one count a pass
    if config.window is not None:
        return np.array([step.flops for step in generation_step_multiply_adds(
            config, prompt_length, new_tokens, use_cache)], dtype=np.float64)
    steps = np.arange(new_tokens, dtype=np.int64)
    if use_cache:                        # pass 0 is the prefill; then decodes, linear in S
        flops = np.full(new_tokens, prefill_multiply_adds(config, prompt_length,
                                                          last_only=True).flops, dtype=np.int64)
        base = decode_step_multiply_adds(config, prompt_length).flops
        slope = decode_step_multiply_adds(config, prompt_length + 1).flops - base
        flops[1:] = base + slope * steps[:-1]
        return flops.astype(np.float64)
    # quadratic in L: Newton's form on the first three lengths, in exact integers
    f0, f1, f2 = (forward_multiply_adds(config, prompt_length + k, last_only=True).flops
                  for k in range(3))
    k = np.arange(new_tokens, dtype=np.int64)
    return (f0 + (f1 - f0) * k + (f2 - 2 * f1 + f0) * (k * (k - 1) // 2)).astype(np.float64)


# Which part a matrix product belongs to, by the kvlib.model function that performs it.
_PART_OF_FUNCTION = {
    "project_qkv": "projections",
    "output_projection": "projections",
    "attention_scores": "attention_scores",
    "weighted_sum": "attention_sums",
    "gelu_mlp": "mlp",
    "swiglu_mlp": "mlp",
    "unembed": "unembedding",
    # latent attention (kvlib.latent, the latent_attention lesson)
    "latent_queries": "projections",
    "compress_kv": "projections",
    "rope_keys": "projections",
    "rebuild_kv": "projections",
    "absorb_queries": "projections",
    "expand_values": "projections",
    "latent_attention_scores": "attention_scores",
    "latent_weighted_sum": "attention_sums",
}


class _CountedArray(np.ndarray):
    """An array whose matrix products are tallied, by the function that performs them."""

    tally: dict[str, int]

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul and method == "__call__":
            caller = sys._getframe(1).f_code.co_name
            if caller not in _PART_OF_FUNCTION:
                raise RuntimeError(f"a matrix product in {caller}() is not assigned to a part")
            a, b = (np.asarray(x) for x in inputs[:2])
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            macs = int(np.prod(batch, dtype=np.int64)) * a.shape[-2] * a.shape[-1] * b.shape[-1]
            self.tally[_PART_OF_FUNCTION[caller]] += macs
        plain = [np.asarray(x) if isinstance(x, _CountedArray) else x for x in inputs]
        if "out" in kwargs:   # numpy's own reductions (mean, for LayerNorm) write into out=
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, _CountedArray) else x
                                  for x in kwargs["out"])
        return self._wrap(getattr(ufunc, method)(*plain, **kwargs))

    def __array_function__(self, function, types, args, kwargs):
        return self._wrap(function(*_unwrap(args), **_unwrap(kwargs)))

    def _wrap(self, result):
        if isinstance(result, tuple):
            return tuple(self._wrap(r) for r in result)
        if isinstance(result, np.ndarray) and not isinstance(result, _CountedArray):
            result = result.view(_CountedArray)
            result.tally = self.tally
        return result

    def __array_finalize__(self, source):
        self.tally = getattr(source, "tally", None)


def _unwrap(value):
    return plain_arrays(value, _CountedArray)


def plain_arrays(value, kind: type):
    """value with every array of the ndarray subclass `kind` in it (also inside lists, tuples
    and dicts) as a plain np.ndarray view of the same numbers: what a function that watches
    numpy's calls (counting multiply-adds, spotting a shortcut) hands on to numpy."""
    if isinstance(value, kind):
        return value.view(np.ndarray)
    if isinstance(value, (list, tuple)):
        return type(value)(plain_arrays(item, kind) for item in value)
    if isinstance(value, dict):
        return {key: plain_arrays(item, kind) for key, item in value.items()}
    return value


def count_multiply_adds(function, params: Params, *args, **kwargs):
    """Run function(params, *args, **kwargs) and count the multiply-adds of every matrix
    product it performs: returns (its result, MultiplyAdds).

    The check on the formulas above: the count comes from the products that really run.
    """
    tally = dict.fromkeys(_PART_OF_FUNCTION.values(), 0)

    def counted(array):
        view = array.view(_CountedArray)
        view.tally = tally
        return view

    if not callable(function):
        raise TypeError(f"function must be a kvlib function to run (kvlib.forward, kvlib."
                        f"prefill, ...), got {function!r}")
    params = as_params(params)
    counted_params = Params(
        config=params.config,
        layers=tuple(type(layer)(**{name: counted(array)
                                    for name, array in layer.arrays().items()})
                     for layer in params.layers),
        **{name: counted(array) for name, array in params.arrays().items()},
    )
    result = function(counted_params, *args, **kwargs)
    return _unwrap(result), MultiplyAdds(**tally)


FLOP_UNITS = ((1e15, "PFLOPs"), (1e12, "TFLOPs"), (1e9, "GFLOPs"), (1e6, "MFLOPs"),
              (1e3, "kFLOPs"), (1.0, "FLOPs"))


def flop_unit(largest: float) -> tuple[float, str]:
    """The unit to show FLOPs in, chosen by size (counting_the_work): (1e9, "GFLOPs") for 2.5e10,
    (1e3, "kFLOPs") for 49,920, so that a toy model never reads "0.0 GFLOPs"."""
    for scale, name in FLOP_UNITS:
        if largest >= scale:
            return scale, name
    return 1.0, "FLOPs"


def format_flops(flops: float) -> str:
    """FLOPs in the unit that fits them, 3 significant digits: '27.0 TFLOPs', '49.9 kFLOPs'."""
    scale, name = flop_unit(abs(flops))
    return f"{flops / scale:,.3g} {name}"
