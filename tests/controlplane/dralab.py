"""The DRA lab on the real control plane: node gpu-node, whose kubelet stand-in
(tests/controlplane/kubelet.py) posts it Ready and runs the pods bound to it, NVIDIA's
DRA driver ready to publish its GPUs (tests/controlplane/nvidia.py), a namespace of the
test's own, and the agent's Kube as its ServiceAccount under deploy/rbac.yaml; and what
tests read and write of them (`Lab`). Shared by tests/unit/cluster/test_dra.py and
tests/controlplane/test_dra_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kubeconfigs
from kubernetes_asyncio.client.exceptions import ApiException

from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import Config
from hostagent.cluster.kube import Kube
from tests.controlplane import ControlPlane
from tests.controlplane.kubelet import Pods
from tests.controlplane.nvidia import DEVICE_CLASS, DRIVER, Driver
from tests.controlplane.rbac import agent_kubeconfig
from tests.unit.kube_scaffold import FAST
from tests.waiting import until

NODE = "gpu-node"
NAMESPACES = itertools.count()


@dataclass
class Lab:
    plane: ControlPlane
    namespace: str
    driver: Driver
    kube: Kube  # the agent's, under deploy/rbac.yaml
    kubeconfig: Path

    async def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        done = await asyncio.to_thread(self.plane.kubectl, *args, input=input, check=check)
        return done.stdout

    async def json(self, *args: str) -> Any:
        return json.loads(await self.kubectl(*args, "-o", "json"))

    async def node(self, name: str = NODE) -> dict[str, Any]:
        node: dict[str, Any] = await self.json("get", "node", name)
        return node

    async def annotations(self) -> dict[str, str]:
        return dict((await self.node())["metadata"].get("annotations") or {})

    async def unschedulable(self) -> bool:
        return bool((await self.node())["spec"].get("unschedulable"))

    async def events(self) -> list[dict[str, Any]]:
        """hostagent's Events on the node (namespace default, as the kubelet's)."""
        items: list[dict[str, Any]] = (await self.json("get", "events", "-n", "default"))["items"]
        return [e for e in items if e.get("source", {}).get("component") == "hostagent"
                or e.get("reportingComponent") == "hostagent"]

    async def claims(self) -> list[str]:
        items = (await self.json("get", "resourceclaims", "-n", self.namespace))["items"]
        return sorted(c["metadata"]["name"] for c in items)

    async def pods(self) -> list[str]:
        items = (await self.json("get", "pods", "-n", self.namespace))["items"]
        return sorted(p["metadata"]["name"] for p in items)

    async def add_pod(self, name: str, *, node: str | None = NODE, namespace: str | None = None,
                      labels: dict[str, str] | None = None, claim: str | None = None
                      ) -> dict[str, Any]:
        """A pod bound to `node` (its kubelet stand-in starts it), using `claim`; with
        `node` None, one no scheduler takes (a scheduler name of its own), for `bind`."""
        spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
        spec.update({"nodeName": node} if node else {"schedulerName": "lab-by-hand"})
        if claim is not None:
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
            spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels or {}}, "spec": spec}
        created: dict[str, Any] = json.loads(await self.kubectl(
            "create", "-n", namespace or self.namespace, "-o", "json", "-f", "-",
            input=json.dumps(body)))
        return created

    async def hold(self, name: str, devices: list[str], *, node: str = NODE,
                   admin: bool = False) -> dict[str, Any]:
        """Pod `name` on `node` holding `devices` of the node's pool through claim
        <name>-gpu, in the scheduler's order: the claim allocated and reserved for the
        pod, then the pod bound to the node (pods/binding). The claim is owned by the
        pod, as one made from its template is (it goes with it)."""
        claim = f"{name}-gpu"
        exactly: dict[str, Any] = {"deviceClassName": DRIVER, "count": len(devices)}
        if admin:
            exactly["adminAccess"] = True
        await self.kubectl("create", "-n", self.namespace, "-f", "-", input=json.dumps({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": claim},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}))
        pod = await self.add_pod(name, node=None, claim=claim)
        meta = pod["metadata"]
        await self.kubectl("patch", "resourceclaim", "-n", self.namespace, claim, "--type=merge",
                           "-p", json.dumps({"metadata": {"ownerReferences": [{
                               "apiVersion": "v1", "kind": "Pod", "name": name,
                               "uid": meta["uid"], "controller": True,
                               "blockOwnerDeletion": True}]}}))
        results = [{"request": "gpu", "driver": DRIVER, "pool": node, "device": d,
                    **({"adminAccess": True} if admin else {})} for d in devices]
        await self.kubectl("patch", "resourceclaim", "-n", self.namespace, claim,
                           "--subresource=status", "--type=merge", "-p", json.dumps({
                               "status": {"allocation": {
                                   "devices": {"results": results},
                                   "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                                       "key": "metadata.name", "operator": "In",
                                       "values": [node]}]}]}},
                                   "reservedFor": [{"resource": "pods", "name": name,
                                                    "uid": meta["uid"]}]}}))
        await self.kubectl("create", "--raw",
                           f"/api/v1/namespaces/{self.namespace}/pods/{name}/binding",
                           "-f", "-", input=json.dumps({
                               "apiVersion": "v1", "kind": "Binding",
                               "metadata": {"name": name},
                               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}))
        return pod

    def cluster(self, cfg: Config, metrics: Any = None) -> KubeCluster:
        """hostagent's KubeCluster for `cfg` on the agent's Kube."""
        return KubeCluster(self.kube, cfg, remember_cordon=lambda _: None, metrics=metrics)

    # --- as the test's user sees it with kubectl

    async def create(self, *objects: dict[str, Any]) -> None:
        """`objects` created in the test's namespace, through kubectl's validation."""
        await self.kubectl("create", "-n", self.namespace, "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    async def get(self, kind: str, name: str = "") -> Any:
        return await self.json("get", kind, *([name] if name else []), "-n", self.namespace)

    async def live(self) -> dict[str, dict[str, Any]]:
        """The test's pods not being deleted, by name."""
        return {p["metadata"]["name"]: p for p in (await self.get("pods"))["items"]
                if not p["metadata"].get("deletionTimestamp")}

    async def running(self, *names: str) -> dict[str, dict[str, Any]]:
        """Once each of `names` runs: the test's pods, by name."""
        async def live() -> dict[str, dict[str, Any]] | None:
            pods = await self.live()
            return pods if all(pods.get(n, {}).get("status", {}).get("phase") == "Running"
                               for n in names) else None
        found: dict[str, dict[str, Any]] = await until(
            live, f"{', '.join(names)} running", every=0.2)
        return found

    async def claim_of(self, pod: str) -> dict[str, Any]:
        """The claim made for `pod` from its template, as its status names it."""
        status = (await self.get("pod", pod))["status"]
        name = next(s["resourceClaimName"] for s in status["resourceClaimStatuses"])
        claim: dict[str, Any] = await self.get("resourceclaim", name)
        return claim


