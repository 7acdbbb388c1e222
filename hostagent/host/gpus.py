"""Which GPUs this host has, by UUID and by PCI address: NVML first, sysfs always.

Two views, because a passthrough host needs both:

- **NVML** (pynvml, from ``nvidia-ml-py``) sees the GPUs bound to the NVIDIA driver:
  their index, UUID, PCI bus id, name, memory and the driver version. Its index is
  nvidia-smi's, in PCI bus order. CUDA numbers the same cards *fastest first* unless
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set, so "GPU 0" can be two different cards
  depending on who reads it: pin cards by UUID (``CUDA_VISIBLE_DEVICES=GPU-…``).
- **sysfs** (``/sys/bus/pci/devices``) sees every display device, including those bound
  to vfio-pci for passthrough, which NVML cannot see: vendor and device ids, the bound
  driver, the other functions of its slot (a Turing card has four: VGA, audio, USB,
  UCSI) and its IOMMU group with the other devices in it (a group moves into a VM whole).

The sysfs root is a parameter, so tests build a fake tree; the NVML library is one too
(any object with pynvml's functions), so tests need no GPU. Reading has no other side
effect; `resolve_uuids` is pure.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.core.config import Config, ConfigError

__all__ = [
    "CUDA_ORDER_WARNING",
    "SYSFS",
    "Inventory",
    "NvmlGpu",
    "NvmlUnavailable",
    "PciDevice",
    "canonical_pci",
    "format_inventory",
    "inventory",
    "inventory_json",
    "on_host",
    "pci_device",
    "read_nvml",
    "resolve_uuids",
    "slot_functions",
    "sysfs_gpus",
]

SYSFS = Path("/sys")

CUDA_ORDER_WARNING = (
    "The index is NVML's and nvidia-smi's (PCI bus order). CUDA numbers GPUs fastest "
    "first by default, so an index can name a different card there: use UUIDs in "
    "CUDA_VISIBLE_DEVICES (or set CUDA_DEVICE_ORDER=PCI_BUS_ID)."
)

_PCI = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")

# PCI class codes (the class file's top byte, and the bridge subclass).
_DISPLAY_CLASS = 0x03
_BRIDGE_SUBCLASS = 0x0604
# Drivers under which a device can sit in a VFIO group used by a VM.
VFIO_DRIVERS = frozenset({"vfio-pci", "pci-stub"})


def canonical_pci(text: str) -> str | None:
    """``0000:01:00.0`` for a PCI address as lspci, libvirt or NVML writes it.

    NVML and nvidia-smi write the domain with 8 digits (``00000000:01:00.0``); sysfs,
    lspci and hostagent's configuration with 4. None if `text` is not an address.
    """
    m = _PCI.fullmatch(text.strip().lower())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"


# --- NVML ------------------------------------------------------------------------------


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why (no library, no driver, ...)."""


@dataclass(frozen=True, kw_only=True)
class NvmlGpu:
    """One GPU as NVML sees it. `index` is nvidia-smi's, not necessarily CUDA's."""

    index: int
    uuid: str
    pci: str  # canonical, 4-digit domain
    name: str
    memory_mib: int
    driver_version: str


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any = None) -> list[NvmlGpu]:
    """Every GPU NVML sees, in its order. `nvml`: the pynvml module (default) or a fake.

    Raises NvmlUnavailable when NVML cannot start (no NVIDIA driver on the host, or
    every card bound to vfio-pci leaves it with nothing to talk to).
    """
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError as e:
            raise NvmlUnavailable(f"pynvml is not installed ({e}): install nvidia-ml-py") from e
    try:
        nvml.nvmlInit()
    except Exception as e:  # pynvml raises NVMLError subclasses; any failure means "none"
        raise NvmlUnavailable(f"NVML did not start: {e}") from e
    try:
        driver = _str(nvml.nvmlSystemGetDriverVersion())
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            bus_id = _str(nvml.nvmlDeviceGetPciInfo(handle).busId)
            found.append(NvmlGpu(
                index=index,
                uuid=_str(nvml.nvmlDeviceGetUUID(handle)),
                pci=canonical_pci(bus_id) or bus_id,
                name=_str(nvml.nvmlDeviceGetName(handle)),
                memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
                driver_version=driver,
            ))
        return found
    except Exception as e:
        raise NvmlUnavailable(f"NVML failed while listing GPUs: {e}") from e
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # already shut down, or never started: nothing to undo
            pass


# --- sysfs -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PciDevice:
    """One PCI function as sysfs describes it."""

    address: str
    class_code: int  # e.g. 0x030000 for a VGA controller
    vendor: str  # "10de"
    device: str  # "2584"
    driver: str | None  # "vfio-pci", "nvidia", None if unbound
    iommu_group: str | None  # None when the IOMMU is off
    group_members: tuple[str, ...]  # the other devices of its IOMMU group

    @property
    def is_display(self) -> bool:
        return self.class_code >> 16 == _DISPLAY_CLASS

    @property
    def is_bridge(self) -> bool:
        return self.class_code >> 8 == _BRIDGE_SUBCLASS

    @property
    def ids(self) -> str:
        return f"{self.vendor}:{self.device}"


