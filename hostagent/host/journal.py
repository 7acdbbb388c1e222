"""One structured journald record per transition, and the agent's talk with systemd.

A person reads `journalctl -u hostagent -f` and sees one sentence per step; a script
reads the same records by field (``journalctl HOSTAGENT_EVENT=reclaim -o json``). The
fields are stable:

    HOSTAGENT_EVENT        what happened (e.g. "reclaim", "lend", "drain")
    HOSTAGENT_VM           the libvirt domain it happened to
    HOSTAGENT_FROM         the phase it left
    HOSTAGENT_TO           the phase it entered
    HOSTAGENT_DURATION_MS  how long the step took, in whole milliseconds
    HOSTAGENT_RESULT       how it ended (e.g. "ok", "timeout", "error")
    HOSTAGENT_<NAME>       anything else the caller passes as name=value
    HOSTAGENT_LOGGER       (ordinary `logging` records only) the logger's name

Ordinary `logging` records go the same way through `LogHandler`, without
HOSTAGENT_EVENT, so filtering on that field shows transitions only.

Where the records go is decided once, by a `Sink`: journald when its socket exists,
else one line per record on stderr (``HOSTAGENT_LOG=stderr`` forces it)::

    hostagent: drained gpu-node in 41 s [event=drain vm=gpu-node duration_ms=41230 result=ok]

Tests plug in a `ListSink` with `use_sink`, and read what was recorded.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from hostagent.core.text import clean

__all__ = [
    "IDENTIFIER",
    "INFO",
    "JOURNAL_SOCKET",
    "Entry",
    "JournalSink",
    "ListSink",
    "LogHandler",
    "Priority",
    "Sink",
    "StderrSink",
    "choose_sink",
    "current_sink",
    "notify",
    "record",
    "use_sink",
    "watchdog_interval",
]

IDENTIFIER = "hostagent"
JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
_PREFIX = "HOSTAGENT_"


class Priority(enum.IntEnum):
    """syslog priorities, as journald stores them in PRIORITY."""

    EMERG = 0
    ALERT = 1
    CRIT = 2
    ERR = 3
    WARNING = 4
    NOTICE = 5
    INFO = 6
    DEBUG = 7


INFO = Priority.INFO


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One record, as every sink receives it."""

    message: str
    priority: Priority = Priority.INFO
    fields: Mapping[str, str] = field(default_factory=dict)  # HOSTAGENT_* name -> value
    code: tuple[str, int, str] | None = None  # file, line and function that recorded it

    def line(self) -> str:
        """The record as one line for stderr."""
        words = [f"{IDENTIFIER}:"]
        if self.priority <= Priority.ERR:
            words.append("error:")
        elif self.priority == Priority.WARNING:
            words.append("warning:")
        # One line, whatever the message quotes (a guest, the API server, a caller).
        words.append(clean(self.message, None))
        pairs = [
            f"{name.removeprefix(_PREFIX).lower()}={clean(_quoted(v), None)}"
            for name, v in self.fields.items()
        ]
        if pairs:
            words.append("[" + " ".join(pairs) + "]")
        return " ".join(words)


def _quoted(value: str) -> str:
    if value and not re.search(r'[\s"=\[\]]', value):
        return value
    return json.dumps(value, ensure_ascii=False)


class Sink(Protocol):
    """Where entries go; chosen once, so nothing downstream asks again."""

    def write(self, entry: Entry) -> None: ...


