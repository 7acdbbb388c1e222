"""A state file from another version of hostagent is migrated, never set aside empty.

A rollback (a newer hostagent's file read by this one) must not drop a hold or a
pending start, and an upgrade reads the older file through each migration in turn.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from hostagent.host import state as persisted
from hostagent.host.state import Intent, IntentSource, IntentStatus, State, load_state

NEWER = b"""\
version = 7
hold = true
cordoned_by_us = true
reclaiming = "maybe"          # its type changed in that version
lendee_phase = "adopting"
a_key_of_its_own = 3

[[intents]]
id = "a"
owner = "gaming1"
created = 2026-01-10T20:15:01Z
source = "calendar"
status = "verifying"
priority = 2

[[intents]]
id = "b"
owner = "gaming2"
created = 2026-01-10T20:15:03Z

[[intents]]
owner = "gaming3"
"""


def test_a_newer_file_keeps_its_hold_and_pending_starts(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_bytes(NEWER)
    state, warning = load_state(path)
    assert state.hold and state.cordoned_by_us and not state.reclaiming
    t = datetime(2026, 1, 10, 20, 15, 1, tzinfo=UTC)
    assert state.intents == (
        Intent(id="a", owner="gaming1", created=t, source=IntentSource.RESUME,
               status=IntentStatus.PENDING),
        Intent(id="b", owner="gaming2", created=t.replace(second=3),
               source=IntentSource.RESUME, status=IntentStatus.PENDING))
    assert warning is not None
    assert "version 7" in warning and "reclaiming" in warning and "intents[2]" in warning
    # Nothing set aside empty; the newer file is copied for the version that wrote it.
    assert not list(tmp_path.glob("state.toml.corrupt-*"))
    (copy,) = tmp_path.glob("state.toml.v7-*")
    assert copy.read_bytes() == NEWER and str(copy) in warning
    assert path.read_bytes() == NEWER  # until the agent saves what it read


def test_an_older_file_goes_through_each_migration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the next format will: version 1 renamed `hold` to `held` in version 2, say."""
    def one_to_two(doc: dict[str, object]) -> dict[str, object]:
        doc["held"] = doc.pop("hold", False)
        return doc

    def two_to_three(doc: dict[str, object]) -> dict[str, object]:
        doc["hold"] = doc.pop("held")
        return doc

    monkeypatch.setattr(persisted, "STATE_VERSION", 3)
    monkeypatch.setattr(persisted, "MIGRATIONS", {1: one_to_two, 2: two_to_three})
    path = tmp_path / "state.toml"
    path.write_text('version = 1\nhold = true\n[[intents]]\nid = "a"\nowner = "gaming1"\n'
                    'created = 2026-01-10T20:15:01Z\nsource = "hook"\nstatus = "pending"\n')
    state, warning = load_state(path)
    assert warning is None
    assert state.hold and [i.owner for i in state.intents] == ["gaming1"]
    assert not list(tmp_path.glob("state.toml.*-*"))


def test_a_version_with_no_way_back_is_still_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_text("version = 0\nhold = true\n")
    state, warning = load_state(path)
    assert state == State() and warning is not None and "version 0" in warning
    assert list(tmp_path.glob("state.toml.corrupt-*"))
