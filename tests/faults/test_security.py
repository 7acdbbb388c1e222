"""Who may drive the agent: root on its sockets, and listed keys, for their VMs, on SSH.

The sockets are checked twice: the socket files' owner and mode, and a real connection
from an unprivileged user (nobody, with no groups) inside the lab, next to a socket
anyone may use in the same directory, so that the refusal comes from the socket's own
mode and not from a directory on the way. The SSH endpoint is covered at length in
tests/lab/test_control_lab.py; here, its refusals in one pass, for the table.
"""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lab.lab import Lab
from tests.lab.helpers import OpenSsh, free_port, keygen, public

pytestmark = pytest.mark.lab

CONNECT = """\
import errno, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
else:
    print("connected")
"""


def connect_as_nobody(lab: Lab, path: str) -> str:
    out = subprocess.run(lab.nsenter("setpriv", "--reuid=65534", "--regid=65534",
                                     "--clear-groups", sys.executable, "-I", "-c", CONNECT,
                                     path),
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


@pytest.fixture
def open_socket(lab: Lab) -> Iterator[str]:
    """A listening socket that anyone may use, beside the agent's: the control."""
    path = lab.root / "run-hostagent" / "anyone.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        path.chmod(0o666)
        s.listen()
        yield "/run/hostagent/anyone.sock"
    path.unlink()


@pytest.mark.parametrize("which", ["hook", "control"])
def test_socket_refuses_other_users(lab: Lab, open_socket: str, which: str) -> None:
    """security: the {which} socket refuses other users"""
    lab.start_agent()
    sock = lab.root / "run-hostagent" / f"{which}.sock"
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == 0
    assert stat.S_IMODE(st.st_mode) & 0o077 == 0, oct(st.st_mode)
    assert connect_as_nobody(lab, open_socket) == "connected"
    assert connect_as_nobody(lab, f"/run/hostagent/{which}.sock") == "EACCES"


def test_ssh_refusals(lab: Lab, tmp_path: Path) -> None:
    """security: SSH refuses an unknown key, another VM, an injection, a shell, a pty"""
    port = free_port()
    button = keygen(tmp_path / "button", "kitchen-button")
    stranger = keygen(tmp_path / "stranger", "stranger")
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    keys.write_text(f'verbs="play,release,status",vms="gaming1" {public(button)} button\n')
    keys.chmod(0o600)
    lab.write_config(lab.config_text() + f'\n[ssh]\nlisten = "127.0.0.1:{port}"\n'
                     f'authorized_keys = "{keys}"\n')
    lab.start_agent()
    host_key = lab.path("/var/lib/hostagent/ssh_host_ed25519_key.pub")
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_key.read_text()}")
    ssh = OpenSsh(port, known_hosts)
    out = ssh(stranger, "status")
    assert out.returncode == 255 and "Permission denied (publickey)" in out.stderr
    out = ssh(button, "play gaming2")
    assert out.returncode == 77 and "may not touch gaming2" in out.stderr
    out = ssh(button, "play gaming1; reboot")
    assert out.returncode == 64 and out.stderr.startswith("hostagent: refused: ")
    out = ssh(button, "-T", "")
    assert out.returncode == 255 and "shell request failed" in out.stderr
    out = ssh(button, "-tt", "status")
    assert out.returncode == 255 and "PTY allocation request failed" in out.stderr
    # None of it changed anything.
    assert "gaming1" not in lab.running() and "gaming2" not in lab.running()
    assert lab.records(event="intent") == []