class StderrSink:
    """One line per record on stderr (or `stream`)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def write(self, entry: Entry) -> None:
        # sys.stderr looked up at each write: it may be replaced after start (tests do).
        stream = self._stream or sys.stderr
        stream.write(entry.line() + "\n")
        stream.flush()


class JournalSink:
    """Records sent to journald with their fields; `send` defaults to systemd.journal.send."""

    def __init__(self, *, send: Callable[..., object] | None = None) -> None:
        if send is None:
            import systemd.journal  # here: only this sink needs the C extension

            send = systemd.journal.send
        self._send = send

    def write(self, entry: Entry) -> None:
        code: dict[str, Any] = {}
        if entry.code is not None:
            code = dict(zip(("CODE_FILE", "CODE_LINE", "CODE_FUNC"), entry.code, strict=True))
        try:
            self._send(
                entry.message,
                PRIORITY=str(int(entry.priority)),
                SYSLOG_IDENTIFIER=IDENTIFIER,
                **code,
                **entry.fields,
            )
        except OSError:
            # journald restarting, or its socket full: the record must not be lost, nor
            # must logging break the agent.
            StderrSink().write(entry)


@dataclass
class ListSink:
    """Keeps every entry, for tests."""

    entries: list[Entry] = field(default_factory=list)

    def write(self, entry: Entry) -> None:
        self.entries.append(entry)

    def events(self) -> list[str]:
        """HOSTAGENT_EVENT of each transition recorded, in order."""
        return [e.fields[f"{_PREFIX}EVENT"] for e in self.entries if f"{_PREFIX}EVENT" in e.fields]


def choose_sink(*, environ: Mapping[str, str] = os.environ, socket: Path = JOURNAL_SOCKET) -> Sink:
    """journald if it is there and not refused by HOSTAGENT_LOG=stderr, else stderr."""
    if environ.get("HOSTAGENT_LOG") == "stderr" or not socket.exists():
        return StderrSink()
    try:
        return JournalSink()
    except ImportError:
        return StderrSink()


_sink: Sink | None = None


def use_sink(sink: Sink | None) -> Sink | None:
    """Send every later record to `sink` (None: choose again at the next record).

    Returns the sink it replaces, so a test can put it back.
    """
    global _sink
    previous, _sink = _sink, sink
    return previous


def current_sink() -> Sink:
    """The sink in use, chosen with `choose_sink` at first use."""
    global _sink
    if _sink is None:
        _sink = choose_sink()
    return _sink


# --- records ---------------------------------------------------------------------------

_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def _text(value: object) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def record(
    event: str,
    message: str,
    *,
    vm: str | None = None,
    from_: str | None = None,
    to: str | None = None,
    duration_ms: float | None = None,
    result: str | None = None,
    priority: Priority = INFO,
    **extra: object,
) -> None:
    """Record one transition: `message` for people, the rest as HOSTAGENT_* fields.

    Fields left at None are not sent. `extra` names become HOSTAGENT_<NAME>.
    """
    values: dict[str, object] = {
        "EVENT": event,
        "VM": vm,
        "FROM": from_,
        "TO": to,
        "DURATION_MS": None if duration_ms is None else round(duration_ms),
        "RESULT": result,
    }
    for name, value in extra.items():
        if not _FIELD_NAME.fullmatch(name.upper()):
            raise ValueError(f"{name!r} cannot be a journald field name")
        values[name.upper()] = value
    fields = {_PREFIX + name: _text(v) for name, v in values.items() if v is not None}
    caller = sys._getframe(1)
    code = (caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)
    current_sink().write(Entry(message=message, priority=priority, fields=fields, code=code))


def retry(result: str, message: str) -> None:
    """A start retried with backoff (`core.backoff.keep_trying`): "retrying" at its
    first failure, a warning; "started" when it succeeds at last."""
    record("retry", message, result=result,
           priority=Priority.WARNING if result == "retrying" else INFO)


def _priority(levelno: int) -> Priority:
    if levelno >= logging.CRITICAL:
        return Priority.CRIT
    if levelno >= logging.ERROR:
        return Priority.ERR
    if levelno >= logging.WARNING:
        return Priority.WARNING
    if levelno >= logging.INFO:
        return Priority.INFO
    return Priority.DEBUG


class LogHandler(logging.Handler):
    """Routes `logging` records to the journal sink (the current one unless given)."""

    def __init__(self, level: int = logging.NOTSET, *, sink: Sink | None = None) -> None:
        super().__init__(level)
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry = Entry(
                message=self.format(record),
                priority=_priority(record.levelno),
                fields={f"{_PREFIX}LOGGER": record.name},
                code=(record.pathname, record.lineno, record.funcName),
            )
            (self._sink or current_sink()).write(entry)
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


# --- systemd service protocol ----------------------------------------------------------


def notify(status: str | None = None, *, ready: bool = False, watchdog: bool = False) -> bool:
    """Tell systemd (sd_notify) we are ready, what we are doing, or that we are alive.

    Returns whether a message was sent: False outside a Type=notify service (no
    NOTIFY_SOCKET) and when sending failed, which must not stop the agent.
    """
    lines: list[str] = []
    if ready:
        lines.append("READY=1")
    if status is not None:
        lines.append("STATUS=" + " ".join(status.splitlines()))  # one line per variable
    if watchdog:
        lines.append("WATCHDOG=1")
    if not lines or not os.environ.get("NOTIFY_SOCKET"):
        return False
    import systemd.daemon

    try:
        return bool(systemd.daemon.notify("\n".join(lines)))
    except OSError:
        return False


def watchdog_interval(*, environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds within which systemd wants WATCHDOG=1 (WatchdogSec=), None if it does not.

    Ping at least twice per interval.
    """
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        seconds = int(usec) / 1_000_000
    except ValueError:
        return None
    return seconds if seconds > 0 else None
