"""Notebook 12 (a real model: GPT-2's architecture): the notebook run headless, its
constructions proven equal to kvlib on random GPT-2-architecture models (the block, the decode
step at any position, the cache, the bias count), its position widget driven headless on the
stories model, and its exercise checkers with tables of typical wrong answers (each with its
diagnosis) and of valid answers in other forms."""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, code_cells, run_notebook
from strategies import configs, token_lists
from widget_checks import no_new_figures

import kvlib
from kvlib import gpt2
from kvlib.exercises import real_model as exercises
from kvlib.widgets import real_model as widgets

TOLERANCE = 1e-10
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def executed():
    """The notebook's variables, and the text each code cell printed."""
    printed = []
    return run_notebook("real_model", printed=printed), printed


# ---------------------------------------------------------------------------------------------
# The notebook: run headless, its widget cell the only one whose output is not compared
# ---------------------------------------------------------------------------------------------

def test_only_the_widget_cell_is_not_compared():
    for index, cell in enumerate(code_cells("real_model")):
        source, tags = "".join(cell["source"]), cell["metadata"].get("tags", [])
        shows_widget = "position_explorer(" in source and source.rstrip().endswith("explorer")
        assert ("nbval-ignore-output" in tags) == shows_widget, (index, source)


def test_the_notebook_has_no_gpt2_124m_cells_now_that_13_runs_them():
    sources = "".join("".join(cell["source"]) for cell in code_cells("real_model"))
    assert "find_weights" not in sources and "PUBLISHED_PROMPT" not in sources


def test_every_solution_passes_in_the_notebooks_variables(executed):
    assert_solutions_pass(executed[0], exercises, {1: exercises.check_decode_position,
                                                   2: exercises.check_xl_cache})


def test_the_notebooks_broken_step_fails_with_its_diagnosis(executed):
    not_yet(exercises.check_decode_position(executed[0]["decode_step_broken"]), "row 0")


def test_exercise_3_moved_to_notebook_13_as_its_exercise_1():
    assert "len(cache)" in exercises.SOLUTIONS[1]
    assert "exercise 3" not in "".join(exercises.SOLUTIONS.values()).lower()
    with pytest.raises(ValueError, match="no exercise 3"):
        exercises.solution(3)
# ---------------------------------------------------------------------------------------------
# The notebook's constructions equal kvlib's on random GPT-2-architecture models (float64)
# ---------------------------------------------------------------------------------------------

@st.composite
def gpt2_models(draw):
    """(params, config): random sizes, GPT-2's architecture (MHA, learned positions, layer
    norms, biases), seeded random weights with non-trivial gains and biases."""
    config = draw(configs(latent=False, window=False, positions="learned"))
    config = config.replace(norm="layer", bias=True, n_kv_heads=None, mlp="gelu")
    return kvlib.init_params(config, seed=draw(st.integers(0, 10_000))), config


@PROPERTY
@given(gpt2_models(), st.data())
def test_the_block_by_hand_is_kvlibs_decoder_block(executed, model, data):
    params, config = model
    block_by_hand = executed[0]["block_by_hand"]
    T = data.draw(st.integers(1, 10))
    X = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal((T, config.d_model))
    for layer in params.layers:
        np.testing.assert_allclose(
            block_by_hand(X, layer, config.n_heads, config.norm_epsilon),
            kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(T),
                                norm_epsilon=config.norm_epsilon), atol=TOLERANCE)


@PROPERTY
@given(gpt2_models(), st.data())
def test_a_step_at_len_cache_equals_recomputation_and_other_rows_do_not(model, data):
    """The notebook's decode step by hand (exercises.decode_at_position at len(cache)) equals
    kvlib.decode_step and kvlib.forward; so does the exercise's solution."""
    params, config = model
    ids = token_lists(data.draw, config, min_size=2, max_size=12)
    *prompt, token = ids
    scope = {"np": np, "kvlib": kvlib}
    exec(exercises.SOLUTIONS[1], scope)
    full = kvlib.forward(params, ids)[-1:]
    for step in (lambda p, t, c: exercises.decode_at_position(p, t, c, len(c)), scope["answer"],
                 kvlib.decode_step):
        _, cache = kvlib.prefill(params, prompt)
        np.testing.assert_allclose(step(params, token, cache), full, atol=TOLERANCE)
        assert len(cache) == len(ids)


