"""Check libvirt domains for the passthrough mistakes that cost an evening each.

Each check comes from a real failure: a ``<hostdev>`` whose card was moved stops the
VM from starting at all; OVMF running every card's option ROM hangs before the first
pixel; a CD-ROM left ahead of the disk boots the installer, which looks exactly like
a failed install; a lendee without a guest-agent channel can never be shut down
cleanly. A `Finding` says what is wrong, why it matters (one sentence) and the fix.

`parse_domain` reads the XML; `check_domain` checks one domain against the host;
`lint` checks several together and against the configuration. The host is read from a
sysfs root given as a parameter (tests build a fake one); nothing else is touched.

What the agent checks before it starts a VM (`check_domain`): only what that domain's
own XML says, against the host. A domain without ``<hostdev>`` (the lab's guests,
whose GPUs are disks) has nothing host-dependent to check, and nothing fires.
Whether the configuration and the XML agree is `hostagent lint`'s job: a mismatch
there does not make a start fail, it makes lending wrong, and the in-guest check
after a lend catches its effect loudly.
"""

from __future__ import annotations

import enum
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hostagent.core import devices as gpu_devices
from hostagent.host import gpus as inventory
from hostagent.core.config import Config, Hotplug, Regrow

__all__ = [
    "AGENT_CHANNEL",
    "Check",
    "Domain",
    "Finding",
    "Hostdev",
    "Severity",
    "check_domain",
    "errors",
    "format_findings",
    "hotplug_capability",
    "lint",
    "parse_domain",
]

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


# --- one domain against the host -----------------------------------------------------------


def _slot(address: str) -> str:
    return address.rsplit(".", 1)[0]


