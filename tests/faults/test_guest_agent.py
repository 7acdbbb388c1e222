"""A lendee whose guest agent never comes up: nothing is destroyed, nothing forgotten."""

from __future__ import annotations

import pytest

from tests.faults.scenario import Scenario, config, count
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


def test_guest_agent_never_up(lab: Lab, fault: Scenario) -> None:
    """guest agent never up: FAILED with a screenshot, no destroy, the request waits"""
    lab.define("gpu-node", agent_delay=600)
    config(lab, guest_agent="3s")
    lab.start_agent()
    # Booted, but its agent never answered: not lent, and left running.
    failed = lab.wait_record(30, event="phase", to="failed")
    assert failed["HOSTAGENT_FROM"] == "booting" and failed["PRIORITY"] == "3"
    # The one witness of a dead boot, its screen, is kept and named in an error record.
    boot = lab.wait_record(event="boot", result="failed")
    assert boot["PRIORITY"] == "3"
    screen = lab.path(boot["HOSTAGENT_SCREENSHOT"])
    assert screen.stat().st_size > 0 and str(screen.name) in boot["MESSAGE"]
    refused = fault.start_owner("gaming1")
    assert refused.returncode != 0 and "is stuck" in refused.stderr
    fault.fault()
    # The player's request retried the reclaim, which waited for the agent in vain.
    lab.wait_records(2, 30, event="phase", to="failed")
    assert lab.phases()[-3:] == ["failed>draining", "draining>stopping", "stopping>failed"]
    assert lab.state("gpu-node") == "running" and lab.state("gaming1") == "shut off"
    assert fault.shutdowns("gpu-node") == 0
    st = lab.status()
    assert st["lendee"]["phase"] == "failed"
    assert "guest agent never answered" in st["lendee"]["reason"]
    assert "force_off_after" in st["lendee"]["reason"]  # and how to unblock it
    assert [i["owner"] for i in st["intents"]] == ["gaming1"]
    assert count(lab, event="intent", to="failed") == 0
    text = lab.hostagent("status")
    assert "gaming1 (asked via hook" in text.stdout and "reason:" in text.stdout
    # A human powers it off as the reason says: the waiting game starts by itself.
    with fault.deliberate():
        lab.virsh("destroy", "gpu-node")
        lab.wait_game("gaming1")
    fault.recovered()
    assert lab.status()["intents"] == []
