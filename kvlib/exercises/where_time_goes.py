"""Exercises of the where_time_goes lesson (where the time goes): checkers and solutions.

1. A roofline prediction: how long a GPT-2-small decode step takes on a given machine (the
   time per output token).
2. The bytes a batched decode step reads: the weights once, every sequence's cache (a
   prediction before any code).
3. The time to first token: the roofline time of a 512-token prefill on the same machine.
"""

from __future__ import annotations

import kvlib
from kvlib import roofline

from .base import (
    Feedback,
    agrees_at_its_precision,
    checker,
    near_miss,
    read_number,
    read_whole_number,
    show_solution,
)

MACHINE_COMPUTE_RATE = 200e9   # FLOP/s
MACHINE_BANDWIDTH = 50e9       # bytes/s
# Exercise 1: GPT-2 small's decode step at this position
EXERCISE1_POSITION = 543
# Exercise 2: a batch of this many sequences, each at this position, float32
EXERCISE2_BATCH, EXERCISE2_POSITION = 8, 543
# Exercise 3: a prefill of this many prompt tokens, last row unembedded
EXERCISE3_PROMPT = 512


def _roofline_parts(flops: float, n_bytes: float):
    rate, bandwidth = MACHINE_COMPUTE_RATE, MACHINE_BANDWIDTH
    return flops / rate, n_bytes / bandwidth


def _unit_slip(value: float, expected: float) -> str | None:
    for factor, unit in ((1e3, "milliseconds"), (1e6, "microseconds")):
        if agrees_at_its_precision(value, expected * factor):
            return f"the right time in {unit}: give it in seconds."
    return None


def _wrong_time(value: float, expected: float, when_close: str, otherwise: str) -> Feedback:
    """The last word on a wrong time in seconds: the right one in ms or us, else near_miss."""
    slip = _unit_slip(value, expected)
    if slip:
        return Feedback(False, slip)
    return near_miss(value, expected, when_close, otherwise)


@checker
def check_roofline_time(answer) -> Feedback:
    """Exercise 1: roofline seconds of GPT-2 small's decode step at position 543, with
    200 GFLOP/s and 50 GB/s. Accepted at the precision given, from 3 significant digits
    (0.0107)."""
    value = read_number(answer, "a number of seconds")
    if isinstance(value, Feedback):
        return value
    config = kvlib.GPT2_SMALL
    flops = kvlib.decode_step_multiply_adds(config, EXERCISE1_POSITION).flops
    n_bytes = roofline.decode_step_bytes(config, EXERCISE1_POSITION)
    compute, reading = _roofline_parts(flops, n_bytes)
    expected = max(compute, reading)
    if agrees_at_its_precision(value, expected):
        return Feedback(True, f"{expected * 1e3:.2f} ms, set by reading {n_bytes / 1e6:.0f} MB; "
                        f"the arithmetic alone would take {compute * 1e3:.2f} ms. That is "
                        "the time per output token (TPOT) of this machine, at batch 1.")
    if agrees_at_its_precision(value, compute + reading):
        return Feedback(False, "you added the two times. In the roofline model reading and "
                        "computing overlap: the slower of the two sets the time (max).")
    if agrees_at_its_precision(value, compute) or agrees_at_its_precision(value, compute / 2):
        return Feedback(False, "that is the arithmetic time only, the faster of the two: a "
                        "decode step does about 2 FLOPs per 4-byte weight, so reading the "
                        "weights takes longer, and the slower one sets the time.")
    weights_only = roofline.weights_bytes(config) / MACHINE_BANDWIDTH
    if agrees_at_its_precision(value, weights_only):
        return Feedback(False, "close: the weights are there, but the step also reads the "
                        f"keys and values of its {EXERCISE1_POSITION + 1} positions "
                        "(roofline.decode_step_bytes counts both).")
    return _wrong_time(value, expected,
                       "Give at least 3 significant digits of max(FLOPs / 200e9, bytes / 50e9).",
                       "Compute max(FLOPs / 200e9 FLOP/s, bytes / 50e9 bytes/s) with the "
                       "step's FLOPs and bytes.")


