"""The agent's steps against the real control plane: a return to the cluster still
waiting for the node when an owner asks must never uncordon it in the middle of the new
drain, and a cordon of ours lifted by hand is ours no more.

A real `Agent` (the control tests' fake libvirt), the real `KubeCluster` and `Kube`, and
the real kube-apiserver; the node's status is written as the admin, the kubelet's part:
kept NotReady so that the return waits, then made Ready once the drain has cordoned it
(the moment a stale return would have uncordoned).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from hostagent.service.agent import Agent
from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import parse
from hostagent.surfaces.inbox import HookEvent
from hostagent.cluster.kube import Kube, cordon_marker
from hostagent.host.libvirt import ExecResult, HostError, Lifecycle
from hostagent.host.verify import BOOT_ID
from hostagent.core.model import IntentSource, Observed, OwnerWants, Phase
from tests.controlplane import ControlPlane
from tests.controlplane.proxy import FaultProxy
from tests.unit.kube_scaffold import FAST
from tests.unit.agents import (  # noqa: F401 (a fixture)
    CONFIG,
    FakeLibvirt,
    no_step_outlives_its_test,
)
from tests.waiting import until

pytestmark = pytest.mark.usefixtures("sink")

KUBE_CONFIG = (CONFIG.replace('"{relend}"', '"60s"')
               .replace("[timeouts]", "[timeouts]\nready = \"30s\"\ndrain = \"10s\"")
               .replace("[policy]", "[policy]\npartial = false") + "\n[kubernetes]\n")


NODE = "gpu-node"
BOOT = "0f1e2d3c-4b5a-4978-8a9b-0c1d2e3f4a5b"  # the guest's boot id, as its kubelet posts it


class Guest(FakeLibvirt):
    """The lab-less lendee, whose guest agent reads its boot id: a return counts the
    node's status only once its bootID is this boot's (invariant 14)."""

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "cat" and args == [BOOT_ID]:
            return ExecResult(0, BOOT + "\n", "")
        raise HostError(f"guest agent of {name}: {path}: Failed to execute child process")


class Node:
    """The node, as the admin reads and writes it with kubectl."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    async def get(self) -> dict[str, Any]:
        out = await asyncio.to_thread(self.plane.kubectl, "get", "node", NODE, "-o", "json")
        node: dict[str, Any] = json.loads(out.stdout)
        return node

    async def until(self, cond: Callable[[dict[str, Any]], bool], what: str) -> None:
        """tests.waiting.until the node, as kubectl gets it, satisfies `cond` (asked every
        0.2 s: a process each time)."""
        async def holds() -> bool:
            return cond(await self.get())
        await until(holds, what, every=0.2)

    async def ready(self) -> None:
        """The kubelet's Ready, as it posts it."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await asyncio.to_thread(self.plane.kubectl, "patch", "node", NODE,
                                "--subresource=status", "--type=merge", "-p", json.dumps(
            {"status": {"nodeInfo": {"bootID": BOOT},
                        "conditions": [{"type": "Ready", "status": "True",
                                        "reason": "KubeletReady", "lastHeartbeatTime": stamp,
                                        "lastTransitionTime": stamp}]}}))

    async def cordon(self, unschedulable: bool) -> None:
        """What `kubectl cordon` and `kubectl uncordon` do."""
        await asyncio.to_thread(self.plane.kubectl, "cordon" if unschedulable else "uncordon",
                                NODE)


@pytest.fixture
async def node(plane: ControlPlane) -> AsyncIterator[Node]:
    """gpu-node with 2 GPUs, not Ready, until the test ends."""
    plane.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"capacity": {"nvidia.com/gpu": "2", "pods": "110"},
                   "allocatable": {"nvidia.com/gpu": "2", "pods": "110"}}}))
    try:
        yield Node(plane)
    finally:
        plane.kubectl("delete", "node", NODE, check=False)



@pytest.fixture
async def kube(plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(plane.admin, timing=FAST) as k:
        yield k


class Returns(KubeCluster):
    """Notes each return once it has ended, finished or cancelled: from then on it
    can uncordon nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended = 0

    async def give_back(self, *args: Any, **kwargs: Any) -> str | None:
        try:
            return await super().give_back(*args, **kwargs)
        finally:
            self.ended += 1


async def test_a_stale_return_never_uncordons_the_node_a_new_drain_cordoned(
        node: Node, plane: ControlPlane, tmp_path: Path) -> None:
    agent = Agent(parse(KUBE_CONFIG.format(root=tmp_path), "test.toml"))
    fake = Guest(agent)
    agent.libvirt = fake
    agent.start()
    async with FaultProxy(plane.admin) as proxy, await Kube.connect(
            proxy.write_kubeconfig(tmp_path / "proxied.kubeconfig"), timing=FAST) as kube:
        cluster = Returns(kube, agent.cfg, remember_cordon=agent._remember_cordon)
        agent.cluster = cluster
        fake.running.add("gpu-node")
        agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
        await until(lambda: agent.state.phase is Phase.JOINING)
        # The return is waiting for the node (this boot's kubelet, then Ready): it
        # watches it.
        await until(lambda: proxy.watching("^/api/v1/nodes$") or cluster.ended,
                    "the return watching the node")
        assert not cluster.ended
        await agent._on_hook(HookEvent(id="h1", time=time.time(), domain="gaming1",
                                       op="prepare", sub="begin", extra="-", xml="<domain/>"))
        await node.until(lambda n: n["spec"].get("unschedulable") is True,
                             "the node cordoned")
        await node.ready()  # a return still alive would uncordon now
        await until(lambda: "gaming1" in fake.running, timeout=15)
        await until(lambda: cluster.ended == 1, "the return to end")  # cancelled, or done
        now = await node.get()
        spec, notes = now["spec"], now["metadata"].get("annotations", {})
        assert spec.get("unschedulable") is True
        assert notes.get(cordon_marker("hostagent.io/")) == "hostagent"
        assert agent.state.phase is Phase.OFF  # all or nothing: off while gaming1 plays


async def test_a_cordon_of_ours_lifted_by_hand_is_ours_no_more(
        node: Node, kube: Kube, tmp_path: Path) -> None:
    """Our cordon while a game runs is lifted by hand (kubectl uncordon), and later an
    administrator cordons the node: the next return leaves their cordon in place."""
    text = KUBE_CONFIG.replace('"60s"', '"0.2s"').format(root=tmp_path)
    agent = Agent(parse(text, "test.toml"))
    fake = Guest(agent)
    agent.libvirt = fake
    agent.start()
    agent.cluster = KubeCluster(kube, agent.cfg, remember_cordon=agent._remember_cordon)
    await node.ready()
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT, timeout=15)
    assert agent.apply(OwnerWants(at=time.time(), owner="gaming1", intent_id="p1",
                                  source=IntentSource.CONTROL))
    await until(lambda: "gaming1" in fake.running, timeout=15)
    marker = cordon_marker("hostagent.io/")
    assert (await node.get())["metadata"]["annotations"].get(marker) == "hostagent"
    await node.cordon(False)  # kubectl uncordon, mid-game
    await node.until(lambda n: marker not in n["metadata"].get("annotations", {}),
                     "the cordon's marker taken off")
    await node.cordon(True)  # kubectl cordon, an administrator's, later
    fake.running.discard("gaming1")
    agent.lifecycle("gaming1", Lifecycle.STOPPED)
    await until(lambda: agent.state.phase is Phase.LENT, timeout=15)
    assert (await node.get())["spec"].get("unschedulable") is True
