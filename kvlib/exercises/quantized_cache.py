"""Exercises of the quantized_cache lesson (the quantized KV cache): checkers and solutions.

1. Quantize a row by hand to int8, symmetric: scale = max|x| / 127, codes = round(x / scale)
   (a), then a second row with the same, fixed scale, where clipping matters (b). The
   checkers name the usual slips: dividing by 128 or 255, int() truncation, max(x) instead
   of max|x|, forgetting to clip, the int8 wrap-around of astype without a clip.
2. Bytes per token of a quantized cache with its scales, for another model (Llama-2-70B).
3. A prediction before running: which grouping suits keys with one huge channel?
4. Find the bug: a "per token" round trip that groups the wrong way.
"""

from __future__ import annotations

import math
from functools import lru_cache
from numbers import Real

import numpy as np

from kvlib.memory import PRESETS
from kvlib.serving.quantized import PerChannel, PerToken, bytes_per_token

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    not_filled_in,
    read_array,
    read_choice,
    read_number,
    read_whole_number,
    show_solution,
)

# Exercise 1 ------------------------------------------------------------------------------

ROW = np.array([0.5, -2.54, 1.013, 0.333, -0.777, 2.0, -0.061, 0.129])
"""The row of exercise 1a: its largest number in size is negative, -2.54."""
NEXT_ROW = np.array([0.3, 2.9, -0.456, -3.1, 0.02, 1.234, -0.5, 0.751])
"""The row of exercise 1b, quantized with ROW's scale: two of its numbers lie beyond it."""
INT8_MAX = 127


def row_scale(row: np.ndarray = ROW) -> float:
    """The symmetric int8 scale of a row: max|x| / 127 (0.02 for ROW)."""
    return float(np.max(np.abs(row)) / INT8_MAX)


def row_codes(row: np.ndarray, scale: float) -> np.ndarray:
    """round(row / scale), clipped to -127 .. 127: the int8 codes (int64 here)."""
    return np.clip(np.rint(row / scale), -INT8_MAX, INT8_MAX).astype(np.int64)


def _wrapped(values: np.ndarray) -> np.ndarray:
    """What astype(np.int8) makes of whole numbers outside -128 .. 127: they wrap around."""
    return ((values.astype(np.int64) + 128) % 256) - 128


