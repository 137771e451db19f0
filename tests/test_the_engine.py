"""Notebook 24 (the engine): its workload and variants, the widget and figures, and the
exercise checkers with their tables of typical wrong answers and valid answers in other
forms."""

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from checker_cases import (  # noqa: E402
    assert_answers_in_words,
    case_id,
    correct,
    not_yet,
    odd_answers,
)

import kvlib  # noqa: E402
from kvlib.checkpoints import smollm2  # noqa: E402
from kvlib.exercises import the_engine as ex24  # noqa: E402
from kvlib.serving import Engine, workloads  # noqa: E402
from kvlib.widgets import the_engine as w24  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "24_the_engine.ipynb"


@pytest.fixture(scope="module")
def params():
    return kvlib.load_smollm2()


@pytest.fixture(scope="module")
def requests():
    return workloads.workload(kvlib.smollm2_tokenizer())


def test_the_workload_shares_a_system_message_and_arrives_over_six_steps(requests):
    prompts = [prompt for _, prompt, _ in requests]
    assert [arrival for arrival, _, _ in requests] == workloads.ARRIVALS
    assert all(p[:16] == prompts[0][:16] for p in prompts), "one full block in common"
    assert max(len(p) for p in prompts) == 148
    assert all(s.stop_token_ids == (2,) for _, _, s in requests)


def test_the_committed_table_is_what_the_variants_give(params, requests):
    """The first row again (the notebook reruns it too); every row's outputs equal."""
    measured = smollm2.measured()["engine"]
    again = workloads.run_variant(workloads.variants(params)["the engine"](), requests)
    columns = workloads.STEP_COLUMNS + workloads.PER_STEP
    assert {k: again[k] for k in columns} == measured["rows"]["the engine"]
    assert all(set(row) == set(columns) for row in measured["rows"].values())
    assert again["outputs"] == measured["outputs"]
    assert set(measured["rows"]) == set(workloads.variants(params))


def make(params, n_blocks):
    return lambda: Engine(params, block_size=16, n_blocks=n_blocks, max_num_batched_tokens=64)


def test_the_widget_steps_runs_and_resets_without_leaking_figures(params, requests,
                                                                   monkeypatch):
    """Run to the end writes the text lines after every step and redraws the figure as it
    goes (every REDRAW_SECONDS; with 0, after every step), not once at the end."""
    figures = set(plt.get_fignums())
    widget = w24.engine_widget(make(params, 14), requests)
    engine = widget.state["engine"]
    assert len(engine.waiting) == 4 and "waiting: 0, 1, 2, 3" in widget.queue.value
    widget.controls["step"].click()
    assert engine.step_count == 1 and "running: 0, 1" in widget.queue.value
    assert "No request has finished yet" in widget.service.value
    texts, drawings = [], []
    status = w24.queue_status
    monkeypatch.setattr(w24, "queue_status", lambda *a: texts.append(1) or status(*a))
    drawing = w24.draw_engine_pool
    monkeypatch.setattr(w24, "draw_engine_pool", lambda *a: drawings.append(1) or drawing(*a))
    monkeypatch.setattr(w24, "REDRAW_SECONDS", 0.0)
    widget.controls["run"].click()
    steps = engine.step_count - 1
    assert not engine.has_unfinished_requests() and len(engine.requests) == 8
    assert len(texts) >= steps and len(drawings) >= steps, (len(texts), len(drawings))
    assert "preemption" in widget.queue.value and "time to first token" in widget.service.value
    assert widget.message.value == ""
    widget.controls["reset"].click()
    assert widget.state["engine"] is not engine and widget.state["engine"].step_count == 0
    assert set(plt.get_fignums()) == figures


def test_a_pool_smaller_than_a_request_says_so_and_serves_the_others(params, requests):
    """9 blocks hold every request but the passage (10 blocks): it is named with the
    engine's reason, the queue says it was refused, and the seven others all finish."""
    widget = w24.engine_widget(make(params, 9), requests)
    widget.controls["run"].click()
    engine = widget.state["engine"]
    assert not engine.has_unfinished_requests() and len(engine.requests) == 7
    assert all(r.status == "finished" for r in engine.requests.values())
    assert "Request 6 (148 prompt tokens" in widget.message.value
    assert "needs 10 blocks" in widget.message.value and "9 in all" in widget.message.value
    assert "refused: 6" in widget.queue.value and "finished: 7 of 7" in widget.queue.value
    widget.controls["step"].click()                      # nothing left: says so again, no error
    assert "Request 6" in widget.message.value and "Traceback" not in widget.message.value


@pytest.mark.parametrize("n_blocks, words", [
    (1, "No request so far can be served"), (0, "the engine could not be made")])
