"""Per-verb rights on the control socket: who the kernel says the caller is decides.

The clients run as other users (nobody, with or without the control group among its
supplementary groups) in child processes, as `hostagent status` run by someone in
that group would; the tests run as root, like the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import journal
from hostagent.surfaces.control import (
    GROUP_VERBS,
    REQUESTS_BURST,
    REQUESTS_INTERVAL,
    Caller,
    Reply,
    Rights,
    current_caller,
    request,
    serve_control,
)

log = logging.getLogger("test")
NOBODY = 65534
GROUP = 47913  # control_group's gid for these tests; needs no /etc/group entry
VERBS = ("status", "play", "release", "hold", "resume", "lend", "reclaim")

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as "
                                 "other users"), pytest.mark.usefixtures("sink")]

CLIENT = r"""
import json, socket, sys
path, verbs = sys.argv[1], sys.argv[2:]
out = {}
for verb in verbs:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError as e:
        out[verb] = "connect: " + type(e).__name__
        continue
    s.sendall(json.dumps({"v": 1, "verb": verb, "args": {"vm": "gaming1"}}).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    reply = json.loads(data.splitlines()[-1])
    out[verb] = "ok" if reply.get("ok") else reply.get("error")
print(json.dumps(out))
"""


@pytest.fixture
def sock() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="ctl-")
    os.chmod(d, 0o755)  # other users must reach the socket, as under /run/hostagent
    try:
        yield Path(d) / "control.sock"
    finally:
        shutil.rmtree(d)


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Caller | None]] = []

    def verbs(self) -> dict[str, Any]:
        def make(verb: str) -> Any:
            async def handler(args: dict[str, Any]) -> AsyncIterator[Reply]:
                self.calls.append((verb, current_caller()))
                yield {"ok": True}
            return handler
        return {v: make(v) for v in VERBS}


def run_as(path: Path, verbs: tuple[str, ...], *, groups: list[int]) -> dict[str, str]:
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", CLIENT, str(path), *verbs],
                          user=NOBODY, group=NOBODY, extra_groups=groups,
                          capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, str] = json.loads(done.stdout)
    return result


async def test_a_control_group_member_may_only_look_hold_and_resume(
        sock: Path, sink: journal.ListSink) -> None:
    # Before, every member of control_group could run every verb: `release gaming1`
    # shut down someone else's game, while the README and the module promised
    # status/hold/resume.
    seen = Seen()
    server = await serve_control(sock, seen.verbs(), mode=0o660, group=GROUP,
                                 group_name="hostagent", log=log)
    try:
        answers = await asyncio.to_thread(run_as, sock, VERBS, groups=[GROUP])
    finally:
        server.close()
    assert {v for v, a in answers.items() if a == "ok"} == set(GROUP_VERBS)
    for verb in set(VERBS) - GROUP_VERBS:
        assert answers[verb].startswith(f"denied: nobody may not use {verb!r}: members of "
                                        "control_group 'hostagent' may use hold, lend, "
                                        "resume, status"), answers[verb]
    assert sorted(v for v, _ in seen.calls) == sorted(GROUP_VERBS)
    for _, caller in seen.calls:
        assert caller is not None and (caller.user, caller.uid) == ("nobody", NOBODY)
        assert caller.pid is not None and caller.pid != os.getpid()
        assert GROUP in caller.groups and not caller.privileged
    # The caller is named in the journal; refusals are summarised, not one each.
    allowed = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "allowed"]
    assert {e.fields["HOSTAGENT_VERB"] for e in allowed} == GROUP_VERBS - {"status"}
    assert all(e.fields["HOSTAGENT_USER"] == "nobody" and e.fields["HOSTAGENT_UID"] == str(NOBODY)
               for e in allowed)
    refused = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "refused"]
    assert len(refused) == 1 and "nobody (uid 65534, pid" in refused[0].message


async def test_control_verbs_grants_members_more(sock: Path) -> None:
    server = await serve_control(sock, Seen().verbs(), mode=0o660, group=GROUP, log=log,
                                 group_verbs=["status", "play"])
    try:
        answers = await asyncio.to_thread(run_as, sock, ("status", "play", "hold"),
                                          groups=[GROUP])
    finally:
        server.close()
    assert answers["status"] == answers["play"] == "ok"
    assert answers["hold"].startswith("denied:")


async def test_a_caller_outside_the_group_may_do_nothing(sock: Path) -> None:
    server = await serve_control(sock, Seen().verbs(), mode=0o666, group=GROUP, log=log)
    try:  # the socket's mode is wrong here: the rights still hold
        answers = await asyncio.to_thread(run_as, sock, ("status", "play"), groups=[])
    finally:
        server.close()
    assert all(a.startswith("denied: nobody (uid 65534) may not use the control socket")
               for a in answers.values()), answers


async def test_root_may_do_everything(sock: Path) -> None:
    seen = Seen()
    server = await serve_control(sock, seen.verbs(), mode=0o660, group=GROUP, log=log)
    try:
        for verb in VERBS:
            replies = await asyncio.to_thread(lambda v: list(request(sock, v)), verb)
            assert replies[-1]["ok"] is True
    finally:
        server.close()
    assert [v for v, _ in seen.calls] == list(VERBS)
    assert all(c is not None and c.privileged and c.uid == 0 for _, c in seen.calls)


def test_rights_are_decided_without_a_socket() -> None:
    rights = Rights(group=10, group_name="hostagent")
    member = Caller(user="ann", uid=1000, gid=1000, pid=5, groups=frozenset({10}))
    assert rights.may(member, "status") is None
    assert rights.may(member, "release") is not None
    assert rights.may(Caller(user="ann", uid=1000, gid=10, pid=5), "hold") is None
    assert rights.may(Caller(user="bob", uid=1001, gid=1001, pid=6), "status") is not None
    assert Rights().may(member, "status") is not None  # no group: root only
    assert Rights().may(Caller(user="root", uid=0, privileged=True), "release") is None


async def test_an_idle_connection_is_closed_and_others_are_served(sock: Path) -> None:
    server = await serve_control(sock, Seen().verbs(), log=log, request_timeout=0.3)
    try:
        idle = socket.socket(socket.AF_UNIX)
        idle.connect(str(sock))
        idle.settimeout(5)
        replies = await asyncio.to_thread(lambda: list(request(sock, "status")))
        assert replies[-1]["ok"] is True
        data = await asyncio.to_thread(idle.recv, 4096)
        assert b"no request within 0.3s" in data
        assert await asyncio.to_thread(idle.recv, 4096) == b""  # closed
        idle.close()
    finally:
        server.close()


async def test_connections_are_capped_per_caller_and_in_all(sock: Path) -> None:
    server = await serve_control(sock, Seen().verbs(), mode=0o660, group=GROUP, log=log,
                                 max_connections=4, max_per_caller=2)
    held: list[socket.socket] = []
    try:
        holder = """
import socket, sys
held = []
for _ in range(3):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); held.append(s)
s = held[-1]; s.settimeout(5); print(s.recv(4096).decode(), flush=True)
"""
        done = await asyncio.to_thread(
            subprocess.run, ["/usr/bin/python3", "-I", "-c", holder, str(sock)],
            user=NOBODY, group=NOBODY, extra_groups=[GROUP], capture_output=True, text=True,
            timeout=60)
        assert "too many control connections" in done.stdout, done
        # Root is counted apart: members holding every slot do not lock it out.
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(sock))
            held.append(s)
        replies = await asyncio.to_thread(lambda: list(request(sock, "status")))
        assert replies[-1]["ok"] is True
    finally:
        for s in held:
            s.close()
        server.close()


FLOODER = r"""
import json, socket, sys
path, n = sys.argv[1], int(sys.argv[2])

