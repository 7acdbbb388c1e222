"""Several lendees: one machine each, an owner's start reclaiming only the lendees that
hold its GPUs, and an owner spanning two lendees started once both let them go.

The world: node-a lends gpu-a, node-b lends gpu-b and gpu-c. gaming1 plays on gpu-a,
gaming2 on gpu-b, "both" on gpu-a and gpu-c, "elsewhere" on gpu-d that no lendee
borrows (tests/unit/core/test_lendees_config.py reads the same file)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hostagent.core import coordinator
from hostagent.core.config import parse
from hostagent.core.coordinator import Fleet, Routed, World
from hostagent.core.model import (
    Action,
    AgentUp,
    CancelRelend,
    CompleteIntent,
    Drain,
    Drained,
    DrainFailed,
    Event,
    FailIntent,
    IntentSource,
    KubeReturn,
    LendeeStarted,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStopped,
    OwnerWants,
    Phase,
    Policy,
    RelendDue,
    Reserve,
    ReturnDone,
    ScheduleRelend,
    ShutdownLendee,
    StartLendee,
    StartOwner,
    State,
    WaitAgent,
    still_wanted,
)
from hostagent.core.reserve import Reservation
from hostagent.core.rules import IllegalTransition
from hostagent.core.topology import topology
from tests.unit.lendees_scaffold import TWO

CFG = parse(TWO)
WORLD = World(topos={n: topology(CFG.view(n)) for n in CFG.lendees},
              policies={n: Policy(relend_delay=0.0) for n in CFG.lendees})
A, B = "node-a", "node-b"
T = 7


def lent(gpus: set[str]) -> State:
    return State(phase=Phase.LENT, ticket=T, agent_up=True, lent=frozenset(gpus))


def both_lent() -> Fleet:
    return Fleet(states={A: lent({"gpu-a"}), B: lent({"gpu-b", "gpu-c"})})


def wants(owner: str, at: float = 100.0) -> OwnerWants:
    return OwnerWants(at=at, owner=owner, intent_id=f"i-{owner}", source=IntentSource.HOOK)


def go(fleet: Fleet, event: Event, lendee: str | None = None) -> tuple[Fleet, list[Routed]]:
    return coordinator.step(fleet, event, world=WORLD, lendee=lendee)


def reclaimed(fleet: Fleet, name: str) -> tuple[Fleet, list[Routed]]:
    """The lendee's reclaim road from DRAINING: drained, its agent answers, it stops."""
    out: list[Routed] = []
    for make in (lambda t: Drained(at=101.0, ticket=t), lambda t: AgentUp(at=102.0, ticket=t),
                 lambda t: LendeeStopped(at=103.0)):
        fleet, actions = go(fleet, make(fleet.states[name].ticket), name)
        out += actions
    return fleet, out


def test_an_owner_of_one_lendees_gpu_never_touches_the_other() -> None:
    fleet = both_lent()
    after, actions = go(fleet, wants("gaming1"))
    assert after.states[B] is fleet.states[B]  # its node, its jobs: untouched
    assert actions == [Routed(A, Drain(ticket=T + 1))]
    after, actions = reclaimed(after, A)
    assert after.states[B] is fleet.states[B]
    assert Routed(A, StartOwner(owner="gaming1")) in actions
    assert {r.lendee for r in actions} == {A}
    after, actions = go(after, OwnerStarted(at=104.0, owner="gaming1"))
    assert actions == [Routed(A, CompleteIntent(intent_id="i-gaming1", owner="gaming1"))]
    assert after.states[B] is fleet.states[B]


def test_an_owner_spanning_two_lendees_starts_once_both_let_go() -> None:
    fleet, actions = go(both_lent(), wants("both"))
    assert set(actions) == {Routed(A, Drain(ticket=T + 1)), Routed(B, Drain(ticket=T + 1))}
    fleet, actions = reclaimed(fleet, A)
    assert not [r for r in actions if isinstance(r.action, StartOwner)]  # node-b holds gpu-c
    assert fleet.ready == {"both": frozenset({A})}
    fleet, actions = reclaimed(fleet, B)
    assert [r for r in actions if isinstance(r.action, StartOwner)] == [
        Routed(A, StartOwner(owner="both"))]
    fleet, actions = go(fleet, OwnerStarted(at=104.0, owner="both"))
    assert actions.count(Routed(A, CompleteIntent(intent_id="i-both", owner="both"))) == 1
    assert [r for r in actions if isinstance(r.action, CompleteIntent)] == [
        Routed(A, CompleteIntent(intent_id="i-both", owner="both"))]  # answered once
    assert fleet.ready == {}
    # node-b lends gpu-b again at once, which "both" does not play on; node-a waits.
    assert {r.lendee for r in actions if isinstance(r.action, ScheduleRelend)} == {B}
    fleet, actions = go(fleet, OwnerStopped(at=200.0, owner="both"))
    assert Routed(A, ScheduleRelend(at=200.0)) in actions


