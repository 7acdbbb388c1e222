"""Whether the lendee's GPUs can change while it runs (``policy.hotplug``), read from its
definition: what `hostagent lint` says of hot-add and hot-unplug, and what ``"auto"``
means for a lendee.

From the definition alone ``"auto"`` is at most "add" (hot-add): a q35 machine, a
hot-pluggable pcie-root-port of its own for each function an owner may free, a 64-bit
prefetchable window reserved on the root ports (the firmware sizes an empty port's
window at boot, and a GPU's BAR1 does not fit the default), and a guest whose hot-plug
is not turned off. Hot-unplug needs what only the running lendee can show: device
plugins that honour ``nvidia.com/gpu.deploy.device-plugin`` (their pods leave the node
when it is false, as NVIDIA's mig-manager pauses them) and an nvidia-smi with NVML's
drain state; `unplug_at_run_time` is the seam that turns "auto" into "both" once they
are seen, and back to "add" when they are not.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import replace

from hostagent.core import devices as gpu_devices
from hostagent.core.config import Config, Hotplug, Regrow
from hostagent.core.model import Policy
from hostagent.host.lint_xml import Check, Domain, Finding, Severity, _address

__all__ = [
    "UNPLUG_NEEDS",
    "changes",
    "hotplug_capability",
    "hotplug_findings",
    "regrow_note",
    "unplug_at_run_time",
]

# What hot-unplug needs of the running lendee, beyond its definition: said by lint and
# status while "auto" is hot-add only.
UNPLUG_NEEDS = ("hot-unplug only once the running lendee shows its GPU plugins honour "
                "nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports drain")

_PREF64 = "no 64-bit prefetchable window is reserved on the root ports"

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
            _PREF64,
            "the firmware sizes an empty root port's windows at boot to almost nothing; a "
            "GPU attached later whose BAR1 (256 MiB to tens of GiB) does not fit gets no "
            "address in the guest and its driver fails.",
            _PREF64_FIX, Severity.WARNING))
    return found


# Kernel arguments with which a Linux guest ignores a hot-plug request: no ACPI hot-plug
# driver (acpiphp), or the PCIe ports without their native hot-plug service.
_NO_HOTPLUG_ARGS = ("acpiphp.disable=1", "pcie_ports=compat", "pciehp.disable=1")


def hotplug_capability(dom: Domain, config: Config) -> tuple[Hotplug, str]:
    """What ``policy.hotplug = "auto"`` means for the lendee `dom` from its definition:
    "add" when the GPUs an owner may free can be attached live (`_hot_add` finds no
    error and a 64-bit prefetchable window is reserved: without one, a GPU attached
    live gets no address in the guest) and the kernel command line in its XML does not
    turn the guest's hot-plug off; else "none". Never "both": hot-unplug waits for what
    the running lendee shows (`unplug_at_run_time`). With the reason, in one sentence,
    for `hostagent status` and `hostagent lint`. A policy set by hand is what applies."""
    if config.policy.hotplug is not Hotplug.AUTO:
        return config.policy.hotplug, f"policy.hotplug = \"{config.policy.hotplug}\""
    found = _hot_add(dom, config)
    problems = [f.what.removeprefix("policy.hotplug: ") for f in found
                if f.severity is Severity.ERROR]
    if problems:
        return Hotplug.NONE, f"{dom.name} cannot hot-plug its GPUs: {problems[0]}"
    if any(f.what.endswith(_PREF64) for f in found):
        return Hotplug.NONE, (f"{dom.name} cannot hot-add its GPUs: {_PREF64} "
                              "(pcie-root-port.pref64-reserve)")
    cmdline = ""
    if dom.xml:
        element = ET.fromstring(dom.xml).find("os/cmdline")
        cmdline = (element.text or "") if element is not None else ""
    off = [a for a in _NO_HOTPLUG_ARGS if a in cmdline.split()]
    if off:
        return Hotplug.NONE, f"{dom.name}'s kernel command line has {off[0]}: it ignores hot-plug"
    return Hotplug.ADD, (f"{dom.name} has a spare pcie-root-port for each function of its "
                         "owners' GPUs, a 64-bit prefetchable window and its guest's "
                         f"hot-plug on: hot-add; {UNPLUG_NEEDS}")


def unplug_at_run_time(config: Config, policy: Policy, *, plugins_pausable: bool,
                       drain_supported: bool) -> Policy:
    """`policy` once the running lendee has shown what hot-unplug needs, under
    ``policy.hotplug = "auto"``: "both" where its GPU plugins can be paused through
    their node label (``plugins_pausable``, the cluster's check) and its nvidia-smi
    supports NVML's drain state (``drain_supported``, the guest's), else "add"; with
    the reason for status. Unchanged where hot-plug was set by hand, or where the
    definition allows no hot-add ("none"). Pure: the agent asks both on each boot of
    the lendee (another boot may run another driver) and applies the result."""
    if config.policy.hotplug is not Hotplug.AUTO or policy.hotplug is Hotplug.NONE:
        return policy
    lendee = config.lendee.domain
    missing = [why for ok, why in (
        (plugins_pausable, "its GPU plugins do not honour nvidia.com/gpu.deploy.device-plugin"),
        (drain_supported, "its nvidia-smi does not support drain"),
    ) if not ok]
    if missing:
        return replace(policy, hotplug=Hotplug.ADD, hotplug_why=(
            f'policy.hotplug = "auto": {lendee} hot-adds only: {" and ".join(missing)}'))
    return replace(policy, hotplug=Hotplug.BOTH, hotplug_why=(
        f'policy.hotplug = "auto": {lendee} hot-adds, and hot-unplugs since its GPU '
        "plugins honour nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports "
        "drain"))


def hotplug_findings(lendee: Domain, config: Config) -> list[Finding]:
    """What `hostagent lint` says of the lendee's hot-plug: every finding of `_hot_add`
    where hot-plug is set by hand, and under "auto" its 64-bit window warning where the
    window is all that keeps the lendee from hot-add (anything else is why "auto" means
    "none" here, which lint's note says); the caveat of hot-unplug where "both" is set
    by hand."""
    hotplug = config.policy.hotplug
    found: list[Finding] = []
    if hotplug in (Hotplug.ADD, Hotplug.BOTH):
        found += _hot_add(lendee, config)
    elif hotplug is Hotplug.AUTO and _PREF64 in hotplug_capability(lendee, config)[1]:
        # The window is all that keeps "auto" from hot-add here: say how to reserve it.
        found += [replace(f, why=f"{f.why} policy.hotplug = \"auto\" attaches no GPU live "
                             "here until one is reserved.")
                  for f in _hot_add(lendee, config) if f.what.endswith(_PREF64)]
    if hotplug is Hotplug.BOTH:
        found.append(Finding(
            domain=lendee.name, check=Check.HOTPLUG, severity=Severity.WARNING,
            what="policy.hotplug = \"both\" is experimental: NVIDIA does not support "
                 "hot-unplug of its GPUs",
            why="the driver in the lendee unbinds a GPU as it leaves, and NVIDIA's open "
                "kernel modules from 595.58.03 to at least 610.57.04 hang an unbind begun "
                "while a client holds the GPU, even once it lets go "
                "(github.com/NVIDIA/open-gpu-kernel-modules/issues/1119). hostagent evicts "
                "the GPU's pods, keeps its plugins off it and waits until no process in the "
                "guest holds its device node (nvidia-persistenced and a display server as "
                "much as a job), then takes it out through NVML's drain state where the "
                "guest's nvidia-smi has it, else by that unbind; it restarts the lendee "
                "when the guest keeps the GPU past a bound, and powers it off where its "
                "driver hung there and its shutdown does not end.",
            fix="run a driver outside that range in the lendee (or one whose release notes "
                "say the unbind is fixed), or set policy.hotplug = \"add\" (or \"auto\", "
                "which hot-unplugs only where the running lendee shows it can)"))
    return found


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

