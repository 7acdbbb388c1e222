"""`hostagent play` and the SSH endpoint end to end, against the lab's real VMs.

Two agent starts: one for the home-automation endpoint (Debian's OpenSSH client and
asyncssh's, real keys, the refusals, then a real play and release), one for the control
socket itself (its permissions, a streamed play, clients that leave mid-play). The
agent runs in the lab's mount namespace; the network is shared, so its SSH listener on
127.0.0.1 is reachable from here, and its control socket through the lab directory.
"""

from __future__ import annotations

import asyncio
import grp
import json
import socket
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from hostagent.surfaces.ssh import PEER_INTERVAL

from tests.lab.lab import Lab
from tests.packaging.readme import commands, readme_ssh
from tests.lab.helpers import (
    free_port,
    keygen,
    OpenSsh,
    public,
    wait_lent,
)

pytestmark = pytest.mark.lab

INJECTIONS = [
    "play gaming1; rm -rf /",
    "play gaming2; rm -rf /",
    "play 'gaming2'",
    'play "gaming2"',
    "play gaming2 && reboot",
    "play $(reboot)",
    "play  gaming2",
    "play gaming2 ",
    "play gaming2\nrm -rf /",
    "play " + "g" * 300,
]


def test_home_automation_over_ssh_with_openssh_and_asyncssh(lab: Lab, tmp_path: Path) -> None:
    lab.partial = False  # the endpoint is the subject: no restart of gpu-node in between
    port = free_port()
    button = keygen(tmp_path / "button", "kitchen-button")
    admin = keygen(tmp_path / "admin", "admin")
    stranger = keygen(tmp_path / "stranger", "stranger")
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    keys.write_text(f'verbs="play,release,status",vms="gaming1" {public(button)} kitchen-button\n'
                    f'restrict,verbs="*",vms="*" {public(admin)} admin\n')
    keys.chmod(0o600)
    lab.write_config(lab.config_text() + f'\n[ssh]\nlisten = "127.0.0.1:{port}"\n'
                     f'authorized_keys = "{keys}"\n')
    lab.start_agent()
    # The host key was created at the first start, in the state directory.
    host_key = lab.path("/var/lib/hostagent/ssh_host_ed25519_key")
    assert stat.S_IMODE(host_key.stat().st_mode) == 0o600
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} "
                           f"{host_key.with_name(host_key.name + '.pub').read_text()}")
    run = OpenSsh(port, known_hosts)
    wait_lent(lab)

    # Refusals, while the lendee is lent: none may change anything.
    out = run(stranger, "status")
    assert out.returncode == 255 and "Permission denied (publickey)" in out.stderr
    out = run(button, "play gaming2")
    assert out.returncode == 77, out
    assert out.stderr == ("hostagent: denied: this key (kitchen-button) may not touch gaming2; "
                          "it may name: gaming1\n")
    out = run(button, "reclaim")
    assert out.returncode == 77, out
    for line in INJECTIONS:
        out = run(admin, line)
        assert out.returncode == 64, (line, out)
        assert out.stderr.startswith("hostagent: refused: ") and out.stdout == "", line
    out = run(button, "-T", "")  # a shell
    assert out.returncode == 255 and "shell request failed" in out.stderr, out
    out = run(button, "-s", "sftp")
    assert out.returncode == 255 and "subsystem request failed" in out.stderr, out
    out = run.sftp(button)
    assert out.returncode != 0, out
    out = run(button, "-W", f"127.0.0.1:{port}", "")  # to a port that listens
    assert out.returncode == 255, out
    assert "administratively prohibited: hostagent forwards nothing" in out.stderr, out
    out = run(button, "-N", "-o", "ExitOnForwardFailure=yes", "-R", f"0:127.0.0.1:{port}", "",
              timeout=30)
    assert out.returncode == 255 and "forwarding failed" in out.stderr, out
    out = run(button, "-tt", "status")  # a terminal asked for with -tt: refused, so no command
    assert out.returncode == 255 and "PTY allocation request failed" in out.stderr, out
    # The refusals above filled this network's allowance of SSH records for the
    # interval (hostagent.surfaces.ssh.PEER_BURST): the commands below, whose every record is
    # checked, come in the next one.
    time.sleep(PEER_INTERVAL)
    out = run(button, "status")
    assert out.returncode == 0 and "lendee gpu-node: lent" in out.stdout, out
    refusals = asyncio.run(_asyncssh_refusals(port, known_hosts, button, stranger))
    assert refusals == {"unknown key": "PermissionDenied", "gaming2": 77, "injection": 64,
                        "shell": "ChannelOpenError", "pty": "ChannelOpenError",
                        "sftp": "ChannelOpenError", "forward": "ChannelOpenError"}
    assert lab.running() == ["gpu-node"]
    assert lab.records(event="intent") == []
    assert lab.phases() == ["off>booting", "booting>joining", "joining>lent"]

    # The button plays gaming1, by README's Home Assistant line (its key, port, host and
    # known_hosts the lab's): progress streamed, exit 0 once it runs.
    shell_command = {c.split()[-2]: readme_ssh(c, port, {"/config/ssh/button_key": button},
                                               known_hosts)
                     for c in commands() if "hostagent@gaming-host.lan" in c}
    out = subprocess.run(shell_command["play"], capture_output=True, text=True, timeout=90,
                         stdin=subprocess.DEVNULL, check=False)
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert any("draining gpu-node" in line for line in lines), lines
    assert lines[-1].startswith("gaming1 is running (")
    assert lab.state("gaming1") == "running" and lab.state("gpu-node") == "shut off"

    # ...and releases it through its guest agent; the lend follows by itself.
    lab.wait_agent("gaming1")
    out = subprocess.run(shell_command["release"], capture_output=True, text=True, timeout=90,
                         stdin=subprocess.DEVNULL, check=False)
    assert out.returncode == 0, out
    assert "shutting gaming1 down through its guest agent" in out.stdout
    assert "gpu-node gets its GPUs back in" in out.stdout
    assert lab.state("gaming1") == "shut off"

    # asyncssh as the client: the same key plays gaming1 again.
    status, stdout = asyncio.run(_asyncssh_play(port, known_hosts, button))
    assert status == 0, stdout
    assert stdout.splitlines()[-1].startswith("gaming1 is running (")
    assert lab.state("gaming1") == "running"

    # Every connection and decision is in the journal, with the key that made it.
    ssh = lab.records(event="ssh")
    results = {r["HOSTAGENT_RESULT"] for r in ssh}
    assert {"created", "listening", "connected", "refused", "authenticated", "denied",
            "allowed", "ok", "closed"} <= results
    allowed = [r for r in ssh if r["HOSTAGENT_RESULT"] == "allowed"]
    assert {r["HOSTAGENT_KEY"] for r in allowed} == {"kitchen-button"}
    assert [r["HOSTAGENT_COMMAND"] for r in allowed] == [
        "'status'", "'play gaming1'", "'release gaming1'", "'play gaming1'"]
    refused = [r["MESSAGE"] for r in ssh if r["HOSTAGENT_RESULT"] == "refused"]
    for what in ("an unknown key", "a shell", "the subsystem 'sftp'", "a terminal (pty)",
                 "the command 'status' after a refused terminal", "a port forwarding",
                 "a remote port forwarding", "command 'play gaming1; rm -rf /'"):
        assert any(what in m for m in refused), (what, refused)


