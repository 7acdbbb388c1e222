"""The agent under deploy/rbac.yaml and its node's deploy/rbac-node.yaml, against the
real kube-apiserver: every call it makes is allowed, every verb the manifests grant is
one it makes, and what a stolen token could do beyond its node and the pods on it is
refused (by RBAC's resourceNames, or by the ValidatingAdmissionPolicies).

The agent's credential is the token of the ServiceAccount named after its node
(kubectl create token), as on a real cluster; the lab's kubelet is played by the admin
(pods on a node with no kubelet never finish terminating: the admin finishes what a
kubelet would)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from hostagent.cluster.kube import Kube, Taint
from hostagent.core.config import DrainTimeoutAction
from hostagent.core.plugins import PLUGIN_LABELS  # every label the agent pauses by default
from tests.controlplane import ControlPlane
from tests.unit.kube_scaffold import FAST
from tests.waiting import until
from tests.controlplane.rbac import (
    agent_kubeconfig,
    NODE,
    node_rbac,
    RBAC,
    REPO,
)

OTHER = "other-node"  # a node of the cluster that is not the agent's
PREFIX = "hostagent.io/"
WORK = "work"  # the namespace of the running test's pods
IDENTITY = f"system:serviceaccount:hostagent:{NODE}"  # the agent's user name


def roles() -> list[dict[str, Any]]:
    """The ClusterRoles of both manifests (the node's made for NODE)."""
    docs = [*yaml.safe_load_all(RBAC.read_text()), *yaml.safe_load_all(node_rbac(NODE))]
    return [d for d in docs if d["kind"] == "ClusterRole"]


def rules() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of each rule of the manifests' ClusterRoles."""
    return {(group, resource, verb) for role in roles() for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


# How each call of the kubernetes client in hostagent/cluster maps onto a rule. None lists
# ResourceClaims: the agent reads those its node's pods name, never the cluster's.
CALLS = {
    "read_node": ("", "nodes", "get"),
    "list_node": ("", "nodes", "list"),
    "patch_node": ("", "nodes", "patch"),
    "list_pod_for_all_namespaces": ("", "pods", "list"),
    "read_namespaced_pod": ("", "pods", "get"),
    "delete_namespaced_pod": ("", "pods", "delete"),
    "patch_namespaced_pod": ("", "pods", "patch"),
    "create_namespaced_pod_eviction": ("", "pods/eviction", "create"),
    "create_namespaced_event": ("", "events", "create"),
    "list_device_class": ("resource.k8s.io", "deviceclasses", "list"),
    "list_resource_slice": ("resource.k8s.io", "resourceslices", "list"),
    "read_namespaced_resource_claim": ("resource.k8s.io", "resourceclaims", "get"),
    "read_namespaced_daemon_set": ("apps", "daemonsets", "get"),
}
WATCHED = {"list_node", "list_pod_for_all_namespaces", "list_resource_slice"}


def calls_in_code() -> set[str]:
    source = "\n".join(p.read_text() for p in (REPO / "hostagent").rglob("*.py"))
    return set(re.findall(r"self\._(?:core|resource|apps)\.(\w+)", source)) | set(
        re.findall(r'_follow\(\s*"(\w+)"', source))


def test_every_verb_granted_is_one_the_agent_uses() -> None:
    called = calls_in_code()
    assert called <= set(CALLS), f"calls with no rule known here: {called - set(CALLS)}"
    needed = {CALLS[c] for c in called} | {(*CALLS[c][:2], "watch") for c in called & WATCHED}
    assert rules() == needed, (f"granted, never used: {rules() - needed}; "
                               f"used, not granted: {needed - rules()}")


def test_every_node_right_names_the_node() -> None:
    """Nodes are reached by name alone: the agent's reads, list and watch included (a
    list or watch whose fieldSelector is metadata.name=<node> counts as named for RBAC:
    k8s.io/apiserver v0.35.4, pkg/endpoints/request/requestinfo.go)."""
    node_rules = [rule for role in roles() for rule in role["rules"]
                  if "nodes" in rule["resources"]]
    assert node_rules and all(rule.get("resourceNames") == [NODE] for rule in node_rules)
    watched = [c for c in WATCHED if CALLS[c][1] == "nodes"]
    source = "\n".join(p.read_text() for p in (REPO / "hostagent" / "cluster").rglob("*.py"))
    for call in watched:
        found = re.findall(rf"{call}[\"]?,\s*(?:field_selector=)?f?\"([^\"]*)\"", source)
        assert found and all(f == "metadata.name={node}" for f in found), (call, found)


def manifest(kind: str, name: str, **spec: Any) -> str:
    return json.dumps({"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, **spec})


NAMESPACES = itertools.count()


@pytest.fixture
async def cluster(plane: ControlPlane) -> AsyncIterator[ControlPlane]:
    """Node gpu-node and two pods on it, in a namespace of this test's own (a deleted
    namespace takes a while to go)."""
    global WORK
    WORK = f"work-{next(NAMESPACES)}"
    plane.kubectl("create", "-f", "-", input=manifest(
        "Node", NODE, status={"capacity": {"nvidia.com/gpu": "2", "pods": "110"}}))
    plane.namespace(WORK)
    for name, gpus in (("trainer-1", {"nvidia.com/gpu": "1"}), ("trainer-2", {})):
        plane.kubectl("create", "-n", WORK, "-f", "-", input=a_pod(name, NODE, gpus))
    try:
        yield plane
    finally:
        plane.kubectl("delete", "namespace", WORK, "--wait=false", check=False)
        plane.kubectl("delete", "node", NODE, OTHER, "--ignore-not-found", check=False)


def a_pod(name: str, node: str, limits: dict[str, str] | None = None,
          **labels: str) -> str:
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [
            {"name": "c", "image": "busybox", "resources": {"limits": limits or {}}}]}})


async def finish_terminating(plane: ControlPlane) -> None:
    """The kubelet's part: a pod being deleted goes once its containers stopped."""
    while True:
        out = await asyncio.to_thread(plane.kubectl, "get", "pods", "-n", WORK, "-o", "json")
        for pod in json.loads(out.stdout)["items"]:
            if pod["metadata"].get("deletionTimestamp"):
                await asyncio.to_thread(plane.kubectl, "delete", "pod", "-n", WORK,
                                        pod["metadata"]["name"], "--grace-period=0",
                                        "--force", check=False)
        await asyncio.sleep(0.3)


async def test_the_agent_does_its_work_with_the_shipped_rbac_alone(
        cluster: ControlPlane, tmp_path: Path) -> None:
    """Every call the agent makes passes: reads and watches of its node and of the pods
    on it, the cordon, a drain's evictions, its annotations, label and taint (beside an
    administrator's taint, which its read-modify-write keeps), NVIDIA's gpu.deploy
    switches, a GPU pod's notice, Events, DRA's reads, a plugin pod's restart."""
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    cluster.kubectl("taint", "node", NODE, "example.com/maintenance=later:NoSchedule")
    kubelet = asyncio.get_running_loop().create_task(finish_terminating(cluster))
    try:
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            assert (await kube.check_node(NODE, timeout=10)).exists
            seen = asyncio.Event()
            watch = asyncio.get_running_loop().create_task(kube.watch_node(
                NODE, resources=["nvidia.com/gpu"], on_change=lambda view: seen.set()))
            await asyncio.wait_for(seen.wait(), 20)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            result = await kube.cordon(NODE, marker_prefix=PREFIX, timeout=10)
            assert result.cordoned_by_us
            when, told = await kube.notice_pods(
                NODE, annotation=f"{PREFIX}reclaim-at", value=lambda grace: "soon",
                reason="GPUReclaimNotice", message=lambda at: f"evicted from {at}", timeout=10)
            assert told == [f"{WORK}/trainer-1"]
            report = await kube.drain(NODE, timeout=60, emptydir_ok=True, unmanaged_ok=True,
                                      on_timeout=DrainTimeoutAction.ABORT)
            assert sorted(str(p) for p in report.evicted) == [f"{WORK}/trainer-1",
                                                              f"{WORK}/trainer-2"]
            await kube.annotate(NODE, {f"{PREFIX}state": "lent"},
                                labels={"hostagent.io/borrowed": "true"},
                                add_taints=[Taint(key="hostagent.io/borrowed")], timeout=10)
            paused = dict.fromkeys(PLUGIN_LABELS, "false")
            await kube.annotate(NODE, {}, labels=paused, timeout=10)
            await kube.annotate(NODE, {}, labels=dict.fromkeys(PLUGIN_LABELS), timeout=10)
            await kube.post_event(NODE, reason="Lent", message="lent by hostagent", timeout=10)
            found = await kube.gpu_api_of(NODE, driver="gpu.nvidia.com",
                                          resource="nvidia.com/gpu", timeout=10)
            assert found is None or found[0] is False
            assert await kube.dra_holders(NODE, driver="gpu.nvidia.com", uuids=["GPU-1"],
                                          timeout=10) == frozenset()
            cluster.kubectl("create", "-n", WORK, "-f", "-", input=a_pod(
                "plugin", NODE, app="nvidia-device-plugin-daemonset"))
            assert await kube.restart_plugins(NODE, timeout=10) == [f"{WORK}/plugin"]
            assert await kube.uncordon(NODE, marker_prefix=PREFIX, timeout=10)
            removed = await kube.unmark(NODE, marker_prefix=PREFIX,
                                        label="hostagent.io/borrowed",
                                        taints=[Taint(key="hostagent.io/borrowed")], timeout=10)
            assert "label hostagent.io/borrowed=true" in removed
    finally:
        kubelet.cancel()
        await asyncio.gather(kubelet, return_exceptions=True)
    events = cluster.kubectl("get", "events", "-n", "default", "-o", "json").stdout
    assert "lent by hostagent" in events
    node = cluster.get(f"/api/v1/nodes/{NODE}")
    assert {"key": "example.com/maintenance", "value": "later", "effect": "NoSchedule"} in \
        node["spec"]["taints"]
    assert not set(PLUGIN_LABELS) & set(node["metadata"].get("labels") or {})


def refused(plane: ControlPlane, kubeconfig: Path, *args: str, says: str) -> None:
    """`kubectl args` as the agent is refused with a 403 that says `says`."""
    out = plane.kubectl(*args, kubeconfig=kubeconfig, check=False)
    assert out.returncode != 0, f"kubectl {' '.join(args)} was allowed: {out.stdout}"
    assert "(Forbidden)" in out.stderr and says in out.stderr, out.stderr


async def test_a_stolen_token_reaches_its_node_and_the_pods_on_it_alone(
        cluster: ControlPlane, tmp_path: Path) -> None:
    """What the token of one host's agent may not do, each refused by the API server:
    run other code in a pod of its node (an image change), touch another node (its
    taint) or a pod on another node, put a label, annotation or taint of another's on
    its own node or take one off, or relabel a pod. The policy holds even where an
    administrator granted more (a ClusterRole that may patch every node)."""
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    cluster.kubectl("create", "-f", "-", input=manifest("Node", OTHER))
    cluster.kubectl("create", "-n", WORK, "-f", "-", input=a_pod("elsewhere", OTHER))
    cluster.kubectl("taint", "node", NODE, "example.com/maintenance=later:NoSchedule")
    pod = ["-n", WORK, "pod"]
    refused(cluster, kubeconfig, "get", "nodes",
            says='cannot list resource "nodes" in API group "" at the cluster scope')
    refused(cluster, kubeconfig, "patch", *pod, "trainer-1", "-p",  # strategic: by name
            json.dumps({"spec": {"containers": [{"name": "c", "image": "evil:1"}]}}),
            says="only hostagent.io/ annotations of a pod")
    refused(cluster, kubeconfig, "label", *pod, "trainer-1", "app=evil",
            says="only hostagent.io/ annotations of a pod")
    refused(cluster, kubeconfig, "annotate", *pod, "trainer-1", "example.com/x=1",
            says="only hostagent.io/ annotations of a pod")
    refused(cluster, kubeconfig, "annotate", *pod, "elsewhere", f"{PREFIX}reclaim-at=1",
            says="only the pods on its own node")
    refused(cluster, kubeconfig, "delete", *pod, "elsewhere", "--wait=false",
            says="only the pods on its own node")
    refused(cluster, kubeconfig, "taint", "node", OTHER, "evil=1:NoExecute",
            says='cannot get resource "nodes" in API group "" at the cluster scope')
    refused(cluster, kubeconfig, "label", "node", NODE, "evil=1",
            says="only hostagent.io/ labels")
    refused(cluster, kubeconfig, "annotate", "node", NODE, "example.com/x=1",
            says="only hostagent.io/ annotations on its node")
    refused(cluster, kubeconfig, "taint", "node", NODE, "evil=1:NoExecute",
            says="only hostagent.io/ taints")
    refused(cluster, kubeconfig, "taint", "node", NODE, "example.com/maintenance-",
            says="only hostagent.io/ taints")
    # An administrator's mistake: a role that may patch every node. The policy still
    # keeps the token to its own node.
    cluster.kubectl("create", "clusterrole", "too-much", "--verb=get,patch", "--resource=nodes")
    try:
        cluster.kubectl("create", "clusterrolebinding", "too-much", "--clusterrole=too-much",
                        f"--serviceaccount={IDENTITY.replace('system:serviceaccount:', '')}")
        refused(cluster, kubeconfig, "taint", "node", OTHER, "evil=1:NoExecute",
                says="only its own node")
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", "too-much",
                        "--ignore-not-found")
    assert (cluster.get(f"/api/v1/namespaces/{WORK}/pods/trainer-1")["spec"]["containers"][0]
            ["image"]) == "busybox"
    assert "taints" not in cluster.get(f"/api/v1/nodes/{OTHER}")["spec"]
    assert "evil" not in (cluster.get(f"/api/v1/nodes/{NODE}")["metadata"].get("labels") or {})


