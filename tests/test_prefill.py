"""Notebook 07 (prefill): its prefill explorer driven headless (the cache of a prompt layer by
layer; bad text explained, not raised; nothing leaks), and its exercise checkers, with tables
of typical wrong answers (each with its diagnosis) and of valid answers in other forms, the
serve function's kinds among them; the published solutions run in the notebook's own
variables, its broken serve fails, and every cell can be run twice."""

import numpy as np
import pytest
from checker_cases import MORE_ODD_ANSWERS, correct, not_yet, odd_answers
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import no_new_figures, text_of

import kvlib
from kvlib.exercises import prefill as exercises
from kvlib.widgets import prefill as widgets

TOKENIZER = kvlib.ToyTokenizer()
PARAMS = kvlib.init_params()
ARTICLE_IDS = TOKENIZER.encode(kvlib.ARTICLE_PROMPT)


# ---------------------------------------------------------------------------------------------
# The prefill explorer: prefill a prompt, look at the cache
# ---------------------------------------------------------------------------------------------

def heatmaps(widget):
    return [np.asarray(ax.images[0].get_array()) for ax in widget.axes]


def test_shows_the_article_prompts_cache(params, article_ids):
    widget = widgets.prefill_explorer()
    status = text_of(widget.status.value)
    assert "Prefilled 5 tokens in one pass: <bos> How are you ?" in status
    assert "K and V of shape (5, 4) in each of the 3 layers: 960 bytes" in status
    assert 'First predicted token: 5 ("I"), probability 0.359' in status
    _, cache = kvlib.prefill(params, article_ids)
    keys, values = heatmaps(widget)
    np.testing.assert_allclose(keys, cache.keys(0))
    np.testing.assert_allclose(values, cache.values(0))
    labels = [t.get_text() for t in widget.axes[0].get_yticklabels()]
    assert labels == ["<bos>", "How", "are", "you", "?"]


def test_layer_dropdown_shows_that_layers_cache(params, article_ids):
    widget = widgets.prefill_explorer()
    _, cache = kvlib.prefill(params, article_ids)
    widget.layer.value = 2
    keys, values = heatmaps(widget)
    np.testing.assert_allclose(keys, cache.keys(2))
    np.testing.assert_allclose(values, cache.values(2))
    assert "Layer 2" in widget.figure.get_suptitle()
    assert widget.axes[0].get_title() == "K (5, 4)" and widget.axes[1].get_title() == "V (5, 4)"


def test_a_new_prompt_is_prefilled(params):
    widget = widgets.prefill_explorer()
    first_rows = heatmaps(widget)[0].copy()
    widget.prompt.value = "How are you? I am fine."
    assert "Prefilled 9 tokens" in widget.status.value
    keys = heatmaps(widget)[0]
    assert keys.shape == (9, 4)
    np.testing.assert_allclose(keys[:5], first_rows)    # causal: later text changes no row
    assert len(widget.cache()) == 9
    widget.prompt.value = ""                            # only BOS: still a valid prompt
    assert "Prefilled 1 token in one pass" in widget.status.value


def test_bad_text_is_explained_not_raised():
    widget = widgets.prefill_explorer()
    status = widget.status.value
    widget.prompt.value = "How are yu"
    assert "unknown word(s) ['yu']" in widget.message.value
    assert widget.status.value == status                # the last good prompt stays on show
    assert "still that of the last prompt that worked: &lt;bos&gt; How are you ?" \
        in widget.message.value
    widget.prompt.value = "<script>"
    assert "<script" not in widget.message.value and "&lt;" in widget.message.value
    widget.prompt.value = " ".join(["you"] * 40)
    assert "32" in widget.message.value                 # longer than the context
    widget.prompt.value = "I am fine"
    assert widget.message.value == "" and "Prefilled 4 tokens" in widget.status.value


def test_no_figure_leaks():
    widget = widgets.prefill_explorer()
    with no_new_figures():
        for step in range(30):
            widget.layer.value = step % 3
            widget.prefill.click()
            widget.prompt.value = ["How are you?", "I am", "yu", "good"][step % 4]

