"""What is true of every exercise checker of the series, in one place.

Every check_* function of every lesson module (kvlib/exercises/<slug>.py, slugs from
notebooks/lessons.json) is found by name, and ANSWERS below says what its answer looks like.
For each of them:

- an untouched answer (`...`, or None) is "not filled in yet";
- odd answers (checker_cases: odd_answers of the answer's own shape and of 1-, 2- and 3-d
  shapes, and MORE_ODD_ANSWERS) are refused with a Feedback in plain words (in_words: no
  doubled "Not yet: not yet:", numbers shown plainly, never np.int64(1) or array([...])),
  never with an exception, 10**5000 (which Python refuses to print) included;
- anything hypothesis builds (student_answers) is answered in plain words;
- a checker that takes a function answers in words whatever the function returns or raises;
- its lesson's notebook calls it once, on the student's untouched answer (`answer`, or the
  name in CALLED_ON), and the committed output says "not filled in yet".

Every lesson's solutions are shown with their code. The lessons' test modules hold each
checker's tables of typical wrong answers (each with its diagnosis) and of valid answers in
other forms, and run the solutions in their notebooks.
"""

import importlib
import inspect
import json
import re
from dataclasses import dataclass

import lessons
import numpy as np
import pytest
from checker_cases import (
    MORE_ODD_ANSWERS,
    UNPRINTABLE,
    answers_of_shape,
    assert_answers_in_words,
    case_id,
    functions_returning,
    in_words,
    not_yet,
    odd_answers,
    student_answers,
)
from hypothesis import HealthCheck, given, settings

import kvlib
from kvlib.exercises import base
from kvlib.exercises.base import Feedback

LESSONS = lessons.load()


@dataclass(frozen=True)
class Returns:
    """The answer is a function; `shape` is the shape of what it should return (None: one
    number, or a list of any length)."""

    shape: tuple[int, ...] | None = None


