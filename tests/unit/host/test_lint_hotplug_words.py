"""What `hostagent lint` and `hostagent status` say of the lendee's hot-plug, word for
word: each finding of `lint_hotplug` whole (check, severity, what, why, fix) for a
definition that makes it, the reason `hotplug_capability` gives on each of its roads,
`regrow_note` and `changes` for each policy; then what of the definition each reads
(the root ports, the devices already on them, the functions' addresses, the GPUs found
by alias, the kernel command line). The operator reads these words: a change to them is
a change the tests should see."""

from __future__ import annotations

import pytest

from hostagent.core.config import Config, parse
from hostagent.core.model import Hotplug, Regrow
from hostagent.host.lint_hotplug import (
    changes,
    hotplug_capability,
    hotplug_findings,
    regrow_note,
)
from hostagent.host.lint_xml import Check, Domain, Finding, Severity, parse_domain
from tests.configs import lendee_toml
from tests.unit.hotplug_scaffold import LINT_CONFIG, lendee_xml

ADD = parse(LINT_CONFIG)
AUTO = parse(LINT_CONFIG.replace('hotplug = "add"', ""))
BOTH = parse(LINT_CONFIG.replace('hotplug = "add"', 'hotplug = "both"'))
NONE = parse(LINT_CONFIG.replace('hotplug = "add"', 'hotplug = "none"'))

QEMU_NS = "xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'"
PREF64 = ("<qemu:commandline><qemu:arg value='-global'/>"
          "<qemu:arg value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline>")

NOT_IN_A_PORT_WHY = ("a hot-added device goes into an empty hot-pluggable root port; one on "
                     "the root bus or a bridge cannot be added live.")
NOT_IN_A_PORT_FIX = ("give it <address type='pci' bus='0xNN' slot='0x00'/> on a "
                     "<controller type='pci' model='pcie-root-port'> with an explicit index "
                     "(one per function)")
SHARES_WHY = ("libvirt hot-plugs one single-function device per root port: a "
              "multifunction slot cannot be attached live.")
SHARES_FIX = ("give each function its own pcie-root-port (bus), slot 0x00, without "
              "multifunction='on'")
PREF64_WHAT = "policy.hotplug: no 64-bit prefetchable window is reserved on the root ports"
PREF64_WHY = ("the firmware sizes an empty root port's windows at boot to almost nothing; a "
              "GPU attached later whose BAR1 (256 MiB to tens of GiB) does not fit gets no "
              "address in the guest and its driver fails.")
PREF64_FIX = ("reserve a 64-bit prefetchable window on the root ports, at least each GPU's "
              "BAR1 (`lspci -vv` on the host: the largest 64-bit prefetchable region) rounded "
              "up: in the domain's XML, <qemu:commandline><qemu:arg value='-global'/>"
              "<qemu:arg value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline> "
              "(xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0' on <domain>)")
UNPLUG_NEEDS = ("hot-unplug only once the running lendee shows its GPU plugins honour "
                "nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports drain")
CAN_ADD = ("gpu-node has a spare pcie-root-port for each function of its owners' GPUs, a "
           f"64-bit prefetchable window and its guest's hot-plug on: hot-add; {UNPLUG_NEEDS}")
BOTH_WARNING = Finding(
    domain="gpu-node", check=Check.HOTPLUG, severity=Severity.WARNING,
    what="policy.hotplug = \"both\" is experimental: NVIDIA does not support hot-unplug of "
         "its GPUs",
    why="the driver in the lendee unbinds a GPU as it leaves, and NVIDIA's open kernel "
        "modules from 595.58.03 to at least 610.57.04 hang an unbind begun while a client "
        "holds the GPU, even once it lets go "
        "(github.com/NVIDIA/open-gpu-kernel-modules/issues/1119). hostagent evicts the "
        "GPU's pods, keeps its plugins off it and waits until no process in the guest holds "
        "its device node (nvidia-persistenced and a display server as much as a job), then "
        "takes it out through NVML's drain state where the guest's nvidia-smi has it, else "
        "by that unbind; it restarts the lendee when the guest keeps the GPU past a bound, "
        "and powers it off where its driver hung there and its shutdown does not end.",
    fix="run a driver outside that range in the lendee (or one whose release notes say the "
        "unbind is fixed), or set policy.hotplug = \"add\" (or \"auto\", which hot-unplugs "
        "only where the running lendee shows it can)")


