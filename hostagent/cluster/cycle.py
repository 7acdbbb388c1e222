"""The Kubernetes half of a cycle, as the agent's `Cluster` seam: policy from the
configuration on top of the `kube` adapter.

Reclaim: cordon (remembering whether we did), mark the node with who takes its GPUs,
tell the cluster (an Event on the Node), drain; `on_drain_timeout` decides whether a
drain that could not finish lets the reclaim go on ("proceed": the player first; the
pods left are named in the journal, loudly when they will die without an eviction) or
stops it ("abort": the GPUs stay lent, the player's request fails with the reason).
A regrow (a restart of the lendee to take more GPUs) has no player: its drain is
always of the "abort" kind, so no pod is killed for a restart nobody waits for.
Credentials the API server refuses (401, 403) are never a reason to go on: nothing is
known about the pods, so the reclaim stops whatever the policy says.

Down: whenever the lendee stops, for any reason (a crash, `virsh shutdown`, a host
reboot seen at start), the node is cordoned with our marker (`lendee_down`), so that
it is verified before it takes work again; another's cordon is never touched.

Return: decide once what the lent GPUs must make allocatable (`expect`: time-slicing
replicas and MIG devices included), wait for the node to be Ready and to report it,
then put the lent taints, the borrowed label and our annotations on, and uncordon last
(only if our marker says we cordoned): no pod lands on borrowed capacity without the
taints in place. A node that comes back short stays cordoned, with an Event saying why.

Lent: `watch_lent` follows the node until cancelled (Ready, allocatable, pods that
use GPUs); a GPU lost or a node NotReady while lent is a journal error and a failing
"kubernetes" health check (`health`), and the GPU pods count feeds
``hostagent_node_gpu_pods`` and `watch_gpu_pods`.

DRA (``[kubernetes] gpu_api``, "auto" deciding at each lend): the node has no GPU in
allocatable; its ResourceSlices of the DRA driver must list exactly the lent GPUs by
UUID before the uncordon, a lent UUID gone from them while lent is a GPU lost, and the
ResourceClaims say which pod holds which lent GPU (`status`, the
``hostagent_lent_gpu_pod`` metric, the node's ``gpu-holders`` annotation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Protocol

from hostagent.cluster import dra
from hostagent.host import journal
from hostagent.core.config import Config, DrainTimeoutAction, GpuApi
from hostagent.core.health import CheckFailed
from hostagent.cluster.kube import (
    DrainAborted,
    ExpectedGpus,
    Kube,
    KubeAuthError,
    KubeError,
    KubeUnavailable,
    LeftReason,
    NodeCheck,
    NodeNotFound,
    NodeView,
    Taint,
    expected_gpus,
)

log = logging.getLogger(__name__)
# A hot-unplug's reading of which pods use its GPUs: their UIDs, or None and why not.
PodsReader = Callable[[], Awaitable[tuple[Collection[str] | None, str]]]


def parse_taint(text: str) -> Taint:
    """`key=value:Effect` or `key:Effect` (kubectl's syntax)."""
    spec, _, effect = text.rpartition(":")
    key, _, value = spec.partition("=")
    return Taint(key=key, value=value, effect=effect)


class Metrics(Protocol):
    """What the cluster reports to `hostagent.surfaces.metrics.Metrics`."""

    def node_gpu_pods(self, count: int | None) -> None: ...

    def gpu_lost(self) -> None: ...

    def lent_gpu_pods(self, holders: dict[str, str] | None) -> None: ...


class KubeCluster:
    def __init__(self, kube: Kube, cfg: Config, *,
                 remember_cordon: Callable[[bool], None],
                 metrics: Metrics | None = None) -> None:
        assert cfg.kubernetes is not None
        self.kube = kube
        self.settings = cfg.kubernetes
        self.timeouts = cfg.timeouts
        self.policy = cfg.policy
        self.node = cfg.lendee.node
        self.lendee_gpus = tuple(cfg.lendee.gpus)
        self.uuids = {label: gpu.uuid for label, gpu in cfg.gpus.items()}
        self.prefix = cfg.kubernetes.annotation_prefix
        self.taints = [parse_taint(t) for t in cfg.kubernetes.lent_taints]
        self._remember_cordon = remember_cordon
        self.metrics = metrics
        # Decided once per lend by `expect`; what `status` shows and the watch checks.
        self.expected: ExpectedGpus | None = None
        self.view: NodeView | None = None  # what the watch of the lent node last saw
        # DRA lends (decided by `expect`): the lent GPUs' label -> UUID; None: device plugin.
        self.dra: dict[str, str | None] | None = None
        self.gpu_api_from = ""  # why the last lend's GPUs were told by that API
        self.holders: dict[str, str] = {}  # DRA: lent GPU -> the pods holding it, last seen
        self.trouble: str | None = None  # why the lent node is not whole (health fails)
        # Seconds a hot-unplug's evictions took: the reclaim by restart after it, if it
        # gives way, drains within what they left of timeouts.drain, not one of its own
        # (the time the guest took to let go is no drain's).
        self._vacate_spent = 0.0
        self._events: set[asyncio.Task[None]] = set()
        self.auth_retry = 30.0  # seconds between watches refused with 401/403

    # --- start-up and health ------------------------------------------------------------

    async def check(self, *, timeout: float = 10) -> NodeCheck:
        """The node as the cluster has it now. A node that is not there is no reason to
        stop (it registers when the lendee's kubelet starts): log `str(check)`.
        Raises KubeUnavailable, KubeAuthError."""
        return await self.kube.check_node(self.node, timeout=timeout)

    async def health(self) -> str:
        """The "kubernetes" health check: one real request to the API server, and what
        the watch of the lent node found wrong (a GPU lost, NotReady)."""
        try:
            check = await self.kube.check_node(self.node, timeout=2)
        except KubeError as e:
            raise CheckFailed(f"kubernetes: {e}") from e
        if self.trouble is not None:
            raise CheckFailed(self.trouble)
        detail = str(check)
        if self.view is not None and self.view.gpu_pods is not None:
            detail += f"; {self.view.gpu_pods} pod(s) on it use GPUs"
        return detail

    def status(self) -> dict[str, object]:
        """What `hostagent status` shows of the cluster: what this lend must make
        allocatable, and the lent node as the watch last saw it."""
        view = self.view
        return {
            "node": self.node,
            "expected": None if self.expected is None else str(self.expected),
            "ready": None if view is None else view.ready,
            "allocatable": None if view is None else dict(view.allocatable),
            "gpu_pods": None if view is None else view.gpu_pods,
            "gpu_api": "device-plugin" if self.dra is None else f"dra ({self.settings.dra_driver})",
            "gpu_api_from": self.gpu_api_from,
            "holders": None if view is None or self.dra is None else self._holders(view),
            "trouble": self.trouble,
        }

    def _holders(self, view: NodeView) -> dict[str, str]:
        """Lent GPU label -> the pods holding it, from the claims the watch saw."""
        assert self.dra is not None
        return {label: view.holders[uuid] for label, uuid in sorted(self.dra.items())
                if uuid and uuid in view.holders}

    # --- reclaim --------------------------------------------------------------------------

    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None) -> str | None:
        on_timeout = DrainTimeoutAction.ABORT if regrow else self.policy.on_drain_timeout
        abort = on_timeout is DrainTimeoutAction.ABORT
        # One budget for the whole reclaim: a player never waits longer than
        # timeouts.drain for the cluster, however the API server behaves, a hot-unplug's
        # evictions before it included (a budget blocked them: it blocks this drain too).
        # A reservation's drain, ahead of its time, may take until then (`until`).
        spent = 0.0 if regrow else self._vacate_spent
        deadline = time.monotonic() + max(self.timeouts.drain - spent, until or 0.0)
        self._vacate_spent = 0.0
        self.trouble = None

        def left() -> float:
            return max(0.1, deadline - time.monotonic())
        who = ", ".join(owners) or ("a restart with more GPUs" if regrow
                                    else "hostagent reclaim")
        try:
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix,
                                            timeout=left())
            if cordon.cordoned_by_us:
                self._remember_cordon(True)
            labels = {self.settings.borrowed_label: None} if self.settings.borrowed_label \
                else None
            await self.kube.annotate(self.node, {
                f"{self.prefix}state": "reclaiming",
                f"{self.prefix}holder": ",".join(owners) or None,
            }, labels=labels, remove_taints=self.taints, timeout=left())
            stops = ", ".join(f"{pods} ({gpu})" for gpu, pods in self.holders.items())
            if stops:
                journal.record("drain", f"the drain of node {self.node} stops the pods that "
                               f"hold lent GPUs: {stops}", vm=self.node, result="holders",
                               pods=stops)
            self._event("Reclaimed", f"GPUs reclaimed for {who}: draining, then the "
                        "node's VM shuts down" + (f"; it stops {stops}" if stops else ""))
            report = await self.kube.drain(
                self.node, timeout=left(), emptydir_ok=self.settings.drain_emptydir,
                unmanaged_ok=self.settings.drain_unmanaged,
                on_timeout=on_timeout,
                grace_period=self.settings.grace_period,
                skip_wait_for_delete_timeout=self.settings.skip_wait_for_delete_timeout)
        except DrainAborted as e:
            return f"the drain of node {self.node} did not finish: {e.report.summary()}"
        except KubeAuthError as e:
            # Not an outage: going on would power off a node whose pods nobody evicted.
            journal.record("drain", f"could not cordon and drain node {self.node}: {e}; the "
                           "reclaim stops, whatever policy.on_drain_timeout says",
                           vm=self.node, result="unauthorized", priority=journal.Priority.ERR)
            return f"could not drain node {self.node}: {e}"
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
            doomed = [p for p in report.left
                      if p.reason in (LeftReason.UNMANAGED, LeftReason.EMPTYDIR)]
            if doomed:
                names = ", ".join(str(p.pod) for p in doomed)
                message = (f"{len(doomed)} pod(s) on {self.node} were not evicted and will be "
                           f"killed when its VM powers off: {names} (drain_unmanaged or "
                           "drain_emptydir is false; policy.on_drain_timeout = \"abort\" "
                           "would keep the GPUs lent instead)")
                journal.record("drain", message, vm=self.node, result="killed-without-eviction",
                               pods=names, priority=journal.Priority.WARNING)
                self._event("PodsNotEvicted", message, warning=True)
        return None

    # --- hot-unplug -----------------------------------------------------------------------

    async def vacate(self, owners: list[str], gpus: Collection[str],
                     pods: PodsReader, *, until: float | None = None) -> str | None:
        """A hot-unplug's part: cordon the node (ours), then evict only the pods that use
        the GPUs `gpus`, those their ResourceClaims name (DRA) or else those `pods()`
        reads, once the node is cordoned (a pod placed before the cordon is seen): the
        UIDs the kubelet's device checkpoint in the guest names, or None and why not,
        as the drain evicts them but always of the "abort" kind. None once they are
        gone; or why the hot-unplug must give way to the reclaim by restart, which
        drains the node, cordoned already, under the policy players wait for. For a
        reservation alone, whose pods were told and get their full grace period, it may
        take `until` (seconds from now: up to the reserved time) where that is longer."""
        began = time.monotonic()
        deadline = began + max(self.timeouts.drain, until or 0.0)
        names = ", ".join(sorted(gpus))
        self.trouble = None

        def left() -> float:
            return max(0.1, deadline - time.monotonic())
        try:
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix,
                                            timeout=left())
            if cordon.cordoned_by_us:
                self._remember_cordon(True)
            await self.kube.annotate(self.node, {
                f"{self.prefix}state": "reclaiming",
                f"{self.prefix}holder": ",".join(owners) or None}, timeout=left())
            if self.dra is not None:
                uuids = {self.uuids.get(g) for g in gpus}
                if None in uuids:
                    return f"which pods hold {names} is unknown: set the uuid of each GPU"
                using: Collection[str] = await self.kube.dra_holders(
                    self.node, driver=self.settings.dra_driver,
                    uuids=[u for u in uuids if u], timeout=left())
            else:
                read, why = await pods()
                if read is None:
                    return (f"which pods use {names} is unknown: the kubelet's device "
                            f"checkpoint could not be read in the guest ({why})")
                using = read
            self._event("Reclaimed", f"GPUs reclaimed for {', '.join(owners) or 'an owner'} "
                        f"live: {names} leave the node, {len(using)} pod(s) using them are "
                        "evicted, the others stay")
            if using:
                await self.kube.drain(
                    self.node, timeout=left(), emptydir_ok=self.settings.drain_emptydir,
                    unmanaged_ok=self.settings.drain_unmanaged,
                    on_timeout=DrainTimeoutAction.ABORT,
                    grace_period=self.settings.grace_period,
                    skip_wait_for_delete_timeout=self.settings.skip_wait_for_delete_timeout,
                    only=using)
        except DrainAborted as e:
            return f"the pods using {names} were not all evicted: {e.report.summary()}"
        except KubeError as e:
            return f"could not evict the pods using {names} from node {self.node}: {e}"
        finally:
            self._vacate_spent = time.monotonic() - began
        return None

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        """A hot-unplug's part, once the GPUs' pods are gone: the node's GPU plugins are
        stopped (their pods deleted). NVIDIA's device plugin enumerates GPUs only when it
        starts (and on SIGHUP, or when the kubelet's socket is made anew) and its health
        check keeps NVML events registered on every GPU it serves for as long as it
        runs, so it holds the GPU open and would still offer it; the DaemonSet starts it
        again, and the return after the detach restarts it once more to advertise the
        rest. None, or why the reclaim by restart must run instead."""
        try:
            deleted = await self.kube.restart_plugins(
                self.node, timeout=self.timeouts.ready, selectors=self.settings.plugin_selectors)
        except KubeError as e:
            return f"could not stop the GPU plugins on node {self.node}: {e}"
        journal.record("hotplug", f"stopped {', '.join(deleted) or 'no plugin pod'} on node "
                       f"{self.node}, which hold {', '.join(sorted(gpus))} open",
                       vm=self.node, result="ok")
        return None

    # --- the lendee went down -------------------------------------------------------------

    async def lendee_down(self, *, why: str = "the lendee stopped") -> None:
        """Cordon the node with our marker because its VM is down, whatever stopped it,
        so that its next return is verified before it takes work. An administrator's
        cordon stays theirs. Never raises: a failure is in the journal, and the return
        path cordons nothing but still only uncordons after verification."""
        try:
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix,
                                            timeout=self.timeouts.drain)
            if cordon.cordoned_by_us:
                self._remember_cordon(True)
            await self.kube.annotate(self.node, {f"{self.prefix}state": "off"},
                                     timeout=self.timeouts.drain)
        except NodeNotFound:
            log.info("node %s is not in the cluster: nothing to cordon (%s)", self.node, why)
        except KubeError as e:
            journal.record("cordon", f"{why}, and its node {self.node} could not be cordoned: "
                           f"{e}", vm=self.node, result="failed",
                           priority=journal.Priority.WARNING)

    # --- return ---------------------------------------------------------------------------

    def _labels(self, lent: Collection[str] | int) -> tuple[str, ...]:
        if not isinstance(lent, int):
            return tuple(sorted(lent))
        if lent == len(self.lendee_gpus):
            return tuple(sorted(self.lendee_gpus))
        return tuple(f"gpu{i}" for i in range(lent))

    async def expect(self, lent: Collection[str] | int) -> ExpectedGpus:
        """Decide, once for this lend, what the node must make allocatable for the `lent`
        GPUs (their labels): `[kubernetes] expected` if set, else from the node's GPU
        Feature Discovery labels (see `kube.expected_gpus`). Journaled; kept in
        `self.expected` for `status` and the watch."""
        gpus = self._labels(lent)
        self.dra, self.holders = None, {}
        if await self._uses_dra():
            self.dra = {label: self.uuids.get(label) for label in gpus}
            driver = self.settings.dra_driver
            self.expected = ExpectedGpus(gpus, {}, f"{len(gpus)} GPU(s) by UUID in its {driver} "
                                         "ResourceSlices (DRA)")
            listed = ", ".join(f"{g} ({u or 'no uuid'})" for g, u in self.dra.items())
            journal.record("expect", f"node {self.node} must list {listed} in its {driver} "
                           f"ResourceSlices (DRA: {self.gpu_api_from})", vm=self.node,
                           result="decided", gpus=",".join(gpus))
            return self.expected
        labels: dict[str, str] = {}
        capacity: dict[str, str] = {}
        labelled: int | None = None
        if not self.settings.expected:
            try:
                labels, annotations, capacity = await self.kube.node_metadata(
                    self.node, timeout=10)
                previous = annotations.get(f"{self.prefix}lent-gpus", "")
                labelled = len([g for g in previous.split(",") if g]) or None
            except (NodeNotFound, KubeUnavailable) as e:
                log.info("node %s unread (%s): expecting one %s per GPU", self.node, e,
                         self.settings.gpu_resource)
        self.expected = expected_gpus(gpus, labels=labels, resource=self.settings.gpu_resource,
                                      override=self.settings.expected, labelled_gpus=labelled,
                                      capacity=capacity)
        journal.record("expect", f"node {self.node} must report {self.expected} for "
                       f"{', '.join(gpus)} (device plugin: {self.gpu_api_from})", vm=self.node,
                       result="decided",
                       gpus=",".join(gpus))
        return self.expected

    async def _uses_dra(self) -> bool:
        """gpu_api, or for "auto" what the node publishes: its ResourceSlices of the DRA
        driver or its GPU capacity, watched for up to timeouts.ready while it publishes
        neither (a lendee just booted: the return goes on at the event that publishes
        them). Kept with why in `gpu_api_from`. Raises KubeError where the DRA API is
        refused (the message names what is missing)."""
        if self.settings.gpu_api is not GpuApi.AUTO:
            self.gpu_api_from = "kubernetes.gpu_api says so"
            return self.settings.gpu_api is GpuApi.DRA
        deadline = time.monotonic() + self.timeouts.ready
        while True:
            try:
                found = await self.kube.gpu_api_of(
                    self.node, driver=self.settings.dra_driver,
                    resource=self.settings.gpu_resource, timeout=10,
                    wait=max(0.0, deadline - time.monotonic()))
            except (NodeNotFound, KubeUnavailable) as e:
                found, self.gpu_api_from = None, f"node {self.node} unread ({e})"
            if found is not None:
                dra_, self.gpu_api_from = found
                return dra_
            if time.monotonic() >= deadline:
                driver = self.settings.dra_driver
                self.gpu_api_from = (f"node {self.node} published neither {driver}"
                                     f" ResourceSlices nor {self.settings.gpu_resource} in "
                                     f"{self.timeouts.ready:g} s: the device plugin expected")
                return False
            await asyncio.sleep(1.0)  # the node unread, or its watch cut: read again

    async def _restart_plugins(self, gpus: Iterable[str]) -> None:
        """The node's GPU plugins started again, to advertise `gpus` (a live change)."""
        deleted = await self.kube.restart_plugins(
            self.node, timeout=self.timeouts.ready, selectors=self.settings.plugin_selectors)
        journal.record("hotplug", f"restarted {', '.join(deleted) or 'no plugin pod'} on "
                       f"node {self.node} to advertise {', '.join(gpus)}",
                       vm=self.node, result="ok")

    async def give_back(self, lent: Collection[str] | int,
                        expected: ExpectedGpus | None = None, *,
                        restart_plugins: bool = False) -> str | None:
        """Wait Ready and the expected allocatable; then taints, label and annotations;
        uncordon last. None when done, or why the node stays cordoned.

        `lent`: the labels of the GPUs this lend gave the lendee (an int, the count, is
        understood as every configured lendee GPU). `expected`: as `expect` decided it
        earlier for this lend; decided here if not given. `restart_plugins`: the lendee
        lost GPUs while it ran (a hot-unplug), and the GPU plugins, which enumerate GPUs
        when they start, are restarted first to advertise the rest."""
        self.trouble = None
        self._vacate_spent = 0.0  # the hot-unplug before, if any, is over
        try:
            if expected is None or expected.gpus != self._labels(lent):
                expected = await self.expect(lent)
            self.expected = expected
            if restart_plugins:
                await self._restart_plugins(expected.gpus)
            await self.kube.wait_ready(self.node, timeout=self.timeouts.ready)
            if self.dra is not None:
                problem = await self._wait_devices(self.dra)
                if problem is not None:
                    return problem
            found = await self.kube.wait_gpus(self.node, expected=expected,
                                              timeout=self.timeouts.ready)
            if not expected.met_by(found):
                await self.kube.annotate(self.node, {f"{self.prefix}state": "short-of-gpus"})
                problem = (f"node {self.node} is Ready but {expected.shortfall(found)} "
                           f"({expected.how}); it stays cordoned. "
                           "Look inside it: is the driver branch right for the card, is the "
                           "device plugin running (and its time-slicing or MIG configuration "
                           "the one expected), did the passthrough work?")
                self._event("ReturnFailed", problem, warning=True)
                return problem
            # Everything that keeps the wrong pods off borrowed capacity first...
            labels = {self.settings.borrowed_label: "true"} if self.settings.borrowed_label \
                else None
            await self.kube.annotate(self.node, {
                f"{self.prefix}state": "lent",
                f"{self.prefix}holder": None,
                f"{self.prefix}lent-gpus": ",".join(expected.gpus),
                f"{self.prefix}expected": ", ".join(
                    f"{n} {r}" for r, n in sorted(expected.resources.items())) or None,
                f"{self.prefix}gpu-holders": None,
            }, labels=labels, add_taints=self.taints)
            # ...and the uncordon last. It lifts only our own cordon (the marker on the
            # Node says whose it is); an administrator's stays, and the adapter says so.
            await self.kube.uncordon(self.node, marker_prefix=self.prefix)
            self._remember_cordon(False)
        except KubeError as e:
            problem = f"could not return node {self.node} to the cluster: {e}"
            self._event("ReturnFailed", problem, warning=True)
            return problem
        self._event("Lent", f"lent with {len(expected.gpus)} GPU(s) "
                    f"({', '.join(expected.gpus)}): {expected}")
        return None

    async def grow(self, lent: Collection[str]) -> str | None:
        """A hot-add: the node, lent and uncordoned all along, must advertise the `lent`
        GPUs now. The GPU plugins' pods on it are restarted (they enumerate GPUs when
        they start), then the node must report what `expect` decides for `lent`; only
        then are our annotations changed. None, or why not: the node is left as it was
        and what it must report too (the GPU added waits for the next restart)."""
        before = (self.expected, self.dra)
        try:
            expected = await self.expect(lent)
            await self._restart_plugins(sorted(lent))
            if self.dra is not None:
                lent_dra, driver = self.dra, self.settings.dra_driver
                seen = await self.kube.wait_devices(
                    self.node, driver=driver, timeout=self.timeouts.ready,
                    done=lambda slices: dra.verdict(lent_dra, slices) is None)
                problem = dra.verdict(lent_dra, seen, driver=driver,
                                       node=f"node {self.node}")
            else:
                found = await self.kube.wait_gpus(self.node, expected=expected,
                                                  timeout=self.timeouts.ready)
                problem = None if expected.met_by(found) else (
                    f"node {self.node} {expected.shortfall(found)} ({expected.how})")
            if problem is None:
                await self.kube.annotate(self.node, {
                    f"{self.prefix}lent-gpus": ",".join(expected.gpus),
                    f"{self.prefix}expected": ", ".join(
                        f"{n} {r}" for r, n in sorted(expected.resources.items())) or None})
        except KubeError as e:
            problem = f"node {self.node} could not be told of the GPUs: {e}"
        if problem is not None:
            self.expected, self.dra = before
            return problem
        self._event("Lent", f"lent {len(expected.gpus)} GPU(s) with no restart "
                    f"({', '.join(expected.gpus)}): {expected}")
        return None

    async def _wait_devices(self, lent: dict[str, str | None]) -> str | None:
        """DRA: wait until the node's slices list exactly the `lent` GPUs by UUID; None,
        or why the node stays cordoned (each GPU missing, or there but not lent, named)."""
        driver = self.settings.dra_driver
        seen = await self.kube.wait_devices(
            self.node, driver=driver, timeout=self.timeouts.ready,
            done=lambda slices: dra.verdict(lent, slices) is None)
        wrong = dra.verdict(lent, seen, driver=driver, node=f"node {self.node}")
        if wrong is None:
            return None
        await self.kube.annotate(self.node, {f"{self.prefix}state": "short-of-gpus"})
        problem = (f"{wrong}; it stays cordoned. Look inside it: is the driver branch right "
                   f"for the card, is the {driver} DRA driver's kubelet plugin running, did "
                   "the passthrough work?")
        self._event("ReturnFailed", problem, warning=True)
        return problem

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

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        resources = list(self.expected.resources) if self.expected is not None \
            else [self.settings.gpu_resource]
        stamps: dict[str, float] = {}

        def value(grace: float) -> str:
            at = when(grace)
            text = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
            stamps[text] = at
            return text

        try:
            text, pods = await self.kube.notice_pods(
                self.node, annotation=f"{self.prefix}reclaim-at", value=value,
                reason="GPUReclaimNotice", message=message, resources=resources, timeout=30)
            return stamps[text], pods
        except KubeError as e:
            at = when(0.0)
            journal.record("reserve", f"could not tell the GPU pods on node {self.node} when "
                           f"their GPUs are taken back: {e}", vm=self.node,
                           result="notice-failed", priority=journal.Priority.WARNING)
            return at, []

    # --- telling the cluster --------------------------------------------------------------

    def _event(self, reason: str, message: str, *, warning: bool = False) -> None:
        """Post an Event on the Node in the background (it never delays a step)."""
        task = asyncio.get_running_loop().create_task(
            self._post(reason, message, warning))
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def _post(self, reason: str, message: str, warning: bool) -> None:
        try:
            await self.kube.post_event(self.node, reason=reason, message=message,
                                       warning=warning, timeout=10)
        except KubeError as e:
            log.warning("could not post the %s event on node %s: %s", reason, self.node, e)

    async def flush_events(self) -> None:
        """Wait for the Events being posted (tests, and before closing the adapter)."""
        await asyncio.gather(*self._events, return_exceptions=True)

    # --- a restart of the agent while lent ---------------------------------------------------

    async def adopt(self, lent: Collection[str]) -> str | None:
        """The lendee runs with `lent` as the agent starts: None if its node is in service
        as the last lend left it (Ready, uncordoned, marked lent with exactly `lent`, each
        expected GPU advertised), this lend's expectations kept for the watch and
        `status` as `give_back` keeps them; else why not (the lend is verified again)."""
        gpus = ", ".join(sorted(lent))
        try:
            check = await self.kube.check_node(self.node, timeout=10)
            if not check.exists or not check.ready or check.unschedulable:
                return str(check)
            _, annotations, _ = await self.kube.node_metadata(self.node, timeout=10)
            marked = annotations.get(f"{self.prefix}lent-gpus", "")
            if (annotations.get(f"{self.prefix}state") != "lent"
                    or marked != ",".join(sorted(lent))):
                return f"node {self.node} is not marked lent with {gpus} ({marked or 'none'})"
            expected = await self.expect(lent)
            if self.dra is not None:
                lent_dra = self.dra
                seen = await self.kube.wait_devices(
                    self.node, driver=self.settings.dra_driver, timeout=5,
                    done=lambda slices: dra.verdict(lent_dra, slices) is None)
                return dra.verdict(lent_dra, seen, driver=self.settings.dra_driver,
                                   node=f"node {self.node}")
            found = await self.kube.wait_gpus(self.node, expected=expected, timeout=5)
        except KubeError as e:
            return f"node {self.node} could not be read: {e}"
        if not expected.met_by(found):
            return f"node {self.node} {expected.shortfall(found)} ({expected.how})"
        return None
