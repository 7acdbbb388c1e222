"""What `hostagent lint` reads of a domain's XML (`hostagent.host.lint_xml.parse_domain`):
its machine and firmware, its PCI hostdevs (managed, ROM BAR), its guest agent channel,
its boot order in either of libvirt's forms, and the user aliases that tie devices to a
GPU; and how a finding reads in one line."""

from __future__ import annotations

import pytest

from hostagent.host.lint_xml import (
    AGENT_CHANNEL,
    BootDevice,
    Check,
    Finding,
    Hostdev,
    Severity,
    parse_domain,
)


def domain(os: str = "", devices: str | None = "", name: str = "win11") -> str:
    devs = "" if devices is None else f"<devices>{devices}</devices>"
    return f"<domain type='kvm'><name> {name} </name>{os}{devs}</domain>"


def test_a_finding_reads_as_one_line() -> None:
    f = Finding(domain="win11", check=Check.NOT_Q35, severity=Severity.WARNING,
                what="machine is pc-i440fx", why="", fix="")
    assert f.line() == "win11: warning: machine is pc-i440fx"


def test_the_name_machine_and_q35() -> None:
    dom = parse_domain(domain("<os><type machine='pc-q35-8.2'>hvm</type></os>"))
    assert (dom.name, dom.machine, dom.q35, dom.ovmf) == ("win11", "pc-q35-8.2", True, False)
    old = parse_domain(domain("<os><type>hvm</type></os>"))
    assert (old.machine, old.q35) == ("", False)
    bare = parse_domain(domain())  # no <os>: neither a machine nor UEFI
    assert (bare.machine, bare.ovmf) == ("", False)
    assert parse_domain(domain("<os firmware='efi'/>")).machine == ""
    assert parse_domain("<domain/>").name == ""


@pytest.mark.parametrize(("os", "ovmf"), [
    ("<os firmware='efi'/>", True),
    ("<os firmware='bios'/>", False),
    ("<os><loader>/usr/share/ovmf/OVMF_CODE.fd</loader></os>", True),
    ("<os><loader>/usr/share/edk2/x64/edk2-code.fd</loader></os>", True),
    ("<os><loader type='pflash'>/opt/fw.fd</loader></os>", True),
    ("<os><loader type='rom'>/opt/fw.fd</loader></os>", False),
    ("<os><loader type='rom'/></os>", False),
    ("<os><type>hvm</type></os>", False),
])
def test_uefi_is_known_by_the_firmware_attribute_or_the_loader(os: str, ovmf: bool) -> None:
    assert parse_domain(domain(os)).ovmf is ovmf


def test_only_pci_subsystem_hostdevs_with_an_address_are_read() -> None:
    devices = """
      <hostdev mode='capabilities' type='pci'>
        <source><address bus='0x09' slot='0' function='0'/></source>
      </hostdev>
      <hostdev mode='subsystem' type='pci'><source/></hostdev>
      <hostdev mode='subsystem' type='pci' managed='yes'>
        <source><address domain='0x0000' bus='0x01' slot='0x00' function='0x1'/></source>
        <rom bar='off'/>
      </hostdev>
      <hostdev type='pci'>
        <source><address domain='0x1' bus='0x2' slot='0x1f' function='0'/></source>
        <rom bar='on'/>
      </hostdev>
      <hostdev mode='subsystem' type='pci' managed='no'>
        <source><address bus='3'/></source><rom file='/x.rom'/>
      </hostdev>
      <hostdev mode='capabilities' type='pci'>
        <source><address bus='0x04' slot='0' function='0'/></source>
      </hostdev>
      <hostdev mode='subsystem' type='usb'>
        <source><address bus='5' device='2'/></source>
      </hostdev>
      <hostdev mode='subsystem' type='pci'><source/></hostdev>
      <hostdev mode='subsystem' type='pci'>
        <source><address bus='zz' slot='0' function='0'/></source>
      </hostdev>
    """
    assert parse_domain(domain(devices=devices)).hostdevs == (
        Hostdev(address="0000:01:00.1", managed=True, rom_bar_off=True),
        Hostdev(address="0001:02:1f.0", managed=False, rom_bar_off=False),
        Hostdev(address="0000:03:00.0", managed=False, rom_bar_off=False),
    )


