"""What it costs the lab to play a node with the real kubelet: a measured run, not a test.

    flock /tmp/lab.lock .venv/bin/python -m tests.controlplane.labnode.spike [--idle 60]

Starts a lab control plane and one RealKubelet (tests/controlplane/realkubelet.py) and
prints, as it goes: time from the kubelet's start to its node registered and Ready;
the kubelet's and the fake runtime's CPU while idle; a pod's time to Running; a device
plugin's time to allocatable; a GPU pod; a pod's deletion; what a restart (a new boot)
does to Ready, bootID, allocatable, a GPU pod and the node's ResourceSlices; a second
node beside the first, each with its own device plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.controlplane import ControlPlane
from tests.controlplane.realkubelet import RealKubelet, former_slice, missing

NODE = "lab-node"
T0 = time.monotonic()


def say(what: str) -> None:
    print(f"[{time.monotonic() - T0:7.2f}s] {what}", flush=True)


def wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if check():
                took = time.monotonic() - start
                say(f"{what}: {took:.2f} s")
                return took
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def node(plane: ControlPlane) -> Any:
    return plane.get(f"/api/v1/nodes/{NODE}")


def ready(plane: ControlPlane) -> str:
    try:
        conditions = node(plane)["status"].get("conditions") or []
    except OSError:
        return "absent"
    return next((c["status"] for c in conditions if c["type"] == "Ready"), "none")


def cpu(pid: int) -> float:
    """User and system CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(pid: int) -> int:
    """The fake runtime: the one child of the kubelet's session besides it."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid:
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[3]) == pid and "labnode" in (entry / "cmdline").read_text():
                return int(entry.name)
    raise LookupError("no fake runtime found")


def pod(plane: ControlPlane, name: str, gpus: int = 0) -> None:
    container: dict[str, Any] = {"name": "main", "image": "registry.k8s.io/pause:3.10"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    plane.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "containers": [container]}}))


def phase(plane: ControlPlane, name: str) -> str:
    return str(plane.get(f"/api/v1/namespaces/default/pods/{name}")["status"].get("phase"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of idle CPU sampled")
    args = parser.parse_args()
    if why := missing():
        sys.exit(why)
    root = Path(tempfile.mkdtemp(prefix="labnode-"))
    say(f"root {root}")
    plane = ControlPlane(root / "plane").start()
    say(f"control plane {plane.version()} up")
    kubelet = RealKubelet(plane, NODE, root / "node")
    try:
        run(plane, kubelet, args.idle)
    except Exception:
        say("FAILED; kubelet log tail:\n" + kubelet.log()[-6000:])
        raise
    finally:
        kubelet.stop()
        plane.stop()
        say(f"logs kept in {root}")


def run(plane: ControlPlane, kubelet: RealKubelet, idle: float) -> None:
    start = time.monotonic()
    kubelet.start()
    assert kubelet.proc is not None
    wait("kubelet start -> node registered", lambda: ready(plane) != "absent")
    wait("kubelet start -> node Ready=True", lambda: ready(plane) == "True")
    say(f"  (from start: {time.monotonic() - start:.2f} s)")
    info = node(plane)["status"]["nodeInfo"]
    say(f"nodeInfo: {info}")
    say(f"bootID is this boot's: {info['bootID'] == kubelet.boot_id}")
    say(f"allocatable: {node(plane)['status']['allocatable']}")

    pod(plane, "plain")
    wait("pod created -> Running", lambda: phase(plane, "plain") == "Running")

    kubelet.devices("nvidia.com/gpu", ["gpu-0", "gpu-1"])
    wait("device plugin started -> allocatable nvidia.com/gpu=2",
         lambda: node(plane)["status"]["allocatable"].get("nvidia.com/gpu") == "2")
    pod(plane, "gpu", gpus=1)
    wait("GPU pod created -> Running", lambda: phase(plane, "gpu") == "Running")
    kubelet.devices("nvidia.com/gpu", ["gpu-0"])
    wait("a device withdrawn -> allocatable nvidia.com/gpu=1",
         lambda: node(plane)["status"]["allocatable"].get("nvidia.com/gpu") == "1")

    pid = kubelet.proc.pid
    runtime = child(pid)
    time.sleep(10)
    k0, r0, w0 = cpu(pid), cpu(runtime), time.monotonic()
    time.sleep(idle)
    k1, r1, w1 = cpu(pid), cpu(runtime), time.monotonic()
    say(f"idle CPU over {w1 - w0:.0f} s with 2 pods: kubelet {100 * (k1 - k0) / (w1 - w0):.2f} %"
        f" of a core, fake runtime {100 * (r1 - r0) / (w1 - w0):.2f} %")
    rss = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
           if line.startswith("VmRSS")]
    say(f"kubelet {rss[0]}; total CPU since start {k1:.2f} s")

    began = time.monotonic()
    plane.kubectl("delete", "pod", "plain", "--wait=false")
    wait("pod deleted (grace 30 s) -> gone", lambda: not any(
        p["metadata"]["name"] == "plain" for p in plane.get(
            "/api/v1/namespaces/default/pods")["items"]))
    say(f"  ({time.monotonic() - began:.2f} s)")

    plane.kubectl("apply", "-f", "-", input=json.dumps(former_slice(NODE)))
    old_boot = kubelet.boot_id
    kubelet.stop()
    say("kubelet stopped (a power-off); restarting it as a new boot")
    say(f"  Ready after stop: {ready(plane)}")
    kubelet.start()
    wait("restart -> nodeInfo.bootID is the new boot's",
         lambda: node(plane)["status"]["nodeInfo"]["bootID"] == kubelet.boot_id)
    say(f"  new bootID differs: {kubelet.boot_id != old_boot}; Ready: {ready(plane)}; "
        f"allocatable nvidia.com/gpu: {node(plane)['status']['allocatable'].get('nvidia.com/gpu')}")
    wait("restart -> the node's ResourceSlices deleted", lambda: not plane.get(
        "/apis/resource.k8s.io/v1/resourceslices",
        fieldSelector=f"spec.nodeName={NODE}")["items"])
    say(f"  pod gpu after restart: {phase(plane, 'gpu')}")
    kubelet.devices("nvidia.com/gpu", ["gpu-0"])
    wait("plugin re-registered -> allocatable nvidia.com/gpu=1",
         lambda: node(plane)["status"]["allocatable"].get("nvidia.com/gpu") == "1")
    say(f"  pod gpu: {phase(plane, 'gpu')}")

    second = RealKubelet(plane, "lab-node-2", kubelet.root.parent / "node-2").start()
    try:
        wait("a second node beside it -> Ready=True", lambda: next(
            (c["status"] for c in plane.get("/api/v1/nodes/lab-node-2")["status"].get(
                "conditions") or [] if c["type"] == "Ready"), "") == "True")
        second.devices("nvidia.com/gpu", ["gpu-7", "gpu-8", "gpu-9"])
        wait("its own plugin -> its allocatable nvidia.com/gpu=3", lambda: plane.get(
            "/api/v1/nodes/lab-node-2")["status"]["allocatable"].get("nvidia.com/gpu") == "3")
        say("  first node's allocatable nvidia.com/gpu still: "
            f"{node(plane)['status']['allocatable'].get('nvidia.com/gpu')}")
    finally:
        second.stop()


if __name__ == "__main__":
    main()
