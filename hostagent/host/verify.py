"""After a lend: does the driver inside the lendee see the GPUs it was given?

Ready is not enough (invariant 7). A card can be passed through and still be absent
inside the guest, silently: a driver branch that no longer supports it (Maxwell cards
are on NVIDIA's legacy 580 branch; the current branch finds no device and says
nothing), firmware that hung on an option ROM, a hostdev that was never attached. So
the agent runs ``nvidia-smi --query-gpu=uuid,pci.bus_id,name --format=csv,noheader``
in the guest and compares what it lists with what the lendee was lent: by UUID when
the configuration knows the UUIDs, by count otherwise.

Where nvidia-smi is: the guest agent runs a command without a login shell, so its
PATH is not the user's. NixOS keeps nvidia-smi in /run/current-system/sw/bin, the GPU
operator's driver container in /run/nvidia/driver/usr/bin, others in /usr/bin,
/usr/local/nvidia/bin or /opt/bin. `candidates` lists the configured command and then
those places; `query` tries them in order until one runs, and when none does, its
error names every place it looked.

What the guest says is the lendee's tenants' to write: names and errors are cleaned
and capped here, where they come in (`hostagent.core.text`).

Everything above `query` and `run_ssh` is pure: parsing and comparing, no side effects.
The guest is reached by the agent (through the guest agent, `Libvirt.guest_exec`) or by
`run_ssh`; `query` only calls the runner it is given.

This boot (invariant 14): the guest's ``/proc/sys/kernel/random/boot_id``, a UUID the
kernel makes afresh at each boot and the kubelet posts as its node's
``status.nodeInfo.bootID`` (Kubernetes v1.35.4 pkg/kubelet/nodestatus/setters.go
MachineInfo, from cadvisor's machine info), says whether the node's status is this
boot's kubelet's or still the previous boot's (`parse_boot_id`, `boot_id`).
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hostagent.host import trusted
from hostagent.core.text import clean

__all__ = [
    "CAUSES",
    "PLACES",
    "QUERY",
    "Expected",
    "Outcome",
    "SeenGpu",
    "BOOT_ID",
    "VerifyError",
    "boot_id",
    "candidates",
    "combine",
    "compare",
    "outcome_of_run",
    "parse_boot_id",
    "parse_query",
    "query",
    "run_ssh",
]

QUERY = ("--query-gpu=uuid,pci.bus_id,name", "--format=csv,noheader")

# Where nvidia-smi lives when the guest agent's PATH does not find it, in this order.
PLACES = (
    "/run/current-system/sw/bin/nvidia-smi",  # NixOS
    "/run/nvidia/driver/usr/bin/nvidia-smi",  # the GPU operator's driver container
    "/usr/bin/nvidia-smi",
    "/usr/local/nvidia/bin/nvidia-smi",  # the GPU operator's toolkit, older images
    "/opt/bin/nvidia-smi",  # Flatcar, Container-Optimized OS
)

CAUSES = (
    "usual causes: the guest's driver branch does not support the card (Maxwell GPUs "
    "such as the GTX 960 are on the legacy 580 branch; the current branch finds no "
    "device and says nothing); the firmware hung on the card's option ROM (several "
    "GPUs under OVMF need <rom bar='off'/> on each function); the card was not passed "
    "through (see `hostagent lint`); or the driver had not loaded yet (raise "
    "verify.timeout)"
)


class VerifyError(Exception):
    """The guest could not be asked (no connection, command not runnable, timeout)."""


@dataclass(frozen=True, kw_only=True)
class SeenGpu:
    """One line of nvidia-smi's answer. `pci` is the guest's address, not the host's."""

    uuid: str
    pci: str
    name: str


