"""The lend/reclaim state machine: (state, event) → (state, actions), and nothing else.

This module contains no I/O whatsoever. It does not start VMs, talk to Kubernetes, read
the clock or log; time arrives inside events (``at``), and everything the world should
do leaves as `Action` values for the executor in `hostagent.service.executor`. The lend/reclaim
policy lives here and only here, so it can be read in one sitting and tested
exhaustively in milliseconds.

The cycle
---------
One lendee VM (a Kubernetes worker) borrows GPUs that owner VMs (games) own. Each
start of the lendee takes the GPUs that are free then (`free_gpus`: no owner runs,
starts or waits with them or with their IOMMU group, no other VM holds part of that:
`GroupsHeld`), all of its GPUs or none unless ``policy.partial``, and at least
``min_gpus``; the set it took is ``lent``. An owner that needs a lent GPU reclaims the
lendee (a drain, then a shutdown), and may only start once the lendee is off; the lendee
starts again later with what is free then. GPUs that free up while it runs are taken by
restarting it (a regrow, per ``policy.regrow``)::

              RelendDue → StartLendee,
        ┌──── then LendeeStarted ─────┐
        │                             ▼
       OFF                         BOOTING ── AgentUp → KubeReturn ──▶ JOINING
        ▲                             │                                   │
        │                             │ OwnerWants → Drain                │ ReturnDone
        │                             ▼   (from JOINING, LENT, FAILED too) ▼
        │ LendeeStopped            DRAINING ◀──────── OwnerWants ──────── LENT
        │ → StartOwner for            │
        │   each waiting owner        │ Drained → WaitAgent
        └──────── STOPPING ◀──────────┘
                  AgentUp → ShutdownLendee

In LENT, GPUs a game freed are added by a restart (a regrow: the reclaim's road, then
a start with more), or with ``policy.hotplug`` attached live (`AttachGpus`; LENT is
entered anew until `GpusAttached` or `AttachFailed`). With ``policy.hotplug = "both"``
an owner's GPUs are taken back live too when the lendee keeps enough without them
(`DetachGpus`; LENT entered anew until `GpusDetached`, which starts the owner and
returns the node through JOINING, or `DetachFailed`, which takes the reclaim's road).

A reservation that holds (`Reserve`, see `hostagent.core.reserve`) keeps its owner's GPUs
from the lendee as an owner that waits does, and starts nobody.

FAILED is where the lendee stays, running, when a step cannot finish without a human:
its guest agent never answered, it ignored a shutdown, or the node came back without
all its GPUs. The reason says what to do. An owner asking again (or ``hostagent
resume``) retries; the lendee stopping by any means resumes the cycle. (A drain the
policy aborts is not a failure of the lendee: the requests fail, and it stays lent.)

What this machine promises
--------------------------
1. **Never two running holders of a GPU.** An owner that needs a GPU the lendee holds
   or is starting with is only started (`StartOwner`) once the lendee is off and its
   start is over; the lendee is only started (`StartLendee`) with GPUs no owner runs,
   starts or waits with.
2. **Never a shutdown before the guest agent answered.** `ShutdownLendee` is only ever
   the answer to an `AgentUp` in STOPPING, and STOPPING always begins with a fresh
   `WaitAgent`: an agent that answered an hour ago may have been restarted since.
3. **Never a destroy unless the policy allows it.** `ForceOff` only with
   ``policy.force_off``; otherwise the machine stops in FAILED and says so.
4. **An intent is never dropped.** An owner's start request ends only through
   `CompleteIntent` (the owner runs) or `FailIntent` (with a reason). It survives
   failures, retries and restarts of the agent (`Observed`).
5. **One reclaim serves everyone.** Owners asking while a reclaim is under way join it;
   they are all started when the lendee stops.
6. **An IOMMU group moves as one.** An owner claims every GPU that shares a group with
   its own (`Topology.claims`): the lendee never starts with part of a group an owner
   needs, and an owner's start reclaims the lendee if it holds any of the group.

How to read it
--------------
`TRANSITIONS`, near the end, is the whole machine: for each phase, which event types it
accepts and which rule handles them. A few events mean the same in every phase (an
owner asking, starting or stopping; hold, resume and a reclaim by hand; a fresh
observation; a failed start) and share one rule each. Every rule is a small function
above the table, and its docstring says why the rule is what it is.

An event the table does not list for the current phase raises `IllegalTransition`,
and so does an event the rule recognises as stale (a report whose ticket is not the
current one, a timer that was cancelled, a start that is not in flight). The state the
caller holds is untouched (states are immutable; the caller simply keeps the old one).
In an asynchronous agent stale events are normal: the executor logs them and moves on.
Being strict here is what makes that safe: a stale `AgentTimeout` from the boot-time
wait must not fail the shutdown that began since.

After every rule one bookkeeping step runs: a scheduled relend that is no longer
allowed (a game started, lending was put on hold, the lendee started by hand) is
cancelled. Rules therefore only ever need to *schedule*; they cannot forget to cancel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from hostagent.core.model import (
    Action,
    AgentTimeout,
    AgentUp,
    AttachFailed,
    AttachGpus,
    CancelIntent,
    CancelRelend,
    CompleteIntent,
    DetachFailed,
    DetachGpus,
    Drain,
    Drained,
    DrainFailed,
    Event,
    FailIntent,
    ForceOff,
    GpuPods,
    GpusAttached,
    GpusDetached,
    GroupsHeld,
    GroupsTaken,
    Hold,
    Hotplug,
    Intent,
    KubeReturn,
    LendeeStarted,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    OwnerWants,
    Phase,
    Policy,
    Reclaim,
    Regrow,
    Reserve,
    RelendDue,
    Resume,
    ReturnDone,
    ReturnFailed,
    ScheduleRelend,
    ShutdownLendee,
    ShutdownTimeout,
    StartFailed,
    StartLendee,
    StartOwner,
    State,
    Topology,
    VmStopped,
    WaitAgent,
    free_gpus,
    holders,
    still_wanted,
)

__all__ = [
    "FOLLOW",
    "TRANSITIONS",
    "Decision",
    "IllegalTransition",
    "conflict",
    "free_gpus",
    "holders",
    "step",
    "still_wanted",
    "verdict",
]

Decision = Literal["proceed", "defer", "refuse"]

FOLLOW = "follow with: journalctl -u hostagent -f"


class IllegalTransition(Exception):
    """`event` cannot happen in `phase` (or is a stale report); the state is unchanged."""

    def __init__(self, phase: Phase, event: Event, why: str = "") -> None:
        self.phase = phase
        self.event = event
        self.why = why or "no rule for it in this phase"
        super().__init__(f"{type(event).__name__} refused in phase {phase}: {self.why}")


# --- helpers: the questions every rule asks --------------------------------------------

_Outcome = tuple[State, list[Action]]


@dataclass(frozen=True)
class _Ctx:
    topo: Topology
    policy: Policy


def _enter(state: State, phase: Phase, **changes: Any) -> State:
    """`state` in `phase`, with a new ticket: actions and reports of the previous phase
    go stale. No phase begins with a shutdown already sent (STOPPING sends its own), and
    a regrow goes on only from its drain to its shutdown, a hot-add or a hot-unplug only
    within its own entry of LENT."""
    changes.setdefault("regrowing", state.regrowing and phase is Phase.STOPPING)
    changes.setdefault("attaching", frozenset())
    changes.setdefault("detaching", frozenset())
    changes.setdefault("replug", state.replug and phase not in (Phase.LENT, Phase.OFF))
    return replace(state, phase=phase, ticket=state.ticket + 1, shutdown_sent=False, **changes)


def _stale(state: State, event: Event, why: str) -> IllegalTransition:
    return IllegalTransition(state.phase, event, why)


_Report = (
    AgentUp | AgentTimeout | Drained | DrainFailed | ShutdownTimeout | ReturnDone | ReturnFailed
    | GpusAttached | AttachFailed | GpusDetached | DetachFailed | GroupsHeld
)


def _check_ticket(state: State, event: _Report) -> None:
    """A report answers the action of one phase entry; any other ticket is stale."""
    if event.ticket != state.ticket:
        raise _stale(state, event, f"stale report (ticket {event.ticket}, now {state.ticket})")


def _check_owner(state: State, event: Event, owner: str, ctx: _Ctx) -> None:
    if not ctx.topo.is_owner(owner):
        raise _stale(state, event, f"{owner} is not an owner VM in the topology")


def _pending(state: State) -> tuple[str, ...]:
    """Owners on their way to running: waiting for GPUs, or let through and starting."""
    return tuple(dict.fromkeys([*state.waiting_owners, *sorted(state.starting_owners)]))


def _pending_claimants(state: State, topo: Topology) -> list[str]:
    """Pending owners that need a GPU the lendee may borrow: while one is on its way, no
    lendee start may race it, whatever GPUs that start would take."""
    return [o for o in _pending(state) if topo.needs_lendee_gpus(o)]


def _in_the_way(state: State, topo: Topology) -> list[str]:
    """Owners that run, start or wait and need a GPU the lendee holds (or is getting):
    each is a reason to take the lendee down."""
    owners = [*sorted(state.running_owners), *_pending(state), *sorted(state.reserved)]
    return list(dict.fromkeys(o for o in owners if topo.claims(o) & state.lent))


def conflict(state: State, owner: str, topo: Topology) -> str | None:
    """Why `owner` cannot start because another owner of one of its GPUs runs, is on
    its way or has a reservation that holds it (owners of one card exclude each other:
    never a reclaim, never a wait on a game), or None. A reservation past its time and
    unused (``yielding``) stops nobody: a real start beats a reservation nobody uses.
    The refusal names who reserved, for the journal."""
    mine = topo.claims(owner)
    firm = {r.vm: r.by for r in state.reservations if r.holding and not r.yielding}
    for others, what in ((sorted(state.running_owners), "in use by"),
                         (_pending(state), "being handed to"),
                         (sorted(firm), "reserved for")):
        for other in others:
            both = mine & topo.claims(other)
            if other != owner and both:
                verb = "is" if len(both) == 1 else "are"
                by = f" (by {firm[other]})" if what == "reserved for" and firm[other] else ""
                return f"{', '.join(sorted(both))} {verb} {what} {other}{by}"
    return None


def _relend_allowed(state: State, ctx: _Ctx) -> bool:
    """Whether nothing stands between an idle lendee and its next start.

    Owners that share no GPU with the lendee do not count: an owner with GPUs of its own
    starting or playing is no reason to leave the cluster's GPUs idle. Owners that run
    only leave their GPUs out of the start, unless the policy is all or nothing.
    """
    return (
        state.phase is Phase.OFF
        and not state.lendee_starting
        and not state.hold
        and not _pending_claimants(state, ctx.topo)
        and len(free_gpus(state, ctx.topo, ctx.policy)) >= ctx.policy.min_gpus
    )


def _regrow_wanted(state: State, ctx: _Ctx) -> bool:
    """Whether a lent lendee could hold more GPUs than it does (a game ended since it
    started), and the policy would restart it for them."""
    return state.phase is Phase.LENT and _regrow_gains(state, ctx)


def _regrow_moot(state: State, ctx: _Ctx) -> bool:
    """Whether the regrow under way would gain nothing now (the game it waited on started
    again, lending was put on hold): the lendee is better returned as it is."""
    return state.regrowing and not _regrow_gains(state, ctx)


def _regrow_gains(state: State, ctx: _Ctx) -> bool:
    """Whether a restart (or a hot-add) would give the lendee more GPUs than it holds,
    as allowed."""
    return (
        not state.hold
        and not state.detaching
        and ctx.policy.partial
        and (ctx.policy.regrow is not Regrow.NEVER or _hot_add(state, ctx))
        and not _pending_claimants(state, ctx.topo)
        and bool(free_gpus(state, ctx.topo, ctx.policy) - state.lent)
    )


def _hot_add(state: State, ctx: _Ctx) -> bool:
    """Whether GPUs freed while the lendee runs are attached live rather than by a
    restart: the policy says so, and no hot-add failed since it started."""
    return ctx.policy.hotplug is not Hotplug.NONE and not state.hotadd_failed


def _unplug(state: State, owner: str, ctx: _Ctx) -> frozenset[str] | None:
    """The GPUs to detach live so that `owner` can start, or None when the reclaim must
    restart the lendee: the policy says "both", the lendee is lent and steady (no
    hot-add, hot-unplug or reclaim under way, none failed since it started), partial
    lending is on, and it keeps at least ``min_gpus`` without them. Whole IOMMU groups:
    `Topology.claims` counts every GPU that shares one with the owner's."""
    take = ctx.topo.claims(owner) & state.lent
    steady = (state.phase is Phase.LENT and not state.attaching and not state.detaching
              and not state.reclaiming and not state.unplug_failed)
    if (ctx.policy.hotplug is not Hotplug.BOTH or not steady or not ctx.policy.partial
            or len(state.lent - take) < max(1, ctx.policy.min_gpus)):
        return None
    return take


