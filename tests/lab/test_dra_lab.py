"""A DRA node in the lab: the real agent, libvirtd and guests, the API stand-in with
the DRA driver's DeviceClass, and a kubelet that publishes the GPUs the guest sees in
the node's ResourceSlice instead of an allocatable count. Real kubectl reads the slices."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.kubeapi.rules import PODS
from tests.lab.cluster import LabCluster, devices_seen, lab_cluster
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.lab.test_kube_lab import annotations, lends

KUBECTL = shutil.which("kubectl")
pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(KUBECTL is None, reason="no kubectl installed "
                                 "(Debian: apt-get install kubernetes-client)")]
UUID = {gpu: uuid for gpu, (uuid, _) in GPUS.items()}


def kubectl_uuids(kc: LabCluster) -> list[str]:
    """What `kubectl get resourceslices` lists for the lendee's node."""
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "--kubeconfig", str(kc.kubeconfig), "get", "resourceslices",
         "--field-selector", f"spec.nodeName={LENDEE}", "-o",
         "jsonpath={.items[*].spec.devices[*].attributes.uuid.string}"],
        capture_output=True, text=True, timeout=60, check=True,
        env={"HOME": str(kc.kubeconfig.parent), "PATH": "/usr/bin:/bin"})
    return sorted(out.stdout.split())


def eventually(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    # Polled: the stand-in's objects change on a thread of their own.
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_dra_node_through_reclaim_partial_lend_and_regrow(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False, dra=True) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig))  # gpu_api "auto"
        lab.start_agent()
        lends(lab, 1)
        # Told from what the node publishes, and said so.
        assert "ResourceSlices (DRA: node gpu-node publishes" in \
            lab.records(event="expect")[-1]["MESSAGE"]
        assert kubectl_uuids(kc) == sorted(UUID.values())
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert "nvidia.com/gpu" not in node["status"].get("allocatable", {})

        # A job holds gpu-a; the node says so.
        kc.add_gpu_job("train-1", UUID["gpu-a"])
        eventually(lambda: annotations(kc.node()).get("hostagent.io/gpu-holders")
                   == "gpu-a=default/train-1", "train-1 never named as gpu-a's holder")

        # gaming1 takes gpu-a: the job is drained, then the lendee comes back with the rest.
        lab.virsh("start", "gaming1", check=False)
        lab.wait_state("gaming1", "running", timeout=90)
        assert "train-1" not in kc.pods_on(LENDEE)
        named = lab.records(event="drain", result="holders")
        assert named and "default/train-1 (gpu-a)" in named[0]["MESSAGE"]
        lends(lab, 2)
        assert annotations(kc.node())["hostagent.io/lent-gpus"] == "gpu-b,gpu-c"
        assert kubectl_uuids(kc) == sorted([UUID["gpu-b"], UUID["gpu-c"]])

        # When idle: the regrow waits for the job whose claim holds gpu-b.
        kc.add_gpu_job("train-2", UUID["gpu-b"])
        eventually(lambda: annotations(kc.node()).get("hostagent.io/gpu-holders")
                   == "gpu-b=default/train-2", "train-2 never named as gpu-b's holder")
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        waiting = lab.wait_record(30, event="regrow", result="waiting")
        assert "1 pod(s) on its node request a GPU" in waiting["MESSAGE"]
        assert len(lab.records(event="phase", to="lent")) == 2  # not restarted under it
        kc.api.call(kc.api.standin.cluster.delete, PODS, "default", "train-2")
        lends(lab, 3)
        assert annotations(kc.node())["hostagent.io/lent-gpus"] == "gpu-a,gpu-b,gpu-c"
        assert kubectl_uuids(kc) == sorted(UUID.values())

        # gpu-c does not come up after the next boot: the node stays cordoned, gpu-c named.
        kc.kubelet.devices_seen = lambda: [d for d in devices_seen(lab)
                                           if d[0] != UUID["gpu-c"]]
        lab.virsh("start", "gaming1", check=False)
        failed = lab.wait_record(120, event="phase", to="failed")
        assert f"lack gpu-c ({UUID['gpu-c']})" in failed["MESSAGE"]
        assert kc.node()["spec"]["unschedulable"] is True
        assert kubectl_uuids(kc) == [UUID["gpu-b"]]
