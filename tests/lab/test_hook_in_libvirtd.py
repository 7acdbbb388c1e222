"""The real hook, executed by the lab's libvirtd, talking to the real inbox."""

from __future__ import annotations

import asyncio
import json
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Callable, Iterator, Set
from pathlib import Path

import pytest

from hostagent.surfaces.inbox import HookEvent, Inbox, Verdict, replay_spool, serve_hooks
from tests.lab.lab import HOOK, Lab
from tests.waiting import BOUND, until

pytestmark = pytest.mark.lab
log = logging.getLogger("test.inbox")


class Recorder:
    def __init__(self, defer: Set[tuple[str, str, str]] = frozenset()) -> None:
        self.events: list[HookEvent] = []
        self.defer = defer

    async def __call__(self, event: HookEvent) -> Verdict:
        self.events.append(event)
        if (event.domain, event.op, event.sub) in self.defer or ("*", event.op, event.sub) \
                in self.defer:
            return Verdict("defer", f"{event.domain} waits: its GPU is being reclaimed.")
        return Verdict("proceed")

    def ops(self, domain: str) -> list[str]:
        return [f"{e.op} {e.sub}" for e in self.events if e.domain == domain]


async def virsh(lab: Lab, *args: str, check: bool = True) -> tuple[int, str]:
    # Off the event loop: libvirtd waits for the hook, which waits for our inbox.
    proc = await asyncio.to_thread(lab.virsh, *args, check=check)
    return proc.returncode, proc.stderr


@pytest.fixture
async def served(lab: Lab) -> AsyncIterator[tuple[Lab, Recorder]]:
    rec = Recorder()
    server = await serve_hooks(lab.hook_socket, rec, log=log)
    yield lab, rec
    server.close()
    await server.wait_closed()
    lab.hook_socket.unlink(missing_ok=True)


async def test_libvirtd_runs_the_hook_for_each_step_in_order(
        served: tuple[Lab, Recorder]) -> None:
    lab, rec = served
    await virsh(lab, "start", "gaming1")
    await asyncio.to_thread(lab.wait_agent, "gaming1")
    await virsh(lab, "shutdown", "--mode", "agent", "gaming1")
    await asyncio.to_thread(lab.wait_state, "gaming1", "shut off")
    await until(lambda: "release end" in rec.ops("gaming1"),
                "the release hook, which runs just after the state change")
    assert rec.ops("gaming1") == ["prepare begin", "start begin", "started begin",
                                  "stopped end", "release end"]
    for e in rec.events:
        assert "<name>gaming1</name>" in e.xml
        assert e.extra == "-"
    assert not any(lab.spool.glob("*.json"))


async def test_a_deferred_prepare_stops_the_start_and_tells_the_user_why(lab: Lab) -> None:
    rec = Recorder(defer={("gaming1", "prepare", "begin")})
    server = await serve_hooks(lab.hook_socket, rec, log=log)
    try:
        code, stderr = await virsh(lab, "start", "gaming1", check=False)
    finally:
        server.close()
    assert code != 0
    assert "gaming1 waits: its GPU is being reclaimed." in stderr
    assert lab.state("gaming1") == "shut off"
    assert rec.ops("gaming1")[0] == "prepare begin"


async def test_agent_absent_the_events_are_spooled_then_replayed_once(lab: Lab) -> None:
    lab.hook_socket.unlink(missing_ok=True)
    await virsh(lab, "start", "gaming1")  # fail-open: the start is not blocked
    await virsh(lab, "destroy", "gaming1")
    spooled = sorted(lab.spool.glob("*.json"))
    assert len(spooled) == 5
    rec = Recorder()
    inbox = Inbox(rec)
    assert await replay_spool(lab.spool, inbox, log=log) == 5
    assert rec.ops("gaming1") == ["prepare begin", "start begin", "started begin",
                                  "stopped end", "release end"]
    assert not any(lab.spool.glob("*.json"))
    assert await replay_spool(lab.spool, inbox, log=log) == 0
    assert len(rec.events) == 5


