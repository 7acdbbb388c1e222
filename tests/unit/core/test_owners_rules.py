"""The owner rules (`hostagent.core.owners`) where the other tests do not look closely:
each stale event's refusal word for word, and every field of the state a rule returns."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.core.machine import IllegalTransition
from hostagent.core.model import (
    CancelIntent,
    Drain,
    Event,
    FailIntent,
    LendeeStarted,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    Phase,
    Reclaim,
    Reserve,
    Resume,
    ScheduleRelend,
    StartFailed,
    State,
    VmStopped,
    WaitAgent,
)
from hostagent.core.reserve import Reservation
from tests.unit.machine_scaffold import AT, FAILED_WHY, LENDEE, T, Stepper, intent, wants
from tests.unit.partial_world import BOTH, G1, TOPO, A, B, C, S, done, go, gpus, vms

NOT_OWNER = "stranger is not an owner VM in the topology"


def holding(vm: str) -> tuple[Reservation, ...]:
    return (Reservation(vm=vm, at=AT, by="me", made=AT, evict_at=AT, holding=True),)


@pytest.mark.parametrize(("state", "event", "why"), [
    (S(), OwnerStopped(at=AT, owner="stranger"), NOT_OWNER),
    (S(), OwnerStarting(at=AT, owner="stranger"), NOT_OWNER),
    (S(), CancelIntent(at=AT, owner="stranger", by="alice"), NOT_OWNER),
    (S(), Reserve(at=AT, reservations=holding("stranger")), NOT_OWNER),
    (S(running_owners=vms("gaming1")), OwnerStarting(at=AT, owner="gaming1"),
     "gaming1 is already running or starting"),
    (S(), CancelIntent(at=AT, owner="gaming1", by="alice"), "gaming1 has no pending start"),
    (S(), VmStopped(at=AT, vm="usb-vm"), "usb-vm holds no IOMMU group of the lendee's GPUs"),
    (S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")), wants("gaming-win"),
     "gpu-a is in use by gaming1"),
])
def test_each_stale_owner_event_is_refused_with_its_own_sentence(
        state: State, event: Event, why: str) -> None:
    """A stale owner event raises IllegalTransition naming the event, the phase and why."""
    with pytest.raises(IllegalTransition) as info:
        go(state, event)
    assert info.value.event is event and info.value.phase is state.phase
    assert str(info.value) == f"{type(event).__name__} refused in phase {state.phase}: {why}"


def test_an_owner_found_running_on_a_lent_gpu_completes_its_requests_and_reclaims() -> None:
    """OwnerStarted with its GPU lent: its requests complete and the reclaim begins."""
    state = S(Phase.LENT, intents=G1)
    new, actions = go(state, OwnerStarted(at=AT, owner="gaming1"))
    assert actions == [done("gaming1"), Drain(ticket=T + 1)]
    assert new == replace(state, phase=Phase.DRAINING, ticket=T + 1, intents=(),
                          running_owners=vms("gaming1"))


def test_an_owner_start_that_held_back_a_regrow_arms_it_after_relend_delay() -> None:
    """A starting owner held back the regrow of a GPU freed meanwhile: armed at its start."""
    state = S(Phase.LENT, lent=gpus(C), starting_owners=vms("gaming1"))
    new, actions = go(state, OwnerStarted(at=AT, owner="gaming1"))
    assert actions == [ScheduleRelend(at=AT + 30.0)]
    assert new == replace(state, starting_owners=frozenset(), running_owners=vms("gaming1"),
                          relend_at=AT + 30.0)


def test_a_vm_stop_frees_its_groups_but_keeps_the_reason_outside_off() -> None:
    """In FAILED, a VM's stop frees its groups; the reason a human must read stays."""
    state = S(Phase.FAILED, reason=FAILED_WHY, held={B: "usb-vm"})
    new, actions = go(state, VmStopped(at=AT, vm="usb-vm"))
    assert (new, actions) == (replace(state, held={}), [])


def test_a_failed_lendee_start_says_how_lending_resumes() -> None:
    """The lendee's start failed: OFF with a reason that says what resumes lending."""
    state = S(lendee_starting=True)
    new, actions = go(state, StartFailed(at=AT, vm=LENDEE, reason="no memory"))
    assert actions == []
    assert new == replace(
        state, lendee_starting=False, lent=frozenset(),
        reason=(f"{LENDEE} failed to start: no memory; lending resumes when an owner stops "
                "or on `hostagent resume`"),
    )


def test_a_failed_owner_start_ends_its_claim_and_lends_again() -> None:
    """An owner's start failed: its requests fail, its claim ends, the relend is armed."""
    state = S(intents=G1, starting_owners=vms("gaming1"))
    new, actions = go(state, StartFailed(at=AT, vm="gaming1", reason="no memory"))
    assert actions == [
        FailIntent(intent_id="i-gaming1", owner="gaming1", reason="gaming1 failed to start: no memory"),
        ScheduleRelend(at=AT + 30.0),
    ]
    assert new == replace(state, intents=(), starting_owners=frozenset(), relend_at=AT + 30.0)


def test_resume_ends_a_reclaim_by_hand_so_the_start_in_flight_is_lent() -> None:
    """Resume after a reclaim by hand of a start in flight: the start that lands is lent."""
    state, _ = go(S(lendee_starting=True), Reclaim(at=AT))
    assert state.reclaiming is True and state.hold is True
    new, actions = go(state, Resume(at=AT))
    assert (new, actions) == (replace(state, hold=False, reclaiming=False), [])
    assert new.reclaiming is False
    new, actions = go(new, LendeeStarted(at=AT))
    assert (new.phase, actions) == (Phase.BOOTING, [WaitAgent(ticket=T + 1)])


def test_a_reservation_of_gpus_not_lent_leaves_the_lendee_alone() -> None:
    """A reservation that holds GPUs the lendee does not hold takes nothing from it."""
    state = S(Phase.LENT, lent=gpus(A, C))
    event = Reserve(at=AT, reservations=holding("gaming2"))
    new, actions = go(state, event)
    assert (new, actions) == (replace(state, reservations=event.reservations), [])


def test_an_owner_asking_again_waits_for_its_gpus_being_detached() -> None:
    """An owner whose GPUs are being detached waits for them, even where a live take of
    every owner in the way would not be allowed now (gaming2, let through meanwhile,
    would leave the lendee no GPU): no restart. No step leads here today (gaming2's
    start is deferred while gpu-b is lent), so the state is built."""
    state = S(Phase.LENT, lent=gpus(A, B), detaching=gpus(A),
              intents=(intent("gaming1"),), starting_owners=vms("gaming2"))
    new, actions = Stepper(TOPO, BOTH).go(state, wants("gaming1", id="i-again"))
    assert (new, actions) == (state, [])
