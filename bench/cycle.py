"""The partial swap, timed in the lab: what hostagent adds on top of the steps that
take the time anyway (the drain, the guests' own shutdown and boot, the cluster).

    python -m bench.cycle [--cycles 5] [--markdown FILE]

Each cycle runs the real swap of `make demo`: gpu-node (the lendee, a node of the lab's
real Kubernetes control plane, with three pods of a Deployment and a StatefulSet on it,
two of them behind a PodDisruptionBudget) is lent gpu-a, gpu-b and gpu-c; `virsh start
gaming1` (gpu-a) is deferred by the hook while the agent drains the node, shuts
gpu-node down through its guest agent and starts gaming1 (the reclaim); the agent
starts gpu-node again with gpu-b and gpu-c up to the uncordon (the partial lend);
three pods land on it again;
then `virsh shutdown --mode agent gaming1`, and once relend_delay has passed (no pod
on the node requests a GPU: policy.regrow = when-idle begins at once) the agent drains
gpu-node, shuts it down and starts it with all three up to the uncordon (the regrow).
Every boundary is taken from the component that does the step, never from hostagent's
own journal:

- the bench's own libvirt connection: lifecycle events (gaming1 RESUMED and STARTED)
  and guest-agent lifecycle events (qemu-ga connected its port);
- libvirtd's debug log for the guest agent (`qemu.qemu_agent`, switched on at run
  time through virt-admin): when libvirt sent `guest-shutdown`;
- each domain's QEMU log, written by libvirtd: "starting up" (libvirt launches QEMU,
  after the `prepare` and `start` hooks) and "shutting down" (QEMU has exited);
- the Kubernetes API: when each request of the agent's arrived (the lab's fault proxy,
  which passes them on untouched) and when the bench's own watch of nodes and pods
  (as the admin, straight to kube-apiserver) saw each change.

Reclaim: `virsh start gaming1` → gaming1's STARTED event. Inherent:
  drain     first eviction request → the last evicted pod gone (as the API server saw
            it); with drain.shutdown_when = "accepted" (the default), whose shutdown
            begins once every eviction is accepted, → the last eviction request
  the guest agent's turn, then its ping
            the agent's journal says it asks for the shutdown → libvirt sends
            guest-shutdown: libvirt runs one guest-agent command at a time (the lab
            kubelet's nvidia-smi, each second, may hold it) and the guest-ping first
  shutdown  libvirt sends guest-shutdown → gpu-node's QEMU has exited
  start     libvirt launches gaming1's QEMU → gaming1's vCPUs run (RESUMED)
Partial lend: gaming1's STARTED event → the node uncordoned with two GPUs (as the API
server saw it). Inherent:
  boot           libvirt launches gpu-node's QEMU → its guest agent connects
  cluster        then → the node Ready with every lent GPU allocatable (the lab
                 kubelet's own pace; 0 if it was already so)
Regrow: gaming1's QEMU has exited → the node uncordoned with three GPUs. Inherent:
  relend_delay   the configured pause before lending again (policy.relend_delay),
                 twice: after the game stopped, and after the lendee stopped (as after
                 any stop of the lendee that no owner waits on)
  drain, shutdown, boot, cluster as above
Overhead = total − inherent: every hook run in those paths, the agent's reactions,
its API calls, its in-guest GPU check, libvirt's own bookkeeping between steps.
hostagent's part = overhead − the lab proxy's share: the agent reaches the API server
through the lab's fault proxy (tests/controlplane/proxy.py, Python, on the loop of the
lab's kubelets), which a real cluster does not have. Its own cost per request is
measured apart (a GET of the node through it and straight to kube-apiserver,
alternated: the difference of the medians), and counted once for each request of the
agent that the proxy passed on within the leg's overhead gaps (watches and Events go
beside the path and are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import libvirt

from tests.controlplane import ControlPlane
from tests.lab.cluster import LabCluster, lab_cluster, statefulset, usual_workloads
from tests.lab.lab import LENDEE, Lab, need_lab

OWNER = "gaming1"
# hostagent's own part of each leg: its overhead less what the lab's fault proxy adds to
# each of the agent's requests on that path (a real cluster has no such proxy).
BUDGET_S = 0.1
# libvirt's timestamps: "2026-01-02 03:04:05.678+0000: ..." (UTC, milliseconds).
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\+\d{4}): (.*)$")


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f%z").timestamp()


def log_lines(path: Path) -> list[tuple[float, str]]:
    """(time, rest of the line) for each timestamped line of a libvirt log."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m:
            out.append((stamp(m[1]), m[2]))
    return out


