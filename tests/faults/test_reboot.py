"""The host loses power mid-reclaim and boots again with an intent on disk."""

from __future__ import annotations

import pytest

from tests.faults.scenario import (
    Scenario,
    power_cut,
    qemu_pids,
    wait_lent,
)
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab


def test_host_rebooted_with_a_pending_intent(lab: Lab, fault: Scenario) -> None:
    """host "rebooted" mid-reclaim: the pending intent is served"""
    lab.define("gpu-node", agent_delay=3)
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    assert fault.start_owner("gaming1").returncode != 0
    lab.wait_record(event="phase", to="stopping")
    with fault.deliberate():
        power_cut(lab)
        fault.fault()
        assert not qemu_pids(lab)
        assert 'owner = "gaming1"' in (lab.root / "var-lib-hostagent" / "state.toml").read_text()
        # Boot: libvirtd, then the agent, as systemd orders them.
        lab.start_libvirtd()  # a fresh /run/libvirt: libvirtd takes seconds here
        assert lab.running() == []
        lab.start_agent()
        lab.wait_game("gaming1")
    fault.recovered()
    assert lab.status()["intents"] == []
    assert len(lab.wait_records(1, event="intent", to="done", vm="gaming1")) == 1
    # The game ends: the GPUs are lent again.
    lab.virsh("destroy", "gaming1")
    wait_lent(lab, timeout=90)
