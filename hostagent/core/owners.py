"""The rules that mean the same whatever the lendee is doing: owners asking, starting and
stopping, reservations, hold, resume and a reclaim by hand, a fresh read of the world,
a failed start. Part of `hostagent.core.machine` (pure, as it is), whose table names
them for every phase; each rule refuses, itself, the combinations that are stale.
"""

from __future__ import annotations

from dataclasses import replace

from hostagent.core.model import (
    Action,
    CancelIntent,
    CompleteIntent,
    FailIntent,
    GpuPods,
    GroupsHeld,
    GroupsTaken,
    Hold,
    Hotplug,
    Intent,
    Observed,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    OwnerWants,
    Phase,
    Reclaim,
    Reserve,
    Resume,
    ScheduleRelend,
    StartFailed,
    StartOwner,
    State,
    VmStopped,
    free_gpus,
)
from hostagent.core.live import _detach
from hostagent.core.rules import (
    _check_owner,
    _check_ticket,
    _Ctx,
    _enter,
    _join_reclaim,
    _Outcome,
    _rebuild_running,
    _reclaim,
    _regrow_wanted,
    _relend_allowed,
    _schedule_relend,
    _stale,
    _start_waiting,
    conflict,
)


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
    - Unless it can give them up live (`hostagent.core.live`): LENT is entered anew with
      them being detached (still ``lent`` until libvirt has removed them, so the owner
      waits). Another owner wanting another lent GPU while that detach or the node's
      return after it is under way is queued as another live detach, not a restart
      (two players a minute apart must not kill the jobs on the GPU neither wanted).
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
    return _detach(new, ctx)


def _reserve(state: State, event: Reserve, ctx: _Ctx) -> _Outcome:
    """The reservations changed (`hostagent.core.reserve`). The GPUs of one that holds are
    taken back as for an owner that waits, gently (the drain gives each pod its grace,
    or a hot-unplug, queued behind one under way), but nobody starts; one that ended
    (used, expired, cancelled) frees its GPUs for the next lend, or a regrow."""
    for r in event.reservations:
        _check_owner(state, event, r.vm, ctx)
    new = replace(state, reservations=event.reservations)
    way = [o for o in sorted(new.reserved) if ctx.topo.claims(o) & new.lent]
    if not way or state.phase is Phase.OFF:
        return _schedule_relend(new, ctx, event.at + ctx.policy.relend_delay)
    if state.phase in (Phase.DRAINING, Phase.STOPPING):
        return _join_reclaim(new)
    if state.phase is Phase.FAILED:
        return new, []
    return _detach(new, ctx)


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
      quick); back to LENT at once if the adapters found it in service as it was lent
      (`Observed.adopt`); else go through BOOTING again (`WaitAgent`, then
      `KubeReturn`, which verifies the GPUs and uncordons only what we cordoned).
      Owners that need no lendee GPU and still wait are started again.
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
        adopt = event.at if event.adopt and event.lendee_gpus is not None else None
        new, more = _rebuild_running(replace(new, agent_up=False, lent=lent, replug=replug), ctx,
                                     adopt_at=adopt)
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

