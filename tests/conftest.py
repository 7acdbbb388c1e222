"""Fixtures shared by the test topics: the lab, started once per session."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lab.lab import Lab, need_lab


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
