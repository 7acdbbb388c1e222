"""The power-off of a drained lendee (``[drain] stop = "power-off"``, lever 4 of
`hostagent.core.levers`): its filesystems frozen through the guest agent, then the VM
powered off.

A k3s guest's own shutdown takes about 30 s, and a player waits for all of it. Once the
drain has seen every evicted pod gone, what is left is to keep what the guest wrote:
the guest agent's freeze (virDomainFSFreeze) flushes every filesystem and holds it
still, so the power-off that follows loses nothing written. Each step is bounded, and
whatever fails leaves the guest as it was for its own shutdown: a freeze refused (no
agent answer, a guest without fsfreeze), or a power-off refused after a freeze, which
is thawed first (a frozen guest can neither write nor shut down).
"""

from __future__ import annotations

import asyncio
import contextlib

from hostagent.core import levers
from hostagent.core.text import clean
from hostagent.host import journal
from hostagent.host.libvirt import Domains, HostError

# The freeze syncs what a drained node still holds dirty (the kubelet's and containerd's
# state, logs): seconds at most. Past this the guest's own shutdown, which syncs as well,
# is the better road.
FREEZE_TIMEOUT = 15
# libvirt's destroy waits up to 10 s for QEMU to exit on SIGTERM, and longer for a VM
# with host devices to let go, before its SIGKILL.
DESTROY_TIMEOUT = 60.0
SETTING = 'drain.stop = "power-off"'


async def when_drained(policy: levers.DrainPolicy, libvirt: Domains, lendee: str, *,
                       emptied: bool) -> bool:
    """A reclaim's stop of `lendee`, whose drain `emptied` its node or not: True once it
    is powered off, False for its guest's own shutdown (under drain.stop = "shutdown",
    after a drain that left pods, or when a step of the power-off failed)."""
    if levers.power_off(policy, emptied=emptied):
        return await freeze_and_power_off(libvirt, lendee)
    if policy.stop is levers.Stop.POWER_OFF:
        journal.record("power-off", f"{lendee}'s drain did not see every evicted pod gone: "
                       "shutting it down through its guest agent, so that none loses its "
                       f"grace ({SETTING} powers off only a drained node)", vm=lendee,
                       result="shutdown")
    return False


async def freeze_and_power_off(libvirt: Domains, lendee: str) -> bool:
    """Freeze `lendee`'s filesystems, then power it off; True once libvirt powered it
    off. False: it still runs, thawed, for the guest-agent shutdown (journaled why)."""
    try:
        frozen = await libvirt.freeze_filesystems(lendee, timeout=FREEZE_TIMEOUT)
    except HostError as e:
        journal.record("power-off", f"{lendee}'s filesystems could not be frozen "
                       f"({clean(e, 300)}): shutting it down through its guest agent "
                       f"instead ({SETTING} powers off only a guest whose filesystems are "
                       "frozen)", vm=lendee, result="shutdown",
                       priority=journal.Priority.WARNING)
        # A freeze that timed out here may still land in the guest: undo it, or the
        # shutdown's own writes would wait behind it.
        with contextlib.suppress(HostError):
            await libvirt.thaw_filesystems(lendee, timeout=FREEZE_TIMEOUT)
        return False
    journal.record("power-off", f"{lendee} is drained: {_filesystems(frozen)} frozen "
                   f"through its guest agent, powering it off ({SETTING})", vm=lendee,
                   result="frozen", frozen=frozen)
    try:
        await asyncio.wait_for(libvirt.destroy(lendee), DESTROY_TIMEOUT)
        return True
    except (HostError, TimeoutError) as e:
        why = clean(e, 300) or f"no answer within {DESTROY_TIMEOUT:g} s"
    try:
        await libvirt.thaw_filesystems(lendee, timeout=FREEZE_TIMEOUT)
        thawed = "its filesystems thawed"
    except HostError as e:
        thawed = f"its filesystems could not be thawed ({clean(e, 200)})"
    journal.record("power-off", f"{lendee} could not be powered off ({why}): {thawed}, "
                   "shutting it down through its guest agent instead", vm=lendee,
                   result="shutdown", priority=journal.Priority.WARNING)
    return False


def _filesystems(n: int) -> str:
    return "1 filesystem" if n == 1 else f"{n} filesystems"
