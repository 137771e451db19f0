"""Notebook 14 (positions and RoPE): the notebook's own constructions proven equal to kvlib
over random inputs, its widget driven headless, its exercise checkers with tables of typical
wrong answers (each with its diagnosis) and of valid answers in other forms, and SmolLM2's
two pairings of rotary dimensions, measured."""

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import case_id, correct, not_yet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, run_notebook
from strategies import models, token_lists
from widget_checks import no_new_figures

import kvlib
from kvlib.exercises import positions_and_rope as exercises
from kvlib.widgets import positions_and_rope as widgets

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "14_positions_and_rope.ipynb"
TOLERANCE = 1e-10
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def namespace():
    """The notebook's variables after running its code cells headless."""
    return run_notebook("positions_and_rope")


# ---------------------------------------------------------------------------------------------
# The notebook's constructions equal kvlib's, over random inputs (float64, 1e-10)
# ---------------------------------------------------------------------------------------------

heads = st.integers(1, 3)
pairs = st.integers(1, 8)
bases = st.sampled_from([10.0, 10000.0, 500000.0, 1e6])
seeds = st.integers(0, 2**32 - 1)


@st.composite
def rotation_inputs(draw):
    """(X (T, dim), positions (T,), dim, base): one head's rows at random positions."""
    dim, T = 2 * draw(pairs), draw(st.integers(1, 12))
    positions = np.array(draw(st.lists(st.integers(0, 5000), min_size=T, max_size=T)))
    X = np.random.default_rng(draw(seeds)).standard_normal((T, dim))
    return X, positions, dim, draw(bases)


@PROPERTY
@given(rotation_inputs())
def test_the_notebooks_pair_rotation_is_kvlibs(namespace, inputs):
    X, positions, dim, base = inputs
    angles = positions[:, None] * base ** (-np.arange(0, dim, 2) / dim)
    np.testing.assert_allclose(angles, kvlib.rotary_angles(positions, dim, base), rtol=1e-12)
    expected = kvlib.RotaryPositions(positions, dim, base).rotate(X)
    np.testing.assert_allclose(namespace["turn_pairs"](X, angles), expected, atol=TOLERANCE)


@PROPERTY
@given(st.floats(-50, 50), st.floats(-50, 50))
def test_the_notebooks_one_line_derivation(namespace, a, b):
    """R(a)ᵀ = R(-a) and R(a)ᵀ R(b) = R(b - a), for any two angles."""
    rotation = namespace["rotation"]
    np.testing.assert_allclose(rotation(a).T, rotation(-a), atol=1e-12)
    np.testing.assert_allclose(rotation(a).T @ rotation(b), rotation(b - a), atol=1e-9)


@PROPERTY
@given(st.integers(2, 128).map(lambda half: 2 * half), bases, st.floats(1.01, 64))
def test_ntk_aware_scaling_keeps_the_fastest_pair_and_slows_the_slowest_by_the_factor(
        namespace, dim, base, factor):
    raised = namespace["ntk_aware_base"](base, dim, factor)
    slowed = (kvlib.rotary_angles(np.array([1]), dim, base)[0]
              / kvlib.rotary_angles(np.array([1]), dim, raised)[0])
    assert slowed[0] == pytest.approx(1.0) and slowed[-1] == pytest.approx(factor)
    assert np.all(np.diff(slowed) > 0)


def test_pair_zero_comes_close_to_a_full_turn_only_near_multiples_of_six_point_28():
    q, k = widgets.example_query_and_key()
    shares = widgets.scores_by_distance(q, k, 48)[:, 0]
    # the distance where pair 0 comes nearest to where it started, 1..48: 44, not 6
    off_a_turn = np.abs((np.arange(1, 49) + np.pi) % (2 * np.pi) - np.pi)
    assert int(np.argmin(off_a_turn)) + 1 == 44
    assert abs(shares[44] - shares[0]) < 0.03 < abs(shares[6] - shares[0])


