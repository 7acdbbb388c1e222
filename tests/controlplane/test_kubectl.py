"""The real kubectl of the lab's release against the real control plane: get, describe,
cordon, drain, events, DRA objects; and hostagent's drain beside kubectl's.

Workloads are real: ReplicaSets, DaemonSets and StatefulSets made into pods by the
real controller-manager, bound by the real scheduler, PodDisruptionBudget status from
the disruption controller; the nodes' kubelets are the lab's stand-in
(tests/controlplane/machine.py: node status, Lease, GPUs, pods).
Manifests go through `kubectl create` with its validation on.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import Config, parse
from hostagent.cluster.kube import Kube, Timing
from tests.controlplane import ControlPlane
from tests.controlplane.machine import Kubelet
from tests.controlplane.nvidia import gpu
from tests.waiting import until

FAST = Timing(request_timeout=2.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
              evict_retry=0.2, delete_poll=0.05, watch_timeout=5.0)  # fmt: skip
NS = "kubectl"
GPU_NODE, CPU_NODE = "gpu-node", "cpu-node"
# kubectl -v=6's line for a request the API server answered (client-go
# round_trippers.go: "Response" verb=... url=... status="200 OK"; status="" when none came).
ANSWERED = re.compile(r'"Response" .*\bstatus="\d')


class Kubectl:
    def __init__(self, plane: ControlPlane, home: Path) -> None:
        self.plane = plane
        self.home = home

    async def __call__(self, *args: str, check: bool = True, timeout: float = 90,
                       input: str | None = None) -> str:
        """kubectl's stdout and stderr together; fails the test on a non-zero exit."""
        process = await self._start(*args)
        out, _ = await asyncio.wait_for(
            process.communicate(input.encode() if input is not None else None), timeout)
        text = out.decode()
        if check:
            assert process.returncode == 0, f"kubectl {' '.join(args)}:\n{text}"
        return text

    async def begin(self, *args: str, timeout: float = 90) -> asyncio.Task[str]:
        """kubectl under way, once the API server has answered its first request (its
        -v=6 log line for the answer); the task gives what a call gives, with kubectl's
        log lines among it, once kubectl is done."""
        process = await self._start("-v=6", *args)
        lines: list[str] = []

        async def finish() -> str:
            assert process.stdout is not None
            try:
                async with asyncio.timeout(timeout):
                    async for line in process.stdout:
                        lines.append(line.decode())
                    await process.wait()
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            text = "".join(lines)
            assert process.returncode == 0, f"kubectl {' '.join(args)}:\n{text}"
            return text

        done = asyncio.create_task(finish())
        try:
            await until(lambda: done.done() or any(ANSWERED.search(line) for line in lines),
                        f"kubectl {args[0]}'s first request answered")
        except BaseException:
            done.cancel()  # and kubectl with it
            raise
        return done

    async def _start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            str(self.plane.labkube), "kubectl", "--kubeconfig", str(self.plane.admin),
            "--cache-dir", str(self.home / "cache"), *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={"HOME": str(self.home), "PATH": "/usr/bin:/bin"})

    async def create(self, *objects: dict[str, Any]) -> None:
        await self("create", "-n", NS, "-f", "-",
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    async def json(self, *args: str) -> Any:
        return json.loads(await self(*args, "-o", "json"))


class Lab:
    """The plane, kubectl, and kubelets for nodes added while the test runs."""

    def __init__(self, plane: ControlPlane, kubectl: Kubectl, stack: AsyncExitStack) -> None:
        self.plane = plane
        self.kubectl = kubectl
        self.stack = stack
        self.nodes: list[str] = []

    async def add_node(self, name: str, gpus: int = 0) -> None:
        kubeconfig = self.plane.credential(f"kubelet-{name}", f"system:node:{name}",
                                           "system:nodes")
        self.nodes.append(name)
        await self.stack.enter_async_context(Kubelet(
            kubeconfig, name, running=lambda: True, plugins=self.plane.admin,
            gpus_seen=lambda: gpus, ready_delay=0, gpu_delay=0, gpu_recheck=3600))
        # Schedulable once the node lifecycle controller took its not-ready taint off; and
        # its GPUs posted, which the stand-in does in a later step than Ready (a test that
        # reads them at once could find none).
        await until(lambda: self._untainted(name, gpus), f"{name} schedulable, {gpus} GPU(s)",
                    every=0.2)

    async def _untainted(self, name: str, gpus: int) -> bool:
        node = await self.kubectl.json("get", "node", name)
        posted = node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")
        return not node["spec"].get("taints") and posted == str(gpus) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

    async def on_node(self, node: str) -> list[str]:
        """The pods bound to `node` that are not being deleted."""
        pods = await self.kubectl.json("get", "pods", "-n", NS,
                                       "--field-selector", f"spec.nodeName={node}")
        return sorted(p["metadata"]["name"] for p in pods["items"]
                      if not p["metadata"].get("deletionTimestamp"))

    async def running(self, count: int) -> None:
        async def ready() -> bool:
            pods = (await self.kubectl.json("get", "pods", "-n", NS))["items"]
            return len(pods) == count and all(p["status"].get("phase") == "Running"
                                              for p in pods)
        await until(ready, f"{count} pods running", every=0.2)


@pytest.fixture
async def lab(plane: ControlPlane, tmp_path: Path) -> AsyncIterator[Lab]:
    kubectl = Kubectl(plane, tmp_path)
    async with AsyncExitStack() as stack:
        lab = Lab(plane, kubectl, stack)
        await asyncio.to_thread(plane.namespace, NS)
        try:
            await lab.add_node(GPU_NODE, gpus=2)
            yield lab
        finally:
            # The namespace goes (its pods at once: the namespace controller would wait
            # their grace period out before it looks again), then the nodes: the next
            # test starts from none of this.
            await kubectl("delete", "namespace", NS, "--wait=false")
            await kubectl("delete", "pods", "-n", NS, "--all", "--grace-period=0", "--force")
            await until(lambda: _gone(kubectl), "the test's namespace deleted", every=0.2)
            await kubectl("delete", "deviceclass", "gpu.nvidia.com", "--ignore-not-found")
            await kubectl("delete", "resourceslices", "--all")
            await stack.aclose()
            await kubectl("delete", "node", *lab.nodes, "--ignore-not-found")
            await kubectl("delete", "lease", "-n", "kube-node-lease", *lab.nodes,
                          "--ignore-not-found")
            await kubectl("delete", "events", "-n", "default", "--all")


async def _gone(kubectl: Kubectl) -> bool:
    return "NotFound" in await kubectl("get", "namespace", NS, check=False)


def labels(app: str) -> dict[str, Any]:
    return {"matchLabels": {"app": app}}


def pod_template(app: str, *, grace: int = 30, volumes: list[Any] | None = None,
                 **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": app}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                     "terminationGracePeriodSeconds": grace, **({"volumes": volumes}
                                                                 if volumes else {}), **spec}}


