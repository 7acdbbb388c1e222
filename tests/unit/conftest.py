"""Fixtures for the unit tests: a fake sysfs tree, built per test; a `Kube` connected
to the test module's own `api` fixture (the real control plane behind its fault proxy,
seeded as that module needs: tests/unit/kube_scaffold.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hostagent.cluster.kube import Kube
from tests.sysfs import FakeSysfs
from tests.unit.kube_scaffold import FAST, Api


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")



@pytest.fixture
async def kube(api: Api, tmp_path: Path) -> AsyncIterator[Kube]:
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=FAST) as k:
        yield k


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The host's zone is Europe/Berlin for the C library and for zoneinfo."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()
