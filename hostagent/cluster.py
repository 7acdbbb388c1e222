"""The Kubernetes half of a cycle, as the agent's `Cluster` seam: policy from the
configuration on top of the `kube` adapter.

Reclaim: cordon (remembering whether we did), mark the node with who takes its GPUs,
drain; `on_drain_timeout` decides whether a drain that could not finish lets the
reclaim go on ("proceed": the player first; the pods left are named in the journal) or
stops it ("abort": the GPUs stay lent, the player's request fails with the reason).

Return: wait for the node to be Ready and to report every lent GPU as allocatable
(the device plugin registers only once the driver really sees them), then uncordon
only if our marker says we cordoned. A node that comes back short stays cordoned.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hostagent import journal
from hostagent.config import Config, DrainTimeoutAction
from hostagent.kube import DrainAborted, Kube, KubeError, Taint


def parse_taint(text: str) -> Taint:
    """`key=value:Effect` or `key:Effect` (kubectl's syntax)."""
    spec, _, effect = text.rpartition(":")
    key, _, value = spec.partition("=")
    return Taint(key=key, value=value, effect=effect)


class KubeCluster:
    def __init__(self, kube: Kube, cfg: Config, *,
                 remember_cordon: Callable[[bool], None]) -> None:
        assert cfg.kubernetes is not None
        self.kube = kube
        self.settings = cfg.kubernetes
        self.timeouts = cfg.timeouts
        self.policy = cfg.policy
        self.node = cfg.lendee.node
        self.prefix = cfg.kubernetes.annotation_prefix
        self.taints = [parse_taint(t) for t in cfg.kubernetes.lent_taints]
        self._remember_cordon = remember_cordon

    async def reclaim(self, owners: list[str]) -> str | None:
        abort = self.policy.on_drain_timeout is DrainTimeoutAction.ABORT
        # One budget for the whole reclaim: a player never waits longer than
        # timeouts.drain for the cluster, however the API server behaves.
        deadline = time.monotonic() + self.timeouts.drain

        def left() -> float:
            return max(0.1, deadline - time.monotonic())
        try:
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix,
                                            timeout=left())
            if cordon.cordoned_by_us:
                self._remember_cordon(True)
            await self.kube.annotate(self.node, {
                f"{self.prefix}state": "reclaiming",
                f"{self.prefix}holder": ",".join(owners) or None,
            }, remove_taints=self.taints, timeout=left())
            report = await self.kube.drain(
                self.node, timeout=left(), emptydir_ok=self.settings.drain_emptydir,
                unmanaged_ok=self.settings.drain_unmanaged,
                on_timeout=self.policy.on_drain_timeout)
        except DrainAborted as e:
            return f"the drain of node {self.node} did not finish: {e.report.summary()}"
        except KubeError as e:
            if abort:
                return f"could not drain node {self.node}: {e}"
            journal.record("drain", f"could not drain node {self.node} ({e}); going on: "
                           "the player comes first (policy.on_drain_timeout = \"proceed\")",
                           vm=self.node, result="skipped", priority=journal.Priority.WARNING)
            return None
        if not report.complete:
            journal.record("drain", f"node {self.node} not fully drained, going on as "
                           f"policy.on_drain_timeout says: {report.summary()}", vm=self.node,
                           result="incomplete", priority=journal.Priority.WARNING)
        return None

    async def give_back(self, gpus: int) -> str | None:
        resource = self.settings.gpu_resource
        try:
            await self.kube.wait_ready(self.node, timeout=self.timeouts.ready)
            found = await self.kube.wait_gpus(self.node, resource=resource, count=gpus,
                                              timeout=self.timeouts.ready)
            if found != gpus:
                await self.kube.annotate(self.node, {f"{self.prefix}state": "short-of-gpus"})
                return (f"node {self.node} is Ready but reports {found} allocatable {resource} "
                        f"where {gpus} were lent; it stays cordoned. Look inside it: is the "
                        "driver branch right for the card, is the device plugin running, did "
                        "the passthrough work?")
            # Lifts only our own cordon (the marker on the Node says whose it is); an
            # administrator's stays, and the adapter says so in the journal.
            await self.kube.uncordon(self.node, marker_prefix=self.prefix)
            self._remember_cordon(False)
            await self.kube.annotate(self.node, {f"{self.prefix}state": "lent",
                                                 f"{self.prefix}holder": None},
                                     add_taints=self.taints)
        except KubeError as e:
            return f"could not return node {self.node} to the cluster: {e}"
        return None
