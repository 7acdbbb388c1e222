"""The control socket: how `hostagent status` (and later play/release) talk to the agent.

Versioned JSON lines on a Unix socket, one request per connection:

    client → agent  {"v":1,"verb":"status","args":{...}}
    agent → client  zero or more {"v":1,"type":"progress",...} lines, then one
                    {"v":1,"type":"result","ok":true,"data":{...}} or
                    {"v":1,"type":"result","ok":false,"error":"what went wrong and the fix"}

A bad request is answered with an error result and never stops the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
MAX_REQUEST = 64 * 1024

Reply = dict[str, Any]
# A verb handler yields progress dicts and finally a result: {"ok": bool, ...}.
VerbHandler = Callable[[dict[str, Any]], AsyncIterator[Reply]]


class ControlError(Exception):
    """The agent answered with an error, or could not be reached."""


def _line(obj: Reply) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **obj}, separators=(",", ":")).encode() + b"\n"


def _not_a_number(name: str) -> Any:
    raise ValueError(f"not JSON: {name} is not a number")


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    """The verb and arguments of a request line; ValueError names what is wrong."""
    try:
        obj = json.loads(line, parse_constant=_not_a_number)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from e
    except RecursionError:
        raise ValueError("not JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("a request is a JSON object")
    # `true` and `1.0` compare equal to 1 in Python; the version is the integer 1.
    if type(obj.get("v")) is not int or obj.get("v") != PROTOCOL_VERSION:
        raise ValueError(f"unsupported protocol version {obj.get('v')!r} "
                         f"(this agent speaks {PROTOCOL_VERSION})")
    verb, args = obj.get("verb"), obj.get("args", {})
    if not isinstance(verb, str):
        raise ValueError('missing "verb" (a string)')
    if not isinstance(args, dict):
        raise ValueError('"args" must be an object')
    return verb, args


async def serve_control(path: Path, verbs: Mapping[str, VerbHandler], *, mode: int = 0o600,
                        group: int | None = None, log: logging.Logger) -> asyncio.Server:
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                line = await reader.readline()
                verb, args = parse_request(line)
            except ValueError as e:
                log.warning("control socket: bad request: %s", e)
                writer.write(_line({"type": "result", "ok": False, "error": f"bad request: {e}"}))
                return
            handler = verbs.get(verb)
            if handler is None:
                writer.write(_line({"type": "result", "ok": False, "error":
                                    f"unknown verb {verb!r}; known: {', '.join(sorted(verbs))}"}))
                return
            async for reply in handler(args):
                kind = "result" if "ok" in reply else "progress"
                writer.write(_line({"type": kind, **reply}))
                await writer.drain()
        except ConnectionError:
            pass
        except Exception as e:
            log.exception("control socket: the %r handler failed", line[:80])
            writer.write(_line({"type": "result", "ok": False, "error": f"agent error: {e}"}))
        finally:
            try:
                await writer.drain()
            except ConnectionError:
                pass
            writer.close()

    server = await asyncio.start_unix_server(connection, path=str(path), limit=MAX_REQUEST)
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, -1, group)
    return server


def request(path: Path, verb: str, args: dict[str, Any] | None = None, *,
            timeout: float | None = 10) -> Iterator[Reply]:
    """Send one request and yield every reply line (blocking; for the CLI)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except FileNotFoundError as e:
        raise ControlError(f"no agent socket at {path}: is hostagent running? "
                           "(systemctl status hostagent)") from e
    except PermissionError as e:
        raise ControlError(f"not allowed to use {path}: run as root or as a member of the "
                           "control socket's group") from e
    except ConnectionRefusedError as e:
        raise ControlError(f"nothing listens on {path}: is hostagent running?") from e
    with sock, sock.makefile("rb") as f:
        sock.sendall(json.dumps({"v": PROTOCOL_VERSION, "verb": verb, "args": args or {}})
                     .encode() + b"\n")
        for raw in f:
            reply = json.loads(raw)
            yield reply
            if reply.get("type") == "result":
                return
    raise ControlError("the agent closed the connection without a result")

