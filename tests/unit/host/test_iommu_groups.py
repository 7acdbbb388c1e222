"""`hostagent.host.iommu` on its own: which devices share a GPU's IOMMU group, and which
other running VM holds one of them. The VM asking is never its own obstacle: the
running lendee holds its GPUs' groups, and a hot-add of a GPU in a group it already
holds is what VFIO allows."""

from __future__ import annotations

from pathlib import Path

from hostagent.core.config import Gpu
from hostagent.host import iommu
from hostagent.host.libvirt import HostError, Libvirt
from tests.sysfs import FakeSysfs

USB = "0000:0c:00.0"


def hostdevs(name: str, *addresses: str) -> str:
    """A domain's live XML with `addresses` passed through."""
    devs = "".join(
        f"<hostdev mode='subsystem' type='pci' managed='yes'><source><address domain='0x0000' "
        f"bus='0x{a[5:7]}' slot='0x{a[8:10]}' function='0x{a[11]}'/></source></hostdev>"
        for a in addresses)
    return f"<domain><name>{name}</name><devices>{devs}</devices></domain>"


class Running(Libvirt):
    """libvirt as `holders` reads it: the running domains and their live XML."""

    def __init__(self, domains: dict[str, str]) -> None:
        super().__init__("test:///default", on_lifecycle=lambda *_: None,
                         on_reconnect=lambda: None)
        self.domains = domains

    async def running_domains(self) -> set[str]:
        return set(self.domains)

    async def xml(self, name: str) -> str:
        if name == "gone":
            raise HostError("Domain not found: no domain with matching name 'gone'")
        return self.domains[name]


def two_gpus_one_group(sysfs: FakeSysfs) -> dict[str, Gpu]:
    """gpu-a and gpu-b behind one bridge: one IOMMU group, 10, with a USB controller."""
    sysfs.gpu("0a", group="10").gpu("0b", group="10")
    sysfs.add(USB, cls=0x0C0330, vendor="1b21", device="2142", group="10")
    return {label: Gpu(label=label, pci=f"0000:{bus}:00.0", functions=(f"0000:{bus}:00.1",))
            for label, bus in (("gpu-a", "0a"), ("gpu-b", "0b"))}


async def test_the_lendee_holding_a_group_is_no_holder_for_its_own_hot_add(
        sysfs: FakeSysfs) -> None:
    gpus = two_gpus_one_group(sysfs)
    lendee = hostdevs("gpu-node", "0000:0a:00.0", "0000:0a:00.1")
    libvirt = Running({"gpu-node": lendee})
    assert await iommu.holders(libvirt, "gpu-node", {"gpu-b": gpus["gpu-b"]},
                               sysfs.root) == {}
    # The same group held by the lendee is in the way of an owner's start.
    [(label, (vm, why))] = (await iommu.holders(libvirt, "gaming1", {"gpu-b": gpus["gpu-b"]},
                                                sysfs.root)).items()
    assert (label, vm) == ("gpu-b", "gpu-node")
    assert why.startswith("gpu-node holds 0000:0a:00.0 (in IOMMU group 10 with gpu-b) and runs")


async def test_another_vm_holding_the_group_is_named_beside_the_running_lendee(
        sysfs: FakeSysfs) -> None:
    gpus = two_gpus_one_group(sysfs)
    libvirt = Running({"gpu-node": hostdevs("gpu-node", "0000:0a:00.0"),
                       "usbvm": hostdevs("usbvm", USB)})
    found = await iommu.holders(libvirt, "gpu-node", {"gpu-b": gpus["gpu-b"]}, sysfs.root)
    assert {label: vm for label, (vm, _) in found.items()} == {"gpu-b": "usbvm"}


def test_a_function_missing_from_the_host_does_not_end_the_scan_of_the_others(
        tmp_path: Path, sysfs: FakeSysfs) -> None:
    # The configuration names 0a:00.2, which the host does not have (gone, or a typo
    # `hostagent check-config` reports): the card's own functions are still read.
    sysfs.gpu("0a", group="10").add(USB, cls=0x0C0330, vendor="1b21", device="2142",
                                    group="10")
    sysfs.add("0000:0d:00.0", cls=0x0C0330, group=None)  # no IOMMU group
    gpu = Gpu(label="gpu-a", pci="0000:0a:00.2",
              functions=("0000:0d:00.0", "0000:0a:00.0", "0000:0a:00.1"))
    assert iommu.group_members({"gpu-a": gpu}, sysfs.root) == {
        address: ("gpu-a", "10") for address in ("0000:0a:00.0", "0000:0a:00.1", USB)}


async def test_a_domain_that_cannot_be_read_does_not_hide_the_next_holder(
        sysfs: FakeSysfs) -> None:
    # "gone" stopped between the list and the read, "broken" is not XML: both come
    # before the one that holds the group, which is still named, in a sentence whole.
    gpus = two_gpus_one_group(sysfs)
    libvirt = Running({"gone": "", "broken": "<domain", "usbvm": hostdevs("usbvm", USB)})
    found = await iommu.holders(libvirt, "gaming1", {"gpu-b": gpus["gpu-b"]}, sysfs.root)
    assert found == {"gpu-b": ("usbvm", (
        f"usbvm holds {USB} (in IOMMU group 10 with gpu-b) and runs: VFIO gives IOMMU group "
        "10 to one VM at a time, so gaming1 cannot have gpu-b until usbvm stops (`hostagent "
        "lint` says how to give the GPU a group of its own)"))}


async def test_another_vm_holding_the_gpu_itself_is_said_so(sysfs: FakeSysfs) -> None:
    gpus = two_gpus_one_group(sysfs)
    libvirt = Running({"gaming2": hostdevs("gaming2", "0000:0b:00.1")})
    [(vm, why)] = (await iommu.holders(libvirt, "gpu-node", {"gpu-b": gpus["gpu-b"]},
                                       sysfs.root)).values()
    assert vm == "gaming2" and why.startswith(
        "gaming2 holds 0000:0b:00.1 (a function of gpu-b) and runs: ")
