"""The notice of a reserved reclaim, against the real kube-apiserver under
deploy/rbac.yaml and its node's deploy/rbac-node.yaml alone: each GPU pod on the
lendee's node gets the annotation hostagent.io/reclaim-at (RFC 3339) and an Event of
its own, computed from the longest grace period among them; a pod without a GPU is left
alone."""

from __future__ import annotations

import json
from pathlib import Path

from hostagent.cluster.kube import Kube
from tests.controlplane import ControlPlane
from tests.controlplane.rbac import agent_kubeconfig
from tests.unit.kube_scaffold import FAST

NODE = "gpu-node-reserved"
WORK = "reserve-notice"


def pod(name: str, *, gpu: bool, grace: int | None) -> str:
    resources = {"limits": {"nvidia.com/gpu": "1"}} if gpu else {}
    spec: dict[str, object] = {"nodeName": NODE, "containers": [
        {"name": "c", "image": "busybox", "resources": resources}]}
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                       "spec": spec})


async def test_the_gpu_pods_are_told_when_with_their_longest_grace(
        plane: ControlPlane, tmp_path: Path) -> None:
    kubeconfig = agent_kubeconfig(plane, tmp_path / "agent.kubeconfig", NODE)
    plane.namespace(WORK)
    try:
        for name, gpu, grace in (("train", True, 600), ("infer", True, None),
                                 ("web", False, 30)):
            plane.kubectl("create", "-n", WORK, "-f", "-", input=pod(name, gpu=gpu, grace=grace))
        graces: list[float] = []

        def value(grace: float) -> str:
            graces.append(grace)
            return "2026-12-04T19:48:00+01:00"

        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            when, told = await kube.notice_pods(
                NODE, annotation="hostagent.io/reclaim-at", value=value,
                reason="GPUReclaimNotice", message=lambda at: f"evicted from {at}",
                timeout=20)
        assert (when, sorted(told), graces) == (
            "2026-12-04T19:48:00+01:00", [f"{WORK}/infer", f"{WORK}/train"], [600.0])
        pods = json.loads(plane.kubectl("get", "pods", "-n", WORK, "-o", "json").stdout)
        notes = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(
            "hostagent.io/reclaim-at") for p in pods["items"]}
        assert notes == {"train": when, "infer": when, "web": None}
        events = json.loads(plane.kubectl("get", "events", "-n", WORK, "-o", "json").stdout)
        ours = sorted((e["involvedObject"]["name"], e["reason"], e["message"])
                      for e in events["items"] if e["reason"] == "GPUReclaimNotice")
        assert ours == [("infer", "GPUReclaimNotice", f"evicted from {when}"),
                        ("train", "GPUReclaimNotice", f"evicted from {when}")]
    finally:
        plane.kubectl("delete", "namespace", WORK, "--wait=false", check=False)
