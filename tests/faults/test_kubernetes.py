"""Faults on the Kubernetes side: the API server down, failing or slow; a budget that
never allows an eviction; the agent killed in a Kubernetes step.

The API is the lab's real control plane (tests/lab/cluster.py), with a kubelet that
follows the lendee VM. The agent reaches it through the fault proxy
(tests/controlplane/proxy.py), whose faults (`down_for`, `fail`, `slow`) so land on the
agent's own requests only: the kubelets and controllers go on as in a cluster whose
API server only the agent cannot reach.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.faults.scenario import (
    Scenario,
    count,
    kill_agent,
    wait_for,
    wait_lent,
)
from tests.lab.cluster import LabCluster, lab_cluster, statefulset
from tests.lab.lab import GPUS, LENDEE, Lab
from tests.faults.helpers import (
    cordoned,
    marker,
)

pytestmark = pytest.mark.lab

NODE = rf"^/api/v1/nodes/{LENDEE}(\?.*)?$"


def kube_config(lab: Lab, kc: LabCluster, *, policy: str = "proceed", **timeouts: str) -> None:
    text = lab.config_text(relend_delay="1s", kubeconfig=kc.kubeconfig)
    for key, value in timeouts.items():
        assert f'\n{key} = "' in text, key
        text = text.replace(f'\n{key} = "', f'\n{key} = "{value}"  # was "', 1)
    lab.write_config(text.replace("[policy]", f'[policy]\non_drain_timeout = "{policy}"'))


def hold_the_drain(kc: LabCluster) -> None:
    """Two pods behind a budget that wants both: no eviction is ever allowed (on
    gpu-node once it is lent: `LabCluster.wait_placed`)."""
    kc.place(*statefulset("db", 2, min_available=2), pods=2)


def requests(kc: LabCluster, method: str, path: str) -> int:
    return len(kc.call(kc.api.requests_to, method, path))


# ---- the API server misbehaving --------------------------------------------------------

FAULTS: dict[str, Callable[[LabCluster], Any]] = {
    "down 4s": lambda kc: kc.call(kc.api.down_for, 4),
    "answering 500": lambda kc: kc.call(kc.api.fail, ".", code=500, times=3),
    "slow (1.5s a request)": lambda kc: kc.call(kc.api.slow, ".", delay=1.5, times=3),
}


@pytest.mark.parametrize("api", list(FAULTS))
def test_api(lab: Lab, fault: Scenario, api: str) -> None:
    """Kubernetes API {api} during the drain and during the return"""
    with lab_cluster(lab) as kc:
        kube_config(lab, kc)
        lab.start_agent()
        wait_lent(lab)
        kc.wait_placed()
        FAULTS[api](kc)
        fault.fault()
        assert fault.start_owner("gaming1").returncode != 0
        lab.wait_game("gaming1")
        fault.recovered()
        # Drained for real once the API answered again: only the DaemonSet's pod is left.
        assert kc.apps_on(LENDEE) == ["device-plugin"]
        assert cordoned(kc) and marker(kc) == "hostagent"
        kc.call(kc.api.clear_faults)
        lab.virsh("destroy", "gaming1")  # the game ends
        lab.wait_record(60, event="phase", to="joining")
        FAULTS[api](kc)
        fault.fault()
        wait_lent(lab, timeout=90)
        fault.recovered()
        assert not cordoned(kc) and marker(kc) is None
        assert kc.node()["status"]["allocatable"]["nvidia.com/gpu"] == str(len(GPUS))
        assert count(lab, event="phase", to="failed") == 0


# ---- a PodDisruptionBudget that never allows an eviction ----------------------------


@pytest.mark.parametrize("policy", ["proceed", "abort"])
def test_pdb(lab: Lab, fault: Scenario, policy: str) -> None:
    """a PDB that never allows eviction, on_drain_timeout = {policy}"""
    with lab_cluster(lab, workloads=False) as kc:
        hold_the_drain(kc)
        kube_config(lab, kc, policy=policy, drain="3s")
        lab.start_agent()
        wait_lent(lab)
        kc.wait_placed()
        fault.fault()
        assert fault.start_owner("gaming1").returncode != 0
        if policy == "proceed":
            # The player first: the game starts, the pods left behind are named.
            lab.wait_game("gaming1")
            fault.recovered()
            left = lab.wait_record(event="drain", result="incomplete")
            assert "db-0" in left["MESSAGE"] and "db-1" in left["MESSAGE"]
            assert cordoned(kc)
        else:
            # The cluster first: the request fails with the reason, nothing is stopped,
            # the node is given back as it was.
            fault.intents_may_fail = 1
            failed = lab.wait_record(30, event="intent", to="failed")
            assert "could not be drained" in failed["MESSAGE"]
            wait_lent(lab)
            fault.recovered()
            assert lab.state("gaming1") == "shut off" and lab.state(LENDEE) == "running"
            assert fault.shutdowns(LENDEE) == 0
            assert not cordoned(kc)
        assert kc.pods_on(LENDEE) == ["db-0", "db-1"]


# ---- the agent SIGKILLed in a Kubernetes step ------------------------------------------

STEPS = ["cordoning", "draining", "waiting Ready", "uncordoning"]


@pytest.mark.parametrize("step", STEPS)
def test_agent_killed(lab: Lab, fault: Scenario, step: str) -> None:
    """agent SIGKILLed in a Kubernetes step: {step}"""
    reclaim = step in ("cordoning", "draining")
    with lab_cluster(lab, workloads=False,
                     ready_delay=15 if step == "waiting Ready" else 1) as kc:
        if step == "draining":
            hold_the_drain(kc)
        kube_config(lab, kc, drain="5s")
        lab.start_agent()
        if step == "waiting Ready":
            # The first return: the GPUs are verified, the node is not Ready yet (for
            # 15 s after the boot, so that a busy machine still sees it so).
            lab.wait_record(60, event="verify", result="ok")
            assert count(lab, event="phase", to="lent") == 0
        else:
            wait_lent(lab)
        if step == "draining":
            kc.wait_placed()
        if step == "uncordoning":
            assert fault.start_owner("gaming1").returncode != 0
            lab.wait_game("gaming1")
            assert marker(kc) == "hostagent"
            lab.virsh("destroy", "gaming1")
            lab.wait_records(2, 60, event="phase", to="joining")
        patches = requests(kc, "PATCH", NODE)
        with slowed(kc, NODE, "PATCH") if step in ("cordoning", "uncordoning") \
                else contextlib.nullcontext():
            if reclaim:
                assert fault.start_owner("gaming1").returncode != 0
            if step == "draining":
                lab.wait_record(30, event="cordon")
            elif step != "waiting Ready":  # a node PATCH is on its way: the (un)cordon
                wait_for(lambda: requests(kc, "PATCH", NODE) > patches, 60,
                         f"the agent's PATCH of node {LENDEE}")
            kill_agent(lab)
            fault.fault()
            if not reclaim:  # killed in the return, the node still cordoned by us
                # (even the first return: a lendee found off at start has its node
                # cordoned, so that no return is uncordoned unverified)
                assert lab.phases()[-1] == "booting>joining"
                assert cordoned(kc) and marker(kc) == "hostagent"
            lab.start_agent()
        if reclaim:
            lab.wait_game("gaming1")
            fault.recovered()
            assert cordoned(kc) and marker(kc) == "hostagent"  # still known as ours
        else:
            wait_lent(lab, timeout=90)
            fault.recovered()
            assert not cordoned(kc) and marker(kc) is None
        assert count(lab, event="phase", to="failed") == 0


@contextlib.contextmanager
def slowed(kc: LabCluster, path: str, method: str, delay: float = 5) -> Iterator[None]:
    """The next matching request waits `delay` seconds: long enough to kill the agent."""
    kc.call(kc.api.slow, path, delay=delay, times=1, method=method)
    try:
        yield
    finally:
        kc.call(kc.api.clear_faults)
