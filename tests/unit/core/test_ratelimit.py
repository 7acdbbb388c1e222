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


def test_by_default_one_record_per_10s_then_one_summary_written_out() -> None:
    now = [100.0]
    out: list[tuple[str, int, dict[str, int]]] = []
    limit = Summarised(lambda *e: out.append(e), clock=lambda: now[0])
    for at, message, reason in [(100.0, "a", "scan"), (105.0, "b", "scan"),
                                (109.9, "c", "brute"), (110.0, "d", "scan")]:
        now[0] = at
        limit(message, reason)
    assert out == [
        ("a", 1, {"scan": 1}),
        ("2 more refused in the last 10s (1 brute, 1 scan)", 2, {"brute": 1, "scan": 1}),
        ("d", 1, {"scan": 1}),
    ]
    assert limit.held == 0
