"""Capacity: how much of the GPU time no game uses reaches the cluster, over a week.

    python -m bench.capacity [--markdown FILE] [--seed 14]

A reference week is replayed through the pure machine (`hostagent.core.machine.step`) on a
simulated clock: the players, the executor and the cluster are played here, each step
taking the time it takes on real hardware. No VM runs; the same machine decides as in
the agent, so the figures are the policy's, not the lab's.

The host: the seeds' tower. Three GPUs, all borrowed by the lendee: gpu-c owned by
nobody (the GTX 960), gpu-a owned by gaming1 and gpu-b by gaming2 (an RTX 3050 each).

The week (Monday 00:00 to the next; the Sunday before runs as a warm-up, the same way):
every evening gaming1 plays 19:00-21:00 and gaming2 20:00-22:00 (an hour together);
on Saturday each also plays six hours, gaming1 10:00-16:00 and gaming2 11:00-17:00. A
player starts the VM through libvirt (the hook: proceed or defer), and shuts it down at
the end.

Step durations (seconds), and where each comes from:

- lendee boot, 30: the seeds (001): the GPU node "started in twenty-four seconds" with
  one card, and after a game "is relaunched in under thirty seconds";
- guest agent, 45 after the boot (so 75 after the start): the seeds (001): "the agent
  takes thirty to sixty seconds to come up in a fresh VM"; taken after the boot, not
  from the start, which is the slower reading;
- drain, 20: the evictions of a few pods with their default 30 s grace period, most
  of which exit on SIGTERM well before it (kubectl drain's own loop, DESIGN.md; the lab
  measures 2.6 s for three pods behind a PodDisruptionBudget);
- guest shutdown, 15: a systemd guest stopping k3s and its containers (the lab's
  busybox guest takes 1.5 s; k3s's containerd shim stop is the long part);
- return to the cluster (Ready and every GPU allocatable after the guest agent
  answers), 60: the kubelet posts node status every 10 s (nodeStatusUpdateFrequency,
  Kubernetes docs), flannel and the NVIDIA device plugin DaemonSet pod start once the
  node is up, and the plugin registers ``nvidia.com/gpu`` after NVML has initialised
  every card (NVIDIA k8s-device-plugin README); an estimate on the slow side;
- owner start, 5: libvirt starting a passthrough game VM up to its vCPUs running (the
  VFIO device reset and DMA mapping of 8 GB of guest memory; the lab's 200 ms has no
  device to reset);
- guest-ping of an agent already up, 1; a libvirt start up to its STARTED event, 1;
- hot-add (``policy.hotplug = "add"``), 40: libvirt's attach and the guest seeing the
  device take under a second (the lab: tests/lab/test_hotplug_lab.py), the NVIDIA
  driver's probe of the new card a few seconds, then the device plugin's pod deleted,
  started again by its DaemonSet and registering after NVML has initialised every
  card, and the kubelet's next status (every 10 s); an estimate on the slow side. The
  GPU counts as lent, and takes jobs, only at its end;
- hot-unplug (``policy.hotplug = "both"``), 5, and a drain's 20 before it when a job
  runs on the game's GPU: the node cordoned and the kubelet's device checkpoint read,
  the pods on the GPU evicted and waited for (as a drain's; the agent evicts, and
  waits, only when the checkpoint or the claims name a pod on it: `Cluster.vacate`),
  the GPU plugins stopped, nothing left on it in the guest, then libvirt's detach: the
  NVIDIA driver's unbind and the slot's power-off take seconds (the lab's 1.5 s has no
  driver to unbind). A player whose GPU is lent thus waits 10 s by hot-unplug (the
  unplug, then the game's start), or 30 s when a job runs on the GPU. The return that
  follows (the plugins restarted, the node verified, uncordoned) takes a return's 60 s,
  during which the node takes no new job; the jobs on its other GPUs run on. Every
  detach is taken to succeed here: one that fails adds its bound (30 s) and a reclaim
  by restart.

The cluster's GPU work: single-GPU jobs of 1 to 3 hours arriving every 2 to 6 hours
(uniformly random, --seed), run first come first served on the node while it is lent,
uncordoned and has a GPU free, each on one GPU. A drain evicts the running ones: each
restart of the lendee that begins while a job runs is one that "killed a running GPU
job" (the job starts over later); a hot-unplug evicts only the jobs on the GPU it
takes. The node watch reports the count of running GPU jobs to the machine (`GpuPods`).

Figures, per policy, over the measured week:

- lent share: GPU-seconds lent (the lendee LENT, holding the GPU) ÷ GPU-seconds no
  owner holds (an owner holds its GPU from its STARTED event to its stop);
- lendee restarts: shutdowns of the lendee (each one followed by a start);
- restarts that killed a running GPU job (of those, how many were a regrow rather than
  a game taking its GPU back), and the jobs killed;
- the longest wait of a player (start asked → the game VM running);
- regrow waiting: time a regrow waited for the node to be idle of GPU jobs.

``never`` keeps the smallest set the lendee came down to until it stops for another
reason: over a week with no such stop, gpu-c alone from the first evening on.

The candidates for the default, side by side: ``always``; ``when-idle`` with no limit
on its wait, or restarting anyway after ``regrow_max_wait`` (30 or 2 minutes); each
bounded one also with no new GPU job starting on the node while the regrow waits (as
if the node were cordoned for them meanwhile: a job started then is one the restart
kills); the default with hot-add (``policy.hotplug = "add"``), which attaches the
GPUs a game freed to the running lendee instead of restarting it: no regrow kills a job
and none waits for the node to be idle, only a game's reclaim restarts the lendee; and
with hot-unplug too (``"both"``), where a game's reclaim takes its GPU from the running
lendee and stops only the jobs on it. Each
is also replayed over 30 weeks of other GPU work (seeds 0-29): in how many the budget is
met, the worst share, the jobs killed per week.

Budget: the default policy (`hostagent.core.model.Policy()`) lends ≥ 99 % of the GPU time
no game uses, in the reference week and in each of the 30; among the candidates that
do, the default is the one that kills the fewest GPU jobs. The agent's default is two
columns: where the lendee can hot-plug (``policy.hotplug = "auto"``), "default, hot-add
+ hot-unplug"; elsewhere `Policy()`, "when-idle, no limit", which never kills a running
job for a regrow and so leaves a freed GPU idle while jobs run on the others.

One week's timing can be tuned to; so every candidate is also replayed over 60 varied
weeks (`VARIED`), a third each of three schedules (`_games`: evenings, weekends, games
at random hours), GPU work of one kind a week (`_work`: a job every 1-6 h on average,
short, medium or long), and every step's duration straying by up to ±50 % at each
occurrence (`_Jittered`). Per candidate: the lent share's median, 10th percentile and
worst; GPU jobs killed, and of those the ones on a GPU no waiting game wanted; the
GPU-hours of work the killed jobs had done (destroyed: they start over); the player's
wait, median and worst. Goals of the default there: median share ≥ 99.5 %, 10th
percentile ≥ 99 %, median wait ≤ 20 s; `winner` names the candidate that meets them
and destroys the least work.

Reservations (`hostagent reserve`): over the same varied weeks, `RESERVED` of the games
(drawn per game) are reserved ahead, for the default and the default where the lendee
can hot-plug. The agent's timeline is played as `hostagent.service.reservations` runs it with
the default `policy.reserve_*` (`TIMING`): the notice `lead` before the game, the
eviction at the game's time less the jobs' grace period (`JOB_GRACE`, the API's
default) and the margin, the GPU held from then until the game runs. Reported: the
reserved player's wait for the GPU (start asked → libvirt starts the VM; goal 0 s) and
to a running VM, and what the gentle reclaim costs: the lent share, jobs killed and
work destroyed without and with reservations; then with no-shows, `NO_SHOW` of the
reserved games never played: the reclaim happens all the same, the GPU is held until
the reservation expires (`expiry` after its time, as `hostagent.service.reservations` ends it)
and is lent again then (a hot-add, or a regrow by restart). Reported: the no-shows,
the GPU-hours each leaves neither played nor lent (from the hold to the lend after the
expiry), the lent share with them, and the jobs their reclaims killed.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hostagent.core import reserve as plan
from hostagent.core.machine import IllegalTransition, step, verdict
from hostagent.core.model import (
    Action,
    AgentUp,
    AttachGpus,
    CancelRelend,
    CompleteIntent,
    Drain,
    DetachGpus,
    Drained,
    Event,
    FailIntent,
    GpuPods,
    GpusAttached,
    GpusDetached,
    Hotplug,
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
    Regrow,
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

HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY
WARMUP = DAY  # the Sunday before Monday 00:00 (time 0)
BUDGET = 0.99
# Reservations: the agent's defaults (policy.reserve_lead, _margin, _expiry), and the
# grace period of the cluster's GPU jobs (the API's default), which sets the eviction.
TIMING = plan.Timing()
JOB_GRACE = 30.0

TOPO = Topology(
    lendee="gpu-node",
    lendee_gpus=frozenset({"gpu-a", "gpu-b", "gpu-c"}),
    owners={"gaming1": frozenset({"gpu-a"}), "gaming2": frozenset({"gpu-b"})},
)


@dataclass(frozen=True)
class Durations:
    """Seconds each step takes (the module docstring says where each comes from)."""

    launch: float = 1.0
    boot: float = 30.0
    agent: float = 45.0
    ping: float = 1.0
    kube_return: float = 60.0
    drain: float = 20.0
    shutdown: float = 15.0
    owner_start: float = 5.0
    hot_add: float = 40.0
    hot_unplug: float = 5.0  # and a drain's, first, when a job runs on the GPU


class _Jittered:
    """`Durations` whose every reading strays by up to ±`spread` (uniformly): each
    boot, drain or return of a varied week takes its own time."""

    def __init__(self, d: Durations, spread: float, rng: random.Random) -> None:
        self._d, self._spread, self._rng = d, spread, rng

    def __getattr__(self, name: str) -> float:
        base: float = getattr(self._d, name)
        return base * self._rng.uniform(1 - self._spread, 1 + self._spread)


def sessions() -> list[tuple[float, float, str]]:
    """(start, end, owner) of every game from the warm-up Sunday to the week's end."""
    out = []
    for day in range(-1, 7):  # -1: the Sunday before; 5: Saturday
        base = day * DAY
        out += [(base + 19 * HOUR, base + 21 * HOUR, "gaming1"),
                (base + 20 * HOUR, base + 22 * HOUR, "gaming2")]
        if day == 5:
            out += [(base + 10 * HOUR, base + 16 * HOUR, "gaming1"),
                    (base + 11 * HOUR, base + 17 * HOUR, "gaming2")]
    return sorted(out)


