"""A guest-agent shutdown that worked is not an error, nor a reason to press ACPI's button.

When the guest powers off at once, libvirt sees the agent's socket close before any
reply and reports "End of file from agent socket" while the domain is still running
(its stop event comes after). The shutdown was delivered: `shutdown_via_agent` returns,
as the lab's `virsh shutdown` wrapper (tests/lab/lab.py, `Lab.virsh`) reads it too.
"""

from __future__ import annotations

from typing import Any

import libvirt
import pytest

from hostagent.host.libvirt import HostError, Libvirt


class Dom:
    def __init__(self, error: str | None) -> None:
        self.error = error
        self.flags: list[int] = []

    def shutdownFlags(self, flags: int) -> int:
        self.flags.append(flags)
        if self.error is not None:
            e = libvirt.libvirtError(self.error)
            # As libvirtd fills it: (code, domain, message, level, ...).
            e.err = (libvirt.VIR_ERR_AGENT_UNRESPONSIVE, libvirt.VIR_FROM_QEMU, self.error,
                     libvirt.VIR_ERR_ERROR, None, None, None, -1, -1)
            raise e
        return 0


class Conn:
    def __init__(self, dom: Dom) -> None:
        self.dom = dom

    def lookupByName(self, name: str) -> Any:
        return self.dom

    def isAlive(self) -> bool:
        return True


def connected(dom: Dom) -> Libvirt:
    lv = Libvirt("test:///", on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
    lv._conn = Conn(dom)
    lv._connected.set()
    return lv


async def test_the_agent_socket_ending_during_shutdown_is_a_delivered_shutdown() -> None:
    dom = Dom("internal error: End of file from agent socket")
    await connected(dom).shutdown_via_agent("gaming1")
    assert dom.flags == [libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT]


async def test_an_agent_that_does_not_answer_is_still_an_error() -> None:
    dom = Dom("Guest agent is not responding: QEMU guest agent is not connected")
    with pytest.raises(HostError, match="not connected"):
        await connected(dom).shutdown_via_agent("gaming1")