def replicaset(name: str, replicas: int, **template: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": labels(name),
                     "template": pod_template(name, **template)}}


def daemonset(name: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name},
            "spec": {"selector": labels(name), "template": pod_template(name)}}


def pdb(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name},
            "spec": {"selector": labels(name), **spec}}


async def test_get_nodes_and_pods_wide_prints_the_servers_columns(lab: Lab) -> None:
    await lab.kubectl.create(replicaset("web", 1))
    await lab.running(1)
    out = await lab.kubectl("get", "nodes,pods", "-n", NS, "-o", "wide")
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert "INTERNAL-IP" in lines[0] and "CONTAINER-RUNTIME" in lines[0]
    assert any(line.startswith(f"node/{GPU_NODE}") and " Ready " in line for line in lines)
    pod = next(line for line in lines if line.startswith("pod/web-"))
    assert pod.split()[1:3] == ["1/1", "Running"] and GPU_NODE in pod
    assert "couldn't get current server API group list" not in out


async def test_cordon_and_uncordon(lab: Lab) -> None:
    assert f"node/{GPU_NODE} cordoned" in await lab.kubectl("cordon", GPU_NODE)
    assert (await lab.kubectl.json("get", "node", GPU_NODE))["spec"]["unschedulable"] is True
    assert "Ready,SchedulingDisabled" in await lab.kubectl("get", "node", GPU_NODE)
    assert f"node/{GPU_NODE} uncordoned" in await lab.kubectl("uncordon", GPU_NODE)
    assert not (await lab.kubectl.json("get", "node", GPU_NODE))["spec"].get("unschedulable")


async def test_describe_node_shows_what_is_on_it(lab: Lab) -> None:
    await lab.kubectl.create(replicaset("web", 1))
    await lab.running(1)
    out = await lab.kubectl("describe", "node", GPU_NODE)
    assert f"Name:               {GPU_NODE}" in out
    assert "nvidia.com/gpu:     2" in out or "nvidia.com/gpu:  2" in out, out
    assert f"HolderIdentity:  {GPU_NODE}" in out
    assert "web-" in out and "Non-terminated Pods:          (1 in total)" in out