def check_domain(dom: Domain, *, sysfs: Path = inventory.SYSFS,
                 lendee: bool | None = None) -> list[Finding]:
    """What is wrong with one domain on this host. `lendee`: whether it is the lendee
    (True), another VM (False) or unknown (None: its missing agent channel warns)."""
    found: list[Finding] = []

    def add(check: Check, severity: Severity, what: str, why: str, fix: str) -> None:
        found.append(Finding(domain=dom.name, check=check, severity=severity, what=what,
                             why=why, fix=fix))

    mine = {h.address for h in dom.hostdevs}
    for h in dom.hostdevs:
        device = inventory.pci_device(h.address, sysfs)
        if device is None:
            add(Check.HOSTDEV_MISSING, Severity.ERROR,
                f"<hostdev> {h.address} is not on this host",
                "libvirt refuses to start a domain whose hostdev points at an empty slot, "
                "so the VM does not start at all.",
                f"remove the hostdev (virsh edit {dom.name}) or point it at the card's new "
                "address (lspci -D; put a replacement card in the freed slot to keep it)")
            continue
        if device.driver not in inventory.VFIO_DRIVERS:
            bound = f"bound to {device.driver}" if device.driver else "bound to no driver"
            if not h.managed:
                add(Check.NOT_VFIO, Severity.ERROR,
                    f"{h.address} ({device.ids}) is {bound} and managed='no'",
                    "with managed='no' libvirt leaves the device on its host driver and "
                    "QEMU cannot take it, so the start fails.",
                    f"bind {device.ids} to vfio-pci at boot (vfio-pci.ids={device.ids}), "
                    "or set managed='yes' on the hostdev")
            elif device.driver is not None:
                add(Check.NOT_VFIO, Severity.WARNING,
                    f"{h.address} ({device.ids}) is {bound}, not vfio-pci",
                    f"libvirt must unbind it from {device.driver} at every start, which hangs "
                    "or fails while the host uses the card.",
                    f"bind {device.ids} to vfio-pci at boot (vfio-pci.ids={device.ids}): by id, "
                    "a replacement card of the same model is caught too")
        for other in device.group_members:
            if other in mine:
                continue
            member = inventory.pci_device(other, sysfs)
            if member is None or member.is_bridge or member.driver in inventory.VFIO_DRIVERS:
                continue
            if member.driver is None:
                continue
            add(Check.GROUP_NOT_VIABLE, Severity.ERROR,
                f"{other} ({member.ids}, {member.driver}) shares IOMMU group "
                f"{device.iommu_group} with {h.address} but stays on the host",
                "VFIO gives a VM a whole IOMMU group or nothing: a member on a host driver "
                "makes the group not viable and the start fails.",
                f"pass {other} to {dom.name} too (a GPU's audio function moves with it), or "
                f"bind it to vfio-pci")
    gpu_slots = {_slot(h.address) for h in dom.hostdevs if _is_gpu(h.address, sysfs)}
    if dom.ovmf and len(gpu_slots) > 1:
        bare = [h.address for h in dom.hostdevs if not h.rom_bar_off]
        if bare:
            add(Check.ROM_BAR, Severity.WARNING,
                f"{len(gpu_slots)} GPUs under OVMF, and {', '.join(bare)} without "
                "<rom bar='off'/>",
                "OVMF runs every card's option ROM while it enumerates PCI and can hang "
                "there before it draws anything (a larger 64-bit MMIO window does not help).",
                "add <rom bar='off'/> to each of these hostdevs: a compute VM needs no "
                "firmware display driver")
    if dom.hostdevs and not dom.q35:
        add(Check.NOT_Q35, Severity.WARNING,
            f"machine type {dom.machine or 'pc (the default)'} with PCI passthrough",
            "a GPU passed through wants a real PCIe port, which only q35 provides; on the "
            "i440fx machine drivers may not find or fully use the card.",
            "create the VM with the q35 machine type (virt-install --machine q35)")
    disks = [b for b in dom.boot if b.kind == "disk"]
    first_disk = disks[0].order if disks else None
    ahead = [b for b in dom.boot if b.kind == "cdrom" and b.media
             and (first_disk is None or b.order < first_disk)]
    if ahead:
        add(Check.CDROM_FIRST, Severity.WARNING,
            "a CD-ROM with media boots ahead of the disk",
            "after the install the VM boots the installer again, which looks exactly like "
            "an install that failed.",
            f"eject the image (virsh change-media {dom.name} <target> --eject) or put the "
            "disk first in the boot order")
    if not dom.agent_channel and lendee is not False:
        add(Check.NO_AGENT_CHANNEL,
            Severity.ERROR if lendee else Severity.WARNING,
            f"no guest-agent channel ({AGENT_CHANNEL})" + ("" if lendee else
                                                          " (matters for the lendee)"),
            "hostagent shuts the lendee down through its guest agent only, so without the "
            "channel it can never give the GPUs back.",
            "add <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/>"
            "</channel> and run qemu-guest-agent in the guest")
    return found


def _is_gpu(address: str, sysfs: Path) -> bool:
    device = inventory.pci_device(address, sysfs)
    # Unknown to the host: count it, the hostdev-missing error already speaks for it.
    return device is None or device.is_display


# --- several domains and the configuration --------------------------------------------------


def lint(domains: Sequence[Domain], *, sysfs: Path = inventory.SYSFS,
         config: Config | None = None) -> list[Finding]:
    """Every finding for `domains`, against the host and, if given, the configuration."""
    found: list[Finding] = []
    for dom in domains:
        lendee = None if config is None else dom.name == config.lendee.domain
        found += check_domain(dom, sysfs=sysfs, lendee=lendee)
    found += _split(domains, sysfs)
    found += _shared_groups(domains, sysfs, config)
    if config is not None:
        found += _against_config(domains, config)
        found += _slot_functions(domains, config, sysfs)
    return found


_ACS_FIX = (
    "put one of the cards in a slot with an IOMMU group of its own (usually one wired to "
    "the CPU's own root ports rather than the chipset's), or turn on ACS for that root "
    "port in the firmware if it offers it (`hostagent gpus` shows the groups). The "
    "pcie_acs_override kernel patch splits the group without the hardware's isolation: "
    "the cards can then reach each other's memory by peer-to-peer DMA, past the IOMMU, "
    "so a VM can read or corrupt the other's")


