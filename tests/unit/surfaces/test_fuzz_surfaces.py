"""The surfaces the other fuzz modules leave out, fuzzed: SSH command lines (past the
transport, through the endpoint's own `run`) and MQTT messages (through the device's
own handler, as the client delivers them). Whatever comes in, the surface answers or
refuses, raises nothing, and still serves a valid request afterwards.

Budgets as in test_fuzz_protocols.py (HOSTAGENT_FUZZ_EXAMPLES; `make fuzz` runs more
and prints how many inputs each test tried)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import aiomqtt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.core import config
from hostagent.host import journal
from hostagent.surfaces import ssh
from hostagent.surfaces.mqtt import Device
from hostagent.surfaces.ssh_keys import Grant
from tests.unit.homeassistant_scaffold import CONFIG, status

EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "3_000")) // 3
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

VERBS = ("status", "play", "release", "hold", "lend", "reclaim")
WORDS = [*VERBS, "gaming1", "gaming2", "ON", "OFF", "PRESS", "owner", "set", "press", "hold",
         "hostagent", "homeassistant", "device", "config", "status", "+", "#", ""]


def _text(rng: random.Random, n: int) -> str:
    pools = ("abc-_. 01", "\x00\t\n\r\x1b\"'\\;&|$`", "\u00e9\u2028\ufeff\U0001f600",
             "\ud800\udfff")
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append(rng.choice(WORDS))
        else:
            pool = rng.choice(pools)
            out.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 8))))
    return rng.choice([" ", "/", "  ", "\t"]).join(out)


def _loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


# --- SSH ---------------------------------------------------------------------------------


def _endpoint(tmp: Path, calls: list[tuple[str, dict[str, Any]]]) -> ssh.Endpoint:
    def verb(name: str) -> Any:
        async def run(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            calls.append((name, args))
            yield {"ok": True, "data": {"message": f"{name} done"}}
        return run
    keys = tmp / "authorized_keys"
    keys.write_text("")
    keys.chmod(0o600)
    return ssh.Endpoint({v: verb(v) for v in VERBS}, keys)


@fuzz
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 6))
def test_any_ssh_command_line_is_run_or_refused_with_a_status(seed: int, n: int,
                                                               tmp_path_factory: Any) -> None:
    rng = random.Random(seed)
    line = _text(rng, n)
    if rng.random() < 0.05:
        line = line * rng.randint(10, 400)  # long ones too
    calls: list[tuple[str, dict[str, Any]]] = []
    grant = Grant(key=None, comment="fuzz", fingerprint="SHA256:fuzz",
                  verbs=frozenset({"status", "play"}), vms=frozenset({"gaming1"}), line=1)
    out: list[str] = []
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    try:
        for loop in _loop():
            endpoint = _endpoint(tmp_path_factory.mktemp("ssh"), calls)
            status_ = loop.run_until_complete(
                endpoint.run(grant, "192.0.2.1:1234", line, out.append, out.append))
            assert status_ in set(ssh.ExitStatus)
            if status_ is ssh.ExitStatus.OK:
                [(verb, args)] = calls
                assert line == f"{verb} {args['vm']}" if args else line == verb
            else:
                assert calls == []
            # And the endpoint still serves a valid command.
            assert loop.run_until_complete(endpoint.run(
                grant, "192.0.2.1:1234", "status", out.append, out.append)) is ssh.ExitStatus.OK
    finally:
        journal.use_sink(previous)
    for entry in sink.entries:
        assert entry.message.isprintable(), entry.message


# --- MQTT --------------------------------------------------------------------------------


class _Client:
    """What the device's handler may call on the client: publish (clearing what it must)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []

    async def publish(self, topic: str, payload: Any = None, **_: Any) -> None:
        self.published.append((topic, payload))


def _device(calls: list[tuple[str, dict[str, Any]]]) -> Device:
    def verb(name: str) -> Any:
        async def run(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            calls.append((name, args))
            yield {"ok": True, "data": {"message": f"{name} done"}}
        return run

    @contextlib.contextmanager
    def follow() -> Iterator[asyncio.Queue[Any]]:
        yield asyncio.Queue()

    host = status(phase="lent", lent=["gpu-a"])
    return Device(config.parse(CONFIG), status=lambda: copy.deepcopy(host),
                  handlers={v: verb(v) for v in VERBS}, follow=follow, clock=lambda: 0.0)


_TOPICS = ["hostagent/owner/gaming1/set", "hostagent/owner/x/set", "hostagent/hold/set",
           "hostagent/reclaim/press", "hostagent/lend/press", "homeassistant/status",
           "homeassistant/device/hostagent/config", "homeassistant/switch/hostagent/x/config",
           "hostagent/phase/state"]


def _payload(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.2:
        return rng.choice([b"ON", b"OFF", b"PRESS", b"online", b"", b" ON \n"])
    if kind < 0.4:  # JSON, nested or not
        depth = rng.choice([1, 3, 20, 5000])
        return b"[" * depth + b'{"cmps":{"a":{"p":"switch"}}}' + b"]" * depth
    if kind < 0.5:
        return b'{"cmps": {"' + rng.randbytes(rng.randint(0, 40)).hex().encode() + b'": {"p": 1}}}'
    return rng.randbytes(rng.randint(0, 300))


@fuzz
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 8))
def test_any_mqtt_message_is_taken_refused_or_dropped(seed: int, n: int) -> None:
    rng = random.Random(seed)
    calls: list[tuple[str, dict[str, Any]]] = []
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    try:
        for loop in _loop():
            async def messages() -> None:
                device = _device(calls)
                # What the handler uses of aiomqtt's client, and nothing more.
                client = cast(aiomqtt.Client, _Client())
                for i in range(n):
                    topic = rng.choice(_TOPICS) if rng.random() < 0.7 else _text(rng, 3)
                    # What a broker delivers: a topic name, no wildcard, no NUL.
                    topic = topic.translate({ord("+"): None, ord("#"): None, 0: None}) or "x"
                    topic = topic.encode("utf-8", "replace").decode("utf-8")
                    message = aiomqtt.Message(topic, _payload(rng), qos=1,
                                              retain=rng.random() < 0.2, mid=i, properties=None)
                    await device._on_message(client, message)  # never raises
                await asyncio.sleep(0)
                for task in list(device._running):
                    await task
                # Still takes a valid command.
                before = len(calls)
                await device._on_message(client, aiomqtt.Message(
                    "hostagent/owner/gaming1/set", b"ON", qos=1, retain=False, mid=99,
                    properties=None))
                for task in list(device._running):
                    await task
                assert calls[before:] == [("play", {"vm": "gaming1"})]
            loop.run_until_complete(messages())
    finally:
        journal.use_sink(previous)
    for entry in sink.entries:
        assert entry.message.isprintable(), entry.message
