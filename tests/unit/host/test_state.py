"""Persisted state: round trip, atomic replace, and a bad file set aside, never trusted."""

from __future__ import annotations

import os
import tomllib
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from hostagent.host.state import (
    STATE_VERSION,
    Intent,
    IntentSource,
    IntentStatus,
    State,
    load_state,
    save_state,
)
from tests import waiting

T0 = datetime(2026, 1, 10, 20, 15, 1, 998000, tzinfo=UTC)

FULL = State(
    intents=(
        Intent(id="0b9e2c7a", owner="gaming1", created=T0, source=IntentSource.HOOK),
        Intent(
            id="77aa",
            owner="gaming2",
            created=T0 + timedelta(seconds=3),
            source=IntentSource.CONTROL,
            status=IntentStatus.RECLAIMING,
        ),
    ),
    cordoned_by_us=True,
    lendee_phase="draining",
    lendee_phase_since=T0,
    last_verified=datetime(2026, 1, 10, 18, 0, 41, tzinfo=timezone(timedelta(hours=-5))),
)


def test_missing_file_is_a_fresh_state(tmp_path: Path) -> None:
    assert load_state(tmp_path / "state.toml") == (State(), None)


@pytest.mark.parametrize("state", [State(), FULL], ids=["empty", "full"])
def test_round_trip(tmp_path: Path, state: State) -> None:
    path = tmp_path / "state.toml"
    save_state(path, state)
    assert load_state(path) == (state, None)


def test_file_is_readable_toml(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save_state(path, FULL)
    doc = tomllib.loads(path.read_text())
    assert doc["version"] == STATE_VERSION
    assert doc["cordoned_by_us"] is True
    assert doc["intents"][0] == {
        "id": "0b9e2c7a",
        "owner": "gaming1",
        "created": T0,
        "source": "hook",
        "status": "pending",
    }
    assert path.stat().st_mode & 0o777 == 0o644


def test_save_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "var" / "lib" / "hostagent" / "state.toml"
    save_state(path, FULL)
    assert load_state(path) == (FULL, None)


def test_save_replaces_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save_state(path, State())
    save_state(path, FULL)
    assert os.listdir(tmp_path) == ["state.toml"]
    assert load_state(path) == (FULL, None)


def test_crash_before_rename_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.toml"
    save_state(path, FULL)
    before = path.read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="Input/output"):
        save_state(path, State())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.toml"]


def test_naive_time_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    with pytest.raises(ValueError, match="time zone"):
        save_state(path, State(last_verified=datetime(2026, 1, 1)))
    assert os.listdir(tmp_path) == []


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_text("version = 1\ncordoned_by_us = true\nsomething_new = 3\n")
    assert load_state(path) == (State(cordoned_by_us=True), None)


