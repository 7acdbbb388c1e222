"""The levers of a player's wait (hostagent.core.levers): the grace an eviction asks
for, which reclaim gets the levers, and the usual hours an owner plays. No I/O."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from hostagent.core.config import ConfigError, parse
from hostagent.core.levers import (
    Ahead,
    DrainPolicy,
    ShutdownWhen,
    Stop,
    ahead,
    eviction_grace,
    hour_of_week,
    power_off,
    terms,
    usual_hours,
)
from tests.configs import lendee_toml

TZ = timezone(timedelta(hours=1))
# A Monday, 20:00 local time.
MONDAY_8PM = datetime(2026, 11, 30, 20, 0, tzinfo=TZ)


# --- the grace an eviction asks for -----------------------------------------------------


@pytest.mark.parametrize(("own", "override", "cap", "asked"), [
    (30, None, None, None),  # kubectl's drain: the pod's own
    (30, 7, None, 7),  # [kubernetes] grace_period, as --grace-period
    (30, None, 10, 10),  # a player waits: at most 10 s
    (5, None, 10, None),  # within the cap: its own, unchanged
    (None, None, 10, 10),  # none set: the API's 30 s, capped
    (None, None, 40, None),
    (300, 60, 10, 10),  # the override, then the cap
    (300, 5, 10, 5),
])
def test_the_grace_an_eviction_asks_for(own: float | None, override: float | None,
                                        cap: float | None, asked: float | None) -> None:
    assert eviction_grace(own, override=override, cap=cap) == asked


def test_a_player_waiting_gets_the_levers_and_says_so() -> None:
    t = terms(DrainPolicy(), players_waiting=True)
    assert t.grace_cap == 10.0 and t.early_shutdown
    assert "at most 10 s" in t.said and "drain.unplanned_grace" in t.said
    assert "once every eviction is accepted" in t.said


@pytest.mark.parametrize(("waiting", "regrow", "why"), [
    (False, False, "nobody is waiting to play"),  # a reservation alone, a reclaim by hand
    (False, True, "a restart nobody waits for"),
    (True, True, "a restart nobody waits for"),
])
def test_reservations_and_regrows_keep_the_full_grace(waiting: bool, regrow: bool,
                                                       why: str) -> None:
    t = terms(DrainPolicy(), players_waiting=waiting, regrow=regrow)
    assert t.grace_cap is None and not t.early_shutdown
    assert t.said == f"evicted pods get their full grace period ({why})"


def test_each_lever_can_be_turned_off() -> None:
    t = terms(DrainPolicy(unplanned_grace=None, shutdown_when=ShutdownWhen.GONE),
              players_waiting=True)
    assert t.grace_cap is None and not t.early_shutdown
    assert t.said == "evicted pods get their own grace period"


def test_the_drain_section_reads_and_names_its_mistakes() -> None:
    cfg = parse(lendee_toml(uuids=False) + """
