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
replicas and MIG devices included); trust nothing from the previous boot — the node's
``bootID`` must be the guest's own boot id (read at each return, `_this_boot`) before
its Ready, allocatable or slices count, and while they differ the journal and `status`
say the return is waiting for the kubelet of this boot; wait for the node to be Ready
and to report it,
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
from collections.abc import Awaitable, Callable, Collection, Iterable

from hostagent.cluster import dra
from hostagent.cluster.lent import Lent, Metrics
from hostagent.host import journal
from hostagent.host.verify import VerifyError
from hostagent.core.config import Config, DrainTimeoutAction, GpuApi
from hostagent.core.health import CheckFailed
from hostagent.core.levers import Terms
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
# The guest's boot id (/proc/sys/kernel/random/boot_id), read through the guest agent;
# raises VerifyError.
BootReader = Callable[[], Awaitable[str]]


def parse_taint(text: str) -> Taint:
    """`key=value:Effect` or `key:Effect` (kubectl's syntax)."""
    spec, _, effect = text.rpartition(":")
    key, _, value = spec.partition("=")
    return Taint(key=key, value=value, effect=effect)


class KubeCluster(Lent):
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
        # The running lendee's boot id, read at each return (forgotten when it stops),
        # and what the return waits for while the node still shows another boot's.
        self.boot_id: str | None = None
        self.waiting: str | None = None
        # Seconds a hot-unplug's evictions took: the reclaim by restart after it, if it
        # gives way, drains within what they left of timeouts.drain, not one of its own
        # (the time the guest took to let go is no drain's).
        self._vacate_spent = 0.0
        # When a hot-unplug under way must be done with the cluster, set by `vacate`:
        # its plugins' pause (`withdraw`) waits no longer, and adds its time to the
        # spent, so a player waits on the cluster within one timeouts.drain, whatever
        # road the reclaim takes. None: no hot-unplug under way.
        self._vacate_deadline: float | None = None
        self._events: set[asyncio.Task[None]] = set()
        self.auth_retry = 30.0  # seconds between watches refused with 401/403
        self.ahead: str | None = None  # why the lent node is cordoned ahead, if it is

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
            "boot_id": self.boot_id,
            "waiting": self.waiting,
            "cordoned_for": self.ahead,
        }

    # --- reclaim --------------------------------------------------------------------------

    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None, terms: Terms | None = None,
                      accepted: Callable[[], None] | None = None,
                      emptied: Callable[[], None] | None = None) -> str | None:
        """Cordon and drain under `terms` (`levers.terms`: the grace cap, said in the
        Event and the journal; None: the pods' own grace); `accepted` is called once
        every eviction is accepted (see `Kube.drain`), `emptied` if the drain ends with
        every evicted pod gone (`DrainReport.complete`)."""
        terms = terms or Terms(None, False, "evicted pods get their full grace period")
        on_timeout = DrainTimeoutAction.ABORT if regrow else self.policy.on_drain_timeout
        abort = on_timeout is DrainTimeoutAction.ABORT
        # One budget for the whole reclaim: a player never waits longer than
        # timeouts.drain for the cluster, however the API server behaves, a hot-unplug's
        # evictions before it included (a budget blocked them: it blocks this drain too).
        # A reservation's drain, ahead of its time, may take until then (`until`).
        spent = 0.0 if regrow else self._vacate_spent
        deadline = time.monotonic() + max(self.timeouts.drain - spent, until or 0.0)
        self._vacate_spent, self._vacate_deadline = 0.0, None
        self.trouble = None

        def left() -> float:
            return max(0.1, deadline - time.monotonic())
        who = ", ".join(owners) or ("a restart with more GPUs" if regrow
                                    else "hostagent reclaim")
        try:
            # The cordon and the marks of a reclaim in one write: the first round trip
            # of a player's wait is also its last before the list and the evictions.
            labels = {self.settings.borrowed_label: None} if self.settings.borrowed_label \
                else None
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix, annotations={
                f"{self.prefix}state": "reclaiming",
                f"{self.prefix}holder": ",".join(owners) or None,
                f"{self.prefix}cordoned-for": None,
            }, labels=labels, remove_taints=self.taints, timeout=left())
            self.ahead = None
            if cordon.cordoned_by_us:
                self._remember_cordon(True)
            stops = ", ".join(f"{pods} ({gpu})" for gpu, pods in self.holders.items())
            if stops:
                journal.record("drain", f"the drain of node {self.node} stops the pods that "
                               f"hold lent GPUs: {stops}", vm=self.node, result="holders",
                               pods=stops)
            journal.record("drain", f"draining node {self.node} for {who}: {terms.said}",
                           vm=self.node, result="started", grace_cap=terms.grace_cap)
            self._event("Reclaimed", f"GPUs reclaimed for {who}: draining, then the "
                        f"node's VM {terms.stop}" + (f"; it stops {stops}" if stops else "")
                        + f"; {terms.said}")
            report = await self.kube.drain(
                self.node, timeout=left(), emptydir_ok=self.settings.drain_emptydir,
                unmanaged_ok=self.settings.drain_unmanaged,
                on_timeout=on_timeout,
                grace_period=self.settings.grace_period,
                skip_wait_for_delete_timeout=self.settings.skip_wait_for_delete_timeout,
                grace_cap=terms.grace_cap, accepted=accepted)
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
        if report.complete and emptied is not None:
            emptied()
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
                     pods: PodsReader, *, until: float | None = None,
                     grace_cap: float | None = None) -> str | None:
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
        self._vacate_deadline = deadline
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
                    only=using, grace_cap=grace_cap)
        except DrainAborted as e:
            return f"the pods using {names} were not all evicted: {e.report.summary()}"
        except KubeError as e:
            return f"could not evict the pods using {names} from node {self.node}: {e}"
        finally:
            self._vacate_spent = time.monotonic() - began
        return None

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        """A hot-unplug's part, once the GPUs' pods are gone: the node's GPU plugins, and
        every DaemonSet pod that honours `plugin_labels` (a DCGM exporter, GPU Feature
        Discovery), kept off the node as NVIDIA's mig-manager does (`pause_plugins`):
        they hold every GPU open while they run, and a deleted pod's DaemonSet makes a
        new one at once. The labels stay paused until the node's return restores them
        (every return does, whatever road it took). None, or why the reclaim by
        restart must run instead. Within what a hot-unplug's evictions left of their
        deadline (`vacate`), else timeouts.ready (a failed hot-add's undo)."""
        began, deadline = time.monotonic(), self._vacate_deadline
        try:
            went = await self._pause_plugins(
                None if deadline is None else max(0.1, deadline - began))
        except KubeError as e:
            return f"could not keep the GPU plugins off node {self.node}: {e}"
        finally:
            if deadline is not None:
                self._vacate_spent += time.monotonic() - began
        journal.record("hotplug", f"paused {', '.join(went)} on node {self.node} in "
                       f"{time.monotonic() - began:.1f}s: they held "
                       f"{', '.join(sorted(gpus))} open", vm=self.node, result="ok")
        return None

    async def plugins_pausable(self, *, timeout: float = 10) -> tuple[bool, str]:
        """Whether the node's GPU plugins (`plugin_selectors`) can be kept off its GPUs
        through `plugin_labels`, and why (see `Kube.plugins_pausable`): what a
        hot-unplug needs of the cluster."""
        try:
            return await self.kube.plugins_pausable(
                self.node, selectors=self.settings.plugin_selectors,
                labels=self.settings.plugin_labels, timeout=timeout)
        except KubeError as e:
            return False, f"node {self.node}'s GPU plugins unread: {e}"

    async def _pause_plugins(self, timeout: float | None = None) -> list[str]:
        return await self.kube.pause_plugins(
            self.node, selectors=self.settings.plugin_selectors,
            labels=self.settings.plugin_labels, prefix=self.prefix,
            timeout=self.timeouts.ready if timeout is None else timeout)

    async def _resume_plugins(self) -> str | None:
        """The labels a pause changed, put back as they were; what was, or None if
        nothing was paused."""
        restored = await self.kube.resume_plugins(self.node, labels=self.settings.plugin_labels,
                                                  prefix=self.prefix, timeout=self.timeouts.ready)
        if restored is None:
            return None
        said = ", ".join(f"{k}={v}" if v is not None else f"{k} (absent)"
                         for k, v in sorted(restored.items())) or "no label"
        journal.record("hotplug", f"restored {said} on node {self.node}: its GPU plugins "
                       "start again", vm=self.node, result="ok")
        return said

    # --- ahead of an owner's usual hour ----------------------------------------------------

    async def cordon_ahead(self, why: str) -> bool:
        """Cordon the lent node (our marker), `why` in its ``cordoned-for`` annotation
        and the journal: it takes no new pod before an owner's usual hour. True if the
        cordon is ours (an administrator's stays theirs)."""
        try:
            cordon = await self.kube.cordon(self.node, marker_prefix=self.prefix,
                                            annotations={f"{self.prefix}cordoned-for": why},
                                            timeout=30)
        except KubeError as e:
            journal.record("ahead", f"could not cordon node {self.node} {why}: {e}",
                           vm=self.node, result="failed", priority=journal.Priority.WARNING)
            return False
        if cordon.cordoned_by_us:
            self._remember_cordon(True)
        self.ahead = why if cordon.cordoned_by_us else None
        journal.record("ahead", f"cordoned node {self.node} {why}: it takes no new pod, so "
                       "that a start finds it idle (drain.cordon_ahead)", vm=self.node,
                       result="cordoned" if cordon.cordoned_by_us else "cordoned-by-someone-else")
        self._event("CordonedAhead", f"cordoned {why}: no new pod until it passes")
        return cordon.cordoned_by_us

    async def uncordon_ahead(self, why: str) -> None:
        """Lift the cordon `cordon_ahead` set (only ours, and only while its annotation
        says it was set ahead: a reclaim's or a return's write drops it)."""
        self.ahead = None
        try:
            _, annotations, _ = await self.kube.node_metadata(self.node, timeout=30)
            if f"{self.prefix}cordoned-for" not in annotations:
                return
            if await self.kube.uncordon(self.node, marker_prefix=self.prefix, annotations={
                    f"{self.prefix}cordoned-for": None}, timeout=30):
                self._remember_cordon(False)
        except KubeError as e:
            journal.record("ahead", f"could not uncordon node {self.node} after {why}: {e}",
                           vm=self.node, result="failed", priority=journal.Priority.WARNING)
            return
        journal.record("ahead", f"uncordoned node {self.node}: {why}", vm=self.node,
                       result="uncordoned")

    # --- the lendee went down -------------------------------------------------------------

    async def lendee_down(self, *, why: str = "the lendee stopped") -> None:
        """Cordon the node with our marker because its VM is down, whatever stopped it,
        so that its next return is verified before it takes work. An administrator's
        cordon stays theirs. Never raises: a failure is in the journal, and the return
        path cordons nothing but still only uncordons after verification."""
        self.boot_id = None  # the next boot is another: its id is read afresh
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
        """The node's GPU plugins started again, to advertise `gpus` (a live change):
        paused until gone, then their labels restored, so that each starts anew and
        enumerates the GPUs (pause and restore are no-ops where a withdraw paused them
        already). Plugins that cannot be paused are deleted instead, for their
        DaemonSet to start again: enough to enumerate, never to withdraw."""
        if await self._resume_plugins() is not None:
            return  # a withdraw paused them: restored, they start anew
        pausable, why = await self.plugins_pausable()
        if pausable:
            went = await self._pause_plugins()
            await self._resume_plugins()
            journal.record("hotplug", f"restarted {', '.join(went)} on node {self.node} to "
                           f"advertise {', '.join(gpus)}", vm=self.node, result="ok")
            return
        deleted = await self.kube.restart_plugins(
            self.node, timeout=self.timeouts.ready, selectors=self.settings.plugin_selectors)
        if not deleted:  # nothing will advertise the GPUs: the setting is wrong
            journal.record("hotplug", f"nothing advertises {', '.join(gpus)} on node "
                           f"{self.node}: {why}", vm=self.node, result="error",
                           priority=journal.Priority.ERR)
            return
        journal.record("hotplug", f"deleted {', '.join(deleted)} on node "
                       f"{self.node} for their DaemonSet to start again, to advertise "
                       f"{', '.join(gpus)}: {why}", vm=self.node, result="warning",
                       priority=journal.Priority.WARNING)

    async def _this_boot(self, read: BootReader | None) -> str | None:
        """Invariant 14: wait until the node's ``status.nodeInfo.bootID`` is the
        guest's boot id, so that nothing a previous boot's kubelet posted counts. None
        when it is, or why the node stays cordoned; journaled plainly while they differ.

        `read`: a return's, which reads the boot id afresh through it (a reclaim stops
        the lendee without `lendee_down`: a boot id kept from before could be the very
        one the stale status shows). None: a hot-add's, in the boot the last return
        read, compared with that one (nothing to compare if none was read)."""
        if read is not None:
            self.boot_id = None
        elif self.boot_id is None:
            return None
        deadline = time.monotonic() + self.timeouts.ready
        while self.boot_id is None and read is not None:
            try:
                self.boot_id = await read()
            except VerifyError as e:
                if time.monotonic() >= deadline:
                    problem = (f"the boot id of node {self.node}'s guest could not be read "
                               f"({e}), so its status cannot be told from a previous "
                               "boot's; it stays cordoned")
                    self._event("ReturnFailed", problem, warning=True)
                    return problem
                await asyncio.sleep(1.0)
        boot = self.boot_id
        assert boot is not None
        try:
            shown = await self.kube.boot_of(self.node, timeout=10)
        except NodeNotFound:
            shown = ""  # deleted: it registers again when the kubelet of this boot starts
        if shown == boot:
            return None
        self.waiting = (f"the kubelet of this boot: node {self.node} still shows bootID "
                        f"{shown or '(none)'}, the guest's is {boot}")
        journal.record("boot", f"node {self.node} still shows the status of another boot "
                       f"(bootID {shown or '(none)'}; the guest's is {boot}): its Ready, "
                       "allocatable and ResourceSlices do not count yet; waiting for the "
                       "kubelet of this boot", vm=self.node, result="waiting",
                       boot_id=boot)
        try:
            shown = await self.kube.wait_boot(self.node, boot,
                                              timeout=max(1.0, deadline - time.monotonic()))
        finally:
            self.waiting = None
        if shown == boot:
            journal.record("boot", f"node {self.node}'s kubelet of this boot posted "
                           f"(bootID {boot})", vm=self.node, result="ok", boot_id=boot)
            return None
        problem = (f"node {self.node}'s kubelet of this boot did not post within "
                   f"{self.timeouts.ready:g} s: the node still shows bootID "
                   f"{shown or '(none)'}, the guest's is {boot}, so its Ready and GPUs are "
                   "another boot's; it stays cordoned. Is the kubelet (k3s) running in the "
                   "guest, and does it reach the API server?")
        self._event("ReturnFailed", problem, warning=True)
        return problem

    async def give_back(self, lent: Collection[str] | int,
                        expected: ExpectedGpus | None = None, *,
                        restart_plugins: bool = False,
                        boot_id: BootReader | None = None) -> str | None:
        """Wait for this boot's kubelet, Ready and the expected allocatable; then taints,
        label and annotations; uncordon last. None when done, or why the node stays
        cordoned.

        `lent`: the labels of the GPUs this lend gave the lendee (an int, the count, is
        understood as every configured lendee GPU). `expected`: as `expect` decided it
        earlier for this lend; decided here if not given. `restart_plugins`: the lendee
        lost GPUs while it ran (a hot-unplug), and the GPU plugins, which enumerate GPUs
        when they start, are restarted first to advertise the rest. `boot_id`: reads the
        guest's boot id, which the node's must equal before its status counts
        (`_this_boot`)."""
        self.trouble = None
        # the hot-unplug before, if any, is over
        self._vacate_spent, self._vacate_deadline = 0.0, None
        try:
            if expected is None or expected.gpus != self._labels(lent):
                expected = await self.expect(lent)
            self.expected = expected
            if (wrong_boot := await self._this_boot(boot_id)) is not None:
                return wrong_boot
            if restart_plugins:
                await self._restart_plugins(expected.gpus)
            else:  # a pause left by a hot-unplug that gave way to a restart, or by a crash
                await self._resume_plugins()
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
            # Everything that keeps the wrong pods off borrowed capacity, and the
            # uncordon, in one write: no pod is scheduled between them. It lifts only
            # our own cordon (the marker on the Node says whose it is); an
            # administrator's stays, and the adapter says so.
            labels = {self.settings.borrowed_label: "true"} if self.settings.borrowed_label \
                else None
            await self.kube.uncordon(self.node, marker_prefix=self.prefix, annotations={
                f"{self.prefix}state": "lent",
                f"{self.prefix}holder": None,
                f"{self.prefix}lent-gpus": ",".join(expected.gpus),
                f"{self.prefix}expected": ", ".join(
                    f"{n} {r}" for r, n in sorted(expected.resources.items())) or None,
                f"{self.prefix}gpu-holders": None,
                f"{self.prefix}cordoned-for": None,
            }, labels=labels, add_taints=self.taints)
            self._remember_cordon(False)
            self.ahead = None
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
            if (wrong_boot := await self._this_boot(None)) is not None:
                return wrong_boot
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
