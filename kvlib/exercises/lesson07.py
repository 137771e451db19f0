"""Exercises of notebook 07 (prefill): checkers and solutions.

Exercise 3 is a classic cache bug: a server that keeps one cache for every request and never
empties it, so each new prompt attends to the keys and values of the prompts before it.
"""

from __future__ import annotations

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

EXERCISE_LAYER = 1
EXERCISE_TOKENS = 20
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


def check_layer_keys(answer) -> Feedback:
    """Exercise 1: layer 1's cached keys (5, 4), computed from that layer's input."""
    name = "answer"
    if (feedback := not_an_array_answer(answer, name)) is not None:
        return feedback
    params, ids = article_example()
    inputs = _layer_inputs(params, ids)
    layer = params.layers[EXERCISE_LAYER]
    expected = inputs[EXERCISE_LAYER] @ layer.Wk
    if isinstance(answer, np.ndarray) and answer.shape == expected.shape:
        if np.allclose(answer, inputs[0] @ layer.Wk):
            return Feedback(False, "you multiplied the embeddings by layer 1's Wk. Layer 1 does "
                            "not read the embeddings: its input is layer 0's output, X1.")
        if np.allclose(answer, inputs[EXERCISE_LAYER + 1] @ layer.Wk):
            return Feedback(False, "you used layer 1's output (X2). The keys of a layer come "
                            "from that layer's input, X1, before its attention and MLP.")
        if np.allclose(answer, inputs[EXERCISE_LAYER] @ params.layers[0].Wk):
            return Feedback(False, "right input, but layer 0's Wk: every layer has its own "
                            "weights, params.layers[1].Wk here.")
        if np.allclose(answer, inputs[EXERCISE_LAYER] @ layer.Wq):
            return Feedback(False, "those are layer 1's queries (Wq). The cache keeps keys and "
                            "values, never queries.")
        if np.allclose(answer, inputs[EXERCISE_LAYER] @ layer.Wv):
            return Feedback(False, "those are layer 1's values (Wv); the exercise asks for the "
                            "keys (Wk).")
    return check_array(answer, expected, name,
                       hint="Multiply layer 1's input X1 by params.layers[1].Wk.")


def check_cache_bytes(answer) -> Feedback:
    """Exercise 2: bytes of the cache after prefilling 20 tokens into the float32 toy model."""
    if is_missing(answer):
        return Feedback(False, "answer is not filled in yet: replace the ... with a number.")
    if isinstance(answer, bool) or not isinstance(answer, (int, np.integer, float, np.floating)):
        return Feedback(False, f"expected a number of bytes, got {type(answer).__name__}.")
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
    }
    if answer == expected:
        return Feedback(True, f"{expected} bytes = 2 (K and V) x {layers} layers x {T} tokens "
                        f"x {d} numbers x {size} bytes. Check it: prefill 20 tokens into a "
                        "float32 model and read cache.nbytes.")
    if answer in mistakes:
        return Feedback(False, mistakes[answer])
    return Feedback(False, f"{answer} is not it. Count: 2 tensors (K and V) x layers x tokens "
                    "x d_model numbers x bytes per number.")


def check_serve(serve) -> Feedback:
    """Exercise 3: a fixed `serve(prompt_ids) -> last row of the logits (V,)`.

    Serves several unrelated prompts one after the other, then the first again, and compares
    each answer with kvlib.forward on that prompt alone.
    """
    if is_missing(serve):
        return Feedback(False, "your fixed function is not filled in yet: write it, then set "
                        "answer = your function (without calling it).")
    if not callable(serve):
        return Feedback(False, f"answer should be a function, like serve_broken, not "
                        f"{type(serve).__name__}: write answer = serve_fixed, without ().")
    params, _ = article_example()
    prompts = list(SERVED_PROMPTS) + [SERVED_PROMPTS[0]]   # the first again, after the others
    tokenizer = kvlib.ToyTokenizer()
    for number, text in enumerate(prompts, start=1):
        ids = tokenizer.encode(text)
        got = _serve_once(serve, ids, number, params.config.vocab_size)
        if isinstance(got, Feedback):
            return got
        if np.allclose(got, kvlib.forward(params, ids)[-1], atol=1e-10):
            continue
        stale = (f"request {number} ({text!r}) differs from kvlib.forward on that prompt "
                 "alone: it still attends to the keys and values of the prompts before it, "
                 "which stay in the cache.{} Empty the cache (cache.reset()) before prefilling "
                 "an unrelated prompt.")
        if number > 1:
            return Feedback(False, stale.format(""))
        again = _serve_once(serve, ids, number + 1, params.config.vocab_size)
        if isinstance(again, Feedback):
            return again
        if not np.allclose(again, got, atol=1e-10):
            return Feedback(False, stale.format(" Served again, the same prompt got a "
                                                "different answer."))
        return Feedback(False, "even a prompt served by itself gives different logits from "
                        "kvlib.forward on it: return the last row of the prefill's logits, "
                        "logits[-1].")
    return Feedback(True, f"{len(prompts)} requests in a row, each equal to kvlib.forward on "
                    "its own prompt: every request starts from an empty cache.")


def _serve_once(serve, ids, number: int, vocab_size: int):
    """The student's answer to one request, as a flat array (V,), or Feedback on failure."""
    try:
        got = serve(list(ids))
    except ValueError as error:
        if "full" in str(error) or "context" in str(error):
            return Feedback(False, f"request {number} failed: the cache filled up after a few "
                            f"prompts ({error}). Nothing empties it between unrelated prompts: "
                            "call cache.reset() (or use a new KVCache) for each request.")
        return Feedback(False, f"request {number} raised ValueError: {error}")
    except Exception as error:  # a student's code may fail in any way; report it in words
        return Feedback(False, f"request {number} raised {type(error).__name__}: {error}")
    try:
        got = np.asarray(got, dtype=float)
    except (TypeError, ValueError):
        return Feedback(False, f"serve should return the last row of the logits, {vocab_size} "
                        f"numbers, got {type(got).__name__}.")
    if got.size != vocab_size:
        return Feedback(False, f"serve should return the last row of the logits, {vocab_size} "
                        f"numbers, got shape {got.shape}.")
    return got.reshape(-1)


SOLUTIONS = {
    1: """
X1 = kvlib.decoder_block(X0, params.layers[0], 2, kvlib.causal_mask(5))   # layer 1's input
answer = X1 @ params.layers[1].Wk
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
