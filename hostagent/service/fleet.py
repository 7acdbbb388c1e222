"""Several lendees in one agent: an `Agent` per lendee, joined by the coordinator.

With ``[lendees.NAME]`` (`hostagent.core.lendees`) each lendee gets the whole single-
lendee composition over its view of the configuration: its machine's state, its
executor, its node's cluster adapter and cordon marker, its journal records, its own
state file. The first lendee's agent is the *primary*: it alone holds the locks, serves
the hook, control, SSH, MQTT and metrics endpoints, and owns the libvirt connection,
whose lifecycle events it hands to the agent concerned (`home`). Every change of state
goes through `Fleet.apply`, which steps `hostagent.core.coordinator` and gives each
agent what its machine decided (`Agent.take`), so that an owner's start reclaims only
the lendees that hold its GPUs and starts once all have let them go.

The primary's state file (``state.toml``, as with one lendee) keeps every pending
request and reservation of every lendee, so that a return to one lendee, or an older
agent, drops none; each other lendee's file (``lendees/NAME.toml`` under ``state_dir``)
keeps what is its own (its node's cordon marker, its phase, its hold). At start the
requests are handed to the lendees that hold their owners' GPUs (`spread`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from hostagent.core import coordinator
from hostagent.core.model import Action, Event, Intent, Policy, State, Topology
from hostagent.core.reserve import Reservation
from hostagent.core.rules import IllegalTransition
from hostagent.core.text import clean

log = logging.getLogger("hostagent")

__all__ = ["Fleet", "Whole"]


class Member(Protocol):
    """What the fleet needs of each lendee's agent."""

    @property
    def lendee(self) -> str: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def policy(self) -> Policy: ...
    state: State

    fleet: Any  # set to the fleet it belongs to

    def take(self, event: Event, new: State, actions: list[Action]) -> None: ...