GOOD_INTENT = (
    '[[intents]]\nid = "a"\nowner = "gaming1"\ncreated = 2026-01-10T20:15:01Z\n'
    'source = "hook"\nstatus = "pending"\n'
)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "no version number"),
        (b"\x00\x17\xff garbage \xfe", "not valid TOML"),
        (b"version = 1\ncordoned_by_us = tr", "not valid TOML"),  # truncated mid-write
        (b'version = 1\n[[intents]]\nid = "a"\nowner = "gam', "not valid TOML"),
        (b"version = 0\n", "version 0"),  # older than any format (newer: migrated)
        (b'version = "1"\n', "version '1'"),
        (b"version = true\n", "version True"),
        (b"cordoned_by_us = false\n", "no version number"),
        (b'version = 1\ncordoned_by_us = "yes"\n', "cordoned_by_us = 'yes'"),
        (b"version = 1\nlendee_phase_since = 2026-01-10T20:15:01\n", "without a time zone"),
        (b'version = 1\nlast_verified = "yesterday"\n', "last_verified = 'yesterday'"),
        (b"version = 1\nintents = [1]\n", "intents[0] that is not a table"),
        (b'version = 1\nintents = "none"\n', "intents = 'none'"),
        (b'version = 1\n[[intents]]\nid = "a"\n', "without owner, created, source, status"),
        (b"version = 1\n" + GOOD_INTENT.replace("hook", "cron").encode(), "'cron'"),
        (b"version = 1\n" + GOOD_INTENT.replace("pending", "done").encode(), "'done'"),
        (b"version = 1\n" + (GOOD_INTENT * 2).encode(), "intent id twice"),
    ],
)
def test_bad_file_is_set_aside(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "state.toml"
    path.write_bytes(content)
    state, warning = load_state(path)
    assert state == State()
    assert warning is not None
    assert why in warning
    (copy,) = tmp_path.glob("state.toml.corrupt-*")
    assert copy.read_bytes() == content
    assert str(copy) in warning
    assert not path.exists()
    # The agent saves its rebuilt state next; the copy stays for a person to read.
    save_state(path, FULL)
    assert load_state(path) == (FULL, None)
    assert copy.exists()


def test_one_good_intent_loads(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_text("version = 1\n" + GOOD_INTENT)
    state, warning = load_state(path)
    assert warning is None
    assert state.intents == (
        Intent(
            id="a",
            owner="gaming1",
            created=datetime(2026, 1, 10, 20, 15, 1, tzinfo=UTC),
            source=IntentSource.HOOK,
        ),
    )


def test_unreadable_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.mkdir()  # reading a directory fails like an unreadable file does
    state, warning = load_state(path)
    assert state == State()
    assert warning is not None and "cannot be read" in warning
    assert list(tmp_path.glob("state.toml.corrupt-*"))


def test_bad_file_that_cannot_be_moved_is_still_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.toml"
    path.write_bytes(b"garbage = ")

    def refuse(src: object, dst: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", refuse)
    state, warning = load_state(path)
    assert state == State()
    assert warning is not None
    assert "could not be moved" in warning and "Read-only file system" in warning


def test_hold_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save_state(path, State(hold=True))
    loaded, warning = load_state(path)
    assert warning is None and loaded.hold is True
    save_state(path, State())
    assert load_state(path)[0].hold is False


def test_relend_time_survives_a_restart(tmp_path: Path) -> None:
    # Without it, an agent restarted during policy.relend_delay lent the GPUs at once.
    path = tmp_path / "state.toml"
    at = T0 + timedelta(minutes=5)
    save_state(path, State(relend_at=at))
    assert tomllib.loads(path.read_text())["relend_at"] == at
    assert load_state(path) == (State(relend_at=at), None)


def test_a_file_written_before_relend_at_existed_loads(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_text('version = 1\ncordoned_by_us = false\nhold = true\nintents = []\n')
    assert load_state(path) == (State(hold=True), None)
    save_state(path, State())
    assert "relend_at" not in tomllib.loads(path.read_text())


def test_a_naive_relend_time_sets_the_file_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    path.write_text('version = 1\nrelend_at = 2026-01-10T21:00:00\n')
    state, warning = load_state(path)
    assert state == State() and warning is not None and "relend_at" in warning


# --- Saver: the two fsyncs off the event loop ------------------------------------------


class SlowDisk:
    """save_state behind a disk that takes `delay` seconds per save, in the worker."""

    def __init__(self, delay: float, fail: OSError | None = None) -> None:
        self.delay = delay
        self.fail = fail
        self.saved: list[State] = []

    def __call__(self, path: Path, state: State) -> None:
        import time
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        save_state(path, state)
        self.saved.append(state)


class HeldDisk:
    """save_state behind a disk that holds each save, in the worker, until the test
    lets it go (`release`, set from the event loop); `began` once a save is under way.
    A save made on the event loop could never be let go: it gives up after the suite's
    bound."""

    def __init__(self) -> None:
        import threading
        self.began = threading.Event()
        self.release = threading.Event()
        self.saved: list[State] = []

    def __call__(self, path: Path, state: State) -> None:
        self.began.set()
        if not self.release.wait(waiting.BOUND):
            raise AssertionError("the save was never let go: it held the event loop")
        save_state(path, state)
        self.saved.append(state)


async def test_a_slow_save_does_not_hold_the_event_loop(tmp_path: Path) -> None:
    # save_state's two fsyncs ran on the loop: on a busy disk the hook socket's answer
    # (budget 0.3 s) waited behind them.
    from hostagent.host.state import Saver
    disk = HeldDisk()
    saver = Saver(tmp_path / "state.toml", write=disk)
    done = saver.submit(State(hold=True))
    await waiting.until(disk.began.is_set, "the save under way")
    # The loop goes on while the disk works: it is the loop that lets the save go.
    assert not done.done()
    disk.release.set()
    assert await done is None
    assert load_state(tmp_path / "state.toml") == (State(hold=True), None)


async def test_saves_queued_behind_a_slow_one_are_merged_into_one(tmp_path: Path) -> None:
    import asyncio
    from hostagent.host.state import Saver
    disk = HeldDisk()
    saver = Saver(tmp_path / "state.toml", write=disk)
    first = saver.submit(State(hold=True))
    await waiting.until(disk.began.is_set, "the first save under way")
    later = [saver.submit(State(cordoned_by_us=bool(i % 2))) for i in range(10)]
    disk.release.set()
    assert await asyncio.gather(first, *later) == [None] * 11
    assert disk.saved == [State(hold=True), State(cordoned_by_us=True)]
    assert await saver.flush() is None and not saver.busy


async def test_a_failed_save_is_reported_and_the_next_one_tries_again(tmp_path: Path) -> None:
    import errno
    from hostagent.host.state import Saver
    disk = SlowDisk(0.0, fail=OSError(errno.ENOSPC, "No space left on device"))
    saver = Saver(tmp_path / "state.toml", write=disk)
    error = await saver.submit(State(hold=True))
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    assert saver.last_error is error
    disk.fail = None
    assert await saver.submit(State(hold=True)) is None
    assert saver.last_error is None
