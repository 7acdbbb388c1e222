"""Fixtures shared by the test topics: the lab, started once per session; the real
Kubernetes control plane, one per test process (pytest-xdist runs several), started at
its first use and stopped at the end (tests reset what they create: their own
namespaces, objects and nodes); journal records kept in memory (`sink`, for the tests
that read what the agent journals)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from hostagent import journal
from tests.controlplane import ControlPlane, missing
from tests.lab.lab import Lab, need_lab

# The fault suite's table and the figures tests measure, printed by whichever process
# prints the summary.
pytest_plugins = ["tests.faults.table", "tests.figures"]


@pytest.fixture
def sink() -> Iterator[journal.ListSink]:
    listed = journal.ListSink()
    previous = journal.use_sink(listed)
    yield listed
    journal.use_sink(previous)


@pytest.fixture(scope="session")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    reason = missing()
    if reason:
        pytest.skip(reason)
    control = ControlPlane(tmp_path_factory.mktemp("controlplane")).start()
    print(f"\nkube-apiserver {control.version()} (tests/controlplane)")
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture(scope="session")
def lab_session() -> Iterator[Lab]:
    reason = need_lab()
    if reason:
        pytest.skip(reason)
    # Short path: unix socket paths under it must stay below 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="hostagent-lab-"))
    lab = Lab(root)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


@pytest.fixture
def lab(lab_session: Lab) -> Iterator[Lab]:
    """The session's lab with every VM off and an empty spool, before and after."""
    lab_session.reset()
    lab_session.partial = True
    yield lab_session
    lab_session.reset()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most lab tests first (`make test` spreads whole files over
    processes, in this order): each of those tests boots guests, where a unit test takes
    milliseconds, so the longest files start first and the short ones fill in after."""
    labs: dict[str, int] = {}
    for item in items:
        labs[str(item.path)] = labs.get(str(item.path), 0) + ("lab" in item.fixturenames)
    order = {path: rank for rank, path in enumerate(sorted(labs, key=lambda p: -labs[p]))}
    items.sort(key=lambda item: order[str(item.path)])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                     pytest.TestReport]:
    """A lab test that fails shows what the agent journaled during it (the last 80
    records): a timeout on a loaded machine says which step was slow."""
    report = yield
    lab = getattr(item, "funcargs", {}).get("lab")
    if report.when == "call" and report.failed and isinstance(lab, Lab):
        try:
            records = lab.records()[-80:]
        except Exception as e:  # the lab itself may be what broke
            records, why = [], f"(the journal could not be read: {e})"
        else:
            why = "(none)" if not records else ""
        lines = [f"{clock(int(r['__REALTIME_TIMESTAMP']))} {r.get('HOSTAGENT_EVENT', '-')}: "
                 f"{r.get('MESSAGE', '')!s:.300}" for r in records]
        report.sections.append(("hostagent's journal during the test", "\n".join(lines) or why))
    return report


def clock(us: int) -> str:
    """A journal timestamp (µs) as UTC hh:mm:ss.mmm."""
    return f"{time.strftime('%H:%M:%S', time.gmtime(us // 10**6))}.{us // 1000 % 1000:03d}"
