"""The cluster's half of a cycle against the API stand-in: what a lend must show
(time-slicing, MIG), the order of a return, cordon when the lendee goes down, the node
watched while lent, Events, and credentials the API server refuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent import journal
from hostagent.cluster import KubeCluster
from hostagent.config import Config, parse
from hostagent.health import CheckFailed
from hostagent.kube import Kube, KubeAuthError, Timing, cordon_marker, expected_gpus
from tests.kubeapi import StandIn, write_kubeconfig
from tests.kubeapi.cluster import gpu_status
from tests.kubeapi.rules import EVENTS, NODES
from tests.unit.kube_scaffold import FAST

PREFIX = "hostagent.io/"
MARKER = cordon_marker(PREFIX)
TAINT = "hostagent.io/borrowed=true:NoSchedule"


def config(extra: str = 'skip_wait_for_delete_timeout = "1s"',
           policy: str = "proceed") -> Config:
    return parse(f"""
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b"]

[gpus.gpu-a]
pci = "0000:01:00.0"

[gpus.gpu-b]
pci = "0000:02:00.0"

[timeouts]
drain = "5s"
ready = "3s"

[policy]
on_drain_timeout = "{policy}"

[kubernetes]
lent_taints = ["{TAINT}"]
{extra}
""", "test.toml")


def result_of(records: journal.ListSink, result: str) -> list[journal.Entry]:
    return [e for e in records.entries if e.fields.get("HOSTAGENT_RESULT") == result]


class FakeMetrics:
    def __init__(self) -> None:
        self.gpu_pods: list[int | None] = []
        self.lost = 0

    def node_gpu_pods(self, count: int | None) -> None:
        self.gpu_pods.append(count)

    def gpu_lost(self) -> None:
        self.lost += 1


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=0.005) as standin:
        standin.cluster.add_node("gpu-node", gpus=2)
        standin.cluster.add_node("cpu-node")
        yield standin


def cluster_for(kube: Kube, cfg: Config | None = None,
                metrics: FakeMetrics | None = None) -> KubeCluster:
    return KubeCluster(kube, cfg or config(), remember_cordon=lambda _: None, metrics=metrics)


def set_status(api: StandIn, node: str = "gpu-node", **status: Any) -> None:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["status"].update(status)
        return obj

    api.cluster.update(NODES, None, node, change, subresource="status")


def relabel(api: StandIn, labels: dict[str, str], node: str = "gpu-node") -> None:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["labels"] = {k: v for k, v in obj["metadata"]["labels"].items()
                                     if not k.startswith("nvidia.com/")} | labels
        return obj

    api.cluster.update(NODES, None, node, change)


def boot(api: StandIn, gpus: int, **knobs: Any) -> None:
    """The lendee booted with `gpus` GPUs: the device plugin and GFD publish them."""
    labels, allocatable = gpu_status(gpus, **knobs)
    relabel(api, labels)
    set_status(api, allocatable=allocatable, capacity=allocatable)


def later(seconds: float, fn: Any, *args: Any, **kwargs: Any) -> None:
    asyncio.get_running_loop().call_later(seconds, lambda: fn(*args, **kwargs))


def node(api: StandIn) -> dict[str, Any]:
    return api.cluster.node("gpu-node")


def events(api: StandIn) -> list[tuple[str, str, str]]:
    listed = api.cluster.list(EVENTS, None)["items"]
    return [(e["type"], e["reason"], e["message"]) for e in listed]


async def until(condition: Any, timeout: float = 3.0) -> None:
    # Polled: the condition reads state that has no event to wait on.
    async with asyncio.timeout(timeout):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


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


async def test_a_time_sliced_lend_completes(api: StandIn, kube: Kube) -> None:
    boot(api, 2, replicas=4)  # what the last lend left
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    # Partial lending: one GPU this time; the device plugin says so a little later.
    later(0.3, boot, api, 1, replicas=4)
    assert await cluster.give_back({"gpu-b"}) is None
    assert cluster.expected is not None and dict(cluster.expected.resources) == {
        "nvidia.com/gpu": 4}
    annotations = node(api)["metadata"]["annotations"]
    assert annotations[f"{PREFIX}lent-gpus"] == "gpu-b"
    assert annotations[f"{PREFIX}expected"] == "4 nvidia.com/gpu"
    assert not node(api)["spec"].get("unschedulable")


async def test_a_mig_lend_completes(api: StandIn, kube: Kube) -> None:
    boot(api, 2, mig={"1g.10gb": 7})
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    later(0.3, boot, api, 2, mig={"1g.10gb": 7})
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert cluster.expected is not None
    assert dict(cluster.expected.resources) == {"nvidia.com/mig-1g.10gb": 14}
    assert not node(api)["spec"].get("unschedulable")


async def test_a_node_short_of_its_expected_gpus_stays_cordoned(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    boot(api, 2, replicas=4)
    set_status(api, allocatable={"nvidia.com/gpu": "0"})  # the kubelet restarted
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    cluster = cluster_for(kube)
    later(0.2, boot, api, 1, replicas=4)  # one GPU of two came up
    problem = await cluster.give_back(["gpu-a", "gpu-b"])
    assert problem is not None
    assert "reports 4 allocatable nvidia.com/gpu where 8 were lent" in problem
    assert node(api)["spec"]["unschedulable"] is True
    await cluster.flush_events()
    assert [r for t, r, _ in events(api) if t == "Warning"] == ["ReturnFailed"]


async def test_the_taints_label_and_annotations_are_there_before_the_uncordon(
        api: StandIn, kube: Kube) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    since = api.cluster.resource_version
    assert await cluster_for(kube).give_back(["gpu-a", "gpu-b"]) is None
    changes = [c for c in api.cluster.changes
               if c.rv > since and c.resource is NODES and c.obj["metadata"]["name"] == "gpu-node"]
    uncordon = next(i for i, c in enumerate(changes)
                    if c.old and c.old["spec"].get("unschedulable")
                    and not c.obj["spec"].get("unschedulable"))
    before = changes[uncordon].old
    assert before is not None
    assert {"key": "hostagent.io/borrowed", "value": "true", "effect": "NoSchedule"} in \
        before["spec"]["taints"]
    assert before["metadata"]["labels"]["hostagent.io/borrowed"] == "true"
    assert before["metadata"]["annotations"][f"{PREFIX}lent-gpus"] == "gpu-a,gpu-b"
    # After it, only the node lifecycle controller's own taint goes.
    for later_change in changes[uncordon + 1:]:
        assert later_change.old is not None
        assert later_change.obj["metadata"]["labels"] == later_change.old["metadata"]["labels"]
        assert {t["key"] for t in later_change.old["spec"]["taints"]} - \
            {t["key"] for t in later_change.obj["spec"].get("taints", [])} <= \
            {"node.kubernetes.io/unschedulable"}


async def test_a_lendee_destroyed_by_hand_comes_back_cordoned_until_verified(
        api: StandIn, kube: Kube) -> None:
    cluster = cluster_for(kube)
    assert not node(api)["spec"].get("unschedulable")  # lent, schedulable
    # virsh destroy: the agent sees the lendee stop, for no reclaim of its own.
    await cluster.lendee_down(why="gpu-node was destroyed")
    assert node(api)["spec"]["unschedulable"] is True
    assert node(api)["metadata"]["annotations"][MARKER] == "hostagent"
    set_status(api, conditions=[{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}],
               allocatable={"nvidia.com/gpu": "0"})
    # It boots again: Ready first, then the GPUs; cordoned until both are there.
    returned = asyncio.create_task(cluster.give_back(["gpu-a", "gpu-b"]))
    later(0.2, set_status, api, conditions=[{"type": "Ready", "status": "True",
                                             "reason": "KubeletReady"}])
    await asyncio.sleep(0.4)
    assert node(api)["spec"]["unschedulable"] is True
    boot(api, 2)
    assert await returned is None
    assert not node(api)["spec"].get("unschedulable")


async def test_the_lendee_going_down_never_takes_an_administrators_cordon(
        api: StandIn, kube: Kube) -> None:
    def cordon_by_hand(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["unschedulable"] = True
        return obj

    api.cluster.update(NODES, None, "gpu-node", cordon_by_hand)
    cluster = cluster_for(kube)
    await cluster.lendee_down()
    assert MARKER not in node(api)["metadata"].get("annotations", {})
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert node(api)["spec"]["unschedulable"] is True


# --- while lent ----------------------------------------------------------------------------------


async def test_our_marker_on_a_node_uncordoned_by_hand_is_dropped_not_trusted(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)

    def uncordon(obj: dict[str, Any]) -> dict[str, Any]:  # kubectl uncordon
        obj["spec"]["unschedulable"] = False
        return obj
    api.cluster.update(NODES, None, "gpu-node", uncordon)
    assert not await kube.uncordon("gpu-node", marker_prefix=PREFIX)
    assert MARKER not in node(api)["metadata"].get("annotations", {})
    assert "uncordoned by someone else" in result_of(records, "not-ours")[-1].message


async def test_a_gpu_lost_while_lent_turns_health_red_and_is_recorded(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    metrics = FakeMetrics()
    cluster = cluster_for(kube, metrics=metrics)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.cluster.add_pod("train", node="gpu-node", owner="ReplicaSet/t",
                        gpus={"nvidia.com/gpu": 1})
    api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/w")
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: metrics.gpu_pods and metrics.gpu_pods[-1] == 1)
        assert "1 pod(s) on it use GPUs" in await cluster.health()
        shown = cluster.status()
        assert shown["gpu_pods"] == 1 and shown["allocatable"] == {"nvidia.com/gpu": 2}
        assert shown["expected"] == "2 nvidia.com/gpu (2 GPUs, one nvidia.com/gpu each)"
        set_status(api, allocatable={"nvidia.com/gpu": "1"})  # one fell off the bus
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match="lost GPUs while lent: it reports 1 "
                                              "allocatable nvidia.com/gpu where 2 were lent"):
            await cluster.health()
        assert metrics.lost == 1
        lost = result_of(records, "gpu-lost")
        assert lost and lost[0].priority is journal.Priority.ERR
        set_status(api, allocatable={"nvidia.com/gpu": "2"})
        await until(lambda: cluster.trouble is None)
        await cluster.health()
        set_status(api, conditions=[{"type": "Ready", "status": "Unknown",
                                     "reason": "NodeStatusUnknown"}])
        await until(lambda: cluster.trouble is not None)
        assert "not Ready while lent" in (cluster.trouble or "")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert metrics.gpu_pods[-1] is None  # unknown once not watched
    await cluster.flush_events()
    assert "GPULost" in [r for _, r, _ in events(api)]


async def test_the_watch_judges_nothing_before_both_its_lists_are_in(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    """The pods' list answers before the node's: no view of a node "deleted while lent"
    (an ERROR on every lend), the first view is of the node as it is, with its pods."""
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.slow("^/api/v1/nodes$", delay=0.5, times=1, method="GET")
    views: list[Any] = []
    watch = asyncio.create_task(cluster.watch_lent(on_view=views.append))
    try:
        await until(lambda: views)
        await asyncio.sleep(0.2)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert [(v.exists, v.gpu_pods) for v in views] == [(True, 0)]
    assert not [e for e in records.entries if "deleted while lent" in e.message]


class BlackHole:
    """A TCP relay to the API server whose connections can be cut without a word: after
    `freeze`, what they carry is dropped both ways and they stay open (an API host that
    rebooted, an address that moved, a NAT entry dropped). New connections go through."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("http://").partition(":")
        self.target = (host, int(port))
        self.frozen: set[asyncio.StreamWriter] = set()
        self.live: set[asyncio.StreamWriter] = set()
        self.closed = asyncio.Event()
        self.url = ""

    async def __aenter__(self) -> BlackHole:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        self.closed.set()
        for writer in self.live:
            writer.close()

    def freeze(self) -> None:
        self.frozen |= self.live

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:  # the API server is gone (the test is over)
            writer.close()
            return
        self.live |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if writer not in self.frozen:
                        dst.write(data)
            if writer in self.frozen:  # a dead peer never says goodbye
                await self.closed.wait()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def test_a_half_open_watch_is_given_up_and_the_node_listed_again(
        api: StandIn, tmp_path: Path) -> None:
    """The connection under the lent node's watch goes silent without closing: the watch
    does not wait on it for the rest of the lend; it lists again, and sees a GPU lost."""
    timing = Timing(request_timeout=1.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
                    watch_timeout=1.0)
    async with BlackHole(api.url) as hole, await Kube.connect(
            write_kubeconfig(tmp_path / "kc", hole.url), timing=timing) as kube:
        cluster = cluster_for(kube)
        await kube.cordon("gpu-node", marker_prefix=PREFIX)
        assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
        views: list[Any] = []
        watch = asyncio.create_task(cluster.watch_lent(on_view=views.append))
        try:
            await until(lambda: views)
            hole.freeze()
            set_status(api, allocatable={"nvidia.com/gpu": "1"})  # one fell off the bus
            await until(lambda: views[-1].allocatable == {"nvidia.com/gpu": 1}, timeout=10)
            assert cluster.trouble is not None and "lost GPUs" in cluster.trouble
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


