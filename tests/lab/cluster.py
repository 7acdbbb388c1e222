"""The lab's Kubernetes: the API stand-in on loopback, a node for the lendee with a few
pods on it, and a lab kubelet that follows the lendee VM's real state.

The kubelet marks node gpu-node Ready a moment after the VM runs (NotReady once it
stops), and reports as `nvidia.com/gpu` what the stand-in nvidia-smi *inside the guest*
lists, read through the guest agent: a lab GPU whose driver "fails" is not counted.
"""

from __future__ import annotations

import contextlib
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
                cordoned: bool = False) -> Iterator[LabCluster]:
    """The stand-in and kubelet for `lab`; `cordoned`: an administrator cordoned the
    node before hostagent ever ran."""
    kubeconfig = lab.root / "agent" / "kubeconfig"
    kubeconfig.parent.mkdir(exist_ok=True)
    with serve_in_thread(termination_scale=0.02, replacement_node="cpu-node",
                         replacement_ready_after=1.0) as api:
        api.write_kubeconfig(kubeconfig)
        api.call(lambda: api.standin.cluster.add_node(LENDEE, ready=False, gpus=0,
                                                      unschedulable=cordoned))
        if workloads:
            seed_workloads(api)
        kubelet = Kubelet(kubeconfig, LENDEE, lendee_running=lambda: lendee_running(lab),
                          gpus_seen=lambda: gpus_seen(lab), ready_delay=ready_delay,
                          gpu_delay=0.3, heartbeat_grace=1.0)
        api.call(kubelet.start)
        try:
            yield LabCluster(api, kubelet, kubeconfig)
        finally:
            api.run(kubelet.stop())
