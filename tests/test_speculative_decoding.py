"""Notebook 23 (speculative decoding): kvlib.serving.speculative proven on random models of
every architecture it takes (greedy output equal to the target's own greedy decoding, caches
equal to fresh prefills after every truncation, the exact distribution of a sampled round
equal to the target's, a seeded empirical check), on the trained story models, its refusals,
the widget driven headless, and the exercise checkers with tables of wrong and valid answers
(what every checker does with odd input is tested once for all lessons, in test_checkers.py)."""

import itertools

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import (
    assert_correct,
    assert_not_yet,
    case_id,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import run_notebook
from strategies import configs
from widget_checks import no_new_figures, text_of

import kvlib
from kvlib.exercises import speculative_decoding as ex23
from kvlib.serving import BlockAllocator, PagedKVCache
from kvlib.serving import speculative as sp
from kvlib.widgets import speculative_decoding as w23

TOLERANCE = 1e-10


# ---------------------------------------------------------------------------------------------
# Random pairs of a target and a draft with one vocabulary
# ---------------------------------------------------------------------------------------------

@st.composite
def pairs(draw, vocab_size=None, max_vocab=30):
    """(target, draft): random models of any architecture but a window, the same vocabulary.
    The draft is another random model, a perturbed copy of the target (it agrees sometimes)
    or the target itself (it always agrees), so that every path of a round is taken."""
    target_config = draw(configs(window=False))
    vocab = vocab_size or draw(st.integers(2, max_vocab))
    target_config = target_config.replace(vocab_size=vocab)
    target = kvlib.init_params(target_config, seed=draw(st.integers(0, 10_000)))
    kind = draw(st.sampled_from(["other", "perturbed", "perturbed", "itself"]))
    if kind == "itself":
        return target, target
    if kind == "perturbed":
        return target, ex23.perturbed(target, draw(st.sampled_from([0.1, 0.3, 1.0])),
                                      draw(st.integers(0, 1000)))
    draft_config = draw(configs(window=False)).replace(vocab_size=vocab)
    return target, kvlib.init_params(draft_config, seed=draw(st.integers(0, 10_000)))


def prompts(config, max_size=8):
    return st.lists(st.integers(0, config.vocab_size - 1), min_size=1, max_size=max_size)


def assert_cache_holds(params, cache, ids):
    """The cache holds exactly what a fresh prefill of ids would (truncate forgot all else)."""
    assert len(cache) == len(ids)
    if not ids:
        return
    _, fresh = kvlib.prefill(params, ids)
    for layer in range(params.config.n_layers):
        np.testing.assert_allclose(cache.keys(layer), fresh.keys(layer), rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(cache.values(layer), fresh.values(layer), rtol=0,
                                   atol=TOLERANCE)
    assert cache.nbytes == kvlib.config_cache_bytes(params.config, len(ids))


# ---------------------------------------------------------------------------------------------
# Greedy: exactly the target's tokens, caches exact after every truncation
# ---------------------------------------------------------------------------------------------

@given(pairs(), st.data())
@settings(max_examples=80, deadline=None)
def test_greedy_speculative_decoding_gives_the_targets_greedy_tokens(pair, data):
    target, draft = pair
    prompt = data.draw(prompts(target.config))
    k = data.draw(st.integers(1, 6))
    decoder = sp.SpeculativeDecoder(target, draft, prompt, k)
    for _ in range(data.draw(st.integers(1, 8))):
        if len(decoder.sequence) > target.config.context_length:
            break
        step = decoder.step()
        sequence = decoder.sequence
        assert step.kept == tuple(sequence[step.start:])
        assert 1 <= len(step.kept) <= k + 1 and step.judged <= len(step.proposals) <= k
        # the target holds all but the last token; the draft what it fed and the sequence
        # kept (one less after a bonus: its last proposal was never fed to it)
        assert_cache_holds(target, decoder.target_cache, sequence[:-1])
        if step.proposals:
            assert len(decoder.draft_cache) == min(step.start + len(step.proposals) - 1,
                                                   len(sequence) - 1)
        else:
            assert len(decoder.draft_cache) == step.draft_lengths[0]
        assert_cache_holds(draft, decoder.draft_cache, sequence[:len(decoder.draft_cache)])
        assert step.target_lengths == (step.start - 1 if decoder.steps[0] is not step else 0,
                                       step.start + len(step.proposals), len(sequence) - 1)
    generated = decoder.generated
    assert generated == kvlib.generate(target, prompt, len(generated))


@given(pairs(), st.data())
@settings(max_examples=60, deadline=None)
def test_speculative_generate_equals_generate_up_to_the_context_length(pair, data):
    target, draft = pair
    prompt = data.draw(prompts(target.config))
    room = min(target.config.context_length, draft.config.context_length) - len(prompt) + 1
    n = data.draw(st.integers(1, min(room, 30)))
    k = data.draw(st.integers(1, 8))
    assert sp.speculative_generate(target, draft, prompt, n, k=k) == \
        kvlib.generate(target, prompt, n)


@given(pairs(), st.data())
@settings(max_examples=40, deadline=None)
def test_the_decoder_runs_on_paged_caches_and_gives_every_block_back(pair, data):
    target, draft = pair
    if target.config.latent_dim is not None or draft.config.latent_dim is not None:
        return       # kvlib's paged cache holds K and V
    prompt = data.draw(prompts(target.config))
    n = data.draw(st.integers(1, 12))
    pools = [BlockAllocator(p.config, n_blocks=40, block_size=data.draw(st.integers(1, 4)))
             for p in (target, draft)]
    decoder = sp.SpeculativeDecoder(target, draft, prompt, data.draw(st.integers(1, 5)),
                                    target_cache=PagedKVCache(pools[0]),
                                    draft_cache=PagedKVCache(pools[1]))
    assert decoder.generate(n) == kvlib.generate(target, prompt, n)
    for pool, cache in zip(pools, (decoder.target_cache, decoder.draft_cache)):
        pool.check_invariants()
        assert pool.n_used == len(cache.block_table) == -(-len(cache) // pool.block_size)
        cache.free()
        pool.check_invariants()
        assert pool.n_used == 0


@given(pairs(), st.data())
@settings(max_examples=60, deadline=None)
def test_replaying_the_agreements_predicts_every_round(pair, data):
    target, draft = pair
    prompt = data.draw(prompts(target.config))
    n = data.draw(st.integers(1, min(20, target.config.context_length - len(prompt) + 1,
                                     draft.config.context_length - len(prompt) + 1)))
    k = data.draw(st.integers(1, 6))
    tokens = kvlib.generate(target, prompt, n)
    agreements = sp.greedy_agreements(target, draft, prompt, tokens)
    decoder = sp.SpeculativeDecoder(target, draft, prompt, k)
    decoder.generate(n)
    assert [s.accepted for s in decoder.steps] == sp.replay_greedy(agreements, k)
    stats = decoder.stats()
    assert stats.new_tokens == n and stats.target_passes == len(decoder.steps)
    if draft is target:
        assert agreements.all()


def test_greedy_on_the_trained_story_models():
    target = kvlib.stories.load_model("stories", "float64")
    draft = kvlib.stories.load_model("stories-draft", "float64")
    tokenizer = _story_tokenizer()
    rng = np.random.default_rng(21)
    for index, story in enumerate(_held_out_stories(12)):
        words = story.split(" ")
        prompt = tokenizer.encode(" ".join(words[:int(rng.integers(3, 12))]))
        n = 40
        expected = kvlib.generate(target, prompt, n)
        k = 1 + index % 6
        decoder = sp.SpeculativeDecoder(target, draft, prompt, k)
        assert decoder.generate(n) == expected
        assert [s.accepted for s in decoder.steps] == \
            sp.replay_greedy(sp.greedy_agreements(target, draft, prompt, expected), k)


def _story_tokenizer():
    from kvlib.stories import StoryTokenizer

    return StoryTokenizer()


def _held_out_stories(n):
    from kvlib.stories import generate_stories

    return generate_stories(n, 7)


# ---------------------------------------------------------------------------------------------
# Sampling: the output is distributed as the target's, exactly
# ---------------------------------------------------------------------------------------------

def distribution_of(params, temperature, top_k=None):
    """sequence -> the model's sampling distribution of the next token, (V,)."""
    def distribution(sequence):
        row = kvlib.forward(params, list(sequence), last_only=True)[-1]
        return kvlib.next_token_probabilities(row, temperature, top_k)
    return distribution


def target_sequences(target_distribution, prefix, length):
    """{continuation of `length` tokens: its probability under the target alone}."""
    vocab = len(target_distribution(prefix))
    result = {}
    for tokens in itertools.product(range(vocab), repeat=length):
        probability = 1.0
        for i in range(length):
            probability *= target_distribution(prefix + tokens[:i])[tokens[i]]
        result[tokens] = probability
    return result


def completed_by_the_target(outcomes, target_distribution, prefix, length):
    """One round's outcomes, each continued by the target alone to `length` tokens."""
    result = {}

    def extend(tokens, probability):
        if len(tokens) == length:
            result[tokens] = result.get(tokens, 0.0) + probability
            return
        p = target_distribution(prefix + tokens)
        for token, p_token in enumerate(p):
            extend(tokens + (token,), probability * p_token)

    for tokens, probability in outcomes.items():
        extend(tokens, probability)
    return result


@st.composite
def tiny_pairs(draw):
    target, draft = draw(pairs(vocab_size=draw(st.integers(2, 4))))
    temperature = draw(st.sampled_from([0.5, 1.0, 2.0]))
    top_k = draw(st.sampled_from([None, None, 1, 2]))
    prefix = tuple(draw(prompts(target.config, max_size=4)))
    return target, draft, temperature, top_k, prefix


@given(tiny_pairs(), st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_one_sampled_round_is_distributed_exactly_as_the_target(case, k):
    target, draft, temperature, top_k, prefix = case
    p_of, q_of = distribution_of(target, temperature, top_k), \
        distribution_of(draft, temperature, top_k)
    outcomes = sp.outcome_probabilities(p_of, q_of, prefix, k)
    assert abs(sum(outcomes.values()) - 1) < TOLERANCE
    assert all(1 <= len(tokens) <= k + 1 for tokens in outcomes)
    first = np.zeros(target.config.vocab_size)
    for tokens, probability in outcomes.items():
        first[tokens[0]] += probability
    np.testing.assert_allclose(first, p_of(prefix), rtol=0, atol=TOLERANCE)
    completed = completed_by_the_target(outcomes, p_of, prefix, k + 1)
    expected = target_sequences(p_of, prefix, k + 1)
    for tokens, probability in expected.items():
        assert abs(completed.get(tokens, 0.0) - probability) < TOLERANCE


def test_the_exact_check_catches_a_wrong_residual(monkeypatch):
    """Drawing the replacement from p instead of max(0, p - q) breaks the distribution, and
    the enumeration says so: the check can fail."""
    target, draft = tiny_fixed_pair()
    p_of, q_of = distribution_of(target, TINY_T), distribution_of(draft, TINY_T)
    right = completed_by_the_target(sp.outcome_probabilities(p_of, q_of, (0,), 2), p_of, (0,), 3)
    monkeypatch.setattr(sp.expectations, "residual_distribution",
                        lambda p, q: np.asarray(p, float))
    wrong = completed_by_the_target(sp.outcome_probabilities(p_of, q_of, (0,), 2), p_of, (0,), 3)
    expected = target_sequences(p_of, (0,), 3)
    assert max(abs(right[t] - expected[t]) for t in expected) < TOLERANCE
    assert max(abs(wrong.get(t, 0) - expected[t]) for t in expected) > 0.01


TINY_T = 2.0
"""Temperature of the fixed tiny pair: its target's 27 three-token continuations then have
probabilities from 0.012 to 0.11, and the draft's differ by a total variation of 0.34."""


def tiny_fixed_pair():
    target = kvlib.init_params(kvlib.ModelConfig(vocab_size=3, d_model=4, n_heads=2,
                                                 n_layers=2, d_ff=8), seed=6)
    draft = kvlib.init_params(kvlib.ModelConfig(vocab_size=3, d_model=2, n_heads=1,
                                                n_layers=1, d_ff=4), seed=3)
    return target, draft


def chi_square(counts: dict, probabilities: dict) -> float:
    total = sum(counts.values())
    return sum((counts.get(t, 0) - total * p) ** 2 / (total * p)
               for t, p in probabilities.items())


CHI_SQUARE_26_DOF_AT_0_001 = 54.05
"""Pearson's statistic over 27 outcomes exceeds this with probability 0.001 when the counts
do follow the probabilities."""


def test_seeded_speculative_samples_follow_the_targets_distribution():
    """The sampler itself: 2000 seeded generations of 3 tokens, k = 2, counted over the 27
    possible outcomes, against the exact target distribution (Pearson's chi-square below its
    0.1 % point); the draft's own distribution is rejected by far."""
    target, draft = tiny_fixed_pair()
    acceptance = sp.SamplingAcceptance(TINY_T, seed=2023)
    counts = {}
    for _ in range(2000):
        decoder = sp.SpeculativeDecoder(target, draft, [0], 2, acceptance)
        tokens = tuple(decoder.generate(3))
        counts[tokens] = counts.get(tokens, 0) + 1
    exact = target_sequences(distribution_of(target, TINY_T), (0,), 3)
    drafts = target_sequences(distribution_of(draft, TINY_T), (0,), 3)
    assert chi_square(counts, exact) < CHI_SQUARE_26_DOF_AT_0_001
    assert chi_square(counts, drafts) > 10 * CHI_SQUARE_26_DOF_AT_0_001


def test_the_sampling_rule_on_fixed_rows():
    p, q = np.array([0.5, 0.2, 0.2, 0.1]), np.array([0.3, 0.5, 0.1, 0.1])
    assert [sp.acceptance_probability(p, q, x) for x in range(4)] == [1.0, 0.4, 1.0, 1.0]
    np.testing.assert_allclose(sp.residual_distribution(p, q), [2 / 3, 0, 1 / 3, 0])
    np.testing.assert_allclose(sp.residual_distribution(p, p), p)
    # min(p, q) from accepted proposals plus the residual after a rejection gives p
    rejected = 1 - np.minimum(p, q).sum()
    np.testing.assert_allclose(np.minimum(p, q) + rejected * sp.residual_distribution(p, q), p)
    with pytest.raises(ValueError, match="cannot have proposed"):
        sp.acceptance_probability(p, np.array([0.5, 0.5, 0, 0]), 2)
    with pytest.raises(ValueError, match="sum to 1"):
        sp.acceptance_probability([0.5, 0.6], [0.5, 0.5], 0)
    with pytest.raises(ValueError, match="same vocabulary"):
        sp.residual_distribution([0.5, 0.5], [1, 0, 0])
    with pytest.raises(ValueError, match="token must be at most 3"):
        sp.acceptance_probability(p, q, 4)
    with pytest.raises(ValueError, match="non-negative"):
        sp.residual_distribution([1.5, -0.5], [0.5, 0.5])


def test_greedy_is_the_sampling_rule_with_one_hot_distributions():
    rng = np.random.default_rng(0)
    for _ in range(50):
        target_row, draft_row = rng.standard_normal(6), rng.standard_normal(6)
        p = kvlib.next_token_probabilities(target_row, 0)
        token, q = sp.GreedyAcceptance().choose(draft_row)
        chance = sp.acceptance_probability(p, q, token)
        assert chance == (1.0 if token == np.argmax(target_row) else 0.0)
        verdict = sp.GreedyAcceptance().verdict((token,), q[None], np.vstack([target_row,
                                                                             draft_row]))
        assert verdict.accepted == int(chance)
        if not chance:
            assert np.argmax(sp.residual_distribution(p, q)) == verdict.next_token


def test_sampling_is_seeded():
    target, draft = tiny_fixed_pair()
    runs = [sp.speculative_generate(target, draft, [0, 1], 12, k=3, temperature=1.0, seed=5)
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert sp.speculative_generate(target, draft, [0, 1], 12, k=3, temperature=1.0,
                                   seed=6) != runs[0]


# ---------------------------------------------------------------------------------------------
# What to expect
# ---------------------------------------------------------------------------------------------

@given(st.floats(0, 1), st.integers(1, 12))
def test_expected_tokens_per_pass_is_the_truncated_geometric_mean(alpha, k):
    # a round keeps j proposals with probability alpha^j (1 - alpha), all k with alpha^k
    mean = sum((j + 1) * alpha**j * (1 - alpha) for j in range(k)) + (k + 1) * alpha**k
    assert abs(sp.expected_tokens_per_pass(alpha, k) - mean) < 1e-9
    assert abs(sp.expected_tokens_per_pass(alpha, k) - sum(alpha**j for j in range(k + 1))) \
        < 1e-9
    assert sp.predicted_speedup(alpha, k, 0) == sp.expected_tokens_per_pass(alpha, k)


def test_predictions_at_known_points():
    assert sp.expected_tokens_per_pass(0, 4) == 1
    assert sp.expected_tokens_per_pass(1, 4) == 5
    assert abs(sp.expected_tokens_per_pass(0.6, 3) - 2.176) < 1e-12
    assert abs(sp.predicted_speedup(0.8, 4, 0.25) - 3.3616 / 2) < 1e-12
    with pytest.raises(ValueError, match="between 0 and 1"):
        sp.expected_tokens_per_pass(1.5, 4)
    with pytest.raises(ValueError, match="at least 1"):
        sp.expected_tokens_per_pass(0.5, 0)
    with pytest.raises(ValueError, match="draft_cost"):
        sp.predicted_speedup(0.5, 2, -1)


def test_replay_greedy_by_hand():
    agreements = [True, True, False, True, True, True, True, False, True]
    assert sp.replay_greedy(agreements, 2) == [2, 2, 1, 0]     # bonus, bonus, correction
    assert sp.replay_greedy(agreements, 8) == [2, 4, 0]   # the last round proposes 0
    assert sum(a + 1 for a in sp.replay_greedy(agreements, 3)) == len(agreements)


# ---------------------------------------------------------------------------------------------
# Refusals, and a failing round changes nothing
# ---------------------------------------------------------------------------------------------

TOY = kvlib.init_params()
TOY_DRAFT = kvlib.init_params(kvlib.ModelConfig(n_layers=1), seed=0)
PROMPT = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)


def test_a_draft_with_another_vocabulary_is_refused():
    other = kvlib.init_params(kvlib.ModelConfig(vocab_size=13))
    with pytest.raises(ValueError, match="different vocabularies .13 and 12 tokens"):
        sp.SpeculativeDecoder(TOY, other, PROMPT)
    with pytest.raises(ValueError, match="different vocabularies"):
        sp.speculative_generate(TOY, other, PROMPT, 4)
    with pytest.raises(ValueError, match="different vocabularies"):
        sp.greedy_agreements(TOY, other, PROMPT, [5])


@pytest.mark.parametrize("k, error, words", [
    (0, ValueError, "at least 1"), (-2, ValueError, "at least 1"),
    (1.5, TypeError, "whole number"), (True, TypeError, "whole number"),
    ("4", TypeError, "whole number"), (None, TypeError, "whole number"),
])
def test_k_below_one_is_refused(k, error, words):
    with pytest.raises(error, match=words):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, k)
    decoder = sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, 2)
    if k is not None:
        with pytest.raises(error, match=words):
            decoder.step(k)
    assert decoder.steps == [] and len(decoder.target_cache) == 0


def test_other_bad_input_is_refused_in_words():
    window = TOY.with_config(window=4)
    with pytest.raises(ValueError, match="sliding window"):
        sp.SpeculativeDecoder(window, TOY, PROMPT)
    with pytest.raises(TypeError, match="must be kvlib Params"):
        sp.SpeculativeDecoder(TOY, "draft", PROMPT)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, [0, 12])
    with pytest.raises(TypeError, match="encode it"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, "How are you?")
    with pytest.raises(TypeError, match="acceptance must be"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, acceptance="greedy")
    with pytest.raises(ValueError, match="for temperature 0 use GreedyAcceptance"):
        sp.SamplingAcceptance(0)
    with pytest.raises(ValueError, match="positive number"):
        sp.speculative_generate(TOY, TOY_DRAFT, PROMPT, 4, temperature=-1)
    _, full = kvlib.prefill(TOY, PROMPT)
    with pytest.raises(ValueError, match="must be an empty kvlib cache"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, target_cache=full)
    with pytest.raises(ValueError, match="another model"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, draft_cache=kvlib.KVCache(TOY.config))
    with pytest.raises(ValueError, match="context length is 32"):
        sp.speculative_generate(TOY, TOY_DRAFT, PROMPT, 29)
    with pytest.raises(ValueError, match="greedy continuation"):
        sp.greedy_agreements(TOY, TOY_DRAFT, PROMPT, [1, 2, 3])
    with pytest.raises(ValueError, match="at least 1"):
        sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT).generate(0)


