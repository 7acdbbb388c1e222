"""Several lendees: one machine each, and the rule that joins them for an owner.

`hostagent.core.machine` is one lendee's machine, and stays so (its promises are tested
there). With ``[lendees.NAME]`` the agent runs one per lendee, each over its own
`Topology` (its view of the configuration: `hostagent.core.lendees.view`), and this
module, as pure as the machine (no I/O, no clock, no logging), sits in front of them:

- **Routing.** An event about an owner goes to the machines of the lendees that hold
  its GPUs (`World.concerned`), and only to those: a game on lendee A's GPU never
  touches lendee B's machine, so B's node and its jobs never notice. What a lendee
  reports (its start, its stop, a drain, its guest agent, its node's GPU pods) goes to
  its machine alone: the caller names it. Hold, resume and a reclaim by hand go to the
  lendee named, else to all.
- **An owner spanning two lendees waits for both.** Each concerned machine emits
  `StartOwner` when its own lendee has let the owner's GPUs go; the owner is started
  (once) only when every concerned machine has reached that point and still wants it
  (`still_wanted`): no GPU is ever given to two VMs, across lendees too (I2).
- **An intent ends once.** Each concerned machine keeps a copy of the owner's request;
  the first to end it (completed: the owner runs; failed: a drain aborted, its start
  failed) answers the caller, and the others drop their copy (a `CancelIntent` whose
  answer is swallowed), so a request never hangs on one lendee once another failed it.
- **The hook's verdict** for an owner is the sternest of the concerned machines'
  (refuse, then defer, then proceed).

An owner no lendee's GPUs concern belongs to the first lendee's view, which only ever
starts it (`hostagent.core.lendees.view`); so every owner has a machine to keep its
intent. With one lendee all of this is the identity: one machine, every event its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from hostagent.core import machine
from hostagent.core.model import (
    Action,
    CancelIntent,
    CompleteIntent,
    Event,
    FailIntent,
    Hold,
    Observed,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    OwnerWants,
    Policy,
    Reclaim,
    Reserve,
    Resume,
    StartFailed,
    StartOwner,
    State,
    Topology,
    still_wanted,
)
from hostagent.core.rules import IllegalTransition, conflict

__all__ = ["Fleet", "Routed", "World", "routed_by_event", "step", "verdict"]


@dataclass(frozen=True, kw_only=True)
class World:
    """Every lendee's topology and policy, by lendee name, in the configuration's order."""

    topos: Mapping[str, Topology] = field(hash=False)
    policies: Mapping[str, Policy] = field(hash=False)

    def __post_init__(self) -> None:
        if not self.topos or self.topos.keys() != self.policies.keys():
            raise ValueError("every lendee needs a topology and a policy")
        by_lendee = {t.lendee for t in self.topos.values()}
        if by_lendee != set(self.topos):
            raise ValueError("each topology is named by its lendee")
        seen: dict[str, str] = {}
        for name, topo in self.topos.items():
            for gpu in topo.lendee_gpus:
                if gpu in seen:
                    raise ValueError(f"{gpu} is lent to {seen[gpu]} and {name}")
                seen[gpu] = name
        object.__setattr__(self, "topos", MappingProxyType(dict(self.topos)))
        object.__setattr__(self, "policies", MappingProxyType(dict(self.policies)))

    def concerned(self, owner: str) -> tuple[str, ...]:
        """The lendees whose machine keeps `owner` (those that hold any GPU it claims,
        or the first lendee for an owner none does); () for a VM that is no owner."""
        return tuple(name for name, topo in self.topos.items() if topo.is_owner(owner))

    def home(self, owner: str) -> str | None:
        """The lendee whose executor starts `owner` and answers its requests: the first
        that keeps it, so that whoever follows a request hears its whole story there."""
        return next(iter(self.concerned(owner)), None)

    def lendee(self, domain: str) -> str | None:
        """The lendee named `domain`, if it is one."""
        return domain if domain in self.topos else None


@dataclass(frozen=True, kw_only=True)
class Fleet:
    """Every lendee machine's state, and the owners on their way to a start.

    ``ready``: for an owner with a pending request, the lendees whose machine asked to
    start it (it let the owner's GPUs go): the owner starts when all concerned did.
    """

    states: Mapping[str, State] = field(hash=False)
    ready: Mapping[str, frozenset[str]] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Routed:
    """An action for the executor of lendee `lendee`."""

    lendee: str
    action: Action


def routed_by_event(event: Event, world: World) -> bool:
    """Whether `event` is routed by what it is about (an owner's, or one for every
    lendee), rather than belonging to the lendee whose part reports it."""
    return _owner_of(event, world) is not None or isinstance(
        event, Hold | Resume | Reclaim | Reserve)


def _owner_of(event: Event, world: World) -> str | None:
    match event:
        case OwnerWants(owner=o) | OwnerStarted(owner=o) | OwnerStopped(owner=o) | \
                OwnerStarting(owner=o) | CancelIntent(owner=o):
            return o
        case StartFailed(vm=vm) if world.lendee(vm) is None:
            return vm
    return None


def _targets(event: Event, world: World, lendee: str | None) -> tuple[str, ...]:
    if lendee is not None:
        if lendee not in world.topos:
            raise ValueError(f"{lendee} is not a lendee")
        return (lendee,)
    owner = _owner_of(event, world)
    if owner is not None:
        return world.concerned(owner)
    match event:
        case Hold(lendee=str(named)) | Resume(lendee=str(named)) | Reclaim(lendee=str(named)):
            if named not in world.topos:
                raise ValueError(f"{named} is not a lendee")
            return (named,)
        case StartFailed(vm=vm):
            return (vm,)
        case Hold() | Resume() | Reclaim() | Reserve():
            return tuple(world.topos)
    raise ValueError(f"{type(event).__name__} must name its lendee")


def _for(event: Event, topo: Topology) -> Event:
    """`event` as lendee `topo.lendee`'s machine is to see it: only its own owners."""
    match event:
        case Reserve(reservations=rs):
            return replace(event, reservations=tuple(r for r in rs if topo.is_owner(r.vm)))
        case Observed(owners_running=running):
            return replace(event, owners_running=frozenset(o for o in running
                                                           if topo.is_owner(o)))
    return event


def step(fleet: Fleet, event: Event, *, world: World,
         lendee: str | None = None) -> tuple[Fleet, list[Routed]]:
    """The fleet after `event`, and each action with the lendee whose executor runs it.

    `lendee`: the lendee the event is about, for what a lendee reports (its start, its
    stop, the reports of its actions, its node's pods, a fresh read of it); None routes
    by the event. Raises `IllegalTransition` when no machine took the event (every one
    found it stale), and changes nothing then; a machine that finds it stale while
    another takes it keeps its state (the single machine's rule, per lendee).
    """
    names = _targets(event, world, lendee)
    if not names:
        raise IllegalTransition(next(iter(fleet.states.values())).phase, event,
                                "no lendee concerns it")
    if isinstance(event, OwnerWants):
        # Refused by one, refused by all: no machine may keep a request another refused.
        for name in names:
            state, topo = fleet.states[name], world.topos[name]
            rival = None if event.owner in state.running_owners else conflict(
                state, event.owner, topo)
            if rival is not None:
                raise IllegalTransition(state.phase, event, rival)
    states = dict(fleet.states)
    emitted: list[Routed] = []
    first: IllegalTransition | None = None
    taken = False
    for name in names:
        try:
            states[name], actions = machine.step(
                states[name], _for(event, world.topos[name]), topo=world.topos[name],
                policy=world.policies[name])
        except IllegalTransition as e:
            first = first or e
            continue
        taken = True
        emitted += [Routed(name, a) for a in actions]
    if not taken:
        assert first is not None
        raise first
    return _settle(Fleet(states=states, ready=fleet.ready), emitted, event, world)


def _settle(fleet: Fleet, emitted: list[Routed], event: Event,
            world: World) -> tuple[Fleet, list[Routed]]:
    """Gate the owners' starts, end each intent once, drop the others' copies."""
    states = dict(fleet.states)
    ready = {o: set(ls) for o, ls in fleet.ready.items()}
    out: list[Routed] = []
    ended: set[str] = set()  # intent ids answered in this step
    failed: set[str] = set()  # owners whose request one machine failed
    asked: list[str] = []  # owners a machine asked to start in this step
    queue = list(emitted)
    while queue:
        routed = queue.pop(0)
        match routed.action:
            case StartOwner(owner=o):
                ready.setdefault(o, set()).add(routed.lendee)
                if o not in asked:
                    asked.append(o)
            case CompleteIntent(intent_id=i) | FailIntent(intent_id=i) if i in ended:
                continue
            case CompleteIntent(intent_id=i, owner=o):
                ended.add(i)
                out.append(Routed(world.home(o) or routed.lendee, routed.action))
            case FailIntent(intent_id=i, owner=o):
                ended.add(i)
                failed.add(o)
                out.append(Routed(world.home(o) or routed.lendee, routed.action))
            case _:
                out.append(routed)
        if not queue:
            # A request one machine failed is failed: the others let go of their copy.
            for o in sorted(failed):
                for name in world.concerned(o):
                    if not states[name].intents_of(o):
                        continue
                    states[name], actions = machine.step(
                        states[name], CancelIntent(at=event.at, owner=o, by="another lendee"),
                        topo=world.topos[name], policy=world.policies[name])
                    queue += [Routed(name, a) for a in actions]
            failed.clear()
    for o in asked:
        concerned = world.concerned(o)
        if ready.get(o, set()) >= set(concerned) and all(
                still_wanted(states[n], StartOwner(owner=o), topo=world.topos[n])
                for n in concerned):
            out.append(Routed(concerned[0], StartOwner(owner=o)))  # its home
    # The gate lives as long as the request: once no machine keeps one, it is gone.
    kept = {o: frozenset(ls) for o, ls in ready.items()
            if any(states[n].intents_of(o) for n in world.concerned(o))}
    return Fleet(states=states, ready=kept), out


_STERNNESS = {"refuse": 0, "defer": 1, "proceed": 2}


def verdict(fleet: Fleet, domain: str, *, world: World, gpus: frozenset[str] | None = None,
            ) -> tuple[machine.Decision, str]:
    """The hook's answer for `domain` (`machine.verdict`): a lendee's is its machine's;
    an owner's is the sternest of the machines that keep it; anything else proceeds."""
    if world.lendee(domain) is not None:
        return machine.verdict(fleet.states[domain], domain, topo=world.topos[domain],
                               gpus=gpus, policy=world.policies[domain])
    answers = [machine.verdict(fleet.states[n], domain, topo=world.topos[n],
                               policy=world.policies[n]) for n in world.concerned(domain)]
    if not answers:
        return "proceed", f"{domain} is not managed by hostagent"
    return min(answers, key=lambda a: _STERNNESS[a[0]])
