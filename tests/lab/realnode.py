"""gpu-node, the lab's lendee, played by the real kubelet of the lab's release
(tests/controlplane/realkubelet.py: cmd/kubelet of Kubernetes v1.35.4 on cri-client's
fake runtime), following the lendee VM as its own kubelet would:

- `start_delay` seconds after the VM runs, once the guest's boot id can be read
  through the guest agent, a kubelet starts whose /proc/sys/kernel/random/boot_id is
  the guest's (cadvisor reads it into ``status.nodeInfo.bootID``); until then the API
  keeps what the previous boot posted, as it does for a real node;
- the kubelet is stopped, without a word to anyone, when the VM stops (a power-off):
  the node lifecycle controller alone changes what the API shows then;
- its device plugin (or, on a DRA node, its DRA kubelet plugin) serves what the
  stand-in nvidia-smi *inside the guest* lists, read through the guest agent each
  `recheck` seconds (`devices_seen`, which a test may replace): NVIDIA's plugins
  publish the GPUs the guest's driver shows, by UUID (k8s-device-plugin v0.17's device
  IDs; k8s-dra-driver-gpu's ``uuid`` attribute, its devices named ``gpu-<minor>``);
  on a device plugin node, GPU Feature Discovery's labels too
  (tests/controlplane/machine.py `gpu_status`), posted with the plugins' credential.

Ready, bootID, allocatable (0 from the kubelet's start until its plugin registers),
the wiping of the node's ResourceSlices at each start and the admission of pods bound
to devices no longer there are the kubelet's own. The node is registered before the
first boot (the lendee joined the cluster long before the lab began), NotReady, as
tests/controlplane/machine.py's stand-in registers it.

Two settings differ from the release's defaults, for the suite's time and the lab's
faster node lifecycle:

- nodeStatusUpdateFrequency (and nodeStatusReportFrequency) `STATUS_EVERY`, not 10 s:
  a device plugin's devices reach allocatable only with the next status post, and the
  agent waits for them at each lend (invariant 14), so the default would add up to
  10 s to every lend of every lab test. tests/lab/test_kube_lab.py keeps one test on
  the default, which shows the agent does not lend before the GPUs are posted.
- nodeLeaseDurationSeconds 16, not 40: the Lease is renewed every 4 s (a quarter of
  it, pkg/kubelet/kubelet.go), since the lab's node monitor grace period is 20 s, not
  50 (tests/controlplane: a stopped node goes Unknown within 16 to 20 s).

`missing()` (tests/controlplane/realkubelet.py) says where this cannot run: then the
lab keeps the stand-in (tests/lab/cluster.py `lendee_kubelet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from tests.controlplane import ControlPlane, nvidia
from tests.controlplane.machine import GPU, gpu_status, ready_condition
from tests.controlplane.kubelet import CAPACITY, _stamp
from tests.controlplane.realkubelet import RealKubelet

log = logging.getLogger(__name__)
STATUS_EVERY = 1.0
LEASE_SECONDS = 16

Seen = Callable[[], list[tuple[str, str]]]


class RealLendee:
    """The lendee's real kubelet, started and stopped with its VM (see the docstring)."""

    def __init__(self, plane: ControlPlane, node: str, root: Path, *,
                 running: Callable[[], bool], boot_id: Callable[[], str | None],
                 devices_seen: Seen, dra: bool, start_delay: float = 2.0,
                 status_every: float | None = STATUS_EVERY, recheck: float = 1.0,
                 interval: float = 0.2) -> None:
        self.plane = plane
        self.node = node
        self.kubelet = RealKubelet(plane, node, root, status_every=status_every,
                                   lease_seconds=LEASE_SECONDS)
        self.running = running
        self.boot_id = boot_id
        self.devices_seen = devices_seen
        self.dra = dra
        self.start_delay = start_delay
        self.recheck = recheck
        self.interval = interval
        self.boots: list[str] = []  # the boot id of each start of the kubelet, in order
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RealLendee:
        await asyncio.to_thread(self._register)
        self._task = asyncio.get_running_loop().create_task(self.run(), name=self.node)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.kubelet.stop)

    def _register(self) -> None:
        """The node as an earlier boot's kubelet left it: registered, NotReady."""
        made = self.plane.kubectl("create", "-f", "-", check=False, input=json.dumps({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                       "kubernetes.io/os": "linux"}}}))
        if made.returncode == 0:
            self.plane.kubectl("patch", "node", self.node, "--subresource=status",
                               "--type=merge", "-p", json.dumps({"status": {
                                   "capacity": CAPACITY, "allocatable": CAPACITY,
                                   "conditions": [ready_condition("False", _stamp())]}}))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        booted: float | None = None  # when the VM was seen running
        checked = 0.0
        posted: list[tuple[str, str]] | None = None
        while True:
            try:
                running = await asyncio.to_thread(self.running)
                t = loop.time()
                if not running:
                    booted = None
                    if self.kubelet.proc is not None:  # the power went
                        await asyncio.to_thread(self.kubelet.stop)
                else:
                    booted = t if booted is None else booted
                    if self.kubelet.proc is not None and self.kubelet.proc.poll() is not None:
                        # Started again, as systemd's Restart= does a real node's.
                        log.warning("gpu-node's kubelet exited: %s", self.kubelet.log()[-500:])
                        await asyncio.to_thread(self.kubelet.stop)
                    if self.kubelet.proc is None and t - booted >= self.start_delay:
                        boot = await asyncio.to_thread(self.boot_id)
                        if boot is not None:
                            await asyncio.to_thread(self.kubelet.start, boot)
                            self.boots.append(boot)
                            posted, checked = None, t
                    if (self.kubelet.proc is not None and t - checked >= self.recheck
                            and self._listening()):
                        checked = t
                        seen = await asyncio.to_thread(self.devices_seen)
                        if seen != posted or not self._serving():
                            await asyncio.to_thread(self._publish, seen)
                            posted = seen
            except (OSError, RuntimeError, ValueError) as e:
                log.warning("gpu-node's kubelet: %r", e)
            await asyncio.sleep(self.interval)

    def _listening(self) -> bool:
        """Whether the kubelet made the directory its plugins register in (its device
        manager, or its plugin watcher, started): a plugin cannot listen before."""
        kept = self.kubelet.root / "var-lib-kubelet"
        return (kept / ("plugins_registry" if self.dra else "device-plugins")).is_dir()

    def _serving(self) -> bool:
        """Whether this boot's plugin runs (one that could not start is started again)."""
        plugin = self.kubelet.plugins.get(f"dra:{nvidia.DRIVER}" if self.dra else GPU)
        return plugin is not None and plugin.poll() is None

    def _publish(self, seen: list[tuple[str, str]]) -> None:
        """What NVIDIA's plugins publish of the GPUs the guest lists ((UUID, name))."""
        if self.dra:
            self.kubelet.dra(nvidia.DRIVER, [(f"gpu-{minor}", uuid)
                                             for minor, (uuid, _) in enumerate(seen)],
                             self.plane.admin)
            return
        self.kubelet.devices(GPU, [uuid for uuid, _ in seen])
        labels, _ = gpu_status(len(seen))
        self.plane.kubectl("label", "node", self.node, "--overwrite",
                           *(f"{k}={v}" for k, v in labels.items()))
