"""The SSH endpoint's keys: which client key may do what (``ssh.authorized_keys``,
`parse_authorized_keys`), and the server's own key (`load_host_key`). The rules of both
are in `hostagent.surfaces.ssh`'s docstring."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from hostagent.host import journal, trusted

_VERB = re.compile(r"[a-z]+")
_VM = re.compile(r"[A-Za-z0-9_.-]+")
# OpenSSH's restrictions, all implied here: accepted so a line may carry them.
_IMPLIED = frozenset({"restrict", "no-pty", "no-port-forwarding", "no-agent-forwarding",
                      "no-x11-forwarding", "no-user-rc"})


class EndpointError(Exception):
    """The endpoint cannot start; the message names the file and the fix."""


class KeysError(EndpointError):
    """The authorized-keys file cannot be used."""


# --- authorized keys ---------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """One authorized key and what it may do. None: every verb, or every VM."""

    key: Any  # asyncssh.SSHKey (untyped)
    comment: str
    fingerprint: str
    verbs: frozenset[str] | None
    vms: frozenset[str] | None
    line: int

    def may(self, verb: str, vm: str | None) -> str | None:
        """None if allowed, else why not (for the client and the journal)."""
        if self.verbs is not None and verb not in self.verbs:
            return (f"this key ({self.comment}) may not use {verb!r}; it may use: "
                    f"{', '.join(sorted(self.verbs)) or 'nothing'}")
        if vm is not None and self.vms is not None and vm not in self.vms:
            return (f"this key ({self.comment}) may not touch {vm}; it may name: "
                    f"{', '.join(sorted(self.vms)) or 'no VM'}")
        return None


def _split_options(text: str, where: str) -> tuple[list[tuple[str, str | None]], str]:
    """OpenSSH's options field: comma-separated, values in double quotes; the rest."""
    options: list[tuple[str, str | None]] = []
    i, n = 0, len(text)
    while i < n:
        m = re.compile(r"[A-Za-z0-9-]+").match(text, i)
        if m is None:
            raise KeysError(f"{where}: an option name was expected at {text[i:i + 20]!r}")
        name, i = m.group(0), m.end()
        value: str | None = None
        if i < n and text[i] == "=":
            if i + 1 >= n or text[i + 1] != '"':
                raise KeysError(f'{where}: the value of {name} must be in double quotes')
            end = text.find('"', i + 2)
            if end < 0:
                raise KeysError(f"{where}: the value of {name} has no closing quote")
            value, i = text[i + 2:end], end + 1
        options.append((name, value))
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] in " \t":
            return options, text[i:].strip()
        raise KeysError(f"{where}: options end with a space before the key type")
    raise KeysError(f"{where}: options but no key")


def _names(value: str | None, option: str, where: str, pattern: re.Pattern[str]
           ) -> frozenset[str] | None:
    if value is None:
        raise KeysError(f'{where}: {option} needs a value, e.g. {option}="..."')
    if value == "*":
        return None
    names = [v.strip() for v in value.split(",")]
    for name in names:
        if not pattern.fullmatch(name):
            raise KeysError(f"{where}: {option}: {name!r} is not a name")
    return frozenset(names)


def parse_authorized_keys(text: str, source: str, *, verbs: frozenset[str]) -> list[Grant]:
    """Every key in an authorized-keys file, with its grant; KeysError names the line."""
    grants: list[Grant] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        options: list[tuple[str, str | None]] = []
        rest = line
        try:
            key = asyncssh.import_public_key(" ".join(line.split()[:2]))
        except (asyncssh.KeyImportError, ValueError):
            options, rest = _split_options(line, where)
            try:
                key = asyncssh.import_public_key(" ".join(rest.split()[:2]))
            except (asyncssh.KeyImportError, ValueError) as e:
                raise KeysError(f"{where}: not a public key ({e}); write "
                                '\'verbs="...",vms="..." ssh-ed25519 AAAA... comment\'') from e
        parts = rest.split(None, 2)
        comment = parts[2].strip() if len(parts) > 2 else ""
        granted_verbs: frozenset[str] | None = frozenset()
        granted_vms: frozenset[str] | None = frozenset()
        seen: set[str] = set()
        for name, value in options:
            lower = name.lower()
            if lower in seen:
                raise KeysError(f"{where}: {name} is given twice")
            seen.add(lower)
            if lower == "verbs":
                granted_verbs = _names(value, "verbs", where, _VERB)
                unknown = sorted((granted_verbs or frozenset()) - verbs)
                if unknown:
                    raise KeysError(f"{where}: verbs: unknown {', '.join(unknown)}; "
                                    f"known: {', '.join(sorted(verbs))}")
            elif lower == "vms":
                granted_vms = _names(value, "vms", where, _VM)
            elif lower in _IMPLIED and value is None:
                continue
            else:
                raise KeysError(f"{where}: hostagent does not support the option {name!r}: "
                                "a key says what it may do with verbs=\"...\" and vms=\"...\"")
        if "verbs" not in seen:
            raise KeysError(f'{where}: this key has no verbs="...": say what it may do, '
                            'e.g. verbs="play,release,status",vms="gaming1"')
        fingerprint = key.get_fingerprint("sha256")
        if any(g.fingerprint == fingerprint for g in grants):
            raise KeysError(f"{where}: this key is already listed; one line per key")
        grants.append(Grant(key=key, comment=comment or fingerprint, fingerprint=fingerprint,
                            verbs=granted_verbs, vms=granted_vms, line=number))
    return grants


