"""One agent per host: the second `hostagent run` is refused, never steals the sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostagent.service.agent import Agent
from hostagent.service.serving import StartupError
from hostagent.core.config import parse
from hostagent.host.lock import AlreadyRunning, lock_agent
from tests.unit.agents import (  # noqa: F401 (a fixture)
    CONFIG,
    FakeLibvirt,
    no_step_outlives_its_test,
)
from tests.waiting import until

HOLD = """
import sys, time
from pathlib import Path
from hostagent.host.lock import lock_agent
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


class RunningLibvirt(FakeLibvirt):
    """The control tests' fake libvirt, with what `Agent.run` asks of it at start."""

    async def connect(self, *, attempts: int | None = None) -> None:
        return None

    async def defined_domains(self) -> set[str]:
        return {"gpu-node", "gaming1", "gaming2"}

    async def close(self) -> None:
        return None


async def test_a_second_agent_with_another_state_dir_leaves_the_hook_socket_alone(
        tmp_path: Path) -> None:
    """Two configurations that differ only in state_dir share the hook socket (the hook
    knows one path): the second agent is refused before it unlinks and rebinds it."""
    first = Agent(parse(CONFIG.format(root=tmp_path, relend="60s"), "first.toml"))
    first.libvirt = RunningLibvirt(first)
    running = asyncio.get_running_loop().create_task(first.run())
    try:
        await until(lambda: first.serving.is_set() and first.cfg.hook_socket.exists())
        bound = first.cfg.hook_socket.stat().st_ino
        text = CONFIG.format(root=tmp_path, relend="60s").replace(
            f'state_dir = "{tmp_path}/state"', f'state_dir = "{tmp_path}/other"')
        second = Agent(parse(text, "second.toml"))
        second.libvirt = RunningLibvirt(second)
        other = asyncio.get_running_loop().create_task(second.run())
        # Refused at once; one that got through rebinds the socket within its start.
        await until(lambda: other.done()
                    or first.cfg.hook_socket.stat().st_ino != bound, timeout=5)
        assert first.cfg.hook_socket.stat().st_ino == bound, "the socket was stolen"
        with pytest.raises(StartupError, match=r"pid \d+.*already running"):
            await other
        assert not running.done()
    finally:
        first.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await running
