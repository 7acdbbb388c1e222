"""An agent for the unit tests: the real `Agent` (machine, executor, persistence, the
progress stream) whose libvirt is `FakeLibvirt`, which starts and stops VMs at once and
reports it as libvirt's lifecycle events do; `make_agent` makes one, `lent` brings it to
a lent lendee. Shared by the unit tests of every topic that run an agent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from hostagent.core.config import parse
from hostagent.core.levers import Terms
from hostagent.core.model import Observed, Phase
from hostagent.host.libvirt import HostError, Lifecycle
from hostagent.service import main as service
from hostagent.service.agent import Agent
from hostagent.service.parts import NoCluster
from hostagent.surfaces.inbox import HookEvent
from hostagent.surfaces.control import Reply
from tests.fakes import LibvirtStub
from tests.waiting import until

AGENT_XML = "<domain><devices><channel type='unix'><target type='virtio' " \
            "name='org.qemu.guest_agent.0'/></channel></devices></domain>"
PLAIN_XML = "<domain><devices/></domain>"


class FakeLibvirt(LibvirtStub):
    """Starts and stops at once; tells the agent as libvirt's lifecycle events would."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.running: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.guest_agent = True  # the lendee's agent answers
        self.no_agent_channel: set[str] = set()
        self.ignores_shutdown: set[str] = set()
        # Powers off before its guest agent answers the shutdown: libvirt reports an error.
        self.agent_dies_answering: set[str] = set()
        self.connected = True

    def _event(self, vm: str, kind: Lifecycle, delay: float = 0.01) -> None:
        asyncio.get_running_loop().call_later(delay, self.agent.lifecycle, vm, kind)

    async def start(self, name: str) -> None:
        self.calls.append(("start", name))
        if name not in self.running:
            self.running.add(name)
            self._event(name, Lifecycle.STARTED)

    async def start_with(self, name: str, *, drop: object, gpus: object) -> None:
        self.live_drop = drop
        await self.start(name)

    async def live_gpus(self, name: str, gpus: Mapping[str, object]) -> frozenset[str]:
        return frozenset(gpus) if name in self.running else frozenset()

    async def _stop(self, name: str, how: str) -> None:
        self.calls.append((how, name))
        if name in self.running and name not in self.ignores_shutdown:
            self.running.discard(name)
            self._event(name, Lifecycle.STOPPED, 0.05)

    async def shutdown_via_agent(self, name: str) -> None:
        await self._stop(name, "agent shutdown")
        if name in self.agent_dies_answering:
            raise HostError(f"shut down {name} through its guest agent: Guest agent is not "
                            "responding: QEMU guest agent is not connected")

    async def shutdown_via_acpi(self, name: str) -> None:
        if name not in self.running:  # as libvirt answers for a domain that is off
            raise HostError(f"shut down {name} through ACPI: Requested operation is not "
                            "valid: domain is not running")
        await self._stop(name, "acpi shutdown")

    async def destroy(self, name: str) -> None:
        await self._stop(name, "destroy")

    async def is_running(self, name: str) -> bool:
        return name in self.running

    async def running_domains(self) -> set[str]:
        return set(self.running)

    async def ping_agent(self, name: str, *, timeout: int = 3) -> bool:
        return self.guest_agent and name in self.running

    async def xml(self, name: str) -> str:
        return PLAIN_XML if name in self.no_agent_channel else AGENT_XML

    async def inactive_xml(self, name: str) -> str:  # no q35: policy.hotplug "auto" is "none"
        return await self.xml(name)


# Two lendees, node-a with gpu-a (gaming1's), node-b with gpu-b (gaming2's); format
# with root=.
TWO_LENDEES = """\
control_socket = "{root}/control.sock"
hook_socket = "{root}/hook.sock"
state_dir = "{root}/state"

[lendees.node-a]
gpus = ["gpu-a"]

[lendees.node-b]
gpus = ["gpu-b"]

[gpus.gpu-a]
pci = "0000:0a:00.0"

[gpus.gpu-b]
pci = "0000:0b:00.0"

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]
"""

CONFIG = """\
control_socket = "{root}/control.sock"
hook_socket = "{root}/hook.sock"
state_dir = "{root}/state"

[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b"]

[gpus.gpu-a]
pci = "0000:0a:00.0"
name = "RTX A"

[gpus.gpu-b]
pci = "0000:0b:00.0"

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]

[timeouts]
guest_agent = "1s"
shutdown = "1s"
start = "2s"

[policy]
relend_delay = "{relend}"
lint_before_start = false

[verify]
method = "none"
"""


