"""Hot-add and hot-unplug: the lendee's GPUs change while it runs, no restart.

Hot-add: the GPUs a game freed join the running lendee, no drain, no restart.

The machine decides (`AttachGpus`, with ``policy.hotplug = "add"``); this is the
executor's step, in four bounded parts, each of which must hold before the next, once
no other running VM holds part of the GPUs' IOMMU groups (`iommu.holders`; if one does,
none is attached and the machine hears `GroupsHeld`, no failure):

1. libvirt attaches every function of the GPUs live (`Libvirt.attach_live`: as the
   persistent definition has them, each into the ``pcie-root-port`` it names, which the
   live definition left empty), and the live XML must list them;
2. the driver in the guest must see exactly the GPUs now lent (the UUIDs in
   nvidia-smi through the guest agent, the same check as a return's);
3. the node must advertise them: the device plugin's pods (or the DRA kubelet
   plugin's) on the node are deleted so that their DaemonSet starts them again, and
   they enumerate the GPUs anew (`Cluster.grow`, `Kube.restart_plugins`);
4. only then is the GPU lent (`GpusAttached`).

Between 2 and 3, `lendee.cdi_refresh` (when set) makes the guest's CDI spec anew: the
one its boot wrote lists that boot's GPUs alone.

A part that fails within its bound reports `AttachFailed` with the reason journaled,
once the live definition is read again and what it holds of the GPUs taken out as an
unplug takes them (`_undo`: the plugins stopped if they came back with it, the driver
made to let go, the detach; a GPU attached but not lent fails every later return's
check in the guest); those the guest keeps, or all when libvirt's attach has not ended,
stay with the lendee (only its stop frees them), the others wait for a regrow by
restart.

Hot-unplug (``policy.hotplug = "both"``, experimental): an owner's GPU leaves the
running lendee (`DetachGpus`), in bounded parts, each of which must hold:

1. the node is cordoned and only the pods using the GPU are evicted (`Cluster.vacate`):
   those their ResourceClaims name (DRA), else those the kubelet's device checkpoint
   in the guest gives it (`checkpoint_pods`), read after the cordon so that no pod
   placed in between is missed; within timeouts.drain, or for a reservation alone up
   to its time (its pods were told, and get their full grace period);
2. the node offers it no more: its GPU plugins are stopped (`Cluster.withdraw`), for
   NVIDIA's device plugin holds every GPU it serves open for as long as it runs;
3. in the guest, within ``timeouts.release`` (10 s) all in all: each GPU's PCI address
   and device node (nvidia-smi's ``pci.bus_id`` and ``minor_number``), no process
   holding the node (any holder, by one scan of /proc/*/fd: a DCGM exporter or
   persistenced as much as a job), then the driver lets go: through NVML's drain state
   and removal where the guest's nvidia-smi has them (`drain_supported`; an in-use GPU
   answers so), else the unbind from its driver: NVIDIA does not support hot-unplug of
   its GPUs, and some drivers hang an unbind begun while a client holds the GPU;
4. libvirt detaches every function live and the live XML must lose them within
   `DETACH_BOUND` (libvirt's device-removed event wakes the wait);
5. only then does the owner start (`GpusDetached`); the node, verified with the rest
   (its GPU plugins restarted to advertise them), is uncordoned by the return.

Anything in doubt (a checkpoint unread, an unknown device ID, a holder, a device
still listed at the bound) reports `DetachFailed`: the reclaim by restart runs
instead, and its shutdown frees whatever the guest kept. A guest past a deadline
(`Stuck`: a driver hung in an unbind hangs nvidia-smi and the shutdown too) reports
it so, and the restart powers it off if its shutdown hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Collection
from typing import Any, Protocol

from hostagent.core import clock, levers
from hostagent.host import journal, lint
from hostagent.host import verify as in_guest
from hostagent.core.config import Config
from hostagent.host.libvirt import Domains, ExecResult, HostError
from hostagent.core.model import (
    Hotplug,
    Policy,
    AttachFailed,
    DetachFailed,
    GpusAttached,
    GpusDetached,
    GroupsHeld,
    Topology,
)
from hostagent.service.parts import Apply, Cluster, View
from hostagent.core.text import clean


class Step(Protocol):
    """What of the executor a hot-add uses (`hostagent.service.executor.Executor`)."""

    # Read-only: a step reads them, never replaces them (and a test's stand-in may be
    # of a narrower type).
    @property
    def lendee(self) -> str: ...
    @property
    def cfg(self) -> Config: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def view(self) -> View: ...
    @property
    def apply(self) -> Apply: ...
    @property
    def libvirt(self) -> Domains: ...
    @property
    def cluster(self) -> Cluster: ...
    @property
    def device_removed(self) -> asyncio.Event: ...

    def lendee_gpu_config(self) -> dict[str, Any]: ...

    async def held_groups(self, vm: str,
                          gpus: frozenset[str]) -> tuple[dict[str, str], str]: ...

    async def report_held(self, event: GroupsHeld) -> None: ...

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None: ...


# How long libvirt may take to attach, and the live XML to list, every function.
ATTACH_BOUND = 60.0


async def hot_add(ex: Step, ticket: int, gpus: frozenset[str]) -> None:
    """The step of `AttachGpus`: see the module docstring."""
    lendee = ex.lendee
    names = ", ".join(sorted(gpus))
    journal.record("hotplug", f"attaching {names} to {lendee} while it runs", vm=lendee,
                   result="started", gpus=",".join(sorted(gpus)))
    others, why = await ex.held_groups(lendee, gpus)
    if others:
        journal.record("hotplug", f"did not add {names} to {lendee}: {why}", vm=lendee,
                       result="refused", gpus=",".join(sorted(gpus)))
        await ex.report_held(GroupsHeld(at=clock.now(), ticket=ticket, gpus=gpus, held=others,
                                        reason=why))
        return
    problem, settled = await _attach(ex, gpus)
    if problem is None and ex.view.state.ticket == ticket:
        problem = await ex._verify_gpus(ticket, ex.view.state.lent)
    if problem is None and ex.view.state.ticket == ticket:
        problem = await _refresh_cdi(ex)
    grown = problem is None and ex.view.state.ticket == ticket
    if grown:
        problem = await ex.cluster.grow(ex.view.state.lent)
    if ex.view.state.ticket != ticket:
        return  # the machine moved on (a reclaim): nobody waits for this report
    if problem is None:
        journal.record("hotplug", f"{names} attached to {lendee} and lent, with no restart",
                       vm=lendee, result="ok", gpus=",".join(sorted(gpus)))
        ex.apply(GpusAttached(at=clock.now(), ticket=ticket, gpus=gpus))
        return
    held = await _undo(ex, gpus, grown=grown) if settled else gpus
    if grown and ex.view.state.ticket == ticket:
        # The undo paused the GPU plugins (they held the GPU): they come back, to
        # advertise what stays lent, as after any live change.
        back = await ex.cluster.grow((ex.view.state.lent - gpus) | held)
        if back is not None:
            journal.record("hotplug", f"the GPU plugins on {lendee}'s node did not come back "
                           f"whole after the failed hot-add: {back}", vm=lendee,
                           result="failed", priority=journal.Priority.WARNING)
    kept = (f"; {lendee} keeps {', '.join(sorted(held))} until it restarts" if held else
            f"; {names} wait for {lendee}'s next restart")
    journal.record("hotplug", f"could not add {names} to {lendee} live: {problem}{kept}",
                   vm=lendee, result="failed", gpus=",".join(sorted(gpus)),
                   priority=journal.Priority.ERR)
    ex.apply(AttachFailed(at=clock.now(), ticket=ticket, gpus=gpus, held=held, reason=problem))


async def _attach(ex: Step, gpus: frozenset[str]) -> tuple[str | None, bool]:
    """Part 1: attach, then wait for the live XML to list every GPU. None, or why not;
    and whether libvirt's call has ended (one past the bound goes on in its thread and
    may still attach: what the live definition holds is then unknown)."""
    libvirt, lendee = ex.libvirt, ex.lendee
    config = ex.lendee_gpu_config()
    deadline = time.monotonic() + ATTACH_BOUND
    call = asyncio.ensure_future(libvirt.attach_live(lendee, gpus, config))
    try:
        await asyncio.wait_for(asyncio.shield(call), ATTACH_BOUND)
        while True:
            missing = gpus - await libvirt.live_gpus(lendee, config)
            if not missing:
                return None, True
            if time.monotonic() >= deadline:
                return (f"{', '.join(sorted(missing))} not in {lendee}'s live definition "
                        f"{ATTACH_BOUND:g}s after the attach"), True
            await asyncio.sleep(0.2)
    except TimeoutError:
        call.add_done_callback(lambda c: c.cancelled() or c.exception())
        return f"libvirt did not attach them within {ATTACH_BOUND:g}s", False
    except HostError as e:
        return str(e), True


# How long the guest's CDI refresh (lendee.cdi_refresh) may take: nvidia-ctk cdi
# generate reads every GPU through NVML, a second or so each.
CDI_BOUND = 60.0


async def _refresh_cdi(ex: Step) -> str | None:
    """Part 2b, after the guest's driver sees the GPU and before the plugins come back:
    the guest's CDI spec made anew by `lendee.cdi_refresh` (the spec a boot wrote lists
    that boot's GPUs, and a container asking for one it lacks is refused: "unresolvable
    CDI devices"). None, or why not; nothing to do where it is "" (the default)."""
    command = ex.cfg.lendee.cdi_refresh
    if not command:
        return None
    try:
        done = await ex.libvirt.guest_exec(ex.lendee, "/bin/sh", ["-c", command],
                                           timeout=CDI_BOUND)
    except HostError as e:
        return f"lendee.cdi_refresh in {ex.lendee}: {clean(e, 200)}"
    if done.exitcode != 0:
        return (f"lendee.cdi_refresh ({clean(command, 80)}) in {ex.lendee} exited "
                f"{done.exitcode}: {clean(done.stderr or done.stdout, 200)}")
    journal.record("hotplug", f"{ex.lendee}'s CDI spec made anew ({clean(command, 80)})",
                   vm=ex.lendee, result="ok")
    return None


