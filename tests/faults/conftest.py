"""The fault-injection suite's fixtures: a test that takes `fault` is a measured
scenario. Once its body has run, its figures are taken (see scenario.py) and any intent
lost, any GPU held twice or any forced stop beyond the policy fails it; its row in the
table printed at the end comes from there (tests/faults/table.py)."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from tests.faults.scenario import Scenario
from tests.faults.table import SCENARIO
from tests.lab.lab import Lab


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