def jobs(seed: int) -> list[tuple[float, float]]:
    """(arrival, duration) of the cluster's GPU jobs, the same for every policy."""
    rng = random.Random(seed)
    out: list[tuple[float, float]] = []
    t = -WARMUP
    while True:
        t += rng.uniform(2 * HOUR, 6 * HOUR)
        if t >= WEEK:
            return out
        out.append((t, rng.uniform(1 * HOUR, 3 * HOUR)))


@dataclass
class Figures:
    lent_gs: float = 0.0  # GPU-seconds the lendee held while LENT
    free_gs: float = 0.0  # GPU-seconds no owner held
    per_gpu_lent: dict[str, float] = field(default_factory=dict)
    per_gpu_free: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    killing_restarts: int = 0
    regrow_kills: int = 0  # of those, restarts no game asked for (a regrow)
    jobs_killed: int = 0
    jobs_killed_by_regrow: int = 0
    hot_adds: int = 0
    hot_unplugs: int = 0
    job_hours_done: float = 0.0
    gpu_hours_destroyed: float = 0.0  # work the killed jobs had done, lost with them
    jobs_killed_elsewhere: int = 0  # killed on a GPU that no waiting game wanted
    player_waits: list[float] = field(default_factory=list)
    # Games reserved ahead: start asked → libvirt starts the VM (the wait for its GPU),
    # and → the VM running (that, and the VM's own start).
    reserved_gpu_waits: list[float] = field(default_factory=list)
    reserved_waits: list[float] = field(default_factory=list)
    regrow_waiting_s: float = 0.0
    # Reserved games nobody came to play: how many, the GPU-seconds their GPUs were
    # neither played nor lent (from the hold to the lend after the expiry), the jobs
    # their reclaims killed and the work those had done.
    no_shows: int = 0
    no_show_idle_gs: float = 0.0
    no_show_killed: int = 0
    no_show_destroyed_h: float = 0.0
    failed_intents: int = 0
    stale: int = 0

    @property
    def share(self) -> float:
        return self.lent_gs / self.free_gs


