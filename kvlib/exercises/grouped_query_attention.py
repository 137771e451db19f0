"""Exercises of the grouped_query_attention lesson (grouped-query attention): checkers and
solutions.

1. The cache of a published model from its config.json (a transfer: Qwen2-7B, whose config
   gives no head size and names its K/V heads num_key_value_heads).
2. Find the bug: a grouped decode step written with np.tile instead of np.repeat (the
   classic slip: right shapes, wrong pairs of query and K/V heads), fixed with np.repeat,
   not with kvlib.attention (the checker runs the function and watches for it).
3. Predict which K/V head a query head of Llama-2-70B reads.
"""

from __future__ import annotations

import math
import sys
from numbers import Real

import numpy as np

import kvlib
from kvlib import grouped
from kvlib import model as kvlib_model
from kvlib.memory import GiB, MiB, kv_cache_bytes

from .base import (
    Feedback,
    as_number,
    checker,
    is_missing,
    not_filled_in,
    read_array,
    read_number,
    read_whole_number,
    show_solution,
)

LESSON_CONFIG = kvlib.ModelConfig(d_model=16, n_heads=8, n_kv_heads=2, d_ff=32)
"""The notebook's grouped model: the toy's vocabulary, 8 query heads of 2, 2 K/V heads."""
EXERCISE_TOKEN = 5   # "I", decoded after "How are you?"

# Exercise 1: config.json of Qwen/Qwen2-7B-Instruct (Qwen2.5-7B has the same shapes)
QWEN2_CONFIG = {"hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
                "num_key_value_heads": 4, "max_position_embeddings": 32768,
                "torch_dtype": "bfloat16"}
# Exercise 3: Llama-2-70B (kvlib.memory.PRESETS) and one of its query heads
EXERCISE3_HEADS, EXERCISE3_KV_HEADS, EXERCISE3_QUERY_HEAD = 64, 8, 42
ROUNDING = 6e-4      # the notebook prints 3 decimals: a copied value is off by up to 5e-4


# Exercise 1 ------------------------------------------------------------------------------

