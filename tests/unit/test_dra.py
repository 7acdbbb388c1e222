"""DRA (resource.k8s.io/v1) against the API stand-in: a lend verified by UUID in the
node's ResourceSlices, a GPU lost from them while lent, the pods whose claims hold lent
GPUs (when-idle's count, status, the metric, the node's annotation), and the mode told
from the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from hostagent import dra, journal
from hostagent.cluster import KubeCluster
from hostagent.config import Config, parse
from hostagent.follow import format_status
from hostagent.health import CheckFailed
from hostagent.kube import Kube
from tests.kubeapi import StandIn
from tests.kubeapi.cluster import gpu_device, health_taint, mig_device
from tests.kubeapi.rules import DEVICECLASSES, EVENTS, PODS, RESOURCECLAIMS, RESOURCESLICES

PREFIX = "hostagent.io/"
UUID_A = "GPU-5f2ab1c4-0000-4000-8000-00000000000a"
UUID_B = "GPU-5f2ab1c4-0000-4000-8000-00000000000b"
UUID_C = "GPU-5f2ab1c4-0000-4000-8000-00000000000c"  # the host's, never lent


def config(gpu_api: str = "auto", domain: str = "gpu-node") -> Config:
    return parse(f"""
[lendee]
domain = "{domain}"
gpus = ["gpu-a", "gpu-b"]

[gpus.gpu-a]
pci = "0000:01:00.0"
uuid = "{UUID_A}"

[gpus.gpu-b]
pci = "0000:02:00.0"
uuid = "{UUID_B}"

[timeouts]
drain = "5s"
ready = "2s"