def test_the_decoder_stops_at_the_context_length():
    decoder = sp.SpeculativeDecoder(TOY, TOY_DRAFT, PROMPT, 8)
    decoder.generate(28)                                    # 5 + 28 - 1 = 32 positions
    assert decoder.generated == kvlib.generate(TOY, PROMPT, 28)
    assert len(decoder.sequence) == 33 and len(decoder.target_cache) == 32
    with pytest.raises(ValueError, match="context is full"):
        decoder.step()


class FailingVerdict(sp.GreedyAcceptance):
    def verdict(self, proposals, draft_probabilities, target_logits):
        raise KeyboardInterrupt      # a student stops the kernel after both passes


def test_a_round_that_fails_half_way_changes_nothing():
    decoder = sp.SpeculativeDecoder(TOY, ex23.perturbed(TOY, 0.5, 21), PROMPT, 3)
    decoder.generate(6)
    sequence, steps = list(decoder.sequence), list(decoder.steps)
    lengths = len(decoder.target_cache), len(decoder.draft_cache)
    decoder.acceptance = FailingVerdict()
    with pytest.raises(KeyboardInterrupt):
        decoder.step()
    assert decoder.sequence == sequence and decoder.steps == steps
    assert (len(decoder.target_cache), len(decoder.draft_cache)) == lengths
    assert_cache_holds(TOY, decoder.target_cache, sequence[:-1])
    decoder.acceptance = sp.GreedyAcceptance()
    decoder.generate(10)
    assert decoder.generated == kvlib.generate(TOY, PROMPT, len(decoder.generated))


