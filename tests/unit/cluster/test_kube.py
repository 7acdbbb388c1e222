"""The Kubernetes adapter against the real kube-apiserver (the process's control plane,
behind the fault proxy): cordon, drain, wait, uncordon, faults. Pods are run and their
deletions ended by the lab's kubelet (tests/controlplane/kubelet.py); their owners are
the real controllers (tests/controlplane/seed.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import journal
from hostagent.core.config import DrainTimeoutAction
from hostagent.cluster.kube import (
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
from tests.controlplane import ControlPlane
from tests.controlplane.seed import ready_condition
from tests.unit.kube_scaffold import Api, Clock, real_api
from tests.users import unprivileged
from tests.waiting import until

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
NODE_WATCH = r"^/api/v1/nodes\?.*watch="


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node (2 GPUs, Ready, its kubelet running: a 30 s grace period takes 0.15 s)
    and other (Ready, no kubelet)."""
    async with real_api(plane) as api:
        await api.seed.node("gpu-node", gpus=2)
        await api.seed.node("other")
        async with api.seed.kubelet("gpu-node"):
            yield api


@pytest.fixture
def kubeconfig(api: Api, tmp_path: Path) -> Path:
    return api.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def kube(kubeconfig: Path) -> AsyncIterator[Kube]:
    async with await Kube.connect(kubeconfig, timing=FAST) as k:
        yield k


def names(pods: Any) -> list[str]:
    return sorted(str(p) for p in pods)


async def on_node(api: Api, node: str = "gpu-node") -> list[str]:
    return sorted(p["metadata"]["name"] for p in await api.seed.pods(node))


async def set_node_status(api: Api, node: str, **status: Any) -> None:
    await api.seed.node_status(node, **status)


def ours(node: dict[str, Any]) -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """The node's annotations and taints that hostagent's prefix names."""
    notes = node["metadata"].get("annotations", {})
    return ({k: v for k, v in notes.items() if k.startswith(PREFIX)},
            [(t["key"], t.get("value")) for t in node["spec"].get("taints", [])
             if t["key"].startswith(PREFIX)])


def gpus(n: int) -> ExpectedGpus:
    return ExpectedGpus(tuple(f"gpu{i}" for i in range(n)), {"nvidia.com/gpu": n}, "test")


def later(seconds: float, fn: Callable[[], Awaitable[Any]]) -> asyncio.Task[None]:
    """`fn()` after `seconds`, beside the test (which awaits the task before it ends)."""

    async def run() -> None:
        await asyncio.sleep(seconds)
        await fn()

    return asyncio.get_running_loop().create_task(run())


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


async def test_an_unreadable_kubeconfig_says_so(kubeconfig: Path) -> None:
    # Root reads any file: read as nobody (tests/users.py), from a directory anyone may
    # enter, so that what is refused is the file itself.
    shared = Path(tempfile.mkdtemp(prefix="kubeconfig-"))
    try:
        shared.chmod(0o755)
        unreadable = Path(shutil.copy(kubeconfig, shared / "kubeconfig"))
        unreadable.chmod(0)
        with unprivileged(), pytest.raises(KubeConfigError, match="permission denied"):
            await Kube.connect(unreadable)
    finally:
        shutil.rmtree(shared)


async def test_a_node_that_does_not_exist_is_reported_not_raised(kube: Kube, api: Api) -> None:
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


async def test_an_unreachable_api_is_unavailable_after_the_timeout(kube: Kube, api: Api) -> None:
    await api.proxy.down()
    with pytest.raises(KubeUnavailable, match="could not read node gpu-node: the API server at"):
        await kube.check_node("gpu-node", timeout=0.3)


# --- cordon and uncordon ----------------------------------------------------------------------


