"""Notebook 19 (the paged KV cache): memory_plan and PoolTimeline against live pools and
plain references (hypothesis, float64, 1e-10), the pool explorer driven headless, the
drawings, and the exercise checkers with tables of wrong and valid answers."""

import math
import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
from checker_cases import (
    assert_answers_in_words,
    case_id,
    not_yet,
    odd_answers,
    student_answers,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from notebook_runs import assert_solutions_pass, run_notebook
from strategies import models

import kvlib
from kvlib import plots
from kvlib.exercises import paged_cache as ex19
from kvlib.serving import (
    BlockAllocator,
    ContiguousArena,
    PagedKVCache,
    PoolTimeline,
    SamplingParams,
    memory_plan,
)
from kvlib.serving.request import requests_of_lengths
from kvlib.widgets import paged_cache as w19

TOLERANCE = 1e-10


def req(prompt_length, output_length, arrival=0):
    """A request of these lengths (its prompt seeded ids of the toy's vocabulary)."""
    return requests_of_lengths([prompt_length], [output_length], [arrival])[0]


def counting_pool(n_blocks, block_size, context_length=64):
    config = kvlib.ModelConfig(vocab_size=2, d_model=1, n_heads=1, n_layers=1, d_ff=1,
                               context_length=context_length)
    return BlockAllocator(config, n_blocks, block_size)


# ---------------------------------------------------------------------------------------------
# memory_plan: formulas against live pools
# ---------------------------------------------------------------------------------------------

@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.integers(1, 20))
@settings(max_examples=80, deadline=None)
def test_paged_memory_equals_a_live_pool(lengths, block_size):
    pool = counting_pool(n_blocks=sum(-(-n // block_size) for n in lengths),
                         block_size=block_size)
    caches = []
    for n in lengths:
        cache = PagedKVCache(pool)
        for _ in range(n):                     # token by token, as decoding writes
            cache.append(0, np.ones((1, 1)), np.ones((1, 1)))
        caches.append(cache)
        assert cache.nbytes == memory_plan.blocks_for(n, block_size) * pool.block_bytes
    plan = memory_plan.paged_memory(lengths, block_size, 64, pool.block_bytes // block_size)
    assert pool.n_used == plan.block_table_entries
    assert pool.nbytes_in_use == plan.paged_bytes == sum(c.nbytes for c in caches)
    assert plan.used_positions == sum(lengths)
    assert plan.reserved_positions == 64 * len(lengths)
    assert 0 <= plan.paged_positions - plan.used_positions < block_size * len(lengths)
    assert plan.largest_slack == max(memory_plan.slack(n, block_size) for n in lengths)
    assert plan.largest_slack < block_size


@given(st.integers(1, 30), st.integers(0, 30), st.integers(1, 5), st.integers(1, 8))
@settings(max_examples=80, deadline=None)
def test_parallel_sampling_blocks_equal_live_forks(prompt, new, n, block_size):
    pool = counting_pool(n_blocks=200, block_size=block_size)
    first = PagedKVCache(pool)
    first.append(0, np.zeros((prompt, 1)), np.zeros((prompt, 1)))
    samples = [first] + [first.fork() for _ in range(n - 1)]
    for position in range(new):
        for index, sample in enumerate(samples):
            row = np.full((1, 1), 1000.0 * index + position)
            sample.append(0, row, row)
    pool.check_invariants()
    assert pool.n_used == memory_plan.parallel_sampling_blocks(prompt, new, n, block_size)
    assert memory_plan.separate_sampling_blocks(prompt, new, n, block_size) == \
        n * memory_plan.blocks_for(prompt + new, block_size)
    for index, sample in enumerate(samples):   # copy-on-write: each sees its own rows only
        expected = np.concatenate([np.zeros(prompt), 1000.0 * index + np.arange(new)])
        np.testing.assert_array_equal(sample.keys(0)[:, 0], expected)


def test_memory_table_rows_and_their_ratios():
    requests = [req(10, 5), req(3, 1), req(30, 34)]
    rows = memory_plan.memory_table(requests, [1, 4, 16], 64, bytes_per_position=10)
    assert [r.block_size for r in rows] == [1, 4, 16]
    assert [r.block_table_entries for r in rows] == [83, 4 + 1 + 16, 1 + 1 + 4]
    assert [r.paged_positions for r in rows] == [83, 84, 96]
    sixteen = rows[2]
    assert sixteen.used_bytes == 830 and sixteen.paged_bytes == 960
    assert sixteen.reserved_bytes == 3 * 64 * 10
    assert sixteen.paged_waste == pytest.approx(1 - 83 / 96)
    assert sixteen.reserved_waste == pytest.approx(1 - 83 / 192)
    assert sixteen.reserved_over_paged == pytest.approx(2.0)
    assert sixteen.largest_slack == 12       # the 4-token request in a block of 16


def test_request_mix_is_seeded_and_bounded():
    mix = memory_plan.request_mix(200, 1024, seed=5, mean_gap=2)
    assert list(map(repr, mix)) == list(map(repr, memory_plan.request_mix(200, 1024, seed=5,
                                                                          mean_gap=2)))
    assert [r.prompt_token_ids for r in mix] == \
        [r.prompt_token_ids for r in memory_plan.request_mix(200, 1024, seed=5, mean_gap=2)]
    assert list(map(repr, mix)) != list(map(repr, memory_plan.request_mix(200, 1024, seed=6,
                                                                          mean_gap=2)))
    assert all(16 <= r.num_prompt_tokens <= 512 and 16 <= r.max_tokens <= 512 for r in mix)
    arrivals = [r.arrival for r in mix]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(r.arrival == 0 for r in memory_plan.request_mix(5, 32))
    toy = memory_plan.request_mix(50, 32, seed=0, shortest=3)
    assert all(3 <= r.num_prompt_tokens <= 16 and r.max_num_tokens <= 32 for r in toy)


@pytest.mark.parametrize("call, error, words", [
    (lambda: memory_plan.request_mix(0, 32), ValueError, "n_requests must be at least 1"),
    (lambda: memory_plan.request_mix(4, 32, shortest=17), ValueError, "at most"),
    (lambda: memory_plan.request_mix(4, 32, mean_gap=-1), ValueError, "mean_gap"),
    (lambda: memory_plan.request_mix(4, 32, seed=1.5), TypeError, "seed"),
    (lambda: memory_plan.blocks_for(5, 0), ValueError, "block_size must be at least 1"),
    (lambda: memory_plan.blocks_for(2.5, 4), TypeError, "n_tokens must be a whole number"),
    (lambda: memory_plan.paged_memory([], 4, 32), ValueError, "lengths is empty"),
    (lambda: memory_plan.paged_memory("abc", 4, 32), TypeError, "lengths must be"),
    (lambda: memory_plan.paged_memory([40], 4, 32), ValueError, "longer than max_length"),
    (lambda: memory_plan.paged_memory([0], 4, 32), ValueError, "lengths must be >= 1"),
    (lambda: memory_plan.memory_table([4], [0], 32), ValueError, "block_sizes must be >= 1"),
    (lambda: memory_plan.memory_table([4], "4", 32), TypeError, "block_sizes must be"),
    (lambda: requests_of_lengths([0], [4]), ValueError, "prompt_lengths must be >= 1"),
    (lambda: SamplingParams(max_tokens=True), TypeError, "max_tokens must be a whole number"),
    (lambda: memory_plan.parallel_sampling_blocks(4, 2, 0, 4), ValueError, "n_samples"),
])
def test_memory_plan_refuses_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ---------------------------------------------------------------------------------------------
# ContiguousArena: first fit against a brute-force search
# ---------------------------------------------------------------------------------------------

def first_fitting_start(owners, n):
    for start in range(len(owners) - n + 1):
        if (owners[start:start + n] == -1).all():
            return start
    return None


@given(st.integers(4, 40), st.lists(st.tuples(st.booleans(), st.integers(1, 12)),
                                    max_size=40))
@settings(max_examples=80, deadline=None)
def test_contiguous_arena_is_first_fit(size, operations):
    arena = ContiguousArena(size)
    holders, next_owner = [], 0
    for reserve, n in operations:
        if reserve or not holders:
            expected = first_fitting_start(arena.owners, n)
            before = arena.owners.copy()
            if expected is None:
                with pytest.raises(MemoryError, match="external fragmentation|no hole"):
                    arena.reserve(next_owner, n)
                np.testing.assert_array_equal(arena.owners, before)   # nothing changed
            else:
                assert arena.reserve(next_owner, n) == expected
                holders.append(next_owner)
            next_owner += 1
        else:
            arena.release(holders.pop(n % len(holders)))
        holes = arena.holes()
        assert sum(length for _, length in holes) == arena.n_free
        for start, length in holes:
            assert (arena.owners[start:start + length] == -1).all()
        assert arena.largest_hole == max((length for _, length in holes), default=0)


def test_contiguous_arena_errors():
    arena = ContiguousArena(10)
    arena.reserve(1, 4)
    with pytest.raises(ValueError, match="already holds"):
        arena.reserve(1, 2)
    with pytest.raises(ValueError, match="holds no reservation"):
        arena.release(2)
    with pytest.raises(ValueError, match="n_positions must be at least 1"):
        ContiguousArena(0)
    assert "6 of 10 positions free" in repr(arena)


# ---------------------------------------------------------------------------------------------
# PoolTimeline: every step equal to contiguous caches; preemption changes no token
# ---------------------------------------------------------------------------------------------

@st.composite
def timelines(draw):
    params, config = draw(models(latent=False, window=False))
    n = draw(st.integers(1, 6))
    requests = []
    for _ in range(n):
        prompt = draw(st.integers(1, 10))
        output = draw(st.integers(1, 10))
        requests.append((prompt, output, draw(st.integers(0, 6))))
    requests = requests_of_lengths(*zip(*requests), seed=draw(st.integers(0, 99)),
                                   vocab_size=config.vocab_size)
    block_size = draw(st.integers(1, 5))
    largest = max(memory_plan.blocks_for(r.max_num_tokens, block_size) for r in requests)
    n_blocks = draw(st.integers(largest, largest + 12))
    forks = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), max_size=3))
    return params, requests, n_blocks, block_size, forks, draw(st.integers(0, 1000))


