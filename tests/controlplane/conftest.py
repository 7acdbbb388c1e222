"""One real control plane per test process (pytest-xdist runs several), started at
its first use and stopped at the end; tests reset what they create (their own
namespaces and nodes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.controlplane import ControlPlane, missing


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
