"""The agent's executor on a bad day: stale steps, a state file that cannot be written,
a clock stepped back. A real `Agent` with the control tests' fake libvirt; the cluster
is a recorder plugged in at the agent's `Cluster` seam, whose steps the tests hold and
release to force the interleavings a real API server allows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hostagent.host import journal
from hostagent.host import state as persisted
from hostagent.service.agent import Agent
from hostagent.core import levers
from hostagent.core.config import parse
from hostagent.surfaces.inbox import Inbox, serve_hooks
from hostagent.host.libvirt import Lifecycle
from hostagent.core.model import (
    GpuPods,
    Hold,
    IntentSource,
    Observed,
    OwnerStopped,
    OwnerWants,
    Phase,
    Regrow,
    Resume,
)
from tests.unit.agents import (  # noqa: F401 (a fixture)
    CONFIG,
    FakeLibvirt,
    HeldCluster,
    ask,
    hook,
    healthy,
    make_agent,
    no_step_outlives_its_test,
)
from tests.waiting import until
from tests.unit.hook_scaffold import HOOK, Place, run_hook


pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


def agent_with(tmp_path: Path, cluster: HeldCluster) -> tuple[Agent, FakeLibvirt]:
    agent, fake = make_agent(tmp_path, relend="60s")
    agent.cluster = cluster
    agent.cluster_given = True
    return agent, fake


async def test_a_stale_return_never_uncordons_the_node_mid_drain(tmp_path: Path) -> None:
    """An owner asks while the lendee is JOINING (its return waits for the node): the
    return is cancelled before the drain begins, so it cannot uncordon in the middle of
    it (pods scheduled then would be killed without eviction)."""
    cluster = HeldCluster()
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: cluster.returns == 1)
    assert agent.state.phase is Phase.JOINING
    await ask(agent, "gaming1")
    await until(lambda: cluster.node == ["cordon"])
    cluster.return_go.set()  # the old return would now uncordon
    await until(lambda: cluster.ended == ["return"])  # cancelled, or done
    assert cluster.node == ["cordon"]
    cluster.drain_go.set()
    await until(lambda: "gaming1" in fake.running)
    assert "uncordon" not in cluster.node[: cluster.node.index("drained")]


async def test_a_stale_drain_never_touches_a_node_lent_again(tmp_path: Path) -> None:
    """The other order: a drain still under way when its reclaim is given up (the owner's
    start cancelled and the lendee lent again is not possible mid-drain, but a reread
    after a libvirt reconnect starts the road over): the old drain is cancelled and
    awaited before the new one runs, so the node sees one drain at a time."""
    cluster = HeldCluster()
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: cluster.returns == 1)
    await ask(agent, "gaming1")
    await until(lambda: cluster.node == ["cordon"])
    # libvirt reconnects: the machine re-reads reality and starts the reclaim over.
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: cluster.node == ["cordon", "cordon"])
    cluster.drain_go.set()
    await until(lambda: "gaming1" in fake.running)
    # One drain finished, and only the current one: the stale one never reported.
    assert cluster.node == ["cordon", "cordon", "drained"]


async def test_a_slow_cordon_after_a_stop_never_lands_after_the_next_return(
        tmp_path: Path) -> None:
    """The lendee stops by hand and its node's cordon hangs (the API is slow); it is lent
    again meanwhile. The cordon is a step of the phase it began in: it never lands after
    the next return's uncordon, which would leave the node lent and cordoned."""
    cluster = HeldCluster()
    cluster.drain_go.set()
    cluster.return_go.set()
    cluster.down_go.clear()
    agent, fake = agent_with(tmp_path, cluster)
    agent.policy = dataclasses.replace(agent.policy, relend_delay=0.1)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)
    fake.running.discard("gpu-node")
    agent.lifecycle("gpu-node", Lifecycle.STOPPED)
    await until(lambda: agent.state.phase is Phase.LENT and cluster.node.count("uncordon") == 2)
    cluster.down_go.set()  # the cordon of the stop, late
    await until(lambda: "down" in cluster.ended)  # cancelled, or done
    assert cluster.node[-1] == "uncordon", cluster.node


