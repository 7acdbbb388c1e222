"""One week replayed through the pure machine (`hostagent.core.machine.step`), once per
lendee, on a simulated clock: libvirt, the players, the executor and the cluster are
played here, each step taking a drawn duration (`bench.capacity_inputs`).

A configuration (`Config`) is either today's single lendee holding all three GPUs, or one
lendee per GPU, each its own machine and its own Kubernetes node: an owner's start then
reaches only the lendee holding its GPU, and the others never see it. The levers of the
per-lendee design are played by the executor: an eviction grace for unplanned starts,
the lendee cordoned ahead of its owner's usual start, the guest's shutdown begun once the
evictions are accepted, and the lendee powered off once drained (`drain.stop =
"power-off"`).

What counts as lent: a GPU the lendee holds, on a node the scheduler may place work on
(LENT, not cordoned for a detach or ahead of a game), or that still runs a job: a GPU
being attached or detached, on a cordoned node with nothing on it, or on a lendee booting
or returning is not lent.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.capacity_inputs import (
    DETACH_BOUND,
    HOUR,
    JOB_GRACE,
    WARMUP,
    WEEK,
    Draws,
    Durations,
    Week,
    precordon_windows,
)
from hostagent.core import reserve as plan
from hostagent.core.machine import IllegalTransition, step, verdict
from hostagent.core.model import (
    Action,
    AgentUp,
    AttachGpus,
    CancelRelend,
    CompleteIntent,
    DetachFailed,
    DetachGpus,
    Drain,
    Drained,
    Event,
    FailIntent,
    GpuPods,
    GpusAttached,
    GpusDetached,
    IntentSource,
    KubeReturn,
    LendeeStarted,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStarting,
    OwnerStopped,
    OwnerWants,
    Phase,
    Policy,
    RelendDue,
    Reserve,
    ReturnDone,
    ScheduleRelend,
    ShutdownLendee,
    StartLendee,
    StartOwner,
    State,
    Topology,
    WaitAgent,
)
from hostagent.core.reserve import Reservation

TIMING = plan.Timing()  # the agent's policy.reserve_* defaults
GPUS = ("gpu-a", "gpu-b", "gpu-c")  # the seeds' tower: gpu-c is owned by nobody
Running = tuple[float, float, str, bool]  # a job's end, duration, GPU, ignores SIGTERM
OWNED = {"gaming1": frozenset({"gpu-a"}), "gaming2": frozenset({"gpu-b"})}


def topologies(per_gpu: bool) -> list[Topology]:
    """One lendee with every GPU (today), or one per GPU, each knowing its owner only."""
    if not per_gpu:
        return [Topology(lendee="gpu-node", lendee_gpus=frozenset(GPUS), owners=OWNED)]
    return [Topology(lendee=f"node-{g[-1]}", lendee_gpus=frozenset({g}),
                     owners={o: gs for o, gs in OWNED.items() if g in gs}) for g in GPUS]


@dataclass(frozen=True)
class Config:
    """A column: the design, its policy and levers, and the live detaches' fallback rate."""

    name: str
    per_gpu: bool = False
    policy: Policy = Policy()
    grace: float | None = None  # the eviction grace of an unplanned start's drain
    precordon: bool = False  # cordon ahead of the owner's usual start
    # The guest's shutdown begins once the evictions are accepted, and runs beside them:
    # taken to end the pods' containers by their grace's end (a guest whose containerd
    # leaves them to systemd's final kill would wait up to 90 s for one ignoring SIGTERM).
    early_shutdown: bool = False
    # drain.stop = "power-off": once drained (shutdown_when "gone", the guest agent's
    # ping), the filesystems frozen and the lendee powered off rather than shut down.
    power_off: bool = False
    fallback: float = 0.0  # the share of live detaches that fail (a restart follows)


@dataclass
class Figures:
    lent_gs: float = 0.0
    free_gs: float = 0.0  # GPU-seconds no owner holds
    job_hours: float = 0.0  # GPU-job hours completed in the week
    killed: int = 0
    killed_elsewhere: int = 0  # on a GPU no waiting or reserved game wanted
    restarts: int = 0
    fallbacks: int = 0
    gpu_waits: list[float] = field(default_factory=list)  # unplanned: asked → VM started
    vm_waits: list[float] = field(default_factory=list)  # unplanned: asked → VM running
    reserved_waits: list[float] = field(default_factory=list)  # reserved: asked → started
    failed: int = 0
    stale: int = 0

    @property
    def share(self) -> float:
        return self.lent_gs / self.free_gs