def test_a_failing_sampled_round_restores_the_random_numbers():
    target, draft = tiny_fixed_pair()
    reference = sp.SpeculativeDecoder(target, draft, [0], 2, sp.SamplingAcceptance(seed=1))
    reference.generate(4)
    decoder = sp.SpeculativeDecoder(target, draft, [0], 2, sp.SamplingAcceptance(seed=1))
    original = sp.SamplingAcceptance.verdict

    def interrupted(self, *args):
        original(self, *args)            # draws random numbers, then fails
        raise KeyboardInterrupt

    sp.SamplingAcceptance.verdict = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            decoder.step()
    finally:
        sp.SamplingAcceptance.verdict = original
    decoder.generate(4)
    assert decoder.sequence == reference.sequence


def test_decoder_repr_and_stats():
    decoder = sp.SpeculativeDecoder(TOY, TOY, PROMPT, 3)
    decoder.generate(8)
    assert repr(decoder) == ("SpeculativeDecoder(k=3, greedy, 13 tokens, 2 rounds; target "
                             "cache 12, draft cache 11 positions)")
    stats = decoder.stats()
    assert (stats.rounds, stats.judged, stats.accepted, stats.new_tokens) == (2, 6, 6, 8)
    assert stats.acceptance_rate == 1 and stats.tokens_per_pass == 4
    assert np.isnan(sp.summarize([]).acceptance_rate)


