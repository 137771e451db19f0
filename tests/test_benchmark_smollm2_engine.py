"""benchmarks/real_decode.py and benchmarks/engine.py run in their quick modes (SmolLM2's and
Gemma 3's decode against their bare products, about 7 s each; notebook 24's four concurrent
requests, its attention over blocks and its workload on three engines, about 25 s) and print
complete tables. No assertion on a time: only that every row is there, that the engines took
the steps notebook 24's committed table counts, that the committed data is whole, and that bad
options are refused in words."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import NUMBER, run_script, table_rows

from kvlib.checkpoints import smollm2

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def refusal(script: str, *options) -> str:
    """What the script writes to stderr when argparse refuses its options (exit 2)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *options],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


@pytest.mark.parametrize("model, name", [("smollm2", "SmolLM2-135M-Instruct"),
                                         ("gemma3", "Gemma 3 270M")])
def test_real_decode_quick_prints_every_row(model, name):
    output = run_script(BENCHMARKS / "real_decode.py", "--quick", "--model", model)
    assert re.search(r"threads in effect: (1|unknown)", output)
    assert f"{name}, float32" in output
    assert "prompt 32 tokens, 12 decode steps a round, 2 rounds, medians" in output
    header, rows = table_rows(output, "what")
    assert [row[0] for row in rows] == [
        "kvlib decode step", "bare products, kvlib's layouts", "bare products, fastest layouts",
        "blocks: file's (out, in) / (in, out) copy", "unembedding: table (V, d) / a (d, V) copy",
        "kvlib's peak memory"]
    assert re.fullmatch(rf"{NUMBER} ms", rows[0][1]) and rows[0][2].endswith("tokens/s")
    assert all(re.fullmatch(rf"{NUMBER}x", row[2]) for row in rows[1:3])
    assert re.fullmatch(rf"{NUMBER} MiB", rows[-1][1])


def test_engine_quick_takes_the_steps_of_notebook_24s_table():
    output = run_script(BENCHMARKS / "engine.py", "--quick")
    assert "notebook 24's workload: 8 chat requests" in output and "1 round(s)" in output
    header, rows = table_rows(output, "model")
    assert [row[0] for row in rows] == ["stories", "smollm2"]
    assert [row[1] for row in rows] == ["4 x 16", "4 x 8"]
    assert all(re.fullmatch(NUMBER, row[2]) and re.fullmatch(NUMBER, row[3])
               and re.fullmatch(rf"{NUMBER}x", row[4]) for row in rows)
    header, rows = table_rows(output, "positions")
    assert [row[0] for row in rows] == ["64", "512"]
    assert all(re.fullmatch(rf"{NUMBER}x", row[3]) for row in rows)
    header, rows = table_rows(output, "engine")
    names = [row[0] for row in rows]
    assert names == ["the engine (continuous batching)", "one request at a time",
                     "static batching"]
    assert all(re.fullmatch(NUMBER, row[1]) and row[2].endswith(" ms")
               and row[3].endswith(" ms") for row in rows)
    committed = smollm2.measured()["engine"]["rows"]
    steps = {row[0]: int(row[4]) for row in rows}
    assert steps["the engine (continuous batching)"] == committed["the engine"]["steps"]
    assert steps["static batching"] == committed["static batching"]["steps"]
    assert re.search(rf"the bookkeeping around it {NUMBER} ms, {NUMBER}% of the step", output)
    assert "wrote" not in output                                   # quick writes no file


def test_the_committed_engine_data_says_how_it_was_made_and_is_whole():
    """benchmarks/data/engine.json, which notebook 24 quotes: the full run's command, the
    machine, both models' four requests with the same tokens as kvlib.generate, both
    attentions at both lengths, the three engines of the workload."""
    data = json.loads((BENCHMARKS / "data" / "engine.json").read_text(encoding="utf-8"))
    assert data["command"] == "python benchmarks/engine.py" and data["rounds"] >= 3
    assert {"cpu", "logical_cpus", "numpy", "blas", "blas_threads"} <= set(data["machine"])
    assert set(data["concurrent"]) == {"stories", "smollm2"}
    for row in data["concurrent"].values():
        assert row["same_tokens"] and row["requests"] == 4
        assert len(row["engine_seconds"]) == len(row["generate_seconds"]) >= data["rounds"]
    assert [row["positions"] for row in data["attention"]] == [64, 512]
    assert set(data["workload"]) == {"the engine (continuous batching)",
                                     "one request at a time", "static batching"}


@pytest.mark.parametrize("script, options, words", [
    ("engine.py", ["--rounds", "0"], "--rounds and --threads must be at least 1"),
    ("real_decode.py", ["--steps", "0"], "--steps must be at least 1"),
    ("real_decode.py", ["--rounds", "-2"], "--rounds must be at least 1"),
    ("real_decode.py", ["--model", "gpt5"], "invalid choice"),
])
def test_bad_options_are_refused_in_words(script, options, words):
    assert words in refusal(script, *options)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="torch is installed here: --transformers would run")
def test_transformers_without_torch_says_where_to_get_it():
    assert "make test-reference" in refusal("real_decode.py", "--quick", "--transformers")
