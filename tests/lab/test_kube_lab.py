"""The Kubernetes half of the cycle in the lab: the real agent, libvirtd and guests,
and the real control plane with a kubelet that follows the lendee VM."""

from __future__ import annotations

import re
import signal

import pytest

from tests.lab.cluster import LabCluster, boot_seen, lab_cluster, statefulset
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.lab.helpers import (
    annotations_of,
    eventually,
    lends,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.lab
MARKER = "hostagent.io/cordoned-by"
# Seconds from a lendee's start to its kubelet's where the agent must not trust the
# last boot's status: past the guest agent's answer and the in-guest check.
LATE_KUBELET = 10.0


def play_and_stop(lab: Lab, owner: str = "gaming1") -> None:
    lab.play(owner)
    lab.wait_agent(owner)
    lab.virsh("shutdown", "--mode", "agent", owner)
    lab.wait_state(owner, "shut off", timeout=30)


def config(lab: Lab, kc: LabCluster, **timeouts: str) -> None:
    text = lab.config_text(kubeconfig=kc.kubeconfig)
    for key, value in timeouts.items():
        text = text.replace(f'\n{key} = "', f'\n{key} = "{value}"  # was "', 1)
    lab.write_config(text)


def test_reclaim_drains_like_kubectl_and_the_return_uncordons(lab: Lab) -> None:
    """With drain.stop = "power-off": the drained lendee's filesystems are frozen by its
    real qemu-ga, then it is powered off (the guest's root is its initramfs, which no
    freeze holds: qemu-ga answers guest-fsfreeze-freeze with 0)."""
    with lab_cluster(lab) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
            'evict_retry = "1s"',
            'evict_retry = "1s"\nlent_taints = ["hostagent.io/borrowed=true:NoSchedule"]')
            + '\n[drain]\nstop = "power-off"\n')
        lab.start_agent()
        lends(lab, 1)
        kc.wait_placed()
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert annotations_of(node).get("hostagent.io/state") == "lent"
        assert {"key": "hostagent.io/borrowed", "value": "true", "effect": "NoSchedule"} \
            in node["spec"]["taints"]

        lab.play("gaming1")
        node = kc.node()
        assert node["spec"]["unschedulable"] is True
        assert annotations_of(node)[MARKER] == "hostagent"
        assert annotations_of(node)["hostagent.io/holder"] == "gaming1"
        assert not any(t["key"] == "hostagent.io/borrowed" for t in node["spec"].get("taints", []))
        # Evicted through the API (the PDB let the trainers go one at a time); the
        # DaemonSet's pod was left alone, as kubectl drain does.
        assert kc.apps_on(LENDEE) == ["device-plugin"]
        drained = lab.wait_record(event="drain", result="ok")  # the drain's end, not its start
        assert "3 pods evicted" in drained["MESSAGE"]
        off = lab.wait_record(event="power-off")
        assert off["MESSAGE"] == ("gpu-node is drained: 0 filesystems frozen through its guest "
                                  'agent, powering it off (drain.stop = "power-off")')
        assert [r["HOSTAGENT_RESULT"] for r in lab.records(event="power-off")] == ["frozen"]

        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        lends(lab, 2)
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert MARKER not in annotations_of(node)
        assert annotations_of(node).get("hostagent.io/state") == "lent"
        # As many as this lend gave (partial lending: fewer while an owner plays).
        lent = annotations_of(node)["hostagent.io/lent-gpus"].split(",")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(len(lent))
        assert 1 <= len(lent) <= len(GPUS)


def test_an_administrators_cordon_survives_a_full_cycle(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False, cordoned=True) as kc:
        config(lab, kc)
        lab.start_agent()
        lends(lab, 1)
        play_and_stop(lab)
        lends(lab, 2)
        node = kc.node()
        assert node["spec"]["unschedulable"] is True
        assert MARKER not in annotations_of(node)