def _schedule_relend(state: State, ctx: _Ctx, due: float) -> _Outcome:
    """Arm the relend timer (a lend from OFF, or a regrow from LENT) if one is allowed
    and it is not armed already.

    An armed timer is left alone: it was set when the last reason to wait went away,
    and something that is no reason (an unrelated owner stopping) must not push it back.
    """
    if state.relend_at is not None:
        return state, []
    if not (_relend_allowed(state, ctx) or _regrow_wanted(state, ctx)):
        return state, []
    return replace(state, relend_at=due), [ScheduleRelend(at=due)]


def _start_waiting(state: State, topo: Topology, *, all_owners: bool = False) -> list[Action]:
    """StartOwner for each waiting owner that was waiting for the lendee's GPUs.

    Owners that need no lendee GPU were started when they asked; `all_owners` also
    starts them, for when in-flight starts may have been lost (a restart of the agent).
    """
    return [
        StartOwner(owner=o) for o in state.waiting_owners if all_owners or topo.needs_lendee_gpus(o)
    ]


def _reclaim(state: State, *, regrow: bool = False) -> _Outcome:
    """Begin taking the GPUs back: cordon and drain first, never shut down a busy node.
    A `regrow`'s drain is the kind nobody waits for (see `Drain`)."""
    new = _enter(state, Phase.DRAINING, reason=None, regrowing=regrow)
    return new, [Drain(ticket=new.ticket, regrow=regrow)]