def error(what: str, why: str, fix: str) -> Finding:
    return Finding(domain="gpu-node", check=Check.HOTPLUG, severity=Severity.ERROR,
                   what=f"policy.hotplug: {what}", why=why, fix=fix)


def not_in_a_port(what: str) -> Finding:
    return error(f"{what} is not in a pcie-root-port of its own", NOT_IN_A_PORT_WHY,
                 NOT_IN_A_PORT_FIX)


def shares(what: str) -> Finding:
    return error(what, SHARES_WHY, SHARES_FIX)


PREF64_WARNING = Finding(domain="gpu-node", check=Check.HOTPLUG, severity=Severity.WARNING,
                         what=PREF64_WHAT, why=PREF64_WHY, fix=PREF64_FIX)


def findings(xml: str, config: Config = ADD) -> list[Finding]:
    return hotplug_findings(parse_domain(xml), config)


def with_devices(devices: str, *, ports: str = "1 2 3", cmdline: str | None = None) -> str:
    """A q35 lendee with pcie-root-ports of the indexes `ports`, a 64-bit window reserved,
    and `devices` (booted with `cmdline` where given)."""
    boot = "" if cmdline is None else f"<kernel>/vmlinuz</kernel><cmdline>{cmdline}</cmdline>"
    controllers = "".join(f"<controller type='pci' index='{i}' model='pcie-root-port'/>"
                          for i in ports.split())
    return (f"<domain type='kvm' {QEMU_NS}><name>gpu-node</name>"
            f"<os><type machine='q35'>hvm</type>{boot}</os><devices>"
            f"<controller type='pci' index='0' model='pcie-root'/>{controllers}{devices}"
            f"</devices>{PREF64}</domain>")


def gpu_function(function: int, bus: str, *, attributes: str = "") -> str:
    """gpu-a's function `function` (host 0000:01:00.N), at guest bus `bus`."""
    return (f"<hostdev mode='subsystem' type='pci' managed='yes'><source><address "
            f"domain='0x0000' bus='0x01' slot='0x00' function='{function:#x}'/></source>"
            f"<address type='pci' domain='0x0000' bus='{bus}' slot='0x00' "
            f"function='0x0'{attributes}/></hostdev>")


GPU_B = gpu_function(0, "0x03").replace("bus='0x01'", "bus='0x02'")


# --- each finding, whole -------------------------------------------------------------------


def test_a_machine_without_pcie_root_ports() -> None:
    why = "a GPU is hot-added into a pcie-root-port, which only q35 has."
    fix = "move the lendee to q35 (a new definition), or set policy.hotplug = \"none\""
    assert findings(lendee_xml(machine="pc-i440fx-7.2")) == [
        error("machine pc-i440fx-7.2 has no PCIe root ports", why, fix)]
    # A definition that names no machine type is told so.
    assert findings(lendee_xml(machine="")) == [
        error("machine (unset) has no PCIe root ports", why, fix)]


def test_a_function_outside_a_root_port_of_its_own() -> None:
    assert findings(lendee_xml(buses=(1, 7))) == [
        not_in_a_port("<hostdev> 0000:01:00.1 of gpu-a")]
    # Each function is told, not only the first found.
    assert findings(lendee_xml(buses=(7, 8))) == [
        not_in_a_port("<hostdev> 0000:01:00.0 of gpu-a"),
        not_in_a_port("<hostdev> 0000:01:00.1 of gpu-a")]


def test_functions_that_share_a_root_port() -> None:
    # The first function of a multifunction slot shares it with a function yet unread;
    # the second names the first.
    assert findings(lendee_xml(buses=(1, 1), multifunction=True)) == [
        shares("<hostdev> 0000:01:00.0 of gpu-a shares root port 1 with another function"),
        shares("<hostdev> 0000:01:00.1 of gpu-a shares root port 1 with gpu-a's <hostdev> "
               "0000:01:00.0")]
    # Without multifunction='on', only the second is told.
    assert findings(lendee_xml(buses=(1, 1))) == [
        shares("<hostdev> 0000:01:00.1 of gpu-a shares root port 1 with gpu-a's <hostdev> "
               "0000:01:00.0")]


def test_a_root_port_with_hotplug_off() -> None:
    assert findings(lendee_xml(hotplug_off=True)) == [
        error(f"root port {bus} of gpu-a's <hostdev> 0000:01:00.{f} has hotplug='off'",
              "the guest is told the port never takes a device.",
              f"remove hotplug='off' from the controller with index {bus}")
        for bus, f in ((1, 0), (2, 1))]


