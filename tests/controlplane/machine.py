"""The lab's kubelet for a node whose machine really starts and stops (the lab's
lendee VM), against the real API server, with the GPU plugins that run on it.

The kubelet's part copies Kubernetes v1.35.4 (pkg/kubelet), as tests/controlplane/
kubelet.py's `Pods` does, and only while `running()` says the machine runs. A boot
is unkind, as a real one is:

- Nothing is posted until the kubelet has started, `start_delay` seconds after the
  machine runs and once the machine's own boot id can be read (`boot_id()`, the
  guest's /proc/sys/kernel/random/boot_id): until then the API keeps the previous
  boot's Ready=True and allocatable, which only the real node lifecycle controller
  changes (Unknown, once the lab's --node-monitor-grace-period has passed since the
  last Lease renewal: pkg/controller/nodelifecycle/node_lifecycle_controller.go).
- At its start the kubelet deletes its node's ResourceSlices (pkg/kubelet/cm/dra/
  plugin/dra_plugin_manager.go NewDRAPluginManager: wipeResourceSlices, every driver),
  registers (kubelet_node_status.go tryRegisterWithAPIServer: a node there from an
  earlier boot is kept) and posts its first status: Ready=False (KubeletNotReady),
  ``status.nodeInfo.bootID`` (nodestatus/setters.go MachineInfo: cadvisor's boot id;
  every later post carries it too), and ``nvidia.com/gpu`` capacity and allocatable 0
  where the device manager's checkpoint knows the resource from an earlier boot
  (cm/devicemanager/manager.go readCheckpoint: empty healthy and unhealthy sets "so
  that the resource capacity will stay zero till the corresponding device plugin
  re-registers"; GetCapacity then gives 0 for both).
- Ready=True after `ready_delay`; posted again when it changes and at least every
  `status_every` seconds; the Lease in kube-node-lease renewed (nodelease).
- Admission (kubelet.go HandlePodAdditions, for every pod bound to the node at its
  start and each one bound later): a pod that requests ``nvidia.com/gpu`` beyond what
  the plugin registered this boot fails (cm/devicemanager/manager.go devicesToAllocate:
  "cannot allocate unregistered device", "no healthy devices present; cannot allocate
  unhealthy devices", "requested number of devices unavailable for ..."; wrapped by
  cm/admission/errors.go as UnexpectedAdmissionError, "Allocate failed due to ...,
  which is unexpected"; written by kubelet.go rejectPod: phase Failed, "Pod was
  rejected: ..."). The rest run, and those deleted finish once their grace period
  (times `grace_scale`) has passed.

While the machine is off nothing is posted or renewed, and pods being deleted stay
until the machine runs again.

Each look the kubelet takes at its machine (one each `interval`, one at a time) is
kept in `looks` once over (the last thousand): what it found the machine doing and
what it wrote to the API server, so that a test can wait for looks, not for time.

The GPU plugins' part, as their own service accounts would (a separate kubeconfig,
`plugins`), after a further `gpu_delay` and every `gpu_recheck` seconds while the
kubelet runs, posting only what changed:

- `gpus_seen()` (how many GPUs the guest's nvidia-smi lists): NVIDIA's device plugin
  (k8s-device-plugin v0.17), registered with the kubelet, and GPU Feature Discovery,
  ``nvidia.com/gpu`` capacity and allocatable and GFD's ``nvidia.com/gpu.*`` labels
  (`gpu_status`).
- `devices_seen()` ((UUID, product name) of each GPU the guest lists): NVIDIA's DRA
  driver's kubelet plugin (k8s-dra-driver-gpu v25.12.0, DynamicMIG off:
  cmd/gpu-kubelet-plugin/driver.go publishResources) publishes one pool named after
  the node in one ResourceSlice, every GPU in it by its minor (tests/controlplane/
  nvidia.py: `Driver.publish`, `gpu`).

docs/architecture.md lists how this still differs from the real kubelet.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from tests.controlplane import nvidia
from tests.controlplane.kubelet import Pods, _stamp

log = logging.getLogger(__name__)
GPU = "nvidia.com/gpu"
ERRORS = (ApiException, aiohttp.ClientError, OSError, TimeoutError, ValueError)


@dataclass(frozen=True)
class Look:
    """One look of the kubelet at its machine, once over: the `n`th. `machine`: "off" (the
    kubelet chose to post nothing), "booting" (it runs, its kubelet not started yet),
    "up" (its kubelet started), "" (the look failed before it knew). `wrote`: what it
    sent the API server in that look, in order: "start" (this boot's first status),
    "lease", "status" (Ready), "gpus" (what the plugins see) and "pods" (its pods read,
    and posted where they changed)."""

    n: int
    machine: str
    wrote: tuple[str, ...]


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
                 boot_id: Callable[[], str | None] | None = None,
                 start_delay: float = 2.0, ready_delay: float = 1.0, gpu_delay: float = 0.3,
                 gpu_recheck: float = 1.0, status_every: float = 60.0,
                 lease_every: float = 10.0, grace_scale: float = 0.05,
                 interval: float = 0.2) -> None:
        super().__init__(kubeconfig, node, grace_scale=grace_scale, interval=interval,
                         lease_every=lease_every)
        self.running = running
        self.plugins = plugins
        self.gpus_seen = gpus_seen
        self.devices_seen = devices_seen
        # The machine's boot id, None while it cannot be read; without one, a fresh
        # UUID per boot.
        self.boot_id = boot_id
        self.start_delay = start_delay
        self.ready_delay = ready_delay
        self.gpu_delay = gpu_delay
        self.gpu_recheck = gpu_recheck
        self.status_every = status_every
        self.boots: list[str] = []  # the boot id of each start of the kubelet, in order
        self.looks: deque[Look] = deque(maxlen=1000)  # the last looks, in order
        self.looked = 0  # how many looks are over
        # The device manager's: the GPUs the plugin registered in this life of the
        # kubelet (None: not yet), the GPUs each admitted pod holds, and whether its
        # checkpoint knows the resource (it survives reboots, as the file on disk does).
        self._plugin_gpus: int | None = None
        self._allocated: dict[str, int] = {}
        self._checkpointed = False

    async def run(self) -> None:
        async with await _client(self.kubeconfig) as api_client, \
                await _client(self.plugins) as plugin_client, \
                nvidia.Driver(self.plugins, self.node) as driver:
            core = client.CoreV1Api(api_client)
            self._claims = client.ResourceV1Api(api_client)
            leases = client.CoordinationV1Api(api_client)
            plugin_core = client.CoreV1Api(plugin_client)
            if await self._register(core):  # new: NotReady, as its kubelet's first post
                await core.patch_node_status(self.node, {"status": {"conditions": [
                    ready_condition("False", _stamp())]}}, _request_timeout=5)
            self._registered.set()
            loop = asyncio.get_running_loop()
            booted: float | None = None  # when the machine was seen running
            started: float | None = None  # when this boot's kubelet started
            boot = ""
            posted, since, last_post, renewed, checked = "", "", 0.0, 0.0, 0.0
            gpus_posted: Any = None
            while True:
                machine, wrote = "", list[str]()
                try:
                    running = await asyncio.to_thread(self.running)
                    t = loop.time()
                    if not running:
                        booted = started = None
                        machine = "off"  # nothing posted, nothing renewed
                    else:
                        machine = "booting"
                        if booted is None:  # a boot: no kubelet yet, nothing posted
                            booted = t
                        if started is None and t - booted >= self.start_delay:
                            found = await self._boot_id()
                            if found is not None:  # the kubelet starts
                                boot = found
                                wrote.append("start")
                                await driver.withdraw()
                                await self._register(core)
                                await self._start(core, boot)
                                started, posted, gpus_posted, renewed = t, "", None, -1e9
                        if started is not None:
                            machine = "up"
                            want = "True" if t - started >= self.ready_delay else "False"
                            if t - renewed >= self.lease_every:
                                wrote.append("lease")
                                await self._renew(leases)
                                renewed = t
                            if want != posted or t - last_post >= self.status_every:
                                since = _stamp() if want != posted else since
                                wrote.append("status")
                                await self._post_condition(core, want, since, boot)
                                posted, last_post = want, t
                            if (t - started >= self.ready_delay + self.gpu_delay
                                    and t - checked >= self.gpu_recheck):
                                checked = t
                                seen = await self._gpus(plugin_core, driver, gpus_posted)
                                if seen is not None:
                                    wrote.append("gpus")
                                gpus_posted = seen if seen is not None else gpus_posted
                            wrote.append("pods")
                            await self._sync(core)
                except ERRORS as e:
                    log.debug("kubelet for %s: %r", self.node, e)
                self.looked += 1
                self.looks.append(Look(self.looked, machine, tuple(wrote)))
                await asyncio.sleep(self.interval)

    async def _boot_id(self) -> str | None:
        if self.boot_id is None:
            return str(uuid.uuid4())
        return await asyncio.to_thread(self.boot_id)

    async def _start(self, core: Any, boot: str) -> None:
        """The first status of this life of the kubelet: NotReady, its boot id, and the
        GPUs the checkpoint knows at 0 until the plugin registers again."""
        self._admitted.clear()
        self._allocated.clear()
        self._plugin_gpus = None
        status: dict[str, Any] = {"conditions": [ready_condition("False", _stamp())],
                                  "nodeInfo": {"bootID": boot}}
        if self._checkpointed:
            status["capacity"] = status["allocatable"] = {GPU: "0"}
        await core.patch_node_status(self.node, {"status": status}, _request_timeout=5)
        self.boots.append(boot)

    async def _post_condition(self, core: Any, ready: str, since: str, boot: str) -> None:
        await core.patch_node_status(self.node, {"status": {
            "conditions": [ready_condition(ready, since)], "nodeInfo": {"bootID": boot}}},
            _request_timeout=5)

    async def _admit(self, pod: Any) -> tuple[str, str] | None:
        """The device manager's Allocate for the pod's ``nvidia.com/gpu`` (device plugin
        nodes only): None, or why it fails admission."""
        wanted = _requested(pod)
        if self.gpus_seen is None or wanted == 0:
            return None
        if self._plugin_gpus is None and not self._checkpointed:
            why = f"cannot allocate unregistered device {GPU}"
        elif not self._plugin_gpus:
            why = f"no healthy devices present; cannot allocate unhealthy devices {GPU}"
        else:
            held = sum(n for uid, n in self._allocated.items() if uid in self._live)
            available = self._plugin_gpus - held
            if available < wanted:
                why = (f"requested number of devices unavailable for {GPU}. "
                       f"Requested: {wanted}, Available: {available}")
            else:
                self._allocated[pod.metadata.uid] = wanted
                return None
        return "UnexpectedAdmissionError", f"Allocate failed due to {why}, which is unexpected"

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
                self._plugin_gpus, self._checkpointed = gpus, True
                return gpus
        return None


def _requested(pod: Any) -> int:
    """The ``nvidia.com/gpu`` the pod's containers ask for (limits, else requests)."""
    total = 0
    for c in pod.spec.containers:
        resources = c.resources
        asked = ((resources.limits or {}).get(GPU) or (resources.requests or {}).get(GPU)
                 if resources is not None else None)
        total += int(asked or 0)
    return total


async def _client(kubeconfig: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig),
                                  client_configuration=configuration, persist_config=False)
    return client.ApiClient(configuration)
