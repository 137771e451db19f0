"""Exercises of the prefill lesson (prefill): checkers and solutions.

1. The keys layer 2 caches for another prompt, from the weights only (a transfer task).
2. The bytes of a float32 cache of 20 tokens.
3. A classic cache bug: a server that keeps one cache for every request and never empties
   it, so each new prompt attends to the keys and values of the prompts before it.
"""

from __future__ import annotations

import numpy as np

import kvlib

from .base import (
    Feedback,
    article_example,
    check_array,
    checker,
    read_array,
    read_function,
    read_whole_number,
    show_solution,
)

EXERCISE1_PROMPT = "I am fine"
EXERCISE1_LAYER = 2
EXERCISE_TOKENS = 20
PRINTED_PRECISION = 1e-3    # the notebook prints arrays at 3 decimals: rounded answers pass
EARLIER_REQUEST = "good and you"   # left in an empty server_cache before the checker's requests
SERVED_PROMPTS = ("How are you?", "I am fine and you?", "you are good", "?",
                  "How are you? I am good and you?")


def _layer_inputs(params, ids):
    """The input of every block, X_0 (the embeddings) to X_L (the last block's output)."""
    X = kvlib.embed(np.asarray(ids), params.embedding)
    mask = kvlib.causal_mask(len(ids))
    inputs = [X]
    for layer in params.layers:
        X = kvlib.decoder_block(X, layer, params.config.n_heads, mask)
        inputs.append(X)
    return inputs


@checker
def check_layer_keys(answer) -> Feedback:
    """Exercise 1: the keys layer 2 caches for "I am fine" (4, 4), computed from that layer's
    input X2 (the output of blocks 0 and 1)."""
    name = "answer"
    answer = read_array(answer, name)
    if isinstance(answer, Feedback):
        return answer
    params, article_ids = article_example()
    tokenizer = kvlib.ToyTokenizer()
    ids = tokenizer.encode(EXERCISE1_PROMPT)
    inputs = _layer_inputs(params, ids)
    L = EXERCISE1_LAYER
    layer = params.layers[L]
    expected = inputs[L] @ layer.Wk
    if answer.shape == (len(article_ids), params.config.d_model):
        return Feedback(False, f"shape {answer.shape}: 5 rows, the length of \"How are you?\". "
                        f"The exercise is about {EXERCISE1_PROMPT!r}: "
                        f"tokenizer.encode({EXERCISE1_PROMPT!r}) gives {len(ids)} ids, BOS "
                        "included.")
    if answer.shape == (len(ids) - 1, params.config.d_model):
        return Feedback(False, f"{len(ids) - 1} rows: the BOS token is missing. The cache "
                        "keeps a row for every position of the prompt, BOS included.")
    if answer.shape == expected.shape:
        for index, X in enumerate(inputs):
            if index != L and np.allclose(answer, X @ layer.Wk):
                what = "the embeddings" if index == 0 else f"block {index - 1}'s output X{index}"
                return Feedback(False, f"you multiplied {what} by layer {L}'s Wk. Layer {L}'s "
                                f"input is X{L}, the output of blocks 0 to {L - 1}: run them "
                                "first.")
        for index, other in enumerate(params.layers):
            if index != L and np.allclose(answer, inputs[L] @ other.Wk):
                return Feedback(False, f"right input, but layer {index}'s Wk: every layer has "
                                f"its own weights, params.layers[{L}].Wk here.")
        if np.allclose(answer, inputs[L] @ layer.Wq):
            return Feedback(False, f"those are layer {L}'s queries (Wq). The cache keeps keys "
                            "and values, never queries.")
        if np.allclose(answer, inputs[L] @ layer.Wv):
            return Feedback(False, f"those are layer {L}'s values (Wv); the exercise asks for "
                            "the keys (Wk).")
        unmasked = _unmasked_input(params, ids, L)
        if np.allclose(answer, unmasked @ layer.Wk):
            return Feedback(False, "close: the right layer and weights, but blocks 0 and 1 ran "
                            "without the causal mask, so early rows saw later tokens. Pass "
                            "kvlib.causal_mask(len(ids)) to every block.")
    return check_array(answer.astype(np.float64), expected, name, atol=PRINTED_PRECISION,
                       hint=f"Run blocks 0 to {L - 1} on the embeddings of {EXERCISE1_PROMPT!r} "
                            f"(with the causal mask), then multiply by params.layers[{L}].Wk.")


