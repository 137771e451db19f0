"""Exercises of the positions_and_rope lesson (positions and the cache): checkers and solutions.

Exercise 1 is the classic offset bug of rotary models: a hand-written continuation whose
chunk positions restart at 0, so that every decode step turns its query and key as if the
token were the first. It works on an empty cache and nowhere else; equality with a full
recomputation catches it. Exercise 2 computes the angle of one pair at one position for
Llama 3's head (a transfer of the notebook's formula to another size and base). Exercise 3
asks for predictions: which changes of the positions keep the scores?
"""

from __future__ import annotations

import math
from functools import lru_cache
from numbers import Integral, Real

import numpy as np

import kvlib

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    not_filled_in,
    read_array,
    read_function,
    show_solution,
    shown,
)

# Exercise 1 ------------------------------------------------------------------------------

ROTARY_CONFIG = kvlib.ModelConfig(positions="rotary")
"""The toy with rotary positions: 2 heads of size 2, one pair each, turning 1 rad a position."""
CONTINUE_CASES = (  # (text already in the cache, new tokens); BOS is added to the first text
    ("", "How are you?"),
    ("How are you?", "I"),
    ("How are you?", "I am fine"),
    ("How are you? I", "am"),
    ("How", "are you? I am fine."),
)
GENERATION_PROMPT, GENERATION_STEPS = "How are you?", 8


@lru_cache(maxsize=1)
def rotary_example() -> kvlib.Params:
    """The rotary toy's seeded weights, made once; callers must not modify the arrays."""
    return kvlib.init_params(ROTARY_CONFIG)


def continue_with_positions(params, ids, cache, positions):
    """Reference continuation of `cache` with ids (T,), the chunk's tokens turned to the
    given positions (T,), or not turned at all when positions is None: logits (T, V)."""
    config = params.config
    T, S = len(ids), len(cache) + len(ids)
    rotary = None if positions is None else kvlib.RotaryPositions(
        np.asarray(positions), config.head_dim, config.rope_base)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(T, S), cache,
                                index, rotary=rotary)
    return kvlib.unembed(X, params.embedding)


def _wrong_positions(P: int, T: int) -> list[tuple[object, str]]:
    """The usual wrong positions for a chunk of T tokens after P cached ones, each with what
    to say; the first that reproduces a student's logits is the diagnosis."""
    where = (f"position len(cache) = {P}" if T == 1 else
             f"positions len(cache) .. len(cache) + len(ids) - 1 = {P} .. {P + T - 1}")
    # a shift of every position, the cached ones too, would keep every score (exercise 3):
    # a student whose own loop shifts consistently is only caught by a cache filled elsewhere
    shifted_note = (" (Shifting every position, the cached ones too, would keep the scores; "
                    "but this cache was filled by kvlib.prefill, at 0 .. "
                    f"{P - 1}.)" if P else "")
    cases = [
        (np.arange(T), (f"the new token was turned to position 0, as if it were the first "
                        f"token: the positions restart at 0 for every call. After {P} cached "
                        f"positions it sits at {where}." if T == 1 else
                        f"the new tokens were turned as if the sequence started with them: "
                        f"their positions restart at 0. After {P} cached positions they sit "
                        f"at {where}.")),
        (np.zeros(T, dtype=int), f"every new token was turned by angle 0: to position 0, or "
                                 f"not turned at all (rotary=None), which is the same. "
                                 f"{'It sits' if T == 1 else 'They sit'} at {where}."),
        (np.arange(P + 1, P + T + 1), f"off by one: positions count from 0, so a cache of {P} "
                                      f"positions holds 0 .. {P - 1} and the first new token "
                                      f"sits at {P}, not {P + 1}" + (
                                          " (len(cache) + len(ids) is where the NEXT token "
                                          "goes)." if T == 1 else ".") + shifted_note),
    ]
    if T > 1:
        cases.append((np.arange(P + T, P + 2 * T),
                       f"the positions start at len(cache) + len(ids) = {P + T}: that is where "
                       f"the NEXT chunk starts. This one starts at len(cache) = {P}."
                       + shifted_note))
    if P >= 1:
        cases.append((np.arange(P - 1, P + T - 1),
                       f"off by one: the first new token sits at position len(cache) = {P}, "
                       f"one after the last cached position {P - 1}."))
    return cases