@PROPERTY
@given(gpt2_models(), st.data())
def test_chunks_sit_at_p_to_p_plus_t(model, data):
    params, config = model
    ids = token_lists(data.draw, config, min_size=2, max_size=14)
    cut = data.draw(st.integers(1, len(ids) - 1))
    first, cache = kvlib.prefill(params, ids[:cut])
    second, cache = kvlib.prefill(params, ids[cut:], cache)
    np.testing.assert_allclose(np.vstack([first, second]), kvlib.forward(params, ids),
                               atol=TOLERANCE)


@PROPERTY
@given(gpt2_models(), st.data())
def test_the_cache_holds_the_projections_of_each_layers_input(model, data):
    """'Where the cache sits': K and V of layer l are ln_1(stream_l) @ Wk + bk, @ Wv + bv."""
    params, config = model
    ids = token_lists(data.draw, config, min_size=1, max_size=10)
    _, cache = kvlib.prefill(params, ids)
    X = kvlib.add_positions(kvlib.embed(np.array(ids), params.embedding),
                            params.position_table, np.arange(len(ids)))
    for index, layer in enumerate(params.layers):
        h = kvlib.layer_norm(X, layer.ln_1_gain, layer.ln_1_bias, config.norm_epsilon)
        np.testing.assert_allclose(cache.keys(index), h @ layer.Wk + layer.bk, atol=TOLERANCE)
        np.testing.assert_allclose(cache.values(index), h @ layer.Wv + layer.bv, atol=TOLERANCE)
        X = kvlib.decoder_block(X, layer, config.n_heads, kvlib.causal_mask(len(ids)),
                                norm_epsilon=config.norm_epsilon)
    assert cache.nbytes == kvlib.config_cache_bytes(config, len(ids)) \
        == 2 * config.n_layers * len(ids) * config.d_model * 8


def test_a_saved_checkpoints_c_attn_is_wq_wk_wv_side_by_side(tmp_path):
    params = kvlib.init_params(kvlib.ModelConfig(positions="learned", norm="layer", bias=True))
    tensors = gpt2.read_safetensors(gpt2.save(params, tmp_path) / "model.safetensors")
    layer = params.layers[1]
    np.testing.assert_array_equal(tensors["h.1.attn.c_attn.weight"],
                                  np.hstack([layer.Wq, layer.Wk, layer.Wv]).astype(np.float32))


@PROPERTY
@given(gpt2_models(), st.data())
def test_the_notebooks_step_at_a_position_is_kvlibs(executed, model, data):
    """decode_step_at (the notebook's step by hand) at len(cache) is kvlib.decode_step; at any
    other row it is the exercise's reference step at that row, and differs from forward."""
    params, config = model
    decode_step_at = executed[0]["decode_step_at"]
    ids = token_lists(data.draw, config, min_size=2, max_size=10)
    *prompt, token = ids
    full = kvlib.forward(params, ids)[-1:]
    _, cache = kvlib.prefill(params, prompt)
    np.testing.assert_allclose(decode_step_at(params, token, cache, len(prompt)), full,
                               atol=TOLERANCE)
    position = data.draw(st.integers(0, config.context_length - 1))
    _, cache = kvlib.prefill(params, prompt)
    mine = decode_step_at(params, token, cache, position)
    np.testing.assert_allclose(mine[-1], widgets.step_at_position(params, prompt, token, position),
                               atol=TOLERANCE)


@PROPERTY
@given(gpt2_models())
def test_the_bias_count_is_every_bias_tensor_of_a_saved_checkpoint(executed, model):
    """The notebook's projection_biases + norm_biases count what a GPT-2 checkpoint holds
    under names ending in .bias, whatever the sizes."""
    params, config = model
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        tensors = gpt2.read_safetensors(gpt2.save(params, Path(directory)) / "model.safetensors")
    in_file = sum(array.size for name, array in tensors.items() if name.endswith(".bias"))
    variables = executed[0]
    assert in_file == variables["projection_biases"](config) + variables["norm_biases"](config)


