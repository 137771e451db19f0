"""nbclient's NotebookClient, with the kernel's replies polled in steps of a second.

On this project's machines a reply sometimes sits unread in its socket after a cell that
displays widgets (pyzmq 26 and 27, ipykernel 6 and 7; jupyter/nbclient issue #312): the
asyncio poll is not woken when the message arrives, only when its timeout ends. nbconvert's
wait without a timeout then never ends, and a wait with the cell timeout of 300 s stalls for
all of it before the reply is read (the run-twice test lost 5 minutes to each stall). Polling
in steps of a second bounds a stall to a second. nbval, which runs the notebooks in
`make test`, uses blocking sockets and is not affected.

Used by tools/execute_notebooks.py, tools/busy_check.py and tests/test_cells_run_twice.py.
"""

from __future__ import annotations

import time
from queue import Empty

from nbclient import NotebookClient

STEP_SECONDS = 1.0


def poll_in_steps(channel) -> None:
    """Make channel.get_msg(timeout) wait in polls of at most STEP_SECONDS, same timeout."""
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
    """A NotebookClient whose shell and IOPub replies are polled in steps (see above)."""

    async def async_start_new_kernel_client(self):
        kernel_client = await super().async_start_new_kernel_client()
        poll_in_steps(kernel_client.shell_channel)
        poll_in_steps(kernel_client.iopub_channel)
        return kernel_client