def _continue_cases():
    tokenizer = kvlib.ToyTokenizer()
    for before, chunk in CONTINUE_CASES:
        cached = tokenizer.encode(before) if before else []
        yield cached, tokenizer.encode(chunk, add_bos=not before)


def _prefilled(params, cached_ids) -> kvlib.KVCache:
    cache = kvlib.KVCache(params.config)
    if cached_ids:
        kvlib.prefill(params, cached_ids, cache)
    return cache


def _call(function, params, ids, cache, where: str):
    """Run a student's function; (logits, None) or (None, Feedback saying what went wrong)."""
    try:
        return function(params, list(ids), cache), None
    except ValueError as error:
        if "layers of this cache hold different numbers" in str(error):
            return None, Feedback(False, f"{where}, len(cache) was read after the first layer "
                                  "had appended its rows (inside the loop over layers?): the "
                                  "layers then disagree. Read the position of the chunk once, "
                                  "before the loop: P = len(cache).")
        if "positions must be >= 0" in str(error):
            return None, Feedback(False, f"{where}, your function asked for a negative "
                                  f"position ({error}). The first new token sits at "
                                  "len(cache).")
        return None, Feedback(False, f"{where}, your function raised ValueError: {error}")
    except Exception as error:  # a student's code may fail in any way; report it in words
        return None, Feedback(False, f"{where}, your function raised "
                              f"{type(error).__name__}: {error}")


def _as_logits(logits, expected_shape, where: str):
    array = read_array(logits, "your function's logits", expected_shape)
    if isinstance(array, Feedback):             # text, complex numbers, ragged lists, objects
        return None, Feedback(False, f"{where}: expected logits, an array of numbers of shape "
                              f"{expected_shape}. {array.message}")
    array = array.astype(np.float64)
    if array.shape != expected_shape:
        return None, Feedback(False, f"{where}: expected logits of shape {expected_shape} (one "
                              f"row per new token), got {array.shape}.")
    return array, None


def _diagnose(params, cached_ids, ids, logits, where: str) -> Feedback:
    P, T = len(cached_ids), len(ids)
    for positions, explanation in _wrong_positions(P, T):
        wrong = continue_with_positions(params, ids, _prefilled(params, cached_ids), positions)
        if np.allclose(logits, wrong, atol=1e-10):
            return Feedback(False, f"{where}, the logits differ from kvlib.forward on the whole "
                            f"text: {explanation}")
    return Feedback(False, f"{where}, the logits differ from kvlib.forward on the whole text. "
                    f"Print the positions your function gives the new tokens: they should be "
                    f"{list(range(P, P + T))}; and the mask should be kvlib.causal_mask({T}, "
                    f"{P + T}).")


@checker
def check_continue(continue_fixed) -> Feedback:
    """Exercise 1: a fixed `continue_fixed(params, ids, cache) -> logits (T, V)` for the
    rotary toy. Runs it on several splits of a text into (already cached, new tokens),
    including a first chunk on an empty cache and single decode steps, and as a greedy
    decode loop, comparing each with kvlib.forward on the whole text."""
    refused = read_function(continue_fixed, "continue_fixed", "continue_broken")
    if refused is not None:
        return refused
    params = rotary_example()
    tokenizer = kvlib.ToyTokenizer()
    for cached_ids, ids in _continue_cases():
        P, T = len(cached_ids), len(ids)
        where = (f"continuing a cache of {P} positions ({tokenizer.decode(cached_ids)!r}) with "
                 f"{T} new token{'s' if T > 1 else ''} ({tokenizer.decode(ids)!r})" if P else
                 f"on an empty cache with {T} tokens ({tokenizer.decode(ids)!r})")
        cache = _prefilled(params, cached_ids)
        logits, failure = _call(continue_fixed, params, ids, cache, where)
        if failure is not None:
            return failure
        expected = kvlib.forward(params, cached_ids + ids)[P:]
        logits, failure = _as_logits(logits, expected.shape, where)
        if failure is not None:
            return failure
        if len(cache) != P + T:
            return Feedback(False, f"{where}: afterwards the cache should hold {P + T} "
                            f"positions, it holds {len(cache)}. Pass the cache to every "
                            "decoder_block so that the new K and V are appended.")
        if not np.allclose(logits, expected, atol=1e-10):
            return _diagnose(params, cached_ids, ids, logits, where)
    return _check_decode_loop(continue_fixed, params, tokenizer)


