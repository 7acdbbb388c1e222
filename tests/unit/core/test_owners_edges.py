"""Where test_partial.py's table does not go in `hostagent.core.owners`: a start (or a
hot-add) refused because another VM holds part of an IOMMU group (`GroupsHeld`), and a
fresh read of libvirt (`Observed`), each pinned to every field of the state it leaves,
with the exact refusal of each stale report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.core.machine import IllegalTransition
from hostagent.core.model import (
    AgentUp,
    Drain,
    GroupsHeld,
    KubeReturn,
    Observed,
    Phase,
    Policy,
    Reclaim,
    RelendDue,
    Resume,
    ScheduleRelend,
    StartFailed,
    StartLendee,
    StartOwner,
    State,
    WaitAgent,
)
from tests.unit.machine_scaffold import AT, FAILED_WHY, LENDEE, T, intent, wants
from tests.unit.partial_world import (
    ALL,
    BOTH,
    MIN2,
    POLICY,
    STEPPER,
    A,
    B,
    C,
    S,
    gpus,
    go,
    run,
    vms,
)

WHY = "usbvm holds a member of the IOMMU group"


def held(given: frozenset[str]) -> GroupsHeld:
    """The report of the lendee's start (no ticket): none of `given` given, C's group held."""
    return GroupsHeld(at=AT, gpus=given, held={C: "usbvm"}, reason=WHY)


def starting() -> State:
    """OFF, the relend timer fired: the lendee's start with every GPU is in flight."""
    state, actions = go(S(relend_at=AT - 1), RelendDue(at=AT - 1))
    assert actions == [StartLendee(gpus=ALL)] and state.lendee_starting
    return state


STALE: list[tuple[str, State, GroupsHeld, str]] = [
    ("a hot-add's report of other GPUs",
     S(Phase.LENT, lent=ALL, attaching=gpus(C)),
     GroupsHeld(at=AT, ticket=T, gpus=gpus(B), held={B: "usbvm"}, reason=WHY),
     "not the GPUs being attached"),
    ("a start's report of other GPUs than the start in flight",
     S(lendee_starting=True), held(gpus(B, C)),
     f"no start of {LENDEE} with those GPUs is in flight"),
    ("a start's report with no start in flight",
     S(), held(frozenset()),
     f"no start of {LENDEE} with those GPUs is in flight"),
    ("a start's report while the lendee runs",
     S(Phase.LENT), held(ALL),
     f"no start of {LENDEE} with those GPUs is in flight"),
]


@pytest.mark.parametrize(("state", "event", "why"), [row[1:] for row in STALE],
                         ids=[row[0] for row in STALE])
def test_a_groups_held_report_that_is_not_current_is_refused_saying_so(
        state: State, event: GroupsHeld, why: str) -> None:
    """A report that answers no start or hot-add under way is refused, the state kept."""
    before = replace(state)
    with pytest.raises(IllegalTransition) as info:
        go(state, event)
    assert (info.value.phase, info.value.event) == (state.phase, event)
    assert str(info.value) == f"GroupsHeld refused in phase {state.phase}: {why}"
    assert state == before


def test_a_start_report_in_lent_is_refused_even_with_a_start_flagged() -> None:
    """Never one GPU in two VMs: a start's report in LENT never frees the GPUs the lendee
    runs with. No step leads to LENT with ``lendee_starting`` (only OFF sets it), so the
    state is built: the guard must hold even so."""
    state = S(Phase.LENT, lendee_starting=True)
    with pytest.raises(IllegalTransition) as info:
        go(state, held(ALL))
    assert str(info.value) == (f"GroupsHeld refused in phase lent: no start of {LENDEE} "
                               "with those GPUs is in flight")


def test_a_start_refused_for_a_held_group_starts_the_waiting_owner_first() -> None:
    """The start got nothing: every field says OFF with no start, the held group is kept,
    and the owner that waited for that start is started; no relend races it."""
    state, _ = go(starting(), wants("gaming1"))
    new, actions = go(state, held(ALL))
    assert new == State(phase=Phase.OFF, ticket=T, intents=(intent("gaming1", at=AT),),
                        held={C: "usbvm"})
    assert actions == [StartOwner(owner="gaming1")]


def test_a_start_refused_for_a_held_group_is_made_again_with_what_is_free() -> None:
    """With enough left (here exactly min_gpus), the start is made again at once with the
    GPUs no VM holds, the reason of an earlier failed start gone; with too few, the lendee
    stays off saying why."""
    # An earlier start failed, lending resumed: its reason is still shown while it starts.
    state, _ = run(starting(), StartFailed(at=AT, vm=LENDEE, reason="no memory"),
                   Resume(at=AT), RelendDue(at=AT))
    assert state.lendee_starting and state.reason is not None
    two_held = GroupsHeld(at=AT, gpus=ALL, held={A: "usbvm", B: "usbvm"}, reason=WHY)
    new, actions = go(state, two_held)
    assert new == State(phase=Phase.OFF, ticket=T, relend_at=AT,
                        held={A: "usbvm", B: "usbvm"})
    assert actions == [ScheduleRelend(at=AT)]
    new, actions = go(new, RelendDue(at=AT))
    assert actions == [StartLendee(gpus=gpus(C))]
    # Under min_gpus 2, the one GPU left is not enough: off, with the reason.
    new, actions = STEPPER.go(state, two_held, MIN2)
    assert new == State(phase=Phase.OFF, ticket=T, held={A: "usbvm", B: "usbvm"},
                        reason=f"{WHY}; {LENDEE} is not started until then")
    assert actions == []


