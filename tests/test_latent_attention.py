"""Notebook 16 (multi-head latent attention): the claims it makes, proven on random models
(absorbed equals rebuilt, with and without a cache; the decode step is MQA with one wide K/V
head; what each path costs), the published numbers it shows, its widget driven headless, and
its exercise checkers with tables of typical wrong answers (each with its diagnosis) and of
valid answers in other forms."""

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import case_id, correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, run_notebook
from strategies import models
from widget_checks import no_new_figures

import kvlib
from kvlib import latent, memory
from kvlib.exercises import latent_attention as exercises
from kvlib.widgets import latent_attention as widgets

TOLERANCE = 1e-10


# ---------------------------------------------------------------------------------------------
# The lesson's claims on random latent-attention models (float64, 1e-10)
# ---------------------------------------------------------------------------------------------

def rotary_for(config, positions):
    if config.positions != "rotary":
        return None
    return kvlib.RotaryPositions(np.asarray(positions), config.rope_head_dim, config.rope_base)


@st.composite
def layer_inputs(draw):
    """A random latent-attention layer, the inputs of P cached and T new positions."""
    params, config = draw(models(latent=True))
    past = draw(st.integers(0, 10))
    new = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 10_000)))
    X = rng.standard_normal((past + new, config.d_model))
    return params.layers[draw(st.integers(0, config.n_layers - 1))], config, X, past


@given(layer_inputs())
@settings(max_examples=120, deadline=None)
def test_absorbed_attention_over_a_latent_cache_equals_rebuilt_keys_and_values(case):
    layer, config, X, past = case
    h, n = config.n_heads, len(X)
    everything = rotary_for(config, np.arange(n))
    X_past, X_new = X[:past], X[past:]
    cache = kvlib.LatentKVCache(config.replace(n_layers=1))
    if past:
        cache.append(0, latent.compress_kv(X_past, layer),
                     latent.rope_keys(X_past, layer, rotary_for(config, np.arange(past))))
    new_positions = rotary_for(config, np.arange(past, n))
    mask = kvlib.causal_mask(n - past, n)
    absorbed = latent.latent_attention(X_new, layer, h, mask, cache=cache, rotary=new_positions)
    rebuilt = latent.latent_attention_rebuilt(
        X_new, layer, h, mask, rotary=new_positions,
        past_latent=latent.compress_kv(X_past, layer) if past else None,
        past_key_rope=(latent.rope_keys(X_past, layer, rotary_for(config, np.arange(past)))
                       if past else None))
    np.testing.assert_allclose(absorbed, rebuilt, rtol=0, atol=TOLERANCE)
    # and both equal the last rows of the whole sequence at once, without a cache
    whole = latent.latent_attention_rebuilt(X, layer, h, kvlib.causal_mask(n), rotary=everything)
    np.testing.assert_allclose(absorbed, whole[past:], rtol=0, atol=TOLERANCE)
    assert cache.nbytes == kvlib.latent_cache_bytes(1, config.latent_dim, config.rope_head_dim,
                                                    n, dtype_bytes=8)


