"""Which configured GPUs a domain's XML holds, and the same XML without some of them.

Partial lending starts the lendee with a *live* definition that leaves out the GPUs
owners hold or wait for, while its persistent definition keeps every GPU it may
borrow (DESIGN.md, invariant 9). This module is the pure half of that: XML in, XML
out, no libvirt, no side effects.

A device belongs to GPU ``LABEL`` when

- it is a ``<hostdev mode='subsystem' type='pci'>`` whose ``<source><address>`` is one
  of the GPU's PCI functions (hex attributes, compared canonically: ``0x01`` and
  ``0x1`` are the same bus), or
- it is a device of any kind that carries the libvirt user alias
  ``<alias name='ua-hostagent-LABEL'/>`` or ``ua-hostagent-LABEL-anything``: a USB
  controller that goes with a card, say, or the lab's disks that stand in for GPUs.
  When several labels fit (``gpu`` and ``gpu-a`` for ``ua-hostagent-gpu-a-usb``), the
  longest wins. A hostdev's PCI address wins over its alias.

`without` removes whole device elements from the text itself, with the line each
stood on, so everything else stays byte for byte as libvirt wrote it (attribute
quotes, comments, indentation); ElementTree, which would rewrite all of that, only
decides which elements go.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
import xml.parsers.expat
from collections.abc import Iterable, Mapping

from hostagent.core.config import Gpu

__all__ = ["ALIAS_PREFIX", "GpuNotInXml", "XmlError", "alias_label", "elements_of", "gpus_in",
           "owner_label", "without"]

ALIAS_PREFIX = "ua-hostagent-"


class XmlError(ValueError):
    """The text is not a libvirt domain's XML."""


class GpuNotInXml(ValueError):
    """A GPU to leave out has no device in the domain's XML: its definition and the
    configuration disagree (`hostagent lint` says how)."""

    def __init__(self, domain: str, missing: Mapping[str, str]) -> None:
        self.domain = domain
        self.missing = dict(missing)  # label -> what was looked for
        listing = "; ".join(f"{label} (looked for {what})" for label, what in missing.items())
        super().__init__(f"{domain}'s XML holds no device of GPU {listing}: its definition "
                         "must list every GPU the configuration gives it (run `hostagent lint`)")


def _canonical(address: ET.Element) -> str | None:
    try:
        domain, bus, slot, function = (int(address.get(k, "0"), 0)
                                       for k in ("domain", "bus", "slot", "function"))
    except ValueError:
        return None
    return f"{domain:04x}:{bus:02x}:{slot:02x}.{function:x}"


def _pci_source(dev: ET.Element) -> str | None:
    """The host PCI address of a PCI hostdev, canonical; None for any other device."""
    if dev.tag != "hostdev" or dev.get("mode", "subsystem") != "subsystem" \
            or dev.get("type") != "pci":
        return None
    address = dev.find("source/address")
    return None if address is None else _canonical(address)


def owner_label(dev: ET.Element, gpus: Mapping[str, Gpu]) -> str | None:
    """The label of the GPU that device element `dev` belongs to, or None."""
    address = _pci_source(dev)
    if address is not None:
        for label, gpu in gpus.items():
            if address in gpu.pci_functions:
                return label
    alias = dev.find("alias")
    return alias_label(alias.get("name", ""), gpus) if alias is not None else None


def alias_label(alias: str, labels: Iterable[str]) -> str | None:
    """The GPU label that user alias `alias` (``ua-hostagent-LABEL[-...]``) ties a
    device to, among `labels`; None if it ties it to none."""
    if not alias.startswith(ALIAS_PREFIX):
        return None
    rest = alias[len(ALIAS_PREFIX):]
    fits = [label for label in labels if rest == label or rest.startswith(label + "-")]
    return max(fits, key=len) if fits else None


def _parse(xml: str) -> ET.Element:
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise XmlError(f"not XML: {e}") from e
    if root.tag != "domain":
        raise XmlError(f"not a libvirt domain (root element <{root.tag}>)")
    return root


def _devices(root: ET.Element) -> list[ET.Element]:
    devices = root.find("devices")
    return list(devices) if devices is not None else []


