"""DRA (resource.k8s.io/v1), what hostagent.cluster.dra decides and, against the real
kube-apiserver (the session's `plane`), a lend verified by UUID in
the node's ResourceSlices as NVIDIA's driver publishes them (tests/controlplane/nvidia.py),
a GPU lost from them or tainted unhealthy while lent, the pods whose claims hold lent
GPUs (when-idle's count, status, the metric, the node's annotation), and which API
serves the node's GPUs. The agent connects as its node's ServiceAccount (deploy/rbac.yaml,
deploy/rbac-node.yaml).

Here a claim is written as the scheduler leaves one (allocated, reserved for its pod,
the pod bound to the node), which is quick; tests/controlplane/test_dra_cluster.py has
the real scheduler and controller-manager make and allocate them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hostagent.cluster import dra
from hostagent.host import journal
from hostagent.cluster.cycle import KubeCluster
from hostagent.surfaces.follow import format_status
from hostagent.core.config import Config, parse
from hostagent.core.health import CheckFailed
from hostagent.cluster.kube import Kube
from tests.fakes import FakeMetrics
from tests.controlplane import ControlPlane, dralab
from tests.controlplane.dralab import NODE, Accounts, Lab, dra_lab
from tests.controlplane.kubelet import Pods
from tests.controlplane.proxy import FaultProxy
from tests.controlplane.rbac import agent_kubeconfig, node_rbac
from tests.controlplane.nvidia import DEVICE_CLASS, DRIVER, gpu, health_taint, mig
from tests.configs import UUID_A, UUID_B, UUID_C, lendee_toml  # UUID_C: the host's, never lent
from tests.unit.kube_scaffold import FAST
from tests.waiting import until

PREFIX = "hostagent.io/"


def config(gpu_api: str = "auto", domain: str = NODE) -> Config:
    return parse(lendee_toml(domain) + f"""
[timeouts]
drain = "10s"
ready = "2s"