def test_the_story_model_counts_its_layer_norm_biases(executed):
    variables = executed[0]
    assert variables["in_file"] - variables["biases"] == (2 * 4 + 1) * 96 == 864
    assert variables["in_file"] == 4_320


# ---------------------------------------------------------------------------------------------
# The position widget, and the figure before it
# ---------------------------------------------------------------------------------------------

SONG = ("Once upon a time, there was a shy girl named Mia. Mia had a red ball. Mia had a friend "
        "named Marco. Marco had a blue ball. Marco made up a song: bam dong hop")


def test_the_song_figure_shows_the_word_a_wrong_position_writes(executed):
    variables, printed = executed
    assert variables["wrong_word"] == "." and variables["at"][0].max() > 0.99
    song_cell = next(index for index, cell in enumerate(code_cells("real_model"))
                     if "song_prompt = (" in "".join(cell["source"]))
    assert "at position 0: '.' with p = 1.00" in printed[song_cell]


def test_the_explorer_starts_at_len_cache_and_equals_recomputation(story_model):
    params, tokenizer = story_model
    explorer = widgets.position_explorer(params, tokenizer, SONG)
    ids = tokenizer.encode(SONG)
    assert explorer.position.value == len(ids) == explorer.state["position"]
    assert explorer.state["difference"] < widgets.TOLERANCES["float64"]
    assert f"belongs at position {len(ids)}" in explorer.status.value
    assert "equals full recomputation" in explorer.status.value
    ax = explorer.figure.axes[0]
    assert ax.get_ylabel() == "probability" and ax.get_xlabel().startswith("next word")
    assert [t.get_text() for t in ax.get_legend().get_texts()][1].endswith(f"position {len(ids)}")


def test_the_explorer_at_position_0_shows_the_classic_bug(story_model):
    params, tokenizer = story_model
    explorer = widgets.position_explorer(params, tokenizer, SONG)
    explorer.position.value = 0
    ids = tokenizer.encode(SONG)
    token = tokenizer.vocabulary.index("dong")
    _, cache = kvlib.prefill(params, ids)
    wrong = exercises.decode_at_position(params, token, cache, 0)[-1]
    right = kvlib.forward(params, ids + [token])[-1]
    assert explorer.state["difference"] == pytest.approx(widgets.relative_difference(wrong, right))
    assert explorer.state["words"] == {"right": "hop", "step": "."}
    assert "nothing crashes" in explorer.status.value
    assert "the model writes '.' with p = 1.00" in explorer.status.value
    bars = explorer.figure.axes[0].patches
    heights = np.array([bar.get_height() for bar in bars])
    np.testing.assert_allclose(heights.max(), kvlib.softmax(wrong).max())


def test_the_explorer_redraws_in_place_and_takes_a_new_prompt(story_model):
    params, tokenizer = story_model
    explorer = widgets.position_explorer(params, tokenizer, SONG)
    with no_new_figures():
        for position in (0, 41, 43, 255):
            explorer.position.value = position
            assert explorer.state["position"] == position
            assert len(explorer.figure.axes) == 1 and explorer.message.value == ""
            assert explorer.state["difference"] > widgets.TOLERANCES["float64"]
        short = "Once upon a time, there was a shy girl named Mia. Mia had a red ball."
        explorer.prompt.value = short
        assert explorer.position.value == len(tokenizer.encode(short)) == 20
        assert explorer.state["difference"] < widgets.TOLERANCES["float64"]


def test_a_wrong_position_does_not_always_change_the_word(story_model):
    """What the widget's hint and the instructor's guide say: after the short opening, "Mia"
    fed at position 0 is still followed by "had", with other numbers."""
    params, tokenizer = story_model
    explorer = widgets.position_explorer(params, tokenizer, "Once upon a time, there was a shy "
                                         "girl named Mia. Mia had a red ball.")
    explorer.position.value = 0
    assert explorer.state["words"] == {"right": "had", "step": "had"}
    assert explorer.state["difference"] > 0.1 and "the word is even the same" in \
        explorer.status.value