class Events:
    """The bench's own libvirt connection: lifecycle and guest-agent events, timed on
    arrival (time.time())."""

    def __init__(self, uri: str) -> None:
        libvirt.virEventRegisterDefaultImpl()
        self.seen: list[tuple[float, str, str]] = []  # (time, domain, what)
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.conn = libvirt.open(uri)
        names = {libvirt.VIR_DOMAIN_EVENT_STARTED: "started",
                 libvirt.VIR_DOMAIN_EVENT_RESUMED: "resumed"}

        def lifecycle(_c: Any, dom: Any, event: int, _detail: int, _o: Any) -> None:
            if event in names:
                self._add(dom.name(), names[event])

        def agent(_c: Any, dom: Any, state: int, _reason: int, _o: Any) -> None:
            if state == libvirt.VIR_CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_STATE_CONNECTED:
                self._add(dom.name(), "agent-connected")

        self.conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                         lifecycle, None)
        self.conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_AGENT_LIFECYCLE,
                                         agent, None)

    def _run(self) -> None:
        while not self._stop:
            libvirt.virEventRunDefaultImpl()

    def _add(self, dom: str, what: str) -> None:
        with self._lock:
            self.seen.append((time.time(), dom, what))
            self._lock.notify_all()

    def wait(self, dom: str, what: str, after: float, timeout: float = 180) -> float:
        deadline = time.monotonic() + timeout
        with self._lock:
            while (t := self._first(dom, what, after)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} event for {dom} within {timeout:g}s")
                self._lock.wait(left)
        return t

    def _first(self, dom: str, what: str, after: float) -> float | None:
        return next((t for t, d, w in self.seen if d == dom and w == what and t >= after), None)

    def close(self) -> None:
        self._stop = True
        # A timer wakes virEventRunDefaultImpl so that the thread sees _stop.
        libvirt.virEventAddTimeout(0, lambda *_: None, None)
        self._thread.join(5)
        self.conn.close()


@dataclass
class Leg:
    """One leg of a cycle: its total, {inherent step: seconds}, {overhead gap: (from,
    to)}, and how many of the agent's requests the lab proxy passed on in those gaps."""

    total: float = 0.0
    at: float = 0.0  # when it began (time.time())
    steps: dict[str, float] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    requests: int = 0

    @property
    def gaps(self) -> dict[str, float]:
        return {name: end - start for name, (start, end) in self.spans.items()}

    @property
    def overhead(self) -> float:
        return self.total - sum(self.steps.values())


LEGS = ("reclaim", "partial lend", "regrow")


def seed(kc: LabCluster, tag: str, first: bool) -> None:
    """Pods on gpu-node before a drain: a Deployment's pod and two StatefulSet pods
    behind a PodDisruptionBudget of their own (minAvailable 1: the second eviction waits
    until the first one's replacement is Ready elsewhere), and once a DaemonSet. None
    requests a GPU (a when-idle regrow does not wait for them). The earlier ones,
    replaced on cpu-node, stay there under other labels and budgets."""
    web, daemons = usual_workloads()[0], usual_workloads()[-1:] if first else []
    web["metadata"]["name"] = f"web-{tag}"
    web["spec"]["selector"]["matchLabels"]["app"] = f"web-{tag}"
    web["spec"]["template"]["metadata"]["labels"]["app"] = f"web-{tag}"
    kc.place(web, *statefulset(f"trainer-{tag}", 2, min_available=1), *daemons, pods=3)


