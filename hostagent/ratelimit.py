"""Journal records for refused connections, summarised instead of one per connection.

A flood of connections (a port scan, a brute-force run, a stuck client in a loop) must
not flood the journal: the first refusal of an interval is recorded as it comes, the
rest are counted and recorded as one summary when the next interval begins (or at the
next refusal after it). No timer and no task: the summary rides on the next call, or on
`flush`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

__all__ = ["Summarised"]


class Summarised:
    """Let one record through per `interval` seconds; count and summarise the rest.

    `emit(message, count, reasons)` writes a record: `count` is 1 for a record let
    through, and for a summary the number of records it stands for, by reason."""

    def __init__(self, emit: Callable[[str, int, dict[str, int]], None], *,
                 interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._interval = interval
        self._clock = clock
        self._window_start: float | None = None
        self._held: Counter[str] = Counter()

    def __call__(self, message: str, reason: str) -> None:
        now = self._clock()
        if self._window_start is not None and now - self._window_start < self._interval:
            self._held[reason] += 1
            return
        self.flush()
        self._window_start = now
        self._emit(message, 1, {reason: 1})

    def flush(self) -> None:
        """Write the summary of what was held back, if anything was."""
        if self._held:
            held, self._held = dict(self._held), Counter()
            total = sum(held.values())
            by = ", ".join(f"{n} {why}" for why, n in sorted(held.items()))
            self._emit(f"{total} more refused in the last {self._interval:g}s ({by})",
                       total, held)

    @property
    def held(self) -> int:
        return sum(self._held.values())