def test_a_request_one_lendee_fails_is_failed_once_and_dropped_by_the_other() -> None:
    fleet, _ = go(both_lent(), wants("both"))
    fleet, _ = reclaimed(fleet, A)
    ticket = fleet.states[B].ticket
    fleet, actions = go(fleet, DrainFailed(at=110.0, ticket=ticket, reason="a PDB"), B)
    fails = [r.action for r in actions if isinstance(r.action, FailIntent)]
    assert [f.intent_id for f in fails] == ["i-both"] and "a PDB" in fails[0].reason
    assert not fleet.states[A].intents and not fleet.states[B].intents
    assert fleet.ready == {}
    # node-a, stopped for nothing now, lends again.
    assert Routed(A, ScheduleRelend(at=110.0)) in actions


def test_the_hook_answers_with_the_sternest_of_the_lendees_concerned() -> None:
    fleet = Fleet(states={A: State(), B: lent({"gpu-b", "gpu-c"})})
    decision, why = coordinator.verdict(fleet, "both", world=WORLD)
    assert decision == "defer" and "node-b holds gpu-c" in why
    assert coordinator.verdict(fleet, "gaming1", world=WORLD)[0] == "proceed"
    assert coordinator.verdict(fleet, "elsewhere", world=WORLD)[0] == "proceed"
    assert coordinator.verdict(fleet, "unknown", world=WORLD) == (
        "proceed", "unknown is not managed by hostagent")
    fleet, _ = go(fleet, OwnerStarted(at=1.0, owner="gaming1"))
    decision, why = coordinator.verdict(fleet, "both", world=WORLD)
    assert decision == "refuse" and "gaming1" in why
    with pytest.raises(IllegalTransition):
        go(fleet, wants("both"))  # refused by node-a: node-b keeps nothing either
    assert coordinator.verdict(fleet, B, world=WORLD)[0] == "proceed"  # it runs already


def test_an_owner_no_lendee_concerns_is_kept_and_started_by_the_first() -> None:
    fleet, actions = go(both_lent(), wants("elsewhere"))
    assert actions == [Routed(A, StartOwner(owner="elsewhere"))]


def test_each_lendee_sees_the_reservations_of_its_own_owners() -> None:
    r = Reservation(vm="gaming2", at=1000.0, by="mqtt", made=0.0)
    fleet, _ = go(Fleet(states={A: State(), B: State()}), Reserve(at=1.0, reservations=(r,)))
    assert fleet.states[A].reservations == () and fleet.states[B].reservations == (r,)


def test_a_lendees_own_report_must_name_it() -> None:
    with pytest.raises(ValueError, match="must name its lendee"):
        go(both_lent(), LendeeStopped(at=1.0))


# --- the property: never one GPU in two VMs, across lendees ------------------------------


