"""Starting a VM through the adapter: the lendee's live definition without some GPUs,
the persistent one only read, and a start a hook refused told apart from a failure.

The real libvirtd does the same in tests/lab/test_partial_start.py."""

from __future__ import annotations

from typing import Any

import libvirt
import pytest

from hostagent.core.config import Gpu
from hostagent.host.libvirt import HookRefused, HostError, Libvirt, hook_sentence

GPUS = {"gpu-a": Gpu(label="gpu-a", pci="0000:01:00.0"),
        "gpu-b": Gpu(label="gpu-b", pci="0000:02:00.0")}
HOSTDEV = """    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x0000' bus='0x{bus}' slot='0x00' function='0x0'/></source>
    </hostdev>
"""
XML = ("<domain type='kvm'>\n  <name>gpu-node</name>\n  <devices>\n"
       + HOSTDEV.format(bus="01") + HOSTDEV.format(bus="02") + "  </devices>\n</domain>\n")
# As libvirt 9.0 words a hook that exited 1 in prepare begin.
HOOK_MESSAGE = (
    "Hook script execution failed: internal error: Child process (LC_ALL=C "
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
    "/etc/libvirt/hooks/qemu gpu-node prepare begin -) unexpected exit status 1: "
    "gpu-node waits: gpu-a is in use by gaming1.\n")


class Refused(libvirt.libvirtError):  # type: ignore[misc]  # libvirt-python has no types
    def __init__(self) -> None:
        Exception.__init__(self, HOOK_MESSAGE)

    def get_error_code(self) -> int:
        return int(libvirt.VIR_ERR_HOOK_SCRIPT_FAILED)

    def get_error_message(self) -> str:
        return HOOK_MESSAGE


class FakeDomain:
    def __init__(self, conn: FakeConn) -> None:
        self.conn = conn

    def isActive(self) -> bool:
        return self.conn.active

    def XMLDesc(self, flags: int = 0) -> str:
        self.conn.calls.append(("XMLDesc", flags))
        return XML

    def create(self) -> None:
        self.conn.calls.append(("create", None))
        if self.conn.refuse:
            raise Refused()


class FakeConn:
    def __init__(self, *, active: bool = False, refuse: bool = False) -> None:
        self.active = active
        self.refuse = refuse
        self.calls: list[tuple[str, Any]] = []

    def lookupByName(self, name: str) -> FakeDomain:
        return FakeDomain(self)

    def createXML(self, xml: str, flags: int) -> None:
        self.calls.append(("createXML", (xml, flags)))
        if self.refuse:
            raise Refused()

    def isAlive(self) -> bool:
        return True


def connected(conn: FakeConn) -> Libvirt:
    lv = Libvirt("test:///", on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
    lv._conn = conn
    lv._connected.set()
    return lv


async def test_start_with_runs_the_persistent_definition_less_the_dropped_gpus() -> None:
    conn = FakeConn()
    await connected(conn).start_with("gpu-node", drop={"gpu-a"}, gpus=GPUS)
    flags = libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_SECURE
    assert conn.calls == [("XMLDesc", flags),
                          ("createXML", (XML.replace(HOSTDEV.format(bus="01"), ""), 0))]


async def test_start_with_nothing_to_drop_is_a_plain_start_and_a_running_vm_is_left() -> None:
    conn = FakeConn()
    await connected(conn).start_with("gpu-node", drop=set(), gpus=GPUS)
    assert conn.calls == [("create", None)]
    running = FakeConn(active=True)
    await connected(running).start_with("gpu-node", drop={"gpu-a"}, gpus=GPUS)
    assert running.calls == []


async def test_a_gpu_the_definition_lacks_fails_before_libvirt_is_asked() -> None:
    conn = FakeConn()
    with pytest.raises(HostError, match=r"^start gpu-node without gpu-c: gpu-node's XML holds "
                       r"no device of GPU gpu-c"):
        await connected(conn).start_with(
            "gpu-node", drop={"gpu-c"}, gpus={**GPUS, "gpu-c": Gpu(label="gpu-c", pci="03:00.0")})
    assert [c for c, _ in conn.calls] == ["XMLDesc"]


@pytest.mark.parametrize("drop", [set(), {"gpu-a"}])
async def test_a_start_a_hook_refused_is_hook_refused_with_its_sentence(drop: set[str]) -> None:
    with pytest.raises(HookRefused) as e:
        await connected(FakeConn(refuse=True)).start_with("gpu-node", drop=drop, gpus=GPUS)
    assert e.value.sentence == "gpu-node waits: gpu-a is in use by gaming1."
    assert str(e.value).endswith("refused by the hook: gpu-node waits: gpu-a is in use by "
                                 "gaming1.")
    assert isinstance(e.value, HostError)  # callers that only know HostError still cope


def test_hook_sentence_is_what_the_hook_wrote() -> None:
    assert hook_sentence(HOOK_MESSAGE) == "gpu-node waits: gpu-a is in use by gaming1."
    assert hook_sentence("unexpected exit status 2: two\nlines\n") == "two\nlines"
    assert hook_sentence("something else entirely") == "something else entirely"
