"""The machine's world run all or nothing (test_machine.py, test_recorder.py): three
owners, the policies, states built like the machine's, and its steps."""

from __future__ import annotations

from hostagent.core.model import (
    Observed,
    Phase,
    Policy,
    State,
    Topology,
)
from tests.unit.machine_scaffold import (
    AT,
    LENDEE,
    Stepper,
    built,
    intent,
)


# gaming1 and gaming2 each own a GPU the lendee borrows; gaming3 owns one it never does;
# gpu-c is the lendee's own (nobody owns it).
TOPO = Topology(
    lendee=LENDEE,
    lendee_gpus=frozenset({"gpu-a", "gpu-b", "gpu-c"}),
    owners={
        "gaming1": frozenset({"gpu-a"}),
        "gaming2": frozenset({"gpu-b"}),
        "gaming3": frozenset({"gpu-z"}),
    },
)


OWNERS = ("gaming1", "gaming2", "gaming3")
SHARING = ("gaming1", "gaming2")


POLICY = Policy(relend_delay=30.0, force_off=False, partial=False)
FORCE = Policy(relend_delay=30.0, force_off=True, partial=False)


ALL = TOPO.lendee_gpus
STEPPER = Stepper(TOPO, POLICY)


go, run = STEPPER.go, STEPPER.run


def S(phase: Phase = Phase.OFF, **changes: object) -> State:  # a state, built like one
    """A state in `phase` at ticket T, as the machine would have it."""
    # A lendee that runs or is being started holds every GPU (all or nothing here).
    lent = ALL if phase is not Phase.OFF or changes.get("lendee_starting") else frozenset()
    return built(phase, **{"lent": lent} | changes)


G1 = (intent("gaming1"),)
G1G2 = (intent("gaming1"), intent("gaming2"))


ABORTED = "gpu-node could not be drained (PDB), and the policy keeps it lent"


def _observed(running: bool, owners: frozenset[str] = frozenset(), at: float = AT) -> Observed:
    return Observed(at=at, lendee_running=running, owners_running=owners)
