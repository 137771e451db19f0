"""Notebook 08 (KV-cached decode): its decode explorer driven headless (each click grows the
cache by one row, the strips are the newest token's real weights, the check line is computed;
nothing leaks), and its exercise checkers, with tables of typical wrong answers (each with its
diagnosis) and of valid answers in other forms, the wrong generation loops among them; the
published solutions run in the notebook's own variables, its broken chunk fails, and every
cell can be run twice."""

import re

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import correct, not_yet
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import assert_check_line_is_computed, no_new_figures, text_of

import kvlib
from kvlib import plots
from kvlib.exercises import kv_cached_decode as exercises
from kvlib.widgets import kv_cached_decode as widgets

TOKENIZER = kvlib.ToyTokenizer()
PARAMS = kvlib.init_params()
ARTICLE_IDS = TOKENIZER.encode(kvlib.ARTICLE_PROMPT)


# ---------------------------------------------------------------------------------------------
# The decode explorer: decode one token at a time
# ---------------------------------------------------------------------------------------------

def cache_box_rows(widget):
    """Rows of the K box drawn in the cache diagram, read from its shape label and patches."""
    cache_ax = widget.figure.axes[0]
    shapes = {t.get_text() for t in cache_ax.texts if t.get_text().startswith("(")}
    assert len(shapes) == 1, shapes
    rows, columns = (int(n) for n in re.findall(r"\d+", shapes.pop()))
    new_color = matplotlib.colors.to_rgb(plots.NEW_ROWS_COLOR)
    new = [p for p in cache_ax.patches if np.allclose(p.get_facecolor()[:3], new_color)]
    outline = [p for p in cache_ax.patches if not p.get_fill()]
    assert len(outline) == 2 and len(new) == 2        # a K box and a V box
    assert new[0].get_height() * rows == pytest.approx(outline[0].get_height() * len_new(widget))
    return rows, columns


def len_new(widget):
    legend = widget.figure.axes[0].get_legend()
    return int(re.search(r"\((\d+)\)", legend.texts[1].get_text()).group(1))


def positions_in_status(widget):
    return int(re.search(r"Cache holds (\d+) positions", widget.status.value).group(1))


def test_starts_from_the_prefilled_prompt(article_ids):
    widget = widgets.decode_explorer()
    assert widget.decode.description == "Decode next token"
    assert widget.reset.description == "Reset"
    assert positions_in_status(widget) == 5
    assert cache_box_rows(widget) == (5, 4) and len_new(widget) == 5
    assert "prefill equals full recomputation" in widget.check.value
    assert widget.sequence() == article_ids and not widget.decode.disabled


def test_three_clicks_grow_the_cache_by_three(params, article_ids):
    widget = widgets.decode_explorer()
    for _ in range(3):
        widget.decode.click()
    assert positions_in_status(widget) == 8
    status = text_of(widget.status.value)
    assert "Cache holds 8 positions (K and V of shape (8, 4) per layer). Generated: I am you you" \
        in status
    assert re.fullmatch(r"decode_step equals full recomputation: the logits differ by "
                        r"\d(e-\d+)? of their size, below 1e-10", widget.check.value), \
        widget.check.value
    assert cache_box_rows(widget) == (8, 4) and len_new(widget) == 1
    assert widget.sequence() == article_ids + [5, 2, 1] and len(widget.cache()) == 8
    # the strips are the newest token's real attention weights, per head, over all 8 positions
    _, cache = kvlib.prefill(params, article_ids)
    for token in (5, 2):
        kvlib.decode_step(params, token, cache)
    recorded = []
    kvlib.decode_step(params, 1, cache, record_attention=recorded)
    strips = [np.asarray(ax.images[0].get_array()) for ax in widget.figure.axes[1:3]]
    assert len(strips) == 2
    for head, strip in enumerate(strips):
        np.testing.assert_allclose(strip, recorded[0][head, -1:, :])
    labels = [t.get_text() for t in widget.figure.axes[1].get_xticklabels()]
    assert labels == ["<bos>", "How", "are", "you", "?", "I", "am", "you"]
    widget.layer.value = 2
    np.testing.assert_allclose(np.asarray(widget.figure.axes[1].images[0].get_array()),
                               recorded[2][0, -1:, :])
    assert positions_in_status(widget) == 8             # switching layers decodes nothing


