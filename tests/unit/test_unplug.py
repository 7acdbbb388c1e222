"""Hot-unplug on reclaim (``policy.hotplug = "both"``), the machine's half: a game's GPU
is detached from the running lendee when it keeps enough without it, the owner starts
once libvirt has removed it, and anything else takes the reclaim's road."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.config import parse
from hostagent.machine import IllegalTransition, still_wanted, verdict
from hostagent.metrics import Metrics
from hostagent.model import (
    CancelIntent,
    CompleteIntent,
    DetachFailed,
    DetachGpus,
    Drain,
    GpusDetached,
    Hold,
    Hotplug,
    KubeReturn,
    LendeeStopped,
    Observed,
    OwnerStarted,
    Phase,
    Reclaim,
    ReturnDone,
    ScheduleRelend,
    StartOwner,
    State,
)
from tests.unit.machine_scaffold import Stepper
from tests.unit.test_partial import AT, LENDEE, POLICY, TOPO, B, C, S, T, gpus, wants

A = "gpu-a"
BOTH = replace(POLICY, hotplug=Hotplug.BOTH)
go, run = Stepper(TOPO, BOTH).go, Stepper(TOPO, BOTH).run


def lent(*labels: str) -> State:
    return S(Phase.LENT, lent=gpus(*labels) if labels else gpus(A, B, C))


def detaching() -> State:
    """gaming1 asked for gpu-a while gpu-node is lent all three: it is being detached."""
    new, _ = go(lent(), wants("gaming1"))
    return new


def test_a_game_takes_its_gpu_from_the_running_lendee_by_hot_unplug() -> None:
    new, actions = go(lent(), wants("gaming1"))
    assert actions == [DetachGpus(ticket=T + 1, gpus=gpus(A))]
    assert (new.phase, new.detaching, new.lent) == (Phase.LENT, gpus(A), gpus(A, B, C))
    assert [i.owner for i in new.intents] == ["gaming1"]
    # The owner waits while the lendee holds it: neither the hook nor the executor starts it.
    assert not still_wanted(new, StartOwner(owner="gaming1"), topo=TOPO)
    decision, why = verdict(new, "gaming1", topo=TOPO)
    assert decision == "defer" and f"taking gpu-a from {LENDEE} while it runs" in why


def test_once_detached_the_owner_starts_and_the_node_returns_with_the_rest() -> None:
    new, actions = go(detaching(), GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert (new.phase, new.lent, new.detaching) == (Phase.JOINING, gpus(B, C), frozenset())
    assert actions == [StartOwner(owner="gaming1"),
                       KubeReturn(ticket=T + 2, restart_plugins=True)]
    assert still_wanted(new, StartOwner(owner="gaming1"), topo=TOPO)
    new, actions = run(new, OwnerStarted(at=AT, owner="gaming1"),
                       ReturnDone(at=AT, ticket=T + 2))
    assert actions == [CompleteIntent(intent_id="i-gaming1", owner="gaming1")]
    assert (new.phase, new.lent, new.running_owners) == (Phase.LENT, gpus(B, C),
                                                         frozenset({"gaming1"}))


def test_a_failed_hot_unplug_takes_the_reclaim_road_and_is_not_tried_again() -> None:
    new, actions = go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                reason="still in the live XML after 30s"))
    assert actions == [Drain(ticket=T + 2)]
    assert (new.phase, new.lent, new.unplug_failed) == (Phase.DRAINING, gpus(A, B, C), True)
    assert [i.owner for i in new.intents] == ["gaming1"]
    # Until the lendee restarts, a reclaim is a restart; its stop starts the owner.
    assert go(replace(lent(), unplug_failed=True), wants("gaming1"))[1] == [Drain(ticket=T + 1)]
    off, actions = go(new, LendeeStopped(at=AT))
    assert actions == [StartOwner(owner="gaming1")] and not off.unplug_failed


@pytest.mark.parametrize(("state", "policy"), [
    (lent(), POLICY),  # hotplug = "none"
    (lent(), replace(POLICY, hotplug=Hotplug.ADD)),
    (lent(), replace(BOTH, partial=False)),  # all or nothing
    (lent(), replace(BOTH, min_gpus=3)),  # it would keep 2
    (lent(A), BOTH),  # it would keep none
    (replace(lent(), attaching=gpus(A)), BOTH),
    (replace(lent(), unplug_failed=True), BOTH),
    (S(Phase.JOINING), BOTH),
], ids=["none", "add", "all-or-nothing", "min_gpus", "last GPU", "attaching", "failed before",
        "joining"])
def test_otherwise_the_reclaim_restarts_the_lendee(state: State, policy: object) -> None:
    new, actions = go(state, wants("gaming1"), policy)  # type: ignore[arg-type]
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 1)]


def test_an_iommu_group_is_detached_whole() -> None:
    grouped = replace(TOPO, groups=(gpus(B, C),))
    new, actions = Stepper(grouped, BOTH).go(lent(), wants("gaming2"))
    assert actions == [DetachGpus(ticket=T + 1, gpus=gpus(B, C))]
    # Not when the group is all it has left but one GPU under min_gpus = 2.
    new, actions = Stepper(grouped, replace(BOTH, min_gpus=2)).go(lent(), wants("gaming2"))
    assert actions == [Drain(ticket=T + 1)]


def test_a_second_owner_for_another_lent_gpu_takes_the_reclaim_road() -> None:
    new, actions = go(detaching(), wants("gaming2"))
    assert actions == [Drain(ticket=T + 2)]
    assert (new.phase, new.detaching, new.lent) == (Phase.DRAINING, frozenset(), gpus(A, B, C))
    assert not still_wanted(new, DetachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)
    with pytest.raises(IllegalTransition):
        go(new, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    # Both start once the lendee stops.
    _, actions = go(new, LendeeStopped(at=AT))
    assert actions == [StartOwner(owner="gaming1"), StartOwner(owner="gaming2")]


def test_a_second_request_for_the_same_owner_joins_the_detach() -> None:
    new, actions = go(detaching(), wants("gaming1", id="i-again"))
    assert actions == [] and new.detaching == gpus(A) and len(new.intents) == 1


def test_hold_leaves_the_detach_alone_and_a_reclaim_by_hand_takes_over() -> None:
    held, actions = go(detaching(), Hold(at=AT))
    assert (held.detaching, actions) == (gpus(A), [])
    new, actions = go(held, Reclaim(at=AT))
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 2)]


def test_the_lendee_stopping_mid_detach_starts_the_owner() -> None:
    new, actions = go(detaching(), LendeeStopped(at=AT))
    assert new.phase is Phase.OFF and actions == [StartOwner(owner="gaming1")]


def test_a_reread_mid_detach_takes_the_reclaim_road() -> None:
    new, actions = go(detaching(), Observed(at=AT, lendee_running=True,
                                            owners_running=frozenset(),
                                            lendee_gpus=gpus(A, B, C)))
    assert new.phase is Phase.DRAINING and Drain(ticket=T + 2) in actions
    # Detached before the agent restarted: the owner starts at once.
    new, actions = go(detaching(), Observed(at=AT, lendee_running=True,
                                            owners_running=frozenset(),
                                            lendee_gpus=gpus(B, C)))
    assert StartOwner(owner="gaming1") in actions and new.lent == gpus(B, C)


def test_a_start_withdrawn_mid_detach_leaves_the_gpu_free_for_a_hot_add() -> None:
    new, actions = go(detaching(), CancelIntent(at=AT, owner="gaming1", by="alice"))
    assert new.detaching == gpus(A) and new.relend_at is None
    assert not any(isinstance(a, ScheduleRelend) for a in actions)
    new, actions = go(new, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [KubeReturn(ticket=T + 2, restart_plugins=True)]
    new, actions = go(new, ReturnDone(at=AT, ticket=T + 2))
    assert actions == [ScheduleRelend(at=AT + 30)]  # a regrow (hot-add) of gpu-a


def test_a_report_for_other_gpus_is_stale() -> None:
    with pytest.raises(IllegalTransition, match="not the GPUs being detached"):
        go(detaching(), GpusDetached(at=AT, ticket=T + 1, gpus=gpus(B)))
    with pytest.raises(IllegalTransition, match="not the GPUs being detached"):
        go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(B), reason="x"))


def test_the_configuration_takes_both() -> None:
    base = (f'[lendee]\ndomain = "{LENDEE}"\ngpus = ["gpu-a"]\n'
            '[gpus.gpu-a]\npci = "0000:01:00.0"\n[policy]\n')
    assert parse(base + 'hotplug = "both"\n').policy.hotplug is Hotplug.BOTH


def test_a_failed_hot_unplug_is_counted_as_a_failure() -> None:
    m = Metrics(TOPO)
    state = detaching()
    event = DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), reason="no")
    m.transition(state, go(state, event)[0], event)
    assert m.registry.get_sample_value("hostagent_failures_total", {"kind": "hotplug"}) == 1
