"""Home Assistant itself, headless, against the device: its MQTT integration creates the
entities from the discovery message, and its switch starts the game.

Home Assistant runs in an interpreter of its own (its 2025.4 releases are the last for
Python 3.13): ``HOSTAGENT_HASS`` names the ``hass`` of a virtual environment with
``homeassistant==2025.4.4``, ``paho-mqtt==2.1.0`` and ``home-assistant-frontend==20250411.0``
(bootstrap loads the frontend whatever the configuration says). Without it the test
skips. The MQTT integration is a config entry written before the first start (it has
no YAML); an automation presses the switch once Home Assistant has started, as a person
would on the dashboard, and another presses "Lend GPUs" once the switch shows the game
running; the entities are read from its registry after a clean stop. The agent's side is the stand-in of tests/unit/test_mqtt.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent import config, journal
from tests.mosquitto import MISSING, USERS, Mosquitto
from tests.unit.test_homeassistant import CONFIG
from tests.unit.test_mqtt import Host, running

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
"""

# What a real discovery creates, README's dashboard card among them
# (tests/packaging/test_readme.py checks that the card names only these): the owner
# "gaming/2" of the unit tests' configuration, and README's gaming2 beside it.
ENTITIES = {
    "switch.hostagent_gaming1", "switch.hostagent_gaming_2", "switch.hostagent_gaming2",
    "sensor.hostagent_gpu_gpu_a", "sensor.hostagent_gpu_gpu_b", "sensor.hostagent_gpu_gpu_c",
    "binary_sensor.hostagent_gpu_node_lent", "sensor.hostagent_gpu_node_phase",
    "sensor.hostagent_gpu_node_gpus", "sensor.hostagent_last_transition",
    "switch.hostagent_hold_lending", "button.hostagent_reclaim_gpus",
    "button.hostagent_lend_gpus",
}


def home_assistant(root: Path, broker: Mosquitto) -> Path:
    """A configuration directory with the MQTT integration set up on `broker`."""
    config = root / "homeassistant"
    (config / ".storage").mkdir(parents=True)
    (config / "configuration.yaml").write_text(CONFIGURATION)
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


@pytest.fixture
def sink() -> Iterator[journal.ListSink]:
    listed = journal.ListSink()
    previous = journal.use_sink(listed)
    yield listed
    journal.use_sink(previous)


def with_gaming2(broker: Mosquitto) -> config.Config:
    """tests/unit/test_mqtt.py's device configuration with README's second owner,
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
    assert HASS is not None
    broker = Mosquitto(tmp_path / "mosquitto")
    broker.start()
    home = home_assistant(tmp_path, broker)
    host = Host()
    host.status["owners"]["gaming2"] = False
    host.status["gpus"][2]["owners"] = ["gaming2"]
    log = (tmp_path / "home-assistant.log").open("wb")
    hass = await asyncio.create_subprocess_exec(HASS, "-c", str(home), "--skip-pip",
                                                stdout=log, stderr=subprocess.STDOUT)
    try:
        async with running(with_gaming2(broker), host) as device:
            async with asyncio.timeout(WAIT):
                while not host.calls:
                    assert hass.returncode is None, (tmp_path / "home-assistant.log").read_text()
                    await asyncio.sleep(0.5)
            assert host.calls == [("play", {"vm": "gaming1"})]
            # The game runs: the switch follows, and the second automation says it saw it.
            host.status["owners"]["gaming1"] = True
            device.changed()
            async with asyncio.timeout(WAIT):
                while len(host.calls) < 2:  # noqa: ASYNC110
                    await asyncio.sleep(0.5)
            assert host.calls == [("play", {"vm": "gaming1"}), ("lend", {})]
            hass.send_signal(signal.SIGTERM)
            await asyncio.wait_for(hass.wait(), 120)
    finally:
        if hass.returncode is None:
            hass.kill()
            await hass.wait()
        log.close()
        broker.stop()
    registry = stored(home, "core.entity_registry")
    found = {e["entity_id"] for e in registry["entities"] if e["platform"] == "mqtt"}
    assert ENTITIES <= found, sorted(found)
    devices = stored(home, "core.device_registry")["devices"]
    assert [d["name"] for d in devices if ["mqtt", "hostagent"] in d["identifiers"]] == [
        "hostagent"]
    assert [e.message for e in sink.entries if e.fields.get("HOSTAGENT_VIA") == "mqtt"
            and e.fields.get("HOSTAGENT_RESULT") == "allowed"] == [
        "mqtt asked for play gaming1", "mqtt asked for lend"]
