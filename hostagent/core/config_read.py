"""How the configuration's values are read: each reader takes a TOML value and its key
and returns the typed field, or raises `_Problem` naming the key, what is wrong and the
fix (`hostagent.core.config` gathers them into one `ConfigError`). Durations, PCI addresses,
listen addresses, lists and sections of dataclasses are read here, once."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import re
import contextlib
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import date, datetime, time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


# --- durations -------------------------------------------------------------------------

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_HINT = 'write a number with a unit, e.g. "500ms", "90s", "2m" or "1h30m"'


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"500ms"``, ``"90s"``, ``"2m"`` or ``"1h30m"``.

    A bare number is refused rather than guessed: "90" could mean seconds or minutes.
    Raises ValueError with a message that says how to write it.
    """
    s = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        raise ValueError(f'"{text}" has no unit; write "{s}s" for seconds (units: ms, s, m, h)')
    parts = list(_DURATION_PART.finditer(s))
    if not s or "".join(m.group(0) for m in parts) != s:
        raise ValueError(f'"{text}" is not a duration; {_DURATION_HINT}')
    return sum(float(m.group(1)) * _UNITS[m.group(2)] for m in parts)


class LogLevel(enum.StrEnum):
    """``log_level``: the least severe of hostagent's own log records that reaches the
    journal (libraries' records stay at "info" and above: their debug would flood it)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


# --- the reading machinery -------------------------------------------------------------
#
# Each configuration dataclass is its own schema: a field that appears in the file
# carries, in its metadata, the reader that checks and converts the TOML value (and, if
# required, an example for the "missing" message). `_build` walks those fields, so a new
# key is one field declaration, not a new branch of checks.


class _Problem(Exception):
    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem
        self.fix = fix
        # What the table reads as with its bad keys left at their defaults (None when a
        # required one is bad): the checks that span sections still run on it, so that
        # one reading names every problem.
        self.salvaged: Any = None

    @property
    def each(self) -> list[_Problem]:
        return [self]


class _Problems(_Problem):
    """Several problems in one table, the first standing for them all where one is read."""

    def __init__(self, problems: list[_Problem]) -> None:
        first = problems[0]
        super().__init__(first.key, first.problem, first.fix)
        self.problems = problems

    @property
    def each(self) -> list[_Problem]:
        return self.problems


@contextlib.contextmanager
def _gather(problems: list[_Problem]) -> Iterator[None]:
    """Add the problems the block raises to `problems` and go on with the next key."""
    try:
        yield
    except _Problem as p:
        problems.extend(p.each)


def _raise_any(problems: list[_Problem], salvaged: Any = None) -> None:
    if problems:
        error = _Problems(problems) if len(problems) > 1 else problems[0]
        error.salvaged = salvaged
        raise error


_Reader = Callable[[object, str], Any]
_READ = "hostagent.read"
_EXAMPLE = "hostagent.example"
_T = TypeVar("_T", bound="DataclassInstance")


def _key(read: _Reader, example: str = "") -> dict[str, object]:
    """Field metadata: how to read this key, and what to suggest when it is missing."""
    return {_READ: read, _EXAMPLE: example}


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _join(prefix: str, key: str) -> str:
    shown = key if _BARE_KEY.fullmatch(key) else json.dumps(key)
    return f"{prefix}.{shown}" if prefix else shown


# bool before int: in Python, True is an int.
_TOML_TYPES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "an array"),
    (dict, "a table"),
    ((datetime, date, time), "a date/time"),
)


def _toml_type(value: object) -> str:
    return next((name for kind, name in _TOML_TYPES if isinstance(value, kind)), "a value")


def _wrong_type(key: str, value: object, wanted: str, fix: str) -> _Problem:
    return _Problem(key, f"expected {wanted}, got {_toml_type(value)}", fix)


def _build(cls: type[_T], table: object, where: str, **given: Any) -> _T:
    """An instance of dataclass `cls` from a TOML table, every key checked."""
    if not isinstance(table, dict):
        raise _wrong_type(where, table, "a table", f"write it as a [{where}] section")
    fields = {f.name: f for f in dataclasses.fields(cls) if _READ in f.metadata}
    problems = [_unknown_key(_join(where, name), name, list(fields))
                for name in table if name not in fields]
    values: dict[str, Any] = dict(given)
    required = []
    for name, f in fields.items():
        key = _join(where, name)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(name)
        if name in table:
            try:
                values[name] = f.metadata[_READ](table[name], key)
            except _Problem as p:
                problems.extend(p.each)
                if p.salvaged is not None:
                    values[name] = p.salvaged
        elif name in required and name not in given:
            problems.append(
                _Problem(key, "missing", "add " + _example(name, f.metadata[_EXAMPLE], where)))
    if problems:
        whole = all(name in values for name in required)
        _raise_any(problems, cls(**values) if whole else None)
    return cls(**values)


def _example(name: str, example: str, where: str) -> str:
    if example.startswith(f"[{name}]"):  # a whole section
        return example
    return f"{name} = {example} " + (f"under [{where}]" if where else "before any [section]")


# The file's top-level keys, which `hostagent.core.config` adds once its `Config` is defined:
# one of them found in a section was written after a [section] header.
TOP_LEVEL_KEYS: set[str] = set()


def _unknown_key(key: str, name: str, known: list[str]) -> _Problem:
    if "." in key and name in TOP_LEVEL_KEYS:
        # TOML puts every key after a [section] header into that section.
        return _Problem(
            key, "unknown key", f"{name} is a top-level key: move it above the first [section]"
        )
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return _Problem(key, "unknown key", f'did you mean "{close[0]}"?')
    return _Problem(key, "unknown key", "known keys here: " + ", ".join(known))


def _section(cls: type[_T]) -> _Reader:
    return lambda value, key: _build(cls, value, key)


def _table_of(cls: type[_T], name_field: str) -> _Reader:
    """A table of same-shaped tables, e.g. [owners.NAME]; NAME goes into `name_field`."""

    def read(value: object, key: str) -> dict[str, _T]:
        if not isinstance(value, dict):
            raise _wrong_type(key, value, "a table", f"write entries as [{key}.NAME] sections")
        problems: list[_Problem] = []
        entries = {}
        for name, entry in value.items():
            try:
                entries[name] = _build(cls, entry, _join(key, name), **{name_field: name})
            except _Problem as p:
                problems.extend(p.each)
                if p.salvaged is not None:
                    entries[name] = p.salvaged
        _raise_any(problems, entries)
        return entries

    return read


def _text(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise _wrong_type(key, value, "a string", "put the value in double quotes")
    if not value.strip():
        raise _Problem(key, "is empty", "give it a value or remove the key")
    return value


def _guest_command(value: object, key: str) -> str:
    """A command line the lendee's guest runs (``sh -c``); "" for none."""
    if not isinstance(value, str):
        raise _wrong_type(key, value, "a string", "put the command line in double quotes")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise _Problem(key, "is not one command line (a newline or control character)",
                       "write one line; join commands with && or put them in a script")
    if len(value) > 1000:
        raise _Problem(key, f"is {len(value)} characters long (at most 1000)",
                       "put the commands in a script in the guest and name it here")
    return value.strip()


