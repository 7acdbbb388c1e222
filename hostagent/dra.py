"""Dynamic Resource Allocation (``resource.k8s.io/v1``): the lent GPUs as a DRA driver shows them.

On a DRA cluster the node has no ``nvidia.com/gpu`` in allocatable. NVIDIA's DRA driver
(``gpu.nvidia.com``) publishes each GPU the node sees as a device in the node's
ResourceSlices, its UUID among the device's attributes (a MIG device names its GPU as
``parentUUID``); a pod gets GPUs through a ResourceClaim, which the scheduler allocates
(driver, pool, device) and reserves for the pod. So here a lend is verified by UUID
(the slices list exactly the lent GPUs), a GPU lost is a lent UUID gone from the
slices, and which pod holds which lent GPU is read from the claims.

`Slices` and `Claims` keep what a list and watch of the API show (objects of the
kubernetes-asyncio models, read defensively: the text is the cluster's), and the rest
is pure: no I/O here; `hostagent.kube` does the requests.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Generic, TypeVar

from hostagent.text import clean

DRIVER = "gpu.nvidia.com"
_MAX_TEXT = 200  # a UUID or a name longer than this is nobody's

DeviceKey = tuple[str, str]  # (pool, device name), as a claim's allocation names it
V = TypeVar("V")


def _text(value: object) -> str | None:
    return clean(value) if isinstance(value, str) and 0 < len(value) <= _MAX_TEXT else None


def _uid(obj: Any) -> str | None:
    meta = getattr(obj, "metadata", None)
    return _text(getattr(meta, "uid", None))


def device_uuid(device: Any) -> str | None:
    """The UUID of the GPU a slice's device is, or is part of: a MIG device's
    ``parentUUID`` attribute (its own ``uuid`` is the MIG instance's), else its ``uuid``."""
    attributes = getattr(device, "attributes", None)
    if not isinstance(attributes, Mapping):
        return None
    for name in ("parentUUID", "uuid"):
        uuid = _text(getattr(attributes.get(name), "string", None))
        if uuid is not None:
            return uuid
    return None


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


class Slices(_Watched[tuple[str, int, dict[str, str]]]):  # pool, generation, devices
    """The devices of `driver` in one node's ResourceSlices, as listed and watched.

    A pool may be spread over several slices and is republished under a higher
    generation when it changes; as the scheduler does, only the newest generation of
    each pool counts."""

    def _read(self, obj: Any) -> tuple[str, int, dict[str, str]] | None:
        spec = getattr(obj, "spec", None)
        if spec is None or getattr(spec, "driver", None) != self.driver:
            return None
        pool = getattr(spec, "pool", None)
        name = _text(getattr(pool, "name", None)) or ""
        generation = getattr(pool, "generation", 0)
        devices = {}
        for device in getattr(spec, "devices", None) or []:
            device_name, uuid = _text(getattr(device, "name", None)), device_uuid(device)
            if device_name is not None and uuid is not None:
                devices[device_name] = uuid
        return name, generation if isinstance(generation, int) else 0, devices

    def devices(self) -> dict[DeviceKey, str]:
        """(pool, device name) -> UUID, for the newest generation of each pool."""
        newest: dict[str, int] = {}
        for pool, generation, _ in self._by_uid.values():
            newest[pool] = max(generation, newest.get(pool, generation))
        return {(pool, name): uuid for pool, generation, devices in self._by_uid.values()
                if generation == newest[pool] for name, uuid in devices.items()}

    def uuids(self) -> frozenset[str]:
        return frozenset(self.devices().values())


class Claims(_Watched[tuple[tuple[DeviceKey, ...], tuple[str, ...]]]):
    """The ResourceClaims of the cluster, as listed and watched: for each, the devices
    of `driver` it was allocated and the pods (by UID) it is reserved for."""

    def _read(self, obj: Any) -> tuple[tuple[DeviceKey, ...], tuple[str, ...]] | None:
        status = getattr(obj, "status", None)
        allocation = getattr(status, "allocation", None)
        results = getattr(getattr(allocation, "devices", None), "results", None) or []
        devices = tuple((pool, device) for r in results
                        if getattr(r, "driver", None) == self.driver
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
             node: str = "the node") -> str | None:
    """None when the node's slices list exactly the lent GPUs, else what differs, each
    GPU named. `lent`: label -> UUID (None: no UUID configured, matched by count)."""
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