# ---------------------------------------------------------------------------------------------
# The widget, headless
# ---------------------------------------------------------------------------------------------

def toy_explorer(**options):
    return w23.speculative_explorer(TOY, ex23.perturbed(TOY, 0.5, 21), kvlib.ToyTokenizer(),
                                    kvlib.ARTICLE_PROMPT, **options)


def test_the_explorer_shows_a_round_and_its_verdicts():
    box = toy_explorer(k=4)
    decoder = box.state["decoder"]
    assert len(decoder.steps) == 1 and box.message.value == ""
    for _ in range(3):
        box.controls["round"].click()
    step = decoder.steps[-1]
    assert len(decoder.steps) == 4
    assert f"Round 4: the draft proposed {len(step.proposals)} tokens" in box.status.value
    assert f"{step.target_lengths[0]} -> {step.target_lengths[1]} -> {step.target_lengths[2]}" \
        in box.status.value
    stats = decoder.stats()
    assert f"{stats.rounds} target passes, for {stats.new_tokens} tokens" in box.stats.value
    assert f"accepted {stats.accepted} of the {stats.judged} proposals" in box.stats.value
    assert "target's own greedy tokens" in box.check.value
    token_ax, cache_ax = box.figure.axes[:2]
    texts = [t.get_text() for t in token_ax.texts]
    assert texts.count("kept") == step.accepted
    assert texts.count("rejected") == (0 if step.bonus else 1)
    assert texts.count("not judged") == len(step.proposals) - step.judged
    assert ("bonus" in texts) == step.bonus and (("target's token" in texts) != step.bonus)
    assert len(cache_ax.patches) == 6          # three segments a cache, two caches


