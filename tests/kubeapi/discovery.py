"""What a real ``kubectl`` asks before and besides the objects: discovery and Tables.

kubectl finds out from the server which resources exist (``/api``, ``/apis``, then one
``APIResourceList`` per group version) before any command, and ``kubectl get`` asks
for objects as a server-side ``Table`` (``Accept: application/json;as=Table;v=v1;
g=meta.k8s.io``) whose columns the server's printers choose. This module answers both,
from the resources the stand-in models, the way kube-apiserver does: legacy discovery
only (a client asking for the aggregated ``apidiscovery.k8s.io/v2`` form gets the
legacy one with ``Content-Type: application/json`` and falls back to it, as it does
with any server older than 1.26), and the columns of pkg/printers/internalversion for
nodes, pods, events, PodDisruptionBudgets, DeviceClasses, ResourceSlices and
ResourceClaims. Nothing here does I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tests.kubeapi.rules import (
    DAEMONSETS,
    DEVICECLASSES,
    EVENTS,
    NODES,
    PDBS,
    PODS,
    RESOURCECLAIMS,
    RESOURCES,
    RESOURCESLICES,
    Obj,
    Resource,
)

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
_SHORT = {"nodes": ["no"], "pods": ["po"], "events": ["ev"], "poddisruptionbudgets": ["pdb"],
          "daemonsets": ["ds"]}  # fmt: skip
_CATEGORIES = {"pods": ["all"], "daemonsets": ["all"]}


def api_versions(server: str) -> Obj:
    """``GET /api``: the core group's versions."""
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}],
    }


def _groups() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for r in RESOURCES:
        if r.group and r.version not in groups.setdefault(r.group, []):
            groups[r.group].append(r.version)
    return groups


def _group(name: str, versions: list[str]) -> Obj:
    listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": listed, "preferredVersion": listed[0]}


def api_group_list() -> Obj:
    """``GET /apis``: every named group the stand-in serves."""
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(name, versions) for name, versions in _groups().items()],
    }


def api_group(name: str) -> Obj | None:
    """``GET /apis/<group>``."""
    versions = _groups().get(name)
    if versions is None:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, versions)}


def _entry(r: Resource) -> Obj:
    entry: Obj = {
        "name": r.plural,
        "singularName": r.kind.lower(),
        "namespaced": r.namespaced,
        "kind": r.kind,
        "verbs": list(_VERBS),
    }
    if r.plural in _SHORT:
        entry["shortNames"] = _SHORT[r.plural]
    if r.plural in _CATEGORIES:
        entry["categories"] = _CATEGORIES[r.plural]
    return entry


def _sub(r: Resource, sub: str, **extra: Any) -> Obj:
    return {"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
            "kind": r.kind, "verbs": ["get", "patch", "update"], **extra}  # fmt: skip


def api_resource_list(group: str, version: str) -> Obj | None:
    """``GET /api/v1`` or ``/apis/<group>/<version>``: the resources and subresources."""
    resources: list[Obj] = []
    for r in RESOURCES:
        if (r.group, r.version) != (group, version):
            continue
        resources.append(_entry(r))
        if r in (NODES, PODS, PDBS, DAEMONSETS, RESOURCECLAIMS):
            resources.append(_sub(r, "status"))
        if r is PODS:
            # What `kubectl drain` looks for before it evicts (CheckEvictionSupport).
            resources.append({"name": "pods/eviction", "singularName": "", "namespaced": True,
                              "group": "policy", "version": "v1", "kind": "Eviction",
                              "verbs": ["create"]})  # fmt: skip
    if not resources:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


# --- Tables ------------------------------------------------------------------------------


def wants_table(accept: str) -> bool:
    """Whether the client asked for a meta.k8s.io/v1 Table (kubectl get does)."""
    for option in accept.split(","):
        params = {p.strip().partition("=")[0]: p.strip().partition("=")[2]
                  for p in option.split(";")[1:]}  # fmt: skip
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io" and \
                params.get("v", "v1") == "v1":
            return True
    return False