[kubernetes]
gpu_api = "{gpu_api}"
drain_unmanaged = true
""", "test.toml")


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture(scope="module")
def accounts(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Accounts]:
    with dralab.accounts(plane, tmp_path_factory.mktemp("dra")) as made:
        yield made


@pytest.fixture
async def lab(plane: ControlPlane, accounts: Accounts) -> AsyncIterator[Lab]:
    async with dra_lab(plane, accounts) as made:
        yield made


async def publish(lab: Lab, *uuids: str) -> None:
    await lab.driver.publish([gpu(i, u) for i, u in enumerate(uuids)])


@contextlib.asynccontextmanager
async def watching(cluster: KubeCluster) -> AsyncIterator[None]:
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        yield
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


# --- pure ----------------------------------------------------------------------------------


def test_mismatch_names_each_gpu_missing_or_not_lent() -> None:
    lent = {"gpu-a": UUID_A, "gpu-b": UUID_B}
    assert dra.mismatch(lent, {UUID_A, UUID_B}) is None
    missing = dra.mismatch(lent, {UUID_A}) or ""
    assert f"lack gpu-b ({UUID_B})" in missing and "gpu-a" not in missing
    extra = dra.mismatch({"gpu-a": UUID_A}, {UUID_A, UUID_C}) or ""
    assert f"list {UUID_C}, not lent" in extra
    # A GPU without a configured uuid is matched by count.
    assert dra.mismatch({"gpu-a": UUID_A, "gpu-x": None}, {UUID_A, UUID_C}) is None
    assert "lack 1 of gpu-x" in (dra.mismatch({"gpu-a": UUID_A, "gpu-x": None}, {UUID_A}) or "")


def test_status_says_which_pod_holds_which_lent_gpu() -> None:
    data = {"lendee": {"domain": "gpu-node", "since": 0, "phase": "lent", "hold": False,
                       "reason": "", "lent": ["gpu-a", "gpu-b"]},
            "gpus": [], "intents": [],
            "cluster": {"holders": {"gpu-b": "default/train-1", "gpu-a": "ml/a,ml/b"}}}
    assert "its node's pods hold gpu-a (ml/a,ml/b), gpu-b (default/train-1)" in \
        format_status(data)


def test_a_node_selector_on_the_hostname_label_selects_the_node() -> None:
    from kubernetes_asyncio.client import (V1NodeSelector, V1NodeSelectorRequirement,
                                           V1NodeSelectorTerm, V1ResourcePool,
                                           V1ResourceSliceSpec)
    term = V1NodeSelectorTerm(match_expressions=[V1NodeSelectorRequirement(
        key="kubernetes.io/hostname", operator="In", values=["gpu-node"])])
    spec = V1ResourceSliceSpec(driver="gpu.nvidia.com", pool=V1ResourcePool(
        name="p", generation=1, resource_slice_count=1),
                               node_selector=V1NodeSelector(node_selector_terms=[term]))
    assert dra.selects(spec, "gpu-node", {"kubernetes.io/hostname": "gpu-node"})
    assert not dra.selects(spec, "other", {"kubernetes.io/hostname": "other"})


def test_status_says_which_api_serves_the_nodes_gpus_and_why() -> None:
    data = {"lendee": {"domain": "gpu-node", "since": 0, "phase": "lent", "hold": False,
                       "reason": "", "lent": ["gpu-a"]},
            "gpus": [], "intents": [],
            "cluster": {"gpu_api": "dra (gpu.nvidia.com)", "gpu_api_from":
                        "node gpu-node publishes 1 gpu.nvidia.com device(s) in ResourceSlices"}}
    assert ("its node's GPUs are served by dra (gpu.nvidia.com): node gpu-node publishes 1 "
            "gpu.nvidia.com device(s) in ResourceSlices") in format_status(data)


def test_devices_of_a_slice_of_per_device_node_selection_count_by_their_node() -> None:
    """perDeviceNodeSelection (the DRAPartitionableDevices gate, alpha in 1.35, which the
    lab's API server leaves off): each device names its node; only the node's count."""
    from kubernetes_asyncio.client import (V1Device, V1DeviceAttribute, V1ObjectMeta,
                                           V1ResourcePool, V1ResourceSlice,
                                           V1ResourceSliceSpec)

    def device(name: str, uuid: str, node: str) -> V1Device:
        return V1Device(name=name, node_name=node,
                        attributes={"uuid": V1DeviceAttribute(string=uuid)})
    slices = dra.Slices(DRIVER, NODE)
    slices.reset([V1ResourceSlice(metadata=V1ObjectMeta(uid="u1"), spec=V1ResourceSliceSpec(
        driver=DRIVER, per_device_node_selection=True,
        pool=V1ResourcePool(name="p", generation=1, resource_slice_count=1),
        devices=[device("gpu-1", UUID_B, NODE), device("gpu-2", UUID_C, "other-node")]))])
    assert slices.uuids() == frozenset({UUID_B})


def test_the_claim_made_for_a_pods_extended_resources_is_one_of_its_claims() -> None:
    """With DRAExtendedResource, a pod that requests nvidia.com/gpu on a DRA node gets a
    claim the scheduler makes for it, named in status.extendedResourceClaimStatus: a
    hot-unplug must evict that pod with the GPU, as it does a pod of a template."""
    from kubernetes_asyncio.client import (V1ObjectMeta, V1Pod, V1PodExtendedResourceClaimStatus,
                                           V1PodResourceClaimStatus, V1PodStatus)
    pod = V1Pod(metadata=V1ObjectMeta(name="train", namespace="ml"), status=V1PodStatus(
        resource_claim_statuses=[V1PodResourceClaimStatus(name="gpu",
                                                          resource_claim_name="train-gpu-x")],
        extended_resource_claim_status=V1PodExtendedResourceClaimStatus(
            request_mappings=[], resource_claim_name="train-extended-resources-y")))
    assert dra.claim_names(pod) == ["train-extended-resources-y", "train-gpu-x"]


# --- the return ---------------------------------------------------------------------------


async def test_a_dra_lend_is_verified_by_uuid_before_the_uncordon(
        lab: Lab, records: journal.ListSink, tmp_path: Path) -> None:
    await publish(lab, UUID_A, UUID_B, UUID_C)  # what the last boot (with every GPU) left
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    async with FaultProxy(lab.kubeconfig) as proxy, await Kube.connect(
            proxy.write_kubeconfig(tmp_path / "proxied.kubeconfig"), timing=FAST) as kube:
        cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
        returned = asyncio.create_task(cluster.give_back({"gpu-b"}))
        # The partial lend (gpu-b only) is published while the return waits for it,
        # watching the slices that still list the last boot's GPUs.
        await until(lambda: proxy.watching("/resourceslices$") or returned.done(),
                    "the return watching the ResourceSlices")
        assert not returned.done()
        await lab.driver.publish([gpu(1, UUID_B)])
        assert await returned is None
        await cluster.flush_events()  # posted before the client closes
    assert cluster.dra == {"gpu-b": UUID_B}
    assert not await lab.unschedulable()
    assert (await lab.annotations())[f"{PREFIX}lent-gpus"] == "gpu-b"
    assert cluster.status()["gpu_api"] == "dra (gpu.nvidia.com)"
    decided = [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "decided"]
    assert UUID_B in decided[0].message


async def test_a_gpu_missing_from_the_slices_keeps_the_node_cordoned_and_named(
        lab: Lab) -> None:
    await publish(lab, UUID_A, UUID_C)  # gpu-b did not come up; the host's gpu-c is there
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    cluster = lab.cluster(config())
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert problem is not None
    assert f"lack gpu-b ({UUID_B})" in problem and f"list {UUID_C}, not lent" in problem
    assert await lab.unschedulable()
    assert (await lab.annotations())[f"{PREFIX}state"] == "short-of-gpus"
    await cluster.flush_events()
    warnings = [e for e in await lab.events() if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["ReturnFailed"] and UUID_B in warnings[0]["message"]


async def test_without_dra_the_device_plugin_count_is_awaited(lab: Lab) -> None:
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config("device-plugin"))
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert cluster.dra is None
    assert problem is not None and "reports 0 allocatable nvidia.com/gpu where 2" in problem


async def test_auto_tells_dra_from_the_node(lab: Lab) -> None:
    of = functools.partial(lab.kube.gpu_api_of, NODE, resource="nvidia.com/gpu", timeout=5)
    assert await of(driver=DRIVER) is None  # nothing published yet
    await publish(lab, UUID_A)
    assert (await of(driver=DRIVER) or (False,))[0] is True
    assert await of(driver="gpu.example.com") is None


async def test_auto_waits_on_the_slices_a_driver_publishes_after_the_boot(
        lab: Lab, tmp_path: Path) -> None:
    """The lendee just booted, its driver's plugin not yet up: the return follows the
    slices and decides DRA when they come, with the lent GPUs verified by UUID."""
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    async with FaultProxy(lab.kubeconfig) as proxy, await Kube.connect(
            proxy.write_kubeconfig(tmp_path / "proxied.kubeconfig"), timing=FAST) as kube:
        cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
        returned = asyncio.create_task(cluster.give_back(["gpu-a", "gpu-b"]))
        # The return is waiting once it watches the slices: nothing is published.
        await until(lambda: proxy.watching("/resourceslices$") or returned.done(),
                    "the return watching the ResourceSlices")
        assert not returned.done()
        await publish(lab, UUID_A, UUID_B)
        assert await returned is None
        await cluster.flush_events()  # posted before the client closes
    assert cluster.dra == {"gpu-a": UUID_A, "gpu-b": UUID_B}
    assert cluster.gpu_api_from == f"node {NODE} publishes 2 {DRIVER} device(s) in ResourceSlices"
    assert not await lab.unschedulable()


async def test_a_mig_partitioned_gpu_is_matched_by_its_parent_uuid(lab: Lab) -> None:
    """The driver publishes a partitioned GPU as its MIG instances, each naming the GPU
    in ``parentUUID``: the lend is verified, and a pod on an instance holds that GPU."""
    await lab.driver.publish([mig(0, 0, UUID_A), mig(0, 1, UUID_A), gpu(1, UUID_B)])
    cluster = lab.cluster(config())
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await lab.hold("infer", ["gpu-0-mig-1g10gb-1"])
    async with watching(cluster):
        await until(lambda: cluster.status()["holders"] == {"gpu-a": f"{lab.namespace}/infer"})
        assert cluster.trouble is None


# --- while lent -----------------------------------------------------------------------------


async def test_a_lent_gpu_leaving_the_slices_is_a_gpu_lost(
        lab: Lab, records: journal.ListSink) -> None:
    metrics = FakeMetrics()
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config(), metrics=metrics)
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    async with watching(cluster):
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        await cluster.health()
        await publish(lab, UUID_A)  # gpu-b fell off the bus; the driver republished
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match=f"gpu-b \\({UUID_B}\\) left its gpu.nvidia.com"):
            await cluster.health()
        assert metrics.lost == 1
        assert [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "gpu-lost"]
        await publish(lab, UUID_A, UUID_B)
        await until(lambda: cluster.trouble is None)
    await cluster.flush_events()
    assert "GPULost" in [e["reason"] for e in await lab.events()]


async def test_pods_whose_claims_hold_lent_gpus_are_gpu_pods_and_named(lab: Lab) -> None:
    metrics = FakeMetrics()
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config(), metrics=metrics)
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    seen: list[int] = []
    ns = lab.namespace

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            if count == 0 and len(seen) > 1:
                return

    counting = asyncio.create_task(follow())
    try:
        async with watching(cluster):
            await until(lambda: seen == [0])
            await lab.hold("train-1", ["gpu-1"])
            await lab.add_pod("web")
            await until(lambda: seen[-1] == 1)
            await until(lambda: cluster.status()["holders"] == {"gpu-b": f"{ns}/train-1"})
            assert metrics.holders[-1] == {"gpu-b": f"{ns}/train-1"}
            await until(lambda: _annotated(lab, f"gpu-b={ns}/train-1"))
            await lab.kubectl("delete", "pod", "-n", ns, "train-1", "--wait=false")
            await asyncio.wait_for(counting, 10)
            await until(lambda: cluster.status()["holders"] == {})
            await until(lambda: _annotated(lab, None))
            await until(lambda: _no_claims(lab))  # deleted with its pod
    finally:
        counting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await counting
    assert metrics.holders[-1] is None


async def _annotated(lab: Lab, holders: str | None) -> bool:
    return (await lab.annotations()).get(f"{PREFIX}gpu-holders") == holders


async def _no_claims(lab: Lab) -> bool:
    return not await lab.claims()


async def test_a_reclaim_names_the_pods_holding_lent_gpus_it_stops(
        lab: Lab, records: journal.ListSink) -> None:
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config())
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await lab.hold("train-1", ["gpu-0"])
    async with watching(cluster):
        await until(lambda: cluster.holders == {"gpu-a": f"{lab.namespace}/train-1"})
    assert await cluster.reclaim(["gaming1"]) is None
    named = [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "holders"]
    assert named and f"{lab.namespace}/train-1 (gpu-a)" in named[0].message
    assert await lab.pods() == []
    await until(lambda: _no_claims(lab))
    await cluster.flush_events()
    reclaimed = [e["message"] for e in await lab.events() if e["reason"] == "Reclaimed"]
    assert reclaimed and f"it stops {lab.namespace}/train-1 (gpu-a)" in reclaimed[0]


# --- as NVIDIA's driver publishes (health taints, pools of several slices, names) -----------


async def test_a_gpu_the_driver_taints_unhealthy_is_missing_from_a_return(lab: Lab) -> None:
    """With NVMLDeviceHealthCheck on, the driver keeps a lost GPU in its slice, tainted
    gpu.nvidia.com/gpu-lost (NoSchedule): the return must not verify it."""
    await lab.driver.publish([gpu(0, UUID_A, taints=[health_taint("gpu-lost")]),
                              gpu(1, UUID_B)])
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    problem = await lab.cluster(config()).give_back(["gpu-a", "gpu-b"])
    assert problem is not None and f"lack gpu-a ({UUID_A})" in problem
    assert await lab.unschedulable()


async def test_a_lent_gpu_tainted_unhealthy_is_a_gpu_lost_and_a_none_taint_is_not(
        lab: Lab) -> None:
    metrics = FakeMetrics()
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config(), metrics=metrics)
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    async with watching(cluster):
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        # An informational taint (effect None: unmonitored, a non-fatal XID) is no loss.
        # Published with a GPU of no lend beside (gpu-c) in the same slice: the view
        # lists it once the watch has taken in that very write, the taint with it.
        await lab.driver.publish([gpu(0, UUID_A),
                                  gpu(1, UUID_B, taints=[health_taint("unmonitored")]),
                                  gpu(2, UUID_C)])
        await until(lambda: cluster.view is not None and UUID_C in (cluster.view.devices or ()),
                    "the watch taking in the slice with the taint")
        assert cluster.trouble is None
        await lab.driver.publish([gpu(0, UUID_A),
                                  gpu(1, UUID_B, taints=[health_taint("xid", "79")])])
        await until(lambda: cluster.trouble is not None)
        assert f"gpu-b ({UUID_B})" in (cluster.trouble or "") and metrics.lost == 1


def raw_slice(name: str, devices: list[dict[str, object]], *, generation: int, count: int,
              **spec: object) -> dict[str, object]:
    """A ResourceSlice of the node's pool, written as the resourceslice controller does."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                     "pool": {"name": NODE, "generation": generation,
                              "resourceSliceCount": count},
                     "devices": devices, **spec}}


