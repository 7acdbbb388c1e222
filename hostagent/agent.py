"""The service: wires libvirt, the hook and control sockets and the cluster to the machine.

Everything that happens becomes an `Event` applied by `Agent.apply`, on the event loop
thread, one at a time: the pure `machine.step` decides, the agent persists what must
survive a crash, writes one journal record per transition, and runs the actions as
tasks. Each task reports back with another event. The loop itself never blocks:
libvirt calls run in worker threads (see `libvirt_host`), so the hook socket is
answered while libvirtd is busy starting the VM whose hook is asking.

Level-triggered: at start and after every libvirt reconnect the agent reads which
VMs run and hands that to the machine (`Observed`); events only wake it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import random
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from hostagent import health, journal, machine, metrics, state as persisted
from hostagent import devices, lint, screenshots, verify as in_guest
from hostagent.backoff import keep_trying
from hostagent.config import Config
from hostagent.config import VerifyMethod
from hostagent.control import Reply, VerbHandler, current_caller, serve_control
from hostagent.inbox import HookEvent, Inbox, Verdict, replay_spool, serve_hooks
from hostagent.libvirt_host import DomainNotFound, HookRefused, HostError, Libvirt, Lifecycle
from hostagent.lock import AlreadyRunning, lock_agent
from hostagent.model import (
    Action,
    AgentTimeout,
    AgentUp,
    CancelIntent,
    CancelRelend,
    CompleteIntent,
    Drain,
    Drained,
    DrainFailed,
    Event,
    FailIntent,
    ForceOff,
    GpuPods,
    Hold,
    Intent,
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
    Reclaim,
    Regrow,
    RelendDue,
    Resume,
    ReturnDone,
    ReturnFailed,
    ScheduleRelend,
    ShutdownLendee,
    ShutdownTimeout,
    StartFailed,
    StartLendee,
    StartOwner,
    State,
    Topology,
    WaitAgent,
)

log = logging.getLogger("hostagent")


class StartupError(Exception):
    """The agent cannot start; the message says what is wrong and how to fix it."""


class Cluster(Protocol):
    """The Kubernetes steps of a cycle. Without a [kubernetes] section: `NoCluster`."""

    async def reclaim(self, owners: list[str]) -> str | None:
        """Cordon and drain; None when done, or why the reclaim must be aborted."""

    async def give_back(self, lent: Collection[str]) -> str | None:
        """Wait Ready and the `lent` GPUs, uncordon; None when done, or why the node
        stays cordoned."""

    async def lendee_down(self, *, why: str) -> None:
        """Cordon (as ours) the node of a lendee that went down, whatever stopped it."""

    async def watch_lent(self, on_view: Callable[[Any], None] | None = None) -> None:
        """Follow the lent node until cancelled; `on_view` gets each change."""


class NoCluster:
    async def reclaim(self, owners: list[str]) -> str | None:
        return None

    async def give_back(self, lent: Collection[str]) -> str | None:
        return None

    async def lendee_down(self, *, why: str) -> None:
        return None

    async def watch_lent(self, on_view: Callable[[Any], None] | None = None) -> None:
        return None


def topology(cfg: Config) -> Topology:
    return Topology(lendee=cfg.lendee.domain, lendee_gpus=frozenset(cfg.lendee.gpus),
                    owners={d: frozenset(o.gpus) for d, o in cfg.owners.items()})


def _now() -> float:
    # Wall time: intents are persisted with it and must age correctly across restarts.
    return time.time()


# Of the hook's 0.3 s budget for an answer: the rest is its own start and the exchange.
HOOK_SAVE_BUDGET = 0.15


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _host_stopping() -> bool:
    """Whether the host is shutting down (systemd says "stopping"), as opposed to only
    hostagent being stopped or restarted."""
    try:
        out = subprocess.run(["systemctl", "is-system-running"], capture_output=True,
                             text=True, timeout=2, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "stopping"


async def _await(task: asyncio.Task[None]) -> None:
    await task


def _persisted(state: State) -> tuple[object, ...]:
    """What of a state goes to the state file (a change of it is saved)."""
    return (state.intents, state.phase, state.hold, state.relend_at, state.reclaiming)


class Agent:
    def __init__(self, cfg: Config, *, cluster: Cluster | None = None) -> None:
        self.cfg = cfg
        self.topo = topology(cfg)
        regrow = Regrow(cfg.policy.regrow.value)
        if cfg.kubernetes is None and regrow is Regrow.WHEN_IDLE:
            regrow = Regrow.ALWAYS  # nothing can tell whether a GPU job runs on the node
        self.policy = Policy(relend_delay=cfg.policy.relend_delay,
                             force_off=cfg.policy.force_off_after is not None,
                             partial=cfg.policy.partial, min_gpus=cfg.lendee.min_gpus,
                             regrow=regrow)
        self.cluster: Cluster = cluster or NoCluster()
        self.cluster_given = cluster is not None
        self.lendee = cfg.lendee.domain
        self.state = State()
        self.phase_since = _now()
        self.cordoned_by_us = False
        self.started_at = _now()
        self.boot_id = _boot_id()
        self.host_booted = False  # this is the agent's first start since the host booted
        self.libvirt = Libvirt(cfg.libvirt_uri, on_lifecycle=self._lifecycle,
                               on_reconnect=self._reconnected)
        self._tasks: set[asyncio.Task[None]] = set()
        # The lendee's steps, by the ticket of the phase that started them: a step is
        # cancelled, and awaited, when its phase ends (see _supervise).
        self._steps: dict[asyncio.Task[None], int] = {}
        # Why the last state save failed (None: saved); retried until it works.
        self._save_failed: str | None = None
        self._save_retry: asyncio.TimerHandle | None = None
        self._relend: asyncio.TimerHandle | None = None
        self._stopped: dict[str, asyncio.Event] = {}
        # Set when libvirt sees the lendee's qemu-ga connect: wakes the guest-ping wait.
        self._agent_connected = asyncio.Event()
        # Control clients following progress (play, release, reclaim): see _progress.
        self._followers: set[asyncio.Queue[Reply]] = set()
        self._fatal: asyncio.Future[BaseException] | None = None
        self.metrics = metrics.Metrics(self.topo)
        self._exporter: asyncio.Server | None = None
        self._endpoint: Any = None  # the SSH endpoint's server, once bound
        # Checks of real things, not "the process runs" (see hostagent.health).
        self.health = health.Health()
        self.health.add("libvirt", health.libvirt_alive(self.libvirt))
        self.health.add("hook socket", health.socket_answers(cfg.hook_socket, "hook socket"))
        self.health.add("last lend verified", self.metrics.lend_verified)
        self.health.add("state file", self._state_saved)

    # ---- the one place where state changes -----------------------------------------
    def apply(self, event: Event) -> bool:
        """Step the machine; persist, journal and act. False if the event was stale."""
        try:
            new, actions = machine.step(self.state, event, topo=self.topo, policy=self.policy)
        except machine.IllegalTransition as e:
            log.debug("ignored: %s", e)
            return False
        old = self.state
        # A hook waits for its answer a fraction of a second: its request gets that long
        # to be on disk (a busy disk must not make the hook give up and spool it).
        within = HOOK_SAVE_BUDGET if isinstance(event, OwnerWants) and (
            event.source is IntentSource.HOOK) else None
        if _persisted(old) != _persisted(new) and not self._save(new, within=within) and (
                isinstance(event, OwnerWants)):
            # A request is taken only once it is on disk (invariant 4); a fact is taken
            # whatever the disk says, and its save is retried.
            return False
        self.state = new
        self.metrics.transition(old, new, event)
        for intent in new.intents:
            if intent not in old.intents:
                self._record_intent(intent)
        if old.phase is not new.phase:
            self._record_phase(old, new, event)
        if old.ticket != new.ticket:
            self._supervise(new.ticket)
        if new.phase is Phase.LENT and old.phase is not Phase.LENT:
            # A step of LENT: it ends with the phase (see _supervise).
            self._spawn(self.cluster.watch_lent(on_view=self._node_view), ticket=new.ticket)
        if new.phase is Phase.OFF and old.phase not in (Phase.OFF, Phase.DRAINING,
                                                        Phase.STOPPING):
            # Down, and not by a reclaim (which cordoned it): a crash, a shutdown by
            # hand. Cordoned now, so that its return is verified before it takes work.
            self._spawn(self.cluster.lendee_down(why=f"{self.lendee} stopped"))
        if new.regrow_waiting and not old.regrow_waiting:
            more = self._gpu_names(machine.free_gpus(new, self.topo, self.policy) - new.lent)
            journal.record("regrow", f"{self.lendee} could take {more} too, but "
                           f"{new.gpu_pods} pod(s) on its node request a GPU: it restarts "
                           "once none does (policy.regrow = when-idle)", vm=self.lendee,
                           result="waiting")
        for action in actions:
            self._execute(action)
        if old.phase is not new.phase or old.intents != new.intents:
            journal.notify(self._status_line())
        return True

    # ---- start-up --------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._fatal = loop.create_future()
        try:
            lock = lock_agent(self.cfg.state_dir / "agent.lock")
        except AlreadyRunning as e:
            raise StartupError(str(e)) from e
        except OSError as e:
            raise StartupError(f"{self.cfg.source}: state_dir: cannot lock "
                               f"{self.cfg.state_dir / 'agent.lock'}: {e.strerror or e}") from e
        try:
            await self._run(loop)
        finally:
            lock.release()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._load()
        await self.libvirt.connect()
        await self._check_domains()
        kube = await self._connect_cluster()
        # Reality first: until the machine knows what runs, its verdicts would be guesses.
        await self._observe()
        if not self.state.phase.lendee_running:
            # Off at start (a host reboot, a crash while the agent was down): its node
            # must not take work before the next lend is verified.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cluster.lendee_down(
                    why=f"{self.lendee} was found off at start"), 15)
        if self.host_booted:
            self._start_at_boot()
        inbox = Inbox(self._on_hook)
        # What happened while the agent was down comes before anything live; a hook that
        # spooled in the moment before the socket existed is picked up by the second pass.
        replayed = await replay_spool(self.cfg.spool_dir, inbox, log=log)
        hooks = await serve_hooks(self.cfg.hook_socket, inbox, log=log)
        control = await serve_control(self.cfg.control_socket, self._verbs(), log=log,
                                      **self._control_access())
        try:
            replayed += await replay_spool(self.cfg.spool_dir, inbox, log=log)
            await self._serve_ssh()
            await self._serve_metrics()
            if replayed:
                log.info("replayed %d hook event(s) spooled while the agent was down", replayed)
            journal.record("agent", f"hostagent is running: {self._status_line()}",
                           result="ready")
            journal.notify(self._status_line(), ready=True)
            watchdog = journal.watchdog_interval()
            if watchdog:
                self._spawn(self._watchdog(watchdog / 2))
            assert self._fatal is not None
            raise await self._fatal
        finally:
            if self.host_stopping():
                await self._drain_for_shutdown()
            flush = getattr(self.cluster, "flush_events", None)
            if flush is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(flush(), 5)
            hooks.close()
            if self._exporter is not None:
                self._exporter.close()
            control.close()
            if self._endpoint is not None:
                self._endpoint.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.libvirt.close()
            if kube is not None:
                await kube.close()

    async def _connect_cluster(self) -> Any:
        """The Kubernetes adapter, if configured: a bad kubeconfig or an unknown node
        stops the agent with the fix; an API server that is down only delays steps."""
        if self.cfg.kubernetes is None or self.cluster_given:
            return None
        from hostagent.cluster import KubeCluster
        from hostagent.kube import Kube, KubeAuthError, KubeConfigError, KubeUnavailable, Timing
        try:
            kube = await Kube.from_config(
                self.cfg.kubernetes, timing=Timing(evict_retry=self.cfg.kubernetes.evict_retry))
        except KubeConfigError as e:
            raise StartupError(f"{self.cfg.source}: kubernetes.kubeconfig: {e}") from e
        try:
            check = await kube.check_node(self.cfg.lendee.node, timeout=10)
            if not check.exists:
                # Not fatal: a node deleted while its VM was off registers again when
                # the lendee starts, and only a lend starts it.
                log.warning("%s; it registers again when %s starts", check, self.lendee)
        except KubeUnavailable as e:
            log.warning("the Kubernetes API is not reachable yet (%s); steps will retry", e)
        except KubeAuthError as e:
            journal.record("kubernetes", f"the API server refuses hostagent's credentials: {e};"
                           " every Kubernetes step fails until they are fixed",
                           result="unauthorized", priority=journal.Priority.ERR)
        self.cluster = KubeCluster(kube, self.cfg, remember_cordon=self._remember_cordon,
                                   metrics=self.metrics)
        self.health.add("kubernetes", health.kubernetes(self.cluster))
        return kube

    def _start_at_boot(self) -> None:
        """The host booted: start the owners configured to start at boot, through the
        same road as a player's request (their GPUs are reclaimed first if need be)."""
        self._save()  # the boot id: once per boot, even if the agent restarts
        for vm, owner in sorted(self.cfg.owners.items()):
            if owner.start_at_boot and vm not in self.state.running_owners:
                journal.record("boot", f"the host booted: starting {vm} ([owners.{vm}] "
                               "start_at_boot)", vm=vm, result="ok")
                self.apply(OwnerWants(at=_now(), owner=vm, intent_id=f"boot-{vm}",
                                      source=IntentSource.CONTROL))

    host_stopping = staticmethod(_host_stopping)

    async def _drain_for_shutdown(self) -> None:
        """The host is going down with the lendee lent: cordon and drain its node now,
        while the API answers, so that it comes back cordoned and is uncordoned only
        once its GPUs are verified (the kubelet's own shutdown does not drain)."""
        if not self.state.phase.lendee_running or self.state.phase is Phase.OFF:
            return
        limit = min(self.cfg.timeouts.drain, 60.0)
        try:
            problem = await asyncio.wait_for(self.cluster.reclaim([]), limit)
        except (TimeoutError, Exception) as e:  # the host goes down regardless
            problem = str(e) or f"not drained within {limit:g}s"
        journal.record("shutdown", f"the host is shutting down: {self.lendee}'s node is "
                       + ("cordoned and drained" if problem is None else
                          f"cordoned, its drain incomplete ({problem})")
                       + "; it is uncordoned after its GPUs are verified at the next boot",
                       vm=self.lendee, result="ok" if problem is None else "failed")

    def _node_view(self, view: Any) -> None:
        """The lent node changed: the count of GPU pods is what a regrow waits on."""
        pods = getattr(view, "gpu_pods", None)
        if pods is not None and pods != self.state.gpu_pods:
            self.apply(GpuPods(at=_now(), count=pods))

    def _remember_cordon(self, ours: bool) -> None:
        # The marker on the Node is what uncordon trusts; the state file keeps a copy.
        if self.cordoned_by_us != ours:
            self.cordoned_by_us = ours
            self._save()

    def stop(self) -> None:
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(asyncio.CancelledError())

    async def _serve_metrics(self) -> None:
        """/metrics and /healthz; a port that cannot be bound yet (in use, an address
        not up at boot) is tried again in the background, never a reason to exit."""
        address = self.cfg.metrics.address
        if address is None:
            return

        async def bind() -> None:
            self._exporter = await keep_trying(
                lambda: metrics.serve(address, self.metrics, self.health, log=log),
                what=f"the metrics endpoint on {self.cfg.metrics.listen}",
                transient=(OSError,))

        await self._bind_soon(bind)

    async def _bind_soon(self, bind: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `bind` now; if its first attempt does not succeed at once, leave it
        retrying in the background (its own record says so) and go on."""
        task = asyncio.get_running_loop().create_task(bind())
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if task in done:
            task.result()  # a StartupError: a person must fix the configuration
            return
        self._spawn(_await(task))

    def _load(self) -> None:
        saved, warning = persisted.load_state(self.cfg.state_file)
        if warning:
            journal.record("state", warning, result="rebuilt", priority=journal.Priority.ERR)
        self.cordoned_by_us = saved.cordoned_by_us
        intents = tuple(Intent(id=i.id, owner=i.owner, created_at=i.created.timestamp(),
                               source=i.source) for i in saved.intents)
        relend_at = saved.relend_at.timestamp() if saved.relend_at else None
        self.host_booted = saved.boot_id != self.boot_id
        self.state = State(intents=intents, hold=saved.hold, relend_at=relend_at,
                           reclaiming=saved.reclaiming)

    def _save(self, state: State | None = None, *, within: float | None = None) -> bool:
        """Write `state` (default: the current one); False if it could not be written
        (or not `within` seconds, when given).

        A failure (disk full, EIO, no descriptor left) never stops the agent: it is
        reported once in the journal and in health, and retried every few seconds.
        """
        state = state or self.state
        try:
            snapshot = persisted.State(
                intents=tuple(persisted.Intent(
                    id=i.id, owner=i.owner, source=i.source,
                    created=datetime.fromtimestamp(i.created_at, UTC))
                    for i in state.intents),
                cordoned_by_us=self.cordoned_by_us,
                hold=state.hold,
                reclaiming=state.reclaiming,
                boot_id=self.boot_id,
                relend_at=(datetime.fromtimestamp(state.relend_at, UTC)
                           if state.relend_at is not None else None),
                lendee_phase=state.phase.value,
                lendee_phase_since=datetime.fromtimestamp(self.phase_since, UTC))
            if within is None:
                persisted.save_state(self.cfg.state_file, snapshot)
            elif not persisted.save_state_within(self.cfg.state_file, snapshot, within):
                self._save_failed = (f"the disk did not take {self.cfg.state_file} within "
                                     f"{within:g}s")
                return False
        except (OSError, ValueError) as e:
            why = f"cannot write {self.cfg.state_file}: {getattr(e, 'strerror', None) or e}"
            if why != self._save_failed:
                journal.record("state", f"{why}; requests that cannot be recorded are refused "
                               "and the save is retried (free space on its filesystem?)",
                               result="failed", priority=journal.Priority.ERR)
            self._save_failed = why
            if self._save_retry is None:
                with contextlib.suppress(RuntimeError):  # no loop: nothing to retry on
                    self._save_retry = asyncio.get_running_loop().call_later(
                        5.0, self._retry_save)
            return False
        if self._save_failed is not None:
            journal.record("state", f"{self.cfg.state_file} is written again", result="ok")
            self._save_failed = None
        return True

    def _retry_save(self) -> None:
        self._save_retry = None
        self._save()

    async def _state_saved(self) -> str | None:
        """Health: fails while the state file refuses saves."""
        if self._save_failed is not None:
            raise health.CheckFailed(self._save_failed)
        return f"{self.cfg.state_file} is up to date"

    async def _check_domains(self) -> None:
        defined = await self.libvirt.defined_domains()
        wanted = {"lendee.domain": self.lendee,
                  **{f"owners.{d}": d for d in self.cfg.owners}}
        for key, dom in wanted.items():
            if dom not in defined:
                raise StartupError(
                    f"{self.cfg.source}: {key}: libvirt at {self.cfg.libvirt_uri} has no domain "
                    f"{dom!r} (it has: {', '.join(sorted(defined)) or 'none'}); fix the name, "
                    f"or define the VM first (virsh define)")

    async def _observe(self) -> None:
        running = await self.libvirt.running_domains()
        lent = None
        if self.lendee in running:
            # Its live definition says which GPUs this boot got (partial lending).
            with contextlib.suppress(HostError):
                lent = await self.libvirt.live_gpus(self.lendee, self._lendee_gpu_config())
        self.apply(Observed(at=_now(), lendee_running=self.lendee in running,
                            owners_running=frozenset(running & set(self.topo.owners)),
                            lendee_gpus=lent & self.topo.lendee_gpus if lent else None))

    def _reconnected(self) -> None:
        self._spawn(self._observe())

    # ---- inputs ----------------------------------------------------------------------
    async def _on_hook(self, event: HookEvent) -> Verdict:
        self.metrics.hook_event(event.op, event.sub)
        if event.spooled:
            # Spooled while the agent was down: libvirt went ahead (fail-open) and the
            # fresh read of reality at start already accounts for it. Where the event
            # came from decides this, never the clock (it may have been stepped).
            log.info("while the agent was down: %s %s %s", event.domain, event.op, event.sub)
            return Verdict("proceed")
        if (event.op, event.sub) == ("prepare", "begin"):
            return self._prepare(event)
        if (event.op, event.sub) == ("release", "end"):
            # The owner's devices are released: the surest sign it stopped (or that a
            # start the hook let through failed).
            self._lifecycle(event.domain, Lifecycle.STOPPED)
        return Verdict("proceed")

    def _prepare(self, event: HookEvent) -> Verdict:
        """libvirt's ``prepare begin``: the machine's verdict, and what it implies."""
        vm = event.domain
        gpus = None
        if vm == self.lendee:
            # The definition being started says whether it is the agent's own start.
            with contextlib.suppress(ValueError):
                gpus = devices.gpus_in(event.xml, self._lendee_gpu_config())
        decision, message = machine.verdict(self.state, vm, topo=self.topo, gpus=gpus)
        if decision == "refuse":
            journal.record("refuse", f"refused the start of {vm}: {message}", vm=vm,
                           result="refused")
            return Verdict("defer", message)  # the hook's one way to say no
        if decision == "proceed":
            if self.topo.is_owner(vm) and vm not in self.state.running_owners:
                # It claims its GPUs until it runs or its start ends (release end).
                self.apply(OwnerStarting(at=_now(), owner=vm))
            return Verdict("proceed", message)
        if self.topo.is_owner(vm):
            # Persisted (inside apply) before the hook hears "defer": invariant 4.
            recorded = self.apply(OwnerWants(at=_now(), owner=vm, intent_id=event.id,
                                             source=IntentSource.HOOK))
            if not recorded and self._save_failed and not self.state.intents_of(vm):
                message = (f"hostagent could not record the request to start {vm} "
                           f"({self._save_failed}), so it will not start it by itself: "
                           "start it again once the state file can be written")
                journal.record("defer", f"refused the start of {vm}: {message}", vm=vm,
                               result="refused", priority=journal.Priority.ERR)
                return Verdict("defer", message)
        journal.record("defer", f"deferred the start of {vm}: {message}", vm=vm,
                       result="deferred")
        return Verdict("defer", message)

    def _lifecycle(self, domain: str, kind: Lifecycle) -> None:
        now = _now()
        if kind is Lifecycle.STOPPED:
            self._stopped.setdefault(domain, asyncio.Event()).set()
        if kind is Lifecycle.AGENT_CONNECTED:
            self._agent_connected.set()
            return
        if domain == self.lendee:
            running = self.state.phase is not Phase.OFF
            if kind is Lifecycle.STARTED and not running:
                self.apply(LendeeStarted(at=now))
            elif kind is Lifecycle.STOPPED and running:
                self.apply(LendeeStopped(at=now))
        elif self.topo.is_owner(domain):
            running = domain in self.state.running_owners
            if kind is Lifecycle.STARTED and not running:
                if self.apply(OwnerStarted(at=now, owner=domain)):
                    journal.record("owner", f"{domain} is running: it holds "
                                   f"{self._gpu_names(self.topo.owners[domain])}",
                                   vm=domain, from_="off", to="running", result="ok",
                                   holders=self._holders())
            elif kind is Lifecycle.STOPPED and domain in self.state.starting_owners:
                if self.apply(OwnerStopped(at=now, owner=domain)):
                    journal.record("owner", f"{domain}'s start ended without it running: "
                                   f"{self._gpu_names(self.topo.owners[domain])} no longer "
                                   "claimed", vm=domain, from_="starting", to="off",
                                   result="failed", holders=self._holders())
            elif kind is Lifecycle.STOPPED and running:
                if self.apply(OwnerStopped(at=now, owner=domain)):
                    then = (f"lending them back in {self.policy.relend_delay:g}s"
                            if self.state.relend_at else "they stay free")
                    journal.record("owner", f"{domain} stopped: "
                                   f"{self._gpu_names(self.topo.owners[domain])} free; {then}",
                                   vm=domain, from_="running", to="off", result="ok",
                                   holders=self._holders())

    # ---- actions ---------------------------------------------------------------------
    def _execute(self, action: Action) -> None:
        match action:
            case Drain(ticket=t):
                self._spawn(self._drain(t), action)
            case WaitAgent(ticket=t):
                self._spawn(self._wait_agent(t), action)
            case ShutdownLendee(ticket=t):
                self._spawn(self._shutdown(t), action)
            case ForceOff(ticket=t):
                self._spawn(self._force_off(t), action)
            case StartOwner(owner=owner):
                self._spawn(self._start(owner, action), action)
            case StartLendee(gpus=gpus):
                self._spawn(self._start(self.lendee, action, gpus), action)
            case KubeReturn(ticket=t):
                self._spawn(self._give_back(t), action)
            case ScheduleRelend(at=at):
                self._cancel_relend()
                self._relend = asyncio.get_running_loop().call_later(
                    max(0.0, at - _now()), lambda: self.apply(RelendDue(at=_now())))
            case CancelRelend():
                self._cancel_relend()
            case CompleteIntent(intent_id=iid, owner=owner):
                journal.record("intent", f"{owner} is running, as asked", vm=owner,
                               to="done", result="ok", intent=iid)
                self._answer(iid, True, f"{owner} is running")
            case FailIntent(intent_id=iid, owner=owner, reason=reason):
                journal.record("intent", f"could not start {owner}: {reason}", vm=owner,
                               to="failed", result="failed", intent=iid,
                               priority=journal.Priority.ERR)
                self._answer(iid, False, reason)
            case _:
                raise AssertionError(f"unhandled action {action}")

    def _cancel_relend(self) -> None:
        if self._relend is not None:
            self._relend.cancel()
            self._relend = None

    def _spawn(self, coro: Coroutine[Any, Any, None], action: Action | None = None, *,
               ticket: int | None = None) -> None:
        ticket = getattr(action, "ticket", ticket)
        # A step of the lendee's waits for the steps of earlier phases to be gone.
        previous = [t for t, n in self._steps.items() if ticket is not None and n != ticket]
        task = asyncio.get_running_loop().create_task(self._guard(coro, action, previous))
        # A step cancelled before it began was never awaited: close it (no warning).
        task.add_done_callback(lambda _: coro.close())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if ticket is not None:
            self._steps[task] = ticket
            task.add_done_callback(lambda t: self._steps.pop(t, None))

    def _supervise(self, ticket: int) -> None:
        """A new phase began: cancel every step of the earlier ones (a drain, a return to
        the cluster, a wait). The next step awaits them before it touches anything, and
        a step whose ticket is stale never acts (it is cancelled at its next await)."""
        me = asyncio.current_task()
        for task, n in list(self._steps.items()):
            if n != ticket and task is not me:
                task.cancel()

    def _wanted(self, action: Action) -> bool:
        """An action can go stale between being issued and running (see the machine)."""
        if machine.still_wanted(self.state, action, topo=self.topo):
            return True
        log.debug("skipped, no longer wanted: %s", action)
        return False

    async def _guard(self, coro: Coroutine[Any, Any, None], action: Action | None,
                     previous: list[asyncio.Task[None]] | None = None) -> None:
        if previous:
            await asyncio.gather(*previous, return_exceptions=True)
        if action is not None and not self._wanted(action):
            coro.close()
            return
        # A bug in one action must not wedge the agent silently: end the process and let
        # systemd restart it; the restart resumes from libvirt and the state file.
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("an action failed unexpectedly; stopping so that systemd restarts us")
            if self._fatal is not None and not self._fatal.done():
                self._fatal.set_exception(e)

    def _current(self, ticket: int) -> bool:
        return self.state.ticket == ticket

    async def _drain(self, ticket: int) -> None:
        problem = await self.cluster.reclaim(list(self.state.waiting_owners))
        if problem is None:
            self.apply(Drained(at=_now(), ticket=ticket))
        else:
            self.apply(DrainFailed(at=_now(), ticket=ticket, reason=problem))

    async def _wait_agent(self, ticket: int) -> None:
        """guest-ping until it answers, bounded: the agent needs 30-60 s in a fresh VM.

        libvirt tells us when qemu-ga connects its port, so the wait is mostly asleep;
        the pings with backoff are what decides (a connected agent may still not answer).
        """
        deadline = time.monotonic() + self.cfg.timeouts.guest_agent
        delay = 1.0
        while self._current(ticket):
            self._agent_connected.clear()
            try:
                if await self.libvirt.ping_agent(self.lendee, timeout=3):
                    self.apply(AgentUp(at=_now(), ticket=ticket))
                    return
            except DomainNotFound:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                if self.state.phase is Phase.BOOTING:
                    await self._screenshot_dead_boot()
                self.apply(AgentTimeout(at=_now(), ticket=ticket))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._agent_connected.wait(), min(delay, left))
            delay = min(delay * 1.5, 5.0)

    async def _shutdown(self, ticket: int) -> None:
        stopped = self._stopped.setdefault(self.lendee, asyncio.Event())
        stopped.clear()
        for attempt in range(3):
            try:
                await self.libvirt.shutdown_via_agent(self.lendee)
                break
            except HostError as e:
                if not await self.libvirt.is_running(self.lendee):
                    break
                log.warning("guest-agent shutdown of %s failed (%s); retrying", self.lendee, e)
                await asyncio.sleep(1 + attempt + random.random())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), self.cfg.timeouts.shutdown)
        if await self.libvirt.is_running(self.lendee):
            self.apply(ShutdownTimeout(at=_now(), ticket=ticket))
        elif self.state.phase is not Phase.OFF:
            self.apply(LendeeStopped(at=_now()))  # the event was lost; reality says off

    async def _force_off(self, ticket: int) -> None:
        grace = self.cfg.policy.force_off_after or 0.0
        journal.record("force-off", f"{self.lendee} did not shut down: forcing it off in "
                       f"{grace:g}s as policy.force_off_after allows", vm=self.lendee,
                       result="forced", priority=journal.Priority.WARNING)
        await asyncio.sleep(grace)
        if self._current(ticket):
            with contextlib.suppress(HostError):
                await self.libvirt.destroy(self.lendee)

    async def _start(self, vm: str, action: Action,
                     gpus: frozenset[str] | None = None) -> None:
        """Start a VM; a failed start is retried twice with jittered backoff (starting a
        running VM is a no-op, so retrying is safe), all within timeouts.start. A start
        a hook refused is not retried: it would only be refused again.
        Unless policy.lint_before_start is off, a VM whose XML has errors on this host
        is not started: the finding is in the journal and the start fails with it.
        The lendee starts with `gpus` only: a live definition for this boot, without the
        others' devices; its persistent definition is never edited."""
        if self.cfg.policy.lint_before_start:
            refusal = await self._lint_before_start(vm)
            if refusal is not None:
                self.apply(StartFailed(at=_now(), vm=vm, reason=refusal))
                return
        deadline = time.monotonic() + self.cfg.timeouts.start
        for attempt in range(3):
            if attempt and not self._wanted(action):
                return
            try:
                start = (self.libvirt.start(vm) if gpus is None else self.libvirt.start_with(
                    vm, drop=self.topo.lendee_gpus - gpus, gpus=self._lendee_gpu_config()))
                await asyncio.wait_for(start, deadline - time.monotonic())
                break
            except HookRefused as e:
                self.apply(StartFailed(at=_now(), vm=vm, reason=e.sentence or str(e)))
                return
            except DomainNotFound as e:
                self.apply(StartFailed(at=_now(), vm=vm, reason=str(e)))
                return
            except (HostError, TimeoutError) as e:
                reason = str(e) or f"no answer within {self.cfg.timeouts.start:g}s"
                pause = (1 + attempt) * (0.5 + random.random())
                if attempt == 2 or time.monotonic() + pause >= deadline:
                    self.apply(StartFailed(at=_now(), vm=vm, reason=reason))
                    return
                log.warning("starting %s failed (%s); retrying in %.1fs", vm, reason, pause)
                await asyncio.sleep(pause)
        # The lifecycle event normally got here first; if it was lost, reality decides.
        self._lifecycle(vm, Lifecycle.STARTED)

    def _lendee_gpu_config(self) -> dict[str, Any]:
        """The configured GPUs the lendee may borrow, by label (their PCI functions)."""
        return {label: self.cfg.gpus[label] for label in self.topo.lendee_gpus
                if label in self.cfg.gpus}

    async def _give_back(self, ticket: int) -> None:
        # What the driver in the guest sees comes first: the cluster's return uncordons.
        lent = self.state.lent
        problem = await self._verify_gpus(ticket, lent)
        if not self._current(ticket):
            return
        if problem is None:
            problem = await self.cluster.give_back(lent)
        if problem is None:
            self.apply(ReturnDone(at=_now(), ticket=ticket))
        else:
            self.apply(ReturnFailed(at=_now(), ticket=ticket, reason=problem))

    # ---- GPUs for real: lint before a start, the in-guest check, a dead boot's screen ----
    # The last in-guest check, for `status`: at (unix time), ok, summary.
    _verified: dict[str, Any] | None = None

    async def _lint_before_start(self, vm: str) -> str | None:
        """Why `vm` must not be started (errors in its XML on this host), or None.

        Only what the domain's own XML says, against the host (`lint.check_domain`):
        whether the configuration agrees with it is `hostagent lint`'s job.
        """
        try:
            dom = lint.parse_domain(await self.libvirt.xml(vm))
        except (HostError, ValueError):
            return None  # the start itself will say what is wrong
        findings = await asyncio.to_thread(lint.check_domain, dom, lendee=vm == self.lendee)
        for f in findings:
            error = f.severity is lint.Severity.ERROR
            journal.record("lint", f"{vm}: {f.what}: {f.why} Fix: {f.fix}", vm=vm,
                           result="refused" if error else "warning", check=f.check.value,
                           priority=journal.Priority.ERR if error else journal.Priority.WARNING)
        errors = lint.errors(findings)
        if not errors:
            return None
        return (f"hostagent did not start {vm}: " + "; ".join(f.what for f in errors)
                + f" (`hostagent lint {vm}` says why and how to fix it)")

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None:
        """Ask the driver in the lendee which GPUs it sees; None if exactly the lent ones.

        Retried until verify.timeout: the guest agent answers before the NVIDIA driver
        has always loaded. The outcome is one journal record, an error naming the
        missing GPUs and the usual causes when it fails."""
        method = self.cfg.verify.method
        if method is VerifyMethod.NONE:
            return None
        expected = [in_guest.Expected(label=label, uuid=gpu.uuid if gpu else None,
                                      name=gpu.name if gpu else None)
                    for label in sorted(lent)
                    for gpu in [self.cfg.gpus.get(label)]]
        deadline = time.monotonic() + self.cfg.verify.timeout
        while True:
            bound = max(1.0, min(30.0, deadline - time.monotonic()))
            try:
                outcome = await self._ask_guest(expected, bound)
            except (HostError, in_guest.VerifyError) as e:
                outcome = in_guest.Outcome(seen=(), missing=tuple(expected), problem=(
                    f"could not run {self.cfg.verify.command} through {method}: {e}"))
            if outcome.ok or not self._current(ticket) or time.monotonic() + 3 >= deadline:
                break
            await asyncio.sleep(3)
        if not self._current(ticket):
            return None
        # Exactly the lent set: a GPU this boot left out but the guest sees means its
        # live definition was not what the agent asked for.
        withheld = {gpu.uuid: label for label in self.topo.lendee_gpus - lent
                    for gpu in [self.cfg.gpus.get(label)] if gpu is not None and gpu.uuid}
        leaked = sorted(withheld[g.uuid] for g in outcome.seen if g.uuid in withheld)
        ok = outcome.ok and not leaked
        summary = outcome.summary(self.lendee)
        if outcome.ok and leaked:
            summary = (f"the driver in {self.lendee} also sees {self._gpu_names(tuple(leaked))}, "
                       "which this boot did not lend it (its live definition was not applied)")
        self._verified = {"at": _now(), "ok": ok, "summary": summary}
        if ok:
            journal.record("verify", summary, vm=self.lendee, result="ok", method=method.value,
                           gpus=",".join(g.uuid for g in outcome.seen))
            return None
        journal.record("verify", f"{summary}; {in_guest.CAUSES}", vm=self.lendee,
                       result="mismatch", method=method.value, priority=journal.Priority.ERR,
                       missing=",".join(g.label for g in outcome.missing) or ",".join(leaked))
        return summary

    async def _ask_guest(self, expected: list[in_guest.Expected],
                         timeout: float) -> in_guest.Outcome:
        """The GPU query in the lendee, with the configured command or where NixOS and
        the GPU operator put nvidia-smi (`verify.PLACES`)."""
        ssh = self.cfg.verify.ssh

        async def run(command: str) -> tuple[int, str, str]:
            if self.cfg.verify.method is VerifyMethod.SSH and ssh is not None:
                return await in_guest.run_ssh(
                    host=ssh.host, port=ssh.port, user=ssh.user, key=str(ssh.key),
                    known_hosts=str(ssh.known_hosts), argv=[command, *in_guest.QUERY],
                    timeout=timeout)
            done = await self.libvirt.guest_exec(self.lendee, command, list(in_guest.QUERY),
                                                 timeout=timeout)
            return done.exitcode, done.stdout, done.stderr

        return await in_guest.query(expected, run, self.cfg.verify.command)

    async def _screenshot_dead_boot(self) -> None:
        """The lendee's guest agent never answered after its start: keep its screen,
        the one witness left (a UEFI shell, an installer, firmware stuck on a ROM)."""
        waited = f"{self.cfg.timeouts.guest_agent:g}s"
        try:
            mime, data = await self.libvirt.screenshot(self.lendee)
            path = await asyncio.to_thread(screenshots.save, self.cfg.state_dir / "screenshots",
                                           self.lendee, mime, data)
        except (HostError, OSError) as e:
            journal.record("boot", f"{self.lendee}'s guest agent did not answer within {waited} "
                           f"of its start, and its screen could not be saved: {e}",
                           vm=self.lendee, result="failed", priority=journal.Priority.ERR)
            return
        journal.record("boot", f"{self.lendee}'s guest agent did not answer within {waited} of "
                       f"its start: its screen is saved in {path} (a UEFI shell, an installer, "
                       "firmware stuck on an option ROM, a kernel panic?)", vm=self.lendee,
                       result="failed", screenshot=str(path), priority=journal.Priority.ERR)

    async def _watchdog(self, interval: float) -> None:
        # Sent from the loop itself: a blocked loop stops the pings and systemd restarts us.
        while True:
            journal.notify(watchdog=True)
            await asyncio.sleep(interval)

    # ---- journal ---------------------------------------------------------------------
    def _gpu_names(self, labels: frozenset[str] | tuple[str, ...]) -> str:
        return ", ".join(str(self.cfg.gpus[g]) if g in self.cfg.gpus else g
                         for g in sorted(labels))

    def _record_phase(self, old: State, new: State, event: Event) -> None:
        now = _now()
        took = (now - self.phase_since) * 1000
        self.phase_since = now
        lendee, gpus = self.lendee, self._gpu_names(new.lent)
        wanting = [o for o in new.waiting_owners if self.topo.owners[o] & old.lent]
        wanted = self.topo.gpus_of(wanting) & old.lent
        who = ", ".join(wanting) or ("hostagent reclaim" if new.reclaiming else "an owner VM")
        draining = f"{who} wants {self._gpu_names(wanted or old.lent)}: draining {lendee}"
        if isinstance(event, RelendDue | GpuPods):
            more = self._gpu_names(machine.free_gpus(new, self.topo, self.policy) - old.lent)
            why = ("policy.regrow = always" if self.policy.regrow is Regrow.ALWAYS
                   else "no pod on its node requests a GPU (policy.regrow = when-idle)")
            draining = f"{more} are free again and {why}: restarting {lendee} to add them"
        held = self.topo.lendee_gpus - new.lent
        others = f" ({self._gpu_names(held)} not lent)" if held and new.lent else ""
        messages = {
            Phase.BOOTING: f"{lendee} is running with {gpus}: waiting for its guest agent",
            Phase.JOINING: f"{lendee}'s guest agent answered: returning it to the cluster",
            Phase.LENT: f"{lendee} is lent: {gpus} are the cluster's{others}",
            Phase.DRAINING: draining,
            Phase.STOPPING: f"{lendee} is drained: shutting it down through its guest agent "
                            "once the agent answers",
            Phase.OFF: f"{lendee} is off: its GPUs are free",
            Phase.FAILED: f"{lendee} needs attention: {new.reason}",
        }
        failed = new.phase is Phase.FAILED
        journal.record("phase", messages[new.phase], vm=lendee, from_=old.phase.value,
                       to=new.phase.value, duration_ms=took,
                       result="failed" if failed else "ok", cause=type(event).__name__,
                       holders=self._holders(),
                       priority=journal.Priority.ERR if failed else journal.Priority.INFO)
        self._progress("phase", messages[new.phase], {"vm": lendee, "from": old.phase.value,
                                                     "to": new.phase.value})

    def _holders(self) -> str:
        """HOSTAGENT_HOLDERS: who holds each GPU after this transition, for `history`."""
        return ",".join(f"{gpu}={vm or '-'}" for gpu, vm in
                        machine.holders(self.state, self.topo).items())

    def _record_intent(self, intent: Intent) -> None:
        shared = self.topo.owners.get(intent.owner, frozenset()) & self.state.lent
        how = {IntentSource.HOOK: "through libvirt", IntentSource.CONTROL: "by hostagent play",
               IntentSource.RESUME: "before the agent restarted"}[intent.source]
        if not shared:
            journal.record("intent", f"{intent.owner} asked to start {how}: its GPUs are "
                           f"free, starting it", vm=intent.owner, to="pending", result="ok",
                           intent=intent.id)
            self._progress("intent", f"{intent.owner} asked to start ({intent.source.value})",
                           {"vm": intent.owner, "intent": intent.id, "to": "pending"})
            return
        journal.record("intent", f"{intent.owner} asked to start {how}: "
                       f"{self._gpu_names(shared)} {'are' if len(shared) > 1 else 'is'} lent to "
                       f"{self.lendee}; {intent.owner} will start by itself once "
                       f"{'they are' if len(shared) > 1 else 'it is'} free",
                       vm=intent.owner, to="pending", result="deferred", intent=intent.id)
        self._progress("intent", f"{intent.owner} asked to start ({intent.source.value})",
                       {"vm": intent.owner, "intent": intent.id, "to": "pending"})

    def _status_line(self) -> str:
        pending = ", ".join(self.state.waiting_owners)
        return f"{self.lendee} {self.state.phase.value}" + (f"; waiting: {pending}"
                                                            if pending else "")

    # ---- control ---------------------------------------------------------------------
    # The verbs of the control socket and of the SSH endpoint. Those that wait (play,
    # release, reclaim) follow the transitions the agent journals (`_progress`) and
    # stream them, with the time elapsed and what they wait for. A client that goes away
    # stops its own waiting, never what it started: an intent lives in the machine.

    def _verbs(self) -> dict[str, VerbHandler]:
        return {"status": self._verb_status, "play": self._verb_play,
                "release": self._verb_release, "hold": self._verb_hold,
                "resume": self._verb_resume, "lend": self._verb_resume,
                "reclaim": self._verb_reclaim}

    def _control_access(self) -> dict[str, Any]:
        """control.sock's mode, group and what the group may do: 0660 for control_group,
        else root's alone."""
        name = self.cfg.control_group
        if name is None:
            return {"mode": 0o600}
        try:
            return {"mode": 0o660, "group": grp.getgrnam(name).gr_gid, "group_name": name,
                    "group_verbs": self.cfg.control_verbs}
        except KeyError:
            raise StartupError(f"{self.cfg.source}: control_group: there is no group {name!r} "
                               f"on this host; create it (groupadd {name}) or remove the "
                               "key") from None

    async def _serve_ssh(self) -> None:
        """The SSH endpoint when [ssh] is configured (see hostagent.ssh), else None."""
        if self.cfg.ssh is None or self.cfg.ssh_host_key is None:
            return None
        from hostagent import ssh  # asyncssh only where it is used
        endpoint, key = self.cfg.ssh, self.cfg.ssh_host_key

        async def bind() -> None:
            try:
                self._endpoint = await keep_trying(
                    lambda: ssh.serve(endpoint.address, key, endpoint.authorized_keys,
                                      self._verbs()),
                    what=f"the SSH endpoint on {endpoint.listen}", transient=(ssh.Transient,))
            except ssh.EndpointError as e:
                raise StartupError(f"{self.cfg.source}: [ssh]: {e}") from e

        await self._bind_soon(bind)

    def _progress(self, event: str, message: str, fields: dict[str, Any]) -> None:
        """Hand one transition to every client following progress. No I/O: a queue each."""
        update = {"event": event, "message": message, **fields}
        for queue in self._followers:
            queue.put_nowait(update)

    @contextlib.contextmanager
    def _following(self) -> Iterator[asyncio.Queue[Reply]]:
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._followers.add(queue)
        try:
            yield queue
        finally:
            self._followers.discard(queue)

    def status(self) -> dict[str, Any]:
        now = _now()
        holders = machine.holders(self.state, self.topo)
        gpus = []
        for label in sorted(self.topo.gpus):
            gpu = self.cfg.gpus.get(label)
            gpus.append({"gpu": label, "name": gpu.name if gpu else None,
                         "pci": gpu.pci if gpu else label,
                         "owners": list(self.cfg.owners_of(label)),
                         "holder": holders.get(label)})
        return {
            "lendee": {"domain": self.lendee, "phase": self.state.phase.value,
                       "reason": self.state.reason, "since": self.phase_since,
                       "hold": self.state.hold, "lent": sorted(self.state.lent),
                       "free": sorted(machine.free_gpus(self.state, self.topo, self.policy)),
                       "regrow_waiting": self.state.regrow_waiting},
            "gpus": gpus,
            "verified": self._verified,
            "owners": {o: o in self.state.running_owners for o in sorted(self.topo.owners)},
            "intents": [{"id": i.id, "owner": i.owner, "source": i.source.value,
                         "age_s": round(now - i.created_at, 1)} for i in self.state.intents],
            "relend_in_s": round(self.state.relend_at - now, 1) if self.state.relend_at else None,
            "libvirt_connected": self.libvirt.connected,
            "cluster": (self.cluster.status() if hasattr(self.cluster, "status")
                        else None),
            "health": [r.as_dict() for r in self.health.last],
        }

    async def _verb_status(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        await self.health.check()
        yield {"ok": True, "data": self.status()}

    async def _verb_hold(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        self.apply(Hold(at=_now()))
        message = f"lending is on hold: {self.lendee} is not lent again until `hostagent lend`"
        if self.state.phase is not Phase.OFF:
            message += ("; it keeps running for now (`hostagent reclaim` takes its GPUs "
                        "back)")
        yield {"ok": True, "data": {**self.status(), "message": message}}

    async def _verb_resume(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """`resume` and `lend`: lend again now, and retry a step that failed."""
        self.apply(Resume(at=_now()))
        yield {"ok": True, "data": {**self.status(), "message": self._lend_note()}}

    def _owner_arg(self, args: dict[str, Any], verb: str) -> tuple[str | None, str]:
        """(the owner VM named in args, "") or (None, why not, naming the owners)."""
        vm = args.get("vm")
        owners = ", ".join(sorted(self.topo.owners)) or "none is configured"
        if not isinstance(vm, str) or not vm:
            return None, f"{verb} needs an owner VM: {owners}"
        if vm == self.lendee:
            return None, (f"{vm} is the lendee, not an owner VM: {verb} takes one of "
                          f"{owners} (`hostagent reclaim` takes the GPUs back from {vm})")
        if not self.topo.is_owner(vm):
            return None, (f"unknown VM {vm[:64]!r}: hostagent manages {owners} "
                          f"(owners.* in {self.cfg.source})")
        return vm, ""

    def _waiting_for(self, vm: str | None = None) -> str:
        """What a client waits for now, in a few words."""
        state, lendee = self.state, self.lendee
        if vm is not None and not self.topo.needs_lendee_gpus(vm):
            return f"{vm} to start"
        match state.phase:
            case Phase.DRAINING:
                return f"{lendee}'s node to drain"
            case Phase.STOPPING if state.shutdown_sent:
                return f"{lendee} to power off"
            case Phase.STOPPING:
                return f"{lendee}'s guest agent to answer, to shut it down"
            case Phase.FAILED:
                return f"a human: {state.reason}"
            case Phase.OFF if state.lendee_starting:
                return f"{lendee} to finish starting, then to give its GPUs back"
            case Phase.OFF:
                return f"{vm} to start" if vm else "nothing"
            case _:
                return f"{lendee} to be reclaimed"

    def _lend_note(self) -> str:
        """When the lendee gets its GPUs back, as things stand."""
        state, lendee = self.state, self.lendee
        if state.relend_at is not None:
            free = machine.free_gpus(state, self.topo, self.policy)
            what = ("its GPUs" if free == self.topo.lendee_gpus and not state.lent
                    else self._gpu_names(free))
            return (f"{lendee} gets {what} back in {max(0.0, state.relend_at - _now()):.0f}s"
                    " (policy.relend_delay) unless an owner VM starts meanwhile")
        if state.phase is not Phase.OFF:
            return f"{lendee} is {state.phase.value}"
        if state.lendee_starting:
            return f"{lendee} is starting"
        if state.hold:
            return f"lending is on hold: `hostagent lend` gives {lendee} its GPUs back"
        claimants = [o for o in (*sorted(state.running_owners), *state.waiting_owners)
                     if self.topo.needs_lendee_gpus(o)]
        if claimants:
            return (f"{', '.join(dict.fromkeys(claimants))} still needs {lendee}'s GPUs; "
                    f"{lendee} gets them back after")
        if state.reason:
            return f"{lendee} is not lent: {state.reason}"
        return f"{lendee} stays off"

    async def _verb_play(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Start an owner VM: an intent, then its progress until the VM runs or fails."""
        vm, problem = self._owner_arg(args, "play")
        if vm is None:
            yield {"ok": False, "error": problem}
            return
        started = time.monotonic()

        def took() -> float:
            return round(time.monotonic() - started, 1)

        if vm in self.state.running_owners:
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": 0.0,
                                        "message": f"{vm} is already running"}}
            return
        rival = machine.conflict(self.state, vm, self.topo)
        if rival is not None:
            yield {"ok": False, "error": f"{vm} cannot start now: {rival}"}
            return
        intent = f"play-{uuid.uuid4().hex[:12]}"
        with self._following() as updates:
            # Persisted inside apply before the client hears anything: invariant 4.
            if not self.apply(OwnerWants(at=_now(), owner=vm, intent_id=intent,
                                         source=IntentSource.CONTROL)):
                why = (f"its request could not be recorded ({self._save_failed})"
                       if self._save_failed else "see journalctl -u hostagent")
                yield {"ok": False, "error": f"the agent refused to start {vm} now: {why}"}
                return
            while True:
                update = await updates.get()
                if update.get("event") == "intent" and update.get("intent") != intent:
                    continue  # another caller's request
                to = update.get("to")
                if update.get("event") == "intent" and to == "done":
                    yield {"ok": True, "data": {"vm": vm, "intent": intent, "elapsed_s": took(),
                                                "message": f"{vm} is running ({took():g}s)"}}
                    return
                if update.get("event") == "intent" and to == "failed":
                    yield {"ok": False, "error": update["message"], "intent": intent,
                           "elapsed_s": took()}
                    return
                if update.get("event") == "intent":  # ours, pending: say what comes next
                    update = {**update, "message": self._play_plan(vm)}
                yield {**update, "elapsed_s": took(), "waiting": self._waiting_for(vm)}
                if update.get("event") == "phase" and to == Phase.FAILED.value:
                    yield {"ok": False, "intent": intent, "pending": True, "elapsed_s": took(),
                           "error": f"{update['message']}; the request stands: {vm} starts "
                                    f"by itself once {self.lendee} has stopped"}
                    return

    def _play_plan(self, vm: str) -> str:
        state, lendee = self.state, self.lendee
        if not self.topo.needs_lendee_gpus(vm):
            return f"starting {vm}: it shares no GPU with {lendee}"
        if state.phase is Phase.OFF and not state.lendee_starting:
            return f"starting {vm}: {lendee} is off"
        shared = self.topo.owners[vm] & state.lent
        if not shared:
            return f"starting {vm}: {lendee} runs without its GPUs"
        return (f"{vm} needs {self._gpu_names(shared)}: {lendee} ({state.phase.value}) gives "
                f"{'them' if len(shared) > 1 else 'it'} back first")

    async def _verb_release(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Shut an owner VM down and wait until it is off; the lend follows by itself."""
        vm, problem = self._owner_arg(args, "release")
        if vm is None:
            yield {"ok": False, "error": problem}
            return
        started = time.monotonic()

        def took() -> float:
            return round(time.monotonic() - started, 1)

        if self.state.intents_of(vm) and vm not in self.state.running_owners:
            # Still waiting for its GPUs: releasing it withdraws the request.
            caller = current_caller()
            by = f"hostagent release ({caller})" if caller else "hostagent release"
            self.apply(CancelIntent(at=_now(), owner=vm, by=by))
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(), "cancelled": True,
                                        "message": f"the pending start of {vm} is cancelled; "
                                                   f"{self._lend_note()}"}}
            return
        if not await self.libvirt.is_running(vm):
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(), "relend_in_s":
                                        self.status()["relend_in_s"],
                                        "message": f"{vm} is not running; {self._lend_note()}"}}
            return
        stopped = self._stopped.setdefault(vm, asyncio.Event())
        stopped.clear()
        how = await self._shut_down_owner(vm)
        yield {"event": "release", "vm": vm, "message": f"shutting {vm} down through {how}",
               "elapsed_s": took(), "waiting": f"{vm} to power off"}
        limit = self.cfg.timeouts.shutdown
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), limit)
        if await self.libvirt.is_running(vm):
            yield {"ok": False, "elapsed_s": took(), "error":
                   f"{vm} did not power off within {limit:g}s (timeouts.shutdown) after a "
                   f"shutdown through {how}; it keeps running: close what holds it up inside, "
                   f"or stop it by hand (virsh shutdown {vm})"}
            return
        if vm in self.state.running_owners:
            self._lifecycle(vm, Lifecycle.STOPPED)  # the event was lost; reality says off
        yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(),
                                    "relend_in_s": self.status()["relend_in_s"],
                                    "message": f"{vm} is off ({took():g}s); {self._lend_note()}"}}

    async def _shut_down_owner(self, vm: str) -> str:
        """Through its guest agent if it has one that answers, else ACPI; says which."""
        channels = ElementTree.fromstring(await self.libvirt.xml(vm)).findall(
            "./devices/channel/target[@name='org.qemu.guest_agent.0']")
        if not channels:
            await self.libvirt.shutdown_via_acpi(vm)
            return "ACPI (it has no guest agent channel)"
        if await self.libvirt.ping_agent(vm, timeout=3):
            try:
                await self.libvirt.shutdown_via_agent(vm)
                return "its guest agent"
            except HostError as e:
                log.warning("guest-agent shutdown of %s failed (%s); using ACPI", vm, e)
        await self.libvirt.shutdown_via_acpi(vm)
        return "ACPI (its guest agent did not answer)"

    async def _verb_reclaim(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Take the GPUs back from the lendee with no owner starting; stream until off.

        The lendee stays off until `lend` (the machine's Reclaim holds). A lendee start
        that was in flight is reclaimed once it lands (see machine._reclaim_by_hand).
        """
        started = time.monotonic()
        lendee, gpus = self.lendee, self._gpu_names(self.topo.lendee_gpus)
        with self._following() as updates:
            self.apply(Reclaim(at=_now()))
            update: Reply | None = {"event": "reclaim", "message": f"reclaiming {gpus} from "
                                    f"{lendee} ({self.state.phase.value})"}
            while True:
                state = self.state
                if state.phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT):
                    self.apply(Reclaim(at=_now()))  # a start that was in flight landed
                    continue
                done = state.phase is Phase.OFF and not state.lendee_starting
                if update is not None and update.get("event") != "intent" and not (
                        done and update.get("event") == "reclaim"):
                    yield {**update, "elapsed_s": round(time.monotonic() - started, 1),
                           "waiting": self._waiting_for()}
                if done:
                    yield {"ok": True, "data": {
                        "elapsed_s": round(time.monotonic() - started, 1),
                        "message": f"{lendee} is off: {gpus} are free; it stays off until "
                                   "`hostagent lend`"}}
                    return
                if state.phase is Phase.FAILED:
                    yield {"ok": False, "error": f"{lendee} could not be reclaimed: "
                                                 f"{state.reason}"}
                    return
                update = None
                with contextlib.suppress(TimeoutError):
                    # A tick as well: a failed lendee start changes no phase.
                    update = await asyncio.wait_for(updates.get(), 1.0)

    def _answer(self, intent_id: str, ok: bool, message: str) -> None:
        """An intent ended: tell whoever follows it (a `play` waiting on it, if any)."""
        self._progress("intent", message, {"intent": intent_id, "to": "done" if ok else "failed"})


def run(cfg: Config) -> int:
    """`hostagent run`: the service's main; returns the process exit status."""
    agent = Agent(cfg)

    async def main() -> None:
        import signal
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        await agent.run()

    try:
        asyncio.run(main())
    except StartupError as e:
        journal.record("agent", f"cannot start: {e}", result="failed",
                       priority=journal.Priority.ERR)
        if "JOURNAL_STREAM" not in os.environ:  # under systemd, stderr *is* the journal
            print(f"hostagent: cannot start: {e}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:
        return 0
    return 0