[drain]
unplanned_grace = ""
shutdown_when = "gone"
cordon_ahead = true
ahead_lead = "30m"
usual_weeks = 2
usual_of = 3
""")
    assert cfg.drain == DrainPolicy(unplanned_grace=None, shutdown_when=ShutdownWhen.GONE,
                                    cordon_ahead=True, ahead_lead=1800.0, usual_weeks=2,
                                    usual_of=3)
    assert parse(lendee_toml(uuids=False)).drain == DrainPolicy()
    with pytest.raises(ConfigError, match=r"drain\.unplanned_grace"):
        parse(lendee_toml(uuids=False) + '[drain]\nunplanned_grace = 10\n')


# --- the stop of a drained lendee --------------------------------------------------------


def test_power_off_is_opt_in_and_only_after_a_drain_that_emptied_the_node() -> None:
    assert DrainPolicy().stop is Stop.SHUTDOWN  # never destroyed by default (I3)
    assert not power_off(DrainPolicy(), emptied=True)
    chosen = DrainPolicy(stop=Stop.POWER_OFF, shutdown_when=ShutdownWhen.GONE)
    assert power_off(chosen, emptied=True)
    assert not power_off(chosen, emptied=False)  # pods left: they keep their grace


def test_power_off_waits_for_the_pods_gone() -> None:
    """shutdown_when = "accepted" begins the stop while the evicted pods still run: it
    cannot go with a power-off, which is "gone" unless told otherwise."""
    base = lendee_toml(uuids=False) + '[drain]\nstop = "power-off"\n'
    assert parse(base).drain == DrainPolicy(stop=Stop.POWER_OFF,
                                            shutdown_when=ShutdownWhen.GONE)
    assert parse(base + 'shutdown_when = "gone"\n').drain.shutdown_when is ShutdownWhen.GONE
    with pytest.raises(ConfigError) as refused:
        parse(base + 'shutdown_when = "accepted"\nunplanned_grace = "1x"\n', "host.toml")
    assert [str(p) for p in refused.value.problems] == [
        'host.toml: drain.unplanned_grace: "1x" is not a duration; write a number with a '
        'unit, e.g. "500ms", "90s", "2m" or "1h30m"',
        'host.toml: drain.shutdown_when: "accepted" cannot go with drain.stop = '
        '"power-off": it begins the lendee\'s stop while the evicted pods still run, and a '
        "power-off must wait until every one of them is gone; write shutdown_when = "
        '"gone" (or remove it: with stop = "power-off" it is the default), or stop = '
        '"shutdown" to keep shutdown_when = "accepted"']


# --- usual hours ---------------------------------------------------------------------------


def weeks_ago(n: int, at: datetime = MONDAY_8PM, minutes: int = 10) -> datetime:
    return at - timedelta(weeks=n) + timedelta(minutes=minutes)


def test_an_hour_seen_in_three_of_the_last_four_weeks_is_usual() -> None:
    now = MONDAY_8PM + timedelta(days=1)  # Tuesday
    starts = [weeks_ago(1), weeks_ago(2), weeks_ago(3, minutes=55)]
    assert usual_hours(starts, now, seen=3, weeks=4) == {hour_of_week(MONDAY_8PM)}
    assert hour_of_week(MONDAY_8PM) == 20
    assert usual_hours(starts[:2], now, seen=3, weeks=4) == set()


def test_a_week_counts_an_hour_once_and_old_weeks_not_at_all() -> None:
    now = MONDAY_8PM + timedelta(days=1)
    many = [weeks_ago(1, minutes=m) for m in (1, 20, 40)]  # three starts, one week
    assert usual_hours(many, now, seen=2, weeks=4) == set()
    old = [weeks_ago(5), weeks_ago(6), weeks_ago(7)]
    assert usual_hours(old, now, seen=3, weeks=4) == set()
    future = [now + timedelta(hours=1)]
    assert usual_hours(future, now, seen=1, weeks=4) == set()


def test_the_window_opens_lead_before_the_hour_and_closes_when_it_ends() -> None:
    usual = {"gaming1": frozenset({hour_of_week(MONDAY_8PM)})}
    lead = 15 * 60
    assert ahead(usual, MONDAY_8PM - timedelta(minutes=16), lead=lead) is None
    opened = ahead(usual, MONDAY_8PM - timedelta(minutes=15), lead=lead)
    assert opened == Ahead("gaming1", MONDAY_8PM)
    assert str(opened) == "ahead of gaming1's usual hour (Mon 20:00)"
    assert ahead(usual, MONDAY_8PM + timedelta(minutes=59), lead=lead) == opened
    assert opened.until == MONDAY_8PM + timedelta(hours=1)
    assert ahead(usual, MONDAY_8PM + timedelta(hours=1), lead=lead) is None


def test_a_lead_longer_than_an_hour_and_the_soonest_of_several() -> None:
    usual = {"gaming2": frozenset({hour_of_week(MONDAY_8PM) + 2}),
             "gaming1": frozenset({hour_of_week(MONDAY_8PM) + 3})}
    now = MONDAY_8PM
    found = ahead(usual, now, lead=3 * 3600)
    assert found == Ahead("gaming2", MONDAY_8PM + timedelta(hours=2))
    assert ahead(usual, now, lead=3600) is None