class Fleet:
    """The lendees' agents, by lendee name, the primary first."""

    def __init__(self, members: Mapping[str, Member]) -> None:
        self.members = dict(members)
        self.ready: Mapping[str, frozenset[str]] = {}
        for member in self.members.values():
            member.fleet = self

    @property
    def primary(self) -> Member:
        return next(iter(self.members.values()))

    def world(self) -> coordinator.World:
        # Read at each step: an agent's policy changes as it learns what its lendee can
        # hot-plug (`policy.hotplug = "auto"`).
        return coordinator.World(topos={n: m.topo for n, m in self.members.items()},
                                 policies={n: m.policy for n, m in self.members.items()})

    def _fleet(self) -> coordinator.Fleet:
        return coordinator.Fleet(states={n: m.state for n, m in self.members.items()},
                                 ready=self.ready)

    def apply(self, event: Event, lendee: str | None) -> bool:
        """Step every machine concerned; each agent takes its new state and actions.
        `lendee`: the lendee whose part reports `event`, unless it is routed by what it
        is about (`coordinator.routed_by_event`). False if no machine took it."""
        world = self.world()
        if coordinator.routed_by_event(event, world):
            lendee = None
        try:
            new, routed = coordinator.step(self._fleet(), event, world=world, lendee=lendee)
        except IllegalTransition as e:
            log.debug("ignored: %s", e)
            return False
        self.ready = new.ready
        actions: dict[str, list[Action]] = {n: [] for n in self.members}
        for r in routed:
            actions[r.lendee].append(r.action)
        for name, member in self.members.items():
            if new.states[name] is not member.state or actions[name]:
                member.take(event, new.states[name], actions[name])
        return True

    def added(self, event: Event) -> dict[str, tuple[Intent, ...]]:
        """The intents `event` would add to each lendee's machine (nothing is changed);
        raises `IllegalTransition` as `apply` would refuse it."""
        world = self.world()
        lendee = None if coordinator.routed_by_event(event, world) else self.primary.lendee
        new, _ = coordinator.step(self._fleet(), event, world=world, lendee=lendee)
        return {n: tuple(i for i in new.states[n].intents if i not in m.state.intents)
                for n, m in self.members.items()}

    def verdict(self, domain: str, gpus: frozenset[str] | None) -> tuple[str, str]:
        return coordinator.verdict(self._fleet(), domain, world=self.world(), gpus=gpus)

    def home(self, domain: str) -> Member:
        """The agent that handles `domain`: a lendee's own, an owner's home (the first
        lendee that keeps it), the primary for any other VM."""
        if domain in self.members:
            return self.members[domain]
        home = self.world().home(domain)
        return self.members[home] if home is not None else self.primary

    def handlers(self, mine: dict[str, Any], verbs_of: Callable[[str], dict[str, Any]],
                 status_now: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The primary's verbs (`mine`), play and release of an owner run by its home's
        verbs (`verbs_of`), which follow its requests; hold, resume, lend and reclaim
        reach every lendee through `apply`; status tells of each lendee (`status_now`:
        `status` of each one's own), or the lendee a "lendee" argument names alone, by its
        verbs (`verbs_of` that lendee). Reservations are the primary's: its part plans
        every lendee's (`Reservations.widen`), and each lendee's machine gets those of
        its owners."""
        def routed(verb: str) -> Any:
            def handler(args: dict[str, Any]) -> Any:
                vm = args.get("vm")
                return (verbs_of(vm) if isinstance(vm, str) else mine)[verb](args)
            return handler

        def named(verb: str) -> Any:
            async def handler(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
                lendee = args.get("lendee")
                if lendee is not None and lendee not in self.members:
                    yield {"ok": False, "error": f"{clean(str(lendee), 64)} is not a lendee: "
                                                 f"the lendees are {', '.join(self.members)}; "
                                                 "name one, or leave --lendee out for every "
                                                 "lendee"}
                    return
                verbs = mine if lendee is None else verbs_of(lendee)
                async for reply in verbs[verb](args):
                    yield reply
            return handler

        async def status(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            async for reply in mine["status"](args):  # the primary's, its health checked
                if reply.get("ok"):
                    reply = {**reply, "data": status_now()}
                yield reply
        out = {verb: routed(verb) if verb in ("play", "release") else
               named(verb) if verb in ("hold", "resume", "lend", "reclaim") else handler
               for verb, handler in mine.items()}
        return {**out, "status": status}

    def status(self, statuses: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """One status of several lendees: the first lendee's, its keys as with one
        lendee (what reads them keeps working), and ``lendees``, each lendee's own part
        (its phase, what it runs with, its node, its relend); each GPU's row is from the
        lendee that lends it and names it (``lendee``), requests and owners from all."""
        first = statuses[self.primary.lendee]
        rows: dict[str, dict[str, Any]] = {}
        for name, each in statuses.items():
            lent = self.members[name].topo.lendee_gpus
            for row in each["gpus"]:
                if row["gpu"] in lent or row["gpu"] not in rows:
                    rows[row["gpu"]] = {**row, "lendee": name if row["gpu"] in lent else None}
        intents: dict[str, Any] = {}
        owners: dict[str, bool] = {}
        for each in statuses.values():
            intents.update((i["id"], i) for i in each["intents"])
            for owner, running in each["owners"].items():
                owners[owner] = owners.get(owner, False) or running
        lendees = [{**each["lendee"], "relend_in_s": each["relend_in_s"],
                    "verified": each["verified"], "cluster": each["cluster"]}
                   for each in statuses.values()]
        return {**first, "gpus": [rows[g] for g in sorted(rows)], "owners": owners,
                "intents": list(intents.values()), "lendees": lendees}

    def status_line(self) -> str:
        """systemd's STATUS: each lendee's phase, then the owners waiting, each once."""
        waiting = dict.fromkeys(o for m in self.members.values() for o in m.state.waiting_owners)
        line = ", ".join(f"{name} {m.state.phase.value}" for name, m in self.members.items())
        return line + (f"; waiting: {', '.join(waiting)}" if waiting else "")

    def owners(self) -> dict[str, frozenset[str]]:
        """Every owner and its GPUs, across the lendees."""
        out: dict[str, frozenset[str]] = {}
        for member in self.members.values():
            for owner, gpus in member.topo.owners.items():
                out[owner] = out.get(owner, frozenset()) | gpus
        return out

    def spread(self) -> None:
        """Each lendee's requests and reservations, as loaded, handed to the lendees that
        keep their owners (`spread`)."""
        states = spread({n: m.state for n, m in self.members.items()},
                        {n: m.topo for n, m in self.members.items()})
        for name, member in self.members.items():
            member.state = states[name]

    def intents(self) -> tuple[Intent, ...]:
        """Every pending request of every lendee, each once, the oldest first."""
        seen: dict[str, Intent] = {}
        for member in self.members.values():
            for intent in member.state.intents:
                seen.setdefault(intent.id, intent)
        return tuple(sorted(seen.values(), key=lambda i: i.created_at))

    def reservations(self) -> tuple[Reservation, ...]:
        seen: dict[str, Reservation] = {}
        for member in self.members.values():
            for r in member.state.reservations:
                seen.setdefault(r.vm, r)
        return tuple(seen.values())


class Whole:
    """Every lendee's state as the first lendee's reservations read it (a `View`, see
    `Reservations.widen`): the first's, with every lendee's reservations, running owners
    and lent GPUs (GPU labels are one lendee's each)."""

    def __init__(self, fleet: Fleet, primary: Any) -> None:
        self.fleet, self.primary = fleet, primary  # `primary`: its agent's `View`

    @property
    def state(self) -> State:
        states = [m.state for m in self.fleet.members.values()]
        return replace(states[0], reservations=self.fleet.reservations(),
                       running_owners=frozenset().union(*(s.running_owners for s in states)),
                       lent=frozenset().union(*(s.lent for s in states)))

    @property
    def phase_since(self) -> float:
        return float(self.primary.phase_since)

    @property
    def save_failed(self) -> str | None:
        return self.primary.save_failed  # type: ignore[no-any-return]


def spread(states: Mapping[str, State], topos: Mapping[str, Topology]) -> dict[str, State]:
    """The states as loaded, each lendee's pending requests and reservations those of
    the owners it keeps, from whichever file listed them (the primary's lists them all;
    one written with a single lendee, before the others were configured, too). A request
    for a VM no lendee keeps stays with the primary, whose machine fails it, saying so."""
    first = next(iter(states))
    intents: dict[str, Intent] = {}
    reservations: dict[str, Reservation] = {}
    for state in states.values():
        for intent in state.intents:
            intents.setdefault(intent.id, intent)
        for r in state.reservations:
            reservations.setdefault(r.vm, r)
    kept = {o for topo in topos.values() for o in topo.owners}

    def mine(name: str, owner: str) -> bool:
        return topos[name].is_owner(owner) or (name == first and owner not in kept)

    return {name: replace(
        state,
        intents=tuple(sorted((i for i in intents.values() if mine(name, i.owner)),
                             key=lambda i: i.created_at)),
        reservations=tuple(r for r in reservations.values() if mine(name, r.vm)))
        for name, state in states.items()}
