"""A real ``kubectl`` against the stand-in: discovery, get, describe, cordon, drain, events.

The stand-in must answer the client people use, with the same semantics it gives
hostagent's own: a PodDisruptionBudget makes kubectl's eviction wait (429, retried
every 5 s), a drain by kubectl and one by hostagent at the same time agree. Skipped
where no kubectl is installed (Debian's ``kubernetes-client`` provides one).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hostagent.cluster import KubeCluster
from hostagent.config import Config, parse
from hostagent.kube import Kube, Timing
from tests.kubeapi import StandIn, write_kubeconfig
from tests.kubeapi.cluster import gpu_device

KUBECTL = shutil.which("kubectl") or ("/usr/bin/kubectl" if Path("/usr/bin/kubectl").exists()
                                      else None)  # fmt: skip
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="no kubectl installed "
                                "(Debian: apt-get install kubernetes-client)")  # fmt: skip
FAST = Timing(request_timeout=2.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
              evict_retry=0.2, delete_poll=0.05, watch_timeout=5.0)  # fmt: skip


class Kubectl:
    def __init__(self, kubeconfig: Path, home: Path) -> None:
        self.kubeconfig = kubeconfig
        self.home = home

    async def __call__(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        """kubectl's stdout and stderr together; fails the test on a non-zero exit."""
        assert KUBECTL is not None
        process = await asyncio.create_subprocess_exec(
            KUBECTL, "--kubeconfig", str(self.kubeconfig), "--cache-dir",
            str(self.home / "cache"), *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={"HOME": str(self.home), "PATH": "/usr/bin:/bin"})  # fmt: skip
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
        text = out.decode()
        if check:
            assert process.returncode == 0, f"kubectl {' '.join(args)}:\n{text}"
        return text


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=0.01, replacement_node="cpu-node",
                       replacement_ready_after=0.5) as standin:  # fmt: skip
        standin.cluster.add_node("gpu-node", gpus=2)
        standin.cluster.add_node("cpu-node")
        yield standin


@pytest.fixture
def kubectl(api: StandIn, tmp_path: Path) -> Kubectl:
    return Kubectl(write_kubeconfig(tmp_path / "kubeconfig", api.url), tmp_path)


def on_node(api: StandIn, node: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in api.cluster.pods(node))


async def test_get_nodes_and_pods_wide_prints_the_servers_columns(
        api: StandIn, kubectl: Kubectl) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    out = await kubectl("get", "nodes,pods", "-o", "wide")
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert "INTERNAL-IP" in lines[0] and "CONTAINER-RUNTIME" in lines[0]
    assert any(line.startswith("node/gpu-node") and " Ready " in line for line in lines)
    pod = next(line for line in lines if line.startswith("pod/web-1"))
    assert pod.split()[1:3] == ["1/1", "Running"] and "gpu-node" in pod
    assert "couldn't get current server API group list" not in out


async def test_cordon_and_uncordon(api: StandIn, kubectl: Kubectl) -> None:
    assert "node/gpu-node cordoned" in await kubectl("cordon", "gpu-node")
    assert api.cluster.node("gpu-node")["spec"]["unschedulable"] is True
    out = await kubectl("get", "node", "gpu-node")
    assert "Ready,SchedulingDisabled" in out
    assert "node/gpu-node uncordoned" in await kubectl("uncordon", "gpu-node")
    assert not api.cluster.node("gpu-node")["spec"].get("unschedulable")


async def test_describe_node_shows_what_is_on_it(api: StandIn, kubectl: Kubectl) -> None:
    api.cluster.add_pod("web-1", node="gpu-node", owner="ReplicaSet/web")
    out = await kubectl("describe", "node", "gpu-node")
    assert "Name:               gpu-node" in out
    assert "nvidia.com/gpu:  2" in out
    assert "HolderIdentity:  gpu-node" in out
    assert "web-1" in out and "Non-terminated Pods:          (1 in total)" in out


async def test_drain_waits_for_a_budget_then_evicts(api: StandIn, kubectl: Kubectl) -> None:
    for name in ("web-1", "web-2"):
        api.cluster.add_pod(name, node="gpu-node", owner="ReplicaSet/web", labels={"app": "web"})
    api.cluster.add_pod("logs", node="gpu-node", owner="DaemonSet/logs")
    api.cluster.add_pod("scratch", node="gpu-node", owner="ReplicaSet/s", emptydir=True)
    api.cluster.add_pdb("web", match_labels={"app": "web"}, min_available=1)
    out = await kubectl("drain", "gpu-node", "--ignore-daemonsets", "--delete-emptydir-data",
                        "--timeout=60s")  # fmt: skip
    # The first web pod goes; the second waits until its replacement is Ready elsewhere.
    assert "Cannot evict pod as it would violate the pod's disruption budget" in out
    assert "will retry after 5s" in out
    assert "node/gpu-node drained" in out
    assert on_node(api, "gpu-node") == ["logs"]
    assert api.cluster.node("gpu-node")["spec"]["unschedulable"] is True
    posted = api.requests_to("POST", r"/pods/web-\d/eviction$")
    assert len(posted) >= 3  # two evictions and at least one refused try


