"""The machine's live changes under ``policy.hotplug = "both"``, driven directly: a second
owner's request while a hot-unplug or its return is under way (co-op evenings: two
players within two minutes), and a guest whose driver hung letting a GPU go.

The lendee borrows gpu-a, gpu-b and gpu-c; gaming1 owns gpu-a, gaming2 gpu-b, nobody
gpu-c. A restart of the lendee kills every job on the node, those on gpu-c included, which
no game wanted: each live detach that replaces one spares them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.core.machine import IllegalTransition, still_wanted, verdict
from hostagent.core.model import (
    AgentTimeout,
    AgentUp,
    CancelIntent,
    DetachFailed,
    DetachGpus,
    Drain,
    Drained,
    ForceOff,
    GpusDetached,
    KubeReturn,
    LendeeStopped,
    OwnerStarted,
    Phase,
    Reserve,
    ReturnDone,
    ShutdownLendee,
    ShutdownTimeout,
    StartOwner,
    State,
)
from hostagent.core.reserve import Reservation
from tests.unit.partial_world import BOTH, LIVE, TOPO, A, B, C, S, gpus
from tests.unit.machine_scaffold import AT, LENDEE, T, intent, wants

go, run = LIVE.go, LIVE.run


def lent() -> State:
    return S(Phase.LENT, lent=gpus(A, B, C))


def detaching() -> State:
    """gaming1 asked for gpu-a while gpu-node is lent all three: it is being detached."""
    new, actions = go(lent(), wants("gaming1"))
    assert actions == [DetachGpus(ticket=T + 1, gpus=gpus(A))]
    return new


def returning() -> State:
    """gpu-a has left; gaming1 is starting and the node returns with gpu-b and gpu-c."""
    new, actions = go(detaching(), GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [StartOwner(owner="gaming1"), KubeReturn(ticket=T + 2,
                                                               restart_plugins=True)]
    return new


# --- a second owner while a hot-unplug is under way ------------------------------------


def test_a_second_owner_mid_unplug_is_queued_as_another_live_detach() -> None:
    queued, actions = go(detaching(), wants("gaming2"))
    # Not a restart: the detach under way goes on, and gaming2's GPU follows it.
    assert actions == []
    assert (queued.phase, queued.ticket, queued.detaching) == (Phase.LENT, T + 1, gpus(A))
    assert still_wanted(queued, DetachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)
    assert [i.owner for i in queued.intents] == ["gaming1", "gaming2"]
    decision, why = verdict(queued, "gaming2", topo=TOPO, policy=BOTH)
    assert decision == "defer" and f"taking gpu-b from {LENDEE} while it runs" in why
    # gpu-a gone: gaming1 starts, and gpu-b is detached next, the node still cordoned.
    new, actions = go(queued, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [StartOwner(owner="gaming1"), DetachGpus(ticket=T + 2, gpus=gpus(B))]
    assert (new.phase, new.lent, new.detaching) == (Phase.LENT, gpus(B, C), gpus(B))
    assert still_wanted(new, StartOwner(owner="gaming1"), topo=TOPO)
    assert not still_wanted(new, StartOwner(owner="gaming2"), topo=TOPO)  # I2
    new, actions = go(new, GpusDetached(at=AT, ticket=T + 2, gpus=gpus(B)))
    assert actions == [StartOwner(owner="gaming2"), KubeReturn(ticket=T + 3,
                                                               restart_plugins=True)]
    assert (new.phase, new.lent) == (Phase.JOINING, gpus(C))
    new, _ = run(new, OwnerStarted(at=AT, owner="gaming1"), OwnerStarted(at=AT, owner="gaming2"),
                 ReturnDone(at=AT, ticket=T + 3))
    assert (new.phase, new.lent, new.intents) == (Phase.LENT, gpus(C), ())


def test_a_second_owner_mid_return_takes_its_gpu_live_too() -> None:
    new, actions = go(returning(), wants("gaming2"))
    assert actions == [DetachGpus(ticket=T + 3, gpus=gpus(B))]
    assert (new.phase, new.lent, new.detaching) == (Phase.LENT, gpus(B, C), gpus(B))
    # The return under way belongs to the phase that ended (I10): cancelled, never acting.
    assert not still_wanted(new, KubeReturn(ticket=T + 2, restart_plugins=True), topo=TOPO)
    with pytest.raises(IllegalTransition):
        go(new, ReturnDone(at=AT, ticket=T + 2))
    decision, why = verdict(returning(), "gaming2", topo=TOPO, policy=BOTH)
    assert decision == "defer" and f"taking gpu-b from {LENDEE} while it runs" in why
    new, actions = go(new, GpusDetached(at=AT, ticket=T + 3, gpus=gpus(B)))
    assert actions == [StartOwner(owner="gaming2"), KubeReturn(ticket=T + 4,
                                                               restart_plugins=True)]


def test_a_held_reservation_mid_unplug_is_queued_too() -> None:
    held = (Reservation(vm="gaming2", at=AT, by="me", made=AT, evict_at=AT, holding=True),)
    queued, actions = go(detaching(), Reserve(at=AT, reservations=held))
    assert (queued.phase, queued.detaching, actions) == (Phase.LENT, gpus(A), [])
    _, actions = go(queued, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [StartOwner(owner="gaming1"), DetachGpus(ticket=T + 2, gpus=gpus(B))]


def test_the_queue_keeps_min_gpus_else_the_reclaim_restarts_the_lendee() -> None:
    # With min_gpus = 2, gpu-node would keep only gpu-c: the reclaim's road frees all.
    min2 = replace(BOTH, min_gpus=2)
    new, actions = go(detaching(), wants("gaming2"), min2)
    assert (new.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 2)])
    new, actions = go(returning(), wants("gaming2"), min2)
    assert (new.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 3)])
    # Both start only once the lendee is off (I2).
    _, actions = go(go(detaching(), wants("gaming2"), min2)[0], LendeeStopped(at=AT), min2)
    assert actions == [StartOwner(owner="gaming1"), StartOwner(owner="gaming2")]


def test_a_queued_start_withdrawn_detaches_nothing_more() -> None:
    queued, _ = go(detaching(), wants("gaming2"))
    new, _ = go(queued, CancelIntent(at=AT, owner="gaming2", by="alice"))
    new, actions = go(new, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [StartOwner(owner="gaming1"), KubeReturn(ticket=T + 2,
                                                               restart_plugins=True)]
    assert new.lent == gpus(B, C)


def test_a_failed_detach_with_one_queued_restarts_and_then_starts_both() -> None:
    queued, _ = go(detaching(), wants("gaming2"))
    new, actions = go(queued, DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), reason="x"))
    assert (new.phase, actions, new.lent) == (Phase.DRAINING, [Drain(ticket=T + 2)],
                                              gpus(A, B, C))
    _, actions = go(new, LendeeStopped(at=AT))
    assert actions == [StartOwner(owner="gaming1"), StartOwner(owner="gaming2")]


def test_a_return_that_follows_no_live_change_still_restarts() -> None:
    # A lendee that just booted holds no job a restart would kill; nothing to spare.
    booted = S(Phase.JOINING, lent=gpus(A, B, C))
    new, actions = go(booted, wants("gaming2"))
    assert (new.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 1)])
# --- a guest whose driver hung letting a GPU go -------------------------------------------


def stuck() -> State:
    """The detach of gpu-a ran past its bound in the guest; the reclaim drained the node
    and sent the shutdown."""
    new, actions = go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), stuck=True,
                                                reason="the unbind of gpu-a hung"))
    assert actions == [Drain(ticket=T + 2)] and new.unplug_stuck
    new, actions = run(new, Drained(at=AT, ticket=T + 2), AgentUp(at=AT, ticket=T + 3))
    assert actions[-1] == ShutdownLendee(ticket=T + 3)
    return new


def test_a_stuck_guest_that_cannot_shut_down_is_powered_off_so_the_game_starts() -> None:
    # Its node is drained (nothing left on it to lose), and a driver hung in an unbind
    # hangs the shutdown behind it: waiting for a human only keeps the player waiting.
    new, actions = go(stuck(), ShutdownTimeout(at=AT, ticket=T + 3))
    [off] = actions
    assert isinstance(off, ForceOff) and off.ticket == T + 3 and new.phase is Phase.STOPPING
    assert off.reason == (
        "gpu-node did not shut down after its driver hung letting a GPU go; powering it off "
        "now that its node is drained, so that gaming1 can start")
    assert still_wanted(new, off, topo=TOPO)
    new, actions = go(new, LendeeStopped(at=AT))
    assert actions == [StartOwner(owner="gaming1")] and not new.unplug_stuck


@pytest.mark.parametrize(("owners", "for_whom"), [
    (("gaming1", "gaming2"), "so that gaming1 and gaming2 can start"),
    # gaming3's GPU is not the lendee's: its wait is for something else.
    (("gaming1", "gaming3"), "so that gaming1 can start"),
    ((), "so that its GPUs are free"),
])
def test_the_power_off_names_the_games_it_lets_start(owners: tuple[str, ...],
                                                     for_whom: str) -> None:
    waiting = replace(stuck(), intents=tuple(intent(o) for o in owners))
    _, [off] = go(waiting, ShutdownTimeout(at=AT, ticket=T + 3))
    assert isinstance(off, ForceOff) and off.reason == (
        "gpu-node did not shut down after its driver hung letting a GPU go; powering it off "
        f"now that its node is drained, {for_whom}")


def test_a_stuck_guest_whose_agent_no_longer_answers_is_powered_off_too() -> None:
    new, _ = go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), stuck=True,
                                          reason="nvidia-smi hung"))
    new, _ = go(new, Drained(at=AT, ticket=T + 2))
    _, actions = go(new, AgentTimeout(at=AT, ticket=T + 3))
    [off] = actions
    assert isinstance(off, ForceOff) and off.reason == (
        "gpu-node's guest agent no longer answers after its driver hung letting a GPU go; "
        "powering it off now that its node is drained, so that gaming1 can start")


def test_a_guest_that_let_go_is_still_never_destroyed_by_default() -> None:
    # I3: without a stuck unplug behind it, a shutdown that times out waits for a human.
    new, _ = go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), reason="doubt"))
    new, _ = run(new, Drained(at=AT, ticket=T + 2), AgentUp(at=AT, ticket=T + 3))
    failed, actions = go(new, ShutdownTimeout(at=AT, ticket=T + 3))
    assert failed.phase is Phase.FAILED and actions == []
    assert failed.reason is not None and "force_off_after" in failed.reason
    # With force_off_after set, the power-off is the policy's, as before.
    _, actions = go(new, ShutdownTimeout(at=AT, ticket=T + 3), replace(BOTH, force_off=True))
    assert actions == [ForceOff(ticket=T + 3)]
