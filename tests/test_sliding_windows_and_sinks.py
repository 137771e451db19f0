"""Notebook 17 (sliding windows and attention sinks): the ring buffer against plain
references (hypothesis, float64, 1e-10), the receptive field of a stack of windows, the
pictures and the widget (headless), the exercise checkers with tables of typical wrong answers
(each with its diagnosis) and of valid answers in other forms, the stories model's measured
windows and SmolLM2's sinks."""

import json
import math
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import measure_smollm2
import measure_windows
import numpy as np
import pytest
from checker_cases import case_id, correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, notebook_cells, run_notebook
from strategies import models, token_lists
from widget_checks import no_new_figures

import kvlib
from kvlib.exercises import sliding_windows_and_sinks as exercises
from kvlib.widgets import sliding_windows_and_sinks as widgets

ROOT = Path(__file__).resolve().parent.parent
WINDOW_LOSSES = ROOT / "notebooks" / "data" / "window_losses.json"
TOLERANCE = 1e-10


# ---------------------------------------------------------------------------------------------
# The ring buffer against plain references
# ---------------------------------------------------------------------------------------------

@given(models(window=True, positions="rotary", context_length=48), st.data())
@settings(max_examples=60, deadline=None)
def test_the_ring_equals_a_full_cache_and_recomputation_over_many_windows(model, data):
    """Decode many windows long with the ring, with a full cache under the banded mask and
    with full recomputation: the same logits at every step, and the ring's bytes are the
    formula's and stop at sinks + W rows."""
    params, config = model
    prompt = token_lists(data.draw, config, 1, 6)
    # at least four windows past the prompt, up to the context length
    length = data.draw(st.integers(min(48, len(prompt) + 4 * config.window + config.sink_tokens),
                                   48))
    rest = data.draw(st.lists(st.integers(0, config.vocab_size - 1),
                              min_size=length - len(prompt), max_size=length - len(prompt)))
    _, ring = kvlib.prefill(params, prompt)
    _, full = kvlib.prefill(params, prompt, kvlib.KVCache(config))
    assert isinstance(ring, kvlib.SlidingWindowCache)
    sequence = list(prompt)
    for token in rest:
        sequence.append(token)
        from_ring = kvlib.decode_step(params, token, ring)
        from_full = kvlib.decode_step(params, token, full)
        recomputed = kvlib.forward(params, sequence, last_only=True)
        np.testing.assert_allclose(from_ring, recomputed, rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(from_full, recomputed, rtol=0, atol=TOLERANCE)
        assert ring.nbytes == kvlib.config_cache_bytes(config, len(sequence))
        rows = min(len(sequence), config.window + config.sink_tokens)
        assert ring.nbytes == 2 * config.n_layers * rows * config.kv_width * 8
    assert full.nbytes == kvlib.config_cache_bytes(config.replace(window=None, sink_tokens=0),
                                                   len(sequence))


@given(models(window=True, context_length=40), st.data())
@settings(max_examples=40, deadline=None)
def test_ring_slot_is_where_the_cache_writes_each_position(model, data):
    """The widget's ring_slot and ring_contents describe the real buffer: the row written
    for position p sits in slot ring_slot(p) of the cache's (private) buffer."""
    params, config = model
    ids = token_lists(data.draw, config, 1, 40)
    _, ring = kvlib.prefill(params, ids)
    _, full = kvlib.prefill(params, ids, kvlib.KVCache(config))
    contents = widgets.ring_contents(ring)
    held = ring.key_positions()
    assert sorted(p for p in contents if p != widgets.EMPTY_SLOT) == held.tolist()
    for layer in range(config.n_layers):
        for position in held:
            slot = widgets.ring_slot(int(position), config.window, config.sink_tokens)
            assert contents[slot] == position
            np.testing.assert_array_equal(ring._keys[layer, slot], full.keys(layer)[position])
            np.testing.assert_array_equal(ring._values[layer, slot],
                                          full.values(layer)[position])


@given(models(window=True, context_length=40), st.data())
@settings(max_examples=40, deadline=None)
def test_chunks_longer_than_the_window_equal_one_prefill(model, data):
    params, config = model
    ids = token_lists(data.draw, config, 2, 40)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=3)))
    cache, pieces = kvlib.make_cache(config), []
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):
        pieces.append(kvlib.prefill(params, ids[start:end], cache)[0])
    np.testing.assert_allclose(np.vstack(pieces), kvlib.forward(params, ids), rtol=0,
                               atol=TOLERANCE)
    np.testing.assert_array_equal(cache.key_positions(),
                                  kvlib.prefill(params, ids)[1].key_positions())


