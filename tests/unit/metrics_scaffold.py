"""What the tests of the metrics and the status share (test_metrics.py,
test_operability.py, test_stale_entries.py): the smallest configuration, a topology,
and `Driver`, which feeds the metrics the machine's transitions."""

from __future__ import annotations

from hostagent.core import machine
from hostagent.surfaces import metrics
from hostagent.core.model import (
    AgentUp,
    Event,
    LendeeStarted,
    Policy,
    RelendDue,
    ReturnDone,
    State,
    Topology,
)


TOPO = Topology(lendee="gpu-node", lendee_gpus=frozenset({"gpu-a", "gpu-b"}),
                owners={"gaming1": frozenset({"gpu-a"}), "gaming2": frozenset({"gpu-b"})})
MINIMAL = '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a"]\n[gpus.gpu-a]\npci = "0000:01:00.0"\n'


class Driver:
    """The machine and the metrics, stepped together as `Agent.apply` does."""

    def __init__(self) -> None:
        self.state = State()
        self.metrics = metrics.Metrics(TOPO)

    def __call__(self, make: type[Event], at: float, **kw: object) -> None:
        if "ticket" in make.__dataclass_fields__:
            kw["ticket"] = self.state.ticket
        event = make(at=at, **kw)
        new, _ = machine.step(self.state, event, topo=TOPO, policy=Policy(relend_delay=0))
        old, self.state = self.state, new
        self.metrics.transition(old, new, event)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def lend(self, at: float) -> None:
        self(RelendDue, at)
        self(LendeeStarted, at + 1)
        self(AgentUp, at + 6)
        self(ReturnDone, at + 10)
