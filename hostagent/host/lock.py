"""One agent per host: a lock held for the life of `hostagent run`.

Two agents with the same configuration would each unlink and bind the hook and control
sockets (the second steals both, the first keeps running blind) and race on the state
file. The first agent takes an exclusive `flock` on a file in its state directory and
one in its sockets' directory (two agents with different state_dirs would still share
/run/hostagent/hook.sock, which libvirt's hook knows), and keeps them until it exits;
the kernel drops the lock when the process dies, however it dies, so there is no stale
lock to clean after a crash. A second agent is refused with the pid of the first.

The lock file holds that pid, for the message and for an administrator; its content is
never trusted (the lock is). It is neither deleted nor truncated by the loser.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["AgentLock", "AlreadyRunning", "lock_agent"]


class AlreadyRunning(Exception):
    """Another agent holds the lock; the message names its pid and the fix."""


class AgentLock:
    """Held until `release` (or the end of the process)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> AgentLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def lock_agent(path: Path) -> AgentLock:
    """Take the agent's lock at `path` (created, with its directory, if missing).

    Raises AlreadyRunning if another process holds it, OSError if the file cannot be
    opened at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        who = f"pid {holder}" if holder.isdigit() else "another process"
        raise AlreadyRunning(
            f"another hostagent ({who}) is already running with {path}: one agent per "
            "host, or the two would steal each other's sockets. Stop it first "
            "(systemctl stop hostagent), or give this one another state_dir and sockets"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the pid is for people; the lock itself is held
    return AgentLock(path, fd)
