"""The executor: each action of the machine becomes one supervised step.

A step is a task. The lendee's steps (drain, waits, shutdown, the return to the cluster)
belong to the phase that started them, named by its ticket: when the phase moves on
they are cancelled, and the next phase's steps await them before touching anything
(`spawn`, `supervise`), so a stale return can never uncordon a node in the middle of a
new drain. Every step reports what happened as an event, through the agent's `apply`;
none changes the state itself. A step that fails unexpectedly ends the process, and
systemd restarts it: the restart resumes from libvirt and the state file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hostagent.core import clock, levers, machine
from hostagent.service import hotplug, poweroff
from hostagent.surfaces import notify
from hostagent.host import iommu, journal, lint, screenshots
from hostagent.host import gpus as inventory
from hostagent.host import verify as in_guest
from hostagent.core.config import Config, VerifyMethod
from hostagent.core.text import clean
from hostagent.host.libvirt import DomainNotFound, Domains, HookRefused, HostError, Lifecycle
from hostagent.core.model import (
    Action,
    AgentTimeout,
    AgentUp,
    AttachGpus,
    CancelRelend,
    CompleteIntent,
    DetachGpus,
    Drain,
    Drained,
    DrainFailed,
    FailIntent,
    ForceOff,
    GroupsHeld,
    GroupsTaken,
    KubeReturn,
    LendeeStopped,
    Phase,
    RelendDue,
    ReturnDone,
    ReturnFailed,
    ScheduleRelend,
    ShutdownLendee,
    ShutdownTimeout,
    StartFailed,
    StartLendee,
    StartOwner,
    Topology,
    VmStopped,
    WaitAgent,
)
from hostagent.service.parts import Apply, Cluster, Facts, Progress, View

log = logging.getLogger("hostagent")


class Executor:
    """Runs the machine's actions: effects through the adapters (`libvirt`, `cluster`),
    each reported through `apply`. `lifecycle` is the agent's reading of a libvirt event
    (a start's that was lost), `fail` ends the agent (a bug in a step), and no step of
    the lendee's begins before `serving` is set (its own hook must find the socket)."""

    sysfs: Path = inventory.SYSFS  # where the IOMMU groups are read (`iommu.holders`)

    def __init__(self, cfg: Config, topo: Topology, view: View, apply: Apply, *,
                 libvirt: Domains, cluster: Cluster, progress: Progress,
                 lifecycle: Callable[[str, Lifecycle], None],
                 fail: Callable[[BaseException], None], serving: asyncio.Event) -> None:
        self.cfg, self.topo, self.view, self.apply = cfg, topo, view, apply
        self.libvirt, self.cluster, self.progress = libvirt, cluster, progress
        self.lifecycle, self.fail, self.serving = lifecycle, fail, serving
        self.lendee = topo.lendee
        self.facts = Facts()
        self.tasks: set[asyncio.Task[None]] = set()
        # The lendee's steps, by the ticket of the phase that started them: a step is
        # cancelled, and awaited, when its phase ends (see supervise).
        self._steps: dict[asyncio.Task[None], int] = {}
        self._relend: asyncio.TimerHandle | None = None
        # Set when libvirt sees the lendee's qemu-ga connect: wakes the guest-ping wait.
        self.agent_connected = asyncio.Event()
        # Set when libvirt says the lendee let a device go: wakes a hot-unplug's wait.
        self.device_removed = asyncio.Event()
        # The last drain ended with every evicted pod gone: its shutdown may be a
        # power-off (drain.stop); taken by that shutdown.
        self._emptied = False

    def execute(self, action: Action) -> None:
        match action:
            case Drain(ticket=t, regrow=regrow):
                self.spawn(self._drain(t, regrow), action)
            case WaitAgent(ticket=t):
                self.spawn(self._wait_agent(t), action)
            case ShutdownLendee(ticket=t):
                self.spawn(self._shutdown(t), action)
            case ForceOff(ticket=t, reason=why):
                self.spawn(self._force_off(t, why), action)
            case StartOwner(owner=owner):
                self.spawn(self._start(owner, action), action)
            case StartLendee(gpus=gpus):
                self.spawn(self._start(self.lendee, action, gpus), action)
            case KubeReturn(ticket=t, restart_plugins=restart):
                self.spawn(self._give_back(t, restart), action)
            case AttachGpus(ticket=t, gpus=gpus):
                self.spawn(hotplug.hot_add(self, t, gpus), action)
            case DetachGpus(ticket=t, gpus=gpus):
                self.spawn(hotplug.hot_unplug(self, t, gpus), action)
            case ScheduleRelend(at=at):
                self._cancel_relend()
                self._relend = asyncio.get_running_loop().call_later(
                    max(0.0, at - clock.now()), self._relend_due)
            case CancelRelend():
                self._cancel_relend()
            case CompleteIntent(intent_id=iid, owner=owner):
                journal.record("intent", f"{owner} is running, as asked", vm=owner,
                               to="done", result="ok", intent=iid)
                self.progress.answer(iid, True, f"{owner} is running")
            case FailIntent(intent_id=iid, owner=owner, reason=reason):
                journal.record("intent", f"could not start {owner}: {reason}", vm=owner,
                               to="failed", result="failed", intent=iid,
                               priority=journal.Priority.ERR)
                self.progress.answer(iid, False, reason)
            case _:
                raise AssertionError(f"unhandled action {action}")

    def _relend_due(self) -> None:
        if not self.serving.is_set():
            # Starting up: the lendee's own hook must find the socket, or it is spooled
            # and its start goes through unanswered. Fired once the agent serves it.
            self._relend = asyncio.get_running_loop().call_later(0.05, self._relend_due)
            return
        self._relend = None
        self.apply(RelendDue(at=clock.now()))

    def _cancel_relend(self) -> None:
        if self._relend is not None:
            self._relend.cancel()
            self._relend = None

    def spawn(self, coro: Coroutine[Any, Any, None], action: Action | None = None, *,
               ticket: int | None = None) -> None:
        ticket = getattr(action, "ticket", ticket)
        # A step of the lendee's waits for the steps of earlier phases to be gone.
        previous = [t for t, n in self._steps.items() if ticket is not None and n != ticket]
        task = asyncio.get_running_loop().create_task(self._guard(coro, action, previous))
        # A step cancelled before it began was never awaited: close it (no warning).
        task.add_done_callback(lambda _: coro.close())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if ticket is not None:
            self._steps[task] = ticket
            task.add_done_callback(lambda t: self._steps.pop(t, None))

    def supervise(self, ticket: int) -> None:
        """A new phase began: cancel every step of the earlier ones (a drain, a return to
        the cluster, a wait). The next step awaits them before it touches anything, and
        a step whose ticket is stale never acts (it is cancelled at its next await)."""
        me = asyncio.current_task()
        for task, n in list(self._steps.items()):
            if n != ticket and task is not me:
                task.cancel()

    def _wanted(self, action: Action) -> bool:
        """An action can go stale between being issued and running (see the machine)."""
        if machine.still_wanted(self.view.state, action, topo=self.topo):
            return True
        log.debug("skipped, no longer wanted: %s", action)
        return False

    async def _guard(self, coro: Coroutine[Any, Any, None], action: Action | None,
                     previous: list[asyncio.Task[None]] | None = None) -> None:
        if previous:
            await asyncio.gather(*previous, return_exceptions=True)
        if action is not None and not self._wanted(action):
            return  # never awaited: spawn's done callback closes it
        # A bug in one action must not wedge the agent silently: end the process and let
        # systemd restart it; the restart resumes from libvirt and the state file.
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("an action failed unexpectedly; stopping so that systemd restarts us")
            self.fail(e)

    def _current(self, ticket: int) -> bool:
        return self.view.state.ticket == ticket

    async def _drain(self, ticket: int, regrow: bool) -> None:
        state = self.view.state
        owners = [*state.waiting_owners, *(f"{o}'s reservation" for o in sorted(state.reserved))]
        if self.cfg.notify is not None:  # told first, the drain waiting a moment at most
            await notify.before_drain(self.cfg.notify, {
                "event": "drain", "host": socket.gethostname(), "node": self.cfg.lendee.node,
                "lendee": self.lendee, "for": list(state.waiting_owners),
                "reservations": sorted(state.reserved), "regrow": regrow,
                "time": datetime.now(UTC).isoformat(timespec="seconds")})
        held = [r.at for r in state.reservations if r.holding]
        self._emptied = False
        emptied = self._node_emptied
        # A player waiting: the pods' grace capped, the shutdown once the evictions are
        # accepted (levers 1 and 2); else kubectl's drain, each pod its full grace.
        terms = levers.terms(self.cfg.drain, players_waiting=bool(state.waiting_owners),
                             regrow=regrow)
        if held and not state.waiting_owners and not regrow:
            # For reservations alone: their pods were told, and may take their full
            # grace period until the reserved time (its margin is for the shutdown).
            until = min(held) - clock.now()
            problem = await self.cluster.reclaim(owners, regrow=regrow, until=until,
                                                 terms=terms, emptied=emptied)
        elif terms.early_shutdown:
            problem = await self._drain_until_accepted(owners, terms)
        else:
            problem = await self.cluster.reclaim(owners, regrow=regrow, terms=terms,
                                                 emptied=emptied)
        if problem is None:
            self.apply(Drained(at=clock.now(), ticket=ticket))
        else:
            self.apply(DrainFailed(at=clock.now(), ticket=ticket, reason=problem))

    def _node_emptied(self) -> None:
        self._emptied = True

    async def _drain_until_accepted(self, owners: list[str], terms: levers.Terms) -> str | None:
        """The reclaim, until every eviction is accepted (or it ends before): then its
        rest, the wait for the pods to go, runs beside the shutdown (not a step of the
        phase: the next step does not wait for it), bounded by timeouts.drain and
        journaled when it ends. The owner still starts only once the lendee is off."""
        accepted = asyncio.Event()
        work = asyncio.ensure_future(self.cluster.reclaim(owners, terms=terms,
                                                          accepted=accepted.set))
        told = asyncio.ensure_future(accepted.wait())
        try:
            await asyncio.wait({work, told}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            told.cancel()
        if work.done():
            return work.result()
        journal.record("drain", f"every eviction from {self.lendee}'s node was accepted: "
                       "its VM shuts down while the pods stop (drain.shutdown_when = "
                       "\"accepted\")", vm=self.lendee, result="accepted")
        self.spawn(self._drain_rest(work))
        return None

    async def _drain_rest(self, work: asyncio.Future[str | None]) -> None:
        problem = await work
        if problem is not None:
            journal.record("drain", f"after the shutdown began: {problem}", vm=self.lendee,
                           result="incomplete", priority=journal.Priority.WARNING)

    async def _wait_agent(self, ticket: int) -> None:
        """guest-ping until it answers, bounded: the agent needs 30-60 s in a fresh VM.

        libvirt tells us when qemu-ga connects its port, so the wait is mostly asleep;
        the pings with backoff are what decides (a connected agent may still not answer).
        """
        deadline = time.monotonic() + self.cfg.timeouts.guest_agent
        delay = 1.0
        while self._current(ticket):
            self.agent_connected.clear()
            try:
                if await self.libvirt.ping_agent(self.lendee, timeout=3):
                    self.apply(AgentUp(at=clock.now(), ticket=ticket))
                    return
            except DomainNotFound:
                pass
            try:
                running = await self.libvirt.is_running(self.lendee)
            except HostError:
                running = True  # libvirt cannot tell now: keep waiting
            if not running:
                # Level-triggered: it stopped and the event was lost (a restart of the
                # agent while libvirtd was stopping it). Reality says off.
                if self._current(ticket):
                    self.apply(LendeeStopped(at=clock.now()))
                return
            left = deadline - time.monotonic()
            if left <= 0:
                if self.view.state.phase is Phase.BOOTING:
                    await self._screenshot_dead_boot()
                self.apply(AgentTimeout(at=clock.now(), ticket=ticket))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.agent_connected.wait(), min(delay, left))
            delay = min(delay * 1.5, 5.0)

    async def _shutdown(self, ticket: int) -> None:
        stopped = self.facts.stopped.setdefault(self.lendee, asyncio.Event())
        stopped.clear()
        emptied, self._emptied = self._emptied, False
        off = await poweroff.when_drained(self.cfg.drain, self.libvirt, self.lendee,
                                          emptied=emptied)
        for attempt in range(0 if off else 3):  # else the guest's own shutdown
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
            self.apply(ShutdownTimeout(at=clock.now(), ticket=ticket))
        elif self.view.state.phase is not Phase.OFF:
            self.apply(LendeeStopped(at=clock.now()))  # the event was lost; reality says off

    async def _force_off(self, ticket: int, why: str = "") -> None:
        """Destroy the lendee after policy.force_off_after (none if unset). `why`: the
        machine's own reason (a guest stuck letting a GPU go), said as it is."""
        grace = self.cfg.policy.force_off_after or 0.0
        said = (why or f"{self.lendee} did not shut down: forcing it off in {grace:g}s as "
                "policy.force_off_after allows")
        if why and grace:
            said += f" (in {grace:g}s, policy.force_off_after)"
        journal.record("force-off", said, vm=self.lendee,
                       result="forced", priority=journal.Priority.WARNING)
        await asyncio.sleep(grace)
        if self._current(ticket):
            try:
                await self.libvirt.destroy(self.lendee)
            except HostError as e:
                # Its QEMU may hang in the kernel letting a device go: only a human (or a
                # host reboot) frees the GPUs then, and whoever waits must hear why.
                journal.record("force-off", f"{self.lendee} could not be powered off: "
                               f"{clean(e, 200)}; its GPUs stay held until it stops "
                               f"(virsh destroy {self.lendee}, else a host reboot)",
                               vm=self.lendee, result="failed",
                               priority=journal.Priority.ERR)

    async def _start(self, vm: str, action: Action,
                     gpus: frozenset[str] | None = None) -> None:
        """Start a VM; a failed start is retried twice with jittered backoff (starting a
        running VM is a no-op, so retrying is safe), all within timeouts.start. A start
        a hook refused is not retried: it would only be refused again.
        Unless policy.lint_before_start is off, a VM whose XML has errors on this host
        is not started: the finding is in the journal and the start fails with it.
        The lendee starts with `gpus` only: a live definition for this boot, without the
        others' devices; its persistent definition is never edited.
        Whether the start is still wanted is asked again just before libvirt is (the
        request may have been withdrawn meanwhile); from then until its outcome is
        applied, `vm` is in `starting`: a start that can no longer be withdrawn.
        A VM is not started with GPUs whose IOMMU group another running VM holds part of
        (`iommu.holders`): an owner's start fails with the group, the device and the VM;
        the lendee's is reported as `GroupsHeld`, for the machine to start it without."""
        labels = self.cfg.owners[vm].gpus if gpus is None and vm != self.lendee else gpus
        held, why = await self.held_groups(vm, frozenset(labels or ()))
        if held and vm == self.lendee and gpus is not None:
            await self.report_held(GroupsHeld(at=clock.now(), gpus=gpus, held=held, reason=why))
            return
        if held:
            self.apply(StartFailed(at=clock.now(), vm=vm, reason=why))
            return
        if self.cfg.policy.lint_before_start:
            refusal = await self._lint_before_start(vm)
            if refusal is not None:
                self.apply(StartFailed(at=clock.now(), vm=vm, reason=refusal))
                return
        deadline = time.monotonic() + self.cfg.timeouts.start
        for attempt in range(3):
            if not self._wanted(action):
                return
            self.facts.starting.add(vm)
            try:
                if await self._start_once(vm, gpus, attempt, deadline):
                    return
            finally:
                self.facts.starting.discard(vm)

    async def _start_once(self, vm: str, gpus: frozenset[str] | None, attempt: int,
                          deadline: float) -> bool:
        """One attempt of `_start`; False: try again (after a pause, taken here)."""
        try:
            libvirt = self.libvirt
            start = (libvirt.start(vm) if gpus is None else libvirt.start_with(
                vm, drop=self.topo.lendee_gpus - gpus, gpus=self.lendee_gpu_config()))
            await asyncio.wait_for(start, deadline - time.monotonic())
        except HookRefused as e:
            self.apply(StartFailed(at=clock.now(), vm=vm, reason=e.sentence or str(e)))
            return True
        except DomainNotFound as e:
            self.apply(StartFailed(at=clock.now(), vm=vm, reason=str(e)))
            return True
        except (HostError, TimeoutError) as e:
            reason = str(e) or f"no answer within {self.cfg.timeouts.start:g}s"
            pause = (1 + attempt) * (0.5 + random.random())
            if attempt == 2 or time.monotonic() + pause >= deadline:
                self.apply(StartFailed(at=clock.now(), vm=vm, reason=reason))
                return True
            log.warning("starting %s failed (%s); retrying in %.1fs", vm, reason, pause)
            self.facts.starting.discard(vm)  # withdrawable again until the next attempt
            await asyncio.sleep(pause)
            return False
        # The lifecycle event normally got here first; if it was lost, reality decides:
        # a domain that is already gone again (its QEMU exited at once) did not start.
        try:
            running = await self.libvirt.is_running(vm)
        except HostError:
            return True  # libvirt cannot tell now: its events, or a reconnect's reread, will
        if running:
            self.lifecycle(vm, Lifecycle.STARTED)
        else:
            self.apply(StartFailed(at=clock.now(), vm=vm, reason=(
                "it stopped right after libvirt started it (its QEMU log, "
                f"/var/log/libvirt/qemu/{vm}.log, says why)")))
        return True

    async def held_groups(self, vm: str, gpus: frozenset[str]) -> tuple[dict[str, str], str]:
        """Those of `gpus` whose IOMMU group another running VM holds part of, each with
        that VM (`iommu.holders`), and why `vm` was given none of `gpus`, journaled."""
        config = {g: self.cfg.gpus[g] for g in gpus if g in self.cfg.gpus}
        found = await iommu.holders(self.libvirt, vm, config, self.sysfs)
        if not found:
            return {}, ""
        why = "; ".join(found[label][1] for label in sorted(found))
        journal.record("iommu", f"{vm} may not take {', '.join(sorted(gpus))}: {why}",
                       vm=vm, result="refused", gpus=",".join(sorted(gpus)),
                       priority=journal.Priority.ERR)
        held = {label: other for label, (other, _) in found.items()}
        return held, f"hostagent did not give {vm} {', '.join(sorted(gpus))}: {why}"

    async def report_held(self, event: GroupsHeld) -> None:
        """Apply `event`, naming only the VMs that still run: the stop of one that stopped
        since it was read came before the machine knew it held a group, and would be
        lost on it (held for none, the GPUs are tried again at once)."""
        with contextlib.suppress(HostError):
            running = await self.libvirt.running_domains()
            event = replace(event, held={g: vm for g, vm in event.held.items() if vm in running})
        self.apply(event)

    async def groups(self, stopped: str | None = None) -> None:
        """The IOMMU groups of the lendee's GPUs that other VMs hold: those `stopped` (a VM
        neither the lendee nor an owner) held are free (`VmStopped`); else (another VM
        started, or the agent read the world anew) those the running VMs hold now
        (`GroupsTaken`), so that no regrow by restart is begun for GPUs it cannot get."""
        if stopped is not None:
            self.apply(VmStopped(at=clock.now(), vm=stopped))
            return
        found = await iommu.holders(self.libvirt, self.lendee, self.lendee_gpu_config(),
                                    self.sysfs)
        if found and self.apply(GroupsTaken(at=clock.now(), held={
                label: other for label, (other, _) in found.items()})):
            journal.record("iommu", f"{self.lendee} may not take {', '.join(sorted(found))} "
                           f"now: {'; '.join(found[g][1] for g in sorted(found))}",
                           vm=self.lendee, result="held", gpus=",".join(sorted(found)))

    def lendee_gpu_config(self) -> dict[str, Any]:
        """The configured GPUs the lendee may borrow, by label (their PCI functions)."""
        return {label: self.cfg.gpus[label] for label in self.topo.lendee_gpus
                if label in self.cfg.gpus}

    async def adoptable(self, lent: frozenset[str] | None, *, saved_lent: bool) -> bool:
        """Whether the running lendee, with `lent` (its live set), is in service as the
        last lend left it (`Observed.adopt`): it was lent then (`saved_lent`: the phase
        saved, with no cordon of ours; or the phase before a libvirt reconnect, with no
        live change under way) and its node says so now. Why not is journaled: the lend
        is then verified again."""
        state = self.view.state
        was_lent = saved_lent or (state.phase is Phase.LENT and not state.attaching
                                  and not state.detaching)
        if not was_lent or not lent:
            return False
        try:
            why = await asyncio.wait_for(self.cluster.adopt(lent), 30)
        except TimeoutError:
            why = "the cluster did not answer within 30s"
        if why is not None:
            journal.record("adopt", f"{self.lendee} runs with {self.topo.gpu_names(lent)} but "
                           f"is not taken back as lent: {clean(why, 500)}; its lend is "
                           "verified again", vm=self.lendee, result="replayed")
        return why is None

    async def _give_back(self, ticket: int, restart_plugins: bool = False) -> None:
        # What the driver in the guest sees comes first: the cluster's return uncordons.
        lent = self.view.state.lent
        problem = await self._verify_gpus(ticket, lent)
        if not self._current(ticket):
            return
        if problem is None:
            problem = await self.cluster.give_back(lent, restart_plugins=restart_plugins,
                                                   boot_id=self._guest_boot_id)
        if problem is None:
            self.apply(ReturnDone(at=clock.now(), ticket=ticket))
        else:
            self.apply(ReturnFailed(at=clock.now(), ticket=ticket, reason=problem))

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
        has always loaded, and the uncordon waits on the query that finds it, so the
        queries come soon after one another (0.25 s, then at most a second apart: one
        nvidia-smi at a time in the guest). The outcome is one journal record, an error
        naming the missing GPUs and the usual causes when it fails."""
        method = self.cfg.verify.method
        if method is VerifyMethod.NONE:
            return None
        expected = [in_guest.Expected(label=label, uuid=gpu.uuid if gpu else None,
                                      name=gpu.name if gpu else None)
                    for label in sorted(lent)
                    for gpu in [self.cfg.gpus.get(label)]]
        deadline = time.monotonic() + self.cfg.verify.timeout
        pause = 0.25
        while True:
            bound = max(1.0, min(30.0, deadline - time.monotonic()))
            try:
                outcome = await self._ask_guest(expected, bound)
            except (HostError, in_guest.VerifyError) as e:
                outcome = in_guest.Outcome(seen=(), missing=tuple(expected), problem=(
                    f"could not run {self.cfg.verify.command} through {method}: {e}"))
            left = deadline - time.monotonic()
            if outcome.ok or not self._current(ticket) or left <= 0:
                break
            await asyncio.sleep(min(pause, left))
            pause = min(1.0, pause * 2)
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
            names = self.topo.gpu_names(tuple(leaked))
            summary = (f"the driver in {self.lendee} also sees {names}, "
                       "which this boot did not lend it (its live definition was not applied)")
        self.facts.verified = {"at": clock.now(), "ok": ok, "summary": summary}
        if ok:
            journal.record("verify", summary, vm=self.lendee, result="ok", method=method.value,
                           gpus=",".join(g.uuid for g in outcome.seen))
            return None
        journal.record("verify", f"{summary}; {in_guest.CAUSES}", vm=self.lendee,
                       result="mismatch", method=method.value, priority=journal.Priority.ERR,
                       missing=",".join(g.label for g in outcome.missing) or ",".join(leaked))
        return summary

    async def _guest_boot_id(self) -> str:
        """The lendee's boot id, through the guest agent (invariant 14: the node's
        status counts only once its bootID is this). Raises in_guest.VerifyError."""
        async def run(path: str, args: list[str]) -> tuple[int, str, str]:
            done = await self.libvirt.guest_exec(self.lendee, path, args, timeout=10)
            return done.exitcode, done.stdout, done.stderr

        return await in_guest.boot_id(run)

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
            done = await self.libvirt.guest_exec(self.lendee, command,
                                                      list(in_guest.QUERY),
                                                 timeout=timeout)
            return done.exitcode, done.stdout, done.stderr

        return await in_guest.query(expected, run, self.cfg.verify.command)

    async def _screenshot_dead_boot(self) -> None:
        """The lendee's guest agent never answered after its start: keep its screen,
        the one witness left (a UEFI shell, an installer, firmware stuck on a ROM)."""
        lendee = self.lendee
        waited = f"{self.cfg.timeouts.guest_agent:g}s"
        try:
            mime, data = await self.libvirt.screenshot(lendee)
            path = await asyncio.to_thread(screenshots.save,
                                           self.cfg.state_dir / "screenshots",
                                           lendee, mime, data)
        except (HostError, OSError) as e:
            journal.record("boot", f"{lendee}'s guest agent did not answer within {waited} "
                           f"of its start, and its screen could not be saved: {e}",
                           vm=lendee, result="failed", priority=journal.Priority.ERR)
            return
        journal.record("boot", f"{lendee}'s guest agent did not answer within {waited} of "
                       f"its start: its screen is saved in {path} (a UEFI shell, an installer, "
                       "firmware stuck on an option ROM, a kernel panic?)", vm=lendee,
                       result="failed", screenshot=str(path), priority=journal.Priority.ERR)
