"""The lab's Kubernetes: the real control plane (tests/controlplane), one per lab process,
started at its first use and stopped with the process; two nodes: gpu-node, the
lendee, which follows the VM's real state, its kubelet the real one where it can run
here (tests/lab/realnode.py, `lendee_kubelet`), else the lab's stand-in
(tests/controlplane/machine.py); and cpu-node, always up, the stand-in's; and, if
asked, real workloads.

gpu-node's kubelet starts `kubelet_start` seconds after the VM runs, once the guest's
boot id can be read through the guest agent (`boot_seen`): until then the API keeps
what the previous boot posted. It is Ready a moment later, and reports as
``nvidia.com/gpu`` what
the stand-in nvidia-smi *inside the guest* lists, read through the guest agent: a lab
GPU whose driver "fails" is not counted. On a DRA node (``dra=True``) those GPUs are
published, by UUID, in the node's ResourceSlice of gpu.nvidia.com instead, and the
cluster has the driver's DeviceClass.

The agent connects with the token of gpu-node's ServiceAccount (deploy/rbac.yaml and
deploy/rbac-node.yaml) and nothing more, as README says to make its kubeconfig,
through the fault proxy
(tests/controlplane/proxy.py: `LabCluster.api`, whose faults a test calls with
`LabCluster.call`). Each `lab_cluster` leaves the plane as it
found it: its nodes, their Leases and slices, and every workload and Event in
namespace default are deleted when it ends.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.controlplane import ControlPlane
from tests.controlplane.proxy import FaultProxy
from tests.controlplane import nvidia
from tests.controlplane.machine import Kubelet
from tests.controlplane.realkubelet import missing as real_missing
from tests.lab.realnode import STATUS_EVERY, RealLendee
from tests.lab.lab import LENDEE, Lab

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
SPARE = "cpu-node"
NS = "default"
_planes: dict[Path, ControlPlane] = {}
READY_DELAY = 1.0  # the stand-in's: seconds from its kubelet's start to Ready
T = TypeVar("T")


def lab_plane(lab: Lab) -> ControlPlane:
    """The lab's control plane, started on first use and stopped when the process ends
    (lab.down() kills what is left of it: its command lines name the lab's directory)."""
    plane = _planes.get(lab.root)
    if plane is None:
        plane = ControlPlane(lab.root / "kube").start()
        _planes[lab.root] = plane
        atexit.register(plane.stop)
        plane.kubectl("apply", "-f", str(REPO / "deploy" / "rbac.yaml"))
        plane.kubectl("apply", "-f", "-", input=node_rbac(LENDEE))
    return plane


def node_rbac(node: str) -> str:
    """deploy/rbac-node.yaml for `node`, as README's sed makes it."""
    return (REPO / "deploy" / "rbac-node.yaml").read_text().replace("@NODE@", node)


def close(lab: Lab) -> None:
    """The lab's control plane stopped, if it was started."""
    plane = _planes.pop(lab.root, None)
    if plane is not None:
        plane.stop()


def agent_kubeconfig(plane: ControlPlane, path: Path, node: str = LENDEE) -> Path:
    """The agent's kubeconfig: the token of the lendee's ServiceAccount, no more."""
    token = plane.kubectl("create", "token", node, "-n", "hostagent",
                          "--duration=12h").stdout.strip()
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "hostagent",
        "clusters": [{"name": "lab", "cluster": {
            "server": plane.server, "certificate-authority": str(plane.pki / "ca.crt")}}],
        "users": [{"name": "hostagent", "user": {"token": token}}],
        "contexts": [{"name": "hostagent", "context": {"cluster": "lab", "user": "hostagent"}}],
    }))
    path.chmod(0o600)
    return path


def pod(name: str, *, app: str, grace: int = 30, **spec: Any) -> dict[str, Any]:
    """A pod template (or, with `name`, a pod) of one container."""
    return {"metadata": {"labels": {"app": app}, **({"name": name} if name else {})},
            "spec": {"terminationGracePeriodSeconds": grace, "containers": [
                {"name": app, "image": f"registry.lab/{app}:1"}],
                # Welcome on borrowed capacity, whatever the agent's lent_taints say.
                "tolerations": [{"key": "hostagent.io/borrowed", "operator": "Exists"}],
                **spec}}