@given(st.integers(1, 30), st.integers(1, 8), st.integers(0, 3))
def test_visibility_kinds_agree_with_the_mask(n, window, sinks):
    kinds = widgets.visibility(n, window, sinks)
    positions = np.arange(n)
    mask = kvlib.attention_mask(positions, positions, window, sinks)
    np.testing.assert_array_equal(np.isin(kinds, [widgets.SINK, widgets.IN_WINDOW]), mask)
    np.testing.assert_array_equal(kinds == widgets.FUTURE, positions[None, :] > positions[:, None])
    assert (kinds[:, sinks:] != widgets.SINK).all()
    assert (kinds.sum(axis=1) >= 0).all() and set(np.unique(kinds)) <= {0, 1, 2, 3}


@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 2), st.integers(0, 10_000),
       st.data())
@settings(max_examples=40, deadline=None)
def test_a_stack_of_windows_reaches_layers_times_w_minus_one_back(n_layers, window, sinks,
                                                                   seed, data):
    """What the notebook shows for 1-3 layers, on random models: a token further back than
    L x (W - 1), and not a sink, changes nothing at all in the last output."""
    config = kvlib.ModelConfig(vocab_size=12, d_model=8, n_heads=2, n_layers=n_layers,
                               d_ff=8, context_length=32, positions="rotary", window=window,
                               sink_tokens=sinks)
    params = kvlib.init_params(config, seed=seed)
    ids = data.draw(st.lists(st.integers(1, 11), min_size=2, max_size=32))
    last = kvlib.forward(params, ids, last_only=True)
    reach = n_layers * (window - 1)
    for position in range(len(ids) - 1):
        if len(ids) - 1 - position <= reach or position < sinks:
            continue
        replaced = list(ids)
        replaced[position] = replaced[position] % 11 + 1
        assert (kvlib.forward(params, replaced, last_only=True) == last).all()


def test_the_ring_holds_what_the_notebook_prints():
    params = widgets.example_model()
    _, cache = widgets.window_cache(params, widgets.example_sequence(40), 4, 2)
    assert cache.key_positions().tolist() == [0, 1, 36, 37, 38, 39]
    assert widgets.ring_contents(cache).tolist() == [0, 1, 38, 39, 36, 37]
    _, cache = widgets.window_cache(params, widgets.example_sequence(3), 4, 2)
    assert widgets.ring_contents(cache).tolist() == [0, 1, 2, -1, -1, -1]
    assert [widgets.ring_slot(p, 4, 2) for p in range(10)] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    with pytest.raises(TypeError, match="SlidingWindowCache"):
        widgets.ring_contents(kvlib.KVCache(params.config))


def test_example_sequence_is_seeded_and_starts_with_bos():
    first, again = widgets.example_sequence(30), widgets.example_sequence(30)
    assert first == again and first[0] == 0 and len(first) == 30
    assert all(1 <= token < 12 for token in first[1:])
    assert widgets.example_sequence(64)[:30] == first


# ---------------------------------------------------------------------------------------------
# The pictures
# ---------------------------------------------------------------------------------------------

def test_draw_window_mask_shows_the_kinds_and_labels_its_axes():
    fig, ax = plt.subplots()
    widgets.draw_window_mask(ax, 12, 3, 1)
    np.testing.assert_array_equal(ax.images[0].get_array(), widgets.visibility(12, 3, 1))
    assert "W = 3, 1 sink" in ax.get_title()
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["in the window", "sink (kept for good)", "fell out of the window",
                      "after the query (causal)"]
    widgets.draw_window_mask(ax, 4, None)                     # full attention: nothing dropped
    assert "full attention" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "in the window", "after the query (causal)"]
    assert len(ax.images) == 1                            # cleared, not stacked


def test_draw_ring_writes_each_slots_position():
    fig, ax = plt.subplots()
    widgets.draw_ring(ax, [0, 1, 38, 39, 36, 37], 2, newest=39, next_slot=4)
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["0", "1", "38", "39", "36", "37"]
    boxes = [p for p in ax.patches if p.get_fill()]
    assert len(boxes) == 6
    assert boxes[3].get_facecolor()[:3] == matplotlib.colors.to_rgb(widgets.plots.NEW_ROWS_COLOR)
    assert [p for p in ax.patches if not p.get_fill()][0].get_x() == pytest.approx(4.06)
    widgets.draw_ring(ax, [0, -1, -1], 0)
    assert [t.get_text() for t in ax.texts] == ["0", "-", "-"]