async def test_watch_gpu_pods_follows_the_count(api: StandIn, kube: Kube) -> None:
    cluster = cluster_for(kube)
    seen: list[int] = []

    async def follow() -> None:
        async for count in cluster.watch_gpu_pods():
            seen.append(count)
            if count == 0 and len(seen) > 1:
                return

    task = asyncio.create_task(follow())
    await until(lambda: seen == [0])
    api.cluster.add_pod("train", node="gpu-node", owner="ReplicaSet/t",
                        gpus={"nvidia.com/gpu": 2})
    api.cluster.add_pod("mig", node="gpu-node", owner="ReplicaSet/m",
                        gpus={"nvidia.com/mig-1g.10gb": 1})
    api.cluster.add_pod("done", node="gpu-node", phase="Succeeded",
                        gpus={"nvidia.com/gpu": 1})
    await until(lambda: seen[-1] == 2)
    from tests.kubeapi.rules import PODS
    api.cluster.delete(PODS, "default", "train", {"gracePeriodSeconds": 0})
    api.cluster.delete(PODS, "default", "mig", {"gracePeriodSeconds": 0})
    await asyncio.wait_for(task, 3)
    assert seen[0] == 0 and seen[-1] == 0 and 2 in seen


# --- telling the cluster -------------------------------------------------------------------------


