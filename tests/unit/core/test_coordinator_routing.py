"""How `hostagent.core.coordinator` checks its world and routes each event: by the owner
it is about, by the lendee it names, or to every lendee; and the hook's verdict for a
lendee itself. The world is tests/unit/core/test_coordinator.py's: node-a lends gpu-a,
node-b gpu-b and gpu-c; gaming1 on gpu-a, gaming2 on gpu-b, "both" on gpu-a and gpu-c,
"elsewhere" on gpu-d that no lendee borrows."""

from __future__ import annotations

import dataclasses

import pytest

from hostagent.core import coordinator
from hostagent.core.config import parse
from hostagent.core.coordinator import Fleet, World
from hostagent.core.model import (
    CancelIntent,
    Hold,
    IntentSource,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    OwnerWants,
    Phase,
    Policy,
    Reclaim,
    Reserve,
    Resume,
    StartFailed,
    State,
)
from hostagent.core.rules import IllegalTransition
from hostagent.core.topology import topology
from tests.unit.lendees_scaffold import TWO

CFG = parse(TWO)
TOPOS = {n: topology(CFG.view(n)) for n in CFG.lendees}
POLICIES = {n: Policy(relend_delay=0.0) for n in CFG.lendees}
WORLD = World(topos=TOPOS, policies=POLICIES)
A, B = "node-a", "node-b"


def test_a_world_needs_a_topology_and_a_policy_for_each_lendee() -> None:
    with pytest.raises(ValueError, match="^every lendee needs a topology and a policy$"):
        World(topos={}, policies={})
    with pytest.raises(ValueError, match="^every lendee needs a topology and a policy$"):
        World(topos=TOPOS, policies={A: POLICIES[A]})
    with pytest.raises(ValueError, match="^each topology is named by its lendee$"):
        World(topos={B: TOPOS[A]}, policies={B: POLICIES[A]})
    with pytest.raises(ValueError, match="^each topology is named by its lendee$"):
        World(topos={A: TOPOS[A], B: TOPOS[A]}, policies=POLICIES)


def test_a_world_refuses_a_gpu_lent_to_two_lendees_naming_both() -> None:
    twice = dataclasses.replace(TOPOS[B], lendee_gpus=TOPOS[B].lendee_gpus | {"gpu-a"})
    with pytest.raises(ValueError, match="^gpu-a is lent to node-a and node-b$"):
        World(topos={A: TOPOS[A], B: twice}, policies=POLICIES)


def test_a_world_keeps_its_own_copy_of_what_it_was_given() -> None:
    topos, policies = dict(TOPOS), dict(POLICIES)
    world = World(topos=topos, policies=policies)
    topos.clear()
    policies.clear()
    assert list(world.topos) == [A, B] and list(world.policies) == [A, B]
    with pytest.raises(TypeError):
        world.topos[A] = TOPOS[B]  # type: ignore[index]


def test_who_keeps_each_owner_and_which_names_are_lendees() -> None:
    assert WORLD.concerned("both") == (A, B)
    assert WORLD.concerned("gaming2") == (B,)
    assert WORLD.concerned("elsewhere") == (A,)
    assert WORLD.concerned("stranger") == ()
    assert WORLD.home("both") == A and WORLD.home("gaming2") == B
    assert WORLD.home("stranger") is None
    assert WORLD.lendee(B) == B and WORLD.lendee("gaming2") is None


@pytest.mark.parametrize(("event", "by_event"), [
    (OwnerWants(at=1.0, owner="gaming2", intent_id="i", source=IntentSource.HOOK), True),
    (OwnerStarted(at=1.0, owner="gaming2"), True),
    (OwnerStopped(at=1.0, owner="gaming2"), True),
    (OwnerStarting(at=1.0, owner="gaming2"), True),
    (CancelIntent(at=1.0, owner="gaming2", by="cli"), True),
    (StartFailed(at=1.0, vm="gaming2", reason="x"), True),
    (StartFailed(at=1.0, vm=B, reason="x"), False),  # the lendee's own start
    (Hold(at=1.0), True),
    (Resume(at=1.0, lendee=A), True),
    (Reclaim(at=1.0), True),
    (Reserve(at=1.0, reservations=()), True),
    (LendeeStopped(at=1.0), False),
    (Observed(at=1.0, lendee_running=False, owners_running=frozenset()), False),
])
def test_what_is_routed_by_the_event_and_what_by_the_lendee_reporting_it(
        event: object, by_event: bool) -> None:
    assert coordinator.routed_by_event(event, WORLD) is by_event  # type: ignore[arg-type]