def test_a_pool_of_one_block_or_none_gives_a_message_not_a_traceback(params, requests,
                                                                     n_blocks, words):
    widget = w24.engine_widget(make(params, n_blocks), requests)
    assert words in widget.message.value
    for control in ("step", "run", "step", "reset"):
        widget.controls[control].click()
        assert words in widget.message.value or "no engine" in widget.message.value
    if n_blocks == 1:
        engine = widget.state["engine"]
        assert "refused: 0, 1, 2, 3" in widget.queue.value
        widget.controls["run"].click()                   # idle steps let the later ones arrive
        assert widget.state["next"] == 8 and not engine.requests


def test_the_notebook_states_the_benchmarks_figures_as_the_committed_data_gives_them():
    """Notebook 24 quotes benchmarks/data/engine.json (measured on this project's machine, not
    timed here): its words must be the file's figures, as benchmark_figures rounds them."""
    notebook = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    texts = [" ".join("".join(cell["source"]).split()) for cell in notebook["cells"]
             if cell["cell_type"] == "markdown"]
    text = next(t for t in texts if t.startswith("`benchmarks/engine.py` measures in seconds"))
    f = w24.benchmark_figures(w24.engine_benchmark())
    for phrase in (
            f"On SmolLM2 the engine gave {f['smollm2 ratio']} times the output tokens a second "
            f"of `kvlib.generate` one request after another ({f['smollm2 engine']} against "
            f"{f['smollm2 generate']})",
            f"on the story model {f['stories ratio']} times ({f['stories engine']} against "
            f"{f['stories generate']})",
            f"took {f['attention 64']} times as long as gathering the blocks and attending once "
            f"at 64 positions, and {f['attention 512']} times at 512"):
        assert phrase in text, phrase


def test_the_pool_figure_colours_every_block_by_its_state(params, requests):
    engine = Engine(params, block_size=16, n_blocks=20, max_num_batched_tokens=64)
    ids = []
    workloads.add_arrivals(engine, requests, ids)
    for _ in range(3):
        engine.step()
    fig, axes = plt.subplots(2, 1)
    w24.draw_engine_pool(axes[0], engine)
    w24.draw_batch(axes[1], engine)
    labels = [t.get_text() for t in axes[0].texts if (t.get_gid() or "").startswith("block")]
    assert len(labels) == 20 and "step 3" in axes[0].get_title()
    assert any(label.startswith("shared") for label in labels) and "" in labels
    assert axes[1].get_xlabel() and "Step 3" in axes[1].get_title()
    plt.close(fig)


# --------------------------------------------------------------------------- exercise 1

@pytest.mark.parametrize("answer, words", [
    ({0: 1, 1: 1, 2: 6}, "prefix cache"), ({0: 1, 1: 1, 2: 2, 3: 5}, "does not fit"),
    ({0: 1, 1: 1}, "request 2 fits"), ({0: 10, 1: 1, 2: 2}, "exactly 1 token"),
    ({0: 1, 2: 2}, "exactly 1 token"), ({0: 1, 1: 1, 2: 3}, "not {0: 1, 1: 1, 2: 3}"),
    ({0: 11, 1: 9}, "already have K and V in the cache"),        # 11 + 9 = the budget of 20
    ({0: 11, 1: 9, 2: 0, 3: 0}, "nobody is preempted here"),
    ({0: 1, 1: 1, 2: 2, 4: 1}, "there is no request 4"), ({0: 1, 1: -1}, "0 tokens or more"),
    ({0: 1, 1: 1, 2: 2.5}, "not a whole number"), ({0: 1, 1: 1, 2: 10**5000}, "digits"),
    ([1, 1, 2], "a dict"), ({"0": 1}, "not text"),
])
def test_exercise_1_diagnoses_typical_mistakes(answer, words):
    not_yet(ex24.check_schedule(answer), words)


@pytest.mark.parametrize("answer", [{0: 1, 1: 1, 2: 2}, {2: 2, 0: 1, 1: 1},
                                    {0: 1.0, 1: 1, 2: 2.0}, {0: 1, 1: 1, 2: 2, 3: 0},
                                    {0: np.int64(1), 1: 1, 2: 2, 3: 0.0}])
def test_exercise_1_accepts_the_answer_in_any_form(answer):
    """A request listed with 0 tokens is one that does not run this step."""
    correct(ex24.check_schedule(answer), "request 3 would need 2 blocks")


@pytest.mark.parametrize("label, answer", odd_answers(), ids=case_id)
def test_exercise_1_answers_anything_in_words(label, answer):
    assert_answers_in_words(ex24.check_schedule, answer)


# --------------------------------------------------------------------------- exercise 2

def pops_the_callers_list(prompt):
    prompt.pop()
    return prompt


def sorts_the_callers_list(prompt):
    prompt.sort(reverse=True)
    return sorted(prompt)[:-1]


