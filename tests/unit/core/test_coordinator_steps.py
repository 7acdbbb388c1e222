"""`hostagent.core.coordinator.step`'s own rules: what it raises and with what, a request
failed on one lendee answered at its home and dropped by every other, the reservations
each lendee's machine is shown. The world is tests/unit/core/test_coordinator.py's:
node-a lends gpu-a, node-b gpu-b and gpu-c; "both" plays on gpu-a and gpu-c."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hostagent.core import coordinator
from hostagent.core.config import parse
from hostagent.core.coordinator import Fleet, Routed, World
from hostagent.core.model import (
    AgentUp,
    CompleteIntent,
    Drained,
    DrainFailed,
    Event,
    FailIntent,
    Hotplug,
    IntentSource,
    KubeReturn,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStopped,
    OwnerWants,
    Phase,
    Policy,
    Reserve,
    ScheduleRelend,
    StartOwner,
    State,
)
from hostagent.core.reserve import Reservation
from hostagent.core.rules import IllegalTransition
from hostagent.core.topology import topology
from tests.unit.lendees_scaffold import GPUS, TWO

CFG = parse(TWO)
A, B = "node-a", "node-b"
T = 7


def world() -> World:
    # Built in each test, not at import: a check that runs at import is no test's.
    return World(topos={n: topology(CFG.view(n)) for n in CFG.lendees},
                 policies={n: Policy(relend_delay=0.0) for n in CFG.lendees})


def go(fleet: Fleet, event: Event, lendee: str | None = None) -> tuple[Fleet, list[Routed]]:
    return coordinator.step(fleet, event, world=world(), lendee=lendee)


def lent(gpus: set[str]) -> State:
    return State(phase=Phase.LENT, ticket=T, agent_up=True, lent=frozenset(gpus))


def both_lent() -> Fleet:
    return Fleet(states={A: lent({"gpu-a"}), B: lent({"gpu-b", "gpu-c"})})


WANTS = OwnerWants(at=100.0, owner="both", intent_id="i-both", source=IntentSource.HOOK)


def reclaimed(fleet: Fleet, name: str) -> Fleet:
    for make in (lambda t: Drained(at=101.0, ticket=t), lambda t: AgentUp(at=102.0, ticket=t),
                 lambda t: LendeeStopped(at=103.0)):
        fleet, _ = go(fleet, make(fleet.states[name].ticket), name)
    return fleet


def test_an_unnamed_report_says_which_event_must_name_its_lendee() -> None:
    with pytest.raises(ValueError, match="^LendeeStopped must name its lendee$"):
        go(both_lent(), LendeeStopped(at=1.0))


def test_an_event_no_lendee_concerns_is_refused_with_the_first_lendees_phase() -> None:
    event = OwnerStopped(at=1.0, owner="stranger")
    with pytest.raises(IllegalTransition) as info:
        go(both_lent(), event)
    assert (info.value.phase, info.value.event, info.value.why) == (
        Phase.LENT, event, "no lendee concerns it")


def test_a_request_one_lendee_refuses_is_refused_with_its_phase_and_rival() -> None:
    fleet = Fleet(states={A: lent(set()), B: State(running_owners=frozenset({"gaming2"}))})
    fleet, _ = go(fleet, OwnerStarted(at=1.0, owner="gaming1"))
    with pytest.raises(IllegalTransition) as info:
        go(fleet, WANTS)
    assert info.value.phase is Phase.LENT and info.value.event == WANTS
    assert "gaming1" in info.value.why and info.value.why != "no rule for it in this phase"


def test_an_owner_already_running_is_not_refused_for_a_rival_beside_it() -> None:
    fleet = Fleet(states={A: State(running_owners=frozenset({"both", "gaming1"})), B: State()})
    _, actions = go(fleet, WANTS)
    assert [r.lendee for r in actions] == [A]


def test_an_event_every_machine_finds_stale_raises_theirs_and_changes_nothing() -> None:
    fleet = both_lent()
    stale = Drained(at=1.0, ticket=T + 5)
    with pytest.raises(IllegalTransition) as info:
        go(fleet, stale, A)
    assert info.value.event == stale and info.value.phase is Phase.LENT


def test_a_machine_that_finds_an_event_stale_does_not_stop_the_next_from_taking_it() -> None:
    # node-a never saw "both" run (its view lost it): node-b's machine still hears it stop.
    fleet = Fleet(states={A: State(), B: State(running_owners=frozenset({"both"}))})
    after, _ = go(fleet, OwnerStopped(at=1.0, owner="both"))
    assert after.states[A] is fleet.states[A]
    assert after.states[B].running_owners == frozenset()


def test_a_request_failed_on_another_lendee_is_answered_at_its_home() -> None:
    fleet = reclaimed(go(both_lent(), WANTS)[0], A)
    fleet, actions = go(fleet, DrainFailed(at=110.0, ticket=fleet.states[B].ticket,
                                           reason="a PDB"), B)
    assert [r for r in actions if isinstance(r.action, FailIntent)] == [Routed(A, FailIntent(
        intent_id="i-both", owner="both",
        reason="node-b could not be drained (a PDB), and the policy keeps it lent"))]
    assert not fleet.states[A].intents and not fleet.states[B].intents  # both let go of it


def test_a_request_failed_on_its_home_is_dropped_by_the_other_lendee() -> None:
    fleet = reclaimed(go(both_lent(), WANTS)[0], B)
    fleet, actions = go(fleet, DrainFailed(at=110.0, ticket=fleet.states[A].ticket,
                                           reason="a PDB"), A)
    assert not fleet.states[A].intents and not fleet.states[B].intents
    assert actions == [
        Routed(A, FailIntent(intent_id="i-both", owner="both", reason=(
            "node-a could not be drained (a PDB), and the policy keeps it lent"))),
        Routed(A, KubeReturn(ticket=T + 2, restart_plugins=False)),
        Routed(B, ScheduleRelend(at=110.0)),
    ]


def test_each_lendee_is_shown_only_its_own_owners_reservations_and_acts_on_them() -> None:
    r = Reservation(vm="gaming2", at=1000.0, by="mqtt", made=0.0)
    fleet, actions = go(Fleet(states={A: State(), B: State()}),
                        Reserve(at=1.0, reservations=(r,)))
    assert fleet.states[A].reservations == () and fleet.states[B].reservations == (r,)
    assert actions == [Routed(A, ScheduleRelend(at=1.0)), Routed(B, ScheduleRelend(at=1.0))]


def test_the_hook_answers_an_owner_with_its_lendees_policy_for_a_live_take() -> None:
    live = World(topos={n: topology(CFG.view(n)) for n in CFG.lendees},
                 policies={n: Policy(relend_delay=0.0, hotplug=Hotplug.BOTH, partial=True)
                           for n in CFG.lendees})
    fleet = both_lent()
    decision, why = coordinator.verdict(fleet, "gaming2", world=live)
    assert decision == "defer" and why.startswith(
        "hostagent is taking gpu-b from node-b while it runs"), why


def test_a_request_one_lendee_sees_completed_is_answered_at_its_home() -> None:
    fleet, _ = go(both_lent(), WANTS)
    seen = Observed(at=105.0, lendee_running=False, owners_running=frozenset({"both"}))
    _, actions = go(fleet, seen, B)
    assert actions == [Routed(A, CompleteIntent(intent_id="i-both", owner="both")),
                       Routed(B, ScheduleRelend(at=105.0))]


def test_an_owner_is_not_started_while_a_lendee_that_let_go_holds_its_gpu_again() -> None:
    """The gate asks each lendee concerned whether the start is still wanted, not only
    whether it once let go: node-a let go of gpu-a, then its VM was found running with it
    again (started by hand); node-b letting go of gpu-c starts nothing."""
    fleet = reclaimed(go(both_lent(), WANTS)[0], A)
    assert fleet.ready == {"both": frozenset({A})}
    fleet, _ = go(fleet, Observed(at=104.0, lendee_running=True, owners_running=frozenset(),
                                  lendee_gpus=frozenset({"gpu-a"})), A)
    assert "gpu-a" in fleet.states[A].lent
    started = []
    for make in (lambda t: Drained(at=105.0, ticket=t), lambda t: AgentUp(at=106.0, ticket=t),
                 lambda t: LendeeStopped(at=107.0)):
        fleet, actions = go(fleet, make(fleet.states[B].ticket), B)
        started += [r for r in actions if r.action == StartOwner(owner="both")]
    assert fleet.ready["both"] >= {A, B} and started == []


THREE = """
[lendees.node-a]
gpus = ["gpu-a"]

