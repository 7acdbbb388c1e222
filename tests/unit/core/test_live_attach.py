"""Hot-add (`hostagent.core.live`) driven directly: GPUs a game freed attached to the
running lendee, then attached, or failed with or without some of them held by its live
definition; a report of another attach is stale. The lendee borrows gpu-a, gpu-b and
gpu-c; gaming1 owns gpu-a."""

from __future__ import annotations


import pytest

from hostagent.core.machine import IllegalTransition
from hostagent.core.model import (
    AttachFailed,
    AttachGpus,
    GpusAttached,
    Phase,
    RelendDue,
    ScheduleRelend,
    State,
)
from tests.unit.machine_scaffold import AT, T
from tests.unit.partial_world import LIVE, POLICY, A, B, C, S, gpus

go = LIVE.go


def attaching() -> State:
    """gaming1 stopped: its gpu-a is being attached to the lendee, which holds the rest."""
    state, actions = go(S(Phase.LENT, lent=gpus(B, C), relend_at=AT, regrow_waiting=True),
                        RelendDue(at=AT))
    assert actions == [AttachGpus(ticket=T + 1, gpus=gpus(A))]
    assert (state.lent, state.attaching, state.relend_at, state.regrow_waiting) == (
        gpus(A, B, C), gpus(A), None, False)
    return state


def test_attached_the_gpus_are_lent_and_nothing_more_is_due() -> None:
    state, actions = go(attaching(), GpusAttached(at=AT + 5, ticket=T + 1, gpus=gpus(A)))
    assert (state.phase, state.ticket, state.lent, state.attaching, actions) == (
        Phase.LENT, T + 2, gpus(A, B, C), frozenset(), [])


def test_a_failed_attach_gives_up_the_gpus_not_held_and_adds_live_no_more() -> None:
    state, actions = go(attaching(), AttachFailed(at=AT + 5, ticket=T + 1, gpus=gpus(A),
                                                  held=frozenset(), reason="timeout"))
    assert (state.phase, state.ticket, state.lent, state.attaching, state.hotadd_failed) == (
        Phase.LENT, T + 2, gpus(B, C), frozenset(), True)
    assert actions == [ScheduleRelend(at=AT + 5 + POLICY.relend_delay)]
    # The regrow that follows is a restart, when the lendee is idle, never a hot-add.
    _, actions = go(state, RelendDue(at=AT + 5 + POLICY.relend_delay))
    assert not any(isinstance(a, AttachGpus) for a in actions)


def test_gpus_the_live_definition_holds_after_a_failed_attach_stay_lent() -> None:
    state, actions = go(attaching(), AttachFailed(at=AT + 5, ticket=T + 1, gpus=gpus(A),
                                                  held=gpus(A), reason="driver"))
    assert (state.lent, state.hotadd_failed, actions) == (gpus(A, B, C), True, [])


@pytest.mark.parametrize("event", [
    AttachFailed(at=AT, ticket=T, gpus=gpus(A), held=frozenset(), reason="x"),
    AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A, B), held=frozenset(), reason="x"),
    GpusAttached(at=AT, ticket=T, gpus=gpus(A)),
    GpusAttached(at=AT, ticket=T + 1, gpus=gpus(A, B)),
])
def test_a_report_of_another_attach_is_stale(event: AttachFailed | GpusAttached) -> None:
    state = attaching()
    with pytest.raises(IllegalTransition):
        go(state, event)


def test_a_gpu_freed_during_an_attach_is_a_regrow_due_after_the_delay() -> None:
    # gpu-b's game ended while gpu-a was being attached: its own attach is due next.
    state = S(Phase.LENT, lent=gpus(A, C), attaching=gpus(A))
    state, actions = go(state, GpusAttached(at=AT + 5, ticket=T, gpus=gpus(A)))
    assert actions == [ScheduleRelend(at=AT + 5 + POLICY.relend_delay)]