@PROPERTY
@given(rotation_inputs(), seeds)
def test_transformers_half_layout_is_a_permutation_of_kvlibs_pairs(namespace, inputs, seed):
    X, positions, dim, base = inputs
    angles = kvlib.rotary_angles(positions, dim, base)
    to_half = np.r_[0:dim:2, 1:dim:2]
    half = namespace["apply_rotary_half"](X[:, to_half], angles)
    np.testing.assert_allclose(half, kvlib.rotate_pairs(X, angles)[:, to_half], atol=TOLERANCE)
    other = np.random.default_rng(seed).standard_normal(X.shape)
    np.testing.assert_allclose(
        half @ namespace["apply_rotary_half"](other[:, to_half], angles).T,
        kvlib.rotate_pairs(X, angles) @ kvlib.rotate_pairs(other, angles).T, atol=1e-9)


@PROPERTY
@given(st.integers(1, 8), bases, st.integers(0, 500), st.integers(0, 500),
       st.integers(0, 2000), seeds)
def test_a_rotary_score_depends_on_the_distance_only(half_dim, base, m, n, shift, seed):
    dim = 2 * half_dim
    q, k = np.random.default_rng(seed).standard_normal((2, 1, dim))

    def score(query_position, key_position):
        turned_q = kvlib.RotaryPositions(np.array([query_position]), dim, base).rotate(q)
        turned_k = kvlib.RotaryPositions(np.array([key_position]), dim, base).rotate(k)
        return float((turned_q @ turned_k.T)[0, 0])

    assert abs(score(m + shift, n + shift) - score(m, n)) < 1e-9 * max(1.0, dim)
    assert abs(widgets.pair_scores(q[0], k[0], m + shift, n + shift, base).sum()
               - score(m, n) / math.sqrt(dim)) < 1e-9 * max(1.0, dim)


@PROPERTY
@given(models(positions="rotary", latent=False, window=False, norm="none",
              rope_pairing="interleaved"), st.data())
def test_turning_keys_at_read_time_equals_caching_them_turned(model, data):
    """The notebook's alternative: raw keys and their positions cached, all turned again at
    every read. A decode step's attention weights from it, in every layer, equal those of
    kvlib.decode_step on its cache of keys turned once, at write time."""
    params, config = model
    ids = token_lists(data.draw, config, min_size=2, max_size=10)
    _, cache = kvlib.prefill(params, ids[:-1])
    recorded = []
    kvlib.decode_step(params, ids[-1], cache, record_attention=recorded)
    stored_positions = np.arange(len(ids))
    at_write = kvlib.RotaryPositions(stored_positions, config.head_dim, config.rope_base)
    X = kvlib.embed(np.array(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        Q, raw_keys, _ = kvlib.project_qkv(X, layer)            # what a raw cache would hold
        np.testing.assert_allclose(cache.keys(index), at_write.rotate(raw_keys),
                                   atol=TOLERANCE)
        at_read = kvlib.RotaryPositions(stored_positions, config.head_dim,
                                        config.rope_base).rotate(raw_keys)
        newest = kvlib.RotaryPositions(stored_positions[-1:], config.head_dim,
                                       config.rope_base).rotate(Q[-1:])
        weights = kvlib.softmax(kvlib.attention_scores(
            kvlib.split_heads(newest, config.n_heads),
            kvlib.split_heads(at_read, config.kv_heads)))
        np.testing.assert_allclose(weights, recorded[index], atol=TOLERANCE)
        X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(len(ids)),
                                rotary=at_write)


@PROPERTY
@given(models(positions="rotary", latent=False, window=False, norm="none",
              rope_pairing="interleaved"), st.data())
def test_the_fixed_continuation_equals_recomputation_for_random_rotary_models(model, data):
    """Exercise 1's solution, any split into chunks: positions P .. P+T-1 every time."""
    params, config = model
    scope = {"np": np, "kvlib": kvlib}
    exec(exercises.SOLUTIONS[1], scope)
    ids = token_lists(data.draw, config, min_size=1, max_size=14)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=4))) | {len(ids)})
    cache, start, pieces = kvlib.KVCache(config), 0, []
    for cut in cuts:
        pieces.append(scope["answer"](params, ids[start:cut], cache))
        start = cut
    np.testing.assert_allclose(np.vstack(pieces), kvlib.forward(params, ids), atol=TOLERANCE)