def _check_decode_loop(continue_fixed, params, tokenizer) -> Feedback:
    ids = tokenizer.encode(GENERATION_PROMPT)
    expected = kvlib.generate(params, ids, GENERATION_STEPS, use_cache=False)
    cache = kvlib.KVCache(params.config)
    logits, failure = _call(continue_fixed, params, ids, cache, "prefilling the prompt")
    if failure is not None:
        return failure
    generated = []
    for step in range(GENERATION_STEPS):
        logits, failure = _as_logits(logits, (len(ids) if step == 0 else 1,
                                              params.config.vocab_size),
                                     f"decode step {step}")
        if failure is not None:
            return failure
        generated.append(int(np.argmax(logits[-1])))
        if step + 1 < GENERATION_STEPS:
            logits, failure = _call(continue_fixed, params, [generated[-1]], cache,
                                    f"at decode step {step + 1}")
            if failure is not None:
                return failure
    if generated != expected:
        return Feedback(False, f"as a decode loop after {GENERATION_PROMPT!r}, your function "
                        f"generates {tokenizer.decode(generated)!r}; recomputing everything "
                        f"gives {tokenizer.decode(expected)!r}.")
    return Feedback(True, f"all {len(CONTINUE_CASES)} splits give the logits of kvlib.forward "
                    f"on the whole text, and as a decode loop your function generates "
                    f"{tokenizer.decode(generated)!r}, as full recomputation does: every chunk "
                    "starts at position len(cache).")


# Exercise 2 ------------------------------------------------------------------------------

ANGLE_QUESTION = {"pair": 20, "position": 8000, "dim": 128, "base": 500000.0,
                  "d_model": 4096}
"""Llama 3 8B: heads of 128 columns (d_model 4096 / 32 heads), rope_base 500000."""
ANGLE_TOLERANCE = 0.005      # the notebook prints 3 decimals


def pair_angle(pair: int, position: int, dim: int, base: float) -> float:
    """The angle (radians) by which pair `pair` of a head of `dim` columns is turned at
    `position`: position x base^(-2 pair / dim), computed by kvlib.rotary_angles."""
    return float(kvlib.rotary_angles(np.array([position]), dim, base)[0, pair])


def _one_number(answer) -> float | None:
    """A finite float from a number, a 0-d array or a one-element list or array; else None."""
    if isinstance(answer, (list, tuple)) and len(answer) == 1:
        answer = answer[0]
    if isinstance(answer, np.ndarray) and answer.size == 1 and answer.dtype.kind in "iuf":
        answer = answer.reshape(()).item()
    if isinstance(answer, bool) or not isinstance(answer, Real):
        return None
    try:
        value = float(answer)
    except (OverflowError, ValueError):
        return math.inf
    return value


def _turns_apart(a: float, b: float) -> float:
    """How far apart two angles are on the circle (radians, 0 .. pi)."""
    return abs((a - b + math.pi) % (2 * math.pi) - math.pi)


