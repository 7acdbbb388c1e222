"""The control socket: how `hostagent status`, `play`, `release`... talk to the agent.

Versioned JSON lines on a Unix socket, one request per connection:

    client → agent  {"v":1,"verb":"play","args":{"vm":"gaming1"}}
    agent → client  zero or more {"v":1,"type":"progress",...} lines, then one
                    {"v":1,"type":"result","ok":true,"data":{...}} or
                    {"v":1,"type":"result","ok":false,"error":"what went wrong and the fix"}

A bad request is answered with an error result and never stops the server. A client
that hangs up (closes its end) ends its request: the verb's handler is cancelled. That
stops the *waiting*, never what the request started: an intent a `play` created stays
and the VM still starts. A client therefore keeps its side open while it waits.

Who may connect is the socket file's business: mode 0600 (root) by default, 0660 with
``control_group``. The same verbs are served over SSH by `hostagent.ssh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
MAX_REQUEST = 64 * 1024

Reply = dict[str, Any]
# A verb handler yields progress dicts and finally a result: {"ok": bool, ...}.
VerbHandler = Callable[[dict[str, Any]], AsyncIterator[Reply]]


class ControlError(Exception):
    """The agent answered with an error, or could not be reached."""


class ControlTimeout(ControlError):
    """The client stopped waiting; what it asked for goes on in the agent."""


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
            if not await stream_replies(handler(args), writer, hangup=_eof(reader)):
                log.info("control socket: the client of %r hung up before the result", verb)
                return
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


async def _eof(reader: asyncio.StreamReader) -> bytes:
    """Returns when the client closes its end; anything it sends meanwhile is ignored."""
    while await reader.read(4096):
        pass
    return b""


async def stream_replies(replies: AsyncIterator[Reply], writer: asyncio.StreamWriter, *,
                         hangup: Awaitable[bytes]) -> bool:
    """Write each reply as a line until the result; False if the client hung up first.

    `hangup` completes when the client closes its end (see `_eof`). The
    handler is then cancelled and closed, so that it stops waiting at once instead of
    noticing at its next write, which may be minutes away.
    """
    async def pump() -> None:
        try:
            async for reply in replies:
                kind = "result" if "ok" in reply else "progress"
                writer.write(_line({"type": kind, **reply}))
                await writer.drain()
        finally:
            if isinstance(replies, AsyncGenerator):
                await replies.aclose()  # its finally blocks run now, not at GC

    writing = asyncio.ensure_future(pump())
    closed = asyncio.ensure_future(hangup)
    try:
        await asyncio.wait({writing, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
        if not writing.done():
            writing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writing
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await closed
    return not writing.cancelled()


def request(path: Path, verb: str, args: dict[str, Any] | None = None, *,
            timeout: float | None = 10, deadline: float | None = None,
            idle: float | None = None, on_idle: Callable[[], None] | None = None,
            ) -> Iterator[Reply]:
    """Send one request and yield every reply line (blocking; for the CLI).

    `timeout` bounds the silence between two lines (None: the agent may take its time,
    as a drain does); `deadline` (a `time.monotonic()` value) the whole exchange. Either
    raises `ControlTimeout`, and the agent goes on regardless. `on_idle` is called after
    each `idle` seconds without a line (a terminal display ticks its clock there).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
    except FileNotFoundError as e:
        raise ControlError(f"no agent socket at {path}: is hostagent running? "
                           "(systemctl status hostagent)") from e
    except PermissionError as e:
        raise ControlError(f"not allowed to use {path}: run as root or as a member of the "
                           "control socket's group") from e
    except ConnectionRefusedError as e:
        raise ControlError(f"nothing listens on {path}: is hostagent running?") from e
    with sock:
        sock.sendall(json.dumps({"v": PROTOCOL_VERSION, "verb": verb, "args": args or {}})
                     .encode() + b"\n")
        buffer = b""
        last = time.monotonic()  # when the agent last said something
        while True:
            while b"\n" not in buffer:
                now = time.monotonic()
                waits = [w for w in (
                    None if timeout is None else timeout - (now - last),
                    None if deadline is None else deadline - now,
                    idle if on_idle is not None else None) if w is not None]
                sock.settimeout(max(0.001, min(waits)) if waits else None)
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        raise ControlTimeout("stopped waiting") from None
                    if timeout is not None and now - last >= timeout:
                        raise ControlTimeout(f"no answer from the agent within "
                                             f"{timeout:g}s") from None
                    if on_idle is not None:
                        on_idle()
                    continue
                if not chunk:
                    raise ControlError("the agent closed the connection without a result")
                buffer += chunk
                last = time.monotonic()
            line, buffer = buffer.split(b"\n", 1)
            reply = json.loads(line)
            yield reply
            if reply.get("type") == "result":
                return