def test_draw_cache_bytes_and_losses_plot_their_data():
    fig, ax = plt.subplots()
    widgets.draw_cache_bytes(ax, [1, 2, 3, 4], [10, 20, 30, 40], [10, 20, 20, 20], 2)
    full, ring = ax.lines[:2]
    assert list(full.get_ydata()) == [10, 20, 30, 40] and list(ring.get_ydata()) == [10, 20,
                                                                                     20, 20]
    assert "W = 2, 0 sinks" in ring.get_label()
    widgets.draw_window_losses(ax, [16, 32], {"window only": [3.0, 2.0], "window + 4 sinks":
                                          [2.5, 1.9]}, 1.5)
    assert [line.get_label() for line in ax.lines] == ["window only", "window + 4 sinks",
                                                       "full cache"]
    assert ax.lines[-1].get_ydata()[0] == 1.5 and ax.get_ylabel().startswith("held-out loss")


def test_the_loss_plots_draw_their_baselines_below_the_legend():
    fig, (left, right) = plt.subplots(1, 2)
    baselines = {"bigram": 2.5, "uniform guess": 5.6}
    widgets.draw_window_losses(left, [16, 32], {"window only": [5.0, 3.0]}, 0.6,
                           baselines=baselines)
    widgets.draw_loss_by_position(right, {"full cache": np.ones(20)}, 4, smoothing=4,
                              baselines=baselines)
    for ax in (left, right):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert lines["bigram"].get_ydata()[0] == 2.5
        assert lines["uniform guess"].get_ydata()[0] == 5.6
        assert lines["bigram"].get_linestyle() != lines["uniform guess"].get_linestyle()
        assert ax.get_ylim()[1] > 1.3 * 5.6           # the legend's band, above every line
        assert {t.get_text() for t in ax.get_legend().get_texts()} >= set(baselines)


def test_draw_loss_by_position_smooths_each_curve():
    fig, ax = plt.subplots()
    curve = np.arange(20, dtype=float)
    widgets.draw_loss_by_position(ax, {"full cache": curve, "window 4 only": curve + 1}, 4,
                              smoothing=4)
    full, window = ax.lines[:2]
    np.testing.assert_allclose(full.get_ydata(), np.convolve(curve, np.ones(4) / 4, "valid"))
    assert full.get_xdata()[0] == 3 and len(full.get_xdata()) == 17
    np.testing.assert_allclose(window.get_ydata(), full.get_ydata() + 1)
    assert ax.lines[2].get_xdata()[0] == 4                  # the window's dashed line
    assert "W = 4" in ax.get_title() and ax.get_xlabel().startswith("position")


def test_draw_reach_marks_the_reach_of_each_depth():
    fig, ax = plt.subplots()
    changes = np.array([[1.0, 0.5, 0.0, 0.0], [1.0, 0.5, 0.1, 0.01]])
    widgets.draw_reach(ax, changes, (1, 2), 2)
    image = ax.images[0].get_array()
    assert image.mask.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert [line.get_xdata()[0] for line in ax.lines] == [1.5, 2.5]


# ---------------------------------------------------------------------------------------------
# The widget, driven headless
# ---------------------------------------------------------------------------------------------

def test_widget_starts_from_its_arguments():
    widget = widgets.window_explorer(window=4, sink_tokens=2, n_tokens=40)
    assert widget.window.value == 4 and widget.sinks.value == 2 and widget.tokens.value == 40
    assert widget.state["contents"].tolist() == [0, 1, 38, 39, 36, 37]
    assert "holds 6 positions: 0-1, 36-39" in widget.status.value
    assert "Position 40 will go to slot 4" in widget.status.value
    assert f"<b>{widget.state['nbytes']:,} bytes</b>" in widget.status.value
    assert widget.state["nbytes"] == widget.state["cache"].nbytes == 2 * 3 * 6 * 4 * 8
    assert f"{kvlib.config_cache_bytes(widgets.example_model().config, 40):,} bytes" in \
        widget.status.value
    assert widget.message.value == ""


@pytest.mark.parametrize("window, sinks, n", [(1, 0, 1), (4, 0, 9), (7, 3, 64), (16, 4, 20),
                                              (5, 1, 6), (16, 0, 64)])