async def test_a_verb_the_manifest_does_not_grant_is_refused(
        cluster: ControlPlane, tmp_path: Path) -> None:
    """The real 403: the ServiceAccount may patch its node but never delete one."""
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    denied = cluster.kubectl("delete", "node", NODE, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    assert f'User "{IDENTITY}" cannot delete resource "nodes"' in denied.stderr


async def test_the_identity_deleted_as_it_was_applied_ends_its_tokens(
        cluster: ControlPlane, tmp_path: Path) -> None:
    """README's uninstall: the node's manifest deleted, a token made before is refused
    (401: the API server checks the ServiceAccount's UID, pkg/serviceaccount/claims.go)
    once the API server's cache of authenticated tokens forgets it (10 s by default,
    TokenSuccessCacheTTL in pkg/kubeapiserver/options/authentication.go; until then its
    roles are gone: 403)."""
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    assert cluster.kubectl("get", "node", NODE, kubeconfig=kubeconfig).returncode == 0
    cluster.kubectl("delete", "-f", "-", input=node_rbac(NODE))

    def unauthorized() -> bool:
        """Whether the token is refused as unknown; refused it is at every read."""
        out = cluster.kubectl("get", "node", NODE, kubeconfig=kubeconfig, check=False)
        assert out.returncode != 0 and ("(Forbidden)" in out.stderr
                                        or "(Unauthorized)" in out.stderr), out.stderr
        return "(Unauthorized)" in out.stderr
    await until(lambda: asyncio.to_thread(unauthorized),
                "the deleted ServiceAccount's token refused as unknown (401)", every=0.5)


async def test_a_right_missing_names_the_shipped_manifest(cluster: ControlPlane) -> None:
    """A credential without the rights: the agent's error says where every right it needs
    is listed (its list of rights had fallen behind what the agent calls)."""
    from hostagent.cluster.kube import KubeAuthError
    nobody = cluster.credential("nobody", "nobody")
    async with await Kube.connect(nobody, timing=FAST) as kube:
        with pytest.raises(KubeAuthError) as refused:
            await kube.check_node(NODE, timeout=10)
    assert refused.value.status == 403
    assert "deploy/rbac.yaml" in str(refused.value), str(refused.value)