def rebuilt_by_hand(X, layer, config, rotary, mask):
    """Notebook 16's reference written from scratch: every head's keys and values rebuilt
    from the latents, the rotary columns appended, plain softmax attention."""
    h, dh, dr = config.n_heads, config.head_dim, config.rope_head_dim
    latents = X @ layer.W_down_kv
    K, V, Q = latents @ layer.W_up_k, latents @ layer.W_up_v, X @ layer.Wq
    outputs = []
    for head in range(h):
        columns = slice(head * dh, (head + 1) * dh)
        q, k = Q[:, columns], K[:, columns]
        if dr:
            q = np.hstack([q, rotary.rotate(X @ layer.Wq_rope)[:, head * dr:(head + 1) * dr]])
            k = np.hstack([k, rotary.rotate(X @ layer.Wk_rope)])
        scores = np.where(mask, q @ k.T / math.sqrt(dh + dr), -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        outputs.append(weights / weights.sum(axis=1, keepdims=True) @ V[:, columns])
    return np.hstack(outputs)


@given(layer_inputs())
@settings(max_examples=60, deadline=None)
def test_kvlibs_reference_equals_attention_written_from_scratch(case):
    layer, config, X, _ = case
    n = len(X)
    rotary, mask = rotary_for(config, np.arange(n)), kvlib.causal_mask(n)
    np.testing.assert_allclose(
        latent.latent_attention_rebuilt(X, layer, config.n_heads, mask, rotary=rotary),
        rebuilt_by_hand(X, layer, config, rotary, mask), rtol=0, atol=TOLERANCE)


@given(layer_inputs())
@settings(max_examples=60, deadline=None)
def test_a_latent_decode_is_mqa_with_one_kv_head_of_dc_plus_dr(case):
    layer, config, X, _ = case
    h, dh, dc, dr = config.n_heads, config.head_dim, config.latent_dim, config.rope_head_dim
    n = len(X)
    rotary, mask = rotary_for(config, np.arange(n)), kvlib.causal_mask(n)
    content, q_rope = latent.latent_queries(X, layer, rotary)
    queries = latent.absorb_queries(kvlib.split_heads(content, h), layer, h)
    keys = latent.compress_kv(X, layer)
    if dr:
        queries = np.concatenate([queries, kvlib.split_heads(q_rope, h)], axis=-1)
        keys = np.hstack([keys, latent.rope_keys(X, layer, rotary)])
    queries = queries * math.sqrt((dc + dr) / (dh + dr))
    mixed = kvlib.attention(queries, keys[None], keys[None, :, :dc], mask)
    np.testing.assert_allclose(kvlib.merge_heads(latent.expand_values(mixed, layer, h)),
                               latent.latent_attention(X, layer, h, mask, rotary=rotary),
                               rtol=0, atol=TOLERANCE)


@given(layer_inputs(), st.data())
@settings(max_examples=60, deadline=None)
def test_one_heads_absorbed_scores_are_the_exercises_formula(case, data):
    layer, config, X, _ = case
    if not config.rope_head_dim:
        return       # the exercise's function takes a rotary part
    h, dh, dr = config.n_heads, config.head_dim, config.rope_head_dim
    n = len(X)
    rotary = rotary_for(config, np.arange(n))
    content, q_rope = latent.latent_queries(X, layer, rotary)
    latents, rope_keys = latent.compress_kv(X, layer), latent.rope_keys(X, layer, rotary)
    scores = latent.latent_attention_scores(
        latent.absorb_queries(kvlib.split_heads(content, h), layer, h), latents,
        kvlib.split_heads(q_rope, h), rope_keys, 1 / math.sqrt(dh + dr))
    head, row = data.draw(st.integers(0, h - 1)), data.draw(st.integers(0, n - 1))
    mine = exercises.expected_head_scores(layer, head, content[row, head * dh:(head + 1) * dh],
                                     q_rope[row, head * dr:(head + 1) * dr], latents, rope_keys)
    np.testing.assert_allclose(mine, scores[head, row], rtol=0, atol=TOLERANCE)


@given(models(latent=True), st.data())
@settings(max_examples=40, deadline=None)
def test_each_paths_count_is_its_formula(model, data):
    params, config = model
    h, dh, dc, dr, d = (config.n_heads, config.head_dim, config.latent_dim,
                        config.rope_head_dim, config.d_model)
    past = data.draw(st.integers(1, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    X_past, x = rng.standard_normal((past, d)), rng.standard_normal((1, d))
    layer = params.layers[0]
    past_latents = latent.compress_kv(X_past, layer)
    past_rope = latent.rope_keys(X_past, layer, rotary_for(config, np.arange(past)))
    position = rotary_for(config, [past])

    def absorbed_path(p, x):
        one_layer = kvlib.LatentKVCache(p.config.replace(n_layers=1))
        one_layer.append(0, past_latents, past_rope)
        return latent.latent_attention(x, p.layers[0], h, cache=one_layer, rotary=position)

    def rebuilt_path(p, x):
        return latent.latent_attention_rebuilt(x, p.layers[0], h, rotary=position,
                                               past_latent=past_latents,
                                               past_key_rope=past_rope)

    out_a, absorbed = kvlib.count_multiply_adds(absorbed_path, params, x)
    out_r, rebuilt = kvlib.count_multiply_adds(rebuilt_path, params, x)
    np.testing.assert_allclose(out_a, out_r, rtol=0, atol=TOLERANCE)
    S = past + 1
    shared = d * d + d * h * dr + d * dc + d * dr          # Wq, Wq_rope, W_down_kv, Wk_rope
    assert absorbed.as_dict() == {"projections": shared + 2 * d * dc,
                                  "attention_scores": h * S * (dc + dr),
                                  "attention_sums": h * S * dc, "mlp": 0, "unembedding": 0}
    assert rebuilt.as_dict() == {"projections": shared + 2 * S * dc * d,
                                 "attention_scores": h * S * (dh + dr),
                                 "attention_sums": h * S * dh, "mlp": 0, "unembedding": 0}
    step = kvlib.decode_step_multiply_adds(config, past)
    assert step.projections == config.n_layers * (absorbed.projections + d * d)


def test_rope_on_rebuilt_keys_needs_a_different_absorbed_query_per_position():
    """The notebook's argument, checked: turning the query by m - n is what each key needs."""
    config = exercises.LESSON_CONFIG.replace(positions="none", rope_head_dim=0)
    layer = kvlib.init_params(config).layers[0]
    rng = np.random.default_rng(3)
    latents, q = rng.standard_normal((6, config.latent_dim)), rng.standard_normal(4)
    block = layer.W_up_k[:, 4:8]
    angles = kvlib.rotary_angles(np.arange(6), 4)
    q_turned = kvlib.rotate_pairs(q[None], angles[[5]])
    scores = kvlib.rotate_pairs(latents @ block, angles) @ q_turned[0]
    needed = np.vstack([kvlib.rotate_pairs(q_turned, -angles[[n]]) @ block.T for n in range(6)])
    np.testing.assert_allclose(np.einsum("nc,nc->n", latents, needed), scores, atol=1e-12)
    for n in range(5):   # no one absorbed query serves two positions
        assert not np.allclose(latents @ needed[n], scores)


def test_rotary_latent_attention_without_a_rotary_key_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="rope_head_dim > 0"):
        kvlib.ModelConfig(d_model=32, n_heads=8, d_ff=64, latent_dim=8, positions="rotary")


# ---------------------------------------------------------------------------------------------
# The numbers the notebook shows
# ---------------------------------------------------------------------------------------------

def test_lesson_model_cache_and_its_mha_twin():
    params = kvlib.init_params(exercises.LESSON_CONFIG)
    ids = kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)
    logits, cache = kvlib.prefill(params, ids)
    assert isinstance(cache, kvlib.LatentKVCache) and cache.keys(0).shape == (5, 10)
    assert np.shares_memory(cache.values(0), cache.keys(0))
    assert cache.nbytes == kvlib.latent_cache_bytes(3, 8, 2, 5, dtype_bytes=8) == 1200
    sequence, token = list(ids), int(np.argmax(logits[-1]))
    for _ in range(8):
        sequence.append(token)
        step = kvlib.decode_step(params, token, cache)
        np.testing.assert_allclose(step, kvlib.forward(params, sequence, last_only=True),
                                   rtol=0, atol=TOLERANCE)
        token = int(np.argmax(step[-1]))
    mha = exercises.LESSON_CONFIG.replace(latent_dim=None, rope_head_dim=0)
    _, mha_cache = kvlib.prefill(kvlib.init_params(mha), sequence)
    assert mha_cache.nbytes / cache.nbytes == 6.4


def test_deepseek_numbers():
    v2, v3 = memory.PRESETS["DeepSeek-V2"], memory.PRESETS["DeepSeek-V3"]
    assert v2.kv_bytes_per_token() == 69_120 and v3.kv_bytes_per_token() == 70_272
    assert v2.mha_bytes_per_token() == 3_932_160 and v3.mha_bytes_per_token() == 3_997_696
    for model in (v2, v3):
        assert model.attention == "MLA" and "config.json of deepseek-ai" in model.source
        assert round(model.mha_bytes_per_token() / model.kv_bytes_per_token(), 1) == 56.9
    assert (v2.latent_dim + v2.rope_head_dim) / (2 * v2.head_dim) == 2.25
    assert v3.kv_bytes_per_token() < memory.PRESETS["Llama-3-8B"].kv_bytes_per_token()
    # per cached position and layer at V3's shapes: absorbed, rebuilt each step, K/V cache
    H, DH, DC, DR = 128, 128, 512, 64
    assert H * (DC + DR) + H * DC == 139_264
    assert 2 * DC * H * DH + H * (DH + DR) + H * DH == 16_818_176
    assert H * (DH + DR) + H * DH == 40_960
    assert H * (2 * DH + DR) * 2 // ((DC + DR) * 2) == 71


def test_bytes_per_token_rows_and_gqa_heads():
    assert widgets.bytes_per_token(60, 128, 128, 512, 64) == {
        "MHA": 3_932_160, "GQA": 245_760, "MQA": 30_720, "MLA": 69_120}
    assert list(widgets.bytes_per_token(32, 71, 64, 256, 32)) == ["MHA", "MQA", "MLA"]   # Falcon
    assert [widgets.grouped_kv_heads(n) for n in (128, 32, 8, 12, 71, 1, 2)] == \
        [8, 8, 4, 6, None, None, None]
    with pytest.raises(ValueError, match="must be even"):
        widgets.bytes_per_token(60, 128, 128, 512, 63)
    with pytest.raises(ValueError, match="latent size dc must be a whole number of at least 1"):
        widgets.bytes_per_token(60, 128, 128, 0, 64)
    with pytest.raises(ValueError, match="whole number"):
        widgets.bytes_per_token(60, 128, 128, 2.5, 64)


def test_draw_bytes_per_token_labels_and_refusals():
    fig, ax = plt.subplots()
    widgets.draw_bytes_per_token(ax, ["MHA", "MLA"], [1000, 100], ["MHA", "MLA"], title="t")
    texts = [t.get_text() for t in ax.texts]
    assert texts == [" 1,000", " 100  (10.0x less)"]
    assert ax.get_xscale() == "log" and ax.get_title() == "t"
    assert [tick.get_text() for tick in ax.get_yticklabels()] == ["MHA", "MLA"]
    widgets.draw_bytes_per_token(ax, ["a", "b", "c"], [100, 100, 400], ["MHA", "MLA", "MLA"])
    assert [t.get_text() for t in ax.texts] == [" 100", " 100  (the same)", " 400  (4.0x more)"]
    with pytest.raises(ValueError, match="positive"):
        widgets.draw_bytes_per_token(ax, ["a"], [0], ["MHA"])
    with pytest.raises(ValueError, match="as many labels"):
        widgets.draw_bytes_per_token(ax, ["a", "b"], [1], ["MHA"])
    with pytest.raises(ValueError, match="kinds must be among"):
        widgets.draw_bytes_per_token(ax, ["a"], [1], ["XYZ"])


# ---------------------------------------------------------------------------------------------
# The widget, headless
# ---------------------------------------------------------------------------------------------

def bars(box):
    return [patch.get_width() for patch in box.figure.axes[0].patches]


def test_calculator_starts_on_deepseek_v2():
    box = widgets.latent_cache_calculator()
    assert box.controls["latent_dim"].value == 512 and box.controls["rope_head_dim"].value == 64
    assert bars(box) == [3_932_160, 245_760, 30_720, 69_120]
    assert "69,120 bytes a token" in box.status.value
    assert "56.9 times less than MHA" in box.status.value
    assert "2.25 K/V heads" in box.status.value and "DeepSeek-V2" in box.status.value
    assert box.message.value == ""
    labels = [t.get_text() for t in box.figure.axes[0].get_yticklabels()]
    assert labels == ["MHA, 128 K/V heads", "GQA, 8 K/V heads", "MQA, 1 K/V head",
                      "MLA, latent 512 + rotary 64"]


def test_choosing_a_preset_brings_its_own_latent_sizes():
    box = widgets.latent_cache_calculator("DeepSeek-V2")
    box.controls["latent_dim"].value = 1024
    assert box.state["sizes"]["MLA"] == 60 * (1024 + 64) * 2
    box.controls["preset"].value = "GPT-2 small"         # no latent: DeepSeek's proportions
    assert (box.controls["latent_dim"].value, box.controls["rope_head_dim"].value) == (256, 32)
    assert box.state["sizes"] == widgets.bytes_per_token(12, 12, 64, 256, 32)
    assert "GPT-2 small itself uses MHA" in box.status.value
    box.controls["preset"].value = "Llama-3-8B"
    assert (box.controls["latent_dim"].value, box.controls["rope_head_dim"].value) == (512, 64)
    box.controls["preset"].value = "DeepSeek-V3"         # its own: 512 and 64
    assert (box.controls["latent_dim"].value, box.controls["rope_head_dim"].value) == (512, 64)
    assert box.state["sizes"]["MLA"] == memory.PRESETS["DeepSeek-V3"].kv_bytes_per_token()
    box.controls["preset"].value = "Falcon-7B"           # 71 heads: no GQA bar
    assert list(box.state["sizes"]) == ["MHA", "MQA", "MLA"] and len(bars(box)) == 3
    assert box.controls["latent_dim"].value == 256       # heads of 64
    assert box.message.value == ""


def test_gpt2_draws_the_gqa_bar_it_can_and_labels_it():
    box = widgets.latent_cache_calculator("GPT-2 small")
    labels = [t.get_text() for t in box.figure.axes[0].get_yticklabels()]
    assert labels[:3] == ["MHA, 12 K/V heads", "GQA, 6 K/V heads", "MQA, 1 K/V head"]


@pytest.mark.parametrize("latent_dim, phrase", [
    (512, "56.9 times less than MHA"),
    (32_704, "as much as MHA"),                 # (32,704 + 64) x 60 x 2 = 3,932,160
    (65_472, "2.0 times more than MHA"),
    (10**9, "times more than MHA"),
])
def test_a_latent_larger_than_mha_is_said_to_cache_more(latent_dim, phrase):
    box = widgets.latent_cache_calculator("DeepSeek-V2")
    box.controls["latent_dim"].value = latent_dim
    assert phrase in box.status.value
    if "more" in phrase:
        assert "times less" not in box.status.value
        assert "x more)" in box.figure.axes[0].texts[-1].get_text()


@pytest.mark.parametrize("preset, latent_dim", [("DeepSeek-V2", 512), ("GPT-2 small", 10**9),
                                                 ("Falcon-7B", 123_456_789)])
def test_every_bar_label_fits_in_the_figure(preset, latent_dim):
    box = widgets.latent_cache_calculator(preset, latent_dim=latent_dim)
    figure = box.figure
    figure.draw_without_rendering()              # places the labels as a display would
    for label in figure.axes[0].get_yticklabels():
        assert label.get_window_extent().x0 >= 0, f"{label.get_text()!r} is clipped"
    right = figure.axes[0].get_window_extent().x1
    for text in figure.axes[0].texts:            # the bytes and the comparison after each bar
        assert text.get_window_extent().x1 <= right, f"{text.get_text()!r} is clipped"


def test_compared_with_says_less_more_or_as_much():
    assert widgets.compared_with(56.9, "MHA") == "56.9 times less than MHA"
    assert widgets.compared_with(0.5, "MHA") == "2.0 times more than MHA"
    assert widgets.compared_with(1.0, "MHA") == "as much as MHA"


def test_calculator_starts_from_deepseek_proportions_for_other_models():
    box = widgets.latent_cache_calculator("Llama-3-8B")
    assert (box.controls["latent_dim"].value, box.controls["rope_head_dim"].value) == (512, 64)
    box = widgets.latent_cache_calculator("GPT-2 small", latent_dim=96, rope_head_dim=0)
    assert box.state["sizes"]["MLA"] == 12 * 96 * 2
    with pytest.raises(ValueError, match="preset must be one of"):
        widgets.latent_cache_calculator("GPT-5")


@pytest.mark.parametrize("field, value, phrase", [
    ("rope_head_dim", 3, "must be even"),
    ("rope_head_dim", -2, "at least 0"),
    ("latent_dim", 0, "at least 1"),
    ("latent_dim", -512, "at least 1"),
])
def test_bad_sizes_land_in_the_message_line_and_change_nothing(field, value, phrase):
    box = widgets.latent_cache_calculator()
    before, status = dict(box.state["sizes"]), box.status.value
    box.controls[field].value = value
    assert "Cannot show this" in box.message.value and phrase in box.message.value
    assert box.state["sizes"] == before and box.status.value == status
    box.controls[field].value = 512 if field == "latent_dim" else 64
    assert box.message.value == "" and box.state["sizes"] == before


def test_a_huge_latent_is_drawn_not_refused():
    box = widgets.latent_cache_calculator()
    box.controls["latent_dim"].value = 10**9
    assert box.message.value == "" and box.state["sizes"]["MLA"] == 60 * (10**9 + 64) * 2


def test_updates_redraw_in_place_without_leaking_figures():
    box = widgets.latent_cache_calculator()
    with no_new_figures():
        for dc in range(16, 2048, 64):
            box.controls["latent_dim"].value = dc
        ax = box.figure.axes[0]
        assert len(box.figure.axes) == 1
        assert len(ax.patches) == 4 and len(ax.texts) == 4    # redrawn, not piled up


# ---------------------------------------------------------------------------------------------
# Exercise checkers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, phrase", [
    (92_160, "no factor 2"),
    (40_960, "rotary key is missing"),
    (204_800, "one for all heads"),
    (1_152, "one layer"),
    (655_360, "multi-head attention"),
    (819_200, "rebuilt keys"),
    (368_640, "bits"),
    (23_040, "counts numbers"),
    (1_474_560, "latent for every head"),
    (45.0, "KiB"),
    (46_081, "not 46,081"),
    (46_080.4, "close (0.4 from the answer)"),
    (46_081.5, "not a whole number"),
    ("46080", "not text: write 46080 without quotes"),
    (np.array(["46080"]), "not text: write 46080 without quotes"),
    ("many", "not text (got 'many')"),
    (True, "True (a bool)"),
    ([46_080, 1], "several numbers"),
    (float("nan"), "finite"),
    (10**400, "finite"),
    (10**5000, "about 5,001 digits"),
], ids=case_id)
def test_bytes_per_token_checker_wrong_answers(answer, phrase):
    not_yet(exercises.check_latent_bytes_per_token(answer), phrase)


