"""What hostagent must remember across its own crashes and the host's reboots.

Most of what the agent needs it re-reads from reality (libvirt, the Node object). Two
things cannot be re-read: an owner's start request that was acknowledged but not yet
served (an *intent*), and whether it was hostagent that cordoned the node (so that an
administrator's cordon is never lifted). Those, and a little history for messages, live
in ``state.toml`` under ``state_dir``::

    version = 1
    cordoned_by_us = true
    hold = false
    reclaiming = false
    lendee_phase = "draining"
    lendee_phase_since = 2026-01-10T20:15:02.125000+00:00
    last_verified = 2026-01-10T18:00:41+00:00
    relend_at = 2026-01-10T21:00:00+00:00

    [[intents]]
    id = "0b9e2c7a"
    owner = "gaming1"
    created = 2026-01-10T20:15:01.998000+00:00
    source = "hook"
    status = "pending"

    [[reservations]]                    # hostagent reserve gaming2 --at 22:00
    vm = "gaming2"
    at = 2026-01-10T22:00:00+00:00
    by = "ssh key phone"
    made = 2026-01-10T17:30:00+00:00
    evict_at = 2026-01-10T21:54:30+00:00  # once the pods' notice went out
    holding = false
    principal = "ssh key SHA256:…"      # who may cancel it (besides cancel-any)
    yielding = false                    # past its time, unused: another owner may start
    yields_from = 2026-01-10T22:00:00+00:00  # when it yields, if not at (it replaced one)
    every = "weekdays 22:00"            # one of a series: the next takes its place

The file is replaced atomically (temporary file, fsync, rename, fsync of the directory),
so a crash leaves either the old state or the new one, never half of each. A file that
cannot be read is moved aside, not trusted and not deleted: the agent starts fresh,
says so loudly, and rebuilds from reality. Unknown keys are ignored. A file of another
version is migrated instead (`load_state`): a rollback keeps the holds and pending starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import tempfile
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import tomli_w

from hostagent.core.model import IntentSource
from hostagent.core.reserve import Reservation

__all__ = [
    "STATE_VERSION",
    "Intent",
    "IntentSource",
    "IntentStatus",
    "Saver",
    "State",
    "load_state",
    "save_state",
]

STATE_VERSION = 1
# How to read an older file: MIGRATIONS[n] turns a version-n document into version n+1.
# The format that changes gets a new version and its migration here, never a set-aside.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
T = TypeVar("T")


class IntentStatus(enum.StrEnum):
    """How far an intent has gone. A served or abandoned intent leaves the file."""

    PENDING = "pending"  # accepted, nothing done yet
    RECLAIMING = "reclaiming"  # taking the owner's GPUs back from the lendee
    STARTING = "starting"  # GPUs free, the owner is being started


@dataclass(frozen=True, kw_only=True)
class Intent:
    """An owner VM someone asked to start; persisted before it is acknowledged."""

    id: str
    owner: str  # libvirt domain name
    created: datetime
    source: IntentSource
    status: IntentStatus = IntentStatus.PENDING


@dataclass(frozen=True, kw_only=True)
class State:
    """Everything in state.toml. Times are timezone-aware."""

    intents: tuple[Intent, ...] = ()
    cordoned_by_us: bool = False
    hold: bool = False  # lending suspended by `hostagent hold`, until `resume`
    lendee_phase: str | None = None  # the state machine's name for it; None: unknown
    lendee_phase_since: datetime | None = None
    last_verified: datetime | None = None  # when the lent GPUs were last seen working
    # When the lendee gets its GPUs back after an owner stopped (policy.relend_delay):
    # kept so that a restart waits out the delay instead of lending at once.
    relend_at: datetime | None = None
    # A reclaim by hand under way: a restart must finish it, not lend the lendee again.
    reclaiming: bool = False
    # The kernel's boot id when the agent last ran: a new one means the host rebooted.
    boot_id: str | None = None
    # Players' reservations (`hostagent.core.reserve`), times as POSIX seconds.
    reservations: tuple[Reservation, ...] = ()


class _Corrupt(Exception):
    """The file is there but is not a state file this version understands."""


# --- reading ---------------------------------------------------------------------------


def load_state(path: Path) -> tuple[State, str | None]:
    """The state in `path`, and a warning to log loudly if not all of it could be kept.

    A missing file is a fresh start (first run), not a warning. An older file goes
    through `MIGRATIONS`; a newer one (a rollback) is read for what this version knows,
    a copy kept beside it for the version that wrote it: a hold or a pending start
    survives either way. Only a file that says nothing usable is set aside.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return State(), None
    except OSError as e:
        return State(), _set_aside(path, f"cannot be read ({e.strerror})")
    try:
        doc, version = _document(data)
        if version <= STATE_VERSION:
            return _decode(_migrated(doc, version)), None
        left_out: list[str] = []
        state = _decode(doc, left_out)
    except _Corrupt as e:
        return State(), _set_aside(path, str(e))
    return state, _newer(path, data, version, left_out)


