"""GPU devices in domain XML: which GPUs a definition holds, and the XML without some."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from hostagent.core.config import Gpu, parse
from hostagent.core.devices import GpuNotInXml, XmlError, elements_of, gpus_in, without

GPUS = {
    "gpu-a": Gpu(label="gpu-a", pci="0000:01:00.0", functions=("0000:01:00.1",)),
    "gpu-b": Gpu(label="gpu-b", pci="0000:02:00.0", functions=("0000:02:00.1",)),
    "gpu-c": Gpu(label="gpu-c", pci="0000:0a:00.0"),
    "gpu": Gpu(label="gpu", pci="0000:0b:00.0"),
}


def hostdev(bus: str, function: str, guest_slot: str, *, alias: str = "") -> str:
    alias_line = f"\n      <alias name='{alias}'/>" if alias else ""
    return f"""    <hostdev mode='subsystem' type='pci' managed='yes'>
      <driver name='vfio'/>
      <source>
        <address domain='0x0000' bus='{bus}' slot='0x00' function='{function}'/>
      </source>{alias_line}
      <rom bar='off'/>
      <address type='pci' domain='0x0000' bus='0x{guest_slot}' slot='0x00' function='0x0'/>
    </hostdev>
"""


# As `virsh dumpxml --inactive --security-info` prints a lendee: single quotes, a
# comment, a USB controller tagged to go with gpu-b.
HEAD = """<domain type='kvm'>
  <name>gpu-node</name>
  <uuid>4b6c1f52-8f7e-4b0a-9b55-0d6c2b3f1a11</uuid>
  <!-- edited by hand: keep -->
  <memory unit='KiB'>8388608</memory>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/var/lib/libvirt/images/gpu-node.qcow2'/>
      <target dev='vda' bus='virtio'/>
    </disk>
"""
GPU_A = hostdev("0x01", "0x0", "07") + hostdev("0x1", "0x1", "08")
GPU_B = hostdev("0x02", "0x0", "09") + hostdev("0x02", "0x1", "0a")
USB_B = """    <controller type='usb' index='1' model='qemu-xhci'>
      <alias name='ua-hostagent-gpu-b-usb'/>
      <address type='pci' domain='0x0000' bus='0x0b' slot='0x00' function='0x0'/>
    </controller>
"""
GPU_C = hostdev("0x0A", "0", "0c")
TAIL = """    <channel type='unix'>
      <target type='virtio' name='org.qemu.guest_agent.0'/>
    </channel>
    <memballoon model='none'/>
  </devices>
</domain>
"""
LENDEE = HEAD + GPU_A + GPU_B + USB_B + GPU_C + TAIL


def test_gpus_in_finds_each_gpu_by_any_function_or_alias() -> None:
    assert gpus_in(LENDEE, GPUS) == {"gpu-a", "gpu-b", "gpu-c"}
    assert gpus_in(HEAD + USB_B + TAIL, GPUS) == {"gpu-b"}  # by its alias alone
    assert gpus_in(HEAD + TAIL, GPUS) == frozenset()


def test_without_removes_every_function_and_tagged_device_and_keeps_the_rest_as_it_was() -> None:
    assert without(LENDEE, {"gpu-b"}, GPUS) == HEAD + GPU_A + GPU_C + TAIL
    assert without(LENDEE, {"gpu-a", "gpu-c"}, GPUS) == HEAD + GPU_B + USB_B + TAIL
    assert without(LENDEE, set(), GPUS) == LENDEE


def test_addresses_compare_as_numbers() -> None:
    # bus='0x1' is bus 01 and slot/function written without 0x are hex too.
    odd = hostdev("0x000001", "0x00", "07").replace("slot='0x00'", "slot='0'", 1)
    assert gpus_in(HEAD + odd + TAIL, GPUS) == {"gpu-a"}
    assert without(HEAD + odd + TAIL, {"gpu-a"}, GPUS) == HEAD + TAIL


def test_the_longest_label_an_alias_fits_wins() -> None:
    tagged = USB_B.replace("ua-hostagent-gpu-b-usb", "ua-hostagent-gpu-c-usb")
    assert gpus_in(HEAD + tagged + TAIL, GPUS) == {"gpu-c"}
    plain = USB_B.replace("ua-hostagent-gpu-b-usb", "ua-hostagent-gpu-x")
    assert gpus_in(HEAD + plain + TAIL, GPUS) == {"gpu"}
    other = USB_B.replace("ua-hostagent-gpu-b-usb", "ua-gpu-b")
    assert gpus_in(HEAD + other + TAIL, GPUS) == frozenset()


def test_a_pci_address_wins_over_an_alias() -> None:
    xml = HEAD + hostdev("0x01", "0x0", "07", alias="ua-hostagent-gpu-b") + TAIL
    assert gpus_in(xml, GPUS) == {"gpu-a"}


def test_other_hostdevs_and_guest_addresses_are_not_gpus() -> None:
    usb = """    <hostdev mode='subsystem' type='usb' managed='yes'>
      <source><vendor id='0x046d'/><product id='0xc52b'/></source>
    </hostdev>