async def test_cordon_marks_the_node_and_uncordon_lifts_it(kube: Kube, api: Api) -> None:
    result = await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert (result.cordoned_by_us, result.was_cordoned, result.by_someone_else) == (
        True,
        False,
        False,
    )
    node = await api.seed.get_node("gpu-node")
    assert node["spec"]["unschedulable"] is True
    notes, taints = ours(node)
    assert notes[MARKER] == "hostagent" and f"{PREFIX}cordoned-at" in notes
    again = await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert (again.cordoned_by_us, again.was_cordoned) == (True, True)
    assert await kube.uncordon("gpu-node", marker_prefix=PREFIX) is True
    node = await api.seed.get_node("gpu-node")
    assert "unschedulable" not in node["spec"]  # false: the server omits it
    assert ours(node) == ({}, [])


async def test_an_administrators_cordon_survives_a_whole_cycle(
    kube: Kube, api: Api, records: journal.ListSink
) -> None:
    await api.seed.node("admin", unschedulable=True, annotations={"note": "disk check"})
    result = await kube.cordon("admin", marker_prefix=PREFIX)
    assert result.by_someone_else and not result.cordoned_by_us
    assert await kube.drain(
        "admin", timeout=1, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert await kube.uncordon("admin", marker_prefix=PREFIX) is False
    node = await api.seed.get_node("admin")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["annotations"]["note"] == "disk check"
    assert ours(node) == ({}, [])
    messages = [e.message for e in records.entries]
    assert (
        "admin was already cordoned by someone else; hostagent will leave it cordoned" in messages
    )
    assert "left admin as it is: hostagent did not cordon it" in messages


async def test_the_marker_on_the_node_outlives_the_agent(api: Api, kubeconfig: Path) -> None:
    async with await Kube.connect(kubeconfig, timing=FAST) as first:
        await first.cordon("gpu-node", marker_prefix=PREFIX)
    async with await Kube.connect(kubeconfig, timing=FAST) as restarted:
        again = await restarted.cordon("gpu-node", marker_prefix=PREFIX)
        assert again.cordoned_by_us
        assert await restarted.uncordon("gpu-node", marker_prefix=PREFIX) is True
    assert "unschedulable" not in (await api.seed.get_node("gpu-node"))["spec"]


async def test_a_write_between_read_and_patch_is_retried(kube: Kube, api: Api) -> None:
    # A label written while the cordon's patch is held makes that patch stale: the real
    # server answers 409 Conflict to the resourceVersion it carries.
    api.proxy.slow(r"/nodes/gpu-node$", delay=0.3, times=1, method="PATCH")
    cordon = asyncio.create_task(kube.cordon("gpu-node", marker_prefix=PREFIX))
    await until(lambda: bool(api.proxy.requests_to("PATCH", r"/nodes/gpu-node$")))
    await api.seed.patch_node("gpu-node", {"metadata": {"labels": {"zone": "b"}}})
    await cordon
    node = await api.seed.get_node("gpu-node")
    assert node["spec"]["unschedulable"] and node["metadata"]["labels"]["zone"] == "b"
    assert len(api.proxy.requests_to("PATCH", r"/nodes/gpu-node$")) == 2


async def test_annotations_and_taints_keep_what_others_put_there(kube: Kube, api: Api) -> None:
    await api.seed.patch_node("gpu-node", {"metadata": {"annotations": {"note": "kept"}},
                                           "spec": {"taints": [{"key": "example.com/theirs",
                                                                "effect": "NoSchedule"}]}})
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    lent = Taint("hostagent.io/borrowed", "NoSchedule", "true")
    await kube.annotate(
        "gpu-node", {f"{PREFIX}state": "lent", f"{PREFIX}holder": None}, add_taints=[lent]
    )
    node = await api.seed.get_node("gpu-node")
    notes, taints = ours(node)
    assert notes[f"{PREFIX}state"] == "lent"
    assert taints == [("hostagent.io/borrowed", "true")]
    await kube.annotate(
        "gpu-node",
        {f"{PREFIX}state": "reclaimed", f"{PREFIX}holder": "gaming1"},
        remove_taints=[Taint("hostagent.io/borrowed")],
    )
    node = await api.seed.get_node("gpu-node")
    notes, taints = ours(node)
    assert taints == []
    assert notes[f"{PREFIX}holder"] == "gaming1" and notes[MARKER] == "hostagent"
    assert node["metadata"]["annotations"]["note"] == "kept"
    assert "example.com/theirs" in [t["key"] for t in node["spec"]["taints"]]


# --- drain ------------------------------------------------------------------------------------


async def test_drain_evicts_what_kubectl_would_and_leaves_the_rest(
    kube: Kube, api: Api, records: journal.ListSink
) -> None:
    seed = api.seed
    await seed.pod("logs-x1", node="gpu-node", owner="DaemonSet/logs", namespace="kube-system")
    await seed.pod("kube-proxy-gpu-node", node="gpu-node", mirror=True, namespace="kube-system")
    await seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web", labels={"app": "web"})
    await seed.pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    await seed.pod("report-7", node="gpu-node", phase="Succeeded")  # a completed bare pod
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await seed.pods("gpu-node")}
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
    assert await on_node(api) == ["kube-proxy-gpu-node", "logs-x1"]
    # Their controllers make replacements, with new UIDs, and nobody waited for them.
    db = await seed.get_pod("default", "db-0")
    assert db is None or db["metadata"]["uid"] != uids["db-0"]

    async def replaced() -> bool:
        pods = await seed.pods(namespace="default")
        db = [p for p in pods if p["metadata"]["name"] == "db-0"]
        web = [p for p in pods if p["metadata"]["name"].startswith("web-")]
        return (len(db) == 1 and db[0]["metadata"]["uid"] != uids["db-0"]
                and len(web) == 1 and web[0]["metadata"]["name"] != "web-1")

    await until(replaced)
    (entry,) = [e for e in records.entries if e.fields.get("HOSTAGENT_EVENT") == "drain"]
    assert entry.fields["HOSTAGENT_RESULT"] == "ok"
    assert entry.message.startswith("drained gpu-node in ")
    assert entry.message.endswith(": 3 pods evicted")


