"""Fixtures for the unit tests: a fake sysfs tree, built per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sysfs import FakeSysfs


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "sys")
