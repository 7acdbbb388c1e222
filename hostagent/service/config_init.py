"""`hostagent config init`: a starter configuration from what libvirt already says.

The domains' ``<hostdev>`` entries say which VM uses which PCI functions; sysfs says
which of those are GPUs (display class) and which functions belong together (one
slot); NVML, where it sees a card, adds its UUID and name. What no file says is which
VM is the lendee: ``--lendee`` names it, and without it the domain that holds the
most GPUs is taken (a tie is an error that asks for ``--lendee``). Every other domain
with GPUs becomes an owner of the GPUs in its XML; several may own one GPU (a Windows
and a Linux VM on one card), and they take turns.

The result is TOML written with tomli-w, with comment lines put between the tables
(tomli-w writes none) saying what to check. `starter_config` is pure: the domains,
the host's view and the clock come in as arguments.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w

from hostagent.host import gpus as inventory
from hostagent.host.lint import Domain

__all__ = ["InitError", "starter_config"]


class InitError(Exception):
    """No starter configuration can be written; the message says why and what to do."""


@dataclass
class _Gpu:
    slot: str
    functions: set[str] = field(default_factory=set)
    domains: list[str] = field(default_factory=list)
    device: inventory.PciDevice | None = None  # the display function, per sysfs
    label: str = ""

    @property
    def pci(self) -> str:
        if self.device is not None:
            return self.device.address
        return min(self.functions)


def _label(i: int) -> str:
    return f"gpu-{chr(ord('a') + i)}" if i < 26 else f"gpu-{i + 1}"


def _slot(address: str) -> str:
    return address.rsplit(".", 1)[0]


def _dump(table: dict[str, Any]) -> str:
    return tomli_w.dumps(table)


def _comment(text: str, *, first: str = "# ", then: str = "#   ") -> list[str]:
    return textwrap.wrap(text, width=88, initial_indent=first, subsequent_indent=then,
                         break_on_hyphens=False, break_long_words=False)


def starter_config(domains: Sequence[Domain], *, sysfs: Path = inventory.SYSFS,
                   nvml: Sequence[inventory.NvmlGpu] = (), lendee_name: str | None = None,
                   nvml_error: str | None = None, now: datetime | None = None,
                   source: str = "libvirt") -> str:
    """The text of a starter config.toml. Raises InitError."""
    gpus: dict[str, _Gpu] = {}
    skipped: dict[str, list[str]] = {}  # non-GPU hostdevs: domain -> addresses
    missing: list[str] = []
    for dom in sorted(domains, key=lambda d: d.name):
        for h in dom.hostdevs:
            device = inventory.pci_device(h.address, sysfs)
            slot = _slot(h.address)
            siblings = [inventory.pci_device(a, sysfs) for a in
                        inventory.slot_functions(h.address, sysfs)]
            display = next((d for d in siblings if d is not None and d.is_display), None)
            if device is not None and display is None:
                skipped.setdefault(dom.name, []).append(h.address)
                continue
            gpu = gpus.setdefault(slot, _Gpu(slot=slot, device=display))
            gpu.functions.add(h.address)
            if dom.name not in gpu.domains:
                gpu.domains.append(dom.name)
            if device is None and h.address not in missing:
                missing.append(h.address)
    if not gpus:
        raise InitError(
            f"no domain in {source} has a PCI <hostdev> of a GPU: pass the GPUs through "
            "first (virsh edit, or virt-manager's Add Hardware > PCI Host Device), then "
            "run this again")
    for i, gpu in enumerate(sorted(gpus.values(), key=lambda g: g.slot)):
        gpu.label = _label(i)
    held: dict[str, list[str]] = {}
    for gpu in sorted(gpus.values(), key=lambda g: g.slot):
        for name in gpu.domains:
            held.setdefault(name, []).append(gpu.label)

    lendee, why_lendee = _choose_lendee(held, lendee_name)
    owners = {name: labels for name, labels in sorted(held.items()) if name != lendee}
    shared: list[str] = []
    for gpu in sorted(gpus.values(), key=lambda g: g.slot):
        takers = [name for name in sorted(owners) if gpu.label in owners[name]]
        if len(takers) > 1:
            shared.append(f"{gpu.label} is owned by {' and '.join(takers)}: they take "
                          "turns, and a start while another of them runs is refused.")

    by_pci = {g.pci: g for g in nvml}
    when = (now or datetime.now()).strftime("%Y-%m-%d %H:%M")
    out = [
        f"# hostagent: a starter configuration by `hostagent config init`, {when}",
        f"# from the <hostdev> entries of the domains in {source}.",
        "#",
        "# Check before you start the agent:",
        *_comment(f"the lendee: {why_lendee}", first="# - "),
        "# - each GPU's functions: everything in its IOMMU group moves with it (the audio",
        "#   function too); `hostagent lint` says when a VM has only part of a card.",
        "# - uuid: after each lend hostagent checks, inside the lendee, that the driver sees",
        "#   every GPU by UUID. NVML on this host cannot see a card bound to vfio-pci: where a",
        "#   uuid is missing, copy it from `nvidia-smi -L` inside a VM that has the card, or",
        "#   the check can only count GPUs.",
        "# - [verify]: nvidia-smi must be on the lendee's PATH and its qemu-guest-agent must",
        "#   allow guest-exec (or use method = \"ssh\", or \"none\").",
        "# - [kubernetes]: uncomment it if the lendee is a Kubernetes node; without it",
        "#   hostagent moves GPUs between VMs only.",
        "# Then run `hostagent check-config` and `hostagent lint`.",
        "",
        _dump({"lendee": {"domain": lendee, "gpus": held[lendee]}}),
    ]
    for gpu in sorted(gpus.values(), key=lambda g: g.slot):
        out += _gpu_comments(gpu, by_pci.get(gpu.pci))
        table: dict[str, Any] = {"pci": gpu.pci}
        rest = sorted(gpu.functions - {gpu.pci})
        if rest:
            table["functions"] = rest
        seen = by_pci.get(gpu.pci)
        if seen is not None:
            table["uuid"] = seen.uuid
            table["name"] = seen.name
        out.append(_dump({"gpus": {gpu.label: table}}))
    for name, labels in sorted(owners.items()):
        out.append(f"# {name} starts only once the lendee has given back what it shares.")
        out.append(_dump({"owners": {name: {"gpus": labels}}}))
    notes = list(shared)
    notes += [f"{name} passes through {', '.join(a)}, no GPU (per sysfs): left out."
              for name, a in sorted(skipped.items())]
    if missing:
        notes.append(f"Not on this host now: {', '.join(missing)}. A <hostdev> whose card is "
                     "gone stops its VM from starting: see `hostagent lint`.")
    passed = {a for gpu in gpus.values() for a in gpu.functions}
    notes += [f"NVML also sees {g.name} ({g.uuid}) at {g.pci}: in no domain's XML."
              for g in nvml if g.pci not in passed]
    if nvml_error and not nvml:
        notes.append(f"NVML: {nvml_error}; no UUIDs were filled in.")
    for note in notes:
        out += _comment(note)
    out += [
        "",
        _dump({"verify": {"method": "guest-agent", "timeout": "2m"}}),
        "# [kubernetes]",
        '# kubeconfig = "/etc/rancher/k3s/k3s.yaml"',
        "",
    ]
    return "\n".join(out)


def _choose_lendee(held: Mapping[str, list[str]], wanted: str | None) -> tuple[str, str]:
    if wanted is not None:
        if wanted not in held:
            raise InitError(
                f"--lendee {wanted}: that domain has no GPU <hostdev> (domains with GPUs: "
                f"{', '.join(sorted(held))}); the lendee must list every GPU it borrows")
        return wanted, f"{wanted}, as --lendee said."
    most = max(len(v) for v in held.values())
    top = sorted(n for n, v in held.items() if len(v) == most)
    if len(top) > 1:
        raise InitError(
            f"{' and '.join(top)} each hold {most} GPU(s): say which one is the lendee "
            "(the Kubernetes worker VM that borrows idle GPUs) with --lendee NAME")
    return top[0], (f"{top[0]}, the domain that holds the most GPUs ({most}); "
                    "run again with --lendee NAME if that is wrong.")


def _gpu_comments(gpu: _Gpu, seen: inventory.NvmlGpu | None) -> list[str]:
    parts = [f"in {', '.join(gpu.domains)}"]
    device = gpu.device
    if device is not None:
        parts.append(f"{device.ids} on {device.driver or 'no driver'}")
        if device.iommu_group is not None:
            group = f"IOMMU group {device.iommu_group}"
            others = [m for m in device.group_members if m not in gpu.functions]
            parts.append(group + (f" with {', '.join(others)}" if others else ""))
    else:
        parts.append("not found on this host")
    if seen is not None:
        parts.append(f"{seen.memory_mib} MiB")
    elif device is not None:
        parts.append("NVML does not see it: add its uuid by hand")
    return _comment(f"{gpu.pci}: " + "; ".join(parts))
