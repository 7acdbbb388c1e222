"""A stale entry of the configuration never stops the agent for good: an owner VM that
is no longer defined in libvirt (`virsh undefine` of an old VM) is said, turns health
red with the fix, and the agent goes on with everything else; defined again, health is
green again with nothing to restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.host import journal

from tests.unit.surfaces.test_control import (  # noqa: F401 (a fixture)
    make_agent,
    no_step_outlives_its_test,
)

pytestmark = pytest.mark.usefixtures("sink")


async def test_an_undefined_owner_makes_health_red_not_an_exit(
        tmp_path: Path, sink: journal.ListSink) -> None:
    agent, fake = make_agent(tmp_path)
    defined = {"gpu-node", "gaming1"}  # gaming2 was undefined

    async def defined_domains() -> set[str]:
        return set(defined)

    fake.defined_domains = defined_domains  # type: ignore[attr-defined]
    fake.uri = "qemu:///system"  # type: ignore[attr-defined]
    await agent._check_domains()
    said = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "waiting"]
    assert len(said) == 1 and "owners.gaming2" in said[0].message
    assert "virsh define" in said[0].message
    domains = {r.check: r for r in await agent.health.check(max_age=0)}["domains"]
    assert not domains.ok and "owners.gaming2 ('gaming2')" in domains.detail
    defined.add("gaming2")
    assert {r.check: r for r in await agent.health.check(max_age=0)}["domains"].ok