def _client(port: int, known_hosts: Path, key: Path) -> Any:
    return asyncssh.connect("127.0.0.1", port, username="hostagent",
                            client_keys=[asyncssh.read_private_key(key)],
                            known_hosts=str(known_hosts), agent_path=None, config=None)


async def _asyncssh_refusals(port: int, known_hosts: Path, button: Path, stranger: Path
                             ) -> dict[str, Any]:
    """Each attempt on a connection of its own: a connection runs one command."""
    seen: dict[str, Any] = {}
    try:
        async with _client(port, known_hosts, stranger):
            pass
    except asyncssh.PermissionDenied as e:
        seen["unknown key"] = type(e).__name__

    async def run(line: str) -> int | None:
        async with _client(port, known_hosts, button) as conn:
            status: int | None = (await conn.run(line)).exit_status
            return status

    seen["gaming2"] = await run("play gaming2")
    codes = {await run(line) for line in INJECTIONS}
    seen["injection"] = codes.pop() if len(codes) == 1 else codes
    attempts: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "shell": lambda conn: conn.create_process(),
        "pty": lambda conn: conn.create_process("status", term_type="xterm"),
        "sftp": lambda conn: conn.start_sftp_client(),
        "forward": lambda conn: conn.open_connection("127.0.0.1", port),
    }
    for what, attempt in attempts.items():
        async with _client(port, known_hosts, button) as conn:
            try:
                await attempt(conn)
                seen[what] = "allowed!"
            except (asyncssh.Error, OSError) as e:
                seen[what] = type(e).__name__
    return seen


