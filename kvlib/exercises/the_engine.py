"""Exercises of the_engine lesson (the engine): checkers and solutions.

1. A scheduling decision by hand: which requests the next step runs, and how many tokens each.
2. Find the bug in a small engine: a prefix-cache lookup that lets a repeated prompt reuse all
   of its blocks, so that its last token never runs and no logits come out.
3. Why static batching's time to first token grew (a choice, with the reason in words).
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral

import numpy as np

import kvlib
from kvlib.serving import Engine, SamplingParams

from .base import (
    Feedback,
    checker,
    described,
    is_missing,
    is_stub,
    not_filled_in,
    read_whole_number,
    show_solution,
    shown,
)

BLOCK_SIZE = 4
BUDGET = 20


def _model() -> kvlib.Params:
    config = kvlib.ModelConfig(vocab_size=40, d_model=8, n_heads=2, n_layers=1, d_ff=8,
                               context_length=64, positions="rotary")
    return kvlib.init_params(config, seed=24)


def exercise1_engine() -> Engine:
    """The engine of exercise 1, in the state the exercise describes: requests 0 and 1 have
    prefilled their prompts, 2 and 3 wait, 3 blocks are free, the budget is 20 tokens."""
    engine = Engine(_model(), block_size=BLOCK_SIZE, n_blocks=8, max_num_batched_tokens=BUDGET)
    engine.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=8))
    engine.add_request([20, 21, 22, 23, 24, 25, 26, 27], SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request([5, 6, 7, 8, 30, 31], SamplingParams(max_tokens=4))
    engine.add_request([33, 34, 35, 36, 37], SamplingParams(max_tokens=4))
    return engine


def describe_exercise1() -> str:
    """What exercise 1 shows the student about the engine's state."""
    engine = exercise1_engine()
    lines = [f"budget: {engine.max_num_batched_tokens} tokens a step; blocks of "
             f"{engine.block_size}; {engine.pool.n_free} blocks free or idle"]
    for request in engine.running:
        lines.append(f"running {request.request_id}: {request.num_tokens} tokens, "
                     f"{request.num_computed_tokens} of them in the cache, block table "
                     f"{request.block_table}")
    for request in engine.waiting:
        cached = len(engine.pool.lookup(request.all_token_ids[:-1])) * engine.block_size
        lines.append(f"waiting {request.request_id}: prompt {request.all_token_ids} "
                     f"({cached} tokens of it in the prefix cache)")
    return "\n".join(lines)


def exercise1_answer() -> dict[int, int]:
    engine = exercise1_engine()
    return dict(engine.scheduler.schedule(engine.step_count + 1).scheduled_tokens)


def _as_schedule(answer) -> dict[int, int] | Feedback:
    """The student's {request id: tokens} as whole numbers, without the requests given 0
    tokens (a request listed with 0 runs no more than one left out); a Feedback for anything
    else."""
    if not isinstance(answer, Mapping):
        return Feedback(False, "answer should be a dict {request id: tokens this step}, for "
                        f"example {{0: 1}}; got {described(answer)}.")
    schedule = {}
    for key, value in list(answer.items()):
        request = read_whole_number(key, "a request id", "each key of answer")
        if isinstance(request, Feedback):
            return request
        tokens = read_whole_number(value, "a number of tokens", f"the count for request "
                                   f"{request}")
        if isinstance(tokens, Feedback):
            return tokens
        if tokens < 0:
            return Feedback(False, f"request {request} is given {tokens} tokens: a request "
                            "computes 0 tokens or more in a step.")
        if tokens:
            schedule[request] = tokens
    return schedule