def gpus_in(xml: str, gpus: Mapping[str, Gpu]) -> frozenset[str]:
    """Labels of `gpus` (label -> Gpu, as `Config.gpus`) of which `xml` holds a device.
    Raises XmlError."""
    found = (owner_label(dev, gpus) for dev in _devices(_parse(xml)))
    return frozenset(label for label in found if label is not None)


def without(xml: str, drop: Iterable[str], gpus: Mapping[str, Gpu]) -> str:
    """`xml` with every device of the GPUs labelled `drop` removed: all their PCI
    functions and every device aliased to them. Raises GpuNotInXml when one of them has
    no device in it (nothing to leave out means the definition is not what the
    configuration says), XmlError when `xml` is not domain XML, KeyError for a label
    `gpus` does not have."""
    wanted = frozenset(drop)
    for label in wanted:
        if label not in gpus:
            raise KeyError(f"unknown GPU {label!r}: known are {', '.join(gpus)}")
    root = _parse(xml)
    devices = _devices(root)
    owners = [owner_label(dev, gpus) for dev in devices]
    missing = {label: _looked_for(gpus[label]) for label in sorted(wanted - set(owners))}
    if missing:
        raise GpuNotInXml(root.findtext("name", "").strip() or "the domain", missing)
    if not wanted:
        return xml
    data = xml.encode()
    spans = _device_spans(data)
    # Both parsers read the same document, so they see the same children in order.
    assert len(spans) == len(devices), (len(spans), len(devices))
    out = bytearray()
    at = 0
    for (start, end), owner in zip(spans, owners, strict=True):
        if owner not in wanted:
            continue
        start, end = _whole_lines(data, start, end)
        out += data[at:start]
        at = end
    out += data[at:]
    return out.decode()


def elements_of(xml: str, labels: Iterable[str], gpus: Mapping[str, Gpu]) -> list[str]:
    """The text of every device element of the GPUs `labels` in `xml`, in its order, as
    libvirt wrote it: what a hot-add attaches (guest addresses included, so each goes
    back to the root port the definition gives it). Raises as `without`."""
    wanted = frozenset(labels)
    for label in wanted:
        if label not in gpus:
            raise KeyError(f"unknown GPU {label!r}: known are {', '.join(gpus)}")
    root = _parse(xml)
    owners = [owner_label(dev, gpus) for dev in _devices(root)]
    missing = {label: _looked_for(gpus[label]) for label in sorted(wanted - set(owners))}
    if missing:
        raise GpuNotInXml(root.findtext("name", "").strip() or "the domain", missing)
    data = xml.encode()
    return [data[start:end].decode() for (start, end), owner in
            zip(_device_spans(data), owners, strict=True) if owner in wanted]


def _looked_for(gpu: Gpu) -> str:
    where = [f"<hostdev> {a}" for a in gpu.pci_functions]
    where.append(f"<alias name='{ALIAS_PREFIX}{gpu.label}'/>")
    return " or ".join(where)


def _device_spans(data: bytes) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of each element directly under <domain><devices>."""
    parser = xml.parsers.expat.ParserCreate()
    spans: list[tuple[int, int]] = []
    path: list[str] = []
    opened = 0
    content = False  # whether anything came between the open element's start and end

    def start(name: str, _attrs: object) -> None:
        nonlocal opened, content
        path.append(name)
        content = False
        if path[:-1] == ["domain", "devices"]:
            opened = parser.CurrentByteIndex

    def end(name: str) -> None:
        nonlocal content
        if path[:-1] == ["domain", "devices"]:
            at = parser.CurrentByteIndex
            # For <x/> expat reports the end just past "/>"; for </x>, where it begins.
            if not content and data[at - 2:at] == b"/>":
                spans.append((opened, at))
            else:
                spans.append((opened, data.index(b">", at) + 1))
        path.pop()
        content = True

    def text(_data: str) -> None:
        nonlocal content
        content = True

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = text
    parser.Parse(data, True)
    return spans


def _whole_lines(data: bytes, start: int, end: int) -> tuple[int, int]:
    """Widen [start, end) to the lines it fills alone, indentation and newline included,
    so that removing it leaves no blank line; otherwise leave it as it is."""
    line_start = data.rfind(b"\n", 0, start) + 1
    line_end = data.find(b"\n", end)
    line_end = len(data) if line_end < 0 else line_end + 1
    if data[line_start:start].strip() or data[end:line_end].strip():
        return start, end
    return line_start, line_end
