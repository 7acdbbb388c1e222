"""The cluster's half of a cycle against the real kube-apiserver (behind the fault
proxy): what a lend must show (time-slicing, MIG), the order of a return, cordon when
the lendee goes down, the node watched while lent, Events, and credentials the API
server refuses."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import journal
from hostagent.core import levers
from hostagent.core.health import CheckFailed
from hostagent.cluster.cycle import KubeCluster
from hostagent.cluster.kube import Kube, KubeAuthError, Timing, expected_gpus
from kubernetes_asyncio import watch as k8s_watch
from tests.fakes import FakeMetrics
from tests.controlplane import ControlPlane
from tests.controlplane.seed import gpu_status
from tests.unit.kube_scaffold import FAST, Api, Clock, real_api
from tests.waiting import until
from tests.unit.cluster_scaffold import (
    boot,
    cluster_for,
    config,
    MARKER,
    PREFIX,
    set_status,
)


def result_of(records: journal.ListSink, result: str) -> list[journal.Entry]:
    return [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == result]


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node (2 GPUs, its kubelet running) and cpu-node."""
    async with real_api(plane) as api:
        await api.seed.node("gpu-node", gpus=2)
        await api.seed.node("cpu-node")
        async with api.seed.kubelet("gpu-node"):
            yield api


def later(seconds: float, fn: Callable[[], Awaitable[Any]]) -> asyncio.Task[None]:
    """`fn()` after `seconds`, beside the test (which awaits the task before it ends)."""

    async def run() -> None:
        await asyncio.sleep(seconds)
        await fn()

    return asyncio.get_running_loop().create_task(run())


async def node(api: Api) -> dict[str, Any]:
    return await api.seed.get_node("gpu-node")


async def events(api: Api) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in await api.seed.events()]


# --- what a lend must show (no I/O) ---------------------------------------------------------


def test_one_gpu_resource_per_gpu_without_labels() -> None:
    e = expected_gpus(["b", "a"], labels={})
    assert e.gpus == ("a", "b") and dict(e.resources) == {"nvidia.com/gpu": 2}
    assert str(e) == "2 nvidia.com/gpu (2 GPUs, one nvidia.com/gpu each)"


def test_time_slicing_replicas_multiply() -> None:
    labels, _ = gpu_status(3, replicas=4)
    e = expected_gpus(["a", "b"], labels=labels)
    assert dict(e.resources) == {"nvidia.com/gpu": 8}
    assert "4 time-slicing replicas" in e.how
    shared = expected_gpus(["a"], labels={**labels, "nvidia.com/gpu.product": "Tesla-T4-SHARED"})
    assert dict(shared.resources) == {"nvidia.com/gpu.shared": 4}


def test_mig_counts_are_per_gpu_from_labels_of_another_lend() -> None:
    labels, _ = gpu_status(2, mig={"1g.10gb": 7, "2g.20gb": 1})
    e = expected_gpus(["a"], labels=labels)
    assert dict(e.resources) == {"nvidia.com/mig-1g.10gb": 7, "nvidia.com/mig-2g.20gb": 1}
    single = {"nvidia.com/mig.strategy": "single", "nvidia.com/gpu.count": "14"}
    assert dict(expected_gpus(["a", "b", "c"], labels=single,
                              labelled_gpus=2).resources) == {"nvidia.com/gpu": 21}


def test_mig_without_gfd_reads_the_resources_the_last_lend_left() -> None:
    _, capacity = gpu_status(3, mig={"3g.40gb": 2})
    e = expected_gpus(["a"], labels={}, labelled_gpus=3, capacity=capacity)
    assert dict(e.resources) == {"nvidia.com/mig-3g.40gb": 2}
    assert "MIG resources" in e.how


def test_the_override_is_per_lent_gpu() -> None:
    labels, _ = gpu_status(2, replicas=4)
    e = expected_gpus(["a", "b", "c"], labels=labels, override={"nvidia.com/gpu": 2})
    assert dict(e.resources) == {"nvidia.com/gpu": 6} and "kubernetes.expected" in e.how


# --- a return ----------------------------------------------------------------------------------


async def test_a_time_sliced_lend_completes(api: Api, kube: Kube) -> None:
    await boot(api, 2, replicas=4)  # what the last lend left
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    # Partial lending: one GPU this time; the device plugin says so a little later.
    plugin = later(0.3, lambda: boot(api, 1, replicas=4))
    assert await cluster.give_back({"gpu-b"}) is None
    await plugin
    assert cluster.expected is not None and dict(cluster.expected.resources) == {
        "nvidia.com/gpu": 4}
    annotations = (await node(api))["metadata"]["annotations"]
    assert annotations[f"{PREFIX}lent-gpus"] == "gpu-b"
    assert annotations[f"{PREFIX}expected"] == "4 nvidia.com/gpu"
    assert not (await node(api))["spec"].get("unschedulable")