def test_the_explorer_redraws_in_place():
    box = toy_explorer(k=3)
    figures = plt.get_fignums()
    counts = []
    for _ in range(5):
        box.controls["round"].click()
        counts.append(len(box.figure.axes[0].patches))
    assert len(box.figure.axes) == 2 and plt.get_fignums() == figures
    assert max(counts) <= 4 + 3 + 3 + 1        # context, proposals, kept, the target's token


def test_k_and_the_rule_start_again():
    box = toy_explorer(k=2)
    box.controls["round"].click()
    box.controls["k"].value = 5
    decoder = box.state["decoder"]
    assert decoder.k == 5 and len(decoder.steps) == 1
    box.controls["rule"].value = "sampling (T = 1)"
    assert isinstance(box.state["decoder"].acceptance, sp.SamplingAcceptance)
    assert "min(1, p/q)" in " ".join(t.get_text() for t in box.figure.axes[0].texts)
    assert "Sampled" in box.check.value


def test_bad_prompts_land_in_the_message_line_and_change_nothing():
    box = toy_explorer()
    decoder = box.state["decoder"]
    box.controls["prompt"].value = "How are <you>?"
    assert "Cannot show this" in box.message.value and "'&lt;'" in box.message.value
    assert box.state["decoder"] is decoder
    assert "The prompt was refused" in text_of(box.status.value)
    box.controls["rule"].value = "sampling (T = 1)"     # refused again: the prompt is bad
    assert box.state["decoder"] is decoder and "Cannot show this" in box.message.value
    shown = [t.get_text() for t in box.figure.axes[0].texts]
    with no_new_figures():
        for _ in range(3):                              # a round advances nothing, and says why
            box.controls["round"].click()
            assert len(decoder.steps) == 1
            message = text_of(box.message.value)
            assert "a round advances nothing while the prompt is refused" in message
            assert "the figure shows the previous prompt's run" in message
    assert [t.get_text() for t in box.figure.axes[0].texts] == shown
    assert "The prompt was refused" in text_of(box.status.value)
    box.controls["prompt"].value = "I am fine"
    assert box.message.value == "" and box.state["decoder"] is not decoder
    assert isinstance(box.state["decoder"].acceptance, sp.SamplingAcceptance)
    box.controls["round"].click()                       # an accepted prompt runs again
    assert len(box.state["decoder"].steps) == 2 and box.message.value == ""
    assert "Round 2" in box.status.value


