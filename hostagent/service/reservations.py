"""The reservations' timeline, run: the pods' notice, the hold, the end (`hostagent.core.reserve`
says what each is and decides when). One task of the agent's (`run`) sleeps until the
next moment due or a change of state (an owner started: a reservation used), does
what is due, and tells the machine the new list (`Reserve`), which is persisted with
the state. Each change is one journal record (``HOSTAGENT_EVENT=reserve``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from hostagent.core import clock
from hostagent.host import journal
from hostagent.core import reserve as plan
from hostagent.core.config import Config
from hostagent.core.model import Reserve, Topology
from hostagent.service.parts import Apply, Cluster, View
from hostagent.core.reserve import Reservation


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
        # The state file's flush (the agent's saver): a reservation is on disk before
        # its caller hears it is taken.
        self.saved = saved
        self.lendee = topo.lendee
        policy = cfg.policy
        self.timing = plan.Timing(lead=policy.reserve_lead, margin=policy.reserve_margin,
                                  expiry=policy.reserve_expiry)
        self._changed = asyncio.Event()

    @property
    def now(self) -> tuple[Reservation, ...]:
        return self.view.state.reservations

    def wake(self) -> None:
        """Something changed (the agent's watchers): look again."""
        self._changed.set()

    def _set(self, reservations: tuple[Reservation, ...]) -> None:
        self.apply(Reserve(at=clock.now(), reservations=reservations))
        self._changed.set()

    async def durable(self) -> str | None:
        """None once the reservations are on disk, else why they are not."""
        error = await self.saved() if self.saved is not None else None
        return None if error is None else f"{error.strerror or error}"

    def reserve(self, vm: str, at: float, *, by: str) -> str:
        """`vm` is played from `at` (checked by the caller): one sentence saying what
        happens when."""
        replaced = next((r for r in self.now if r.vm == vm), None)
        new = Reservation(vm=vm, at=at, by=by, made=clock.now())
        self._set(plan.put(self.now, new))
        gpus = self.topo.gpu_names(self.topo.claims(vm))
        notice = max(clock.now(), at - self.timing.lead)
        message = (f"{vm} is reserved for {_hhmm(at)} by {by}: {gpus} will be free then "
                   f"(the pods using them get notice at {_hhmm(notice)} and their grace "
                   f"period); unused by {_hhmm(at + self.timing.expiry)}, it is lent again")
        if replaced is not None:
            message += f" (it replaces the one for {_hhmm(replaced.at)})"
        journal.record("reserve", message, vm=vm, result="reserved", at=_hhmm(at), by=by)
        return message

    def cancel(self, vm: str, *, by: str) -> str | None:
        """Drop `vm`'s reservation; what happens then, or None when it had none."""
        mine = next((r for r in self.now if r.vm == vm), None)
        if mine is None:
            return None
        self._set(plan.without(self.now, [mine]))
        message = (f"{vm}'s reservation for {_hhmm(mine.at)} is cancelled by {by}"
                   + ("; its GPUs are lent again" if mine.holding else ""))
        journal.record("reserve", message, vm=vm, result="cancelled", by=by)
        return message

    def status(self) -> list[dict[str, Any]]:
        return [{"vm": r.vm, "at": r.at, "by": r.by, "holding": r.holding,
                 "evict_at": r.evict_at, "expires_at": r.at + self.timing.expiry}
                for r in self.now]

    async def run(self) -> None:
        """Until cancelled: do what is due, then sleep until the next moment or change."""
        while True:
            self._changed.clear()
            await self.step()
            wake = plan.next_wake(self.now, self.timing)
            with contextlib.suppress(TimeoutError):
                timeout = None if wake is None else max(0.0, wake - clock.now()) + 0.05
                await asyncio.wait_for(self._changed.wait(), timeout)

    async def step(self) -> None:
        """Everything due now: the ends (used, expired), the notices, the holds."""
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
        due = plan.due(self.now, clock.now(), self.timing)
        for r in due.expire:
            gpus = self.topo.gpu_names(self.topo.claims(r.vm))
            journal.record("reserve", f"nobody started {r.vm} by "
                           f"{_hhmm(r.at + self.timing.expiry)}: its reservation for "
                           f"{_hhmm(r.at)} expired, and its GPUs are lent again ({gpus})",
                           vm=r.vm, result="expired")
        if used or due.expire:
            self._set(plan.without(self.now, [*used, *due.expire]))
        for r in due.notify:
            await self._notify(r)
        for r in plan.due(self.now, clock.now(), self.timing).hold:
            self._set(plan.changed(self.now, r.vm, holding=True))
            gpus = self.topo.gpu_names(self.topo.claims(r.vm))
            lent = bool(self.topo.claims(r.vm) & self.view.state.lent)
            journal.record("reserve", f"{r.vm}'s reservation for {_hhmm(r.at)} holds {gpus} "
                           "now" + (f": {self.lendee} gives them back, its pods with their "
                                    "grace period" if lent else ""), vm=r.vm, result="holding")

    async def _notify(self, r: Reservation) -> None:
        """The notice: the GPU pods told when their eviction begins (the time less their
        longest grace period and the margin), and that time kept."""
        def when(grace: float) -> float:
            return plan.evict_time(r, grace, self.timing, clock.now())

        def message(at: str) -> str:
            return (f"a GPU of node {self.lendee} is reserved for {r.vm} at "
                    f"{_hhmm(r.at)}: this pod may be evicted from {at}, with its full "
                    "grace period; checkpoint before then")
        evict, pods = await self.cluster.notice(when, message)
        if not any(x.vm == r.vm and x.at == r.at for x in self.now):
            return  # cancelled or replaced meanwhile
        self._set(plan.changed(self.now, r.vm, evict_at=evict))
        told = f"told {', '.join(pods)}" if pods else "no GPU pod to tell"
        journal.record("reserve", f"{r.vm}'s reservation for {_hhmm(r.at)}: its GPUs are "
                       f"taken back from {_hhmm(evict)}; {told}", vm=r.vm, result="notice",
                       pods=", ".join(pods))
