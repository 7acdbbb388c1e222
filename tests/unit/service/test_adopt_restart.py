"""A restart of the agent while a GPU is lent adopts what runs: the lendee that the last
lend left in service goes straight back to LENT, journaled as adopted, with no booting →
joining → lent replay, no swap counted and the last lend's health check passing."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from hostagent.core.model import Phase
from hostagent.service.agent import Agent
from hostagent.host import journal
from hostagent.host import state as persisted

from tests.unit.agents import (  # noqa: F401 (a fixture)
    make_agent,
    no_step_outlives_its_test,
)

pytestmark = pytest.mark.usefixtures("sink")


def left(tmp_path: Path, phase: str, *, cordoned_by_us: bool = False) -> None:
    """The state file as the previous agent left it."""
    persisted.save_state(tmp_path / "state" / "state.toml", persisted.State(
        lendee_phase=phase, lendee_phase_since=datetime.now(UTC),
        cordoned_by_us=cordoned_by_us))


def phases(sink: journal.ListSink) -> list[tuple[str, str, str]]:
    return [(e.fields["HOSTAGENT_FROM"], e.fields["HOSTAGENT_TO"], e.fields["HOSTAGENT_RESULT"])
            for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "phase"]


async def restarted(tmp_path: Path) -> Agent:
    agent, fake = make_agent(tmp_path)
    fake.running.add("gpu-node")
    await agent._observe()
    return agent


async def test_a_lent_lendee_is_adopted(tmp_path: Path, sink: journal.ListSink) -> None:
    left(tmp_path, "lent")
    agent = await restarted(tmp_path)
    assert agent.state.phase is Phase.LENT and agent.state.lent == {"gpu-a", "gpu-b"}
    assert phases(sink) == [("off", "lent", "adopted")]
    metrics = agent.metrics
    assert metrics.registry.get_sample_value("hostagent_swaps_total", {"kind": "lend"}) == 0
    assert "adopted" in await metrics.lend_verified()


@pytest.mark.parametrize(("phase", "cordoned"), [("lent", True), ("joining", False)])
async def test_a_lend_not_finished_or_cordoned_by_us_is_replayed(
        tmp_path: Path, sink: journal.ListSink, phase: str, cordoned: bool) -> None:
    left(tmp_path, phase, cordoned_by_us=cordoned)
    agent = await restarted(tmp_path)
    assert agent.state.phase is Phase.BOOTING
    assert phases(sink) == [("off", "booting", "ok")]
