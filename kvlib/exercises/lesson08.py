"""Exercises of notebook 08 (KV-cached decode): checkers and solutions.

Exercise 2 is a classic cache bug: a chunked prefill whose causal mask is aligned to the
start instead of the end, so the new tokens cannot see all the cached positions.
Exercise 3 is the generation loop, where the classic slip is feeding a token twice.
"""

from __future__ import annotations

import math

import numpy as np

import kvlib

from .base import (
    Feedback,
    article_example,
    check_array,
    is_missing,
    not_an_array_answer,
    show_solution,
)

EXERCISE_TOKEN = 5  # "I", the token chosen after "How are you?"
CHUNK_CASES = (  # (text already in the cache, new chunk); the tokenizer adds BOS to the first
    ("How are you?", "I am fine"),
    ("How", "are you? I am fine."),
    ("How are you? I", "am"),
    ("you are good and I am", "fine. How are you?"),
    ("", "How are you?"),
)
GENERATION_CASES = (("How are you?", 10), ("I am", 6), ("?", 3), ("How are you? I am fine.", 1))


# Exercise 1 ------------------------------------------------------------------------------

def check_decode_weights(answer) -> Feedback:
    """Exercise 1: the new token's layer-0 attention weights, per head: (2, 1, 6)."""
    name = "answer"
    if (feedback := not_an_array_answer(answer, name)) is not None:
        return feedback
    params, ids = article_example()
    n_heads = params.config.n_heads
    recorded = []
    _, cache = kvlib.prefill(params, ids)
    cached_keys = cache.keys(0).copy()
    kvlib.decode_step(params, EXERCISE_TOKEN, cache, record_attention=recorded)
    expected = recorded[0]
    x = kvlib.embed(np.array([EXERCISE_TOKEN]), params.embedding)
    q, k, _ = kvlib.project_qkv(x, params.layers[0])
    qh = kvlib.split_heads(q, n_heads)
    Kh = kvlib.split_heads(np.vstack([cached_keys, k]), n_heads)
    raw = qh @ Kh.swapaxes(-1, -2)
    if not isinstance(answer, np.ndarray):
        return check_array(answer, expected, name)
    if answer.shape == (n_heads, 1, len(ids)):
        return Feedback(False, "one weight short: the new token attends to itself too. Append "
                        "its k to the 5 cached keys first, so that there are 6.")
    if answer.shape in {(1, len(ids) + 1), (len(ids) + 1,)}:
        return Feedback(False, "one row of 6 weights: the exercise asks for every head. Split q "
                        "and K into heads (kvlib.split_heads) to get shape (2, 1, 6).")
    if answer.ndim >= 2 and answer.shape[-2:] == (len(ids) + 1, len(ids) + 1):
        return Feedback(False, "6 query rows: that recomputes every position. In a decode "
                        "step only the new token asks a question: one query row per head.")
    if answer.shape == expected.shape:
        if np.allclose(answer, kvlib.softmax(raw)):
            return Feedback(False, "not scaled: divide the scores by sqrt(head size) = "
                            f"sqrt({params.config.head_dim}) before the softmax.")
        if np.allclose(answer, raw / math.sqrt(params.config.head_dim)) or \
                np.allclose(answer, raw):
            return Feedback(False, "those are scores, not weights: apply the softmax along the "
                            "last axis, so that each head's row adds up to 1.")
        if np.allclose(answer, 1.0):
            return Feedback(False, "every weight is 1: the softmax ran over the wrong axis. "
                            "Take it along the last axis (the 6 keys).")
    return check_array(answer, expected, name,
                       hint="Scaled scores of q against all 6 keys, per head, then softmax.")


# Exercise 2 ------------------------------------------------------------------------------

def _ids(text: str, first: bool) -> list[int]:
    tokenizer = kvlib.ToyTokenizer()
    return tokenizer.encode(text, add_bos=first) if text or first else []


def _chunk_cases():
    for before, chunk in CHUNK_CASES:
        cached = _ids(before, first=True) if before else []
        yield cached, _ids(chunk, first=not before)


def _prefilled_cache(params, cached_ids):
    cache = kvlib.KVCache(params.config)
    if cached_ids:
        kvlib.prefill(params, cached_ids, cache)
    return cache


