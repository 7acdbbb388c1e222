"""The lendee's GPUs changed while it runs (``policy.hotplug``): the rules of hot-add and
hot-unplug, part of `hostagent.core.machine` (pure, as it is).

A hot-add enters LENT anew with the GPUs ``attaching`` until `GpusAttached` or
`AttachFailed`. A hot-unplug enters LENT anew with the GPUs ``detaching`` until
`GpusDetached`, which starts the owners that waited for them and returns the node
through JOINING, or `DetachFailed`, which takes the reclaim's road (a restart).

Owners that ask while a hot-unplug or its return is under way (two players on a co-op
evening, a minute apart) are queued as another live detach rather than turned into a
restart: a restart kills every job on the node, those on GPUs no game wanted included.
The queue is not kept apart: it is every owner in the way (`_in_the_way`), read again
when the detach under way ends, so an owner that withdrew or whose reservation ended is
simply no longer in it. Only one detach runs at a time (one ticket, one phase entry, I10),
and an owner starts only once the lendee no longer lists its GPUs (I2).
"""

from __future__ import annotations

from dataclasses import replace

from hostagent.core.model import (
    Action,
    AttachFailed,
    AttachGpus,
    DetachFailed,
    DetachGpus,
    GpusAttached,
    GpusDetached,
    Hotplug,
    KubeReturn,
    Phase,
    StartOwner,
    State,
    free_gpus,
)
from hostagent.core.rules import (
    _check_ticket,
    _Ctx,
    _enter,
    _in_the_way,
    _Outcome,
    _reclaim,
    _schedule_relend,
    _stale,
)


def _live_take(state: State, ctx: _Ctx, also: str | None = None) -> frozenset[str] | None:
    """The GPUs to detach live for every owner in the way (and `also`, about to be), or
    None when the reclaim must restart the lendee instead.

    Live only where the policy says "both" with partial lending, no hot-unplug failed
    since the lendee started, and it keeps at least ``min_gpus`` (and one) without them
    all; and only while it is lent and steady (no hot-add or reclaim under way; a detach
    under way is fine: the rest follows it), or while its node returns from a live change
    (``replug``: JOINING after a detach, its other GPUs' jobs running on). A node
    returning from a boot has no job a restart would kill. Whole IOMMU groups:
    `Topology.claims` counts every GPU that shares one with an owner's."""
    way = [*_in_the_way(state, ctx.topo), *([also] if also else [])]
    take = frozenset().union(*(ctx.topo.claims(o) for o in way)) & state.lent
    lent = (state.phase is Phase.LENT and not state.attaching and not state.reclaiming)
    returning = (state.phase is Phase.JOINING and state.replug and state.agent_up
                 and not state.reclaiming)
    if (ctx.policy.hotplug is not Hotplug.BOTH or not ctx.policy.partial
            or state.unplug_failed or not (lent or returning)
            or len(state.lent - take) < max(1, ctx.policy.min_gpus)):
        return None
    return take


def _detach(state: State, ctx: _Ctx) -> _Outcome:
    """Owners need GPUs the lendee holds: detach them live if it can (`_live_take`),
    queue them behind the detach under way, else reclaim by restart. Their GPUs stay in
    ``lent`` until libvirt has removed them, so the owners wait (I2)."""
    take = _live_take(state, ctx)
    if take is None:
        return _reclaim(state)
    if state.detaching:
        return state, []  # queued: taken when the detach under way ends
    new = _enter(state, Phase.LENT, detaching=take)
    return new, [DetachGpus(ticket=new.ticket, gpus=take)]


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
    plugins restarted first, to advertise the rest), verified before its uncordon.

    Unless owners asked for more of its GPUs meanwhile: their detach follows at once,
    the node still cordoned (LENT entered anew), and the return comes after the last."""
    _check_ticket(state, event)
    if event.gpus != state.detaching:
        raise _stale(state, event, "not the GPUs being detached")
    after = replace(state, phase=Phase.JOINING, lent=state.lent - state.detaching,
                    detaching=frozenset(), replug=True)
    starts: list[Action] = [StartOwner(owner=o) for o in after.waiting_owners
                            if ctx.topo.claims(o) & state.detaching
                            and not ctx.topo.claims(o) & after.lent]
    if _in_the_way(after, ctx.topo):
        new, more = _detach(after, ctx)
        return new, [*starts, *more]
    new = _enter(after, Phase.JOINING)
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

