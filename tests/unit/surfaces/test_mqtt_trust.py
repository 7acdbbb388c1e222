"""What another user of the broker can do to the Home Assistant device, against a real
mosquitto (tests/mosquitto.py): forge its retained discovery, take its client id, clear
a retained command; and what the device does once only (clear the former base topic).

Waits are bounded; a negative ("it did not happen") is read once something that would
have come after it has come."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from pathlib import Path

import aiomqtt
import pytest

from hostagent.host import journal
from hostagent.surfaces import homeassistant
from hostagent.surfaces.mqtt import CLIENT_ID_FILE, FORMER_CLEARED
from tests.mosquitto import MISSING, USERS, Mosquitto
from tests.waiting import until
from tests.unit.homeassistant_scaffold import (
    WAIT, Host, device_config, kept_in, running, watching)

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def broker(tmp_path: Path) -> Mosquitto:  # type: ignore[misc]
    m = Mosquitto(tmp_path / "mosquitto")
    m.start()
    yield m
    m.stop()


async def connections(sink: journal.ListSink, n: int) -> None:
    await until(lambda: sum(e.fields.get("HOSTAGENT_RESULT") == "connected"
                            for e in sink.entries) >= n, f"{n} connections recorded",
                timeout=WAIT)


async def test_forged_device_messages_leave_the_discovery_small(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    """Ten forged retained device messages of 1,000 made-up ids each, and one real
    removal in each: the agent removes the ten, and nothing of the rest."""
    topic = "homeassistant/device/hostagent/config"
    async with running(kept_in(broker, tmp_path / "state"), Host()) as device, \
            watching(broker) as ha:
        ours = json.loads(await ha.until(topic))
        for n in range(10):
            cmps = {f"junk{n}_{i}": {"p": "sensor", "uniq_id": f"junk{n}_{i}"}
                    for i in range(1000)}
            cmps[f"owner_old{n}"] = {"p": "switch", "uniq_id": f"hostagent_owner_old{n}"}
            await ha.client.publish(topic, json.dumps({"cmps": cmps}), qos=1, retain=True)
        async with asyncio.timeout(WAIT):
            while json.loads(ha.last[topic]).get("cmps", {}).get("owner_old9") != {
                    "p": "switch"}:
                ha.changed.clear()
                await ha.changed.wait()
        kept = json.loads(ha.last[topic])["cmps"]
        assert not [c for c in kept if c.startswith("junk")]
        assert len(kept) == len(ours["cmps"]) + 10
        assert len(ha.last[topic]) < 2 * len(json.dumps(ours))
        assert len(device._removed) == 10


async def test_the_client_id_is_the_installs_own_and_cannot_be_taken_over(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    """The client id was hostagent-<host>-<base>: any broker user could connect with it,
    the broker dropped the agent and published its will ("offline")."""
    state = tmp_path / "state"
    cfg = kept_in(broker, state)
    async with running(cfg, Host(), hostname="tower") as device, watching(broker) as ha:
        await connections(sink, 1)
        assert re.fullmatch(r"hostagent-tower-[0-9a-f]{24}", device.client_id), device.client_id
        first = device.client_id
        kept = state / CLIENT_ID_FILE
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert first.endswith(kept.read_text().strip())
        assert await ha.until("hostagent/availability") == b"online"
        # What an intruder would guess from the configuration: another client.
        async with aiomqtt.Client("127.0.0.1", broker.port, username="intruder",
                                  password=USERS["intruder"],
                                  identifier="hostagent-tower-hostagent"):
            pass
        await ha.client.publish("hostagent/lend/press", "PRESS", qos=1)
        await recorded_ok(sink)
        assert (b"offline" not in [p for t, p in ha.seen if t == "hostagent/availability"])
        assert sum(e.fields.get("HOSTAGENT_RESULT") == "connected" for e in sink.entries) == 1
    async with running(cfg, Host(), hostname="tower") as again:
        await connections(sink, 2)
        assert again.client_id == first  # stable across restarts


async def recorded_ok(sink: journal.ListSink) -> None:
    await until(lambda: "ok" in [e.fields.get("HOSTAGENT_RESULT") for e in sink.entries
                                 if e.fields.get("HOSTAGENT_VIA") == "mqtt"],
                "an ok record of a command from MQTT", timeout=WAIT)


async def test_clearing_a_retained_reservation_cancels_nothing(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    host = Host()
    async with running(kept_in(broker, tmp_path / "state"), host), watching(broker) as ha:
        await ha.until("hostagent/availability", b"online")
        topic = "hostagent/owner/gaming1/reserve"
        # A retained command cleared, as the agent's refusal of one asks: an empty
        # message, which subscribers get as is.
        await ha.client.publish(topic, b"", qos=1, retain=True)
        await ha.client.publish(topic, "cancel", qos=1)
        async with asyncio.timeout(WAIT):
            await host.called.wait()
        assert host.calls == [("reserve", {"vm": "gaming1", "cancel": True})]


async def test_the_former_base_topic_is_cleared_once(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    """Cleared at every connection, it deleted what a host still on the old release
    published there, again and again."""
    state = tmp_path / "state"
    cfg = kept_in(broker, state, default=True)
    old = homeassistant.surface(device_config(broker), version="0")
    new = "homeassistant/device/hostagent_tower/config"
    # Watched, and the old host's message there, before the agent's first connection:
    # its clearing cannot come before either.
    async with watching(broker) as ha:
        await ha.client.publish(old.device_topic, '{"o": "old"}', qos=1, retain=True)
        await ha.until(old.device_topic, b'{"o": "old"}')
        async with running(cfg, Host(), hostname="tower"):
            await ha.until(new)
            await ha.until(old.device_topic, b"")
    assert (state / FORMER_CLEARED).exists()
    # The broker restarts (it keeps nothing); the old host publishes again before the
    # agent is back (its backoff), and the agent, back, leaves it alone.
    async with running(cfg, Host(), hostname="tower"):
        await connections(sink, 2)
        broker.stop()
        broker.start()
        async with watching(broker) as ha:
            await ha.client.publish(old.device_topic, '{"o": "old"}', qos=1, retain=True)
            await connections(sink, 3)
            await ha.until(new)  # its discovery comes after any clearing
            await ha.until(old.device_topic, b'{"o": "old"}')
            assert (old.device_topic, b"") not in ha.seen
    # Restarted, with the old host's message there first: still left alone.
    async with watching(broker) as ha:
        await ha.until(old.device_topic, b'{"o": "old"}')
        async with running(cfg, Host(), hostname="tower"):
            await connections(sink, 4)
            await ha.until(new)
        assert (old.device_topic, b"") not in ha.seen
