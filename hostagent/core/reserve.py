"""Reservations: a player who knows when they will play says so ahead
(``hostagent reserve gaming1 --at 20:00``), and the GPU is free at that minute.

Pure: no I/O, no clock; times are POSIX seconds passed in. `hostagent.service.reservations`
runs the timeline, the machine (`hostagent.core.machine`) keeps a held reservation's GPUs
from the lendee as it does an owner's who waits.

The timeline of one reservation of `vm` at ``at`` (`Timing` holds the lengths)::

    at - lead           the notice: every GPU pod on the lendee's node gets the annotation
                        hostagent.io/reclaim-at (RFC 3339) and an Event, as a cloud's
                        spot-interruption notice, so it can checkpoint
    evict_at            = at - (the pods' longest grace period + margin), said by the
                        notice: the reservation holds its GPUs, and the lendee gives them
                        up as for a start (a drain that gives each pod its full grace, then
                        a shutdown, or a hot-unplug)
    at                  ``virsh start vm`` starts at once: its GPUs are free
    at                  from then on, unused, it *yields*: another owner of one of its
                        GPUs may start (a real start, by `virsh start` or `play`), and the
                        reservation then ends
    at + expiry         nobody came: the reservation is dropped and the GPUs lent again

A reservation ends when its owner starts once it holds (used), when it expires, when
another owner starts after its time (yielded), or when it is cancelled; the journal says
which. One per owner: a new one replaces it, and one that held already keeps yielding
from the first one's time (a reservation renewed again and again must not lock another
owner out). Who reserved is kept (``principal``): only they, or a caller granted
``cancel-any``, may cancel or replace it (`hostagent.service.verbs`).

Times of day are read in the host's zone with its rules for the target date (zoneinfo),
never with today's offset: ``20:00`` on the eve of a change is 20:00 on the clock that
day. A time the clock skips (the spring gap) is refused, naming the gap; a time it shows
twice (the autumn fold) is the first, and the answer says so (`At.note`), with how to
ask for the second (an ISO 8601 time with its offset).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, tzinfo, UTC

__all__ = [
    "MAX_AHEAD",
    "At",
    "BadReservation",
    "Due",
    "Every",
    "Reservation",
    "Timing",
    "due",
    "evict_time",
    "held",
    "next_occurrence",
    "next_wake",
    "parse_at",
    "read_at",
    "read_every",
    "rfc3339",
]

MAX_AHEAD = 7 * 24 * 3600.0  # a reservation further ahead is a typo more often than a plan
_CLOCK = re.compile(r"(\d{1,2}):(\d{2})")


class BadReservation(ValueError):
    """A reservation that cannot be taken, in one sentence for whoever asked."""


@dataclass(frozen=True, kw_only=True)
class Reservation:
    """`vm` will be played from `at`. ``evict_at``: when its GPUs are taken back, set
    when the pods' notice went out (None before); ``holding``: its GPUs are kept from
    the lendee now; ``yielding``: past its time and unused, it no longer stops another
    owner of its GPUs from starting; ``yields_from``: when it begins to yield (None:
    ``at``; earlier when it replaced one that held); ``principal``: who reserved, as
    `hostagent.surfaces.control.Caller.principal` says it ("" for nobody known)."""

    vm: str
    at: float
    by: str  # who asked: "control (uid 1000)", "ssh key phone", "mqtt"
    made: float
    evict_at: float | None = None
    holding: bool = False
    principal: str = ""
    yielding: bool = False
    yields_from: float | None = None
    every: str | None = None  # one of a series (`Every`, as its str shows it)

    @property
    def yields_at(self) -> float:
        return self.at if self.yields_from is None else self.yields_from


@dataclass(frozen=True, kw_only=True)
class Timing:
    """``lead``: how long before the time the notice goes out (at least the longest grace
    period plus ``margin``); ``margin``: for the drain of the other pods and the lendee's
    shutdown after the longest grace; ``expiry``: how long after its time an unused
    reservation is kept; ``cooldown``: how long after a reservation that held ended
    unused (expired, yielded, or cancelled while it held) the same VM may not be
    reserved again."""

    lead: float = 900.0
    margin: float = 300.0
    expiry: float = 1800.0
    cooldown: float = 3600.0


@dataclass(frozen=True)
class At:
    """A time read by `read_at`; ``note``: what the answer must say about it (which of
    two instances of an ambiguous time it is), or None."""

    when: datetime
    note: str | None = None


_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_SETS = {"daily": frozenset(range(7)), "weekdays": frozenset(range(5)),
         "weekends": frozenset({5, 6})}


@dataclass(frozen=True)
class Every:
    """The days of the week (0 Monday to 6 Sunday) and the wall time of a series."""

    days: frozenset[int]
    hour: int
    minute: int

    def __str__(self) -> str:
        named = next((n for n, d in _SETS.items() if d == self.days), None)
        days = named or ",".join(_DAYS[d] for d in sorted(self.days))
        return f"{days} {self.hour:02}:{self.minute:02}"


def read_every(text: str) -> Every:
    """A series as people write it: days (daily, weekdays, weekends, or day names joined
    by commas: mon,wed,fri), an optional "at", and HH:MM."""
    words = text.strip()[:64].split()
    if len(words) == 3 and words[1].lower() == "at":
        words = [words[0], words[2]]
    if len(words) != 2:
        raise BadReservation(f"{text[:64]!r} is not a series: give days and a time, "
                             '"weekdays 20:00", "daily 07:30" or "mon,fri 21:00"')
    days_text, time_text = words[0].lower(), words[1]
    days = _SETS.get(days_text)
    if days is None:
        names = days_text.split(",")
        if not all(n in _DAYS for n in names):
            raise BadReservation(f"{days_text!r} are not days: daily, weekdays, weekends, "
                                 "or day names joined by commas (mon,wed,fri)")
        days = frozenset(_DAYS.index(n) for n in names)
    clock = _CLOCK.fullmatch(time_text)
    if clock is None or int(clock[1]) > 23 or int(clock[2]) > 59:
        raise BadReservation(f"{time_text!r} is not a time of day for a series: HH:MM, "
                             "00:00 to 23:59")
    return Every(days=days, hour=int(clock[1]), minute=int(clock[2]))


def next_occurrence(every: Every, after: float, zone: tzinfo) -> tuple[float, list[str]]:
    """The first occurrence of `every` strictly after `after`, at its wall time with
    `zone`'s rules for that date; and the days (ISO dates) passed over because the
    clock skips that time there."""
    start = datetime.fromtimestamp(after, zone).date()
    skipped = []
    for n in range(15):  # a week, and a week more for a day skipped
        day = start + timedelta(days=n)
        if day.weekday() not in every.days:
            continue
        when = datetime(day.year, day.month, day.day, every.hour, every.minute,
                        tzinfo=zone, fold=0)
        try:
            _local_time(when, zone)
        except BadReservation:
            skipped.append(day.isoformat())
            continue
        if when.timestamp() > after:
            return when.timestamp(), skipped
    raise BadReservation(f"{every} has no day in the next two weeks")


def parse_at(text: str, now: datetime) -> datetime:
    """`read_at`'s time alone."""
    return read_at(text, now).when


