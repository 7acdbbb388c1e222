"""``[drain] stop = "power-off"``: a reclaim whose drain emptied the node freezes the
lendee's filesystems through its guest agent, then powers it off; a freeze refused, a
power-off refused (thawed first) or a drain that left pods falls back to the guest's
own shutdown, whose timeout and force-off still apply. A real `Agent` with the fake
libvirt, the cluster a recorder at the agent's `Cluster` seam."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from hostagent.core.config import parse
from hostagent.core.model import Observed, Phase
from hostagent.host import journal
from hostagent.host.libvirt import HostError
from hostagent.service import poweroff
from hostagent.service.agent import Agent
from tests.unit.agents import (
    CONFIG,
    FakeLibvirt,
    HeldCluster,
    ask,
    healthy,
    no_step_outlives_its_test,
)
from tests.waiting import until

__all__ = ["no_step_outlives_its_test"]

pytestmark = pytest.mark.usefixtures("sink")

POWER_OFF = '\n[drain]\nstop = "power-off"\n'


class Freezing(FakeLibvirt):
    """qemu-ga's fsfreeze through libvirt: `frozen` filesystems, or the error set."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.frozen = 2
        self.freeze_error: HostError | None = None
        self.destroy_error: HostError | None = None
        self.thaw_error: HostError | None = None
        self.destroy_hangs = False

    async def freeze_filesystems(self, name: str, *, timeout: int = 10) -> int:
        self.calls.append(("freeze", name))
        if self.freeze_error is not None:
            raise self.freeze_error
        return self.frozen

    async def thaw_filesystems(self, name: str, *, timeout: int = 10) -> int:
        self.calls.append(("thaw", name))
        if self.thaw_error is not None:
            raise self.thaw_error
        return self.frozen

    async def destroy(self, name: str) -> None:
        if self.destroy_hangs:
            self.calls.append(("destroy hangs", name))
            await asyncio.Event().wait()
        if self.destroy_error is not None:
            self.calls.append(("destroy refused", name))
            raise self.destroy_error
        await super().destroy(name)


def agent_with(tmp_path: Path, extra: str = POWER_OFF, *,
               policy: str = "") -> tuple[Agent, Freezing, HeldCluster]:
    text = CONFIG.format(root=tmp_path, relend="60s")
    text = text.replace("[policy]\n", f"[policy]\n{policy}") + extra
    cfg = parse(text, "test.toml")
    agent = Agent(cfg)
    fake = Freezing(agent)
    agent.libvirt = fake
    cluster = HeldCluster()
    cluster.drain_go.set()
    cluster.return_go.set()
    agent.cluster = cluster
    agent.cluster_given = True
    agent.start()
    return agent, fake, cluster


async def reclaimed(agent: Agent, fake: Freezing) -> list[str]:
    """Lend the lendee, start gaming1 through the hook, wait until it runs: what libvirt
    was asked of the lendee until then, in order (it starts again after, with gpu-b)."""
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)
    await ask(agent, "gaming1")
    await until(lambda: "gaming1" in fake.running)
    healthy(agent)
    calls = fake.calls[:fake.calls.index(("start", "gaming1"))]
    return [how for how, vm in calls if vm == "gpu-node"]


def said(sink: journal.ListSink) -> list[str]:
    return [e.message for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "power-off"]