def test_rope_adds_nothing_to_the_cache():
    for config in (kvlib.ModelConfig(positions="rotary"),
                   kvlib.ModelConfig(d_model=8, n_heads=4, n_kv_heads=2, positions="rotary")):
        _, cache = kvlib.prefill(kvlib.init_params(config), [0, 3, 7, 1, 9])
        assert cache.nbytes == kvlib.kv_cache_bytes(
            config.n_layers, None, 5, dtype_bytes=8, n_kv_heads=config.kv_heads,
            head_dim=config.head_dim)


# ---------------------------------------------------------------------------------------------
# What the notebook claims, checked again outside it
# ---------------------------------------------------------------------------------------------

def test_the_notebooks_broken_loop_fails_and_its_figures_hold(namespace):
    assert namespace["generated"] != namespace["expected"]
    not_yet(exercises.check_continue(namespace["continue_broken"]), "restart at 0",
            "position len(cache) = 5")
    assert (namespace["llama2"], namespace["llama3"]) == (18, 29)
    assert (namespace["turns_at_write"], namespace["turns_at_read"]) == (32, 518)


def test_every_solution_passes_in_the_notebooks_variables(namespace):
    assert "continue_fixed" in exercises.SOLUTIONS[1]
    assert_solutions_pass(namespace, exercises, {1: exercises.check_continue,
                                                 2: exercises.check_pair_angle,
                                                 3: exercises.check_keeps_scores})


# ---------------------------------------------------------------------------------------------
# The widget
# ---------------------------------------------------------------------------------------------

def arrow_tips(ax):
    """The tips of the full-strength arrows (q then k) drawn in the pair's plane."""
    arrows = [t for t in ax.texts if hasattr(t, "xy") and t.arrow_patch is not None
              and t.arrow_patch.get_alpha() in (None, 1.0)]
    return [np.array(a.xy) for a in arrows]


def artist_count(widget):
    return sum(len(ax.lines) + len(ax.texts) + len(ax.patches) + len(ax.images)
               for ax in widget.figure.axes), len(widget.figure.axes)


def test_widget_draws_kvlibs_rotation_of_the_chosen_pair():
    widget = widgets.rotation_explorer()
    q, k = widgets.example_query_and_key()
    controls = widget.controls
    assert set(controls) == {"pair", "distance", "key_position", "base"}
    controls["pair"].value, controls["distance"].value, controls["key_position"].value = 2, 5, 7
    plane = widget.state["plane"]
    tip_q, tip_k = arrow_tips(plane)
    np.testing.assert_allclose(tip_q, widgets.rotated(q, 12).reshape(-1, 2)[2])
    np.testing.assert_allclose(tip_k, widgets.rotated(k, 7).reshape(-1, 2)[2])
    assert "Pair 2 of q and k" in plane.get_title()
    assert "m = 12" in plane.get_legend().texts[0].get_text()
    assert "Pair 2 turns 0.1 rad per position (a full turn every 62.83 positions)" in \
        widget.status.value
    curves = widget.state["curves"]
    np.testing.assert_allclose(curves.lines[0].get_ydata(),
                               widgets.scores_by_distance(q, k)[:, 2])
    np.testing.assert_allclose(curves.lines[1].get_ydata(), widgets.scores_by_distance(q, k).sum(1))
    expected = kvlib.attention_scores(widgets.rotated(q, 12)[None, None],
                                      widgets.rotated(k, 7)[None, None])[0, 0, 0]
    assert widget.state["head_score"] == pytest.approx(expected, abs=1e-12)
    assert widget.message.value == ""