async def _asyncssh_play(port: int, known_hosts: Path, key: Path) -> tuple[int | None, str]:
    async with _client(port, known_hosts, key) as conn:
        done = await conn.run("play gaming1", timeout=90)
    return done.exit_status, str(done.stdout)


def _as(lab: Lab, uid: int, gid: int) -> subprocess.CompletedProcess[str]:
    """Try to connect to the agent's control socket as uid/gid, with no other groups."""
    code = ("import socket; s = socket.socket(socket.AF_UNIX); "
            "s.connect('/run/hostagent/control.sock'); print('connected')")
    return subprocess.run(lab.nsenter("setpriv", f"--reuid={uid}", f"--regid={gid}",
                                      "--clear-groups", "/usr/bin/python3", "-I", "-c", code),
                          capture_output=True, text=True, timeout=30, check=False, cwd="/")


def test_control_socket_permissions_streamed_play_and_clients_that_leave(lab: Lab) -> None:
    lab.partial = False  # the socket is the subject: no restart of gpu-node in between
    lab.write_config('control_group = "nogroup"\n' + lab.config_text())
    lab.start_agent()
    sock = lab.path("/run/hostagent/control.sock")
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    assert sock.stat().st_gid == grp.getgrnam("nogroup").gr_gid
    member, stranger = _as(lab, 65534, 65534), _as(lab, 65534, 65533)
    assert member.stdout == "connected\n", member
    assert stranger.returncode != 0 and "PermissionError" in stranger.stderr, stranger
    wait_lent(lab)

    # A full play, streamed as JSON lines by the CLI.
    out = lab.hostagent("play", "gaming1", "--json")
    assert out.returncode == 0, out
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["type"] for e in events[:-1]] == ["progress"] * (len(events) - 1)
    assert events[0]["event"] == "intent" and events[0]["to"] == "pending"
    assert [e["to"] for e in events if e.get("event") == "phase"] == [
        "draining", "stopping", "off"]
    assert all(e["v"] == 1 and "elapsed_s" in e and e["waiting"] for e in events[:-1])
    assert events[-1]["ok"] is True and events[-1]["data"]["vm"] == "gaming1"
    assert lab.state("gaming1") == "running"
    intent = lab.records(event="intent", to="pending")
    assert [r["HOSTAGENT_INTENT"] for r in intent] == [events[0]["intent"]]

    lab.wait_agent("gaming1")
    out = lab.hostagent("release", "gaming1")
    assert out.returncode == 0, out
    assert out.stdout.splitlines()[0].endswith(
        "shutting gaming1 down through its guest agent (waiting for gaming1 to power off)")
    wait_lent(lab, after=1)

    # Two clients leave mid-play: one hangs up after the first line, one times out.
    # Neither cancels anything: both VMs start, from one reclaim.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b'{"v":1,"verb":"play","args":{"vm":"gaming1"}}\n')
        first = json.loads(s.makefile("rb").readline())
    assert first["type"] == "progress" and first["to"] == "pending"
    out = lab.hostagent("play", "gaming2", "--timeout", "1")
    assert out.returncode == 3, out
    assert out.stderr == ("hostagent: stopped waiting after 1s (--timeout); gaming2 still starts "
                          "by itself: follow it with `hostagent status`\n")
    lab.wait_game("gaming1")
    lab.wait_game("gaming2")
    assert len(lab.wait_records(3, event="intent", to="done")) == 3
    assert lab.phases()[-3:] == ["lent>draining", "draining>stopping", "stopping>off"]
