"""Stand-ins for what the agent talks to, typed against the interfaces they stand in for:
libvirt (`hostagent.host.libvirt.Domains`) and the metrics the cluster reports
(`hostagent.cluster.lent.Metrics`); the cluster's own is `hostagent.service.parts.
NoCluster`, which a fake cluster extends. Each fake is a subclass, so mypy checks every
method a test overrides against the real signature: a change there fails the fake's
type check instead of letting it drift."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from hostagent.cluster.lent import Metrics
from hostagent.core.config import Gpu
from hostagent.host.libvirt import Domains, ExecResult


class LibvirtStub(Domains):
    """libvirt that a test has not set up: each call it makes fails the test, saying
    which. A fake overrides what its test needs."""

    uri = "test:///stub"

    def _unexpected(self, call: str) -> AssertionError:
        return AssertionError(f"{type(self).__name__}: libvirt's {call} was not expected")

    connected = True

    async def connect(self, *, attempts: int | None = None) -> None:
        return None

    async def close(self) -> None:
        return None

    async def defined_domains(self) -> set[str]:
        raise self._unexpected("defined_domains")

    async def running_domains(self) -> set[str]:
        raise self._unexpected("running_domains")

    async def is_running(self, name: str) -> bool:
        raise self._unexpected("is_running")

    async def xml(self, name: str) -> str:
        raise self._unexpected("xml")

    async def inactive_xml(self, name: str) -> str:
        raise self._unexpected("inactive_xml")

    async def live_gpus(self, name: str, gpus: Mapping[str, Gpu]) -> frozenset[str]:
        raise self._unexpected("live_gpus")

    async def start(self, name: str) -> None:
        raise self._unexpected("start")

    async def start_with(self, name: str, *, drop: Collection[str],
                         gpus: Mapping[str, Gpu]) -> None:
        raise self._unexpected("start_with")

    async def attach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None:
        raise self._unexpected("attach_live")

    async def detach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None:
        raise self._unexpected("detach_live")

    async def shutdown_via_agent(self, name: str) -> None:
        raise self._unexpected("shutdown_via_agent")

    async def shutdown_via_acpi(self, name: str) -> None:
        raise self._unexpected("shutdown_via_acpi")

    async def destroy(self, name: str) -> None:
        raise self._unexpected("destroy")

    async def freeze_filesystems(self, name: str, *, timeout: int = 10) -> int:
        raise self._unexpected("freeze_filesystems")

    async def thaw_filesystems(self, name: str, *, timeout: int = 10) -> int:
        raise self._unexpected("thaw_filesystems")

    async def agent_command(self, name: str, command: dict[str, Any], *,
                            timeout: int = 5) -> Any:
        raise self._unexpected("agent_command")

    async def ping_agent(self, name: str, *, timeout: int = 3) -> bool:
        raise self._unexpected("ping_agent")

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        raise self._unexpected("guest_exec")

    async def screenshot(self, name: str, *, screen: int = 0) -> tuple[str, bytes]:
        raise self._unexpected("screenshot")


class FakeMetrics(Metrics):
    """What the cluster reported, each report kept in order."""

    def __init__(self) -> None:
        self.gpu_pods: list[int | None] = []
        self.holders: list[dict[str, str] | None] = []
        self.lost = 0

    def node_gpu_pods(self, count: int | None) -> None:
        self.gpu_pods.append(count)

    def gpu_lost(self) -> None:
        self.lost += 1

    def lent_gpu_pods(self, holders: dict[str, str] | None) -> None:
        self.holders.append(holders)