def _shared_groups(domains: Sequence[Domain], sysfs: Path,
                   config: Config | None) -> list[Finding]:
    """Several cards in one IOMMU group. VFIO gives a group to one VM at a time, so they
    move together: with the configuration, GPUs of different owners sharing a group
    are an error (those owners exclude each other, and hostagent lends and reclaims
    them together); without it, VMs that use disjoint cards of one group are."""
    cards: dict[str, dict[str, set[str]]] = {}  # group -> card (slot) -> domains using it
    for dom in domains:
        for h in dom.hostdevs:
            group = _group(h.address, sysfs)
            if group:
                cards.setdefault(group, {}).setdefault(_slot(h.address), set()).add(dom.name)
    labels: dict[str, str] = {}  # slot -> GPU label
    if config is not None:
        for gpu in config.gpus.values():
            for address in gpu.pci_functions:
                labels[_slot(address)] = gpu.label
                group = _group(address, sysfs)
                if group:
                    cards.setdefault(group, {}).setdefault(_slot(address), set())
    found = []
    for group, users in sorted(cards.items()):
        if len(users) < 2:
            continue
        if config is None:
            sets = [frozenset(u) for u in users.values()]
            if not any(a.isdisjoint(b) and a and b for a in sets for b in sets if a is not b):
                continue
            listing = "; ".join(f"{slot} in {', '.join(sorted(u)) or 'no VM'}"
                                for slot, u in sorted(users.items()))
            for name in sorted(set().union(*users.values())):
                found.append(Finding(
                    domain=name, check=Check.SHARED_GROUP, severity=Severity.ERROR,
                    what=f"cards of IOMMU group {group} are given to different VMs: {listing}",
                    why="VFIO gives a whole IOMMU group to one VM at a time, so these VMs "
                        "cannot run together even though their XML says they share nothing.",
                    fix=_ACS_FIX))
            continue
        others = sorted(slot for slot in users if slot not in labels)
        if others and len(others) < len(users):
            # hostagent moves GPUs only: a device of another kind in their group stays
            # where it is, and holds the whole group for its VM.
            held = sorted(set().union(*users.values()))
            cards_in = sorted(labels[slot] for slot in users if slot in labels)
            listing = "; ".join(f"{labels.get(slot, slot)} in {', '.join(sorted(u)) or 'no VM'}"
                                for slot, u in sorted(users.items()))
            found.append(Finding(
                domain=", ".join(held), check=Check.SHARED_GROUP, severity=Severity.ERROR,
                what=f"IOMMU group {group} holds {', '.join(others)}, no GPU, with "
                     f"{', '.join(cards_in)}: {listing}",
                why="VFIO gives a whole IOMMU group to one VM at a time and hostagent moves "
                    "GPUs only: while a VM holds one member of the group no other can start "
                    "with another, so hostagent gives the GPU to no VM (a game or the "
                    "lendee, started or hot-added) while another holds the rest of its "
                    "group.",
                fix=_ACS_FIX + "; or pass the other device through to no VM"))
            continue
        gpus = sorted({labels.get(slot, slot) for slot in users})
        if len(gpus) < 2:
            continue
        owners = {g: frozenset(config.owners_of(g)) for g in gpus}
        together = " and ".join(gpus)
        named = ", ".join(f"{g} ({' and '.join(sorted(o)) or 'no owner'})"
                          for g, o in owners.items())
        owned = [o for o in owners.values() if o]
        if len(set(owned)) > 1:
            players = sorted(set().union(*owned))
            found.append(Finding(
                domain=", ".join(players), check=Check.SHARED_GROUP, severity=Severity.ERROR,
                what=f"GPUs of different owners share IOMMU group {group}: {named}",
                why=f"VFIO gives a group to one VM at a time: {' and '.join(players)} cannot "
                    f"run together, and hostagent lends and reclaims {together} together "
                    "(one owner's start takes them all from the lendee).",
                fix=_ACS_FIX + "; or give those GPUs to the same owners"))
        elif owned and len(owned) < len(gpus):
            found.append(Finding(
                domain=config.lendee.domain, check=Check.SHARED_GROUP,
                severity=Severity.WARNING,
                what=f"{together} share IOMMU group {group}: they move together ({named})",
                why=f"VFIO gives a group to one VM at a time, so while "
                    f"{' or '.join(sorted(set().union(*owned)))} plays, the lendee has none "
                    f"of {together}.",
                fix=_ACS_FIX))
    return found


