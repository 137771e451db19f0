"""When the cache is wrong (when_the_cache_is_wrong): find where a cached run first parts from full
recomputation, and say what the evidence shows.

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
returned (q, k and v before the rotation), what attention read (q and k as attention_weights got
them, v as weighted_sum got it), the attention weights, the attention output and each block's
output, layer by layer, pass by pass (a prompt in chunks is several passes). The cache is read
before and after every step: how many rows each layer holds, what the step wrote, and whether it
touched an earlier row. The first quantity, in the order a token meets them, that differs from
the reference by more than the tolerance is reported, at the first row (position) that differs.
A NaN or an infinity where recomputation has a number always differs.

The reading names what the locator found, not a guess: a row is called stale, misplaced or
another sequence's only when it equals such a row; when every cached row is right and attention
still differs, the reading says which quantity of the attention over them differs first, and
what the weights show (keys the mask hides or reveals, heads matched to the wrong K/V heads,
keys turned again on read).

Tolerances are relative to the size of the numbers compared: 1e-9 in float64 and 2e-4 in float32
by default; for 16-bit formats, tolerance_for(number_format, model): twice the largest
difference right loops showed, measured by tools/measure_tolerances.py for the story model and
SmolLM2 (kvlib/models/tolerances.json).

rows_computed tells what a step cost: how many rows each step projected, which is how a cache
that is filled but never read shows (every answer right, nothing faster).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import inference, model
from .cache import BaseKVCache, make_cache
from .checks import (
    as_array,
    as_cache,
    as_one_of,
    as_params,
    as_real_number,
    as_token_ids,
    as_whole_number,
)
from .params import Params
from .positions import rotary_positions
from .wrapping import wrapped

WATCHED = ("project_qkv", "attention_weights", "weighted_sum", "decoder_block")
"""kvlib.model's functions whose results (and, for attention, inputs) are recorded, by the name
a loop calls them by."""

NOT_A_NUMBER = "NaN/inf where recomputation has numbers"
"""The first words of a reading when the cached run holds NaN or infinity where the reference
holds numbers."""


@dataclass(frozen=True)
class Divergence:
    """Where a cached run first parts from recomputation (when_the_cache_is_wrong).

    step: the decode step (0 is the first after the prefill), None for the prefill itself;
    layer (from 0) and head: where, as far as they apply (None otherwise); position: the
    position of the first row that differs (for a cached row, the row's position; for the
    cache's length, the new token's position); given_position: the position the token was given
    instead, when the locator found it (a learned position or a rotation), else None;
    quantity: what differs ("cached k", "attention weights", "logits", ...); difference: the
    largest absolute difference in that row (inf when the run holds NaN or inf there, or the
    shapes differ; a count for the cache's length; NaN for an error); relative: difference over
    the size of the numbers compared (what the tolerance bounds); reading: what the evidence
    shows.
    """

    step: int | None
    layer: int | None
    head: int | None
    position: int | None
    quantity: str
    difference: float
    reading: str
    given_position: int | None = None
    relative: float | None = None

    def __str__(self) -> str:
        where = ["the prefill" if self.step is None else f"decode step {self.step}"]
        for name in ("layer", "head"):
            if getattr(self, name) is not None:
                where.append(f"{name} {getattr(self, name)}")
        if self.position is not None:
            given = "" if self.given_position in (None, self.position) else \
                f" (given {self.given_position})"
            where.append(f"position {self.position}{given}")
        if math.isnan(self.difference):          # an error
            return f"{', '.join(where)}: {self.reading}"
        if math.isinf(self.difference):          # NaN, infinity or another shape
            return f"{', '.join(where)}: {self.quantity}: {self.reading}"
        return (f"{', '.join(where)}: {self.quantity} differs by {self.difference:.3g}. "
                f"{self.reading}")


# ------------------------------------------------------------------------------ recording

class Record:
    """What one run computed, layer call by layer call, in call order: each a dict with q, k, v
    (project_qkv: rows (T, width) before the rotation), q_read and k_read (what
    attention_weights got: heads (h, T, dh) and (kv or h, S, dh), after the rotation), weights
    (h, T, S), v_read (what weighted_sum got), attended (h, T, dh) and output (T, d), as far as
    they ran; and where the block ran: start (the cache row its rows go to, None without a
    cache), keys (the positions its attention reads, when a cache said), cached (whether the
    block got a cache), layer (its layer_index, when decoder_block said)."""

    def __init__(self):
        self.layers: list[dict] = []
        self.rows_projected: list[int] = []
        self.block: dict = {}       # where the decoder_block being run puts its rows
        self._pass_keys = None      # the key positions of the pass, from its first layer

    def _layer(self, key: str) -> dict:
        if not self.layers or key in self.layers[-1]:
            self.layers.append({})
        return self.layers[-1]

    def enter_block(self, X, cache, layer: int) -> None:
        """decoder_block(X, ..., cache, layer_index) is about to run."""
        if cache is None:
            self.block = {"start": None, "keys": None, "cached": False, "layer": layer}
            return
        if layer == 0:
            try:
                self._pass_keys = np.array(cache.key_positions(len(X)))
            except Exception:                # a learner's cache in a state of its own
                self._pass_keys = None
        self.block = {"start": cache.lengths[layer], "keys": self._pass_keys, "cached": True,
                      "layer": layer}

    def add(self, name: str, result, args=(), kwargs=None) -> None:
        kwargs = kwargs or {}
        if name == "project_qkv":
            q, k, v = result
            self.layers.append({"q": q, "k": k, "v": v, **self.block})
            self.rows_projected.append(len(q))
        elif name == "attention_weights":
            layer = self._layer("weights")
            layer["q_read"] = np.array(kwargs.get("Q", args[0] if args else None))
            layer["k_read"] = np.array(kwargs.get("K", args[1] if len(args) > 1 else None))
            layer["weights"] = result
        elif name == "weighted_sum":
            layer = self._layer("attended")
            layer["v_read"] = np.array(kwargs.get("V", args[1] if len(args) > 1 else None))
            layer["attended"] = result
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
            if name == "decoder_block":       # where this block's rows go
                cache = kwargs.get("cache", args[4] if len(args) > 4 else None)
                layer = kwargs.get("layer_index", args[5] if len(args) > 5 else 0)
                recorded.enter_block(kwargs.get("X", args[0] if args else None), cache, layer)
            try:
                result = original(*args, **kwargs)
            finally:
                if name == "decoder_block":
                    recorded.block = {}
            recorded.add(name, result, args, kwargs)
            return result
        return watched

    with wrapped(WATCHED, watch):
        yield recorded


# ------------------------------------------------------------------------------ tolerances

CACHED_TOLERANCES = {"float64": 1e-10, "float32": 1e-5}
"""How close cached decoding must come to full recomputation, relative to the logits' size
(the largest |logit|): 1e-10 in float64 (kv_cached_decode's check: rounding leaves a few
1e-16, a real bug moves logits by 1e-3 or more); in float32 the same check scaled by its
spacing (1.2e-7), 1e-5."""

DEFAULT_TOLERANCES = {"float64": 1e-9, "float32": 2e-4}
"""The locator's tolerance when none is given, by the params' dtype: relative to the size of
the numbers compared (right loops leave a few 1e-15 in float64, tests/test_debug.py; in
float32 up to 2e-5 on SmolLM2 and 2e-6 on the story model, measured by
tools/measure_tolerances.py, which checks that 2e-4 stands at least twice as high)."""

MEASURED_TOLERANCES = Path(__file__).parent / "models" / "tolerances.json"


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


def measured_tolerances() -> dict:
    """What tools/measure_tolerances.py measured (when_the_cache_is_wrong): under "models", by
    model ("stories", "smollm2"): under "formats", by format ("float32", "float16",
    "bfloat16"), the tolerance, the largest relative difference right loops showed (over
    prompts and OpenBLAS kernels: "largest", with its quantity), the smallest the planted bugs
    showed where the locator found them ("smallest_bug"), and the gap (smallest_bug / largest;
    "loud_gap" over the bugs of positions and masks); under "bugs", where each bug was found in
    each format. "margin" is the tolerance over the largest."""
    return json.loads(MEASURED_TOLERANCES.read_text())


def tolerance_for(number_format: str, model_name: str = "stories") -> float:
    """The locator's tolerance for a number format and model (when_the_cache_is_wrong): for
    "float16" and "bfloat16", twice the largest relative difference right loops showed on
    "stories" (the story model: 4 layers, d_model 96) or "smollm2" (SmolLM2-135M: 30 layers,
    d_model 576), rounded up, as tools/measure_tolerances.py measured; float64 and float32 are
    DEFAULT_TOLERANCES' (the tool checks float32's against the same margin)."""
    number_format = as_one_of("number_format", number_format,
                              ("float64", "float32", "float16", "bfloat16"))
    if number_format == "float64":
        return DEFAULT_TOLERANCES["float64"]
    measured = measured_tolerances()["models"]
    model_name = as_one_of("model_name", model_name, tuple(measured))
    return measured[model_name]["formats"][number_format]["tolerance"]


# ------------------------------------------------------------------------------ comparing

@dataclass(frozen=True)
class _Gap:
    """How an array of the run parts from the reference's: the first row that does (None when
    the shapes differ), its largest difference (inf for NaN/inf against a number), that over
    the size of the numbers compared, and what was not a number ("run": the run has NaN/inf
    where the reference has numbers; "reference": the other way; None)."""

    row: int | None
    difference: float
    relative: float
    not_a_number: str | None = None


def _size(want: np.ndarray) -> float:
    """What a tolerance is relative to: the largest finite |number| compared, at least 1."""
    finite = want[np.isfinite(want)]
    return max(1.0, float(np.abs(finite).max(initial=0.0)))


def _differences(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| element by element: 0 where both are the same NaN or infinity, inf where
    only one is a number."""
    both = np.isfinite(got) & np.isfinite(want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(both, np.abs(np.where(both, got - want, 0.0)),
                        np.where(same, 0.0, np.inf))


def _gap(got, want, tolerance: float, rows_axis: int = 0) -> _Gap | None:
    """The first row of got (along rows_axis) that differs from want by more than tolerance x
    their size, or that holds NaN or inf where want has a number (or the other way); None when
    none does. Shapes that differ always part."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return _Gap(None, math.inf, math.inf)
    size = _size(want)
    differences = _differences(got, want)
    parted = np.moveaxis(differences > tolerance * size, rows_axis, 0)
    parted = parted.reshape(len(parted), -1) if parted.size else parted.reshape(0, 0)
    rows = np.flatnonzero(parted.any(axis=1)) if parted.size else []
    if len(rows) == 0:
        return None
    row = int(rows[0])
    take = (slice(None),) * rows_axis + (row,)
    worst = float(differences[take].max())
    not_a_number = None
    if math.isinf(worst):
        not_a_number = "run" if (~np.isfinite(got[take]) & np.isfinite(want[take])).any() \
            else "reference"
    return _Gap(row, worst, worst / size, not_a_number)


def _largest_relative(got, want) -> float:
    """The largest finite |got - want| over their size (0 for shapes that differ)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or got.size == 0:
        return 0.0
    differences = _differences(got, want)
    finite = differences[np.isfinite(differences)]
    return float(finite.max(initial=0.0)) / _size(want)


class _Comparer:
    """The tolerance of one locator run, and the largest relative difference it saw of each
    quantity (what a tolerance must stay above for this run)."""

    def __init__(self, tolerance: float):
        self.tolerance = tolerance
        self.largest: dict[str, float] = {}

    def gap(self, quantity: str, got, want, rows_axis: int = 0) -> _Gap | None:
        seen = _largest_relative(got, want)
        self.largest[quantity] = max(self.largest.get(quantity, 0.0), seen)
        return _gap(got, want, self.tolerance, rows_axis)

    def equal(self, got, want) -> bool:
        """got is want within the tolerance (numbers only: a NaN equals nothing here)."""
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        return got.shape == want.shape and bool(np.isfinite(got).all()) and \
            _gap(got, want, self.tolerance) is None


def _worst_head(got: np.ndarray, want: np.ndarray, n_heads: int) -> int | None:
    """The head differing most: column blocks of rows (T, n x dh), or axis 0 of (h, ...)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or got.size == 0:
        return None
    if got.ndim == 2:
        got, want = model.split_heads(got, n_heads), model.split_heads(want, n_heads)
    differences = _differences(got, want).reshape(got.shape[0], -1)
    return int(differences.max(axis=1).argmax())


# ------------------------------------------------------------------------------ the reference

class _Reference:
    """Full recomputation of the whole sequence, once, recorded: everything a step at any
    position should have computed, what attention read (q and k turned, v), and what a right
    cache holds (keys: each layer's K rows after the rotation, (T, kv_width); values)."""

    def __init__(self, params: Params, ids: list[int]):
        self.params, self.ids = params, ids
        with record() as recorded:
            self.logits = inference.forward(params, ids)
        self.layers = recorded.layers
        self.keys = [model.merge_heads(layer["k_read"]) for layer in self.layers]
        self.values = [model.merge_heads(layer["v_read"]) for layer in self.layers]
        self.right_in_layer_zero: set[int] = set()    # positions whose layer-0 rows were right


def _placed_at(params: Params, token: int, key: np.ndarray, limit: int, comparer: _Comparer):
    """The learned position at which token's first-layer key is key (1, width), if any."""
    layer = params.layers[0]
    for position in range(min(limit, params.config.context_length)):
        X = params.embedding[[token]] + params.position_table[[position]]
        X = model.normalize(X, layer.ln_1_gain, layer.ln_1_bias, params.config.norm_epsilon)
        if comparer.equal(model.project_qkv(X, layer)[1], key):
            return position
    return None


def _rotated_for(params: Params, raw: np.ndarray, rotated: np.ndarray, limit: int,
                 comparer: _Comparer):
    """The position at which raw (1, width) turns into rotated, if any below limit."""
    for position in range(limit):
        turned = rotary_positions(params.config, np.array([position])).rotate(raw)
        if comparer.equal(turned, rotated):
            return position
    return None


def _equal_rows(row: np.ndarray, rows: np.ndarray, comparer: _Comparer) -> list[int]:
    """The indices of rows (n, width) that row (width,) equals within the tolerance."""
    return [i for i in range(len(rows)) if comparer.equal(row[None], rows[i:i + 1])]


# ------------------------------------------------------------------------------ readings

def _not_a_number(gap: _Gap, what: str) -> str:
    """The reading of a NaN or infinity: which side has it."""
    if gap.not_a_number == "reference":
        return (f"numbers where recomputation has NaN/inf: the reference itself overflowed "
                f"or divided by zero ({what})")
    return f"{NOT_A_NUMBER}: {what}"


def _cached_row_reading(reference: _Reference, kind: str, layer: int, position: int,
                        row: np.ndarray, computed: dict, comparer: _Comparer, limit: int):
    """(reading, given position) of a cached k or v row that differs from recomputation's,
    from what the row is found equal to; computed: position -> (k, v) rows (before the
    rotation) that this step's passes computed at this layer."""
    params = reference.params
    config = params.config
    want_k, want_v = reference.keys[layer], reference.values[layer]
    own = want_k if kind == "k" else want_v
    other = want_v if kind == "k" else want_k
    if not np.isfinite(row).all():
        return _not_a_number(_Gap(0, math.inf, math.inf, "run"),
                             f"the cached {kind} of this position is not a number: written "
                             "from an uninitialised buffer, or computed from NaN"), None
    if not row.any():
        return (f"the cached {kind} is all zeros: the row was never written (the append "
                "skipped this layer, or wrote elsewhere)"), None
    if kind == "k" and config.positions == "rotary":
        raw = reference.layers[layer]["k"][position:position + 1]
        turned = _rotated_for(params, raw, row[None], limit, comparer)
        if turned is not None and turned != position:
            return (f"positions off: the key of position {position} was rotated for position "
                    f"{turned}"), turned
    if kind == "k" and config.positions == "learned" and layer == 0:
        placed = _placed_at(params, reference.ids[position], row[None], limit, comparer)
        if placed is not None and placed != position:
            return (f"positions off: the token of position {position} was given the learned "
                    f"position {placed}"), placed
    if comparer.equal(row[None], other[position:position + 1]):
        return (f"the cached {kind} equals the {'value' if kind == 'k' else 'key'} of its "
                f"position: the {'key' if kind == 'k' else 'value'} cache holds "
                f"{'values' if kind == 'k' else 'keys'} (K and V swapped, or one stored "
                "twice)"), None
    elsewhere = [p for p in _equal_rows(row, own[:limit], comparer) if p != position]
    if elsewhere:
        return (f"the cached {kind} is the row of position {elsewhere[0]}: written at the wrong "
                "place (an offset off), or a stale row left from before"), None
    if position in computed:
        raw = computed[position][0 if kind == "k" else 1]
        want_raw = reference.layers[layer][kind][position:position + 1]
        if comparer.equal(raw[None], want_raw):
            return (f"this step computed the right {kind} for the position, but the cache holds "
                    f"another: it changed on its way in or out (quantized and read back with "
                    "the wrong scales, cast, or transformed)"), None
    if layer > 0 and position not in computed and position in reference.right_in_layer_zero:
        return (f"the row is right in layer 0 (its token at its position) and differs from "
                f"layer {layer} on, and no pass of this run computed it: it was computed after "
                "other tokens, a row from another sequence (a prefix-cache block reused "
                "without its parent)"), None
    return (f"the cached {kind} differs from what its token computes at its position, and "
            "equals no row the locator knows (not another position's, not the "
            f"{'value' if kind == 'k' else 'key'}, not zeros): written from other inputs, or "
            "transformed on its way in"), None


def _read_heads_reading(got: np.ndarray, want: np.ndarray, group: int, kind: str,
                        comparer: _Comparer) -> str | None:
    """When a read (h, S, dh) has as many heads as the queries and want (kv, S, dh) fewer: which
    K/V head each query head read, if each equals one -> a reading of a wrong head mapping."""
    if group == 1 or got.shape[0] != want.shape[0] * group:
        return None
    mapping = []
    for head in range(got.shape[0]):
        found = [j for j in range(want.shape[0]) if comparer.equal(got[head], want[j])]
        if not found:
            return None
        mapping.append(found[0])
    right = [head // group for head in range(got.shape[0])]
    if mapping == right:
        return None
    wrong = next(head for head in range(len(mapping)) if mapping[head] != right[head])
    return (f"query head {wrong} read K/V head {mapping[wrong]}'s {kind} where it should read "
            f"K/V head {right[wrong]} (query heads {list(range(got.shape[0]))} read "
            f"{mapping}, not {right}): the K/V heads are repeated in the wrong order "
            "(np.tile where np.repeat is right)")


def _heads(read) -> int:
    """How many heads a read (heads, S, dh) has; 0 when it is no such array."""
    return read.shape[0] if read is not None and read.ndim == 3 else 0


def _same_shape(got, want: np.ndarray) -> bool:
    """Whether a recorded read can be compared with recomputation's: one shape (a read of
    another shape is left to the weights, which say how many keys were read)."""
    return got is not None and got.shape == want.shape


def _expanded(want: np.ndarray, heads: int) -> np.ndarray:
    """want (kv, S, dh) repeated to `heads` heads the right way (head i reads i // group)."""
    if heads == 0 or want.shape[0] == heads or heads % want.shape[0]:
        return want
    return np.repeat(want, heads // want.shape[0], axis=0)


def _key_read_reading(reference: _Reference, got: np.ndarray, want: np.ndarray,
                      keys: np.ndarray, comparer: _Comparer) -> str:
    """What differs in the keys attention read, when the cached keys are right."""
    config = reference.params.config
    mapped = _read_heads_reading(got, want, config.n_heads // config.kv_heads, "keys",
                                 comparer)
    if mapped:
        return mapped
    if config.positions == "rotary" and got.shape == _expanded(want, got.shape[0]).shape:
        turned = rotary_positions(config, keys).rotate(model.merge_heads(want))
        expanded = _expanded(model.split_heads(turned, want.shape[0]), got.shape[0])
        if comparer.equal(got, expanded):
            return ("the cached keys are right, but attention read them turned once more: the "
                    "rotation is applied again on read (the cache already holds rotated keys)")
    return ("the cached keys are right, but the keys attention read differ from them: they "
            "change between the cache and the scores (a rotation, a cast, a head mapping)")


def _value_read_reading(reference: _Reference, layer: int, got: np.ndarray, want: np.ndarray,
                        keys: np.ndarray, comparer: _Comparer) -> str:
    """What differs in the values attention read, when the cached values are right."""
    config = reference.params.config
    mapped = _read_heads_reading(got, want, config.n_heads // config.kv_heads, "values",
                                 comparer)
    if mapped:
        return mapped
    keys_read = _expanded(reference.layers[layer]["k_read"][:, keys], got.shape[0])
    if comparer.equal(got, keys_read):
        return ("the cached values are right, but attention mixed the keys: V read from the "
                "key cache")
    return ("the cached values are right, but the values attention read differ from them: "
            "they change between the cache and the weighted sum (a cast, a head mapping)")


def _hidden_and_revealed(learned: np.ndarray, expected: np.ndarray):
    """For one query's weights (h, S): which key columns the run hides (weight 0 or not a
    number where recomputation has weight) and reveals (weight where recomputation has 0)."""
    hidden = ((learned == 0) | ~np.isfinite(learned)) & (expected > 0)
    revealed = np.isfinite(learned) & (learned > 0) & (expected == 0)
    return hidden.any(axis=0), revealed.any(axis=0)


def _span(positions) -> str:
    """Key positions, as a range when they run on."""
    positions = [int(p) for p in positions]
    if len(positions) > 2 and positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}..{positions[-1]}"
    return str(positions)


def _mask_reading(learned: np.ndarray, expected: np.ndarray, query: int, keys: np.ndarray,
                  config, phase: str) -> str | None:
    """What one query's weights (h, S) show about the mask, against recomputation's, from the
    heads whose weights are numbers: keys revealed (later ones: no causal mask; earlier ones:
    a window too wide) or hidden (its own position alone: a strict mask; the latest keys: a
    mask aligned to the wrong end; the oldest ones of a sliding window: a window too narrow).
    None when every key is weighed where it should be, or no head's weights are numbers."""
    visible = keys[expected.max(axis=0) > 0]
    finite = np.isfinite(learned).all(axis=1)
    if not finite.any():               # a softmax over nothing but -inf, or over NaN scores
        if visible.tolist() == [query]:
            return ("the mask hides the query's own position: a strict causal mask (key < "
                    "query where key <= query is right); the first query, which may see only "
                    "itself, sees nothing, and its weights are NaN")
        return None
    hidden, revealed = _hidden_and_revealed(learned[finite], expected[finite])
    if (revealed & (keys > query)).any():
        where = "the prompt's pass" if phase == "prefill" else "this pass"
        return f"queries weigh later positions: the causal mask is missing in {where}"
    if revealed.any():
        return (f"the query at position {query} weighs keys {_span(keys[revealed])} that "
                "recomputation masks: a window too wide, or sinks that are not the model's")
    if not hidden.any():
        return None
    gone = keys[hidden]
    if gone.tolist() == [query]:
        return ("the mask hides the query's own position: a strict causal mask (key < query "
                "where key <= query is right)")
    if np.array_equal(gone, visible[len(visible) - len(gone):]):
        return (f"the mask hides the latest keys {_span(gone)} the query at position {query} "
                "should see: a mask aligned to the wrong end (a causal mask built from the "
                "top-left corner for fewer queries than keys, is_causal)")
    recent = visible[visible >= config.sink_tokens]
    if config.window is not None and np.array_equal(gone, recent[:len(gone)]):
        return (f"the mask hides the oldest keys {_span(gone)} of the window the query at "
                f"position {query} should see: a window too narrow")
    return f"the mask hides keys {_span(gone)} the query at position {query} should see"


def _overflow_reading(got: dict, q_read: np.ndarray, k_read: np.ndarray) -> str | None:
    """Heads whose weights are all NaN, when their scores can overflow float16: the run's q or
    k read in float16, or recomputation's largest |q . k| beyond float16's 65504."""
    in_half = any(got.get(name) is not None and got[name].dtype == np.float16
                  for name in ("q_read", "k_read"))
    largest = float(np.abs(model.attention_scores(q_read, k_read)).max()) \
        * math.sqrt(q_read.shape[-1])
    if not (in_half or largest > 65504):
        return None
    return (f"scores in float16 overflow (q . k reaches {largest:.3g} here, float16 ends at "
            "65504), and the softmax takes inf - inf")


def _weights_reading(got: dict, expected: np.ndarray, positions, keys, row: int, config,
                     phase: str, q_read: np.ndarray, k_read: np.ndarray) -> str:
    """What differing attention weights (h, T, S) show, when the cached rows and what attention
    read before them agree; row: the first query that differs."""
    learned = got["weights"]
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
    blind = [h for h in range(learned.shape[0]) if not np.isfinite(learned[h, row]).any()]
    if blind:
        overflow = _overflow_reading(got, q_read[:, row:row + 1], k_read)
        if overflow:
            return f"the weights of heads {blind} are all NaN: {overflow}"
    masked = _mask_reading(learned[:, row], expected[:, row], int(positions[row]), keys,
                           config, phase)
    if masked:
        return masked
    if blind:
        return (f"the weights of heads {blind} are all NaN: every key of their row is masked, "
                "or their scores are not numbers")
    if not np.isfinite(learned[:, row]).all():
        return "some weights are NaN or inf: a score that is not a number (NaN in q or k?)"
    return ("every cached row is right and so are the q and k attention read, yet the weights "
            "differ at the same positions: the scores are scaled differently (1 / sqrt(head "
            "size)), or the softmax differs")


# ------------------------------------------------------------------------------ the locator

@dataclass(frozen=True)
class _Step:
    """What is compared at one step: which step (None for the prefill), its positions (the
    rows it must add), the keys a right pass reads (before the step, the cache's), the cache
    rows of each layer before the step, and the phase ("prefill" or "decode")."""

    number: int | None
    positions: list[int]
    keys: np.ndarray
    before: list[dict]
    phase: str


def _held_rows(cache: BaseKVCache, layer: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Position -> (K row, V row) of what a layer of the cache holds now (copies)."""
    positions = cache.key_positions(0)
    keys, values = cache.keys(layer), cache.values(layer)
    return {int(p): (np.array(keys[i]), np.array(values[i])) for i, p in enumerate(positions)}


def _check_lengths(recorded: Record, cache: BaseKVCache, step: _Step, n_layers: int):
    """The cache must hold, in every layer, the positions computed so far: the first layer
    that does not is named, with what its block did."""
    expected = step.positions[-1] + 1
    lengths = list(cache.lengths)
    if all(length == expected for length in lengths):
        return None
    if len(set(lengths)) == 1:
        return Divergence(step.number, None, None, expected - 1, "cache length",
                          abs(lengths[0] - expected),
                          f"the cache holds {lengths[0]} positions where {expected} were "
                          "computed: rows appended twice or not at all, or a rollback one too "
                          "far or not far enough")
    layer = next(i for i, length in enumerate(lengths) if length != expected)
    ran = [entry for entry in recorded.layers if entry.get("layer") == layer]
    without = any(entry.get("cached") is False for entry in ran)
    how = ("; its block ran without the cache (cache=None), so attention there read only the "
           "new rows and appended nothing" if without else "")
    return Divergence(step.number, layer, None, expected - 1, "cache length",
                      abs(lengths[layer] - expected),
                      f"layer {layer} holds {lengths[layer]} positions where {expected} were "
                      f"computed (the layers hold {lengths}){how}")


def _passes(recorded: Record, n_layers: int, step: _Step) -> list[dict]:
    """The passes a step ran (a prompt in chunks is several), each its layers' records and the
    positions of its rows, in call order; a pass whose rows go past the step's last position
    (a draft's guess, rolled back afterwards) is left out."""
    last = step.positions[-1]
    passes = []
    for first in range(0, len(recorded.layers), n_layers):
        layers = recorded.layers[first:first + n_layers]
        if "q" not in layers[0]:
            continue
        n_rows = len(layers[0]["q"])
        start = layers[0].get("start")
        start = last - n_rows + 1 if start is None else start
        if start + n_rows - 1 > last or start < 0:
            continue
        positions = np.arange(start, start + n_rows)
        keys = layers[0].get("keys")
        if keys is None or len(keys) == 0 or keys.max() != positions[-1]:
            keys = (np.arange(positions[-1] + 1) if n_rows > len(step.positions)
                    or not layers[0].get("cached", True)
                    else step.keys[step.keys <= positions[-1]])
        passes.append({"layers": layers, "positions": positions, "keys": keys})
    return passes


def _computed_rows(passes: list[dict], layer: int) -> dict:
    """Position -> (k, v) rows before the rotation, as this step's passes computed them."""
    rows = {}
    for run in passes:
        if layer < len(run["layers"]) and "k" in run["layers"][layer]:
            got = run["layers"][layer]
            for i, position in enumerate(run["positions"]):
                rows[int(position)] = (got["k"][i], got["v"][i])
    return rows


def _compare_rows(reference: _Reference, held: dict, rows: list[int], before: dict, layer: int,
                  computed: dict, comparer: _Comparer, step: _Step):
    """The first of `rows` (positions) of one layer of the cache that changed since before the
    step, or that differs from what recomputation computes for its position."""
    config = reference.params.config
    limit = 2 * (max(held) + 1) + 2 if held else 2
    for position in rows:
        key, value = held[position]
        old = before.get(position)
        if old is not None:
            changed = comparer.gap("an earlier cache row", np.concatenate([key, value]),
                                   np.concatenate(old))
            if changed is not None:
                return Divergence(step.number, layer, None, position, "an earlier cache row",
                                  changed.difference, _overwritten_reading(
                                      reference, layer, position, key, step, comparer),
                                  relative=changed.relative)
        for kind, row, want in (("k", key, reference.keys[layer]),
                                ("v", value, reference.values[layer])):
            gap = comparer.gap(f"cached {kind}", row[None], want[position:position + 1])
            if gap is not None:
                reading, given = _cached_row_reading(reference, kind, layer, position, row,
                                                     computed, comparer, limit)
                head = _worst_head(row[None], want[position:position + 1], config.kv_heads)
                return Divergence(step.number, layer, head, position, f"cached {kind}",
                                  gap.difference, reading, given, gap.relative)
        if layer == 0:
            reference.right_in_layer_zero.add(position)
    return None


def _overwritten_reading(reference, layer, position, key, step: _Step, comparer) -> str:
    """An earlier row that changed during the step: with whose key, if the locator knows."""
    new = step.positions[-1]
    if comparer.equal(key[None], reference.keys[layer][new:new + 1]):
        return (f"the step wrote the new token's row (position {new}) over position "
                f"{position}: its write offset is off (an overwritten, stale row)")
    return ("the step wrote over a row of an earlier position: its write offset is off (an "
            "overwritten, stale row)")


def _rows_gap(comparer, quantity, got, want, rows_axis, positions):
    """A gap, and the position of its first differing row."""
    gap = comparer.gap(quantity, got, want, rows_axis)
    if gap is None:
        return None, None
    return gap, None if gap.row is None else int(positions[gap.row])


def _compare_layer_pass(reference: _Reference, run: dict, layer: int, comparer: _Comparer,
                        step: _Step):
    """The first difference of one layer of one pass of the cached run from the reference, in
    the order a token meets them: q, k, v before the rotation; q and k as attention read them;
    the weights; v as read; the attention output; the block's output."""
    config = reference.params.config
    got, want = run["layers"][layer], reference.layers[layer]
    positions, keys = run["positions"], run["keys"]
    span = slice(int(positions[0]), int(positions[-1]) + 1)

    def found(quantity, gap, position, head, reading, given=None):
        return Divergence(step.number, layer, head, position, quantity, gap.difference,
                          _not_a_number(gap, reading) if gap.not_a_number else reading,
                          given, gap.relative)

    for name, label, heads in (("q", "q (before the rotation)", config.n_heads),
                               ("k", "k (before the rotation)", config.kv_heads),
                               ("v", "v", config.kv_heads)):
        if name in got:
            gap, position = _rows_gap(comparer, label, got[name], want[name][span], 0, positions)
            if gap is not None:
                return found(label, gap, position, _worst_head(got[name], want[name][span],
                             heads), _input_reading(run, layer))
    if _same_shape(got.get("q_read"), want["q_read"][:, span]):
        gap, position = _rows_gap(comparer, "q as attention reads it", got["q_read"],
                                  want["q_read"][:, span], 1, positions)
        if gap is not None:
            reading, given = _query_read_reading(reference, got, layer, positions, gap,
                                                 comparer)
            return found("q as attention reads it", gap, position,
                         _worst_head(got["q_read"], want["q_read"][:, span], config.n_heads),
                         reading, given)
    expected = _expanded(want["k_read"][:, keys], _heads(got.get("k_read")))
    if _same_shape(got.get("k_read"), expected):
        gap, position = _rows_gap(comparer, "k as attention reads it", got["k_read"], expected,
                                  1, keys)
        if gap is not None:
            return found("k as attention reads it", gap, position,
                         _worst_head(got["k_read"], expected, len(expected)),
                         _key_read_reading(reference, got["k_read"], want["k_read"][:, keys],
                                           keys, comparer))
    if "weights" in got:
        expected = want["weights"][:, span][:, :, keys]
        gap, position = _rows_gap(comparer, "attention weights", got["weights"], expected, 1,
                                  positions)
        if gap is not None:
            row = 0 if gap.row is None else gap.row
            reading = _weights_reading(got, expected, positions, keys, row, config, step.phase,
                                       want["q_read"][:, span], want["k_read"][:, keys])
            if gap.not_a_number == "run":
                reading = f"{NOT_A_NUMBER}: {reading}"
            return Divergence(step.number, layer,
                              _worst_head(got["weights"], expected, config.n_heads),
                              int(positions[row]), "attention weights", gap.difference,
                              reading, None, gap.relative)
    expected = _expanded(want["v_read"][:, keys], _heads(got.get("v_read")))
    if _same_shape(got.get("v_read"), expected):
        gap, position = _rows_gap(comparer, "v as attention reads it", got["v_read"], expected,
                                  1, keys)
        if gap is not None:
            return found("v as attention reads it", gap, position,
                         _worst_head(got["v_read"], expected, len(expected)),
                         _value_read_reading(reference, layer, got["v_read"],
                                             want["v_read"][:, keys], keys, comparer))
    if "attended" in got:
        gap, position = _rows_gap(comparer, "attention output", got["attended"],
                                  want["attended"][:, span], 1, positions)
        if gap is not None:
            return found("attention output", gap, position,
                         _worst_head(got["attended"], want["attended"][:, span],
                                     config.n_heads),
                         _attended_reading(got, want, span, keys))
    if "output" in got:
        gap, position = _rows_gap(comparer, "block output", got["output"], want["output"][span],
                                  0, positions)
        if gap is not None:
            return found("block output", gap, position, None,
                         "every cached row and the attention output agree, but the block's "
                         "output does not: the output projection, the MLP or the residual "
                         "differs")
    return None


def _input_reading(run: dict, layer: int) -> str:
    """Why q, k or v before the rotation differ: the token's input, or the layer before."""
    if layer == 0:
        return ("the step's input differs from the start: a wrong token, or a wrong row of the "
                "learned position table (positions off)")
    if "output" in run["layers"][layer - 1]:
        return ("the layer's q, k or v differ though the block before agreed: another layer's "
                "weights, or a layer skipped or run twice")
    return ("the layer's input differs, and the block before it was not watched (a block of "
            "your own, not kvlib.decoder_block?)")


def _query_read_reading(reference, got, layer, positions, gap, comparer):
    """(reading, given position) of q as attention read it, when q before the rotation agreed."""
    config = reference.params.config
    if config.positions == "rotary" and gap.row is not None and "q" in got:
        raw = got["q"][gap.row:gap.row + 1]
        turned = model.merge_heads(got["q_read"][:, gap.row:gap.row + 1])
        position = int(positions[gap.row])
        at = _rotated_for(reference.params, raw, turned, 2 * position + 2, comparer)
        if at is not None and at != position:
            return (f"positions off: the query of position {position} was rotated for position "
                    f"{at}"), at
    return ("q before the rotation agrees, but q as attention read it does not: the rotation "
            "differs (positions, pairing), or q is scaled"), None


def _attended_reading(got: dict, want: dict, span: slice, keys) -> str:
    """Why the attention output differs when the weights and the values read agree."""
    if "weights" in got and got["weights"].shape == want["weights"][:, span][:, :, keys].shape:
        below = float(np.abs(got["weights"] - want["weights"][:, span][:, :, keys]).max())
        if below > 0:
            return (f"the weights and the values read agree within the tolerance, yet their mix "
                    f"differs: weight differences under the tolerance (up to {below:.3g} here) "
                    "add up over the values, or the weighted sum pairs heads with the wrong "
                    "values")
    return ("the weights and the values read agree, yet their mix differs: the weighted sum "
            "pairs heads with the wrong values")


def _compare(reference: _Reference, recorded: Record, cache: BaseKVCache, comparer: _Comparer,
             step: _Step):
    """What a step did against the reference: every layer's length first; then pass by pass
    (in call order), layer by layer, the cache rows the pass reads (each row once: what was
    written, and that nothing earlier changed) and what the pass computed; then the rows no
    pass read."""
    n_layers = reference.params.config.n_layers
    found = _check_lengths(recorded, cache, step, n_layers)
    if found is not None:
        return found
    held = [_held_rows(cache, layer) for layer in range(n_layers)]
    checked = [set() for _ in range(n_layers)]
    passes = _passes(recorded, n_layers, step)
    computed = [_computed_rows(passes, layer) for layer in range(n_layers)]

    def rows_up_to(layer, last):
        rows = sorted(p for p in held[layer] if p <= last and p not in checked[layer])
        checked[layer].update(rows)
        return _compare_rows(reference, held[layer], rows, step.before[layer], layer,
                             computed[layer], comparer, step)

    for run in passes:
        for layer in range(min(n_layers, len(run["layers"]))):
            found = rows_up_to(layer, int(run["positions"][-1])) or \
                _compare_layer_pass(reference, run, layer, comparer, step)
            if found is not None:
                return found
    for layer in range(n_layers):
        found = rows_up_to(layer, math.inf)
        if found is not None:
            return found
    return None


def _compare_logits(logits, reference: _Reference, position: int, comparer: _Comparer,
                    step: int | None):
    """The logits of the row at position against recomputation's, once every layer agreed."""
    gap = comparer.gap("logits", np.asarray(logits).reshape(1, -1),
                       reference.logits[position:position + 1])
    if gap is None:
        return None
    reading = ("every layer and every cached row agrees but the logits do not: the final norm "
               "or the unembedding differs, or what the step does to the logits after them")
    return Divergence(step, None, None, position, "logits", gap.difference,
                      _not_a_number(gap, reading) if gap.not_a_number else reading,
                      relative=gap.relative)


def _greedy(params: Params, prompt_ids, n_new_tokens) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the prompt and its n_new_tokens greedy tokens): the reference run,
    by full recomputation (kvlib.generate checks that they fit the context)."""
    ids = [int(i) for i in as_token_ids(prompt_ids, as_params(params).config.vocab_size)]
    n_new_tokens = as_whole_number("n_new_tokens", n_new_tokens, 1)
    return ids, ids + inference.generate(params, ids, n_new_tokens, use_cache=False)


def _locate(params, prompt_ids, n_new_tokens, decode_step, prefill, cache, comparer):
    """The locator's run: the reference, the prefill and each decode step, compared in turn ->
    the first Divergence or None."""
    if as_params(params).config.latent_dim is not None:
        raise ValueError("first_divergence watches K/V heads; latent attention (the "
                         "latent_attention lesson) caches a latent instead")
    cache = make_cache(params.config) if cache is None else as_cache(cache, params.config)
    if len(cache) != 0:
        raise ValueError("cache must be an empty kvlib cache (kvlib.make_cache(config))")
    ids, tokens = _greedy(params, prompt_ids, n_new_tokens)
    reference = _Reference(params, tokens)
    n_layers = params.config.n_layers
    step = _Step(None, list(range(len(ids))), cache.key_positions(len(ids)),
                 [{} for _ in range(n_layers)], "prefill")
    with record() as recorded:
        try:
            logits, cache = prefill(params, ids, cache)
        except Exception as error:     # the learner's code: a crash is a finding too
            return Divergence(None, None, None, None, "an error", math.nan,
                              f"the prefill raised {type(error).__name__}: {error}")
    found = _compare(reference, recorded, cache, comparer, step) or \
        _compare_logits(np.asarray(logits)[-1:], reference, len(ids) - 1, comparer, None)
    for number in range(len(tokens) - len(ids) - 1):
        if found is not None:
            return found
        position = len(ids) + number
        step = _Step(number, [position], cache.key_positions(1),
                     [_held_rows(cache, layer) for layer in range(n_layers)], "decode")
        with record() as recorded:
            try:
                logits = decode_step(params, tokens[position], cache)
            except Exception as error:
                return Divergence(number, None, None, position, "an error", math.nan,
                                  f"the step raised {type(error).__name__}: {error}")
        found = _compare(reference, recorded, cache, comparer, step) or \
            _compare_logits(logits, reference, position, comparer, number)
    return found


def first_divergence(params: Params, prompt_ids, n_new_tokens: int,
                     decode_step=inference.decode_step, *, prefill=inference.prefill,
                     cache: BaseKVCache | None = None, tolerance: float | None = None
                     ) -> Divergence | None:
    """The first place where a cached generation parts from full recomputation
    (when_the_cache_is_wrong), or None when nothing parts.

    decode_step(params, token_id, cache) -> logits (1, V): kvlib.decode_step or a learner's
    own; prefill(params, ids, cache) -> (logits, cache): kvlib.prefill or a learner's own.
    cache: the empty cache to fill (by default the kind the model needs). tolerance: relative
    to the size of the numbers compared (DEFAULT_TOLERANCES by the params' dtype when None;
    in 16 bits, tolerance_for(format, model)). A NaN or inf where recomputation has a number
    always parts. The run is fed the reference's greedy tokens. Steps count from 0 after the
    prefill (None is the prefill), layers from 0.
    """
    params = as_params(params)
    tolerance = DEFAULT_TOLERANCES[params.config.dtype] if tolerance is None else \
        as_real_number("tolerance", tolerance, positive=True)
    return _locate(params, prompt_ids, n_new_tokens, decode_step, prefill, cache,
                   _Comparer(tolerance))


def largest_differences(params: Params, prompt_ids, n_new_tokens: int,
                        decode_step=inference.decode_step, *, prefill=inference.prefill
                        ) -> dict[str, float]:
    """How far a run comes from recomputation, quantity by quantity, with no tolerance at all
    (when_the_cache_is_wrong): quantity -> the largest difference over the size of the numbers
    compared, over every step. For a right loop, what a tolerance must stay above
    (tools/measure_tolerances.py). A run that parts whatever the tolerance (NaN, a shape, the
    cache's length, an error) raises a ValueError that says where."""
    comparer = _Comparer(math.inf)
    found = _locate(as_params(params), prompt_ids, n_new_tokens, decode_step, prefill, None,
                    comparer)
    if found is not None:
        raise ValueError(f"this run parts from recomputation whatever the tolerance: {found}")
    return dict(comparer.largest)


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


__all__ = ["DEFAULT_TOLERANCES", "Divergence", "NOT_A_NUMBER", "Record", "first_divergence",
           "largest_differences", "logit_differences", "measured_tolerances", "record",
           "rows_computed", "tolerance_for"]
