"""Figures a test measures (`record_property("figure", text)`), printed together at the
end of the run: a passing test's output is not shown, and under pytest-xdist only the
reports reach the process that prints the summary. Figures, never assertions on time.
Registered by tests/conftest.py."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Figures(), "figures")


class Figures:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.lines += [(report.nodeid, str(v)) for k, v in report.user_properties
                           if k == "figure"]

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.lines:
            return
        terminalreporter.section("figures measured by the tests")
        for nodeid, text in sorted(self.lines):
            terminalreporter.write_line(f"{nodeid.split('::')[-1]}: {text}")