def _slot_functions(domains: Sequence[Domain], config: Config, sysfs: Path) -> list[Finding]:
    """A hostdev on a configured GPU's slot that the agent would not move with it (it
    moves the functions the configuration lists and those the host has in that slot):
    it would stay behind in the lendee's live definition and keep the card busy."""
    found = []
    for dom in domains:
        for h in dom.hostdevs:
            gpu = next((g for g in config.gpus.values()
                        if g.pci is not None and _slot(g.pci) == _slot(h.address)), None)
            if gpu is None or h.address in gpu.pci_functions:
                continue
            if h.address in inventory.slot_functions(gpu.pci or h.address, sysfs):
                continue
            found.append(Finding(
                domain=dom.name, check=Check.SLOT_FUNCTION, severity=Severity.ERROR,
                what=f"<hostdev> {h.address} is on the slot of GPU {gpu.label} but hostagent "
                     f"does not move it with {gpu.label}: the card there has no such function "
                     "on this host",
                why="hostagent moves a GPU with every function its slot has on the host; a "
                    "hostdev it does not know stays in the lendee's live definition, so the "
                    "owner's start fails on a device in use.",
                fix=f"remove the <hostdev> {h.address} from {dom.name} (virsh edit "
                    f"{dom.name}): `hostagent gpus` lists the functions the card has"))
    return found


def _group(address: str, sysfs: Path) -> str | None:
    device = inventory.pci_device(address, sysfs)
    return device.iommu_group if device else None


def _split(domains: Sequence[Domain], sysfs: Path) -> list[Finding]:
    """A GPU's functions divided between VMs. Lending means two VMs list the same
    functions; each must list the same set, or they look independent and are not.
    Several cards in one IOMMU group are `_shared_groups`' concern."""
    slots: dict[str, set[str]] = {}  # IOMMU group -> the slots of its hostdevs
    for dom in domains:
        for h in dom.hostdevs:
            slots.setdefault(_group(h.address, sysfs) or "", set()).add(_slot(h.address))
    groups: dict[str, dict[str, set[str]]] = {}  # group (or slot) -> domain -> functions
    for dom in domains:
        for h in dom.hostdevs:
            group = _group(h.address, sysfs)
            key = (f"IOMMU group {group}" if group and len(slots[group]) == 1
                   else f"device {_slot(h.address)}")
            groups.setdefault(key, {}).setdefault(dom.name, set()).add(h.address)
    found = []
    for key, users in sorted(groups.items()):
        sets = {frozenset(v) for v in users.values()}
        if len(sets) < 2:
            continue
        names = sorted(users)
        listing = "; ".join(f"{n} has {', '.join(sorted(users[n]))}" for n in names)
        disjoint = all(a.isdisjoint(b) for a in sets for b in sets if a is not b)
        for name in names:
            found.append(Finding(
                domain=name, check=Check.SPLIT_GPU,
                severity=Severity.ERROR if disjoint else Severity.WARNING,
                what=f"the functions of {key} are split between VMs: {listing}",
                why="VFIO gives a whole IOMMU group to one VM at a time, so these VMs cannot "
                    "run together even though their XML says they share nothing."
                if disjoint else
                "functions left behind stay on the host while the other VM runs, and a "
                "GPU's audio function is expected to move with it.",
                fix="give each VM that uses this card all of its functions"))
    return found


