"""The pod side of a lab kubelet, against the real API server, as the node's own user
(system:node:<name>, so the Node authorizer checks it as it checks a kubelet).

A real kubelet (Kubernetes v1.35, pkg/kubelet) registers its node with its capacity,
renews its Lease in kube-node-lease every 10 s (nodelease), runs the pods the scheduler
bound to it and posts their status (Running, Ready), and when a pod is deleted stops its
containers within the grace period and then deletes it for good (grace period 0,
status_manager). The lab has no container runtime: a pod's containers "stop" when its
grace period, times `grace_scale`, has passed. The node's Ready condition and its GPUs
are the part of tests/controlplane/machine.py's Kubelet, built on this one; with `ready`
this one posts Ready itself (a node whose GPUs are DRA devices, which the node's
status does not carry).

Admission: each pod bound to the node is admitted once in each life of the kubelet
(kubelet.go HandlePodAdditions: every pod there at its start, then each one bound);
a pod refused fails as kubelet.go rejectPod writes it (phase Failed, its reason,
"Pod was rejected: ..."). This one admits every pod; machine.py's adds the device
manager's Allocate.

DRA: a real kubelet's DRA manager (pkg/kubelet/cm/dra, manager.go prepareResources)
reads each of a pod's ResourceClaims before its containers start, refuses to start it
while a claim is missing, not made for it (one from a template must be owned by the
pod) or not reserved for it, and then calls the driver's NodePrepareResources (and
NodeUnprepareResources after they stop). This one does the checks, leaving such a pod
Pending to look again, and skips the calls: the lab has no driver process to call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)
LEASE_NAMESPACE = "kube-node-lease"
CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110"}


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Pods:
    def __init__(self, kubeconfig: Path, node: str, *, grace_scale: float = 0.05,
                 interval: float = 0.2, lease_every: float = 10.0,
                 ready: bool = False) -> None:
        self.kubeconfig = kubeconfig
        self.node = node
        self.ready = ready
        self._ready_since = ""
        self.grace_scale = grace_scale
        self.interval = interval
        self.lease_every = lease_every
        self._task: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()
        self._claims: Any = None
        # The pods this kubelet admitted since it started (their UIDs), and the UIDs of
        # the node's pods not yet finished, as the last look found them.
        self._admitted: set[str] = set()
        self._live: set[str] = set()

    async def __aenter__(self) -> Pods:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"pods {self.node}")
        waiter = asyncio.ensure_future(self._registered.wait())
        await asyncio.wait([waiter, self._task], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            waiter.cancel()
            self._task.result()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            if self._task.done():
                self._task.result()  # what ended it, if not a cancellation
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run(self) -> None:
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(self.kubeconfig),
                                      client_configuration=configuration, persist_config=False)
        async with client.ApiClient(configuration) as api_client:
            core = client.CoreV1Api(api_client)
            self._claims = client.ResourceV1Api(api_client)
            leases = client.CoordinationV1Api(api_client)
            await self._register(core)
            self._registered.set()
            renewed = -self.lease_every
            loop = asyncio.get_running_loop()
            while True:
                try:
                    if loop.time() - renewed >= self.lease_every:
                        await self._renew(leases)
                        if self.ready:
                            await self._post_ready(core)
                        renewed = loop.time()
                    await self._sync(core)
                except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as e:
                    log.debug("kubelet for %s: %r", self.node, e)
                await asyncio.sleep(self.interval)

    async def _register(self, core: Any) -> bool:
        """Whether the node was created (False: registered before, as after a reboot)."""
        try:
            await core.create_node({
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                           "kubernetes.io/os": "linux"}},
                "status": {"capacity": CAPACITY, "allocatable": CAPACITY,
                           "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                         {"type": "Hostname", "address": self.node}],
                           "nodeInfo": {"kubeletVersion": "v1.35.4",
                                        "containerRuntimeVersion": "lab://0",
                                        "operatingSystem": "linux", "architecture": "amd64"}},
            }, _request_timeout=5)
        except ApiException as e:
            if e.status != 409:
                raise
            return False
        return True

    async def _post_ready(self, core: Any) -> None:
        stamp = _stamp()
        self._ready_since = self._ready_since or stamp
        await core.patch_node_status(self.node, {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "kubelet is posting ready status", "lastHeartbeatTime": stamp,
             "lastTransitionTime": self._ready_since}]}}, _request_timeout=5)

    async def _renew(self, leases: Any) -> None:
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                "renewTime": _stamp()}
        try:
            await leases.patch_namespaced_lease(self.node, LEASE_NAMESPACE, {"spec": spec},
                                                _request_timeout=5)
        except ApiException as e:
            if e.status != 404:
                raise
            await leases.create_namespaced_lease(LEASE_NAMESPACE, {
                "metadata": {"name": self.node}, "spec": spec}, _request_timeout=5)

    async def _sync(self, core: Any) -> None:
        listed = await core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", _request_timeout=5)
        now = datetime.now(UTC)
        self._live = {p.metadata.uid for p in listed.items
                      if p.status.phase in ("Pending", "Running")}
        for pod in listed.items:
            meta = pod.metadata
            if (meta.deletion_timestamp is None and meta.uid in self._live
                    and meta.uid not in self._admitted):
                # Admission, once per pod in each life of the kubelet (kubelet.go
                # HandlePodAdditions: at its start, every pod bound to the node).
                rejected = await self._admit(pod)
                if rejected is not None:
                    await self._reject(core, pod, *rejected)
                    continue
                self._admitted.add(meta.uid)
            if meta.deletion_timestamp is not None:
                grace = meta.deletion_grace_period_seconds or 0
                started = meta.deletion_timestamp.timestamp() - grace
                if now.timestamp() >= started + grace * self.grace_scale:
                    # In the body: the API server reads no query parameter when there is one.
                    with contextlib.suppress(ApiException):  # 404: gone already
                        await core.delete_namespaced_pod(meta.name, meta.namespace, body={
                            "gracePeriodSeconds": 0, "preconditions": {"uid": meta.uid}},
                            _request_timeout=5)
            elif pod.status.phase == "Pending" and await self._claims_ready(pod):
                await self._post(core, pod, ready=_probe_delay(pod) == 0)
            elif (pod.status.phase == "Running" and not _ready(pod) and now.timestamp()
                  >= pod.status.start_time.timestamp() + _probe_delay(pod)):
                await self._post(core, pod, ready=True)

    async def _admit(self, pod: Any) -> tuple[str, str] | None:
        """None if the pod is admitted, else (reason, message) of its rejection; this
        one admits every pod (tests/controlplane/machine.py's adds the device manager)."""
        return None

    async def _reject(self, core: Any, pod: Any, reason: str, message: str) -> None:
        """The pod failed, as kubelet.go rejectPod writes it (v1.35.4)."""
        await core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {
            "status": {"phase": "Failed", "reason": reason,
                       "message": f"Pod was rejected: {message}"}}, _request_timeout=5)

    async def _claims_ready(self, pod: Any) -> bool:
        """Whether each of the pod's ResourceClaims is there, made for it and reserved
        for it, as the DRA manager checks before it prepares them."""
        made = {s.name: s.resource_claim_name
                for s in pod.status.resource_claim_statuses or []}
        for claim in pod.spec.resource_claims or []:
            from_template = claim.resource_claim_name is None
            if from_template and claim.name not in made:
                return False  # not made yet: the controller-manager's part
            name = claim.resource_claim_name or made[claim.name]
            if name is None:
                continue  # none needed
            try:
                found = await self._claims.read_namespaced_resource_claim(
                    name, pod.metadata.namespace, _request_timeout=5)
            except ApiException:
                return False
            owners = found.metadata.owner_references or []
            if from_template and not any(o.uid == pod.metadata.uid and o.controller
                                         for o in owners):
                return False
            reserved = (found.status.reserved_for if found.status is not None else None) or []
            if not any(r.uid == pod.metadata.uid for r in reserved):
                return False
        return True

    async def _post(self, core: Any, pod: Any, *, ready: bool) -> None:
        stamp = _stamp()
        started = (pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ")
                   if pod.status.start_time else stamp)
        status = {
            "phase": "Running", "hostIP": "127.0.0.1", "podIP": "10.244.0.2",
            "startTime": started,
            "conditions": [{"type": kind, "status": "True" if ready or kind in (
                "PodReadyToStartContainers", "Initialized") else "False",
                            "lastTransitionTime": stamp}
                           for kind in ("PodReadyToStartContainers", "Initialized",
                                        "ContainersReady", "Ready")],
            "containerStatuses": [
                {"name": c.name, "image": c.image, "imageID": "", "ready": ready,
                 "restartCount": 0, "started": True,
                 "state": {"running": {"startedAt": started}}}
                for c in pod.spec.containers],
        }
        await core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                               {"status": status}, _request_timeout=5)


def _probe_delay(pod: Any) -> float:
    """How long after it starts the pod turns Ready: its readiness probes' longest
    initialDelaySeconds, as though each probe then passed at once."""
    return max((c.readiness_probe.initial_delay_seconds or 0 for c in pod.spec.containers
                if c.readiness_probe is not None), default=0)


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