def _angle_mistakes() -> list[tuple[float, str]]:
    q = ANGLE_QUESTION
    pair, position, dim, base = q["pair"], q["position"], q["dim"], q["base"]
    frequency = pair_angle(pair, 1, dim, base)
    exact = position * frequency
    return [
        (pair_angle(pair, position, dim, 10000.0),
         "that is the angle with rope_base 10000 (the RoPE paper, Llama 2). Llama 3 uses "
         "rope_base 500000."),
        (position * base ** (-pair / dim),
         f"the exponent is -2i / dim, not -i / dim: pair i holds columns 2i and 2i + 1, so "
         f"pair {pair} starts at column {2 * pair}."),
        (pair_angle(pair + 1, position, dim, base),
         f"that is pair {pair + 1}: pairs count from 0, and pair i's exponent is -2i / dim."),
        (pair_angle(pair - 1, position, dim, base),
         f"that is pair {pair - 1}: pair i's exponent is -2i / dim with i = {pair}."),
        (math.degrees(exact), "that is the angle in degrees: give it in radians."),
        (pair_angle(pair, position, q["d_model"], base),
         f"dim is the size of one head, {dim} columns, not d_model = {q['d_model']}: the "
         f"rotation turns the pairs inside each head."),
        (position * base ** (2 * pair / dim),
         "the exponent is negative: the pairs turn more SLOWLY as i grows, "
         "frequency = base^(-2i / dim)."),
        (frequency, "that is the angle per position (the frequency): multiply by the position."),
        (2 * math.pi / frequency,
         "that is the wavelength, the positions a full turn takes: the angle is position x "
         "frequency."),
        (1 / frequency, "that is 1 / frequency: the angle is position x frequency."),
        ((position - 1) * frequency, f"that is position {position - 1}: the token sits at "
                                     f"position {position}."),
        ((position + 1) * frequency, f"that is position {position + 1}: the token sits at "
                                     f"position {position}."),
        (-exact, "the angle is positive: position x base^(-2i / dim), both factors positive."),
    ]


@checker
def check_pair_angle(answer) -> Feedback:
    """Exercise 2: the angle (radians) of pair 20 of a Llama 3 head (dim 128, rope_base
    500000) at position 8000. Any angle a whole number of turns away is the same rotation."""
    if is_missing(answer):
        return not_filled_in("answer", "your number")
    value = _one_number(answer)
    if value is None:
        return Feedback(False, f"answer should be one number (an angle in radians), got "
                        f"{described(answer)}.")
    if not math.isfinite(value):
        return Feedback(False, f"answer should be a finite angle in radians, got {value}.")
    q = ANGLE_QUESTION
    exact = pair_angle(q["pair"], q["position"], q["dim"], q["base"])
    if abs(value - exact) <= ANGLE_TOLERANCE:
        return Feedback(True, f"{exact:.3f} rad: {q['position']} positions x "
                        f"{exact / q['position']:.6f} rad per position. Pair {q['pair']} "
                        f"makes a full turn every {2 * math.pi * q['position'] / exact:,.0f} "
                        f"positions; the slowest pair, 63, every "
                        f"{2 * math.pi / pair_angle(63, 1, q['dim'], q['base']):,.0f}.")
    if _turns_apart(value, exact) <= ANGLE_TOLERANCE:
        return Feedback(True, f"{value:.3f} rad is the same rotation as {exact:.3f} rad, a "
                        f"whole number of turns apart: {q['position']} x base^(-2 x "
                        f"{q['pair']} / {q['dim']}).")
    if any(abs(value - round(exact, digits)) < 1e-9 for digits in (0, 1)):
        return Feedback(False, f"{value} is the angle rounded too far: give it to 3 decimals "
                        f"(a turn of 0.05 rad is already a visible difference in a score).")
    for wrong, explanation in _angle_mistakes():
        if abs(value - wrong) <= max(ANGLE_TOLERANCE, 1e-6 * abs(wrong)):
            return Feedback(False, f"{value:.6g} is not it: {explanation}")
    if abs(value - exact) <= 0.1:
        return Feedback(False, f"{value} is close but not within {ANGLE_TOLERANCE}: give the "
                        "angle to 3 decimals.")
    return Feedback(False, f"{value:.6g} is not it. The angle of pair i at position p is "
                    "p x base^(-2i / dim): which dim and which base does a Llama 3 head use?")


