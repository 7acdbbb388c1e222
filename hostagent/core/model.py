"""The nouns of lending: who holds which GPU, what the machine remembers, what happens.

This module is plain data. It imports no I/O library and has no side effects, so that
`hostagent.core.machine` (the rules) and its tests can be read and run without a host.

Three kinds of values live here:

- **The world as configured**: `Topology` (which VM borrows which GPUs, which VMs own
  them) and `Policy` (how patient and how forceful the agent may be). The agent builds
  both from its configuration; they do not depend on the configuration module, so the
  rules can be tested with a three-line topology.
- **What the machine remembers**: `State`, with the lendee's `Phase` and the pending
  `Intent` s (owners someone asked to start).
- **What flows through it**: events (facts that happened, each stamped with ``at``, the
  agent's clock in seconds) and actions (requests to the executor). Events and actions
  are frozen dataclasses with keyword-only fields: they are messages, never mutated.

Three pure questions asked of the state end it: which GPUs a lendee start takes
(`free_gpus`), who holds each GPU (`holders`) and whether an action is still wanted
(`still_wanted`).

Tickets
-------
The executor runs actions concurrently with everything else, so an action can outlive
the situation that asked for it, and so can its report (the node was drained while the
boot-time `WaitAgent` was still waiting, and its timeout now lands in the middle of the
shutdown). The lendee's actions (`Drain`, `WaitAgent`, `ShutdownLendee`, `ForceOff`,
`KubeReturn`, `AttachGpus`, `DetachGpus`) carry the ``ticket`` of the phase that issued
them; the machine bumps the ticket whenever it enters a phase (a hot-add or a
hot-unplug enters LENT anew, and its end once more). Both directions use it:

- a report (`AgentUp`, `Drained`, ...) carries its action's ticket back, and the machine
  refuses one whose ticket is not current;
- the executor does not *start* an action the machine no longer wants
  (`hostagent.core.machine.still_wanted`), and cancels one in progress when its ticket goes
  stale: a late `Drain` must not cordon a node that has been lent again since.

Staleness is decided by bookkeeping, not by guessing from timestamps.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hostagent.core.reserve import Reservation

__all__ = [
    "Action",
    "AgentTimeout",
    "AttachFailed",
    "AttachGpus",
    "AgentUp",
    "CancelRelend",
    "CompleteIntent",
    "Drain",
    "DrainFailed",
    "Drained",
    "DetachFailed",
    "DetachGpus",
    "Event",
    "CancelIntent",
    "FailIntent",
    "ForceOff",
    "GpuPods",
    "GpusAttached",
    "GpusDetached",
    "GroupsHeld",
    "GroupsTaken",
    "Hold",
    "Hotplug",
    "Intent",
    "IntentSource",
    "KubeReturn",
    "LendeeStarted",
    "LendeeStopped",
    "Observed",
    "OwnerStarted",
    "OwnerStarting",
    "OwnerStopped",
    "OwnerWants",
    "Phase",
    "Policy",
    "Reclaim",
    "Reserve",
    "Regrow",
    "RelendDue",
    "Resume",
    "ReturnDone",
    "ReturnFailed",
    "ScheduleRelend",
    "ShutdownLendee",
    "ShutdownTimeout",
    "StartFailed",
    "StartLendee",
    "StartOwner",
    "State",
    "Topology",
    "VmStopped",
    "WaitAgent",
    "free_gpus",
    "holders",
    "still_wanted",
]


# --- the world as configured -----------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Which GPUs the lendee may borrow and which VMs own each of them.

    ``owners`` maps an owner's libvirt domain name to the GPU labels it owns. Several
    owners may own one GPU (a Windows and a Linux game on one card): they exclude each
    other. The lendee may also hold GPUs nobody owns, and an owner may own GPUs the
    lendee never borrows. Checked on construction.

    ``groups``: GPUs that share an IOMMU group. VFIO gives a group to one VM at a time,
    so a group moves as one (DESIGN.md, invariant 11): an owner *claims* every GPU of
    the groups of its own (`claims`), which the lendee then neither starts with nor
    keeps. A GPU in no group moves alone.

    ``names``: how records and replies name a GPU (its label, model and address), by
    label; a GPU without one is named by its label (`gpu_names`).
    """

    lendee: str
    lendee_gpus: frozenset[str]
    owners: Mapping[str, frozenset[str]] = field(hash=False)
    groups: tuple[frozenset[str], ...] = ()
    names: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.lendee_gpus:
            raise ValueError(f"lendee {self.lendee} borrows no GPU: there is nothing to lend")
        if self.lendee in self.owners:
            raise ValueError(f"{self.lendee} is the lendee and cannot also be an owner")
        for owner, gpus in self.owners.items():
            if not gpus:
                raise ValueError(f"owner {owner} owns no GPU")
        seen: set[str] = set()
        for group in self.groups:
            if seen & group:
                raise ValueError(f"{', '.join(sorted(seen & group))} in two IOMMU groups")
            seen |= group
        # Frozen means frozen: nobody edits the topology behind the machine's back.
        object.__setattr__(self, "owners", MappingProxyType(dict(self.owners)))
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))

    def gpu_names(self, labels: Iterable[str]) -> str:
        """`labels` as records and replies name them, sorted: "gpu-a (RTX 4090, ...)"."""
        return ", ".join(self.names.get(g, g) for g in sorted(labels))

    def is_owner(self, domain: str) -> bool:
        return domain in self.owners

    def needs_lendee_gpus(self, owner: str) -> bool:
        """Whether `owner` owns a GPU the lendee may borrow.

        False for a VM that is not an owner: it needs nothing from the lendee. (An intent
        persisted for an owner since removed from the configuration must not crash the
        agent before `Observed` fails it.)
        """
        return bool(self.shared_gpus(owner))

    def shared_gpus(self, owner: str) -> frozenset[str]:
        """The lendee's GPUs that `owner` claims (empty if they never meet)."""
        return self.claims(owner) & self.lendee_gpus

    def whole(self, gpus: Iterable[str]) -> frozenset[str]:
        """`gpus` and every GPU that shares an IOMMU group with one of them."""
        given = frozenset(gpus)
        return given.union(*(g for g in self.groups if g & given))

    def claims(self, owner: str) -> frozenset[str]:
        """The GPUs `owner` takes from the lendee when it runs: its own, and those that
        share an IOMMU group with them (empty for a VM that is not an owner)."""
        return self.whole(self.owners.get(owner, frozenset()))

    def gpus_of(self, owners: Iterable[str]) -> frozenset[str]:
        """Every GPU those owners own."""
        return frozenset().union(*(self.owners.get(o, frozenset()) for o in owners))

    @property
    def gpus(self) -> frozenset[str]:
        """Every GPU the agent knows about."""
        return self.lendee_gpus.union(*self.owners.values())


