"""Several lendees on the agent's surfaces: systemd's STATUS line, reservations of the
owners of any lendee's GPUs (a real `Agent` per lendee, `test_lendees`' two lendees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.core.model import Phase
from tests.unit.agents import no_step_outlives_its_test  # noqa: F401 (a fixture)
from tests.unit.service.test_lendees import hook, two_lent
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
    await a._on_hook(hook("gaming2", "s1"))
    await until(lambda: b.state.phase is Phase.STOPPING)
    assert lines[-1] == "node-a lent, node-b stopping; waiting: gaming2"
    assert a.recorder.running_line(a.status_line()).endswith(
        "is running: node-a lent, node-b stopping; waiting: gaming2")


async def test_the_ssh_endpoint_knows_every_lendees_name(tmp_path: Path) -> None:
    """`--lendee NAME` over SSH is checked against every lendee, not the primary's view
    (which holds the first alone)."""
    a, b, _ = await two_lent(tmp_path)
    assert a.endpoints.lendees == ("node-a", "node-b")
