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

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from hostagent.core import devices as gpu_devices
from hostagent.core.config import Config
from hostagent.core.lendees import lendee_of
from hostagent.host import gpus as inventory
from hostagent.host.lint_hotplug import (
    changes,
    hotplug_capability,
    hotplug_findings,
    regrow_note,
    unplug_at_run_time,
)
from hostagent.host.lint_xml import (
    AGENT_CHANNEL,
    Check,
    Domain,
    Finding,
    Hostdev,
    Severity,
    parse_domain,
)

__all__ = [
    "AGENT_CHANNEL",
    "Check",
    "Domain",
    "Finding",
    "Hostdev",
    "Severity",
    "changes",
    "check_domain",
    "errors",
    "format_findings",
    "hotplug_capability",
    "lint",
    "parse_domain",
    "regrow_note",
    "unplug_at_run_time",
]

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
        lendee = None if config is None else dom.name in config.lendees
        found += check_domain(dom, sysfs=sysfs, lendee=lendee)
    found += _split(domains, sysfs)
    found += _shared_groups(domains, sysfs, config)
    if config is not None:
        found += _against_config(domains, config)
        found += _slot_functions(domains, config, sysfs)
        for name in config.lendees:  # each lendee over its own view
            if any(d.name == name for d in domains):
                found += _resets(config.view(name), sysfs)
    return found


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _reset_methods(address: str, sysfs: Path) -> list[str] | None:
    """The function's reset methods as the kernel lists them in sysfs (``reset_method``,
    since 5.15: absent where there is none), or None where it does not say."""
    path = sysfs / "bus" / "pci" / "devices" / address
    try:
        return (path / "reset_method").read_text().split()
    except OSError:
        pass
    # Before 5.15 only `reset` says whether there is one (drivers/pci/pci-sysfs.c shows
    # both only where pci_reset_supported()).
    return None if (path / "reset").exists() else []


def _bus_of(address: str, sysfs: Path) -> tuple[str | None, list[str]]:
    """The bridge above the function (None: on a root bus) and the other devices on its
    bus, read from where the kernel nests its directory in sysfs."""
    try:
        where = (sysfs / "bus" / "pci" / "devices" / address).resolve(strict=True).parent
        names = sorted(p.name for p in where.iterdir() if p.is_dir())
    except OSError:
        return None, []
    bridge = where.name if _PCI_ADDRESS.fullmatch(where.name) else None
    return bridge, [n for n in names if _PCI_ADDRESS.fullmatch(n) and n != address]


