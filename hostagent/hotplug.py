"""Hot-add: the GPUs a game freed join the running lendee, no drain, no restart.

The machine decides (`AttachGpus`, with ``policy.hotplug = "add"``); this is the
executor's step, in four bounded parts, each of which must hold before the next:

1. libvirt attaches every function of the GPUs live (`Libvirt.attach_live`: as the
   persistent definition has them, each into the ``pcie-root-port`` it names, which the
   live definition left empty), and the live XML must list them;
2. the driver in the guest must see exactly the GPUs now lent (the UUIDs in
   nvidia-smi through the guest agent, the same check as a return's);
3. the node must advertise them: the device plugin's pods (or the DRA kubelet
   plugin's) on the node are deleted so that their DaemonSet starts them again, and
   they enumerate the GPUs anew (`Cluster.grow`, `Kube.restart_plugins`);
4. only then is the GPU lent (`GpusAttached`).

A part that fails within its bound reports `AttachFailed` with the reason journaled;
the GPUs the live definition holds anyway stay with the lendee (only its stop frees
them), the others wait for a regrow by restart. Nothing is ever detached.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from hostagent import clock, journal
from hostagent.libvirt_host import HostError, Libvirt
from hostagent.model import AttachFailed, GpusAttached
from hostagent.parts import Apply, Cluster, View


class Step(Protocol):
    """What of the executor a hot-add uses (`hostagent.executor.Executor`)."""

    lendee: str
    view: View
    apply: Apply
    libvirt: Libvirt
    cluster: Cluster

    def lendee_gpu_config(self) -> dict[str, Any]: ...

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None: ...


# How long libvirt may take to attach, and the live XML to list, every function.
ATTACH_BOUND = 60.0


async def hot_add(ex: Step, ticket: int, gpus: frozenset[str]) -> None:
    """The step of `AttachGpus`: see the module docstring."""
    lendee = ex.lendee
    names = ", ".join(sorted(gpus))
    journal.record("hotplug", f"attaching {names} to {lendee} while it runs", vm=lendee,
                   result="started", gpus=",".join(sorted(gpus)))
    problem = await _attach(ex, gpus)
    if problem is None and ex.view.state.ticket == ticket:
        problem = await ex._verify_gpus(ticket, ex.view.state.lent)
    if problem is None and ex.view.state.ticket == ticket:
        problem = await ex.cluster.grow(ex.view.state.lent)
    if ex.view.state.ticket != ticket:
        return  # the machine moved on (a reclaim): nobody waits for this report
    if problem is None:
        journal.record("hotplug", f"{names} attached to {lendee} and lent, with no restart",
                       vm=lendee, result="ok", gpus=",".join(sorted(gpus)))
        ex.apply(GpusAttached(at=clock.now(), ticket=ticket, gpus=gpus))
        return
    try:
        held = await ex.libvirt.live_gpus(lendee, ex.lendee_gpu_config()) & gpus
    except HostError:
        held = gpus  # in doubt, the lendee holds them: only its stop frees them for sure
    kept = (f"; {lendee} keeps {', '.join(sorted(held))} until it restarts" if held else
            f"; {names} wait for {lendee}'s next restart")
    journal.record("hotplug", f"could not add {names} to {lendee} live: {problem}{kept}",
                   vm=lendee, result="failed", gpus=",".join(sorted(gpus)),
                   priority=journal.Priority.ERR)
    ex.apply(AttachFailed(at=clock.now(), ticket=ticket, gpus=gpus, held=held, reason=problem))


async def _attach(ex: Step, gpus: frozenset[str]) -> str | None:
    """Part 1: attach, then wait for the live XML to list every GPU. None, or why not."""
    libvirt, lendee = ex.libvirt, ex.lendee
    config = ex.lendee_gpu_config()
    deadline = time.monotonic() + ATTACH_BOUND
    try:
        await asyncio.wait_for(libvirt.attach_live(lendee, gpus, config), ATTACH_BOUND)
        while True:
            missing = gpus - await libvirt.live_gpus(lendee, config)
            if not missing:
                return None
            if time.monotonic() >= deadline:
                return (f"{', '.join(sorted(missing))} not in {lendee}'s live definition "
                        f"{ATTACH_BOUND:g}s after the attach")
            await asyncio.sleep(0.2)
    except TimeoutError:
        return f"libvirt did not attach them within {ATTACH_BOUND:g}s"
    except HostError as e:
        return str(e)
