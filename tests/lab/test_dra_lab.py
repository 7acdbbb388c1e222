"""A DRA node in the lab: the real agent, libvirtd and guests, the real control plane
with the DRA driver's DeviceClass, and a kubelet whose driver plugin publishes the GPUs
the guest sees in the node's ResourceSlice instead of an allocatable count. The jobs'
claims are made from their templates by the controller-manager and allocated by the
scheduler; the release's kubectl reads the slices."""

from __future__ import annotations

import re

import pytest

from tests.lab.cluster import LabCluster, devices_seen, lab_cluster
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.lab.helpers import annotations_of, eventually, lends
from tests.packaging.readme import README
from tests.packaging.readme import commands

pytestmark = pytest.mark.lab
UUID = {gpu: uuid for gpu, (uuid, _) in GPUS.items()}


def kubectl_uuids(kc: LabCluster) -> list[str]:
    """What `kubectl get resourceslices` lists for the lendee's node."""
    out = kc.kubectl("get", "resourceslices", "--field-selector", f"spec.nodeName={LENDEE}",
                     "-o", "jsonpath={.items[*].spec.devices[*].attributes.uuid.string}")
    return sorted(out.split())


def holders(kc: LabCluster) -> str:
    """The node's holders annotation, each pod's generated suffix as -*."""
    return re.sub(r"-[a-z0-9]{5}\b", "-*",
                  annotations_of(kc.node()).get("hostagent.io/gpu-holders", ""))


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
        eventually(lambda: holders(kc) == "gpu-a=default/train-1-*",
                   "train-1 never named as gpu-a's holder")
        # "`kubectl get resourceclaims` shows the pod's claim `allocated,reserved`, and
        # `kubectl get resourceslices -o yaml` the device it holds, whose `uuid` is one that
        # hostagent lent": README's commands, as written.
        shown = ("kubectl get resourceclaims", "kubectl get resourceslices -o yaml")
        assert set(shown) <= set(commands())
        claims, slices = (kc.kubectl(*command.split()[1:]) for command in shown)
        assert re.search(r"^train-1-\S+ +allocated,reserved ", claims, re.M), claims
        assert UUID["gpu-a"] in slices, slices
        # `hostagent status` as README quotes it, with the lab's count, GPU and pod.
        status = lab.hostagent("status").stdout
        said = re.findall(r'`hostagent status` \("([^"]+)"\)', " ".join(README.read_text().split()))
        assert len(said) == 2, said
        for quoted in said:
            pattern = (re.escape(quoted).replace(r"publishes\ 2", r"publishes\ \d+")
                       .replace(re.escape("gpu-b"), "gpu-a")
                       .replace(re.escape("ml/train-1"), "default/train-1-[a-z0-9]{5}"))
            assert re.search(pattern, status), (quoted, status)

        # gaming1 takes gpu-a: the job is drained, then the lendee comes back with the rest.
        lab.play("gaming1")
        assert "train-1" not in kc.apps_on(LENDEE)
        named = lab.records(event="drain", result="holders")
        assert named and re.search(r"default/train-1-[a-z0-9]{5} \(gpu-a\)",
                                   named[0]["MESSAGE"])
        kc.delete_job("train-1")  # its owner gives up on it: no pod waits for gpu-a
        lends(lab, 2)
        assert annotations_of(kc.node())["hostagent.io/lent-gpus"] == "gpu-b,gpu-c"
        assert kubectl_uuids(kc) == sorted([UUID["gpu-b"], UUID["gpu-c"]])

        # When idle: the regrow waits for the job whose claim holds gpu-b.
        kc.add_gpu_job("train-2", UUID["gpu-b"])
        eventually(lambda: holders(kc) == "gpu-b=default/train-2-*",
                   "train-2 never named as gpu-b's holder")
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        waiting = lab.wait_record(30, event="regrow", result="waiting")
        assert "1 pod(s) on its node request a GPU" in waiting["MESSAGE"]
        assert len(lab.records(event="phase", to="lent")) == 2  # not restarted under it
        kc.delete_job("train-2")
        lends(lab, 3)
        assert annotations_of(kc.node())["hostagent.io/lent-gpus"] == "gpu-a,gpu-b,gpu-c"
        assert kubectl_uuids(kc) == sorted(UUID.values())

        # gpu-c does not come up after the next boot: the node stays cordoned, gpu-c named.
        kc.gpus.seen = lambda: [d for d in devices_seen(lab) if d[0] != UUID["gpu-c"]]
        lab.ask("gaming1")
        failed = lab.wait_record(120, event="phase", to="failed")
        assert f"lack gpu-c ({UUID['gpu-c']})" in failed["MESSAGE"]
        assert kc.node()["spec"]["unschedulable"] is True
        assert kubectl_uuids(kc) == [UUID["gpu-b"]]
