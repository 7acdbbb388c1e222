"""`make demo`: the real swap in the lab, with two lendees, hostagent's journal printed as
it comes.

Two lendees, each a Kubernetes worker VM of its own: gpu-node is lent gpu-a and gpu-b,
gpu-node-b gpu-c; each node runs pods (gpu-node-b's hold its GPU). `virsh start gaming1`
is deferred by the hook while the agent cordons and drains gpu-node alone (a
PodDisruptionBudget makes one eviction wait), shuts it down through its guest agent and
starts gaming1, then starts gpu-node again with what gaming1 leaves: gpu-b, verified in
the guest, uncordoned. `virsh shutdown gaming1`; once no pod on the node uses a GPU,
gpu-node regrows (policy.regrow = when-idle): drained, restarted with both, verified,
uncordoned. gpu-node-b never notices: the demo prints its pods' start times before and
after, and fails (exit status 1) if any of them was restarted, or its node cordoned or
moved. Every component is real, the Kubernetes control plane too (etcd,
kube-apiserver, controller-manager and scheduler of one release, built from source:
tests/controlplane), except the kubelets: there is no container runtime here, so the
lab plays gpu-node-b's and cpu-node's through the API, and gpu-node's too where the
real kubelet cannot run (tests/lab/realnode.py).

    python -m tests.lab.demo [--svg FILE]

--svg draws the cycle from the demo's journal with `hostagent history --svg` (README's
docs/timeline.svg is drawn so).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.lab.cluster import LabCluster, close, deployment, lab_cluster, lab_plane, \
    usual_workloads
from tests.lab.helpers import OTHER, two_lendees
from tests.lab.lab import LENDEE, Lab, need_lab

# gpu-node-b serves GPU work only, as GPU nodes often do: a taint that only its pods
# tolerate keeps the usual workloads, and their replacements, off it.
GPU_ONLY = "nvidia.com/gpu=present:NoSchedule"
THEIRS = {"inference": 1, "queue": 0}  # gpu-node-b's Deployments: app -> GPUs


class NoticedError(RuntimeError):
    """gpu-node-b noticed gaming1's start: what the demo shows must not happen."""


def say(text: str) -> None:
    print(f"\n\033[1m{text}\033[0m", flush=True)


def shell(lab: Lab, *argv: str) -> subprocess.CompletedProcess[str]:
    print(f"$ {' '.join(argv)}", flush=True)
    if argv[0] == "virsh":
        out = lab.virsh(*argv[1:], check=False)
    else:
        out = lab.hostagent(*argv[1:])
    for text in (out.stdout.strip(), out.stderr.strip()):
        if text:
            print("  " + text.replace("\n", "\n  "), flush=True)
    return out


def kubectl(kc: LabCluster) -> None:
    """The cluster as `kubectl get nodes,pods -o wide` shows it, run for real against the
    lab's control plane with the same release's kubectl."""
    argv = ["get", "nodes,pods", "-o", "wide"]
    print(f"$ kubectl {' '.join(argv)}", flush=True)
    out = kc.plane.kubectl(*argv, check=False)
    print("  " + (out.stdout + out.stderr).strip().replace("\n", "\n  "), flush=True)
    for node in (LENDEE, OTHER):
        notes = {k: v for k, v in (kc.node(node)["metadata"].get("annotations") or {}).items()
                 if k.startswith("hostagent.io/")}
        print(f"  (hostagent's annotations on {node}: {notes})", flush=True)


def wait_phase(lab: Lab, to: str, count: int, timeout: float = 120, vm: str = LENDEE) -> float:
    start = time.monotonic()
    while len(lab.records(event="phase", to=to, vm=vm)) < count:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{vm} never reached {to}; phases: {lab.phases()}")
        time.sleep(0.1)
    return time.monotonic() - start


def their_pods(kc: LabCluster) -> dict[str, tuple[str, str]]:
    """gpu-node-b's pods, by app: (name, start time), each once it runs."""
    found = {app: kc.running_on(app, OTHER) for app in THEIRS}
    return {app: (p["metadata"]["name"], p["status"]["startTime"]) for app, p in found.items()}


