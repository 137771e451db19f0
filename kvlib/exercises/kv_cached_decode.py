"""Exercises of the kv_cached_decode lesson (KV-cached decode): checkers and solutions.

Exercise 2 is a classic cache bug: a chunked prefill whose causal mask is aligned to the
start instead of the end, so the new tokens cannot see all the cached positions.
Exercise 3 is the generation loop, where the classic slip is feeding a token twice.
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
    show_solution,
    shown,
)

EXERCISE1_CACHED = "How are you? I"   # in the cache before the step: 6 positions
EXERCISE1_TOKEN = 2                   # "am", the token decoded
PRINTED_PRECISION = 1e-3              # the notebook prints arrays at 3 decimals
CHUNK_CASES = (  # (text already in the cache, new chunk); the tokenizer adds BOS to the first
    ("How are you?", "I am fine"),
    ("How", "are you? I am fine."),
    ("How are you? I", "am"),
    ("you are good and I am", "fine. How are you?"),
    ("", "How are you?"),
)
GENERATION_CASES = (  # the first two: prompts where the usual wrong loops choose other tokens
    ("you are fine.", 8), ("I am fine and", 8), ("How are you?", 10), ("I am", 6), ("?", 3),
    ("How are you? I am fine.", 1),
)


# Exercise 1 ------------------------------------------------------------------------------

def _decode_step_pieces(params, cached_ids, token):
    """Layer 0 of a decode step done by hand: (the new q split into heads (h, 1, dh), the cached
    keys (S - 1, d), the new k (1, d))."""
    _, cache = kvlib.prefill(params, cached_ids)
    x = kvlib.embed(np.array([token]), params.embedding)
    q, k, _ = kvlib.project_qkv(x, params.layers[0])
    return kvlib.split_heads(q, params.config.n_heads), cache.keys(0).copy(), k


@checker
def check_decode_weights(answer) -> Feedback:
    """Exercise 1: the layer-0 attention weights, per head, of the step that decodes "am"
    (token 2) after "How are you? I" is in the cache: (2, 1, 7)."""
    name = "answer"
    answer = read_array(answer, name)
    if isinstance(answer, Feedback):
        return answer
    params, article_ids = article_example()
    config = params.config
    cached_ids = kvlib.ToyTokenizer().encode(EXERCISE1_CACHED)
    S = len(cached_ids) + 1
    recorded = []
    _, cache = kvlib.prefill(params, cached_ids)
    kvlib.decode_step(params, EXERCISE1_TOKEN, cache, record_attention=recorded)
    expected = recorded[0]
    qh, cached_keys, k = _decode_step_pieces(params, cached_ids, EXERCISE1_TOKEN)

    def weights_over(keys, mask=None):
        return kvlib.attention_weights(qh, kvlib.split_heads(keys, config.n_heads), mask)

    raw = qh @ kvlib.split_heads(np.vstack([cached_keys, k]), config.n_heads).swapaxes(-1, -2)
    if answer.shape == (config.n_heads, 1, S - 1):
        if np.allclose(answer, weights_over(cached_keys)):
            return Feedback(False, "one weight short: the new token attends to itself too. "
                            f"Append its k to the {S - 1} cached keys first, so that there "
                            f"are {S}.")
        article_step = kvlib.attention_weights(*_article_step(params, article_ids))
        if np.allclose(answer, article_step):
            return Feedback(False, "that is the notebook's step, decoding 'I' after 'How are "
                            "you?'. Here 'I' is already in the cache and 'am' (token 2) "
                            f"is decoded: prefill {EXERCISE1_CACHED!r}, 6 positions, and the "
                            "new token makes 7.")
        return Feedback(False, f"shape {answer.shape}: the cache should hold "
                        f"{EXERCISE1_CACHED!r}, {S - 1} positions, and the new token's own key "
                        f"makes {S}: expected {expected.shape}.")
    if answer.shape in {(1, S), (S,)}:
        return Feedback(False, f"one row of {S} weights: the exercise asks for every head. "
                        "Split q and K into heads (kvlib.split_heads) to get shape "
                        f"{expected.shape}.")
    if answer.ndim >= 2 and answer.shape[-2:] == (S, S):
        return Feedback(False, f"{S} query rows: that recomputes every position. In a decode "
                        "step only the new token asks a question: one query row per head.")
    if answer.shape == expected.shape:
        if np.allclose(answer, weights_over(np.vstack([cached_keys, k]),
                                            np.tri(1, S, dtype=bool))):
            return Feedback(False, "the new token sees only position 0 (BOS): that is a causal "
                            "mask aligned to the start, np.tri(1, S) or np.tril. The new query "
                            f"is the newest position, {S - 1}; aligned to the end "
                            f"(kvlib.causal_mask(1, {S})) the mask lets all {S} keys through, "
                            "which is why a decode step needs no mask at all.")
        if np.allclose(answer, kvlib.softmax(raw)):
            return Feedback(False, "not scaled: divide the scores by sqrt(head size) = "
                            f"sqrt({config.head_dim}) before the softmax.")
        if np.allclose(answer, raw / np.sqrt(config.head_dim)) or np.allclose(answer, raw):
            return Feedback(False, "those are scores, not weights: apply the softmax along the "
                            "last axis, so that each head's row adds up to 1.")
        if np.allclose(answer, 1.0):
            return Feedback(False, "every weight is 1: the softmax ran over the wrong axis. "
                            f"Take it along the last axis (the {S} keys).")
    return check_array(answer.astype(np.float64), expected, name, atol=PRINTED_PRECISION,
                       hint=f"Scaled scores of q against all {S} keys, per head, then softmax.")


def _article_step(params, article_ids):
    """q and K (split into heads) of the notebook's step: "I" after "How are you?"."""
    qh, cached_keys, k = _decode_step_pieces(params, article_ids, 5)
    return qh, kvlib.split_heads(np.vstack([cached_keys, k]), params.config.n_heads)


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