ANSWERS = {
    # lesson.checker: the shape of a right answer (None: a number, a word, a dict, a list of
    # any length), or Returns(...) for a checker that takes the student's function
    "big_picture.check_logits_shape": (2,),
    "big_picture.check_next_token": None,
    "embedding_lookup.check_sentence_embedding": (5, 4),
    "embedding_lookup.check_one_hot": (4, 12),
    "embedding_lookup.check_gpt2_table_size": None,
    "one_attention_head.check_head1_scores": (5, 5),
    "one_attention_head.check_head1_scaled_scores": (5, 5),
    "one_attention_head.check_strongest_key": None,
    "causal_masking.check_mask": (7, 7),
    "causal_masking.check_masked_weights": (7, 7),
    "causal_masking.check_changed_rows": (3,),
    "multi_head_attention.check_head_slice": (5, 4),
    "multi_head_attention.check_three_heads": (3, 5, 2),
    "multi_head_attention.check_attention_output": (7, 4),
    "mlp_residual_stream.check_hidden_shape": (2,),
    "mlp_residual_stream.check_second_block": (7, 4),
    "mlp_residual_stream.check_gelu_values": (3,),
    "logits_next_token.check_predictions_per_position": (7,),
    "logits_next_token.check_temperature_for_half": None,
    "logits_next_token.check_top_k": (12,),
    "prefill.check_layer_keys": (4, 4),
    "prefill.check_cache_bytes": None,
    "prefill.check_serve": Returns((12,)),
    "kv_cached_decode.check_decode_weights": (2, 1, 7),
    "kv_cached_decode.check_chunked_prefill": Returns((3, 12)),
    "kv_cached_decode.check_generation_loop": Returns((8,)),
    "counting_the_work.check_forward_macs": None,
    "counting_the_work.check_flop_ratio": None,
    "counting_the_work.check_attention_crossover": None,
    "where_time_goes.check_roofline_time": None,
    "where_time_goes.check_batched_bytes": None,
    "where_time_goes.check_time_to_first_token": None,
    "kv_cache_memory.check_bytes_per_token": None,
    "kv_cache_memory.check_batch_where_cache_equals_weights": None,
    "kv_cache_memory.check_tokens_that_fit": None,
    "real_model.check_decode_position": Returns((1, 12)),
    "real_model.check_xl_cache": None,
    "what_the_heads_read.check_name_head": (2,),
    "what_the_heads_read.check_copy_window": None,
    "positions_and_rope.check_continue": Returns((5, 12)),
    "positions_and_rope.check_pair_angle": None,
    "positions_and_rope.check_keeps_scores": (5,),
    "grouped_query_attention.check_cache_bytes_from_config": None,
    "grouped_query_attention.check_grouped_decode": Returns((8, 1, 2)),   # or the output itself
    "grouped_query_attention.check_query_group": None,
    "latent_attention.check_latent_bytes_per_token": None,
    "latent_attention.check_head_scores": Returns((6,)),
    "latent_attention.check_why_rope_is_not_absorbed": None,
    "sliding_windows_and_sinks.check_visible_positions": None,
    "sliding_windows_and_sinks.check_ring_slot": Returns(None),
    "sliding_windows_and_sinks.check_cache_bytes": None,
    "model_of_today.check_llama32_cache": None,
    "model_of_today.check_to_interleaved": Returns((5, 16)),
    "model_of_today.check_reusable_positions": None,
    "paged_cache.check_blocks_and_slack": (2,),
    "paged_cache.check_gather": Returns((7, 4)),
    "paged_cache.check_forked_blocks": None,
    "prefix_caching.check_reusable_tokens": (4,),
    "prefix_caching.check_block_key": Returns(None),
    "prefix_caching.check_eviction_order": (4,),
    "batched_decoding.check_padded_mask": (3, 5, 5),
    "batched_decoding.check_compute_bound_batch": None,
    "batched_decoding.check_admitted": None,
    "batched_decoding.check_admitted_with_budget": None,
    "quantized_cache.check_codes": (8,),
    "quantized_cache.check_codes_with_fixed_scale": (8,),
    "quantized_cache.check_bytes_per_token": None,
    "quantized_cache.check_huge_channel_prediction": None,
    "quantized_cache.check_round_trip_per_token": Returns((6, 4)),
    "speculative_decoding.check_tokens_per_pass": None,
    "speculative_decoding.check_speculative_round": Returns(None),
    "speculative_decoding.check_acceptance_probabilities": (4,),
    "the_engine.check_schedule": None,
    "the_engine.check_tokens_to_look_up": Returns(None),
    "the_engine.check_static_ttft": None,
    "when_the_cache_is_wrong.check_where": (2,),
    "when_the_cache_is_wrong.check_fixed_step": Returns((1, 276)),
    "when_the_cache_is_wrong.check_bug_or_rounding": (4,),
    "local_and_global_layers.check_cache_bytes": None,
    "local_and_global_layers.check_blocks_to_free": None,
    "local_and_global_layers.check_global_layers": None,
    "keeping_what_attention_reads.check_tova_drop": None,
    "keeping_what_attention_reads.check_evicting_bytes": None,
    "keeping_what_attention_reads.check_snapkv_kept": (5,),
    "state_layers.check_state_bytes": None,
    "state_layers.check_truncate_lengths": None,
    "state_layers.check_resumable_tokens": (2,),
}
ANY_SHAPES = [(4,), (1, 12), (8, 1, 2)]
"""Shapes of odd arrays every checker also meets, whatever its answer's shape."""
MORE_ARGUMENTS = {
    "prefill.check_serve": lambda: (kvlib.KVCache(kvlib.init_params().config),),
}
"""Checkers given more than the answer in their notebook: a maker of the other arguments (each
checker is also called on the answer alone)."""
CALLED_ON = {
    "prefill.check_serve": "answer, server_cache",
    "model_of_today.check_to_interleaved": "to_interleaved",
    "quantized_cache.check_codes": "codes",
    "quantized_cache.check_codes_with_fixed_scale": "codes_next",
    "the_engine.check_tokens_to_look_up": "tokens_to_look_up",
}
"""What a notebook calls a checker on, where it is not `answer`."""
KNOWN_FAILURES = {
    # checker: (what its known failure says, a regular expression), where the bug is
}
"""Bugs these tests found in checkers that take a function, excused in the tests of functions
returning odd values until they are fixed; test_the_known_failures_are_still_there says when
an entry can go."""


