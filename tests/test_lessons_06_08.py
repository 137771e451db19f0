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
from checker_cases_06_11 import (  # noqa: E402
    FUZZ,
    correct,
    functions_returning_the_fuzz,
    not_yet,
    survives_the_fuzz,
)

import kvlib  # noqa: E402
from kvlib import plots  # noqa: E402
from kvlib.exercises import kv_cached_decode as ex08  # noqa: E402
from kvlib.exercises import logits_next_token as ex06  # noqa: E402
from kvlib.exercises import prefill as ex07  # noqa: E402
from kvlib.widgets import kv_cached_decode as w08  # noqa: E402
from kvlib.widgets import logits_next_token as w06  # noqa: E402
from kvlib.widgets import prefill as w07  # noqa: E402

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


def test_06_sample_button_keeps_a_running_count():
    widget, twin = w06.next_token_explorer(seed=3), w06.next_token_explorer(seed=3)
    widget.sample.click()
    twin.sample.click()
    assert widget.samples.value == twin.samples.value          # seeded: the same draws
    assert "20 samples so far</b> (1 draw of 20, seed 3)" in widget.samples.value
    counts = [int(n) for n in re.findall(r"x(\d+)", widget.samples.value)]
    assert sum(counts) == 20
    dots = widget.ax.lines[0].get_ydata()
    assert dots.sum() == pytest.approx(1.0) and len(dots) == 12
    first = widget.counts()
    for _ in range(9):
        widget.sample.click()
    assert "200 samples so far</b> (10 draws of 20" in widget.samples.value
    counts = widget.counts()
    assert counts.sum() == 200 and (counts >= first).all()      # added to, not replaced
    np.testing.assert_allclose(widget.ax.lines[0].get_ydata(), counts / 200)
    assert "share of 200 samples so far" in widget.ax.get_legend().texts[0].get_text()
    # 200 draws: the shares approach the probabilities
    assert np.abs(counts / 200 - widget.probabilities()).max() < 0.1
    widget.temperature.value = 0.0                 # greedy: every sample is "I"
    assert widget.samples.value == "" and not widget.ax.lines   # old samples cleared
    assert widget.counts().sum() == 0
    widget.sample.click()
    assert '"I" x20' in widget.samples.value


def test_06_readout_lists_only_tokens_that_can_be_drawn():
    widget = w06.next_token_explorer()
    widget.temperature.value = 0.0
    assert " ".join(text_of(widget.readout.value).split()).startswith('Top 3: 1. "I" 1.000')
    assert "2." not in widget.readout.value and "never drawn" in widget.readout.value
    widget.temperature.value = 1.0
    widget.top_k.value = 1
    assert "2." not in widget.readout.value and "never drawn" in widget.readout.value
    widget.top_k.value = 2
    assert '2. "?"' in widget.readout.value and "3." not in widget.readout.value
    widget.top_k.value = 12
    assert "3." in widget.readout.value and "never drawn" not in widget.readout.value


def test_06_temperature_zero_is_greedy_and_bad_input_is_refused(last_logits):
    greedy = kvlib.next_token_probabilities(last_logits, 0.0)
    assert greedy[5] == 1.0 and greedy.sum() == 1.0
    with pytest.raises(ValueError, match="temperature must be at least 0"):
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
    assert "Layer 2" in widget.figure.get_suptitle()
    assert widget.axes[0].get_title() == "K (5, 4)" and widget.axes[1].get_title() == "V (5, 4)"


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
    assert "Prefilled 1 token in one pass" in widget.status.value


def test_07_bad_text_is_explained_not_raised():
    widget = w07.prefill_explorer()
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
    assert re.fullmatch(r"decode_step equals full recomputation: the logits differ by "
                        r"\d(e-\d+)? of their size, below 1e-10", widget.check.value), \
        widget.check.value
    assert cache_box_rows(widget) == (8, 4) and len_new(widget) == 1
    assert widget.sequence() == ids + [5, 2, 1] and len(widget.cache()) == 8
    # the strips are the newest token's real attention weights, per head, over all 8 positions
    _, cache = kvlib.prefill(params, ids)
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