def _unmasked_input(params, ids, layer_index):
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for layer in params.layers[:layer_index]:
        X = kvlib.decoder_block(X, layer, params.config.n_heads, None)
    return X


@checker
def check_cache_bytes(answer) -> Feedback:
    """Exercise 2: bytes of the cache after prefilling 20 tokens into the float32 toy model."""
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    config = kvlib.ModelConfig(dtype="float32")
    layers, d, T, size = config.n_layers, config.d_model, EXERCISE_TOKENS, 4
    expected = kvlib.kv_cache_bytes(n_layers=layers, d_model=d, seq_len=T, dtype_bytes=size)
    mistakes = {
        layers * T * d * size: "that is K or V, not both: the cache holds two tensors per "
                               "layer, so multiply by 2.",
        2 * T * d * size: "that is one layer's cache: each of the 3 layers keeps its own K "
                          "and V.",
        2 * layers * T * d * 8: "float32 numbers take 4 bytes each, not 8 (that is float64, "
                                "the default).",
        3 * layers * T * d * size: "that counts queries too: the cache keeps K and V only.",
        2 * layers * T * d * size * 8: "that is in bits; the answer is in bytes (8 bits each).",
        2 * layers * T * d: "that is the number of cached numbers; each float32 takes 4 bytes.",
        2 * layers * config.context_length * d * size: "that is the whole buffer the cache "
                                                       "reserves, 32 positions (the context "
                                                       "length); cache.nbytes counts the 20 "
                                                       "filled positions.",
    }
    if value == expected:
        return Feedback(True, f"{expected} bytes = 2 (K and V) x {layers} layers x {T} tokens "
                        f"x {d} numbers x {size} bytes. Check it: prefill 20 tokens into a "
                        "float32 model and read cache.nbytes.")
    if value in mistakes:
        return Feedback(False, mistakes[value])
    return Feedback(False, f"{value} bytes is not it. Count: 2 tensors (K and V) x layers x "
                    "tokens x d_model numbers x bytes per number.")


@checker
def check_serve(serve, server_cache=None) -> Feedback:
    """Exercise 3: a fixed `serve(prompt_ids) -> last row of the logits (V,)` that still keeps
    its one `server_cache` (give it too: check_serve(answer, server_cache)).

    Serves several unrelated prompts one after the other, then the first again, and compares
    each answer with kvlib.forward on that prompt alone. After each request server_cache must
    hold that prompt (or, for a function that cleans up after itself, nothing): a function
    that makes a new cache per request works, but is not the fix the server asked for.
    """
    refused = read_function(serve, "serve_fixed", "serve_broken")
    if refused is not None:
        return refused
    if server_cache is None:
        return Feedback(False, "give the server's cache too, so that the checker can see how "
                        "it is used: exercises.check_serve(answer, server_cache).")
    if not isinstance(server_cache, kvlib.KVCache):
        return Feedback(False, "the second argument should be the server's KVCache, "
                        f"server_cache, not {type(server_cache).__name__}.")
    params, _ = article_example()
    if server_cache.config != params.config:
        return Feedback(False, "server_cache was made for another model: make it with "
                        "kvlib.KVCache(params.config).")
    if len(server_cache) == 0:   # a running server's cache always holds an earlier request
        kvlib.prefill(params, kvlib.ToyTokenizer().encode(EARLIER_REQUEST), server_cache)
        stale_note = (f" (The checker first served {EARLIER_REQUEST!r} into server_cache, as an "
                      f"earlier request would: it held {len(server_cache)} positions.)")
    else:
        stale_note = (f" (server_cache already held {len(server_cache)} positions from earlier "
                      "cells, the requests served above.)")
    prompts = list(SERVED_PROMPTS) + [SERVED_PROMPTS[0]]   # the first again, after the others
    tokenizer = kvlib.ToyTokenizer()
    used = False
    for number, text in enumerate(prompts, start=1):
        ids = tokenizer.encode(text)
        before = len(server_cache)
        got = _serve_once(serve, ids, number, params.config.vocab_size)
        if isinstance(got, Feedback):
            return got
        if not np.allclose(got, kvlib.forward(params, ids)[-1], atol=1e-10):
            return _wrong_request(serve, ids, text, number, got, params, stale_note)
        used = used or len(server_cache) != before or _holds_the_prompt(server_cache, params, ids)
    if not used:
        return Feedback(False, "every answer is right, but server_cache is never used: after "
                        "each request it still holds what it held before. A new cache per "
                        "request (or kvlib.forward) is what the server wanted to avoid. Keep "
                        "server_cache and empty it (cache.reset()) before each new prompt.")
    return Feedback(True, f"{len(prompts)} requests in a row, each equal to kvlib.forward on "
                    "its own prompt, all served from the one server_cache: every request "
                    "starts from an empty cache." + stale_note)