def _row_mistakes(row: np.ndarray, scale: float, first_row: bool
                  ) -> list[tuple[np.ndarray, str]]:
    """The usual wrong codes for a row quantized with scale, each with what to say."""
    ratio = row / scale
    largest = float(np.max(np.abs(ROW)))
    right = row_codes(row, scale)
    mistakes = []
    if not first_row:
        unclipped = np.rint(ratio)
        mistakes += [
            (unclipped, f"the codes {_outside(unclipped)} lie outside -127 .. 127: int8 "
                        "cannot hold them. Clip, np.clip(codes, -127, 127): a number beyond "
                        "the scale's range is stored at the largest code (it saturates)."),
            (_wrapped(unclipped), f"astype(np.int8) without a clip wrapped "
                                  f"{_outside(unclipped)} around to "
                                  f"{_outside(unclipped, _wrapped(unclipped))}: a huge key "
                                  "became a negative one. Clip to -127 .. 127 first."),
            (np.clip(unclipped, -128, 127), "clipped to int8's whole range, -128 .. 127. "
                                            "Symmetric codes stop at -127, so that the "
                                            "negatives mirror the positives: clip to "
                                            "-127 .. 127."),
            (row_codes(row, row_scale(row)), "that quantizes the new row with its own scale "
                                             "(max|new row| / 127). The exercise keeps the "
                                             f"first row's scale, {scale:.2f}, as a cache with "
                                             "a fixed, calibrated scale does."),
            (row_codes(ROW, scale), "those are the codes of the first row, ROW; quantize "
                                    "NEXT_ROW with its scale."),
            (np.trunc(ratio), "int() and astype(int) cut the fraction off (towards zero: "
                              f"{_example(ratio, np.trunc)}), and the codes outside -127 .. "
                              "127 are not clipped either. Round to the nearest whole number "
                              "(np.rint), then clip."),
        ]
    mistakes += [
        (np.clip(np.trunc(ratio), -127, 127), "int() and astype(int) cut the fraction off, "
                                              f"towards zero: {_example(ratio, np.trunc)}. "
                                              "Round to the nearest whole number: np.rint "
                                              "or np.round."),
        (np.clip(np.floor(ratio), -127, 127), f"np.floor rounds down: "
                                              f"{_example(ratio, np.floor)}. Round to the "
                                              "nearest whole number: np.rint or np.round."),
    ]
    if first_row:
        by_128, by_255, by_max_x = largest / 128, largest / 255, float(np.max(ROW)) / 127
        mistakes += [
            (np.rint(row / by_128), "that divides max|x| by 128: the largest number then gets "
                                    "the code -128, and the others are a little too large. "
                                    "Symmetric int8 codes run from -127 to 127: scale = "
                                    "max|x| / 127."),
            (np.clip(np.rint(row / by_128), -127, 127), "that divides max|x| by 128 (and "
                                                        "clips): scale = max|x| / 127, so "
                                                        "that max|x| lands exactly on 127."),
            (np.rint(row / by_255), "that divides by 255, the number of steps of unsigned "
                                    "8-bit codes (0 .. 255). Symmetric codes have 127 on "
                                    "each side of 0: scale = max|x| / 127."),
            (np.clip(np.rint(row / by_255), -127, 127), "that divides by 255 and clips: half "
                                                        "the numbers saturate. Symmetric "
                                                        "codes use 127 on each side of 0: "
                                                        "scale = max|x| / 127."),
            (_wrapped(np.rint(row / by_255)), "that divides by 255, and astype(np.int8) then "
                                              "wrapped the codes beyond 127 around. Scale = "
                                              "max|x| / 127."),
            (np.rint((row - row.min()) / (row.max() - row.min()) * 255),
             "that is asymmetric (min-max) quantization to 0 .. 255. The exercise asks for "
             "symmetric codes: scale = max|x| / 127, codes = round(x / scale)."),
            (np.rint(row / by_max_x), "max(x) is 2.0, but the largest number in size is "
                                      "-2.54: the scale comes from max|x|, np.abs(row).max(), "
                                      "or -2.54 needs a code beyond -127."),
            (np.clip(np.rint(row / by_max_x), -127, 127), "the scale comes from max(x) = 2.0; "
                                                          "the largest number in size is "
                                                          "-2.54. Use np.abs(row).max()."),
            (np.rint(row / largest), "that divides by max|x| itself: every code is then -1, "
                                     "0 or 1. The scale is max|x| / 127."),
        ]
    return [(wrong, message) for wrong, message in mistakes if not np.array_equal(wrong, right)]


def _example(ratio: np.ndarray, rounding) -> str:
    """One number that rounding sends elsewhere than np.rint: 'x / scale = 16.65 becomes 16,
    not 17'."""
    differs = np.flatnonzero(rounding(ratio) != np.rint(ratio))
    if not len(differs):
        return "it keeps every code here, but not in general"
    i = differs[0]
    return (f"x / scale = {ratio[i]:.2f} becomes {rounding(ratio[i]):.0f}, not "
            f"{np.rint(ratio[i]):.0f}")


def _outside(values: np.ndarray, shown: np.ndarray | None = None) -> str:
    where = np.abs(values) > INT8_MAX
    chosen = values if shown is None else shown
    return " and ".join(str(int(v)) for v in chosen[where])


def _codes_answer(answer, name: str) -> np.ndarray | Feedback:
    """A student's codes as a float array of shape (8,), or a Feedback."""
    if is_missing(answer):
        return not_filled_in(name, "the 8 codes, for example np.rint(...)")
    if isinstance(answer, Real) and not isinstance(answer, bool):
        return Feedback(False, f"{name} should be 8 codes, one per number of the row, got one "
                        "number. (The scale is a step on the way: the codes are round(x / "
                        "scale).)")
    array = read_array(answer, name, (8,), booleans=True)
    if isinstance(array, Feedback):
        return array
    if array.dtype == np.bool_:
        return Feedback(False, f"{name} should hold whole-number codes, got True/False values.")
    if array.size == 8 and array.ndim == 2:
        array = array.reshape(8)
    if array.shape != (8,):
        return Feedback(False, f"{name} should be 8 codes, one per number of the row, got "
                        f"shape {array.shape}.")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        return Feedback(False, f"{name} holds NaN or infinite values: the codes are whole "
                        "numbers between -127 and 127.")
    return array


