"""The stand-in's state: stored objects, one resourceVersion counter, watches, and the
few controllers whose effects a drain sees.

Those controllers are the kubelet's end of a pod deletion (a pod with a
deletionTimestamp goes away after its grace period, but only while its node is Ready),
the ReplicaSet and StatefulSet controllers (a replacement pod with a new UID, never on
the drained node), the disruption controller's arithmetic (computed when an eviction
asks), and the node lifecycle controller's taints (``node.kubernetes.io/unschedulable``
and friends, which is why the taints list is not the adapter's alone).

Everything runs on one asyncio loop; the methods are synchronous and must be called
from that loop (`serve_in_thread` in server.py hops there for callers on other threads).
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.kubeapi.rules import (
    DAEMONSETS,
    DEVICECLASSES,
    EVENTS,
    LEASES,
    MODIFIED,
    NODES,
    PDBS,
    PODS,
    RESOURCECLAIMS,
    RESOURCES,
    RESOURCESLICES,
    ApiError,
    Obj,
    Resource,
    already_exists,
    bad_request,
    check_shape,
    conflict,
    fields_match,
    internal_error,
    invalid,
    labels_match,
    normalize,
    not_found,
    not_modelled,
    now,
    parse_field_selector,
    parse_label_selector,
    selector_requirements,
    too_many_requests,
    uid_conflict,
    validate,
)
from tests.kubeapi.rules import apply_patch as _apply_patch

Key = tuple[str, str]  # (namespace, name); nodes have namespace ""

# What the node lifecycle controller manages (TaintNodesByCondition).
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
_SYSTEM_TAINTS = {UNSCHEDULABLE_TAINT, NOT_READY_TAINT, UNREACHABLE_TAINT}
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
_OWNER_API = {
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1",
    "Job": "batch/v1",
    "ReplicationController": "v1",
    "Node": "v1",
}
# What a k3s kubelet reports about its node (shown by `kubectl get nodes -o wide`).
NODE_INFO = {
    "machineID": "0f9e8d7c6b5a49382716f5e4d3c2b1a0",
    "systemUUID": "6c1f4a2e-8b3d-4e5f-9a7b-1c2d3e4f5a6b",
    "bootID": "d2c3b4a5-9687-4f1e-8d2c-3b4a59687f1e",
    "kubeletVersion": "v1.30.6+k3s1",
    "kubeProxyVersion": "v1.30.6+k3s1",
    "osImage": "NixOS 24.11 (Vicuna)",
    "kernelVersion": "6.6.63",
    "containerRuntimeVersion": "containerd://1.7.23-k3s2",
    "operatingSystem": "linux",
    "architecture": "amd64",
}
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what generateName draws from
DRA_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver, and the DeviceClass it installs


@dataclass(frozen=True)
class Change:
    """One committed change: ADDED, MODIFIED or DELETED, the object after (for DELETED,
    as it was) and before, and `at`, the wall-clock time (time.time()) of the commit."""

    rv: int
    resource: Resource
    type: str
    obj: Obj
    old: Obj | None
    at: float


class Watcher:
    """One watch: its filters and a queue of event bodies; None ends the stream."""

    def __init__(self, resource: Resource, namespace: str | None, fields: Any, labels: Any) -> None:
        self.resource = resource
        self.namespace = namespace
        self.fields = fields
        self.labels = labels
        self.queue: asyncio.Queue[Obj | None] = asyncio.Queue()

    def wants(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return fields_match(self.fields, obj) and labels_match(
            self.labels, meta.get("labels") or {}
        )

    def push(self, kind: str, obj: Obj) -> None:
        self.queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    def offer(self, event: Change) -> None:
        if event.resource is not self.resource:
            return
        before = self.wants(event.old)
        after = event.type != "DELETED" and self.wants(event.obj)
        # An object that enters or leaves the selection is ADDED or DELETED for this
        # watcher, whatever happened to it in storage.
        if after and not before:
            self.push("ADDED", event.obj)
        elif after:
            self.push("MODIFIED", event.obj)
        elif before:
            self.push("DELETED", event.obj)

    def close(self) -> None:
        self.queue.put_nowait(None)


def _ready(obj: Obj) -> bool:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False


def _controller(pod: Obj) -> Obj | None:
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def _scaled(value: int | str, total: int) -> int:
    """An IntOrString budget: an int, or a percentage of `total` rounded up."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def _later(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    """Objects as kube-apiserver would store them, plus the controllers a drain meets.

    `termination_scale` is how many wall-clock seconds one second of a pod's
    terminationGracePeriodSeconds takes (tests use 0.01 or less). Replacement pods go to
    `replacement_node` (None: they stay Pending, unscheduled: there is no scheduler) and
    become Ready `replacement_ready_after` seconds later (None: never). `history` is how
    many events watches can resume from; an older resourceVersion gets 410 Expired.
    `changes` keeps the last `kept_changes` commits with their times, for benchmarks
    that time what the API server saw (when the last evicted pod went, when the node
    was uncordoned).
    """

    def __init__(
        self,
        *,
        termination_scale: float = 1.0,
        replacement_node: str | None = None,
        replacement_ready_after: float | None = None,
        history: int = 1000,
        kept_changes: int = 10000,
    ) -> None:
        self.termination_scale = termination_scale
        self.replacement_node = replacement_node
        self.replacement_ready_after = replacement_ready_after
        self._store: dict[str, dict[Key, Obj]] = {r.plural: {} for r in RESOURCES}
        self._rv = 100
        self._history: deque[Change] = deque(maxlen=history)
        self.changes: deque[Change] = deque(maxlen=kept_changes)
        self._watchers: set[Watcher] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._stuck: dict[str, set[tuple[Key, str]]] = {}  # node -> pods its kubelet owes
        self.on_commit: Callable[[], None] | None = None
        self._addresses = 0

    @property
    def resource_version(self) -> int:
        return self._rv

    # --- reading -----------------------------------------------------------------------

    def _key(self, resource: Resource, namespace: str | None, name: str) -> Key:
        return (namespace or "" if resource.namespaced else "", name)

    def _stored(self, resource: Resource, namespace: str | None, name: str) -> Obj:
        obj = self._store[resource.plural].get(self._key(resource, namespace, name))
        if obj is None:
            raise not_found(resource, name)
        return obj

    def get(self, resource: Resource, namespace: str | None, name: str) -> Obj:
        obj = copy.deepcopy(self._stored(resource, namespace, name))
        if resource is PDBS:
            obj["status"] = self._budget_status(obj)
        return obj

    def _select(
        self, resource: Resource, namespace: str | None, field_selector: str, label_selector: str
    ) -> Iterator[Obj]:
        fields = parse_field_selector(field_selector, resource)
        labels = parse_label_selector(label_selector)
        for (ns, _), obj in sorted(self._store[resource.plural].items()):
            if namespace is not None and ns != namespace:
                continue
            if fields_match(fields, obj) and labels_match(
                labels, obj["metadata"].get("labels") or {}
            ):
                yield obj

    def list(
        self,
        resource: Resource,
        namespace: str | None,
        *,
        field_selector: str = "",
        label_selector: str = "",
    ) -> Obj:
        items = []
        for obj in self._select(resource, namespace, field_selector, label_selector):
            item = copy.deepcopy(obj)
            # List items carry no kind or apiVersion; the list does.
            item.pop("kind", None)
            item.pop("apiVersion", None)
            if resource is PDBS:
                item["status"] = self._budget_status(obj)
            items.append(item)
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    # --- writing -----------------------------------------------------------------------

    def _commit(self, resource: Resource, key: Key, new: Obj | None) -> Obj:
        old = self._store[resource.plural].get(key)
        self._rv += 1
        if new is None:
            assert old is not None
            shown = copy.deepcopy(old)
            shown["metadata"]["resourceVersion"] = str(self._rv)
            del self._store[resource.plural][key]
            kind = "DELETED"
        else:
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._store[resource.plural][key] = new
            shown = new
            kind = "ADDED" if old is None else "MODIFIED"
        event = Change(self._rv, resource, kind, copy.deepcopy(shown), copy.deepcopy(old),
                       time.time())
        self._history.append(event)
        self.changes.append(event)
        for watcher in list(self._watchers):
            watcher.offer(event)
        if resource is NODES and new is not None:
            self._node_changed(key[1])
        if self.on_commit is not None:
            self.on_commit()
        return copy.deepcopy(shown)

    def _insert(self, resource: Resource, obj: Obj) -> Obj:
        meta = obj["metadata"]
        key = self._key(resource, meta.get("namespace"), meta["name"])
        if key in self._store[resource.plural]:
            raise already_exists(resource, meta["name"])
        obj["kind"], obj["apiVersion"] = resource.kind, resource.api_version
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(field, None)
        if resource is PDBS:
            meta["generation"] = 1
        validate(resource, obj)
        return self._commit(resource, key, normalize(obj))

    def create(self, resource: Resource, namespace: str | None, body: Any) -> Obj:
        """POST: what a client creates (a pod's status starts over as Pending)."""
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not a JSON object")
        check_shape(body)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if resource.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(
                    resource,
                    "",
                    [
                        (
                            "metadata.name",
                            "FieldValueRequired",
                            "Required value: name or generateName is required",
                        )
                    ],
                )
            meta["name"] = meta["generateName"] + "".join(random.choices(_SUFFIX_CHARS, k=5))
        if resource is RESOURCECLAIMS:
            obj.pop("status", None)  # the scheduler allocates, through the status
        if resource is PODS:
            spec = obj.setdefault("spec", {})
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("schedulerName", "default-scheduler")
            obj["status"] = {"phase": "Pending"}
        if resource is EVENTS:
            # metav1.Time: RFC 3339 in whole seconds, whatever precision was sent.
            for stamp in ("firstTimestamp", "lastTimestamp"):
                if obj.get(stamp):
                    try:
                        when = datetime.fromisoformat(str(obj[stamp]).replace("Z", "+00:00"))
                    except ValueError:
                        raise bad_request(f'{stamp}: Invalid value: "{obj[stamp]}"') from None
                    obj[stamp] = when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if resource is PDBS:
            spec = obj.get("spec") or {}
            if "minAvailable" in spec and "maxUnavailable" in spec:
                raise invalid(
                    resource,
                    meta["name"],
                    [
                        (
                            "spec",
                            "FieldValueInvalid",
                            "Invalid value: minAvailable and maxUnavailable cannot be both set",
                        )
                    ],
                )
            if "minAvailable" not in spec and "maxUnavailable" not in spec:
                raise not_modelled(
                    "a PodDisruptionBudget with neither minAvailable nor maxUnavailable"
                )
            obj.pop("status", None)
        return self._insert(resource, obj)

    def update(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        change: Callable[[Obj], Any],
        *,
        subresource: str | None = None,
    ) -> Obj:
        """PATCH and PUT: `change` turns a copy of the object into the wanted one."""
        old = self._stored(resource, namespace, name)
        new = change(copy.deepcopy(old))
        if not isinstance(new, dict):
            raise bad_request("the result of the change is not a JSON object")
        check_shape(new)
        meta = new.setdefault("metadata", {})
        old_meta = old["metadata"]
        if meta.get("uid") not in (None, old_meta["uid"]):
            raise uid_conflict(resource, name, meta["uid"], old_meta["uid"])
        if meta.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
            raise conflict(resource, name, MODIFIED)
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "generation"):  # fmt: skip
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        new["kind"], new["apiVersion"] = resource.kind, resource.api_version
        if subresource == "status":
            # The status subresource changes status only.
            new = {**copy.deepcopy(old), "status": new.get("status", {})}
        else:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
            if resource is PODS and new.get("spec") != old.get("spec"):
                raise invalid(
                    resource,
                    name,
                    [
                        (
                            "spec",
                            "FieldValueForbidden",
                            "Forbidden: pod updates may not change fields other than those the stand-in allows (metadata)",
                        )
                    ],
                )
            if resource is PDBS and new.get("spec") != old.get("spec"):
                meta["generation"] = old_meta.get("generation", 1) + 1
        validate(resource, new)
        new = normalize(new)
        comparable = {
            **new,
            "metadata": {**new["metadata"], "resourceVersion": old_meta["resourceVersion"]},
        }
        if comparable == old:
            return copy.deepcopy(old)  # a no-op write changes no resourceVersion
        return self._commit(resource, self._key(resource, namespace, name), new)

    def patch(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        content_type: str,
        body: bytes,
        *,
        subresource: str | None = None,
    ) -> Obj:
        return self.update(
            resource,
            namespace,
            name,
            lambda obj: _apply_patch(content_type, obj, body),
            subresource=subresource,
        )

    def replace(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
    ) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not a JSON object")
        return self.update(
            resource, namespace, name, lambda _: copy.deepcopy(body), subresource=subresource
        )

    def delete(
        self, resource: Resource, namespace: str | None, name: str, options: Obj | None = None
    ) -> Obj:
        """DELETE: a pod on a node terminates gracefully; everything else goes at once."""
        options = options or {}
        obj = self._stored(resource, namespace, name)
        key = self._key(resource, namespace, name)
        meta = obj["metadata"]
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") not in (None, meta["uid"]):
            raise uid_conflict(resource, name, preconditions["uid"], meta["uid"])
        if preconditions.get("resourceVersion") not in (None, meta["resourceVersion"]):
            raise conflict(resource, name, MODIFIED)
        if resource is not PODS:
            self._commit(resource, key, None)
            details = {"name": name, **({"group": resource.group} if resource.group else {}),
                       "kind": resource.plural, "uid": meta["uid"]}  # fmt: skip
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": details}  # fmt: skip
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = obj["spec"].get("terminationGracePeriodSeconds", 30)
        # No kubelet has to confirm the end of a pod that never ran or already ended.
        if not obj["spec"].get("nodeName") or obj["status"].get("phase") in ("Succeeded", "Failed"):
            grace = 0
        if grace == 0:
            gone = self._commit(PODS, key, None)
            self._controllers_see_deleted(gone, terminating=False)
            return gone
        current = meta.get("deletionGracePeriodSeconds")
        if current is not None and current <= grace:
            return copy.deepcopy(obj)
        new = copy.deepcopy(obj)
        new["metadata"]["deletionTimestamp"] = _later(grace)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        shown = self._commit(PODS, key, new)
        if current is None:
            self._controllers_see_deleted(shown, terminating=True)
        self._after(grace * self.termination_scale, self._kubelet_finish, key, meta["uid"])
        return shown

    # --- the eviction subresource --------------------------------------------------------

    def _budgets_for(self, pod: Obj) -> list[Obj]:
        namespace = pod["metadata"]["namespace"]
        labels = pod["metadata"].get("labels") or {}
        return [
            pdb
            for (ns, _), pdb in sorted(self._store[PDBS.plural].items())
            if ns == namespace
            and labels_match(selector_requirements(pdb["spec"].get("selector")), labels)
        ]

    def _budget(self, pdb: Obj) -> tuple[int, int, int, int]:
        """(expected, currently healthy, desired healthy, disruptions allowed)."""
        requirements = selector_requirements(pdb["spec"].get("selector"))
        pods = [
            p
            for (ns, _), p in self._store[PODS.plural].items()
            if ns == pdb["metadata"]["namespace"]
            and labels_match(requirements, p["metadata"].get("labels") or {})
            and not p["metadata"].get("deletionTimestamp")
        ]
        # The real controller takes the expected count from the controller's scale for
        # percentages and maxUnavailable; here it is the pods that are not terminating.
        expected = len(pods)
        healthy = sum(1 for p in pods if _ready(p))
        spec = pdb["spec"]
        if "minAvailable" in spec:
            desired = _scaled(spec["minAvailable"], expected)
        else:
            desired = max(0, expected - _scaled(spec["maxUnavailable"], expected))
        return expected, healthy, desired, max(0, healthy - desired)

    def _budget_status(self, pdb: Obj) -> Obj:
        expected, healthy, desired, allowed = self._budget(pdb)
        generation = pdb["metadata"].get("generation", 1)
        return {
            "observedGeneration": generation,
            "disruptionsAllowed": allowed,
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "conditions": [
                {
                    "type": "DisruptionAllowed",
                    "status": "True" if allowed else "False",
                    "reason": "SufficientPods" if allowed else "InsufficientPods",
                    "message": "",
                    "observedGeneration": generation,
                    "lastTransitionTime": pdb["metadata"]["creationTimestamp"],
                }
            ],
        }

    def evict(self, namespace: str, name: str, body: Any) -> Obj:
        """POST .../pods/NAME/eviction, in the order pkg/registry/core/pod/storage/eviction.go checks."""
        pod = self._stored(PODS, namespace, name)
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not a JSON object")
        if (body.get("metadata") or {}).get("name", name) != name:
            raise bad_request("name in URL does not match name in Eviction object")
        options = body.get("deleteOptions") or {}
        ignore_budget = (
            pod["status"].get("phase") in ("Succeeded", "Failed", "Pending")
            or pod["metadata"].get("deletionTimestamp") is not None
        )
        if not ignore_budget:
            budgets = self._budgets_for(pod)
            if len(budgets) > 1:
                raise internal_error(
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
                )
            if budgets:
                self._check_budget(pod, budgets[0])
        self.delete(PODS, namespace, name, options)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }

    def _check_budget(self, pod: Obj, pdb: Obj) -> None:
        _, healthy, desired, allowed = self._budget(pdb)
        if not _ready(pod):
            # An unready pod adds nothing to the budget: it may go if the budget is met.
            policy = pdb["spec"].get("unhealthyPodEvictionPolicy", "IfHealthyBudget")
            if policy == "AlwaysAllow" or (healthy >= desired and desired > 0):
                return
        if allowed == 0:
            raise too_many_requests(
                "Cannot evict pod as it would violate the pod's disruption budget.",
                [
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {pdb['metadata']['name']} needs "
                        f"{desired} healthy pods and has {healthy} currently",
                    }
                ],
            )

    # --- the controllers -------------------------------------------------------------------

    def _after(self, seconds: float, fn: Callable[..., None], *args: Any) -> None:
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._timers.discard(handle)
            fn(*args)

        handle = loop.call_later(max(seconds, 0.0), fire)
        self._timers.add(handle)

    def _node_ready(self, name: str) -> bool:
        node = self._store[NODES.plural].get(("", name))
        return node is not None and _ready(node)

    def _kubelet_finish(self, key: Key, uid: str) -> None:
        """The kubelet saw the containers exit and removes the pod for good."""
        pod = self._store[PODS.plural].get(key)
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        node = pod["spec"].get("nodeName", "")
        if not self._node_ready(node):
            # No kubelet to confirm: the pod stays Terminating until the node is back.
            self._stuck.setdefault(node, set()).add((key, uid))
            return
        gone = self._commit(PODS, key, None)
        self._controllers_see_deleted(gone, terminating=False)

    def _controllers_see_deleted(self, pod: Obj, *, terminating: bool) -> None:
        if not terminating:
            self._release_claims(pod)
        owner = _controller(pod)
        if owner is None:
            return
        # A ReplicaSet replaces a pod as soon as it starts terminating (or vanishes
        # without doing so); a StatefulSet waits until it is gone, then re-creates it
        # under the same name with a new UID.
        replica_set = owner["kind"] in ("ReplicaSet", "ReplicationController")
        if replica_set and (terminating or not pod["metadata"].get("deletionTimestamp")):
            self._replacement(pod, same_name=False)
        elif owner["kind"] == "StatefulSet" and not terminating:
            self._replacement(pod, same_name=True)

    def _release_claims(self, pod: Obj) -> None:
        """The resourceclaim controller: a pod gone is no claim's user any more, and the
        claims made for it from a template go with it (their devices free again)."""
        uid = pod["metadata"]["uid"]
        for key, claim in list(self._store[RESOURCECLAIMS.plural].items()):
            if key[0] != pod["metadata"]["namespace"]:
                continue
            if any(ref.get("uid") == uid for ref in claim["metadata"].get("ownerReferences") or []):
                self._commit(RESOURCECLAIMS, key, None)
                continue
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            if any(r.get("uid") == uid for r in reserved):
                new = copy.deepcopy(claim)
                new["status"]["reservedFor"] = [r for r in reserved if r.get("uid") != uid]
                if not new["status"]["reservedFor"]:
                    del new["status"]["reservedFor"]
                self._commit(RESOURCECLAIMS, key, new)

    def _replacement(self, old: Obj, *, same_name: bool) -> None:
        meta = old["metadata"]
        owner = _controller(old)
        assert owner is not None
        prefix = meta.get("generateName") or f"{owner['name']}-"
        name = meta["name"] if same_name else prefix + "".join(random.choices(_SUFFIX_CHARS, k=5))
        spec = copy.deepcopy(old["spec"])
        spec.pop("nodeName", None)
        status: Obj = {"phase": "Pending"}
        if self.replacement_node:
            spec["nodeName"] = self.replacement_node
            status["conditions"] = [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}
            ]
        else:
            status["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "the Kubernetes API stand-in has no scheduler",
                    "lastTransitionTime": now(),
                }
            ]
        new_meta = {
            k: copy.deepcopy(v)
            for k, v in meta.items()
            if k in ("namespace", "labels", "annotations", "ownerReferences")
        }
        new_meta["name"] = name
        if not same_name:
            new_meta["generateName"] = prefix
        pod = {"metadata": new_meta, "spec": spec, "status": status}
        created = self._insert(PODS, pod)
        if self.replacement_node and self.replacement_ready_after is not None:
            self._after(
                self.replacement_ready_after,
                self._ready_if_same,
                meta["namespace"],
                name,
                created["metadata"]["uid"],
            )

    def _ready_if_same(self, namespace: str, name: str, uid: str) -> None:
        pod = self._store[PODS.plural].get((namespace, name))
        if pod is not None and pod["metadata"]["uid"] == uid:
            self.set_pod_ready(namespace, name)

    def _node_changed(self, name: str) -> None:
        """The node lifecycle controller: taints that follow spec and conditions."""
        node = self._store[NODES.plural][("", name)]
        wanted: list[tuple[str, str]] = []
        if node.get("spec", {}).get("unschedulable"):
            wanted.append((UNSCHEDULABLE_TAINT, "NoSchedule"))
        for c in node.get("status", {}).get("conditions") or []:
            if c.get("type") == "Ready" and c.get("status") == "False":
                wanted.append((NOT_READY_TAINT, "NoSchedule"))
            elif c.get("type") == "Ready" and c.get("status") == "Unknown":
                wanted.append((UNREACHABLE_TAINT, "NoSchedule"))
        taints = node.get("spec", {}).get("taints") or []
        kept = [
            t
            for t in taints
            if t.get("key") not in _SYSTEM_TAINTS or (t.get("key"), t.get("effect")) in wanted
        ]
        have = {(t.get("key"), t.get("effect")) for t in kept}
        added = [
            {"key": k, "effect": e, "timeAdded": now()} for k, e in wanted if (k, e) not in have
        ]
        if kept != taints or added:
            new = copy.deepcopy(node)
            new.setdefault("spec", {})["taints"] = kept + added
            self._commit(NODES, ("", name), normalize(new))
            return
        if _ready(node):
            for key, uid in sorted(self._stuck.pop(name, set())):
                self._kubelet_finish(key, uid)

    # --- watches ---------------------------------------------------------------------------

    def watch(
        self,
        resource: Resource,
        namespace: str | None,
        *,
        field_selector: str = "",
        label_selector: str = "",
        resource_version: str = "",
    ) -> Watcher:
        watcher = Watcher(
            resource,
            namespace,
            parse_field_selector(field_selector, resource),
            parse_label_selector(label_selector),
        )
        if resource_version in ("", "0"):
            # "Get state and start at most recent": the current objects first, as ADDED.
            for obj in self._select(resource, namespace, field_selector, label_selector):
                watcher.push("ADDED", obj)
        else:
            try:
                since = int(resource_version)
            except ValueError:
                raise bad_request(f'resourceVersion: Invalid value: "{resource_version}"') from None
            oldest = self._history[0].rv if self._history else self._rv + 1
            if since < oldest - 1:
                watcher.push(
                    "ERROR",
                    ApiError(
                        410, "Expired", f"too old resource version: {since} ({oldest - 1})"
                    ).status(),
                )
                watcher.close()
                return watcher
            for event in self._history:
                if event.rv > since:
                    watcher.offer(event)
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_watches(self) -> None:
        for watcher in list(self._watchers):
            watcher.close()
        self._watchers.clear()

    def close(self) -> None:
        self.close_watches()
        for handle in list(self._timers):
            handle.cancel()
        self._timers.clear()

    # --- state file ------------------------------------------------------------------------

    def dump(self) -> Obj:
        return {
            "resourceVersion": self._rv,
            "objects": {
                plural: [copy.deepcopy(o) for _, o in sorted(objs.items())]
                for plural, objs in self._store.items()
            },
        }

    def load(self, state: Obj) -> None:
        """Objects from `dump()`. Watch history is not kept, as after an API server restart."""
        by_plural = {r.plural: r for r in RESOURCES}
        self._rv = int(state.get("resourceVersion", self._rv))
        for plural, objs in (state.get("objects") or {}).items():
            resource = by_plural[plural]
            for obj in objs:
                meta = obj["metadata"]
                obj.setdefault("kind", resource.kind)
                obj.setdefault("apiVersion", resource.api_version)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", now())
                self._rv += "resourceVersion" not in meta
                meta.setdefault("resourceVersion", str(self._rv))
                self._store[plural][self._key(resource, meta.get("namespace"), meta["name"])] = obj

    def resume_timers(self) -> None:
        """Finish terminations that were under way when the state was saved."""
        for key, pod in list(self._store[PODS.plural].items()):
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is not None:
                self._after(
                    grace * self.termination_scale,
                    self._kubelet_finish,
                    key,
                    pod["metadata"]["uid"],
                )

    # --- for tests: the scheduler and kubelet's side, without the API ---------------------

    def add_node(
        self,
        name: str,
        *,
        ready: bool = True,
        unschedulable: bool = False,
        gpus: int | None = None,
        gpu_resource: str = "nvidia.com/gpu",
        replicas: int = 1,
        mig: dict[str, int] | None = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
    ) -> Obj:
        """A registered node; `gpus` physical GPUs as the NVIDIA device plugin and GPU
        Feature Discovery show them (`replicas`: time-slicing; `mig`: MIG profile →
        devices per GPU, mixed strategy): see `gpu_status`."""
        resources = {"cpu": "4", "memory": "16Gi", "pods": "110"}
        self._addresses += 1
        address = f"10.0.0.{self._addresses}"
        gfd: dict[str, str] = {}
        if gpus is not None:
            gfd, extended = gpu_status(gpus, resource=gpu_resource, replicas=replicas, mig=mig)
            resources.update(extended)
        node: Obj = {
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **gfd, **(labels or {})},
                "annotations": dict(annotations or {}),
            },
            "spec": {"unschedulable": unschedulable, "taints": list(taints or [])},
            "status": {
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": [ready_condition("True" if ready else "False")],
                "addresses": [{"type": "InternalIP", "address": address},
                              {"type": "Hostname", "address": name}],
                "nodeInfo": dict(NODE_INFO),
            },
        }
        created = self._insert(NODES, node)
        if ("kube-node-lease", name) not in self._store[LEASES.plural]:
            self._insert(LEASES, {
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                         "renewTime": now().replace("Z", ".000000Z")},
            })  # fmt: skip
        return created

    def add_pod(
        self,
        name: str,
        *,
        node: str | None,
        namespace: str = "default",
        owner: str | None = None,
        labels: dict[str, str] | None = None,
        phase: str = "Running",
        ready: bool = True,
        emptydir: bool = False,
        mirror: bool = False,
        grace: int = 30,
        gpus: dict[str, int] | None = None,
        devices: list[str] | None = None,
        driver: str = DRA_DRIVER,
    ) -> Obj:
        """A pod already scheduled and running; `owner` is "Kind/name", e.g. "ReplicaSet/web";
        `gpus`: what its container requests (and limits), e.g. {"nvidia.com/gpu": 1};
        `devices`: DRA devices of `driver` on its node (their names in the node's
        ResourceSlice), held through a ResourceClaim made for it from a template,
        allocated and reserved for it as the scheduler leaves one."""
        meta: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
        refs = []
        if owner is not None:
            kind, _, owner_name = owner.partition("/")
            refs.append(owner_reference(kind, owner_name))
        if mirror:
            meta["annotations"] = {MIRROR_ANNOTATION: uuid.uuid4().hex}
            refs.append(owner_reference("Node", node or ""))
        if refs:
            meta["ownerReferences"] = refs
        if owner is not None and owner.startswith("DaemonSet/") and self._store[
                DAEMONSETS.plural].get((namespace, owner.split("/", 1)[1])) is None:
            # kubectl drain reads the DaemonSet of each of its pods before leaving it.
            self._insert(DAEMONSETS, {"metadata": {"name": owner.split("/", 1)[1],
                                                   "namespace": namespace},
                                      "spec": {"selector": {"matchLabels": dict(labels or {})}}})
        spec: Obj = {
            "containers": [{"name": "main", "image": "registry.example/app:1"}],
            "restartPolicy": "Always" if phase in ("Running", "Pending") else "Never",
            "terminationGracePeriodSeconds": grace,
            "schedulerName": "default-scheduler",
        }
        if node:
            spec["nodeName"] = node
        if gpus:
            amounts = {k: str(v) for k, v in gpus.items()}
            spec["containers"][0]["resources"] = {"requests": amounts, "limits": dict(amounts)}
        claim = ""
        if devices:
            claim = f"{name}-gpu-" + "".join(random.choices(_SUFFIX_CHARS, k=5))
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
            spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        if emptydir:
            spec["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
            spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        status: Obj = {
            "phase": phase,
            "conditions": [pod_ready_condition(ready and phase == "Running")],
        }
        if node and phase in ("Running", "Pending"):
            self._addresses += 1
            status["podIP"] = f"10.42.{self._addresses // 250}.{self._addresses % 250 + 2}"
        if claim:
            status["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": claim}]
        pod = self._insert(PODS, {"metadata": meta, "spec": spec, "status": status})
        if claim:
            self._insert(RESOURCECLAIMS, _claim(claim, pod, devices or [], driver))
        return pod

    def publish_devices(self, node: str, devices: list[Obj], *, driver: str = DRA_DRIVER,
                        per_gpu: bool = False) -> list[Obj]:
        """What NVIDIA's DRA driver's kubelet plugin publishes through the resourceslice
        controller (k8s.io/dynamic-resource-allocation; driver main at 22407113, May
        2026): one pool named after the node, in one slice, or with `per_gpu` (its
        DynamicMIG layout on 1.34) one slice per device, each carrying the pool's
        resourceSliceCount. When the devices change the pool's generation is raised and
        the slices are rewritten one write at a time, as the controller does, so a
        watcher sees old and new generations side by side in between."""
        selector = f"spec.nodeName={node},spec.driver={driver}"
        existing = sorted(self._select(RESOURCESLICES, None, selector, ""),
                          key=lambda s: s["metadata"]["name"])
        chunks = [[d] for d in devices] if per_gpu else [devices]
        if existing and [d for s in existing for d in s["spec"].get("devices") or []] == devices \
                and len(existing) == len(chunks):
            return existing
        generation = max((s["spec"]["pool"]["generation"] for s in existing), default=0) + 1
        pool = {"name": node, "generation": generation, "resourceSliceCount": len(chunks)}
        written = []
        for i, chunk in enumerate(chunks):
            if i < len(existing):
                def change(slice_: Obj, chunk: list[Obj] = chunk) -> Obj:
                    slice_["spec"]["devices"] = copy.deepcopy(chunk)
                    slice_["spec"]["pool"] = dict(pool)
                    return slice_

                written.append(self.update(RESOURCESLICES, None,
                                           existing[i]["metadata"]["name"], change))
            else:
                written.append(self.create(RESOURCESLICES, None, {
                    "metadata": {"generateName": f"{node}-{driver}-"},
                    "spec": {"driver": driver, "nodeName": node, "pool": dict(pool),
                             "devices": copy.deepcopy(chunk)},
                }))  # fmt: skip
        for stale in existing[len(chunks):]:
            self.delete(RESOURCESLICES, None, stale["metadata"]["name"])
        return written

    def withdraw_devices(self, node: str, *, driver: str = DRA_DRIVER) -> None:
        """The node's slices of `driver` deleted (a kubelet wipes them as it starts)."""
        for slice_ in list(self._select(RESOURCESLICES, None,
                                        f"spec.nodeName={node},spec.driver={driver}", "")):
            self.delete(RESOURCESLICES, None, slice_["metadata"]["name"])

    def add_device_class(self, name: str = DRA_DRIVER, *, driver: str = DRA_DRIVER) -> Obj:
        """The DeviceClass a DRA driver installs: every device of `driver`."""
        return self.create(DEVICECLASSES, None, {
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
        })  # fmt: skip

    def slices(self, node: str | None = None) -> list[Obj]:
        selector = f"spec.nodeName={node}" if node is not None else ""
        return self.list(RESOURCESLICES, None, field_selector=selector)["items"]

    def claims(self, namespace: str | None = None) -> list[Obj]:
        return self.list(RESOURCECLAIMS, namespace)["items"]

    def add_pdb(
        self,
        name: str,
        *,
        match_labels: dict[str, str],
        namespace: str = "default",
        min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
    ) -> Obj:
        spec: Obj = {"selector": {"matchLabels": dict(match_labels)}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        return self.create(PDBS, namespace, {"metadata": {"name": name}, "spec": spec})

    def set_pod_ready(self, namespace: str, name: str, ready: bool = True) -> Obj:
        def change(pod: Obj) -> Obj:
            status = pod["status"]
            status["phase"] = "Running" if ready else status.get("phase", "Running")
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
            status["conditions"] = conditions + [pod_ready_condition(ready)]
            return pod

        return self.update(PODS, namespace, name, change, subresource="status")

    def node(self, name: str) -> Obj:
        return self.get(NODES, None, name)

    def pod(self, namespace: str, name: str) -> Obj | None:
        try:
            return self.get(PODS, namespace, name)
        except ApiError:
            return None

    def pods(self, node: str | None = None) -> list[Obj]:
        selector = f"spec.nodeName={node}" if node is not None else ""
        return self.list(PODS, None, field_selector=selector)["items"]


def gpu_status(gpus: int, *, resource: str = "nvidia.com/gpu", replicas: int = 1,
               mig: dict[str, int] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(GPU Feature Discovery labels, allocatable) of a node with `gpus` physical GPUs,
    as the NVIDIA device plugin and GFD publish them: `replicas` > 1 is time-slicing
    (``nvidia.com/gpu.replicas``, allocatable GPUs × replicas); `mig` maps MIG profiles
    to devices per GPU, mixed strategy (``nvidia.com/mig-<profile>`` resources and
    ``.count`` labels, the fully partitioned GPUs no longer ``nvidia.com/gpu``)."""
    labels = {"nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
              "nvidia.com/gpu.present": "true"}  # fmt: skip
    if mig:
        labels["nvidia.com/mig.strategy"] = "mixed"
        allocatable = {resource: "0"}
        for profile, per_gpu in mig.items():
            labels[f"nvidia.com/mig-{profile}.count"] = str(per_gpu * gpus)
            allocatable[f"nvidia.com/mig-{profile}"] = str(per_gpu * gpus)
        return labels, allocatable
    labels["nvidia.com/gpu.replicas"] = str(replicas)
    if replicas > 1:
        labels["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
    return labels, {resource: str(gpus * replicas)}


def gpu_device(index: int, uuid_: str, *, product: str = "NVIDIA A100-SXM4-80GB",
               memory: str = "81920Mi", taints: list[Obj] | None = None) -> Obj:
    """One GPU as NVIDIA's DRA driver (gpu.nvidia.com, main at 22407113, May 2026:
    cmd/gpu-kubelet-plugin/deviceinfo.go GpuInfo.GetDevice) publishes it in a
    resource.k8s.io/v1 ResourceSlice: named gpu-<minor>, typed attributes in short form
    but the PCI ones fully qualified, memory capacity. With its NVMLDeviceHealthCheck
    gate on, an unhealthy GPU stays in the slice with device `taints` (see
    `health_taint`); release v25.12.0 removed it from the slice instead."""
    device: Obj = {
        "name": f"gpu-{index}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid_},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "570.172.8"},
            "cudaDriverVersion": {"version": "12.8.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{index + 1:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{index:02x}"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    if taints:
        device["taints"] = copy.deepcopy(taints)
    return device


def health_taint(kind: str = "gpu-lost", value: str | None = None) -> Obj:
    """The device taint NVIDIA's driver (main at 22407113, device_health.go
    healthEventToTaint) puts on a GPU its NVML health check finds unhealthy:
    gpu.nvidia.com/gpu-lost (NoSchedule), gpu.nvidia.com/xid=<n> (NoSchedule, None for
    an XID it deems non-fatal), gpu.nvidia.com/unmonitored (None)."""
    effect = "None" if kind == "unmonitored" or (kind == "xid" and value == "43") \
        else "NoSchedule"
    taint: Obj = {"key": f"{DRA_DRIVER}/{kind}", "effect": effect,
                  "timeAdded": "2026-01-01T00:00:00Z"}
    if value is not None:
        taint["value"] = value
    return taint


def mig_device(gpu: int, slot: int, parent_uuid: str, *, profile: str = "1g.10gb") -> Obj:
    """One MIG instance of GPU `gpu` as NVIDIA's DRA driver publishes it: its own UUID,
    its GPU's as ``parentUUID``."""
    return {
        "name": f"gpu-{gpu}-mig-{profile.replace('.', '')}-{slot}",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{uuid.uuid5(uuid.NAMESPACE_URL, f'{parent_uuid}/{slot}')}"},
            "parentUUID": {"string": parent_uuid},
            "profile": {"string": profile},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            "index": {"int": gpu},
        },
        "capacity": {"memory": {"value": "9728Mi"}},
    }


def _claim(name: str, pod: Obj, devices: list[str], driver: str) -> Obj:
    """A ResourceClaim made from a pod's template, allocated `devices` and reserved for it."""
    meta = pod["metadata"]
    node = pod["spec"].get("nodeName", "")
    return {
        "metadata": {
            "name": name, "namespace": meta["namespace"],
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": driver, "allocationMode": "ExactCount",
            "count": len(devices)}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": driver, "pool": node,
                                         "device": d} for d in devices]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}],
        },
    }  # fmt: skip


def owner_reference(kind: str, name: str) -> Obj:
    return {
        "apiVersion": _OWNER_API.get(kind, "v1"),
        "kind": kind,
        "name": name,
        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{kind}/{name}")),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def ready_condition(status: str) -> Obj:
    """A node's Ready condition as the kubelet (True/False) or node controller (Unknown) writes it."""
    reason, message = {
        "True": ("KubeletReady", "kubelet is posting ready status"),
        "False": ("KubeletNotReady", "container runtime network not ready: NetworkReady=false"),
        "Unknown": ("NodeStatusUnknown", "Kubelet stopped posting node status."),
    }[status]
    stamp = now()
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def pod_ready_condition(ready: bool) -> Obj:
    return {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now()}