def test_a_node_back_short_of_gpus_stays_cordoned_with_an_error(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        config(lab, kc, ready="6s")
        lab.start_agent()
        lends(lab, 1)
        # The device plugin will find nothing after the next boot.
        kc.gpus.seen = lambda: []
        play_and_stop(lab)
        failed = lab.wait_record(60, event="phase", to="failed")
        assert re.search(r"reports 0 allocatable nvidia.com/gpu where [1-9] were lent",
                         failed["MESSAGE"])
        assert failed["PRIORITY"] == "3"
        assert kc.node()["spec"]["unschedulable"] is True


@pytest.mark.parametrize("policy", ["proceed", "abort"])
def test_a_pdb_that_never_allows_eviction(lab: Lab, policy: str) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        kc.place(*statefulset("db", 2, min_available=2), pods=2)
        config(lab, kc, drain="3s")
        lab.write_config(lab.config.read_text().replace(
            "[policy]", f'[policy]\non_drain_timeout = "{policy}"'))
        lab.start_agent()
        lends(lab, 1)
        kc.wait_placed()
        refused = lab.ask("gaming1")
        assert refused.returncode != 0
        if policy == "proceed":
            # The player first: the pods left behind are named, and the game starts.
            lab.wait_game("gaming1")
            left = lab.wait_record(event="drain", result="incomplete")
            assert "db-0" in str(left) and "db-1" in str(left)
        else:
            failed = lab.wait_record(30, event="intent", to="failed")
            assert "could not be drained" in failed["MESSAGE"]
            lends(lab, 2)
            assert lab.state("gaming1") == "shut off"
            assert lab.state(LENDEE) == "running"
            assert not kc.node()["spec"].get("unschedulable")
            assert kc.pods_on(LENDEE) == ["db-0", "db-1"]


def test_our_cordon_is_still_ours_after_an_agent_restart_mid_drain(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        kc.place(*statefulset("db", 2, min_available=2), pods=2)
        config(lab, kc, drain="4s")
        lab.start_agent()
        lends(lab, 1)
        kc.wait_placed()
        lab.ask("gaming1")
        lab.wait_record(event="cordon")
        lab.stop_agent(signal.SIGKILL)
        assert annotations_of(kc.node())[MARKER] == "hostagent"
        lab.start_agent()
        lab.wait_game("gaming1")
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        lends(lab, 2)
        assert not kc.node()["spec"].get("unschedulable")


def said_after(lab: Lab, event: str, text: str) -> bool:
    """Whether hostagent's journal has `text` in a message after its last `event` record."""
    entries = lab.journal("SYSLOG_IDENTIFIER=hostagent")
    marks = [i for i, e in enumerate(entries) if e.get("HOSTAGENT_EVENT") == event]
    return bool(marks) and any(text in str(e.get("MESSAGE", "")) for e in entries[marks[-1]:])


def test_the_api_down_during_the_return_delays_it_only(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        config(lab, kc)
        lab.start_agent()
        lends(lab, 1)
        lab.play("gaming1")
        kc.run(kc.api.down())
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        lab.wait_record(60, event="phase", to="joining")
        # The return's check in the guest passed and its first read of the node failed:
        # it waits for the API, and only for it.
        eventually(lambda: said_after(lab, "verify", f"could not read node {LENDEE}"),
                   "the return's read of the node refused", timeout=60)
        assert len(lab.records(event="phase", to="lent")) == 1
        kc.run(kc.api.up())
        lends(lab, 2)
        assert not kc.node()["spec"].get("unschedulable")


def test_a_bad_kubeconfig_makes_the_kubernetes_steps_wait_and_says_the_fix(lab: Lab) -> None:
    # It stopped the agent for good once (exit 2, and systemd never tried again): a
    # kubeconfig can appear while the agent runs, so only the Kubernetes steps wait.
    with lab_cluster(lab, workloads=False) as kc:
        says = "/nonexistent/kubeconfig"
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
            str(kc.kubeconfig), says))
        proc = lab.start_agent()
        message = lab.wait_record(event="kubernetes", result="waiting")["MESSAGE"]
        assert "kubernetes.kubeconfig" in message and says in message
        assert proc.poll() is None  # still running, saying why
        assert not lab.records(event="phase", to="lent")  # no lend without the node's return


def test_a_node_not_in_the_cluster_does_not_stop_the_agent(lab: Lab) -> None:
    # A node deleted while its VM was off registers again when the lendee starts.
    with lab_cluster(lab, workloads=False) as kc:
        text = lab.config_text(kubeconfig=kc.kubeconfig)
        lab.write_config(text.replace("[lendee]", '[lendee]\nnode = "no-such-node"', 1))
        proc = lab.start_agent()
        assert proc.poll() is None and lab.agent_ready()
        assert lab.stop_agent() == 0


def test_regrow_when_idle_waits_for_the_gpu_job_then_takes_the_freed_gpu(lab: Lab) -> None:
    """gaming1 ends while a pod on gpu-node uses a GPU: the regrow (a restart, so a
    drain) waits, running, and says why; once the pod is gone gpu-node is restarted
    with all three GPUs, verified and uncordoned."""
    with lab_cluster(lab, workloads=False) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig))
        lab.start_agent()
        lends(lab, 1)
        lab.play("gaming1")
        lends(lab, 2)
        kc.add_gpu_job("train")
        eventually(lambda: kc.apps_on(LENDEE) == ["train"], "the job never ran on gpu-node")
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        waiting = lab.wait_record(30, event="regrow", result="waiting")
        assert "1 pod(s) on its node request a GPU" in waiting["MESSAGE"]
        # The regrow waits on the node's count of GPU pods: nothing but a change of that
        # count (a node event) moves it, and the agent still counts the job.
        status = lab.status()
        assert status["lendee"]["regrow_waiting"] and status["cluster"]["gpu_pods"] == 1
        assert lab.phases()[-1] == "joining>lent"  # not restarted under the job
        assert annotations_of(kc.node())["hostagent.io/lent-gpus"] == "gpu-b,gpu-c"
        kc.delete_job("train")
        lends(lab, 3)
        regrow = lab.records(event="phase", to="draining")[-1]
        assert "no pod on its node requests a GPU" in regrow["MESSAGE"]
        node = kc.node()
        assert annotations_of(node)["hostagent.io/lent-gpus"] == "gpu-a,gpu-b,gpu-c"
        assert not node["spec"].get("unschedulable")


