"""Exercises of the latent_attention lesson (multi-head latent attention): checkers and solutions.

1. Bytes per token of a latent-attention model described in words (a transfer of the
   DeepSeek numbers to other shapes).
2. One head's absorbed scores against the cached latents, written as a function. The checker
   runs it on the lesson's shapes (latent wider than a head) and on a model whose latent is
   exactly one head wide, where a forgotten transpose still runs and can be told apart; it
   watches the latents and W_up_k, so that right scores reached by rebuilding the keys (what
   the exercise asks to avoid) are told apart too.
3. Why the rotary key cannot be absorbed (a choice).
"""

from __future__ import annotations

import math
import re

import numpy as np

import kvlib
from kvlib.flops import plain_arrays
from kvlib.memory import kv_cache_bytes, latent_cache_bytes

from .base import (
    Feedback,
    checker,
    read_array,
    read_choice,
    read_function,
    read_number,
    read_whole_number,
    show_solution,
)

# Exercise 1: an imagined model with latent attention, cache in BF16
EXERCISE1 = {"n_layers": 40, "n_heads": 32, "head_dim": 128, "latent_dim": 512,
             "rope_head_dim": 64, "dtype_bytes": 2}

# Exercise 2: the lesson's model (latent_attention), and one whose latent is exactly one head wide
LESSON_CONFIG = kvlib.ModelConfig(d_model=32, n_heads=8, d_ff=64, latent_dim=8,
                                  rope_head_dim=2, positions="rotary")
SQUARE_CONFIG = kvlib.ModelConfig(d_model=8, n_heads=2, d_ff=16, latent_dim=4,
                                  rope_head_dim=2, positions="rotary")
SIGNATURE = "head_scores(layer, head, q_head, q_rope_head, latents, rope_keys)"

# Exercise 3: the choices
CHOICES = {
    "a": "The rotation is not a linear map, so it cannot be folded into a matrix.",
    "b": "The rotation that sits between q and W_up_k depends on the key's position, so the "
         "matrix to absorb would be different for every cached token.",
    "c": "A rotated key would be wider than the latent, so the cache would grow.",
    "d": "The query is rotated too, and the two rotations cancel, so the positions would be "
         "lost.",
}
RIGHT_CHOICE = "b"
WRONG_CHOICES = {
    "a": "A rotation is linear: it is a matrix (notebook 14 turns pairs of columns with cos "
         "and sin). The trouble is which matrix: it is a different one at every position.",
    "c": "A rotation keeps the width (and the length) of what it turns. Nothing would get "
         "wider; the trouble is that the rotation depends on the key's position.",
    "d": "The two rotations do not cancel: they combine into one rotation by the distance "
         "between the two positions (that is how RoPE encodes it). That rotation depends on "
         "the key's position, so it cannot be folded into one matrix for every key.",
}


# Exercise 1 ------------------------------------------------------------------------------

