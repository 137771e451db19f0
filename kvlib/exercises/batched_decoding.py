"""Exercises of the batched_decoding lesson (batched decoding and continuous batching): checkers and
solutions.

Exercise 1 asks for the attention mask of a batch of prompts padded on the left: causal, and
no query may see a padded key. The usual mistakes (padding on the right, hiding the padded
rows instead of the padded columns, forgetting the causal part or the padding, True for
"hidden") each get their own diagnosis. Exercise 2 is a transfer: from an A100's datasheet
figures, the batch size from which a decode step's work on the weights is compute-bound.
Exercise 3 asks which waiting requests a continuous-batching scheduler admits at a given step,
first without and then with a token budget.
"""

from __future__ import annotations

import math
from numbers import Integral

import numpy as np

from kvlib import roofline
from kvlib.serving import BlockPool, Request, SamplingParams, batch, scheduler

from .base import (
    Feedback,
    agrees_at_its_precision,
    checker,
    described,
    is_missing,
    not_filled_in,
    read_array,
    read_number,
    read_whole_number,
    show_solution,
)

# Exercise 1 ------------------------------------------------------------------------------

PROMPTS = ([0, 3, 7], [0, 3, 7, 1, 9], [0, 5])
"""Three prompts of the toy (BOS first): 3, 5 and 2 tokens, padded on the left to 5."""


def prompt_lengths() -> list[int]:
    return [len(prompt) for prompt in PROMPTS]


def _masks() -> dict[str, np.ndarray]:
    """The right mask and the usual wrong ones, (B, T, T) each, True = may see."""
    lengths = prompt_lengths()
    T = max(lengths)
    left = batch.padding_mask(lengths)                                   # real, padded left
    right = np.arange(T)[None, :] < np.array(lengths)[:, None]           # real, padded right
    causal = np.tri(T, dtype=bool)[None].repeat(len(lengths), axis=0)
    return {
        "right": causal & left[:, None, :],
        "right padding": causal & right[:, None, :],
        "rows": causal & left[:, :, None],
        "rows, right padding": causal & right[:, :, None],
        "causal only": causal,
        "padding only": np.broadcast_to(left[:, None, :], causal.shape).copy(),
        "transposed": (causal & left[:, None, :]).transpose(0, 2, 1),
        "inverted": ~(causal & left[:, None, :]),
    }


def expected_mask() -> np.ndarray:
    """The mask exercise 1 wants: kvlib.serving.batch.padded_prompt_mask of the batch."""
    _, real = batch.left_pad(list(PROMPTS))
    return batch.padded_prompt_mask(real)


_DIAGNOSES = {
    "right padding": "this is the mask of a batch padded on the RIGHT: each prompt's tokens in "
                     "its first columns. Padded on the left, prompt b's tokens fill its LAST "
                     "len(prompt) columns, so that every prompt's last token sits in the last "
                     "column.",
    "rows, right padding": "this pads on the right, and hides padded rows (queries) instead of "
                           "padded columns (keys). Pad on the left, and hide the columns.",
    "causal only": "every prompt gets the plain causal mask: the padding is not hidden, so a "
                   "short prompt's real tokens attend to the pad tokens before them. Also hide "
                   "the padded COLUMNS (keys): mask[b, :, j] is False for a padded j.",
    "padding only": "the padded columns are hidden, but the mask is not causal: query i may "
                    "not see keys after it. Combine the two: causal AND key is real.",
    "transposed": "rows and columns are swapped: mask[b, i, j] says whether QUERY i may see "
                  "KEY j, so row i is True up to column i (and only on real columns).",
    "inverted": "True and False are swapped: in kvlib (as in transformers' attention_mask), "
                "True means the query MAY see that key. Use ~ to flip it.",
}


def _mask_answer(answer, expected_shape):
    """The answer as a bool array, or a Feedback on its form."""
    array = read_array(answer, "answer", expected_shape, booleans=True)
    if isinstance(array, Feedback):
        return array
    if array.shape == expected_shape[::2]:
        return Feedback(False, f"answer has shape {array.shape}: that says which columns of "
                        "each prompt are real (the padding mask). Attention needs one (T, T) "
                        f"mask per prompt, query by key: shape {expected_shape}.")
    if array.shape != expected_shape:
        return Feedback(False, f"answer should have shape {expected_shape} (prompt, query, "
                        f"key), got {array.shape}.")
    values = array.astype(float)
    if not np.all((values == 0) | (values == 1)):
        return Feedback(False, "answer should hold True/False (or 1/0): True where the query "
                        "may see the key.")
    return values.astype(bool)


