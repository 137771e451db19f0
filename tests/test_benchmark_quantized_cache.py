"""benchmarks/quantized_cache.py runs and prints complete tables, at tiny sizes so that it
takes a few seconds. No assertion on a time: only that every row and figure is there, and
that the exact figures are exact."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "quantized_cache.py"
NUMBER = r"[+-]?[\d,]+(\.\d+)?"


def table(output, title):
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## " + title))
    header_index = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for line in lines[header_index + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header = [cell.strip() for cell in lines[header_index].strip("|").split("|")]
    return header, rows, lines[start:header_index]


def test_the_benchmark_prints_complete_tables():
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--layers", "1",
                             "--lengths", "8", "40", "--steps", "2"], capture_output=True,
                            text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert result.returncode == 0, result.stderr
    output = result.stdout

    header, rows, _ = table(output, "Bytes per token")
    assert header == ["model", "K/V width", "setting", "bytes/token", "vs float16",
                      "tokens in 80 GiB"]
    assert len(rows) == 4 * 6
    llama = {row[2]: row for row in rows if row[0] == "Llama-3-8B"}
    assert llama["float16"][3] == "131,072" and llama["int4 KIVI"][3] == "34,880"
    assert llama["int8 per token"][4] == "2.00x"
    assert all(row[5] == "weights > 80 GiB" for row in rows if row[0] == "Llama-2-70B")

    header, rows, before = table(output, "kvlib decode speed")
    assert any("1 layers, d_model 768" in line for line in before)
    assert header[0] == "cached tokens" and "int4 KIVI / plain time" in header
    assert header[-1] == "fused-kernel prediction"
    assert [row[0] for row in rows] == ["8", "40"]
    for row in rows:
        assert len(row) == 9 and all(re.fullmatch(rf"{NUMBER}x?( faster)?", cell) for cell in row)

    lines = output.splitlines()
    start = lines.index("## Quality on the trained story model (exact)")
    if "(skipped: no trained model" in lines[start + 2]:
        return
    header, rows, _ = table(output, "Quality on the trained story model")
    assert header[:3] == ["bits", "grouping", "bytes/token"] and header[-1] == "same greedy"
    assert [row[0] for row in rows] == ["8"] * 4 + ["4"] * 4 + ["2"] * 4
    for row in rows:
        assert len(row) == 8 and row[-1].endswith("%")