@checker
def check_latent_bytes_per_token(answer) -> Feedback:
    """Exercise 1: bytes one token adds to the cache of a 40-layer latent-attention model
    (32 heads of 128, latent 512, rotary key 64), in BF16."""
    value = read_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    e = EXERCISE1
    layers, dc, dr, h, dtype_bytes = (e["n_layers"], e["latent_dim"], e["rope_head_dim"],
                                      e["n_heads"], e["dtype_bytes"])
    expected = latent_cache_bytes(layers, dc, dr, 1, dtype_bytes=dtype_bytes)
    mha = kv_cache_bytes(layers, None, 1, dtype_bytes=dtype_bytes, n_kv_heads=h,
                         head_dim=e["head_dim"])
    if value == expected:
        return Feedback(True, f"{expected:,} bytes a token: 40 layers x (512 + 64) numbers x 2 "
                        f"bytes, {mha / expected:.1f} times less than the {mha:,} bytes of "
                        "K and V for all 32 heads.")
    diagnoses = [
        (expected * 2, "twice the answer. One latent serves as keys and as values: there is "
                       "no factor 2 for K and V (and BF16 takes 2 bytes a number, not 4)."),
        (layers * dc * dtype_bytes, "the rotary key is missing: its 64 numbers are cached "
                                    "beside the 512 of the latent."),
        (layers * (dc + h * dr) * dtype_bytes, "that caches a rotary key per head. The "
                                               "cached rotary key is one for all heads; the "
                                               "per-head rotary parts are on the query side, "
                                               "computed fresh at every step."),
        (expected // layers, "that is one layer; every one of the 40 layers has its own "
                             "latent."),
        (mha, "that is multi-head attention: K and V for each of the 32 heads. Latent "
              "attention caches one latent and one rotary key a token and layer."),
        (layers * h * (2 * e["head_dim"] + dr) * dtype_bytes,
         "that caches the rebuilt keys (with their rotary part) and values of all 32 heads, "
         "as an engine that rebuilds K and V and then caches them would. Latent attention "
         "caches the latent they are rebuilt from."),
        (expected * 8, "that counts bits, not bytes: BF16 is 2 bytes a number."),
        (expected // dtype_bytes, "that counts numbers; each takes 2 bytes in BF16."),
        (expected * h, "that caches a latent for every head. The latent is one per token and "
                       "layer, shared by all 32 heads: that is where the saving comes from."),
        (expected / 1024, "that is in KiB; the exercise asks for bytes."),
    ]
    for wrong, message in diagnoses:
        if math.isclose(value, wrong):
            return Feedback(False, message)
    if not value.is_integer():                    # bytes are whole
        return read_whole_number(value, "a number of bytes", expected=expected)
    return Feedback(False, f"not {value:,.0f}. Multiply layers x (latent size + rotary key "
                    "size) x bytes a number: there is no factor 2 and no head count.")


# Exercise 2 ------------------------------------------------------------------------------

def expected_head_scores(layer, head, q_head, q_rope_head, latents, rope_keys) -> np.ndarray:
    """The scores the exercise asks for: one head's query moved into the latent's space,
    scored against every cached latent, plus the rotary part, scaled: (S,)."""
    dh, dr = len(q_head), len(q_rope_head)
    block = layer.W_up_k[:, head * dh:(head + 1) * dh]            # (dc, dh)
    absorbed = q_head @ block.T                                    # (dc,)
    return (latents @ absorbed + rope_keys @ q_rope_head) / math.sqrt(dh + dr)


def _case(config: kvlib.ModelConfig, seed: int, n_positions: int = 6):
    """A layer of the config and seeded inputs for one head: what the checker passes."""
    params = kvlib.init_params(config, seed=seed)
    rng = np.random.default_rng(seed)
    dh, dc, dr = config.head_dim, config.latent_dim, config.rope_head_dim
    return (params.layers[0], rng.standard_normal(dh), rng.standard_normal(dr),
            rng.standard_normal((n_positions, dc)), rng.standard_normal((n_positions, dr)))


def _wrong_variants(layer, head, q_head, q_rope_head, latents, rope_keys, n_heads):
    """Typical slips, each with what to say: (scores, diagnosis)."""
    dh, dr, dc = len(q_head), len(q_rope_head), latents.shape[1]
    right = expected_head_scores(layer, head, q_head, q_rope_head, latents, rope_keys)
    content = latents @ (q_head @ layer.W_up_k[:, head * dh:(head + 1) * dh].T)
    rope = rope_keys @ q_rope_head
    variants = []
    if dc == dh:   # only here does a forgotten transpose give numbers instead of an error
        forgot = latents @ (q_head @ layer.W_up_k[:, head * dh:(head + 1) * dh])
        variants.append(((forgot + rope) / math.sqrt(dh + dr),
                         "the transpose of W_up_k's block is missing. A head's keys are "
                         "latents @ block, with block (dc, dh); so q . k = (q @ block.T) . "
                         "latent: the absorbed query is q_head @ block.T, of dc numbers."))
    values = expected_head_scores(kvlib.LatentLayerParams(
        **(layer.arrays() | {"W_up_k": layer.W_up_v})), head, q_head, q_rope_head, latents,
        rope_keys)
    variants += [
        (values, "that uses W_up_v, the values' up-projection. Scores compare queries with "
                 "keys: absorb the query through W_up_k. W_up_v comes after the weighted sum."),
        (content / math.sqrt(dh + dr), "the rotary part is missing: add rope_keys @ "
                                       "q_rope_head, the score of the positions."),
        (content + rope, "not scaled: divide by sqrt(dh + dr), the width of a whole query "
                         "(content and rotary part)."),
        ((content + rope) / math.sqrt(dh), "scaled by 1 / sqrt(dh) only: a query is dh + dr "
                                           "numbers wide (content and rotary part), so divide "
                                           "by sqrt(dh + dr)."),
        (content / math.sqrt(dh) + rope / math.sqrt(dr), "each part scaled on its own: the "
                                                         "two parts are one query of dh + dr "
                                                         "numbers; divide their sum by "
                                                         "sqrt(dh + dr)."),
        (content / math.sqrt(dh + dr) + rope, "only the content part is scaled: divide the "
                                              "whole sum by sqrt(dh + dr)."),
        (kvlib.softmax(right), "those are attention weights (after the softmax); the exercise "
                               "asks for the scores before it."),
    ]
    if dc != dh:
        variants.append(((content + rope) / math.sqrt(dc + dr),
                         "scaled by 1 / sqrt(dc + dr), the width of the absorbed query. The "
                         "scores must equal those of the rebuilt keys, which are dh + dr wide: "
                         "divide by sqrt(dh + dr)."))
    for other in {0, (head + 1) % n_heads, head - 1} - {head}:
        if 0 <= other < n_heads:
            variants.append((expected_head_scores(layer, other, q_head, q_rope_head, latents,
                                                  rope_keys),
                             f"those are head {other}'s scores. Head {head} owns columns "
                             f"{head} x dh to ({head} + 1) x dh - 1 of W_up_k."))
    return variants


class _Watched(np.ndarray):
    """An array that shows every array computed from it to KeyWatch.current: the checker
    passes the latents and W_up_k as _Watched, so that a rebuilt key (latents @ block, or
    one latent @ block) is seen, however the student's code computes it (@, np.dot,
    np.einsum, a loop). Results stay _Watched, so that what is computed from them is seen
    too; the values are numpy's own."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = _plain(kwargs["out"])
        return _seen(getattr(ufunc, method)(*_plain(inputs), **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return _seen(func(*_plain(args), **_plain(kwargs)))


def _plain(value):
    """value with every _Watched array inside it (lists, tuples, dicts) as a plain one."""
    return plain_arrays(value, _Watched)


def _seen(result):
    """Show a result to the current KeyWatch; arrays go on being watched."""
    if isinstance(result, tuple):
        return tuple(_seen(item) for item in result)
    if not isinstance(result, np.ndarray):
        return result
    if KeyWatch.current is not None:
        KeyWatch.current.look(result)
    return result.view(_Watched)


class KeyWatch:
    """Notes whether any array computed in a call holds a rebuilt key: a vector parallel to
    one of the keys latents @ W_up_k (so a scaled key counts too), as a row or a column."""

    current: KeyWatch | None = None

    def __init__(self, latents: np.ndarray, W_up_k: np.ndarray, head_dim: int):
        self.head_dim = head_dim
        self.keys = (latents @ W_up_k).reshape(-1, head_dim)       # (S x h, dh), every head
        self.rebuilt = False

    def look(self, array: np.ndarray) -> None:
        if self.rebuilt or array.dtype.kind != "f" or array.size < self.head_dim:
            return
        array, dh = array.view(np.ndarray), self.head_dim      # plain: no watching itself
        if array.shape[-1] % dh == 0:
            self._compare(array.reshape(-1, dh))
        if array.ndim == 2 and array.shape[0] == dh:
            self._compare(array.T)

    def _compare(self, vectors: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            dots = np.abs(vectors @ self.keys.T)
            norms = np.linalg.norm(vectors, axis=1)[:, None] * np.linalg.norm(self.keys, axis=1)
            parallel = (norms > 0) & (np.abs(dots - norms) <= 1e-9 * norms)
        self.rebuilt = self.rebuilt or bool(parallel.any())


def _call(function, layer, head, q_head, q_rope_head, latents, rope_keys):
    """(scores as a flat float array, None, whether the function rebuilt a key) or (None,
    Feedback, False) for a failed call."""
    watch = KeyWatch(latents, layer.W_up_k, len(q_head))
    watched = kvlib.LatentLayerParams(**(layer.arrays() |
                                         {"W_up_k": layer.W_up_k.copy().view(_Watched)}))
    inputs = (q_head.copy(), q_rope_head.copy(), latents.copy().view(_Watched),
              rope_keys.copy())
    KeyWatch.current = watch
    try:
        result = function(watched, head, *inputs)
    except Exception as error:   # noqa: BLE001 - whatever a student's code raises is reported
        message = f"your function raised {type(error).__name__}: {error}"
        if isinstance(error, TypeError) and "argument" in str(error):
            message += f". It should take six arguments: {SIGNATURE}."
        return None, Feedback(False, message), False
    finally:
        KeyWatch.current = None
    if result is None:
        return None, Feedback(False, "your function returned None: fill in its body and "
                              "return the scores."), False
    scores = read_array(_plain(result), "your function's result")
    if isinstance(scores, Feedback):            # text, complex numbers, ragged lists, objects
        return None, Feedback(False, f"{scores.message} It should return one score per cached "
                              "position."), False
    scores = scores.astype(np.float64)
    n = latents.shape[0]
    if scores.shape in {(1, n), (n, 1)}:
        scores = scores.reshape(n)
    if scores.shape != (n,):
        return None, Feedback(False, f"your function should return {n} scores, one per cached "
                              f"position, shape ({n},); got shape {scores.shape}."), False
    if not np.isfinite(scores).all():
        return None, Feedback(False, "your function returned NaN or infinite scores."), False
    return scores, None, watch.rebuilt


def _diagnose(function, config: kvlib.ModelConfig, heads, seed: int):
    """How the function does on every head of one case: ("right", None), or ("raised",
    "wrong output", "known slip", "wrong values" or "rebuilt", Feedback)."""
    layer, q_head, q_rope_head, latents, rope_keys = _case(config, seed)
    for head in heads:
        scores, failed, rebuilt = _call(function, layer, head, q_head, q_rope_head, latents,
                                        rope_keys)
        if failed is not None:
            raised = failed.message.startswith("your function raised")
            return ("raised" if raised else "wrong output"), failed
        args = (layer, head, q_head, q_rope_head, latents, rope_keys)
        if np.allclose(scores, expected_head_scores(*args), rtol=1e-6, atol=1e-9):
            if rebuilt:
                return "rebuilt", Feedback(
                    False, f"head {head}'s scores are right, but your function rebuilt its "
                    "keys from the latents (latents @ block, dh numbers a cached position), "
                    "which the exercise asks you to avoid. Move the query instead: q_head @ "
                    "block.T is dc numbers, the query in the latent's space; score it against "
                    "every latent. No key is ever formed.")
            continue
        for wrong, message in _wrong_variants(*args, config.n_heads):
            if np.allclose(scores, wrong, rtol=1e-6, atol=1e-9):
                return "known slip", Feedback(False, message)
        return "wrong values", Feedback(
            False, f"head {head}'s scores are not right. Take head {head}'s block of W_up_k "
            "(dc, dh), absorb the query (q_head @ block.T, dc numbers), score it against "
            "every latent, add rope_keys @ q_rope_head, divide by sqrt(dh + dr).")
    return "right", None


@checker
def check_head_scores(answer) -> Feedback:
    """Exercise 2: a function head_scores(layer, head, q_head, q_rope_head, latents,
    rope_keys) -> (S,): one head's absorbed scores against the cached latents."""
    refused = read_function(answer, "head_scores")
    if refused is not None:
        return refused
    outcome, feedback = _diagnose(answer, LESSON_CONFIG, heads=(1, 6), seed=15)
    square_outcome, square_feedback = _diagnose(answer, SQUARE_CONFIG, heads=(1,), seed=16)
    if outcome == "rebuilt":
        return feedback
    if outcome == "right":
        if square_outcome == "right":
            return Feedback(True, "right for every head tried, on the lesson's shapes (latent "
                            "of 8, heads of 4) and on a latent one head wide. A decode step "
                            "does this for every head without ever rebuilding a key.")
        return square_feedback
    # A latent exactly one head wide lets a forgotten transpose run: its diagnosis is the
    # most precise one when the lesson's shapes made the function fail.
    if outcome == "raised" and square_outcome == "known slip":
        return square_feedback
    if outcome == "raised" and re.search(r"mismatch|shapes|aligned|broadcast",
                                         feedback.message):
        return Feedback(False, f"{feedback.message}. Check the shapes: q_head is (dh,), the "
                        "head's block of W_up_k is (dc, dh), so the absorbed query is q_head @ "
                        "block.T, (dc,), and latents (S, dc) @ it gives (S,).")
    return feedback


# Exercise 3 ------------------------------------------------------------------------------

@checker
def check_why_rope_is_not_absorbed(answer) -> Feedback:
    """Exercise 3: why can the rotary part not be absorbed into the query? One letter."""
    choice = read_choice(answer, CHOICES)
    if isinstance(choice, Feedback):
        return choice
    if choice == RIGHT_CHOICE:
        return Feedback(True, "b. The query at position m is turned by m's angles, the key at "
                        "n by n's; in their dot product q meets the latent through W_up_k and "
                        "a rotation by n - m, a different matrix for every cached position n. "
                        "So DeepSeek leaves the content part unrotated (it absorbs) and adds a "
                        "small rotated key, cached as it is.")
    return Feedback(False, f"not {choice}. {WRONG_CHOICES[choice]}")


SOLUTIONS = {
    1: """
answer = 40 * (512 + 64) * 2   # layers x (latent + rotary key) x BF16 bytes: no factor 2
""",
    2: """
def head_scores(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    block = layer.W_up_k[:, head * dh:(head + 1) * dh]   # (dc, dh): this head's keys
    absorbed = q_head @ block.T                          # (dc,): the query in latent space
    return (latents @ absorbed + rope_keys @ q_rope_head) / math.sqrt(dh + dr)

answer = head_scores
""",
    3: """
answer = "b"
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)

