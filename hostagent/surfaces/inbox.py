"""The agent's end of the libvirt hook: a Unix socket speaking versioned JSON lines.

The hook (hooks/qemu) sends one event per connection and waits, under a hard time
budget, for one answer: the answer is the agent's acknowledgement that the event is
handled, and for `prepare begin` it carries the proceed/defer decision. An event the
hook could not deliver lies in the spool directory; `replay_spool` hands it over when
the agent starts. The hook may spool an event whose answer merely came late, so every
event is handled at most once per id (an `Inbox` remembers recent ids).

Protocol version 1, one JSON object per line, UTF-8:

    hook → agent  {"v":1,"kind":"hook","id":str,"time":number,"domain":str,"op":str,
                   "sub":str,"extra":str,"xml":str}
    agent → hook  {"v":1,"id":str|null,"verdict":"proceed"|"defer"|"error","message":str}
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

PROTOCOL_VERSION = 1
# The hook reads at most 8 MiB of domain XML and never sends a longer line than this
# (its LINE_CAP): the rest is room for the other fields and JSON escapes.
MAX_LINE = 8 * 1024 * 1024 + 64 * 1024
REMEMBERED_IDS = 4096
# A hook's temporary spool file lives for a few milliseconds (its whole budget is under
# a second); one older than this was left by a hook that was killed while writing it.
STALE_TEMP_SECONDS = 60.0
_EXCERPT = 80


@dataclass(frozen=True)
class HookEvent:
    """One call of the hook: `qemu <domain> <op> <sub> <extra>`, the domain XML on stdin."""

    id: str
    time: float
    domain: str
    op: str
    sub: str
    extra: str
    xml: str
    # True when it was read from the spool (the hook could not deliver it live): libvirt
    # went ahead without an answer. Where an event came from, never the clock, says
    # whether its answer can still matter (a clock stepped back at boot would make
    # every live event look old).
    spooled: bool = False


@dataclass(frozen=True)
class Verdict:
    """The agent's answer; "defer" stops only `prepare begin`, with `message` shown."""

    decision: Literal["proceed", "defer"]
    message: str = ""


Handler = Callable[[HookEvent], Awaitable[Verdict]]


class ProtocolError(ValueError):
    """A line that is not a valid version-1 hook event; the message says what is wrong."""


_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (dict, "object"),
    (list, "array"),
    (str, "string"),
    (int, "integer"),
    (float, "number"),
    (type(None), "null"),
)
_STRING_FIELDS = ("id", "domain", "op", "sub", "extra", "xml")


def _json_type(value: object) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python, not in JSON
        return "boolean"
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"bad JSON: {name} is not a number")