@dataclass
class Change:
    at: float  # when the bench's watch saw it (time.time())
    kind: str  # "nodes" or "pods"
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


class Changes:
    """Every change to nodes and pods, as the bench's own watches (the admin's, straight
    to kube-apiserver) see them, on the loop of the lab's kubelets."""

    def __init__(self, kc: LabCluster) -> None:
        self.seen: list[Change] = []
        self._lock = threading.Lock()
        self._watches = [asyncio.run_coroutine_threadsafe(self._watch(kc.plane, kind), kc.loop)
                         for kind in ("nodes", "pods")]

    def since(self, after: float) -> list[Change]:
        with self._lock:
            return [c for c in self.seen if c.at >= after]

    def close(self) -> None:
        for w in self._watches:
            w.cancel()

    async def _watch(self, plane: ControlPlane, kind: str) -> None:
        context = ssl.create_default_context(cafile=str(plane.pki / "ca.crt"))
        context.load_cert_chain(plane.pki / "admin.crt", plane.pki / "admin.key")
        last: dict[str, dict[str, Any]] = {}
        version = ""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            while True:
                url = f"{plane.server}/api/v1/{kind}?watch=1&resourceVersion={version}"
                async with s.get(url, ssl=context) as reply:
                    async for line in reply.content:
                        event = json.loads(line)
                        obj = event["object"]
                        if event["type"] == "ERROR":  # 410: start again from now
                            version = ""
                            break
                        version = obj["metadata"]["resourceVersion"]
                        key = f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
                        old = last.pop(key, None) if event["type"] == "DELETED" else last.get(key)
                        if event["type"] != "DELETED":
                            last[key] = obj
                        with self._lock:
                            self.seen.append(Change(time.time(), kind, event["type"], obj, old))


def node_ok(node: dict[str, Any], gpus: int) -> bool:
    ready = any(c["type"] == "Ready" and c["status"] == "True"
                for c in node["status"].get("conditions", []))
    return ready and node["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(gpus)


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)
    return value


def qemu_log(lab: Lab, dom: str, text: str, after: float) -> float:
    """When libvirt wrote `text` in `dom`'s QEMU log, first time at or after `after`."""
    path = lab.root / "log-libvirt" / "qemu" / f"{dom}.log"
    return wait_for(lambda: next((t for t, rest in log_lines(path)
                                  if rest.startswith(text) and t >= after - 0.001), None),
                    10, f"{text!r} in {path}")


def last_launch(lab: Lab, dom: str, after: float, before: float) -> float:
    """When libvirt last launched `dom`'s QEMU between `after` and `before`: the launch
    that ran. An earlier one may have failed (a hook that ran out of its budget on a
    busy machine lets a start through, and QEMU refuses the device in use)."""
    path = lab.root / "log-libvirt" / "qemu" / f"{dom}.log"
    def last() -> float | None:
        return max((t for t, rest in log_lines(path)
                    if rest.startswith("starting up") and after - 0.001 <= t <= before),
                   default=None)
    return wait_for(last, 10, f"a launch of {dom} in {path}")


def libvirtd_log(lab: Lab, text: str, after: float) -> float:
    path = lab.root / "log-libvirt" / "libvirtd.log"
    return wait_for(lambda: next((t for t, rest in log_lines(path)
                                  if text in rest and t >= after - 0.001), None),
                    10, f"{text!r} in {path}")


