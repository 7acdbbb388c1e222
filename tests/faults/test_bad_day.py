"""A bad day for the host itself: its disk fills mid-reclaim, its clock is stepped
back, it shuts down and boots again with an owner that should start at boot.

The disk is the lab's: a tiny tmpfs mounted over /var/lib/hostagent inside the lab's
mount namespace, filled, then freed. The clock is the hook's: libvirtd runs it through
a wrapper that steps its clock back a year, so each event it sends carries a time from
before the agent started. The shutdown half asks the agent's own question, `systemctl
is-system-running`, of a stand-in that answers "stopping" (the lab cannot stop a
host); the SIGTERM, the cordon and the drain through the API stand-in are real.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.scenario import (
    Scenario,
    count,
    counted,
    gpus_in_xml,
    power_cut,
    qemu_pids,
    wait_for,
)
from tests.faults.helpers import cordoned, marker
from tests.lab.cluster import lab_cluster
from tests.lab.lab import DEFERRED, HOOK, LENDEE, REPO, Lab

pytestmark = pytest.mark.lab

STATE_DIR = "/var/lib/hostagent"  # inside the lab's namespace
YEAR = 366 * 86400

# The lab's libvirt hook for the clock row: the real hook, run with a clock one year
# behind (time.time_ns is where it stamps its events); the time it sent is kept in
# /var/log/libvirt/hook-clock, for the test to see the fault landed.
CLOCK_BEHIND = f"""#!/usr/bin/python3 -IS
import runpy, sys, time
real = time.time_ns
def behind():
    now = real() - {YEAR} * 10**9
    with open("/var/log/libvirt/hook-clock", "a") as f:
        f.write(f"{{now}}\\n")
    return now
time.time_ns = behind
sys.argv[0] = {str(HOOK)!r}
runpy.run_path({str(HOOK)!r}, run_name="__main__")
"""

# `systemctl is-system-running` as it answers while the host shuts down.
STOPPING = """#!/bin/sh
[ "$1" = "is-system-running" ] && { echo stopping; exit 1; }
exec /usr/bin/systemctl "$@"
"""


def in_lab(lab: Lab, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(lab.nsenter("sh", "-c", script), capture_output=True, text=True,
                          timeout=30, check=False)


@contextlib.contextmanager
def full_disk(lab: Lab) -> Iterator[Path]:
    """/var/lib/hostagent, inside the lab, on a 64 KiB tmpfs filled to the last byte.
    Yields the file to delete to free it; unmounted at the end (the lab's own directory
    is then the state directory again)."""
    out = in_lab(lab, f"mount -t tmpfs -o size=64k,mode=0755 hostagent-full {STATE_DIR} && "
                      f"{{ dd if=/dev/zero of={STATE_DIR}/fill bs=4k 2>/dev/null; true; }}")
    assert out.returncode == 0, out.stderr
    try:
        full = in_lab(lab, f"df --output=avail {STATE_DIR} | tail -1")
        assert full.stdout.strip() == "0", full.stdout
        yield Path(STATE_DIR) / "fill"
    finally:
        out = in_lab(lab, f"umount {STATE_DIR}")
        assert out.returncode == 0, out.stderr


def test_disk_full_mid_reclaim(lab: Lab, fault: Scenario) -> None:
    """disk full mid-reclaim: the reclaim goes on, a new request refused with its reason"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_for(lambda: lab.status()["lendee"]["phase"] == "lent", 90, "the first lend")
    # The lendee's stop is held some seconds after it powered off: the agent is still
    # stopping when gaming2 asks (long enough for a busy machine's status call).
    with fault.slow_hook(LENDEE, "stopped", "end", seconds=12) as held:
        assert DEFERRED in fault.start_owner("gaming1").stderr  # on disk before the answer
        with full_disk(lab) as fill:
            fault.fault()
            wait_for(held.exists, 60, "the lendee to power off")
            assert lab.status()["lendee"]["phase"] == "stopping"
            refused = fault.start_owner("gaming2", tries=1)
            assert refused.returncode != 0
            assert "could not record the request to start gaming2" in refused.stderr, refused
            assert "No space left on device" in refused.stderr
            assert DEFERRED not in refused.stderr  # no promise it cannot keep
            # The facts are taken: the lendee's stop, gaming1's start, its intent done.
            lab.wait_game("gaming1")
            lab.wait_records(1, event="intent", to="done", vm="gaming1")
            # Journaled once (a busy machine may have missed the save's time bound first).
            assert len([r for r in lab.records(event="state", result="failed")
                        if "No space left on device" in r["MESSAGE"]]) == 1
            text = lab.hostagent("status")
            assert text.returncode == 0, text.stderr
            assert re.search(r"failed checks:\n  state file: cannot write \S+state.toml: "
                             "No space left on device", text.stdout), text.stdout
            assert lab.status()["intents"] == []
            assert lab.state("gaming2") == "shut off"
            # Space is freed: the next retry (every 5 s) writes it.
            assert in_lab(lab, f"rm {fill}").returncode == 0
            lab.wait_record(timeout=15, event="state", result="ok")
            fault.recovered()
            saved = in_lab(lab, f"cat {STATE_DIR}/state.toml").stdout
            assert 'lendee_phase = "off"' in saved and "owner =" not in saved, saved
    assert "state file" not in lab.hostagent("status").stdout
    assert fault.shutdowns(LENDEE) == 1


