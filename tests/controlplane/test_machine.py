"""The lab's kubelet for a machine that starts and stops (tests/controlplane/machine.py),
against the real control plane: what it posts follows the machine, and what the
plugins publish follows the GPUs the machine says it sees."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.controlplane import ControlPlane
from tests.controlplane.machine import Kubelet
from tests.controlplane.nvidia import DRIVER

NODE = "machine-node"
UUID_A = "GPU-7a1c0de5-0000-4000-8000-00000000000a"
UUID_B = "GPU-7a1c0de5-0000-4000-8000-00000000000b"


class Machine:
    """What the kubelet is asked: does the machine run, which GPUs does it see."""

    def __init__(self) -> None:
        self.on = False
        self.gpus: list[tuple[str, str]] = []


def get(plane: ControlPlane, *args: str) -> Any:
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def ready(plane: ControlPlane) -> str:
    node = get(plane, "node", NODE)
    return next((c["status"] for c in node["status"].get("conditions") or []
                 if c["type"] == "Ready"), "")


def uuids(plane: ControlPlane) -> list[str]:
    slices = get(plane, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    return sorted(d["attributes"]["uuid"]["string"] for s in slices for d in s["spec"]["devices"])


async def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def machine(plane: ControlPlane, request: pytest.FixtureRequest
                  ) -> AsyncIterator[tuple[Machine, Kubelet]]:
    vm = Machine()
    credential = plane.credential(f"kubelet-{NODE}", f"system:node:{NODE}", "system:nodes")
    dra = request.param == "dra"
    kubelet = Kubelet(credential, NODE, running=lambda: vm.on, plugins=plane.admin,
                      ready_delay=0.5, gpu_delay=0.1, gpu_recheck=0.2,
                      **({"devices_seen": lambda: list(vm.gpus)} if dra
                         else {"gpus_seen": lambda: len(vm.gpus)}))
    try:
        async with kubelet:
            yield vm, kubelet
    finally:
        for args in (("resourceslices", "--all"), ("node", NODE),
                     ("lease", "-n", "kube-node-lease", NODE)):
            await asyncio.to_thread(plane.kubectl, "delete", *args, "--ignore-not-found")


@pytest.mark.parametrize("machine", ["device plugin"], indirect=True)
async def test_the_node_follows_the_machine(plane: ControlPlane,
                                            machine: tuple[Machine, Kubelet]) -> None:
    vm, _ = machine
    assert ready(plane) == "False"  # registered, as a node whose machine is off
    vm.gpus = [(UUID_A, "A"), (UUID_B, "B")]
    vm.on = True
    await until(lambda: ready(plane) == "True", "Ready once the machine runs")
    await until(lambda: get(plane, "node", NODE)["status"]["allocatable"].get(
        "nvidia.com/gpu") == "2", "two GPUs allocatable")
    lease = get(plane, "lease", "-n", "kube-node-lease", NODE)
    assert lease["spec"]["holderIdentity"] == NODE
    vm.gpus = vm.gpus[:1]
    await until(lambda: get(plane, "node", NODE)["status"]["allocatable"].get(
        "nvidia.com/gpu") == "1", "one GPU once the machine sees one")
    vm.on = False
    await asyncio.sleep(0.5)  # the look the kubelet may have begun before, over
    renewed = get(plane, "lease", "-n", "kube-node-lease", NODE)["spec"]["renewTime"]
    heartbeat = next(c["lastHeartbeatTime"] for c in get(plane, "node", NODE)["status"][
        "conditions"] if c["type"] == "Ready")
    await asyncio.sleep(1.5)  # a kubelet whose machine is off posts nothing
    assert get(plane, "lease", "-n", "kube-node-lease", NODE)["spec"]["renewTime"] == renewed
    assert next(c["lastHeartbeatTime"] for c in get(plane, "node", NODE)["status"][
        "conditions"] if c["type"] == "Ready") == heartbeat
    vm.on = True  # a boot: NotReady at once, then Ready again
    await until(lambda: ready(plane) == "False", "NotReady when the machine boots again")
    await until(lambda: ready(plane) == "True", "Ready after the boot")


@pytest.mark.parametrize("machine", ["dra"], indirect=True)
async def test_a_dra_node_publishes_what_the_machine_sees(
        plane: ControlPlane, machine: tuple[Machine, Kubelet]) -> None:
    vm, _ = machine
    vm.gpus = [(UUID_A, "A"), (UUID_B, "B")]
    vm.on = True
    await until(lambda: uuids(plane) == [UUID_A, UUID_B], "both GPUs in the node's slice")
    node = get(plane, "node", NODE)
    assert "nvidia.com/gpu" not in node["status"].get("allocatable", {})
    (found,) = get(plane, "resourceslices", "--field-selector",
                   f"spec.nodeName={NODE}")["items"]
    assert found["spec"]["driver"] == DRIVER and found["spec"]["pool"]["name"] == NODE
    assert found["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
    vm.gpus = vm.gpus[1:]
    await until(lambda: uuids(plane) == [UUID_B], "the slice without the GPU gone")
    # Off, the slices stay as the last boot left them; the next boot starts afresh.
    vm.on = False
    await asyncio.sleep(1)
    assert uuids(plane) == [UUID_B]
    vm.gpus = []
    vm.on = True
    await until(lambda: uuids(plane) == [], "the last boot's slices gone after a boot")
