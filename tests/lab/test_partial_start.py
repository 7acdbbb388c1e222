"""Starting the lendee without some GPUs, against the lab's real libvirtd: a live
definition for this boot only, the persistent one untouched (DESIGN.md invariant 9)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hostagent.host import lint
from hostagent.core.config import parse
from hostagent.surfaces.inbox import HookEvent, Verdict, serve_hooks
from hostagent.host.libvirt import HookRefused, HostError, Libvirt, read_domains
from tests.lab.lab import AGENT_CONFIG, GPUS, LENDEE, Lab

# libvirt takes one event loop per process: every test here shares the module's.
pytestmark = [pytest.mark.lab, pytest.mark.asyncio(loop_scope="module")]
log = logging.getLogger("test.partial")
CONFIG = parse(AGENT_CONFIG.format(relend_delay="2s"), "lab")


@pytest_asyncio.fixture(loop_scope="module")
async def lv(lab: Lab) -> AsyncIterator[Libvirt]:
    adapter = Libvirt(lab.uri, on_lifecycle=lambda *_: None, on_reconnect=lambda: None)
    await adapter.connect(attempts=3)
    yield adapter
    await adapter.close()


def persistent(lab: Lab) -> str:
    return lab.virsh("dumpxml", "--inactive", "--security-info", LENDEE).stdout


def disks(lab: Lab, *flags: str) -> list[str]:
    out = lab.virsh("domblklist", LENDEE, "--details", *flags).stdout
    return sorted(line.split()[-1].rsplit("/", 1)[-1].removesuffix(".img")
                  for line in out.splitlines() if "/gpus/" in line)


async def test_a_start_without_one_gpu_runs_the_rest_for_this_boot_only(
        lab: Lab, lv: Libvirt) -> None:
    before = persistent(lab)
    await lv.start_with(LENDEE, drop={"gpu-a"}, gpus=CONFIG.gpus)
    rest = sorted(set(GPUS) - {"gpu-a"})
    assert lab.state(LENDEE) == "running"
    assert disks(lab) == rest
    assert str(lab.gpu_image("gpu-a")) not in lab.virsh("dumpxml", LENDEE).stdout
    assert await lv.live_gpus(LENDEE, CONFIG.gpus) == frozenset(rest)
    info = lab.virsh("dominfo", LENDEE).stdout
    assert any(line.split() == ["Persistent:", "yes"] for line in info.splitlines()), info
    assert persistent(lab) == before  # byte for byte
    assert disks(lab, "--inactive") == sorted(GPUS)
    # `hostagent lint` reads the persistent definitions: the running lendee lacks
    # gpu-a for this boot only, which is no finding; autostart is one.
    lab.virsh("autostart", LENDEE)
    try:
        defined = await asyncio.to_thread(read_domains, lab.uri)
    finally:
        lab.virsh("autostart", "--disable", LENDEE)
    assert defined[LENDEE].autostart and not defined["gaming1"].autostart
    found = lint.lint([lint.parse_domain(d.xml, autostart=d.autostart)
                       for d in defined.values()], config=CONFIG)
    assert [(f.domain, f.check) for f in found
            if f.check in (lint.Check.CONFIG_XML, lint.Check.AUTOSTART)] == [
        (LENDEE, lint.Check.AUTOSTART)]
    # gpu-a is really free: its owner takes the disk lock the lendee would hold.
    await asyncio.to_thread(lab.virsh, "start", "gaming1")
    assert sorted(lab.running()) == sorted(["gaming1", LENDEE])
    lab.virsh("destroy", LENDEE)
    assert await lv.live_gpus(LENDEE, CONFIG.gpus) == frozenset()
    assert persistent(lab) == before
    assert LENDEE in lab.virsh("list", "--all", "--name").stdout.split()
    # The next plain start has every GPU again (the owner gone first).
    lab.virsh("destroy", "gaming1")
    await lv.start_with(LENDEE, drop=set(), gpus=CONFIG.gpus)
    assert disks(lab) == sorted(GPUS)
    assert await lv.live_gpus(LENDEE, CONFIG.gpus) == frozenset(GPUS)


async def test_a_gpu_the_definition_lacks_is_a_clear_error_and_nothing_starts(
        lab: Lab, lv: Libvirt) -> None:
    with pytest.raises(HostError, match=r"gaming1's XML holds no device of GPU gpu-b"):
        await lv.start_with("gaming1", drop={"gpu-b"}, gpus=CONFIG.gpus)
    assert lab.state("gaming1") == "shut off"


async def test_a_start_the_hook_defers_is_hook_refused_with_its_sentence(
        lab: Lab, lv: Libvirt) -> None:
    sentence = "gpu-node waits: gpu-a is being reclaimed; it will start by itself."

    async def defer(event: HookEvent) -> Verdict:
        if (event.op, event.sub) == ("prepare", "begin"):
            return Verdict("defer", sentence)
        return Verdict("proceed")

    server = await serve_hooks(lab.hook_socket, defer, log=log)
    try:
        with pytest.raises(HookRefused) as e:
            await lv.start_with(LENDEE, drop={"gpu-a"}, gpus=CONFIG.gpus)
        with pytest.raises(HookRefused):
            await lv.start(LENDEE)
    finally:
        server.close()
        await server.wait_closed()
        lab.hook_socket.unlink(missing_ok=True)
    assert e.value.sentence == sentence
    assert lab.state(LENDEE) == "shut off"
