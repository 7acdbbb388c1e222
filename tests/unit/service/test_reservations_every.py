"""Recurring reservations ("weekdays at 20:00"): the spec read and checked, each
occurrence at that wall time with the zone's rules for its own date (daylight saving),
one occurrence at a time in the state (the next made when one ends: used, expired,
yielded or cancelled alone), the whole series cancelled on demand, listed in status and
kept in the state file (`hostagent.core.reserve`, `hostagent.service.reservations`)."""

from __future__ import annotations

import time
import zoneinfo
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostagent.core import clock
from hostagent.core import reserve as plan
from hostagent.core.reserve import BadReservation, Reservation
from hostagent.host import state as persisted
from hostagent.surfaces.follow import format_status
from tests.unit.reserve_scaffold import (
    BERLIN, Pods, make_agent, reserve)

NEW_YORK = zoneinfo.ZoneInfo("America/New_York")


# --- the spec --------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "days", "shown"), [
    ("weekdays 20:00", {0, 1, 2, 3, 4}, "weekdays 20:00"),
    ("daily at 7:05", set(range(7)), "daily 07:05"),
    ("weekends 21:30", {5, 6}, "weekends 21:30"),
    ("Mon,wed,FRI 20:00", {0, 2, 4}, "mon,wed,fri 20:00"),
    ("mon,tue,wed,thu,fri 20:00", {0, 1, 2, 3, 4}, "weekdays 20:00"),
])
def test_the_spec_is_read_and_shown_one_way(spec: str, days: set[int], shown: str) -> None:
    every = plan.read_every(spec)
    assert every.days == days and str(every) == shown


@pytest.mark.parametrize(("spec", "said"), [
    ("someday 20:00", "someday"),
    ("weekdays 25:00", "25:00"),
    ("weekdays", "a time"),
    ("", "a time"),
    ("mon,,fri 20:00", "mon,,fri"),
    ("weekdays 2026-12-04T20:00", "HH:MM"),
])
def test_a_spec_that_is_not_one_is_refused_saying_why(spec: str, said: str) -> None:
    with pytest.raises(BadReservation) as e:
        plan.read_every(spec)
    assert said in str(e.value)


def test_each_occurrence_keeps_its_wall_time_across_a_change_of_the_clocks() -> None:
    every = plan.read_every("daily 20:00")
    # Berlin goes forward on 2026-03-29: 20:00 is 19:00 UTC the day before, 18:00 after.
    at, skipped = plan.next_occurrence(every, datetime(2026, 3, 28, 21, 0, tzinfo=BERLIN)
                                       .timestamp(), BERLIN)
    assert datetime.fromtimestamp(at, BERLIN).isoformat() == "2026-03-29T20:00:00+02:00"
    assert skipped == []
    before = plan.next_occurrence(every, datetime(2026, 3, 28, 12, 0, tzinfo=BERLIN)
                                  .timestamp(), BERLIN)[0]
    assert at - before == 23 * 3600  # a day of 23 hours between two 20:00s


def test_weekdays_skip_the_weekend() -> None:
    friday_night = datetime(2026, 12, 4, 21, 0, tzinfo=BERLIN).timestamp()
    at, _ = plan.next_occurrence(plan.read_every("weekdays 20:00"), friday_night, BERLIN)
    assert datetime.fromtimestamp(at, BERLIN) == datetime(2026, 12, 7, 20, 0, tzinfo=BERLIN)


def test_a_day_whose_time_the_clock_skips_is_passed_over_and_one_it_shows_twice_is_first(
        ) -> None:
    # New York skips 02:00-03:00 on 2026-03-08.
    at, skipped = plan.next_occurrence(plan.read_every("daily 02:30"), datetime(
        2026, 3, 7, 12, 0, tzinfo=NEW_YORK).timestamp() + 86400 - 3600 * 11, NEW_YORK)
    assert skipped == ["2026-03-08"]
    assert datetime.fromtimestamp(at, NEW_YORK).isoformat() == "2026-03-09T02:30:00-04:00"
    # Berlin shows 02:30 twice on 2026-10-25: the first.
    at, _ = plan.next_occurrence(plan.read_every("daily 02:30"), datetime(
        2026, 10, 24, 21, 0, tzinfo=BERLIN).timestamp(), BERLIN)
    assert datetime.fromtimestamp(at, BERLIN).isoformat() == "2026-10-25T02:30:00+02:00"


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
