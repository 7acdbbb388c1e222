"""Read hostagent's configuration: one TOML file, checked whole before the agent starts.

The agent moves hardware between running VMs, so it refuses to start on a file it does
not fully understand. Every mistake names the file, the key (``owners.gaming1.gpus[1]``),
what is wrong and how to fix it; one `ConfigError` carries every mistake of the file in
its ``problems`` (those that span sections once each section reads), so a single run of
``hostagent check-config`` names them all.

Example (``/etc/hostagent/config.toml``; everything but ``[lendee]`` is optional)::

    libvirt_uri = "qemu:///system"
    hook_socket = "/run/hostagent/hook.sock"
    control_socket = "/run/hostagent/control.sock"
    control_group = "hostagent"             # may use control.sock (mode 0660); default: root only
    control_verbs = ["status", "hold", "resume"]  # what control_group may do (the default)
    state_dir = "/var/lib/hostagent"        # state.toml and spool/ live here

    [lendee]                                # the Kubernetes worker VM that borrows GPUs
    domain = "gpu-node"                     # libvirt domain name
    node = "gpu-node"                       # Kubernetes node name; defaults to domain
    gpus = ["gpu-a", "gpu-b", "gpu-c"]      # every GPU it may borrow: labels or PCI addresses
    min_gpus = 1                            # fewer free than this: the lendee stays off

    [gpus.gpu-a]                            # a label of your choosing
    pci = "0000:01:00.0"                    # the GPU function; every function of its
    functions = ["0000:01:00.1"]            # slot moves with it, listed here or not
    uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000001"  # checked inside the lendee
    name = "RTX 3050"                       # for messages

    [gpus.gpu-b]
    pci = "0000:02:00.0"
    functions = ["0000:02:00.1"]

    [gpus.gpu-c]
    pci = "0000:03:00.0"

    [gpus.gpu-d]                            # by UUID alone: placed where NVML sees it
    uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000004"

    [owners.gaming1]                        # a gaming VM, by libvirt domain name
    gpus = ["gpu-a"]

    [owners.gaming2]
    gpus = ["gpu-b"]
    start_at_boot = false                   # true: started once per host boot, GPUs freed first

    [owners.gaming-win]                     # another VM on gpu-a: owners of a GPU take turns
    gpus = ["gpu-a"]

    [timeouts]                              # durations: "500ms", "90s", "2m", "1h30m"
    guest_agent = "3m"                      # for the lendee's guest agent to answer
    shutdown = "2m"                         # for the lendee to stop after guest-shutdown
    start = "2m"                            # for a VM to start
    drain = "5m"                            # for the node to drain
    ready = "10m"                           # for the node to be Ready with its GPUs

    [policy]
    relend_delay = "30s"                    # quiet time before lending GPUs back
    force_off_after = ""                    # "" = never destroy the lendee (default)
    on_drain_timeout = "proceed"            # or "abort"
    lint_before_start = true                # refuse to start a VM whose XML has errors
    partial = true                          # lend the free GPUs while others play; false:
                                            # the lendee runs only with all of its GPUs
    regrow = "when-idle"                    # add GPUs a game freed (a restart): "when-idle"
                                            # (no GPU pod on the node), "always" or "never"
    regrow_max_wait = "2m"                  # when-idle restarts anyway after this; "": no limit
    hotplug = "none"                        # "add": attach freed GPUs live, no restart

    [verify]                                # after a lend: does the guest see its GPUs?
    method = "guest-agent"                  # "guest-agent" (guest-exec), "ssh" or "none"
    command = "nvidia-smi"                  # run in the guest (PATH is searched)
    timeout = "2m"                          # keep asking this long: drivers load late

    [verify.ssh]                            # only for method = "ssh"
    host = "gpu-node.lan"
    port = 22
    user = "hostagent"
    key = "/var/lib/hostagent/id_ed25519"
    known_hosts = "/var/lib/hostagent/known_hosts"  # the guest's host key is checked

    [kubernetes]
    kubeconfig = "/etc/rancher/k3s/k3s.yaml"  # default: the client's own lookup
    annotation_prefix = "hostagent.io/"
    gpu_resource = "nvidia.com/gpu"
    gpu_api = "auto"                        # "device-plugin", "dra" (resource.k8s.io/v1),
                                            # or "auto": dra where the driver's DeviceClass
                                            # or ResourceSlices exist
    dra_driver = "gpu.nvidia.com"           # the DRA driver whose slices list the GPUs
    drain_emptydir = true                   # evict pods that use emptyDir volumes
    drain_unmanaged = false                 # evict pods no controller will recreate
    lent_taints = ["hostagent.io/borrowed=true:NoSchedule"]  # while lent; none by default
    evict_retry = "5s"                      # retry an eviction a PodDisruptionBudget refused
    borrowed_label = "hostagent.io/borrowed"  # label "true" while lent; "" for none
    expected = { "nvidia.com/gpu" = 4 }     # per lent GPU; default: read from the node's
                                            # GPU Feature Discovery labels (time-slicing, MIG)
    grace_period = "30s"                    # evicted pods' grace; default: each pod's own
    skip_wait_for_delete_timeout = "10s"    # a pod this long past its deletion counts as gone

    [metrics]                               # Prometheus /metrics and /healthz; off without it
    listen = "127.0.0.1:9477"               # host:port ("[::1]:9477"; ":9477" = every address)

    [ssh]                                   # the home-automation endpoint; off without it
    listen = "0.0.0.0:2222"                 # host:port, or a port number: every address
    host_key = "/var/lib/hostagent/ssh_host_ed25519_key"  # the default; made if missing
    authorized_keys = "/etc/hostagent/authorized_keys"    # each key: verbs="…",vms="…"

    [mqtt]                                  # Home Assistant over MQTT; off without it
    broker = "mqtts://broker.lan:8883"      # mqtt://host[:port] (1883) or mqtts:// (8883)
    ca = "/etc/hostagent/broker-ca.pem"     # mqtts only; default: the system's CAs
    username = "hostagent"
    password_file = "/run/credentials/hostagent.service/mqtt-password"  # the default when
                                            # the unit passes the credential mqtt-password
    discovery_prefix = "homeassistant"
    base_topic = "hostagent"                # states and commands live under it
    verbs = ["play", "release", "hold", "lend", "reclaim"]  # what MQTT may command (all)
    vms = ["gaming1"]                       # the owners it may start and stop; default: all
    per_entity = false                      # true: one discovery message per entity

Rules beyond the types:

- A GPU reference (in ``lendee.gpus`` or ``owners.*.gpus``) is a label from ``[gpus]``,
  a PCI address, or a UUID (``GPU-…``). The address of a declared GPU means that GPU;
  any other address stands for a GPU with that single function (declare it under
  ``[gpus]`` to move its audio function along); so does any other UUID, by UUID alone.
  Addresses are written ``DDDD:BB:DD.F``; ``BB:DD.F`` means domain 0000. They are kept
  lowercase with the domain.
- A ``[gpus]`` entry has a ``pci`` address, a ``uuid``, or both. One given by UUID alone
  is placed where NVML sees it when the agent starts (`hostagent.gpus.resolve_uuids`);
  NVML cannot see a GPU bound to vfio-pci, so passthrough GPUs need ``pci`` (``hostagent
  config init`` writes both). A UUID names one GPU.
- A PCI function belongs to one GPU. A GPU may have several owners (a Windows and a
  Linux gaming VM on one card): they take turns, and a start while another owner holds
  the card is refused at once.
- The lendee is not an owner: it borrows, it does not lend.
- The lendee may borrow a GPU no owner claims: that GPU is simply always the lendee's.
- The lendee's persistent definition lists every GPU it borrows; each boot runs with
  those that are free (``policy.partial``), and only when at least ``lendee.min_gpus``
  are (1 to the number in ``lendee.gpus``).
- ``policy.regrow`` says when the lendee, running with fewer GPUs than it may borrow,
  restarts to add those a game freed: ``"when-idle"`` when no pod on the node requests
  a GPU (without ``[kubernetes]``: as ``"always"``), ``"always"`` after
  ``relend_delay``, ``"never"`` only when it stops for another reason.
  ``policy.regrow_max_wait`` bounds the wait of ``"when-idle"``: after it, the lendee
  restarts and the GPU pods still running start over (``""``: no bound).
- ``policy.hotplug = "add"`` attaches the GPUs a game freed to the running lendee
  (its live definition only) instead of that restart; a hot-add that fails leaves
  them to the regrow. ``"none"`` (the default): every change is a restart.
- An owner may keep a GPU the lendee does not borrow: hostagent leaves it alone.
- A ``[gpus]`` entry nobody references is allowed and ignored.
- Timeouts must be longer than zero; ``relend_delay``, ``force_off_after`` and
  ``regrow_max_wait`` may be 0.
- ``force_off_after`` is how long after a guest-agent shutdown timed out the lendee is
  destroyed. Unset (or ``""``), it never is.
- Paths must be absolute: the agent's working directory is nobody's business.
- ``verify.method = "ssh"`` needs ``[verify.ssh]``; its ``known_hosts`` is required,
  because a check that trusts any host key proves nothing.
- ``control_group`` is a group name; the agent looks it up when it starts and refuses
  to start if there is no such group. Without it the control socket is root's alone.
- ``control_verbs`` lists the control verbs members of ``control_group`` may use
  (default: status, hold, resume and its other name lend); root may use every verb.
- ``[ssh]`` turns the SSH endpoint on (`hostagent.ssh`, which documents the
  authorized-keys syntax). Its host key is created (ed25519, mode 0600, with a ``.pub``
  beside it) when the file does not exist; an existing one is never replaced.
- ``[mqtt]`` turns the Home Assistant device on (`hostagent.mqtt`, `hostagent.homeassistant`).
  The broker URL carries no user or password: the password is read from
  ``password_file`` (a systemd credential) at each connection. ``mqtt.vms`` lists owners.
- Private keys (``ssh.host_key``, ``verify.ssh.key``) that group or others may read are
  refused, with the fix (``chmod 600``), as OpenSSH refuses them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import re
import tomllib
import contextlib
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hostagent.model import Hotplug, Regrow  # the machine's own policy values

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "DEFAULT_PATH",
    "Config",
    "ConfigError",
    "DrainTimeoutAction",
    "Gpu",
    "Kubernetes",
    "Lendee",
    "Metrics",
    "Mqtt",
    "Owner",
    "Policy",
    "Hotplug",
    "Regrow",
    "Ssh",
    "SshEndpoint",
    "Timeouts",
    "Verify",
    "VerifyMethod",
    "load",
    "parse",
    "parse_duration",
]

DEFAULT_PATH = Path("/etc/hostagent/config.toml")


class ConfigError(Exception):
    """A configuration file hostagent cannot use, and what to do about it."""

    def __init__(
        self,
        *,
        source: str,
        problem: str,
        fix: str = "",
        key: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        self.fix = fix
        self.line = line
        self.column = column
        where = source
        if line is not None:
            where += f":{line}" + (f":{column}" if column is not None else "")
        if key:
            where += f": {key}"
        super().__init__(f"{where}: {problem}" + (f"; {fix}" if fix else ""))
        # Every problem found in one reading, this one first: a file is checked whole,
        # so that one run of check-config names them all.
        self.problems: tuple[ConfigError, ...] = (self,)

    @classmethod
    def several(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error that stands for `errors` (at least one): the first's fields, every
        problem in `problems`, one line each in its message."""
        first = errors[0]
        combined = cls(source=first.source, problem=first.problem, fix=first.fix,
                       key=first.key, line=first.line, column=first.column)
        combined.problems = tuple(errors)
        combined.args = ("\n".join(str(e) for e in errors),)
        return combined


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


