"""What a player sees of their VM in Home Assistant: one sensor per owner with the
transitional states a start goes through ("waiting for the GPU" while the lendee gives
it back, "starting" once libvirt starts the VM), not only the switch's on and off."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hostagent.surfaces import homeassistant as ha
from tests.unit.homeassistant_scaffold import check_device_message, status, surface


def player(extra: dict[str, Any], vm: str = "gaming/2") -> str:
    s = surface()
    data = {**status(), **extra}
    slug = next(k for k, v in s.owners.items() if v == vm)
    return ha.states(s, data, "")[s.topic("owner", slug, "player")]


def test_each_owner_has_a_state_sensor_with_every_state_listed() -> None:
    s = surface()
    topic, payload = ha.device_config(s)
    message = check_device_message(topic, payload)
    sensor = message["cmps"]["player_gaming_2"]
    assert (sensor["p"], sensor["name"], sensor["stat_t"], sensor["dev_cla"]) == (
        "sensor", "gaming/2 state", "hostagent/owner/gaming_2/player", "enum")
    assert sensor["ops"] == ["off", "reserved", "waiting for the GPU", "starting", "running"]
    assert "player_gaming1" in message["cmps"]


def test_the_state_follows_a_start_from_the_request_to_the_game() -> None:
    assert player({}) == "off"
    held = {"reservations": [{"vm": "gaming/2", "at": 1e10, "holding": True}]}
    assert player(held) == "reserved"
    asked = {"intents": [{"owner": "gaming/2", "source": "mqtt", "age_s": 3}]}
    assert player({**held, **asked}) == "waiting for the GPU"
    assert player({**asked, "starting": ["gaming/2"]}) == "starting"
    assert player({**asked, "starting": ["gaming/2"],
                   "owners": {"gaming1": True, "gaming/2": True}}) == "running"
    assert player({}, vm="gaming1") == "running"


async def test_status_lists_the_owners_libvirt_is_starting(tmp_path: Path) -> None:
    from tests.unit.agents import make_agent
    agent, _ = make_agent(tmp_path)
    assert agent.verbs.status()["starting"] == []
    agent.state = dataclasses.replace(agent.state, starting_owners=frozenset({"gaming1"}))
    assert agent.verbs.status()["starting"] == ["gaming1"]