@checker
def check_chunked_prefill(prefill_chunk) -> Feedback:
    """Exercise 2: a fixed `prefill_chunk(params, ids, cache) -> logits (T_new, V)`.

    Runs it on several splits of a text into (already cached, new chunk), including a first
    chunk on an empty cache, and compares with kvlib.forward on the whole text.
    """
    refused = read_function(prefill_chunk, "prefill_chunk_fixed", "prefill_chunk_broken")
    if refused is not None:
        return refused
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
        array = read_array(logits, "logits")
        if isinstance(array, Feedback) or array.dtype == object:
            return Feedback(False, f"{where}: expected logits, an array of numbers of shape "
                            f"{expected.shape}, got {type(logits).__name__}.")
        logits = array.astype(np.float64)
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


def _generate_prefilling_every_step(params, ids, n):
    """The bug the token ids alone can hide: a fresh prefill of the prompt at every step, then
    a decode step of only the newest token, so each step forgets the tokens generated before."""
    logits, _ = kvlib.prefill(params, ids)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n:
        _, cache = kvlib.prefill(params, ids)
        new.append(int(np.argmax(kvlib.decode_step(params, new[-1], cache)[-1])))
    return new


def _rows_through_the_model(work: kvlib.MultiplyAdds, config) -> int:
    """How many rows went through the projections: the positions appended to the caches."""
    return work.projections // (4 * config.n_layers * config.d_model ** 2)