class Replay:
    """The machine, its executor, libvirt, the players and the cluster on one clock."""

    def __init__(self, policy: Policy, d: Durations, work: list[tuple[float, float]],
                 *, hold_new_jobs: bool = False,
                 games: list[tuple[float, float, str]] | None = None,
                 spread: float = 0.0, seed: int = 0, reserved: float = 0.0,
                 no_show: float = 0.0) -> None:
        self.policy, self.hold_new_jobs = policy, hold_new_jobs
        self.d = _Jittered(d, spread, random.Random(seed)) if spread else d
        self.state = State()
        self.now = -WARMUP
        self.last = -WARMUP
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.relend_token = 0
        self.lendee_started_at = 0.0
        self.owners_up: set[str] = set()
        self.asked_at: dict[str, float] = {}
        self.running: dict[int, tuple[float, float, str]] = {}  # job → (end, duration, GPU)
        self.pending: deque[tuple[int, float]] = deque()
        self.rng = random.Random(0)  # which free GPU a job gets: the same for every policy
        self.f = Figures()
        # A share `reserved` of the games is reserved ahead (`hostagent reserve`): the
        # agent's timeline, played here as `hostagent.service.reservations` runs it.
        self.reservations: dict[str, Reservation] = {}
        self.reserved_games: set[tuple[str, float]] = set()
        self.asked_reserved: dict[str, bool] = {}
        # A share `no_show` of the reserved games is never played: the reservation holds
        # the GPU until it expires, `TIMING.expiry` after its time (`no_show_idle` is
        # open from the hold until the GPU is lent again).
        self.no_show_games: set[tuple[str, float]] = set()
        self.no_show_idle: set[str] = set()
        pick, absent = random.Random(seed + 1_000), random.Random(seed + 2_000)
        for start, end, owner in sessions() if games is None else games:
            booked = bool(reserved) and pick.random() < reserved
            if booked and absent.random() < no_show:
                self.no_show_games.add((owner, start))
                self.at(start + TIMING.expiry, self.reservation_expires, owner, start)
            else:
                self.at(start, self.player_starts, owner)
                self.at(end, self.player_stops, owner)
            if booked:
                self.reserved_games.add((owner, start))
                self.at(max(-WARMUP, start - TIMING.lead), self.reservation_notice, owner,
                        start)
        for arrival, duration in work:
            self.at(arrival, self.job_arrives, duration)

    # -- the clock

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> Figures:
        self.deliver(Observed(at=self.now, lendee_running=False, owners_running=frozenset()))
        self.deliver(GpuPods(at=self.now, count=0))
        while self.heap and self.heap[0][0] < WEEK:
            t, _, fn, args = heapq.heappop(self.heap)
            self.account(t)
            self.now = t
            fn(*args)
            self.start_jobs()
        self.account(WEEK)
        return self.f

    def account(self, t: float) -> None:
        """Integrate the time since the last event, inside the measured week only."""
        dt = min(t, WEEK) - max(self.last, 0.0)
        self.last = t
        if dt <= 0:
            return
        s = self.state
        held = TOPO.gpus_of(self.owners_up)
        # A GPU being hot-added is the lendee's, but not lent until the node has it; one
        # being detached is lent no more (the node is cordoned for it).
        lent = s.lent - s.attaching - s.detaching if s.phase is Phase.LENT else frozenset()
        for gpu in TOPO.lendee_gpus:
            if gpu not in held:
                self.f.free_gs += dt
                self.f.per_gpu_free[gpu] = self.f.per_gpu_free.get(gpu, 0.0) + dt
            if gpu in lent:
                assert gpu not in held, f"{gpu} lent while an owner holds it"
                self.f.lent_gs += dt
                self.f.per_gpu_lent[gpu] = self.f.per_gpu_lent.get(gpu, 0.0) + dt
        if s.regrow_waiting:
            self.f.regrow_waiting_s += dt
        self.no_show_idle -= lent
        self.f.no_show_idle_gs += dt * len(self.no_show_idle - held)

    def measured(self) -> bool:
        return 0.0 <= self.now < WEEK

    # -- the machine and its executor

    def deliver(self, event: Event) -> None:
        try:
            new, actions = step(self.state, event, topo=TOPO, policy=self.policy)
        except IllegalTransition:
            self.f.stale += 1  # a report that went stale: the agent logs it, as here
            return
        self.state = new
        for action in actions:
            self.execute(action)

    def execute(self, action: Action) -> None:
        d, now = self.d, self.now
        match action:
            case ScheduleRelend(at=due):
                self.relend_token += 1
                self.at(max(due, now), self.relend_fires, self.relend_token)
            case CancelRelend():
                self.relend_token += 1
            case StartLendee():
                self.at(now + d.launch, self.lendee_starts)
            case WaitAgent(ticket=t):
                if self.state.phase is Phase.BOOTING:
                    up = self.lendee_started_at + d.boot + d.agent
                else:
                    up = now + d.ping
                self.at(max(up, now), self.deliver, AgentUp(at=max(up, now), ticket=t))
            case AttachGpus(ticket=t, gpus=gpus):
                if self.measured():
                    self.f.hot_adds += 1
                self.at(now + d.hot_add, self.deliver,
                        GpusAttached(at=now + d.hot_add, ticket=t, gpus=gpus))
            case DetachGpus(ticket=t, gpus=gpus):
                if self.measured():
                    self.f.hot_unplugs += 1
                took = (d.drain if self.evict(gpus) else 0.0) + d.hot_unplug
                self.at(now + took, self.deliver,
                        GpusDetached(at=now + took, ticket=t, gpus=gpus))
            case KubeReturn(ticket=t):
                self.at(now + d.kube_return, self.deliver,
                        ReturnDone(at=now + d.kube_return, ticket=t))
            case Drain(ticket=t):
                self.evict()
                self.at(now + d.drain, self.deliver, Drained(at=now + d.drain, ticket=t))
            case ShutdownLendee():
                self.at(now + d.shutdown, self.lendee_stops)
            case StartOwner(owner=o):
                self.owner_launch(o)
            case CompleteIntent():
                pass
            case FailIntent():
                self.f.failed_intents += 1
            case _:
                raise AssertionError(f"the replay has no executor for {action}")

    def relend_fires(self, token: int) -> None:
        if token == self.relend_token:
            self.deliver(RelendDue(at=self.now))

    def lendee_starts(self) -> None:
        self.lendee_started_at = self.now
        self.deliver(LendeeStarted(at=self.now))

    def lendee_stops(self) -> None:
        if self.measured():
            self.f.restarts += 1
        self.deliver(LendeeStopped(at=self.now))

    # -- libvirt and the players

    def owner_launch(self, owner: str) -> None:
        """libvirt starts `owner`: the hook lets it through, it runs a moment later."""
        decision, why = verdict(self.state, owner, topo=TOPO)
        assert decision == "proceed", f"{owner}: {decision}: {why}"
        if self.asked_reserved.get(owner) and self.measured():
            self.f.reserved_gpu_waits.append(self.now - self.asked_at[owner])
        self.deliver(OwnerStarting(at=self.now, owner=owner))
        self.at(self.now + self.d.owner_start, self.owner_runs, owner)

    def owner_runs(self, owner: str) -> None:
        self.owners_up.add(owner)
        waited = self.now - self.asked_at.pop(owner)
        if self.measured():
            self.f.player_waits.append(waited)
            if self.asked_reserved.get(owner):
                self.f.reserved_waits.append(waited)
        self.deliver(OwnerStarted(at=self.now, owner=owner))
        mine = self.reservations.get(owner)
        if mine is not None and mine.holding:
            del self.reservations[owner]  # used
            self.deliver(Reserve(at=self.now, reservations=tuple(self.reservations.values())))

    # -- reservations

    def reservation_notice(self, owner: str, start: float) -> None:
        """The notice, `TIMING.lead` ahead: the eviction's time, from the jobs' grace."""
        r = Reservation(vm=owner, at=start, by="bench", made=self.now)
        evict = plan.evict_time(r, JOB_GRACE, TIMING, self.now)
        self.reservations[owner] = replace(r, evict_at=evict)
        self.at(evict, self.reservation_holds, owner, start)

    def reservation_holds(self, owner: str, start: float) -> None:
        r = self.reservations.get(owner)
        if r is None or r.at != start:
            return
        self.reservations[owner] = replace(r, holding=True)
        if (owner, start) in self.no_show_games:
            self.no_show_idle |= TOPO.owners[owner]
            if self.measured():
                self.f.no_shows += 1
        self.deliver(Reserve(at=self.now, reservations=tuple(self.reservations.values())))

    def reservation_expires(self, owner: str, start: float) -> None:
        """`hostagent.service.reservations`: unused `expiry` after its time, it ends, and the
        GPU is lent again (a hot-add or a regrow, as after a game)."""
        r = self.reservations.get(owner)
        if r is None or r.at != start:
            return
        del self.reservations[owner]
        self.deliver(Reserve(at=self.now, reservations=tuple(self.reservations.values())))

    def player_starts(self, owner: str) -> None:
        self.asked_at[owner] = self.now
        self.asked_reserved[owner] = (owner, self.now) in self.reserved_games
        decision, why = verdict(self.state, owner, topo=TOPO)
        if decision == "proceed":
            self.owner_launch(owner)
        elif decision == "defer":
            self.deliver(OwnerWants(at=self.now, owner=owner, intent_id=f"i{next(self.ids)}",
                                    source=IntentSource.HOOK))
        else:
            raise AssertionError(f"{owner} refused: {why}")

    def player_stops(self, owner: str) -> None:
        self.owners_up.discard(owner)
        self.deliver(OwnerStopped(at=self.now, owner=owner))

    # -- the cluster's GPU jobs

    def job_arrives(self, duration: float) -> None:
        self.pending.append((next(self.ids), duration))

    def start_jobs(self) -> None:
        s, before = self.state, len(self.running)
        if (self.hold_new_jobs and s.regrow_waiting) or s.phase is not Phase.LENT or s.detaching:
            return  # (while a GPU is detached, the node is cordoned)
        # The kubelet gives a job any free GPU (its device manager's set has no order).
        free = sorted(s.lent - s.attaching - {gpu for _, _, gpu in self.running.values()})
        while self.pending and free:
            job, duration = self.pending.popleft()
            gpu = free.pop(self.rng.randrange(len(free)))
            self.running[job] = (self.now + duration, duration, gpu)
            self.at(self.now + duration, self.job_ends, job, self.now + duration)
        # The node watch reports the count when it changes, and first at each lend (the
        # machine knows nothing of this lend's GPU pods until then).
        if len(self.running) != before or (s.phase is Phase.LENT and s.gpu_pods is None):
            self.deliver(GpuPods(at=self.now, count=len(self.running)))

    def job_ends(self, job: int, end: float) -> None:
        if self.running.get(job, (None,))[0] != end:
            return  # evicted since
        _, duration, _ = self.running.pop(job)
        if self.measured():
            self.f.job_hours_done += duration / HOUR
        self.deliver(GpuPods(at=self.now, count=len(self.running)))

    def evict(self, gpus: frozenset[str] | None = None) -> int:
        """A drain (`gpus` None): every running job is evicted, and will start over; a
        hot-unplug: the jobs on `gpus`. How many were."""
        evicted = {job: run for job, run in self.running.items()
                   if gpus is None or run[2] in gpus}
        if not evicted:
            return 0
        if self.measured():
            self.f.killing_restarts += gpus is None
            self.f.jobs_killed += len(evicted)
            wanted = TOPO.gpus_of({i.owner for i in self.state.intents} | self.state.reserved)
            self.f.jobs_killed_elsewhere += sum(run[2] not in wanted for run in evicted.values())
            self.f.gpu_hours_destroyed += sum(
                self.now - (end - duration) for end, duration, _ in evicted.values()) / HOUR
            if not self.state.intents and not self.state.reserved:
                self.f.regrow_kills += 1
                self.f.jobs_killed_by_regrow += len(evicted)
            if not self.state.intents and self.no_show_idle & TOPO.gpus_of(self.state.reserved):
                self.f.no_show_killed += len(evicted)
                self.f.no_show_destroyed_h += sum(
                    self.now - (end - duration) for end, duration, _ in evicted.values()) / HOUR
        for job, (_, duration, _) in sorted(evicted.items(), reverse=True):
            self.pending.appendleft((job, duration))
            del self.running[job]
        left = len(self.running)
        self.at(self.now, self.deliver, GpuPods(at=self.now, count=left))  # the node watch
        return len(evicted)


