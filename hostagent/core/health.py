"""Health that means something: checks of the real things the agent depends on.

"The process runs" says little: the seeds tell of a health check that said OK while the
service behind it was broken. Each check here exercises one dependency the way the
agent uses it (a libvirt call, a connection to the hook socket, a Kubernetes request,
the outcome of the last lend) and says, in one sentence, what it found.

A check is a *probe*: an async callable that returns a short description when all is
well and raises (preferably `CheckFailed`, with a sentence) when not. `Health.check` runs
every probe concurrently, each within a time budget, so one hung dependency cannot hang
the answer. `hostagent status`, ``/healthz`` and the ``hostagent_health_check_success``
metric all show the same results.

Anyone who may ask for the status (a key allowed `status` over SSH, anyone who reaches
``/healthz``) can ask thousands of times a second, and each run opens a connection to
the hook socket, makes a libvirt call and a Kubernetes request. So a run is shared: a
caller joins the run in flight rather than starting another, and takes the last
results while they are younger than `Health.max_age`. When the agent itself changes what
a check reads (the state file saved again), it says so (`Health.forget`): no caller is
then given a run that began before.

Who adds which check: the agent adds "libvirt", "hook socket" and "last lend verified";
the Kubernetes wiring adds "kubernetes" with
``agent.health.add("kubernetes", health.kubernetes(cluster))``: a real request to the
API server (401/403 and an unreachable server fail it), and what the watch of the lent
node found (a GPU lost, the node NotReady while lent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["CheckFailed", "CheckResult", "Health", "Probe", "kubernetes", "libvirt_alive",
           "of_lendee", "socket_answers"]

Probe = Callable[[], Awaitable[str | None]]
MAX_AGE = 1.0  # seconds a run's results are shared with later callers


class CheckFailed(Exception):
    """A probe's sentence saying what is wrong."""


@dataclass(frozen=True)
class CheckResult:
    check: str
    ok: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "detail": self.detail}


class Health:
    """The named checks, in the order they were added."""

    def __init__(self, *, timeout: float = 3.0, max_age: float = MAX_AGE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.max_age = max_age
        self._clock = clock
        self._probes: dict[str, Probe] = {}
        self.last: list[CheckResult] = []  # the results of the latest run
        self._taken: float | None = None  # when the latest run began
        self._running: asyncio.Task[list[CheckResult]] | None = None
        self._changes = 0  # counts `forget` calls; a run is current if none came after it began
        self._run_of = 0  # the count when the run in flight (or the latest) began

    def add(self, name: str, probe: Probe) -> None:
        """Add (or replace) the check called `name`."""
        self._probes[name] = probe

    def remove(self, name: str) -> None:
        self._probes.pop(name, None)

    def forget(self) -> None:
        """What a check reads has changed: the results so far, and the run in flight,
        are not given to any later caller."""
        self._changes += 1
        self._taken = None

    @property
    def names(self) -> list[str]:
        return list(self._probes)

    async def check(self, *, max_age: float | None = None) -> list[CheckResult]:
        """The results of every check, begun at most `max_age` seconds ago (default
        `self.max_age`; 0: a run begun now, or the one in flight). A caller that stops
        waiting (a client hung up) leaves the run to the others."""
        age = self.max_age if max_age is None else max_age
        if (self._running is None and self._taken is not None
                and self._clock() - self._taken < age):
            return self.last
        while True:
            if self._running is None:
                self._run_of = self._changes
                self._running = asyncio.get_running_loop().create_task(self._run_all())
            run, began = self._running, self._run_of
            results = await asyncio.shield(run)
            if began == self._changes:
                return results

    async def _run_all(self) -> list[CheckResult]:
        """Every check, concurrently; each gets `timeout` seconds."""
        began = self._clock()
        try:
            self.last = list(await asyncio.gather(
                *(self._run(name, probe) for name, probe in self._probes.items())))
            if self._run_of == self._changes:
                self._taken = began
            return self.last
        finally:
            self._running = None

    async def _run(self, name: str, probe: Probe) -> CheckResult:
        try:
            detail = await asyncio.wait_for(probe(), self.timeout)
        except CheckFailed as e:
            return CheckResult(name, False, str(e))
        except TimeoutError:
            return CheckResult(name, False, f"no answer within {self.timeout:g}s")
        except Exception as e:  # whatever a dependency raises, the check failed: say how
            return CheckResult(name, False, str(e) or type(e).__name__)
        return CheckResult(name, True, detail or "ok")


class _Libvirt(Protocol):
    uri: str

    @property
    def connected(self) -> bool: ...

    async def running_domains(self) -> set[str]: ...


def libvirt_alive(libvirt: _Libvirt) -> Probe:
    """The connection is open and libvirtd answers a call through it."""

    async def probe() -> str:
        if not libvirt.connected:
            raise CheckFailed(f"libvirt: not connected to {libvirt.uri} (reconnecting)")
        try:
            running = await libvirt.running_domains()
        except Exception as e:
            raise CheckFailed(f"libvirt: {e}") from e
        return f"connected to {libvirt.uri}; {len(running)} domain(s) running"

    return probe


def socket_answers(path: Path, what: str = "socket") -> Probe:
    """Something accepts connections on the Unix socket `path` (a connection that sends
    nothing and closes is ignored by the hook inbox)."""

    async def probe() -> str:
        try:
            _, writer = await asyncio.open_unix_connection(str(path))
        except OSError as e:
            raise CheckFailed(f"{what} {path}: {e.strerror or e}") from e
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return f"{path} accepts connections"

    return probe


class _Domains(Protocol):
    uri: str

    async def defined_domains(self) -> set[str]: ...


def domains_defined(libvirt: _Domains, wanted: dict[str, str], source: str) -> Probe:
    """Every domain the configuration names (key -> domain) is defined in libvirt. One
    that is not (someone ran `virsh undefine` on an old VM) stops only what needs it:
    that owner's start, or lending; the agent goes on (DESIGN.md invariant 13)."""

    async def probe() -> str:
        try:
            defined = await libvirt.defined_domains()
        except Exception as e:
            raise CheckFailed(f"domains: {e}") from e
        missing = [f"{key} ({dom!r})" for key, dom in wanted.items() if dom not in defined]
        if missing:
            raise CheckFailed(
                f"{source}: libvirt at {libvirt.uri} has no domain for {', '.join(missing)} "
                f"(it has: {', '.join(sorted(defined)) or 'none'}): fix the name, define "
                "the VM (virsh define), or remove the entry")
        return f"the {len(wanted)} configured domain(s) are defined"

    return probe


class _Cluster(Protocol):
    async def health(self) -> str: ...


def kubernetes(cluster: _Cluster) -> Probe:
    """The "kubernetes" check: `cluster.health()` (hostagent.cluster.cycle.KubeCluster) asks
    the API server for the node and raises CheckFailed with what is wrong."""

    async def probe() -> str:
        return await cluster.health()

    return probe


def of_lendee(checks: Health, *, shared: tuple[str, ...] = ("libvirt", "hook socket")) -> Probe:
    """Another lendee's checks as one probe of the agent's (`hostagent.service.fleet`):
    passes when all of them do but those it `shared` with the agent, else says each that
    failed. Its checks run on their own schedule and cache (`Health.check`)."""
    async def probe() -> str:
        results = [r for r in await checks.check() if r.check not in shared]
        failed = [f"{r.check}: {r.detail}" for r in results if not r.ok]
        if failed:
            raise CheckFailed("; ".join(failed))
        return ", ".join(r.check for r in results) + " pass"
    return probe