@checker
def check_padded_mask(answer) -> Feedback:
    """Exercise 1: the (3, 5, 5) attention mask of PROMPTS padded on the left, True where
    query i of prompt b may see key j. Rows of padded queries are not graded: their output
    is thrown away."""
    if is_missing(answer):
        return not_filled_in("answer", "a (3, 5, 5) array of True/False")
    expected = expected_mask()
    mask = _mask_answer(answer, expected.shape)
    if isinstance(mask, Feedback):
        return mask
    _, real = batch.left_pad(list(PROMPTS))
    graded = np.broadcast_to(real[:, :, None], expected.shape)    # real query rows only
    masks = _masks()
    if np.array_equal(mask[graded], masks["right"][graded]):
        pad_rows = mask[~real]
        note = (" Your padded rows see nothing: a softmax over nothing is 0 / 0, NaN, which "
                "is why kvlib lets a padded query see itself (transformers un-masks such "
                "rows); their output is never read." if not pad_rows.any() else "")
        return Feedback(True, "causal, and every padded column hidden: each real query sees "
                        "its own prompt's tokens up to itself, and the last column holds "
                        f"every prompt's last token.{note}")
    for name in ("right padding", "rows, right padding", "padding only", "transposed",
                 "inverted"):
        if np.array_equal(mask[graded], masks[name][graded]):
            return Feedback(False, _DIAGNOSES[name])
    if np.array_equal(mask[graded], masks["causal only"][graded]):
        if not mask[~real].any():
            return Feedback(False, "you hid the padded ROWS (the pad tokens as queries), but "
                            "the real queries still see the padded COLUMNS (the pad tokens "
                            "as keys). Padding must be hidden as keys: mask[b, :, j] = False "
                            "for every padded j.")
        return Feedback(False, _DIAGNOSES["causal only"])
    wrong = np.argwhere((mask != masks["right"]) & graded)
    b, i, j = (int(x) for x in wrong[0])
    return Feedback(False, f"look at prompt {b}, query {i}, key {j}. Query i may see "
                    "key j when j <= i and column j holds a real token of that prompt (the "
                    f"prompts have {prompt_lengths()} tokens, padded on the left to "
                    f"{max(prompt_lengths())}).")


# Exercise 2 ------------------------------------------------------------------------------

A100 = {"name": "NVIDIA A100 SXM 80GB", "bf16_flops": 312e12, "bandwidth": 2.039e12,
        "source": "NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS "
                  "(624 with sparsity), GPU memory bandwidth 2,039 GB/s (80GB SXM)"}
H100 = {"name": "NVIDIA H100 SXM", "bf16_flops": 989e12, "bandwidth": 3.35e12,
        "source": "NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with "
                  "sparsity (989 dense), GPU memory bandwidth 3.35 TB/s (SXM)"}
BYTES_PER_WEIGHT = 2            # BF16


def weights_bound_batch_size(compute_rate: float, bandwidth: float,
                             bytes_per_weight: int = BYTES_PER_WEIGHT) -> float:
    """From which batch size the work on the weights is compute-bound (exercise 2): each
    weight read (bytes_per_weight bytes) serves 2 FLOPs per sequence, so B sequences do
    2 B / bytes_per_weight FLOPs per byte; set that equal to the ridge point."""
    return roofline.ridge_point(compute_rate, bandwidth) * bytes_per_weight / 2


def _batch_mistakes(rate: float, bandwidth: float) -> list[tuple[float, str]]:
    ridge = rate / bandwidth
    exact = weights_bound_batch_size(rate, bandwidth)
    return [
        (2 * exact, "twice the answer: each weight (2 bytes in BF16) serves 2 FLOPs per "
                    "sequence (a multiply and an add), so B sequences do B FLOPs per byte. "
                    "Counting a multiply-add as one FLOP, or 4 bytes a weight (float32), "
                    "doubles it."),
        (exact / 2, "half the answer: the weights are 2 bytes each in BF16, not 1; B sequences "
                    "do 2 B FLOPs per weight, B per byte."),
        (weights_bound_batch_size(H100["bf16_flops"], H100["bandwidth"]),
         "that is the H100 SXM's figure (989 TFLOP/s, 3.35 TB/s). Use the A100's."),
        (bandwidth / rate, "that is bandwidth / FLOP rate, upside down: the ridge point is "
                           "FLOP/s divided by bytes/s."),
        (exact * 1000, "1000 times too large: TFLOP/s and TB/s share the 10^12, so divide "
                       "312 by 2.039, not 312 by 2.039 x 10^-3."),
        (exact / 1000, "1000 times too small: 2,039 GB/s is 2.039 TB/s; divide 312 by 2.039."),
        (ridge * 4 / 2 * 2, "that is float32 weights counted as multiply-adds: BF16 weights are "
                            "2 bytes and a multiply-add is 2 FLOPs."),
    ]


