"""Write notebooks/data/local_and_global_layers.json, the text notebook 26 runs Gemma 3 on,
and what the window does to it (after `make gemma3`; numpy and kvlib only, one BLAS thread):

    .venv/bin/python tools/measure_local_and_global.py            # about 15 s
    .venv/bin/python tools/measure_local_and_global.py --check    # recompute, compare

The text: Python's own documentation of the assignment statement and the for statement
(pydoc_data.topics, PSF licence), the first N_TOKENS + 1 Gemma 3 tokens (BOS first), so
that the text runs past Gemma 3 270M's window of 512 positions. Its ids are kept, since
another Python's pydoc_data may hold another text.

Measured on it, in float32, at the positions past the window (512 .. N_TOKENS - 1, whose
sliding layers read less than the whole prefix; each predicts the next id, up to the last):
the mean loss a token of Gemma 3 as it is and of the same weights with the window opened to
the whole context (every layer reads every position; the sliding layers keep their rotary
base), and the size of the change in the logits, ||logits(no window) - logits(window)|| /
||logits(window)||, row by row (the median and the largest). The notebook recomputes them
(tolerance: float32 sums on another CPU).
"""

from __future__ import annotations

import os

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib import gemma3  # noqa: E402
from kvlib.checkpoints.gemma3 import gemma3_tokenizer, load_gemma3  # noqa: E402

OUT = ROOT / "notebooks" / "data" / "local_and_global_layers.json"
N_TOKENS = 640
PAST = 512


def text_ids(tokenizer) -> list[int]:
    from pydoc_data import topics
    return tokenizer.encode(topics.topics["assignment"] + topics.topics["for"])[:N_TOKENS + 1]


def losses_past(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Losses (nats) of the predictions of ids[PAST + 1 ..] from the logits at PAST .. -2."""
    rows = logits.astype(np.float64)
    shifted = rows - rows.max(axis=1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probabilities[np.arange(len(rows)), ids[PAST + 1:]]


def measure(params, ids: list[int]) -> dict:
    ids = np.asarray(ids)                  # N_TOKENS + 1: the last is only predicted
    # the window opened to the whole context; each layer keeps its rotary base
    everywhere = dataclasses.replace(params, config=params.config.replace(
        sliding_window=params.config.max_position_embeddings))
    logits = {}
    for name, model in (("window", params), ("no_window", everywhere)):
        X = gemma3.run_layers(model, ids, np.arange(len(ids)))
        logits[name] = gemma3.unembed_logits(model, X[PAST:N_TOKENS])
    change = np.linalg.norm(logits["no_window"] - logits["window"], axis=1) / \
        np.linalg.norm(logits["window"], axis=1)
    return {"loss_window": float(losses_past(logits["window"], ids).mean()),
            "loss_no_window": float(losses_past(logits["no_window"], ids).mean()),
            "change_median": float(np.median(change)), "change_max": float(change.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="recompute and compare")
    check = parser.parse_args().check
    params, tokenizer = load_gemma3(), gemma3_tokenizer()
    if check:
        kept = json.loads(OUT.read_text())
        again = measure(params, kept["ids"])
        for key, value in again.items():
            print(f"{key}: kept {kept['measured'][key]:.6f}, now {value:.6f}")
        return
    ids = text_ids(tokenizer)
    record = {"source": "pydoc_data.topics: 'assignment' then 'for', Gemma 3 tokens, BOS first",
              "command": "python tools/measure_local_and_global.py",
              "past": PAST, "ids": ids, "measured": measure(params, ids)}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(record["measured"])


if __name__ == "__main__":
    main()
