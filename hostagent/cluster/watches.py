"""While lent: the node and the pods on it, followed with list-then-watch.

`Watches._follow` lists, then watches from the list's resourceVersion, and lists again
whenever a watch ends, expires or reads an event it cannot use; `_watch_node` waits on
one Node until a condition holds (Ready, GPUs) or a deadline passes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Mapping,
)
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hostagent.cluster import lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from hostagent.cluster import dra
from hostagent.core.text import clean
from hostagent.cluster.client import (
    Client,
    KubeRequestError,
    KubeUnavailable,
    NodeNotFound,
    _describe,
    _gpus,
    _is_ready,
    _listed,
    _malformed,
    _node,
    _raise_auth_error,
    _ready,
)

log = logging.getLogger("hostagent.cluster.kube")

ClaimKey = tuple[str, str]  # (namespace, name) of a ResourceClaim


def claim_keys(pod: Any) -> frozenset[ClaimKey]:
    """The ResourceClaims `pod` uses (see `dra.claim_names`), by namespace and name."""
    namespace = clean(getattr(pod.metadata, "namespace", None) or "", 253)
    return frozenset((namespace, name) for name in dra.claim_names(pod))


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


class Watches(Client):
    """A node, and the pods on it, followed."""

    async def _read_claims(self, keys: Iterable[ClaimKey],
                           deadline: float | None = None) -> dict[ClaimKey, Any]:
        """The ResourceClaims `keys` name, each read by name (one gone is left out): the
        claims of a node's pods, never the cluster's, which are many where the node's are
        few, and which hostagent may not list (deploy/rbac.yaml grants get alone)."""
        found: dict[ClaimKey, Any] = {}
        for namespace, name in sorted(set(keys)):
            try:
                found[(namespace, name)] = await self._call(
                    f"read ResourceClaim {namespace}/{name}", functools.partial(
                        self._resource.read_namespaced_resource_claim, name, namespace),
                    deadline if deadline is not None else self._deadline(None))
            except KubeRequestError as e:
                if e.status != 404:  # a claim gone with its pod holds nothing
                    raise
        return found

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

        With `dra_driver` (a DRA cluster) the node's ResourceSlices of that driver are
        followed too, and the ResourceClaims its pods name read: the view's `devices`
        are the UUIDs the slices list (a GPU lost leaves them), `holders` which pod
        holds which, and a pod holding one of them counts among the GPU pods."""
        state: dict[str, Any] = {"node": None, "pods": None, "listed": False,
                                 "names": {}, "slices": False, "claims": False}
        # DRA: the claims each pod on the node names (pod UID -> keys), and those to
        # read again (new, or their pod changed: a shared claim reserved for one more).
        named: dict[str, frozenset[ClaimKey]] = {}
        stale: set[ClaimKey] = set()
        to_read = asyncio.Event()
        last: list[NodeView] = []
        slices = dra.Slices(dra_driver or dra.DRIVER, node)
        claims = dra.Claims(dra_driver or dra.DRIVER)

        def publish() -> None:
            if not state["listed"] or state["pods"] is None:
                return
            if dra_driver is not None and not (state["slices"] and state["claims"]):
                return
            holders: dict[str, str] = {}
            holding: set[str] = set()
            if dra_driver is not None:
                names = state["names"]
                holders = claims.holders(slices.every(), names)
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
            if dra_driver is not None:  # listed again: every claim read again
                named.clear()
                named.update({p.metadata.uid: k for p in items if (k := claim_keys(p))})
                stale.update(k for keys in named.values() for k in keys)
                to_read.set()
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
            if dra_driver is not None:
                before = named.pop(obj.metadata.uid, frozenset())
                keys = claim_keys(obj) if kind != "DELETED" else frozenset()
                if keys:
                    named[obj.metadata.uid] = keys
                    stale.update(keys)
                if keys or before:
                    to_read.set()
            publish()

        async def read_claims() -> None:
            """The claims the node's pods name, read by name whenever a pod naming one
            comes, changes or goes (the scheduler reserves a claim before it binds a pod
            to the node, so the claim read then names the pod)."""
            read: dict[ClaimKey, Any] = {}
            attempt = 0
            while True:
                await to_read.wait()
                to_read.clear()
                wanted = {k for keys in named.values() for k in keys}
                again = stale & wanted
                stale.clear()
                try:
                    fresh = await self._read_claims(again)
                except (KubeUnavailable, KubeRequestError) as e:
                    log.debug("reading the claims of %s's pods: %s", node, e)
                    stale.update(again)
                    to_read.set()
                    await asyncio.sleep(self._backoff(attempt))
                    attempt += 1
                    continue
                attempt = 0
                read = {k: v for k, v in read.items() if k in wanted and k not in again}
                read.update(fresh)
                claims.reset(read.values())
                state["claims"] = True
                publish()

        def slices_reset(items: list[Any]) -> None:
            slices.reset(items)
            state["slices"] = True
            publish()

        def slices_apply(kind: str, obj: Any) -> None:
            slices.apply(kind, obj)
            publish()

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._follow("list_node", f"metadata.name={node}",
                                               node_reset, node_apply))
                group.create_task(self._follow("list_pod_for_all_namespaces",
                                               f"spec.nodeName={node}", pods_reset, pods_apply))
                if dra_driver is not None:
                    group.create_task(self._follow(
                        "list_resource_slice", f"spec.driver={dra_driver}",
                        slices_reset, slices_apply, api="_resource"))
                    group.create_task(read_claims())
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
