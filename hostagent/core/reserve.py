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
    at + expiry         nobody came: the reservation is dropped and the GPUs lent again

A reservation ends when its owner starts once it holds (used), when it expires, or
when it is cancelled; the journal says which. One per owner: a new one replaces it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, tzinfo

__all__ = [
    "MAX_AHEAD",
    "BadReservation",
    "Due",
    "Reservation",
    "Timing",
    "due",
    "evict_time",
    "held",
    "next_wake",
    "parse_at",
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
    the lendee now."""

    vm: str
    at: float
    by: str  # who asked: "control (uid 1000)", "ssh key phone", "mqtt"
    made: float
    evict_at: float | None = None
    holding: bool = False


@dataclass(frozen=True, kw_only=True)
class Timing:
    """``lead``: how long before the time the notice goes out (at least the longest grace
    period plus ``margin``); ``margin``: for the drain of the other pods and the lendee's
    shutdown after the longest grace; ``expiry``: how long after its time an unused
    reservation is kept."""

    lead: float = 900.0
    margin: float = 300.0
    expiry: float = 1800.0


def parse_at(text: str, now: datetime) -> datetime:
    """The time `text` names, seen from `now` (timezone-aware; its zone is the host's):
    ``HH:MM``, the next time the clock shows it (today, or tomorrow if that has passed),
    or an ISO 8601 date and time (the host's zone unless it says one). Refuses the past,
    and more than `MAX_AHEAD` ahead."""
    text = text.strip()[:64]
    zone: tzinfo | None = now.tzinfo
    clock = _CLOCK.fullmatch(text)
    if clock:
        hour, minute = int(clock[1]), int(clock[2])
        if hour > 23 or minute > 59:
            raise BadReservation(f"{text!r} is not a time of day (HH:MM, 00:00 to 23:59)")
        when = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if when <= now:
            when += timedelta(days=1)
    else:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise BadReservation(
                f"{text!r} is not a time: give HH:MM (the next one) or a date and time, "
                "2026-12-04T20:00") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=zone)
    if when <= now:
        raise BadReservation(f"{when.isoformat(timespec='minutes')} has passed "
                             f"(it is {now.isoformat(timespec='minutes')})")
    if (when - now).total_seconds() > MAX_AHEAD:
        raise BadReservation(f"{when.isoformat(timespec='minutes')} is more than "
                             f"{MAX_AHEAD / 86400:g} days ahead")
    return when


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
    begin to hold, and those that expire (`due`)."""

    notify: tuple[Reservation, ...] = ()
    hold: tuple[Reservation, ...] = ()
    expire: tuple[Reservation, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.notify or self.hold or self.expire)


def due(reservations: Iterable[Reservation], now: float, timing: Timing) -> Due:
    notify, hold, expire = [], [], []
    for r in reservations:
        if now >= r.at + timing.expiry:
            expire.append(r)
        elif r.evict_at is None and now >= r.at - timing.lead:
            notify.append(r)
        elif r.evict_at is not None and not r.holding and now >= r.evict_at:
            hold.append(r)
    return Due(notify=tuple(notify), hold=tuple(hold), expire=tuple(expire))


def next_wake(reservations: Iterable[Reservation], timing: Timing) -> float | None:
    """The next moment something is due (None: nothing reserved)."""
    times = []
    for r in reservations:
        times.append(r.at + timing.expiry)
        if r.evict_at is None:
            times.append(r.at - timing.lead)
        elif not r.holding:
            times.append(r.evict_at)
    return min(times, default=None)


def held(reservations: Iterable[Reservation]) -> frozenset[str]:
    """The owners whose GPUs reservations keep from the lendee now."""
    return frozenset(r.vm for r in reservations if r.holding)


def used(reservations: Iterable[Reservation], running: Collection[str]) -> tuple[Reservation, ...]:
    """The holding reservations whose owner runs: they served their purpose."""
    return tuple(r for r in reservations if r.holding and r.vm in running)


def put(reservations: Iterable[Reservation], new: Reservation) -> tuple[Reservation, ...]:
    """`new` in place of the owner's reservation, if it had one; sorted by time."""
    kept = [r for r in reservations if r.vm != new.vm]
    return tuple(sorted([*kept, new], key=lambda r: (r.at, r.vm)))


def without(reservations: Iterable[Reservation],
            gone: Iterable[Reservation]) -> tuple[Reservation, ...]:
    names = {r.vm for r in gone}
    return tuple(r for r in reservations if r.vm not in names)


def changed(reservations: Iterable[Reservation], vm: str, **changes: object) -> tuple[
        Reservation, ...]:
    return tuple(replace(r, **changes) if r.vm == vm else r  # type: ignore[arg-type]
                 for r in reservations)
