"""The state file's durability, checked step by step: the file fsynced before its
rename, the directory after it (without that, the rename can be lost in a power cut
and the previous state comes back), and a state submitted while a save runs saved
next, never dropped. Each is shown by what happened, in order, not by a wait that
times out: a lost save used to show only as a test hanging for 300 s."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from hostagent.host.state import Saver, State, load_state, save_state
from tests.waiting import until


def test_the_file_then_the_directory_are_fsynced_around_the_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state" / "state.toml"
    steps: list[str] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            steps.append(f"fsync dir {info.st_ino == path.parent.stat().st_ino}")
        else:
            steps.append("fsync file")
        fsync(fd)

    def recorded_replace(src: str, dst: Path) -> None:
        steps.append("rename")
        replace(src, dst)

    monkeypatch.setattr("hostagent.host.state.os.fsync", recorded_fsync)
    monkeypatch.setattr("hostagent.host.state.os.replace", recorded_replace)
    save_state(path, State(hold=True))
    assert steps == ["fsync file", "rename", "fsync dir True"]
    assert load_state(path) == (State(hold=True), None)


class GatedDisk:
    """save_state that, in the worker thread, says it has begun and waits to be let go."""

    def __init__(self) -> None:
        self.begun = threading.Event()
        self.go_on = threading.Event()
        self.saved: list[State] = []

    def __call__(self, path: Path, state: State) -> None:
        self.begun.set()
        self.go_on.wait(timeout=60)
        save_state(path, state)
        self.saved.append(state)


async def test_a_state_submitted_mid_save_is_saved_next(tmp_path: Path) -> None:
    disk = GatedDisk()
    saver = Saver(tmp_path / "state.toml", write=disk)
    first = saver.submit(State(hold=True))
    try:
        await until(disk.begun.is_set, "the first save begun")
        later = saver.submit(State(cordoned_by_us=True))  # while the first is on disk
    finally:
        disk.go_on.set()
    # Once the saver has nothing left to do, both are answered: no bound to wait out.
    assert await saver.flush() is None and not saver.busy
    assert first.done() and later.done(), "the state submitted mid-save was dropped"
    assert (first.result(), later.result()) == (None, None)
    assert disk.saved == [State(hold=True), State(cordoned_by_us=True)]
    assert load_state(tmp_path / "state.toml") == (State(cordoned_by_us=True), None)
