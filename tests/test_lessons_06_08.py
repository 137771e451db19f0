"""Notebooks 06-08 (logits, prefill, cached decode): their widgets, driven headless as a
student would drive them, and their exercise checkers, with wrong answers and with the
solutions executed in the notebooks' own variables."""

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvlib  # noqa: E402
from kvlib import plots  # noqa: E402
from kvlib.exercises import lesson06 as ex06  # noqa: E402
from kvlib.exercises import lesson07 as ex07  # noqa: E402
from kvlib.exercises import lesson08 as ex08  # noqa: E402
from kvlib.widgets import lesson06 as w06  # noqa: E402
from kvlib.widgets import lesson07 as w07  # noqa: E402
from kvlib.widgets import lesson08 as w08  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def params():
    return kvlib.init_params()


@pytest.fixture(scope="module")
def ids():
    return kvlib.ToyTokenizer().encode(kvlib.ARTICLE_PROMPT)


@pytest.fixture(scope="module")
def last_logits(params, ids):
    return kvlib.forward(params, ids)[-1]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bar_heights(ax):
    return np.array([bar.get_height() for bar in ax.containers[0]])


def text_of(html):
    """An HTML string as the words a reader sees."""
    return re.sub(r"<[^>]+>", " ", html).replace("&lt;", "<").replace("&gt;", ">")


# ---------------------------------------------------------------------------------------------
# Widget of notebook 06: temperature, top-k, samples
# ---------------------------------------------------------------------------------------------

def test_06_starts_at_temperature_1_without_a_cut(last_logits):
    widget = w06.next_token_explorer()
    assert widget.temperature.description == "temperature"
    assert widget.temperature.value == 1.0 and widget.top_k.value == 12
    assert widget.sample.description == "sample"
    np.testing.assert_allclose(bar_heights(widget.ax), kvlib.softmax(last_logits))
    assert '1. "I" 0.359, 2. "?" 0.178, 3. "fine" 0.148' in widget.readout.value
    assert widget.message.value == ""


def test_06_temperature_moves_the_bars_and_the_readout(last_logits):
    widget = w06.next_token_explorer()
    before_heights, before_readout = bar_heights(widget.ax), widget.readout.value
    widget.temperature.value = 0.5
    heights = bar_heights(widget.ax)
    np.testing.assert_allclose(heights, kvlib.next_token_probabilities(last_logits, 0.5))
    assert heights[5] > before_heights[5]
    assert widget.readout.value != before_readout
    assert '1. "I" 0.623' in widget.readout.value
    widget.temperature.value = 5.0
    assert bar_heights(widget.ax).max() < 0.15                 # nearly flat
    assert '1. "I" 0.130' in widget.readout.value
    widget.temperature.value = 0.0                             # greedy
    np.testing.assert_array_equal(bar_heights(widget.ax), np.eye(12)[5])
    assert '1. "I" 1.000' in widget.readout.value
    assert "greedy" in widget.ax.get_title()


def test_06_top_k_leaves_exactly_k_bars(last_logits):
    widget = w06.next_token_explorer()
    widget.top_k.value = 3
    heights = bar_heights(widget.ax)
    assert np.count_nonzero(heights) == 3
    assert set(np.flatnonzero(heights)) == set(np.argsort(last_logits)[-3:])
    assert heights.sum() == pytest.approx(1.0)
    assert "top-k 3" in widget.ax.get_title()


def test_06_sample_button_draws_seeded_samples():
    widget, twin = w06.next_token_explorer(seed=3), w06.next_token_explorer(seed=3)
    widget.sample.click()
    twin.sample.click()
    assert widget.samples.value == twin.samples.value
    assert "Draw 1</b> (20 samples, seed 3)" in widget.samples.value
    counts = [int(n) for n in re.findall(r"x(\d+)", widget.samples.value)]
    assert sum(counts) == 20
    dots = widget.ax.lines[0].get_ydata()
    assert dots.sum() == pytest.approx(1.0) and len(dots) == 12
    widget.sample.click()
    assert "Draw 2" in widget.samples.value
    widget.temperature.value = 0.0                 # greedy: every sample is "I"
    assert widget.samples.value == "" and not widget.ax.lines   # old samples cleared
    widget.sample.click()
    assert '"I" x20' in widget.samples.value