async def test_a_mig_lend_completes(api: Api, kube: Kube) -> None:
    await boot(api, 2, mig={"1g.10gb": 7})
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    plugin = later(0.3, lambda: boot(api, 2, mig={"1g.10gb": 7}))
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await plugin
    assert cluster.expected is not None
    assert dict(cluster.expected.resources) == {"nvidia.com/mig-1g.10gb": 14}
    assert not (await node(api))["spec"].get("unschedulable")


@pytest.mark.parametrize(("knobs", "advertised"), [
    ({"mig": {"1g.10gb": 7}}, "nvidia.com/mig-1g.10gb"),  # mixed MIG: no nvidia.com/gpu
    ({"resource": "nvidia.com/gpu.shared", "replicas": 4}, "nvidia.com/gpu.shared"),
])
async def test_auto_tells_the_device_plugin_by_its_mig_or_shared_resources(
        api: Api, kube: Kube, knobs: dict[str, Any], advertised: str) -> None:
    """With gpu_api = "auto", a node whose device plugin advertises its GPUs as MIG
    instances (mixed strategy) or renamed time-slices, never as nvidia.com/gpu, is a
    device-plugin node at once: not one that publishes nothing, which the return would
    watch for the whole timeouts.ready (10 min by default) before the uncordon."""
    await boot(api, 2, **knobs)
    none = {"nvidia.com/gpu": "0"}  # renamed, the device plugin advertises no such GPU
    await set_status(api, allocatable=none, capacity=none)
    assert await kube.gpu_api_of("gpu-node", driver="gpu.nvidia.com",
                                 resource="nvidia.com/gpu", timeout=10) == (
        False, f"node gpu-node advertises {advertised} capacity (a device plugin)")


async def test_auto_tells_the_device_plugin_by_its_capacity_with_none_allocatable(
        api: Api, kube: Kube) -> None:
    """Every GPU unhealthy: the plugin's capacity counts them, allocatable none. It is
    still a device-plugin node (read from either, as before the MIG names came in)."""
    await set_status(api, allocatable={"nvidia.com/gpu": "0"},
                     capacity={"nvidia.com/gpu": "2"})
    assert await kube.gpu_api_of("gpu-node", driver="gpu.nvidia.com",
                                 resource="nvidia.com/gpu", timeout=10) == (
        False, "node gpu-node advertises nvidia.com/gpu capacity (a device plugin)")


NODE_WATCH = r"^/api/v1/nodes\?.*watch="


