"""Notebook 23, on SmolLM2 without a second model: the drafters of kvlib.serving.speculative.

Prompt lookup (``prompt_lookup``, ``PromptLookupDrafter``) against a brute-force reading of
its rule; self-speculation (``Params.first_layers``) whose cache is the target's first layers;
greedy speculative decoding with either drafter equal to the target's own greedy tokens on
random models of every architecture (float64), on the trained story model and on SmolLM2,
for random k; sampling with a drafter that has no distribution (certain guesses) distributed
exactly as the target's; and bad input refused in words."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import configs, token_lists

import kvlib
from kvlib.serving import speculative as sp

TOLERANCE = 1e-10


# ---------------------------------------------------------------------------------------------
# prompt_lookup: the longest n-gram, its first earlier occurrence, what followed it
# ---------------------------------------------------------------------------------------------

def lookup_by_brute_force(sequence, k, max_ngram, min_ngram):
    """The rule read word for word: for n from max_ngram down, the first i < len - n with
    sequence[i:i+n] == the last n ids; the k ids after it."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(sequence):
            continue
        last = sequence[-n:]
        for i in range(len(sequence) - n):
            if sequence[i:i + n] == last:
                return tuple(sequence[i + n:i + n + k])
    return ()


@given(st.lists(st.integers(0, 3), min_size=0, max_size=30), st.integers(1, 8),
       st.integers(1, 5), st.integers(0, 4))
@settings(max_examples=300, deadline=None)
def test_prompt_lookup_follows_its_rule(sequence, k, max_ngram, shorter):
    min_ngram = max(1, max_ngram - shorter)
    found = sp.prompt_lookup(sequence, k, max_ngram, min_ngram)
    assert found == lookup_by_brute_force(sequence, k, max_ngram, min_ngram)
    assert len(found) <= k and all(isinstance(t, int) for t in found)
    assert sp.PromptLookupDrafter(max_ngram, min_ngram).propose(sequence, k).tokens == found


def test_prompt_lookup_by_hand():
    # vLLM's docstring example (vllm/v1/spec_decode/ngram_proposer.py): min 2, max 3, k 4
    assert sp.prompt_lookup([1, 2, 3, 4, 2, 3], 4, max_ngram=3, min_ngram=2) == (4, 2, 3)
    # the longest n-gram wins over an earlier, shorter one
    assert sp.prompt_lookup([7, 1, 5, 9, 1, 2, 8, 5, 1, 2], 2, max_ngram=2) == (8, 5)
    # of the occurrences of one n-gram, the first
    assert sp.prompt_lookup([3, 4, 3, 5, 3], 3, max_ngram=1) == (4, 3, 5)
    # overlapping occurrences count: "a a a" after "a a"
    assert sp.prompt_lookup([0, 0, 0], 4, max_ngram=2) == (0,)
    # nothing earlier: no guess; min_ngram forbids the shorter ones
    assert sp.prompt_lookup([1, 2, 3], 4) == ()
    assert sp.prompt_lookup([1, 9, 2, 9], 4, max_ngram=3, min_ngram=2) == ()
    assert sp.prompt_lookup([1, 9, 2, 9], 4, max_ngram=3, min_ngram=1) == (2, 9)
    assert sp.prompt_lookup([5], 3) == () and sp.prompt_lookup([], 3) == ()
    assert sp.prompt_lookup(np.array([2, 6, 2], dtype=np.int32), 1) == (6,)


