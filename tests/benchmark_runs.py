"""Helpers for the benchmark tests: run a script of benchmarks/ at tiny sizes and read the
tables it prints. Not a test module (pytest collects test_*.py only)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+(\.\d+)?"
"""A measured figure as a benchmark prints it: 12 or 3.45."""


def run_script(script: Path, *options) -> str:
    """The script's standard output; it must exit 0 within two minutes."""
    result = subprocess.run([sys.executable, str(script), *options], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused(script: Path, *options) -> str:
    """The script's standard error when it refuses the options: it must exit non-zero, within a
    minute."""
    result = subprocess.run([sys.executable, str(script), *options], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode != 0, result.stdout
    return result.stderr


def table_rows(output: str, first_header: str):
    """The header line and the rows (lists of cells) of the table whose first column is
    first_header."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and line.strip("| ").startswith(first_header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return lines[start], rows


def assert_one_blas_thread(output: str) -> None:
    """The machine lines (benchmarks/report.py) say the run used one BLAS thread."""
    assert re.search(r"threads in effect: (1|unknown)", output)
    assert "OPENBLAS_NUM_THREADS=1" in output


def assert_rates_measured(output: str) -> None:
    """The output gives the read bandwidth and the matmul rate it measured on this machine."""
    assert re.search(rf"measured read bandwidth: {NUMBER} GB/s", output)
    assert re.search(rf"measured matmul rate: {NUMBER} GFLOP/s", output)
