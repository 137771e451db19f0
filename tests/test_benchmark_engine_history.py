"""benchmarks/engine_history.py runs in its quick mode (200 requests, about 2 s) and prints its
table and the ratio of a late step to an early one. No assertion on a time: only that both
windows are there and that a checkpoint saved no more requests than max_num_seqs (8) in
either, however many requests were served before."""

import re
from pathlib import Path

from benchmark_runs import run_script, table_rows

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_engine_history_quick_prints_both_windows_and_the_ratio():
    output = run_script(BENCHMARKS / "engine_history.py", "--quick")
    _, rows = table_rows(output, "steps")
    assert [row[0] for row in rows] == ["steps 10-29", "20 steps after 200 requests"]
    assert all(re.fullmatch(r"\d+\.\d\d ms", row[1]) and 1 <= int(row[2]) <= 8 for row in rows)
    assert re.search(r"late / early: \d+\.\d\dx", output)
