"""DRA end to end through the real control plane: NVIDIA's driver publishes the node's
GPUs (tests/controlplane/nvidia.py, as k8s-dra-driver-gpu main at 22407113 does), the
real kube-controller-manager makes each pod's ResourceClaim from its template, the real
kube-scheduler allocates it from those slices, reserves it for the pod and binds the
pod to the node, whose kubelet stand-in (tests/controlplane/kubelet.py) starts it; and
hostagent, as its ServiceAccount under deploy/rbac.yaml alone, tells which pod holds
which lent GPU, drains only the pods of a GPU reclaimed live, and counts a GPU its
driver taints unhealthy as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from hostagent.host import journal
from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import Config, parse
from hostagent.core.health import CheckFailed
from tests.controlplane import ControlPlane, dralab
from tests.controlplane.dralab import NODE, Accounts, Lab, dra_lab
from tests.controlplane.nvidia import DRIVER, gpu, health_taint
from tests.configs import UUID_A, UUID_B, lendee_toml
from tests.waiting import until

PREFIX = "hostagent.io/"
LABEL = {"gpu-0": "gpu-a", "gpu-1": "gpu-b"}  # the driver's device name -> hostagent's GPU
DEVICE = {"gpu-a": gpu(0, UUID_A), "gpu-b": gpu(1, UUID_B)}


def config() -> Config:
    return parse(lendee_toml(NODE) + """
[timeouts]
drain = "30s"
ready = "15s"

[kubernetes]
drain_unmanaged = true
""", "test.toml")


def devices(claim: dict[str, Any]) -> list[str]:
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture(scope="module")
def accounts(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Accounts]:
    with dralab.accounts(plane, tmp_path_factory.mktemp("dra-cluster")) as made:
        yield made


@dataclass
class Lent:
    lab: Lab
    cluster: KubeCluster  # the agent's, both GPUs lent


@pytest.fixture
async def lent(plane: ControlPlane, accounts: Accounts) -> AsyncIterator[Lent]:
    """The DRA lab (tests/controlplane/dralab.py) with both GPUs published, the node
    schedulable (the node lifecycle controller took its not-ready taint off), and
    both lent by the agent: verified by UUID, uncordoned."""
    async with dra_lab(plane, accounts) as lab:
        await lab.driver.publish([DEVICE["gpu-a"], DEVICE["gpu-b"]])

        async def schedulable() -> bool:
            return not (await lab.node())["spec"].get("taints")
        await until(schedulable, f"{NODE} schedulable")
        cluster = lab.cluster(config())
        await lab.kube.cordon(NODE, marker_prefix=PREFIX)
        assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
        try:
            yield Lent(lab, cluster)
        finally:
            await cluster.flush_events()


def template(name: str = "gpu") -> dict[str, Any]:
    """A ResourceClaimTemplate for one GPU of the driver's DeviceClass."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER}}]}}}}


def claim(name: str, **exactly: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER, **exactly}}]}}}


