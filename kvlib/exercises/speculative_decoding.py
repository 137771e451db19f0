"""Exercises of the speculative_decoding lesson (speculative decoding): checkers and solutions.

1. Tokens a round adds on average, for an acceptance rate and a k other than the lesson's
   (a transfer of the formula 1 + alpha + ... + alpha^k).
2. Find the bug: a greedy speculative round that truncates the draft's cache after a
   rejection but forgets the target's. The checker runs the student's fixed round on four
   draft/target pairs (the lesson's story models; rejections every round, mixed, never) and
   says what went wrong first: the caches' lengths and contents after every round, the
   tokens against the target's own greedy decoding, then what the round returns (the tokens
   it kept).
3. The chance that each token is kept if the draft proposes it, min(1, p/q), for given p and q.
"""

from __future__ import annotations

import math
from functools import lru_cache
from numbers import Real

import numpy as np

import kvlib
from kvlib import stories
from kvlib.serving import speculative

from .base import (
    Feedback,
    agrees_at_its_precision,
    as_number,
    checker,
    described,
    how_close,
    is_missing,
    not_filled_in,
    read_array,
    read_number,
    read_whole_number,
    show_solution,
    shown,
    significant_digits,
)

ROUNDING = 6e-4      # a value copied from a print at 3 decimals is off by up to 5e-4
PRINTED_DIGITS = 3   # the notebook prints tokens a pass at 2 decimals: 2.18, 3 digits

# Exercise 1: another draft, another k
EXERCISE1_ALPHA, EXERCISE1_K = 0.6, 3

# Exercise 3: the target's and the draft's distributions over a four-token vocabulary
EXERCISE3_P = (0.5, 0.2, 0.2, 0.1)
EXERCISE3_Q = (0.3, 0.5, 0.1, 0.1)


# Exercise 1 ------------------------------------------------------------------------------

@checker
def check_tokens_per_pass(answer) -> Feedback:
    """Exercise 1: the tokens a round adds on average (per pass of the target) when each
    proposal is accepted with probability 0.6, independently, and the draft proposes k = 3."""
    value = read_number(answer, "a number of tokens")
    if isinstance(value, Feedback):
        return value
    a, k = EXERCISE1_ALPHA, EXERCISE1_K
    expected = speculative.expected_tokens_per_pass(a, k)

    def near(target: float) -> bool:
        return abs(value - target) <= ROUNDING

    if near(expected) or agrees_at_its_precision(value, expected, PRINTED_DIGITS):
        return Feedback(True, f"1 + 0.6 + 0.36 + 0.216 = {expected:.3f} tokens a pass: each "
                        "round adds the target's own token, and proposal i counts when the "
                        f"first i are all accepted (alpha^i). Plain decoding adds 1.")
    diagnoses = [
        ((1 - a**k) / (1 - a), "that is 1 + alpha + alpha^2 = 1.96: one term short. Count "
                               "the target's own token (1) and each of the 3 proposals, "
                               "proposal i with alpha^i: the sum runs up to alpha^3."),
        (a * k + 1, "that counts each proposal with probability alpha on its own. Proposal i "
                    "is kept only if all before it were: probability alpha^i, not alpha."),
        (a * k, "that counts each proposal with probability alpha on its own and forgets the "
                "target's own token. Proposal i is kept only if all before it were (alpha^i), "
                "and every round adds one token of the target's."),
        (1 / (1 - a), "that is the limit for an endless k, 1 / (1 - alpha). With k = 3 the "
                      "sum stops at alpha^3."),
        (k + 1.0, "that is the most a round can add, when all 3 proposals are accepted, which "
                  "happens with probability alpha^3 only."),
        (expected - 1, "that counts the accepted proposals alone, alpha + alpha^2 + alpha^3. "
                       "The round also adds the target's own token (the correction or the "
                       "bonus): add 1."),
        (a**k, "that is the chance that all 3 proposals are accepted, alpha^3."),
        (a ** (k + 1), "that is alpha^4; the expected tokens are a sum, 1 + alpha + alpha^2 "
                       "+ alpha^3."),
        (speculative.expected_tokens_per_pass(a, k + 1), "that is k = 4: the sum has one term "
                                                         "per proposal plus 1, up to alpha^3."),
        (speculative.expected_tokens_per_pass(a, k - 1) if k > 1 else math.nan,
         "that is k = 2: with 3 proposals the sum runs up to alpha^3."),
    ]
    for wrong, message in diagnoses:
        if near(wrong):
            return Feedback(False, message)
    if significant_digits(value) < PRINTED_DIGITS and abs(value - expected) < 0.05:
        return Feedback(False, f"{value:g} is rounded too far to tell: give the number to 2 "
                        "decimals at least, as the notebook prints tokens a pass.")
    close = how_close(value, expected) if significant_digits(value) >= PRINTED_DIGITS else None
    if close is not None:
        return Feedback(False, f"{value:g} is close ({close}) but not it: compute each term, "
                        "alpha^i for i = 0 to 3, to 3 decimals, and add them.")
    return Feedback(False, f"not {value:.6g}. A round adds 1 + alpha + alpha^2 + ... + alpha^k "
                    "tokens on average, (1 - alpha^(k+1)) / (1 - alpha).")