def _chunk_with_mask(params, cached_ids, ids, mask):
    """Reference chunked prefill with a given mask (T_new, S) or None: logits (T_new, V)."""
    cache = _prefilled_cache(params, cached_ids)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, params.config.n_heads, mask, cache, index)
    return kvlib.unembed(X, params.embedding)


def check_chunked_prefill(prefill_chunk) -> Feedback:
    """Exercise 2: a fixed `prefill_chunk(params, ids, cache) -> logits (T_new, V)`.

    Runs it on several splits of a text into (already cached, new chunk), including a first
    chunk on an empty cache, and compares with kvlib.forward on the whole text.
    """
    if is_missing(prefill_chunk):
        return Feedback(False, "your fixed function is not filled in yet: write it, then set "
                        "answer = your function (without calling it).")
    if not callable(prefill_chunk):
        return Feedback(False, f"answer should be a function like prefill_chunk_broken, not "
                        f"{type(prefill_chunk).__name__}: write answer = prefill_chunk_fixed.")
    params, _ = article_example()
    tokenizer = kvlib.ToyTokenizer()
    for cached_ids, ids in _chunk_cases():
        P, T = len(cached_ids), len(ids)
        where = (f"continuing a cache of {P} positions ({tokenizer.decode(cached_ids)!r}) with "
                 f"{T} new tokens ({tokenizer.decode(ids)!r})" if P else
                 f"on an empty cache with {T} tokens ({tokenizer.decode(ids)!r})")
        cache = _prefilled_cache(params, cached_ids)
        try:
            logits = prefill_chunk(params, list(ids), cache)
        except ValueError as error:
            if "mask" in str(error):
                return Feedback(False, f"{where}, your function raised: {error}. The mask needs "
                                f"one row per new token and one column per position the "
                                f"queries see, cached and new: ({T}, {P + T}) here.")
            return Feedback(False, f"{where}, your function raised ValueError: {error}")
        except Exception as error:  # a student's code may fail in any way; report it in words
            return Feedback(False, f"{where}, your function raised {type(error).__name__}: "
                            f"{error}")
        expected = kvlib.forward(params, cached_ids + ids)[P:]
        try:
            logits = np.asarray(logits, dtype=float)
        except (TypeError, ValueError):
            return Feedback(False, f"{where}: expected logits, an array of numbers of shape "
                            f"{expected.shape}, got {type(logits).__name__}.")
        if logits.shape != expected.shape:
            return Feedback(False, f"{where}: expected logits of shape {expected.shape} (one "
                            f"row per new token), got {logits.shape}.")
        if len(cache) != P + T:
            return Feedback(False, f"{where}: afterwards the cache should hold {P + T} "
                            f"positions, it holds {len(cache)}. Pass the cache to every "
                            "decoder_block so that the new K and V are appended.")
        if np.allclose(logits, expected, atol=1e-10):
            continue
        if np.allclose(logits, _chunk_with_mask(params, cached_ids, ids,
                                                np.tri(T, P + T, dtype=bool)), atol=1e-10):
            return Feedback(False, f"{where}, the logits differ from kvlib.forward on the whole "
                            "text: the new tokens cannot see all the cached positions. Is the "
                            f"mask aligned to the end? New token i sits at position {P} + i and "
                            f"must see keys 0 to {P} + i (kvlib.causal_mask(T_new, S), or "
                            "np.tri(T_new, S, k=S - T_new)).")
        if np.allclose(logits, _chunk_with_mask(params, cached_ids, ids, None), atol=1e-10):
            return Feedback(False, f"{where}, the new tokens see the new tokens after them: "
                            "there is no causal mask among them. They see every cached "
                            "position, and among themselves only the earlier ones.")
        if P == 0:
            return Feedback(False, f"{where}, the logits differ from kvlib.forward: on an empty "
                            "cache a chunk is an ordinary prompt, with the usual lower "
                            "triangular mask.")
        return Feedback(False, f"{where}, the logits differ from kvlib.forward on the whole "
                        "text. Print your mask for this case and compare it with "
                        f"kvlib.causal_mask({T}, {P + T}).")
    return Feedback(True, f"all {len(CHUNK_CASES)} splits give the logits of kvlib.forward on "
                    "the whole text, including a first chunk on an empty cache.")