def test_widget_follows_its_sliders(window, sinks, n):
    widget = widgets.window_explorer()
    widget.window.value, widget.sinks.value, widget.tokens.value = window, sinks, n
    cache = widget.state["cache"]
    config = cache.config
    assert (config.window, config.sink_tokens, len(cache)) == (window, sinks, n)
    assert cache.nbytes == widget.state["nbytes"] == kvlib.config_cache_bytes(config, n)
    mask_ax, ring_ax = widget.axes
    np.testing.assert_array_equal(mask_ax.images[0].get_array(),
                                  widgets.visibility(n, window, sinks))
    expected = [widgets.EMPTY_SLOT] * (sinks + window)
    for position in cache.key_positions():
        expected[widgets.ring_slot(int(position), window, sinks)] = int(position)
    assert widget.state["contents"].tolist() == expected
    assert [t.get_text() for t in ring_ax.texts] == [str(p) if p >= 0 else "-" for p in expected]
    assert widget.message.value == ""


def test_widget_counts_in_words_with_one_of_each():
    widget = widgets.window_explorer(window=1, sink_tokens=1, n_tokens=1)
    status = widget.status.value
    assert "After 1 token the ring holds 1 position: 0." in status
    assert "x 1 row x" in status and "a full cache of 1 position:" in status
    assert widget.axes[1].get_title() == "The ring after 1 token: 1 sink slot + 1 window slot"
    assert not any(phrase in status for phrase in ("1 positions", "1 rows", "1 tokens"))
    widget.sinks.value, widget.tokens.value = 0, 2
    assert "After 2 tokens the ring holds 1 position: 1." in widget.status.value


def test_widget_redraws_in_place_without_leaks():
    widget = widgets.window_explorer()
    with no_new_figures():
        for step in range(15):
            widget.window.value = 1 + step % 16
            widget.sinks.value = step % 5
            widget.tokens.value = 1 + (7 * step) % 64
            slots = widget.sinks.value + widget.window.value
            mask_ax, ring_ax = widget.axes
            # redrawn, never accumulated: one image and one outline on the mask, one box per
            # slot and the next write's outline on the ring
            assert len(mask_ax.images) == 1 and len(mask_ax.patches) == 1
            assert len(ring_ax.texts) == slots and len(ring_ax.patches) == slots + 1
    assert len(widget.figure.axes) == 2


def test_widget_reports_an_impossible_window_in_its_message_line():
    params = kvlib.init_params(kvlib.ModelConfig(positions="rotary", context_length=8))
    widget = widgets.window_explorer(params, window=4, sink_tokens=2, n_tokens=8)
    status = widget.status.value
    widget.window.value = 8                              # 2 sinks + 8 > the context of 8
    assert "cannot exceed the context length" in widget.message.value
    assert widget.status.value == status                 # the last good state stays on show
    widget.sinks.value = 0
    assert widget.message.value == "" and "holds 8 positions" in widget.status.value


@pytest.mark.parametrize("options, error, phrase", [
    (dict(window=0), ValueError, "between 1 and 16"),
    (dict(window=2.5), TypeError, "whole number"),
    (dict(sink_tokens=5), ValueError, "between 0 and 4"),
    (dict(n_tokens=65), ValueError, "between 1 and 64"),
    (dict(params="toy"), TypeError, "kvlib Params"),
])
def test_widget_refuses_bad_arguments_in_words(options, error, phrase):
    with pytest.raises(error, match=phrase):
        widgets.window_explorer(**options)
    with pytest.raises(TypeError, match="without a window"):
        widgets.window_explorer(widgets.example_model().with_config(window=4))


# ---------------------------------------------------------------------------------------------
# Exercise 1: the positions a query sees
# ---------------------------------------------------------------------------------------------

RIGHT_POSITIONS = [0, 1, 2, 3] + list(range(905, 5001))


@pytest.mark.parametrize("answer, phrase", [
    (list(range(905, 5001)), "sinks stay visible"),
    ([0, 1, 2, 3] + list(range(904, 5001)), "one position too many"),
    ([0, 1, 2, 3] + list(range(904, 5000)), "ends at the query itself"),
    ([0, 1, 2, 3] + list(range(905, 5000)), "query itself is missing"),
    ([0, 1, 2, 3] + list(range(909, 5001)), "on top of the window"),
    ([0, 1, 2, 3, 4] + list(range(905, 5001)), "one sink too many"),
    (list(range(5001)), "full attention"),
    ([1, 2, 3, 4] + list(range(906, 5002)), "count from 0"),
    ([0, 1, 2, 3] + list(range(905, 5002)), "comes after the query"),
    ([0, 1, 2] + list(range(905, 5001)), "missing 1 (such as 3)"),
    ([0, 1, 2, 3, 7] + list(range(905, 5001)), "1 too many (such as 7)"),
    ([0, 0, 1, 2, 3] + list(range(905, 5001)), "appear twice"),
    (5000, "one number is not enough"),
    ("0, 1, 2, 3, 905..5000", "not text"),
    ([[0, 1, 2, 3], list(range(905, 5001))], "flat"),
    ([0, 1, 2, 3.5], "whole number"),
    ([0, 1, None], "whole number"),
    ([True, 1], "whole number"),
    (kvlib.attention_mask([5000], np.arange(5001), 4096, 4)[0], "give positions, not a mask"),
    (kvlib.attention_mask([5000], np.arange(5001), 4096, 4), "give positions, not a mask"),
    (kvlib.attention_mask([5000], np.arange(5001), 4096, 4)[0].tolist(), "np.flatnonzero"),
    ([10**5000, 1], "about 5,001 digits"),
], ids=case_id)
def test_visible_positions_wrong_answers(answer, phrase):
    not_yet(exercises.check_visible_positions(answer), phrase)