@given(timelines())
@settings(max_examples=40, deadline=None)
def test_timeline_steps_equal_contiguous_caches_and_never_leak(case):
    params, requests, n_blocks, block_size, forks, seed = case
    timeline = PoolTimeline(params, requests, n_blocks, block_size, seed=seed, temperature=0)
    ample = PoolTimeline(params, requests, 400, block_size, seed=seed, temperature=0)
    ample.run()
    forked = set()
    for _ in range(300):
        if timeline.all_done:
            break
        for step, which in forks:
            if step == timeline.step_number and timeline.running:
                forked.add(timeline.fork(
                    timeline.running[which % len(timeline.running)].request_id))
        timeline.step()
        assert timeline.check() < TOLERANCE         # includes: no block leaked
        snapshot = timeline.history[-1]
        assert snapshot.blocks_in_use == timeline.pool.n_used
        assert 0 <= snapshot.paged_positions - snapshot.used_positions <= \
            (block_size - 1) * len(timeline.running)
    assert timeline.all_done
    timeline.pool.check_invariants()
    assert timeline.pool.n_free == n_blocks                 # every block given back
    outputs = {seq.request_id: seq.output_token_ids for seq in timeline.finished}
    assert outputs.keys() - forked == {seq.request_id for seq in ample.finished}
    for seq in ample.finished:                   # preempted or not: the same greedy tokens
        assert outputs[seq.request_id] == seq.output_token_ids
        assert seq.output_token_ids == kvlib.generate(params, seq.prompt_token_ids,
                                                      seq.max_tokens)
    for name in forked:          # greedy: a fork continues from the shared blocks exactly
        assert outputs[name] == outputs[name.split(".")[0]]
    for seq in timeline.finished:
        request = requests[timeline.parent[seq.request_id]]
        assert seq.num_tokens == seq.max_num_tokens == request.max_num_tokens
        assert len(seq.output_token_ids) == request.max_tokens


