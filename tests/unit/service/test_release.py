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
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import pytest

from hostagent.core.model import AttachFailed, DetachFailed, GpusAttached, GpusDetached
from hostagent.host.libvirt import ExecResult, HostError
from hostagent.host import journal
from hostagent.service import hotplug
from tests.configs import UUID_A, UUID_B, UUID_C
from tests.unit.partial_world import B, C, gpus
from tests.unit.machine_scaffold import T
from tests.unit.hotplug_scaffold import AddStep
from tests.unit.hotplug_scaffold import FakeStep, Guest, release_within, unplug
from tests.unit.partial_world import A

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
    # processes, past timeouts.release on a real node, and the unplug then read as a stuck
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
    step = FakeStep()
    step.cfg = release_within(step.cfg, 0.3)
    step.libvirt = SlowScan(step)
    step.cluster.guest = step.libvirt
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and not event.stuck, event
    assert "holders" in event.reason and step.libvirt.detached == []


# --- NVML's drain state and removal, where the guest's nvidia-smi has them ---------------

# What `nvidia-smi drain -h` answers: see hostagent.service.hotplug's DRAIN_HELP.
DRAIN_HELP_TEXT = """    drain -- Display and modify the GPU drain states.
    -p,   --pciid=     PCI bus ID of the GPU
    -m,   --modify=    Modify the drain state
    -r,   --remove     Remove the GPU from the kernel's view
    -q,   --query      Display the current drain state
"""


class Draining(Guest):
    """A guest whose nvidia-smi has the drain verb: persistence off, the drain state
    set, then the removal, which answers "In use" while `in_use` (a client NVML knows
    of) and otherwise takes the GPU from its driver."""

    def __init__(self, step: FakeStep) -> None:
        super().__init__(step)
        self.in_use = False
        self.help = (0, DRAIN_HELP_TEXT)
        self.persistence_code = 0

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        order = self.step.cluster.order
        if path == "nvidia-smi" and args == list(hotplug.DRAIN_HELP):
            return ExecResult(self.help[0], self.help[1], "")
        if path == "nvidia-smi" and args == ["-i", "0000:05:00.0", "-pm", "0"]:
            order.append("persistence off")
            if self.persistence_code:
                return ExecResult(self.persistence_code, "Unable to set persistence mode for "
                                  "GPU 00000000:05:00.0: Not Supported\n", "")
            return ExecResult(0, "Disabled persistence mode for GPU 00000000:05:00.0.\n", "")
        if path == "nvidia-smi" and args[:3] == ["drain", "--pciid", "0000:05:00.0"]:
            if args[3:] == ["--modify", "1"]:
                order.append("drain")
                return ExecResult(0, "Successfully set GPU 00000000:05:00.0 drain state "
                                     "to: draining.\n", "")
            assert args[3:] == ["--remove"] and not self.holders
            order.append("remove")
            if self.in_use:
                return ExecResult(255, "Failed to remove GPU 00000000:05:00.0: In use by "
                                       "another client\n", "")
            self.bound = False
            return ExecResult(0, "", "")
        return await super().guest_exec(name, path, args, timeout=timeout)


def draining_step() -> FakeStep:
    step = FakeStep()
    step.libvirt = Draining(step)
    step.cluster.guest = step.libvirt
    return step


@pytest.mark.parametrize("persistence", [0, 3], ids=["persistence off", "refused"])
async def test_the_gpu_leaves_through_nvml_drain_where_nvidia_smi_has_it(
        persistence: int) -> None:
    # A GPU that refuses to change its persistence mode is no doubt by itself: a holder
    # left would show in the scan, and the removal would say "in use".
    step = draining_step()
    step.libvirt.persistence_code = persistence  # type: ignore[attr-defined]
    await unplug(step)
    assert step.cluster.order == ["cordon", "checkpoint", "withdraw", "query",
                                  "persistence off", "holders", "drain", "remove",
                                  "unbind", "detach"]
    assert [type(e) for e in step.applied] == [GpusDetached]


async def test_a_gpu_in_use_answers_so_and_gives_way_to_the_restart_unstuck() -> None:
    # A client the scan could not see (another PID namespace's, say): NVML says "in use"
    # where a sysfs unbind would wait on it; no detach, no stuck guest.
    step = draining_step()
    step.libvirt.in_use = True  # type: ignore[attr-defined]
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and not event.stuck
    assert "In use by another client" in event.reason
    assert step.libvirt.detached == [] and step.libvirt.bound