async def test_a_pod_already_terminating_is_waited_for(kube: Kube, api: Api) -> None:
    await api.seed.pod("going", node="gpu-node", owner="ReplicaSet/going", grace=40)
    await api.seed.delete_pod("default", "going")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert names(report.waited) == ["default/going"] and not report.evicted
    assert await on_node(api) == []


async def test_a_watch_sees_an_evicted_pod_go_before_the_next_poll(
    api: Api, kubeconfig: Path
) -> None:
    # Its kubelet ends it 1.5 s after the eviction: it is read while it terminates.
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=300)
    # A poll this slow would outlast the drain's timeout: only the watch can end it.
    timing = dataclasses.replace(FAST, delete_poll=60.0)
    async with await Kube.connect(kubeconfig, timing=timing) as kube:
        report = await kube.drain(
            "gpu-node", timeout=20, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
        )
    assert report.complete and names(report.evicted) == ["default/web-1"]
    # Read once while it terminates, and once more when the watch saw it deleted.
    assert len(api.proxy.requests_to("GET", r"/pods/web-1$")) == 2
    (watch,) = api.proxy.requests_to("GET", r"^/api/v1/pods\?.*watch=")
    assert "fieldSelector=spec.nodeName%3Dgpu-node" in watch


async def test_pods_without_consent_are_named_and_left_behind(kube: Kube, api: Api) -> None:
    await api.seed.pod("bare", node="gpu-node")
    await api.seed.pod("cache-1", node="gpu-node", owner="ReplicaSet/cache", emptydir=True)
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert not report.complete
    assert names(report.evicted) == ["default/web-1"]
    assert [str(p) for p in report.left] == [
        "default/bare (no controller would re-create it; drain_unmanaged = false)",
        "default/cache-1 (uses an emptyDir volume; drain_emptydir = false)",
    ]
    assert await on_node(api) == ["bare", "cache-1"]