class Regrow(enum.StrEnum):
    """When a lendee running with fewer GPUs than are free restarts to take them all."""

    WHEN_IDLE = "when-idle"  # only while no pod on the node requests a GPU
    ALWAYS = "always"  # after relend_delay, whatever runs on the node
    NEVER = "never"  # only when it stops for another reason


class Hotplug(enum.StrEnum):
    """Whether the lendee's GPUs change while it runs, instead of by a restart."""

    NONE = "none"  # every change is a restart (drain, shutdown, start)
    ADD = "add"  # GPUs a game freed are attached live; a reclaim still restarts
    # Experimental: a game's GPU is also detached live from the running lendee (only
    # the pods using it evicted), the restart its fallback. NVIDIA does not support
    # hot-unplug of its GPUs, and some drivers hang an unbind begun while a client
    # holds the GPU: the agent checks that none does first, and bounds the wait.
    BOTH = "both"
    # The configuration's default: "add" where `hostagent lint` finds the lendee's
    # definition can hot-add (`hostagent.host.lint_hotplug.hotplug_capability`), "both"
    # once the running lendee shows its plugins pause and its nvidia-smi drains
    # (`unplug_at_run_time`), else "none". The agent decides it; the machine never sees it.
    AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the machine may act. Timeouts belong to the executor; these are decisions.

    ``relend_delay``: quiet seconds after the last owner stopped before the lendee is
    started again (an owner that reboots must not trigger a lend/reclaim round trip).
    ``force_off``: whether ``force_off_after`` is set, i.e. whether the lendee may be
    destroyed when its guest agent never answers or it ignores a shutdown. Off by
    default: destroying a VM whose GPUs are mid-initialisation can leave a card in a
    power state only a host reboot clears. (A guest stuck letting a GPU go is powered
    off without it: `State.unplug_stuck`.)
    ``partial``: the lendee runs with whatever GPUs no owner holds or waits for (False:
    all of them or none, the lendee off while any owner needs one). ``min_gpus``: below
    this many free GPUs the lendee is not worth running. ``regrow``: see `Regrow`.
    ``regrow_max_wait``: how long a ``when-idle`` regrow waits for the node's GPU pods
    to end before it restarts the lendee anyway (None: as long as they run). Every
    second of it leaves the freed GPUs idle while the pods use the others.
    ``hotplug``: see `Hotplug` (never AUTO here); a hot-add that fails leaves its GPUs
    to a regrow by restart, as ``regrow`` says, and a hot-unplug that fails to the
    reclaim by restart. ``hotplug_why``: why it is what it is, for status.
    """

    relend_delay: float = 30.0
    force_off: bool = False
    partial: bool = True
    min_gpus: int = 1
    regrow: Regrow = Regrow.WHEN_IDLE
    regrow_max_wait: float | None = None
    hotplug: Hotplug = Hotplug.NONE
    hotplug_why: str = ""


# --- what the machine remembers --------------------------------------------------------


class Phase(enum.StrEnum):
    """Where the lendee is in its lend/reclaim cycle."""

    OFF = "off"  # not running (a start may be pending: State.lendee_starting)
    BOOTING = "booting"  # running; its guest agent has not answered yet
    JOINING = "joining"  # agent answered; waiting Ready + GPUs, then uncordon
    LENT = "lent"  # in the cluster, GPUs verified, schedulable
    DRAINING = "draining"  # reclaim: cordon + drain
    STOPPING = "stopping"  # drained; waiting for the agent, then its shutdown
    FAILED = "failed"  # running, stuck; State.reason says why and what to do

    @property
    def lendee_running(self) -> bool:
        """Whether the lendee's QEMU process exists (and so holds all its GPUs)."""
        return self is not Phase.OFF


