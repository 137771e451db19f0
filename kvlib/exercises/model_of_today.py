"""Exercises of the model_of_today lesson (a model of today, SmolLM2): checkers and solutions.

1. The cache of another model of today from its config.json (a transfer: Llama-3.2-1B, which
   gives head_dim and num_key_value_heads).
2. Write llama.cpp's reordering of q and k yourself: the hub's column order -> the GGUF's.
3. A chat app that puts today's date into its system message: how many cached positions can
   the next request reuse?
"""

from __future__ import annotations

import numpy as np

import kvlib
from kvlib.chat import reusable_prefix
from kvlib.checkpoints.llama import to_half_columns, to_interleaved_columns

from .base import (
    Feedback,
    checker,
    is_missing,
    is_stub,
    not_filled_in,
    read_array,
    read_function,
    read_whole_number,
    show_solution,
)

# Exercise 1: meta-llama/Llama-3.2-1B-Instruct's config.json, the entries that matter
LLAMA32_CONFIG = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "head_dim": 64, "num_hidden_layers": 16, "max_position_embeddings": 131072,
                  "torch_dtype": "bfloat16"}

# Exercise 3: the conversation and the two system messages
EXERCISE3_TURNS = [("What is the capital of France?", "The capital of France is Paris."),
                   ("And of Italy?", "The capital of Italy is Rome.")]
SYSTEM_BEFORE = "You are a helpful assistant."
SYSTEM_AFTER = "You are a helpful assistant. Today is 2 December 2026."


# Exercise 1 ------------------------------------------------------------------------------

