"""The lab's kubelet for a machine that starts and stops (tests/controlplane/machine.py),
against the real control plane: what it posts follows the machine, and what the
plugins publish follows the GPUs the machine says it sees."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kubernetes_asyncio import client, config
from kubernetes_asyncio import watch as k8s_watch

from tests import waiting
from tests.controlplane import ControlPlane
from tests.controlplane.machine import Kubelet, Look
from tests.controlplane.nvidia import DRIVER

NODE = "machine-node"
UUID_A = "GPU-7a1c0de5-0000-4000-8000-00000000000a"
UUID_B = "GPU-7a1c0de5-0000-4000-8000-00000000000b"
START = 1.0  # seconds from the machine's start to its kubelet's


class Machine:
    """What the kubelet is asked: does the machine run, which GPUs does it see, which
    boot is it (a new id at each `start`)."""

    def __init__(self) -> None:
        self.on = False
        self.gpus: list[tuple[str, str]] = []
        self.boot = ""
        self.started_at = 0.0

    def start(self) -> str:
        self.boot, self.started_at = str(uuid.uuid4()), time.monotonic()
        self.on = True
        return self.boot


def get(plane: ControlPlane, *args: str) -> Any:
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def ready(plane: ControlPlane) -> str:
    node = get(plane, "node", NODE)
    return next((c["status"] for c in node["status"].get("conditions") or []
                 if c["type"] == "Ready"), "")


def uuids(plane: ControlPlane) -> list[str]:
    slices = get(plane, "resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
    return sorted(d["attributes"]["uuid"]["string"] for s in slices for d in s["spec"]["devices"])


async def until(check: Callable[[], bool], what: str, timeout: float = waiting.BOUND) -> None:
    """tests.waiting.until for a check that runs kubectl: in a thread (it blocks), asked
    every 0.2 s (a process each time)."""
    await waiting.until(lambda: asyncio.to_thread(check), what, timeout=timeout, every=0.2)


async def looks(kubelet: Kubelet, count: int) -> list[Look]:
    """The next `count` looks the kubelet takes at its machine, begun after this call,
    once they are over. It takes one look at a time, so once the first of them is over
    so is every look begun before."""
    after = kubelet.looked + 1  # the look under way now, if one is: begun before

    def taken() -> list[Look] | None:
        later = [look for look in kubelet.looks if look.n > after][:count]
        return later if len(later) == count else None
    found: list[Look] = await waiting.until(taken, f"{count} more looks of the kubelet "
                                                    "at its machine")
    return found


async def turn_off(vm: Machine, kubelet: Kubelet) -> None:
    """The machine off, once its kubelet has seen it off: every look begun while the
    machine ran, and what that look posted, is over."""
    vm.on = False
    assert [look.machine for look in await looks(kubelet, 1)] == ["off"]


@pytest.fixture
async def machine(plane: ControlPlane, request: pytest.FixtureRequest
                  ) -> AsyncIterator[tuple[Machine, Kubelet]]:
    vm = Machine()
    credential = plane.credential(f"kubelet-{NODE}", f"system:node:{NODE}", "system:nodes")
    dra = request.param == "dra"
    kubelet = Kubelet(credential, NODE, running=lambda: vm.on, plugins=plane.admin,
                      boot_id=lambda: vm.boot or None, start_delay=START,
                      ready_delay=0.5, gpu_delay=0.1, gpu_recheck=0.2,
                      **({"devices_seen": lambda: list(vm.gpus)} if dra
                         else {"gpus_seen": lambda: len(vm.gpus)}))
    try:
        async with kubelet:
            yield vm, kubelet
    finally:
        for args in (("resourceslices", "--all"), ("pods", "--all", "--force",
                                                    "--grace-period=0"), ("node", NODE),
                     ("lease", "-n", "kube-node-lease", NODE)):
            await asyncio.to_thread(plane.kubectl, "delete", *args, "--ignore-not-found")


@pytest.mark.parametrize("machine", ["device plugin"], indirect=True)
async def test_the_node_follows_the_machine(plane: ControlPlane,
                                            machine: tuple[Machine, Kubelet]) -> None:
    vm, kubelet = machine
    assert ready(plane) == "False"  # registered, as a node whose machine is off
    vm.gpus = [(UUID_A, "A"), (UUID_B, "B")]
    vm.start()
    await until(lambda: ready(plane) == "True", "Ready once the machine runs")
    await until(lambda: get(plane, "node", NODE)["status"]["allocatable"].get(
        "nvidia.com/gpu") == "2", "two GPUs allocatable")
    lease = get(plane, "lease", "-n", "kube-node-lease", NODE)
    assert lease["spec"]["holderIdentity"] == NODE
    vm.gpus = vm.gpus[:1]
    await until(lambda: get(plane, "node", NODE)["status"]["allocatable"].get(
        "nvidia.com/gpu") == "1", "one GPU once the machine sees one")
    await turn_off(vm, kubelet)
    renewed = get(plane, "lease", "-n", "kube-node-lease", NODE)["spec"]["renewTime"]
    heartbeat = next(c["lastHeartbeatTime"] for c in get(plane, "node", NODE)["status"][
        "conditions"] if c["type"] == "Ready")
    # A kubelet whose machine is off posts nothing: two more looks, and the API as it was.
    assert [(look.machine, look.wrote) for look in await looks(kubelet, 2)] == [("off", ())] * 2
    assert get(plane, "lease", "-n", "kube-node-lease", NODE)["spec"]["renewTime"] == renewed
    assert next(c["lastHeartbeatTime"] for c in get(plane, "node", NODE)["status"][
        "conditions"] if c["type"] == "Ready") == heartbeat
    vm.start()  # a boot: NotReady once its kubelet starts, then Ready again
    await until(lambda: ready(plane) == "False", "NotReady when the machine boots again")
    await until(lambda: ready(plane) == "True", "Ready after the boot")


@pytest.mark.parametrize("machine", ["dra"], indirect=True)
async def test_a_dra_node_publishes_what_the_machine_sees(
        plane: ControlPlane, machine: tuple[Machine, Kubelet]) -> None:
    vm, kubelet = machine
    vm.gpus = [(UUID_A, "A"), (UUID_B, "B")]
    vm.start()
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
    await turn_off(vm, kubelet)
    assert [(look.machine, look.wrote) for look in await looks(kubelet, 2)] == [("off", ())] * 2
    assert uuids(plane) == [UUID_B]
    vm.gpus = []
    vm.start()
    await until(lambda: uuids(plane) == [], "the last boot's slices gone after a boot")


# --- a boot, as the real kubelet goes through it ----------------------------------------------


class Versions:
    """Every version of the node from now on, as a watch sees them."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, dict[str, Any]]] = []  # (monotonic time, node)
        self.reading = asyncio.Event()  # set once the version to follow from is read

    async def follow(self, plane: ControlPlane) -> None:
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(plane.admin),
                                      client_configuration=configuration)
        async with client.ApiClient(configuration) as api:
            core = client.CoreV1Api(api)
            since = (await core.read_node(NODE)).metadata.resource_version
            self.reading.set()
            async with k8s_watch.Watch() as stream:
                async for event in stream.stream(
                        core.list_node, field_selector=f"metadata.name={NODE}",
                        resource_version=since, timeout_seconds=60):
                    self.seen.append((time.monotonic(),
                                      api.sanitize_for_serialization(event["object"])))


