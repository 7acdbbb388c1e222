"""A lab node played by the real kubelet of the lab's release (Kubernetes v1.35.4,
cmd/kubelet, built as `labnode` by tests/controlplane/labnode/build.sh), against
the lab's real control plane, with k8s.io/cri-client/pkg/fake's runtime behind it.

    node = RealKubelet(plane, "lab-node", root).start()   # registers, turns Ready
    node.devices("nvidia.com/gpu", ["gpu-0", "gpu-1"])   # a device plugin, real gRPC API
    node.dra("gpu.nvidia.com", [("gpu-0", uuid)], plugins)  # a DRA kubelet plugin
    node.stop()

Each kubelet runs as root in a mount namespace of its own (`unshare -m`, as the lab's
libvirtd), because what it touches is at fixed paths: /var/lib/kubelet, and in it
the device plugin directory (kubelet's pkg/apis/deviceplugin/v1beta1 constants.go),
/var/log/pods, and the host's kernel settings. In that namespace:

- /var/lib/kubelet and /var/log are this node's own directories under `root`, so two
  nodes never share sockets, checkpoints or pod directories;
- /proc/sys/kernel/random/boot_id is a file of this boot's own: cadvisor (v0.53.0,
  machine/info.go) reads it once at the kubelet's start into `nodeInfo.bootID`, so each
  start is a new boot, as a rebooted guest's kubelet is;
- the six sysctls the kubelet sets at its start (pkg/kubelet/cm/container_manager_linux.go
  setupKernelTunables: vm.overcommit_memory=1, vm.panic_on_oom=0, kernel.panic=10,
  kernel.panic_on_oops=1, kernel.keys.root_maxkeys and root_maxbytes) are files holding
  the values it wants: on the shared host it would otherwise write them for everyone.

The configuration is what a node without a real runtime needs and no more: swap
allowed, cgroup v1 allowed (the kubelet refuses it by default from v1.35:
failCgroupV1), no per-QoS cgroups and no node allocatable enforcement (no container
really runs), its API on loopback only. The node's address is the host's: the kubelet
refuses a loopback node IP (kubelet_node_status.go, "nodeIP can't be loopback
address"). Everything else is the release's default, nodeStatusUpdateFrequency (10 s)
included (a device plugin's devices reach the node's allocatable with the next post),
unless `status_every` and `lease_seconds` say otherwise (the lab's lendee,
tests/lab/realnode.py). It is not started where iptables is installed (`missing`).

What differs from a real node: containers run nowhere (the fake runtime keeps them in
memory, so a restarted runtime has none: each start here is a reboot, not a kubelet
restart beside running containers), and where iptables is installed the kubelet
changes the host's tables (kubelet_network_linux.go); docs/architecture.md, "The real
kubelet: what was tried", has the measurements.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.lab.image import shared_cache

if TYPE_CHECKING:
    from tests.controlplane import ControlPlane

__all__ = ["RealKubelet", "labnode", "missing"]

HERE = Path(__file__).parent
# What setupKernelTunables wants (k8s.io/component-helpers v0.35.4, node/util/sysctl).
SYSCTLS = {"vm/overcommit_memory": 1, "vm/panic_on_oom": 0, "kernel/panic": 10,
           "kernel/panic_on_oops": 1, "kernel/keys/root_maxkeys": 1000000,
           "kernel/keys/root_maxbytes": 25000000}


def labnode() -> Path:
    release = next(line.split()[1] for line in (HERE / "go.mod").read_text().splitlines()
                   if line.strip().startswith("k8s.io/kubernetes v"))
    return shared_cache() / f"kube-{release}" / "labnode"


def missing() -> str | None:
    """Why the real kubelet cannot play a node here, or None."""
    if os.geteuid() != 0:
        return "the real kubelet needs root (a mount namespace of its own)"
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return "the real kubelet's mount namespace needs util-linux's unshare and nsenter"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    if shutil.which("iptables", path=path) or shutil.which("ip6tables", path=path):
        # kubelet_network_linux.go syncIPTablesRules would change the host's tables.
        return ("iptables is installed: the real kubelet would change the host's tables "
                "(no stub bound over it here)")
    if not labnode().exists():
        return (f"{labnode()} is not built: `tests/controlplane/labnode/build.sh` builds "
                "the real kubelet (minutes, once per release)")
    return None


def former_slice(node: str) -> dict[str, Any]:
    """A ResourceSlice of gpu.nvidia.com on `node`, as a former boot's DRA plugin left
    it: the kubelet's start must delete it."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpu.nvidia.com-old"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RealKubelet:
    """The kubelet of node `name`, its fake runtime and device plugins, under `root`."""

    def __init__(self, plane: ControlPlane, name: str, root: Path, *,
                 status_every: float | None = None, lease_seconds: int | None = None) -> None:
        self.plane = plane
        self.name = name
        self.root = root
        # nodeStatusUpdateFrequency (and nodeStatusReportFrequency with it) and
        # nodeLeaseDurationSeconds; None: the release's default (10 s, 5 min; 40 s).
        self.status_every = status_every
        self.lease_seconds = lease_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.plugins: dict[str, subprocess.Popen[bytes]] = {}
        self.boot_id = ""

    @property
    def log_path(self) -> Path:
        return self.root / "kubelet.log"

    def start(self, boot_id: str | None = None) -> RealKubelet:
        """Start a new boot of the node: a new kubelet with boot ID `boot_id` (a new
        one if None; what it kept in /var/lib/kubelet stays, as on a real node's disk)."""
        binary = labnode()
        for part in ("var-lib-kubelet", "var-log", "sysctl"):
            (self.root / part).mkdir(parents=True, exist_ok=True)
        self.boot_id = boot_id or str(uuid.uuid4())
        (self.root / "boot_id").write_text(self.boot_id + "\n")
        q = shlex.quote
        mounts = [f"mount --bind {q(str(self.root / 'var-lib-kubelet'))} /var/lib/kubelet",
                  f"mount --bind {q(str(self.root / 'var-log'))} /var/log",
                  f"mount --bind {q(str(self.root / 'boot_id'))} /proc/sys/kernel/random/boot_id"]
        for key, value in SYSCTLS.items():
            held = self.root / "sysctl" / key.replace("/", ".")
            held.write_text(f"{value}\n")
            mounts.append(f"mount --bind {q(str(held))} /proc/sys/{key}")
        credential = self.plane.credential(f"kubelet-{self.name}", f"system:node:{self.name}",
                                           "system:nodes")
        config = self.root / "kubelet.json"
        config.write_text(json.dumps(self._config(), indent=2))
        cri = self.root / "cri.sock"
        # The mount point is made on the host, empty; what the kubelet writes lands
        # under root.
        script = " && ".join([
            "mkdir -p /var/lib/kubelet", *mounts,
            f"rm -f {q(str(cri))}",
            f"{{ {q(str(binary))} cri {q(str(cri))} >{q(str(self.root / 'cri.log'))} 2>&1 & }}",
            # The kubelet gives up at once on a runtime not yet listening.
            f"for i in $(seq 100); do [ -S {q(str(cri))} ] && break; sleep 0.1; done",
            f"exec {q(str(binary))} kubelet --config={q(str(config))} "
            f"--kubeconfig={q(str(credential))} --hostname-override={q(self.name)} --v=2"])
        with self.log_path.open("ab") as log:
            # A session of its own: stop() ends the kubelet and the runtime it started.
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        return self

    def _config(self) -> dict[str, Any]:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.root / 'cri.sock'}",
            "cgroupDriver": "cgroupfs", "failSwapOn": False, "failCgroupV1": False,
            "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "address": "127.0.0.1", "port": _free_port(), "healthzPort": 0,
            "readOnlyPort": 0,
            "authentication": {"anonymous": {"enabled": False},
                               "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.plane.pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "resolvConf": "/etc/resolv.conf",
        }
        if self.status_every is not None:
            every = f"{self.status_every:g}s"
            config["nodeStatusUpdateFrequency"] = config["nodeStatusReportFrequency"] = every
        if self.lease_seconds is not None:
            config["nodeLeaseDurationSeconds"] = self.lease_seconds
        return config

    def devices(self, resource: str, ids: list[str]) -> None:
        """Serve `ids` as `resource` through a device plugin registered with this
        kubelet (started the first time, its list rewritten after)."""
        listed = self.root / f"{resource.replace('/', '_')}.devices"
        tmp = listed.with_suffix(".tmp")
        tmp.write_text("".join(f"{i}\n" for i in ids))
        tmp.replace(listed)
        if resource in self.plugins and self.plugins[resource].poll() is None:
            return
        assert self.proc is not None
        log = (self.root / f"plugin-{resource.replace('/', '_')}.log").open("ab")
        with log:
            self.plugins[resource] = subprocess.Popen(
                ["nsenter", "-t", str(self.proc.pid), "-m", str(labnode()),
                 "device-plugin", resource, str(listed)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def dra(self, driver: str, gpus: list[tuple[str, str]], kubeconfig: Path) -> None:
        """Publish `gpus` ((device name, UUID) each) as `driver`'s pool for this node
        through a DRA kubelet plugin registered with this kubelet, which prepares them
        for pods (started the first time, its list rewritten after); `kubeconfig` is
        the driver's own credential, for its ResourceSlices."""
        key = f"dra:{driver}"
        listed = self.root / f"{driver}.dra"
        tmp = listed.with_suffix(".tmp")
        tmp.write_text("".join(f"{name} {uuid_}\n" for name, uuid_ in gpus))
        tmp.replace(listed)
        if key in self.plugins and self.plugins[key].poll() is None:
            return
        assert self.proc is not None
        with (self.root / f"plugin-{driver}.log").open("ab") as log:
            self.plugins[key] = subprocess.Popen(
                ["nsenter", "-t", str(self.proc.pid), "-m", str(labnode()), "dra-plugin",
                 driver, self.name, str(kubeconfig), str(listed)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the kubelet, its runtime and its plugins (a power-off: nothing is told)."""
        procs = [*self.plugins.values(), *([self.proc] if self.proc else [])]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.plugins.clear()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
