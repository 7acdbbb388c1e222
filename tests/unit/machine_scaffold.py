"""What the machine's tests share (test_machine.py runs it all or nothing, test_partial.py
as configured by default): the lendee's name, the ticket and time of every state they
build, intents and requests as a hook makes them, and feeding events in order."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from hostagent.core.machine import step
from hostagent.core.model import (
    Action,
    Event,
    Intent,
    IntentSource,
    OwnerWants,
    Phase,
    Policy,
    State,
    Topology,
)

LENDEE = "gpu-node"
T = 7  # the ticket of every state built below; the next phase gets T + 1
AT = 100.0
HOOK = IntentSource.HOOK
FAILED_WHY = "something went wrong"
# Runs of the stateful worlds (test_machine.py 400, test_partial.py 400 and 200): make
# mutate asks for fewer, since it runs them once per mutant of the machine.
STATEFUL_EXAMPLES = int(os.environ.get("HOSTAGENT_STATEFUL_EXAMPLES", "400"))


def built(phase: Phase, **changes: object) -> State:
    """A state in `phase` at ticket T, its guest agent up where the phase says so."""
    base = State(phase=phase, ticket=T, agent_up=phase in (Phase.JOINING, Phase.LENT))
    return replace(base, **changes)  # type: ignore[arg-type]


def intent(owner: str, id: str | None = None, at: float = 50.0) -> Intent:
    return Intent(id=id or f"i-{owner}", owner=owner, created_at=at, source=HOOK)


def wants(owner: str, id: str | None = None, at: float = AT) -> OwnerWants:
    return OwnerWants(at=at, owner=owner, intent_id=id or f"i-{owner}", source=HOOK)


@dataclass(frozen=True)
class Stepper:
    """The machine on `topo`, under `policy` unless a step names another."""

    topo: Topology
    policy: Policy

    def go(self, state: State, event: Event,
           policy: Policy | None = None) -> tuple[State, list[Action]]:
        return step(state, event, topo=self.topo, policy=policy or self.policy)

    def run(self, state: State, *events: Event,
            policy: Policy | None = None) -> tuple[State, list[Action]]:
        """Feed events in order; every action emitted along the way, in order."""
        out: list[Action] = []
        for event in events:
            state, actions = self.go(state, event, policy)
            out += actions
        return state, out
