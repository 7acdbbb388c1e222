"""A lab "kubelet": the lab node's status, driven by the lendee VM's real state.

A real kubelet runs inside the lendee and posts its node's status to the API server;
when the VM stops, nothing posts, and after node-monitor-grace-period the node
lifecycle controller marks Ready "Unknown". The lab has no kubelet inside its guests,
so this class plays both parts from outside, through the same API (with the real
client): it asks `lendee_running()` (e.g. "does libvirt say the domain is running?")
and `gpus_seen()` (e.g. "what does nvidia-smi inside the guest list?") and posts what a
kubelet and the NVIDIA device plugin would.

Timeline after the VM starts: Ready=False (KubeletNotReady) at once, Ready=True after
`ready_delay`, and ``capacity``/``allocatable`` of `resource` set to `gpus_seen()` after
a further `gpu_delay` (the device plugin registering). Until then the node keeps the
count it had before, as a real one does for a while after a kubelet restart: that
stale count is why the agent also checks inside the guest. After the VM stops:
Ready=Unknown (NodeStatusUnknown) once `heartbeat_grace` has passed.

With `devices_seen` (a DRA node: "which GPUs, by UUID and name, does the guest see?")
it plays NVIDIA's DRA driver's kubelet plugin (k8s-dra-driver-gpu, main at 22407113,
without DynamicMIG) instead of the device plugin: no allocatable, and the node's pool of
``gpu.nvidia.com`` in one ResourceSlice lists the GPUs seen, each as `gpu_device` writes
it, republished under the next generation when they change. As a real kubelet does, it deletes the node's slices when it starts (the VM
booted); until then they are the ones the last boot left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.kubeapi.cluster import DRA_DRIVER, gpu_device, gpu_status, ready_condition
from tests.kubeapi.rules import now

log = logging.getLogger(__name__)


class Kubelet:
    def __init__(
        self,
        kubeconfig: Path,
        node: str,
        *,
        lendee_running: Callable[[], bool],
        gpus_seen: Callable[[], int],
        resource: str = "nvidia.com/gpu",
        replicas: int = 1,
        mig: dict[str, int] | None = None,
        ready_delay: float = 2.0,
        gpu_delay: float = 0.5,
        heartbeat_grace: float = 1.0,
        heartbeat: float = 10.0,
        interval: float = 0.2,
        gpu_recheck: float = 1.0,
        devices_seen: Callable[[], list[tuple[str, str]]] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.node = node
        self.lendee_running = lendee_running
        self.gpus_seen = gpus_seen
        self.resource = resource
        self.replicas = replicas  # time-slicing, as the device plugin's config says
        self.mig = mig  # MIG profile -> devices per GPU (mixed strategy)
        self.ready_delay = ready_delay
        self.gpu_delay = gpu_delay
        self.heartbeat_grace = heartbeat_grace
        self.heartbeat = heartbeat
        self.interval = interval
        self.gpu_recheck = gpu_recheck
        self.devices_seen = devices_seen  # DRA: (UUID, product name) of each GPU seen
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Kubelet:
        """Run in the background on the current loop until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"kubelet {self.node}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> Kubelet:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run(self) -> None:
        configuration = client.Configuration()
        await config.load_kube_config(
            config_file=str(self.kubeconfig),
            client_configuration=configuration,
            persist_config=False,
        )
        async with client.ApiClient(configuration) as api_client:
            api = client.CoreV1Api(api_client)
            resource = client.ResourceV1Api(api_client)
            loop = asyncio.get_running_loop()
            running_since: float | None = None
            stopped_since: float | None = None
            posted: str | None = None  # the Ready status this kubelet last posted
            # Like the device plugin's ListAndWatch: the count is re-read while the VM
            # runs, and posted when it changes (the driver may come up after Ready).
            gpus_posted: Any = None
            last_gpu_check = 0.0
            last_post = 0.0
            while True:
                running = await asyncio.to_thread(self.lendee_running)
                t = loop.time()
                want: str | None = None
                gpus: Any = None
                if running:
                    stopped_since = None
                    if running_since is None:
                        running_since, gpus_posted = t, None
                        posted = None
                        if self.devices_seen is not None:
                            await self._wipe(resource)
                    want = "True" if t - running_since >= self.ready_delay else "False"
                    if (t - running_since >= self.ready_delay + self.gpu_delay
                            and t - last_gpu_check >= self.gpu_recheck):
                        last_gpu_check = t
                        seen: Any = await asyncio.to_thread(self.devices_seen or self.gpus_seen)
                        gpus = seen if seen != gpus_posted else None
                else:
                    running_since = None
                    if stopped_since is None:
                        stopped_since = t
                    if t - stopped_since >= self.heartbeat_grace:
                        want = "Unknown"
                heartbeat_due = running and t - last_post >= self.heartbeat
                if want is not None and (want != posted or gpus is not None or heartbeat_due):
                    try:
                        if gpus is not None and self.devices_seen is not None:
                            await self._publish(resource, gpus)
                            await self._post(api, want, None)
                        else:
                            await self._post(api, want, gpus)
                    except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as e:
                        log.debug("kubelet for %s could not post its status: %s", self.node, e)
                    else:
                        posted, last_post = want, t
                        if gpus is not None:
                            gpus_posted = gpus
                await asyncio.sleep(self.interval)

    async def _slices(self, resource: Any) -> list[Any]:
        listed = await resource.list_resource_slice(
            field_selector=f"spec.nodeName={self.node},spec.driver={DRA_DRIVER}",
            _request_timeout=5)
        return list(listed.items)

    async def _wipe(self, resource: Any) -> None:
        try:
            for found in await self._slices(resource):
                # Not read as a ResourceSlice: the answer is a Status.
                await resource.delete_resource_slice(found.metadata.name, _request_timeout=5,
                                                     _preload_content=False)
        except (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            log.debug("kubelet for %s could not delete its slices: %s", self.node, e)

    async def _publish(self, resource: Any, seen: list[tuple[str, str]]) -> None:
        """The DRA driver's kubelet plugin: the node's pool, one device per GPU seen."""
        devices = [gpu_device(i, uuid, product=name) for i, (uuid, name) in enumerate(seen)]
        found = await self._slices(resource)
        if not found:
            await resource.create_resource_slice({
                "metadata": {"generateName": f"{self.node}-{DRA_DRIVER}-"},
                "spec": {"driver": DRA_DRIVER, "nodeName": self.node,
                         "pool": {"name": self.node, "generation": 1, "resourceSliceCount": 1},
                         "devices": devices},
            }, _request_timeout=5)  # fmt: skip
            return
        generation = found[0].spec.pool.generation + 1
        await resource.patch_resource_slice(found[0].metadata.name, {"spec": {
            "devices": devices, "pool": {"name": self.node, "generation": generation,
                                         "resourceSliceCount": 1}}},
            _request_timeout=5, _content_type="application/merge-patch+json")  # fmt: skip

    async def _post(self, api: Any, ready: str, gpus: int | None) -> None:
        try:
            node = await api.read_node(self.node, _request_timeout=5)
        except ApiException as e:
            if e.status != 404 or ready == "Unknown":
                raise
            # A kubelet registers its node when there is none.
            await api.create_node(
                {
                    "metadata": {
                        "name": self.node,
                        "labels": {"kubernetes.io/hostname": self.node},
                    },
                    "status": {"conditions": [ready_condition(ready)]},
                },
                _request_timeout=5,
            )
            node = await api.read_node(self.node, _request_timeout=5)
        condition = ready_condition(ready)
        for c in node.status.conditions or []:
            if c.type == "Ready" and c.status == ready and c.last_transition_time is not None:
                condition["lastTransitionTime"] = c.last_transition_time.strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                )
        if ready == "Unknown":
            # The node controller writes no heartbeat: it is saying there was none.
            condition["lastHeartbeatTime"] = next(
                (c.last_heartbeat_time.strftime("%Y-%m-%dT%H:%M:%SZ")
                 for c in node.status.conditions or [] if c.type == "Ready" and c.last_heartbeat_time),
                now(),
            )  # fmt: skip
        status: dict[str, Any] = {"conditions": [condition]}
        if gpus is not None:
            # The device plugin's allocatable, and GPU Feature Discovery's labels.
            labels, allocatable = gpu_status(gpus, resource=self.resource,
                                             replicas=self.replicas, mig=self.mig)
            status["capacity"] = dict(allocatable)
            status["allocatable"] = dict(allocatable)
            await api.patch_node(self.node, {"metadata": {"labels": labels}},
                                 _request_timeout=5)
        await api.patch_node_status(self.node, {"status": status}, _request_timeout=5)
