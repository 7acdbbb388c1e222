"""What every rule of the lend/reclaim machine asks and does: the shared part of
`hostagent.core.machine`, split out so that each family of rules reads on its own.

Pure, as the machine is: no I/O, no clock. The questions (who is in the way, whether a
relend or a regrow is allowed) and the roads every rule may take (a reclaim, a boot, a
return to lending) live here; the rules themselves live in `hostagent.core.owners` (what
means the same in every phase), `hostagent.core.live` (hot-add and hot-unplug) and
`hostagent.core.machine` (the lendee's phases, the table, `step` and `verdict`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hostagent.core.model import (
    Action,
    AgentTimeout,
    AgentUp,
    AttachFailed,
    DetachFailed,
    Drain,
    Drained,
    DrainFailed,
    Event,
    GpusAttached,
    GpusDetached,
    GroupsHeld,
    Hotplug,
    KubeReturn,
    Phase,
    Policy,
    Regrow,
    ReturnDone,
    ReturnFailed,
    ScheduleRelend,
    ShutdownTimeout,
    StartOwner,
    State,
    Topology,
    WaitAgent,
    free_gpus,
)


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


def _rebuild_running(state: State, ctx: _Ctx, *, adopt_at: float | None = None) -> _Outcome:
    """Resume a running lendee from the top of whichever road it is on.

    Each road is idempotent from its first step: `Drain` of a drained node returns at
    once, `WaitAgent` of an answering agent too, and `KubeReturn` re-verifies what it
    finds. So starting over is always correct, and never destroys anything. A reclaim
    by hand is a road of its own: it goes on until the lendee is off. `adopt_at`: the
    lendee is in service as the last lend left it (`Observed.adopt`), so nothing of the
    lend is done again: no swap, no plugin restart, no "lent" going off and on.
    """
    if state.reclaiming or _in_the_way(state, ctx.topo):
        return _reclaim(state)
    if adopt_at is not None:
        new = _enter(state, Phase.LENT, agent_up=True, replug=False, gpu_pods=None, reason=None)
        return _schedule_relend(new, ctx, adopt_at + ctx.policy.relend_delay)
    return _boot(state)

