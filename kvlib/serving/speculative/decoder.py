"""The verify-and-roll-back loop of speculative decoding (speculative_decoding).

Each round: the drafter proposes k guesses; the target checks them all in one pass (verify: a
chunked prefill of its missing token(s) and the k guesses, k + 1 rows of logits); the
acceptance rule keeps a prefix of the guesses and adds one token of the target's; both caches
are truncated back to what was kept. SpeculativeDecoder runs the rounds and keeps a
SpeculativeStep record of each; speculative_generate is kvlib.generate's counterpart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import numpy as np

from ...cache import BaseKVCache
from ...checks import as_whole_number, as_whole_numbers
from ...inference import (
    check_ids,
    prefill,
)
from ...params import Params
from .acceptance import GreedyAcceptance, SamplingAcceptance, _check_acceptance
from .drafters import (
    Drafter,
    ModelDrafter,
    Proposal,
    _check_proposal,
    _empty_cache,
    _room,
    as_drafter,
    check_model,
    check_speculation_length,
)


def verify(target: Params, cache: BaseKVCache, unseen, proposals) -> np.ndarray:
    """The target's verdict material, in one pass (speculative_decoding): logits (k + 1, V).

    One chunked prefill of the tokens its cache does not hold yet (the sequence's last token,
    or the whole prompt in the first round) followed by the k proposals, continuing the
    cache. The last k + 1 rows are what the target predicts after the sequence and after
    each of its first 1 .. k proposals: row i judges proposal i, row k gives the bonus.
    """
    unseen = check_ids(unseen, target, what="unseen tokens")
    proposals = as_whole_numbers("proposals", proposals)
    logits, _ = prefill(target, np.concatenate([unseen, proposals]).astype(np.intp), cache)
    return logits[-(len(proposals) + 1):]


@dataclass(frozen=True)
class SpeculativeStep:
    """What one round did (speculative_decoding): the draft's proposals, the target's verdict, and
    both caches' lengths before the round, after its passes and after the truncation.

    start: the sequence's length before the round; accepted + 1 tokens were kept.
    """

    start: int
    proposals: tuple[int, ...]
    accepted: int
    next_token: int
    acceptance: tuple[float, ...]
    target_lengths: tuple[int, int, int]
    draft_lengths: tuple[int, int, int]

    @property
    def kept(self) -> tuple[int, ...]:
        """The tokens this round added: the accepted proposals, then the target's token."""
        return self.proposals[: self.accepted] + (self.next_token,)

    @property
    def judged(self) -> int:
        """Proposals the target ruled on: up to and including the first rejection."""
        return len(self.acceptance)

    @property
    def bonus(self) -> bool:
        """True when all proposals were kept and the target's token is a bonus."""
        return self.accepted == len(self.proposals)


@dataclass(frozen=True)
class SpeculativeStats:
    """Totals over rounds (speculative_decoding). acceptance_rate = accepted / judged estimates
    alpha; tokens_per_pass = new tokens / target passes."""

    rounds: int
    proposed: int
    judged: int
    accepted: int
    new_tokens: int

    @property
    def target_passes(self) -> int:
        """One pass of the target a round."""
        return self.rounds

    @property
    def draft_passes(self) -> int:
        """One pass of the draft a proposal: a chunk for the first, a decode step for each
        further one."""
        return self.proposed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.judged if self.judged else math.nan

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else math.nan


def summarize(steps) -> SpeculativeStats:
    """SpeculativeStats of a list of SpeculativeStep."""
    steps = list(steps)
    return SpeculativeStats(
        rounds=len(steps), proposed=sum(len(s.proposals) for s in steps),
        judged=sum(s.judged for s in steps), accepted=sum(s.accepted for s in steps),
        new_tokens=sum(len(s.kept) for s in steps))


