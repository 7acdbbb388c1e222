"""Recurring reservations ("weekdays at 20:00"): the spec read and checked, each
occurrence at that wall time with the zone's rules for its own date (daylight saving),
one occurrence at a time in the state (the next made when one ends: used, expired,
yielded or cancelled alone), the whole series cancelled on demand, listed in status and
kept in the state file (`hostagent.service.reservations`; the spec and each occurrence's
time, pure, in tests/unit/core/test_reserve_times.py)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostagent.core import clock
from hostagent.core.reserve import Reservation
from hostagent.host import state as persisted
from hostagent.surfaces.follow import format_status
from tests.unit.reserve_scaffold import (
    BERLIN, Pods, make_agent, reserve)


# --- the agent ---------------------------------------------------------------------------


@pytest.mark.usefixtures("berlin")
async def test_a_series_is_reserved_listed_kept_and_goes_on_after_each_occurrence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, _ = make_agent(tmp_path)
    now = [datetime(2026, 12, 4, 12, 0, tzinfo=BERLIN).timestamp()]  # a Friday
    monkeypatch.setattr(clock, "now", lambda: now[0])
    agent.reservations.cluster = Pods()
    done = await reserve(agent, vm="gaming1", at="20:00", every="weekdays")
    assert done["ok"] is True, done
    assert done["data"]["at"] == "2026-12-04T20:00+01:00"
    assert "every weekdays 20:00" in done["data"]["message"]
    [r] = agent.state.reservations
    assert (r.at, r.every) == (datetime(2026, 12, 4, 20, 0, tzinfo=BERLIN).timestamp(),
                               "weekdays 20:00")
    status = agent.verbs.status()["reservations"]
    assert status[0]["every"] == "weekdays 20:00"
    assert "every weekdays 20:00" in format_status(agent.verbs.status())
    # Kept in the state file, series and all.
    saved, warning = persisted.load_state(agent.cfg.state_file)
    assert warning is None and saved.reservations[0].every == "weekdays 20:00"
    # Nobody plays: once it expires, the next weekday's occurrence takes its place.
    now[0] = r.at + agent.reservations.timing.expiry
    await agent.reservations.step()
    [following] = agent.state.reservations
    assert following.at == datetime(2026, 12, 7, 20, 0, tzinfo=BERLIN).timestamp()
    assert (following.every, following.by, following.holding) == (r.every, r.by, False)


@pytest.mark.usefixtures("berlin")
async def test_one_occurrence_or_the_whole_series_is_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, _ = make_agent(tmp_path)
    now = [datetime(2026, 12, 4, 12, 0, tzinfo=BERLIN).timestamp()]  # a Friday
    monkeypatch.setattr(clock, "now", lambda: now[0])
    assert (await reserve(agent, vm="gaming1", at="20:00", every="weekdays"))["ok"]
    one = await reserve(agent, vm="gaming1", cancel=True)
    assert one["ok"] is True, one
    assert "Mon 07 Dec 20:00" in one["data"]["message"]
    [r] = agent.state.reservations
    assert r.at == datetime(2026, 12, 7, 20, 0, tzinfo=BERLIN).timestamp()
    whole = await reserve(agent, vm="gaming1", cancel=True, every=True)
    assert whole["ok"] is True, whole
    assert agent.state.reservations == ()
    assert "every weekdays 20:00" in whole["data"]["message"]


@pytest.mark.usefixtures("berlin")
async def test_a_series_needs_a_time_of_day_and_days_it_knows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, _ = make_agent(tmp_path)
    for args in ({"at": "2026-12-04T20:00", "every": "weekdays"},
                 {"at": "20:00", "every": "someday"}, {"at": "20:00", "every": 3}):
        answer: dict[str, Any] = await reserve(agent, vm="gaming1", **args)
        assert answer["ok"] is False and "cannot reserve gaming1" in answer["error"], answer
    assert agent.state.reservations == ()


def test_a_state_file_with_a_series_reads_back() -> None:
    now = float(int(time.time()))  # whole seconds: the file keeps microseconds
    r = Reservation(vm="gaming1", at=now + 60, by="x", made=now, every="daily 20:00")
    doc = persisted._encode(persisted.State(reservations=(r,)))
    assert doc["reservations"][0]["every"] == "daily 20:00"
    assert persisted._decode(doc).reservations == (r,)
