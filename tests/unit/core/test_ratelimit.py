"""Refusals are journaled a few at a time, then summarised: a flood cannot flood the journal."""

from __future__ import annotations

from hostagent.core.ratelimit import Summarised


def test_a_burst_per_interval_then_one_summary() -> None:
    now = [0.0]
    out: list[tuple[str, int]] = []
    limit = Summarised(lambda m, n, _: out.append((m, n)), interval=10, burst=2,
                       clock=lambda: now[0])
    for i in range(1000):
        limit(f"refused {i}", "idle" if i % 2 else "cap")
    assert out == [("refused 0", 1), ("refused 1", 1)]
    assert limit.held == 998
    now[0] = 10.0
    limit("refused again", "cap")
    assert out[2:] == [("998 more refused in the last 10s (499 cap, 499 idle)", 998),
                       ("refused again", 1)]
    limit.flush()
    assert len(out) == 4 and limit.held == 0
