"""`hostagent run`: the agents for a configuration, one per lendee (the first serving
every endpoint, `Fleet` stepping them together), run until a signal stops them."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import replace

from hostagent.core import health
from hostagent.core.config import Config
from hostagent.core.topology import topology
from hostagent.host import journal
from hostagent.service.agent import Agent
from hostagent.service.fleet import Fleet, Whole
from hostagent.service.parts import Cluster
from hostagent.service.serving import StartupError


def build(cfg: Config, *, cluster: Callable[[str], Cluster | None] = lambda name: None,
          ) -> Agent:
    """The agent for `cfg`, with several lendees a `Fleet`'s primary; `cluster`: tests'."""
    views = [cfg.view(name) for name in cfg.lendees]
    primary = Agent(views[0], cluster=cluster(views[0].lendee.domain), whole=cfg)
    others = [Agent(v, cluster=cluster(v.lendee.domain), whole=cfg, primary=primary)
              for v in views[1:]]
    if others:
        agents = (primary, *others)
        fleet = Fleet({a.lendee: a for a in agents})  # sets each one's `fleet`
        primary.metrics.several = {a.lendee: a.metrics for a in agents}
        # One timeline for every reservation, its notice to each node whose GPUs it takes.
        primary.reservations.widen(
            replace(topology(cfg), lendee_gpus=frozenset().union(
                *(a.topo.lendee_gpus for a in agents))), Whole(fleet, primary.kept),
            lambda vm: [(a.lendee, a.cluster) for a in agents if a.topo.needs_lendee_gpus(vm)])
    for a in others:  # /healthz and status: each lendee's checks, one check each
        primary.health.add(f"lendee {a.lendee}", health.of_lendee(a.health))
    return primary


def run(cfg: Config) -> int:
    """`hostagent run`: the service's main; returns the process exit status."""
    agent = build(cfg)

    async def main() -> None:
        import signal
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        await agent.run()

    try:
        asyncio.run(main())
    except StartupError as e:
        journal.record("agent", f"cannot start: {e}", result="failed",
                       priority=journal.Priority.ERR)
        if "JOURNAL_STREAM" not in os.environ:  # under systemd, stderr *is* the journal
            print(f"hostagent: cannot start: {e}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:
        return 0
    return 0