def _join_reclaim(state: State) -> _Outcome:
    """A reclaim someone waits for joins the one under way. A regrow's is not theirs:
    its drain gives up where theirs must not, so it begins again as theirs (a drain is
    idempotent); once drained, the shutdown is theirs as it stands."""
    if not state.regrowing:
        return state, []
    if state.phase is Phase.DRAINING:
        return _reclaim(state)
    return replace(state, regrowing=False), []


def _back_to_lending(state: State) -> _Outcome:
    """A reclaim given up while the lendee runs: it is returned to the cluster the usual
    way (its cordon lifted by `KubeReturn`, only if it was ours), through BOOTING first
    if its guest agent has not answered yet."""
    if not state.agent_up:
        return _boot(state)
    new = _enter(state, Phase.JOINING, reason=None)
    return new, [KubeReturn(ticket=new.ticket, restart_plugins=new.replug)]


def _boot(state: State) -> _Outcome:
    """The lendee runs and nobody wants its GPUs: wait for its agent, then lend it."""
    new = _enter(state, Phase.BOOTING, reason=None, agent_up=False)
    return new, [WaitAgent(ticket=new.ticket)]


def _rebuild_running(state: State, ctx: _Ctx) -> _Outcome:
    """Resume a running lendee from the top of whichever road it is on.

    Each road is idempotent from its first step: `Drain` of a drained node returns at
    once, `WaitAgent` of an answering agent too, and `KubeReturn` re-verifies what it
    finds. So starting over is always correct, and never destroys anything. A reclaim
    by hand is a road of its own: it goes on until the lendee is off.
    """
    if state.reclaiming or _in_the_way(state, ctx.topo):
        return _reclaim(state)
    return _boot(state)


# --- rules for every phase -------------------------------------------------------------


def _owner_wants(state: State, event: OwnerWants, ctx: _Ctx) -> _Outcome:
    """Someone asked for an owner to start: record the intent, then free its GPUs.

    - The same intent id twice is a replay (a spooled hook event read again): stale.
    - An owner that already runs has what was asked for: the intent completes at once.
    - Otherwise the intent is kept until `OwnerStarted` completes it or `StartFailed`
      fails it. A request for an owner that already has one joins it: one intent per
      owner, whoever asks and however often (a client that asks and hangs up in a loop
      adds nothing to keep or to write); a second caller follows that intent's answer.
    - Another owner of one of its GPUs runs or is on its way: refused at once with one
      sentence ("gpu-a is in use by gaming-win"), never a reclaim, never a wait on a game.
    - An owner whose GPUs the lendee neither holds nor is getting (it shares none with
      it, the lendee is off, or it runs or starts without them) is started right away.
    - A lendee start in flight with its GPUs: the two starts would race for the same
      device. The intent waits for the lendee's start to end (`LendeeStarted` reclaims
      it, `StartFailed` frees it).
    - With the lendee running with its GPUs, a reclaim begins (or the one under way is
      joined: one drain and one shutdown serve two owners that asked 100 ms apart). From
      FAILED this is the retry: the player asking again is the signal to try again.
    - Unless, lent and steady, it can give them up live (`_unplug`): LENT is entered
      anew with them being detached (still ``lent`` until libvirt has removed them, so
      the owner waits); another owner wanting another lent GPU meanwhile takes the
      reclaim's road, which frees everything.
    """
    _check_owner(state, event, event.owner, ctx)
    if any(i.id == event.intent_id for i in state.intents):
        raise _stale(state, event, f"intent {event.intent_id} is already pending")
    if event.owner in state.running_owners:
        return state, [CompleteIntent(intent_id=event.intent_id, owner=event.owner)]
    rival = conflict(state, event.owner, ctx.topo)
    if rival is not None:
        raise _stale(state, event, rival)
    first = not state.intents_of(event.owner)
    intent = Intent(id=event.intent_id, owner=event.owner, created_at=event.at, source=event.source)
    new = replace(state, intents=(*state.intents, intent)) if first else state
    if not ctx.topo.claims(event.owner) & state.lent:
        return new, [StartOwner(owner=event.owner)] if first else []
    if state.phase is Phase.OFF:
        return new, []
    if state.phase in (Phase.DRAINING, Phase.STOPPING):
        return _join_reclaim(new)
    if state.detaching and ctx.topo.claims(event.owner) & state.lent <= state.detaching:
        return new, []  # its GPUs are on their way out already: it waits for them
    take = _unplug(new, event.owner, ctx)
    if take is None:
        return _reclaim(new)
    new = _enter(new, Phase.LENT, detaching=take)
    return new, [DetachGpus(ticket=new.ticket, gpus=take)]


def _reserve(state: State, event: Reserve, ctx: _Ctx) -> _Outcome:
    """The reservations changed (`hostagent.core.reserve`). The GPUs of one that holds are
    taken back as for an owner that waits, gently (the drain gives each pod its grace,
    or a hot-unplug), but nobody starts; one that ended (used, expired, cancelled)
    frees its GPUs for the next lend, or a regrow."""
    for r in event.reservations:
        _check_owner(state, event, r.vm, ctx)
    new = replace(state, reservations=event.reservations)
    way = [o for o in sorted(new.reserved) if ctx.topo.claims(o) & new.lent]
    if not way or state.phase is Phase.OFF:
        return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
    if state.phase in (Phase.DRAINING, Phase.STOPPING):
        return _join_reclaim(new)
    take = _unplug(new, way[0], ctx) if len(way) == 1 and not state.detaching else None
    if state.phase is Phase.FAILED or take is None:
        return (new, []) if state.phase is Phase.FAILED else _reclaim(new)
    new = _enter(new, Phase.LENT, detaching=take)
    return new, [DetachGpus(ticket=new.ticket, gpus=take)]


def _owner_started(state: State, event: OwnerStarted, ctx: _Ctx) -> _Outcome:
    """An owner runs: every request for it is done.

    If it shares a GPU with a lendee that is lending or about to (BOOTING, JOINING,
    LENT), reality contradicts the topology: libvirt refuses a device in use, so this
    only happens when the configuration does not describe the domain XML. The machine
    believes reality and reclaims the lendee, gently (drain, agent shutdown), because
    the owner's claim comes first. In FAILED it does not act on its own: a human is
    already asked to look.
    """
    _check_owner(state, event, event.owner, ctx)
    if event.owner in state.running_owners:
        raise _stale(state, event, f"{event.owner} is already running")
    mine = state.intents_of(event.owner)
    new = replace(
        state,
        running_owners=state.running_owners | {event.owner},
        starting_owners=state.starting_owners - {event.owner},
        intents=tuple(i for i in state.intents if i.owner != event.owner),
    )
    actions: list[Action] = [CompleteIntent(intent_id=i.id, owner=i.owner) for i in mine]
    if ctx.topo.claims(event.owner) & state.lent and state.phase in (
        Phase.BOOTING,
        Phase.JOINING,
        Phase.LENT,
    ):
        new, more = _reclaim(new)
        actions += more
    elif (new.phase is Phase.OFF and new.reason is None and ctx.topo.needs_lendee_gpus(event.owner)
          and (mine or event.owner in state.starting_owners)):
        # The lendee waited for this start: it now takes what is left, at once.
        new, more = _schedule_relend(new, ctx, event.at)
        actions += more
    elif new.phase is Phase.LENT:
        # Its start, pending, held back a regrow for GPUs freed meanwhile: arm it again.
        new, more = _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
        actions += more
    return new, actions