def _against_config(domains: Sequence[Domain], config: Config) -> list[Finding]:
    found = []
    by_name = {d.name: d for d in domains}
    label_of = {f: g.label for g in config.gpus.values() for f in g.pci_functions}
    roles: dict[str, tuple[str, str, tuple[str, ...]]] = {
        config.lendee.domain: ("lendee", "lendee.gpus", config.lendee.gpus),
        **{o.domain: ("owner", f"owners.{o.domain}.gpus", o.gpus)
           for o in config.owners.values()},
    }
    for name, (role, key, labels) in roles.items():
        dom = by_name.get(name)
        if dom is None:
            continue
        have = {h.address for h in dom.hostdevs}
        tagged = {gpu_devices.alias_label(a, config.gpus) for a in dom.aliases}
        for label in labels:
            gpu = config.gpus[label]
            if label in tagged and not have & set(gpu.pci_functions):
                continue  # a stand-in tied to the GPU by its alias (the lab's disks)
            for address in gpu.pci_functions:
                if address in have:
                    continue
                verb = "borrows" if role == "lendee" else "owns"
                found.append(Finding(
                    domain=name, check=Check.CONFIG_XML, severity=Severity.ERROR,
                    what=f"the config says {name} {verb} {gpu} but its "
                         + ("persistent definition" if role == "lendee" else "XML")
                         + f" has no <hostdev> for {address}",
                    why="the agent starts the lendee from its persistent definition minus "
                        "the GPUs in use, so a GPU missing there is never lent, and the "
                        "in-guest check fails after every lend."
                    if role == "lendee" else
                    "hostagent moves GPUs by what the config says, so it would lend or "
                    "reclaim a card this VM does not use and leave the one it uses alone.",
                    fix=f"add the hostdev (virsh edit {name}) or fix {key} / gpus.{label}"))
        for h in dom.hostdevs:
            other = label_of.get(h.address)
            if other is None or other in labels:
                continue
            label = other
            owners = config.owners_of(label)
            given = (f"the config gives it to {' and '.join(owners)}" if owners
                     else f"the config does not give it to {name}")
            found.append(Finding(
                domain=name, check=Check.CONFIG_XML, severity=Severity.ERROR,
                what=f"{name}'s XML has {h.address} of GPU {label}, but {given}",
                why="hostagent does not free that GPU for this VM, so its start fails "
                    "whenever another VM holds it.",
                fix=f"add {label} to {key}, or remove the hostdev from {name}"))
    found += _autostart(domains, roles)
    lendee = by_name.get(config.lendee.domain)
    if lendee is not None and config.policy.hotplug not in (Hotplug.NONE, Hotplug.AUTO):
        found += _hot_add(lendee, config)
    # "auto" takes hot-unplug where the lendee can: the same caveat as "both" set by hand.
    if lendee is not None and hotplug_capability(lendee, config)[0] is Hotplug.BOTH:
        found.append(Finding(
            domain=lendee.name, check=Check.HOTPLUG, severity=Severity.WARNING,
            what=("policy.hotplug = \"auto\" takes hot-unplug here, which"
                  if config.policy.hotplug is Hotplug.AUTO else "policy.hotplug = \"both\"")
                 + " is experimental: NVIDIA does not support hot-unplug of its GPUs",
            why="the driver in the lendee unbinds a GPU as it leaves, and NVIDIA's open "
                "kernel modules from 595.58.03 to at least 610.57.04 hang an unbind begun "
                "while a client holds the GPU, even once it lets go "
                "(github.com/NVIDIA/open-gpu-kernel-modules/issues/1119). hostagent evicts "
                "the GPU's pods and checks that nvidia-smi lists no process on it first, "
                "and restarts the lendee when the guest keeps it past a bound, but a "
                "client nvidia-smi does not list "
                "(nvidia-persistenced, a display server) still holds it.",
            fix="run a driver outside that range in the lendee (or one whose release notes "
                "say the unbind is fixed), without nvidia-persistenced, or set "
                "policy.hotplug = \"add\""))
    return found


_PREF64_FIX = (
    "reserve a 64-bit prefetchable window on the root ports, at least each GPU's BAR1 "
    "(`lspci -vv` on the host: the largest 64-bit prefetchable region) rounded up: in "
    "the domain's XML, <qemu:commandline><qemu:arg value='-global'/><qemu:arg "
    "value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline> (xmlns:qemu="
    "'http://libvirt.org/schemas/domain/qemu/1.0' on <domain>)")