@dataclass(frozen=True)
class Candidate:
    """A column: the policy, whether the node runs the GPU jobs (the last column is the
    default on a node without GPU work, to tell what waiting for jobs costs), and
    whether no new GPU job starts on the node while a regrow waits (as if the node were
    cordoned for them meanwhile)."""

    name: str
    policy: Policy
    busy: bool = True
    hold_new_jobs: bool = False


WHEN_IDLE = Policy(regrow=Regrow.WHEN_IDLE, regrow_max_wait=None)
CANDIDATES = [
    Candidate("all or nothing", Policy(partial=False)),
    Candidate("partial, always", Policy(regrow=Regrow.ALWAYS)),
    Candidate("when-idle, no limit", WHEN_IDLE),
    Candidate("when-idle ≤ 30 min", replace(WHEN_IDLE, regrow_max_wait=30 * 60)),
    Candidate("when-idle ≤ 30 min, no new jobs", replace(WHEN_IDLE, regrow_max_wait=30 * 60),
              hold_new_jobs=True),
    Candidate("when-idle ≤ 2 min", replace(WHEN_IDLE, regrow_max_wait=2 * 60)),
    Candidate("when-idle ≤ 2 min, no new jobs", replace(WHEN_IDLE, regrow_max_wait=2 * 60),
              hold_new_jobs=True),
    Candidate("partial, never", Policy(regrow=Regrow.NEVER)),
    Candidate("default, hot-add", Policy(hotplug=Hotplug.ADD)),
    Candidate("default, hot-add + hot-unplug", Policy(hotplug=Hotplug.BOTH)),
    Candidate("default, no GPU jobs", Policy(), busy=False),
]
# The agent's default policy, whichever column it is.
DEFAULT = next(c.name for c in CANDIDATES if c.policy == Policy() and c.busy)
WEEKS = range(30)  # the seeds of the weeks the candidates are also compared over


