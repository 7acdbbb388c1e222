"""The stand-in answers the real kubernetes-asyncio client as kube-apiserver would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.kubeapi import Kubelet, StandIn, serve_in_thread, write_kubeconfig
from tests.kubeapi.cluster import UNSCHEDULABLE_TAINT
from tests.kubeapi.rules import NODES

REPO = Path(__file__).resolve().parents[2]
MERGE = "application/merge-patch+json"


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=0.005) as standin:
        yield standin


async def connect(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration, persist_config=False
    )
    return client.ApiClient(configuration)


@pytest.fixture
async def v1(api: StandIn, tmp_path: Path) -> AsyncIterator[client.CoreV1Api]:
    async with await connect(write_kubeconfig(tmp_path / "kubeconfig", api.url)) as api_client:
        yield client.CoreV1Api(api_client)


def status_of(e: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(e.body)
    return body


async def until(condition: Any, timeout: float = 3.0) -> None:
    # Polled: the condition reads the stand-in's state, which has no event to wait on.
    async with asyncio.timeout(timeout):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


# --- nodes ---------------------------------------------------------------------------


async def test_a_missing_node_is_404_with_a_notfound_status(v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.read_node("nope")
    assert caught.value.status == 404
    assert status_of(caught.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'nodes "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "nodes"},
        "code": 404,
    }


async def test_merge_patch_sets_and_null_deletes_and_every_change_bumps_the_version(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1", annotations={"keep": "me"})
    before = int((await v1.read_node("n1")).metadata.resource_version)
    node = await v1.patch_node(
        "n1", {"metadata": {"annotations": {"a/b": "1"}}}, _content_type=MERGE
    )
    assert node.metadata.annotations == {"keep": "me", "a/b": "1"}
    assert int(node.metadata.resource_version) > before
    node = await v1.patch_node(
        "n1", {"metadata": {"annotations": {"a/b": None}}}, _content_type=MERGE
    )
    assert node.metadata.annotations == {"keep": "me"}
    # A write that changes nothing changes no resourceVersion either.
    again = await v1.patch_node(
        "n1", {"metadata": {"annotations": {"keep": "me"}}}, _content_type=MERGE
    )
    assert again.metadata.resource_version == node.metadata.resource_version


async def test_cordon_gets_the_lifecycle_taint_and_false_is_omitted(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    await v1.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    node = await v1.read_node("n1")
    assert node.spec.unschedulable is True
    assert [(t.key, t.effect) for t in node.spec.taints] == [(UNSCHEDULABLE_TAINT, "NoSchedule")]
    await v1.patch_node("n1", {"spec": {"unschedulable": False}}, _content_type=MERGE)
    raw = api.cluster.node("n1")
    assert "unschedulable" not in raw["spec"] and "taints" not in raw["spec"]


async def test_a_stale_resource_version_is_a_409_conflict(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    stale = (await v1.read_node("n1")).metadata.resource_version
    await v1.patch_node("n1", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE)
    with pytest.raises(ApiException) as caught:
        await v1.patch_node(
            "n1",
            {"metadata": {"resourceVersion": stale}, "spec": {"unschedulable": True}},
            _content_type=MERGE,
        )
    assert caught.value.status == 409
    status = status_of(caught.value)
    assert status["reason"] == "Conflict"
    assert status["message"] == (
        'Operation cannot be fulfilled on nodes "n1": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )


async def test_strategic_merge_merges_conditions_by_type_and_replaces_taints(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}])
    # The client sends a dict as a strategic merge patch by default.
    await v1.patch_node_status(
        "n1", {"status": {"conditions": [{"type": "MemoryPressure", "status": "False"}]}}
    )
    node = await v1.read_node("n1")
    assert sorted(c.type for c in node.status.conditions) == ["MemoryPressure", "Ready"]
    await v1.patch_node("n1", {"spec": {"taints": [{"key": "b", "effect": "NoExecute"}]}})
    assert [t.key for t in (await v1.read_node("n1")).spec.taints] == ["b"]
    await v1.patch_node_status(
        "n1", {"status": {"conditions": [{"type": "MemoryPressure", "$patch": "delete"}]}}
    )
    assert [c.type for c in (await v1.read_node("n1")).status.conditions] == ["Ready"]


async def test_json_patch_applies_and_a_failed_test_is_422(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    node = await v1.patch_node("n1", [{"op": "add", "path": "/spec/unschedulable", "value": True}])
    assert node.spec.unschedulable is True
    with pytest.raises(ApiException) as caught:
        await v1.patch_node(
            "n1",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
                {"op": "remove", "path": "/spec/unschedulable"},
            ],
        )
    assert caught.value.status == 422
    assert status_of(caught.value)["reason"] == "Invalid"
    assert (await v1.read_node("n1")).spec.unschedulable is True


async def test_status_goes_through_its_subresource_only(api: StandIn, v1: client.CoreV1Api) -> None:
    api.cluster.add_node("n1", gpus=2)
    await v1.patch_node(
        "n1", {"status": {"allocatable": {"nvidia.com/gpu": "0"}}}, _content_type=MERGE
    )
    assert (await v1.read_node("n1")).status.allocatable["nvidia.com/gpu"] == "2"
    await v1.patch_node_status(
        "n1", {"spec": {"unschedulable": True}, "status": {"allocatable": {"nvidia.com/gpu": "1"}}}
    )
    node = await v1.read_node("n1")
    assert node.status.allocatable["nvidia.com/gpu"] == "1"
    assert not node.spec.unschedulable


async def test_bad_values_are_refused_as_the_server_refuses_them(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    with pytest.raises(ApiException) as caught:
        await v1.patch_node("n1", {"metadata": {"annotations": {"a": 1}}}, _content_type=MERGE)
    assert caught.value.status == 400
    assert status_of(caught.value)["reason"] == "BadRequest"
    with pytest.raises(ApiException) as caught:
        await v1.patch_node(
            "n1", {"spec": {"taints": [{"key": "k", "effect": "Never"}]}}, _content_type=MERGE
        )
    assert caught.value.status == 422
    status = status_of(caught.value)
    assert status["reason"] == "Invalid"
    assert status["details"]["causes"][0]["field"] == "spec.taints[0].effect"
    with pytest.raises(ApiException) as caught:
        await v1.patch_node("n1", {"spec": {}}, _content_type="application/json")
    assert caught.value.status == 415


# --- pods and evictions ---------------------------------------------------------------


async def test_pods_are_listed_by_node_and_labels_across_namespaces(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_pod("a", node="n1", namespace="one", labels={"app": "web"})
    api.cluster.add_pod("b", node="n1", namespace="two", labels={"app": "db"})
    api.cluster.add_pod("c", node="n2", namespace="one", labels={"app": "web"})
    on_n1 = await v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [(p.metadata.namespace, p.metadata.name) for p in on_n1.items] == [
        ("one", "a"),
        ("two", "b"),
    ]
    web = await v1.list_namespaced_pod("one", label_selector="app in (web, cache)")
    assert [p.metadata.name for p in web.items] == ["a", "c"]
    with pytest.raises(ApiException) as caught:
        await v1.list_pod_for_all_namespaces(field_selector="spec.colour=blue")
    assert caught.value.status == 400
    assert status_of(caught.value)["message"] == "field label not supported: spec.colour"


async def test_a_created_pod_starts_pending_whatever_status_it_was_sent_with(
    v1: client.CoreV1Api,
) -> None:
    pod = await v1.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running"},
        },
    )
    assert pod.status.phase == "Pending"
    assert pod.spec.termination_grace_period_seconds == 30


async def test_an_evicted_pod_terminates_and_its_replicaset_replaces_it_elsewhere(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    api.cluster.add_pod("web-1", node="n1", owner="ReplicaSet/web", grace=30)
    old = await v1.read_namespaced_pod("web-1", "default")
    answer = await v1.create_namespaced_pod_eviction(
        "web-1", "default", client.V1Eviction(metadata=client.V1ObjectMeta(name="web-1"))
    )
    assert answer.kind == "Status"
    terminating = await v1.read_namespaced_pod("web-1", "default")
    assert terminating.metadata.deletion_timestamp is not None
    assert terminating.metadata.deletion_grace_period_seconds == 30
    pods = (await v1.list_namespaced_pod("default")).items
    new = [p for p in pods if p.metadata.name != "web-1"]
    assert len(new) == 1 and new[0].metadata.name.startswith("web-")
    assert new[0].metadata.uid != old.metadata.uid
    assert new[0].spec.node_name is None and new[0].status.phase == "Pending"
    await asyncio.sleep(30 * 0.005 + 0.1)
    with pytest.raises(ApiException) as caught:
        await v1.read_namespaced_pod("web-1", "default")
    assert caught.value.status == 404


async def test_a_statefulset_pod_comes_back_under_its_name_with_a_new_uid(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_pod("db-0", node="n1", owner="StatefulSet/db", grace=10)
    api.cluster.add_node("n1")
    old = await v1.read_namespaced_pod("db-0", "default")
    await v1.create_namespaced_pod_eviction("db-0", "default", {"metadata": {"name": "db-0"}})
    await asyncio.sleep(10 * 0.005 + 0.1)
    new = await v1.read_namespaced_pod("db-0", "default")
    assert new.metadata.uid != old.metadata.uid
    assert new.metadata.deletion_timestamp is None


async def test_eviction_answers_404_429_and_500_with_real_status_bodies(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod_eviction("ghost", "default", {"metadata": {"name": "ghost"}})
    assert caught.value.status == 404
    assert status_of(caught.value)["message"] == 'pods "ghost" not found'
    api.cluster.add_pod("web-1", node="n1", owner="ReplicaSet/web", labels={"app": "web"})
    api.cluster.add_pod("web-2", node="n1", owner="ReplicaSet/web", labels={"app": "web"})
    api.cluster.add_pdb("web", match_labels={"app": "web"}, min_available=2)
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod_eviction("web-1", "default", {"metadata": {"name": "web-1"}})
    assert caught.value.status == 429
    assert status_of(caught.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Cannot evict pod as it would violate the pod's disruption budget.",
        "reason": "TooManyRequests",
        "details": {
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": "The disruption budget web needs 2 healthy pods and has 2 currently",
                }
            ]
        },
        "code": 429,
    }
    api.cluster.add_pdb("web-too", match_labels={"app": "web"}, max_unavailable=1)
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod_eviction("web-1", "default", {"metadata": {"name": "web-1"}})
    assert caught.value.status == 500
    status = status_of(caught.value)
    assert status["reason"] == "InternalError"
    assert status["message"] == (
        "Internal error occurred: This pod has more than one PodDisruptionBudget, "
        "which the eviction subresource does not support."
    )


async def test_a_budget_reads_back_its_arithmetic_through_policy_v1(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    policy = client.PolicyV1Api(v1.api_client)
    await policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "metadata": {"name": "web"},
            "spec": {"maxUnavailable": "50%", "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    for i in range(4):
        api.cluster.add_pod(
            f"web-{i}", node="n1", owner="ReplicaSet/web", labels={"app": "web"}, ready=i < 3
        )
    pdb = await policy.read_namespaced_pod_disruption_budget("web", "default")
    assert (pdb.status.expected_pods, pdb.status.current_healthy, pdb.status.desired_healthy) == (
        4,
        3,
        2,
    )
    assert pdb.status.disruptions_allowed == 1


async def test_an_eviction_with_a_stale_uid_precondition_is_a_409(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_pod("db-0", node="n1", owner="StatefulSet/db")
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="db-0"),
        delete_options=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-it")),
    )
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod_eviction("db-0", "default", body)
    assert caught.value.status == 409
    assert "Precondition failed: UID in precondition: not-it" in status_of(caught.value)["message"]


async def test_a_pod_on_a_node_that_is_not_ready_stays_terminating(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1", ready=False)
    api.cluster.add_pod("p", node="n1", owner="ReplicaSet/p", grace=1)
    await v1.delete_namespaced_pod("p", "default")
    await asyncio.sleep(0.1)
    assert api.cluster.pod("default", "p") is not None
    await v1.patch_node_status(
        "n1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    )
    await until(lambda: api.cluster.pod("default", "p") is None)


# --- watches ----------------------------------------------------------------------------


async def test_a_watch_sends_what_happens_after_its_resource_version(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    api.cluster.add_node("n2")
    start = (await v1.read_node("n1")).metadata.resource_version
    await v1.patch_node("n2", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE)
    await v1.patch_node("n1", {"metadata": {"labels": {"x": "1"}}}, _content_type=MERGE)
    await v1.delete_node("n1")
    seen = []
    async with watch.Watch() as w:
        async for event in w.stream(
            v1.list_node,
            field_selector="metadata.name=n1",
            resource_version=start,
            timeout_seconds=1,
        ):
            seen.append((event["type"], event["object"].metadata.labels.get("x")))
            if event["type"] == "DELETED":
                w.stop()
    assert seen == [("MODIFIED", "1"), ("DELETED", "1")]


async def test_a_watch_from_nothing_starts_with_the_objects_added(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    events = []
    async with watch.Watch() as w:
        async for event in w.stream(v1.list_node, timeout_seconds=1):
            events.append(event["type"])
            if len(events) == 1:
                await v1.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
            if len(events) == 3:  # the cordon, then the lifecycle controller's taint
                w.stop()
    assert events == ["ADDED", "MODIFIED", "MODIFIED"]


async def test_a_too_old_resource_version_is_410_expired() -> None:
    async with StandIn(history=3) as api:
        api.cluster.add_node("n1")
        for i in range(5):
            api.cluster.patch(
                NODES,
                None,
                "n1",
                MERGE,
                json.dumps({"metadata": {"labels": {"i": str(i)}}}).encode(),
            )
        async with aiohttp.ClientSession() as session:
            url = f"{api.url}/api/v1/nodes?watch=true&resourceVersion=101&timeoutSeconds=1"
            async with session.get(url) as response:
                assert response.status == 200
                lines = [json.loads(line) async for line in response.content if line.strip()]
    assert lines == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 101 (104)",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


async def test_the_client_sees_410_as_an_api_exception(tmp_path: Path) -> None:
    async with StandIn(history=1) as api:
        api.cluster.add_node("n1")
        api.cluster.add_node("n2")
        api.cluster.add_node("n3")
        async with await connect(write_kubeconfig(tmp_path / "kc", api.url)) as api_client:
            v1 = client.CoreV1Api(api_client)
            with pytest.raises(ApiException) as caught:
                async with watch.Watch() as w:
                    async for _ in w.stream(
                        v1.list_node, resource_version="101", timeout_seconds=1
                    ):
                        pass
    assert caught.value.status == 410


async def test_a_watch_ends_after_its_timeout(api: StandIn, v1: client.CoreV1Api) -> None:
    api.cluster.add_node("n1")
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with watch.Watch() as w:
        events = [e async for e in w.stream(v1.list_node, timeout_seconds=1)]
    assert [e["type"] for e in events] == ["ADDED"]
    assert 0.9 < loop.time() - start < 2


# --- faults -----------------------------------------------------------------------------


async def test_down_refuses_connections_cuts_watches_and_up_keeps_the_state(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    events: list[str] = []

    async def follow() -> None:
        async with watch.Watch() as w:
            async for event in w.stream(v1.list_node, timeout_seconds=30):
                events.append(event["type"])

    watching = asyncio.create_task(follow())
    await until(lambda: events == ["ADDED"])
    await api.down()
    # The cut stream ends or fails, as it does when a real server dies.
    with contextlib.suppress(aiohttp.ClientError):
        await asyncio.wait_for(watching, 2)
    with pytest.raises(aiohttp.ClientConnectorError):
        await v1.read_node("n1")
    await api.up()
    assert (await v1.read_node("n1")).metadata.name == "n1"


async def test_injected_errors_and_delays_hit_the_matching_paths_only(
    api: StandIn, v1: client.CoreV1Api
) -> None:
    api.cluster.add_node("n1")
    api.fail(r"/nodes/n1$", code=503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as caught:
            await v1.read_node("n1")
        assert caught.value.status == 503
        assert status_of(caught.value)["reason"] == "ServiceUnavailable"
    assert (await v1.list_node()).items
    assert (await v1.read_node("n1")).metadata.name == "n1"
    api.slow(r"/nodes/n1$", delay=0.3, times=1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await v1.read_node("n1")
    assert loop.time() - start >= 0.3


async def test_a_bearer_token_is_required_when_set(tmp_path: Path) -> None:
    async with StandIn(token="s3cret") as api:
        api.cluster.add_node("n1")
        async with await connect(write_kubeconfig(tmp_path / "bad", api.url)) as anonymous:
            with pytest.raises(ApiException) as caught:
                await client.CoreV1Api(anonymous).read_node("n1")
            assert caught.value.status == 401
        kubeconfig = write_kubeconfig(tmp_path / "good", api.url, token="s3cret")
        async with await connect(kubeconfig) as authorised:
            assert (await client.CoreV1Api(authorised).read_node("n1")).metadata.name == "n1"


# --- ways to run it ---------------------------------------------------------------------


def test_a_thread_serves_synchronous_code(tmp_path: Path) -> None:
    with serve_in_thread(termination_scale=0.01) as api:
        node = api.call(api.standin.cluster.add_node, "n1", gpus=3)
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "3"
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

        async def read() -> str:
            async with await connect(kubeconfig) as api_client:
                node = await client.CoreV1Api(api_client).read_node("n1")
                return str(node.metadata.name)

        assert asyncio.run(read()) == "n1"


def _start_process(
    state: Path, kubeconfig: Path, port: int = 0
) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.kubeapi", "--port", str(port), "--state", str(state),
         "--kubeconfig", str(kubeconfig)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(5)
    assert process.stdout is not None
    process.stdout.close()


async def test_as_a_process_it_keeps_its_objects_across_a_restart(tmp_path: Path) -> None:
    state, kubeconfig = tmp_path / "state.json", tmp_path / "kubeconfig"
    process, url = _start_process(state, kubeconfig)
    try:
        assert url.startswith("http://127.0.0.1:")
        async with await connect(kubeconfig) as api_client:
            v1 = client.CoreV1Api(api_client)
            created = await v1.create_node({"metadata": {"name": "n1"}})
    finally:
        _stop(process)
    port = int(url.rsplit(":", 1)[1])
    process, again = _start_process(state, kubeconfig, port)
    try:
        assert again == url
        async with await connect(kubeconfig) as api_client:
            v1 = client.CoreV1Api(api_client)
            node = await v1.read_node("n1")
            assert node.metadata.uid == created.metadata.uid
            assert node.metadata.resource_version == created.metadata.resource_version
            # Its watch history did not survive, as a real API server's cache would not.
            with pytest.raises(ApiException) as caught:
                async with watch.Watch() as w:
                    async for _ in w.stream(
                        v1.list_node, resource_version="100", timeout_seconds=1
                    ):
                        pass
            assert caught.value.status == 410
    finally:
        _stop(process)


async def test_the_process_takes_faults_through_its_control_paths(tmp_path: Path) -> None:
    process, url = _start_process(tmp_path / "state.json", tmp_path / "kubeconfig")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{url}/stand-in/faults", json={"path": "/nodes", "code": 500}
            ) as r:
                assert r.status == 201
            async with session.get(f"{url}/api/v1/nodes") as r:
                assert r.status == 500
            async with session.get(f"{url}/api/v1/nodes") as r:
                assert r.status == 200
            async with session.post(f"{url}/stand-in/down", json={"seconds": 0.5}) as r:
                assert r.status == 202
            await asyncio.sleep(0.2)
            with pytest.raises(aiohttp.ClientConnectorError):
                async with session.get(f"{url}/api/v1/nodes"):
                    pass
            await asyncio.sleep(0.6)
            async with session.get(f"{url}/api/v1/nodes") as r:
                assert r.status == 200
    finally:
        _stop(process)


# --- the lab kubelet ----------------------------------------------------------------------


async def test_the_kubelet_follows_the_vm(
    api: StandIn, v1: client.CoreV1Api, tmp_path: Path
) -> None:
    api.cluster.add_node("gpu-node", gpus=2)
    vm = {"running": False, "gpus": 3}
    kubelet = Kubelet(
        write_kubeconfig(tmp_path / "kubelet.kubeconfig", api.url),
        "gpu-node",
        lendee_running=lambda: vm["running"],
        gpus_seen=lambda: vm["gpus"],
        ready_delay=0.2,
        gpu_delay=0.1,
        heartbeat_grace=0.2,
        interval=0.02,
    )

    def ready() -> str:
        node = api.cluster.node("gpu-node")
        return next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")

    def gpus() -> str:
        return str(api.cluster.node("gpu-node")["status"]["allocatable"]["nvidia.com/gpu"])

    async with kubelet:
        await until(lambda: ready() == "Unknown")
        reason = next(
            c for c in api.cluster.node("gpu-node")["status"]["conditions"] if c["type"] == "Ready"
        )
        assert reason["reason"] == "NodeStatusUnknown"
        assert gpus() == "2"  # stale: nobody posts while the VM is off
        vm["running"] = True
        await until(lambda: ready() == "False")
        assert gpus() == "2"
        await until(lambda: ready() == "True")
        await until(lambda: gpus() == "3")
        vm["running"], vm["gpus"] = False, 0
        await until(lambda: ready() == "Unknown")
        vm["running"] = True
        await until(lambda: ready() == "True")
        await until(lambda: gpus() == "0")


async def test_the_kubelet_registers_a_missing_node(api: StandIn, tmp_path: Path) -> None:
    kubelet = Kubelet(
        write_kubeconfig(tmp_path / "kubeconfig", api.url),
        "fresh",
        lendee_running=lambda: True,
        gpus_seen=lambda: 1,
        ready_delay=0.05,
        gpu_delay=0.0,
        interval=0.02,
    )
    async with kubelet:
        await until(lambda: _has_node(api, "fresh", gpus="1"))


def _has_node(api: StandIn, name: str, *, gpus: str) -> bool:
    try:
        node = api.cluster.node(name)
    except Exception:
        return False
    return bool(node["status"].get("allocatable", {}).get("nvidia.com/gpu") == gpus)