async def test_a_drained_lendee_is_frozen_then_powered_off(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake, cluster = agent_with(tmp_path)
    assert await reclaimed(agent, fake) == ["freeze", "destroy"]  # no guest-agent shutdown
    assert "drained" in cluster.node
    assert said(sink) == ["gpu-node is drained: 2 filesystems frozen through its guest agent, "
                          'powering it off (drain.stop = "power-off")']
    [stopping] = [e for e in sink.entries if e.fields.get("HOSTAGENT_TO") == "stopping"]
    assert stopping.message == (
        "gpu-node is drained: powering it off once its guest agent answers and has frozen "
        'its filesystems (drain.stop = "power-off"; its own shutdown if the drain left pods)')


async def test_a_freeze_refused_falls_back_to_the_guests_shutdown(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake, _ = agent_with(tmp_path)
    fake.freeze_error = HostError("freeze the filesystems of gpu-node: Guest agent is not "
                                  "responding: QEMU guest agent is not connected")
    assert await reclaimed(agent, fake) == ["freeze", "thaw", "agent shutdown"]
    [warning] = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "power-off"]
    assert warning.message == (
        "gpu-node's filesystems could not be frozen (freeze the filesystems of gpu-node: "
        "Guest agent is not responding: QEMU guest agent is not connected): shutting it "
        'down through its guest agent instead (drain.stop = "power-off" powers off only a '
        "guest whose filesystems are frozen)")
    assert warning.priority is journal.Priority.WARNING


async def test_a_power_off_refused_after_the_freeze_thaws_then_shuts_down(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake, _ = agent_with(tmp_path)
    fake.destroy_error = HostError("force off gpu-node: Failed to terminate process 4242")
    fake.frozen = 1
    assert await reclaimed(agent, fake) == ["freeze", "destroy refused", "thaw",
                                            "agent shutdown"]
    assert said(sink)[0] == ("gpu-node is drained: 1 filesystem frozen through its guest "
                             'agent, powering it off (drain.stop = "power-off")')
    assert said(sink)[-1] == ("gpu-node could not be powered off (force off gpu-node: Failed "
                              "to terminate process 4242): its filesystems thawed, shutting "
                              "it down through its guest agent instead")


async def test_a_power_off_that_hangs_and_a_thaw_refused_are_said_and_shut_down(
        tmp_path: Path, sink: journal.ListSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QEMU that does not exit within its bound, and an agent that no longer thaws:
    the journal says both, and the shutdown is tried all the same (its timeout and the
    force-off policy decide what follows)."""
    monkeypatch.setattr(poweroff, "DESTROY_TIMEOUT", 0.1)
    agent, fake, _ = agent_with(tmp_path)
    fake.destroy_hangs = True
    fake.thaw_error = HostError("thaw the filesystems of gpu-node: Guest agent is not "
                                "responding")
    assert await reclaimed(agent, fake) == ["freeze", "destroy hangs", "thaw",
                                            "agent shutdown"]
    assert said(sink)[-1] == (
        "gpu-node could not be powered off (no answer within 0.1 s): its filesystems could "
        "not be thawed (thaw the filesystems of gpu-node: Guest agent is not responding), "
        "shutting it down through its guest agent instead")


async def test_a_drain_that_left_pods_is_followed_by_the_guests_shutdown(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """A budget or the drain's timeout left pods (policy.on_drain_timeout = "proceed"):
    they keep their grace through the guest's own shutdown."""
    agent, fake, cluster = agent_with(tmp_path)
    cluster.pods_left = True
    assert await reclaimed(agent, fake) == ["agent shutdown"]
    assert said(sink) == [
        "gpu-node's drain did not see every evicted pod gone: shutting it down through its "
        'guest agent, so that none loses its grace (drain.stop = "power-off" powers off '
        "only a drained node)"]


async def test_by_default_a_drained_lendee_shuts_down_through_its_guest_agent(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake, cluster = agent_with(tmp_path, extra="")
    assert await reclaimed(agent, fake) == ["agent shutdown"]
    assert "drained" in cluster.node
    assert said(sink) == []
    [stopping] = [e for e in sink.entries if e.fields.get("HOSTAGENT_TO") == "stopping"]
    assert stopping.message == ("gpu-node is drained: shutting it down through its guest "
                                "agent once the agent answers")


async def test_the_fallback_shutdown_still_times_out_into_the_force_off(
        tmp_path: Path) -> None:
    """The freeze refused and the guest ignoring its shutdown: timeouts.shutdown, then
    policy.force_off_after's power-off, as without the setting."""
    agent, fake, _ = agent_with(tmp_path, policy='force_off_after = "0s"\n')
    fake.freeze_error = HostError("freeze the filesystems of gpu-node: Command "
                                  "guest-fsfreeze-freeze has been disabled")
    fake.ignores_shutdown.add("gpu-node")

    async def refused_then_off(name: str) -> None:
        fake.ignores_shutdown.discard(name)  # a destroy stops what a shutdown did not
        await FakeLibvirt.destroy(fake, name)

    fake.destroy = refused_then_off  # type: ignore[method-assign]
    assert await reclaimed(agent, fake) == ["freeze", "thaw", "agent shutdown", "destroy"]
