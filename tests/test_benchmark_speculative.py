"""benchmarks/speculative.py runs and prints a complete table, on a tiny workload so that it
takes a few seconds. No assertion on a time: only that every row and every figure is there,
and the counts that do not depend on the machine."""

import re
import subprocess
import sys
from pathlib import Path

from benchmark_runs import NUMBER, run_script, table_rows

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "speculative.py"
TINY = ["--quick", "--prompts", "1", "--tokens", "12", "--k", "1", "3", "--repeats", "1",
        "--dtype", "float64"]   # float64: no near tie can make a greedy token differ


def run(*options):
    return run_script(SCRIPT, *options)




def test_the_benchmark_prints_a_complete_table():
    output = run(*TINY)
    assert re.search(r"target: stories, \d+ layers, d_model \d+, \d+ heads, [\d,]+ weights; "
                     r"draft: stories-draft, \d+ layers?, d_model \d+", output)
    assert re.search(r"threads in effect: (1|unknown)", output)
    assert "1 prompts" in output and "12 new tokens each; k = 1, 3" in output
    alpha = re.search(rf"alpha = ({NUMBER}): .* at (\d+) of 12 positions", output)
    assert alpha and abs(float(alpha.group(1)) - int(alpha.group(3)) / 12) < 1e-3
    assert re.search(rf"target decode step {NUMBER} ms, draft decode step {NUMBER} ms, so c = ",
                     output)
    header, rows = table_rows(output, "k")
    for column in ("accepted/judged", "acceptance", "tokens/pass", "replayed", "from alpha",
                   "speed-up", "predicted (alpha, c)", "predicted (passes)", "tok/s"):
        assert column in header
    assert [row[0] for row in rows] == ["plain", "1", "3"]
    for row in rows[1:]:
        assert len(row) == 10
        accepted, judged = map(int, row[1].split("/"))
        assert 0 <= accepted <= judged
        assert all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in row[2:])
        # the replay predicts every round exactly: measured and replayed tokens per pass agree
        assert row[3] == row[4]
    assert "every speculative run gave exactly the target's greedy tokens: yes (2 of 2 runs)" \
        in output
    assert "total benchmark time" in output


def test_bad_options_are_refused():
    for options, words in ((["--k", "0"], "at least 1"), (["--tokens", "0"], "at least 1"),
                           (["--target", "/nonexistent"], "holds no model")):
        result = subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode != 0 and words in result.stderr