def _owner_stopped(state: State, event: OwnerStopped, ctx: _Ctx) -> _Outcome:
    """An owner stopped: if it was the last reason to keep the lendee off, lend again
    after `relend_delay`, not at once: a game VM that reboots stops and starts within
    seconds, and a lend/reclaim round trip for it would cost the player minutes."""
    _check_owner(state, event, event.owner, ctx)
    if event.owner not in state.running_owners | state.starting_owners:
        raise _stale(state, event, f"{event.owner} was not running")
    new = replace(
        _release(state, event.owner),
        running_owners=state.running_owners - {event.owner},
        starting_owners=state.starting_owners - {event.owner},
    )
    return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)


def _vm_stopped(state: State, event: VmStopped, ctx: _Ctx) -> _Outcome:
    """A VM that held part of GPUs' IOMMU groups stopped: they are free, and the usual
    relend or regrow takes them after `relend_delay`, as after a game's stop."""
    if event.vm not in state.held.values():
        raise _stale(state, event, f"{event.vm} holds no IOMMU group of the lendee's GPUs")
    return _schedule_relend(_release(state, event.vm), ctx, event.at + ctx.policy.relend_delay)


def _release(state: State, vm: str) -> State:
    """The groups `vm` held free, and in OFF the reason they gave gone: lending goes on."""
    if vm not in state.held.values():
        return state
    held = {gpu: by for gpu, by in state.held.items() if by != vm}
    return replace(state, held=held, reason=None if state.phase is Phase.OFF else state.reason)


def _groups_taken(state: State, event: GroupsTaken, ctx: _Ctx) -> _Outcome:
    """Another VM started: those GPUs are not free while it runs, so no regrow is made
    for them (the bookkeeping cancels one due; one under way gives up at `_drained`)."""
    taken = {gpu: vm for gpu, vm in event.held.items() if gpu not in state.lent}
    return replace(state, held={**state.held, **taken}), []


def _groups_held(state: State, event: GroupsHeld, ctx: _Ctx) -> _Outcome:
    """OFF starting, or LENT attaching: the lendee got none of the GPUs, as another VM
    holds part of the IOMMU group of some (``held``). They are not free until it stops,
    as if a game ran with them, and no restart would get them: the start is made again
    at once with what is free (if enough: else OFF, with the reason), and a hot-add
    leaves the lendee LENT, the rest attached by the regrow that follows, not a restart."""
    held = {**state.held, **event.held}
    if event.ticket is not None:
        _check_ticket(state, event)
        if event.gpus != state.attaching:
            raise _stale(state, event, "not the GPUs being attached")
        new = _enter(state, Phase.LENT, lent=state.lent - state.attaching, held=held)
        return _schedule_relend(new, ctx, event.at)
    if state.phase is not Phase.OFF or not state.lendee_starting or event.gpus != state.lent:
        raise _stale(state, event, f"no start of {ctx.topo.lendee} with those GPUs is in flight")
    new = replace(state, lendee_starting=False, lent=frozenset(), reclaiming=False, held=held,
                  reason=None)
    if len(free_gpus(new, ctx.topo, ctx.policy)) < ctx.policy.min_gpus:
        new = replace(new, reason=f"{event.reason}; {ctx.topo.lendee} is not started until then")
    starts = _start_waiting(new, ctx.topo)
    new, relend = _schedule_relend(new, ctx, event.at)
    return new, starts + relend


def _owner_starting(state: State, event: OwnerStarting, ctx: _Ctx) -> _Outcome:
    """The hook let an owner through: until it runs (`OwnerStarted`) or its start ends
    without it (`OwnerStopped` on libvirt's release), it claims its GPUs, and no lendee
    start may race it (the bookkeeping cancels a relend due meanwhile)."""
    _check_owner(state, event, event.owner, ctx)
    if event.owner in state.running_owners | state.starting_owners:
        raise _stale(state, event, f"{event.owner} is already running or starting")
    return replace(state, starting_owners=state.starting_owners | {event.owner}), []


def _cancel_intent(state: State, event: CancelIntent, ctx: _Ctx) -> _Outcome:
    """Someone withdrew an owner's pending start: its requests fail with who did it.

    A reclaim under way for it is finished (a cordoned, half-drained node is the worst
    of both worlds); the lendee is lent again once it has stopped.
    """
    _check_owner(state, event, event.owner, ctx)
    mine = state.intents_of(event.owner)
    if not mine:
        raise _stale(state, event, f"{event.owner} has no pending start")
    new = replace(state, intents=tuple(i for i in state.intents if i.owner != event.owner))
    failed: list[Action] = [
        FailIntent(intent_id=i.id, owner=i.owner, reason=f"cancelled by {event.by}") for i in mine
    ]
    new, more = _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
    return new, failed + more


def _gpu_pods(state: State, event: GpuPods, ctx: _Ctx) -> _Outcome:
    """The cluster says how many pods on the node request a GPU. A regrow that waits for
    the node to be idle of GPU work begins when that count reaches zero."""
    new = replace(state, gpu_pods=event.count)
    if new.regrow_waiting and event.count == 0 and _regrow_wanted(new, ctx):
        return _reclaim(replace(new, regrow_waiting=False), regrow=True)
    return new, []


def _start_failed(state: State, event: StartFailed, ctx: _Ctx) -> _Outcome:
    """A start the machine asked for failed (the executor already retried).

    The lendee: back to plain OFF with the reason, and every owner that waited for the
    start to end is started. No relend is scheduled: the start would most likely fail
    the same way; lending is retried when an owner stops, on ``resume`` or at the next
    agent start.

    An owner: its intents fail with the reason, except when it shares a GPU with a
    lendee that is running now. Then the lendee being in the way explains the failure
    (it was started by hand while the owner's start was in flight) and the intents stay:
    the reclaim under way, or the next retry, starts the owner when the lendee stops.
    """
    if event.vm == ctx.topo.lendee:
        if state.phase is not Phase.OFF or not state.lendee_starting:
            raise _stale(state, event, f"no start of {event.vm} is in flight")
        new = replace(
            state,
            lendee_starting=False,
            lent=frozenset(),
            reclaiming=False,
            reason=(
                f"{event.vm} failed to start: {event.reason}; lending resumes when an "
                "owner stops or on `hostagent resume`"
            ),
        )
        return new, _start_waiting(new, ctx.topo)
    _check_owner(state, event, event.vm, ctx)
    mine = state.intents_of(event.vm)
    if not mine:
        raise _stale(state, event, f"no start of {event.vm} was requested")
    if ctx.topo.claims(event.vm) & state.lent and state.phase.lendee_running:
        return state, []
    new = replace(
        state,
        intents=tuple(i for i in state.intents if i.owner != event.vm),
        starting_owners=state.starting_owners - {event.vm},
    )
    actions: list[Action] = [
        FailIntent(
            intent_id=i.id, owner=i.owner, reason=f"{event.vm} failed to start: {event.reason}"
        )
        for i in mine
    ]
    new, more = _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
    return new, actions + more