@dataclass(frozen=True, kw_only=True)
class Expected:
    """A GPU lent to the guest; without a UUID it can only be counted."""

    label: str
    uuid: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        what = ", ".join(x for x in (self.name, self.uuid) if x)
        return f"{self.label} ({what})" if what else self.label


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """The verdict. `problem`: why nvidia-smi gave no list (then nothing was seen)."""

    seen: tuple[SeenGpu, ...]
    missing: tuple[Expected, ...]
    extra: tuple[SeenGpu, ...] = ()
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return not self.missing and self.problem is None

    def summary(self, vm: str) -> str:
        """One sentence for the journal and for the node's FAILED reason."""
        if self.ok:
            listed = ", ".join(f"{g.name} ({g.uuid})" for g in self.seen)
            return f"the driver in {vm} sees {listed}"
        missing = ", ".join(str(g) for g in self.missing)
        if self.problem is not None:
            return f"the driver in {vm} sees no GPU ({self.problem}); missing: {missing}"
        seen = ", ".join(g.uuid for g in self.seen) or "none"
        return f"the driver in {vm} does not see {missing} (it sees: {seen})"


def parse_query(text: str) -> list[SeenGpu]:
    """The GPUs in nvidia-smi's ``--query-gpu=uuid,pci.bus_id,name`` CSV, in order.

    Raises ValueError on a line that is not three fields (an error message, say).
    """
    found = []
    # Lines end at "\n" alone: a carriage return or a separator inside a name is the
    # name's (cleaned below), not an end of line that would split it.
    for line in text.split("\n"):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",", 2)]
        if len(fields) != 3 or not fields[0]:
            raise ValueError(f"not a uuid, pci.bus_id, name line: {clean(line.strip(), 200)}")
        found.append(SeenGpu(uuid=clean(fields[0], 100), pci=clean(fields[1], 100),
                             name=clean(fields[2], 200)))
    return found


def compare(expected: Sequence[Expected], seen: Iterable[SeenGpu]) -> Outcome:
    """Which lent GPUs the guest does not see.

    A GPU with a UUID must be seen by that UUID. GPUs without one are counted against
    what is seen beyond the known UUIDs. GPUs seen but not lent (`extra`) are not an
    error: the guest may have a card of its own.
    """
    seen = tuple(seen)
    uuids = {g.uuid for g in seen}
    known = {e.uuid for e in expected if e.uuid}
    missing = [e for e in expected if e.uuid and e.uuid not in uuids]
    unnamed = [e for e in expected if not e.uuid]
    others = [g for g in seen if g.uuid not in known]
    missing += unnamed[len(others):]
    extra = tuple(others[len(unnamed):])
    return Outcome(seen=seen, missing=tuple(missing), extra=extra)


def outcome_of_run(expected: Sequence[Expected], exitcode: int, stdout: str,
                   stderr: str) -> Outcome:
    """The verdict from one run of the query command in the guest."""
    if exitcode != 0:
        said = clean((stdout.strip() or stderr.strip() or "no output").splitlines()[0], 200)
        return Outcome(seen=(), missing=tuple(expected),
                       problem=f"nvidia-smi exited with status {exitcode}: {said}")
    try:
        seen = parse_query(stdout)
    except ValueError as e:
        return Outcome(seen=(), missing=tuple(expected), problem=f"unexpected output: {e}")
    return compare(expected, seen)


# --- finding nvidia-smi ---------------------------------------------------------------------


def candidates(configured: str) -> list[str]:
    """The commands to try, in order: the configured one, then `PLACES`, each once."""
    return list(dict.fromkeys([configured, *PLACES]))


_MISSING = ("no such file", "not found", "failed to execute child process",
            "cannot execute", "permission denied")


def _missing(text: str) -> bool:
    lowered = text.lower()
    return any(word in lowered for word in _MISSING)


Run = tuple[int, str, str]


def not_there(result: Run | Exception) -> bool:
    """Whether a try of a command in the guest found no such command there (try the
    next place), rather than one that ran, or failed for another reason."""
    if isinstance(result, Exception):
        return _missing(str(result))
    code, out, err = result
    return code in (126, 127) or (code != 0 and not out.strip() and _missing(err))


def combine(expected: Sequence[Expected], attempts: Sequence[tuple[str, Run | Exception]]
            ) -> Outcome | None:
    """The verdict from the tries so far, in order: (command, its run or the error that
    kept it from running). The first command that ran decides; None while every one so
    far was missing (try the next); when the last one was missing too, call
    `none_found`. No side effects."""
    for _command, result in attempts:
        if not_there(result):
            continue
        if isinstance(result, Exception):
            return Outcome(seen=(), missing=tuple(expected), problem=clean(result))
        return outcome_of_run(expected, *result)
    return None


