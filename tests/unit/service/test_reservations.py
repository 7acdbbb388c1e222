"""Reservations that cannot be turned against a player: the time read with the zone's
rules for its date (daylight saving), an unused reservation that yields to another
owner's real start and a cooldown before it comes back, who may cancel, and answers
that say what was kept (`hostagent.core.reserve`, `hostagent.service.reservations`)."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostagent.core import clock
from hostagent.core import reserve as plan
from hostagent.core.config import parse
from hostagent.core.machine import verdict
from hostagent.core.model import Reserve
from hostagent.host import journal
from hostagent.host import state as persisted
from hostagent.service.agent import Agent
from hostagent.service.reservations import _hhmm
from hostagent.core.reserve import Reservation
from hostagent.surfaces.control import Caller, Rights, serving
from tests.unit.partial_world import TOPO, S, gpus, A, B, C
from tests.waiting import until
from tests.unit.agents import lent
from tests.unit.reserve_scaffold import (
    BERLIN, SHARED, Pods, make_agent, reserve)

# --- daylight saving ----------------------------------------------------------------------


async def test_reserve_on_the_eve_of_a_change_lands_at_that_days_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, berlin: None) -> None:
    agent, _ = make_agent(tmp_path)
    eve = datetime(2026, 10, 24, 21, 0, tzinfo=BERLIN)
    monkeypatch.setattr(clock, "now", eve.timestamp)
    done = await reserve(agent, vm="gaming1", at="20:00")
    assert done["ok"] is True, done
    assert agent.state.reservations[0].at == datetime(
        2026, 10, 25, 20, 0, tzinfo=BERLIN).timestamp()
    assert done["data"]["at"] == "2026-10-25T20:00+01:00"
    twice = await reserve(agent, vm="gaming2", at="02:30")
    assert "02:30 happens twice on 2026-10-25" in twice["data"]["message"]


# --- the agent, with two owners of one card -----------------------------------------------

def records(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, str, dict[str, Any]]]:
    kept: list[tuple[str | None, str, dict[str, Any]]] = []
    record = journal.record

    def keep(event: str, message: str, **fields: Any) -> None:
        kept.append((fields.get("result"), message, fields))
        record(event, message, **fields)
    monkeypatch.setattr(journal, "record", keep)
    return kept


# --- an unused reservation yields, and waits a cooldown ----------------------------------


def test_past_its_time_an_unused_reservation_stops_no_other_owner() -> None:
    held = Reservation(vm="gaming1", at=100.0, by="ssh key phone", made=0.0, evict_at=50.0,
                       holding=True)
    state = S(lent=gpus(B, C), reservations=(held,))
    decision, message = verdict(state, "gaming-win", topo=TOPO)
    # Before its time: refused, naming who holds it (the journal records the sentence).
    assert (decision, message.split(" (follow")[0]) == (
        "refuse", "gpu-a is reserved for gaming1 (by ssh key phone)")
    yielding = S(lent=gpus(B, C), reservations=(replace(held, yielding=True),))
    assert verdict(yielding, "gaming-win", topo=TOPO)[0] == "proceed"
    assert yielding.reserved == {"gaming1"}  # still kept from the lendee meanwhile
    assert A not in yielding.lent


def test_a_reservation_renewed_while_it_holds_yields_from_the_first_time() -> None:
    held = Reservation(vm="gaming1", at=100.0, by="k", made=0.0, evict_at=50.0, holding=True)
    later = plan.put([held], Reservation(vm="gaming1", at=400.0, by="k", made=90.0))
    assert later[0].yields_at == 100.0
    timing = plan.Timing()
    assert plan.due(later, 100.0, timing).yields == later
    fresh = plan.put([], Reservation(vm="gaming1", at=400.0, by="k", made=90.0))
    assert fresh[0].yields_at == 400.0


async def test_an_unused_reservation_yields_to_another_owners_start_then_cools_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    now = [time.time()]
    monkeypatch.setattr(clock, "now", lambda: now[0])
    agent.reservations.cluster = Pods()
    at = now[0] + 60
    assert (await agent.reservations.reserve("gaming1", at, by="ssh key kid",
                                             principal="ssh key SHA256:kid"))[0]
    await agent.reservations.step()  # the notice
    await agent.reservations.step()  # the hold
    assert agent.state.reserved == {"gaming1"}
    kept = records(monkeypatch)
    # Before its time another owner of gpu-a is refused, and the journal names who holds it.
    refused = await collect(agent, "play", vm="gaming-win")
    assert refused[-1]["ok"] is False
    assert "gpu-a is reserved for gaming1 (by ssh key kid)" in refused[-1]["error"]
    assert any(r == "refused" and "reserved for gaming1 (by ssh key kid)" in m
               for r, m, _ in kept)
    # Past its time and unused, it yields: gaming-win starts, and the reservation ends.
    now[0] = at
    await agent.reservations.step()
    assert agent.state.reservations[0].yielding
    await until(lambda: agent.state.phase.value == "off")
    await fake.start("gaming-win")
    await until(lambda: "gaming-win" in agent.state.running_owners)
    await agent.reservations.step()
    assert agent.state.reservations == ()
    assert [m for r, m, _ in kept if r == "yielded"] == [
        f"gaming-win started: gaming1's reservation for {_hhmm(at)} (by ssh key kid) went "
        f"unused past its time and yields to it; gaming1 may be reserved again from "
        f"{_hhmm(at + 3600)}"]
    # Reserving it again waits the cooldown (policy.reserve_cooldown, 1h by default).
    again, message = await agent.reservations.reserve("gaming1", at + 600, by="ssh key kid",
                                                      principal="ssh key SHA256:kid")
    assert not again and message == (
        f"gaming1 cannot be reserved again before {_hhmm(at + 3600)}: its last reservation "
        "held its GPUs and went unused (policy.reserve_cooldown)")
    now[0] = at + 3600
    assert (await agent.reservations.reserve("gaming1", at + 4000, by="ssh key kid",
                                             principal="ssh key SHA256:kid"))[0]


def test_the_cooldown_is_a_setting() -> None:
    cfg = parse(SHARED.format(root="/tmp/x", relend="1s"), "test.toml")
    assert cfg.policy.reserve_cooldown == 3600.0
    cfg = parse(SHARED.format(root="/tmp/x", relend="1s").replace(
        'relend_delay = "1s"', 'relend_delay = "1s"\nreserve_cooldown = "10m"'), "test.toml")
    assert cfg.policy.reserve_cooldown == 600.0


async def collect(agent: Agent, verb: str, **args: Any) -> list[dict[str, Any]]:
    return [r async for r in agent.verbs.handlers()[verb](args)]


# --- who may cancel ----------------------------------------------------------------------

ALICE = Caller(user="alice", uid=1000, gid=100, pid=1, groups=frozenset({100}))
BOB = Caller(user="bob", uid=1001, gid=100, pid=2, groups=frozenset({100}))


async def test_only_who_reserved_or_cancel_any_may_cancel_or_replace(
        tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    at = datetime.fromtimestamp(time.time() + 7200).astimezone().replace(microsecond=0)
    with serving(ALICE):
        assert (await reserve(agent, vm="gaming1", at=at.isoformat()))["ok"]
    assert agent.state.reservations[0].principal == "uid 1000"
    with serving(BOB):
        for args in ({"cancel": True}, {"at": at.isoformat()}):
            refused = await reserve(agent, vm="gaming1", **args)
            assert refused["ok"] is False and "only they, or a caller granted cancel-any" \
                in refused["error"], refused
    assert [r.principal for r in agent.state.reservations] == ["uid 1000"]
    with serving(replace(BOB, cancel_any=True)):
        assert (await reserve(agent, vm="gaming1", at=at.isoformat()))["ok"]
    with serving(ALICE):  # bob's now
        assert not (await reserve(agent, vm="gaming1", cancel=True))["ok"]
    with serving(BOB):
        assert (await reserve(agent, vm="gaming1", cancel=True))["ok"]
    assert agent.state.reservations == ()
    # An SSH key is its fingerprint, whatever its comment says.
    key = Caller(user="phone", via="ssh", peer="10.0.0.2:5", fingerprint="SHA256:abc")
    assert key.principal == "ssh key SHA256:abc"


def test_control_verbs_scope_a_verb_to_a_vm() -> None:
    rights = Rights(group=100, group_name="players",
                    group_verbs=frozenset({"status", "reserve:gaming1", "cancel-any:gaming1"}))
    assert rights.may(ALICE, "reserve", "gaming1") is None
    assert rights.may(ALICE, "reserve", "gaming2") == (
        "alice may use 'reserve' only on gaming1 (control_verbs in the configuration)")
    assert rights.may(ALICE, "reserve") is not None
    assert rights.may(ALICE, "cancel-any", "gaming1") is None
    assert rights.may(ALICE, "cancel-any", "gaming2") is not None
    assert rights.may(ALICE, "play", "gaming1") is not None
    cfg = parse('control_group = "players"\ncontrol_verbs = ["status", "reserve:gaming1"]\n'
                + SHARED.format(root="/tmp/x", relend="1s"), "test.toml")
    assert cfg.control_verbs == {"status", "reserve:gaming1"}


# --- answers that say what was kept --------------------------------------------------------


async def test_a_reservation_that_cannot_be_saved_is_not_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, fake = make_agent(tmp_path)
    await lent(agent, fake)
    pods = Pods()
    agent.reservations.cluster = pods
    seen: list[tuple[Reservation, ...]] = []

    async def broken() -> OSError:
        seen.append(agent.state.reservations)
        await agent.reservations.step()  # the timeline runs meanwhile: it must wait
        return OSError(28, "No space left on device")
    agent.reservations.saved = broken
    soon = datetime.fromtimestamp(time.time() + 120).astimezone().isoformat()
    answer = await reserve(agent, vm="gaming1", at=soon)
    assert answer == {"ok": False, "error": "gaming1 is not reserved: the reservation could "
                      "not be recorded (No space left on device); ask again"}
    assert agent.state.reservations == () and pods.told == []
    await agent.reservations.step()
    assert pods.told == [] and agent.state.reserved == frozenset()


async def test_a_cancel_answers_after_its_save_and_keeps_what_was_not_saved(
        tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    at = datetime.fromtimestamp(time.time() + 7200).astimezone().replace(microsecond=0)
    assert (await reserve(agent, vm="gaming1", at=at.isoformat()))["ok"]
    order: list[str] = []

    async def slow() -> OSError | None:
        order.append("saving")
        return OSError(5, "Input/output error")
    agent.reservations.saved = slow
    answer = await reserve(agent, vm="gaming1", cancel=True)
    order.append("answered")
    assert order == ["saving", "answered"]
    assert answer == {"ok": False, "error": "gaming1's reservation is not cancelled: the "
                      "change could not be recorded (Input/output error); ask again"}
    assert [r.vm for r in agent.state.reservations] == ["gaming1"]


async def test_a_reservation_the_machine_refused_is_never_answered_ok(
        tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    now = float(int(time.time()))
    stale = Reservation(vm="old-game", at=now + 3600, by="me", made=now)
    persisted.save_state(agent.cfg.state_file, persisted.State(reservations=(stale,)))
    agent.start()  # as a restart reads it
    assert not agent.apply(Reserve(at=now, reservations=(stale,)))  # the machine refuses
    at = datetime.fromtimestamp(now + 7200).astimezone().isoformat()
    answer = await reserve(agent, vm="gaming1", at=at)
    assert answer["ok"] is False and answer["error"].startswith("gaming1 is not reserved")
    assert all(r.vm != "gaming1" for r in agent.state.reservations)