def test_a_lendee_destroyed_by_hand_comes_back_cordoned_until_verified(lab: Lab) -> None:
    """Not a reclaim: `virsh destroy gpu-node` while lent. Its node is cordoned (as
    ours) at once, stays cordoned while gpu-node boots again, and is uncordoned only
    once the return verified its GPUs — on what this boot's kubelet posted: the API
    still shows the last boot's Ready and GPUs when the guest answers, and the new
    kubelet posts seconds later (invariant 14). The real kubelet runs here at the
    release's nodeStatusUpdateFrequency (10 s; the lab's others post each second): its
    first status after the boot says the new bootID with allocatable nvidia.com/gpu 0,
    and the GPUs come with a post up to 10 s after the device plugin registered."""
    with lab_cluster(lab, workloads=False, kubelet_start=LATE_KUBELET,
                     status_every=None) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig))
        lab.start_agent()
        lends(lab, 1)
        last_boot = kc.node()["status"]["nodeInfo"]["bootID"]
        lab.virsh("destroy", LENDEE)
        eventually(lambda: kc.node()["spec"].get("unschedulable"),
                   "gpu-node cordoned after the destroy")
        assert annotations_of(kc.node())[MARKER] == "hostagent"
        eventually(lambda: len(lab.records(event="phase", to="joining")) >= 2,
                   "gpu-node booted again (its second joining)")
        assert kc.node()["spec"].get("unschedulable") is True  # booted, not yet verified
        node = wait_until(lambda: n if not (n := kc.node())["spec"].get("unschedulable")
                          else None, "gpu-node uncordoned once its GPUs were verified",
                          every=0.2)
        # The read that first shows the uncordon shows the status it was decided on.
        assert node["status"]["nodeInfo"]["bootID"] == boot_seen(lab) != last_boot
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(len(GPUS))
        lends(lab, 2)
        assert lab.records(event="verify", result="ok")
        assert lab.records(event="boot", result="waiting")
        assert MARKER not in annotations_of(kc.node())