async def _undo(ex: Step, gpus: frozenset[str], *, grown: bool) -> frozenset[str]:
    """After a failed hot-add, the live definition is read and what it holds of `gpus`
    taken out again as an unplug takes a GPU: the GPU plugins stopped where they were
    restarted with it present (`grown`: they hold every GPU they serve), the guest's
    driver let go of it (drain or unbind, no holder left; one nvidia-smi does not list
    has none to let go of), then the live detach; so that what the lendee has is what is
    lent: a GPU left attached but not lent shows in the guest at every later return,
    whose check then fails. Returns what it still holds (only the lendee's stop frees
    those), all of `gpus` in doubt."""
    try:
        attached = await ex.libvirt.live_gpus(ex.lendee, ex.lendee_gpu_config()) & gpus
        if not attached:
            return attached
        uuids = frozenset(gpu.uuid for label in attached for gpu in [ex.cfg.gpus.get(label)]
                          if gpu is not None and gpu.uuid)
        problem = None if len(uuids) == len(attached) else (
            "a GPU with no uuid configured: which device it is in the guest is unknown")
        if problem is None and grown:
            problem = await ex.cluster.withdraw(attached)
        if problem is None:
            problem = await _release(ex, attached, uuids, absent_ok=True)
        if problem is None:
            problem = await _detach(ex, attached, frozenset())
        if problem is not None:
            journal.record("hotplug", f"could not take {', '.join(sorted(attached))} from "
                           f"{ex.lendee} again after the failed hot-add: {problem}",
                           vm=ex.lendee, result="failed", gpus=",".join(sorted(attached)),
                           priority=journal.Priority.WARNING)
        return await ex.libvirt.live_gpus(ex.lendee, ex.lendee_gpu_config()) & gpus
    except HostError:
        return gpus  # in doubt, the lendee holds them: only its stop frees them for sure