def read_at(text: str, now: datetime) -> At:
    """The time `text` names, seen from `now` (timezone-aware; its zone the host's, a
    zone with rules such as a `zoneinfo.ZoneInfo`): ``HH:MM``, the next time the clock
    shows it (today, or tomorrow if that has passed), or an ISO 8601 date and time (the
    host's zone unless it says one). Refuses the past, more than `MAX_AHEAD` ahead, and
    a local time the clock skips; of a local time it shows twice, the first."""
    text = text.strip()[:64]
    zone: tzinfo | None = now.tzinfo
    clock = _CLOCK.fullmatch(text)
    if clock:
        hour, minute = int(clock[1]), int(clock[2])
        if hour > 23 or minute > 59:
            raise BadReservation(f"{text!r} is not a time of day (HH:MM, 00:00 to 23:59)")
        # The wall time, on the date: its offset is the zone's for that date, not now's.
        when = now.replace(hour=hour, minute=minute, second=0, microsecond=0, fold=0)
        if when.timestamp() <= now.timestamp():
            when = (when.replace(tzinfo=None) + timedelta(days=1)).replace(tzinfo=zone)
        local = True
    else:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise BadReservation(
                f"{text!r} is not a time: give HH:MM (the next one) or a date and time, "
                "2026-12-04T20:00") from None
        local = when.tzinfo is None
        if local:
            when = when.replace(tzinfo=zone, fold=0)
    note = _local_time(when, zone) if local else None
    if when.timestamp() <= now.timestamp():
        raise BadReservation(f"{_shown(when)} has passed (it is {_shown(now)})")
    if when.timestamp() - now.timestamp() > MAX_AHEAD:
        raise BadReservation(f"{_shown(when)} is more than "
                             f"{MAX_AHEAD / 86400:g} days ahead")
    return At(when=when, note=note)


def _shown(when: datetime) -> str:
    """ISO 8601 to the minute, with the offset the zone gives that instant."""
    return when.astimezone(when.tzinfo).isoformat(timespec="minutes") \
        if when.tzinfo is not None else when.isoformat(timespec="minutes")


