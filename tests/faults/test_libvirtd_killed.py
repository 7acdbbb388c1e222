"""libvirtd SIGKILLed mid-cycle and started again: the guests run on, the cycle ends.

A killed libvirtd leaves its QEMU processes running; the new one reconnects to them
(running the `reconnect begin` hook, which must not fail, or libvirt kills the guest).
The agent loses its connection, reconnects with backoff and reads the world again.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.scenario import (
    Scenario,
    alive,
    kill_libvirtd,
    qemu_pid,
    wait_for,
    wait_lent,
)
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


def outage(lab: Lab, fault: Scenario, *guests: str) -> None:
    """libvirtd down for a second; the guests' QEMU processes must outlive it."""
    pids = {g: qemu_pid(lab, g) for g in guests}
    kill_libvirtd(lab)
    fault.fault()
    time.sleep(1)  # the outage's length: libvirtd down for a second
    assert all(alive(pid) for pid in pids.values())
    lab.start_libvirtd()
    for g, pid in pids.items():
        assert lab.state(g) == "running" and qemu_pid(lab, g) == pid, g


def test_mid_reclaim(lab: Lab, fault: Scenario) -> None:
    """libvirtd SIGKILLed mid-reclaim (waiting for the guest agent)"""
    # Long enough that the guest agent cannot come up, and the agent-shutdown go
    # through, before the outage below is over and checked.
    lab.define("gpu-node", agent_delay=8)
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    assert fault.start_owner("gaming1").returncode != 0
    lab.wait_record(event="phase", to="stopping")
    outage(lab, fault, "gpu-node")
    lab.wait_game("gaming1")
    fault.recovered()
    assert lab.state("gpu-node") == "shut off"
    assert fault.shutdowns("gpu-node") == 1
    wait_for(lambda: lab.status()["libvirt_connected"], 30, "the agent to reconnect")


def test_mid_game(lab: Lab, fault: Scenario) -> None:
    """libvirtd SIGKILLed mid-game; the game ends after"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    assert fault.start_owner("gaming1").returncode != 0
    lab.wait_game("gaming1")
    outage(lab, fault, "gaming1")
    wait_for(lambda: lab.status()["libvirt_connected"], 30, "the agent to reconnect")
    fault.recovered()
    assert lab.status()["owners"]["gaming1"] is True
    lab.virsh("destroy", "gaming1")  # the game ends
    wait_lent(lab, timeout=90)
    assert lab.state("gpu-node") == "running"