@checker
def check_schedule(answer) -> Feedback:
    """Exercise 1: {request id: tokens it computes in the next step}; a request listed with
    0 tokens is one that does not run."""
    if is_missing(answer):
        return not_filled_in("answer", "a dict {request id: tokens}")
    schedule = _as_schedule(answer)
    if isinstance(schedule, Feedback):
        return schedule
    expected = exercise1_answer()
    if schedule == expected:
        return Feedback(True, "running requests first, one decode token each (request 1's "
                        "position 8 opens a new block); then request 2, which takes its first "
                        "block from the prefix cache and computes only its last 2 tokens; "
                        "request 3 would need 2 blocks and only 1 is left, so it waits (and "
                        "nobody behind it may jump the queue).")
    unknown = sorted(set(schedule) - {0, 1, 2, 3})
    if unknown:
        return Feedback(False, f"the engine has requests 0 to 3; there is no request "
                        f"{shown(unknown[0])}.")
    if schedule.get(0) in (10, 11) or schedule.get(1) in (8, 9):
        return Feedback(False, "requests 0 and 1 are running: 10 of request 0's 11 tokens and 8 "
                        "of request 1's 9 already have K and V in the cache, so a step computes "
                        "exactly 1 token of each, the one that has none yet (the token it "
                        "produced last). Computing a whole sequence again is what a preempted "
                        "request does when it comes back, and nobody is preempted here.")
    if schedule.get(2) == 6:
        return Feedback(False, "request 2 shares its first 4 tokens with request 0's prompt: "
                        "that full block is in the prefix cache, so only 2 tokens run.")
    if 3 in schedule:
        return Feedback(False, "request 3 needs 2 new blocks for its 5 tokens; after requests "
                        "1 and 2 take theirs, 1 block is left. A request that does not fit "
                        "waits.")
    if 2 not in schedule:
        return Feedback(False, "request 2 fits: the budget has 18 tokens left after the two "
                        "decodes, and it needs 1 new block (2 are left after request 1 takes "
                        "one for its position 8).")
    if schedule.get(0) != 1 or schedule.get(1) != 1:
        return Feedback(False, "a decoding request computes exactly 1 token a step (the token "
                        "it produced last), and running requests are scheduled first.")
    if sum(schedule.values()) > BUDGET:
        return Feedback(False, f"that is {sum(schedule.values())} tokens: the step's budget "
                        f"is {BUDGET}.")
    return Feedback(False, f"not {shown(schedule)}. Go in order: running requests first (1 "
                    "token each), then waiting ones first come, first served, each after its "
                    "cached prefix, while tokens and blocks last.")


# Exercise 2 ------------------------------------------------------------------------------

def buggy_tokens_to_look_up(prompt: list[int]) -> list[int]:
    """The small engine's bug: it looks up the whole prompt in the prefix cache."""
    return prompt


PROMPT_LENGTHS = (8, 9, 12, 1, 4, 5, 10, 11, 13, 14, 15, 16, 17, 18, 19, 21, 23, 24, 30, 33,
                  47, 64)
"""The prompts exercise 2 tries, by length: whole blocks first (the bug's symptom), then
every kind of length up to 16 blocks, short ones and ones of 10 tokens or more."""


def _prompt(length: int) -> list[int]:
    """A prompt of `length` different token ids (so that any other token list differs)."""
    return [(7 * i + 3) % 97 for i in range(length)]


def _token_ids(result) -> list[int] | Feedback:
    """What the student's function returned, as a list of token ids (ints); a Feedback for
    anything else (floats, text, bools, nested lists, sets, ...)."""
    if isinstance(result, np.ndarray) and result.ndim == 1 and \
            (result.dtype.kind in "iu" or result.size == 0):
        return [int(token) for token in result.tolist()]
    if not isinstance(result, (list, tuple, range)):
        return Feedback(False, f"tokens_to_look_up should return a list of token ids, got "
                        f"{described(result)}.")
    for position, token in enumerate(result):
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, Integral):
            return Feedback(False, "token ids are whole numbers (ints), but item "
                            f"{position + 1} of the list your function returned is "
                            f"{described(token)}.")
    return [int(token) for token in result]


