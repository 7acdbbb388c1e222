"""At a restart of the agent, the running lendee's node is adopted only if it is in
service as the last lend left it: Ready, uncordoned, marked lent with exactly the GPUs
the lendee runs with, and each expected GPU advertised (real kube-apiserver)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hostagent.cluster.kube import Kube
from tests.controlplane import ControlPlane
from tests.unit.cluster_scaffold import PREFIX, boot, cluster_for, set_status
from tests.unit.kube_scaffold import Api, Clock, real_api

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node with 2 GPUs, its kubelet running (as test_cluster.py's)."""
    async with real_api(plane) as api:
        await api.seed.node("gpu-node", gpus=2)
        async with api.seed.kubelet("gpu-node"):
            yield api

BOTH = ["gpu-a", "gpu-b"]


async def lent_by_the_previous_agent(api: Api, kube: Kube) -> None:
    await boot(api, 2)
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    assert await cluster_for(kube).give_back(BOTH) is None


async def test_a_node_in_service_as_lent_is_adopted(api: Api, kube: Kube) -> None:
    await lent_by_the_previous_agent(api, kube)
    restarted = cluster_for(kube)
    assert await restarted.adopt(BOTH) is None
    # What the watch of the lent node and status need, as a lend decides it.
    assert restarted.expected is not None and restarted.expected.gpus == tuple(BOTH)


async def test_a_node_marked_with_other_gpus_is_not_adopted(api: Api, kube: Kube) -> None:
    await lent_by_the_previous_agent(api, kube)
    why = await cluster_for(kube).adopt(["gpu-a"])
    assert why is not None and "not marked lent with gpu-a" in why


async def test_a_cordoned_node_is_not_adopted(api: Api, kube: Kube) -> None:
    await lent_by_the_previous_agent(api, kube)
    await api.seed.patch_node("gpu-node", {"spec": {"unschedulable": True}})
    why = await cluster_for(kube).adopt(BOTH)
    assert why is not None and "cordoned" in why


async def test_a_node_short_of_its_gpus_is_not_adopted(
        api: Api, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
    await lent_by_the_previous_agent(api, kube)
    await set_status(api, allocatable={"nvidia.com/gpu": "1"})
    # Its wait for the GPUs (5 s) passes once it watches the node, which shows one.
    expiry = asyncio.create_task(Clock(kube, monkeypatch).expire_when(
        lambda: api.proxy.watching("^/api/v1/nodes$"), api))
    why = await cluster_for(kube).adopt(BOTH)
    await expiry
    assert why is not None and "1" in why and "nvidia.com/gpu" in why