def test_reset_returns_to_the_prompt(article_ids):
    widget = widgets.decode_explorer()
    for _ in range(4):
        widget.decode.click()
    widget.reset.click()
    assert positions_in_status(widget) == 5 and cache_box_rows(widget) == (5, 4)
    assert widget.sequence() == article_ids and len(widget.cache()) == 5
    widget.decode.click()
    assert positions_in_status(widget) == 6


def test_the_check_line_is_computed_not_written(monkeypatch):
    widget = widgets.decode_explorer()
    assert_check_line_is_computed(monkeypatch, widget, widget.decode,
                                  "differs from full recomputation", "equals full recomputation")


def test_filling_the_context_disables_the_button_without_raising():
    widget = widgets.decode_explorer()
    with no_new_figures():
        for _ in range(30):                   # 27 clicks fill the 32 positions; 3 more do nothing
            widget.decode.click()
    assert widget.decode.disabled
    assert positions_in_status(widget) == 32 and len(widget.cache()) == 32
    assert "context is full" in widget.status.value
    assert cache_box_rows(widget) == (32, 4)
    assert widget.message.value == ""
    widget.reset.click()
    assert not widget.decode.disabled and positions_in_status(widget) == 5


def test_prompt_box(article_ids):
    widget = widgets.decode_explorer()
    widget.prompt.value = "I am"
    assert positions_in_status(widget) == 3 and "Generated:" in widget.status.value
    widget.decode.click()
    assert positions_in_status(widget) == 4
    widget.prompt.value = "I am yu"
    assert "unknown word(s) ['yu']" in widget.message.value
    assert "Decoding is paused" in widget.message.value
    assert positions_in_status(widget) == 4             # nothing changed
    assert widget.decode.disabled                       # the box's text is not what decodes
    widget.decode.click()
    assert positions_in_status(widget) == 4
    widget.reset.click()                                # the box still cannot be read
    assert widget.decode.disabled and "unknown word" in widget.message.value
    widget.prompt.value = ""                            # BOS alone: one position
    assert "Cache holds 1 position (" in widget.status.value and not widget.decode.disabled
    widget.prompt.value = " ".join(["you"] * 31)        # BOS + 31 = the whole context
    assert positions_in_status(widget) == 32 and widget.decode.disabled
    widget.decode.click()                               # disabled: nothing happens, no error
    assert positions_in_status(widget) == 32


def test_strips_have_a_scale_that_shows_their_spread():
    widget = widgets.decode_explorer()
    for _ in range(27):                   # 32 positions: weights near 1/32
        widget.decode.click()
    strips = widget.figure.axes[1:3]
    weights = np.vstack([np.asarray(ax.images[0].get_array()) for ax in strips])
    for ax in strips:
        low, high = ax.images[0].get_clim()
        assert low == 0.0 and high == pytest.approx(weights.max()) and high < 0.5
    colorbar = widget.figure.axes[-1]
    assert "attention weight" in colorbar.get_ylabel()
    titles = [ax.get_title() for ax in strips]
    assert titles == [f"layer 0, head {h}: the newest query over all 32 cached positions"
                      for h in (0, 1)]


def test_tolerance_is_relative_to_the_logits():
    logits = np.array([[100.0, -50.0]])
    assert widgets.relative_difference(logits + 1e-9, logits) == pytest.approx(1e-11)
    assert widgets.TOLERANCE == 1e-10


def test_draw_decode_state_checks_its_input():
    figure = plt.figure()
    with pytest.raises(ValueError, match="key labels"):
        widgets.draw_decode_state(figure, 5, 1, np.ones((2, 6)) / 6, "I", ["a"] * 5)

# ---------------------------------------------------------------------------------------------
# Exercises 1: a decode step's weights; 2: chunked prefill; 3: the generation loop
# ---------------------------------------------------------------------------------------------

# ------------------------------------------------------------------ 08 ex. 1: a step's weights

def decode_pieces():
    _, cache = kvlib.prefill(PARAMS, TOKENIZER.encode(exercises.EXERCISE1_CACHED))
    x = kvlib.embed(np.array([exercises.EXERCISE1_TOKEN]), PARAMS.embedding)
    q, k, _ = kvlib.project_qkv(x, PARAMS.layers[0])
    return kvlib.split_heads(q, 2), cache.keys(0), k


QH, CACHED_KEYS, NEW_K = decode_pieces()
KH = kvlib.split_heads(np.vstack([CACHED_KEYS, NEW_K]), 2)
RAW = QH @ KH.swapaxes(-1, -2)
EX08_1_RIGHT = kvlib.softmax(RAW / np.sqrt(2))