def test_a_too_long_prompt_is_refused_and_no_round_runs():
    box = toy_explorer()
    decoder = box.state["decoder"]
    box.controls["prompt"].value = " ".join(["I am fine ."] * 20)
    assert "fit here" in box.message.value
    box.controls["round"].click()
    assert len(decoder.steps) == 1 and "while the prompt is refused" in box.message.value
    box.controls["reset"].click()                        # Reset with the same prompt: refused
    assert box.state["decoder"] is decoder and "fit here" in box.message.value


def test_the_round_button_stops_at_the_context_length():
    box = toy_explorer(k=8)
    for _ in range(40):
        box.controls["round"].click()
    decoder = box.state["decoder"]
    assert len(decoder.sequence) == TOY.config.context_length + 1
    assert box.controls["round"].disabled and "context is full" in box.status.value
    assert decoder.generated == kvlib.generate(TOY, PROMPT, len(decoder.generated))
    box.controls["reset"].click()
    assert not box.controls["round"].disabled and len(box.state["decoder"].steps) == 1


def test_draw_round_refuses_what_is_not_a_step():
    fig, (a, b) = plt.subplots(2)
    with pytest.raises(TypeError, match="SpeculativeStep"):
        w23.draw_round(a, b, "step", [], str)
    with pytest.raises(ValueError, match="rule must be"):
        toy_explorer(rule="beam")


