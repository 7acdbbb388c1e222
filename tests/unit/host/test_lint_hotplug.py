"""``policy.hotplug = "auto"`` from the lendee's definition: each kernel argument with
which a Linux guest ignores a hot-plug request makes it "none", and only the argument
itself does (the lab's guests booted with ``acpiphp.disable=1 pcie_ports=compat`` neither
see a hot-added device nor release one: DESIGN.md, the lab)."""

from __future__ import annotations

import pytest

from hostagent.core.config import parse
from hostagent.core.model import Hotplug
from hostagent.host import lint

AUTO = parse("""
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b"]
[gpus.gpu-a]
pci = "0000:01:00.0"
[gpus.gpu-b]
pci = "0000:02:00.0"
[owners.gaming1]
gpus = ["gpu-a"]
""")


def lendee(cmdline: str | None) -> lint.Domain:
    """A lendee whose definition allows hot-add: a root port of its own per GPU, spare
    ones, a 64-bit window reserved; booted with `cmdline` (None: no <cmdline>)."""
    def hostdev(bus: int) -> str:
        return (f"<hostdev mode='subsystem' type='pci' managed='yes'><source><address "
                f"domain='0x0000' bus='{bus:#x}' slot='0x00' function='0x0'/></source>"
                f"<address type='pci' domain='0x0000' bus='{bus:#04x}' slot='0x00' "
                "function='0x0'/></hostdev>")
    boot = "" if cmdline is None else f"<kernel>/vmlinuz</kernel><cmdline>{cmdline}</cmdline>"
    ports = "".join(f"<controller type='pci' index='{i}' model='pcie-root-port'/>"
                    for i in (1, 2, 3))
    return lint.parse_domain(
        "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
        f"<name>gpu-node</name><os><type machine='q35'>hvm</type>{boot}</os><devices>"
        f"<controller type='pci' index='0' model='pcie-root'/>{ports}{hostdev(1)}{hostdev(2)}"
        "</devices><qemu:commandline><qemu:arg value='-global'/>"
        "<qemu:arg value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline></domain>")


@pytest.mark.parametrize("cmdline", [None, "", "quiet", "console=ttyS0 pcie_ports=native",
                                     "acpiphp.disable=0", "pciehp.disable=10"])
def test_a_guest_with_its_hot_plug_on_may_hot_add(cmdline: str | None) -> None:
    assert lint.hotplug_capability(lendee(cmdline), AUTO)[0] is Hotplug.ADD


@pytest.mark.parametrize("argument", ["acpiphp.disable=1", "pcie_ports=compat",
                                      "pciehp.disable=1"])
def test_each_argument_that_turns_the_guests_hot_plug_off_rules_it_out(argument: str) -> None:
    for cmdline in (argument, f"quiet {argument} console=ttyS0"):
        assert lint.hotplug_capability(lendee(cmdline), AUTO) == (Hotplug.NONE, (
            f"gpu-node's kernel command line has {argument}: it ignores hot-plug"))