def test_08_strips_have_a_scale_that_shows_their_spread():
    widget = w08.decode_explorer()
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


def test_08_tolerance_is_relative_to_the_logits():
    logits = np.array([[100.0, -50.0]])
    assert w08.relative_difference(logits + 1e-9, logits) == pytest.approx(1e-11)
    assert w08.TOLERANCE == 1e-10


def test_08_draw_decode_state_checks_its_input():
    figure = plt.figure()
    with pytest.raises(ValueError, match="key labels"):
        w08.draw_decode_state(figure, 5, 1, np.ones((2, 6)) / 6, "I", ["a"] * 5)

# ---------------------------------------------------------------------------------------------
# Exercise checkers: tables of typical wrong answers, each with its diagnosis, and valid
# answers in other forms; then the fuzz (anything a student can type gets a Feedback)
# ---------------------------------------------------------------------------------------------

TOKENIZER = kvlib.ToyTokenizer()
PARAMS = kvlib.init_params()
ARTICLE_IDS = TOKENIZER.encode(kvlib.ARTICLE_PROMPT)
ARTICLE_LAST = kvlib.forward(PARAMS, ARTICLE_IDS)[-1]


@pytest.mark.parametrize("module, checkers", [
    (ex06, ["check_predictions_per_position", "check_temperature_for_half", "check_top_k"]),
    (ex07, ["check_layer_keys", "check_cache_bytes", "check_serve"]),
    (ex08, ["check_decode_weights", "check_chunked_prefill", "check_generation_loop"]),
])
def test_unfilled_answers_say_so(module, checkers):
    for name in checkers:
        not_yet(getattr(module, name)(...), "not filled in yet")
        not_yet(getattr(module, name)(None), "not filled in yet")


# ------------------------------------------------------------------ 06 ex. 1: every row's guess

EX06_1_IDS = TOKENIZER.encode(ex06.EXERCISE1_PROMPT)
EX06_1_LOGITS = kvlib.forward(PARAMS, EX06_1_IDS)
EX06_1_RIGHT = np.argmax(EX06_1_LOGITS, axis=-1)


def _one_position_off():
    guesses = EX06_1_RIGHT.copy()
    guesses[3] = (guesses[3] + 1) % 12
    return guesses


