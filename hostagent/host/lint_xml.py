"""The domain as `hostagent lint` reads it from libvirt's XML, and what lint reports of it
(`Finding`): the part of `hostagent.host.lint` its checks share."""

from __future__ import annotations

import enum
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from hostagent.core import devices as gpu_devices

__all__ = ["AGENT_CHANNEL", "BootDevice", "Check", "Domain", "Finding", "Hostdev", "Severity",
           "parse_domain"]

AGENT_CHANNEL = "org.qemu.guest_agent.0"


class Severity(enum.StrEnum):
    ERROR = "error"  # the VM will not start, or hostagent cannot do its job with it
    WARNING = "warning"  # it may start, and then not do what you think


class Check(enum.StrEnum):
    HOSTDEV_MISSING = "hostdev-missing"
    NOT_VFIO = "not-vfio"
    GROUP_NOT_VIABLE = "iommu-group"
    SPLIT_GPU = "split-gpu"
    SLOT_FUNCTION = "slot-function"
    SHARED_GROUP = "shared-iommu-group"
    ROM_BAR = "rom-bar"
    NOT_Q35 = "not-q35"
    CDROM_FIRST = "cdrom-first"
    NO_AGENT_CHANNEL = "no-agent-channel"
    CONFIG_XML = "config-xml"
    AUTOSTART = "autostart"
    HOTPLUG = "hotplug"
    RESET = "reset"
    NOT_AN_OWNER = "not-an-owner"


@dataclass(frozen=True, kw_only=True)
class Finding:
    domain: str
    check: Check
    severity: Severity
    what: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.domain}: {self.severity}: {self.what}"


# --- reading the XML ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Hostdev:
    """A PCI function passed to the VM (``<hostdev mode='subsystem' type='pci'>``)."""

    address: str
    managed: bool
    rom_bar_off: bool


@dataclass(frozen=True, kw_only=True)
class BootDevice:
    kind: str  # "disk", "cdrom", "network", "hostdev"
    media: bool  # a CD-ROM with an image in it
    order: int


@dataclass(frozen=True, kw_only=True)
class Domain:
    name: str
    machine: str
    ovmf: bool
    hostdevs: tuple[Hostdev, ...]
    agent_channel: bool
    boot: tuple[BootDevice, ...]  # in boot order; () when the firmware decides
    # User aliases ua-hostagent-… of devices: they move with a GPU (`hostagent.core.devices`).
    aliases: tuple[str, ...] = ()
    autostart: bool | None = None  # None: not known (read from a file)
    xml: str = ""  # as read: what the hot-add check reads of controllers and addresses

    @property
    def q35(self) -> bool:
        return "q35" in self.machine


def _address(source: ET.Element | None) -> str | None:
    address = source.find("address") if source is not None else None
    if address is None:
        return None
    try:
        parts = [int(address.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function")]
    except ValueError:
        return None
    domain, bus, slot, function = parts
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def _has_media(dev: ET.Element) -> bool:
    source = dev.find("source")
    return source is not None and any(source.attrib.values())


def _boot_order(root: ET.Element, devices: ET.Element | None) -> tuple[BootDevice, ...]:
    """Devices in the order the firmware tries them, as far as the XML says."""
    if devices is None:
        return ()
    by_order: list[BootDevice] = []
    for dev in devices:
        boot = dev.find("boot")
        if boot is None or boot.get("order") is None:
            continue
        kind = dev.get("device", dev.tag) if dev.tag == "disk" else dev.tag
        by_order.append(BootDevice(kind=kind, media=_has_media(dev),
                                   order=int(boot.get("order", "0"))))
    if by_order:
        return tuple(sorted(by_order, key=lambda b: b.order))
    # The older <os><boot dev='cdrom'/><boot dev='hd'/> form: by kind, not by device.
    cdrom_media = any(d.get("device") == "cdrom" and _has_media(d)
                      for d in devices.findall("disk"))
    kinds = {"hd": "disk", "cdrom": "cdrom", "network": "network"}
    return tuple(BootDevice(kind=kinds.get(b.get("dev", ""), b.get("dev", "")),
                            media=cdrom_media if b.get("dev") == "cdrom" else False, order=i)
                 for i, b in enumerate(root.findall("os/boot")))


def parse_domain(xml: str, *, autostart: bool | None = None) -> Domain:
    """What lint needs from a domain's XML (and `autostart`, which libvirt keeps
    outside it). Raises ValueError if it is not domain XML."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise ValueError(f"not XML: {e}") from e
    if root.tag != "domain":
        raise ValueError(f"not a libvirt domain (root element <{root.tag}>)")
    os_el = root.find("os")
    machine = ""
    ovmf = False
    if os_el is not None:
        type_el = os_el.find("type")
        machine = type_el.get("machine", "") if type_el is not None else ""
        loader = os_el.find("loader")
        loader_text = (loader.text or "") if loader is not None else ""
        ovmf = (os_el.get("firmware") == "efi"
                or any(word in loader_text.upper() for word in ("OVMF", "EDK2"))
                or (loader is not None and loader.get("type") == "pflash"))
    devices = root.find("devices")
    hostdevs = []
    channel = False
    aliases: list[str] = []
    if devices is not None:
        aliases = [a.get("name", "") for a in devices.findall("*/alias")
                   if a.get("name", "").startswith(gpu_devices.ALIAS_PREFIX)]
        for dev in devices.findall("hostdev"):
            if dev.get("mode", "subsystem") != "subsystem" or dev.get("type") != "pci":
                continue
            address = _address(dev.find("source"))
            if address is None:
                continue
            rom = dev.find("rom")
            hostdevs.append(Hostdev(address=address, managed=dev.get("managed") == "yes",
                                    rom_bar_off=rom is not None and rom.get("bar") == "off"))
        channel = any(t.get("name") == AGENT_CHANNEL
                      for t in devices.findall("channel/target"))
    return Domain(name=root.findtext("name", "").strip(), machine=machine, ovmf=ovmf,
                  hostdevs=tuple(hostdevs), agent_channel=channel,
                  boot=_boot_order(root, devices), aliases=tuple(aliases), autostart=autostart,
                  xml=xml)