async def test_agent_hung_the_start_goes_on_and_the_events_are_spooled(lab: Lab) -> None:
    """An agent that accepts and never answers: `prepare begin`, the one event whose
    answer the hook waits for, is spooled once the budget runs out, and the start goes
    on; the events that only inform are handed over in the socket (the agent reads them
    when it comes back), not spooled twice."""
    hung: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def never_answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hung.append((r, w))

    server = await asyncio.start_unix_server(never_answer, path=str(lab.hook_socket))
    handed: list[str] = []
    try:
        await virsh(lab, "start", "gaming1")
        for reader, _ in hung:
            with contextlib.suppress(TimeoutError):
                line = await asyncio.wait_for(reader.readline(), 1)
                event = json.loads(line)
                handed.append(f"{event['op']} {event['sub']}")
    finally:
        server.close()
        for _, w in hung:
            w.close()
        lab.hook_socket.unlink(missing_ok=True)
    assert lab.state("gaming1") == "running"
    ops = [json.loads(p.read_text()) for p in lab.spool.glob("*.json")]
    assert [(o["op"], o["sub"]) for o in ops] == [("prepare", "begin")]
    assert sorted(handed) == ["prepare begin", "start begin", "started begin"]


async def test_reconnect_begin_never_fails_even_when_everything_is_deferred(lab: Lab) -> None:
    """libvirtd restarted with gaming1 running runs its `reconnect begin` hook, whose
    non-zero exit would make libvirt kill that QEMU: the hook sends nothing (the agent
    learns the same from its own reconnection) and exits 0, whatever the agent says."""
    await virsh(lab, "start", "gaming1")
    rec = Recorder(defer={("*", "reconnect", "begin"), ("*", "prepare", "begin")})
    spooled = set(lab.spool.glob("*.json"))
    server = await serve_hooks(lab.hook_socket, rec, log=log)
    try:
        await asyncio.to_thread(lab.restart_libvirtd)
        # libvirt runs `reconnect begin` inside the domain's job, which a monitor command
        # waits for (src/qemu/qemu_process.c qemuProcessReconnect, alike in the releases
        # before and after the lab's 9.0.0): once it answers, the hook has run.
        await virsh(lab, "qemu-monitor-command", "gaming1", '{"execute":"query-status"}')
    finally:
        server.close()
    assert "reconnect begin" not in rec.ops("gaming1")
    assert set(lab.spool.glob("*.json")) == spooled
    # libvirt would have killed QEMU had the hook failed.
    assert lab.state("gaming1") == "running"


def test_hook_is_the_repositorys_file(lab: Lab) -> None:
    hook = lab.root / "etc-libvirt" / "hooks" / "qemu"
    assert hook.resolve() == (Path(__file__).parents[2] / "hooks" / "qemu").resolve()


# --- beside the VFIO community's hook layout -----------------------------------------------

# The "passthrough post hook helper" (PassthroughPOST/VFIO-Tools, libvirt_hooks/qemu, the
# version at commit 0e50fd1): installed as <hooks>/qemu itself, it runs the executable
# qemu.d/<vm>/<op>/<sub-op> or every executable file in that directory (find -maxdepth 1
# -type f -executable), each with libvirt's arguments and a copy of stdin, under set -e
# so that a script's failure is the dispatcher's. Written here as it behaves, not copied.
DISPATCHER = """#!/bin/bash
hooks="$(dirname "$0")/qemu.d/$1/$2/$3"
input=$(cat)
set -e
if [ -f "$hooks" ] && [ -s "$hooks" ] && [ -x "$hooks" ]; then
    "$hooks" "$@" <<< "$input"
elif [ -d "$hooks" ]; then
    while read -r script; do
        [ -z "$script" ] || "$script" "$@" <<< "$input"
    done <<< "$(find -L "$hooks" -maxdepth 1 -type f -executable -print)"
fi
"""
# What its alloc_hugepages.sh and unalloc_hugepages.sh do to nr_hugepages (add the
# guest's pages at prepare/begin, take them away at release/end), on a counter of the
# lab's, and a line per call: the guest's 4 pages of 1 GiB.
COUNTER = """#!/bin/bash
count=/var/log/libvirt/community-hugepages
current=$(cat "$count" 2>/dev/null || echo 0)
echo $((current {sign} 4)) > "$count"
echo "$1 $2 $3" >> /var/log/libvirt/community-marks
"""


