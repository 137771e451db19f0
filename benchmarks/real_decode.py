"""A real model's cached decode on this machine, one thread: against the bare matrix-vector
products it has to do, and against transformers on the same float32 weights. SmolLM2-135M-
Instruct (notebook 18) or Gemma 3 270M (notebook 26, --model gemma3).

    python benchmarks/real_decode.py                  # SmolLM2 against its bare products (1 min)
    python benchmarks/real_decode.py --model gemma3   # Gemma 3
    .venv-reference/bin/python benchmarks/real_decode.py --transformers   # and transformers too
    python benchmarks/real_decode.py --quick          # fewer steps and rounds

The model: kvlib.load_smollm2() or kvlib.load_gemma3() (`make smollm2`, `make gemma3` first),
float32 weights memory-mapped. A decode step at a cache of P + n positions is timed, one token
at a time, greedy.

1. The bare products: every matrix a decode step multiplies by one row (7 a layer: SmolLM2's
   30 x 7 and its 49152 x 576 token table for the logits, Gemma 3's 18 x 7 and its 262144 x
   640 table), alone, in a loop with nothing else, each in
   the faster of its two layouts: the file's (out, in), read as kvlib's transposed view, or a
   contiguous (in, out) copy. The unembedding, too: the table itself (V, d), or a (d, V) copy
   (113 MB more memory for SmolLM2, 640 MiB for Gemma 3). The ratio kvlib step / bare
   products says what kvlib's Python and its small steps (norms, rotation, attention, the
   cache) add to the products that must run.
2. With --transformers (needs torch and transformers: .venv-reference): transformers'
   LlamaForCausalLM or Gemma3ForCausalLM from the same GGUF file (float32, dequantized by the
   gguf package as kvlib does), decoding with its own cache under torch.inference_mode(), one
   thread. Rounds alternate kvlib and transformers so that whatever else the machine does
   weighs on both.

Prints medians, the ratios, kvlib's peak memory (ru_maxrss after loading the model, a prefill of
512 tokens (with every row's logits for SmolLM2, as notebook 18 does; the last row's for Gemma
3, whose 512 rows would be 512 MiB of logits) and 8 decode steps, before the benchmark makes any
copy; Binder gives 1-2 GB), and the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="the model (default smollm2)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps a round (default 48, 12 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds (default 5, 2 with --quick)")
    parser.add_argument("--transformers", action="store_true",
                        help="also time transformers (needs torch and transformers)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = parser.parse_args(argv)
    args.steps = (12 if args.quick else 48) if args.steps is None else args.steps
    args.rounds = (2 if args.quick else 5) if args.rounds is None else args.rounds
    for name in ("prompt", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.transformers and not all(importlib.util.find_spec(name)
                                     for name in ("torch", "transformers")):
        parser.error("--transformers needs torch and transformers: `make test-reference` "
                     "installs them into .venv-reference; run .venv-reference/bin/python "
                     "benchmarks/real_decode.py --transformers")
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)    # before numpy (and torch) load
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib import gemma3  # noqa: E402
from kvlib.checkpoints import gemma3 as gemma3_files  # noqa: E402
from kvlib.checkpoints import smollm2  # noqa: E402


def runner(model: str):
    """(load params, tokenizer, prefill, decode_step, find_gguf) of the model."""
    if model == "gemma3":
        return (kvlib.load_gemma3, kvlib.gemma3_tokenizer, gemma3.prefill, gemma3.decode_step,
                gemma3_files.find_gguf)
    return (kvlib.load_smollm2, kvlib.smollm2_tokenizer, kvlib.prefill, kvlib.decode_step,
            smollm2.find_gguf)


def kvlib_steps(params, prompt: list[int], steps: int) -> tuple[list[float], list[int]]:
    """Seconds of each decode step after a prefill of prompt, and the tokens chosen."""
    _, _, prefill, decode_step, _ = runner(ARGS.model)
    logits, cache = prefill(params, prompt, last_only=True)
    tokens, seconds = [int(np.argmax(logits[-1]))], []
    for _ in range(steps):
        started = time.perf_counter()
        logits = decode_step(params, tokens[-1], cache)
        seconds.append(time.perf_counter() - started)
        tokens.append(int(np.argmax(logits[-1])))
    return seconds, tokens


def products(params) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, the matrix as kvlib holds it (in, out), a contiguous (in, out) copy)."""
    found = []
    for i, layer in enumerate(params.layers):
        for name in ("Wq", "Wk", "Wv", "Wo", "W_gate", "W_up", "W_down"):
            W = getattr(layer, name)
            found.append((f"{i}.{name}", W, np.ascontiguousarray(W)))
    return found