async def test_abort_refuses_before_evicting_anything(kube: Kube, api: Api) -> None:
    await api.seed.pod("cache-1", node="gpu-node", owner="ReplicaSet/cache", emptydir=True)
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    with pytest.raises(DrainAborted) as caught:
        await kube.drain(
            "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=False, on_timeout=ABORT
        )
    assert [p.reason for p in caught.value.report.left] == [LeftReason.EMPTYDIR]
    assert await on_node(api) == ["cache-1", "web-1"]
    assert not api.proxy.requests_to("POST", "/eviction$")


async def test_force_evicts_unmanaged_pods(kube: Kube, api: Api) -> None:
    await api.seed.pod("bare", node="gpu-node")
    report = await kube.drain(
        "gpu-node", timeout=3, emptydir_ok=False, unmanaged_ok=True, on_timeout=ABORT
    )
    assert names(report.evicted) == ["default/bare"]
    assert await api.seed.pods(namespace="default") == []  # nothing re-creates it


async def test_a_budget_that_blocks_then_allows(api: Api, kubeconfig: Path) -> None:
    # Three replicas, two on this node, at least two available: the second eviction
    # waits until the first one's replacement is Ready on the other node (its readiness
    # probe's delay: 2 s, at least 1 s after its start as the kubelet stamps it, in seconds).
    api.seed.replacement_node = "other"
    api.seed.replacement_ready_after = 2
    async with api.seed.kubelet("other"):
        for name, node in (("web-1", "gpu-node"), ("web-2", "gpu-node"), ("web-3", "other")):
            await api.seed.pod(name, node=node, owner="ReplicaSet/web", labels={"app": "web"})
        await api.seed.pdb("web", match_labels={"app": "web"}, min_available=2)
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            # The bound only: the drain ends when the replacement is Ready (~2 s), and a
            # busy machine's start of it must not count as a budget that never allowed.
            report = await kube.drain(
                "gpu-node", timeout=60, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
            )
    assert report.complete, report
    assert names(report.evicted) == ["default/web-1", "default/web-2"]
    assert len(api.proxy.requests_to("POST", "/eviction$")) > 2  # at least one 429, retried


DB_EVICTIONS = "/pods/db-0/eviction$"


