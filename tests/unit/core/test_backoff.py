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


@pytest.mark.parametrize(("jitter", "factor"), [(0.0, 0.5), (1.0, 1.0)])
async def test_the_backoff_doubles_from_1s_to_60s_jittered_to_half_and_says_so_twice(
        monkeypatch: pytest.MonkeyPatch, jitter: float, factor: float) -> None:
    # The defaults, written out: 1 s doubling to a cap of 60 s, each wait between half
    # of it and all of it; one record at the first failure and one at the recovery.
    monkeypatch.setattr("hostagent.core.backoff.random.random", lambda: jitter)
    attempts = 0
    slept: list[float] = []
    records: list[tuple[str, str]] = []

    async def start() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 10:
            raise Transient(f"address in use, attempt {attempts}")
        return "up"

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    assert await keep_trying(start, what="the SSH endpoint", transient=(Transient,),
                             record=lambda *r: records.append(r), sleep=sleep) == "up"
    assert slept == [factor * s for s in (1, 2, 4, 8, 16, 32, 60, 60, 60)]
    assert records == [
        ("retrying", "the SSH endpoint cannot start yet (address in use, attempt 1); trying "
                     "again with backoff up to 60s"),
        ("started", "the SSH endpoint started after 9 failed attempt(s)")]
