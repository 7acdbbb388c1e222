"""The drain, as ``kubectl drain`` does it (k8s.io/kubectl/pkg/drain, drain.go and
filters.go): a plan without side effects (`plan_drain`), then the evictions.

Drain, in kubectl's order of filters: a pod already terminating is waited for; a
DaemonSet's pod is left alone (its controller would put it right back); a mirror pod
(a static pod's reflection) is skipped; a pod with an emptyDir volume needs
``emptydir_ok`` and a pod no controller will re-create needs ``unmanaged_ok`` — a pod
refused for either is named in the report and left behind; a completed pod goes
without either check. Evictions go through policy/v1 Eviction with the pod's UID as a
precondition (a StatefulSet re-creates a pod under the same name); 429 (a
PodDisruptionBudget) is retried every `Timing.evict_retry` seconds; 404, 409 or a new
UID means the pod is gone; 500 naming PodDisruptionBudget means more than one budget
selects the pod, which no retry fixes. Then each evicted pod is followed until it is
gone: read again each `Timing.delete_poll` seconds as kubectl does, and at once when a
watch on the node's pods sees one deleted (the read still decides). All of it is
bounded by the drain's timeout; what is left when it runs out is in the `DrainReport`,
and ``on_timeout`` decides: "proceed" returns the report, "abort" raises
`DrainAborted` — at once, before any eviction, when pods are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp

from hostagent.cluster import lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.client.rest import RESTResponse

from hostagent.host import journal
from hostagent.core.config import DrainTimeoutAction
from hostagent.core.levers import eviction_grace
from hostagent.cluster.client import (
    Client,
    KubeError,
    KubeRequestError,
    KubeUnavailable,
    _count,
    _describe,
    _eviction_transient,
    _malformed,
    _pod,
    _raise_auth_error,
)

log = logging.getLogger("hostagent.cluster.kube")


MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


class DrainAborted(KubeError):
    """The drain did not finish and the policy is to abort; `report` says what is left."""

    def __init__(self, report: DrainReport) -> None:
        super().__init__(report.summary())
        self.report = report


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class PodRef:
    """One pod, by name and UID: a pod re-created under the same name is another pod."""

    namespace: str
    name: str
    uid: str = field(compare=False, default="")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class Ignored(enum.StrEnum):
    """Pods a drain leaves on the node on purpose."""

    DAEMONSET = "daemonset"  # its controller would put it right back
    MIRROR = "mirror"  # a static pod's reflection; the kubelet owns it
    # Deleted longer ago than skip_wait_for_delete_timeout: on a node whose kubelet is
    # gone it stays Terminating forever (kubectl drain --skip-wait-for-delete-timeout).
    STUCK_TERMINATING = "stuck-terminating"


class LeftReason(enum.StrEnum):
    """Why a pod that should have gone is still on the node."""

    EMPTYDIR = "emptydir"  # uses emptyDir and emptydir_ok was false
    UNMANAGED = "unmanaged"  # no controller and unmanaged_ok was false
    PDB_BLOCKED = "pdb-blocked"  # a PodDisruptionBudget refused until the deadline
    PDB_MISCONFIGURED = "pdb-misconfigured"  # more than one budget selects it
    TERMINATING = "terminating"  # evicted (or deleting) but not gone by the deadline
    API_UNREACHABLE = "api-unreachable"
    REFUSED = "refused"  # the API server refused its eviction for another reason


@dataclass(frozen=True)
class LeftPod:
    pod: PodRef
    reason: LeftReason
    detail: str

    def __str__(self) -> str:
        return f"{self.pod} ({self.detail})"


@dataclass(frozen=True, kw_only=True)
class DrainReport:
    """What a drain did: pods gone, pods left alone on purpose, pods left behind and why."""

    node: str
    evicted: tuple[PodRef, ...] = ()  # evicted by this drain, and gone
    waited: tuple[PodRef, ...] = ()  # were already terminating, and are gone
    # Evicted or waited for, and counted as gone: their deletion is more than
    # skip_wait_for_delete_timeout in the past and no kubelet confirmed it.
    abandoned: tuple[PodRef, ...] = ()
    ignored: tuple[tuple[PodRef, Ignored], ...] = ()
    left: tuple[LeftPod, ...] = ()
    error: str = ""  # why the node's pods could not even be listed
    duration: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.left and not self.error

    def summary(self) -> str:
        seconds = f"{self.duration:.0f} s" if self.duration >= 1 else f"{self.duration:.1f} s"
        if self.error:
            return f"could not drain {self.node} within {seconds}: {self.error}"
        gone = f"{_count(len(self.evicted), 'pod')} evicted"
        stuck = self.abandoned + tuple(p for p, why in self.ignored
                                       if why is Ignored.STUCK_TERMINATING)
        if stuck:
            gone += (f", {len(stuck)} stuck Terminating counted as gone "
                     f"({', '.join(str(p) for p in stuck)})")
        if self.complete:
            return f"drained {self.node} in {seconds}: {gone}"
        left = "; ".join(str(p) for p in self.left)
        return (
            f"{self.node} not fully drained after {seconds}: {gone}, "
            f"{len(self.left)} left behind: {left}"
        )


    # A watch still open `request_timeout` after the server was to end it is taken for a
    # half-open connection (an API host rebooted, an address moved, a NAT entry
    # dropped): nothing would ever come on it. It is given up, and the list read again.


# --- the drain plan (no side effects) --------------------------------------------------


@dataclass(frozen=True)
class PodInfo:
    """What the drain needs to know about a pod."""

    ref: PodRef
    phase: str = "Running"
    deleting: bool = False
    controller: str | None = None  # the controller's kind, e.g. "ReplicaSet"
    mirror: bool = False
    emptydir: bool = False
    deleted_at: datetime | None = None  # metadata.deletionTimestamp: when its grace ends
    grace: float | None = None  # spec.terminationGracePeriodSeconds (None: the API's 30 s)

    @classmethod
    def from_api(cls, pod: Any) -> PodInfo:
        meta, spec, status = pod.metadata, pod.spec, pod.status
        owner = next((r for r in meta.owner_references or [] if r.controller), None)
        return cls(
            ref=PodRef(meta.namespace, meta.name, meta.uid),
            phase=(status.phase if status is not None else None) or "",
            deleting=meta.deletion_timestamp is not None,
            controller=owner.kind if owner is not None else None,
            mirror=MIRROR_ANNOTATION in (meta.annotations or {}),
            emptydir=any(v.empty_dir is not None for v in (spec.volumes if spec else None) or []),
            deleted_at=meta.deletion_timestamp,
            grace=spec.termination_grace_period_seconds if spec else None,
        )


def _of(value: Any, kind: type, what: str) -> Any:
    """`value` if it is a `kind`; else TypeError (a reply of another shape)."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} is not a {kind.__name__}")
    return value