@checker
def check_compute_bound_batch(answer) -> Feedback:
    """Exercise 2: from what batch size is a decode step's work on the BF16 weights
    compute-bound on an A100 SXM 80GB (312 TFLOP/s dense BF16, 2.039 TB/s)? The ridge point,
    153.0: a batch of 153 or 154 sequences (whole numbers), or the ridge itself at the
    precision it is given (153.0, 153.02, 153.0162...)."""
    value = read_number(answer, "a number of sequences")
    if isinstance(value, Feedback):
        return value
    rate, bandwidth = A100["bf16_flops"], A100["bandwidth"]
    exact = weights_bound_batch_size(rate, bandwidth)
    batches = (math.floor(exact), math.ceil(exact))
    if value in batches or (not value.is_integer() and agrees_at_its_precision(value, exact)):
        return Feedback(True, f"the A100's ridge point is {rate / 1e12:.0f} / "
                        f"{bandwidth / 1e12:.3f} = {exact:.1f} FLOP per byte, and B sequences "
                        f"do B FLOPs per byte of BF16 weights: from about {math.ceil(exact)} "
                        "sequences the weights stop being the bottleneck. The cache is another "
                        "matter: each sequence reads its own, at about 1 FLOP per byte (MHA), "
                        "whatever the batch.")
    if batches[0] - 1 < value < batches[1] + 1 and not value.is_integer():
        return Feedback(False, f"{value:g} sequences: a batch size is a whole number. Give "
                        "the whole batch from which the work is compute-bound, or the ridge "
                        "point itself to the digits you computed.")
    for wrong, explanation in _batch_mistakes(rate, bandwidth):
        if abs(value - wrong) <= 0.01 * abs(wrong) + (0.5 if abs(wrong) >= 10 else 0.0):
            return Feedback(False, f"{value:g} is not it: {explanation}")
    if value < 1:
        return Feedback(False, f"{value:g} is below one sequence: a batch size is a number of "
                        "sequences, and the A100's ridge point is far above one FLOP per byte.")
    return Feedback(False, f"{value:g} is not it. How many FLOPs per byte does the A100 need "
                    "to be compute-bound (FLOP/s over bytes/s), and how many FLOPs does a "
                    "batch of B sequences do for each byte of BF16 weights it reads?")


# Exercise 3 ------------------------------------------------------------------------------

QUESTION_STEP = 7
MAX_BATCH = 4
TOKEN_BUDGET = 24
def _request(request_id: int, arrival: int, prompt_length: int, output_length: int) -> Request:
    """A request of the exercise: only its lengths matter (its prompt is token 1 repeated)."""
    return Request(request_id, [1] * prompt_length, SamplingParams(max_tokens=output_length),
                   arrival)


RUNNING = (_request(0, 0, 6, 30), _request(1, 1, 9, 25))
"""Still generating at step 7: they decode one token each (they do not enter again)."""
FINISHED = (_request(3, 2, 5, 3),)
"""Request 3 got its last token in step 6."""
WAITING = (_request(4, 3, 12, 8), _request(5, 5, 20, 6),
           _request(6, 6, 4, 5))
"""Arrived, not yet admitted: ids 4, 5, 6 (arrivals 3, 5, 6; prompts 12, 20, 4 tokens)."""
LATER = (_request(7, 8, 3, 4),)
"""Arrives at step 8, after the question's step."""


def situation() -> str:
    """The state of the batch at the start of step 7, as the notebook prints it."""
    lines = [f"max_batch (vLLM's --max-num-seqs) = {MAX_BATCH}; start of step {QUESTION_STEP}",
             "running (each decodes one token this step):"]
    lines += [f"  request {r.request_id}: arrived at step {r.arrival}, prompt "
              f"{r.num_prompt_tokens} tokens" for r in RUNNING]
    lines += ["finished (its last token came out in step 6):"]
    lines += [f"  request {r.request_id}" for r in FINISHED]
    lines += ["waiting:"]
    lines += [f"  request {r.request_id}: arrived at step {r.arrival}, prompt "
              f"{r.num_prompt_tokens} tokens" for r in WAITING]
    lines += ["not arrived yet:"]
    lines += [f"  request {r.request_id}: arrives at step {r.arrival}, prompt "
              f"{r.num_prompt_tokens} tokens" for r in LATER]
    return "\n".join(lines)


