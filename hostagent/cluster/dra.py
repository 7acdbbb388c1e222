"""Dynamic Resource Allocation (``resource.k8s.io/v1``): the lent GPUs as a DRA driver shows them.

On a DRA cluster the node has no ``nvidia.com/gpu`` in allocatable. NVIDIA's DRA driver
(``gpu.nvidia.com``) publishes each GPU the node sees as a device in the node's
ResourceSlices, its UUID among the device's attributes (a MIG device names its GPU as
``parentUUID``); a pod gets GPUs through a ResourceClaim, which the scheduler allocates
(driver, pool, device) and reserves for the pod. So here a lend is verified by UUID
(the slices list exactly the lent GPUs), a GPU lost is a lent UUID gone from the
slices, and which pod holds which lent GPU is read from the claims the node's pods name.

`Slices` and `Claims` keep what the API shows (slices listed and watched, claims read
by name; objects of the kubernetes-asyncio models, read defensively: the text is the
cluster's), and the rest is pure: no I/O here; `hostagent.cluster.kube` does the requests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hostagent.core.text import clean

DRIVER = "gpu.nvidia.com"
_MAX_TEXT = 200  # a UUID or a name longer than this is nobody's

DeviceKey = tuple[str, str]  # (pool, device name), as a claim's allocation names it
V = TypeVar("V")


def _text(value: object) -> str | None:
    return clean(value) if isinstance(value, str) and 0 < len(value) <= _MAX_TEXT else None


def _uid(obj: Any) -> str | None:
    meta = getattr(obj, "metadata", None)
    return _text(getattr(meta, "uid", None))


def attribute(attributes: Mapping[str, Any], name: str, driver: str = DRIVER) -> Any:
    """An attribute by its short name or fully qualified by the driver's domain
    (``uuid`` or ``gpu.nvidia.com/uuid``: the API takes both as the same name)."""
    found = attributes.get(name)
    return found if found is not None else attributes.get(f"{driver}/{name}")


def device_uuid(device: Any, driver: str = DRIVER) -> str | None:
    """The UUID of the GPU a slice's device is, or is part of: a MIG device's
    ``parentUUID`` attribute (its own ``uuid`` is the MIG instance's), else its ``uuid``."""
    attributes = getattr(device, "attributes", None)
    if not isinstance(attributes, Mapping):
        return None
    for name in ("parentUUID", "uuid"):
        uuid = _text(getattr(attribute(attributes, name, driver), "string", None))
        if uuid is not None:
            return uuid
    return None


# A device taint of these effects keeps new pods off the device (NoExecute evicts those
# on it too): NVIDIA's driver marks a GPU its NVML health check finds lost or failing so
# (gpu.nvidia.com/gpu-lost, /xid), and an administrator's DeviceTaintRule the same way.
# Effect "None" is only informational (unmonitored, a non-fatal XID).
_UNUSABLE = frozenset({"NoSchedule", "NoExecute"})


def usable(device: Any) -> bool:
    """Whether the scheduler may still give the device out: no taint that forbids it."""
    return not any(getattr(t, "effect", None) in _UNUSABLE
                   for t in getattr(device, "taints", None) or [])


def _term_matches(term: Any, node: str, labels: Mapping[str, str]) -> bool:
    """One NodeSelectorTerm: every expression on the labels and field on the name."""
    for requirement, value_of in ((getattr(term, "match_expressions", None), labels.get),
                                  (getattr(term, "match_fields", None),
                                   {"metadata.name": node}.get)):
        for r in requirement or []:
            value, values = value_of(getattr(r, "key", "")), getattr(r, "values", None) or []
            operator = str(getattr(r, "operator", ""))
            if not {"In": value is not None and value in values,
                    "NotIn": value is None or value not in values,
                    "Exists": value is not None,
                    "DoesNotExist": value is None}.get(operator, False):
                return False
    return True


def selects(obj: Any, node: str, labels: Mapping[str, str]) -> bool:
    """Whether a slice or a device (``nodeName`` or ``nodeSelector``) is `node`'s; a
    device of ``allNodes`` (network-attached) is nobody's GPU in particular."""
    if getattr(obj, "node_name", None) == node:
        return True
    terms = getattr(getattr(obj, "node_selector", None), "node_selector_terms", None) or []
    return any(_term_matches(term, node, labels) for term in terms)


def claim_names(pod: Any) -> list[str]:
    """The ResourceClaims a pod uses, by name: those made for it from a template, as its
    status names them, those it names itself, and the one the scheduler made for its
    extended resources (``nvidia.com/gpu`` in a container's requests, on a node whose
    DeviceClass says ``extendedResourceName``, as NVIDIA's chart writes it: the
    DRAExtendedResource gate, alpha in 1.35), as ``status.extendedResourceClaimStatus``
    names it."""
    status = getattr(pod, "status", None)
    names = [getattr(s, "resource_claim_name", None)
             for s in getattr(status, "resource_claim_statuses", None) or []]
    names.append(getattr(getattr(status, "extended_resource_claim_status", None),
                         "resource_claim_name", None))
    names += [getattr(c, "resource_claim_name", None)
              for c in getattr(getattr(pod, "spec", None), "resource_claims", None) or []]
    return sorted({n for name in names if (n := _text(name)) is not None})


class _Watched(Generic[V]):
    """Objects of one kind by UID, as listed (`reset`) and watched (`apply` each event),
    each kept as what `_read` makes of it; one it makes nothing of is dropped."""

    def __init__(self, driver: str = DRIVER) -> None:
        self.driver = driver
        self._by_uid: dict[str, V] = {}

    def reset(self, items: Iterable[Any]) -> None:
        self._by_uid = {}
        for item in items:
            self.apply("ADDED", item)

    def apply(self, kind: str, obj: Any) -> None:
        uid = _uid(obj)
        if uid is None:
            return
        value = None if kind == "DELETED" else self._read(obj)
        if value is None:
            self._by_uid.pop(uid, None)
        else:
            self._by_uid[uid] = value

    def _read(self, obj: Any) -> V | None:
        raise NotImplementedError


@dataclass(frozen=True)
class _Slice:
    pool: str
    generation: int
    count: int  # resourceSliceCount: the slices the pool has at this generation
    devices: dict[str, str]  # the node's devices here: name -> UUID
    tainted: frozenset[str]  # those a taint keeps pods off (see `usable`)
    ours: bool  # the slice, or one of its devices, is the node's


class Slices(_Watched[_Slice]):
    """The devices of `driver` that are `node`'s, in the ResourceSlices listed and
    watched: slices of the node (``nodeName``, or a ``nodeSelector`` that selects it)
    and devices of it in slices of ``perDeviceNodeSelection``.

    A pool may be spread over several slices and is republished under a higher
    generation when it changes, one slice at a time; as the scheduler does, only the
    newest generation of each pool counts, and only once all its slices are in
    (`incomplete` names the pools that are not). A device tainted so that nothing may
    be scheduled on it (the driver's health check) is not counted."""

    def __init__(self, driver: str = DRIVER, node: str = "",
                 labels: Mapping[str, str] | None = None) -> None:
        super().__init__(driver)
        self.node = node
        self.labels = dict(labels) if labels is not None else {"kubernetes.io/hostname": node}

    def _read(self, obj: Any) -> _Slice | None:
        spec = getattr(obj, "spec", None)
        if spec is None or getattr(spec, "driver", None) != self.driver:
            return None
        pool = getattr(spec, "pool", None)
        generation, count = getattr(pool, "generation", 0), getattr(pool, "resource_slice_count", 1)
        per_device = getattr(spec, "per_device_node_selection", None) is True
        ours = not per_device and (not self.node or selects(spec, self.node, self.labels))
        devices, tainted = {}, set()
        for device in getattr(spec, "devices", None) or []:
            if per_device and not selects(device, self.node, self.labels):
                continue
            device_name = _text(getattr(device, "name", None))
            uuid = device_uuid(device, self.driver)
            if device_name is not None and uuid is not None:
                ours = True
                devices[device_name] = uuid
                if not usable(device):
                    tainted.add(device_name)
        if not ours:
            return None
        return _Slice(_text(getattr(pool, "name", None)) or "",
                      generation if isinstance(generation, int) else 0,
                      count if isinstance(count, int) and count > 0 else 1, devices,
                      frozenset(tainted), ours)

    def _newest(self) -> dict[str, list[_Slice]]:
        newest: dict[str, list[_Slice]] = {}
        for s in self._by_uid.values():
            kept = newest.setdefault(s.pool, [s])
            if s.generation > kept[0].generation:
                newest[s.pool] = [s]
            elif s.generation == kept[0].generation and s is not kept[0]:
                kept.append(s)
        return newest

    def every(self) -> dict[DeviceKey, str]:
        """(pool, device name) -> UUID of every device of the node's, tainted or of a
        pool being rewritten included: a pod may hold one all the same."""
        return {(s.pool, name): uuid for s in self._by_uid.values()
                for name, uuid in s.devices.items()}

    def incomplete(self) -> list[str]:
        """The pools whose newest generation lacks some of its slices: not yet known."""
        return sorted(f"{pool} (generation {s[0].generation}: {len(s)} of {s[0].count} "
                      "slices)" for pool, s in self._newest().items() if len(s) < s[0].count)

    def devices(self) -> dict[DeviceKey, str]:
        """(pool, device name) -> UUID of the usable devices of the complete pools."""
        return {(pool, name): uuid for pool, kept in self._newest().items()
                if len(kept) >= kept[0].count for s in kept
                for name, uuid in s.devices.items() if name not in s.tainted}

    def uuids(self) -> frozenset[str] | None:
        """The UUIDs of the node's usable GPUs; None while a pool is incomplete."""
        return None if self.incomplete() else frozenset(self.devices().values())


class Claims(_Watched[tuple[tuple[DeviceKey, ...], tuple[str, ...]]]):
    """ResourceClaims as read (those the node's pods name): for each, the devices of
    `driver` it was allocated and the pods (by UID) it is reserved for."""

    def _read(self, obj: Any) -> tuple[tuple[DeviceKey, ...], tuple[str, ...]] | None:
        status = getattr(obj, "status", None)
        allocation = getattr(status, "allocation", None)
        results = getattr(getattr(allocation, "devices", None), "results", None) or []
        # A claim with admin access (monitoring, diagnostics) shares the device with
        # whoever holds it and holds nothing itself.
        devices = tuple((pool, device) for r in results
                        if getattr(r, "driver", None) == self.driver
                        and getattr(r, "admin_access", None) is not True
                        and (pool := _text(getattr(r, "pool", None))) is not None
                        and (device := _text(getattr(r, "device", None))) is not None)
        pods = tuple(pod for ref in getattr(status, "reserved_for", None) or []
                     if getattr(ref, "resource", None) == "pods"
                     and (pod := _text(getattr(ref, "uid", None))) is not None)
        return (devices, pods) if devices and pods else None

    def pods_of(self, devices: Collection[DeviceKey]) -> frozenset[str]:
        """The UIDs of the pods a claim allocated one of `devices` is reserved for."""
        wanted = set(devices)
        return frozenset(uid for keys, uids in self._by_uid.values()
                         if wanted.intersection(keys) for uid in uids)

    def holders(self, devices: Mapping[DeviceKey, str],
                pods: Mapping[str, str]) -> dict[str, str]:
        """UUID -> the pods ("namespace/name", comma-separated) holding that device, for
        the `devices` of the node's slices and the `pods` (UID -> name) running on it."""
        held: dict[str, set[str]] = {}
        for keys, uids in self._by_uid.values():
            names = {pods[u] for u in uids if u in pods}
            for key in keys:
                if key in devices and names:
                    held.setdefault(devices[key], set()).update(names)
        return {uuid: ",".join(sorted(names)) for uuid, names in sorted(held.items())}


def mismatch(lent: Mapping[str, str | None], seen: Collection[str], *, driver: str = DRIVER,
             node: str = "the node", incomplete: Collection[str] = ()) -> str | None:
    """None when the node's slices list exactly the lent GPUs, else what differs, each
    GPU named. `lent`: label -> UUID (None: no UUID configured, matched by count).
    `incomplete`: pools not all in, which leave the answer unknown."""
    if incomplete:
        return (f"the {driver} ResourceSlices of {node} are incomplete: "
                f"{', '.join(incomplete)}; what they list is not known yet")
    known = {uuid: label for label, uuid in lent.items() if uuid}
    unknown = sorted(label for label, uuid in lent.items() if not uuid)
    missing = [f"{label} ({uuid})" for uuid, label in sorted(known.items(), key=lambda x: x[1])
               if uuid not in seen]
    extra = sorted(set(seen) - set(known))
    problems = []
    if missing:
        problems.append(f"lack {', '.join(missing)}")
    if len(extra) > len(unknown):
        problems.append(f"list {', '.join(extra)}, not lent")
    elif len(extra) < len(unknown):
        problems.append(f"lack {len(unknown) - len(extra)} of {', '.join(unknown)} (no uuid "
                        "configured: matched by count)")
    if not problems:
        return None
    return f"the {driver} ResourceSlices of {node} " + "; ".join(problems)


def verdict(lent: Mapping[str, str | None], slices: Slices | None, *, driver: str = DRIVER,
            node: str = "the node") -> str | None:
    """`mismatch` for what `slices` show (None: never listed, nothing shown)."""
    if slices is None:
        return mismatch(lent, frozenset(), driver=driver, node=node)
    return mismatch(lent, frozenset(slices.devices().values()), driver=driver, node=node,
                    incomplete=slices.incomplete())