async def write_slice(lab: Lab, body: dict[str, object], verb: str = "create") -> None:
    await lab.kubectl(verb, "-f", "-", input=json.dumps(body))


async def test_a_pool_half_rewritten_is_not_yet_never_a_gpu_lost(lab: Lab) -> None:
    """A pool of one slice per GPU at generation 1; the driver rewrites it as generation
    2 one slice at a time: in between, gpu-b's slice is of the old generation only."""
    await write_slice(lab, raw_slice("s-a", [gpu(0, UUID_A)], generation=1, count=2))
    await write_slice(lab, raw_slice("s-b", [gpu(1, UUID_B)], generation=1, count=2))
    cluster = lab.cluster(config())
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    async with watching(cluster):
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        await write_slice(lab, raw_slice("s-a", [gpu(0, UUID_A)], generation=2, count=2),
                          "replace")
        # Taken in once the view's devices change: unknown (None) while the pool is
        # incomplete, {gpu-a} for a watch that counted the half-written pool.
        await until(lambda: cluster.view is not None
                    and cluster.view.devices != frozenset({UUID_A, UUID_B}),
                    "the watch taking in s-a of generation 2")
        assert cluster.trouble is None  # gpu-b's slice of generation 2 is yet to come
        await write_slice(lab, raw_slice("s-b", [], generation=2, count=2), "replace")
        await until(lambda: cluster.trouble is not None)
        assert f"gpu-b ({UUID_B})" in (cluster.trouble or "")