# ---------------------------------------------------------------------------------------------
# Exercises 1: layer 2's keys; 2: the cache's bytes; 3: one server cache
# ---------------------------------------------------------------------------------------------

# ------------------------------------------------------------------ 07 ex. 1: layer 2's keys

def layer_inputs(ids, mask=True):
    X = kvlib.embed(np.array(ids), PARAMS.embedding)
    inputs = [X]
    for layer in PARAMS.layers:
        inputs.append(kvlib.decoder_block(inputs[-1], layer, 2,
                                          kvlib.causal_mask(len(ids)) if mask else None))
    return inputs


EX07_IDS = TOKENIZER.encode(exercises.EXERCISE1_PROMPT)
X07 = layer_inputs(EX07_IDS)
W2 = PARAMS.layers[2]
EX07_1_RIGHT = X07[2] @ W2.Wk
EX07_1_WRONG = [
    (X07[0] @ W2.Wk, "the embeddings"),
    (X07[1] @ W2.Wk, "block 0's output X1"),
    (X07[3] @ W2.Wk, "block 2's output X3"),
    (X07[2] @ PARAMS.layers[0].Wk, "layer 0's Wk"),
    (X07[2] @ PARAMS.layers[1].Wk, "layer 1's Wk"),
    (X07[2] @ W2.Wq, "queries"),
    (X07[2] @ W2.Wv, "values"),
    (layer_inputs(EX07_IDS, mask=False)[2] @ W2.Wk, "without the causal mask"),
    (layer_inputs(ARTICLE_IDS)[2] @ W2.Wk, "How are you?"),
    (layer_inputs(EX07_IDS[1:])[2] @ W2.Wk, "BOS token is missing"),
    (X07[2], "not the right values"),
    (EX07_1_RIGHT[:, :2], "shape (4, 4)"),
    (np.full((4, 4), "k"), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX07_1_WRONG)
def test_layer_keys_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_layer_keys(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX07_1_RIGHT, EX07_1_RIGHT.tolist(), np.round(EX07_1_RIGHT, 3),
                                    EX07_1_RIGHT.astype(np.float32)])
def test_layer_keys_valid_forms(answer):
    correct(exercises.check_layer_keys(answer))


def test_layer_keys_equal_a_real_cache():
    _, cache = kvlib.prefill(PARAMS, EX07_IDS)
    correct(exercises.check_layer_keys(cache.keys(2)))


# ------------------------------------------------------------------ 07 ex. 2: cache bytes

@pytest.mark.parametrize("answer, diagnosis", [
    (960, "multiply by 2"), (640, "one layer"), (3840, "4 bytes"), (2880, "queries"),
    (15360, "bits"), (480, "cached numbers"), (3072, "32 positions"), (1000, "is not it"),
    ("1920", "a number of bytes"), (1920.5, "not a whole number"), ([1920, 1920], "several"),
])
def test_cache_bytes_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_cache_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [1920, 1920.0, 1.92e3, np.int64(1920), np.float32(1920),
                                    np.array(1920), [1920], np.array([1920])])
def test_cache_bytes_valid_forms(answer):
    correct(exercises.check_cache_bytes(answer))


def test_cache_bytes_answer_is_a_real_cache():
    config = kvlib.ModelConfig(dtype="float32")
    _, cache = kvlib.prefill(kvlib.init_params(config), [0] * 20)
    correct(exercises.check_cache_bytes(cache.nbytes))


# ------------------------------------------------------------------ 07 ex. 3: one server cache