def test_the_guest_agent_channel_is_found_by_its_name() -> None:
    agent = f"<channel type='unix'><target type='virtio' name='{AGENT_CHANNEL}'/></channel>"
    other = "<channel type='spicevmc'><target type='virtio' name='com.redhat.spice.0'/></channel>"
    assert parse_domain(domain(devices=other + agent)).agent_channel is True
    assert parse_domain(domain(devices=other)).agent_channel is False
    assert parse_domain(domain(devices=None)).agent_channel is False


def test_user_aliases_of_hostagent_are_kept_in_order() -> None:
    devices = """
      <disk type='file' device='disk'><alias name='ua-hostagent-gpu-b'/></disk>
      <controller type='usb'><alias name='ua-other'/></controller>
      <hostdev mode='subsystem' type='pci'><alias name='ua-hostagent-gpu-a-usb'/></hostdev>
      <disk type='file' device='disk'><alias/></disk>
    """
    assert parse_domain(domain(devices=devices)).aliases == (
        "ua-hostagent-gpu-b", "ua-hostagent-gpu-a-usb")


def test_the_boot_order_of_devices_is_by_their_order_attribute() -> None:
    devices = """
      <disk type='file' device='disk'><boot order='2'/></disk>
      <disk type='file' device='cdrom'><source file='/iso/win.iso'/><boot order='1'/></disk>
      <disk type='file' device='cdrom'><source/><boot order='4'/></disk>
      <interface type='network'><boot order='3'/></interface>
      <disk type='file'><boot order='5'/></disk>
      <disk type='file' device='disk'><boot/></disk>
      <hostdev mode='subsystem' type='pci'><boot order='10'/></hostdev>
    """
    assert parse_domain(domain("<os><boot dev='hd'/></os>", devices)).boot == (
        BootDevice(kind="cdrom", media=True, order=1),
        BootDevice(kind="disk", media=False, order=2),
        BootDevice(kind="interface", media=False, order=3),
        BootDevice(kind="cdrom", media=False, order=4),
        BootDevice(kind="disk", media=False, order=5),
        BootDevice(kind="hostdev", media=False, order=10),
    )


def test_the_older_os_boot_list_is_by_kind() -> None:
    os = "<os><boot dev='cdrom'/><boot dev='hd'/><boot dev='network'/><boot dev='fd'/></os>"
    with_media = "<disk device='cdrom'><source file='/iso/win.iso'/></disk><disk device='disk'/>"
    assert parse_domain(domain(os, with_media)).boot == (
        BootDevice(kind="cdrom", media=True, order=0),
        BootDevice(kind="disk", media=False, order=1),
        BootDevice(kind="network", media=False, order=2),
        BootDevice(kind="fd", media=False, order=3),
    )
    empty = "<disk device='cdrom'><source/></disk><disk device='disk'><source file='/a'/></disk>"
    assert parse_domain(domain(os, empty)).boot[0] == BootDevice(kind="cdrom", media=False,
                                                                  order=0)
    assert parse_domain(domain(os, None)).boot == ()
    assert parse_domain(domain("<os><boot/></os>", "")).boot == (
        BootDevice(kind="", media=False, order=0),)


def test_autostart_and_the_text_are_kept() -> None:
    xml = domain()
    assert parse_domain(xml).autostart is None
    dom = parse_domain(xml, autostart=True)
    assert (dom.autostart, dom.xml) == (True, xml)


@pytest.mark.parametrize(("xml", "said"), [
    ("<domain>", "not XML: "),
    ("<network/>", "not a libvirt domain (root element <network>)"),
])
def test_what_is_not_domain_xml_is_refused_saying_why(xml: str, said: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_domain(xml)
    assert str(info.value).startswith(said)