# --- hot-unplug --------------------------------------------------------------------------

# How long the guest may take to let every function go once libvirt asked (an ACPI or
# pciehp unplug takes about a second a device; pciehp's attention button waits 5 s).
# Past it the device is in doubt, the restart's shutdown frees it for sure, and the
# player has waited this much longer than by a restart at most.
DETACH_BOUND = 30.0

CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


class Stuck(str):
    """Why a hot-unplug gave way, when the guest ran past a deadline in its part (a
    driver that hangs an unbind hangs nvidia-smi, and the guest's shutdown, with it)."""
QUERY = ("--query-gpu=uuid,pci.bus_id,minor_number", "--format=csv,noheader")
# Each "PID/fd/N" of the guest whose link is one of the device nodes given, by one scan
# of /proc: one `ls -l` reads every link in itself (a readlink per open file was one
# process each, thousands on a real node, past timeouts.release on their own) and awk keeps
# the holders, at most HOLDERS_SHOWN of them (the answer is the guest's: bounded). By
# link text, as the kernel writes it from the holder's root: a container's own /dev
# node (runc mknods the CDI spec's device nodes) reads /dev/nvidiaN too. busybox's ls
# and awk (the lab's guest) and GNU's write the same long listing.
HOLDERS_SHOWN = 64
HOLDERS = (f"ls -l /proc/[0-9]*/fd 2>/dev/null | awk -v want=\"$*\" -v most={HOLDERS_SHOWN} '"
           'BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) node[w[i]] = 1 }\n'
           '/^\\/proc\\/[0-9]+\\/fd:$/ { split($0, p, "/"); pid = p[3]; next }\n'
           '{ i = index($0, " -> "); if (!i || pid == "" || !(substr($0, i + 4) in node)) next\n'
           '  m = split(substr($0, 1, i - 1), f, " "); print pid "/fd/" f[m]\n'
           "  if (++shown >= most) exit }'")