def test_06_temperature_zero_is_greedy_and_bad_input_is_refused(last_logits):
    greedy = kvlib.next_token_probabilities(last_logits, 0.0)
    assert greedy[5] == 1.0 and greedy.sum() == 1.0
    with pytest.raises(ValueError, match="temperature must be 0"):
        kvlib.next_token_probabilities(last_logits, -1.0)
    with pytest.raises(ValueError, match="one row of logits"):
        kvlib.next_token_probabilities(np.zeros((2, 12)), 1.0)


def test_06_no_figure_leaks_over_many_interactions():
    widget = w06.next_token_explorer()
    before = plt.get_fignums()
    for step in range(30):
        widget.temperature.value = (step % 10) * 0.5
        widget.top_k.value = 1 + step % 12
        widget.sample.click()
    assert plt.get_fignums() == before
    assert widget.message.value == ""


# ---------------------------------------------------------------------------------------------
# Widget of notebook 07: prefill a prompt, look at the cache
# ---------------------------------------------------------------------------------------------

def heatmaps(widget):
    return [np.asarray(ax.images[0].get_array()) for ax in widget.axes]


def test_07_shows_the_article_prompts_cache(params, ids):
    widget = w07.prefill_explorer()
    status = text_of(widget.status.value)
    assert "Prefilled 5 tokens in one pass: <bos> How are you ?" in status
    assert "K and V of shape (5, 4) in each of the 3 layers: 960 bytes" in status
    assert 'First predicted token: 5 ("I"), probability 0.359' in status
    _, cache = kvlib.prefill(params, ids)
    keys, values = heatmaps(widget)
    np.testing.assert_allclose(keys, cache.keys(0))
    np.testing.assert_allclose(values, cache.values(0))
    labels = [t.get_text() for t in widget.axes[0].get_yticklabels()]
    assert labels == ["<bos>", "How", "are", "you", "?"]


def test_07_layer_dropdown_shows_that_layers_cache(params, ids):
    widget = w07.prefill_explorer()
    _, cache = kvlib.prefill(params, ids)
    widget.layer.value = 2
    keys, values = heatmaps(widget)
    np.testing.assert_allclose(keys, cache.keys(2))
    np.testing.assert_allclose(values, cache.values(2))
    assert "layer 2" in widget.axes[0].get_title()


def test_07_a_new_prompt_is_prefilled(params):
    widget = w07.prefill_explorer()
    first_rows = heatmaps(widget)[0].copy()
    widget.prompt.value = "How are you? I am fine."
    assert "Prefilled 9 tokens" in widget.status.value
    keys = heatmaps(widget)[0]
    assert keys.shape == (9, 4)
    np.testing.assert_allclose(keys[:5], first_rows)    # causal: later text changes no row
    assert len(widget.cache()) == 9
    widget.prompt.value = ""                            # only BOS: still a valid prompt
    assert "Prefilled 1 tokens" in widget.status.value


def test_07_bad_text_is_explained_not_raised():
    widget = w07.prefill_explorer()
    status = widget.status.value
    widget.prompt.value = "How are yu"
    assert "unknown word(s) ['yu']" in widget.message.value
    assert widget.status.value == status                # the last good prompt stays on show
    widget.prompt.value = "<script>"
    assert "<script" not in widget.message.value and "&lt;" in widget.message.value
    widget.prompt.value = " ".join(["you"] * 40)
    assert "32" in widget.message.value                 # longer than the context
    widget.prompt.value = "I am fine"
    assert widget.message.value == "" and "Prefilled 4 tokens" in widget.status.value


def test_07_no_figure_leaks():
    widget = w07.prefill_explorer()
    before = plt.get_fignums()
    for step in range(30):
        widget.layer.value = step % 3
        widget.prefill.click()
        widget.prompt.value = ["How are you?", "I am", "yu", "good"][step % 4]
    assert plt.get_fignums() == before


# ---------------------------------------------------------------------------------------------
# Widget of notebook 08: decode one token at a time
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


