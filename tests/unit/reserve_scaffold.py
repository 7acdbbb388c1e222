"""The reservations tests' shared parts: the host in Berlin's zone, the agent with two
owners of one card, the reserve verb, a cluster that counts its notices."""

from __future__ import annotations

import zoneinfo
from collections.abc import Callable
from pathlib import Path
from typing import Any


from hostagent.core.config import parse
from hostagent.service.agent import Agent
from hostagent.service.parts import NoCluster
from tests.unit.agents import CONFIG, FakeLibvirt

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")


SHARED = CONFIG + """
[owners.gaming-win]
gpus = ["gpu-a"]
"""


def make_agent(tmp_path: Path, extra: str = "") -> tuple[Agent, FakeLibvirt]:
    cfg = parse(SHARED.format(root=tmp_path, relend="0.2s") + extra, "test.toml")
    agent = Agent(cfg)
    fake = FakeLibvirt(agent)
    agent.libvirt = fake
    agent.start()
    return agent, fake


async def reserve(agent: Agent, **args: Any) -> dict[str, Any]:
    replies = [r async for r in agent.verbs.handlers()["reserve"](args)]
    return replies[-1]


class Pods(NoCluster):
    """The cluster's notice, counted: no pod may hear of a reservation not kept."""

    def __init__(self) -> None:
        self.told: list[float] = []

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        at = when(30.0)
        self.told.append(at)
        return at, ["ml/train-0"]