async def test_a_budget_that_never_allows_is_left_behind_with_proceed(
    kube: Kube, api: Api, records: journal.ListSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.seed.pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    await api.seed.pdb("db", match_labels={"app": "db"}, max_unavailable=0)
    # The timeout passes once web-1 is gone and db-0's eviction was refused and retried
    # (a second request is made only after the first was answered).
    clock = Clock(kube, monkeypatch)
    sent: list[int] = []

    async def refused_and_web_gone() -> bool:
        sent[:] = [len(api.proxy.requests_to("POST", DB_EVICTIONS))]
        return sent[0] >= 2 and await on_node(api) == ["db-0"]

    expiry = asyncio.create_task(clock.expire_when(refused_and_web_gone))
    report = await kube.drain(
        "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    await expiry
    assert names(report.evicted) == ["default/web-1"]
    # The real server's cause (registry/core/pod/storage/eviction.go).
    assert report.left == (
        LeftPod(
            PodRef("default", "db-0"),
            LeftReason.PDB_BLOCKED,
            "a PodDisruptionBudget blocks its eviction: The disruption budget db needs 1 healthy pods and has 1 currently",
        ),
    )
    assert report.duration >= 30  # it ran until its timeout ...
    # ... and then stopped: no eviction after it but the one that may have been under way.
    assert len(api.proxy.requests_to("POST", DB_EVICTIONS)) <= sent[0] + 1
    (entry,) = [e for e in records.entries if e.fields.get("HOSTAGENT_EVENT") == "drain"]
    assert entry.fields["HOSTAGENT_RESULT"] == "incomplete"
    assert entry.fields["HOSTAGENT_LEFT"] == "default/db-0"
    assert entry.priority == journal.Priority.WARNING
    assert "1 left behind: default/db-0 (a PodDisruptionBudget blocks its eviction" in entry.message


async def test_a_budget_that_never_allows_aborts_with_abort(
    kube: Kube, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.seed.pod("db-0", node="gpu-node", owner="StatefulSet/db", labels={"app": "db"})
    await api.seed.pdb("db", match_labels={"app": "db"}, min_available="100%")
    # The timeout passes once db-0's eviction was refused and retried.
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        lambda: len(api.proxy.requests_to("POST", DB_EVICTIONS)) >= 2))
    with pytest.raises(DrainAborted) as caught:
        await kube.drain(
            "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
        )
    await expiry
    assert [(str(p.pod), p.reason) for p in caught.value.report.left] == [
        ("default/db-0", LeftReason.PDB_BLOCKED)
    ]
    assert str(caught.value).startswith(
        f"gpu-node not fully drained after {caught.value.report.duration:.0f} s: "
        "0 pods evicted, 1 left behind"
    )
    assert caught.value.report.duration >= 30
    assert await on_node(api) == ["db-0"]


async def test_two_budgets_on_one_pod_are_reported_as_misconfigured_at_once(
    kube: Kube, api: Api
) -> None:
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web", labels={"app": "web"})
    await api.seed.pdb("web-a", match_labels={"app": "web"}, max_unavailable=1)
    await api.seed.pdb("web-b", match_labels={"app": "web"}, max_unavailable=1)
    report = await kube.drain(
        "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert [str(p) for p in report.left] == [
        "default/web-1 (misconfigured PodDisruptionBudget: more than one PodDisruptionBudget selects pod default/web-1)"
    ]
    assert report.duration < 30  # no retry fixes it, so none is made: not held to the end
    assert len(api.proxy.requests_to("POST", "/eviction$")) == 1


async def test_a_drain_rides_out_an_api_outage(kube: Kube, api: Api) -> None:
    for i in range(3):
        await api.seed.pod(f"web-{i}", node="gpu-node", owner="ReplicaSet/web", grace=60)
    api.proxy.fail("/eviction$", code=503, times=2)
    outage = later(0.1, lambda: api.proxy.down_for(0.4))
    report = await kube.drain(
        "gpu-node", timeout=5, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
    )
    await outage
    assert report.complete, report.summary()
    assert names(report.evicted) == ["default/web-0", "default/web-1", "default/web-2"]
    assert await on_node(api) == []


async def test_an_api_down_for_the_whole_drain_is_bounded_by_its_timeout(
    kube: Kube, api: Api
) -> None:
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    await api.proxy.down()
    report = await kube.drain(
        "gpu-node", timeout=0.4, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    assert not report.complete
    assert report.error.startswith("could not list the pods on gpu-node: the API server at")
    # Its deadline ends it (no hang); the margin is a busy machine's, as for the hook.
    assert 0.4 <= report.duration < 0.4 + 2.0
    with pytest.raises(DrainAborted, match="could not drain gpu-node within 0.4 s"):
        await kube.drain(
            "gpu-node", timeout=0.4, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT
        )


async def test_a_pod_whose_kubelet_is_gone_is_left_terminating(
    kube: Kube, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=1)
    await api.seed.kubelet_gone("gpu-node")
    await set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    # The timeout passes once the drain, its eviction accepted, has read the pod still
    # there (it reads the pod only while it waits for it to go).
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        lambda: api.proxy.requests_to("GET", r"/pods/web-1$"), api))
    report = await kube.drain(
        "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=PROCEED
    )
    await expiry
    assert [str(p) for p in report.left] == ["default/web-1 (evicted but still terminating)"]


