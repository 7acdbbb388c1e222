"""Connection floods on the SSH and metrics ports leave the hook and control sockets alone.

A separate process opens hundreds of TCP connections to each port and holds them, the
way a scanner or a brute-force run does. Both servers share the agent's process, and so
its descriptors, with the hook socket: they must close what is over their caps at once,
so the agent's descriptor count stays bounded, the hook and control sockets go on
answering, and the journal gets a handful of records, not two per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from hostagent.host import journal
from hostagent.surfaces import metrics, ssh
from hostagent.surfaces.control import Reply, request, serve_control
from hostagent.core.health import Health
from hostagent.surfaces.inbox import HookEvent, Verdict, serve_hooks
from hostagent.core.model import Topology
from tests.waiting import until

log = logging.getLogger("test.floods")
FLOOD = 400  # connections per port: far over any cap, well under the process limit

FLOODER = r"""
import socket, sys, time
host, ports, n = sys.argv[1], [int(p) for p in sys.argv[2:-1]], int(sys.argv[-1])
held = []
for port in ports:
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((host, port))
        except BlockingIOError:
            pass
        held.append(s)
print("flooding", flush=True)
time.sleep(120)
"""


pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def hook_round_trip(path: Path, event_id: str) -> dict[str, Any]:
    line = json.dumps({"v": 1, "kind": "hook", "id": event_id, "time": time.time(),
                       "domain": "gaming1", "op": "prepare", "sub": "begin", "extra": "-",
                       "xml": ""}).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(str(path))
        s.sendall(line)
        answer: dict[str, Any] = json.loads(s.makefile("rb").readline())
    return answer


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    async def proceed(event: HookEvent) -> Verdict:
        return Verdict("proceed")

    async def status(args: dict[str, Any]) -> AsyncIterator[Reply]:
        yield {"ok": True, "data": {"fine": True}}

    key = asyncssh.generate_private_key("ssh-ed25519")
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="status" {key.export_public_key().decode().strip()}\n')
    keys.chmod(0o600)
    hooks = await serve_hooks(tmp_path / "hook.sock", proceed, log=log)
    control = await serve_control(tmp_path / "control.sock", {"status": status}, log=log)
    endpoint = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys,
                               {"status": status})
    topo = Topology(lendee="gpu-node", lendee_gpus=frozenset({"gpu-a"}), owners={})
    exporter = await metrics.serve(("127.0.0.1", 0), metrics.Metrics(topo), Health(), log=log)
    try:
        yield {"dir": tmp_path, "ssh": endpoint.get_port(),
               "metrics": exporter.sockets[0].getsockname()[1]}
    finally:
        for server in (hooks, control, exporter):
            server.close()
        endpoint.close()
        await endpoint.wait_closed()


async def test_a_flood_on_the_ssh_and_metrics_ports_leaves_the_sockets_answering(
        servers: dict[str, Any], sink: journal.ListSink) -> None:
    # Before: every connection held a descriptor for the 30 s login timeout (SSH) or
    # the 10 s request timeout (metrics), with no cap, and wrote two journal records;
    # a flood exhausted the descriptors the hook socket and the state file need.
    before = descriptors()
    flooder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOODER, "127.0.0.1", str(servers["ssh"]),
        str(servers["metrics"]), str(FLOOD), stdout=asyncio.subprocess.PIPE)
    try:
        assert flooder.stdout is not None
        assert await asyncio.wait_for(flooder.stdout.readline(), 30) == b"flooding\n"
        peak = before
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the flood's 3 s: the servers accept all they will
            peak = max(peak, descriptors())
            await asyncio.sleep(0.05)
        answer = await asyncio.to_thread(hook_round_trip, servers["dir"] / "hook.sock", "e1")
        assert answer["verdict"] == "proceed"
        replies = await asyncio.to_thread(
            lambda: list(request(servers["dir"] / "control.sock", "status", timeout=2)))
        assert replies[-1]["ok"] is True
        peak = max(peak, descriptors())
    finally:
        flooder.kill()
        await flooder.wait()
    # The flood gone, every descriptor it took is given back (a connection left to the
    # end of the event loop was never closed, a leak a long flood would add to).
    await until(lambda: descriptors() <= before, "every descriptor the flood took given back")
    # What each server holds at worst (the connections it keeps, and one batch of
    # accepts not yet looked at), plus slack for the test's own sockets: whatever the
    # size of the flood.
    bound = (ssh.MAX_UNAUTHENTICATED + 2 * ssh.ACCEPT_BACKLOG
             + metrics.MAX_PER_SOURCE + 2 * metrics.ACCEPT_BACKLOG + 8)
    print(f"flood: {peak - before} descriptors at the peak, bound {bound}")
    assert peak - before <= bound, f"{peak - before} descriptors for the flood, bound {bound}"
    ssh_records = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "ssh"
                   and e.fields.get("HOSTAGENT_RESULT") != "listening"
                   and e.fields.get("HOSTAGENT_RESULT") != "created"]
    assert len(ssh_records) <= ssh.PREAUTH_BURST + 2, len(ssh_records)


async def test_an_unauthenticated_connection_is_dropped_after_the_login_timeout(
        tmp_path: Path) -> None:
    async def status(args: dict[str, Any]) -> AsyncIterator[Reply]:
        yield {"ok": True}

    keys = tmp_path / "authorized_keys"
    keys.write_text("")
    keys.chmod(0o600)
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, {"status": status},
                             login_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.get_port())
        started = time.monotonic()
        while await asyncio.wait_for(reader.read(4096), 5):
            pass  # the server's version line, then nothing: it closes on us
        assert time.monotonic() - started < 3
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert ssh.LOGIN_TIMEOUT <= 5  # a few seconds: a button needs well under one


# --- SSH: what a stranger and what a listed key can hold ---------------------------------

BUTTON = asyncssh.generate_private_key("ssh-ed25519", comment="button")
ADMIN = asyncssh.generate_private_key("ssh-ed25519", comment="admin")


class Blocking:
    """Verbs for the SSH tests: `status` answers at once, `play` waits to be let go."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.go = asyncio.Event()
        self.playing: asyncio.Queue[str] = asyncio.Queue()

    def table(self) -> dict[str, Any]:
        async def status(args: dict[str, Any]) -> AsyncIterator[Reply]:
            self.calls.append("status")
            yield {"ok": True, "data": {"message": "fine"}}

        async def play(args: dict[str, Any]) -> AsyncIterator[Reply]:
            self.calls.append("play")
            self.playing.put_nowait(args["vm"])
            await self.go.wait()
            yield {"ok": True, "data": {"message": f"{args['vm']} is running"}}

        return {"status": status, "play": play}


