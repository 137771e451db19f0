"""Exercises of the real_model lesson (a real model): checkers and solutions.

Exercise 1 is the offset bug of learned positions: a hand-written decode step that adds row
0 of the position table (wpe[0]) to every new token, so that each one looks like the first
token of a text. Nothing crashes; only the comparison with a full recomputation catches it.
Exercise 2 sizes the cache of another GPT-2 (XL) from its config, a transfer of the
notebook's formula. (Finding the head that decides a name, exercise 3 until the lesson was
split, is exercise 1 of the what_the_heads_read lesson, kvlib.exercises.what_the_heads_read.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib

from .base import (
    Feedback,
    checker,
    described,
    read_array,
    read_function,
    read_whole_number,
    show_solution,
)

# Exercise 1 ------------------------------------------------------------------------------

GPT2_TOY = kvlib.ModelConfig(positions="learned", norm="layer", bias=True)
"""The article's toy sizes (vocabulary 12, d_model 4, 2 heads, 3 blocks, 32 positions) with
GPT-2's architecture: learned positions, pre-LN layer norms and a final one, biases."""
STEP_CASES = ("How are you?", "How are you? I am", "I", "you are good and I am fine. How")
"""Texts the checker prefills (BOS added) before calling the student's decode step."""
GENERATION_PROMPT, GENERATION_STEPS = "How are you?", 8
WRONG_POSITIONS = (  # (positions of the new token given P cached ones, what to say)
    (lambda P: 0, "the new token got row 0 of the position table, wpe[0], as if it were "
                  "the first token of the text"),
    (lambda P: P - 1, "the new token got the position of the last cached token, P - 1: a "
                      "cache of P positions holds 0 .. P - 1, so the new token sits at P"),
    (lambda P: P + 1, "off by one: a cache of P positions holds 0 .. P - 1, so the new token "
                      "sits at P = len(cache), not P + 1"),
    (lambda P: None, "the new token got no position at all: GPT-2 adds a row of the position "
                     "table to every token, the new one too"),
)


@lru_cache(maxsize=1)
def gpt2_toy() -> kvlib.Params:
    """GPT2_TOY's seeded weights, made once; callers must not modify the arrays."""
    return kvlib.init_params(GPT2_TOY)


