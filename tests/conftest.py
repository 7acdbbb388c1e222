"""Fixtures shared by the test topics: the lab, started once per session; the real
Kubernetes control plane, one per test process (pytest-xdist runs several), started at
its first use and stopped at the end (tests reset what they create: their own
namespaces, objects and nodes); journal records kept in memory (`sink`, for the tests
that read what the agent journals)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from hostagent.host import journal
from tests.controlplane import ControlPlane, missing
from tests.lab import leftovers
from tests.lab.lab import Lab, need_lab

# Hypothesis, in `make test` and any plain pytest run: the same examples every run, so a
# failure is the code's and comes back on the next run, not a draw that a later run
# misses; no per-example deadline and no too-slow health check, clocks that a loaded
# machine fails. `make explore` selects "explore" (--hypothesis-profile): random draws,
# many more of them, each failure printed with the blob that replays it. Settings that a
# test gives itself (its number of examples) are made from the profile loaded here.
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True,
                          max_examples=int(os.environ.get("HOSTAGENT_EXPLORE_EXAMPLES", "2000")))
# `make mutate` selects "mutate": the same draws, and a failure is not shrunk, since only
# whether a test fails on a mutant counts (shrinking it took minutes each).
settings.register_profile("mutate", parent=settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("ci")

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
    """The longest files first (`make test` spreads whole files over processes, in this
    order), so that the last to start are short ones that fill in, not a lab file that
    runs on alone at the end: each file's seconds from tests/times.json (a measured run,
    see `TIMES`), else 30 s per lab test in it (each boots guests; a unit test takes
    milliseconds)."""
    measured = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    guess: dict[str, float] = {}
    for item in items:
        name = _file(item.nodeid)
        guess[name] = guess.get(name, 0.0) + (30.0 if "lab" in getattr(item, "fixturenames", ()) else 0.01)
    weight = {name: measured.get(name, guess[name]) for name in guess}
    order = {name: rank for rank, name in enumerate(sorted(weight, key=lambda n: -weight[n]))}
    items.sort(key=lambda item: order[_file(item.nodeid)])


# Each file's seconds in a run (setup, call and teardown of its tests), for the order
# above: `HOSTAGENT_TEST_TIMES=1 make test` writes them to tests/times.json at the end
# (the process that prints the summary hears every test's report).
TIMES = Path(__file__).with_name("times.json")
_spent: dict[str, float] = {}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = _file(report.nodeid)
    _spent[name] = _spent.get(name, 0.0) + report.duration


def pytest_configure(config: pytest.Config) -> None:
    """The run's registry of labs (tests/lab/leftovers.py), made by the process that
    controls the run; its test processes (pytest-xdist's workers) inherit it."""
    if not hasattr(config, "workerinput"):
        run = Path(tempfile.mkdtemp(prefix="hostagent-labs-"))
        os.environ[leftovers.RUN] = str(run)
        config.stash[_RUN] = run


_RUN = pytest.StashKey[Path]()


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which waits for its workers to end
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return
    if os.environ.get("HOSTAGENT_TEST_TIMES"):
        TIMES.write_text(json.dumps({name: round(seconds, 1) for name, seconds
                                     in sorted(_spent.items())}, indent=0) + "\n")
    # A lab leaves nothing running, however its test ended, its process included: what
    # one left fails the run, and is ended here.
    run = session.config.stash.get(_RUN, None)
    if run is None:
        return
    left = leftovers.check_run(run)
    shutil.rmtree(run, ignore_errors=True)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("the labs of this run left processes running (now killed):\n  "
                   + "\n  ".join(left))
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