@dataclass
class Weeks:
    """A candidate over the weeks of `WEEKS`: how many met the budget, jobs killed."""

    met: int = 0
    killed: int = 0
    worst_share: float = 1.0


def over_weeks(c: Candidate, d: Durations) -> Weeks:
    out = Weeks()
    for seed in WEEKS:
        f = Replay(c.policy, d, jobs(seed) if c.busy else [], hold_new_jobs=c.hold_new_jobs).run()
        out.met += f.share >= BUDGET
        out.killed += f.jobs_killed
        out.worst_share = min(out.worst_share, f.share)
    return out


# --- varied weeks: no figure above may hang on one week's timing ---------------------

SCHEDULES = ("evenings", "weekends", "random")
VARIED = range(100, 160)  # the seeds of the varied weeks
SPREAD = 0.5  # each step's duration strays by up to ±50 % at each occurrence


def _games(kind: str, rng: random.Random) -> list[tuple[float, float, str]]:
    """Games from the warm-up Sunday to the week's end, each owner's never overlapping:
    ``evenings``, most evenings from 18-21 h for 1-3 h; ``weekends``, long afternoons on
    Saturday and Sunday and a rare weekday evening; ``random``, 0-3 games a day at any
    hour, a quarter of an hour to 4 hours each."""
    out: list[tuple[float, float, str]] = []
    for owner in sorted(TOPO.owners):
        for day in range(-1, 7):
            base, weekend = day * DAY, day in (-1, 5)
            if kind == "evenings" and rng.random() < 0.8:
                start = base + rng.uniform(18, 21) * HOUR
                out.append((start, start + rng.uniform(1, 3) * HOUR, owner))
            elif kind == "weekends" and (weekend or rng.random() < 0.15):
                start = base + (rng.uniform(9, 15) if weekend else rng.uniform(19, 21)) * HOUR
                out.append((start, start + rng.uniform(3, 8 if weekend else 2) * HOUR, owner))
            elif kind == "random":
                t = base
                for _ in range(rng.randint(0, 3)):
                    t += rng.uniform(0.5, 6) * HOUR
                    end = t + rng.uniform(0.25, 4) * HOUR
                    out.append((t, end, owner))
                    t = end
    return sorted(g for g in out if g[0] < WEEK)


