"""When the cache is wrong (when_the_cache_is_wrong): find where a cached run first parts from full
recomputation, and say what that usually means.

    report = kvlib.debug.first_divergence(params, prompt_ids, n_new_tokens,
                                          decode_step=my_decode_step)
    print(report)       # None when nothing parts, else one line: where, what, by how much, why

Two runs see the same tokens: the reference recomputes everything with kvlib.forward (no cache
at all), and chooses the next tokens greedily; the cached run prefills the prompt (kvlib.prefill,
or the prefill given) and then calls decode_step(params, token_id, cache) -> logits (1, V) once
per token, fed the reference's tokens (teacher forcing), so that a difference in one step cannot
hide behind a different token in the next. decode_step may be kvlib.decode_step with any cache
kind, or a learner's own loop.

While each step runs, kvlib's building blocks are watched (record): what kvlib.project_qkv
returned (q, k and v before the rotation), the attention weights, the attention output and
each block's output, layer by layer, in the order they are called. The cache is read before
and after every step: what the step wrote, where, and whether it touched an earlier row. The
first quantity, in the order a token meets them, that differs from the reference by more than
the tolerance is reported, with a one-line reading of what such a difference usually means
(positions off, a missing mask row, a stale or overwritten row, a cache that is not read, a
rollback one too far).

rows_computed tells what a step cost: how many rows each step projected, which is how a cache
that is filled but never read shows (every answer right, nothing faster).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from . import inference, model
from .cache import BaseKVCache, make_cache
from .checks import as_array, as_cache, as_params, as_real_number, as_token_ids, as_whole_number
from .params import Params
from .positions import rotary_positions
from .wrapping import wrapped

WATCHED = ("project_qkv", "attention_weights", "weighted_sum", "decoder_block")
"""kvlib.model's functions whose results are recorded, by the name a loop calls them by."""


@dataclass(frozen=True)
class Divergence:
    """Where a cached run first parts from recomputation (when_the_cache_is_wrong).

    step: the decode step (0 is the first after the prefill), None for the prefill itself;
    layer (from 0), head and position: where, as far as they apply (None otherwise);
    quantity: what differs ("k after the rotation", "attention weights", "logits", ...);
    difference: how much (the largest absolute difference, or a count); reading: what such a
    difference usually means.
    """

    step: int | None
    layer: int | None
    head: int | None
    position: int | None
    quantity: str
    difference: float
    reading: str

    def __str__(self) -> str:
        where = ["the prefill" if self.step is None else f"decode step {self.step}"]
        for name in ("layer", "head", "position"):
            if getattr(self, name) is not None:
                where.append(f"{name} {getattr(self, name)}")
        if math.isnan(self.difference):          # an error, or layers that disagree
            return f"{', '.join(where)}: {self.reading}"
        return (f"{', '.join(where)}: {self.quantity} differs by {self.difference:.3g}. "
                f"{self.reading}")


# ------------------------------------------------------------------------------ recording

class Record:
    """What one pass computed, layer by layer: each layer a dict with q, k, v (pre-rotation
    rows), weights (h, T, S), attended (h, T, dh) and output (T, d), as far as they ran."""

    def __init__(self):
        self.layers: list[dict[str, np.ndarray]] = []
        self.rows_projected: list[int] = []
        self.start: int | None = None     # the first position of the block being run

    def _layer(self, key: str) -> dict:
        if not self.layers or key in self.layers[-1]:
            self.layers.append({})
        return self.layers[-1]

    def add(self, name: str, result) -> None:
        if name == "project_qkv":
            q, k, v = result
            self.layers.append({"q": q, "k": k, "v": v, "start": self.start})
            self.rows_projected.append(len(q))
        elif name == "attention_weights":
            self._layer("weights")["weights"] = result
        elif name == "weighted_sum":
            self._layer("attended")["attended"] = result
        elif name == "decoder_block":
            self._layer("output")["output"] = result


@contextlib.contextmanager
def record():
    """Record kvlib's building blocks while the block runs -> a Record. The functions are
    wrapped where loops look them up (kvlib.wrapping), and put back afterwards, even if the
    block raises."""
    recorded = Record()

    def watch(name, original):
        def watched(*args, **kwargs):
            if name == "decoder_block":       # where this block's rows start
                cache = kwargs.get("cache", args[4] if len(args) > 4 else None)
                layer = kwargs.get("layer_index", args[5] if len(args) > 5 else 0)
                recorded.start = 0 if cache is None else cache.lengths[layer]
            result = original(*args, **kwargs)
            recorded.add(name, result)
            if name == "decoder_block":
                recorded.start = None
            return result
        return watched

    with wrapped(WATCHED, watch):
        yield recorded


