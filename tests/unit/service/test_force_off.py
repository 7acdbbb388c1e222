"""The executor's power-off of the lendee: the journal says why in plain words, the
machine's own reason where a guest stuck letting a GPU go is powered off without
``force_off_after`` (tests/unit/core/test_live.py decides when), and the lendee stops."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hostagent.core.model import ForceOff, Hold
from hostagent.host import journal
from hostagent.host.libvirt import HostError
from tests.waiting import until
from tests.unit.agents import lent, make_agent

STUCK = ("gpu-node did not shut down after its driver hung letting a GPU go; powering it "
         "off now that its node is drained, so that gaming1 can start")


async def test_a_stuck_guest_is_powered_off_at_once_with_the_machines_reason(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    agent.apply(Hold(at=time.time()))  # no relend after the stop: the test ends there
    agent.executor.execute(ForceOff(ticket=agent.state.ticket, reason=STUCK))
    await until(lambda: "gpu-node" not in fake.running)
    [said] = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "force-off"]
    assert said.message == STUCK  # no force_off_after is set, and none is cited


async def test_the_policys_power_off_cites_force_off_after(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    agent.apply(Hold(at=time.time()))  # no relend after the stop: the test ends there
    agent.executor.execute(ForceOff(ticket=agent.state.ticket))
    await until(lambda: "gpu-node" not in fake.running)
    [said] = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "force-off"]
    assert said.message == ("gpu-node did not shut down: forcing it off in 0s as "
                            "policy.force_off_after allows")


async def test_a_power_off_that_fails_says_the_gpus_stay_held(
        tmp_path: Path, sink: journal.ListSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QEMU hung in the kernel letting a device go cannot be destroyed: the journal
    says so and what is left to do, rather than nothing while a player waits."""
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    agent.apply(Hold(at=time.time()))  # no relend after the stop: the test ends there

    async def refuses(name: str) -> None:
        raise HostError(f"Failed to terminate process 4242 with SIGKILL: {name} busy")

    monkeypatch.setattr(fake, "destroy", refuses)
    agent.executor.execute(ForceOff(ticket=agent.state.ticket, reason=STUCK))
    await until(lambda: any(e.fields.get("HOSTAGENT_RESULT") == "failed"
                            for e in sink.entries))
    [failed] = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "failed"]
    assert failed.message == (
        "gpu-node could not be powered off: Failed to terminate process 4242 with SIGKILL: "
        "gpu-node busy; its GPUs stay held until it stops (virsh destroy gpu-node, else a "
        "host reboot)")
    assert "gpu-node" in fake.running