EX06_1_WRONG = [
    (np.argmax(EX06_1_LOGITS, axis=0), "12 numbers"),
    (5, "one token id"),
    (np.argmax(kvlib.forward(PARAMS, ARTICLE_IDS), axis=-1), "How are you?"),
    (np.argmax(kvlib.forward(PARAMS, TOKENIZER.encode(ex06.EXERCISE1_PROMPT, add_bos=False)),
               axis=-1), "BOS"),
    (EX06_1_LOGITS, "whole (7, 12) matrix"),
    (_one_position_off(), "position 3 is off"),
    (EX06_1_RIGHT + 0.5, "whole numbers"),
    (EX06_1_RIGHT[:6], "expected 7 ids"),
    (np.array(["a"] * 7), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX06_1_WRONG)
def test_06_predictions_wrong_answers(answer, diagnosis):
    not_yet(ex06.check_predictions_per_position(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX06_1_RIGHT, EX06_1_RIGHT.tolist(), tuple(EX06_1_RIGHT),
                                    EX06_1_RIGHT.astype(float), EX06_1_RIGHT.astype(np.int32)])
def test_06_predictions_valid_forms(answer):
    correct(ex06.check_predictions_per_position(answer), "Training compares")


# ------------------------------------------------------------------ 06 ex. 2: temperature

@pytest.mark.parametrize("answer, diagnosis", [
    (1.0, "try a lower temperature"), (2.0, "above 1 flattens"), (0.3, "try a higher"),
    (-0.5, "positive"), (0, "greedy"), ("hot", "a temperature"), ([0.665, 0.7], "several"),
])
def test_06_temperature_wrong_answers(answer, diagnosis):
    not_yet(ex06.check_temperature_for_half(answer), diagnosis)


@pytest.mark.parametrize("answer", [0.665, 0.66, 0.67, np.float32(0.665), np.array(0.665),
                                    [0.665], np.array([0.665])])
def test_06_temperature_valid_forms(answer):
    correct(ex06.check_temperature_for_half(answer))


# ------------------------------------------------------------------ 06 ex. 3: top-k by hand

TOP = np.argsort(ARTICLE_LAST)[-3:]
TOP3 = kvlib.next_token_probabilities(ARTICLE_LAST, top_k=3)


def _only(indices, values):
    answer = np.zeros(12)
    answer[indices] = values
    return answer


EX06_3_WRONG = [
    (_only(TOP, kvlib.softmax(ARTICLE_LAST)[TOP]), "Renormalise"),
    (_only(np.argsort(ARTICLE_LAST)[:3], 1 / 3), "you kept tokens"),
    (kvlib.next_token_probabilities(ARTICLE_LAST, top_k=4), "4 tokens"),
    (kvlib.softmax(ARTICLE_LAST), "12 tokens"),
    (TOP3[TOP], "3 numbers"),
    (_only(TOP, ARTICLE_LAST[TOP]), "logits"),
    (np.where(np.isin(np.arange(12), TOP), ARTICLE_LAST, -np.inf), "-inf"),
    (np.full(12, np.nan), "nan"),
    (_only(TOP, 1 / 3), "not their probabilities"),
    (kvlib.next_token_probabilities(ARTICLE_LAST, 0.7, top_k=3), "not their probabilities"),
    (TOP3[:11], "shape (12,)"),
    (np.array(list("abcdefghijkl")), "should hold numbers"),
]


@pytest.mark.parametrize("answer, diagnosis", EX06_3_WRONG)
def test_06_top_k_wrong_answers(answer, diagnosis):
    not_yet(ex06.check_top_k(answer), diagnosis)


@pytest.mark.parametrize("answer", [TOP3, TOP3.tolist(), tuple(TOP3), np.round(TOP3, 3),
                                    TOP3.astype(np.float32), np.round(TOP3, 3).tolist()])
def test_06_top_k_valid_forms(answer):
    correct(ex06.check_top_k(answer))


# ------------------------------------------------------------------ 07 ex. 1: layer 2's keys

def layer_inputs(ids, mask=True):
    X = kvlib.embed(np.array(ids), PARAMS.embedding)
    inputs = [X]
    for layer in PARAMS.layers:
        inputs.append(kvlib.decoder_block(inputs[-1], layer, 2,
                                          kvlib.causal_mask(len(ids)) if mask else None))
    return inputs


EX07_IDS = TOKENIZER.encode(ex07.EXERCISE1_PROMPT)
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
def test_07_layer_keys_wrong_answers(answer, diagnosis):
    not_yet(ex07.check_layer_keys(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX07_1_RIGHT, EX07_1_RIGHT.tolist(), np.round(EX07_1_RIGHT, 3),
                                    EX07_1_RIGHT.astype(np.float32)])
def test_07_layer_keys_valid_forms(answer):
    correct(ex07.check_layer_keys(answer))


def test_07_layer_keys_equal_a_real_cache():
    _, cache = kvlib.prefill(PARAMS, EX07_IDS)
    correct(ex07.check_layer_keys(cache.keys(2)))


# ------------------------------------------------------------------ 07 ex. 2: cache bytes

@pytest.mark.parametrize("answer, diagnosis", [
    (960, "multiply by 2"), (640, "one layer"), (3840, "4 bytes"), (2880, "queries"),
    (15360, "bits"), (480, "cached numbers"), (3072, "32 positions"), (1000, "is not it"),
    ("1920", "a number of bytes"), (1920.5, "not a whole number"), ([1920, 1920], "several"),
])
def test_07_cache_bytes_wrong_answers(answer, diagnosis):
    not_yet(ex07.check_cache_bytes(answer), diagnosis)


@pytest.mark.parametrize("answer", [1920, 1920.0, 1.92e3, np.int64(1920), np.float32(1920),
                                    np.array(1920), [1920], np.array([1920])])
def test_07_cache_bytes_valid_forms(answer):
    correct(ex07.check_cache_bytes(answer))


def test_07_cache_bytes_answer_is_a_real_cache():
    config = kvlib.ModelConfig(dtype="float32")
    _, cache = kvlib.prefill(kvlib.init_params(config), [0] * 20)
    correct(ex07.check_cache_bytes(cache.nbytes))


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
def test_07_serve_wrong_answers(kind, capacity, diagnosis):
    serve, server_cache = serving(kind, capacity)
    not_yet(ex07.check_serve(serve, server_cache), diagnosis)


@pytest.mark.parametrize("kind", ["resets first", "resets before and after", "returns a list",
                                  "returns (1, V)"])
def test_07_serve_valid_forms(kind):
    serve, server_cache = serving(kind)
    correct(ex07.check_serve(serve, server_cache), "server_cache")


def test_07_serve_says_how_stale_the_cache_was():
    serve, server_cache = serving("never resets")
    kvlib.prefill(PARAMS, TOKENIZER.encode("How are you? I am fine"), server_cache)
    not_yet(ex07.check_serve(serve, server_cache), "already held 8 positions")
    serve, server_cache = serving("never resets")
    not_yet(ex07.check_serve(serve, server_cache), "first served 'good and you'",
            "it held 4 positions")


def test_07_serve_needs_the_cache_itself():
    serve, _ = serving("resets first")
    not_yet(ex07.check_serve(serve), "check_serve(answer, server_cache)")
    not_yet(ex07.check_serve(serve, "server_cache"), "KVCache")
    not_yet(ex07.check_serve(serve, kvlib.KVCache(kvlib.ModelConfig(d_model=8))),
            "another model")
    not_yet(ex07.check_serve(np.zeros(12)), "should be a function")


# ------------------------------------------------------------------ 08 ex. 1: a step's weights

def decode_pieces():
    _, cache = kvlib.prefill(PARAMS, TOKENIZER.encode(ex08.EXERCISE1_CACHED))
    x = kvlib.embed(np.array([ex08.EXERCISE1_TOKEN]), PARAMS.embedding)
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
def test_08_decode_weights_wrong_answers(answer, diagnosis):
    not_yet(ex08.check_decode_weights(answer), diagnosis)


@pytest.mark.parametrize("answer", [EX08_1_RIGHT, EX08_1_RIGHT.tolist(),
                                    np.round(EX08_1_RIGHT, 3), EX08_1_RIGHT.astype(np.float32)])
def test_08_decode_weights_valid_forms(answer):
    correct(ex08.check_decode_weights(answer))


def test_08_decode_weights_equal_what_decode_step_records():
    _, cache = kvlib.prefill(PARAMS, TOKENIZER.encode(ex08.EXERCISE1_CACHED))
    recorded = []
    kvlib.decode_step(PARAMS, ex08.EXERCISE1_TOKEN, cache, record_attention=recorded)
    correct(ex08.check_decode_weights(recorded[0]))


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
def test_08_chunked_prefill_wrong_answers(function, diagnosis):
    not_yet(ex08.check_chunked_prefill(function), diagnosis)


@pytest.mark.parametrize("function", [
    chunk_with(kvlib.causal_mask),
    chunk_with(lambda T, S: np.tri(T, S, k=S - T, dtype=bool)),
    lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0],
    lambda params, ids, cache: kvlib.prefill(params, ids, cache)[0].tolist(),
])
def test_08_chunked_prefill_valid_forms(function):
    correct(ex08.check_chunked_prefill(function))


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
def test_08_generation_loop_wrong_answers(function, diagnosis):
    not_yet(ex08.check_generation_loop(function), diagnosis)