def deployment(name: str, node: str, *, gpus: int = 0, **spec: Any) -> dict[str, Any]:
    """One pod of `name`, kept on `node` by its hostname label; `gpus`: the
    ``nvidia.com/gpu`` it holds; `spec`: more of the pod's spec."""
    template = pod("", app=name, nodeSelector={"kubernetes.io/hostname": node}, **spec)
    if gpus:
        template["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": template}}


def usual_workloads() -> list[dict[str, Any]]:
    """A web Deployment, two training pods of a StatefulSet behind a budget
    (minAvailable 1: one eviction at a time, the next once the replacement is Ready
    elsewhere), and a DaemonSet whose pods drain leaves alone."""
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                  "template": pod("", app="web")}},
        *statefulset("trainer", 2, min_available=1),
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "device-plugin"},
         "spec": {"selector": {"matchLabels": {"app": "device-plugin"}},
                  "template": pod("", app="device-plugin")}},
    ]


def statefulset(name: str, replicas: int, *, min_available: int) -> list[dict[str, Any]]:
    """A StatefulSet of `replicas` pods and its PodDisruptionBudget."""
    return [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name},
         "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": {"app": name}}, "template": pod("", app=name)}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name},
         "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": name}}}},
    ]


class GuestGpus:
    """What NVIDIA's plugins on gpu-node see: (UUID, name) of each GPU the stand-in
    nvidia-smi inside the lendee lists (`devices_seen`), unless a test sets `seen`."""

    def __init__(self, lab: Lab) -> None:
        self.seen: Callable[[], list[tuple[str, str]]] = lambda: devices_seen(lab)

    def __call__(self) -> list[tuple[str, str]]:
        return self.seen()