class IntentSource(enum.StrEnum):
    """Where an owner's start request came from."""

    HOOK = "hook"  # `virsh start` (or anything through libvirt), deferred by the hook
    CONTROL = "control"  # the control socket: CLI, SSH, home automation
    RESUME = "resume"  # re-read after a restart (spooled while the agent was down)


@dataclass(frozen=True, kw_only=True)
class Intent:
    """An owner someone asked to start. It ends only as completed or failed."""

    id: str
    owner: str
    created_at: float
    source: IntentSource


@dataclass(frozen=True, kw_only=True)
class State:
    """Everything the machine knows. The default is a fresh agent: off, nothing pending.

    ``reason``: in FAILED, what went wrong and what a human can do; in OFF, why the last
    lendee start failed (lending then waits for an owner to stop or for ``resume``).
    ``agent_up``: the lendee's guest agent answered guest-ping since the lendee last
    started. ``shutdown_sent``: in STOPPING, the guest-agent shutdown was requested.
    ``lendee_starting``: in OFF, a `StartLendee` is in flight and its outcome unknown.
    ``intents``: pending start requests, oldest first; one owner may appear more than
    once (two callers asked), each id ends on its own. ``hold``: automatic lending is
    suspended. ``relend_at``: when a scheduled relend is due (None: none scheduled).
    ``ticket``: bumped on every phase entry; see the module docstring.
    ``lent``: the GPUs the lendee's live definition holds while it runs, or will hold
    once the start in flight lands; empty otherwise. ``starting_owners``: owners the
    hook let through that do not run yet (each claims its GPUs until it runs or fails).
    ``gpu_pods``: pods on the node that request a GPU, as last watched (None: unknown).
    ``regrow_waiting``: a regrow is due but waits for those pods to end.
    ``reclaiming``: a reclaim by hand is under way (it survives a restart of the agent).
    ``regrowing``: the reclaim under way is a regrow, which nobody waits for: it is
    given up (the lendee returned as it is) when its drain cannot finish or when the
    restart would gain nothing any more.
    ``attaching``: in LENT, GPUs being attached live (already in ``lent``: the lendee
    may hold them from the first call on). ``hotadd_failed``: a hot-add failed since the
    lendee started, so the GPUs it left wait for a restart.
    ``detaching``: in LENT, GPUs an owner waits for being detached live (still in
    ``lent`` until libvirt says they are gone). ``unplug_failed``: a hot-unplug failed
    since the lendee started, so every reclaim until it restarts is a restart;
    ``unplug_stuck``: the guest did not let the GPUs go when asked, and may be stuck
    there: once its node is drained, a shutdown that times out (or an agent that no
    longer answers) is a power-off, whatever ``force_off`` says.
    ``replug``: the running lendee's GPUs changed live, or may have while the agent was
    away, since its node last returned: the next return restarts its GPU plugins first
    (they enumerate GPUs when they start). Cleared once it is lent again, or off.
    ``reservations``: players' reservations (`hostagent.core.reserve`); those that hold keep
    their owners' GPUs from the lendee (``reserved``) as a waiting owner's are kept.
    ``held``: GPUs the lendee was refused because another running VM holds a member of
    their IOMMU group (a USB controller passed through to it), each with that VM: they
    are not free until it stops (`GroupsHeld`, `VmStopped`).
    """

    phase: Phase = Phase.OFF
    reason: str | None = None
    agent_up: bool = False
    shutdown_sent: bool = False
    lendee_starting: bool = False
    running_owners: frozenset[str] = frozenset()
    intents: tuple[Intent, ...] = ()
    hold: bool = False
    relend_at: float | None = None
    ticket: int = 0
    lent: frozenset[str] = frozenset()
    starting_owners: frozenset[str] = frozenset()
    gpu_pods: int | None = None
    regrow_waiting: bool = False
    reclaiming: bool = False
    regrowing: bool = False
    attaching: frozenset[str] = frozenset()
    hotadd_failed: bool = False
    detaching: frozenset[str] = frozenset()
    unplug_failed: bool = False
    unplug_stuck: bool = False
    replug: bool = False
    reservations: tuple[Reservation, ...] = ()
    held: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def reserved(self) -> frozenset[str]:
        """Owners whose reservation holds their GPUs now."""
        return frozenset(r.vm for r in self.reservations if r.holding)

    def intents_of(self, owner: str) -> tuple[Intent, ...]:
        return tuple(i for i in self.intents if i.owner == owner)

    @property
    def waiting_owners(self) -> tuple[str, ...]:
        """Owners with a pending intent, each once, in the order they first asked."""
        return tuple(dict.fromkeys(i.owner for i in self.intents))