@contextlib.asynccontextmanager
async def ssh_endpoint(tmp_path: Path, verbs: Blocking, **limits: Any) -> AsyncIterator[int]:
    keys = tmp_path / "authorized_keys"
    keys.write_text("".join(f'verbs="*",vms="*" {k.export_public_key().decode().strip()}\n'
                            for k in (BUTTON, ADMIN)))
    keys.chmod(0o600)
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, verbs.table(),
                             **limits)
    try:
        yield server.get_port()
    finally:
        server.close()
        await server.wait_closed()


def client(port: int, key: asyncssh.SSHKey, tmp_path: Path, local: str = "127.0.0.1") -> Any:
    host_key = asyncssh.read_private_key(tmp_path / "host_key")
    known = asyncssh.import_known_hosts(
        f"[127.0.0.1]:{port} {host_key.export_public_key().decode()}")
    return asyncssh.connect("127.0.0.1", port, username="hostagent", client_keys=[key],
                            known_hosts=known, agent_path=None, config=None,
                            password_auth=False, kbdint_auth=False, local_addr=(local, 0))


def ssh_results(sink: journal.ListSink) -> list[str]:
    return [e.fields["HOSTAGENT_RESULT"] for e in sink.entries
            if e.fields.get("HOSTAGENT_EVENT") == "ssh"]