def status_of(node: dict[str, Any]) -> tuple[str, str, str | None, str | None]:
    """(bootID, Ready, allocatable GPUs, capacity GPUs) of a node version."""
    status = node["status"]
    ready = next((c["status"] for c in status.get("conditions") or []
                  if c["type"] == "Ready"), "")
    return (status.get("nodeInfo", {}).get("bootID", ""), ready,
            status.get("allocatable", {}).get("nvidia.com/gpu"),
            status.get("capacity", {}).get("nvidia.com/gpu"))


@pytest.mark.parametrize("machine", ["device plugin"], indirect=True)
async def test_a_reboot_keeps_the_last_boots_status_until_the_kubelet_starts(
        plane: ControlPlane, machine: tuple[Machine, Kubelet]) -> None:
    """The previous boot's Ready and GPUs stay until the new kubelet's first post, which
    brings a new bootID, NotReady and 0 GPUs (capacity too) until the plugin registers."""
    vm, kubelet = machine
    vm.gpus = [(UUID_A, "A"), (UUID_B, "B")]
    first = vm.start()
    await until(lambda: status_of(get(plane, "node", NODE)) == (first, "True", "2", "2"),
                "this boot's id, Ready and both GPUs")
    await turn_off(vm, kubelet)
    versions = Versions()
    watching = asyncio.create_task(versions.follow(plane))
    try:
        async with asyncio.timeout(10):
            await versions.reading.wait()
        second = vm.start()
        await until(lambda: status_of(get(plane, "node", NODE)) == (second, "True", "2", "2"),
                    "the new boot's id, Ready and both GPUs again")
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    assert first != second and kubelet.boots[-2:] == [first, second]
    states = [(t, status_of(n)) for t, n in versions.seen]
    posted = next(t for t, (boot, *_) in states if boot == second)
    assert posted - vm.started_at >= START  # nothing before the kubelet started
    assert all(s == (first, "True", "2", "2") for t, s in states if t < posted)
    this_boot = [s for _, s in states if s[0] == second]
    assert this_boot[0] == (second, "False", "0", "0")  # the checkpoint: 0 until registered
    assert this_boot.index((second, "True", "2", "2")) > 0