def _absolute_path(value: object, key: str) -> Path:
    path = Path(_text(value, key))
    if not path.is_absolute():
        raise _Problem(key, f'"{path}" is a relative path', "write the full path from /")
    return path


def _optional_path(value: object, key: str) -> Path | None:
    if value == "":
        return None
    return _absolute_path(value, key)


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(key, value, "true or false", "write true or false, without quotes")
    return value


def _duration(value: object, key: str) -> float:
    if not isinstance(value, str):
        fix = _DURATION_HINT
        if isinstance(value, int | float) and not isinstance(value, bool):
            fix = f'write "{value}s" for seconds (in quotes, with a unit)'
        raise _wrong_type(key, value, "a duration string", fix)
    try:
        return parse_duration(value)
    except ValueError as e:
        raise _Problem(key, str(e)) from e


def _positive_duration(value: object, key: str) -> float:
    seconds = _duration(value, key)
    if seconds <= 0:
        raise _Problem(key, "must be longer than zero", 'e.g. "90s"')
    return seconds


def _optional_duration(value: object, key: str) -> float | None:
    if value == "":
        return None
    return _duration(value, key)


def _choice(kind: type[enum.StrEnum]) -> _Reader:
    allowed = [str(member) for member in kind]

    def read(value: object, key: str) -> enum.StrEnum:
        text = _text(value, key)
        if text not in allowed:
            raise _Problem(key, f'"{text}" is not allowed', "write one of: " + ", ".join(allowed))
        return kind(text)

    return read


def _annotation_prefix(value: object, key: str) -> str:
    prefix = _text(value, key)
    if not prefix.endswith("/"):
        raise _Problem(key, f'"{prefix}" does not end with "/"', f'write "{prefix}/"')
    return prefix


_TAINT = re.compile(r"[A-Za-z0-9./_-]+(=[A-Za-z0-9._-]*)?:(NoSchedule|PreferNoSchedule|NoExecute)")