[kubernetes]
gpu_api = "{gpu_api}"
""", "test.toml")


class FakeMetrics:
    def __init__(self) -> None:
        self.gpu_pods: list[int | None] = []
        self.holders: list[dict[str, str] | None] = []
        self.lost = 0

    def node_gpu_pods(self, count: int | None) -> None:
        self.gpu_pods.append(count)

    def gpu_lost(self) -> None:
        self.lost += 1

    def lent_gpu_pods(self, holders: dict[str, str] | None) -> None:
        self.holders.append(holders)


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=0.005) as standin:
        # A DRA node: no nvidia.com/gpu in allocatable, the driver's DeviceClass installed.
        standin.cluster.add_node("gpu-node")
        standin.cluster.add_device_class()
        yield standin


def cluster_for(kube: Kube, cfg: Config | None = None,
                metrics: FakeMetrics | None = None) -> KubeCluster:
    return KubeCluster(kube, cfg or config(), remember_cordon=lambda _: None, metrics=metrics)


def publish(api: StandIn, *uuids: str) -> None:
    api.cluster.publish_devices("gpu-node", [gpu_device(i, u) for i, u in enumerate(uuids)])


def later(seconds: float, fn: Callable[..., object], *args: object) -> None:
    asyncio.get_running_loop().call_later(seconds, lambda: fn(*args))


async def until(condition: Callable[[], object], timeout: float = 15.0) -> None:
    # Polled: the condition reads state that has no event to wait on.
    async with asyncio.timeout(timeout):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


def unschedulable(api: StandIn) -> bool:
    return bool(api.cluster.node("gpu-node")["spec"].get("unschedulable"))


def annotations(api: StandIn) -> dict[str, str]:
    return dict(api.cluster.node("gpu-node")["metadata"].get("annotations") or {})


# --- pure --------------------------------------------------------------------------------


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


# --- the return ---------------------------------------------------------------------------


async def test_a_dra_lend_is_verified_by_uuid_before_the_uncordon(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    publish(api, UUID_A, UUID_B, UUID_C)  # what the last boot (with every GPU) left
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    # Partial lend: gpu-b only; the driver's plugin republishes a little later.
    later(0.3, publish, api, UUID_B)
    assert await cluster.give_back({"gpu-b"}) is None
    assert cluster.dra == {"gpu-b": UUID_B}
    assert not unschedulable(api)
    assert annotations(api)[f"{PREFIX}lent-gpus"] == "gpu-b"
    assert cluster.status()["gpu_api"] == "dra (gpu.nvidia.com)"
    decided = [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "decided"]
    assert UUID_B in decided[0].message


async def test_a_gpu_missing_from_the_slices_keeps_the_node_cordoned_and_named(
        api: StandIn, kube: Kube) -> None:
    publish(api, UUID_A, UUID_C)  # gpu-b did not come up; the host's gpu-c is there
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert problem is not None
    assert f"lack gpu-b ({UUID_B})" in problem and f"list {UUID_C}, not lent" in problem
    assert unschedulable(api)
    assert annotations(api)[f"{PREFIX}state"] == "short-of-gpus"
    await cluster.flush_events()
    warnings = [e for e in api.cluster.list(EVENTS, None)["items"] if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["ReturnFailed"] and UUID_B in warnings[0]["message"]


async def test_without_dra_the_device_plugin_count_is_awaited(api: StandIn, kube: Kube) -> None:
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube, config("device-plugin"))
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert cluster.dra is None
    assert problem is not None and "reports 0 allocatable nvidia.com/gpu where 2" in problem


async def test_auto_tells_dra_from_the_node(api: StandIn, kube: Kube) -> None:
    of = functools.partial(kube.gpu_api_of, "gpu-node", resource="nvidia.com/gpu")
    assert await of(driver="gpu.nvidia.com") is None  # nothing published yet
    publish(api, UUID_A)
    assert (await of(driver="gpu.nvidia.com") or (False,))[0] is True
    assert await of(driver="gpu.example.com") is None


async def test_a_mig_partitioned_gpu_is_matched_by_its_parent_uuid(
        api: StandIn, kube: Kube) -> None:
    """The driver publishes a partitioned GPU as its MIG instances, each naming the GPU
    in ``parentUUID``: the lend is verified, and a pod on an instance holds that GPU."""
    api.cluster.publish_devices("gpu-node", [mig_device(0, 0, UUID_A), mig_device(0, 1, UUID_A),
                                             gpu_device(1, UUID_B)])
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.cluster.add_pod("infer", node="gpu-node", owner="ReplicaSet/i",
                        devices=["gpu-0-mig-1g10gb-1"])
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.status()["holders"] == {"gpu-a": "default/infer"})
        assert cluster.trouble is None
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch

# --- while lent -----------------------------------------------------------------------------


async def test_a_lent_gpu_leaving_the_slices_is_a_gpu_lost(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    metrics = FakeMetrics()
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube, metrics=metrics)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        await cluster.health()
        publish(api, UUID_A)  # gpu-b fell off the bus; the driver republished
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match=f"gpu-b \\({UUID_B}\\) left its gpu.nvidia.com"):
            await cluster.health()
        assert metrics.lost == 1
        assert [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "gpu-lost"]
        publish(api, UUID_A, UUID_B)
        await until(lambda: cluster.trouble is None)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    await cluster.flush_events()
    assert "GPULost" in [e["reason"] for e in api.cluster.list(EVENTS, None)["items"]]


async def test_pods_whose_claims_hold_lent_gpus_are_gpu_pods_and_named(
        api: StandIn, kube: Kube) -> None:
    metrics = FakeMetrics()
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube, metrics=metrics)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    seen: list[int] = []

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            if count == 0 and len(seen) > 1:
                return

    counting = asyncio.create_task(follow())
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: seen == [0])
        api.cluster.add_pod("train-1", node="gpu-node", owner="Job/train", devices=["gpu-1"])
        api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/w")
        await until(lambda: seen[-1] == 1)
        await until(lambda: cluster.status()["holders"] == {"gpu-b": "default/train-1"})
        assert metrics.holders[-1] == {"gpu-b": "default/train-1"}
        await until(lambda: annotations(api).get(f"{PREFIX}gpu-holders")
                    == "gpu-b=default/train-1")
        api.cluster.delete(PODS, "default", "train-1", {"gracePeriodSeconds": 0})
        await asyncio.wait_for(counting, 3)
        await until(lambda: cluster.status()["holders"] == {})
        await until(lambda: f"{PREFIX}gpu-holders" not in annotations(api))
        assert api.cluster.claims() == []  # released with its pod
    finally:
        for task in (watch, counting):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert metrics.holders[-1] is None



async def test_a_reclaim_names_the_pods_holding_lent_gpus_it_stops(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.cluster.add_pod("train-1", node="gpu-node", owner="Job/train", devices=["gpu-0"])
    watch = asyncio.create_task(cluster.watch_lent())
    await until(lambda: cluster.holders == {"gpu-a": "default/train-1"})
    watch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    assert await cluster.reclaim(["gaming1"]) is None
    named = [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "holders"]
    assert named and "default/train-1 (gpu-a)" in named[0].message
    assert api.cluster.pods("gpu-node") == [] and api.cluster.claims() == []
    await cluster.flush_events()
    reclaimed = [e["message"] for e in api.cluster.list(EVENTS, None)["items"]
                 if e["reason"] == "Reclaimed"]
    assert reclaimed and "it stops default/train-1 (gpu-a)" in reclaimed[0]


def test_status_says_which_pod_holds_which_lent_gpu() -> None:
    data = {"lendee": {"domain": "gpu-node", "since": 0, "phase": "lent", "hold": False,
                       "reason": "", "lent": ["gpu-a", "gpu-b"]},
            "gpus": [], "intents": [],
            "cluster": {"holders": {"gpu-b": "default/train-1", "gpu-a": "ml/a,ml/b"}}}
    assert "its node's pods hold gpu-a (ml/a,ml/b), gpu-b (default/train-1)" in \
        format_status(data)


# --- as NVIDIA's driver publishes (health taints, pools of several slices, names) -----------


def raw_slice(name: str, devices: list[dict[str, object]], *, generation: int, count: int,
              **spec: object) -> dict[str, object]:
    """A ResourceSlice of the node's pool, written as the resourceslice controller does."""
    return {"metadata": {"name": name},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "gpu-node",
                     "pool": {"name": "gpu-node", "generation": generation,
                              "resourceSliceCount": count},
                     "devices": devices, **spec}}


