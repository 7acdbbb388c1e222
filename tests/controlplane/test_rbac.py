"""The agent under deploy/rbac.yaml, against the real kube-apiserver: every call it
makes is allowed, and every verb the manifest grants is one it makes.

The agent's credential is the ServiceAccount's token (kubectl create token), as on a
real cluster; the lab's kubelet is played by the admin (pods on a node with no kubelet
never finish terminating: the admin finishes what a kubelet would)."""

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
from tests.controlplane import ControlPlane
from tests.unit.kube_scaffold import FAST

REPO = Path(__file__).resolve().parents[2]
RBAC = REPO / "deploy" / "rbac.yaml"
NODE = "gpu-node"
PREFIX = "hostagent.io/"
WORK = "work"  # the namespace of the running test's pods


def rules() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of each rule of the manifest's ClusterRole."""
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "ClusterRole")
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


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


def agent_kubeconfig(plane: ControlPlane, path: Path) -> Path:
    """The agent's kubeconfig as README says to make it: the ServiceAccount's token."""
    plane.kubectl("apply", "-f", str(RBAC))
    token = plane.kubectl("create", "token", "hostagent", "-n", "hostagent",
                          "--duration=1h").stdout.strip()
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "hostagent",
        "clusters": [{"name": "lab", "cluster": {
            "server": plane.server, "certificate-authority": str(plane.pki / "ca.crt")}}],
        "users": [{"name": "hostagent", "user": {"token": token}}],
        "contexts": [{"name": "hostagent", "context": {"cluster": "lab",
                                                        "user": "hostagent"}}]}))
    return path


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
    for name in ("trainer-1", "trainer-2"):
        plane.kubectl("create", "-n", WORK, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "busybox"}],
                     "terminationGracePeriodSeconds": 1}}))
    try:
        yield plane
    finally:
        plane.kubectl("delete", "namespace", WORK, "--wait=false", check=False)
        plane.kubectl("delete", "node", NODE, check=False)


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
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    kubelet = asyncio.get_running_loop().create_task(finish_terminating(cluster))
    try:
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            assert (await kube.check_node(NODE, timeout=10)).exists
            result = await kube.cordon(NODE, marker_prefix=PREFIX, timeout=10)
            assert result.cordoned_by_us
            report = await kube.drain(NODE, timeout=60, emptydir_ok=True, unmanaged_ok=True,
                                      on_timeout=DrainTimeoutAction.ABORT)
            assert sorted(str(p) for p in report.evicted) == [f"{WORK}/trainer-1",
                                                              f"{WORK}/trainer-2"]
            await kube.annotate(NODE, {f"{PREFIX}state": "lent"},
                                labels={"hostagent.io/borrowed": "true"},
                                add_taints=[Taint(key="hostagent.io/borrowed")], timeout=10)
            await kube.post_event(NODE, reason="Lent", message="lent by hostagent", timeout=10)
            found = await kube.gpu_api_of(NODE, driver="gpu.nvidia.com",
                                          resource="nvidia.com/gpu", timeout=10)
            assert found is None or found[0] is False
            assert await kube.dra_holders(NODE, driver="gpu.nvidia.com", uuids=["GPU-1"],
                                          timeout=10) == frozenset()
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


async def test_a_verb_the_manifest_does_not_grant_is_refused(
        cluster: ControlPlane, tmp_path: Path) -> None:
    """The real 403: the ServiceAccount may patch its node but never delete one."""
    kubeconfig = agent_kubeconfig(cluster, tmp_path / "agent.kubeconfig")
    denied = cluster.kubectl("delete", "node", NODE, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    assert 'User "system:serviceaccount:hostagent:hostagent" cannot delete resource "nodes"' \
        in denied.stderr


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