def _work(rng: random.Random) -> list[tuple[float, float]]:
    """GPU jobs: one every 1-6 h on average, short (15 min-1 h), medium (1-3 h) or long
    (2-12 h) — one kind a week."""
    every = rng.uniform(1, 6) * HOUR
    low, high = rng.choice([(0.25, 1.0), (1.0, 3.0), (2.0, 12.0)])
    out, t = [], -WARMUP
    while (t := t + rng.expovariate(1 / every)) < WEEK:
        out.append((t, rng.uniform(low, high) * HOUR))
    return out


@dataclass
class Spread:
    """A candidate over the varied weeks."""

    shares: list[float] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    killed_elsewhere: int = 0
    destroyed: list[float] = field(default_factory=list)  # GPU-hours a week
    waits: list[float] = field(default_factory=list)
    reserved_gpu_waits: list[float] = field(default_factory=list)
    reserved_waits: list[float] = field(default_factory=list)
    no_shows: int = 0
    no_show_idle_h: float = 0.0
    no_show_killed: int = 0
    no_show_destroyed: float = 0.0  # GPU-hours

    @staticmethod
    def quantile(xs: Sequence[float], q: float) -> float:
        ordered = sorted(xs)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def varied_week(seed: int) -> tuple[str, list[tuple[float, float, str]], list[tuple[float, float]]]:
    rng = random.Random(seed)
    kind = SCHEDULES[seed % len(SCHEDULES)]
    return kind, _games(kind, rng), _work(rng)


def over_varied(c: Candidate, d: Durations, *, reserved: float = 0.0,
                no_show: float = 0.0) -> Spread:
    out = Spread()
    for seed in VARIED:
        _, games, work = varied_week(seed)
        f = Replay(c.policy, d, work if c.busy else [], hold_new_jobs=c.hold_new_jobs,
                   games=games, spread=SPREAD, seed=seed, reserved=reserved,
                   no_show=no_show).run()
        out.no_shows += f.no_shows
        out.no_show_idle_h += f.no_show_idle_gs / HOUR
        out.no_show_killed += f.no_show_killed
        out.no_show_destroyed += f.no_show_destroyed_h
        out.shares.append(f.share)
        out.killed.append(f.jobs_killed)
        out.killed_elsewhere += f.jobs_killed_elsewhere
        out.destroyed.append(f.gpu_hours_destroyed)
        out.waits += f.player_waits
        out.reserved_gpu_waits += f.reserved_gpu_waits
        out.reserved_waits += f.reserved_waits
    return out


# Reservations over the varied weeks: this share of the games is reserved ahead, for the
# two defaults (a lendee that cannot hot-plug, and one that can).
RESERVED = 0.5
# And this share of the reserved games is never played (a no-show): the reclaim happens,
# the GPU is held until the reservation expires, then lent again.
NO_SHOW = 0.2
GOAL_RESERVED_WAIT = 0.0  # the reserved player waits for no GPU