def test_08_starts_from_the_prefilled_prompt(ids):
    widget = w08.decode_explorer()
    assert widget.decode.description == "Decode next token"
    assert widget.reset.description == "Reset"
    assert positions_in_status(widget) == 5
    assert cache_box_rows(widget) == (5, 4) and len_new(widget) == 5
    assert "prefill equals full recomputation" in widget.check.value
    assert widget.sequence() == ids and not widget.decode.disabled


def test_08_three_clicks_grow_the_cache_by_three(params, ids):
    widget = w08.decode_explorer()
    for _ in range(3):
        widget.decode.click()
    assert positions_in_status(widget) == 8
    status = text_of(widget.status.value)
    assert "Cache holds 8 positions (K and V of shape (8, 4) per layer). Generated: I am you you" \
        in status
    assert widget.check.value == ("decode_step equals full recomputation "
                                  "(max difference below 1e-10)")
    assert cache_box_rows(widget) == (8, 4) and len_new(widget) == 1
    assert widget.sequence() == ids + [5, 2, 1] and len(widget.cache()) == 8
    # the strips are the newest token's real attention weights, per head, over all 8 positions
    _, cache = kvlib.prefill(params, ids)
    for token in (5, 2):
        kvlib.decode_step(params, token, cache)
    recorded = []
    kvlib.decode_step(params, 1, cache, record_attention=recorded)
    strips = [np.asarray(ax.images[0].get_array()) for ax in widget.figure.axes[1:]]
    assert len(strips) == 2
    for head, strip in enumerate(strips):
        np.testing.assert_allclose(strip, recorded[0][head, -1:, :])
    labels = [t.get_text() for t in widget.figure.axes[1].get_xticklabels()]
    assert labels == ["<bos>", "How", "are", "you", "?", "I", "am", "you"]
    widget.layer.value = 2
    np.testing.assert_allclose(np.asarray(widget.figure.axes[1].images[0].get_array()),
                               recorded[2][0, -1:, :])
    assert positions_in_status(widget) == 8             # switching layers decodes nothing


def test_08_reset_returns_to_the_prompt(ids):
    widget = w08.decode_explorer()
    for _ in range(4):
        widget.decode.click()
    widget.reset.click()
    assert positions_in_status(widget) == 5 and cache_box_rows(widget) == (5, 4)
    assert widget.sequence() == ids and len(widget.cache()) == 5
    widget.decode.click()
    assert positions_in_status(widget) == 6


def test_08_the_check_line_is_computed_not_written(monkeypatch):
    widget = w08.decode_explorer()
    real_forward = kvlib.forward
    monkeypatch.setattr(kvlib, "forward", lambda *a, **k: real_forward(*a, **k) + 1.0)
    widget.decode.click()
    assert "differs from full recomputation" in widget.check.value
    monkeypatch.setattr(kvlib, "forward", real_forward)
    widget.decode.click()
    assert "equals full recomputation" in widget.check.value


def test_08_filling_the_context_disables_the_button_without_raising():
    widget = w08.decode_explorer()
    before = plt.get_fignums()
    for _ in range(30):                   # 27 clicks fill the 32 positions; 3 more do nothing
        widget.decode.click()
    assert plt.get_fignums() == before
    assert widget.decode.disabled
    assert positions_in_status(widget) == 32 and len(widget.cache()) == 32
    assert "context is full" in widget.status.value
    assert cache_box_rows(widget) == (32, 4)
    assert widget.message.value == ""
    widget.reset.click()
    assert not widget.decode.disabled and positions_in_status(widget) == 5


def test_08_prompt_box(ids):
    widget = w08.decode_explorer()
    widget.prompt.value = "I am"
    assert positions_in_status(widget) == 3 and "Generated:" in widget.status.value
    widget.decode.click()
    assert positions_in_status(widget) == 4
    widget.prompt.value = "I am yu"
    assert "unknown word(s) ['yu']" in widget.message.value
    assert positions_in_status(widget) == 4             # nothing changed
    widget.prompt.value = " ".join(["you"] * 31)        # BOS + 31 = the whole context
    assert positions_in_status(widget) == 32 and widget.decode.disabled
    widget.decode.click()                               # disabled: nothing happens, no error
    assert positions_in_status(widget) == 32


def test_08_draw_decode_state_checks_its_input():
    figure = plt.figure()
    with pytest.raises(ValueError, match="key labels"):
        w08.draw_decode_state(figure, 5, 1, np.ones((2, 6)) / 6, "I", ["a"] * 5)


