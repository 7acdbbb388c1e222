"""Hot-unplug in the lab (``policy.hotplug = "both"``): a game takes its lab GPU from the
running lendee (its disk, detached live from its root port) while a job on another GPU
runs on; only the pod the kubelet's device checkpoint gives that GPU is evicted. NVIDIA's
device plugin runs under its real DaemonSet, which makes a new pod at once for one
deleted, and every plugin pod's process in the guest holds every GPU open while the pod
runs (tests/lab/plugins.py): hostagent keeps them off the node through their deploy
label, sees no holder left, unbinds the GPU, detaches it, then restores the label as it
was; the lab kubelet follows the live set. Both NVIDIA's static manifest (with README's
affinity term) and gpu-operator's install (with a DCGM exporter holding every GPU and
GPU Feature Discovery, then NVIDIA's Helm chart with README's term added to each of its
three terms, in the same boot) are run. A guest booted to ignore unplug requests keeps the
device: the detach times out, the journal says so, and the reclaim by restart runs
instead. The two reclaims' times are printed side by side (figures, not assertions)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from hostagent.service.hotplug import DETACH_BOUND, HOLDERS
from tests.lab.cluster import NS, LabCluster, lab_cluster
from tests.lab.plugins import OPERATOR_LABELS, GuestPlugins, daemonsets, operator_node
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.lab.helpers import annotations_of, eventually, lends
from tests.lab.helpers import (
    define_lendee,
    gpu_pods,
    guest,
    NEVER_LETS_GO,
)

pytestmark = pytest.mark.lab


def at(record: dict[str, Any]) -> float:
    return int(record["__REALTIME_TIMESTAMP"]) / 1e6


def unplug_config(lab: Lab, kc: LabCluster) -> None:
    lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
        "[policy]\n", '[policy]\nhotplug = "both"\n') + '\n[verify]\ntimeout = "10s"\n')


def test_a_game_takes_its_gpu_live_and_a_guest_that_keeps_it_falls_back(
        lab: Lab, record_property: Callable[[str, object], None]) -> None:
    with lab_cluster(lab, workloads=False) as kc, \
            GuestPlugins(lab, kc, daemonsets("static")).running() as plugins:
        unplug_config(lab, kc)
        # The first boot ignores unplug requests; the next ones are the lab's own.
        define_lendee(lab, NEVER_LETS_GO)
        lab.start_agent()
        lends(lab, 1)
        plugins.wait_holding(1)
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
        [plugin] = plugins.wait_holding(1)
        # hostagent's own look at the holders finds it: until the plugin goes, no detach.
        assert guest(lab, "/bin/sh", "-c", HOLDERS, "sh", "/dev/nvidia0", "/dev/nvidia1")
        phases = len(lab.phases())
        asked = time.time()
        lab.ask("gaming2")
        done = lab.wait_record(120, event="intent", vm="gaming2", to="done")
        by_unplug = at(done) - asked
        kc.delete_job("train-b2")  # evicted: its Job is done with
        assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                if r["MESSAGE"].startswith(f"gpu-b detached from {LENDEE} in ")]
        # The plugin held gpu-b open until its DaemonSet, told by the label, took it off
        # the node: no new pod of it came until the label was restored, after the detach
        # (a pod deleted is made again at once).
        assert plugin in plugins.ended
        assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                if r["MESSAGE"].startswith(f"paused default/{plugin} on node {LENDEE} in ")]
        assert lab.state("gaming2") == "running"
        # Same instance, same boot; only gpu-b's pod was evicted.
        assert lab.virsh("domid", LENDEE).stdout.strip() == domid
        assert guest(lab, "cat", "/proc/sys/kernel/random/boot_id") == boot
        eventually(lambda: [a for a in kc.apps_on(LENDEE) if a] == ["train-c"],
                   "train-c is not the only job left on gpu-node")
        assert str(lab.gpu_image("gpu-b")) not in lab.virsh("dumpxml", LENDEE).stdout
        listed = guest(lab, "/usr/bin/nvidia-smi", "-L")
        assert GPUS["gpu-c"][0] in listed and GPUS["gpu-b"][0] not in listed, listed
        lends(lab, 3)
        assert lab.phases()[phases:] == ["lent>joining", "joining>lent"]
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
        assert annotations_of(node)["hostagent.io/lent-gpus"] == "gpu-c"
        # The label restored as it was (absent), and the plugin back, holding gpu-c.
        assert "hostagent.io/paused-plugins" not in annotations_of(node)
        assert not [k for k in node["metadata"]["labels"] if k.startswith("nvidia.com/gpu.deploy")]
        assert plugins.wait_holding(1) != [plugin]
        [*_, restored] = [r for r in lab.records(event="hotplug", result="ok")
                          if r["MESSAGE"].startswith("restored ")]
        later = [t for _, t in plugins.started[[p for p, _ in plugins.started].index(plugin) + 1:]]
        assert later and min(later) > at(restored) - 0.5, (later, at(restored))
        record_property("figure", (
            f"reclaim of one GPU from the running lendee, the game's start to it running: "
            f"by hot-unplug {by_unplug:.1f}s, by restart {by_restart:.1f}s (drain, shutdown, "
            f"the game's start); a guest that keeps the GPU: {fallback:.1f}s in all, the "
            f"{DETACH_BOUND:g}s bound included"))


def persistenced_holds(lab: Lab) -> list[str]:
    """The minor numbers of the GPUs the stand-in nvidia-persistenced holds open."""
    return guest(lab, "cat", "/var/run/nvidia-persistenced/held").split()


def minors(lab: Lab) -> dict[str, str]:
    """Each lab GPU the guest's nvidia-smi lists, by label: its minor number."""
    listed = dict(line.split(", ") for line in guest(
        lab, "/usr/bin/nvidia-smi", "--query-gpu=uuid,minor_number",
        "--format=csv,noheader").splitlines())
    return {gpu: listed[uuid] for gpu, (uuid, _) in GPUS.items() if uuid in listed}


