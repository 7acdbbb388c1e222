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
``control_group``. What a caller may then do is decided per verb, from the kernel's
word on who it is (SO_PEERCRED: uid, gid, pid, and the supplementary groups of that
pid): root, and the user the agent runs as, may use every verb; members of
``control_group`` may use `GROUP_VERBS` (status, hold, resume/lend), or what
``control_verbs`` in the configuration grants them; anyone else nothing. Each request
but ``status`` is journaled with its caller (``HOSTAGENT_EVENT=control``,
``HOSTAGENT_USER``, ``HOSTAGENT_UID``, ``HOSTAGENT_PID``), and a verb reads its caller
with `current_caller()` to name it in its own records. Refusals are journaled once per
interval, then summarised, and requests (allowed or bad) `REQUESTS_BURST` per uid and
interval, then summarised, so a caller in a loop cannot flood the journal. A request's
record names a VM only for a verb that takes one and a VM that is a configured owner.

A connection must send its request within `REQUEST_TIMEOUT` seconds, and at most
`MAX_CONNECTIONS` connections (`MAX_PER_CALLER` per uid) are served at once; root and
the agent's own user are counted apart, so that a member holding every slot cannot
lock root out.

The same verbs are served over SSH by `hostagent.surfaces.ssh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
)
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hostagent.host import journal
from hostagent.core.ratelimit import Summarised

PROTOCOL_VERSION = 1
MAX_REQUEST = 64 * 1024
# What control_group members may do unless control_verbs says otherwise: look, and stop
# or restart lending; never start or stop someone's VM. `lend` is `resume`'s other name.
GROUP_VERBS = frozenset({"status", "hold", "resume", "lend"})
# Not a verb: the grant to cancel or replace a reservation someone else made (only the
# principal that reserved may otherwise). Root and the agent's user have it.
CANCEL_ANY = "cancel-any"
REQUEST_TIMEOUT = 10.0  # seconds for a connection to send its request line
MAX_CONNECTIONS = 64  # served at once, for callers other than root and the agent's user
MAX_PER_CALLER = 16  # of those, per uid
MAX_PRIVILEGED = 64  # and for root and the agent's user, counted apart
REFUSALS_INTERVAL = 10.0  # one journal record per interval for refusals, then a summary
# Requests journaled per uid and interval (allowed and bad alike), then one summary: a
# caller in a loop must not drown the agent's own records (journald drops past its
# rate limit, whoever wrote them).
REQUESTS_BURST = 10
REQUESTS_INTERVAL = 10.0
# The verbs whose "vm" argument names an owner; only there, and only for a configured
# owner, is it journaled (anything else a caller sends is not taken for a VM's name).
VM_VERBS = frozenset({"play", "release", "reserve"})

Reply = dict[str, Any]
# A verb handler yields progress dicts and finally a result: {"ok": bool, ...}.
VerbHandler = Callable[[dict[str, Any]], AsyncIterator[Reply]]


class ControlError(Exception):
    """The agent answered with an error, or could not be reached."""


class ControlTimeout(ControlError):
    """The client stopped waiting; what it asked for goes on in the agent."""


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who sent a request: a local process (the control socket) or an SSH key."""

    user: str  # a user name (or "uid N"); for SSH the key's comment
    uid: int | None = None
    gid: int | None = None
    pid: int | None = None
    groups: frozenset[int] = field(default_factory=frozenset)
    via: str = "control"  # "control", "ssh" or "mqtt"
    peer: str | None = None  # SSH: the client's address
    privileged: bool = False  # root or the agent's own user: every verb
    fingerprint: str | None = None  # SSH: the key's SHA256 fingerprint
    # May cancel or replace a reservation someone else made (the grant `CANCEL_ANY`).
    cancel_any: bool = False

    @property
    def principal(self) -> str:
        """Who this is, stably across connections: what a reservation keeps of who made
        it, so that only they (or `cancel_any`) may cancel it. A uid, a key's
        fingerprint, or "mqtt" (the broker's ACL says who may publish there)."""
        if self.via == "ssh":
            return f"ssh key {self.fingerprint or self.user}"
        if self.via == "mqtt":
            return "mqtt"
        return f"uid {self.uid}"

    def __str__(self) -> str:
        if self.via in ("ssh", "mqtt"):  # the peer: the SSH client, the MQTT broker
            return f"{self.user} at {self.peer or '?'}"
        return f"{self.user} (uid {self.uid}, pid {self.pid})"

    def fields(self) -> dict[str, Any]:
        """Journal fields naming the caller (HOSTAGENT_USER, _UID, _PID, _VIA)."""
        named = {"user": self.user, "uid": self.uid, "pid": self.pid, "via": self.via}
        return {k: v for k, v in named.items() if v is not None}


_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "hostagent_caller", default=None)


def current_caller() -> Caller | None:
    """The caller of the request being served in this task (None outside a request).

    Set by the control socket and the SSH endpoint before a verb runs, so a verb can
    name who asked in its journal records: ``journal.record(..., **caller.fields())``."""
    return _caller.get()


@contextlib.contextmanager
def serving(caller: Caller) -> Iterator[None]:
    """Make `caller` the current caller for what runs inside (and tasks started there)."""
    token = _caller.set(caller)
    try:
        yield
    finally:
        _caller.reset(token)


def peer_caller(sock: Any) -> Caller:
    """The caller at the other end of a Unix socket, as the kernel says (SO_PEERCRED)."""
    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET,
                                                        socket.SO_PEERCRED, size))
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    return Caller(user=user, uid=uid, gid=gid, pid=pid, groups=_groups(pid, user, gid),
                  privileged=uid in (0, os.geteuid()))


def _groups(pid: int, user: str, gid: int) -> frozenset[int]:
    """The supplementary groups of `pid` (what it runs with now), else of `user`."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    try:
        return frozenset(os.getgrouplist(user, gid))
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class Rights:
    """Which verbs a caller may use on the control socket. An entry of `group_verbs`
    is a verb, or ``verb:vm`` for a verb that names a VM, on that VM alone (as an SSH
    key's ``vms=``); `CANCEL_ANY` is a grant, not a verb."""

    group: int | None = None  # control_group's gid; None: root (and the agent's user) only
    group_name: str | None = None  # for messages
    group_verbs: frozenset[str] = GROUP_VERBS

    def may(self, caller: Caller, verb: str, vm: object = None) -> str | None:
        """None if `caller` may use `verb` (on `vm`, for a verb that names one), else why
        not (with the fix)."""
        if caller.privileged:
            return None
        name = self.group_name or (str(self.group) if self.group is not None else None)
        if self.group is None or (caller.gid != self.group and self.group not in caller.groups):
            return (f"{caller.user} (uid {caller.uid}) may not use the control socket: only "
                    "root" + (f" and members of control_group {name!r}" if name else "")
                    + " may")
        scoped = sorted(e.partition(":")[2] for e in self.group_verbs
                        if e.partition(":")[0] == verb and ":" in e)
        if verb not in self.group_verbs and scoped:
            if isinstance(vm, str) and vm in scoped:
                return None
            return (f"{caller.user} may use {verb!r} only on {', '.join(scoped)} "
                    f"(control_verbs in the configuration)")
        if verb not in self.group_verbs:
            return (f"{caller.user} may not use {verb!r}: members of control_group {name!r} "
                    f"may use {', '.join(sorted(self.group_verbs)) or 'nothing'}; ask root, "
                    "or grant it with control_verbs in the configuration")
        return None


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


class GroupAccess:
    """control_group's access to the control socket when the group did not exist as the
    agent started: the socket is root's alone until it does, then the group's (0660,
    `verbs`) with no restart (DESIGN.md invariant 13). `take_up` looks (a health check,
    and `run` every `RETRY` seconds); `rights` is what `serve_control(access=)` asks."""

    RETRY = 10.0

    def __init__(self, path: Path, name: str, verbs: Collection[str], source: str) -> None:
        self.path, self.name, self.verbs, self.source = path, name, frozenset(verbs), source
        self.current = Rights()

    def rights(self) -> Rights:
        return self.current

    async def take_up(self) -> str:
        """The health check: the group's access once it exists, else CheckFailed."""
        from hostagent.core.health import CheckFailed
        if self.current.group is None:
            import grp
            try:  # NSS may ask a directory server: not on the loop
                gid = (await asyncio.to_thread(grp.getgrnam, self.name)).gr_gid
            except KeyError:
                raise CheckFailed(
                    f"{self.source}: control_group: there is no group {self.name!r} on this "
                    f"host; create it (groupadd {self.name}) or remove the key; until then the "
                    "control socket is root's alone") from None
            os.chown(self.path, -1, gid)
            os.chmod(self.path, 0o660)
            self.current = Rights(group=gid, group_name=self.name, group_verbs=self.verbs)
            journal.record("control", f"control_group {self.name!r} exists now: its members "
                           f"may use {', '.join(sorted(self.verbs))}", result="ready")
        return f"members of {self.name!r} may use the control socket"

    async def run(self) -> None:
        while self.current.group is None:
            await asyncio.sleep(self.RETRY)
            with contextlib.suppress(Exception):  # said by the health check
                await self.take_up()


async def serve_control(path: Path, verbs: Mapping[str, VerbHandler], *, mode: int = 0o600,
                        group: int | None = None, log: logging.Logger,
                        group_verbs: Collection[str] | None = None,
                        group_name: str | None = None,
                        request_timeout: float = REQUEST_TIMEOUT,
                        max_connections: int = MAX_CONNECTIONS,
                        max_per_caller: int = MAX_PER_CALLER,
                        owners: Collection[str] = (),
                        access: Callable[[], Rights] | None = None,
                        clock: Callable[[], float] = time.monotonic) -> asyncio.Server:
    """Serve `verbs` on `path`. `group` (a gid) may connect (mode 0660) and use
    `group_verbs` (default `GROUP_VERBS`); root and the agent's user may use all.
    `owners`: the VM names a request's record may carry (see `VM_VERBS`). `access`:
    the rights asked at each request instead (a `GroupAccess` waiting for its group)."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    rights = Rights(group=group, group_name=group_name,
                    group_verbs=GROUP_VERBS if group_verbs is None else frozenset(group_verbs))
    active: dict[int | None, int] = {}  # uid → connections being served
    counts = {"privileged": 0, "others": 0}

    def refused_record(message: str, count: int, reasons: dict[str, int]) -> None:
        journal.record("control", message, result="refused", count=count,
                       priority=journal.Priority.WARNING)

    refusals = Summarised(refused_record, interval=REFUSALS_INTERVAL)
    known = frozenset(owners)
    requests: dict[int | None, Summarised] = {}  # uid → its requests' records

    def journaled(caller: Caller, reason: str) -> bool:
        """Whether `caller`'s request is journaled now (else counted for its summary)."""
        limit = requests.get(caller.uid)
        if limit is None:
            def summary(message: str, count: int, reasons: dict[str, int]) -> None:
                journal.record("control", f"{caller.user} (uid {caller.uid}): {message}",
                               result="summarised", count=count,
                               **{k: v for k, v in caller.fields().items() if k != "pid"})

            limit = requests[caller.uid] = Summarised(
                summary, interval=REQUESTS_INTERVAL, burst=REQUESTS_BURST, what="requests",
                clock=clock)
        return limit.allow(reason)

    def admit(caller: Caller) -> str | None:
        kind = "privileged" if caller.privileged else "others"
        if caller.privileged:
            full = counts[kind] >= MAX_PRIVILEGED
        else:
            full = (counts[kind] >= max_connections
                    or active.get(caller.uid, 0) >= max_per_caller)
        if full:
            return "too many control connections at once; try again when some have ended"
        counts[kind] += 1
        active[caller.uid] = active.get(caller.uid, 0) + 1
        return None

    def leave(caller: Caller) -> None:
        counts["privileged" if caller.privileged else "others"] -= 1
        active[caller.uid] -= 1
        if not active[caller.uid]:
            del active[caller.uid]

    def refuse(writer: asyncio.StreamWriter, caller: Caller | None, why: str,
               reason: str) -> None:
        who = str(caller) if caller is not None else "a caller"
        refusals(f"control socket: refused {who}: {why}", reason)
        writer.write(_line({"type": "result", "ok": False, "error": why}))

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = b""
        caller: Caller | None = None
        admitted = False
        try:
            try:
                caller = peer_caller(writer.get_extra_info("socket"))
            except (OSError, struct.error, AttributeError) as e:
                log.warning("control socket: cannot tell who connected (%s); refused", e)
                refuse(writer, None, "cannot tell who you are", "unknown caller")
                return
            full = admit(caller)
            if full is not None:
                refuse(writer, caller, full, "too many connections")
                return
            admitted = True
            try:
                async with asyncio.timeout(request_timeout):
                    line = await reader.readline()
                verb, args = parse_request(line)
            except TimeoutError:
                refuse(writer, caller, f"no request within {request_timeout:g}s", "idle")
                return
            except ValueError as e:
                if journaled(caller, "bad"):
                    log.warning("control socket: bad request from %s: %s", caller,
                                str(e)[:200])
                writer.write(_line({"type": "result", "ok": False, "error": f"bad request: {e}"}))
                return
            handler = verbs.get(verb)
            if handler is None:
                writer.write(_line({"type": "result", "ok": False, "error":
                                    f"unknown verb {verb!r}; known: {', '.join(sorted(verbs))}"}))
                return
            now = rights if access is None else access()
            denied = now.may(caller, verb, args.get("vm"))
            if denied is not None:
                refuse(writer, caller, f"denied: {denied}", f"denied {verb}")
                return
            caller = replace(caller, cancel_any=now.may(
                caller, CANCEL_ANY, args.get("vm")) is None)
            # status is polled; the rest change something
            if verb != "status" and journaled(caller, verb):
                vm = args.get("vm") if verb in VM_VERBS else None
                vm = vm if isinstance(vm, str) and vm in known else None
                journal.record("control", f"{caller} asked for {verb}"
                               + (f" {vm}" if vm else ""), vm=vm, result="allowed",
                               verb=verb, **caller.fields())
            with serving(caller):
                done = await stream_replies(handler(args), writer, hangup=_eof(reader))
            if not done:
                log.info("control socket: the client of %r hung up before the result", verb)
                return
        except ConnectionError:
            pass
        except Exception as e:
            log.exception("control socket: the %r handler failed", line[:80])
            writer.write(_line({"type": "result", "ok": False, "error": f"agent error: {e}"}))
        finally:
            if admitted and caller is not None:
                leave(caller)
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