def test_moving_the_key_turns_both_arrows_and_keeps_every_score():
    widget = widgets.rotation_explorer(pair=0, distance=4)
    before = widget.state["head_score"], widget.state["pair_score"]
    first_tips = arrow_tips(widget.state["plane"])
    for n in (1, 13, 40, 64):
        widget.controls["key_position"].value = n
        assert (widget.state["head_score"], widget.state["pair_score"]) == pytest.approx(before,
                                                                                        abs=1e-12)
        assert widget.state["difference"] < 1e-12
        assert "the same as with the key at n = 0" in widget.status.value
        assert widget.state["query_position"] == n + 4
    tips = arrow_tips(widget.state["plane"])
    assert not np.allclose(tips[0], first_tips[0])          # the arrows did turn
    angle = [math.atan2(t[1], t[0]) for t in (*tips, *first_tips)]
    between_now = (angle[0] - angle[1]) % (2 * math.pi)
    between_before = (angle[2] - angle[3]) % (2 * math.pi)
    assert between_now == pytest.approx(between_before, abs=1e-9)


def test_the_status_line_is_computed_not_written(monkeypatch):
    widget = widgets.rotation_explorer()
    real = widgets.pair_scores
    monkeypatch.setattr(widgets, "pair_scores", lambda q, k, m, n, base=10000.0:
                        real(q, k, m, n, base) + (1.0 if n == 0 else 0.0))
    widget.controls["key_position"].value = 9
    assert "<b>not</b> the same" in widget.status.value


def test_low_pairs_turn_fast_and_high_pairs_slowly():
    widget = widgets.rotation_explorer()
    speeds = []
    for pair in range(8):
        widget.controls["pair"].value = pair
        speeds.append(widget.state["angle_per_position"])
    assert speeds[0] == pytest.approx(1.0) and np.all(np.diff(speeds) < 0)
    assert "a full turn every 6.28 positions" in widgets.rotation_explorer(pair=0).status.value
    assert "a full turn every 19,869 positions" in widgets.rotation_explorer(pair=7).status.value
    widget.controls["base"].value = 500000.0
    assert widget.state["angle_per_position"] == pytest.approx(500000.0 ** (-14 / 16))


@pytest.mark.parametrize("bad", [0.0, -3.0, 1.0, float("nan"), float("inf")])
def test_a_bad_base_lands_in_the_message_line(bad):
    widget = widgets.rotation_explorer()
    status, score = widget.status.value, widget.state["head_score"]
    widget.controls["base"].value = bad
    assert "rope_base must be a number above 1" in widget.message.value
    assert widget.status.value == status and widget.state["head_score"] == score
    widget.controls["base"].value = 10000.0
    assert widget.message.value == ""


def test_updates_redraw_in_place_without_leaks_or_piling_up():
    widget = widgets.rotation_explorer()
    with no_new_figures():
        count = artist_count(widget)
        for step in range(25):
            widget.controls["pair"].value = step % 8
            widget.controls["distance"].value = (7 * step) % 49
            widget.controls["key_position"].value = (11 * step) % 65
            assert artist_count(widget) == count


def test_draw_rotation_refuses_bad_input_in_words():
    figure = plt.figure()
    q, k = widgets.example_query_and_key()
    with pytest.raises(ValueError, match="same even length"):
        widgets.draw_rotation(figure, q[:3], k[:3], 0, 1, 0)
    with pytest.raises(ValueError, match="pair must be a whole number from 0 to 7"):
        widgets.draw_rotation(figure, q, k, 8, 1, 0)
    with pytest.raises(ValueError, match="distance must be"):
        widgets.draw_rotation(figure, q, k, 0, -1, 0)
    with pytest.raises(ValueError, match="rope_base"):
        widgets.draw_rotation(figure, q, k, 0, 1, 0, base="big")


def test_the_plain_figures_show_kvlibs_numbers():
    fig, ax = plt.subplots()
    image = widgets.draw_angle_table(ax, n_positions=10, dim=8)
    np.testing.assert_allclose(image.get_array(),
                               np.cos(kvlib.rotary_angles(np.arange(10), 8)))
    assert ax.get_xlabel().startswith("pair i") and ax.get_ylabel() == "position"
    figure = plt.figure()
    tables = np.arange(16.0).reshape(4, 4), -np.arange(16.0).reshape(4, 4)
    axes = widgets.draw_score_tables(figure, *tables)
    shown = np.ma.filled(axes[0].images[0].get_array(), np.nan)
    assert np.isnan(shown[0, 1]) and shown[3, 0] == 12.0       # only m >= n is drawn
    assert all(ax.get_xlabel() == "key position n" for ax in axes)