def _resets(config: Config, sysfs: Path) -> list[Finding]:
    """Each function of each GPU the lendee borrows can be reset between VMs.

    A function reset (FLR, PM, a device-specific one) resets it alone. Without one the
    reset is of its bus: the kernel lists "bus" only for a function alone on its bus
    (drivers/pci/pci.c, pci_parent_bus_reset), and vfio-pci resets the bus itself when
    every device on it is released (vfio_pci_core.c, vfio_pci_dev_set_try_reset), the
    card's other functions with it. So: no function reset and no bridge above it, or
    every method turned off, is an error; a bus shared with another card or device is a
    warning, since vfio-pci resets it only while none of them is in use."""
    found: list[Finding] = []
    lendee = config.lendee.domain
    for label in config.lendee.gpus:
        gpu = config.gpus[label]
        for address in gpu.pci_functions if gpu.pci else ():
            if inventory.pci_device(address, sysfs) is None:
                continue  # hostdev-missing says so
            methods = _reset_methods(address, sysfs)
            if methods is None or [m for m in methods if m != "bus"]:
                continue
            bridge, on_bus = _bus_of(address, sysfs)
            others = [a for a in on_bus if _slot(a) != _slot(address)]
            why = ("the next VM gets the GPU as the last one left it: its memory, the "
                   "previous VM's data included, and a state its driver may not start from.")
            path = f"/sys/bus/pci/devices/{address}/reset_method"
            what = f"{address} of GPU {label} cannot be reset between VMs: "
            if not methods and (sysfs / path.removeprefix("/sys/")).exists():
                found.append(Finding(
                    domain=lendee, check=Check.RESET, severity=Severity.ERROR,
                    what=what + "every reset method is turned off (its reset_method is empty)",
                    why=why, fix=f"echo default > {path} (and find what wrote it empty: a udev "
                                 "rule, a boot script)"))
            elif bridge is None:
                found.append(Finding(
                    domain=lendee, check=Check.RESET, severity=Severity.ERROR,
                    what=what + "it has no reset method and no bridge above it whose bus "
                                "could be reset",
                    why=why, fix=f"put the card in a slot behind a PCIe root port (`cat {path}` "
                                 "lists the methods the kernel found; `lspci -vv` shows "
                                 "FLReset+ where the card has FLR)"))
            elif others:
                named = ", ".join(f"{a} ({d.ids})" if (d := inventory.pci_device(a, sysfs))
                                  else a for a in others)
                found.append(Finding(
                    domain=lendee, check=Check.RESET, severity=Severity.WARNING,
                    what=f"{address} of GPU {label} is reset only by a reset of its bus, which "
                         f"{named} {'shares' if len(others) == 1 else 'share'}",
                    why=f"a bus reset resets every device behind bridge {bridge}, so it resets "
                        f"{', '.join(others)} too, and vfio-pci resets the bus between VMs only "
                        "while none of them is in use: otherwise " + why,
                    fix="put the card in a slot with a root port of its own, or give the other "
                        "devices on that bus to no VM that runs while the GPU changes hands"))
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
        if len(others) == len(users):
            continue  # no GPU in the group: none of hostagent's moves
        if others:
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
        gpus = sorted({labels[slot] for slot in users})
        if len(gpus) < 2:
            continue
        owners = {g: frozenset(config.owners_of(g)) for g in gpus}
        together = " and ".join(gpus)
        lendees = sorted({n for g in gpus if (n := lendee_of(config, g)) is not None})
        if len(lendees) > 1:
            found.append(Finding(
                domain=", ".join(lendees), check=Check.SHARED_GROUP, severity=Severity.ERROR,
                what=f"{together} share IOMMU group {group} but are lent to "
                     f"{' and '.join(lendees)}",
                why="VFIO gives a group to one VM at a time: while one of those lendees "
                    "runs with its GPU, the other cannot start with its own.",
                fix=_ACS_FIX + "; or lend those GPUs to one lendee"))
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
                domain=lendee_of(config, gpus[0]) or config.lendee.domain,
                check=Check.SHARED_GROUP,
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
        **{name: ("lendee", "lendee.gpus" if len(config.lendees) == 1
                  else f"lendees.{name}.gpus", lendee.gpus)
           for name, lendee in config.lendees.items()},
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
    found += _not_owners(domains, config, roles)
    for name in config.lendees:
        lendee = by_name.get(name)
        if lendee is not None:
            found += hotplug_findings(lendee, config.view(name))
    return found

def _not_owners(domains: Sequence[Domain], config: Config,
                roles: dict[str, tuple[str, str, tuple[str, ...]]]) -> list[Finding]:
    """A VM the configuration does not name that passes through a GPU the lendee borrows
    (an old Windows VM kept around): hostagent reclaims only for an owner, so that VM's
    start fails with libvirt's busy-device error whenever the lendee holds the GPU."""
    found = []
    lent = {gpu: name for name, lendee in config.lendees.items() for gpu in lendee.gpus}
    for dom in domains:
        if dom.name in roles:
            continue
        have = {h.address for h in dom.hostdevs}
        tagged = {gpu_devices.alias_label(a, config.gpus) for a in dom.aliases}
        for label in sorted(lent):
            gpu = config.gpus[label]
            mine = [a for a in gpu.pci_functions if a in have]
            if not mine and label not in tagged:
                continue
            shown = f"{label} ({', '.join(mine)})" if mine else label
            found.append(Finding(
                domain=dom.name, check=Check.NOT_AN_OWNER, severity=Severity.WARNING,
                what=f"{dom.name} passes through {shown}, which {lent[label]} "
                     "borrows, but is not an owner",
                why="hostagent frees a GPU only for an owner: while the lendee holds it, "
                    f"virsh start {dom.name} fails with libvirt's device-in-use error, and "
                    f"while {dom.name} runs, the lendee cannot start with it.",
                fix=f'make it an owner ([owners.{dom.name}] gpus = ["{label}"]), or '
                    f"remove the hostdev from {dom.name} (virsh edit {dom.name})"))
    return found


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