# Exercise 2 ------------------------------------------------------------------------------

STORY_TARGET, STORY_DRAFT = "stories", "stories-draft"
EXERCISE2_ROUNDS = 12


def perturbed(params: kvlib.Params, scale: float, seed: int) -> kvlib.Params:
    """A copy of a model with every weight moved by scale x N(0, 1) x its own spread: a
    stand-in draft that agrees with the model sometimes (the checker's mixed pair)."""
    rng = np.random.default_rng(seed)

    def moved(array):
        if array is None:
            return None
        noise = rng.standard_normal(array.shape) * scale * float(np.std(array) or 1.0)
        return (array + noise).astype(array.dtype)

    layers = tuple(type(layer)(**{name: moved(value) for name, value in layer.arrays().items()})
                   for layer in params.layers)
    return kvlib.Params(params.config, moved(params.embedding), layers,
                        moved(params.position_table), moved(params.ln_f_gain),
                        moved(params.ln_f_bias))


@lru_cache(maxsize=1)
def exercise2_cases():
    """(label, target, draft, prompt, k, new tokens) of the pairs the checker runs."""
    toy = kvlib.init_params()
    prompt = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    target = stories.load_model(STORY_TARGET, "float64")
    draft = stories.load_model(STORY_DRAFT, "float64")
    story_prompt = stories.StoryTokenizer().encode("Mia had a red ball.")
    return (
        ("the lesson's story models", target, draft, story_prompt, 4, 24),
        ("a draft the toy target rejects often", toy,
         kvlib.init_params(kvlib.ModelConfig(n_layers=1), seed=0), prompt, 3, 12),
        ("a draft that is the target itself (every proposal accepted)", toy, toy, prompt, 3,
         12),
        ("a slightly different copy of the toy target", toy, perturbed(toy, 0.5, 21), prompt,
         2, 12),
    )


def _divergence(params, cache, sequence) -> str:
    """How far the next logits computed on this cache are from the target's own decoding."""
    try:
        logits = kvlib.decode_step(params, sequence[-1], cache)
    except ValueError:            # the cache is full: the rejected rows filled it
        return "cannot even be computed: the rejected rows fill the cache."
    own = kvlib.forward(params, sequence, last_only=True)
    return (f"differ from the target's own decoding by up to "
            f"{float(np.max(np.abs(logits - own))):.3g}.")