# ---------------------------------------------------------------------------------------------
# Exercise 1: the offset bug
# ---------------------------------------------------------------------------------------------

def continuation(positions_for, use_cache=True, rotate=True):
    """A continuation whose chunk positions are positions_for(P, T)."""
    def continue_chunk(params, ids, cache):
        config = params.config
        P, T = len(cache), len(ids)
        rotary = kvlib.RotaryPositions(positions_for(P, T), config.head_dim,
                                       config.rope_base) if rotate else None
        X = kvlib.embed(np.asarray(ids), params.embedding)
        for index, layer in enumerate(params.layers):
            X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(T, P + T),
                                    cache if use_cache else None, index, rotary=rotary)
        return kvlib.unembed(X, params.embedding)
    return continue_chunk


def reads_len_inside_the_loop(params, ids, cache):
    config = params.config
    T = len(ids)
    S = len(cache) + T
    X = kvlib.embed(np.asarray(ids), params.embedding)
    for index, layer in enumerate(params.layers):
        rotary = kvlib.RotaryPositions(np.arange(len(cache), len(cache) + T), config.head_dim)
        X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(T, S), cache,
                                index, rotary=rotary)
    return kvlib.unembed(X, params.embedding)


WRONG_CONTINUATIONS = [
    (continuation(lambda P, T: np.arange(T)), ["restart at 0", "position len(cache) = 5"]),
    (continuation(lambda P, T: np.zeros(T, dtype=int)), ["turned by angle 0: to position 0"]),
    (continuation(lambda P, T: np.arange(T), rotate=False), ["turned by angle 0",
                                                             "rotary=None"]),
    (continuation(lambda P, T: np.arange(P + 1, P + T + 1)), ["off by one", "sits at 5, not 6",
                                                              "cached ones too"]),
    (continuation(lambda P, T: np.arange(P - 1, P + T - 1)), ["negative position"]),
    (continuation(lambda P, T: np.arange(P + T, P + 2 * T)), ["NEXT token"]),
    (continuation(lambda P, T: np.arange(P + T, P + 2 * T) if T > 1 and P else np.arange(P, P + T)),
     ["NEXT chunk", "starts at len(cache) = 5"]),
    (continuation(lambda P, T: np.arange(P, P + T), use_cache=False), ["the cache should "
                                                                      "hold"]),
    (reads_len_inside_the_loop, ["read after the first layer", "P = len(cache)"]),
    (lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0][-1:], ["shape (5, 12)"]),
    (lambda params, ids, cache: "logits", ["got text"]),
    (lambda params, ids, cache: 1 / 0, ["ZeroDivisionError"]),
    (lambda params, ids: None, ["TypeError"]),
    (lambda params, ids, cache: np.zeros((len(ids), 12)), ["the cache should hold"]),
]


@pytest.mark.parametrize("function, phrases", WRONG_CONTINUATIONS)
def test_continue_checker_diagnoses_each_wrong_continuation(function, phrases):
    not_yet(exercises.check_continue(function), *phrases)


def test_off_by_one_after_the_cache_is_named():
    minus_one = continuation(lambda P, T: np.arange(max(P - 1, 0), max(P - 1, 0) + T))
    not_yet(exercises.check_continue(minus_one), "one after the last cached position")


def test_a_mask_bug_is_not_mistaken_for_a_position_bug():
    def start_aligned_mask(params, ids, cache):
        config = params.config
        P, T = len(cache), len(ids)
        rotary = kvlib.RotaryPositions(np.arange(P, P + T), config.head_dim)
        X = kvlib.embed(np.asarray(ids), params.embedding)
        for index, layer in enumerate(params.layers):
            X = kvlib.decoder_block(X, layer, config.n_heads,
                                    np.tri(T, P + T, dtype=bool), cache, index, rotary=rotary)
        return kvlib.unembed(X, params.embedding)

    not_yet(exercises.check_continue(start_aligned_mask), "kvlib.causal_mask(1, 6)",
            "should be [5]")