def _hold(state: State, event: Hold, ctx: _Ctx) -> _Outcome:
    """Suspend lending. A lendee that is up stays up (holding is not reclaiming), and a
    reclaim still works: hold stops the *next* lend. Holding twice changes nothing."""
    return replace(state, hold=True), []


def _resume(state: State, event: Resume, ctx: _Ctx) -> _Outcome:
    """Resume lending, and retry.

    From OFF the lendee is started now, not after `relend_delay`: the operator asked.
    From FAILED the stuck step is retried from the top of its road (reclaim if someone
    wants the GPUs, else the return to the cluster). This is the operator's "try again".
    """
    new = replace(state, hold=False, reclaiming=False)
    if new.phase is Phase.FAILED:
        return _rebuild_running(new, ctx)
    return _schedule_relend(new, ctx, event.at)


def _reclaim_by_hand(state: State, event: Reclaim, ctx: _Ctx) -> _Outcome:
    """The operator takes the GPUs back with no owner asking: hold, then the reclaim road.

    Hold is what keeps the lendee off once it has stopped (no relend is scheduled while
    it is set), so a manual reclaim is a hold plus the same gentle road an owner's
    request takes: drain, wait for the guest agent, shut down. ``resume`` lends again.

    - Running in a lending phase (BOOTING, JOINING, LENT) or stuck (FAILED): reclaim.
    - DRAINING, STOPPING: a reclaim is already under way; holding is all that is left
      (a regrow's is made this one, see `_join_reclaim`).
    - OFF: hold, which cancels a scheduled relend. A lendee start already in flight
      cannot be recalled (nothing stops a start libvirt is running), so the reclaim is
      kept: it lands as `LendeeStarted` and is reclaimed at once, whether or not anyone
      still waits for the answer; a start that fails leaves nothing to reclaim.
    """
    if state.phase is Phase.OFF:
        return replace(state, hold=True, reclaiming=state.lendee_starting), []
    new = replace(state, hold=True, reclaiming=True)
    if state.phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT, Phase.FAILED):
        return _reclaim(new)
    return _join_reclaim(new)


def _observed(state: State, event: Observed, ctx: _Ctx) -> _Outcome:
    """Rebuild from a fresh read of libvirt, at agent start or after a reconnect.

    Only two things cannot be re-read and come from memory (the persisted state):
    intents and hold. Everything else is reality: which VMs run. In-flight actions
    (starts, waits, timers) are assumed lost, so whatever the new phase needs is
    issued again; every action is idempotent, so issuing one twice is harmless.

    - Intents whose owner runs are complete (it started while the agent was away);
      intents for a VM the configuration no longer names as an owner fail.
    - Lendee running: reclaim if anyone wants its GPUs (`Drain` of a drained node is
      quick), else go through BOOTING again (`WaitAgent`, then `KubeReturn`, which
      verifies the GPUs and uncordons only what we cordoned). Owners that need no lendee
      GPU and still wait are started again.
    - Lendee off: start every waiting owner; if nobody wants the GPUs and lending is not
      on hold, relend at once, or when an earlier relend was due if that is later (the
      owner's reboot grace still applies).
    """
    unknown = sorted(o for o in event.owners_running if not ctx.topo.is_owner(o))
    if unknown:
        raise _stale(state, event, f"{', '.join(unknown)} is not an owner VM in the topology")
    actions: list[Action] = []
    kept: list[Intent] = []
    for intent in state.intents:
        if not ctx.topo.is_owner(intent.owner):
            actions.append(
                FailIntent(
                    intent_id=intent.id,
                    owner=intent.owner,
                    reason=f"{intent.owner} is no longer an owner VM in the configuration",
                )
            )
        elif intent.owner in event.owners_running:
            actions.append(CompleteIntent(intent_id=intent.id, owner=intent.owner))
        else:
            kept.append(intent)
    new = replace(
        state,
        running_owners=event.owners_running,
        starting_owners=frozenset(),
        intents=tuple(kept),
        lendee_starting=False,
        regrow_waiting=False,
        held={},  # learnt again by the next start or hot-add: a stop may have been missed
    )
    if event.lendee_running:
        # Same instance or not, nobody knows: its agent must answer again.
        lent = ctx.topo.lendee_gpus if event.lendee_gpus is None else event.lendee_gpus
        # With hotplug, a live change may have been under way: the plugins re-enumerate.
        replug = ctx.policy.hotplug is not Hotplug.NONE
        new, more = _rebuild_running(replace(new, agent_up=False, lent=lent, replug=replug), ctx)
        # Owners whose GPUs it does not hold were started when they asked; that start
        # may have been lost with the previous agent.
        others = [
            StartOwner(owner=o)
            for o in new.waiting_owners
            if not ctx.topo.claims(o) & new.lent
        ]
        return new, actions + more + others
    new = _enter(
        new,
        Phase.OFF,
        agent_up=False,
        lent=frozenset(),
        reclaiming=False,
        reason=new.reason if new.phase is Phase.OFF else None,
    )
    actions += _start_waiting(new, ctx.topo, all_owners=True)
    if not _relend_allowed(new, ctx):
        return new, actions  # an armed timer is cancelled by the bookkeeping in step()
    # Armed again even if it was: the timer may have died with the previous agent.
    due = event.at if new.relend_at is None else max(event.at, new.relend_at)
    return replace(new, relend_at=due), [*actions, ScheduleRelend(at=due)]


# --- rules for the lendee, phase by phase ----------------------------------------------


def _lendee_started(state: State, event: LendeeStarted, ctx: _Ctx) -> _Outcome:
    """OFF → the lendee runs (our `StartLendee`, or by hand).

    Usually BOOTING: wait for the agent. But if an owner asked while the start was in
    flight, the lendee now holds that owner's GPUs: reclaim at once (the drain is
    cheap on a node that just booted cordoned; the shutdown still waits for the agent).
    An owner needing its GPUs that *runs* cannot coexist with it (QEMU refuses a device
    in use, and the hook defers the start); if reality shows it anyway, the topology is
    wrong, and the lendee is reclaimed the same gentle way rather than lent.
    """
    lent = state.lent if state.lendee_starting else ctx.topo.lendee_gpus
    new = replace(state, lendee_starting=False, reason=None, agent_up=False, lent=lent)
    return _rebuild_running(new, ctx)


def _relend_due(state: State, event: RelendDue, ctx: _Ctx) -> _Outcome:
    """OFF → the relend timer fired: start the lendee, and stay OFF until it runs.

    The start may fail (StartFailed), and until it succeeds the GPUs are not held, so
    the phase says OFF; `lendee_starting` makes owners wait instead of racing it.

    A timer that was cancelled is stale. Nothing else is checked, on purpose:
    - not the conditions: the bookkeeping after every step cancels a relend the moment
      it stops being allowed, so an armed timer means lending is allowed;
    - not ``at`` against ``relend_at``: the executor keeps one timer and replaces it on
      every `ScheduleRelend`, so the one that fires is the current one; and timers run on
      a monotonic clock while events are stamped with wall time, which may lag it by a
      few milliseconds. Refusing an "early" timer would lose the relend for good.
    """
    if state.relend_at is None:
        raise _stale(state, event, "no relend is scheduled")
    gpus = free_gpus(state, ctx.topo, ctx.policy)
    new = replace(state, relend_at=None, lendee_starting=True, lent=gpus)
    return new, [StartLendee(gpus=gpus)]