def _cache_feedback(which: str, params, cache, sequence, expected_length: int, label: str,
                    round_number: int) -> Feedback | None:
    """None when the cache holds exactly sequence[:expected_length]'s keys and values."""
    held = len(cache)
    where = f"With {label}, after round {round_number}"
    if held > expected_length:
        if which == "target":
            return Feedback(False, f"{where} the target's cache holds {held} positions, but "
                            f"the sequence has {len(sequence)} tokens, the last one not fed "
                            f"yet: {held - expected_length} of the cached positions are K and "
                            "V of rejected proposals. The next pass attends to them, and its "
                            f"logits {_divergence(params, cache, sequence)} Truncate the "
                            "target's cache too, to len(sequence) - 1.")
        return Feedback(False, f"{where} the draft's cache holds {held} positions, "
                        f"{held - expected_length} more than it should: rejected proposals are "
                        "still in it, and the draft would propose from a context that is not "
                        "the sequence. Truncate it to min(len(draft_cache), len(sequence) - 1).")
    if held < expected_length:
        fed = ("what it was fed that the sequence kept, without the sequence's last token"
               if which == "draft" else "all but the sequence's last token")
        return Feedback(False, f"{where} the {which}'s cache holds {held} positions, "
                        f"{expected_length - held} fewer than it can keep ({expected_length}: "
                        f"{fed}). The tokens stay right, but the next pass computes again what "
                        "the cache had: truncate to "
                        + ("len(sequence) - 1." if which == "target" else
                           "min(len(draft_cache), len(sequence) - 1)."))
    fresh = kvlib.prefill(params, sequence[:held])[1] if held else None
    for layer in range(params.config.n_layers if held else 0):
        if not np.allclose(cache.keys(layer), fresh.keys(layer), rtol=0, atol=1e-9) \
                or not np.allclose(cache.values(layer), fresh.values(layer), rtol=0,
                                   atol=1e-9):
            return Feedback(False, f"{where} the {which}'s cache has the right length, "
                            f"{held}, but not the keys and values of the sequence's first "
                            f"{held} tokens (layer {layer} differs): it was filled with other "
                            "tokens, or in another order.")
    return None


def _run_case(step, label, target, draft, prompt, k, new_tokens) -> Feedback | None:
    reference = list(prompt) + kvlib.generate(target, prompt, new_tokens)
    sequence = list(prompt)
    target_cache, draft_cache = kvlib.make_cache(target.config), kvlib.make_cache(draft.config)
    for round_number in range(1, EXERCISE2_ROUNDS + 1):
        before = len(sequence)
        if before >= len(reference):
            break
        try:
            returned = step(target, draft, sequence, target_cache, draft_cache, k)
        except Exception as error:   # noqa: BLE001 - whatever a student's code raises is reported
            hint = ""
            if "truncate" in str(error):
                hint = (". Between rounds the target's cache holds all but the sequence's last "
                        "token, len(sequence) - 1 positions; the draft's one fewer after a "
                        "round whose proposals were all kept (its last proposal was never fed "
                        "to it): min(len(draft_cache), len(sequence) - 1)")
            return Feedback(False, f"With {label}, round {round_number} raised "
                            f"{type(error).__name__}: {error}"[:600] + hint + ".")
        if not isinstance(sequence, list) or len(sequence) == before:
            return Feedback(False, f"With {label}, round {round_number} did not add any "
                            "token to sequence (every round adds at least the target's own "
                            "token): extend the list in place (sequence.extend(kept)), do not "
                            "assign a new list to the name.")
        added = len(sequence) - before
        if added > k + 1:
            return Feedback(False, f"With {label}, round {round_number} added {added} tokens; "
                            f"a round adds at most k + 1 = {k + 1} (k proposals and the "
                            "target's token).")
        if not all(isinstance(t, (int, np.integer)) for t in sequence[before:]):
            return Feedback(False, f"With {label}, round {round_number} added "
                            f"{shown(sequence[before:])}: token ids must be whole numbers.")
        # the draft fed the sequence and k - 1 proposals; it keeps what the sequence confirms
        expected = {"target": len(sequence) - 1,
                    "draft": min(before + k - 1, len(sequence) - 1)}
        for which, params, cache in (("target", target, target_cache),
                                     ("draft", draft, draft_cache)):
            feedback = _cache_feedback(which, params, cache, sequence, expected[which],
                                       label, round_number)
            if feedback is not None:
                return feedback
        n = min(len(sequence), len(reference))
        if [int(t) for t in sequence[:n]] != reference[:n]:
            first = next(i for i in range(n) if int(sequence[i]) != reference[i])
            return Feedback(False, f"With {label}, round {round_number} gave new token "
                            f"{first - len(prompt)} = {int(sequence[first])}; the target's own "
                            f"greedy decoding gives {reference[first]}. Keep the proposals "
                            "while each is the argmax of the target's row before it, then add "
                            "the target's argmax.")
        problem = _return_problem(returned, [int(t) for t in sequence[before:]])
        if problem is not None:
            return Feedback(False, f"With {label}, round {round_number} added the right "
                            f"tokens to sequence, but returned {problem}")
    return None