def drain_span(kc: LabCluster, seen: Changes, after: float,
               shutdown: float | None = None) -> tuple[float, float]:
    """(first eviction request, the drain's end) of the drain begun after `after`: the
    last evicted pod gone; or, where the lendee's shutdown was sent before that
    (`shutdown`: drain.shutdown_when = "accepted"), when the API server's last 201 to
    an eviction was out (the pods stop during the shutdown). An eviction of a pod
    behind a budget may take the API server half a second or more to accept: it
    retries the budget's update when it conflicts (pkg/registry/core/pod/storage/
    eviction.go, EvictionsRetry), which is the drain's time, not the agent's."""
    evictions = [t for t, _ in kc.call(kc.api.requests_at, "POST", "/eviction") if t >= after]
    gone = [ch.at for ch in seen.since(after) if ch.kind == "pods" and ch.type == "DELETED"
            and ch.obj["spec"].get("nodeName") == LENDEE]
    if shutdown is not None and max(gone, default=shutdown) > shutdown:
        accepted = [out for m, p, at, out, code in kc.call(list, kc.api.answers)
                    if m == "POST" and p.endswith("/eviction") and code == 201
                    and after <= at and out <= shutdown]
        return min(evictions), max(accepted)
    return min(evictions), max(gone)


def uncordoned_after(seen: Changes, after: float) -> float:
    """When the first uncordon of the node after `after` was seen."""
    return wait_for(lambda: next(
        (ch.at for ch in seen.since(after) if ch.kind == "nodes" and ch.type == "MODIFIED"
         and ch.obj["metadata"]["name"] == LENDEE
         and (ch.old or {}).get("spec", {}).get("unschedulable")
         and not ch.obj["spec"].get("unschedulable")), None), 180, "the uncordon")


def back(lab: Lab, seen: Changes, ev: Events, after: float, gpus: int,
         uncordoned: float) -> tuple[float, float, float]:
    """(gpu-node's QEMU launched, its guest agent connected, the node Ready with `gpus`
    GPUs) of the lend that ended with the uncordon at `uncordoned`. The last time the
    node became so before the uncordon: the lab kubelet may post a stale GPU count
    while the guest boots, and that one is not it."""
    launch = last_launch(lab, LENDEE, after, uncordoned)
    agent_up = ev.wait(LENDEE, "agent-connected", launch)
    ready = max(ch.at for ch in seen.since(launch)
                if ch.kind == "nodes" and ch.obj["metadata"]["name"] == LENDEE
                and ch.at <= uncordoned and node_ok(ch.obj, gpus)
                and not node_ok(ch.old or {"status": {}}, gpus))
    return launch, agent_up, ready


def reclaim(lab: Lab, kc: LabCluster, seen: Changes, ev: Events) -> tuple[Leg, float]:
    """The reclaim leg, and when gaming1's STARTED event came."""
    t0 = time.time()
    out = lab.virsh("start", OWNER, check=False)
    if out.returncode == 0:
        raise RuntimeError(f"virsh start {OWNER} was not deferred: the lendee was not lent")
    started = ev.wait(OWNER, "started", t0)
    resumed = ev.wait(OWNER, "resumed", t0)
    shutdown_sent = libvirtd_log(lab, '"execute":"guest-shutdown"', t0)
    first_eviction, last_gone = drain_span(kc, seen, t0, shutdown_sent)
    lendee_exit = qemu_log(lab, LENDEE, "shutting down", t0)
    owner_launch = last_launch(lab, OWNER, t0, resumed)
    asked = stopping_asked(lab, t0, shutdown_sent)
    return Leg(
        total=started - t0, at=t0,
        steps={"drain": last_gone - first_eviction,
               "the guest agent's turn, then its ping": max(0.0, shutdown_sent - asked),
               "guest shutdown": lendee_exit - shutdown_sent,
               "owner start": resumed - owner_launch},
        spans={"virsh start → first eviction": (t0, first_eviction),
               "drain's end → the agent asks for the shutdown": (last_gone,
                                                                 max(last_gone, asked)),
               "lendee exited → owner's QEMU launched": (lendee_exit, owner_launch),
               "owner running → STARTED event": (resumed, started)},
    ), started


