"""Exercises of the when_the_cache_is_wrong lesson (when the cache is wrong): checkers and
solutions.

1. A learner's decode loop writes the wrong text: find with the locator where it first parts
   from recomputation, and which position it gave the new token.
2. Fix the loop: the locator finds nothing, and each step still computes one row.
3. Four reports of "cached is not recomputed": a bug, or rounding?
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

import kvlib
from kvlib import cache_bugs, debug, precision, stories

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    not_filled_in,
    read_whole_numbers,
    show_solution,
)

PROMPT_TEXT = cache_bugs.ZOO_PROMPT
N_NEW_TOKENS = 6
CHECKED_NEW_TOKENS = 16
"""The fixed step of exercise 2 is checked over more tokens than the mystery step is shown:
a step may go wrong only after some positions."""


@lru_cache(maxsize=1)
def story_model():
    """(params in float32, tokenizer) of the trained story model that ships with kvlib."""
    return stories.load_model(dtype="float32"), stories.load_tokenizer()


def exercise_prompt() -> list[int]:
    """The prompt of exercises 1 and 2, as the story model's token ids."""
    return story_model()[1].encode(PROMPT_TEXT)


def mystery_decode_step(params, token_id, cache):
    """A learner's decode step: its text reads wrong from the first new token on."""
    config = params.config
    position = len(cache) - 1              # the cache's last position
    X = kvlib.embed(np.array([token_id]), params.embedding)
    X = kvlib.add_positions(X, params.position_table, [position])
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, config.n_heads, cache=cache, layer_index=index,
                                norm_epsilon=config.norm_epsilon)
    X = kvlib.normalize(X, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return kvlib.unembed(X, params.embedding)


# Exercise 1 ------------------------------------------------------------------------------

@checker
def check_where(answer) -> Feedback:
    """Exercise 1: (decode step, position the new token was given) where the mystery loop
    first parts from recomputation, as first_divergence reports it."""
    if is_missing(answer):
        return not_filled_in("answer", "(step, position given), such as (2, 17)")
    if isinstance(answer, (tuple, list)) and len(answer) == 2 and answer[0] is None:
        return Feedback(False, "a step of None is how the report names the prefill, but the "
                        "mystery loop's prefill is right: the report points at a decode step. "
                        "Give its number (decode step 0 is the first after the prefill).")
    read = read_whole_numbers(answer, 2, "answer")
    if isinstance(read, Feedback):
        return read
    step, given = read
    prompt_length = len(exercise_prompt())
    right_position = prompt_length
    expected = (0, prompt_length - 1)
    if read == expected:
        return Feedback(True, f"decode step 0 (the first after the prefill): the token of "
                        f"position {right_position} was given position {given}, one too "
                        "early; len(cache) is already the new token's position.")
    if read == (expected[1], expected[0]):
        return Feedback(False, "the two numbers are swapped: (step, position given).")
    if step == 1 and given == expected[1]:
        return Feedback(False, "steps count from 0 in the report: decode step 0 is the first "
                        "after the prefill.")
    if step is not None and step < 0:
        return Feedback(False, "steps count from 0; there is no negative step.")
    if given == right_position:
        return Feedback(False, f"{right_position} is where the new token should sit (the "
                        "prompt's length, the report's position); its given_position says "
                        "which position the loop gave it.")
    if step != 0:
        return Feedback(False, f"step {step} is not where the report points: run "
                        "debug.first_divergence(params, prompt, 6, mystery_decode_step) and "
                        "read its first words.")
    return Feedback(False, f"position {given} is not the one in the report: read its "
                    "given_position (printed as 'position ... (given ...)').")


# Exercise 2 ------------------------------------------------------------------------------

def _empty(params, token_id, cache):
    ...


def _is_empty(function) -> bool:
    """Whether a function's body is only `...` or `pass` (the exercise's placeholder)."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_code == _empty.__code__.co_code and \
        code.co_argcount == _empty.__code__.co_argcount

@checker
def check_fixed_step(function) -> Feedback:
    """Exercise 2: a decode step that the locator cannot fault on the exercise's prompt, that
    computes one row a step (it reads its cache), and that is not the mystery step itself."""
    if is_missing(function):
        return not_filled_in("answer", "your fixed function (answer = fixed_decode_step, "
                             "without calling it)")
    if not callable(function):
        return Feedback(False, f"answer should be your fixed function, not "
                        f"{described(function)}: write answer = fixed_decode_step.")
    params, _ = story_model()
    prompt = exercise_prompt()
    if _is_empty(function):
        return not_filled_in("fixed_decode_step", "a body that returns the logits (1, V)")
    not_finite = []

    def watched(params, token_id, cache):
        # the learner's step, as the locator calls it; its logits must be numbers, all finite
        logits = function(params, token_id, cache)
        kind = getattr(np.asarray(logits), "dtype", np.dtype(object)).kind
        if kind not in "fiu":
            raise TypeError(f"it returned {described(logits)}, not logits (numbers)")
        not_finite.extend([] if np.isfinite(logits).all() else [len(cache)])
        return logits

    try:
        found = debug.first_divergence(params, prompt, CHECKED_NEW_TOKENS, watched)
    except Exception as error:          # the learner's code: any failure is an answer too
        return Feedback(False, f"the locator could not run your step: it failed with "
                        f"{type(error).__name__}: {error}. It must take (params, token_id, "
                        "cache) and return logits (1, V).")
    if not_finite:
        return Feedback(False, "your step returns logits that are not all finite numbers (nan "
                        "or inf): no token can be chosen from them.")
    if found is not None:
        return Feedback(False, f"the locator still finds something: {found}")
    try:
        rows = debug.rows_computed(params, prompt, CHECKED_NEW_TOKENS, function)
    except Exception as error:
        return Feedback(False, f"counting its rows failed with {type(error).__name__}: "
                        f"{error}.")
    if any(row != 1 for row in rows):
        return Feedback(False, f"the answers are right, but the steps compute {rows} rows: "
                        "the whole sequence again, so the cache is not read (bug 8 of the "
                        "zoo). Feed only the new token and let decoder_block read the cache.")
    return Feedback(True, f"nothing parts in {CHECKED_NEW_TOKENS - 1} decode steps, and each step "
                    "computes one row: the token sits at len(cache), the cache is read.")


# Exercise 3 ------------------------------------------------------------------------------

def reports() -> dict[str, str]:
    """Exercise 3's four reports, with the numbers of the committed precision table."""
    rows = {(row["format"], row["where"]): row["cached_against_recomputed"]
            for row in precision.measured()["smollm2"]["rows"]}
    bf16, fp32 = rows[("bfloat16", "everything")], rows[("float32", "everything")]
    return {
        "A": f"SmolLM2 with everything in bfloat16: over {bf16['positions']} positions the "
             f"cached logits differ from the recomputed ones by up to "
             f"{bf16['largest_difference']:.2g}, and the greedy token differs at "
             f"{max(bf16['flips'], 1)} of them.",
        "B": "The story model in float32: the prefill and decode step 0 agree to 1e-6; from "
             "step 1 on, the logits differ by 5 or more and the story stops making sense.",
        "C": f"SmolLM2 in float32: the cached logits differ from the recomputed ones by up to "
             f"{fp32['largest_difference']:.1g} at every step; no greedy token changes.",
        "D": "SmolLM2 in float32 with a sliding window of 64: everything agrees until the "
             "sequence is 64 tokens long; from then on the logits differ by 0.2 to 1 at every "
             "step.",
    }


ANSWERS = {"A": "rounding", "B": "bug", "C": "rounding", "D": "bug"}
WHY = {
    "A": "in bfloat16 a logit carries 2 to 3 significant digits: differences of this size, and a "
         "flip now and then between two near-equal tokens, are the format's own rounding",
    "B": "a difference of 5 in float32, starting at one step and staying, is a bug (a "
         "position that jumps, as in tiny-llm PR #46); rounding in float32 is 1e-5",
    "C": "a few 1e-5 in float32 is the order of the sums: a decode step adds in another "
         "order than a forward pass",
    "D": "0.2 in float32 is ten thousand times the rounding, and it starts exactly at the "
         "window: the window's mask is off (mlx-lm PR #390)",
}


def _verdict(item) -> str | None:
    if isinstance(item, (str, np.str_)):
        word = str(item).strip().lower()
        if word in ("bug", "b", "a bug"):
            return "bug"
        if word in ("rounding", "round", "r", "precision", "rounding error"):
            return "rounding"
    return None


@checker
def check_bug_or_rounding(answer) -> Feedback:
    """Exercise 3: for reports A-D, "bug" or "rounding": a dict keyed by the letters, or four
    words in order (a list, a tuple, or one string of words separated by spaces or commas)."""
    if is_missing(answer):
        return not_filled_in("answer", '{"A": "bug" or "rounding", ...}, or four words')
    if isinstance(answer, np.ndarray) and answer.ndim == 1:
        answer = answer.tolist()
    if isinstance(answer, (str, np.str_)):
        answer = [word for word in str(answer).replace(",", " ").split() if word]
    if isinstance(answer, dict):
        keys = {str(key).strip().upper(): value for key, value in answer.items()}
        if len(keys) < len(answer):
            return Feedback(False, "a letter is given twice (as \"a\" and \"A\", say): give one "
                            "verdict for each of A, B, C and D.")
        if keys and all(is_missing(value) for value in keys.values()):
            return not_filled_in("answer", '"bug" or "rounding" for each letter')
        if set(keys) != set(ANSWERS):
            return Feedback(False, f"give a verdict for each of A, B, C and D; got the keys "
                            f"{sorted(map(str, answer))[:6]}.")
        verdicts = {letter: _verdict(keys[letter]) for letter in ANSWERS}
    elif isinstance(answer, (list, tuple)):
        if len(answer) != len(ANSWERS):
            return Feedback(False, f"give four verdicts, one for each of A, B, C, D; got "
                            f"{len(answer)}.")
        verdicts = dict(zip(ANSWERS, map(_verdict, answer)))
    else:
        return Feedback(False, f'answer should be four words like ["bug", "rounding", ...] or '
                        f"a dict keyed by the letters, not {described(answer)}.")
    unread = [letter for letter, verdict in verdicts.items() if verdict is None]
    if unread:
        return Feedback(False, f'each verdict is the word "bug" or "rounding"; could not read '
                        f"the one for {', '.join(unread)}.")
    wrong = [letter for letter in ANSWERS if verdicts[letter] != ANSWERS[letter]]
    if not wrong:
        return Feedback(True, "A and C are rounding, B and D are bugs. The size against the "
                        "format's precision tells them apart, and so does the shape: a bug "
                        "starts at one step and stays; rounding is everywhere and small.")
    return Feedback(False, f"not {', '.join(wrong)}: " + "; ".join(
        f"{letter}: {WHY[letter]}" for letter in wrong) + ".")


# Solutions -------------------------------------------------------------------------------

SOLUTIONS = {
    1: """
found = debug.first_divergence(story, exercise_prompt, 6, exercises.mystery_decode_step)
print(found)            # decode step 0, layer 0, ..., position P (given P - 1): ...
answer = (found.step, found.given_position)
""",
    2: """
def fixed_decode_step(params, token_id, cache):
    config = params.config
    position = len(cache)                  # the cache holds positions 0 .. len - 1
    X = kvlib.embed(np.array([token_id]), params.embedding)
    X = kvlib.add_positions(X, params.position_table, [position])
    for index, layer in enumerate(params.layers):
        X = kvlib.decoder_block(X, layer, config.n_heads, cache=cache, layer_index=index,
                                norm_epsilon=config.norm_epsilon)
    X = kvlib.normalize(X, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
    return kvlib.unembed(X, params.embedding)

answer = fixed_decode_step
""",
    3: """
answer = {"A": "rounding", "B": "bug", "C": "rounding", "D": "bug"}
""",
}


def solution(number: int):
    """Show the solution of exercise `number` (for the instructor: try first)."""
    return show_solution(SOLUTIONS, number)
