"""Measure the locator's tolerance for each number format and model (notebook 25), once, and
keep the numbers small (kvlib/models/tolerances.json; kvlib.debug.tolerance_for reads it).

    python tools/measure_tolerances.py                      # about 5 minutes on 2 cores
    python tools/measure_tolerances.py --kernels native     # this machine's kernel only
    python tools/measure_tolerances.py --check              # recompute, compare with the file

kvlib.debug.first_divergence reports the first quantity that differs from full recomputation
by more than a tolerance, relative to the size of the numbers compared. In 16 bits a right
loop differs by the format's rounding, so the tolerance must stand above what right loops
show, and below what bugs show. Measured here, for the story model ("stories": 4 layers,
d_model 96) and SmolLM2-135M ("smollm2": 30 layers, d_model 576), in float32, float16 and
bfloat16 (kvlib.precision's emulation: weights rounded, every building block's result
rounded):

- right loops: kvlib's own prefill and decode step on PROMPTS prompts per model (the story
  model: the zoo's prompt and windows of held-out stories; SmolLM2: windows of Python's
  documentation, the text of kvlib/models/smollm2/measured.json, and two sentences of prose),
  and on the bugs' prompt the zoo's right loop as written, with the bugs' sliding window and
  with the prompt in chunks of 4 (each of these rounds in its own way), NEW_TOKENS new tokens
  each. kvlib.debug.largest_differences gives, quantity by quantity, the
  largest difference over the size of the numbers compared, over every step; the largest of
  all, over quantities, prompts and OpenBLAS kernels (OPENBLAS_CORETYPE, each kernel its own
  process: kernels add in other orders), is what a right loop shows.
- the tolerance: MARGIN times that, rounded up to one significant digit (float32 keeps
  kvlib.debug.DEFAULT_TOLERANCES', checked to stand MARGIN times above what was measured).
- bugs: the zoo's bugs that change numbers (kvlib.cache_bugs: an offset that jumps, no mask in
  the prefill, a mask from the top-left, one batch position, a window one short, a prefix
  block without its parent) planted on each model, located in float32 with the default
  tolerance (where the bug starts) and in each 16-bit format with its measured tolerance (on
  this machine's kernel): the step, layer, position and quantity, and the relative difference
  found there.

The tool stops when a check fails: every bug is found in every format, never before it starts;
the bugs that move positions or masks ("loud") at the same step, layer, position and
quantity as in float32, LOUD_GAP times above the largest right-loop difference or more. The
quiet ones (a window one short moves one weight by the weight of the key it drops; a block
borrowed after a one-word change moves the next layer's keys a little) may start under 16-bit
rounding: the file says where the locator finds them (a later layer, or the next step), and by
how much.

float32 is measured under the machine's own kernel only (its tolerance is the default, 2e-4,
which must stand MARGIN times above); float16 and bfloat16 under every kernel asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
sys.path.insert(0, str(ROOT))

import kvlib  # noqa: E402
from kvlib import cache_bugs, debug, precision, stories  # noqa: E402

OUTPUT = ROOT / "kvlib" / "models" / "tolerances.json"
MODELS = ("stories", "smollm2")
FORMATS = ("float32", "float16", "bfloat16")
KERNELS = ("native", "Haswell", "Sandybridge", "Prescott")
PROMPTS = {"stories": 8, "smollm2": 6}
PROMPT_TOKENS = 24
NEW_TOKENS = 16
BUG_NEW_TOKENS = 8
MARGIN = 2.0
LOUD_GAP = 5.0
LOUD = ("offset", "mask", "top-left", "batch")
PLACE = ("step", "layer", "position", "quantity")
SMOLLM2_PROSE = (
    "The sky is blue because molecules in the air scatter short wavelengths of sunlight more "
    "than long ones. At sunset",
    "My grandmother kept bees behind her house, and every summer we helped her take the honey "
    "from the hives.",
)
SMOLLM2_OTHER_WORD = (" sky", " sea")      # the bug prompt's other request: one word changed
SMOLLM2_WINDOW = {"window": 16, "sink_tokens": 1}
"""The bugs' window on SmolLM2, with one attention sink: SmolLM2 leans on its first token
(notebook 17), and a window that drops it sends the activations far from anything it was
trained on, and the 16-bit rounding with them (right loops then part by up to 0.24 in
bfloat16, three times as far as with the sink)."""


# ------------------------------------------------------------------------------ the models

def load(name: str):
    """(params in float32, encode) of a model."""
    if name == "stories":
        return stories.load_model(dtype="float32"), stories.load_tokenizer().encode
    return kvlib.load_smollm2(), kvlib.smollm2_tokenizer().encode


def prompts(name: str, encode) -> list[list[int]]:
    """The right loops' prompts of a model."""
    if name == "stories":
        from kvlib.stories.corpus import HELD_OUT_SEED, story_sequences

        windows = story_sequences(PROMPTS[name] - 1, seed=HELD_OUT_SEED, length=PROMPT_TOKENS)
        return [encode(cache_bugs.ZOO_PROMPT)] + [list(map(int, row)) for row in windows]
    ids = kvlib.checkpoints.smollm2.measured()["ids"]
    n_windows = PROMPTS[name] - len(SMOLLM2_PROSE)
    step = len(ids) // n_windows
    return [ids[i * step:i * step + PROMPT_TOKENS] for i in range(n_windows)] + \
        [encode(text) for text in SMOLLM2_PROSE]


