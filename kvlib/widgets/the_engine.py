"""The engine lesson's pictures, step by step (its workload is kvlib.serving.workloads).

- draw_engine_pool: every block of the pool, free, cached and idle, held, or shared
  (kvlib.plots.draw_pool);
- draw_batch: what one step computed for each request (a prefill chunk or a decode), and who
  was preempted;
- engine_widget: Step / Run to the end / Reset on an engine, redrawing both, the queue and the
  running service numbers;
- engine_benchmark, benchmark_figures, benchmark_summary: what benchmarks/engine.py measured on
  this project's machine (benchmarks/data/engine.json), in the words the lesson states it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ipywidgets as widgets
import matplotlib.pyplot as plt

from kvlib.plots import draw_pool
from kvlib.serving.engine import Engine, summarize

from .base import LiveFigure, as_html, plural, safely


def draw_engine_pool(ax, engine: Engine):
    """The engine's pool (plots.draw_pool): free, cached and idle, held or shared blocks, each
    held block labelled with the ids of the requests that hold it."""
    tables = {request.request_id: request.block_table for request in engine.running}
    pool = engine.pool
    cached = sum(key is not None for key in pool.key_of)
    return draw_pool(ax, pool, tables, columns=16,
                     title=f"The pool after step {engine.step_count}: {len(pool.free)} free, "
                           f"{cached} cached, {pool.n_used} held; the labels are request ids")


def draw_batch(ax, engine: Engine) -> None:
    """Tokens each request computed in the last step: prefill chunks and decodes, against
    the token budget; preempted requests are named in the title."""
    ax.clear()
    record = engine.last_step
    ids = sorted(record.scheduled_tokens)
    for row, request_id in enumerate(ids):
        n = record.scheduled_tokens[request_id]
        colour = "#009E73" if request_id in record.decodes else "#0072B2"
        ax.barh(row, n, color=colour)
        ax.text(n + 0.3, row, f"{n}", va="center", fontsize=8)
    ax.set_yticks(range(len(ids)), [f"request {i}" for i in ids])
    ax.set_xlim(0, engine.max_num_batched_tokens * 1.1)
    ax.axvline(engine.max_num_batched_tokens, color="0.5", ls="--", lw=1)
    ax.set_xlabel(f"tokens computed this step (budget {engine.max_num_batched_tokens}, dashed)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#0072B2", "#009E73")]
    ax.legend(handles, ["prefill (a prompt or a chunk of it)", "decode (one token)"],
              fontsize=8, loc="lower right")
    preempted = ", ".join(str(i) for i in record.preempted) or "nobody"
    ax.set_title(f"Step {record.step}: {sum(record.scheduled_tokens.values())} tokens for "
                 f"{plural(len(ids), 'request')}; preempted: {preempted}", fontsize=10)


def queue_status(engine: Engine, refused=()) -> str:
    """Who runs, who waits, who finished, and who was refused (a request the engine would not
    queue), with the counts since the start."""
    waiting = ", ".join(str(r.request_id) for r in engine.waiting) or "empty"
    running = ", ".join(str(r.request_id) for r in engine.running) or "none"
    finished = sum(r.status == "finished" for r in engine.requests.values())
    stats = engine.stats
    preemptions = plural(stats["preemptions"], "preemption")
    refusals = f"; refused: {', '.join(str(index) for index, _ in refused)}" if refused else ""
    return (f"running: {running}; waiting: {waiting}; finished: {finished} of "
            f"{len(engine.requests)}{refusals}. Since the start: {preemptions}, "
            f"{stats['prefix_hit_tokens']} of {stats['prompt_tokens']} prompt tokens from the "
            "prefix cache.")


def service_status(engine: Engine) -> str:
    done = [i for i, r in engine.requests.items() if r.status == "finished"]
    if not done:
        return "No request has finished yet."
    numbers = summarize(engine, done)
    return (f"Over the {plural(len(done), 'finished request')}: time to first token "
            f"{numbers['ttft_steps']:.1f} steps ({numbers['ttft_seconds'] * 1000:.0f} ms here), "
            f"time per output token {numbers['tpot_seconds'] * 1000:.0f} ms here (in steps it "
            f"is about 1: every running request gets a token every step), "
            f"{numbers['tokens_per_step']:.2f} tokens a step ({numbers['tokens_per_second']:.1f} "
            "a second), medians.")


def refusal_note(requests, refused, arrived: int) -> str:
    """In words, the requests the engine would not queue and why (its own message), the first
    one whole, the others by number; arrived: how many requests have arrived so far."""
    if not refused:
        return ""
    index, reason = refused[0]
    _, prompt, sampling = requests[index]
    note = (f"Request {index} ({len(prompt)} prompt tokens, at most {sampling.max_tokens} new) "
            f"was not queued: {reason}.")
    others = [str(i) for i, _ in refused[1:]]
    if others:
        note += (f" Nor {'were requests' if len(others) > 1 else 'was request'} "
                 f"{', '.join(others)}, for the same kind of reason.")
    if len(refused) == arrived:
        return note + (" No request so far can be served: give the engine a larger pool "
                       "(n_blocks).")
    return note + " The others are served as usual; a larger pool (n_blocks) would take it."


REDRAW_SECONDS = 0.5
"""Run to the end redraws the figure when this long has passed since the last drawing (the
text lines change after every step): feedback well under a second apart, without spending the
run on drawing."""
MAX_STEPS = 10_000
"""Run to the end stops after this many steps, whatever happens (an engine never needs as many
on the lesson's workload)."""


def engine_widget(make_engine, requests):
    """Step an engine through a workload (the_engine): make_engine() builds a fresh engine;
    requests [(arrival step, prompt, SamplingParams)] arrive as the steps pass. Step runs one
    step, Run to the end runs them all (the text after every step, the figure every
    REDRAW_SECONDS), Reset starts again. A request the engine refuses (more blocks than the
    whole pool, more positions than the context) is named with the engine's reason and left
    out; the others go on. An engine that cannot be made (n_blocks=0) is said in words."""
    live = LiveFigure(figsize=(10, 5.4), n_axes=1)
    live.figure.clear()
    pool_ax = live.figure.add_axes([0.05, 0.42, 0.9, 0.5])
    batch_ax = live.figure.add_axes([0.15, 0.08, 0.7, 0.24])
    state = {"engine": None, "next": 0, "refused": [], "drawn": 0.0}
    step_button = widgets.Button(description="Step")
    run_button = widgets.Button(description="Run to the end")
    reset_button = widgets.Button(description="Reset")
    queue, service, message = widgets.HTML(), widgets.HTML(), widgets.HTML()

    def write() -> None:
        engine = state["engine"]
        queue.value = as_html(queue_status(engine, state["refused"]))
        service.value = as_html(service_status(engine))

    def redraw() -> None:
        engine = state["engine"]
        draw_engine_pool(pool_ax, engine)
        draw_batch(batch_ax, engine)
        write()
        live.show()
        state["drawn"] = time.monotonic()

    def arrive() -> None:
        """Queue every request whose arrival step has come; a refused one is noted."""
        engine = state["engine"]
        while state["next"] < len(requests) and \
                requests[state["next"]][0] <= engine.step_count:
            _, prompt, sampling = requests[state["next"]]
            try:
                engine.add_request(prompt, sampling)
            except ValueError as error:
                state["refused"].append((state["next"], str(error)))
            state["next"] += 1

    def pending() -> bool:
        """Requests to serve, now or later (an idle step lets the later ones arrive)."""
        engine = state["engine"]
        return engine.has_unfinished_requests() or state["next"] < len(requests)

    def advance() -> None:
        state["engine"].step()
        arrive()

    def need_engine() -> None:
        if state["engine"] is None:
            raise ValueError("there is no engine to step: " + state["why"])

    def tell() -> None:
        """The refusals in the message line (safely clears it after a callback: put back)."""
        message.value = as_html(refusal_note(requests, state["refused"], state["next"]))

    def reset(_=None) -> None:
        state.update(engine=None, next=0, refused=[])
        try:
            state["engine"] = make_engine()
        except (ValueError, TypeError) as error:
            state["why"] = f"the engine could not be made: {error}"
            queue.value, service.value = "", ""
            with live.output:
                live.output.clear_output()
            raise ValueError(state["why"]) from None
        arrive()
        redraw()

    def step(_=None) -> None:
        need_engine()
        if pending():
            advance()
        redraw()

    def run(_=None) -> None:
        need_engine()
        steps = 0
        while pending() and steps < MAX_STEPS:
            advance()
            steps += 1
            if time.monotonic() - state["drawn"] >= REDRAW_SECONDS:
                redraw()
            else:
                write()
        redraw()

    def clicked(callback):
        checked = safely(callback, message, "Not possible:")

        def run_and_tell(*args):
            checked(*args)
            if state["engine"] is not None:
                tell()
        return run_and_tell

    step_button.on_click(clicked(step))
    run_button.on_click(clicked(run))
    reset_button.on_click(clicked(reset))
    clicked(reset)()
    box = widgets.VBox([widgets.HBox([step_button, run_button, reset_button]), message, queue,
                        service, live.output])
    box.figure, box.state, box.queue, box.service = live.figure, state, queue, service
    box.message = message
    box.controls = {"step": step_button, "run": run_button, "reset": reset_button}
    return box


ENGINE_BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "engine.json"
"""What benchmarks/engine.py measured on this project's machine (the_engine)."""


def engine_benchmark(path=None) -> dict:
    """What benchmarks/engine.py measured (the_engine): the machine and its load, four
    requests served by the engine and by kvlib.generate one after another on two models
    (every round's seconds), block against gather attention, the workload on three engines.
    The file lives in the repository (benchmarks/data/), beside the script that remakes it."""
    path = ENGINE_BENCHMARK if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not there: it is committed with the repository "
                                "(run the notebooks from a checkout), or remake it with "
                                "python benchmarks/engine.py")
    return json.loads(path.read_text(encoding="utf-8"))