def stopping_asked(lab: Lab, after: float, sent: float) -> float:
    """When the agent's journal says the lendee is drained and its shutdown asked (the
    phase record "stopping", as journald stored it): from then until libvirt sends
    guest-shutdown, the guest agent's turn (libvirt runs one agent command at a time,
    and the lab's kubelet asks the guest's nvidia-smi through it every second) and the
    guest-ping that invariant 3 requires."""
    return wait_for(lambda: next((int(e["__REALTIME_TIMESTAMP"]) / 1e6
                                  for e in lab.records(event="phase", to="stopping")
                                  if after <= int(e["__REALTIME_TIMESTAMP"]) / 1e6 <= sent),
                                 None), 10, "the agent's stopping record")


def partial_lend(lab: Lab, seen: Changes, ev: Events, started: float) -> Leg:
    """gaming1 runs: gpu-node starts again with gpu-b and gpu-c, up to the uncordon."""
    uncordoned = uncordoned_after(seen, started)
    launch, agent_up, ready = back(lab, seen, ev, started, 2, uncordoned)
    return Leg(
        total=uncordoned - started, at=started,
        steps={"lendee boot to guest agent": agent_up - launch,
               "Ready and GPUs after that": max(0.0, ready - agent_up)},
        spans={"owner's STARTED event → lendee launched": (started, launch),
               "node Ready with GPUs → uncordoned": (max(agent_up, ready), uncordoned)},
    )


def regrow(lab: Lab, kc: LabCluster, seen: Changes, ev: Events, relend_delay: float) -> Leg:
    """gaming1 shuts down: after relend_delay gpu-node is drained, shut down and started
    with all three GPUs, up to the uncordon."""
    t1 = time.time()
    out = lab.virsh("shutdown", "--mode", "agent", OWNER, check=False)
    # qemu-ga may power the guest off before its answer is out: the shutdown goes on.
    if out.returncode != 0 and "End of file from agent socket" not in out.stderr:
        raise RuntimeError(f"virsh shutdown {OWNER} failed: {out.stderr.strip()}")
    owner_exit = qemu_log(lab, OWNER, "shutting down", t1)
    uncordoned = uncordoned_after(seen, owner_exit)
    first_eviction, last_gone = drain_span(kc, seen, owner_exit)
    shutdown_sent = libvirtd_log(lab, '"execute":"guest-shutdown"', owner_exit)
    lendee_exit = qemu_log(lab, LENDEE, "shutting down", owner_exit)
    launch, agent_up, ready = back(lab, seen, ev, lendee_exit, 3, uncordoned)
    return Leg(
        total=uncordoned - owner_exit, at=owner_exit,
        steps={"relend_delay after the game": relend_delay,
               "drain": last_gone - first_eviction,
               "guest shutdown": lendee_exit - shutdown_sent,
               "relend_delay after the lendee stopped": relend_delay,
               "lendee boot to guest agent": agent_up - launch,
               "Ready and GPUs after that": max(0.0, ready - agent_up)},
        spans={"owner exited → first eviction, beyond relend_delay":
               (owner_exit + relend_delay, first_eviction),
               "last pod gone → guest-shutdown sent": (last_gone, shutdown_sent),
               "lendee exited → lendee launched, beyond relend_delay":
               (lendee_exit + relend_delay, launch),
               "node Ready with GPUs → uncordoned": (max(agent_up, ready), uncordoned)},
    )