def test_a_bad_prompt_is_said_in_words_and_changes_nothing(story_model):
    params, tokenizer = story_model
    explorer = widgets.position_explorer(params, tokenizer, SONG)
    explorer.prompt.value = "Once upon a zebra"
    assert "unknown word" in explorer.message.value and "zebra" in explorer.message.value
    assert "Waiting for a prompt" in explorer.status.value      # no stale verdict
    explorer.position.value = 3                         # nothing to redraw: it says why
    assert "unknown word" in explorer.message.value
    explorer.prompt.value = "Mia " * 300                # longer than the context
    assert "leave room" in explorer.message.value
    explorer.prompt.value = SONG
    assert explorer.message.value == "" and explorer.position.value == 42


def test_draw_next_words_refuses_rows_that_do_not_match():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError, match="two probability rows"):
        widgets.draw_next_words(ax, list("abc"), np.ones(3) / 3, np.ones(4) / 4, 0)
    assert widgets.top_words(np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.1, 0.8]),
                             count=1) == [0, 2]


# ---------------------------------------------------------------------------------------------
# Exercise 1: the position of a decode step
# ---------------------------------------------------------------------------------------------


def step_with(position_of, use_cache=True, final_norm=True, epsilon=None):
    """A hand-written decode step whose new token sits at position_of(len(cache))."""
    def step(params, token, cache):
        config = params.config
        eps = config.norm_epsilon if epsilon is None else epsilon
        x = kvlib.embed(np.array([token]), params.embedding)
        position = position_of(len(cache))
        if position is not None:
            x = kvlib.add_positions(x, params.position_table, position)
        for index, layer in enumerate(params.layers):
            x = kvlib.decoder_block(x, layer, config.n_heads, cache=cache if use_cache else None,
                                    layer_index=index, norm_epsilon=eps)
        if final_norm:
            x = kvlib.layer_norm(x, params.ln_f_gain, params.ln_f_bias, config.norm_epsilon)
        return kvlib.unembed(x, params.embedding)
    return step


def reads_len_inside_the_loop(params, token, cache):
    config = params.config
    x = kvlib.embed(np.array([token]), params.embedding)
    for index, layer in enumerate(params.layers):
        if index == 1:
            x = x + params.position_table[len(cache)]
        x = kvlib.decoder_block(x, layer, config.n_heads, cache=cache, layer_index=index,
                                norm_epsilon=config.norm_epsilon)
    return kvlib.unembed(kvlib.layer_norm(x, params.ln_f_gain, params.ln_f_bias), params.embedding)


def right_for_short_caches_only(params, token, cache):
    P = len(cache)
    return step_with(lambda n: [n] if P < 7 else [0])(params, token, cache)


WRONG_STEPS = [
    (step_with(lambda P: [0]), ["row 0 of the position table", "sits at 5"]),
    (step_with(lambda P: np.zeros(1, dtype=int)), ["row 0 of the position table"]),
    (step_with(lambda P: [P - 1]), ["the last cached token, P - 1"]),
    (step_with(lambda P: [P + 1]), ["off by one", "not P + 1"]),
    (step_with(lambda P: None), ["no position at all"]),
    (step_with(lambda P: [P], use_cache=False), ["the cache should hold 6 positions"]),
    (step_with(lambda P: [P], final_norm=False), ["not as a wrong row", "ln_f"]),
    (step_with(lambda P: [P], epsilon=0.5), ["not as a wrong row", "norm_epsilon"]),
    (reads_len_inside_the_loop, ["read after the first block", "P = len(cache)"]),
    (right_for_short_caches_only, ["'How are you? I am' (7 positions", "row 0"]),
    (lambda params, token, cache: kvlib.prefill(params, [token], [])[0],
     ["raised TypeError: cache must be a kvlib cache"]),
    (lambda params, token, cache: kvlib.prefill(params, [token])[0],
     ["the cache should hold 6 positions, it holds 5"]),
    (lambda params, token, cache: kvlib.decode_step(params, token, cache)[0],
     ["shape (1, 12), got (12,)"]),
    (lambda params, token, cache: kvlib.forward(params, [0, token]),
     ["shape (1, 12), got (2, 12)", "one row of logits"]),
    (lambda params, token, cache: "logits", ["got text, 'logits'"]),
    (lambda params, token, cache: 1 / 0, ["ZeroDivisionError"]),
    (lambda params, token: None, ["TypeError"]),
    (lambda params, token, cache: np.zeros((1, 12)), ["the cache should hold"]),
]


