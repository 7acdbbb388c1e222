"""How a test waits for something to happen: `until` it holds (`wait_until` in a test
without an event loop), polled, within one bound for the whole suite.

A condition that holds returns at once, so the bound costs a passing test nothing. It
is generous because `make test` runs three test processes and their lab guests on 2
cores, where anything can take many times longer than on a quiet machine: a test must
fail because the thing never happens, not because it happened late. Never sleep and
then assert that something happened; and time a test only where the time is what it
checks (a budget the code promises), with a margin that load cannot eat."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

BOUND = 60.0


async def until(cond: Callable[[], object], what: str = "the condition", *,
                timeout: float = BOUND, every: float = 0.02) -> Any:
    """Until `cond()` (or what it returns, awaited) is true, and that true value, for a
    test that uses what it waited for (`[pod] = await until(...)`); an AssertionError
    saying `what` after `timeout` seconds, a condition that hangs included. A condition
    that costs a process (kubectl) is asked less often: a larger `every`."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                got = cond()
                if inspect.isawaitable(got):
                    got = await got
                if got:
                    return got
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"not within {timeout:g} s: {what}") from None


def wait_until(cond: Callable[[], object], what: str = "the condition", *,
               timeout: float = BOUND, every: float = 0.1) -> Any:
    """`until` for a test that has no event loop (its condition a plain call)."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(every)
    return got
