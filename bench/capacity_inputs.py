"""The capacity model's inputs: how long each step takes, and the weeks it is tried on.

Every step's duration is a distribution with its source beside it: the literature
(upstream defaults and documented behaviour), the issue's realistic figures for a real
host, and the lab's own journal (`duration_ms` of each phase record,
`hostagent.service.recorder`; bench/RESULTS.md "the partial swap"), which is a lower
bound: its guests run busybox under TCG, with no GPU driver, no k3s and no device to
reset. Each occurrence of a step draws once (`Draws.take`): the event that ends it is
scheduled and stamped with that one reading.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

HOUR = 3600.0
DAY = 24 * HOUR
WEEK = 7 * DAY
WARMUP = DAY  # the Sunday before Monday 00:00 (time 0), replayed the same way

# Kubernetes' default terminationGracePeriodSeconds (core/v1 PodSpec): a pod that
# ignores SIGTERM is killed by the kubelet at its end, and only then is it gone.
JOB_GRACE = 30.0
# hostagent.service.hotplug.DETACH_BOUND: a detach that fails is known at the latest then.
DETACH_BOUND = 30.0
# The share of GPU jobs whose pod ignores SIGTERM. A container's first process is its
# PID namespace's init, to which the kernel sends only the signals it handles
# (pid_namespaces(7)); `python train.py` installs no SIGTERM handler, so a plain
# training script ignores it until SIGKILL. Launchers that forward it exist
# (torchrun): half is taken, no survey behind it.
IGNORES_SIGTERM = 0.5


@dataclass(frozen=True)
class Dist:
    """A duration in seconds: `floor` plus a log-normal part of median `median - floor`
    and shape `sigma`; with probability `tail_p` the step takes `tail` instead."""

    median: float
    sigma: float = 0.0
    floor: float = 0.0
    tail_p: float = 0.0
    tail: float = 0.0
    source: str = field(default="", compare=False)

    def draw(self, rng: random.Random) -> float:
        if self.tail_p and rng.random() < self.tail_p:
            return self.tail
        return self.floor + (self.median - self.floor) * math.exp(self.sigma * rng.gauss(0, 1))


@dataclass(frozen=True)
class Durations:
    """Each step of a swap on a real host."""

    launch: Dist = Dist(1.0, 0.2, source="libvirt's start of the lendee up to its STARTED "
                        "event (the lab: under a second)")
    boot: Dist = Dist(20.0, 0.25, source="the lendee's start to its guest agent answering: "
                      "the seeds' GPU node 'started in twenty-four seconds'; with the return "
                      "below the issue's ~45 s to node Ready (the lab's busybox guest: 2.2 s)")
    kube_return: Dist = Dist(25.0, 0.3, floor=10.0, source="the agent answering to the node "
                             "Ready with every GPU allocatable: k3s's agent starts, the kubelet "
                             "posts status every 10 s (nodeStatusUpdateFrequency), the NVIDIA "
                             "device plugin registers after NVML initialised its cards (the "
                             "lab, no k3s nor NVML: 2.2 s)")
    ping: Dist = Dist(1.0, 0.2, source="guest-ping of an agent already up")
    drain_idle: Dist = Dist(2.0, 0.3, source="evictions of pods that exit on SIGTERM, or of "
                            "none: the lab's journal, DRAINING 1.0-1.3 s median with three pods "
                            "behind a PodDisruptionBudget (bench/RESULTS.md), and the issue's "
                            "2 s on an idle node")
    drain_tail: Dist = Dist(2.0, 0.3, source="after a pod's grace period: the kubelet's SIGKILL, "
                            "its status and the pod's deletion seen (hostagent.cluster.drain "
                            "reads each second as kubectl drain does, and at a watch's event); "
                            "30 s grace + this is the issue's 32 s")
    accept: Dist = Dist(0.3, 0.3, source="virsh start to the evictions accepted by the API "
                        "server: the lab, 131 ms median to the first (bench/RESULTS.md)")
    shutdown: Dist = Dist(30.0, 0.3, tail_p=0.05, tail=90.0, source="a k3s guest's "
                          "shutdown through its agent, ~30 s (the issue); 1 in 20 waits "
                          "systemd's DefaultTimeoutStopSec, 90 s, for a containerd shim left "
                          "by k3s's KillMode=process (k3s-io/k3s#2400, containerd#5502)")
    power_off: Dist = Dist(3.0, 0.3, source="drain.stop = \"power-off\": the guest agent's "
                           "freeze of a drained node's filesystems (a sync of what the kubelet "
                           "and containerd still hold, taken as ~1 s: the lab's initramfs "
                           "freezes none), then virsh destroy: QEMU's exit and VFIO's reset of "
                           "the released card, ~2 s")
    owner_start: Dist = Dist(8.0, 0.3, floor=4.0, source="libvirt starting a passthrough game "
                             "VM up to its vCPUs running: VFIO pins all its memory and resets "
                             "the card first; ~8 s (the issue; the lab's 0.35 s resets no "
                             "device)")
    hot_add: Dist = Dist(30.0, 0.3, floor=10.0, source="attach (<1 s, tests/lab/"
                         "test_hotplug_lab.py), the NVIDIA driver's probe, the device plugin's "
                         "pod restarted by its DaemonSet and registering, the kubelet's next "
                         "status (10 s)")
    unplug: Dist = Dist(8.0, 0.3, floor=2.0, source="the plugins paused, the NVIDIA driver's "
                        "unbind and the slot's power-off: ~8 s (the issue; the lab's 1.5 s "
                        "unbinds no driver). NVIDIA does not support hot-unplug: hence the "
                        "fallback rate")


class Draws:
    """One reading of a step's duration per occurrence, from a seeded generator."""

    def __init__(self, d: Durations, rng: random.Random) -> None:
        self.d, self.rng = d, rng

    def take(self, step: str) -> float:
        dist: Dist = getattr(self.d, step)
        return dist.draw(self.rng)