async def test_an_incomplete_pool_never_verifies_a_return(lab: Lab) -> None:
    """One slice of a pool of two is in: what the other lists is unknown, so the lend of
    gpu-a alone is not verified (the other lists gpu-b, which is not lent)."""
    await write_slice(lab, raw_slice("s-a", [gpu(0, UUID_A)], generation=1, count=2))
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    problem = await lab.cluster(config()).give_back(["gpu-a"])
    assert problem is not None and "incomplete" in problem
    assert await lab.unschedulable()


async def test_an_admin_access_claim_holds_no_lent_gpu(lab: Lab) -> None:
    """A monitoring pod's claim with adminAccess (exactly.adminAccess in its request,
    adminAccess in its allocation; its namespace labelled for it) blocks neither a
    reclaim nor a when-idle regrow."""
    await lab.kubectl("label", "namespace", lab.namespace,
                      "resource.kubernetes.io/admin-access=true")
    await publish(lab, UUID_A, UUID_B)
    cluster = lab.cluster(config())
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await lab.hold("dcgm", ["gpu-0"], admin=True)
    assert await lab.kube.dra_holders(NODE, driver=DRIVER, uuids=[UUID_A],
                                      timeout=5) == frozenset()
    seen: list[int] = []

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            return

    await asyncio.wait_for(follow(), 5)
    assert seen == [0]


