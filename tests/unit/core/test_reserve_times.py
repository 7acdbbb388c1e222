"""Reservations' pure parts (`hostagent.core.reserve`): a time read in the host's zone
with its rules for the date (daylight saving: the gap refused, the fold the first), a
series ("weekdays 20:00") read and each occurrence found, and the list kept of them
(one per owner, the yield time handed on, those yielded to another owner's start)."""

from __future__ import annotations

import time
import zoneinfo
from datetime import datetime, timedelta, timezone

import pytest

from hostagent.core import reserve as plan
from hostagent.core.reserve import BadReservation, Due, Reservation, Timing

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
NEW_YORK = zoneinfo.ZoneInfo("America/New_York")
LORD_HOWE = zoneinfo.ZoneInfo("Australia/Lord_Howe")  # its clocks move by 30 minutes
ZONE = timezone(timedelta(hours=1))
NOW = datetime(2026, 12, 4, 17, 30, tzinfo=ZONE)  # a Friday


# --- the time of one reservation -------------------------------------------------------


def test_a_time_of_day_takes_the_offset_of_its_own_date() -> None:
    eve = datetime(2026, 10, 24, 21, 0, tzinfo=BERLIN)  # CEST, +02:00; tomorrow +01:00
    assert plan.parse_at("20:00", eve) == datetime(2026, 10, 25, 20, 0, tzinfo=BERLIN)
    assert plan.parse_at("20:00", eve).utcoffset() == timedelta(hours=1)


def test_a_time_the_clock_skips_is_refused_naming_the_gap() -> None:
    eve = datetime(2026, 3, 28, 21, 0, tzinfo=BERLIN)  # the clocks go forward at 02:00
    for text in ("02:30", "2026-03-29T02:30"):
        with pytest.raises(BadReservation) as info:
            plan.read_at(text, eve)
        assert str(info.value) == (
            "02:30 does not exist on 2026-03-29 in the host's zone: the clocks go forward "
            "from 02:00 to 03:00 that night; give a time outside the gap")
    assert plan.read_at("03:00", eve).when == datetime(2026, 3, 29, 3, 0, tzinfo=BERLIN)
    assert plan.read_at("01:59", eve).when == datetime(2026, 3, 29, 1, 59, tzinfo=BERLIN)


def test_a_time_the_clock_shows_twice_is_the_first_and_says_so() -> None:
    eve = datetime(2026, 10, 24, 21, 0, tzinfo=BERLIN)  # the clocks go back at 03:00
    at = plan.read_at("02:30", eve)
    assert at.when.isoformat() == "2026-10-25T02:30:00+02:00"
    assert at.note == ("02:30 happens twice on 2026-10-25 (the clocks go back from 03:00 "
                       "to 02:00): this is the first, 2026-10-25T02:30+02:00; for the "
                       "second, give 2026-10-25T02:30+01:00")
    second = plan.read_at("2026-10-25T02:30+01:00", eve)
    assert second.note is None and second.when.timestamp() == at.when.timestamp() + 3600
    assert plan.read_at("20:00", eve).note is None
    # Written as a date without an offset, it is the first as well, and says so.
    dated = plan.read_at("2026-10-25T02:30", eve)
    assert (dated.when.utcoffset(), dated.note) == (timedelta(hours=2), at.note)


@pytest.mark.parametrize("minute", ["00", "17", "41", "59"])
def test_the_change_is_found_whatever_minute_within_the_hour_is_asked(minute: str) -> None:
    forward = datetime(2026, 3, 28, 21, 0, tzinfo=BERLIN)
    with pytest.raises(BadReservation, match=f"^02:{minute} does not exist on 2026-03-29 in "
                       "the host's zone: the clocks go forward from 02:00 to 03:00 "):
        plan.read_at(f"02:{minute}", forward)
    back = datetime(2026, 10, 24, 21, 0, tzinfo=BERLIN)
    assert plan.read_at(f"02:{minute}", back).note == (
        f"02:{minute} happens twice on 2026-10-25 (the clocks go back from 03:00 to 02:00): "
        f"this is the first, 2026-10-25T02:{minute}+02:00; for the second, give "
        f"2026-10-25T02:{minute}+01:00")


