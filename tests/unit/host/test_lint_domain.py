"""What the agent checks before it starts a VM (`lint.check_domain`), word for word: each
finding whole (domain, check, severity, what, why, fix) for a domain and a host that make
it, the cases that make none, and that the check goes on past a hostdev, a group member
or a check that has nothing to say. The operator reads these words: a change to them is
a change the tests should see."""

from __future__ import annotations

from hostagent.host import lint
from hostagent.host.lint import Check, Finding, Severity
from tests.sysfs import FakeSysfs
from tests.unit.domain_scaffold import domain, gpu, hostdev


def check(sysfs: FakeSysfs, xml: str, lendee: bool | None = None) -> list[Finding]:
    return lint.check_domain(lint.parse_domain(xml), sysfs=sysfs.root, lendee=lendee)


def not_in_xml(xml: str, text: str) -> str:
    assert text in xml
    return xml.replace(text, "", 1)


# --- hostdevs: missing, not on vfio-pci -----------------------------------------------------


def missing(name: str, address: str) -> Finding:
    return Finding(
        domain=name, check=Check.HOSTDEV_MISSING, severity=Severity.ERROR,
        what=f"<hostdev> {address} is not on this host",
        why="libvirt refuses to start a domain whose hostdev points at an empty slot, so the "
            "VM does not start at all.",
        fix=f"remove the hostdev (virsh edit {name}) or point it at the card's new address "
            "(lspci -D; put a replacement card in the freed slot to keep it)")


def unmanaged(name: str, address: str, ids: str, bound: str) -> Finding:
    return Finding(
        domain=name, check=Check.NOT_VFIO, severity=Severity.ERROR,
        what=f"{address} ({ids}) is {bound} and managed='no'",
        why="with managed='no' libvirt leaves the device on its host driver and QEMU cannot "
            "take it, so the start fails.",
        fix=f"bind {ids} to vfio-pci at boot (vfio-pci.ids={ids}), or set managed='yes' on "
            "the hostdev")


def managed_on(name: str, address: str, ids: str, driver: str) -> Finding:
    return Finding(
        domain=name, check=Check.NOT_VFIO, severity=Severity.WARNING,
        what=f"{address} ({ids}) is bound to {driver}, not vfio-pci",
        why=f"libvirt must unbind it from {driver} at every start, which hangs or fails while "
            "the host uses the card.",
        fix=f"bind {ids} to vfio-pci at boot (vfio-pci.ids={ids}): by id, a replacement card "
            "of the same model is caught too")


def test_a_missing_hostdev_is_an_error_and_the_next_hostdev_is_still_checked(
        sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", driver="nvidia", audio=False)
    xml = domain("gaming1", [hostdev("0000:09:00.0"), hostdev("0000:01:00.0")])
    assert check(sysfs, xml) == [
        missing("gaming1", "0000:09:00.0"),
        managed_on("gaming1", "0000:01:00.0", "10de:2584", "nvidia")]


def test_managed_no_on_a_host_driver_or_on_none_is_an_error(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", driver="nvidia", audio=False).gpu("02", driver=None, audio=False)
    xml = domain("gaming1", [hostdev("0000:01:00.0", managed="no"),
                             hostdev("0000:02:00.0", managed="no")])
    assert check(sysfs, xml) == [
        unmanaged("gaming1", "0000:01:00.0", "10de:2584", "bound to nvidia"),
        unmanaged("gaming1", "0000:02:00.0", "10de:2584", "bound to no driver")]


def test_managed_yes_warns_on_a_host_driver_only(sysfs: FakeSysfs) -> None:
    # 02: no driver at all, libvirt binds it to vfio-pci without unbinding anything;
    # 03 on pci-stub and 04 on vfio-pci: ready. Only 01 on nouveau warns.
    sysfs.gpu("02", driver=None, audio=False).gpu("01", driver="nouveau", audio=False)
    sysfs.gpu("03", driver="pci-stub", audio=False).gpu("04", audio=False)
    xml = domain("gaming1", [hostdev(f"0000:0{b}:00.0") for b in "2314"])
    assert check(sysfs, xml) == [managed_on("gaming1", "0000:01:00.0", "10de:2584", "nouveau")]
    # managed='no' is fine on vfio-pci or pci-stub.
    xml = domain("gaming1", [hostdev(f"0000:0{b}:00.0", managed="no") for b in "34"])
    assert check(sysfs, xml) == []


# --- IOMMU group members left on the host ---------------------------------------------------


def test_a_group_member_on_a_host_driver_is_an_error_for_each_hostdev_of_the_group(
        sysfs: FakeSysfs) -> None:
    # Group 12: the GPU and its audio (both passed through), a bridge, a function with no
    # driver and one on pci-stub (none of them stops the group), then a USB controller on
    # its host driver, which does. Members are read in address order: each skipped one
    # comes before the USB controller.
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="12")
    sysfs.gpu("01", group="12")
    sysfs.add("0000:01:00.2", cls=0x0c8000, device="1ad9", driver=None, group="12")
    sysfs.add("0000:01:00.3", cls=0x0c8000, device="1ada", driver="pci-stub", group="12")
    sysfs.add("0000:01:00.4", cls=0x0c0330, device="1adb", driver="xhci_hcd", group="12")
    found = check(sysfs, domain("gaming1", gpu("01")))
    assert found == [Finding(
        domain="gaming1", check=Check.GROUP_NOT_VIABLE, severity=Severity.ERROR,
        what=f"0000:01:00.4 (10de:1adb, xhci_hcd) shares IOMMU group 12 with {address} but "
             "stays on the host",
        why="VFIO gives a VM a whole IOMMU group or nothing: a member on a host driver makes "
            "the group not viable and the start fails.",
        fix="pass 0000:01:00.4 to gaming1 too (a GPU's audio function moves with it), or bind "
            "it to vfio-pci") for address in ("0000:01:00.0", "0000:01:00.1")]


def test_a_group_whose_other_members_are_passed_through_bridges_or_unbound_is_viable(
        sysfs: FakeSysfs) -> None:
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="12")
    sysfs.gpu("01", group="12")
    sysfs.add("0000:01:00.2", cls=0x0c8000, device="1ad9", driver=None, group="12")
    assert check(sysfs, domain("gaming1", gpu("01"))) == []


