"""The levers that shorten a player's wait, and the ``[drain]`` section that sets them.
No side effects: the executor and the cluster ask these functions, then act.

    [drain]
    unplanned_grace = "10s"       # a player's start: evicted pods get at most this long to
                                  # stop ("" = their own grace); reservations keep theirs
    shutdown_when = "accepted"    # a player's start: the lendee's shutdown begins once every
                                  # eviction is accepted ("gone": once the pods are gone)
    stop = "shutdown"             # how a drained lendee stops: its guest's own shutdown, or
                                  # "power-off" (filesystems frozen, then a power-off)
    cordon_ahead = false          # cordon the lendee ahead of an owner's usual hour
    ahead_lead = "15m"            # this long before it
    usual_weeks = 3               # an hour of the week is usual when an owner started in
    usual_of = 4                  # it in at least usual_weeks of the last usual_of weeks

1. **An eviction grace for unplanned starts** (`terms`, `eviction_grace`). A player who
   runs ``virsh start`` waits for the drain; a pod that ignores SIGTERM holds it for its
   whole grace period (the API's default is 30 s). For such a start the grace each
   eviction asks for is capped at ``unplanned_grace``: 10 s by default, what a job that
   handles SIGTERM needs to save its state (a checkpoint written on SIGTERM), and a
   third of the default that a job that ignores it would otherwise hold the player for.
   A reservation's pods were told ahead and keep their full grace, and so does a
   restart nobody waits for (a regrow) or a reclaim asked by hand.
2. **The shutdown once the evictions are accepted** (`terms`). Once the API server has
   accepted every eviction (201), each pod is being deleted: nothing the drain does
   after that can keep one, and the guest's own shutdown (a k3s node's takes about
   30 s) can run while they stop. For a player's start the lendee's shutdown begins
   then; the owner still starts only once the lendee is off. The drain's end is still
   followed and journaled, beside.
3. **Cordoned ahead of an owner's usual hour** (`usual_hours`, `ahead`). From the
   owners' past starts (the journal's history), an hour of the week is usual for an
   owner when it started in it in at least ``usual_weeks`` of the last ``usual_of``
   weeks. From ``ahead_lead`` before such an hour until it ends, the lendee holding the
   owner's GPUs is cordoned: it takes no new pod, so that a start finds it as empty as
   the running pods leave it. When the hour passes without a start it is uncordoned.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from hostagent.core.config_read import (
    _Problem, _bool, _build, _choice, _count, _key, _optional_duration, _duration,
    _raise_any)

__all__ = ["DrainPolicy", "ShutdownWhen", "Stop", "Terms", "Ahead", "ahead",
           "eviction_grace", "power_off", "read_drain", "terms", "usual_hours"]

HOUR = 3600.0
WEEK = 7 * 24 * HOUR
# The grace period the API server gives a pod whose spec sets none
# (k8s.io/api/core/v1: DefaultTerminationGracePeriodSeconds).
API_DEFAULT_GRACE = 30.0


def _weeks(value: object, key: str) -> int:
    """A number of weeks of history: 1 to 52 (none, or a negative count, learns nothing)."""
    weeks = _count(value, key)
    if not 1 <= weeks <= 52:
        raise _Problem(key, f"{weeks} is not a number of weeks", "write 1 to 52")
    return weeks


class ShutdownWhen(enum.StrEnum):
    """When a player's reclaim shuts the lendee down."""

    ACCEPTED = "accepted"  # once every eviction is accepted: the pods stop meanwhile
    GONE = "gone"  # once the evicted pods are gone (kubectl drain's end)


class Stop(enum.StrEnum):
    """How a reclaim stops its drained lendee (lever 4)."""

    SHUTDOWN = "shutdown"  # the guest's own shutdown, through its guest agent
    POWER_OFF = "power-off"  # filesystems frozen through the agent, then a power-off


@dataclass(frozen=True, kw_only=True)
class DrainPolicy:
    """``[drain]``: the levers (see the module docstring)."""

    # None: the pods' own grace (or [kubernetes] grace_period) for a player's start too.
    unplanned_grace: float | None = field(default=10.0, metadata=_key(_optional_duration))
    shutdown_when: ShutdownWhen = field(default=ShutdownWhen.ACCEPTED,
                                        metadata=_key(_choice(ShutdownWhen)))
    cordon_ahead: bool = field(default=False, metadata=_key(_bool))
    ahead_lead: float = field(default=900.0, metadata=_key(_duration))
    usual_weeks: int = field(default=3, metadata=_key(_weeks))
    usual_of: int = field(default=4, metadata=_key(_weeks))
    stop: Stop = field(default=Stop.SHUTDOWN, metadata=_key(_choice(Stop)))


def read_drain(value: object, key: str) -> DrainPolicy:
    """The ``[drain]`` section: its keys, then ``stop = "power-off"`` against
    ``shutdown_when`` (a power-off waits for every evicted pod to be gone, so "gone" is
    its default, and "accepted" written beside it is refused)."""
    try:
        policy, problems = _build(DrainPolicy, value, key), []
    except _Problem as p:
        if p.salvaged is None:
            raise
        policy, problems = p.salvaged, p.each
    if policy.stop is Stop.POWER_OFF and isinstance(value, dict):
        if "shutdown_when" not in value:
            policy = replace(policy, shutdown_when=ShutdownWhen.GONE)
        elif policy.shutdown_when is ShutdownWhen.ACCEPTED:
            problems.append(_Problem(
                f"{key}.shutdown_when",
                f'"accepted" cannot go with {key}.stop = "power-off": it begins the '
                "lendee's stop while the evicted pods still run, and a power-off must wait "
                "until every one of them is gone",
                'write shutdown_when = "gone" (or remove it: with stop = "power-off" it is '
                'the default), or stop = "shutdown" to keep shutdown_when = "accepted"'))
    _raise_any(problems, policy)
    return policy