async def test_pods_stuck_terminating_on_an_unreachable_node_do_not_hold_the_drain(
    kube: Kube, api: Api
) -> None:
    await api.seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web", grace=1)
    await api.seed.pod("old", node="gpu-node", owner="ReplicaSet/old", grace=1)
    await api.seed.kubelet_gone("gpu-node")
    await set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    await api.seed.delete_pod("default", "old")  # Terminating before the drain starts
    report = await kube.drain(
        "gpu-node", timeout=30, emptydir_ok=True, unmanaged_ok=False, on_timeout=ABORT,
        skip_wait_for_delete_timeout=1,
    )
    # Each counts as gone once its deletion is more than 1 s past: not after 30 s.
    assert report.complete and report.duration < 5, report.summary()
    assert names(report.abandoned) == ["default/old", "default/web-1"]
    assert "2 stuck Terminating counted as gone" in report.summary()
    assert await on_node(api) == ["old", "web-1"]  # still there: no kubelet confirmed


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


def watches(api: Api) -> int:
    return len(api.proxy.requests_to("GET", NODE_WATCH))


async def test_wait_ready_watches_rather_than_polls(kube: Kube, api: Api) -> None:
    await set_node_status(api, "gpu-node", conditions=[ready_condition("False")])
    waiting = asyncio.create_task(kube.wait_ready("gpu-node", timeout=5))
    await until(lambda: watches(api) == 1)
    await set_node_status(api, "gpu-node", conditions=[ready_condition("True")])
    await waiting
    assert len(api.proxy.requests_to("GET", r"/nodes/gpu-node$")) == 1
    (watch,) = api.proxy.requests_to("GET", r"/api/v1/nodes\?")
    assert "watch=True" in watch and "fieldSelector=metadata.name%3Dgpu-node" in watch


async def test_wait_ready_says_what_the_node_last_said(
    kube: Kube, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await set_node_status(api, "gpu-node", conditions=[ready_condition("Unknown")])
    # The timeout passes once the node was read and is watched.
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        lambda: watches(api) == 1, api))
    with pytest.raises(NodeNotReady) as caught:
        await kube.wait_ready("gpu-node", timeout=30)
    await expiry
    assert str(caught.value) == (
        "node gpu-node was not Ready within 30 s: Ready=Unknown "
        "(NodeStatusUnknown: Kubelet stopped posting node status.)"
    )


async def test_wait_ready_rides_out_an_api_outage(kube: Kube, api: Api) -> None:
    await set_node_status(api, "gpu-node", conditions=[ready_condition("False")])

    async def outage() -> None:
        await until(lambda: watches(api) == 1)  # down while the wait watches
        await api.proxy.down()
        await set_node_status(api, "gpu-node", conditions=[ready_condition("True")])
        await asyncio.sleep(0.4)  # the outage's length, Ready posted within it
        await api.proxy.up()

    task = asyncio.create_task(outage())
    await kube.wait_ready("gpu-node", timeout=30)
    await task


async def test_wait_ready_resumes_after_410_expired(kube: Kube, api: Api) -> None:
    # The first watch is answered as the watch cache answers a resourceVersion it no
    # longer holds; Ready comes once the second has been asked for.
    await set_node_status(api, "gpu-node", conditions=[ready_condition("False")])
    api.proxy.expire(r"^/api/v1/nodes$", times=1)
    waiting = asyncio.create_task(kube.wait_ready("gpu-node", timeout=5))
    await until(lambda: watches(api) == 2)
    await set_node_status(api, "gpu-node", conditions=[ready_condition("True")])
    await waiting
    assert len(api.proxy.requests_to("GET", r"/nodes/gpu-node$")) == 2


