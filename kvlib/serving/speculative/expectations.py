"""What to expect from speculative decoding (speculative_decoding): tokens a round adds,
expected_tokens_per_pass(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha), and the speed-up,
predicted_speedup(alpha, k, c); where a draft agrees with the target (greedy_agreements) and
the rounds greedy decoding will take (replay_greedy); the exact distribution of one round's
outcome (outcome_probabilities).
"""

from __future__ import annotations

import math

import numpy as np

from ...checks import as_real_number, as_whole_numbers
from ...inference import (
    check_ids,
    forward,
)
from ...params import Params
from .acceptance import _probabilities, acceptance_probability, residual_distribution
from .drafters import check_pair, check_speculation_length


def _check_alpha(alpha) -> float:
    if as_real_number("alpha (the acceptance rate)", alpha, minimum=0) > 1:
        raise ValueError(f"alpha (the acceptance rate) must be between 0 and 1, got {alpha!r}")
    return float(alpha)


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens a round adds on average when each proposal is accepted with probability
    alpha, independently (speculative_decoding): 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) /
    (1 - alpha); k + 1 when alpha = 1."""
    alpha, k = _check_alpha(alpha), check_speculation_length(k)
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Speed-up over plain decoding (speculative_decoding): tokens per round over the round's cost
    in target steps, (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), where c = draft_cost is a
    draft pass's time relative to a target pass, and the target's pass over k + 1 tokens is
    taken to cost one decode step (true while decoding is limited by reading the weights)."""
    draft_cost = as_real_number("draft_cost (c)", draft_cost, minimum=0)
    return expected_tokens_per_pass(alpha, k) / (k * draft_cost + 1)


def greedy_agreements(target: Params, draft: Params, prompt, new_tokens) -> np.ndarray:
    """Where the draft's greedy choice is the target's (speculative_decoding): bool (N,).

    new_tokens are the target's greedy continuation of the prompt (kvlib.generate); entry i
    says whether the draft, given the prompt and new_tokens[:i], would propose new_tokens[i].
    One forward pass of each model over the whole sequence. Its mean is the greedy
    acceptance rate alpha, whatever k.
    """
    check_pair(target, draft)
    prompt = check_ids(prompt, target)
    new_tokens = check_ids(new_tokens, target, what="new tokens")
    sequence = np.concatenate([prompt, new_tokens])
    rows = slice(len(prompt) - 1, len(sequence) - 1)
    target_choices = np.argmax(forward(target, sequence)[rows], axis=-1)
    if not np.array_equal(target_choices, new_tokens):
        raise ValueError("new_tokens are not the target's greedy continuation of the prompt "
                         "(kvlib.generate(target, prompt, n) gives it)")
    return np.argmax(forward(draft, sequence)[rows], axis=-1) == new_tokens


def replay_greedy(agreements, k: int) -> list[int]:
    """The accepted count of every round greedy speculative decoding takes to produce
    len(agreements) tokens (speculative_decoding), from greedy_agreements alone.

    A round starting at new token i accepts the run of agreements from i, at most k (and
    fewer near the end, as SpeculativeDecoder.generate does), then adds the target's token.
    """
    k = check_speculation_length(k)
    agreements = _agreements(agreements)
    total, done, rounds = len(agreements), 0, []
    while done < total:
        limit = min(k, total - done - 1)
        accepted = 0
        while accepted < limit and agreements[done + accepted]:
            accepted += 1
        rounds.append(accepted)
        done += accepted + 1
    return rounds


def _agreements(agreements) -> list[bool]:
    """A flat sequence of True/False (greedy_agreements gives one), as a list of bools."""
    flat = agreements.tolist() if isinstance(agreements, np.ndarray) and agreements.ndim == 1 \
        else agreements
    if not isinstance(flat, (list, tuple)) or not all(isinstance(a, (bool, np.bool_))
                                                      for a in flat):
        raise TypeError(f"agreements must be a flat sequence of True or False (as "
                        f"greedy_agreements gives), got {agreements!r:.80}")
    return [bool(a) for a in flat]


MAX_OUTCOME_PATHS = 10**6
"""outcome_probabilities follows every path of a round: at most this many."""


def outcome_probabilities(target_distribution, draft_distribution, prefix, k: int
                          ) -> dict[tuple[int, ...], float]:
    """The exact distribution of one round of speculative sampling (speculative_decoding):
    {tokens kept: probability}, by enumeration, no sampling.

    target_distribution(sequence) and draft_distribution(sequence) give each model's
    distribution (V,) of the token after a sequence (a tuple of ids). Every way the round
    can go is followed: each proposal the draft can draw (probability q), kept (min(1, p/q))
    or rejected (the rest) and replaced by each token of the residual, or the bonus token
    after k acceptances. Only for a tiny vocabulary: V^k draft paths.
    """
    k = check_speculation_length(k)
    for name, function in (("target_distribution", target_distribution),
                           ("draft_distribution", draft_distribution)):
        if not callable(function):
            raise TypeError(f"{name} must be a function sequence -> distribution (V,), got "
                            f"{function!r}")
    prefix = tuple(int(i) for i in as_whole_numbers("prefix", prefix))
    outcomes: dict[tuple[int, ...], float] = {}

    def add(tokens, probability):
        if probability > 0:
            outcomes[tokens] = outcomes.get(tokens, 0.0) + probability

    def follow(kept: tuple[int, ...], probability: float) -> None:
        p = _probabilities("target_distribution(...)", target_distribution(prefix + kept))
        if len(kept) == k:                                   # all accepted: the bonus
            for token in np.flatnonzero(p):
                add(kept + (int(token),), probability * p[token])
            return
        q = _probabilities("draft_distribution(...)", draft_distribution(prefix + kept))
        if not kept and k * math.log(q.size) > math.log(MAX_OUTCOME_PATHS):
            raise ValueError(f"a round of k = {k} proposals over {q.size} tokens has up to "
                             f"{q.size}^{k} paths, more than {MAX_OUTCOME_PATHS:,}: this "
                             "enumeration is for a tiny vocabulary and small k")
        residual = residual_distribution(p, q)
        rejected = 0.0
        for token in np.flatnonzero(q):
            chance = acceptance_probability(p, q, token)
            rejected += q[token] * (1 - chance)
            if chance > 0:
                follow(kept + (int(token),), probability * q[token] * chance)
        for token in np.flatnonzero(residual):
            add(kept + (int(token),), probability * rejected * residual[token])

    follow((), 1.0)
    return outcomes
