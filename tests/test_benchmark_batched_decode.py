"""benchmarks/batched_decode.py runs and prints complete tables, at tiny sizes so that it
takes a second. No assertion on a time: only that every row and every figure is there, and
the counted (machine-independent) figures are right."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import (
    NUMBER,
    assert_one_blas_thread,
    assert_rates_measured,
    run_script,
    table_rows,
)

from kvlib import roofline
from kvlib.gpt2 import GPT2_124M

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "batched_decode.py"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64",
        "--bandwidth-mib", "4", "--batch-sizes", "1", "2", "4", "--cached", "6",
        "--requests", "5", "--max-batch", "3", "--prompt-lengths", "2", "6",
        "--output-lengths", "1", "5"]


def run(*options):
    return run_script(SCRIPT, *TINY, *options)




@pytest.mark.parametrize("mode", [["--quick"], ["--repeats", "2"]])
def test_the_benchmark_prints_complete_tables(mode):
    output = run(*mode)
    assert "model: 2 layers, d_model 32, 2 heads, d_ff 128, vocabulary 64" in output
    assert_one_blas_thread(output)
    assert_rates_measured(output)
    assert f"mode: {'quick' if '--quick' in mode else 'full'}" in output

    header, rows = table_rows(output, "batch")
    for column in ("mean cached", "one at a time tok/s", "batched tok/s", "padded tok/s",
                   "products alone tok/s", "roofline tok/s", "roofline bound",
                   "batched / one at a time"):
        assert column in header
    assert [row[0] for row in rows] == ["1", "2", "4"]
    for row in rows:
        assert len(row) == 9
        assert all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in row[:7] + row[8:])
        assert row[7] in ("memory", "compute")
    assert re.search(r"compute-bound from B = (\d+|None) on this machine", output)

    header, rows = table_rows(output, "policy")
    for column in ("steps", "makespan s", "tok/s", "mean TTFT ms", "worst TTFT ms",
                   "mean TPOT ms", "slots busy"):
        assert column in header
    assert [row[0] for row in rows] == ["static", "continuous"]
    assert all(len(row) == 8 and all(re.fullmatch(NUMBER, c) for c in row[1:]) for row in rows)
    assert "every request's tokens are the same under both policies: True" in output
    # counted in model steps, the workload's figures are exact
    assert re.search(rf"in model steps, the same workload: static \d+ steps, mean TTFT "
                     rf"{NUMBER}; continuous \d+ steps", output)
    assert "total benchmark time" in output


def test_the_h100_figures_are_counted_not_measured():
    """The H100 lines come from the roofline of the benchmark's model, not from a clock."""
    config = GPT2_124M.replace(vocab_size=64, d_model=32, n_heads=2, n_layers=2, d_ff=128)
    output = run("--quick")
    for cached in (0, 6):
        size = roofline.compute_bound_batch_size(config, cached, compute_rate=989e12,
                                              bandwidth=3.35e12, bytes_per_number=2)
        expected = f"from B = {size}" if size is not None else "never"
        assert f"{cached} tokens cached each: {expected}" in output


@pytest.mark.parametrize("options, words", [
    (["--d-model", "30", "--heads", "4"], "divisible"),
    (["--batch-sizes", "0"], "--batch-sizes must be at least 1"),
    (["--prompt-lengths", "5", "2"], "shortest then longest"),
    (["--mean-gap", "-1"], "--mean-gap"),
])
def test_bad_options_are_refused(options, words):
    result = subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and words in result.stderr