async def test_one_connection_runs_one_command_however_many_sessions_it_opens(
        tmp_path: Path, sink: journal.ListSink) -> None:
    # Before: each channel ran its command, and each status a health check (a hook
    # socket connection, a libvirt call, a Kubernetes request): 4,500 channels on one
    # connection of a status-only key exhausted the descriptors and hooks spooled.
    verbs = Blocking()
    async with ssh_endpoint(tmp_path, verbs) as port:
        async with client(port, BUTTON, tmp_path) as conn:
            first = await conn.create_process("play gaming1")
            await asyncio.wait_for(verbs.playing.get(), 10)
            more = await asyncio.gather(*(conn.run("status") for _ in range(500)),
                                        return_exceptions=True)
            await asyncio.wait_for(conn.wait_closed(), 10)  # refused too often: closed
        assert all(isinstance(s, asyncssh.ChannelOpenError) for s in more), {
            type(s) for s in more}
        assert "hostagent runs one command per connection: connect again for another" in {
            s.reason for s in more if isinstance(s, asyncssh.ChannelOpenError)}
        assert (await first.wait()).exit_status is None  # hung up on, as the client was
        assert verbs.calls == ["play"]
        # A connection of its own runs the next command.
        async with client(port, BUTTON, tmp_path) as conn:
            assert (await conn.run("status")).exit_status == 0
    results = ssh_results(sink)
    assert results.count("refused") == ssh.MAX_REFUSALS, results
    assert results.count("disconnected") == 1


async def test_commands_running_over_ssh_are_bounded_for_every_key_together(
        tmp_path: Path, sink: journal.ListSink) -> None:
    verbs = Blocking()
    async with ssh_endpoint(tmp_path, verbs, max_running=2) as port:
        async with client(port, BUTTON, tmp_path) as a, client(port, ADMIN, tmp_path) as b, \
                client(port, ADMIN, tmp_path) as c:
            first = await a.create_process("play gaming1")
            second = await b.create_process("play gaming2")
            for _ in range(2):
                await asyncio.wait_for(verbs.playing.get(), 10)
            third = await asyncio.wait_for(c.run("status"), 10)
            assert third.exit_status == 75
            assert third.stderr == ("hostagent: busy: 2 commands are running over SSH "
                                    "already (the limit); try again shortly\n")
            verbs.go.set()
            assert (await first.wait()).exit_status == 0
            assert (await second.wait()).exit_status == 0
        async with client(port, ADMIN, tmp_path) as d:
            assert (await d.run("status")).exit_status == 0  # room again
    assert verbs.calls == ["play", "play", "status"]
    assert "busy" in ssh_results(sink)


async def test_one_key_holds_a_few_connections_and_an_idle_one_is_closed(
        tmp_path: Path, sink: journal.ListSink) -> None:
    verbs = Blocking()
    async with ssh_endpoint(tmp_path, verbs, max_per_key=2, idle_timeout=0.5) as port:
        async with client(port, BUTTON, tmp_path) as a, client(port, BUTTON, tmp_path) as b:
            async with client(port, BUTTON, tmp_path) as c:
                with pytest.raises((asyncssh.DisconnectError, asyncssh.ChannelOpenError)):
                    await c.run("status")
            async with client(port, ADMIN, tmp_path) as other:  # another key: its own count
                assert (await other.run("status")).exit_status == 0
            # Neither runs a command: both are closed, and the key may connect again.
            await asyncio.wait_for(asyncio.gather(a.wait_closed(), b.wait_closed()), 10)
        async with client(port, BUTTON, tmp_path) as again:
            assert (await again.run("status")).exit_status == 0
    assert verbs.calls == ["status", "status"]
    closing = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "disconnected"]
    assert closing[0].endswith(": this key already holds 2 connections (the limit)")
    assert sum(m.endswith(": no command for 0.5s") for m in closing) == 2  # a and b