def _hot_add(dom: Domain, config: Config) -> list[Finding]:
    """Whether GPUs can be attached to the running lendee (policy.hotplug): a q35
    machine, each function of each GPU an owner may free in a hot-pluggable
    pcie-root-port of its own (libvirt hot-plugs no multifunction device, and the live
    definition leaves the GPU's root ports empty for it), and 64-bit prefetchable
    windows reserved (firmware sizes an empty root port's window at boot)."""
    def finding(what: str, why: str, fix: str, severity: Severity = Severity.ERROR) -> Finding:
        return Finding(domain=dom.name, check=Check.HOTPLUG, severity=severity,
                       what=f"policy.hotplug: {what}", why=why, fix=fix)

    if not dom.q35:
        return [finding(
            f"machine {dom.machine or '(unset)'} has no PCIe root ports",
            "a GPU is hot-added into a pcie-root-port, which only q35 has.",
            "move the lendee to q35 (a new definition), or set policy.hotplug = \"none\"")]
    if not dom.xml:
        return []  # built by hand, not read: nothing to tell the ports from
    root = ET.fromstring(dom.xml)
    ports = {c.get("index"): c for c in root.findall("devices/controller[@type='pci']")
             if c.get("model") == "pcie-root-port"}
    owned = {label for o in config.owners.values() for label in o.gpus}
    gpus = {label: config.gpus[label] for label in config.lendee.gpus}
    found: list[Finding] = []
    used: dict[int, str] = {}
    for dev in root.findall("devices/*"):
        at = dev.find("address[@type='pci']")
        if at is not None and gpu_devices.owner_label(dev, gpus) is None:
            used.setdefault(_int(at.get("bus")), f"<{dev.tag}>")
    for label in sorted(set(gpus) & owned):
        try:
            parts = gpu_devices.elements_of(dom.xml, {label}, gpus)
        except (gpu_devices.GpuNotInXml, ValueError):
            continue  # said by the config checks above
        for part in parts:
            dev = ET.fromstring(part)
            what = _device_name(dev)
            at = dev.find("address[@type='pci']")
            bus = _int(at.get("bus")) if at is not None else -1
            port = ports.get(str(bus))
            if at is None or port is None:
                found.append(finding(
                    f"{what} of {label} is not in a pcie-root-port of its own",
                    "a hot-added device goes into an empty hot-pluggable root port; one on "
                    "the root bus or a bridge cannot be added live.",
                    "give it <address type='pci' bus='0xNN' slot='0x00'/> on a "
                    "<controller type='pci' model='pcie-root-port'> with an explicit index "
                    "(one per function)"))
                continue
            if at.get("multifunction") == "on" or bus in used:
                other = used.get(bus, "another function")
                found.append(finding(
                    f"{what} of {label} shares root port {bus} with {other}",
                    "libvirt hot-plugs one single-function device per root port: a "
                    "multifunction slot cannot be attached live.",
                    "give each function its own pcie-root-port (bus), slot 0x00, without "
                    "multifunction='on'"))
            target = port.find("target")
            if target is not None and target.get("hotplug") == "off":
                found.append(finding(
                    f"root port {bus} of {label}'s {what} has hotplug='off'",
                    "the guest is told the port never takes a device.",
                    f"remove hotplug='off' from the controller with index {bus}"))
            used[bus] = f"{label}'s {what}"
    if "pref64-reserve" not in dom.xml:
        found.append(finding(
            "no 64-bit prefetchable window is reserved on the root ports",
            "the firmware sizes an empty root port's windows at boot to almost nothing; a "
            "GPU attached later whose BAR1 (256 MiB to tens of GiB) does not fit gets no "
            "address in the guest and its driver fails.",
            _PREF64_FIX, Severity.WARNING))
    return found


# Kernel arguments with which a Linux guest ignores a hot-plug request: no ACPI hot-plug
# driver (acpiphp), or the PCIe ports without their native hot-plug service.
_NO_HOTPLUG_ARGS = ("acpiphp.disable=1", "pcie_ports=compat", "pciehp.disable=1")


