"""The machine's view of the configuration: who owns which GPUs, who borrows them, and
which GPUs go together because their functions share an IOMMU group."""

from __future__ import annotations

from hostagent.core.config import Config
from hostagent.core.model import Topology


def topology(cfg: Config) -> Topology:
    """The machine's view of `cfg`; GPUs whose functions share an IOMMU group (as
    `hostagent.host.gpus.on_host` read them) form one group, transitively."""
    groups: list[set[str]] = []
    for label, gpu in sorted(cfg.gpus.items()):
        mine = {label}
        for group in [g for g in groups
                      if any(set(gpu.iommu_groups) & set(cfg.gpus[o].iommu_groups) for o in g)]:
            groups.remove(group)
            mine |= group
        groups.append(mine)
    return Topology(lendee=cfg.lendee.domain, lendee_gpus=frozenset(cfg.lendee.gpus),
                    owners={d: frozenset(o.gpus) for d, o in cfg.owners.items()},
                    groups=tuple(frozenset(g) for g in groups if len(g) > 1),
                    names={label: str(gpu) for label, gpu in cfg.gpus.items()})
