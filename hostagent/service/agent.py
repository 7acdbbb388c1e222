"""The service: wires libvirt, the hook and control sockets and the cluster to the machine.

Everything that happens becomes an `Event` applied by `Agent.apply`, on the event loop
thread, one at a time: the pure `machine.step` decides, the agent persists what must
survive a crash, writes one journal record per transition, and runs the actions as
tasks. Each task reports back with another event. An owner's start request is applied
only once it is on disk (`Agent.request`). The loop itself never blocks: libvirt calls
and state saves run in worker threads (see `host.libvirt`, `state.Saver`), so the hook
socket is answered while libvirtd is busy starting the VM whose hook is asking, and
while the disk takes its time.

Level-triggered: at start and after every libvirt reconnect the agent reads which
VMs run and hands that to the machine (`Observed`); events only wake it up.

The agent is the composition root and owns the state and `apply`. Its parts are
`hostagent.service.executor` (actions to effects, each a step supervised by its phase),
`hostagent.service.verbs` (the control verbs) and `hostagent.service.recorder` (the journal record
of each transition); each is given what it uses (`hostagent.service.parts`: a read-only view of the
state, `apply`, the progress channel), never the agent, and changes nothing but through
`apply`. Only `hostagent.service.main` (`hostagent run`) imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hostagent.core import clock, devices, health, machine
from hostagent.host import journal, lint
from hostagent.surfaces import metrics
from hostagent.host import state as persisted
from hostagent.core.config import Config
from hostagent.surfaces.control import serve_control
from hostagent.service import hotplug
from hostagent.service.executor import Executor
from hostagent.surfaces.inbox import HookEvent, Inbox, Verdict, replay_spool, serve_hooks
from hostagent.host.libvirt import Domains, HostError, Libvirt, Lifecycle
from hostagent.host.lock import AlreadyRunning, lock_agent
from hostagent.core.model import (
    Action,
    Event,
    GpuPods,
    Hotplug,
    Intent,
    IntentSource,
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
    State,
)
from hostagent.service.parts import Cluster, Kept, NoCluster, Progress, Shared
from hostagent.service.recorder import Recorder
from hostagent.service.reservations import Reservations
from hostagent.core.topology import topology
from hostagent.service.fleet import Fleet
from hostagent.service.serving import Endpoints, StartupError, boot_id, host_stopping
from hostagent.service.verbs import Verbs

log = logging.getLogger("hostagent")


# Of the hook's 0.3 s budget for an answer: the rest is its own start and the exchange.
HOOK_SAVE_BUDGET = 0.15
# Waited for the last state to be on disk when the agent stops.
EXIT_SAVE_BUDGET = 10.0


def _persisted(state: State) -> tuple[object, ...]:
    """What of a state goes to the state file (a change of it is saved)."""
    return (state.intents, state.phase, state.hold, state.relend_at, state.reclaiming,
            state.reservations)


class Agent:
    cfg: Shared[Config] = Shared()
    policy: Shared[Policy] = Shared()
    libvirt: Shared[Domains] = Shared()
    cluster: Shared[Cluster] = Shared()

    def __init__(self, cfg: Config, *, cluster: Cluster | None = None,
                 whole: Config | None = None, primary: Agent | None = None) -> None:
        self.cfg = cfg
        # With several lendees (`hostagent.service.fleet`): `cfg` is this lendee's view,
        # `whole` the file, `fleet` steps every machine, and a lendee after the first
        # shares the `primary`'s connection, progress and watchers; else both are `cfg`.
        self.whole = whole or cfg
        self.fleet: Fleet | None = None
        self.state_file = (cfg.state_file if primary is None else
                           cfg.state_dir / "lendees" / f"{cfg.lendee.domain}.toml")
        self.topo = topology(cfg)
        regrow = cfg.policy.regrow
        if cfg.kubernetes is None and regrow is Regrow.WHEN_IDLE:
            regrow = Regrow.ALWAYS  # nothing can tell whether a GPU job runs on the node
        hotplug = cfg.policy.hotplug
        self.policy = Policy(relend_delay=cfg.policy.relend_delay,
                             force_off=cfg.policy.force_off_after is not None,
                             partial=cfg.policy.partial, min_gpus=cfg.lendee.min_gpus,
                             regrow=regrow, regrow_max_wait=cfg.policy.regrow_max_wait,
                             hotplug=Hotplug.NONE if hotplug is Hotplug.AUTO else hotplug,
                             hotplug_why=f"policy.hotplug = \"{hotplug}\"")
        self.cluster_given = cluster is not None
        # "auto": what the definition allows (`_decide_hotplug`), and whether this boot
        # was asked for hot-unplug (`hotplug.unplug_policy`).
        self.by_definition = (self.policy.hotplug, self.policy.hotplug_why)
        self.unplug_asked = False
        self.lendee = cfg.lendee.domain
        # The state the parts read (`View`): only `apply` and `_load` write it.
        self.kept = Kept()
        self.cordoned_by_us = self.left_lent = False  # left_lent: see _load
        self.started_at = clock.now()
        self.boot_id = boot_id()
        self.host_booted = False  # this is the agent's first start since the host booted
        self.libvirt = primary.libvirt if primary else Libvirt(
            cfg.libvirt_uri, on_lifecycle=self.lifecycle, on_reconnect=self._reconnected)
        # The state file is written from a worker thread (its fsyncs may take seconds
        # on a busy disk, and nothing on the loop may wait for them); see `request`.
        self.saver = persisted.Saver(self.state_file)
        # Intents of requests waiting to be on disk before they are taken: every save
        # meanwhile includes them, so none overwrites them.
        self._unconfirmed: tuple[Intent, ...] = ()
        self._save_retry: asyncio.TimerHandle | None = None
        self._fatal: asyncio.Future[BaseException] | None = None
        self.metrics = metrics.Metrics(self.topo)
        # Told after each change of state, on the loop, with no I/O (MQTT).
        self.watchers: list[Callable[[], None]] = primary.watchers if primary else []
        # Set while the hook socket is served (`run` clears it until then): a lend waits
        # for it, so that the lendee's own prepare hook gets an answer.
        self.serving = asyncio.Event()
        self.serving.set()
        # Checks of real things, not "the process runs" (see hostagent.core.health).
        self.health = health.Health()
        self.health.add("libvirt", health.libvirt_alive(self.libvirt))
        self.health.add("hook socket", health.socket_answers(cfg.hook_socket, "hook socket"))
        self.health.add("last lend verified", self.metrics.lend_verified)
        self.health.add("state file", self._state_saved)
        # The parts, each given what it uses: actions to effects, the control verbs, the
        # journal record of each transition; progress flows from the last two to callers.
        self.progress: Progress = primary.progress if primary else Progress()
        cluster = cluster or NoCluster()
        self.executor = Executor(cfg, self.topo, self.kept, self.apply, libvirt=self.libvirt,
                                 cluster=cluster, progress=self.progress,
                                 lifecycle=self.lifecycle, fail=self.fail, serving=self.serving)
        self.reservations = Reservations(cfg, self.topo, self.kept, self.apply, cluster=cluster,
                                         saved=self.saver.flush)
        self.watchers.append(self.reservations.wake)
        self.verbs = Verbs(cfg, self.topo, self.policy, self.kept, self.apply,
                           request=self.request, libvirt=self.libvirt, cluster=cluster,
                           health=self.health, facts=self.executor.facts,
                           progress=self.progress, lifecycle=self.lifecycle,
                           reservations=self.reservations)
        self.recorder = Recorder(self.topo, self.policy, self.kept, self.progress, cfg.drain.stop)
        self.cluster = cluster
        self.parts = (self.executor, self.verbs, self.recorder, self.reservations)
        # /metrics, /healthz, the SSH endpoint and the control socket's access.
        self.endpoints = Endpoints(cfg, health=self.health, metrics=self.metrics,
                                   handlers=self.handlers, spawn=self.executor.spawn,
                                   lendees=tuple(self.whole.lendees))

    # The state, as the parts read it through `kept`.
    @property
    def state(self) -> State:
        return self.kept.state

    @state.setter
    def state(self, state: State) -> None:
        self.kept.state = state

    @property
    def phase_since(self) -> float:
        return self.kept.phase_since

    @phase_since.setter
    def phase_since(self, at: float) -> None:
        self.kept.phase_since = at

    @property
    def save_failed(self) -> str | None:
        """Why the last state save failed (None: saved); retried until it works."""
        return self.kept.save_failed

    @save_failed.setter
    def save_failed(self, why: str | None) -> None:
        if why != self.kept.save_failed:
            self.health.forget()  # the "state file" check reads it
        self.kept.save_failed = why

    # ---- the one place where state changes -----------------------------------------
    def apply(self, event: Event) -> bool:
        """Step the machine; persist, journal and act. False if the event was stale."""
        if self.fleet is not None:
            return self.fleet.apply(event, self.lendee)
        try:
            new, actions = machine.step(self.state, event, topo=self.topo, policy=self.policy)
        except machine.IllegalTransition as e:
            log.debug("ignored: %s", e)
            return False
        self.take(event, new, actions)
        return True

    def take(self, event: Event, new: State, actions: list[Action]) -> None:
        """`new`, the machine's step on `event`, and its `actions`: persist, journal, act."""
        old = self.state
        self.state = new
        self.metrics.transition(old, new, event)
        for intent in new.intents:
            if intent not in old.intents:
                self.recorder.intent(intent)
        if old.phase is not new.phase:
            self.recorder.phase(old, new, event)
            self.phase_since = clock.now()
        if _persisted(old) != _persisted(new):
            # Handed to the saver: the loop never waits for the disk. A request was on
            # disk before it got here (`request`); a fact is taken whatever the disk
            # says, and its save is retried.
            self._save()
        if old.ticket != new.ticket:
            self.executor.supervise(new.ticket)
        if (new.phase is Phase.LENT and old.ticket != new.ticket and not new.attaching
                and not new.detaching):
            # A step of LENT: it ends with the phase (see _supervise), and a hot-add or
            # a hot-unplug, which enter LENT anew, end it too: the node's count changes.
            self.executor.spawn(self.cluster.watch_lent(on_view=self._node_view), ticket=new.ticket)
            if not self.unplug_asked:  # once a boot: "auto" asks the guest and the node
                self.executor.spawn(self._decide_unplug(), ticket=new.ticket)
        if new.phase in (Phase.OFF, Phase.FAILED) and old.ticket != new.ticket:
            # Its node cordoned by us for long (a game, a human asked to look): a step
            # of the phase, which drops our marker if someone lifts the cordon meanwhile.
            self.executor.spawn(self.cluster.watch_cordon(), ticket=new.ticket)
        if new.phase is Phase.OFF and old.phase is not Phase.OFF and self.unplug_asked:
            self.unplug_asked = False  # the next boot is asked again; until then, its definition
            self.policy = replace(self.policy, hotplug=self.by_definition[0],
                                  hotplug_why=self.by_definition[1])
        if new.phase is Phase.OFF and old.phase not in (Phase.OFF, Phase.DRAINING,
                                                        Phase.STOPPING):
            # Down, and not by a reclaim (which cordoned it): a crash, a shutdown by
            # hand. Cordoned now, so that its return is verified before it takes work;
            # a step of OFF, so a slow cordon never lands after the next return.
            self.executor.spawn(self.cluster.lendee_down(why=f"{self.lendee} stopped"),
                                ticket=new.ticket)
        if new.regrow_waiting and not old.regrow_waiting:
            self.recorder.regrow_waits(new)
        for action in actions:
            self.executor.execute(action)
        if old.phase is not new.phase or old.intents != new.intents:
            journal.notify(self.status_line())
        for watch in self.watchers:
            watch()

    # ---- start-up --------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._fatal = loop.create_future()
        with contextlib.ExitStack() as locks:
            # The state directory and the sockets' (runtime) directory each: an agent
            # with another state_dir must not unlink and rebind the hook socket.
            dirs: dict[Path, str] = {}
            for key, directory in (("state_dir", self.cfg.state_dir),
                                   ("hook_socket", self.cfg.hook_socket.parent),
                                   ("control_socket", self.cfg.control_socket.parent)):
                dirs.setdefault(directory, key)
            for directory, key in dirs.items():
                try:
                    locks.enter_context(lock_agent(directory / "agent.lock"))
                except AlreadyRunning as e:
                    raise StartupError(str(e)) from e
                except OSError as e:
                    raise StartupError(f"{self.cfg.source}: {key}: cannot lock "
                                       f"{directory / 'agent.lock'}: {e.strerror or e}") from e
            await self._run(loop)

    def status_line(self) -> str:
        """systemd's STATUS line: of every lendee, where several lend."""
        return self.recorder.status_line() if self.fleet is None else self.fleet.status_line()

    def _members(self) -> list[Agent]:
        """Every lendee's agent, this one (the primary) first; [self] with one lendee."""
        if self.fleet is None:
            return [self]
        return [m for m in self.fleet.members.values() if isinstance(m, Agent)]

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        members = self._members()
        for m in members:
            m.serving.clear()
            m._fatal = self._fatal  # a bug in any lendee's step ends the agent
            m._load()
        if self.fleet is not None:
            self.fleet.spread()  # each request to the lendees that keep its owner
        await self.libvirt.connect()
        await self._check_domains()
        kubes = []
        for m in members:
            await m._decide_hotplug()
            kubes.append(await m._connect_cluster())
        if self.host_booted:
            # Asked before reality is read, so that the first lend leaves their GPUs
            # out instead of booting the lendee with them only to reclaim them at once.
            self._start_at_boot()
        # Reality first: until the machine knows what runs, its verdicts would be guesses.
        for m in members:
            await m._observe()
            if not m.state.phase.lendee_running:
                # Off at start (a reboot, a crash): no work before a verified lend.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(m.cluster.lendee_down(
                        why=f"{m.lendee} was found off at start"), 15)
        inbox = Inbox(self._on_hook)
        # What happened while the agent was down comes before anything live; a hook that
        # spooled in the moment before the socket existed is picked up by the second pass.
        replayed = await replay_spool(self.cfg.spool_dir, inbox, log=log)
        hooks = await serve_hooks(self.cfg.hook_socket, inbox, log=log)
        for m in members:
            m.serving.set()
        control = await serve_control(
            self.cfg.control_socket, self.handlers(), log=log, owners=(
                self.fleet.owners() if self.fleet is not None else self.topo.owners),
            **self._control_access())
        try:
            replayed += await replay_spool(self.cfg.spool_dir, inbox, log=log)
            await self.endpoints.serve_ssh()
            await self.endpoints.serve_metrics()
            self._serve_mqtt()
            if replayed:
                log.info("replayed %d hook event(s) spooled while the agent was down", replayed)
            journal.record("agent", self.recorder.running_line(self.status_line()),
                           result="ready")
            journal.notify(self.status_line(), ready=True)
            self.executor.spawn(self.reservations.run([m.reservations for m in members]))
            watchdog = journal.watchdog_interval()
            if watchdog:
                self.executor.spawn(self._watchdog(watchdog / 2))
            assert self._fatal is not None
            raise await self._fatal
        finally:
            stopping = self.host_stopping()
            for m in members:
                if stopping:
                    await m._drain_for_shutdown()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(m.cluster.flush_events(), 5)
            hooks.close()
            self.endpoints.close()
            control.close()
            for m in members:
                for task in list(m.executor.tasks):
                    task.cancel()
                await asyncio.gather(*m.executor.tasks, return_exceptions=True)
            await self.libvirt.close()
            for kube in kubes:
                if kube is not None:
                    await kube.close()
            for m in members:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(m.saver.flush(), EXIT_SAVE_BUDGET)

    async def _connect_cluster(self) -> Any:
        """The Kubernetes adapter, if configured (`kubewait.connect`); a kubeconfig that
        cannot be used yet makes the Kubernetes steps wait for it, health red."""
        if self.cfg.kubernetes is None or self.cluster_given:
            return None
        from hostagent.cluster.cycle import KubeCluster
        from hostagent.service import kubewait

        def make(kube: Any) -> Cluster:
            return KubeCluster(kube, self.cfg, remember_cordon=self._remember_cordon,
                               metrics=self.metrics)
        try:
            kube, self.cluster = await kubewait.connect(self.cfg, make)
        except kubewait.KubeConfigError as e:
            waiting = kubewait.WaitingCluster(f"{self.cfg.source}: kubernetes.kubeconfig: {e}")
            self.cluster, kube = waiting, None
            self.executor.spawn(waiting.run(self.cfg, make))
        self.health.add("kubernetes", health.kubernetes(self.cluster))  # type: ignore[arg-type]
        return kube

    def _start_at_boot(self) -> None:
        """The host booted: start the owners configured to start at boot, through the
        same road as a player's request (their GPUs are reclaimed first if need be)."""
        self._save()  # the boot id: once per boot, even if the agent restarts
        for vm, owner in sorted(self.whole.owners.items()):
            if owner.start_at_boot and vm not in self.state.running_owners:
                journal.record("boot", f"the host booted: starting {vm} ([owners.{vm}] "
                               "start_at_boot)", vm=vm, result="ok")
                self.apply(OwnerWants(at=clock.now(), owner=vm, intent_id=f"boot-{vm}",
                                      source=IntentSource.CONTROL))

    host_stopping = staticmethod(host_stopping)

    async def _drain_for_shutdown(self) -> None:
        """The host is going down with the lendee lent: cordon and drain its node now,
        while the API answers, so that it comes back cordoned and is uncordoned only
        once its GPUs are verified (the kubelet's own shutdown does not drain)."""
        if not self.state.phase.lendee_running:
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
            self.apply(GpuPods(at=clock.now(), count=pods))

    def _remember_cordon(self, ours: bool) -> None:
        # The marker on the Node is what uncordon trusts; the state file keeps a copy.
        if self.cordoned_by_us != ours:
            self.cordoned_by_us = ours
            self._save()

    async def request(self, event: OwnerWants, *, within: float | None = None) -> bool:
        """An owner's start request: taken (applied) only once it is on disk, without
        the loop waiting for the disk (invariant 4 and 12). False if it could not be
        written (`save_failed` says why), not `within` seconds, or was stale.

        A request that joins a pending one, or that completes at once, adds nothing to
        keep and is applied at once. A request given up on may still reach the file (its
        write was under way); the next save replaces it, and a crash before that starts
        the owner at the next start, which is what its caller asked for."""
        try:
            if self.fleet is not None:
                added = tuple({i.id: i for each in self.fleet.added(event).values()
                               for i in each}.values())
            else:
                new, _ = machine.step(self.state, event, topo=self.topo, policy=self.policy)
                added = tuple(i for i in new.intents if i not in self.state.intents)
        except machine.IllegalTransition:
            return self.apply(event)  # says why, and changes nothing
        if not added:
            return self.apply(event)
        # With several lendees the primary's file keeps every request (`_save`), so its
        # save is the one the request waits for.
        keeper = self if self.fleet is None else self._primary()
        keeper._unconfirmed += added
        durable = keeper._save()
        try:
            error = await asyncio.wait_for(asyncio.shield(durable), within)
        except TimeoutError:
            self.save_failed = (f"the disk did not take {self.state_file} within "
                                f"{within:g}s")
            return False
        finally:
            keeper._unconfirmed = tuple(i for i in keeper._unconfirmed if i not in added)
            if not durable.done():  # given up on: a state without it takes its place
                keeper._save()
        return error is None and self.apply(event)

    def fail(self, error: BaseException) -> None:
        """End `run` with `error` (a bug in a step: systemd restarts the agent)."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(error)

    def stop(self) -> None:
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(asyncio.CancelledError())

    def start(self) -> None:
        """The saved state read and events taken until `stop` or `fail`, nothing served:
        what `run` does first, for a test that drives the agent itself."""
        self._fatal = asyncio.get_running_loop().create_future()
        self._load()

    @property
    def ended(self) -> BaseException | None:
        """Why the agent stopped (`stop`, `fail`); None while it goes on."""
        return self._fatal.exception() if self._fatal and self._fatal.done() else None

    def _load(self) -> None:
        saved, warning = persisted.load_state(self.state_file)
        if warning:
            journal.record("state", warning, result="rebuilt", priority=journal.Priority.ERR)
        self.cordoned_by_us = saved.cordoned_by_us
        self.left_lent = saved.lendee_phase == Phase.LENT.value and not saved.cordoned_by_us
        intents = tuple(Intent(id=i.id, owner=i.owner, created_at=i.created.timestamp(),
                               source=i.source) for i in saved.intents)
        relend_at = saved.relend_at.timestamp() if saved.relend_at else None
        # A new kernel boot id: the host booted since the agent last ran (a first run,
        # with no id kept, is not taken for a boot: the host may have been up for days).
        self.host_booted = saved.boot_id is not None and saved.boot_id != self.boot_id
        self.state = State(intents=intents, hold=saved.hold, relend_at=relend_at,
                           reclaiming=saved.reclaiming, reservations=saved.reservations)

    def _save(self, state: State | None = None) -> asyncio.Future[OSError | None]:
        """Hand `state` (default: the current one) to the saver; the future says when
        it (or a later state) is on disk, or the OSError that kept it off.

        A failure (disk full, EIO, no descriptor left) never stops the agent: it is
        reported once in the journal and in health, and retried every few seconds.
        """
        state = state or self.state
        listed, reservations = state.intents, state.reservations
        if self.fleet is not None and self._primary() is not self:
            self._primary()._save()  # it keeps this lendee's requests too
        elif self.fleet is not None:
            listed, reservations = self.fleet.intents(), self.fleet.reservations()
        intents = (*listed, *(i for i in self._unconfirmed if i not in listed))
        snapshot = persisted.State(
            intents=tuple(persisted.Intent(
                id=i.id, owner=i.owner, source=i.source,
                created=datetime.fromtimestamp(i.created_at, UTC))
                for i in intents),
            cordoned_by_us=self.cordoned_by_us,
            hold=state.hold,
            reclaiming=state.reclaiming,
            boot_id=self.boot_id,
            relend_at=(datetime.fromtimestamp(state.relend_at, UTC)
                       if state.relend_at is not None else None),
            reservations=reservations,
            lendee_phase=state.phase.value,
            lendee_phase_since=datetime.fromtimestamp(self.phase_since, UTC))
        durable = self.saver.submit(snapshot)
        durable.add_done_callback(self._saved)
        return durable

    def _primary(self) -> Agent:
        """The agent that serves the endpoints and keeps every request on disk."""
        return self._home(self.fleet.primary.lendee) if self.fleet is not None else self

    def _saved(self, durable: asyncio.Future[OSError | None]) -> None:
        if durable.cancelled() or durable.exception() is not None:
            return  # the agent is stopping, or a bug the saver's task reports
        error = durable.result()
        if error is None:
            if self.save_failed is not None:
                journal.record("state", f"{self.state_file} is written again", result="ok")
                self.save_failed = None
            return
        why = f"cannot write {self.state_file}: {error.strerror or error}"
        if why != self.save_failed:
            journal.record("state", f"{why}; requests that cannot be recorded are refused "
                           "and the save is retried (free space on its filesystem?)",
                           result="failed", priority=journal.Priority.ERR)
        self.save_failed = why
        if self._save_retry is None:
            self._save_retry = asyncio.get_running_loop().call_later(5.0, self._retry_save)

    def _retry_save(self) -> None:
        self._save_retry = None
        self._save()

    async def _state_saved(self) -> str | None:
        """Health: fails while the state file refuses saves."""
        if self.save_failed is not None:
            raise health.CheckFailed(self.save_failed)
        return f"{self.state_file} is up to date"

    async def _check_domains(self) -> None:
        """A configured domain libvirt lacks is said, and health is red until it is
        defined again; only what needs it waits (DESIGN.md invariant 13)."""
        lendees = ({"lendee.domain": self.lendee} if self.fleet is None else
                   {f"lendees.{n}": n for n in self.fleet.members})
        wanted = {**lendees, **{f"owners.{d}": d for d in self.whole.owners}}
        probe = health.domains_defined(self.libvirt, wanted, self.cfg.source)
        self.health.add("domains", probe)
        try:
            await probe()
        except health.CheckFailed as e:
            journal.record("config", f"{e}; hostagent goes on without it meanwhile",
                           result="waiting", priority=journal.Priority.WARNING)

    async def _decide_hotplug(self) -> None:
        """policy.hotplug = "auto": what lint finds the lendee's definition can do."""
        if self.cfg.policy.hotplug is not Hotplug.AUTO:
            return
        try:
            dom = lint.parse_domain(await self.libvirt.inactive_xml(self.lendee))
            how, why = lint.hotplug_capability(dom, self.cfg)
        except (HostError, ValueError) as e:
            how, why = Hotplug.NONE, f"{self.lendee}'s definition could not be read: {e}"
        self.policy = replace(self.policy, hotplug=how,
                              hotplug_why=f'policy.hotplug = "auto": {why}')
        self.by_definition = (how, self.policy.hotplug_why)
        changes = lint.changes(how, self.policy.regrow, self.policy.regrow_max_wait)
        journal.record("policy", f"{self.lendee}'s GPUs change {changes} ({why})",
                       vm=self.lendee, result=how.value)

    async def _decide_unplug(self) -> None:
        self.policy = await hotplug.unplug_policy(self.executor, self.policy)
        self.unplug_asked = True

    async def _observe(self) -> None:
        running = await self.libvirt.running_domains()
        lent = None
        if self.lendee in running:
            # Its live definition says which GPUs this boot got (partial lending). A
            # domain in the middle of stopping may keep that read waiting, and events
            # that come meanwhile are lost on a machine that has not read reality yet:
            # bounded, then the running set is read again.
            with contextlib.suppress(HostError, TimeoutError):
                lent = await asyncio.wait_for(self.libvirt.live_gpus(
                    self.lendee, self.executor.lendee_gpu_config()), 5)
            running = await self.libvirt.running_domains()
        lent = lent & self.topo.lendee_gpus if lent and self.lendee in running else None
        adopt = await self.executor.adoptable(lent, saved_lent=self.left_lent)
        self.left_lent = False  # only the first read after a start finds the saved phase
        self.apply(Observed(at=clock.now(), lendee_running=self.lendee in running,
                            owners_running=frozenset(running & set(self.topo.owners)),
                            lendee_gpus=lent, adopt=adopt))
        self.executor.spawn(self.executor.groups())

    def _reconnected(self) -> None:
        for m in self._members():
            m.executor.spawn(m._observe())

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
            return await self._prepare(event)
        if (event.op, event.sub) == ("release", "end"):
            # The owner's devices are released: the surest sign it stopped (or that a
            # start the hook let through failed).
            self.lifecycle(event.domain, Lifecycle.STOPPED)
        return Verdict("proceed")

    async def _prepare(self, event: HookEvent) -> Verdict:
        """libvirt's ``prepare begin``: the machine's verdict, and what it implies."""
        vm = event.domain
        home = self._home(vm)
        if home is not self:
            return await home._prepare(event)
        gpus = None
        if vm == self.lendee:
            # The definition being started says whether it is the agent's own start.
            with contextlib.suppress(ValueError):
                gpus = devices.gpus_in(event.xml, self.executor.lendee_gpu_config())
        decision, message = (self.fleet.verdict(vm, gpus) if self.fleet is not None else
                             machine.verdict(self.state, vm, topo=self.topo, gpus=gpus,
                                             policy=self.policy))
        if decision == "refuse":
            journal.record("refuse", f"refused the start of {vm}: {message}", vm=vm,
                           result="refused")
            return Verdict("defer", message)  # the hook's one way to say no
        if decision == "proceed":
            if self.topo.is_owner(vm) and vm not in self.state.running_owners:
                # It claims its GPUs until it runs or its start ends (release end).
                self.apply(OwnerStarting(at=clock.now(), owner=vm))
            return Verdict("proceed", message)
        if self.topo.is_owner(vm):
            # On disk before the hook hears "defer" (invariant 4), within the part of
            # the hook's budget it gets: a busy disk makes a clear refusal.
            recorded = await self.request(OwnerWants(at=clock.now(), owner=vm, intent_id=event.id,
                                                     source=IntentSource.HOOK),
                                          within=HOOK_SAVE_BUDGET)
            if not recorded and self.save_failed and not self.state.intents_of(vm):
                message = (f"hostagent could not record the request to start {vm} "
                           f"({self.save_failed}), so it will not start it by itself: "
                           "start it again once the state file can be written")
                journal.record("defer", f"refused the start of {vm}: {message}", vm=vm,
                               result="refused", priority=journal.Priority.ERR)
                return Verdict("defer", message)
        journal.record("defer", f"deferred the start of {vm}: {message}", vm=vm,
                       result="deferred")
        return Verdict("defer", message)

    def _home(self, domain: str) -> Agent:
        """The agent that handles `domain` (`Fleet.home`): this one with one lendee."""
        home = self.fleet.home(domain) if self.fleet is not None else self
        assert isinstance(home, Agent)
        return home

    def lifecycle(self, domain: str, kind: Lifecycle) -> None:
        if self.fleet is not None and self._primary() is self:
            # Each event to the agent it concerns (a lendee's, an owner's home); another
            # VM's to every lendee (IOMMU groups), a stop to every executor waiting.
            home = self._home(domain)
            members = [m for m in self.fleet.members.values() if isinstance(m, Agent)]
            if kind is Lifecycle.STOPPED:
                for m in members:
                    m.executor.facts.stopped.setdefault(domain, asyncio.Event()).set()
            if home is not self:
                home.lifecycle(domain, kind)
                return
            if domain not in self.fleet.members and not self.topo.is_owner(domain):
                for m in members[1:]:
                    m.lifecycle(domain, kind)
        now = clock.now()
        if kind is Lifecycle.STOPPED:
            self.executor.facts.stopped.setdefault(domain, asyncio.Event()).set()
        if kind is Lifecycle.AGENT_CONNECTED:
            self.executor.agent_connected.set()
            return
        if kind is Lifecycle.DEVICE_REMOVED:
            if domain == self.lendee:
                self.executor.device_removed.set()
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
                                   f"{self.topo.gpu_names(self.topo.owners[domain])}",
                                   vm=domain, from_="off", to="running", result="ok",
                                   holders=self.recorder.holders())
            elif kind is Lifecycle.STOPPED and domain in self.state.starting_owners:
                if self.apply(OwnerStopped(at=now, owner=domain)):
                    journal.record("owner", f"{domain}'s start ended without it running: "
                                   f"{self.topo.gpu_names(self.topo.owners[domain])} no longer "
                                   "claimed", vm=domain, from_="starting", to="off",
                                   result="failed", holders=self.recorder.holders())
            elif kind is Lifecycle.STOPPED and running:
                if self.apply(OwnerStopped(at=now, owner=domain)):
                    then = (f"lending them back in {self.policy.relend_delay:g}s"
                            if self.state.relend_at else "they stay free")
                    gpus = self.topo.gpu_names(self.topo.owners[domain])
                    journal.record("owner", f"{domain} stopped: {gpus} free; {then}",
                                   vm=domain, from_="running", to="off", result="ok",
                                   holders=self.recorder.holders())
        else:  # another VM: what it holds of the lendee's GPUs' IOMMU groups
            self.executor.spawn(self.executor.groups(domain if kind is Lifecycle.STOPPED else None))

    async def _watchdog(self, interval: float) -> None:
        # Sent from the loop itself: a blocked loop stops the pings and systemd restarts us.
        while True:
            journal.notify(watchdog=True)
            await asyncio.sleep(interval)

    def handlers(self) -> dict[str, Any]:
        """The verbs the control socket, SSH and MQTT serve (`Fleet.handlers`)."""
        mine: dict[str, Any] = dict(self.verbs.handlers())
        return mine if self.fleet is None else self.fleet.handlers(mine, lambda vm: dict(
            self._home(vm).verbs.handlers()), self._status)

    def _status(self) -> dict[str, Any]:
        """status' data: with several lendees, of each one (`Fleet.status`)."""
        return self.verbs.status() if self.fleet is None else self.fleet.status(
            {m.lendee: m.verbs.status() for m in self._members()})

    def _control_access(self) -> dict[str, Any]:
        return self.endpoints.control_access()

    def _serve_mqtt(self) -> None:
        """The Home Assistant device when [mqtt] is configured (see hostagent.surfaces.mqtt): its
        own task, told of each change; a broker that is down or slow delays nothing."""
        if self.cfg.mqtt is None:
            return
        from hostagent.surfaces.mqtt import Device  # aiomqtt only where it is used
        device = Device(self.whole, status=self._status, handlers=self.handlers(),
                        follow=self.progress.following)
        self.watchers.append(device.changed)
        device.changed()
        self.executor.spawn(device.run())