# Each PCI address given, unbound from its driver; one no driver has (NVML removed it, or
# none bound it) is left as it is.
UNBIND = ('for a; do d="/sys/bus/pci/devices/$a/driver"; [ -e "$d" ] || continue; '
          'echo "$a" > "$d/unbind" || exit 1; done')


async def hot_unplug(ex: Step, ticket: int, gpus: frozenset[str]) -> None:
    """The step of `DetachGpus`: see the module docstring."""
    lendee, names, state = ex.lendee, ", ".join(sorted(gpus)), ex.view.state
    owners = [o for o in state.waiting_owners if ex.topo.claims(o) & gpus]
    held = [r for r in state.reservations if r.holding and ex.topo.claims(r.vm) & gpus]
    # For reservations alone: their pods were told, and get their full grace period,
    # until the reserved time (as the drain of the reclaim by restart gives them).
    until = None if owners or not held else min(r.at for r in held) - clock.now()
    # A player waiting: the pods using the GPUs get at most drain.unplanned_grace.
    cap = levers.terms(ex.cfg.drain, players_waiting=bool(owners)).grace_cap
    owners = owners or [f"{r.vm}'s reservation" for r in held]
    journal.record("hotplug", f"taking {names} from {lendee} while it runs, for "
                   f"{', '.join(owners) or 'an owner'}: evicting the pods that use them",
                   vm=lendee, result="started", gpus=",".join(sorted(gpus)))
    began = time.monotonic()
    uuids = {label: gpu.uuid for label in gpus for gpu in [ex.cfg.gpus.get(label)]
             if gpu is not None and gpu.uuid}
    problem = None if len(uuids) == len(gpus) else (
        f"{', '.join(sorted(gpus - set(uuids)))} has no uuid configured: which pods and "
        "processes use it cannot be told")
    if problem is None:
        # Read once the node is cordoned: a pod placed before the cordon is among them.
        problem = await ex.cluster.vacate(
            owners, gpus, lambda: _checkpoint(ex, frozenset(uuids.values())), until=until,
            grace_cap=cap)
    for part in (_withdraw, _release, _detach):
        if problem is None and ex.view.state.ticket == ticket:
            problem = await part(ex, gpus, frozenset(uuids.values()))
    if ex.view.state.ticket != ticket:
        return  # the machine moved on (a reclaim, a stop): nobody waits for this report
    took = time.monotonic() - began
    if problem is None:
        journal.record("hotplug", f"{names} detached from {lendee} in {took:.1f}s, with no "
                       "restart", vm=lendee, result="ok", gpus=",".join(sorted(gpus)),
                       duration_ms=took * 1000)
        ex.apply(GpusDetached(at=clock.now(), ticket=ticket, gpus=gpus))
        return
    journal.record("hotplug", f"could not take {names} from {lendee} live: {problem}; "
                   "reclaiming it by restart instead (drain, shutdown, start)", vm=lendee,
                   result="failed", gpus=",".join(sorted(gpus)), duration_ms=took * 1000,
                   priority=journal.Priority.ERR)
    ex.apply(DetachFailed(at=clock.now(), ticket=ticket, gpus=gpus, reason=problem,
                          stuck=isinstance(problem, Stuck)))