async def test_a_node_short_of_its_expected_gpus_stays_cordoned(
        api: Api, kube: Kube, records: journal.ListSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await boot(api, 2, replicas=4)
    await set_status(api, allocatable={"nvidia.com/gpu": "0"})  # the kubelet restarted
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    plugin = later(0.2, lambda: boot(api, 1, replicas=4))  # one GPU of two came up

    async def short_seen() -> None:
        """The return's wait for the GPUs passes once it has read the node as the plugin
        left it: its watch (the one node watch of a return here) is ended as the server
        ends one, the node is read again, and its time is up at the next watch."""
        await plugin
        await until(lambda: api.proxy.watching("^/api/v1/nodes$"), "the wait for the GPUs")
        asked = len(api.proxy.requests_to("GET", NODE_WATCH))
        api.proxy.drop_watches("^/api/v1/nodes$", clean=True)
        await Clock(kube, monkeypatch).expire_when(
            lambda: len(api.proxy.requests_to("GET", NODE_WATCH)) > asked
            and api.proxy.watching("^/api/v1/nodes$"), api)

    expiry = asyncio.create_task(short_seen())
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    await expiry
    assert problem is not None
    assert "reports 4 allocatable nvidia.com/gpu where 8 were lent" in problem
    assert (await node(api))["spec"]["unschedulable"] is True
    await cluster.flush_events()
    assert [r for t, r, _ in await events(api) if t == "Warning"] == ["ReturnFailed"]


OLD_BOOT = "0b0e1d00-0000-4000-8000-000000000001"
NEW_BOOT = "0b0e1d00-0000-4000-8000-000000000002"


def boot_reader(boot: str, reads: list[str]) -> Callable[[], Awaitable[str]]:
    """What the agent reads in the guest: `boot`, each read kept in `reads`."""
    async def read() -> str:
        reads.append(boot)
        return boot
    return read


async def test_a_return_waits_for_the_kubelet_of_this_boot(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    """The API still has the previous boot's Ready and both GPUs: none of it counts
    until the node's bootID is the guest's, which the new kubelet posts late."""
    await boot(api, 2)
    await set_status(api, nodeInfo={"bootID": OLD_BOOT})
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster, reads = cluster_for(kube), list[str]()
    returned = asyncio.create_task(cluster.give_back(
        ["gpu-a", "gpu-b"], boot_id=boot_reader(NEW_BOOT, reads)))
    await until(lambda: any("waiting for the kubelet of this boot" in e.message
                            for e in records.entries) or returned.done())
    assert not returned.done(), f"returned on the previous boot's status: {returned.result()}"
    assert (await node(api))["spec"]["unschedulable"] is True
    assert "kubelet of this boot" in str(cluster.status()["waiting"])
    # The new kubelet's first post: its bootID, the GPUs not registered yet; then the plugin.
    await set_status(api, nodeInfo={"bootID": NEW_BOOT},
                     allocatable={"nvidia.com/gpu": "0"}, capacity={"nvidia.com/gpu": "0"})
    plugin = later(0.3, lambda: boot(api, 2))
    assert await returned is None
    await plugin
    assert not (await node(api))["spec"].get("unschedulable")
    assert reads == [NEW_BOOT] and cluster.status()["waiting"] is None


def waiting_for_the_boot(api: Api, cluster: KubeCluster) -> Callable[[], bool]:
    """Whether the return (or hot-add) waits on the node's watch for its kubelet of this
    boot: where a test lets its timeout pass (`Clock`) rather than wait it out."""
    return lambda: cluster.waiting is not None and bool(api.proxy.watching("^/api/v1/nodes$"))


async def test_a_node_that_keeps_another_boots_status_stays_cordoned(
        api: Api, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    await boot(api, 2)
    await set_status(api, nodeInfo={"bootID": OLD_BOOT})
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        waiting_for_the_boot(api, cluster), api))
    problem = await cluster.give_back(["gpu-a", "gpu-b"],
                                      boot_id=boot_reader(NEW_BOOT, []))
    await expiry
    assert problem is not None and "kubelet of this boot did not post" in problem
    assert OLD_BOOT in problem and NEW_BOOT in problem
    assert (await node(api))["spec"]["unschedulable"] is True


async def test_each_return_reads_the_boot_id_afresh(
        api: Api, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reclaim stops the lendee with no `lendee_down`: the next return must not
    compare the node with the boot id of the boot before, which its stale status shows."""
    await boot(api, 2)
    await set_status(api, nodeInfo={"bootID": OLD_BOOT})
    cluster, reads = cluster_for(kube), list[str]()
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"],
                                   boot_id=boot_reader(OLD_BOOT, reads)) is None
    # Reclaimed and booted again; the node still shows the last boot's status.
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    clock = Clock(kube, monkeypatch)
    expiry = asyncio.create_task(clock.expire_when(waiting_for_the_boot(api, cluster), api))
    problem = await cluster.give_back(["gpu-a", "gpu-b"],
                                      boot_id=boot_reader(NEW_BOOT, reads))
    await expiry
    assert reads == [OLD_BOOT, NEW_BOOT]
    assert problem is not None and "kubelet of this boot did not post" in problem
    # A hot-add in a boot compares the node with the id its return read.
    assert cluster.boot_id == NEW_BOOT
    expiry = asyncio.create_task(clock.expire_when(waiting_for_the_boot(api, cluster), api))
    assert "kubelet of this boot did not post" in str(await cluster.grow(["gpu-a", "gpu-b"]))
    await expiry


async def test_the_taints_label_and_annotations_are_there_before_the_uncordon(
        api: Api, kube: Kube) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    # Every version of the node from now on, as a watch from now sees them.
    since = (await node(api))["metadata"]["resourceVersion"]
    versions: list[dict[str, Any]] = []

    async def follow() -> None:
        async with k8s_watch.Watch() as stream:
            async for event in stream.stream(api.seed.core.list_node, resource_version=since,
                                             field_selector="metadata.name=gpu-node",
                                             timeout_seconds=30):
                versions.append(api.seed.plain(event["object"]))

    watching = asyncio.create_task(follow())
    try:
        assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None
        final = (await node(api))["metadata"]["resourceVersion"]
        await until(lambda: versions and versions[-1]["metadata"]["resourceVersion"] == final)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
    uncordon = next(i for i, v in enumerate(versions) if not v["spec"].get("unschedulable"))
    # The very version that is schedulable has them all: one write, no version between.
    first = versions[uncordon]
    assert {"key": "hostagent.io/borrowed", "value": "true", "effect": "NoSchedule"} in \
        first["spec"]["taints"]
    assert first["metadata"]["labels"]["hostagent.io/borrowed"] == "true"
    assert first["metadata"]["annotations"][f"{PREFIX}lent-gpus"] == "gpu-a,gpu-b"
    # After it, only the node lifecycle controller's own taint goes.
    for old, new in itertools.pairwise(versions[uncordon:]):
        assert new["metadata"]["labels"] == old["metadata"]["labels"]
        assert {t["key"] for t in old["spec"].get("taints", [])} - \
            {t["key"] for t in new["spec"].get("taints", [])} <= \
            {"node.kubernetes.io/unschedulable", "node.kubernetes.io/not-ready"}


def node_writes(api: Api, since: int) -> list[str]:
    """The PATCHes of gpu-node the API server took, after the proxy's `since`th answer: a
    write refused for a conflict (another writer of the node came first) and made again
    is one write."""
    return [p for m, p, *_, status in list(api.proxy.answers)[since:]
            if m == "PATCH" and p.startswith("/api/v1/nodes/gpu-node") and status < 300]


async def test_a_reclaim_cordons_and_marks_the_node_in_one_write(api: Api, kube: Kube) -> None:
    """What must be in order before the evictions is one read and one write of the
    node (cordon, marker, state, holder, label and taints together), then the list."""
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web")
    since = len(api.proxy.requests)
    assert await cluster.reclaim(["gaming1"]) is None
    asked = [(m, p.split("?")[0]) for m, p, _ in list(api.proxy.requests)[since:]
             if "watch=" not in p]  # the drain's watch of deletions goes beside
    path = asked[:asked.index(("POST", "/api/v1/namespaces/default/pods/web/eviction"))]
    assert [a for a in path if a[1] != "/api/v1/namespaces/default/events"] == [
        ("GET", "/api/v1/nodes/gpu-node"), ("PATCH", "/api/v1/nodes/gpu-node"),
        ("GET", "/api/v1/pods")]
    now = await node(api)
    assert now["spec"]["unschedulable"] is True
    assert now["metadata"]["annotations"][MARKER] == "hostagent"
    assert now["metadata"]["annotations"][f"{PREFIX}state"] == "reclaiming"
    assert now["metadata"]["annotations"][f"{PREFIX}holder"] == "gaming1"
    assert "hostagent.io/borrowed" not in now["metadata"]["labels"]
    assert "hostagent.io/borrowed" not in {t["key"] for t in now["spec"].get("taints", [])}


async def test_a_reclaim_of_a_node_cordoned_by_someone_else_marks_it_and_leaves_the_cordon(
        api: Api, kube: Kube) -> None:
    await api.seed.patch_node("gpu-node", {"spec": {"unschedulable": True}})
    since = len(api.proxy.answers)
    assert await cluster_for(kube).reclaim(["gaming1"]) is None
    assert len(node_writes(api, since)) == 1
    now = await node(api)
    assert now["metadata"]["annotations"][f"{PREFIX}state"] == "reclaiming"
    assert MARKER not in now["metadata"]["annotations"]
    assert await kube.uncordon("gpu-node", marker_prefix=PREFIX) is False


async def test_a_return_marks_and_uncordons_the_node_in_one_write(api: Api, kube: Kube) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    since = len(api.proxy.answers)
    assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None
    assert len(node_writes(api, since)) == 1
    now = await node(api)
    assert not now["spec"].get("unschedulable")
    assert MARKER not in now["metadata"]["annotations"]
    assert now["metadata"]["annotations"][f"{PREFIX}state"] == "lent"


async def test_a_lendee_destroyed_by_hand_comes_back_cordoned_until_verified(
        api: Api, kube: Kube) -> None:
    cluster = cluster_for(kube)
    assert not (await node(api))["spec"].get("unschedulable")  # lent, schedulable
    # virsh destroy: the agent sees the lendee stop, for no reclaim of its own.
    await cluster.lendee_down(why="gpu-node was destroyed")
    assert (await node(api))["spec"]["unschedulable"] is True
    assert (await node(api))["metadata"]["annotations"][MARKER] == "hostagent"
    await set_status(api, conditions=[{"type": "Ready", "status": "False",
                                       "reason": "KubeletNotReady"}],
                     allocatable={"nvidia.com/gpu": "0"})
    # It boots again: Ready first, then the GPUs; cordoned until both are there.
    await set_status(api, conditions=[{"type": "Ready", "status": "True",
                                       "reason": "KubeletReady"}])
    returned = asyncio.create_task(cluster.give_back(["gpu-a", "gpu-b"]))
    # Ready from its first read: the node's watch is the wait for the GPUs, open once
    # the return has seen it Ready without them (one that did not wait would have
    # uncordoned instead, and ended).
    await until(lambda: api.proxy.watching("^/api/v1/nodes$") or returned.done(),
                "the return watching the node for its GPUs")
    assert not returned.done()
    assert (await node(api))["spec"]["unschedulable"] is True
    await boot(api, 2)
    assert await returned is None
    assert not (await node(api))["spec"].get("unschedulable")


async def test_a_return_learns_which_api_serves_the_gpus_from_watches_not_a_poll(
        api: Api, kube: Kube) -> None:
    """The lendee just booted and its device plugin has found no GPU yet: the node
    advertises none and no DRA driver publishes any. gpu_api "auto" watches the node
    and the ResourceSlices and goes on at the event that brings the GPUs; it read both
    again each second, which held a lend's uncordon up to a second after the node was
    Ready with its GPUs (bench/cycle.py, against the real API server)."""
    await boot(api, 0)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    returned = asyncio.create_task(cluster.give_back(["gpu-a", "gpu-b"]))
    try:
        await until(lambda: api.proxy.watching(r"^/api/v1/nodes$")
                    and api.proxy.watching("/resourceslices$"))
        assert not returned.done()
    except BaseException:
        returned.cancel()  # the return must not outlive the test
        with contextlib.suppress(asyncio.CancelledError):
            await returned
        raise
    await boot(api, 2)  # the device plugin publishes
    assert await returned is None
    assert cluster.gpu_api_from == "node gpu-node advertises nvidia.com/gpu capacity " \
        "(a device plugin)"
    assert not (await node(api))["spec"].get("unschedulable")
    # One read of each before the watches, and one as each watch began: no poll.
    lists = [p for p in api.proxy.requests_to("GET", "/resourceslices") if "watch=" not in p]
    assert len(lists) == 2


async def test_the_lendee_going_down_never_takes_an_administrators_cordon(
        api: Api, kube: Kube) -> None:
    await api.seed.patch_node("gpu-node", {"spec": {"unschedulable": True}})  # kubectl cordon
    cluster = cluster_for(kube)
    await cluster.lendee_down()
    assert MARKER not in (await node(api))["metadata"].get("annotations", {})
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert (await node(api))["spec"]["unschedulable"] is True


# --- while lent ----------------------------------------------------------------------------------


async def test_our_marker_on_a_node_uncordoned_by_hand_is_dropped_not_trusted(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    await api.seed.patch_node("gpu-node", {"spec": {"unschedulable": False}})  # kubectl uncordon
    assert not await kube.uncordon("gpu-node", marker_prefix=PREFIX)
    assert MARKER not in (await node(api))["metadata"].get("annotations", {})
    assert "uncordoned by someone else" in result_of(records, "not-ours")[-1].message


async def test_a_gpu_lost_while_lent_turns_health_red_and_is_recorded(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    metrics = FakeMetrics()
    cluster = cluster_for(kube, metrics=metrics)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    await api.seed.pod("train", node="gpu-node", owner="ReplicaSet/t",
                       gpus={"nvidia.com/gpu": 1})
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/w")
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: metrics.gpu_pods and metrics.gpu_pods[-1] == 1)
        assert "1 pod(s) on it use GPUs" in await cluster.health()
        shown = cluster.status()
        assert shown["gpu_pods"] == 1 and shown["allocatable"] == {"nvidia.com/gpu": 2}
        assert shown["expected"] == "2 nvidia.com/gpu (2 GPUs, one nvidia.com/gpu each)"
        await set_status(api, allocatable={"nvidia.com/gpu": "1"})  # one fell off the bus
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match="lost GPUs while lent: it reports 1 "
                                              "allocatable nvidia.com/gpu where 2 were lent"):
            await cluster.health()
        assert metrics.lost == 1
        lost = result_of(records, "gpu-lost")
        assert lost and lost[0].priority is journal.Priority.ERR
        await set_status(api, allocatable={"nvidia.com/gpu": "2"})
        await until(lambda: cluster.trouble is None)
        await cluster.health()
        await set_status(api, conditions=[{"type": "Ready", "status": "Unknown",
                                           "reason": "NodeStatusUnknown"}])
        await until(lambda: cluster.trouble is not None)
        assert "not Ready while lent" in (cluster.trouble or "")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert metrics.gpu_pods[-1] is None  # unknown once not watched
    await cluster.flush_events()
    assert "GPULost" in [r for _, r, _ in await events(api)]


async def test_the_watch_judges_nothing_before_both_its_lists_are_in(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    """The pods' list answers before the node's: no view of a node "deleted while lent"
    (an ERROR on every lend), the first view is of the node as it is, with its pods."""
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.proxy.slow("^/api/v1/nodes$", delay=0.5, times=1, method="GET")
    views: list[Any] = []
    watch = asyncio.create_task(cluster.watch_lent(on_view=views.append))
    try:
        # Each list is in before its watch opens: with both watches open, every view
        # of the lists has been published.
        await until(lambda: api.proxy.watching("^/api/v1/(nodes|pods)$") == 2,
                    "the node and its pods watched")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert [(v.exists, v.gpu_pods) for v in views] == [(True, 0)]
    assert not [e for e in records.entries if "deleted while lent" in e.message]


async def test_a_half_open_watch_is_given_up_and_the_node_listed_again(
        api: Api, tmp_path: Path) -> None:
    """The connections under the lent node's watches go silent without closing (an API
    host that rebooted, an address that moved, a NAT entry dropped): the watch does not
    wait on them for the rest of the lend; it lists again, and sees a GPU lost."""
    timing = Timing(request_timeout=1.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
                    watch_timeout=1.0)
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=timing) as kube:
        cluster = cluster_for(kube)
        await kube.cordon("gpu-node", marker_prefix=PREFIX)
        assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
        views: list[Any] = []
        watch = asyncio.create_task(cluster.watch_lent(on_view=views.append))
        try:
            await until(lambda: views)
            await until(lambda: api.proxy.watching("^/api/v1/nodes$") == 1)
            api.proxy.hold_watches()  # the node's and its pods', and any new one
            await set_status(api, allocatable={"nvidia.com/gpu": "1"})  # one fell off the bus
            await until(lambda: views[-1].allocatable == {"nvidia.com/gpu": 1})
            assert cluster.trouble is not None and "lost GPUs" in cluster.trouble
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


async def test_a_lent_nodes_watch_cut_then_expired_lists_again_and_follows_on(
        api: Api, kube: Kube) -> None:
    """The lent node's watch is cut (a server that died), and the next one is answered
    410 Expired, as the watch cache answers a resourceVersion it no longer holds: the
    node is listed again each time, and a GPU lost after is seen."""
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    views: list[Any] = []
    watch = asyncio.create_task(cluster.watch_lent(on_view=views.append))
    try:
        def asked(watch: bool) -> int:
            return len(api.proxy.requests_to(
                "GET", r"^/api/v1/nodes\?" + (".*watch=" if watch else "(?!.*watch=)")))

        await until(lambda: api.proxy.watching("^/api/v1/nodes$") == 1)
        lists, watches = asked(False), asked(True)
        api.proxy.expire("^/api/v1/nodes$", times=1)
        assert api.proxy.drop_watches("^/api/v1/nodes$") == 1
        await until(lambda: asked(True) == watches + 2)  # the expired one, and the next
        assert asked(False) == lists + 2
        await set_status(api, allocatable={"nvidia.com/gpu": "1"})  # one fell off the bus
        await until(lambda: views[-1].allocatable == {"nvidia.com/gpu": 1})
        assert cluster.trouble is not None and "lost GPUs" in cluster.trouble
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def test_watch_gpu_pods_follows_the_count(api: Api, kube: Kube) -> None:
    cluster = cluster_for(kube)
    seen: list[int] = []

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            if count == 0 and len(seen) > 1:
                return

    task = asyncio.create_task(follow())
    await until(lambda: seen == [0])
    await api.seed.pod("train", node="gpu-node", owner="ReplicaSet/t",
                       gpus={"nvidia.com/gpu": 2})
    await api.seed.pod("mig", node="gpu-node", owner="ReplicaSet/m",
                       gpus={"nvidia.com/mig-1g.10gb": 1})
    await api.seed.pod("done", node="gpu-node", phase="Succeeded",
                       gpus={"nvidia.com/gpu": 1})
    await until(lambda: seen[-1] == 2)
    await api.seed.delete_pod("default", "train", grace=0)
    await api.seed.delete_pod("default", "mig", grace=0)
    await asyncio.wait_for(task, 3)
    assert seen[0] == 0 and seen[-1] == 0 and 2 in seen


# --- telling the cluster -------------------------------------------------------------------------


async def test_events_and_the_borrowed_label_tell_the_cluster(api: Api, kube: Kube) -> None:
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert (await node(api))["metadata"]["labels"]["hostagent.io/borrowed"] == "true"
    assert await cluster.reclaim(["gaming1"]) is None
    assert "hostagent.io/borrowed" not in (await node(api))["metadata"]["labels"]
    await cluster.flush_events()
    said = await events(api)
    assert ("Normal", "Lent", "lent with 2 GPU(s) (gpu-a, gpu-b): 2 nvidia.com/gpu "
            "(2 GPUs, one nvidia.com/gpu each)") in said
    assert ("Normal", "Reclaimed", "GPUs reclaimed for gaming1: draining, then the node's "
            "VM shuts down; evicted pods get their full grace period") in said
    # Under drain.stop = "power-off" the Event says so, not "shuts down".
    off = levers.DrainPolicy(stop=levers.Stop.POWER_OFF, shutdown_when=levers.ShutdownWhen.GONE)
    await cluster.give_back(["gpu-a", "gpu-b"])
    assert await cluster.reclaim(["gaming2"], terms=levers.terms(
        off, players_waiting=False)) is None
    await cluster.flush_events()
    assert ("Normal", "Reclaimed", "GPUs reclaimed for gaming2: draining, then the node's "
            'VM is powered off once every evicted pod is gone (drain.stop = "power-off"; it '
            "shuts down if one stays); evicted pods get their full grace period (nobody is "
            "waiting to play)") in await events(api)
    involved = (await api.seed.events())[0]["involvedObject"]
    assert involved == {"kind": "Node", "name": "gpu-node", "uid": "gpu-node",
                        "apiVersion": "v1"}
    # What `kubectl describe node` shows of them: the events of the node's name.
    out = await asyncio.to_thread(api.seed.plane.kubectl, "get", "events", "-n", "default",
                                  "--field-selector", "involvedObject.name=gpu-node",
                                  "-o", "json")
    assert {"Lent", "Reclaimed"} <= {e["reason"] for e in json.loads(out.stdout)["items"]}


async def test_an_event_slow_to_post_delays_no_drain(api: Api, kube: Kube) -> None:
    """The Event goes beside the reclaim: an API server that takes 1.5 s to take it
    (the test client's requests time out at 2 s) neither delays nor fails the drain."""
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web")
    api.proxy.slow("/events", delay=1.5, method="POST")
    cluster = cluster_for(kube)
    assert await cluster.reclaim(["gaming1"]) is None
    assert await api.seed.get_pod("default", "web") is None
    [(posted, _)] = api.proxy.requests_at("POST", "/events")
    [(evicted, _)] = api.proxy.requests_at("POST", "/eviction")
    assert evicted < posted + 1.5  # the eviction went before the Event's answer
    await cluster.flush_events()
    assert ("Normal", "Reclaimed") in {(t, r) for t, r, _ in await events(api)}


async def test_an_event_the_api_server_refuses_is_journaled_not_lost(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    api.proxy.fail("/events", code=400, method="POST", times=None)
    cluster = cluster_for(kube)
    assert await cluster.reclaim(["gaming1"]) is None
    await cluster.flush_events()
    kept = result_of(records, "not-posted")
    assert len(kept) == 1 and kept[0].fields["HOSTAGENT_REASON"] == "Reclaimed"
    assert "GPUs reclaimed for gaming1" in kept[0].message


async def test_events_beyond_the_bound_are_journaled_at_once(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    from hostagent.cluster.lent import EVENTS_PENDING
    api.proxy.slow("/events", delay=1.0, method="POST")
    cluster = cluster_for(kube)
    for n in range(EVENTS_PENDING + 2):
        cluster._event("Test", f"event {n}")
    kept = result_of(records, "not-posted")
    assert [e.message.rsplit(": ", 1)[1] for e in kept] == [
        f"event {EVENTS_PENDING}", f"event {EVENTS_PENDING + 1}"]
    await cluster.flush_events()
    assert len(result_of(records, "not-posted")) == 2


async def test_unmanaged_pods_left_with_proceed_are_named_before_the_power_off(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    await api.seed.pod("bare", node="gpu-node")
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web")
    assert await cluster_for(kube).reclaim(["gaming1"]) is None
    loud = result_of(records, "killed-without-eviction")
    assert len(loud) == 1 and "default/bare" in loud[0].message
    assert loud[0].priority is journal.Priority.WARNING


async def test_a_regrows_drain_kills_nothing_whatever_the_policy_says(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    """A restart for more GPUs has no player waiting: with on_drain_timeout = "proceed",
    a pod the drain cannot evict stops the regrow, and nothing is evicted for it."""
    await api.seed.pod("bare", node="gpu-node")
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web")
    problem = await cluster_for(kube, config(policy="proceed")).reclaim([], regrow=True)
    assert problem is not None and "default/bare" in problem
    for name in ("bare", "web"):
        pod = await api.seed.get_pod("default", name)
        assert pod is not None and "deletionTimestamp" not in pod["metadata"]
    assert not result_of(records, "killed-without-eviction")


async def test_the_grace_period_override_goes_with_each_eviction(api: Api, kube: Kube) -> None:
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web", grace=300)
    await api.seed.kubelet_gone("gpu-node")  # the evicted pod stays Terminating: read its grace
    cluster = cluster_for(kube, config('grace_period = "7s"\nskip_wait_for_delete_timeout = "0s"'))
    task = asyncio.create_task(cluster.reclaim(["gaming1"]))

    async def deleting() -> bool:
        pod = await api.seed.get_pod("default", "web")
        return pod is not None and "deletionGracePeriodSeconds" in pod["metadata"]

    await until(deleting)
    pod = await api.seed.get_pod("default", "web")
    assert pod is not None and pod["metadata"]["deletionGracePeriodSeconds"] == 7
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_players_reclaim_caps_the_grace_and_says_so(api: Api, kube: Kube) -> None:
    """drain.unplanned_grace: a pod of 300 s is evicted with 10 s; the Event says which
    grace applies; a pod within the cap keeps its own."""
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web", grace=300)
    await api.seed.pod("quick", node="gpu-node", owner="ReplicaSet/quick", grace=5)
    await api.seed.kubelet_gone("gpu-node")  # the evicted pods stay Terminating: read them
    cluster = cluster_for(kube, config('skip_wait_for_delete_timeout = "0s"'))
    said = levers.terms(levers.DrainPolicy(), players_waiting=True)
    accepted = asyncio.Event()
    task = asyncio.create_task(cluster.reclaim(["gaming1"], terms=said,
                                               accepted=accepted.set))

    async def deleting(name: str) -> bool:
        pod = await api.seed.get_pod("default", name)
        return pod is not None and "deletionGracePeriodSeconds" in pod["metadata"]

    await until(lambda: deleting("web"))
    await until(lambda: deleting("quick"))
    graces = {n: (await api.seed.get_pod("default", n) or {})["metadata"]
              ["deletionGracePeriodSeconds"] for n in ("web", "quick")}
    assert graces == {"web": 10, "quick": 5}
    await asyncio.wait_for(accepted.wait(), 5)  # accepted, the pods still there
    assert not task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await cluster.flush_events()
    reclaimed = [m for _, r, m in await events(api) if r == "Reclaimed"]
    assert reclaimed == ["GPUs reclaimed for gaming1: draining, then the node's VM shuts "
                         "down; evicted pods get at most 10 s to stop (drain.unplanned_grace: "
                         "a player is waiting); the node's VM shuts down once every eviction "
                         "is accepted"]


async def test_a_drain_blocked_by_a_budget_is_never_accepted(
        api: Api, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    """`accepted` means every eviction went through: a budget that never allows one
    keeps it from being said, whatever on_drain_timeout does with the drain."""
    await api.seed.pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    await api.seed.pdb("db", match_labels={"app": "db"}, max_unavailable=0)
    said: list[bool] = []
    cluster = cluster_for(kube, config(policy="proceed"))
    # The drain's timeout passes once db-0's eviction was refused and tried again.
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        lambda: len(api.proxy.requests_to("POST", "/pods/db-0/eviction$")) >= 2))
    assert await cluster.reclaim(["gaming1"], accepted=lambda: said.append(True)) is None
    await expiry
    assert said == []


async def test_a_cordon_ahead_is_lifted_only_while_it_is_still_that_one(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    cluster = cluster_for(kube)
    why = "ahead of gaming1's usual hour (Mon 20:00)"
    assert await cluster.cordon_ahead(why) is True
    now = await node(api)
    assert now["spec"]["unschedulable"] is True
    assert now["metadata"]["annotations"][f"{PREFIX}cordoned-for"] == why
    assert cluster.status()["cordoned_for"] == why
    await cluster.uncordon_ahead("it passed without a start")
    now = await node(api)
    assert not now["spec"].get("unschedulable")
    assert f"{PREFIX}cordoned-for" not in now["metadata"]["annotations"]
    assert [e.fields["HOSTAGENT_RESULT"] for e in records.entries
            if e.fields.get("HOSTAGENT_EVENT") == "ahead"] == ["cordoned", "uncordoned"]
    # A reclaim takes the cordon over: its write drops the reason, nothing lifts it then.
    assert await cluster.cordon_ahead(why) is True
    assert await cluster.reclaim(["gaming1"]) is None
    await cluster.uncordon_ahead("it passed without a start")
    assert (await node(api))["spec"]["unschedulable"] is True


# --- credentials the API server refuses ------------------------------------------------------------


async def test_a_403_stops_the_reclaim_even_with_proceed(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    api.proxy.fail(r"/api/v1/nodes/gpu-node$", code=403, method="PATCH", times=None)
    problem = await cluster_for(kube, config(policy="proceed")).reclaim(["gaming1"])
    assert problem is not None and "lack a right" in problem and "403" in problem
    assert [e.fields["HOSTAGENT_RESULT"] for e in records.entries
            if e.fields.get("HOSTAGENT_EVENT") == "drain"] == ["unauthorized"]


async def test_a_403_on_an_eviction_is_not_an_incomplete_drain(api: Api, kube: Kube) -> None:
    await api.seed.pod("web", node="gpu-node", owner="ReplicaSet/web")
    api.proxy.fail(r"/eviction$", code=403, times=None)
    problem = await cluster_for(kube, config(policy="proceed")).reclaim(["gaming1"])
    assert problem is not None and "403" in problem


async def test_a_401_reads_the_kubeconfig_again(api: Api, plane: ControlPlane,
                                                tmp_path: Path) -> None:
    """The real API server's 401 for a token it does not know; then the kubeconfig is
    rewritten (k3s rotated the credentials) and the next call reads it again."""
    kubeconfig = tmp_path / "kc"
    admin = json.loads(plane.admin.read_text())
    expired = json.loads(plane.admin.read_text())
    expired["users"][0]["user"] = {"token": "expired"}
    kubeconfig.write_text(json.dumps(expired))
    async with await Kube.connect(kubeconfig, timing=FAST) as kube:
        with pytest.raises(KubeAuthError, match="does not accept hostagent's credentials"):
            await kube.cordon("gpu-node", marker_prefix=PREFIX)
        kubeconfig.write_text(json.dumps(admin))
        result = await kube.cordon("gpu-node", marker_prefix=PREFIX)
        assert result.cordoned_by_us


async def test_a_watch_refused_with_403_keeps_health_red_until_fixed(
        api: Api, kube: Kube) -> None:
    cluster = cluster_for(kube)
    cluster.auth_retry = 0.05
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.proxy.fail(r"/api/v1/nodes$", code=403, method="GET", times=None)
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match="cannot watch node gpu-node: .*403"):
            await cluster.health()
        api.proxy.clear_faults()  # RBAC fixed
        await until(lambda: cluster.trouble is None)
        assert cluster.view is not None and cluster.view.ready
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