# Exercise 3 ------------------------------------------------------------------------------

STATEMENTS = (
    "Shift every position, of the query and of all the keys, by 100.",
    "Shift only the new query's position by 100; the cached keys stay as they are.",
    "Double every position (query and keys).",
    "Store the cached rows of K and V in another order (a paged cache may put them anywhere).",
    "With learned positions (GPT-2) instead of RoPE: shift every position by 100.",
)
"""Exercise 3: does the query's score for each key token stay the same after this change?"""

REASONS = (
    "Shifting every position by the same amount keeps every distance m - n, and a rotary "
    "score depends on m - n only.",
    "Only the query moves: every distance m - n grows by 100, and the scores change. This is "
    "the offset bug of exercise 1 seen from the scores.",
    "Doubling the positions doubles every distance m - n, so the angles between q and k, and "
    "the scores, change. (Position interpolation does the opposite, dividing positions to fit "
    "a longer text in the trained range, and needs a little fine-tuning for that reason.)",
    "Each cached key was turned to its own position before it was stored: the position "
    "travels inside the row, so each token's score is the same wherever its row sits.",
    "A learned table adds a different row to each position: shifted by 100, every token gets "
    "another vector, and nothing makes the scores depend on the distance only.",
)
YES = {"true", "yes", "y", "keeps", "keep", "kept", "same", "stays", "stay", "unchanged"}
NO = {"false", "no", "n", "changes", "change", "changed", "different", "differs"}


def _scores_rotary(query_position: int, key_positions, dim: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, dim)), rng.standard_normal((len(key_positions), dim))
    turned_q = kvlib.RotaryPositions(np.array([query_position]), dim).rotate(q)
    turned_k = kvlib.RotaryPositions(np.asarray(key_positions), dim).rotate(k)
    return (turned_q @ turned_k.T)[0] / math.sqrt(dim)


def _scores_learned(positions, seed: int = 0):
    """Layer 0, head 0 scores of the newest token of a fixed text over all its tokens, the
    text placed at `positions`, in a learned-position toy."""
    config = kvlib.ModelConfig(positions="learned", context_length=128)
    params = kvlib.init_params(config, seed=seed)
    ids = np.array([0, 3, 7, 1, 9, 5])
    X = kvlib.add_positions(kvlib.embed(ids, params.embedding), params.position_table,
                            positions)
    Q, K, _ = kvlib.project_qkv(X, params.layers[0])
    Qh, Kh = kvlib.split_heads(Q, 2)[0], kvlib.split_heads(K, 2)[0]
    return kvlib.attention_scores(Qh, Kh)[-1]


def _cached_scores_in_another_order():
    """The newest query's scores per key token, with the rotary toy's cached rows read in
    position order and in a shuffled order (then put back by token)."""
    params = rotary_example()
    ids = [0, 3, 7, 1, 9, 5]
    _, cache = kvlib.prefill(params, ids[:-1])
    X = kvlib.embed(np.array(ids[-1:]), params.embedding)
    q, k, _ = kvlib.project_qkv(X, params.layers[0])
    rotary = kvlib.RotaryPositions(np.array([len(cache)]), ROTARY_CONFIG.head_dim)
    q = kvlib.split_heads(rotary.rotate(q), 2)
    keys = cache.keys(0).copy()
    order = np.random.default_rng(1).permutation(len(keys))
    in_order = kvlib.attention_scores(q, kvlib.split_heads(keys, 2))
    shuffled = kvlib.attention_scores(q, kvlib.split_heads(keys[order], 2))
    by_token = np.empty_like(shuffled)
    by_token[..., order] = shuffled
    return in_order, by_token


