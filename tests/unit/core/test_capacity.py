"""The capacity model's varied weeks really vary, and leave the reference week alone."""

from __future__ import annotations

import random

from bench.capacity import (
    CANDIDATES,
    JOB_GRACE,
    SCHEDULES,
    TIMING,
    VARIED,
    WEEK,
    Durations,
    Replay,
    _Jittered,
    jobs,
    over_varied,
    sessions,
    varied_week,
)
from hostagent.core.model import Event, Hotplug, Policy


def test_each_reading_of_a_jittered_duration_strays_within_its_spread() -> None:
    d = _Jittered(Durations(), 0.5, random.Random(1))
    boots = [d.boot for _ in range(200)]
    assert all(15.0 <= b <= 45.0 for b in boots)
    assert len(set(boots)) == 200 and min(boots) < 20 and max(boots) > 40


def test_the_varied_weeks_cover_every_schedule_with_games_that_never_overlap() -> None:
    kinds = {varied_week(seed)[0] for seed in VARIED}
    assert kinds == set(SCHEDULES)
    for seed in VARIED:
        _, games, work = varied_week(seed)
        assert work
        for owner in {o for _, _, o in games}:
            mine = sorted((s, e) for s, e, o in games if o == owner)
            assert all(e1 <= s2 for (_, e1), (s2, _) in zip(mine, mine[1:], strict=False))
    assert len({tuple(varied_week(seed)[1]) for seed in VARIED}) == len(VARIED)


def test_the_reference_week_is_the_same_without_a_spread() -> None:
    plain = Replay(Policy(), Durations(), jobs(14)).run()
    again = Replay(Policy(), Durations(), jobs(14), spread=0.0, seed=99).run()
    assert (plain.share, plain.jobs_killed, plain.player_waits) == \
        (again.share, again.jobs_killed, again.player_waits)


def test_a_killed_job_destroys_the_work_it_had_done() -> None:
    always = next(c for c in CANDIDATES if c.name == "partial, always")
    s = over_varied(always, Durations())
    assert sum(s.killed) > 0 and sum(s.destroyed) > 0
    assert len(s.shares) == len(VARIED) and all(0 < x <= 1 for x in s.shares)


def test_a_reserved_player_waits_for_no_gpu_and_the_notice_costs_some_lent_time() -> None:
    plain = Replay(Policy(), Durations(), jobs(14)).run()
    booked = Replay(Policy(), Durations(), jobs(14), reserved=1.0).run()
    assert len(booked.reserved_gpu_waits) == len(plain.player_waits) > 0  # every game
    assert set(booked.reserved_gpu_waits) == {0.0}
    assert max(booked.reserved_waits) == Durations().owner_start  # the VM's own start
    assert max(plain.player_waits) > 30
    # The GPU is held idle from the eviction to the game: less is lent.
    assert booked.share < plain.share and booked.failed_intents == 0


def test_a_hot_unplug_waits_for_evictions_only_when_a_job_runs_on_the_gpu() -> None:
    # As `Cluster.vacate`: it evicts, and waits, only for the pods using the GPU; the
    # player then waits for the rest of the unplug and the game's start.
    d = Durations()
    f = Replay(Policy(hotplug=Hotplug.BOTH), d, jobs(14)).run()
    assert f.hot_unplugs > 0 and f.restarts == 0
    idle, busy = d.hot_unplug + d.owner_start, d.drain + d.hot_unplug + d.owner_start
    assert set(f.player_waits) <= {d.owner_start, idle, busy}
    assert idle in f.player_waits and busy in f.player_waits


def test_a_no_show_holds_its_gpu_until_the_reservation_expires_then_it_is_lent_again() -> None:
    d, policy = Durations(), Policy(hotplug=Hotplug.BOTH)
    f = Replay(policy, d, jobs(14), reserved=1.0, no_show=1.0).run()
    games = [g for g in sessions() if 0 <= g[0] - TIMING.margin - JOB_GRACE < WEEK]
    assert f.no_shows == len(games) and not f.player_waits and f.failed_intents == 0
    # From the hold (margin and grace before the time) to the hot-add that follows the
    # expiry, after relend_delay as after any GPU freed.
    each = TIMING.margin + JOB_GRACE + TIMING.expiry + policy.relend_delay + d.hot_add
    assert abs(f.no_show_idle_gs / f.no_shows - each) < 1
    assert f.no_show_killed <= f.jobs_killed
    played = Replay(policy, d, jobs(14), reserved=1.0).run()
    assert played.no_shows == 0 and played.no_show_idle_gs == 0


class _Stamps(Replay):
    """A replay that notes every event delivered at another time than its stamp."""

    late: list[tuple[float, float, str]]

    def deliver(self, event: Event) -> None:
        if abs(event.at - self.now) > 1e-9:
            self.late.append((self.now, event.at, type(event).__name__))
        super().deliver(event)


def test_each_event_is_stamped_with_the_time_it_is_delivered_at() -> None:
    # A jittered duration is one reading: the event that ends a step must be scheduled
    # and stamped with the same one, or the machine reads a drain's end at another time
    # than the clock it arrived on.
    for policy in (Policy(), Policy(hotplug=Hotplug.BOTH)):
        r = _Stamps(policy, Durations(), jobs(14), spread=0.5, seed=3)
        r.late = []
        r.run()
        assert r.late == []
