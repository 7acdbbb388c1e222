"""Fixtures for the unit tests: a fake sysfs tree, built per test; journal records kept
in memory (`sink`, for the tests that read what the agent journals)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hostagent import journal
from tests.sysfs import FakeSysfs


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


@pytest.fixture
def sink() -> Iterator[journal.ListSink]:
    listed = journal.ListSink()
    previous = journal.use_sink(listed)
    yield listed
    journal.use_sink(previous)
