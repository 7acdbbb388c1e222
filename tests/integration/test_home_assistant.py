"""Home Assistant itself, headless, against the device: its MQTT integration creates the
entities from the discovery message, and its switch starts the game.

Home Assistant runs in an interpreter of its own (its 2025.4 releases are the last for
Python 3.13): ``HOSTAGENT_HASS`` names the ``hass`` of a virtual environment with
``homeassistant==2025.4.4``, ``paho-mqtt==2.1.0`` and ``home-assistant-frontend==20250411.0``
(bootstrap loads the frontend whatever the configuration says). Without it the test
skips. The MQTT integration is a config entry written before the first start (it has
no YAML); an automation presses the switch once Home Assistant has started, as a person
would on the dashboard, and another presses "Lend GPUs" once the switch shows the game
running; the entities are read from its registry after a clean stop. The agent's side is the stand-in of tests/unit/surfaces/test_mqtt.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hostagent.core import config
from hostagent.host import journal
from tests.mosquitto import MISSING, USERS, Mosquitto
from tests.waiting import until
from tests.unit.homeassistant_scaffold import CONFIG
from tests.unit.homeassistant_scaffold import Host, device_config, running
from tests.unit.homeassistant_scaffold import (
    ENTITIES,
)

HASS = os.environ.get("HOSTAGENT_HASS") or shutil.which("hass")
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
    pytest.mark.skipif(HASS is None, reason="no Home Assistant: set HOSTAGENT_HASS to the "
                       "hass of a Python 3.13 venv with homeassistant==2025.4.4, "
                       "paho-mqtt==2.1.0 and home-assistant-frontend==20250411.0"),
]
WAIT = 600.0  # Home Assistant's first start on 2 busy cores: a bound, never a measure

CONFIGURATION = """\
homeassistant:
  name: Test
  latitude: 0
  longitude: 0
  elevation: 0
  unit_system: metric
  time_zone: UTC
logger:
  default: warning
  logs:
    homeassistant.components.mqtt: info
automation:
  - alias: the dashboard's switch
    triggers:
      - trigger: homeassistant
        event: start
    actions:
      - wait_template: "{{ states('switch.hostagent_gaming1') in ['on', 'off'] }}"
        timeout: 300
      - action: switch.turn_on
        target:
          entity_id: switch.hostagent_gaming1
  - alias: seen running
    triggers:
      - trigger: state
        entity_id: switch.hostagent_gaming1
        to: "on"
    actions:
      - action: button.press
        target:
          entity_id: button.hostagent_lend_gpus
  # What an automation sees of the phase and of gaming1's switch, each change in order.
  - alias: phases seen
    mode: queued
    max: 100
    triggers:
      - trigger: state
        entity_id: sensor.hostagent_gpu_node_phase
    actions:
      - action: shell_command.seen
        data:
          what: "phase {{ trigger.to_state.state }}"
  - alias: switch seen
    mode: queued
    max: 100
    triggers:
      - trigger: state
        entity_id: switch.hostagent_gaming1
    actions:
      - action: shell_command.seen
        data:
          what: "switch {{ trigger.to_state.state }}"
shell_command:
  seen: /bin/sh -c "echo {{ what }} >> SEEN"
"""


# What Home Assistant's MQTT integration logs (homeassistant/components/mqtt/entity.py):
# an entity handed over to device discovery, unloaded from its old topic once that is
# cleared, or removed with its registry entry when its config is cleared without one.
MIGRATED = r"Migration to MQTT device discovery schema started for entity (\S+)"
UNLOADED = r"Unloading component: (\S+)"
REMOVED = r"Removing component: (\S+)"


def home_assistant(root: Path, broker: Mosquitto) -> Path:
    """A configuration directory with the MQTT integration set up on `broker`."""
    config = root / "homeassistant"
    (config / ".storage").mkdir(parents=True)
    (config / "configuration.yaml").write_text(CONFIGURATION.replace("SEEN", str(root / "seen")))
    now = "2026-01-01T00:00:00+00:00"
    entry = {"entry_id": uuid.uuid4().hex, "version": 1, "minor_version": 2, "domain": "mqtt",
             "title": "mosquitto", "source": "user", "unique_id": None, "disabled_by": None,
             "data": {"broker": "127.0.0.1", "port": broker.port, "username": "ha",
                      "password": USERS["ha"]},
             "options": {"discovery": True, "discovery_prefix": "homeassistant"},
             "pref_disable_new_entities": False, "pref_disable_polling": False,
             "created_at": now, "modified_at": now, "discovery_keys": {}, "subentries": []}
    (config / ".storage" / "core.config_entries").write_text(json.dumps(
        {"version": 1, "minor_version": 5, "key": "core.config_entries",
         "data": {"entries": [entry]}}))
    return config


@dataclass
class Hass:
    """A real Home Assistant on a broker: its configuration directory, its log, its
    process (`stop` ends it cleanly, so that it saves its registries)."""

    broker: Mosquitto
    home: Path
    log: Path
    process: asyncio.subprocess.Process

    def alive(self) -> None:
        assert self.process.returncode is None, self.log.read_text()

    async def until(self, cond: Callable[[], object], what: str) -> None:
        """tests.waiting.until, asked every 0.5 s within WAIT; failed at once, with Home
        Assistant's log, if it has ended."""
        def alive_and() -> object:
            self.alive()
            return cond()
        await until(alive_and, what, timeout=WAIT, every=0.5)

    async def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.process.wait(), 120)


