"""The API server's rules that need no state: Status errors, selectors, patches, validation.

Each rule follows what kube-apiserver does (k8s.io/apimachinery and
pkg/registry/core/...), down to the messages a client reads, because the adapter under
test makes decisions on codes, reasons and messages. Nothing here does I/O.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]


def now() -> str:
    """A timestamp as the API writes it: RFC 3339, whole seconds, UTC."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- resources -------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    group: str  # "" for the core group
    version: str
    namespaced: bool
    fields: tuple[str, ...]  # what a fieldSelector may name

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """How messages name the resource: ``pods``, ``poddisruptionbudgets.policy``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


NODES = Resource("nodes", "Node", "", "v1", False, ("metadata.name", "spec.unschedulable"))
PODS = Resource(
    "pods",
    "Pod",
    "",
    "v1",
    True,
    (
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
)
PDBS = Resource(
    "poddisruptionbudgets", "PodDisruptionBudget", "policy", "v1", True,
    ("metadata.name", "metadata.namespace"),
)  # fmt: skip
EVENTS = Resource(
    "events", "Event", "", "v1", True,
    ("metadata.name", "metadata.namespace", "involvedObject.kind",
     "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
     "involvedObject.apiVersion", "involvedObject.resourceVersion",
     "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"),
)  # fmt: skip
# Stored as sent: `kubectl drain` reads the DaemonSet that owns a pod before leaving it.
DAEMONSETS = Resource(
    "daemonsets", "DaemonSet", "apps", "v1", True, ("metadata.name", "metadata.namespace")
)
# The kubelet's heartbeat in kube-node-lease, which `kubectl describe node` shows.
LEASES = Resource(
    "leases", "Lease", "coordination.k8s.io", "v1", True, ("metadata.name", "metadata.namespace")
)
# Dynamic Resource Allocation (resource.k8s.io/v1, GA in 1.34): a DRA driver publishes
# each node's devices in ResourceSlices; a pod gets devices through a ResourceClaim that
# the scheduler allocates and reserves for it.
DEVICECLASSES = Resource(
    "deviceclasses", "DeviceClass", "resource.k8s.io", "v1", False, ("metadata.name",)
)
RESOURCESLICES = Resource(
    "resourceslices", "ResourceSlice", "resource.k8s.io", "v1", False,
    ("metadata.name", "spec.nodeName", "spec.driver"),
)  # fmt: skip
RESOURCECLAIMS = Resource(
    "resourceclaims", "ResourceClaim", "resource.k8s.io", "v1", True,
    ("metadata.name", "metadata.namespace"),
)  # fmt: skip
RESOURCES = (NODES, PODS, PDBS, EVENTS, DAEMONSETS, LEASES, DEVICECLASSES, RESOURCESLICES,
             RESOURCECLAIMS)  # fmt: skip


# --- Status errors ---------------------------------------------------------------------


class ApiError(Exception):
    """An error answer; `status()` is the body kube-apiserver would send."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Obj | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = dict(headers or {})

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(resource: Resource, name: str) -> Obj:
    details: Obj = {"name": name}
    if resource.group:
        details["group"] = resource.group
    details["kind"] = resource.plural
    return details


def not_found(resource: Resource, name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'{resource.group_resource} "{name}" not found', _details(resource, name)
    )


def already_exists(resource: Resource, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{resource.group_resource} "{name}" already exists',
        _details(resource, name),
    )


def conflict(resource: Resource, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource.group_resource} "{name}": {why}',
        _details(resource, name),
    )


MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def uid_conflict(resource: Resource, name: str, wanted: str, actual: str) -> ApiError:
    return conflict(
        resource,
        name,
        f"Precondition failed: UID in precondition: {wanted}, UID in object meta: {actual}",
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(resource: Resource, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 Invalid; each cause is (field, cause reason, message)."""
    text = "; ".join(f"{f}: {m}" for f, _, m in causes)
    if len(causes) > 1:
        text = f"[{', '.join(f'{f}: {m}' for f, _, m in causes)}]"
    return ApiError(
        422,
        "Invalid",
        f'{resource.kind} "{name}" is invalid: {text}',
        {
            "name": name,
            **({"group": resource.group} if resource.group else {}),
            "kind": resource.kind,
            "causes": [{"reason": r, "message": f"{m}", "field": f} for f, r, m in causes],
        },
    )


def internal_error(message: str) -> ApiError:
    return ApiError(
        500,
        "InternalError",
        f"Internal error occurred: {message}",
        {"causes": [{"message": message}]},
    )


def too_many_requests(message: str, causes: list[Obj] | None = None) -> ApiError:
    return ApiError(429, "TooManyRequests", message, {"causes": causes} if causes else {})


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(PATCH_TYPES)}",
        {},
    )


def not_modelled(what: str) -> ApiError:
    # The real server would do something here; this stand-in does not pretend to.
    return bad_request(f"not modelled by the Kubernetes API stand-in: {what}")


# --- selectors -------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # In, NotIn, Exists, DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "Exists":
            return self.key in labels
        if self.op == "DoesNotExist":
            return self.key not in labels
        if self.op == "In":
            return labels.get(self.key) in self.values
        # NotIn (and !=) match an object without the label, as in apimachinery.
        return labels.get(self.key) not in self.values


_SET = re.compile(r"([^\s!=(),]+)\s+(in|notin)\s+\(([^()]*)\)")
_EQUALITY = re.compile(r"([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)")
_EXISTS = re.compile(r"(!?)\s*([^\s!=(),]+)")


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def parse_label_selector(text: str) -> list[Requirement]:
    """``a=b,c!=d,e in (x,y),!f,g`` as requirements that must all hold."""
    if not text.strip():
        return []
    requirements = []
    for part in _split_top(text):
        if m := _SET.fullmatch(part):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            op = "In" if m.group(2) == "in" else "NotIn"
            requirements.append(Requirement(m.group(1), op, values))
        elif m := _EQUALITY.fullmatch(part):
            op = "NotIn" if m.group(2) == "!=" else "In"
            requirements.append(Requirement(m.group(1), op, frozenset([m.group(3)])))
        elif m := _EXISTS.fullmatch(part):
            requirements.append(Requirement(m.group(2), "DoesNotExist" if m.group(1) else "Exists"))
        else:
            raise bad_request(f"unable to parse requirement: found '{part}', expected: identifier")
    return requirements


def selector_requirements(selector: Obj | None) -> list[Requirement] | None:
    """A LabelSelector object as requirements; None (matches nothing) for a null selector."""
    if selector is None:
        return None
    requirements = [
        Requirement(k, "In", frozenset([v])) for k, v in (selector.get("matchLabels") or {}).items()
    ]
    for e in selector.get("matchExpressions") or []:
        requirements.append(Requirement(e["key"], e["operator"], frozenset(e.get("values") or [])))
    return requirements


def labels_match(requirements: Iterable[Requirement] | None, labels: Mapping[str, str]) -> bool:
    if requirements is None:
        return False
    return all(r.matches(labels) for r in requirements)


def parse_field_selector(text: str, resource: Resource) -> list[tuple[str, bool, str]]:
    """``spec.nodeName=x,status.phase!=Failed`` as (field, equal, value) terms."""
    terms = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", part)
        if m is None:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        name, op, value = m.groups()
        if name not in resource.fields:
            raise bad_request(f"field label not supported: {name}")
        terms.append((name, op != "!=", value))
    return terms


def field_value(obj: Obj, path: str) -> str:
    if path == "source" and obj.get("kind", "Event") == "Event" and "involvedObject" in obj:
        path = "source.component"  # the event registry's name for it
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def fields_match(terms: Iterable[tuple[str, bool, str]], obj: Obj) -> bool:
    return all((field_value(obj, name) == value) == equal for name, equal, value in terms)


# --- patches ---------------------------------------------------------------------------

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, APPLY_PATCH, STRATEGIC_MERGE_PATCH)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes a key, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists with a patch merge key, by field name, as the Go types declare them for the
# objects modelled here (NodeStatus, PodSpec, PodStatus, ObjectMeta). Every other list
# is atomic: a patch replaces it whole. That includes spec.taints, which is why an
# adapter must read, change and write taints back with a resourceVersion.
_MERGE_KEYS = {
    "conditions": "type",
    "addresses": "type",
    "ownerReferences": "uid",
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
_MERGE_PRIMITIVES = {"finalizers"}
_DELETE = object()


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch, for the directives kubectl and kubelets send."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return _DELETE
    if directive not in (None, "merge"):
        raise bad_request(f"unknown patch type: {directive}")
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key == "$patch" or key.startswith("$setElementOrder/"):
            continue  # order only; the stand-in keeps the existing order
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in value]
            continue
        if key.startswith("$"):
            raise not_modelled(f"strategic merge directive {key}")
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in _MERGE_KEYS:
            result[key] = _merge_list(result.get(key) or [], value, _MERGE_KEYS[key])
        elif isinstance(value, list) and key in _MERGE_PRIMITIVES:
            current = list(result.get(key) or [])
            result[key] = current + [v for v in value if v not in current]
        else:
            merged = strategic_merge_patch(result.get(key), value)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
    return result


def _merge_list(current: list[Any], items: list[Any], key: str) -> list[Any]:
    out = [copy.deepcopy(x) for x in current]
    for item in items:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == item[key]), None)  # fmt: skip
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(strategic_merge_patch({}, item))
        else:
            out[at] = strategic_merge_patch(out[at], item)
    return out


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy and test."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(doc)
    for op in operations:
        try:
            doc = _json_patch_op(doc, op)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(
                422,
                "Invalid",
                "the server rejected our request due to an error in our request",
                {"causes": [{"reason": "UnexpectedServerResponse", "message": str(e)}]},
            ) from None
    return doc


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> Any:
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _json_patch_op(doc: Any, op: Any) -> Any:
    kind = op["op"]
    parts = _pointer(op["path"])
    if kind == "test":
        if _get(doc, parts) != op["value"]:
            raise ValueError(f"testing value {op['path']} failed")
        return doc
    if kind in ("move", "copy"):
        value = copy.deepcopy(_get(doc, _pointer(op["from"])))
        if kind == "move":
            doc = _remove(doc, _pointer(op["from"]))
        return _add(doc, parts, value)
    if kind == "remove":
        return _remove(doc, parts)
    if kind == "add":
        return _add(doc, parts, copy.deepcopy(op["value"]))
    if kind == "replace":
        _get(doc, parts)  # must exist
        doc = _remove(doc, parts)
        return _add(doc, parts, copy.deepcopy(op["value"]))
    raise ValueError(f"unexpected operation {kind!r}")


def _get(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _parent(doc, parts)
    if isinstance(parent, list):
        if parts[-1] == "-":
            parent.append(value)
        else:
            index = int(parts[-1])
            if not 0 <= index <= len(parent):
                raise IndexError(f"add operation does not apply: index {index} out of bounds")
            parent.insert(index, value)
    elif isinstance(parent, dict):
        parent[parts[-1]] = value
    else:
        raise TypeError(f"add operation does not apply: doc is missing path: {'/'.join(parts)}")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    parent = _parent(doc, parts)
    if isinstance(parent, list):
        del parent[int(parts[-1])]
    else:
        del parent[parts[-1]]
    return doc


def apply_patch(content_type: str, target: Obj, body: bytes) -> Any:
    kind = content_type.split(";")[0].strip().lower()
    if kind not in PATCH_TYPES:
        raise unsupported_media_type(kind)
    if kind == APPLY_PATCH:
        raise not_modelled("server-side apply")
    try:
        patch = json.loads(body)
    except ValueError as e:
        raise bad_request(f"error decoding patch: {e}") from None
    if kind == JSON_PATCH:
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        raise bad_request(
            "json: cannot unmarshal array into Go value of type map[string]interface {}"
        )
    if kind == MERGE_PATCH:
        return merge_patch(target, patch)
    return strategic_merge_patch(target, patch)


# --- validation ------------------------------------------------------------------------

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "PreferNoSchedule")


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a valid label or annotation key, or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not _NAME_PART.fullmatch(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
    return None


def _go_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "value")


def check_shape(obj: Obj) -> None:
    """What decoding into the Go types would refuse, as the server's 400 says it."""
    for section in ("metadata", "spec", "status"):
        if section in obj and not isinstance(obj[section], dict):
            raise bad_request(
                f"json: cannot unmarshal {_go_type(obj[section])} into Go struct field "
                f".{section} of type object"
            )
    meta = obj.get("metadata", {})
    for name in ("labels", "annotations"):
        values = meta.get(name)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise bad_request(
                f"json: cannot unmarshal {_go_type(values)} into Go struct field "
                f"ObjectMeta.metadata.{name} of type map[string]string"
            )
        for v in values.values():
            if not isinstance(v, str):
                raise bad_request(
                    f"json: cannot unmarshal {_go_type(v)} into Go struct field "
                    f"ObjectMeta.metadata.{name} of type string"
                )
    unschedulable = obj.get("spec", {}).get("unschedulable")
    if unschedulable is not None and not isinstance(unschedulable, bool):
        raise bad_request(
            f"json: cannot unmarshal {_go_type(unschedulable)} into Go struct field "
            "NodeSpec.spec.unschedulable of type bool"
        )


def validate(resource: Resource, obj: Obj) -> None:
    """422 Invalid for what the registry's validation refuses (the parts modelled)."""
    name = obj["metadata"].get("name", "")
    causes: list[tuple[str, str, str]] = []
    for section in ("labels", "annotations"):
        for key in obj["metadata"].get(section) or {}:
            problem = qualified_name_problem(key)
            if problem:
                causes.append(
                    (
                        f"metadata.{section}",
                        "FieldValueInvalid",
                        f'Invalid value: "{key}": {problem}',
                    )
                )
    if resource is NODES:
        taints = obj.get("spec", {}).get("taints") or []
        seen: set[tuple[str, str]] = set()
        for i, taint in enumerate(taints):
            where = f"spec.taints[{i}]"
            if not isinstance(taint, dict):
                raise bad_request(
                    f"json: cannot unmarshal {_go_type(taint)} into Go struct field "
                    "NodeSpec.spec.taints of type core.Taint"
                )
            key, effect = taint.get("key", ""), taint.get("effect", "")
            if not key:
                causes.append((f"{where}.key", "FieldValueRequired", "Required value"))
            elif qualified_name_problem(key):
                causes.append((f"{where}.key", "FieldValueInvalid", f'Invalid value: "{key}"'))
            if effect not in TAINT_EFFECTS:
                causes.append(
                    (
                        f"{where}.effect",
                        "FieldValueNotSupported",
                        f'Unsupported value: "{effect}": supported values: '
                        + ", ".join(f'"{e}"' for e in TAINT_EFFECTS),
                    )
                )
            if (key, effect) in seen:
                causes.append(
                    (
                        "spec.taints",
                        "FieldValueDuplicate",
                        f'Duplicate value: "{key}:{effect}": taints must be unique by key and effect pair',
                    )
                )
            seen.add((key, effect))
    if causes:
        raise invalid(resource, name, causes)


def normalize(obj: Obj) -> Obj:
    """Drop what Go's ``omitempty`` would not write: false flags, empty maps and lists."""
    meta = obj.get("metadata", {})
    for name in ("labels", "annotations"):
        if name in meta and not meta[name]:
            del meta[name]
    spec = obj.get("spec")
    if isinstance(spec, dict):
        if spec.get("unschedulable") is False:
            del spec["unschedulable"]
        if "taints" in spec and not spec["taints"]:
            del spec["taints"]
    return obj
