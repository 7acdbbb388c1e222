"""The Kubernetes adapter against the API stand-in: cordon, drain, wait, uncordon, faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent import journal
from hostagent.config import DrainTimeoutAction
from hostagent.kube import (
    DrainAborted,
    ExpectedGpus,
    Ignored,
    Kube,
    KubeConfigError,
    KubeUnavailable,
    LeftPod,
    LeftReason,
    NodeNotFound,
    NodeNotReady,
    PodInfo,
    PodRef,
    Taint,
    Timing,
    cordon_marker,
    plan_drain,
)
from tests.kubeapi import StandIn, write_kubeconfig
from tests.kubeapi.cluster import UNSCHEDULABLE_TAINT, ready_condition
from tests.kubeapi.rules import NODES, PODS

PREFIX = "hostagent.io/"
MARKER = cordon_marker(PREFIX)
PROCEED, ABORT = DrainTimeoutAction.PROCEED, DrainTimeoutAction.ABORT
FAST = Timing(
    request_timeout=2.0,
    api_timeout=3.0,
    backoff_min=0.02,
    backoff_max=0.1,
    evict_retry=0.05,
    delete_poll=0.02,
    watch_timeout=5.0,
)
SCALE = 0.005  # a 30 s grace period takes 0.15 s


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=SCALE) as standin:
        standin.cluster.add_node("gpu-node", gpus=2)
        standin.cluster.add_node("other")
        yield standin


@pytest.fixture
def kubeconfig(api: StandIn, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", api.url)


@pytest.fixture
async def kube(kubeconfig: Path) -> AsyncIterator[Kube]:
    async with await Kube.connect(kubeconfig, timing=FAST) as k:
        yield k


def names(pods: Any) -> list[str]:
    return sorted(str(p) for p in pods)


def on_node(api: StandIn, node: str = "gpu-node") -> list[str]:
    return sorted(p["metadata"]["name"] for p in api.cluster.pods(node))


def set_node_status(api: StandIn, node: str, **status: Any) -> None:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["status"].update(status)
        return obj

    api.cluster.update(NODES, None, node, change, subresource="status")


def gpus(n: int) -> ExpectedGpus:
    return ExpectedGpus(tuple(f"gpu{i}" for i in range(n)), {"nvidia.com/gpu": n}, "test")


def later(seconds: float, fn: Any, *args: Any) -> None:
    asyncio.get_running_loop().call_later(seconds, fn, *args)


# --- the plan (no I/O) -------------------------------------------------------------------


def info(name: str, **kw: Any) -> PodInfo:
    return PodInfo(ref=PodRef("default", name, f"uid-{name}"), **kw)


def test_the_filters_apply_in_kubectl_order() -> None:
    plan = plan_drain(
        [
            info("a-terminating-daemon", deleting=True, controller="DaemonSet"),
            info("b-daemon-with-scratch", controller="DaemonSet", emptydir=True),
            info("c-mirror", mirror=True, controller="Node"),
            info("c-static-unmanaged-mirror", mirror=True),
            info("d-done-job-scratch", phase="Succeeded", emptydir=True),
            info("e-scratch-and-bare", emptydir=True),
            info("f-bare"),
            info("g-web", controller="ReplicaSet"),
        ],
        emptydir_ok=False,
        unmanaged_ok=False,
    )
    assert names(plan.wait) == ["default/a-terminating-daemon"]
    assert [(str(p), why) for p, why in plan.ignored] == [
        ("default/b-daemon-with-scratch", Ignored.DAEMONSET),
        ("default/c-mirror", Ignored.MIRROR),
        ("default/c-static-unmanaged-mirror", Ignored.MIRROR),
    ]
    assert names(plan.evict) == ["default/d-done-job-scratch", "default/g-web"]
    assert [(str(p.pod), p.reason) for p in plan.refused] == [
        ("default/e-scratch-and-bare", LeftReason.EMPTYDIR),
        ("default/f-bare", LeftReason.UNMANAGED),
    ]


def test_consent_lets_emptydir_and_unmanaged_pods_go() -> None:
    plan = plan_drain(
        [info("scratch", controller="ReplicaSet", emptydir=True), info("bare")],
        emptydir_ok=True,
        unmanaged_ok=True,
    )
    assert names(plan.evict) == ["default/bare", "default/scratch"]
    assert not plan.refused


# --- connecting ----------------------------------------------------------------------------


async def test_a_missing_kubeconfig_is_a_clear_startup_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError) as caught:
        await Kube.connect(tmp_path / "k3s.yaml")
    assert str(caught.value) == (
        f"kubernetes.kubeconfig {tmp_path / 'k3s.yaml'}: no such file; set kubernetes.kubeconfig "
        "to the cluster's kubeconfig (a k3s server writes /etc/rancher/k3s/k3s.yaml), "
        "or remove the [kubernetes] section"
    )


async def test_a_directory_or_garbage_is_not_a_kubeconfig(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="is a directory"):
        await Kube.connect(tmp_path)
    garbage = tmp_path / "kubeconfig"
    garbage.write_text("clusters: [\n")
    with pytest.raises(KubeConfigError, match=f"kubeconfig {garbage}: not usable"):
        await Kube.connect(garbage)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
async def test_an_unreadable_kubeconfig_says_so(kubeconfig: Path) -> None:
    kubeconfig.chmod(0)
    with pytest.raises(KubeConfigError, match="permission denied"):
        await Kube.connect(kubeconfig)


async def test_a_node_that_does_not_exist_is_reported_not_raised(
    kube: Kube, api: StandIn
) -> None:
    found = await kube.check_node("gpu-node")
    assert found.exists and found.ready and str(found) == "node gpu-node is Ready"
    # Not fatal at start: the node registers again when the lendee's kubelet starts.
    missing = await kube.check_node("gpu-nod")
    assert not missing.exists
    assert str(missing) == (
        "node gpu-nod is not in the cluster; it registers when the lendee's kubelet starts"
    )
    assert missing.detail == (
        f"node gpu-nod does not exist in the cluster at {api.url}; "
        "set lendee.node to a name `kubectl get nodes` lists"
    )
    with pytest.raises(NodeNotFound):
        await kube.cordon("gpu-nod", marker_prefix=PREFIX)


async def test_an_unreachable_api_is_unavailable_after_the_timeout(
    kube: Kube, api: StandIn
) -> None:
    await api.down()
    with pytest.raises(KubeUnavailable, match="could not read node gpu-node: the API server at"):
        await kube.check_node("gpu-node", timeout=0.3)


# --- cordon and uncordon ----------------------------------------------------------------------


async def test_cordon_marks_the_node_and_uncordon_lifts_it(kube: Kube, api: StandIn) -> None:
    result = await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert (result.cordoned_by_us, result.was_cordoned, result.by_someone_else) == (
        True,
        False,
        False,
    )
    node = api.cluster.node("gpu-node")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"][MARKER] == "hostagent"
    assert f"{PREFIX}cordoned-at" in node["metadata"]["annotations"]
    again = await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert (again.cordoned_by_us, again.was_cordoned) == (True, True)
    assert await kube.uncordon("gpu-node", marker_prefix=PREFIX) is True
    node = api.cluster.node("gpu-node")
    assert "unschedulable" not in node["spec"]
    assert "annotations" not in node["metadata"]
    assert "taints" not in node["spec"]


async def test_an_administrators_cordon_survives_a_whole_cycle(
    kube: Kube, api: StandIn, records: journal.ListSink
) -> None:
    api.cluster.add_node("admin", unschedulable=True, annotations={"note": "disk check"})
    result = await kube.cordon("admin", marker_prefix=PREFIX)
    assert result.by_someone_else and not result.cordoned_by_us
    assert await kube.drain(
        "admin", timeout=1, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert await kube.uncordon("admin", marker_prefix=PREFIX) is False
    node = api.cluster.node("admin")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"] == {"note": "disk check"}
    messages = [e.message for e in records.entries]
    assert (
        "admin was already cordoned by someone else; hostagent will leave it cordoned" in messages
    )
    assert "left admin as it is: hostagent did not cordon it" in messages


async def test_the_marker_on_the_node_outlives_the_agent(api: StandIn, kubeconfig: Path) -> None:
    async with await Kube.connect(kubeconfig, timing=FAST) as first:
        await first.cordon("gpu-node", marker_prefix=PREFIX)
    async with await Kube.connect(kubeconfig, timing=FAST) as restarted:
        again = await restarted.cordon("gpu-node", marker_prefix=PREFIX)
        assert again.cordoned_by_us
        assert await restarted.uncordon("gpu-node", marker_prefix=PREFIX) is True
    assert "unschedulable" not in api.cluster.node("gpu-node")["spec"]


async def test_a_write_between_read_and_patch_is_retried(kube: Kube, api: StandIn) -> None:
    # A label written while the cordon's patch is in flight makes that patch stale (409).
    api.slow(r"/nodes/gpu-node$", delay=0.1, times=1, method="PATCH")
    later(0.05, api.cluster.patch, NODES, None, "gpu-node", "application/merge-patch+json",
          b'{"metadata": {"labels": {"zone": "b"}}}')  # fmt: skip
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    node = api.cluster.node("gpu-node")
    assert node["spec"]["unschedulable"] and node["metadata"]["labels"]["zone"] == "b"
    assert len(api.requests_to("PATCH", r"/nodes/gpu-node$")) == 2


async def test_annotations_and_taints_keep_what_others_put_there(kube: Kube, api: StandIn) -> None:
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    lent = Taint("hostagent.io/borrowed", "NoSchedule", "true")
    await kube.annotate(
        "gpu-node", {f"{PREFIX}state": "lent", f"{PREFIX}holder": None}, add_taints=[lent]
    )
    node = api.cluster.node("gpu-node")
    assert node["metadata"]["annotations"][f"{PREFIX}state"] == "lent"
    assert [(t["key"], t.get("value")) for t in node["spec"]["taints"]] == [
        (UNSCHEDULABLE_TAINT, None),
        ("hostagent.io/borrowed", "true"),
    ]
    await kube.annotate(
        "gpu-node",
        {f"{PREFIX}state": "reclaimed", f"{PREFIX}holder": "gaming1"},
        remove_taints=[Taint("hostagent.io/borrowed")],
    )
    node = api.cluster.node("gpu-node")
    assert [t["key"] for t in node["spec"]["taints"]] == [UNSCHEDULABLE_TAINT]
    assert node["metadata"]["annotations"][f"{PREFIX}holder"] == "gaming1"
    assert node["metadata"]["annotations"][MARKER] == "hostagent"


# --- drain ------------------------------------------------------------------------------------


async def test_drain_evicts_what_kubectl_would_and_leaves_the_rest(
    kube: Kube, api: StandIn, records: journal.ListSink
) -> None:
    c = api.cluster
    c.add_pod("logs-x1", node="gpu-node", owner="DaemonSet/logs", namespace="kube-system")
    c.add_pod("kube-proxy-gpu-node", node="gpu-node", mirror=True, namespace="kube-system")
    c.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web", labels={"app": "web"})
    c.add_pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    c.add_pod("report-7", node="gpu-node", phase="Succeeded")  # a completed bare pod
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert report.complete, report.summary()
    assert names(report.evicted) == ["default/db-0", "default/report-7", "default/web-1"]
    assert [(str(p), why) for p, why in report.ignored] == [
        ("kube-system/kube-proxy-gpu-node", Ignored.MIRROR),
        ("kube-system/logs-x1", Ignored.DAEMONSET),
    ]
    assert on_node(api) == ["kube-proxy-gpu-node", "logs-x1"]
    # Replacements exist, with new UIDs, and nobody waited for them.
    assert c.pod("default", "db-0") is not None
    assert len([p for p in c.pods() if p["metadata"]["name"].startswith("web-")]) == 1
    (entry,) = [e for e in records.entries if e.fields.get("HOSTAGENT_EVENT") == "drain"]
    assert entry.fields["HOSTAGENT_RESULT"] == "ok"
    assert entry.message.startswith("drained gpu-node in ")
    assert entry.message.endswith(": 3 pods evicted")


async def test_a_pod_already_terminating_is_waited_for(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("going", node="gpu-node", owner="ReplicaSet/going", grace=40)
    api.cluster.delete(PODS, "default", "going")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert names(report.waited) == ["default/going"] and not report.evicted
    assert on_node(api) == []


async def test_a_watch_sees_an_evicted_pod_go_before_the_next_poll(
    api: StandIn, kubeconfig: Path
) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=100)
    # A poll this slow would outlast the drain's timeout: only the watch can end it.
    timing = dataclasses.replace(FAST, delete_poll=60.0)
    async with await Kube.connect(kubeconfig, timing=timing) as kube:
        report = await kube.drain(
            "gpu-node", timeout=20, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
        )
    assert report.complete and names(report.evicted) == ["default/web-1"]
    # Read once while it terminates, and once more when the watch saw it deleted.
    assert len(api.requests_to("GET", r"/pods/web-1$")) == 2
    (watch,) = api.requests_to("GET", r"^/api/v1/pods\?.*watch=")
    assert "fieldSelector=spec.nodeName%3Dgpu-node" in watch


async def test_pods_without_consent_are_named_and_left_behind(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("bare", node="gpu-node")
    api.cluster.add_pod("cache-1", node="gpu-node", owner="ReplicaSet/cache", emptydir=True)
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert not report.complete
    assert names(report.evicted) == ["default/web-1"]
    assert [str(p) for p in report.left] == [
        "default/bare (no controller would re-create it; drain_unmanaged = false)",
        "default/cache-1 (uses an emptyDir volume; drain_emptydir = false)",
    ]
    assert on_node(api) == ["bare", "cache-1"]


async def test_abort_refuses_before_evicting_anything(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("cache-1", node="gpu-node", owner="ReplicaSet/cache", emptydir=True)
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    with pytest.raises(DrainAborted) as caught:
        await kube.drain(
            "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=False, on_timeout=ABORT
        )
    assert [p.reason for p in caught.value.report.left] == [LeftReason.EMPTYDIR]
    assert on_node(api) == ["cache-1", "web-1"]
    assert not api.requests_to("POST", "/eviction$")


async def test_force_evicts_unmanaged_pods(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("bare", node="gpu-node")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=True, on_timeout=ABORT
    )
    assert names(report.evicted) == ["default/bare"]
    assert api.cluster.pods() == []  # nothing re-creates it


async def test_a_budget_that_blocks_then_allows(api: StandIn, kubeconfig: Path) -> None:
    # Three replicas, two on this node, at least two available: the second eviction
    # waits until the first one's replacement is Ready on another node.
    api.cluster.replacement_node = "other"
    api.cluster.replacement_ready_after = 0.3
    for name, node in (("web-1", "gpu-node"), ("web-2", "gpu-node"), ("web-3", "other")):
        api.cluster.add_pod(name, node=node, owner="ReplicaSet/web", labels={"app": "web"})
    api.cluster.add_pdb("web", match_labels={"app": "web"}, min_available=2)
    async with await Kube.connect(kubeconfig, timing=FAST) as kube:
        report = await kube.drain(
            "gpu-node", timeout=5, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
        )
    assert report.complete
    assert names(report.evicted) == ["default/web-1", "default/web-2"]
    assert len(api.requests_to("POST", "/eviction$")) > 2  # at least one 429, then retried
    assert report.duration >= 0.3


async def test_a_budget_that_never_allows_is_left_behind_with_proceed(
    kube: Kube, api: StandIn, records: journal.ListSink
) -> None:
    api.cluster.add_pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    api.cluster.add_pdb("db", match_labels={"app": "db"}, max_unavailable=0)
    report = await kube.drain(
        "gpu-node", timeout=0.5, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert names(report.evicted) == ["default/web-1"]
    assert report.left == (
        LeftPod(
            PodRef("default", "db-0"),
            LeftReason.PDB_BLOCKED,
            "a PodDisruptionBudget blocks its eviction: The disruption budget db needs 1 healthy pods and has 1 currently",
        ),
    )
    assert 0.5 <= report.duration < 1.5
    (entry,) = [e for e in records.entries if e.fields.get("HOSTAGENT_EVENT") == "drain"]
    assert entry.fields["HOSTAGENT_RESULT"] == "incomplete"
    assert entry.fields["HOSTAGENT_LEFT"] == "default/db-0"
    assert entry.priority == journal.Priority.WARNING
    assert "1 left behind: default/db-0 (a PodDisruptionBudget blocks its eviction" in entry.message


async def test_a_budget_that_never_allows_aborts_with_abort(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    api.cluster.add_pdb("db", match_labels={"app": "db"}, min_available="100%")
    with pytest.raises(DrainAborted) as caught:
        await kube.drain(
            "gpu-node", timeout=0.3, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
        )
    assert [(str(p.pod), p.reason) for p in caught.value.report.left] == [
        ("default/db-0", LeftReason.PDB_BLOCKED)
    ]
    assert str(caught.value).startswith(
        "gpu-node not fully drained after 0.3 s: 0 pods evicted, 1 left behind"
    )
    assert on_node(api) == ["db-0"]


async def test_two_budgets_on_one_pod_are_reported_as_misconfigured_at_once(
    kube: Kube, api: StandIn
) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web", labels={"app": "web"})
    api.cluster.add_pdb("web-a", match_labels={"app": "web"}, max_unavailable=1)
    api.cluster.add_pdb("web-b", match_labels={"app": "web"}, max_unavailable=1)
    report = await kube.drain(
        "gpu-node", timeout=5, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert [str(p) for p in report.left] == [
        "default/web-1 (misconfigured PodDisruptionBudget: more than one PodDisruptionBudget selects pod default/web-1)"
    ]
    assert report.duration < 1  # no retry fixes it, so none is made
    assert len(api.requests_to("POST", "/eviction$")) == 1


async def test_a_drain_rides_out_an_api_outage(kube: Kube, api: StandIn) -> None:
    for i in range(3):
        api.cluster.add_pod(f"web-{i}", node="gpu-node", owner="ReplicaSet/web", grace=60)
    api.fail("/eviction$", code=503, times=2)
    later(0.1, api.down_for, 0.4)
    report = await kube.drain(
        "gpu-node", timeout=5, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
    )
    assert report.complete, report.summary()
    assert names(report.evicted) == ["default/web-0", "default/web-1", "default/web-2"]
    assert on_node(api) == []


async def test_an_api_down_for_the_whole_drain_is_bounded_by_its_timeout(
    kube: Kube, api: StandIn
) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    await api.down()
    report = await kube.drain(
        "gpu-node", timeout=0.4, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert not report.complete
    assert report.error.startswith("could not list the pods on gpu-node: the API server at")
    assert report.duration < 1
    with pytest.raises(DrainAborted, match="could not drain gpu-node within 0.4 s"):
        await kube.drain(
            "gpu-node", timeout=0.4, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
        )


async def test_a_pod_whose_kubelet_is_gone_is_left_terminating(kube: Kube, api: StandIn) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=1)
    set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    report = await kube.drain(
        "gpu-node", timeout=0.3, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert [str(p) for p in report.left] == ["default/web-1 (evicted but still terminating)"]


async def test_pods_stuck_terminating_on_an_unreachable_node_do_not_hold_the_drain(
    kube: Kube, api: StandIn
) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=1)
    api.cluster.add_pod("old", node="gpu-node", owner="ReplicaSet/old", grace=1)
    set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    api.cluster.delete(PODS, "default", "old")  # Terminating before the drain starts
    report = await kube.drain(
        "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT,
        skip_wait_for_delete_timeout=1,
    )
    # Each counts as gone once its deletion is more than 1 s past: not after 30 s.
    assert report.complete and report.duration < 5, report.summary()
    assert names(report.abandoned) == ["default/old", "default/web-1"]
    assert "2 stuck Terminating counted as gone" in report.summary()
    assert on_node(api) == ["old", "web-1"]  # still there: no kubelet confirmed


def test_a_pod_deleted_long_ago_is_left_alone_by_the_plan() -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 1, 1, tzinfo=UTC)
    pods = [info("stuck", deleting=True, controller="ReplicaSet",
                 deleted_at=now - timedelta(seconds=11)),
            info("fresh", deleting=True, controller="ReplicaSet",
                 deleted_at=now - timedelta(seconds=5))]
    plan = plan_drain(pods, emptydir_ok=True, unmanaged_ok=True, skip_after=10, now=now)
    assert [p.name for p, _ in plan.ignored] == ["stuck"]
    assert [p.name for p in plan.wait] == ["fresh"]
    # 0: kubectl's default, wait for every pod.
    assert not plan_drain(pods, emptydir_ok=True, unmanaged_ok=True, now=now).ignored


# --- waiting for the node to come back --------------------------------------------------------


async def test_wait_ready_watches_rather_than_polls(kube: Kube, api: StandIn) -> None:
    set_node_status(api, "gpu-node", conditions=[ready_condition("False")])
    later(0.3, lambda: set_node_status(api, "gpu-node", conditions=[ready_condition("True")]))
    await kube.wait_ready("gpu-node", timeout=3)
    assert len(api.requests_to("GET", r"/nodes/gpu-node$")) == 1
    (watch,) = api.requests_to("GET", r"/api/v1/nodes\?")
    assert "watch=True" in watch and "fieldSelector=metadata.name%3Dgpu-node" in watch


async def test_wait_ready_says_what_the_node_last_said(kube: Kube, api: StandIn) -> None:
    set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    with pytest.raises(NodeNotReady) as caught:
        await kube.wait_ready("gpu-node", timeout=0.3)
    assert str(caught.value) == (
        "node gpu-node was not Ready within 0.3 s: Ready=Unknown "
        "(NodeStatusUnknown: Kubelet stopped posting node status.)"
    )


async def test_wait_ready_rides_out_an_api_outage(kube: Kube, api: StandIn) -> None:
    set_node_status(api, "gpu-node", conditions=[ready_condition("False")])

    async def outage() -> None:
        await asyncio.sleep(0.1)
        await api.down()
        set_node_status(api, "gpu-node", conditions=[ready_condition("True")])
        await asyncio.sleep(0.4)
        await api.up()

    task = asyncio.create_task(outage())
    await kube.wait_ready("gpu-node", timeout=3)
    await task


def on_watch(api: StandIn, number: int, act: Any) -> None:
    """Run `act()` just before the stand-in registers its `number`th watch (from 1)."""
    register = api.cluster.watch
    seen = 0

    def watch(*args: Any, **kwargs: Any) -> Any:
        nonlocal seen
        seen += 1
        if seen == number:
            act()
        return register(*args, **kwargs)

    api.cluster.watch = watch  # type: ignore[method-assign]


async def test_wait_ready_resumes_after_410_expired(kubeconfig: Path) -> None:
    async with StandIn(history=2) as api:
        api.cluster.add_node("gpu-node", ready=False)
        api.cluster.add_node("noisy")
        kubeconfig = write_kubeconfig(kubeconfig, api.url)

        def noise_then_ready() -> None:
            # By the time the watch starts, its resourceVersion has left the history.
            for i in range(4):
                body = f'{{"metadata": {{"labels": {{"i": "{i}"}}}}}}'.encode()
                api.cluster.patch(NODES, None, "noisy", "application/merge-patch+json", body)
            set_node_status(api, "gpu-node", conditions=[ready_condition("True")])

        on_watch(api, 1, noise_then_ready)
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            await kube.wait_ready("gpu-node", timeout=3)
        assert len(api.requests_to("GET", r"/nodes/gpu-node$")) == 2


async def test_wait_ready_resumes_when_the_server_ends_the_watch(
    api: StandIn, kubeconfig: Path
) -> None:
    set_node_status(api, "gpu-node", conditions=[ready_condition("False")])
    # Ready comes while the second watch starts: only a resumed watch can see it.
    on_watch(api, 2, lambda: set_node_status(api, "gpu-node", conditions=[ready_condition("True")]))
    timing = Timing(**{**FAST.__dict__, "watch_timeout": 1.0})
    async with await Kube.connect(kubeconfig, timing=timing) as kube:
        await kube.wait_ready("gpu-node", timeout=3)
    assert len(api.requests_to("GET", r"/api/v1/nodes\?")) == 2
    assert len(api.requests_to("GET", r"/nodes/gpu-node$")) == 2


async def test_wait_gpus_returns_when_the_count_is_there(kube: Kube, api: StandIn) -> None:
    later(0.2, lambda: set_node_status(api, "gpu-node", allocatable={"nvidia.com/gpu": "3"}))
    assert await kube.wait_gpus("gpu-node", expected=gpus(3), timeout=3) == {"nvidia.com/gpu": 3}


async def test_wait_gpus_reports_fewer_on_timeout(kube: Kube, api: StandIn) -> None:
    later(0.1, lambda: set_node_status(api, "gpu-node", allocatable={"nvidia.com/gpu": "1"}))
    found = await kube.wait_gpus("gpu-node", expected=gpus(3), timeout=0.4)
    assert found == {"nvidia.com/gpu": 1}
    amd = ExpectedGpus(("a",), {"amd.com/gpu": 1}, "test")
    assert await kube.wait_gpus("gpu-node", expected=amd, timeout=0.1) == {"amd.com/gpu": 0}


async def test_wait_gpus_with_the_api_down_reports_what_it_last_saw(
    kube: Kube, api: StandIn
) -> None:
    await api.down()
    found = await kube.wait_gpus("gpu-node", expected=gpus(2), timeout=0.3)
    assert found == {"nvidia.com/gpu": 0}