def untouched(lab: Lab, kc: LabCluster, before: dict[str, tuple[str, str]],
              phases: int) -> None:
    """gpu-node-b's pods as they were (the same pods, started when they were), its node
    never cordoned, its machine never moved; else NoticedError."""
    now = their_pods(kc)
    for app, (name, started) in now.items():
        print(f"  {OTHER}: pod {name} started {started}"
              f" (before gaming1's start: {before[app][0]} started {before[app][1]})", flush=True)
    wrong = []
    if now != before:
        wrong.append(f"its pods were restarted: {before} became {now}")
    if kc.node(OTHER)["spec"].get("unschedulable"):
        wrong.append("its node was cordoned")
    moved = lab.records(event="phase", vm=OTHER)[phases:]
    if moved:
        wrong.append(f"its machine moved: {[r['MESSAGE'] for r in moved]}")
    if wrong:
        raise NoticedError(f"{OTHER} noticed gaming1's start: " + "; ".join(wrong))
    print(f"  {OTHER}: the same pods, started when they were; never cordoned; no transition",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--svg", type=Path, help="draw the cycle's timeline to this file")
    opts = ap.parse_args()
    reason = need_lab()
    if reason:
        print(f"demo: {reason}", file=sys.stderr)
        return 1
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-demo-")))
    follow: subprocess.Popen[bytes] | None = None
    try:
        say(f"Bringing up the lab: private libvirtd + journald, {LENDEE}, {OTHER}, gaming1, "
            "gaming2")
        t = time.monotonic()
        lab.up()
        lab.reset()
        print(f"  lab up in {time.monotonic() - t:.1f}s; libvirt at {lab.uri}")
        t = time.monotonic()
        plane = lab_plane(lab)
        print(f"  Kubernetes control plane up in {time.monotonic() - t:.1f}s: kube-apiserver "
              f"{plane.version()} at {plane.server}", flush=True)
        with lab_cluster(lab, workloads=False, others=(OTHER,)) as kc:
            lab.write_config(two_lendees(lab, lab.config_text(kubeconfig=kc.kubeconfig),
                                         ("gpu-c",), kubeconfig=kc.kubeconfigs[OTHER]))
            print(f"  {LENDEE} holds gpu-a and gpu-b, {OTHER} gpu-c (two [lendees.NAME])")
            kc.kubectl("taint", "node", OTHER, GPU_ONLY)
            kc.place(*usual_workloads(), pods=3)
            tolerate = [{"key": "hostagent.io/borrowed", "operator": "Exists"},
                        {"key": "nvidia.com/gpu", "operator": "Exists"}]
            kc.create(*(deployment(app, OTHER, gpus=gpus, tolerations=tolerate)
                        for app, gpus in THEIRS.items()))
            say("Starting hostagent; following its journal (journalctl -f, the lab's journald)")
            follow = subprocess.Popen(["journalctl", "-D", str(lab.root / "journal"), "-f",
                                       "-n", "0", "-o", "short-precise",
                                       "SYSLOG_IDENTIFIER=hostagent"])
            lab.start_agent()
            wait_phase(lab, "lent", 1)
            wait_phase(lab, "lent", 1, vm=OTHER)
            kc.wait_placed()
            before = their_pods(kc)
            phases = len(lab.records(event="phase", vm=OTHER))
            shell(lab, "hostagent", "status")
            kubectl(kc)

            say(f"A player starts gaming1, whose GPU {LENDEE} holds ({OTHER} holds none of it)")
            t = time.monotonic()
            shell(lab, "virsh", "start", "gaming1")
            lab.wait_game("gaming1")
            reclaim = time.monotonic() - t
            print(f"  gaming1 running {reclaim:.1f}s after `virsh start`", flush=True)
            wait_phase(lab, "lent", 2)
            partial = time.monotonic() - t
            print(f"  {LENDEE} lent again with what gaming1 leaves {partial:.1f}s after "
                  "`virsh start`", flush=True)
            shell(lab, "hostagent", "status")
            kubectl(kc)
            untouched(lab, kc, before, phases)

            say("The game ends")
            lab.wait_agent("gaming1")
            t = time.monotonic()
            shell(lab, "virsh", "shutdown", "--mode", "agent", "gaming1")
            wait_phase(lab, "lent", 3)
            lend = time.monotonic() - t
            print(f"  {LENDEE} regrown to all its GPUs {lend:.1f}s after the shutdown "
                  f"(relend_delay 2s in the lab)", flush=True)
            shell(lab, "hostagent", "status")
            kubectl(kc)
            untouched(lab, kc, before, phases)

        say("Phases, as recorded in the journal")
        for rec in lab.records(event="phase"):
            print(f"  {rec.get('HOSTAGENT_VM', ''):<10} {rec['HOSTAGENT_FROM']:>9} → "
                  f"{rec['HOSTAGENT_TO']:<9} after "
                  f"{int(rec['HOSTAGENT_DURATION_MS']) / 1000:6.2f}s  {rec['MESSAGE']}")
        print(f"\n  reclaim (virsh start → gaming1 running): {reclaim:.1f}s")
        print(f"  partial lend (virsh start → {LENDEE} lent gpu-b): {partial:.1f}s")
        print(f"  regrow (gaming1 shutdown → {LENDEE} lent gpu-a and gpu-b): {lend:.1f}s")
        print(f"  {OTHER}: lent gpu-c throughout, its pods never restarted")
        if opts.svg is not None:
            out = lab.hostagent("history", "--svg", str(opts.svg.resolve()))
            if out.returncode != 0:
                print(f"demo: hostagent history failed: {out.stderr.strip()}", file=sys.stderr)
                return 1
            print(f"\n  the timeline: {opts.svg}")
        return 0
    except NoticedError as e:
        print(f"\ndemo: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        time.sleep(0.3)  # let journalctl print the last lines
        if follow is not None:
            follow.terminate()
            follow.wait()
        close(lab)
        lab.down()


if __name__ == "__main__":
    sys.exit(main())