class GatedLibvirt(FakeLibvirt):
    """Holds reads of a domain's XML (the lint before a start) and starts until let go."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.xml_go = asyncio.Event()
        self.start_go = asyncio.Event()

    async def xml(self, name: str) -> str:
        self.calls.append(("reading", name))
        await self.xml_go.wait()
        return await super().xml(name)

    async def start(self, name: str) -> None:
        self.calls.append(("starting", name))
        await self.start_go.wait()
        await super().start(name)


@pytest.mark.parametrize("when", ["linting", "starting"])
async def test_release_racing_the_agents_own_start_answers_the_truth(
        tmp_path: Path, when: str) -> None:
    """gaming1's start is under way (its GPUs are free) when `hostagent release gaming1`
    comes: before libvirt is asked, the start is withdrawn and never happens; once libvirt
    runs it, the verb says it cannot be withdrawn, and gaming1 runs."""
    agent, _ = agent_with(tmp_path, HeldCluster())
    fake = GatedLibvirt(agent)
    agent.libvirt = fake
    policy = dataclasses.replace(agent.cfg.policy, lint_before_start=True)
    agent.cfg = dataclasses.replace(agent.cfg, policy=policy)
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    assert agent.apply(OwnerWants(at=time.time(), owner="gaming1", intent_id="p1",
                                  source=IntentSource.CONTROL))
    if when == "starting":
        fake.xml_go.set()
        await until(lambda: ("starting", "gaming1") in fake.calls)
    else:
        await until(lambda: ("reading", "gaming1") in fake.calls)
    replies = [r async for r in agent.verbs.handlers()["release"]({"vm": "gaming1"})]
    fake.xml_go.set()
    fake.start_go.set()
    if when == "linting":
        # Once every step has ended (none is left to lend: the relend is 60 s off), the
        # start has happened or never will.
        await until(lambda: not agent.executor.tasks, "the start step to end")
        assert replies[-1]["ok"] and replies[-1]["data"]["cancelled"], replies
        assert "gaming1" not in fake.running and ("starting", "gaming1") not in fake.calls
    else:
        assert not replies[-1]["ok"] and "cannot be withdrawn" in replies[-1]["error"]
        await until(lambda: "gaming1" in agent.state.running_owners)


class DiesAtOnce(FakeLibvirt):
    """A start libvirt reports done, of a domain that was gone before its events came."""

    async def start(self, name: str) -> None:
        self.calls.append(("start", name))


async def test_a_start_is_reported_only_for_a_domain_that_runs(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """gaming1's QEMU exits right after libvirt started it and its events are lost: the
    request fails with the reason instead of "gaming1 is running"."""
    agent, _ = agent_with(tmp_path, HeldCluster())
    fake = DiesAtOnce(agent)
    agent.libvirt = fake
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    assert agent.apply(OwnerWants(at=time.time(), owner="gaming1", intent_id="p1",
                                  source=IntentSource.CONTROL))
    await until(lambda: not agent.state.intents)
    assert "gaming1" not in agent.state.running_owners
    said = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_INTENT") == "p1"]
    assert said[-1].startswith("could not start gaming1: gaming1 failed to start: it stopped")


async def test_a_failed_save_refuses_the_request_and_keeps_the_machine_moving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sink: journal.ListSink) -> None:
    """Disk full while a request arrives: the request is refused with the reason (it
    could not be made durable), facts are still taken and acted on, health says so, and
    the save is retried until it works."""
    cluster = HeldCluster()
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.update({"gaming2"})
    agent.apply(Observed(at=time.time(), lendee_running=False,
                         owners_running=frozenset({"gaming2"})))
    real_save = persisted.save_state
    full = True

    def save(path: Path, state: persisted.State) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(path, state)

    monkeypatch.setattr(persisted, "save_state", save)
    assert not await agent.request(OwnerWants(at=time.time(), owner="gaming1",
                                              intent_id="p1", source=IntentSource.CONTROL))
    assert agent.state.intents == ()  # nothing taken that could not be kept
    # A fact is taken even so: gaming2 stopped.
    assert agent.apply(OwnerStopped(at=time.time(), owner="gaming2"))
    assert "gaming2" not in agent.state.running_owners
    await agent.saver.flush()
    await agent.health.check()
    failing = {r.check: r.detail for r in agent.health.last if not r.ok}
    assert "No space left on device" in (failing.get("state file") or "")
    assert any("No space left on device" in e.message for e in sink.entries)
    full = False
    agent._retry_save()
    await agent.saver.flush()
    # Asked again within the checks' max_age: the save that worked is not hidden by the
    # results of a run before it.
    await agent.health.check()
    assert all(r.ok for r in agent.health.last if r.check == "state file")
    saved, _ = persisted.load_state(agent.cfg.state_file)
    assert saved.lendee_phase == agent.state.phase.value


async def test_a_live_hook_event_is_live_whatever_the_clock_says(tmp_path: Path) -> None:
    """The clock was stepped back at boot: a live event stamped before the agent's start
    is still live (the owner's start is deferred and recorded), never treated as one
    spooled while the agent was down."""
    agent, fake = agent_with(tmp_path, HeldCluster())
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    verdict = await agent._on_hook(hook("gaming1", at=agent.started_at - 3600))
    assert verdict.decision == "defer"
    assert [i.owner for i in agent.state.intents] == ["gaming1"]


async def test_a_second_owner_of_a_gpu_is_refused_with_one_sentence(tmp_path: Path) -> None:
    """gaming1 and gaming1-linux share gpu-a: while gaming1 plays, the other's start is
    refused at once, and nothing is recorded (no reclaim, no wait on the game)."""
    agent = Agent(parse(TWO_OWNERS.format(root=tmp_path), "test.toml"))
    fake = FakeLibvirt(agent)
    agent.libvirt = fake
    agent.start()
    fake.running.add("gaming1")
    agent.apply(Observed(at=time.time(), lendee_running=False,
                         owners_running=frozenset({"gaming1"})))
    verdict = await agent._on_hook(hook("gaming1-linux", at=time.time()))
    assert (verdict.decision, verdict.message.split(" (")[0]) == (
        "defer", "gpu-a is in use by gaming1")
    assert agent.state.intents == ()
    replies = [r async for r in agent.verbs.handlers()["play"]({"vm": "gaming1-linux"})]
    assert replies[-1] == {"ok": False,
                           "error": "gaming1-linux cannot start now: gpu-a is in use by gaming1"}


# gaming1-linux shares gpu-a with gaming1 (gaming2 stays, unused here).
TWO_OWNERS = CONFIG.replace("[owners.gaming2]", '[owners.gaming1-linux]\ngpus = ["gpu-a"]\n\n'
                            "[owners.gaming2]").replace('"{relend}"', '"60s"')


async def test_at_host_shutdown_the_lent_node_is_drained_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host goes down with the lendee lent: its node is cordoned and drained while
    the API still answers, so it comes back cordoned and verified. A plain stop of the
    agent (a restart, an upgrade) leaves the node alone."""
    cluster = HeldCluster()
    cluster.drain_go.set()
    cluster.return_go.set()
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)
    assert cluster.node == ["uncordon"]
    monkeypatch.setattr(agent, "host_stopping", lambda: True)
    await agent._drain_for_shutdown()
    assert cluster.node[:3] == ["uncordon", "cordon", "drained"]