def test_no_64_bit_window_reserved() -> None:
    assert findings(lendee_xml(pref64=False)) == [PREF64_WARNING]


def test_a_lendee_ready_for_hot_add_has_no_finding() -> None:
    assert findings(lendee_xml()) == []


def test_hotplug_both_adds_its_caveat_after_the_hot_add_findings() -> None:
    assert findings(lendee_xml(), BOTH) == [BOTH_WARNING]
    assert findings(lendee_xml(pref64=False), BOTH) == [PREF64_WARNING, BOTH_WARNING]
    assert findings(lendee_xml(buses=(1, 7)), BOTH) == [
        not_in_a_port("<hostdev> 0000:01:00.1 of gpu-a"), BOTH_WARNING]


def test_under_auto_only_the_missing_window_is_a_finding() -> None:
    # The window is all that keeps "auto" from hot-add: lint says how to reserve it.
    assert findings(lendee_xml(pref64=False), AUTO) == [Finding(
        domain="gpu-node", check=Check.HOTPLUG, severity=Severity.WARNING, what=PREF64_WHAT,
        why=f"{PREF64_WHY} policy.hotplug = \"auto\" attaches no GPU live here until one is "
            "reserved.",
        fix=PREF64_FIX)]
    # An error under "auto" is why it means "none" (lint's note), not a finding; nor is
    # the window then.
    assert findings(lendee_xml(pref64=False, buses=(1, 7)), AUTO) == []
    assert findings(lendee_xml(machine="pc-i440fx-7.2"), AUTO) == []
    assert findings(lendee_xml(), AUTO) == []


def test_hotplug_none_has_no_finding() -> None:
    for xml in (lendee_xml(pref64=False), lendee_xml(machine="pc-i440fx-7.2"),
                lendee_xml(hotplug_off=True)):
        assert findings(xml, NONE) == []


# --- what hotplug_capability says, on each road ----------------------------------------------


@pytest.mark.parametrize("config,how", [(ADD, Hotplug.ADD), (BOTH, Hotplug.BOTH),
                                        (NONE, Hotplug.NONE)])
def test_a_policy_set_by_hand_is_what_applies(config: Config, how: Hotplug) -> None:
    for xml in (lendee_xml(), lendee_xml(machine="pc-i440fx-7.2")):
        assert hotplug_capability(parse_domain(xml), config) == (
            how, f'policy.hotplug = "{how}"')


def test_auto_is_hot_add_where_the_definition_allows_it() -> None:
    assert hotplug_capability(parse_domain(lendee_xml()), AUTO) == (Hotplug.ADD, CAN_ADD)


def test_auto_is_none_with_the_first_error() -> None:
    assert hotplug_capability(parse_domain(lendee_xml(machine="pc-i440fx-7.2")), AUTO) == (
        Hotplug.NONE,
        "gpu-node cannot hot-plug its GPUs: machine pc-i440fx-7.2 has no PCIe root ports")
    assert hotplug_capability(parse_domain(lendee_xml(buses=(7, 8))), AUTO) == (
        Hotplug.NONE, "gpu-node cannot hot-plug its GPUs: <hostdev> 0000:01:00.0 of gpu-a is "
                      "not in a pcie-root-port of its own")


def test_auto_is_none_without_the_window() -> None:
    assert hotplug_capability(parse_domain(lendee_xml(pref64=False)), AUTO) == (
        Hotplug.NONE, "gpu-node cannot hot-add its GPUs: no 64-bit prefetchable window is "
                      "reserved on the root ports (pcie-root-port.pref64-reserve)")


def test_auto_is_none_where_the_kernel_command_line_turns_hot_plug_off() -> None:
    xml = with_devices(gpu_function(0, "0x01") + gpu_function(1, "0x02") + GPU_B,
                       cmdline="quiet pciehp.disable=1 pcie_ports=compat")
    # The first of the arguments in the module's order is named.
    assert hotplug_capability(parse_domain(xml), AUTO) == (
        Hotplug.NONE, "gpu-node's kernel command line has pcie_ports=compat: it ignores "
                      "hot-plug")
    for cmdline in ("", "quiet"):
        booted = with_devices(gpu_function(0, "0x01") + gpu_function(1, "0x02") + GPU_B,
                              cmdline=cmdline)
        assert hotplug_capability(parse_domain(booted), AUTO) == (Hotplug.ADD, CAN_ADD)


