"""A port that cannot be bound now is retried, not a reason to stop the agent (exit 2)."""

from __future__ import annotations


import pytest

from hostagent.host import journal
from hostagent.core.backoff import keep_trying
from hostagent.surfaces.ssh import EndpointError, Transient


pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


async def test_a_transient_failure_is_retried_with_capped_backoff(
        sink: journal.ListSink) -> None:
    attempts = 0
    slept: list[float] = []

    async def start() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 8:
            raise Transient("cannot listen for SSH on *:2222: Address already in use")
        return "listening"

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    assert await keep_trying(start, what="the SSH endpoint", transient=(Transient,),
                             record=journal.retry, first=1, cap=10, sleep=sleep) == "listening"
    assert len(slept) == 7
    assert all(0.5 <= s <= 1 for s in slept[:1]) and max(slept) <= 10
    assert slept[-1] >= 5  # grew to the cap
    assert [e.fields["HOSTAGENT_RESULT"] for e in sink.entries] == ["retrying", "started"]


async def test_what_needs_a_person_is_not_retried() -> None:
    async def start() -> None:
        raise EndpointError("the host key is unusable")

    with pytest.raises(EndpointError):
        await keep_trying(start, what="the SSH endpoint", transient=(Transient,),
                          record=journal.retry)