class _KeyFile:
    """The authorized-keys file, read again when it changes; broken means nobody."""

    def __init__(self, path: Path, verbs: frozenset[str]) -> None:
        self.path = path
        self.verbs = verbs
        self.grants: list[Grant] = []
        self._seen: tuple[int, int, int, int] | None = None
        self.problem: str | None = None  # why every key is refused, while it lasts
        self.refresh()

    def _read(self) -> tuple[tuple[int, int, int, int], str]:
        try:
            st, data = trusted.read_trusted(self.path)
        except trusted.UnsafeFile as e:
            raise KeysError(f"{e}; until then nobody may use the SSH endpoint") from e
        except OSError as e:
            raise KeysError(f"{self.path}: cannot read the SSH authorized keys "
                            f"({e.strerror}); create it, or remove [ssh] from the "
                            "configuration") from e
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size), data.decode(errors="replace")

    def refresh(self) -> None:
        try:
            seen, text = self._read()
            if seen == self._seen:
                return
            self.grants = parse_authorized_keys(text, str(self.path), verbs=self.verbs)
            self._seen = seen
            if self.problem is not None:
                journal.record("ssh", f"authorized keys usable again: {len(self.grants)} "
                               f"key(s) in {self.path}", result="fixed")
            self.problem = None
        except KeysError as e:
            if self.problem != str(e):  # once per problem, not once per connection
                journal.record("ssh", f"authorized keys unusable, every key is refused "
                               f"until it is fixed: {e}", result="error",
                               priority=journal.Priority.ERR)
            self.grants, self._seen, self.problem = [], None, str(e)

    def find(self, key: Any) -> Grant | None:
        self.refresh()
        data = key.public_data  # the key itself, whatever its comment
        return next((g for g in self.grants if g.key.public_data == data), None)


# --- host key ----------------------------------------------------------------------------


def load_host_key(path: Path) -> Any:
    """The host key at `path`, created (ed25519, 0600, with a .pub) if missing or empty."""
    if not path.exists() or _empty(path):
        key = asyncssh.generate_private_key("ssh-ed25519", comment="hostagent")
        path.parent.mkdir(parents=True, exist_ok=True)
        public = path.with_name(path.name + ".pub")
        # The public half first: a crash between the two leaves no private key, so the
        # next start makes a fresh pair instead of serving one whose .pub is missing.
        _write_atomically(public, key.export_public_key(), 0o644)
        if _write_atomically(path, key.export_private_key(), 0o600, replace=_empty(path)):
            journal.record("ssh", f"created the SSH host key {path}: "
                           f"{key.get_fingerprint('sha256')}; clients pin "
                           f"{path}.pub in their known_hosts", result="created",
                           fingerprint=key.get_fingerprint("sha256"))
    try:
        return asyncssh.import_private_key(trusted.read_private(path))
    except trusted.UnsafeFile as e:
        raise EndpointError(f"the SSH host key: {e}") from e
    except (OSError, asyncssh.KeyImportError, ValueError) as e:
        raise EndpointError(
            f"{path}: cannot use it as the SSH host key ({e}); it may have been cut short "
            f"while it was written: fix it, or move it away (mv {path} {path}.broken) to "
            "have a new one created, then give clients its new .pub line") from e


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except FileNotFoundError:
        return False


def _write_atomically(path: Path, data: bytes, mode: int, *, replace: bool = True) -> bool:
    """Write `path` whole or not at all (temporary file, fsync, rename, fsync of the
    directory). With replace=False an existing file is kept: False, nothing written."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(temp, path)
        else:
            try:
                os.link(temp, path)  # fails if another agent made one meanwhile
            except FileExistsError:
                return False
            finally:
                os.unlink(temp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True