# ---------------------------------------------------------------------------------------------
# Exercise checkers: wrong answers get specific words
# ---------------------------------------------------------------------------------------------

def not_yet(feedback, *phrases):
    assert not feedback.passed, feedback
    assert repr(feedback).startswith("Not yet: ")
    for phrase in phrases:
        assert phrase in feedback.message, feedback.message


def correct(feedback):
    assert feedback.passed, feedback
    assert repr(feedback).startswith("Correct: ")


@pytest.mark.parametrize("module, checkers", [
    (ex06, ["check_predictions_per_position", "check_temperature_for_half", "check_top_k"]),
    (ex07, ["check_layer_keys", "check_cache_bytes", "check_serve"]),
    (ex08, ["check_decode_weights", "check_chunked_prefill", "check_generation_loop"]),
])
def test_unfilled_answers_say_so(module, checkers):
    for name in checkers:
        not_yet(getattr(module, name)(...), "not filled in yet")
        not_yet(getattr(module, name)(None), "not filled in yet")


def test_06_predictions_checker(params, ids):
    logits = kvlib.forward(params, ids)
    not_yet(ex06.check_predictions_per_position(np.argmax(logits, axis=0)), "12 numbers", "axis")
    not_yet(ex06.check_predictions_per_position(5), "one token id")
    not_yet(ex06.check_predictions_per_position([10, 1, 5, 1, 4]), "position 4")
    not_yet(ex06.check_predictions_per_position(np.array([10.0, 1, 5, 1, 5])), "whole numbers")
    correct(ex06.check_predictions_per_position([10, 1, 5, 1, 5]))


def test_06_temperature_checker():
    not_yet(ex06.check_temperature_for_half(1.0), "try a lower temperature")
    not_yet(ex06.check_temperature_for_half(2.0), "above 1 flattens")
    not_yet(ex06.check_temperature_for_half(0.3), "try a higher temperature")
    not_yet(ex06.check_temperature_for_half(-0.5), "positive")
    not_yet(ex06.check_temperature_for_half("hot"), "one number")
    correct(ex06.check_temperature_for_half(0.665))


def test_06_top_k_checker(last_logits):
    p = kvlib.softmax(last_logits)
    top = np.argsort(last_logits)[-3:]
    zeroed = np.where(np.isin(np.arange(12), top), p, 0.0)
    not_yet(ex06.check_top_k(zeroed), "Renormalise")
    bottom = np.argsort(last_logits)[:3]
    wrong_tokens = np.zeros(12)
    wrong_tokens[bottom] = 1 / 3
    not_yet(ex06.check_top_k(wrong_tokens), "you kept tokens")
    not_yet(ex06.check_top_k(kvlib.next_token_probabilities(last_logits, top_k=4)), "4 tokens")
    not_yet(ex06.check_top_k(p[:3]), "shape")
    not_yet(ex06.check_top_k(np.array(list("abcdefghijkl"))), "should hold numbers")
    correct(ex06.check_top_k(kvlib.next_token_probabilities(last_logits, top_k=3)))


def layer_inputs(params, ids):
    X = kvlib.embed(np.array(ids), params.embedding)
    inputs = [X]
    for layer in params.layers:
        inputs.append(kvlib.decoder_block(inputs[-1], layer, 2, kvlib.causal_mask(len(ids))))
    return inputs


def test_07_layer_keys_checker(params, ids):
    X0, X1, X2, _ = layer_inputs(params, ids)
    layer1 = params.layers[1]
    not_yet(ex07.check_layer_keys(X0 @ layer1.Wk), "embeddings")
    not_yet(ex07.check_layer_keys(X2 @ layer1.Wk), "layer 1's output")
    not_yet(ex07.check_layer_keys(X1 @ params.layers[0].Wk), "layer 0's Wk")
    not_yet(ex07.check_layer_keys(X1 @ layer1.Wq), "queries")
    not_yet(ex07.check_layer_keys(X1 @ layer1.Wv), "values")
    not_yet(ex07.check_layer_keys(X1), "right shape but not the right values")
    not_yet(ex07.check_layer_keys((X1 @ layer1.Wk)[:4]), "shape (5, 4)")
    not_yet(ex07.check_layer_keys(np.full((5, 4), "k")), "should hold numbers")
    correct(ex07.check_layer_keys(X1 @ layer1.Wk))


