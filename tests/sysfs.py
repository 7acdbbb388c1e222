"""A fake sysfs tree for tests: what hostagent reads of PCI devices, laid out as the
kernel lays it out (device directories, driver and IOMMU group links)."""

from __future__ import annotations

import os
from pathlib import Path


class FakeSysfs:
    """A /sys with just what hostagent reads of PCI devices: class, ids, the bound
    driver and the IOMMU group, as links laid out the way the kernel lays them out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus/pci/devices").mkdir(parents=True)

    def add(self, address: str, *, cls: int = 0x030000, vendor: str = "10de",
            device: str = "2584", driver: str | None = "vfio-pci",
            group: str | None = None, reset_method: str | None = "flr",
            behind: str | None = None) -> FakeSysfs:
        """`reset_method`: the file's text, or None for no file (a kernel since 5.15
        shows none where the function has no reset method; `reset` then goes too).
        `behind`: the bridge whose secondary bus it is on (added first), else the root
        bus: the kernel nests a device's directory in its bridge's."""
        parent = self.root / "devices/pci0000:00"
        if behind is not None:
            parent = next(parent.rglob(behind))
        dev = parent / address
        dev.mkdir(parents=True)
        if reset_method is not None:
            (dev / "reset_method").write_text(f"{reset_method}\n")
            (dev / "reset").write_text("")
        (dev / "class").write_text(f"0x{cls:06x}\n")
        (dev / "vendor").write_text(f"0x{vendor}\n")
        (dev / "device").write_text(f"0x{device}\n")
        os.symlink(os.path.relpath(dev, self.root / "bus/pci/devices"),
                   self.root / "bus/pci/devices" / address)
        if driver is not None:
            drv = self.root / "bus/pci/drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(drv, dev), dev / "driver")
        if group is not None:
            members = self.root / "kernel/iommu_groups" / group / "devices"
            members.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(members.parent, dev), dev / "iommu_group")
            os.symlink(os.path.relpath(dev, members), members / address)
        return self

    def gpu(self, bus: str, *, group: str | None = None, driver: str | None = "vfio-pci",
            audio: bool = True, device: str = "2584", reset_method: str | None = "flr",
            behind: str | None = None) -> FakeSysfs:
        """A GPU at 0000:<bus>:00.0 and, with `audio`, its HDMI audio at .1."""
        group = group or str(int(bus, 16))
        self.add(f"0000:{bus}:00.0", group=group, driver=driver, device=device,
                 reset_method=reset_method, behind=behind)
        if audio:
            self.add(f"0000:{bus}:00.1", cls=0x040300, device="228e", group=group,
                     driver=driver, reset_method=reset_method, behind=behind)
        return self