def _pod_from_json(pod: Any) -> PodInfo:
    """`PodInfo.from_api` of a pod as JSON: the fields the drain reads, each checked."""
    _of(pod, dict, "a pod")
    meta = _of(pod.get("metadata"), dict, "its metadata")
    spec = _of(pod.get("spec") or {}, dict, "its spec")
    status = _of(pod.get("status") or {}, dict, "its status")
    owners = _of(meta.get("ownerReferences") or [], list, "its owners")
    owner = next((r for r in owners if isinstance(r, dict) and r.get("controller") is True),
                 None)
    deleted = meta.get("deletionTimestamp")
    grace = spec.get("terminationGracePeriodSeconds")
    phase = status.get("phase")
    return PodInfo(
        ref=PodRef(_of(meta.get("namespace"), str, "its namespace"),
                   _of(meta.get("name"), str, "its name"), _of(meta.get("uid", ""), str, "uid")),
        phase=phase if isinstance(phase, str) else "",
        deleting=deleted is not None,
        controller=_of(owner.get("kind"), str, "an owner's kind") if owner else None,
        mirror=MIRROR_ANNOTATION in _of(meta.get("annotations") or {}, dict, "annotations"),
        emptydir=any(_of(v, dict, "a volume").get("emptyDir") is not None
                     for v in _of(spec.get("volumes") or [], list, "its volumes")),
        deleted_at=None if deleted is None else datetime.fromisoformat(
            _of(deleted, str, "its deletion time")),
        grace=float(grace) if isinstance(grace, int) and not isinstance(grace, bool) else None,
    )