async def test_an_owner_starts_at_boot_once(tmp_path: Path) -> None:
    """[owners.X] start_at_boot: started when the agent first runs after a host boot
    (a new kernel boot id), through the usual road; not on a first run ever (the host
    may have been up for days), not again when the agent restarts."""
    text = TWO_OWNERS.format(root=tmp_path).replace(
        '[owners.gaming1]\ngpus = ["gpu-a"]',
        '[owners.gaming1]\ngpus = ["gpu-a"]\nstart_at_boot = true')

    def agent() -> Agent:
        made = Agent(parse(text, "test.toml"))
        made.libvirt = FakeLibvirt(made)
        made.start()
        return made

    first = agent()
    assert not first.host_booted
    await first._save()
    saved, _ = persisted.load_state(first.cfg.state_file)
    persisted.save_state(first.cfg.state_file, dataclasses.replace(saved, boot_id="before"))
    booted = agent()
    assert booted.host_booted
    booted._start_at_boot()
    assert [i.owner for i in booted.state.intents] == ["gaming1"]
    fake = booted.libvirt
    assert isinstance(fake, FakeLibvirt)
    await until(lambda: "gaming1" in fake.running)
    await booted.saver.flush()  # what an agent does before it exits
    assert not agent().host_booted


async def test_a_metrics_port_in_use_is_retried_not_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is taken when the agent starts (another exporter, an address not up yet
    at boot): the agent goes on without it and binds it once it is free, instead of
    exiting 2 and being left failed by RestartPreventExitStatus."""
    import functools
    import socket

    from hostagent.core import backoff
    from hostagent.service import serving
    # Its retries 50 ms apart at first, not 1 s (keep_trying's `first`): the retry, not
    # its pace, is what is checked.
    monkeypatch.setattr(serving, "keep_trying", functools.partial(backoff.keep_trying,
                                                                  first=0.05))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    text = TWO_OWNERS.format(root=tmp_path) + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    agent = Agent(parse(text, "test.toml"))
    agent.start()
    await agent.endpoints.serve_metrics()  # returns: it keeps trying in the background
    assert agent.endpoints.exporter is None
    squatter.close()
    await until(lambda: agent.endpoints.exporter is not None, timeout=10)
    assert agent.endpoints.exporter is not None
    agent.endpoints.exporter.close()
    assert agent.ended is None, agent.ended
    for task in list(agent.executor.tasks):
        task.cancel()


async def test_a_regrow_restarts_under_gpu_jobs_once_regrow_max_wait_is_over(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """gaming1 ends while a GPU pod runs on the node: the when-idle regrow waits, says
    for how long at most, and restarts the lendee with the pod still there once
    regrow_max_wait is over, saying so (not "no pod requests a GPU")."""
    cluster = HeldCluster()
    cluster.drain_go.set()
    cluster.return_go.set()
    agent, fake = agent_with(tmp_path, cluster)
    agent.policy = dataclasses.replace(agent.policy, relend_delay=0.2, regrow=Regrow.WHEN_IDLE,
                                       regrow_max_wait=0.3)
    fake.running.update({"gaming1", "gpu-node"})
    agent.apply(Observed(at=time.time(), lendee_running=True,
                         owners_running=frozenset({"gaming1"}), lendee_gpus=frozenset({"gpu-b"})))
    await until(lambda: agent.state.phase is Phase.LENT)
    agent.apply(GpuPods(at=time.time(), count=1))
    fake.running.discard("gaming1")
    agent.lifecycle("gaming1", Lifecycle.STOPPED)
    await until(lambda: agent.state.regrow_waiting)
    assert any("it restarts once none does (policy.regrow = when-idle), or in 0.3s with them"
               in e.message for e in sink.entries)
    await until(lambda: agent.state.lent == {"gpu-a", "gpu-b"}
                and agent.state.phase is Phase.LENT)
    draining = [e.message for e in sink.entries if "restarting gpu-node" in e.message]
    assert len(draining) == 1 and draining[0].endswith(
        "is free again and 1 pod(s) on its node still request a GPU after "
        "policy.regrow_max_wait (0.3s): they start over: restarting gpu-node to add it")
    for task in list(agent.executor.tasks):
        task.cancel()


@pytest.mark.parametrize("regrow", ["never", "always"])
async def test_regrow_never_keeps_the_smaller_lendee_running(tmp_path: Path,
                                                             regrow: str) -> None:
    """gaming1 ends while the lendee runs with gpu-b alone: `never` leaves it running as
    it is (no restart, no drain); `always` restarts it with both after relend_delay."""
    cluster = HeldCluster()
    cluster.drain_go.set()
    cluster.return_go.set()
    agent, fake = agent_with(tmp_path, cluster)
    agent.policy = dataclasses.replace(agent.policy, relend_delay=0.2, regrow=Regrow(regrow))
    fake.running.update({"gaming1", "gpu-node"})
    agent.apply(Observed(at=time.time(), lendee_running=True,
                         owners_running=frozenset({"gaming1"}), lendee_gpus=frozenset({"gpu-b"})))
    await until(lambda: agent.state.phase is Phase.LENT)
    fake.running.discard("gaming1")
    agent.lifecycle("gaming1", Lifecycle.STOPPED)
    if regrow == "never":
        # The stop is taken at once, and no timer is left that could restart gpu-node.
        assert "gaming1" not in agent.state.running_owners and agent.state.relend_at is None
        assert agent.state.phase is Phase.LENT and agent.state.lent == {"gpu-b"}
        assert ("agent shutdown", "gpu-node") not in fake.calls
    else:
        await until(lambda: agent.state.lent == {"gpu-a", "gpu-b"}
                    and agent.state.phase is Phase.LENT)
        assert ("agent shutdown", "gpu-node") in fake.calls


async def test_a_slow_disk_never_keeps_a_hook_from_its_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync takes a second (an SD card, a disk busy with something else) while
    the state keeps changing: the hooks that come meanwhile are answered by the agent,
    none spooled. An owner's request that cannot be on disk within the hook's share of
    its budget is refused with the reason, never deferred unrecorded; once the disk is
    quick again, the same request is deferred and kept."""
    cluster = HeldCluster()
    cluster.return_go.set()
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)
    short = Path(tempfile.mkdtemp(prefix="hk-"))  # a socket's path has a short limit
    place = Place(short / "hook.sock", short / "spool")
    server = await serve_hooks(place.socket, Inbox(agent._on_hook), log=logging.getLogger())
    fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(1.0)
        fsync(fd)

    def hooks() -> list[subprocess.CompletedProcess[str]]:
        """As libvirtd runs them: in processes of their own, whatever the agent does."""
        calls = [("other-vm", "<domain><name>other-vm</name></domain>")] * 3 + [
            ("gaming1", "<domain><name>gaming1</name></domain>")]
        return [subprocess.run(
            [sys.executable, "-I", "-S", str(HOOK), vm, "prepare", "begin", "-"], input=xml,
            env={"PATH": "/usr/bin:/bin", "HOSTAGENT_SOCKET": str(place.socket),
                 "HOSTAGENT_SPOOL": str(place.spool)},
            capture_output=True, text=True, timeout=30, check=False) for vm, xml in calls]

    changing = True

    async def keep_changing() -> None:
        while changing:  # each a change of the state file, each two fsyncs
            agent.apply(Resume(at=time.time()) if agent.state.hold else Hold(at=time.time()))
            await asyncio.sleep(0.05)

    try:
        monkeypatch.setattr(os, "fsync", slow_fsync)
        changer = asyncio.get_running_loop().create_task(keep_changing())
        *runs, asked = await asyncio.to_thread(hooks)
        changing = False
        await changer
        assert place.spooled() == [] and [r.returncode for r in runs] == [0, 0, 0], runs
        assert asked.returncode != 0 and "could not record the request" in asked.stderr, asked
        assert [i.owner for i in agent.state.intents] == []
        monkeypatch.setattr(os, "fsync", fsync)
        await agent.saver.flush()
        again = await run_hook(place, "gaming1", "prepare", "begin", "-")
        assert again.rc != 0 and "will start by itself" in again.stderr, again
        assert [i.owner for i in agent.state.intents] == ["gaming1"]
        saved, _ = persisted.load_state(agent.cfg.state_file)
        assert [i.owner for i in saved.intents] == ["gaming1"]
    finally:
        server.close()
        shutil.rmtree(short)