@dataclass(frozen=True)
class Accounts:
    node: Path  # the node's kubelet: system:node:gpu-node
    agent: Path  # the agent's ServiceAccount token, under deploy/rbac.yaml


@contextlib.contextmanager
def accounts(plane: ControlPlane, root: Path) -> Iterator[Accounts]:
    """What every test of a module uses, made once (a module-scoped fixture): the
    credentials, and the driver's DeviceClass, deleted at the end."""
    made = Accounts(plane.credential(f"kubelet-{NODE}", f"system:node:{NODE}", "system:nodes"),
                    agent_kubeconfig(plane, root / "agent.kubeconfig"))
    plane.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_CLASS))
    try:
        yield made
    finally:
        plane.kubectl("delete", "deviceclass", DRIVER, "--ignore-not-found")


async def _gone(call: Awaitable[object]) -> None:
    with contextlib.suppress(ApiException):  # 404: gone already
        await call


@contextlib.asynccontextmanager
async def dra_lab(plane: ControlPlane, accounts: Accounts) -> AsyncIterator[Lab]:
    """A DRA node: gpu-node Ready (its kubelet stand-in), no nvidia.com/gpu in its
    status, the driver's plugin ready to publish; a namespace of the test's own; the
    agent's Kube. All of it gone afterwards (through the admin's client: quick)."""
    namespace = f"dra-{next(NAMESPACES)}"
    configuration = client.Configuration()
    await kubeconfigs.load_kube_config(config_file=str(plane.admin),
                                  client_configuration=configuration, persist_config=False)
    async with client.ApiClient(configuration) as admin:
        core, resource = client.CoreV1Api(admin), client.ResourceV1Api(admin)
        await core.create_namespace(client.V1Namespace(
            metadata=client.V1ObjectMeta(name=namespace)))
        async def account() -> bool:
            return bool((await core.list_namespaced_service_account(namespace)).items)
        # Pods are refused until its ServiceAccount is in.
        await until(account, f"a ServiceAccount in namespace {namespace}")
        try:
            async with Pods(accounts.node, NODE, ready=True), \
                    Driver(plane.admin, NODE) as driver, \
                    await Kube.connect(accounts.agent, timing=FAST) as kube:
                yield Lab(plane, namespace, driver, kube, accounts.agent)
        finally:
            await _gone(core.delete_namespace(namespace))
            await _gone(core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0))
            await _gone(resource.delete_collection_resource_slice())
            await _gone(core.delete_node(NODE))
            await _gone(client.CoordinationV1Api(admin).delete_namespaced_lease(
                NODE, "kube-node-lease"))
            await _gone(core.delete_collection_namespaced_event("default"))
