"""The return and its verification: what a lend must show before the uncordon.

First this boot (invariant 14): the node's ``status.nodeInfo.bootID`` must be the
guest's own boot id (`wait_boot`) before anything else of its status counts — the API
keeps the previous boot's Ready and allocatable until the new kubelet posts (or the
node monitor grace period ends), and the previous boot's ResourceSlices until the new
kubelet wipes them. Then the node Ready, then the lent GPUs: counted in its
allocatable (the device plugin, with what GPU feature discovery's labels say of MIG
and time-slicing, `expected_gpus`), or listed by UUID in a DRA driver's
ResourceSlices (`wait_devices`).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import (
    Callable,
    Collection,
    Iterable,
    Mapping,
)
from dataclasses import dataclass
from typing import Any


from hostagent.cluster import dra
from hostagent.core.plugins import PLUGIN_SELECTORS
from hostagent.core.text import clean
from hostagent.cluster.client import (
    KubeAuthError,
    KubeRequestError,
    NodeNotReady,
    _annotations,
    _count,
    _gpus,
    _is_ready,
    _listed,
    _pods,
    _ready,
)
from hostagent.cluster.watches import Watches, claim_keys


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


def boot_id_of(node: Any) -> str:
    """The boot id the node's kubelet last posted ("" if none), cleaned and capped."""
    info = node.status.node_info if node.status is not None else None
    return clean(getattr(info, "boot_id", None) or "", 80)


