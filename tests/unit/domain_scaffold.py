"""Domain XML as libvirt gives it, for the tests that read domains (test_lint.py,
test_config_init.py, test_whole_cards.py): a guest agent's channel, disks, a GPU's
hostdevs, a whole domain."""

from __future__ import annotations

from typing import Any


CHANNEL = """<channel type='unix'>
      <target type='virtio' name='org.qemu.guest_agent.0'/>
    </channel>"""


def hostdev(address: str, *, managed: str = "yes", rom_off: bool = True) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    rom = "\n      <rom bar='off'/>" if rom_off else ""
    return f"""<hostdev mode='subsystem' type='pci' managed='{managed}'>
      <source>
        <address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>
      </source>{rom}
      <address type='pci' domain='0x0000' bus='0x07' slot='0x00' function='0x0'/>
    </hostdev>"""


def gpu(bus: str, **kw: Any) -> list[str]:
    return [hostdev(f"0000:{bus}:00.0", **kw), hostdev(f"0000:{bus}:00.1", **kw)]


DISK = """<disk type='file' device='disk'>
      <source file='/var/lib/libvirt/images/{name}.qcow2'/>
      <target dev='vda' bus='virtio'/>
      <boot order='{disk}'/>
    </disk>"""
CDROM = """<disk type='file' device='cdrom'>
      {media}
      <target dev='sda' bus='sata'/>
      <readonly/>
      <boot order='{cdrom}'/>
    </disk>"""


def domain(name: str, devices: list[str], *, machine: str = "pc-q35-7.2",
           firmware: str = " firmware='efi'", channel: bool = True, disk: int = 1,
           cdrom: int = 2, media: bool = False) -> str:
    """A domain as virt-install writes one, with `devices` added."""
    parts = [DISK.format(name=name, disk=disk),
             CDROM.format(cdrom=cdrom, media="<source file='/iso/nixos.iso'/>" if media else ""),
             *devices, *([CHANNEL] if channel else [])]
    body = "\n    ".join(parts)
    return f"""<domain type='kvm'>
  <name>{name}</name>
  <memory unit='GiB'>16</memory>
  <os{firmware}>
    <type arch='x86_64' machine='{machine}'>hvm</type>
  </os>
  <devices>
    {body}
  </devices>
</domain>
"""