def test_a_domain_built_by_hand_without_its_xml() -> None:
    # Nothing to tell the ports or the command line from: only the machine type is read.
    dom = Domain(name="gpu-node", machine="pc-q35-9.2", ovmf=True, hostdevs=(),
                 agent_channel=True, boot=())
    assert hotplug_findings(dom, ADD) == []
    assert hotplug_capability(dom, AUTO) == (Hotplug.ADD, CAN_ADD)


# --- regrow_note and changes ------------------------------------------------------------------


WAITS = "a regrow by restart waits until no GPU pod runs, however long"


def test_regrow_note_is_none_without_the_lendee() -> None:
    other = parse_domain(lendee_xml().replace("gpu-node", "gaming1"))
    assert regrow_note([other], AUTO) is None
    assert regrow_note([], AUTO) is None


def test_regrow_note_reads_the_lendee_among_the_domains() -> None:
    # Another domain first, one that could not hot-add: the lendee's is the note.
    other = parse_domain(lendee_xml(machine="pc-i440fx-7.2").replace("gpu-node", "gaming1"))
    assert regrow_note([other, parse_domain(lendee_xml())], AUTO) == (
        f"gpu-node: GPUs change live when added (hot-add), by restart when a game takes one; "
        f"{WAITS} ({CAN_ADD})")


def test_regrow_note_says_how_and_why_for_each_policy() -> None:
    ready = [parse_domain(lendee_xml())]
    assert regrow_note(ready, BOTH) == (
        "gpu-node: GPUs change live (hot-add and hot-unplug), the restart as fallback; "
        f'{WAITS} (policy.hotplug = "both")')
    assert regrow_note(ready, NONE) == (
        f'gpu-node: GPUs change by restart; {WAITS} (policy.hotplug = "none")')
    always = parse(LINT_CONFIG + 'regrow = "always"\n')
    assert regrow_note(ready, always) == (
        "gpu-node: GPUs change live when added (hot-add), by restart when a game takes one; "
        "a regrow by restart kills the GPU jobs that run (policy.regrow = \"always\") "
        '(policy.hotplug = "add")')
    bounded = parse(LINT_CONFIG + 'regrow_max_wait = "90m"\n')
    assert regrow_note(ready, bounded) == (
        "gpu-node: GPUs change live when added (hot-add), by restart when a game takes one; "
        "a regrow by restart waits up to 5400s (policy.regrow_max_wait) for the GPU pods to "
        'end, then kills them (policy.hotplug = "add")')


HOW = {
    Hotplug.BOTH: "live (hot-add and hot-unplug), the restart as fallback; ",
    Hotplug.ADD: "live when added (hot-add), by restart when a game takes one; ",
    Hotplug.NONE: "by restart; ",
}


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("regrow,max_wait,wait", [
    (Regrow.ALWAYS, 60.0,
     'a regrow by restart kills the GPU jobs that run (policy.regrow = "always")'),
    (Regrow.NEVER, 60.0, 'no regrow by restart (policy.regrow = "never")'),
    (Regrow.WHEN_IDLE, None, WAITS),
    (Regrow.WHEN_IDLE, 1.5, "a regrow by restart waits up to 1.5s (policy.regrow_max_wait) "
                            "for the GPU pods to end, then kills them"),
    (Regrow.WHEN_IDLE, 0.0, "a regrow by restart waits up to 0s (policy.regrow_max_wait) "
                            "for the GPU pods to end, then kills them"),
])
def test_changes_in_a_few_words(how: Hotplug, regrow: Regrow, max_wait: float | None,
                                wait: str) -> None:
    assert changes(how, regrow, max_wait) == HOW[how] + wait


# --- what of the definition is read ---------------------------------------------------------


def test_another_device_on_a_gpus_root_port_is_named() -> None:
    disk = ("<disk type='file' device='disk'><source file='/d.qcow2'/><target dev='vda' "
            "bus='virtio'/><address type='pci' domain='0x0000' bus='0x02' slot='0x00' "
            "function='0x0'/></disk>")
    xml = with_devices(disk + gpu_function(0, "0x01") + gpu_function(1, "0x02") + GPU_B)
    assert findings(xml) == [
        shares("<hostdev> 0000:01:00.1 of gpu-a shares root port 2 with <disk>")]
    # A device on a port no GPU of an owner uses is no concern; nor is one without a
    # PCI address.
    elsewhere = with_devices(disk.replace("0x02", "0x04") + gpu_function(0, "0x01")
                             + gpu_function(1, "0x02") + GPU_B, ports="1 2 3 4")
    assert findings(elsewhere) == []
    usb = disk.replace("type='pci' domain='0x0000' bus='0x02' slot='0x00' function='0x0'",
                       "type='drive' controller='0' bus='2' unit='0'")
    assert findings(with_devices(usb + gpu_function(0, "0x01") + gpu_function(1, "0x02")
                                 + GPU_B)) == []


