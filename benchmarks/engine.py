"""The engine of notebook 24 on this machine, one BLAS thread: four requests served by the
engine at once against kvlib.generate one after another, on the story model and on SmolLM2;
block attention against gather attention; the lesson's chat workload on three engines; and the
engine's bookkeeping against the model step it schedules.

    python benchmarks/engine.py              # about 2 minutes; writes benchmarks/data/engine.json
    python benchmarks/engine.py --quick      # one round, fewer tokens, about 30 s; writes nothing
    python benchmarks/engine.py --output results.json   # somewhere else

1. Four concurrent requests: the same four prompts, greedy, NEW_TOKENS new tokens each (no
   stop token, so every request makes them all), served by kvlib.serving.Engine.generate (all
   four at once: one prefill step, then one decode step for the four together) and by
   kvlib.generate for each prompt in turn (one request at a time, its own contiguous cache).
   On the story model (kvlib/models/stories: GPT-2 shaped, 4 layers of 96, 32-token prompts
   from its held-out stories) and on SmolLM2-135M-Instruct (the first four chat requests of
   notebook 24's workload). Both give the same tokens (checked); rounds alternate the two (the
   story model's, a fraction of a second each, five times as many), and each reports the
   median of its rounds in output tokens a second.
2. Attention over blocks: one layer's decode attention of 4 sequences at SmolLM2's shapes (9
   query heads, 3 K/V heads of 64, blocks of 16) at 64 and 512 positions each, float32:
   batched_block_attention (every block's softmax, then one merge: flash-decoding) against
   batched_gather_attention (the blocks gathered, one softmax: what Engine.step runs), the
   median of many calls each.
3. The workload (kvlib.serving.workloads.workload: eight chat requests arriving over six
   steps, a shared system message, one long passage) on three engines: the lesson's engine
   (blocks of 16, a budget of 64 tokens a step), the same with max_num_seqs=1 (one request at
   a time), and the lesson's static batching (workloads.variants). Rounds alternate the
   engines; each reports the median of its rounds.
4. The bookkeeping: 8 requests decoding together (prompts of the workload, 32 new tokens
   each); each step's time split into the model step (kvlib.serving.engine.forward_step) and
   everything else (scheduling, block accounting, the prefix cache, sampling, the step's
   checkpoint).

The machine, the BLAS, its threads and the load average before and after go into the JSON
(benchmarks/data/engine.json by default) with the command that remakes it; notebook 24 states
its figures, and tests/test_benchmark_smollm2_engine.py checks them against the file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import report  # benchmarks/report.py: threads, machine lines, tables

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "benchmarks" / "data" / "engine.json"
COMMAND = "python benchmarks/engine.py"
NEW_TOKENS = {"stories": 64, "smollm2": 32}
"""New tokens of each of the four requests (quick: a quarter)."""
ROUNDS_FACTOR = {"stories": 5, "smollm2": 1}
"""The story model's four requests take a fraction of a second: five times the rounds."""
ATTENTION_POSITIONS = (64, 512)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round, a quarter of the tokens; writes no JSON unless "
                             "--output is given")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, 1 quick)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"where the JSON goes (default {OUTPUT.relative_to(ROOT)}; "
                             "quick: none)")
    args = parser.parse_args(argv)
    args.rounds = (1 if args.quick else 3) if args.rounds is None else args.rounds
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    if args.output is None and not args.quick:
        args.output = OUTPUT
    return args


ARGS = parse_arguments() if __name__ == "__main__" else None
if ARGS is not None:
    report.use_threads(ARGS.threads)
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import kvlib  # noqa: E402
from kvlib.serving import Engine, SamplingParams, workloads  # noqa: E402
from kvlib.serving import block_attention as paged  # noqa: E402
from kvlib.serving import engine as engine_module  # noqa: E402

# ------------------------------------------------------------------ 1. four requests at once