@pytest.mark.parametrize("answer, phrase", [
    (960, "multiply by 2"), (640, "one layer"), (3840, "4 bytes"), (2880, "queries"),
    (15360, "bits"), (480, "cached numbers"), (1000, "is not it"), ("1920", "a number"),
])
def test_07_cache_bytes_checker(answer, phrase):
    not_yet(ex07.check_cache_bytes(answer), phrase)


def test_07_cache_bytes_answer_is_a_real_cache():
    config = kvlib.ModelConfig(dtype="float32")
    _, cache = kvlib.prefill(kvlib.init_params(config), [0] * 20)
    correct(ex07.check_cache_bytes(cache.nbytes))
    correct(ex07.check_cache_bytes(1920.0))


def test_07_serve_checker(params):
    shared_cache = kvlib.KVCache(params.config)

    def never_reset(prompt_ids):
        return kvlib.prefill(params, prompt_ids, shared_cache)[0][-1]

    not_yet(ex07.check_serve(never_reset), "request 2 ('I am fine and you?') differs",
            "cache.reset()")
    small_cache = kvlib.KVCache(params.config, capacity=8)

    def never_reset_small(prompt_ids):
        return kvlib.prefill(params, prompt_ids, small_cache)[0][-1]

    not_yet(ex07.check_serve(never_reset_small), "filled up", "cache.reset()")
    not_yet(ex07.check_serve(lambda prompt_ids: kvlib.prefill(params, prompt_ids)[0]),
            "last row of the logits")
    not_yet(ex07.check_serve(lambda prompt_ids: kvlib.prefill(params, prompt_ids)[0][0]),
            "even a prompt served by itself")
    not_yet(ex07.check_serve(lambda prompt_ids: 1 / 0), "ZeroDivisionError")
    not_yet(ex07.check_serve(lambda prompt_ids: "I"), "got str")
    not_yet(ex07.check_serve(np.zeros(12)), "should be a function")
    correct(ex07.check_serve(lambda prompt_ids: kvlib.prefill(params, prompt_ids)[0][-1]))


def test_08_decode_weights_checker(params, ids):
    _, cache = kvlib.prefill(params, ids)
    x = kvlib.embed(np.array([5]), params.embedding)
    q, k, _ = kvlib.project_qkv(x, params.layers[0])
    qh = kvlib.split_heads(q, 2)
    Kh = kvlib.split_heads(np.vstack([cache.keys(0), k]), 2)
    raw = qh @ Kh.swapaxes(-1, -2)
    not_yet(ex08.check_decode_weights(kvlib.softmax(raw)), "not scaled")
    not_yet(ex08.check_decode_weights(raw / np.sqrt(2)), "scores, not weights")
    not_yet(ex08.check_decode_weights(kvlib.softmax(raw / np.sqrt(2), axis=1)), "wrong axis")
    short = kvlib.softmax(kvlib.attention_scores(qh, kvlib.split_heads(cache.keys(0), 2)))
    not_yet(ex08.check_decode_weights(short), "attends to itself")
    not_yet(ex08.check_decode_weights(kvlib.softmax(raw[0] / np.sqrt(2))), "every head")
    not_yet(ex08.check_decode_weights(np.full((2, 6, 6), 1 / 6)), "6 query rows")
    not_yet(ex08.check_decode_weights([[0.5, 0.5]]), "numpy array")
    not_yet(ex08.check_decode_weights(np.full((2, 1, 6), "w")), "should hold numbers")
    correct(ex08.check_decode_weights(kvlib.softmax(raw / np.sqrt(2))))


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


