"""kvlib.eviction (keeping_what_attention_reads): every policy equals the plain cache while the
budget holds the whole sequence, never holds more than its budget, keeps what its paper says
(TOVA checked on SmolLM2 against an independent implementation: a full recomputation in which
a dropped position is masked for every later query), and changes nothing when a call fails."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import configs

import kvlib
from kvlib.eviction import H2O, POLICIES, TOVA, EvictingCache, Sinks, SnapKV, Window, average_pool
from kvlib.long_context import copied_tokens, streaming_losses

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "notebooks" / "data" / "keeping_what_attention_reads.json"
NAMES = sorted(POLICIES)


def toy(n_kv_heads=2, n_layers=3, positions="rotary"):
    config = kvlib.ModelConfig(vocab_size=40, d_model=24, n_heads=4, n_layers=n_layers, d_ff=32,
                               context_length=64, dtype="float64", positions=positions,
                               norm="rms", mlp="swiglu", bias=False, n_kv_heads=n_kv_heads)
    return kvlib.init_params(config, seed=3), config


def run(params, ids, cache, chunks):
    """The ids in passes of the given sizes (the rest one token a pass): the logits of each."""
    rows, start = [], 0
    for size in chunks:
        logits, cache = kvlib.prefill(params, ids[start:start + size], cache)
        rows.append(logits)
        start += size
    for token in ids[start:]:
        rows.append(kvlib.decode_step(params, token, cache))
    return np.concatenate(rows)


def any_policy(name, draw):
    if name == "sinks":
        return Sinks(draw(st.integers(1, 3)))
    if name == "h2o":
        return H2O(draw(st.sampled_from([None, 1, 2])))
    if name == "snapkv":
        return SnapKV(draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 5])))
    return POLICIES[name]()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES))
def test_with_room_for_the_whole_sequence_every_policy_is_the_plain_cache(data, name):
    config = data.draw(configs(latent=False, window=False))
    params = kvlib.init_params(config, seed=data.draw(st.integers(0, 1000)))
    ids = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=2, max_size=14))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    chunks = [size for size in chunks if size <= len(ids)][:1] or [1]
    budget = data.draw(st.integers(max(len(ids), 5), 30))
    per_layer = data.draw(st.booleans())
    budgets = [budget + data.draw(st.integers(0, 3)) for _ in range(config.n_layers)] \
        if per_layer else budget
    cache = EvictingCache(config, budgets, any_policy(name, data.draw))
    expected = run(params, ids, kvlib.KVCache(config), chunks)
    np.testing.assert_array_equal(run(params, ids, cache, chunks), expected)
    assert len(cache) == len(ids)
    assert cache.nbytes == 2 * config.n_layers * len(ids) * config.kv_width * 8


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(NAMES))
def test_the_budget_is_never_exceeded_between_passes(data, name):
    config = data.draw(configs(latent=False, window=False, positions="rotary"))
    params = kvlib.init_params(config, seed=data.draw(st.integers(0, 1000)))
    ids = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=6, max_size=24))
    budget = data.draw(st.integers(5, 10))
    policy = any_policy(name, data.draw)
    cache = EvictingCache(config, budget, policy)
    first = data.draw(st.integers(1, len(ids) - 1))
    kvlib.prefill(params, ids[:first], cache)
    for step, token in enumerate(ids[first:], start=1):
        kvlib.decode_step(params, token, cache)
        # SnapKV compresses the prompt, then keeps every token that follows
        held = min(first, budget) + step if name == "snapkv" else min(first + step, budget)
        for layer in range(config.n_layers):
            positions = cache.held_positions(layer)
            assert positions.shape[1] == held
            assert all((np.diff(row) > 0).all() for row in positions)        # sorted, distinct
            assert positions.max() < len(cache) == first + step
            if name != "tova":                       # the others always keep the newest
                assert (positions[:, -1] == len(cache) - 1).all()
        held = sum(cache.held_positions(layer).shape[1] for layer in range(config.n_layers))
        assert cache.nbytes == 2 * held * config.kv_width * 8


def test_window_and_sinks_keep_what_they_say():
    params, config = toy()
    ids = list(range(30))
    window, sinks = EvictingCache(config, 8, Window()), EvictingCache(config, 8, Sinks(3))
    for cache in (window, sinks):
        kvlib.prefill(params, ids[:5], cache)
        for token in ids[5:]:
            kvlib.decode_step(params, token, cache)
    assert window.held_positions(1).tolist() == [list(range(22, 30))] * 2
    assert sinks.held_positions(2).tolist() == [[0, 1, 2, *range(25, 30)]] * 2


def test_tova_keeps_one_set_per_layer_and_h2o_one_per_kv_head():
    params, config = toy(n_kv_heads=2)
    ids = np.random.default_rng(0).integers(0, 40, 30)
    tova, h2o = EvictingCache(config, 9, "tova"), EvictingCache(config, 9, "h2o")
    for cache in (tova, h2o):
        run(params, ids, cache, [6])
    assert all((tova.held_positions(layer)[0] == tova.held_positions(layer)[1]).all()
               for layer in range(3))
    assert any((h2o.held_positions(layer)[0] != h2o.held_positions(layer)[1]).any()
               for layer in range(3))
    # H2O's recent half is the last 4 positions of every head (budget 9 // 2)
    assert all((h2o.held_positions(layer)[:, -4:] == np.arange(26, 30)).all() for layer in range(3))


def tova_by_recomputation(params, ids, budget):
    """TOVA as its paper states it, without a cache: at step t the whole sequence is
    recomputed with, in each layer, every query seeing only the positions that layer held at
    its time (a dropped position is masked for every later query); after the step, while more
    than `budget` are held, the one the newest query weighs least, averaged over the layer's
    query heads, is dropped. -> (last-row logits of every step, final held sets)."""
    config = params.config
    held = [[] for _ in params.layers]                    # per layer: held positions, in order
    visible = [np.zeros((len(ids), len(ids)), dtype=bool) for _ in params.layers]
    logits_rows = []
    for t in range(len(ids)):
        for layer in range(config.n_layers):
            visible[layer][t, held[layer] + [t]] = True
        positions = np.arange(t + 1)
        X = kvlib.embed(np.asarray(ids[: t + 1]), params.embedding)
        rotary = kvlib.rotary_positions(config, positions)
        for index, layer in enumerate(params.layers):
            recorded = []
            X = kvlib.decoder_block(X, layer, config.n_heads, mask=visible[index][: t + 1, : t + 1],
                                    record_attention=recorded, rotary=rotary,
                                    norm_epsilon=config.norm_epsilon)
            candidates = held[index] + [t]
            weights = recorded[0][:, -1, :].mean(axis=0)   # the newest query, every head
            while len(candidates) > budget:
                candidates.remove(min(candidates, key=lambda p: weights[p]))
            held[index] = candidates
        normed = kvlib.normalize(X[-1:], params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
        logits_rows.append(kvlib.unembed(normed, params.embedding))
    return np.concatenate(logits_rows), held


HIDDEN_TEXT = ("The lighthouse keeper wrote down the colour of the sea every morning, and on "
               "the day the ledger ran out of pages he began again on the inside of the cover, "
               "in smaller letters, so that the grey and the green would still fit.")


def test_tova_on_smollm2_matches_the_papers_rule_computed_without_a_cache(smollm2_tokenizer):
    params = kvlib.load_smollm2(dtype="float64")
    ids = smollm2_tokenizer.encode(HIDDEN_TEXT)[:40]
    budget = 12
    expected_logits, expected_held = tova_by_recomputation(params, ids, budget)
    cache = EvictingCache(params.config, budget, TOVA())
    logits = run(params, ids, cache, [1])
    for layer, held in enumerate(expected_held):
        assert cache.held_positions(layer).tolist() == [sorted(held)] * 3, layer
    np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=1e-9)
    # the eviction changed the prediction: the test compares something
    plain = run(params, ids, kvlib.KVCache(params.config), [1])
    assert np.abs(plain - logits).max() > 0.1


def test_snapkv_votes_with_its_observation_window_pooled():
    """SnapKV's choice after a prompt, recomputed from the prompt's recorded weights by loops."""
    params, config = toy(n_kv_heads=2, n_layers=2)
    ids = np.random.default_rng(1).integers(0, 40, 24)
    window, kernel, budget = 4, 3, 10
    recorded = []
    kvlib.prefill(params, ids, kvlib.KVCache(config), record_attention=recorded)
    cache = EvictingCache(config, budget, SnapKV(window, kernel))
    kvlib.prefill(params, ids, cache)
    for layer, weights in enumerate(recorded):                 # (h, T, T)
        for head in range(2):
            group = weights[2 * head: 2 * head + 2, -window:, : len(ids) - window]
            votes = group.sum(axis=(0, 1))
            padded = np.concatenate([[0.0], votes, [0.0]])
            pooled = np.array([padded[i:i + kernel].sum() / kernel for i in range(len(votes))])
            chosen = sorted(np.argsort(-pooled, kind="stable")[: budget - window].tolist())
            assert cache.held_positions(layer)[head].tolist() == \
                chosen + list(range(len(ids) - window, len(ids)))
    # generated tokens are kept: two more steps, two more rows
    kvlib.decode_step(params, 3, cache)
    kvlib.decode_step(params, 4, cache)
    assert cache.held_positions(0).shape == (2, budget + 2)


def test_average_pool_is_torchs_with_zero_padding():
    votes = np.array([[1.0, 2.0, 3.0, 4.0]])
    np.testing.assert_allclose(average_pool(votes, 3), [[1.0, 2.0, 3.0, 7 / 3]])
    np.testing.assert_array_equal(average_pool(votes, 1), votes)


def test_pyramid_budgets_fall_with_depth_and_keep_the_total():
    budgets = kvlib.pyramid_budgets(30, 128)
    assert budgets[0] > budgets[-1] and all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert abs(sum(budgets) - 30 * 128) <= 15      # each layer's share rounded
    assert budgets[0] == 8 + 2 * 120 - 6 and budgets[-1] == 8 + 120 // 20


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_pass_that_fails_half_way_leaves_the_cache_as_it_was(error, monkeypatch):
    params, config = toy()
    cache = EvictingCache(config, 6, "h2o")
    run(params, list(range(12)), cache, [5])
    before = cache.checkpoint()[1]
    observe = EvictingCache.observe

    def failing(self, layer, weights):
        if layer == 2:
            raise error
        observe(self, layer, weights)

    monkeypatch.setattr(EvictingCache, "observe", failing)
    with pytest.raises(type(error)):
        kvlib.decode_step(params, 3, cache)
    monkeypatch.setattr(EvictingCache, "observe", observe)
    lengths, layers = cache.checkpoint()[1]
    assert lengths == before[0]
    for state_before, state_after in zip(before[1], layers):   # the same arrays, untouched
        assert all(a is b for a, b in zip(state_before, state_after))
    assert cache.lengths == (12, 12, 12) and cache.held_positions(0).shape == (2, 6)


@pytest.mark.parametrize("make, words", [
    (lambda c: EvictingCache(c, 0), "budget"),
    (lambda c: EvictingCache(c, "8"), "budget"),
    (lambda c: EvictingCache(c, [8, 8]), "one per layer"),
    (lambda c: EvictingCache(c, 8, "lru"), "policy"),
    (lambda c: EvictingCache(c, 8, len), "policy"),
    (lambda c: EvictingCache(c, 4, Sinks(4)), "sinks"),
    (lambda c: EvictingCache(c, 8, SnapKV(8)), "observation window"),
    (lambda c: EvictingCache(c, 8, H2O(recent=8)), "recent"),
    (lambda c: EvictingCache(c.replace(window=4), 8), "no window"),
    (lambda c: SnapKV(kernel_size=4), "odd"),
])
def test_bad_settings_are_refused_in_words(make, words):
    _, config = toy()
    with pytest.raises((ValueError, TypeError), match=words):
        make(config)


def test_truncating_after_an_eviction_is_refused_and_reset_works():
    params, config = toy()
    cache = EvictingCache(config, 6, "tova")
    run(params, list(range(5)), cache, [3])
    cache.truncate(3)                                   # nothing dropped yet: allowed
    assert len(cache) == 3 and cache.held_positions(0).shape == (2, 3)
    run_more = [kvlib.decode_step(params, token, cache) for token in range(3, 10)]
    assert len(run_more) == 7
    with pytest.raises(ValueError, match="dropped"):
        cache.truncate(5)
    cache.reset()
    assert len(cache) == 0 and cache.nbytes == 0
    assert "0 positions seen" in repr(cache)


def test_streaming_losses_through_a_plain_cache_are_the_models_losses():
    params, config = toy()
    ids = np.random.default_rng(2).integers(0, 40, 20)
    np.testing.assert_allclose(streaming_losses(params, ids, kvlib.KVCache(config)),
                               kvlib.next_token_losses(kvlib.forward(params, ids), ids),
                               atol=1e-12)
    with pytest.raises(ValueError, match="an empty cache"):
        cache = kvlib.KVCache(config)
        kvlib.prefill(params, [1], cache)
        streaming_losses(params, ids, cache)


def test_copied_tokens_counts_the_greedy_choices():
    params, config = toy()
    ids = np.random.default_rng(3).integers(0, 40, 16)
    logits = kvlib.forward(params, ids)
    expected = logits[9:-1].argmax(axis=1) == ids[10:]
    np.testing.assert_array_equal(
        copied_tokens(params, [ids[:6], ids[6:10]], ids[10:], kvlib.KVCache(config)), expected)


DATA_GEMMA3 = ROOT / "notebooks" / "data" / "keeping_what_attention_reads_gemma3.json"


def _tool():
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import measure_eviction
    return measure_eviction


def test_the_committed_measurements_are_the_tools_inputs(smollm2_tokenizer):
    tool, data = _tool(), json.loads(DATA.read_text())
    assert data["loss"]["ids"] == tool.loss_ids(smollm2_tokenizer)
    assert data["copying"]["trials"] == [tool.copy_trial(smollm2_tokenizer, seed)
                                         for seed in range(tool.TRIALS)]
    loss = data["loss"]
    assert set(loss["policies"]) == set(tool.STREAMING)
    for rows in loss["policies"].values():
        assert all(rows[str(b)]["mean"] >= loss["full"]["mean"] - 0.05 for b in loss["budgets"])


def test_gemma3s_measurements_are_the_tools_inputs_and_one_trial_is_remade():
    tool, data = _tool(), json.loads(DATA_GEMMA3.read_text())
    tokenizer, params = kvlib.gemma3_tokenizer(), kvlib.load_gemma3()
    assert data["loss"]["ids"] == tool.loss_ids(tokenizer, tool.N_LOSS_GEMMA3)
    copying = data["copying"]
    assert copying["trials"] == [tool.copy_trial(tokenizer, seed)
                                 for seed in range(tool.TRIALS_GEMMA3)]
    # the filler is longer than the sliding window: only the global layers reach the passage
    assert len(copying["trials"][0]["filler"]) > params.config.sliding_window
    row = copying["question_later"]["per_trial"]["policies"]["tova"][0]     # budget 32
    remade = tool.copy_fractions(params, copying["trials"][:1], "question_later", "tova",
                                 copying["budgets"][0])
    assert abs(remade[0] - row[0]) <= 0.07        # two tokens of about 30: float32 near ties


def test_one_copying_row_is_remade(smollm2):
    tool, data = _tool(), json.loads(DATA.read_text())["copying"]
    budgets = data["budgets"]
    fraction = tool.copy_fraction(smollm2, data["trials"], "question_later", "window", budgets[-1])
    # each trial's answer has about 30 tokens: another CPU's float32 may flip a near tie or two
    assert abs(fraction - data["question_later"]["policies"]["window"][-1]) <= 0.05


# --------------------------------------------------------------------------- Gemma 3

@st.composite
def gemma3_models(draw):
    """A tiny random Gemma 3 in float64: sliding and global layers, one K/V head or two."""
    from kvlib import gemma3
    from kvlib.checkpoints.gemma3 import LAYER_TYPES, Gemma3Config
    kv = draw(st.integers(1, 2))
    layers = draw(st.integers(1, 3))
    config = Gemma3Config(
        vocab_size=20, hidden_size=8, intermediate_size=6, num_hidden_layers=layers,
        num_attention_heads=kv * draw(st.integers(1, 2)), num_key_value_heads=kv, head_dim=4,
        layer_types=tuple(draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=layers,
                                        max_size=layers))),
        sliding_window=draw(st.integers(1, 5)), query_pre_attn_scalar=9.0,
        max_position_embeddings=40, dtype="float64")
    return gemma3.init_gemma3_params(config, draw(st.integers(0, 1000)))


def run_gemma3(params, ids, cache, first):
    from kvlib import gemma3
    logits, cache = gemma3.prefill(params, ids[:first], cache)
    rows = [logits] + [gemma3.decode_step(params, token, cache) for token in ids[first:]]
    return np.concatenate(rows)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(["window", "sinks", "tova", "h2o", "snapkv"]))
def test_gemma3s_evicting_global_layers_are_its_cache_with_room_and_keep_their_budget(data, name):
    from kvlib import gemma3
    params = data.draw(gemma3_models())
    config = params.config
    if config.num_key_value_heads > 1 and name in ("h2o", "snapkv"):
        with pytest.raises(ValueError, match="per K/V head"):
            gemma3.evicting_cache(config, 10, name)
        return
    name = {"snapkv": SnapKV(2, 3), "sinks": Sinks(2)}.get(name, name)
    ids = data.draw(st.lists(st.integers(0, 19), min_size=6, max_size=20))
    first = data.draw(st.integers(1, len(ids)))
    expected = run_gemma3(params, ids, gemma3.Gemma3Cache(config), first)
    roomy = gemma3.evicting_cache(config, 20, name)
    np.testing.assert_array_equal(run_gemma3(params, ids, roomy, first), expected)
    budget = 5
    tight = gemma3.evicting_cache(config, budget, name)
    run_gemma3(params, ids, tight, first)
    for index, layer in enumerate(tight.layers):
        held = layer.n_held
        if config.is_sliding(index):
            assert held == min(len(ids), config.sliding_window)
        elif isinstance(name, SnapKV):
            assert held == min(first, budget) + len(ids) - first
        else:
            assert held == min(len(ids), budget)
    assert len(tight) == len(ids)


# ------------------------------------------------------------------- kvpress on transformers

REFERENCE = ROOT / "tests" / "data" / "eviction-reference.npz"


@pytest.mark.parametrize("name, policy", [("sinks", Sinks(4)), ("snapkv", SnapKV(4, 3))])
def test_the_kept_positions_and_the_next_logits_are_kvpresss(name, policy):
    """tools/make_eviction_reference.py: kvpress 0.5.5's presses on transformers 5.25, the tiny
    Llama in float64, a 32-token prompt compressed to 12 positions, then one decode step."""
    reference, params = np.load(REFERENCE), _tiny_llama()
    kept = reference[f"{name}_positions"].shape[-1]
    cache = EvictingCache(params.config, kept, policy)
    recorded = []
    kvlib.prefill(params, reference["ids"], cache, record_attention=recorded)
    for layer, positions in enumerate(reference[f"{name}_positions"]):
        np.testing.assert_array_equal(cache.held_positions(layer), positions)
    logits = kvlib.decode_step(params, int(reference["token"]), cache)
    np.testing.assert_allclose(logits[0], reference[f"{name}_logits"][-1], rtol=0, atol=1e-9)
    assert np.abs(reference["full_logits"][-1] - logits[0]).max() > 1e-3   # eviction showed
    if name == "snapkv":     # no near tie between the last kept and the first dropped vote
        window = policy.observation_window
        for weights in recorded:
            votes = weights.reshape(2, -1, *weights.shape[1:])[:, :, -window:, :-window]
            ranked = -np.sort(-average_pool(votes.sum(axis=(1, 2)), policy.kernel_size))
            chosen = kept - window
            assert (ranked[:, chosen - 1] - ranked[:, chosen] > 1e-4 * ranked[:, 0]).all()


def test_tova_scores_what_kvpresss_tova_scores():
    """kvpress's TOVAPress keeps the last position always, then the others the last query
    weighs most, averaged over every query head; TOVA's own code (TOVACache.reduce) and kvlib
    rank the last position like any other. So kvpress's choice is checked against kvlib's
    scores with the last forced in, and kvlib's own choice differs exactly where the last
    position's weight is not among the 12 highest."""
    reference, params = np.load(REFERENCE), _tiny_llama()
    kept = reference["tova_positions"].shape[-1]
    cache = EvictingCache(params.config, kept, TOVA())
    recorded = []
    kvlib.prefill(params, reference["ids"], cache, record_attention=recorded)
    differs = []
    for layer, weights in enumerate(recorded):
        scores = weights[:, -1, :].mean(axis=0)                       # (T,)
        others = np.argsort(-scores[:-1], kind="stable")[: kept - 1]
        forced_last = sorted([*others.tolist(), len(scores) - 1])
        assert reference["tova_positions"][layer].tolist() == [forced_last] * 2
        ranked = -np.sort(-scores[:-1])
        assert ranked[kept - 2] - ranked[kept - 1] > 1e-4 * ranked[0]    # no near tie
        last_is_top = scores[-1] >= np.sort(scores)[-kept]
        assert (cache.held_positions(layer)[0].tolist() == forced_last) == bool(last_is_top)
        differs.append(not last_is_top)
    assert any(differs)        # the difference shows on this prompt: the test compares something


