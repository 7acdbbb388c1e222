"""Connection floods on the SSH and metrics ports leave the hook and control sockets alone.

A separate process opens hundreds of TCP connections to each port and holds them, the
way a scanner or a brute-force run does. Both servers share the agent's process, and so
its descriptors, with the hook socket: they must close what is over their caps at once,
so the agent's descriptor count stays bounded, the hook and control sockets go on
answering, and the journal gets a handful of records, not two per connection.
"""

from __future__ import annotations

import asyncio
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

from hostagent import journal, metrics, ssh
from hostagent.control import Reply, request, serve_control
from hostagent.health import Health
from hostagent.inbox import HookEvent, Verdict, serve_hooks
from hostagent.model import Topology

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
        while time.monotonic() < deadline:  # let the servers accept all they will
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
    assert ssh.LOGIN_TIMEOUT <= 10


async def test_ssh_caps_per_source_then_in_all(tmp_path: Path) -> None:
    keys = tmp_path / "authorized_keys"
    keys.write_text("")
    keys.chmod(0o600)
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, {},
                             max_per_source=3, max_unauthenticated=5)
    held = []
    try:
        port = server.get_port()
        for _ in range(4):
            held.append(await asyncio.open_connection("127.0.0.1", port))
        banners = []
        for reader, _ in held:
            try:
                banners.append(await asyncio.wait_for(reader.readline(), 2))
            except (TimeoutError, ConnectionError):
                banners.append(b"")
        assert sum(b.startswith(b"SSH-2.0-hostagent") for b in banners) >= 3
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(held[3][0].read(), 2) == b""  # the fourth: closed
    finally:
        for _, writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
