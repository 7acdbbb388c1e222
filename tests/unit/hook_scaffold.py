"""The hook as libvirtd runs it (test_hook.py, test_agent_steps.py): the repository's
hooks/qemu in a process of its own, its socket and spool in `Place`."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path


HOOK = Path(__file__).resolve().parents[2] / "hooks" / "qemu"
XML = "<domain type='kvm'><name>gaming1</name><description>été</description></domain>\n"


@dataclass
class Run:
    rc: int
    stdout: bytes
    stderr: str
    elapsed: float


@dataclass
class Place:
    socket: Path
    spool: Path

    def spooled(self) -> list[Path]:
        return sorted(self.spool.glob("*.json")) if self.spool.is_dir() else []


async def run_hook(
    place: Place,
    *args: str,
    xml: str = XML,
    budget: float | str | None = None,
    spool: Path | None = None,
    argv0: list[str] | None = None,
) -> Run:
    env = {
        "PATH": "/usr/bin:/bin",  # libvirt gives hooks a fixed, short PATH
        "HOSTAGENT_SOCKET": str(place.socket),
        "HOSTAGENT_SPOOL": str(spool or place.spool),
    }
    if budget is not None:
        env["HOSTAGENT_HOOK_BUDGET"] = str(budget)
    cmd = argv0 if argv0 is not None else [sys.executable, "-I", "-S", str(HOOK)]
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await proc.communicate(xml.encode())
    elapsed = time.monotonic() - start
    assert proc.returncode is not None
    # libvirt reads a hook's stdout as replacement XML for migrate/restore.
    assert out == b"", out
    return Run(proc.returncode, out, err.decode(), elapsed)
