"""Speculative decoding (speculative_decoding; Leviathan et al. 2023, Chen et al. 2023).

A decode step of a large model reads all of its weights to produce one token (where_time_goes);
a pass over k + 1 tokens reads them once too, and costs little more. So a small draft model
guesses the next k tokens with its own cached decode, and the target checks all k guesses in
one pass: a chunked prefill of the last token and the k guesses, continuing its cache (the
mask aligned to the end, the kv_cached_decode lesson). Its k + 1 rows of logits say what the target
itself would choose after each prefix. The guesses up to the first one the target rejects are kept,
then one token of the target's own (at the rejection, or a bonus token after the last row
when all k pass), and both caches are truncated back to what was kept (cache.truncate).

The pieces, one job each:

- ``propose``: the draft's k guesses and its distribution at each, (k,) and (k, V);
- a drafter is whatever proposes the guesses: ``ModelDrafter`` (a draft model and its cache;
  a kvlib Params given as the draft becomes one, and ``target.first_layers(n)`` makes the
  target's own first layers a draft: self-speculation) or ``PromptLookupDrafter`` (no model:
  the tokens that followed the last n-gram's earlier occurrence in the prompt and output,
  ``prompt_lookup``);
- ``verify``: the target's k + 1 rows of logits, in one pass;
- ``GreedyAcceptance``: keep a guess when it is the target's argmax. The output is exactly
  the target's own greedy tokens;
- ``SamplingAcceptance``: keep guess x with probability min(1, p(x) / q(x)), else draw the
  target's token from max(0, p - q), normalised (``acceptance_probability``,
  ``residual_distribution``). The output is distributed exactly as the target's samples;
- ``SpeculativeDecoder``: the loop, both caches, a ``SpeculativeStep`` record per round;
  ``speculative_generate`` is kvlib.generate's counterpart;
- what to expect: ``expected_tokens_per_pass(alpha, k)`` = (1 - alpha^(k+1)) / (1 - alpha),
  ``predicted_speedup(alpha, k, c)``, ``greedy_agreements`` and ``replay_greedy`` (the
  rounds greedy decoding will take, from where the draft agrees with the target), and
  ``outcome_probabilities``: the exact distribution of one step's outcome.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from ..cache import BaseKVCache, make_cache
from ..checks import LARGEST_COUNT, count, numbers, real_number, whole_number, whole_numbers
from ..inference import (
    _check_logits_row,
    check_ids,
    decode_step,
    forward,
    next_token_probabilities,
    prefill,
)
from ..params import Params

PROBABILITY_TOLERANCE = 1e-6
"""How far from 1 the sum of a probability vector may be (float32 softmax rows pass)."""


# -------------------------------------------------------------------------- checks

def check_speculation_length(k) -> int:
    """k, the number of tokens the draft proposes a round: a whole number of at least 1."""
    if isinstance(k, bool) or not isinstance(k, Integral):
        raise TypeError(f"k (tokens the draft proposes a round) must be a whole number, "
                        f"got {k!r}")
    if k < 1:
        raise ValueError(f"k (tokens the draft proposes a round) must be at least 1, got {k}: "
                         "with no proposals there is nothing to verify (that is plain "
                         "decoding, kvlib.generate)")
    if k > LARGEST_COUNT:
        raise ValueError(f"k (tokens the draft proposes a round) must be at most "
                         f"{LARGEST_COUNT:,}, got {k:,}")
    return int(k)


def check_model(name: str, params: Params) -> None:
    """Refuse, saying why, a target or draft model speculative decoding cannot run."""
    if not isinstance(params, Params):
        raise TypeError(f"the {name} must be kvlib Params (kvlib.init_params or "
                        f"kvlib.gpt2.load), got {type(params).__name__}")
    if params.config.window is not None:
        raise ValueError(f"the {name} has a sliding window: its ring-buffer cache cannot "
                         "be truncated back past positions it overwrote (notebook 17), "
                         "which speculative decoding does after every rejection")


def check_pair(target: Params, draft: Params) -> None:
    """Refuse a target and a draft that cannot work together, saying why (speculative_decoding)."""
    check_model("target", target)
    check_model("draft", draft)
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(
            f"the draft and the target have different vocabularies ({draft.config.vocab_size} "
            f"and {target.config.vocab_size} tokens): the draft's token ids would mean other "
            "tokens to the target. Speculative decoding needs a draft with the target's "
            "tokenizer")


def _probabilities(name: str, values) -> np.ndarray:
    """A probability vector (V,) as float64, or a ValueError that says what is wrong."""
    try:
        array = numbers(name, values).astype(np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a vector of probabilities, got {values!r}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a vector of probabilities (V,), got shape "
                         f"{array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError(f"{name} must hold finite, non-negative probabilities")
    if abs(array.sum() - 1) > PROBABILITY_TOLERANCE:
        raise ValueError(f"{name} must sum to 1, got {array.sum():.6g}")
    return array


def _pair_of_distributions(p, q) -> tuple[np.ndarray, np.ndarray]:
    p, q = _probabilities("p (the target's distribution)", p), \
        _probabilities("q (the draft's distribution)", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must be over the same vocabulary, got {p.size} and "
                         f"{q.size} tokens")
    return p, q


# -------------------------------------------------------------------------- the rule

def acceptance_probability(p, q, token: int) -> float:
    """The chance that a proposed token is kept (speculative_decoding): min(1, p(x) / q(x)).

    p (V,) is the target's distribution, q (V,) the draft's, x the token the draft drew from
    q. A token the target likes at least as much as the draft is always kept; one it likes
    less is kept in proportion. Then x is kept with probability q(x) min(1, p(x)/q(x)) =
    min(p(x), q(x)) overall.
    """
    p, q = _pair_of_distributions(p, q)
    token = whole_number("token", token, 0)
    if token >= p.size:
        raise ValueError(f"token must be between 0 and {p.size - 1}, got {token}")
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
    vocab_size = count("vocab_size", vocab_size, 1)
    token = whole_number("token", token, 0, vocab_size - 1)
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
        logits_row = _check_logits_row(logits_row)
        token = int(np.argmax(logits_row))
        return token, certain(token, len(logits_row))

    def verdict(self, proposals, draft_probabilities, target_logits) -> Verdict:
        """Keep proposals while each is the argmax of the target's row before it; then the
        target's argmax. target_logits (k + 1, V)."""
        proposals, target_logits = _check_round(proposals, target_logits)
        choices = np.argmax(target_logits, axis=-1)
        accepted, acceptance = 0, []
        for proposal, choice in zip(proposals, choices):
            acceptance.append(1.0 if proposal == choice else 0.0)
            if proposal != choice:
                break
            accepted += 1
        return Verdict(accepted, int(choices[accepted]), tuple(acceptance))