# ---------------------------------------------------------------------------------------------
# Exercise checkers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, words", [
    (1.96, "one term short"), (2.8, "on its own"), (1.8, "forgets the target's own token"),
    (2.5, "endless k"), (4, "the most a round can add"), (1.176, "accepted proposals alone"),
    (0.216, "all 3 proposals are accepted"), (0.1296, "alpha^4"), (2.3056, "k = 4"),
    (1.96 - 0.0001, "one term short"), (2.0, "not 2"), ("2.176", "without quotes"),
    (2.2, "rounded too far to tell: give the number to 2 decimals"),
    (2.19, "close (0.64% above the exact value)"), (2.16, "close"),
    (True, "True (a bool)"), (float("nan"), "finite"), (10**400, "finite"),
    (10**5000, "about 5,001 digits"), ([2.176, 1], "several numbers"),
], ids=case_id)
def test_tokens_per_pass_checker_wrong_answers(answer, words):
    assert_not_yet(ex23.check_tokens_per_pass(answer), words)


@pytest.mark.parametrize("answer", [2.176, 2.1760000001, 2.1756, 2.1764, np.float64(2.176),
                                    np.float32(2.176), np.array(2.176), [2.176],
                                    np.array([2.176]), 272 / 125, 1 + 0.6 + 0.36 + 0.216,
                                    2.18, 2.17, np.float64(2.18)])   # 2 decimals, as printed
def test_tokens_per_pass_checker_valid_forms(answer):
    assert_correct(ex23.check_tokens_per_pass(answer))


P3, Q3 = np.array(ex23.EXERCISE3_P), np.array(ex23.EXERCISE3_Q)


@pytest.mark.parametrize("answer, words", [
    (P3 / Q3, "cannot exceed 1"), (np.minimum(1, Q3 / P3), "upside down: that is min(1, q/p)"),
    (Q3 / P3, "upside down and not capped"), (np.minimum(P3, Q3), "AND it is kept"),
    (P3, "the target's distribution"), (Q3, "the draft's distribution"),
    (np.maximum(P3 - Q3, 0), "residual"), ([2 / 3, 0, 1 / 3, 0], "residual distribution"),
    ([0, 0.6, 0, 0], "chances of rejection"), ([1, 0, 1, 1], "as if greedy"),
    ([1, 0.5, 1, 1], "look at token 1"), (0.7, "4 numbers"), ([1, 0.4, 1], "shape"),
    ([[1, 0.4], [1, 1]], "shape"), (np.full(4, np.nan), "NaN"), ("1, 0.4, 1, 1", "array"),
    ([100, 40, 100, 100], "look like percentages"), ([100, 40, 100, 100], "they are right"),
    (np.array([100.0, 40.0, 100.0, 100.0]), "Divided by 100, they are right"),
    ([30, 50, 10, 10], "percentages"), ([30, 50, 10, 10], "the draft's distribution"),
    ([100, 50, 100, 100], "percentages"),
])
def test_acceptance_checker_wrong_answers(answer, words):
    assert_not_yet(ex23.check_acceptance_probabilities(answer), words)


@pytest.mark.parametrize("answer", [[1, 0.4, 1, 1], (1, 0.4, 1, 1), np.array([1, 0.4, 1, 1]),
                                    [1.0, 2 / 5, 1.0, 1.0], np.minimum(1, P3 / Q3),
                                    [1, 0.4004, 0.9996, 1], np.array([1, 0.4, 1, 1],
                                                                     dtype=np.float32),
                                    np.array([1, 0.4, 1, 1], dtype=object)])
def test_acceptance_checker_valid_forms(answer):
    assert_correct(ex23.check_acceptance_probabilities(answer))


SOLUTION_2 = ex23.SOLUTIONS[2]


def round_variant(old, new):
    assert old in SOLUTION_2
    scope = {"kvlib": kvlib, "np": np}
    exec(SOLUTION_2.replace(old, new), scope)
    return scope["answer"]


MISSING_LINE = "    target_cache.truncate(len(sequence) - 1)             # the missing line\n"