async def test_a_gpu_the_driver_taints_unhealthy_is_missing_from_a_return(
        api: StandIn, kube: Kube) -> None:
    """With NVMLDeviceHealthCheck on, the driver keeps a lost GPU in its slice, tainted
    gpu.nvidia.com/gpu-lost (NoSchedule): the return must not verify it."""
    api.cluster.publish_devices("gpu-node", [
        gpu_device(0, UUID_A, taints=[health_taint("gpu-lost")]), gpu_device(1, UUID_B)])
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    problem = await cluster_for(kube).give_back(["gpu-a", "gpu-b"])
    assert problem is not None and f"lack gpu-a ({UUID_A})" in problem
    assert unschedulable(api)


async def test_a_lent_gpu_tainted_unhealthy_is_a_gpu_lost_and_a_none_taint_is_not(
        api: StandIn, kube: Kube) -> None:
    metrics = FakeMetrics()
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube, metrics=metrics)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        # An informational taint (effect None: unmonitored, a non-fatal XID) is no loss.
        api.cluster.publish_devices("gpu-node", [
            gpu_device(0, UUID_A), gpu_device(1, UUID_B, taints=[health_taint("unmonitored")])])
        await asyncio.sleep(0.3)
        assert cluster.trouble is None
        api.cluster.publish_devices("gpu-node", [
            gpu_device(0, UUID_A), gpu_device(1, UUID_B, taints=[health_taint("xid", "79")])])
        await until(lambda: cluster.trouble is not None)
        assert f"gpu-b ({UUID_B})" in (cluster.trouble or "") and metrics.lost == 1
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def test_a_pool_half_rewritten_is_not_yet_never_a_gpu_lost(
        api: StandIn, kube: Kube) -> None:
    """A pool of one slice per GPU at generation 1; the driver rewrites it as generation
    2 one slice at a time: in between, gpu-b's slice is of the old generation only."""
    c = api.cluster
    c.create(RESOURCESLICES, None, raw_slice("s-a", [gpu_device(0, UUID_A)],
                                             generation=1, count=2))
    c.create(RESOURCESLICES, None, raw_slice("s-b", [gpu_device(1, UUID_B)],
                                             generation=1, count=2))
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.view is not None and cluster.view.devices is not None)
        c.update(RESOURCESLICES, None, "s-a", lambda s: {**s, "spec": {
            **s["spec"], "pool": {"name": "gpu-node", "generation": 2, "resourceSliceCount": 2}}})
        await asyncio.sleep(0.3)
        assert cluster.trouble is None  # gpu-b's slice of generation 2 is yet to come
        c.update(RESOURCESLICES, None, "s-b", lambda s: {**s, "spec": {
            **s["spec"], "devices": [],
            "pool": {"name": "gpu-node", "generation": 2, "resourceSliceCount": 2}}})
        await until(lambda: cluster.trouble is not None)
        assert f"gpu-b ({UUID_B})" in (cluster.trouble or "")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def test_an_incomplete_pool_never_verifies_a_return(api: StandIn, kube: Kube) -> None:
    """One slice of a pool of two is in: what the other lists is unknown, so the lend of
    gpu-a alone is not verified (the other lists gpu-b, which is not lent)."""
    api.cluster.create(RESOURCESLICES, None, raw_slice("s-a", [gpu_device(0, UUID_A)],
                                                       generation=1, count=2))
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    problem = await cluster_for(kube).give_back(["gpu-a"])
    assert problem is not None and "incomplete" in problem
    assert unschedulable(api)


