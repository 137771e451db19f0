"""Execute notebooks top to bottom, as `jupyter nbconvert --execute` does, and optionally save
them in place with their outputs and widget state (`make notebooks`; tools/binder_check.sh).

One change from nbconvert: the kernel's replies are polled in steps of a second. On this
project's machines a reply sometimes sits unread in its socket after a cell that displays
many widgets (seen with pyzmq 26 and 27, ipykernel 6 and 7): nbconvert's wait without a
timeout then never ends. nbval, which `make test` uses, is not affected.

    python tools/execute_notebooks.py [--inplace] notebooks/00_big_picture.ipynb ...

Exits non-zero, naming the notebook, on the first cell that raises or prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
from nbclient import NotebookClient

STEP_SECONDS = 1.0
CELL_TIMEOUT_SECONDS = 300


def poll_in_steps(channel) -> None:
    get_msg = channel.get_msg

    async def get_msg_in_steps(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = STEP_SECONDS if deadline is None else deadline - time.monotonic()
            try:
                return await get_msg(timeout=max(0.0, min(STEP_SECONDS, left)))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = get_msg_in_steps


class SteppedClient(NotebookClient):
    async def async_start_new_kernel_client(self):
        kernel_client = await super().async_start_new_kernel_client()
        poll_in_steps(kernel_client.shell_channel)
        poll_in_steps(kernel_client.iopub_channel)
        return kernel_client


def error_outputs(notebook) -> list[str]:
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error" or (
                    output.get("name") == "stderr" and "Traceback" in output.get("text", "")):
                found.append(output.get("ename", "a traceback on stderr"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--inplace", action="store_true",
                        help="save each executed notebook over the original")
    args = parser.parse_args()
    for path in args.notebooks:
        notebook = nbformat.read(path, as_version=4)
        started = time.monotonic()
        try:
            SteppedClient(notebook, timeout=CELL_TIMEOUT_SECONDS, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
        except Exception as error:  # CellExecutionError, CellTimeoutError, DeadKernelError
            sys.exit(f"{path.name} failed:\n{error}")
        errors = error_outputs(notebook)
        if errors:
            sys.exit(f"{path.name}: error outputs: {'; '.join(errors)}")
        if args.inplace:
            nbformat.write(notebook, path)
        print(f"   {path.name:34} {time.monotonic() - started:5.1f} s", flush=True)


if __name__ == "__main__":
    main()
