"""Exercises of the_engine lesson (the engine): checkers and solutions.

1. A scheduling decision by hand: which requests the next step runs, and how many tokens each.
2. Find the bug in a small engine: a prefix-cache lookup that lets a repeated prompt reuse all
   of its blocks, so that its last token never runs and no logits come out.
3. Why static batching's time to first token grew (a choice, with the reason in words).
"""

from __future__ import annotations

from collections.abc import Mapping

import kvlib
from kvlib.serving import Engine, SamplingParams

from .base import (
    Feedback,
    checker,
    is_missing,
    not_filled_in,
    read_whole_number,
    show_solution,
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


def _as_schedule(answer):
    if isinstance(answer, Mapping):
        items = list(answer.items())
    else:
        return None
    schedule = {}
    for key, value in items:
        whole = [read_whole_number(x) for x in (key, value)]
        if any(isinstance(x, Feedback) for x in whole):
            return None
        schedule[whole[0]] = whole[1]
    return schedule


@checker
def check_schedule(answer) -> Feedback:
    """Exercise 1: {request id: tokens it computes in the next step}."""
    if is_missing(answer):
        return not_filled_in("answer", "a dict {request id: tokens}")
    schedule = _as_schedule(answer)
    if schedule is None:
        return Feedback(False, "expected a dict of whole numbers, {request id: tokens this "
                        "step}, for example {0: 1}.")
    expected = exercise1_answer()
    if schedule == expected:
        return Feedback(True, "running requests first, one decode token each (request 1's "
                        "position 8 opens a new block); then request 2, which takes its first "
                        "block from the prefix cache and computes only its last 2 tokens; "
                        "request 3 would need 2 blocks and only 1 is left, so it waits (and "
                        "nobody behind it may jump the queue).")
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
    return Feedback(False, f"not {schedule}. Go in order: running requests first (1 token "
                    "each), then waiting ones first come, first served, each after its cached "
                    "prefix, while tokens and blocks last.")


# Exercise 2 ------------------------------------------------------------------------------

def buggy_tokens_to_look_up(prompt: list[int]) -> list[int]:
    """The small engine's bug: it looks up the whole prompt in the prefix cache."""
    return prompt


@checker
def check_tokens_to_look_up(function) -> Feedback:
    """Exercise 2: tokens_to_look_up(prompt) -> the tokens whose full blocks may come from
    the prefix cache."""
    if is_missing(function):
        return not_filled_in("tokens_to_look_up", "your function")
    if not callable(function):
        return Feedback(False, f"expected a function, got {type(function).__name__}.")
    cases = [list(range(1, 9)), list(range(1, 10)), [7], list(range(3, 15))]
    for prompt in cases:
        try:
            result = function(list(prompt))
        except Exception as error:       # the student's code: any error is an answer
            return Feedback(False, f"on the prompt {prompt} your function raised "
                            f"{type(error).__name__}: {error}")
        if is_missing(result):
            return not_filled_in("tokens_to_look_up", "a body that returns a list of tokens")
        try:
            result = [int(t) for t in result]
        except (TypeError, ValueError):
            return Feedback(False, f"expected a list of token ids, got {result!r:.60}.")
        full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
        if result == prompt and full == len(prompt):
            return Feedback(False, f"for the prompt {prompt} (a whole number of blocks) that "
                            "lets every block come from the cache: nothing is left to run, so "
                            "no logits come out for the next token. Keep the last token out "
                            "of the lookup.")
        if result != prompt[:-1]:
            return Feedback(False, f"for {prompt} expected the prompt without its last token "
                            f"({prompt[:-1]}), got {result}.")
    return Feedback(True, "the last token always runs through the model, even when its block "
                    "is cached: its logits are the ones that choose the next token (vLLM "
                    "looks up num_tokens - 1 for the same reason).")


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