def _local_time(when: datetime, zone: tzinfo | None) -> str | None:
    """BadReservation for a wall time `zone`'s clock skips that day (naming the gap);
    for one it shows twice, which `when` (fold 0, the first) is, in words; else None."""
    if zone is None:
        return None
    first, second = when.replace(fold=0), when.replace(fold=1)
    before, after = first.utcoffset(), second.utcoffset()
    if before is None or after is None or before == after:
        return None
    wall = when.replace(tzinfo=None)
    shown = wall.strftime("%H:%M")
    day = wall.date().isoformat()
    # The instant the offset changes lies between the two readings of the wall time.
    lo = (wall - max(before, after)).replace(tzinfo=UTC)
    hi = (wall - min(before, after)).replace(tzinfo=UTC)
    while hi - lo > timedelta(seconds=1):
        mid = lo + (hi - lo) / 2
        if mid.astimezone(zone).utcoffset() == lo.astimezone(zone).utcoffset():
            lo = mid
        else:
            hi = mid
    change = hi.astimezone(zone)
    was = (hi - timedelta(seconds=1)).astimezone(zone)
    old, new = was.utcoffset(), change.utcoffset()
    assert old is not None and new is not None
    start = change.replace(tzinfo=None) - (new - old)  # the wall time at the change
    end = change.replace(tzinfo=None)
    if new > old:  # forward: the wall times from `start` to `end` do not exist
        raise BadReservation(
            f"{shown} does not exist on {day} in the host's zone: the clocks go forward "
            f"from {start:%H:%M} to {end:%H:%M} that night; give a time outside the gap")
    other = second if first.utcoffset() == old else first
    return (f"{shown} happens twice on {day} (the clocks go back from {start:%H:%M} to "
            f"{end:%H:%M}): this is the first, {_shown(first)}; for the second, give "
            f"{other.isoformat(timespec='minutes')}")


def rfc3339(at: float, zone: tzinfo) -> str:
    """`at` as the annotation carries it: RFC 3339, to the second, with its offset."""
    return datetime.fromtimestamp(at, zone).isoformat(timespec="seconds")


def evict_time(reservation: Reservation, grace: float, timing: Timing, now: float) -> float:
    """When the GPUs are taken back: the longest grace period of the pods on them and
    the margin before the time, never before now."""
    return max(now, reservation.at - max(0.0, grace) - timing.margin)


@dataclass(frozen=True, kw_only=True)
class Due:
    """What is due at a moment: the reservations whose notice goes out, those that
    begin to hold, those that begin to yield, and those that expire (`due`)."""

    notify: tuple[Reservation, ...] = ()
    hold: tuple[Reservation, ...] = ()
    expire: tuple[Reservation, ...] = ()
    yields: tuple[Reservation, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.notify or self.hold or self.expire or self.yields)


def due(reservations: Iterable[Reservation], now: float, timing: Timing) -> Due:
    notify, hold, expire, yields = [], [], [], []
    for r in reservations:
        if now >= r.at + timing.expiry:
            expire.append(r)
            continue
        if r.evict_at is None and now >= r.at - timing.lead:
            notify.append(r)
        elif r.evict_at is not None and not r.holding and now >= r.evict_at:
            hold.append(r)
        if not r.yielding and now >= r.yields_at:
            yields.append(r)
    return Due(notify=tuple(notify), hold=tuple(hold), expire=tuple(expire),
               yields=tuple(yields))


def next_wake(reservations: Iterable[Reservation], timing: Timing) -> float | None:
    """The next moment something is due (None: nothing reserved)."""
    times = []
    for r in reservations:
        times.append(r.at + timing.expiry)
        if r.evict_at is None:
            times.append(r.at - timing.lead)
        elif not r.holding:
            times.append(r.evict_at)
        if not r.yielding:
            times.append(r.yields_at)
    return min(times, default=None)


def yielded(reservations: Iterable[Reservation], running: Collection[str],
            claims: Callable[[str], frozenset[str]]) -> tuple[tuple[Reservation, str], ...]:
    """The yielding reservations another owner of one of their GPUs started meanwhile:
    (reservation, that owner). `claims`: the GPUs of an owner."""
    out = []
    for r in reservations:
        if not r.yielding or r.vm in running:
            continue
        other = next((o for o in sorted(running) if o != r.vm and claims(o) & claims(r.vm)),
                     None)
        if other is not None:
            out.append((r, other))
    return tuple(out)


def held(reservations: Iterable[Reservation]) -> frozenset[str]:
    """The owners whose GPUs reservations keep from the lendee now."""
    return frozenset(r.vm for r in reservations if r.holding)


def used(reservations: Iterable[Reservation], running: Collection[str]) -> tuple[Reservation, ...]:
    """The holding reservations whose owner runs: they served their purpose."""
    return tuple(r for r in reservations if r.holding and r.vm in running)


def put(reservations: Iterable[Reservation], new: Reservation) -> tuple[Reservation, ...]:
    """`new` in place of the owner's reservation, if it had one; sorted by time. One that
    held already hands its yield time on: a reservation moved later and later still
    yields from the first one's time, also when moved again before that time came (the
    one it replaces holds nothing yet, but carries the first one's time)."""
    kept = []
    for r in reservations:
        if r.vm != new.vm:
            kept.append(r)
        elif r.holding or r.yielding or r.yields_from is not None:
            new = replace(new, yields_from=min(new.yields_at, r.yields_at))
    return tuple(sorted([*kept, new], key=lambda r: (r.at, r.vm)))


def without(reservations: Iterable[Reservation],
            gone: Iterable[Reservation]) -> tuple[Reservation, ...]:
    names = {r.vm for r in gone}
    return tuple(r for r in reservations if r.vm not in names)


def changed(reservations: Iterable[Reservation], vm: str, **changes: object) -> tuple[
        Reservation, ...]:
    return tuple(replace(r, **changes) if r.vm == vm else r  # type: ignore[arg-type]
                 for r in reservations)