def bug_cases(name: str, params, encode) -> tuple[list[int], dict]:
    """(the bugs' prompt, bug -> (config changes, a function that makes the locator's options
    afresh)) on a model, as the zoo plants them (kvlib.cache_bugs.zoo)."""
    if name == "stories":
        prompt, other = encode(cache_bugs.ZOO_PROMPT), encode(cache_bugs.ZOO_OTHER_PROMPT)
        window = {"window": cache_bugs.ZOO_WINDOW}
    else:
        prompt = encode(SMOLLM2_PROSE[0])
        other = encode(SMOLLM2_PROSE[0].replace(*SMOLLM2_OTHER_WORD, 1))
        window = SMOLLM2_WINDOW
    return prompt, {
        "offset": ({}, lambda p: dict(decode_step=cache_bugs.JumpingOffset())),
        "mask": ({}, lambda p: dict(prefill=cache_bugs.prefill_without_mask)),
        "top-left": ({}, lambda p: dict(decode_step=cache_bugs.decode_step_mask_from_the_top)),
        "batch": ({}, lambda p: dict(decode_step=cache_bugs.SharedBatchPosition(6))),
        "window": (window, lambda p: dict(decode_step=cache_bugs.decode_step_window_one_short)),
        "parent": ({}, lambda p: dict(prefill=cache_bugs.PrefixCacheWithoutParent(p, 4,
                                                                                  [other]))),
    }


# ------------------------------------------------------------------------------ measuring

def right_runs(name: str, params, encode) -> list[tuple]:
    """The right loops measured on a model: (label, config changes, prompt, a function that
    makes the locator's options afresh). kvlib's own loop on each prompt, and on the bugs'
    prompt the zoo's right loops: its loop written out (kvlib.cache_bugs.decode_step and
    prefill), with the bugs' sliding window, and with the prompt fed in blocks of 4 (the
    prefix cache with no earlier request: every block computed, in chunks)."""
    runs = [(f"prompt {index}", {}, ids, lambda p: {})
            for index, ids in enumerate(prompts(name, encode))]
    prompt, cases = bug_cases(name, params, encode)
    zoo = dict(decode_step=cache_bugs.decode_step, prefill=cache_bugs.prefill)
    return runs + [
        ("the zoo's loop", {}, prompt, lambda p: zoo),
        ("the zoo's loop, windowed", cases["window"][0], prompt, lambda p: zoo),
        ("the zoo's loop, in chunks of 4", {}, prompt,
         lambda p: zoo | dict(prefill=cache_bugs.PrefixCacheWithoutParent(p, 4, [])))]