def _check_row(answer, name: str, row: np.ndarray, scale: float, first_row: bool) -> Feedback:
    codes = _codes_answer(answer, name)
    if isinstance(codes, Feedback):
        return codes
    right = row_codes(row, scale)
    if np.array_equal(codes, right):
        return None
    if np.allclose(codes, right * scale, atol=1e-6):
        return Feedback(False, f"those are the numbers read back, codes x scale; {name} "
                        "should be the codes themselves, the whole numbers stored in int8.")
    if np.allclose(codes, row / scale, atol=1e-6):
        return Feedback(False, "that is x / scale, not yet rounded: the codes are whole "
                        "numbers, np.rint(x / scale).")
    for wrong, message in _row_mistakes(row, scale, first_row):
        if np.allclose(codes, wrong, atol=1e-9):
            return Feedback(False, message)
    if not np.allclose(codes, np.rint(codes), atol=1e-9):
        return Feedback(False, f"{name} should be whole numbers (the int8 codes); "
                        f"{np.round(codes, 3).tolist()} are not.")
    differs = int(np.argmax(codes != right))
    return Feedback(False, f"the code of number {differs} ({row[differs]}) is "
                    f"{codes[differs]:g}. Codes are round(x / scale) with scale = "
                    f"{'max|x| / 127' if first_row else 'the first row' + chr(39) + 's scale'}"
                    f" = {scale:.4f}" + ("." if first_row else ", clipped to -127 .. 127."))


@checker
def check_codes(answer) -> Feedback:
    """Exercise 1a: the int8 codes of ROW, symmetric, scale = max|x| / 127."""
    failed = _check_row(answer, "codes", ROW, row_scale(), first_row=True)
    if failed is not None:
        return failed
    codes = row_codes(ROW, row_scale())
    error = np.abs(codes * row_scale() - ROW).max()
    return Feedback(True, f"{codes.tolist()}: scale 2.54 / 127 = {row_scale():.2f}, and every "
                    f"number read back is within half a step ({row_scale() / 2:.2f}) of itself "
                    f"(here at most {error:.4f}). 8 bytes and one scale instead of 8 floats.")


@checker
def check_codes_with_fixed_scale(answer) -> Feedback:
    """Exercise 1b: NEXT_ROW quantized with ROW's scale: round, then clip to -127 .. 127."""
    failed = _check_row(answer, "codes_next", NEXT_ROW, row_scale(), first_row=False)
    if failed is not None:
        return failed
    codes = row_codes(NEXT_ROW, row_scale())
    return Feedback(True, f"{codes.tolist()}: 2.9 and -3.1 lie beyond 127 steps of "
                    f"{row_scale():.2f} and saturate at 127 and -127 (read back as "
                    f"{127 * row_scale():.2f} and {-127 * row_scale():.2f}). That is the "
                    "risk of a fixed scale, and why a per-token cache gives every row its own.")


# Exercise 2 ------------------------------------------------------------------------------

EXERCISE2_MODEL = "Llama-2-70B"
"""Not a model of the lesson's table: Llama-3-8B's figure, with rows as wide (8 x 128),
would give the answer times 32 / 80, so the notebook's table shows Llama-2-7B instead."""
EXERCISE2_KEYS = PerChannel(bits=4, group_size=32)
EXERCISE2_VALUES = PerToken(bits=4)


def exercise2_shapes() -> tuple[int, int]:
    """(layers, width of a cached row) of the exercise's model: 32 and 8 x 128."""
    model = PRESETS[EXERCISE2_MODEL]
    return model.n_layers, model.n_kv_heads * model.head_dim


def expected_bytes_per_token() -> int:
    layers, width = exercise2_shapes()
    return int(bytes_per_token(layers, width, EXERCISE2_KEYS, EXERCISE2_VALUES))


