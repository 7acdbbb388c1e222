"""The Home Assistant device (hostagent.surfaces.mqtt) against a real mosquitto, with its password
and ACL files (tests/mosquitto.py); the agent's side stood in by a status and verbs.

Waits are bounded (a broken device fails the test rather than hanging it); no
assertion is about how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from hostagent.core import config
from hostagent.host import journal
from hostagent.surfaces import homeassistant
from hostagent.surfaces.mqtt import COMMANDS_BURST, MAX_PACKET, Device
from tests.mosquitto import MISSING, USERS, Mosquitto
from tests.waiting import until
from tests.unit.homeassistant_scaffold import CONFIG, check_device_message, recorded, status
from tests.unit.homeassistant_scaffold import (
    device_config,
    Host,
    running,
    WAIT,
    watching,
)

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    m = Mosquitto(tmp_path / "mosquitto")
    m.start()
    yield m
    m.stop()


def on_the_default(broker: Mosquitto) -> config.Config:
    """device_config with base_topic left to its default (hostagent/<host>)."""
    return device_config(broker, text=CONFIG.replace('base_topic = "hostagent"\n', ""))


async def test_discovery_and_states_are_published_and_follow_changes(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    host = Host()
    async with running(device_config(broker), host) as device, watching(broker) as ha:
        topic = "homeassistant/device/hostagent/config"
        check_device_message(topic, (await ha.until(topic)).decode())
        assert await ha.until("hostagent/availability") == b"online"
        assert await ha.until("hostagent/owner/gaming1/state") == b"OFF"
        assert await ha.until("hostagent/phase/state") == b"off"
        host.status["owners"]["gaming1"] = True
        host.status["lendee"]["phase"] = "draining"
        device.changed()
        await ha.until("hostagent/owner/gaming1/state", b"ON")
        await ha.until("hostagent/transition/state", b"gaming1 is running")
        await ha.until("hostagent/phase/state", b"draining")
        host.progress("gpu-node is drained: shutting it down through its guest agent")
        await ha.until("hostagent/transition/state",
                       b"gpu-node is drained: shutting it down through its guest agent")
    # Stopped: offline at once, not at the will's delay.
    async with watching(broker) as ha:
        assert await ha.until("hostagent/availability") == b"offline"


async def test_every_phase_is_shown_however_short(broker: Mosquitto,
                                                  sink: journal.ListSink) -> None:
    """A reclaim that goes through draining and stopping within one turn of the loop
    still shows each phase, in order: an automation waiting for "draining" sees it (the
    newest value replaced one not yet sent, and Home Assistant saw lent, then off)."""
    host = Host()
    async with running(device_config(broker), host) as device, watching(broker) as ha:
        await ha.until("hostagent/phase/state", b"off")
        for phase in ("booting", "lent", "draining", "stopping", "off"):
            host.status["lendee"]["phase"] = phase
            device.changed()
        await ha.until("hostagent/phase/state", b"off")
        # One more change, on another topic: the device sends in order, so once it is
        # here every phase sent before it is too.
        host.status["lendee"]["hold"] = True
        device.changed()
        await ha.until("hostagent/hold/state", b"ON")
        shown = [p for t, p in ha.seen if t == "hostagent/phase/state"]
        assert shown[-5:] == [b"booting", b"lent", b"draining", b"stopping", b"off"], shown


async def test_two_hosts_on_one_broker_keep_their_connections(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """Two hosts with the same [mqtt] section: each has a client id of its own, and each
    takes the command both are subscribed to (they shared hostagent-<base_topic>, and
    the broker closed the first one's connection when the second came)."""
    cfg = device_config(broker)
    tower, den = Host(), Host()
    async with running(cfg, tower, hostname="tower"), running(cfg, den, hostname="den"):
        await until(lambda: sum(e.fields.get("HOSTAGENT_RESULT") == "connected"
                                for e in sink.entries) >= 2, "both connected", timeout=WAIT)
        # Each has subscribed to the command, each under its own client id.
        await until(lambda: len(broker.subscribed("hostagent/lend/press")) >= 2,
                    "both subscribed to the command", timeout=WAIT)
        async with watching(broker) as ha:
            await ha.client.publish("hostagent/lend/press", "PRESS", qos=1)
            async with asyncio.timeout(WAIT):
                await tower.called.wait()
                await den.called.wait()
    assert tower.calls == den.calls == [("lend", {})]


async def test_two_hosts_on_the_defaults_are_two_devices(broker: Mosquitto,
                                                         sink: journal.ListSink) -> None:
    """On the defaults, each host has its own topics and device id (the base_topic was
    "hostagent" for every host: one device in Home Assistant, their entities merged, and
    each took the other's commands)."""
    cfg = on_the_default(broker)
    tower, den = Host(), Host()
    async with running(cfg, tower, hostname="tower.lan"), running(cfg, den, hostname="den"), \
            watching(broker) as ha:
        for host in ("tower", "den"):
            assert await ha.until(f"hostagent/{host}/availability") == b"online"
            message = json.loads(await ha.until(f"homeassistant/device/hostagent_{host}/config"))
            assert message["dev"]["ids"] == [f"hostagent_{host}"]
            assert message["cmps"]["phase"]["stat_t"] == f"hostagent/{host}/phase/state"
        await ha.client.publish("hostagent/den/lend/press", "PRESS", qos=1)
        async with asyncio.timeout(WAIT):
            await den.called.wait()
        # tower's own command after it: the broker sends each client's messages in order,
        # so den's would have reached tower first.
        await ha.client.publish("hostagent/tower/reclaim/press", "PRESS", qos=1)
        async with asyncio.timeout(WAIT):
            await tower.called.wait()
    assert (tower.calls, den.calls) == ([("reclaim", {})], [("lend", {})])


async def test_what_the_former_default_published_is_cleared_first(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """A host upgraded from the release whose default base_topic was "hostagent": its
    device and states there are deleted (retained, empty) before the new device comes,
    so that Home Assistant drops the old entities and gives their ids to the new ones."""
    old = homeassistant.surface(device_config(broker), version="0")
    async with running(device_config(broker), Host()), watching(broker) as ha:
        await ha.until(old.device_topic)
        await ha.until("hostagent/phase/state")
    async with watching(broker) as ha:
        async with running(on_the_default(broker), Host(), hostname="tower"):
            new = "homeassistant/device/hostagent_tower/config"
            await ha.until(new)
            await ha.until(old.device_topic, b"")
            await ha.until("hostagent/phase/state", b"")
            await ha.until("hostagent/availability", b"")
        order = [t for t, p in ha.seen if (t, p) in ((old.device_topic, b""), (new, ha.last[new]))]
        assert order[:2] == [old.device_topic, new], order
    async with watching(broker) as fresh:  # what the broker keeps of the former: nothing
        await fresh.until(new)
        await fresh.caught_up()  # the retained messages of its subscriptions are all in
        assert not [t for t in fresh.last if t == old.device_topic or
                    t.startswith("hostagent/") and not t.startswith("hostagent/tower/")]


async def test_commands_run_the_verbs_as_mqtt(broker: Mosquitto,
                                               sink: journal.ListSink) -> None:
    host = Host()
    async with running(device_config(broker), host), watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        for topic, payload in [("hostagent/owner/gaming1/set", "ON"),
                               ("hostagent/owner/gaming_2/set", "OFF"),
                               ("hostagent/hold/set", "ON"), ("hostagent/hold/set", "OFF"),
                               ("hostagent/reclaim/press", "PRESS"),
                               ("hostagent/lend/press", "PRESS")]:
            host.called.clear()
            await ha.client.publish(topic, payload, qos=1)
            async with asyncio.timeout(WAIT):
                await host.called.wait()
    assert host.calls == [("play", {"vm": "gaming1"}), ("release", {"vm": "gaming/2"}),
                          ("hold", {}), ("lend", {}), ("reclaim", {}), ("lend", {})]
    asked = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "allowed"]
    assert [e.message for e in asked][:2] == ["mqtt asked for play gaming1",
                                              "mqtt asked for release gaming/2"]
    assert all(e.fields["HOSTAGENT_VIA"] == "mqtt" and e.fields["HOSTAGENT_USER"] == "mqtt"
               and e.fields["HOSTAGENT_EVENT"] == "control" for e in asked)


async def test_bad_payloads_forbidden_clients_and_retained_commands_change_nothing(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    host = Host()
    cfg = device_config(broker, vms=["gaming1"], verbs=["play", "release"])
    async with watching(broker) as ha:
        # Left retained by someone: it would replay at each of the agent's connections.
        await ha.client.publish("hostagent/owner/gaming1/set", "OFF", qos=1, retain=True)
    async with running(cfg, host), watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        async with watching(broker, "intruder") as intruder:
            await intruder.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        for topic, payload in [("hostagent/owner/gaming1/set", "on"),
                               ("hostagent/owner/gaming1/set", "ON" * 40),
                               ("hostagent/owner/gaming_2/set", "ON"),
                               ("hostagent/reclaim/press", "PRESS"),
                               ("hostagent/nothing/set", "ON")]:
            await ha.client.publish(topic, payload, qos=1)
        await ha.client.publish("hostagent/owner/gaming1/set", "", qos=1, retain=True)
        # The broker delivers one publisher's messages in order: once this one has run,
        # every message before it has been handled.
        await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        async with asyncio.timeout(WAIT):
            await host.called.wait()
    assert host.calls == [("play", {"vm": "gaming1"})]
    refused = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "refused"]
    assert refused == [
        "refused from MQTT: a retained command on hostagent/owner/gaming1/set: publish commands without retain (and clear it: an empty retained message)",
        'refused from MQTT: "on" on hostagent/owner/gaming1/set: expected ON or OFF',
        "refused from MQTT: a 80-byte payload on hostagent/owner/gaming1/set (at most 64)",
    ]  # then summarised (burst 3 per 10 s): a loop cannot flood the journal
    assert all(e.priority == journal.Priority.WARNING for e in sink.entries
               if e.fields.get("HOSTAGENT_RESULT") == "refused")


async def test_commands_past_the_rate_are_refused(broker: Mosquitto,
                                                  sink: journal.ListSink) -> None:
    """Each command topic has its budget: a flood of presses on one spends its own, and
    the switch of gaming1 still gets its turn."""
    host = Host()
    # A clock that stands still: no token comes back.
    async with running(device_config(broker), host, clock=lambda: 0.0) as device, \
            watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        for _ in range(COMMANDS_BURST + 5):
            await ha.client.publish("hostagent/hold/set", "ON", qos=1)
        await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        # 3 records, then counted for the summary; and gaming1's press served.
        await until(lambda: device.refusals.held >= 2
                    and ("play", {"vm": "gaming1"}) in host.calls,
                    "two refusals held for the summary and gaming1's press served",
                    timeout=WAIT)
    assert host.calls == [("hold", {})] * COMMANDS_BURST + [("play", {"vm": "gaming1"})]
    refused = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "refused"]
    assert refused == ["refused from MQTT: hold on hostagent/hold/set: more than 2 per second"] * 3


