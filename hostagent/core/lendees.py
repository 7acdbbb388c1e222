"""Several lendees: ``[lendees.NAME]``, each a worker VM with its own GPUs and node.

A host may lend its GPUs to more than one Kubernetes worker VM (one per GPU, or per
IOMMU group): each is its own node, drained, shut down and booted on its own, so that
an owner's start touches only the lendees that hold its GPUs and the jobs on the others
never notice. ``NAME`` is the lendee's libvirt domain, as ``[owners.NAME]`` is an
owner's::

    [lendees.gpu-node-a]                    # the worker VM gpu-node-a
    gpus = ["gpu-a"]
    node = "gpu-node-a"                     # Kubernetes node name; defaults to NAME

    [lendees.gpu-node-b]
    gpus = ["gpu-b", "gpu-c"]
    min_gpus = 2
    kubeconfig = "/etc/hostagent/gpu-node-b.kubeconfig"  # its node's ServiceAccount's;
                                            # default: [kubernetes] kubeconfig

The single ``[lendee]`` section stays as it was: it is the lendee named by its domain
(``[lendee] domain = "gpu-node"`` is ``[lendees.gpu-node]``), and may stand beside
``[lendees.*]`` sections. A GPU belongs to at most one lendee, a domain is one lendee or
one owner, and two lendees are two nodes: each mistake names both keys.

The state machine stays one lendee's (`hostagent.core.machine`): the agent runs one per
lendee, each over its `view` of the configuration, and `hostagent.core.coordinator`
routes the events between them and starts an owner once every lendee holding its GPUs
has let them go. This module is pure: it reads and checks, nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from hostagent.core.config_read import (
    _GPU_REFS, _Problem, _count, _table_of, _guest_command, _join, _key, _optional_path,
    _raise_any, _text,
)

__all__ = ["Lendee", "lendee_of", "read_lendees", "view"]


@dataclass(frozen=True, kw_only=True)
class Lendee:
    """A Kubernetes worker VM that borrows every idle GPU of its own."""

    domain: str = field(metadata=_key(_text, example='"gpu-node"'))
    node: str = field(default="", metadata=_key(_text))
    gpus: tuple[str, ...] = field(metadata=_key(_GPU_REFS, example='["gpu-a"]'))
    # Below this many free GPUs a boot is not worth its drain: the lendee stays off.
    min_gpus: int = field(default=1, metadata=_key(_count))
    # Run in the guest (sh -c) after a hot-add, before its plugins come back: the CDI
    # spec a container asks its GPUs by lists those of the boot alone. "": none.
    cdi_refresh: str = field(default="", metadata=_key(_guest_command))
    # Its node's credentials, where [kubernetes] kubeconfig is another node's: the
    # shipped RBAC (deploy/rbac-node.yaml) gives each node's ServiceAccount that node
    # alone. None: [kubernetes] kubeconfig.
    kubeconfig: Path | None = field(default=None, metadata=_key(_optional_path))

    def __post_init__(self) -> None:
        # Most setups name the node after the VM, so that is the default.
        if not self.node:
            object.__setattr__(self, "node", self.domain)


# `Config.lendee` when the file has no [lendee] section: `link` replaces it by the first
# of [lendees.*], or names the missing section. Told apart by identity.
NO_LENDEE = Lendee(domain="-", gpus=())


def read_lendees(value: object, key: str) -> dict[str, Lendee]:
    """``[lendees.NAME]`` sections: NAME is the domain, so a ``domain`` key is refused
    (two names for one VM would be one too many to keep apart)."""
    problems = [_Problem(f"{_join(key, name)}.domain", "not a key here",
                         "the section's name is the lendee's domain: remove it, or name the "
                         f"section [{_join(key, str(entry['domain']))}]")
                for name, entry in (value.items() if isinstance(value, dict) else ())
                if isinstance(entry, dict) and "domain" in entry]
    if isinstance(value, dict):  # refused above: each entry is read without it
        value = {name: {k: v for k, v in entry.items() if k != "domain"}
                 if isinstance(entry, dict) else entry for name, entry in value.items()}
    try:
        entries: dict[str, Lendee] = _LENDEES(value, key)
    except _Problem as p:
        problems.extend(p.each)
        entries = p.salvaged
    _raise_any(problems, entries)
    return entries


_LENDEES = _table_of(Lendee, "domain")


class _Gpu(Protocol):
    @property
    def iommu_groups(self) -> tuple[str, ...]: ...


class _Owner(Protocol):
    @property
    def gpus(self) -> tuple[str, ...]: ...


class _Config(Protocol):
    """What a view needs of `hostagent.core.config.Config` (which imports this module)."""

    @property
    def lendees(self) -> Mapping[str, Lendee]: ...
    @property
    def owners(self) -> Mapping[str, _Owner]: ...
    @property
    def gpus(self) -> Mapping[str, _Gpu]: ...
    @property
    def kubernetes(self) -> Any: ...


_C = TypeVar("_C", bound=_Config)
_Resolve = Callable[[tuple[str, ...], str], tuple[str, ...]]


def link(single: Lendee, several: Mapping[str, Lendee], resolve_all: _Resolve,
         problems: list[_Problem]) -> dict[str, Lendee]:
    """Every lendee by name (its domain), ``[lendee]`` first, GPU references resolved
    with `resolve_all`; what is wrong across them goes to `problems`."""
    given: list[tuple[str, Lendee]] = []  # (the key of its section, the lendee)
    if single is not NO_LENDEE:
        given.append(("lendee", single))
    given += [(_join("lendees", name), lendee) for name, lendee in several.items()]
    if not given:
        problems.append(_Problem(
            "lendee", "missing",
            'add [lendee] with domain = "gpu-node" and gpus = ["gpu-a"] (or a '
            "[lendees.NAME] section for each of several worker VMs)"))
        return {}
    out: dict[str, Lendee] = {}
    keys: dict[str, str] = {}  # lendee name -> the key of its section
    lent_by: dict[str, str] = {}  # GPU label -> the key that lends it
    node_of: dict[str, str] = {}  # node name -> the key of its lendee
    for key, lendee in given:
        gpus = resolve_all(lendee.gpus, f"{key}.gpus")
        if lendee.domain in out:
            problems.append(_Problem(
                key, f"{lendee.domain} is already the lendee of [{keys[lendee.domain]}]",
                "a worker VM is one lendee: remove one of them"))
            continue
        # Counted only when every GPU reads: a bad one is its own problem.
        if len(gpus) == len(lendee.gpus) and not 1 <= lendee.min_gpus <= len(gpus):
            problems.append(_Problem(
                f"{key}.min_gpus",
                f"{lendee.min_gpus} is not between 1 and the {len(gpus)} GPU(s) in {key}.gpus",
                f"write a number from 1 to {len(gpus)} (1, the default, runs the lendee "
                "whenever a GPU is free)",
            ))
        for i, gpu in enumerate(gpus):
            if gpu in lent_by:
                problems.append(_Problem(
                    f"{key}.gpus[{i}]", f"GPU {gpu} is already lent to {lent_by[gpu]}",
                    "a GPU belongs to one lendee: remove it from one of them"))
            else:
                lent_by[gpu] = f"{key}.gpus"
        if lendee.node in node_of:
            problems.append(_Problem(
                f"{key}.node", f"{lendee.node} is already the node of [{node_of[lendee.node]}]",
                "each lendee is its own Kubernetes node: give one its own node name"))
        node_of.setdefault(lendee.node, key)
        keys[lendee.domain] = key
        out[lendee.domain] = dataclasses.replace(lendee, gpus=gpus)
    return out


def lendee_of(cfg: _Config, gpu: str) -> str | None:
    """The lendee that borrows GPU label `gpu`; None if none does."""
    return next((name for name, lendee in cfg.lendees.items() if gpu in lendee.gpus), None)


def _reach(cfg: _Config, gpus: tuple[str, ...]) -> frozenset[str]:
    """`gpus` and every GPU that shares an IOMMU group with them, transitively: what an
    owner takes from the lendee by claiming any of them (`Topology.claims`)."""
    reach = set(gpus)
    grown = True
    while grown:
        groups = {g for label in reach if label in cfg.gpus
                  for g in cfg.gpus[label].iommu_groups}
        more = {label for label, gpu in cfg.gpus.items() if set(gpu.iommu_groups) & groups}
        grown = not more <= reach
        reach |= more
    return frozenset(reach)


def view(cfg: _C, name: str) -> _C:
    """What lendee `name`'s machine sees of `cfg`: that lendee alone, and the owners that
    claim any of its GPUs (or of their IOMMU groups), each with those GPUs only.

    With one lendee the view is `cfg` itself, unchanged, every owner included. With
    several, an owner that claims no lendee's GPU goes with the first lendee (whose
    machine only starts it when asked); an owner sharing a GPU with no lendee but
    with another owner is refused by libvirt, not beforehand.
    """
    lendee = cfg.lendees[name]
    kubernetes = cfg.kubernetes
    if lendee.kubeconfig is not None and kubernetes is not None:
        kubernetes = dataclasses.replace(kubernetes, kubeconfig=lendee.kubeconfig)
    if len(cfg.lendees) == 1:
        return cfg if kubernetes is cfg.kubernetes else dataclasses.replace(  # type: ignore[type-var]
            cfg, kubernetes=kubernetes)
    reach = _reach(cfg, lendee.gpus)
    lent = frozenset().union(*(_reach(cfg, other.gpus) for other in cfg.lendees.values()))
    first = name == next(iter(cfg.lendees))
    owners: dict[str, Any] = {
        domain: dataclasses.replace(  # type: ignore[type-var]  # an Owner, a dataclass
            owner, gpus=tuple(g for g in owner.gpus if g in reach))
        for domain, owner in cfg.owners.items() if set(owner.gpus) & reach
    }
    if first:
        owners.update({domain: owner for domain, owner in cfg.owners.items()
                       if not set(owner.gpus) & lent})
    return dataclasses.replace(  # type: ignore[type-var]  # a dataclass, as Config is
        cfg, lendee=lendee, lendees={name: lendee}, owners=owners, kubernetes=kubernetes)
