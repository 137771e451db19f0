"""benchmarks/paged_memory.py prints complete tables whose every figure is exact: here the
quick run's numbers are recomputed independently, from the request lengths alone."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import run_script

from kvlib.memory import MiB
from kvlib.serving.memory_plan import request_mix

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "paged_memory.py"
PER_POSITION = 2 * 12 * 768 * 2          # GPT-2 small, K and V, 16-bit
CONTEXT = 1024


def run(*options):
    return run_script(SCRIPT, *options)


def table(output, first_header):
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and line.strip("| ").startswith(first_header))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


@pytest.fixture(scope="module")
def quick():
    return run("--quick")


def test_the_memory_table_is_complete_and_exact(quick):
    lengths = [r.max_num_tokens for r in request_mix(32, CONTEXT, seed=0)]
    assert "mode: quick" in quick and "workload: 32 requests (seed 0)" in quick
    assert f"{PER_POSITION:,} bytes a position" in quick
    assert f"positions written: {sum(lengths):,}" in quick
    rows = table(quick, "block size")
    assert [int(row["block size"]) for row in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for row in rows:
        size = int(row["block size"])
        blocks = sum(math.ceil(n / size) for n in lengths)
        paged = blocks * size
        assert row["block-table entries"] == f"{blocks:,}"
        assert row["written MiB"] == f"{sum(lengths) * PER_POSITION / MiB:.1f}"
        assert row["paged MiB"] == f"{paged * PER_POSITION / MiB:.1f}"
        assert row["paged waste"] == f"{100 * (1 - sum(lengths) / paged):.2f}%"
        assert row["contiguous MiB"] == f"{32 * CONTEXT * PER_POSITION / MiB:.1f}"
        assert row["contiguous / paged"] == f"{32 * CONTEXT / paged:.2f}x"
        assert int(row["largest slack"]) == max(math.ceil(n / size) * size - n for n in lengths)
        assert int(row["largest slack"]) < size
        assert row["fit in 2 GiB"] == "32"          # the quick mix fits whole
    assert "56 requests fit in 2 GiB" in quick      # 2 GiB // (1024 x 36,864 bytes)


def test_the_sampling_table_is_exact(quick):
    rows = table(quick, "n")
    assert [int(row["n"]) for row in rows] == [1, 2, 4, 8]
    for row in rows:
        n = int(row["n"])
        shared = 200 // 16 + n * (math.ceil(300 / 16) - 200 // 16)
        assert int(row["shared blocks"]) == shared
        assert int(row["separate blocks"]) == n * math.ceil(300 / 16)
        assert row["separate / shared"] == f"{n * math.ceil(300 / 16) / shared:.2f}x"


def test_the_full_run_fits_fewer_contiguous_than_paged_requests():
    rows = table(run("--requests", "256"), "block size")
    sixteen = next(row for row in rows if row["block size"] == "16")
    assert sixteen["contiguous / paged"] == "3.18x" and sixteen["paged waste"] == "2.34%"
    assert int(sixteen["fit in 2 GiB"]) == 177


def test_bad_options_are_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "at least 1" in result.stderr
