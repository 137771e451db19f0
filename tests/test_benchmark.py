"""benchmarks/decode.py runs and prints a complete table, at tiny sizes so that it takes a few
seconds; with GPT-2's architecture (lesson real_model) it also compares the layouts of the
weights, and it runs a saved checkpoint. No assertion on a time: only that every row and every
figure is there."""

import re
import sys
from pathlib import Path

import pytest
from benchmark_runs import (
    NUMBER,
    assert_one_blas_thread,
    assert_rates_measured,
    refused,
    run_script,
    table_rows,
)

import kvlib
from kvlib import gpt2

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--prompt", "4",
        "--lengths", "4", "8", "16", "--append-lengths", "8", "32", "--bandwidth-mib", "4"]


def run(*options):
    return run_script(SCRIPT, *TINY, *options)


@pytest.mark.parametrize("mode", [["--quick"], []])
def test_the_benchmark_prints_a_complete_table(mode):
    output = run(*mode)
    assert "model: 2 layers, d_model 32, 2 heads" in output
    assert_one_blas_thread(output)
    assert_rates_measured(output)

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
    assert "divisible" in refused(SCRIPT, "--d-model", "30", "--heads", "4")


# ---------------------------------------------------------------------------------------------
# GPT-2's architecture and a saved checkpoint (lesson real_model)
# ---------------------------------------------------------------------------------------------

GPT2_TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "64", "--prompt",
             "4", "--lengths", "4", "8", "--append-lengths", "8", "--bandwidth-mib", "4",
             "--quick"]


def benchmark_parts():
    """The products the benchmark times, as benchmarks/decode.py lists them (PARTS)."""
    import importlib.util

    if str(SCRIPT.parent) not in sys.path:  # as for a script: its folder first (report.py)
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("decode_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PARTS


def test_the_benchmark_runs_gpt2s_architecture_and_compares_layouts():
    output = run_script(SCRIPT, *GPT2_TINY, "--architecture", "gpt2")
    assert "GPT-2 architecture (learned positions, layer norms, biases), random weights" in output
    header, rows = table_rows(output, "part")
    assert "as kvlib holds it" in header
    rows = {row[0]: row[1:] for row in rows}
    assert list(rows) == [*benchmark_parts(), "all products",
                          "all products, in turn with the steps", "decode step, kvlib",
                          "decode step, column-major table"]
    assert rows["unembedding"][2] in ("x @ table.T, (V, d)", "x @ (d, V) copy")
    assert rows["Q, K, V projections"][2] in ("three contiguous (d, d)", "one contiguous (d, 3d)")
    assert re.fullmatch(r"model code: [+-]\d+% over the products", rows["decode step, kvlib"][2])
    assert "costs 0.0 MB more" in output and "the same 8 tokens" in output


def test_the_benchmark_loads_a_checkpoint(tmp_path):
    config = gpt2.GPT2_124M.replace(vocab_size=64, d_model=32, n_heads=2, n_layers=2, d_ff=128,
                                    context_length=64)
    directory = gpt2.save(kvlib.init_params(config, seed=1), tmp_path / "model")
    output = run_script(SCRIPT, *GPT2_TINY, "--checkpoint", str(directory))
    assert f"weights of {directory}" in output and "## Generation, tokens per second" in output
    assert "has 64 positions" in refused(SCRIPT, "--checkpoint", str(directory), "--lengths", "100")


def test_the_benchmark_refuses_more_than_gpt2s_positions():
    assert "1024 positions" in refused(SCRIPT, "--architecture", "gpt2", "--lengths", "1000")