def _holds_the_prompt(cache, params, ids) -> bool:
    if len(cache) != len(ids):
        return False
    _, reference = kvlib.prefill(params, ids)
    return all(np.allclose(cache.keys(layer), reference.keys(layer))
               for layer in range(params.config.n_layers))


def _wrong_request(serve, ids, text, number, got, params, stale_note) -> Feedback:
    stale = (f"request {number} ({text!r}) differs from kvlib.forward on that prompt alone: "
             "it still attends to the keys and values of the prompts before it, which stay in "
             "the cache.{} Empty the cache (cache.reset()) before prefilling an unrelated "
             "prompt.")
    if number > 1:
        return Feedback(False, stale.format(stale_note))
    again = _serve_once(serve, ids, number + 1, params.config.vocab_size)
    if isinstance(again, Feedback):
        return again
    if not np.allclose(again, got, atol=1e-10):
        return Feedback(False, stale.format(stale_note + " Served again, the same prompt got "
                                            "a different answer."))
    if np.allclose(got, kvlib.forward(params, ids)[0], atol=1e-10):
        return Feedback(False, "that is the first row of the logits, the guess after BOS: "
                        "return the last row, logits[-1].")
    return Feedback(False, "even a prompt served by itself gives different logits from "
                    "kvlib.forward on it: return the last row of the prefill's logits, "
                    "logits[-1].")


def _serve_once(serve, ids, number: int, vocab_size: int):
    """The student's answer to one request, as a flat array (V,), or Feedback on failure."""
    try:
        got = serve(list(ids))
    except ValueError as error:
        if "full" in str(error) or "context" in str(error):
            return Feedback(False, f"request {number} failed: the cache filled up after a few "
                            f"prompts ({error}). Nothing empties it between unrelated prompts: "
                            "call server_cache.reset() for each request.")
        return Feedback(False, f"request {number} raised ValueError: {error}")
    except Exception as error:  # a student's code may fail in any way; report it in words
        return Feedback(False, f"request {number} raised {type(error).__name__}: {error}")
    array = read_array(got, "what serve returns")
    if isinstance(array, Feedback):
        return Feedback(False, f"serve should return the last row of the logits, {vocab_size} "
                        f"numbers, got {type(got).__name__}.")
    if array.size != vocab_size:
        return Feedback(False, f"serve should return the last row of the logits, {vocab_size} "
                        f"numbers, got shape {array.shape}.")
    return array.reshape(-1).astype(np.float64)


SOLUTIONS = {
    1: """
new_ids = tokenizer.encode("I am fine")                # BOS first: 4 ids
mask = kvlib.causal_mask(len(new_ids))
X = kvlib.embed(np.array(new_ids), params.embedding)   # X0
for layer in params.layers[:2]:                        # blocks 0 and 1 -> X2, layer 2's input
    X = kvlib.decoder_block(X, layer, params.config.n_heads, mask)
answer = X @ params.layers[2].Wk                       # (4, 4)
""",
    2: """
answer = 2 * 3 * 20 * 4 * 4   # K and V x layers x tokens x d_model x 4 bytes (float32) = 1920
# Check with a real cache:
config32 = kvlib.ModelConfig(dtype="float32")
_, cache32 = kvlib.prefill(kvlib.init_params(config32), [0] * 20)
assert cache32.nbytes == answer
""",
    3: """
def serve_fixed(prompt_ids):
    server_cache.reset()   # a new, unrelated prompt: forget the previous one's K and V
    logits, _ = kvlib.prefill(params, prompt_ids, server_cache)
    return logits[-1]

answer = serve_fixed
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
