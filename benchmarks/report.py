"""What the benchmarks in this folder share: the BLAS thread count, set before numpy loads,
the machine they describe, their tables, and a step timed with its caches put back. Each
script imports it as `report` (a script's own folder is first on sys.path). Nothing here
imports numpy at module level."""

from __future__ import annotations

import os
import platform
import time

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def use_threads(threads: int) -> None:
    """Must run before numpy is imported: OpenBLAS reads these once, when it loads."""
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(threads)


def add_model_shape_options(parser) -> None:
    """--layers, --d-model, --heads, --vocab and --d-ff of the model to build, GPT-2 small's
    by default (12, 768, 12, 50257, and 4 d_model)."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--d-ff", type=int, default=None, help="MLP width (default 4 d_model)")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_lines() -> str:
    """Two lines: the CPU, Python and numpy; the BLAS and the threads it really uses."""
    import numpy as np

    from kvlib import roofline

    threads = roofline.blas_threads()
    settings = ", ".join(f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARIABLES)
    return (f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} "
            f"{platform.machine()}; Python {platform.python_version()}, numpy {np.__version__}\n"
            f"BLAS: {roofline.blas_name()}; threads in effect: "
            f"{threads if threads is not None else 'unknown (not OpenBLAS)'} ({settings})")


def machine() -> dict:
    """The machine as the committed JSON files record it: CPU, system, Python, numpy, BLAS."""
    import numpy as np

    from kvlib import roofline

    return {"cpu": cpu_name(), "logical_cpus": os.cpu_count(),
            "system": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version(), "numpy": np.__version__,
            "blas": roofline.blas_name(), "blas_threads": roofline.blas_threads()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def table(headers, rows) -> str:
    """A plain-text table whose columns fit their contents (also valid Markdown)."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(str(c).rjust(w) for c, w in zip(row, widths)) + " |"
             for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def run_once(step, params, tokens, caches) -> float:
    """Seconds of one step(params, tokens, caches); every cache put back afterwards, so that
    each repeat and each batch size starts from the same caches."""
    saved = [cache.checkpoint() for cache in caches]
    started = time.perf_counter()
    step(params, tokens, caches)
    seconds = time.perf_counter() - started
    for cache, state in zip(caches, saved):
        cache.restore(state)
    return seconds
