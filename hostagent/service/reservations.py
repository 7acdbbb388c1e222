"""The reservations' timeline, run: the pods' notice, the hold, the end (`hostagent.core.reserve`
says what each is and decides when). One task of the agent's (`run`) sleeps until the
next moment due or a change of state (an owner started: a reservation used), does
what is due, and tells the machine the new list (`Reserve`), which is persisted with
the state. Each change is one journal record (``HOSTAGENT_EVENT=reserve``). A
reservation of a series (``every``) that ends, used, expired, yielded or cancelled
alone, has the series' next occurrence put in its place."""

from __future__ import annotations

import asyncio
import contextlib
import os
import zoneinfo
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, tzinfo, UTC
from typing import Any

from hostagent.core import clock
from hostagent.host import journal
from hostagent.core import reserve as plan
from hostagent.core.config import Config
from hostagent.core.model import Reserve, Topology
from hostagent.service.ahead import AheadOfUsual
from hostagent.service.parts import Apply, Cluster, View
from hostagent.core.reserve import Reservation


def local_zone() -> tzinfo:
    """The host's zone with its rules (daylight saving), as the C library reads it: $TZ,
    else /etc/localtime; else today's offset alone. Reads a file: not on the loop."""
    name = os.environ.get("TZ", "").lstrip(":")
    try:
        if name and not name.startswith("/"):
            return zoneinfo.ZoneInfo(name)
        with open(name or "/etc/localtime", "rb") as f:
            return zoneinfo.ZoneInfo.from_file(f, key=name or "localtime")
    except (OSError, ValueError, zoneinfo.ZoneInfoNotFoundError):
        return datetime.now().astimezone().tzinfo or UTC


def _hhmm(at: float) -> str:
    """`at` on the host's clock: "20:00", or "Sat 20:00" when it is not today."""
    when, now = datetime.fromtimestamp(at).astimezone(), datetime.now().astimezone()
    return when.strftime("%H:%M" if when.date() == now.date() else "%a %d %b %H:%M")