class Returns(Watches):
    """What a return waits for before the uncordon."""

    async def wait_boot(self, node: str, boot_id: str, *, timeout: float) -> str:
        """Follow `node` until its ``status.nodeInfo.bootID`` is `boot_id` (the kubelet
        of that boot posted) or `timeout`; the boot id it last showed ("" if never
        read). Raises nothing of its own: the caller says what the mismatch means."""
        last, _ = await self._watch_node(node, lambda n: boot_id_of(n) == boot_id,
                                         self._now() + timeout)
        return "" if last is None else boot_id_of(last)

    async def boot_of(self, node: str, *, timeout: float | None = None) -> str:
        """The boot id `node` shows now. Raises NodeNotFound, KubeUnavailable."""
        return boot_id_of(await self._read_node(node, self._deadline(timeout)))

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

    async def restart_plugins(self, node: str, *, timeout: float,
                              selectors: Iterable[str] = PLUGIN_SELECTORS) -> list[str]:
        """Delete the GPU-advertising plugin pods on `node` (found by `selectors`), whose
        DaemonSets start them again: a device plugin enumerates GPUs when it starts, so a
        GPU added or removed later is advertised as such only then. The names of the pods
        deleted."""
        deadline = self._deadline(timeout)
        deleted: list[str] = []
        for selector in selectors:
            pods = await self._call(
                f"list pods {selector} on node {node}",
                functools.partial(self._core.list_pod_for_all_namespaces,
                                  field_selector=f"spec.nodeName={node}",
                                  label_selector=selector), deadline, readable=_pods)
            for pod in pods.items or []:
                namespace, name = pod.metadata.namespace, pod.metadata.name
                await self._call(f"delete pod {namespace}/{name}",
                                 functools.partial(self._core.delete_namespaced_pod, name,
                                                   namespace), deadline)
                deleted.append(f"{clean(namespace, 253)}/{clean(name, 253)}")
        return deleted

    # --- DRA: the node's devices ----------------------------------------------------------

    async def gpu_api_of(self, node: str, *, driver: str, resource: str,
                         timeout: float | None = None,
                         wait: float = 0.0) -> tuple[bool, str] | None:
        """Which API serves `node`'s GPUs, from what the node publishes: (True, why) for
        DRA, its ResourceSlices of `driver`; (False, why) for the device plugin, its
        `resource` capacity; None while it publishes neither, which `wait` seconds the
        node and the slices are watched for (a lendee just booted: its plugins publish
        soon, and the return goes on at that event). Raises NodeNotFound,
        KubeUnavailable, and KubeAuthError or KubeRequestError naming the right or the
        API version that is missing when the DRA API is refused."""
        deadline = self._deadline(timeout)
        current = await self._read_node(node, deadline)

        def advertised(n: Any) -> str | None:
            """The NVIDIA device plugin's resource `n` advertises in its capacity or its
            allocatable: `resource`, its time-slices renamed `<resource>.shared`, or a
            MIG profile's (mixed strategy, where a partitioned GPU is no `resource`)."""
            status = n.status
            amounts = [] if status is None else [*(status.capacity or {}).items(),
                                                 *(status.allocatable or {}).items()]
            return next((name for name, amount in sorted(amounts)
                         if (name in (resource, f"{resource}.shared")
                             or name.startswith("nvidia.com/mig-"))
                         and str(amount) not in ("0", "")), None)

        def plugin(name: str) -> tuple[bool, str]:
            return False, f"node {node} advertises {name} capacity (a device plugin)"

        if (name := advertised(current)) is not None:
            return plugin(name)
        try:
            listed = await self._call(
                f"list the ResourceSlices of {driver}",
                lambda: self._resource.list_resource_slice(field_selector=f"spec.driver={driver}"),
                deadline, readable=_listed)
        except KubeAuthError as e:
            raise KubeAuthError(
                f"node {node} advertises no {resource}, and hostagent may not read the DRA "
                f"API: its ServiceAccount needs list and watch on "
                f"resourceslices.resource.k8s.io and get on resourceclaims.resource.k8s.io "
                f"(deploy/rbac.yaml grants them) ({e})", status=e.status) from e
        except KubeRequestError as e:
            if e.status != 404:
                raise
            raise KubeRequestError(
                f"node {node} advertises no {resource}, and the API server does not serve "
                "resource.k8s.io/v1 (DRA's API: Kubernetes 1.34 or later); set "
                "kubernetes.gpu_api to say which API serves the GPUs", status=404,
                reason=e.reason) from e
        labels = dict(current.metadata.labels or {})
        slices = dra.Slices(driver, node, labels)
        slices.reset(listed.items or [])
        if devices := slices.every():
            return True, (f"node {node} publishes {len(devices)} {driver} device(s) in "
                          "ResourceSlices")
        if wait <= 0:
            return None
        # Both followed at once, each read again as its watch starts: nothing published
        # since the reads above is missed.
        on_node = asyncio.create_task(self._watch_node(
            node, lambda n: advertised(n) is not None, self._now() + wait))
        on_slices = asyncio.create_task(self.wait_devices(
            node, driver=driver, labels=labels, timeout=wait,
            done=lambda seen: bool(seen.every())))
        pending: set[asyncio.Task[Any]] = {on_node, on_slices}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if on_node in done and (last := on_node.result()[0]) is not None \
                        and (name := advertised(last)) is not None:
                    return plugin(name)
                if on_slices in done and (seen := on_slices.result()) is not None \
                        and (devices := seen.every()):
                    return True, (f"node {node} publishes {len(devices)} {driver} device(s) "
                                  "in ResourceSlices")
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return None

    async def dra_holders(self, node: str, *, driver: str, uuids: Collection[str],
                          timeout: float | None = None) -> frozenset[str]:
        """The UIDs of the pods holding a device of `driver` on `node` whose UUID is one
        of `uuids` (a MIG instance's is its parent's), from the ResourceClaims allocated
        it. Raises KubeUnavailable, KubeRequestError, KubeAuthError."""
        deadline = self._deadline(timeout)
        slices, claims = dra.Slices(driver, node), dra.Claims(driver)
        listed = await self._call(
            f"list the ResourceSlices of {node}", lambda: self._resource.list_resource_slice(
                field_selector=f"spec.driver={driver}"), deadline, readable=_listed)
        slices.reset(listed.items or [])
        # Only the claims the node's pods name, each read by name (see `_read_claims`).
        pods = await self._call(
            f"list the pods of node {node}", functools.partial(
                self._core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}"),
            deadline, readable=_pods)
        found = await self._read_claims((key for pod in pods.items or []
                                         for key in claim_keys(pod)), deadline)
        claims.reset(found.values())
        return claims.pods_of([key for key, uuid in slices.every().items() if uuid in uuids])

    async def wait_devices(self, node: str, *, driver: str,
                           done: Callable[[dra.Slices], bool],
                           timeout: float,
                           labels: Mapping[str, str] | None = None) -> dra.Slices | None:
        """Follow the ResourceSlices of `driver` that are `node`'s (its `labels` for the
        slices' node selectors) until `done(slices)` or `timeout`; the slices as last seen
        (None: never listed). Raises KubeAuthError."""
        slices = dra.Slices(driver, node, labels)
        seen: list[dra.Slices] = []
        met = asyncio.Event()

        def changed() -> None:
            seen[:] = [slices]
            if done(slices):
                met.set()

        def reset(items: list[Any]) -> None:
            slices.reset(items)
            changed()

        def apply(kind: str, obj: Any) -> None:
            slices.apply(kind, obj)
            changed()

        follower = asyncio.create_task(self._follow(
            "list_resource_slice", f"spec.driver={driver}", reset, apply, api="_resource"))
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