[lendees.node-b]
gpus = ["gpu-b"]
node = "k8s-b"

[lendees.node-c]
gpus = ["gpu-c"]
node = "k8s-c"

[owners.all]
gpus = ["gpu-a", "gpu-b", "gpu-c"]
""" + GPUS


def test_a_request_failed_on_one_of_three_lendees_lends_both_others_again() -> None:
    """node-b and node-c let go of their GPUs for `all`; node-a's drain fails: both
    drop their copy of the request and each arms its relend (one must not replace the
    other's)."""
    cfg = parse(THREE)
    world = World(topos={n: topology(cfg.view(n)) for n in cfg.lendees},
                  policies={n: Policy(relend_delay=0.0) for n in cfg.lendees})
    C = "node-c"
    fleet = Fleet(states={A: lent({"gpu-a"}), B: lent({"gpu-b"}), C: lent({"gpu-c"})})
    fleet, _ = coordinator.step(fleet, replace(WANTS, owner="all", intent_id="i-all"),
                                world=world)
    for name in (B, C):
        for make in (lambda t: Drained(at=101.0, ticket=t), lambda t: AgentUp(at=102.0, ticket=t),
                     lambda t: LendeeStopped(at=103.0)):
            fleet, _ = coordinator.step(fleet, make(fleet.states[name].ticket), world=world,
                                        lendee=name)
    fleet, actions = coordinator.step(fleet, DrainFailed(
        at=110.0, ticket=fleet.states[A].ticket, reason="a PDB"), world=world, lendee=A)
    assert [r for r in actions if isinstance(r.action, ScheduleRelend)] == [
        Routed(B, ScheduleRelend(at=110.0)), Routed(C, ScheduleRelend(at=110.0))]
    assert not any(s.intents for s in fleet.states.values())
