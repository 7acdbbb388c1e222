"""The agent's Kubernetes part: connected at start, or waited for when its kubeconfig
cannot be used yet, so that a stale kubeconfig never stops the agent for good (DESIGN.md
invariant 13): k3s writes it once its server runs, an administrator fixes a path.

Until it can be used, `WaitingCluster` stands in: each Kubernetes step waits for it
(nothing is drained, returned or uncordoned without the cluster's word), the
"kubernetes" health check fails saying why, and the file is tried again every
`RETRY` seconds. A cordon asked meanwhile (the lendee went down) is done first once it
comes; then the waiting steps go on with the real adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from hostagent.cluster.kube import Kube, KubeAuthError, KubeConfigError, KubeUnavailable, Timing
from hostagent.core.config import Config
from hostagent.core.health import CheckFailed
from hostagent.host import journal
from hostagent.service.parts import Cluster

__all__ = ["RETRY", "KubeConfigError", "WaitingCluster", "connect"]

log = logging.getLogger("hostagent")
RETRY = 10.0  # seconds between reads of a kubeconfig that could not be used


async def connect(cfg: Config, make: Callable[[Kube], Cluster]) -> tuple[Kube, Cluster]:
    """The client and `make(client)`. A missing Node, an API server that is down or
    refuses the credentials are said and only delay steps. Raises KubeConfigError."""
    assert cfg.kubernetes is not None
    kube = await Kube.from_config(cfg.kubernetes,
                                  timing=Timing(evict_retry=cfg.kubernetes.evict_retry))
    try:
        check = await kube.check_node(cfg.lendee.node, timeout=10)
        if not check.exists:
            # Not fatal: a node deleted while its VM was off registers again when the
            # lendee starts, and only a lend starts it.
            log.warning("%s; it registers again when %s starts", check, cfg.lendee.domain)
    except KubeUnavailable as e:
        log.warning("the Kubernetes API is not reachable yet (%s); steps will retry", e)
    except KubeAuthError as e:
        journal.record("kubernetes", f"the API server refuses hostagent's credentials: {e}; "
                       "every Kubernetes step fails until they are fixed",
                       result="unauthorized", priority=journal.Priority.ERR)
    return kube, make(kube)


class WaitingCluster:
    """The Cluster until its kubeconfig can be used; then a pass-through to the real one."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.real: Cluster | None = None
        self._ready = asyncio.Event()
        self._down: str | None = None  # a cordon asked for while waiting: why

    async def run(self, cfg: Config, make: Callable[[Kube], Cluster]) -> None:
        """Read the kubeconfig every `RETRY` s until it works; until cancelled (the
        client is closed then)."""
        retry = RETRY
        journal.record("kubernetes", f"{self.why}; Kubernetes steps wait for it (tried again "
                       f"every {retry:g}s) and health fails meanwhile", result="waiting",
                       priority=journal.Priority.ERR)
        kube: Kube | None = None
        real: Cluster | None = None
        try:
            while real is None:
                await asyncio.sleep(retry)
                try:
                    kube, real = await connect(cfg, make)
                except KubeConfigError as e:
                    self.why = f"{cfg.source}: kubernetes.kubeconfig: {e}"
            if self._down is not None:
                await real.lendee_down(why=self._down)
            self.real = real
            self._ready.set()
            journal.record("kubernetes", "the kubeconfig is read: the Kubernetes steps that "
                           "waited go on", result="ready")
            await asyncio.Event().wait()
        finally:
            if kube is not None:
                await kube.close()

    async def _cluster(self) -> Cluster:
        await self._ready.wait()
        assert self.real is not None
        return self.real

    async def health(self) -> str:
        if self.real is None:
            raise CheckFailed(f"kubernetes: {self.why}")
        return await self.real.health()  # type: ignore[attr-defined, no-any-return]

    def status(self) -> dict[str, object] | None:
        return {"waiting": self.why} if self.real is None else self.real.status()

    async def adopt(self, lent: Collection[str]) -> str | None:
        # Never waited for: the agent's start must not hang on it.
        return self.why if self.real is None else await self.real.adopt(lent)

    async def lendee_down(self, *, why: str) -> None:
        if self.real is None:
            self._down = why  # done first once the cluster comes
            return
        await self.real.lendee_down(why=why)

    async def flush_events(self) -> None:
        if self.real is not None:
            await self.real.flush_events()

    async def reclaim(self, owners: list[str], **kw: Any) -> str | None:
        return await (await self._cluster()).reclaim(owners, **kw)

    async def cordon_ahead(self, why: str) -> bool:
        return await (await self._cluster()).cordon_ahead(why)

    async def uncordon_ahead(self, why: str) -> None:
        await (await self._cluster()).uncordon_ahead(why)

    async def give_back(self, lent: Collection[str], **kw: Any) -> str | None:
        return await (await self._cluster()).give_back(lent, **kw)

    async def vacate(self, owners: list[str], gpus: Collection[str], pods: Any,
                     **kw: Any) -> str | None:
        return await (await self._cluster()).vacate(owners, gpus, pods, **kw)

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        return await (await self._cluster()).withdraw(gpus)

    async def grow(self, lent: Collection[str]) -> str | None:
        return await (await self._cluster()).grow(lent)

    async def plugins_pausable(self, *, timeout: float = 10) -> tuple[bool, str]:
        return await (await self._cluster()).plugins_pausable(timeout=timeout)

    async def watch_lent(self, on_view: Callable[[Any], None] | None = None) -> None:
        await (await self._cluster()).watch_lent(on_view)

    async def watch_cordon(self) -> None:
        await (await self._cluster()).watch_cordon()

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        return await (await self._cluster()).notice(when, message)