async def test_an_admin_access_claim_holds_no_lent_gpu(api: StandIn, kube: Kube) -> None:
    """A monitoring pod's claim with adminAccess (exactly.adminAccess in its request,
    adminAccess in its allocation) blocks neither a reclaim nor a when-idle regrow."""
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.cluster.add_pod("dcgm", node="gpu-node", owner="DaemonSet/dcgm", devices=["gpu-0"])
    claim = api.cluster.claims()[0]

    def admin(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
        for result in obj["status"]["allocation"]["devices"]["results"]:
            result["adminAccess"] = True
        return obj

    # As the scheduler allocates it: the claim made so, its status written through /status.
    where = (RESOURCECLAIMS, claim["metadata"]["namespace"], claim["metadata"]["name"])
    api.cluster.update(*where, admin)
    api.cluster.update(*where, admin, subresource="status")
    assert await kube.dra_holders("gpu-node", driver="gpu.nvidia.com",
                                  uuids=[UUID_A]) == frozenset()
    seen: list[int] = []

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            return

    await asyncio.wait_for(follow(), 5)
    assert seen == [0]


async def test_attributes_fully_qualified_are_read_as_the_short_ones(
        api: StandIn, kube: Kube) -> None:
    device = gpu_device(0, UUID_A)
    device["attributes"] = {"gpu.nvidia.com/uuid": device["attributes"]["uuid"],
                            "gpu.nvidia.com/type": {"string": "gpu"}}
    api.cluster.publish_devices("gpu-node", [device, gpu_device(1, UUID_B)])
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None


async def test_slices_that_select_the_node_by_selector_or_per_device_count(
        api: StandIn, kube: Kube) -> None:
    by_name = {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["gpu-node"]}]}]}
    per_device = {**gpu_device(1, UUID_B), "nodeName": "gpu-node"}
    other = {**gpu_device(2, UUID_C), "nodeName": "other-node"}
    for name, spec in (("sel", {"nodeSelector": by_name, "devices": [gpu_device(0, UUID_A)]}),
                       ("per", {"perDeviceNodeSelection": True,
                                "devices": [per_device, other]})):
        body = raw_slice(name, [], generation=1, count=1)
        spec_ = body["spec"]
        assert isinstance(spec_, dict)
        del spec_["nodeName"]
        spec_.update(spec)
        spec_["pool"] = {"name": f"pool-{name}", "generation": 1, "resourceSliceCount": 1}
        api.cluster.create(RESOURCESLICES, None, body)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None


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


# --- which API serves the node's GPUs -----------------------------------------------------


