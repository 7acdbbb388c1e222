"""The lend/reclaim state machine, driven directly: no VM, no cluster, no clock.

Four layers: one table row per transition; the refusals (illegal and stale events);
scenarios from the field (two owners at once, a reboot of a game VM, an owner asking
while the lendee boots, a lendee started by hand mid-game, an agent restarted in any
phase); and a randomised world that runs the machine's actions the way the executor
would and checks the invariants after every step.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import MappingProxyType

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
    TRANSITIONS,
    IllegalTransition,
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
    DetachFailed,
    CancelIntent,
    CancelRelend,
    CompleteIntent,
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
    Intent,
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
)
from tests.unit.machine_scaffold import (
    STATEFUL_EXAMPLES,
    AT,
    FAILED_WHY,
    HOOK,
    LENDEE,
    T,
    intent,
    wants,
)
from tests.unit.machine_world import (
    run,
    _observed,
    ABORTED,
    ALL,
    FORCE,
    G1,
    G1G2,
    go,
    OWNERS,
    POLICY,
    S,
    TOPO,
)


# --- one row per transition ------------------------------------------------------------
#
# (name, state, event, policy, expected phase, expected actions)

ROWS: list[tuple[str, State, Event, Policy, Phase, list[Action]]] = [
    # OFF
    (
        "off/wants: start the owner at once",
        S(),
        wants("gaming1"),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming1")],
    ),
    (
        "off/wants with a relend armed: cancel it",
        S(relend_at=120.0),
        wants("gaming1"),
        POLICY,
        Phase.OFF,
        [CancelRelend(), StartOwner(owner="gaming1")],
    ),
    (
        "off/wants while the lendee starts: wait, do not race it",
        S(lendee_starting=True),
        wants("gaming1"),
        POLICY,
        Phase.OFF,
        [],
    ),
    (
        "off/second caller for the same owner: one start",
        S(intents=G1),
        wants("gaming1", "i-2"),
        POLICY,
        Phase.OFF,
        [],
    ),
    (
        "off/wants an owner with GPUs of its own: relend stays armed",
        S(relend_at=120.0),
        wants("gaming3"),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming3")],
    ),
    (
        "off/wants an owner already running: done at once",
        S(running_owners=frozenset({"gaming1"})),
        wants("gaming1"),
        POLICY,
        Phase.OFF,
        [CompleteIntent(intent_id="i-gaming1", owner="gaming1")],
    ),
    (
        "off/lendee started: wait for its agent",
        S(),
        LendeeStarted(at=AT),
        POLICY,
        Phase.BOOTING,
        [WaitAgent(ticket=T + 1)],
    ),
    (
        "off/lendee started with an owner waiting: reclaim at once",
        S(lendee_starting=True, intents=G1),
        LendeeStarted(at=AT),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "off/lendee started by hand mid-game: reclaim it, gently",
        S(running_owners=frozenset({"gaming1"})),
        LendeeStarted(at=AT),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "off/lendee started by hand with a relend armed",
        S(relend_at=120.0),
        LendeeStarted(at=AT),
        POLICY,
        Phase.BOOTING,
        [CancelRelend(), WaitAgent(ticket=T + 1)],
    ),
    (
        "off/relend due: start the lendee",
        S(relend_at=AT),
        RelendDue(at=AT),
        POLICY,
        Phase.OFF,
        [StartLendee(gpus=ALL)],
    ),
    (
        "off/lendee start failed: no retry loop",
        S(lendee_starting=True),
        StartFailed(at=AT, vm=LENDEE, reason="no such device"),
        POLICY,
        Phase.OFF,
        [],
    ),
    (
        "off/lendee start failed: the waiting owner starts",
        S(lendee_starting=True, intents=G1),
        StartFailed(at=AT, vm=LENDEE, reason="no such device"),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming1")],
    ),
    (
        "off/owner start failed: fail its intent, lend again later",
        S(intents=G1),
        StartFailed(at=AT, vm="gaming1", reason="bad XML"),
        POLICY,
        Phase.OFF,
        [
            FailIntent(
                intent_id="i-gaming1", owner="gaming1", reason="gaming1 failed to start: bad XML"
            ),
            ScheduleRelend(at=AT + 30),
        ],
    ),
    (
        "off/owner started: complete its intent",
        S(intents=G1),
        OwnerStarted(at=AT, owner="gaming1"),
        POLICY,
        Phase.OFF,
        [CompleteIntent(intent_id="i-gaming1", owner="gaming1")],
    ),
    (
        "off/owner started by hand: cancel the relend",
        S(relend_at=120.0),
        OwnerStarted(at=AT, owner="gaming1"),
        POLICY,
        Phase.OFF,
        [CancelRelend()],
    ),
    (
        "off/last owner stopped: relend after the delay",
        S(running_owners=frozenset({"gaming1"})),
        OwnerStopped(at=AT, owner="gaming1"),
        POLICY,
        Phase.OFF,
        [ScheduleRelend(at=AT + 30)],
    ),
    (
        "off/an owner stopped, another still plays",
        S(running_owners=frozenset({"gaming1", "gaming2"})),
        OwnerStopped(at=AT, owner="gaming1"),
        POLICY,
        Phase.OFF,
        [],
    ),
    (
        "off/owner stopped, lending on hold",
        S(running_owners=frozenset({"gaming1"}), hold=True),
        OwnerStopped(at=AT, owner="gaming1"),
        POLICY,
        Phase.OFF,
        [],
    ),
    (
        "off/hold: cancel the relend",
        S(relend_at=120.0),
        Hold(at=AT),
        POLICY,
        Phase.OFF,
        [CancelRelend()],
    ),
    (
        "off/resume: lend now",
        S(hold=True),
        Resume(at=AT),
        POLICY,
        Phase.OFF,
        [ScheduleRelend(at=AT)],
    ),
    (
        "off/resume during a game: nothing to lend",
        S(hold=True, running_owners=frozenset({"gaming1"})),
        Resume(at=AT),
        POLICY,
        Phase.OFF,
        [],
    ),
    # BOOTING
    (
        "booting/agent up: rejoin the cluster",
        S(Phase.BOOTING),
        AgentUp(at=AT, ticket=T),
        POLICY,
        Phase.JOINING,
        [KubeReturn(ticket=T + 1)],
    ),
    (
        "booting/agent timeout: failed, left running",
        S(Phase.BOOTING),
        AgentTimeout(at=AT, ticket=T),
        POLICY,
        Phase.FAILED,
        [],
    ),
    (
        "booting/agent timeout never destroys, even with force_off",
        S(Phase.BOOTING),
        AgentTimeout(at=AT, ticket=T),
        FORCE,
        Phase.FAILED,
        [],
    ),
    (
        "booting/crashed: relend later",
        S(Phase.BOOTING),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [ScheduleRelend(at=AT + 30)],
    ),
    (
        "booting/wants: reclaim (drain first, the shutdown waits for the agent)",
        S(Phase.BOOTING),
        wants("gaming1"),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "booting/wants an owner with GPUs of its own",
        S(Phase.BOOTING),
        wants("gaming3"),
        POLICY,
        Phase.BOOTING,
        [StartOwner(owner="gaming3")],
    ),
    (
        "booting/owner appears by hand: reclaim",
        S(Phase.BOOTING),
        OwnerStarted(at=AT, owner="gaming1"),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "booting/unrelated owner starts",
        S(Phase.BOOTING),
        OwnerStarted(at=AT, owner="gaming3"),
        POLICY,
        Phase.BOOTING,
        [],
    ),
    # JOINING
    (
        "joining/return done: lent",
        S(Phase.JOINING),
        ReturnDone(at=AT, ticket=T),
        POLICY,
        Phase.LENT,
        [],
    ),
    (
        "joining/return failed: failed, stays cordoned",
        S(Phase.JOINING),
        ReturnFailed(at=AT, ticket=T, reason="2 of 3 GPUs"),
        POLICY,
        Phase.FAILED,
        [],
    ),
    (
        "joining/stopped",
        S(Phase.JOINING),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [ScheduleRelend(at=AT + 30)],
    ),
    (
        "joining/wants: reclaim",
        S(Phase.JOINING),
        wants("gaming2"),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    # LENT
    (
        "lent/wants: reclaim",
        S(Phase.LENT),
        wants("gaming1"),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "lent/stopped by hand: relend later",
        S(Phase.LENT),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [ScheduleRelend(at=AT + 30)],
    ),
    (
        "lent/stopped on hold: stays off",
        S(Phase.LENT, hold=True),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [],
    ),
    ("lent/hold: stays lent", S(Phase.LENT), Hold(at=AT), POLICY, Phase.LENT, []),
    (
        "lent/resume: nothing to retry",
        S(Phase.LENT, hold=True),
        Resume(at=AT),
        POLICY,
        Phase.LENT,
        [],
    ),
    (
        "lent/unrelated owner stops",
        S(Phase.LENT, running_owners=frozenset({"gaming3"})),
        OwnerStopped(at=AT, owner="gaming3"),
        POLICY,
        Phase.LENT,
        [],
    ),
    # DRAINING
    (
        "draining/drained: wait for the agent again",
        S(Phase.DRAINING, intents=G1),
        Drained(at=AT, ticket=T),
        POLICY,
        Phase.STOPPING,
        [WaitAgent(ticket=T + 1)],
    ),
    (
        "draining/drain aborted: requests fail, back to lending through the agent",
        S(Phase.DRAINING, intents=G1),
        DrainFailed(at=AT, ticket=T, reason="PDB"),
        POLICY,
        Phase.BOOTING,
        [FailIntent(intent_id=G1[0].id, owner="gaming1", reason=ABORTED), WaitAgent(ticket=T + 1)],
    ),
    (
        "draining/drain aborted, agent up: requests fail, node returned",
        S(Phase.DRAINING, intents=G1, agent_up=True),
        DrainFailed(at=AT, ticket=T, reason="PDB"),
        POLICY,
        Phase.JOINING,
        [FailIntent(intent_id=G1[0].id, owner="gaming1", reason=ABORTED), KubeReturn(ticket=T + 1)],
    ),
    (
        "draining/second owner joins the reclaim",
        S(Phase.DRAINING, intents=G1),
        wants("gaming2"),
        POLICY,
        Phase.DRAINING,
        [],
    ),
    (
        "draining/stopped: start the waiting owner",
        S(Phase.DRAINING, intents=G1),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming1")],
    ),
    (
        "draining/owner start failed because the lendee runs: intent kept",
        S(Phase.DRAINING, intents=G1),
        StartFailed(at=AT, vm="gaming1", reason="in use"),
        POLICY,
        Phase.DRAINING,
        [],
    ),
    # STOPPING
    (
        "stopping/agent up: now the shutdown",
        S(Phase.STOPPING, intents=G1),
        AgentUp(at=AT, ticket=T),
        POLICY,
        Phase.STOPPING,
        [ShutdownLendee(ticket=T)],
    ),
    (
        "stopping/agent timeout: failed, never destroyed",
        S(Phase.STOPPING, intents=G1),
        AgentTimeout(at=AT, ticket=T),
        POLICY,
        Phase.FAILED,
        [],
    ),
    (
        "stopping/agent timeout with force_off: destroy",
        S(Phase.STOPPING, intents=G1),
        AgentTimeout(at=AT, ticket=T),
        FORCE,
        Phase.STOPPING,
        [ForceOff(ticket=T)],
    ),
    (
        "stopping/shutdown ignored: failed",
        S(Phase.STOPPING, intents=G1, agent_up=True, shutdown_sent=True),
        ShutdownTimeout(at=AT, ticket=T),
        POLICY,
        Phase.FAILED,
        [],
    ),
    (
        "stopping/shutdown ignored with force_off: destroy",
        S(Phase.STOPPING, intents=G1, agent_up=True, shutdown_sent=True),
        ShutdownTimeout(at=AT, ticket=T),
        FORCE,
        Phase.STOPPING,
        [ForceOff(ticket=T)],
    ),
    (
        "stopping/stopped: every waiting owner starts, once each",
        S(Phase.STOPPING, intents=(*G1G2, intent("gaming1", "i-again"))),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming1"), StartOwner(owner="gaming2")],
    ),
    (
        "stopping/second owner joins",
        S(Phase.STOPPING, intents=G1),
        wants("gaming2"),
        POLICY,
        Phase.STOPPING,
        [],
    ),
    # FAILED
    (
        "failed/wants: retry the reclaim",
        S(Phase.FAILED, reason=FAILED_WHY),
        wants("gaming1"),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "failed/stopped by hand: the waiting owner starts",
        S(Phase.FAILED, reason=FAILED_WHY, intents=G1),
        LendeeStopped(at=AT),
        POLICY,
        Phase.OFF,
        [StartOwner(owner="gaming1")],
    ),
    (
        "failed/resume with owners waiting: retry the reclaim",
        S(Phase.FAILED, reason=FAILED_WHY, intents=G1),
        Resume(at=AT),
        POLICY,
        Phase.DRAINING,
        [Drain(ticket=T + 1)],
    ),
    (
        "failed/resume, nobody waiting: retry the return",
        S(Phase.FAILED, reason=FAILED_WHY),
        Resume(at=AT),
        POLICY,
        Phase.BOOTING,
        [WaitAgent(ticket=T + 1)],
    ),
    ("failed/hold", S(Phase.FAILED, reason=FAILED_WHY), Hold(at=AT), POLICY, Phase.FAILED, []),
    (
        "failed/owner appears by hand: no action of its own",
        S(Phase.FAILED, reason=FAILED_WHY, intents=G1),
        OwnerStarted(at=AT, owner="gaming1"),
        POLICY,
        Phase.FAILED,
        [CompleteIntent(intent_id="i-gaming1", owner="gaming1")],
    ),
]


def _reclaim_row(phase: Phase, base: State) -> tuple[str, State, Event, Policy, Phase, list[Action]]:
    """A reclaim by hand: the lendee's running phases take the drain road; a reclaim
    under way, or an off lendee, only gains the hold."""
    if phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT, Phase.FAILED):
        return (f"{phase}/reclaim: drained", base, Reclaim(at=AT), POLICY, Phase.DRAINING,
                [Drain(ticket=T + 1)])
    return (f"{phase}/reclaim: held", base, Reclaim(at=AT), POLICY, phase, [])


def _shared_rows() -> list[tuple[str, State, Event, Policy, Phase, list[Action]]]:
    """The every-phase rules, in every phase, with gaming3: an owner that shares no GPU
    with the lendee, so whatever the lendee does, it is started and stopped at once."""
    rows: list[tuple[str, State, Event, Policy, Phase, list[Action]]] = []
    g3 = (intent("gaming3"),)
    for phase in Phase:
        base = S(phase, reason=FAILED_WHY if phase is Phase.FAILED else None)
        off = phase is Phase.OFF
        relend: list[Action] = [ScheduleRelend(at=AT + 30)] if off else []
        rows += [
            (
                f"{phase}/wants gaming3: started at once",
                base,
                wants("gaming3"),
                POLICY,
                phase,
                [StartOwner(owner="gaming3")],
            ),
            (
                f"{phase}/gaming3 started",
                replace(base, intents=g3),
                OwnerStarted(at=AT, owner="gaming3"),
                POLICY,
                phase,
                [CompleteIntent(intent_id="i-gaming3", owner="gaming3")],
            ),
            (
                f"{phase}/gaming3 stopped",
                replace(base, running_owners=frozenset({"gaming3"})),
                OwnerStopped(at=AT, owner="gaming3"),
                POLICY,
                phase,
                relend,
            ),
            (
                f"{phase}/gaming3 failed to start",
                replace(base, intents=g3),
                StartFailed(at=AT, vm="gaming3", reason="x"),
                POLICY,
                phase,
                [
                    FailIntent(
                        intent_id="i-gaming3", owner="gaming3", reason="gaming3 failed to start: x"
                    ),
                    *relend,
                ],
            ),
            (f"{phase}/hold", base, Hold(at=AT), POLICY, phase, []),
            _reclaim_row(phase, base),
        ]
        if phase is not Phase.FAILED:  # FAILED retries on resume: rows above
            rows.append(
                (
                    f"{phase}/resume",
                    replace(base, hold=True),
                    Resume(at=AT),
                    POLICY,
                    phase,
                    [ScheduleRelend(at=AT)] if off else [],
                )
            )
    return rows


ROWS += _shared_rows()


@pytest.mark.parametrize(
    ("state", "event", "policy", "phase", "actions"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_transition(
    state: State, event: Event, policy: Policy, phase: Phase, actions: list[Action]
) -> None:
    new, got = go(state, event, policy)
    assert (new.phase, got) == (phase, actions)
    assert (new.ticket != state.ticket) == (new.phase != state.phase)
    if new.phase is Phase.FAILED:
        assert new.reason


def test_every_legal_pair_has_a_row_or_a_scenario() -> None:
    """The table is the machine: this is its whole shape, reviewed here on purpose."""
    every = {OwnerWants, OwnerStarted, OwnerStopped, StartFailed, Hold, Resume, Reclaim,
             Observed, OwnerStarting, CancelIntent, GpuPods, Reserve, VmStopped, GroupsTaken}
    running_stop = {LendeeStopped}
    expected = {
        Phase.OFF: every | {RelendDue, LendeeStarted, GroupsHeld},
        Phase.BOOTING: every | running_stop | {AgentUp, AgentTimeout},
        Phase.JOINING: every | running_stop | {ReturnDone, ReturnFailed},
        Phase.LENT: every | running_stop | {RelendDue, GpusAttached, AttachFailed,
                                            GpusDetached, DetachFailed, GroupsHeld},
        Phase.DRAINING: every | running_stop | {Drained, DrainFailed},
        Phase.STOPPING: every | running_stop | {AgentUp, AgentTimeout, ShutdownTimeout},
        Phase.FAILED: every | running_stop,
    }
    got: dict[Phase, set[type[Event]]] = {p: set() for p in Phase}
    for phase, event_type in TRANSITIONS:
        got[phase].add(event_type)
    assert got == expected
    assert isinstance(TRANSITIONS, MappingProxyType)
    covered = {(row[1].phase, type(row[2])) for row in ROWS}
    # Observed is covered by its own tests below, the events of partial lending (and a
    # regrow due in LENT) in test_partial.py, those of a hot-add in test_hotplug.py and
    # of a hot-unplug in test_unplug.py, reservations in test_reserve.py, IOMMU groups
    # another VM holds in test_iommu.py; the rest must each have a row.
    partial = {Observed, OwnerStarting, CancelIntent, GpuPods, GpusAttached, AttachFailed,
               GpusDetached, DetachFailed, Reserve, GroupsHeld, VmStopped, GroupsTaken}
    rest = {k for k in TRANSITIONS if k[1] not in partial and k != (Phase.LENT, RelendDue)}
    assert rest <= covered


# --- refusals --------------------------------------------------------------------------

EXAMPLES: list[Event] = [
    wants("gaming1"),
    OwnerStarted(at=AT, owner="gaming1"),
    OwnerStopped(at=AT, owner="gaming1"),
    LendeeStarted(at=AT),
    LendeeStopped(at=AT),
    AgentUp(at=AT, ticket=T),
    AgentTimeout(at=AT, ticket=T),
    Drained(at=AT, ticket=T),
    DrainFailed(at=AT, ticket=T, reason="x"),
    ShutdownTimeout(at=AT, ticket=T),
    ReturnDone(at=AT, ticket=T),
    ReturnFailed(at=AT, ticket=T, reason="x"),
    RelendDue(at=AT),
    StartFailed(at=AT, vm=LENDEE, reason="x"),
    Hold(at=AT),
    Resume(at=AT),
    Reclaim(at=AT),
    Observed(at=AT, lendee_running=False, owners_running=frozenset()),
    OwnerStarting(at=AT, owner="gaming1"),
    CancelIntent(at=AT, owner="gaming1", by="alice"),
    GpuPods(at=AT, count=0),
    GpusAttached(at=AT, ticket=T, gpus=frozenset({"gpu-a"})),
    AttachFailed(at=AT, ticket=T, gpus=frozenset({"gpu-a"}), held=frozenset(), reason="x"),
    GpusDetached(at=AT, ticket=T, gpus=frozenset({"gpu-a"})),
    DetachFailed(at=AT, ticket=T, gpus=frozenset({"gpu-a"}), reason="x"),
    Reserve(at=AT, reservations=()),
    GroupsHeld(at=AT, ticket=T, gpus=frozenset({"gpu-a"}), held={"gpu-a": "usbvm"}, reason="x"),
    VmStopped(at=AT, vm="usbvm"),
    GroupsTaken(at=AT, held={"gpu-a": "usbvm"}),
]


def test_examples_cover_every_event_type() -> None:
    assert {type(e) for e in EXAMPLES} == set(Event.__subclasses__())


ILLEGAL = [
    (phase, event)
    for phase in Phase
    for event in EXAMPLES
    if (phase, type(event)) not in TRANSITIONS
]


@pytest.mark.parametrize(
    ("phase", "event"), ILLEGAL, ids=[f"{p}/{type(e).__name__}" for p, e in ILLEGAL]
)
def test_illegal_transition_raises_and_changes_nothing(phase: Phase, event: Event) -> None:
    state = S(phase, reason=FAILED_WHY if phase is Phase.FAILED else None)
    before = replace(state)
    with pytest.raises(IllegalTransition) as info:
        go(state, event)
    assert state == before
    assert (info.value.phase, info.value.event) == (phase, event)
    assert str(info.value) == (
        f"{type(event).__name__} refused in phase {phase}: no rule for it in this phase"
    )


STALE: list[tuple[str, State, Event, str]] = [
    (
        "report of an earlier phase",
        S(Phase.BOOTING),
        AgentUp(at=AT, ticket=T - 1),
        "stale report (ticket 6, now 7)",
    ),
    (
        "boot-time wait timing out during the shutdown",
        S(Phase.STOPPING, intents=G1),
        AgentTimeout(at=AT, ticket=T - 2),
        "stale report (ticket 5, now 7)",
    ),
    (
        "drain report after a new reclaim",
        S(Phase.DRAINING, intents=G1),
        Drained(at=AT, ticket=T - 1),
        "stale report (ticket 6, now 7)",
    ),
    (
        "return report after a restart",
        S(Phase.JOINING),
        ReturnFailed(at=AT, ticket=3, reason="x"),
        "stale report (ticket 3, now 7)",
    ),
    (
        "second AgentUp after the shutdown was sent",
        S(Phase.STOPPING, agent_up=True, shutdown_sent=True),
        AgentUp(at=AT, ticket=T),
        "the shutdown was already sent",
    ),
    (
        "AgentTimeout after the agent answered",
        S(Phase.STOPPING, agent_up=True, shutdown_sent=True),
        AgentTimeout(at=AT, ticket=T),
        "the agent already answered",
    ),
    (
        "ShutdownTimeout with no shutdown sent",
        S(Phase.STOPPING),
        ShutdownTimeout(at=AT, ticket=T),
        "no shutdown was sent",
    ),
    ("relend timer cancelled", S(), RelendDue(at=AT), "no relend is scheduled"),
    (
        "lendee start failure with no start in flight",
        S(),
        StartFailed(at=AT, vm=LENDEE, reason="x"),
        "no start of gpu-node is in flight",
    ),
    ("regrow due with none scheduled", S(Phase.LENT), RelendDue(at=AT),
     "no regrow is scheduled"),
    (
        "lendee start failure while it runs",
        S(Phase.BOOTING),
        StartFailed(at=AT, vm=LENDEE, reason="x"),
        "no start of gpu-node is in flight",
    ),
    (
        "owner start failure nobody asked for",
        S(),
        StartFailed(at=AT, vm="gaming1", reason="x"),
        "no start of gaming1 was requested",
    ),
    (
        "owner started twice",
        S(running_owners=frozenset({"gaming1"})),
        OwnerStarted(at=AT, owner="gaming1"),
        "gaming1 is already running",
    ),
    ("owner stopped twice", S(), OwnerStopped(at=AT, owner="gaming1"), "gaming1 was not running"),
    ("intent replayed", S(intents=G1), wants("gaming1"), "intent i-gaming1 is already pending"),
    ("unknown owner", S(), wants("desktop"), "desktop is not an owner VM in the topology"),
    (
        "unknown owner started",
        S(Phase.LENT),
        OwnerStarted(at=AT, owner="desktop"),
        "desktop is not an owner VM in the topology",
    ),
    (
        "unknown VM failed to start",
        S(),
        StartFailed(at=AT, vm="desktop", reason="x"),
        "desktop is not an owner VM in the topology",
    ),
    (
        "unknown owner observed",
        S(),
        Observed(at=AT, lendee_running=False, owners_running=frozenset({"desktop"})),
        "desktop is not an owner VM in the topology",
    ),
]


@pytest.mark.parametrize(
    ("state", "event", "why"), [r[1:] for r in STALE], ids=[r[0] for r in STALE]
)
def test_stale_event_raises_with_its_reason(state: State, event: Event, why: str) -> None:
    before = replace(state)
    with pytest.raises(IllegalTransition) as info:
        go(state, event)
    assert info.value.why == why
    # The refusal names the event and the phase it came in (the journal's record).
    assert (info.value.phase, info.value.event) == (state.phase, event)
    assert str(info.value) == f"{type(event).__name__} refused in phase {state.phase}: {why}"
    assert state == before


# --- decisions worth a test of their own -----------------------------------------------


def test_intent_is_recorded_with_its_origin() -> None:
    event = OwnerWants(at=AT, owner="gaming1", intent_id="abc", source=IntentSource.CONTROL)
    new, _ = go(S(Phase.LENT), event)
    assert new.intents == (
        Intent(id="abc", owner="gaming1", created_at=AT, source=IntentSource.CONTROL),
    )


def test_a_second_request_for_an_owner_joins_its_intent() -> None:
    """Asked again (a second caller, or one that asks and hangs up in a loop): one
    intent, nothing more to keep or to write, and the owner started once."""
    state, actions = run(
        S(Phase.LENT),
        wants("gaming1", "first"),
        wants("gaming1", "second", at=AT + 1),
        wants("gaming1", "third", at=AT + 2),
    )
    assert actions == [Drain(ticket=T + 1)]
    assert [i.id for i in state.intents] == ["first"]
    assert go(state, wants("gaming1", "fourth", at=AT + 3)) == (state, [])
    _, done = run(
        state,
        Drained(at=AT + 10, ticket=T + 1),
        AgentUp(at=AT + 11, ticket=T + 2),
        LendeeStopped(at=AT + 13),
        OwnerStarted(at=AT + 15, owner="gaming1"),
    )
    assert done == [
        WaitAgent(ticket=T + 2),
        ShutdownLendee(ticket=T + 2),
        StartOwner(owner="gaming1"),
        CompleteIntent(intent_id="first", owner="gaming1"),
    ]


def test_two_callers_for_one_owner_both_fail_with_the_reason() -> None:
    state = S(intents=(intent("gaming1", "first"), intent("gaming1", "second")))
    _, actions = go(state, StartFailed(at=AT, vm="gaming1", reason="no such domain"))
    assert actions == [
        FailIntent(
            intent_id="first", owner="gaming1", reason="gaming1 failed to start: no such domain"
        ),
        FailIntent(
            intent_id="second", owner="gaming1", reason="gaming1 failed to start: no such domain"
        ),
        ScheduleRelend(at=AT + 30),
    ]


@pytest.mark.parametrize(("sent", "event", "what"), [
    (False, AgentTimeout(at=AT, ticket=T), "its guest agent never answered guest-ping"),
    (True, ShutdownTimeout(at=AT, ticket=T), "it did not stop after a guest-agent shutdown"),
])
def test_a_lendee_that_cannot_be_shut_down_says_why_whole(sent: bool, event: Event,
                                                          what: str) -> None:
    stuck, actions = go(S(Phase.STOPPING, intents=G1, agent_up=sent, shutdown_sent=sent), event)
    assert (stuck.phase, actions) == (Phase.FAILED, [])
    assert stuck.reason == (
        f"gpu-node cannot be shut down cleanly: {what}; hostagent never destroys it unless "
        "force_off_after is set: stop it by hand (virsh shutdown gpu-node) and the waiting "
        "VMs start")


def test_a_lendee_that_boots_without_its_agent_or_comes_back_short_says_why_whole() -> None:
    silent, _ = go(S(Phase.BOOTING), AgentTimeout(at=AT, ticket=T))
    assert (silent.phase, silent.reason) == (Phase.FAILED, (
        "gpu-node's guest agent did not answer guest-ping after it started; it keeps running "
        "but is not lent (is qemu-guest-agent running in the guest?)"))
    short, _ = go(S(Phase.JOINING), ReturnFailed(at=AT, ticket=T, reason="2 of 3 GPUs"))
    assert (short.phase, short.reason) == (Phase.FAILED, (
        "gpu-node did not come back whole: 2 of 3 GPUs; the node stays cordoned (`hostagent "
        "resume` retries)"))


@pytest.mark.parametrize("phase", [Phase.LENT, Phase.STOPPING, Phase.FAILED])
def test_a_stopped_lendee_leaves_nothing_of_its_run_behind(phase: Phase) -> None:
    running = S(phase, agent_up=True, reason="old", reclaiming=True, regrow_waiting=True,
                hotadd_failed=True, unplug_failed=True, unplug_stuck=True)
    new, _ = go(running, LendeeStopped(at=AT))
    assert (new.phase, new.agent_up, new.reason, new.lent, new.reclaiming,
            new.regrow_waiting, new.hotadd_failed, new.unplug_failed, new.unplug_stuck) == (
        Phase.OFF, False, None, frozenset(), False, False, False, False, False)
    assert all(type(v) is bool for v in (new.agent_up, new.reclaiming, new.hotadd_failed,
                                         new.unplug_failed, new.unplug_stuck))


@pytest.mark.parametrize("intents", [(), G1], ids=["lent", "reclaimed at once"])
def test_a_started_lendee_begins_with_no_agent_and_no_old_reason(
        intents: tuple[Intent, ...]) -> None:
    # What the state said of a former run (read back after a restart) is not this one's.
    off = S(lendee_starting=True, intents=intents, agent_up=True, reason="old")
    new, _ = go(off, LendeeStarted(at=AT))
    assert new.phase is (Phase.DRAINING if intents else Phase.BOOTING)
    assert (new.agent_up, new.reason, new.lendee_starting) == (False, None, False)
    assert type(new.agent_up) is bool


@pytest.mark.parametrize("replug", [False, True])
def test_the_agent_answering_a_boot_is_remembered(replug: bool) -> None:
    # replug: a boot whose GPUs changed live before, whose plugins restart on the return.
    new, actions = go(S(Phase.BOOTING, replug=replug), AgentUp(at=AT, ticket=T))
    assert (new.phase, new.agent_up, actions) == (
        Phase.JOINING, True, [KubeReturn(ticket=T + 1, restart_plugins=replug)])
    assert new.agent_up is True


def test_failed_reasons_say_what_to_do() -> None:
    stuck, _ = go(S(Phase.STOPPING, intents=G1), AgentTimeout(at=AT, ticket=T))
    assert stuck.reason is not None
    assert "guest agent never answered" in stuck.reason
    assert "virsh shutdown gpu-node" in stuck.reason
    assert "force_off_after" in stuck.reason
    assert stuck.intents == G1  # the player's request is not lost
    short, _ = go(S(Phase.JOINING), ReturnFailed(at=AT, ticket=T, reason="2 of 3 GPUs"))
    assert short.reason is not None and "2 of 3 GPUs" in short.reason
    assert "cordoned" in short.reason
    off, _ = go(S(lendee_starting=True), StartFailed(at=AT, vm=LENDEE, reason="IOMMU"))
    assert off.reason is not None and "IOMMU" in off.reason
    assert off.phase is Phase.OFF and not off.lendee_starting


def test_relend_resumes_after_a_lendee_start_failure_when_an_owner_stops() -> None:
    state = S(lendee_starting=True, running_owners=frozenset({"gaming3"}))
    state, actions = run(
        state,
        StartFailed(at=AT, vm=LENDEE, reason="IOMMU"),
        OwnerStopped(at=AT + 60, owner="gaming3"),
    )
    assert actions == [ScheduleRelend(at=AT + 90)]
    state, actions = go(state, RelendDue(at=AT + 90))
    assert actions == [StartLendee(gpus=ALL)]
    state, _ = go(state, LendeeStarted(at=AT + 91))
    assert state.reason is None


def test_resume_retries_a_failed_lendee_start_at_once() -> None:
    state, _ = go(S(lendee_starting=True), StartFailed(at=AT, vm=LENDEE, reason="IOMMU"))
    _, actions = go(state, Resume(at=AT + 5))
    assert actions == [ScheduleRelend(at=AT + 5)]


def test_an_unrelated_owner_stopping_does_not_push_the_relend_back() -> None:
    state = S(relend_at=AT + 10, running_owners=frozenset({"gaming3"}))
    new, actions = go(state, OwnerStopped(at=AT, owner="gaming3"))
    assert (new.relend_at, actions) == (AT + 10, [])


def test_hold_stops_the_next_lend_but_not_a_reclaim() -> None:
    state, actions = run(
        S(Phase.LENT),
        Hold(at=AT),
        wants("gaming1"),
        Drained(at=AT + 10, ticket=T + 1),
        AgentUp(at=AT + 11, ticket=T + 2),
        LendeeStopped(at=AT + 12),
        OwnerStarted(at=AT + 20, owner="gaming1"),
        OwnerStopped(at=AT + 3600, owner="gaming1"),
    )
    assert StartOwner(owner="gaming1") in actions
    assert not any(isinstance(a, (ScheduleRelend, StartLendee)) for a in actions)
    state, actions = go(state, Resume(at=AT + 4000))
    assert actions == [ScheduleRelend(at=AT + 4000)]
    assert not state.hold


def test_reclaim_by_hand_takes_the_gentle_road_and_keeps_the_lendee_off() -> None:
    # From LENT: drain, a fresh wait for the agent, its shutdown; then nobody starts
    # and nothing is lent again until resume, which lends at once.
    state, actions = run(
        S(Phase.LENT),
        Reclaim(at=AT),
        Drained(at=AT + 5, ticket=T + 1),
        AgentUp(at=AT + 6, ticket=T + 2),
        LendeeStopped(at=AT + 8),
    )
    assert actions == [Drain(ticket=T + 1), WaitAgent(ticket=T + 2), ShutdownLendee(ticket=T + 2)]
    assert (state.phase, state.hold, state.relend_at, state.intents) == (Phase.OFF, True, None, ())
    state, actions = go(state, Resume(at=AT + 100))
    assert actions == [ScheduleRelend(at=AT + 100)]
    assert not state.hold


def test_reclaim_by_hand_while_off_cancels_the_scheduled_relend() -> None:
    state, actions = go(S(relend_at=AT + 20), Reclaim(at=AT))
    assert actions == [CancelRelend()]
    assert state.hold and state.relend_at is None and state.phase is Phase.OFF


def test_reclaim_by_hand_during_a_lendee_start_is_kept_by_the_machine() -> None:
    # The start in flight lands after the caller stopped waiting (a timeout, Ctrl-C, an
    # SSH client gone, an agent restart): the machine reclaims it by itself, and a start
    # that fails instead leaves nothing under way.
    starting = S(lendee_starting=True, lent=TOPO.lendee_gpus)
    state, actions = run(starting, Reclaim(at=AT), LendeeStarted(at=AT + 1))
    assert (state.phase, state.hold, actions) == (Phase.DRAINING, True, [Drain(ticket=T + 1)])
    state, actions = run(starting, Reclaim(at=AT), StartFailed(at=AT + 1, vm=LENDEE, reason="x"))
    assert (state.phase, state.hold, state.reclaiming) == (Phase.OFF, True, False)


def test_reclaim_by_hand_joins_an_owner_and_the_owner_still_starts() -> None:
    # An owner asked first; the operator reclaims too: one drain, the owner starts when
    # the lendee is off, and the lendee stays off after the game (hold).
    state, actions = run(
        S(Phase.LENT),
        wants("gaming1"),
        Reclaim(at=AT + 1),
        Drained(at=AT + 5, ticket=T + 1),
        AgentUp(at=AT + 6, ticket=T + 2),
        LendeeStopped(at=AT + 8),
        OwnerStarted(at=AT + 10, owner="gaming1"),
        OwnerStopped(at=AT + 500, owner="gaming1"),
    )
    assert actions.count(Drain(ticket=T + 1)) == 1
    assert StartOwner(owner="gaming1") in actions
    assert not any(isinstance(a, (ScheduleRelend, StartLendee)) for a in actions)
    assert state.hold and state.phase is Phase.OFF


def test_holding_twice_changes_nothing() -> None:
    state = S(Phase.LENT, hold=True)
    assert go(state, Hold(at=AT)) == (state, [])


@pytest.mark.parametrize("late", [0.0, 2.5, -0.004], ids=["on time", "late", "clock skew"])
def test_relend_due_starts_the_lendee(late: float) -> None:
    # Timers run on a monotonic clock, events are stamped with wall time: a timer that
    # seems to fire a few milliseconds early is still the relend.
    state, actions = go(S(relend_at=AT), RelendDue(at=AT + late))
    assert actions == [StartLendee(gpus=ALL)]
    assert state.lendee_starting and state.relend_at is None and state.phase is Phase.OFF


def test_reclaim_is_finished_even_when_the_reason_went_away() -> None:
    # The owner appeared by hand and stopped again during the drain: the drain is
    # still completed and the lendee shut down, then lent again after the delay.
    state, actions = run(
        S(Phase.LENT),
        OwnerStarted(at=AT, owner="gaming1"),
        OwnerStopped(at=AT + 1, owner="gaming1"),
        Drained(at=AT + 5, ticket=T + 1),
        AgentUp(at=AT + 6, ticket=T + 2),
        LendeeStopped(at=AT + 8),
    )
    assert actions == [
        Drain(ticket=T + 1),
        WaitAgent(ticket=T + 2),
        ShutdownLendee(ticket=T + 2),
        ScheduleRelend(at=AT + 38),
    ]


# --- scenarios -------------------------------------------------------------------------


def test_two_owners_within_100_ms_share_one_reclaim() -> None:
    state, actions = run(
        S(Phase.LENT),
        OwnerWants(at=AT, owner="gaming1", intent_id="a", source=HOOK),
        OwnerWants(at=AT + 0.1, owner="gaming2", intent_id="b", source=IntentSource.CONTROL),
    )
    assert actions == [Drain(ticket=T + 1)]
    assert verdict(state, "gaming2", topo=TOPO)[0] == "defer"
    state, actions = run(
        state,
        Drained(at=AT + 20, ticket=T + 1),
        AgentUp(at=AT + 21, ticket=T + 2),
    )
    assert actions == [WaitAgent(ticket=T + 2), ShutdownLendee(ticket=T + 2)]
    state, actions = go(state, LendeeStopped(at=AT + 23))
    assert actions == [StartOwner(owner="gaming1"), StartOwner(owner="gaming2")]
    assert verdict(state, "gaming1", topo=TOPO)[0] == "proceed"
    assert verdict(state, "gaming2", topo=TOPO)[0] == "proceed"
    assert verdict(state, LENDEE, topo=TOPO)[0] == "defer"
    state, actions = run(
        state,
        OwnerStarted(at=AT + 30, owner="gaming2"),
        OwnerStarted(at=AT + 31, owner="gaming1"),
    )
    assert actions == [
        CompleteIntent(intent_id="b", owner="gaming2"),
        CompleteIntent(intent_id="a", owner="gaming1"),
    ]
    assert state.intents == () and state.relend_at is None


def test_owner_reboot_within_relend_delay_never_lends() -> None:
    state = S(running_owners=frozenset({"gaming1"}))
    state, actions = go(state, OwnerStopped(at=AT, owner="gaming1"))
    assert actions == [ScheduleRelend(at=AT + 30)]
    # The game VM comes back 10 s later through `virsh start` (the hook lets it pass).
    assert verdict(state, "gaming1", topo=TOPO)[0] == "proceed"
    state, actions = go(state, OwnerStarted(at=AT + 10, owner="gaming1"))
    assert actions == [CancelRelend()]
    # The timer's event, already queued when it was cancelled, is refused.
    with pytest.raises(IllegalTransition):
        go(state, RelendDue(at=AT + 30))


def test_owner_restart_through_the_control_socket_within_relend_delay() -> None:
    state, actions = run(
        S(running_owners=frozenset({"gaming1"})),
        OwnerStopped(at=AT, owner="gaming1"),
        wants("gaming1", at=AT + 10),
        OwnerStarted(at=AT + 12, owner="gaming1"),
    )
    assert actions == [
        ScheduleRelend(at=AT + 30),
        CancelRelend(),
        StartOwner(owner="gaming1"),
        CompleteIntent(intent_id="i-gaming1", owner="gaming1"),
    ]
    assert not any(isinstance(a, StartLendee) for a in actions)


def test_owner_wants_while_the_lendee_boots_never_shuts_down_before_agent_up() -> None:
    state, actions = run(S(relend_at=AT), RelendDue(at=AT), LendeeStarted(at=AT + 1))
    assert actions == [StartLendee(gpus=ALL), WaitAgent(ticket=T + 1)]
    boot_wait = T + 1
    state, actions = go(state, wants("gaming1", at=AT + 5))
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 2)])
    state, actions = go(state, Drained(at=AT + 6, ticket=T + 2))
    assert actions == [WaitAgent(ticket=T + 3)]
    # The boot-time wait gives up while the new one still waits: stale, refused.
    with pytest.raises(IllegalTransition):
        go(state, AgentTimeout(at=AT + 7, ticket=boot_wait))
    assert state.phase is Phase.STOPPING and not state.shutdown_sent
    state, actions = go(state, AgentUp(at=AT + 40, ticket=T + 3))
    assert actions == [ShutdownLendee(ticket=T + 3)]
    state, actions = go(state, LendeeStopped(at=AT + 42))
    assert actions == [StartOwner(owner="gaming1")]


def test_owner_wants_while_a_lendee_start_is_in_flight() -> None:
    state, _ = go(S(relend_at=AT), RelendDue(at=AT))
    decision, message = verdict(state, "gaming1", topo=TOPO)
    assert decision == "defer" and "is starting" in message
    state, actions = go(state, wants("gaming1", at=AT + 0.5))
    assert actions == []  # no StartOwner racing the StartLendee for gpu-a
    # Either the lendee starts, and is reclaimed before it is ever lent ...
    started, actions = go(state, LendeeStarted(at=AT + 1))
    assert (started.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 1)])
    # ... or its start fails, and the owner starts at once.
    failed, actions = go(state, StartFailed(at=AT + 1, vm=LENDEE, reason="x"))
    assert (failed.phase, actions) == (Phase.OFF, [StartOwner(owner="gaming1")])


def test_lendee_started_by_hand_mid_game_is_deferred() -> None:
    state = S(running_owners=frozenset({"gaming1"}))
    decision, message = verdict(state, LENDEE, topo=TOPO)
    assert decision == "defer"
    assert message == (
        "gpu-node's GPUs are in use by gaming1; hostagent lends it what is free by itself, "
        f"and the rest when that VM stops ({FOLLOW})"
    )
    # Nothing is recorded: the lend after the game is automatic anyway.
    assert go(state, OwnerStopped(at=AT, owner="gaming1"))[1] == [ScheduleRelend(at=AT + 30)]


def test_stuck_shutdown_waits_for_a_human_then_the_game_starts() -> None:
    state, actions = run(
        S(Phase.LENT),
        wants("gaming1"),
        Drained(at=AT + 5, ticket=T + 1),
        AgentTimeout(at=AT + 185, ticket=T + 2),
    )
    assert state.phase is Phase.FAILED
    assert not any(isinstance(a, (ShutdownLendee, ForceOff)) for a in actions)
    decision, message = verdict(state, "gaming1", topo=TOPO)
    assert decision == "defer" and "is stuck" in message
    # The administrator shuts it down from inside; the game starts by itself.
    state, actions = go(state, LendeeStopped(at=AT + 600))
    assert actions == [StartOwner(owner="gaming1")]


def test_an_aborted_drain_answers_the_player_and_asking_again_retries() -> None:
    state, _ = run(
        S(Phase.LENT),
        wants("gaming1", "first"),
        DrainFailed(at=AT + 300, ticket=T + 1, reason="a PodDisruptionBudget blocks"),
    )
    assert (state.phase, state.intents) == (Phase.JOINING, ())
    state, _ = go(state, ReturnDone(at=AT + 310, ticket=T + 2))
    assert state.phase is Phase.LENT
    state, actions = go(state, wants("gaming1", "second", at=AT + 400))
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=T + 4)])
    assert [i.id for i in state.intents] == ["second"]


# --- Observed: an agent restarted in any phase ------------------------------------------

BEFORE_RESTART = {
    Phase.OFF: S(relend_at=AT + 20),
    Phase.BOOTING: S(Phase.BOOTING),
    Phase.JOINING: S(Phase.JOINING),
    Phase.LENT: S(Phase.LENT),
    Phase.DRAINING: S(Phase.DRAINING, intents=G1),
    Phase.STOPPING: S(Phase.STOPPING, intents=G1, agent_up=True, shutdown_sent=True),
    Phase.FAILED: S(Phase.FAILED, intents=G1, reason=FAILED_WHY),
}


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("lendee_running", [True, False], ids=["running", "off"])
@pytest.mark.parametrize("fresh", [False, True], ids=["remembered", "fresh"])
def test_observed_resumes_from_every_phase(phase: Phase, lendee_running: bool, fresh: bool) -> None:
    """After a reconnect the whole state is there; after a restart only what was
    persisted (intents and hold). Either way reality decides the phase."""
    state = BEFORE_RESTART[phase]
    if fresh:
        state = State(intents=state.intents, hold=state.hold)
    new, actions = go(state, _observed(lendee_running))
    waiting = bool(state.intents)
    assert new.intents == state.intents
    assert not new.lendee_starting and not new.shutdown_sent and not new.agent_up
    assert new.ticket != state.ticket
    if lendee_running and waiting:
        assert new.phase is Phase.DRAINING
        assert actions[-1:] == [Drain(ticket=new.ticket)]
    elif lendee_running:
        assert new.phase is Phase.BOOTING
        assert actions[-1:] == [WaitAgent(ticket=new.ticket)]
    elif waiting:
        assert (new.phase, actions) == (Phase.OFF, [StartOwner(owner="gaming1")])
    else:
        due = AT + 20 if (phase is Phase.OFF and not fresh) else AT
        assert (new.phase, actions) == (Phase.OFF, [ScheduleRelend(at=due)])
        assert new.relend_at == due
    if lendee_running and state.relend_at is not None:
        assert actions[0] == CancelRelend()


def test_observed_completes_intents_whose_owner_started_meanwhile() -> None:
    state = S(intents=(*G1G2, intent("gaming3")))
    new, actions = go(state, _observed(False, frozenset({"gaming1"})))
    assert actions == [
        CompleteIntent(intent_id="i-gaming1", owner="gaming1"),
        StartOwner(owner="gaming2"),
        StartOwner(owner="gaming3"),
    ]
    assert new.running_owners == {"gaming1"}
    assert [i.owner for i in new.intents] == ["gaming2", "gaming3"]


def test_observed_restarts_independent_owners_while_the_lendee_is_reclaimed() -> None:
    state = State(intents=(intent("gaming3"), intent("gaming1")))
    new, actions = go(state, _observed(True))
    assert new.phase is Phase.DRAINING
    assert actions == [Drain(ticket=new.ticket), StartOwner(owner="gaming3")]


def test_observed_fails_intents_for_an_owner_no_longer_configured() -> None:
    state = State(intents=(intent("gaming9"), *G1))
    new, actions = go(state, _observed(False))
    assert actions == [
        FailIntent(
            intent_id="i-gaming9",
            owner="gaming9",
            reason="gaming9 is no longer an owner VM in the configuration",
        ),
        StartOwner(owner="gaming1"),
    ]
    assert new.intents == G1


def test_observed_lendee_running_alongside_an_owner_reclaims_it() -> None:
    new, actions = go(S(Phase.LENT), _observed(True, frozenset({"gaming2"})))
    assert (new.phase, actions) == (Phase.DRAINING, [Drain(ticket=new.ticket)])


def test_observed_on_hold_or_mid_game_does_not_lend() -> None:
    assert go(State(hold=True), _observed(False))[1] == []
    new, actions = go(S(relend_at=AT + 5), _observed(False, frozenset({"gaming1"})))
    assert actions == [CancelRelend()] and new.relend_at is None


def test_observed_keeps_the_reason_of_a_failed_lendee_start_but_retries() -> None:
    state = S(reason="gpu-node failed to start: IOMMU")
    new, actions = go(state, _observed(False))
    assert new.reason == state.reason
    assert actions == [ScheduleRelend(at=AT)]


# --- verdict and holders ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        (S(lendee_starting=True), "gpu-node is starting and would take gpu-a"),
        (S(Phase.BOOTING), "gpu-node holds gpu-a; hostagent is draining it"),
        (S(Phase.JOINING), "gpu-node holds gpu-a; hostagent is draining it"),
        (S(Phase.LENT), "gpu-node holds gpu-a; hostagent is draining it"),
        (S(Phase.DRAINING), "hostagent is draining gpu-node to free gpu-a"),
        (S(Phase.STOPPING), "gpu-node is shutting down to free gpu-a"),
        (S(Phase.FAILED, reason="silent"), "is stuck (`hostagent status` says why); hostagent"),
    ],
    ids=lambda v: v.phase.value if isinstance(v, State) else "",
)
def test_verdict_defers_an_owner_while_the_lendee_holds_its_gpu(
    state: State, fragment: str
) -> None:
    decision, message = verdict(state, "gaming1", topo=TOPO)
    assert decision == "defer"
    assert fragment in message
    assert "gaming1 will start by itself" in message
    assert message.endswith(f"({FOLLOW})")
    assert "\n" not in message and ". " not in message  # one sentence


def test_verdict_lets_an_owner_through_when_it_can_start() -> None:
    assert verdict(S(), "gaming1", topo=TOPO) == ("proceed", "gpu-node is off")
    assert verdict(S(intents=G1), "gaming1", topo=TOPO)[0] == "proceed"  # our own start
    assert verdict(S(Phase.LENT), "gaming3", topo=TOPO) == (
        "proceed",
        "gaming3 shares no GPU with gpu-node",
    )
    assert verdict(S(Phase.LENT), "desktop", topo=TOPO) == (
        "proceed",
        "desktop is not managed by hostagent",
    )
    running = S(Phase.DRAINING, running_owners=frozenset({"gaming1"}))
    assert verdict(running, "gaming1", topo=TOPO)[0] == "proceed"


def test_verdict_for_the_lendee() -> None:
    assert verdict(S(), LENDEE, topo=TOPO) == ("proceed", "no owner VM needs gpu-node's GPUs")
    assert verdict(S(hold=True), LENDEE, topo=TOPO)[0] == "proceed"  # hold is not a veto
    assert verdict(S(running_owners=frozenset({"gaming3"})), LENDEE, topo=TOPO)[0] == ("proceed")
    both = S(running_owners=frozenset({"gaming1", "gaming2"}))
    assert verdict(both, LENDEE, topo=TOPO) == (
        "defer",
        "gpu-node's GPUs are in use by gaming1, gaming2; hostagent lends it what is free "
        f"by itself, and the rest when those VMs stop ({FOLLOW})",
    )
    assert verdict(S(intents=G1), LENDEE, topo=TOPO) == (
        "defer",
        "gpu-node's GPUs are being handed to gaming1; hostagent lends them again by itself "
        f"when that is over ({FOLLOW})",
    )
    one = S(running_owners=frozenset({"gaming1", "gaming3"}))  # gaming3 shares none
    assert verdict(one, LENDEE, topo=TOPO) == (
        "defer",
        "gpu-node's GPUs are in use by gaming1; hostagent lends it what is free by itself, "
        f"and the rest when that VM stops ({FOLLOW})",
    )


def test_holders() -> None:
    free = dict.fromkeys(["gpu-a", "gpu-b", "gpu-c", "gpu-z"])
    assert holders(S(), TOPO) == free
    assert holders(S(lendee_starting=True), TOPO) == free
    assert holders(S(Phase.LENT, running_owners=frozenset({"gaming3"})), TOPO) == {
        "gpu-a": LENDEE,
        "gpu-b": LENDEE,
        "gpu-c": LENDEE,
        "gpu-z": "gaming3",
    }
    assert holders(S(running_owners=frozenset({"gaming1"})), TOPO) == {**free, "gpu-a": "gaming1"}
    # Reality contradicting the topology: the owner's claim is shown.
    assert holders(S(Phase.DRAINING, running_owners=frozenset({"gaming2"})), TOPO) == {
        "gpu-a": LENDEE,
        "gpu-b": "gaming2",
        "gpu-c": LENDEE,
        "gpu-z": None,
    }
    assert list(holders(S(), TOPO)) == sorted(TOPO.gpus)


# --- the topology ----------------------------------------------------------------------


def test_topology_questions() -> None:
    assert TOPO.needs_lendee_gpus("gaming1") and not TOPO.needs_lendee_gpus("gaming3")
    assert TOPO.shared_gpus("gaming2") == {"gpu-b"}
    assert TOPO.gpus == {"gpu-a", "gpu-b", "gpu-c", "gpu-z"}
    assert TOPO.is_owner("gaming1") and not TOPO.is_owner(LENDEE)
    assert not TOPO.needs_lendee_gpus("desktop") and TOPO.shared_gpus("desktop") == set()
    with pytest.raises(TypeError):
        TOPO.owners["gaming4"] = frozenset({"gpu-y"})  # type: ignore[index]


@pytest.mark.parametrize(
    ("lendee_gpus", "owners", "message"),
    [
        (
            frozenset({"gpu-a"}),
            {"gpu-node": frozenset({"gpu-a"})},
            "gpu-node is the lendee and cannot also be an owner",
        ),
        (frozenset(), {}, "lendee gpu-node borrows no GPU: there is nothing to lend"),
        (frozenset({"gpu-a"}), {"g1": frozenset()}, "owner g1 owns no GPU"),
    ],
)
def test_topology_refuses_contradictions(
    lendee_gpus: frozenset[str], owners: dict[str, frozenset[str]], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        Topology(lendee=LENDEE, lendee_gpus=lendee_gpus, owners=owners)
    assert str(info.value) == message


# --- a randomised world ----------------------------------------------------------------


class World(RuleBasedStateMachine):
    """libvirt, the guest, the cluster, people and the executor, simulated crudely.

    The executor's part: every action is queued, and queued actions complete in any
    order, successfully or not, so reports go stale the way they do in a real agent.
    libvirt's part: lifecycle events are delivered as soon as a VM starts or stops
    (libvirt's own device lock covers the window in reality; here the world has *no*
    lock, so a machine that asked for a conflicting start would be caught). People's
    part: they start VMs through the hook (the verdict decides), ask through the
    control socket, stop VMs, crash the lendee, hold, resume and reclaim, restart the agent.

    Checked after every step: never two running holders of a GPU; ShutdownLendee only
    after the lendee's agent answered since its last start; ForceOff only if the policy
    allows it; every intent ends through CompleteIntent or FailIntent, never silently.
    Checked at the end: with everything succeeding, the machine settles (no intent
    left, the lendee lent unless someone plays or lending is on hold).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.policy = POLICY
        self.state = State()
        self.now = 0.0
        self.lendee_up = False
        self.guest_ready = False  # the current lendee's agent would answer a ping
        self.answered = False  # and an AgentUp for this lendee instance was delivered
        self.owners_up: set[str] = set()
        self.queue: list[Action] = []
        self.timer: float | None = None
        self.open: dict[str, str] = {}  # intent id → owner, as the world knows them
        self.ids = itertools.count()
        self.stale_refused = 0

    # -- plumbing

    def deliver(self, event: Event, *, may_be_stale: bool = False) -> None:
        before = self.state
        try:
            after, actions = step(before, event, topo=TOPO, policy=self.policy)
        except IllegalTransition:
            if not may_be_stale:
                raise
            self.stale_refused += 1
            return
        self.state = after
        if after.phase is not before.phase:
            assert after.ticket != before.ticket
        for action in actions:
            self.take(before, after, action)

    def take(self, before: State, after: State, action: Action) -> None:
        match action:
            case ScheduleRelend(at=at):
                self.timer = at
            case CancelRelend():
                self.timer = None
            case CompleteIntent(intent_id=i, owner=o):
                assert self.open.pop(i) == o, f"intent {i} completed twice or never opened"
                assert o in self.owners_up, f"intent {i} completed but {o} is not running"
            case FailIntent(intent_id=i, owner=o):
                assert self.open.pop(i) == o, f"intent {i} failed twice or never opened"
            case ForceOff():
                assert self.policy.force_off, "ForceOff without force_off_after"
                self.queue.append(action)
            case ShutdownLendee():
                assert before.phase is Phase.STOPPING
                assert self.lendee_up and self.answered, "shutdown before the agent answered"
                assert after.agent_up
                self.queue.append(action)
            case StartOwner(owner=o):
                if TOPO.needs_lendee_gpus(o):
                    assert after.phase is Phase.OFF and not after.lendee_starting
                self.queue.append(action)
            case StartLendee():
                assert not after.hold
                assert not any(TOPO.needs_lendee_gpus(i.owner) for i in after.intents)
                self.queue.append(action)
            case _:
                self.queue.append(action)

    def conflict(self, starting: str) -> bool:
        if starting == LENDEE:
            return any(TOPO.needs_lendee_gpus(o) for o in self.owners_up)
        return self.lendee_up and TOPO.needs_lendee_gpus(starting)

    def start_owner(self, owner: str) -> None:
        assert not self.conflict(owner), f"{owner} started while {LENDEE} holds its GPU"
        self.owners_up.add(owner)
        self.deliver(OwnerStarted(at=self.now, owner=owner))

    def start_lendee(self) -> None:
        assert not self.conflict(LENDEE), f"{LENDEE} started while an owner holds a GPU"
        self.lendee_up, self.guest_ready, self.answered = True, False, False
        self.deliver(LendeeStarted(at=self.now))

    def stop_lendee(self) -> None:
        self.lendee_up, self.guest_ready, self.answered = False, False, False
        self.deliver(LendeeStopped(at=self.now))

    def ask(self, owner: str, source: IntentSource) -> None:
        intent_id = f"i{next(self.ids)}"
        if not self.state.intents_of(owner):  # else it joins the one pending
            self.open[intent_id] = owner
        self.deliver(OwnerWants(at=self.now, owner=owner, intent_id=intent_id, source=source))

    def execute(self, action: Action, ok: bool, late: bool = False) -> None:
        """Run one queued action the way the executor would, and report.

        The executor skips an action that went stale while queued (`still_wanted`). A
        `late` one was already under way when it went stale: if it touches no VM (a
        wait, a drain, a return), it still reports, and the machine must refuse that.
        """
        wanted = still_wanted(self.state, action, topo=TOPO)
        if not wanted and not (late and isinstance(action, (WaitAgent, Drain, KubeReturn))):
            return
        stale = not wanted
        match action:
            case StartOwner(owner=o):
                if not ok:
                    self.deliver(StartFailed(at=self.now, vm=o, reason="x"))
                    return
                # Our own start goes through the hook too, and must pass it.
                assert verdict(self.state, o, topo=TOPO)[0] == "proceed"
                self.start_owner(o)
            case StartLendee():
                if not ok:
                    self.deliver(StartFailed(at=self.now, vm=LENDEE, reason="x"))
                    return
                if verdict(self.state, LENDEE, topo=TOPO)[0] == "defer":
                    # An owner asked while the start was in flight: the lendee's own hook
                    # defers it, which spares a boot only to shut it down again.
                    self.deliver(StartFailed(at=self.now, vm=LENDEE, reason="deferred"))
                    return
                self.start_lendee()
            case WaitAgent(ticket=t):
                if ok and self.lendee_up and self.guest_ready:
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
                event: Event = (
                    Drained(at=self.now, ticket=t)
                    if ok
                    else DrainFailed(at=self.now, ticket=t, reason="PDB")
                )
                self.deliver(event, may_be_stale=stale)
            case KubeReturn(ticket=t):
                event = (
                    ReturnDone(at=self.now, ticket=t)
                    if ok
                    else ReturnFailed(at=self.now, ticket=t, reason="short")
                )
                self.deliver(event, may_be_stale=stale)
            case _:
                raise AssertionError(f"unexpected queued action {action}")

    # -- the world's moves

    @initialize(
        force_off=st.booleans(),
        delay=st.sampled_from([30.0, 0.0]),
        lendee=st.booleans(),
        owners=st.sets(st.sampled_from(OWNERS)),
    )
    def boot(self, force_off: bool, delay: float, lendee: bool, owners: set[str]) -> None:
        self.policy = Policy(relend_delay=delay, force_off=force_off, partial=False)
        if lendee:  # a host that comes up with a consistent set of VMs running
            owners = {o for o in owners if not TOPO.needs_lendee_gpus(o)}
        self.lendee_up, self.owners_up = lendee, set(owners)
        self.deliver(Observed(at=0.0, lendee_running=lendee, owners_running=frozenset(owners)))
        self.ready = True

    @rule(owner=st.sampled_from(OWNERS))
    def virsh_start(self, owner: str) -> None:
        if owner in self.owners_up:
            return
        if verdict(self.state, owner, topo=TOPO)[0] == "proceed":
            self.start_owner(owner)
        else:
            self.ask(owner, IntentSource.HOOK)

    @rule(owner=st.sampled_from(OWNERS))
    def control_start(self, owner: str) -> None:
        self.ask(owner, IntentSource.CONTROL)

    @rule()
    def virsh_start_lendee(self) -> None:
        if not self.lendee_up and verdict(self.state, LENDEE, topo=TOPO)[0] == "proceed":
            self.start_lendee()

    @rule(owner=st.sampled_from(OWNERS))
    def owner_stops(self, owner: str) -> None:
        if owner in self.owners_up:
            self.owners_up.discard(owner)
            self.deliver(OwnerStopped(at=self.now, owner=owner))

    @rule()
    def lendee_stops_by_itself(self) -> None:
        if self.lendee_up:
            self.stop_lendee()

    @rule()
    def guest_agent_comes_up(self) -> None:
        if self.lendee_up:
            self.guest_ready = True

    @precondition(lambda self: bool(self.queue))
    @rule(data=st.data())
    def executor_finishes_something(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.queue) - 1), label="which")
        ok = data.draw(st.integers(0, 4), label="outcome") > 0  # mostly success
        late = data.draw(st.booleans(), label="late")
        self.execute(self.queue.pop(index), ok, late)

    @rule(steps=st.integers(1, 8))
    def a_quiet_while(self, steps: int) -> None:
        """Some time in which everything works: drives the long roads (lend, reclaim)."""
        for _ in range(steps):
            if self.lendee_up:
                self.guest_ready = True
            if self.queue:
                self.execute(self.queue.pop(0), ok=True)
            elif self.timer is not None:
                self.relend_timer_fires()

    @precondition(lambda self: self.timer is not None)
    @rule()
    def relend_timer_fires(self) -> None:
        assert self.timer is not None
        self.now = max(self.now, self.timer)
        self.timer = None
        self.deliver(RelendDue(at=self.now))  # an armed timer is never stale

    @rule(dt=st.sampled_from([0.1, 5.0, 60.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(what=st.sampled_from([Hold, Resume, Reclaim]))
    def operator(self, what: type[Hold | Resume | Reclaim]) -> None:
        self.deliver(what(at=self.now))

    @rule(restart=st.booleans())
    def agent_loses_track(self, restart: bool) -> None:
        if restart:
            # The agent process dies: in-flight work and timers die with it; what was
            # persisted (intents, hold) comes back.
            self.queue.clear()
            self.timer = None
            self.state = State(intents=self.state.intents, hold=self.state.hold)
        else:
            # The libvirt connection drops: calls on it fail (their reports are lost);
            # Kubernetes work and the timer go on.
            self.queue = [a for a in self.queue if isinstance(a, (Drain, KubeReturn))]
        self.reread()

    def reread(self) -> None:
        self.deliver(
            Observed(
                at=self.now,
                lendee_running=self.lendee_up,
                owners_running=frozenset(self.owners_up),
            )
        )

    # -- what must always hold

    @invariant()
    def never_two_holders_of_a_gpu(self) -> None:
        if self.lendee_up:
            assert not any(TOPO.needs_lendee_gpus(o) for o in self.owners_up)

    @invariant()
    def the_machine_knows_what_runs(self) -> None:
        if not self.ready:
            return
        assert self.state.phase.lendee_running == self.lendee_up
        assert self.state.running_owners == self.owners_up
        expected = {
            gpu: next((o for o in self.owners_up if gpu in TOPO.owners[o]), None)
            or (LENDEE if self.lendee_up and gpu in TOPO.lendee_gpus else None)
            for gpu in TOPO.gpus
        }
        assert holders(self.state, TOPO) == expected

    @invariant()
    def no_intent_is_lost(self) -> None:
        assert {i.id: i.owner for i in self.state.intents} == self.open

    @invariant()
    def the_state_is_coherent(self) -> None:
        s = self.state
        claimed = any(TOPO.needs_lendee_gpus(i.owner) for i in s.intents) or any(
            TOPO.needs_lendee_gpus(o) for o in s.running_owners
        )
        if s.relend_at is not None:
            assert s.phase is Phase.OFF and not s.hold and not s.lendee_starting
            assert not claimed
        assert s.relend_at == self.timer or not self.ready
        if s.lendee_starting:
            assert s.phase is Phase.OFF
        if s.shutdown_sent:
            assert s.phase is Phase.STOPPING and s.agent_up
        if s.phase is Phase.FAILED:
            assert s.reason
        if s.phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT):
            assert not claimed

    def teardown(self) -> None:
        """Let everything succeed: the machine must come to rest where it should."""
        if not self.ready:
            return
        for _ in range(500):
            if self.lendee_up:
                self.guest_ready = True
            s = self.state
            playing = any(TOPO.needs_lendee_gpus(o) for o in self.owners_up)
            idle = not self.queue and self.timer is None
            if s.phase is Phase.FAILED or (
                s.phase is Phase.OFF and s.reason and idle and not playing and not s.hold
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
        playing = any(TOPO.needs_lendee_gpus(o) for o in self.owners_up)
        if self.state.hold or playing:
            assert self.state.phase in (Phase.OFF, Phase.LENT)
        else:
            assert self.state.phase is Phase.LENT


World.TestCase.settings = settings(
    max_examples=STATEFUL_EXAMPLES,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_world = World.TestCase