def right_loops(name: str, number_formats) -> dict:
    """format -> {"largest", "quantity", "run", "by_run"}: the largest relative difference right
    loops show over the runs of right_runs, under this process's OpenBLAS kernel."""
    params, encode = load(name)
    runs = right_runs(name, params, encode)
    result = {}
    for number_format in number_formats:
        weights = precision.in_format(params, number_format)
        worst = {"largest": 0.0, "quantity": None, "run": None, "by_run": {}}
        with precision.computed_in(number_format):
            for label, changes, ids, make in runs:
                loop = weights.with_config(**changes) if changes else weights
                largest = debug.largest_differences(loop, ids, NEW_TOKENS, **make(loop))
                quantity = max(largest, key=largest.get)
                worst["by_run"][label] = largest[quantity]
                if largest[quantity] > worst["largest"]:
                    worst |= {"largest": largest[quantity], "quantity": quantity,
                              "run": label}
        result[number_format] = worst
        del weights
    return result


def located(found) -> dict | None:
    """What the file keeps of a Divergence."""
    if found is None:
        return None
    return {"step": found.step, "layer": found.layer, "position": found.position,
            "quantity": found.quantity, "relative": found.relative, "report": str(found)}


def bugs(name: str, tolerances: dict) -> dict:
    """bug -> format -> where the locator finds it and by how much, in float32 with the default
    tolerance and in 16 bits with the measured one."""
    params, encode = load(name)
    prompt, cases = bug_cases(name, params, encode)
    result = {bug: {} for bug in cases}
    for number_format in FORMATS:
        weights = precision.in_format(params, number_format)
        tolerance = None if number_format == "float32" else tolerances[number_format]
        with precision.computed_in(number_format):
            for bug, (changes, make) in cases.items():
                planted = weights.with_config(**changes) if changes else weights
                options = dict(decode_step=cache_bugs.decode_step, prefill=cache_bugs.prefill)
                found = debug.first_divergence(planted, prompt, BUG_NEW_TOKENS,
                                               tolerance=tolerance,
                                               **(options | make(planted)))
                result[bug][number_format] = located(found)
        del weights
    return result


def round_up(x: float) -> float:
    """x rounded up to one significant digit: 0.0123 -> 0.02."""
    scale = 10 ** math.floor(math.log10(x))
    return float(f"{math.ceil(x / scale - 1e-9) * scale:.1g}")


def formats_under(kernel: str) -> tuple[str, ...]:
    """The formats measured under a kernel: float32 under the machine's own only (its
    tolerance is the default, 2e-4, checked against what was measured with ten times room)."""
    return FORMATS if kernel == "native" else FORMATS[1:]


