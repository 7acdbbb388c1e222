"""The agent SIGKILLed at each step of a reclaim and of a lend, then restarted.

Each step is held open on purpose, so that the kill lands in it every time: a slow
guest agent (`agent_delay`) holds BOOTING and the reclaim's wait for the agent, a slow
`qemu.d` hook holds libvirtd half-way through a start or a stop, and a GPU the guest's
driver does not find yet holds the check of the GPUs. The Kubernetes steps (cordoning,
draining, waiting Ready, uncordoning) are in test_kubernetes.py.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.faults.scenario import (
    Scenario,
    count,
    kill_agent,
    wait_for,
    wait_lent,
)
from tests.lab.lab import GPUS, Lab

pytestmark = pytest.mark.lab

RECLAIM_STEPS = ["waiting for the guest agent", "shutting down", "starting the owner"]
LEND_STEPS = ["starting the lendee", "booting", "verifying the GPUs"]


@pytest.mark.parametrize("step", RECLAIM_STEPS)
def test_reclaim(lab: Lab, fault: Scenario, step: str) -> None:
    """agent SIGKILLed while reclaiming: {step}"""
    if step == "waiting for the guest agent":
        lab.define("gpu-node", agent_delay=3)
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    if step == "waiting for the guest agent":
        lab.wait_record(event="phase", to="booting")
    else:
        wait_lent(lab)
    hold = {"shutting down": ("gpu-node", "stopped", "end"),
            "starting the owner": ("gaming1", "start", "begin")}.get(step)
    with fault.slow_hook(*hold) if hold else contextlib.nullcontext() as held:
        assert fault.start_owner("gaming1").returncode != 0  # deferred
        if held is None:
            lab.wait_record(event="phase", to="stopping")
        else:
            wait_for(held.exists, 60, f"libvirtd to be held in {' '.join(hold or ())}")
        kill_agent(lab)
        fault.fault()
        # The kill landed in the step it was meant for.
        agent_up = "starting qemu-ga" in fault.console("gpu-node")
        assert agent_up is (step != "waiting for the guest agent")
        assert fault.shutdowns("gpu-node") == (0 if step == "waiting for the guest agent" else 1)
        if step == "starting the owner":
            assert lab.phases()[-1] == "stopping>off"
        saved = (lab.root / "var-lib-hostagent" / "state.toml").read_text()
        assert 'owner = "gaming1"' in saved  # persisted before the hook heard "defer"
        lab.start_agent()
    lab.wait_game("gaming1")
    lab.wait_records(1, event="intent", to="done", vm="gaming1")
    fault.recovered()
    assert lab.state("gpu-node") == "shut off"
    assert fault.shutdowns("gpu-node") == 1  # through its agent, once
    assert lab.status()["intents"] == []


@pytest.mark.parametrize("step", LEND_STEPS)
def test_lend(lab: Lab, fault: Scenario, step: str) -> None:
    """agent SIGKILLed while lending: {step}"""
    if step == "booting":
        lab.define("gpu-node", agent_delay=3)
    if step == "verifying the GPUs":
        # The driver finds nothing on gpu-b: the check retries until verify.timeout.
        lab.write_gpu("gpu-b", "NOT A GPU")
    lab.write_config(relend_delay="1s")
    hold = ("gpu-node", "start", "begin") if step == "starting the lendee" else None
    with fault.slow_hook(*hold) if hold else contextlib.nullcontext() as held:
        lab.start_agent()
        if held is not None:
            wait_for(held.exists, 60, "libvirtd to be held in gpu-node's start")
        else:
            lab.wait_record(event="phase", to="booting" if step == "booting" else "joining")
        if step == "verifying the GPUs":
            time.sleep(2)  # checks have failed (0.25 s, then at most 1 s apart): kill mid-way
        kill_agent(lab)
        fault.fault()
        if step == "verifying the GPUs":
            assert lab.phases() == ["off>booting", "booting>joining"]
            assert count(lab, event="verify") == 0  # still checking
            uuid, name = GPUS["gpu-b"]
            lab.write_gpu("gpu-b", f"LABGPU {uuid} {name}")  # the driver loads, late
            lab.guest_exec("gpu-node", "/bin/sh", "-c", "echo 3 > /proc/sys/vm/drop_caches")
        else:
            assert "starting qemu-ga" not in fault.console("gpu-node")  # still booting
            assert lab.phases() == ([] if held else ["off>booting"])
        lab.start_agent()
    wait_lent(lab)
    fault.recovered()
    assert lab.state("gpu-node") == "running"
    assert fault.boots("gpu-node") == 1  # started once
    assert count(lab, event="phase", to="failed") == 0