@checker
def check_generation_loop(my_generate) -> Feedback:
    """Exercise 3: a greedy `my_generate(params, ids, n) -> n new ids` with prefill and decode_step.

    Compares the ids with kvlib.generate(..., use_cache=False) on several prompts, and counts
    the rows that went through the model (kvlib.count_multiply_adds, on the params it is
    given): with the cache, one prefill of the P-token prompt and n - 1 decode steps put
    P + n - 1 rows through it, one per position the cache grows by. Counting the work does not
    depend on how kvlib.decode_step was imported.
    """
    refused = read_function(my_generate, "my_generate")
    if refused is not None:
        return refused
    params, _ = article_example()
    tokenizer = kvlib.ToyTokenizer()
    remark = ""
    for text, n in GENERATION_CASES:
        ids = tokenizer.encode(text)
        expected = kvlib.generate(params, ids, n, use_cache=False)
        try:
            got, work = kvlib.count_multiply_adds(my_generate, params, list(ids), n)
        except RuntimeError as error:
            if "not assigned to a part" in str(error):
                return Feedback(False, "your function multiplies the weights itself; write "
                                "the loop with kvlib.prefill and kvlib.decode_step.")
            return Feedback(False, f"on {text!r} with n={n}, your function raised "
                            f"RuntimeError: {error}")
        except Exception as error:  # a student's code may fail in any way; report it in words
            return Feedback(False, f"on {text!r} with n={n}, your function raised "
                            f"{type(error).__name__}: {error}")
        tokens = _token_list(got)
        if isinstance(tokens, Feedback):
            return tokens
        if tokens == list(ids) + expected:
            return Feedback(False, "your list starts with the prompt: return only the n new "
                            "tokens.")
        if len(tokens) != n:
            return Feedback(False, f"on {text!r} you returned {len(tokens)} tokens; asked for "
                            f"n={n} new ones.")
        P = len(ids)
        rows = _rows_through_the_model(work, params.config)
        if rows == 0:
            return Feedback(False, "your function never ran the model on the params it was "
                            "given: use the function's own params argument (the checker "
                            "passes its own), not the notebook's variable.")
        if tokens != expected:
            if tokens == _generate_feeding_last_prompt_token_again(params, ids, n):
                return Feedback(False, "the prompt's last token went into the cache twice: "
                                "prefill already cached it. The first token to decode is the "
                                "one chosen from the prefill's last row of logits.")
            if tokens == _generate_prefilling_every_step(params, ids, n):
                return _prefills_every_step(P, n)
            return Feedback(False, f"on {text!r} you generated "
                            f"{tokenizer.decode(tokens)!r}; greedy decoding gives "
                            f"{tokenizer.decode(expected)!r}.")
        right = P + n - 1
        if rows == right:
            continue
        if n > 1 and rows == P + (n - 1) * (P + 1):
            return _prefills_every_step(P, n)
        if n > 1 and rows == sum(range(P, P + n)):
            return Feedback(False, f"the tokens are right, but on {text!r} your loop put "
                            f"{rows} rows through the model: the whole sequence again for every "
                            f"new token. With the cache, one prefill ({P} rows) and one row per "
                            f"further token make {right}: use kvlib.decode_step.")
        if rows == right + 1:
            remark = (" One remark: your loop runs one decode step more than it needs, for a "
                      "token it never returns.")
            continue
        return Feedback(False, f"the tokens are right, but on {text!r} your loop put {rows} "
                        f"rows through the model, where one prefill of the {P}-token prompt "
                        f"and {n - 1} decode steps put {right}: the cache should grow by one "
                        "position per new token.")
    if my_generate is kvlib.generate or "generate" in _names_used(my_generate):
        return Feedback(False, "right tokens and right work, but through kvlib.generate: the "
                        "exercise is to write its loop yourself, with kvlib.prefill and "
                        "kvlib.decode_step.")
    return Feedback(True, "the same tokens as recomputing everything, with one prefill and one "
                    "decode_step per further token: the cache grew by one position per new "
                    "token." + remark)


def _names_used(function) -> set[str]:
    """Global and attribute names a function's code (and its nested code) refers to."""
    code = getattr(function, "__code__", None)
    names, stack = set(), [code] if code is not None else []
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if hasattr(c, "co_names"))
    return names


def _prefills_every_step(P: int, n: int) -> Feedback:
    return Feedback(False, f"your loop prefills the {P}-token prompt into a fresh cache at every "
                    "step, then decodes only the newest token: each step forgets the tokens "
                    "generated before it (and redoes the prompt's work). Prefill once, keep "
                    "that cache, and let every decode_step add to it.")


def _token_list(got):
    """The student's tokens as a list of ints, or Feedback."""
    array = read_array(got, "what your function returns")
    if isinstance(array, Feedback) or array.ndim != 1 or not np.all(np.mod(array, 1) == 0):
        return Feedback(False, f"expected a list of token ids, got {shown(got, 150)}.")
    return [int(token) for token in array]


SOLUTIONS = {
    1: """
_, cache_ex = kvlib.prefill(params, tokenizer.encode("How are you? I"))   # 6 positions
x = kvlib.embed(np.array([2]), params.embedding)     # token 2 ("am"): (1, 4)
q, k, v = kvlib.project_qkv(x, params.layers[0])     # (1, 4) each
K_all = np.vstack([cache_ex.keys(0), k])             # (7, 4): its own key too
answer = kvlib.softmax(kvlib.attention_scores(kvlib.split_heads(q, 2),
                                              kvlib.split_heads(K_all, 2)))   # (2, 1, 7)
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
