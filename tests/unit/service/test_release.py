"""The guest's part of a hot-unplug (`hostagent.service.hotplug._release`): who holds a
GPU's device node is found by one scan of /proc in the guest, whatever the number of
open files there (a real node has thousands: k3s, containerd shims, data loaders), and
only a driver call past its deadline (the unbind, nvidia-smi) counts as a stuck guest."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostagent.core.model import DetachFailed
from hostagent.host.libvirt import ExecResult, HostError
from hostagent.service import hotplug
from tests.unit.service.test_unplug import FakeStep, Guest, unplug

# A process of a busy node: `count` files open, and the "device node" at argv[2] once,
# whose fd number it prints; it lives until its stdin closes.
HOLDER = """
import os, sys
fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(sys.argv[1]))]
if sys.argv[2]:
    print(os.open(sys.argv[2], os.O_RDONLY), flush=True)
else:
    print("", flush=True)
sys.stdin.read()
"""


def test_the_holders_of_a_device_node_are_found_by_one_scan_of_5000_fds(
        tmp_path: Path) -> None:
    # The scan used to run readlink once per open file of the guest: thousands of
    # processes, past RELEASE_BOUND on a real node, and the unplug then read as a stuck
    # driver. Here every command the scan starts is counted through PATH.
    node = tmp_path / "nvidia0"
    node.write_text("")
    shims, log = tmp_path / "bin", tmp_path / "calls"
    shims.mkdir()
    for tool in ("readlink", "ls", "awk", "find", "grep", "sed", "cat", "head", "stat"):
        real = next((f"{d}/{tool}" for d in os.defpath.split(":") + ["/usr/bin", "/bin"]
                     if os.access(f"{d}/{tool}", os.X_OK)), None)
        if real:
            (shims / tool).write_text(f'#!/bin/sh\necho {tool} >> {log}\nexec {real} "$@"\n')
            (shims / tool).chmod(0o755)
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, "500", str(node) if i == 3 else ""],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(10)]
    try:
        fds = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        began = time.monotonic()
        try:
            done = subprocess.run(["/bin/sh", "-c", hotplug.HOLDERS, "sh", str(node)],
                                  capture_output=True, text=True, timeout=20,
                                  env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"})
            out = done.stdout
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        took = time.monotonic() - began
        calls = log.read_text().split() if log.exists() else []
        assert f"{procs[3].pid}/fd/{fds[3]}" in out.split(), out[:500]
        assert len(calls) <= 3, f"{len(calls)} commands in {took:.1f}s: {calls[:5]}"
        assert took < 5
    finally:
        for p in procs:
            stop(p)


def test_the_scan_answers_a_bounded_list(tmp_path: Path) -> None:
    # Untrusted text from the guest: however many fds hold the node, a bounded answer.
    node = tmp_path / "nvidia0"
    node.write_text("")
    script = f"import os, sys\n[os.open({str(node)!r}, os.O_RDONLY) for _ in range(300)]\n" \
             "print('', flush=True)\nsys.stdin.read()\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # type: ignore[union-attr]
        done = subprocess.run(["/bin/sh", "-c", hotplug.HOLDERS, "sh", str(node)],
                              capture_output=True, text=True, timeout=20)
        lines = done.stdout.splitlines()
        assert 0 < len(lines) <= hotplug.HOLDERS_SHOWN
        assert all(line.startswith(f"{proc.pid}/fd/") for line in lines)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


class SlowScan(Guest):
    """A guest whose holder scan does not end within the bound (a /proc of 100,000 fds
    on a loaded node): the driver is not what hangs."""

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.HOLDERS]:
            self.timeouts.append(timeout)
            await asyncio.sleep(timeout)
            raise HostError(f"{path} in {name} did not finish within {timeout:g}s")
        return await super().guest_exec(name, path, args, timeout=timeout)


async def test_a_holder_scan_past_the_bound_is_no_stuck_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Only an unbind or nvidia-smi past its deadline says the driver hangs (and the
    # restart that follows may then power the guest off); a slow scan is a plain doubt.
    monkeypatch.setattr(hotplug, "RELEASE_BOUND", 0.3)
    step = FakeStep()
    step.libvirt = SlowScan(step)
    step.cluster.guest = step.libvirt
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and not event.stuck, event
    assert "holders" in event.reason and step.libvirt.detached == []
