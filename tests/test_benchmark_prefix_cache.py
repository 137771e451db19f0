"""benchmarks/prefix_cache.py runs and prints a complete table, at tiny sizes so that it takes
a few seconds. No assertion on a time: only that every row and figure is there, and that the
counts (tokens reused, the FLOP ratio) are exact."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import NUMBER, assert_one_blas_thread, run_script, table_rows

import kvlib
from kvlib.gpt2 import GPT2_124M

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "prefix_cache.py"
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64",
        "--prefixes", "16", "40", "--question", "8", "--block-size", "8", "--repeats", "2"]


def run(*options):
    return run_script(SCRIPT, *options)




@pytest.mark.parametrize("mode", [["--quick"], []])
def test_the_benchmark_prints_a_complete_table(mode):
    output = run(*TINY, *mode)
    assert "model: GPT-2's architecture, 1 layers, d_model 32, 2 heads, vocabulary 64" in output
    assert_one_blas_thread(output)
    assert f"mode: {'quick' if mode else 'full'}; 2 measurements each way" in output
    header, rows = table_rows(output, "shared prefix")
    for column in ("own tokens", "reused", "TTFT without reuse ms", "TTFT with reuse ms",
                   "time ratio", "FLOP ratio", "logits difference"):
        assert column in header
    assert [row[0] for row in rows] == ["16", "40"]
    config = GPT2_124M.replace(n_layers=1, d_model=32, n_heads=2, d_ff=128, vocab_size=64)
    for row, prefix in zip(rows, (16, 40)):
        assert len(row) == 8
        assert row[1] == "8" and row[2] == str(prefix // 8 * 8)      # full blocks of the prefix
        assert all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in row[:7])
        reused = prefix // 8 * 8
        ratio = (kvlib.prefill_multiply_adds(config, prefix + 8, last_only=True).flops /
                 kvlib.prefill_multiply_adds(config, prefix + 8 - reused, cached=reused,
                                             last_only=True).flops)
        assert row[6] == f"{ratio:.1f}x"
        assert float(row[7]) < 1e-4                                  # reuse changes nothing
    assert "total benchmark time" in output


def test_bad_options_are_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--d-model", "30", "--heads", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "divisible" in result.stderr
    result = subprocess.run([sys.executable, str(SCRIPT), "--prefixes", "1020"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "1024 positions" in result.stderr