def article_step():
    _, cache = kvlib.prefill(PARAMS, ARTICLE_IDS)
    recorded = []
    kvlib.decode_step(PARAMS, 5, cache, record_attention=recorded)
    return recorded[0]


EX08_1_WRONG = [
    (kvlib.softmax(RAW), "not scaled"),
    (RAW / np.sqrt(2), "scores, not weights"),
    (kvlib.softmax(RAW / np.sqrt(2), axis=1), "wrong axis"),
    (kvlib.attention_weights(QH, kvlib.split_heads(CACHED_KEYS, 2)), "attends to itself"),
    (article_step(), "the notebook's step"),
    (EX08_1_RIGHT[0], "every head"),
    (np.full((2, 7, 7), 1 / 7), "7 query rows"),
    (kvlib.attention_weights(QH, KH, np.tri(1, 7, dtype=bool)), "aligned to the start"),
    (kvlib.attention_weights(QH, KH, np.tril(np.ones((1, 7), dtype=bool))),
     "aligned to the start"),
    (np.full((2, 1, 7), 1 / 7), "not the right values"),
    (np.full((2, 1, 6), 1 / 6), "expected (2, 1, 7)"),
    (np.full((2, 1, 7), "w"), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX08_1_WRONG)
def test_decode_weights_wrong_answers(answer, diagnosis):
    not_yet(exercises.check_decode_weights(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX08_1_RIGHT, EX08_1_RIGHT.tolist(),
                                    np.round(EX08_1_RIGHT, 3), EX08_1_RIGHT.astype(np.float32)])
def test_decode_weights_valid_forms(answer):
    correct(exercises.check_decode_weights(answer))


def test_decode_weights_equal_what_decode_step_records():
    _, cache = kvlib.prefill(PARAMS, TOKENIZER.encode(exercises.EXERCISE1_CACHED))
    recorded = []
    kvlib.decode_step(PARAMS, exercises.EXERCISE1_TOKEN, cache, record_attention=recorded)
    correct(exercises.check_decode_weights(recorded[0]))


# ------------------------------------------------------------------ 08 ex. 2: chunked prefill

def chunk_with(mask_for, use_cache=True):
    """A chunked prefill whose mask is mask_for(T_new, S) (None: no mask)."""
    def prefill_chunk(params, ids, cache):
        T_new, S = len(ids), len(cache) + len(ids)
        X = kvlib.embed(np.asarray(ids), params.embedding)
        for index, layer in enumerate(params.layers):
            X = kvlib.decoder_block(X, layer, 2, mask_for(T_new, S),
                                    cache if use_cache else None, index)
        return kvlib.unembed(X, params.embedding)
    return prefill_chunk


@pytest.mark.parametrize("function, diagnosis", [
    (chunk_with(lambda T, S: np.tril(np.ones((T, S), dtype=bool))), "aligned to the end"),
    (chunk_with(lambda T, S: None), "no causal mask among them"),
    (chunk_with(lambda T, S: kvlib.causal_mask(T)), "one column per position"),
    (chunk_with(lambda T, S: kvlib.causal_mask(T), use_cache=False), "the cache should hold"),
    (lambda params, ids, cache: None, "shape (3, 12)"),
    (lambda params, ids, cache: "logits", "got str"),
    (lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0][-1:], "one row per new"),
    ("prefill", "should be a function"),
])
def test_chunked_prefill_wrong_answers(function, diagnosis):
    not_yet(exercises.check_chunked_prefill(function), diagnosis)


@pytest.mark.parametrize("function", [
    chunk_with(kvlib.causal_mask),
    chunk_with(lambda T, S: np.tri(T, S, k=S - T, dtype=bool)),
    lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0],
    lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0].tolist(),
])
def test_chunked_prefill_valid_forms(function):
    correct(exercises.check_chunked_prefill(function))


# ------------------------------------------------------------------ 08 ex. 3: generation loop

def loop_from_kvlib(params, ids, n):
    logits, cache = kvlib.prefill(params, ids)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n:
        new.append(int(np.argmax(kvlib.decode_step(params, new[-1], cache)[-1])))
    return new


def loop_with_direct_imports(params, ids, n):
    from kvlib import decode_step, prefill
    logits, cache = prefill(params, ids)
    new = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        new.append(int(decode_step(params, new[-1], cache)[-1].argmax()))
    return new