def _raise_any(problems: list[_Problem]) -> None:
    if problems:
        raise _Problems(problems) if len(problems) > 1 else problems[0]


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
    for name, f in fields.items():
        key = _join(where, name)
        if name in table:
            with _gather(problems):
                values[name] = f.metadata[_READ](table[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(
                _Problem(key, "missing", "add " + _example(name, f.metadata[_EXAMPLE], where)))
    _raise_any(problems)
    return cls(**values)


def _example(name: str, example: str, where: str) -> str:
    if example.startswith(f"[{name}]"):  # a whole section
        return example
    return f"{name} = {example} " + (f"under [{where}]" if where else "before any [section]")


def _unknown_key(key: str, name: str, known: list[str]) -> _Problem:
    if "." in key and name in _TOP_LEVEL_KEYS:
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
            with _gather(problems):
                entries[name] = _build(cls, entry, _join(key, name), **{name_field: name})
        _raise_any(problems)
        return entries

    return read


def _text(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise _wrong_type(key, value, "a string", "put the value in double quotes")
    if not value.strip():
        raise _Problem(key, "is empty", "give it a value or remove the key")
    return value


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
# The control socket's verbs (hostagent.agent serves them), for control_verbs.
CONTROL_VERBS = ("status", "play", "release", "hold", "resume", "lend", "reclaim")


def _control_verb(value: object, key: str) -> str:
    verb = _text(value, key)
    if verb not in CONTROL_VERBS:
        raise _Problem(key, f'"{verb}" is not a control verb',
                       f"write one of {', '.join(CONTROL_VERBS)}")
    return verb


def _control_verbs(value: object, key: str) -> frozenset[str]:
    verbs = frozenset(_list(_control_verb)(value, key))
    # resume and lend are one verb under two names: granting one grants both.
    return verbs | {"resume", "lend"} if verbs & {"resume", "lend"} else verbs


def _group(value: object, key: str) -> str:
    name = _text(value, key)
    if not _GROUP.fullmatch(name):
        raise _Problem(key, f'"{name}" is not a group name', 'write a name, e.g. "hostagent"')
    return name


# --- the configuration -----------------------------------------------------------------


class DrainTimeoutAction(enum.StrEnum):
    """What to do when the node has not drained within ``timeouts.drain``."""

    PROCEED = "proceed"  # shut the lendee down anyway: the gamer waits no longer
    ABORT = "abort"  # give up: the lendee keeps its GPUs and the owner does not start


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One passthrough GPU: its main PCI function and the functions that move with it."""

    label: str
    # None: given by uuid alone, placed where NVML sees it when the agent starts.
    pci: str | None = field(default=None, metadata=_key(_pci))
    # Other functions that move with it. Every function of its slot does anyway: the
    # agent adds those it finds on the host (`hostagent.gpus.on_host`).
    functions: tuple[str, ...] = field(default=(), metadata=_key(_list(_pci)))
    uuid: str | None = field(default=None, metadata=_key(_text))
    name: str | None = field(default=None, metadata=_key(_text))
    # Not a key: the IOMMU groups of its functions, as the host has them (`on_host`).
    iommu_groups: tuple[str, ...] = ()

    @property
    def pci_functions(self) -> tuple[str, ...]:
        """Every PCI function of this GPU, the main one first (if its address is known)."""
        return (self.pci, *self.functions) if self.pci else self.functions

    def __str__(self) -> str:
        return f"{self.label} ({self.name}, {self.pci or self.uuid})" if self.name else self.label


@dataclass(frozen=True, kw_only=True)
class Lendee:
    """The Kubernetes worker VM that borrows every idle GPU."""

    domain: str = field(metadata=_key(_text, example='"gpu-node"'))
    node: str = field(default="", metadata=_key(_text))
    gpus: tuple[str, ...] = field(metadata=_key(_GPU_REFS, example='["gpu-a"]'))
    # Below this many free GPUs a boot is not worth its drain: the lendee stays off.
    min_gpus: int = field(default=1, metadata=_key(_count))

    def __post_init__(self) -> None:
        # Most setups name the node after the VM, so that is the default.
        if not self.node:
            object.__setattr__(self, "node", self.domain)


@dataclass(frozen=True, kw_only=True)
class Owner:
    """A gaming VM and the GPUs it must have back before it starts."""

    domain: str
    gpus: tuple[str, ...] = field(metadata=_key(_GPU_REFS, example='["gpu-a"]'))
    # Started by the agent once per host boot (instead of libvirt's autostart, which
    # runs before the agent is up to reclaim its GPUs).
    start_at_boot: bool = field(default=False, metadata=_key(_bool))


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long each step may take, in seconds."""

    # The guest agent takes 30-60 s to come up in a freshly booted VM.
    guest_agent: float = field(default=180.0, metadata=_key(_positive_duration))
    shutdown: float = field(default=120.0, metadata=_key(_positive_duration))
    start: float = field(default=120.0, metadata=_key(_positive_duration))
    drain: float = field(default=300.0, metadata=_key(_positive_duration))
    ready: float = field(default=600.0, metadata=_key(_positive_duration))


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Choices an administrator makes; the defaults are the careful ones."""

    relend_delay: float = field(default=30.0, metadata=_key(_duration))
    # None: never destroy. Destroying a booting VM has left a GPU in a power state only a
    # host reboot cured, so forcing is opt-in.
    force_off_after: float | None = field(default=None, metadata=_key(_optional_duration))
    on_drain_timeout: DrainTimeoutAction = field(
        default=DrainTimeoutAction.PROCEED, metadata=_key(_choice(DrainTimeoutAction))
    )
    # Lint a domain's XML against the host before starting it; refuse on errors.
    lint_before_start: bool = field(default=True, metadata=_key(_bool))
    # False: all or nothing, the lendee runs only when every GPU it borrows is free.
    partial: bool = field(default=True, metadata=_key(_bool))
    regrow: Regrow = field(default=Regrow.WHEN_IDLE, metadata=_key(_choice(Regrow)))
    # A when-idle regrow restarts the lendee anyway after this long; None: waits as long
    # as GPU pods run. Waiting leaves the freed GPUs idle: bench/capacity.py weighs it.
    regrow_max_wait: float | None = field(default=120.0, metadata=_key(_optional_duration))
    # "add": GPUs a game freed are attached to the running lendee, no drain, no restart.
    hotplug: Hotplug = field(default=Hotplug.NONE, metadata=_key(_choice(Hotplug)))


class VerifyMethod(enum.StrEnum):
    """How the agent asks the lendee which GPUs its driver sees, after a lend."""

    GUEST_AGENT = "guest-agent"  # guest-exec through qemu-ga: nothing else to set up
    SSH = "ssh"  # for guests whose qemu-ga refuses guest-exec
    NONE = "none"  # trust the cluster's nvidia.com/gpu count alone


@dataclass(frozen=True, kw_only=True)
class Ssh:
    """Where and as whom to reach the lendee over SSH; its host key is always checked."""

    host: str = field(metadata=_key(_text, example='"gpu-node.lan"'))
    port: int = field(default=22, metadata=_key(_port))
    user: str = field(metadata=_key(_text, example='"hostagent"'))
    key: Path = field(metadata=_key(_absolute_path, example='"/var/lib/hostagent/id_ed25519"'))
    known_hosts: Path = field(
        metadata=_key(_absolute_path, example='"/var/lib/hostagent/known_hosts"')
    )


@dataclass(frozen=True, kw_only=True)
class Verify:
    """The in-guest check after a lend: the UUIDs nvidia-smi lists in the lendee."""

    method: VerifyMethod = field(
        default=VerifyMethod.GUEST_AGENT, metadata=_key(_choice(VerifyMethod))
    )
    command: str = field(default="nvidia-smi", metadata=_key(_text))
    # The NVIDIA driver may load after the guest agent answers: keep asking this long.
    timeout: float = field(default=120.0, metadata=_key(_positive_duration))
    ssh: Ssh | None = field(default=None, metadata=_key(_section(Ssh)))


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


def _label_key_or_off(value: object, key: str) -> str | None:
    if value == "":
        return None
    label = _text(value, key)
    prefix, _, name = label.rpartition("/")
    if not re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", name) or len(name) > 63 \
            or (prefix and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", prefix)):
        raise _Problem(key, f'"{label}" is not a label key',
                       'write e.g. "hostagent.io/borrowed", or "" for no label')
    return label


class GpuApi(enum.StrEnum):
    """How the cluster hands out GPUs: "device-plugin" (allocatable ``nvidia.com/gpu``),
    "dra" (Dynamic Resource Allocation: devices in ResourceSlices, by UUID), or "auto"
    (decided at each lend from what the cluster serves)."""

    AUTO = "auto"
    DEVICE_PLUGIN = "device-plugin"
    DRA = "dra"


@dataclass(frozen=True, kw_only=True)
class Kubernetes:
    """How to reach the cluster and how to drain the lendee's node."""

    kubeconfig: Path | None = field(default=None, metadata=_key(_optional_path))
    annotation_prefix: str = field(default="hostagent.io/", metadata=_key(_annotation_prefix))
    gpu_resource: str = field(default="nvidia.com/gpu", metadata=_key(_text))
    gpu_api: GpuApi = field(default=GpuApi.AUTO, metadata=_key(_choice(GpuApi)))
    dra_driver: str = field(default="gpu.nvidia.com", metadata=_key(_text))
    drain_emptydir: bool = field(default=True, metadata=_key(_bool))
    drain_unmanaged: bool = field(default=False, metadata=_key(_bool))
    # Put on the node while it is lent, taken off when it is reclaimed: e.g. to keep
    # workloads that cannot be preempted off borrowed capacity.
    lent_taints: tuple[str, ...] = field(default=(), metadata=_key(_list(_taint)))
    # How often an eviction that a PodDisruptionBudget refuses is tried again (kubectl: 5s).
    evict_retry: float = field(default=5.0, metadata=_key(_positive_duration))
    # A label set to "true" while the node is lent (for a Kueue ResourceFlavor or a
    # scheduler to tell borrowed capacity apart); None: no label.
    borrowed_label: str | None = field(default="hostagent.io/borrowed",
                                       metadata=_key(_label_key_or_off))
    # What the node must report allocatable *per lent GPU* before it is uncordoned,
    # e.g. {"nvidia.com/gpu" = 4} for 4 time-slicing replicas or
    # {"nvidia.com/mig-1g.10gb" = 7} for MIG; None: read from the node's labels.
    expected: dict[str, int] | None = field(default=None, metadata=_key(_expected))
    # Grace period given to evicted pods (kubectl drain --grace-period); None: their own.
    grace_period: float | None = field(default=None, metadata=_key(_optional_duration))
    # A pod whose deletion is this far in the past counts as gone: on a node whose
    # kubelet is unreachable it would stay Terminating forever (kubectl drain
    # --skip-wait-for-delete-timeout). "0s": wait for every pod.
    skip_wait_for_delete_timeout: float = field(default=10.0, metadata=_key(_duration))


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """Where to serve Prometheus metrics and /healthz over HTTP; nowhere unless set."""

    # No authentication: keep it on loopback or a trusted network.
    listen: str | None = field(default=None, metadata=_key(_listen))

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to bind, host "" meaning every address; None when off."""
        return None if self.listen is None else _split_listen(self.listen)


@dataclass(frozen=True, kw_only=True)
class SshEndpoint:
    """The SSH endpoint for home automation (`hostagent.ssh`); off without [ssh]."""

    listen: str = field(metadata=_key(_listen_or_port, example='"0.0.0.0:2222"'))
    # None: ssh_host_ed25519_key in state_dir (Config.ssh_host_key).
    host_key: Path | None = field(default=None, metadata=_key(_absolute_path))
    authorized_keys: Path = field(
        default=Path("/etc/hostagent/authorized_keys"), metadata=_key(_absolute_path)
    )

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to bind, host "" meaning every address."""
        address = _split_listen(self.listen)
        assert address is not None  # checked when read
        return address


# What MQTT may command: the control verbs that change something (status is published).
MQTT_VERBS = ("play", "release", "hold", "lend", "reclaim")
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
    if verb not in MQTT_VERBS:
        raise _Problem(key, f'"{verb}" is not a verb MQTT can command',
                       f"write some of {', '.join(MQTT_VERBS)} (its states are published)")
    return verb


@dataclass(frozen=True, kw_only=True)
class Mqtt:
    """The Home Assistant device over MQTT (`hostagent.mqtt`); off without [mqtt]."""

    broker: str = field(metadata=_key(_broker, example='"mqtt://broker.lan"'))
    # mqtts: the CA that signed the broker's certificate; None: the system's.
    ca: Path | None = field(default=None, metadata=_key(_absolute_path))
    username: str | None = field(default=None, metadata=_key(_text))
    # None: $CREDENTIALS_DIRECTORY/mqtt-password when the unit passes that credential.
    password_file: Path | None = field(default=None, metadata=_key(_absolute_path))
    discovery_prefix: str = field(default="homeassistant", metadata=_key(_topic))
    base_topic: str = field(default="hostagent", metadata=_key(_topic))
    verbs: frozenset[str] = field(default=frozenset(MQTT_VERBS),
                                  metadata=_key(lambda v, k: frozenset(_list(_mqtt_verb)(v, k))))
    # None: every owner; else the owners whose switch may start and stop them.
    vms: tuple[str, ...] | None = field(default=None, metadata=_key(_list(_text)))
    # True: one discovery message per entity (Home Assistant before 2024.11).
    per_entity: bool = field(default=False, metadata=_key(_bool))

    @property
    def tls(self) -> bool:
        return urllib.parse.urlsplit(self.broker).scheme == "mqtts"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the broker."""
        parts = urllib.parse.urlsplit(self.broker)
        assert parts.hostname is not None  # checked when read
        return parts.hostname, parts.port or (8883 if self.tls else 1883)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. GPU references are resolved to labels of `gpus`."""

    lendee: Lendee = field(
        metadata=_key(
            _section(Lendee), example='[lendee] with domain = "gpu-node" and gpus = ["gpu-a"]'
        )
    )
    gpus: Mapping[str, Gpu] = field(default_factory=dict, metadata=_key(_table_of(Gpu, "label")))
    owners: Mapping[str, Owner] = field(
        default_factory=dict, metadata=_key(_table_of(Owner, "domain"))
    )
    timeouts: Timeouts = field(default_factory=Timeouts, metadata=_key(_section(Timeouts)))
    policy: Policy = field(default_factory=Policy, metadata=_key(_section(Policy)))
    # None: no [kubernetes] section, the agent moves GPUs between VMs only.
    kubernetes: Kubernetes | None = field(default=None, metadata=_key(_section(Kubernetes)))
    verify: Verify = field(default_factory=Verify, metadata=_key(_section(Verify)))
    metrics: Metrics = field(default_factory=Metrics, metadata=_key(_section(Metrics)))
    # None: no [ssh] section, no SSH endpoint.
    ssh: SshEndpoint | None = field(default=None, metadata=_key(_section(SshEndpoint)))
    # None: no [mqtt] section, no Home Assistant device.
    mqtt: Mqtt | None = field(default=None, metadata=_key(_section(Mqtt)))
    libvirt_uri: str = field(default="qemu:///system", metadata=_key(_text))
    hook_socket: Path = field(
        default=Path("/run/hostagent/hook.sock"), metadata=_key(_absolute_path)
    )
    control_socket: Path = field(
        default=Path("/run/hostagent/control.sock"), metadata=_key(_absolute_path)
    )
    # None: the control socket is root's alone (0600); a group makes it 0660.
    control_group: str | None = field(default=None, metadata=_key(_group))
    # What control_group's members may do on the control socket; root may do everything.
    control_verbs: frozenset[str] = field(
        default=frozenset({"status", "hold", "resume", "lend"}), metadata=_key(_control_verbs)
    )
    state_dir: Path = field(default=Path("/var/lib/hostagent"), metadata=_key(_absolute_path))
    source: str = "<config>"  # where it was read from, for messages

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.toml"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def ssh_host_key(self) -> Path | None:
        """The SSH endpoint's host key file; None when the endpoint is off."""
        if self.ssh is None:
            return None
        return self.ssh.host_key or self.state_dir / "ssh_host_ed25519_key"

    def owners_of(self, gpu: str) -> tuple[str, ...]:
        """The domains that own GPU label `gpu`, in the file's order; () if only the
        lendee uses it."""
        return tuple(o.domain for o in self.owners.values() if gpu in o.gpus)

    def gpus_of(self, domain: str) -> tuple[str, ...]:
        """GPU labels that `domain` (the lendee or an owner) uses; () for any other VM."""
        if domain == self.lendee.domain:
            return self.lendee.gpus
        owner = self.owners.get(domain)
        return owner.gpus if owner else ()

    def shared_gpus(self, owner: str) -> frozenset[str]:
        """The GPUs the lendee must give back before `owner` can start."""
        return frozenset(self.gpus_of(owner)) & frozenset(self.lendee.gpus)


_TOP_LEVEL_KEYS = frozenset(f.name for f in dataclasses.fields(Config) if _READ in f.metadata)


# --- cross-references ------------------------------------------------------------------


def _link(config: Config) -> Config:
    """Check what spans sections, and resolve every GPU reference to a label."""
    gpus = dict(config.gpus)
    holder: dict[str, tuple[str, str]] = {}  # PCI function -> (GPU label, key that set it)
    by_uuid: dict[str, str] = {}  # UUID -> GPU label
    problems: list[_Problem] = []
    for label, gpu in gpus.items():
        if gpu.pci is None and gpu.uuid is None:
            where = _join("gpus", label)
            problems.append(_Problem(
                f"{where}.pci",
                "missing",
                f'add pci = "0000:01:00.0" under [{where}] (see lspci -D), or uuid = '
                '"GPU-..." if NVML on this host sees it (see hostagent gpus)',
            ))
        if gpu.uuid is not None:
            if gpu.uuid in by_uuid:
                problems.append(_Problem(
                    f"{_join('gpus', label)}.uuid",
                    f"{gpu.uuid} is already the UUID of GPU {by_uuid[gpu.uuid]}",
                    "a UUID names one GPU: fix one of them",
                ))
            else:
                by_uuid[gpu.uuid] = label
        keys = [f"{_join('gpus', label)}.pci"] * (gpu.pci is not None) + [
            f"{_join('gpus', label)}.functions[{i}]" for i in range(len(gpu.functions))
        ]
        for address, key in zip(gpu.pci_functions, keys, strict=True):
            if address in holder:
                other, other_key = holder[address]
                problems.append(_Problem(
                    key,
                    f"{address} is already a function of GPU {other} ({other_key})",
                    "a PCI function belongs to one GPU: remove one of them",
                ))
            else:
                holder[address] = (label, key)

    def resolve(ref: str, key: str) -> str:
        if ref in gpus:
            return ref
        if ref.startswith("GPU-"):
            if ref not in by_uuid:
                gpus[ref] = Gpu(label=ref, uuid=ref)
                by_uuid[ref] = ref
            return by_uuid[ref]
        address = _canonical_pci(ref)
        if address is None:
            # Labels often differ by one letter (gpu-a, gpu-b): list them, do not guess.
            fix = f"define it as a [{_join('gpus', ref)}] section"
            if gpus:
                fix += " or use one of: " + ", ".join(gpus)
            raise _Problem(key, f'unknown GPU "{ref}"', fix)
        if address not in holder:
            gpus[address] = Gpu(label=address, pci=address)
            holder[address] = (address, key)
            return address
        label, _ = holder[address]
        if gpus[label].pci != address:
            raise _Problem(
                key,
                f"{address} is not a GPU but another function of GPU {label}",
                f'list "{label}" instead: its functions move with it',
            )
        return label

    def resolve_all(refs: tuple[str, ...], key: str) -> tuple[str, ...]:
        at: dict[str, int] = {}  # label -> where it is first listed
        for i, ref in enumerate(refs):
            with _gather(problems):
                label = resolve(ref, f"{key}[{i}]")
                if label in at:
                    raise _Problem(f"{key}[{i}]",
                                   f"GPU {label} is already listed at {key}[{at[label]}]",
                                   "remove one")
                at[label] = i
        return tuple(at)

    if config.verify.method is VerifyMethod.SSH and config.verify.ssh is None:
        problems.append(_Problem(
            "verify.ssh",
            'missing: verify.method = "ssh" needs it',
            "add a [verify.ssh] section with host, user, key and known_hosts",
        ))
    lendee = dataclasses.replace(config.lendee, gpus=resolve_all(config.lendee.gpus, "lendee.gpus"))
    # Counted only when every GPU of lendee.gpus reads: a bad one is its own problem.
    complete = len(lendee.gpus) == len(config.lendee.gpus)
    if complete and not 1 <= lendee.min_gpus <= len(lendee.gpus):
        problems.append(_Problem(
            "lendee.min_gpus",
            f"{lendee.min_gpus} is not between 1 and the {len(lendee.gpus)} GPU(s) in lendee.gpus",
            f"write a number from 1 to {len(lendee.gpus)} (1, the default, runs the lendee "
            "whenever a GPU is free)",
        ))
    owners: dict[str, Owner] = {}
    for domain, owner in config.owners.items():
        key = _join("owners", domain)
        if domain == lendee.domain:
            problems.append(_Problem(
                key,
                f"{domain} is the lendee, and the lendee cannot also own GPUs",
                f"remove [{key}]: the lendee borrows what lendee.gpus lists",
            ))
            continue
        owners[domain] = dataclasses.replace(owner, gpus=resolve_all(owner.gpus, f"{key}.gpus"))
    if config.mqtt is not None and config.mqtt.ca is not None and not config.mqtt.tls:
        problems.append(_Problem("mqtt.ca", "set, but the broker URL is mqtt:// (no TLS)",
                                 "write the broker as mqtts://... or remove ca"))
    for i, vm in enumerate((config.mqtt.vms or ()) if config.mqtt else ()):
        if vm not in owners:
            problems.append(_Problem(
                f"mqtt.vms[{i}]", f'"{vm}" is not an owner VM',
                f"list some of {', '.join(owners) or 'the [owners] (none yet)'}"))
    _raise_any(problems)
    return dataclasses.replace(config, lendee=lendee, owners=owners, gpus=gpus)


# --- entry points ----------------------------------------------------------------------

_TOML_POSITION = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)$")


def parse(text: str, source: str = "<config>") -> Config:
    """The configuration in TOML `text`; `source` names it in error messages."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _syntax_error(e, text, source) from None
    try:
        # Problems that span sections are looked for once every section reads.
        return _link(_build(Config, document, "", source=source))
    except _Problem as p:
        raise ConfigError.several([
            ConfigError(source=source, key=one.key, problem=one.problem, fix=one.fix)
            for one in p.each]) from None


def _syntax_error(error: tomllib.TOMLDecodeError, text: str, source: str) -> ConfigError:
    message = str(error)
    m = _TOML_POSITION.search(message)
    if m is None:
        return ConfigError(source=source, problem=f"not valid TOML: {message}")
    lines = text.splitlines()
    if m.group(1) is None:
        # Something still open when the file ends (a string, a bracket): the last line.
        line = max(len(lines), 1)
        column = len(lines[-1]) + 1 if lines else 1
        where = " at the end of the file"
    else:
        line, column, where = int(m.group(1)), int(m.group(2)), ""
    shown = f' in "{lines[line - 1].strip()}"' if 0 < line <= len(lines) else ""
    return ConfigError(
        source=source,
        line=line,
        column=column,
        problem=f"not valid TOML: {message[: m.start()]}{where}{shown}",
        fix='check quotes, brackets and "key = value" on that line',
    )


def load(path: Path = DEFAULT_PATH) -> Config:
    """The configuration in file `path`."""
    source = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            source=source,
            problem="no such file",
            fix="create one with `hostagent config init`, then edit it",
        ) from None
    except OSError as e:
        raise ConfigError(source=source, problem=f"cannot read it: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            source=source,
            line=data.count(b"\n", 0, e.start) + 1,
            column=e.start - data.rfind(b"\n", 0, e.start),
            problem=f"not UTF-8 text (byte {e.start})",
            fix="save the file as UTF-8",
        ) from None
    return parse(text, source)
