"""NVIDIA's DRA driver for GPUs (github.com/NVIDIA/k8s-dra-driver-gpu, main at 22407113,
May 2026, after releases v25.12.0 and v0.4.0), the part the API server sees: the
DeviceClass its chart installs and the ResourceSlices its kubelet plugin publishes
through the resourceslice controller of k8s.io/dynamic-resource-allocation v0.35.4.

- DeviceClass ``gpu.nvidia.com`` (deployments/helm/dra-driver-nvidia-gpu/templates/
  deviceclass-gpu.yaml): the driver's devices of type "gpu"; on resource.k8s.io/v1
  also ``extendedResourceName: nvidia.com/gpu``, which the API server drops while its
  DRAExtendedResource gate is off (as in 1.35 by default).
- One pool named after the node (cmd/gpu-kubelet-plugin/driver.go, DriverResources
  {Pools: {nodeName: ...}}), in one slice, or one slice per GPU (the DynamicMIG layout);
  each GPU as GpuInfo.GetDevice writes it (cmd/gpu-kubelet-plugin/deviceinfo.go):
  ``gpu-<minor>``, typed attributes in short form, the PCI ones fully qualified, its
  memory as capacity; a MIG instance its own UUID and its GPU's as ``parentUUID``.
- The controller (resourceslice/resourceslicecontroller.go): slices named
  ``<node>-gpu.nvidia.com-<random>``, owned by the Node; obsolete slices deleted first,
  then changed ones updated, then new ones created; the pool's generation raised unless
  a single update does it.
- Health (cmd/gpu-kubelet-plugin/device_health.go, healthEventToTaint, behind its
  NVMLDeviceHealthCheck gate; needs the cluster's DRADeviceTaints): a GPU found unhealthy
  stays in the slice with a device taint (`health_taint`). Release v25.12.0 removed it
  from the slice instead, which `publish` without it does.

What it does not do: talk to NVML, prepare devices for the kubelet (NodePrepareResources,
CDI specs), or publish ComputeDomains.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config

DRIVER = "gpu.nvidia.com"
Obj = dict[str, Any]

DEVICE_CLASS: Obj = {
    "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": (
        "device.driver == 'gpu.nvidia.com' && "
        "device.attributes['gpu.nvidia.com'].type == 'gpu'")}}],
             "extendedResourceName": "nvidia.com/gpu"},
}


def gpu(minor: int, uuid_: str, *, product: str = "NVIDIA A100-SXM4-80GB",
        memory: str = "81920Mi", taints: list[Obj] | None = None) -> Obj:
    """One whole GPU, as GpuInfo.GetDevice publishes it."""
    device: Obj = {
        "name": f"gpu-{minor}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid_},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": "8.0.0"},
            "driverVersion": {"version": "570.172.8"},
            "cudaDriverVersion": {"version": "12.8.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{minor + 1:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{minor:02x}"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    if taints:
        device["taints"] = copy.deepcopy(taints)
    return device


def mig(parent: int, slot: int, parent_uuid: str, *, profile: str = "1g.10gb") -> Obj:
    """One MIG instance of GPU `parent`, as MigDeviceInfo.GetDevice publishes it."""
    return {
        "name": f"gpu-{parent}-mig-{profile.replace('.', '')}-{slot}",
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{uuid.uuid5(uuid.NAMESPACE_URL, f'{parent_uuid}/{slot}')}"},
            "parentUUID": {"string": parent_uuid},
            "profile": {"string": profile},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            "index": {"int": parent},
        },
        "capacity": {"memory": {"value": "9728Mi"}},
    }


def health_taint(kind: str = "gpu-lost", value: str | None = None) -> Obj:
    """healthEventToTaint: gpu.nvidia.com/gpu-lost (NoSchedule), gpu.nvidia.com/xid=<n>
    (NoSchedule; None for an XID it deems non-fatal, such as 43), and
    gpu.nvidia.com/unmonitored (None)."""
    effect = "None" if kind == "unmonitored" or (kind == "xid" and value == "43") \
        else "NoSchedule"
    taint: Obj = {"key": f"{DRIVER}/{kind}", "effect": effect}
    if value is not None:
        taint["value"] = value
    return taint


class Driver:
    """The driver's kubelet plugin on `node`, publishing through the API as `kubeconfig`."""

    def __init__(self, kubeconfig: Path, node: str) -> None:
        self.kubeconfig = kubeconfig
        self.node = node
        self._api: client.ApiClient | None = None

    async def __aenter__(self) -> Driver:
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(self.kubeconfig),
                                      client_configuration=configuration,
                                      persist_config=False)
        self._api = client.ApiClient(configuration)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._api is not None:
            await self._api.close()

    @property
    def _resource(self) -> Any:
        return client.ResourceV1Api(self._api)

    async def slices(self) -> list[Obj]:
        """The node's slices of the driver, by name, as plain objects."""
        listed = await self._resource.list_resource_slice(
            field_selector=f"spec.nodeName={self.node},spec.driver={DRIVER}")
        items = [self._api.sanitize_for_serialization(s)  # type: ignore[union-attr]
                 for s in listed.items]
        return sorted(items, key=lambda s: s["metadata"]["name"])

    async def publish(self, devices: list[Obj], *, per_gpu: bool = False) -> None:
        """The node's pool made `devices`, as the resourceslice controller syncs it."""
        existing = await self.slices()
        wanted = [[d] for d in devices] if per_gpu else [devices]
        generation = max((s["spec"]["pool"]["generation"] for s in existing), default=0)
        for stale in existing[len(wanted):]:
            await self._resource.delete_resource_slice(stale["metadata"]["name"])
        kept = existing[:len(wanted)]
        changed = [i for i, s in enumerate(kept) if s["spec"].get("devices") != wanted[i]]
        new = len(wanted) - len(kept)
        bumped = not (new == 0 and len(changed) <= 1)
        if bumped:
            generation += 1
        pool = {"name": self.node, "generation": generation, "resourceSliceCount": len(wanted)}
        for i, slice_ in enumerate(kept):
            if i in changed or bumped:
                slice_["spec"]["devices"] = copy.deepcopy(wanted[i])
                slice_["spec"]["pool"] = dict(pool)
                await self._resource.replace_resource_slice(slice_["metadata"]["name"], slice_)
        if new:
            node = await client.CoreV1Api(self._api).read_node(self.node)
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                     "uid": node.metadata.uid, "controller": True}
            for chunk in wanted[len(kept):]:
                await self._resource.create_resource_slice({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"generateName": f"{self.node}-{DRIVER}-",
                                 "ownerReferences": [owner]},
                    "spec": {"driver": DRIVER, "nodeName": self.node, "pool": dict(pool),
                             "devices": copy.deepcopy(chunk)}})

    async def withdraw(self) -> None:
        """Every slice of the node's gone (the plugin stopped and cleaned up)."""
        for slice_ in await self.slices():
            await self._resource.delete_resource_slice(slice_["metadata"]["name"])