def serving(kind, capacity=None):
    """A serve function of the given kind over its own server cache: (serve, server_cache)."""
    server_cache = kvlib.KVCache(PARAMS.config, capacity=capacity)
    other = {"cache": kvlib.KVCache(PARAMS.config)}

    def prefilled(ids):
        return kvlib.prefill(PARAMS, ids, server_cache)[0]

    kinds = {
        "never resets": lambda ids: prefilled(ids)[-1],
        "resets first": lambda ids: (server_cache.reset(), prefilled(ids)[-1])[1],
        "resets after": lambda ids: (prefilled(ids)[-1], server_cache.reset())[0],
        "resets before and after": lambda ids: (server_cache.reset(), prefilled(ids)[-1],
                                                server_cache.reset())[1],
        "returns a list": lambda ids: (server_cache.reset(), list(prefilled(ids)[-1]))[1],
        "returns (1, V)": lambda ids: (server_cache.reset(), prefilled(ids)[-1:])[1],
        "a new cache per request": lambda ids: kvlib.prefill(PARAMS, ids)[0][-1],
        "forward": lambda ids: kvlib.forward(PARAMS, ids)[-1],
        "another cache, reset": lambda ids: (other["cache"].reset(),
                                             kvlib.prefill(PARAMS, ids, other["cache"])[0][-1])[1],
        "all rows": lambda ids: (server_cache.reset(), prefilled(ids))[1],
        "first row": lambda ids: (server_cache.reset(), prefilled(ids)[0])[1],
        "raises": lambda ids: 1 / 0,
        "a word": lambda ids: "I",
    }
    return kinds[kind], server_cache


@pytest.mark.parametrize("kind, capacity, diagnosis", [
    ("never resets", None, "request 1 ('How are you?') differs"),
    ("never resets", 8, "filled up"),
    ("resets after", None, "request 1 ('How are you?') differs"),
    ("a new cache per request", None, "server_cache is never used"),
    ("forward", None, "server_cache is never used"),
    ("another cache, reset", None, "server_cache is never used"),
    ("all rows", None, "got shape (5, 12)"),
    ("first row", None, "first row"),
    ("raises", None, "ZeroDivisionError"),
    ("a word", None, "got str"),
])
def test_serve_wrong_answers(kind, capacity, diagnosis):
    serve, server_cache = serving(kind, capacity)
    not_yet(exercises.check_serve(serve, server_cache), diagnosis)


@pytest.mark.parametrize("kind", ["resets first", "resets before and after", "returns a list",
                                  "returns (1, V)"])
def test_serve_valid_forms(kind):
    serve, server_cache = serving(kind)
    correct(exercises.check_serve(serve, server_cache), "server_cache")


def test_serve_says_how_stale_the_cache_was():
    serve, server_cache = serving("never resets")
    kvlib.prefill(PARAMS, TOKENIZER.encode("How are you? I am fine"), server_cache)
    not_yet(exercises.check_serve(serve, server_cache), "already held 8 positions")
    serve, server_cache = serving("never resets")
    not_yet(exercises.check_serve(serve, server_cache), "first served 'good and you'",
            "it held 4 positions")


def test_serve_needs_the_cache_itself():
    serve, _ = serving("resets first")
    not_yet(exercises.check_serve(serve), "check_serve(answer, server_cache)")
    not_yet(exercises.check_serve(serve, "server_cache"), "KVCache")
    not_yet(exercises.check_serve(serve, kvlib.KVCache(kvlib.ModelConfig(d_model=8))),
            "another model")
    not_yet(exercises.check_serve(np.zeros(12)), "should be a function")


@pytest.mark.parametrize("label, value", odd_answers() + MORE_ODD_ANSWERS,
                         ids=[label for label, _ in odd_answers() + MORE_ODD_ANSWERS])
def test_serve_refuses_an_odd_server_cache(label, value):
    not_yet(exercises.check_serve(serving("resets first")[0], value))


# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("prefill"), exercises,
                          {1: exercises.check_layer_keys, 2: exercises.check_cache_bytes,
                           3: exercises.check_serve}, arguments={3: ["server_cache"]})


def test_the_notebooks_broken_serve_fails_with_its_diagnosis():
    notebook = run_notebook("prefill")     # its own: the solutions change server_cache
    # the notebook's demo already used server_cache: even request 1 sees earlier prompts
    not_yet(exercises.check_serve(notebook["serve_broken"], notebook["server_cache"]),
            "request 1 ('How are you?') differs", "already held 9 positions",
            "Served again, the same prompt got a different answer", "cache.reset()")


def test_every_cell_can_be_run_twice_in_a_row():
    """Students re-run cells: each code cell, run a second time at once, must neither fail
    nor leave a different state for the cells after it (a cache that grew twice)."""
    assert run_notebook("prefill", each_twice=True)["answer"] is ...
