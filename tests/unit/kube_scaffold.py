"""What the tests of the Kubernetes adapter share: timings short enough for a test, the
adapter's clock moved past its deadlines once what a test waits for has happened
(`Clock`), and the real control plane behind a fault proxy (`real_api`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from hostagent.cluster.kube import Kube, Timing
from tests.controlplane import ControlPlane
from tests.controlplane.nvidia import DEVICE_CLASS
from tests.controlplane.proxy import FaultProxy
from tests.controlplane.seed import Seed
from tests.waiting import until

FAST = Timing(request_timeout=2.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
              evict_retry=0.05, delete_poll=0.02, watch_timeout=5.0)


@dataclass
class Api:
    """The real control plane as a test of the adapter sees it: `proxy` in front (what
    the client under test connects to, and its faults), `seed` behind it (the admin's
    hands, for what the cluster holds)."""

    proxy: FaultProxy
    seed: Seed

    @property
    def url(self) -> str:
        return self.proxy.url

    def write_kubeconfig(self, path: Path) -> Path:
        return self.proxy.write_kubeconfig(path)


@contextlib.asynccontextmanager
async def real_api(plane: ControlPlane, **seed_knobs: Any) -> AsyncIterator[Api]:
    """A fault proxy before the admin's credential and a Seed, reset when it ends."""
    async with Seed(plane, **seed_knobs) as seed, FaultProxy(plane.admin) as proxy:
        yield Api(proxy, seed)


@contextlib.asynccontextmanager
async def gpu_node_api(plane: ControlPlane, *others: str) -> AsyncIterator[Api]:
    """`real_api` with gpu-node (its kubelet running) and the nodes `others`, and NVIDIA's
    DeviceClass: where the tests of a live GPU change find the cluster."""
    async with real_api(plane) as api:
        with contextlib.suppress(ApiException):  # 409: an earlier test's
            resource: Any = client.ResourceV1Api(api.seed.core.api_client)
            await resource.create_device_class(DEVICE_CLASS)
        for node in ("gpu-node", *others):
            await api.seed.node(node)
        async with api.seed.kubelet("gpu-node"):
            yield api


class Clock:
    """The adapter's clock, which a test moves past every deadline once what it waits
    for has happened: a drain then meets its timeout on a condition, not after a few
    tenths of a second that a loaded machine may need for the first answer alone."""

    def __init__(self, kube: Kube, monkeypatch: pytest.MonkeyPatch) -> None:
        self.skew = 0.0
        monkeypatch.setattr(kube, "_now", lambda: asyncio.get_running_loop().time() + self.skew)

    async def expire_when(self, cond: Callable[[], object], api: Api | None = None) -> None:
        """Past every deadline set so far, once `cond()`; and with `api`, its open watches
        ended, as the server ends one (the wait then looks at its deadline at once)."""
        await until(cond, "what ends the wait")
        self.skew += 3600.0  # past any timeout a test gives
        if api is not None:
            api.proxy.drop_watches(clean=True)


def plain_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for a server of a test's own on plain HTTP, with no credential (the
    fuzzed replies of tests/unit/cluster/test_fuzz_kube.py, which no real server gives)."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url}}],
        "users": [{"name": "test", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    return path
