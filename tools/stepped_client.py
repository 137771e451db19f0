"""nbclient's NotebookClient, made robust to two stalls seen on this project's machines.

1. ipykernel 7 sometimes leaves a request unread in the kernel's shell socket: it writes a
   reply on that socket outside its ZMQStream, which can swallow the wake-up of a request
   arriving then (ipython/ipykernel issue #1554; pull request #1529, merged in June 2026, not
   in 7.4.0). The kernel sits idle, the client waits for a reply that never comes, until some
   other message reaches the socket. Seen three times in two runs of the run-twice test, after
   cells that display widgets: 5 to 10 minutes each, ended by another message to the kernel
   (a second client's request, a debugger attaching) or, once, after about 5 minutes. So a
   client that has heard nothing on the shell channel for NUDGE_SECONDS sends a
   kernel_info_request: its arrival wakes the kernel's socket, the stuck request is read, and
   the kernel_info reply, with another parent, is ignored by nbclient.
2. nbclient's asyncio poll of a socket can miss a message that arrives while it waits
   (jupyter/nbclient issue #312): polling in steps of STEP_SECONDS bounds that to a step.

nbval, which runs the notebooks in `make test`, waits for each reply and each idle status
before it sends the next cell, and has not stalled here. Used by tools/execute_notebooks.py,
tools/busy_check.py and tests/test_cells_run_twice.py.
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
