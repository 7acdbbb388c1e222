"""The SSH endpoint's command line (`hostagent.surfaces.ssh`): checked word by word,
never given to a shell.

    status | play VM | release VM | reserve VM TIME | reserve VM cancel
    hold | resume | lend | reclaim [--lendee NAME]

At most `MAX_COMMAND` characters of printable ASCII, words separated by single spaces;
a VM or lendee name holds letters, digits, ``.``, ``_`` and ``-``. ``--lendee NAME``
names one lendee where several lend (``[lendees.NAME]``): without it, ``hold``,
``resume``, ``lend`` and ``reclaim`` act on every lendee. A name that is no lendee is
refused before anything happens, naming the lendees there are. A key's ``vms="..."``
does not limit the lendee it names: the verb alone without it reaches every lendee.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from hostagent.surfaces.ssh_keys import _VM

__all__ = ["LENDEE_VERBS", "MAX_COMMAND", "VM_VERBS", "BadCommand", "lendee_args",
           "parse_command", "reserve_args"]

MAX_COMMAND = 256
VM_VERBS = frozenset({"play", "release", "reserve"})  # the verbs that name a VM
LENDEE_VERBS = frozenset({"hold", "resume", "lend", "reclaim"})  # may name a lendee
# reserve's third word: its time (HH:MM or ISO 8601), or "cancel".
_WHEN = re.compile(r"cancel|[0-9][0-9T:+.Z-]{3,31}")
_LENDEE = "--lendee"


class BadCommand(Exception):
    """A command line refused before anything happened."""


def parse_command(line: str | None, verbs: frozenset[str],
                  lendees: Collection[str] = ()) -> tuple[str, str | None]:
    """(verb, VM or None) of an exec command line, or BadCommand. Never a shell.
    `lendees`: the names ``--lendee`` may give (empty: any well-formed name, which
    the verb checks)."""
    if line is None:
        raise BadCommand("hostagent runs no shell: give a command, e.g. `status`")
    if not line:
        raise BadCommand("the command is empty: give one, e.g. `status`")
    if len(line) > MAX_COMMAND:
        raise BadCommand(f"the command is longer than {MAX_COMMAND} characters")
    if not (line.isascii() and line.isprintable()):
        raise BadCommand("the command may only hold printable ASCII characters")
    words = line.split(" ")
    if "" in words:
        raise BadCommand("the words of a command are separated by exactly one space")
    verb = words[0]
    if verb not in verbs:
        raise BadCommand(f"unknown verb {verb[:32]!r}; known: {', '.join(sorted(verbs))}")
    if _LENDEE in words:
        _check_lendee(verb, words, lendees)
        return verb, None
    if verb == "reserve" and len(words) == 3 and _WHEN.fullmatch(words[2]):
        words = words[:2]  # its time, read by `reserve_args`
    elif verb == "reserve":
        raise BadCommand("reserve takes a VM and a time or cancel, e.g. `reserve gaming1 "
                         "20:00`, `reserve gaming1 2026-12-04T20:00`, `reserve gaming1 cancel`")
    if len(words) > 2:
        raise BadCommand("a command is a verb and at most one VM name, e.g. `play gaming1`")
    vm = words[1] if len(words) == 2 else None
    if vm is not None and not _VM.fullmatch(vm):
        raise BadCommand("a VM name holds only letters, digits, '.', '_' and '-'")
    if verb in VM_VERBS and vm is None:
        raise BadCommand(f"{verb} needs a VM name, e.g. `{verb} gaming1`")
    if verb not in VM_VERBS and vm is not None:
        raise BadCommand(f"{verb} takes no VM name" + (
            f" (`{verb} --lendee NAME` names one lendee)" if verb in LENDEE_VERBS else ""))
    return verb, vm


def _check_lendee(verb: str, words: list[str], lendees: Collection[str]) -> None:
    if verb not in LENDEE_VERBS:
        raise BadCommand(f"{verb} takes no --lendee: only "
                         f"{', '.join(sorted(LENDEE_VERBS))} name a lendee")
    if len(words) != 3 or words[1] != _LENDEE:
        raise BadCommand(f"--lendee takes one lendee name after the verb, e.g. "
                         f"`{verb} --lendee gpu-node-b`")
    name = words[2]
    if not _VM.fullmatch(name):
        raise BadCommand("a lendee name holds only letters, digits, '.', '_' and '-'")
    if lendees and name not in lendees:
        raise BadCommand(f"{name[:64]!r} is not a lendee: the lendees are "
                         f"{', '.join(lendees)}; name one, or leave --lendee out for every "
                         "lendee")


def reserve_args(line: str) -> dict[str, Any]:
    """The arguments of a `parse_command`-checked reserve line, for the verb."""
    when = line.split(" ")[2]
    return {"cancel": True} if when == "cancel" else {"at": when}


def lendee_args(line: str) -> dict[str, Any]:
    """{"lendee": NAME} of a `parse_command`-checked line with ``--lendee NAME``."""
    words = line.split(" ")
    return {"lendee": words[2]} if len(words) == 3 and words[1] == _LENDEE else {}