def all_checkers() -> dict:
    """{"lesson.check_x": function} for every check_* function defined in a lesson module."""
    found = {}
    for lesson in LESSONS:
        module = importlib.import_module(f"kvlib.exercises.{lesson.slug}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("check_") and function.__module__ == module.__name__:
                found[f"{lesson.slug}.{name}"] = function
    return found


CHECKERS = all_checkers()
TAKES_A_FUNCTION = [name for name, answer in ANSWERS.items() if isinstance(answer, Returns)]


def shape_of(name):
    answer = ANSWERS[name]
    return answer.shape if isinstance(answer, Returns) else answer


def argument_lists(name) -> list[tuple]:
    """What a checker is called with after the answer: nothing, and its notebook's arguments."""
    return [()] + ([MORE_ARGUMENTS[name]()] if name in MORE_ARGUMENTS else [])


def odd_answers_for(shape) -> list[tuple[str, object]]:
    """The odd answers for an answer of this shape: odd_answers(shape), MORE_ODD_ANSWERS and
    odd arrays of 1-, 2- and 3-d shapes."""
    answers = odd_answers(shape) + MORE_ODD_ANSWERS
    for other in ANY_SHAPES:
        if other != shape:
            answers += [(f"{label} {other}", answer) for label, answer in answers_of_shape(other)]
    return answers


def problem_with(check, answer, *arguments) -> str | None:
    """None when the checker refuses the answer with a Feedback in plain words, else what
    went wrong (an exception, not a Feedback, words that are not plain, a pass)."""
    try:
        feedback = in_words(check(answer, *arguments))
    except Exception as error:            # the assertion of in_words too
        return f"{type(error).__name__}: {error}"
    return f"passed: {feedback.message}" if feedback.passed else None


def refusals(name, answers) -> list[str]:
    """What is wrong with the checker's replies to these answers, one line an answer."""
    check = CHECKERS[name]
    return [f"{label}: {problem}" for arguments in argument_lists(name)
            for label, answer in answers
            if (problem := problem_with(check, answer, *arguments)) is not None]


def is_known(name, problem: str) -> bool:
    return name in KNOWN_FAILURES and re.search(KNOWN_FAILURES[name][0], problem) is not None


def odd_returns(name) -> list[tuple[str, object]]:
    return functions_returning(odd_answers_for(shape_of(name)))


ANYTHING = settings(max_examples=60, deadline=None,       # as many as the lessons' tests drew
                    suppress_health_check=[HealthCheck.too_slow])


def test_every_checker_of_every_lesson_says_what_its_answer_looks_like():
    assert sorted(ANSWERS) == sorted(CHECKERS)
    assert {name.split(".")[0] for name in CHECKERS} == {lesson.slug for lesson in LESSONS}


@pytest.mark.parametrize("name", CHECKERS)
def test_an_untouched_answer_is_not_filled_in_yet(name):
    for untouched in (..., None):
        for arguments in argument_lists(name):
            not_yet(CHECKERS[name](untouched, *arguments), "not filled in yet")


@pytest.mark.parametrize("name", CHECKERS)
def test_every_odd_answer_is_refused_in_plain_words(name):
    problems = refusals(name, odd_answers_for(shape_of(name)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", TAKES_A_FUNCTION)
def test_a_function_is_refused_in_plain_words_whatever_odd_thing_it_returns(name):
    problems = [problem for problem in refusals(name, odd_returns(name))
                if not is_known(name, problem.split(": ", 1)[1])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", KNOWN_FAILURES)
def test_the_known_failures_are_still_there(name):
    """When this fails, the checker is fixed: remove its entry from KNOWN_FAILURES."""
    assert any(is_known(name, problem.split(": ", 1)[1])
               for problem in refusals(name, odd_returns(name))), KNOWN_FAILURES[name][1]


@pytest.mark.parametrize("name", CHECKERS)
@ANYTHING
@given(answer=student_answers)
def test_anything_a_student_types_is_answered_in_plain_words(name, answer):
    for arguments in argument_lists(name):
        assert_answers_in_words(CHECKERS[name], answer, *arguments)


@pytest.mark.parametrize("name", TAKES_A_FUNCTION)
@ANYTHING
@given(value=student_answers)
def test_a_function_is_answered_in_plain_words_whatever_it_returns(name, value):
    for arguments in argument_lists(name):
        try:
            assert_answers_in_words(CHECKERS[name], lambda *args, **kwargs: value, *arguments)
        except Exception as error:
            if not is_known(name, f"{type(error).__name__}: {error}"):
                raise


def cell_text(output) -> str:
    text = output["data"]["text/plain"] if "data" in output else output["text"]
    return "".join(text)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.slug)
def test_the_notebook_calls_each_checker_once_on_an_untouched_answer(lesson):
    notebook = json.loads((lessons.ROOT / lesson.notebook).read_text(encoding="utf-8"))
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for name in (name for name in CHECKERS if name.startswith(f"{lesson.slug}.")):
        arguments = re.escape(CALLED_ON.get(name, "answer"))
        call = re.compile(rf"^exercises\.{name.split('.')[1]}\({arguments}\)$", re.M)
        calling = [cell for cell in cells if call.search("".join(cell["source"]))]
        assert len(calling) == 1, f"{name} is called in {len(calling)} cells"
        shown = cell_text(calling[0]["outputs"][-1])
        assert shown.startswith("Not yet:") and "not filled in yet" in shown, (name, shown)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda lesson: lesson.slug)
def test_every_solution_is_shown_with_its_code(lesson):
    exercises = importlib.import_module(f"kvlib.exercises.{lesson.slug}")
    assert sorted(exercises.SOLUTIONS) == list(range(1, len(exercises.SOLUTIONS) + 1))
    for number, code in exercises.SOLUTIONS.items():
        shown = exercises.solution(number).data
        assert shown.startswith(f"**Solution to exercise {number}**") and code.strip() in shown
    with pytest.raises(ValueError, match="there is no exercise 9"):
        exercises.solution(9)


@pytest.mark.parametrize("message", [
    "not yet: look at token 0.", "Not yet: x", "Correct: x", "  correct: x",
    "the code is np.int64(3)", "got array([1, 2])", "got np.float64(nan)", "dtype='<U1'",
    "got array([None], dtype=object)", "(np.str_('x'))", "np.bool_(True) is not",
])
def test_the_words_check_catches_doubled_prefixes_and_numpy_reprs(message):
    with pytest.raises(AssertionError):
        in_words(Feedback(False, message))


def test_plain_words_pass_the_words_check():
    in_words(Feedback(False, "look at token 0: the chance is min(1, p / q); use np.argmax."))
    in_words(Feedback(False, "use dtype=bool, or np.array([1, 0, 1], dtype=float)."))
    in_words(Feedback(True, "correctly done: 2.176 tokens a pass."))


@pytest.mark.parametrize("answer, text", [
    (np.int64(7), "7"), (np.float64(2.5), "2.5"), (np.float64("nan"), "nan"),
    (np.array([1, 2]), "[1, 2]"), (np.array(3), "3"), (np.str_("x"), "'x'"),
    ((np.int64(1), np.int64(2)), "(1, 2)"), ([np.float32(0.5)], "[0.5]"),
    (True, "True"), (10**400, "a number of 401 digits"),
    (UNPRINTABLE, "a number of about 5,001 digits"), ([UNPRINTABLE], "[a number of about"),
    ((None, (None, (None, (None, np.int64(7))))), "(None, (None, (None, (...))))"),
    (np.zeros((20, 3)), "an array of shape (20, 3)"), (len, "len"),
    (object(), "an instance of object"),
], ids=case_id)
def test_answers_are_shown_plainly(answer, text):
    assert base.shown(answer).startswith(text)


def test_shown_answers_are_short():
    assert len(base.shown(list(range(1000)))) <= 60
    assert len(base.shown("x" * 1000)) <= 60