# --- 1 and 2: a drain's terms ------------------------------------------------------------


@dataclass(frozen=True)
class Terms:
    """How one reclaim drains: the cap on the pods' grace (None: their own), whether
    the shutdown begins once the evictions are accepted, and the words for the Event,
    the journal and the pods' notice, with how the node's VM stops (`stop`)."""

    grace_cap: float | None
    early_shutdown: bool
    said: str
    stop: str = "shuts down"


def terms(policy: DrainPolicy, *, players_waiting: bool, regrow: bool = False) -> Terms:
    """The terms of a reclaim: a player waiting (an unplanned start: ``virsh start``,
    ``hostagent play``, a button) gets the levers; a reservation alone, a regrow or a
    reclaim by hand drains as kubectl does, each pod with its full grace period."""
    stop = ('is powered off once every evicted pod is gone (drain.stop = "power-off"; it '
            "shuts down if one stays)") if policy.stop is Stop.POWER_OFF else "shuts down"
    if not players_waiting or regrow:
        why = "a restart nobody waits for" if regrow else "nobody is waiting to play"
        return Terms(None, False, f"evicted pods get their full grace period ({why})", stop)
    cap = policy.unplanned_grace
    said = ("evicted pods get their own grace period" if cap is None else
            f"evicted pods get at most {cap:g} s to stop (drain.unplanned_grace: a player "
            "is waiting)")
    early = policy.shutdown_when is ShutdownWhen.ACCEPTED
    if early:
        said += "; the node's VM shuts down once every eviction is accepted"
    return Terms(cap, early, said, stop)


def eviction_grace(own: float | None, *, override: float | None,
                   cap: float | None) -> float | None:
    """The grace period an eviction asks for, None for the pod's own: `override`
    ([kubernetes] grace_period, kubectl drain's --grace-period) in place of the pod's
    `own` (None: it set none, the API's 30 s), then at most `cap`. A pod whose grace is
    within the cap keeps it as it is."""
    grace = override if override is not None else own
    if cap is None:
        return override
    if (API_DEFAULT_GRACE if grace is None else grace) <= cap:
        return override
    return cap


# --- 3: ahead of an owner's usual hour ---------------------------------------------------


def hour_of_week(at: datetime) -> int:
    """0 (Monday 00:00-01:00) to 167 (Sunday 23:00-24:00), in `at`'s own time zone."""
    return at.weekday() * 24 + at.hour


def usual_hours(starts: Iterable[datetime], now: datetime, *, seen: int,
                weeks: int) -> frozenset[int]:
    """The hours of the week (`hour_of_week`) in which an owner started in at least
    `seen` of the last `weeks` weeks before `now`: its usual hours. Each week counts an
    hour once, however many starts it saw in it."""
    if seen < 1 or weeks < 1:
        return frozenset()
    counted: dict[int, set[int]] = {}
    for at in starts:
        back = (now - at).total_seconds()
        if 0 <= back < weeks * WEEK:
            counted.setdefault(hour_of_week(at), set()).add(int(back // WEEK))
    return frozenset(h for h, found in counted.items() if len(found) >= seen)


@dataclass(frozen=True)
class Ahead:
    """An owner's usual hour the lendee is cordoned for: from `lead` before `hour` (its
    start) until the hour ends."""

    owner: str
    hour: datetime

    @property
    def until(self) -> datetime:
        return self.hour + timedelta(hours=1)

    def __str__(self) -> str:
        return f"ahead of {self.owner}'s usual hour ({self.hour:%a %H:%M})"


def ahead(usual: Mapping[str, frozenset[int]], now: datetime, *,
          lead: float) -> Ahead | None:
    """The usual hour (of an owner in `usual`, owner → its `usual_hours`) whose window,
    from `lead` seconds before it to its end, holds `now`; the soonest if several,
    the first owner by name on a tie. None: no window holds `now`."""
    base = now.replace(minute=0, second=0, microsecond=0)
    found: list[tuple[datetime, str]] = []
    steps = int(lead // HOUR) + 1
    for owner, hours in usual.items():
        for k in range(0, steps + 1):  # this hour, and those the lead reaches into
            hour = base + timedelta(hours=k)
            if hour_of_week(hour) in hours and \
                    hour - timedelta(seconds=lead) <= now < hour + timedelta(hours=1):
                found.append((hour, owner))
    if not found:
        return None
    hour, owner = min(found)
    return Ahead(owner, hour)


# --- 4: the stop of a drained lendee -----------------------------------------------------


def power_off(policy: DrainPolicy, *, emptied: bool) -> bool:
    """Whether a reclaim powers its drained lendee off (lever 4) rather than shutting it
    down: under ``stop = "power-off"``, and only if its drain `emptied` the node (it
    ended with every evicted pod gone; not one the policy let pass with pods left)."""
    return policy.stop is Stop.POWER_OFF and emptied
