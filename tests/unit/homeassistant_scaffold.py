"""What the tests of the Home Assistant device and its MQTT share (test_homeassistant.py,
test_mqtt.py, test_mqtt_trust.py, test_fuzz_surfaces.py, tests/integration, the lab's):
a configuration, the discovery message checked as Home Assistant reads it, an agent's
status, a host and a device running against a broker, and a watcher subscribed as Home
Assistant is."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiomqtt

from hostagent.core import config
from hostagent.host import journal
from hostagent.surfaces import homeassistant as ha
from hostagent.surfaces.control import Reply
from hostagent.surfaces.mqtt import Device
from tests.mosquitto import USERS, Mosquitto
from tests.waiting import until


CONFIG = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b", "gpu-c"]

[gpus.gpu-a]
pci = "0000:01:00.0"
name = "RTX 3050"

[gpus.gpu-b]
pci = "0000:02:00.0"

[gpus.gpu-c]
pci = "0000:03:00.0"

[owners.gaming1]
gpus = ["gpu-a"]

[owners."gaming/2"]
gpus = ["gpu-b"]

[mqtt]
broker = "mqtt://127.0.0.1"
base_topic = "hostagent"
"""


# Home Assistant's abbreviations (homeassistant/components/mqtt/abbreviations.py) for
# the keys used here, and the device's and origin's.
ABBREVIATIONS = {
    "avty_t": "availability_topic", "cmd_t": "command_topic", "dev_cla": "device_class",
    "ic": "icon", "json_attr_t": "json_attributes_topic", "ops": "options",
    "pl_avail": "payload_available", "pl_not_avail": "payload_not_available",
    "pl_off": "payload_off", "pl_on": "payload_on", "pl_prs": "payload_press",
    "stat_t": "state_topic", "uniq_id": "unique_id", "name": "name", "qos": "qos",
    "p": "platform", "min": "min", "max": "max",
}


DEVICE = {"ids": "identifiers", "name": "name", "mf": "manufacturer", "mdl": "model",
          "sw": "sw_version"}
ORIGIN = {"name": "name", "sw": "sw_version", "url": "support_url"}


COMMON = {"name", "unique_id", "icon", "availability_topic", "payload_available",
          "payload_not_available", "qos", "json_attributes_topic", "platform"}


# Each platform's own keys (the MQTT integration's documentation, one page per platform).
PLATFORMS = {
    "switch": {"state_topic", "command_topic", "payload_on", "payload_off", "device_class"},
    "binary_sensor": {"state_topic", "payload_on", "payload_off", "device_class"},
    "sensor": {"state_topic", "device_class", "options"},
    "button": {"command_topic", "payload_press", "device_class"},
    "text": {"state_topic", "command_topic", "min", "max", "mode", "pattern"},
}


DEVICE_CLASSES = {"binary_sensor": {"running", "problem", "connectivity"},
                  "sensor": {"enum"}, "switch": {"switch", "outlet"}, "button": {"restart"}}


def check_topic(topic: object, *, wildcards: bool = False) -> None:
    assert isinstance(topic, str) and topic and len(topic.encode()) < 65536
    assert "\0" not in topic
    if not wildcards:
        assert "+" not in topic and "#" not in topic, topic


def check_component(cmp: dict[str, Any]) -> None:
    """One entity's config, abbreviations expanded, as Home Assistant validates it."""
    full = {ABBREVIATIONS[k]: v for k, v in cmp.items()}  # KeyError: a key HA does not know
    platform = full["platform"]
    assert set(full) <= COMMON | PLATFORMS[platform], set(full) - COMMON - PLATFORMS[platform]
    assert isinstance(full["unique_id"], str) and full["unique_id"]
    if platform in ("switch", "button", "text"):
        check_topic(full["command_topic"])
    if platform != "button":
        check_topic(full["state_topic"])
    if "device_class" in full:
        assert full["device_class"] in DEVICE_CLASSES[platform]
    if full.get("device_class") == "enum":
        assert isinstance(full["options"], list) and full["options"]


def check_device_message(topic: str, payload: str) -> dict[str, Any]:
    """A device-based discovery message: <prefix>/device/<id>/config with dev, o, cmps."""
    prefix, kind, node, last = topic.split("/")
    assert (prefix, kind, last) == ("homeassistant", "device", "config")
    assert node.replace("_", "").replace("-", "").isalnum()
    message: dict[str, Any] = json.loads(payload)
    assert {"dev", "o", "cmps"} <= set(message)
    device = {DEVICE[k]: v for k, v in message["dev"].items()}
    assert device["identifiers"] and device["name"]
    origin = {ORIGIN[k]: v for k, v in message["o"].items()}
    assert origin["name"] == "hostagent"
    shared = {ABBREVIATIONS[k] for k in message if k not in ("dev", "o", "cmps")}
    assert shared <= COMMON
    check_topic(message["avty_t"])
    for cmp in message["cmps"].values():
        if set(cmp) != {"p"}:  # a removal
            check_component(cmp)
    uniques = [c["uniq_id"] for c in message["cmps"].values() if "uniq_id" in c]
    assert len(uniques) == len(set(uniques))
    return message


def surface(text: str = CONFIG, **mqtt: Any) -> ha.Surface:
    cfg = config.parse(text + "".join(f"{k} = {json.dumps(v)}\n" for k, v in mqtt.items()))
    return ha.surface(cfg, version="0.1.0")