async def test_strangers_are_counted_per_prefix_and_the_oldest_waiting_makes_room(
        tmp_path: Path) -> None:
    # Before: counted per address (one host has a whole /64), and over the limit the
    # newest was refused: whoever held the slots without authenticating locked a
    # button out until the login timeout, again and again.
    verbs = Blocking()

    async def silent(local: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"SSH-2.0-hostagent")
        return reader, writer

    async def closed(reader: asyncio.StreamReader) -> bool:
        try:
            await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:
            pass
        return True

    # A login timeout that no wait here reaches: each connection closed is one closed
    # to make room (at 5 s, each wait was met by the timeout, whoever was closed).
    async with ssh_endpoint(tmp_path, verbs, max_per_prefix=3, max_unauthenticated=5,
                            login_timeout=120) as port:
        held = [await silent(f"127.0.0.{1 + i % 2}") for i in range(3)]  # one /24
        # One more there: the oldest of the address that holds the most makes room (a
        # tie, .1 two and .2 one and the newcomer: the newcomer's own).
        held.append(await silent("127.0.0.2"))
        assert await closed(held[1][0])
        held += [await silent("127.0.1.1") for _ in range(2)]  # another /24: 5 waiting
        # The sixth: the network that holds the most goes first (a tie, three each with
        # the newcomer: the newcomer's own), its oldest.
        held.append(await silent("127.0.1.1"))
        assert await closed(held[4][0])
        # Its /24 full of silent connections, the button still gets in: the oldest of
        # the address that holds the most there (the button's own) makes room.
        async with client(port, BUTTON, tmp_path, local="127.0.0.1") as conn:
            assert (await conn.run("status")).exit_status == 0
        assert await closed(held[0][0])
        for _, writer in held:
            writer.close()
    assert verbs.calls == ["status"]