def test_a_reclaim_by_hand_of_a_start_refused_for_a_held_group_is_over() -> None:
    """Nothing started, so nothing is left to reclaim: only the hold stays."""
    state, _ = go(starting(), Reclaim(at=AT))
    assert state.reclaiming and state.hold
    new, actions = go(state, held(ALL))
    assert new == State(phase=Phase.OFF, ticket=T, hold=True, held={C: "usbvm"})
    assert actions == []


def test_a_reread_naming_vms_that_are_no_owners_is_refused_naming_them_all() -> None:
    """Every VM the topology does not know is named, in order, and nothing changes."""
    event = Observed(at=AT, lendee_running=False, owners_running=vms("zeta", "gaming1", "alpha"))
    with pytest.raises(IllegalTransition) as info:
        go(S(), event)
    assert info.value.event is event
    assert str(info.value) == ("Observed refused in phase off: alpha, zeta is not an owner VM "
                               "in the topology")


def test_a_reread_finding_the_lendee_gone_leaves_it_off_with_nothing_of_the_old_phase() -> None:
    """From a stuck lendee that stopped while the agent was away: OFF with no reason, no
    GPU lent, no agent, no flag of the old phase (nor a held group: learnt again), the
    waiting owner started and the relend armed at once."""
    state = S(Phase.FAILED, reason=FAILED_WHY, agent_up=True, lendee_starting=True,
              regrow_waiting=True, reclaiming=True, held={C: "usbvm"},
              intents=(intent("gaming3"),), starting_owners=vms("gaming2"))
    new, actions = go(state, Observed(at=AT, lendee_running=False, owners_running=vms()))
    assert new == State(phase=Phase.OFF, ticket=T + 1, relend_at=AT,
                        intents=(intent("gaming3"),))
    assert actions == [StartOwner(owner="gaming3"), ScheduleRelend(at=AT)]


def test_a_reread_with_the_lendee_off_keeps_why_its_last_start_failed() -> None:
    """In OFF the reason is the last failed start's, and a restart of the agent keeps it."""
    why = f"{LENDEE} failed to start: no memory"
    new, actions = go(S(reason=why), Observed(at=AT, lendee_running=False, owners_running=vms()))
    assert new == State(phase=Phase.OFF, ticket=T + 1, reason=why, relend_at=AT)
    assert actions == [ScheduleRelend(at=AT)]


@pytest.mark.parametrize(("policy", "replug"), [(POLICY, False), (BOTH, True)],
                         ids=["no hotplug", "hotplug"])
def test_a_reread_finding_the_lendee_running_replays_its_lend(policy: Policy,
                                                               replug: bool) -> None:
    """Through BOOTING again, its agent unknown and no flag of the old phase kept; with
    hotplug on, a live change may have been under way, so its return restarts the GPU
    plugins, and only then."""
    state = S(Phase.LENT, lent=gpus(B, C), lendee_starting=True, regrow_waiting=True,
              replug=not replug, held={A: "usbvm"}, gpu_pods=2)
    seen = Observed(at=AT, lendee_running=True, owners_running=vms(), lendee_gpus=gpus(B, C))
    new, actions = STEPPER.go(state, seen, policy)
    assert new == State(phase=Phase.BOOTING, ticket=T + 1, lent=gpus(B, C), replug=replug,
                        gpu_pods=2)
    assert actions == [WaitAgent(ticket=T + 1)]
    new, actions = STEPPER.go(new, AgentUp(at=AT, ticket=T + 1), policy)
    assert actions == [KubeReturn(ticket=T + 2, restart_plugins=replug)]


def test_a_reread_finding_the_lendee_running_with_its_gpus_wanted_reclaims_it() -> None:
    """The owner waiting for its GPUs reclaims the lendee, whose agent must answer again
    before the shutdown; an owner that needs none of them is started again now."""
    state = S(Phase.LENT, intents=(intent("gaming1"), intent("gaming3")), gpu_pods=0)
    seen = Observed(at=AT, lendee_running=True, owners_running=vms())
    new, actions = go(state, seen)
    assert new == State(phase=Phase.DRAINING, ticket=T + 1, lent=ALL, gpu_pods=0,
                        intents=(intent("gaming1"), intent("gaming3")))
    assert actions == [Drain(ticket=T + 1), StartOwner(owner="gaming3")]


def test_an_adopted_lendee_waits_its_whole_bound_again_before_a_regrow() -> None:
    """A regrow that waited for pods before the restart of the agent starts its wait
    afresh once adopted: the pods are unknown until watched again, and a regrow that
    took the old wait for over would kill their jobs at once."""
    state = S(Phase.LENT, lent=gpus(B, C), regrow_waiting=True, gpu_pods=2)
    seen = Observed(at=AT, lendee_running=True, owners_running=vms(), lendee_gpus=gpus(B, C),
                    adopt=True)
    new, actions = go(state, seen)
    assert new == State(phase=Phase.LENT, ticket=T + 1, lent=gpus(B, C), agent_up=True,
                        relend_at=AT + 30)
    assert actions == [ScheduleRelend(at=AT + 30)]
    new, actions = go(new, RelendDue(at=AT + 30))
    assert (new.phase, new.regrow_waiting, new.relend_at) == (Phase.LENT, True, AT + 150)
    assert actions == [ScheduleRelend(at=AT + 150)]