def test_a_small_pool_preempts_and_recomputes_the_same_sampled_tokens():
    params = kvlib.init_params()
    requests = w19.demo_requests()
    small = PoolTimeline(params, requests, n_blocks=10, block_size=4, seed=0)
    large = PoolTimeline(params, requests, n_blocks=60, block_size=4, seed=0)
    small.run(), large.run()
    assert small.preemptions > 0 and large.preemptions == 0
    assert {s.request_id: s.output_token_ids for s in small.finished} == \
        {s.request_id: s.output_token_ids for s in large.finished}
    assert all(s.blocks_in_use <= 10 for s in small.history)


def test_fork_shares_blocks_then_copies_on_write():
    params = kvlib.init_params()
    timeline = PoolTimeline(params, [req(6, 8)], n_blocks=12, block_size=4, seed=1)
    timeline.step()                              # A prefilled: 6 positions, blocks [0, 1]
    child = timeline.fork("A")
    assert child == "A.1" and "nothing copied" in timeline.events[0]
    tables = timeline.block_tables()
    assert tables["A"] == tables["A.1"] == [0, 1]
    assert list(timeline.pool.ref_counts[:2]) == [2, 2]
    assert timeline.history[-1].blocks_in_use == 2
    timeline.step()                              # both write position 6, in block 1
    tables = timeline.block_tables()
    assert tables["A"][0] == tables["A.1"][0] == 0
    assert tables["A"][1] != tables["A.1"][1]
    assert len(timeline.copied_blocks) == 1
    assert any("copy-on-write" in event for event in timeline.events)
    assert timeline.check() < TOLERANCE
    timeline.run()
    assert {s.request_id for s in timeline.finished} == {"A", "A.1"}
    assert timeline.pool.n_free == 12