def _column(name: str, kind: str = "string", *, priority: int = 0, fmt: str = "",
            description: str = "") -> Obj:  # fmt: skip
    return {"name": name, "type": kind, "format": fmt, "description": description,
            "priority": priority}  # fmt: skip


def _age(stamp: str | None, now: datetime | None = None) -> str:
    """k8s.io/apimachinery duration.HumanDuration, as the printers show ages."""
    if not stamp:
        return "<unknown>"
    then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        s = seconds % 60
        return f"{minutes}m{s}s" if s else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = seconds // 3600
    if hours < 8:
        m = minutes % 60
        return f"{hours}h{m}m" if m else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def _none(value: Any) -> Any:
    return "<none>" if value in (None, "") else value


def _node_row(node: Obj) -> list[Any]:
    status = node.get("status") or {}
    ready = next((c.get("status") for c in status.get("conditions") or []
                  if c.get("type") == "Ready"), None)  # fmt: skip
    shown = {"True": "Ready", "False": "NotReady"}.get(ready or "", "Unknown")
    if (node.get("spec") or {}).get("unschedulable"):
        shown += ",SchedulingDisabled"
    labels = node["metadata"].get("labels") or {}
    roles = sorted(k.split("/", 1)[1] for k in labels
                   if k.startswith("node-role.kubernetes.io/") and "/" in k)  # fmt: skip
    info = status.get("nodeInfo") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    return [node["metadata"]["name"], shown, ",".join(roles) or "<none>",
            _age(node["metadata"].get("creationTimestamp")), info.get("kubeletVersion", ""),
            _none(addresses.get("InternalIP")), _none(addresses.get("ExternalIP")),
            _none(info.get("osImage")) if info else "<unknown>",
            _none(info.get("kernelVersion")) if info else "<unknown>",
            _none(info.get("containerRuntimeVersion")) if info else "<unknown>"]  # fmt: skip


_NODE_COLUMNS = [
    _column("Name", fmt="name"), _column("Status"), _column("Roles"), _column("Age"),
    _column("Version"), _column("Internal-IP", priority=1), _column("External-IP", priority=1),
    _column("OS-Image", priority=1), _column("Kernel-Version", priority=1),
    _column("Container-Runtime", priority=1),
]  # fmt: skip


def _pod_row(pod: Obj) -> list[Any]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    containers = spec.get("containers") or []
    statuses = status.get("containerStatuses")
    if statuses is not None:
        ready = sum(1 for c in statuses if c.get("ready"))
        restarts = sum(int(c.get("restartCount", 0)) for c in statuses)
    else:  # the stand-in's pods carry the pod's Ready condition only
        pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in status.get("conditions") or [])  # fmt: skip
        ready, restarts = (len(containers) if pod_ready else 0), 0
    shown = status.get("reason") or status.get("phase") or "Unknown"
    if meta.get("deletionTimestamp"):
        shown = "Terminating"
    gates = spec.get("readinessGates")
    return [meta["name"], f"{ready}/{len(containers)}", shown, restarts,
            _age(meta.get("creationTimestamp")), _none(status.get("podIP")),
            _none(spec.get("nodeName")), _none(status.get("nominatedNodeName")),
            "<none>" if not gates else f"0/{len(gates)}"]  # fmt: skip


_POD_COLUMNS = [
    _column("Name", fmt="name"), _column("Ready"), _column("Status"),
    _column("Restarts", "string"), _column("Age"), _column("IP", priority=1),
    _column("Node", priority=1), _column("Nominated Node", priority=1),
    _column("Readiness Gates", priority=1),
]  # fmt: skip


def _event_row(event: Obj) -> list[Any]:
    involved = event.get("involvedObject") or {}
    source = event.get("source") or {}
    first = event.get("firstTimestamp") or event.get("eventTime")
    last = event.get("lastTimestamp") or first
    where = source.get("component") or event.get("reportingComponent") or ""
    if source.get("host"):
        where += f", {source['host']}"
    return [_age(last), event.get("type", ""), event.get("reason", ""),
            f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
            involved.get("fieldPath", ""), where, event.get("message", ""), _age(first),
            int(event.get("count") or 1), event["metadata"]["name"]]  # fmt: skip


