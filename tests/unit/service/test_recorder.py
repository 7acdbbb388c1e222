"""The journal's sentence for each transition (hostagent/service/recorder.py)."""

from __future__ import annotations

from hostagent.host import journal
from hostagent.core.model import Phase, State
from hostagent.service.parts import Kept, Progress
from hostagent.service.recorder import Recorder
from tests.unit.machine_world import G1, POLICY, TOPO, _observed, go


def test_a_reclaim_resumed_at_start_says_who_wants_which_gpu(sink: journal.ListSink) -> None:
    """Restarted while gaming1's reclaim was under way, the agent finds the lendee running
    and drains it again: the journal said "an owner VM wants : draining gpu-node" (the
    state it starts from lends nothing yet)."""
    old = State(intents=G1)
    new, _ = go(old, _observed(True))
    assert new.phase is Phase.DRAINING
    Recorder(TOPO, POLICY, Kept(new, phase_since=0.0), Progress()).phase(old, new, _observed(True))
    assert [e.message for e in sink.entries] == ["gaming1 wants gpu-a: draining gpu-node"]