def checkpoint_pods(text: str, uuids: Collection[str], known: Collection[str]) -> frozenset[str]:
    """The UIDs of the pods the kubelet's device checkpoint gives one of `uuids`. The
    NVIDIA device plugin's device IDs are GPU UUIDs, or ``UUID::n`` for a time-sliced
    replica. Raises ValueError when it cannot tell for sure: not the checkpoint's JSON,
    or an ID of an ``nvidia.com/`` resource that is none of `known` (the lendee's GPU
    UUIDs): index IDs, MIG devices. No side effects; the text is the guest's."""
    try:
        entries = json.loads(text)["Data"]["PodDeviceEntries"] or []
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"not the kubelet's device checkpoint ({clean(e, 80)})") from e
    pods: set[str] = set()
    for entry in entries if isinstance(entries, list) else [None]:
        if not isinstance(entry, dict):
            raise ValueError("an entry of the checkpoint is not an object")
        resource, ids = entry.get("ResourceName"), entry.get("DeviceIDs")
        if not isinstance(resource, str) or not resource.startswith("nvidia.com/"):
            continue
        # Older kubelets keep a list; newer ones the IDs by NUMA node.
        lists = list(ids.values()) if isinstance(ids, dict) else [ids]
        for device in (d for group in lists for d in (group or [])):
            uuid = str(device).split("::")[0]
            if uuid in uuids:
                pods.add(str(entry.get("PodUID")))
            elif uuid not in known:
                raise ValueError(f"device {clean(device, 80)} of {clean(resource, 60)} is no "
                                 "GPU UUID of the lendee's")
    return frozenset(pods)


async def _checkpoint(ex: Step, uuids: frozenset[str]) -> tuple[frozenset[str] | None, str]:
    """Part 1's reading in the guest: the pods using `uuids`, or None and why not."""
    known = {gpu.uuid for label in ex.view.state.lent for gpu in [ex.cfg.gpus.get(label)]
             if gpu is not None and gpu.uuid}
    try:
        done = await ex.libvirt.guest_exec(ex.lendee, "cat", [CHECKPOINT], timeout=10)
        if done.exitcode != 0:
            return None, f"cat {CHECKPOINT}: {clean(done.stderr, 200) or done.exitcode}"
        return checkpoint_pods(done.stdout, uuids, known), ""
    except (HostError, ValueError) as e:
        return None, f"{CHECKPOINT}: {clean(e, 200)}"


async def _withdraw(ex: Step, gpus: frozenset[str], _uuids: frozenset[str]) -> str | None:
    """Part 2: the node offers the GPUs no more: its GPU plugins are stopped."""
    return await ex.cluster.withdraw(gpus)