@checker
def check_batched_bytes(answer) -> Feedback:
    """Exercise 2: bytes one decode step of 8 GPT-2-small sequences (float32), each at
    position 543, must read: the weights once, and each sequence's keys and values."""
    config, B, position = kvlib.GPT2_SMALL, EXERCISE2_BATCH, EXERCISE2_POSITION
    weights = roofline.weights_bytes(config)
    one_cache = roofline.cache_bytes(config, position + 1)
    expected = weights + B * one_cache
    number = read_number(answer, "a number of bytes")
    if not isinstance(number, Feedback):
        for scale, unit in ((1e6, "MB"), (1e9, "GB"), (2**20, "MiB"), (2**30, "GiB")):
            if agrees_at_its_precision(number, expected / scale):
                return Feedback(False, f"the right amount in {unit}: give it in bytes.")
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    if value == expected:
        return Feedback(True, f"{expected:,} bytes: {weights / 1e6:.0f} MB of weights read "
                        f"once for all {B} sequences, and {B} caches of "
                        f"{one_cache / 1e6:.1f} MB, one for each. Batching shares the weights, "
                        "not the caches.")
    mistakes = {
        B * (weights + one_cache): f"that reads the weights {B} times, once per sequence. In "
                                   "a batched step every weight, read once, serves all the "
                                   "sequences' rows.",
        weights + one_cache: "that is one sequence's step: each of the 8 sequences has its "
                             "own cache, and all of them are read.",
        weights: "that leaves out the caches: each sequence's step reads its own keys and "
                 "values too.",
        B * one_cache: "that leaves out the weights, read once for the whole batch.",
        weights + B * roofline.cache_bytes(config, position): "one position short: the step "
                                                             "attends over position + 1 = 544 "
                                                             "positions, its own included.",
        weights // 2 + B * one_cache // 2: "that counts 2 bytes a number (BF16); this model "
                                           "is float32, 4 bytes.",
    }
    if value in mistakes:
        return Feedback(False, mistakes[value])
    return near_miss(value, expected,
                     "Count the weights once (roofline.weights_bytes) and one cache per "
                     "sequence (roofline.cache_bytes, of position + 1 positions).",
                     "Weights once (roofline.weights_bytes(config)) plus 8 caches "
                     "(roofline.cache_bytes(config, 544) each).")


@checker
def check_time_to_first_token(answer) -> Feedback:
    """Exercise 3: roofline seconds of GPT-2 small's prefill of a 512-token prompt, the last
    row unembedded, at 200 GFLOP/s and 50 GB/s: the time to first token."""
    value = read_number(answer, "a number of seconds")
    if isinstance(value, Feedback):
        return value
    config, P = kvlib.GPT2_SMALL, EXERCISE3_PROMPT
    flops = kvlib.prefill_multiply_adds(config, P, last_only=True).flops
    n_bytes = roofline.forward_bytes(config, P)
    compute, reading = _roofline_parts(flops, n_bytes)
    expected = max(compute, reading)
    if agrees_at_its_precision(value, expected):
        step = _roofline_parts(kvlib.decode_step_multiply_adds(config, P).flops,
                               roofline.decode_step_bytes(config, P))
        return Feedback(True, f"{expected:.3f} s, set by arithmetic ({flops / n_bytes:.0f} "
                        "FLOPs per byte): the prefill is compute-bound, while each decode "
                        f"step after it is memory-bound, about {max(step) * 1e3:.1f} ms. "
                        f"{P} tokens in one pass take as long as about "
                        f"{expected / max(step):.0f} decode steps.")
    if agrees_at_its_precision(value, reading):
        return Feedback(False, "that is the reading time: a prefill of 512 rows does about "
                        "180 FLOPs per byte read, so arithmetic, not memory, sets its time.")
    if agrees_at_its_precision(value, compute + reading):
        return Feedback(False, "you added the two times; the slower of the two sets it (max).")
    if agrees_at_its_precision(value, compute / 2):
        return Feedback(False, "half of it: those are multiply-adds; each is 2 FLOPs.")
    all_rows = kvlib.prefill_multiply_adds(config, P).flops / MACHINE_COMPUTE_RATE
    if agrees_at_its_precision(value, all_rows):
        return Feedback(False, "close: that unembeds all 512 rows; the first new token needs "
                        "only the last row's logits (last_only=True).")
    decode = _roofline_parts(kvlib.decode_step_multiply_adds(config, P).flops,
                             roofline.decode_step_bytes(config, P))
    if agrees_at_its_precision(value, max(decode)):
        return Feedback(False, "that is one decode step, the time per output token. The first "
                        "token comes from the prefill of the whole prompt.")
    if agrees_at_its_precision(value, P * max(decode)):
        return Feedback(False, "that is 512 decode steps, one token at a time; a prefill takes "
                        "the whole prompt in one pass, as a matrix-matrix product.")
    return _wrong_time(value, expected,
                       "Use kvlib.prefill_multiply_adds(config, 512, last_only=True).flops and "
                       "roofline.forward_bytes(config, 512).",
                       "max(FLOPs / 200e9, bytes / 50e9) for the prefill: "
                       "kvlib.prefill_multiply_adds(config, 512, last_only=True) and "
                       "roofline.forward_bytes(config, 512).")


SOLUTIONS = {
    1: """
config = kvlib.GPT2_SMALL
flops = kvlib.decode_step_multiply_adds(config, 543).flops
n_bytes = roofline.decode_step_bytes(config, 543)
answer = max(flops / 200e9, n_bytes / 50e9)
""",
    2: """
config = kvlib.GPT2_SMALL
answer = roofline.weights_bytes(config) + 8 * roofline.cache_bytes(config, 544)
""",
    3: """
config = kvlib.GPT2_SMALL
flops = kvlib.prefill_multiply_adds(config, 512, last_only=True).flops
answer = max(flops / 200e9, roofline.forward_bytes(config, 512) / 50e9)
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