@pytest.mark.parametrize("answer", [
    RIGHT_POSITIONS,
    tuple(RIGHT_POSITIONS),
    np.array(RIGHT_POSITIONS),
    np.array(RIGHT_POSITIONS, dtype=float),
    set(RIGHT_POSITIONS),
    RIGHT_POSITIONS[::-1],
    [np.int64(p) for p in RIGHT_POSITIONS],
    np.flatnonzero(kvlib.attention_mask([5000], np.arange(5001), 4096, 4)[0]),
    (p for p in RIGHT_POSITIONS),
])
def test_visible_positions_right_answers_in_any_form(answer):
    correct(exercises.check_visible_positions(answer))


def test_visible_positions_is_the_masks_row():
    assert exercises.visible_positions() == RIGHT_POSITIONS
    assert exercises.visible_positions(5, 3, 1) == [0, 3, 4, 5]


# ---------------------------------------------------------------------------------------------
# Exercise 2: the ring slot
# ---------------------------------------------------------------------------------------------

def right_slot(position, window, sinks):
    return position if position < sinks else sinks + (position - sinks) % window


@pytest.mark.parametrize("ring_slot, phrase", [
    (lambda p, W, s: p % W, "ignores the sinks"),
    (lambda p, W, s: p % (W + s), "cycles through the sinks"),
    (lambda p, W, s: (p - s) % W if p >= s else p, "add s"),
    (lambda p, W, s: s + p % W if p >= s else p, "subtract the sinks first"),
    (lambda p, W, s: s + (p - s) % W, "keeps its own slot"),
    (lambda p, W, s: s + (p - s + 1) % W if p >= s else p, "without adding 1"),
    (lambda p, W, s: s + (p - s - 1) % W if p >= s else p, "without subtracting 1"),
    (lambda p, W, s: p, "the buffer has only"),
    (lambda p, W, s: 0, "should be"),
    (lambda p, W, s: 1 / 0, "ZeroDivisionError"),
    (lambda p, W, s: "slot", "one whole number"),
    (lambda p, W, s: 2.5, "one whole number"),
    (lambda p, W, s: None, "one whole number"),
    (lambda p, W: p % W, "TypeError"),
    ("p % W", "should be a function"),
    (3, "should be a function"),
])
def test_ring_slot_wrong_answers(ring_slot, phrase):
    not_yet(exercises.check_ring_slot(ring_slot), phrase)


@pytest.mark.parametrize("ring_slot", [
    right_slot,
    lambda p, W, s: np.int64(right_slot(p, W, s)),
    lambda p, W, s: float(right_slot(p, W, s)),
    lambda p, W, s: np.array([right_slot(p, W, s)]),
    lambda p, W, s: widgets.ring_slot(p, W, s),
    lambda p, W, s: int(np.where(p < s, p, s + (p - s) % W)),
])
def test_ring_slot_right_answers_in_any_form(ring_slot):
    correct(exercises.check_ring_slot(ring_slot))


def test_ring_slot_cases_match_the_cache():
    """The checker's expected slots are the cache's: where each case's position is written."""
    for position, window, sinks in exercises.SLOT_CASES:
        assert exercises._expected_slot(position, window, sinks) == \
            widgets.ring_slot(position, window, sinks)
    config = kvlib.ModelConfig(positions="rotary", window=3, sink_tokens=4, context_length=40)
    params = kvlib.init_params(config)
    _, ring = kvlib.prefill(params, [1] * 31)
    _, full = kvlib.prefill(params, [1] * 31, kvlib.KVCache(config))
    slot = exercises._expected_slot(30, 3, 4)
    np.testing.assert_array_equal(ring._keys[0, slot], full.keys(0)[30])


def test_every_slip_in_the_table_is_wrong_and_told_apart():
    expected = [right_slot(*case) for case in exercises.SLOT_CASES]
    outputs = [tuple(slip(*case) for case in exercises.SLOT_CASES)
               for slip, _ in exercises.SLOT_SLIPS]
    assert all(list(output) != expected for output in outputs)
    assert len(set(outputs)) == len(outputs)