@dataclass(frozen=True)
class DrainPlan:
    evict: tuple[PodRef, ...] = ()
    wait: tuple[PodRef, ...] = ()
    ignored: tuple[tuple[PodRef, Ignored], ...] = ()
    refused: tuple[LeftPod, ...] = ()


def stuck_terminating(deleted_at: datetime | None, skip_after: float, now: datetime) -> bool:
    """kubectl's shouldSkipPod: deleted more than `skip_after` whole seconds ago (0: never)."""
    return (skip_after > 0 and deleted_at is not None
            and int((now - deleted_at).total_seconds()) > skip_after)


def plan_drain(pods: Iterable[PodInfo], *, emptydir_ok: bool, unmanaged_ok: bool,
               skip_after: float = 0.0, now: datetime | None = None) -> DrainPlan:
    """Sort a node's pods the way kubectl drain's filters do, in their order. No side effects.

    `skip_after` > 0: a pod whose deletion is more than that many seconds past (`now`)
    is left alone as gone, as kubectl's skip-wait-for-delete-timeout does."""
    now = now or datetime.now(UTC)
    evict: list[PodRef] = []
    wait: list[PodRef] = []
    ignored: list[tuple[PodRef, Ignored]] = []
    refused: list[LeftPod] = []
    for pod in sorted(pods, key=lambda p: p.ref):
        completed = pod.phase in ("Succeeded", "Failed")
        if pod.deleting and stuck_terminating(pod.deleted_at, skip_after, now):
            ignored.append((pod.ref, Ignored.STUCK_TERMINATING))
        elif pod.deleting:
            wait.append(pod.ref)
        elif pod.controller == "DaemonSet":
            ignored.append((pod.ref, Ignored.DAEMONSET))
        elif pod.mirror:
            ignored.append((pod.ref, Ignored.MIRROR))
        elif pod.emptydir and not emptydir_ok and not completed:
            refused.append(
                LeftPod(
                    pod.ref, LeftReason.EMPTYDIR, "uses an emptyDir volume; drain_emptydir = false"
                )
            )
        elif pod.controller is None and not unmanaged_ok and not completed:
            refused.append(
                LeftPod(
                    pod.ref,
                    LeftReason.UNMANAGED,
                    "no controller would re-create it; drain_unmanaged = false",
                )
            )
        else:
            evict.append(pod.ref)
    return DrainPlan(tuple(evict), tuple(wait), tuple(ignored), tuple(refused))


