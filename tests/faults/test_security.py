"""The hook and control sockets refuse every user but root.

Checked twice: the socket files' owner and mode, and a real connection from an
unprivileged user (nobody, with no groups) inside the lab, next to a socket anyone
may use in the same directory, so that the refusal comes from the socket's own mode
and not from a directory on the way.
"""

from __future__ import annotations

import socket
import stat
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.lab.lab import Lab

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