async def test_attributes_fully_qualified_are_read_as_the_short_ones(lab: Lab) -> None:
    device = gpu(0, UUID_A)
    device["attributes"] = {"gpu.nvidia.com/uuid": device["attributes"]["uuid"],
                            "gpu.nvidia.com/type": {"string": "gpu"}}
    await lab.driver.publish([device, gpu(1, UUID_B)])
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await lab.cluster(config()).give_back(["gpu-a", "gpu-b"]) is None


async def test_a_slice_that_selects_the_node_by_a_node_selector_counts(lab: Lab) -> None:
    """A pool published with a nodeSelector instead of nodeName. (Devices each naming
    their node, perDeviceNodeSelection, need the DRAPartitionableDevices gate, alpha in
    1.35: tests/unit/cluster/test_dra.py reads them.)"""
    by_name = {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
    body = raw_slice("sel", [gpu(0, UUID_A), gpu(1, UUID_B)], generation=1, count=1)
    spec = body["spec"]
    assert isinstance(spec, dict)
    del spec["nodeName"]
    spec.update(nodeSelector=by_name, pool={"name": "pool-sel", "generation": 1,
                                            "resourceSliceCount": 1})
    await write_slice(lab, body)
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await lab.cluster(config()).give_back(["gpu-a", "gpu-b"]) is None


# --- which API serves the node's GPUs -----------------------------------------------------


async def test_the_gpu_api_is_told_from_what_the_node_publishes_not_a_device_class(
        lab: Lab, records: journal.ListSink, tmp_path: Path) -> None:
    """The cluster has the driver's DeviceClass and another node's slices, but this node
    advertises nvidia.com/gpu: the device plugin serves it, and status says why. The
    agent of that node is that node's ServiceAccount (deploy/rbac-node.yaml)."""
    plane = lab.plane
    plugin_node = plane.credential("kubelet-plugin-node", "system:node:plugin-node",
                                   "system:nodes")
    kubeconfig = await asyncio.to_thread(agent_kubeconfig, plane,
                                         tmp_path / "plugin-node.kubeconfig", "plugin-node")
    try:
        async with Pods(plugin_node, "plugin-node", ready=True):
            gpus = {"nvidia.com/gpu": "2", "pods": "110"}
            await lab.kubectl("patch", "node", "plugin-node", "--subresource=status",
                              "--type=merge", "-p", json.dumps(
                                  {"status": {"capacity": gpus, "allocatable": gpus}}))
            await publish(lab, UUID_C)
            async with await Kube.connect(kubeconfig, timing=FAST) as kube:
                cluster = KubeCluster(kube, config(domain="plugin-node"),
                                      remember_cordon=lambda _: None)
                await kube.cordon("plugin-node", marker_prefix=PREFIX)
                assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    finally:
        await lab.kubectl("delete", "node", "plugin-node", "--ignore-not-found")
        await lab.kubectl("delete", "lease", "-n", "kube-node-lease", "plugin-node",
                          "--ignore-not-found")
        await lab.kubectl("delete", "--ignore-not-found", "-f", "-",
                          input=node_rbac("plugin-node"))
    assert cluster.dra is None
    assert cluster.status()["gpu_api"] == "device-plugin"
    assert "advertises nvidia.com/gpu" in str(cluster.status()["gpu_api_from"])
    decided = [e.message for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "decided"]
    assert "advertises nvidia.com/gpu" in decided[0]


async def test_a_node_with_slices_is_dra_without_a_device_class(lab: Lab) -> None:
    await lab.kubectl("delete", "deviceclass", DRIVER)
    try:
        await publish(lab, UUID_A, UUID_B)
        cluster = lab.cluster(config())
        await lab.kube.cordon(NODE, marker_prefix=PREFIX)
        assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    finally:
        await lab.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_CLASS))
    assert cluster.status()["gpu_api"] == "dra (gpu.nvidia.com)"
    assert "publishes 2 gpu.nvidia.com device(s)" in str(cluster.status()["gpu_api_from"])


