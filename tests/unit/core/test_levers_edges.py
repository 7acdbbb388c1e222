"""The levers of a player's wait (`hostagent.core.levers`) at their edges: the bounds of
a number of weeks, the words each reclaim's terms say, a grace equal to the cap, the
hour of the week, the usual hours' limits, and a lead that is not whole minutes."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from hostagent.core.config import ConfigError, parse
from hostagent.core.levers import (
    Ahead,
    DrainPolicy,
    ShutdownWhen,
    Stop,
    Terms,
    ahead,
    eviction_grace,
    hour_of_week,
    terms,
    usual_hours,
)
from tests.configs import lendee_toml

TZ = timezone(timedelta(hours=1))
MONDAY_8PM = datetime(2026, 11, 30, 20, 0, tzinfo=TZ)
WEEK = timedelta(weeks=1)


@pytest.mark.parametrize("weeks", [1, 52])
def test_one_to_52_weeks_are_read(weeks: int) -> None:
    cfg = parse(lendee_toml(uuids=False) + f"[drain]\nusual_weeks = {weeks}\nusual_of = {weeks}\n")
    assert (cfg.drain.usual_weeks, cfg.drain.usual_of) == (weeks, weeks)


@pytest.mark.parametrize("weeks", [0, 53])
def test_a_number_of_weeks_out_of_bounds_is_refused_saying_what_to_write(weeks: int) -> None:
    with pytest.raises(ConfigError) as info:
        parse(lendee_toml(uuids=False) + f"[drain]\nusual_weeks = {weeks}\n")
    assert str(info.value).endswith(
        f"drain.usual_weeks: {weeks} is not a number of weeks; write 1 to 52")


def test_each_reclaims_terms_in_words() -> None:
    assert terms(DrainPolicy(), players_waiting=False) == Terms(
        None, False, "evicted pods get their full grace period (nobody is waiting to play)")
    assert terms(DrainPolicy(), players_waiting=True) == Terms(
        10.0, True, "evicted pods get at most 10 s to stop (drain.unplanned_grace: a player "
        "is waiting); the node's VM shuts down once every eviction is accepted")
    gone = DrainPolicy(unplanned_grace=None, shutdown_when=ShutdownWhen.GONE)
    assert terms(gone, players_waiting=True) == Terms(
        None, False, "evicted pods get their own grace period")


def test_the_terms_say_how_the_nodes_vm_stops() -> None:
    """The Event's "then the node's VM ..." follows drain.stop: a power-off is said as
    one, with the shutdown it falls back to when a pod stays."""
    assert terms(DrainPolicy(), players_waiting=False).stop == "shuts down"
    assert terms(DrainPolicy(), players_waiting=True).stop == "shuts down"
    off = DrainPolicy(stop=Stop.POWER_OFF, shutdown_when=ShutdownWhen.GONE)
    for waiting in (False, True):
        assert terms(off, players_waiting=waiting).stop == (
            'is powered off once every evicted pod is gone (drain.stop = "power-off"; '
            "it shuts down if one stays)")
    assert terms(off, players_waiting=True, regrow=True).stop.startswith("is powered off")


def test_a_grace_equal_to_the_cap_is_the_pods_own() -> None:
    assert eviction_grace(10.0, override=None, cap=10.0) is None
    assert eviction_grace(None, override=None, cap=30.0) is None  # the API's 30 s
    assert eviction_grace(10.5, override=None, cap=10.0) == 10.0


@pytest.mark.parametrize(("at", "hour"), [
    (datetime(2026, 11, 30, 0, 0, tzinfo=TZ), 0),  # Monday
    (datetime(2026, 12, 1, 5, 59, tzinfo=TZ), 29),  # Tuesday 05:xx
    (datetime(2026, 12, 6, 23, 30, tzinfo=TZ), 167),  # Sunday 23:xx
])
def test_the_hours_of_the_week_run_from_monday_0_to_sunday_167(at: datetime, hour: int) -> None:
    assert hour_of_week(at) == hour


def test_seen_once_in_the_last_week_is_usual_and_zero_of_either_learns_nothing() -> None:
    start = MONDAY_8PM - WEEK + timedelta(minutes=10)
    assert usual_hours([start], MONDAY_8PM, seen=1, weeks=1) == {hour_of_week(start)}
    assert usual_hours([start], MONDAY_8PM, seen=0, weeks=4) == frozenset()
    assert usual_hours([start], MONDAY_8PM, seen=1, weeks=0) == frozenset()


def test_a_start_now_counts_and_one_exactly_the_weeks_ago_does_not() -> None:
    assert usual_hours([MONDAY_8PM], MONDAY_8PM, seen=1, weeks=1) == {hour_of_week(MONDAY_8PM)}
    assert usual_hours([MONDAY_8PM - timedelta(milliseconds=1)], MONDAY_8PM, seen=1,
                       weeks=1) == {hour_of_week(MONDAY_8PM) - 1}
    assert usual_hours([MONDAY_8PM - 2 * WEEK], MONDAY_8PM, seen=1, weeks=2) == frozenset()
    assert usual_hours([MONDAY_8PM + timedelta(seconds=1)], MONDAY_8PM, seen=1,
                       weeks=1) == frozenset()  # a start after now: the clock moved back


def test_a_lead_of_seconds_opens_the_window_to_the_second() -> None:
    usual = {"gaming1": frozenset({hour_of_week(MONDAY_8PM)})}
    opens = MONDAY_8PM - timedelta(seconds=890)  # 19:45:10
    assert ahead(usual, opens - timedelta(seconds=1), lead=890) is None
    assert ahead(usual, opens + timedelta(seconds=20), lead=890) == Ahead("gaming1", MONDAY_8PM)
    opens = MONDAY_8PM - timedelta(seconds=899.75)  # 19:45:00.25
    assert ahead(usual, opens - timedelta(milliseconds=1), lead=899.75) is None
    assert ahead(usual, opens + timedelta(milliseconds=250), lead=899.75) == Ahead(
        "gaming1", MONDAY_8PM)