def test_08_chunked_prefill_checker():
    start_aligned = chunk_with(lambda T, S: np.tril(np.ones((T, S), dtype=bool)))
    not_yet(ex08.check_chunked_prefill(start_aligned), "cannot see all the cached positions",
            "aligned to the end")
    not_yet(ex08.check_chunked_prefill(chunk_with(lambda T, S: None)),
            "no causal mask among them")
    not_yet(ex08.check_chunked_prefill(chunk_with(lambda T, S: kvlib.causal_mask(T))),
            "one column per position")
    not_yet(ex08.check_chunked_prefill(chunk_with(lambda T, S: kvlib.causal_mask(T),
                                                  use_cache=False)),
            "the cache should hold")
    not_yet(ex08.check_chunked_prefill(lambda params, ids, cache: None), "shape (3, 12)")
    not_yet(ex08.check_chunked_prefill(lambda params, ids, cache: "logits"), "got str")
    not_yet(ex08.check_chunked_prefill("prefill"), "should be a function")
    correct(ex08.check_chunked_prefill(chunk_with(kvlib.causal_mask)))
    correct(ex08.check_chunked_prefill(lambda params, ids, cache:
                                       kvlib.prefill(params, ids, cache)[0]))


def test_08_generation_loop_checker():
    def with_prompt(params, ids, n):
        return list(ids) + kvlib.generate(params, ids, n)

    def feeds_last_prompt_token_again(params, ids, n):
        _, cache = kvlib.prefill(params, ids)
        token, new = ids[-1], []
        for _ in range(n):
            token = int(np.argmax(kvlib.decode_step(params, token, cache)[-1]))
            new.append(token)
        return new

    def without_cache(params, ids, n):
        return kvlib.generate(params, ids, n, use_cache=False)

    def one_short(params, ids, n):
        return kvlib.generate(params, ids, n)[:-1] if n > 1 else []

    not_yet(ex08.check_generation_loop(with_prompt), "starts with the prompt")
    not_yet(ex08.check_generation_loop(feeds_last_prompt_token_again), "twice")
    not_yet(ex08.check_generation_loop(without_cache), "decode_step was never called")
    not_yet(ex08.check_generation_loop(one_short), "new ones")
    not_yet(ex08.check_generation_loop(lambda params, ids, n: [0] * n), "greedy decoding gives")
    not_yet(ex08.check_generation_loop(lambda params, ids, n: 1 / 0), "ZeroDivisionError")
    assert kvlib.decode_step.__name__ == "decode_step"     # restored after the checker


# ---------------------------------------------------------------------------------------------
# Solutions, executed in each notebook's own variables, pass their checkers
# ---------------------------------------------------------------------------------------------

def notebook_namespace(name):
    """Run a notebook's code cells (headless) and return its variables."""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    namespace = {"__name__": "__notebook__"}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), name, "exec"), namespace)
    plt.close("all")
    return namespace


LESSONS = {
    "06_logits_next_token": (ex06, {1: "check_predictions_per_position",
                                    2: "check_temperature_for_half", 3: "check_top_k"}),
    "07_prefill": (ex07, {1: "check_layer_keys", 2: "check_cache_bytes", 3: "check_serve"}),
    "08_kv_cached_decode": (ex08, {1: "check_decode_weights", 2: "check_chunked_prefill",
                                   3: "check_generation_loop"}),
}


@pytest.mark.parametrize("name", sorted(LESSONS))
def test_solutions_pass_in_the_notebooks_namespace(name):
    module, checkers = LESSONS[name]
    assert sorted(module.SOLUTIONS) == sorted(checkers)
    namespace = notebook_namespace(name)
    assert namespace["answer"] is ...           # the notebook leaves the exercises open
    for number, checker in checkers.items():
        scope = dict(namespace)
        exec(module.SOLUTIONS[number], scope)
        feedback = getattr(module, checker)(scope["answer"])
        assert feedback.passed, f"solution {number} of {name}: {feedback}"


def test_notebook_08_broken_functions_fail_their_checkers():
    namespace = notebook_namespace("08_kv_cached_decode")
    not_yet(ex08.check_chunked_prefill(namespace["prefill_chunk_broken"]), "aligned to the end")
    namespace = notebook_namespace("07_prefill")
    # the notebook's demo already used server_cache: even request 1 sees an earlier prompt
    not_yet(ex07.check_serve(namespace["serve_broken"]), "request 1 ('How are you?') differs",
            "Served again, the same prompt got a different answer", "cache.reset()")


@pytest.mark.parametrize("module", [ex06, ex07, ex08])
def test_solution_display(module):
    shown = module.solution(1)
    assert "Solution to exercise 1" in shown.data and "answer" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        module.solution(9)