def four_prompts(name: str) -> tuple[kvlib.Params, list[list[int]]]:
    """The model and the four prompts of part 1."""
    if name == "stories":
        from kvlib.stories import corpus, load_model

        sequences = corpus.story_sequences(4, corpus.HELD_OUT_SEED)
        return load_model("stories", dtype="float32"), [row[:32].tolist() for row in sequences]
    tokenizer = kvlib.smollm2_tokenizer()
    return kvlib.load_smollm2(), workloads.chat_prompts(tokenizer)[:4]


def engine_against_generate(name: str, new_tokens: int, rounds: int) -> dict:
    """Seconds of each round for the engine (four at once) and for kvlib.generate (one after
    another), and whether their tokens agree."""
    params, prompts = four_prompts(name)
    size = 16
    blocks = sum(-(-(len(p) + new_tokens) // size) for p in prompts) + 4
    sampling = SamplingParams(max_tokens=new_tokens)
    seconds = {"engine": [], "generate": []}
    outputs = {}
    for _ in range(rounds):
        started = time.perf_counter()
        engine = Engine(params, block_size=size, n_blocks=blocks, max_num_batched_tokens=256)
        outputs["engine"] = engine.generate(prompts, sampling)
        seconds["engine"].append(time.perf_counter() - started)
        started = time.perf_counter()
        outputs["generate"] = [kvlib.generate(params, prompt, new_tokens) for prompt in prompts]
        seconds["generate"].append(time.perf_counter() - started)
    if outputs["engine"] != outputs["generate"]:
        raise SystemExit(f"{name}: the engine's tokens differ from kvlib.generate's")
    return {"requests": len(prompts), "prompt_lengths": [len(p) for p in prompts],
            "new_tokens": new_tokens, "engine_seconds": seconds["engine"],
            "generate_seconds": seconds["generate"], "same_tokens": True}


def tokens_per_second(row: dict, who: str) -> float:
    return row["requests"] * row["new_tokens"] / float(np.median(row[f"{who}_seconds"]))


# ------------------------------------------------------------------ 2. block against gather

def attention_seconds(positions: int, calls: int) -> dict:
    """Median seconds of one call of each batched attention: 4 decoding sequences at SmolLM2's
    shapes, each over `positions` positions in blocks of 16 scattered over the pool."""
    rng = np.random.default_rng(24)
    R, h, kv, dh, size = 4, 9, 3, 64, 16
    n = -(-positions // size)
    pool = R * n + 8
    keys, values = rng.standard_normal((2, pool, size, kv * dh)).astype(np.float32)
    tables = rng.permutation(pool)[:R * n].reshape(R, n)
    Q = rng.standard_normal((R, h, 1, dh)).astype(np.float32)
    at = np.full((R, 1), positions - 1)
    seconds = {}
    for name, function in (("block", paged.batched_block_attention),
                           ("gather", paged.batched_gather_attention)):
        function(Q, at, keys, values, tables)                      # warm
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            function(Q, at, keys, values, tables)
            times.append(time.perf_counter() - started)
        seconds[name] = float(np.median(times))
    np.testing.assert_allclose(paged.batched_block_attention(Q, at, keys, values, tables),
                               paged.batched_gather_attention(Q, at, keys, values, tables),
                               rtol=1e-4, atol=1e-5)
    return {"sequences": R, "positions": positions, "block_seconds": seconds["block"],
            "gather_seconds": seconds["gather"]}


# ------------------------------------------------------------------ 3, 4. the workload

def engines(params) -> dict:
    variants = workloads.variants(params)
    return {
        "the engine (continuous batching)": variants["the engine"],
        "one request at a time": lambda: Engine(params, block_size=16, n_blocks=48,
                                                max_num_batched_tokens=64, max_num_seqs=1),
        "static batching": variants["static batching"],
    }


def bookkeeping(params, prompts, steps: int) -> tuple[float, float]:
    """(median seconds of a whole step, median seconds of its model step) with 8 requests
    decoding together."""
    model_seconds = []
    timed_forward = engine_module.forward_step

    def forward(*args):
        started = time.perf_counter()
        result = timed_forward(*args)
        model_seconds.append(time.perf_counter() - started)
        return result

    engine = Engine(params, block_size=16, n_blocks=64, max_num_batched_tokens=512)
    for prompt in prompts[:8]:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2))
    engine.step()                                     # every prefill in one step
    engine_module.forward_step = forward
    try:
        step_seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - started)
    finally:
        engine_module.forward_step = timed_forward
    return float(np.median(step_seconds)), float(np.median(model_seconds))