async def test_the_gpu_api_is_told_from_what_the_node_publishes_not_a_device_class(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    """The cluster has the driver's DeviceClass and another node's slices, but this node
    advertises nvidia.com/gpu: the device plugin serves it, and status says why."""
    api.cluster.add_node("plugin-node", gpus=2)
    api.cluster.publish_devices("gpu-node", [gpu_device(0, UUID_C)])
    cluster = cluster_for(kube, config(domain="plugin-node"))
    await kube.cordon("plugin-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert cluster.dra is None
    assert cluster.status()["gpu_api"] == "device-plugin"
    assert "advertises nvidia.com/gpu" in cluster.status()["gpu_api_from"]
    decided = [e.message for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == "decided"]
    assert "advertises nvidia.com/gpu" in decided[0]


async def test_a_node_with_slices_is_dra_without_a_device_class(
        api: StandIn, kube: Kube) -> None:
    api.cluster.delete(DEVICECLASSES, None, "gpu.nvidia.com")
    publish(api, UUID_A, UUID_B)
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert cluster.status()["gpu_api"] == "dra (gpu.nvidia.com)"
    assert "publishes 2 gpu.nvidia.com device(s)" in cluster.status()["gpu_api_from"]


@pytest.mark.parametrize(("code", "named"), [
    (403, "list and watch on resourceslices.resource.k8s.io"),
    (404, "does not serve resource.k8s.io/v1"),
])
async def test_a_dra_api_refused_is_an_error_that_names_what_is_missing(
        api: StandIn, kube: Kube, code: int, named: str) -> None:
    """The node advertises no nvidia.com/gpu and the DRA API answers 403 or 404: the
    return fails at once naming the right or the version, instead of expecting the
    device plugin and failing after timeouts.ready."""
    api.fail("/apis/resource.k8s.io/", code=code, times=None)
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert problem is not None and named in problem
    assert unschedulable(api)


def test_status_says_which_api_serves_the_nodes_gpus_and_why() -> None:
    data = {"lendee": {"domain": "gpu-node", "since": 0, "phase": "lent", "hold": False,
                       "reason": "", "lent": ["gpu-a"]},
            "gpus": [], "intents": [],
            "cluster": {"gpu_api": "dra (gpu.nvidia.com)", "gpu_api_from":
                        "node gpu-node publishes 1 gpu.nvidia.com device(s) in ResourceSlices"}}
    assert ("its node's GPUs are served by dra (gpu.nvidia.com): node gpu-node publishes 1 "
            "gpu.nvidia.com device(s) in ResourceSlices") in format_status(data)


async def test_the_dra_kubelet_plugin_is_restarted_by_the_current_charts_labels(
        api: StandIn, kube: Kube) -> None:
    """The pod labels NVIDIA's chart (main at 22407113) gives the kubelet plugin."""
    labels = {"app.kubernetes.io/name": "dra-driver-nvidia-gpu",
              "app.kubernetes.io/instance": "nvidia-dra-driver-gpu",
              "dra-driver-nvidia-gpu-component": "kubelet-plugin",
              "nvidia-dra-driver-gpu-component": "kubelet-plugin"}
    api.cluster.add_pod("plugin-x", node="gpu-node", namespace="nvidia-dra-driver-gpu",
                        owner="DaemonSet/nvidia-dra-driver-gpu-kubelet-plugin", labels=labels)
    api.cluster.add_pod("train", node="gpu-node", owner="Job/train")
    deleted = await cluster_for(kube).kube.restart_plugins(
        "gpu-node", timeout=5, selectors=config().kubernetes.plugin_selectors)  # type: ignore[union-attr]
    assert deleted == ["nvidia-dra-driver-gpu/plugin-x"]


async def test_the_holders_are_read_from_the_claims_of_the_nodes_pods_alone(
        api: StandIn, kube: Kube) -> None:
    """A reclaim reads the claims its node's pods name (status.resourceClaimStatuses),
    not every claim of the cluster."""
    publish(api, UUID_A, UUID_B)
    api.cluster.add_pod("train-1", node="gpu-node", owner="Job/train", devices=["gpu-0"])
    api.cluster.add_pod("far", node="other-node", owner="Job/far", devices=["gpu-9"])
    holders = await kube.dra_holders("gpu-node", driver="gpu.nvidia.com", uuids=[UUID_A])
    assert holders == {api.cluster.pods("gpu-node")[0]["metadata"]["uid"]}
    assert api.requests_to("GET", "/apis/resource.k8s.io/v1/resourceclaims") == []
    assert len(api.requests_to("GET", "/namespaces/default/resourceclaims/train-1-gpu-")) == 1


async def test_a_pool_of_one_slice_per_gpu_is_verified_once_whole(
        api: StandIn, kube: Kube) -> None:
    """The driver's DynamicMIG layout: the node's pool in one slice per GPU."""
    api.cluster.publish_devices("gpu-node", [gpu_device(0, UUID_A), gpu_device(1, UUID_B)],
                                per_gpu=True)
    assert len(api.cluster.slices("gpu-node")) == 2
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None