@pytest.mark.parametrize("call, error, words", [
    (lambda p: PoolTimeline("params", [req(2, 2)], 4), TypeError, "kvlib Params"),
    (lambda p: PoolTimeline(p, [], 4), ValueError, "at least one request"),
    (lambda p: PoolTimeline(p, "AB", 4), TypeError, "list of kvlib.serving.Request"),
    (lambda p: PoolTimeline(p, [(2, 2)], 4), TypeError, "list of kvlib.serving.Request"),
    (lambda p: PoolTimeline(p, [req(20, 20)], 40), ValueError, "context length 32"),
    (lambda p: PoolTimeline(p, [req(10, 10)], 2, 4), ValueError, "the pool's 2"),
    (lambda p: PoolTimeline(p, [req(2, 2)], 4, seed=-1), ValueError, "seed"),
    (lambda p: PoolTimeline(p, [req(2, 2)], 4, temperature=-1), ValueError, "temperature"),
    (lambda p: PoolTimeline(p, [req(2, 2)], 4).fork("A"), ValueError, "no running"),
])
def test_timeline_refuses_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call(kvlib.init_params())


# ---------------------------------------------------------------------------------------------
# Drawings
# ---------------------------------------------------------------------------------------------

def labels(ax, prefix):
    return {t.get_gid(): t.get_text() for t in ax.texts if (t.get_gid() or "").startswith(prefix)}


def test_draw_pool_labels_owners_shared_and_free_blocks():
    fig, ax = plt.subplots()
    pool = counting_pool(6, 4)

    def draw(tables, lengths):
        plots.draw_pool(ax, pool, tables, lengths, colors=w19.owner_color)

    draw({"A": [0, 2], "A.1": [0, 3], "B": [1]}, {"A": 6, "A.1": 7, "B": 3})
    assert labels(ax, "block") == {"block 0": "shared x2", "block 1": "B", "block 2": "A",
                                   "block 3": "A.1", "block 4": "free", "block 5": "free"}
    plain, hatched, outlines = ax.collections
    assert len(plain.get_paths()) + len(hatched.get_paths()) == 6 * 4
    assert len(hatched.get_paths()) == 4 and hatched.get_hatch() == "///"
    assert len(outlines.get_paths()) == 6
    count = len(ax.texts) + len(ax.collections)
    for _ in range(5):                           # a redraw replaces, never accumulates
        draw({"A": [0]}, {"A": 2})
    assert len(ax.texts) == 12 and len(ax.collections) == 2      # no shared block now
    draw({"A": [0, 2], "A.1": [0, 3], "B": [1]}, {"A": 6, "A.1": 7, "B": 3})
    assert len(ax.texts) + len(ax.collections) == count


