"""Who proposes a round's guesses (speculative_decoding): a Drafter.

- ModelDrafter: a draft model and its own cache (a kvlib Params given as the draft becomes
  one; target.first_layers(n) makes the target's own first layers a draft: self-speculation),
  proposing with propose();
- PromptLookupDrafter: no model, the tokens that followed the last n-gram's earlier occurrence
  in the prompt and output (prompt_lookup).

A drafter returns a Proposal: its guesses and its distribution before each. The checks that a
target and a draft can work together (check_pair) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ...cache import BaseKVCache, make_cache
from ...checks import as_count, as_whole_numbers
from ...inference import (
    check_ids,
    decode_step,
    prefill,
)
from ...params import Params


def check_speculation_length(k) -> int:
    """k, the number of tokens the draft proposes a round: a whole number of at least 1
    (with none there is nothing to verify: that is plain decoding, kvlib.generate)."""
    return as_count("k (tokens the draft proposes a round)", k, 1)


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


@dataclass(frozen=True)
class Proposal:
    """The draft's guesses for one round: tokens (k,) and its distribution before each,
    probabilities (k, V) (one-hot when greedy), or None from a drafter without a
    distribution (prompt lookup: its guesses count as certain). A drafter may propose
    fewer than k tokens, or none."""

    tokens: tuple[int, ...]
    probabilities: np.ndarray


def _check_proposal(proposal, k: int, vocab_size: int) -> None:
    """Refuse, in words, what a drafter (a learner's, perhaps) returned if the round cannot
    use it."""
    tokens = getattr(proposal, "tokens", ())
    if not isinstance(proposal, Proposal) or len(tokens) > k or any(
            isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size
            for t in tokens) or proposal.probabilities is not None and \
            np.shape(proposal.probabilities) != (len(tokens), vocab_size):
        raise ValueError(f"a drafter's propose must return a Proposal of at most {k} token ids "
                         f"below {vocab_size} and their probabilities, (proposals, "
                         f"{vocab_size}) or None; got {proposal!r:.80}")


def propose(draft: Params, cache: BaseKVCache, unseen, k: int, choose) -> Proposal:
    """The draft's k proposals with its own cached decode (speculative_decoding).

    unseen: the tokens of the sequence the draft's cache does not hold yet, the last one
    included (1 of them, or 2 after a round whose k proposals were all kept). They go in as
    one chunk (a chunked prefill, the kv_cached_decode lesson); its last row gives the first
    proposal, and each proposal is fed back for the next: k passes, after which the cache holds the
    sequence and the first k - 1 proposals. choose: logits row -> (token, distribution).
    """
    k, unseen = check_speculation_length(k), check_ids(unseen, draft, what="unseen tokens")
    if not callable(choose) or not isinstance(cache, BaseKVCache):
        raise TypeError(f"choose must be a function logits row -> (token, distribution), such "
                        f"as GreedyAcceptance().choose, and cache a kvlib cache; got "
                        f"{choose!r:.40} and {type(cache).__name__}")
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
        if prompt_length > self.params.config.context_length:
            raise ValueError(f"the prompt has {prompt_length} tokens but the draft's context "
                             f"length is {self.params.config.context_length}")

    def room(self, n_tokens: int) -> int:
        """Proposals the draft can make after a sequence of n_tokens: its context (or its
        cache's capacity) minus what it must hold; it never feeds its last proposal."""
        return _room(self.params, self.cache) - n_tokens + 1

    def propose(self, sequence, k: int, choose) -> Proposal:
        """k guesses after the sequence (ids, (n,)): feed what the cache lacks, then decode
        (``propose``). choose: the acceptance rule's logits row -> (token, distribution)."""
        return propose(self.params, self.cache, sequence[len(self.cache):], k, choose)

    def truncate(self, n_tokens: int) -> None:
        """Keep at most the sequence's first n_tokens positions in the cache."""
        self.cache.truncate(min(len(self.cache), n_tokens))

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
    ids = as_whole_numbers("sequence (token ids)", sequence)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        # windows[i] = ids[i : i + n] over ids[:-1]: every n-gram but the last one itself
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if found.size:
            start = int(found[0]) + n           # what followed the first occurrence
            return tuple(int(i) for i in ids[start:start + k])
    return ()


def _check_ngrams(max_ngram, min_ngram) -> tuple[int, int]:
    max_ngram = as_count("max_ngram", max_ngram, 1)
    min_ngram = as_count("min_ngram", min_ngram, 1)
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


def _empty_cache(name: str, cache, params: Params) -> BaseKVCache:
    if cache is None:
        return make_cache(params.config)
    if not isinstance(cache, BaseKVCache) or cache.config != params.config or len(cache):
        raise ValueError(f"{name}_cache must be an empty kvlib cache made for the {name} "
                         f"(not for another model), got {cache!r:.80}")
    return cache


def _room(params: Params, cache: BaseKVCache) -> int:
    """How many positions this model can compute: its context length, or less when the
    cache given has a smaller capacity."""
    limit = params.config.context_length
    return limit if cache.capacity is None else min(limit, cache.capacity)
