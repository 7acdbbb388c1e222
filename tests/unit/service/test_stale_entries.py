"""A stale entry of the configuration never stops the agent for good: an owner VM that
is no longer defined in libvirt (`virsh undefine` of an old VM) is said, turns health
red with the fix, and the agent goes on with everything else; defined again, health is
green again with nothing to restart."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hostagent.core.config import parse
from hostagent.host import journal

from hostagent.service.agent import Agent
from tests.unit.agents import (  # noqa: F401 (a fixture)
    CONFIG,
    make_agent,
    no_step_outlives_its_test,
)
from tests.unit.metrics_scaffold import MINIMAL

pytestmark = pytest.mark.usefixtures("sink")


async def test_an_undefined_owner_makes_health_red_not_an_exit(
        tmp_path: Path, sink: journal.ListSink, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, fake = make_agent(tmp_path)
    defined = {"gpu-node", "gaming1"}  # gaming2 was undefined

    async def defined_domains() -> set[str]:
        return set(defined)

    monkeypatch.setattr(fake, "defined_domains", defined_domains)
    fake.uri = "qemu:///system"
    await agent._check_domains()
    said = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "waiting"]
    assert len(said) == 1 and "owners.gaming2" in said[0].message
    assert "virsh define" in said[0].message
    domains = {r.check: r for r in await agent.health.check(max_age=0)}["domains"]
    assert not domains.ok and "owners.gaming2 ('gaming2')" in domains.detail
    defined.add("gaming2")
    assert {r.check: r for r in await agent.health.check(max_age=0)}["domains"].ok


class Real:
    """The Kubernetes adapter once its kubeconfig is there: records what reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def lendee_down(self, *, why: str) -> None:
        self.calls.append(f"cordon ({why})")

    async def reclaim(self, owners: list[str], **_: object) -> str | None:
        self.calls.append(f"drain for {', '.join(owners)}")
        return None

    async def health(self) -> str:
        return "node gpu-node is Ready"


async def test_a_missing_kubeconfig_makes_the_kubernetes_steps_wait(
        tmp_path: Path, sink: journal.ListSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an exit: health red and the steps waiting; the file written, they go on, a
    cordon asked meanwhile first."""
    import asyncio

    from hostagent.core.health import CheckFailed
    from hostagent.service import kubewait

    kubeconfig = tmp_path / "k3s.yaml"
    agent, _ = make_agent(tmp_path)
    agent.cfg = replace(agent.cfg, kubernetes=parse(
        f'[kubernetes]\nkubeconfig = "{kubeconfig}"\n' + MINIMAL, "t.toml").kubernetes)
    real = Real()

    tries: list[bool] = []  # each read of the kubeconfig: whether the file was there
    tried = asyncio.Event()

    async def connect(cfg: object, make: object) -> tuple[object, object]:
        tries.append(kubeconfig.exists())
        tried.set()
        if not kubeconfig.exists():
            raise kubewait.KubeConfigError(f"{kubeconfig} does not exist")
        return None, real

    monkeypatch.setattr(kubewait, "connect", connect)
    monkeypatch.setattr(kubewait, "RETRY", 0.01)
    assert await agent._connect_cluster() is None  # before: StartupError, exit status 2
    waiting = agent.cluster
    assert isinstance(waiting, kubewait.WaitingCluster)
    with pytest.raises(CheckFailed, match="does not exist"):
        await waiting.health()
    await waiting.lendee_down(why="gpu-node stopped")
    drain = asyncio.create_task(waiting.reclaim(["gaming1"]))
    asked = len(tries)
    async with asyncio.timeout(10):  # tried twice since: the drain had its turns meanwhile
        while len(tries) < asked + 2:
            tried.clear()
            await tried.wait()
    assert not drain.done() and real.calls == []
    kubeconfig.write_text("apiVersion: v1\n")
    assert await asyncio.wait_for(drain, 10) is None
    assert real.calls == ["cordon (gpu-node stopped)", "drain for gaming1"]
    assert await waiting.health() == "node gpu-node is Ready"
    assert [e.fields["HOSTAGENT_RESULT"] for e in sink.entries
            if e.fields.get("HOSTAGENT_EVENT") == "kubernetes"] == ["waiting", "ready"]


async def test_a_missing_control_group_is_taken_up_once_it_exists(
        tmp_path: Path, sink: journal.ListSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an exit: the control socket is root's alone meanwhile and health fails with
    the fix; once the group exists (groupadd), the socket is the group's, no restart."""
    import grp
    import logging
    import os
    import stat

    from hostagent.surfaces import control

    cfg = parse('control_group = "players"\n' + CONFIG.format(root=tmp_path, relend="1s"),
                "test.toml")
    agent = Agent(cfg)
    gid = os.getgid() if os.getuid() != 0 else 65534
    groups: dict[str, int] = {}

    def getgrnam(name: str) -> object:
        if name not in groups:
            raise KeyError(name)
        return type("Group", (), {"gr_gid": groups[name]})()

    monkeypatch.setattr(grp, "getgrnam", getgrnam)
    access = agent._control_access()  # before: StartupError, exit status 2
    server = await control.serve_control(cfg.control_socket, {}, log=logging.getLogger("t"),
                                         **access)
    try:
        assert stat.S_IMODE(cfg.control_socket.stat().st_mode) == 0o600
        checks = {r.check: r for r in await agent.health.check(max_age=0)}
        assert not checks["control group"].ok
        assert "groupadd players" in checks["control group"].detail
        groups["players"] = gid
        checks = {r.check: r for r in await agent.health.check(max_age=0)}
        assert checks["control group"].ok
        assert stat.S_IMODE(cfg.control_socket.stat().st_mode) == 0o660
        assert cfg.control_socket.stat().st_gid == gid
        assert access["access"]().group == gid
    finally:
        server.close()
