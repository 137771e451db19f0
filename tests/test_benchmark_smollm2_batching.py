"""benchmarks/smollm2_batching.py runs in its quick mode (SmolLM2 at B = 1 and 2, one repeat,
the skinny products with 1 and 2 rows) in a few seconds, prints complete tables and writes a
JSON file the notebook can load. No assertion on a time: only that every row and figure is
there, and that the roofline's seconds in the file are kvlib's."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from benchmark_runs import NUMBER, assert_one_blas_thread, run_script, table_rows

import kvlib
from kvlib import roofline
from kvlib.widgets import batched_decoding as w21

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "smollm2_batching.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2_batching") / "quick.json"
    output = run_script(SCRIPT, "--quick", "--bandwidth-mib", "16", "--output", str(path))
    return output, path


def test_the_quick_run_prints_complete_tables(quick):
    output, path = quick
    assert_one_blas_thread(output)
    assert "mode: quick; 1 interleaved repeat(s); every sequence with 44 tokens cached" in output
    assert re.search(rf"read bandwidth {NUMBER} GB/s, matrix products {NUMBER} GFLOP/s", output)
    assert re.search(r"load average \(1, 5, 15 min\): before ", output)
    header, rows = table_rows(output, "batch")
    for column in ("one at a time tok/s", "batched tok/s", "products alone tok/s",
                   "roofline tok/s", "batched step ms", "step / B = 1 step"):
        assert column in header
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(len(row) == 7 and all(re.fullmatch(rf"{NUMBER}x?", c) for c in row)
               for row in rows)
    header, rows = table_rows(output, "rows")
    assert [row[0] for row in rows] == ["1", "2"] and rows[0][3] == "1.00x"
    assert f"written: {path}" in output


def test_the_quick_run_writes_what_the_notebook_loads(quick):
    _, path = quick
    measured = w21.smollm2_batching(path)
    assert measured == json.loads(path.read_text(encoding="utf-8"))
    check_measurement(measured, sizes=[1, 2], repeats=1, rows=[1, 2])
    assert measured["command"] == "python benchmarks/smollm2_batching.py --quick"


def check_measurement(measured, sizes, repeats, rows):
    """What notebook 21 reads from a run: every field, and the roofline's seconds equal to
    kvlib's for the rates the run recorded."""
    for key in ("command", "model", "cached_tokens", "repeats", "machine", "load_average",
                "bandwidth", "matmul_rate", "compute_bound_from", "batches", "skinny_products"):
        assert key in measured, key
    for key in ("cpu", "logical_cpus", "system", "python", "numpy", "blas", "blas_threads"):
        assert key in measured["machine"], key
    assert set(measured["load_average"]) == {"before", "after"}
    assert measured["repeats"] == repeats
    assert [row["batch_size"] for row in measured["batches"]] == sizes
    config = kvlib.SMOLLM2_135M
    for row in measured["batches"]:
        for way in ("batched", "one_at_a_time", "products"):
            seconds = row[f"{way}_seconds"]
            assert len(seconds) == repeats and all(s > 0 for s in seconds)
        predicted = roofline.batched_step_seconds(
            config, [measured["cached_tokens"]] * row["batch_size"], measured["matmul_rate"],
            measured["bandwidth"])
        assert np.isclose(row["predicted_seconds"], predicted, rtol=1e-12, atol=0)
    assert measured["compute_bound_from"] == roofline.compute_bound_batch_size(
        config, measured["cached_tokens"], measured["matmul_rate"], measured["bandwidth"])
    skinny = measured["skinny_products"]
    assert skinny["shape"] == [576, 1536] and skinny["rows"] == rows
    for key in ("seconds_as_held", "seconds_contiguous"):
        assert len(skinny[key]) == len(rows) and all(s > 0 for s in skinny[key])


def test_the_committed_run_is_complete():
    """benchmarks/data/smollm2_batching.json, which notebook 21 and docs/benchmarks.md use:
    a full run (5 batch sizes, 5 repeats, 1 to 16 rows) on one BLAS thread."""
    measured = w21.smollm2_batching()
    check_measurement(measured, sizes=[1, 2, 4, 8, 16], repeats=5, rows=list(range(1, 17)))
    assert measured["command"] == "python benchmarks/smollm2_batching.py"
    assert measured["machine"]["blas_threads"] in (1, None)
    assert measured["cached_tokens"] == 44


def test_bad_options_are_refused():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--repeats must be at least 1" in result.stderr
