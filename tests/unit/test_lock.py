"""One agent per host: the second `hostagent run` is refused, never steals the sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostagent.lock import AlreadyRunning, lock_agent

HOLD = """
import sys, time
from pathlib import Path
from hostagent.lock import lock_agent
lock = lock_agent(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_agent_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    path = tmp_path / "state" / "agent.lock"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "locked\n"
        with pytest.raises(AlreadyRunning, match=rf"pid {first.pid}\b.*systemctl stop"):
            lock_agent(path)
    finally:
        first.kill()
        first.wait()
        if first.stdout is not None:
            first.stdout.close()
    # The kernel dropped the dead agent's lock: no stale lock to clean by hand.
    with lock_agent(path):
        assert path.read_text() == f"{os.getpid()}\n"


def test_the_lock_is_exclusive_within_a_process_too(tmp_path: Path) -> None:
    path = tmp_path / "agent.lock"
    held = lock_agent(path)
    with pytest.raises(AlreadyRunning):
        lock_agent(path)
    assert path.read_text() == f"{os.getpid()}\n"  # the loser changed nothing
    held.release()
    held.release()  # idempotent
    lock_agent(path).release()


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "agent.lock").symlink_to(target)
    with pytest.raises(OSError):
        lock_agent(tmp_path / "agent.lock")
    assert target.read_text() == "keep"
