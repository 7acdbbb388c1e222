"""Partial lending, driven directly: the lendee runs with every GPU no game needs.

test_machine.py runs the machine all or nothing (``Policy(partial=False)``); this file
runs it as configured by default (partial, regrow when idle) and under the other
policies. Three layers: one table row per transition with GPU *subsets*, plus the
scenarios they add up to (a sharing owner reclaims and the lendee comes back with the
rest, regrow under each policy, a second owner of a card refused, cancelled starts, a
reread with a live subset or a reclaim by hand under way); the events of partial lending
(`OwnerStarting`, `CancelIntent`, `GpuPods`) in every phase; and a randomised world that
tracks the GPUs each VM really holds and checks, after every step, that no GPU has two
running holders and that the lendee's live set never meets what an owner holds, starts
with or waits for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hostagent.core.machine import (
    FOLLOW,
    IllegalTransition,
    conflict,
    free_gpus,
    holders,
    step,
    still_wanted,
    verdict,
)
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
    Hold,
    Hotplug,
    IntentSource,
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
    WaitAgent,
)
from tests.unit.partial_world import (
    A,
    B,
    C,
    Z,
    TOPO,
    OWNERS,
    ALL,
    POLICY,
    UNBOUNDED,
    ALWAYS,
    NEVER,
    MIN2,
    ALL_OR_NOTHING,
    gpus,
    vms,
    go,
    run,
    S,
    done,
    cancelled,
    G1,
    G2,
)
from tests.unit.machine_scaffold import (
    STATEFUL_EXAMPLES,
    AT,
    FAILED_WHY,
    LENDEE,
    T,
    intent,
    wants,
)



# --- one row per transition with subsets -----------------------------------------------


@dataclass(frozen=True)
class Row:
    """`event` in `state` under `policy` gives `phase` and `actions`; `fields` are what
    else of the new state the row is about."""

    name: str
    state: State
    event: Event
    phase: Phase
    actions: list[Action]
    policy: Policy = POLICY
    fields: dict[str, object] = field(default_factory=dict)


ROWS: list[Row] = [
    # OFF: what a lendee start takes
    Row("off/relend with gaming1 playing takes the rest",
        S(running_owners=vms("gaming1"), relend_at=AT), RelendDue(at=AT),
        Phase.OFF, [StartLendee(gpus=gpus(B, C))],
        fields={"lent": gpus(B, C), "lendee_starting": True, "relend_at": None}),
    Row("off/relend with gaming3 playing (a GPU of its own) takes all",
        S(running_owners=vms("gaming3"), relend_at=AT), RelendDue(at=AT),
        Phase.OFF, [StartLendee(gpus=ALL)], fields={"lent": ALL}),
    Row("off/relend with both games playing takes gpu-c alone",
        S(running_owners=vms("gaming1", "gaming2"), relend_at=AT), RelendDue(at=AT),
        Phase.OFF, [StartLendee(gpus=gpus(C))], fields={"lent": gpus(C)}),
    Row("off/gaming2 stops while gaming1 plays: relend after relend_delay",
        S(running_owners=vms("gaming1", "gaming2")), OwnerStopped(at=AT, owner="gaming2"),
        Phase.OFF, [ScheduleRelend(at=AT + 30)], fields={"relend_at": AT + 30}),
    Row("off/all or nothing: gaming2 stops while gaming1 plays: stays off",
        S(running_owners=vms("gaming1", "gaming2")), OwnerStopped(at=AT, owner="gaming2"),
        Phase.OFF, [], policy=ALL_OR_NOTHING, fields={"relend_at": None}),
    Row("off/gaming3 stops while both games play: gpu-c alone is worth lending (min_gpus 1)",
        S(running_owners=vms("gaming1", "gaming2", "gaming3")),
        OwnerStopped(at=AT, owner="gaming3"), Phase.OFF, [ScheduleRelend(at=AT + 30)]),
    Row("off/gaming3 stops while both games play: min_gpus 2 not met, stays off",
        S(running_owners=vms("gaming1", "gaming2", "gaming3")),
        OwnerStopped(at=AT, owner="gaming3"), Phase.OFF, [], policy=MIN2,
        fields={"relend_at": None}),
    Row("off/gaming2 stops while gaming1 plays: min_gpus 2 met by gpu-b and gpu-c",
        S(running_owners=vms("gaming1", "gaming2")), OwnerStopped(at=AT, owner="gaming2"),
        Phase.OFF, [ScheduleRelend(at=AT + 30)], policy=MIN2),
    Row("off/resume with min_gpus not met: stays off",
        S(running_owners=vms("gaming1", "gaming2"), hold=True), Resume(at=AT),
        Phase.OFF, [], policy=MIN2, fields={"hold": False, "relend_at": None}),
    # OFF: an owner on its way, then running
    Row("off/the waited-for owner runs: relend at once with the rest",
        S(intents=G1), OwnerStarted(at=AT, owner="gaming1"),
        Phase.OFF, [done("gaming1"), ScheduleRelend(at=AT)],
        fields={"relend_at": AT, "running_owners": vms("gaming1")}),
    Row("off/an owner let through runs: relend at once with the rest",
        S(starting_owners=vms("gaming1")), OwnerStarted(at=AT, owner="gaming1"),
        Phase.OFF, [ScheduleRelend(at=AT)], fields={"starting_owners": vms()}),
    Row("off/the first of two waiting owners runs: no relend while the other waits",
        S(intents=(*G1, *G2)), OwnerStarted(at=AT, owner="gaming1"),
        Phase.OFF, [done("gaming1")], fields={"relend_at": None}),
    Row("off/the last waiting owner runs: relend at once with what is left",
        S(running_owners=vms("gaming1"), intents=G2), OwnerStarted(at=AT, owner="gaming2"),
        Phase.OFF, [done("gaming2"), ScheduleRelend(at=AT)]),
    Row("off/the waited-for owner runs, min_gpus 2 met by none: stays off",
        S(running_owners=vms("gaming1"), intents=G2), OwnerStarted(at=AT, owner="gaming2"),
        Phase.OFF, [done("gaming2")], policy=MIN2),
    Row("off/OwnerStarting cancels an armed relend",
        S(relend_at=AT + 20), OwnerStarting(at=AT, owner="gaming1"),
        Phase.OFF, [CancelRelend()],
        fields={"relend_at": None, "starting_owners": vms("gaming1")}),
    Row("off/OwnerStarting of gaming3 (a GPU of its own) leaves the relend armed",
        S(relend_at=AT + 20), OwnerStarting(at=AT, owner="gaming3"),
        Phase.OFF, [], fields={"relend_at": AT + 20, "starting_owners": vms("gaming3")}),
    Row("off/the start let through failed (released): relend re-armed",
        S(starting_owners=vms("gaming1")), OwnerStopped(at=AT, owner="gaming1"),
        Phase.OFF, [ScheduleRelend(at=AT + 30)], fields={"starting_owners": vms()}),
    # OFF: a lendee start in flight with a subset
    Row("off/wants an owner whose GPU the starting lendee does not take: started at once",
        S(lendee_starting=True, lent=gpus(B, C)), wants("gaming1"),
        Phase.OFF, [StartOwner(owner="gaming1")]),
    Row("off/wants an owner whose GPU the starting lendee takes: waits",
        S(lendee_starting=True, lent=gpus(B, C)), wants("gaming2"),
        Phase.OFF, [], fields={"intents": (intent("gaming2", at=AT),)}),
    Row("off/our start with a subset lands: booting with it",
        S(lendee_starting=True, lent=gpus(B, C), running_owners=vms("gaming1")),
        LendeeStarted(at=AT), Phase.BOOTING, [WaitAgent(ticket=T + 1)],
        fields={"lent": gpus(B, C), "lendee_starting": False}),
    Row("off/a start by hand takes the whole definition",
        S(), LendeeStarted(at=AT), Phase.BOOTING, [WaitAgent(ticket=T + 1)],
        fields={"lent": ALL}),
    Row("off/our start with gpu-b lands after gaming2 asked: reclaim at once",
        S(lendee_starting=True, lent=gpus(B, C), intents=G2),
        LendeeStarted(at=AT), Phase.DRAINING, [Drain(ticket=T + 1)]),
    Row("off/our start with gpu-b and gpu-c fails: the waiting owner starts",
        S(lendee_starting=True, lent=gpus(B, C), intents=G2),
        StartFailed(at=AT, vm=LENDEE, reason="x"), Phase.OFF, [StartOwner(owner="gaming2")],
        fields={"lent": frozenset(), "lendee_starting": False}),
    Row("off/cancel while waiting for a lendee start: the start goes on",
        S(lendee_starting=True, intents=G1), CancelIntent(at=AT, owner="gaming1", by="alice"),
        Phase.OFF, [cancelled("gaming1")],
        fields={"intents": (), "lendee_starting": True, "lent": ALL}),
    Row("off/cancel a start nobody else waits for: relend after relend_delay",
        S(intents=G1), CancelIntent(at=AT, owner="gaming1", by="alice"),
        Phase.OFF, [cancelled("gaming1"), ScheduleRelend(at=AT + 30)]),
    Row("off/cancel one of two waiting owners: no relend while the other waits",
        S(intents=(*G1, *G2)), CancelIntent(at=AT, owner="gaming2", by="bob"),
        Phase.OFF, [cancelled("gaming2", "bob")], fields={"intents": G1}),
    # BOOTING, JOINING, LENT with a subset: an owner outside it starts at once
    *(
        Row(f"{phase}/wants an owner outside the live set: started at once",
            S(phase, lent=gpus(B, C)), wants("gaming1"), phase, [StartOwner(owner="gaming1")],
            fields={"lent": gpus(B, C), "intents": (intent("gaming1", at=AT),)})
        for phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT, Phase.FAILED)
    ),
    Row("lent/wants an owner outside the live set with a regrow armed: cancelled, started",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 10), wants("gaming1"),
        Phase.LENT, [CancelRelend(), StartOwner(owner="gaming1")]),
    Row("lent/a sharing owner asks: reclaim",
        S(Phase.LENT, lent=gpus(A, C), running_owners=vms("gaming2")), wants("gaming1"),
        Phase.DRAINING, [Drain(ticket=T + 1)], fields={"lent": gpus(A, C)}),
    Row("lent/gaming2 asks mid-game: reclaim (gpu-c will be left)",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")), wants("gaming2"),
        Phase.DRAINING, [Drain(ticket=T + 1)]),
    Row("lent/an owner outside the live set runs: nothing to do",
        S(Phase.LENT, lent=gpus(B, C), starting_owners=vms("gaming1")),
        OwnerStarted(at=AT, owner="gaming1"), Phase.LENT, []),
    Row("lent/the owner outside the live set stops: regrow armed (when-idle)",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
        OwnerStopped(at=AT, owner="gaming1"), Phase.LENT, [ScheduleRelend(at=AT + 30)],
        fields={"relend_at": AT + 30}),
    Row("lent/the owner outside the live set stops: regrow armed (always)",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
        OwnerStopped(at=AT, owner="gaming1"), Phase.LENT, [ScheduleRelend(at=AT + 30)],
        policy=ALWAYS),
    Row("lent/the owner outside the live set stops: no regrow (never)",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
        OwnerStopped(at=AT, owner="gaming1"), Phase.LENT, [], policy=NEVER,
        fields={"relend_at": None}),
    Row("lent/the game restarts within relend_delay: the regrow is cancelled",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 20), OwnerStarting(at=AT, owner="gaming1"),
        Phase.LENT, [CancelRelend()], fields={"relend_at": None}),
    Row("lent/the other owner of gpu-a starts within relend_delay: the regrow is cancelled",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 20),
        OwnerStarting(at=AT, owner="gaming-win"), Phase.LENT, [CancelRelend()]),
    Row("lent/regrow due (always): the reclaim road, GPU pods or not",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, gpu_pods=2), RelendDue(at=AT),
        Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)], policy=ALWAYS,
        fields={"relend_at": None, "regrowing": True}),
    Row("lent/regrow due (when-idle), no GPU pod: the reclaim road",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, gpu_pods=0), RelendDue(at=AT),
        Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)]),
    Row("lent/regrow due (when-idle, no limit), GPU pods running: waits for them",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, gpu_pods=2), RelendDue(at=AT),
        Phase.LENT, [], policy=UNBOUNDED, fields={"regrow_waiting": True, "relend_at": None}),
    Row("lent/regrow due (when-idle, no limit), GPU pods unknown: waits for the count",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT), RelendDue(at=AT),
        Phase.LENT, [], policy=UNBOUNDED, fields={"regrow_waiting": True}),
    Row("lent/the timer armed again while a regrow waits with no limit: still waiting",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, regrow_waiting=True, gpu_pods=1),
        RelendDue(at=AT), Phase.LENT, [], policy=UNBOUNDED,
        fields={"regrow_waiting": True, "relend_at": None}),
    Row("lent/regrow due (when-idle), GPU pods running: waits, its end armed",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, gpu_pods=2), RelendDue(at=AT),
        Phase.LENT, [ScheduleRelend(at=AT + 120)],
        fields={"regrow_waiting": True, "relend_at": AT + 120}),
    Row("lent/regrow due (when-idle), GPU pods unknown: waits for the count, its end armed",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT), RelendDue(at=AT),
        Phase.LENT, [ScheduleRelend(at=AT + 120)], fields={"regrow_waiting": True}),
    Row("lent/the wait ends with GPU pods running: the reclaim road",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, regrow_waiting=True, gpu_pods=2),
        RelendDue(at=AT), Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)],
        fields={"regrow_waiting": False, "relend_at": None}),
    Row("lent/the last GPU pod ends before the wait does: the reclaim road, its end disarmed",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 60, regrow_waiting=True, gpu_pods=1),
        GpuPods(at=AT, count=0), Phase.DRAINING, [CancelRelend(), Drain(ticket=T + 1, regrow=True)],
        fields={"regrow_waiting": False, "relend_at": None}),
    Row("lent/the game restarts during the wait: it stops waiting, its end disarmed",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 60, regrow_waiting=True, gpu_pods=1),
        OwnerStarting(at=AT, owner="gaming1"), Phase.LENT, [CancelRelend()],
        fields={"regrow_waiting": False, "relend_at": None}),
    Row("lent/regrow due with a wait of 0: the reclaim road, GPU pods or not",
        S(Phase.LENT, lent=gpus(B, C), relend_at=AT, gpu_pods=2), RelendDue(at=AT),
        Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)], policy=replace(POLICY, regrow_max_wait=0.0),
        fields={"regrow_waiting": False, "relend_at": None}),
    Row("lent/the last GPU pod ends while a regrow waits: the reclaim road",
        S(Phase.LENT, lent=gpus(B, C), regrow_waiting=True, gpu_pods=1), GpuPods(at=AT, count=0),
        Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)],
        fields={"regrow_waiting": False, "gpu_pods": 0}),
    Row("lent/GPU pods change while a regrow waits: still waiting",
        S(Phase.LENT, lent=gpus(B, C), regrow_waiting=True, gpu_pods=1), GpuPods(at=AT, count=3),
        Phase.LENT, [], fields={"regrow_waiting": True, "gpu_pods": 3}),
    Row("lent/the game restarts while a regrow waits: it stops waiting",
        S(Phase.LENT, lent=gpus(B, C), regrow_waiting=True, gpu_pods=1),
        OwnerStarting(at=AT, owner="gaming1"), Phase.LENT, [], fields={"regrow_waiting": False}),
    Row("lent/no GPU pod without a regrow waiting: nothing",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=1),
        GpuPods(at=AT, count=0), Phase.LENT, [], fields={"gpu_pods": 0}),
    Row("lent/stops by itself beside a game: relend with the rest after relend_delay",
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")), LendeeStopped(at=AT),
        Phase.OFF, [ScheduleRelend(at=AT + 30)], fields={"lent": frozenset()}),
    Row("joining/back whole, a game ended meanwhile: regrow armed",
        S(Phase.JOINING, lent=gpus(B, C)), ReturnDone(at=AT, ticket=T),
        Phase.LENT, [ScheduleRelend(at=AT + 30)]),
    Row("joining/back whole beside a game: no regrow",
        S(Phase.JOINING, lent=gpus(B, C), running_owners=vms("gaming1")),
        ReturnDone(at=AT, ticket=T), Phase.LENT, []),
    # DRAINING, STOPPING
    Row("draining/cancel the only intent: the reclaim is finished anyway",
        S(Phase.DRAINING, intents=G1), CancelIntent(at=AT, owner="gaming1", by="alice"),
        Phase.DRAINING, [cancelled("gaming1")], fields={"intents": ()}),
    Row("draining/aborted: only requests for its GPUs fail, the started one waits on",
        S(Phase.DRAINING, lent=gpus(B, C), agent_up=True, intents=(*G2, *G1)),
        DrainFailed(at=AT, ticket=T, reason="PDB"), Phase.JOINING,
        [FailIntent(intent_id="i-gaming2", owner="gaming2",
                    reason="gpu-node could not be drained (PDB), and the policy keeps it lent"),
         KubeReturn(ticket=T + 1)],
        fields={"intents": G1}),
    Row("stopping/stopped: the waiting owner starts, the relend waits for it to run",
        S(Phase.STOPPING, lent=gpus(A, C), running_owners=vms("gaming2"), intents=G1,
          agent_up=True, shutdown_sent=True),
        LendeeStopped(at=AT), Phase.OFF, [StartOwner(owner="gaming1")],
        fields={"lent": frozenset(), "relend_at": None}),
    Row("stopping/a regrow's shutdown done: relend with all after relend_delay",
        S(Phase.STOPPING, lent=gpus(B, C), agent_up=True, shutdown_sent=True),
        LendeeStopped(at=AT), Phase.OFF, [ScheduleRelend(at=AT + 30)]),
    # Observed: a fresh read of libvirt
    Row("observed/a live subset beside a game: no reclaim, through BOOTING",
        S(), Observed(at=AT, lendee_running=True, owners_running=vms("gaming1"),
                      lendee_gpus=gpus(B, C)),
        Phase.BOOTING, [WaitAgent(ticket=T + 1)], fields={"lent": gpus(B, C)}),
    Row("observed/the whole definition beside a game: reclaim",
        S(), Observed(at=AT, lendee_running=True, owners_running=vms("gaming1")),
        Phase.DRAINING, [Drain(ticket=T + 1)], fields={"lent": ALL}),
    Row("observed/a live subset an owner waits for: reclaim",
        S(intents=G2), Observed(at=AT, lendee_running=True, owners_running=vms("gaming1"),
                               lendee_gpus=gpus(B, C)),
        Phase.DRAINING, [Drain(ticket=T + 1)]),
    Row("observed/a reclaim by hand under way (draining): it goes on",
        S(Phase.DRAINING, lent=gpus(B, C), reclaiming=True, hold=True),
        Observed(at=AT, lendee_running=True, owners_running=vms(), lendee_gpus=gpus(B, C)),
        Phase.DRAINING, [Drain(ticket=T + 1)], fields={"reclaiming": True}),
    Row("observed/a reclaim by hand under way (stopping): it goes on",
        S(Phase.STOPPING, reclaiming=True, hold=True, agent_up=True, shutdown_sent=True),
        Observed(at=AT, lendee_running=True, owners_running=vms()),
        Phase.DRAINING, [Drain(ticket=T + 1)], fields={"reclaiming": True}),
    Row("observed/a reclaim by hand, the lendee off meanwhile: held, not reclaiming",
        S(Phase.STOPPING, reclaiming=True, hold=True, agent_up=True, shutdown_sent=True),
        Observed(at=AT, lendee_running=False, owners_running=vms()),
        Phase.OFF, [], fields={"reclaiming": False, "hold": True}),
    Row("observed/off beside a game: relend the rest at once",
        S(), Observed(at=AT, lendee_running=False, owners_running=vms("gaming1")),
        Phase.OFF, [ScheduleRelend(at=AT)]),
    Row("observed/off beside both games, min_gpus 2: stays off",
        S(), Observed(at=AT, lendee_running=False, owners_running=vms("gaming1", "gaming2")),
        Phase.OFF, [], policy=MIN2),
    Row("observed/a start let through is forgotten: the reread says what runs",
        S(starting_owners=vms("gaming1")),
        Observed(at=AT, lendee_running=False, owners_running=vms("gaming1")),
        Phase.OFF, [ScheduleRelend(at=AT)],
        fields={"starting_owners": vms(), "running_owners": vms("gaming1")}),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_transition(row: Row) -> None:
    new, got = go(row.state, row.event, row.policy)
    assert (new.phase, got) == (row.phase, row.actions)
    if not isinstance(row.event, Observed):  # a reread enters its phase afresh
        assert (new.ticket != row.state.ticket) == (new.phase != row.state.phase)
    assert {k: getattr(new, k) for k in row.fields} == row.fields


def test_row_names_are_unique() -> None:
    assert len({row.name for row in ROWS}) == len(ROWS)


# --- scenarios -------------------------------------------------------------------------


def _reclaim_road(state: State) -> tuple[State, list[Action]]:
    """From DRAINING: drained, the agent answers, the lendee shuts down."""
    assert state.phase is Phase.DRAINING
    t = state.ticket
    return run(
        state,
        Drained(at=AT + 1, ticket=t),
        AgentUp(at=AT + 2, ticket=t + 1),
        LendeeStopped(at=AT + 3),
    )


def test_a_sharing_owner_reclaims_starts_then_the_lendee_comes_back_with_the_rest() -> None:
    lent = S(Phase.LENT, lent=gpus(A, C), running_owners=vms("gaming2"))
    state, actions = go(lent, wants("gaming1"))
    assert actions == [Drain(ticket=T + 1)]
    state, actions = _reclaim_road(state)
    assert actions == [WaitAgent(ticket=T + 2), ShutdownLendee(ticket=T + 2),
                       StartOwner(owner="gaming1")]
    assert state.phase is Phase.OFF and state.relend_at is None
    # Our start goes through the hook, which lets it through (OwnerStarting).
    assert verdict(state, "gaming1", topo=TOPO)[0] == "proceed"
    state, actions = run(state, OwnerStarting(at=AT + 4, owner="gaming1"),
                         OwnerStarted(at=AT + 5, owner="gaming1"))
    # The lendee waited for this start only: it takes what is left at once.
    assert actions == [done("gaming1"), ScheduleRelend(at=AT + 5)]
    state, actions = go(state, RelendDue(at=AT + 5))
    assert actions == [StartLendee(gpus=gpus(C))]
    state, actions = go(state, LendeeStarted(at=AT + 6))
    assert (state.phase, state.lent) == (Phase.BOOTING, gpus(C))
    assert holders(state, TOPO) == {A: "gaming1", B: "gaming2", C: LENDEE, Z: None}


def test_gaming2_starting_mid_game_leaves_only_gpu_c() -> None:
    # gaming1 plays; the lendee was lent gpu-b and gpu-c.
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"))
    decision, message = verdict(state, "gaming2", topo=TOPO)
    assert decision == "defer" and "gpu-node holds gpu-b;" in message
    state, actions = go(state, wants("gaming2"))
    assert actions == [Drain(ticket=T + 1)]
    state, actions = _reclaim_road(state)
    assert actions[-1] == StartOwner(owner="gaming2")
    state, actions = run(state, OwnerStarting(at=AT + 4, owner="gaming2"),
                         OwnerStarted(at=AT + 5, owner="gaming2"), RelendDue(at=AT + 5))
    assert actions == [done("gaming2"), ScheduleRelend(at=AT + 5), StartLendee(gpus=gpus(C))]
    # Both games end: the lendee regrows to all three once idle.
    state, actions = run(state, LendeeStarted(at=AT + 6), AgentUp(at=AT + 7, ticket=T + 4),
                         ReturnDone(at=AT + 8, ticket=T + 5),
                         OwnerStopped(at=AT + 10, owner="gaming1"),
                         OwnerStopped(at=AT + 11, owner="gaming2"))
    assert state.phase is Phase.LENT and state.relend_at == AT + 40  # armed once, not pushed
    assert free_gpus(state, TOPO, POLICY) - state.lent == {A, B}


@pytest.mark.parametrize("policy", [POLICY, UNBOUNDED, ALWAYS, NEVER],
                         ids=["when-idle", "when-idle, no limit", "always", "never"])
@pytest.mark.parametrize("pods", [0, 1], ids=["idle", "GPU pod"])
def test_regrow_under_each_policy(policy: Policy, pods: int) -> None:
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"))
    state, _ = run(state, GpuPods(at=AT, count=pods), OwnerStopped(at=AT, owner="gaming1"),
                   policy=policy)
    if policy.regrow is Regrow.NEVER:
        assert state.relend_at is None  # lent with gpu-b and gpu-c until it stops
        return
    state, actions = go(state, RelendDue(at=AT + 30), policy)
    if policy.regrow is Regrow.WHEN_IDLE and pods:
        # No restart while a GPU job runs; it begins when the last one ends, or when
        # the wait's limit is reached.
        end = [] if policy.regrow_max_wait is None else [ScheduleRelend(at=AT + 150)]
        assert (state.phase, actions, state.regrow_waiting) == (Phase.LENT, end, True)
        state, actions = go(state, GpuPods(at=AT + 90, count=pods + 1), policy)
        assert (state.phase, actions) == (Phase.LENT, [])
        state, actions = go(state, GpuPods(at=AT + 100, count=0), policy)
        actions = [a for a in actions if a != CancelRelend()]
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=state.ticket, regrow=True)])
    state, actions = _reclaim_road(state)
    assert actions[-1] == ScheduleRelend(at=AT + 33)
    state, actions = go(state, RelendDue(at=AT + 33), policy)
    assert actions == [StartLendee(gpus=ALL)]


def test_a_lend_knows_no_gpu_pods_until_its_own_watch_reports() -> None:
    # The previous lend's watch last said 0: this lend's regrow must not decide on that.
    state = S(Phase.JOINING, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=0)
    state, _ = run(state, ReturnDone(at=AT, ticket=T), OwnerStopped(at=AT, owner="gaming1"),
                   RelendDue(at=AT + 30))
    assert (state.phase, state.gpu_pods, state.regrow_waiting) == (Phase.LENT, None, True)
    state, actions = go(state, GpuPods(at=AT + 31, count=0))
    # The end of the wait, armed meanwhile, is disarmed.
    assert (state.phase, actions) == (Phase.DRAINING,
                                      [CancelRelend(), Drain(ticket=state.ticket, regrow=True)])


REGROW_DUE = S(Phase.LENT, lent=gpus(B, C), gpu_pods=0, relend_at=AT)  # gpu-a free again


def test_a_regrow_whose_drain_cannot_finish_is_given_up_and_tried_again_later() -> None:
    # Nobody waits for a regrow: its drain is the optional kind (a pod a PDB protects is
    # never killed for it), and a drain that cannot finish returns the node as it is.
    state, actions = go(REGROW_DUE, RelendDue(at=AT))
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 1, regrow=True)])
    state, actions = go(state, DrainFailed(at=AT + 60, ticket=T + 1, reason="a PDB"))
    assert (state.phase, actions) == (Phase.JOINING, [KubeReturn(ticket=T + 2)])
    state, actions = go(state, ReturnDone(at=AT + 70, ticket=T + 2))
    assert (state.phase, state.lent, actions) == (Phase.LENT, gpus(B, C),
                                                  [ScheduleRelend(at=AT + 100)])


@pytest.mark.parametrize("event", [wants("gaming2"), Reclaim(at=AT + 5)],
                         ids=["an owner", "by hand"])
def test_a_reclaim_joining_a_regrows_drain_drains_again_as_its_own(event: Event) -> None:
    state, _ = go(REGROW_DUE, RelendDue(at=AT))
    state, actions = go(state, event)
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 2)])
    state, actions = run(state, Drained(at=AT + 10, ticket=T + 2), AgentUp(at=AT + 11, ticket=T + 3))
    assert actions == [WaitAgent(ticket=T + 3), ShutdownLendee(ticket=T + 3)]


@pytest.mark.parametrize("when", ["draining", "stopping"])
def test_a_regrow_that_would_gain_nothing_now_is_given_up_before_the_shutdown(when: str) -> None:
    # gaming1 starts again while the regrow drains (or waits for the guest agent): gpu-a
    # is not free any more, and a restart would bring the lendee back with what it has.
    state, _ = go(REGROW_DUE, RelendDue(at=AT))
    game = [wants("gaming1", at=AT + 5), OwnerStarted(at=AT + 6, owner="gaming1")]
    if when == "draining":
        state, actions = run(state, *game, Drained(at=AT + 10, ticket=T + 1))
        assert actions[-1:] == [KubeReturn(ticket=T + 2)]
    else:
        state, _ = run(state, Drained(at=AT + 10, ticket=T + 1), *game)
        state, actions = go(state, AgentUp(at=AT + 11, ticket=T + 2))
        assert actions == [KubeReturn(ticket=T + 3)]
    assert (state.phase, state.lent, state.regrowing) == (Phase.JOINING, gpus(B, C), False)


def test_a_moot_regrow_whose_agent_answers_only_now_returns_the_lendee_as_it_runs() -> None:
    # A STOPPING regrow read back with the agent not yet up (a restart of hostagent
    # meanwhile): its answer is what the return needs, not another wait for it.
    state = S(Phase.STOPPING, lent=gpus(B, C), running_owners=vms("gaming1"), regrowing=True,
              agent_up=False)
    state, actions = go(state, AgentUp(at=AT, ticket=T))
    assert (state.phase, state.agent_up, actions) == (Phase.JOINING, True,
                                                      [KubeReturn(ticket=T + 1)])


def test_a_regrow_is_cancelled_when_the_game_restarts_within_relend_delay() -> None:
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"))
    state, actions = go(state, OwnerStopped(at=AT, owner="gaming1"))
    assert actions == [ScheduleRelend(at=AT + 30)]
    # The game VM reboots: the lendee does not hold gpu-a, so the hook lets it through.
    assert verdict(state, "gaming1", topo=TOPO) == ("proceed", "gpu-node runs without gpu-a")
    state, actions = run(state, OwnerStarting(at=AT + 5, owner="gaming1"),
                         OwnerStarted(at=AT + 8, owner="gaming1"))
    assert actions == [CancelRelend()]
    assert (state.phase, state.lent, state.relend_at) == (Phase.LENT, gpus(B, C), None)
    with pytest.raises(IllegalTransition, match="no regrow is scheduled"):
        go(state, RelendDue(at=AT + 30))  # the timer that was cancelled, firing late


@pytest.mark.parametrize("policy", [POLICY, UNBOUNDED], ids=["when-idle", "no limit"])
def test_a_regrow_waiting_for_gpu_pods_is_dropped_when_the_game_restarts(policy: Policy) -> None:
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=1)
    state, _ = run(state, OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                   policy=policy)
    assert state.regrow_waiting
    state, actions = run(state, OwnerStarting(at=AT + 40, owner="gaming1"),
                         OwnerStarted(at=AT + 45, owner="gaming1"),
                         GpuPods(at=AT + 50, count=0), policy=policy)
    assert (state.phase, state.regrow_waiting, state.relend_at) == (Phase.LENT, False, None)
    assert Drain(ticket=state.ticket) not in actions


def test_the_default_regrow_never_kills_a_running_job() -> None:
    # Without hot-plug a regrow is a restart: by default it waits for the node's GPU
    # jobs to end however long they run, and begins the moment none does.
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=1)
    policy = Policy(relend_delay=30.0)
    state, actions = run(state, OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                         policy=policy)
    for hour in range(1, 25):
        state, more = go(state, GpuPods(at=AT + 3600 * hour, count=hour % 3 + 1), policy)
        actions += more
    assert actions == [ScheduleRelend(at=AT + 30)]
    assert (state.phase, state.regrow_waiting) == (Phase.LENT, True)
    state, actions = go(state, GpuPods(at=AT + 90000, count=0), policy)
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=state.ticket, regrow=True)])


def test_a_regrow_wait_of_under_a_second_is_still_a_wait() -> None:
    # Only a bound of 0 restarts at once; half a second is waited like any other.
    policy = replace(POLICY, regrow_max_wait=0.5)
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=1)
    state, actions = run(state, OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                         policy=policy)
    assert actions == [ScheduleRelend(at=AT + 30), ScheduleRelend(at=AT + 30.5)]
    assert (state.phase, state.regrow_waiting) == (Phase.LENT, True)


def test_a_regrow_waits_at_most_regrow_max_wait_for_gpu_pods() -> None:
    # A bounded wait: a GPU job that outlives it is killed by the restart, so the freed
    # GPU is not left idle for the rest of it.
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1"), gpu_pods=1)
    state, actions = run(state, OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                         GpuPods(at=AT + 60, count=2))
    assert actions == [ScheduleRelend(at=AT + 30), ScheduleRelend(at=AT + 150)]
    assert (state.phase, state.regrow_waiting) == (Phase.LENT, True)
    state, actions = go(state, RelendDue(at=AT + 150))
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=state.ticket, regrow=True)])
    assert not state.regrow_waiting  # the wait is over: a relend later does not extend it
    state, actions = _reclaim_road(state)
    state, actions = go(state, RelendDue(at=AT + 33))
    assert actions == [StartLendee(gpus=ALL)]


@pytest.mark.parametrize(
    "state",
    [
        S(running_owners=vms("gaming-win")),
        S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming-win")),
        S(Phase.DRAINING, lent=gpus(B, C), running_owners=vms("gaming-win")),
    ],
    ids=["off", "lent", "draining"],
)
def test_a_second_owner_of_a_held_gpu_is_refused_with_one_sentence(state: State) -> None:
    sentence = "gpu-a is in use by gaming-win"
    assert conflict(state, "gaming1", TOPO) == sentence
    assert verdict(state, "gaming1", topo=TOPO) == ("refuse", f"{sentence} ({FOLLOW})")
    with pytest.raises(IllegalTransition) as refused:
        go(state, wants("gaming1"))
    assert refused.value.why == sentence
    # Never a reclaim, never a wait on a game: nothing was recorded.
    assert not state.intents


@pytest.mark.parametrize(
    ("state", "sentence"),
    [
        (S(intents=(intent("gaming-win"),)), "gpu-a is being handed to gaming-win"),
        (S(starting_owners=vms("gaming-win")), "gpu-a is being handed to gaming-win"),
        (S(Phase.DRAINING, intents=(intent("gaming-win"),)),
         "gpu-a is being handed to gaming-win"),
    ],
    ids=["waiting", "starting", "reclaim for it"],
)
def test_a_second_owner_of_a_gpu_on_its_way_is_refused(state: State, sentence: str) -> None:
    assert verdict(state, "gaming1", topo=TOPO) == ("refuse", f"{sentence} ({FOLLOW})")
    with pytest.raises(IllegalTransition, match=sentence):
        go(state, wants("gaming1"))


def test_owners_of_other_cards_are_not_refused() -> None:
    state = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming-win"))
    assert conflict(state, "gaming2", TOPO) is None
    assert conflict(state, "gaming-win", TOPO) is None  # itself
    assert verdict(state, "gaming2", topo=TOPO)[0] == "defer"


def test_the_hook_claim_of_a_failed_start_is_released_and_the_relend_re_armed() -> None:
    state = S(relend_at=AT + 20)
    state, actions = go(state, OwnerStarting(at=AT, owner="gaming1"))
    assert actions == [CancelRelend()]
    # While it starts, the lendee may not: defer a start by hand, refuse the other owner.
    assert verdict(state, LENDEE, topo=TOPO)[0] == "defer"
    assert verdict(state, "gaming-win", topo=TOPO)[0] == "refuse"
    state, actions = go(state, OwnerStopped(at=AT + 2, owner="gaming1"))  # release end
    assert actions == [ScheduleRelend(at=AT + 32)]
    assert state.starting_owners == frozenset()


def test_cancel_while_draining_then_the_lendee_is_lent_again_whole() -> None:
    state = S(Phase.LENT, running_owners=vms())
    state, _ = go(state, wants("gaming1"))
    state, actions = go(state, CancelIntent(at=AT + 1, owner="gaming1", by="control"))
    assert actions == [cancelled("gaming1", "control")]
    assert state.phase is Phase.DRAINING  # finished anyway
    state, actions = _reclaim_road(state)
    assert actions == [WaitAgent(ticket=T + 2), ShutdownLendee(ticket=T + 2),
                       ScheduleRelend(at=AT + 33)]
    _, actions = go(state, RelendDue(at=AT + 33))
    assert actions == [StartLendee(gpus=ALL)]


def test_cancel_while_waiting_for_a_lendee_start_then_it_lands_and_is_lent() -> None:
    state = S(relend_at=AT)
    state, _ = go(state, RelendDue(at=AT))
    state, actions = go(state, wants("gaming2"))
    assert actions == []  # waits for the start to end
    state, actions = go(state, CancelIntent(at=AT + 1, owner="gaming2", by="alice"))
    assert actions == [cancelled("gaming2")]
    state, actions = go(state, LendeeStarted(at=AT + 2))
    assert (state.phase, actions) == (Phase.BOOTING, [WaitAgent(ticket=T + 1)])


def test_cancel_without_a_pending_start_is_refused() -> None:
    with pytest.raises(IllegalTransition, match="gaming1 has no pending start"):
        go(S(intents=G2), CancelIntent(at=AT, owner="gaming1", by="alice"))


def test_a_reclaim_by_hand_survives_a_reread_until_the_lendee_is_off() -> None:
    """Issue 15, item 3: a manual reclaim was undone by a libvirtd reconnect or an agent
    restart during DRAINING or STOPPING (the reread sent a lendee nobody waits for back
    through BOOTING and lent it again)."""
    state, actions = go(S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
                        Reclaim(at=AT))
    assert (state.phase, state.reclaiming, state.hold) == (Phase.DRAINING, True, True)
    state, _ = go(state, Drained(at=AT + 1, ticket=state.ticket))
    assert state.phase is Phase.STOPPING
    # The agent restarts: intents, hold, relend_at and reclaiming come back from disk.
    fresh = State(intents=state.intents, hold=state.hold, relend_at=state.relend_at,
                  reclaiming=state.reclaiming)
    live = Observed(at=AT + 2, lendee_running=True, owners_running=vms("gaming1"),
                    lendee_gpus=gpus(B, C))
    for before in (state, fresh):  # a reconnect, a restart
        after, actions = go(before, live)
        assert (after.phase, actions[-1]) == (Phase.DRAINING, Drain(ticket=after.ticket))
        after, _ = _reclaim_road(after)
        assert (after.phase, after.hold, after.reclaiming, after.relend_at) == (
            Phase.OFF, True, False, None)


def test_still_wanted_start_lendee_only_with_the_set_expected() -> None:
    starting = S(lendee_starting=True, lent=gpus(B, C))
    assert still_wanted(starting, StartLendee(gpus=gpus(B, C)), topo=TOPO)
    assert not still_wanted(starting, StartLendee(gpus=ALL), topo=TOPO)  # a stale set
    assert not still_wanted(starting, StartLendee(gpus=gpus(C)), topo=TOPO)
    assert not still_wanted(S(), StartLendee(gpus=gpus(B, C)), topo=TOPO)  # not in flight
    booted = S(Phase.BOOTING, lent=gpus(B, C))
    assert not still_wanted(booted, StartLendee(gpus=gpus(B, C)), topo=TOPO)


def test_still_wanted_start_owner_beside_a_subset() -> None:
    lent = S(Phase.LENT, lent=gpus(B, C), intents=(*G1, *G2))
    assert still_wanted(lent, StartOwner(owner="gaming1"), topo=TOPO)  # outside the set
    assert not still_wanted(lent, StartOwner(owner="gaming2"), topo=TOPO)  # it holds gpu-b
    assert not still_wanted(S(lendee_starting=True, lent=gpus(A, C), intents=G1),
                            StartOwner(owner="gaming1"), topo=TOPO)
    assert not still_wanted(replace(lent, running_owners=vms("gaming1")),
                            StartOwner(owner="gaming1"), topo=TOPO)


def test_holders_with_a_subset() -> None:
    lent = S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1", "gaming3"))
    assert holders(lent, TOPO) == {A: "gaming1", B: LENDEE, C: LENDEE, Z: "gaming3"}
    nobody = dict.fromkeys([A, B, C, Z])
    # A start in flight holds nothing yet; neither does an owner the hook let through.
    assert holders(S(lendee_starting=True, lent=gpus(B, C)), TOPO) == nobody
    assert holders(S(starting_owners=vms("gaming1")), TOPO) == nobody
    assert holders(S(running_owners=vms("gaming-win")), TOPO) == {**nobody, A: "gaming-win"}
    assert holders(S(Phase.LENT, lent=gpus(C)), TOPO) == {**nobody, C: LENDEE}


def test_free_gpus() -> None:
    assert free_gpus(S(), TOPO, POLICY) == ALL
    assert free_gpus(S(running_owners=vms("gaming1")), TOPO, POLICY) == {B, C}
    assert free_gpus(S(starting_owners=vms("gaming-win")), TOPO, POLICY) == {B, C}
    assert free_gpus(S(intents=G2, running_owners=vms("gaming3")), TOPO, POLICY) == {A, C}
    assert free_gpus(S(running_owners=vms("gaming1")), TOPO, ALL_OR_NOTHING) == frozenset()
    assert free_gpus(S(running_owners=vms("gaming3")), TOPO, ALL_OR_NOTHING) == ALL


# --- minimal sequences the world found (bugs, fixed) -----------------------------------


def test_observed_starts_a_waiting_owner_outside_the_live_set() -> None:
    # gaming1 asked while the lendee ran with gpu-b and gpu-c: started at once (the
    # intent persisted); the agent restarted before the start ran.
    new, actions = go(State(intents=G1), Observed(at=AT, lendee_running=True,
                                                  owners_running=vms(),
                                                  lendee_gpus=gpus(B, C)))
    assert new.phase is Phase.BOOTING
    assert StartOwner(owner="gaming1") in actions


def test_a_start_of_the_lendee_by_hand_during_the_agents_own_is_deferred() -> None:
    """The hook reads the definition being started: while the agent starts gpu-node
    without gpu-a, a start by hand of its whole definition is deferred, not taken for
    the agent's own (the machine would believe a live set it does not have)."""
    starting = S(lendee_starting=True, lent=gpus(B, C))
    assert verdict(starting, LENDEE, topo=TOPO, gpus=gpus(B, C))[0] == "proceed"
    decision, message = verdict(starting, LENDEE, topo=TOPO, gpus=ALL)
    assert decision == "defer" and message.startswith(
        "hostagent is starting gpu-node without gpu-a right now")


