"""The lendee cordoned ahead of an owner's usual hour (hostagent.service.ahead), one look
at the clock at a time, with the cluster a recorder at the agent's `Cluster` seam and
the history given."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from hostagent.core.config import Config, parse
from hostagent.core.model import Phase, State
from hostagent.core.topology import topology
from hostagent.service import ahead
from hostagent.service import main as service
from hostagent.service.agent import Agent
from hostagent.service.ahead import AheadOfUsual
from tests.configs import lendee_toml
from tests.waiting import until
from tests.unit.agents import TWO_LENDEES

TZ = timezone(timedelta(hours=1))
MONDAY_8PM = datetime(2026, 11, 30, 20, 0, tzinfo=TZ)
WHY = "ahead of gaming1's usual hour (Mon 20:00)"


def config(on: bool = True) -> Config:
    return parse(lendee_toml(uuids=False) + f"""
[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]

[kubernetes]

[drain]
cordon_ahead = {str(on).lower()}
ahead_lead = "15m"
""")


class Recorder:
    def __init__(self) -> None:
        self.said: list[str] = []

    async def cordon_ahead(self, why: str) -> bool:
        self.said.append(f"cordon {why}")
        return True

    async def uncordon_ahead(self, why: str) -> None:
        self.said.append(f"uncordon: {why}")


@dataclass
class Kept:
    state: State


def played(weeks: Sequence[int], minutes: int = 5) -> Mapping[str, Sequence[datetime]]:
    return {"gaming1": [MONDAY_8PM - timedelta(weeks=n, minutes=-minutes) for n in weeks]}


def ahead_of(state: State, starts: Mapping[str, Sequence[datetime]]) -> tuple[
        AheadOfUsual, Recorder, Kept]:
    cfg = config()
    cluster, kept = Recorder(), Kept(state)

    async def read() -> Mapping[str, Sequence[datetime]]:
        return starts
    return AheadOfUsual(cfg, topology(cfg), kept, cluster, starts=read), cluster, kept  # type: ignore[arg-type]


LENT = State(phase=Phase.LENT, lent=frozenset({"gpu-a", "gpu-b"}))


async def test_cordoned_lead_before_the_usual_hour_and_uncordoned_when_it_passes() -> None:
    loop, cluster, _ = ahead_of(LENT, played([1, 2, 3]))
    await loop.step(MONDAY_8PM - timedelta(minutes=20))
    assert cluster.said == []
    await loop.step(MONDAY_8PM - timedelta(minutes=14))
    await loop.step(MONDAY_8PM + timedelta(minutes=30))  # once
    assert cluster.said == [f"cordon {WHY}"]
    await loop.step(MONDAY_8PM + timedelta(minutes=61))
    assert cluster.said == [f"cordon {WHY}",
                            "uncordon: gaming1's usual hour (Mon 20:00) passed without a start"]


async def test_an_hour_seen_in_too_few_weeks_cordons_nothing() -> None:
    loop, cluster, _ = ahead_of(LENT, played([1, 3]))  # 2 of the last 4 weeks
    await loop.step(MONDAY_8PM - timedelta(minutes=5))
    assert cluster.said == []


async def test_not_while_the_lendee_holds_none_of_the_owners_gpus() -> None:
    loop, cluster, _ = ahead_of(replace(LENT, lent=frozenset({"gpu-b"})), played([1, 2, 3]))
    await loop.step(MONDAY_8PM - timedelta(minutes=5))
    assert cluster.said == []


async def test_a_start_takes_the_cordon_over_and_nothing_is_lifted() -> None:
    """The owner started: the reclaim's cordon is the reclaim's, never lifted here."""
    loop, cluster, kept = ahead_of(LENT, played([1, 2, 3]))
    await loop.step(MONDAY_8PM - timedelta(minutes=5))
    kept.state = replace(LENT, phase=Phase.DRAINING)
    await loop.step(MONDAY_8PM + timedelta(minutes=2))
    kept.state = replace(LENT, phase=Phase.OFF, lent=frozenset())
    await loop.step(MONDAY_8PM + timedelta(minutes=70))
    assert cluster.said == [f"cordon {WHY}"]
    assert loop.cordoned_for is None


TWO_LENDEES_AHEAD = TWO_LENDEES + """
[kubernetes]

[drain]
cordon_ahead = true
"""


@pytest.mark.usefixtures("sink")  # journal records in memory (conftest)
async def test_with_two_lendees_the_one_holding_the_owners_gpu_is_cordoned_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gaming2 usually plays now, on gpu-b, which node-b holds: node-b's node is cordoned
    ahead of it, not node-a's, the first lendee (the one the loop used to look at alone)."""
    now = datetime.now().astimezone()
    starts = {"gaming2": [now - timedelta(weeks=n) for n in (1, 2, 3)]}

    async def read() -> Mapping[str, Sequence[datetime]]:
        return starts
    monkeypatch.setattr(ahead, "starts_in_journal", lambda weeks: read)
    clusters = {name: Recorder() for name in ("node-a", "node-b")}
    primary = service.build(parse(TWO_LENDEES_AHEAD.format(root=tmp_path), "test.toml"),
                            cluster=clusters.get)  # type: ignore[arg-type]
    assert primary.fleet is not None
    members = [m for m in primary.fleet.members.values() if isinstance(m, Agent)]
    for member, gpu in zip(members, ("gpu-a", "gpu-b"), strict=True):
        member.kept.state = State(phase=Phase.LENT, lent=frozenset({gpu}))
    task = asyncio.create_task(primary.reservations.run([m.reservations for m in members]))
    try:
        await until(lambda: clusters["node-b"].said, "node-b cordoned ahead")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    said = clusters["node-b"].said
    assert len(said) == 1 and said[0].startswith("cordon ahead of gaming2's usual hour ("), said
    assert clusters["node-a"].said == []