def test_gpu_operators_plugin_and_dcgm_exporter_are_paused_and_restored_as_found(
        lab: Lab) -> None:
    """gpu-operator's device plugin and DCGM exporter hold every GPU, GPU Feature
    Discovery opens them each minute; all select the node by their deploy label. The
    hot-unplug sets those labels to "false", their DaemonSets take them off the node, and
    the return puts back the labels as gpu-operator left them. Then, in the same boot,
    NVIDIA's Helm chart in their place, README's term added to each of its three
    required node affinity terms: its plugin leaves by the same label, and a second
    game takes its GPU live too. The guest runs the profile with nvidia-persistenced,
    which holds every GPU: each unplug turns persistence off for its GPU alone
    (``nvidia-smi -i ADDR -pm 0``), and persistenced lets go of that one."""
    with lab_cluster(lab, workloads=False) as kc:
        operator_node(kc)
        with GuestPlugins(lab, kc, daemonsets("operator")).running() as plugins:
            unplug_config(lab, kc)
            define_lendee(lab, "hostagent.persistenced=1")
            lab.start_agent()
            lends(lab, 1)
            minor = minors(lab)  # as the boot numbered them: persistenced keeps those
            assert sorted(minor) == ["gpu-a", "gpu-b", "gpu-c"], minor
            eventually(lambda: persistenced_holds(lab) == sorted(minor.values()),
                       "persistenced holding every GPU")
            gpu_pods(lab, kc, {"train-b": "gpu-b", "train-c": "gpu-c"})
            held = plugins.wait_holding(3)
            lab.ask("gaming2")
            lab.wait_record(120, event="intent", vm="gaming2", to="done")
            assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                    if r["MESSAGE"].startswith(f"gpu-b detached from {LENDEE} in ")]
            assert set(held) <= set(plugins.ended)
            assert persistenced_holds(lab) == sorted([minor["gpu-a"], minor["gpu-c"]])
            lends(lab, 2)
            node = kc.node()
            assert {k: v for k, v in node["metadata"]["labels"].items()
                    if k.startswith("nvidia.com/gpu.deploy.")} == OPERATOR_LABELS
            assert "hostagent.io/paused-plugins" not in annotations_of(node)
            assert not set(plugins.wait_holding(3)) & set(held)

            # The chart's install instead: the node labelled as its third term forces.
            kc.kubectl("delete", "daemonset", "-n", NS, "--cascade=foreground",
                       *(o.name for o in daemonsets("operator")))
            eventually(lambda: not plugins.holding(), "gpu-operator's pods still hold GPUs")
        kc.kubectl("label", "node", LENDEE, "--overwrite", "nvidia.com/gpu.present=true")
        with GuestPlugins(lab, kc, daemonsets("chart")).running() as chart:
            [nvdp] = chart.wait_holding(1)
            gpu_pods(lab, kc, {"train-a": "gpu-a"})
            lab.ask("gaming1")
            lab.wait_record(120, event="intent", vm="gaming1", to="done")
            assert not lab.records(event="hotplug", result="failed"), [
                r["MESSAGE"] for r in lab.records(event="hotplug", result="failed")]
            assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                    if r["MESSAGE"].startswith(f"gpu-a detached from {LENDEE} in ")]
            assert [r["MESSAGE"] for r in lab.records(event="hotplug", result="ok")
                    if r["MESSAGE"].startswith(f"paused {NS}/{nvdp} on node {LENDEE} in ")]
            assert nvdp in chart.ended
            assert persistenced_holds(lab) == [minor["gpu-c"]]
            assert lab.state("gaming1") == "running"
            lends(lab, 3)
            eventually(lambda: [a for a in kc.apps_on(LENDEE) if a] == ["train-c"],
                       "train-c is not the only job left on gpu-node")
            node = kc.node()
            assert {k: v for k, v in node["metadata"]["labels"].items()
                    if k.startswith("nvidia.com/gpu.deploy.")} == OPERATOR_LABELS
            assert annotations_of(node)["hostagent.io/lent-gpus"] == "gpu-c"
            assert chart.wait_holding(1) != [nvdp]