async def test_events_and_the_borrowed_label_tell_the_cluster(api: StandIn, kube: Kube) -> None:
    cluster = cluster_for(kube)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    assert node(api)["metadata"]["labels"]["hostagent.io/borrowed"] == "true"
    assert await cluster.reclaim(["gaming1"]) is None
    assert "hostagent.io/borrowed" not in node(api)["metadata"]["labels"]
    await cluster.flush_events()
    said = events(api)
    assert ("Normal", "Lent", "lent with 2 GPU(s) (gpu-a, gpu-b): 2 nvidia.com/gpu "
            "(2 GPUs, one nvidia.com/gpu each)") in said
    assert ("Normal", "Reclaimed", "GPUs reclaimed for gaming1: draining, then the node's "
            "VM shuts down") in said
    involved = api.cluster.list(EVENTS, None)["items"][0]["involvedObject"]
    assert involved == {"kind": "Node", "name": "gpu-node", "uid": "gpu-node",
                        "apiVersion": "v1"}


async def test_unmanaged_pods_left_with_proceed_are_named_before_the_power_off(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    api.cluster.add_pod("bare", node="gpu-node")
    api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/web")
    assert await cluster_for(kube).reclaim(["gaming1"]) is None
    loud = result_of(records, "killed-without-eviction")
    assert len(loud) == 1 and "default/bare" in loud[0].message
    assert loud[0].priority is journal.Priority.WARNING


async def test_a_regrows_drain_kills_nothing_whatever_the_policy_says(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    """A restart for more GPUs has no player waiting: with on_drain_timeout = "proceed",
    a pod the drain cannot evict stops the regrow, and nothing is evicted for it."""
    api.cluster.add_pod("bare", node="gpu-node")
    api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/web")
    problem = await cluster_for(kube, config(policy="proceed")).reclaim([], regrow=True)
    assert problem is not None and "default/bare" in problem
    assert api.cluster.pod("default", "bare") and api.cluster.pod("default", "web")
    assert not result_of(records, "killed-without-eviction")


async def test_the_grace_period_override_goes_with_each_eviction(
        api: StandIn, kube: Kube) -> None:
    def stop_kubelet() -> None:  # keep the evicted pod Terminating, to read its grace
        set_status(api, conditions=[{"type": "Ready", "status": "Unknown"}])

    api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/web", grace=300)
    stop_kubelet()
    cluster = cluster_for(kube, config('grace_period = "7s"\nskip_wait_for_delete_timeout = "0s"'))
    task = asyncio.create_task(cluster.reclaim(["gaming1"]))
    await until(lambda: (api.cluster.pod("default", "web") or {}).get("metadata", {})
                .get("deletionGracePeriodSeconds") is not None)
    assert api.cluster.pod("default", "web")["metadata"]["deletionGracePeriodSeconds"] == 7  # type: ignore[index]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# --- credentials the API server refuses ------------------------------------------------------------


async def test_a_403_stops_the_reclaim_even_with_proceed(
        api: StandIn, kube: Kube, records: journal.ListSink) -> None:
    api.fail(r"/api/v1/nodes/gpu-node$", code=403, method="PATCH", times=None)
    problem = await cluster_for(kube, config(policy="proceed")).reclaim(["gaming1"])
    assert problem is not None and "lack a right" in problem and "403" in problem
    assert [e.fields["HOSTAGENT_RESULT"] for e in records.entries
            if e.fields.get("HOSTAGENT_EVENT") == "drain"] == ["unauthorized"]


async def test_a_403_on_an_eviction_is_not_an_incomplete_drain(api: StandIn, kube: Kube) -> None:
    api.cluster.add_pod("web", node="gpu-node", owner="ReplicaSet/web")
    api.fail(r"/eviction$", code=403, times=None)
    problem = await cluster_for(kube, config(policy="proceed")).reclaim(["gaming1"])
    assert problem is not None and "403" in problem


async def test_a_401_reads_the_kubeconfig_again(tmp_path: Path) -> None:
    async with StandIn(token="rotated") as api:
        api.cluster.add_node("gpu-node", gpus=1)
        kubeconfig = write_kubeconfig(tmp_path / "kc", api.url, token="expired")
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            with pytest.raises(KubeAuthError, match="does not accept hostagent's credentials"):
                await kube.cordon("gpu-node", marker_prefix=PREFIX)
            write_kubeconfig(kubeconfig, api.url, token="rotated")  # k3s rotated the cert
            result = await kube.cordon("gpu-node", marker_prefix=PREFIX)
            assert result.cordoned_by_us


async def test_a_watch_refused_with_403_keeps_health_red_until_fixed(
        api: StandIn, kube: Kube) -> None:
    cluster = cluster_for(kube)
    cluster.auth_retry = 0.05
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster.give_back(["gpu-a", "gpu-b"]) is None
    api.fail(r"/api/v1/nodes$", code=403, method="GET", times=None)
    watch = asyncio.create_task(cluster.watch_lent())
    try:
        await until(lambda: cluster.trouble is not None)
        with pytest.raises(CheckFailed, match="cannot watch node gpu-node: .*403"):
            await cluster.health()
        api.clear_faults()  # RBAC fixed
        await until(lambda: cluster.trouble is None)
        assert cluster.view is not None and cluster.view.ready
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