def _return_problem(returned, added: list[int]) -> str | None:
    """None when a round returned the tokens it added (a list, tuple or 1-D array of whole
    numbers); else what it returned and why that is not it, in words."""
    wanted = (f"It should return the tokens it kept, the ones it added to sequence: "
              f"{added} (kept = proposals[:accepted] + [the target's token]).")
    if returned is None:
        return f"None. {wanted}"
    if isinstance(returned, np.ndarray) and returned.ndim == 1:
        returned = returned.tolist()
    if not isinstance(returned, (list, tuple)):
        return f"{described(returned)}. {wanted}"
    tokens = []
    for item in returned:
        token = read_whole_number(item, "a token id") if not isinstance(
            item, (list, tuple, np.ndarray)) else None
        if not isinstance(token, int):
            return f"{shown(returned)}: token ids are whole numbers. {wanted}"
        tokens.append(token)
    if tokens != added:
        return f"{shown(returned)}. {wanted}"
    return None


@checker
def check_speculative_round(answer) -> Feedback:
    """Exercise 2: a fixed speculative_round(target, draft, sequence, target_cache,
    draft_cache, k) that extends sequence in place with the round's tokens and leaves both
    caches holding what the next round needs."""
    if is_missing(answer):
        return not_filled_in("answer", "your fixed function (answer = speculative_round_fixed)")
    if not callable(answer):
        return Feedback(False, "answer should be your fixed function, speculative_round_fixed "
                        f"(without brackets); got {described(answer)}.")
    cases = exercise2_cases()
    for case in cases:
        feedback = _run_case(answer, *case)
        if feedback is not None:
            return feedback
    return Feedback(True, f"right on {len(cases)} pairs of draft and target: every round's "
                    "tokens are the target's greedy ones, and after every round the target's "
                    "cache holds the sequence but its last token and the draft's no rejected "
                    "proposal.")


# Exercise 3 ------------------------------------------------------------------------------

def exercise3_answer() -> np.ndarray:
    """min(1, p/q) for each of the four tokens."""
    return np.array([speculative.acceptance_probability(EXERCISE3_P, EXERCISE3_Q, x)
                     for x in range(len(EXERCISE3_P))])