async def test_a_dra_api_refused_is_an_error_that_names_the_right_missing(
        lab: Lab, tmp_path: Path) -> None:
    """The node advertises no nvidia.com/gpu and the agent's ServiceAccount has no right
    on resource.k8s.io (an older manifest: one ServiceAccount, outside namespace
    hostagent's policies, bound to a ClusterRole without those rules): the return fails
    at once naming the right, instead of expecting the device plugin and failing after
    timeouts.ready."""
    rules = [rule for name in ("hostagent", f"hostagent:{NODE}") for rule in json.loads(
        await lab.kubectl("get", "clusterrole", name, "-o", "json"))["rules"]]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "hostagent-no-dra"},
            "rules": [r for r in rules if "resource.k8s.io" not in r["apiGroups"]]}
    await lab.kubectl("apply", "-f", "-", input=json.dumps(role))
    await lab.kubectl("create", "serviceaccount", "-n", lab.namespace, "no-dra")
    await lab.kubectl("create", "clusterrolebinding", "hostagent-no-dra",
                      "--clusterrole=hostagent-no-dra",
                      f"--serviceaccount={lab.namespace}:no-dra")
    try:
        token = (await lab.kubectl("create", "token", "no-dra", "-n", lab.namespace)).strip()
        kubeconfig = json.loads(lab.kubeconfig.read_text())
        kubeconfig["users"][0]["user"]["token"] = token
        path = tmp_path / "no-dra.kubeconfig"
        path.write_text(json.dumps(kubeconfig))
        async with await Kube.connect(path, timing=FAST) as kube:
            cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
            await kube.cordon(NODE, marker_prefix=PREFIX)
            problem = await cluster.give_back(["gpu-a", "gpu-b"])
        assert problem is not None
        assert "list and watch on resourceslices.resource.k8s.io" in problem
        assert await lab.unschedulable()
    finally:
        for args in (("delete", "clusterrolebinding", "hostagent-no-dra"),
                     ("delete", "clusterrole", "hostagent-no-dra")):
            await lab.kubectl(*args, "--ignore-not-found")