# --- events: facts, each stamped with the agent's clock --------------------------------


@dataclass(frozen=True, kw_only=True)
class Event:
    """Something that happened. ``at``: seconds on the agent's clock."""

    at: float


@dataclass(frozen=True, kw_only=True)
class OwnerWants(Event):
    """Someone asked for `owner` to start (the hook deferred it, or a control request)."""

    owner: str
    intent_id: str
    source: IntentSource


@dataclass(frozen=True, kw_only=True)
class OwnerStarted(Event):
    """libvirt: the owner VM is running."""

    owner: str


@dataclass(frozen=True, kw_only=True)
class OwnerStarting(Event):
    """The hook let the owner's start through (libvirt is starting it now)."""

    owner: str


@dataclass(frozen=True, kw_only=True)
class CancelIntent(Event):
    """Someone withdrew the pending start requests of `owner` (`hostagent release`)."""

    owner: str
    by: str


@dataclass(frozen=True, kw_only=True)
class GpuPods(Event):
    """The cluster: this many pods on the lendee's node request a GPU now."""

    count: int


@dataclass(frozen=True, kw_only=True)
class OwnerStopped(Event):
    """libvirt: the owner VM stopped (shut down, crashed or destroyed)."""

    owner: str


@dataclass(frozen=True, kw_only=True)
class LendeeStarted(Event):
    """libvirt: the lendee VM is running (started by the agent or by hand)."""