def test_draw_gather_has_one_arrow_per_block_and_a_row_per_position():
    fig = plt.figure()
    tables, lengths = {"A": [0, 2, 4], "B": [1, 3]}, {"A": 9, "B": 7}
    pool_ax, table_ax, rows_ax = w19.draw_gather(fig, 12, 4, tables, lengths, "A")
    arrows = [a for a in fig.artists if a.get_gid() == "gather"]
    assert len(arrows) == 3
    rows = [t.get_text() for t in rows_ax.texts if t.get_gid() == "gathered"]
    assert rows[0] == "p0: block 0, row 0" and rows[6] == "p6: block 2, row 2"
    assert len(rows) == 9 and rows[8] == "p8: block 4, row 0"
    assert sorted(t.get_text() for t in table_ax.texts if t.get_gid() == "table A") == \
        ["0", "2", "4"]
    with pytest.raises(ValueError, match="no sequence 'C'"):
        w19.draw_gather(fig, 12, 4, tables, lengths, "C")


def test_owner_colors_follow_the_request():
    assert w19.owner_color("A") == w19.owner_color("A.1") == w19.owner_color("A.2")
    assert w19.owner_color("A") != w19.owner_color("B")
    assert w19.owner_color("s0") in w19.OWNER_COLORS and w19.owner_color("") in w19.OWNER_COLORS


# ---------------------------------------------------------------------------------------------
# The widget, driven headless
# ---------------------------------------------------------------------------------------------

def test_pool_explorer_starts_empty_and_steps():
    widget = w19.pool_explorer()
    assert widget.next_step.description == "Next step" and widget.fork.description == "Fork"
    assert "Step 0: 0 sequences running" in widget.status.value and widget.fork.disabled
    assert labels(widget.axes["pool"], "block")["block 0"] == "free"
    widget.next_step.click()
    timeline = widget.timeline()
    assert timeline.step_number == 1 and widget.fork_of.options == ("A", "B")
    assert "Step 1: 2 sequences running" in widget.status.value
    assert "0 of 10 requests done" in widget.status.value
    assert "A arrived" in widget.events.value and "B arrived" in widget.events.value
    assert "equal a contiguous cache" in widget.check.value
    pool_labels = labels(widget.axes["pool"], "block")
    for name, table in timeline.block_tables().items():
        assert all(pool_labels[f"block {b}"] == name for b in table)
        cells = [t.get_text() for t in widget.axes["tables"].texts
                 if t.get_gid() == f"table {name}"]
        assert cells == [str(b) for b in table]
    per_position = kvlib.config_cache_bytes(kvlib.ModelConfig(), 1)
    snapshot = timeline.history[-1]
    assert f"{snapshot.paged_positions * per_position:,} bytes in" in widget.status.value
    assert f"would reserve {2 * 32 * per_position:,} bytes" in widget.status.value


def test_pool_explorer_fork_and_copy_on_write():
    widget = w19.pool_explorer()
    for _ in range(3):
        widget.next_step.click()
    widget.fork_of.value = "A"
    widget.fork.click()
    tables = widget.timeline().block_tables()
    assert tables["A.1"] == tables["A"]
    assert all(labels(widget.axes["pool"], "block")[f"block {b}"] == "shared x2"
               for b in tables["A"])
    widget.next_step.click()
    assert "copy-on-write" in widget.events.value
    copied = widget.timeline().copied_blocks
    assert len(copied) == 1
    outlines = widget.axes["pool"].collections[-1]
    widths = outlines.get_linewidths()
    assert [b for b, width in enumerate(widths) if width > 1] == sorted(copied)
    assert "equal a contiguous cache" in widget.check.value and widget.message.value == ""


def test_pool_explorer_block_size_reset_and_the_end():
    widget = w19.pool_explorer()
    widget.block_size.value = 1
    assert widget.timeline().pool.n_blocks == 96
    widget.next_step.click()
    assert len(labels(widget.axes["pool"], "block")) == 96
    widget.block_size.value = 8
    assert widget.timeline().pool.n_blocks == 12 and widget.timeline().step_number == 0
    before = plt.get_fignums()
    for _ in range(80):
        widget.next_step.click()
    assert widget.timeline().all_done and widget.next_step.disabled
    assert "Every request is done" in widget.status.value
    widget.next_step.click()                     # nothing left: no error, nothing changes
    assert widget.message.value == "" and plt.get_fignums() == before
    widget.reset.click()
    assert widget.timeline().step_number == 0 and not widget.next_step.disabled


