"""Journal records of what callers send, summarised instead of one per connection.

A flood of connections (a port scan, a brute-force run, a stuck client in a loop) must
not flood the journal: the first `burst` records of an interval are written as they
come, the rest are counted and written as one summary when the next interval begins
(at the next record after it, or at `flush`). No timer and no task.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

__all__ = ["Summarised"]


class Summarised:
    """Let `burst` records through per `interval` seconds; count and summarise the rest.

    `emit(message, count, reasons)` writes a record: `count` is 1 for a record let
    through, and for a summary the number of records it stands for, by reason."""

    def __init__(self, emit: Callable[[str, int, dict[str, int]], None], *,
                 interval: float = 10.0, burst: int = 1, what: str = "refused",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._interval = interval
        self._burst = burst
        self._what = what  # in the summary: "12 more <what> in the last 10s"
        self._passed = 0
        self._clock = clock
        self._window_start: float | None = None
        self._held: Counter[str] = Counter()

    def __call__(self, message: str, reason: str) -> None:
        if self.allow(reason):
            self._emit(message, 1, {reason: 1})

    def allow(self, reason: str) -> bool:
        """Count one record: True if it goes through now (the caller writes it, with
        fields of its own), False if it is held back for the summary."""
        now = self._clock()
        if self._window_start is None or now - self._window_start >= self._interval:
            self.flush()
            self._window_start, self._passed = now, 0
        if self._passed >= self._burst:
            self._held[reason] += 1
            return False
        self._passed += 1
        return True

    def flush(self) -> None:
        """Write the summary of what was held back, if anything was."""
        if self._held:
            held, self._held = dict(self._held), Counter()
            total = sum(held.values())
            by = ", ".join(f"{n} {why}" for why, n in sorted(held.items()))
            self._emit(f"{total} more {self._what} in the last {self._interval:g}s ({by})",
                       total, held)

    @property
    def held(self) -> int:
        return sum(self._held.values())