def _regrow_due(state: State, event: RelendDue, ctx: _Ctx) -> _Outcome:
    """LENT → the relend timer fired while the lendee runs short of GPUs that are free
    now: restart it to take them all, the reclaim's gentle road (drain, agent
    shutdown) and a start with the larger set.

    ``when-idle`` waits, running, while pods on the node request a GPU (a restart would
    kill their work), and begins when `GpuPods` says none is left; ``always`` does not.
    A bounded wait (``regrow_max_wait``) arms the timer once more for its end: the timer
    firing while the regrow waits is that end, and the restart begins, pods or not (the
    timer cannot be armed twice, so nothing else fires it meanwhile). The bookkeeping
    has already cancelled a timer that stopped being wanted. With ``hotplug`` the GPUs
    are attached live instead (`_attach`), at once: that stops no pod.
    """
    if state.relend_at is None:
        raise _stale(state, event, "no regrow is scheduled")
    if _hot_add(state, ctx):
        return _attach(state, ctx)
    new = replace(state, relend_at=None)
    limit = ctx.policy.regrow_max_wait
    waited_enough = state.regrow_waiting and limit is not None
    if ctx.policy.regrow is Regrow.ALWAYS or state.gpu_pods == 0 or waited_enough:
        return _reclaim(replace(new, regrow_waiting=False), regrow=True)
    if limit is None:
        return replace(new, regrow_waiting=True), []
    if limit <= 0:
        return _reclaim(new, regrow=True)
    due = event.at + limit
    return replace(new, regrow_waiting=True, relend_at=due), [ScheduleRelend(at=due)]


def _attach(state: State, ctx: _Ctx) -> _Outcome:
    """LENT → LENT with the free GPUs being attached live: no drain, no restart, so no
    pod is stopped and nothing waits for the node to be idle.

    The GPUs count as the lendee's from the first call on (``lent``): libvirt may have
    attached some of their functions whatever happens next, so an owner asking for one
    meanwhile takes the reclaim's road, like for any GPU the lendee holds. LENT is
    entered anew: its watch of the node ends (the device plugin restarts to advertise
    them, which is no GPU lost) and begins again with the node's new count at the end.
    """
    gain = free_gpus(state, ctx.topo, ctx.policy) - state.lent
    new = _enter(state, Phase.LENT, relend_at=None, regrow_waiting=False, attaching=gain,
                 lent=state.lent | gain)
    return new, [AttachGpus(ticket=new.ticket, gpus=gain)]


def _gpus_attached(state: State, event: GpusAttached, ctx: _Ctx) -> _Outcome:
    """LENT, attaching → LENT: the GPUs are in the guest and the node advertises them;
    they are lent. A game that ended meanwhile is a regrow due after `relend_delay`."""
    _check_ticket(state, event)
    if event.gpus != state.attaching:
        raise _stale(state, event, "not the GPUs being attached")
    new = _enter(state, Phase.LENT)
    return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)


def _attach_failed(state: State, event: AttachFailed, ctx: _Ctx) -> _Outcome:
    """LENT, attaching → LENT without the GPUs the lendee did not get: a step failed
    within its bound (the executor journaled why). Those its live definition holds stay
    its own (only its stop frees them); the others wait for a regrow by restart, as the
    policy says, and no hot-add is tried again until the lendee restarts."""
    _check_ticket(state, event)
    if event.gpus != state.attaching:
        raise _stale(state, event, "not the GPUs being attached")
    lent = state.lent - (state.attaching - event.held)
    new = _enter(state, Phase.LENT, lent=lent, hotadd_failed=True)
    return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)


def _gpus_detached(state: State, event: GpusDetached, ctx: _Ctx) -> _Outcome:
    """LENT, detaching → JOINING without them: the owners that waited for them start
    now, and the node, cordoned for the evictions, is returned the usual way (its GPU
    plugins restarted first, to advertise the rest), verified before its uncordon."""
    _check_ticket(state, event)
    if event.gpus != state.detaching:
        raise _stale(state, event, "not the GPUs being detached")
    new = _enter(state, Phase.JOINING, lent=state.lent - state.detaching, replug=True)
    starts: list[Action] = [StartOwner(owner=o) for o in new.waiting_owners
                            if ctx.topo.claims(o) & state.detaching]
    return new, [*starts, KubeReturn(ticket=new.ticket, restart_plugins=new.replug)]


def _detach_failed(state: State, event: DetachFailed, ctx: _Ctx) -> _Outcome:
    """LENT, detaching → DRAINING: a step failed, something was in doubt or the bound
    ran out (the executor journaled which). The reclaim by restart frees the GPUs for
    sure, whatever the guest did with them (they stay in ``lent`` until it stops), and
    no hot-unplug is tried again until the lendee restarts. Nothing is lost: the
    intents wait as for any reclaim, and the node is cordoned already."""
    _check_ticket(state, event)
    if event.gpus != state.detaching:
        raise _stale(state, event, "not the GPUs being detached")
    return _reclaim(replace(state, unplug_failed=True, unplug_stuck=event.stuck))


def _agent_up_booting(state: State, event: AgentUp, ctx: _Ctx) -> _Outcome:
    """BOOTING → JOINING: the guest answers; now the node must rejoin, whole.

    Intents cannot be pending here (an owner asking during BOOTING starts a reclaim),
    so the only road is the return: wait Ready and the GPUs, then uncordon.
    """
    _check_ticket(state, event)
    new = _enter(state, Phase.JOINING, agent_up=True)
    return new, [KubeReturn(ticket=new.ticket, restart_plugins=new.replug)]


def _agent_timeout_booting(state: State, event: AgentTimeout, ctx: _Ctx) -> _Outcome:
    """BOOTING → FAILED: the lendee runs but its agent never answered.

    It is not lent (nothing proves it booted) and it is not stopped (there is no clean
    way without the agent, and the node holds no work). A reclaim still works: the
    shutdown road waits for the agent again, and may find it up by then.
    """
    _check_ticket(state, event)
    return _enter(
        state,
        Phase.FAILED,
        reason=(
            f"{ctx.topo.lendee}'s guest agent did not answer guest-ping after it started; it "
            "keeps running but is not lent (is qemu-guest-agent running in the guest?)"
        ),
    ), []


def _returned(state: State, event: ReturnDone, ctx: _Ctx) -> _Outcome:
    """JOINING → LENT: Ready, every GPU counted, uncordoned. If a game ended meanwhile,
    a regrow is due after `relend_delay`. The GPU pods are unknown until this lend's
    watch reports them: a count from an earlier lend says nothing about this one."""
    _check_ticket(state, event)
    new = _enter(state, Phase.LENT, gpu_pods=None)
    return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)