def statement_truths() -> tuple[bool, ...]:
    """Whether each of STATEMENTS keeps every key token's score, computed, not written."""
    keys = np.arange(8)
    base = _scores_rotary(7, keys)
    in_order, by_token = _cached_scores_in_another_order()
    return (
        bool(np.allclose(_scores_rotary(107, keys + 100), base, atol=1e-10)),
        bool(np.allclose(_scores_rotary(107, keys), base, atol=1e-10)),
        bool(np.allclose(_scores_rotary(14, 2 * keys), base, atol=1e-10)),
        bool(np.allclose(by_token, in_order, atol=1e-12)),
        bool(np.allclose(_scores_learned(np.arange(100, 106)), _scores_learned(np.arange(6)),
                         atol=1e-10)),
    )


def _prediction(item) -> bool | None:
    if isinstance(item, (bool, np.bool_)):
        return bool(item)
    if isinstance(item, (Integral, np.integer, float, np.floating)) and item in (0, 1):
        return bool(item)      # 0 / 1, also as floats (np.array([1, 0, ...], dtype=float))
    if isinstance(item, str):
        word = item.strip().lower()
        return True if word in YES else False if word in NO else None
    return None


def _predictions(answer):
    """A list of len(STATEMENTS) booleans, or a Feedback saying why the answer is not one."""
    n = len(STATEMENTS)
    form = (f"a list of {n} predictions, True (keeps every score) or False (changes some), "
            f"in the order of the statements")
    if isinstance(answer, dict):
        try:
            answer = [answer[i] for i in range(1, n + 1)]
        except (KeyError, TypeError):
            return Feedback(False, f"a dict answer needs the keys 1 to {n} (the statements' "
                            f"numbers); or give {form}.")
    if isinstance(answer, np.ndarray):
        if answer.ndim != 1:
            return Feedback(False, f"answer should be {form}, got an array of shape "
                            f"{answer.shape}.")
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not isinstance(answer, (list, tuple)):
        return Feedback(False, f"answer should be {form}, got {type(answer).__name__}.")
    if len(answer) != n:
        return Feedback(False, f"answer should have {n} predictions, one per statement, got "
                        f"{len(answer)}.")
    predictions = [_prediction(item) for item in answer]
    unreadable = [i + 1 for i, p in enumerate(predictions) if p is None]
    if unreadable:
        return Feedback(False, f"prediction(s) {unreadable} are not True or False (nor 'keeps' "
                        f"/ 'changes'): got {shown([answer[i - 1] for i in unreadable], 80)}.")
    return predictions


@checker
def check_keeps_scores(answer) -> Feedback:
    """Exercise 3: for each of STATEMENTS, True if every key token's score stays the same."""
    if is_missing(answer):
        return not_filled_in("answer", f"your {len(STATEMENTS)} predictions")
    predictions = _predictions(answer)
    if isinstance(predictions, Feedback):
        return predictions
    truths = statement_truths()
    wrong = [i for i, (p, t) in enumerate(zip(predictions, truths)) if p != t]
    if not wrong:
        return Feedback(True, "all " + str(len(STATEMENTS)) + " right. " + " ".join(
            f"({i + 1}) {reason}" for i, reason in enumerate(REASONS)))
    said = " ".join(f"({i + 1}) you said it {'keeps' if predictions[i] else 'changes'} the "
                    f"scores, but it {'keeps' if truths[i] else 'changes'} them: {REASONS[i]}"
                    for i in wrong)
    return Feedback(False, f"{len(wrong)} of {len(STATEMENTS)} predictions are off. {said}")


SOLUTIONS = {
    1: """
def continue_fixed(params, ids, cache):
    config = params.config
    P, T = len(cache), len(ids)              # read before any layer appends
    rotary = kvlib.RotaryPositions(np.arange(P, P + T), config.head_dim, config.rope_base)
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(T, P + T),
                                cache, index, rotary=rotary)
    return kvlib.unembed(X, params.embedding)

answer = continue_fixed
""",
    2: """
pair, position, dim, base = 20, 8000, 128, 500000.0
answer = position * base ** (-2 * pair / dim)          # 132.484 rad
# or: kvlib.rotary_angles(np.array([position]), dim, base)[0, pair]
""",
    3: """
answer = [True, False, False, True, False]
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
