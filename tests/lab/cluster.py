"""The lab's Kubernetes: the API stand-in on loopback, a node for the lendee with a few
pods on it, and a lab kubelet that follows the lendee VM's real state.

The kubelet marks node gpu-node Ready a moment after the VM runs (NotReady once it
stops), and reports as `nvidia.com/gpu` what the stand-in nvidia-smi *inside the guest*
lists, read through the guest agent: a lab GPU whose driver "fails" is not counted.
On a DRA node (``dra=True``) it publishes those GPUs, by UUID, in the node's
ResourceSlice of gpu.nvidia.com instead, and the cluster has the driver's DeviceClass.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.kubeapi.kubelet import Kubelet
from tests.kubeapi.server import ThreadedStandIn, serve_in_thread
from tests.lab.lab import LENDEE, Lab


@dataclass
class LabCluster:
    api: ThreadedStandIn
    kubelet: Kubelet
    kubeconfig: Path

    def node(self) -> dict[str, Any]:
        return self.api.call(self.api.standin.cluster.node, LENDEE)

    def slice_uuids(self) -> list[str]:
        """The UUIDs in the lendee node's ResourceSlices (DRA)."""
        slices = self.api.call(self.api.standin.cluster.slices, LENDEE)
        return sorted(d["attributes"]["uuid"]["string"] for s in slices
                      for d in s["spec"].get("devices") or [])

    def add_gpu_job(self, name: str, uuid: str) -> None:
        """A Job's pod on the lendee's node holding the GPU `uuid` through a claim, as
        the scheduler would allocate it from the node's slice (DRA)."""
        def add() -> None:
            cluster = self.api.standin.cluster
            device = next(d["name"] for s in cluster.slices(LENDEE)
                          for d in s["spec"].get("devices") or []
                          if d["attributes"]["uuid"]["string"] == uuid)
            cluster.add_pod(name, node=LENDEE, owner=f"Job/{name}", devices=[device])
        self.api.call(add)

    def pods_on(self, node: str) -> list[str]:
        pods = self.api.call(self.api.standin.cluster.pods, node)
        return sorted(p["metadata"]["name"] for p in pods
                      if not p["metadata"].get("deletionTimestamp"))


def gpus_seen(lab: Lab) -> int:
    try:
        out = lab.guest_exec(LENDEE, "/usr/bin/nvidia-smi", "-L", timeout=5)
    except Exception:  # no agent yet, VM gone: the device plugin sees nothing either
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def devices_seen(lab: Lab) -> list[tuple[str, str]]:
    """(UUID, name) of each GPU nvidia-smi lists inside the lendee: what NVIDIA's DRA
    driver would publish."""
    try:
        out = lab.guest_exec(LENDEE, "/usr/bin/nvidia-smi", "-L", timeout=5)
    except Exception:  # no agent yet, VM gone: the driver sees nothing either
        return []
    return [(m[2], m[1]) for line in out.stdout.splitlines()
            if (m := re.fullmatch(r"GPU \d+: (.*) \(UUID: (\S+)\)", line.strip()))]


def lendee_running(lab: Lab) -> bool:
    """What the kubelet sees of its VM: not running while libvirtd is down too."""
    return lab.virsh("domstate", LENDEE, check=False).stdout.strip() == "running"


def seed_workloads(api: ThreadedStandIn) -> None:
    """A few pods on the lendee's node: a web Deployment's pod, two training pods behind
    a PodDisruptionBudget (minAvailable 1: one eviction at a time, the next once the
    replacement is Ready elsewhere), and a DaemonSet's pod that drain leaves alone."""
    cluster = api.standin.cluster

    def seed() -> None:
        cluster.add_node("cpu-node")
        cluster.add_pod("web-7d4f9-x2k8q", node=LENDEE, owner="ReplicaSet/web-7d4f9",
                        labels={"app": "web"})
        for i in (1, 2):
            cluster.add_pod(f"trainer-{i}", node=LENDEE, owner="StatefulSet/trainer",
                            labels={"app": "trainer"})
        cluster.add_pdb("trainer", match_labels={"app": "trainer"}, min_available=1)
        cluster.add_pod("gpu-device-plugin-z7x", node=LENDEE, owner="DaemonSet/device-plugin",
                        labels={"app": "device-plugin"})
    api.call(seed)


@contextlib.contextmanager
def lab_cluster(lab: Lab, *, workloads: bool = True, ready_delay: float = 1.0,
                cordoned: bool = False, dra: bool = False) -> Iterator[LabCluster]:
    """The stand-in and kubelet for `lab`; `cordoned`: an administrator cordoned the
    node before hostagent ever ran; `dra`: the GPUs go through DRA, not the device
    plugin."""
    kubeconfig = lab.root / "agent" / "kubeconfig"
    kubeconfig.parent.mkdir(exist_ok=True)
    with serve_in_thread(termination_scale=0.02, replacement_node="cpu-node",
                         replacement_ready_after=1.0) as api:
        api.write_kubeconfig(kubeconfig)
        api.call(lambda: api.standin.cluster.add_node(LENDEE, ready=False,
                                                      gpus=None if dra else 0,
                                                      unschedulable=cordoned))
        if dra:
            api.call(api.standin.cluster.add_device_class)
        if workloads:
            seed_workloads(api)
        kubelet = Kubelet(kubeconfig, LENDEE, lendee_running=lambda: lendee_running(lab),
                          gpus_seen=lambda: gpus_seen(lab), ready_delay=ready_delay,
                          gpu_delay=0.3, heartbeat_grace=1.0,
                          devices_seen=(lambda: devices_seen(lab)) if dra else None)
        api.call(kubelet.start)
        try:
            yield LabCluster(api, kubelet, kubeconfig)
        finally:
            api.run(kubelet.stop())