class SpeculativeDecoder:
    """A draft and a target decoding one sequence together, a round at a time
    (speculative_decoding).

    Both caches hold a prefix of the sequence: the target's all but its last token between
    rounds, the draft's that or one token less (after a round whose k proposals were all
    kept, the last of them was never fed to the draft). Each round (``step``):

    1. the draft feeds what its cache lacks and proposes k tokens (``propose``);
    2. the target runs one chunked prefill over its missing token(s) and the k proposals,
       k + 1 rows of logits (``verify``);
    3. the acceptance rule keeps a prefix of the proposals and adds one token of the target's;
    4. both caches are truncated back to the sequence (without its new last token).

    draft: a draft model (kvlib Params, with the target's vocabulary; ``target.first_layers(n)``
    for self-speculation) or any Drafter, such as PromptLookupDrafter() (no model: steps 1
    and 4 have no draft pass and no draft cache; a round without a guess is the target's own
    step). acceptance: GreedyAcceptance() (the default: exactly the target's greedy tokens)
    or SamplingAcceptance(temperature, top_k, seed). Caches may be given (empty, for example
    a kvlib.serving.PagedKVCache; draft_cache only with a draft model); by default each
    model gets the one it needs. If a round fails half-way, the caches and the sequence are
    left as they were.
    """

    def __init__(self, target: Params, draft: Params | Drafter, prompt, k: int = 4,
                 acceptance=None, target_cache: BaseKVCache | None = None,
                 draft_cache: BaseKVCache | None = None):
        check_model("target", target)
        self.drafter = as_drafter(draft, draft_cache)
        self.k = check_speculation_length(k)
        prompt = check_ids(prompt, target)
        self.drafter.check(target, len(prompt))
        if len(prompt) > target.config.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the target's context "
                             f"length is {target.config.context_length}")
        self.target, self.draft = target, draft
        self.acceptance = _check_acceptance(GreedyAcceptance() if acceptance is None
                                            else acceptance)
        self.target_cache = _empty_cache("target", target_cache, target)
        self.prompt_length = len(prompt)
        self.sequence: list[int] = [int(i) for i in prompt]
        self.steps: list[SpeculativeStep] = []

    def __repr__(self) -> str:
        rounds = "1 round" if len(self.steps) == 1 else f"{len(self.steps)} rounds"
        drafter = (f"draft cache {len(self.draft_cache)} positions"
                   if isinstance(self.drafter, ModelDrafter) else self.drafter.name)
        return (f"SpeculativeDecoder(k={self.k}, {self.acceptance.name}, "
                f"{len(self.sequence)} tokens, {rounds}; target cache "
                f"{len(self.target_cache)}, {drafter})")

    @property
    def draft_cache(self) -> BaseKVCache | None:
        """The draft model's cache (None for a drafter without one)."""
        return getattr(self.drafter, "cache", None)

    @draft_cache.setter
    def draft_cache(self, cache: BaseKVCache) -> None:
        if not isinstance(self.drafter, ModelDrafter):
            raise TypeError(f"a {self.drafter.name} drafter has no cache to replace")
        self.drafter.cache = cache

    @property
    def generated(self) -> list[int]:
        """The new tokens so far (after the prompt)."""
        return self.sequence[self.prompt_length:]

    def stats(self) -> SpeculativeStats:
        return summarize(self.steps)

    def room(self) -> int:
        """How many proposals the next round can take before a context is full (it may be
        0: the target's own step, no draft)."""
        n = len(self.sequence)
        rooms = [_room(self.target, self.target_cache) - n, self.drafter.room(n)]
        return max(0, min(room for room in rooms if room is not None))

    def step(self, k: int | None = None) -> SpeculativeStep:
        """One round with k proposals (default self.k; fewer when the context is nearly
        full): returns its SpeculativeStep; the sequence grows by accepted + 1 tokens."""
        k = self.k if k is None else check_speculation_length(k)
        if len(self.sequence) > _room(self.target, self.target_cache):
            raise ValueError(f"the target's context is full: the sequence has "
                             f"{len(self.sequence)} tokens, the context length is "
                             f"{_room(self.target, self.target_cache)}")
        return self._round(min(k, self.room()))

    def _round(self, k: int) -> SpeculativeStep:
        target_cache, drafter = self.target_cache, self.drafter
        target_before, draft_before = len(target_cache), drafter.cached
        start = len(self.sequence)
        saved = (target_cache.checkpoint(), drafter.checkpoint(), self._random_state())
        try:
            if k == 0:      # no room for a proposal: the target's own step
                proposal = Proposal((), np.zeros((0, self.target.config.vocab_size)))
            else:
                proposal = drafter.propose(self.sequence, k, self.acceptance.choose)
                _check_proposal(proposal, k, self.target.config.vocab_size)
            draft_after = drafter.cached
            rows = verify(self.target, target_cache, self.sequence[target_before:],
                          proposal.tokens)
            target_after = len(target_cache)
            verdict = self.acceptance.verdict(proposal.tokens, proposal.probabilities, rows)
            self.sequence.extend(proposal.tokens[: verdict.accepted] + (verdict.next_token,))
            held = len(self.sequence) - 1
            target_cache.truncate(held)
            drafter.truncate(held)
        except BaseException:     # an error or a KeyboardInterrupt: leave everything as it was
            target_cache.restore(saved[0])
            drafter.restore(saved[1])
            self._set_random_state(saved[2])
            del self.sequence[start:]
            raise
        step = SpeculativeStep(
            start=start, proposals=proposal.tokens, accepted=verdict.accepted,
            next_token=verdict.next_token, acceptance=verdict.acceptance,
            target_lengths=(target_before, target_after, len(target_cache)),
            draft_lengths=(draft_before, draft_after, drafter.cached))
        self.steps.append(step)
        return step

    def _random_state(self):
        rng = getattr(self.acceptance, "rng", None)
        return None if rng is None else rng.bit_generator.state

    def _set_random_state(self, state) -> None:
        if state is not None:
            self.acceptance.rng.bit_generator.state = state

    def generate(self, max_new_tokens: int) -> list[int]:
        """Run rounds until max_new_tokens more tokens are in the sequence; return them. The
        last rounds propose fewer, so that no token past max_new_tokens is computed. (If a
        round fails, the rounds before it stay done, and the decoder is as after them.)"""
        max_new_tokens = as_whole_number("max_new_tokens", max_new_tokens, 1)
        start = len(self.sequence)
        needed = start + max_new_tokens - 1
        limit = _room(self.target, self.target_cache)
        if needed > limit:
            raise ValueError(f"a sequence of {start} tokens plus {max_new_tokens} new ones "
                             f"needs {needed} positions; the target's context length is "
                             f"{limit}")
        while (done := len(self.sequence) - start) < max_new_tokens:
            self._round(min(self.k, self.room(), max_new_tokens - done - 1))
        return self.sequence[start:]


def speculative_generate(target: Params, draft: Params | Drafter, prompt,
                         max_new_tokens: int, k: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, seed: int | None = None) -> list[int]:
    """kvlib.generate with a draft (speculative_decoding): prompt ids (P,) -> max_new_tokens new
    ids. draft: a draft model (Params) or a Drafter (PromptLookupDrafter()).

    Greedy at temperature 0: exactly kvlib.generate(target, prompt, max_new_tokens). At a
    positive temperature, sampled by speculative sampling, distributed as the target's
    samples (not the same ids as kvlib.generate with the same seed: the random numbers are
    used differently).
    """
    if isinstance(temperature, Real) and not isinstance(temperature, bool) and \
            temperature == 0:
        if top_k is not None:
            as_whole_number("top_k", top_k, 1)
        acceptance = GreedyAcceptance()
    else:
        acceptance = SamplingAcceptance(temperature, top_k, seed)
    decoder = SpeculativeDecoder(target, draft, prompt, k, acceptance)
    return decoder.generate(max_new_tokens)