@contextlib.contextmanager
def hook_clock_behind(lab: Lab) -> Iterator[Path]:
    """libvirtd runs the real hook with its clock a year behind."""
    hook = lab.root / "etc-libvirt" / "hooks" / "qemu"
    wrapper = lab.root / "clock-behind-hook"
    wrapper.write_text(CLOCK_BEHIND)
    wrapper.chmod(0o755)
    sent = lab.root / "log-libvirt" / "hook-clock"
    sent.unlink(missing_ok=True)
    hook.unlink()
    hook.symlink_to(wrapper)
    try:
        yield sent
    finally:
        hook.unlink()
        hook.symlink_to(HOOK)


def test_clock_stepped_back(lab: Lab, fault: Scenario) -> None:
    """clock stepped back a year: live hook events handled live, the owner starts by itself"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_for(lambda: lab.status()["lendee"]["phase"] == "lent", 90, "the first lend")
    with hook_clock_behind(lab) as sent:
        fault.fault()
        asked = fault.start_owner("gaming1")
        # Stale by its clock, live by where it came from: deferred, not waved through
        # onto a GPU the lendee holds.
        assert asked.returncode != 0 and DEFERRED in asked.stderr, asked
        stamps = [int(line) for line in sent.read_text().split()]
        assert stamps and all(t < time.time_ns() - 300 * 86400 * 10**9 for t in stamps)
        assert counted(lab, 1, event="intent", to="pending", vm="gaming1") == 1
        lab.wait_game("gaming1")
        lab.wait_records(1, event="intent", to="done", vm="gaming1")
        fault.recovered()
    assert lab.state(LENDEE) == "shut off"
    assert fault.shutdowns(LENDEE) == 1
    assert not list(lab.spool.glob("*.json"))  # nothing taken for a spooled event


@contextlib.contextmanager
def autostart(lab: Lab, vm: str) -> Iterator[None]:
    lab.virsh("autostart", vm)
    try:
        yield
    finally:
        lab.virsh("autostart", "--disable", vm, check=False)


def start_agent_while_host_stops(lab: Lab) -> subprocess.Popen[bytes]:
    """`hostagent run` whose `systemctl is-system-running` says "stopping"."""
    bin_dir = lab.root / "stopping-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(STOPPING)
    (bin_dir / "systemctl").chmod(0o755)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    proc = lab.spawn("agent", [str(REPO / ".venv" / "bin" / "hostagent"),
                               "--config", str(lab.config), "--sysfs", str(lab.sysfs),
                               "run"], env=env)
    wait_for(lambda: proc.poll() is not None or lab.agent_ready(), 30, "the agent")
    return proc


def test_host_shutdown_and_boot(lab: Lab, fault: Scenario) -> None:
    """host shut down and booted, gaming1 autostarted: start_at_boot instead, once"""
    lab.partial = True  # the lendee takes what gaming1 leaves
    with lab_cluster(lab) as kc, autostart(lab, "gaming1"):
        text = lab.config_text(relend_delay="1s", kubeconfig=kc.kubeconfig)
        lab.write_config(text)
        lint = lab.hostagent("lint")
        assert "gaming1: warning: libvirt autostarts it" in lint.stdout, lint.stdout
        assert "start_at_boot = true under [owners.gaming1]" in lint.stdout
        # As lint says: no autostart, start_at_boot instead.
        lab.virsh("autostart", "--disable", "gaming1")
        assert "autostart" not in lab.hostagent("lint").stdout
        start_agent_while_host_stops(lab)
        wait_for(lambda: lab.status()["lendee"]["phase"] == "lent", 90, "the first lend")
        assert not cordoned(kc)
        kc.wait_placed()  # the workloads, scheduled onto gpu-node once it was lent
        assert "web" in kc.apps_on(LENDEE)

        # Shutdown: systemd stops hostagent before libvirt-guests (its unit is ordered
        # after it), which then shuts the VMs down; then the power goes.
        assert lab.stop_agent() == 0
        assert cordoned(kc) and marker(kc) is not None
        assert kc.apps_on(LENDEE) == ["device-plugin"]  # drained but the DaemonSet
        assert lab.running() == [LENDEE]  # drained, not stopped: libvirt-guests does that
        with fault.deliberate():
            lab.virsh("shutdown", LENDEE)
            lab.wait_state(LENDEE, "shut off")
            fault.watcher.settle()  # its stop seen as deliberate before libvirtd goes
            power_cut(lab)
            assert not qemu_pids(lab)
            state = lab.root / "var-lib-hostagent" / "state.toml"
            saved = state.read_text()
            assert re.search(r'^boot_id = "', saved, re.M), saved
            state.write_text(re.sub(r'^boot_id = ".*"$', f'boot_id = "{uuid.uuid4()}"',
                                    saved, flags=re.M))
            lab.write_config(text.replace('[owners.gaming1]\ngpus = ["gpu-a"]\n',
                                          '[owners.gaming1]\ngpus = ["gpu-a"]\n'
                                          "start_at_boot = true\n"))
            # Boot (recovery counts from here): libvirtd (nothing autostarts), then
            # hostagent.
            fault.fault()
            lab.start_libvirtd()
            assert lab.running() == []
        booted_us = time.time_ns() // 1000
        boots_before = fault.boots(LENDEE)
        lab.start_agent()
        lab.wait_game("gaming1", up=True)  # booted: its console's count is final
        wait_for(lambda: lab.status()["lendee"]["phase"] == "lent", 90, "the lend at boot")
        wait_for(lambda: not cordoned(kc), 30, "the node uncordoned")
        fault.recovered()
        assert marker(kc) is None
        # The host's boot started gaming1 alone; the lendee's own boot records (the
        # API still showing its former boot, then this boot's kubelet posting) may come
        # too: the real kubelet posts a moment after the guest agent answers.
        assert [r["HOSTAGENT_VM"] for r in lab.records(event="boot")
                if r["HOSTAGENT_VM"] != LENDEE] == ["gaming1"]
        assert counted(lab, 1, event="intent", to="done", vm="gaming1") == 1
        live = gpus_in_xml(lab.virsh("dumpxml", LENDEE).stdout)
        assert live == {"gpu-b", "gpu-c"}, live
        lendee_boots = fault.boots(LENDEE) - boots_before
        reclaims = [r for r in lab.records(event="phase", to="draining")
                    if int(r["__REALTIME_TIMESTAMP"]) >= booted_us]
        boots = (fault.boots("gaming1"), fault.boots(LENDEE))

        # hostagent restarted on the same boot: gaming1 is not started again.
        assert lab.stop_agent() == 0
        lab.start_agent()
        wait_for(lambda: lab.status()["lendee"]["phase"] == "lent", 30, "the agent back")
        assert count(lab, event="boot", vm="gaming1") == 1
        assert (fault.boots("gaming1"), fault.boots(LENDEE)) == boots
        assert sorted(lab.running()) == ["gaming1", LENDEE]
    # The first lend after the boot left gaming1's GPU out: one boot, no reclaim.
    assert (lendee_boots, [r["MESSAGE"] for r in reclaims]) == (1, [])
