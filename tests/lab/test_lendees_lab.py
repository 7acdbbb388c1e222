"""Two lendees end to end: real libvirtd, the real hook, real guests, one agent.

gpu-node borrows gpu-a, gpu-node-b borrows gpu-b and gpu-c, each its own worker VM.
`virsh start gaming1` (gpu-a) reclaims gpu-node only: gpu-node-b is never drained,
never shut down, never restarted (the same guest boot id throughout), and its machine
records no transition; gaming1 plays, and when it stops gpu-node is lent again. Where
mosquitto is installed, Home Assistant sees each lendee's own entities over MQTT, and
gpu-node-b's hold switch holds it alone. With Kubernetes, the pods on gpu-node-b's node keep running: the same pods, started when
they were."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.lab.cluster import deployment, lab_cluster
from tests.lab.helpers import OTHER, publish, two_lendees
from tests.lab.lab import AGENT_CONFIG, Lab
from tests.mosquitto import DEVICE, MISSING, Dashboard, Mosquitto
from tests.unit.homeassistant_scaffold import check_device_message

pytestmark = pytest.mark.lab


@pytest.fixture
def two(lab: Lab) -> Iterator[Lab]:
    """The lab with gpu-node on gpu-a alone and gpu-node-b on gpu-b and gpu-c."""
    lab.write_config(two_lendees(lab, AGENT_CONFIG.format(relend_delay="2s"),
                                 ("gpu-b", "gpu-c")))
    try:
        yield lab
    finally:
        lab.virsh("destroy", OTHER, check=False)
        lab.virsh("undefine", OTHER, check=False)


def boot_id(lab: Lab, vm: str) -> str:
    out = lab.guest_exec(vm, "/bin/cat", "/proc/sys/kernel/random/boot_id").stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", out), out
    return out


def test_gaming1_reclaims_its_lendee_only_and_the_other_never_notices(two: Lab) -> None:
    lab = two
    broker = Mosquitto(lab.root / "mosquitto") if MISSING is None else None
    if broker is not None:
        broker.start()
        lab.write_config(lab.config.read_text() + (
            f'\n[mqtt]\nbroker = "mqtt://127.0.0.1:{broker.port}"\nusername = "hostagent"\n'
            f'password_file = "{broker.root / "agent-password"}"\nbase_topic = "hostagent"\n'))
    try:
        reclaims_one(lab, broker)
    finally:
        if broker is not None:
            broker.stop()


def reclaims_one(lab: Lab, broker: Mosquitto | None) -> None:
    dashboard = Dashboard(broker, lab.root / "dashboard.log") if broker else None
    if dashboard is not None:
        dashboard.start()
    lab.start_agent()
    lab.wait_record(120, event="phase", to="lent", vm="gpu-node")
    lab.wait_record(120, event="phase", to="lent", vm=OTHER)
    if dashboard is not None:  # each lendee its entities, the first on the topics it had
        dashboard.wait(f"hostagent/lendee/{OTHER}/phase/state", "lent")
        dashboard.wait("hostagent/phase/state", "lent")
        cmps = check_device_message(DEVICE, dashboard.last(DEVICE) or "")["cmps"]
        assert {"hold", "reclaim", "lend", f"phase_{OTHER}", f"hold_{OTHER}",
                f"reclaim_{OTHER}", f"lend_{OTHER}"} <= set(cmps), sorted(cmps)
        assert dashboard.last(f"hostagent/lendee/{OTHER}/live_gpus/state") == "gpu-b, gpu-c"
    before = boot_id(lab, OTHER)
    other_phases = len(lab.records(event="phase", vm=OTHER))

    answer = lab.play("gaming1")
    assert "will start by itself" in answer.stderr, answer.stderr
    assert "gpu-node holds gpu-a" in answer.stderr, answer.stderr
    assert lab.state("gaming1") == "running"
    lab.wait_state("gpu-node", "shut off")
    # gpu-node-b: still running, the same boot, and its machine never moved.
    assert lab.state(OTHER) == "running"
    assert boot_id(lab, OTHER) == before
    assert len(lab.records(event="phase", vm=OTHER)) == other_phases
    assert not [e for e in lab.records(vm=OTHER) if e.get("HOSTAGENT_EVENT") in
                ("shutdown", "drain", "reclaim")]

    # The game ends: gpu-node is lent again; gpu-node-b still never noticed.
    lab.virsh("destroy", "gaming1")
    lab.wait_records(2, 120, event="phase", to="lent", vm="gpu-node")
    assert boot_id(lab, OTHER) == before
    assert len(lab.records(event="phase", vm=OTHER)) == other_phases
    if broker is not None and dashboard is not None:
        # gpu-node-b's own hold switch holds it alone (it keeps running: a hold lends no
        # more), and Home Assistant sees it so.
        publish(broker, f"hostagent/lendee/{OTHER}/hold/set", "ON")
        dashboard.wait(f"hostagent/lendee/{OTHER}/hold/state", "ON")
        assert dashboard.last("hostagent/hold/state") == "OFF"
        assert [r["MESSAGE"] for r in lab.records(event="control", result="allowed")] == [
            f"mqtt asked for hold --lendee {OTHER}"]
        assert lab.state(OTHER) == "running" and boot_id(lab, OTHER) == before
        dashboard.stop()


def test_gaming1_leaves_the_other_nodes_pods_running(two: Lab) -> None:
    """With Kubernetes: gaming1's start drains gpu-node only. The pod on gpu-node-b's
    node is the same pod, started at the same time, Running throughout, and its node
    was never cordoned; the one on gpu-node was evicted."""
    lab = two
    with lab_cluster(lab, workloads=False, others=(OTHER,)) as kc:
        # Each lendee as its own node's ServiceAccount, as deploy/rbac-node.yaml makes them.
        config = lab.config.read_text().replace(
            f'[lendees.{OTHER}]\n', f'[lendees.{OTHER}]\nkubeconfig = "{kc.kubeconfigs[OTHER]}"\n')
        lab.write_config(config + f'\n[kubernetes]\nkubeconfig = "{kc.kubeconfig}"\n'
                         'evict_retry = "1s"\n')
        lab.start_agent()
        lab.wait_record(240, event="phase", to="lent", vm="gpu-node")
        lab.wait_record(240, event="phase", to="lent", vm=OTHER)
        kc.create(*(deployment(f"job-{n}", node) for n, node in (("a", "gpu-node"),
                                                                 ("b", OTHER))))
        before = {n: kc.running_on(f"job-{n}", node)
                  for n, node in (("a", "gpu-node"), ("b", OTHER))}

        answer = lab.play("gaming1")
        assert "will start by itself" in answer.stderr, answer.stderr
        lab.wait_state("gpu-node", "shut off")
        after = kc.running_on("job-b", OTHER)
        assert (after["metadata"]["uid"], after["status"]["startTime"]) == (
            before["b"]["metadata"]["uid"], before["b"]["status"]["startTime"])
        assert not kc.node(OTHER)["spec"].get("unschedulable")
        assert not [p for p in kc.pods_on("gpu-node")
                    if p == before["a"]["metadata"]["name"]]  # evicted by the drain
        assert lab.state(OTHER) == "running"