@pytest.mark.parametrize("function, words", [
    (ex24.buggy_tokens_to_look_up, "nothing is left to run"),
    (lambda p: list(p), "nothing is left to run"),
    (lambda p: p[1:], "not the prompt's tokens"),
    (lambda p: p[:-2], "1 full block of 4"),                      # 9 tokens: reuses 1 of 2
    (lambda p: p[:-5], "Leave out only the last token"),
    (lambda p: p[:len(p) // 4 * 4 - 1], "Leave out only the last token"),
    (lambda p: p[:-1] if len(p) < 10 or len(p) % 4 == 0 else p[:4], "a prompt of 10 tokens"),
    (lambda p: p[:-1] + [999], "not the prompt's tokens"),
    (lambda p: p[::-1][1:], "not the prompt's tokens"),
    (pops_the_callers_list, "changed the list it was given"),
    (sorts_the_callers_list, "changed the list it was given"),
    (lambda p: [float(t) for t in p[:-1]], "whole numbers (ints)"),
    (lambda p: [str(t) for t in p[:-1]], "text"),
    (lambda p: [True] * (len(p) - 1), "a bool"),
    (lambda p: [10**5000] * (len(p) - 1), "5,001 digits"),
    (lambda p: [math.inf] * (len(p) - 1), "inf"),
    (lambda p: [math.nan] * (len(p) - 1), "nan"),
    (lambda p: np.array(p[:-1], dtype=float), "an array"),
    (lambda p: [p[:-1]], "a list"),
    (lambda p: set(p[:-1]), "a list of token ids"),
    (lambda p: "".join(map(str, p[:-1])), "a list of token ids"),
    (lambda p: p[-1], "a list of token ids"),
    (lambda p: None, "not filled in"),
    (lambda p: None if len(p) > 9 else p[:-1], "returned nothing"),
    (lambda p: 1 / 0, "ZeroDivisionError"),
    ("p[:-1]", "a function"),
])
def test_exercise_2_diagnoses_typical_mistakes(function, words):
    not_yet(ex24.check_tokens_to_look_up(function), words)


def nano_vllm_leaves_out_the_last_block(prompt):
    """nano-vllm's lookup (BlockManager.can_allocate: range(seq.num_blocks - 1)): every
    block but the last, full or not: the blocks prompt[:-1] covers."""
    blocks = -(-len(prompt) // ex24.BLOCK_SIZE)
    return prompt[:(blocks - 1) * ex24.BLOCK_SIZE]


def test_exercise_2_accepts_every_fix_that_reuses_the_same_blocks():
    namespace = {}
    exec(ex24.SOLUTIONS[2], namespace)
    for function in (namespace["tokens_to_look_up"], lambda p: tuple(p[:len(p) - 1]),
                     lambda p: [t for t in p[:-1]], nano_vllm_leaves_out_the_last_block,
                     lambda p: p[:-4] if len(p) % 4 == 0 else p,
                     lambda p: p[:(len(p) - 1) // 4 * 4], lambda p: np.array(p[:-1]),
                     lambda p: [np.int64(t) for t in p[:-1]], lambda p: range(3, 3)
                     if len(p) < 5 else p[:-1]):
        correct(ex24.check_tokens_to_look_up(function), "last token always runs")


@pytest.mark.parametrize("label, answer", odd_answers(), ids=case_id)
def test_exercise_2_answers_anything_in_words(label, answer):
    assert_answers_in_words(ex24.check_tokens_to_look_up, answer)


# --------------------------------------------------------------------------- exercise 3

@pytest.mark.parametrize("answer, words", [("b", "counted in steps"), ("c", "0 preemptions"),
                                           ("d", "keeps the prefix cache"), ("e", "one of")])
def test_exercise_3_diagnoses_each_wrong_reason(answer, words):
    not_yet(ex24.check_static_ttft(answer), words)


@pytest.mark.parametrize("answer", ["a", "A", " a ", "(a)"])
def test_exercise_3_accepts_the_letter_in_any_form(answer):
    correct(ex24.check_static_ttft(answer), "continuous batching")


@pytest.mark.parametrize("label, answer", odd_answers(), ids=case_id)
def test_exercise_3_answers_anything_in_words(label, answer):
    assert_answers_in_words(ex24.check_static_ttft, answer)


def test_the_solutions_pass():
    namespace = {"exercises": ex24}
    exec(ex24.SOLUTIONS[1], namespace)
    correct(ex24.check_schedule(namespace["answer"]))
    exec(ex24.SOLUTIONS[3], namespace)
    correct(ex24.check_static_ttft(namespace["answer"]))
    with pytest.raises(ValueError, match="no exercise 4"):
        ex24.solution(4)
