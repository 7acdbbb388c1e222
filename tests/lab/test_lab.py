"""The lab itself: real guests, the private libvirtd, and nothing leaking out of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.lab import leftovers
from tests.lab.lab import GPUS, LIBVIRTD_PATIENCE, REPO, Lab, host_fingerprint, need_lab
from tests.waiting import wait_until

pytestmark = pytest.mark.lab


def test_lendee_boots_answers_ping_and_powers_off_through_its_agent(lab: Lab) -> None:
    lab.virsh("start", "gpu-node")
    lab.wait_agent("gpu-node")
    assert lab.agent("gpu-node", "guest-ping") == {}
    lab.virsh("shutdown", "--mode", "agent", "gpu-node")
    lab.wait_state("gpu-node", "shut off", timeout=30)


def test_an_owner_cannot_start_while_the_lendee_holds_its_gpu(lab: Lab) -> None:
    lab.virsh("start", "gpu-node")
    refused = lab.ask("gaming1")
    assert refused.returncode != 0
    assert "write" in refused.stderr and "lock" in refused.stderr
    assert str(lab.gpu_image("gpu-a")) in refused.stderr
    assert lab.state("gaming1") == "shut off"
    # gaming2's GPU is held too; with the lendee gone both owners start together.
    lab.virsh("destroy", "gpu-node")
    lab.virsh("start", "gaming1")
    lab.virsh("start", "gaming2")
    assert sorted(lab.running()) == ["gaming1", "gaming2"]
    # gaming-win owns gpu-a too: the two owners of one card exclude each other.
    refused = lab.ask("gaming-win")
    assert refused.returncode != 0 and str(lab.gpu_image("gpu-a")) in refused.stderr


def test_the_stand_in_nvidia_smi_reports_the_lab_gpus_or_none(lab: Lab) -> None:
    lab.virsh("start", "gpu-node")
    lab.wait_agent("gpu-node")
    out = lab.guest_exec("gpu-node", "/usr/bin/nvidia-smi", "-L")
    assert out.exitcode == 0
    for uuid, name in GPUS.values():
        assert f"{name} (UUID: {uuid})" in out.stdout
    lab.virsh("destroy", "gpu-node")
    # A GPU whose driver finds nothing: the disk is there, the device is not.
    for gpu in GPUS:
        lab.write_gpu(gpu, "no driver")
    lab.virsh("start", "gpu-node")
    lab.wait_agent("gpu-node")
    out = lab.guest_exec("gpu-node", "/usr/bin/nvidia-smi", "-L")
    assert (out.exitcode, out.stdout.strip()) == (6, "No devices were found")


def test_agent_delay_on_the_kernel_command_line_keeps_the_agent_down(lab: Lab) -> None:
    lab.define("gpu-node", agent_delay=30)
    lab.virsh("start", "gpu-node")
    lab.wait_console("gpu-node", "agent delay 30s")
    assert lab.agent("gpu-node", "guest-ping", timeout=2) is None


def test_the_machines_own_libvirt_journal_and_etc_are_untouched(lab_session: Lab) -> None:
    lab_session.virsh("start", "gaming1")
    lab_session.virsh("destroy", "gaming1")
    assert host_fingerprint() == lab_session.host_before
    assert str(lab_session.root) not in Path("/proc/self/mounts").read_text()
    # ...while the lab's daemon has its own configuration and domains.
    assert (lab_session.root / "etc-libvirt" / "qemu" / "gpu-node.xml").exists()


def test_teardown_leaves_no_process_or_mount_behind() -> None:
    reason = need_lab()
    if reason:
        pytest.skip(reason)
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-lab-")))
    try:
        lab.up()
        lab.virsh("start", "gaming1")
        assert lab.pids_using_lab()
        ns = os.readlink(f"/proc/{lab.holder.pid}/ns/mnt") if lab.holder else None
    finally:
        lab.down()
    assert lab.pids_using_lab() == []
    assert str(lab.root) not in Path("/proc/self/mounts").read_text()
    # No process is left in the lab's mount namespace.
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                assert os.readlink(p / "ns/mnt") != ns
            except OSError:
                pass


def test_teardown_ends_the_guests_of_a_libvirtd_killed_abruptly() -> None:
    """libvirtd daemonizes its guests: killed, it leaves them running (two guests and
    their agent were once found so after a run). The lab's teardown ends them all."""
    reason = need_lab()
    if reason:
        pytest.skip(reason)
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-lab-")))
    try:
        lab.up()
        lab.virsh("start", "gaming1")
        lab.write_config()
        lab.start_agent()
        pidfile = lab.root / "run-libvirt" / "qemu" / "gaming1.pid"
        guest = int(pidfile.read_text())
        assert b"qemu" in Path(f"/proc/{guest}/cmdline").read_bytes()
        lab.procs["libvirtd"].kill()
        lab.procs["libvirtd"].wait(10)
        assert leftovers.running(guest)  # the guest outlives its libvirtd
    finally:
        lab.down()
    assert not leftovers.running(guest)  # gone, or a zombie its new parent has not reaped
    assert lab.pids_using_lab() == []