@contextlib.contextmanager
def community_layout(lab: Lab) -> Iterator[tuple[Path, Path]]:
    """The lab's hooks as a host with the community's dispatcher has them: theirs at
    <hooks>/qemu, ours where `make install` puts it (qemu.d/hostagent), and gaming1's
    prepare/begin and release/end scripts. Yields the marks and the counter; the lab's
    own layout (our hook at <hooks>/qemu) comes back after."""
    hooks = lab.root / "etc-libvirt" / "hooks"
    marks = lab.root / "log-libvirt" / "community-marks"
    pages = lab.root / "log-libvirt" / "community-hugepages"
    vm = hooks / "qemu.d" / "gaming1"
    for path, sign in ((vm / "prepare" / "begin" / "alloc_hugepages.sh", "+"),
                       (vm / "release" / "end" / "unalloc_hugepages.sh", "-")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(COUNTER.format(sign=sign))
        path.chmod(0o755)
    ours = hooks / "qemu.d" / "hostagent"
    ours.unlink(missing_ok=True)
    ours.symlink_to(HOOK)
    staged = hooks / ".qemu.community"
    staged.write_text(DISPATCHER)
    staged.chmod(0o755)
    staged.replace(hooks / "qemu")  # in one step: libvirtd never runs half a file
    marks.unlink(missing_ok=True)
    pages.unlink(missing_ok=True)
    try:
        yield marks, pages
    finally:
        staged = hooks / ".qemu.ours"
        staged.unlink(missing_ok=True)
        staged.symlink_to(HOOK)
        staged.replace(hooks / "qemu")
        ours.unlink()
        shutil.rmtree(vm)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def settled(what: Callable[[], object], expected: object, timeout: float = BOUND) -> None:
    """Wait, bounded, until `what()` is `expected` (release end runs just after the
    state change, and the inbox reads the hook's line a moment later)."""
    with contextlib.suppress(AssertionError):  # said below, with what it was instead
        await until(lambda: what() == expected, timeout=timeout)
    assert what() == expected


async def test_beside_the_community_dispatcher_a_deferred_start_runs_and_undoes_its_prepare(
        lab: Lab) -> None:
    """libvirt (>= 6.5, src/util/virhook.c virHookCall) runs <hooks>/qemu first, then
    every executable file of qemu.d/ in strcmp order, each whatever the one before
    returned; directories (qemu.d/gaming1) are not executable files and are skipped.
    So the community's prepare/begin scripts run before ours, also for a start that ours
    then defers; libvirt's clean-up of the failed start runs release/end, which undoes
    them. A normal start is untouched: prepare/begin once, release/end at its stop."""
    rec = Recorder(defer={("gaming1", "prepare", "begin")})
    server = await serve_hooks(lab.hook_socket, rec, log=log)
    try:
        with community_layout(lab) as (marks, pages):
            code, stderr = await virsh(lab, "start", "gaming1", check=False)
            assert code != 0 and "gaming1 waits: its GPU is being reclaimed." in stderr
            assert lab.state("gaming1") == "shut off"
            # What ran for the refused start, ours and theirs.
            await settled(lambda: lines(marks), ["gaming1 prepare begin", "gaming1 release end"])
            await settled(lambda: rec.ops("gaming1"), ["prepare begin", "stopped end",
                                                       "release end"])
            assert pages.read_text().strip() == "0"  # allocated, then given back
            rec.defer = frozenset()
            await virsh(lab, "start", "gaming1")
            assert lab.state("gaming1") == "running"
            assert lines(marks)[2:] == ["gaming1 prepare begin"]
            assert pages.read_text().strip() == "4"
            await virsh(lab, "destroy", "gaming1")
            await settled(lambda: lines(marks)[2:], ["gaming1 prepare begin",
                                                     "gaming1 release end"])
            assert pages.read_text().strip() == "0"
            await settled(lambda: rec.ops("gaming1")[3:], [
                "prepare begin", "start begin", "started begin", "stopped end", "release end"])
    finally:
        server.close()
        await server.wait_closed()
        lab.hook_socket.unlink(missing_ok=True)
