"""Why an idle GPU is not lent: the answer `hostagent status` (text and JSON) and the MQTT
device give for each GPU that no VM runs with.

Pure: no I/O, no clock (the time is passed in). It reads the configuration and the
machine's state and asks the questions the machine asks (`hostagent.core.rules`) in the
order a person would: first what keeps this one GPU (its owner on its way, a
reservation, its IOMMU group), then what keeps every GPU (``partial = false``, a hold,
an owner on its way, ``min_gpus``, the relend delay, a failed start), then where the
lendee is. The first that holds is the reason; each has a name of its own (`NotLent`)
and plain words that name the setting or the VM behind it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hostagent.core.config import Config
from hostagent.core.model import Phase, Policy, Regrow, State, Topology, free_gpus
from hostagent.core.topology import topology

__all__ = ["NotLent", "Why", "as_dicts", "not_lent"]


class NotLent(enum.StrEnum):
    """Why an idle GPU is not lent; the value is its name in JSON and MQTT."""

    NOT_BORROWED = "not-borrowed"  # lendee.gpus does not list it
    OWNER_STARTING = "owner-starting"  # an owner that needs the lendee's GPUs is on its way
    RESERVATION = "reservation"  # a reservation of its owner holds it
    IOMMU_GROUP = "iommu-group"  # a VM holds another member of its IOMMU group
    PARTIAL_OFF = "partial-off"  # policy.partial = false and another GPU is taken
    HOLD = "hold"  # lending is on hold
    BELOW_MIN_GPUS = "below-min-gpus"  # fewer GPUs free than lendee.min_gpus
    RELEND_DELAY = "relend-delay"  # lent once policy.relend_delay has passed
    START_FAILED = "start-failed"  # the lendee's last start failed
    LENDEE_BUSY = "lendee-busy"  # the lendee is being reclaimed, or failed
    REGROW = "regrow"  # the lendee runs without it and takes it later
    LENDING = "lending"  # nothing stands in the way: its lend is being started


@dataclass(frozen=True)
class Why:
    """``words`` do not count down (MQTT publishes a state when it changes): the time the
    reason ends, where one is known, is ``until`` (POSIX seconds)."""

    reason: NotLent
    words: str
    until: float | None = None

    def as_dict(self) -> dict[str, str | float | None]:
        return {"reason": self.reason.value, "words": self.words, "until": self.until}


def _s(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def not_lent(cfg: Config, state: State, now: float) -> dict[str, Why]:
    """For each GPU that no VM runs with and the lendee does not hold (nor is being
    started with), why not; GPUs in use are absent. Sorted by label."""
    topo = topology(cfg)
    policy = Policy(partial=cfg.policy.partial, min_gpus=cfg.lendee.min_gpus,
                    relend_delay=cfg.policy.relend_delay)
    busy = {g for o in state.running_owners for g in topo.owners.get(o, ())}
    out: dict[str, Why] = {}
    for gpu in sorted(topo.gpus):
        if gpu in busy or gpu in state.lent:
            continue
        out[gpu] = _why(gpu, cfg, topo, policy, state, now)
    return out


def _owning(topo: Topology, gpu: str, vms: Iterable[str]) -> list[str]:
    return [vm for vm in sorted(vms) if gpu in topo.owners.get(vm, ())]


def _why(gpu: str, cfg: Config, topo: Topology, policy: Policy, state: State,
         now: float) -> Why:
    lendee = topo.lendee
    if gpu not in topo.lendee_gpus:
        return Why(NotLent.NOT_BORROWED, f"{lendee} does not borrow it (lendee.gpus)")
    on_its_way = [*state.waiting_owners, *sorted(state.starting_owners)]
    mine = [o for o in dict.fromkeys(on_its_way) if gpu in topo.owners.get(o, ())]
    if mine:
        return Why(NotLent.OWNER_STARTING, f"kept for {mine[0]}, which is starting")
    firm = {r.vm: r for r in state.reservations if r.holding}
    reserved = _owning(topo, gpu, firm)
    if reserved:
        r = firm[reserved[0]]
        if r.at > now:
            return Why(NotLent.RESERVATION,
                       f"kept for {r.vm}, reserved by {r.by} (`hostagent reserve {r.vm} "
                       "--cancel` frees it)", until=r.at)
        return Why(NotLent.RESERVATION,
                   f"kept for {r.vm}, reserved by {r.by}: its time has come and it is not "
                   "used yet; lent again when it expires or is cancelled")
    if gpu in state.held:
        return Why(NotLent.IOMMU_GROUP,
                   f"{state.held[gpu]} holds another device of its IOMMU group; lent once "
                   f"{state.held[gpu]} stops")
    claimants = sorted({*state.running_owners, *on_its_way, *firm})
    for owner in claimants:
        if gpu in topo.claims(owner):
            mates = sorted(topo.whole({gpu}) & topo.owners.get(owner, frozenset()))
            return Why(NotLent.IOMMU_GROUP,
                       f"shares its IOMMU group with {', '.join(mates)}, which {owner} "
                       "takes: VFIO gives a group to one VM at a time")
    taken = sorted(topo.whole(topo.gpus_of(claimants) | state.held.keys()) & topo.lendee_gpus)
    if taken and not policy.partial:
        return Why(NotLent.PARTIAL_OFF,
                   f"policy.partial = false: {lendee} runs with all its GPUs or none, and "
                   f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} taken")
    if state.hold:
        return Why(NotLent.HOLD, "lending is on hold (`hostagent lend` lends again)")
    return _lendee_side(cfg, topo, policy, state)


def _lendee_side(cfg: Config, topo: Topology, policy: Policy, state: State) -> Why:
    """The reasons that keep every free GPU alike, from where the lendee is."""
    lendee = topo.lendee
    pending = [o for o in dict.fromkeys([*state.waiting_owners, *sorted(state.starting_owners)])
               if topo.needs_lendee_gpus(o)]
    if pending and state.phase in (Phase.OFF, Phase.LENT, Phase.BOOTING, Phase.JOINING):
        return Why(NotLent.OWNER_STARTING,
                   f"{', '.join(pending)} {'is' if len(pending) == 1 else 'are'} starting: "
                   f"{lendee} waits until {'it runs' if len(pending) == 1 else 'they run'}")
    relend = (Why(NotLent.RELEND_DELAY, f"lent once policy.relend_delay ({policy.relend_delay:g}"
                  " s after the last game) has passed", until=state.relend_at)
              if state.relend_at is not None else None)
    if state.phase is Phase.OFF:
        free = len(free_gpus(state, topo, policy))
        if free < policy.min_gpus:
            return Why(NotLent.BELOW_MIN_GPUS,
                       f"{_s(free)} free, fewer than lendee.min_gpus = {policy.min_gpus}")
        if relend is not None:
            return relend
        if state.reason:
            return Why(NotLent.START_FAILED,
                       f"{lendee}'s last start failed: {state.reason} (`hostagent lend` "
                       "tries again)")
        return Why(NotLent.LENDING, f"{lendee} is about to start with it")
    if state.phase in (Phase.DRAINING, Phase.STOPPING, Phase.FAILED):
        what = f"failed: {state.reason}" if state.phase is Phase.FAILED else (
            f"{state.phase.value}: it takes it at its next start")
        return Why(NotLent.LENDEE_BUSY, f"{lendee} is {what}")
    if relend is not None:
        return relend
    if state.regrow_waiting:
        return Why(NotLent.REGROW, f"{lendee} takes it once no pod on its node uses a GPU "
                   '(policy.regrow = "when-idle")')
    regrow = cfg.policy.regrow
    if cfg.kubernetes is None and regrow is Regrow.WHEN_IDLE:
        regrow = Regrow.ALWAYS  # as the agent reads it: nothing can tell what runs
    if state.hotadd_failed:
        how = "a hot-add failed since it started"
    elif regrow is Regrow.NEVER:
        how = 'policy.regrow = "never"'
    else:
        how = f"{state.phase.value} now"
    return Why(NotLent.REGROW, f"{lendee} runs without it and takes it at its next start "
               f"({how})")


def as_dicts(whys: Mapping[str, Why]) -> dict[str, dict[str, str | float | None]]:
    return {gpu: why.as_dict() for gpu, why in whys.items()}