def _return_failed(state: State, event: ReturnFailed, ctx: _Ctx) -> _Outcome:
    """JOINING → FAILED: Ready is not enough. A node that came back short of GPUs stays
    cordoned and says so; it keeps running, and a reclaim still works."""
    _check_ticket(state, event)
    return _enter(
        state,
        Phase.FAILED,
        reason=(
            f"{ctx.topo.lendee} did not come back whole: {event.reason}; the node stays "
            "cordoned (`hostagent resume` retries)"
        ),
    ), []


def _drained(state: State, event: Drained, ctx: _Ctx) -> _Outcome:
    """DRAINING → STOPPING: the node is empty; now wait for the guest agent.

    Always a fresh `WaitAgent`, even if the agent answered at boot: it may have been
    restarted inside the guest since, and a shutdown it cannot receive is the bug this
    project exists to avoid. If it answers at once, this costs one round trip.

    The reclaim is finished even if the reason for it went away meanwhile (the owner
    that appeared by hand stopped again): a cordoned, half-drained node is the worst of
    both worlds, and the relend after the shutdown is automatic. A regrow is the
    exception: nobody waits for it, and one that would gain nothing now (the game
    started again) returns the lendee as it is rather than restart it with the same set.
    """
    _check_ticket(state, event)
    if _regrow_moot(state, ctx):
        return _back_to_lending(state)
    new = _enter(state, Phase.STOPPING)
    return new, [WaitAgent(ticket=new.ticket)]


def _drain_failed(state: State, event: DrainFailed, ctx: _Ctx) -> _Outcome:
    """DRAINING → back to lending (the policy chose "abort" on a drain that cannot finish).

    Under that policy the cluster's workloads come first: the reclaim is given up, and
    every request that waited for it fails with the reason, so whoever asked hears why
    at once rather than waiting on a drain that will not end. The lendee goes back to
    the cluster the usual way (its cordon lifted by `KubeReturn`, only if it was ours);
    through BOOTING first if its guest agent has not answered yet.
    """
    _check_ticket(state, event)
    why = f"{ctx.topo.lendee} could not be drained ({event.reason}), and the policy keeps it lent"

    def waits(i: Intent) -> bool:
        return bool(ctx.topo.claims(i.owner) & state.lent)

    failed: list[Action] = [
        FailIntent(intent_id=i.id, owner=i.owner, reason=why) for i in state.intents if waits(i)
    ]
    kept = tuple(i for i in state.intents if not waits(i))
    new, more = _back_to_lending(replace(state, intents=kept))
    return new, failed + more


def _agent_up_stopping(state: State, event: AgentUp, ctx: _Ctx) -> _Outcome:
    """STOPPING: the agent answered, so now, and only now, the shutdown is sent; unless
    this is a regrow that would gain nothing any more (see `_drained`), the last moment
    to give it up."""
    _check_ticket(state, event)
    if state.shutdown_sent:
        raise _stale(state, event, "the shutdown was already sent")
    if _regrow_moot(state, ctx):
        return _back_to_lending(replace(state, agent_up=True))
    new = replace(state, agent_up=True, shutdown_sent=True)
    return new, [ShutdownLendee(ticket=new.ticket)]


def _agent_timeout_stopping(state: State, event: AgentTimeout, ctx: _Ctx) -> _Outcome:
    """STOPPING: the agent never answered, so a clean shutdown is impossible.

    With force_off set the operator accepted the risk: destroy. Without it the machine
    will not: FAILED, the lendee keeps running, the intents keep waiting, and the
    reason tells a human how to unblock them (any stop of the lendee starts them).
    """
    _check_ticket(state, event)
    if state.shutdown_sent:
        raise _stale(state, event, "the agent already answered")
    return _give_up_stopping(state, ctx, "its guest agent never answered guest-ping")


def _shutdown_timeout(state: State, event: ShutdownTimeout, ctx: _Ctx) -> _Outcome:
    """STOPPING: the guest accepted the shutdown but did not stop. As above."""
    _check_ticket(state, event)
    if not state.shutdown_sent:
        raise _stale(state, event, "no shutdown was sent")
    return _give_up_stopping(state, ctx, "it did not stop after a guest-agent shutdown")


def _give_up_stopping(state: State, ctx: _Ctx, what: str) -> _Outcome:
    # Never destroyed by default (I3), a guest stuck letting a GPU go included.
    if ctx.policy.force_off:
        return state, [ForceOff(ticket=state.ticket)]
    lendee = ctx.topo.lendee
    stuck = " (it did not let a GPU go when asked)" if state.unplug_stuck else ""
    return _enter(
        state,
        Phase.FAILED,
        reason=(f"{lendee} cannot be shut down cleanly: {what}{stuck}; hostagent never destroys "
                f"it unless force_off_after is set: stop it by hand (virsh shutdown {lendee}) "
                "and the waiting VMs start"),
    ), []


def _lendee_stopped(state: State, event: LendeeStopped, ctx: _Ctx) -> _Outcome:
    """Any running phase → OFF, whatever stopped it: our shutdown, a destroy, a crash,
    a human. The GPUs are free: start every owner that waited for them. If nobody did,
    lend again what is free after `relend_delay` (a crashed lendee comes back; an owner
    that stopped during a reclaim may be rebooting)."""
    new = _enter(
        state, Phase.OFF, agent_up=False, reason=None, lent=frozenset(), reclaiming=False,
        regrow_waiting=False, hotadd_failed=False, unplug_failed=False, unplug_stuck=False,
    )
    starts = _start_waiting(new, ctx.topo)
    new, relend = _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
    return new, starts + relend


# --- the table -------------------------------------------------------------------------

_E = TypeVar("_E", bound=Event)
_Rule = Callable[[State, Any, _Ctx], _Outcome]


def _on(
    event_type: type[_E], rule: Callable[[State, _E, _Ctx], _Outcome]
) -> tuple[type[Event], _Rule]:
    """One table entry; the type checker makes sure the rule takes that event."""
    return event_type, rule


# Meaningful whatever the lendee is doing: VMs are started and stopped by people, the
# operator holds, resumes and reclaims, and the agent re-reads the world after a restart.
# The rules themselves refuse the combinations that are stale.
_EVERY_PHASE = dict(
    [
        _on(OwnerWants, _owner_wants),
        _on(OwnerStarted, _owner_started),
        _on(OwnerStopped, _owner_stopped),
        _on(OwnerStarting, _owner_starting),
        _on(CancelIntent, _cancel_intent),
        _on(GpuPods, _gpu_pods),
        _on(StartFailed, _start_failed),  # the lendee's only in OFF with a start in flight
        _on(Hold, _hold),
        _on(Resume, _resume),
        _on(Reclaim, _reclaim_by_hand),
        _on(Reserve, _reserve),
        _on(Observed, _observed),
        _on(VmStopped, _vm_stopped),
        _on(GroupsTaken, _groups_taken),
    ]
)

# The lendee stops whenever it likes: every phase in which it runs accepts it.
_STOPS = dict([_on(LendeeStopped, _lendee_stopped)])

