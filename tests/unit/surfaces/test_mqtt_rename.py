"""A host renamed, and a broker that refuses a publish, against a real mosquitto
(tests/mosquitto.py).

Home Assistant keeps a device by its identifiers (``dev.ids``) and an entity by its
``unique_id``: made from the host's name, both changed with it, and Home Assistant made
a new device with new entities (``switch.hostagent_gaming1_2``), every automation and
dashboard left on the old ones. The broker's refusal of a publish (MQTT 5: a PUBACK
reason code of 0x80 or more; mosquitto 2 answers 0x87 Not authorized for a topic its ACL
denies) was ignored: the state never reached Home Assistant and nothing said why.

Waits are bounded; a negative is read once something that would have come after it
has come."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hostagent.core import config
from hostagent.host import journal
from hostagent.surfaces.mqtt import DEVICE_FILE
from tests.mosquitto import ACL, MISSING, Mosquitto
from tests.unit.homeassistant_scaffold import (
    CONFIG, WAIT, Host, device_config, kept_in, recorded, running, watching)

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def broker(tmp_path: Path) -> Mosquitto:  # type: ignore[misc]
    m = Mosquitto(tmp_path / "mosquitto")
    m.start()
    yield m
    m.stop()


def ids(message: bytes) -> tuple[list[str], dict[str, str]]:
    """The device's identifiers and each entity's unique id, as Home Assistant keys them."""
    parsed = json.loads(message)
    return parsed["dev"]["ids"], {cid: c["uniq_id"] for cid, c in parsed["cmps"].items()}


async def test_renaming_the_host_keeps_the_device_and_its_entities(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = kept_in(broker, state, default=True)
    device_topic = "homeassistant/device/hostagent_tower/config"
    async with watching(broker) as ha:
        async with running(cfg, Host(), hostname="tower"):
            before = ids(await ha.until(device_topic))
            await ha.until("hostagent/tower/phase/state", b"off")
        assert json.loads((state / DEVICE_FILE).read_text())["base"] == "hostagent/tower"
        ha.seen.clear()
        async with running(cfg, Host(), hostname="den"):
            await ha.until("hostagent/den/availability", b"online")
            await ha.until("hostagent/den/phase/state", b"off")
            # The same device message, its states now under the new name.
            async with asyncio.timeout(WAIT):
                while not [p for t, p in ha.seen if t == device_topic and b"hostagent/den/" in p]:
                    ha.changed.clear()
                    await ha.changed.wait()
            message = ha.last[device_topic]
            assert ids(message) == before
            assert json.loads(message)["cmps"]["phase"]["stat_t"] == "hostagent/den/phase/state"
            # What the former name held is deleted, so no stale "offline" or state is left.
            await ha.until("hostagent/tower/phase/state", b"")
            await ha.until("hostagent/tower/availability", b"")
            assert not [t for t, p in ha.seen
                        if t.startswith("homeassistant/device/") and t != device_topic]
        assert json.loads((state / DEVICE_FILE).read_text())["base"] == "hostagent/den"
    renamed = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "renamed"]
    assert renamed and "hostagent/tower" in renamed[0] and "hostagent/den" in renamed[0]


async def test_a_kept_device_file_that_is_not_ours_is_made_again(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    """The file is read bounded and checked: junk there is replaced, not trusted."""
    state = tmp_path / "state"
    cfg = kept_in(broker, state, default=True)
    (state / DEVICE_FILE).write_text('{"base": "x/#", "node": "../../etc"}')
    async with watching(broker) as ha, running(cfg, Host(), hostname="tower"):
        assert ids(await ha.until("homeassistant/device/hostagent_tower/config"))[0] == [
            "hostagent_tower"]
    assert json.loads((state / DEVICE_FILE).read_text()) == {
        "base": "hostagent/tower", "node": "hostagent_tower"}


async def test_a_publish_the_broker_refuses_is_journaled_with_its_reason(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """mosquitto 2's ACL denies the phase's topic: its PUBACK says 0x87 Not authorized,
    and the journal says which topic and why; the other states still go."""
    denied = ACL.replace("user hostagent\n", "user hostagent\ntopic deny hostagent/phase/#\n")
    broker = Mosquitto(tmp_path / "mosquitto", acl=denied)
    broker.start()
    try:
        async with running(kept_in(broker, tmp_path / "state"), Host()), \
                watching(broker) as ha:
            await recorded(sink, "publish-refused")
            await ha.until("hostagent/lent/state", b"OFF")
            assert "hostagent/phase/state" not in ha.last
    finally:
        broker.stop()
    refused = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "publish-refused"]
    assert "hostagent/phase/state" in refused[0].message
    assert "Not authorized" in refused[0].message and "0x87" in refused[0].message
    assert refused[0].priority == journal.Priority.WARNING


async def test_a_base_topic_changed_by_hand_is_a_new_device_and_the_former_one_is_cleared(
        broker: Mosquitto, sink: journal.ListSink, tmp_path: Path) -> None:
    state = tmp_path / "state"

    state.mkdir()

    def by_hand(base: str) -> config.Config:
        return device_config(broker, text=f'state_dir = "{state}"\n' + CONFIG.replace(
            'base_topic = "hostagent"', f'base_topic = "{base}"'))

    async with watching(broker) as ha:
        async with running(by_hand("hostagent/tower"), Host(), hostname="tower"):
            await ha.until("homeassistant/device/hostagent_tower/config")
            await ha.until("hostagent/tower/phase/state", b"off")
        async with running(by_hand("hostagent/attic"), Host(), hostname="tower"):
            await ha.until("homeassistant/device/hostagent_attic/config")
            await ha.until("homeassistant/device/hostagent_tower/config", b"")
            await ha.until("hostagent/tower/phase/state", b"")
    renamed = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "renamed"]
    assert renamed and "is a new device (hostagent_attic" in renamed[0]