def loop_with_chunks_of_one(params, ids, n):
    logits, cache = kvlib.prefill(params, ids, last_only=True)
    new = [kvlib.choose_next_token(logits[-1])]
    while len(new) < n:
        logits, cache = kvlib.prefill(params, [new[-1]], cache)
        new.append(kvlib.choose_next_token(logits[-1]))
    return np.array(new)


def loop_one_step_too_many(params, ids, n):
    logits, cache = kvlib.prefill(params, ids)
    token, new = int(np.argmax(logits[-1])), []
    for _ in range(n):
        new.append(token)
        token = int(np.argmax(kvlib.decode_step(params, token, cache)[-1]))
    return new


def prefills_every_step(params, ids, n):
    logits, _ = kvlib.prefill(params, ids)
    new = [int(np.argmax(logits[-1]))]
    while len(new) < n:
        _, cache = kvlib.prefill(params, ids)   # a fresh cache: the generated tokens are lost
        new.append(int(np.argmax(kvlib.decode_step(params, new[-1], cache)[-1])))
    return new


def feeds_last_prompt_token_again(params, ids, n):
    _, cache = kvlib.prefill(params, ids)
    token, new = ids[-1], []
    for _ in range(n):
        token = int(np.argmax(kvlib.decode_step(params, token, cache)[-1]))
        new.append(token)
    return new


def recomputes_with_prefill(params, ids, n):
    new = []
    for _ in range(n):
        logits, _ = kvlib.prefill(params, list(ids) + new)
        new.append(int(np.argmax(logits[-1])))
    return new


def the_notebooks_params(params, ids, n):
    return loop_from_kvlib(PARAMS, ids, n)


@pytest.mark.parametrize("function, diagnosis", [
    (lambda params, ids, n: list(ids) + kvlib.generate(params, ids, n), "starts with the prompt"),
    (feeds_last_prompt_token_again, "twice"),
    (prefills_every_step, "prefills the 5-token prompt into a fresh cache at every step"),
    (lambda params, ids, n: kvlib.generate(params, ids, n, use_cache=False),
     "the whole sequence again"),
    (recomputes_with_prefill, "the whole sequence again"),
    (lambda params, ids, n: kvlib.generate(params, ids, n), "through kvlib.generate"),
    (kvlib.generate, "through kvlib.generate"),
    (lambda params, ids, n: kvlib.generate(params, ids, n)[:-1], "asked for"),
    (lambda params, ids, n: [0] * n, "never ran the model"),
    (the_notebooks_params, "never ran the model on the params it was given"),
    (lambda params, ids, n: 1 / 0, "ZeroDivisionError"),
    (lambda params, ids, n: "I am", "a list of token ids"),
    (np.zeros(3), "should be a function"),
])
def test_generation_loop_wrong_answers(function, diagnosis):
    not_yet(exercises.check_generation_loop(function), diagnosis)


@pytest.mark.parametrize("function", [loop_from_kvlib, loop_with_direct_imports,
                                      loop_with_chunks_of_one, loop_one_step_too_many])
def test_generation_loop_valid_forms(function):
    correct(exercises.check_generation_loop(function), "one position per new token")


def test_generation_loop_tells_the_wrong_loops_apart_by_their_tokens():
    """On the checker's first prompts, the two classic wrong loops choose other tokens, so
    the token comparison alone catches them (the work count is a second check)."""
    text, n = exercises.GENERATION_CASES[0]
    ids = TOKENIZER.encode(text)
    right = kvlib.generate(PARAMS, ids, n, use_cache=False)
    assert prefills_every_step(PARAMS, ids, n) != right
    assert feeds_last_prompt_token_again(PARAMS, ids, n) != right
    assert kvlib.decode_step.__name__ == "decode_step"      # nothing was monkeypatched

# ---------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------

def test_every_solution_passes_in_the_notebooks_variables():
    assert_solutions_pass(run_notebook("kv_cached_decode"), exercises,
                          {1: exercises.check_decode_weights, 2: exercises.check_chunked_prefill,
                           3: exercises.check_generation_loop})


def test_the_notebooks_broken_chunk_fails_with_its_diagnosis():
    notebook = run_notebook("kv_cached_decode")
    not_yet(exercises.check_chunked_prefill(notebook["prefill_chunk_broken"]),
            "aligned to the end")


def test_every_cell_can_be_run_twice_in_a_row():
    """Students re-run cells: each code cell, run a second time at once, must neither fail
    nor leave a different state for the cells after it (a cache that grew twice)."""
    assert run_notebook("kv_cached_decode", each_twice=True)["answer"] is ...
