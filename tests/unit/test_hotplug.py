"""Hot-add on regrow (``policy.hotplug = "add"``), the machine's half: GPUs a game freed
are attached to the running lendee instead of a restart, the node stays lent, and a
hot-add that fails leaves them to the regrow by restart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.config import ConfigError, parse
from hostagent.machine import IllegalTransition, still_wanted, verdict
from hostagent.model import (
    AttachFailed,
    AttachGpus,
    Drain,
    GpuPods,
    GpusAttached,
    Hotplug,
    LendeeStopped,
    OwnerStopped,
    Phase,
    RelendDue,
    ScheduleRelend,
    State,
)
from tests.unit.test_partial import AT, LENDEE, POLICY, TOPO, B, C, S, T, gpus, go, run, vms, wants

ADD = replace(POLICY, hotplug=Hotplug.ADD)
A = "gpu-a"


def freed() -> State:
    """gaming1 played on gpu-a and stopped: the lendee runs with gpu-b and gpu-c, two GPU
    pods on its node, and the regrow's timer is due."""
    return S(Phase.LENT, lent=gpus(B, C), gpu_pods=2, relend_at=AT)


def attaching() -> State:
    new, _ = go(freed(), RelendDue(at=AT), ADD)
    return new


def test_a_regrow_by_hot_add_attaches_the_freed_gpu_while_gpu_pods_run() -> None:
    new, actions = go(freed(), RelendDue(at=AT), ADD)
    assert actions == [AttachGpus(ticket=T + 1, gpus=gpus(A))]
    assert (new.phase, new.lent, new.attaching) == (Phase.LENT, gpus(A, B, C), gpus(A))
    assert (new.relend_at, new.regrow_waiting, new.ticket) == (None, False, T + 1)


def test_without_hotplug_the_same_regrow_waits_for_the_pods() -> None:
    new, actions = go(freed(), RelendDue(at=AT), POLICY)
    assert new.regrow_waiting and not any(isinstance(a, AttachGpus) for a in actions)


def test_hot_add_never_restarts_even_when_regrow_is_never() -> None:
    state, actions = run(S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
                         OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                         policy=replace(ADD, regrow=POLICY.regrow.NEVER))
    assert actions == [ScheduleRelend(at=AT + 30), AttachGpus(ticket=T + 1, gpus=gpus(A))]
    assert not any(isinstance(a, Drain) for a in actions)


def test_the_gpu_is_lent_once_attached() -> None:
    new, actions = go(attaching(), GpusAttached(at=AT, ticket=T + 1, gpus=gpus(A)), ADD)
    assert (new.phase, new.lent, new.attaching, new.ticket) == (
        Phase.LENT, gpus(A, B, C), frozenset(), T + 2)
    assert actions == []


def test_a_failed_hot_add_leaves_the_gpu_to_a_regrow_by_restart() -> None:
    new, actions = go(attaching(), AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                held=frozenset(), reason="no"), ADD)
    assert (new.phase, new.lent, new.attaching, new.hotadd_failed) == (
        Phase.LENT, gpus(B, C), frozenset(), True)
    assert actions == [ScheduleRelend(at=AT + 30)]
    # The regrow that follows is the restart, when the node is idle of GPU pods.
    new, actions = run(new, GpuPods(at=AT, count=0), RelendDue(at=AT + 30), policy=ADD)
    assert actions == [Drain(ticket=T + 3, regrow=True)]


def test_a_failed_hot_add_keeps_what_the_live_definition_holds() -> None:
    new, actions = go(attaching(), AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                held=gpus(A), reason="not seen"), ADD)
    assert (new.lent, new.hotadd_failed, actions) == (gpus(A, B, C), True, [])


def test_the_lendee_stopping_allows_hot_add_again() -> None:
    failed = replace(S(Phase.LENT, lent=gpus(B, C)), hotadd_failed=True)
    new, _ = go(failed, LendeeStopped(at=AT), ADD)
    assert not new.hotadd_failed and new.lent == frozenset()


def test_an_owner_asking_for_the_gpu_being_attached_takes_the_reclaim_road() -> None:
    state = attaching()
    decision, why = verdict(state, "gaming1", topo=TOPO)
    assert decision == "defer" and "gpu-a" in why
    new, actions = go(state, wants("gaming1"), ADD)
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 2)]
    assert new.attaching == frozenset() and A in new.lent
    assert not still_wanted(new, AttachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)
    with pytest.raises(IllegalTransition):
        go(new, GpusAttached(at=AT, ticket=T + 1, gpus=gpus(A)), ADD)


def test_a_report_for_other_gpus_is_stale() -> None:
    with pytest.raises(IllegalTransition, match="not the GPUs being attached"):
        go(attaching(), GpusAttached(at=AT, ticket=T + 1, gpus=gpus(B)), ADD)
    assert still_wanted(attaching(), AttachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)


def test_the_configuration_takes_hotplug() -> None:
    base = (f'[lendee]\ndomain = "{LENDEE}"\ngpus = ["gpu-a"]\n'
            '[gpus.gpu-a]\npci = "0000:01:00.0"\n[policy]\n')
    assert parse(base + 'hotplug = "add"\n').policy.hotplug is Hotplug.ADD
    assert parse(base).policy.hotplug is Hotplug.NONE
    with pytest.raises(ConfigError, match="hotplug"):
        parse(base + 'hotplug = "sometimes"\n')