def pod(name: str, gpus: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeName": NODE, "restartPolicy": "Never", "containers": [{
            "name": "job", "image": "registry.lab/job:1",
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def pod_status(plane: ControlPlane, name: str) -> tuple[str, str, str]:
    status = get(plane, "pod", name)["status"]
    return status.get("phase", ""), status.get("reason", ""), status.get("message", "")


@pytest.mark.parametrize("machine", ["device plugin"], indirect=True)
async def test_a_pod_beyond_the_registered_gpus_fails_admission(
        plane: ControlPlane, machine: tuple[Machine, Kubelet]) -> None:
    vm, kubelet = machine
    vm.gpus = [(UUID_A, "A")]
    vm.start()
    await until(lambda: get(plane, "node", NODE)["status"]["allocatable"].get(
        "nvidia.com/gpu") == "1", "the plugin registered one GPU")
    plane.kubectl("create", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [pod("holds-one", 1),
                                                       pod("wants-two", 2)]}))
    await until(lambda: pod_status(plane, "holds-one")[0] == "Running", "one GPU: admitted")
    await until(lambda: pod_status(plane, "wants-two")[0] == "Failed", "two GPUs: rejected")
    assert pod_status(plane, "wants-two")[1:] == (
        "UnexpectedAdmissionError", "Pod was rejected: Allocate failed due to requested "
        "number of devices unavailable for nvidia.com/gpu. Requested: 2, Available: 0, "
        "which is unexpected")  # the one GPU is holds-one's, admitted first (by name)
    # A reboot: the kubelet admits the pod bound to it again, before the plugin registers.
    await turn_off(vm, kubelet)
    vm.start()
    await until(lambda: pod_status(plane, "holds-one")[0] == "Failed",
                "the pod of the last boot rejected by the new kubelet")
    assert pod_status(plane, "holds-one")[1:] == (
        "UnexpectedAdmissionError", "Pod was rejected: Allocate failed due to no healthy "
        "devices present; cannot allocate unhealthy devices nvidia.com/gpu, which is "
        "unexpected")