async def test_junk_costs_no_valid_command_its_turn(broker: Mosquitto,
                                                    sink: journal.ListSink) -> None:
    """Garbage on the command topics (words that command nothing, topics of no VM) is
    refused and counted apart: the switch of gaming1 pressed after it is served."""
    host = Host()
    async with running(device_config(broker), host, clock=lambda: 0.0) as device, \
            watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        for i in range(3 * COMMANDS_BURST):
            await ha.client.publish("hostagent/owner/gaming1/set", f"junk{i}", qos=1)
            await ha.client.publish("hostagent/owner/nobody/set", "ON", qos=1)
        await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        await until(lambda: ("play", {"vm": "gaming1"}) in host.calls,
                    "gaming1's press served after the junk", timeout=WAIT)
    assert host.calls == [("play", {"vm": "gaming1"})]
    assert device.junk == 6 * COMMANDS_BURST


async def test_a_reservation_never_waits_behind_junk_in_the_incoming_queue() -> None:
    """The client's queue keeps room for a press, a birth and a reservation whatever junk
    filled it (a reservation was dropped with the junk, as any other message)."""
    from types import SimpleNamespace

    from hostagent.surfaces.mqtt import _Inbound
    queue = _Inbound(maxsize=4)
    for i in range(10):
        queue.put_nowait(SimpleNamespace(topic="hostagent/owner/gaming1/reserve",
                                         payload=f"junk{i}".encode()))
    for payload in (b"20:00", b"2026-12-04T20:00", b"cancel", b"ON"):
        queue.put_nowait(SimpleNamespace(topic="hostagent/owner/gaming1/reserve"
                                         if payload != b"ON" else "hostagent/hold/set",
                                         payload=payload))
    kept = [queue.get_nowait().payload for _ in range(queue.qsize())]
    assert kept == [b"junk0", b"junk1", b"junk2", b"junk3",
                    b"20:00", b"2026-12-04T20:00", b"cancel", b"ON"]


