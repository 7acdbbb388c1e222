"""The host as a Home Assistant device over MQTT ([mqtt]; the mapping: `homeassistant`).

The broker never touches the swap. The agent tells the device that something changed
(`Device.changed`: no I/O, a few dictionaries); the device works out the retained
states at once and leaves them to its own task, which publishes them when the broker
takes them. A slow or absent broker therefore delays nothing: what waits is one entry
per topic, the newest value replacing an older one not yet sent (bounded by the
number of topics). The connection is retried with capped backoff, and each connection
starts by publishing discovery and every current state, so a broker restarted
mid-cycle loses nothing it held (and one that lost its retained messages gets them
back).

Commands are the control verbs (`hostagent.service.verbs`), run as the caller ``mqtt``: each
is journaled (``HOSTAGENT_EVENT=control``, ``HOSTAGENT_VIA=mqtt``), and a payload that
is not one of the expected words, a retained command (it would replay at every
connection), or one past `COMMANDS_PER_S` on its topic is refused with a journal
warning and changes nothing. Junk spends no command's budget: each command topic (a
VM's switch, a button) has a budget of its own, taken only by valid commands, so a
flood of garbage or of one VM's presses never costs another its turn. Who may publish
a command at all is the broker's business (its ACL); which verbs and VMs MQTT may
command is ``mqtt.verbs`` and ``mqtt.vms``.

Nothing a broker sends can stop the agent: the client speaks MQTT 5 and tells the
broker its maximum packet size (`MAX_PACKET`), so a larger message is never sent to it
(MQTT 5, 3.1.2.11.4: the server discards it); a retained discovery message is parsed
only within `MAX_PACKET` and `MAX_DEPTH`; and a message that still cannot be handled is
dropped with a rate-limited journal record, its text escaped, the connection kept.

A retained device message is anyone's who may publish under the discovery prefix: of
the entities it lists, only those this device could have made (its ids, platforms and
unique ids) are removed, at most `homeassistant.MAX_REMOVED`. An empty command is a
retained one cleared, and does nothing (a reservation is cancelled by the word
``cancel`` alone).

The client id is ``hostagent-<host>-<random>``, the random part made once and kept in
the state directory (``mqtt-client-id``, mode 0600): a broker user who knew the id
could connect with it, and the broker would drop the agent and publish its will. What
the former default base topic (``hostagent``) held is cleared once per install (the
marker ``mqtt-former-cleared``), not at each connection.
The device id in use is kept with the base topic (`mqtt_kept`), so renaming the host
keeps Home Assistant's device and entities; a publish the broker refuses is journaled.

Availability is the client's last will: ``<base>/availability`` is ``offline`` when the
agent stops or its connection dies, ``online`` while it is connected. When Home
Assistant starts it says ``online`` on ``<prefix>/status``, and discovery is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import secrets
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiomqtt

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from hostagent.surfaces import homeassistant as ha
from hostagent.host import journal, trusted
from hostagent.core.config import Config
from hostagent.surfaces.mqtt_kept import DEVICE_FILE, Client, keep_device, kept_device
from hostagent.surfaces.mqtt_kept import write_private as _write
from hostagent.surfaces.control import CANCEL_ANY, Caller, Reply, VerbHandler, serving
from hostagent.core.ratelimit import Summarised
from hostagent.core.text import bounded_json, clean

__all__ = ["COMMANDS_PER_S", "DEVICE_FILE", "Device"]

log = logging.getLogger("hostagent")

COMMANDS_PER_S = 2.0  # commands taken per second on one topic, on average
COMMANDS_BURST = 10  # at once on one topic, before the rate applies
MAX_PACKET = 256 * 1024  # bytes: the largest packet the broker may send (our own
# device discovery, which comes back retained, is a few kilobytes)
MAX_DEPTH = 16  # arrays and objects in a discovery message (Home Assistant's use 3)
MAX_HISTORY = 32  # values of one phase or transition topic waiting for the broker
MAX_RUNNING = 8  # commands under way at once (a play waits for its VM)
MAX_INCOMING = 64  # messages queued in the client before it reads them
CREDENTIAL = "mqtt-password"  # the systemd credential read when password_file is unset
KEEPALIVE = 30  # seconds; the broker sends the will after 1.5 times this


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hostagent")
    except PackageNotFoundError:
        return "0"


def _cancelled() -> bool:
    """Whether this task was asked to stop. Python 3.11's wait_for (inside aiomqtt) may
    swallow a cancellation that lands as its wait ends; the request still counts."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _stop(task: asyncio.Task[Any]) -> None:
    """Cancel `task` until it ends (see `_cancelled`)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1)


_WORDS = (b"ON", b"OFF", b"PRESS", b"online")  # what a press or a birth message says


def _word(message: Any) -> bool:
    """A press, a birth, or a reservation: what junk must never crowd out."""
    payload = message.payload
    if not isinstance(payload, bytes) or len(payload) > ha.MAX_PAYLOAD:
        return False
    if payload.strip() in _WORDS:
        return True
    return str(message.topic).endswith("/reserve") and \
        ha.reservation(payload.decode("ascii", "replace").strip())


CLIENT_ID_FILE = "mqtt-client-id"  # in the state directory: the client id's random part
FORMER_CLEARED = "mqtt-former-cleared"  # in the state directory: the former base is cleared
_SUFFIX = re.compile(r"[0-9a-f]{24}")


def client_suffix(state_dir: Path) -> tuple[str, str | None]:
    """The random part of the client id, kept in `state_dir` (made the first time, mode
    0600, written atomically) so that it is stable across restarts and unknown to other
    users of the broker; and why it could not be kept (None when it is). Blocking."""
    path = state_dir / CLIENT_ID_FILE
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            kept = f.read(64).strip()
        if _SUFFIX.fullmatch(kept):
            return kept, None
    except FileNotFoundError:
        pass
    except OSError as e:
        return secrets.token_hex(12), f"{path}: {e.strerror or e}"
    suffix = secrets.token_hex(12)
    try:
        _write(path, suffix + "\n")
    except OSError as e:
        return suffix, f"{path}: {e.strerror or e}"
    return suffix, None


def _mark(path: Path) -> None:
    """A marker file; a state directory that cannot take it only means doing it again."""
    try:
        _write(path, "1\n")
    except OSError as e:
        log.warning("mqtt: cannot write %s (%s): the former base topic is cleared again "
                    "at the next start", path, e.strerror or e)


class _Inbound(asyncio.Queue[Any]):
    """The client's queue of messages not read yet. Bounded, but a message that is one
    of the words a press or a birth says never waits behind junk: other messages fill at
    most `maxsize` (more are dropped), those words have as much room again of their own.
    A flood of garbage then costs no press its turn before the budgets see it."""

    def _init(self, maxsize: int) -> None:
        self._queue: deque[Any] = deque()
        self._words = 0

    def full(self) -> bool:
        return False  # put_nowait never refuses: _put keeps or drops

    def _put(self, item: Any) -> None:
        word = _word(item)
        if word and self._words < self.maxsize:
            self._words += 1
            self._queue.append(item)
        elif not word and len(self._queue) - self._words < self.maxsize:
            self._queue.append(item)

    def _get(self) -> Any:
        item = self._queue.popleft()
        if _word(item):
            self._words -= 1
        return item


class Device:
    """The MQTT client of the agent: states out, commands in."""

    def __init__(self, cfg: Config, *, status: Callable[[], dict[str, Any]],
                 handlers: Mapping[str, VerbHandler],
                 follow: Callable[[], contextlib.AbstractContextManager[asyncio.Queue[Reply]]],
                 clock: Callable[[], float] = time.monotonic,
                 hostname: str | None = None) -> None:
        assert cfg.mqtt is not None
        self.settings = cfg.mqtt
        host = ha.host_slug(hostname or socket.gethostname())
        self.surface = ha.surface(cfg, version=_version(), host=host)
        self._former = ha.former(cfg, version=_version())
        # The client id names the host (two hosts on one broker must not share it: the
        # broker closes the older connection of a client id that connects again), and
        # ends with a random part kept in the state directory (`client_suffix`): any
        # broker user who could guess it could take the agent's place and have the
        # broker publish its will, "offline". Set by `run`.
        self._host = host
        self.client_id = f"hostagent-{host}"
        self._former_cleared = False  # the former base topic's, once per install
        self._cfg = cfg
        self._renamed: ha.Surface | None = None  # the base in use before, to clear
        self._keep = False  # the device id and base in use are to be kept (DEVICE_FILE)
        self._state_dir = cfg.state_dir
        self._status = status
        self._handlers = handlers
        self._follow = follow
        self._clock = clock
        self._sentence = "hostagent started"  # an empty retained message would delete it
        self._last: dict[str, Any] | None = None
        self._states: dict[str, str] = {}  # topic -> payload: what the broker should hold
        # What is still to publish, oldest first: topic -> payload, but each value of a
        # topic in HISTORY keyed "<topic>#<n>" (no topic has a '#'), so none is merged away.
        self._pending: dict[str, str] = {}
        self._history = {self.surface.topic("phase", "state"),
                         self.surface.topic("transition", "state"),
                         *(self.surface.topic("lendee", slug, "phase", "state")
                           for slug in self.surface.others)}
        self._sequence = 0
        self._wake = asyncio.Event()
        self._removed: dict[str, str] = {}  # entities of an earlier configuration
        self._budgets: dict[str, tuple[float, float]] = {}  # topic -> (tokens, when)
        self._running: set[asyncio.Task[None]] = set()
        self._sleep: Callable[[float], Any] = asyncio.sleep
        self.connected = False
        self.refusals = Summarised(self._refused_record, interval=10.0, burst=3)
        self.junk = 0  # messages refused as malformed or unexpected
        self.drops = Summarised(self._dropped_record, interval=10.0, burst=3,
                                what="messages dropped")
        self.denied = Summarised(self._denied_record, interval=10.0, burst=3,
                                 what="publishes refused by the broker")

    @property
    def pending(self) -> Mapping[str, str]:
        """What waits for the broker: the newest payload of each topic not yet sent."""
        return {key.partition("#")[0]: payload for key, payload in self._pending.items()}

    # ---- states (on the agent's loop, no I/O) ---------------------------------------
    def changed(self, sentence: str | None = None) -> None:
        """Something changed: recompute the states and queue those that differ."""
        status = self._status()
        said = ha.sentence(self._last, status) or sentence
        self._last = status
        if said:
            self._sentence = said
        states = ha.states(self.surface, status, self._sentence)
        for topic, payload in states.items():
            if self._states.get(topic) != payload:
                key = topic
                if topic in self._history and self.connected:
                    # Each phase is shown, however short: an automation may wait for it.
                    # Bounded: a connection that does not take them ends, and the next
                    # starts from the current states (`_everything`).
                    self._sequence += 1
                    key = f"{topic}#{self._sequence}"
                    mine = [k for k in self._pending if k.partition("#")[0] == topic]
                    for old in mine[:max(0, len(mine) - MAX_HISTORY + 1)]:
                        del self._pending[old]
                self._pending.pop(key, None)  # the newest goes last, in order
                self._pending[key] = payload
        self._states = states
        self._wake.set()

    def _everything(self) -> None:
        """Queue availability, discovery and every state (a new connection, a birth)."""
        self._pending = {self.surface.availability: ha.ONLINE, **self._discovery(),
                         **self._states}
        self._wake.set()

    def _discovery(self) -> dict[str, str]:
        if self.surface.per_entity:
            return ha.entity_configs(self.surface)
        topic, payload = ha.device_config(self.surface, self._removed)
        return {topic: payload}

    # ---- the connection ------------------------------------------------------------------
    async def run(self) -> None:
        """Connect, publish, take commands; again with backoff whenever the link breaks."""
        state_dir = self._state_dir
        suffix, problem = await asyncio.to_thread(client_suffix, state_dir)
        self.client_id = f"hostagent-{self._host}-{suffix}"
        if problem is not None:
            journal.record("mqtt", f"the MQTT client id cannot be kept: {problem}; this run "
                           "uses a random one of its own", result="client-id",
                           priority=journal.Priority.WARNING)
        if self._former is not None:
            self._former_cleared = await asyncio.to_thread(
                (state_dir / FORMER_CLEARED).exists)
        self._adopt(await asyncio.to_thread(kept_device, state_dir))
        try:
            with self._follow() as updates:
                await self._connections(updates)
        finally:
            for task in list(self._running):
                await _stop(task)

    def _adopt(self, kept: tuple[str, str] | None) -> None:
        """Take the device id kept from an earlier run (`mqtt_kept`): on the default base
        topic it stays when the host's name changes, so Home Assistant keeps the device
        and its entities; a base topic that changed is cleared at the next connection."""
        s = self.surface
        if kept is None:
            self._keep = True
            return
        base, node = kept
        if self.settings.base_topic is None and node != s.node:
            s = self.surface = ha.surface(self._cfg, version=_version(), host=self._host,
                                          node=node)
        if base != s.base:
            self._renamed = ha.surface(self._cfg, version=_version(), base=base, node=node)
            kept_id = "keeps its device and entities" if node == s.node else \
                f"is a new device ({s.node}; mqtt.base_topic changed)"
            journal.record("mqtt", f"the base topic was {base} and is now {s.base}: what "
                           f"{base} held is cleared, and Home Assistant's device {node} "
                           f"{kept_id}", result="renamed")
        self._keep = kept != (s.base, s.node)

    async def _connections(self, updates: asyncio.Queue[Reply]) -> None:
        delay, failures = 1.0, 0
        waker = asyncio.get_running_loop().create_task(self._sentences(updates))
        try:
            while not _cancelled():
                try:
                    await self._connection()
                except (aiomqtt.MqttError, OSError, ssl.SSLError) as e:
                    if self.connected:  # a good connection ended: start the backoff anew
                        delay, failures = 1.0, 0
                    failures += 1
                    if failures == 1:
                        journal.record("mqtt", f"the broker {self.settings.broker} is not "
                                       f"reachable ({e}); trying again with backoff up to "
                                       "60s", result="retrying",
                                       priority=journal.Priority.WARNING)
                    else:
                        log.debug("mqtt: %s", e)
                self.connected = False
                if _cancelled():
                    break
                await self._sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 60.0)
        finally:
            await _stop(waker)

    async def _sentences(self, updates: asyncio.Queue[Reply]) -> None:
        """The journal's sentence of each transition (a phase, an intent) as it comes."""
        while True:
            update = await updates.get()
            if isinstance(update.get("message"), str):
                self.changed(update["message"])

    async def _connection(self) -> None:
        s = self.surface
        password = await self._password()
        tls = await asyncio.to_thread(self._tls) if self.settings.tls else None
        host, port = self.settings.address
        connect = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        connect.MaximumPacketSize = MAX_PACKET
        async with Client(
                host, port, username=self.settings.username, password=password,
                refused=self._publish_refused,
                identifier=self.client_id, keepalive=KEEPALIVE, timeout=10,
                will=aiomqtt.Will(s.availability, ha.OFFLINE, qos=1, retain=True),
                tls_context=tls, max_queued_incoming_messages=MAX_INCOMING, queue_type=_Inbound,
                protocol=aiomqtt.ProtocolVersion.V5, properties=connect,
                logger=logging.getLogger("hostagent.surfaces.mqtt")) as client:
            self.connected = True
            journal.record("mqtt", f"connected to {self.settings.broker}: publishing "
                           f"{s.base}/... for Home Assistant", result="connected")
            self._everything()
            if self._former is not None and not self._former_cleared:
                # What the default base_topic published before it named the host: gone
                # first, so that Home Assistant frees its entities' ids for this device's.
                # Once per install (a marker in the state directory), not at each
                # connection: another host still on an old release may publish there.
                for topic, payload in ha.cleared(self._former, self._status()).items():
                    await client.publish(topic, payload, qos=1, retain=True, timeout=10)
                self._former_cleared = True
                await asyncio.to_thread(_mark, self._state_dir / FORMER_CLEARED)
            await self._clear_renamed(client)
            publisher = asyncio.get_running_loop().create_task(self._publish(client))
            try:
                await client.subscribe([(t, 1) for t in (
                    *ha.command_topics(s), s.birth_topic, s.device_topic,
                    ha.entity_topics(s))])
                async for message in client.messages:
                    try:
                        await self._on_message(client, message)
                    except aiomqtt.MqttError:
                        raise  # the link, not the message
                    except Exception as e:  # no message may end the task
                        self._drop(message.topic.value, f"could not be handled: {e!r}")
                    if _cancelled():
                        raise asyncio.CancelledError
            finally:
                await _stop(publisher)
                if self.connected:  # stopping: say so now rather than at the will's delay
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(client.publish(
                            s.availability, ha.OFFLINE, qos=1, retain=True), 2)
        raise aiomqtt.MqttError("the broker closed the connection")

    async def _clear_renamed(self, client: aiomqtt.Client) -> None:
        """What the base topic in use before held, deleted (not what this device still
        publishes: the device message's topic is the same when the id was kept); then
        the base and id in use are kept for the next start."""
        if self._renamed is not None:
            s = self.surface
            current = {s.availability, *self._discovery(), *self._states}
            for topic, payload in ha.cleared(self._renamed, self._status()).items():
                if topic not in current:
                    await client.publish(topic, payload, qos=1, retain=True, timeout=10)
            self._renamed = None
        if self._keep:
            problem = await asyncio.to_thread(keep_device, self._state_dir,
                                              base=self.surface.base, node=self.surface.node)
            self._keep = False
            if problem is not None:
                journal.record("mqtt", f"the device id in use cannot be kept: {problem}; "
                               "if the host is renamed, Home Assistant gets a new device",
                               result="device-id", priority=journal.Priority.WARNING)

    def _publish_refused(self, topic: str, reason: ReasonCode) -> None:
        """The broker's acknowledgement refused a publish: it never reaches Home
        Assistant, and only the broker's own log would say so."""
        self.denied(clean(f"the broker {self.settings.broker} refused the message on "
                          f"{topic}: {reason} (0x{int(reason.value):02X}); Home Assistant "
                          "does not get it. Fix: the broker's ACL lets the agent's user "
                          f"write {self.surface.base}/# and {self.surface.prefix}/#", 600),
                    "refused")

    async def _publish(self, client: aiomqtt.Client) -> None:
        """Send what is pending, oldest first; a value replaced meanwhile goes once."""
        while not _cancelled():
            await self._wake.wait()
            self._wake.clear()
            while self._pending and not _cancelled():
                key = next(iter(self._pending))
                payload = self._pending.pop(key)
                topic = key.partition("#")[0]
                try:
                    await client.publish(topic, payload, qos=1, retain=True, timeout=10)
                except aiomqtt.MqttError:
                    # The link is gone: the next connection sends everything again.
                    return

    async def _password(self) -> str | None:
        path = self.settings.password_file
        if path is None and os.environ.get("CREDENTIALS_DIRECTORY"):
            path = Path(os.environ["CREDENTIALS_DIRECTORY"]) / CREDENTIAL
            if not path.exists():
                return None
        if path is None:
            return None
        try:
            data = await asyncio.to_thread(trusted.read_private, path, limit=4096,
                                           what="the broker's password", noun="password")
            text = data.decode("utf-8")
        except trusted.UnsafeFile as e:
            raise aiomqtt.MqttError(f"refusing the password: {e}") from e
        except (OSError, UnicodeDecodeError) as e:
            raise aiomqtt.MqttError(f"cannot read the password in {path}: "
                                    f"{getattr(e, 'strerror', None) or e}") from e
        return text.rstrip("\r\n")

    def _tls(self) -> ssl.SSLContext:
        ca = self.settings.ca
        return ssl.create_default_context(cafile=str(ca) if ca else None)

    # ---- what comes in ---------------------------------------------------------------
    async def _on_message(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        s, topic = self.surface, message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else (
            str(message.payload).encode() if message.payload is not None else b"")
        if topic == s.birth_topic:
            if payload.strip() == ha.ONLINE.encode():
                self._everything()  # Home Assistant (re)started
            return
        if topic == s.device_topic:
            if payload and s.per_entity:
                await client.publish(topic, b"", qos=1, retain=True)
                return
            try:
                retained = bounded_json(payload, max_bytes=MAX_PACKET, max_depth=MAX_DEPTH) \
                    if payload else None
            except ValueError as e:
                self._drop(topic, f"not a discovery message: {e}")
                return
            room = ha.MAX_REMOVED - len(self._removed)
            if retained is not None and (removed := ha.removals(s, retained, room=room)):
                self._removed.update(removed)
                journal.record("mqtt", "Home Assistant forgets what the configuration no "
                               f"longer has: {', '.join(sorted(removed))}", result="removed")
                self._pending.update(self._discovery())
                self._wake.set()
            return
        if topic.startswith(s.prefix + "/"):
            if payload and ha.stale_entity(s, topic):
                if ha.migrating(s, topic) and payload != ha.MIGRATE:
                    # Home Assistant's migration to device discovery: the old config
                    # hands its entity over, the device config takes it, and only then
                    # is the old one cleared (cleared first, the entity is deleted).
                    await client.publish(topic, ha.MIGRATE, qos=1, retain=True)
                    device, config = ha.device_config(s, self._removed)
                    await client.publish(device, config, qos=1, retain=True)
                await client.publish(topic, b"", qos=1, retain=True)
            return
        self._command(topic, payload, retained=message.retain)

    def _command(self, topic: str, payload: bytes, *, retained: bool) -> None:
        if not payload.strip():
            # A retained command cleared (as a refusal below asks): no command, no noise.
            return
        if retained:
            # Retained, it would run again at every connection.
            self.junk += 1
            self._refuse(f"a retained command on {topic}: publish commands without retain "
                         "(and clear it: an empty retained message)", "retained")
            return
        asked = ha.command(self.surface, topic, payload)
        if isinstance(asked, ha.Refused):
            self.junk += 1  # costs no command its budget: only valid ones spend it
            self._refuse(asked.why, "payload")
            return
        # Only a valid command's topic gets a budget: their number is the configuration's.
        now = self._clock()
        tokens, since = self._budgets.get(topic, (float(COMMANDS_BURST), now))
        tokens = min(COMMANDS_BURST, tokens + (now - since) * COMMANDS_PER_S)
        if tokens < 1:
            self._budgets[topic] = (tokens, now)
            self._refuse(f"{asked} on {topic}: more than {COMMANDS_PER_S:g} per second", "rate")
            return
        self._budgets[topic] = (tokens - 1, now)
        if len(self._running) >= MAX_RUNNING:
            self._refuse(f"{asked}: {MAX_RUNNING} commands are already under way", "busy")
            return
        caller = Caller(user="mqtt", via="mqtt", peer=self.settings.broker,
                        cancel_any=CANCEL_ANY in self.settings.verbs)
        journal.record("control", f"mqtt asked for {asked}", result="allowed",
                       verb=asked.verb, **caller.fields())
        task = asyncio.get_running_loop().create_task(self._run_verb(asked, caller))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_verb(self, asked: ha.Command, caller: Caller) -> None:
        """One verb to its end (a play: until the VM runs or fails); its result journaled."""
        result: Reply = {"ok": False, "error": "no answer"}
        with serving(caller):
            replies: AsyncIterator[Reply] = self._handlers[asked.verb](asked.args)
            async for reply in replies:
                if "ok" in reply:
                    result = reply
        if result.get("ok"):
            message = (result.get("data") or {}).get("message") or "done"
            journal.record("control", f"mqtt: {asked}: {message}", result="ok",
                           verb=asked.verb, **caller.fields())
        else:
            journal.record("control", f"mqtt: {asked} failed: {result.get('error')}",
                           result="failed", verb=asked.verb, **caller.fields(),
                           priority=journal.Priority.WARNING)

    def _refuse(self, why: str, reason: str) -> None:
        self.refusals(clean(f"refused from MQTT: {why}", 600), reason)

    def _drop(self, topic: str, why: str) -> None:
        self.junk += 1
        self.drops(clean(f"dropped a message from the broker on {topic}: {why}", 600), "drop")

    @staticmethod
    def _dropped_record(message: str, count: int, reasons: dict[str, int]) -> None:
        journal.record("mqtt", message, result="dropped", count=count,
                       priority=journal.Priority.WARNING)

    @staticmethod
    def _denied_record(message: str, count: int, reasons: dict[str, int]) -> None:
        journal.record("mqtt", message, result="publish-refused", count=count,
                       priority=journal.Priority.WARNING)

    @staticmethod
    def _refused_record(message: str, count: int, reasons: dict[str, int]) -> None:
        journal.record("control", message, result="refused", via="mqtt", count=count,
                       priority=journal.Priority.WARNING)
