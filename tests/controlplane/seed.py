"""What a test puts in the real cluster, as the admin, and takes out again (`reset`).

    async with Seed(plane) as seed:                   # reset when it ends
        await seed.node("gpu-node", gpus=2)           # status through its subresource
        async with seed.kubelet("gpu-node"):          # runs its pods, ends their deletions
            await seed.pod("web-1", node="gpu-node", owner="ReplicaSet/web")
            await seed.pdb("web", match_labels={"app": "web"}, min_available=1)

A pod is created bound to its node (as the scheduler leaves one) and its owner is the
real controller: the test's pods are made first and the ReplicaSet, StatefulSet, Job
or DaemonSet after them, which adopts them (its selector matches them) as it adopts any
orphan; an evicted pod's replacement is then the controller's own, on
`replacement_node` or, by default, unschedulable and Pending. A mirror pod is owned by
its Node. Only a kubelet finishes a graceful deletion: without `kubelet(node)` running,
a deleted pod stays Terminating, as on a node whose kubelet is gone.

Everything seeded carries the label SEEDED, and `reset` deletes it (owners first,
orphaning their pods; pods at once, grace period 0), and the nodes this Seed created:
one control plane serves every test of a process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.controlplane import ControlPlane
from tests.controlplane.kubelet import Pods
from tests.waiting import until

__all__ = ["SEEDED", "Seed", "gpu_status", "ready_condition"]

Obj = dict[str, Any]
SEEDED = "lab.hostagent.io/seeded"
OWNER = "lab.hostagent.io/owner"
MIRROR = "kubernetes.io/config.mirror"
NOWHERE = {"lab.hostagent.io/nowhere": "true"}  # a node selector no node matches
DRA_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver (tests/controlplane/nvidia.py)
HOSTAGENT = "hostagent"  # the source.component of hostagent's Events
_APIS = {"ReplicaSet": "apps/v1", "StatefulSet": "apps/v1", "DaemonSet": "apps/v1",
         "Job": "batch/v1"}


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_condition(status: str) -> Obj:
    """A node's Ready condition as the kubelet (True, False) or the node lifecycle
    controller (Unknown) writes it (pkg/kubelet/nodestatus, pkg/controller/nodelifecycle)."""
    reason, message = {
        "True": ("KubeletReady", "kubelet is posting ready status"),
        "False": ("KubeletNotReady", "container runtime network not ready: NetworkReady=false"),
        "Unknown": ("NodeStatusUnknown", "Kubelet stopped posting node status."),
    }[status]
    stamp = _stamp()
    return {"type": "Ready", "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}


def gpu_status(gpus: int, *, resource: str = "nvidia.com/gpu", replicas: int = 1,
               mig: dict[str, int] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(GPU Feature Discovery labels, allocatable) of a node with `gpus` physical GPUs,
    as the NVIDIA device plugin and GFD publish them: `replicas` > 1 is time-slicing
    (``nvidia.com/gpu.replicas``, allocatable GPUs × the replicas); `mig` maps MIG
    profiles to devices per GPU, mixed strategy (``nvidia.com/mig-<profile>`` resources
    and ``.count`` labels, the fully partitioned GPUs no longer ``nvidia.com/gpu``)."""
    labels = {"nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.present": "true",
              "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    if mig:
        labels["nvidia.com/mig.strategy"] = "mixed"
        allocatable = {resource: "0"}
        for profile, per_gpu in mig.items():
            labels[f"nvidia.com/mig-{profile}.count"] = str(per_gpu * gpus)
            allocatable[f"nvidia.com/mig-{profile}"] = str(per_gpu * gpus)
        return labels, allocatable
    labels["nvidia.com/gpu.replicas"] = str(replicas)
    if replicas > 1:
        labels["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
    return labels, {resource: str(gpus * replicas)}


class Seed:
    """The admin's hands on the cluster for one test. `replacement_node`: where the
    controllers of pods seeded from now on put their replacements (None: nowhere);
    `replacement_ready_after`: seconds before those turn Ready (a readiness probe's
    initialDelaySeconds, which the lab's kubelet keeps)."""

    def __init__(self, plane: ControlPlane, *, replacement_node: str | None = None,
                 replacement_ready_after: int = 0, grace_scale: float = 0.005) -> None:
        self.plane = plane
        self.replacement_node = replacement_node
        self.replacement_ready_after = replacement_ready_after
        self.grace_scale = grace_scale
        self.nodes: list[str] = []
        self.namespaces: set[str] = set()  # those whose default ServiceAccount is there
        self._kubelets: dict[str, Pods] = {}
        self._client: client.ApiClient | None = None

    async def __aenter__(self) -> Seed:
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(self.plane.admin),
                                      client_configuration=configuration, persist_config=False)
        self._client = client.ApiClient(configuration)
        # Any: the client's bodies are typed as its models, and these send plain dicts.
        self.core: Any = client.CoreV1Api(self._client)
        self.apps: Any = client.AppsV1Api(self._client)
        self.batch: Any = client.BatchV1Api(self._client)
        self.policy: Any = client.PolicyV1Api(self._client)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.reset()
        finally:
            assert self._client is not None
            await self._client.close()

    def plain(self, obj: Any) -> Obj:
        """A client object as the API's JSON (camelCase keys, no Nones)."""
        assert self._client is not None
        out: Obj = self._client.sanitize_for_serialization(obj)
        return out

    # --- nodes ---------------------------------------------------------------------------

    async def node(self, name: str, *, ready: bool | str = True, unschedulable: bool = False,
                   gpus: int | None = None, gpu_resource: str = "nvidia.com/gpu",
                   replicas: int = 1, mig: dict[str, int] | None = None,
                   labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None,
                   taints: list[Obj] | None = None) -> Obj:
        """A registered node with its status (capacity, allocatable, Ready) written
        through the status subresource, as its kubelet does; `gpus` as the device
        plugin and GPU Feature Discovery publish them (see `gpu_status`)."""
        resources = {"cpu": "4", "memory": "16Gi", "pods": "110"}
        gfd: dict[str, str] = {}
        if gpus is not None:
            gfd, extended = gpu_status(gpus, resource=gpu_resource, replicas=replicas, mig=mig)
            resources.update(extended)
        spec: Obj = {"unschedulable": unschedulable} if unschedulable else {}
        if taints:
            spec["taints"] = taints
        await self.core.create_node({
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, SEEDED: "true",
                                                  **gfd, **(labels or {})},
                         "annotations": dict(annotations or {})},
            "spec": spec})
        self.nodes.append(name)
        status = ready if isinstance(ready, str) else ("True" if ready else "False")
        return await self.node_status(name, capacity=resources, allocatable=dict(resources),
                                      conditions=[ready_condition(status)],
                                      addresses=[{"type": "Hostname", "address": name}])

    async def node_status(self, name: str, **status: Any) -> Obj:
        """Merge `status` into the node's status (strategic merge: conditions by type)."""
        return self.plain(await self.core.patch_node_status(name, {"status": status}))

    async def ready(self, name: str, status: str = "True") -> Obj:
        return await self.node_status(name, conditions=[ready_condition(status)])

    async def schedulable(self, name: str) -> None:
        """Until the node lifecycle controller has taken its not-ready taint off (the
        scheduler places nothing on the node before)."""
        async def untainted() -> bool:
            return not any(t.key.startswith("node.kubernetes.io/")
                           for t in (await self.core.read_node(name)).spec.taints or [])
        await until(untainted, f"node {name} schedulable", every=0.05)

    async def get_node(self, name: str) -> Obj:
        return self.plain(await self.core.read_node(name))

    async def patch_node(self, name: str, patch: Obj) -> Obj:
        return self.plain(await self.core.patch_node(name, patch))

    @contextlib.asynccontextmanager
    async def kubelet(self, node: str) -> AsyncIterator[Pods]:
        """The node's kubelet (tests/controlplane/kubelet.py) while the block runs, or
        until `kubelet_gone`, as the node's own user: it runs the node's pods (seeded
        pods wait for it to make them Ready) and ends their deletions."""
        kubeconfig = self.plane.credential(f"node-{node}", f"system:node:{node}",
                                           "system:nodes")
        pods = Pods(kubeconfig, node, grace_scale=self.grace_scale, interval=0.05)
        await pods.__aenter__()
        self._kubelets[node] = pods
        try:
            yield pods
        finally:
            await self.kubelet_gone(node)

    async def kubelet_gone(self, node: str) -> None:
        """Stop the node's kubelet: its pods' deletions are never finished."""
        pods = self._kubelets.pop(node, None)
        if pods is not None:
            await pods.__aexit__(None, None, None)

    # --- pods ----------------------------------------------------------------------------

    async def pod(self, name: str, *, node: str | None, namespace: str = "default",
                  owner: str | None = None, labels: dict[str, str] | None = None,
                  phase: str | None = None, emptydir: bool = False, mirror: bool = False,
                  grace: int = 30, gpus: dict[str, int] | None = None,
                  uuids: list[str] | None = None,
                  annotations: dict[str, str] | None = None) -> Obj:
        """A pod bound to `node`; `owner` is "Kind/name", e.g. "ReplicaSet/web" (its
        controller adopts it; a DaemonSet's on a further node is its own, named by it:
        use the name returned); `phase` "Succeeded" or "Failed": a pod that ended;
        `gpus`: what its container requests and limits, e.g. {"nvidia.com/gpu": 1};
        `uuids`: GPUs of NVIDIA's DRA driver it holds through a ResourceClaim of its own
        (one request per GPU, selecting it by its uuid attribute), which the scheduler
        allocates and reserves for it as it places it on `node`."""
        own: dict[str, str] = {}
        if owner is not None:
            kind, _, owner_name = owner.partition("/")
            own = {OWNER: f"{kind.lower()}.{owner_name}"}
        await self.namespace(namespace)
        meta: Obj = {"name": name, "namespace": namespace,
                     "labels": {SEEDED: "true", **own, **(labels or {})},
                     "annotations": dict(annotations or {})}
        if mirror:
            assert node is not None
            uid = (await self.core.read_node(node)).metadata.uid
            meta["annotations"][MIRROR] = f"mirror-{name}"
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node,
                                        "uid": uid, "controller": True}]
        spec = _pod_spec(grace, emptydir=emptydir, gpus=gpus,
                         restart="Never" if phase in ("Succeeded", "Failed") or (
                             owner or "").startswith("Job/") else "Always")
        if uuids:
            resource = client.ResourceV1Api(self._client)
            claim: Any = await resource.create_namespaced_resource_claim(namespace, {
                "metadata": {"generateName": f"{name}-gpu-", "labels": {SEEDED: "true"}},
                "spec": {"devices": {"requests": [{"name": f"gpu{i}", "exactly": {
                    "deviceClassName": DRA_DRIVER, "selectors": [{"cel": {"expression": (
                        f"device.attributes['{DRA_DRIVER}'].uuid == '{uuid}'")}}]}}
                    for i, uuid in enumerate(uuids)]}}})  # type: ignore[arg-type]
            spec["resourceClaims"] = [{"name": "gpu",
                                       "resourceClaimName": claim.metadata.name}]
            spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
            if node is not None:  # the scheduler's to place: it allocates the claim
                spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        elif node is not None:
            spec["nodeName"] = node
        count = 0
        if owner is not None:
            mine = (await self.core.list_namespaced_pod(
                namespace, label_selector=f"{OWNER}={own[OWNER]}")).items
            count = 1 + len(mine)
            if owner.startswith("DaemonSet/") and mine:
                return await self._daemon(owner, namespace, own, labels or {}, node,
                                          {p.spec.node_name for p in mine})
            if owner.startswith(("ReplicaSet/", "Job/")):
                # Room first: one more pod than it wants is one it deletes. It may
                # make one of its own meanwhile; the one it then deletes is that,
                # unscheduled or newer (controller.ActivePodsWithRanks).
                await self._owner(owner, namespace, own, labels or {}, count, create=False)
        created = await self.core.create_namespaced_pod(namespace, {
            "metadata": meta, "spec": spec})
        if phase is not None:
            if node in self._kubelets:  # it ran first: a kubelet's later Running would undo it
                await self._until(namespace, name, "Ready", _ready)
            await self.core.patch_namespaced_pod_status(name, namespace, {"status": {
                "phase": phase, "conditions": [{"type": "Ready", "status": "False",
                                                "reason": "PodCompleted"}]}})
        if owner is not None:
            kind = owner.partition("/")[0]
            await self._owner(owner, namespace, own, labels or {}, count)
            await self._until(namespace, name, f"adopted by its {kind}", lambda pod: any(
                r.controller and r.kind == kind for r in pod.metadata.owner_references or []))
        if uuids:
            return await self._until(namespace, name, "placed and Ready",
                                     lambda pod: bool(pod.spec.node_name) and _ready(pod))
        if node in self._kubelets and phase is None:
            return await self._until(namespace, name, "Ready", _ready)
        return self.plain(created)

    async def _owner(self, owner: str, namespace: str, own: dict[str, str],
                     labels: dict[str, str], count: int, *, create: bool = True,
                     nodes: set[str] | None = None) -> None:
        """Create `owner` ("Kind/name") of the `count` pods labelled `own`, or scale it
        to them (`create` False: only if it exists)."""
        kind, _, name = owner.partition("/")
        template_spec = _pod_spec(30, restart="Never" if kind == "Job" else "Always")
        if self.replacement_ready_after:
            template_spec["containers"][0]["readinessProbe"] = {
                "exec": {"command": ["true"]},
                "initialDelaySeconds": self.replacement_ready_after}
        if self.replacement_node is not None:
            template_spec["nodeName"] = self.replacement_node
        else:
            template_spec["nodeSelector"] = dict(NOWHERE)
        template = {"metadata": {"labels": {SEEDED: "true", **own, **labels}},
                    "spec": template_spec}
        selector = {"matchLabels": dict(own)}
        if kind == "DaemonSet":
            # The DaemonSet's pods go to the nodes its selector picks: their own.
            nodes = nodes or {p.spec.node_name for p in (await self.core.list_namespaced_pod(
                namespace, label_selector=f"{OWNER}={own[OWNER]}")).items}
            template_spec.pop("nodeName", None)
            template_spec["nodeSelector"] = {}
            template_spec["affinity"] = {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                           "values": sorted(nodes)}]}]}}}
        body: Obj = {"apiVersion": _APIS[kind], "kind": kind,
                     "metadata": {"name": name, "labels": {SEEDED: "true"}},
                     "spec": {"selector": selector, "template": template}}
        if kind == "ReplicaSet":
            body["spec"]["replicas"] = count
        elif kind == "StatefulSet":
            body["spec"].update(replicas=count, serviceName=name,
                                podManagementPolicy="Parallel",
                                updateStrategy={"type": "OnDelete"})  # ours: no revision, never "updated"
        elif kind == "Job":
            # No completions: a work queue, whose parallelism alone can grow.
            body["spec"].update(parallelism=count, manualSelector=True)
        else:
            body["spec"]["updateStrategy"] = {"type": "OnDelete"}  # as for the StatefulSet
        make, scale = {
            "ReplicaSet": (self.apps.create_namespaced_replica_set,
                           self.apps.patch_namespaced_replica_set),
            "StatefulSet": (self.apps.create_namespaced_stateful_set,
                            self.apps.patch_namespaced_stateful_set),
            "DaemonSet": (self.apps.create_namespaced_daemon_set,
                          self.apps.patch_namespaced_daemon_set),
            "Job": (self.batch.create_namespaced_job, self.batch.patch_namespaced_job),
        }[kind]
        if create:
            try:
                await make(namespace, body)
                return
            except ApiException as e:
                if e.status != 409:
                    raise
        # A Job's template is immutable; the others' changes apply to new pods only.
        change = {k: v for k, v in body["spec"].items()
                  if k in ("replicas", "parallelism") or (k == "template" and kind != "Job")}
        try:
            await scale(name, namespace, {"spec": change})
        except ApiException as e:
            if create or e.status != 404:
                raise

    async def _daemon(self, owner: str, namespace: str, own: dict[str, str],
                      labels: dict[str, str], node: str | None, nodes: set[str]) -> Obj:
        """The DaemonSet's own pod on one more node: a pod of ours there would race its
        controller's (the older of two stays, and ours is newer)."""
        assert node is not None
        await self._owner(owner, namespace, own, labels, 0, nodes=nodes | {node})

        async def placed() -> Any:
            pods = (await self.core.list_namespaced_pod(
                namespace, label_selector=f"{OWNER}={own[OWNER]}",
                field_selector=f"spec.nodeName={node}")).items
            return pods[0] if pods and (node not in self._kubelets or any(
                c.type == "Ready" and c.status == "True"
                for c in pods[0].status.conditions or [])) else None
        return self.plain(await until(placed, f"a pod of {owner} on {node}"))

    async def namespace(self, name: str) -> None:
        """Namespace `name`, kept for the process's later tests (a deleted one takes a while
        to go), once its default ServiceAccount is there (a pod before it is refused)."""
        if name in self.namespaces:
            return
        with contextlib.suppress(ApiException):  # 409: an earlier test's
            await self.core.create_namespace({"metadata": {"name": name}})

        async def account() -> bool:
            try:
                await self.core.read_namespaced_service_account("default", name)
            except ApiException as e:
                if e.status != 404:
                    raise
                return False
            return True
        await until(account, f"the default ServiceAccount of namespace {name}")
        self.namespaces.add(name)

    async def _until(self, namespace: str, name: str, what: str,
                     cond: Callable[[Any], bool]) -> Obj:
        async def read() -> Any:
            pod = await self.core.read_namespaced_pod(name, namespace)
            return pod if cond(pod) else None
        return self.plain(await until(read, f"pod {namespace}/{name} {what}"))

    async def pods(self, node: str | None = None, namespace: str | None = None) -> list[Obj]:
        """The pods (on `node`; in `namespace`), by namespace and name."""
        selector = f"spec.nodeName={node}" if node else ""
        listed = (await self.core.list_namespaced_pod(namespace, field_selector=selector)
                  if namespace else
                  await self.core.list_pod_for_all_namespaces(field_selector=selector))
        pods = [self.plain(p) for p in listed.items]
        return sorted(pods, key=lambda p: (p["metadata"]["namespace"], p["metadata"]["name"]))

    async def get_pod(self, namespace: str, name: str) -> Obj | None:
        try:
            return self.plain(await self.core.read_namespaced_pod(name, namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> None:
        """A delete as a user's: graceful, its kubelet ends it (`grace` 0: at once)."""
        body = {} if grace is None else {"gracePeriodSeconds": grace}
        await self.core.delete_namespaced_pod(name, namespace, body=body)

    async def pdb(self, name: str, *, match_labels: dict[str, str], namespace: str = "default",
                  min_available: int | str | None = None,
                  max_unavailable: int | str | None = None,
                  unhealthy_pod_eviction_policy: str | None = None) -> Obj:
        """A PodDisruptionBudget, once the disruption controller has computed its status
        (the eviction API refuses to decide on a budget it has not: 429), or failed to:
        with maxUnavailable or a percentage it needs the pods' controller's scale, which
        a Job has not (its status then stays unobserved, and every eviction is refused)."""
        spec: Obj = {"selector": {"matchLabels": dict(match_labels)}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        if unhealthy_pod_eviction_policy is not None:
            spec["unhealthyPodEvictionPolicy"] = unhealthy_pod_eviction_policy
        await self.policy.create_namespaced_pod_disruption_budget(namespace, {
            "metadata": {"name": name, "labels": {SEEDED: "true"}}, "spec": spec})

        async def computed() -> Any:
            pdb = await self.policy.read_namespaced_pod_disruption_budget(name, namespace)
            status = pdb.status
            return pdb if status is not None and (
                status.observed_generation == pdb.metadata.generation
                or any(c.reason == "SyncFailed" for c in status.conditions or [])) else None
        return self.plain(await until(computed, f"a status for PodDisruptionBudget {name}"))

    async def events(self, namespace: str = "default") -> list[Obj]:
        """The Events hostagent posted, oldest first."""
        listed = await self.core.list_namespaced_event(namespace,
                                                       field_selector=f"source={HOSTAGENT}")
        return [self.plain(e) for e in listed.items]

    async def budget(self, namespace: str, name: str) -> Obj:
        return self.plain(await self.policy.read_namespaced_pod_disruption_budget(
            name, namespace))

    # --- reset ---------------------------------------------------------------------------

    async def reset(self) -> None:
        """Delete what was seeded: owners (orphaning their pods, which would otherwise
        wait out their grace period), budgets, pods at once, then the nodes."""
        namespaces = sorted(self.namespaces | {"default", "kube-system"})
        await asyncio.gather(*(self._clear(namespace) for namespace in namespaces))
        # The Events hostagent posted (the kubelet's way: on the node's name, in default).
        await self.core.delete_collection_namespaced_event(
            "default", field_selector=f"source={HOSTAGENT}", body={"gracePeriodSeconds": 0})
        for node in self.nodes:
            with contextlib.suppress(ApiException):
                await self.core.delete_node(node)
        self.nodes.clear()

    async def _clear(self, namespace: str) -> None:
        label = f"{SEEDED}=true"
        orphan = {"propagationPolicy": "Orphan", "gracePeriodSeconds": 0}
        await asyncio.gather(*(delete(namespace, label_selector=label, body=orphan) for delete in (
            self.apps.delete_collection_namespaced_replica_set,
            self.apps.delete_collection_namespaced_stateful_set,
            self.apps.delete_collection_namespaced_daemon_set,
            self.batch.delete_collection_namespaced_job,
            self.policy.delete_collection_namespaced_pod_disruption_budget)))
        await self.core.delete_collection_namespaced_pod(
            namespace, label_selector=label, body={"gracePeriodSeconds": 0})
        await client.ResourceV1Api(self._client).delete_collection_namespaced_resource_claim(
            namespace, label_selector=label)
        for pod in (await self.core.list_namespaced_pod(namespace, label_selector=label)).items:
            if pod.metadata.finalizers:  # a Job's tracking finalizer
                with contextlib.suppress(ApiException):
                    await self.core.patch_namespaced_pod(
                        pod.metadata.name, namespace, {"metadata": {"finalizers": None}})


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _pod_spec(grace: int, *, restart: str = "Always", emptydir: bool = False,
              gpus: dict[str, int] | None = None) -> Obj:
    container: Obj = {"name": "main", "image": "registry.example/app:1"}
    spec: Obj = {"containers": [container], "restartPolicy": restart,
                 "terminationGracePeriodSeconds": grace,
                 "automountServiceAccountToken": False}
    if gpus:
        amounts = {k: str(v) for k, v in gpus.items()}
        container["resources"] = {"requests": amounts, "limits": dict(amounts)}
    if emptydir:
        container["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    return spec