def bare_seconds(matrices, table, table_copy, rng) -> dict[str, float]:
    """One pass over every product of a decode step, in each layout: seconds."""
    widths = {W.shape[0] for _, W, _ in matrices} | {table.shape[1]}
    x = {n: rng.standard_normal((1, n)).astype(np.float32) for n in widths}
    times = {}
    for layout in ("file", "contiguous"):
        started = time.perf_counter()
        for _, as_held, contiguous in matrices:
            W = as_held if layout == "file" else contiguous
            x[W.shape[0]] @ W
        times[layout] = time.perf_counter() - started
    for layout, unembed in (("table", lambda v: v @ table.T),
                            ("copy", lambda v: v @ table_copy)):
        started = time.perf_counter()
        unembed(x[table.shape[1]])
        times[f"unembed {layout}"] = time.perf_counter() - started
    return times


def transformers_steps(model, prompt: list[int], steps: int):
    import torch

    with torch.inference_mode():
        output = model(torch.tensor([prompt]), use_cache=True)
        cache = output.past_key_values
        tokens, seconds = [int(output.logits[0, -1].argmax())], []
        for _ in range(steps):
            started = time.perf_counter()
            output = model(torch.tensor([[tokens[-1]]]), past_key_values=cache,
                           use_cache=True)
            seconds.append(time.perf_counter() - started)
            cache = output.past_key_values
            tokens.append(int(output.logits[0, -1].argmax()))
    return seconds, tokens


def load_transformers():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(ARGS.threads)
    path = runner(ARGS.model)[4]()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32).eval()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    load, load_tokenizer, prefill, decode_step, _ = runner(ARGS.model)
    params, tokenizer = load(), load_tokenizer()
    text = "The history of the printing press begins with movable type, and " * 50
    every_row = ARGS.model == "smollm2"             # Gemma 3's 512 rows: 512 MiB of logits
    _, cache = prefill(params, tokenizer.encode(text)[:512], last_only=not every_row)
    for token in range(8):
        decode_step(params, token, cache)
    kvlib_peak, cache = peak_mib(), None
    prompt = tokenizer.encode(text)[:ARGS.prompt]
    matrices = products(params)
    table_copy = np.ascontiguousarray(params.embedding.T)          # (d, V): a second table
    model = load_transformers() if ARGS.transformers else None
    rng = np.random.default_rng(0)
    ours, bare, theirs, same = [], [], [], True
    kvlib_steps(params, prompt, 2)                      # every page of the weights read once
    for _ in range(ARGS.rounds):
        seconds, tokens = kvlib_steps(params, prompt, ARGS.steps)
        ours.append(np.median(seconds))
        bare.append(bare_seconds(matrices, params.embedding, table_copy, rng))
        if model is not None:
            their_seconds, their_tokens = transformers_steps(model, prompt, ARGS.steps)
            theirs.append(np.median(their_seconds))
            same &= their_tokens == tokens
    step = float(np.median(ours))
    layouts = {key: float(np.median([b[key] for b in bare])) for key in bare[0]}
    fastest = min(layouts["file"], layouts["contiguous"]) + min(layouts["unembed table"],
                                                                 layouts["unembed copy"])
    held = layouts["file"] + layouts["unembed table"]
    print(report.machine_lines())
    print(f"{MODELS[ARGS.model]}, float32, prompt {len(prompt)} tokens, {ARGS.steps} decode "
          f"steps a round, {ARGS.rounds} rounds, medians\n")
    rows = [
        ("kvlib decode step", f"{step * 1e3:.1f} ms", f"{1 / step:.1f} tokens/s"),
        ("bare products, kvlib's layouts", f"{held * 1e3:.1f} ms", f"{step / held:.2f}x"),
        ("bare products, fastest layouts", f"{fastest * 1e3:.1f} ms", f"{step / fastest:.2f}x"),
        ("  blocks: file's (out, in) / (in, out) copy",
         f"{layouts['file'] * 1e3:.1f} / {layouts['contiguous'] * 1e3:.1f} ms", ""),
        ("  unembedding: table (V, d) / a (d, V) copy",
         f"{layouts['unembed table'] * 1e3:.1f} / {layouts['unembed copy'] * 1e3:.1f} ms",
         f"the copy costs {table_copy.nbytes / 2**20:,.0f} MiB"),
    ]
    if theirs:
        step_theirs = float(np.median(theirs))
        rows.append(("transformers decode step", f"{step_theirs * 1e3:.1f} ms",
                     f"{1 / step_theirs:.1f} tokens/s"))
        rows.append(("kvlib / transformers, tokens per second", f"{step_theirs / step:.2f}x",
                     "same tokens" if same else "tokens differ"))
    rows.append(("kvlib's peak memory", f"{kvlib_peak:.0f} MiB",
                 "model, a 512-token prefill, 8 steps"))
    print(report.table(("what", "time", "ratio / note"), rows))


if __name__ == "__main__":
    main()