async def test_wait_ready_resumes_when_the_server_ends_the_watch(
    api: Api, kubeconfig: Path
) -> None:
    await set_node_status(api, "gpu-node", conditions=[ready_condition("False")])
    # The server ends each watch after 1 s; Ready comes once the second has been asked
    # for: only a resumed watch can see it.
    timing = Timing(**{**FAST.__dict__, "watch_timeout": 1.0})
    async with await Kube.connect(kubeconfig, timing=timing) as kube:
        waiting = asyncio.create_task(kube.wait_ready("gpu-node", timeout=5))
        await until(lambda: watches(api) == 2)
        await set_node_status(api, "gpu-node", conditions=[ready_condition("True")])
        await waiting
    assert watches(api) == 2
    assert len(api.proxy.requests_to("GET", r"/nodes/gpu-node$")) == 2


async def test_wait_gpus_returns_when_the_count_is_there(kube: Kube, api: Api) -> None:
    more = later(0.2, lambda: set_node_status(api, "gpu-node",
                                              allocatable={"nvidia.com/gpu": "3"}))
    assert await kube.wait_gpus("gpu-node", expected=gpus(3), timeout=3) == {"nvidia.com/gpu": 3}
    await more


async def test_wait_gpus_reports_fewer_on_timeout(
    kube: Kube, api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    await set_node_status(api, "gpu-node", allocatable={"nvidia.com/gpu": "1"})
    # Each timeout passes once the node was read and is watched.
    clock = Clock(kube, monkeypatch)
    expiry = asyncio.create_task(clock.expire_when(lambda: watches(api) == 1, api))
    found = await kube.wait_gpus("gpu-node", expected=gpus(3), timeout=30)
    await expiry
    assert found == {"nvidia.com/gpu": 1}
    amd = ExpectedGpus(("a",), {"amd.com/gpu": 1}, "test")
    expiry = asyncio.create_task(clock.expire_when(lambda: watches(api) == 2, api))
    assert await kube.wait_gpus("gpu-node", expected=amd, timeout=30) == {"amd.com/gpu": 0}
    await expiry


async def test_wait_gpus_with_the_api_down_reports_what_it_last_saw(kube: Kube, api: Api) -> None:
    await api.proxy.down()
    found = await kube.wait_gpus("gpu-node", expected=gpus(2), timeout=0.3)
    assert found == {"nvidia.com/gpu": 0}


@pytest.mark.parametrize("pod", [
    {"metadata": {"name": "web", "namespace": "ml", "uid": "u1",
                  "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                       "name": "w", "uid": "x", "controller": True}],
                  "annotations": {"kubernetes.io/config.mirror": "m"},
                  "deletionTimestamp": "2026-01-02T03:04:05Z"},
     "spec": {"containers": [{"name": "c"}], "terminationGracePeriodSeconds": 300,
              "volumes": [{"name": "scratch", "emptyDir": {}}]},
     "status": {"phase": "Running"}},
    {"metadata": {"name": "bare", "namespace": "default", "uid": "u2",
                  "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n",
                                       "uid": "y"}]},
     "spec": {"containers": [{"name": "c"}]}},
])
async def test_the_drains_reading_of_a_pods_json_is_the_models(pod: dict[str, Any]) -> None:
    """The drain reads its list from the JSON (a player's path): the same PodInfo as the
    client's model gives."""
    import json

    from kubernetes_asyncio import client

    from hostagent.cluster.drain import PodInfo, _pod_from_json

    class Reply:
        data = json.dumps(pod)

    async with client.ApiClient() as api:
        model = api.deserialize(Reply(), "V1Pod")
    assert _pod_from_json(pod) == PodInfo.from_api(model)


@pytest.mark.parametrize("pod", [[], {"metadata": []}, {"metadata": {"name": 3}},
                                 {"metadata": {"name": "a", "namespace": "b"}, "spec": ["x"]}])
def test_a_pod_of_another_shape_is_a_reply_to_retry(pod: Any) -> None:
    from hostagent.cluster.drain import _pod_from_json

    with pytest.raises((TypeError, AttributeError)):
        _pod_from_json(pod)