@dataclass
class Lendee:
    topo: Topology
    state: State = field(default_factory=State)
    relend_token: int = 0
    started_at: float = 0.0
    cordoned: bool = False  # ahead of an owner's usual start
    drain_end: float = 0.0  # where the shutdown overlaps the drain (early_shutdown)
    reported: int = -1  # the GPU-pod count the node watch last reported


class Replay:
    """The machines, their executor, libvirt, the players and the cluster on one clock."""

    def __init__(self, cfg: Config, w: Week, d: Durations | None = None, *,
                 reserved: float = 0.0) -> None:
        self.cfg, self.week = cfg, w
        self.draws = Draws(d or Durations(), random.Random(f"draws/{w.kind}/{w.band}/{w.seed}"))
        self.luck = random.Random(f"luck/{w.kind}/{w.band}/{w.seed}")  # detaches that fail
        self.place = random.Random(0)  # which free GPU a job gets
        self.lendees = [Lendee(t) for t in topologies(cfg.per_gpu)]
        self.of_gpu = {g: le for le in self.lendees for g in le.topo.lendee_gpus}
        self.now = self.last = -WARMUP
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq, self.ids = itertools.count(), itertools.count()
        self.owners_up: set[str] = set()
        self.asked: dict[str, tuple[float, bool]] = {}  # owner → (asked at, reserved)
        self.waiting: dict[str, set[int]] = {}  # owner → lendees yet to let its GPUs go
        self.running: dict[int, Running] = {}
        self.pending: deque[tuple[int, float, bool]] = deque()
        self.reservations: dict[str, Reservation] = {}
        self.f = Figures()
        book = random.Random(f"book/{w.kind}/{w.band}/{w.seed}")
        for start, end, owner in w.games:
            booked = bool(reserved) and book.random() < reserved
            self.at(start, self.player_starts, owner, booked)
            self.at(end, self.player_stops, owner)
            if booked:
                self.at(max(-WARMUP, start - TIMING.lead), self.notice, owner, start)
        for arrival, duration, stubborn in w.work:
            self.at(arrival, self.pending.append, (next(self.ids), duration, stubborn))
        if cfg.precordon:
            for owner, gpus in OWNED.items():
                le = self.of_gpu[next(iter(gpus))]
                for begin, end in precordon_windows(w.history, owner):
                    self.at(begin, self.cordon, le, owner, True)
                    self.at(end, self.cordon, le, owner, False)

    # -- the clock

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> Figures:
        for le in self.lendees:
            self.deliver(le, Observed(at=self.now, lendee_running=False,
                                      owners_running=frozenset()))
            self.deliver(le, GpuPods(at=self.now, count=0))
        while self.heap and self.heap[0][0] < WEEK:
            t, _, fn, args = heapq.heappop(self.heap)
            self.account(t)
            self.now = t
            fn(*args)
            self.start_jobs()
        self.account(WEEK)
        return self.f

    def measured(self) -> bool:
        return 0.0 <= self.now < WEEK

    def usable(self, le: Lendee) -> frozenset[str]:
        s = le.state
        if s.phase not in (Phase.LENT, Phase.JOINING):
            return frozenset()
        return s.lent - s.attaching - s.detaching

    def schedulable(self, le: Lendee) -> bool:
        return le.state.phase is Phase.LENT and not le.state.detaching and not le.cordoned

    def account(self, t: float) -> None:
        """Integrate the time since the last event, inside the measured week only."""
        dt = min(t, WEEK) - max(self.last, 0.0)
        self.last = t
        if dt <= 0:
            return
        held = frozenset().union(*(OWNED[o] for o in self.owners_up))
        busy = {run[2] for run in self.running.values()}
        self.f.free_gs += dt * len(set(GPUS) - held)
        for le in self.lendees:
            open_ = self.schedulable(le)
            for gpu in self.usable(le):
                assert gpu not in held, f"{gpu} lent while an owner holds it"
                if open_ or gpu in busy:
                    self.f.lent_gs += dt

    # -- the machines and their executor

    def deliver(self, le: Lendee, event: Event) -> None:
        try:
            new, actions = step(le.state, event, topo=le.topo, policy=self.cfg.policy)
        except IllegalTransition:
            self.f.stale += 1  # a report gone stale: the agent logs it, as here
            return
        le.state = new
        for action in actions:
            self.execute(le, action)

    def later(self, le: Lendee, took: float, event: Event) -> None:
        """`event` delivered to `le` when a step that takes `took` ends: scheduled and
        stamped with the same reading."""
        self.at(self.now + took, self.deliver, le, replace(event, at=self.now + took))

    def drain_time(self, le: Lendee, evicted: list[Running]) -> float:
        """The evictions' wait: a pod that ignores SIGTERM holds it for its grace period
        (the lever's shorter one for an unplanned start; a reservation's keeps the full)."""
        if not any(run[3] for run in evicted):
            return self.draws.take("drain_idle")
        grace = JOB_GRACE
        if self.cfg.grace is not None and le.state.intents and not le.state.reserved:
            grace = self.cfg.grace
        return grace + self.draws.take("drain_tail")

    def execute(self, le: Lendee, action: Action) -> None:
        take, cfg = self.draws.take, self.cfg
        match action:
            case ScheduleRelend(at=due):
                le.relend_token += 1
                self.at(max(due, self.now), self.relend_fires, le, le.relend_token)
            case CancelRelend():
                le.relend_token += 1
            case StartLendee():
                self.at(self.now + take("launch"), self.lendee_starts, le)
            case WaitAgent(ticket=t):
                up = self.now + take("ping")
                if le.state.phase is Phase.BOOTING:
                    up = max(self.now, le.started_at + take("boot"))
                self.later(le, up - self.now, AgentUp(at=up, ticket=t))
            case AttachGpus(ticket=t, gpus=gpus):
                self.later(le, take("hot_add"), GpusAttached(at=0, ticket=t, gpus=gpus))
            case DetachGpus(ticket=t, gpus=gpus):
                evicted = self.evict(le, gpus)
                took = self.drain_time(le, evicted) if evicted else 0.0
                if self.luck.random() < cfg.fallback:
                    if self.measured():
                        self.f.fallbacks += 1
                    self.later(le, took + DETACH_BOUND, DetachFailed(
                        at=0, ticket=t, gpus=gpus, reason="the detach ran out of its bound"))
                else:
                    self.later(le, took + take("unplug"), GpusDetached(at=0, ticket=t, gpus=gpus))
            case KubeReturn(ticket=t):
                self.later(le, take("kube_return"), ReturnDone(at=0, ticket=t))
            case Drain(ticket=t):
                took = self.drain_time(le, self.evict(le, None))
                le.drain_end = self.now + took
                if cfg.early_shutdown:
                    took = min(took, take("accept"))  # the rest runs beside the shutdown
                self.later(le, took, Drained(at=0, ticket=t))
            case ShutdownLendee():
                took = take("power_off") if cfg.power_off else take("shutdown")
                if cfg.early_shutdown and not cfg.power_off:
                    took = max(took, le.drain_end - self.now)
                self.at(self.now + took, self.lendee_stops, le)
            case StartOwner(owner=o):
                self.waiting.get(o, set()).discard(id(le))
                if not self.waiting.get(o):
                    self.owner_launch(o)
            case CompleteIntent():
                pass
            case FailIntent():
                self.f.failed += 1
            case _:
                raise AssertionError(f"the replay has no executor for {action}")

    def relend_fires(self, le: Lendee, token: int) -> None:
        if token == le.relend_token:
            self.deliver(le, RelendDue(at=self.now))

    def lendee_starts(self, le: Lendee) -> None:
        le.started_at, le.reported = self.now, -1
        self.deliver(le, LendeeStarted(at=self.now))

    def lendee_stops(self, le: Lendee) -> None:
        if self.measured():
            self.f.restarts += 1
        self.deliver(le, LendeeStopped(at=self.now))

    def cordon(self, le: Lendee, owner: str, on: bool) -> None:
        """The pre-cordon lever: no new GPU pod on `le` ahead of its owner's usual start
        (not when the owner already plays)."""
        le.cordoned = on and owner not in self.owners_up

    # -- libvirt and the players

    def mine(self, owner: str) -> list[Lendee]:
        return [le for le in self.lendees if le.topo.needs_lendee_gpus(owner)]

    def player_starts(self, owner: str, booked: bool) -> None:
        self.asked[owner] = (self.now, booked)
        defer = set()
        for le in self.mine(owner):
            decision, why = verdict(le.state, owner, topo=le.topo)
            assert decision in ("proceed", "defer"), f"{owner} refused: {why}"
            if decision == "defer":
                defer.add(id(le))
                self.deliver(le, OwnerWants(at=self.now, owner=owner,
                                            intent_id=f"i{next(self.ids)}",
                                            source=IntentSource.HOOK))
        self.waiting[owner] = defer
        if not defer:
            self.owner_launch(owner)

    def owner_launch(self, owner: str) -> None:
        """libvirt starts `owner`: every lendee of its GPUs lets it through."""
        self.waiting.pop(owner, None)
        asked, booked = self.asked[owner]
        if self.measured():
            (self.f.reserved_waits if booked else self.f.gpu_waits).append(self.now - asked)
        for le in self.mine(owner):
            decision, why = verdict(le.state, owner, topo=le.topo)
            assert decision == "proceed", f"{owner}: {decision}: {why}"
            self.deliver(le, OwnerStarting(at=self.now, owner=owner))
        self.at(self.now + self.draws.take("owner_start"), self.owner_runs, owner)

    def owner_runs(self, owner: str) -> None:
        self.owners_up.add(owner)
        asked, booked = self.asked.pop(owner)
        if self.measured() and not booked:
            self.f.vm_waits.append(self.now - asked)
        for le in self.mine(owner):
            le.cordoned = False
            self.deliver(le, OwnerStarted(at=self.now, owner=owner))
        if self.reservations.pop(owner, None) is not None:  # used
            self.reserve()

    def player_stops(self, owner: str) -> None:
        self.owners_up.discard(owner)
        for le in self.mine(owner):
            self.deliver(le, OwnerStopped(at=self.now, owner=owner))

    # -- reservations, as hostagent.service.reservations plays them

    def notice(self, owner: str, start: float) -> None:
        """`TIMING.lead` ahead: the eviction at the game's time less the jobs' full grace
        and the margin; the GPU held from then on."""
        r = Reservation(vm=owner, at=start, by="bench", made=self.now)
        evict = plan.evict_time(r, JOB_GRACE, TIMING, self.now)
        self.reservations[owner] = replace(r, evict_at=evict)
        self.at(evict, self.hold, owner, start)

    def hold(self, owner: str, start: float) -> None:
        r = self.reservations.get(owner)
        if r is not None and r.at == start:
            self.reservations[owner] = replace(r, holding=True)
            self.reserve()

    def reserve(self) -> None:
        for le in self.lendees:
            mine = tuple(r for r in self.reservations.values()
                         if le.topo.needs_lendee_gpus(r.vm))
            self.deliver(le, Reserve(at=self.now, reservations=mine))

    # -- the cluster's GPU jobs

    def start_jobs(self) -> None:
        busy = {run[2] for run in self.running.values()}
        free = sorted(g for le in self.lendees if self.schedulable(le)
                      for g in self.usable(le) - busy)
        while self.pending and free:
            job, duration, stubborn = self.pending.popleft()
            gpu = free.pop(self.place.randrange(len(free)))
            self.running[job] = (self.now + duration, duration, gpu, stubborn)
            self.at(self.now + duration, self.job_ends, job, self.now + duration)
        self.report()

    def report(self) -> None:
        """The node watch: each lendee's count of GPU pods, when it changes, and first at
        each lend (the machine knows nothing of a lend's GPU pods until then)."""
        for le in self.lendees:
            count = sum(self.of_gpu[run[2]] is le for run in self.running.values())
            fresh = le.state.phase is Phase.LENT and le.state.gpu_pods is None
            if count != le.reported or fresh:
                le.reported = count
                self.deliver(le, GpuPods(at=self.now, count=count))

    def job_ends(self, job: int, end: float) -> None:
        if self.running.get(job, (None,))[0] != end:
            return  # evicted since
        _, duration, _, _ = self.running.pop(job)
        if self.measured():
            self.f.job_hours += duration / HOUR
        self.report()

    def evict(self, le: Lendee, gpus: frozenset[str] | None) -> list[Running]:
        """A drain (`gpus` None): every job on `le` is evicted, and will start over; a
        hot-unplug: the jobs on `gpus`. Those evicted."""
        evicted = {job: run for job, run in self.running.items()
                   if self.of_gpu[run[2]] is le and (gpus is None or run[2] in gpus)}
        if self.measured() and evicted:
            wanted = frozenset().union(*(
                x.topo.gpus_of({i.owner for i in x.state.intents} | x.state.reserved)
                for x in self.lendees))
            self.f.killed += len(evicted)
            self.f.killed_elsewhere += sum(run[2] not in wanted for run in evicted.values())
        for job, (_, duration, _, stubborn) in sorted(evicted.items(), reverse=True):
            self.pending.appendleft((job, duration, stubborn))
            del self.running[job]
        if evicted:
            self.at(self.now, self.report)
        return list(evicted.values())