async def test_hostagent_and_kubectl_draining_at_once_agree(
        api: StandIn, kubectl: Kubectl, tmp_path: Path) -> None:
    for i in range(6):
        api.cluster.add_pod(f"web-{i}", node="gpu-node", owner="ReplicaSet/web",
                            labels={"app": "web"})  # fmt: skip
    api.cluster.add_pod("db-0", node="gpu-node", owner="StatefulSet/db", grace=60)
    api.cluster.add_pod("logs", node="gpu-node", owner="DaemonSet/logs")
    api.cluster.add_pdb("web", match_labels={"app": "web"}, max_unavailable=2)
    async with await Kube.connect(write_kubeconfig(tmp_path / "ours", api.url),
                                  timing=FAST) as kube:  # fmt: skip
        cordons: list[bool] = []
        cluster = KubeCluster(kube, _config(), remember_cordon=cordons.append)
        theirs = asyncio.create_task(kubectl("drain", "gpu-node", "--ignore-daemonsets",
                                             "--delete-emptydir-data", "--timeout=60s"))
        await asyncio.sleep(0.05)  # kubectl's discovery first, as a person would be
        assert await cluster.reclaim(["gaming1"]) is None
        out = await theirs
        ours = kube.last_drain
        await cluster.flush_events()
    assert ours is not None and ours.complete, ours
    assert "node/gpu-node drained" in out
    assert on_node(api, "gpu-node") == ["logs"]
    assert [ref.name for ref, _ in ours.ignored] == ["logs"]
    # Both cordoned; whoever was first, the node stays cordoned, as both meant.
    assert api.cluster.node("gpu-node")["spec"]["unschedulable"] is True


def _config() -> Config:
    return parse("""
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"

[timeouts]
drain = "60s"

[policy]
on_drain_timeout = "abort"

[kubernetes]
evict_retry = "1s"
""", "test.toml")


async def test_get_events_and_describe_show_hostagents_events(
        api: StandIn, kubectl: Kubectl, tmp_path: Path) -> None:
    async with await Kube.connect(write_kubeconfig(tmp_path / "ours", api.url),
                                  timing=FAST) as kube:  # fmt: skip
        await kube.post_event("gpu-node", reason="Reclaimed",
                              message="GPUs reclaimed for gaming1")  # fmt: skip
    out = await kubectl("get", "events")
    line = next(line for line in out.splitlines() if "Reclaimed" in line)
    assert line.split()[1:4] == ["Normal", "Reclaimed", "node/gpu-node"]
    assert "GPUs reclaimed for gaming1" in line
    described = await kubectl("describe", "node", "gpu-node")
    events = described.split("Events:", 1)[1]
    assert "Reclaimed" in events and "hostagent" in events


async def test_get_resourceslices_and_claims_prints_the_servers_columns(
        api: StandIn, kubectl: Kubectl) -> None:
    c = api.cluster
    c.add_device_class()
    c.publish_devices("gpu-node", [gpu_device(0, "GPU-0"), gpu_device(1, "GPU-1")])
    c.add_pod("train-1", node="gpu-node", owner="Job/train", devices=["gpu-1"])
    out = await kubectl("get", "resourceslices")
    assert out.splitlines()[0].split() == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert out.splitlines()[1].split()[1:4] == ["gpu-node", "gpu.nvidia.com", "gpu-node"]
    claims = await kubectl("get", "resourceclaims")
    assert claims.splitlines()[1].split()[1] == "allocated,reserved"
    assert "gpu.nvidia.com" in await kubectl("get", "deviceclasses")
    shown = await kubectl("get", "resourceslices", "-o", "jsonpath={.items[0].spec.devices[*]"
                          ".attributes.uuid.string}")
    assert shown.split() == ["GPU-0", "GPU-1"]
    c.publish_devices("gpu-node", [gpu_device(0, "GPU-0")])
    shown = await kubectl("get", "resourceslices", "--field-selector", "spec.nodeName=gpu-node",
                          "-o", "jsonpath={.items[*].spec.devices[*].attributes.uuid.string}")
    assert shown.split() == ["GPU-0"]
    await kubectl("delete", "pod", "train-1", "--wait=true")
    assert "No resources found" in await kubectl("get", "resourceclaims")
