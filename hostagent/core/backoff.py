"""Retrying what fails for a while: a port taken at boot, an address not configured yet.

Exit status 2 (with `RestartPreventExitStatus=2`) is for what a person must fix in the
configuration. A port that cannot be bound now may be free in a minute (the previous
agent still closing it, a network not up yet); stopping the agent for it would also
stop the hook socket. `keep_trying` retries such a start with capped, jittered backoff,
recording the first failure and the recovery (not every attempt) through the `record`
it is given (the agent gives `journal.retry`: no I/O here), while the caller runs it as
a task of its own and serves everything else meanwhile.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["keep_trying"]

T = TypeVar("T")


async def keep_trying(start: Callable[[], Awaitable[T]], *, what: str,
                      transient: tuple[type[BaseException], ...],
                      record: Callable[[str, str], object], first: float = 1.0,
                      cap: float = 60.0,
                      sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """`await start()` until it does not raise one of `transient`; its result.

    Other exceptions propagate at once (they need a person). `what` names the thing in
    the records, e.g. "the SSH endpoint"; `record(result, sentence)` gets "retrying" at
    the first failure and "started" at the recovery."""
    delay = first
    failures = 0
    while True:
        try:
            result = await start()
        except transient as e:
            failures += 1
            if failures == 1:
                record("retrying", f"{what} cannot start yet ({e}); trying again with "
                       f"backoff up to {cap:g}s")
            await sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, cap)
            continue
        if failures:
            record("started", f"{what} started after {failures} failed attempt(s)")
        return result
