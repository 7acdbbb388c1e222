"""The lendee cordoned ahead of an owner's usual hour (``[drain] cordon_ahead``), the
third lever of a player's wait (`hostagent.core.levers`): from the owners' starts in
the journal's history, the hours each usually plays; from ``ahead_lead`` before such an
hour until it ends, the node of the lendee holding that owner's GPUs takes no new pod,
so that the start finds it as idle as the running pods leave it; when the hour passes
without a start, the node is uncordoned. Only while the lendee is lent: a reclaim takes
the cordon over (its write drops the reason), a return lifts it.

A loop beside the reservations' timeline (`Reservations.run` starts it); the decisions
are pure (`levers.usual_hours`, `levers.ahead`), the history is read in a worker thread
once an hour, the cordon goes through the `Cluster` seam (our marker: an
administrator's cordon is never touched).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime

from hostagent.core import levers
from hostagent.core.config import Config
from hostagent.core.model import Phase, Topology
from hostagent.host import journal
from hostagent.service.parts import Cluster, View
from hostagent.surfaces import history

log = logging.getLogger("hostagent")

# Each owner's past starts (local time), oldest first.
Starts = Callable[[], Awaitable[Mapping[str, Sequence[datetime]]]]


def starts_in_journal(weeks: int) -> Starts:
    """The owners' starts of the last `weeks` weeks, as `hostagent history` reads them
    (the service's own records only)."""
    async def read() -> Mapping[str, Sequence[datetime]]:
        records = await asyncio.to_thread(history.read_journal,
                                          since=f"{weeks * 7 + 1} days ago")
        found: dict[str, list[datetime]] = {}
        for t in history.build(records).transitions:
            if t.event == "owner" and t.to == "running":
                found.setdefault(t.vm, []).append(datetime.fromtimestamp(t.at).astimezone())
        return found
    return read


class AheadOfUsual:
    """The loop; `step` is one look at the clock, for tests."""

    def __init__(self, cfg: Config, topo: Topology, view: View, cluster: Cluster, *,
                 starts: Starts | None = None, every: float = 60.0,
                 refresh: float = 3600.0) -> None:
        self.cfg, self.topo, self.view, self.cluster = cfg, topo, view, cluster
        self.policy = cfg.drain
        self._read = starts or starts_in_journal(self.policy.usual_of)
        self.every, self.refresh = every, refresh
        self.starts: Mapping[str, Sequence[datetime]] = {}
        self._read_at: float | None = None
        self.cordoned_for: str | None = None  # why we cordoned the node ahead, if we did

    async def run(self) -> None:
        while True:
            await self.step(datetime.now().astimezone())
            await asyncio.sleep(self.every)

    async def _history(self) -> None:
        if self._read_at is not None and time.monotonic() - self._read_at < self.refresh:
            return
        self._read_at = time.monotonic()
        try:
            self.starts = await self._read()
        except history.HistoryError as e:
            journal.record("ahead", f"the owners' usual hours are unknown: {e}; the lendee "
                           "is not cordoned ahead of them", result="unread",
                           priority=journal.Priority.WARNING)

    async def step(self, now: datetime) -> None:
        await self._history()
        state = self.view.state
        window = None
        if state.phase is Phase.LENT and not state.attaching and not state.detaching:
            usual = {o: levers.usual_hours(self.starts.get(o, ()), now,
                                           seen=self.policy.usual_weeks,
                                           weeks=self.policy.usual_of)
                     for o in self.topo.owners
                     if self.topo.claims(o) & state.lent and o not in state.running_owners}
            window = levers.ahead(usual, now, lead=self.policy.ahead_lead)
        why = None if window is None else str(window)
        if why == self.cordoned_for:
            return
        if why is not None:
            if await self.cluster.cordon_ahead(why):
                self.cordoned_for = why
            return
        was, self.cordoned_for = self.cordoned_for, None
        if was is not None and state.phase is Phase.LENT:
            await self.cluster.uncordon_ahead(f"{was.removeprefix('ahead of ')} passed "
                                              "without a start")