@pytest.mark.parametrize("function", [loop_from_kvlib, loop_with_direct_imports,
                                      loop_with_chunks_of_one, loop_one_step_too_many])
def test_08_generation_loop_valid_forms(function):
    correct(ex08.check_generation_loop(function), "one position per new token")


def test_08_generation_loop_tells_the_wrong_loops_apart_by_their_tokens():
    """On the checker's first prompts, the two classic wrong loops choose other tokens, so
    the token comparison alone catches them (the work count is a second check)."""
    text, n = ex08.GENERATION_CASES[0]
    ids = TOKENIZER.encode(text)
    right = kvlib.generate(PARAMS, ids, n, use_cache=False)
    assert prefills_every_step(PARAMS, ids, n) != right
    assert feeds_last_prompt_token_again(PARAMS, ids, n) != right
    assert kvlib.decode_step.__name__ == "decode_step"      # nothing was monkeypatched


# ------------------------------------------------------------------ the fuzz

@pytest.mark.parametrize("checker", [
    ex06.check_predictions_per_position, ex06.check_temperature_for_half, ex06.check_top_k,
    ex07.check_layer_keys, ex07.check_cache_bytes, ex08.check_decode_weights,
    ex08.check_chunked_prefill, ex08.check_generation_loop,
])
def test_every_checker_answers_the_fuzz_with_feedback(checker):
    survives_the_fuzz(checker)