async def _release(ex: Step, gpus: frozenset[str], uuids: frozenset[str], *,
                   absent_ok: bool = False) -> str | None:
    """Part 3, in the guest and within one deadline: find each GPU's PCI address and
    device node, wait until no process holds a node open (any holder: a pod's process,
    a plugin, an exporter, persistenced), then let the driver go of each: through NVML's
    drain state and removal where the guest's nvidia-smi has them (`drain_supported`),
    else the unbind from its driver. None, or why in doubt; `Stuck` only when a driver
    call (nvidia-smi, the unbind) ran past the deadline. `absent_ok` (a failed hot-add's
    undo): a GPU nvidia-smi does not list has no driver to let go of, and is skipped."""
    deadline = time.monotonic() + ex.cfg.timeouts.release
    found, problem = await _locate(ex, uuids, deadline, absent_ok=absent_ok)
    if found is None:
        return problem
    command, gpus_found = found
    if not gpus_found:
        return None  # the driver has none of them (only with absent_ok)
    nodes = [node for _, node in gpus_found]
    addresses = [address for address, _ in gpus_found]
    draining, why = await _drain_command(ex, command, deadline)
    if why is not None:
        return why
    if draining:
        # NVML: persistence mode counts as a client and must be off before the drain
        # state is changed (nvidia-persistenced lets go of the device when asked so).
        # A GPU that refuses is no doubt yet: a holder left shows in the scan below, and
        # the removal says "in use"; only a hung nvidia-smi ends the part here.
        for address in addresses:
            problem = await _nvidia_smi(ex, command, ["-i", address, "-pm", "0"], deadline)
            if isinstance(problem, Stuck):
                return problem
    while True:
        done, problem = await _run(ex, "/bin/sh", ["-c", HOLDERS, "sh", *nodes], deadline,
                                   driver=False)
        if done is None:
            return problem or "no /bin/sh in the guest to look for the GPU's holders"
        holders = sorted({line.split("/")[0] for line in done.stdout.splitlines()
                          if line.split("/")[0].isdigit()})
        if not holders:
            break
        if time.monotonic() + 0.5 >= deadline:  # no time left to look again
            return (f"process(es) {', '.join(holders[:10])} in {ex.lendee} still hold "
                    f"{', '.join(nodes)} ({', '.join(sorted(gpus))}) {ex.cfg.timeouts.release:g}s "
                    "after the evictions")
        await asyncio.sleep(0.5)
    if draining:
        # nvidia-smi drain (NVML's nvmlDeviceModifyDrainState, then nvmlDeviceRemoveGpu):
        # a GPU a client still holds answers "In use by another client" and stays
        # draining, where a sysfs unbind would wait for it (some drivers hang there).
        for address in addresses:
            for args in (["drain", "--pciid", address, "--modify", "1"],
                         ["drain", "--pciid", address, "--remove"]):
                problem = await _nvidia_smi(ex, command, args, deadline)
                if problem is not None:
                    return problem
    # Whatever the driver still has bound (all of them where NVML could not remove it).
    done, problem = await _run(ex, "/bin/sh", ["-c", UNBIND, "sh", *addresses], deadline)
    if done is None:
        return problem or "no /bin/sh in the guest to unbind the GPU"
    if done.exitcode != 0:
        return (f"could not unbind {', '.join(addresses)} in {ex.lendee}: "
                f"{clean(done.stderr or done.stdout, 200) or done.exitcode}")
    return None


async def _nvidia_smi(ex: Step, command: str, args: list[str], deadline: float) -> str | None:
    """`command args` in the guest within `deadline`: None when it exited 0, else why."""
    done, problem = await _run(ex, command, args, deadline)
    if done is None:
        return problem or f"{command} is gone from {ex.lendee}"
    if done.exitcode != 0:
        return (f"{command} {' '.join(args)} in {ex.lendee} exited {done.exitcode}: "
                f"{clean(done.stdout + done.stderr, 200)}")
    return None