def test_pool_explorer_keeps_a_sequence_chosen_to_fork():
    """While sequences run, the dropdown always names one (the one chosen before if it still
    runs, else the first), so Fork never answers that nothing runs."""
    widget = w19.pool_explorer()
    for _ in range(6):
        widget.next_step.click()
        running = [seq.request_id for seq in widget.timeline().running]
        assert widget.fork_of.value in running
    widget.fork_of.value = running[-1]
    widget.next_step.click()
    if running[-1] in widget.fork_of.options:
        assert widget.fork_of.value == running[-1]
    chosen = widget.fork_of.value
    widget.fork.click()                                    # without touching the dropdown
    assert widget.message.value == ""
    assert f"{chosen}.1 forked from {chosen}" in widget.events.value


def test_pool_explorer_counts_forks_as_sequences_not_requests():
    """Forks finish as sequences of their request: the status never says more finished than
    there are requests, and says when every request is done."""
    widget = w19.pool_explorer()
    forks = 0
    for _ in range(30):
        widget.next_step.click()
        if widget.timeline().running:
            widget.fork.click()
            forks += 1
    timeline = widget.timeline()
    assert timeline.n_forks == forks > 10
    status = re.sub(r"<[^>]+>", "", widget.status.value)
    done = timeline.requests_done
    assert f"{done} of 10 requests done" in status and done <= 10
    assert f"{len(timeline.finished)} finished, {timeline.n_forks} forks among them" in status
    for _ in range(200):
        widget.next_step.click()
    assert widget.timeline().requests_done == 10 and widget.timeline().all_done
    assert "10 of 10 requests done" in widget.status.value


def test_pool_labels_never_sit_on_the_block_numbers():
    """Each row of blocks has its labels above and its numbers below: no label shares a line
    with any number (of its own row or of the row above), at every block size."""
    widget = w19.pool_explorer()
    for size in (4, 1, 16):
        widget.block_size.value = size
        widget.next_step.click()
        texts = [t for t in widget.axes["pool"].texts if t.get_text()]
        spans = {kind: [(box.y0, box.y1) for box in
                        (t.get_window_extent() for t in texts
                         if (t.get_gid() or "").startswith(kind))]
                 for kind in ("block", "number")}
        n_blocks = widget.timeline().pool.n_blocks
        assert len(spans["number"]) == n_blocks and spans["block"]
        assert not [(a, b) for a in spans["block"] for b in spans["number"]
                    if a[0] < b[1] and b[0] < a[1]]


def test_pool_explorer_reports_a_fork_of_nothing_in_words():
    widget = w19.pool_explorer()
    widget.fork.click()                          # no sequence is running yet
    assert "no sequence is running" in widget.message.value
    assert widget.timeline().step_number == 0


def test_pool_explorer_preempts_without_a_traceback():
    widget = w19.pool_explorer(n_blocks=10)
    for _ in range(8):
        widget.next_step.click()
        if widget.timeline().running:
            widget.fork_of.value = widget.fork_of.options[0]
            widget.fork.click()
    assert widget.timeline().preemptions > 0
    assert "preempt" in widget.status.value and widget.message.value == ""
    assert "equal a contiguous cache" in widget.check.value


def test_pool_explorer_redraws_replace_artists():
    widget = w19.pool_explorer()
    widget.next_step.click()
    pool_ax = widget.axes["pool"]
    count = len(pool_ax.collections) + len(pool_ax.texts)
    memory_lines = len(widget.axes["memory"].lines)
    for _ in range(10):
        widget.next_step.click()
    assert len(pool_ax.collections) + len(pool_ax.texts) == count
    assert len(widget.axes["memory"].lines) == memory_lines
    assert len(widget.figure.axes) == 3


# ---------------------------------------------------------------------------------------------
# Exercise checkers
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("answer, phrase", [
    ((77, 14), "round up"), ((77, 2), "round up"), ((78, 2), "filled"),
    ((79, 30), "one block too many"), ((1234, 0), "positions, not blocks"),
    ((78, 0), "partly filled"), ((78, -14), "negative"), ((78, 16), "never wastes a whole"),
    ((78, 13), "78 blocks is right"), ((80, 14), "2 blocks too many"),
    ((77.125, 14), "whole blocks"), ((78, 14.5), "whole too"),
    (78, "give two numbers"), ("78, 14", "two numbers"), ((78, 14, 0), "two numbers"),
    ({"blocks": 78}, "two numbers"), (..., "not filled in"), (None, "not filled in"),
    (10**5000, "give two numbers"), ((10**5000, 14), "too many"),
    ((np.float64(77.5), 14), "77.5 blocks"),
], ids=case_id)
def test_blocks_and_slack_wrong_answers(answer, phrase):
    not_yet(ex19.check_blocks_and_slack(answer), phrase)