def send(line):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(line)
    while s.recv(65536):
        pass
    s.close()

for i in range(n):
    send(json.dumps({"v": 1, "verb": "hold", "args": {"vm": "hold-vm\x1b[2J"}}).encode() + b"\n")
    send(b"{not json " + b"\x1b]52;c;AAAA\x07" * 50 + b"\n")
    send(json.dumps({"v": 1, "verb": "play", "args": {"vm": "no-such-vm\x1b[2J"}}).encode()
         + b"\n")
"""
PLAY = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(json.dumps({"v": 1, "verb": "play", "args": {"vm": "gaming1"}}).encode() + b"\n")
while s.recv(65536):
    pass
"""


async def test_a_member_in_a_loop_gets_a_few_records_then_a_summary(
        sock: Path, sink: journal.ListSink, caplog: pytest.LogCaptureFixture) -> None:
    """One control_group member sends 600 requests in a loop (allowed, malformed, and
    play for a VM that does not exist): a few are journaled, the rest summarised once
    the interval is over, so the agent's own records are never drowned. A request's
    record names a VM only for play or release of a configured owner."""
    now = [0.0]  # the records' clock: the flood fits in one interval, however slow
    server = await serve_control(sock, Seen().verbs(), mode=0o660, group=GROUP,
                                 group_name="hostagent", log=log, owners={"gaming1"},
                                 group_verbs=GROUP_VERBS | {"play"}, clock=lambda: now[0])
    try:
        with caplog.at_level(logging.WARNING, logger="test"):
            await asyncio.to_thread(
                subprocess.run, ["/usr/bin/python3", "-I", "-c", FLOODER, str(sock), "200"],
                user=NOBODY, group=NOBODY, extra_groups=[GROUP], timeout=120, check=True)
            now[0] += REQUESTS_INTERVAL
            await asyncio.to_thread(
                subprocess.run, ["/usr/bin/python3", "-I", "-c", PLAY, str(sock)],
                user=NOBODY, group=NOBODY, extra_groups=[GROUP], timeout=60, check=True)
            answers = await asyncio.to_thread(lambda: list(request(sock, "release",
                                                                   {"vm": "gaming1"})))
            assert answers[-1]["ok"] is True
    finally:
        server.close()
    theirs = [e for e in sink.entries if e.fields.get("HOSTAGENT_UID") == str(NOBODY)]
    bad = [r for r in caplog.records if "bad request" in r.getMessage()]
    written = [e for e in theirs if e.fields.get("HOSTAGENT_RESULT") == "allowed"]
    # The first burst, and the last request (the interval was over by then).
    assert len(written) + len(bad) == REQUESTS_BURST + 1, (len(written), len(bad))
    summary = [e for e in theirs if e.fields.get("HOSTAGENT_RESULT") == "summarised"]
    assert len(summary) == 1 and "more requests in the last 10s" in summary[0].message
    assert len(written) + len(bad) + int(summary[0].fields["HOSTAGENT_COUNT"]) == 601
    assert written[-1].fields["HOSTAGENT_VM"] == "gaming1"  # the one after the interval
    assert all("HOSTAGENT_VM" not in e.fields for e in written[:-1])
    assert not any("vm" in e.message or "\x1b" in e.message for e in sink.entries)
    assert all(len(r.getMessage()) < 400 for r in bad)
    ours = [e for e in sink.entries if e.fields.get("HOSTAGENT_VERB") == "release"]
    assert len(ours) == 1 and ours[0].fields["HOSTAGENT_VM"] == "gaming1"
