"""Several lendees on the agent's surfaces: systemd's STATUS line, reservations of the
owners of any lendee's GPUs (a real `Agent` per lendee, `test_lendees`' two lendees)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from hostagent.core.model import Phase
from hostagent.service.parts import NoCluster
from tests.unit.agents import hook, no_step_outlives_its_test, two_lent  # noqa: F401
from tests.waiting import until

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


async def test_systemd_status_speaks_of_every_lendee(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`systemctl status hostagent` shows the STATUS line: the second lendee's phase and
    the owner waiting for it are there, not the first lendee's alone."""
    from hostagent.host import journal
    lines: list[str] = []

    def notify(status: str | None = None, **kw: object) -> bool:
        if status is not None:
            lines.append(status)
        return False
    monkeypatch.setattr(journal, "notify", notify)
    a, b, fake = await two_lent(tmp_path)
    fake.ignores_shutdown.add("node-b")
    await a._on_hook(hook("gaming2", at=time.time(), id="s1"))
    await until(lambda: b.state.phase is Phase.STOPPING)
    assert lines[-1] == "node-a lent, node-b stopping; waiting: gaming2"
    assert a.recorder.running_line(a.status_line()).endswith(
        "is running: node-a lent, node-b stopping; waiting: gaming2")


async def test_the_ssh_endpoint_knows_every_lendees_name(tmp_path: Path) -> None:
    """`--lendee NAME` over SSH is checked against every lendee, not the primary's view
    (which holds the first alone)."""
    a, b, _ = await two_lent(tmp_path)
    assert a.endpoints.lendees == ("node-a", "node-b")


class Told(NoCluster):
    """A node that records the reservation notices it was given."""

    def __init__(self, node: str, told: list[tuple[str, str]]) -> None:
        self.node, self.told = node, told

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        self.told.append((self.node, message("then")))
        return when(30.0), [f"{self.node}-job"]


async def test_an_owner_of_the_second_lendees_gpu_is_reserved_and_its_node_told(
        tmp_path: Path) -> None:
    """gaming2 plays on node-b's GPU: `hostagent reserve gaming2` was refused ("unknown
    VM": the reservations were the first lendee's alone). Now it is taken, kept by
    node-b's machine, shown in status, and node-b's pods get the notice, node-a's none;
    coop, on both, tells both nodes."""
    a, b, _ = await two_lent(tmp_path)
    told: list[tuple[str, str]] = []
    a.cluster, b.cluster = Told("node-a", told), Told("node-b", told)
    soon = datetime.fromtimestamp(time.time() + 600).strftime("%Y-%m-%dT%H:%M")
    handlers = a.handlers()
    replies = [r async for r in handlers["reserve"]({"vm": "gaming2", "at": soon})]
    assert replies[-1]["ok"], replies[-1]
    assert "gpu-b will be free then" in replies[-1]["data"]["message"]
    assert [r.vm for r in b.state.reservations] == ["gaming2"] and not a.state.reservations
    status = [r async for r in handlers["status"]({})][-1]["data"]
    assert [r["vm"] for r in status["reservations"]] == ["gaming2"]
    await a.reservations.step()
    assert told == [("node-b", "a GPU of node node-b is reserved for gaming2 at "
                     f"{soon[-5:]}: this pod may be evicted from then, with its full grace "
                     "period; checkpoint before then")]
    assert b.state.reservations[0].evict_at is not None  # node-b's machine holds it then
    told.clear()
    replies = [r async for r in handlers["reserve"]({"vm": "coop", "at": soon})]
    assert "gpu-a, gpu-b will be free then" in replies[-1]["data"]["message"], replies[-1]
    await a.reservations.step()
    assert sorted(node for node, _ in told) == ["node-a", "node-b"]
    assert {r.vm for r in b.state.reservations} == {"gaming2", "coop"}
    assert [r.vm for r in a.state.reservations] == ["coop"]
    # Cancelled by name, whichever lendee keeps it.
    replies = [r async for r in handlers["reserve"]({"vm": "gaming2", "cancel": True})]
    assert replies[-1]["ok"], replies[-1]
    assert [r.vm for r in b.state.reservations] == ["coop"]