def test_a_regrow_cancelled_by_a_pending_owner_is_armed_again_once_it_runs() -> None:
    state = S(Phase.LENT, lent=gpus(C), running_owners=vms("gaming1", "gaming2"))
    state, actions = run(state, OwnerStopped(at=AT, owner="gaming2"),  # gpu-b is free
                         OwnerStopped(at=AT + 1, owner="gaming1"),  # gaming1 reboots
                         OwnerStarting(at=AT + 2, owner="gaming1"),
                         OwnerStarted(at=AT + 5, owner="gaming1"))
    assert actions[:2] == [ScheduleRelend(at=AT + 30), CancelRelend()]
    assert free_gpus(state, TOPO, POLICY) - state.lent == {B}
    assert state.relend_at is not None  # a regrow for gpu-b


# --- the events of partial lending in every phase --------------------------------------


def _base(phase: Phase) -> State:
    """A plausible state in each phase with the lendee (if it runs) short of gpu-a."""
    if phase is Phase.OFF:
        return S()
    return S(phase, lent=gpus(B, C), reason=FAILED_WHY if phase is Phase.FAILED else None,
             agent_up=phase in (Phase.JOINING, Phase.LENT, Phase.STOPPING),
             shutdown_sent=phase is Phase.STOPPING)


EVERY_PHASE_EVENTS = ["OwnerStarting", "CancelIntent", "GpuPods 0", "GpuPods 3"]