def none_found(expected: Sequence[Expected], attempts: Sequence[tuple[str, Run | Exception]]
               ) -> Outcome:
    """No command ran: the problem names every place looked."""
    looked = ", ".join(command for command, _ in attempts)
    return Outcome(seen=(), missing=tuple(expected),
                   problem=f"nvidia-smi not found in the guest; looked for {looked} (is the "
                   "NVIDIA driver installed? set verify.command to where it is)")


async def query(expected: Sequence[Expected], run: Callable[[str], Awaitable[Run]],
                configured: str = "nvidia-smi") -> Outcome:
    """Run the GPU query with each of `candidates(configured)` until one runs.

    `run(command)` runs ``command *QUERY`` in the guest and returns (exit status,
    stdout, stderr), or raises when it could not (e.g. guest-exec's "Failed to execute
    child process" for a missing file, which means: try the next place)."""
    attempts: list[tuple[str, Run | Exception]] = []
    for command in candidates(configured):
        try:
            attempts.append((command, await run(command)))
        except Exception as e:  # whatever the runner raises: combine() tells missing from broken
            attempts.append((command, e))
        outcome = combine(expected, attempts)
        if outcome is not None:
            return outcome
    return none_found(expected, attempts)


# --- this boot --------------------------------------------------------------------------

BOOT_ID = "/proc/sys/kernel/random/boot_id"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def parse_boot_id(text: str) -> str:
    """The boot id in what ``cat BOOT_ID`` printed (one UUID, lower case, as the
    kernel writes it); VerifyError, with what came instead cleaned and capped, when
    it is not one. No side effects."""
    found = text.strip().lower()
    if not _UUID.fullmatch(found):
        raise VerifyError(f"{BOOT_ID} in the guest is not a boot id: {clean(text, 80)!r}")
    return found


async def boot_id(run: Callable[[str, list[str]], Awaitable[Run]]) -> str:
    """The guest's boot id, read with `run(path, args)` (the guest agent's exec);
    VerifyError when it could not be read or is not one."""
    try:
        code, out, err = await run("cat", [BOOT_ID])
    except Exception as e:  # whatever the runner raises, said as this read's failure
        raise VerifyError(f"could not read {BOOT_ID} in the guest: {clean(e, 300)}") from e
    if code != 0:
        raise VerifyError(f"cat {BOOT_ID} in the guest exited {code}: {clean(err, 300)}")
    return parse_boot_id(out[:200])


# --- the one I/O function: asking over SSH ----------------------------------------------


async def run_ssh(*, host: str, port: int, user: str, key: str, known_hosts: str,
                  argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """Run `argv` on `host` over SSH: (exit status, stdout, stderr).

    The host key must be in `known_hosts`: a check against an unknown host proves
    nothing. The user's ~/.ssh/config and SSH agent are ignored: the configuration is
    the whole truth. Raises VerifyError.
    """
    import asyncssh  # only where SSH is chosen

    try:
        # Read as OpenSSH would use it: a key others may read is refused, with the fix.
        client_key = asyncssh.import_private_key(
            await asyncio.to_thread(trusted.read_private, Path(key)))
    except trusted.UnsafeFile as e:
        raise VerifyError(f"verify.ssh.key: {e}") from e
    except (OSError, ValueError, asyncssh.Error) as e:  # ValueError: not a key
        raise VerifyError(f"SSH to {user}@{host}:{port}: the key {key}: {e}") from e
    try:
        async with asyncio.timeout(timeout):
            async with asyncssh.connect(host, port=port, username=user,
                                        client_keys=[client_key],
                                        known_hosts=known_hosts, config=None,
                                        agent_path=None) as conn:
                result = await conn.run(shlex.join(argv), check=False)
    except TimeoutError as e:
        raise VerifyError(f"no answer over SSH from {user}@{host} within {timeout:g}s") from e
    except (OSError, ValueError, asyncssh.Error) as e:  # ValueError: an unreadable key
        raise VerifyError(f"SSH to {user}@{host}:{port}: {e}") from e
    status = result.exit_status if result.exit_status is not None else -1
    return int(status), _as_text(result.stdout), _as_text(result.stderr)


def _as_text(data: object) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return "" if data is None else str(data)
