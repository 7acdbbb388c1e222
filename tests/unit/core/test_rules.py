"""The roads every rule of the machine takes (`hostagent.core.rules`), where the table of
test_machine.py does not reach: a failed lendee retried from the top of its road leaves
its failure behind, a reclaim given up returns the node with its plugins restarted when
its GPUs changed live, an owner joining a regrow's shutdown makes it theirs, an adopted
lendee knows nothing of an earlier lend's pods, and owners with GPUs of their own are
not started twice."""

from __future__ import annotations

from hostagent.core.model import (
    AgentUp,
    Drain,
    DrainFailed,
    KubeReturn,
    LendeeStopped,
    Observed,
    Phase,
    Resume,
    ShutdownLendee,
    StartOwner,
    WaitAgent,
)
from tests.unit.machine_scaffold import AT, T, intent, wants
from tests.unit.partial_world import G1, S, go, gpus, A, B, C

BROKEN = "gpu-node's guest agent did not answer"


def test_a_failed_lendee_retried_boots_again_its_failure_forgotten() -> None:
    state, actions = go(S(Phase.FAILED, reason=BROKEN, agent_up=True), Resume(at=AT))
    assert (state.phase, state.reason, actions) == (Phase.BOOTING, None,
                                                    [WaitAgent(ticket=T + 1)])
    # Its agent must answer again: a reclaim given up now waits for it, never returns
    # a node whose agent nobody heard since the retry.
    state, _ = go(state, wants("gaming1"))
    assert state.phase is Phase.DRAINING
    state, actions = go(state, DrainFailed(at=AT, ticket=state.ticket, reason="PDB"))
    assert (state.phase, actions[-1]) == (Phase.BOOTING, WaitAgent(ticket=state.ticket))


def test_a_failed_lendee_retried_with_an_owner_in_the_way_is_reclaimed_reason_gone() -> None:
    state, actions = go(S(Phase.FAILED, reason=BROKEN, intents=G1), Resume(at=AT))
    assert (state.phase, state.reason, actions) == (Phase.DRAINING, None,
                                                    [Drain(ticket=T + 1)])


def test_a_reclaim_given_up_restarts_the_plugins_of_a_node_whose_gpus_changed_live() -> None:
    state = S(Phase.DRAINING, intents=G1, agent_up=True, replug=True)
    state, actions = go(state, DrainFailed(at=AT, ticket=T, reason="PDB"))
    assert state.phase is Phase.JOINING
    assert actions[-1] == KubeReturn(ticket=T + 1, restart_plugins=True)


def test_an_owner_joining_a_regrows_shutdown_gets_the_shutdown() -> None:
    # The regrow waited for gaming2's GPU; gaming2 plays again, so the regrow would gain
    # nothing, but gaming1 now wants gpu-a the lendee holds: the shutdown is theirs.
    state = S(Phase.STOPPING, lent=gpus(A, C), regrowing=True, running_owners={"gaming2"})
    state, actions = go(state, wants("gaming1"))
    assert (state.phase, state.regrowing, actions) == (Phase.STOPPING, False, [])
    state, actions = go(state, AgentUp(at=AT, ticket=T))
    assert actions == [ShutdownLendee(ticket=T)]


def test_an_adopted_lendee_knows_nothing_of_an_earlier_lends_pods() -> None:
    state, _ = go(S(Phase.LENT, lent=gpus(A, B, C), gpu_pods=3),
                  Observed(at=AT, lendee_running=True, owners_running=frozenset(),
                           lendee_gpus=gpus(A, B, C), adopt=True))
    assert (state.phase, state.gpu_pods) == (Phase.LENT, None)


def test_an_owner_with_gpus_of_its_own_is_not_started_again_when_the_lendee_stops() -> None:
    # gaming3 owns a GPU the lendee never borrows: it was started when it asked.
    state = S(Phase.STOPPING, intents=(intent("gaming1"), intent("gaming3")),
              shutdown_sent=True)
    _, actions = go(state, LendeeStopped(at=AT))
    assert [a for a in actions if isinstance(a, StartOwner)] == [StartOwner(owner="gaming1")]
