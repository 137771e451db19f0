"""tools/stepped_client.py: a kernel that went quiet is nudged and the reply then arrives, and a
wait in steps keeps the caller's timeout."""

import asyncio
import time
from pathlib import Path
from queue import Empty

import pytest
import stepped_client

ROOT = Path(__file__).resolve().parent.parent


class StuckChannel:
    """A shell channel whose reply comes only after the kernel has been nudged (a stall)."""

    def __init__(self):
        self.nudged = 0
        self.polls = []

    async def get_msg(self, timeout=None):
        self.polls.append(timeout)
        if self.nudged:
            return {"parent_header": {"msg_id": "cell"}}
        await asyncio.sleep(timeout)
        raise Empty

    def nudge(self):
        self.nudged += 1


@pytest.fixture
def short_steps(monkeypatch):
    monkeypatch.setattr(stepped_client, "STEP_SECONDS", 0.01)
    monkeypatch.setattr(stepped_client, "NUDGE_SECONDS", 0.05)


def test_a_quiet_kernel_is_nudged_and_the_reply_then_arrives(short_steps):
    channel = StuckChannel()
    stepped_client.poll_in_steps(channel, nudge=channel.nudge)
    reply = asyncio.run(channel.get_msg(timeout=5))
    assert reply["parent_header"]["msg_id"] == "cell" and channel.nudged == 1
    assert all(timeout <= 0.01 for timeout in channel.polls)


def test_without_a_nudge_the_timeout_still_ends_the_wait(short_steps):
    channel = StuckChannel()
    stepped_client.poll_in_steps(channel)
    started = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(channel.get_msg(timeout=0.2))
    assert 0.2 <= time.monotonic() - started < 2 and channel.nudged == 0
