"""Two lendees in one agent: a real `Agent` per lendee (`hostagent.service.main.build`)
with the control tests' fake libvirt. gaming1's start reclaims node-a only, node-b never
notices; coop, on a GPU of each, starts once both have let theirs go; every request is
on disk in the primary's state file before the hook hears "defer"."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hostagent.core.model import Phase
from hostagent.host import state as persisted
from hostagent.host.libvirt import Lifecycle
from hostagent.service import main as service
from hostagent.service.agent import Agent
from hostagent.surfaces.follow import format_status
from tests.unit.agents import (  # noqa: F401 (a fixture)
    TWO_LENT,
    FakeLibvirt,
    hook,
    two_lent,
    no_step_outlives_its_test,
)
from tests.waiting import until

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)

async def test_gaming1_reclaims_its_lendee_only_and_the_other_never_notices(
        tmp_path: Path) -> None:
    a, b, fake = await two_lent(tmp_path)
    b_state = b.state
    verdict = await a._on_hook(hook("gaming1", at=time.time(), id="h1"))
    assert verdict.decision == "defer" and "node-a holds gpu-a" in verdict.message
    saved, _ = persisted.load_state(a.state_file)
    assert [i.owner for i in saved.intents] == ["gaming1"]  # on disk before "defer"
    await until(lambda: "gaming1" in a.state.running_owners)
    assert ("agent shutdown", "node-a") in fake.calls and ("start", "gaming1") in fake.calls
    assert not [c for c in fake.calls if c[1] == "node-b"]
    assert b.state is b_state  # its machine was never stepped: its node, its jobs untouched
    assert "node-b" in fake.running


async def test_an_owner_on_both_lendees_starts_once_both_have_let_go(tmp_path: Path) -> None:
    a, b, fake = await two_lent(tmp_path)
    verdict = await a._on_hook(hook("coop", at=time.time(), id="h2"))
    assert verdict.decision == "defer"
    saved, _ = persisted.load_state(a.state_file)  # the primary's file keeps every request
    assert [i.owner for i in saved.intents] == ["coop"]
    await until(lambda: "coop" in a.state.running_owners and "coop" in b.state.running_owners)
    calls = fake.calls
    start = calls.index(("start", "coop"))
    assert calls.index(("agent shutdown", "node-a")) < start
    assert calls.index(("agent shutdown", "node-b")) < start
    assert calls.count(("start", "coop")) == 1
    assert not a.state.intents and not b.state.intents
    # Each lendee's own state is its own file's: node-b's beside the primary's.
    assert (tmp_path / "state" / "lendees" / "node-b.toml").exists()


async def test_a_lendee_stopped_by_hand_is_its_agents_alone(tmp_path: Path) -> None:
    a, b, fake = await two_lent(tmp_path)
    a_state = a.state
    fake.running.discard("node-b")
    a.lifecycle("node-b", Lifecycle.STOPPED)  # the primary's connection hears it
    await until(lambda: b.state.phase is Phase.OFF)
    assert a.state is a_state


async def test_a_pending_start_on_the_other_lendee_survives_a_restart(tmp_path: Path) -> None:
    """gaming2 waits for node-b, which ignores its shutdown; the agent restarts: the
    primary's file lists the request, and the new agent hands it to node-b's machine,
    the one that keeps gaming2, not node-a's (whose machine would fail it as unknown).
    node-b's shutdown may wait a minute: at 1 s a loaded machine saw it time out before
    the file was read, and the request end."""
    a, b, fake = await two_lent(tmp_path, TWO_LENT.replace('shutdown = "1s"', 'shutdown = "60s"'))
    fake.ignores_shutdown.add("node-b")
    verdict = await a._on_hook(hook("gaming2", at=time.time(), id="h3"))
    assert verdict.decision == "defer"
    await a.saver.flush()
    saved, _ = persisted.load_state(a.state_file)
    assert [i.owner for i in saved.intents] == ["gaming2"]
    again = service.build(a.whole)
    assert again.fleet is not None
    members = [m for m in again.fleet.members.values() if isinstance(m, Agent)]
    for m in members:
        m._load()
    again.fleet.spread()
    assert [(m.lendee, [i.owner for i in m.state.intents]) for m in members] == [
        ("node-a", []), ("node-b", ["gaming2"])]


async def test_status_tells_of_each_lendee(tmp_path: Path) -> None:
    a, b, fake = await two_lent(tmp_path)
    fake.ignores_shutdown.add("node-b")
    await a._on_hook(hook("gaming2", at=time.time(), id="h4"))
    await until(lambda: b.state.phase is Phase.STOPPING)
    replies = [r async for r in a.handlers()["status"]({})]
    data = replies[-1]["data"]
    assert data["lendee"]["domain"] == "node-a"  # as with one lendee: the first's
    assert [(s["domain"], s["phase"]) for s in data["lendees"]] == [
        ("node-a", "lent"), ("node-b", "stopping")]
    assert [(g["gpu"], g["lendee"], g["holder"]) for g in data["gpus"]] == [
        ("gpu-a", "node-a", "node-a"), ("gpu-b", "node-b", "node-b")]
    assert [i["owner"] for i in data["intents"]] == ["gaming2"]
    assert set(data["owners"]) == {"gaming1", "gaming2", "coop"}
    text = format_status(data)
    assert "lendee node-a: lent for" in text and "lendee node-b: stopping for" in text


async def test_metrics_have_a_lendee_label_per_lendee(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    a, b, _ = await two_lent(tmp_path)
    await a._on_hook(hook("gaming1", at=time.time(), id="h5"))
    await until(lambda: "gaming1" in a.state.running_owners)
    families = {f.name: f for f in text_string_to_metric_families(a.metrics.render().decode())}
    phase = {(s.labels["lendee"], s.labels["phase"]) for s in families[
        "hostagent_lendee_phase"].samples if s.value == 1}
    assert phase == {("node-a", "off"), ("node-b", "lent")}
    swaps = {(s.labels["lendee"], s.labels["kind"]): s.value
             for s in families["hostagent_swaps"].samples if s.name.endswith("_total")}
    assert swaps[("node-a", "reclaim")] == 1 and swaps[("node-b", "reclaim")] == 0
    # The agent's own: once, unlabelled.
    hooks = families["hostagent_hook_events"].samples
    assert hooks and all("lendee" not in s.labels for s in hooks)
    assert len(families["hostagent_build_info"].samples) == 1


async def test_a_stop_reaches_every_lendees_executor(tmp_path: Path) -> None:
    """What an executor may wait for (a VM's stop): told to every lendee's, whichever
    agent the VM belongs to."""
    a, b, _ = await two_lent(tmp_path)
    for vm in ("gaming2", "node-b", "some-vm"):
        a.lifecycle(vm, Lifecycle.STOPPED)
        assert all(vm in x.executor.facts.stopped and x.executor.facts.stopped[vm].is_set()
                   for x in (a, b)), vm


async def test_health_tells_of_each_lendee(tmp_path: Path) -> None:
    a, b, _ = await two_lent(tmp_path)
    results = {r.check: r for r in await a.health.check(max_age=0)}
    assert results["lendee node-b"].ok, results["lendee node-b"]
    b.save_failed = "cannot write it: disk full"
    results = {r.check: r for r in await a.health.check(max_age=0)}
    assert not results["lendee node-b"].ok
    assert "state file: cannot write it: disk full" in results["lendee node-b"].detail


async def test_hold_and_reclaim_one_lendee_or_every_lendee(tmp_path: Path) -> None:
    a, b, fake = await two_lent(tmp_path)
    handlers = a.handlers()
    replies = [r async for r in handlers["hold"]({"lendee": "node-b"})]
    assert replies[-1]["ok"] and "node-b is not lent again" in replies[-1]["data"]["message"]
    assert b.state.hold and not a.state.hold
    replies = [r async for r in handlers["hold"]({"lendee": "node-c"})]
    assert replies == [{"ok": False, "error": "node-c is not a lendee: the lendees are node-a, "
                                              "node-b; name one, or leave --lendee out for "
                                              "every lendee"}]
    replies = [r async for r in handlers["reclaim"]({"lendee": "node-b"})]
    assert replies[-1]["ok"], replies[-1]
    assert b.state.phase is Phase.OFF and a.state.phase is Phase.LENT
    assert ("agent shutdown", "node-b") in fake.calls and ("agent shutdown", "node-a") not in \
        fake.calls
    replies = [r async for r in handlers["resume"]({})]  # every lendee
    assert not a.state.hold and not b.state.hold
    assert [r async for r in b.verbs.handlers()["hold"]({"lendee": "node-a"})] == [
        {"ok": False, "error": "node-a is not a lendee here: node-b is; name it, or leave "
                               "--lendee out"}]
