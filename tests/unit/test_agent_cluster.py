"""The agent's steps against the API stand-in: a return to the cluster still waiting for
the node when an owner asks must never uncordon it in the middle of the new drain.

A real `Agent` (the control tests' fake libvirt), the real `KubeCluster` and `Kube`, and
the stand-in API server; the node is kept NotReady so that the return waits, then made
Ready once the drain has cordoned it (the moment a stale return would have uncordoned).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.agent import Agent
from hostagent.cluster import KubeCluster
from hostagent.config import parse
from hostagent.inbox import HookEvent
from hostagent.kube import Kube, cordon_marker
from hostagent.libvirt_host import Lifecycle
from hostagent.model import IntentSource, Observed, OwnerWants, Phase
from tests.kubeapi import StandIn
from tests.kubeapi.cluster import ready_condition
from tests.kubeapi.rules import NODES
from tests.unit.test_control import (  # noqa: F401 (a fixture)
    CONFIG,
    FakeLibvirt,
    no_step_outlives_its_test,
    until,
)

pytestmark = pytest.mark.usefixtures("sink")

KUBE_CONFIG = (CONFIG.replace('"{relend}"', '"60s"')
               .replace("[timeouts]", "[timeouts]\nready = \"30s\"\ndrain = \"10s\"")
               .replace("[policy]", "[policy]\npartial = false") + "\n[kubernetes]\n")


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn(termination_scale=0.005) as standin:
        standin.cluster.add_node("gpu-node", gpus=2, ready=False)
        yield standin


def ready(api: StandIn) -> None:
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["status"]["conditions"] = [ready_condition("True")]
        return obj
    api.cluster.update(NODES, None, "gpu-node", change, subresource="status")


async def test_a_stale_return_never_uncordons_the_node_a_new_drain_cordoned(
        api: StandIn, kube: Kube, tmp_path: Path) -> None:
    agent = Agent(parse(KUBE_CONFIG.format(root=tmp_path), "test.toml"))
    fake = FakeLibvirt(agent)
    agent.libvirt = fake  # type: ignore[assignment]
    agent._fatal = asyncio.get_running_loop().create_future()
    agent.cluster = KubeCluster(kube, agent.cfg, remember_cordon=agent._remember_cordon)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.JOINING)
    await asyncio.sleep(0.3)  # the return is waiting for the node to be Ready
    await agent._on_hook(HookEvent(id="h1", time=time.time(), domain="gaming1", op="prepare",
                                   sub="begin", extra="-", xml="<domain/>"))
    node = api.cluster.node
    await until(lambda: node("gpu-node")["spec"].get("unschedulable") is True)
    ready(api)  # a return still alive would uncordon now
    await until(lambda: "gaming1" in fake.running, timeout=15)
    await asyncio.sleep(0.5)
    spec, notes = node("gpu-node")["spec"], node("gpu-node")["metadata"].get("annotations", {})
    assert spec.get("unschedulable") is True
    assert notes.get(cordon_marker("hostagent.io/")) == "hostagent"
    assert agent.state.phase is Phase.OFF  # all or nothing: off while gaming1 plays


def spec(api: StandIn, unschedulable: bool) -> None:
    """What `kubectl cordon` and `kubectl uncordon` write."""
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["unschedulable"] = unschedulable
        return obj
    api.cluster.update(NODES, None, "gpu-node", change)


async def test_a_cordon_of_ours_lifted_by_hand_is_ours_no_more(
        api: StandIn, kube: Kube, tmp_path: Path) -> None:
    """Our cordon while a game runs is lifted by hand (kubectl uncordon), and later an
    administrator cordons the node: the next return leaves their cordon in place."""
    text = KUBE_CONFIG.replace('"60s"', '"0.2s"').format(root=tmp_path)
    agent = Agent(parse(text, "test.toml"))
    fake = FakeLibvirt(agent)
    agent.libvirt = fake  # type: ignore[assignment]
    agent._fatal = asyncio.get_running_loop().create_future()
    agent.cluster = KubeCluster(kube, agent.cfg, remember_cordon=agent._remember_cordon)
    ready(api)
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT, timeout=15)
    assert agent.apply(OwnerWants(at=time.time(), owner="gaming1", intent_id="p1",
                                  source=IntentSource.CONTROL))
    await until(lambda: "gaming1" in fake.running, timeout=15)
    node = api.cluster.node
    marker = cordon_marker("hostagent.io/")
    assert node("gpu-node")["metadata"]["annotations"].get(marker) == "hostagent"
    spec(api, False)  # kubectl uncordon, mid-game
    await until(lambda: marker not in node("gpu-node")["metadata"].get("annotations", {}))
    spec(api, True)  # kubectl cordon, an administrator's, later
    fake.running.discard("gaming1")
    agent.lifecycle("gaming1", Lifecycle.STOPPED)
    await until(lambda: agent.state.phase is Phase.LENT, timeout=15)
    assert node("gpu-node")["spec"].get("unschedulable") is True
