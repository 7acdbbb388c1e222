"""The journal's sentence for each transition (hostagent/service/recorder.py)."""

from __future__ import annotations

from hostagent.host import journal
from hostagent.core.machine import Phase, State
from hostagent.service.parts import Progress
from hostagent.service.recorder import Recorder
from tests.unit.core.test_machine import G1, POLICY, TOPO, _observed, go


class Kept:
    """The agent's view of its state, as the recorder reads it."""

    def __init__(self, state: State) -> None:
        self.state, self.phase_since = state, 0.0


def test_a_reclaim_resumed_at_start_says_who_wants_which_gpu(sink: journal.ListSink) -> None:
    """Restarted while gaming1's reclaim was under way, the agent finds the lendee running
    and drains it again: the journal said "an owner VM wants : draining gpu-node" (the
    state it starts from lends nothing yet)."""
    old = State(intents=G1)
    new, _ = go(old, _observed(True))
    assert new.phase is Phase.DRAINING
    Recorder(TOPO, POLICY, Kept(new), Progress()).phase(old, new, _observed(True))
    assert [e.message for e in sink.entries] == ["gaming1 wants gpu-a: draining gpu-node"]