def test_prefixes() -> None:
    assert ssh.prefix("192.0.2.17") == "192.0.2.0/24"
    assert ssh.prefix("::ffff:192.0.2.17") == "192.0.2.0/24"
    assert ssh.prefix("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert ssh.prefix("?") == "?"


async def holding(port: int, source: str, first: bytes, stop: asyncio.Event,
                  connected: list[str] | None = None) -> None:
    """A client from `source` that sends `first` and then nothing, holding its slot until
    it is closed, and connects again at once, until `stop`; each connection made is
    noted in `connected`."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.01)
            continue
        if connected is not None:
            connected.append(source)
        try:
            writer.write(first)
            await reader.read()  # until it is closed
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def presses(port: int, tmp_path: Path, attackers: list[Any], *, settle: float,
                  n: int) -> list[object]:
    """The button pressed `n` times (`status` from 127.0.0.1) while `attackers` run, after
    `settle` seconds of them: each press's exit status, or what stopped it."""
    tasks = [asyncio.get_running_loop().create_task(a) for a in attackers]
    results: list[object] = []
    try:
        await asyncio.sleep(settle)
        for _ in range(n):
            try:
                async with client(port, BUTTON, tmp_path, local="127.0.0.1") as conn:
                    results.append((await conn.run("status")).exit_status)
            except (OSError, asyncssh.Error) as e:
                results.append(repr(e))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results


async def test_strangers_that_reconnect_at_once_never_evict_a_key_holder(
        tmp_path: Path) -> None:
    """Five connections from the button's /24 that never authenticate and come back the
    moment they are closed: each newcomer made the oldest waiting one of that /24 make
    room, and the button, waiting too until its signature was checked, was the one
    closed. A connection that has offered a listed key is no longer a stranger's slot:
    only those that have not are closed to make room, and the button gets in each time."""
    verbs = Blocking()
    stop = asyncio.Event()
    greeting = b"SSH-2.0-OpenSSH_9.2\r\n"  # then nothing: a slot held

    async with ssh_endpoint(tmp_path, verbs, max_per_prefix=4, max_unauthenticated=16) as port:
        results = await presses(port, tmp_path, [holding(port, "127.0.0.3", greeting, stop)
                                                 for _ in range(5)], settle=0.5, n=5)
    assert results == [0] * 5


async def test_a_slowloris_from_a_handful_of_addresses_never_keeps_a_scrape_out(
        tmp_path: Path) -> None:
    """Four addresses each holding their share of connections that send a request line
    and never finish their headers, reconnecting the moment one is closed, filled every
    slot: a scrape was refused. A connection still sending its request now makes room,
    the oldest of whoever holds the most, and every scrape is answered."""
    topo = Topology(lendee="gpu-node", lendee_gpus=frozenset({"gpu-a"}), owners={})
    exporter = await metrics.serve(("127.0.0.1", 0), metrics.Metrics(topo), Health(), log=log)
    port = exporter.sockets[0].getsockname()[1]
    stop = asyncio.Event()

    async def scrape() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    sources = [f"127.0.0.{n}" for n in range(2, 6) for _ in range(metrics.MAX_PER_SOURCE)]
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # never the blank line
    connected: list[str] = []
    attackers = [asyncio.get_running_loop().create_task(
        holding(port, s, request, stop, connected)) for s in sources]
    try:
        # All of them connected (those past the listen queue, 8, get in when TCP sends their
        # SYN again, a second later).
        await until(lambda: len(connected) >= len(sources), "every attacker connected",
                    timeout=30)
        answers = []
        for _ in range(5):
            try:
                answers.append((await scrape()).split(b"\r\n", 1)[0])
            except OSError as e:
                answers.append(repr(e).encode())
    finally:
        stop.set()
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
        exporter.close()
    assert answers == [b"HTTP/1.1 200 OK"] * 5


@pytest.mark.parametrize("strangers,addresses", [(5, 5), (50, 50)])
async def test_strangers_from_many_addresses_of_its_24_never_evict_a_key_holder(
        tmp_path: Path, strangers: int, addresses: int) -> None:
    """The same from many addresses of the button's /24, one connection each: each
    address held no more than the others, so each newcomer closed the oldest waiting,
    whose address came back at once and closed the next; the button, the oldest within
    milliseconds, was closed before it could offer its key (6 of 10 presses with five
    addresses, 10 of 10 with fifty). Now an address may close only a few connections
    for its own before it must wait, and those it closes come first from addresses no
    key holder authenticated from, then from those that had spent their budget."""
    verbs = Blocking()
    stop = asyncio.Event()

    async with ssh_endpoint(tmp_path, verbs) as port:
        async with client(port, BUTTON, tmp_path, local="127.0.0.1") as conn:  # pressed before
            assert (await conn.run("status")).exit_status == 0
        greeting = b"SSH-2.0-OpenSSH_9.2\r\n"
        results = await presses(port, tmp_path, [
            holding(port, f"127.0.0.{10 + i % addresses}", greeting, stop)
            for i in range(strangers)], settle=1, n=10)
    assert results == [0] * 10, results


async def test_idle_offers_of_a_listed_key_never_lock_a_key_holder_out(tmp_path: Path) -> None:
    """A listed public key is no secret: forty connections that offer it and never sign
    (each back the moment it is closed) held every slot, none of them a stranger's any
    more, and every newcomer was refused, the button's too. A connection that offered
    a listed key is closed for a newcomer after every stranger, and after those from an
    address a key holder has authenticated from."""
    verbs = Blocking()
    stop = asyncio.Event()
    pair = asyncssh.load_keypairs([ADMIN])[0]
    pair.public_data = BUTTON.public_data  # the button's key offered, never signed

    async def never(data: bytes) -> bytes:
        await asyncio.Event().wait()
        return b""

    pair.sign_async = never  # type: ignore[attr-defined]

    async def offerer(source: str) -> None:
        while not stop.is_set():
            try:
                async with asyncssh.connect(
                        "127.0.0.1", port, username="hostagent", client_keys=[pair],
                        known_hosts=None, agent_path=None, config=None, password_auth=False,
                        kbdint_auth=False, local_addr=(source, 0)):
                    pass
            except (OSError, asyncssh.Error):
                await asyncio.sleep(0.01)

    async with ssh_endpoint(tmp_path, verbs) as port:
        async with client(port, BUTTON, tmp_path, local="127.0.0.1") as conn:  # pressed before
            assert (await conn.run("status")).exit_status == 0
        results = await presses(port, tmp_path, [offerer(f"127.0.0.{10 + i}")
                                                 for i in range(40)], settle=2, n=5)
        stop.set()
    assert results == [0] * 5, results