_BY_PHASE: dict[Phase, dict[type[Event], _Rule]] = {
    # Off: it can only start, by the relend timer or by hand.
    Phase.OFF: dict([_on(RelendDue, _relend_due), _on(LendeeStarted, _lendee_started),
                     _on(GroupsHeld, _groups_held)]),
    # Booting: only its agent's answer (or silence) moves it on.
    Phase.BOOTING: dict([_on(AgentUp, _agent_up_booting),
                         _on(AgentTimeout, _agent_timeout_booting), *_STOPS.items()]),
    # Joining: the cluster's verdict on the node.
    Phase.JOINING: dict([_on(ReturnDone, _returned), _on(ReturnFailed, _return_failed),
                         *_STOPS.items()]),
    # Lent: steady state; an owner (above), a regrow or a stop moves it.
    Phase.LENT: dict([_on(RelendDue, _regrow_due), _on(GpusAttached, _gpus_attached),
                      _on(AttachFailed, _attach_failed), _on(GpusDetached, _gpus_detached),
                      _on(DetachFailed, _detach_failed), _on(GroupsHeld, _groups_held),
                      *_STOPS.items()]),
    # Draining: the drain's verdict. Reports of the boot road are stale here.
    Phase.DRAINING: dict([_on(Drained, _drained), _on(DrainFailed, _drain_failed),
                          *_STOPS.items()]),
    # Stopping: the agent's answer, then the shutdown's outcome.
    Phase.STOPPING: dict([_on(AgentUp, _agent_up_stopping),
                          _on(AgentTimeout, _agent_timeout_stopping),
                          _on(ShutdownTimeout, _shutdown_timeout), *_STOPS.items()]),
    # Failed: waits for a human, a retry (owner asking, resume), or a stop.
    Phase.FAILED: dict(_STOPS),
}

TRANSITIONS: Mapping[tuple[Phase, type[Event]], _Rule] = MappingProxyType(
    {
        (phase, event_type): rule
        for phase in Phase
        for event_type, rule in (_EVERY_PHASE | _BY_PHASE[phase]).items()
    }
)
"""(phase, event type) → the rule that handles it. Anything absent is illegal."""


# --- the entry points ------------------------------------------------------------------


def step(
    state: State, event: Event, *, topo: Topology, policy: Policy
) -> tuple[State, list[Action]]:
    """The next state and the actions that get there. Pure; raises IllegalTransition."""
    rule = TRANSITIONS.get((state.phase, type(event)))
    if rule is None:
        raise IllegalTransition(state.phase, event)
    ctx = _Ctx(topo=topo, policy=policy)
    new, actions = rule(state, event, ctx)
    regrow = _regrow_wanted(new, ctx)
    if new.relend_at is not None and not (_relend_allowed(new, ctx) or regrow):
        new = replace(new, relend_at=None)
        actions = [CancelRelend(), *actions]
    if new.regrow_waiting and not regrow:
        new = replace(new, regrow_waiting=False)
    return new, actions


def verdict(
    state: State, domain: str, *, topo: Topology, gpus: frozenset[str] | None = None,
    policy: Policy | None = None,
) -> tuple[Decision, str]:
    """The hook's answer to libvirt's ``prepare begin`` for `domain`, from memory.

    Pure and cheap: libvirtd waits on it with its locks held. "defer" and "refuse" come
    with one sentence for whoever ran ``virsh start``. On defer for an owner, the agent
    records the request (`OwnerWants`) and persists it before answering; on proceed,
    it records the claim (`OwnerStarting`); a refusal records nothing. This function
    only decides. The agent's own starts pass: its `StartOwner` once the lendee freed
    the GPUs, its `StartLendee` (a live definition with the free GPUs only).

    A start that is allowed here still races a relend that fires before libvirt reports
    the start; QEMU's lock on the device settles that race (one start fails, and the
    owner's hook then defers). `gpus`, for the lendee: the GPUs of the definition being
    started (read by the hook from libvirt's XML), which tells the agent's own start
    from one by hand. `policy`: to say whether the lendee gives the GPUs up live.
    """
    lendee = topo.lendee
    if domain == lendee:
        extra = sorted((gpus or frozenset()) - state.lent)
        if state.phase is Phase.OFF and state.lendee_starting and gpus is not None and extra:
            # Not the live definition the agent is starting: a start by hand, meanwhile.
            return "defer", (
                f"hostagent is starting {lendee} without {', '.join(extra)} right now; "
                f"it lends {lendee} the rest by itself when they are free ({FOLLOW})"
            )
        if state.phase is not Phase.OFF or state.lendee_starting:
            return "proceed", f"{lendee} is started by hostagent (or already runs)"
        # By hand: its whole persistent definition, every GPU it may borrow.
        playing = sorted(o for o in state.running_owners if topo.needs_lendee_gpus(o))
        if playing:
            stop = "that VM stops" if len(playing) == 1 else "those VMs stop"
            return "defer", (
                f"{lendee}'s GPUs are in use by {', '.join(playing)}; hostagent lends it "
                f"what is free by itself, and the rest when {stop} ({FOLLOW})"
            )
        waiting = _pending_claimants(state, topo)
        if waiting:
            return "defer", (
                f"{lendee}'s GPUs are being handed to {', '.join(waiting)}; hostagent lends "
                f"them again by itself when that is over ({FOLLOW})"
            )
        return "proceed", f"no owner VM needs {lendee}'s GPUs"
    if not topo.is_owner(domain):
        return "proceed", f"{domain} is not managed by hostagent"
    if domain in state.running_owners:
        return "proceed", f"{domain} is already running"
    rival = conflict(state, domain, topo)
    if rival is not None:
        return "refuse", f"{rival} ({FOLLOW})"
    if not topo.needs_lendee_gpus(domain):
        return "proceed", f"{domain} shares no GPU with {lendee}"
    held = ", ".join(sorted(topo.claims(domain) & state.lent))
    if not held:
        if state.phase is Phase.OFF and not state.lendee_starting:
            return "proceed", f"{lendee} is off"
        return "proceed", f"{lendee} runs without {', '.join(sorted(topo.shared_gpus(domain)))}"
    later = f"{domain} will start by itself"
    match state.phase:
        case Phase.OFF:
            what = (
                f"{lendee} is starting and would take {held}; hostagent frees them first "
                f"(shutting {lendee} down cleanly if it got them), and {later} then"
            )
        case Phase.LENT if (topo.claims(domain) & state.lent <= state.detaching or (
                policy is not None and _unplug(state, domain, _Ctx(topo, policy)))):
            what = (
                f"hostagent is taking {held} from {lendee} while it runs (or, failing "
                f"that, shutting it down), and {later} then"
            )
        case Phase.BOOTING | Phase.JOINING | Phase.LENT:
            what = (
                f"{lendee} holds {held}; hostagent is draining it and shutting it "
                f"down to free them, and {later} then"
            )
        case Phase.DRAINING:
            what = (
                f"hostagent is draining {lendee} to free {held}; {later} once "
                f"{lendee} has shut down"
            )
        case Phase.STOPPING:
            what = f"{lendee} is shutting down to free {held}; {later} when it has stopped"
        case Phase.FAILED:
            what = (
                f"{lendee} holds {held} and is stuck (`hostagent status` says why); "
                f"hostagent retries now, and {later} once {lendee} stops"
            )
    return "defer", f"{what} ({FOLLOW})"