@dataclass(frozen=True, kw_only=True)
class LendeeStopped(Event):
    """libvirt: the lendee VM stopped, whatever the cause."""


@dataclass(frozen=True, kw_only=True)
class AgentUp(Event):
    """Report of `WaitAgent`: the lendee's guest agent answered guest-ping."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class AgentTimeout(Event):
    """Report of `WaitAgent`: the guest agent did not answer in time."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class Drained(Event):
    """Report of `Drain`: the node is cordoned and drained (or the policy let it pass)."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class DrainFailed(Event):
    """Report of `Drain`: draining timed out and the policy is to abort (always, for a
    regrow's)."""

    ticket: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ShutdownTimeout(Event):
    """Report of `ShutdownLendee`: the lendee ignored the guest-agent shutdown."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class ReturnDone(Event):
    """Report of `KubeReturn`: Ready, every GPU seen, uncordoned."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class ReturnFailed(Event):
    """Report of `KubeReturn`: the node did not come back whole (the node stays cordoned)."""

    ticket: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class GpusAttached(Event):
    """Report of `AttachGpus`: the GPUs are in the live definition, the guest's driver
    sees them and the node advertises them."""

    ticket: int
    gpus: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class AttachFailed(Event):
    """Report of `AttachGpus`: a step failed within its bound. ``held``: those of
    ``gpus`` the lendee's live definition holds anyway (they stay with it)."""

    ticket: int
    gpus: frozenset[str]
    held: frozenset[str]
    reason: str


@dataclass(frozen=True, kw_only=True)
class GpusDetached(Event):
    """Report of `DetachGpus`: the pods using the GPUs were evicted, nothing in the guest
    used them, and the live definition no longer lists any of their functions."""

    ticket: int
    gpus: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class DetachFailed(Event):
    """Report of `DetachGpus`: a step failed, found something in doubt or ran out of its
    bound; the lendee may hold the GPUs still (only its stop frees them for sure)."""

    ticket: int
    gpus: frozenset[str]
    reason: str
    # The guest was asked to let them go and did not within the bound: its driver may
    # hang there (an unbind while a handle stays open), and its shutdown behind it.
    stuck: bool = False


@dataclass(frozen=True, kw_only=True)
class RelendDue(Event):
    """The relend timer set by `ScheduleRelend` fired."""


@dataclass(frozen=True, kw_only=True)
class GroupsHeld(Event):
    """Report of `StartLendee` (``ticket`` None) or `AttachGpus`: the lendee was given
    none of ``gpus`` (libvirt was not asked), because another running VM holds a member
    of the IOMMU group of each GPU in ``held`` (GPU -> that VM; `hostagent.host.iommu`)."""

    ticket: int | None = None
    gpus: frozenset[str]
    held: Mapping[str, str] = field(hash=False)
    reason: str


@dataclass(frozen=True, kw_only=True)
class GroupsTaken(Event):
    """A VM that is neither the lendee nor an owner started: running VMs hold a member of
    the IOMMU groups of those of the lendee's GPUs in ``held`` (GPU -> that VM)."""

    held: Mapping[str, str] = field(hash=False)


@dataclass(frozen=True, kw_only=True)
class VmStopped(Event):
    """libvirt: a VM that is neither the lendee nor an owner stopped."""

    vm: str


@dataclass(frozen=True, kw_only=True)
class StartFailed(Event):
    """Report of `StartOwner` or `StartLendee`: `vm` could not be started."""

    vm: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Hold(Event):
    """An operator suspended lending (of `lendee` alone, where several lend; None: all)."""

    lendee: str | None = None


@dataclass(frozen=True, kw_only=True)
class Resume(Event):
    """An operator resumed lending (and asked to retry whatever failed); `lendee`: as Hold."""

    lendee: str | None = None


@dataclass(frozen=True, kw_only=True)
class Reclaim(Event):
    """An operator took the GPUs back by hand (`hostagent reclaim`): no owner is to start,
    and the lendee is to stay off until lending is resumed. `lendee`: as Hold."""

    lendee: str | None = None


@dataclass(frozen=True, kw_only=True)
class Reserve(Event):
    """The reservations changed (`hostagent.service.reservations`): made, cancelled, holding,
    used or expired. The whole new list."""

    reservations: tuple[Reservation, ...]


@dataclass(frozen=True, kw_only=True)
class Observed(Event):
    """A fresh read of libvirt, at agent start or after a reconnect."""

    lendee_running: bool
    owners_running: frozenset[str]
    lendee_gpus: frozenset[str] | None = None  # its live set; None: its whole definition
    # The lendee is in service as the previous agent left it: its node uncordoned, Ready
    # and marked lent with exactly `lendee_gpus` (the adapters checked): adopt it.
    adopt: bool = False


# --- actions: requests to the executor -------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Action:
    """Something the executor must do. The lendee's actions carry a ticket."""


@dataclass(frozen=True, kw_only=True)
class Drain(Action):
    """Cordon (marking the cordon as ours) and drain the node; a running `KubeReturn`
    is superseded. Reports `Drained` or `DrainFailed`. A `regrow`'s drain is the
    optional kind: nobody waits for it, so one that cannot finish fails, whatever
    policy.on_drain_timeout says for the drains players wait for."""

    ticket: int
    regrow: bool = False


@dataclass(frozen=True, kw_only=True)
class WaitAgent(Action):
    """Poll guest-ping on the lendee, bounded. Reports `AgentUp` or `AgentTimeout`."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class ShutdownLendee(Action):
    """Guest-agent shutdown of the lendee. Reports `LendeeStopped` or `ShutdownTimeout`."""

    ticket: int


@dataclass(frozen=True, kw_only=True)
class ForceOff(Action):
    """Destroy the lendee (after the force_off_after grace). Reports `LendeeStopped`.
    ``reason``: set when the machine powers off a guest stuck letting a GPU go, which no
    policy needs to allow (see `hostagent.core.machine`); the journal says it as is."""

    ticket: int
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class StartOwner(Action):
    """Start the owner VM. Reports `OwnerStarted` or `StartFailed`."""

    owner: str


@dataclass(frozen=True, kw_only=True)
class StartLendee(Action):
    """Start the lendee VM with `gpus` only (a live definition for this boot; the
    persistent one keeps them all). Reports `LendeeStarted` or `StartFailed`."""

    gpus: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class KubeReturn(Action):
    """Wait Ready and the GPUs, then uncordon (if we cordoned). Reports `ReturnDone`
    or `ReturnFailed`. ``restart_plugins``: the lendee lost GPUs while it ran (a
    hot-unplug); the GPU plugins' pods on the node restart first, to advertise the rest."""

    ticket: int
    restart_plugins: bool = False


@dataclass(frozen=True, kw_only=True)
class AttachGpus(Action):
    """Attach `gpus` to the running lendee (its live definition only), wait for them in
    the guest, have the node advertise them. Reports `GpusAttached` or `AttachFailed`."""

    ticket: int
    gpus: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class DetachGpus(Action):
    """Take `gpus` from the running lendee live: cordon its node, evict the pods using
    them, check that nothing in the guest does, detach every function and wait until
    libvirt has removed them, within a bound. Reports `GpusDetached` or `DetachFailed`."""

    ticket: int
    gpus: frozenset[str]


@dataclass(frozen=True, kw_only=True)
class ScheduleRelend(Action):
    """Arm (or re-arm) the one relend timer to report `RelendDue` at `at`."""

    at: float


@dataclass(frozen=True, kw_only=True)
class CancelRelend(Action):
    """Disarm the relend timer."""


@dataclass(frozen=True, kw_only=True)
class FailIntent(Action):
    """Tell whoever asked that the start request failed, and why."""

    intent_id: str
    owner: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class CompleteIntent(Action):
    """Tell whoever asked that the owner is running."""

    intent_id: str
    owner: str


# --- questions asked of the state ------------------------------------------------------


def free_gpus(state: State, topo: Topology, policy: Policy) -> frozenset[str]:
    """The lendee's GPUs that no owner holds, starts with or waits for, nor shares an
    IOMMU group with, and whose group no other VM holds (``held``): what a lendee start
    takes. All or nothing unless ``policy.partial``."""
    owners = state.running_owners | state.starting_owners | {*state.waiting_owners,
                                                             *state.reserved}
    claimed = topo.whole(topo.gpus_of(owners) | state.held.keys()) & topo.lendee_gpus
    if claimed and not policy.partial:
        return frozenset()
    return topo.lendee_gpus - claimed


def holders(state: State, topo: Topology) -> dict[str, str | None]:
    """Which running VM holds each GPU, as the machine knows it (for ``status``).

    A GPU that both a running owner and a running lendee claim (a topology reality
    contradicted, see `hostagent.core.machine`) is shown as the owner's: its claim comes first,
    and the lendee's phase already says it is being reclaimed.
    """
    out: dict[str, str | None] = {}
    for gpu in sorted(topo.gpus):
        owner = next((o for o in sorted(state.running_owners) if gpu in topo.owners[o]), None)
        if owner is not None:
            out[gpu] = owner
        elif gpu in state.lent and state.phase.lendee_running:
            out[gpu] = topo.lendee
        else:
            out[gpu] = None
    return out


def still_wanted(state: State, action: Action, *, topo: Topology) -> bool:
    """Whether `action`, emitted earlier, should still be run in `state`.

    The executor asks just before it runs an action, and skips (and logs) the ones that
    went stale in the queue. The lendee's actions are wanted while their ticket is
    current. A `StartOwner` while its owner still waits and the lendee neither holds
    nor is getting its GPUs: a start nobody waits for any more would be deferred by the
    hook, which would record it as a *new* request and start a game nobody asked for.
    A `StartLendee` while its start, with that set, is expected. The rest (timers,
    answers to callers) always.
    """
    match action:
        case Drain() | WaitAgent() | ShutdownLendee() | ForceOff() | KubeReturn():
            return action.ticket == state.ticket
        case AttachGpus(ticket=ticket, gpus=gpus):
            return ticket == state.ticket and gpus == state.attaching
        case DetachGpus(ticket=ticket, gpus=gpus):
            return ticket == state.ticket and gpus == state.detaching
        case StartOwner(owner=owner):
            if not state.intents_of(owner) or owner in state.running_owners:
                return False
            return not topo.claims(owner) & state.lent
        case StartLendee(gpus=gpus):
            return state.lendee_starting and gpus == state.lent
    return True
