"""A restart of the agent while its GPUs are lent adopts what runs: a lendee that the
adapters found in service as the previous agent left it (`Observed.adopt`: its node
uncordoned, Ready, marked lent with the GPUs it runs with) goes straight back to LENT,
with no booting → joining → lent replay (no swap, no plugin restart, no sensor flap).
Anything else about it replays the lend, or reclaims, as before."""

from __future__ import annotations

from hostagent.core.model import (
    Drain,
    Hotplug,
    Observed,
    Phase,
    Policy,
    ScheduleRelend,
    State,
    Topology,
    WaitAgent,
)

from tests.unit.machine_scaffold import AT, LENDEE, Stepper, intent

TOPO = Topology(lendee=LENDEE, lendee_gpus=frozenset({"gpu-a", "gpu-b"}),
                owners={"gaming1": frozenset({"gpu-a"}), "gaming2": frozenset({"gpu-b"})})
POLICY = Policy(relend_delay=30.0, hotplug=Hotplug.ADD)
go = Stepper(TOPO, POLICY).go
BOTH = frozenset({"gpu-a", "gpu-b"})


def observed(*, adopt: bool, gpus: frozenset[str] = BOTH,
             owners: frozenset[str] = frozenset()) -> Observed:
    return Observed(at=AT, lendee_running=True, owners_running=owners, lendee_gpus=gpus,
                    adopt=adopt)


def test_a_lendee_in_service_goes_straight_back_to_lent() -> None:
    new, actions = go(State(), observed(adopt=True))
    assert (new.phase, new.lent, new.agent_up, new.replug) == (Phase.LENT, BOTH, True, False)
    assert actions == []


def test_without_the_adapters_word_the_lend_is_replayed() -> None:
    new, actions = go(State(), observed(adopt=False))
    assert new.phase is Phase.BOOTING and actions == [WaitAgent(ticket=new.ticket)]


def test_an_owner_waiting_for_its_gpu_reclaims_instead() -> None:
    new, actions = go(State(intents=(intent("gaming1"),)), observed(adopt=True))
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=new.ticket)]
    new, _ = go(State(reclaiming=True), observed(adopt=True))
    assert new.phase is Phase.DRAINING


def test_a_gpu_freed_while_the_agent_was_away_is_regrown_later() -> None:
    """Lent with gpu-b only, gaming1 gone meanwhile: adopted, then the regrow's timer."""
    new, actions = go(State(), observed(adopt=True, gpus=frozenset({"gpu-b"})))
    assert new.phase is Phase.LENT and new.lent == {"gpu-b"}
    assert actions == [ScheduleRelend(at=AT + 30.0)]
