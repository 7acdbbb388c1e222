"""What the tests of the SSH endpoint share: keys, stand-in verbs that record their
calls, and a client connection as `ssh host verb` makes one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncssh

VERBS = frozenset({"status", "play", "release", "hold", "resume", "lend", "reclaim"})
KEY_A = asyncssh.generate_private_key("ssh-ed25519", comment="button")
KEY_B = asyncssh.generate_private_key("ssh-ed25519", comment="admin")
KEY_C = asyncssh.generate_private_key("ssh-ed25519", comment="stranger")


def pub(key: asyncssh.SSHKey, comment: str = "") -> str:
    line = key.export_public_key().decode().strip()
    return " ".join(line.split()[:2]) + (f" {comment}" if comment else "")


class Verbs:
    """Stand-in verbs that record their calls: play streams two steps, then succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.release_started = asyncio.Event()
        self.release_closed = asyncio.Event()

    def table(self) -> dict[str, Any]:
        return {v: getattr(self, f"_{v}", self._plain(v)) for v in sorted(VERBS)}

    async def _play(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("play", args))
        yield {"event": "phase", "message": "draining gpu-node", "elapsed_s": 0.0,
               "waiting": "gpu-node's node to drain"}
        yield {"event": "phase", "message": "gpu-node is off", "elapsed_s": 0.1}
        yield {"ok": True, "data": {"vm": args["vm"], "message": f"{args['vm']} is running"}}

    async def _release(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(("release", args))
        try:
            self.release_started.set()
            yield {"event": "release", "message": "shutting down", "elapsed_s": 0.0}
            await asyncio.sleep(3600)
            yield {"ok": True, "data": {}}
        finally:
            self.release_closed.set()

    def _plain(self, verb: str) -> Any:
        async def handler(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            self.calls.append((verb, args))
            yield {"ok": verb != "reclaim", "data": {"message": f"{verb} done"},
                   "error": "the lendee is stuck"}
        return handler


def connect(port: int, key: asyncssh.SSHKey, tmp_path: Path) -> Any:
    host_key = asyncssh.read_private_key(tmp_path / "host_key")
    known = asyncssh.import_known_hosts(
        f"[127.0.0.1]:{port} {host_key.export_public_key().decode()}")
    return asyncssh.connect("127.0.0.1", port, username="hostagent", client_keys=[key],
                            known_hosts=known, agent_path=None, config=None,
                            password_auth=False, kbdint_auth=False)


async def run(port: int, key: asyncssh.SSHKey, tmp_path: Path, line: str) -> Any:
    """One command on a connection of its own, as `ssh host verb` runs it."""
    async with connect(port, key, tmp_path) as conn:
        return await conn.run(line)