def parse_hook_line(line: bytes) -> HookEvent:
    """Parse one line sent by the hook (the trailing newline is optional)."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line too long ({len(line)} bytes, limit {MAX_LINE})")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"not UTF-8: bad byte at position {e.start}") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except json.JSONDecodeError as e:
        raise ProtocolError(
            f"bad JSON at line {e.lineno} column {e.colno} (char {e.pos}): {e.msg}"
        ) from None
    except RecursionError:
        raise ProtocolError("bad JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer over Python's 4300-digit limit
        raise ProtocolError(f"bad JSON: {e}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"expected a JSON object, got {_json_type(value)}")

    version = _field(value, "v", "integer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version} (this agent speaks {PROTOCOL_VERSION})"
        )
    kind = _field(value, "kind", "string")
    if kind != "hook":
        raise ProtocolError(f"field 'kind' is {kind!r}, expected 'hook'")
    strings = {name: _field(value, name, "string") for name in _STRING_FIELDS}
    if not strings["id"]:
        raise ProtocolError("field 'id' is empty")
    when = _field(value, "time", "number")
    try:
        seconds = float(when)  # an integer past float's range raises OverflowError
    except OverflowError:
        raise ProtocolError("field 'time' is too large for a time") from None
    if not math.isfinite(seconds):
        raise ProtocolError(f"field 'time' is {when}, expected a finite number")
    return HookEvent(time=seconds, **strings)


def _field(obj: dict[str, Any], name: str, expected: Literal["string", "integer", "number"]) -> Any:
    if name not in obj:
        raise ProtocolError(f"missing field {name!r}")
    value = obj[name]
    got = _json_type(value)
    # Any integer is also a fine number.
    if got != expected and not (expected == "number" and got == "integer"):
        raise ProtocolError(f"field {name!r} has type {got}, expected {expected}")
    return value


def _answer(event_id: str | None, verdict: str, message: str) -> bytes:
    line = {"v": PROTOCOL_VERSION, "id": event_id, "verdict": verdict, "message": message}
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def _excerpt(line: bytes) -> str:
    text = repr(line[:_EXCERPT])
    return text + ("…" if len(line) > _EXCERPT else "")


class Inbox:
    """Hands hook events to a handler, at most once per event id.

    Both the live socket and the spool replay go through one Inbox, so an event that
    was answered live (too late for the hook, which then spooled it) is not handled
    again on replay. Only the last `remember` ids are kept.
    """

    def __init__(self, handler: Handler, *, remember: int = REMEMBERED_IDS) -> None:
        self._handler = handler
        self._remember = remember
        # A future per id, so that a duplicate arriving while the first is still being
        # handled waits for that result instead of running the handler a second time.
        self._seen: OrderedDict[str, asyncio.Future[Verdict | None]] = OrderedDict()

    async def __call__(self, event: HookEvent) -> Verdict:
        while True:
            pending = self._seen.get(event.id)
            if pending is None:
                break
            self._seen.move_to_end(event.id)
            verdict = await asyncio.shield(pending)
            if verdict is not None:
                return verdict
            # The first attempt failed and was forgotten: this one handles it.

        pending = asyncio.get_running_loop().create_future()
        self._seen[event.id] = pending
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        try:
            verdict = await self._handler(event)
        except BaseException:
            if self._seen.get(event.id) is pending:
                del self._seen[event.id]  # not handled: a later copy may try again
            pending.set_result(None)
            raise
        pending.set_result(verdict)
        return verdict


def _as_inbox(handler: Handler | Inbox) -> Inbox:
    return handler if isinstance(handler, Inbox) else Inbox(handler)


async def serve_hooks(
    path: Path,
    handler: Handler | Inbox,
    *,
    mode: int = 0o600,
    log: logging.Logger,
) -> asyncio.Server:
    """Listen on `path` for hook events; each valid one is answered with its verdict.

    Pass the same `Inbox` to `replay_spool` to share its memory of handled ids.
    A bad line is logged and answered with an "error" verdict; it never stops the server.
    """
    inbox = _as_inbox(handler)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        # A socket left by a previous run would make bind fail; anything else at that
        # path is not ours to delete.
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # the stream's limit: the line is longer than MAX_LINE
                    message = f"line too long (over {MAX_LINE} bytes, limit {MAX_LINE})"
                    log.warning("hook socket: bad line: %s", message)
                    writer.write(_answer(None, "error", message))
                    await writer.drain()
                    return  # the rest of that line is still coming: drop the connection
                if not line:
                    return
                writer.write(await _handle_line(inbox, line, log))
                await writer.drain()
        except ConnectionError as e:
            # The hook gave up waiting (its budget) and went on; it has spooled the event.
            log.debug("hook socket: peer went away: %s", e)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(connection, path=str(path), limit=MAX_LINE)
    os.chmod(path, mode)
    return server


async def _handle_line(inbox: Inbox, line: bytes, log: logging.Logger) -> bytes:
    try:
        event = parse_hook_line(line)
    except ProtocolError as e:
        log.warning("hook socket: bad line: %s; line starts %s", e, _excerpt(line))
        return _answer(None, "error", str(e))
    try:
        verdict = await inbox(event)
    except Exception as e:
        log.exception(
            "hook event %s (%s %s %s): the handler failed",
            event.id,
            event.domain,
            event.op,
            event.sub,
        )
        return _answer(event.id, "error", f"the agent failed to handle the event: {e}")
    return _answer(event.id, verdict.decision, verdict.message)


async def replay_spool(spool: Path, handler: Handler | Inbox, *, log: logging.Logger) -> int:
    """Hand every spooled event to the handler, oldest first; return how many files.

    Each event is marked `spooled`. An event whose id the inbox already handled counts,
    but is not handled again. Run it before serving live hook events (see `serve_hooks`),
    so that what happened while the agent was down comes first.

    A file is deleted only once the handler has returned, so an agent that crashes
    here replays it next time. A handler exception propagates and leaves the file and
    all later ones in place (their order matters). A file that is not a valid event, or
    cannot be read, is moved to `spool/bad/` with a warning, never silently dropped and
    never allowed to stop the replay (a poison file would stop every start). Temporary
    files a killed hook left behind (``.tmp-*``, older than `STALE_TEMP_SECONDS`) are
    removed.
    """
    inbox = _as_inbox(handler)
    try:
        entries = list(os.scandir(spool))
    except FileNotFoundError:
        return 0
    _remove_stale_temps(spool, entries, log)
    names = sorted(
        entry.name
        for entry in entries
        # Dot files are the hook's temporary files, perhaps still being written.
        if entry.name.endswith(".json")
        and not entry.name.startswith(".")
        and entry.is_file(follow_symlinks=False)
    )
    handled = 0
    for name in names:
        file = spool / name
        try:
            event = parse_hook_line(file.read_bytes())
        except FileNotFoundError:
            continue  # removed meanwhile (another replay, an administrator)
        except (ProtocolError, OSError, ValueError, OverflowError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            _set_aside(spool, name, why, log)
            continue
        await inbox(replace(event, spooled=True))
        file.unlink(missing_ok=True)
        handled += 1
    return handled


def _set_aside(spool: Path, name: str, why: str, log: logging.Logger) -> None:
    bad = spool / "bad"
    try:
        bad.mkdir(mode=0o700, exist_ok=True)
        (spool / name).rename(bad / name)
    except OSError as e:
        log.error("spool: %s is not a valid hook event (%s) and could not be moved to %s "
                  "(%s); skipped", spool / name, why, bad, e.strerror or e)
        return
    log.warning("spool: %s is not a valid hook event (%s); moved to %s", spool / name, why, bad)


def _remove_stale_temps(spool: Path, entries: list[os.DirEntry[str]],
                        log: logging.Logger) -> None:
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(".tmp-"):
            continue
        try:
            if (not entry.is_file(follow_symlinks=False)
                    or now - entry.stat(follow_symlinks=False).st_mtime < STALE_TEMP_SECONDS):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        log.info("spool: removed %s, left by a hook that was stopped while writing it",
                 entry.path)