# ------------------------------------------------------------------------------ comparing

CACHED_TOLERANCES = {"float64": 1e-10, "float32": 1e-5}
"""How close cached decoding must come to full recomputation, relative to the logits' size
(the largest |logit|): 1e-10 in float64 (kv_cached_decode's check: rounding leaves a few
1e-16, a real bug moves logits by 1e-3 or more); in float32 the same check scaled by its
spacing (1.2e-7), 1e-5."""


def relative_difference(logits, reference) -> float:
    """max |logits - reference| / max |reference| (kv_cached_decode): how far cached decoding
    is from full recomputation, in units of the logits' own size."""
    logits, reference = as_array("logits", logits), as_array("reference", reference)
    if logits.shape != reference.shape or reference.size == 0:
        raise ValueError(f"logits {logits.shape} and reference {reference.shape} must be two "
                         "arrays of one shape, not empty")
    return float(np.max(np.abs(logits - reference)) / np.max(np.abs(reference)))


def cached_tolerance(params: Params) -> float:
    """The tolerance of CACHED_TOLERANCES for the params' dtype (float64 or float32)."""
    return CACHED_TOLERANCES[params.config.dtype]


def _parts(a: np.ndarray, b: np.ndarray, tolerance: float) -> float | None:
    """The largest difference of a from b when it is beyond tolerance x their size, else
    None. Shapes that differ always part."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    difference = float(np.abs(a - b).max(initial=0.0))
    return difference if difference > tolerance * max(1.0, float(np.abs(b).max(initial=0.0))) \
        else None


def _worst_head(a: np.ndarray, b: np.ndarray, n_heads: int) -> int | None:
    """The head (column block of rows (T, n x dh), or axis 0 of (h, ...)) differing most."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return None
    if a.ndim == 2:
        a, b = model.split_heads(a, n_heads), model.split_heads(b, n_heads)
    return int(np.abs(a - b).reshape(a.shape[0], -1).max(axis=1).argmax())


