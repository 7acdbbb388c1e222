"""The hook when the agent is absent, hung, or when even the spool cannot be written.

Whatever the agent does, the hook answers libvirtd within its budget (0.3 s) and lets
the start go on (fail-open: the lab's disk locks, like vfio, refuse a device in use).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.faults.scenario import Scenario, count, wait_lent
from tests.lab.lab import HOOK, Lab

pytestmark = pytest.mark.lab

BUDGET = 0.3


def log_lines(lab: Lab, text: str) -> int:
    return sum(text in e.get("MESSAGE", "") for e in lab.records())


def test_agent_absent(lab: Lab, fault: Scenario) -> None:
    """hook, agent absent: events spooled, replayed exactly once"""
    lab.write_config(relend_delay="1s")
    fault.fault()
    lab.virsh("start", "gaming1")  # nobody answers: the start goes on
    lab.virsh("destroy", "gaming1")
    spooled = sorted(lab.spool.glob("*.json"))
    assert len(spooled) == 5  # prepare, start, started; stopped, release
    lab.start_agent()
    wait_lent(lab)
    fault.recovered()
    assert not list(lab.spool.glob("*.json"))
    assert log_lines(lab, "replayed 5 hook event(s)") == 1
    assert log_lines(lab, "while the agent was down: gaming1") == 5
    # Started again: nothing is left to replay, nothing is handled twice.
    lab.stop_agent()
    lab.start_agent()
    assert log_lines(lab, "replayed") == 1
    assert log_lines(lab, "while the agent was down: gaming1") == 5
    assert count(lab, event="intent") == 0


def test_agent_hung(lab: Lab, fault: Scenario) -> None:
    """hook, agent hung (SIGSTOP): virsh start within budget, then it catches up"""
    lab.write_config(relend_delay="1s")
    agent = lab.start_agent()
    wait_lent(lab)
    agent.send_signal(signal.SIGSTOP)
    fault.fault()
    try:
        out = lab.ask("gaming1")
        # Fail-open: libvirt tried, and the lendee's lock on gpu-a refused it.
        assert out.returncode != 0 and "lock" in out.stderr, out.stderr
        # `prepare begin` waited for an answer and gave up: spooled. The calls that only
        # inform handed their line over in the agent's socket, which it reads on waking.
        spooled = [json.loads(p.read_text()) for p in lab.spool.glob("*.json")]
        assert [(e["op"], e["sub"]) for e in spooled] == [("prepare", "begin")]
    finally:
        agent.send_signal(signal.SIGCONT)
    # The agent reads what queued while it was stopped, and acts on the player's wish.
    lab.wait_game("gaming1")
    fault.recovered()
    lab.wait_records(1, event="intent", to="done", vm="gaming1")
    assert fault.shutdowns("gpu-node") == 1
    # The spooled copies of those events are not acted on a second time.
    lab.stop_agent()
    lab.start_agent()
    assert not list(lab.spool.glob("*.json"))
    assert count(lab, event="intent", to="pending") == 1
    assert lab.status()["owners"]["gaming1"] is True


UNWRITABLE = ["a file in its place", "a read-only mount"]


@pytest.mark.parametrize("how", UNWRITABLE)
def test_spool_unwritable(lab: Lab, fault: Scenario, how: str) -> None:
    """hook, agent absent and spool unwritable ({how}): exit 0, says why"""
    if how == "a file in its place":
        lab.spool.write_text("not a directory\n")
    else:
        lab.spool.mkdir()
        inside = "/var/lib/hostagent/spool"
        subprocess.run(lab.nsenter("sh", "-c", f"mount --bind {inside} {inside} && "
                                   f"mount -o remount,bind,ro {inside}"), check=True)
    try:
        fault.fault()
        began = time.monotonic()
        hook = subprocess.run(lab.nsenter(str(HOOK), "gaming1", "prepare", "begin", "-"),
                              input=b"<domain/>", capture_output=True, timeout=10)
        took = time.monotonic() - began
        message = hook.stderr.decode()
        assert hook.returncode == 0 and hook.stdout == b""
        assert "agent did not take the event" in message
        assert "spool /var/lib/hostagent/spool unwritable" in message
        assert "event lost" in message
        # Bounds correctness (no hang), not speed: nsenter and an interpreter's start on a
        # busy machine come on top of the budget (the unit tests' margin).
        assert took < BUDGET + 2.0, f"the hook took {took:.2f}s"
        # And libvirt's own run of it lets the start go on.
        lab.virsh("start", "gaming1")
        fault.recovered()
    finally:
        if how == "a read-only mount":
            subprocess.run(lab.nsenter("umount", "/var/lib/hostagent/spool"), check=True)
        else:
            lab.spool.unlink()