ABANDONED = """
import os, sys, tempfile
from pathlib import Path
from tests.lab.lab import Lab
lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-lab-")))
lab.up()
lab.virsh("start", "gaming1")
print(lab.root, flush=True)
os._exit(9)  # killed, as by a timeout: no teardown runs
"""


def test_a_lab_whose_test_process_dies_ends_by_itself(tmp_path: Path) -> None:
    """The lab's holder waits on the process that owns the lab: gone without taking the
    lab down, the holder ends every process of it."""
    reason = need_lab()
    if reason:
        pytest.skip(reason)
    # Output to files, not pipes: the lab's processes inherit them, and a pipe kept open
    # would keep the dead process from being reaped, which is what the holder waits for.
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        died = subprocess.run([sys.executable, "-c", ABANDONED], cwd=REPO, stdout=stdout,
                              stderr=stderr, timeout=LIBVIRTD_PATIENCE + 120, check=False)
    assert died.returncode == 9, err.read_text()
    root = Path(out.read_text().strip())
    try:
        wait_until(lambda: leftovers.lab_pids(root) == [], "the abandoned lab to end")
    finally:
        leftovers.end(leftovers.lab_pids(root))


def test_a_dead_or_hung_libvirtd_is_brought_back_by_the_next_reset(
        lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    """A test that leaves libvirtd killed, stopped or hung fails alone: the next test's
    reset starts it again, and says so with libvirtd's log."""
    lab.virsh("start", "gaming2")
    libvirtd = lab.procs["libvirtd"]
    libvirtd.kill()
    libvirtd.wait()
    lab.reset()
    assert lab.procs["libvirtd"] is not libvirtd
    # The new libvirtd found gaming2 still running; reset destroyed it.
    assert lab.running() == []
    assert "libvirtd had exited" in capsys.readouterr().err

    lab.stop_libvirtd()  # as a test that failed before starting it again leaves it
    lab.reset()
    assert lab.state("gpu-node") == "shut off"

    # Hung: it takes connections and answers none.
    hung = lab.procs["libvirtd"]
    os.kill(hung.pid, signal.SIGSTOP)
    lab.libvirtd_patience = 1
    try:
        lab.reset()
    finally:
        lab.libvirtd_patience = LIBVIRTD_PATIENCE
    assert hung.poll() is not None and lab.procs["libvirtd"] is not hung
    err = capsys.readouterr().err
    assert "libvirtd did not answer within" in err and "starting libvirtd again" in err
    assert str(lab.root / "libvirtd.log") in err  # its log, printed
    assert sorted(lab.virsh("list", "--all", "--name").stdout.split()) == sorted(
        ["gpu-node", "gaming1", "gaming2", "gaming-win"])
