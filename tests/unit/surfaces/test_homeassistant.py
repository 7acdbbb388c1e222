"""The Home Assistant mapping (hostagent.surfaces.homeassistant): discovery, states, commands.

The discovery payloads are checked against Home Assistant's documented MQTT discovery
schema (device-based discovery since 2024.11): the abbreviations it expands, the keys
each platform takes, and what every component needs.
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from hostagent.surfaces import homeassistant as ha
from tests.unit.homeassistant_scaffold import (
    check_component,
    check_device_message,
    CONFIG,
    status,
    surface,
)


def test_the_device_message_follows_the_schema() -> None:
    s = surface()
    topic, payload = ha.device_config(s)
    message = check_device_message(topic, payload)
    assert topic == "homeassistant/device/hostagent/config"
    kinds = {cid: c["p"] for cid, c in message["cmps"].items()}
    assert kinds == {"owner_gaming1": "switch", "owner_gaming_2": "switch",
                     "gpu_gpu-a": "sensor", "gpu_gpu-b": "sensor", "gpu_gpu-c": "sensor",
                     "lent": "binary_sensor", "phase": "sensor", "live_gpus": "sensor",
                     "transition": "sensor", "hold": "switch", "reclaim": "button",
                     "lend": "button", "reserve_gaming1": "text", "reserve_gaming_2": "text",
                     "player_gaming1": "sensor", "player_gaming_2": "sensor"}
    gaming2 = message["cmps"]["owner_gaming_2"]
    assert (gaming2["name"], gaming2["cmd_t"]) == ("gaming/2", "hostagent/owner/gaming_2/set")
    reserve = message["cmps"]["reserve_gaming_2"]
    assert (reserve["cmd_t"], reserve["stat_t"], reserve["min"]) == (
        "hostagent/owner/gaming_2/reserve", "hostagent/owner/gaming_2/reserved", 0)
    assert message["avty_t"] == "hostagent/availability"


def test_per_entity_discovery_follows_the_schema() -> None:
    s = surface(per_entity=True)
    configs = ha.entity_configs(s)
    assert "homeassistant/switch/hostagent/owner_gaming1/config" in configs
    for topic, payload in configs.items():
        message = json.loads(payload)
        platform = topic.split("/")[1]
        check_component({**{k: v for k, v in message.items() if k not in ("dev", "o")},
                         "p": platform})
        assert message["dev"]["ids"] == ["hostagent"]
        assert not ha.stale_entity(s, topic)
    assert ha.stale_entity(s, "homeassistant/switch/hostagent/owner_gaming3/config")
    assert not ha.stale_entity(s, "homeassistant/switch/otherhost/owner_gaming3/config")
    # Device-based again: every per-entity config of this device is stale.
    assert ha.stale_entity(surface(), "homeassistant/switch/hostagent/owner_gaming1/config")


def test_what_mqtt_may_not_command_is_shown_not_offered() -> None:
    s = surface(verbs=["play", "release"], vms=["gaming1"])
    _, payload = ha.device_config(s)
    message = check_device_message(*ha.device_config(s))
    kinds = {cid: c["p"] for cid, c in message["cmps"].items()}
    assert kinds["owner_gaming1"] == "switch"
    assert kinds["owner_gaming_2"] == "binary_sensor"
    assert kinds["hold"] == "binary_sensor"
    assert "reclaim" not in kinds and "lend" not in kinds


def test_a_removed_owner_loses_its_entity() -> None:
    s = surface()
    _, before = ha.device_config(s)
    fewer = surface(CONFIG.replace('[owners."gaming/2"]\ngpus = ["gpu-b"]\n', ""))
    removed = ha.removals(fewer, json.loads(before))
    assert removed == {"owner_gaming_2": "switch", "reserve_gaming_2": "text",
                       "player_gaming_2": "sensor"}
    topic, after = ha.device_config(fewer, removed)
    message = check_device_message(topic, after)
    assert message["cmps"]["owner_gaming_2"] == {"p": "switch"}
    # Once sent, a removal is not sent again; nor is anything for a payload that is not ours.
    assert ha.removals(fewer, json.loads(after)) == {}
    assert ha.removals(fewer, None) == {} and ha.removals(fewer, [1]) == {}
    assert ha.removals(fewer, {"cmps": {"x": 3}}) == {}


def test_states() -> None:
    s = surface()
    out = ha.states(s, status(), "gpu-node is lent: gpu-b, gpu-c are the cluster's")
    assert out == {
        "hostagent/owner/gaming1/state": "ON",
        "hostagent/owner/gaming_2/state": "OFF",
        "hostagent/gpu/gpu-a/state": "gaming1",
        "hostagent/gpu/gpu-a/attributes": json.dumps(
            {"name": "RTX 3050", "owners": ["gaming1"], "pci": "0000:01:00.0"}),
        "hostagent/gpu/gpu-b/state": "gpu-node",
        "hostagent/gpu/gpu-b/attributes": json.dumps(
            {"name": None, "owners": ["gaming/2"], "pci": "0000:02:00.0"}),
        "hostagent/gpu/gpu-c/state": "gpu-node",
        "hostagent/gpu/gpu-c/attributes": json.dumps(
            {"name": None, "owners": [], "pci": "0000:03:00.0"}),
        "hostagent/lent/state": "ON",
        "hostagent/phase/state": "lent",
        "hostagent/live_gpus/state": "gpu-b, gpu-c",
        "hostagent/transition/state": "gpu-node is lent: gpu-b, gpu-c are the cluster's",
        "hostagent/hold/state": "OFF",
        "hostagent/owner/gaming1/reserved": "",
        "hostagent/owner/gaming_2/reserved": "",
        "hostagent/owner/gaming1/player": "running",
        "hostagent/owner/gaming_2/player": "off",
    }
    at = datetime(2026, 12, 4, 20, 0).timestamp()  # the host's zone, as the state says it
    reserved = ha.states(s, {**status(), "reservations": [{"vm": "gaming/2", "at": at}]}, "")
    assert reserved["hostagent/owner/gaming_2/reserved"] == "2026-12-04T20:00"
    off = ha.states(s, status(phase="draining", lent=[], hold=True), "x" * 400)
    assert off["hostagent/lent/state"] == "OFF"
    assert off["hostagent/live_gpus/state"] == "none"
    assert off["hostagent/hold/state"] == "ON"
    assert len(off["hostagent/transition/state"]) == ha.MAX_STATE
    # Every state topic is one an entity reads.
    read = {c.get(k) for c in ha.components(s).values() for k in ("stat_t", "json_attr_t")}
    assert set(out) <= read


def test_owner_sentences() -> None:
    before, after = status(), status()
    after["owners"] = {"gaming1": False, "gaming/2": True}
    assert ha.sentence(None, after) is None
    assert ha.sentence(before, before) is None
    assert ha.sentence(before, after) == "gaming1 stopped; gaming/2 is running"


@pytest.mark.parametrize(("topic", "payload", "expected"), [
    ("hostagent/owner/gaming1/set", b"ON", ha.Command("play", "gaming1")),
    ("hostagent/owner/gaming_2/set", b"OFF", ha.Command("release", "gaming/2")),
    ("hostagent/hold/set", b"ON", ha.Command("hold")),
    ("hostagent/hold/set", b"OFF", ha.Command("lend")),
    ("hostagent/reclaim/press", b"PRESS", ha.Command("reclaim")),
    ("hostagent/lend/press", b" PRESS\n", ha.Command("lend")),
    ("hostagent/owner/gaming1/set", b"on", ha.Refused('"on" on hostagent/owner/gaming1/set: expected ON or OFF')),
    ("hostagent/owner/gaming1/set", b"\xff\x00", ha.Refused('"\\ufffd\\u0000" on hostagent/owner/gaming1/set: expected ON or OFF')),
    ("hostagent/owner/gaming9/set", b"ON", ha.Refused('"ON" on hostagent/owner/gaming9/set, which commands nothing')),
    ("hostagent/reclaim/press", b"x" * 65, ha.Refused("a 65-byte payload on hostagent/reclaim/press (at most 64)")),
    ("elsewhere/reclaim/press", b"PRESS", ha.Refused('"PRESS" on elsewhere/reclaim/press, which commands nothing')),
])
def test_commands(topic: str, payload: bytes, expected: object) -> None:
    assert ha.command(surface(), topic, payload) == expected


def test_commands_mqtt_may_not_give() -> None:
    s = surface(verbs=["play"], vms=["gaming1"])
    assert ha.command(s, "hostagent/owner/gaming1/set", b"ON") == ha.Command("play", "gaming1")
    assert ha.command(s, "hostagent/owner/gaming1/set", b"OFF") == ha.Refused(
        "release on hostagent/owner/gaming1/set: mqtt.verbs does not allow it")
    assert ha.command(s, "hostagent/owner/gaming_2/set", b"ON") == ha.Refused(
        "play gaming/2 on hostagent/owner/gaming_2/set: mqtt.vms does not list gaming/2")
    assert ha.command(s, "hostagent/reclaim/press", b"PRESS") == ha.Refused(
        "reclaim on hostagent/reclaim/press: mqtt.verbs does not allow it")


@pytest.mark.parametrize("lendees", ["one", "two"])
def test_every_command_topic_is_subscribed(lendees: str) -> None:
    s = surface() if lendees == "one" else surface(TWO)
    subscribed = ha.command_topics(s)
    for cmp in ha.components(s).values():
        if "cmd_t" in cmp:
            levels = cmp["cmd_t"].split("/")
            assert any(all(a in ("+", b) for a, b in zip(sub.split("/"), levels, strict=False))
                       and len(sub.split("/")) == len(levels) for sub in subscribed), cmp


def test_names_that_are_not_topic_levels_get_distinct_slugs() -> None:
    text = CONFIG.replace('[owners.gaming1]', '[owners."gaming_2"]')
    s = surface(text)
    assert dict(s.owners) == {"gaming_2": "gaming_2", "gaming_2_2": "gaming/2"}


def test_a_switch_stays_on_while_its_start_waits_for_a_reclaim() -> None:
    """Pressed ON, gaming/2 waits for its GPU while gpu-node is reclaimed: its switch says
    ON from the press on (it said OFF until the VM ran, so Home Assistant's switch went
    back OFF and came ON again), and OFF again if the start fails (the intent is gone)."""
    s = surface()
    topic = "hostagent/owner/gaming_2/state"
    waiting = {**status(phase="reclaiming"), "intents": [
        {"owner": "gaming/2", "source": "hook", "age_s": 3}]}
    assert ha.states(s, waiting, "")[topic] == "ON"
    assert ha.states(s, {**waiting, "intents": []}, "")[topic] == "OFF"
    assert ha.states(s, status(), "")[topic] == "OFF"  # a status without intents


def test_a_forged_device_message_removes_only_what_this_device_made_and_few() -> None:
    """A retained device message is anyone's who may publish on the discovery prefix: it
    once listed 6,000 made-up ids and the agent kept and republished every one (40 such
    messages: 240,000 ids, a 5.2 MB discovery message, the loop blocked 4.3 s)."""
    s = surface()
    forged = {"cmps": {f"x{i}": {"p": "sensor", "name": "junk", "uniq_id": f"x{i}"}
                       for i in range(6000)}}
    assert ha.removals(s, forged) == {}
    # An id this device makes, but not its unique id: not ours either.
    assert ha.removals(s, {"cmps": {"owner_old": {"p": "switch", "uniq_id": "other"}}}) == {}
    mine = {f"owner_old{i}": {"p": "switch", "name": "old", "uniq_id": f"hostagent_owner_old{i}"}
            for i in range(500)}
    removed = ha.removals(s, {"cmps": mine})
    assert len(removed) == ha.MAX_REMOVED and set(removed.values()) == {"switch"}
    assert ha.removals(s, {"cmps": mine}, room=2) == {"owner_old0": "switch",
                                                      "owner_old1": "switch"}
    assert ha.removals(s, {"cmps": mine}, room=0) == {}


def test_only_the_word_cancel_cancels_a_reservation() -> None:
    """Clearing a retained command (an empty message, as the agent's own refusal asks)
    reaches the subscribers as an empty payload: it cancelled the reservation."""
    s = surface()
    for empty in (b"", b" ", b"\n"):
        asked = ha.command(s, "hostagent/owner/gaming1/reserve", empty)
        assert isinstance(asked, ha.Refused), asked
    asked = ha.command(s, "hostagent/owner/gaming1/reserve", b"cancel")
    assert isinstance(asked, ha.Command) and asked.args == {"vm": "gaming1", "cancel": True}
    assert not ha.reservation("") and ha.reservation("cancel") and ha.reservation("20:00")


def test_each_lendee_has_its_entities_and_the_first_keeps_its_ids() -> None:
    """Several lendees: the first keeps lent, phase and live_gpus (an upgrade from one
    lendee keeps its entities in Home Assistant); each other gets its own, by slug."""
    two = CONFIG.replace('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]\n',
                         '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a"]\n'
                         '[lendees."gpu/node-b"]\ngpus = ["gpu-b", "gpu-c"]\n')
    single, s = surface(), surface(two)
    assert set(ha.components(s)) - set(ha.components(single)) == {
        "lent_gpu_node-b", "phase_gpu_node-b", "live_gpus_gpu_node-b", "hold_gpu_node-b",
        "reclaim_gpu_node-b", "lend_gpu_node-b"}
    topic, payload = ha.device_config(s)
    message = check_device_message(topic, payload)
    assert message["cmps"]["phase_gpu_node-b"]["name"] == "gpu/node-b phase"
    data = {**status(lent=["gpu-a"]), "lendees": [
        {"domain": "gpu-node", "phase": "lent", "hold": False, "lent": ["gpu-a"]},
        {"domain": "gpu/node-b", "phase": "stopping", "hold": False, "lent": ["gpu-b"]}]}
    out = ha.states(s, data, "")
    assert out["hostagent/lent/state"] == "ON" and out["hostagent/live_gpus/state"] == "gpu-a"
    assert out["hostagent/lendee/gpu_node-b/lent/state"] == "OFF"
    assert out["hostagent/lendee/gpu_node-b/phase/state"] == "stopping"
    assert out["hostagent/lendee/gpu_node-b/live_gpus/state"] == "gpu-b"
    read = {c.get(k) for c in ha.components(s).values() for k in ("stat_t", "json_attr_t")}
    assert set(out) <= read
    # Back to one lendee: the other's entities are removed, the first's kept.
    assert ha.removals(single, json.loads(payload)) == {
        "lent_gpu_node-b": "binary_sensor", "phase_gpu_node-b": "sensor",
        "live_gpus_gpu_node-b": "sensor", "hold_gpu_node-b": "switch",
        "reclaim_gpu_node-b": "button", "lend_gpu_node-b": "button"}


TWO = CONFIG.replace('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]\n',
                     '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a"]\n'
                     '[lendees."gpu/node-b"]\ngpus = ["gpu-b", "gpu-c"]\n')


def test_each_lendee_has_its_own_hold_reclaim_and_lend() -> None:
    """Several lendees: hold, reclaim and lend for each, under its own topics, each
    command naming its lendee (the first's, on the topics one lendee has, names the
    first: it held every lendee while its state showed the first's alone)."""
    s = surface(TWO)
    cmps = ha.components(s)
    for cmp in cmps.values():
        check_component(cmp)
    assert cmps["hold_gpu_node-b"]["cmd_t"] == "hostagent/lendee/gpu_node-b/hold/set"
    assert cmps["hold_gpu_node-b"]["name"] == "gpu/node-b hold lending"
    assert cmps["reclaim_gpu_node-b"]["name"] == "Reclaim gpu/node-b's GPUs"
    assert cmps["reclaim"]["name"] == "Reclaim gpu-node's GPUs"  # the first's, by name
    assert ha.components(surface())["reclaim"]["name"] == "Reclaim GPUs"
    assert cmps["reclaim_gpu_node-b"]["cmd_t"] == "hostagent/lendee/gpu_node-b/reclaim/press"
    assert cmps["lend_gpu_node-b"]["cmd_t"] == "hostagent/lendee/gpu_node-b/lend/press"
    assert ha.command(s, "hostagent/lendee/gpu_node-b/hold/set", b"ON") == ha.Command(
        "hold", lendee="gpu/node-b")
    assert ha.command(s, "hostagent/lendee/gpu_node-b/hold/set", b"OFF").args == {  # type: ignore[union-attr]
        "lendee": "gpu/node-b"}
    assert ha.command(s, "hostagent/lendee/gpu_node-b/reclaim/press", b"PRESS") == ha.Command(
        "reclaim", lendee="gpu/node-b")
    assert str(ha.Command("reclaim", lendee="gpu/node-b")) == "reclaim --lendee gpu/node-b"
    assert ha.command(s, "hostagent/lendee/gpu_node-b/lend/press", b"PRESS") == ha.Command(
        "lend", lendee="gpu/node-b")
    assert ha.command(s, "hostagent/reclaim/press", b"PRESS") == ha.Command(
        "reclaim", lendee="gpu-node")
    assert ha.command(s, "hostagent/lendee/node-c/lend/press", b"PRESS") == ha.Refused(
        '"PRESS" on hostagent/lendee/node-c/lend/press, which commands nothing')
    assert ha.command(surface(TWO, verbs=["hold"]), "hostagent/lendee/gpu_node-b/reclaim/press",
                      b"PRESS") == ha.Refused("reclaim on hostagent/lendee/gpu_node-b/reclaim/"
                                              "press: mqtt.verbs does not allow it")
    data = {**status(lent=["gpu-a"]), "lendees": [
        {"domain": "gpu-node", "phase": "lent", "hold": False, "lent": ["gpu-a"]},
        {"domain": "gpu/node-b", "phase": "off", "hold": True, "lent": []}]}
    out = ha.states(s, data, "")
    assert out["hostagent/hold/state"] == "OFF"
    assert out["hostagent/lendee/gpu_node-b/hold/state"] == "ON"
    subscribed = ha.command_topics(s)
    assert "hostagent/lendee/+/hold/set" in subscribed
    assert isinstance(ha.command(s, "hostagent/lendee/gpu_node-b/owner/gaming1/set", b"ON"),
                      ha.Refused)
    # One lendee: the topics, ids and commands it always had.
    single = surface()
    assert not any(cid.startswith(("hold_", "reclaim_", "lend_")) for cid in ha.components(single))
    assert ha.command(single, "hostagent/reclaim/press", b"PRESS") == ha.Command("reclaim")
    assert ha.command_topics(single) == [
        "hostagent/owner/+/set", "hostagent/owner/+/reserve", "hostagent/hold/set",
        "hostagent/reclaim/press", "hostagent/lend/press"]