class Drains(Client):
    """The drain of a node, as kubectl's."""

    last_drain: DrainReport | None = None  # what the last drain did, for status

    # --- the drain -----------------------------------------------------------------------

    async def drain(
        self,
        node: str,
        *,
        timeout: float,
        emptydir_ok: bool,
        unmanaged_ok: bool,
        on_timeout: DrainTimeoutAction,
        grace_period: float | None = None,
        skip_wait_for_delete_timeout: float = 0.0,
        only: Collection[str] | None = None,
        grace_cap: float | None = None,
        accepted: Callable[[], None] | None = None,
    ) -> DrainReport:
        """Evict the node's pods like ``kubectl drain`` (see the module docstring).

        `grace_period`: given to each evicted pod instead of its own (``--grace-period``).
        `grace_cap`: no evicted pod gets longer than this (`levers.eviction_grace`).
        `accepted`: called once, when every eviction of the plan was accepted (or its pod
        found gone) and every other pod it waits for is being deleted already: from
        then on nothing the drain does can keep a pod (an incomplete drain never calls it).
        `skip_wait_for_delete_timeout` > 0: a pod whose deletion is that many seconds in
        the past counts as gone (``--skip-wait-for-delete-timeout``): on a node whose
        kubelet is unreachable, a Terminating pod never goes, and must not hold a
        reclaim for the whole timeout. `only`: the UIDs of the pods to evict (a
        hot-unplug's, those using its GPU), the node's others left alone. Raises
        KubeAuthError on 401/403 whatever `on_timeout` says: a drain that is not allowed
        is not an incomplete one."""
        start = self._now()
        deadline = start + timeout
        try:
            version, listed = await self._call(
                f"list the pods on {node}", lambda: self._list_pods(node), deadline)
        except (KubeUnavailable, KubeRequestError) as e:
            return self._finish(
                DrainReport(node=node, error=str(e), duration=self._now() - start), on_timeout
            )
        infos = [i for i in listed if only is None or i.ref.uid in only]
        graces = {i.ref: eviction_grace(i.grace, override=grace_period, cap=grace_cap)
                  for i in infos}
        plan = plan_drain(
            infos,
            emptydir_ok=emptydir_ok,
            unmanaged_ok=unmanaged_ok,
            skip_after=skip_wait_for_delete_timeout,
        )
        if plan.refused and on_timeout is DrainTimeoutAction.ABORT:
            # Like kubectl: refuse before evicting anything, rather than half-drain and stop.
            report = DrainReport(
                node=node, ignored=plan.ignored, left=plan.refused, duration=self._now() - start
            )
            return self._finish(report, on_timeout)
        deletions = _Deletions()
        accepting = _Accepting(len(plan.evict), accepted)
        follower: asyncio.Task[None] | None = None
        try:
            async with asyncio.TaskGroup() as group:
                evictions = [
                    group.create_task(self._evict(pod, deadline, deletions, graces.get(pod),
                                                  skip_wait_for_delete_timeout, accepting))
                    for pod in plan.evict
                ]
                waits = [
                    group.create_task(self._wait_gone(pod, deadline, deletions, evicted=False,
                                                      skip_after=skip_wait_for_delete_timeout))
                    for pod in plan.wait
                ]
                # After the evictions, which go first; from the list's resourceVersion,
                # so that no deletion since is missed.
                follower = asyncio.create_task(
                    self._follow_deletions(node, version, deletions,
                                           deadline)
                )
        except ExceptionGroup as group_error:
            _raise_auth_error(group_error)
            raise
        finally:
            if follower is not None:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
        left = [*plan.refused]
        evicted: list[PodRef] = []
        waited: list[PodRef] = []
        abandoned: list[PodRef] = []
        for refs, tasks, gone in ((plan.evict, evictions, evicted), (plan.wait, waits, waited)):
            for pod, task in zip(refs, tasks, strict=True):
                outcome = task.result()
                if outcome is None:
                    gone.append(pod)
                elif outcome is _STUCK:
                    abandoned.append(pod)
                else:
                    left.append(outcome)
        report = DrainReport(
            node=node,
            evicted=tuple(evicted),
            waited=tuple(waited),
            abandoned=tuple(abandoned),
            ignored=plan.ignored,
            left=tuple(sorted(left, key=lambda p: p.pod)),
            duration=self._now() - start,
        )
        return self._finish(report, on_timeout)

    async def _list_pods(self, node: str) -> tuple[str | None, list[PodInfo]]:
        """The pods on `node` and the list's resourceVersion, read from the answer's JSON
        (`_pod_from_json`) rather than the client's model: the list is on a player's
        path, and the model takes a millisecond or two a pod on a small CPU (a real
        node runs tens). A reply of another shape raises what `Client._call` retries."""
        reply: aiohttp.ClientResponse = await self._core.list_pod_for_all_namespaces(  # type: ignore[assignment]
            field_selector=f"spec.nodeName={node}", _preload_content=False)
        async with reply:
            data = await reply.read()
        if not 200 <= reply.status <= 299:
            raise ApiException(http_resp=RESTResponse(reply, data))  # type: ignore[arg-type]
        body = json.loads(data)
        items, meta = body["items"], body.get("metadata") or {}
        if not isinstance(items, list) or not isinstance(meta, dict):
            raise TypeError("not a list of pods")
        version = meta.get("resourceVersion")
        return version if isinstance(version, str) else None, [
            _pod_from_json(p) for p in items]

    def _finish(self, report: DrainReport, on_timeout: DrainTimeoutAction) -> DrainReport:
        self.last_drain = report
        abort = not report.complete and on_timeout is DrainTimeoutAction.ABORT
        result = "ok" if report.complete else "aborted" if abort else "incomplete"
        journal.record(
            "drain",
            report.summary(),
            duration_ms=report.duration * 1000,
            result=result,
            priority=journal.Priority.INFO if report.complete else journal.Priority.WARNING,
            node=report.node,
            evicted=len(report.evicted),
            left=", ".join(str(p.pod) for p in report.left) or None,
            abandoned=", ".join(str(p) for p in report.abandoned) or None,
        )
        if abort:
            raise DrainAborted(report)
        return report

    async def _follow_deletions(
        self, node: str, resource_version: str | None, deletions: _Deletions, deadline: float
    ) -> None:
        """Tell `deletions` of each pod deleted on `node`, by watch, until cancelled.

        Only a wake-up for `_wait_gone`: whether a pod is gone is still read from the
        API, so a watch that fails or misses an event costs at most `delete_poll`.
        """
        while self._now() < deadline:
            remaining = deadline - self._now()
            since = {"resource_version": resource_version} if resource_version else {}
            try:
                seconds = max(1, math.ceil(min(remaining, self.timing.watch_timeout)))
                async with asyncio.timeout(remaining), k8s_watch.Watch() as stream:
                    async for event in stream.stream(
                        self._core.list_pod_for_all_namespaces,
                        field_selector=f"spec.nodeName={node}",
                        timeout_seconds=seconds,
                        **since,
                    ):
                        resource_version = event["object"].metadata.resource_version
                        if event["type"] == "DELETED":
                            deletions.saw()
                continue  # the server ended the watch: resume from the last event
            except TimeoutError:
                return
            except (ApiException, aiohttp.ClientError, OSError, ValueError) as e:
                log.debug("watching the pods on %s: %s", node, _describe(e))
            except Exception as e:
                if not _malformed(e):
                    raise
                log.debug("watching the pods on %s: an event that could not be read", node)
            resource_version = None  # from now on: the reads catch what was missed
            await asyncio.sleep(max(0.0, min(self.timing.delete_poll, deadline - self._now())))

    async def _evict(self, pod: PodRef, deadline: float, deletions: _Deletions,
                     grace_period: float | None, skip_after: float,
                     accepting: _Accepting | None = None) -> LeftPod | None:
        """Evict one pod and wait until it is gone; None when it is, `_STUCK` when it
        counts as gone (see `drain`), else why not. `accepting` hears when its eviction
        is accepted, or the pod found gone."""
        accepting = accepting or _Accepting(1, None)
        body = k8s.V1Eviction(
            metadata=k8s.V1ObjectMeta(name=pod.name, namespace=pod.namespace),
            delete_options=k8s.V1DeleteOptions(
                preconditions=k8s.V1Preconditions(uid=pod.uid),
                grace_period_seconds=None if grace_period is None else math.ceil(grace_period),
            ),
        )
        why: LeftPod | None = None  # what kept the pod here at the last try
        while True:
            try:
                await self._call(
                    f"evict pod {pod}",
                    lambda: self._core.create_namespaced_pod_eviction(
                        pod.name, pod.namespace, body
                    ),
                    deadline,
                    transient=_eviction_transient,
                )
                accepting.one()
                break
            except KubeUnavailable as e:
                return why if why is not None and not e.last else self._unreachable(pod, e)
            except KubeRequestError as e:
                if e.status == 404:
                    accepting.one()
                    return None
                if e.status >= 500:
                    return LeftPod(
                        pod,
                        LeftReason.PDB_MISCONFIGURED,
                        "misconfigured PodDisruptionBudget: more than one "
                        f"PodDisruptionBudget selects pod {pod}",
                    )
                if e.status not in (409, 429):
                    return LeftPod(pod, LeftReason.REFUSED, str(e))
                why = self._refusal(pod, e)
            # 429: a budget says not now. 409: our UID precondition failed (another pod
            # has the name now) or a race. Either way: pause, look at the pod, try again.
            pause = self.timing.evict_retry if why.reason is LeftReason.PDB_BLOCKED else 0.0
            await asyncio.sleep(max(0.0, min(pause, deadline - self._now())))
            if self._now() >= deadline:
                return why
            try:
                if await self._gone(pod, deadline, 0.0) is not None:
                    accepting.one()
                    return None
            except KubeRequestError as e:
                return LeftPod(pod, LeftReason.REFUSED, str(e))
            except KubeUnavailable as e:
                return self._unreachable(pod, e) if e.last else why
        return await self._wait_gone(pod, deadline, deletions, evicted=True,
                                     skip_after=skip_after)

    def _refusal(self, pod: PodRef, e: KubeRequestError) -> LeftPod:
        if e.status != 429:
            return LeftPod(pod, LeftReason.REFUSED, str(e))
        blocked = "; ".join(e.causes) or str(e)
        log.info("eviction of %s refused for now (%s); retrying", pod, blocked)
        return LeftPod(
            pod, LeftReason.PDB_BLOCKED, f"a PodDisruptionBudget blocks its eviction: {blocked}"
        )

    @staticmethod
    def _unreachable(pod: PodRef, e: KubeUnavailable) -> LeftPod:
        return LeftPod(pod, LeftReason.API_UNREACHABLE, str(e))

    async def _gone(self, pod: PodRef, deadline: float, skip_after: float) -> LeftPod | None:
        """None while the pod is there; `_GONE` once it is (404, or another pod under its
        name); `_STUCK` if its deletion is more than `skip_after` seconds past (> 0)."""
        try:
            current = await self._call(
                f"read pod {pod}",
                # self._core at each try: a refresh of the credentials replaces it
                lambda: self._core.read_namespaced_pod(pod.name, pod.namespace),
                deadline,
                readable=_pod,
            )
        except KubeRequestError as e:
            if e.status == 404:
                return _GONE
            raise
        if current.metadata.uid != pod.uid:
            return _GONE
        if stuck_terminating(current.metadata.deletion_timestamp, skip_after, datetime.now(UTC)):
            log.warning("pod %s was deleted at %s and is still Terminating (no kubelet "
                        "confirmed it): counted as gone", pod, current.metadata.deletion_timestamp)
            return _STUCK
        return None

    async def _wait_gone(
        self, pod: PodRef, deadline: float, deletions: _Deletions, *, evicted: bool,
        skip_after: float = 0.0,
    ) -> LeftPod | None:
        still = LeftPod(
            pod,
            LeftReason.TERMINATING,
            "evicted but still terminating" if evicted else "still terminating",
        )
        while self._now() < deadline:
            seen = deletions.count
            try:
                gone = await self._gone(pod, deadline, skip_after)
                if gone is not None:
                    return None if gone is _GONE else gone
            except KubeRequestError as e:
                return LeftPod(pod, LeftReason.REFUSED, str(e))
            except KubeUnavailable as e:
                return self._unreachable(pod, e) if e.last else still
            pause = max(0.0, min(self.timing.delete_poll, deadline - self._now()))
            await deletions.wait(seen, pause)
        return still


# What `_gone` answers: the pod went, or counts as gone (stuck Terminating).
_GONE = LeftPod(PodRef("", ""), LeftReason.TERMINATING, "gone")


_STUCK = LeftPod(PodRef("", ""), LeftReason.TERMINATING, "stuck terminating: counted as gone")


class _Accepting:
    """Counts a drain's evictions accepted; calls `then` once all `needed` were."""

    def __init__(self, needed: int, then: Callable[[], None] | None) -> None:
        self.left, self.then = needed, then
        self.check()

    def one(self) -> None:
        self.left -= 1
        self.check()

    def check(self) -> None:
        if self.left <= 0 and self.then is not None:
            then, self.then = self.then, None
            then()


class _Deletions:
    """The pod deletions a drain's watch has seen; `wait` returns at the next one."""

    def __init__(self) -> None:
        self.count = 0
        self._next = asyncio.Event()

    def saw(self) -> None:
        self.count += 1
        self._next.set()  # wakes whoever waits on this one; later waiters get a new one
        self._next = asyncio.Event()

    async def wait(self, since: int, timeout: float) -> None:
        """Return after `timeout` seconds, or as soon as a deletion after the `since`th."""
        if self.count != since:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._next.wait(), timeout)