@pytest.mark.parametrize("function", [
    continuation(lambda P, T: np.arange(P, P + T)),
    continuation(lambda P, T: list(range(P, P + T))),
    continuation(lambda P, T: np.arange(P, P + T, dtype=np.int32)),
    lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0],
])
def test_continue_checker_accepts_every_right_continuation(function):
    correct(exercises.check_continue(function), "position len(cache)")


def test_continue_checker_wants_a_function():
    not_yet(exercises.check_continue(np.zeros(3)), "should be a function")


# ---------------------------------------------------------------------------------------------
# Exercise 2: the angle of pair 20 at position 8000 in a Llama 3 head
# ---------------------------------------------------------------------------------------------

EXACT_ANGLE = 8000 * 500000.0 ** (-40 / 128)


@pytest.mark.parametrize("answer, phrase", [
    (8000 * 10000.0 ** (-40 / 128), "rope_base 500000"),
    (8000 * 500000.0 ** (-20 / 128), "-2i / dim, not -i / dim"),
    (8000 * 500000.0 ** (-42 / 128), "that is pair 21"),
    (8000 * 500000.0 ** (-38 / 128), "that is pair 19"),
    (math.degrees(EXACT_ANGLE), "degrees"),
    (8000 * 500000.0 ** (-40 / 4096), "not d_model = 4096"),
    (8000 * 500000.0 ** (40 / 128), "exponent is negative"),
    (500000.0 ** (-40 / 128), "multiply by the position"),
    (2 * math.pi / 500000.0 ** (-40 / 128), "wavelength"),
    (1 / 500000.0 ** (-40 / 128), "1 / frequency"),
    (7999 * 500000.0 ** (-40 / 128), "position 7999"),
    (8001 * 500000.0 ** (-40 / 128), "position 8001"),
    (-EXACT_ANGLE, "positive"),
    (round(EXACT_ANGLE, 1), "rounded too far"),
    (round(EXACT_ANGLE), "rounded too far"),
    (EXACT_ANGLE + 0.04, "close but not within"),
    (round(8000 * 10000.0 ** (-40 / 128), 3), "rope_base 500000"),     # rounded wrong answer
    (100.0, "which dim and which base"),
    ("132.484", "one number"),
    ([132.484, 0.537], "one number"),
    (True, "one number"),
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    (10**400, "finite"),
])
def test_angle_checker_diagnoses_each_mistake(answer, phrase):
    not_yet(exercises.check_pair_angle(answer), phrase)


@pytest.mark.parametrize("answer", [
    EXACT_ANGLE, round(EXACT_ANGLE, 3), round(EXACT_ANGLE, 2), np.float32(EXACT_ANGLE),
    np.float64(EXACT_ANGLE), np.array(EXACT_ANGLE), np.array([EXACT_ANGLE]), [EXACT_ANGLE],
    (round(EXACT_ANGLE, 3),), float(kvlib.rotary_angles(np.array([8000]), 128, 500000.0)[0, 20]),
    EXACT_ANGLE % (2 * math.pi), round(EXACT_ANGLE % (2 * math.pi), 3),
    EXACT_ANGLE - 2 * math.pi * 22, EXACT_ANGLE + 2 * math.pi,
])
def test_angle_checker_accepts_the_angle_in_every_form(answer):
    correct(exercises.check_pair_angle(answer))


def test_angle_checker_states_what_the_answer_means():
    correct(exercises.check_pair_angle(EXACT_ANGLE), "132.484", "full turn every 379")
    correct(exercises.check_pair_angle(EXACT_ANGLE % (2 * math.pi)), "same rotation")


# ---------------------------------------------------------------------------------------------
# Exercise 3: which changes keep the scores
# ---------------------------------------------------------------------------------------------

RIGHT = [True, False, False, True, False]


