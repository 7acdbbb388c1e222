"""A reservation at most 7 days ahead (`hostagent.core.reserve.MAX_AHEAD`), to the minute:
the limit is elapsed time, so across a change of the clock it is a week of hours, not
of wall-clock dates."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from hostagent.core import reserve as plan
from hostagent.core.reserve import BadReservation

ZONE = timezone(timedelta(hours=1))
NOW = datetime(2026, 12, 4, 17, 30, tzinfo=ZONE)


@pytest.mark.parametrize("text", ["2026-12-11T17:30", "2026-12-11T17:29",
                                  "2026-12-11T16:30", "2026-12-11 16:30:00+00:00"])
def test_seven_days_ahead_to_the_minute_is_accepted(text: str) -> None:
    assert plan.parse_at(text, NOW) <= NOW + timedelta(days=7)


@pytest.mark.parametrize(("text", "shown"), [
    ("2026-12-11T17:31", "2026-12-11T17:31+01:00"),
    ("2026-12-11T18:30", "2026-12-11T18:30+01:00"),
    ("2026-12-11T17:30:01", "2026-12-11T17:30+01:00"),
    ("2026-12-11 17:31:00+01:00", "2026-12-11T17:31+01:00"),
])
def test_a_minute_more_is_refused(text: str, shown: str) -> None:
    with pytest.raises(BadReservation) as e:
        plan.parse_at(text, NOW)
    assert str(e.value) == f"{shown} is more than 7 days ahead"


def test_across_the_end_of_summer_time_the_week_is_168_hours() -> None:
    paris = ZoneInfo("Europe/Paris")  # summer time ends 2026-10-25, 03:00 -> 02:00
    now = datetime(2026, 10, 20, 12, 0, tzinfo=paris)
    assert plan.parse_at("2026-10-27T11:00", now).utcoffset() == timedelta(hours=1)
    with pytest.raises(BadReservation, match=r"^2026-10-27T11:01\+01:00 is more than 7 days"):
        plan.parse_at("2026-10-27T11:01", now)