@contextlib.asynccontextmanager
async def home_assistant_on_a_broker(root: Path) -> AsyncIterator[Hass]:
    assert HASS is not None
    broker = Mosquitto(root / "mosquitto")
    broker.start()
    home = home_assistant(root, broker)
    path = root / "home-assistant.log"
    with path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            HASS, "-c", str(home), "--skip-pip", stdout=log, stderr=subprocess.STDOUT)
        try:
            yield Hass(broker, home, path, process)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            broker.stop()


def with_gaming2(broker: Mosquitto) -> config.Config:
    """tests/unit/surfaces/test_mqtt.py's device configuration with README's second owner,
    gaming2, on gpu-c."""
    return config.parse(
        CONFIG.replace("[mqtt]", '[owners.gaming2]\ngpus = ["gpu-c"]\n\n[mqtt]')
        .replace('broker = "mqtt://127.0.0.1"',
                 f'broker = "mqtt://127.0.0.1:{broker.port}"\nusername = "hostagent"\n'
                 f'password_file = "{broker.root / "agent-password"}"'))


def stored(home: Path, name: str) -> Any:
    path = home / ".storage" / name
    return json.loads(path.read_text())["data"] if path.exists() else None


async def test_home_assistant_shows_the_device_and_its_switch_plays(
        tmp_path: Path, sink: journal.ListSink) -> None:
    host = Host()
    host.status["lendee"].update(phase="lent", lent=["gpu-b", "gpu-c"])
    host.status["owners"]["gaming2"] = False
    host.status["gpus"][2]["owners"] = ["gaming2"]
    async with home_assistant_on_a_broker(tmp_path) as hass:
        home = hass.home
        async with running(with_gaming2(hass.broker), host) as device:
            await hass.until(lambda: host.calls, "the automation's press of the switch")
            assert host.calls == [("play", {"vm": "gaming1"})]
            # gaming1's start waits while gpu-node is reclaimed and lent again, each phase
            # within one turn of the loop, until Home Assistant has shown them; then the
            # game runs, and the second automation, which waits for the switch to be on,
            # presses "Lend GPUs".
            host.status["intents"] = [{"owner": "gaming1", "source": "mqtt", "age_s": 0}]
            for phase in ("draining", "stopping", "off", "booting", "joining", "lent"):
                host.status["lendee"]["phase"] = phase
                device.changed()
            await hass.until(lambda: shown_again(tmp_path),
                             "the automation shown draining, then lent as the newest phase")
            host.status["owners"]["gaming1"], host.status["intents"] = True, []
            device.changed()
            await hass.until(lambda: len(host.calls) >= 2, "the automation's press of Lend")
            assert host.calls == [("play", {"vm": "gaming1"}), ("lend", {})]
            await hass.stop()
    registry = stored(home, "core.entity_registry")
    found = {e["entity_id"] for e in registry["entities"] if e["platform"] == "mqtt"}
    assert ENTITIES <= found, sorted(found)
    devices = stored(home, "core.device_registry")["devices"]
    assert [d["name"] for d in devices if ["mqtt", "hostagent"] in d["identifiers"]] == [
        "hostagent"]
    assert [e.message for e in sink.entries if e.fields.get("HOSTAGENT_VIA") == "mqtt"
            and e.fields.get("HOSTAGENT_RESULT") == "allowed"] == [
        "mqtt asked for play gaming1", "mqtt asked for lend"]
    # Every phase reached the automation, in order, however short; the switch went on at
    # the press and stayed on while the start waited (it went back off, then on again).
    phases = [w.split()[1] for w in seen(tmp_path) if w.startswith("phase ")]
    assert phases[phases.index("draining"):] == [
        "draining", "stopping", "off", "booting", "joining", "lent"], phases
    switch = [w.split()[1] for w in seen(tmp_path) if w.startswith("switch ")]
    switch = [s for i, s in enumerate(switch) if s in ("on", "off") and switch[i - 1:i] != [s]]
    assert switch == ["off", "on"], switch


def shown_again(root: Path) -> bool:
    """The automation saw draining, and lent as the newest phase."""
    phases = [w for w in seen(root) if w.startswith("phase ")]
    return "phase draining" in phases and phases[-1] == "phase lent"


def seen(root: Path) -> list[str]:
    """What the recording automations saw, in order."""
    path = root / "seen"
    return path.read_text().splitlines() if path.exists() else []