def _check_round(proposals, target_logits) -> tuple[list[int], np.ndarray]:
    """k proposals (token ids) and the target's k + 1 rows of logits (k + 1, V) over them."""
    proposals = [int(p) for p in whole_numbers("proposals", proposals)]
    target_logits = numbers("target_logits", target_logits, 2)
    if len(target_logits) != len(proposals) + 1 or target_logits.shape[1] == 0:
        raise ValueError(f"target_logits must be (k + 1, V) = ({len(proposals) + 1}, V) for "
                         f"{len(proposals)} proposals, got {target_logits.shape}")
    if proposals and max(proposals) >= target_logits.shape[1]:
        raise ValueError(f"proposals must be token ids below {target_logits.shape[1]}, got "
                         f"{max(proposals)}")
    return proposals, target_logits


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
        if isinstance(temperature, bool) or not isinstance(temperature, Real) or \
                not temperature > 0:
            raise ValueError(f"temperature must be a positive number (for temperature 0 use "
                             f"GreedyAcceptance), got {temperature!r}")
        real_number("temperature", temperature, positive=True)
        if top_k is not None:
            top_k = whole_number("top_k", top_k, 1)
        if seed is not None:
            seed = whole_number("seed", seed, 0)
        self.temperature, self.top_k = float(temperature), top_k
        self.rng = np.random.default_rng(seed)

    def distribution(self, logits_row) -> np.ndarray:
        """The sampling distribution of a logits row (V,), float64 (logits_next_token)."""
        return next_token_probabilities(_check_logits_row(logits_row), self.temperature,
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
        proposals, target_logits = _check_round(proposals, target_logits)
        if draft_probabilities is None:
            draft_probabilities = np.zeros((len(proposals), target_logits.shape[1]))
            draft_probabilities[np.arange(len(proposals)), proposals] = 1.0
        draft_probabilities = numbers("draft_probabilities", draft_probabilities, 2)
        if draft_probabilities.shape != (len(proposals), target_logits.shape[1]):
            raise ValueError(f"draft_probabilities must be (k, V) = ({len(proposals)}, "
                             f"{target_logits.shape[1]}), got {draft_probabilities.shape}")
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


def _check_proposal(proposal, k: int, vocab_size: int) -> None:
    """Refuse, in words, what a drafter returned if the round cannot use it."""
    if not isinstance(proposal, Proposal):
        raise TypeError(f"a drafter's propose must return a Proposal(tokens, probabilities), "
                        f"got {type(proposal).__name__}")
    tokens = proposal.tokens
    if len(tokens) > k:
        raise ValueError(f"the drafter proposed {len(tokens)} tokens where at most {k} "
                         "were asked for")
    if any(isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size
           for t in tokens):
        raise ValueError(f"the drafter's proposals must be token ids between 0 and "
                         f"{vocab_size - 1}, got {list(tokens)}")
    probabilities = proposal.probabilities
    if probabilities is not None and np.shape(probabilities) != (len(tokens), vocab_size):
        raise ValueError(f"the drafter's probabilities must be (proposals, V) = "
                         f"({len(tokens)}, {vocab_size}) or None, got shape "
                         f"{np.shape(probabilities)}")


def _check_acceptance(acceptance):
    if not isinstance(acceptance, (GreedyAcceptance, SamplingAcceptance)):
        raise TypeError("acceptance must be GreedyAcceptance() or SamplingAcceptance(...), "
                        f"got {type(acceptance).__name__}")
    return acceptance


# -------------------------------------------------------------------------- the two passes

@dataclass(frozen=True)
class Proposal:
    """The draft's guesses for one round: tokens (k,) and its distribution before each,
    probabilities (k, V) (one-hot when greedy), or None from a drafter without a
    distribution (prompt lookup: its guesses count as certain). A drafter may propose
    fewer than k tokens, or none."""

    tokens: tuple[int, ...]
    probabilities: np.ndarray


def propose(draft: Params, cache: BaseKVCache, unseen, k: int, choose) -> Proposal:
    """The draft's k proposals with its own cached decode (speculative_decoding).

    unseen: the tokens of the sequence the draft's cache does not hold yet, the last one
    included (1 of them, or 2 after a round whose k proposals were all kept). They go in as
    one chunk (a chunked prefill, the kv_cached_decode lesson); its last row gives the first
    proposal, and each proposal is fed back for the next: k passes, after which the cache holds the
    sequence and the first k - 1 proposals. choose: logits row -> (token, distribution).
    """
    k = check_speculation_length(k)
    if not callable(choose):
        raise TypeError(f"choose must be a function logits row -> (token, distribution), such "
                        f"as GreedyAcceptance().choose, got {choose!r}")
    if not isinstance(cache, BaseKVCache):
        raise TypeError(f"cache must be a kvlib cache, got {type(cache).__name__}")
    unseen = check_ids(unseen, draft, what="unseen tokens")
    room = draft.config.context_length if cache.capacity is None else cache.capacity
    if len(cache) + len(unseen) + k - 1 > room:
        raise ValueError(f"{len(unseen)} unseen tokens and {k} proposals need "
                         f"{len(cache) + len(unseen) + k - 1} positions; the draft's cache "
                         f"holds {room}")
    saved = cache.checkpoint()
    try:
        logits, _ = prefill(draft, unseen, cache, last_only=True)
        tokens, probabilities = [], []
        for index in range(k):
            chosen = choose(logits[-1])
            if not (isinstance(chosen, tuple) and len(chosen) == 2):
                raise TypeError(f"choose must return (token, distribution), got {chosen!r:.80}")
            token, distribution = chosen
            tokens.append(token)
            probabilities.append(distribution)
            if index < k - 1:
                logits = decode_step(draft, token, cache)
    except BaseException:          # choose failed half-way: the cache as it was
        cache.restore(saved)
        raise
    return Proposal(tuple(tokens), np.array(probabilities))


def verify(target: Params, cache: BaseKVCache, unseen, proposals) -> np.ndarray:
    """The target's verdict material, in one pass (speculative_decoding): logits (k + 1, V).

    One chunked prefill of the tokens its cache does not hold yet (the sequence's last token,
    or the whole prompt in the first round) followed by the k proposals, continuing the
    cache. The last k + 1 rows are what the target predicts after the sequence and after
    each of its first 1 .. k proposals: row i judges proposal i, row k gives the bonus.
    """
    unseen = check_ids(unseen, target, what="unseen tokens")
    proposals = whole_numbers("proposals", proposals)
    logits, _ = prefill(target, np.concatenate([unseen, proposals]).astype(np.intp), cache)
    return logits[-(len(proposals) + 1):]


# -------------------------------------------------------------------------- drafters

class Drafter:
    """Whatever proposes a round's guesses (speculative_decoding). SpeculativeDecoder asks it for:

    - ``propose(sequence, k, choose)``: a Proposal of at most k tokens after the sequence
      (its ids so far, (n,)); choose is the acceptance rule's logits row -> (token,
      distribution), for drafters that have logits;
    - ``truncate(n_tokens)``: after the verdict, forget what follows the sequence's first
      n_tokens (a cache to cut back);
    - ``room(n_tokens)``: how many proposals it can make after n_tokens (None: no limit of
      its own); ``check(target, prompt_length)``: refuse, in words, a target it cannot
      serve; ``cached``: positions it caches; ``checkpoint()`` / ``restore(state)``: put
      back its state when a round fails half-way.

    This base class is a drafter with no state of its own; a subclass writes ``propose``.
    """

    name = "drafter"
    cached = 0
    """Positions it caches: none."""

    def propose(self, sequence, k: int, choose) -> Proposal:
        raise NotImplementedError(f"{type(self).__name__} must define propose(sequence, k, "
                                  "choose) -> Proposal")

    def check(self, target: Params, prompt_length: int) -> None:
        """Nothing to refuse."""

    def room(self, n_tokens: int) -> int | None:
        """No context of its own: only the target's limits the proposals."""
        return None

    def truncate(self, n_tokens: int) -> None:
        """Nothing to forget."""

    def checkpoint(self):
        return None

    def restore(self, state) -> None:
        """No state to put back."""


class ModelDrafter(Drafter):
    """A draft model and its own cache (speculative_decoding): the drafter of the first half of the
    lesson. Any kvlib Params will do, as long as it has the target's vocabulary: a small
    model trained apart, or the target's own first layers, ``target.first_layers(n)``
    (self-speculation: an early exit, LayerSkip's draft, with the target's own weights).

    Its cache holds a prefix of the sequence: all but the last token, or one token less
    after a round whose k proposals were all kept (the last was never fed to it).
    """

    name = "draft model"

    def __init__(self, params: Params, cache: BaseKVCache | None = None):
        if not isinstance(params, Params):
            raise TypeError(f"a ModelDrafter needs kvlib Params, got {type(params).__name__}")
        self.params = params
        self.cache = _empty_cache("draft", cache, params)

    def __repr__(self) -> str:
        return (f"ModelDrafter({self.params.config.n_layers} layers; cache of "
                f"{len(self.cache)} positions)")

    def check(self, target: Params, prompt_length: int) -> None:
        check_pair(target, self.params)
        prompt_length = whole_number("prompt_length", prompt_length, 1)
        if prompt_length > self.params.config.context_length:
            raise ValueError(f"the prompt has {prompt_length} tokens but the draft's context "
                             f"length is {self.params.config.context_length}")

    def room(self, n_tokens: int) -> int:
        """Proposals the draft can make after a sequence of n_tokens: its context (or its
        cache's capacity) minus what it must hold; it never feeds its last proposal."""
        return _room(self.params, self.cache) - whole_number("n_tokens", n_tokens, 0) + 1

    def propose(self, sequence, k: int, choose) -> Proposal:
        """k guesses after the sequence (ids, (n,)): feed what the cache lacks, then decode
        (``propose``). choose: the acceptance rule's logits row -> (token, distribution)."""
        sequence = whole_numbers("sequence (token ids)", sequence)
        if len(sequence) <= len(self.cache):
            raise ValueError(f"the draft's cache holds {len(self.cache)} positions, the sequence "
                             f"{len(sequence)} tokens: it must hold fewer, a prefix of it")
        return propose(self.params, self.cache, sequence[len(self.cache):], k, choose)

    def truncate(self, n_tokens: int) -> None:
        """Keep at most the sequence's first n_tokens positions in the cache."""
        self.cache.truncate(min(len(self.cache), whole_number("n_tokens", n_tokens, 0)))

    @property
    def cached(self) -> int:
        return len(self.cache)

    def checkpoint(self):
        return self.cache.checkpoint()

    def restore(self, state) -> None:
        self.cache.restore(state)


def prompt_lookup(sequence, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """Prompt-lookup drafting (speculative_decoding): up to k guesses copied from earlier text.

    sequence: the ids so far (n,), prompt and output. For n from max_ngram down to min_ngram,
    take the last n ids and find their first earlier occurrence in the sequence; the guesses
    are the (up to k) ids that followed it. No occurrence of any length: no guesses, ().
    The longest n-gram wins, and of its occurrences the first, as in transformers'
    PromptLookupCandidateGenerator and vLLM's ngram proposer.
    """
    k = check_speculation_length(k)
    max_ngram, min_ngram = _check_ngrams(max_ngram, min_ngram)
    ids = whole_numbers("sequence (token ids)", sequence)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        # windows[i] = ids[i : i + n] over ids[:-1]: every n-gram but the last one itself
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if found.size:
            start = int(found[0]) + n           # what followed the first occurrence
            return tuple(int(i) for i in ids[start:start + k])
    return ()


def _check_ngrams(max_ngram, min_ngram) -> tuple[int, int]:
    max_ngram = count("max_ngram", max_ngram, 1)
    min_ngram = count("min_ngram", min_ngram, 1)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram ({min_ngram}) must not be above max_ngram ({max_ngram})")
    return max_ngram, min_ngram


class PromptLookupDrafter(Drafter):
    """Guesses without a model (speculative_decoding): ``prompt_lookup`` over the prompt and the
    output so far. Worth it where the output repeats its input (a passage to repeat or
    summarize, code to edit, names): transformers' ``prompt_lookup_num_tokens``, vLLM's
    ``ngram`` method. It has no cache and no distribution: its guesses count as certain
    (probabilities None), and a round it cannot guess in is the target's own step."""

    name = "prompt lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = _check_ngrams(max_ngram, min_ngram)

    def __repr__(self) -> str:
        return f"PromptLookupDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def propose(self, sequence, k: int, choose=None) -> Proposal:
        """Up to k guesses (``prompt_lookup``); choose is not used (no logits to choose
        from)."""
        return Proposal(prompt_lookup(sequence, k, self.max_ngram, self.min_ngram), None)


def as_drafter(draft, cache: BaseKVCache | None = None) -> Drafter:
    """The drafter for SpeculativeDecoder's draft argument: kvlib Params become a
    ModelDrafter with the given cache (a fresh one by default); a Drafter is used as it is."""
    if isinstance(draft, Params):
        return ModelDrafter(draft, cache)
    if isinstance(draft, Drafter):
        if cache is not None:
            raise ValueError("draft_cache goes with a draft model given as Params; a drafter "
                             "brings its own cache (ModelDrafter(params, cache)) or none")
        return draft
    raise TypeError(f"the draft must be kvlib Params (a draft model) or a Drafter "
                    f"(ModelDrafter, PromptLookupDrafter), got {type(draft).__name__}")


# -------------------------------------------------------------------------- the loop

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
    if not isinstance(steps, (list, tuple)) or \
            not all(isinstance(step, SpeculativeStep) for step in steps):
        raise TypeError(f"steps must be a list of SpeculativeStep (decoder.steps), got "
                        f"{steps!r:.80}")
    steps = list(steps)
    return SpeculativeStats(
        rounds=len(steps), proposed=sum(len(s.proposals) for s in steps),
        judged=sum(s.judged for s in steps), accepted=sum(s.accepted for s in steps),
        new_tokens=sum(len(s.kept) for s in steps))


def _empty_cache(name: str, cache, params: Params) -> BaseKVCache:
    if cache is None:
        return make_cache(params.config)
    if not isinstance(cache, BaseKVCache):
        raise TypeError(f"{name}_cache must be a kvlib cache, got {type(cache).__name__}")
    if cache.config != params.config:
        raise ValueError(f"{name}_cache was made for another model than the {name}")
    if len(cache) != 0:
        raise ValueError(f"{name}_cache must be empty; it holds {len(cache)} positions")
    return cache


def _room(params: Params, cache: BaseKVCache) -> int:
    """How many positions this model can compute: its context length, or less when the
    cache given has a smaller capacity."""
    limit = params.config.context_length
    return limit if cache.capacity is None else min(limit, cache.capacity)


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
        max_new_tokens = whole_number("max_new_tokens", max_new_tokens, 1)
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
            whole_number("top_k", top_k, 1)
        acceptance = GreedyAcceptance()
    else:
        acceptance = SamplingAcceptance(temperature, top_k, seed)
    decoder = SpeculativeDecoder(target, draft, prompt, k, acceptance)
    return decoder.generate(max_new_tokens)


# -------------------------------------------------------------------------- what to expect

def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha (the acceptance rate) must be a number between 0 and 1, "
                         f"got {alpha!r}")
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
    if isinstance(draft_cost, bool) or not isinstance(draft_cost, Real) or \
            not draft_cost >= 0:
        raise ValueError(f"draft_cost (c) must be a number >= 0, got {draft_cost!r}")
    draft_cost = real_number("draft_cost (c)", draft_cost, minimum=0)
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
    if isinstance(agreements, np.ndarray):
        if agreements.dtype != bool or agreements.ndim != 1:
            raise TypeError(f"agreements must be a flat sequence of True or False, got an "
                            f"array of {agreements.dtype} {agreements.shape}")
        return agreements.tolist()
    if not isinstance(agreements, (list, tuple)) or \
            not all(isinstance(a, (bool, np.bool_)) for a in agreements):
        raise TypeError(f"agreements must be a flat sequence of True or False (as "
                        f"greedy_agreements gives), got {agreements!r:.80}")
    return [bool(a) for a in agreements]


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
    prefix = tuple(int(i) for i in whole_numbers("prefix", prefix))
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