@checker
def check_acceptance_probabilities(answer) -> Feedback:
    """Exercise 3: for each of the 4 tokens, the chance that it is kept if the draft
    proposes it (p, the target's distribution; q, the draft's)."""
    if is_missing(answer):
        return not_filled_in("answer", "four numbers, one chance per token")
    array = read_array(answer, "answer", (4,))
    if isinstance(array, Feedback):
        if isinstance(answer, Real) and not isinstance(answer, bool) and \
                as_number(answer) is not None and \
                abs(float(answer) - float(np.minimum(EXERCISE3_P, EXERCISE3_Q).sum())) \
                <= ROUNDING:
            return Feedback(False, "0.7 = sum of min(p, q) is the chance that a proposal is "
                            "kept on average (alpha for this position). The exercise asks for "
                            "each token's chance, 4 numbers.")
        return array
    array = array.astype(float)
    if array.shape != (4,):
        return Feedback(False, f"answer should be 4 numbers, one per token, got shape "
                        f"{array.shape}.")
    if not np.isfinite(array).all():
        return Feedback(False, "answer has NaN or infinite values: each entry is a "
                        "probability between 0 and 1.")
    p, q = np.array(EXERCISE3_P), np.array(EXERCISE3_Q)
    expected = exercise3_answer()
    if np.allclose(array, expected, rtol=0, atol=ROUNDING):
        return Feedback(True, "[1, 0.4, 1, 1]: tokens 0, 2 and 3 are liked by the target at "
                        "least as much as by the draft and always kept; token 1 is proposed "
                        "with 0.5 but the target gives it 0.2, so it is kept 0.2 / 0.5 = 40% "
                        "of the time. Kept overall: q x min(1, p/q) = min(p, q).")
    residual = np.maximum(p - q, 0)
    diagnoses = [
        (p / q, "some entries are above 1: p/q is 2 for token 2, but a chance cannot exceed "
                "1. Take min(1, p/q)."),
        (np.minimum(1, q / p), "upside down: that is min(1, q/p). A token is kept with the "
                               "target's probability over the draft's, min(1, p/q)."),
        (q / p, "upside down and not capped: the chance is min(1, p/q), the target's "
                "probability over the draft's, at most 1."),
        (np.minimum(p, q), "that is min(p, q), the chance that the draft proposes the token "
                           "AND it is kept: q x min(1, p/q). The exercise asks for the chance "
                           "once it is proposed: min(1, p/q)."),
        (p, "that is p, the target's distribution. A proposed token is kept with probability "
            "min(1, p/q): always when the target likes it at least as much as the draft."),
        (q, "that is q, the draft's distribution. A proposed token is kept with probability "
            "min(1, p/q)."),
        (residual, "that is max(0, p - q), the residual the target's token is drawn from "
                   "after a rejection (normalised). The chance of being kept is min(1, p/q)."),
        (residual / residual.sum(), "that is the residual distribution, max(0, p - q) "
                                    "normalised: where the target's token comes from after a "
                                    "rejection. The chance of being kept is min(1, p/q)."),
        (1 - expected, "those are the chances of rejection, 1 - min(1, p/q): the exercise asks "
                       "for the chance of being kept."),
        ((p >= q).astype(float), "that keeps a token only when p >= q, as if greedy. Token 1 "
                                 "(p = 0.2 < q = 0.5) is still kept 0.2 / 0.5 of the time: "
                                 "min(1, p/q)."),
        (np.minimum(1, p / q) * q, "that multiplies by q: it is the chance of being proposed "
                                   "and kept, min(p, q). Once proposed, the chance is min(1, "
                                   "p/q)."),
    ]
    for wrong, message in diagnoses:
        if np.allclose(array, wrong, rtol=0, atol=ROUNDING):
            return Feedback(False, message)
    if array.max() > 1 and (array >= 0).all():
        said = ("those look like percentages: a chance is a number between 0 and 1 (25% is "
                "0.25)")
        chances = array / 100
        if np.allclose(chances, expected, rtol=0, atol=ROUNDING):
            return Feedback(False, f"{said}. Divided by 100, they are right.")
        for wrong, message in diagnoses:
            if np.allclose(chances, wrong, rtol=0, atol=ROUNDING):
                return Feedback(False, f"{said}. Read as chances: {message}")
        return Feedback(False, f"{said}. For each token x the chance is min(1, p(x) / q(x)).")
    worst = int(np.argmax(np.abs(array - expected)))
    return Feedback(False, f"look at token {worst}. For each token x the chance is "
                    "min(1, p(x) / q(x)).")


SOLUTIONS = {
    1: """
alpha, k = 0.6, 3
answer = (1 - alpha ** (k + 1)) / (1 - alpha)     # 1 + 0.6 + 0.36 + 0.216 = 2.176
""",
    2: """
def speculative_round_fixed(target, draft, sequence, target_cache, draft_cache, k):
    logits, _ = kvlib.prefill(draft, sequence[len(draft_cache):], draft_cache, last_only=True)
    proposals = []
    for i in range(k):
        proposals.append(int(np.argmax(logits[-1])))
        if i < k - 1:
            logits = kvlib.decode_step(draft, proposals[-1], draft_cache)
    rows, _ = kvlib.prefill(target, sequence[len(target_cache):] + proposals, target_cache)
    choices = np.argmax(rows[-(k + 1):], axis=-1)
    accepted = 0
    while accepted < k and choices[accepted] == proposals[accepted]:
        accepted += 1
    kept = proposals[:accepted] + [int(choices[accepted])]
    sequence.extend(kept)
    target_cache.truncate(len(sequence) - 1)             # the missing line
    draft_cache.truncate(min(len(draft_cache), len(sequence) - 1))
    return kept

answer = speculative_round_fixed
""",
    3: """
p = np.array([0.5, 0.2, 0.2, 0.1])
q = np.array([0.3, 0.5, 0.1, 0.1])
answer = np.minimum(1, p / q)                        # [1, 0.4, 1, 1]
""",
}


def solution(number: int):
    """Show exercise `number`'s solution (for the instructor, after students have tried)."""
    return show_solution(SOLUTIONS, number)