async def test_drain_waits_for_a_budget_then_evicts(lab: Lab) -> None:
    # A replacement web pod is Ready 3 s after it starts: kubectl's second eviction,
    # at once, is refused.
    probe = {"exec": {"command": ["true"]}, "initialDelaySeconds": 3}
    web = replicaset("web", 2)
    web["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = probe
    await lab.kubectl.create(web, daemonset("logs"),
                             replicaset("scratch", 1, volumes=[{"name": "s", "emptyDir": {}}]),
                             pdb("web", minAvailable=1))
    await lab.running(4)
    await lab.add_node(CPU_NODE)  # where the web pods' replacements go
    out = await lab.kubectl("drain", GPU_NODE, "--ignore-daemonsets", "--delete-emptydir-data",
                            "--timeout=90s")
    # The first web pod goes; the second waits until its replacement is Ready elsewhere.
    assert "Cannot evict pod as it would violate the pod's disruption budget" in out
    assert "will retry after 5s" in out
    assert f"node/{GPU_NODE} drained" in out
    left = await lab.on_node(GPU_NODE)
    assert len(left) == 1 and left[0].startswith("logs-"), left
    assert (await lab.kubectl.json("get", "node", GPU_NODE))["spec"]["unschedulable"] is True
    assert sorted(p.rsplit("-", 1)[0] for p in await lab.on_node(CPU_NODE)) == [
        "logs", "scratch", "web", "web"]


def _config() -> Config:
    return parse(f"""
[lendee]
domain = "{GPU_NODE}"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"

[timeouts]
drain = "90s"

[policy]
on_drain_timeout = "abort"

[kubernetes]
evict_retry = "1s"
""", "test.toml")


async def test_hostagent_and_kubectl_draining_at_once_agree(lab: Lab) -> None:
    db = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db"},
          "spec": {"replicas": 1, "serviceName": "db", "selector": labels("db"),
                   "template": pod_template("db", grace=60)}}
    await lab.kubectl.create(replicaset("web", 6), db, daemonset("logs"),
                             pdb("web", maxUnavailable=2))
    await lab.running(8)
    await lab.add_node(CPU_NODE)
    async with await Kube.connect(lab.plane.admin, timing=FAST) as kube:
        cordons: list[bool] = []
        cluster = KubeCluster(kube, _config(), remember_cordon=cordons.append)
        # kubectl first, as a person would be: under way when hostagent begins.
        theirs = await lab.kubectl.begin("drain", GPU_NODE, "--ignore-daemonsets",
                                         "--delete-emptydir-data", "--timeout=90s")
        assert await cluster.reclaim(["gaming1"]) is None
        out = await theirs
        ours = kube.last_drain
        await cluster.flush_events()
    assert ours is not None and ours.complete, ours
    assert f"node/{GPU_NODE} drained" in out
    left = await lab.on_node(GPU_NODE)
    assert len(left) == 1 and left[0].startswith("logs-"), left
    assert [ref.name for ref, _ in ours.ignored] == left
    # Both cordoned; whoever was first, the node stays cordoned, as both meant.
    assert (await lab.kubectl.json("get", "node", GPU_NODE))["spec"]["unschedulable"] is True


async def test_get_events_and_describe_show_hostagents_events(lab: Lab) -> None:
    async with await Kube.connect(lab.plane.admin, timing=FAST) as kube:
        await kube.post_event(GPU_NODE, reason="Reclaimed", message="GPUs reclaimed for gaming1")
    out = await lab.kubectl("get", "events", "-n", "default")
    line = next(line for line in out.splitlines() if "Reclaimed" in line)
    assert line.split()[1:4] == ["Normal", "Reclaimed", f"node/{GPU_NODE}"]
    assert "GPUs reclaimed for gaming1" in line
    described = await lab.kubectl("describe", "node", GPU_NODE)
    events = described.split("Events:", 1)[1]
    assert "Reclaimed" in events and "hostagent" in events


async def test_get_resourceslices_and_claims_prints_the_servers_columns(lab: Lab) -> None:
    """The claim is made from its template by the controller-manager, allocated and
    reserved by the scheduler, and deleted with its pod by the garbage collector."""
    k = lab.kubectl
    await k("create", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}}))
    await k("create", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{GPU_NODE}-gpu.nvidia.com"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": GPU_NODE,
                 "pool": {"name": GPU_NODE, "generation": 1, "resourceSliceCount": 1},
                 "devices": [gpu(0, "GPU-0"), gpu(1, "GPU-1")]}}))
    await k.create(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": "gpu"},
         "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
             "deviceClassName": "gpu.nvidia.com"}}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-1"},
         "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                  "resources": {"claims": [{"name": "gpu"}]}}],
                  "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
                  "terminationGracePeriodSeconds": 1}})
    await lab.running(1)
    out = await k("get", "resourceslices")
    assert out.splitlines()[0].split() == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert out.splitlines()[1].split()[1:4] == [GPU_NODE, "gpu.nvidia.com", GPU_NODE]
    claims = await k("get", "resourceclaims", "-n", NS)
    assert claims.splitlines()[1].split()[1] == "allocated,reserved", claims
    assert "gpu.nvidia.com" in await k("get", "deviceclasses")
    shown = await k("get", "resourceslices", "-o", "jsonpath={.items[0].spec.devices[*]"
                    ".attributes.uuid.string}")
    assert shown.split() == ["GPU-0", "GPU-1"]
    await k("delete", "pod", "-n", NS, "train-1", "--wait=true")
    await until(lambda: _no_claims(k), "the claim deleted with its pod", every=0.2)


async def _no_claims(k: Kubectl) -> bool:
    return "No resources found" in await k("get", "resourceclaims", "-n", NS)