def fresh() -> Fleet:
    return Fleet(states={A: State(), B: State()})


def test_hold_resume_and_reclaim_go_to_the_lendee_named_or_to_all() -> None:
    one, _ = coordinator.step(fresh(), Hold(at=1.0, lendee=A), world=WORLD)
    assert one.states[A].hold and one.states[B] == State()
    held, _ = coordinator.step(fresh(), Hold(at=1.0), world=WORLD)
    assert held.states[A].hold and held.states[B].hold
    one, _ = coordinator.step(held, Resume(at=2.0, lendee=B), world=WORLD)
    assert one.states[A] is held.states[A] and not one.states[B].hold
    every, _ = coordinator.step(held, Resume(at=2.0), world=WORLD)
    assert not every.states[A].hold and not every.states[B].hold
    lent = Fleet(states={A: State(phase=Phase.LENT, lent=frozenset({"gpu-a"}), agent_up=True),
                         B: State(phase=Phase.LENT, lent=frozenset({"gpu-b"}), agent_up=True)})
    one, actions = coordinator.step(lent, Reclaim(at=2.0, lendee=B), world=WORLD)
    assert one.states[A] is lent.states[A] and one.states[B].phase is Phase.DRAINING
    assert {r.lendee for r in actions} == {B}
    every, _ = coordinator.step(lent, Reclaim(at=2.0), world=WORLD)
    assert every.states[A].phase is every.states[B].phase is Phase.DRAINING


@pytest.mark.parametrize("make", [Hold, Resume, Reclaim])
def test_a_lendee_named_that_is_none_is_refused_by_name(make: type[Hold]) -> None:
    with pytest.raises(ValueError, match="^gaming2 is not a lendee$"):
        coordinator.step(fresh(), make(at=1.0, lendee="gaming2"), world=WORLD)


def test_a_report_for_a_lendee_that_is_none_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="^node-z is not a lendee$"):
        coordinator.step(fresh(), LendeeStopped(at=1.0), world=WORLD, lendee="node-z")


def test_a_lendees_failed_start_goes_to_its_machine_alone() -> None:
    fleet = Fleet(states={A: State(lendee_starting=True), B: State(lendee_starting=True)})
    after, _ = coordinator.step(fleet, StartFailed(at=1.0, vm=B, reason="no memory"),
                                world=WORLD)
    assert after.states[A] is fleet.states[A]
    reason = after.states[B].reason
    assert reason is not None and "no memory" in reason


def test_an_event_about_a_vm_no_lendee_keeps_is_refused_and_changes_nothing() -> None:
    with pytest.raises(IllegalTransition, match="no lendee concerns it"):
        coordinator.step(fresh(), OwnerStopped(at=1.0, owner="stranger"), world=WORLD)


def test_each_lendee_sees_only_its_own_owners_running() -> None:
    seen = Observed(at=1.0, lendee_running=False, owners_running=frozenset({"gaming1", "gaming2"}))
    for name, owner in ((A, "gaming1"), (B, "gaming2")):
        fleet, _ = coordinator.step(fresh(), seen, world=WORLD, lendee=name)
        assert fleet.states[name].running_owners == {owner}


def test_a_wanted_owner_already_running_on_one_lendee_is_not_refused_there() -> None:
    fleet = Fleet(states={A: State(running_owners=frozenset({"both"})), B: State()})
    after, _ = coordinator.step(fleet, OwnerWants(at=1.0, owner="both", intent_id="i",
                                                  source=IntentSource.HOOK), world=WORLD)
    assert after.states[B].intents_of("both")


def test_the_hook_answers_for_a_lendee_with_its_own_machine_and_gpus() -> None:
    fleet = Fleet(states={A: State(phase=Phase.LENT, lent=frozenset({"gpu-a"}), agent_up=True),
                          B: State(running_owners=frozenset({"gaming2"}))})
    assert coordinator.verdict(fleet, A, world=WORLD)[0] == "proceed"
    decision, why = coordinator.verdict(fleet, B, world=WORLD, gpus=frozenset({"gpu-b"}))
    assert decision == "defer" and "in use by gaming2" in why, why
    # The definition being started tells the agent's own start from one by hand.
    starting = Fleet(states={A: State(), B: State(lendee_starting=True,
                                                    lent=frozenset({"gpu-b"}))})
    decision, why = coordinator.verdict(starting, B, world=WORLD,
                                        gpus=frozenset({"gpu-b", "gpu-c"}))
    assert decision == "defer" and "node-b without gpu-c" in why, why
    assert coordinator.verdict(starting, B, world=WORLD)[0] == "proceed"