def status(**lendee: Any) -> dict[str, Any]:
    return {
        "lendee": {"domain": "gpu-node", "phase": "lent", "hold": False,
                   "lent": ["gpu-b", "gpu-c"], **lendee},
        "gpus": [{"gpu": "gpu-a", "name": "RTX 3050", "pci": "0000:01:00.0",
                  "owners": ["gaming1"], "holder": "gaming1"},
                 {"gpu": "gpu-b", "name": None, "pci": "0000:02:00.0",
                  "owners": ["gaming/2"], "holder": "gpu-node"},
                 {"gpu": "gpu-c", "name": None, "pci": "0000:03:00.0", "owners": [],
                  "holder": "gpu-node"}],
        "owners": {"gaming1": True, "gaming/2": False},
    }


WAIT = 30.0  # a bound, never a measure
MARK = "homeassistant/test/mark"  # no device's topic; user ha may publish it


class Host:
    """The agent as the device sees it: a status, the verbs, the progress of each."""

    def __init__(self) -> None:
        self.status = status(phase="off", lent=[])
        self.status["owners"]["gaming1"] = False
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.called = asyncio.Event()
        self.followers: set[asyncio.Queue[Reply]] = set()

    def handlers(self) -> dict[str, Any]:
        def verb(name: str) -> Any:
            async def run(args: dict[str, Any]) -> AsyncIterator[Reply]:
                self.calls.append((name, args))
                self.called.set()
                yield {"ok": True, "data": {"message": f"{name} done"}}
            return run
        return {v: verb(v) for v in ("status", "play", "release", "hold", "lend", "reclaim",
                                     "reserve")}

    @contextlib.contextmanager
    def following(self) -> Iterator[asyncio.Queue[Reply]]:
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self.followers.add(queue)
        try:
            yield queue
        finally:
            self.followers.discard(queue)

    def progress(self, message: str) -> None:
        for queue in self.followers:
            queue.put_nowait({"event": "phase", "message": message})


def device_config(broker: Mosquitto, *, text: str = CONFIG, **mqtt: Any) -> config.Config:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in mqtt.items())
    return config.parse(text.replace('broker = "mqtt://127.0.0.1"',
                                     f'broker = "mqtt://127.0.0.1:{broker.port}"\n'
                                     'username = "hostagent"\n'
                                     f'password_file = "{broker.root / "agent-password"}"')
                        + extra)


@contextlib.asynccontextmanager
async def running(cfg: config.Config, host: Host, **kw: Any) -> AsyncIterator[Device]:
    device = Device(cfg, status=lambda: copy.deepcopy(host.status), handlers=host.handlers(),
                    follow=host.following, **kw)
    device.changed()
    task = asyncio.get_running_loop().create_task(device.run())
    try:
        yield device
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Watcher:
    """A client of the broker as `user`, keeping the last payload of each topic."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.last: dict[str, bytes] = {}
        self.seen: list[tuple[str, bytes]] = []  # every message, in order
        self.changed = asyncio.Event()
        self.marks = 0  # sent by caught_up

    async def read(self) -> None:
        async for message in self.client.messages:
            assert isinstance(message.payload, bytes | bytearray)
            self.last[message.topic.value] = bytes(message.payload)
            self.seen.append((message.topic.value, bytes(message.payload)))
            self.changed.set()

    async def until(self, topic: str, payload: bytes | None = None) -> bytes:
        """The payload of `topic` once it is there (and `payload`, if given)."""
        async with asyncio.timeout(WAIT):
            while topic not in self.last or payload is not None and self.last[topic] != payload:
                self.changed.clear()
                await self.changed.wait()
        return self.last[topic]

    async def caught_up(self) -> None:
        """Until a mark published now (not retained; the user must be let write it)
        comes back to this watcher: every retained message of its subscriptions came
        before it. Mosquitto 2.0.11 queues a subscription's retained messages on the
        client before it sends the SUBACK (src/handle_subscribe.c: retain__queue, then
        send__suback), and appends each message for a client to one list written in
        order (src/database.c: db__message_insert), so a message published after the
        SUBACK comes after them."""
        self.marks += 1
        mark = str(self.marks).encode()
        await self.client.publish(MARK, mark, qos=1)
        await self.until(MARK, mark)


@contextlib.asynccontextmanager
async def watching(broker: Mosquitto, user: str = "ha",
                   topics: tuple[str, ...] = ("hostagent/#", "homeassistant/#")
                   ) -> AsyncIterator[Watcher]:
    async with aiomqtt.Client("127.0.0.1", broker.port, username=user,
                              password=USERS[user], identifier=f"test-{user}") as client:
        for topic in topics:
            await client.subscribe(topic, qos=1)
        watcher = Watcher(client)
        reader = asyncio.get_running_loop().create_task(watcher.read())
        try:
            yield watcher
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


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


async def recorded(sink: journal.ListSink, result: str) -> None:
    """Until the journal has a record with HOSTAGENT_RESULT `result` (bounded)."""
    # The sink has no event to wait on.
    await until(lambda: result in [e.fields.get("HOSTAGENT_RESULT") for e in sink.entries],
                f"a {result!r} record in the journal", timeout=WAIT)


def kept_in(broker: Mosquitto, state: Path, *, default: bool = False) -> config.Config:
    """device_config with a state directory (base_topic its default with `default`)."""
    state.mkdir(exist_ok=True)
    text = CONFIG.replace('base_topic = "hostagent"\n', "") if default else CONFIG
    return device_config(broker, text=f'state_dir = "{state}"\n' + text)