@pytest.mark.parametrize("kind", EVERY_PHASE_EVENTS)
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_partial_events_in_every_phase(phase: Phase, kind: str) -> None:
    base = _base(phase)
    event: Event
    if kind == "OwnerStarting":
        # gaming1 is let through: the lendee does not hold gpu-a (or is off).
        assert verdict(base, "gaming1", topo=TOPO)[0] == "proceed"
        event = OwnerStarting(at=AT, owner="gaming1")
        expected = replace(base, starting_owners=vms("gaming1"))
        actions: list[Action] = []
    elif kind == "CancelIntent":
        base = replace(base, intents=G1)
        event = CancelIntent(at=AT, owner="gaming1", by="alice")
        expected = replace(base, intents=())
        actions = [cancelled("gaming1")]
        if phase in (Phase.OFF, Phase.LENT):
            # Nothing waits any more: a relend (OFF) or a regrow for gpu-a (LENT).
            expected = replace(expected, relend_at=AT + 30)
            actions.append(ScheduleRelend(at=AT + 30))
    else:
        count = int(kind.split()[1])
        event = GpuPods(at=AT, count=count)
        expected = replace(base, gpu_pods=count)
        actions = []
    new, got = go(base, event)
    assert (new, got) == (expected, actions)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_partial_events_refused_in_every_phase(phase: Phase) -> None:
    base = replace(_base(phase), starting_owners=vms("gaming1"))
    for event, why in [
        (OwnerStarting(at=AT, owner="gaming1"), "gaming1 is already running or starting"),
        (OwnerStarting(at=AT, owner="desktop"), "desktop is not an owner VM"),
        (CancelIntent(at=AT, owner="gaming2", by="x"), "gaming2 has no pending start"),
        (CancelIntent(at=AT, owner="desktop", by="x"), "desktop is not an owner VM"),
    ]:
        with pytest.raises(IllegalTransition, match=why):
            go(base, event)