async def test_a_players_reclaim_shuts_the_lendee_down_once_the_evictions_are_accepted(
        tmp_path: Path) -> None:
    """drain.shutdown_when = "accepted" (the default): the guest's shutdown begins while
    the evicted pods still stop, and the owner starts only once the lendee is off."""
    cluster = HeldCluster()
    cluster.accept = True
    agent, fake = agent_with(tmp_path, cluster)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    cluster.return_go.set()
    await until(lambda: agent.state.phase is Phase.LENT)
    await ask(agent, "gaming1")
    await until(lambda: "gaming1" in fake.running)
    assert cluster.node[:3] == ["uncordon", "cordon", "evictions accepted"]
    assert "drained" not in cluster.node  # the pods were still going
    order = [c for c in fake.calls if c in (("agent shutdown", "gpu-node"), ("start", "gaming1"))]
    assert order == [("agent shutdown", "gpu-node"), ("start", "gaming1")]
    terms = cluster.terms[0]
    assert isinstance(terms, levers.Terms) and terms.grace_cap == 10.0
    cluster.drain_go.set()  # the rest of the drain, beside, ends
    await until(lambda: "drained" in cluster.node)
    healthy(agent)


async def test_with_shutdown_when_gone_the_shutdown_waits_for_the_pods(tmp_path: Path) -> None:
    cluster = HeldCluster()
    cluster.accept = True  # every eviction accepted at once, the pods still going
    agent, fake = agent_with(tmp_path, cluster)
    agent.cfg = dataclasses.replace(agent.cfg, drain=dataclasses.replace(
        agent.cfg.drain, shutdown_when=levers.ShutdownWhen.GONE))
    agent.executor.cfg = agent.cfg
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    cluster.return_go.set()
    await until(lambda: agent.state.phase is Phase.LENT)
    await ask(agent, "gaming1")
    # The moment the default ("accepted") begins the shutdown: every eviction accepted,
    # the agent told through the reclaim's `accepted` hook. Under "gone" it asked for
    # no such word, so nothing can start the shutdown there.
    await until(lambda: cluster.told)
    assert cluster.told == [False]
    assert ("agent shutdown", "gpu-node") not in fake.calls
    cluster.drain_go.set()
    await until(lambda: "gaming1" in fake.running)
    assert cluster.node[:3] == ["uncordon", "cordon", "drained"]
    healthy(agent)