@pytest.mark.parametrize("function, phrases", WRONG_STEPS)
def test_position_checker_diagnoses_each_wrong_step(function, phrases):
    not_yet(exercises.check_decode_position(function), *phrases)


def test_a_step_right_alone_but_wrong_in_a_generation_is_named():
    calls = []

    def drifting(params, token, cache):
        calls.append(token)
        logits = kvlib.decode_step(params, token, cache)
        if len(calls) > len(exercises.STEP_CASES) + 2:     # the generation's later steps
            logits = logits[:, ::-1].copy()
        return logits

    not_yet(exercises.check_decode_position(drifting), "a generation of 8 tokens")


@pytest.mark.parametrize("function", [
    step_with(lambda P: [P]),
    step_with(lambda P: np.array([P])),
    step_with(lambda P: (P,)),
    step_with(lambda P: np.arange(P, P + 1, dtype=np.int32)),
    lambda params, token, cache: kvlib.decode_step(params, token, cache),
    lambda params, token, cache: kvlib.decode_step(params, token, cache).tolist(),
    lambda params, token, cache: kvlib.decode_step(params, token, cache).astype(np.float32),
    lambda params, token, cache: kvlib.prefill(params, [token], cache)[0],   # a 1-token chunk
])
def test_position_checker_accepts_every_right_step(function):
    correct(exercises.check_decode_position(function), "position len(cache)")


def test_position_checker_wants_a_function():
    not_yet(exercises.check_decode_position(np.zeros(3)), "should be a function")


# ---------------------------------------------------------------------------------------------
# Exercise 2: GPT-2 XL's cache
# ---------------------------------------------------------------------------------------------

XL = 2 * 48 * 1024 * 1600 * 2


@pytest.mark.parametrize("answer, phrase", [
    (XL // 2, "K and V"),
    (XL * 3 // 2, "Q is never cached"),
    (XL * 2, "float32"),
    (XL // 1024, "one token's K and V"),
    (2 * 48 * 1000 * 1600 * 2, "1000 tokens"),
    (XL * 25, "25 heads"),
    (2 * 48 * 1024 * 64 * 2, "one head's 64 columns"),
    (2 * 12 * 1024 * 1600 * 2, "GPT-2 small's; XL has 48"),
    (2 * 48 * 1024 * 768 * 2, "768 is GPT-2 small's d_model"),
    (2 * 1 * 1024 * 1600 * 2, "one layer"),
    (300, "MiB"),
    (314, "MB"),
    (XL + 1000, "close to the answer"),
    (2 * 48 * 1023 * 1600 * 2, "1023 tokens, one short"),
    (2 * 48 * 1025 * 1600 * 2, "1025 tokens, one too many"),
    (12345, "multiply 2 (K and V)"),
    (XL + 0.5, "not a whole number"),
    ("314572800", "not text: write 314572800 without quotes"),
    ("3.1e8", "not text: write 3.1e8 without quotes"),
    ("a lot", "not text (got 'a lot')"),
    (True, "True (a bool)"),
    ([XL, XL], "several"),
    (float("nan"), "got nan"),
    (10**400, "digits"),
])
def test_xl_checker_diagnoses_each_mistake(answer, phrase):
    not_yet(exercises.check_xl_cache(answer), phrase)


@pytest.mark.parametrize("answer", [
    XL, float(XL), np.int64(XL), np.float64(XL), np.array(XL), 3.145728e8, 314_572_800.0,
    2 * 48 * 1024 * 1600 * 2, 300 * 2**20, [XL], np.array([XL]), (float(XL),),
])
def test_xl_checker_accepts_the_bytes_in_every_form(answer):
    correct(exercises.check_xl_cache(answer), "314,572,800 bytes", "300 MiB")