def pod(name: str, *, template: str | None = None, claim: str | None = None) -> dict[str, Any]:
    """A pod, using a claim made from `template` or the claim named `claim`, or none."""
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                            "terminationGracePeriodSeconds": 1}
    source = {"resourceClaimTemplateName": template} if template else \
        {"resourceClaimName": claim} if claim else None
    if source is not None:
        spec["resourceClaims"] = [{"name": "gpu", **source}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@contextlib.asynccontextmanager
async def watching(cluster: KubeCluster) -> AsyncIterator[None]:
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        yield
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def no_checkpoint() -> tuple[None, str]:
    raise AssertionError("a DRA lend reads which pods use a GPU from the claims")


async def test_a_gpu_reclaimed_live_drains_its_claims_pod_and_the_other_stays_lent(
        lent: Lent) -> None:
    """train-1's claim, made from its template and allocated by the scheduler, holds one
    GPU: the agent under the shipped RBAC (get on claims, no list) names it; the GPU's
    reclaim evicts train-1 alone; the other GPU, lent still, takes train-2."""
    lab, cluster = lent.lab, lent.cluster
    await lab.create(template(), pod("train-1", template="gpu"), pod("web"))
    await lab.running("train-1", "web")
    held = LABEL[devices(await lab.claim_of("train-1"))[0]]
    other = next(g for g in DEVICE if g != held)
    async with watching(cluster):
        await until(lambda: cluster.status()["holders"] == {held: f"{lab.namespace}/train-1"},
                    f"{held} held by train-1")
        assert cluster.view is not None and cluster.view.gpu_pods == 1
        assert cluster.trouble is None
    assert await cluster.vacate(["gaming1"], {held}, no_checkpoint) is None
    assert sorted(await lab.live()) == ["web"]
    await until(lambda: no_claims(lab), "train-1's claim deleted with it")
    # The guest let the GPU go: the driver publishes the other alone; the return verifies it.
    await lab.driver.publish([DEVICE[other]])
    assert await cluster.give_back([other]) is None
    await lab.create(pod("train-2", template="gpu"))
    await lab.running("train-2")
    assert devices(await lab.claim_of("train-2")) == [DEVICE[other]["name"]]


async def no_claims(lab: Lab) -> bool:
    return not (await lab.get("resourceclaims"))["items"]


async def test_one_claim_shared_by_two_pods_is_held_by_both(lent: Lent) -> None:
    lab, cluster = lent.lab, lent.cluster
    await lab.create(claim("shared"), pod("a", claim="shared"), pod("b", claim="shared"))
    pods = await lab.running("a", "b")
    shared = await lab.get("resourceclaim", "shared")
    assert sorted(r["name"] for r in shared["status"]["reservedFor"]) == ["a", "b"]
    held = LABEL[devices(shared)[0]]
    ns = lab.namespace
    async with watching(cluster):
        await until(lambda: cluster.status()["holders"] == {held: f"{ns}/a,{ns}/b"},
                    f"{held} held by a and b")
        assert cluster.view is not None and cluster.view.gpu_pods == 2
    uuid = DEVICE[held]["attributes"]["uuid"]["string"]
    assert await lab.kube.dra_holders(NODE, driver=DRIVER, uuids=[uuid], timeout=10) == {
        pods["a"]["metadata"]["uid"], pods["b"]["metadata"]["uid"]}


async def test_an_admin_access_claim_blocks_nothing(lent: Lent) -> None:
    """A monitoring pod's claim of every GPU with adminAccess (its namespace labelled so,
    as DRAAdminAccess requires) is allocated beside train-1's and holds nothing."""
    lab, cluster = lent.lab, lent.cluster
    await lab.kubectl("label", "namespace", lab.namespace,
                      "resource.kubernetes.io/admin-access=true")
    await lab.create(claim("monitor", allocationMode="All", adminAccess=True),
                     pod("dcgm", claim="monitor"), template(), pod("train-1", template="gpu"))
    pods = await lab.running("dcgm", "train-1")
    monitor = await lab.get("resourceclaim", "monitor")
    results = monitor["status"]["allocation"]["devices"]["results"]
    assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-1"]
    assert all(r.get("adminAccess") is True for r in results)
    held = LABEL[devices(await lab.claim_of("train-1"))[0]]
    async with watching(cluster):
        await until(lambda: cluster.status()["holders"] == {
            held: f"{lab.namespace}/train-1"}, f"{held} held by train-1 alone")
        assert cluster.view is not None and cluster.view.gpu_pods == 1
    assert await lab.kube.dra_holders(NODE, driver=DRIVER, uuids=[UUID_A, UUID_B],
                                      timeout=10) == {pods["train-1"]["metadata"]["uid"]}


async def test_a_lent_gpu_the_driver_taints_unhealthy_is_lost_and_given_to_no_pod(
        lent: Lent) -> None:
    """The driver's health check taints gpu-b (XID 79, NoSchedule) while lent: the agent
    counts it lost, and the scheduler gives the one GPU left to one pod of two."""
    lab, cluster = lent.lab, lent.cluster
    async with watching(cluster):
        await until(lambda: cluster.view is not None and cluster.view.devices is not None,
                    "the slices seen")
        await lab.driver.publish([DEVICE["gpu-a"],
                                  gpu(1, UUID_B, taints=[health_taint("xid", "79")])])
        await until(lambda: cluster.trouble is not None, "gpu-b lost")
        assert f"gpu-b ({UUID_B})" in (cluster.trouble or "")
        with pytest.raises(CheckFailed, match="gpu-b"):
            await cluster.health()
        await lab.create(template(), pod("train-1", template="gpu"),
                         pod("train-2", template="gpu"))

        async def one_left_out() -> bool:
            pods = await lab.live()
            phases = sorted(p["status"].get("phase", "") for p in pods.values())
            events = (await lab.get("events"))["items"]
            return phases == ["Pending", "Running"] and any(
                e["reason"] == "FailedScheduling" for e in events)
        await until(one_left_out, "one pod Running on gpu-a, the other left Pending")
        running = next(n for n, p in (await lab.live()).items()
                       if p["status"]["phase"] == "Running")
        assert devices(await lab.claim_of(running)) == ["gpu-0"]
        await lab.driver.publish([DEVICE["gpu-a"], DEVICE["gpu-b"]])  # healthy again
        await until(lambda: cluster.trouble is None, "gpu-b back")


async def test_a_pod_bound_by_hand_to_a_claim_not_reserved_for_it_is_not_started(
        lent: Lent) -> None:
    """The kubelet's DRA manager starts no pod whose claim is not reserved for it: one
    bound by hand (spec.nodeName, no scheduler) to a claim nobody allocated stays
    Pending, while a pod the scheduler placed runs."""
    lab = lent.lab
    bound = pod("by-hand", claim="unallocated")
    bound["spec"]["nodeName"] = NODE
    await lab.create(claim("unallocated"), bound, template(), pod("train-1", template="gpu"))
    pods = await lab.running("train-1")  # the stand-in has looked at both by now
    assert pods["by-hand"]["status"].get("phase") == "Pending"
