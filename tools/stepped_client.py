"""nbclient's NotebookClient, made robust to stalls seen on this project's machines.

After cells that display widgets, a run sometimes stood still: the kernel idle, the client
waiting for a message (three times in two runs of the run-twice test, 5 to 10 minutes each).
Each stall ended when some other message went through the kernel (a second client's request,
a debugger attaching) or, once, when nbclient's 300 s poll ran out. Two known bugs look like
it: nbclient's asyncio poll missing a message that arrives while it waits (jupyter/nbclient
issue #312), and ipykernel 7 leaving a request unread in its shell socket (ipython/ipykernel
issue #1554); the fix for the second, pull request #1529, is already in the ipykernel 7.4.0
used here, so which one it is was not pinned down. Two remedies, for either cause:

1. polling in steps of STEP_SECONDS, so that a missed message is seen at the next step;
2. after NUDGE_SECONDS with nothing on the shell channel, a kernel_info_request: it reaches the
   kernel's shell socket, and its reply and status messages come back on the client's shell
   and IOPub sockets, which is what ended every stall. nbclient ignores them (another parent).

With both, the run-twice test has not stalled since. nbval, which runs the notebooks in `make
test`, sends each cell only after the previous one is idle and has not stalled here. Used by
tools/execute_notebooks.py, tools/busy_check.py and tests/test_cells_run_twice.py.
"""

from __future__ import annotations

import time
from queue import Empty

from nbclient import NotebookClient

STEP_SECONDS = 1.0
NUDGE_SECONDS = 2.0


def poll_in_steps(channel, nudge=None) -> None:
    """Make channel.get_msg(timeout) wait in polls of at most STEP_SECONDS, with the same
    timeout; with nudge, call it after every NUDGE_SECONDS without a message."""
    get_msg = channel.get_msg

    async def get_msg_in_steps(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        quiet_since = time.monotonic()
        while True:
            left = STEP_SECONDS if deadline is None else deadline - time.monotonic()
            try:
                return await get_msg(timeout=max(0.0, min(STEP_SECONDS, left)))
            except Empty:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise
                if nudge is not None and now - quiet_since >= NUDGE_SECONDS:
                    nudge()
                    quiet_since = now

    channel.get_msg = get_msg_in_steps


class SteppedClient(NotebookClient):
    """A NotebookClient that polls in steps and nudges a kernel that went quiet (see above)."""

    async def async_start_new_kernel_client(self):
        kernel_client = await super().async_start_new_kernel_client()
        poll_in_steps(kernel_client.shell_channel, nudge=kernel_client.kernel_info)
        poll_in_steps(kernel_client.iopub_channel)
        return kernel_client
