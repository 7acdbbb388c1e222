"""Whether a VM may take GPUs now: no other running VM holds a member of their IOMMU groups.

VFIO gives a whole IOMMU group to one VM at a time, and hostagent moves GPUs only. A
device of another kind in a GPU's group (a USB controller passed through to some other
VM) stays where it is, and while its VM runs it holds the whole group: libvirt then
refuses the start of a VM with the GPU, or, with hot-add, may be asked to attach it to
the running lendee. `hostagent lint` says so as an error; the agent asks too, before it
starts a VM with GPUs or attaches them live (`holders`), so that the request is answered
with the group, the device and the VM that holds it, instead of a failure of libvirt's.

The groups are read from sysfs when asked (as `hostagent.host.gpus` reads them), the holders
from the live definitions libvirt gives of the running domains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from hostagent.host import gpus as inventory
from hostagent.host import lint
from hostagent.core.config import Gpu
from hostagent.host.libvirt import Domains, HostError


def group_members(gpus: Mapping[str, Gpu],
                  sysfs: Path = inventory.SYSFS) -> dict[str, tuple[str, str]]:
    """Every PCI device in the IOMMU groups of `gpus`' functions (their own included):
    address -> (the GPU's label, the group). Reads sysfs: run it off the event loop."""
    members: dict[str, tuple[str, str]] = {}
    for label, gpu in sorted(gpus.items()):
        for address in gpu.pci_functions:
            device = inventory.pci_device(address, sysfs)
            if device is None or device.iommu_group is None:
                continue
            for member in (address, *device.group_members):
                members.setdefault(member, (label, device.iommu_group))
    return members


async def holders(libvirt: Domains, vm: str, gpus: Mapping[str, Gpu],
                  sysfs: Path = inventory.SYSFS) -> dict[str, tuple[str, str]]:
    """Those of `gpus` that `vm` may not take now, by label, each with the other running
    domain that holds a member of its IOMMU group and a sentence that says so. What
    libvirt cannot tell now is left to the start or the attach itself, which will say
    what is wrong."""
    members = await asyncio.to_thread(group_members, gpus, sysfs)
    if not members:
        return {}
    try:
        others = sorted(await libvirt.running_domains() - {vm})
    except HostError:
        return {}
    found: dict[str, tuple[str, str]] = {}
    for other in others:
        try:
            dom = lint.parse_domain(await libvirt.xml(other))
        except (HostError, ValueError):
            continue  # stopped meanwhile, or not XML: it holds nothing we can name
        for hostdev in dom.hostdevs:
            if hostdev.address in members and members[hostdev.address][0] not in found:
                label, group = members[hostdev.address]
                gpu = gpus[label]
                whose = ("a function of" if hostdev.address in gpu.pci_functions
                         else f"in IOMMU group {group} with")
                found[label] = (other, (
                    f"{other} holds {hostdev.address} ({whose} {gpu}) and runs: VFIO "
                    f"gives IOMMU group {group} to one VM at a time, so {vm} cannot "
                    f"have {label} until {other} stops (`hostagent lint` says how to "
                    "give the GPU a group of its own)"))
    return found