@pytest.mark.parametrize("answer", [(78, 14), [78, 14], np.array([78, 14]), (78.0, 14.0),
                                    np.array([78.0, 14.0]), (np.int64(78), np.int32(14))])
def test_blocks_and_slack_valid_forms(answer):
    feedback = ex19.check_blocks_and_slack(answer)
    assert feedback.passed and "78 blocks" in feedback.message


@pytest.mark.parametrize("answer, phrase", [
    (6, "cannot stay shared"), (9, "one block too many"), (12, "three caches of their own"),
    (4, "one sample's table"), (7, "not 7"), (8.5, "whole number"), ("8", "without quotes"),
    ("eight", "not text"), (10**5000, "about 5,001 digits"), ([8, 8], "several numbers"),
    (None, "not filled in"),
], ids=case_id)
def test_forked_blocks_wrong_answers(answer, phrase):
    not_yet(ex19.check_forked_blocks(answer), phrase)


@pytest.mark.parametrize("answer", [8, 8.0, np.int64(8), np.float32(8.0), [8], np.array([8])])
def test_forked_blocks_valid_forms(answer):
    assert ex19.check_forked_blocks(answer).passed


def test_forked_blocks_correct_text_says_what_the_lesson_teaches():
    """The partly filled block is copied by the first writers; the last holder writes in
    place (notebook 19, cell 27): the feedback must not say the block is copied for each."""
    message = ex19.check_forked_blocks(8).message
    assert "in place" in message and "copied on write" not in message


def test_forked_blocks_answer_is_a_live_pool():
    pool = counting_pool(40, 4)
    first = PagedKVCache(pool)
    first.append(0, np.zeros((10, 1)), np.zeros((10, 1)))
    samples = [first, first.fork(), first.fork()]
    for index, sample in enumerate(samples):
        sample.append(0, np.full((5, 1), index + 1.0), np.full((5, 1), index + 1.0))
    assert ex19.check_forked_blocks(pool.n_used).passed


def gather_with(block_of, row_of, trim=True):
    def gather(pool, block_table, n_positions, block_size):
        rows = [pool[block_of(block_table, p, block_size), row_of(p, block_size)]
                for p in range(n_positions)]
        return np.array(rows)
    return gather


