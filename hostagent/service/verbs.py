"""The control verbs (status, play, release, hold, resume/lend, reclaim, reserve), shared by
the control socket, the SSH endpoint and the MQTT device.

Those that wait (play, release, reclaim) follow the transitions the agent journals
(`hostagent.service.parts.Progress`) and stream them, with the time elapsed and what they wait for.
A client that goes away stops its own waiting, never what it started: an intent lives in the
machine. Verbs change the state only through the agent's `apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import xml.etree.ElementTree as ElementTree
from datetime import datetime
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import hostagent
from hostagent.core import clock, idle, machine, reserve
from hostagent.host import journal, lint
from hostagent.core.config import Config
from hostagent.surfaces.control import Reply, VerbHandler, current_caller
from hostagent.core.health import Health
from hostagent.host.libvirt import Domains, HostError, Lifecycle
from hostagent.core.text import clean
from hostagent.core.model import (
    CancelIntent,
    Hold,
    IntentSource,
    OwnerWants,
    Phase,
    Policy,
    Reclaim,
    Resume,
    Topology,
)
from hostagent.service.parts import Apply, Cluster, Facts, Progress, View
from hostagent.service.reservations import Reservations, local_zone

log = logging.getLogger("hostagent")


def _stopwatch() -> Callable[[], float]:
    """Seconds since it was made, to a tenth: the ``elapsed_s`` of a streamed reply."""
    started = time.monotonic()
    return lambda: round(time.monotonic() - started, 1)


class Verbs:
    """The verbs of the control socket, the SSH endpoint and the MQTT device.

    They read `view` and the executor's `facts`, follow `progress`, and change the state
    through `apply` and `request` (the agent's: an owner's start request, taken once it
    is on disk). `lifecycle` is the agent's reading of a libvirt event (a stop's that
    was lost)."""

    def __init__(self, cfg: Config, topo: Topology, policy: Policy, view: View, apply: Apply,
                 *, request: Callable[[OwnerWants], Awaitable[bool]],
                 libvirt: Domains, cluster: Cluster, health: Health, facts: Facts,
                 progress: Progress, lifecycle: Callable[[str, Lifecycle], None],
                 reservations: Reservations) -> None:
        self.cfg, self.topo, self.policy, self.view = cfg, topo, policy, view
        self.reservations = reservations
        self.apply, self.request, self.lifecycle = apply, request, lifecycle
        self.libvirt, self.cluster, self.health = libvirt, cluster, health
        self.facts, self.progress = facts, progress
        self.lendee = topo.lendee

    def handlers(self) -> dict[str, VerbHandler]:
        return {"status": self._status, "play": self._play,
                "release": self._release, "hold": self._hold,
                "resume": self._resume, "lend": self._resume,
                "reclaim": self._reclaim, "reserve": self._reserve}

    def status(self) -> dict[str, Any]:
        now, state, topo = clock.now(), self.view.state, self.topo
        holders = machine.holders(state, topo)
        why = idle.not_lent(self.cfg, state, now)  # each idle GPU's reason
        gpus = []
        for label in sorted(topo.gpus):
            gpu = self.cfg.gpus.get(label)
            gpus.append({"gpu": label, "name": gpu.name if gpu else None,
                         "pci": gpu.pci if gpu else label,
                         # Every function that moves with it, and the GPUs that share
                         # an IOMMU group with it (they move together).
                         "functions": list(gpu.functions) if gpu else [],
                         "moves_with": sorted(topo.whole({label}) - {label}),
                         "owners": list(self.cfg.owners_of(label)),
                         "holder": holders.get(label),
                         "not_lent": why[label].as_dict() if label in why else None})
        return {
            "lendee": {"domain": self.lendee, "phase": state.phase.value,
                       "reason": state.reason, "since": self.view.phase_since,
                       "hold": state.hold, "lent": sorted(state.lent),
                       "free": sorted(machine.free_gpus(state, topo, self.policy)),
                       "regrow_waiting": state.regrow_waiting,
                       "changes": lint.changes(self.policy.hotplug, self.policy.regrow,
                                               self.policy.regrow_max_wait),
                       "changes_why": self.policy.hotplug_why},
            "gpus": gpus,
            "verified": self.facts.verified,
            "owners": {o: o in state.running_owners for o in sorted(topo.owners)},
            "starting": sorted(state.starting_owners),  # libvirt starts them now
            "intents": [{"id": i.id, "owner": i.owner, "source": i.source.value,
                         "age_s": round(now - i.created_at, 1)} for i in state.intents],
            "reservations": self.reservations.status(),
            "relend_in_s": round(state.relend_at - now, 1) if state.relend_at else None,
            "libvirt_connected": self.libvirt.connected,
            "cluster": self.cluster.status(),
            "health": [r.as_dict() for r in self.health.last],
            "version": hostagent.version(),
        }

    async def _status(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        await self.health.check()
        yield {"ok": True, "data": self.status()}

    def _named(self, args: dict[str, Any]) -> tuple[str | None, Reply | None]:
        """The lendee a verb names (its "lendee" argument: this one, where several lend;
        None: every lendee), or the refusal of another."""
        named = args.get("lendee")
        if named is None or named == self.lendee:
            return named, None
        return None, {"ok": False, "error": f"{clean(str(named), 64)} is not a lendee here: "
                                            f"{self.lendee} is; name it, or leave --lendee "
                                            "out"}

    async def _hold(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        named, refused = self._named(args)
        if refused is not None:
            yield refused
            return
        self.apply(Hold(at=clock.now(), lendee=named))
        message = f"lending is on hold: {self.lendee} is not lent again until `hostagent lend`"
        if self.view.state.phase is not Phase.OFF:
            message += ("; it keeps running for now (`hostagent reclaim` takes its GPUs "
                        "back)")
        yield {"ok": True, "data": {**self.status(), "message": message}}

    async def _resume(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """`resume` and `lend`: lend again now, and retry a step that failed."""
        named, refused = self._named(args)
        if refused is not None:
            yield refused
            return
        self.apply(Resume(at=clock.now(), lendee=named))
        yield {"ok": True, "data": {**self.status(), "message": self.lend_note()}}

    async def _reserve(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """`vm` will be played at `at` (HH:MM, the next one, or ISO 8601); with `cancel`,
        its reservation is dropped (`hostagent.core.reserve`)."""
        # The reservations' owners: every lendee's, where the first lendee's plan them all.
        vm, problem = self._owner_arg(args, "reserve", self.reservations.topo)
        if vm is None:
            yield {"ok": False, "error": problem}
            return
        caller = current_caller()
        by = f"hostagent reserve ({caller})" if caller else "hostagent reserve"
        # Who may cancel or replace what: the principal that reserved, or a caller
        # granted cancel-any (root, the agent's user; in-process callers too).
        principal = caller.principal if caller else ""
        cancel_any = (caller.cancel_any or caller.privileged) if caller else True
        if args.get("cancel") is True:
            ok, message = await self.reservations.cancel(
                vm, by=by, principal=principal, cancel_any=cancel_any,
                series=args.get("every") is True)
            yield ({"ok": True, "data": {"vm": vm, "message": message}} if ok else
                   {"ok": False, "error": message})
            return
        text = args.get("at")
        if not isinstance(text, str) or not text.strip():
            yield {"ok": False, "error": f"reserve {vm} needs a time: --at 20:00 (the next "
                                         "one) or --at 2026-12-04T20:00, or --cancel"}
            return
        # The zone's rules for the target date, not today's offset (daylight saving).
        zone = await asyncio.to_thread(local_zone)
        every = args.get("every")
        try:
            if every is not None:  # a series: its first occurrence (`reserve.Every`)
                if not isinstance(every, str):
                    raise reserve.BadReservation("every takes days: daily, weekdays, "
                                                 "weekends or mon,wed,fri")
                series = reserve.read_every(f"{every} {text}")
                first, _ = reserve.next_occurrence(series, clock.now(), zone)
                at = reserve.At(when=datetime.fromtimestamp(first, zone))
                every = str(series)
            else:
                at = reserve.read_at(text, datetime.fromtimestamp(clock.now(), zone))
        except reserve.BadReservation as e:
            yield {"ok": False, "error": f"cannot reserve {vm}: {e}"}
            return
        ok, message = await self.reservations.reserve(vm, at.when.timestamp(), by=by,
                                                      note=at.note, principal=principal,
                                                      cancel_any=cancel_any, every=every)
        if not ok:
            yield {"ok": False, "error": message}
            return
        yield {"ok": True, "data": {"vm": vm, "at": at.when.isoformat(timespec="minutes"),
                                    "message": message}}

    def _owner_arg(self, args: dict[str, Any], verb: str,
                   topo: Topology | None = None) -> tuple[str | None, str]:
        """(the owner VM named in args, "") or (None, why not, naming the owners);
        `topo`: whose owners (default: this lendee's)."""
        vm = args.get("vm")
        topo = topo or self.topo
        owners = ", ".join(sorted(topo.owners)) or "none is configured"
        if not isinstance(vm, str) or not vm:
            return None, f"{verb} needs an owner VM: {owners}"
        if vm == self.lendee:
            return None, (f"{vm} is the lendee, not an owner VM: {verb} takes one of "
                          f"{owners} (`hostagent reclaim` takes the GPUs back from {vm})")
        if not topo.is_owner(vm):
            return None, (f"unknown VM {vm[:64]!r}: hostagent manages {owners} "
                          f"(owners.* in {self.cfg.source})")
        return vm, ""

    def _waiting_for(self, vm: str | None = None) -> str:
        """What a client waits for now, in a few words."""
        state, lendee = self.view.state, self.lendee
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

    def lend_note(self) -> str:
        """When the lendee gets its GPUs back, as things stand."""
        state, lendee = self.view.state, self.lendee
        if state.relend_at is not None:
            free = machine.free_gpus(state, self.topo, self.policy)
            what = ("its GPUs" if free == self.topo.lendee_gpus and not state.lent
                    else self.topo.gpu_names(free))
            return (f"{lendee} gets {what} back in {max(0.0, state.relend_at - clock.now()):.0f}s"
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

    async def _play(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Start an owner VM: an intent, then its progress until the VM runs or fails."""
        vm, problem = self._owner_arg(args, "play")
        if vm is None:
            yield {"ok": False, "error": problem}
            return
        took = _stopwatch()

        if vm in self.view.state.running_owners:
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": 0.0,
                                        "message": f"{vm} is already running"}}
            return
        rival = machine.conflict(self.view.state, vm, self.topo)
        if rival is not None:
            caller = current_caller()
            journal.record("refuse", f"refused the start of {vm}"
                           + (f" asked by {caller}" if caller else "") + f": {rival}",
                           vm=vm, result="refused")
            yield {"ok": False, "error": f"{vm} cannot start now: {rival}"}
            return
        intent = f"play-{uuid.uuid4().hex[:12]}"
        with self.progress.following() as updates:
            # On disk before the client hears anything: invariant 4.
            if not await self.request(OwnerWants(at=clock.now(), owner=vm, intent_id=intent,
                                                      source=IntentSource.CONTROL)):
                why = (f"its request could not be recorded ({self.view.save_failed})"
                       if self.view.save_failed else "see journalctl -u hostagent")
                yield {"ok": False, "error": f"the agent refused to start {vm} now: {why}"}
                return
            pending = self.view.state.intents_of(vm)
            if pending and all(i.id != intent for i in pending):
                # Asked for already (by anyone): this request joined that one; follow it.
                intent = pending[0].id
                yield {"event": "intent", "vm": vm, "intent": intent, "to": "pending",
                       "message": f"{vm} was already asked to start "
                                  f"({pending[0].source.value}, "
                                  f"{max(0.0, clock.now() - pending[0].created_at):.0f}s ago); "
                                  + self._play_plan(vm),
                       "elapsed_s": took(), "waiting": self._waiting_for(vm)}
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
        state, lendee = self.view.state, self.lendee
        if not self.topo.needs_lendee_gpus(vm):
            return f"starting {vm}: it shares no GPU with {lendee}"
        if state.phase is Phase.OFF and not state.lendee_starting:
            return f"starting {vm}: {lendee} is off"
        shared = self.topo.claims(vm) & state.lent
        if not shared:
            return f"starting {vm}: {lendee} runs without its GPUs"
        names = self.topo.gpu_names(shared)
        return (f"{vm} needs {names}: {lendee} ({state.phase.value}) gives "
                f"{'them' if len(shared) > 1 else 'it'} back first")

    async def _release(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Shut an owner VM down and wait until it is off; the lend follows by itself."""
        vm, problem = self._owner_arg(args, "release")
        if vm is None:
            yield {"ok": False, "error": problem}
            return
        took = _stopwatch()

        if vm in self.facts.starting and vm not in self.view.state.running_owners:
            # libvirt is starting it now: that cannot be withdrawn, and saying so is true.
            yield {"ok": False, "elapsed_s": took(), "error":
                   f"{vm} is being started right now (its GPUs are free) and a start under "
                   f"way cannot be withdrawn: it runs in a moment, and `hostagent release "
                   f"{vm}` then shuts it down"}
            return
        if self.view.state.intents_of(vm) and vm not in self.view.state.running_owners:
            # Still waiting for its GPUs: releasing it withdraws the request (the
            # executor asks whether it is still wanted just before it starts it).
            caller = current_caller()
            by = f"hostagent release ({caller})" if caller else "hostagent release"
            self.apply(CancelIntent(at=clock.now(), owner=vm, by=by))
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(), "cancelled": True,
                                        "message": f"the pending start of {vm} is cancelled; "
                                                   f"{self.lend_note()}"}}
            return
        if not await self.libvirt.is_running(vm):
            yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(), "relend_in_s":
                                        self.status()["relend_in_s"],
                                        "message": f"{vm} is not running; {self.lend_note()}"}}
            return
        stopped = self.facts.stopped.setdefault(vm, asyncio.Event())
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
        if vm in self.view.state.running_owners:
            self.lifecycle(vm, Lifecycle.STOPPED)  # the event was lost; reality says off
        yield {"ok": True, "data": {"vm": vm, "elapsed_s": took(),
                                    "relend_in_s": self.status()["relend_in_s"],
                                    "message": f"{vm} is off ({took():g}s); {self.lend_note()}"}}

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
                # A guest that powers off before its agent's reply reaches libvirt makes
                # the call fail: the shutdown worked, and there is no button left to press.
                if not await self.libvirt.is_running(vm):
                    return "its guest agent"
                log.warning("guest-agent shutdown of %s failed (%s); using ACPI", vm, e)
        try:
            await self.libvirt.shutdown_via_acpi(vm)
        except HostError:
            if await self.libvirt.is_running(vm):
                raise
        return "ACPI (its guest agent did not answer)"

    async def _reclaim(self, args: dict[str, Any]) -> AsyncIterator[Reply]:
        """Take the GPUs back from the lendee with no owner starting; stream until off.

        The lendee stays off until `lend` (the machine's Reclaim holds). A lendee start
        that was in flight is reclaimed once it lands (see machine._reclaim_by_hand).
        """
        named, refused = self._named(args)
        if refused is not None:
            yield refused
            return
        took = _stopwatch()
        lendee, gpus = self.lendee, self.topo.gpu_names(self.topo.lendee_gpus)
        with self.progress.following() as updates:
            self.apply(Reclaim(at=clock.now(), lendee=named))
            update: Reply | None = {"event": "reclaim", "message": f"reclaiming {gpus} from "
                                    f"{lendee} ({self.view.state.phase.value})"}
            while True:
                state = self.view.state
                if state.phase in (Phase.BOOTING, Phase.JOINING, Phase.LENT):
                    self.apply(Reclaim(at=clock.now(), lendee=named))  # a start in flight landed
                    continue
                done = state.phase is Phase.OFF and not state.lendee_starting
                if update is not None and update.get("event") != "intent" and not (
                        done and update.get("event") == "reclaim"):
                    yield {**update, "elapsed_s": took(),
                           "waiting": self._waiting_for()}
                if done:
                    yield {"ok": True, "data": {
                        "elapsed_s": took(),
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