def main(args) -> None:
    load_before = report.load_average()
    print(report.machine_lines())
    quick = 4 if args.quick else 1
    print(f"mode: {'quick' if args.quick else 'full'}; {args.rounds} round(s), medians\n")

    print("## Four requests: the engine at once against kvlib.generate one after another\n")
    concurrent = {name: engine_against_generate(name, tokens // quick,
                                                args.rounds * ROUNDS_FACTOR[name])
                  for name, tokens in NEW_TOKENS.items()}
    rows = []
    for name, row in concurrent.items():
        engine_rate, alone_rate = (tokens_per_second(row, who) for who in ("engine", "generate"))
        rows.append((name, f"{row['requests']} x {row['new_tokens']}", f"{engine_rate:.1f}",
                     f"{alone_rate:.1f}", f"{engine_rate / alone_rate:.2f}x"))
    print(report.table(("model", "requests x new tokens", "engine tokens/s",
                        "generate tokens/s", "engine / generate"), rows))
    sys.stdout.flush()

    print("\n## Decode attention of 4 sequences over blocks of 16 (SmolLM2's shapes, float32)\n")
    attention = [attention_seconds(positions, 20 if args.quick else 200)
                 for positions in ATTENTION_POSITIONS]
    print(report.table(("positions", "block (merge) us", "gather us", "block / gather"),
                       [(row["positions"], f"{row['block_seconds'] * 1e6:.0f}",
                         f"{row['gather_seconds'] * 1e6:.0f}",
                         f"{row['block_seconds'] / row['gather_seconds']:.2f}x")
                        for row in attention]))
    sys.stdout.flush()

    params = kvlib.load_smollm2()
    requests = workloads.workload(kvlib.smollm2_tokenizer())
    makers = engines(params)
    results = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            results[name].append(workloads.run_variant(make(), requests))
    print(f"\n## notebook 24's workload: 8 chat requests to SmolLM2-135M-Instruct (float32), "
          f"{args.rounds} round(s), medians\n")
    rows, workload_rows = [], {}
    for name, runs in results.items():
        def median(key, runs=runs):
            return float(np.median([run[key] for run in runs]))
        workload_rows[name] = {key: median(key) for key in
                               ("tokens_per_second", "ttft_seconds", "tpot_seconds", "steps")}
        rows.append((name, f"{median('tokens_per_second'):.1f}",
                     f"{median('ttft_seconds') * 1000:.0f} ms",
                     f"{median('tpot_seconds') * 1000:.0f} ms", f"{median('steps'):.0f}"))
    print(report.table(("engine", "output tokens/s", "TTFT", "TPOT", "steps"), rows))
    step, model = bookkeeping(params, [prompt for _, prompt, _ in requests],
                              8 if args.quick else 24)
    print(f"\nbatch 8, decoding: a step {step * 1000:.1f} ms, its model step "
          f"{model * 1000:.1f} ms; the bookkeeping around it {(step - model) * 1000:.1f} ms, "
          f"{(step - model) / step:.1%} of the step")
    load_after = report.load_average()
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    if args.output is not None:
        result = {"command": COMMAND + (" --quick" if args.quick else ""),
                  "machine": report.machine(),
                  "load_average": {"before": load_before, "after": load_after},
                  "rounds": args.rounds, "concurrent": concurrent, "attention": attention,
                  "workload": workload_rows,
                  "bookkeeping": {"step_seconds": step, "model_step_seconds": model}}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main(ARGS)
