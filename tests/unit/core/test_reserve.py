"""Reservations (`hostagent reserve gaming1 --at 20:00`): the time read, the timeline
(notice, hold, end), the machine keeping a held reservation's GPUs from the lendee, the
verb over the control socket, SSH and MQTT, and the state file across a restart."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest

from hostagent.core import clock
from hostagent.host import journal
from hostagent.surfaces import homeassistant as ha
from hostagent.core import reserve as plan
from hostagent.host import state as persisted
from hostagent.service.parts import NoCluster
from hostagent.core.model import (
    DetachGpus,
    Drain,
    Hotplug,
    LendeeStopped,
    Observed,
    Phase,
    RelendDue,
    Reserve,
    ScheduleRelend,
    StartLendee,
    StartOwner,
    State,
)
from hostagent.service.reservations import _hhmm
from hostagent.core.reserve import BadReservation, Reservation, Timing
from hostagent.surfaces.ssh import BadCommand, parse_command, reserve_args
from tests.unit.agents import lent, make_agent
from tests.unit.partial_world import POLICY, A, B, C, S, gpus, go, run
from tests.unit.machine_scaffold import AT, wants
from tests.waiting import until

ZONE = timezone(timedelta(hours=1))
NOW = datetime(2026, 12, 4, 17, 30, tzinfo=ZONE)  # a Friday, 17:30 on the host's clock


# --- the time ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "when"), [
    ("20:00", datetime(2026, 12, 4, 20, 0, tzinfo=ZONE)),
    ("9:05", datetime(2026, 12, 5, 9, 5, tzinfo=ZONE)),  # passed today: tomorrow's
    ("17:30", datetime(2026, 12, 5, 17, 30, tzinfo=ZONE)),  # now is no longer ahead
    ("2026-12-04T20:00", datetime(2026, 12, 4, 20, 0, tzinfo=ZONE)),
    ("2026-12-04 19:00:00+00:00", datetime(2026, 12, 4, 20, 0, tzinfo=ZONE)),
    (" 20:00 ", datetime(2026, 12, 4, 20, 0, tzinfo=ZONE)),
])
def test_a_time_is_the_next_one_the_clock_shows_or_the_date_given(text: str,
                                                                  when: datetime) -> None:
    assert plan.parse_at(text, NOW) == when


@pytest.mark.parametrize(("text", "why"), [
    ("2026-12-04T17:00", "2026-12-04T17:00+01:00 has passed (it is 2026-12-04T17:30+01:00)"),
    ("2026-12-20T20:00", "2026-12-20T20:00+01:00 is more than 7 days ahead"),
    ("25:00", "'25:00' is not a time of day (HH:MM, 00:00 to 23:59)"),
    ("tonight", "'tonight' is not a time: give HH:MM (the next one) or a date and time, "
                "2026-12-04T20:00"),
    ("20:00; reboot", "'20:00; reboot' is not a time: give HH:MM (the next one) or a date "
                      "and time, 2026-12-04T20:00"),
])
def test_a_time_that_is_past_far_or_garbage_is_refused_with_why(text: str, why: str) -> None:
    with pytest.raises(BadReservation) as info:
        plan.parse_at(text, NOW)
    assert str(info.value) == why


# --- the timeline -----------------------------------------------------------------------

T0 = 1_000_000.0
TIMING = Timing(lead=600, margin=120, expiry=1800)


def test_the_timeline_notice_then_hold_then_expiry() -> None:
    r = Reservation(vm="gaming1", at=T0 + 3600, by="me", made=T0)
    assert plan.next_wake([r], TIMING) == T0 + 3000  # the notice, lead before the time
    assert not plan.due([r], T0 + 2999, TIMING)
    assert plan.due([r], T0 + 3000, TIMING).notify == (r,)
    # The notice says when: the time less the pods' longest grace and the margin.
    evict = plan.evict_time(r, 300, TIMING, T0 + 3000)
    assert evict == T0 + 3600 - 300 - 120
    told = replace(r, evict_at=evict)
    assert plan.next_wake([told], TIMING) == evict
    assert plan.due([told], evict, TIMING).hold == (told,)
    holding = replace(told, holding=True)
    assert plan.held([holding]) == {"gaming1"}
    assert plan.next_wake([holding], TIMING) == T0 + 3600  # at its time, it yields
    assert plan.due([holding], T0 + 3600, TIMING).yields == (holding,)
    yielding = replace(holding, yielding=True)
    assert plan.next_wake([yielding], TIMING) == T0 + 3600 + 1800
    assert plan.due([yielding], T0 + 5400, TIMING).expire == (yielding,)
    assert plan.used([holding], {"gaming1"}) == (holding,)
    assert plan.used([told], {"gaming1"}) == ()  # playing early uses no reservation
    # A grace longer than the time left: the eviction begins at once, never in the past.
    assert plan.evict_time(r, 7200, TIMING, T0 + 3000) == T0 + 3000


# --- the machine ------------------------------------------------------------------------


def holding(*names: str) -> tuple[Reservation, ...]:
    return tuple(Reservation(vm=n, at=AT, by="me", made=AT, evict_at=AT, holding=True)
                 for n in names)


def test_a_held_reservation_reclaims_gently_and_starts_nobody_and_lends_the_rest() -> None:
    state, actions = go(S(Phase.LENT), Reserve(at=AT, reservations=holding("gaming1")))
    assert (state.phase, actions) == (Phase.DRAINING, [Drain(ticket=state.ticket)])
    assert state.reserved == {"gaming1"}
    # Once it is off, the lendee gets back what the reservation does not hold.
    state, actions = run(replace(state, phase=Phase.STOPPING), LendeeStopped(at=AT + 60))
    assert not any(isinstance(a, StartOwner) for a in actions)
    assert actions == [ScheduleRelend(at=AT + 60 + POLICY.relend_delay)]
    state, actions = go(state, _due(state))
    assert actions == [StartLendee(gpus=gpus(B, C))]


def _due(state: State) -> RelendDue:
    assert state.relend_at is not None
    return RelendDue(at=state.relend_at)


def test_a_reservation_that_ends_lends_its_gpus_again() -> None:
    # Off with gpu-a held: the lend that follows leaves it out; ended, it is lent again.
    state = S(reservations=holding("gaming1"))
    state, actions = go(state, Reserve(at=AT, reservations=holding("gaming1")))
    assert actions == [ScheduleRelend(at=AT + 30)]
    state, actions = go(state, _due(state))
    assert actions == [StartLendee(gpus=gpus(B, C))]
    # Lent with two, the reservation dropped: a regrow takes gpu-a (here by restart).
    state = S(Phase.LENT, lent=gpus(B, C), reservations=holding("gaming1"), gpu_pods=0)
    state, actions = go(state, Reserve(at=AT, reservations=()))
    assert (state.reserved, actions) == (frozenset(), [ScheduleRelend(at=AT + 30)])


def test_with_hot_unplug_a_held_reservation_takes_only_its_gpu_live() -> None:
    both = replace(POLICY, hotplug=Hotplug.BOTH)
    state, actions = go(S(Phase.LENT), Reserve(at=AT, reservations=holding("gaming1")), both)
    assert (state.phase, actions) == (Phase.LENT, [DetachGpus(ticket=state.ticket,
                                                              gpus=gpus(A))])


def test_a_reservation_not_yet_holding_changes_nothing_for_the_lendee() -> None:
    waiting = (Reservation(vm="gaming1", at=AT + 3600, by="me", made=AT),)
    state, actions = go(S(Phase.LENT), Reserve(at=AT, reservations=waiting))
    assert (state.phase, actions, state.reservations) == (Phase.LENT, [], waiting)


# --- the verb, its timeline and the state file, through the agent -------------------------


async def test_reserve_over_the_control_socket_then_notice_hold_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, fake = make_agent(tmp_path, relend="0.2s")
    await lent(agent, fake)
    clock_at = [time.time()]
    monkeypatch.setattr(clock, "now", lambda: clock_at[0])
    told: list[float] = []

    class Pods(NoCluster):
        async def notice(self, when: Callable[[float], float],
                         message: Callable[[str], str]) -> tuple[float, list[str]]:
            at = when(90.0)  # the longest grace period on the node: 90 s
            told.append(at)
            assert "checkpoint" in message("20:00")
            return at, ["ml/train-0"]

    drains: list[tuple[list[str], float | None]] = []
    caps: list[float | None] = []  # a reservation's pods keep their full grace

    class Drains(NoCluster):
        async def reclaim(self, owners: list[str], *, regrow: bool = False,
                          until: float | None = None, terms: Any = None,
                          **_: Any) -> str | None:
            drains.append((owners, until))
            caps.append(terms.grace_cap)
            return None

    agent.cluster = Drains()
    agent.reservations.cluster = Pods()
    handlers = agent.verbs.handlers()

    async def reserve(**args: Any) -> dict[str, Any]:
        return [r async for r in handlers["reserve"](args)][-1]

    bad = await reserve(vm="gaming9", at="20:00")
    assert bad["ok"] is False and bad["error"].startswith("unknown VM 'gaming9'")
    assert (await reserve(vm="gaming1", at="yesterday"))["error"].startswith(
        "cannot reserve gaming1: 'yesterday' is not a time")
    assert (await reserve(vm="gaming1"))["error"].startswith("reserve gaming1 needs a time")
    assert (await reserve(vm="gaming1", cancel=True))["error"] == (
        "gaming1 has no reservation to cancel")
    at = datetime.fromtimestamp(clock_at[0] + 3600).astimezone().replace(microsecond=0)
    done = await reserve(vm="gaming1", at=at.isoformat(timespec="seconds"))
    assert done["ok"] is True and "gaming1 is reserved for" in done["data"]["message"]
    assert [r["vm"] for r in agent.verbs.status()["reservations"]] == ["gaming1"]
    # On disk before the caller hears it is taken: a restart keeps it.
    saved, _ = persisted.load_state(agent.cfg.state_file)
    assert [(r.vm, r.at) for r in saved.reservations] == [("gaming1", at.timestamp())]

    lead = agent.reservations.timing.lead
    clock_at[0] = at.timestamp() - lead  # the notice
    await agent.reservations.step()
    margin = agent.reservations.timing.margin
    assert told == [at.timestamp() - 90 - margin]
    assert agent.state.phase is Phase.LENT  # only told, not evicted yet
    clock_at[0] = told[0]  # the hold: the reclaim begins, nobody is started
    await agent.reservations.step()
    assert agent.state.reserved == {"gaming1"}
    await until_phase(agent, Phase.OFF)
    assert ("start", "gaming1") not in fake.calls
    # Its drain may take until the reserved time: the pods get their full grace.
    assert drains == [(["gaming1's reservation"], 90 + margin)]
    assert caps == [None]
    # The player's start, at the time: the GPU is free, and the reservation used.
    await fake.start("gaming1")
    await until(lambda: "gaming1" in agent.state.running_owners)
    await agent.reservations.step()
    assert agent.state.reservations == ()


async def test_an_unused_reservation_expires_and_its_gpu_is_lent_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, fake = make_agent(tmp_path, relend="0.2s")
    await lent(agent, fake)
    start = time.time()
    clock_at = [start]
    monkeypatch.setattr(clock, "now", lambda: clock_at[0])
    at = start + 60
    assert (await agent.reservations.reserve("gaming1", at, by="test"))[0]
    clock_at[0] = at  # notice and hold at once (the lead is longer than what is left)
    await agent.reservations.step()
    await agent.reservations.step()
    assert agent.state.reserved == {"gaming1"}
    await until_phase(agent, Phase.OFF)
    await until(lambda: agent.state.phase is Phase.LENT)  # with gpu-b alone
    assert agent.state.lent == {"gpu-b"}
    records: list[tuple[object, str]] = []
    record = journal.record
    def recorded(event: str, message: str, **fields: Any) -> None:
        records.append((fields.get("result"), message))
        record(event, message, **fields)

    monkeypatch.setattr(journal, "record", recorded)
    clock_at[0] = at + agent.reservations.timing.expiry
    await agent.reservations.step()
    assert agent.state.reservations == ()
    assert [m for r, m in records if r == "expired"] == [
        f"nobody started gaming1 by {_hhmm(clock_at[0])}: its reservation for {_hhmm(at)} "
        "expired, and its GPUs are lent again (gpu-a (RTX A, 0000:0a:00.0)); it may be "
        f"reserved again from {_hhmm(clock_at[0] + agent.reservations.timing.cooldown)}"]
    # Lent back: the lendee restarts with both (no [kubernetes]: the regrow does not wait).
    await until(lambda: agent.state.phase is Phase.LENT and agent.state.lent == {
        "gpu-a", "gpu-b"})


async def until_phase(agent: Any, phase: Phase) -> None:
    await until(lambda: agent.state.phase is phase)


def test_reservations_survive_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    kept = (Reservation(vm="gaming1", at=T0 + 60.5, by="ssh key phone", made=T0,
                        evict_at=T0 + 30, holding=True, principal="ssh key SHA256:x",
                        yielding=True, yields_from=T0 + 40),
            Reservation(vm="gaming2", at=T0 + 7200, by="mqtt", made=T0))
    persisted.save_state(path, persisted.State(reservations=kept))
    assert persisted.load_state(path) == (persisted.State(reservations=kept), None)


# --- SSH and MQTT -----------------------------------------------------------------------

VERBS = frozenset({"status", "play", "reserve"})


@pytest.mark.parametrize(("line", "args"), [
    ("reserve gaming1 20:00", {"vm": "gaming1", "at": "20:00"}),
    ("reserve gaming1 2026-12-04T20:00", {"vm": "gaming1", "at": "2026-12-04T20:00"}),
    ("reserve gaming1 cancel", {"vm": "gaming1", "cancel": True}),
])
def test_ssh_reserve_lines(line: str, args: dict[str, Any]) -> None:
    verb, vm = parse_command(line, VERBS)
    assert {"vm": vm} | reserve_args(line) == args and verb == "reserve"


@pytest.mark.parametrize("line", ["reserve gaming1", "reserve gaming1 at 20:00",
                                  "reserve gaming1 20:00;reboot", "play gaming1 20:00",
                                  "reserve gaming1 $(reboot)"])
def test_ssh_reserve_lines_refused(line: str) -> None:
    with pytest.raises(BadCommand):
        parse_command(line, VERBS)


def test_mqtt_reserve_topic() -> None:
    from tests.unit.homeassistant_scaffold import surface
    s = surface()
    assert s.topic("owner", "+", "reserve") in ha.command_topics(s)
    asked = ha.command(s, "hostagent/owner/gaming1/reserve", b"20:00")
    assert asked == ha.Command("reserve", "gaming1", "20:00")
    assert isinstance(asked, ha.Command) and asked.args == {"vm": "gaming1", "at": "20:00"}
    assert str(asked) == "reserve gaming1 20:00"
    asked = ha.command(s, "hostagent/owner/gaming1/reserve", b"cancel")
    assert isinstance(asked, ha.Command) and asked.args == {"vm": "gaming1", "cancel": True}
    # Only the word: an empty message is a retained one cleared (see test_homeassistant).
    assert isinstance(ha.command(s, "hostagent/owner/gaming1/reserve", b""), ha.Refused)
    refused = ha.command(s, "hostagent/owner/gaming1/reserve", b"rm -rf /")
    assert isinstance(refused, ha.Refused) and "expected HH:MM" in refused.why


def test_another_owner_of_a_reserved_card_is_refused_while_the_reservation_holds() -> None:
    from hostagent.core.machine import IllegalTransition, verdict
    from tests.unit.partial_world import TOPO
    state = S(lent=gpus(B, C), reservations=holding("gaming1"))
    assert verdict(state, "gaming-win", topo=TOPO) == (
        "refuse", "gpu-a is reserved for gaming1 (by me) (follow with: journalctl -u "
                  "hostagent -f)")
    with pytest.raises(IllegalTransition, match="gpu-a is reserved for gaming1"):
        go(state, wants("gaming-win"))
    # The player it holds for starts at once; before it holds, anyone may play.
    assert verdict(state, "gaming1", topo=TOPO)[0] == "proceed"
    early = S(lent=gpus(B, C), reservations=(replace(holding("gaming1")[0], holding=False),))
    assert verdict(early, "gaming-win", topo=TOPO)[0] == "proceed"


async def test_a_restarted_agent_holds_what_its_reservations_held(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    now = float(int(time.time()))  # the state file keeps microseconds
    held = Reservation(vm="gaming1", at=now + 60, by="ssh key phone", made=now,
                       evict_at=now, holding=True)
    persisted.save_state(agent.cfg.state_file, persisted.State(reservations=(held,)))
    again, fake = make_agent(tmp_path)
    assert again.state.reservations == (held,) and again.state.reserved == {"gaming1"}
    # Found running with gpu-a: the reclaim goes on, as for a waiting owner's.
    fake.running.add("gpu-node")
    again.apply(Observed(at=time.time(), lendee_running=True, owners_running=frozenset()))
    assert again.state.phase is Phase.DRAINING


def test_status_says_each_reservation_and_what_it_holds() -> None:
    from hostagent.surfaces.follow import format_status
    now = time.time()
    data = {"lendee": {"domain": "gpu-node", "phase": "lent", "since": now, "hold": False,
                       "reason": None, "lent": ["gpu-b"]},
            "gpus": [], "intents": [], "verified": None, "relend_in_s": None,
            "reservations": [{"vm": "gaming1", "at": now + 600, "by": "mqtt",
                              "holding": True, "evict_at": now, "expires_at": now + 2400}]}
    line = next(x for x in format_status(data).splitlines() if x.startswith("reserved:"))
    assert line == (f"reserved: gaming1 at {_hhmm(now + 600)} by mqtt: its GPUs held for it "
                    f"now; unused, it expires at {_hhmm(now + 2400)}")


async def test_a_reservation_of_a_vm_no_longer_configured_is_dropped(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    now = float(int(time.time()))
    kept = (Reservation(vm="gaming1", at=now + 3600, by="me", made=now),
            Reservation(vm="old-game", at=now + 3600, by="me", made=now))
    persisted.save_state(agent.cfg.state_file, persisted.State(reservations=kept))
    agent.start()  # as a restart reads it
    # Every change of the list is refused while it names a VM that is not an owner.
    assert not agent.apply(Reserve(at=now, reservations=kept))
    await agent.reservations.step()
    assert agent.state.reservations == kept[:1]