@pytest.mark.parametrize("answer", [46_080, 46_080.0, np.int64(46_080), np.float32(46_080),
                                    np.array(46_080), [46_080], np.array([46_080.0]),
                                    40 * (512 + 64) * 2])
def test_bytes_per_token_checker_valid_forms(answer):
    correct(exercises.check_latent_bytes_per_token(answer))


def make_head_scores(*, block_of="W_up_k", transpose=True, rope=True, scale="dh+dr",
                     head_shift=0, softmax=False, rebuild=False, as_list=False, shape=None):
    """A student's head_scores with one chosen slip (or none)."""
    def head_scores(layer, head, q_head, q_rope_head, latents, rope_keys):
        dh, dr = len(q_head), len(q_rope_head)
        other = (head + head_shift) % (getattr(layer, block_of).shape[1] // dh)
        block = getattr(layer, block_of)[:, other * dh:(other + 1) * dh]
        if rebuild:
            content = (latents @ block) @ q_head
        else:
            content = latents @ (q_head @ (block.T if transpose else block))
        rotary = rope_keys @ q_rope_head if rope else 0.0
        width = {"dh+dr": dh + dr, "dh": dh, "dc+dr": latents.shape[1] + dr, "none": 1}[scale]
        scores = (content + rotary) / math.sqrt(width)
        if softmax:
            scores = kvlib.softmax(scores)
        if shape is not None:
            scores = scores.reshape(shape)
        return scores.tolist() if as_list else scores
    return head_scores


@pytest.mark.parametrize("slip, phrase", [
    (dict(transpose=False), "transpose of W_up_k's block is missing"),
    (dict(block_of="W_up_v"), "uses W_up_v"),
    (dict(rope=False), "rotary part is missing"),
    (dict(scale="none"), "not scaled"),
    (dict(scale="dh"), "1 / sqrt(dh) only"),
    (dict(scale="dc+dr"), "sqrt(dc + dr), the width of the absorbed query"),
    (dict(softmax=True), "attention weights"),
    (dict(head_shift=1), "head 2's scores"),
    (dict(head_shift=-1), "head 0's scores"),
    (dict(shape=(2, 3)), "shape (6,)"),
])
def test_head_scores_checker_diagnoses_each_slip(slip, phrase):
    not_yet(exercises.check_head_scores(make_head_scores(**slip)), phrase)


def test_head_scores_checker_catches_every_kind_of_failure():
    def each_part_scaled(layer, head, q_head, q_rope_head, latents, rope_keys):
        dh, dr = len(q_head), len(q_rope_head)
        block = layer.W_up_k[:, head * dh:(head + 1) * dh]
        return latents @ (q_head @ block.T) / math.sqrt(dh) + rope_keys @ q_rope_head / \
            math.sqrt(dr)

    def only_content_scaled(layer, head, q_head, q_rope_head, latents, rope_keys):
        dh, dr = len(q_head), len(q_rope_head)
        block = layer.W_up_k[:, head * dh:(head + 1) * dh]
        return latents @ (q_head @ block.T) / math.sqrt(dh + dr) + rope_keys @ q_rope_head

    not_yet(exercises.check_head_scores(each_part_scaled), "each part scaled on its own")
    not_yet(exercises.check_head_scores(only_content_scaled), "only the content part")
    not_yet(exercises.check_head_scores(lambda *args: 1 / 0), "raised ZeroDivisionError")
    not_yet(exercises.check_head_scores(lambda layer, head: 0), "six arguments", "head_scores(")
    not_yet(exercises.check_head_scores(lambda *args: None), "returned None")
    not_yet(exercises.check_head_scores(lambda *args: "scores"), "array of numbers")
    not_yet(exercises.check_head_scores(lambda *args: np.full(6, np.nan)), "NaN")
    not_yet(exercises.check_head_scores(lambda *args: [1, [2, 3]]), "ragged list")
    not_yet(exercises.check_head_scores(lambda *args: np.zeros(6)), "head 1's scores are not right")
    not_yet(exercises.check_head_scores(lambda *args: np.zeros(5)), "shape (6,)")
    not_yet(exercises.check_head_scores("head_scores"), "should be a function")
    not_yet(exercises.check_head_scores(np.zeros(6)), "should be a function")

    def shapes_wrong(layer, head, q_head, q_rope_head, latents, rope_keys):
        return latents @ layer.W_up_k       # (S, d): a matmul that cannot go on to (S,)

    not_yet(exercises.check_head_scores(lambda l, h, q, qr, c, kr: c @ q), "Check the shapes")
    not_yet(exercises.check_head_scores(shapes_wrong), "shape (6,)")


@pytest.mark.parametrize("form", [dict(), dict(as_list=True), dict(shape=(1, 6)),
                                  dict(shape=(6, 1))])
def test_head_scores_checker_valid_forms(form):
    correct(exercises.check_head_scores(make_head_scores(**form)))


def rebuilt_in_a_loop(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    block = layer.W_up_k[:, head * dh:(head + 1) * dh]
    content = [float((latent @ block) @ q_head) for latent in latents]    # a key at a time
    return (np.array(content) + rope_keys @ q_rope_head) / math.sqrt(dh + dr)


def rebuilt_with_einsum(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    block = layer.W_up_k[:, head * dh:(head + 1) * dh]
    keys = np.einsum("sc,cd->sd", latents, block) / math.sqrt(dh + dr)   # scaled keys
    return keys @ q_head + rope_keys @ q_rope_head / math.sqrt(dh + dr)


def rebuilt_every_head(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    keys = np.dot(latents, layer.W_up_k)[:, head * dh:(head + 1) * dh]  # all heads, then one
    return (keys @ q_head + rope_keys @ q_rope_head) / math.sqrt(dh + dr)


def rebuilt_by_kvlib(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    keys, _ = latent.rebuild_kv(latents, layer)                           # (S, d): K and V
    return (keys[:, head * dh:(head + 1) * dh] @ q_head + rope_keys @ q_rope_head) / \
        math.sqrt(dh + dr)


def rebuilt_transposed(layer, head, q_head, q_rope_head, latents, rope_keys):
    dh, dr = len(q_head), len(q_rope_head)
    block = layer.W_up_k[:, head * dh:(head + 1) * dh]
    keys_t = block.T @ latents.T                                          # (dh, S)
    return (q_head @ keys_t + rope_keys @ q_rope_head) / math.sqrt(dh + dr)


@pytest.mark.parametrize("function", [make_head_scores(rebuild=True), rebuilt_in_a_loop,
                                      rebuilt_with_einsum, rebuilt_every_head,
                                      rebuilt_by_kvlib, rebuilt_transposed],
                         ids=["latents @ block", "a key at a time", "einsum, scaled keys",
                              "every head's keys", "kvlib's up-projection", "transposed"])
def test_head_scores_checker_refuses_rebuilt_keys(function):
    """The exercise says: without rebuilding any key. Right scores reached through the keys
    are told apart, however the keys are computed."""
    not_yet(exercises.check_head_scores(function), "scores are right, but your function rebuilt",
            "q_head @ block.T")


def test_watching_for_keys_leaves_the_arrays_and_the_watch_as_they_were():
    layer, q_head, q_rope_head, latents, rope_keys = exercises._case(exercises.LESSON_CONFIG, 15)
    before = layer.W_up_k.copy()
    exercises.check_head_scores(make_head_scores(rebuild=True))
    assert exercises.KeyWatch.current is None
    assert type(exercises._case(exercises.LESSON_CONFIG, 15)[0].W_up_k) is np.ndarray
    np.testing.assert_array_equal(layer.W_up_k, before)


def test_head_scores_checker_accepts_kvlibs_own_functions():
    def with_kvlib(layer, head, q_head, q_rope_head, latents, rope_keys):
        dh, dr = len(q_head), len(q_rope_head)
        n_heads = layer.W_up_k.shape[1] // dh
        queries = np.zeros((n_heads, 1, dh))
        queries[head, 0] = q_head
        absorbed = latent.absorb_queries(queries, layer, n_heads)[head]      # (1, dc)
        return latent.latent_attention_scores(absorbed, latents, q_rope_head[None], rope_keys,
                                              1 / math.sqrt(dh + dr))[0]

    correct(exercises.check_head_scores(with_kvlib))


@pytest.mark.parametrize("answer, phrase", [
    ("a", "A rotation is linear"), ("c", "keeps the width"), ("D", "do not cancel"),
    ("e", "no choice 'e'"), ("ab", "one letter"), ("", "one letter"), (2, "one letter"),
    (["a", "b"], "one letter"),
])
def test_choice_checker_wrong_answers(answer, phrase):
    not_yet(exercises.check_why_rope_is_not_absorbed(answer), phrase)


@pytest.mark.parametrize("answer", ["b", "B", " b ", "(b)", "b)", "b.", ["b"], ("B",)])
def test_choice_checker_valid_forms(answer):
    correct(exercises.check_why_rope_is_not_absorbed(answer))


# ---------------------------------------------------------------------------------------------
# The notebook: its exercises stay open, the solutions pass in its own variables
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def namespace():
    return run_notebook("latent_attention")


def test_every_solution_passes_in_the_notebooks_variables(namespace):
    assert_solutions_pass(namespace, exercises, {1: exercises.check_latent_bytes_per_token,
                                                 2: exercises.check_head_scores,
                                                 3: exercises.check_why_rope_is_not_absorbed})


def test_the_notebooks_suggested_self_check_holds(namespace):
    scope = dict(namespace)
    exec(exercises.SOLUTIONS[2], scope)
    mine = scope["head_scores"](scope["rope_layer"], 1, scope["q_head"], scope["q_rope_head"],
                                scope["rope_latents"], scope["k_rope"])
    np.testing.assert_allclose(mine, scope["scores_head"], atol=1e-12)
    assert scope["rope_config"] == exercises.LESSON_CONFIG


def test_the_second_solution_defines_head_scores():
    assert "def head_scores(" in exercises.SOLUTIONS[2]


def test_the_calculator_says_a_latent_wider_than_mha_saves_nothing():
    box = widgets.latent_cache_calculator()
    box.controls["latent_dim"].value = 10_000_000
    assert "saves nothing" in box.status.value and "39,062" not in box.status.value
    box.controls["latent_dim"].value = 512
    assert "as much as GQA with 2.25 K/V heads of 128" in box.status.value
