"""NVIDIA's GPU plugins on the lab's lendee node, as their installs run them.

The DaemonSets are real objects run by the lab's real kube-controller-manager (a deleted
pod is made again at once, and a cordon does not stop it: kubernetes v1.35.4
pkg/controller/daemon, whose pods tolerate node.kubernetes.io/unschedulable) and
placed by the real kube-scheduler; what is stood in is each pod's process inside the
lendee's guest (`GuestPlugins`): for every pod of theirs running on gpu-node, a
process in the guest that opens every lab GPU's device node (/dev/nvidiaN, N as the
stand-in nvidia-smi's minor_number) and keeps it open while the pod runs, ended when
the pod is deleted or gone, as

- NVIDIA's device plugin does (k8s-device-plugin v0.17.4 internal/rm/health.go: NVML
  events registered on every device it serves, kept until the plugin stops);
- gpu-operator's DCGM exporter does (its DCGM host engine watches every GPU);
- GPU Feature Discovery does briefly at each labelling pass (its default
  ``--sleep-interval`` 60 s): here it opens every GPU for a moment each 60 s.

Three installs (`daemonsets`):

- "static": NVIDIA's static manifest (k8s-device-plugin v0.17.4 deployments/static/
  nvidia-device-plugin.yml): pods labelled ``name=nvidia-device-plugin-ds``, no node
  selection;
- "chart": NVIDIA's Helm chart (deployments/helm/nvidia-device-plugin v0.17.4: pods
  labelled ``app.kubernetes.io/name=nvidia-device-plugin`` and
  ``app.kubernetes.io/instance``, its values' required node affinity of three terms);
- "operator": gpu-operator's (assets/state-device-plugin, state-dcgm-exporter,
  gpu-feature-discovery at v26.7): ``app=nvidia-device-plugin-daemonset``,
  ``app=nvidia-dcgm-exporter`` and ``app=gpu-feature-discovery``, each selecting nodes
  by its ``nvidia.com/gpu.deploy.<operand>=true`` label, which the operator's node
  labelling sets on a GPU node (`OPERATOR_LABELS`, controllers/state_manager.go).

A pod leaves the API only once its process in the guest has ended, as the kubelet
deletes a pod only when its termination is finished, its containers stopped (kubernetes
v1.35.4 pkg/kubelet/status/status_manager.go: `canBeDeleted` waits for a terminal phase
and SyncTerminatedPod's end, then the delete of grace 0): the lab's kubelet knows
nothing of the guest's processes, so each pod whose process runs carries `FINALIZER`
until `GuestPlugins` has ended it.

`pausable` adds, to the static manifest's and the chart's, the term README gives so
that they honour ``nvidia.com/gpu.deploy.device-plugin`` as gpu-operator's do.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.lab.cluster import LabCluster, pod
from tests.lab.lab import LENDEE, Lab

DEVICE_PLUGIN = "nvidia.com/gpu.deploy.device-plugin"
GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
DCGM_EXPORTER = "nvidia.com/gpu.deploy.dcgm-exporter"
# What gpu-operator's node labelling puts on a GPU node for these operands.
OPERATOR_LABELS = {DEVICE_PLUGIN: "true", GFD: "true", DCGM_EXPORTER: "true"}
# README's term: the node stays eligible unless the label says "false".
PAUSABLE = {"key": DEVICE_PLUGIN, "operator": "NotIn", "values": ["false"]}
# The chart's values.yaml (v0.17.4): a node with an NVIDIA PCI device, or NVIDIA CPUs,
# or one labelled as having a GPU.
CHART_TERMS = [
    [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
      "values": ["true"]}],
    [{"key": "feature.node.kubernetes.io/cpu-model.vendor_id", "operator": "In",
      "values": ["NVIDIA"]}],
    [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}],
]
# Keeps a plugin pod in the API until its process in the guest has ended.
FINALIZER = "lab.hostagent/guest-process"
# The lab's nodes carry none of the chart's labels but the last, which GFD's stand-in
# (tests/controlplane/machine.py gpu_status) posts once the GPUs are seen.


def _daemonset(name: str, labels: dict[str, str], *, selector: dict[str, str] | None = None,
               terms: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    template = pod("", app=name)
    template["metadata"]["labels"] = dict(labels)
    spec = template["spec"]
    spec["tolerations"] += [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}]
    if selector:
        spec["nodeSelector"] = dict(selector)
    if terms:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": dict(labels)}, "template": template}}


@dataclass(frozen=True)
class Operand:
    """One DaemonSet of an install and how its process holds the GPUs."""

    manifest: dict[str, Any]
    every: float | None = None  # None: holds them all along; else opens them each `every` s

    @property
    def selector(self) -> dict[str, str]:
        labels: dict[str, str] = self.manifest["spec"]["selector"]["matchLabels"]
        return labels

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


def daemonsets(flavour: str, *, pausable: bool = True) -> list[Operand]:
    """The DaemonSets of `flavour` ("static", "chart", "operator"), see the docstring."""
    if flavour == "static":
        return [Operand(_daemonset("nvidia-device-plugin-daemonset",
                                   {"name": "nvidia-device-plugin-ds"},
                                   terms=[[PAUSABLE]] if pausable else None))]
    if flavour == "chart":
        terms = [[*t, PAUSABLE] for t in CHART_TERMS] if pausable else CHART_TERMS
        return [Operand(_daemonset("nvdp-nvidia-device-plugin", {
            "app.kubernetes.io/name": "nvidia-device-plugin",
            "app.kubernetes.io/instance": "nvdp"}, terms=terms))]
    if flavour == "operator":
        return [
            Operand(_daemonset("nvidia-device-plugin-daemonset",
                               {"app": "nvidia-device-plugin-daemonset"},
                               selector={DEVICE_PLUGIN: "true"})),
            Operand(_daemonset("nvidia-dcgm-exporter", {"app": "nvidia-dcgm-exporter"},
                               selector={DCGM_EXPORTER: "true"})),
            Operand(_daemonset("gpu-feature-discovery", {"app": "gpu-feature-discovery"},
                               selector={GFD: "true"}), every=60.0),
        ]
    raise ValueError(f"no such install: {flavour}")


# The lab GPUs' device nodes, made anew to match the disks the guest has now, in the
# stand-in nvidia-smi's order (its minor_number is the index): /dev/nvidiaN.
NODES = r"""
i=0
for b in /sys/block/vd*; do
    set -- $(head -c 200 /dev/${b##*/} 2>/dev/null | head -n 1)
    [ "$1" = LABGPU ] || continue
    dev=$(tr : ' ' < $b/dev)
    [ "$(stat -c '%t %T' /dev/nvidia$i 2>/dev/null)" = "$(printf '%x %x' $dev)" ] || {
        rm -f /dev/nvidia$i; mknod /dev/nvidia$i b $dev; }
    i=$((i+1))
done
while [ -e /dev/nvidia$i ]; do rm -f /dev/nvidia$i; i=$((i+1)); done
"""
# Once per pod: a start asked again (its answer lost while the guest agent was busy
# with another caller) answers the PIDs of the first.
# (`$1` and `$2` are kept first: NODES sets the positional parameters.)
ONCE = r"""
pidfile=$1 every=$2
if ! mkdir "$pidfile.once" 2>/dev/null; then
    for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
        [ -s "$pidfile" ] && break; sleep 0.1; done
    cat "$pidfile"; exit 0
fi
"""
# A holder: one process per GPU with its device node open; their PIDs, the first the
# group's leader. `$1`: the file the PIDs are written to.
HOLD = ONCE + NODES + r"""
setsid sh -c 'pids=$$; for n in /dev/nvidia[0-9]*; do [ -e "$n" ] || continue
    sleep 2147483647 <"$n" & pids="$pids $!"; done; echo $pids > "$1"; wait' sh "$pidfile" \
    </dev/null >/dev/null 2>&1 &
for i in 1 2 3 4 5 6 7 8 9 10; do [ -s "$pidfile" ] && break; sleep 0.1; done; cat "$pidfile"
"""
# A passing opener: every GPU opened for a moment each `$2` seconds.
PEEK = ONCE + NODES + r"""
setsid sh -c 'echo $$ > "$1"; while :; do for n in /dev/nvidia[0-9]*; do
    head -c 1 "$n" >/dev/null 2>&1; done; sleep "$2"; done' sh "$pidfile" "$every" \
    </dev/null >/dev/null 2>&1 &
for i in 1 2 3 4 5 6 7 8 9 10; do [ -s "$pidfile" ] && break; sleep 0.1; done; cat "$pidfile"
"""


@dataclass
class _Held:
    pod: str
    pids: list[str]
    boot: str


@dataclass
class GuestPlugins:
    """The processes in the lendee's guest of `operands`' pods on gpu-node (see the
    module docstring), followed by label until `stop`."""

    lab: Lab
    kc: LabCluster
    operands: list[Operand]
    held: dict[str, _Held] = field(default_factory=dict)  # pod UID -> its process
    started: list[tuple[str, float]] = field(default_factory=list)  # (pod, time.time())
    ended: list[str] = field(default_factory=list)  # pod names whose process was ended
    marked: dict[str, str] = field(default_factory=dict)  # pod UID -> name, with FINALIZER
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self) -> None:
        self.kc.create(*(o.manifest for o in self.operands))

    def holding(self) -> list[str]:
        """The pods whose process runs now."""
        with self._lock:
            return sorted(h.pod for h in self.held.values())

    def wait_holding(self, count: int, timeout: float = 90) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(found := self.holding()) < count:
            assert time.monotonic() < deadline, f"{found}: not {count} plugins holding the GPUs"
            time.sleep(0.2)
        return found

    def _operand(self, labels: dict[str, str]) -> Operand | None:
        return next((o for o in self.operands
                     if all(labels.get(k) == v for k, v in o.selector.items())), None)

    def _guest(self, *argv: str) -> str:
        return self.lab.guest_exec(LENDEE, *argv, timeout=10).stdout.strip()

    def _boot(self) -> str:
        return self._guest("cat", "/proc/sys/kernel/random/boot_id")

    def _finalizer(self, uid: str, name: str, on: bool) -> None:
        """`FINALIZER` put on pod `name` (`on`) or taken off; a pod gone is left so."""
        try:
            self.kc.plane.patch(f"/api/v1/namespaces/default/pods/{name}", {"metadata": {
                "uid": uid, "finalizers": [FINALIZER] if on else None}})
        except urllib.error.HTTPError as e:
            if on or e.code not in (404, 409):  # 409: the UID is another pod's now
                raise
        if on:
            self.marked[uid] = name
        else:
            self.marked.pop(uid, None)

    def _start(self, uid: str, name: str, operand: Operand) -> None:
        self._finalizer(uid, name, True)
        boot = self._boot()
        pidfile = f"/run/labplugin-{uid[:8]}"
        if operand.every is None:
            out = self._guest("/bin/sh", "-c", HOLD, "sh", pidfile)
        else:
            out = self._guest("/bin/sh", "-c", PEEK, "sh", pidfile, f"{operand.every:g}")
        pids = out.split()
        assert pids and all(p.isdigit() for p in pids), out
        with self._lock:
            self.held[uid] = _Held(name, pids, boot)
            self.started.append((name, time.time()))

    def _end(self, uid: str) -> None:
        held = self.held[uid]
        try:
            if self._boot() == held.boot:  # else gone with the boot that ran it
                self._guest("kill", "-9", *held.pids)
        except Exception:  # the guest agent busy or not up: the next step tries again
            if self.lab.virsh("domstate", LENDEE, check=False).stdout.strip() == "running":
                return
        with self._lock:
            del self.held[uid]
            self.ended.append(held.pod)
        self._finalizer(uid, held.pod, False)

    def _step(self) -> None:
        pods = self.kc.plane.get("/api/v1/namespaces/default/pods",
                                 fieldSelector=f"spec.nodeName={LENDEE}")["items"]
        live: set[str] = set()
        for p in pods:
            operand = self._operand(p["metadata"].get("labels") or {})
            if operand is None:
                continue
            uid, name = p["metadata"]["uid"], p["metadata"]["name"]
            if p["metadata"].get("deletionTimestamp"):
                continue  # the kubelet stops its containers at once
            live.add(uid)
            if uid not in self.held and p["status"].get("phase") == "Running":
                with contextlib.suppress(Exception):  # the guest not up yet: next time
                    self._start(uid, name, operand)
        for uid in [u for u in self.held if u not in live]:
            self._end(uid)
        for uid in [u for u in self.marked if u not in live and u not in self.held]:
            self._finalizer(uid, self.marked[uid], False)  # its process went with a boot

    def _rebooted(self) -> None:
        """Processes of an earlier boot are gone with it: started again for the pods."""
        with contextlib.suppress(Exception):
            boot = self._boot()
            with self._lock:
                for uid in [u for u, h in self.held.items() if h.boot != boot]:
                    del self.held[uid]

    def _follow(self) -> None:
        checked = 0.0
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self._step()
            if self.held and time.monotonic() - checked > 2:
                self._rebooted()
                checked = time.monotonic()
            self._stop.wait(0.2)

    @contextlib.contextmanager
    def running(self) -> Iterator[GuestPlugins]:
        """The DaemonSets created, their pods' processes followed while the block runs."""
        self.create()
        thread = threading.Thread(target=self._follow, name="lab plugins", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(30)
            for uid, name in list(self.marked.items()):
                self._finalizer(uid, name, False)


def operator_node(kc: LabCluster) -> None:
    """gpu-node labelled as gpu-operator's node labelling does a GPU node."""
    kc.kubectl("label", "node", LENDEE, "--overwrite",
               *(f"{k}={v}" for k, v in OPERATOR_LABELS.items()))
