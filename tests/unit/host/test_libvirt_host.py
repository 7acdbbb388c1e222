"""What the lendee's guest agent answers is not trusted: junk is a HostError, never a crash.

The lendee runs arbitrary pods; whoever owns it can make its qemu-ga answer anything.
`Libvirt.agent_command` and `Libvirt.guest_exec` turn every malformed reply (not JSON,
not an object, no ``pid``, bad base64, a non-integer exit code) into a `HostError`
that the step reports and retries, instead of an exception that stops the agent.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import libvirt_qemu
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.host.libvirt import ExecResult, HostError, Libvirt


class FakeConn:
    def lookupByName(self, name: str) -> str:
        return name

    def isAlive(self) -> bool:
        return True


def connected() -> Libvirt:
    lv = Libvirt("test:///", on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
    lv._conn = FakeConn()
    lv._connected.set()
    return lv


class Scripted(Libvirt):
    """guest-exec answers, in order: first the guest-exec reply, then each status."""

    def __init__(self, replies: list[Any]) -> None:
        super().__init__("test:///", on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
        self.replies = list(replies)

    async def agent_command(self, name: str, command: dict[str, Any], *,
                            timeout: int = 5) -> Any:
        if not self.replies:
            raise HostError("no more replies")
        return self.replies.pop(0)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def test_a_well_formed_exchange_gives_the_result() -> None:
    lv = Scripted([{"pid": 7}, {"exited": False},
                   {"exited": True, "exitcode": 3, "out-data": b64("GPU 0"), "err-data": ""}])
    assert await lv.guest_exec("lendee", "/bin/true", [], timeout=5) == ExecResult(3, "GPU 0", "")


@pytest.mark.parametrize("replies", [
    [None],
    [[1, 2]],
    ["pid"],
    [{}],
    [{"pid": "7"}],
    [{"pid": True}],
    [{"pid": 7}, None],
    [{"pid": 7}, ["exited"]],
    [{"pid": 7}, {"exited": True, "exitcode": "zero"}],
    [{"pid": 7}, {"exited": True, "exitcode": 1.5}],
    [{"pid": 7}, {"exited": True, "exitcode": 10**400}],
    [{"pid": 7}, {"exited": True, "exitcode": 0, "out-data": "%%%not base64"}],
    [{"pid": 7}, {"exited": True, "exitcode": 0, "out-data": 12}],
    [{"pid": 7}, {"exited": True, "exitcode": 0, "err-data": ["x"]}],
], ids=lambda r: repr(r)[:40])
async def test_a_hostile_reply_is_a_host_error(replies: list[Any]) -> None:
    with pytest.raises(HostError, match="guest agent"):
        await Scripted(replies).guest_exec("lendee", "/usr/bin/nvidia-smi", [], timeout=5)


@pytest.mark.parametrize("out", ["not json", "[1]", '"x"', "null", "{", '{"return": 1}x',
                                 "1e999999", "[" * 5000])
async def test_agent_command_turns_a_bad_reply_into_a_host_error(
        monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    monkeypatch.setattr(libvirt_qemu, "qemuAgentCommand", lambda *_: out)
    with pytest.raises(HostError, match="guest agent of lendee"):
        await connected().agent_command("lendee", {"execute": "guest-exec-status"})


async def test_agent_command_returns_the_return_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libvirt_qemu, "qemuAgentCommand", lambda *_: '{"return": {"pid": 3}}')
    assert await connected().agent_command("lendee", {"execute": "guest-exec"}) == {"pid": 3}


# --- fuzzed --------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
_status = st.fixed_dictionaries({}, optional={
    "exited": st.booleans() | _json, "exitcode": st.integers() | _json,
    "out-data": st.text(max_size=16) | st.just(b64("ok")) | _json,
    "err-data": st.text(max_size=16) | _json})
_start = st.fixed_dictionaries({}, optional={"pid": st.integers() | _json}) | _json


@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(start=_start, statuses=st.lists(_status | _json, min_size=1, max_size=3))
def test_fuzzed_guest_exec_replies_give_a_result_or_a_host_error(
        start: Any, statuses: list[Any]) -> None:
    async def run() -> None:
        lv = Scripted([start, *statuses])
        try:
            result = await lv.guest_exec("lendee", "/bin/x", [], timeout=0)
        except HostError:
            return
        assert isinstance(result, ExecResult)
        assert type(result.exitcode) is int
        assert isinstance(result.stdout, str) and isinstance(result.stderr, str)
    asyncio.run(run())


@settings(max_examples=400, deadline=None)
@given(reply=st.text(max_size=40) | _json.map(lambda v: json.dumps(v)))
def test_fuzzed_agent_replies_give_a_value_or_a_host_error(reply: str) -> None:
    async def run() -> None:
        import unittest.mock
        with unittest.mock.patch.object(libvirt_qemu, "qemuAgentCommand", lambda *_: reply):
            try:
                await connected().agent_command("lendee", {"execute": "guest-ping"})
            except HostError:
                pass
    asyncio.run(run())