def test_a_change_of_half_an_hour_is_named_to_the_minute() -> None:
    eve = datetime(2026, 10, 3, 21, 0, tzinfo=LORD_HOWE)  # forward 02:00 -> 02:30
    with pytest.raises(BadReservation, match="^02:15 does not exist on 2026-10-04 in the "
                       "host's zone: the clocks go forward from 02:00 to 02:30 that night"):
        plan.read_at("02:15", eve)
    assert plan.read_at("02:30", eve).note is None
    back = datetime(2026, 4, 4, 21, 0, tzinfo=LORD_HOWE)  # back 02:00 -> 01:30
    assert plan.read_at("01:45", back).note == (
        "01:45 happens twice on 2026-04-05 (the clocks go back from 02:00 to 01:30): this "
        "is the first, 2026-04-05T01:45+11:00; for the second, give 2026-04-05T01:45+10:30")
    assert plan.read_at("01:29", back).note is None


def test_within_the_repeated_hour_a_time_of_day_is_its_first_instance() -> None:
    # 02:10 the second time (+01:00): 02:40's first instance (+02:00) has passed, so
    # "02:40" is tomorrow's, never the second instance of today's.
    now = datetime(2026, 10, 25, 2, 10, tzinfo=BERLIN, fold=1)
    assert plan.read_at("02:40", now).when == datetime(2026, 10, 26, 2, 40, tzinfo=BERLIN)


def test_a_time_of_day_is_to_the_minute_whatever_the_seconds_of_now() -> None:
    now = datetime(2026, 12, 4, 17, 30, 42, 123456, tzinfo=ZONE)
    assert plan.parse_at("20:00", now) == datetime(2026, 12, 4, 20, 0, tzinfo=ZONE)


@pytest.mark.parametrize(("text", "when"), [
    ("23:59", datetime(2026, 12, 4, 23, 59, tzinfo=ZONE)),
    ("0:00", datetime(2026, 12, 5, 0, 0, tzinfo=ZONE)),
])
def test_the_first_and_last_minutes_of_the_day_are_times(text: str, when: datetime) -> None:
    assert plan.parse_at(text, NOW) == when


@pytest.mark.parametrize("text", ["24:00", "20:60"])
def test_an_hour_or_minute_past_the_clocks_is_refused(text: str) -> None:
    with pytest.raises(BadReservation, match=r"is not a time of day \(HH:MM, 00:00 to 23:59\)"):
        plan.parse_at(text, NOW)


def test_now_itself_has_passed() -> None:
    with pytest.raises(BadReservation, match="^2026-12-04T17:30\\+01:00 has passed"):
        plan.parse_at("2026-12-04T17:30", NOW)


def test_a_long_text_is_quoted_cut_at_64_characters() -> None:
    with pytest.raises(BadReservation) as info:
        plan.parse_at("y" * 70, NOW)
    assert str(info.value).startswith(f"{'y' * 64!r} is not a time")


def test_with_a_naive_now_times_are_shown_without_an_offset() -> None:
    now = datetime(2026, 12, 4, 17, 30)
    with pytest.raises(BadReservation) as info:
        plan.parse_at("2026-12-04T17:00", now)
    assert str(info.value) == "2026-12-04T17:00 has passed (it is 2026-12-04T17:30)"
    assert plan.read_at("20:00", now) == plan.At(datetime(2026, 12, 4, 20, 0))


def test_rfc3339_is_to_the_second_with_the_offset_of_that_instant() -> None:
    summer = datetime(2026, 7, 1, 12, 0, 5, 900000, tzinfo=BERLIN).timestamp()
    assert plan.rfc3339(summer, BERLIN) == "2026-07-01T12:00:05+02:00"
    assert plan.rfc3339(summer, NEW_YORK) == "2026-07-01T06:00:05-04:00"


# --- a series ----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "days", "shown"), [
    ("weekdays 20:00", {0, 1, 2, 3, 4}, "weekdays 20:00"),
    ("daily at 7:05", set(range(7)), "daily 07:05"),
    ("DAILY AT 0:00", set(range(7)), "daily 00:00"),
    ("weekends 23:59", {5, 6}, "weekends 23:59"),
    ("Mon,wed,FRI 20:00", {0, 2, 4}, "mon,wed,fri 20:00"),
    ("sun,sat 9:30", {5, 6}, "weekends 09:30"),
    ("sun 9:30", {6}, "sun 09:30"),
    ("mon,tue,wed,thu,fri 20:00", {0, 1, 2, 3, 4}, "weekdays 20:00"),
])
def test_the_spec_is_read_and_shown_one_way(spec: str, days: set[int], shown: str) -> None:
    every = plan.read_every(spec)
    assert every.days == days and str(every) == shown


