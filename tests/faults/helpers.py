"""What the fault tests share (and bench/hook.py): the node's cordon and its marker,
known_hosts for the lab's SSH endpoint, a flood of SSH sessions, a slow disk, a forged
journal record."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


from tests.faults.scenario import wait_for
from tests.lab.cluster import LabCluster
from tests.lab.lab import Lab



MARKER = "hostagent.io/cordoned-by"


def cordoned(kc: LabCluster) -> bool:
    return bool(kc.node()["spec"].get("unschedulable"))


def marker(kc: LabCluster) -> str | None:
    annotations: dict[str, str] = kc.node()["metadata"].get("annotations") or {}
    return annotations.get(MARKER)


# A listed key's client gone wrong, or turned: on each connection it asks for `per`
# sessions at once, each running `status`; when the connection ends it connects again.
# After each connection it writes "connections commands-run" to `stats`.
SESSION_FLOOD = r"""
import asyncio, os, sys
import asyncssh
port, key, known, per, stats = int(sys.argv[1]), *sys.argv[2:4], int(sys.argv[4]), sys.argv[5]

async def main():
    connections = ran = 0
    while True:
        try:
            async with asyncssh.connect("127.0.0.1", port, username="hostagent",
                                        client_keys=[key], known_hosts=known,
                                        agent_path=None, config=None) as conn:
                connections += 1
                results = await asyncio.gather(*(conn.run("status") for _ in range(per)),
                                               return_exceptions=True)
                ran += sum(getattr(r, "exit_status", None) == 0 for r in results)
        except (OSError, asyncssh.Error):
            await asyncio.sleep(0.01)
        with open(stats + ".tmp", "w") as f:
            f.write(f"{connections} {ran}\n")
        os.replace(stats + ".tmp", stats)

asyncio.run(main())
"""


def known_hosts(lab: Lab, port: int, tmp_path: Path) -> Path:
    host_key = lab.path("/var/lib/hostagent/ssh_host_ed25519_key.pub")
    wait_for(host_key.exists, 30, "the SSH host key")
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_key.read_text()}")
    return known


@contextlib.contextmanager
def slow_disk(lab: Lab, seconds: float) -> Iterator[None]:
    """Agents started inside wait `seconds` in each fsync, for their whole life."""
    shim = lab.root / "slow-disk"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLOW_FSYNC.format(seconds=seconds))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), before) if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


# An owner's start, as the agent records it: what `hostagent history` draws as gaming.
FORGED = {"MESSAGE": "gaming1: off to running", "SYSLOG_IDENTIFIER": "hostagent",
          "HOSTAGENT_EVENT": "owner", "HOSTAGENT_VM": "gaming1", "HOSTAGENT_FROM": "off",
          "HOSTAGENT_TO": "running", "HOSTAGENT_RESULT": "ok",
          "HOSTAGENT_HOLDERS": "gpu-a=gaming1,gpu-b=-,gpu-c=-"}


# Loaded by the agent's interpreter (a sitecustomize on its PYTHONPATH): every fsync
# waits first, as on an SD card or a disk busy with something else.
SLOW_FSYNC = """\
import os, time
_fsync = os.fsync
def _slow(fd):
    time.sleep({seconds})
    _fsync(fd)
os.fsync = _slow
"""
