"""Fixtures for the unit tests: a fake sysfs tree, built per test; journal records kept
in memory (`sink`, for the tests that read what the agent journals); a `Kube` connected
to the test module's own `api` fixture (the real control plane behind its fault proxy,
seeded as that module needs: tests/unit/kube_scaffold.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hostagent import journal
from hostagent.kube import Kube
from tests.sysfs import FakeSysfs
from tests.unit.kube_scaffold import FAST, Api


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")


@pytest.fixture
def sink() -> Iterator[journal.ListSink]:
    listed = journal.ListSink()
    previous = journal.use_sink(listed)
    yield listed
    journal.use_sink(previous)


@pytest.fixture
async def kube(api: Api, tmp_path: Path) -> AsyncIterator[Kube]:
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=FAST) as k:
        yield k
