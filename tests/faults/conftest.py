"""The fault-injection suite's table: one row per scenario, printed at the end.

A test that takes the `fault` fixture is a measured scenario: once its body has run,
its figures are taken (see scenario.py) and any intent lost, any GPU held twice or any
forced stop beyond the policy fails it. Every test here gets a row, named by the first
line of its docstring (with its parameters filled in); the security checks have a
result only.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.scenario import Metrics, Scenario
from tests.lab.lab import Lab

HERE = Path(__file__).parent
SCENARIO = pytest.StashKey[Scenario]()
ROWS = pytest.StashKey[dict[str, "Row"]]()


@dataclass
class Row:
    scenario: str
    result: str = "not run"
    metrics: Metrics | None = None


@pytest.fixture(autouse=True)
def all_or_nothing(lab: Lab) -> None:
    """The faults hit the reclaim and lend roads, which are the same with partial lending
    off; with it on, every reclaim adds a boot of the lendee with the GPUs left (seconds
    of TCG each, minutes over the suite) that no fault here is about. The lab tests
    exercise partial lending, faults included where it changes the road."""
    lab.partial = False


@pytest.fixture
def fault(lab: Lab, request: pytest.FixtureRequest) -> Iterator[Scenario]:
    """A measured scenario: the watcher runs from here to the end of the test's body."""
    scenario = Scenario(lab)
    request.node.stash[SCENARIO] = scenario
    scenario.begin()
    try:
        yield scenario
    finally:
        scenario.close()


def _ours(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).parents


def _name(item: pytest.Item) -> str:
    doc = getattr(getattr(item, "function", None), "__doc__", None)
    name = (doc or item.name).strip().splitlines()[0].rstrip(".")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return name.format(**params) if params else name


def _rows(config: pytest.Config) -> dict[str, Row]:
    return config.stash.setdefault(ROWS, {})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        yield
    except BaseException:
        scenario = item.stash.get(SCENARIO, None)
        if scenario is not None:
            try:
                scenario.measure()  # for the table; the test has failed already
            except Exception:  # the lab itself may be what broke
                pass
        raise
    scenario = item.stash.get(SCENARIO, None)
    if scenario is not None:
        scenario.check()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                      pytest.TestReport]:
    report = yield
    if not _ours(item):
        return report
    row = _rows(item.config).setdefault(item.nodeid, Row(_name(item)))
    if report.when == "setup" and not report.passed:
        row.result = "skipped" if report.skipped else "error"
    elif report.when == "call":
        # A known defect pinned by a strict xfail reads as such, not as "skipped".
        row.result = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    elif report.when == "teardown" and report.failed and row.result == "passed":
        row.result = "error"
    scenario = item.stash.get(SCENARIO, None)
    if scenario is not None and scenario.metrics is not None:
        row.metrics = scenario.metrics
    return report


def _figure(value: int | None) -> str:
    return "-" if value is None else str(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    rows = list(_rows(terminalreporter.config).values())
    if not rows:
        return
    table = [("scenario", "result", "intents lost", "double holders", "forced stops",
              "recovery")]
    for row in rows:
        m = row.metrics
        table.append((
            row.scenario, row.result,
            _figure(m.intents_lost if m else None),
            _figure(m.double_holders if m else None),
            _figure(m.forced_stops if m else None),
            f"{m.recovery_s:.1f}s" if m and m.recovery_s is not None else "-",
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    terminalreporter.section("fault injection")
    for r in table:
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(r, widths,
                                                                          strict=True)).rstrip())
    passed = sum(r.result == "passed" for r in rows)
    failed = sum(r.result in ("failed", "error") for r in rows)
    terminalreporter.write_line(f"{passed} passed, {failed} failed")
