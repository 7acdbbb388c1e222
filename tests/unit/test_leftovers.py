"""The check that a test run's labs left nothing running (tests/lab/leftovers.py),
without a lab: processes marked as a lab marks them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab import leftovers

PAUSE = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_run_finds_and_ends_what_its_labs_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, run = tmp_path / "lab", tmp_path / "run"
    (root / "run-libvirt" / "qemu").mkdir(parents=True)
    monkeypatch.setenv(leftovers.RUN, str(run))
    leftovers.register(root)
    marked = subprocess.Popen(PAUSE, env={**os.environ, leftovers.MARKER: str(root)})
    # A guest: libvirtd gives it a clean environment; its disks name the lab's directory.
    guest = subprocess.Popen([*PAUSE, f"file={root}/gpus/gpu-a.img"])
    (root / "run-libvirt" / "qemu" / "gaming1.pid").write_text(str(guest.pid))
    others = [subprocess.Popen(PAUSE),  # not the lab's
              subprocess.Popen([*PAUSE, f"{root}-other/x"])]  # another lab's
    try:
        left = leftovers.check_run(run)
        assert sorted(int(line.split()[0]) for line in left) == sorted([marked.pid, guest.pid])
        assert marked.wait(10) == guest.wait(10) == -9
        assert [p.poll() for p in others] == [None, None]
        assert leftovers.check_run(run) == []
    finally:
        for p in (marked, guest, *others):
            p.kill()
            p.wait()