async def test_a_deeply_nested_retained_discovery_message_is_dropped(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """Retained on the agent's own discovery topic, read at every connection: nested
    deep enough to make json.loads raise RecursionError, it ended the MQTT task (and the
    agent, in a crash loop). It is dropped, journaled once, and commands still work."""
    host = Host()
    nested = b"[" * 100_000 + b"]" * 100_000
    async with watching(broker) as ha:
        await ha.client.publish("homeassistant/device/hostagent/config", nested, qos=1,
                                retain=True)
    async with running(device_config(broker), host) as device, watching(broker) as ha:
        await recorded(sink, "dropped")
        await ha.until("hostagent/availability", b"online")
        await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        await until(lambda: ("play", {"vm": "gaming1"}) in host.calls,
                    "gaming1's press served after the dropped message", timeout=WAIT)
        assert device.connected
    dropped = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "dropped"]
    assert dropped == ["dropped a message from the broker on "
                       "homeassistant/device/hostagent/config: not a discovery message: "
                       "nested deeper than 16"]


async def test_a_message_past_the_maximum_packet_size_never_reaches_the_agent(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """The client tells the broker its maximum packet size (MQTT 5): a 2 MB message with
    control characters on the discovery topic is not sent to it at all, so nothing of
    it is read, kept or journaled; the connection and commands go on."""
    host = Host()
    seen: list[int] = []
    big = b"\x1b[2J" + b"x" * (2 * 1024 * 1024)
    async with running(device_config(broker), host) as device, watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        original = device._on_message

        async def counted(client: Any, message: Any) -> None:
            seen.append(len(message.payload))
            await original(client, message)

        device._on_message = counted  # type: ignore[method-assign]
        await ha.client.publish("homeassistant/device/hostagent/config", big, qos=1)
        await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
        await until(lambda: ("play", {"vm": "gaming1"}) in host.calls,
                    "gaming1's press served after the message past the size", timeout=WAIT)
        assert device.connected
    assert seen and max(seen) < MAX_PACKET  # its own discovery, a few kilobytes, comes back
    assert not any("\x1b" in e.message for e in sink.entries)


async def test_the_backoff_starts_anew_after_a_good_connection(
        broker: Mosquitto) -> None:
    """After a connection that worked, the next wait is the first step again, not the
    cap: a broker restarted a few times left the agent waiting 60 s each time."""
    host = Host()
    device = Device(device_config(broker), status=lambda: copy.deepcopy(host.status),
                    handlers=host.handlers(), follow=host.following)
    waits: list[float] = []
    attempts = 0

    async def connection() -> None:
        nonlocal attempts
        attempts += 1
        device.connected = attempts % 4 == 0  # every fourth attempt gets through
        raise aiomqtt.MqttError("the broker closed the connection")

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 12:
            raise asyncio.CancelledError

    device._connection = connection  # type: ignore[method-assign]
    device._sleep = sleep
    with host.following() as updates, contextlib.suppress(asyncio.CancelledError):
        await device._connections(updates)
    # Attempts 4 and 8 connected: the waits after them are back at the first step.
    assert waits[3] <= 1.0 and waits[7] <= 1.0
    assert waits[2] > 2.0 and waits[6] > 2.0


async def test_a_broker_down_at_start_and_restarted_loses_nothing(
        tmp_path: Path, sink: journal.ListSink) -> None:
    broker = Mosquitto(tmp_path / "mosquitto")  # not started yet
    host = Host()
    async with running(device_config(broker), host) as device:
        # Its waits between connections a twentieth as long (`_sleep`, as the backoff's
        # own test replaces it): what is checked is what gets through, not the pace.
        device._sleep = lambda seconds: asyncio.sleep(seconds / 20)
        await recorded(sink, "retrying")
        host.status["lendee"]["phase"] = "booting"
        device.changed()  # while the broker is down: kept, not waited for
        broker.start()
        try:
            async with watching(broker) as ha:
                await ha.until("hostagent/phase/state", b"booting")
                await ha.until("homeassistant/device/hostagent/config")
            broker.stop()  # no persistence: every retained message is gone
            host.status["lendee"]["phase"] = "lent"
            host.status["lendee"]["lent"] = ["gpu-b", "gpu-c"]
            device.changed()
            broker.start()
            async with watching(broker) as ha:
                await ha.until("hostagent/phase/state", b"lent")
                await ha.until("hostagent/live_gpus/state", b"gpu-b, gpu-c")
                await ha.until("hostagent/availability", b"online")
                check_device_message("homeassistant/device/hostagent/config", (await ha.until(
                    "homeassistant/device/hostagent/config")).decode())
        finally:
            broker.stop()


async def test_home_assistant_online_gets_discovery_again(broker: Mosquitto,
                                                          sink: journal.ListSink) -> None:
    host = Host()
    topic = "homeassistant/device/hostagent/config"
    async with running(device_config(broker), host), watching(broker) as ha:
        await ha.until(topic)
        await ha.client.publish(topic, "", qos=1, retain=True)  # forgotten
        await ha.until(topic, b"")
        await ha.client.publish("homeassistant/status", "offline", qos=1)
        await ha.client.publish("homeassistant/status", "online", qos=1)
        async with asyncio.timeout(WAIT):
            while not ha.last[topic]:
                ha.changed.clear()
                await ha.changed.wait()
        check_device_message(topic, ha.last[topic].decode())


async def test_an_owner_removed_from_the_configuration_loses_its_entity(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    topic = "homeassistant/device/hostagent/config"
    async with running(device_config(broker), Host()), watching(broker) as ha:
        before = json.loads(await ha.until(topic))
    assert "owner_gaming_2" in before["cmps"]
    fewer = device_config(broker)
    fewer = config.parse(CONFIG.replace('[owners."gaming/2"]\ngpus = ["gpu-b"]\n', "").replace(
        'broker = "mqtt://127.0.0.1"', f'broker = "{fewer.mqtt.broker if fewer.mqtt else ""}"\n'
        f'username = "hostagent"\npassword_file = "{broker.root / "agent-password"}"'))
    host = Host()
    del host.status["owners"]["gaming/2"]
    async with running(fewer, host), watching(broker) as ha:
        async with asyncio.timeout(WAIT):
            while json.loads(ha.last.get(topic) or b"{}").get("cmps", {}).get(
                    "owner_gaming_2") != {"p": "switch"}:
                ha.changed.clear()
                await ha.changed.wait()
        check_device_message(topic, ha.last[topic].decode())
    assert any("owner_gaming_2" in e.message for e in sink.entries
               if e.fields.get("HOSTAGENT_RESULT") == "removed")


async def test_per_entity_discovery_clears_what_is_no_longer_there(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    device_topic = "homeassistant/device/hostagent/config"
    async with running(device_config(broker), Host()), watching(broker) as ha:
        await ha.until(device_topic)
    stale = "homeassistant/switch/hostagent/owner_gaming9/config"
    async with watching(broker) as ha:
        await ha.client.publish(stale, '{"name": "gaming9"}', qos=1, retain=True)
        async with running(device_config(broker, per_entity=True), Host()):
            await ha.until("homeassistant/switch/hostagent/owner_gaming1/config")
            await ha.until(stale, b"")
            await ha.until(device_topic, b"")


async def test_per_entity_to_device_discovery_migrates_every_entity(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """Home Assistant's migration: each old config gets {"migrate_discovery": true}, then
    the device config comes, then the old config is cleared; cleared first, Home
    Assistant deleted the entity (11 of 12 were lost)."""
    device_topic = "homeassistant/device/hostagent/config"
    old = "homeassistant/switch/hostagent/owner_gaming1/config"
    async with running(device_config(broker, per_entity=True), Host()), watching(broker) as ha:
        await ha.until(old)
    async with watching(broker) as ha:
        async with running(device_config(broker), Host()):
            await ha.until(old, b"")
            await ha.until(device_topic)
        on_old = [p for t, p in ha.seen if t == old]
        assert on_old[-2:] == [b'{"migrate_discovery": true}', b""], on_old
        migrated = ha.seen.index((old, b'{"migrate_discovery": true}'))
        cleared = len(ha.seen) - 1 - ha.seen[::-1].index((old, b""))
        assert any(t == device_topic and p for t, p in ha.seen[migrated:cleared]), \
            "the device config came between the hand-over and the clearing"


async def test_a_wrong_password_is_retried_not_fatal(broker: Mosquitto,
                                                     sink: journal.ListSink) -> None:
    (broker.root / "agent-password").write_text("wrong\n")
    async with running(device_config(broker), Host()):
        await recorded(sink, "retrying")
        (broker.root / "agent-password").write_text(USERS["hostagent"])
        async with watching(broker) as ha:
            await ha.until("hostagent/availability", b"online")
    assert any("Not authorized" in e.message or "not authorised" in e.message.lower()
               for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "retrying")


async def test_a_broker_that_never_answers_delays_nothing_and_holds_one_value_per_topic(
        sink: journal.ListSink) -> None:
    """A broker that takes the connection and says nothing: the device keeps trying in
    its own task, and what waits for it is the newest value of each topic, not a queue
    of every change."""
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    cfg = config.parse(CONFIG.replace('"mqtt://127.0.0.1"', f'"mqtt://127.0.0.1:{port}"'))
    host = Host()
    async with silent, running(cfg, host) as device:
        for n in range(2000):
            host.status["lendee"]["phase"] = ("draining", "stopping", "off")[n % 3]
            host.status["owners"]["gaming1"] = bool(n % 2)
            device.changed()
        assert set(device.pending) <= set(homeassistant.states(device.surface, status(), "x"))
        assert device.pending["hostagent/phase/state"] == "stopping"  # the newest, n = 1999
        assert device.pending["hostagent/owner/gaming1/state"] == "ON"
        assert not device.connected


async def test_the_agent_tells_the_device_each_change_and_runs_its_commands(
        broker: Mosquitto, tmp_path: Path, sink: journal.ListSink) -> None:
    """The agent with a stand-in libvirt (tests/unit/surfaces/test_control.py) and the device
    wired as `hostagent run` wires it: the switch reclaims and starts gaming1, and every
    state follows."""
    from hostagent.service.agent import Agent
    from hostagent.core.model import Phase
    from tests.unit.agents import CONFIG as AGENT, FakeLibvirt, lent

    cfg = config.parse(AGENT.format(root=tmp_path, relend="60s") + (
        f'\n[mqtt]\nbroker = "mqtt://127.0.0.1:{broker.port}"\nusername = "hostagent"\n'
        f'password_file = "{broker.root / "agent-password"}"\nbase_topic = "hostagent"\n'),
        "test.toml")
    agent = Agent(cfg)
    fake = FakeLibvirt(agent)
    agent.libvirt = fake
    agent.start()
    try:
        async with watching(broker) as ha:
            agent._serve_mqtt()
            await lent(agent, fake)
            await ha.until("hostagent/phase/state", b"lent")
            await ha.until("hostagent/live_gpus/state", b"gpu-a, gpu-b")
            await ha.client.publish("hostagent/owner/gaming1/set", "ON", qos=1)
            await until(lambda: "gaming1" in fake.running, timeout=30)
            await ha.until("hostagent/owner/gaming1/state", b"ON")
            await ha.until("hostagent/gpu/gpu-a/state", b"gaming1")
            # Partial lending: gpu-node is lent again with the GPU no game holds.
            await until(lambda: agent.state.phase is Phase.LENT, timeout=30)
            await ha.until("hostagent/live_gpus/state", b"gpu-b")
            await ha.until("hostagent/phase/state", b"lent")
            assert json.loads(await ha.until("hostagent/gpu/gpu-a/attributes")) == {
                "name": "RTX A", "owners": ["gaming1"], "pci": "0000:0a:00.0"}
    finally:
        for task in list(agent.executor.tasks):
            task.cancel()
        await asyncio.gather(*agent.executor.tasks, return_exceptions=True)
    assert agent.ended is None, agent.ended
    assert [e.message for e in sink.entries if e.fields.get("HOSTAGENT_VIA") == "mqtt"
            and e.fields.get("HOSTAGENT_RESULT") == "allowed"] == ["mqtt asked for play gaming1"]


async def test_a_password_file_others_may_read_is_refused_with_the_fix(
        broker: Mosquitto, sink: journal.ListSink) -> None:
    """As an SSH key file: a password others may read is one they may have used."""
    password = broker.root / "agent-password"
    password.chmod(0o644)
    host = Host()
    async with running(device_config(broker), host) as device:
        await recorded(sink, "retrying")
        assert not device.connected
    retrying = next(e.message for e in sink.entries
                    if e.fields.get("HOSTAGENT_RESULT") == "retrying")
    assert (f"refusing the password: {password}: the broker's password readable by group or "
            f"others (mode 0644), so anyone who can read it can use it: chmod 600 {password}, "
            "and replace the password if others may have copied it") in retrying


SHIPPED_ACL = Path(__file__).resolve().parents[3] / "deploy" / "mosquitto.acl"


async def test_the_shipped_acl_lets_each_do_its_part_and_no_more(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """Under deploy/mosquitto.acl the agent (on the defaults, on a host named tower)
    publishes its discovery and states and takes Home Assistant's commands, a reservation
    among them; Home Assistant's user cannot forge the agent's state or availability
    (mosquitto drops the publish), nor publish discovery in its name."""
    broker = Mosquitto(tmp_path / "mosquitto", acl=SHIPPED_ACL.read_text())
    broker.start()
    base, device = "hostagent/tower", "homeassistant/device/hostagent_tower/config"
    try:
        host = Host()
        async with running(on_the_default(broker), host, hostname="tower.lan"), \
                watching(broker, user="homeassistant") as ha:
            await ha.until(f"{base}/availability", b"online")
            phase = await ha.until(f"{base}/phase/state")
            assert await ha.until(device)
            for topic, forged in ((f"{base}/phase/state", b"reclaiming"),
                                  (f"{base}/availability", b"offline"),
                                  (device, b"{}")):
                await ha.client.publish(topic, forged, qos=1, retain=True)
            await ha.client.publish(f"{base}/owner/gaming1/set", "ON", qos=1)
            await ha.client.publish(f"{base}/owner/gaming1/reserve", "20:00", qos=1)
            await until(lambda: ("reserve", {"vm": "gaming1", "at": "20:00"}) in host.calls,
                        "gaming1's reservation for 20:00 served", timeout=WAIT)
            assert ("play", {"vm": "gaming1"}) in host.calls
        # A fresh reader sees what the broker kept: the agent's, not the forgeries.
        async with watching(broker, user="homeassistant") as again:
            assert await again.until(f"{base}/phase/state") == phase
            assert await again.until(device) != b"{}"
    finally:
        broker.stop()


async def test_each_lendee_is_commanded_on_its_own_topics_under_the_shipped_acl(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """Several lendees: a press on the second lendee's reclaim and its hold switch reach
    the verbs naming it, and the first's topics name the first (they held and reclaimed
    every lendee, where the states beside them are the first's alone)."""
    broker = Mosquitto(tmp_path / "mosquitto", acl=SHIPPED_ACL.read_text())
    broker.start()
    base = "hostagent/tower"
    two = CONFIG.replace('base_topic = "hostagent"\n', "").replace(
        'gpus = ["gpu-a", "gpu-b", "gpu-c"]\n', 'gpus = ["gpu-a"]\n'
        '[lendees.gpu-node-b]\ngpus = ["gpu-b", "gpu-c"]\n', 1)
    try:
        host = Host()
        async with running(device_config(broker, text=two), host, hostname="tower.lan"), \
                watching(broker, user="homeassistant") as ha:
            assert await ha.until(f"{base}/lendee/gpu-node-b/hold/state") == b"OFF"
            await ha.client.publish(f"{base}/lendee/gpu-node-b/reclaim/press", "PRESS", qos=1)
            await ha.client.publish(f"{base}/lendee/gpu-node-b/hold/set", "ON", qos=1)
            await ha.client.publish(f"{base}/lend/press", "PRESS", qos=1)
            wanted = [("reclaim", {"lendee": "gpu-node-b"}), ("hold", {"lendee": "gpu-node-b"}),
                      ("lend", {"lendee": "gpu-node"})]
            await until(lambda: all(c in host.calls for c in wanted),
                        "the second lendee's reclaim and hold, and the first's lend, served",
                        timeout=WAIT)
    finally:
        broker.stop()
    asked = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "allowed"]
    assert "mqtt asked for reclaim --lendee gpu-node-b" in asked