def _set_aside(path: Path, why: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    copy = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        os.replace(path, copy)
    except OSError as e:
        kept = f"it could not be moved to {copy} ({e.strerror}) and will be overwritten"
    else:
        kept = f"it was moved to {copy}"
    return (
        f"state file {path} {why}; {kept}. Starting from an empty state rebuilt from "
        "libvirt and Kubernetes: start requests that were pending in it are lost "
        "(start those VMs again)."
    )


def _document(data: bytes) -> tuple[dict[str, Any], int]:
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise _Corrupt(f"is not valid TOML ({e})") from None
    version = doc.get("version")
    if version is None:
        raise _Corrupt("has no version number")
    oldest = min(MIGRATIONS, default=STATE_VERSION)
    if type(version) is not int or version < oldest:  # `true == 1` in Python
        raise _Corrupt(f"has version {version!r}, this hostagent reads version "
                       f"{STATE_VERSION} and migrates from {oldest}")
    return doc, version


def _migrated(doc: dict[str, Any], version: int) -> dict[str, Any]:
    """`doc` (of `version`) brought to STATE_VERSION, one migration at a time."""
    while version < STATE_VERSION:
        doc, version = MIGRATIONS[version](doc), version + 1
    return doc


def _newer(path: Path, data: bytes, version: int, left_out: list[str]) -> str:
    """Keep a newer version's file for a roll forward; say what this version could not read."""
    copy = path.with_name(f"{path.name}.v{version}-{datetime.now(UTC):%Y%m%dT%H%M%S.%fZ}")
    try:
        copy.write_bytes(data)
    except OSError as e:
        kept = f"no copy of it could be kept at {copy} ({e.strerror})"
    else:
        kept = f"a copy of it is kept at {copy}"
    lost = (f"; left out, as this version cannot read them: {', '.join(left_out)}"
            if left_out else "")
    return (f"state file {path} has version {version}, written by a newer hostagent; this "
            f"one reads version {STATE_VERSION}: read for what it knows (holds, pending "
            f"starts, reservations){lost}; {kept}")


def _decode(doc: dict[str, Any], left_out: list[str] | None = None) -> State:
    """The state in `doc`. Strict unless `left_out` is given (a newer version's file):
    then a value this version cannot read is left out and named there, an intent's
    unknown source or status read as a pending request re-read after a restart."""
    def part(key: str, default: T, read: Callable[..., T], *args: Any) -> T:
        try:
            return read(*args)
        except _Corrupt:
            if left_out is None:
                raise
            left_out.append(key)
            return default

    intents: list[Intent] = []
    listed: list[Any] = part("intents", [], _get, doc, "intents", list, [])
    for i, entry in enumerate(listed):
        if left_out is not None and isinstance(entry, dict):
            entry = {**entry, "status": _known(entry.get("status"), IntentStatus.PENDING),
                     "source": _known(entry.get("source"), IntentSource.RESUME)}
        intent = part(f"intents[{i}]", None, _intent, entry, i)
        if intent is None:
            continue
        if any(known.id == intent.id for known in intents):
            if left_out is None:
                raise _Corrupt("lists an intent id twice")
            left_out.append(f"intents[{i}] (its id twice)")
            continue
        intents.append(intent)
    listed = part("reservations", [], _get, doc, "reservations", list, [])
    reservations = [part(f"reservations[{i}]", None, _reservation, entry, i)
                    for i, entry in enumerate(listed)]

    def flag(key: str) -> bool:
        return bool(part(key, False, _get, doc, key, bool, False))

    def text(key: str) -> str | None:
        value: str | None = part(key, None, _get, doc, key, str, None)
        return value

    def when(key: str) -> datetime | None:
        return part(key, None, _time, doc, key)

    return State(
        intents=tuple(intents), cordoned_by_us=flag("cordoned_by_us"), hold=flag("hold"),
        lendee_phase=text("lendee_phase"), lendee_phase_since=when("lendee_phase_since"),
        last_verified=when("last_verified"), relend_at=when("relend_at"),
        reclaiming=flag("reclaiming"), boot_id=text("boot_id"),
        reservations=tuple(r for r in reservations if r is not None),
    )


def _known(value: object, default: enum.StrEnum) -> object:
    return value if value in {str(m) for m in type(default)} else default.value


def _get(table: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = table.get(key, default)
    if value is not default and not isinstance(value, kind):
        raise _Corrupt(f"has {key} = {value!r}, not a {kind.__name__}")
    return value


def _time(table: dict[str, Any], key: str) -> datetime | None:
    value: datetime | None = _get(table, key, datetime, None)
    if value is not None and value.tzinfo is None:
        raise _Corrupt(f"has {key} without a time zone")
    return value


_INTENT_KEYS = ("id", "owner", "created", "source", "status")


def _intent(entry: object, index: int) -> Intent:
    if not isinstance(entry, dict):
        raise _Corrupt(f"has intents[{index}] that is not a table")
    missing = [key for key in _INTENT_KEYS if key not in entry]
    if missing:
        raise _Corrupt(f"has intents[{index}] without {', '.join(missing)}")
    created = _time(entry, "created")
    assert created is not None  # present, checked above
    try:
        return Intent(
            id=_get(entry, "id", str, None),
            owner=_get(entry, "owner", str, None),
            created=created,
            source=IntentSource(_get(entry, "source", str, None)),
            status=IntentStatus(_get(entry, "status", str, None)),
        )
    except ValueError as e:  # an unknown source or status
        raise _Corrupt(f"has intents[{index}] with {e}") from None


def _reservation(entry: object, index: int) -> Reservation:
    if not isinstance(entry, dict):
        raise _Corrupt(f"has reservations[{index}] that is not a table")
    at, made, evict_at = (_time(entry, k) for k in ("at", "made", "evict_at"))
    vm, by = _get(entry, "vm", str, None), _get(entry, "by", str, "")
    if vm is None or at is None or made is None:
        raise _Corrupt(f"has reservations[{index}] without vm, at or made")
    yields_from = _time(entry, "yields_from")
    return Reservation(vm=vm, at=at.timestamp(), by=by, made=made.timestamp(),
                       evict_at=evict_at.timestamp() if evict_at else None,
                       holding=_get(entry, "holding", bool, False),
                       principal=_get(entry, "principal", str, ""),
                       yielding=_get(entry, "yielding", bool, False),
                       yields_from=yields_from.timestamp() if yields_from else None,
                       every=_get(entry, "every", str, None))


# --- writing ---------------------------------------------------------------------------


def _encode(state: State) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": STATE_VERSION, "cordoned_by_us": state.cordoned_by_us,
                           "hold": state.hold, "reclaiming": state.reclaiming}
    optional = {
        "lendee_phase": state.lendee_phase,
        "lendee_phase_since": _aware(state.lendee_phase_since, "lendee_phase_since"),
        "last_verified": _aware(state.last_verified, "last_verified"),
        "relend_at": _aware(state.relend_at, "relend_at"),
        "boot_id": state.boot_id,
    }
    doc.update((k, v) for k, v in optional.items() if v is not None)
    doc["intents"] = [
        {
            "id": intent.id,
            "owner": intent.owner,
            "created": _aware(intent.created, f"intent {intent.id} created"),
            "source": intent.source.value,
            "status": intent.status.value,
        }
        for intent in state.intents
    ]
    doc["reservations"] = [
        {"vm": r.vm, "at": _stamp(r.at), "by": r.by, "made": _stamp(r.made),
         "holding": r.holding, **({"evict_at": _stamp(r.evict_at)} if r.evict_at else {}),
         "principal": r.principal, "yielding": r.yielding,
         **({"yields_from": _stamp(r.yields_from)} if r.yields_from is not None else {}),
         **({"every": r.every} if r.every else {})}
        for r in state.reservations
    ]
    return doc


def _stamp(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


def _aware(value: datetime | None, what: str) -> datetime | None:
    # A naive time would be read back in whatever zone the next reader assumes.
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{what}: {value} has no time zone; use datetime.now(UTC)")
    return value


def save_state(path: Path, state: State) -> None:
    """Replace `path` with `state`, atomically and durably."""
    data = tomli_w.dumps(_encode(state)).encode("utf-8")
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o644)  # not secret; lets an administrator read it
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    # The rename is only durable once the directory entry is.
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --- saving from the event loop ------------------------------------------------------


class Saver:
    """Saves the state file from a worker thread: one save at a time, the latest wins.

    `save_state` makes two fsyncs (the file, then its directory), and a busy disk can
    take seconds over each. On the event loop they would hold everything else (the hook
    socket among it, whose callers have a budget of a fraction of a second). Here the
    loop only hands the state over; `submit` returns a future that is done once that
    state, or a later one, is on disk (its result: None) or could not be written (the
    OSError). States submitted while a save runs are merged into the next save.

    Invariant 4 stays the caller's: await the future before acknowledging an intent,
    with a bound (`asyncio.wait_for(asyncio.shield(future), budget)`); a save that has
    not finished in time goes on, and the request is refused, never acknowledged.
    """

    def __init__(self, path: Path, *,
                 write: Callable[[Path, State], None] | None = None) -> None:
        self.path = path
        self._write = write  # None: save_state, looked up at each save
        self._pending: State | None = None
        self._waiters: list[asyncio.Future[OSError | None]] = []
        self._task: asyncio.Task[None] | None = None
        self.last_error: OSError | None = None  # of the last save; None once one works

    def submit(self, state: State) -> asyncio.Future[OSError | None]:
        """Save `state` soon; the future says when it (or a later state) is durable."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[OSError | None] = loop.create_future()
        self._pending = state
        self._waiters.append(done)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="state file")
        return done

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def flush(self) -> OSError | None:
        """Wait for every submitted state to be saved; the last error, if any."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        return self.last_error

    async def _run(self) -> None:
        while self._pending is not None:
            state, self._pending = self._pending, None
            waiters, self._waiters = self._waiters, []
            error: OSError | None = None
            try:
                await asyncio.to_thread(self._write or save_state, self.path, state)
            except OSError as e:
                error = e
            except BaseException as e:  # a bug, or cancelled: no waiter waits forever
                for waiter in waiters:
                    if not waiter.done():
                        waiter.cancel() if isinstance(e, asyncio.CancelledError) else (
                            waiter.set_exception(e))
                raise
            self.last_error = error
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(error)