def test_the_truths_are_computed():
    assert exercises.statement_truths() == tuple(RIGHT)
    assert len(exercises.STATEMENTS) == len(exercises.REASONS) == len(RIGHT)


@pytest.mark.parametrize("flipped, phrase", [
    (0, "keeps every distance m - n"),
    (1, "offset bug of exercise 1"),
    (2, "doubles every distance"),
    (3, "the position travels inside the row"),
    (4, "A learned table adds a different row"),
])
def test_keeps_checker_explains_each_wrong_prediction(flipped, phrase):
    answer = list(RIGHT)
    answer[flipped] = not answer[flipped]
    said = "keeps" if answer[flipped] else "changes"
    not_yet(exercises.check_keeps_scores(answer), phrase, "1 of 5 predictions are off",
            f"({flipped + 1}) you said it {said}")


@pytest.mark.parametrize("answer, phrases", [
    ([True] * 5, ["3 of 5", "(2)", "(3)", "(5)"]),
    ([False] * 5, ["2 of 5", "(1)", "(4)"]),
    ([not r for r in RIGHT], ["5 of 5"]),
])
def test_keeps_checker_names_every_wrong_prediction(answer, phrases):
    not_yet(exercises.check_keeps_scores(answer), *phrases)


@pytest.mark.parametrize("answer", [
    RIGHT, tuple(RIGHT), np.array(RIGHT), [int(r) for r in RIGHT],
    np.array(RIGHT, dtype=float), ["keeps", "changes", "changes", "keeps", "changes"],
    ["Yes", "no", "NO", "yes ", "No"], ["true", "false", "false", "true", "false"],
    [np.bool_(r) for r in RIGHT], {i + 1: r for i, r in enumerate(RIGHT)},
])
def test_keeps_checker_accepts_predictions_in_every_form(answer):
    correct(exercises.check_keeps_scores(answer), "all 5 right")


@pytest.mark.parametrize("answer, phrase", [
    (RIGHT[:4], "5 predictions"),
    (RIGHT + [True], "5 predictions"),
    (np.array([RIGHT, RIGHT]), "shape (2, 5)"),
    ({0: True, 1: False}, "keys 1 to 5"),
    (["keeps", "maybe", "changes", "keeps", "changes"], "[2]"),
    ([True, False, 2, True, False], "not True or False"),
    ("TFFTF", "got str"),
    (True, "got bool"),
    ([10**5000, True, False, True, False], "got [a number of about 5,001 digits]"),
], ids=case_id)
def test_keeps_checker_explains_answers_of_the_wrong_form(answer, phrase):
    not_yet(exercises.check_keeps_scores(answer), phrase)


# ---------------------------------------------------------------------------------------------
# On a real model: SmolLM2's two pairings, its measured wrong pairing, its base
# ---------------------------------------------------------------------------------------------