def qwen2_cache_bytes() -> int:
    """Exercise 1's answer: the BF16 cache of one full-length sequence of Qwen2-7B."""
    c = QWEN2_CONFIG
    return kv_cache_bytes(c["num_hidden_layers"], None, c["max_position_embeddings"],
                          n_kv_heads=c["num_key_value_heads"],
                          head_dim=c["hidden_size"] // c["num_attention_heads"])


@checker
def check_cache_bytes_from_config(answer) -> Feedback:
    """Exercise 1: bytes of Qwen2-7B's cache for one sequence of 32,768 tokens in BF16
    (bytes, or the same size in MiB or GiB)."""
    value = read_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    c = QWEN2_CONFIG
    expected = qwen2_cache_bytes()
    tokens, layers = c["max_position_embeddings"], c["num_hidden_layers"]
    group = c["num_attention_heads"] // c["num_key_value_heads"]

    def equals(target: float) -> bool:       # bytes are whole: exactly
        return value == target

    if equals(expected) or math.isclose(value, expected / MiB, rel_tol=1e-9) or \
            math.isclose(value, expected / GiB, rel_tol=1e-9):
        return Feedback(True, f"{expected:,} bytes = {expected / GiB:g} GiB: 57,344 bytes a "
                        f"token, {group} times less than with 28 K/V heads.")
    if math.isclose(value, expected / 1e9, abs_tol=0.005) or \
            math.isclose(value, expected / 1e6, abs_tol=0.5):
        return Feedback(False, "that is in GB or MB (powers of 10). Give bytes, or GiB "
                        "(2^30 bytes) as the series does.")
    if equals(expected * group):
        return Feedback(False, f"{group} times too much: that caches a K/V head for each of "
                        "the 28 query heads (or takes the head size as hidden_size / 4). Only "
                        "num_key_value_heads = 4 heads are cached, each of head size "
                        "hidden_size / num_attention_heads = 3584 / 28 = 128.")
    if equals(expected / 2):
        return Feedback(False, "that is K or V alone: the cache keeps both, a factor 2.")
    if equals(expected / layers):
        return Feedback(False, "that is one layer; each of the 28 layers has its own cache.")
    if equals(expected * 2):
        return Feedback(False, "that is 4 bytes a number; torch_dtype bfloat16 takes 2.")
    if equals(expected * 8):
        return Feedback(False, "that counts bits, not bytes: BF16 is 2 bytes a number.")
    if equals(expected / tokens):
        return Feedback(False, "that is one token (57,344 bytes): the sequence has "
                        f"{tokens:,} of them.")
    if equals(expected / tokens * 32000):
        return Feedback(False, f"max_position_embeddings is {tokens:,} (2^15), not 32,000.")
    if not value.is_integer() and abs(value) > 1000:     # bytes with a fraction
        return read_whole_number(value, "a number of bytes", expected=expected)
    return Feedback(False, f"not {value:,.12g}. Multiply 2 (K and V) x num_hidden_layers x "
                    "num_key_value_heads x head size x 2 bytes x tokens; the head size is "
                    "hidden_size / num_attention_heads.")


# Exercise 2 ------------------------------------------------------------------------------

def lesson_model() -> kvlib.Params:
    """The notebook's grouped model (LESSON_CONFIG, the default seed)."""
    return kvlib.init_params(LESSON_CONFIG)


def decode_inputs(params: kvlib.Params | None = None):
    """What exercise 2 works on, as the notebook builds it: after the prefill of "How are
    you?", the new token "I" in layer 0. Returns q (h, 1, dh), the query heads of the new
    token, and K_rows, V_rows (6, kv x dh), layer 0's cached rows with its own appended."""
    params = lesson_model() if params is None else params
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    _, cache = kvlib.prefill(params, ids)
    x = kvlib.embed(np.array([EXERCISE_TOKEN]), params.embedding)
    q, k, v = kvlib.project_qkv(x, params.layers[0])
    return (kvlib.split_heads(q, params.config.n_heads), np.vstack([cache.keys(0), k]),
            np.vstack([cache.values(0), v]))


def _kv_heads_in_order(order: str, rows: np.ndarray, n_heads: int, head_dim: int):
    """rows (S, kv x dh) as (h, S, dh), each query head's K/V head, in one of the ways a
    student may write it: the right one and the classic wrong ones."""
    kv = rows.shape[1] // head_dim
    heads = kvlib.split_heads(rows, kv)
    if order == "repeat":
        return np.repeat(heads, n_heads // kv, axis=0)
    if order == "tile":
        return np.tile(heads, (n_heads // kv, 1, 1))
    if order == "columns":       # single columns repeated, then split into h heads
        return kvlib.split_heads(np.repeat(rows, n_heads // kv, axis=1), n_heads)
    raise ValueError(order)


def _decode_output(q, K_rows, V_rows, k_order="repeat", v_order="repeat", scaled=True,
                   softmax_axis=-1):
    n_heads, _, head_dim = q.shape
    K = _kv_heads_in_order(k_order, K_rows, n_heads, head_dim)
    V = _kv_heads_in_order(v_order, V_rows, n_heads, head_dim)
    scores = q @ K.swapaxes(-1, -2)
    if scaled:
        scores = scores / math.sqrt(head_dim)
    return kvlib.softmax(scores, axis=softmax_axis) @ V


WRONG_DECODES = (   # (what the student did, options of _decode_output, the diagnosis)
    ("np.tile", dict(k_order="tile", v_order="tile"),
     "np.tile lays the K/V heads out in the order 0, 1, 0, 1, ...: query head 1 got K/V head "
     "1 instead of 0. Query head i must read K/V head i // group: np.repeat(..., group, "
     "axis=0) gives 0, 0, 0, 0, 1, 1, 1, 1, the order of transformers' repeat_kv."),
    ("repeated columns", dict(k_order="columns", v_order="columns"),
     "that repeats single columns of the (S, kv x dh) rows, so a head is made of copies of "
     "one column. Repeat whole heads: split the rows into the K/V heads first, (kv, S, dh), "
     "then np.repeat along axis 0."),
    ("no scale", dict(scaled=False),
     "the heads are paired right, but the scores are not scaled: divide them by "
     "sqrt(head size) before the softmax."),
    ("np.tile, no scale", dict(k_order="tile", v_order="tile", scaled=False),
     "two slips: np.tile pairs the wrong heads (query head i must read K/V head i // group: "
     "use np.repeat along axis 0), and the scores are not divided by sqrt(head size)."),
    ("repeated columns, no scale", dict(k_order="columns", v_order="columns", scaled=False),
     "two slips: whole heads must be repeated, not single columns (split the rows into K/V "
     "heads first), and the scores are not divided by sqrt(head size)."),
    ("K right, V tiled", dict(v_order="tile"),
     "the keys are repeated right but the values are tiled: V must be repeated exactly like "
     "K, with np.repeat along axis 0, so that each query head mixes its own K/V head's values."),
    ("K tiled, V right", dict(k_order="tile"),
     "the values are repeated right but the keys are tiled: K must be repeated exactly like "
     "V, with np.repeat along axis 0."),
    ("softmax over heads", dict(softmax_axis=0),
     "the softmax ran along the heads axis. Take it along the last axis (the positions), so "
     "that each head's row of weights adds up to 1."),
    ("softmax over the one query", dict(softmax_axis=1),
     "every weight is 1: the softmax ran along the axis of the single query. Take it along "
     "the last axis (the positions)."),
)


def _as_output(answer, n_heads: int, head_dim: int):
    """The answer as (h, 1, dh) if it is an array of numbers in an accepted form: per head
    (h, 1, dh) or (h, dh), or merged (1, h x dh) or (h x dh,). Else a Feedback."""
    if is_missing(answer):
        return Feedback(False, "got None instead of the output: return (or assign) the array "
                        "of the attention output.")
    array = read_array(answer, "the output")
    if isinstance(array, Feedback):
        return array
    array = array.astype(float)
    if array.size == n_heads * head_dim and array.shape in {
            (n_heads, 1, head_dim), (n_heads, head_dim), (1, n_heads * head_dim),
            (n_heads * head_dim,)}:
        per_head = array.reshape(1, n_heads, head_dim) if array.shape[-1] == n_heads * head_dim \
            else array.reshape(n_heads, 1, head_dim)
        return per_head.transpose(1, 0, 2) if per_head.shape[0] == 1 else per_head
    return array


def _diagnose(answer, q, K_rows, V_rows, where: str = "") -> Feedback | None:
    """None when the answer is this decode step's grouped attention output; else why not."""
    n_heads, _, head_dim = q.shape
    S = K_rows.shape[0]
    expected = _decode_output(q, K_rows, V_rows)
    output = _as_output(answer, n_heads, head_dim)
    if isinstance(output, Feedback):
        return output
    if output.shape != expected.shape:
        if output.shape in {(n_heads, 1, S), (n_heads, S)}:
            return Feedback(False, f"{where}those are the attention weights, one row of {S} "
                            "per head: multiply them by the values, repeated like the keys.")
        got = "a single number" if output.ndim == 0 else f"shape {output.shape}"
        return Feedback(False, f"{where}expected the output per query head, an array of "
                        f"shape {expected.shape}, got {got}.")
    if not np.isfinite(output).all():
        return Feedback(False, f"{where}the output has NaN or infinite values: the softmax "
                        "of finite scores is always finite.")
    if np.allclose(output, expected, rtol=0, atol=ROUNDING):
        return None
    for _, options, diagnosis in WRONG_DECODES:
        if np.allclose(output, _decode_output(q, K_rows, V_rows, **options), rtol=0,
                       atol=ROUNDING):
            return Feedback(False, where + diagnosis)
    return Feedback(False, f"{where}the shape is right but not the values. Split the rows "
                    "into K/V heads, np.repeat them to one per query head along axis 0, then "
                    "scaled scores, softmax over the positions, and the weighted sum of V.")


SMALLER_CASES = ((6, 3, 2, 7), (8, 4, 4, 3), (4, 1, 2, 5), (4, 4, 2, 4))
"""Other decode steps a fixed function must get right: (h, kv, dh, S) with random numbers."""


def _random_case(n_heads, n_kv_heads, head_dim, S, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_heads, 1, head_dim)),
            rng.standard_normal((S, n_kv_heads * head_dim)),
            rng.standard_normal((S, n_kv_heads * head_dim)))


SHORTCUTS = {
    kvlib_model.attention.__code__: "kvlib.attention",
    grouped.repeated_attention.__code__: "kvlib.grouped.repeated_attention",
}
"""kvlib functions that do the exercise's grouping themselves: the task asks for it written
with np.repeat. (Scoring already repeated heads with kvlib's helpers is fine.)"""


def _run_watching_kvlib(function, *args):
    """function(*args), and the first kvlib shortcut it took, or None: kvlib.attention, the
    reference grouped attention, or kvlib's scores or weighted sum given fewer K/V heads
    than query heads (which broadcast the grouping, kvlib.model.is_grouped). A profile
    hook sees the calls however the student named the functions."""
    taken = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code in SHORTCUTS:
            taken.append(SHORTCUTS[frame.f_code])
        elif event == "return" and frame.f_code is kvlib_model.is_grouped.__code__ and \
                arg is True:
            taken.append("kvlib's grouped attention (attention_scores or weighted_sum given "
                         "the K/V heads as they are)")

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        result = function(*args)
    finally:
        sys.setprofile(previous)
    return result, (taken[0] if taken else None)


@checker
def check_grouped_decode(answer) -> Feedback:
    """Exercise 2: the fixed grouped decode step, f(q, K_rows, V_rows) -> (h, 1, dh), run on
    the notebook's q, K_rows, V_rows and on other numbers of heads; it must repeat the K/V
    heads itself (np.repeat), not let kvlib.attention do the grouping. An output array gets
    its diagnosis, but passes only as the function that made it."""
    if is_missing(answer):
        return not_filled_in("answer", "your fixed function (answer = "
                             "grouped_decode_attention, without calling it)")
    lesson_case = decode_inputs()
    if not callable(answer):
        feedback = _diagnose(answer, *lesson_case)
        if feedback is not None:   # a Feedback that did not pass is falsy: test for None
            return feedback
        return Feedback(False, "those are the right numbers for the notebook's q, K_rows, "
                        "V_rows. Now set answer to the fixed function itself (answer = "
                        "grouped_decode_attention, without brackets): from an array the "
                        "checker cannot tell np.repeat from kvlib.attention, and it runs the "
                        "function on other numbers of heads too.")
    cases = [lesson_case] + [_random_case(*sizes, seed) for seed, sizes
                             in enumerate(SMALLER_CASES)]
    for q, K_rows, V_rows in cases:
        h, kv = q.shape[0], K_rows.shape[1] // q.shape[-1]
        where = f"with {h} query heads and {kv} K/V heads, "
        try:
            output, shortcut = _run_watching_kvlib(answer, q.copy(), K_rows.copy(),
                                                   V_rows.copy())
        except Exception as error:  # a student's code may fail in any way; say it in words
            return Feedback(False, f"{where}your function raised {type(error).__name__}: "
                            f"{error}")
        feedback = _diagnose(output, q, K_rows, V_rows, where)
        if feedback is not None:
            return feedback
        if shortcut is not None:
            return Feedback(False, f"the numbers are right, but {shortcut} did the grouping "
                            "for you. The exercise asks for the broken step fixed by hand: "
                            "split the rows into K/V heads, np.repeat them to one per query "
                            "head along axis 0, then the scores, the softmax and the weighted "
                            "sum of V.")
    return Feedback(True, f"right on the notebook's decode step and on {len(SMALLER_CASES)} "
                    "other sizes: query head i reads K/V head i // group. kvlib.attention "
                    "does the same by broadcasting, without the copies.")


# Exercise 3 ------------------------------------------------------------------------------

@checker
def check_query_group(answer) -> Feedback:
    """Exercise 3: the K/V head that query head 42 of Llama-2-70B (64 query heads, 8 K/V
    heads) reads."""
    h, kv, head = EXERCISE3_HEADS, EXERCISE3_KV_HEADS, EXERCISE3_QUERY_HEAD
    group = h // kv
    expected = head // group
    if isinstance(answer, Real) and not isinstance(answer, (bool, np.bool_)) and \
            as_number(answer) is not None and math.isclose(float(answer), head / group):
        return Feedback(False, f"{head} / {group} = {head / group:g}: a head number is whole, "
                        f"round down (integer division, {head} // {group}).")
    value = read_whole_number(answer, "a K/V head number", expected=expected)
    if isinstance(value, Feedback):
        return value
    if value == expected:
        return Feedback(True, f"K/V head {expected}: groups of {group}, so query heads "
                        f"{expected * group}-{expected * group + group - 1} all read it.")
    if value < 0:
        return Feedback(False, "heads are numbered from 0 up.")
    if value == head % kv:
        return Feedback(False, f"that is {head} % {kv}, the np.tile order 0, 1, ..., 7, 0, 1, "
                        f"...: in a grouped model consecutive query heads share a K/V head, "
                        f"so query head i reads K/V head i // {group}.")
    if value == expected + 1:
        return Feedback(False, "one too many: heads are numbered from 0, and the division "
                        "rounds down.")
    if value == head:
        return Feedback(False, f"query head {head} has no K/V head of its own: {group} query "
                        "heads share each K/V head.")
    if value >= kv:
        return Feedback(False, f"Llama-2-70B has only {kv} K/V heads, numbered 0 to {kv - 1}: "
                        f"each serves {h} / {kv} = {group} query heads.")
    v = int(value)
    return Feedback(False, f"K/V head {v} serves query heads {v * group}-{v * group + group - 1}"
                    f", not {head}. Query head i reads K/V head i // (64 / 8).")


SOLUTIONS = {
    1: """
c = qwen2_config
head_dim = c["hidden_size"] // c["num_attention_heads"]          # 128
answer = (2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2
          * c["max_position_embeddings"])                        # 1,879,048,192 = 1.75 GiB
""",
    2: """
def grouped_decode_attention(q, K_rows, V_rows):
    n_heads, _, head_dim = q.shape
    n_kv_heads = K_rows.shape[1] // head_dim
    group = n_heads // n_kv_heads
    K = np.repeat(kvlib.split_heads(K_rows, n_kv_heads), group, axis=0)   # 0,0,..,1,1,..
    V = np.repeat(kvlib.split_heads(V_rows, n_kv_heads), group, axis=0)
    weights = kvlib.softmax(q @ K.swapaxes(-1, -2) / np.sqrt(head_dim))
    return weights @ V

answer = grouped_decode_attention
""",
    3: """
answer = 42 // (64 // 8)     # groups of 8: query heads 40-47 read K/V head 5
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
