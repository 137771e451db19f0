"""Notebook 25 (when the cache is wrong): the table and figure of the precision measurements,
and the exercise checkers with their tables of typical wrong answers and valid answers in
other forms."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import case_id, correct, not_yet

import kvlib
from kvlib import cache_bugs as bugs
from kvlib.exercises import when_the_cache_is_wrong as exercises
from kvlib.widgets import when_the_cache_is_wrong as widgets

P = len(exercises.exercise_prompt())


def test_the_table_shows_every_row_and_comparison():
    text = widgets.table("smollm2")
    assert text.count("\n") == 1 + len(widgets.rows("smollm2"))
    assert "bfloat16  the cache" in text and "padded vs alone" in text
    with pytest.raises(ValueError, match="no precision measurements for 'gpt3'"):
        widgets.rows("gpt3")


@pytest.mark.usefixtures("no_figure_leaks")
def test_the_figure_labels_its_axes_and_leaks_nothing():
    fig, ax = plt.subplots()
    widgets.draw_precision(ax, "stories", "the story model")
    assert ax.get_yscale() == "log" and ax.get_ylabel() and ax.get_title() == "the story model"
    assert len(ax.patches) == 2 * len(widgets.rows("stories"))
    plt.close(fig)


@pytest.mark.usefixtures("no_figure_leaks")
def test_the_zoo_widget_draws_every_run_and_leaks_nothing():
    widget = widgets.zoo_widget()
    assert "given the learned position 60" in widget.status.value
    for label in widgets.zoo_runs():
        for number_format in widgets.TOLERANCES:
            widget.controls["format"].value = number_format
            widget.controls["bug"].value = label
            assert widget.message.value == "", widget.message.value
            assert "rows each of the 15 decode steps computes" in widget.status.value
            tolerance = widgets.TOLERANCES[number_format]
            assert ("its default" if tolerance is None else f"{tolerance:g}, measured") in \
                widget.status.value
    widget.controls["bug"].value = "8 cache never read"
    rows = ", ".join(str(32 + step) for step in range(15))
    assert "nothing parts" in widget.status.value and f"[{rows}]" in widget.status.value
    ax = widget.figure.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() and ax.get_ylabel()
    # in bfloat16 the right loop's logits are often exactly those of recomputation: the zeros
    # are drawn at the floor with their own marker, and the legend names them
    widget.controls["bug"].value = "none: the right loop"
    widget.controls["format"].value = "bfloat16"
    labels = [text.get_text() for text in widget.figure.axes[0].get_legend().get_texts()]
    assert any(f"exactly 0 (drawn at {widgets.FLOOR:g})" in label for label in labels), labels
    assert any("the floor, where 0 is drawn" in label for label in labels), labels


def test_every_right_loop_of_the_zoo_is_left_alone_with_the_measured_tolerance():
    """The widget's right loops (plain and windowed) in every format: nothing parts, with the
    tolerance the widget says (tools/measure_tolerances.py measured the same loops)."""
    runs = widgets.zoo_runs()
    for label in ("none: the right loop", "5 window, the right loop"):
        for number_format in widgets.TOLERANCES:
            assert runs[label][number_format]["report"] is None, (label, number_format)


def test_the_zoo_widget_finds_the_window_bug_where_it_starts_in_every_format():
    # with bfloat16's old tolerance, 5e-2, the window one short (0.0495) slipped to a later
    # quantity and read as "a stale row"
    runs = widgets.zoo_runs()["5 window one short"]
    for number_format in widgets.TOLERANCES:
        report = runs[number_format]["report"]
        assert report.startswith("decode step 0, layer 0, head 0, position 30: attention "
                                 "weights"), report
        assert "window too narrow" in report


@pytest.mark.parametrize("label, number_format", [
    ("1 offset that jumps", "float32"), ("6 prefix key without parent", "float16"),
    ("8 cache never read", "float32"),
])
def test_the_committed_zoo_runs_of_bugs_are_what_run_bug_gives(label, number_format):
    # a real bug stands far above rounding: the same report on any processor
    story, tokenizer = exercises.story_model()
    differences, found, rows = kvlib.cache_bugs.run_bug(story, tokenizer,
                                                        exercises.exercise_prompt(), label,
                                                        number_format)
    committed = widgets.zoo_runs()[label][number_format]
    assert (None if found is None else str(found)) == committed["report"]
    assert rows == committed["rows"]
    np.testing.assert_allclose(differences, np.array(committed["differences"], dtype=float),
                               rtol=0.05, atol=1e-5)


@pytest.mark.parametrize("number_format, rounding", [("float16", 5e-2), ("bfloat16", 0.25)])
def test_the_right_loop_in_16_bits_parts_by_rounding_only_here_as_in_the_file(number_format,
                                                                             rounding):
    # where and by how much depends on the processor's rounding (its BLAS kernel): only the
    # size is the same everywhere, a few of the format's steps at these logits
    story, tokenizer = exercises.story_model()
    differences, _, rows = kvlib.cache_bugs.run_bug(story, tokenizer, exercises.exercise_prompt(),
                                                    "none: the right loop", number_format)
    committed = widgets.zoo_runs()["none: the right loop"][number_format]
    assert rows == committed["rows"]
    for run in (differences, np.array(committed["differences"], dtype=float)):
        assert np.nanmax(run) < rounding


# --------------------------------------------------------------------------- exercise 1

def test_the_mystery_step_is_found_where_exercise_1_says():
    params, _ = exercises.story_model()
    found = kvlib.debug.first_divergence(params, exercises.exercise_prompt(), 6,
                                         exercises.mystery_decode_step)
    assert (found.step, found.layer, found.quantity) == (0, 0, "cached k")
    assert f"given the learned position {P - 1}" in found.reading


@pytest.mark.parametrize("answer, phrases", [
    ((1, P - 1), ["steps count from 0"]),
    ((0, P), [f"{P} is where the new token should sit"]),
    ((P - 1, 0), ["swapped"]),
    ((2, P - 1), ["step 2 is not where the report points"]),
    ((0, 12), ["position 12 is not the one in the report"]),
    ((-1, P - 1), ["no negative step"]),
    ((0,), ["should have 2 numbers"]),
    ((0, P - 1.5), ["not a whole number"]),
    ("0, 29", ["tuple of 2 whole numbers"]),
    ((None, P - 1), ["None is how the report names the prefill", "decode step"]),
    ((None, None), ["None is how the report names the prefill"]),
    (((0,), (P - 1,)), ["plain numbers"]),
    (..., ["not filled in"]),
], ids=case_id)
def test_exercise_1_diagnoses_each_wrong_answer(answer, phrases):
    not_yet(exercises.check_where(answer), *phrases)


@pytest.mark.parametrize("answer", [(0, P - 1), [0, P - 1], np.array([0, P - 1]),
                                    (0.0, float(P - 1)), (np.int64(0), np.int64(P - 1))],
                         ids=case_id)
def test_exercise_1_accepts_the_answer_in_every_form(answer):
    correct(exercises.check_where(answer), "decode step 0", "one too early")


def test_exercise_1_solution_runs():
    scope = {"debug": kvlib.debug, "story": exercises.story_model()[0], "exercises": exercises,
             "exercise_prompt": exercises.exercise_prompt()}
    exec(exercises.SOLUTIONS[1], scope)
    correct(exercises.check_where(scope["answer"]))


# --------------------------------------------------------------------------- exercise 2

def _recompute_everything():
    seen = []

    def step(params, token_id, cache):
        if not seen:
            seen.extend(exercises.exercise_prompt())
        seen.append(int(token_id))
        kvlib.decode_step(params, token_id, cache)
        return kvlib.forward(params, seen, last_only=True)
    return step


def _never_appends(params, token_id, cache):
    return kvlib.forward(params, list(exercises.exercise_prompt()) + [int(token_id)],
                         last_only=True)


def _one_too_far(params, token_id, cache):
    return bugs.run_blocks(params, [token_id], np.array([len(cache) + 1]), cache, None, None)


def _placeholder(params, token_id, cache):
    ...


def _step_with(change):
    """kvlib's right step, its logits changed by change(position, logits)."""
    def step(params, token_id, cache):
        return change(len(cache), kvlib.decode_step(params, token_id, cache).copy())
    return step


