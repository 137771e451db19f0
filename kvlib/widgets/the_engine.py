"""The engine lesson's pictures, step by step (its workload is kvlib.serving.workloads).

- draw_engine_pool: every block of the pool, free, cached and idle, held, or shared
  (kvlib.plots.draw_pool);
- draw_batch: what one step computed for each request (a prefill chunk or a decode), and who
  was preempted;
- engine_widget: Step / Run to the end / Reset on an engine, redrawing both, the queue and the
  running service numbers.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from kvlib.plots import draw_pool
from kvlib.serving.engine import Engine, summarize
from kvlib.serving.workloads import add_arrivals

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


def queue_status(engine: Engine) -> str:
    waiting = ", ".join(str(r.request_id) for r in engine.waiting) or "empty"
    running = ", ".join(str(r.request_id) for r in engine.running) or "none"
    finished = sum(r.status == "finished" for r in engine.requests.values())
    stats = engine.stats
    preemptions = plural(stats["preemptions"], "preemption")
    return (f"running: {running}; waiting: {waiting}; finished: {finished} of "
            f"{len(engine.requests)}. Since the start: {preemptions}, "
            f"{stats['prefix_hit_tokens']} of {stats['prompt_tokens']} prompt tokens from the "
            "prefix cache.")


def service_status(engine: Engine) -> str:
    done = [i for i, r in engine.requests.items() if r.status == "finished"]
    if not done:
        return "No request has finished yet."
    numbers = summarize(engine, done)
    return (f"Over the {plural(len(done), 'finished request')}: time to first token "
            f"{numbers['ttft_steps']:.1f} steps ({numbers['ttft_seconds'] * 1000:.0f} ms here), "
            f"time per output token {numbers['tpot_steps']:.2f} steps "
            f"({numbers['tpot_seconds'] * 1000:.0f} ms), {numbers['tokens_per_step']:.2f} "
            f"tokens a step ({numbers['tokens_per_second']:.1f} a second), medians.")


def engine_widget(make_engine, requests):
    """Step an engine through a workload (the_engine): make_engine() builds a fresh engine;
    requests [(arrival step, prompt, SamplingParams)] arrive as the steps pass. Step runs one
    step, Run to the end runs them all, Reset starts again."""
    live = LiveFigure(figsize=(10, 5.4), n_axes=1)
    live.figure.clear()
    pool_ax = live.figure.add_axes([0.05, 0.42, 0.9, 0.5])
    batch_ax = live.figure.add_axes([0.15, 0.08, 0.7, 0.24])
    state = {}
    step_button = widgets.Button(description="Step")
    run_button = widgets.Button(description="Run to the end")
    reset_button = widgets.Button(description="Reset")
    queue, service, message = widgets.HTML(), widgets.HTML(), widgets.HTML()

    def redraw() -> None:
        engine = state["engine"]
        draw_engine_pool(pool_ax, engine)
        draw_batch(batch_ax, engine)
        queue.value = as_html(queue_status(engine))
        service.value = as_html(service_status(engine))
        live.show()

    def advance() -> None:
        engine = state["engine"]
        engine.step()
        add_arrivals(engine, requests, state["ids"])

    def reset(_=None) -> None:
        state["engine"], state["ids"] = make_engine(), []
        add_arrivals(state["engine"], requests, state["ids"])
        redraw()

    def step(_=None) -> None:
        if state["engine"].has_unfinished_requests():
            advance()
        redraw()

    def run(_=None) -> None:
        while state["engine"].has_unfinished_requests():
            advance()
        redraw()

    step_button.on_click(safely(step, message))
    run_button.on_click(safely(run, message))
    reset_button.on_click(safely(reset, message))
    reset()
    box = widgets.VBox([widgets.HBox([step_button, run_button, reset_button]), message, queue,
                        service, live.output])
    box.figure, box.state, box.queue, box.service = live.figure, state, queue, service
    box.controls = {"step": step_button, "run": run_button, "reset": reset_button}
    return box


__all__ = ["draw_batch", "draw_engine_pool", "engine_widget"]