def _tiny_llama():
    from kvlib.checkpoints import llama
    return llama.load(ROOT / "tests" / "data" / "llama-reference", dtype="float64")


def test_a_prompt_in_one_pass_gives_the_same_losses_as_one_token_at_a_time():
    params, config = toy()
    ids = np.random.default_rng(4).integers(0, 40, 20)
    one_by_one = streaming_losses(params, ids, kvlib.KVCache(config))
    np.testing.assert_allclose(streaming_losses(params, ids, kvlib.KVCache(config), 12),
                               one_by_one, atol=1e-12)
    # SnapKV compresses a prompt given in one pass, not one given token by token
    compressed = streaming_losses(params, ids, EvictingCache(config, 8, SnapKV(2)), 12)
    assert np.abs(compressed[12:] - one_by_one[12:]).max() > 1e-6
    np.testing.assert_allclose(compressed[:11], one_by_one[:11], atol=1e-12)


def test_gemma3_is_given_its_own_cache_or_a_clear_error():
    from kvlib import gemma3
    from kvlib.checkpoints.gemma3 import Gemma3Config
    config = Gemma3Config(vocab_size=20, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                          query_pre_attn_scalar=9.0, max_position_embeddings=40, dtype="float64")
    params = gemma3.init_gemma3_params(config, 1)
    for wrong in (kvlib.KVCache(toy()[1]), 5, "cache"):
        with pytest.raises(TypeError, match="Gemma3Cache"):
            streaming_losses(params, [1, 2, 3], wrong)
    assert len(streaming_losses(params, [1, 2, 3, 4], gemma3.evicting_cache(config, 2))) == 3