def test_a_gpu_of_no_owner_may_share_its_port() -> None:
    # gpu-b is the lendee's own: it is never hot-added, so its port is not checked, and
    # it is not another device on an owner's GPU's port either.
    gpu_b = GPU_B.replace("bus='0x03'", "bus='0x02'")
    xml = with_devices(gpu_function(0, "0x01") + gpu_function(1, "0x02") + gpu_b)
    assert findings(xml) == []


def test_a_bus_that_is_no_number_is_in_no_root_port() -> None:
    xml = with_devices(gpu_function(0, "0xzz") + gpu_function(1, "0x02") + GPU_B)
    assert findings(xml) == [not_in_a_port("<hostdev> 0000:01:00.0 of gpu-a")]
    # Nor is a function without a guest address.
    bare = gpu_function(1, "0x02").replace(
        "<address type='pci' domain='0x0000' bus='0x02' slot='0x00' function='0x0'/>", "")
    xml = with_devices(gpu_function(0, "0x01") + bare + GPU_B)
    assert findings(xml) == [not_in_a_port("<hostdev> 0000:01:00.1 of gpu-a")]


def test_only_a_root_port_with_hotplug_off_is_told() -> None:
    xml = with_devices(gpu_function(0, "0x01") + gpu_function(1, "0x02") + GPU_B).replace(
        "<controller type='pci' index='1' model='pcie-root-port'/>",
        "<controller type='pci' index='1' model='pcie-root-port'><model name='pcie-root-port'/>"
        "<target chassis='1' port='0x10' hotplug='on'/></controller>")
    assert findings(xml) == []
    # A controller of another model is no root port, whatever its index.
    bridge = with_devices(gpu_function(0, "0x01") + gpu_function(1, "0x02") + GPU_B,
                          ports="1 3").replace(
        "<controller type='pci' index='3'",
        "<controller type='pci' index='2' model='pcie-to-pci-bridge'/>"
        "<controller type='pci' index='3'")
    assert findings(bridge) == [not_in_a_port("<hostdev> 0000:01:00.1 of gpu-a")]


def test_multifunction_off_is_a_port_of_its_own() -> None:
    xml = with_devices(gpu_function(0, "0x01", attributes=" multifunction='off'")
                       + gpu_function(1, "0x02") + GPU_B)
    assert findings(xml) == []


ALIASED = lendee_toml(uuids=False) + """
[owners.gaming1]
gpus = ["gpu-a", "gpu-b"]
[policy]
hotplug = "add"
"""


def test_a_gpu_found_by_its_alias_is_named_by_it() -> None:
    # A device of the GPU's that is no PCI hostdev of its address is tied to it by its
    # user alias, and named by its element and that alias.
    interface = ("<interface type='hostdev' managed='yes'><source><address type='pci' "
                 "domain='0x0000' bus='0x01' slot='0x00' function='0x0'/></source>"
                 "<alias name='ua-hostagent-gpu-a'/><address type='pci' domain='0x0000' "
                 "bus='0x07' slot='0x00' function='0x0'/></interface>")
    misc = ("<hostdev mode='capabilities' type='misc'><source><char>/dev/vfio/9</char>"
            "</source><alias name='ua-hostagent-gpu-b-audio'/><address type='pci' "
            "domain='0x0000' bus='0x08' slot='0x00' function='0x0'/></hostdev>")
    assert findings(with_devices(interface + misc), parse(ALIASED)) == [
        not_in_a_port("<interface> ua-hostagent-gpu-a of gpu-a"),
        not_in_a_port("<hostdev> ua-hostagent-gpu-b-audio of gpu-b")]


def test_a_gpu_missing_from_the_definition_leaves_the_others_checked() -> None:
    # gpu-a has no device: the configuration checks say so; gpu-b is still read.
    gpu_b = GPU_B.replace("bus='0x03'", "bus='0x09'")
    assert findings(with_devices(gpu_b), parse(ALIASED)) == [
        not_in_a_port("<hostdev> 0000:02:00.0 of gpu-b")]
