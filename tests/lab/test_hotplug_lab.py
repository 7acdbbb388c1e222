"""Hot-add in the lab (``policy.hotplug = "add"``): the real agent attaches the lab GPU
a game freed to the running lendee (its disk, into the root port its live definition
left empty), the stand-in nvidia-smi lists it, the lab's kubelet on the real control
plane follows the live set,
and the GPU is lent with no drain and no restart while a GPU job runs on the node; a
hot-add whose GPU the guest does not see is journaled and leaves it to the next restart.
After the hot-add, lendee.cdi_refresh makes the guest's CDI spec anew (its boot's lists
the GPUs of that boot alone) before the plugins come back."""

from __future__ import annotations

import json

import pytest

from tests.lab.cluster import lab_cluster
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.lab.helpers import annotations_of, eventually, lends
from tests.lab.helpers import journalctl

pytestmark = pytest.mark.lab

CDI = "/var/run/cdi/nvidia.yaml"
# As gpu-operator's toolkit writes it (the lab's nvidia-ctk stands in).
CDI_REFRESH = f"/usr/bin/nvidia-ctk cdi generate --output={CDI}"


def test_a_regrow_by_hot_add_lends_the_freed_gpu_without_a_restart(lab: Lab) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig).replace(
            "[policy]\n", '[policy]\nhotplug = "add"\n').replace(
            "[lendee]\n", f'[lendee]\ncdi_refresh = "{CDI_REFRESH}"\n')
            + '\n[verify]\ntimeout = "10s"\n')
        lab.start_agent()
        lends(lab, 1)
        lab.play("gaming1")
        lends(lab, 2)
        # The CDI spec gpu-node's boot wrote lists the GPUs of that boot alone.
        assert GPUS["gpu-a"][0] not in lab.guest_exec(LENDEE, "cat", CDI).stdout
        persistent = lab.virsh("dumpxml", "--inactive", LENDEE).stdout
        kc.add_gpu_job("train")
        eventually(lambda: kc.apps_on(LENDEE) == ["train"], "the job never ran on gpu-node")
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        # The hot-add's own record, not the plugins' restart before it (both "ok").
        eventually(lambda: any("and lent, with no restart" in e["MESSAGE"]
                               for e in lab.records(event="hotplug", result="ok")),
                   "the hot-add of gpu-a", timeout=120)
        # "Each step is journaled (`journalctl -u hostagent HOSTAGENT_EVENT=hotplug`)".
        steps = [e["MESSAGE"] for e in lab.records(event="hotplug")]
        shown = journalctl(lab, "journalctl -u hostagent HOSTAGENT_EVENT=hotplug")
        assert len(steps) > 1 and shown[:len(steps)] == steps, shown
        phases = lab.phases()
        # Lent twice, then no drain, no stop: the second lend's instance runs on.
        assert phases[-1] == "joining>lent" and phases.count("joining>lent") == 2, phases
        assert not lab.records(event="regrow", result="waiting")
        assert str(lab.gpu_image("gpu-a")) in lab.virsh("dumpxml", LENDEE).stdout
        assert lab.virsh("dumpxml", "--inactive", LENDEE).stdout == persistent
        listed = lab.guest_exec(LENDEE, "/usr/bin/nvidia-smi", "-L").stdout
        assert all(uuid in listed for uuid, _ in GPUS.values()), listed
        # lendee.cdi_refresh made the spec anew: a container may ask for gpu-a by name.
        spec = lab.guest_exec(LENDEE, "cat", CDI).stdout
        assert all(uuid in spec for uuid, _ in GPUS.values()), spec
        assert any("CDI spec made anew" in step for step in steps)
        seen = lab.records(event="verify", result="ok")[-1]["HOSTAGENT_GPUS"].split(",")
        assert sorted(seen) == sorted(uuid for uuid, _ in GPUS.values())
        # The node's annotation follows the hot-add's record (a PATCH after it).
        eventually(lambda: annotations_of(kc.node()).get("hostagent.io/lent-gpus")
                   == "gpu-a,gpu-b,gpu-c", "the node's lent-gpus after the hot-add")
        node = kc.node()
        assert not node["spec"].get("unschedulable")
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "3"
        assert kc.apps_on(LENDEE) == ["train"]  # the job ran on through it
        status = json.loads(lab.hostagent("status", "--json").stdout)
        assert status["lendee"]["lent"] == ["gpu-a", "gpu-b", "gpu-c"]
        # The next game's reclaim is the usual one (drain, stop, a start without gpu-a).
        kc.delete_job("train")
        lab.play("gaming1")
        assert lab.phases()[len(phases):len(phases) + 1] == ["lent>draining"]
        lends(lab, 3)
        # A hot-add whose GPU the guest's driver does not find fails within its bound,
        # journaled: gpu-a is detached again (left attached and lent, it failed every
        # later return's check in the guest), waits for gpu-node's next restart, and
        # gpu-node is neither drained nor restarted for it.
        lab.write_gpu("gpu-a", "no driver")
        phases = lab.phases()
        lab.wait_agent("gaming1")
        lab.virsh("shutdown", "--mode", "agent", "gaming1")
        failed = lab.wait_record(120, event="hotplug", result="failed")
        assert failed["MESSAGE"].startswith("could not add gpu-a to gpu-node live: ")
        assert failed["MESSAGE"].endswith("; gpu-a wait for gpu-node's next restart")
        assert lab.phases() == phases
        assert str(lab.gpu_image("gpu-a")) not in lab.virsh("dumpxml", LENDEE).stdout
        status = json.loads(lab.hostagent("status", "--json").stdout)
        assert status["lendee"]["lent"] == ["gpu-b", "gpu-c"]
        assert annotations_of(kc.node())["hostagent.io/lent-gpus"] == "gpu-b,gpu-c"
