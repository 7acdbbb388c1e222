"""The control socket and its verbs, without a host.

The protocol is driven over a real Unix socket in a temporary directory. The verbs run
in a real `Agent` whose libvirt is a small fake (`FakeLibvirt`) that starts and stops
VMs at once and reports it the way libvirt's lifecycle events do; the machine, the
executor, persistence and the progress stream are the real ones.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import state as persisted
from hostagent.service.agent import Agent
from hostagent.surfaces.control import ControlError, ControlTimeout, Reply, request, serve_control
from hostagent.surfaces.follow import follow, format_reply
from hostagent.host.libvirt import Lifecycle
from hostagent.core.model import Observed, Phase
from tests.unit.agents import (  # noqa: F401 (a fixture)
    AGENT_XML,
    FakeLibvirt,
    collect,
    healthy,
    lent,
    make_agent,
    no_step_outlives_its_test,
)
from tests.waiting import until

log = logging.getLogger("test")


pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


# --- the protocol --------------------------------------------------------------------------


async def _serve(path: Path, **verbs: Any) -> asyncio.Server:
    return await serve_control(path, verbs, log=log)


def _exchange(path: Path, line: bytes) -> list[dict[str, Any]]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(line)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(x) for x in data.splitlines()]


async def test_progress_lines_then_one_result(tmp_path: Path) -> None:
    async def count(args: dict[str, Any]) -> AsyncIterator[Reply]:
        for i in range(args["n"]):
            yield {"event": "tick", "message": f"tick {i}"}
        yield {"ok": True, "data": {"message": "done"}}

    path = tmp_path / "control.sock"
    server = await _serve(path, count=count)
    try:
        replies = await asyncio.to_thread(
            lambda: list(request(path, "count", {"n": 2})))
        assert replies == [
            {"v": 1, "type": "progress", "event": "tick", "message": "tick 0"},
            {"v": 1, "type": "progress", "event": "tick", "message": "tick 1"},
            {"v": 1, "type": "result", "ok": True, "data": {"message": "done"}},
        ]
        # Bytes after the request are ignored; only closing the connection ends it.
        extra = await asyncio.to_thread(
            _exchange, path, b'{"v":1,"verb":"count","args":{"n":1}}\nmore\n')
        assert [r["type"] for r in extra] == ["progress", "result"]
        bad = await asyncio.to_thread(_exchange, path, b'{"v":1,"verb":"nope"}\n')
        assert bad == [{"v": 1, "type": "result", "ok": False,
                        "error": "unknown verb 'nope'; known: count"}]
        bad = await asyncio.to_thread(_exchange, path, b'{"v":2,"verb":"count"}\n')
        assert bad[0]["error"] == "bad request: unsupported protocol version 2 (this agent speaks 1)"
    finally:
        server.close()


async def test_the_socket_is_roots_alone_unless_a_group_is_given(tmp_path: Path) -> None:
    async def ok(args: dict[str, Any]) -> AsyncIterator[Reply]:
        yield {"ok": True}

    path = tmp_path / "a.sock"
    server = await serve_control(path, {"ok": ok}, log=log)
    server.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path = tmp_path / "b.sock"
    gid = os.getgid() if os.getuid() != 0 else 65534
    server = await serve_control(path, {"ok": ok}, mode=0o660, group=gid, log=log)
    server.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    assert path.stat().st_gid == gid


async def test_a_client_that_hangs_up_stops_only_its_waiting(tmp_path: Path) -> None:
    closed = asyncio.Event()

    async def forever(args: dict[str, Any]) -> AsyncIterator[Reply]:
        try:
            yield {"event": "started", "message": "waiting"}
            await asyncio.sleep(3600)
            yield {"ok": True}
        finally:
            closed.set()

    path = tmp_path / "control.sock"
    server = await _serve(path, forever=forever)

    def hang_up_after_the_first_line() -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            s.sendall(b'{"v":1,"verb":"forever"}\n')
            line: dict[str, Any] = json.loads(s.makefile("rb").readline())
            return line

    try:
        first = await asyncio.to_thread(hang_up_after_the_first_line)
        assert first["message"] == "waiting"
        await asyncio.wait_for(closed.wait(), 5)  # not at the next write, an hour away
    finally:
        server.close()


async def test_request_deadline_and_idle_ticks(tmp_path: Path) -> None:
    async def slow(args: dict[str, Any]) -> AsyncIterator[Reply]:
        yield {"event": "step", "message": "one"}
        await asyncio.sleep(3600)
        yield {"ok": True}

    path = tmp_path / "control.sock"
    server = await _serve(path, slow=slow)
    ticks: list[float] = []
    seen: list[Reply] = []

    def client() -> None:
        for reply in request(path, "slow", timeout=None, deadline=time.monotonic() + 0.6,
                             idle=0.1, on_idle=lambda: ticks.append(time.monotonic())):
            seen.append(reply)

    try:
        with pytest.raises(ControlTimeout, match="stopped waiting"):
            await asyncio.to_thread(client)
        assert [r["message"] for r in seen] == ["one"]
        assert 3 <= len(ticks) <= 8
        with pytest.raises(ControlTimeout, match="no answer from the agent within 0.2s"):
            await asyncio.to_thread(lambda: list(request(path, "slow", timeout=0.2)))
    finally:
        server.close()
    with pytest.raises(ControlError, match="is hostagent running"):
        list(request(tmp_path / "absent.sock", "status"))


# --- the verbs, in an agent with a fake libvirt ----------------------------------------------


async def test_play_persists_the_intent_then_streams_every_step_until_it_runs(
        tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    replies: list[Reply] = []
    async for reply in agent.verbs.handlers()["play"]({"vm": "gaming1"}):
        if not replies:  # persisted before the client hears anything
            saved, _ = persisted.load_state(agent.cfg.state_file)
            assert [i.owner for i in saved.intents] == ["gaming1"]
        replies.append(reply)
    *steps, result = replies
    assert result["ok"] is True
    assert result["data"]["vm"] == "gaming1"
    assert result["data"]["message"].startswith("gaming1 is running (")
    assert [(s["event"], s.get("to")) for s in steps] == [
        ("intent", "pending"), ("phase", "draining"), ("phase", "stopping"), ("phase", "off")]
    assert steps[0]["message"] == "gaming1 needs gpu-a (RTX A, 0000:0a:00.0): gpu-node (draining) gives it back first"
    assert steps[0]["intent"].startswith("play-")
    assert [s["waiting"] for s in steps] == [
        "gpu-node's node to drain", "gpu-node's node to drain",
        "gpu-node's guest agent to answer, to shut it down", "gaming1 to start"]
    elapsed = [s["elapsed_s"] for s in steps] + [result["data"]["elapsed_s"]]
    assert elapsed == sorted(elapsed)
    assert fake.calls == [("agent shutdown", "gpu-node"), ("start", "gaming1")]
    assert "gaming1" in fake.running and "gpu-node" not in fake.running
    # Progress lines read well as text too (what SSH clients and pipes get).
    assert format_reply(steps[1]) == (
        f"[{steps[1]['elapsed_s']:6.1f}s] gaming1 wants gpu-a (RTX A, 0000:0a:00.0): draining gpu-node "
        "(waiting for gpu-node's node to drain)")
    healthy(agent)


async def test_play_answers_at_once_or_names_the_owners(tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path)
    fake.running.add("gaming2")
    agent.apply(Observed(at=time.time(), lendee_running=False,
                         owners_running=frozenset({"gaming2"})))
    assert await collect(agent, "play", vm="gaming2") == [
        {"ok": True, "data": {"vm": "gaming2", "elapsed_s": 0.0,
                              "message": "gaming2 is already running"}}]
    assert await collect(agent, "play", vm="gaming9") == [{"ok": False, "error": (
        "unknown VM 'gaming9': hostagent manages gaming1, gaming2 (owners.* in test.toml)")}]
    assert await collect(agent, "release", vm="gpu-node") == [{"ok": False, "error": (
        "gpu-node is the lendee, not an owner VM: release takes one of gaming1, gaming2 "
        "(`hostagent reclaim` takes the GPUs back from gpu-node)")}]
    assert await collect(agent, "play") == [
        {"ok": False, "error": "play needs an owner VM: gaming1, gaming2"}]
    assert agent.state.intents == ()


async def test_a_client_gone_mid_play_does_not_cancel_the_intent(tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    stream = agent.verbs.handlers()["play"]({"vm": "gaming1"})
    assert isinstance(stream, AsyncGenerator)
    first = await stream.__anext__()
    assert first["to"] == "pending"
    await stream.aclose()  # what the control socket does when the client hangs up
    assert not agent.progress._followers
    await until(lambda: "gaming1" in agent.state.running_owners)
    assert agent.state.intents == ()
    healthy(agent)


async def test_play_and_hang_up_in_a_loop_adds_nothing_to_keep_or_write(
        tmp_path: Path) -> None:
    """A client that asks for gaming1 and hangs up, again and again, while its reclaim
    is under way: every request joins the pending one (one intent, one record), and the
    state file is not rewritten for any of them. The last caller still hears the end."""
    agent, fake = make_agent(tmp_path)
    fake.ignores_shutdown.add("gpu-node")  # the reclaim waits in STOPPING meanwhile
    await lent(agent, fake)
    first = [r async for r in _until_pending(agent)]
    await until(lambda: agent.state.phase is Phase.STOPPING and agent.state.shutdown_sent)
    await agent.saver.flush()
    saved = agent.cfg.state_file.stat().st_ino  # each save renames a new file in
    for _ in range(20):
        again = [r async for r in _until_pending(agent)]
        assert again[-1]["intent"] == first[-1]["intent"], again
        assert "already asked to start" in again[-1]["message"]
    assert [i.id for i in agent.state.intents] == [first[-1]["intent"]]
    await agent.saver.flush()
    assert agent.cfg.state_file.stat().st_ino == saved
    stream = agent.verbs.handlers()["play"]({"vm": "gaming1"})
    assert isinstance(stream, AsyncGenerator)
    fake.ignores_shutdown.clear()
    fake.running.discard("gpu-node")
    agent.lifecycle("gpu-node", Lifecycle.STOPPED)
    replies = [r async for r in stream]
    assert replies[-1]["ok"] and replies[-1]["data"]["intent"] == first[-1]["intent"]
    healthy(agent)


async def _until_pending(agent: Agent) -> AsyncIterator[Reply]:
    """`play gaming1` until its first line (the request pending), then hang up."""
    stream = agent.verbs.handlers()["play"]({"vm": "gaming1"})
    assert isinstance(stream, AsyncGenerator)
    try:
        reply = await stream.__anext__()
        assert reply.get("to") == "pending", reply
        yield reply
    finally:
        await stream.aclose()  # what the control socket does when the client hangs up


async def test_play_stops_waiting_with_the_reason_when_the_lendee_gets_stuck(
        tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    fake.guest_agent = False  # no clean shutdown possible, and no force_off_after
    *_, result = await collect(agent, "play", vm="gaming1")
    assert result["ok"] is False and result["pending"] is True
    assert result["error"].startswith("gpu-node needs attention: gpu-node cannot be shut down")
    assert result["error"].endswith(
        "the request stands: gaming1 starts by itself once gpu-node has stopped")
    assert [i.owner for i in agent.state.intents] == ["gaming1"]  # still pending
    fake.running.discard("gpu-node")  # a human stops it: the game starts
    agent.lifecycle("gpu-node", Lifecycle.STOPPED)
    await until(lambda: "gaming1" in fake.running)


async def test_release_through_the_guest_agent_or_acpi_then_says_when_it_lends(
        tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path, relend="60s")
    for vm in ("gaming1", "gaming2"):
        fake.running.add(vm)
    fake.no_agent_channel.add("gaming2")
    agent.apply(Observed(at=time.time(), lendee_running=False,
                         owners_running=frozenset({"gaming1", "gaming2"})))
    step, result = await collect(agent, "release", vm="gaming1")
    assert step["message"] == "shutting gaming1 down through its guest agent"
    assert step["waiting"] == "gaming1 to power off"
    assert result["ok"] is True
    assert result["data"]["message"].endswith(
        "gpu-node gets gpu-a (RTX A, 0000:0a:00.0) back in 60s (policy.relend_delay) unless an "
        "owner VM starts meanwhile")
    step, result = await collect(agent, "release", vm="gaming2")
    assert step["message"] == "shutting gaming2 down through ACPI (it has no guest agent channel)"
    assert "gpu-node gets its GPUs back in 60s (policy.relend_delay)" in result["data"]["message"]
    assert 55 < result["data"]["relend_in_s"] <= 60
    assert fake.calls == [("agent shutdown", "gaming1"), ("acpi shutdown", "gaming2")]
    assert (await collect(agent, "release", vm="gaming2"))[0]["data"]["message"].startswith(
        "gaming2 is not running; gpu-node gets its GPUs back in")
    fake.running.add("gaming1")
    agent.lifecycle("gaming1", Lifecycle.STARTED)
    fake.ignores_shutdown.add("gaming1")
    *_, result = await collect(agent, "release", vm="gaming1")
    assert result == {"ok": False, "elapsed_s": result["elapsed_s"], "error": (
        "gaming1 did not power off within 1s (timeouts.shutdown) after a shutdown through its "
        "guest agent; it keeps running: close what holds it up inside, or stop it by hand "
        "(virsh shutdown gaming1)")}
    healthy(agent)


async def test_release_of_a_vm_that_powers_off_before_its_agent_answers(
        tmp_path: Path) -> None:
    """The guest powers off before its agent's reply reaches libvirt, which reports an
    error: the VM is off all the same, so the release says so (no "domain is not running"
    from an ACPI press on a VM already off)."""
    agent, fake = make_agent(tmp_path, relend="60s")
    fake.running.add("gaming1")
    fake.agent_dies_answering.add("gaming1")
    agent.apply(Observed(at=time.time(), lendee_running=False,
                         owners_running=frozenset({"gaming1"})))
    step, result = await collect(agent, "release", vm="gaming1")
    assert step["message"] == "shutting gaming1 down through its guest agent"
    assert result["ok"] is True, result
    assert result["data"]["message"].startswith("gaming1 is off")
    assert [c for c in fake.calls if c[1] == "gaming1"] == [("agent shutdown", "gaming1")]
    healthy(agent)


async def test_reclaim_takes_the_gpus_back_and_lend_gives_them_again(tmp_path: Path) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    replies = await collect(agent, "reclaim")
    *steps, result = replies
    assert [s.get("to") for s in steps] == [None, "draining", "stopping", "off"]
    assert steps[0]["message"] == "reclaiming gpu-a (RTX A, 0000:0a:00.0), gpu-b from gpu-node (draining)"
    assert steps[1]["message"] == "hostagent reclaim wants gpu-a (RTX A, 0000:0a:00.0), gpu-b: draining gpu-node"
    assert result == {"ok": True, "data": {"elapsed_s": result["data"]["elapsed_s"], "message": (
        "gpu-node is off: gpu-a (RTX A, 0000:0a:00.0), gpu-b are free; it stays off until `hostagent lend`")}}
    # Held: once the reclaim's steps have all ended, nothing is left that could lend,
    # no relend timer armed (one would fire after relend_delay, 0.2 s).
    await until(lambda: not agent.executor.tasks, "the reclaim's steps to end")
    assert agent.state.phase is Phase.OFF and agent.state.hold
    assert agent.state.relend_at is None and agent.executor._relend is None
    assert not any(owner in fake.running for owner in ("gaming1", "gaming2"))
    assert (await collect(agent, "reclaim"))[-1]["ok"] is True  # already off: at once
    [result] = await collect(agent, "lend")
    assert result["data"]["message"].startswith("gpu-node gets its GPUs back in 0s")
    await until(lambda: agent.state.phase is Phase.LENT)
    [result] = await collect(agent, "hold")
    assert result["data"]["message"] == (
        "lending is on hold: gpu-node is not lent again until `hostagent lend`; it keeps "
        "running for now (`hostagent reclaim` takes its GPUs back)")
    assert result["data"]["lendee"]["hold"] is True
    healthy(agent)


# --- the terminal side -------------------------------------------------------------------


class Tty(io.StringIO):
    """A terminal's output, kept (`text`)."""

    tty = True

    @property
    def text(self) -> str:
        return self.getvalue()

    def isatty(self) -> bool:
        return self.tty