@pytest.fixture(autouse=True)
async def no_step_outlives_its_test() -> AsyncIterator[None]:
    """The agent's steps run as tasks: each test's are cancelled and awaited at its end,
    as the agent does when it stops, before the event loop closes."""
    yield
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def make_agent(tmp_path: Path, relend: str = "0.2s") -> tuple[Agent, FakeLibvirt]:
    cfg = parse(CONFIG.format(root=tmp_path, relend=relend), "test.toml")
    agent = Agent(cfg)
    fake = FakeLibvirt(agent)
    agent.libvirt = fake
    agent.start()
    return agent, fake


async def lent(agent: Agent, fake: FakeLibvirt) -> None:
    """Start the world with the lendee running, and wait until it is lent."""
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)


async def collect(agent: Agent, verb: str, **args: Any) -> list[Reply]:
    return [r async for r in agent.verbs.handlers()[verb](args)]


def healthy(agent: Agent) -> None:
    assert agent.ended is None, agent.ended


class HeldCluster(NoCluster):
    """Records cordon/uncordon as the node would see them; each step waits for a go."""

    def __init__(self) -> None:
        self.node: list[str] = []  # what reached the node, in order
        self.return_go = asyncio.Event()
        self.drain_go = asyncio.Event()
        self.down_go = asyncio.Event()  # set: the cordon after a stop goes through at once
        self.down_go.set()
        self.returns = 0
        self.accept = False  # True: every eviction accepted at once; the pods go at drain_go
        self.terms: list[Terms | None] = []
        self.pods_left = False  # True: the drain ends with pods left (a budget, its timeout)
        # Each reclaim, once its evictions are accepted (accept): whether the agent asked
        # to be told (the `accepted` hook, called then), as drain.shutdown_when "accepted"
        # does to begin the shutdown at that moment.
        self.told: list[bool] = []
        # Each give_back and lendee_down once it has ended, finished or cancelled: the
        # moment a stale one could have reached the node, or no longer can.
        self.ended: list[str] = []

    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None, terms: Terms | None = None,
                      accepted: Callable[[], None] | None = None,
                      emptied: Callable[[], None] | None = None) -> str | None:
        self.node.append("cordon")
        self.terms.append(terms)
        if self.accept:
            self.told.append(accepted is not None)
        if accepted is not None and self.accept:
            self.node.append("evictions accepted")
            accepted()
        await self.drain_go.wait()
        if self.pods_left:
            self.node.append("drained, pods left")
            return None  # as policy.on_drain_timeout = "proceed" goes on
        self.node.append("drained")
        if emptied is not None:
            emptied()
        return None

    async def give_back(self, lent: object, **_: object) -> str | None:
        self.returns += 1
        try:
            await self.return_go.wait()
            self.node.append("uncordon")
            return None
        finally:
            self.ended.append("return")

    async def lendee_down(self, *, why: str) -> None:
        try:
            await self.down_go.wait()
            self.node.append("cordon (down)")
        finally:
            self.ended.append("down")


async def ask(agent: Agent, vm: str) -> None:
    """The start of `vm` through the hook, asked again as a player would while the agent
    could not record it in time (a save slower than the hook's budget beside other work;
    the refusal says to start again)."""
    for _ in range(3):
        verdict = await agent._on_hook(hook(vm, at=time.time()))
        if "could not record the request" not in verdict.message:
            return


def hook(vm: str, *, at: float, id: str = "h1") -> HookEvent:
    return HookEvent(id=id, time=at, domain=vm, op="prepare", sub="begin", extra="-",
                     xml="<domain/>")


TWO_LENT = TWO_LENDEES + """
[owners.coop]
gpus = ["gpu-a", "gpu-b"]

[timeouts]
guest_agent = "1s"
shutdown = "1s"
start = "2s"

[policy]
relend_delay = "60s"
lint_before_start = false

[verify]
method = "none"
"""


async def two_lent(tmp_path: Path, config: str = TWO_LENT) -> tuple[Agent, Agent, FakeLibvirt]:
    """Node-a and node-b lent, each its own `Agent`, on one fake libvirt."""
    primary = service.build(parse(config.format(root=tmp_path), "test.toml"))
    assert primary.fleet is not None
    a, b = (m for m in primary.fleet.members.values() if isinstance(m, Agent))
    fake = FakeLibvirt(primary)
    fatal = asyncio.get_running_loop().create_future()
    for agent in (a, b):
        agent.libvirt = fake
        agent._fatal = fatal
    fake.running |= {"node-a", "node-b"}
    for agent in (a, b):
        agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: a.state.phase is Phase.LENT and b.state.phase is Phase.LENT)
    return a, b, fake
