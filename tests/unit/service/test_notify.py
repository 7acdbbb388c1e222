"""A notification to a URL before each drain (kured's --notify-url): an HTTP POST with a
small JSON body, sent from the event loop without blocking it, bounded by
notify.timeout; a receiver that is slow, down or failing delays the drain by that cap at
most, and its failure is journaled. A real `Agent` (the executor's own drain step) with
the control tests' fake libvirt and the steps tests' recording cluster; the receiver is
a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from hostagent.core.config import ConfigError, parse
from hostagent.core.levers import Terms
from hostagent.core.model import Observed
from hostagent.host import journal
from hostagent.service.agent import Agent
from tests.unit.agents import (  # noqa: F401 (a fixture)
    HeldCluster,
    ask,
    CONFIG,
    FakeLibvirt,
    no_step_outlives_its_test,
)
from tests.waiting import until

WAIT = 10.0  # a bound, never a measure


class Receiver:
    """An HTTP server that keeps each request (its head and body) with when it came, and
    answers `status`, or nothing at all (`answer` False)."""

    def __init__(self, order: list[str], *, status: int = 200, answer: bool = True) -> None:
        self.order, self.status, self.answer = order, status, answer
        self.requests: list[tuple[str, dict[str, str], bytes, float]] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode()
            headers = {}
            while (header := (await reader.readline()).decode().strip()):
                name, _, value = header.partition(":")
                headers[name.lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((line.strip(), headers, body, time.monotonic()))
            self.order.append("notified")
            if not self.answer:
                await asyncio.Event().wait()  # until the test ends
            writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def serving(receiver: Receiver) -> AsyncIterator[None]:
    """`receiver` on a loopback port until the block ends, its connections with it."""
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        await receiver.handle(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    receiver.port = server.sockets[0].getsockname()[1]
    try:
        yield
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


@pytest.fixture
async def order() -> list[str]:
    return []


class OrderedCluster(HeldCluster):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order
        self.drain_go.set()
        self.return_go.set()
        self.cordoned_at = 0.0

    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None, terms: Terms | None = None,
                      accepted: Callable[[], None] | None = None,
                      emptied: Callable[[], None] | None = None) -> str | None:
        self.order.append("cordon")
        self.cordoned_at = time.monotonic()
        return await super().reclaim(owners, regrow=regrow, until=until, terms=terms,
                                     accepted=accepted, emptied=emptied)


def agent_notifying(tmp_path: Path, port: int, cluster: HeldCluster,
                    timeout: str = "1s") -> tuple[Agent, FakeLibvirt]:
    """make_agent's agent, with a [notify] section."""
    cfg = parse(CONFIG.format(root=tmp_path, relend="60s") + (
        f'\n[notify]\nurl = "http://127.0.0.1:{port}/hooks/drain?token=abc"\n'
        f'timeout = "{timeout}"\n'), "test.toml")
    agent = Agent(cfg)
    fake = FakeLibvirt(agent)
    agent.libvirt = fake
    agent.start()
    agent.cluster = cluster
    agent.cluster_given = True
    return agent, fake


async def start_and_reclaim(agent: Agent, fake: FakeLibvirt, cluster: OrderedCluster) -> None:
    fake.running.add("gpu-node")
    agent.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    await until(lambda: cluster.returns == 1)
    await ask(agent, "gaming1")
    await until(lambda: "cordon" in cluster.order)


async def test_a_drain_is_announced_to_the_url_before_it_begins(
        tmp_path: Path, order: list[str], sink: journal.ListSink) -> None:
    receiver = Receiver(order)
    async with serving(receiver):
        cluster = OrderedCluster(order)
        agent, fake = agent_notifying(tmp_path, receiver.port, cluster)
        await start_and_reclaim(agent, fake, cluster)
        await until(lambda: "gaming1" in fake.running)
    assert order == ["notified", "cordon"]
    line, headers, body, _ = receiver.requests[0]
    assert line == "POST /hooks/drain?token=abc HTTP/1.1"
    assert headers["content-type"] == "application/json"
    sent = json.loads(body)
    assert (sent["event"], sent["node"], sent["lendee"], sent["for"], sent["regrow"]) == (
        "drain", "gpu-node", "gpu-node", ["gaming1"], False)
    assert len(body) < 1024
    notified = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "notify"]
    assert notified[0].fields["HOSTAGENT_RESULT"] == "sent"
    assert "token=abc" not in notified[0].message  # a URL may carry a secret


async def test_a_receiver_that_never_answers_delays_the_drain_by_the_cap_alone(
        tmp_path: Path, order: list[str], sink: journal.ListSink) -> None:
    receiver = Receiver(order, answer=False)
    async with serving(receiver):
        cluster = OrderedCluster(order)
        agent, fake = agent_notifying(tmp_path, receiver.port, cluster, timeout="1s")
        await start_and_reclaim(agent, fake, cluster)
        await until(lambda: "gaming1" in fake.running)
        assert order == ["notified", "cordon"]
        waited = cluster.cordoned_at - receiver.requests[0][3]
        assert 0.5 < waited < 2.5, waited
    failed = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "notify"]
    assert failed[0].fields["HOSTAGENT_RESULT"] == "failed"
    assert "1s" in failed[0].message and failed[0].priority == journal.Priority.WARNING


async def test_a_receiver_that_is_down_or_fails_is_journaled_and_the_drain_goes_on(
        tmp_path: Path, order: list[str], sink: journal.ListSink) -> None:
    receiver = Receiver(order, status=500)
    async with serving(receiver):
        cluster = OrderedCluster(order)
        agent, fake = agent_notifying(tmp_path, receiver.port, cluster)
        await start_and_reclaim(agent, fake, cluster)
        await until(lambda: "gaming1" in fake.running)
    failed = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "notify"]
    assert "500" in failed[0].message
    # Down: nobody listens on the port any more.
    order.clear()
    cluster = OrderedCluster(order)
    agent, fake = agent_notifying(tmp_path / "down", receiver.port, cluster)
    (tmp_path / "down").mkdir()
    await start_and_reclaim(agent, fake, cluster)
    await until(lambda: "gaming1" in fake.running)
    assert order == ["cordon"]
    failed = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "notify"]
    assert len(failed) == 2 and failed[1].fields["HOSTAGENT_RESULT"] == "failed"


@pytest.mark.parametrize(("section", "wanted"), [
    ('url = "ftp://x/y"', "not an http"),
    ('url = "http://"', "not an http"),
    ('url = "https://hooks.lan/x"\ntimeout = "30s"', "at most 10s"),
    ('timeout = "1s"', "url"),
])
def test_the_setting_is_checked(tmp_path: Path, section: str, wanted: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(CONFIG.format(root=tmp_path, relend="1s") + f"\n[notify]\n{section}\n")
    assert wanted in str(e.value)
