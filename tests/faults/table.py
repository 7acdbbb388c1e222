"""The fault-injection suite's table: one row per scenario, printed at the end.

Every test of tests/faults gets a row, named by the first line of its docstring (with
its parameters filled in), with the figures of its scenario (the security checks have a
result only). The row travels in the test's report (`user_properties`), so that the
table is whole when the tests run in several processes (pytest-xdist): the process that
prints the summary gathers what the others report. Registered by tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faults.scenario import Scenario

HERE = Path(__file__).parent
SCENARIO = pytest.StashKey[Scenario]()
PROPERTY = "fault row"


@dataclass
class Row:
    scenario: str
    result: str = "not run"
    metrics: dict[str, Any] | None = None


def _ours(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).parents


def _name(item: pytest.Item) -> str:
    doc = getattr(getattr(item, "function", None), "__doc__", None)
    name = (doc or item.name).strip().splitlines()[0].rstrip(".")
    params = getattr(getattr(item, "callspec", None), "params", {})
    return name.format(**params) if params else name


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                      pytest.TestReport]:
    report = yield
    if _ours(item):
        scenario = item.stash.get(SCENARIO, None)
        metrics = scenario.metrics if scenario is not None else None
        report.user_properties.append((PROPERTY, {
            "scenario": _name(item),
            # A known defect pinned by a strict xfail reads as such, not as "skipped".
            "xfailed": hasattr(report, "wasxfail"),
            "metrics": asdict(metrics) if metrics is not None else None}))
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Table(), "fault table")


def _figure(value: int | None) -> str:
    return "-" if value is None else str(value)


class Table:
    """The rows, from the reports (of this process's tests, or of other processes')."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        mine: list[Any] = [v for k, v in report.user_properties if k == PROPERTY]
        if not mine:
            return
        told: dict[str, Any] = mine[-1]
        row = self.rows.setdefault(report.nodeid, Row(told["scenario"]))
        if told["metrics"] is not None:
            row.metrics = told["metrics"]
        if report.when == "setup" and not report.passed:
            row.result = "skipped" if report.skipped else "error"
        elif report.when == "call":
            row.result = "xfailed" if told["xfailed"] else report.outcome
        elif report.when == "teardown" and report.failed and row.result == "passed":
            row.result = "error"

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.rows:
            return
        # By file, in the order run within each (processes finish files in any order).
        rows = [self.rows[k] for k in sorted(self.rows, key=lambda k: k.split("::")[0])]
        table = [("scenario", "result", "intents lost", "double holders", "forced stops",
                  "recovery")]
        for row in rows:
            m = row.metrics
            table.append((
                row.scenario, row.result,
                _figure(m["intents_lost"] if m else None),
                _figure(m["double_holders"] if m else None),
                _figure(m["forced_stops"] if m else None),
                f"{m['recovery_s']:.1f}s" if m and m["recovery_s"] is not None else "-",
            ))
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        terminalreporter.section("fault injection")
        for r in table:
            terminalreporter.write_line("  ".join(
                c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        passed = sum(r.result == "passed" for r in rows)
        failed = sum(r.result in ("failed", "error") for r in rows)
        terminalreporter.write_line(f"{passed} passed, {failed} failed")