# ---------------------------------------------------------------------------------------------
# Exercise 3: the bytes
# ---------------------------------------------------------------------------------------------

RIGHT_BYTES = 2 * 32 * 4100 * 8 * 128 * 2


@pytest.mark.parametrize("answer, phrase", [
    (2 * 32 * 10_000 * 8 * 128 * 2, "full cache"),
    (2 * 32 * 4096 * 8 * 128 * 2, "window alone"),
    (2 * 32 * 4099 * 8 * 128 * 2, "one row short"),
    (2 * 32 * 4100 * 32 * 128 * 2, "8 K/V heads"),
    (32 * 4100 * 8 * 128 * 2, "multiply by 2"),
    (2 * 4100 * 8 * 128 * 2, "one layer"),
    (2 * 32 * 4100 * 8 * 128 * 4, "not 4"),
    (2 * 32 * 4100 * 8 * 128 * 16, "not bits"),
    (0.5, "GiB"), (0.5005, "GiB"), (512.5, "MiB"), (512, "MiB"),
    (123456, "is not it"),
    (-RIGHT_BYTES, "negative"),
    ("537395200", "not text: write 537395200 without quotes"),
    ([RIGHT_BYTES, 1], "several numbers"),
    (True, "(a bool)"),
    (float("nan"), "got nan"),
    (float("inf"), "got inf"),
    (10**400, "401 digits"),
    (-(10**400), "401 digits"),
    (10**5000, "about 5,001 digits"),
    (537395200.5, "close"),
], ids=case_id)
def test_cache_bytes_wrong_answers(answer, phrase):
    not_yet(exercises.check_cache_bytes(answer), phrase)


@pytest.mark.parametrize("answer", [
    RIGHT_BYTES, float(RIGHT_BYTES), np.int64(RIGHT_BYTES), np.float32(RIGHT_BYTES),
    np.array(RIGHT_BYTES), np.array([RIGHT_BYTES]), [RIGHT_BYTES], (float(RIGHT_BYTES),),
    kvlib.kv_cache_bytes(32, None, 4100, dtype_bytes=2, n_kv_heads=8, head_dim=128),
])
def test_cache_bytes_right_answers_in_any_form(answer):
    correct(exercises.check_cache_bytes(answer))


def test_cache_bytes_is_what_a_live_window_cache_holds():
    """The same rule on a live cache: a window of 4 with 4 sinks after 30 tokens holds 8
    rows, the count exercise 3 scales up to Mistral's shapes."""
    config = kvlib.ModelConfig(positions="rotary", window=4, sink_tokens=4, context_length=32,
                               n_heads=2, n_kv_heads=1, dtype="float32")
    _, cache = kvlib.prefill(kvlib.init_params(config), [1] * 30)
    assert cache.nbytes == kvlib.kv_cache_bytes(3, None, 8, dtype_bytes=4, n_kv_heads=1,
                                                head_dim=2)
    assert exercises.mistral_cache_bytes() == RIGHT_BYTES
    assert kvlib.memory.PRESETS["Mistral-7B"].kv_cache_bytes(10_000) == \
        exercises.mistral_cache_bytes(sink_tokens=0)