# What says that nvidia-smi has NVML's drain state and removal: its drain verb's help.
# The verb wraps nvmlDeviceModifyDrainState and nvmlDeviceRemoveGpu (NVML API reference,
# "Drain states": removal fails with NVML_ERROR_IN_USE, "In use by another client",
# while a client is attached, persistence mode included, and the GPU stays draining;
# nvidia-ml-py's bindings carry no docstrings). Read on an H200 with driver 580.159.04:
# `nvidia-smi drain -h` exits 0 and lists [-p | --pciid], [-m | --modify] (0 or 1;
# "Persistence mode must be disabled"), [-q | --query], [-r | --remove] ("The GPU must
# have already been put in a drain state using -m and persistence mode for this GPU
# must be disabled") and [-d | --discover]: the options and order used here. What the
# real verb answers for a GPU in use was not tried (it would take the machine's GPU
# away); the lab's stand-in answers as the NVML reference says.
DRAIN_HELP = ("drain", "-h")
DRAIN_OPTIONS = ("--modify", "--remove")


async def _drain_command(ex: Step, command: str,
                         deadline: float) -> tuple[bool, str | None]:
    """Whether `command` (nvidia-smi in the guest) has the drain verb; and why in doubt
    (`Stuck` when its help hung past `deadline`)."""
    done, problem = await _run(ex, command, list(DRAIN_HELP), deadline)
    if done is None:
        return False, problem
    text = done.stdout + done.stderr
    return done.exitcode == 0 and all(o in text for o in DRAIN_OPTIONS), None


async def drain_supported(ex: Step) -> tuple[bool, str]:
    """Whether the lendee's nvidia-smi can take a GPU out through NVML's drain state and
    removal (``nvidia-smi drain``), and why: said by `status` and `lint`, and the hot-
    unplug's choice between it and the sysfs unbind. Asks the running guest."""
    deadline = time.monotonic() + ex.cfg.timeouts.release
    for command in in_guest.candidates(ex.cfg.verify.command):
        try:
            done = await ex.libvirt.guest_exec(ex.lendee, command, list(DRAIN_HELP),
                                               timeout=max(0.1, deadline - time.monotonic()))
        except HostError as e:
            if in_guest.not_there(e):
                continue
            return False, f"{command} {' '.join(DRAIN_HELP)} in {ex.lendee}: {clean(e, 200)}"
        if in_guest.not_there((done.exitcode, done.stdout, done.stderr)):
            continue
        text = done.stdout + done.stderr
        if done.exitcode == 0 and all(o in text for o in DRAIN_OPTIONS):
            return True, (f"{command} in {ex.lendee} has NVML's drain state and removal "
                          "(nvidia-smi drain)")
        return False, (f"{command} in {ex.lendee} has no drain verb (nvidia-smi drain -h "
                       f"exited {done.exitcode}: {clean(text, 120)})")
    return False, f"nvidia-smi not found in {ex.lendee}"


async def unplug_policy(ex: Step, policy: Policy) -> Policy:
    """Under ``policy.hotplug = "auto"``, once the lendee runs lent: hot-unplug too
    ("both") where its node's GPU plugins can be kept off it through their deploy label
    (`Cluster.plugins_pausable`) and its nvidia-smi has NVML's drain (`drain_supported`),
    else hot-add alone (`lint.unplug_at_run_time` decides); journaled when it changes.
    Asked at each boot: another boot may run another driver, or another plugin."""
    if ex.cfg.policy.hotplug is not Hotplug.AUTO or policy.hotplug is Hotplug.NONE:
        return policy
    drain, drain_why = await drain_supported(ex)
    pausable, pause_why = await ex.cluster.plugins_pausable()
    new = lint.unplug_at_run_time(ex.cfg, policy, plugins_pausable=pausable,
                                  drain_supported=drain)
    if new.hotplug is not policy.hotplug:
        changes = lint.changes(new.hotplug, new.regrow, new.regrow_max_wait)
        journal.record("policy", f"{ex.lendee}'s GPUs change {changes} ({new.hotplug_why}: "
                       f"{clean(pause_why, 300)}; {clean(drain_why, 300)})", vm=ex.lendee,
                       result=new.hotplug.value)
    return new


