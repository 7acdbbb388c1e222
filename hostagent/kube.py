"""Kubernetes for the lendee's node: cordon, drain, wait for Ready and GPUs, uncordon.

Taking the GPUs from a worker without draining it kills workloads mid-step; giving them
back without checking leaves a node that says Ready and runs nothing. This module does
both halves the way the cluster expects: it drains like ``kubectl drain``
(k8s.io/kubectl/pkg/drain), remembers on the Node whether *it* cordoned (so an
administrator's cordon is never lifted), and waits with watches, not polling loops.

It is the only module that imports kubernetes-asyncio. Library errors are translated
here, once, into this tree (``raise … from e``)::

    KubeError
    ├── KubeConfigError    the kubeconfig is missing, unreadable or unusable (startup)
    ├── NodeNotFound       no Node of that name in the cluster
    ├── KubeUnavailable    the API server stayed unreachable, or answered 5xx, until
    │                      the step's deadline (retried with backoff and jitter before)
    ├── KubeRequestError   the API server refused a request (4xx); .status, .reason
    ├── KubeAuthError      401 or 403: the credentials are wrong, expired or lack a
    │                      right (a 401 is retried once with credentials read afresh:
    │                      a rotated k3s client certificate, an exec plugin's new token)
    ├── NodeNotReady       the node was not Ready by wait_ready's deadline
    └── DrainAborted       the drain did not finish and on_timeout is "abort"; .report

The adapter holds no policy: which pods may be evicted, how long each step may take
and what to do when a drain does not finish are arguments, taken from the
configuration by the caller.

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
import os
import random
import re
import socket
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from functools import partial
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from hostagent import k8s_lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from hostagent import dra, journal
from hostagent.config import DrainTimeoutAction
from hostagent.config import Kubernetes as KubernetesConfig
from hostagent.text import clean

__all__ = [
    "MARKER_VALUE",
    "CordonResult",
    "DrainAborted",
    "DrainPlan",
    "DrainReport",
    "ExpectedGpus",
    "Ignored",
    "Kube",
    "KubeAuthError",
    "KubeConfigError",
    "KubeError",
    "KubeRequestError",
    "KubeUnavailable",
    "LeftPod",
    "LeftReason",
    "NodeNotFound",
    "NodeCheck",
    "NodeView",
    "NodeNotReady",
    "PodInfo",
    "PodRef",
    "Taint",
    "Timing",
    "cordon_marker",
    "expected_gpus",
    "plan_drain",
    "requests_gpu",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

MARKER_VALUE = "hostagent"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
MERGE_PATCH = "application/merge-patch+json"


def cordon_marker(prefix: str) -> str:
    """The annotation that says hostagent cordoned the node, e.g. hostagent.io/cordoned-by."""
    return f"{prefix}cordoned-by"


def _cordoned_at(prefix: str) -> str:
    return f"{prefix}cordoned-at"


# --- errors ----------------------------------------------------------------------------


class KubeError(Exception):
    """Something about the cluster that hostagent could not do; the message says what."""


class KubeConfigError(KubeError):
    """The kubeconfig is missing, unreadable or unusable: the agent cannot start."""


class NodeNotFound(KubeError):
    """The node named in the configuration is not in the cluster."""


class KubeUnavailable(KubeError):
    """The API server did not answer usefully before the deadline.

    `last` is the last error seen; empty when nothing failed and time simply ran out.
    """

    def __init__(self, message: str, *, last: str = "") -> None:
        super().__init__(message)
        self.last = last


class KubeRequestError(KubeError):
    """The API server refused a request; `status` is the HTTP code, `reason` the Status reason."""

    def __init__(
        self, message: str, *, status: int, reason: str, causes: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.causes = tuple(causes)


class KubeAuthError(KubeError):
    """401 or 403: not an outage. Retrying will not help and nothing may be skipped
    because of it: the caller must stop and say so. `status` is the HTTP code."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class NodeNotReady(KubeError):
    """The node did not become Ready before the deadline."""


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


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """What `Kube.watch_node` last saw of a lent node. `gpu_pods`: pods on it that
    request a GPU, None until they were listed."""

    node: str
    exists: bool = True
    ready: bool = False
    ready_detail: str = ""
    allocatable: Mapping[str, int] = field(default_factory=dict)
    gpu_pods: int | None = None
    # DRA (watched with a driver): the UUIDs in the node's ResourceSlices, None until
    # listed; and which pods ("ns/name") hold each, from the ResourceClaims.
    devices: frozenset[str] | None = None
    holders: Mapping[str, str] = field(default_factory=dict)


def requests_gpu(pod: Any, resources: Collection[str] = ("nvidia.com/gpu",)) -> bool:
    """Whether any container of `pod` requests or limits one of `resources` or any
    NVIDIA GPU resource (``nvidia.com/gpu*``, ``nvidia.com/mig-*``). No side effects."""
    spec = pod.spec
    containers = [*(spec.containers or []), *(spec.init_containers or [])] if spec else []
    for container in containers:
        needs = container.resources
        for amounts in (needs.requests, needs.limits) if needs is not None else ():
            for name, amount in (amounts or {}).items():
                wanted = name in resources or name.startswith(("nvidia.com/gpu",
                                                               "nvidia.com/mig-"))
                if wanted and str(amount) not in ("0", ""):
                    return True
    return False


@dataclass(frozen=True, kw_only=True)
class NodeCheck:
    """`Kube.check_node`'s answer."""

    node: str
    exists: bool
    ready: bool = False
    unschedulable: bool = False
    detail: str = ""

    def __str__(self) -> str:
        if not self.exists:
            return (f"node {self.node} is not in the cluster; it registers when the "
                    "lendee's kubelet starts")
        state = "Ready" if self.ready else f"not Ready ({self.detail or 'no Ready condition'})"
        return f"node {self.node} is {state}" + (", cordoned" if self.unschedulable else "")


@dataclass(frozen=True)
class CordonResult:
    """What `cordon` found and did. Keep `cordoned_by_us` in the state file too."""

    node: str
    cordoned_by_us: bool  # our marker is on the node: `uncordon` will lift the cordon
    was_cordoned: bool  # the node was already unschedulable before this call

    @property
    def by_someone_else(self) -> bool:
        return self.was_cordoned and not self.cordoned_by_us