@pytest.mark.parametrize(("spec", "said"), [
    ("someday 20:00", "'someday' are not days: daily, weekdays, weekends, or day names "
                      "joined by commas (mon,wed,fri)"),
    ("weekdays 24:00", "'24:00' is not a time of day for a series: HH:MM, 00:00 to 23:59"),
    ("weekdays 20:60", "'20:60' is not a time of day for a series"),
    ("weekdays 2026-12-04T20:00", "'2026-12-04T20:00' is not a time of day"),
    ("weekdays", "'weekdays' is not a series: give days and a time, \"weekdays 20:00\", "
                 "\"daily 07:30\" or \"mon,fri 21:00\""),
    ("", "'' is not a series"),
    ("daily on 20:00", "'daily on 20:00' is not a series"),
    ("daily at 20:00 now", "'daily at 20:00 now' is not a series"),
    ("mon,,fri 20:00", "'mon,,fri' are not days"),
    ("y" * 70, f"{'y' * 64!r} is not a series"),
])
def test_a_spec_that_is_not_one_is_refused_saying_why(spec: str, said: str) -> None:
    with pytest.raises(BadReservation) as e:
        plan.read_every(spec)
    assert str(e.value).startswith(said)


def test_a_spec_is_read_from_its_first_64_characters() -> None:
    spec = "daily" + " " * 53 + "20:00"  # 63 characters
    assert str(plan.read_every(spec + " x")) == "daily 20:00"  # the 65th is not read
    with pytest.raises(BadReservation, match="is not a series"):
        plan.read_every(spec.replace("  ", " ", 1) + " x")  # 64: x is read, a word too many


def test_the_days_are_the_zones_not_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20:00 at -11:00 is 07:00 UTC the next day: the first day is the zone's own.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        samoa = zoneinfo.ZoneInfo("Pacific/Pago_Pago")
        after = datetime(2026, 12, 4, 20, 0, tzinfo=samoa).timestamp()
        at, _ = plan.next_occurrence(plan.read_every("daily 21:00"), after, samoa)
        assert datetime.fromtimestamp(at, samoa) == datetime(2026, 12, 4, 21, 0, tzinfo=samoa)
    finally:
        monkeypatch.undo()
        time.tzset()


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


def test_an_occurrence_is_strictly_after_the_moment_given() -> None:
    every = plan.read_every("daily 20:00")
    eight = datetime(2026, 12, 4, 20, 0, tzinfo=BERLIN).timestamp()
    assert plan.next_occurrence(every, eight - 1, BERLIN) == (eight, [])
    assert plan.next_occurrence(every, eight, BERLIN) == (eight + 86400, [])


def test_weekdays_skip_the_weekend() -> None:
    friday_night = datetime(2026, 12, 4, 21, 0, tzinfo=BERLIN).timestamp()
    at, _ = plan.next_occurrence(plan.read_every("weekdays 20:00"), friday_night, BERLIN)
    assert datetime.fromtimestamp(at, BERLIN) == datetime(2026, 12, 7, 20, 0, tzinfo=BERLIN)


def test_one_day_a_week_is_found_a_week_on() -> None:
    friday_night = datetime(2026, 12, 4, 21, 0, tzinfo=BERLIN).timestamp()
    at, _ = plan.next_occurrence(plan.read_every("fri 20:00"), friday_night, BERLIN)
    assert datetime.fromtimestamp(at, BERLIN) == datetime(2026, 12, 11, 20, 0, tzinfo=BERLIN)


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


def test_a_weekly_time_the_clock_skips_is_found_the_week_after() -> None:
    # Sunday 2026-03-08 02:30 does not exist in New York: the next Sunday's is taken.
    saturday = datetime(2026, 3, 7, 12, 0, tzinfo=NEW_YORK).timestamp()
    at, skipped = plan.next_occurrence(plan.read_every("sun 02:30"), saturday, NEW_YORK)
    assert skipped == ["2026-03-08"]
    assert datetime.fromtimestamp(at, NEW_YORK).isoformat() == "2026-03-15T02:30:00-04:00"