class Reservations:
    """Players' reservations, kept in the machine's state (``reservations``)."""

    def __init__(self, cfg: Config, topo: Topology, view: View, apply: Apply, *,
                 cluster: Cluster,
                 saved: Callable[[], Awaitable[OSError | None]] | None = None) -> None:
        self.topo, self.view, self.apply, self.cluster = topo, view, apply, cluster
        self.cfg = cfg
        # The state file's flush (the agent's saver): a reservation is on disk before
        # its caller hears it is taken.
        self.saved = saved
        self.lendee = topo.lendee
        policy = cfg.policy
        self.timing = plan.Timing(lead=policy.reserve_lead, margin=policy.reserve_margin,
                                  expiry=policy.reserve_expiry, cooldown=policy.reserve_cooldown)
        self._changed = asyncio.Event()
        self._unsaved: set[str] = set()  # VMs whose new reservation is being saved
        # VM -> until when it may not be reserved again (one that held ended unused). Kept
        # in memory: a restart forgets it, which only the host's administrator can cause.
        self._cooldown: dict[str, float] = {}
        # This lendee's own, for the usual hours (`ahead`), where `widen` plans them all.
        self.own: tuple[Topology, View] = (topo, view)
        self._nodes: Callable[[str], list[tuple[str, Cluster]]] | None = None

    def widen(self, topo: Topology, view: View,
              nodes: Callable[[str], list[tuple[str, Cluster]]]) -> None:
        """Several lendees: this, the first lendee's, plans every lendee's reservations,
        one timeline for each reservation (one per lendee would notice and end twice a
        reservation of an owner on two lendees):
        `topo` has every owner, `view` every lendee's reservations, running owners and
        lent GPUs, and `nodes(vm)` the lendees whose GPUs `vm` claims, with their
        clusters (read when used: connecting replaces them), which get its notice.
        Each lendee's machine gets the reservations of its owners (`coordinator`)."""
        self.topo, self.view, self._nodes = topo, view, nodes

    def _lendees(self, vm: str) -> list[tuple[str, Cluster]]:
        """The lendees `vm`'s reservation takes GPUs from, and their clusters."""
        return self._nodes(vm) if self._nodes is not None else [(self.lendee, self.cluster)]

    def _named(self, vm: str) -> str:
        return " and ".join(name for name, _ in self._lendees(vm)) or self.lendee

    @property
    def now(self) -> tuple[Reservation, ...]:
        return self.view.state.reservations

    def wake(self) -> None:
        """Something changed (the agent's watchers): look again."""
        self._changed.set()

    def _set(self, reservations: tuple[Reservation, ...]) -> bool:
        ok = self.apply(Reserve(at=clock.now(), reservations=reservations))
        self._changed.set()
        return ok

    async def durable(self) -> str | None:
        """None once the reservations are on disk, else why they are not."""
        error = await self.saved() if self.saved is not None else None
        return None if error is None else f"{error.strerror or error}"

    def cooling(self, vm: str) -> float | None:
        """Until when `vm` may not be reserved again (a reservation of it that held ended
        unused), or None."""
        until = self._cooldown.get(vm)
        return until if until is not None and clock.now() < until else None

    def _cool(self, r: Reservation) -> None:
        if r.holding or r.yielding:
            self._cooldown[r.vm] = clock.now() + self.timing.cooldown

    @staticmethod
    def _owned(r: Reservation, principal: str, cancel_any: bool) -> bool:
        return cancel_any or (bool(principal) and r.principal == principal)

    async def reserve(self, vm: str, at: float, *, by: str, principal: str = "",
                      cancel_any: bool = True, note: str | None = None,
                      every: str | None = None) -> tuple[bool, str]:
        """`vm` is played from `at` (checked by the caller): (taken, one sentence saying
        what happens when, or why not). Taken only once on disk: until then the timeline
        leaves it alone, and a save that fails takes it back. Replacing a reservation
        someone else made takes `cancel_any`."""
        replaced = next((r for r in self.now if r.vm == vm), None)
        if replaced is not None and not self._owned(replaced, principal, cancel_any):
            return False, (f"{vm} is already reserved for {_hhmm(replaced.at)} by "
                           f"{replaced.by}: only they, or a caller granted cancel-any, may "
                           "change it")
        until = self.cooling(vm)
        if until is not None:
            return False, (f"{vm} cannot be reserved again before {_hhmm(until)}: its last "
                           "reservation held its GPUs and went unused (policy.reserve_cooldown)")
        new = Reservation(vm=vm, at=at, by=by, made=clock.now(), principal=principal,
                          every=every)
        listed = plan.put(self.now, new)
        new = next(r for r in listed if r.vm == vm)
        self._unsaved.add(vm)
        try:
            if not self._set(listed):
                return False, (f"{vm} is not reserved: the agent refused the change (journalctl "
                               "-u hostagent says why)")
            unsaved = await self.durable()
            if unsaved is not None:
                if new in self.now:  # nobody changed it meanwhile: as it was before
                    self._set(plan.put(self.now, replaced) if replaced is not None
                              else plan.without(self.now, [new]))
                return False, (f"{vm} is not reserved: the reservation could not be recorded "
                               f"({unsaved}); ask again")
        finally:
            self._unsaved.discard(vm)
            self._changed.set()
        gpus = self.topo.gpu_names(self.topo.claims(vm))
        notice = max(clock.now(), at - self.timing.lead)
        message = (f"{vm} is reserved for {_hhmm(at)} by {by}: {gpus} will be free then "
                   f"(the pods using them get notice at {_hhmm(notice)} and their grace "
                   f"period); unused by {_hhmm(at + self.timing.expiry)}, it is lent again")
        if note:
            message += f" ({note})"
        if every:
            message += (f"; every {every}, each occurrence reserved once the one before "
                        "ends (--cancel drops one, --cancel --all the series)")
        if replaced is not None:
            message += f" (it replaces the one for {_hhmm(replaced.at)})"
        journal.record("reserve", message, vm=vm, result="reserved", at=_hhmm(at), by=by)
        return True, message

    async def cancel(self, vm: str, *, by: str, principal: str = "",
                     cancel_any: bool = True, series: bool = False) -> tuple[bool, str]:
        """Drop `vm`'s reservation, once that is on disk: (done, what happens then, or why
        not); of a series, its next occurrence takes its place unless `series` (the
        whole series is dropped). Only who reserved it, or `cancel_any`, may."""
        mine = next((r for r in self.now if r.vm == vm), None)
        if mine is None:
            return False, f"{vm} has no reservation to cancel"
        if not self._owned(mine, principal, cancel_any):
            return False, (f"{vm}'s reservation for {_hhmm(mine.at)} was made by {mine.by}: "
                           "only they, or a caller granted cancel-any, may cancel it")
        following = None
        if mine.every and not series:
            following = self._following(mine, await asyncio.to_thread(local_zone))
        listed = plan.without(self.now, [mine])
        if following is not None:
            listed = plan.put(listed, following)
        if not self._set(listed):
            return False, (f"{vm}'s reservation is not cancelled: the agent refused the "
                           "change (journalctl -u hostagent says why)")
        unsaved = await self.durable()
        if unsaved is not None:
            now = [r for r in self.now if r.vm == vm]
            if now in ([], [following]):  # nobody reserved it meanwhile
                self._set(plan.put(self.now, mine))
            return False, (f"{vm}'s reservation is not cancelled: the change could not be "
                           f"recorded ({unsaved}); ask again")
        self._cool(mine)
        message = (f"{vm}'s reservation for {_hhmm(mine.at)} is cancelled by {by}"
                   + ("; its GPUs are lent again" if mine.holding else ""))
        if following is not None:
            message += (f"; the next of every {mine.every} is {_hhmm(following.at)} "
                        "(--cancel --all ends the series)")
        elif mine.every:
            message += f", and with it the series every {mine.every}"
        journal.record("reserve", message, vm=vm, result="cancelled", by=by)
        return True, message

    def status(self) -> list[dict[str, Any]]:
        return [{"vm": r.vm, "at": r.at, "by": r.by, "holding": r.holding,
                 "yielding": r.yielding, "evict_at": r.evict_at,
                 "expires_at": r.at + self.timing.expiry, "every": r.every}
                for r in self.now]

    async def run(self, lendees: Sequence[Reservations] = ()) -> None:
        """Until cancelled: do what is due, then sleep until the next moment or change.
        Beside it, with ``[drain] cordon_ahead``, the owners' usual hours (`ahead`), one
        loop per lendee (`lendees`: every lendee's part, this one's among them; none:
        this one alone), each cordoning its own node for the owners whose GPUs it holds
        (its `own` topology and view, not the whole that `widen` gave the first)."""
        ahead = [AheadOfUsual(p.cfg, *p.own, p.cluster) for p in lendees or (self,)
                 if p.cfg.drain.cordon_ahead and p.cfg.kubernetes is not None]
        if ahead:
            async with asyncio.TaskGroup() as group:
                for beside in ahead:
                    group.create_task(beside.run())
                group.create_task(self._run())
            return
        await self._run()

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            await self.step()
            wake = plan.next_wake(self.now, self.timing)
            with contextlib.suppress(TimeoutError):
                timeout = None if wake is None else max(0.0, wake - clock.now()) + 0.05
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def step(self) -> None:
        """Everything due now: the ends (used, expired, yielded), the notices, the holds,
        the yields. A reservation not yet on disk (`reserve` waits for its save) waits."""
        state = self.view.state
        gone = [r for r in state.reservations if not self.topo.is_owner(r.vm)]
        for r in gone:  # kept in the state file from a configuration that had it
            journal.record("reserve", f"{r.vm[:64]!r} is no owner VM any more: its "
                           f"reservation for {_hhmm(r.at)} is dropped", result="dropped")
        if gone:
            self._set(plan.without(self.now, gone))
            state = self.view.state
        used = plan.used(state.reservations, state.running_owners)
        for r in used:
            journal.record("reserve", f"{r.vm} started: its reservation for {_hhmm(r.at)} "
                           "is used", vm=r.vm, result="used")
        due = plan.due(self._live(), clock.now(), self.timing)
        for r in due.expire:
            gpus = self.topo.gpu_names(self.topo.claims(r.vm))
            journal.record("reserve", f"nobody started {r.vm} by "
                           f"{_hhmm(r.at + self.timing.expiry)}: its reservation for "
                           f"{_hhmm(r.at)} expired, and its GPUs are lent again ({gpus}); "
                           f"it may be reserved again from "
                           f"{_hhmm(clock.now() + self.timing.cooldown)}",
                           vm=r.vm, result="expired")
        yielded = plan.yielded(self._live(), state.running_owners, self.topo.claims)
        for r, other in yielded:
            journal.record("reserve", f"{other} started: {r.vm}'s reservation for "
                           f"{_hhmm(r.at)} (by {r.by}) went unused past its time and yields "
                           f"to it; {r.vm} may be reserved again from "
                           f"{_hhmm(clock.now() + self.timing.cooldown)}",
                           vm=r.vm, result="yielded", by=r.by, other=other)
        ended = [*due.expire, *(r for r, _ in yielded)]
        for r in ended:
            self._cool(r)
        if used or ended:
            self._set(plan.without(self.now, [*used, *ended]))
        series = [r for r in (*used, *ended) if r.every]
        zone = await asyncio.to_thread(local_zone) if series else UTC
        for r in series:
            following = self._following(r, zone)
            if following is not None and not any(x.vm == r.vm for x in self.now):
                self._set(plan.put(self.now, following))
                journal.record("reserve", f"{r.vm} is reserved for {_hhmm(following.at)} by "
                               f"{r.by}: the next of every {r.every}", vm=r.vm,
                               result="reserved", at=_hhmm(following.at), by=r.by)
        for r in due.notify:
            await self._notify(r)
        for r in plan.due(self._live(), clock.now(), self.timing).hold:
            self._set(plan.changed(self.now, r.vm, holding=True))
            gpus = self.topo.gpu_names(self.topo.claims(r.vm))
            lent = bool(self.topo.claims(r.vm) & self.view.state.lent)
            journal.record("reserve", f"{r.vm}'s reservation for {_hhmm(r.at)} holds {gpus} "
                           "now" + (f": {self._named(r.vm)} gives them back, its pods with "
                                    "their grace period" if lent else ""), vm=r.vm,
                           result="holding")
        for r in plan.due(self._live(), clock.now(), self.timing).yields:
            self._set(plan.changed(self.now, r.vm, yielding=True))
            journal.record("reserve", f"{r.vm}'s reservation for {_hhmm(r.at)} is unused past "
                           "its time: another owner of its GPUs may start now, which ends "
                           f"it; else it keeps them from {self._named(r.vm)} until "
                           f"{_hhmm(r.at + self.timing.expiry)}", vm=r.vm, result="yielding")

    def _following(self, r: Reservation, zone: tzinfo) -> Reservation | None:
        """The occurrence of `r`'s series after `r` (and after now), or None (journaled)
        where its series cannot be read (a state file written by hand)."""
        assert r.every is not None
        try:
            every = plan.read_every(r.every)
            at, skipped = plan.next_occurrence(every, max(r.at, clock.now()), zone)
        except plan.BadReservation as e:
            journal.record("reserve", f"{r.vm}'s series every {r.every[:64]!r} ends: {e}",
                           vm=r.vm, result="dropped", priority=journal.Priority.WARNING)
            return None
        for day in skipped:
            journal.record("reserve", f"{r.vm}'s series every {every} passes over {day}: "
                           "the host's clock skips that time then (daylight saving)",
                           vm=r.vm, result="skipped")
        return Reservation(vm=r.vm, at=at, by=r.by, made=clock.now(), principal=r.principal,
                           every=str(every))

    def _live(self) -> tuple[Reservation, ...]:
        """The reservations on disk: those `reserve` is still saving wait for it."""
        return tuple(r for r in self.now if r.vm not in self._unsaved)

    async def _notify(self, r: Reservation) -> None:
        """The notice: the GPU pods told when their eviction begins (the time less their
        longest grace period and the margin), and that time kept."""
        def when(grace: float) -> float:
            return plan.evict_time(r, grace, self.timing, clock.now())

        def message(lendee: str) -> Callable[[str], str]:
            return lambda at: (f"a GPU of node {lendee} is reserved for {r.vm} at "
                               f"{_hhmm(r.at)}: this pod may be evicted from {at}, with its "
                               "full grace period; checkpoint before then")
        # Each node its own notice; the GPUs are taken back when the earliest begins.
        evict, pods = when(0.0), list[str]()
        for i, (lendee, cluster) in enumerate(self._lendees(r.vm)):
            at, pods_told = await cluster.notice(when, message(lendee))
            evict = at if i == 0 else min(evict, at)
            pods += pods_told
        if not any(x.vm == r.vm and x.at == r.at for x in self.now):
            return  # cancelled or replaced meanwhile
        self._set(plan.changed(self.now, r.vm, evict_at=evict))
        told = f"told {', '.join(pods)}" if pods else "no GPU pod to tell"
        journal.record("reserve", f"{r.vm}'s reservation for {_hhmm(r.at)}: its GPUs are "
                       f"taken back from {_hhmm(evict)}; {told}", vm=r.vm, result="notice",
                       pods=", ".join(pods))
