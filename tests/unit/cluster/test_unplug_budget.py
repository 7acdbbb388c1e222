"""A hot-unplug's time in the cluster, while a player waits: its evictions and the pause
of the node's GPU plugins share the one ``timeouts.drain`` that the reclaim by restart
after them (if it gives way) drains within, so that the player's wait is bounded as
README says. The `Kube` adapter is stood in at its seam: what is checked is the budget
each call is given, not the API server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from hostagent.cluster.cycle import KubeCluster
from hostagent.cluster.kube import Kube
from hostagent.core.config import parse
from hostagent.host import journal
from tests.configs import lendee_toml

DRAIN = 2.0


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


@dataclass
class _Cordon:
    cordoned_by_us: bool = False


@dataclass
class _Report:
    complete: bool = True
    left: list[Any] = field(default_factory=list)


@dataclass
class BudgetKube:
    """The calls a hot-unplug and the reclaim after it make, each timeout kept; the
    plugins take `pause_takes` seconds to go."""

    pause_takes: float = 0.0
    pause_timeouts: list[float] = field(default_factory=list)
    drain_timeouts: list[float] = field(default_factory=list)

    async def cordon(self, node: str, *, marker_prefix: str, timeout: float,
                     **_: Any) -> _Cordon:
        return _Cordon()

    async def annotate(self, node: str, annotations: dict[str, str | None],
                       **_: Any) -> None:
        return None

    async def post_event(self, node: str, **_: Any) -> None:
        return None

    async def pause_plugins(self, node: str, *, selectors: Collection[str],
                            labels: Collection[str], prefix: str,
                            timeout: float) -> list[str]:
        self.pause_timeouts.append(timeout)
        await asyncio.sleep(min(self.pause_takes, timeout))
        return ["gpu-operator/nvidia-device-plugin-daemonset-x"]

    async def drain(self, node: str, *, timeout: float, **_: Any) -> _Report:
        self.drain_timeouts.append(timeout)
        return _Report()


async def test_the_plugins_pause_and_the_fallback_drain_share_the_unplugs_drain_budget(
) -> None:
    """Before, the pause waited up to timeouts.ready (10 minutes by default) for the
    plugins to go, on top of the evictions' timeouts.drain, and the restart's drain
    after it got what the evictions alone had left: a player could wait timeouts.ready
    longer than README's bound."""
    cfg = parse(lendee_toml("gpu-node") + f'[timeouts]\ndrain = "{DRAIN:g}s"\nready = "600s"\n'
                "[kubernetes]\n", "test.toml")
    kube = BudgetKube(pause_takes=0.6)
    cluster = KubeCluster(cast(Kube, kube), cfg, remember_cordon=lambda _: None)

    async def pods() -> tuple[frozenset[str] | None, str]:
        await asyncio.sleep(0.6)  # the checkpoint's reading in the guest
        return frozenset(), ""

    began = time.monotonic()
    assert await cluster.vacate(["gaming1"], {"gpu-a"}, pods) is None
    assert await cluster.withdraw({"gpu-a"}) is None
    [pause] = kube.pause_timeouts
    assert pause <= DRAIN - 0.5, pause  # what the evictions left of timeouts.drain
    # The unplug gives way (the guest kept the GPU): the restart's drain gets the rest.
    assert await cluster.reclaim(["gaming1"]) is None
    [drain] = kube.drain_timeouts
    assert drain <= DRAIN - (time.monotonic() - began) + 0.2, drain
    await cluster.flush_events()


async def test_a_pause_outside_a_hot_unplug_waits_up_to_timeouts_ready() -> None:
    """A failed hot-add's undo pauses the plugins too; nobody waits on a game there, and
    no reclaim after it pays for it."""
    cfg = parse(lendee_toml("gpu-node") + f'[timeouts]\ndrain = "{DRAIN:g}s"\nready = "600s"\n'
                "[kubernetes]\n", "test.toml")
    kube = BudgetKube()
    cluster = KubeCluster(cast(Kube, kube), cfg, remember_cordon=lambda _: None)
    assert await cluster.withdraw({"gpu-a"}) is None
    assert kube.pause_timeouts == [600.0]
    assert await cluster.reclaim(["gaming1"]) is None
    [drain] = kube.drain_timeouts
    assert drain > DRAIN - 0.2, drain
    await cluster.flush_events()