def hotplug_capability(dom: Domain, config: Config) -> tuple[Hotplug, str]:
    """What ``policy.hotplug = "auto"`` means for the lendee `dom`: "both" when the GPUs
    an owner may free can be attached and detached live (`_hot_add` finds no error: each
    function in a hot-pluggable pcie-root-port of its own) and the kernel command line
    in its XML does not turn the guest's hot-plug off; else "none". With the reason, in
    one sentence, for `hostagent status` and `hostagent lint`."""
    if config.policy.hotplug is not Hotplug.AUTO:
        return config.policy.hotplug, f"policy.hotplug = \"{config.policy.hotplug}\""
    problems = [f.what.removeprefix("policy.hotplug: ") for f in _hot_add(dom, config)
                if f.severity is Severity.ERROR]
    if problems:
        return Hotplug.NONE, f"{dom.name} cannot hot-plug its GPUs: {problems[0]}"
    cmdline = ""
    if dom.xml:
        found = ET.fromstring(dom.xml).find("os/cmdline")
        cmdline = (found.text or "") if found is not None else ""
    off = [a for a in _NO_HOTPLUG_ARGS if a in cmdline.split()]
    if off:
        return Hotplug.NONE, f"{dom.name}'s kernel command line has {off[0]}: it ignores hot-plug"
    return Hotplug.BOTH, (f"{dom.name} has a spare pcie-root-port for each function of its "
                          "owners' GPUs and its guest's hot-plug is not turned off")


def regrow_note(domains: Sequence[Domain], config: Config) -> str | None:
    """How the lendee's GPUs change while it runs, and why: one line for `hostagent lint`
    (None when the lendee is not among `domains`)."""
    lendee = next((d for d in domains if d.name == config.lendee.domain), None)
    if lendee is None:
        return None
    how, why = hotplug_capability(lendee, config)
    policy = config.policy
    return (f"{lendee.name}: GPUs change "
            f"{changes(how, policy.regrow, policy.regrow_max_wait)} ({why})")


def changes(how: Hotplug, regrow: Regrow, max_wait: float | None) -> str:
    """The lendee's regrow and reclaim under `how`, in a few words."""
    if regrow is Regrow.ALWAYS:
        wait = "a regrow by restart kills the GPU jobs that run (policy.regrow = \"always\")"
    elif regrow is Regrow.NEVER:
        wait = "no regrow by restart (policy.regrow = \"never\")"
    elif max_wait is None:
        wait = "a regrow by restart waits until no GPU pod runs, however long"
    else:
        wait = (f"a regrow by restart waits up to {max_wait:g}s (policy.regrow_max_wait) "
                "for the GPU pods to end, then kills them")
    match how:
        case Hotplug.BOTH:
            return f"live (hot-add and hot-unplug), the restart as fallback; {wait}"
        case Hotplug.ADD:
            return f"live when added (hot-add), by restart when a game takes one; {wait}"
        case _:
            return f"by restart; {wait}"


def _int(text: str | None) -> int:
    try:
        return int(text or "", 0)
    except ValueError:
        return -1


def _device_name(dev: ET.Element) -> str:
    source = dev.find("source/address")
    if dev.tag == "hostdev" and source is not None:
        return f"<hostdev> {_address(dev.find('source'))}"
    alias = dev.find("alias")
    return f"<{dev.tag}> {alias.get('name', '') if alias is not None else ''}".strip()


def _autostart(domains: Sequence[Domain],
               roles: dict[str, tuple[str, str, tuple[str, ...]]]) -> list[Finding]:
    found = []
    for dom in domains:
        if not dom.autostart or dom.name not in roles:
            continue
        lendee = roles[dom.name][0] == "lendee"
        found.append(Finding(
            domain=dom.name, check=Check.AUTOSTART, severity=Severity.WARNING,
            what="libvirt autostarts it",
            why="libvirt starts it when libvirtd starts at host boot, before hostagent "
                "answers its hook, which can then only spool the event: "
                + ("the lendee boots with every GPU, those an owner starting at boot "
                   "needs included, and one of the two fails to start."
                   if lendee else
                   "the owner takes its GPU while the lendee may be booting with it, and "
                   "one of the two fails to start."),
            fix=f"virsh autostart --disable {dom.name}; "
                + ("hostagent lends the free GPUs at boot by itself"
                   if lendee else
                   f"to start it at boot, set start_at_boot = true under [owners.{dom.name}]: "
                   "hostagent then starts it once its GPUs are free")))
    return found


def format_findings(findings: Iterable[Finding]) -> str:
    lines = []
    for f in findings:
        lines += [f.line(), f"  why: {f.why}", f"  fix: {f.fix}"]
    return "\n".join(lines)


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.ERROR]