class Fleetworld(RuleBasedStateMachine):
    """libvirt, the guests and the executors of both lendees, people starting and
    stopping games; every action completes in any order. What each VM really holds is
    checked at each start: a GPU is never in two running VMs."""

    def __init__(self) -> None:
        super().__init__()
        self.fleet = Fleet(states={A: State(), B: State()})
        self.now = 0.0
        self.live: dict[str, frozenset[str] | None] = {A: None, B: None}
        self.up: set[str] = set()
        self.queue: list[Routed] = []
        self.timers: dict[str, float | None] = {A: None, B: None}
        self.open: dict[str, str] = {}
        self.ids = itertools.count()

    def deliver(self, event: Event, lendee: str | None = None) -> list[Routed] | None:
        """Step the fleet and take its actions; None when every machine found it stale."""
        try:
            self.fleet, actions = coordinator.step(self.fleet, event, world=WORLD, lendee=lendee)
        except IllegalTransition:
            return None
        for r in actions:
            match r.action:
                case ScheduleRelend(at=at):
                    self.timers[r.lendee] = at
                case CancelRelend():
                    self.timers[r.lendee] = None
                case CompleteIntent(intent_id=i, owner=o) | FailIntent(intent_id=i, owner=o):
                    assert self.open.pop(i) == o, f"intent {i} answered twice or never opened"
                    if isinstance(r.action, CompleteIntent):
                        assert o in self.up
                case StartOwner(owner=o):
                    held = {g for live in self.live.values() if live for g in live}
                    assert not CFG.shared_gpus(o) & held, f"{o} started into a lendee's GPUs"
                    self.queue.append(r)
                case _:
                    self.queue.append(r)
        return actions

    @initialize()
    def observe(self) -> None:
        for name in (A, B):
            self.deliver(Observed(at=0.0, lendee_running=False, owners_running=frozenset()),
                         name)

    @rule(owner=st.sampled_from(["gaming1", "gaming2", "both", "elsewhere"]))
    def want(self, owner: str) -> None:
        self.now += 1
        intent_id = f"i{next(self.ids)}"
        if not any(s.intents_of(owner) for s in self.fleet.states.values()):
            self.open[intent_id] = owner  # else it joins the request pending
        before = dict(self.fleet.states)
        actions = self.deliver(OwnerWants(at=self.now, owner=owner, intent_id=intent_id,
                                          source=IntentSource.CONTROL))
        if actions is None:  # another owner of its card plays: refused, nothing kept
            self.open.pop(intent_id, None)
            return
        for name in set(WORLD.topos) - set(WORLD.concerned(owner)):
            assert self.fleet.states[name] is before[name], f"{owner} touched {name}"
            assert all(r.lendee != name for r in actions)

    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        if not self.up:
            return
        owner = data.draw(st.sampled_from(sorted(self.up)))
        self.up.discard(owner)
        self.now += 1
        self.deliver(OwnerStopped(at=self.now, owner=owner))

    @rule(name=st.sampled_from([A, B]))
    def timer(self, name: str) -> None:
        if self.timers[name] is not None:
            self.now = max(self.now, self.timers[name] or 0.0)
            self.timers[name] = None
            self.deliver(RelendDue(at=self.now), name)

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        if not self.queue:
            return
        routed = self.queue.pop(data.draw(st.integers(0, len(self.queue) - 1)))
        name, action = routed.lendee, routed.action
        self.now += 1
        if not still_wanted(self.fleet.states[name], action, topo=WORLD.topos[name]):
            return  # the executor skips what went stale in the queue
        self.run(name, action)

    def run(self, name: str, action: Action) -> None:
        at = self.now
        match action:
            case StartLendee(gpus=gpus):
                owned = {g for o in self.up for g in CFG.owners[o].gpus}
                assert not gpus & owned, f"{name} started with a game's GPU"
                self.live[name] = gpus
                self.deliver(LendeeStarted(at=at), name)
            case WaitAgent(ticket=t):
                self.deliver(AgentUp(at=at, ticket=t), name)
            case Drain(ticket=t):
                self.deliver(Drained(at=at, ticket=t), name)
            case ShutdownLendee():
                self.live[name] = None
                self.deliver(LendeeStopped(at=at), name)
            case KubeReturn(ticket=t):
                self.deliver(ReturnDone(at=at, ticket=t), name)
            case StartOwner(owner=o):
                held = {g for live in self.live.values() if live for g in live}
                assert not set(CFG.owners[o].gpus) & held, f"{o} started on a lent GPU"
                self.up.add(o)
                self.deliver(OwnerStarted(at=at, owner=o))

    @invariant()
    def one_vm_per_gpu(self) -> None:
        holders: dict[str, str] = {}
        for vm, gpus in [*((n, g) for n, g in self.live.items() if g),
                         *((o, frozenset(CFG.owners[o].gpus)) for o in self.up)]:
            for gpu in gpus:
                assert gpu not in holders, f"{gpu} in {holders[gpu]} and {vm}"
                holders[gpu] = vm


TestFleet = Fleetworld.TestCase
TestFleet.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
