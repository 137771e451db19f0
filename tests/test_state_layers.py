"""The state_layers lesson (a cache that does not grow): prefix reuse on a grid of kept states
(resumable_length, prefix_hits) and resuming a hybrid cache at a snapshot, proven equal to a
fresh prefill on random prompts in float64; the snapshot explorer driven headless (what it
draws and says, nothing leaks); the committed measurements against the code that made them;
the exercise checkers with tables of typical wrong answers (each with its diagnosis) and of
valid answers in other forms; and the published solutions in the notebook's own variables."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from checker_cases import correct, not_yet
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, run_notebook
from widget_checks import no_new_figures, text_of

from kvlib import hybrid, stories
from kvlib.checkpoints.hybrid import load_hybrid
from kvlib.exercises import state_layers as exercises
from kvlib.hybrid_cache import HybridCache, common_prefix, prefix_hits, resumable_length
from kvlib.widgets import state_layers as widgets

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "notebooks" / "data" / "state_layers.json").read_text())
HYBRID = load_hybrid("stories-hybrid", "float64")


# ---------------------------------------------------------------------------- prefix reuse

def resumable_by_search(matching: int, n_prompt: int, every: int) -> int:
    """The plain reference: the largest kept length (a multiple of every) that is at most the
    match and leaves a token to compute."""
    return max([0] + [n for n in range(every, n_prompt, every) if n <= matching])


@given(matching=st.integers(0, 400), n_prompt=st.integers(1, 400), every=st.integers(1, 600))
def test_resumable_length_is_the_last_kept_length_within_the_match(matching, n_prompt, every):
    assert resumable_length(matching, n_prompt, every) == \
        resumable_by_search(matching, n_prompt, every)


def test_resumable_length_refuses_bad_input_in_words():
    for bad, words in (((5, 0, 4), "n_prompt"), ((-1, 5, 4), "shared"), ((5, 5, 0), "every"),
                       ((5.5, 5, 4), "shared")):
        with pytest.raises((ValueError, TypeError), match=words):
            resumable_length(*bad)


def test_prefix_hits_on_a_small_workload():
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7]]
    assert prefix_hits(prompts, 1) == [0, 4, 6, 0]
    assert prefix_hits(prompts, 4) == [0, 4, 4, 0]
    assert prefix_hits(prompts, 8) == [0, 0, 0, 0]
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), matching=st.integers(1, 80), first_extra=st.integers(0, 30),
       second_extra=st.integers(1, 30), every=st.integers(1, 40))
def test_resuming_at_a_snapshot_equals_a_fresh_prefill(seed, matching, first_extra,
                                                       second_extra, every):
    """A hybrid cache that held another prompt, truncated to the last snapshot within the
    match and given the rest of a new prompt, gives the logits of the new prompt alone
    (float64, the trained model, random token ids)."""
    rng = np.random.default_rng(seed)
    vocabulary = HYBRID.config.vocab_size
    start = rng.integers(0, vocabulary, matching).tolist()
    first = start + rng.integers(0, vocabulary, first_extra).tolist()
    second = start + [(t + 1) % vocabulary for t in rng.integers(0, vocabulary, 1)] \
        + rng.integers(0, vocabulary, second_extra - 1).tolist()
    if first_extra and second[matching] == first[matching]:
        second[matching] = (second[matching] + 1) % vocabulary
    cache = HybridCache(HYBRID.config, snapshot_every=every)
    hybrid.hybrid_prefill(HYBRID, first, cache)
    resume = resumable_length(common_prefix(first, second), len(second), every)
    assert resume == 0 or resume in cache.snapshot_positions
    cache.truncate(resume)
    rest, _ = hybrid.hybrid_prefill(HYBRID, second[resume:], cache)
    fresh, _ = hybrid.hybrid_prefill(HYBRID, second)
    np.testing.assert_allclose(rest, fresh[resume:], atol=1e-10)


def test_truncating_between_snapshots_refuses_and_changes_nothing():
    cache = HybridCache(HYBRID.config, snapshot_every=6)
    ids = list(range(1, 21))
    hybrid.hybrid_prefill(HYBRID, ids, cache)
    for token in (3, 4, 5):
        hybrid.hybrid_decode_step(HYBRID, token, cache)
    allowed = [n for n in range(len(cache) + 1) if _truncates(cache, n)]
    assert allowed == exercises.allowed_lengths() == [0, 6, 12, 18, 23]


def _truncates(cache: HybridCache, n: int) -> bool:
    saved = cache.checkpoint()
    try:
        cache.truncate(n)
    except ValueError as error:
        assert "cannot truncate" in str(error) and len(cache) == 23
        return False
    cache.restore(saved)
    return True


# ---------------------------------------------------------------------------- the widget

CHAT = {"requests": DATA["chat"]["requests"], "conversation": DATA["chat"]["conversation"]}


def bar_heights(widget) -> tuple[list[float], list[float]]:
    prompts, hits = widget.axes[0].containers
    return [b.get_height() for b in prompts], [b.get_height() for b in hits]


def test_the_explorer_draws_each_prompt_and_what_it_skips():
    widget = widgets.snapshot_explorer(CHAT, 1000, every=16)
    lengths, hits = bar_heights(widget)
    assert lengths == [len(p) for p in CHAT["requests"]]
    assert hits == prefix_hits(CHAT["requests"], 16) == widget.hits()
    rate = sum(hits) / sum(lengths)
    status = text_of(widget.status.value)
    assert f"hit rate {rate:.1%}" in status
    longest = max(lengths)
    assert f"({longest} tokens): {longest // 16} x 1,000 = {longest // 16 * 1000:,} bytes" in status


def test_the_explorer_follows_its_controls_without_leaking_figures():
    widget = widgets.snapshot_explorer(CHAT, 39_518_208)
    with no_new_figures():
        for every in widgets.SPACINGS:
            widget.every.value = every
            widget.workload.value = "conversation"
            assert widget.hits() == prefix_hits(CHAT["conversation"], every)
            assert str(every) in widget.axes[0].get_title()
            widget.workload.value = "requests"
    widget.every.value = 528
    assert widget.hits() == [0] * 8 and "hit rate 0.0%" in widget.status.value


def test_the_explorer_refuses_a_spacing_it_does_not_offer():
    with pytest.raises(ValueError, match="every must be one of"):
        widgets.snapshot_explorer(CHAT, 1, every=17)
    with pytest.raises(ValueError, match="workload must be one of"):
        widgets.snapshot_explorer(CHAT, 1, workload="chat")


def test_the_explorer_answers_in_under_a_second():
    import time
    widget = widgets.snapshot_explorer(CHAT, 1)
    start = time.perf_counter()
    widget.every.value = 1
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------- the data

def test_the_chat_workload_is_the_engine_lessons_and_the_conversation_grows():
    requests, turns = CHAT["requests"], CHAT["conversation"]
    assert len(requests) == len(turns) == 8
    assert turns[0] == requests[0]
    for earlier, later in zip(turns, turns[1:]):
        assert later[:len(earlier)] == earlier


def test_the_copy_measurements_agree_with_the_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    import measure_state_layers as tool

    ids, positions = tool.stretched_story(0, 64)
    assert ids == DATA["example"]["ids"] and positions == DATA["example"]["positions"]
    rows = DATA["copying"]
    assert [r["filler"] for r in rows["stories"]["stretched"]] == list(tool.FILLERS)
    story = stories.load_model("stories", "float32")
    guesses = tool.predicted(story, __import__("kvlib").forward, ids)
    assert sum(int(guesses[p - 1] == ids[p]) for p in positions) == \
        DATA["example"]["copied"]["stories"]
    assert all(r["count"] == tool.TRIALS * 6 for r in rows["stories"]["stretched"])


# ---------------------------------------------------------------------------- exercise 1

@pytest.mark.parametrize("answer, words", [
    (37_748_736, "matrices alone"), (40_108_032, "K = 4"), (52_690_944, "48 layers"),
    (79_036_416, "float32"), (19_759_104, "counts numbers"), (1_097_728, "one layer"),
    (20_643_840, "per value head"), (18_874_368, "per value head"), (-5, "negative"),
    (39_000_000, "close"), (1e3, "not that"), ("39518208", "not text"),
])
def test_exercise_1_diagnoses_typical_mistakes(answer, words):
    not_yet(exercises.check_state_bytes(answer), words)


@pytest.mark.parametrize("answer", [39_518_208, 39518208.0, np.int64(39_518_208), 3.95e7,
                                    3.952e7, [39_518_208]])
def test_exercise_1_accepts_the_answer_in_any_form(answer):
    correct(exercises.check_state_bytes(answer), "39,518,208")


# ---------------------------------------------------------------------------- exercise 2

@pytest.mark.parametrize("answer, words", [
    ([6, 12, 18], "0 is always allowed"), ([0, 6, 12, 18], "23, the current length"),
    ([6, 12, 18, 23], "0 is always allowed"), ([0, 6, 12, 18, 23, 24], "above 23"),
    ([0, 5, 11, 17, 23], "not 5, 11, 17"), ([0, 6, 12, 18, 20, 23], "prompt ended"),
    ([0, 6, 12, 18, 21, 22, 23], "decode steps keep no snapshot"),
    (list(range(24)), "mixed every token"), ([0, 6, 23], "also kept a snapshot at [12, 18]"),
    ([0, 6, 12, 18, 19, 23], "19"), ([0, 6.5], "whole number"), ([], "a list of lengths"),
    (23, "a list of lengths"),
])
def test_exercise_2_diagnoses_typical_mistakes(answer, words):
    not_yet(exercises.check_truncate_lengths(answer), words)


@pytest.mark.parametrize("answer", [[0, 6, 12, 18, 23], (23, 18, 12, 6, 0), {0, 6, 12, 18, 23},
                                    np.array([0, 6, 12, 18, 23]), [0.0, 6, 12, 18, 23],
                                    [0, 6, 6, 12, 18, 23]])
def test_exercise_2_accepts_the_answer_in_any_form(answer):
    correct(exercises.check_truncate_lengths(answer), "nothing to undo")


# ---------------------------------------------------------------------------- exercise 3

@pytest.mark.parametrize("answer, words", [
    ((896, 528), "swapped"), ((900, 900), "only resume"), ((528, 900), "only resume"),
    ((1056, 896), "round down"), ((528, 912), "round down"), ((0, 896), "one state"),
    ((512, 896), "multiple of 528"), ((528, 880), "one block short"),
    ((528, 800), "multiple of 16"), ((528,), "2"), ("528, 896", "got text"),
])
def test_exercise_3_diagnoses_typical_mistakes(answer, words):
    not_yet(exercises.check_resumable_tokens(answer), words)


@pytest.mark.parametrize("answer", [(528, 896), [528, 896], np.array([528, 896]),
                                    (528.0, np.int64(896))])
def test_exercise_3_accepts_the_answer_in_any_form(answer):
    correct(exercises.check_resumable_tokens(answer), "472")


# ---------------------------------------------------------------------------- the notebook

def test_the_solutions_pass_in_the_notebook(monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")             # the notebook reads data/ beside it
    assert_solutions_pass(run_notebook("state_layers"), exercises,
                          {1: exercises.check_state_bytes, 2: exercises.check_truncate_lengths,
                           3: exercises.check_resumable_tokens})
    with pytest.raises(ValueError, match="no exercise 4"):
        exercises.solution(4)
