"""What systemd hears from the agent, on a real NOTIFY_SOCKET.

The test binds the AF_UNIX datagram socket systemd would pass in NOTIFY_SOCKET, and a
thread timestamps every datagram as it arrives, as the service manager would: the
watchdog is judged from the receiving side, so a blocked loop shows as a gap.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hostagent.host import journal
from hostagent.service.agent import Agent
from hostagent.core.config import parse
from tests.lab.lab import Lab
from tests.waiting import until, wait_until

CONFIG = """\
[lendee]
domain = "gpu-node"
gpus = ["0000:01:00.0"]
"""


@dataclass
class Listener:
    """The service manager's end of NOTIFY_SOCKET: (arrival time, datagram) pairs."""

    sock: socket.socket
    received: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def messages(self) -> list[str]:
        with self.lock:
            return [m for _, m in self.received]

    def pings(self) -> list[float]:
        with self.lock:
            return [t for t, m in self.received if m == "WATCHDOG=1"]

    def wait_for(self, predicate: str) -> list[str]:
        """Every message so far, once one contains `predicate`."""
        wait_until(lambda: any(predicate in m for m in self.messages()),
                   f"a message with {predicate!r}", every=0.05)
        return self.messages()


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[Listener]:
    # Not tmp_path: a unix socket path must stay below 108 bytes. Under /tmp, which
    # the lab's mount namespace shares, so an agent inside the lab reaches it too.
    with (
        tempfile.TemporaryDirectory(prefix="hostagent-notify-") as directory,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock,
    ):
        path = Path(directory) / "notify"
        sock.bind(str(path))
        sock.settimeout(0.02)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        found = Listener(sock)
        stop = threading.Event()

        def receive() -> None:
            while not stop.is_set():
                try:
                    data = sock.recv(4096)
                except TimeoutError:
                    continue
                with found.lock:
                    found.received.append((time.monotonic(), data.decode()))

        thread = threading.Thread(target=receive, name="notify-listener", daemon=True)
        thread.start()
        try:
            yield found
        finally:
            stop.set()
            thread.join(5)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


async def test_watchdog_pings_come_from_the_event_loop_and_stop_while_it_is_blocked(
    listener: Listener,
) -> None:
    # As under WatchdogSec=200ms: the agent pings at half the interval, as Agent.run does.
    interval = journal.watchdog_interval(environ={"WATCHDOG_USEC": "200000"})
    assert interval == 0.2
    agent = Agent(parse(CONFIG))  # no libvirt connection is made until run()
    watchdog = asyncio.create_task(agent._watchdog(interval / 2))
    try:
        await until(lambda: len(listener.pings()) >= 3, "three pings")
        blocked_at = time.monotonic()
        # A libvirt call made on the loop thread by mistake, or any other hang.
        time.sleep(0.6)  # noqa: ASYNC251 -- blocking the loop is the point
        unblocked_at = time.monotonic()
        await until(lambda: len([t for t in listener.pings() if t >= unblocked_at]) >= 3,
                    "three pings after the block")
    finally:
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)

    pings = listener.pings()
    assert set(listener.messages()) == {"WATCHDOG=1"}
    before = [t for t in pings if t < blocked_at]
    during = [t for t in pings if blocked_at + 0.05 < t < unblocked_at]
    after = [t for t in pings if t >= unblocked_at]
    assert len(before) >= 3 and len(after) >= 3, pings
    assert during == [], "pings arrived while the loop was blocked"
    # What systemd would conclude: silent across the block for longer than WatchdogSec
    # (it would have killed us there), and there longest: elsewhere the loop pings on
    # its own schedule, however late a busy machine lets it run.
    across = before[-1], after[0]
    longest = max(zip(pings, pings[1:], strict=False), key=lambda g: g[1] - g[0])
    assert longest == across and across[1] - across[0] >= 0.6 - 0.05, gaps(pings)


def test_notify_lines_reach_a_real_socket(listener: Listener) -> None:
    assert journal.notify("gpu-node off", ready=True)
    assert journal.notify("gpu-node booting; waiting: gaming1")
    assert journal.notify(watchdog=True)
    listener.wait_for("WATCHDOG=1")
    assert listener.messages() == [
        "READY=1\nSTATUS=gpu-node off",
        "STATUS=gpu-node booting; waiting: gaming1",
        "WATCHDOG=1",
    ]


@pytest.mark.lab
def test_hostagent_run_tells_systemd_ready_status_and_pings(
    lab: Lab, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hostagent run`, as the unit starts it, with the two variables systemd sets."""
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # WatchdogSec=1s: a ping every 0.5 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)  # nsenter runs it under another pid
    lab.start_agent()  # returns once the agent has journaled that it is ready
    messages = listener.wait_for("READY=1")
    ready = next(m for m in messages if "READY=1" in m)
    # Ready only with a status: what `systemctl status hostagent` shows first.
    assert ready.startswith("READY=1\nSTATUS=gpu-node "), ready
    # All VMs are off, so the agent starts lending: the status follows the lendee.
    listener.wait_for("STATUS=gpu-node booting")
    wait_until(lambda: len(listener.pings()) >= 3, "three watchdog pings")
    pings = listener.pings()
    assert max(gaps(pings)) < 1.0, gaps(pings)
    assert lab.stop_agent(signal.SIGTERM) == 0