def llama_cpp_permute(rows, n_head):
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py; conversion/llama.py), on rows
    (out, in) as its converter reads them from the hub's checkpoint."""
    return (rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


@pytest.mark.parametrize("layer", [0, 14, 29])
def test_llama_cpps_permute_is_to_interleaved_columns_on_smollm2s_weights(smollm2, layer):
    from kvlib.checkpoints import llama
    block = smollm2.layers[layer]
    for W, n_heads in ((block.Wq, 9), (block.Wk, 3)):
        hub = llama.to_half_columns(W, n_heads)
        assert not np.array_equal(hub, W)
        np.testing.assert_array_equal(llama_cpp_permute(hub.T, n_heads).T, W)
        np.testing.assert_array_equal(llama.to_interleaved_columns(hub, n_heads), W)


@pytest.mark.parametrize("layer, head", [(0, 0), (0, 8), (7, 4), (29, 5)])
def test_both_right_pairings_give_one_heads_scores_and_the_wrong_one_does_not(smollm2, layer, head):
    """The notebook's check, on other heads: a head's scores on real inputs (the layer's
    RMSNorm of the embeddings) with the GGUF's columns and neighbour pairs equal those with
    the hub's order and halves; the GGUF's columns with halves differ."""
    from kvlib.checkpoints import llama
    config, block = smollm2.config, smollm2.layers[layer]
    ids = kvlib.smollm2_tokenizer().encode("def f(x):\n    return x * 2  # twice x")
    X = kvlib.rms_norm(kvlib.embed(np.array(ids), smollm2.embedding), block.ln_1_gain,
                       config.norm_epsilon)
    angles = kvlib.rotary_angles(np.arange(len(ids)), 64, config.rope_base)
    q_columns = slice(64 * head, 64 * head + 64)
    k_columns = slice(64 * (head // 3), 64 * (head // 3) + 64)

    def scores(Wq, Wk, turn):
        q, k = turn(X @ Wq[:, q_columns], angles), turn(X @ Wk[:, k_columns], angles)
        return q @ k.T

    gguf = scores(block.Wq, block.Wk, kvlib.rotate_pairs)
    hub = scores(llama.to_half_columns(block.Wq, 9), llama.to_half_columns(block.Wk, 3),
                 kvlib.rotate_halves)
    wrong = scores(block.Wq, block.Wk, kvlib.rotate_halves)
    largest = np.abs(gguf).max()
    np.testing.assert_allclose(hub, gguf, rtol=0, atol=1e-5 * largest)
    assert np.abs(wrong - gguf).max() > 1e-2 * largest
    assert wrong[0, 0] == pytest.approx(gguf[0, 0], rel=1e-5)     # position 0: angle 0


def test_the_measured_pairing_holds_its_first_predictions_one_by_one(smollm2):
    pairing = kvlib.checkpoints.smollm2.measured()["pairing"]
    first = pairing["first_tokens"]
    assert len(pairing["first_losses"]) == len(pairing["first_wrong_pairing_losses"]) \
        == first - 1 == 63
    ids = kvlib.checkpoints.smollm2.measured()["ids"][:first]
    right = kvlib.next_token_losses(kvlib.forward(smollm2, ids), ids)
    np.testing.assert_allclose(right, pairing["first_losses"], rtol=0, atol=1e-4)
    assert np.mean(pairing["first_wrong_pairing_losses"]) - np.mean(pairing["first_losses"]) \
        < (pairing["wrong_pairing_loss"] - pairing["loss"]) / 2


def test_the_tools_first_predictions_are_what_the_first_tokens_alone_give():
    """tools/measure_smollm2.py's pairing part keeps the first predictions of the whole text;
    a causal model gives the same from the first tokens alone (what notebook 14 recomputes).
    Checked on a random rotary model, in float64."""
    import measure_smollm2 as tool
    params = kvlib.init_params(kvlib.ModelConfig(positions="rotary", context_length=128,
                                                 vocab_size=12))
    ids = np.random.default_rng(5).integers(0, 12, 100).tolist()
    part = tool.run_pairing(params, ids)
    first = ids[:part["first_tokens"]]
    alone = kvlib.next_token_losses(kvlib.forward(params, first), first)
    np.testing.assert_allclose(part["first_losses"], alone, rtol=0, atol=1e-5)
    wrong = kvlib.next_token_losses(
        kvlib.forward(params.with_config(rope_pairing="half"), first), first)
    np.testing.assert_allclose(part["first_wrong_pairing_losses"], wrong, rtol=0, atol=1e-5)
    assert part["loss"] == pytest.approx(
        kvlib.next_token_losses(kvlib.forward(params, ids), ids).mean())


def test_a_base_of_100000_slows_every_pair_but_the_first():
    slow = kvlib.rotary_angles(np.array([1]), 64, 100000.0)[0]
    fast = kvlib.rotary_angles(np.array([1]), 64, 10000.0)[0]
    ratio = fast / slow
    assert ratio[0] == 1 and np.all(np.diff(ratio) > 0)
    assert ratio[-1] == pytest.approx(10 ** (62 / 64))
    assert round(2 * np.pi / slow[-1]) == 438_460 and round(2 * np.pi / fast[-1]) == 47_117
    assert kvlib.SMOLLM2_135M.rope_base == 100000.0 and kvlib.ModelConfig().rope_base == 10000.0