@pytest.mark.parametrize("call, error, words", [
    (lambda: sp.prompt_lookup([1, 2, 1], 0), ValueError, "at least 1"),
    (lambda: sp.prompt_lookup([1, 2, 1], 2.5), TypeError, "whole number"),
    (lambda: sp.prompt_lookup([1, 2, 1], 2, max_ngram=0), ValueError, "max_ngram must be"),
    (lambda: sp.prompt_lookup([1, 2, 1], 2, max_ngram=2, min_ngram=3), ValueError,
     "must not be above max_ngram"),
    (lambda: sp.prompt_lookup([1.5, 2.0], 2), TypeError, "must be whole numbers"),
    (lambda: sp.prompt_lookup([[1, 2]], 2), TypeError, "must be whole numbers"),
    (lambda: sp.prompt_lookup([1, -2, 1], 2), ValueError, "must be >= 0"),
    (lambda: sp.PromptLookupDrafter(min_ngram=0), ValueError, "min_ngram must be"),
    (lambda: sp.PromptLookupDrafter(max_ngram=2, min_ngram=4), ValueError, "must not be above"),
    (lambda: sp.PromptLookupDrafter(max_ngram="3"), TypeError, "whole number"),
])
def test_bad_lookups_are_refused_in_words(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ---------------------------------------------------------------------------------------------
# Params.first_layers: an early exit whose cache is the target's first layers
# ---------------------------------------------------------------------------------------------

@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_first_layers_cache_what_the_whole_model_caches_there(data):
    config = data.draw(configs(window=False))
    params = kvlib.init_params(config, seed=data.draw(st.integers(0, 1000)))
    n = data.draw(st.integers(1, config.n_layers))
    ids = token_lists(data.draw, config, max_size=12)
    early = params.first_layers(n)
    assert early.config == config.replace(n_layers=n) and early.layers == params.layers[:n]
    assert early.embedding is params.embedding             # shared, not copied
    _, whole = kvlib.prefill(params, ids)
    _, cut = kvlib.prefill(early, ids)
    for layer in range(n):
        np.testing.assert_array_equal(cut.keys(layer), whole.keys(layer))
        np.testing.assert_array_equal(cut.values(layer), whole.values(layer))
    if n == config.n_layers:
        np.testing.assert_array_equal(kvlib.forward(early, ids), kvlib.forward(params, ids))


@pytest.mark.parametrize("n, error, words", [
    (0, ValueError, "n_layers must be at least 1"),
    (4, ValueError, "n_layers must be at most 3"),
    (1.0, TypeError, "whole number"), (True, TypeError, "whole number"),
])
def test_first_layers_refuses_what_is_not_a_depth(n, error, words):
    params = kvlib.init_params(kvlib.ModelConfig())
    with pytest.raises(error, match=words):
        params.first_layers(n)


# ---------------------------------------------------------------------------------------------
# Greedy speculative decoding with each drafter: exactly the target's greedy tokens
# ---------------------------------------------------------------------------------------------

@st.composite
def targets_and_drafters(draw):
    """A random target (any architecture without a window, float64) and one of the new
    drafters: prompt lookup with random n-gram lengths, or the target's own first layers."""
    config = draw(configs(window=False)).replace(vocab_size=draw(st.integers(2, 8)))
    target = kvlib.init_params(config, seed=draw(st.integers(0, 10_000)))
    if draw(st.booleans()):
        max_ngram = draw(st.integers(1, 4))
        return target, sp.PromptLookupDrafter(max_ngram, draw(st.integers(1, max_ngram)))
    return target, target.first_layers(draw(st.integers(1, config.n_layers)))


@given(targets_and_drafters(), st.data())
@settings(max_examples=100, deadline=None)
def test_each_drafter_gives_the_targets_greedy_tokens(case, data):
    target, draft = case
    # a small vocabulary, so that n-grams recur and prompt lookup proposes often
    prompt = token_lists(data.draw, target.config, max_size=12)
    n = data.draw(st.integers(1, min(24, target.config.context_length - len(prompt) + 1)))
    k = data.draw(st.integers(1, 8))
    decoder = sp.SpeculativeDecoder(target, draft, prompt, k)
    assert decoder.generate(n) == kvlib.generate(target, prompt, n)
    for step in decoder.steps:
        assert len(step.proposals) <= k and step.kept[-1] == step.next_token
    assert decoder.stats().new_tokens == n
    if isinstance(draft, kvlib.Params):
        tokens = decoder.generated
        agreements = sp.greedy_agreements(target, draft, prompt, tokens)
        assert [s.accepted for s in decoder.steps] == sp.replay_greedy(agreements, k)
        if draft.config.n_layers == target.config.n_layers:
            assert agreements.all()
    else:
        assert decoder.draft_cache is None
        assert all(s.draft_lengths == (0, 0, 0) for s in decoder.steps)


@given(targets_and_drafters(), st.data())
@settings(max_examples=40, deadline=None)
def test_speculative_generate_takes_a_drafter_up_to_the_context_length(case, data):
    target, draft = case
    prompt = token_lists(data.draw, target.config, max_size=8)
    n = target.config.context_length - len(prompt) + 1       # every position the target has
    assert sp.speculative_generate(target, draft, prompt, n, k=data.draw(st.integers(1, 8))) \
        == kvlib.generate(target, prompt, n)


def test_prompt_lookup_guesses_a_song_sung_again():
    """The story model sings a song again word for word: the lookup of ": tra" finds the
    song where it was made up and proposes its next sounds, all kept."""
    from kvlib.stories import generate_stories

    target = kvlib.stories.load_model("stories", "float64")
    tokenizer = _story_tokenizer()
    story = generate_stories(1, 7)[0]
    cut = story.index("Hannah sang: tra") + len("Hannah sang: tra")
    prompt = tokenizer.encode(story[:cut])
    expected = kvlib.generate(target, prompt, 6)
    assert tokenizer.tokens(expected) == ["lee", "zap", "loo", "dong", "zip", "."]
    decoder = sp.SpeculativeDecoder(target, sp.PromptLookupDrafter(), prompt, 4)
    assert decoder.generate(6) == expected
    first = decoder.steps[0]
    assert first.proposals == tuple(expected[:4]) and first.accepted == 4 and first.bonus
    assert len(decoder.steps) == 2          # 5 tokens in the first pass, 1 in the second


def _story_tokenizer():
    from kvlib.stories import StoryTokenizer

    return StoryTokenizer()


def test_both_drafters_on_the_trained_story_model():
    from kvlib.stories import generate_stories

    target = kvlib.stories.load_model("stories", "float64")
    tokenizer = _story_tokenizer()
    rng = np.random.default_rng(23)
    accepted = {"lookup": 0, "first layers": 0}
    for index, story in enumerate(generate_stories(8, 7)):
        words = story.split(" ")
        prompt = tokenizer.encode(" ".join(words[:int(rng.integers(12, 30))]))
        expected = kvlib.generate(target, prompt, 40)
        k = int(rng.integers(1, 9))
        for name, draft in (("lookup", sp.PromptLookupDrafter()),
                            ("first layers", target.first_layers(1 + index % 3))):
            decoder = sp.SpeculativeDecoder(target, draft, prompt, k)
            assert decoder.generate(40) == expected, (name, index, k)
            accepted[name] += decoder.stats().accepted
    # the stories repeat their names and songs: prompt lookup guesses right often
    assert accepted["lookup"] > 10 and accepted["first layers"] > 10, accepted


def test_both_drafters_on_smollm2():
    params = kvlib.load_smollm2()
    tokenizer = kvlib.smollm2_tokenizer()
    prompt = tokenizer.apply_chat_template([{
        "role": "user", "content": "Repeat exactly: the cache keeps the keys and values of "
                                   "every earlier token."}])
    expected = kvlib.generate(params, prompt, 12)
    lookup = sp.SpeculativeDecoder(params, sp.PromptLookupDrafter(), prompt, 5)
    assert lookup.generate(12) == expected
    assert lookup.stats().rounds < 12                      # the repeat is guessed
    early = sp.SpeculativeDecoder(params, params.first_layers(28), prompt, 3)
    assert early.generate(12) == expected
    # the draft's cache is the target's first 28 layers (up to float32 rounding: the two
    # models computed the rows in chunks of other sizes)
    held = len(early.draft_cache)
    for layer in (0, 27):
        np.testing.assert_allclose(early.draft_cache.keys(layer),
                                   early.target_cache.keys(layer)[:held], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Sampling with certain guesses: still exactly the target's distribution
# ---------------------------------------------------------------------------------------------

def test_a_verdict_without_draft_probabilities_is_one_with_one_hot_ones():
    rng = np.random.default_rng(4)
    for _ in range(50):
        V, k = int(rng.integers(2, 6)), int(rng.integers(1, 5))
        rows = rng.normal(size=(k + 1, V)) * 2
        proposals = tuple(int(t) for t in rng.integers(0, V, k))
        one_hot = np.array([sp.certain(t, V) for t in proposals])
        seed = int(rng.integers(0, 1000))
        a = sp.SamplingAcceptance(1.0, seed=seed).verdict(proposals, None, rows)
        b = sp.SamplingAcceptance(1.0, seed=seed).verdict(proposals, one_hot, rows)
        assert a == b


def distribution_of(params, temperature):
    def distribution(sequence):
        row = kvlib.forward(params, list(sequence), last_only=True)[-1]
        return kvlib.next_token_probabilities(row, temperature)
    return distribution


@given(st.integers(0, 500), st.lists(st.integers(0, 2), min_size=1, max_size=3),
       st.sampled_from([0.7, 1.0, 2.0]))
@settings(max_examples=40, deadline=None)
def test_a_round_of_certain_guesses_is_distributed_as_the_target(seed, guesses, temperature):
    """Whatever fixed guesses a lookup makes, one sampled round followed by the target
    gives the target's distribution (exact enumeration over a vocabulary of 3)."""
    target = kvlib.init_params(kvlib.ModelConfig(vocab_size=3, d_model=4, n_heads=2,
                                                 n_layers=2, d_ff=8), seed=seed)
    prefix, k = (0,), len(guesses)
    p_of = distribution_of(target, temperature)

    def guessed(sequence):              # the drafter is certain of guess i after i kept
        return sp.certain(guesses[len(sequence) - len(prefix)], 3)

    outcomes = sp.outcome_probabilities(p_of, guessed, prefix, k)
    assert abs(sum(outcomes.values()) - 1) < TOLERANCE
    first = np.zeros(3)
    for tokens, probability in outcomes.items():
        first[tokens[0]] += probability
    np.testing.assert_allclose(first, p_of(prefix), rtol=0, atol=TOLERANCE)
    # the chance of keeping all k guesses is the target's own chance of writing them
    all_kept = sum(p for tokens, p in outcomes.items() if tokens[:k] == tuple(guesses))
    expected = np.prod([p_of(prefix + tuple(guesses[:i]))[guesses[i]] for i in range(k)])
    assert abs(all_kept - expected) < TOLERANCE


def test_sampled_prompt_lookup_runs_seeded():
    target = kvlib.init_params(kvlib.ModelConfig(), seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def run():
        decoder = sp.SpeculativeDecoder(target, sp.PromptLookupDrafter(), prompt, 3,
                                        sp.SamplingAcceptance(1.0, seed=11))
        return decoder.generate(15), decoder.stats()

    (tokens, stats), (again, _) = run(), run()
    assert tokens == again and len(tokens) == 15 and stats.proposed > 0


# ---------------------------------------------------------------------------------------------
# Bad drafters and bad input, refused in words; a failing round changes nothing
# ---------------------------------------------------------------------------------------------

TOY = kvlib.init_params(kvlib.ModelConfig(), seed=1)
PROMPT = [3, 1, 4, 1, 5]


class Proposing(sp.Drafter):
    """A drafter that returns whatever it is told to."""

    def __init__(self, proposal):
        self.proposal = proposal

    def propose(self, sequence, k, choose):
        return self.proposal


@pytest.mark.parametrize("proposal, error, words", [
    ((1, 2), ValueError, "must return a Proposal"),
    (sp.Proposal((1, 2, 3, 4), None), ValueError, "at most 2 token ids below 12"),
    (sp.Proposal((1, 12), None), ValueError, "at most 2 token ids below 12"),
    (sp.Proposal((1, -1), None), ValueError, "at most 2 token ids below 12"),
    (sp.Proposal((1.0,), None), ValueError, "at most 2 token ids below 12"),
    (sp.Proposal((1, 2), np.ones((2, 5)) / 5), ValueError, r"\(proposals, 12\) or None"),
])
def test_a_drafters_bad_proposal_is_refused_and_changes_nothing(proposal, error, words):
    decoder = sp.SpeculativeDecoder(TOY, Proposing(sp.Proposal((), None)), PROMPT, 2)
    decoder.step()
    before = list(decoder.sequence), len(decoder.target_cache)
    decoder.drafter.proposal = proposal
    with pytest.raises(error, match=words):
        decoder.step()
    assert (decoder.sequence, len(decoder.target_cache)) == before
    assert len(decoder.steps) == 1


def test_the_base_drafter_and_bad_drafts_are_refused_in_words():
    with pytest.raises(NotImplementedError, match="must define propose"):
        sp.SpeculativeDecoder(TOY, sp.Drafter(), PROMPT).step()
    with pytest.raises(TypeError, match="must be kvlib Params .a draft model. or a Drafter"):
        sp.SpeculativeDecoder(TOY, "prompt lookup", PROMPT)
    with pytest.raises(TypeError, match="must be kvlib Params"):
        sp.SpeculativeDecoder("target", sp.PromptLookupDrafter(), PROMPT)
    with pytest.raises(ValueError, match="draft_cache goes with a draft model"):
        sp.SpeculativeDecoder(TOY, sp.PromptLookupDrafter(), PROMPT,
                              draft_cache=kvlib.KVCache(TOY.config))
    with pytest.raises(ValueError, match="sliding window"):
        sp.SpeculativeDecoder(TOY.with_config(window=4), sp.PromptLookupDrafter(), PROMPT)
    with pytest.raises(TypeError, match="needs kvlib Params"):
        sp.ModelDrafter("draft")
    with pytest.raises(ValueError, match="different vocabularies"):
        sp.SpeculativeDecoder(TOY, sp.ModelDrafter(
            kvlib.init_params(kvlib.ModelConfig(vocab_size=13))), PROMPT)
    decoder = sp.SpeculativeDecoder(TOY, sp.PromptLookupDrafter(), PROMPT)
    with pytest.raises(TypeError, match="prompt lookup drafter has no cache"):
        decoder.draft_cache = kvlib.KVCache(TOY.config)


def test_drafters_describe_themselves():
    lookup = sp.SpeculativeDecoder(TOY, sp.PromptLookupDrafter(2), PROMPT, 3)
    lookup.generate(4)
    assert repr(lookup).endswith("target cache 8, prompt lookup)")
    assert repr(sp.PromptLookupDrafter(2)) == "PromptLookupDrafter(max_ngram=2, min_ngram=1)"
    drafter = sp.ModelDrafter(TOY.first_layers(1))
    assert repr(drafter) == "ModelDrafter(1 layers; cache of 0 positions)"
    early = sp.SpeculativeDecoder(TOY, drafter, PROMPT, 3)
    assert early.drafter is drafter and early.draft_cache is drafter.cache
    early.generate(4)
    assert "draft cache" in repr(early) and drafter.cached == len(drafter.cache) > 0


def test_a_failing_round_puts_the_model_drafters_cache_back():
    class Failing(sp.GreedyAcceptance):
        def verdict(self, *args):
            raise KeyboardInterrupt

    decoder = sp.SpeculativeDecoder(TOY, TOY.first_layers(1), PROMPT, 3)
    decoder.generate(5)
    lengths = len(decoder.target_cache), len(decoder.draft_cache)
    sequence = list(decoder.sequence)
    decoder.acceptance = Failing()
    with pytest.raises(KeyboardInterrupt):
        decoder.step()
    assert (len(decoder.target_cache), len(decoder.draft_cache)) == lengths
    assert decoder.sequence == sequence
    decoder.acceptance = sp.GreedyAcceptance()
    decoder.generate(6)
    assert decoder.generated == kvlib.generate(TOY, PROMPT, 11)