def _error_text(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - str() of an error may fail (an int too long to print)
        text = ""
    return f"{type(error).__name__}: {text[:120]}" if text else type(error).__name__


@checker
def check_tokens_to_look_up(function) -> Feedback:
    """Exercise 2: tokens_to_look_up(prompt) -> the tokens whose full blocks may come from
    the prefix cache. Judged by what the engine would do with it: which of the prompt's full
    blocks it reuses (those of the returned tokens), on prompts of many lengths; any fix that
    reuses exactly the blocks prompt[:-1] covers passes (nano-vllm leaves out the last block
    instead: the same blocks)."""
    if is_missing(function):
        return not_filled_in("tokens_to_look_up", "your function")
    if not callable(function):
        return Feedback(False, f"expected a function, got {described(function)}.")
    for length in PROMPT_LENGTHS:
        prompt = _prompt(length)
        given = list(prompt)
        try:
            result = function(given)
        except Exception as error:       # the student's code: any error is an answer
            return Feedback(False, f"on the prompt {shown(prompt)} ({length} tokens) your "
                            f"function raised {_error_text(error)}")
        if is_missing(result) and is_stub(function):
            return not_filled_in("tokens_to_look_up", "a body that returns a list of tokens")
        if result is None:
            return Feedback(False, f"on the prompt {shown(prompt)} ({length} tokens) your "
                            "function returned nothing (None): does every path through it end "
                            "in a return?")
        if given != prompt:
            return Feedback(False, f"your function changed the list it was given: the prompt "
                            f"{shown(prompt)} became {shown(given)}. That list is the "
                            "request's own prompt, so the engine would lose its last token. "
                            "Return a new list (prompt[:-1] makes one) and leave the prompt "
                            "as it is.")
        tokens = _token_ids(result)
        if isinstance(tokens, Feedback):
            return tokens
        size = BLOCK_SIZE
        looked_up = len(tokens) // size
        same = 0
        while same < looked_up and tokens[same * size:(same + 1) * size] == \
                prompt[same * size:(same + 1) * size]:
            same += 1
        if same < looked_up:
            return Feedback(False, f"for the prompt {shown(prompt)} ({length} tokens) your "
                            f"function returned {shown(tokens)}: its full block {same + 1} is "
                            "not the prompt's tokens at those positions, so the lookup would "
                            "follow another sequence's keys. Return the prompt's own first "
                            "tokens, in order.")
        reusable = (length - 1) // size
        if looked_up > reusable:
            return Feedback(False, f"for the prompt {shown(prompt)} ({length} tokens, a whole "
                            "number of blocks) that lets every block come from the cache: "
                            "nothing is left to run, so no logits come out for the next token. "
                            "Keep the last token out of the lookup.")
        if looked_up < reusable:
            blocks = f"{looked_up} full block{'s' * (looked_up != 1)}"
            return Feedback(False, f"for a prompt of {length} tokens your function returns "
                            f"{len(tokens)} tokens, {blocks} of {size}, so only "
                            f"{looked_up} of the prompt's blocks can come from the cache; "
                            f"{reusable} can (every full block that does not hold the last "
                            "token). Leave out only the last token: without it the prompt "
                            f"still has {reusable} full blocks.")
    return Feedback(True, "the last token always runs through the model, even when its block "
                    "is cached: its logits are the ones that choose the next token (vLLM "
                    "looks up num_tokens - 1 for the same reason; nano-vllm leaves out the "
                    "last block, which reuses the same blocks).")


# Exercise 3 ------------------------------------------------------------------------------

REASONS = {
    "a": "it admits waiting requests only when the whole batch has finished, so a request "
         "that arrives meanwhile waits for the longest reply in the batch",
    "b": "its steps are slower, because each one computes more tokens",
    "c": "it preempts more requests, which must then be recomputed",
    "d": "it has no prefix cache, so every prompt runs in full",
}


@checker
def check_static_ttft(answer) -> Feedback:
    """Exercise 3: the letter of the reason static batching's TTFT grew (in steps)."""
    if is_missing(answer):
        return not_filled_in("answer", "a letter, 'a' to 'd'")
    if not isinstance(answer, str) or answer.strip().lower().strip("()") not in REASONS:
        return Feedback(False, f"answer with one of the letters {', '.join(REASONS)} (as text, "
                        "in quotes).")
    letter = answer.strip().lower().strip("()")
    if letter == "a":
        return Feedback(True, "a request that arrives while a static batch runs waits for the "
                        "batch's longest reply; continuous batching admits it at the next step.")
    why = {"b": "TTFT here is counted in steps, and a step's duration does not enter it; the "
                "table's steps column is what grew.",
           "c": "the table shows 0 preemptions for static batching: its pool is large enough.",
           "d": "static batching here keeps the prefix cache (it is the same engine with another "
                "admission rule); the prompt tokens it runs are not what delays the first token."}
    return Feedback(False, why[letter])


SOLUTIONS = {
    1: '''
answer = {0: 1, 1: 1, 2: 2}      # 3 waits: 2 blocks needed, 1 left
''',
    2: '''
def tokens_to_look_up(prompt):
    return prompt[:-1]            # the last token always runs: its logits choose the next
''',
    3: '''
answer = "a"
''',
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor)."""
    return show_solution(SOLUTIONS, number)
