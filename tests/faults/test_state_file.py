"""A state file the agent cannot read at start: kept aside, rebuilt from reality, loudly."""

from __future__ import annotations

import pytest

from tests.faults.scenario import Scenario, wait_lent
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

VALID = b"""\
version = 1
cordoned_by_us = false
hold = false
lendee_phase = "stopping"
lendee_phase_since = 2026-01-10T20:15:02.125000+00:00

[[intents]]
id = "0b9e2c7a"
owner = "gaming1"
created = 2026-01-10T20:15:01.998000+00:00
source = "hook"
status = "pending"
"""
BROKEN = {
    # A write cut short (what the atomic replace exists to prevent): mid-string.
    "truncated": VALID[:VALID.index(b'owner = "gam') + len(b'owner = "gam')],
    "garbage": b"\x00\x89PNG\r\n\x1a\n\xff\xfe not toml at all [[[",
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_state_file(lab: Lab, fault: Scenario, how: str) -> None:
    """state file {how} at start: kept aside, rebuilt, said loudly"""
    state = lab.root / "var-lib-hostagent" / "state.toml"
    state.write_bytes(BROKEN[how])
    lab.write_config(relend_delay="1s")
    fault.fault()
    lab.start_agent()
    wait_lent(lab)
    fault.recovered()
    record = lab.wait_record(event="state")
    assert record["HOSTAGENT_RESULT"] == "rebuilt" and record["PRIORITY"] == "3"
    assert "was moved to" in record["MESSAGE"] and "are lost" in record["MESSAGE"]
    kept = list(state.parent.glob("state.toml.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == BROKEN[how]
    assert "lendee_phase" in state.read_text()  # a new, whole one
