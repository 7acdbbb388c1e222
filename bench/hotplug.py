"""Hot-plug on a busy lendee, timed in the lab: the holder scan and the live changes'
fallback rate.

    python -m bench.hotplug [--runs 3] [--markdown FILE]

gpu-node boots with ``hostagent.busy=5000`` on its kernel command line (the lab
guest's knob: 5,000 open files over 50 processes, as k3s, its containerd shims and a
training job's data loaders keep on a real node; tests/lab/guest/init).

- Holder scan: hostagent's look for the processes that hold a GPU's device node
  (`hostagent.service.hotplug.HOLDERS`: one ``ls -l`` of every /proc/PID/fd, filtered
  by awk), run in the guest through its agent, guest-exec to its exit as this bench
  sees it; beside the scan it replaced (a readlink per open file), once. The ratio is
  old / new. The release's whole bound is ``timeouts.release``.
- Fallback rate: with ``policy.hotplug = "both"``, the lab's control plane, a job on
  gpu-a and one on gpu-c, and the device plugin's stand-in holding every GPU in the
  guest (tests/lab/test_unplug_lab.py), each run asks gaming1 to start (gpu-a leaves the
  running lendee), then stops it (gpu-a comes back by hot-add). A run whose hot-unplug
  the journal records as failed fell back to the reclaim by restart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hostagent.core.config import Timeouts
from hostagent.service.hotplug import HOLDERS
from tests.lab.cluster import lab_cluster
from tests.lab.lab import LENDEE, Lab, need_lab
from tests.lab.plugins import GuestPlugins, daemonsets, operator_node
from tests.lab.helpers import define_lendee, gpu_pods

BUSY = 5000
# The scan hostagent ran before: a readlink per open file of the guest.
PER_FD = ('for f in /proc/[0-9]*/fd/*; do l=$(readlink "$f") || continue; '
          'for n; do [ "$l" = "$n" ] && echo "${f#/proc/}"; done; done; true')


def wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


def open_fds(lab: Lab) -> int:
    out = lab.guest_exec(LENDEE, "/bin/sh", "-c",
                         "ls /proc/[0-9]*/fd 2>/dev/null | grep -c '^[0-9]'").stdout
    return int(out.strip() or 0)


def timed(lab: Lab, script: str) -> float:
    began = time.monotonic()
    lab.guest_exec(LENDEE, "/bin/sh", "-c", script, "sh", "/dev/nvidia0", "/dev/nvidia1",
                   timeout=600)
    return time.monotonic() - began


def lent_all(lab: Lab) -> bool:
    done = lab.hostagent("status", "--json")
    return done.returncode == 0 and json.loads(done.stdout)["lendee"]["lent"] == [
        "gpu-a", "gpu-b", "gpu-c"]


def run(runs: int) -> tuple[list[float], float, int, list[str]]:
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-bench-")))
    outcomes: list[str] = []
    try:
        lab.up()
        lab.reset()
        with lab_cluster(lab, workloads=False) as kc:
            # The node as gpu-operator makes it: the device plugin's DaemonSet, a DCGM
            # exporter and GFD, each pod's process in the guest holding the GPUs.
            operator_node(kc)
            with GuestPlugins(lab, kc, daemonsets("operator")).running():
                lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
                    "[policy]\n", '[policy]\nhotplug = "both"\n') + '\n[verify]\ntimeout = "10s"\n')
                define_lendee(lab, f"hostagent.busy={BUSY}")
                lab.start_agent()
                wait_for(lambda: lab.records(event="phase", to="lent"), 300, "gpu-node lent")
                wait_for(lambda: open_fds(lab) >= BUSY, 120, f"{BUSY} open files in the guest")
                fds = open_fds(lab)
                new = [timed(lab, HOLDERS) for _ in range(5)]
                old = timed(lab, PER_FD)
                print(f"holder scan at {fds} fds: one scan median {statistics.median(new):.2f}s, "
                      f"per fd {old:.1f}s", file=sys.stderr)
                for n in range(runs):
                    wait_for(lambda: lent_all(lab), 300, "gpu-node lent all three GPUs")
                    jobs = {f"train-a{n}": "gpu-a", f"train-c{n}": "gpu-c"}
                    gpu_pods(lab, kc, jobs)
                    before = len(lab.records(event="hotplug", result="failed"))
                    lab.ask("gaming1")
                    lab.wait_record(300, event="intent", vm="gaming1", to="done")
                    failed = lab.records(event="hotplug", result="failed")[before:]
                    outcomes.append("restart" if failed else "live")
                    print(f"run {n + 1}/{runs}: gpu-a left gpu-node "
                          f"{'by restart: ' + failed[0]['MESSAGE'] if failed else 'live'}",
                          file=sys.stderr)
                    for job in jobs:
                        kc.delete_job(job)
                    lab.wait_agent("gaming1", timeout=120)
                    lab.virsh("shutdown", "--mode", "agent", "gaming1")
                    lab.wait_state("gaming1", "shut off", timeout=60)
    finally:
        lab.down()
    return new, old, fds, outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--markdown", type=Path, help="append the table to this file")
    opts = ap.parse_args()
    reason = need_lab()
    if reason:
        print(f"bench: {reason}", file=sys.stderr)
        return 1
    new, old, fds, outcomes = run(opts.runs)
    scan = statistics.median(new)
    fell_back = outcomes.count("restart")
    rows = [
        (f"holder scan at {fds:,} fds in the guest", f"median {scan * 1000:.0f} ms, "
         f"max {max(new) * 1000:.0f} ms",
         f"{len(new)} scans; bound {Timeouts().release:g} s (timeouts.release)"),
        ("the scan it replaced (a readlink per fd)", f"{old:.1f} s",
         f"{old / scan:.0f}x the one scan"),
        ("hot-unplugs that fell back to a restart", f"{fell_back} of {len(outcomes)}",
         f"{fell_back / len(outcomes):.0%}" if outcomes else ""),
    ]
    width = max(len(r[0]) for r in rows)
    for name, figure, note in rows:
        print(f"{name:<{width}}  {figure:<28}  {note}")
    if opts.markdown:
        with opts.markdown.open("a") as f:
            f.write(f"\n| hot-plug on a busy lendee ({BUSY:,} fds) | figure | note |\n"
                    "|---|---|---|\n")
            f.writelines(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
