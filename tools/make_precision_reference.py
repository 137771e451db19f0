"""What real 16-bit arithmetic does to "cached equals recomputed", measured with transformers on
SmolLM2, for kvlib's emulation to be compared against (tests/test_precision.py; notebook 25).

kvlib.precision emulates bfloat16 in numpy (float32 sums, every building block's result
rounded). This tool runs the same windows through transformers' LlamaForCausalLM in real
bfloat16 (PyTorch's CPU kernels) and in float32: the same 16 windows of 64 tokens of Python's
documentation as tools/measure_precision.py (the ids kept in
kvlib/models/smollm2/measured.json), the first 16 tokens as the prompt, every later token
predicted twice, by decode steps through transformers' cache and by one forward pass; and each
window with 5 pad tokens in front (attention_mask 0 there, position_ids counting from the first
real token) against the window alone. The comparisons are kvlib.precision.compare's.

Needs torch and transformers (`make test-reference` builds .venv-reference); run by hand after
`make smollm2`:

    .venv-reference/bin/python tools/make_precision_reference.py

Writes tests/data/precision-reference/smollm2.json (a few kB).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers_runs import cache_of, continue_with  # noqa: E402  tools/transformers_runs.py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlib import precision  # noqa: E402
from kvlib.checkpoints import smollm2  # noqa: E402

OUT = ROOT / "tests" / "data" / "precision-reference" / "smollm2.json"
WINDOWS, TOKENS, PROMPT, PADDING = 16, 64, 16, 5


def windows() -> list[list[int]]:
    ids = smollm2.measured()["ids"]
    return [ids[i * TOKENS:(i + 1) * TOKENS] for i in range(WINDOWS)]


def as_numpy(logits) -> np.ndarray:
    return logits[0].float().numpy()


def teacher_forced(model, ids):
    """(cached, recomputed) logits (n, V) that predict ids[PROMPT:], as kvlib's
    precision.teacher_forced computes them."""
    with torch.no_grad():
        output = model(torch.tensor([ids[:PROMPT]]), use_cache=True)
        rows = [as_numpy(output.logits)[-1]]
        for token in ids[PROMPT:-1]:
            output = continue_with(model, [token], cache_of(output))
            rows.append(as_numpy(output.logits)[-1])
        recomputed = as_numpy(model(torch.tensor([ids[:-1]])).logits)[PROMPT - 1:]
    return np.stack(rows), recomputed


def left_padded(model, ids):
    """(padded, alone) logits (T, V): PADDING pad tokens in front, masked, positions from the
    first real token, as transformers' batched generate runs a left-padded row."""
    mask = torch.tensor([[0] * PADDING + [1] * len(ids)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded_ids = torch.tensor([[0] * PADDING + list(ids)])
    with torch.no_grad():
        padded = model(padded_ids, attention_mask=mask, position_ids=positions).logits
        alone = model(torch.tensor([ids])).logits
    return as_numpy(padded)[PADDING:], as_numpy(alone)


def pooled(pairs) -> dict:
    return precision.compare(np.concatenate([a for a, _ in pairs]),
                             np.concatenate([b for _, b in pairs])).as_dict()


def main() -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    path = smollm2.find_gguf()
    if path is None:
        raise SystemExit("SmolLM2's GGUF file is missing: run `make smollm2` first")
    texts = windows()
    single = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    exact = [teacher_forced(single, ids) for ids in texts]
    rows = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = single.to(dtype)
        runs = [teacher_forced(model, ids) for ids in texts]
        rows.append({
            "format": name,
            "cached_against_recomputed": pooled(runs),
            "against_float32": pooled([(recomputed, reference) for (_, recomputed),
                                       (_, reference) in zip(runs, exact)]),
            "padded_against_alone": pooled([left_padded(model, ids) for ids in texts])})
        print(name, rows[-1]["cached_against_recomputed"], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "transformers' LlamaForCausalLM on SmolLM2's GGUF, default attention "
                f"({single.config._attn_implementation}), one thread",
        "windows": WINDOWS, "tokens": TOKENS, "prompt": PROMPT, "padding": PADDING,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