# --- the weeks ---------------------------------------------------------------------------

OWNERS = ("gaming1", "gaming2")
SCHEDULES = ("evenings", "weekends", "random", "co-op")
BANDS = ("light", "medium", "saturated")
Game = tuple[float, float, str]  # start, end, owner
Job = tuple[float, float, bool]  # arrival, duration, ignores SIGTERM


def games(kind: str, rng: random.Random) -> list[Game]:
    """Games from the warm-up Sunday to the week's end, each owner's never overlapping:
    ``evenings``, most evenings from 18-21 h for 1-3 h; ``weekends``, long afternoons on
    Saturday and Sunday and a rare weekday evening; ``random``, 0-3 games a day at any
    hour, a quarter of an hour to 4 hours each; ``co-op``, most evenings both players,
    the second within two minutes of the first."""
    out: list[Game] = []
    for day in range(-1, 7):
        base, weekend = day * DAY, day in (-1, 5)
        if kind == "co-op" and rng.random() < 0.8:
            first = base + rng.uniform(18, 21) * HOUR
            second = first + rng.uniform(0, 120)
            out += [(first, first + rng.uniform(1, 3) * HOUR, "gaming1"),
                    (second, second + rng.uniform(1, 3) * HOUR, "gaming2")]
        for owner in OWNERS:
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


def work(band: str, rng: random.Random) -> list[Job]:
    """The cluster's single-GPU jobs: ``light``, one every 4-8 h on average of 15 min-2 h
    (the three GPUs busy ~6 % of the time); ``medium``, one every 1-2 h of 1-3 h (~45 %);
    ``saturated``, one every 15-30 min of 1-6 h (more than three GPUs can take: the
    queue never empties)."""
    every, low, high = {"light": ((4, 8), 0.25, 2.0), "medium": ((1, 2), 1.0, 3.0),
                        "saturated": ((0.25, 0.5), 1.0, 6.0)}[band]
    mean = rng.uniform(*every) * HOUR
    out: list[Job] = []
    t = -WARMUP
    while (t := t + rng.expovariate(1 / mean)) < WEEK:
        out.append((t, rng.uniform(low, high) * HOUR, rng.random() < IGNORES_SIGTERM))
    return out


@dataclass(frozen=True)
class Week:
    kind: str
    band: str
    seed: int
    games: tuple[Game, ...]
    work: tuple[Job, ...]
    history: tuple[Game, ...]  # the three weeks before, of the same habits


def week(kind: str, band: str, seed: int) -> Week:
    rng = random.Random(f"{kind}/{band}/{seed}")
    played = games(kind, rng)
    jobs = work(band, rng)
    past = random.Random(f"{kind}/{seed}/history")
    history = [(s - n * WEEK, e - n * WEEK, o) for n in (1, 2, 3) for s, e, o in games(kind, past)]
    return Week(kind, band, seed, tuple(played), tuple(jobs), tuple(history))


# Pre-cordon (a lever): an owner's usual start, learnt from its history, is the median
# time of day of its starts when at least half the days saw one within an hour of it;
# its lendee is cordoned from LEAD before it to AFTER past it, or until the owner starts.
PRECORDON_LEAD, PRECORDON_AFTER = 30 * 60.0, 30 * 60.0


def usual_start(history: tuple[Game, ...], owner: str) -> float | None:
    """The owner's usual start, seconds after midnight, or None when it has none."""
    starts = sorted(s % DAY for s, _, o in history if o == owner)
    if not starts:
        return None
    median = starts[len(starts) // 2]
    days = {int(s // DAY) for s, _, o in history
            if o == owner and abs(s % DAY - median) <= HOUR}
    return median if len(days) >= 0.5 * 3 * 7 else None


def precordon_windows(history: tuple[Game, ...], owner: str) -> list[tuple[float, float]]:
    usual = usual_start(history, owner)
    if usual is None:
        return []
    return [(day * DAY + usual - PRECORDON_LEAD, day * DAY + usual + PRECORDON_AFTER)
            for day in range(-1, 7)]