def llama32_bytes_per_token() -> int:
    c = LLAMA32_CONFIG
    return kvlib.kv_cache_bytes(c["num_hidden_layers"], None, 1, dtype_bytes=2,
                                n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"])


@checker
def check_llama32_cache(answer) -> Feedback:
    """Exercise 1: bytes of cache a token for Llama-3.2-1B in bfloat16."""
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    c = LLAMA32_CONFIG
    expected = llama32_bytes_per_token()
    if value == expected:
        return Feedback(True, f"{expected:,} bytes a token: 2 (K and V) x 16 layers x 8 K/V "
                        "heads x 64 x 2 bytes. Its full context of 131,072 tokens takes "
                        f"{expected * c['max_position_embeddings'] / kvlib.GiB:g} GiB, and with "
                        "32 K/V heads it would take 4 times that.")
    if value == expected * 4:
        return Feedback(False, "4 times too much: that caches a K/V head for each of the 32 "
                        "query heads (or takes hidden_size as the cached width). Only "
                        "num_key_value_heads = 8 heads are cached, of head_dim = 64.")
    if value == expected // 2:
        return Feedback(False, "that is K or V alone: the cache keeps both, a factor 2.")
    if value == expected // c["num_hidden_layers"]:
        return Feedback(False, "that is one layer; each of the 16 layers caches its own K and V.")
    if value == expected * 2:
        return Feedback(False, "that is 4 bytes a number; bfloat16 takes 2.")
    if value == expected * 8:
        return Feedback(False, "that counts bits: bfloat16 is 2 bytes (16 bits) a number.")
    if value == expected * c["max_position_embeddings"]:
        return Feedback(False, "that is the whole context of 131,072 tokens; the question asks "
                        "for one token.")
    return Feedback(False, f"not {value:,}. Multiply 2 (K and V) x num_hidden_layers x "
                    "num_key_value_heads x head_dim x 2 bytes (bfloat16).")


# Exercise 2 ------------------------------------------------------------------------------

SHAPES = [(5, 2, 8), (3, 3, 6), (7, 1, 4), (4, 4, 2)]
"""(d_in, heads, head_dim) of the test matrices: several heads, odd and even pair counts."""


def _test_matrices():
    rng = np.random.default_rng(18)
    return [(rng.standard_normal((d_in, heads * head_dim)), heads)
            for d_in, heads, head_dim in SHAPES]


def _same(result: np.ndarray, target: np.ndarray) -> bool:
    """The same numbers in the same places, to float32's rounding."""
    return np.allclose(result.astype(np.float64), target, rtol=1e-6, atol=1e-7)


@checker
def check_to_interleaved(function) -> Feedback:
    """Exercise 2: to_interleaved(W, n_heads) reorders the columns of W (d, heads x dh) from
    the hub's order to llama.cpp's, within each head."""
    refused = read_function(function, "to_interleaved")
    if refused is not None:
        return refused
    for W, heads in _test_matrices():
        original = W.copy()
        try:
            result = function(W, heads)
        except Exception as error:      # the student's code: any error is an answer
            return Feedback(False, f"on W of shape {W.shape} with {heads} heads your function "
                            f"raised {type(error).__name__}: {error}")
        if result is None and is_stub(function):
            return not_filled_in("to_interleaved", "a body that returns the reordered W")
        if result is None:
            return Feedback(False, "your function returned None: does it end with `return` "
                            "and the reordered W?")
        if is_missing(result):
            return not_filled_in("to_interleaved", "a body that returns the reordered W")
        if not np.array_equal(W, original):
            return Feedback(False, "your function changed W in place; return a new array (the "
                            "loaded weights are read-only views of a file).")
        if isinstance(result, (list, tuple)):
            result = read_array(result, "your function's result", W.shape)
            if isinstance(result, Feedback):     # a ragged list, text, objects
                return result
        if not isinstance(result, np.ndarray) or result.shape != W.shape:
            return Feedback(False, f"for W of shape {W.shape} expected an array of the same "
                            f"shape, got {getattr(result, 'shape', type(result).__name__)}: "
                            "reorder the columns, don't transpose or reshape the matrix.")
        if result.dtype.kind not in "fiu":
            return Feedback(False, f"expected an array of numbers, got dtype {result.dtype}.")
        expected = to_interleaved_columns(W, heads)
        if _same(result, expected):     # float32 is fine: the order is what is asked
            continue
        head_dim = W.shape[1] // heads
        if _same(result, W):
            return Feedback(False, "nothing moved: within each head, column 2i must take "
                            "column i and column 2i + 1 must take column i + dh/2.")
        if _same(result, to_half_columns(W, heads)):
            return Feedback(False, "that is the inverse: it takes a GGUF's order back to the "
                            "hub's. Column 2i of the result is column i of W, not the other "
                            "way round.")
        if _same(result, to_interleaved_columns(W, 1)):
            return Feedback(False, "the reordering must stay inside each head: reshape to "
                            f"(d, n_heads, 2, dh/2) first (here dh = {head_dim}), swap the "
                            "last two axes, reshape back.")
        return Feedback(False, f"on W of shape {W.shape} ({heads} heads of {head_dim}) the "
                        "columns are not in llama.cpp's order: within each head, column 2i "
                        "takes column i and 2i + 1 takes column i + dh/2.")
    return Feedback(True, "the columns come out as llama.cpp's converter orders its rows: "
                    "turning neighbouring pairs of the result is turning halves of W.")


# Exercise 3 ------------------------------------------------------------------------------

def exercise3_ids(system: str) -> list[int]:
    """The conversation of exercise 3 with a system message, as the template renders it and
    the tokenizer reads it (no generation: the replies are given)."""
    messages = [{"role": "system", "content": system}]
    for question, reply in EXERCISE3_TURNS:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": reply}]
    return kvlib.smollm2_tokenizer().apply_chat_template(messages, add_generation_prompt=False)


def exercise3_answer() -> int:
    return reusable_prefix(exercise3_ids(SYSTEM_BEFORE), exercise3_ids(SYSTEM_AFTER))


@checker
def check_reusable_positions(answer) -> Feedback:
    """Exercise 3: how many positions of the cached conversation (SYSTEM_BEFORE) can the
    request with the dated system message (SYSTEM_AFTER) reuse?"""
    value = read_whole_number(answer, "a number of positions")
    if isinstance(value, Feedback):
        return value
    expected = exercise3_answer()
    cached = len(exercise3_ids(SYSTEM_BEFORE))
    if value == expected:
        return Feedback(True, f"{expected} of the {cached} cached positions: the K and V of a "
                        "position depend on every token before it, so the first token that "
                        "changes ends the reuse, however much of the text after it is the same. "
                        "Engines' advice: put what changes (dates, names) at the end.")
    if value == cached:
        return Feedback(False, "not all of them: the conversation after the system message is "
                        "the same text, but its K and V were computed after the old system "
                        "message. A position can only be reused if every token before it is "
                        "the same.")
    if value in (expected - 1, expected + 1):
        return Feedback(False, "off by one: count the tokens both conversations share from the "
                        "start (reusable_prefix does it), up to the first that differs.")
    if value == 0:
        return Feedback(False, "some positions survive: both conversations begin with the same "
                        "tokens, up to where the system messages differ.")
    if value == 3:
        return Feedback(False, "3 is the system turn's header alone: the two system messages "
                        "also begin with the same words, and those positions survive too.")
    return Feedback(False, f"not {value}. Render both conversations (exercise3_ids), then count "
                    "the tokens they share from the start.")


SOLUTIONS = {
    1: '''
c = exercises.LLAMA32_CONFIG
answer = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2   # 32,768
''',
    2: '''
def to_interleaved(W, n_heads):
    d_in, width = W.shape
    head_dim = width // n_heads
    # within each head: (2, dh/2) -> (dh/2, 2), so column 2i takes i and 2i + 1 takes i + dh/2
    return W.reshape(d_in, n_heads, 2, head_dim // 2).swapaxes(2, 3).reshape(d_in, width)
''',
    3: '''
from kvlib.chat import reusable_prefix
answer = reusable_prefix(exercises.exercise3_ids(exercises.SYSTEM_BEFORE),
                         exercises.exercise3_ids(exercises.SYSTEM_AFTER))
''',
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor)."""
    return show_solution(SOLUTIONS, number)
