"""benchmarks/decode.py runs and prints a complete table, at tiny sizes so that it takes a few
seconds. No assertion on a time: only that every row and every figure is there."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import run_script, table_rows

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--prompt", "4",
        "--lengths", "4", "8", "16", "--append-lengths", "8", "32", "--bandwidth-mib", "4"]
NUMBER = r"\d+(\.\d+)?"


def run(*options):
    return run_script(SCRIPT, *TINY, *options)




@pytest.mark.parametrize("mode", [["--quick"], []])
def test_the_benchmark_prints_a_complete_table(mode):
    output = run(*mode)
    assert "model: 2 layers, d_model 32, 2 heads" in output
    assert re.search(r"threads in effect: (1|unknown)", output)
    assert "OPENBLAS_NUM_THREADS=1" in output
    assert re.search(rf"measured read bandwidth: {NUMBER} GB/s", output)
    assert re.search(rf"measured matmul rate: {NUMBER} GFLOP/s", output)

    header, rows = table_rows(output, "new tokens")
    for column in ("cached tok/s", "no-cache tok/s", "time ratio", "FLOP ratio",
                   "roofline ratio", "floor fraction", "concatenating tok/s"):
        assert column in header
    assert [row[0] for row in rows] == ["4", "8", "16"]
    for row in rows:
        assert len(row) == 8 and all(re.fullmatch(rf"{NUMBER}\*?x?", cell) for cell in row)
    # the FLOP ratio is a count, not a measurement: it is exact
    assert [row[4] for row in rows] == ["3.1x", "5.3x", "9.3x"]

    header, rows = table_rows(output, "cached tokens")
    assert "preallocated us" in header and "concatenating us" in header
    assert [row[0] for row in rows] == ["8", "32"]
    assert all(len(row) == 4 for row in rows)

    assert ("* estimated" in output) == ("--quick" in mode)
    assert f"mode: {'quick' if mode else 'full'}" in output
    assert re.search(r"greedy token as the cached run in (\d+) of \1 passes", output)
    assert "matrix-vector products alone" in output
    assert "total benchmark time" in output


def test_the_profile_option():
    """The profile lists every kvlib function the decode steps call, with its call count
    (never a timing order: which functions are slowest changes from run to run)."""
    output = run("--quick", "--profile")
    assert "Profile of cached decode steps" in output
    steps = int(re.search(r"(\d+) decode steps; every kvlib function", output).group(1))
    calls = {name: int(count) for count, name in
             re.findall(r"^\s*(\d+)\s.*kvlib[/\\]\w+\.py:\d+\((\w+)\)$", output, re.M)}
    assert steps >= 1 and calls["decode_step"] == steps
    assert calls["decoder_block"] == steps * 2     # the benchmark's tiny model has 2 layers


def test_bad_options_are_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--d-model", "30", "--heads", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "divisible" in result.stderr