@dataclass(frozen=True)
class Taint:
    """A node taint; two taints are the same taint when key and effect match, as in kubectl."""

    key: str
    effect: str = "NoSchedule"
    value: str = ""

    def body(self) -> dict[str, str]:
        return {
            "key": self.key,
            "effect": self.effect,
            **({"value": self.value} if self.value else {}),
        }


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How long to wait between tries, in seconds; tests shrink these."""

    request_timeout: float = 30.0  # one HTTP request
    api_timeout: float = 60.0  # cordon, uncordon, annotate, check_node, unless given one
    backoff_min: float = 0.5  # first retry after an unreachable API or a 5xx
    backoff_max: float = 15.0
    evict_retry: float = 5.0  # kubectl drain retries a 429 every 5 s
    delete_poll: float = 1.0  # kubectl drain checks each second whether a pod is gone
    # (here also woken at once by a watch on the node's pods: see Kube.drain)
    watch_timeout: float = 60.0  # ask the server to end each watch; we re-read and resume
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


# --- what a lend must show (no side effects) ------------------------------------------

# GPU Feature Discovery's labels (NVIDIA gpu-feature-discovery, also in the GPU operator).
GFD_COUNT = "nvidia.com/gpu.count"
GFD_REPLICAS = "nvidia.com/gpu.replicas"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MIG_STRATEGY = "nvidia.com/mig.strategy"
_GFD_MIG_COUNT = re.compile(r"nvidia\.com/(mig-[^/]+)\.count")


@dataclass(frozen=True)
class ExpectedGpus:
    """What the node must report allocatable once its lent GPUs are schedulable.

    `resources`: resource name → total count (exact: a count left over from a bigger
    lend is not this one); `gpus`: the lent GPUs' labels; `how`: where the numbers come
    from, for the journal and `status`.
    """

    gpus: tuple[str, ...]
    resources: Mapping[str, int]
    how: str

    def __str__(self) -> str:
        wanted = ", ".join(f"{n} {r}" for r, n in sorted(self.resources.items()))
        return f"{wanted} ({self.how})" if wanted else self.how

    def found(self, node: Any) -> dict[str, int]:
        """The node's allocatable count of each expected resource."""
        return {r: _gpus(node, r) for r in self.resources}

    def met_by(self, found: Mapping[str, int]) -> bool:
        return all(found.get(r, 0) == n for r, n in self.resources.items())

    def shortfall(self, found: Mapping[str, int]) -> str:
        """"reports 2 allocatable nvidia.com/gpu where 4 were lent; ..." for each resource
        that differs."""
        return "; ".join(f"reports {found.get(r, 0)} allocatable {r} where {n} were lent"
                         for r, n in sorted(self.resources.items()) if found.get(r, 0) != n)


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        value = int(labels.get(key, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def expected_gpus(
    lent: Iterable[str],
    *,
    labels: Mapping[str, str],
    resource: str = "nvidia.com/gpu",
    override: Mapping[str, int] | None = None,
    labelled_gpus: int | None = None,
    capacity: Mapping[str, str] | None = None,
) -> ExpectedGpus:
    """What `lent` GPUs make allocatable, decided once per lend. No side effects.

    In order: `override` (``[kubernetes] expected``, counts per lent GPU); MIG as
    GPU Feature Discovery labels it (``nvidia.com/mig.strategy``: "mixed", one
    ``nvidia.com/mig-<profile>`` resource per profile; "single", ``nvidia.com/gpu``
    counting MIG devices); time-slicing (``nvidia.com/gpu.replicas`` per GPU, the
    resource renamed ``<resource>.shared`` when the product label says ``-SHARED``);
    else one `resource` per GPU. GFD labels count every GPU the node had when they
    were written: `labelled_gpus` is that number (hostagent's own annotation of the
    previous lend names those GPUs), else ``nvidia.com/gpu.count`` for mixed MIG, else
    the lent count. MIG counts are per GPU, so this assumes the lent GPUs are
    partitioned alike; where they are not, set the override. Without GFD, the MIG
    resources in the node's `capacity` (the device plugin's, as the last lend of
    `labelled_gpus` GPUs left them) give the counts per GPU.
    """
    gpus = tuple(sorted(set(lent)))
    n = len(gpus)
    what = _count(n, "GPU")
    if override:
        per = ", ".join(f"{c} {r}" for r, c in sorted(override.items()))
        return ExpectedGpus(gpus, {r: c * n for r, c in override.items()},
                            f"{what} × {per} per GPU, from kubernetes.expected")
    strategy = labels.get(GFD_MIG_STRATEGY, "")
    if strategy == "mixed":
        profiles = {m[1]: int(v) for k, v in labels.items()
                    if (m := _GFD_MIG_COUNT.fullmatch(k)) and v.isdigit() and int(v) > 0}
        physical = labelled_gpus or _label_int(labels, GFD_COUNT) or n
        per_gpu = {f"nvidia.com/{p}": c // physical for p, c in profiles.items()
                   if c // physical > 0}
        if per_gpu:
            per = ", ".join(f"{c} {r}" for r, c in sorted(per_gpu.items()))
            return ExpectedGpus(gpus, {r: c * n for r, c in per_gpu.items()},
                                f"{what} × {per} per GPU, from the MIG labels (mixed strategy)")
    if not strategy and labelled_gpus and capacity:
        mig = {r: int(v) // labelled_gpus for r, v in capacity.items()
               if r.startswith("nvidia.com/mig-") and str(v).isdigit()
               and int(v) // labelled_gpus > 0}
        if mig:
            per = ", ".join(f"{c} {r}" for r, c in sorted(mig.items()))
            return ExpectedGpus(gpus, {r: c * n for r, c in mig.items()},
                                f"{what} × {per} per GPU, from the node's MIG resources")
    devices = _label_int(labels, GFD_COUNT)
    if strategy == "single" and devices is not None:
        per_gpu_devices = max(1, devices // (labelled_gpus or n or 1))
        return ExpectedGpus(gpus, {resource: per_gpu_devices * n},
                            f"{what} × {per_gpu_devices} MIG devices per GPU, from the MIG "
                            "labels (single strategy)")
    replicas = _label_int(labels, GFD_REPLICAS)
    if replicas is not None and replicas > 1:
        name = f"{resource}.shared" if labels.get(GFD_PRODUCT, "").endswith("-SHARED") \
            else resource
        return ExpectedGpus(gpus, {name: replicas * n},
                            f"{what} × {replicas} time-slicing replicas, from the node's "
                            "GPU Feature Discovery labels")
    return ExpectedGpus(gpus, {resource: n}, f"{what}, one {resource} each")


# --- reading API objects ---------------------------------------------------------------


def _annotations(node: Any) -> dict[str, str]:
    return dict(node.metadata.annotations or {})


def _unschedulable(node: Any) -> bool:
    return bool(node.spec is not None and node.spec.unschedulable)


def _ready(node: Any) -> Any | None:
    conditions = node.status.conditions if node.status is not None else None
    return next((c for c in conditions or [] if c.type == "Ready"), None)


def _is_ready(node: Any) -> bool:
    condition = _ready(node)
    return condition is not None and condition.status == "True"


def _gpus(node: Any, resource: str) -> int:
    allocatable = (node.status.allocatable if node.status is not None else None) or {}
    try:
        return int(allocatable.get(resource, "0"))
    except ValueError:
        return 0  # extended resources are whole numbers; anything else counts for nothing


def _status_of(e: ApiException) -> tuple[str, str, list[str]]:
    """(reason, message, cause messages) from the Status body of an error answer.

    The body is whatever the server (or a proxy before it) sent: each field is taken
    only where it has the type a Status gives it, and ignored otherwise."""
    try:
        body = json.loads(e.body or b"{}")
    except (ValueError, TypeError, RecursionError):
        body = None
    body = body if isinstance(body, dict) else {}
    details = body.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    fallback = e.reason if isinstance(e.reason, str) else ""
    return (
        clean(_string(body.get("reason")) or fallback, 200),
        clean(_string(body.get("message")) or fallback),
        [clean(_string(c.get("message"))) for c in causes[:20] if isinstance(c, dict)]
        if isinstance(causes, list) else [],
    )


def _string(value: object) -> str:
    return value if isinstance(value, str) else ""


class _Unreadable(Exception):
    """A reply of a shape the client or the adapter cannot read."""


# What the client's parsing raises on a reply of the wrong shape: a list where an
# object belongs, a required field missing, a body that is not JSON or not UTF-8.
_PARSING = (ValueError, TypeError, AttributeError, KeyError, RecursionError)


async def _parsed(request: Callable[[], Awaitable[T]], readable: Callable[[Any], bool]) -> T:
    """`request()`'s object; _Unreadable when it cannot be read."""
    try:
        result = await request()
    except (ApiException, aiohttp.ClientError, OSError):
        raise
    except _PARSING as e:
        # An error answer whose body is not UTF-8 fails inside the client's own handler
        # of that answer: the answer still stands.
        if isinstance(e.__context__, ApiException):
            raise e.__context__ from None
        raise _Unreadable(f"a reply that could not be read ({type(e).__name__}: "
                          f"{clean(e, 200)})") from e
    try:
        ok = readable(result)
    except _PARSING:
        ok = False
    if not ok:
        raise _Unreadable(f"a reply that is not what was asked for ({type(result).__name__})")
    return result


def _malformed(e: BaseException) -> bool:
    """A watch event that could not be read: the client's parsing errors, and the bare
    Exception kubernetes-asyncio raises for an event without a type or an object."""
    return isinstance(e, _PARSING) or type(e) is Exception


def _listed(reply: Any) -> bool:
    return getattr(reply, "metadata", None) is not None and isinstance(
        getattr(reply, "items", None), list)


def _node(reply: Any) -> bool:
    return isinstance(reply, k8s.V1Node) and reply.metadata is not None


def _pod(reply: Any) -> bool:  # named: its eviction and reads go by name
    return (isinstance(reply, k8s.V1Pod) and reply.metadata is not None
            and isinstance(reply.metadata.name, str) and isinstance(reply.metadata.namespace, str))


def _pods(reply: Any) -> bool:
    return isinstance(reply, k8s.V1PodList) and all(_pod(p) for p in reply.items)


def _transient(e: ApiException) -> bool:
    status = e.status or 0
    return status >= 500 or status == 429


def _eviction_transient(e: ApiException) -> bool:
    # 429 is a budget saying no, handled by the drain; a 500 about budgets is a
    # misconfiguration no retry fixes. Other 5xx are the API server's trouble.
    if (e.status or 0) < 500:
        return False
    _, message, _ = _status_of(e)
    return "PodDisruptionBudget" not in message


def _describe(e: BaseException) -> str:
    if isinstance(e, ApiException):
        reason, message, _ = _status_of(e)
        return f"{e.status} {reason}: {message}" if message else f"{e.status} {reason}"
    return clean(e) or type(e).__name__


_HOSTNAME = socket.gethostname()


def _timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _default_kubeconfig() -> Path:
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first) if first else Path.home() / ".kube" / "config"


# --- the adapter -----------------------------------------------------------------------


class Kube:
    """A connection to the cluster. Create it with `connect` (or `from_config`); close it."""

    def __init__(
        self,
        api_client: Any,
        *,
        timing: Timing | None = None,
        server: str = "",
        reload: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._api_client = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._resource = k8s.ResourceV1Api(api_client)
        self.timing = timing or Timing()
        self.server = server or str(getattr(api_client.configuration, "host", ""))
        # Reads the credentials again (a fresh kubernetes-asyncio Configuration): after
        # a 401, the kubeconfig's client certificate may have been rotated (k3s does it
        # yearly) or an exec plugin's token may have expired.
        self._reload = reload
        self._retired: list[Any] = []  # clients replaced by a reload, closed with ours
        self.last_drain: DrainReport | None = None  # what the last drain did, for status

    @classmethod
    async def connect(cls, kubeconfig: Path | None = None, *, timing: Timing | None = None) -> Kube:
        """Read `kubeconfig`; without one, the in-cluster service account or the default
        kubeconfig ($KUBECONFIG, ~/.kube/config). Raises KubeConfigError."""

        async def load() -> Any:
            configuration = k8s.Configuration()
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                try:
                    k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                except Exception as e:  # the library raises several kinds; all mean "unusable"
                    raise KubeConfigError(f"in-cluster Kubernetes configuration: {e}") from e
                return configuration
            path = kubeconfig if kubeconfig is not None else _default_kubeconfig()
            _check_readable(path, given=kubeconfig is not None)
            try:
                await k8s_config.load_kube_config(
                    config_file=str(path), client_configuration=configuration, persist_config=False
                )
            except Exception as e:  # yaml, ConfigException, KeyError...: all mean "unusable"
                raise KubeConfigError(f"kubeconfig {path}: not usable: {e}") from e
            return configuration

        configuration = await load()
        return cls(k8s.ApiClient(configuration), timing=timing, server=configuration.host or "",
                   reload=load)

    @classmethod
    async def from_config(cls, settings: KubernetesConfig, *, timing: Timing | None = None) -> Kube:
        return await cls.connect(settings.kubeconfig, timing=timing)

    async def close(self) -> None:
        for client in [*self._retired, self._api_client]:
            await client.close()
        self._retired.clear()

    async def _refresh_credentials(self) -> bool:
        """Read the credentials again and use them from now on; False if they cannot be."""
        if self._reload is None:
            return False
        try:
            configuration = await self._reload()
        except KubeConfigError as e:
            log.warning("could not read the Kubernetes credentials again: %s", e)
            return False
        self._retired.append(self._api_client)
        self._api_client = k8s.ApiClient(configuration)
        self._core = k8s.CoreV1Api(self._api_client)
        self._resource = k8s.ResourceV1Api(self._api_client)
        log.info("read the Kubernetes credentials again after a 401 from %s", self.server)
        return True

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests, with retries ----------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _deadline(self, timeout: float | None) -> float:
        return self._now() + (self.timing.api_timeout if timeout is None else timeout)

    def _watch_bound(self, seconds: float) -> float:
        """How long a watch the server was asked to end after `seconds` may stay open
        before it is taken for a half-open connection (see `Timing`)."""
        return seconds + self.timing.request_timeout

    def _backoff(self, attempt: int) -> float:
        # The exponent is bounded: 2.0**1024 overflows, and a request that fails at once
        # reaches that many attempts within a long deadline.
        ceiling = min(self.timing.backoff_max, self.timing.backoff_min * 2.0**min(attempt, 60))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: no retries in lockstep

    async def _call(
        self,
        what: str,
        request: Callable[[], Awaitable[T]],
        deadline: float,
        *,
        transient: Callable[[ApiException], bool] = _transient,
        readable: Callable[[Any], bool] = lambda _: True,
    ) -> T:
        """`request()`, retried while the API is unreachable or answers 5xx, until `deadline`.

        A reply the client cannot parse, or whose object `readable` refuses, counts as
        no answer (retried like a 5xx): the server, or a proxy before it, is not one
        whose word can be taken."""
        attempt = 0
        last = ""
        refreshed = False
        while True:
            remaining = deadline - self._now()
            if remaining <= 0:
                raise KubeUnavailable(
                    f"could not {what}: the API server at {self.server} did not answer in time"
                    + (f" (last: {last})" if last else ""),
                    last=last,
                )
            limit = min(remaining, self.timing.request_timeout)
            try:
                async with asyncio.timeout(limit):
                    return await _parsed(request, readable)
            except _Unreadable as e:
                last = str(e)
            except ApiException as e:
                if e.status == 401 and not refreshed:
                    refreshed = True
                    if await self._refresh_credentials():
                        continue  # once, at once, with what the kubeconfig says now
                if e.status in (401, 403):
                    _, message, _ = _status_of(e)
                    what_failed = ("the API server does not accept hostagent's credentials"
                                   if e.status == 401 else "hostagent's credentials lack a right")
                    raise KubeAuthError(
                        f"could not {what}: {what_failed} ({e.status} {message}); fix the "
                        "kubeconfig or the RBAC rules (hostagent needs get, list, watch and "
                        "patch on nodes, list and get on pods, create on pods/eviction and "
                        "on events)",
                        status=e.status,
                    ) from e
                if not transient(e):
                    reason, message, causes = _status_of(e)
                    raise KubeRequestError(
                        f"could not {what}: {message}",
                        status=e.status or 0,
                        reason=reason,
                        causes=causes,
                    ) from e
                last = _describe(e)
            except TimeoutError as e:
                if limit >= self.timing.request_timeout:
                    last = _describe(e)  # one cut short by the deadline is no failure
            except (aiohttp.ClientError, OSError) as e:
                last = _describe(e)
            delay = self._backoff(attempt)
            if attempt == 0 and last:
                log.warning("could not %s (%s); retrying", what, last)
            attempt += 1
            await asyncio.sleep(max(0.0, min(delay, deadline - self._now())))

    async def _read_node(self, node: str, deadline: float) -> Any:
        try:
            return await self._call(
                f"read node {node}", lambda: self._core.read_node(node), deadline,
                readable=_node,
            )
        except KubeRequestError as e:
            if e.status == 404:
                raise NodeNotFound(
                    f"node {node} does not exist in the cluster at {self.server}; "
                    "set lendee.node to a name `kubectl get nodes` lists"
                ) from e
            raise

    async def _update_node(
        self, node: str, change: Callable[[Any], dict[str, Any] | None], deadline: float
    ) -> None:
        """Read, change, write with the read's resourceVersion; again if someone wrote between."""
        while True:
            current = await self._read_node(node, deadline)
            body = change(current)
            if body is None:
                return
            body.setdefault("metadata", {})["resourceVersion"] = current.metadata.resource_version
            try:
                await self._call(
                    f"update node {node}", partial(self._patch_node, node, body), deadline
                )
                return
            except KubeRequestError as e:
                if e.status != 409:
                    raise

    def _patch_node(self, node: str, body: dict[str, Any]) -> Awaitable[Any]:
        # A merge patch: null deletes a key. The stubs omit _content_type, which the
        # generated method takes; without it a dict goes as a strategic merge patch.
        return self._core.patch_node(node, body, _content_type=MERGE_PATCH)  # type: ignore[call-arg]

    # --- the node ------------------------------------------------------------------------

    async def check_node(self, node: str, *, timeout: float | None = None) -> NodeCheck:
        """What the cluster says of `node` now: one real request.

        A node that is not there is an answer, not an error: a node deleted while its VM
        was off registers again when the lendee's kubelet starts. Raises
        KubeUnavailable and KubeAuthError."""
        try:
            current = await self._read_node(node, self._deadline(timeout))
        except NodeNotFound as e:
            return NodeCheck(node=node, exists=False, detail=str(e))
        condition = _ready(current)
        return NodeCheck(node=node, exists=True, ready=_is_ready(current),
                         unschedulable=_unschedulable(current),
                         detail=clean(condition.reason, 200) if condition is not None and
                         condition.reason else "")

    async def post_event(self, node: str, *, reason: str, message: str,
                         warning: bool = False, timeout: float | None = None) -> None:
        """A core/v1 Event on the Node, as the kubelet writes its own (namespace default,
        involvedObject.uid = the node's name), so `kubectl describe node` and `kubectl
        get events` show it. Best effort: the event is also in the journal, and a
        failure to post it is logged, never raised (KubeAuthError aside)."""
        stamp = datetime.now(UTC)
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{node}.", namespace="default"),
            involved_object=k8s.V1ObjectReference(kind="Node", name=node, uid=node,
                                                  api_version="v1"),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=k8s.V1EventSource(component="hostagent", host=_HOSTNAME),
            reporting_component="hostagent.io/hostagent", reporting_instance=_HOSTNAME,
            first_timestamp=stamp, last_timestamp=stamp, count=1,
        )
        try:
            await self._call(f"post an event on node {node}",
                             lambda: self._core.create_namespaced_event("default", body),
                             self._deadline(timeout))
        except (KubeUnavailable, KubeRequestError) as e:
            log.warning("could not tell the cluster (%s: %s): %s", reason, message, e)

    async def cordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None
    ) -> CordonResult:
        """Make `node` unschedulable and mark it as ours, unless someone else already did."""
        marker = cordon_marker(marker_prefix)
        found: list[CordonResult] = []

        def change(current: Any) -> dict[str, Any] | None:
            cordoned = _unschedulable(current)
            ours = _annotations(current).get(marker) == MARKER_VALUE
            # Already cordoned without our marker: an administrator's, to be left alone.
            found[:] = [
                CordonResult(node, cordoned_by_us=ours or not cordoned, was_cordoned=cordoned)
            ]
            if cordoned:
                return None
            return {
                "metadata": {
                    "annotations": {marker: MARKER_VALUE, _cordoned_at(marker_prefix): _timestamp()}
                },
                "spec": {"unschedulable": True},
            }

        await self._update_node(node, change, self._deadline(timeout))
        result = found[0]
        if result.by_someone_else:
            journal.record(
                "cordon",
                f"{node} was already cordoned by someone else; hostagent will leave it cordoned",
                result="cordoned-by-someone-else",
                node=node,
                priority=journal.Priority.NOTICE,
            )
        elif not result.was_cordoned:
            journal.record("cordon", f"cordoned {node}", result="ok", node=node)
        return result

    async def uncordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None
    ) -> bool:
        """Lift the cordon if our marker says we set it; True if we did. Never lifts another's."""
        marker = cordon_marker(marker_prefix)
        lifted: list[bool] = []

        def change(current: Any) -> dict[str, Any] | None:
            ours = _annotations(current).get(marker) == MARKER_VALUE
            # Our marker on a schedulable node: someone lifted our cordon, and whatever
            # cordon comes next is theirs. The marker goes; nothing is lifted.
            stale[:] = [ours and not _unschedulable(current)]
            lifted[:] = [ours and not stale[0]]
            if not ours:
                return None
            body: dict[str, Any] = {
                "metadata": {"annotations": {marker: None, _cordoned_at(marker_prefix): None}}}
            if lifted[0]:
                body["spec"] = {"unschedulable": None}
            return body

        stale: list[bool] = []
        await self._update_node(node, change, self._deadline(timeout))
        if lifted[0]:
            journal.record("uncordon", f"uncordoned {node}", result="ok", node=node)
        elif stale[0]:
            self._record_lifted(node)
        else:
            journal.record(
                "uncordon",
                f"left {node} as it is: hostagent did not cordon it",
                result="not-ours",
                node=node,
                priority=journal.Priority.NOTICE,
            )
        return lifted[0]

    async def forget_cordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None
    ) -> bool:
        """Drop our cordon marker if `node` is schedulable: someone lifted our cordon
        (``kubectl uncordon``), so a cordon set after that is theirs and must never be
        lifted by us. True if the marker was dropped."""
        marker = cordon_marker(marker_prefix)
        dropped: list[bool] = []

        def change(current: Any) -> dict[str, Any] | None:
            dropped[:] = [_annotations(current).get(marker) == MARKER_VALUE
                          and not _unschedulable(current)]
            if not dropped[0]:
                return None
            return {"metadata": {"annotations": {marker: None,
                                                 _cordoned_at(marker_prefix): None}}}

        await self._update_node(node, change, self._deadline(timeout))
        if dropped[0]:
            self._record_lifted(node)
        return dropped[0]

    @staticmethod
    def _record_lifted(node: str) -> None:
        journal.record("uncordon", f"{node} was uncordoned by someone else since hostagent "
                       "cordoned it: hostagent's marker is dropped, and a cordon set from now "
                       "on is left alone", result="not-ours", node=node,
                       priority=journal.Priority.NOTICE)

    async def watch_cordon(self, node: str, *, marker_prefix: str) -> None:
        """Follow `node` until cancelled, dropping our cordon marker each time the node is
        seen schedulable with it (see `forget_cordon`). Raises KubeAuthError."""
        marker = cordon_marker(marker_prefix)
        lifted = asyncio.Event()

        def see(obj: Any) -> None:
            if (obj is not None and _annotations(obj).get(marker) == MARKER_VALUE
                    and not _unschedulable(obj)):
                lifted.set()

        follower = asyncio.create_task(self._follow(
            "list_node", f"metadata.name={node}", lambda items: see(items[0] if items else None),
            lambda kind, obj: see(None if kind == "DELETED" else obj)))
        wait: asyncio.Future[Any] | None = None
        try:
            while True:
                wait = asyncio.ensure_future(lifted.wait())
                await asyncio.wait({wait, follower}, return_when=asyncio.FIRST_COMPLETED)
                if follower.done():
                    follower.result()  # raises what ended it
                    return
                lifted.clear()
                try:
                    await self.forget_cordon(node, marker_prefix=marker_prefix)
                except (NodeNotFound, KubeUnavailable, KubeRequestError) as e:
                    log.info("could not drop the cordon marker of %s yet: %s", node, e)
        finally:
            if wait is not None:
                wait.cancel()
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def annotate(
        self,
        node: str,
        annotations: Mapping[str, str | None],
        *,
        labels: Mapping[str, str | None] | None = None,
        add_taints: Sequence[Taint] = (),
        remove_taints: Sequence[Taint] = (),
        timeout: float | None = None,
    ) -> None:
        """Set annotations and labels (None removes one) and add or remove taints, in
        one write.

        Taints are a list the API replaces whole, and the node lifecycle controller keeps
        its own in it: they are read, changed and written back, never overwritten.
        """

        def change(current: Any) -> dict[str, Any] | None:
            body: dict[str, Any] = {"metadata": {"annotations": dict(annotations)}}
            if labels:
                body["metadata"]["labels"] = dict(labels)
            if add_taints or remove_taints:
                spec = current.spec
                taints = [
                    self._api_client.sanitize_for_serialization(t)
                    for t in (spec.taints if spec else None) or []
                ]
                drop = {(t.key, t.effect) for t in (*add_taints, *remove_taints)}
                wanted = [t for t in taints if (t.get("key"), t.get("effect")) not in drop]
                wanted += [t.body() for t in add_taints]
                if wanted != taints:
                    body["spec"] = {"taints": wanted or None}
            return body

        await self._update_node(node, change, self._deadline(timeout))

    async def _watch_node(
        self, node: str, done: Callable[[Any], bool], deadline: float
    ) -> tuple[Any, str]:
        """Follow `node` until `done(node)` or the deadline: (the node last seen, the last problem).

        A read gives the resourceVersion to watch from; when the watch ends (the server's
        timeout, 410 Expired, a cut connection) the node is read again and the watch resumes.
        """
        last: Any = None
        problem = ""
        attempt = 0
        while self._now() < deadline:
            try:
                current = await self._read_node(node, deadline)
            except NodeNotFound as e:
                # A node deleted while its VM was off re-registers when the kubelet starts.
                problem = str(e)
                await asyncio.sleep(max(0.0, min(self._backoff(attempt), deadline - self._now())))
                attempt += 1
                continue
            except KubeUnavailable as e:
                return last, str(e)
            last = current
            if done(current):
                return current, ""
            remaining = deadline - self._now()
            seconds = max(1, math.ceil(min(remaining, self.timing.watch_timeout)))
            try:
                async with asyncio.timeout(min(remaining, self._watch_bound(seconds))), \
                        k8s_watch.Watch() as stream:
                    async for event in stream.stream(
                        self._core.list_node,
                        field_selector=f"metadata.name={node}",
                        resource_version=current.metadata.resource_version,
                        timeout_seconds=seconds,
                    ):
                        if event["type"] in ("ADDED", "MODIFIED") and _node(event["object"]):
                            last = event["object"]
                            if done(last):
                                return last, ""
                attempt = 0
                continue
            except TimeoutError:
                continue  # the deadline (the loop ends), or a silent connection: read again
            except ApiException as e:
                if e.status == 410:
                    continue  # history expired: read again, watch from there
                problem = _describe(e)
            except (aiohttp.ClientError, OSError) as e:
                problem = _describe(e)
            except Exception as e:
                if not _malformed(e):
                    raise
                problem = f"a watch event that could not be read ({clean(e, 200)})"
            await asyncio.sleep(max(0.0, min(self._backoff(attempt), deadline - self._now())))
            attempt += 1
        return last, problem

    async def wait_ready(self, node: str, *, timeout: float) -> None:
        """Return once `node` is Ready; raise NodeNotReady after `timeout` seconds."""
        last, problem = await self._watch_node(node, _is_ready, self._now() + timeout)
        if last is not None and _is_ready(last):
            return
        why = ""
        condition = _ready(last) if last is not None else None
        if condition is not None:
            why = f": Ready={clean(condition.status, 20)}" + (
                f" ({clean(condition.reason, 200)}: {clean(condition.message)})"
                if condition.reason else ""
            )
        if problem:
            why += f"; {problem}"
        raise NodeNotReady(f"node {node} was not Ready within {timeout:g} s{why}")

    async def wait_gpus(
        self, node: str, *, expected: ExpectedGpus, timeout: float
    ) -> dict[str, int]:
        """Wait until the node's allocatable equals `expected` (every resource in it);
        return the counts found.

        On timeout the counts last seen are returned (all 0 if the node was never read),
        so the caller can say "expected 8 nvidia.com/gpu, found 0".
        """
        last, _ = await self._watch_node(
            node, lambda n: expected.met_by(expected.found(n)), self._now() + timeout
        )
        if last is None:
            return {r: 0 for r in expected.resources}
        return expected.found(last)

    async def node_metadata(
        self, node: str, *, timeout: float | None = None
    ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """The node's (labels, annotations, capacity). Raises NodeNotFound, KubeUnavailable."""
        current = await self._read_node(node, self._deadline(timeout))
        capacity = (current.status.capacity if current.status is not None else None) or {}
        return (dict(current.metadata.labels or {}), _annotations(current),
                {k: str(v) for k, v in capacity.items()})

    # --- DRA: the node's devices ----------------------------------------------------------

    async def dra_in_use(self, driver: str, *, timeout: float | None = None) -> bool:
        """Whether the cluster hands out GPUs through DRA with `driver`: resource.k8s.io/v1
        is served and there is a DeviceClass of that name (the driver installs it) or a
        ResourceSlice of that driver. Raises KubeUnavailable, KubeAuthError."""
        deadline = self._deadline(timeout)
        try:
            classes = await self._call(
                "list DeviceClasses", lambda: self._resource.list_device_class(
                    field_selector=f"metadata.name={driver}"), deadline, readable=_listed)
            if classes.items:
                return True
            slices = await self._call(
                "list ResourceSlices", lambda: self._resource.list_resource_slice(
                    field_selector=f"spec.driver={driver}", limit=1), deadline,
                readable=_listed)
        except KubeRequestError as e:
            if e.status == 404:
                return False  # resource.k8s.io/v1 not served: a cluster older than 1.34
            raise
        return bool(slices.items)

    async def wait_devices(self, node: str, *, driver: str,
                           done: Callable[[frozenset[str]], bool],
                           timeout: float) -> frozenset[str] | None:
        """Follow the node's ResourceSlices of `driver` until `done(uuids)` or `timeout`;
        the UUIDs last seen (None: never listed). Raises KubeAuthError."""
        slices = dra.Slices(driver)
        seen: list[frozenset[str]] = []
        met = asyncio.Event()

        def changed() -> None:
            seen[:] = [slices.uuids()]
            if done(seen[0]):
                met.set()

        def reset(items: list[Any]) -> None:
            slices.reset(items)
            changed()

        def apply(kind: str, obj: Any) -> None:
            slices.apply(kind, obj)
            changed()

        follower = asyncio.create_task(self._follow(
            "list_resource_slice", f"spec.nodeName={node},spec.driver={driver}", reset, apply,
            api="_resource"))
        waiter = asyncio.create_task(met.wait())
        try:
            await asyncio.wait({follower, waiter}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if follower.done():
                follower.result()  # raises what ended it
        finally:
            for task in (follower, waiter):
                task.cancel()
            await asyncio.gather(follower, waiter, return_exceptions=True)
        return seen[0] if seen else None

    # --- while lent: the node watched --------------------------------------------------

    async def _follow(self, method: str, selector: str, reset: Callable[[list[Any]], None],
                      apply: Callable[[str, Any], None], api: str = "_core",
                      return_type: str | None = None) -> None:
        """List, then watch from the list's resourceVersion, for ever (until cancelled):
        `reset(items)` after every list, `apply(type, object)` for every event. A watch
        that ends or fails is followed by a fresh list: level-triggered, nothing missed.
        Raises KubeAuthError (a 401 that fresh credentials did not cure, or a 403)."""
        attempt = 0
        while True:
            try:
                listed = await self._call(
                    f"list {selector}",
                    lambda: getattr(getattr(self, api), method)(field_selector=selector),
                    self._deadline(None), readable=_listed)
            except (KubeUnavailable, KubeRequestError) as e:
                log.debug("following %s: %s", selector, e)
                await asyncio.sleep(self._backoff(attempt))
                attempt += 1
                continue
            reset(list(listed.items))
            seconds = max(1, math.ceil(self.timing.watch_timeout))
            try:
                async with asyncio.timeout(self._watch_bound(seconds)), \
                        k8s_watch.Watch(return_type) as stream:
                    async for event in stream.stream(
                        getattr(getattr(self, api), method),
                        field_selector=selector,
                        resource_version=listed.metadata.resource_version,
                        timeout_seconds=seconds,
                    ):
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            apply(event["type"], event["object"])
                attempt = 0
                continue
            except TimeoutError:
                log.info("the watch of %s stayed open past its end: taken for a dead "
                         "connection, listed again", selector)
                continue
            except ApiException as e:
                if e.status == 410:
                    continue
                log.debug("watching %s: %s", selector, _describe(e))
            except (aiohttp.ClientError, OSError, ValueError) as e:
                log.debug("watching %s: %s", selector, _describe(e))
            except Exception as e:  # an event or object of the wrong shape: list again
                if not _malformed(e):
                    raise
                log.warning("watching %s: an event that could not be read (%s); listing "
                            "again", selector, clean(e, 200))
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1

    async def watch_node(self, node: str, *, resources: Collection[str],
                         on_change: Callable[[NodeView], None],
                         dra_driver: str | None = None) -> None:
        """Follow `node` and the pods on it until cancelled; `on_change(view)` each time
        what matters changes: the node there and Ready, its allocatable count of each of
        `resources`, the count of its pods that request a GPU (see `requests_gpu`).

        Watches, not polling: a GPU that falls off the bus shows as the device plugin
        lowering allocatable, a dead kubelet as Ready going Unknown; both within a
        second of the API server knowing. Raises KubeAuthError only.

        Nothing is published before both lists are in: a node not listed yet is not a
        node deleted, and pods not listed yet are not none.

        With `dra_driver` (a DRA cluster) the node's ResourceSlices of that driver and
        the ResourceClaims are followed too: the view's `devices` are the UUIDs the
        slices list (a GPU lost leaves them), `holders` which pod holds which, and a pod
        holding one of them counts among the GPU pods."""
        state: dict[str, Any] = {"node": None, "pods": None, "listed": False,
                                 "names": {}, "slices": False, "claims": False}
        last: list[NodeView] = []
        slices, claims = dra.Slices(dra_driver or dra.DRIVER), dra.Claims(dra_driver or dra.DRIVER)

        def publish() -> None:
            if not state["listed"] or state["pods"] is None:
                return
            if dra_driver is not None and not (state["slices"] and state["claims"]):
                return
            holders: dict[str, str] = {}
            holding: set[str] = set()
            if dra_driver is not None:
                names = state["names"]
                holders = claims.holders(slices.devices(), names)
                holding = {uid for uid, name in names.items()
                           if any(name in pods.split(",") for pods in holders.values())}
            current = state["node"]
            pods = state["pods"]
            condition = _ready(current) if current is not None else None
            view = NodeView(
                node=node,
                exists=current is not None,
                ready=current is not None and _is_ready(current),
                ready_detail="" if condition is None else
                f"Ready={clean(condition.status, 20)}" + (
                    f" ({clean(condition.reason, 200)})" if condition.reason else ""),
                allocatable={r: _gpus(current, r) for r in resources} if current is not None
                else {r: 0 for r in resources},
                gpu_pods=sum(1 for uid, counted in pods.items() if counted or uid in holding),
                devices=slices.uuids() if dra_driver is not None else None,
                holders=holders,
            )
            if not last or last[0] != view:
                last[:] = [view]
                on_change(view)

        def node_reset(items: list[Any]) -> None:
            state["node"] = items[0] if items else None
            state["listed"] = True
            publish()

        def node_apply(kind: str, obj: Any) -> None:
            state["node"] = None if kind == "DELETED" else obj
            publish()

        def counts(pod: Any) -> bool:
            phase = pod.status.phase if pod.status is not None else ""
            return phase not in ("Succeeded", "Failed") and requests_gpu(pod, resources)

        def name(pod: Any) -> str | None:
            phase = pod.status.phase if pod.status is not None else ""
            return None if phase in ("Succeeded", "Failed") else \
                f"{clean(pod.metadata.namespace, 253)}/{clean(pod.metadata.name, 253)}"

        def pods_reset(items: list[Any]) -> None:
            state["pods"] = {p.metadata.uid: counts(p) for p in items}
            state["names"] = {p.metadata.uid: n for p in items if (n := name(p)) is not None}
            publish()

        def pods_apply(kind: str, obj: Any) -> None:
            pods = state["pods"] if state["pods"] is not None else {}
            pods.pop(obj.metadata.uid, None)
            state["names"].pop(obj.metadata.uid, None)
            if kind != "DELETED":
                pods[obj.metadata.uid] = counts(obj)
                if (n := name(obj)) is not None:
                    state["names"][obj.metadata.uid] = n
            state["pods"] = pods
            publish()

        def followed(what: str, kept: dra.Slices | dra.Claims
                     ) -> tuple[Callable[[list[Any]], None], Callable[[str, Any], None]]:
            def reset(items: list[Any]) -> None:
                kept.reset(items)
                state[what] = True
                publish()

            def apply(kind: str, obj: Any) -> None:
                kept.apply(kind, obj)
                publish()
            return reset, apply

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._follow("list_node", f"metadata.name={node}",
                                               node_reset, node_apply))
                group.create_task(self._follow("list_pod_for_all_namespaces",
                                               f"spec.nodeName={node}", pods_reset, pods_apply))
                if dra_driver is not None:
                    group.create_task(self._follow(
                        "list_resource_slice", f"spec.nodeName={node},spec.driver={dra_driver}",
                        *followed("slices", slices), api="_resource"))
                    # The library guesses "V1ResourceClaim" from the list's type, a
                    # name its models lack: the watch is told the class.
                    group.create_task(self._follow(
                        "list_resource_claim_for_all_namespaces", "",
                        *followed("claims", claims), api="_resource",
                        return_type="ResourceV1ResourceClaim"))
        except ExceptionGroup as group_error:
            _raise_auth_error(group_error)
            raise

    async def watch_gpu_pods(self, node: str, *,
                             resources: Collection[str] = ("nvidia.com/gpu",),
                             dra_driver: str | None = None) -> AsyncIterator[int]:
        """The count of pods on `node` that request a GPU: first the current count, then
        each new one, for as long as the caller iterates (e.g. to restart the lendee
        with more GPUs only once it drops to 0). Raises KubeAuthError."""
        counts: asyncio.Queue[int] = asyncio.Queue()
        last: list[int] = []

        def seen(view: NodeView) -> None:
            if view.gpu_pods is not None and (not last or last[0] != view.gpu_pods):
                last[:] = [view.gpu_pods]
                counts.put_nowait(view.gpu_pods)

        watcher = asyncio.create_task(self.watch_node(node, resources=resources, on_change=seen,
                                                      dra_driver=dra_driver))
        try:
            while True:
                get = asyncio.ensure_future(counts.get())
                await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    watcher.result()  # raises what ended it
                    return
                yield get.result()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

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
    ) -> DrainReport:
        """Evict the node's pods like ``kubectl drain`` (see the module docstring).

        `grace_period`: given to each evicted pod instead of its own (``--grace-period``).
        `skip_wait_for_delete_timeout` > 0: a pod whose deletion is that many seconds in
        the past counts as gone (``--skip-wait-for-delete-timeout``): on a node whose
        kubelet is unreachable, a Terminating pod never goes, and must not hold a
        reclaim for the whole timeout. Raises KubeAuthError on 401/403 whatever
        `on_timeout` says: a drain that is not allowed is not an incomplete one."""
        start = self._now()
        deadline = start + timeout
        try:
            pods = await self._call(
                f"list the pods on {node}",
                lambda: self._core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}"
                ),
                deadline,
                readable=_pods,
            )
        except (KubeUnavailable, KubeRequestError) as e:
            return self._finish(
                DrainReport(node=node, error=str(e), duration=self._now() - start), on_timeout
            )
        plan = plan_drain(
            (PodInfo.from_api(p) for p in pods.items),
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
        follower: asyncio.Task[None] | None = None
        try:
            async with asyncio.TaskGroup() as group:
                evictions = [
                    group.create_task(self._evict(pod, deadline, deletions, grace_period,
                                                  skip_wait_for_delete_timeout))
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
                    self._follow_deletions(node, pods.metadata.resource_version, deletions,
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
                     grace_period: float | None, skip_after: float) -> LeftPod | None:
        """Evict one pod and wait until it is gone; None when it is, `_STUCK` when it
        counts as gone (see `drain`), else why not."""
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
                break
            except KubeUnavailable as e:
                return why if why is not None and not e.last else self._unreachable(pod, e)
            except KubeRequestError as e:
                if e.status == 404:
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


def _raise_auth_error(group: ExceptionGroup[Exception]) -> None:
    """A KubeAuthError from a task of a group, as itself: callers catch it by type."""
    for e in group.exceptions:
        if isinstance(e, KubeAuthError):
            raise e from None
        if isinstance(e, ExceptionGroup):
            _raise_auth_error(e)


# What `_gone` answers: the pod went, or counts as gone (stuck Terminating).
_GONE = LeftPod(PodRef("", ""), LeftReason.TERMINATING, "gone")
_STUCK = LeftPod(PodRef("", ""), LeftReason.TERMINATING, "stuck terminating: counted as gone")


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


def _check_readable(path: Path, *, given: bool) -> None:
    where = "kubernetes.kubeconfig" if given else "the default kubeconfig"
    fix = (
        "set kubernetes.kubeconfig to the cluster's kubeconfig "
        "(a k3s server writes /etc/rancher/k3s/k3s.yaml), or remove the [kubernetes] section"
    )
    try:
        with path.open("rb"):
            pass
    except FileNotFoundError:
        raise KubeConfigError(f"{where} {path}: no such file; {fix}") from None
    except IsADirectoryError:
        raise KubeConfigError(f"{where} {path}: is a directory, not a file; {fix}") from None
    except PermissionError:
        raise KubeConfigError(
            f"{where} {path}: permission denied; make it readable by the user hostagent runs as"
        ) from None
    except OSError as e:
        raise KubeConfigError(f"{where} {path}: cannot read it: {e.strerror}") from None