def test_a_series_with_no_day_has_no_occurrence() -> None:
    with pytest.raises(BadReservation, match="^ 20:00 has no day in the next two weeks$"):
        plan.next_occurrence(plan.Every(frozenset(), 20, 0), NOW.timestamp(), BERLIN)


# --- the list of reservations ------------------------------------------------------------


T0 = 1_000_000.0
TIMING = Timing(lead=600, margin=120, expiry=1800)


def r(vm: str, at: float = T0, **kw: object) -> Reservation:
    return Reservation(vm=vm, at=at, by="me", made=T0 - 60, **kw)  # type: ignore[arg-type]


def test_the_timing_s_defaults() -> None:
    assert Timing() == Timing(lead=900.0, margin=300.0, expiry=1800.0, cooldown=3600.0)


def test_due_is_true_when_any_of_its_lists_has_one() -> None:
    one = (r("gaming1"),)
    assert not Due()
    for name in ("notify", "hold", "expire", "yields"):
        assert Due(**{name: one})


def test_an_expired_reservation_does_not_hide_those_after_it() -> None:
    old, new = r("gaming1", T0 - 2000), r("gaming2", T0 + 600)
    assert plan.due([old, new], T0, TIMING) == Due(notify=(new,), expire=(old,))


def test_without_a_grace_the_eviction_is_the_margin_before() -> None:
    assert plan.evict_time(r("gaming1", T0 + 3600), 0, TIMING, T0) == T0 + 3600 - 120
    assert plan.evict_time(r("gaming1", T0 + 3600), -5, TIMING, T0) == T0 + 3600 - 120


def test_a_new_reservation_replaces_the_owners_and_the_list_is_by_time() -> None:
    a, b = r("gaming1", T0 + 600), r("gaming2", T0 + 300)
    c = r("gaming3", T0 + 300)
    assert plan.put([a, c], b) == (b, c, a)  # by time, then by name
    moved = r("gaming1", T0 + 900)
    assert plan.put([a, b], moved) == (b, moved)


def test_a_reservation_that_held_hands_its_yield_time_to_the_one_replacing_it() -> None:
    first = r("gaming1", T0, evict_at=T0 - 300, holding=True)
    later = r("gaming1", T0 + 3600)
    (kept,) = plan.put([first], later)
    assert (kept.at, kept.yields_from, kept.yields_at) == (T0 + 3600, T0, T0)
    # A yielding one too; one that never held hands nothing on.
    assert plan.put([r("gaming1", T0, yielding=True)], later)[0].yields_at == T0
    assert plan.put([r("gaming1", T0)], later)[0].yields_from is None
    # Moved earlier, it yields from its own time.
    earlier = r("gaming1", T0 - 600)
    assert plan.put([first], earlier)[0].yields_at == T0 - 600
    # Replaced again, it keeps the first one's time.
    again = plan.put(plan.put([first], later), r("gaming1", T0 + 7200))
    assert again[0].yields_at == T0


def test_a_yielding_reservation_yields_to_another_owner_of_its_gpus_who_started() -> None:
    cards = {"gaming1": frozenset({"gpu-a"}), "gaming2": frozenset({"gpu-a"}),
             "gaming3": frozenset({"gpu-b"}), "gaming4": frozenset({"gpu-a", "gpu-b"})}

    def claims(vm: str) -> frozenset[str]:
        return cards[vm]

    waiting, mine = r("gaming1", yielding=True), r("gaming3", yielding=True)
    # Its own owner running is a use, not a yield; an owner of other GPUs is no reason.
    assert plan.yielded([waiting], {"gaming1", "gaming2"}, claims) == ()
    assert plan.yielded([mine], {"gaming1"}, claims) == ()
    assert plan.yielded([waiting, mine], {"gaming4"}, claims) == (
        (waiting, "gaming4"), (mine, "gaming4"))
    assert plan.yielded([r("gaming1"), mine], {"gaming2", "gaming4"}, claims) == (
        (mine, "gaming4"),)  # one not yet yielding stops the owner's start elsewhere
    assert plan.yielded([waiting], {"gaming4", "gaming2"}, claims) == (
        (waiting, "gaming2"),)  # the first by name


def test_changed_changes_only_the_owners_reservation() -> None:
    a, b = r("gaming1"), r("gaming2")
    assert plan.changed([a, b], "gaming2", holding=True) == (a, r("gaming2", holding=True))
    assert plan.without([a, b], [r("gaming1", T0 + 5)]) == (b,)