@dataclass
class LabCluster:
    plane: ControlPlane
    kubelet: Kubelet | RealLendee
    kubeconfig: Path
    api: FaultProxy
    loop: asyncio.AbstractEventLoop
    gpus: GuestGpus
    placed: threading.Event = field(default_factory=threading.Event)
    kubeconfigs: dict[str, Path] = field(default_factory=dict)  # other lendees' nodes

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the loop of the kubelets and the proxy, e.g.
        ``kc.call(kc.api.down_for, 4)``."""
        async def call() -> T:
            return fn(*args, **kwargs)
        return self.run(call())

    def run(self, work: Awaitable[T]) -> T:
        async def run() -> T:
            return await work
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.plane.kubectl(*args, input=input).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def node(self, name: str = LENDEE) -> dict[str, Any]:
        node: dict[str, Any] = self.plane.get(f"/api/v1/nodes/{name}")
        return node

    def slice_uuids(self) -> list[str]:
        """The UUIDs in the lendee node's ResourceSlices (DRA)."""
        slices = self.plane.get("/apis/resource.k8s.io/v1/resourceslices",
                                fieldSelector=f"spec.nodeName={LENDEE}")
        return sorted(d["attributes"]["uuid"]["string"] for s in slices["items"]
                      for d in s["spec"].get("devices") or [])

    def create(self, *objects: dict[str, Any]) -> None:
        self.kubectl("create", "-n", NS, "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def place(self, *objects: dict[str, Any], pods: int) -> None:
        """Create `objects`, whose `pods` pods (DaemonSets' not counted) the scheduler
        puts on gpu-node: cpu-node is cordoned until they run there (gpu-node is Ready
        only once the agent lent it), then uncordoned for their replacements.
        `wait_placed` waits for that."""
        self.placed.clear()
        self.kubectl("cordon", SPARE)
        self.create(*objects)
        self._background(self._open_spare(pods))

    def wait_placed(self, timeout: float = 60) -> None:
        assert self.placed.wait(timeout), f"the workloads never ran on {LENDEE}: " + \
            self.kubectl("get", "pods", "-n", NS, "-o", "wide")

    def add_gpu_job(self, name: str, uuid: str | None = None) -> None:
        """A Job whose pod holds one GPU: `uuid`, through a claim from a template that
        selects it (DRA: the scheduler allocates it from the node's slice), or one
        ``nvidia.com/gpu``. The pod is named ``<name>-<suffix>`` by the Job controller."""
        template = pod("", app=name, restartPolicy="Never")
        objects: list[dict[str, Any]] = []
        if uuid is None:
            template["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        else:
            chosen = f'device.attributes["{nvidia.DRIVER}"].uuid == "{uuid}"'
            objects.append({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name}, "spec": {"spec": {"devices": {"requests": [{
                    "name": "gpu", "exactly": {"deviceClassName": nvidia.DRIVER,
                                               "selectors": [{"cel": {"expression": chosen}}]},
                }]}}}})
            template["spec"]["resourceClaims"] = [{"name": "gpu",
                                                   "resourceClaimTemplateName": name}]
            template["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        objects.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                        "spec": {"backoffLimit": 0, "template": template}})
        self.create(*objects)

    def delete_job(self, name: str) -> None:
        """The Job gone, and its pod with it (through its grace period)."""
        self.kubectl("delete", "job", name, "-n", NS, "--wait=false")

    def pod(self, name: str) -> dict[str, Any] | None:
        """Pod `name` of namespace default, or None once it is gone."""
        out = self.plane.kubectl("get", "pod", name, "-n", NS, "-o", "json", check=False)
        found: dict[str, Any] | None = json.loads(out.stdout) if out.returncode == 0 else None
        return found

    def running(self, app: str, timeout: float = 60) -> dict[str, Any]:
        """The pod labelled ``app=<app>`` once it runs on gpu-node."""
        deadline = time.monotonic() + timeout
        while True:
            found = [p for p in self._pods(LENDEE) if p["metadata"]["labels"].get("app") == app
                     and p["status"].get("phase") == "Running"]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no pod of {app} running on {LENDEE}"
            time.sleep(0.2)

    def running_on(self, app: str, node: str, timeout: float = 120) -> dict[str, Any]:
        """The pod labelled ``app=<app>`` once it runs on `node`."""
        deadline = time.monotonic() + timeout
        while True:
            found = [p for p in self._pods(node) if p["metadata"]["labels"].get("app") == app
                     and p["status"].get("phase") == "Running"]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no pod of {app} running on {node}"
            time.sleep(0.5)

    def pods_on(self, node: str) -> list[str]:
        """The names of the pods bound to `node` that are not being deleted."""
        return sorted(p["metadata"]["name"] for p in self._pods(node))

    def apps_on(self, node: str) -> list[str]:
        """The ``app`` labels of those pods: a generated name says less."""
        return sorted(p["metadata"]["labels"].get("app", "") for p in self._pods(node))

    def _pods(self, node: str) -> list[dict[str, Any]]:
        pods = self.plane.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self.loop)

    async def _open_spare(self, count: int) -> None:
        while True:
            pods = await asyncio.to_thread(self._pods, LENDEE)
            running = [p for p in pods if p["status"].get("phase") == "Running"
                       and not any(o["kind"] == "DaemonSet"
                                   for o in p["metadata"].get("ownerReferences") or [])]
            if len(running) >= count:
                break
            await asyncio.sleep(0.5)
        await asyncio.to_thread(self.kubectl, "uncordon", SPARE)
        self.placed.set()


def gpus_seen(lab: Lab, vm: str = LENDEE) -> int:
    return len(devices_seen(lab, vm))


def lendee_kubelet(lab: Lab, plane: ControlPlane, gpus: GuestGpus,
                   stand_in: Callable[..., Kubelet], *, kubelet_start: float,
                   ready_delay: float, dra: bool,
                   status_every: float | None) -> Kubelet | RealLendee:
    """gpu-node's kubelet: the real one (tests/lab/realnode.py) where it can run here,
    else the stand-in (tests/controlplane/machine.py), saying why in the log. The
    stand-in stays where a test holds the node NotReady for `ready_delay` seconds after
    the kubelet's start, which the real kubelet does not do; HOSTAGENT_LAB_KUBELET=
    stand-in asks for it anyway (to compare)."""
    why = real_missing()
    if ready_delay != READY_DELAY:
        why = f"a node held NotReady {ready_delay:g}s after its kubelet's start"
    elif os.environ.get("HOSTAGENT_LAB_KUBELET") == "stand-in":
        why = "HOSTAGENT_LAB_KUBELET=stand-in"
    if why is None:
        root = Path(tempfile.mkdtemp(prefix="node-", dir=lab.root))
        return RealLendee(plane, LENDEE, root, running=lambda: lendee_running(lab),
                          boot_id=lambda: boot_seen(lab), devices_seen=gpus, dra=dra,
                          start_delay=kubelet_start, status_every=status_every)
    # tests/controlplane/test_realkubelet.py's skip says so in the run's summary.
    log.warning("%s's kubelet is the lab's stand-in, not the real one: %s", LENDEE, why)
    # Its Lease renewed every 4 s, not 10: the lab's node monitor grace period is 20 s,
    # not 50, and a stopped node's last status then stays 16 to 20 s, as a real one's
    # stays 40 to 50 s (v1.35.4: pkg/kubelet/kubelet.go renews every 0.25 of its 40 s
    # lease; pkg/controller/nodelifecycle/config/v1alpha1/defaults.go: 50 s).
    return stand_in(LENDEE, lambda: lendee_running(lab), boot_id=lambda: boot_seen(lab),
                    start_delay=kubelet_start, lease_every=4.0,
                    **({"devices_seen": gpus} if dra else {"gpus_seen": lambda: len(gpus())}))


def devices_seen(lab: Lab, vm: str = LENDEE) -> list[tuple[str, str]]:
    """(UUID, name) of each GPU nvidia-smi lists inside the lendee: what NVIDIA's
    plugins would publish."""
    try:
        out = lab.guest_exec(vm, "/usr/bin/nvidia-smi", "-L", timeout=5)
    except Exception:  # no agent yet, VM gone: the plugins see nothing either
        return []
    return [(m[2], m[1]) for line in out.stdout.splitlines()
            if (m := re.fullmatch(r"GPU \d+: (.*) \(UUID: (\S+)\)", line.strip()))]


def boot_seen(lab: Lab, vm: str = LENDEE) -> str | None:
    """The lendee's boot id (/proc/sys/kernel/random/boot_id), which its kubelet posts
    as the node's bootID; None while the guest agent cannot tell it."""
    try:
        out = lab.guest_exec(vm, "/bin/cat", "/proc/sys/kernel/random/boot_id", timeout=5)
    except Exception:  # no agent yet, VM gone
        return None
    found = out.stdout.strip()
    return found if re.fullmatch(r"[0-9a-f-]{36}", found) else None


def lendee_running(lab: Lab, vm: str = LENDEE) -> bool:
    """What the kubelet sees of its VM: not running while libvirtd is down too."""
    return lab.virsh("domstate", vm, check=False).stdout.strip() == "running"



@contextlib.contextmanager
def lab_cluster(lab: Lab, *, workloads: bool = True, ready_delay: float = READY_DELAY,
                kubelet_start: float = 2.0, cordoned: bool = False,
                dra: bool = False, others: tuple[str, ...] = (),
                status_every: float | None = STATUS_EVERY) -> Iterator[LabCluster]:
    """The plane's nodes and their kubelets for `lab`; `workloads`: the usual ones
    placed on gpu-node once it is lent; `kubelet_start`: seconds from the lendee's
    start to its kubelet's (at the soonest: the guest agent must answer too);
    `cordoned`: an administrator cordoned the node before hostagent ever ran; `dra`:
    the GPUs go through DRA, not the device plugin; `others`: more lendees, each its
    own node, kubelet (the stand-in) and ServiceAccount (deploy/rbac-node.yaml), whose
    kubeconfig (no fault proxy in front) is `LabCluster.kubeconfigs`; `status_every`: the
    real kubelet's nodeStatusUpdateFrequency (None: the release's 10 s; tests/lab/realnode.py)."""
    plane = lab_plane(lab)
    upstream = agent_kubeconfig(plane, plane.root / "agent.kubeconfig")
    if dra:  # the DeviceClass the driver's chart installs
        plane.kubectl("apply", "-f", "-", input=json.dumps(nvidia.DEVICE_CLASS))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="lab kubelets", daemon=True)
    thread.start()

    def run(work: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(work, loop).result(60)

    def kubelet(node: str, running: Callable[[], bool], **knobs: Any) -> Kubelet:
        credential = plane.credential(f"kubelet-{node}", f"system:node:{node}", "system:nodes")
        return Kubelet(credential, node, running=running, plugins=plane.admin,
                       ready_delay=ready_delay, grace_scale=0.02, **knobs)

    gpus = GuestGpus(lab)
    lendee = lendee_kubelet(lab, plane, gpus, kubelet, kubelet_start=kubelet_start,
                            ready_delay=ready_delay, dra=dra, status_every=status_every)

    def other(vm: str) -> Kubelet:  # another lendee's node, as gpu-node's
        return kubelet(vm, lambda: lendee_running(lab, vm), boot_id=lambda: boot_seen(lab, vm),
                       start_delay=kubelet_start, lease_every=4.0,
                       gpus_seen=lambda: gpus_seen(lab, vm))

    more = [other(vm) for vm in others]
    kubeconfigs = {}
    for vm in others:
        plane.kubectl("apply", "-f", "-", input=node_rbac(vm))
        kubeconfigs[vm] = agent_kubeconfig(plane, plane.root / f"{vm}.kubeconfig", vm)
    spare = kubelet(SPARE, lambda: True, start_delay=0.0)  # up before the lab began
    proxy = FaultProxy(upstream)
    try:
        run(proxy.start())
        kubeconfig = proxy.write_kubeconfig(lab.root / "agent" / "kubeconfig")
        for k in (lendee, *more, spare):
            run(k.__aenter__())
        if cordoned:
            plane.kubectl("cordon", LENDEE)
        kc = LabCluster(plane, lendee, kubeconfig, proxy, loop, gpus, kubeconfigs=kubeconfigs)
        if workloads:
            kc.place(*usual_workloads(), pods=3)
        yield kc
    finally:
        for k in (lendee, *more, spare):
            with contextlib.suppress(Exception):
                run(k.__aexit__(None, None, None))
        with contextlib.suppress(Exception):
            run(proxy.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        _close(loop)
        reset(plane)
        for vm in others:
            plane.kubectl("delete", f"node/{vm}", "--ignore-not-found")
            plane.kubectl("delete", "lease", "-n", "kube-node-lease", vm, "--ignore-not-found")


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Whatever still runs on `loop` cancelled, and its connections closed for good (an
    aiohttp connection needs a moment of its loop after it is closed)."""
    async def finish() -> None:
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await asyncio.sleep(0.25)
        await loop.shutdown_asyncgens()
    loop.run_until_complete(finish())
    loop.close()


def reset(plane: ControlPlane) -> None:
    """What a lab_cluster made, gone: the workloads and pods of namespace default (at
    once: no kubelet is left to finish them), its Events, the nodes, their Leases and
    slices, the DeviceClass."""
    kinds = ("deployments,statefulsets,daemonsets,replicasets,jobs,poddisruptionbudgets,"
             "resourceclaimtemplates,resourceclaims,events")
    plane.kubectl("delete", kinds, "--all", "-n", NS, "--wait=false")
    deadline = time.monotonic() + 60
    while "deleted" in plane.kubectl("delete", "pods", "--all", "-n", NS, "--force",
                                     "--grace-period=0", check=False).stdout:
        assert time.monotonic() < deadline, "the lab's pods would not go"
        time.sleep(0.3)
    plane.kubectl("delete", "resourceslices", "--all")
    plane.kubectl("delete", f"deviceclass/{nvidia.DRIVER}", f"node/{LENDEE}", f"node/{SPARE}",
                  "--ignore-not-found")
    plane.kubectl("delete", "lease", "-n", "kube-node-lease", LENDEE, SPARE, "--ignore-not-found")
