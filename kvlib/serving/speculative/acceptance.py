"""The acceptance rules of speculative decoding (speculative_decoding): which of the draft's
guesses the target keeps, and which token of its own it adds.

- GreedyAcceptance: keep a guess when it is the target's argmax; the output is exactly the
  target's own greedy tokens;
- SamplingAcceptance: keep guess x with probability min(1, p(x) / q(x)), else draw the target's
  token from max(0, p - q), normalised (acceptance_probability, residual_distribution); the
  output is distributed exactly as the target's samples.

Each gives a Verdict on one round: how many guesses are kept, and the next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...checks import as_array, as_real_number, as_whole_number
from ...inference import (
    next_token_probabilities,
)

PROBABILITY_TOLERANCE = 1e-6
"""How far from 1 the sum of a probability vector may be (float32 softmax rows pass)."""


def _probabilities(name: str, values) -> np.ndarray:
    """A probability vector (V,) as float64, or an error that says what is wrong."""
    array = as_array(name, values, 1).astype(np.float64)
    if not array.size or not np.isfinite(array).all() or (array < 0).any() or \
            abs(array.sum() - 1) > PROBABILITY_TOLERANCE:
        raise ValueError(f"{name} must be a vector (V,) of finite, non-negative probabilities "
                         f"that sum to 1, got {values!r:.60}")
    return array


def _pair_of_distributions(p, q) -> tuple[np.ndarray, np.ndarray]:
    p, q = _probabilities("p (the target's distribution)", p), \
        _probabilities("q (the draft's distribution)", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must be over the same vocabulary, got {p.size} and "
                         f"{q.size} tokens")
    return p, q


def acceptance_probability(p, q, token: int) -> float:
    """The chance that a proposed token is kept (speculative_decoding): min(1, p(x) / q(x)).

    p (V,) is the target's distribution, q (V,) the draft's, x the token the draft drew from
    q. A token the target likes at least as much as the draft is always kept; one it likes
    less is kept in proportion. Then x is kept with probability q(x) min(1, p(x)/q(x)) =
    min(p(x), q(x)) overall.
    """
    p, q = _pair_of_distributions(p, q)
    token = as_whole_number("token", token, 0, p.size - 1)
    if q[token] == 0:
        raise ValueError(f"the draft gives token {token} probability 0: it cannot have "
                         "proposed it")
    return min(1.0, float(p[token] / q[token]))


def residual_distribution(p, q) -> np.ndarray:
    """Where the target's token comes from after a rejection (speculative_decoding): max(0, p - q),
    normalised, (V,).

    It holds the probability the target gives beyond what the draft's proposals already
    supplied: min(p, q) comes through accepted proposals, the rest, p - min(p, q) =
    max(0, p - q), through this distribution, so that together every token gets p(x).
    When p equals q there is nothing left (and no rejection can happen); p is returned.
    """
    p, q = _pair_of_distributions(p, q)
    excess = np.maximum(p - q, 0.0)
    total = excess.sum()
    return p if total <= 0 else excess / total


def certain(token: int, vocab_size: int) -> np.ndarray:
    """The distribution of a guess made without doubt (speculative_decoding): one-hot (V,) at token.
    Greedy drafts and prompt lookup's guesses have it."""
    distribution = np.zeros(vocab_size)
    distribution[token] = 1.0
    return distribution


def _sample(rng: np.random.Generator, probabilities: np.ndarray) -> int:
    probabilities = np.asarray(probabilities, dtype=np.float64)
    return int(rng.choice(len(probabilities), p=probabilities / probabilities.sum()))


@dataclass(frozen=True)
class Verdict:
    """The target's judgement of one round's proposals (speculative_decoding).

    accepted: how many proposals are kept, from the first (0 .. k); next_token: the target's
    own token after them (a correction at the first rejection, a bonus when all k pass);
    acceptance: each judged proposal's chance of being kept (1 or 0 when greedy), one per
    judged proposal (accepted + 1, or k when all pass).
    """

    accepted: int
    next_token: int
    acceptance: tuple[float, ...]