def in_kernel(kernel: str, name: str) -> dict:
    """right_loops(name) in a process of its own, under one OpenBLAS kernel."""
    environment = dict(os.environ)
    environment.pop("OPENBLAS_CORETYPE", None)
    if kernel != "native":
        environment["OPENBLAS_CORETYPE"] = kernel
    started = time.monotonic()
    done = subprocess.run([sys.executable, __file__, "--right-loops", name,
                           "--formats", *formats_under(kernel)], env=environment,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} under {kernel} failed:\n{done.stderr}")
    print(f"  {name}, {kernel}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(kernels) -> dict:
    jobs = [(kernel, name) for name in reversed(MODELS) for kernel in kernels]
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        runs = dict(zip(jobs, pool.map(lambda job: in_kernel(*job), jobs)))
    models = {}
    for name in MODELS:
        entry = {}
        for number_format in FORMATS:
            by_kernel = {kernel: runs[kernel, name][number_format] for kernel in kernels
                         if number_format in formats_under(kernel)}
            kernel = max(by_kernel, key=lambda k: by_kernel[k]["largest"])
            largest = by_kernel[kernel]["largest"]
            tolerance = (debug.DEFAULT_TOLERANCES["float32"] if number_format == "float32"
                         else round_up(MARGIN * largest))
            labels = list(by_kernel[kernel]["by_run"])
            entry[number_format] = {
                "tolerance": tolerance, "largest": largest,
                "quantity": by_kernel[kernel]["quantity"], "kernel": kernel,
                "run": by_kernel[kernel]["run"],
                "by_kernel": {k: run["largest"] for k, run in by_kernel.items()},
                "by_run": {label: max(run["by_run"][label] for run in by_kernel.values())
                           for label in labels}}
        started = time.monotonic()
        found = bugs(name, {f: entry[f]["tolerance"] for f in FORMATS})
        print(f"  {name}, the bugs: {time.monotonic() - started:.0f} s", flush=True)
        for number_format in FORMATS:
            relative = {bug: (math.inf if where[number_format] is None
                              else where[number_format]["relative"])
                        for bug, where in found.items()}
            smallest = min(relative, key=relative.get)
            largest = entry[number_format]["largest"]
            entry[number_format] |= {
                "smallest_bug": relative[smallest], "smallest_bug_name": smallest,
                "gap": relative[smallest] / largest if largest else math.inf,
                "loud_gap": min(relative[bug] for bug in LOUD) / largest if largest
                else math.inf}
        models[name] = {"prompts": PROMPTS[name], "formats": entry, "bugs": found}
    return {"command": "python tools/measure_tolerances.py", "kernels": list(kernels),
            "margin": MARGIN, "loud_gap": LOUD_GAP, "loud": list(LOUD),
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
            "bug_new_tokens": BUG_NEW_TOKENS, "models": models}


def check(measured: dict) -> list[str]:
    """What the measurement must show; the failures, in words."""
    failures = []
    for name, model in measured["models"].items():
        for number_format, entry in model["formats"].items():
            if entry["tolerance"] < MARGIN * entry["largest"]:
                failures.append(f"{name} {number_format}: the tolerance {entry['tolerance']} is "
                                f"under {MARGIN} x the right loops' {entry['largest']:.3g}")
            if number_format != "float32" and entry["loud_gap"] < LOUD_GAP:
                failures.append(f"{name} {number_format}: a loud bug stands only "
                                f"{entry['loud_gap']:.3g} times above the right loops")
        for bug, where in model["bugs"].items():
            start = where["float32"]
            for number_format in FORMATS[1:]:
                got = where[number_format]
                if got is None or order(got) < order(start):
                    failures.append(f"{name} {number_format}: {bug} not found, or found before "
                                    f"it starts ({start['report']}): {got and got['report']}")
                elif bug in LOUD and [got[key] for key in PLACE] != [start[key] for key in PLACE]:
                    failures.append(f"{name} {number_format}: {bug} found elsewhere than where "
                                    f"it starts ({start['report']}): {got['report']}")
    return failures


def order(where: dict) -> tuple[int, int]:
    """(step, position) of a place, the prefill first: a bug is found where it starts or later,
    never before (that would be a right loop blamed)."""
    return (-1 if where["step"] is None else where["step"], where["position"])


def summary(measured: dict) -> str:
    lines = [f"{'model':8} {'format':9} {'largest':>9} {'tolerance':>9} {'smallest bug':>13} "
             f"{'gap':>6} {'loud gap':>9}"]
    for name, model in measured["models"].items():
        for number_format, entry in model["formats"].items():
            lines.append(f"{name:8} {number_format:9} {entry['largest']:9.2g} "
                         f"{entry['tolerance']:9.2g} {entry['smallest_bug']:13.3g} "
                         f"{entry['gap']:6.1f} {entry['loud_gap']:9.1f}   "
                         f"({entry['smallest_bug_name']}; right loops: {entry['run']}, "
                         f"{entry['quantity']}, {entry['kernel']})")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS),
                        help="OpenBLAS kernels (OPENBLAS_CORETYPE; native: this machine's)")
    parser.add_argument("--check", action="store_true",
                        help="recompute and compare with the committed file")
    parser.add_argument("--right-loops", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS,
                        help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.right_loops:                      # a child process: one model, one kernel
        print(json.dumps(right_loops(options.right_loops, options.formats)))
        return
    if "native" not in options.kernels:
        raise SystemExit("--kernels must include native: float32 is measured there")
    started = time.monotonic()
    measured = measure(options.kernels)
    print(summary(measured))
    failures = check(measured)
    print(f"{time.monotonic() - started:.0f} s in all")
    if failures:
        raise SystemExit("the measurement does not show what it must:\n" + "\n".join(failures))
    if options.check and OUTPUT.is_file():
        committed = json.loads(OUTPUT.read_text())
        for name in MODELS:
            for number_format in FORMATS:
                was = committed["models"][name]["formats"][number_format]["tolerance"]
                now = measured["models"][name]["formats"][number_format]["tolerance"]
                print(f"{name} {number_format}: tolerance {was} committed, {now} now")
        return
    OUTPUT.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
