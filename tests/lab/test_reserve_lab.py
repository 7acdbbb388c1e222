"""A reservation end to end, with the real agent, hook, libvirtd, guests and journald:
`hostagent reserve gaming1 --at T` seconds ahead; before T gpu-node gives its GPUs back
(agent shutdown; the machine's tests show the relend with the rest) and nobody starts
gaming1; at T `virsh start gaming1` is let through at once; the journal says each step
(from T on, unused, the reservation yields to another owner), and the reservation is used. (The lead and margin are the lab's: seconds.)"""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from tests.lab.lab import Lab
from tests.lab.helpers import wait_lent

pytestmark = pytest.mark.lab


def test_a_reserved_game_finds_its_gpu_free_and_starts_at_once(lab: Lab) -> None:
    lab.write_config(lab.config_text().replace(
        "[policy]\n", '[policy]\nreserve_lead = "30s"\nreserve_margin = "15s"\n'))
    lab.start_agent()
    wait_lent(lab)
    at = datetime.fromtimestamp(int(time.time()) + 25).astimezone()
    asked = lab.hostagent("reserve", "gaming1", "--at", at.isoformat())
    assert asked.returncode == 0, asked.stderr
    assert "gaming1 is reserved for" in asked.stdout
    bad = lab.hostagent("reserve", "gaming1", "--at", "2001-01-01T20:00")
    assert bad.returncode == 1 and "has passed" in bad.stderr
    listed = json.loads(lab.hostagent("status", "--json").stdout)["reservations"]
    assert [r["vm"] for r in listed] == ["gaming1"]
    # The notice at once (the lead is longer than what is left), the hold 15 s before T,
    # then the reclaim: gpu-node shuts down, and nobody starts gaming1.
    lab.wait_record(30, event="reserve", result="holding")
    lab.wait_record(30, event="phase", to="off")
    assert lab.state("gaming1") != "running"
    while time.time() < at.timestamp():
        time.sleep(0.2)
    started = lab.ask("gaming1")
    assert started.returncode == 0, started.stderr  # let through at once: its GPU is free
    lab.wait_game("gaming1")
    lab.wait_record(30, event="reserve", result="used")
    results = [r["HOSTAGENT_RESULT"] for r in lab.records(event="reserve")]
    # From T on, still unused, it yields (another owner of gpu-a could start): the journal
    # says so, unless gaming1's start came first.
    assert [r for r in results if r != "yielding"] == ["reserved", "notice", "holding", "used"]
    assert results.count("yielding") <= 1, results
    assert json.loads(lab.hostagent("status", "--json").stdout)["reservations"] == []