def timeline(lab: Lab, kc: LabCluster, name: str, start: float, end: float) -> None:
    """What happened in a leg, in order, on stderr (`--timeline`): each request of the
    agent as the proxy saw it arrive, each journal record of the agent as journald
    stored it, in ms from the leg's start. For finding what is on the path."""
    lines = [(t, f"{m} {p.split('?')[0]}{' (watch)' if 'watch=' in p else ''}")
             for m, p, t in list(kc.api.requests) if start <= t <= end]
    lines += [(int(e["__REALTIME_TIMESTAMP"]) / 1e6,
               f"journal {e.get('HOSTAGENT_EVENT', '')}: {str(e.get('MESSAGE', ''))[:90]}")
              for e in lab.records() if start <= int(e["__REALTIME_TIMESTAMP"]) / 1e6 <= end]
    print(f"-- {name}", file=sys.stderr)
    for t, what in sorted(lines):
        print(f"  {(t - start) * 1000:8.1f} ms  {what}", file=sys.stderr)


def enable_agent_log(lab: Lab) -> None:
    """libvirtd's guest-agent commands into /var/log/libvirt/libvirtd.log (the lab's
    log-libvirt/), switched on at run time: the rest of its logging is unchanged."""
    admin = f"libvirtd:///system?socket={lab.root}/run-libvirt/libvirt-admin-sock"
    for args in (("daemon-log-filters", "1:qemu.qemu_agent"),
                 ("daemon-log-outputs", "1:file:/var/log/libvirt/libvirtd.log 3:stderr")):
        subprocess.run(["virt-admin", "-c", admin, *args], check=True, capture_output=True)


def on_path(kc: LabCluster, leg: Leg) -> int:
    """How many of the agent's requests the proxy passed on within the leg's overhead
    gaps: watches and Events left out (they go beside the path, never awaited on it)."""
    return sum(1 for _, path, t in list(kc.api.requests)
               if "watch=" not in path and "/events" not in path
               and any(start <= t < end for start, end in leg.spans.values()))


def proxy_cost(kc: LabCluster, rounds: int = 60) -> float:
    """The lab proxy's own cost per request, in seconds: the median time of a GET of
    gpu-node through it less the median straight to kube-apiserver, over one kept-alive
    TLS connection each as the agent's client keeps, alternated, the first of each
    left out (its handshake)."""
    async def measure() -> float:
        context = ssl.create_default_context(cafile=str(kc.plane.pki / "ca.crt"))
        context.load_cert_chain(kc.plane.pki / "admin.crt", kc.plane.pki / "admin.key")
        took: dict[str, list[float]] = {"proxy": [], "direct": []}
        async with aiohttp.ClientSession() as session:
            for n in range(rounds + 1):
                for name, base in (("proxy", kc.api.url), ("direct", kc.plane.server)):
                    began = time.perf_counter()
                    async with session.get(f"{base}/api/v1/nodes/{LENDEE}", ssl=context) as r:
                        await r.read()
                    if n:
                        took[name].append(time.perf_counter() - began)
        return statistics.median(took["proxy"]) - statistics.median(took["direct"])
    return asyncio.run(measure())