@pytest.mark.parametrize("old, new, words", [
    (MISSING_LINE, "", "K and V of rejected proposals"),
    (MISSING_LINE, "", "differ from the target's own decoding by up to"),
    ("target_cache.truncate(len(sequence) - 1)", "target_cache.truncate(len(sequence))",
     "len(sequence) - 1"),     # a rejected row kept, or a truncation past the cache's end
    ("target_cache.truncate(len(sequence) - 1)", "target_cache.truncate(len(sequence) - 2)",
     "computes again what the cache had"),
    ("    draft_cache.truncate(min(len(draft_cache), len(sequence) - 1))\n", "",
     "the draft's cache holds"),
    ("draft_cache.truncate(min(len(draft_cache), len(sequence) - 1))",
     "draft_cache.truncate(len(sequence) - 2)", "fewer than it can keep"),
    ("kept = proposals[:accepted] + [int(choices[accepted])]", "kept = proposals[:accepted]",
     "did not add any token"),
    ("kept = proposals[:accepted] + [int(choices[accepted])]",
     "kept = proposals[:accepted + 1]", "the target's own greedy decoding gives"),
    ("choices = np.argmax(rows[-(k + 1):], axis=-1)", "choices = np.argmax(rows, axis=-1)",
     "the target's own greedy decoding gives"),
    ("choices = np.argmax(rows[-(k + 1):], axis=-1)", "choices = np.argmax(rows[-k:], axis=-1)",
     ("raised IndexError", "the target's own greedy decoding gives")),
    ("sequence.extend(kept)", "sequence = sequence + kept", "in place"),
    ("sequence.extend(kept)", "sequence.extend(kept + [0] * 9)",
     ("at most k + 1", "cannot truncate")),
])
def test_round_checker_diagnoses_each_slip(old, new, words):
    """words: the diagnosis, or a tuple of the diagnoses one of which must be given (which
    case shows a slip first depends on where the trained models first disagree)."""
    feedback = ex23.check_speculative_round(round_variant(old, new))
    options = words if isinstance(words, tuple) else (words,)
    assert any(option in feedback.message for option in options), feedback.message
    assert_not_yet(feedback, "")


def test_round_checker_other_answers():
    assert_not_yet(ex23.check_speculative_round(lambda *args: 1 / 0), "raised ZeroDivisionError")
    assert_not_yet(ex23.check_speculative_round(lambda *args: None), "did not add any token")
    assert_not_yet(ex23.check_speculative_round("speculative_round_fixed"), "without brackets")
    assert_not_yet(ex23.check_speculative_round(...), "not filled in")

    def floats(target, draft, sequence, target_cache, draft_cache, k):
        sequence.append(1.5)

    assert_not_yet(ex23.check_speculative_round(floats), "whole numbers")


def test_round_checker_accepts_the_solution_and_kvlibs_decoder():
    assert_correct(ex23.check_speculative_round(round_variant("", "")))

    def with_kvlib(target, draft, sequence, target_cache, draft_cache, k):
        decoder = sp.SpeculativeDecoder(target, draft, [0], k)
        decoder.sequence = sequence
        decoder.target_cache, decoder.draft_cache = target_cache, draft_cache
        return decoder.step().kept          # a tuple

    assert_correct(ex23.check_speculative_round(with_kvlib))
    assert_correct(ex23.check_speculative_round(round_variant(
        "    return kept\n", "    return np.array(kept)\n")))


@pytest.mark.parametrize("new, words", [
    ("    return None\n", "returned None"),
    ("", "returned None"),                                           # no return at all
    ("    return 'junk'\n", "returned text, 'junk'"),
    ("    return [t + 1e-3 for t in kept]\n", "token ids are whole numbers"),
    ("    return [float('nan')] * len(kept)\n", "token ids are whole numbers"),
    ("    return sequence\n", "It should return the tokens it kept"),
    ("    return proposals\n", "It should return the tokens it kept"),
    ("    return kept[:-1]\n", "It should return the tokens it kept"),
    ("    return kept + [0]\n", "It should return the tokens it kept"),
    ("    return len(kept)\n", "returned "),
], ids=["None", "no return", "junk", "+1e-3", "NaN", "sequence", "proposals",
        "without the target's token", "one too many", "a count"])
def test_round_checker_reads_what_the_round_returns(new, words):
    """The round returns the tokens it kept (the broken round's comment says so): whatever
    else it returns is refused, once the tokens and the caches are right."""
    feedback = ex23.check_speculative_round(round_variant("    return kept\n", new))
    assert_not_yet(feedback, "added the right tokens to sequence, but returned")
    assert_not_yet(feedback, words)


# ---------------------------------------------------------------------------------------------
# The notebook: its exercises stay open, the solutions pass in its own variables
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def namespace():
    """The notebook's variables, its code cells run once in order (tests/test_cells_run_twice.py
    runs every cell again after the whole notebook)."""
    return run_notebook("speculative_decoding")


SOLVED_BY = {1: ex23.check_tokens_per_pass, 2: ex23.check_speculative_round,
             3: ex23.check_acceptance_probabilities}


def test_solutions_pass_in_the_notebooks_namespace(namespace):
    assert namespace["answer"] is ...
    assert sorted(ex23.SOLUTIONS) == sorted(SOLVED_BY)
    for number, check in SOLVED_BY.items():
        scope = dict(namespace)
        exec(ex23.SOLUTIONS[number], scope)
        assert check(scope["answer"]).passed, number


def test_the_notebooks_broken_round_is_the_exercises_bug(namespace):
    feedback = ex23.check_speculative_round(namespace["speculative_round_broken"])
    assert_not_yet(feedback, "K and V of rejected proposals")


def test_solution_display():
    shown = ex23.solution(2)
    assert "Solution to exercise 2" in shown.data and "truncate" in shown.data
    with pytest.raises(ValueError, match="no exercise 7"):
        ex23.solution(7)