@pytest.mark.parametrize("gather, phrase", [
    (gather_with(lambda t, p, B: t[p % B], lambda p, B: p % B), "block_table[p // B]"),
    (gather_with(lambda t, p, B: t[p % B], lambda p, B: p // B), "IndexError"),
    (gather_with(lambda t, p, B: p // B, lambda p, B: p % B), "block table is not used"),
    (lambda pool, t, n, B: pool[t].reshape(-1, pool.shape[-1]), "every row of every block"),
    (gather_with(lambda t, p, B: t[p // B], lambda p, B: (p + 1) % B), "are not the keys"),
    (lambda pool, t, n, B: pool[t].reshape(-1, pool.shape[-1])[:n][::-1], "are not the keys"),
    (lambda pool, t, n, B: pool[sorted(t)].reshape(-1, pool.shape[-1])[:n],
     "block table [1, 4, 5, 0, 3]: the blocks are read in the order of their numbers"),
    (lambda pool, t, n, B: pool[np.sort(t)].reshape(-1, pool.shape[-1])[:n], "not in the "
     "table's order"),
    (lambda pool, t, n, B: pool[t][:, 0], "shape"),
    (lambda pool, t, n, B: None, "shape"),
    (lambda pool, t, n, B: "rows", "array of numbers"),
    (lambda pool, t, n, B: [[1], [2, 3]], "array of numbers"),
    (lambda pool, t, n, B: 1 / 0, "ZeroDivisionError"),
    (lambda pool, t: pool, "TypeError"),
    ("gather", "should be a function"), (np.zeros(3), "should be a function"),
    (..., "not filled in"),
])
def test_gather_wrong_answers(gather, phrase):
    not_yet(ex19.check_gather(gather), phrase)


@pytest.mark.parametrize("gather", [
    ex19.gather_reference,
    lambda pool, t, n, B: pool[t].reshape(-1, pool.shape[-1])[:n],
    lambda pool, t, n, B: ex19.gather_reference(pool, t, n, B).tolist(),
    lambda pool, t, n, B: np.concatenate([pool[b] for b in t])[:n],
    lambda pool, t, n, B: pool[np.asarray(t)[np.arange(n) // B], np.arange(n) % B],
])
def test_gather_valid_forms(gather):
    assert ex19.check_gather(gather).passed


def test_the_gather_cases_include_a_table_out_of_order_and_a_reused_block():
    """Blocks given back by a finished request are reused: a table that is not ascending,
    which pool[sorted(table)] reads wrong (every other case's table is ascending)."""
    tables = [table for _, table, _, _, _ in ex19._gather_cases()]
    assert [1, 4, 5, 0, 3] in tables
    assert any(table != sorted(table) for table in tables)


def test_a_wrong_gather_is_told_which_rows_in_plain_numbers():
    feedback = ex19.check_gather(gather_with(lambda t, p, B: t[p // B], lambda p, B: (p + 1) % B))
    not_yet(feedback, "rows [")
    assert "np." not in feedback.message


FUZZ = [None, ..., "", "8", b"8", 10**400, -(10**400), float("nan"), float("inf"), -1, 0,
        True, 3.7, [], [1], [[1], [2, 3]], (10**400, 10**400), (float("nan"), 1),
        (True, False), np.array([object(), object()]), np.array(["a", "b"]), np.zeros((2, 2)),
        np.array(78), {"a": 1}, {1, 2}, object(), lambda: None, print, complex(1, 2)]


CHECKERS = [ex19.check_blocks_and_slack, ex19.check_forked_blocks, ex19.check_gather]


@pytest.mark.parametrize("checker", CHECKERS)
@pytest.mark.parametrize("answer", FUZZ + [a for _, a in odd_answers((2,))],
                         ids=range(len(FUZZ) + len(odd_answers((2,)))))
def test_every_checker_answers_anything_with_feedback(checker, answer):
    feedback = assert_answers_in_words(checker, answer)
    assert not feedback.passed and len(feedback.message) < 400


@pytest.mark.parametrize("checker", CHECKERS)
@given(answer=student_answers)
@settings(max_examples=150, deadline=None)
def test_every_checker_answers_generated_answers_in_words(checker, answer):
    assert_answers_in_words(checker, answer)


def test_a_gather_that_returns_odd_things_is_answered_in_words():
    for _, odd in odd_answers((9, 4)):
        assert_answers_in_words(ex19.check_gather, lambda pool, t, n, B, odd=odd: odd)


# ---------------------------------------------------------------------------------------------
# The notebook's own variables
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def notebook():
    return run_notebook("paged_cache")


def test_solutions_pass_in_the_notebooks_namespace(notebook):
    assert_solutions_pass(notebook, ex19, {1: ex19.check_blocks_and_slack, 2: ex19.check_gather,
                                           3: ex19.check_forked_blocks})


def test_the_notebooks_broken_gather_fails_its_checker(notebook):
    not_yet(ex19.check_gather(notebook["gather_broken"]), "block_table[p // B]")


def test_the_notebook_measures_what_its_text_says(notebook):
    sixteen = next(r for r in notebook["rows"] if r.block_size == 16)
    assert round(sixteen.reserved_over_paged, 1) == 3.2
    assert round(100 * sixteen.paged_waste, 1) == 2.3
    assert notebook["rows"][0].block_table_entries == 80_468
    assert sixteen.block_table_entries == 5_150
    assert math.isclose(notebook["rows"][-1].paged_waste, 0.3061, abs_tol=5e-5)
    assert notebook["small"].preemptions > 0


def test_solution_display():
    shown = ex19.solution(2)
    assert "Solution to exercise 2" in shown.data and "p // block_size" in shown.data
    with pytest.raises(ValueError, match="no exercise 9"):
        ex19.solution(9)