# ---------------------------------------------------------------------------------------------
# The trained model's measurement: notebooks/data/window_losses.json, from tools/measure_windows
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def window_losses():
    return json.loads(WINDOW_LOSSES.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def held_out():
    """The held-out stories tools/measure_windows.py measured the windows on."""
    return measure_windows.story_sequences(measure_windows.HELD_OUT_SEQUENCES,
                                           measure_windows.HELD_OUT_SEED)


def test_the_saved_measurement_is_written_as_the_tool_writes_it(window_losses, tmp_path):
    measure_windows.write(window_losses, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text(encoding="utf-8") == \
        WINDOW_LOSSES.read_text(encoding="utf-8")
    n, first = window_losses["sequences"], window_losses["first_position"]
    assert (n, first, window_losses["predictions_per_sequence"]) == (64, 68, 187)
    assert window_losses["uniform"] == round(math.log(276), 6)
    names = {measure_windows.row_name(w, s) for w in (16, 32, 64) for s in (0, 1, 4)}
    assert set(window_losses["rows"]) == names | {
        "full cache", "bigram", "re-reading the last 16 afresh", "re-reading the last 32 afresh"}
    for row in window_losses["rows"].values():
        assert all(len(values) == n for values in row.values())
        assert row["forced_count"] == window_losses["rows"]["bigram"]["forced_count"]
    for name, curve in window_losses["by_position"].items():   # the same predictions
        assert len(curve) == 255
        assert abs(np.mean(curve[first:]) - np.mean(window_losses["rows"][name]["per_sequence"])) \
            < 1e-5


@pytest.mark.parametrize("window, sinks, sequences", [
    (None, 0, [5, 63]), (16, 0, [7]), (16, 4, [4, 40]), (32, 1, [12]), (64, 4, [30])])
def test_rows_of_the_saved_measurement_recomputed(window_losses, story_model, held_out, window,
                                                  sinks, sequences):
    """Rows the notebook does not recompute (it does the window of 32 on sequences 0-3)."""
    stories, _ = story_model
    model = stories if window is None else stories.with_config(window=window,
                                                               sink_tokens=sinks)
    picked = held_out[sequences]
    first = window_losses["first_position"]
    losses = measure_windows.model_losses(model, picked)
    forced = measure_windows.forced_predictions(picked)[:, first:]
    fresh = measure_windows.summary(losses[:, first:], forced, 276)
    saved = window_losses["rows"][measure_windows.row_name(window, sinks)]
    for key, values in fresh.items():
        np.testing.assert_allclose(values, [saved[key][i] for i in sequences], atol=2e-6)


def test_re_reading_afresh_recomputed_for_one_sequence(window_losses, story_model,
                                                       held_out):
    stories, _ = story_model
    first = window_losses["first_position"]
    for window in (16, 32):
        losses = measure_windows.afresh_losses(stories, held_out[[9]], window, first)
        saved = window_losses["rows"][f"re-reading the last {window} afresh"]
        assert losses.shape == (1, 187)
        assert abs(losses.mean() - saved["per_sequence"][9]) < 2e-6
        assert int((losses > math.log(276)).sum()) == saved["worse_than_uniform"][9]


def test_forced_predictions_are_the_repeats_of_the_grammar(held_out):
    forced = measure_windows.forced_predictions(held_out[:2])
    tokens = kvlib.stories.StoryTokenizer().tokens(held_out[0].tolist())
    names = {r.position for r in kvlib.stories.forced_repeats(tokens, "name") if r.earlier}
    assert names and all(forced[0, position - 1] for position in names)
    assert not forced[:, 0].any() and 0.1 < forced.mean() < 0.3


def test_what_the_notebook_reads_in_the_saved_measurement(window_losses):
    rows = window_losses["rows"]
    loss = {name: np.mean(row["per_sequence"]) for name, row in rows.items()}
    assert loss["full cache"] < loss["window 64"] < loss["bigram"] < loss["window 32"] \
        < loss["window 16"] < window_losses["uniform"]
    for window in (16, 32, 64):        # a sink never hurts here, and 4 help more than 1
        assert loss[f"window {window} + 4 sinks"] < loss[f"window {window} + 1 sink"] \
            < loss[f"window {window}"]
    assert min(loss["re-reading the last 16 afresh"], loss["re-reading the last 32 afresh"]) \
        > loss["bigram"]
    curve = np.convolve(window_losses["by_position"]["window 32"], np.ones(8) / 8, "valid")
    assert curve.max() > window_losses["uniform"]       # the peak the plot shows


# ---------------------------------------------------------------------------------------------
# The notebook: its solutions pass, its broken function fails with the right diagnosis
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def notebook_namespace():
    """The notebook's variables after its code cells ran headless, all but the trained
    model's measurement (nbval runs that; the exercises do not use it)."""
    cells, measuring = [], False
    for cell in notebook_cells("sliding_windows_and_sinks"):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            measuring = text.startswith("## Measured on a trained model") or (
                measuring and not text.startswith("## Where this lives"))
        if cell["cell_type"] == "code" and not measuring:
            cells.append(cell)
    return run_notebook("sliding_windows_and_sinks", cells)


def test_every_solution_passes_in_the_notebooks_variables(notebook_namespace):
    assert_solutions_pass(notebook_namespace, exercises, {1: exercises.check_visible_positions,
                                                          2: exercises.check_ring_slot,
                                                          3: exercises.check_cache_bytes})


def test_the_notebooks_broken_ring_slot_gets_its_diagnosis(notebook_namespace):
    not_yet(exercises.check_ring_slot(notebook_namespace["ring_slot_broken"]), "p % W",
            "overwrite them")


def test_the_second_solution_defines_ring_slot_fixed():
    assert "def ring_slot_fixed(" in exercises.SOLUTIONS[2]


# ---------------------------------------------------------------------------------------------
# On a real model: SmolLM2's sinks and windows (kvlib/models/smollm2/measured.json, written by
# tools/measure_smollm2.py), as the notebook reads them, and a row recomputed
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_measured():
    return kvlib.checkpoints.smollm2.measured()


def test_draw_sink_heads_draws_every_head_and_outlines_the_sinks():
    fig, ax = plt.subplots()
    on_first = np.array([[0.0, 0.2, 0.6], [0.999, 0.45, 0.51]])      # 2 layers, 3 heads
    image = widgets.draw_sink_heads(ax, on_first, 0.01, first_query=64)
    np.testing.assert_array_equal(image.get_array(), on_first.T)  # heads down, layers across
    assert image.get_clim() == (0.0, 1.0) and image.get_cmap().name == widgets.plots.COLORMAP
    assert [t.get_text() for t in ax.texts] == [".00", ".20", ".60", "1", ".45", ".51"]
    outlined = sorted((p.get_x() + 0.5, p.get_y() + 0.5) for p in ax.patches)
    assert outlined == [(0.0, 2.0), (1.0, 0.0), (1.0, 2.0)]       # (layer, head) above 0.5
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("layer", "query head")
    assert "3 of 6 heads above 0.5" in ax.get_title() and "0.010" in ax.get_title()
    assert "from position 64 on" in ax.get_title()
    assert len(fig.axes) == 2                                    # the colour bar
    for bad in (np.ones(3), np.array([[1.5]]), np.array([[np.nan]])):
        with pytest.raises(ValueError, match="layers, heads"):
            widgets.draw_sink_heads(ax, bad, 0.01)


def test_draw_sinks_won_back_draws_one_bar_a_window_grouped_by_model():
    fig, ax = plt.subplots()
    widgets.draw_sinks_won_back(ax, {"story model": {16: 0.092, 64: 0.09}, "SmolLM2": {64: 0.746}})
    heights = [bar.get_height() for bar in ax.patches]
    np.testing.assert_allclose(heights, [9.2, 9.0, 74.6])
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["9%", "W = 16", "9%", "W = 64", "75%", "W = 64"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["story model", "SmolLM2"]
    assert ax.patches[0].get_facecolor() != ax.patches[2].get_facecolor()


def test_smollm2s_sinks_as_the_notebook_reads_them(smol_measured, smollm2_tokenizer):
    sinks = smol_measured["sinks"]
    on_first = np.array(sinks["attention_on_position_0"])
    assert on_first.shape == (30, 9) and sinks["first_query"] == 64
    assert sinks["even_share"] == pytest.approx(np.mean(1 / (np.arange(64, 1024) + 1)))
    assert int((on_first > 0.5).sum()) == 46
    assert on_first.argmax() == 18 * 9 + 8 and on_first[18, 7] > 0.93
    assert on_first[[0, 1, 10, 11]].max() < 0.03 < on_first[3:10].min() / 0.8
    assert smollm2_tokenizer.decode(smol_measured["ids"][:1]) == "The"


def test_smollm2s_windows_as_the_notebook_reads_them(smol_measured):
    rows = smol_measured["windows"]["rows"]
    loss = {(r["window"], r["sinks"], r["positions"]): r["loss"] for r in rows}
    assert set(loss) == {(w, s, "original") for w in (64, 256) for s in (0, 4)} | \
        {(w, 4, "inside the cache") for w in (64, 256)}
    full = smol_measured["pairing"]["loss"]
    for window in (64, 256):
        alone, sinks = loss[(window, 0, "original")], loss[(window, 4, "original")]
        assert full < sinks < alone
        assert (alone - sinks) / (alone - full) > 0.7
        assert abs(sinks - loss[(window, 4, "inside the cache")]) < 0.002
    assert loss[(256, 0, "original")] < loss[(64, 0, "original")]


def test_a_row_of_smollm2s_sink_measurement_recomputed(smol_measured, smollm2):
    """Layer 1's row (the notebook recomputes layer 3's), the tool's way: the layers run one
    by one on the 1,024 measured tokens, each recording its attention weights."""
    first_two = kvlib.Params(smollm2.config.replace(n_layers=2), smollm2.embedding,
                             smollm2.layers[:2], None, smollm2.ln_f_gain, None)
    rows = {}
    measure_smollm2.layer_by_layer(first_two, smol_measured["ids"],
                                   lambda index, weights: rows.setdefault(
                                       index, weights[:, 64:, 0].mean(axis=1)))
    saved = np.array(smol_measured["sinks"]["attention_on_position_0"])
    for index in (0, 1):
        np.testing.assert_allclose(rows[index], saved[index], rtol=0, atol=2e-4)
