"""The real kubelet of the lab's release as a lab node (tests/controlplane/realkubelet.py),
against the real control plane: it registers and turns Ready with this boot's ID, runs
pods on cri-client's fake runtime, takes a device plugin's devices over the real gRPC
API, prepares a pod's claim through a DRA kubelet plugin, and after a restart behaves as
a rebooted node's kubelet does (Kubernetes v1.35.4, pkg/kubelet). Skipped where labnode is not built (tests/controlplane/labnode/build.sh)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.controlplane import ControlPlane, nvidia
from tests.controlplane.realkubelet import SYSCTLS, RealKubelet, former_slice, missing
from tests.waiting import wait_until

NODE = "real-node"
NAMESPACE = "realkubelet"


def answered(check: Callable[[], Any]) -> Callable[[], Any]:
    """`check` for tests.waiting.wait_until, an OSError from the API server (a 404: the
    node not registered yet) counted as not yet."""
    def asked() -> Any:
        try:
            return check()
        except OSError:
            return None
    return asked


def node(plane: ControlPlane) -> Any:
    return plane.get(f"/api/v1/nodes/{NODE}")


def ready(plane: ControlPlane) -> str:
    conditions = node(plane)["status"].get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == "Ready"), "")


def gpus(plane: ControlPlane) -> str | None:
    allocatable: dict[str, str] = node(plane)["status"].get("allocatable") or {}
    return allocatable.get("nvidia.com/gpu")


def pod(plane: ControlPlane, name: str) -> Any:
    return plane.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")


@pytest.fixture
def kubelet(plane: ControlPlane, tmp_path: Path) -> Iterator[RealKubelet]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    if plane.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        plane.namespace(NAMESPACE)
    real = RealKubelet(plane, NODE, tmp_path).start()
    try:
        yield real
    finally:
        real.stop()
        plane.kubectl("delete", "pods,resourceclaims", "--all", "-n", NAMESPACE,
                      "--grace-period=0", "--force", check=False)
        plane.kubectl("delete", "node", NODE, "--ignore-not-found")


def test_the_real_kubelet_registers_its_node_ready_with_this_boots_id(
        plane: ControlPlane, kubelet: RealKubelet) -> None:
    host = {key: Path(f"/proc/sys/{key}").read_text() for key in SYSCTLS}
    started = time.monotonic()
    wait_until(answered(lambda: ready(plane) == "True"), "the node Ready")
    took = time.monotonic() - started
    info = node(plane)["status"]["nodeInfo"]
    assert info["kubeletVersion"] == plane.version()
    assert info["bootID"] == kubelet.boot_id
    assert info["containerRuntimeVersion"] == "fakeRuntime://0.1.0"
    # The kernel settings it wants were its own namespace's files, not the host's.
    assert {key: Path(f"/proc/sys/{key}").read_text() for key in SYSCTLS} == host
    print(f"\nreal kubelet: node Ready {took:.2f} s after its start")


def test_after_a_reboot_a_pod_on_a_device_not_yet_served_again_fails_admission(
        plane: ControlPlane, kubelet: RealKubelet) -> None:
    wait_until(answered(lambda: ready(plane) == "True"), "the node Ready")
    kubelet.devices("nvidia.com/gpu", ["gpu-0"])
    # Posted with the node's next status (nodeStatusUpdateFrequency, 10 s).
    wait_until(answered(lambda: gpus(plane) == "1"), "the plugin's GPU allocatable", timeout=30)
    plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu", "namespace": NAMESPACE},
        "spec": {"nodeName": NODE, "containers": [{
            "name": "main", "image": "registry.k8s.io/pause:3.10",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
    wait_until(answered(lambda: pod(plane, "gpu")["status"].get("phase") == "Running"),
               "the GPU pod Running")
    plane.kubectl("apply", "-f", "-", input=json.dumps(former_slice(NODE)))
    before = kubelet.boot_id

    kubelet.stop()
    kubelet.start()  # a reboot: the plugin is not serving yet

    wait_until(answered(lambda: node(plane)["status"]["nodeInfo"]["bootID"]
                        == kubelet.boot_id != before), "the new boot's ID")
    assert gpus(plane) == "0"
    wait_until(answered(lambda: not plane.get("/apis/resource.k8s.io/v1/resourceslices",
                                              fieldSelector=f"spec.nodeName={NODE}")["items"]),
               "the node's ResourceSlices deleted at the kubelet's start")
    status = wait_until(answered(lambda: (s := pod(plane, "gpu")["status"]).get("phase")
                                 == "Failed" and s), "the GPU pod failed")
    assert status["reason"] == "UnexpectedAdmissionError", status
    kubelet.devices("nvidia.com/gpu", ["gpu-0"])
    wait_until(answered(lambda: gpus(plane) == "1"), "the GPU allocatable again", timeout=30)


def test_a_pod_with_a_resource_claim_runs_once_the_dra_plugin_prepared_its_gpu(
        plane: ControlPlane, kubelet: RealKubelet) -> None:
    wait_until(answered(lambda: ready(plane) == "True"), "the node Ready")
    plane.kubectl("apply", "-f", "-", input=json.dumps(nvidia.DEVICE_CLASS))
    kubelet.dra(nvidia.DRIVER, [("gpu-0", "GPU-7a1c0de5-0000-4000-8000-0000000000a0")],
                plane.admin)
    wait_until(answered(lambda: plane.get("/apis/resource.k8s.io/v1/resourceslices",
                                          fieldSelector=f"spec.nodeName={NODE}")["items"]),
               "the plugin's ResourceSlice")
    plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "one-gpu", "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": nvidia.DRIVER}}]}}}))
    plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "claims", "namespace": NAMESPACE},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE},
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": "one-gpu"}],
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                 "resources": {"claims": [{"name": "gpu"}]}}]}}))
    wait_until(answered(lambda: pod(plane, "claims")["status"].get("phase") == "Running"),
               "the pod with a claim Running")
    # The kubelet's DRA manager asked the plugin, which gave the GPU as a CDI device.
    log = (kubelet.root / f"plugin-{nvidia.DRIVER}.log").read_text()
    assert "k8s.gpu.nvidia.com/gpu=gpu-0" in log, log[-3000:]
