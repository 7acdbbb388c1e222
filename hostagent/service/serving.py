"""The endpoints the agent serves beside its sockets: Prometheus' /metrics and /healthz,
the SSH endpoint for home automation, and the control socket's access. Each is bound at
start; one that cannot be bound yet (a port in use, an address not up at boot, a group
not made yet) is retried in the background, said once, never a reason to exit
(DESIGN.md invariant 13): only a mistake a person must fix ends the start
(`StartupError`). And what the host says at the agent's start and stop: its boot id, and
whether it is shutting down."""

from __future__ import annotations

import asyncio
import grp
import logging
import subprocess
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from hostagent.core import health
from hostagent.core.backoff import keep_trying
from hostagent.core.config import Config
from hostagent.host import journal
from hostagent.surfaces import metrics
from hostagent.surfaces.control import GroupAccess

log = logging.getLogger("hostagent")

_Spawn = Callable[[Coroutine[Any, Any, None]], None]


class StartupError(Exception):
    """The agent cannot start; the message says what is wrong and how to fix it."""


class Endpoints:
    """The metrics and SSH endpoints and the control socket's access, for `cfg`; what
    retries runs through `spawn` (a task the agent keeps and cancels when it stops)."""

    def __init__(self, cfg: Config, *, health: health.Health, metrics: metrics.Metrics,
                 handlers: Callable[[], Mapping[str, Any]], spawn: _Spawn,
                 lendees: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.lendees = lendees  # every lendee's name, which SSH's --lendee may give
        self.health = health
        self.metrics = metrics
        self.handlers = handlers
        self.spawn = spawn
        self.exporter: asyncio.Server | None = None
        self.endpoint: Any = None  # the SSH endpoint's server, once bound

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def control_access(self) -> dict[str, Any]:
        """control.sock's mode, group and what the group may do: 0660 for control_group,
        else root's alone."""
        name = self.cfg.control_group
        if name is None:
            return {"mode": 0o600}
        try:
            return {"mode": 0o660, "group": grp.getgrnam(name).gr_gid, "group_name": name,
                    "group_verbs": self.cfg.control_verbs}
        except KeyError:  # not fatal: taken up once it exists (DESIGN.md invariant 13)
            waiting = GroupAccess(self.cfg.control_socket, name, self.cfg.control_verbs,
                                  self.cfg.source)
            self.health.add("control group", waiting.take_up)
            self.spawn(waiting.run())
            journal.record("control", f"{self.cfg.source}: control_group: there is no group "
                           f"{name!r} yet (groupadd {name}): the control socket is root's alone "
                           "until it exists", result="waiting", priority=journal.Priority.WARNING)
            return {"mode": 0o600, "access": waiting.rights}

    async def serve_metrics(self) -> None:
        """/metrics and /healthz, when [metrics] listen is set."""
        address = self.cfg.metrics.address
        if address is None:
            return

        async def bind() -> None:
            self.exporter = await keep_trying(
                lambda: metrics.serve(address, self.metrics, self.health, log=log),
                what=f"the metrics endpoint on {self.cfg.metrics.listen}",
                transient=(OSError,), record=journal.retry)

        await self._bind_soon(bind)

    async def serve_ssh(self) -> None:
        """The SSH endpoint when [ssh] is configured (see hostagent.surfaces.ssh)."""
        if self.cfg.ssh is None or self.cfg.ssh_host_key is None:
            return None
        from hostagent.surfaces import ssh  # asyncssh only where it is used
        endpoint, key = self.cfg.ssh, self.cfg.ssh_host_key

        async def bind() -> None:
            try:
                self.endpoint = await keep_trying(
                    lambda: ssh.serve(endpoint.address, key, endpoint.authorized_keys,
                                      dict(self.handlers()), lendees=self.lendees),
                    what=f"the SSH endpoint on {endpoint.listen}", transient=(ssh.Transient,),
                    record=journal.retry)
            except ssh.EndpointError as e:
                raise StartupError(f"{self.cfg.source}: [ssh]: {e}") from e

        await self._bind_soon(bind)

    async def _bind_soon(self, bind: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `bind` now; if its first attempt does not succeed at once, leave it
        retrying in the background (its own record says so) and go on."""
        task = asyncio.get_running_loop().create_task(bind())
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if task in done:
            task.result()  # a StartupError: a person must fix the configuration
            return
        self.spawn(asyncio.wait_for(task, None))


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def host_stopping() -> bool:
    """Whether the host is shutting down (systemd says "stopping"), as opposed to only
    hostagent being stopped or restarted."""
    try:
        out = subprocess.run(["systemctl", "is-system-running"], capture_output=True,
                             text=True, timeout=2, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "stopping"