def _held_rows(cache: BaseKVCache, layer: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Position -> (K row, V row) of what a layer of the cache holds now (copies)."""
    positions = cache.key_positions(0)
    keys, values = cache.keys(layer), cache.values(layer)
    return {int(p): (np.array(keys[i]), np.array(values[i])) for i, p in enumerate(positions)}


class _Reference:
    """Full recomputation of the whole sequence, once, recorded: everything a step at any
    position should have computed."""

    def __init__(self, params: Params, ids: list[int]):
        self.params, self.ids = params, ids
        with record() as recorded:
            self.logits = inference.forward(params, ids)
        self.layers = recorded.layers
        self.rotated = []
        rotary = rotary_positions(params.config, np.arange(len(ids)))
        for layer in self.layers:
            keys = layer["k"] if rotary is None else rotary.rotate(layer["k"])
            self.rotated.append(keys)


def _placed_at(params: Params, token: int, key: np.ndarray, limit: int):
    """The learned position at which token's first-layer key is key (1, width), if any."""
    layer = params.layers[0]
    for position in range(min(limit, params.config.context_length)):
        X = params.embedding[[token]] + params.position_table[[position]]
        X = model.normalize(X, layer.ln_1_gain, layer.ln_1_bias, params.config.norm_epsilon)
        if np.allclose(model.project_qkv(X, layer)[1], key, rtol=1e-5, atol=1e-6):
            return position
    return None


def _rotated_for(params: Params, raw_key: np.ndarray, rotated: np.ndarray, limit: int):
    """The position at which raw_key (1, width) turns into rotated, if any below limit."""
    for position in range(limit):
        turned = rotary_positions(params.config, np.array([position])).rotate(raw_key)
        if np.allclose(turned, rotated, rtol=1e-5, atol=1e-6):
            return position
    return None


def _reading_for_weights(learned: np.ndarray, expected: np.ndarray, phase: str) -> str:
    """What differing attention weights usually mean, from their shapes and where they part."""
    read, should = learned.shape[-1], expected.shape[-1]
    if read != should:
        if read == learned.shape[-2]:
            return (f"attention read only the {read} new key(s), not the {should} it should: "
                    "the cache is written but never read")
        if read < should:
            return (f"attention read {read} keys where recomputation reads {should}: a window "
                    "or a mask one too narrow, or rows missing from the cache")
        return (f"attention read {read} keys where recomputation reads {should}: extra rows "
                "(stale, appended twice, or a rollback not far enough), or a window one too wide")
    later = np.triu(np.ones(learned.shape[-2:], dtype=bool), k=1 + should - learned.shape[-2])
    if phase == "prefill" and np.abs(learned[..., later]).max(initial=0.0) > 0:
        return "queries weigh later positions: the causal mask is missing in the prompt's pass"
    hidden = (learned == 0) & (expected > 0)
    if hidden.any():
        return ("the mask hides keys the query should see: a mask aligned to the wrong end "
                "(a causal mask built for one query, is_causal), or a window too narrow")
    return ("the weights differ at the same positions: a key in the cache differs from what "
            "its token computes (a stale row), or the scores are scaled or masked differently")


# ------------------------------------------------------------------------------ the locator

def _compare_layer_pass(reference: _Reference, got: dict, layer: int, positions: list[int],
                        keys_read: np.ndarray, tol: float, step, phase: str):
    """The first difference of one layer of a pass of the cached run (got: its recorded q, k,
    v, weights, attended, output for the last len(q) of `positions`) from the reference."""
    config = reference.params.config
    want = reference.layers[layer]
    # the pass's rows end at the last position: a prefill that reused rows computes fewer,
    # a step that recomputes the sequence (a cache never read) computes more
    n_rows = len(got["q"]) if "q" in got else len(positions)
    last = positions[-1]
    span = slice(last - n_rows + 1, last + 1)
    first = span.start
    if n_rows > len(positions):
        keys_read = np.arange(last + 1)
    for quantity, label, heads in (("q", "q (before the rotation)", config.n_heads),
                                   ("k", "k (before the rotation)", config.kv_heads),
                                   ("v", "v", config.kv_heads)):
        if quantity in got:
            difference = _parts(got[quantity], want[quantity][span], tol)
            if difference is not None:
                reading = ("the step's input differs from the start: a wrong token, or a wrong "
                           "row of the learned position table (positions off)" if layer == 0
                           else "the layer's input differs: see the layer before")
                return Divergence(step, layer, _worst_head(got[quantity], want[quantity][span],
                                  heads), first, label, difference, reading)
    if "weights" in got:
        expected = want["weights"][:, span][:, :, keys_read]
        difference = _parts(got["weights"], expected, tol)
        if difference is not None:
            head = _worst_head(got["weights"], expected, config.n_heads)
            return Divergence(step, layer, head, first, "attention weights", difference,
                              _reading_for_weights(got["weights"], expected, phase))
    if "attended" in got:
        difference = _parts(got["attended"], want["attended"][:, span], tol)
        if difference is not None:
            return Divergence(step, layer, _worst_head(got["attended"],
                              want["attended"][:, span], config.n_heads), first,
                              "attention output", difference,
                              "the same weights mix other values: a value row in the cache "
                              "differs from what its token computes (a stale row)")
    if "output" in got:
        difference = _parts(got["output"], want["output"][span], tol)
        if difference is not None:
            return Divergence(step, layer, None, first, "block output", difference,
                              "attention agrees but the block's output does not: the output "
                              "projection, the MLP or the residual differs")
    return None


def _compare_layer_cache(reference: _Reference, rows: dict, before: dict, layer: int,
                         length: int, tol: float, step):
    """The first row of one layer of the cache that changed since before the pass, or that
    differs from what recomputation computes for its position."""
    params = reference.params
    config = params.config
    for position, (key, value) in sorted(rows.items()):
        old = before.get(position)
        if old is not None and (_parts(key, old[0], tol) is not None
                                or _parts(value, old[1], tol) is not None):
            return Divergence(step, layer, None, position, "an earlier cache row",
                              _parts(key, old[0], tol) or _parts(value, old[1], tol),
                              "the step wrote over a row of an earlier position: its write "
                              "offset is off (an overwritten, stale row)")
        want_k = reference.rotated[layer][position:position + 1]
        difference = _parts(key[None], want_k, tol)
        if difference is not None:
            raw = reference.layers[layer]["k"][position:position + 1]
            turned = placed = None
            if config.positions == "rotary":
                turned = _rotated_for(params, raw, key[None], 2 * length + 2)
            elif config.positions == "learned" and layer == 0:
                placed = _placed_at(params, reference.ids[position], key[None], 2 * length + 2)
            if turned is not None and turned != position:
                reading = (f"positions off: the key of position {position} was rotated for "
                           f"position {turned}")
            elif placed is not None and placed != position:
                reading = (f"positions off: the token of position {position} was given the "
                           f"learned position {placed}")
            else:
                reading = ("the cached key differs from what its token computes at its "
                           "position: a row from another sequence (a prefix-cache key without "
                           "its parent), or positions off")
            return Divergence(step, layer, _worst_head(key[None], want_k, config.kv_heads),
                              position, "cached k", difference, reading)
        want_v = reference.layers[layer]["v"][position:position + 1]
        difference = _parts(value[None], want_v, tol)
        if difference is not None:
            return Divergence(step, layer, None, position, "cached v", difference,
                              "the cached value differs from what its token computes: a row "
                              "from another sequence, or written at the wrong place")
    return None


def _the_pass(recorded: Record, n_layers: int, last: int) -> list[dict]:
    """Of the passes a step ran (a prompt in chunks, a draft's guess), the last one whose rows
    end at the step's last position; the last pass when none says where it started."""
    passes = [recorded.layers[i:i + n_layers]
              for i in range(0, len(recorded.layers), n_layers)]
    ending = [layers for layers in passes if layers[0].get("start") is not None
              and layers[0]["start"] + len(layers[0]["q"]) - 1 == last]
    return ending[-1] if ending else (passes[-1] if passes else [])


def _compare(reference: _Reference, recorded: Record, cache: BaseKVCache, before: list[dict],
             positions: list[int], keys_read: np.ndarray, tol: float, step, phase: str):
    """What a pass did against the reference: the cache's length first, then layer by layer
    the rows it holds (what the pass wrote, and that nothing earlier changed) and what the
    pass computed (q, k, v, weights, attention output, block output)."""
    config = reference.params.config
    expected_length = positions[-1] + 1
    try:
        length = len(cache)
    except ValueError as error:           # its layers disagree
        return Divergence(step, None, None, None, "cache length", math.nan,
                          f"the layers of the cache hold different numbers of rows ({error})")
    if length != expected_length:
        return Divergence(step, None, None, expected_length - 1, "cache length",
                          abs(length - expected_length),
                          f"the cache holds {length} positions where {expected_length} were "
                          "computed: rows appended twice or not at all, or a rollback one too "
                          "far or not far enough")
    passes = _the_pass(recorded, config.n_layers, positions[-1])
    for layer in range(config.n_layers):
        found = _compare_layer_cache(reference, _held_rows(cache, layer), before[layer], layer,
                                     length, tol, step)
        if found is None and layer < len(passes):
            found = _compare_layer_pass(reference, passes[layer], layer, positions, keys_read,
                                        tol, step, phase)
        if found is not None:
            return found
    return None


def _greedy(params: Params, prompt_ids, n_new_tokens) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the prompt and its n_new_tokens greedy tokens): the reference run,
    by full recomputation (kvlib.generate checks that they fit the context)."""
    ids = [int(i) for i in as_token_ids(prompt_ids, as_params(params).config.vocab_size)]
    n_new_tokens = as_whole_number("n_new_tokens", n_new_tokens, 1)
    return ids, ids + inference.generate(params, ids, n_new_tokens, use_cache=False)


def first_divergence(params: Params, prompt_ids, n_new_tokens: int,
                     decode_step=inference.decode_step, *, prefill=inference.prefill,
                     cache: BaseKVCache | None = None, tolerance: float | None = None
                     ) -> Divergence | None:
    """The first place where a cached generation parts from full recomputation
    (when_the_cache_is_wrong), or None when nothing parts.

    decode_step(params, token_id, cache) -> logits (1, V): kvlib.decode_step or a learner's
    own; prefill(params, ids, cache) -> (logits, cache): kvlib.prefill or a learner's own.
    cache: the empty cache to fill (by default the kind the model needs). tolerance: relative
    to the size of the numbers compared (1e-9 in float64, 2e-4 in float32 by default). The
    run is fed the reference's greedy tokens. Steps count from 0 after the prefill (None is the
    prefill), layers from 0.
    """
    if as_params(params).config.latent_dim is not None:
        raise ValueError("first_divergence watches K/V heads; latent attention (the "
                         "latent_attention lesson) caches a latent instead")
    tol = (1e-9 if params.config.dtype == "float64" else 2e-4) if tolerance is None else \
        as_real_number("tolerance", tolerance, positive=True)
    cache = make_cache(params.config) if cache is None else as_cache(cache, params.config)
    if len(cache) != 0:
        raise ValueError("cache must be an empty kvlib cache (kvlib.make_cache(config))")
    ids, tokens = _greedy(params, prompt_ids, n_new_tokens)
    n_new = len(tokens) - len(ids)
    reference = _Reference(params, tokens)
    empty = [{} for _ in range(params.config.n_layers)]
    keys_read = cache.key_positions(len(ids))     # what a right pass attends to
    with record() as recorded:
        try:
            logits, cache = prefill(params, ids, cache)
        except Exception as error:     # the learner's code: a crash is a finding too
            return Divergence(None, None, None, None, "an error", math.nan,
                              f"the prefill raised {type(error).__name__}: {error}")
    found = _compare(reference, recorded, cache, empty, list(range(len(ids))), keys_read, tol,
                     None, "prefill")
    if found is not None:
        return found
    difference = _parts(np.asarray(logits)[-1:], reference.logits[len(ids) - 1:len(ids)], tol)
    if difference is not None:
        return Divergence(None, None, None, len(ids) - 1, "logits", difference,
                          "every layer agrees but the logits do not: the final norm or the "
                          "unembedding differs")
    for step in range(n_new - 1):
        position = len(ids) + step
        before = [_held_rows(cache, layer) for layer in range(params.config.n_layers)]
        keys_read = cache.key_positions(1)
        with record() as recorded:
            try:
                logits = decode_step(params, tokens[position], cache)
            except Exception as error:
                return Divergence(step, None, None, position, "an error", math.nan,
                                  f"the step raised {type(error).__name__}: {error}")
        found = _compare(reference, recorded, cache, before, [position], keys_read, tol, step,
                         "decode")
        if found is not None:
            return found
        difference = _parts(np.asarray(logits).reshape(1, -1),
                            reference.logits[position:position + 1], tol)
        if difference is not None:
            return Divergence(step, None, None, position, "logits", difference,
                              "every layer and every cached row agrees but the logits do not: "
                              "the final norm or the unembedding differs")
    return None


def rows_computed(params: Params, prompt_ids, n_new_tokens: int,
                  decode_step=inference.decode_step) -> list[int]:
    """How many rows each decode step pushed through the model (when_the_cache_is_wrong): the rows
    kvlib.project_qkv saw in a step, over the layers: 1 for a step that uses its cache, the
    whole sequence so far for one that recomputes it (a cache filled but never read gives the
    right answers and no speed-up)."""
    ids, tokens = _greedy(params, prompt_ids, n_new_tokens)
    n_new = len(tokens) - len(ids)
    _, cache = inference.prefill(params, ids)
    rows = []
    for step in range(n_new - 1):
        with record() as recorded:
            decode_step(params, tokens[len(ids) + step], cache)
        rows.append(sum(recorded.rows_projected) // params.config.n_layers)
    return rows


def logit_differences(params: Params, prompt_ids, n_new_tokens: int,
                      decode_step=inference.decode_step, *, prefill=inference.prefill
                      ) -> np.ndarray:
    """How far a cached run's logits are from recomputation, step by step (when_the_cache_is_wrong):
    (n_new_tokens,) largest |difference| of the logits that choose each new token, the
    prefill's last row first, then one per decode step; fed the reference's greedy tokens
    (teacher forcing). A step that raises gives nan from there on. A bug shows as a jump
    that stays; rounding as a low, even floor."""
    ids, tokens = _greedy(params, prompt_ids, n_new_tokens)
    n_new = len(tokens) - len(ids)
    reference = inference.forward(params, tokens[:-1])[len(ids) - 1:]
    differences = np.full(n_new, np.nan)
    try:
        logits, cache = prefill(params, ids, make_cache(params.config))
        differences[0] = np.abs(np.asarray(logits)[-1] - reference[0]).max()
        for step in range(1, n_new):
            logits = decode_step(params, tokens[len(ids) + step - 1], cache)
            differences[step] = np.abs(np.asarray(logits).reshape(-1) - reference[step]).max()
    except Exception:        # a failing loop: what it computed before stays, the rest is nan
        pass
    return differences


__all__ = ["Divergence", "Record", "first_divergence", "logit_differences", "record",
           "rows_computed"]