@pytest.mark.parametrize(("answer", "supported"), [
    ((0, DRAIN_HELP_TEXT), True),
    ((2, "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"),
     False),
    (None, False),
], ids=["drain", "an older nvidia-smi", "no nvidia-smi"])
async def test_drain_supported_says_whether_and_why(
        answer: tuple[int, str] | None, supported: bool) -> None:
    step = draining_step()
    if answer is None:
        async def nothing(name: str, path: str, args: list[str], *,
                          timeout: float = 30) -> ExecResult:
            raise HostError(f"guest agent of {name}: {path}: Failed to execute child process")
        step.libvirt.guest_exec = nothing  # type: ignore[method-assign]
    else:
        step.libvirt.help = answer  # type: ignore[attr-defined]
    ok, why = await hotplug.drain_supported(step)
    assert ok is supported and why
    assert ("not found" in why) if answer is None else True


# --- a failed hot-add is undone as an unplug; the CDI spec made anew before the plugins --


class Added(AddStep):
    """A hot-add whose GPU the guest's driver sees (nvidia-smi lists all three), with a
    node that does not advertise it (`grow_says`), or a CDI refresh (`refresh`)."""

    def __init__(self, refresh: str = "", refresh_code: int = 0) -> None:
        super().__init__()
        if refresh:
            self.cfg = replace(self.cfg, lendee=replace(self.cfg.lendee, cdi_refresh=refresh))
        self.refresh_code = refresh_code
        self.order: list[str] = []
        self.grow_says: str | None = "node gpu-node reports 2 nvidia.com/gpu of 3"

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None:
        self.order.append("verify")
        return None

    async def grow(self, lent: object) -> str | None:
        self.order.append("grow")
        return self.grow_says

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        self.order.append("withdraw")
        return None

    async def detach_live(self, name: str, labels: Collection[str], gpus: object) -> None:
        self.order.append("detach")
        await super().detach_live(name, labels, gpus)

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "nvidia-smi" and args == list(hotplug.QUERY):
            self.order.append("query")
            return ExecResult(0, f"{UUID_A}, 00000000:05:00.0, 0\n"
                                 f"{UUID_B}, 00000000:06:00.0, 1\n"
                                 f"{UUID_C}, 00000000:07:00.0, 2\n", "")
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.HOLDERS]:
            self.order.append("holders")
            assert args[3:] == ["/dev/nvidia0"]
            return ExecResult(0, "", "")
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.UNBIND]:
            self.order.append("unbind")
            assert args[3:] == ["0000:05:00.0"]
            return ExecResult(0, "", "")
        if path == "/bin/sh" and args[0] == "-c" and args[1] == self.cfg.lendee.cdi_refresh:
            self.order.append("cdi")
            return ExecResult(self.refresh_code, "", "" if self.refresh_code == 0 else
                              "nvidia-ctk: failed to initialize NVML: Unknown Error")
        raise HostError(f"guest agent of {name}: {path}: Failed to execute child process")


async def test_a_failed_hot_add_is_undone_as_an_unplug() -> None:
    # The plugins came back with the GPU present and hold it open; the guest's driver
    # has it bound: a bare detach then hangs in the guest or leaves the GPU in doubt.
    step = Added()
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, AttachFailed) and event.held == frozenset()
    # Then the plugins come back, for what stays lent.
    assert step.order == ["verify", "grow", "withdraw", "query", "holders", "unbind",
                          "detach", "grow"]
    assert step.live == {B, C}


async def test_the_cdi_spec_is_made_anew_before_the_plugins_come_back(
        sink: journal.ListSink) -> None:
    command = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
    step = Added(refresh=command)
    step.grow_says = None
    await hotplug.hot_add(step, T + 1, gpus(A))
    assert [type(e) for e in step.applied] == [GpusAttached]
    assert step.order == ["verify", "cdi", "grow"]
    assert any("CDI spec made anew" in e.message for e in sink.entries)
    # A refresh that fails is a failed hot-add: the plugins never came back with it.
    step = Added(refresh=command, refresh_code=1)
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, AttachFailed) and "lendee.cdi_refresh" in event.reason
    assert step.order == ["verify", "cdi", "query", "holders", "unbind", "detach"]


class ScanToTheBound(Draining):
    """A guest whose holder scan answers "none" only as the bound runs out (a loaded
    node): no time is left for nvidia-smi, which never ran, so never hung."""

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.HOLDERS]:
            await asyncio.sleep(timeout)
            return ExecResult(0, "", "")
        return await super().guest_exec(name, path, args, timeout=timeout)


async def test_no_time_left_for_a_driver_call_is_no_stuck_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a driver call the bound left no time for was read as one that hung: the
    # restart after it could then power off a guest whose driver was fine.
    step = FakeStep()
    step.cfg = release_within(step.cfg, 0.3)
    step.libvirt = ScanToTheBound(step)
    step.cluster.guest = step.libvirt
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and not event.stuck, event
    assert "no time left" in event.reason and "nvidia-smi" in event.reason, event.reason
    assert event.reason.count("nvidia-smi in ") == 1, event.reason  # said once
    assert step.libvirt.detached == [] and step.libvirt.bound