def _taint(value: object, key: str) -> str:
    taint = _text(value, key)
    if not _TAINT.fullmatch(taint):
        raise _Problem(key, f'"{taint}" is not a taint',
                       'write it as kubectl does: "key=value:NoSchedule" (or PreferNoSchedule, '
                       'NoExecute)')
    return taint


_PCI = re.compile(r"(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")


def _canonical_pci(text: str) -> str | None:
    """``0000:01:00.0`` for any accepted spelling of a PCI address, None if it is not one."""
    m = _PCI.fullmatch(text.strip().lower())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    return f"{domain or '0000'}:{bus}:{device}.{function}"


def _pci(value: object, key: str) -> str:
    address = _canonical_pci(_text(value, key))
    if address is None:
        raise _Problem(
            key,
            f'"{value}" is not a PCI address',
            'write it as domain:bus:device.function, e.g. "0000:01:00.0" (see lspci -D)',
        )
    return address


def _list(item: _Reader, *, at_least_one: str = "") -> _Reader:
    """An array of distinct items; `at_least_one`, if given, is the fix for an empty one."""

    def read(value: object, key: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            fix = f'write it in brackets: ["{value}"]' if isinstance(value, str) else ""
            raise _wrong_type(key, value, "an array", fix or "write it in brackets: [...]")
        if not value and at_least_one:
            raise _Problem(key, "is empty", at_least_one)
        problems: list[_Problem] = []
        read_items = []
        for i, v in enumerate(value):
            with _gather(problems):
                read_items.append(item(v, f"{key}[{i}]"))
        _raise_any(problems)
        items = tuple(read_items)
        for i, v in enumerate(items):
            if v in items[:i]:
                raise _Problem(f"{key}[{i}]", f'"{v}" is listed twice', "remove one")
        return items

    return read


_GPU_REFS = _list(_text, at_least_one="list GPU labels from [gpus] or PCI addresses")


def _count(value: object, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong_type(key, value, "an integer", "write a whole number without quotes")
    return value


def _port(value: object, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong_type(key, value, "an integer", "write the port number without quotes")
    if not 0 < value < 65536:
        raise _Problem(key, f"{value} is not a TCP port", "write a number from 1 to 65535")
    return value


_LISTEN = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]*):([0-9]+)")


def _split_listen(text: str) -> tuple[str, int] | None:
    """(host, port) of "host:port", "[v6]:port" or ":port" (host "": every address)."""
    m = _LISTEN.fullmatch(text.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        return None
    return m.group(1).strip("[]"), int(m.group(2))


def _listen(value: object, key: str) -> str | None:
    if value == "":
        return None
    text = _text(value, key)
    if _split_listen(text) is None:
        raise _Problem(
            key,
            f'"{text}" is not an address to listen on',
            'write host:port, e.g. "127.0.0.1:9477", "[::1]:9477" or ":9477" for every address',
        )
    return text.strip()


def _listen_or_port(value: object, key: str) -> str:
    """A port number means every address: ``2222`` is ``":2222"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f":{_port(value, key)}"
    text = _listen(value, key)
    if text is None:
        raise _Problem(key, "is empty", 'write host:port, e.g. "0.0.0.0:2222", or a port number')
    return text


_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


# The control socket's verbs (hostagent.service.verbs serves them), for control_verbs.
CONTROL_VERBS = ("status", "play", "release", "hold", "resume", "lend", "reclaim", "reserve")


# What a grant may name beyond the verbs: cancel (or replace) a reservation someone else
# made (hostagent.service.verbs); without it only the one who reserved may.
CANCEL_ANY = "cancel-any"
# The verbs that name an owner VM: "verb:vm" grants one on that VM alone.
_SCOPED = ("play", "release", "reserve", CANCEL_ANY)
_SCOPED_VM = re.compile(r"[A-Za-z0-9_.-]+")


def _control_verb(value: object, key: str) -> str:
    entry = _text(value, key)
    verb, colon, vm = entry.partition(":")
    if verb not in (*CONTROL_VERBS, CANCEL_ANY):
        raise _Problem(key, f'"{entry}" is not a control verb',
                       f"write one of {', '.join((*CONTROL_VERBS, CANCEL_ANY))}, or "
                       '"reserve:gaming1" for one VM')
    if colon and (verb not in _SCOPED or not _SCOPED_VM.fullmatch(vm)):
        raise _Problem(key, f'"{entry}" does not scope a verb to a VM',
                       f"only {', '.join(_SCOPED)} name a VM: write e.g. \"reserve:gaming1\"")
    return entry


def _control_verbs(value: object, key: str) -> frozenset[str]:
    verbs = frozenset(_list(_control_verb)(value, key))
    # resume and lend are one verb under two names: granting one grants both.
    return verbs | {"resume", "lend"} if verbs & {"resume", "lend"} else verbs


def _group(value: object, key: str) -> str:
    name = _text(value, key)
    if not _GROUP.fullmatch(name):
        raise _Problem(key, f'"{name}" is not a group name', 'write a name, e.g. "hostagent"')
    return name


_RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def _expected(value: object, key: str) -> dict[str, int]:
    """`[kubernetes] expected`: extended resource name → count per lent GPU."""
    example = '{ "nvidia.com/gpu" = 4 } (the count per lent GPU)'
    if not isinstance(value, dict):
        raise _wrong_type(key, value, "a table", f"write it as an inline table: {example}")
    if not value:
        raise _Problem(key, "is empty", f"name at least one resource, e.g. {example}, "
                       "or remove the key to read it from the node's labels")
    counts: dict[str, int] = {}
    for name, count in value.items():
        where = _join(key, name)
        if not _RESOURCE_NAME.fullmatch(name) or len(name) > 253:
            raise _Problem(where, f'"{name}" is not an extended resource name',
                           "write it as `kubectl describe node` lists it under Allocatable, "
                           'e.g. "nvidia.com/gpu" or "nvidia.com/mig-1g.10gb"')
        number = _count(count, where)
        if number < 1:
            raise _Problem(where, f"{number} is not a count", "write 1 or more, or remove it")
        counts[name] = number
    return counts


# Kubernetes' qualified name (apimachinery's validation.IsQualifiedName, v1.35.4): an
# optional DNS-1123 subdomain of at most 253 characters and "/", then a name of at most 63.
_DNS_SUBDOMAIN = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_LABEL_KEY = rf"(?:{_DNS_SUBDOMAIN}/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"


def _label_key_or_off(value: object, key: str) -> str | None:
    if value == "":
        return None
    label = _text(value, key)
    if not re.fullmatch(_LABEL_KEY, label) or len(label.rpartition("/")[0]) > 253:
        raise _Problem(key, f'"{label}" is not a label key',
                       'write e.g. "hostagent.io/borrowed", or "" for no label')
    return label


def _label_key(value: object, key: str) -> str:
    label = _label_key_or_off(value, key)
    if label is None:
        raise _Problem(key, "an empty label key",
                       'write e.g. "nvidia.com/gpu.deploy.device-plugin"')
    return label


_LABEL_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_REQUIREMENT = re.compile(rf"!?{_LABEL_KEY}|{_LABEL_KEY}(?:==?|!=){_LABEL_VALUE}")


def _label_selector(value: object, key: str) -> str:
    """An equality-based label selector, as ``kubectl get pods -l`` takes it."""
    selector = _text(value, key)
    if not selector or not all(_REQUIREMENT.fullmatch(r) for r in selector.split(",")):
        raise _Problem(key, f'"{selector}" is not a label selector',
                       'write it as kubectl -l does: "key=value", "key!=value", "key" or '
                       '"!key", comma-separated')
    return selector


# What MQTT may command: the control verbs that change something (status is published).
MQTT_VERBS = ("play", "release", "hold", "lend", "reclaim", "reserve")
_MQTT_TOPIC = re.compile(r"[^\s+#/\x00]+(/[^\s+#/\x00]+)*")


def _broker(value: object, key: str) -> str:
    url = _text(value, key)
    example = 'write e.g. "mqtt://broker.lan" or "mqtts://broker.lan:8883"'
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise _Problem(key, f'"{url}" is not a broker URL', example) from None
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise _Problem(key, f'"{url}" is not a broker URL', example)
    if parts.username is not None or parts.password is not None:
        raise _Problem(key, "the URL carries a user or password",
                       "remove it: set username and password_file under [mqtt]")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise _Problem(key, f'"{url}" has a path', example)
    if port == 0:
        raise _Problem(key, f'"{url}" has port 0', "write a port from 1 to 65535")
    return url


def _topic(value: object, key: str) -> str:
    topic = _text(value, key)
    if not _MQTT_TOPIC.fullmatch(topic) or len(topic) > 128:
        raise _Problem(key, f'"{topic[:64]}" is not a topic prefix',
                       'write levels joined by "/", without +, #, spaces or a "/" at either '
                       'end, e.g. "hostagent"')
    return topic


def _mqtt_verb(value: object, key: str) -> str:
    verb = _text(value, key)
    verb = "lend" if verb == "resume" else verb
    if verb == CANCEL_ANY:  # granted by name only, never by default
        return verb
    if verb not in MQTT_VERBS:
        raise _Problem(key, f'"{verb}" is not a verb MQTT can command',
                       f"write some of {', '.join(MQTT_VERBS)} (its states are published)")
    return verb