def _median(values) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def benchmark_figures(data: dict) -> dict[str, str]:
    """The figures the lesson states, as it prints them: for each model the engine's and
    generate's output tokens a second and their ratio, and block attention's time over
    gather attention's at each length."""
    figures = {}
    for model, row in data["concurrent"].items():
        tokens = row["requests"] * row["new_tokens"]
        engine, alone = (tokens / _median(row[f"{who}_seconds"])
                         for who in ("engine", "generate"))
        figures[f"{model} engine"] = f"{engine:,.1f}" if engine < 100 else f"{engine:,.0f}"
        figures[f"{model} generate"] = f"{alone:,.1f}" if alone < 100 else f"{alone:,.0f}"
        figures[f"{model} ratio"] = f"{engine / alone:.1f}"
    for row in data["attention"]:
        figures[f"attention {row['positions']}"] = \
            f"{row['block_seconds'] / row['gather_seconds']:.1f}"
    return figures


def benchmark_summary(data: dict) -> str:
    """benchmark_figures in lines, with the machine and the command that remakes the file."""
    machine, load = data["machine"], data["load_average"]
    figures = benchmark_figures(data)
    lines = [f"`{data['command']}` on {machine['cpu']}, {machine['logical_cpus']} logical CPUs, "
             f"{machine['blas_threads']} BLAS thread; load average {load['before'][0]} "
             f"before, {load['after'][0]} after"]
    for model in data["concurrent"]:
        row = data["concurrent"][model]
        lines.append(f"{model}: {row['requests']} requests x {row['new_tokens']} new tokens: "
                     f"the engine {figures[model + ' engine']} output tokens a second, "
                     f"kvlib.generate one after another {figures[model + ' generate']}: "
                     f"{figures[model + ' ratio']} times")
    for row in data["attention"]:
        lines.append(f"attention of {row['sequences']} sequences over {row['positions']} "
                     f"positions: block {row['block_seconds'] * 1e6:.0f} microseconds, "
                     f"gather {row['gather_seconds'] * 1e6:.0f}: block takes "
                     f"{figures['attention ' + str(row['positions'])]} times as long")
    return "\n".join(lines)


__all__ = ["benchmark_figures", "benchmark_summary", "draw_batch", "draw_engine_pool",
           "engine_benchmark", "engine_widget"]
