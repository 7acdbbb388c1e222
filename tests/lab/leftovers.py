"""What a lab started, found again and ended: its guests included, and whatever the test
did to its libvirtd.

libvirtd starts each QEMU guest daemonized, in a session of its own: a guest outlives a
libvirtd that is killed, and a test process that dies without taking its lab down
leaves both behind (two TCG guests and their agent were once found running after a
run, their libvirtd gone). So a lab's processes are found by what marks them, not by
whose children they are:

- its directory on their command line (QEMU's disks, consoles and pid files; the
  control plane's data directory),
- `MARKER` in their environment (every process the lab spawns; libvirtd clears the
  environment of the guests it starts, hence the first),
- its mount namespace (everything started inside it, guests included),
- the pid files libvirtd writes for its guests (`run-libvirt/qemu/<name>.pid`).

A test run registers each lab it brings up in `RUN`'s directory (set by the run's
controlling process, tests/conftest.py), which checks at the very end that none of
them left a process (`check_run`). Standard library only."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

MARKER = "HOSTAGENT_LAB"  # = the lab's directory, in each process the lab spawns
RUN = "HOSTAGENT_LAB_RUN"  # = a directory where a test run's labs are registered
END_BOUND = 10.0  # seconds a SIGKILLed process may take to be gone (out of D state)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def running(pid: int) -> bool:
    """Whether `pid` runs: a zombie has ended, its parent not having reaped it yet."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    return bool(stat) and stat.rsplit(b")", 1)[-1].split()[:1] != [b"Z"]


def _names(cmdline: bytes, marks: tuple[bytes, ...]) -> bool:
    return any(m in cmdline + b"\0" for m in marks)


def lab_pids(root: Path, *, namespace: str | None = None) -> list[int]:
    """The processes of the lab at `root` (see the module docstring), this one aside.
    `namespace`: the lab's mount namespace (`readlink /proc/<holder>/ns/mnt`)."""
    marks = (f"{root}/".encode(), f"{root}\0".encode())
    env = f"{MARKER}={root}".encode()
    found = set()
    for pidfile in (root / "run-libvirt" / "qemu").glob("*.pid"):
        text = _read(pidfile).strip()
        # A pid libvirtd wrote may be another process's by now: only a command line that
        # names the lab counts.
        if text.isdigit() and _names(_read(Path(f"/proc/{int(text)}/cmdline")), marks):
            found.add(int(text))
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        if _names(_read(p / "cmdline"), marks) or env in _read(p / "environ").split(b"\0"):
            found.add(int(p.name))
        elif namespace is not None:
            try:
                if os.readlink(p / "ns" / "mnt") == namespace:
                    found.add(int(p.name))
            except OSError:
                pass
    return sorted(pid for pid in found if running(pid))


def end(pids: list[int], *, bound: float = END_BOUND) -> list[int]:
    """SIGKILL each of `pids` and wait until they are gone, at most `bound` seconds;
    those still there (should be none)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + bound
    left = [pid for pid in pids if running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if running(pid)]
    return left


def describe(pid: int) -> str:
    cmdline = _read(Path(f"/proc/{pid}/cmdline")).replace(b"\0", b" ").decode(errors="replace")
    return f"{pid} {cmdline.strip()[:200] or '(gone)'}"


def register(root: Path) -> None:
    """Note the lab at `root` in the run's registry, if a run keeps one."""
    run = os.environ.get(RUN)
    if run:
        Path(run).mkdir(parents=True, exist_ok=True)
        (Path(run) / root.name).write_text(str(root))


def check_run(run: Path) -> list[str]:
    """The processes that the run's labs left, each ended now: one line each, what it
    was (none: the run left nothing running)."""
    left = []
    for entry in sorted(run.glob("*")) if run.is_dir() else []:
        root = Path(entry.read_text())
        pids = lab_pids(root)
        left += [describe(pid) for pid in pids]
        survivors = end(pids)
        left += [f"{pid} survived SIGKILL for {END_BOUND:g}s" for pid in survivors]
    return left


if __name__ == "__main__":  # the lab's holder, once the process that owned the lab is gone
    end(lab_pids(Path(sys.argv[1]), namespace=os.readlink("/proc/self/ns/mnt")))