def reservations_table(plain: dict[str, Spread], reserved: dict[str, Spread],
                       absent: dict[str, Spread]) -> list[list[str]]:
    def pct(x: float) -> str:
        return f"{100 * x:.2f} %"

    def row(name: str, fn: Callable[[Spread, Spread], str]) -> list[str]:
        return [name, *(fn(plain[n], reserved[n]) for n in reserved)]

    q = Spread.quantile
    return [
        [f"varied weeks, {100 * RESERVED:.0f} % of games reserved "
         f"(notice {TIMING.lead / 60:.0f} min ahead)", *reserved],
        row("lent share: median, without → with reservations",
            lambda p, r: f"{pct(q(p.shares, 0.5))} → {pct(q(r.shares, 0.5))}"),
        row("lent share: 10th percentile, without → with",
            lambda p, r: f"{pct(q(p.shares, 0.1))} → {pct(q(r.shares, 0.1))}"),
        row("what the gentle reclaim costs: lent share, mean over the weeks",
            lambda p, r: f"{100 * (sum(p.shares) - sum(r.shares)) / len(p.shares):.2f} points"),
        row("reserved player's wait for the GPU (asked → libvirt starts it): median / worst",
            lambda p, r: f"{q(r.reserved_gpu_waits, 0.5):.0f} s / "
                         f"{max(r.reserved_gpu_waits):.0f} s"),
        row("reserved player's wait to a running VM: median / worst",
            lambda p, r: f"{q(r.reserved_waits, 0.5):.0f} s / {max(r.reserved_waits):.0f} s"),
        row("every player's wait: median / worst, without → with",
            lambda p, r: f"{q(p.waits, 0.5):.0f} s / {max(p.waits):.0f} s → "
                         f"{q(r.waits, 0.5):.0f} s / {max(r.waits):.0f} s"),
        row("GPU jobs killed, all weeks: without → with",
            lambda p, r: f"{sum(p.killed)} → {sum(r.killed)}"),
        row("GPU-hours destroyed, all weeks: without → with",
            lambda p, r: f"{sum(p.destroyed):.1f} h → {sum(r.destroyed):.1f} h"),
        row(f"goal: a reserved player waits {GOAL_RESERVED_WAIT:.0f} s for the GPU",
            lambda p, r: "met" if max(r.reserved_gpu_waits) <= GOAL_RESERVED_WAIT
            else "MISSED"),
        [f"no-shows: {100 * NO_SHOW:.0f} % of the reserved games never played "
         f"(held until the expiry, {TIMING.expiry / 60:.0f} min after the time)",
         *(str(absent[n].no_shows) for n in reserved)],
        ["  GPU-hours neither played nor lent, per no-show (its hold to the lend after)",
         *(f"{absent[n].no_show_idle_h / max(1, absent[n].no_shows):.2f} h" for n in reserved)],
        ["  lent share: median, every reserved game played → with no-shows",
         *(f"{pct(q(reserved[n].shares, 0.5))} → {pct(q(absent[n].shares, 0.5))}"
           for n in reserved)],
        ["  lent share: 10th percentile, every reserved game played → with no-shows",
         *(f"{pct(q(reserved[n].shares, 0.1))} → {pct(q(absent[n].shares, 0.1))}"
           for n in reserved)],
        ["  GPU jobs killed for no-shows, all weeks (GPU-hours of their work destroyed)",
         *(f"{absent[n].no_show_killed} ({absent[n].no_show_destroyed:.1f} h)"
           for n in reserved)],
    ]


# Goals of the default over the varied weeks.
GOAL_MEDIAN, GOAL_P10, GOAL_WAIT = 0.995, 0.99, 20.0


def meets(s: Spread) -> bool:
    return (s.quantile(s.shares, 0.5) >= GOAL_MEDIAN and s.quantile(s.shares, 0.1) >= GOAL_P10
            and s.quantile(s.waits, 0.5) <= GOAL_WAIT)


def winner(spreads: dict[str, Spread], busy: dict[str, bool]) -> str | None:
    """Of the candidates that meet the goals, the one that destroys the least work, then
    kills the fewest jobs, then makes players wait least."""
    def cost(name: str) -> tuple[float, int, float]:
        s = spreads[name]
        return sum(s.destroyed), sum(s.killed), s.quantile(s.waits, 0.5)

    return min((n for n, s in spreads.items() if busy[n] and meets(s)), default=None, key=cost)


def varied_table(spreads: dict[str, Spread]) -> list[list[str]]:
    def pct(x: float) -> str:
        return f"{100 * x:.2f} %"

    def row(name: str, fn: Callable[[Spread], str]) -> list[str]:
        return [name, *(fn(s) for s in spreads.values())]

    n = len(VARIED)
    return [
        [f"varied weeks ({n})", *spreads],
        row("lent share: median", lambda s: pct(s.quantile(s.shares, 0.5))),
        row("lent share: 10th percentile", lambda s: pct(s.quantile(s.shares, 0.1))),
        row("lent share: worst", lambda s: pct(min(s.shares))),
        row("GPU jobs killed a week: median / worst",
            lambda s: f"{s.quantile(s.killed, 0.5):.0f} / {max(s.killed)}"),
        row("  of those, on a GPU no game wanted (all weeks)", lambda s: str(s.killed_elsewhere)),
        row("GPU-hours of work destroyed a week: median / worst",
            lambda s: f"{s.quantile(s.destroyed, 0.5):.1f} h / {max(s.destroyed):.1f} h"),
        row("player's wait: median / worst",
            lambda s: f"{s.quantile(s.waits, 0.5):.0f} s / {max(s.waits):.0f} s"),
        row(f"goals: median ≥ {100 * GOAL_MEDIAN:.1f} %, 10th ≥ {100 * GOAL_P10:.0f} %, "
            f"wait ≤ {GOAL_WAIT:.0f} s", lambda s: "met" if meets(s) else "MISSED"),
    ]