# Exercise 3 ------------------------------------------------------------------------------

def _generate_feeding_last_prompt_token_again(params, ids, n):
    """The classic slip: after prefill, decode the prompt's last token once more."""
    _, cache = kvlib.prefill(params, ids)
    token, new = ids[-1], []
    for _ in range(n):
        token = int(np.argmax(kvlib.decode_step(params, token, cache)[-1]))
        new.append(token)
    return new


def check_generation_loop(my_generate) -> Feedback:
    """Exercise 3: a greedy `my_generate(params, ids, n) -> n new ids` with prefill and decode_step.

    Compares with kvlib.generate(..., use_cache=False) on several prompts, and counts the
    calls to kvlib.decode_step to see that the cache is used.
    """
    if is_missing(my_generate):
        return Feedback(False, "your function is not filled in yet: write it, then set "
                        "answer = your function (without calling it).")
    if not callable(my_generate):
        return Feedback(False, f"answer should be a function, not {type(my_generate).__name__}: "
                        "write answer = my_generate, without ().")
    params, _ = article_example()
    tokenizer = kvlib.ToyTokenizer()
    original = kvlib.decode_step
    calls = []

    def counting_decode_step(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for text, n in GENERATION_CASES:
        ids = tokenizer.encode(text)
        expected = kvlib.generate(params, ids, n, use_cache=False)
        calls.clear()
        kvlib.decode_step = counting_decode_step  # restored below, whatever happens
        try:
            got = my_generate(params, list(ids), n)
        except Exception as error:  # a student's code may fail in any way; report it in words
            return Feedback(False, f"on {text!r} with n={n}, your function raised "
                            f"{type(error).__name__}: {error}")
        finally:
            kvlib.decode_step = original
        try:
            got = [int(token) for token in got]
        except (TypeError, ValueError):
            return Feedback(False, f"expected a list of token ids, got {got!r}.")
        if got == list(ids) + expected:
            return Feedback(False, "your list starts with the prompt: return only the n new "
                            "tokens.")
        if len(got) != n:
            return Feedback(False, f"on {text!r} you returned {len(got)} tokens; asked for "
                            f"n={n} new ones.")
        if got != expected:
            if got == _generate_feeding_last_prompt_token_again(params, ids, n):
                return Feedback(False, "the prompt's last token went into the cache twice: "
                                "prefill already cached it. The first token to decode is the "
                                "one chosen from the prefill's last row of logits.")
            return Feedback(False, f"on {text!r} you generated "
                            f"{tokenizer.decode(got)!r}; greedy decoding gives "
                            f"{tokenizer.decode(expected)!r}.")
        if n > 1 and not calls:
            return Feedback(False, "the tokens are right, but kvlib.decode_step was never "
                            "called: write the loop with kvlib.prefill and kvlib.decode_step, "
                            "so that each new token uses the cache.")
    return Feedback(True, "the same tokens as recomputing everything, with one prefill and "
                    "one decode_step per further token.")


SOLUTIONS = {
    1: """
_, cache_ex = kvlib.prefill(params, ids)             # a fresh cache holding the 5 prompt rows
x = kvlib.embed(np.array([5]), params.embedding)     # token 5 ("I"): (1, 4)
q, k, v = kvlib.project_qkv(x, params.layers[0])     # (1, 4) each
K_all = np.vstack([cache_ex.keys(0), k])             # (6, 4): its own key too
answer = kvlib.softmax(kvlib.attention_scores(kvlib.split_heads(q, 2),
                                              kvlib.split_heads(K_all, 2)))   # (2, 1, 6)
""",
    2: """
def prefill_chunk_fixed(params, ids, cache):
    T_new, S = len(ids), len(cache) + len(ids)
    mask = kvlib.causal_mask(T_new, S)   # aligned to the end: new token i sees keys 0..S-T_new+i
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, params.config.n_heads, mask, cache, index)
    return kvlib.unembed(X, params.embedding)

answer = prefill_chunk_fixed
""",
    3: """
def my_generate(params, ids, n):
    logits, cache = kvlib.prefill(params, ids)      # the prompt, once
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n:
        logits = kvlib.decode_step(params, new[-1], cache)   # only the newest token goes in
        new.append(int(np.argmax(logits[-1])))
    return new

answer = my_generate
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