# --- a randomised world ----------------------------------------------------------------


class World(RuleBasedStateMachine):
    """libvirt, the guest, the cluster, people and the executor, with the GPUs each VM
    really holds.

    Like test_machine.World, actions are queued and complete in any order, successfully
    or not. What is new: the lendee runs with the GPU set it was started with (its live
    definition), or all of them when started by hand; a start the hook lets through is
    recorded (`OwnerStarting`) and lands later, or fails and is released
    (`OwnerStopped`); owners of one card can be started against each other; pending
    starts are cancelled; the cluster reports GPU pods. The world has no device lock for
    anything the machine starts or lets through: a conflicting start is caught, not
    refused. The one exception is a lendee started by hand with its whole definition,
    which the hook lets through while hostagent's own start is in flight (it cannot tell
    the two apart): there QEMU's lock on a device in use is what refuses it.

    After a restart of the agent, libvirt lists an owner whose start is in flight as
    running (its domain is active from the moment libvirt starts preparing it).
    """

    topo = TOPO

    def owned(self, owners: set[str] | frozenset[str]) -> frozenset[str]:
        """What those owners hold when they run: their GPUs and every GPU that shares
        an IOMMU group with one (VFIO takes the group)."""
        return self.topo.whole(self.topo.gpus_of(owners))

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.policy = POLICY
        self.state = State()
        self.now = 0.0
        self.live: frozenset[str] | None = None  # the lendee's GPUs while it runs
        self.attached: frozenset[str] = frozenset()  # asked to attach since it started
        self.guest_ready = False
        self.answered = False
        self.owners_up: set[str] = set()
        self.owners_starting: set[str] = set()  # let through, start in flight
        self.listed: set[str] = set()  # of those, the ones a reread saw as running
        self.agent_starts: set[str] = set()  # of those, the ones our StartOwner began
        self.queue: list[Action] = []
        self.timer: float | None = None
        self.open: dict[str, str] = {}
        self.ids = itertools.count()

    # -- plumbing

    def deliver(self, event: Event, *, may_be_stale: bool = False) -> None:
        before = self.state
        try:
            after, actions = step(before, event, topo=self.topo, policy=self.policy)
        except IllegalTransition:
            if not may_be_stale:
                raise
            return
        self.state = after
        if after.phase is not before.phase:
            assert after.ticket != before.ticket
        for action in actions:
            self.take(before, after, action)

    def claimed(self, s: State) -> frozenset[str]:
        """What owners hold, start with or wait for, as the machine knows it."""
        return self.owned(s.running_owners | s.starting_owners | set(s.waiting_owners))

    def take(self, before: State, after: State, action: Action) -> None:
        match action:
            case ScheduleRelend(at=at):
                self.timer = at
            case CancelRelend():
                self.timer = None
            case CompleteIntent(intent_id=i, owner=o):
                assert self.open.pop(i) == o, f"intent {i} completed twice or never opened"
                assert o in self.owners_up | self.listed, f"intent {i} done, {o} not running"
            case FailIntent(intent_id=i, owner=o):
                assert self.open.pop(i) == o, f"intent {i} failed twice or never opened"
            case ForceOff():
                assert self.policy.force_off or before.unplug_stuck, (
                    "ForceOff without force_off_after, of a guest not stuck letting a GPU go")
                self.queue.append(action)
            case AttachGpus(gpus=g):
                self.attached |= g
                self.queue.append(action)
            case ShutdownLendee():
                assert before.phase is Phase.STOPPING
                assert self.live is not None and self.answered, "shutdown before agent up"
                self.queue.append(action)
            case StartOwner(owner=o):
                assert not self.topo.claims(o) & after.lent, f"{o} started into the lendee's set"
                self.queue.append(action)
            case StartLendee(gpus=g):
                assert not after.hold
                assert g == after.lent and after.lendee_starting
                assert len(g) >= self.policy.min_gpus, f"{sorted(g)} is below min_gpus"
                assert g <= self.topo.lendee_gpus
                assert not g & self.claimed(after), f"{sorted(g)} meets what owners claim"
                assert not g & self.owned(self.owners_up | self.owners_starting)
                if not self.policy.partial:
                    assert g == self.topo.lendee_gpus
                self.queue.append(action)
            case _:
                self.queue.append(action)

    def open_intent(self, owner: str, source: IntentSource) -> None:
        intent_id = f"i{next(self.ids)}"
        if not self.state.intents_of(owner):  # else it joins the one pending
            self.open[intent_id] = owner
        rival = conflict(self.state, owner, self.topo) if owner not in self.state.running_owners \
            else None
        try:
            self.deliver(OwnerWants(at=self.now, owner=owner, intent_id=intent_id,
                                    source=source))
        except IllegalTransition as e:
            # Another owner of its card: refused with its sentence, nothing recorded.
            assert rival is not None and e.why == rival, e
            self.open.pop(intent_id, None)

    def let_through(self, owner: str) -> None:
        """The hook said proceed: the agent records the claim, libvirt starts it."""
        self.owners_starting.add(owner)
        self.deliver(OwnerStarting(at=self.now, owner=owner),
                     may_be_stale=owner in self.state.starting_owners)

    def land(self, owner: str, ok: bool) -> None:
        """libvirt's start of `owner` ends: it runs, or it failed and is released."""
        self.owners_starting.discard(owner)
        listed = owner in self.listed
        self.listed.discard(owner)
        ours = owner in self.agent_starts
        self.agent_starts.discard(owner)
        if ok:
            self.owners_up.add(owner)
            self.deliver(OwnerStarted(at=self.now, owner=owner), may_be_stale=listed)
            return
        if ours:
            self.deliver(StartFailed(at=self.now, vm=owner, reason="x"), may_be_stale=True)
        self.deliver(OwnerStopped(at=self.now, owner=owner), may_be_stale=ours)

    def start_lendee(self, gpus: frozenset[str]) -> None:
        self.live, self.guest_ready, self.answered = gpus, False, False
        self.attached = frozenset()
        self.deliver(LendeeStarted(at=self.now))

    def stop_lendee(self) -> None:
        self.live, self.guest_ready, self.answered = None, False, False
        self.deliver(LendeeStopped(at=self.now))

    def execute(self, action: Action, ok: bool, late: bool = False) -> None:
        wanted = still_wanted(self.state, action, topo=self.topo)
        if not wanted and not (late and isinstance(action, (WaitAgent, Drain, KubeReturn))):
            return
        stale = not wanted
        match action:
            case StartOwner(owner=o):
                if o in self.owners_starting:
                    self.queue.append(action)  # libvirt serialises starts of one domain
                    return
                if not ok:
                    self.deliver(StartFailed(at=self.now, vm=o, reason="x"))
                    return
                decision, why = verdict(self.state, o, topo=self.topo)
                assert decision == "proceed", f"our own start of {o}: {decision}: {why}"
                self.agent_starts.add(o)
                self.let_through(o)
            case StartLendee(gpus=g):
                if not ok:
                    self.deliver(StartFailed(at=self.now, vm=LENDEE, reason="x"))
                    return
                if verdict(self.state, LENDEE, topo=self.topo)[0] == "defer":
                    self.deliver(StartFailed(at=self.now, vm=LENDEE, reason="deferred"))
                    return
                assert self.live is None
                self.start_lendee(g)
            case WaitAgent(ticket=t):
                if ok and self.live is not None and self.guest_ready:
                    self.answered = True
                    self.deliver(AgentUp(at=self.now, ticket=t), may_be_stale=stale)
                else:
                    self.deliver(AgentTimeout(at=self.now, ticket=t), may_be_stale=stale)
            case ShutdownLendee(ticket=t):
                if ok:
                    self.stop_lendee()
                else:
                    self.deliver(ShutdownTimeout(at=self.now, ticket=t))
            case ForceOff():
                self.stop_lendee()
            case Drain(ticket=t):
                event: Event = (Drained(at=self.now, ticket=t) if ok
                                else DrainFailed(at=self.now, ticket=t, reason="PDB"))
                self.deliver(event, may_be_stale=stale)
            case KubeReturn(ticket=t):
                event = (ReturnDone(at=self.now, ticket=t) if ok
                         else ReturnFailed(at=self.now, ticket=t, reason="short"))
                self.deliver(event, may_be_stale=stale)
            case AttachGpus(ticket=t, gpus=g):
                assert self.live is not None
                assert not g & self.owned(self.owners_up | self.owners_starting)
                if ok:
                    self.live |= g
                    self.deliver(GpusAttached(at=self.now, ticket=t, gpus=g))
                else:
                    self.deliver(AttachFailed(at=self.now, ticket=t, gpus=g,
                                              held=frozenset(), reason="x"))
            case DetachGpus(ticket=t, gpus=g):
                assert self.policy.hotplug is Hotplug.BOTH
                assert self.live is not None and g <= self.live
                assert len(self.live - g) >= self.policy.min_gpus
                if ok:  # else it never left: the guest held on to it
                    self.live -= g
                    self.deliver(GpusDetached(at=self.now, ticket=t, gpus=g))
                else:
                    # Every other one stuck in the guest: powered off if it cannot stop.
                    self.deliver(DetachFailed(at=self.now, ticket=t, gpus=g, reason="x",
                                              stuck=t % 2 == 0))
            case _:
                raise AssertionError(f"unexpected queued action {action}")

    # -- the world's moves

    @initialize(
        partial=st.booleans(),
        regrow=st.sampled_from(list(Regrow)),
        min_gpus=st.sampled_from([1, 2]),
        force_off=st.booleans(),
        delay=st.sampled_from([30.0, 0.0]),
        lendee=st.sampled_from([None, ALL, gpus(B, C), gpus(C)]),
        owners=st.sets(st.sampled_from(OWNERS)),
        hotplug=st.sampled_from(list(Hotplug)),
    )
    def boot(self, partial: bool, regrow: Regrow, min_gpus: int, force_off: bool,
             delay: float, lendee: frozenset[str] | None, owners: set[str],
             hotplug: Hotplug) -> None:
        self.policy = Policy(relend_delay=delay, force_off=force_off, partial=partial,
                             min_gpus=min_gpus, regrow=regrow, hotplug=hotplug)
        # A host that comes up with a consistent set of VMs running (all or nothing
        # never ran the lendee with a subset).
        if lendee is not None and (not partial or len(lendee) < min_gpus):
            lendee = ALL
        # Each GPU (and IOMMU group) held once: gaming1 wins its card over gaming-win.
        kept: set[str] = set()
        for o in OWNERS:
            if o in owners and not self.owned(kept) & self.topo.claims(o):
                kept.add(o)
        owners = kept
        if lendee is not None:
            owners = {o for o in owners if not self.topo.claims(o) & lendee}
        self.live, self.owners_up = lendee, set(owners)
        self.deliver(Observed(at=0.0, lendee_running=lendee is not None,
                              owners_running=frozenset(owners), lendee_gpus=lendee))
        self.ready = True

    @rule(owner=st.sampled_from(OWNERS))
    def virsh_start(self, owner: str) -> None:
        if owner in self.owners_up | self.owners_starting:
            return
        decision, message = verdict(self.state, owner, topo=self.topo)
        if decision == "proceed":
            self.let_through(owner)
        elif decision == "defer":
            self.open_intent(owner, IntentSource.HOOK)
        else:
            rival = conflict(self.state, owner, self.topo)
            assert rival is not None and message == f"{rival} ({FOLLOW})"

    @precondition(lambda self: bool(self.owners_starting))
    @rule(data=st.data())
    def owner_start_ends(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owners_starting)), label="owner")
        ok = data.draw(st.integers(0, 3), label="outcome") > 0
        self.land(owner, ok)

    @rule(owner=st.sampled_from(OWNERS))
    def control_start(self, owner: str) -> None:
        self.open_intent(owner, IntentSource.CONTROL)

    @precondition(lambda self: bool(self.state.intents))
    @rule(data=st.data())
    def control_release(self, data: st.DataObject) -> None:
        """`hostagent release VM`: cancel its pending start (a VM with none is refused:
        test_cancel_without_a_pending_start_is_refused)."""
        owner = data.draw(st.sampled_from(self.state.waiting_owners), label="owner")
        self.deliver(CancelIntent(at=self.now, owner=owner, by="alice"))
        assert not self.state.intents_of(owner)

    @rule()
    def virsh_start_lendee(self) -> None:
        """By hand: its whole definition. Not while hostagent's own start is in flight:
        the hook cannot tell the two apart, and `LendeeStarted` does not say which set
        the lendee got (the machine assumes the one it asked for)."""
        if self.live is not None or self.state.lendee_starting:
            return
        if verdict(self.state, LENDEE, topo=self.topo)[0] == "proceed":
            assert not self.topo.lendee_gpus & self.owned(self.owners_up | self.owners_starting)
            self.start_lendee(self.topo.lendee_gpus)

    @rule(owner=st.sampled_from(OWNERS))
    def owner_stops(self, owner: str) -> None:
        if owner in self.owners_up:
            self.owners_up.discard(owner)
            self.deliver(OwnerStopped(at=self.now, owner=owner))

    @rule()
    def lendee_stops_by_itself(self) -> None:
        if self.live is not None:
            self.stop_lendee()

    @rule()
    def guest_agent_comes_up(self) -> None:
        if self.live is not None:
            self.guest_ready = True

    @rule(count=st.sampled_from([0, 1, 2]))
    def gpu_pods(self, count: int) -> None:
        """The node watch: GPU jobs start and end on the lendee's node."""
        if self.live is not None:
            self.deliver(GpuPods(at=self.now, count=count))

    @precondition(lambda self: bool(self.queue))
    @rule(data=st.data())
    def executor_finishes_something(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.queue) - 1), label="which")
        ok = data.draw(st.integers(0, 4), label="outcome") > 0
        late = data.draw(st.booleans(), label="late")
        self.execute(self.queue.pop(index), ok, late)

    @rule(steps=st.integers(1, 20))
    def a_quiet_while(self, steps: int) -> None:
        """Some time in which everything works: drives the long roads (lend, reclaim,
        regrow)."""
        for _ in range(steps):
            if self.live is not None:
                self.guest_ready = True
            if self.queue:
                self.execute(self.queue.pop(0), ok=True)
            elif self.owners_starting:
                self.land(sorted(self.owners_starting)[0], ok=True)
            elif self.timer is not None:
                self.relend_timer_fires()

    @precondition(lambda self: self.timer is not None)
    @rule()
    def relend_timer_fires(self) -> None:
        assert self.timer is not None
        self.now = max(self.now, self.timer)
        self.timer = None
        self.deliver(RelendDue(at=self.now))

    @rule(dt=st.sampled_from([0.1, 5.0, 60.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(what=st.sampled_from([Hold, Resume, Reclaim]))
    def operator(self, what: type[Hold | Resume | Reclaim]) -> None:
        self.deliver(what(at=self.now))

    @rule(restart=st.booleans())
    def agent_loses_track(self, restart: bool) -> None:
        if restart:
            # What the agent persists comes back; in-flight work and timers die.
            self.queue.clear()
            self.timer = None
            s = self.state
            self.state = State(intents=s.intents, hold=s.hold, relend_at=s.relend_at,
                               reclaiming=s.reclaiming)
        else:
            self.queue = [a for a in self.queue if isinstance(a, (Drain, KubeReturn))]
        self.listed = set(self.owners_starting)
        self.deliver(Observed(at=self.now, lendee_running=self.live is not None,
                              owners_running=frozenset(self.owners_up | self.listed),
                              lendee_gpus=self.live))

    # -- what must always hold

    @invariant()
    def never_two_running_holders_of_a_gpu(self) -> None:
        if self.live is not None:
            assert not self.live & self.owned(self.owners_up), "the lendee and an owner share"
        for one, other in itertools.combinations(sorted(self.owners_up), 2):
            assert not self.topo.claims(one) & self.topo.claims(other), f"{one} and {other} share"

    @invariant()
    def the_live_set_never_meets_a_claim(self) -> None:
        """Lent, nothing an owner claims is the lendee's; but for the GPUs being detached
        for the owners that wait for them, and, while a detach is under way, those of
        owners queued behind it (a second player's GPU is detached live next, not by a
        restart). Never a GPU of an owner that runs or starts (I2)."""
        s = self.state
        if s.phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT):
            queued = self.owned(set(s.waiting_owners)) if s.detaching else frozenset()
            kept = s.lent - s.detaching - queued
            assert not kept & self.claimed(s), f"{s.phase} with {sorted(s.lent)}: {s}"
            assert not s.lent & self.owned(s.running_owners | s.starting_owners)
            world = self.owned(self.owners_up | self.owners_starting | set(s.waiting_owners))
            assert self.live is not None and not (self.live - s.detaching - queued) & world
            assert not self.live & self.owned(self.owners_up | self.owners_starting)

    @invariant()
    def no_intent_is_lost(self) -> None:
        assert {i.id: i.owner for i in self.state.intents} == self.open

    @invariant()
    def the_machine_knows_what_runs(self) -> None:
        if not self.ready:
            return
        s = self.state
        running = self.owners_up | self.listed
        assert s.phase.lendee_running == (self.live is not None)
        assert s.running_owners == running
        assert s.starting_owners <= self.owners_starting
        if self.live is not None:
            # A hot-add counts its GPUs from its first call on; one asked that never
            # ran (a reclaim came first) leaves them counted until the lendee stops.
            assert self.live <= s.lent and s.lent - self.live <= self.attached, s
        expected = {
            gpu: next((o for o in sorted(running) if gpu in self.topo.owners[o]), None)
            or (LENDEE if self.live is not None and gpu in s.lent else None)
            for gpu in sorted(self.topo.gpus)
        }
        assert holders(s, self.topo) == expected

    @invariant()
    def the_state_is_coherent(self) -> None:
        s = self.state
        assert s.relend_at == self.timer or not self.ready
        if s.relend_at is not None:
            assert s.phase in (Phase.OFF, Phase.LENT) and not s.hold and not s.lendee_starting
        if s.lendee_starting:
            assert s.phase is Phase.OFF and s.lent
        if s.regrow_waiting:
            assert s.phase is Phase.LENT
        if s.shutdown_sent:
            assert s.phase is Phase.STOPPING and s.agent_up
        if s.phase is Phase.FAILED:
            assert s.reason

    def teardown(self) -> None:
        """Let everything succeed: the machine must come to rest where it should."""
        if not self.ready:
            return
        for _ in range(500):
            if self.live is not None:
                self.guest_ready = True
            s = self.state
            idle = not self.queue and self.timer is None and not self.owners_starting
            if self.owners_starting:
                self.land(sorted(self.owners_starting)[0], ok=True)
            elif s.gpu_pods != 0 and self.live is not None:
                self.deliver(GpuPods(at=self.now, count=0))  # the GPU jobs end
            elif s.phase is Phase.FAILED or (
                s.phase is Phase.OFF and s.reason and idle and not s.hold
                and len(free_gpus(s, self.topo, self.policy)) >= self.policy.min_gpus
            ):
                self.deliver(Resume(at=self.now))  # the operator's "try again"
            elif self.queue:
                self.execute(self.queue.pop(0), ok=True)
            elif self.timer is not None:
                self.relend_timer_fires()
            else:
                break
        else:
            raise AssertionError(f"the machine never came to rest: {self.state}")
        assert not self.open, f"intents never ended: {self.open}"
        s = self.state
        free = self.topo.lendee_gpus - self.owned(self.owners_up)
        if not self.policy.partial and free != self.topo.lendee_gpus:
            free = frozenset()
        if s.hold:
            assert s.phase in (Phase.OFF, Phase.LENT)
            return
        if len(free) < self.policy.min_gpus:
            assert s.phase is Phase.OFF, f"lent below min_gpus: {s}"
        elif self.policy.regrow is Regrow.NEVER:
            assert s.phase is Phase.LENT and s.lent and s.lent <= free, s
        else:
            assert (s.phase, s.lent) == (Phase.LENT, free), s


World.TestCase.settings = settings(
    max_examples=STATEFUL_EXAMPLES,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_world = World.TestCase


class GroupedWorld(World):
    """The same world on a host where gpu-b (gaming2's) shares an IOMMU group with
    gpu-c (nobody's), and gpu-a with gpu-z (gaming3's, never lent): an owner holds its
    whole group, so the lendee's live set must never meet one."""

    topo = replace(TOPO, groups=(gpus(B, C), gpus(A, Z)))


GroupedWorld.TestCase.settings = settings(
    max_examples=max(1, STATEFUL_EXAMPLES // 2),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_grouped_world = GroupedWorld.TestCase