async def _locate(ex: Step, uuids: frozenset[str], deadline: float, *,
                  absent_ok: bool = False
                  ) -> tuple[tuple[str, list[tuple[str, str]]] | None, str | None]:
    """The guest's PCI address and device node of each of `uuids`, by nvidia-smi, and
    the nvidia-smi that answered. `absent_ok`: those it does not list are left out."""
    for command in in_guest.candidates(ex.cfg.verify.command):
        done, problem = await _run(ex, command, list(QUERY), deadline)
        if done is None:
            if problem is None:
                continue  # not there: the next place
            return None, problem
        if done.exitcode != 0:
            if absent_ok and "No devices were found" in done.stdout:
                return (command, []), None
            return None, (f"{command} {QUERY[0]} exited {done.exitcode}: "
                          f"{clean(done.stderr or done.stdout, 200)}")
        found: dict[str, tuple[str, str]] = {}
        for line in done.stdout.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != 3 or not fields[2].isdigit() or ":" not in fields[1]:
                return None, f"{command} answered what cannot be read: {clean(line, 120)}"
            domain, _, rest = fields[1].partition(":")
            if fields[0] in uuids:  # nvidia-smi writes an 8-digit domain, sysfs 4
                found[fields[0]] = (f"{domain[-4:]}:{rest}".lower(), f"/dev/nvidia{fields[2]}")
        if set(found) != uuids and not absent_ok:
            return None, (f"{command} in {ex.lendee} does not list "
                          f"{', '.join(sorted(uuids - set(found)))}")
        return (command, [found[u] for u in sorted(found)]), None
    if absent_ok:
        return (ex.cfg.verify.command, []), None  # no driver tools: nothing holds it
    return None, "nvidia-smi not found in the guest: which device the GPU is is unknown"


async def _run(ex: Step, path: str, args: list[str], deadline: float, *,
               driver: bool = True) -> tuple[ExecResult | None, str | None]:
    """`path` run in the guest within `deadline`: its result, or None and why not (None
    and None: no such command there). Past the deadline, why is `Stuck` for a `driver`
    call (nvidia-smi, the unbind: a driver that hangs hangs them); the holder scan
    reads /proc alone, and one past it is a plain doubt, as is a call the deadline left
    no time for (it never ran, so never hung)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None, (f"{path} in {ex.lendee}: no time left within the "
                      f"{ex.cfg.timeouts.release:g}s bound (timeouts.release)")
    try:
        done = await ex.libvirt.guest_exec(ex.lendee, path, args, timeout=left)
    except HostError as e:
        if in_guest.not_there(e):
            return None, None
        why = f"{path} in {ex.lendee}: {clean(e, 200)}"
        if not driver:
            return None, f"the look for the GPU's holders in {ex.lendee} did not end: {why}"
        return None, Stuck(why) if time.monotonic() >= deadline else why
    if in_guest.not_there((done.exitcode, done.stdout, done.stderr)):
        return None, None
    return done, None


async def _detach(ex: Step, gpus: frozenset[str], _uuids: frozenset[str]) -> str | None:
    """Part 3: detach, then wait for the live XML to lose every function. None, or why
    not (a device still listed is in doubt: only the lendee's stop frees it for sure)."""
    libvirt, lendee, config = ex.libvirt, ex.lendee, ex.lendee_gpu_config()
    deadline = time.monotonic() + DETACH_BOUND
    try:
        await asyncio.wait_for(libvirt.detach_live(lendee, gpus, config), DETACH_BOUND)
        while True:
            ex.device_removed.clear()  # before the read: a removal after it wakes the wait
            left = gpus & await libvirt.live_gpus(lendee, config)
            if not left:
                return None
            if time.monotonic() >= deadline:
                return Stuck(f"{', '.join(sorted(left))} still in {lendee}'s live definition "
                             f"{DETACH_BOUND:g}s after the detach: the guest did not let it go")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ex.device_removed.wait(),
                                       max(0.05, min(1.0, deadline - time.monotonic())))
    except TimeoutError:
        return Stuck(f"libvirt did not detach them within {DETACH_BOUND:g}s")
    except HostError as e:
        return str(e)