def admitted(max_batched_tokens: int | None = None) -> list[int]:
    """The ids ContinuousBatching admits at step 7: computed by kvlib's scheduler."""
    server = scheduler.Scheduler(BlockPool(None, 64, 16, enable_prefix_caching=False),
                                 scheduler.ContinuousBatching(MAX_BATCH, max_batched_tokens))
    for request in RUNNING:                         # admitted before: now they decode
        server.add_request(request.fresh())
    record = server.schedule(QUESTION_STEP - 1)
    server.update(record, dict.fromkeys(record.scheduled_tokens, 0))
    for request in WAITING:
        server.add_request(request.fresh())
    return sorted(server.schedule(QUESTION_STEP).admitted)


def _take(order, slots: int, tokens: int | None, overtake: bool = False) -> list[int]:
    """Ids taken from the requests in the given order (no re-sorting), as long as slots and
    tokens last; at a request that does not fit, stop, or with overtake=True skip it."""
    taken = []
    for request in order:
        if len(taken) == slots:
            break
        if tokens is not None and request.num_prompt_tokens > tokens:
            if overtake:
                continue
            break
        tokens = None if tokens is None else tokens - request.num_prompt_tokens
        taken.append(request.request_id)
    return sorted(taken)


def _variants(budget: int | None) -> list[tuple[list[int], str]]:
    """What the usual wrong rules admit, each with what to say about it."""
    free = MAX_BATCH - len(RUNNING)
    tokens = None if budget is None else budget - len(RUNNING)
    by_arrival = sorted(WAITING, key=lambda r: (r.arrival, r.request_id))
    shortest = sorted(WAITING, key=lambda r: (r.num_prompt_tokens, r.request_id))
    latest = sorted(WAITING, key=lambda r: (-r.arrival, r.request_id))
    return [
        ([], "that is static batching's answer: it admits nobody until requests 0 and 1 have "
             "finished too. Continuous batching refills a free slot at the next step."),
        (_take(by_arrival, free - len(FINISHED), None if tokens is None
               else tokens - len(FINISHED)),
         "request 3 got its last token in step 6 and left the batch then: its slot is free "
         f"at step {QUESTION_STEP}. Only requests 0 and 1 are still running."),
        (_take(by_arrival, len(WAITING), tokens),
         f"max_batch is {MAX_BATCH} and requests 0 and 1 hold two slots: two are free."),
        (_take(by_arrival, free, None),
         "the exercise assumes no chunked prefill, as kvlib's ContinuousBatching: a prompt "
         f"is prefilled whole, in one step. Each of requests 0 and 1 decodes one token, "
         f"which leaves {tokens} of the {budget} tokens for prompts; request 4 takes 12, and "
         "request 5's 20 do not fit in the 10 left. (With chunked prefill, vLLM's default, "
         "request 5 would start with a chunk of 10 of its 20 tokens, and this would be "
         "right; without the budget, it is the answer of 3a.)"),
        (_take(by_arrival, free, tokens, overtake=True),
         "request 5 does not fit in what is left of the budget, and first come, first served "
         "never lets a later request overtake it: request 6 waits too (head-of-line blocking; "
         "vLLM stops at the same place with chunked prefill off)."),
        (_take(shortest, free, tokens, overtake=True),
         "those are the shortest prompts: kvlib's scheduler (like vLLM's default) serves "
         "first come, first served, by arrival, whatever the prompt's length."),
        (_take(latest, free, tokens, overtake=True),
         "those arrived last: the queue is served first come, first served, the earliest "
         "arrival first."),
    ]


def _ids(answer):
    """A sorted list of request ids, or a Feedback on the answer's form."""
    if isinstance(answer, (bool, np.bool_)):
        return Feedback(False, "answer should be a list of request ids, like [4, 6], not a "
                        "bool.")
    if isinstance(answer, Integral):
        answer = [answer]
    if isinstance(answer, np.ndarray):
        if answer.ndim > 1 or answer.dtype.kind not in "iuf":
            return Feedback(False, "answer should be a flat list of request ids, like [4, 6].")
        answer = answer.tolist()
    if isinstance(answer, (set, frozenset)):
        answer = list(answer)
    if isinstance(answer, (str, bytes)) or not isinstance(answer, (list, tuple)):
        return Feedback(False, f"answer should be a list of request ids, like [4, 6] ([] for "
                        f"none), got {described(answer)}.")
    ids = []
    for item in answer:
        if isinstance(item, (bool, np.bool_)):
            return Feedback(False, "the ids should be whole numbers, not True/False.")
        if isinstance(item, (list, tuple, np.ndarray)):
            return Feedback(False, f"answer should be a flat list of request ids, like [4, 6], "
                            f"got {described(item)} inside it.")
        value = read_whole_number(item, "a request id (0 to 7)", "every id")
        if isinstance(value, Feedback):
            return Feedback(False, f"the ids should be whole numbers (0 to 7): "
                            f"{value.message}")
        ids.append(value)
    if len(set(ids)) != len(ids):
        return Feedback(False, "a request enters at most once: an id appears twice.")
    return sorted(ids)