def decode_at_position(params, token: int, cache, position):
    """Reference decode step whose token gets row `position` of the position table (None:
    no position): logits (1, V). With position = len(cache) it is kvlib.decode_step."""
    config = params.config
    x = kvlib.embed(np.array([token]), params.embedding)
    if position is not None:
        x = kvlib.add_positions(x, params.position_table, [position])
    for index, layer in enumerate(params.layers):
        x = kvlib.decoder_block(x, layer, config.n_heads, cache=cache, layer_index=index,
                                norm_epsilon=config.norm_epsilon)
    x = kvlib.layer_norm(x, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return kvlib.unembed(x, params.embedding)


def _same_logits(logits: np.ndarray, reference: np.ndarray) -> bool:
    """Equal within 1e-6 of the logits' size: float64 rounding, or a float32 copy of the right
    logits, passes; a wrong position moves them by 1e-3 of their size or more."""
    scale = float(np.max(np.abs(reference)))
    with np.errstate(all="ignore"):
        return bool(np.all(np.abs(logits - reference) <= 1e-6 * scale))


def _logits_of(result, expected_shape) -> np.ndarray | str:
    """The student's return value as float logits, or what to say about it."""
    array = read_array(result, "logits")
    if isinstance(array, Feedback):
        return f"expected logits, an array of numbers of shape {expected_shape}, got " \
               f"{described(result)}"
    if array.shape != expected_shape:
        hint = " (one row of logits per call: the new token's)" if array.ndim == 2 else ""
        return f"expected logits of shape {expected_shape}, got {array.shape}{hint}"
    return array.astype(np.float64)


def _call(function, params, token, cache, where):
    """(logits or None, what to say or None): the student's step, errors put in words."""
    try:
        return function(params, token, cache), None
    except ValueError as error:
        if "layers of this cache hold different numbers" in str(error):
            return None, (f"{where}, your function raised: the cache's layers disagreed. "
                          "len(cache) was read after the first block had appended its K and "
                          "V: read the position once, before the blocks, as P = len(cache).")
        return None, f"{where}, your function raised ValueError: {error}"
    except Exception as error:  # a student's code may fail in any way; report it in words
        return None, f"{where}, your function raised {type(error).__name__}: {error}"


@checker
def check_decode_position(decode_step_fixed) -> Feedback:
    """Exercise 1: a fixed `decode_step_fixed(params, token, cache) -> logits (1, V)`.

    Runs it after prefills of several lengths and compares with kvlib.forward on the whole
    text; names the wrong position when the logits are those of another row of the position
    table; then generates with it alone and compares with kvlib.generate.
    """
    refused = read_function(decode_step_fixed, "decode_step_fixed", "decode_step_broken")
    if refused is not None:
        return refused
    params = gpt2_toy()
    tokenizer = kvlib.ToyTokenizer()
    vocab = params.config.vocab_size
    for text in STEP_CASES:
        ids = tokenizer.encode(text)
        P = len(ids)
        reference = kvlib.forward(params, ids)
        token = int(np.argmax(reference[-1]))
        where = (f"after a prefill of {text!r} ({P} positions, so the new token "
                 f"{tokenizer.vocabulary[token]!r} sits at {P})")
        _, cache = kvlib.prefill(params, ids)
        result, problem = _call(decode_step_fixed, params, token, cache, where)
        if problem:
            return Feedback(False, problem)
        logits = _logits_of(result, (1, vocab))
        if isinstance(logits, str):
            return Feedback(False, f"{where}: {logits}.")
        if len(cache) != P + 1:
            return Feedback(False, f"{where}: afterwards the cache should hold {P + 1} "
                            f"positions, it holds {len(cache)}. Pass the cache to every "
                            "decoder_block, with its layer_index, so that the new K and V are "
                            "appended.")
        expected = kvlib.forward(params, ids + [token])[-1:]
        if _same_logits(logits, expected):
            continue
        for position_of, words in WRONG_POSITIONS:
            position = position_of(P)
            if position is not None and not 0 <= position < params.config.context_length:
                continue
            _, fresh = kvlib.prefill(params, ids)
            wrong = decode_at_position(params, token, fresh, position)
            if _same_logits(logits, wrong):
                return Feedback(False, f"{where}, the logits differ from kvlib.forward on the "
                                f"whole text: {words}. The position is len(cache), read "
                                "before the blocks append anything.")
        return Feedback(False, f"{where}, the logits differ from kvlib.forward on the whole "
                        "text, and not as a wrong row of the position table would make them: "
                        "compare your step with kvlib.decode_step piece by piece (the position "
                        "row, the norm_epsilon, the final layer norm ln_f).")
    prompt = tokenizer.encode(GENERATION_PROMPT)
    logits, cache = kvlib.prefill(params, prompt)
    generated = [int(np.argmax(logits[-1]))]
    while len(generated) < GENERATION_STEPS:
        result, problem = _call(decode_step_fixed, params, generated[-1], cache,
                                f"in a generation after {GENERATION_PROMPT!r}")
        logits = _logits_of(result, (1, vocab)) if problem is None else problem
        if isinstance(logits, str):
            return Feedback(False, logits)
        generated.append(int(np.argmax(logits[-1])))
    expected = kvlib.generate(params, prompt, GENERATION_STEPS, use_cache=False)
    if generated != expected:
        return Feedback(False, f"one step at a time your function is right, but a generation of "
                        f"{GENERATION_STEPS} tokens after {GENERATION_PROMPT!r} gives "
                        f"{tokenizer.decode(generated)!r}, not {tokenizer.decode(expected)!r}.")
    return Feedback(True, f"after {len(STEP_CASES)} prefills of different lengths and in a "
                    f"generation of {GENERATION_STEPS} tokens, your step equals kvlib.forward: "
                    "the new token sits at position len(cache).")


# Exercise 2 ------------------------------------------------------------------------------

GPT2_XL = {"n_layers": 48, "d_model": 1600, "n_heads": 25, "context_length": 1024}
"""config.json of openai-community/gpt2-xl: n_layer 48, n_embd 1600, n_head 25, n_positions
1024 (1.56 billion parameters)."""
XL_DTYPE_BYTES = 2     # float16


def xl_cache_bytes(n_layers=48, d_model=1600, tokens=1024, dtype_bytes=XL_DTYPE_BYTES,
                   tensors=2) -> int:
    """tensors (K and V) x layers x tokens x d_model x bytes: the cache of one sequence."""
    return tensors * n_layers * tokens * d_model * dtype_bytes


def _xl_mistakes() -> dict[int, str]:
    exact = xl_cache_bytes()
    return {
        xl_cache_bytes(tensors=1): "half the answer: the cache holds K and V, two rows of "
                                   "d_model per token and layer (or you took 1 byte a "
                                   "number; float16 takes 2)",
        xl_cache_bytes(tensors=3): "that counts Q, K and V: Q is never cached (notebook 08), "
                                   "only K and V",
        xl_cache_bytes(dtype_bytes=4): "that is float32 (4 bytes a number); the question asks "
                                       "for float16, 2 bytes",
        xl_cache_bytes(tokens=1): "that is one token's K and V (the bytes per token); the "
                                  "cache is full: 1024 tokens",
        xl_cache_bytes(tokens=1000): "1000 tokens: GPT-2's context is 1024 positions",
        xl_cache_bytes(tokens=1023): "that counts 1023 tokens, one short: a full context "
                                     "holds positions 0 to 1023, 1024 tokens",
        xl_cache_bytes(tokens=1025): "that counts 1025 tokens, one too many: a full context "
                                     "holds positions 0 to 1023, 1024 tokens",
        25 * exact: "multiplied by the 25 heads: d_model = 25 heads x 64 already counts every "
                    "head's columns",
        xl_cache_bytes(d_model=64): "that is one head's 64 columns; every head is cached, "
                                    "d_model = 1600 columns in all",
        xl_cache_bytes(n_layers=12): "12 layers are GPT-2 small's; XL has 48",
        xl_cache_bytes(d_model=768): "768 is GPT-2 small's d_model; XL's is 1600",
        xl_cache_bytes(n_layers=1): "that is one layer; every one of the 48 layers caches its "
                                    "own K and V",
        exact // 2**20: "that is the answer in MiB (2**20 bytes); give it in bytes",
        exact // 10**6: "that looks like the answer in MB; give it in bytes",
    }


@checker
def check_xl_cache(answer) -> Feedback:
    """Exercise 2: bytes of GPT-2 XL's float16 cache for one sequence at its full context."""
    value = read_whole_number(answer, "a number of bytes")
    if isinstance(value, Feedback):
        return value
    exact = xl_cache_bytes()
    if value == exact:
        return Feedback(True, f"{exact:,} bytes = {exact / 2**20:.0f} MiB: 2 (K and V) x 48 "
                        f"layers x 1024 tokens x 1600 x 2 bytes, "
                        f"{exact // 1024:,} bytes a token: about a tenth of the model's 3.1 GB "
                        "of float16 weights, for one sequence.")
    mistakes = _xl_mistakes()
    if value in mistakes:
        return Feedback(False, f"{value:,}: {mistakes[value]}.")
    if value == round(exact / 2**20, 2) or value == round(exact / 1e6):
        return Feedback(False, "that is the answer in MiB or MB; give it in bytes.")
    if exact * 0.9 < value < exact * 1.1:
        return Feedback(False, f"{value:,} is close to the answer but not it "
                        f"({abs(value - exact) / exact:.1%} off): one factor is a little off. "
                        "Check each one against GPT-2 XL's config: 2 (K and V), layers, "
                        "tokens, d_model, bytes a number.")
    return Feedback(False, f"{value:,} is not it: multiply 2 (K and V) x layers x tokens x "
                    "the width of a cached row x bytes a number, with GPT-2 XL's sizes.")


# Solutions -------------------------------------------------------------------------------

SOLUTIONS = {
    1: """
def decode_step_fixed(params, token, cache):
    config = params.config
    x = kvlib.embed(np.array([token]), params.embedding)
    x = kvlib.add_positions(x, params.position_table, [len(cache)])   # the new token sits at P
    for index, layer in enumerate(params.layers):
        x = kvlib.decoder_block(x, layer, config.n_heads, cache=cache, layer_index=index,
                                norm_epsilon=config.norm_epsilon)
    x = kvlib.layer_norm(x, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return kvlib.unembed(x, params.embedding)

answer = decode_step_fixed
""",
    2: """
layers, d_model, tokens, float16 = 48, 1600, 1024, 2
answer = 2 * layers * tokens * d_model * float16     # K and V: 314,572,800 bytes, 300 MiB
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
