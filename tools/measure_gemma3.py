"""Measure kvlib's Gemma 3 270M on this machine, one BLAS thread (after `make gemma3`):

    .venv/bin/python tools/measure_gemma3.py

Prints: the time to load the converted float32 folder (memory-mapped) and to build the
tokenizer; a prefill's and a cached decode step's time (medians); the peak resident memory
(VmHWM) of a fresh process that loads the model and generates 16 tokens; the greedy
answer after "Question: What is the capital of France?\\nAnswer:"; the loss a token on the
English paragraph of tools/make_gemma3_reference.py (its ids from tests/data/gemma3-reference).
Nothing is written. Another process on the machine slows every figure: compare runs made side
by side.
"""

from __future__ import annotations

import os

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kvlib import gemma3  # noqa: E402
from kvlib.checkpoints.gemma3 import gemma3_tokenizer, load_gemma3  # noqa: E402
from kvlib.inference import next_token_losses  # noqa: E402

FRANCE = "Question: What is the capital of France?\nAnswer:"
PEAK = """
import sys
sys.path.insert(0, {root!r})
from kvlib import gemma3
from kvlib.checkpoints.gemma3 import load_gemma3
params = load_gemma3()
gemma3.generate(params, {ids!r}, 16)
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""
"""The child reports its peak from /proc (VmHWM, in kB): ru_maxrss would report the parent's
resident size at the fork, which Linux carries over into the child's."""


def seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    started = time.perf_counter()
    params = load_gemma3()
    print(f"load (memory-mapped float32 folder): {time.perf_counter() - started:.2f} s")
    started = time.perf_counter()
    tokenizer = gemma3_tokenizer()
    print(f"tokenizer (262,144 pieces): {time.perf_counter() - started:.2f} s")

    ids = tokenizer.encode(FRANCE)
    new = gemma3.generate(params, ids, 16)
    print(f"greedy after {FRANCE!r}: {tokenizer.decode(new)!r}")

    with np.load(ROOT / "tests" / "data" / "gemma3-reference" / "real.npz") as reference:
        paragraph = reference["paragraph_ids"]
    losses = next_token_losses(gemma3.forward(params, paragraph), paragraph)
    print(f"paragraph ({len(paragraph)} tokens with BOS): {losses.mean():.3f} nats a token")

    prompt = (np.arange(512) * 7919 % 200_000 + 1000).tolist()
    print(f"prefill of 512 tokens (last row unembedded): "
          f"{seconds(lambda: gemma3.prefill(params, prompt, last_only=True), 3):.2f} s")
    _, cache = gemma3.prefill(params, ids, gemma3.Gemma3Cache(params.config, 200))
    step = seconds(lambda: gemma3.decode_step(params, 9079, cache), 30)
    print(f"decode step at about 30 positions: {step * 1000:.0f} ms "
          f"({1 / step:.1f} tokens a second); cache {cache.nbytes:,} bytes after "
          f"{len(cache)} positions")
    _, long_cache = gemma3.prefill(params, prompt, last_only=True)
    step = seconds(lambda: gemma3.decode_step(params, 9079, long_cache), 10)
    print(f"decode step past 512 positions: {step * 1000:.0f} ms")

    done = subprocess.run([sys.executable, "-c", PEAK.format(root=str(ROOT), ids=ids)],
                          capture_output=True, text=True, check=True)
    peak = int(done.stdout.split()[-1]) * 1024
    print(f"peak resident memory of a process that loads the model and generates 16 tokens: "
          f"{peak / 2**20:,.0f} MiB ({peak / 2**30:.2f} GiB)")
    print(f"(this process, which also ran the paragraph and prefills of 512: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB)")


if __name__ == "__main__":
    main()