def run(cycles: int, show: bool = False) -> tuple[list[dict[str, Leg]], float]:
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-bench-")))
    relend_delay = 2.0
    done: list[dict[str, Leg]] = []
    try:
        lab.up()
        lab.reset()
        enable_agent_log(lab)
        ev = Events(lab.uri)
        try:
            with lab_cluster(lab, workloads=False) as kc:
                seen = Changes(kc)
                print(f"kube-apiserver {kc.plane.version()}", file=sys.stderr)
                lab.write_config(lab.config_text(relend_delay=f"{relend_delay:g}s",
                                                 kubeconfig=kc.kubeconfig))
                lab.start_agent()
                for n in range(cycles):
                    # Each cycle lends twice: the partial lend and the regrow.
                    seed(kc, f"{n}", first=n == 0)
                    wait_for(lambda n=n: len(lab.records(event="phase", to="lent")) > 2 * n, 180,
                             "gpu-node lent")
                    wait_for(lambda: not kc.node()["spec"].get("unschedulable"), 60,
                             "the node uncordoned")
                    kc.wait_placed()
                    legs: dict[str, Leg] = {}
                    legs["reclaim"], started = reclaim(lab, kc, seen, ev)
                    legs["partial lend"] = partial_lend(lab, seen, ev, started)
                    wait_for(lambda n=n: len(lab.records(event="phase", to="lent")) > 2 * n + 1,
                             60, "gpu-node lent gpu-b and gpu-c")
                    seed(kc, f"{n}r", first=False)
                    kc.wait_placed()
                    lab.wait_agent(OWNER)  # `virsh shutdown --mode agent` needs it
                    legs["regrow"] = regrow(lab, kc, seen, ev, relend_delay)
                    for leg in legs.values():
                        leg.requests = on_path(kc, leg)
                    done.append(legs)
                    if show:
                        for name, leg in legs.items():
                            timeline(lab, kc, name, leg.at, leg.at + leg.total)
                    print(f"cycle {n + 1}/{cycles}: " + "; ".join(
                        f"{name} {leg.total:.2f}s (overhead {leg.overhead * 1000:.0f} ms: "
                        + ", ".join(f"{k} {v * 1000:.0f}" for k, v in {**leg.steps,
                                                                      **leg.gaps}.items())
                        + f"; {leg.requests} requests on the path)"
                        for name, leg in legs.items()), file=sys.stderr)
                cost = proxy_cost(kc)
        finally:
            ev.close()
    finally:
        lab.down()
    return done, cost


def ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def table(cycles: list[dict[str, Leg]], cost: float) -> list[tuple[str, str, str]]:
    def stat(values: list[float], unit: Callable[[float], str] = ms) -> str:
        return f"median {unit(statistics.median(values))}, max {unit(max(values))}"

    rows: list[tuple[str, str, str]] = [
        ("the lab proxy's own cost per request", f"{cost * 1000:.1f} ms",
         "median GET of the node through it, less straight to kube-apiserver")]
    for name in LEGS:
        legs = [c[name] for c in cycles]
        totals = [leg.total for leg in legs]
        overheads = [leg.overhead for leg in legs]
        rows.append((f"{name}: total", stat(totals, lambda s: f"{s:.2f} s"),
                     f"{len(cycles)} cycles"))
        for step in legs[0].steps:
            rows.append((f"{name}: inherent: {step}",
                         stat([leg.steps[step] for leg in legs]), ""))
        rows.append((f"{name}: overhead", stat(overheads),
                     f"of which the lab proxy: {statistics.median(leg.requests for leg in legs):g}"
                     " requests on the path, median"))
        own = [leg.overhead - leg.requests * cost for leg in legs]
        worst = max(own)
        rows.append((f"{name}: hostagent's part", stat(own),
                     f"budget < {BUDGET_S * 1000:.0f} ms: "
                     f"{'met' if worst < BUDGET_S else 'MISSED'}"))
        ratios = [leg.total / sum(leg.steps.values()) for leg in legs]
        rows.append((f"{name}: total / inherent", f"median {statistics.median(ratios):.3f}, "
                     f"max {max(ratios):.3f}", ""))
        for gap in legs[0].gaps:
            rows.append((f"{name}: of the overhead: {gap}",
                         stat([leg.gaps[gap] for leg in legs]), ""))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--markdown", type=Path, help="append the table to this file")
    ap.add_argument("--timeline", action="store_true",
                    help="print each leg's requests and journal records (stderr)")
    opts = ap.parse_args()
    reason = need_lab()
    if reason:
        print(f"bench: {reason}", file=sys.stderr)
        return 1
    rows = table(*run(opts.cycles, opts.timeline))
    width = max(len(r[0]) for r in rows)
    for name, figure, note in rows:
        print(f"{name:<{width}}  {figure:<28}  {note}")
    if opts.markdown:
        with opts.markdown.open("a") as f:
            f.write("\n| the partial swap | figure | note |\n|---|---|---|\n")
            f.writelines(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