async def test_a_dra_api_not_served_is_an_error_that_names_the_version(
        lab: Lab, tmp_path: Path) -> None:
    """An API server that does not serve resource.k8s.io/v1 (before 1.34) answers 404
    there (the fault proxy answers for it, as the real one would, Status and all)."""
    async with FaultProxy(lab.kubeconfig) as proxy:
        proxy.fail("/apis/resource.k8s.io/", code=404, times=None)
        path = proxy.write_kubeconfig(tmp_path / "proxied.kubeconfig")
        async with await Kube.connect(path, timing=FAST) as kube:
            cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
            await kube.cordon(NODE, marker_prefix=PREFIX)
            problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert problem is not None and "does not serve resource.k8s.io/v1" in problem
    assert await lab.unschedulable()


async def test_the_dra_kubelet_plugin_is_restarted_by_the_current_charts_labels(
        lab: Lab) -> None:
    """The pod labels NVIDIA's chart (main at 22407113) gives the kubelet plugin."""
    labels = {"app.kubernetes.io/name": "dra-driver-nvidia-gpu",
              "app.kubernetes.io/instance": "nvidia-dra-driver-gpu",
              "dra-driver-nvidia-gpu-component": "kubelet-plugin",
              "nvidia-dra-driver-gpu-component": "kubelet-plugin"}
    await lab.add_pod("plugin-x", labels=labels)
    await lab.add_pod("train")
    selectors = config().kubernetes.plugin_selectors  # type: ignore[union-attr]
    deleted = await lab.kube.restart_plugins(NODE, timeout=5, selectors=selectors)
    assert deleted == [f"{lab.namespace}/plugin-x"]


async def test_the_holders_are_read_from_the_claims_of_the_nodes_pods_alone(
        lab: Lab) -> None:
    """A reclaim reads the claims its node's pods name, each by name: the agent may not
    list claims (deploy/rbac.yaml), and another node's claim is not its."""
    await publish(lab, UUID_A, UUID_B)
    train = await lab.hold("train-1", ["gpu-0"])
    await lab.hold("far", ["gpu-0"], node="other-node")
    holders = await lab.kube.dra_holders(NODE, driver=DRIVER, uuids=[UUID_A], timeout=5)
    assert holders == {train["metadata"]["uid"]}
    refused = await asyncio.to_thread(
        lab.plane.kubectl, "get", "resourceclaims", "-A", kubeconfig=lab.kubeconfig, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr


async def test_while_lent_the_claims_are_read_by_name_and_again_after_a_failure(
        lab: Lab, tmp_path: Path) -> None:
    """The watch reads train-1's claim by name, never a list of claims; a read the API
    server fails (500) is tried again, and the holder is named all the same."""
    await publish(lab, UUID_A, UUID_B)
    async with FaultProxy(lab.kubeconfig) as proxy:
        path = proxy.write_kubeconfig(tmp_path / "proxied.kubeconfig")
        async with await Kube.connect(path, timing=FAST) as kube:
            cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
            await kube.cordon(NODE, marker_prefix=PREFIX)
            assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
            proxy.fail("/resourceclaims/train-1-gpu$", code=500, times=2)
            await lab.hold("train-1", ["gpu-1"])
            async with watching(cluster):
                await until(lambda: cluster.status()["holders"] == {
                    "gpu-b": f"{lab.namespace}/train-1"})
    reads = proxy.requests_to("GET", "/resourceclaims")
    assert len([r for r in reads if r.endswith("/resourceclaims/train-1-gpu")]) >= 3
    assert all("/namespaces/" in r and not r.endswith("/resourceclaims") for r in reads)


async def test_a_pool_of_one_slice_per_gpu_is_verified_once_whole(lab: Lab) -> None:
    """The driver's DynamicMIG layout: the node's pool in one slice per GPU."""
    await lab.driver.publish([gpu(0, UUID_A), gpu(1, UUID_B)], per_gpu=True)
    assert len(await lab.driver.slices()) == 2
    await lab.kube.cordon(NODE, marker_prefix=PREFIX)
    assert await lab.cluster(config()).give_back(["gpu-a", "gpu-b"]) is None
