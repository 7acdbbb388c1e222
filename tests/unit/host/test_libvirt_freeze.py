"""The adapter's freeze and thaw of a guest's filesystems (`Libvirt.freeze_filesystems`,
for ``drain.stop = "power-off"``): libvirt's agent calls wait without end by default,
so the domain's agent response timeout is set first, and the loop stops waiting after
a bound of its own whatever libvirt does."""

from __future__ import annotations

import threading
from typing import Any

import libvirt
import pytest

from hostagent.host.libvirt import HostError, Libvirt


class Dom:
    """A domain whose guest agent freezes `frozen` filesystems, or blocks until `go`."""

    def __init__(self, frozen: int = 3, *, blocks: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.frozen = frozen
        self.go = threading.Event()
        if not blocks:
            self.go.set()

    def agentSetResponseTimeout(self, timeout: int, flags: int) -> int:
        self.calls.append(("timeout", timeout))
        return 0

    def fsFreeze(self, mountpoints: Any, flags: int) -> int:
        self.calls.append(("freeze", mountpoints))
        self.go.wait(30)
        return self.frozen

    def fsThaw(self, mountpoints: Any, flags: int) -> int:
        self.calls.append(("thaw", mountpoints))
        return self.frozen


class Conn:
    def __init__(self, dom: Any) -> None:
        self.dom = dom

    def lookupByName(self, name: str) -> Any:
        return self.dom

    def isAlive(self) -> bool:
        return True


def connected(conn: Any) -> Libvirt:
    lv = Libvirt("test:///", on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
    lv._conn = conn
    lv._connected.set()
    return lv


async def test_the_agents_timeout_is_set_before_the_freeze() -> None:
    dom = Dom()
    lv = connected(Conn(dom))
    assert await lv.freeze_filesystems("gpu-node", timeout=15) == 3
    assert await lv.thaw_filesystems("gpu-node", timeout=15) == 3
    assert dom.calls == [("timeout", 15), ("freeze", None), ("timeout", 15), ("thaw", None)]


async def test_a_freeze_that_never_answers_is_an_error_within_its_bound() -> None:
    dom = Dom(blocks=True)
    lv = connected(Conn(dom))
    lv.bound_slack = 0.2
    try:
        with pytest.raises(HostError, match=r"freeze the filesystems of gpu-node: no answer "
                                            r"within 1.2 s"):
            await lv.freeze_filesystems("gpu-node", timeout=1)
    finally:
        dom.go.set()  # the worker thread ends


async def test_libvirts_test_driver_freezes_without_an_agent_timeout() -> None:
    """libvirt's test driver has no virDomainAgentSetResponseTimeout: the freeze goes
    on, bounded by the adapter alone."""
    conn = libvirt.open("test:///default")
    try:
        lv = connected(conn)
        assert await lv.freeze_filesystems("test", timeout=5) == 2  # its "/" and "/boot"
        assert await lv.thaw_filesystems("test", timeout=5) == 2
    finally:
        conn.close()