def _bytes_mistakes() -> list[tuple[float, str]]:
    layers, width = exercise2_shapes()
    model = PRESETS[EXERCISE2_MODEL]
    codes = width // 2                                   # int4: two codes a byte
    key_scales, value_scale = 2 * width / 32, 2
    right = layers * (codes + key_scales + codes + value_scale)
    heads = model.n_heads * model.head_dim
    return [
        (layers * 2 * codes, "that leaves the scales out: the keys' float16 scales (one per "
                             "channel for every 32 tokens) and the values' (one per row) "
                             "are stored too."),
        (layers * 2 * (codes + 2), "that gives the keys one scale per row. Here the keys are "
                                   "quantized per channel: 1024 float16 scales for every 32 "
                                   "tokens, 2 x 1024 / 32 = 64 bytes a token."),
        (layers * (codes + 2 * width + codes + value_scale),
         "that stores 1024 key scales for every token. A group of 32 tokens shares them: "
         "2 x 1024 / 32 = 64 bytes a token."),
        (model.kv_bytes_per_token(), "that is the float16 cache without quantization, 2 bytes "
                                     "a number."),
        (layers * (width + key_scales + width + value_scale),
         "that counts one byte per int4 code: two 4-bit codes share a byte, so a row of 1024 "
         "codes is 512 bytes."),
        (right / layers, f"that is one layer; each of the {layers} layers caches its own K "
                         "and V."),
        (layers * (codes + key_scales), "that is the keys only; the values are cached too."),
        (layers * (codes + value_scale), "that is the values only; the keys are cached too."),
        (right * 8, "that counts bits; the answer is in bytes."),
        (layers * (codes + 2 * key_scales + codes + 2 * value_scale),
         "that stores the scales in float32 (4 bytes); they are float16, 2 bytes each."),
        (layers * ((heads // 2 + 2 * heads / 32) + (heads // 2 + 2)),
         f"that caches all {model.n_heads} query heads; {EXERCISE2_MODEL} has "
         f"{model.n_kv_heads} K/V heads (GQA), so a row is {model.n_kv_heads} x "
         f"{model.head_dim} = {width} numbers."),
        (right / 1024, "that is in KiB; the answer is in bytes."),
        (right / layers * 32, "that is the figure for 32 layers, Llama-3-8B's count (its rows "
                              f"are as wide); {EXERCISE2_MODEL} has {layers}."),
        (layers * (codes + key_scales + codes + 2 * model.n_kv_heads),
         "that gives the values one scale per head; here one float16 scale serves the whole "
         "row of 8 heads."),
    ]


@checker
def check_bytes_per_token(answer) -> Feedback:
    """Exercise 2: bytes one token adds to Llama-2-70B's cache with int4 keys per channel
    (groups of 32) and int4 values per token, float16 scales."""
    value = read_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    expected = expected_bytes_per_token()
    layers, _ = exercise2_shapes()
    float16 = PRESETS[EXERCISE2_MODEL].kv_bytes_per_token()
    if math.isclose(value, expected):
        return Feedback(True, f"{expected:,} bytes a token: {layers} layers x ((512 + 64) + "
                        f"(512 + 2)), {float16 / expected:.2f} times less than float16's "
                        f"{float16:,}. "
                        "The keys' scales cost 64 bytes a token, 32 times the values' 2.")
    for wrong, message in _bytes_mistakes():
        if math.isclose(value, wrong, rel_tol=1e-9):
            return Feedback(False, f"not {value:,.6g}: {message}")
    if not value.is_integer() and value > 1000:          # bytes with a fraction
        return read_whole_number(value, "a number of bytes", expected=expected)
    return Feedback(False, f"not {value:,.6g}. Per layer: K's packed codes (1024 int4 = 512 "
                    "bytes) and its share of the group's scales, plus V's codes and its own "
                    "scale; then times the layers.")


# Exercise 3 ------------------------------------------------------------------------------

CHOICES = {
    "a": "Per token: every token gets a scale of its own, which adapts to it.",
    "b": "Per channel: the huge channel gets a scale of its own and leaves the other "
         "channels' scales small.",
    "c": "Both the same: int4 has 15 levels whichever way the scales are shared.",
    "d": "Neither matters: the error depends on the number of bits only.",
}
RIGHT_CHOICE = "b"
OUTLIER_CHANNEL, OUTLIER_SIZE = 5, 30.0


@lru_cache(maxsize=1)
def outlier_keys() -> np.ndarray:
    """64 tokens x 8 channels of keys, channel 5 thirty times larger than the others."""
    keys = np.random.default_rng(20).standard_normal((64, 8))
    keys[:, OUTLIER_CHANNEL] = OUTLIER_SIZE + keys[:, OUTLIER_CHANNEL]
    return keys


def outlier_errors(bits: int = 4) -> dict[str, float]:
    """RMS round-trip error of the seven ordinary channels of outlier_keys() with each
    grouping (per channel over the 64 tokens as one group)."""
    keys = outlier_keys()
    ordinary = np.arange(keys.shape[1]) != OUTLIER_CHANNEL
    held = {"per token": PerToken(bits).round_trip(keys),
            "per channel": PerChannel(bits, len(keys)).round_trip(keys)}
    return {name: float(np.sqrt(np.mean((rows - keys)[:, ordinary] ** 2)))
            for name, rows in held.items()}


WRONG_CHOICES = {
    "a": "a token's scale is set by its largest number, and in every token that is the huge "
         "channel: the scale is 30 times too coarse for the other seven.",
    "c": "the levels are the same, but not their spacing: it is the group's max|x| / 7.",
    "d": "the error of a number is at most half its group's step, max|x| / 7 / 2, and the "
         "grouping decides which max|x| that is.",
}


@checker
def check_huge_channel_prediction(answer) -> Feedback:
    """Exercise 3: keys whose channel 5 is 30 times larger than the others, int4: which
    grouping keeps the error of the other channels small? One letter."""
    letter = read_choice(answer, CHOICES)
    if isinstance(letter, Feedback):
        return letter
    errors = outlier_errors()
    measured = (f"Measured on these keys, the other channels' RMS error is "
                f"{errors['per token']:.3f} per token against {errors['per channel']:.3f} "
                f"per channel, {errors['per token'] / errors['per channel']:.0f} times less.")
    if letter == RIGHT_CHOICE:
        return Feedback(True, f"b. {measured} This is KIVI's argument for quantizing keys per "
                        "channel; values have no such channels, and go per token.")
    return Feedback(False, f"not {letter}: {WRONG_CHOICES[letter]} {measured}")


# Exercise 4 ------------------------------------------------------------------------------

SIGNATURE = "round_trip_per_token(rows, bits)"


def round_trip_per_token_buggy(rows, bits):
    """Meant: what a per-token cache holds for rows (n, w), each row with its own scale."""
    largest_code = 2 ** (bits - 1) - 1
    scales = np.abs(rows).max(axis=0, keepdims=True) / largest_code
    codes = np.clip(np.rint(rows / scales), -largest_code, largest_code)
    return codes * scales


def round_trip_per_token(rows, bits):
    """The fixed version: one scale per row, axis=1 (float64 scales)."""
    largest_code = 2 ** (bits - 1) - 1
    scales = np.abs(rows).max(axis=1, keepdims=True) / largest_code
    codes = np.clip(np.rint(rows / scales), -largest_code, largest_code)
    return codes * scales


def _round_trip_with(rows, bits, axis, largest_code=None, keepdims=True, rounding=np.rint,
                     clip=True, times_scale=True):
    largest_code = 2 ** (bits - 1) - 1 if largest_code is None else largest_code
    scales = np.abs(rows).max(axis=axis, keepdims=keepdims) / largest_code
    codes = rounding(rows / scales)
    if clip:
        codes = np.clip(codes, -largest_code, largest_code)
    return codes * scales if times_scale else codes


@lru_cache(maxsize=1)
def _bug_cases() -> tuple[tuple[np.ndarray, int], ...]:
    """Rows with an outlier channel (not square, so that per token and per channel differ
    in shape of their scales), a square block, at 4 and 8 bits."""
    rng = np.random.default_rng(4)
    tall = rng.standard_normal((6, 4))
    tall[:, 2] *= 20
    square = rng.standard_normal((5, 5)) * np.array([1, 1, 15, 1, 1])
    return (tall, 4), (tall, 8), (square, 4), (tall.T.copy(), 2)


def _bug_variants(rows, bits) -> list[tuple[np.ndarray, str]]:
    n = 2 ** (bits - 1) - 1
    variants = [
        (_round_trip_with(rows, bits, 0), "still one scale per column (axis=0): that is per "
                                          "channel. A per-token cache gives every row its own "
                                          "scale: the max over axis=1."),
        (_round_trip_with(rows, bits, 1, largest_code=2 ** bits - 1),
         f"the largest code is 2**(bits - 1) - 1 = {n} at {bits} bits (symmetric codes have "
         "as many steps on each side of 0), not 2**bits - 1."),
        (_round_trip_with(rows, bits, 1, largest_code=2 ** (bits - 1)),
         f"the largest code is 2**(bits - 1) - 1 = {n}, not 2**(bits - 1)."),
        (_round_trip_with(rows, bits, 1, rounding=np.trunc), "np.trunc (or astype(int)) cuts "
                                                             "the fraction: round to the "
                                                             "nearest code, np.rint."),
        (_round_trip_with(rows, bits, 1, times_scale=False), "that returns the codes; the "
                                                             "round trip reads them back: "
                                                             "codes * scales."),
        (np.asarray(rows, dtype=np.float64), "that returns the rows unchanged: nothing was "
                                             "rounded."),
    ]
    if rows.shape[0] == rows.shape[1]:
        variants.append((_round_trip_with(rows, bits, 1, keepdims=False),
                         "on a square block, scales of shape (n,) line up with the columns: "
                         "column j is divided by row j's scale. Keep the axis, keepdims=True, "
                         "so that the scales are (n, 1)."))
    return variants


@checker
def check_round_trip_per_token(answer) -> Feedback:
    """Exercise 4: a fixed round_trip_per_token(rows, bits) -> rows read back (n, w)."""
    if is_missing(answer):
        return not_filled_in("answer", "your fixed function (answer = round_trip_per_token)")
    if not callable(answer):
        return Feedback(False, f"answer should be a function, {SIGNATURE}; got "
                        f"{described(answer)}. Set answer = round_trip_per_token (no "
                        "brackets).")
    for rows, bits in _bug_cases():
        where = f"on rows of shape {rows.shape} at {bits} bits"
        try:
            result = answer(rows.copy(), bits)
        except Exception as error:  # noqa: BLE001 - a student's code may fail in any way
            message = f"{where}, your function raised {type(error).__name__}: {error}"
            if "broadcast" in str(error):
                message += (". The scales of shape (n,) do not line up with rows (n, w): keep "
                            "the axis, keepdims=True, so that they are (n, 1).")
            return Feedback(False, message[:600])
        if result is None:
            return Feedback(False, f"{where}, your function returned None: return the rows "
                            "read back, codes * scales.")
        held = read_array(result, "the result") if isinstance(
            result, (np.ndarray, list, tuple)) else None
        if not isinstance(held, np.ndarray):
            return Feedback(False, f"{where}, your function should return an array of numbers "
                            f"(the rows read back), got {described(result)}"
                            + (f": {held.message}" if isinstance(held, Feedback) else "."))
        held = held.astype(np.float64)
        if held.shape != rows.shape:
            return Feedback(False, f"{where}, your function should return the rows read "
                            f"back, shape {rows.shape}; got {held.shape}.")
        right = (round_trip_per_token(rows, bits), PerToken(bits).round_trip(rows))
        if any(np.allclose(held, r, rtol=1e-9, atol=1e-12) for r in right):
            continue
        for wrong, message in _bug_variants(rows, bits):
            if np.allclose(held, wrong, rtol=1e-9, atol=1e-12, equal_nan=True):
                return Feedback(False, f"{where}: {message}")
        return Feedback(False, f"{where}, the rows read back are not right. Per token: scales "
                        "= max|row| / (2**(bits - 1) - 1) with keepdims (n, 1), codes = "
                        "clip(rint(rows / scales)), read back codes * scales.")
    return Feedback(True, "right on every case: one scale per row, max over axis=1 with "
                    "keepdims. On rows with an outlier channel the error is now that of "
                    "per-token quantization, as kvlib's PerToken gives.")


SOLUTIONS = {
    1: """
scale = np.abs(row).max() / 127                          # 2.54 / 127 = 0.02
codes = np.clip(np.rint(row / scale), -127, 127)         # round to nearest, then clip
codes_next = np.clip(np.rint(next_row / scale), -127, 127)   # the same, fixed scale
""",
    2: """
layers, width = 80, 8 * 128                     # Llama-2-70B: 8 K/V heads of 128
keys = width // 2 + 2 * width / 32              # int4 codes + float16 scales shared by 32
values = width // 2 + 2                         # int4 codes + one float16 scale a row
answer = layers * (keys + values)               # 87,200 bytes
""",
    3: """
answer = "b"
""",
    4: """
def round_trip_per_token(rows, bits):
    largest_code = 2 ** (bits - 1) - 1
    scales = np.abs(rows).max(axis=1, keepdims=True) / largest_code   # axis=1: per row
    codes = np.clip(np.rint(rows / scales), -largest_code, largest_code)
    return codes * scales

answer = round_trip_per_token
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