def _devices_dir(root: Path) -> Path:
    return root / "bus" / "pci" / "devices"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _link_name(path: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _hex_id(text: str | None) -> str:
    return (text or "").lower().removeprefix("0x") or "?"


def pci_device(address: str, root: Path = SYSFS) -> PciDevice | None:
    """The device at `address`, or None if the host has nothing there."""
    path = _devices_dir(root) / address
    if not path.is_dir():
        return None
    group = _link_name(path / "iommu_group")
    members: tuple[str, ...] = ()
    if group is not None:
        group_dir = root / "kernel" / "iommu_groups" / group / "devices"
        try:
            members = tuple(sorted(p.name for p in group_dir.iterdir() if p.name != address))
        except OSError:
            members = ()
    try:
        class_code = int(_read(path / "class") or "0", 16)
    except ValueError:
        class_code = 0
    return PciDevice(address=address, class_code=class_code,
                     vendor=_hex_id(_read(path / "vendor")),
                     device=_hex_id(_read(path / "device")),
                     driver=_link_name(path / "driver"), iommu_group=group,
                     group_members=members)


def _addresses(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in _devices_dir(root).iterdir())
    except OSError:
        return []


def sysfs_gpus(root: Path = SYSFS) -> list[PciDevice]:
    """Every display-class device (class 0x03xxxx) on the host, in PCI order."""
    found = (pci_device(a, root) for a in _addresses(root))
    return [d for d in found if d is not None and d.is_display]


def _slot(address: str) -> str:
    return address.rsplit(".", 1)[0]


def slot_functions(address: str, root: Path = SYSFS) -> list[str]:
    """Every function of the device at `address` (the GPU and its audio, ...)."""
    return [a for a in _addresses(root) if _slot(a) == _slot(address)]


# --- both views together ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Inventory:
    nvml: list[NvmlGpu]
    nvml_error: str | None  # why NVML saw nothing, when it could not start
    pci: list[PciDevice]  # display devices per sysfs, NVML's included
    # Display device (or NVML's card) -> the other functions of its slot, per sysfs.
    functions: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def inventory(root: Path = SYSFS, nvml: Any = None) -> Inventory:
    try:
        seen, error = read_nvml(nvml), None
    except NvmlUnavailable as e:
        seen, error = [], str(e)
    pci = sysfs_gpus(root)
    cards = {d.address for d in pci} | {g.pci for g in seen}
    functions = {a: tuple(f for f in slot_functions(a, root) if f != a) for a in sorted(cards)}
    return Inventory(nvml=seen, nvml_error=error, pci=pci, functions=functions)


def _others(address: str, inv: Inventory) -> str:
    return ", ".join(inv.functions.get(address, ())) or "-"


def inventory_json(inv: Inventory) -> dict[str, Any]:
    return {
        "nvml": {"available": inv.nvml_error is None, "error": inv.nvml_error,
                 "gpus": [{**dataclasses.asdict(g),
                           "functions": list(inv.functions.get(g.pci, ()))} for g in inv.nvml]},
        "pci": [{**dataclasses.asdict(d), "class_code": f"0x{d.class_code:06x}",
                 "group_members": list(d.group_members),
                 "functions": list(inv.functions.get(d.address, ()))} for d in inv.pci],
        "warning": CUDA_ORDER_WARNING if inv.nvml else None,
    }


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def format_inventory(inv: Inventory) -> str:
    """`hostagent gpus` for a person."""
    lines: list[str] = []
    if inv.nvml:
        lines.append(f"NVIDIA driver {inv.nvml[0].driver_version}, as NVML sees it:")
        rows = [("INDEX", "UUID", "PCI", "NAME", "MEMORY", "OTHER FUNCTIONS")]
        rows += [(str(g.index), g.uuid, g.pci, g.name, f"{g.memory_mib} MiB",
                  _others(g.pci, inv)) for g in inv.nvml]
        lines += ["  " + line for line in _table(rows)]
        lines += ["", "note: " + CUDA_ORDER_WARNING]
    else:
        lines.append(f"NVML: no GPU ({inv.nvml_error or 'it lists none'})")
    by_nvml = {g.pci for g in inv.nvml}
    others = [d for d in inv.pci if d.address not in by_nvml]
    if others:
        lines += ["", "Display devices NVML does not see (sysfs):" if inv.nvml
                  else "Display devices (sysfs):"]
        rows = [("PCI", "IDS", "DRIVER", "OTHER FUNCTIONS", "IOMMU GROUP",
                 "ALSO IN THE GROUP")]
        rows += [(d.address, d.ids, d.driver or "none", _others(d.address, inv),
                  d.iommu_group or "-", ", ".join(d.group_members) or "-") for d in others]
        lines += ["  " + line for line in _table(rows)]
    if any(inv.functions.get(d.address) for d in inv.pci):
        lines += ["", "Every function of a card's slot moves with it (hostagent lends and "
                  "reclaims them together)."]
    if not inv.nvml and not inv.pci:
        lines = [
            "No GPU found: NVML sees none "
            f"({inv.nvml_error or 'it lists none'}) and sysfs lists no display device "
            "(class 0x03) under /sys/bus/pci/devices. Is this the host (not a container), "
            "and is the card seated and powered?"
        ]
    return "\n".join(lines)


# --- the configuration by UUID ----------------------------------------------------------


def resolve_uuids(cfg: Config, seen: Iterable[NvmlGpu], *, nvml_error: str | None = None
                  ) -> Config:
    """`cfg` with each GPU given by UUID alone placed at the PCI address NVML reports.

    A GPU given by both is checked: a UUID NVML sees at another address means the card
    moved slots, and hostagent would move the wrong one. Raises ConfigError.
    """
    at: Mapping[str, NvmlGpu] = {g.uuid: g for g in seen}
    gpus = dict(cfg.gpus)
    for label, gpu in cfg.gpus.items():
        if gpu.uuid is None:
            continue
        key = f"gpus.{label}"
        found = at.get(gpu.uuid)
        if gpu.pci is None and found is None:
            why = f"NVML on this host does not see {gpu.uuid}"
            why += f" ({nvml_error})" if nvml_error else ""
            raise ConfigError(
                source=cfg.source, key=key, problem=why,
                fix="a GPU bound to vfio-pci is invisible to NVML: add its pci address "
                    "(`hostagent gpus` lists the display devices, `lspci -D` all)")
        if found is None:
            continue
        if gpu.pci is not None and gpu.pci != found.pci:
            raise ConfigError(
                source=cfg.source, key=f"{key}.pci",
                problem=f"{gpu.uuid} ({found.name}) is at {found.pci}, not {gpu.pci}",
                fix=f'the card moved: write pci = "{found.pci}" (and check its functions)')
        gpus[label] = dataclasses.replace(gpu, pci=found.pci)
    return dataclasses.replace(cfg, gpus=gpus)


# --- the configuration against this host's slots and IOMMU groups ----------------------------


def on_host(cfg: Config, root: Path = SYSFS) -> Config:
    """`cfg` with each GPU's functions as the host has them: every function of its slot
    (same domain:bus:slot), whatever the configuration lists, and the IOMMU groups of
    them all. A card is passed through whole, so its functions move together, and a
    group goes to one VM at a time, so GPUs sharing one are lent and reclaimed
    together (DESIGN.md, invariant 11).

    GPUs given by UUID alone must be placed first (`resolve_uuids`). Raises ConfigError
    for an address the host does not have, and for two GPUs on one slot.
    """
    gpus = dict(cfg.gpus)
    slot_of: dict[str, str] = {}  # slot -> the GPU label whose slot it is
    for label, gpu in cfg.gpus.items():
        if gpu.pci is None:
            continue
        key = f"gpus.{label}"
        listed = [(f"{key}.pci", gpu.pci)]
        listed += [(f"{key}.functions[{i}]", a) for i, a in enumerate(gpu.functions)]
        for where, address in listed:
            if pci_device(address, root) is None:
                raise ConfigError(
                    source=cfg.source, key=where,
                    problem=f"{address} is not on this host ({_devices_dir(root)} has no "
                            "such device)",
                    fix="write the address lspci -D shows (`hostagent gpus` lists the "
                        "display devices with their functions)"
                        + ("; a card's own functions need not be listed: they move with it"
                           if where != f"{key}.pci" else ""))
        if _slot(gpu.pci) in slot_of:
            raise ConfigError(
                source=cfg.source, key=f"{key}.pci",
                problem=f"{gpu.pci} is on the slot of GPU {slot_of[_slot(gpu.pci)]}",
                fix="one card is one GPU: its other functions move with it, so remove one "
                    "of the two")
        slot_of[_slot(gpu.pci)] = label
        extra = [a for a in slot_functions(gpu.pci, root)
                 if a != gpu.pci and a not in gpu.functions]
        functions = (*gpu.functions, *extra)
        groups = {d.iommu_group for d in (pci_device(a, root) for a in (gpu.pci, *functions))
                  if d is not None and d.iommu_group is not None}
        gpus[label] = dataclasses.replace(gpu, functions=functions,
                                          iommu_groups=tuple(sorted(groups)))
    holder: dict[str, str] = {}
    for label, gpu in gpus.items():
        for address in gpu.pci_functions:
            if address in holder:
                raise ConfigError(
                    source=cfg.source, key=f"gpus.{label}.functions",
                    problem=f"{address} is a function of GPU {holder[address]}'s card",
                    fix=f"remove it here: it moves with {holder[address]}")
            holder[address] = label
    return dataclasses.replace(cfg, gpus=gpus)
