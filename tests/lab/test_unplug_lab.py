"""Hot-unplug in the lab (``policy.hotplug = "both"``): a game takes its lab GPU from the
running lendee (its disk, detached live from its root port) while a job on another GPU
runs on; only the pod the kubelet's device checkpoint gives that GPU is evicted, the
device plugin's stand-in in the guest holds every GPU open until its pod is deleted
(hostagent stops it, sees no holder left, unbinds the GPU, then detaches it), and the
lab kubelet follows the live set. A guest booted to ignore unplug requests keeps the
device: the detach times out, the journal says so, and the reclaim by restart runs
instead. The two reclaims' times are printed side by side (figures, not assertions)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hostagent.service.hotplug import CHECKPOINT, DETACH_BOUND, HOLDERS
from tests.lab.cluster import LabCluster, lab_cluster, pod
from tests.lab.lab import GPUS, LENDEE, Lab, domain_xml
from tests.lab.test_kube_lab import annotations, eventually, lends

pytestmark = pytest.mark.lab

# What makes the lab's guest ignore an unplug request: no ACPI hot-plug driver, and
# the PCIe ports without their native hot-plug service either.
NEVER_LETS_GO = "acpiphp.disable=1 pcie_ports=compat"
PLUGIN = "nvidia-device-plugin-daemonset"  # its pods' app label, which hostagent finds


def define_lendee(lab: Lab, kernel_args: str = "") -> None:
    """gpu-node's persistent definition, as the lab's, with more on its kernel command
    line (a running instance keeps its own until it restarts)."""
    assert lab.guest is not None
    xml = domain_xml(LENDEE, lab.guest, [lab.gpu_image(g) for g in sorted(GPUS)],
                     console=lab.root / "console" / f"{LENDEE}.log")
    xml = xml.replace("<cmdline>console=ttyS0", f"<cmdline>{kernel_args} console=ttyS0")
    path = lab.root / f"{LENDEE}.xml"
    path.write_text(xml)
    lab.virsh("define", str(path))


def gpu_pods(lab: Lab, kc: LabCluster, pods: dict[str, str]) -> None:
    """Pods of Jobs on gpu-node, each using one lab GPU (name -> GPU label), and the
    kubelet's device checkpoint in the guest saying which, as the device plugin's IDs."""
    for name in pods:
        kc.add_gpu_job(name)
    entries = []
    for name, gpu in pods.items():
        running = kc.running(name)
        entries.append({"PodUID": running["metadata"]["uid"], "ContainerName": "main",
                        "ResourceName": "nvidia.com/gpu",
                        "DeviceIDs": {"0": [GPUS[gpu][0]]}, "AllocResp": ""})
    text = json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {
        "nvidia.com/gpu": [uuid for uuid, _ in GPUS.values()]}}, "Checksum": 0})
    done = lab.guest_exec(LENDEE, "/bin/sh", "-c", 'mkdir -p "${1%/*}" && printf %s "$2" > "$1"',
                          "sh", CHECKPOINT, text)
    assert done.exitcode == 0, done


# The lab's stand-in for NVIDIA's device plugin inside the guest: a process that holds
# the device node of every lab GPU open (/dev/nvidiaN, N as the stand-in nvidia-smi's
# minor_number) for as long as the plugin's pod runs, as the real plugin's NVML health
# check does (k8s-device-plugin v0.17: internal/rm/health.go registers events on every
# device it serves and keeps them until the plugin stops).
PLUGIN_HOLDS = r"""
i=0
for b in /sys/block/vd*; do
    set -- $(head -c 200 /dev/${b##*/} 2>/dev/null | head -n 1)
    [ "$1" = LABGPU ] || continue
    [ -e /dev/nvidia$i ] || mknod /dev/nvidia$i b $(tr : ' ' < $b/dev)
    i=$((i+1))
done
setsid sh -c 'for n in /dev/nvidia[0-9]*; do exec 3<"$n"; eval "exec $((${n#/dev/nvidia}+4))<&3"; done
    echo $$ > /run/labplugin.pid; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &
sleep 0.5; cat /run/labplugin.pid
"""


def plugin_in_guest(lab: Lab, kc: LabCluster) -> Callable[[], bool]:
    """The device plugin's pod on gpu-node and its process in the guest holding every lab
    GPU open; the process ends when the pod is deleted. Returns whether it has ended."""
    kc.create({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": PLUGIN},
               "spec": {"selector": {"matchLabels": {"app": PLUGIN}},
                        "template": pod("", app=PLUGIN)}})
    name = kc.running(PLUGIN)["metadata"]["name"]
    pid = guest(lab, "/bin/sh", "-c", PLUGIN_HOLDS)
    assert pid.isdigit(), pid
    # hostagent's own look at the holders finds it: until the plugin stops, no detach.
    holders = guest(lab, "/bin/sh", "-c", HOLDERS, "sh", "/dev/nvidia1").split()
    assert [h for h in holders if h.startswith(f"{pid}/fd/")], holders
    ended = threading.Event()

    def follow() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            found = kc.pod(name)
            if found is None or found["metadata"].get("deletionTimestamp"):
                guest(lab, "kill", pid)
                ended.set()
                return
            time.sleep(0.2)
    threading.Thread(target=follow, daemon=True).start()
    return ended.is_set


def guest(lab: Lab, *argv: str) -> str:
    return lab.guest_exec(LENDEE, *argv).stdout.strip()


def at(record: dict[str, Any]) -> float:
    return int(record["__REALTIME_TIMESTAMP"]) / 1e6


def test_a_game_takes_its_gpu_live_and_a_guest_that_keeps_it_falls_back(
        lab: Lab, record_property: Callable[[str, object], None]) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
            "[policy]\n", '[policy]\nhotplug = "both"\n') + '\n[verify]\ntimeout = "10s"\n')
        # The first boot ignores unplug requests; the next ones are the lab's own.
        define_lendee(lab, NEVER_LETS_GO)
        lab.start_agent()
        lends(lab, 1)
        assert NEVER_LETS_GO in guest(lab, "cat", "/proc/cmdline")
        define_lendee(lab)
        gpu_pods(lab, kc, {"train-a": "gpu-a", "train-b": "gpu-b"})

        # A guest that never lets go: the detach times out, the restart reclaims.
        asked = time.time()
        lab.ask("gaming1")
        failed = lab.wait_record(120, event="hotplug", result="failed")
        assert failed["MESSAGE"] == (
            f"could not take gpu-a from {LENDEE} live: gpu-a still in {LENDEE}'s live "
            f"definition {DETACH_BOUND:g}s after the detach: the guest did not let it go; "
            "reclaiming it by restart instead (drain, shutdown, start)")
        done = lab.wait_record(180, event="intent", vm="gaming1", to="done")
        assert lab.state("gaming1") == "running"
        assert "lent>draining" in lab.phases()
        # gaming1 started only once the lendee, which may have held gpu-a, was off.
        assert at(lab.records(event="phase", to="off")[0]) <= at(done)
        fallback, by_restart = at(done) - asked, at(done) - at(failed)
        for job in ("train-a", "train-b"):  # evicted: their Jobs are done with
            kc.delete_job(job)

        # The lab's own guest lets go: gaming2 takes gpu-b, the job on gpu-c runs on.
        lends(lab, 2)
        assert NEVER_LETS_GO not in guest(lab, "cat", "/proc/cmdline")
        domid = lab.virsh("domid", LENDEE).stdout.strip()
        boot = guest(lab, "cat", "/proc/sys/kernel/random/boot_id")
        gpu_pods(lab, kc, {"train-b2": "gpu-b", "train-c": "gpu-c"})
        plugin_ended = plugin_in_guest(lab, kc)
        phases = len(lab.phases())
        asked = time.time()
        lab.ask("gaming2")
        done = lab.wait_record(120, event="intent", vm="gaming2", to="done")
        by_unplug = at(done) - asked
        kc.delete_job("train-b2")  # evicted: its Job is done with
        assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                if r["MESSAGE"].startswith(f"gpu-b detached from {LENDEE} in ")]
        # The plugin held gpu-b open until hostagent stopped it; gpu-b left only after.
        assert plugin_ended()
        assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                if r["MESSAGE"].startswith(f"stopped default/{PLUGIN}-")]
        assert lab.state("gaming2") == "running"
        # Same instance, same boot; only gpu-b's pod was evicted.
        assert lab.virsh("domid", LENDEE).stdout.strip() == domid
        assert guest(lab, "cat", "/proc/sys/kernel/random/boot_id") == boot
        eventually(lambda: [a for a in kc.apps_on(LENDEE) if a != PLUGIN] == ["train-c"],
                   "train-c is not the only job left on gpu-node")
        assert str(lab.gpu_image("gpu-b")) not in lab.virsh("dumpxml", LENDEE).stdout
        listed = guest(lab, "/usr/bin/nvidia-smi", "-L")
        assert GPUS["gpu-c"][0] in listed and GPUS["gpu-b"][0] not in listed, listed
        lends(lab, 3)
        assert lab.phases()[phases:] == ["lent>joining", "joining>lent"]
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
        assert annotations(node)["hostagent.io/lent-gpus"] == "gpu-c"
        record_property("figure", (
            f"reclaim of one GPU from the running lendee, the game's start to it running: "
            f"by hot-unplug {by_unplug:.1f}s, by restart {by_restart:.1f}s (drain, shutdown, "
            f"the game's start); a guest that keeps the GPU: {fallback:.1f}s in all, the "
            f"{DETACH_BOUND:g}s bound included"))
