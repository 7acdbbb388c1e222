"""The machine's world as hostagent is configured by default (partial lending, regrow
when idle), which test_partial.py drives and the agent's tests run on: three owners and
the lendee's GPUs, the policies, states built like the machine's, and its steps."""

from __future__ import annotations

from dataclasses import replace

from hostagent.core.model import (
    CompleteIntent,
    FailIntent,
    Hotplug,
    Phase,
    Policy,
    Regrow,
    State,
    Topology,
)
from tests.unit.machine_scaffold import LENDEE, Stepper, built, intent

A, B, C, Z = "gpu-a", "gpu-b", "gpu-c", "gpu-z"
# The seeds' machine, plus a second owner of one card: gaming1 and gaming-win share
# gpu-a (a Linux and a Windows game on one card), gaming2 owns gpu-b, gaming3 owns a GPU
# the lendee never borrows, and nobody owns gpu-c (the GTX 960).
TOPO = Topology(
    lendee=LENDEE,
    lendee_gpus=frozenset({A, B, C}),
    owners={
        "gaming1": frozenset({A}),
        "gaming2": frozenset({B}),
        "gaming-win": frozenset({A}),
        "gaming3": frozenset({Z}),
    },
)
OWNERS = ("gaming1", "gaming2", "gaming-win", "gaming3")
ALL = TOPO.lendee_gpus
# Partial, regrow when idle (here ≤ 2 min, which kills the jobs then), min_gpus 1.
POLICY = Policy(relend_delay=30.0, regrow_max_wait=120.0)
UNBOUNDED = replace(POLICY, regrow_max_wait=None)  # when idle, however long that takes
ALWAYS = replace(POLICY, regrow=Regrow.ALWAYS)
NEVER = replace(POLICY, regrow=Regrow.NEVER)
MIN2 = replace(POLICY, min_gpus=2)
ALL_OR_NOTHING = replace(POLICY, partial=False)
# Hot-add and hot-unplug on: the world of the live changes.
BOTH = replace(POLICY, hotplug=Hotplug.BOTH)


def gpus(*labels: str) -> frozenset[str]:
    return frozenset(labels)


def vms(*names: str) -> frozenset[str]:
    return frozenset(names)


STEPPER = Stepper(TOPO, POLICY)
go, run = STEPPER.go, STEPPER.run
LIVE = Stepper(TOPO, BOTH)


def S(phase: Phase = Phase.OFF, **changes: object) -> State:  # a state, built like one
    """A state in `phase` at ticket T. A running (or starting) lendee holds every GPU
    unless ``lent`` says which; an off one holds none."""
    lent = ALL if phase.lendee_running or changes.get("lendee_starting") else frozenset()
    return built(phase, **{"lent": lent} | changes)


def done(owner: str) -> CompleteIntent:
    return CompleteIntent(intent_id=f"i-{owner}", owner=owner)


def cancelled(owner: str, by: str = "alice") -> FailIntent:
    return FailIntent(intent_id=f"i-{owner}", owner=owner, reason=f"cancelled by {by}")


G1 = (intent("gaming1"),)
G2 = (intent("gaming2"),)
