"""The lendee's node while lent, and what the cycle tells the cluster: `Lent`, a part of
`hostagent.cluster.cycle.KubeCluster` (split from it by concern).

`watch_lent` follows the node until cancelled (Ready, allocatable, pods that use GPUs);
a GPU lost or a node NotReady while lent is a journal error and a failing "kubernetes"
health check, and the GPU pods count feeds ``hostagent_node_gpu_pods``. Events on the
Node are posted in the background: they never delay a step, and none is lost: one
that cannot be posted (the API server down past its 10 s, or `EVENTS_PENDING` already
waiting) is written to the journal instead, with its message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from hostagent.host import journal
from hostagent.cluster.kube import ExpectedGpus, Kube, KubeAuthError, KubeError, NodeView

if TYPE_CHECKING:
    from hostagent.core.config import Kubernetes

log = logging.getLogger(__name__)
# Events being posted at once, at most: beyond, an Event goes to the journal instead.
EVENTS_PENDING = 16


class Metrics(Protocol):
    """What the cluster reports to `hostagent.surfaces.metrics.Metrics`."""

    def node_gpu_pods(self, count: int | None) -> None: ...

    def gpu_lost(self) -> None: ...

    def lent_gpu_pods(self, holders: dict[str, str] | None) -> None: ...


class Lent:
    """What `KubeCluster` sets up for these (see its constructor)."""

    kube: Kube
    node: str
    settings: Kubernetes
    prefix: str
    metrics: Metrics | None
    expected: ExpectedGpus | None
    view: NodeView | None
    dra: dict[str, str | None] | None
    holders: dict[str, str]
    trouble: str | None
    auth_retry: float
    _events: set[asyncio.Task[None]]

    def _holders(self, view: NodeView) -> dict[str, str]:
        """Lent GPU label -> the pods holding it, from the claims the watch saw."""
        assert self.dra is not None
        return {label: view.holders[uuid] for label, uuid in sorted(self.dra.items())
                if uuid and uuid in view.holders}

    # --- while lent -----------------------------------------------------------------------

    async def watch_lent(self, on_view: Callable[[NodeView], None] | None = None) -> None:
        """Follow the lent node until cancelled (cancel it when the reclaim starts);
        never raises (credentials refused: health red, tried again every `auth_retry` s).

        Sets ``hostagent_node_gpu_pods``; a node that loses expected GPUs or stops being
        Ready is a journal error, an Event, the GPU-lost failure metric and a failing
        "kubernetes" health check until it is whole again. `on_view` gets every change
        (e.g. the agent deciding when a regrow is safe from `view.gpu_pods`)."""
        expected = self.expected
        resources = list(expected.resources) if expected is not None \
            else [self.settings.gpu_resource]
        lent_dra = self.dra
        driver = self.settings.dra_driver if lent_dra is not None else None
        was: list[NodeView] = []

        def seen(view: NodeView) -> None:
            before = was[0] if was else None
            was[:] = [view]
            self.view = view
            if self.metrics is not None:
                self.metrics.node_gpu_pods(view.gpu_pods)
            self._judge(view, before, expected)
            if lent_dra is not None and (before is None or before.holders != view.holders):
                self._show_holders(view)
            if on_view is not None:
                on_view(view)

        try:
            while True:
                try:
                    await self.kube.watch_node(self.node, resources=resources, on_change=seen,
                                               dra_driver=driver)
                except KubeAuthError as e:
                    # Health stays red until the credentials are fixed; tried again
                    # meanwhile, so that fixing them is enough.
                    trouble = f"kubernetes: cannot watch node {self.node}: {e}"
                    if trouble != self.trouble:
                        journal.record("watch", trouble, vm=self.node, result="unauthorized",
                                       priority=journal.Priority.ERR)
                    self.trouble = trouble
                    was.clear()
                    await asyncio.sleep(self.auth_retry)
        finally:
            self.view = None
            if self.metrics is not None:
                self.metrics.node_gpu_pods(None)
                if lent_dra is not None:
                    self.metrics.lent_gpu_pods(None)

    def _show_holders(self, view: NodeView) -> None:
        """Who holds which lent GPU: the metric, and the node's annotation (in the
        background, like an Event: it never delays a step)."""
        holders = self.holders = self._holders(view)
        if self.metrics is not None:
            self.metrics.lent_gpu_pods(holders)
        text = ",".join(f"{gpu}={pods.replace(',', '+')}" for gpu, pods in holders.items())

        async def annotate() -> None:
            try:
                await self.kube.annotate(self.node, {f"{self.prefix}gpu-holders": text or None},
                                         timeout=10)
            except KubeError as e:
                log.warning("could not annotate node %s with its GPUs' holders: %s",
                            self.node, e)
        task = asyncio.get_running_loop().create_task(annotate())
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    def _judge(self, view: NodeView, before: NodeView | None,
               expected: ExpectedGpus | None) -> None:
        """What a change of the lent node means: trouble starts, or ends."""
        problems = []
        if not view.exists:
            problems.append(f"node {self.node} was deleted while lent")
        elif not view.ready:
            problems.append(f"node {self.node} is not Ready while lent ({view.ready_detail})")
        gone = self._gone(view)
        lost = expected is not None and view.exists and (bool(gone) or any(
            view.allocatable.get(r, 0) < n for r, n in expected.resources.items()))
        if gone:
            problems.append(f"node {self.node} lost GPUs while lent: {', '.join(gone)} left "
                            f"its {self.settings.dra_driver} ResourceSlices (a GPU off the "
                            "bus, a driver crash, the DRA driver's plugin restarting?)")
        elif lost and expected is not None:
            problems.append(f"node {self.node} lost GPUs while lent: it "
                            f"{expected.shortfall(view.allocatable)} (a GPU off the bus, a "
                            "driver crash, the device plugin restarting?)")
        trouble = "; ".join(problems) or None
        if trouble == self.trouble:
            return
        had_lost = before is not None and expected is not None and before.exists and (
            bool(self._gone(before)) or any(
                before.allocatable.get(r, 0) < n for r, n in expected.resources.items()))
        self.trouble = trouble
        if trouble is None:
            journal.record("watch", f"node {self.node} is whole again: Ready, {expected}",
                           vm=self.node, result="ok")
            return
        journal.record("watch", trouble, vm=self.node,
                       result="gpu-lost" if lost else "not-ready",
                       priority=journal.Priority.ERR)
        if lost and not had_lost:
            if self.metrics is not None:
                self.metrics.gpu_lost()
            self._event("GPULost", trouble, warning=True)

    def _gone(self, view: NodeView) -> list[str]:
        """DRA: the lent GPUs ("label (UUID)") the node's slices no longer list."""
        if self.dra is None or view.devices is None or not view.exists:
            return []
        return [f"{label} ({uuid})" for label, uuid in sorted(self.dra.items())
                if uuid and uuid not in view.devices]

    async def watch_cordon(self) -> None:
        """While the lendee is off or stuck (its node cordoned by us, for hours during a
        game), follow the node until cancelled: a cordon of ours that someone lifts
        (``kubectl uncordon``) loses our marker the moment it is seen, so that a cordon
        they set later is never lifted by us (invariant 6). Never raises."""
        while True:
            try:
                await self.kube.watch_cordon(self.node, marker_prefix=self.prefix)
                return
            except KubeAuthError as e:
                log.warning("cannot watch node %s for a cordon lifted by hand: %s", self.node, e)
                await asyncio.sleep(self.auth_retry)

    def watch_gpu_pods(self) -> AsyncIterator[int]:
        """The count of pods on the node that request a GPU: the current count, then each
        change, while iterated. For deciding when restarting the lendee (a regrow) is safe:
        ``async for n in cluster.watch_gpu_pods(): if n == 0: break``."""
        resources = list(self.expected.resources) if self.expected is not None \
            else [self.settings.gpu_resource]
        return self.kube.watch_gpu_pods(
            self.node, resources=resources,
            dra_driver=self.settings.dra_driver if self.dra is not None else None)

    # --- telling the cluster --------------------------------------------------------------

    def _event(self, reason: str, message: str, *, warning: bool = False) -> None:
        """Post an Event on the Node in the background (it never delays a step); one
        that cannot be posted is journaled instead (`_unposted`)."""
        if len(self._events) >= EVENTS_PENDING:
            self._unposted(reason, message, f"{EVENTS_PENDING} Events already wait for the "
                           "API server", warning)
            return
        task = asyncio.get_running_loop().create_task(
            self._post(reason, message, warning))
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def _post(self, reason: str, message: str, warning: bool) -> None:
        try:
            why = await self.kube.post_event(self.node, reason=reason, message=message,
                                             warning=warning, timeout=10)
        except KubeError as e:
            why = str(e)
        if why is not None:
            self._unposted(reason, message, why, warning)

    def _unposted(self, reason: str, message: str, why: str, warning: bool) -> None:
        journal.record("event", f"could not post the {reason} event on node {self.node} "
                       f"({why}); it says: {message}", vm=self.node, result="not-posted",
                       reason=reason, priority=journal.Priority.WARNING if warning
                       else journal.Priority.NOTICE)

    async def flush_events(self) -> None:
        """Wait for the Events being posted (tests, and before closing the adapter)."""
        await asyncio.gather(*self._events, return_exceptions=True)