async def until_logged(hass: Hass, count: int, *patterns: str) -> None:
    """Until Home Assistant's log has `count` lines matching any of `patterns` (bounded)."""
    await hass.until(lambda: sum(len(re.findall(p, hass.log.read_text()))
                                 for p in patterns) >= count,
                     f"{count} lines of Home Assistant's log matching {patterns}")


async def test_home_assistant_keeps_every_entity_from_per_entity_to_device_discovery(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """Turning per_entity off hands each entity over as Home Assistant's migration
    expects: each is migrated, none removed, and the registry keeps them all (clearing
    the old configs outright made Home Assistant remove 11 of 12)."""
    async with home_assistant_on_a_broker(tmp_path) as hass:
        home, path = hass.home, hass.log
        host = Host()
        async with running(device_config(hass.broker, per_entity=True), host):
            # Home Assistant has the entities once its automation pressed the switch and
            # its registry (saved a few seconds after a change) lists them all.
            await hass.until(lambda: host.calls and len(mqtt_entities(home)) >= 12,
                             "the switch pressed and 12 entities in the registry")
        before = mqtt_entities(home)
        async with running(device_config(hass.broker), Host()):
            # Each entity either handed over and then unloaded from its old topic, or
            # removed outright.
            await until_logged(hass, len(before), UNLOADED, REMOVED)
            await hass.stop()
    said = path.read_text()
    assert re.findall(REMOVED, said) == []
    assert sorted(re.findall(MIGRATED, said)) == before
    assert mqtt_entities(home) == before
    deleted = stored(home, "core.entity_registry")["deleted_entities"]
    assert [e["entity_id"] for e in deleted if e["platform"] == "mqtt"] == []


def mqtt_entities(home: Path) -> list[str]:
    """The ids of the MQTT entities in Home Assistant's registry, as last saved."""
    return sorted(e["entity_id"] for e in registered(home))


async def test_an_upgrade_to_the_default_that_names_the_host_keeps_the_entity_ids(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """The default base_topic was "hostagent" on every host; it names the host now, and
    so does the device's id. A host upgraded clears what it published under the former
    default before its new device comes: Home Assistant drops the old entities and gives
    the new ones the same ids, so dashboards and automations keep working."""
    async with home_assistant_on_a_broker(tmp_path) as hass:
        home = hass.home
        async with running(device_config(hass.broker), Host()):  # the former default
            await hass.until(lambda: len(mqtt_entities(home)) >= 12,
                             "12 entities in the registry")
        before = mqtt_entities(home)
        async with running(device_config(hass.broker, text=CONFIG.replace(
                'base_topic = "hostagent"\n', "")), Host(), hostname="tower"):
            await hass.until(lambda: all(e["unique_id"].startswith("hostagent_tower_")
                                         for e in registered(home))
                             and len(registered(home)) >= 12,
                             "12 entities in the registry, each of tower's device")
            await hass.stop()
    assert mqtt_entities(home) == before
    assert "switch.hostagent_gaming1" in before


def registered(home: Path) -> list[dict[str, Any]]:
    """The MQTT entities of Home Assistant's registry, as last saved."""
    registry = stored(home, "core.entity_registry")
    return [e for e in (registry or {}).get("entities", []) if e["platform"] == "mqtt"]


def mqtt_devices(home: Path) -> dict[str, list[list[str]]]:
    """Home Assistant's id of each MQTT device in its registry -> its identifiers."""
    registry = stored(home, "core.device_registry")
    return {d["id"]: d["identifiers"] for d in (registry or {}).get("devices", [])
            if any(i[0] == "mqtt" for i in d["identifiers"])}


async def test_renaming_the_host_keeps_the_device_and_entity_ids(
        tmp_path: Path, sink: journal.ListSink) -> None:
    """On the default base_topic (hostagent/<host>) the device id and the unique ids were
    made from the host's name: renamed, the host became a new device with new entities
    (switch.hostagent_gaming1_2). The id in use is kept in the state directory, and Home
    Assistant follows the states to their new topics on the same device and entities."""
    state = tmp_path / "state"
    state.mkdir()
    async with home_assistant_on_a_broker(tmp_path) as hass:
        home = hass.home
        on_default = device_config(hass.broker, text=f'state_dir = "{state}"\n' + CONFIG.replace(
            'base_topic = "hostagent"\n', ""))
        async with running(on_default, Host(), hostname="tower"):
            await hass.until(lambda: len(registered(home)) >= 12 and mqtt_devices(home),
                             "12 entities and their device in the registries")
        before, devices = registered(home), mqtt_devices(home)
        den = Host()
        den.status["lendee"]["phase"] = "draining"  # published on den's topics only
        async with running(on_default, den, hostname="den"):
            await hass.until(lambda: "phase draining" in seen(tmp_path),
                             "the automation shown den's draining")
            await hass.stop()
    after = registered(home)
    assert sorted((e["entity_id"], e["unique_id"], e["device_id"]) for e in after) == sorted(
        (e["entity_id"], e["unique_id"], e["device_id"]) for e in before)
    assert "switch.hostagent_gaming1" in [e["entity_id"] for e in after]
    assert mqtt_devices(home) == devices