def table(results: dict[str, Figures], weeks: dict[str, Weeks],
          partial: dict[str, bool]) -> list[list[str]]:
    def pct(x: float) -> str:
        return f"{100 * x:.2f} %"

    def row(name: str, fn: Callable[[Figures], str]) -> list[str]:
        return [name, *(fn(f) for f in results.values())]

    def lent_of(gpu: str) -> Callable[[Figures], str]:
        return lambda f: pct(f.per_gpu_lent.get(gpu, 0) / f.per_gpu_free[gpu])

    n = len(WEEKS)
    rows = [
        ["per week", *results],
        row("lent share (GPU-s lent ÷ GPU-s no owner holds)", lambda f: pct(f.share)),
        *(row(f"  of {gpu} ({', '.join(owners) or 'owned by nobody'})",
              lent_of(gpu))
          for gpu in sorted(TOPO.lendee_gpus)
          for owners in [[o for o, gs in TOPO.owners.items() if gpu in gs]]),
        row("GPU-hours not lent (of those no owner holds)",
            lambda f: f"{(f.free_gs - f.lent_gs) / HOUR:.1f} h of {f.free_gs / HOUR:.0f} h"),
        row("lendee restarts", lambda f: str(f.restarts)),
        row("restarts that killed a running GPU job",
            lambda f: f"{f.killing_restarts} ({f.regrow_kills} by a regrow)"),
        row("GPU jobs killed in all (each starts over)", lambda f: str(f.jobs_killed)),
        row("  of those, by a game's reclaim / by a regrow",
            lambda f: f"{f.jobs_killed - f.jobs_killed_by_regrow} / {f.jobs_killed_by_regrow}"),
        row("regrows by hot-add (no drain, no restart)", lambda f: str(f.hot_adds)),
        row("reclaims by hot-unplug (no drain, no restart)", lambda f: str(f.hot_unplugs)),
        row("GPU-job hours completed", lambda f: f"{f.job_hours_done:.1f} h"),
        row("a regrow waiting for the node to be idle",
            lambda f: f"{f.regrow_waiting_s / HOUR:.1f} h"),
        row("longest wait of a player", lambda f: f"{max(f.player_waits):.0f} s"),
        row("requests failed", lambda f: str(f.failed_intents)),
        ["budget: lent share ≥ 99 %",
         *(("met" if f.share >= BUDGET else "MISSED") if partial[name] else "—"
           for name, f in results.items())],
        [f"{n} weeks (seeds {WEEKS.start}-{WEEKS.stop - 1}): budget met",
         *(f"{w.met} of {n}" if partial[name] else "—" for name, w in weeks.items())],
        [f"{n} weeks: worst lent share",
         *(pct(w.worst_share) for w in weeks.values())],
        [f"{n} weeks: GPU jobs killed, mean per week",
         *(f"{w.killed / n:.1f}" for w in weeks.values())],
    ]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", type=Path, help="append the table to this file")
    ap.add_argument("--seed", type=int, default=14, help="of the GPU jobs' arrivals")
    opts = ap.parse_args()
    d, work = Durations(), jobs(opts.seed)
    results = {c.name: Replay(c.policy, d, work if c.busy else [],
                              hold_new_jobs=c.hold_new_jobs).run() for c in CANDIDATES}
    weeks = {c.name: over_weeks(c, d) for c in CANDIDATES}
    share = results[DEFAULT].share
    ok = share >= BUDGET and weeks[DEFAULT].met == len(WEEKS)
    verdict_line = (f"budget: the default ({DEFAULT}) lends ≥ {100 * BUDGET:.0f} % of the GPU "
                    f"time no game uses: {'met' if ok else 'MISSED'} ({100 * share:.2f} %; "
                    f"{weeks[DEFAULT].met} of {len(WEEKS)} weeks)")
    rows = table(results, weeks, {c.name: c.policy.partial for c in CANDIDATES})
    spreads = {c.name: over_varied(c, d) for c in CANDIDATES}
    kinds = [varied_week(seed)[0] for seed in VARIED]
    varied = varied_table(spreads)
    best = winner(spreads, {c.name: c.busy for c in CANDIDATES})
    varied_line = (f"varied weeks ({', '.join(f'{kinds.count(k)} {k}' for k in SCHEDULES)}; "
                   f"every step ±{100 * SPREAD:.0f} %; jobs of 15 min-12 h): the default "
                   f"({DEFAULT}) {'meets' if meets(spreads[DEFAULT]) else 'MISSES'} the goals; "
                   f"the candidate that meets them and destroys the least work: "
                   f"{best or 'none'}")
    both = [DEFAULT, "default, hot-add + hot-unplug"]
    named = {c.name: c for c in CANDIDATES}
    reserving = {n: over_varied(named[n], d, reserved=RESERVED) for n in both}
    absent = {n: over_varied(named[n], d, reserved=RESERVED, no_show=NO_SHOW) for n in both}
    booked = reservations_table({n: spreads[n] for n in both}, reserving, absent)
    for table_rows in (rows, varied, booked):
        widths = [max(len(r[i]) for r in table_rows) for i in range(len(table_rows[0]))]
        for r in table_rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        print()
    print(verdict_line)
    print(varied_line)
    if opts.markdown:
        jobs_note = (f"{len(work)} single-GPU jobs of 1-3 h, one every 2-6 h "
                     f"(seed {opts.seed})")
        with opts.markdown.open("a") as f:
            f.write(f"\n| capacity: {' | '.join(rows[0])} |\n")
            f.write("|---" * len(rows[0]) + "|\n")
            f.writelines(f"| {' | '.join(r)} |\n" for r in rows[1:])
            f.write(f"\nCapacity: a reference week replayed through the machine "
                    f"(bench/capacity.py); GPU work on the node: {jobs_note}; {verdict_line}.\n")
            f.write(f"\n| capacity: {' | '.join(varied[0])} |\n")
            f.write("|---" * len(varied[0]) + "|\n")
            f.writelines(f"| {' | '.join(r)} |\n" for r in varied[1:])
            f.write(f"\nCapacity, {varied_line}.\n")
            f.write(f"\n| capacity: {' | '.join(booked[0])} |\n")
            f.write("|---" * len(booked[0]) + "|\n")
            f.writelines(f"| {' | '.join(r)} |\n" for r in booked[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