def _one_nan(position, logits):
    logits[0, 3] = np.nan
    return logits


def _wrong_from_the_eleventh_new_position(position, logits):
    # the checker decodes 16 new tokens; a step wrong only 10 positions past the prompt
    return logits + 5 * (np.arange(logits.shape[1]) % 2) if position >= P + 10 else logits


STEP_MISTAKES = [
    (exercises.mystery_decode_step, ["still finds", "learned position"]),
    (_one_too_far, ["still finds", "learned position"]),
    (_recompute_everything(), ["the cache is not read"]),
    (_never_appends, ["still finds", "cache length"]),
    (lambda params, token_id, cache: 1 / 0, ["ZeroDivisionError"]),
    (lambda params, token_id: None, ["TypeError"]),
    (lambda params, token_id, cache: np.zeros((1, 3)), ["still finds", "cache length"]),
    (_step_with(lambda position, logits: logits * np.nan), ["not all finite"]),
    (_step_with(_one_nan), ["not all finite"]),
    (_step_with(lambda position, logits: np.where(logits > logits.max() - 1, np.inf, logits)),
     ["not all finite"]),
    (_step_with(_wrong_from_the_eleventh_new_position), ["still finds", "logits"]),
    (_placeholder, ["not filled in"]),
    (exercises.mystery_decode_step(exercises.story_model()[0], 1, kvlib.prefill(
        exercises.story_model()[0], [1, 2])[1]), ["function", "array"]),
    ("fixed_decode_step", ["function", "text"]),
    (..., ["not filled in"]),
]