def _check_admitted(answer, budget: int | None) -> Feedback:
    if is_missing(answer):
        return not_filled_in("answer", "a list of request ids, [] for none")
    ids = _ids(answer)
    if isinstance(ids, Feedback):
        return ids
    known = {r.request_id for r in RUNNING + FINISHED + WAITING + LATER}
    unknown = [i for i in ids if i not in known]
    if unknown:
        return Feedback(False, f"there is no request {unknown[0]}: the ids are 0, 1, 3 to 7.")
    expected = admitted(budget)
    if ids == expected:
        why = ("two slots are free (request 3 left after step 6), and requests 4 and 5 "
               "arrived first" if budget is None else
               f"requests 0 and 1 decode one token each, leaving {budget - len(RUNNING)} of "
               f"the {budget} tokens; request 4 takes 12, request 5's 20 do not fit in the "
               "10 left, and request 6 may not overtake it")
        return Feedback(True, f"{expected}: {why}.")
    inside = sorted(set(ids) & {r.request_id for r in RUNNING})
    if inside:
        return Feedback(False, f"request{'s' if len(inside) > 1 else ''} {inside} "
                        f"{'are' if len(inside) > 1 else 'is'} already in the batch: running "
                        "requests decode one token this step; they do not enter again.")
    if any(r.request_id in ids for r in LATER):
        return Feedback(False, f"request {LATER[0].request_id} arrives at step "
                        f"{LATER[0].arrival}: at step {QUESTION_STEP} it is not there yet, so "
                        "it cannot enter.")
    if 3 in ids:
        return Feedback(False, "request 3 has finished (its last token came out in step 6): "
                        "it leaves the batch, and its slot goes to a waiting request.")
    for wrong, explanation in _variants(budget):
        if ids == wrong and wrong != expected:
            return Feedback(False, f"{ids} is not it: {explanation}")
    return Feedback(False, f"{ids} is not it. Count the free slots ({MAX_BATCH} minus the "
                    "requests still running), then take the waiting requests in order of "
                    "arrival" + ("" if budget is None else
                                 ", while their prompts fit in what the decodes leave of the "
                                 "token budget, stopping at the first that does not") + ".")


@checker
def check_admitted(answer) -> Feedback:
    """Exercise 3a: which requests does continuous batching admit at step 7?"""
    return _check_admitted(answer, None)


@checker
def check_admitted_with_budget(answer) -> Feedback:
    """Exercise 3b: the same with max_batched_tokens = 24 (a decode takes one token of it,
    a prefill its whole prompt: no chunked prefill)."""
    return _check_admitted(answer, TOKEN_BUDGET)


SOLUTIONS = {
    1: """
lengths = [len(p) for p in exercises.PROMPTS]            # [3, 5, 2]
T = max(lengths)
real = np.arange(T)[None, :] >= (T - np.array(lengths))[:, None]    # (3, 5), padded left
causal = np.tri(T, dtype=bool)                                      # (5, 5)
answer = causal[None, :, :] & real[:, None, :]          # hide padded COLUMNS (keys)
# kvlib: kvlib.serving.batch.padded_prompt_mask(real), which also lets a padded row see itself
""",
    2: """
ridge = 312e12 / 2.039e12            # FLOP per byte the A100 needs: 153.0
# B sequences: 2 FLOPs per weight each, 2 bytes per BF16 weight -> B FLOPs per byte
answer = ridge                       # about 153 sequences (154 is the first whole batch above)
""",
    3: """
# 3a: slots free = 4 - 2 (request 3 left after step 6); first come, first served
answer = [4, 5]
# 3b: budget 24 - 2 decode tokens = 22; request 4 takes 12, leaving 10; request 5 needs 20
# and is never split (no chunked prefill): stop there (request 6 may not overtake)
answer = [4]
""",
}


def solution(number: int):
    """Show the solution to exercise `number` (for the instructor, after students try)."""
    return show_solution(SOLUTIONS, number)