_EVENT_COLUMNS = [
    _column("Last Seen"), _column("Type"), _column("Reason"), _column("Object"),
    _column("Subobject", priority=1), _column("Source", priority=1), _column("Message"),
    _column("First Seen", priority=1), _column("Count", "integer", priority=1),
    _column("Name", priority=1),
]  # fmt: skip


def _pdb_row(pdb: Obj) -> list[Any]:
    spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
    return [pdb["metadata"]["name"], str(spec.get("minAvailable", "N/A")),
            str(spec.get("maxUnavailable", "N/A")), int(status.get("disruptionsAllowed", 0)),
            _age(pdb["metadata"].get("creationTimestamp"))]  # fmt: skip


_PDB_COLUMNS = [_column("Name", fmt="name"), _column("Min Available"),
                _column("Max Unavailable"), _column("Allowed Disruptions", "integer"),
                _column("Age")]  # fmt: skip


def _slice_row(slice_: Obj) -> list[Any]:
    spec = slice_.get("spec") or {}
    return [slice_["metadata"]["name"], _none(spec.get("nodeName")), spec.get("driver", ""),
            (spec.get("pool") or {}).get("name", ""),
            _age(slice_["metadata"].get("creationTimestamp"))]  # fmt: skip


_SLICE_COLUMNS = [_column("Name", fmt="name"), _column("Node"), _column("Driver"),
                  _column("Pool"), _column("Age")]  # fmt: skip


def _claim_state(claim: Obj) -> str:
    """The printers' summary: deleted, pending or allocated, and reserved."""
    status = claim.get("status") or {}
    states = []
    if claim["metadata"].get("deletionTimestamp"):
        states.append("deleted")
    if status.get("allocation") is None:
        if not claim["metadata"].get("deletionTimestamp"):
            states.append("pending")
    else:
        states.append("allocated")
    if status.get("reservedFor"):
        states.append("reserved")
    return ",".join(states)


def _claim_row(claim: Obj) -> list[Any]:
    return [claim["metadata"]["name"], _claim_state(claim),
            _age(claim["metadata"].get("creationTimestamp"))]  # fmt: skip


_CLAIM_COLUMNS = [
    _column("Name", fmt="name"),
    _column("State", description="A summary of the current state (allocated, pending, "
            "reserved, etc.)."),
    _column("Age"),
]  # fmt: skip


def _default_row(obj: Obj) -> list[Any]:
    return [obj["metadata"]["name"], _age(obj["metadata"].get("creationTimestamp"))]


_TABLES = {
    NODES.plural: (_NODE_COLUMNS, _node_row),
    PODS.plural: (_POD_COLUMNS, _pod_row),
    EVENTS.plural: (_EVENT_COLUMNS, _event_row),
    PDBS.plural: (_PDB_COLUMNS, _pdb_row),
    DEVICECLASSES.plural: ([_column("Name", fmt="name"), _column("Age")], _default_row),
    RESOURCESLICES.plural: (_SLICE_COLUMNS, _slice_row),
    RESOURCECLAIMS.plural: (_CLAIM_COLUMNS, _claim_row),
}


def table(resource: Resource, objects: list[Obj], resource_version: str,
          include_object: str = "Metadata") -> Obj:  # fmt: skip
    """A meta.k8s.io/v1 Table of `objects`; each row carries the object as asked
    (``includeObject``: None, Metadata (the default) or Object)."""
    columns, row = _TABLES.get(resource.plural, (
        [_column("Name", fmt="name"), _column("Age")], _default_row))
    rows = []
    for obj in objects:
        entry: Obj = {"cells": row(obj)}
        if include_object == "Object":
            entry["object"] = {"kind": resource.kind, "apiVersion": resource.api_version, **obj}
        elif include_object != "None":
            entry["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                               "metadata": obj["metadata"]}  # fmt: skip
        rows.append(entry)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}  # fmt: skip