@pytest.mark.parametrize("answer, phrases", STEP_MISTAKES, ids=case_id)
def test_exercise_2_diagnoses_each_wrong_answer(answer, phrases):
    not_yet(exercises.check_fixed_step(answer), *phrases)


def test_exercise_2_accepts_the_solution_and_kvlibs_own_step():
    scope = {"kvlib": kvlib, "np": np}
    exec(exercises.SOLUTIONS[2], scope)
    correct(exercises.check_fixed_step(scope["answer"]), "one row")
    correct(exercises.check_fixed_step(kvlib.decode_step), "one row")
    correct(exercises.check_fixed_step(bugs.decode_step), "one row")


# --------------------------------------------------------------------------- exercise 3

RIGHT = {"A": "rounding", "B": "bug", "C": "rounding", "D": "bug"}


@pytest.mark.parametrize("answer, phrases", [
    ({"A": "bug", "B": "bug", "C": "bug", "D": "bug"}, ["not A, C", "2 to 3 significant digits"]),
    (["rounding"] * 4, ["not B, D", "tiny-llm PR #46", "mlx-lm PR #390"]),
    (["bug", "rounding", "bug", "rounding"], ["not A, B, C, D"]),
    ({"A": "rounding", "B": "bug", "C": "bug", "D": "bug"}, ["not C", "order of the sums"]),
    ({"A": "rounding", "B": "bug", "C": "rounding"}, ["each of A, B, C and D"]),
    (["rounding", "bug", "rounding"], ["four verdicts", "got 3"]),
    ({"A": "maybe", "B": "bug", "C": "rounding", "D": "bug"}, ["could not read", "A"]),
    ({"A": ..., "B": ..., "C": ..., "D": ...}, ["not filled in"]),
    ({"a": "bug", "A": "rounding", "B": "bug", "C": "rounding", "D": "bug"}, ["given twice"]),
    ({"A": "rounding", "b": "bug", "B": "bug", "C": "rounding", "D": "bug"}, ["given twice"]),
    (3, ["four words"]),
    (..., ["not filled in"]),
], ids=case_id)
def test_exercise_3_diagnoses_each_wrong_answer(answer, phrases):
    not_yet(exercises.check_bug_or_rounding(answer), *phrases)


@pytest.mark.parametrize("answer", [
    RIGHT, {"a": "Rounding", "b": "BUG", "c": "round", "d": "b"},
    ["rounding", "bug", "rounding", "bug"], ("r", "b", "r", "b"),
    "rounding, bug, rounding, bug", "r b r b", np.array(["rounding", "bug", "rounding", "bug"]),
], ids=case_id)
def test_exercise_3_accepts_the_verdicts_in_every_form(answer):
    correct(exercises.check_bug_or_rounding(answer), "A and C are rounding")


def test_exercise_3_reports_carry_the_committed_numbers():
    reports = exercises.reports()
    assert set(reports) == set(RIGHT)
    assert "bfloat16" in reports["A"] and "float32" in reports["C"]
