"""`make demo`: the real swap in the lab, with hostagent's journal printed as it comes.

gpu-node (the lendee, a Kubernetes worker) is lent gpu-a, gpu-b and gpu-c; `virsh start
gaming1` is deferred by the hook while the agent cordons and drains the node (a
PodDisruptionBudget makes one eviction wait), shuts gpu-node down through its guest
agent and starts gaming1, then starts gpu-node again with what gaming1 leaves: gpu-b and
gpu-c, verified in the guest, uncordoned. `virsh shutdown gaming1`; once no pod on the
node uses a GPU, gpu-node regrows (policy.regrow = when-idle): drained, restarted with
all three, verified, uncordoned. Every component is real, the Kubernetes control plane
too (etcd, kube-apiserver, controller-manager and scheduler of one release, built from
source: tests/controlplane), except the kubelets: there is no container runtime here, so
the lab plays gpu-node's, which follows the VM, and cpu-node's, through the API.

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

from tests.lab.cluster import LabCluster, close, lab_cluster, lab_plane
from tests.lab.lab import LENDEE, Lab, need_lab


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
    notes = {k: v for k, v in (kc.node()["metadata"].get("annotations") or {}).items()
             if k.startswith("hostagent.io/")}
    print(f"  (hostagent's annotations on {LENDEE}: {notes})", flush=True)


def wait_phase(lab: Lab, to: str, count: int, timeout: float = 120) -> float:
    start = time.monotonic()
    while len(lab.records(event="phase", to=to)) < count:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"gpu-node never reached {to}; phases: {lab.phases()}")
        time.sleep(0.1)
    return time.monotonic() - start


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
        say("Bringing up the lab: private libvirtd + journald, gpu-node, gaming1, gaming2")
        t = time.monotonic()
        lab.up()
        lab.reset()
        print(f"  lab up in {time.monotonic() - t:.1f}s; libvirt at {lab.uri}")
        t = time.monotonic()
        plane = lab_plane(lab)
        print(f"  Kubernetes control plane up in {time.monotonic() - t:.1f}s: kube-apiserver "
              f"{plane.version()} at {plane.server}", flush=True)
        with lab_cluster(lab) as kc:
            lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig))
            say("Starting hostagent; following its journal (journalctl -f, the lab's journald)")
            follow = subprocess.Popen(["journalctl", "-D", str(lab.root / "journal"), "-f",
                                       "-n", "0", "-o", "short-precise",
                                       "SYSLOG_IDENTIFIER=hostagent"])
            lab.start_agent()
            wait_phase(lab, "lent", 1)
            kc.wait_placed()
            shell(lab, "hostagent", "status")
            kubectl(kc)

            say("A player starts gaming1, whose GPU gpu-node holds")
            t = time.monotonic()
            shell(lab, "virsh", "start", "gaming1")
            lab.wait_game("gaming1")
            reclaim = time.monotonic() - t
            print(f"  gaming1 running {reclaim:.1f}s after `virsh start`", flush=True)
            wait_phase(lab, "lent", 2)
            partial = time.monotonic() - t
            print(f"  gpu-node lent again with what gaming1 leaves {partial:.1f}s after "
                  "`virsh start`", flush=True)
            shell(lab, "hostagent", "status")
            kubectl(kc)

            say("The game ends")
            lab.wait_agent("gaming1")
            t = time.monotonic()
            shell(lab, "virsh", "shutdown", "--mode", "agent", "gaming1")
            wait_phase(lab, "lent", 3)
            lend = time.monotonic() - t
            print(f"  gpu-node regrown to all its GPUs {lend:.1f}s after the shutdown "
                  f"(relend_delay 2s in the lab)", flush=True)
            shell(lab, "hostagent", "status")
            kubectl(kc)

        say("Phases, as recorded in the journal")
        for rec in lab.records(event="phase"):
            print(f"  {rec['HOSTAGENT_FROM']:>9} → {rec['HOSTAGENT_TO']:<9}"
                  f" after {int(rec['HOSTAGENT_DURATION_MS']) / 1000:6.2f}s  {rec['MESSAGE']}")
        print(f"\n  reclaim (virsh start → gaming1 running): {reclaim:.1f}s")
        print(f"  partial lend (virsh start → gpu-node lent gpu-b, gpu-c): {partial:.1f}s")
        print(f"  regrow (gaming1 shutdown → gpu-node lent all three): {lend:.1f}s")
        if opts.svg is not None:
            out = lab.hostagent("history", "--svg", str(opts.svg.resolve()))
            if out.returncode != 0:
                print(f"demo: hostagent history failed: {out.stderr.strip()}", file=sys.stderr)
                return 1
            print(f"\n  the timeline: {opts.svg}")
        return 0
    finally:
        time.sleep(0.3)  # let journalctl print the last lines
        if follow is not None:
            follow.terminate()
            follow.wait()
        close(lab)
        lab.down()


if __name__ == "__main__":
    sys.exit(main())
