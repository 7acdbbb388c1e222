"""What the tests of the cluster's steps share (test_cluster.py, test_adopt_node.py): the
agent's cordon marker and taint, its configuration, a KubeCluster on the test's Kube,
and a node's status and labels set, and its boot, as its kubelet would."""

from __future__ import annotations

from typing import Any
from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import Config, parse
from hostagent.cluster.kube import Kube, cordon_marker
from tests.fakes import FakeMetrics
from tests.controlplane.seed import gpu_status
from tests.configs import lendee_toml
from tests.unit.kube_scaffold import Api


PREFIX = "hostagent.io/"
MARKER = cordon_marker(PREFIX)


TAINT = "hostagent.io/borrowed=true:NoSchedule"


def config(extra: str = 'skip_wait_for_delete_timeout = "1s"',
           policy: str = "proceed") -> Config:
    return parse(lendee_toml(uuids=False) + f"""
[timeouts]
drain = "5s"
ready = "3s"

[policy]
on_drain_timeout = "{policy}"

[kubernetes]
lent_taints = ["{TAINT}"]
{extra}
""", "test.toml")


def cluster_for(kube: Kube, cfg: Config | None = None,
                metrics: FakeMetrics | None = None) -> KubeCluster:
    return KubeCluster(kube, cfg or config(), remember_cordon=lambda _: None, metrics=metrics)


async def set_status(api: Api, node: str = "gpu-node", **status: Any) -> None:
    await api.seed.node_status(node, **status)


async def boot(api: Api, gpus: int, **knobs: Any) -> None:
    """The lendee booted with `gpus` GPUs: the device plugin and GFD publish them."""
    labels, allocatable = gpu_status(gpus, **knobs)
    await relabel(api, labels)
    await set_status(api, allocatable=allocatable, capacity=allocatable)


async def relabel(api: Api, labels: dict[str, str], node: str = "gpu-node") -> None:
    """The node's nvidia.com/ labels replaced by `labels`, as GFD writes them."""
    old = (await api.seed.get_node(node))["metadata"]["labels"]
    gone: dict[str, str | None] = {k: None for k in old if k.startswith("nvidia.com/")}
    await api.seed.patch_node(node, {"metadata": {"labels": gone | labels}})