# --- option ROMs under OVMF -----------------------------------------------------------------

ROM_WHY = ("OVMF runs every card's option ROM while it enumerates PCI and can hang there "
           "before it draws anything (a larger 64-bit MMIO window does not help).")
ROM_FIX = ("add <rom bar='off'/> to each of these hostdevs: a compute VM needs no firmware "
           "display driver")


def test_two_gpus_under_ovmf_with_a_rom_bar_on_warn_whole(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01").gpu("02")
    xml = domain("gpu-node", gpu("01") + gpu("02", rom_off=False))
    assert check(sysfs, xml) == [Finding(
        domain="gpu-node", check=Check.ROM_BAR, severity=Severity.WARNING,
        what="2 GPUs under OVMF, and 0000:02:00.0, 0000:02:00.1 without <rom bar='off'/>",
        why=ROM_WHY, fix=ROM_FIX)]


def test_a_card_the_host_lacks_counts_as_a_gpu(sysfs: FakeSysfs) -> None:
    # Its missing hostdev is an error already; the ROM warning still counts its slot.
    sysfs.gpu("01")
    xml = domain("gpu-node", gpu("01", rom_off=False) + [hostdev("0000:09:00.0")])
    assert check(sysfs, xml) == [
        missing("gpu-node", "0000:09:00.0"),
        Finding(domain="gpu-node", check=Check.ROM_BAR, severity=Severity.WARNING,
                what="2 GPUs under OVMF, and 0000:01:00.0, 0000:01:00.1 without "
                     "<rom bar='off'/>",
                why=ROM_WHY, fix=ROM_FIX)]


def test_rom_bars_are_fine_with_one_gpu_seabios_rom_off_or_devices_that_are_no_gpu(
        sysfs: FakeSysfs) -> None:
    # The devices that are no GPU sit in a PCI domain no real host has, so that the check
    # must read them from this tree to know they are no display device.
    sysfs.gpu("01").gpu("02")
    for slot, device in (("05", "2142"), ("06", "2143")):
        sysfs.add(f"00ab:{slot}:00.0", cls=0x0c0330, vendor="1b21", device=device)
    usb = [hostdev("00ab:05:00.0", rom_off=False), hostdev("00ab:06:00.0", rom_off=False)]
    for xml in (domain("g", gpu("01", rom_off=False)),
                domain("g", gpu("01", rom_off=False) + usb),
                domain("g", usb),
                domain("g", gpu("01") + gpu("02")),
                domain("g", gpu("01", rom_off=False) + gpu("02", rom_off=False),
                       firmware="")):
        assert check(sysfs, xml) == [], xml


# --- machine type ---------------------------------------------------------------------------


def not_q35(machine: str) -> Finding:
    return Finding(
        domain="g", check=Check.NOT_Q35, severity=Severity.WARNING,
        what=f"machine type {machine} with PCI passthrough",
        why="a GPU passed through wants a real PCIe port, which only q35 provides; on the "
            "i440fx machine drivers may not find or fully use the card.",
        fix="create the VM with the q35 machine type (virt-install --machine q35)")


def test_passthrough_on_a_machine_that_is_not_q35_warns_whole(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01")
    assert check(sysfs, domain("g", gpu("01"), machine="pc-i440fx-7.2")) == [
        not_q35("pc-i440fx-7.2")]
    assert check(sysfs, domain("g", gpu("01"), machine="")) == [not_q35("pc (the default)")]
    # Without passthrough, or on q35: nothing to say.
    assert check(sysfs, domain("g", [], machine="pc-i440fx-7.2")) == []
    assert check(sysfs, domain("g", gpu("01"), machine="pc-q35-9.0")) == []


# --- a CD-ROM ahead of the disk -------------------------------------------------------------


def cdrom_first(name: str) -> Finding:
    return Finding(
        domain=name, check=Check.CDROM_FIRST, severity=Severity.WARNING,
        what="a CD-ROM with media boots ahead of the disk",
        why="after the install the VM boots the installer again, which looks exactly like an "
            "install that failed.",
        fix=f"eject the image (virsh change-media {name} <target> --eject) or put the disk "
            "first in the boot order")


def os_boot(xml: str, *devs: str) -> str:
    """The older form: <os><boot dev=.../></os>, no per-device boot order."""
    xml = not_in_xml(not_in_xml(xml, "<boot order='1'/>"), "<boot order='2'/>")
    return xml.replace("</os>", "".join(f"<boot dev='{d}'/>" for d in devs) + "</os>")


def test_a_cdrom_with_media_ahead_of_the_disk_warns_whole(sysfs: FakeSysfs) -> None:
    assert check(sysfs, domain("g", [], disk=2, cdrom=1, media=True)) == [cdrom_first("g")]
    # No disk in the boot order at all: the CD-ROM boots first.
    no_disk = not_in_xml(domain("g", [], disk=1, cdrom=2, media=True), "<boot order='1'/>")
    assert check(sysfs, no_disk) == [cdrom_first("g")]
    assert check(sysfs, os_boot(domain("g", [], media=True), "cdrom", "hd")) == [
        cdrom_first("g")]


def test_an_empty_cdrom_or_one_after_the_disk_boots_the_disk(sysfs: FakeSysfs) -> None:
    for xml in (domain("g", [], disk=2, cdrom=1, media=False),
                domain("g", [], disk=1, cdrom=2, media=True),
                os_boot(domain("g", [], media=True), "hd", "cdrom"),
                os_boot(domain("g", [], media=False), "cdrom", "hd"),
                os_boot(domain("g", [], media=True))):
        assert check(sysfs, xml) == [], xml


# --- the guest agent's channel --------------------------------------------------------------

CHANNEL_WHY = ("hostagent shuts the lendee down through its guest agent only, so without the "
               "channel it can never give the GPUs back.")
CHANNEL_FIX = ("add <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/>"
               "</channel> and run qemu-guest-agent in the guest")


def test_no_agent_channel_is_an_error_on_the_lendee_and_a_warning_if_unknown(
        sysfs: FakeSysfs) -> None:
    xml = domain("gpu-node", [], channel=False)
    assert check(sysfs, xml, lendee=True) == [Finding(
        domain="gpu-node", check=Check.NO_AGENT_CHANNEL, severity=Severity.ERROR,
        what="no guest-agent channel (org.qemu.guest_agent.0)",
        why=CHANNEL_WHY, fix=CHANNEL_FIX)]
    assert check(sysfs, xml, lendee=None) == [Finding(
        domain="gpu-node", check=Check.NO_AGENT_CHANNEL, severity=Severity.WARNING,
        what="no guest-agent channel (org.qemu.guest_agent.0) (matters for the lendee)",
        why=CHANNEL_WHY, fix=CHANNEL_FIX)]
    # Another VM (an owner) needs none; with the channel, nobody does.
    assert check(sysfs, xml, lendee=False) == []
    for lendee in (True, None, False):
        assert check(sysfs, domain("gpu-node", []), lendee=lendee) == []


def test_every_check_speaks_for_one_domain_in_order(sysfs: FakeSysfs) -> None:
    # A domain with every mistake: the findings come in the order of the checks.
    sysfs.gpu("01").gpu("02")
    xml = domain("gpu-node", gpu("01", rom_off=False) + gpu("02") + [hostdev("0000:09:00.0")],
                 machine="pc-i440fx-7.2", channel=False, disk=2, cdrom=1, media=True)
    assert [(f.check, f.severity) for f in check(sysfs, xml, lendee=True)] == [
        (Check.HOSTDEV_MISSING, Severity.ERROR), (Check.ROM_BAR, Severity.WARNING),
        (Check.NOT_Q35, Severity.WARNING), (Check.CDROM_FIRST, Severity.WARNING),
        (Check.NO_AGENT_CHANNEL, Severity.ERROR)]