class GreedyAcceptance:
    """Greedy speculative decoding (speculative_decoding): the draft proposes its argmax, and a
    proposal is kept when it is the target's argmax too. At the first mismatch the target's
    argmax is taken instead, so every kept token is the one the target's own greedy decoding
    would have chosen: the output is exactly the target's greedy tokens."""

    name = "greedy"

    def choose(self, logits_row) -> tuple[int, np.ndarray]:
        """The draft's proposal from its logits row (V,): (argmax, its distribution, one-hot:
        next_token_probabilities at temperature 0, built directly, as it runs every pass)."""
        token = int(np.argmax(logits_row))
        return token, certain(token, len(logits_row))

    def verdict(self, proposals, draft_probabilities, target_logits) -> Verdict:
        """Keep proposals while each is the argmax of the target's row before it; then the
        target's argmax. target_logits (k + 1, V)."""
        choices = np.argmax(target_logits, axis=-1)
        accepted, acceptance = 0, []
        for proposal, choice in zip(proposals, choices):
            acceptance.append(1.0 if proposal == choice else 0.0)
            if proposal != choice:
                break
            accepted += 1
        return Verdict(accepted, int(choices[accepted]), tuple(acceptance))


class SamplingAcceptance:
    """Speculative sampling (speculative_decoding; Leviathan et al. 2023, Chen et al. 2023).

    Draft and target both sample at the same temperature (and top_k). A proposal x drawn
    from the draft's q is kept with probability min(1, p(x)/q(x)); at the first rejection
    the target's token is drawn from max(0, p - q), normalised; when all k are kept, a bonus
    token is drawn from the target's last row. Each kept token is then distributed exactly
    as the target's own sample would be. Seeded: the same seed gives the same tokens.
    """

    name = "sampling"

    def __init__(self, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None):
        temperature = as_real_number("temperature (for temperature 0 use GreedyAcceptance)",
                                  temperature, positive=True)
        top_k, seed = (None if value is None else as_whole_number(name, value, low)
                       for name, value, low in (("top_k", top_k, 1), ("seed", seed, 0)))
        self.temperature, self.top_k = temperature, top_k
        self.rng = np.random.default_rng(seed)

    def distribution(self, logits_row) -> np.ndarray:
        """The sampling distribution of a logits row (V,), float64 (logits_next_token)."""
        return next_token_probabilities(logits_row, self.temperature,
                                        self.top_k)

    def choose(self, logits_row) -> tuple[int, np.ndarray]:
        """The draft's proposal: a sample from its distribution q; (token, q)."""
        q = self.distribution(logits_row)
        return _sample(self.rng, q), q

    def verdict(self, proposals, draft_probabilities, target_logits) -> Verdict:
        """Accept each proposal with min(1, p/q) in turn; at the first rejection draw from
        the residual; after k acceptances draw the bonus from the last row.
        draft_probabilities None: a drafter without a distribution (prompt lookup) is
        certain of its guesses, q one-hot, so each is kept with chance p(x) (vLLM's ngram
        drafts are judged the same way, with a draft probability of 1)."""
        if draft_probabilities is None:
            draft_probabilities = np.zeros((len(proposals), target_logits.shape[1]))
            draft_probabilities[np.arange(len(proposals)), proposals] = 1.0
        accepted, acceptance = 0, []
        for proposal, q, row in zip(proposals, draft_probabilities, target_logits):
            p = self.distribution(row)
            chance = acceptance_probability(p, q, proposal)
            acceptance.append(chance)
            if self.rng.random() >= chance:
                return Verdict(accepted, _sample(self.rng, residual_distribution(p, q)),
                               tuple(acceptance))
            accepted += 1
        bonus = _sample(self.rng, self.distribution(target_logits[accepted]))
        return Verdict(accepted, bonus, tuple(acceptance))


def _check_acceptance(acceptance):
    if not isinstance(acceptance, (GreedyAcceptance, SamplingAcceptance)):
        raise TypeError("acceptance must be GreedyAcceptance() or SamplingAcceptance(...), "
                        f"got {type(acceptance).__name__}")
    return acceptance