def test_07_serve_answers_the_fuzz_with_feedback():
    survives_the_fuzz(ex07.check_serve, kvlib.KVCache(PARAMS.config))
    for value in FUZZ:
        assert not ex07.check_serve(serving("resets first")[0], value).passed
    for function in functions_returning_the_fuzz():
        not_yet(ex07.check_serve(function, kvlib.KVCache(PARAMS.config)))


@pytest.mark.parametrize("checker", [ex08.check_chunked_prefill, ex08.check_generation_loop])
def test_function_checkers_answer_whatever_the_function_returns(checker):
    for function in functions_returning_the_fuzz():
        not_yet(checker(function))


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
EXTRA_ARGUMENTS = {("07_prefill", 3): ["server_cache"]}


@pytest.mark.parametrize("name", sorted(LESSONS))
def test_solutions_pass_in_the_notebooks_namespace(name):
    module, checkers = LESSONS[name]
    assert sorted(module.SOLUTIONS) == sorted(checkers)
    namespace = notebook_namespace(name)
    assert namespace["answer"] is ...           # the notebook leaves the exercises open
    for number, checker in checkers.items():
        scope = dict(namespace)
        exec(module.SOLUTIONS[number], scope)
        extra = [scope[variable] for variable in EXTRA_ARGUMENTS.get((name, number), [])]
        feedback = getattr(module, checker)(scope["answer"], *extra)
        assert feedback.passed, f"solution {number} of {name}: {feedback}"


@pytest.mark.parametrize("name", sorted(LESSONS))
def test_every_cell_can_be_run_twice(name):
    """Students re-run cells: each code cell, run a second time at once, must neither fail
    nor leave a different state for the cells after it (a cache that grew twice)."""
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    namespace = {"__name__": "__notebook__"}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            code = compile("".join(cell["source"]), name, "exec")
            exec(code, namespace)
            exec(code, namespace)
    plt.close("all")
    assert namespace["answer"] is ...


def test_the_notebooks_broken_functions_fail_their_checkers():
    namespace = notebook_namespace("08_kv_cached_decode")
    not_yet(ex08.check_chunked_prefill(namespace["prefill_chunk_broken"]), "aligned to the end")
    namespace = notebook_namespace("07_prefill")
    # the notebook's demo already used server_cache: even request 1 sees earlier prompts
    not_yet(ex07.check_serve(namespace["serve_broken"], namespace["server_cache"]),
            "request 1 ('How are you?') differs", "already held 9 positions",
            "Served again, the same prompt got a different answer", "cache.reset()")


@pytest.mark.parametrize("module", [ex06, ex07, ex08])
def test_solution_display(module):
    shown = module.solution(1)
    assert "Solution to exercise 1" in shown.data and "answer" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        module.solution(9)
