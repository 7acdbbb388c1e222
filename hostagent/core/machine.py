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
Another owner asking while that detach or the return after it is under way is queued
as another live detach, not a restart (`hostagent.core.live`).

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
   ``policy.force_off``; otherwise the machine stops in FAILED and says so. The one
   exception is a guest whose driver hung letting a GPU go, its node drained: it cannot
   shut down, and the game would wait for nothing (`_give_up_stopping`).
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
The rules are split by concern: this module holds the lendee's phases, the table and
the entry points; `hostagent.core.owners` the rules that mean the same in every phase,
`hostagent.core.live` hot-add and hot-unplug, `hostagent.core.rules` the questions and
roads they share. `TRANSITIONS`, near the end, is the whole machine: for each phase,
which event types it accepts and which rule handles them. A few events mean the same in
every phase (an owner asking, starting or stopping; hold, resume and a reclaim by hand;
a fresh observation; a failed start) and share one rule each. Every rule is a small
function, and its docstring says why the rule is what it is.

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
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from hostagent.core.model import (
    Action,
    AgentTimeout,
    AgentUp,
    AttachFailed,
    CancelIntent,
    CancelRelend,
    DetachFailed,
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
    State,
    Topology,
    VmStopped,
    WaitAgent,
    free_gpus,
    holders,
    still_wanted,
)
from hostagent.core.live import (
    _attach,
    _attach_failed,
    _detach_failed,
    _gpus_attached,
    _gpus_detached,
    _live_take,
)
from hostagent.core.owners import (
    _cancel_intent,
    _gpu_pods,
    _groups_held,
    _groups_taken,
    _hold,
    _observed,
    _owner_started,
    _owner_starting,
    _owner_stopped,
    _owner_wants,
    _reclaim_by_hand,
    _reserve,
    _resume,
    _start_failed,
    _vm_stopped,
)
from hostagent.core.rules import (
    IllegalTransition,
    _back_to_lending,
    _check_ticket,
    _Ctx,
    _enter,
    _hot_add,
    _Outcome,
    _pending_claimants,
    _rebuild_running,
    _reclaim,
    _regrow_moot,
    _regrow_wanted,
    _relend_allowed,
    _schedule_relend,
    _stale,
    _start_waiting,
    conflict,
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

    With force_off set the operator accepted the risk: destroy; a guest stuck letting a
    GPU go is powered off too (`_give_up_stopping`). Otherwise the machine will not:
    FAILED, the lendee keeps running, the intents keep waiting, and the
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
    """STOPPING, no clean shutdown: FAILED with the reason, or a power-off.

    Never destroyed by default (I3), with one exception: a guest whose driver hung
    letting a GPU go (``unplug_stuck``). The reasons for I3 do not hold there. Its node
    is drained, so nothing on it is lost that the shutdown would have kept; its card is
    not mid-initialisation but mid-removal, and the host resets it when QEMU lets it go
    (`hostagent lint` checks that each lent GPU can be reset); and its shutdown hangs
    behind the unbind, so a human could only destroy it too, later, while the player
    waits. The game then starts within the bound the timeouts set: the unplug's, what
    is left of the drain's, and the shutdown's (or the guest agent's)."""
    lendee = ctx.topo.lendee
    if state.unplug_stuck:
        waiting = [o for o in state.waiting_owners if ctx.topo.claims(o) & state.lent]
        stuck = (f"{lendee} did not shut down" if state.shutdown_sent
                 else f"{lendee}'s guest agent no longer answers")
        for_whom = (f"so that {' and '.join(waiting)} can start" if waiting
                    else "so that its GPUs are free")
        return state, [ForceOff(ticket=state.ticket, reason=(
            f"{stuck} after its driver hung letting a GPU go; powering it off now that "
            f"its node is drained, {for_whom}"))]
    if ctx.policy.force_off:
        return state, [ForceOff(ticket=state.ticket)]
    return _enter(
        state,
        Phase.FAILED,
        reason=(f"{lendee} cannot be shut down cleanly: {what}; hostagent never destroys "
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
        case Phase.LENT | Phase.JOINING if (topo.claims(domain) & state.lent <= state.detaching
                                            or (policy is not None and _live_take(
                                                state, _Ctx(topo, policy), domain))):
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
