"""Players and administrators acting at the same time as the agent."""

from __future__ import annotations

import threading
import time

import pytest

from tests.faults.scenario import Scenario, counted, wait_for, wait_lent
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


def test_two_owners_within_100ms(lab: Lab, fault: Scenario) -> None:
    """two owners started within 100 ms: one reclaim serves both"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    results = {}

    def start(vm: str) -> None:
        results[vm] = fault.start_owner(vm)

    threads = [threading.Thread(target=start, args=(vm,)) for vm in ("gaming1", "gaming2")]
    fault.fault()
    for t in threads:
        t.start()
        time.sleep(0.05)  # the second press 50 ms after the first: the scenario's spacing
    for t in threads:
        t.join()
    assert all(r.returncode != 0 for r in results.values())
    lab.wait_game("gaming1")
    lab.wait_game("gaming2")
    fault.recovered()
    assert lab.phases().count("lent>draining") == 1
    assert fault.shutdowns("gpu-node") == 1
    assert counted(lab, 2, event="intent", to="done") == 2


def test_owner_while_the_lendee_boots(lab: Lab, fault: Scenario) -> None:
    """owner started while the lendee boots: waits for its guest agent"""
    lab.define("gpu-node", agent_delay=3)
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    fault.fault()
    assert fault.start_owner("gaming1").returncode != 0
    lab.wait_game("gaming1")
    fault.recovered()
    console = fault.console("gpu-node")
    assert console.index("starting qemu-ga") < console.index("lab guest: shutdown")


# After each stop the player waits this long before starting again: mostly not at all
# (the lendee stays off within the relend delay), twice long enough to meet the lendee
# starting (1.1 s, just after the 1 s relend) or booting (1.6 s).
PAUSES = [0.0] * 20
PAUSES[6], PAUSES[13] = 1.1, 1.6


def test_owner_started_and_stopped_20_times(lab: Lab, fault: Scenario) -> None:
    """owner started and stopped 20 times in a row: bounded, ends lent"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    deferred = 0
    for i in range(20):
        out = fault.start_owner("gaming1")
        if out.returncode != 0:
            deferred += 1
            lab.wait_game("gaming1")
        lab.virsh("destroy", "gaming1")  # the player pulls the plug
        time.sleep(PAUSES[i])
    fault.fault()  # the storm is over: from its end to the lendee lent again
    wait_lent(lab, timeout=60)
    fault.recovered()
    assert deferred >= 2  # the pauses met the lendee starting and booting
    assert counted(lab, deferred, event="intent", to="done") == deferred
    assert lab.status()["intents"] == []
    assert lab.state("gpu-node") == "running"


def test_lendee_started_by_hand_mid_game(lab: Lab, fault: Scenario) -> None:
    """lendee started by hand mid-game: deferred; lent after the game"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    assert fault.start_owner("gaming1").returncode != 0
    lab.wait_game("gaming1")
    fault.fault()
    refused = lab.virsh("start", "gpu-node", check=False)
    assert refused.returncode != 0
    assert "gpu-node's GPUs are in use by gaming1" in refused.stderr
    assert lab.state("gaming1") == "running" and lab.state("gpu-node") == "shut off"
    lab.virsh("destroy", "gaming1")  # the game ends
    wait_lent(lab)
    fault.recovered()
    wait_for(lambda: lab.status()["relend_in_s"] is None, 10, "no relend left")