async def test_follow_draws_one_line_on_a_tty_plain_lines_or_json_otherwise(
        tmp_path: Path) -> None:
    # The pause between the two phases, for each follow below: long enough for a tty's
    # clock to tick (every 0.5 s), and for --timeout 0.3 to pass; plain lines and JSON
    # lines print what the agent says when it says it, and need none.
    pauses = iter([0.7, 0.0, 0.0, 0.7])

    async def play(args: dict[str, Any]) -> AsyncIterator[Reply]:
        yield {"event": "phase", "message": "draining gpu-node", "elapsed_s": 0.1,
               "waiting": "gpu-node's node to drain"}
        await asyncio.sleep(next(pauses))
        yield {"event": "phase", "message": "gpu-node is off", "elapsed_s": 0.8,
               "waiting": "gaming1 to start"}
        yield {"ok": True, "data": {"vm": args["vm"], "message": "gaming1 is running (0.9s)"}}

    path = tmp_path / "control.sock"
    server = await _serve(path, play=play)
    try:
        tty, err = Tty(), Tty()
        code = await asyncio.to_thread(follow, path, "play", {"vm": "gaming1"}, out=tty,
                                       err=err)
        assert code == 0
        frames = tty.text.split("\r\x1b[K")
        assert frames[1].startswith("[    0s] draining gpu-node - waiting for gpu-node's node")
        assert len([f for f in frames if "draining" in f]) >= 2  # the clock ticked
        assert frames[-1] == "gaming1 is running (0.9s)\n"

        plain, err = Tty(), Tty()
        plain.tty = False
        assert await asyncio.to_thread(follow, path, "play", {"vm": "gaming1"}, out=plain,
                                       err=err) == 0
        assert plain.text.splitlines() == [
            "[   0.1s] draining gpu-node (waiting for gpu-node's node to drain)",
            "[   0.8s] gpu-node is off (waiting for gaming1 to start)",
            "gaming1 is running (0.9s)"]

        lines = Tty()
        assert await asyncio.to_thread(follow, path, "play", {"vm": "gaming1"},
                                       json_lines=True, out=lines, err=err) == 0
        events = [json.loads(x) for x in lines.text.splitlines()]
        assert [e["type"] for e in events] == ["progress", "progress", "result"]

        late, err = Tty(), Tty()
        assert await asyncio.to_thread(follow, path, "play", {"vm": "gaming1"}, out=late,
                                       err=err, timeout=0.3) == 3
        assert err.text == ("hostagent: stopped waiting after 0.3s (--timeout); gaming1 still "
                            "starts by itself: follow it with `hostagent status`\n")
    finally:
        server.close()