"""
    # The guest-side <address> of a disk equals gpu-a's host address: not a hostdev source.
    disk = """    <disk type='file' device='disk'>
      <source file='/x.img'/>
      <target dev='vdb' bus='virtio'/>
      <address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>
    </disk>
"""
    assert gpus_in(HEAD + usb + disk + TAIL, GPUS) == frozenset()


def test_a_gpu_to_drop_that_is_not_there_is_an_error_that_says_what_was_looked_for() -> None:
    with pytest.raises(GpuNotInXml) as e:
        without(HEAD + GPU_A + TAIL, {"gpu-a", "gpu-b"}, GPUS)
    assert e.value.domain == "gpu-node"
    assert list(e.value.missing) == ["gpu-b"]
    assert str(e.value) == (
        "gpu-node's XML holds no device of GPU gpu-b (looked for <hostdev> 0000:02:00.0 or "
        "<hostdev> 0000:02:00.1 or <alias name='ua-hostagent-gpu-b'/>): its definition must "
        "list every GPU the configuration gives it (run `hostagent lint`)")


def test_unknown_label_and_non_domain_xml_are_refused() -> None:
    with pytest.raises(KeyError, match="gpu-z"):
        without(LENDEE, {"gpu-z"}, GPUS)
    with pytest.raises(XmlError, match="not XML"):
        gpus_in("<domain>", GPUS)
    with pytest.raises(XmlError, match="root element <network>"):
        without("<network/>", set(), GPUS)


def test_self_closing_and_inline_devices_are_cut_exactly() -> None:
    xml = ("<domain><name>n</name><devices><memballoon model='none'/>"
           "<controller type='usb'><alias name='ua-hostagent-gpu-c'/></controller>"
           "<watchdog model='i6300esb'/></devices></domain>")
    assert without(xml, {"gpu-c"}, GPUS) == (
        "<domain><name>n</name><devices><memballoon model='none'/>"
        "<watchdog model='i6300esb'/></devices></domain>")
    solo = "<domain><devices><rng model='virtio'><alias name='ua-hostagent-gpu-c'/></rng></devices></domain>"
    assert without(solo, {"gpu-c"}, GPUS) == "<domain><devices></devices></domain>"


def test_non_ascii_text_keeps_its_place() -> None:
    xml = HEAD.replace("edited by hand", "édité à la main") + GPU_C + TAIL
    assert without(xml, {"gpu-c"}, GPUS) == HEAD.replace("edited by hand",
                                                         "édité à la main") + TAIL


def test_the_result_is_still_the_same_domain() -> None:
    out = ET.fromstring(without(LENDEE, {"gpu-a", "gpu-b"}, GPUS))
    assert out.findtext("name") == "gpu-node"
    assert out.findtext("uuid") == "4b6c1f52-8f7e-4b0a-9b55-0d6c2b3f1a11"
    assert len(out.findall("devices/hostdev")) == 1


def test_works_with_the_configs_own_gpus() -> None:
    cfg = parse("""
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "0000:0a:00.0"]

[gpus.gpu-a]
pci = "01:00.0"
functions = ["01:00.1"]
""")
    assert gpus_in(LENDEE, cfg.gpus) == {"gpu-a", "0000:0a:00.0"}
    assert without(LENDEE, {"0000:0a:00.0"}, cfg.gpus) == HEAD + GPU_A + GPU_B + USB_B + TAIL


def test_elements_of_gives_each_device_of_the_gpus_as_written() -> None:
    assert elements_of(LENDEE, {"gpu-b", "gpu-c"}, GPUS) == [
        part.removeprefix("    ").removesuffix("\n")
        for part in (*_split(GPU_B), USB_B, GPU_C)]
    with pytest.raises(GpuNotInXml):
        elements_of(HEAD + TAIL, {"gpu-a"}, GPUS)


def _split(devices: str) -> list[str]:
    return [d + "</hostdev>\n" for d in devices.split("</hostdev>\n") if d.strip()]
