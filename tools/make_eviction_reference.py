"""Write tests/data/eviction-reference.npz: what NVIDIA's kvpress 0.5.5, on transformers,
keeps of a prompt and predicts next, for kvlib's eviction policies to be checked against a
real implementation (tests/test_eviction.py).

Needs torch and transformers (the reference environment, never CI) and kvpress 0.5.5, which
pins transformers < 5.3 and imports its benchmark's libraries (datasets, pandas) at the top;
its presses need neither, so it is installed beside, without dependencies, and the two are
stubbed if missing:

    .venv-reference/bin/pip install --no-deps --target /tmp/kvpress kvpress==0.5.5 \
        cachetools==5.5.2 fire==0.6.0 six
    PYTHONPATH=/tmp/kvpress .venv-reference/bin/python tools/make_eviction_reference.py

The model: tests/data/llama-reference's tiny random Llama (3 layers, 4 query heads, 2 K/V
heads), in float64 with its norm and rotary angles computed in float64 (as
tools/make_llama_reference.py does). A prompt of PROMPT random ids is prefilled with each press
at compression ratio 1 - KEPT / PROMPT, which keeps KEPT positions in every layer and K/V head;
then one more token is decoded at position PROMPT through the compressed cache. Saved per
press: the positions kept (layer, K/V head, KEPT), found by matching each kept key with the
uncompressed cache's rows, and the decode step's logits. (kvpress computes SnapKV's window
weights with a float32 softmax: tests/test_eviction.py checks, in float64, that the kept and the
dropped are far apart, so that the reference does not rest on a near tie.)

Presses and their kvlib counterparts: StreamingLLMPress(n_sink=4) is kvlib's Sinks(4) (without
kvpress's KeyRerotationPress, kept keys keep their rotation, as in kvlib); SnapKVPress(window
4, kernel 3) is SnapKV(4, 3) (kvpress averages the window's weights over queries and over the
group's heads where kvlib sums: the same order); TOVAPress keeps the last position always and
the KEPT - 1 others the last query weighs most, averaged over every query head: kvlib's TOVA
when the last position is among its KEPT most weighed, which this tool checks.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from make_llama_reference import FLOAT64_FORWARDS, LLAMA_OUT  # noqa: E402
from transformers_runs import forwards_replaced  # noqa: E402

for _name in ("datasets", "pandas"):      # kvpress's __init__ imports them for its benchmark
    try:
        __import__(_name)
    except ImportError:
        _stub = types.ModuleType(_name)
        _stub.__spec__ = importlib.machinery.ModuleSpec(_name, None)
        _stub.load_dataset = None
        sys.modules[_name] = _stub

import kvpress  # noqa: E402
from kvpress import SnapKVPress, StreamingLLMPress, TOVAPress  # noqa: E402

OUT = ROOT / "tests" / "data" / "eviction-reference.npz"
SEED, PROMPT, KEPT = 7, 32, 12
PRESSES = {
    "sinks": lambda ratio: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
    "snapkv": lambda ratio: SnapKVPress(compression_ratio=ratio, window_size=4, kernel_size=3),
    "tova": lambda ratio: TOVAPress(compression_ratio=ratio),
}


def on_this_transformers(press):
    """kvpress 0.5.5's hook reads the attention's keyword arguments of transformers < 5.3
    (past_key_values, cache_position); transformers 5.25 passes the cache as `cache` and no
    cache_position. The hook is given what it expects: the cache, and the positions of the
    pass's queries (the layer's cache already holds them, so they end at its length)."""
    hook = press.forward_hook

    def forward_hook(module, args, kwargs, output):
        cache, queries = kwargs["cache"], kwargs["hidden_states"].shape[1]
        seen = cache.layers[module.layer_idx].keys.shape[2]
        kwargs = {**kwargs, "past_key_values": cache,
                  "cache_position": torch.arange(seen - queries, seen)}
        return hook(module, args, kwargs, output)

    press.forward_hook = forward_hook
    return press


def prefill(model, ids, press=None) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model(ids, cache=cache, use_cache=True)
        else:
            with press(model):
                model(ids, cache=cache, use_cache=True)
    return cache


def decode(model, cache, token: int) -> np.ndarray:
    """One token at position PROMPT (not at the compressed cache's length)."""
    with torch.no_grad():
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[PROMPT]]),
                    cache_position=torch.tensor([PROMPT]))
    return out.logits[0].numpy()


def kept_positions(full: DynamicCache, compressed: DynamicCache) -> np.ndarray:
    """(layers, kv, KEPT): for each kept key, the position whose uncompressed key it is."""
    rows = []
    for full_layer, layer in zip(full.layers, compressed.layers):
        every, kept = full_layer.keys[0].numpy(), layer.keys[0].numpy()     # (kv, S, dh)
        heads = []
        for head in range(kept.shape[0]):
            distance = np.abs(kept[head][:, None, :] - every[head][None, :, :]).max(axis=-1)
            assert (distance.min(axis=1) == 0).all(), "a kept key is no key of the prompt"
            heads.append(np.sort(distance.argmin(axis=1)))
        rows.append(heads)
    return np.array(rows)


def main() -> None:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(LLAMA_OUT, torch_dtype=torch.float64,
                                             attn_implementation="sdpa").eval()
    rng = np.random.default_rng(SEED)
    ids = rng.integers(2, model.config.vocab_size, PROMPT)
    token = int(rng.integers(2, model.config.vocab_size))
    prompt = torch.tensor(ids)[None]
    ratio = 1 - KEPT / PROMPT
    record = {"ids": ids, "token": np.array(token)}
    with forwards_replaced(FLOAT64_FORWARDS):
        full = prefill(model, prompt)
        record["full_logits"] = decode(model, full, token)
        full = prefill(model, prompt)
        for name, make in PRESSES.items():
            compressed = prefill(model, prompt, on_this_transformers(make(ratio)))
            record[f"{name}_positions"] = kept_positions(full, compressed)
            record[f"{name}_logits"] = decode(model, compressed, token)
            print(name, record[f"{name}_positions"][0].tolist())
    np.savez_compressed(OUT, **record)
    (OUT.with_suffix(".json")).write_text(json.dumps(
        {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
         "transformers": transformers.__version__, "torch": torch.__version__,
         "seed": SEED, "prompt": PROMPT, "kept": KEPT}, indent=2) + "\n")
    print("wrote", OUT.relative_to(ROOT))


if __name__ == "__main__":
    main()
