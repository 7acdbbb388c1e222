"""The lab's kubelet for a node whose machine really starts and stops (the lab's
lendee VM), against the real API server, with the GPU plugins that run on it.

The kubelet's part copies Kubernetes v1.35 (pkg/kubelet), as tests/controlplane/
kubelet.py's `Pods` does, and only while `running()` says the machine runs: it
registers its node (kubelet_node_status.go registerWithAPIServer: a node there from an
earlier boot is kept), renews its Lease in kube-node-lease (nodelease), posts the Ready
condition (False, KubeletNotReady, at once on boot; True after `ready_delay`; posted
again when it changes and at least every `status_every` seconds), runs the pods bound
to it and finishes those deleted once their grace period (times `grace_scale`) has
passed. While the machine is off nothing is posted or renewed: the real node lifecycle
controller marks the node Unknown after its grace period, and pods being deleted stay
until the machine runs again. On boot the kubelet deletes its node's ResourceSlices
(pkg/kubelet/cm/dra, the plugin manager's wipe of what a former boot left).

The GPU plugins' part, as their own service accounts would (a separate kubeconfig,
`plugins`), after a further `gpu_delay` and every `gpu_recheck` seconds while the
machine runs, posting only what changed:

- `gpus_seen()` (how many GPUs the guest's nvidia-smi lists): NVIDIA's device plugin
  (k8s-device-plugin v0.17) and GPU Feature Discovery, ``nvidia.com/gpu`` capacity
  and allocatable and GFD's ``nvidia.com/gpu.*`` labels (`gpu_status`). Until then the
  node keeps the count the last boot left, as a real one does after a kubelet restart.
- `devices_seen()` ((UUID, product name) of each GPU the guest lists): NVIDIA's DRA
  driver's kubelet plugin (k8s-dra-driver-gpu v25.12.0, DynamicMIG off:
  cmd/gpu-kubelet-plugin/driver.go publishResources) publishes one pool named after
  the node in one ResourceSlice, every GPU in it by its minor (tests/controlplane/
  nvidia.py: `Driver.publish`, `gpu`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.controlplane import nvidia
from tests.controlplane.kubelet import Pods, _stamp

log = logging.getLogger(__name__)
ERRORS = (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError)


def gpu_status(gpus: int, *, resource: str = "nvidia.com/gpu"
               ) -> tuple[dict[str, str], dict[str, str]]:
    """(GPU Feature Discovery labels, allocatable) of a node with `gpus` GPUs, as the
    device plugin (no sharing, no MIG) and GFD publish them."""
    labels = {"nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.present": "true",
              "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.replicas": "1"}
    return labels, {resource: str(gpus)}


def ready_condition(status: str, since: str) -> dict[str, Any]:
    reason, message = {
        "True": ("KubeletReady", "kubelet is posting ready status"),
        "False": ("KubeletNotReady", "container runtime network not ready: NetworkReady=false"),
    }[status]
    return {"type": "Ready", "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": _stamp(), "lastTransitionTime": since}


class Kubelet(Pods):
    def __init__(self, kubeconfig: Path, node: str, *, running: Callable[[], bool],
                 plugins: Path, gpus_seen: Callable[[], int] | None = None,
                 devices_seen: Callable[[], list[tuple[str, str]]] | None = None,
                 ready_delay: float = 1.0, gpu_delay: float = 0.3, gpu_recheck: float = 1.0,
                 status_every: float = 60.0, grace_scale: float = 0.05,
                 interval: float = 0.2) -> None:
        super().__init__(kubeconfig, node, grace_scale=grace_scale, interval=interval)
        self.running = running
        self.plugins = plugins
        self.gpus_seen = gpus_seen
        self.devices_seen = devices_seen
        self.ready_delay = ready_delay
        self.gpu_delay = gpu_delay
        self.gpu_recheck = gpu_recheck
        self.status_every = status_every

    async def run(self) -> None:
        async with await _client(self.kubeconfig) as api_client, \
                await _client(self.plugins) as plugin_client, \
                nvidia.Driver(self.plugins, self.node) as driver:
            core = client.CoreV1Api(api_client)
            self._claims = client.ResourceV1Api(api_client)
            leases = client.CoordinationV1Api(api_client)
            plugin_core = client.CoreV1Api(plugin_client)
            await self._register(core)
            await self._post_condition(core, "False", _stamp())
            self._registered.set()
            loop = asyncio.get_running_loop()
            booted: float | None = None
            posted, since, last_post, renewed, checked = "", "", 0.0, 0.0, 0.0
            gpus_posted: Any = None
            while True:
                try:
                    running = await asyncio.to_thread(self.running)
                    t = loop.time()
                    if not running:
                        booted = None
                    else:
                        if booted is None:  # a boot: a new kubelet, nothing posted yet
                            await driver.withdraw()
                            booted, posted, gpus_posted, renewed = t, "", None, -1e9
                        want = "True" if t - booted >= self.ready_delay else "False"
                        if t - renewed >= self.lease_every:
                            await self._renew(leases)
                            renewed = t
                        if want != posted or t - last_post >= self.status_every:
                            since = _stamp() if want != posted else since
                            await self._post_condition(core, want, since)
                            posted, last_post = want, t
                        if (t - booted >= self.ready_delay + self.gpu_delay
                                and t - checked >= self.gpu_recheck):
                            checked = t
                            seen = await self._gpus(plugin_core, driver, gpus_posted)
                            gpus_posted = seen if seen is not None else gpus_posted
                        await self._sync(core)
                except ERRORS as e:
                    log.debug("kubelet for %s: %r", self.node, e)
                await asyncio.sleep(self.interval)

    async def _post_condition(self, core: Any, ready: str, since: str) -> None:
        await core.patch_node_status(self.node, {"status": {
            "conditions": [ready_condition(ready, since)]}}, _request_timeout=5)

    async def _gpus(self, core: Any, driver: nvidia.Driver, posted: Any) -> Any:
        """What the plugins see now, published if it changed; None if unchanged."""
        if self.devices_seen is not None:
            devices = await asyncio.to_thread(self.devices_seen)
            if devices != posted:
                await driver.publish([nvidia.gpu(minor, uuid, product=name)
                                      for minor, (uuid, name) in enumerate(devices)])
                return devices
        elif self.gpus_seen is not None:
            gpus = await asyncio.to_thread(self.gpus_seen)
            if gpus != posted:
                labels, allocatable = gpu_status(gpus)
                await core.patch_node(self.node, {"metadata": {"labels": labels}},
                                      _request_timeout=5)
                await core.patch_node_status(self.node, {"status": {
                    "capacity": allocatable, "allocatable": allocatable}}, _request_timeout=5)
                return gpus
        return None


async def _client(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig),
                                  client_configuration=configuration, persist_config=False)
    return client.ApiClient(configuration)
